"""The two passes of the winsorized mean over the cohort's rows (``winsorized.winsorized_mean_rows``):
each block of rows rotated in float64 into reused buffers (``rotated_blocks``); pass 1 takes
every entry's PrivateRange bin (or only their counts per column), the column sums and each
column's min and max (``first_pass``); pass 2, only where some entry lies outside the clip,
sums the clipped entries (``clipped_sums``). The rows are never held rotated whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from fedudp.aggregators.private_range import Binned, Counted, bin_dtype, counts_suffice
from fedudp.aggregators.rows import CohortRows
from fedudp.privacy.mechanisms import RandomRotation

__all__ = ["clipped_sums", "first_pass", "rotated_blocks"]


def rotated_blocks(
    rows: CohortRows, rotation: RandomRotation | None, step: int, k: int
) -> Callable[[], Iterator[tuple[int, torch.Tensor]]]:
    """The passes' blocks: each ``step`` received rows rotated in float64 into reused buffers
    (``RandomRotation.rotate_block``), or copied there (the rows stay unwritten); (start, block).

    Parameters
    ----------
    rows : CohortRows
        The cohort's received rows (private data).
    rotation : RandomRotation or None
        The release's rotation (None: the rows as they are).
    step, k : int
        Rows per block; the (padded) dimension.

    Returns
    -------
    Callable[[], Iterator[tuple[int, torch.Tensor]]]
        A fresh iterator over (start, block ``[<= step, k]``) at each call.
    """
    dev, f64 = rows.device, torch.float64
    out = torch.empty(step, k, dtype=f64, device=dev)
    padded, work = out, out  # the rotation's input and scratch blocks, only where it rotates
    if rotation is not None:
        padded = torch.zeros(step, k, dtype=f64, device=dev)
        work = torch.empty(step, k, dtype=f64, device=dev)

    def blocks() -> Iterator[tuple[int, torch.Tensor]]:
        for s in range(0, rows.received, step):
            X = rows.stored(s, min(rows.received, s + step))
            if rotation is not None:
                yield s, rotation.rotate_block(X, padded, out, work)
            else:
                yield s, out[: len(X)].copy_(X)  # a float64 copy: the rows stay unwritten

    return blocks


def first_pass(
    blocks: Callable[[], Iterator[tuple[int, torch.Tensor]]],
    rows: CohortRows,
    k: int,
    tau: float,
    bound: float,
    step: int,
    count_bins: int,
) -> tuple[Binned | Counted, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 1: every entry's PrivateRange bin (their counts per column where there are at most
    ``count_bins`` bins, else the bins themselves), the column sums and each column's min and
    max (float64), the zero rows past the received ones counted, not rotated.

    Parameters
    ----------
    blocks : Callable[[], Iterator[tuple[int, torch.Tensor]]]
        The rows' blocks (``rotated_blocks``); each is written in place.
    rows : CohortRows
        The cohort's rows (their count ``n`` and how many were received).
    k : int
        The dimension.
    tau, bound : float
        The bins' half width τ and the public bound B.
    step : int
        Rows per block.
    count_bins : int
        The most bins that are counted per column rather than stored.

    Returns
    -------
    tuple[Binned | Counted, torch.Tensor, torch.Tensor, torch.Tensor]
        The bins (or their counts), the column sums, minima and maxima, each ``[k]``.
    """
    n, dev, f64 = rows.n, rows.device, torch.float64
    zeros = n - rows.received  # padding rows: exactly zero after the rotation
    nbins = max(1, math.ceil(bound / tau))
    counting = nbins <= count_bins and counts_suffice(nbins, n)
    stored = bin_dtype(tau, bound)
    v0 = (0.0 + bound) / (2 * tau)  # a zero entry's (Y + B)/(2τ), as the tensors compute it
    if counting:
        at_least = torch.zeros(nbins, k, dtype=torch.int64, device=dev)  # #{v >= j}, j >= 1
        at_least[0] = n
        for j in range(1, nbins):
            at_least[j] = zeros * int(v0 >= j)
    else:
        bins_t = torch.empty(k, n, dtype=stored, device=dev)
        if zeros:
            bins_t[:, rows.received :] = min(max(math.floor(v0), 0), nbins - 1)
    total = torch.zeros(k, dtype=f64, device=dev)  # Σ_i Y_ij, in pass 1's block order
    low = torch.full((k,), 0.0 if zeros else math.inf, dtype=f64, device=dev)
    high = torch.full((k,), 0.0 if zeros else -math.inf, dtype=f64, device=dev)
    ge = torch.empty(step, k, dtype=torch.bool, device=dev)
    for s, Y in blocks():
        r = len(Y)
        total += Y.sum(0)
        torch.minimum(low, Y.amin(0), out=low)  # (amin and amax: 4x faster than aminmax)
        torch.maximum(high, Y.amax(0), out=high)
        Y.add_(bound).div_(2 * tau)  # range_bins' float64 arithmetic, in place on the block
        if counting:
            for j in range(1, nbins):
                at_least[j] += torch.ge(Y, j, out=ge[:r]).sum(0)
        else:
            Y.floor_().clamp_(0, nbins - 1)
            bins_t[:, s : s + r] = Y.T
    if counting:
        hist = at_least - torch.cat([at_least[1:], torch.zeros_like(at_least[:1])])
        X: Binned | Counted = Counted(hist.T.contiguous().cpu(), n)
    else:
        X = Binned(bins_t.cpu())
        del bins_t
    return X, total, low, high


def clipped_sums(
    blocks: Callable[[], Iterator[tuple[int, torch.Tensor]]],
    zeros: int,
    lo: torch.Tensor,
    hi: torch.Tensor,
    k: int,
    dev: torch.device,
) -> tuple[torch.Tensor, int]:
    """Pass 2: each block rotated again, clipped to [lo, hi] and summed (float64), the ``zeros``
    zero rows clipped once; (the clipped sums, how many entries lay outside).

    Parameters
    ----------
    blocks : Callable[[], Iterator[tuple[int, torch.Tensor]]]
        The rows' blocks (``rotated_blocks``).
    zeros : int
        The padding rows (exactly zero).
    lo, hi : torch.Tensor
        Each column's clipping range, ``[k]``.
    k : int
        The dimension.
    dev : torch.device
        Where the sums are kept.

    Returns
    -------
    tuple[torch.Tensor, int]
        The clipped column sums ``[k]`` (float64) and how many entries lay outside.
    """
    f64 = torch.float64
    stat = torch.zeros(k, dtype=f64, device=dev)
    outside = 0
    for _, Y in blocks():
        outside += int(((Y < lo) | (Y > hi)).sum())
        stat += torch.clamp(Y, lo, hi).sum(0)
    if zeros:
        z = torch.zeros((), dtype=f64, device=dev)
        stat += zeros * torch.clamp(z, lo, hi)
        outside += zeros * int(((z < lo) | (z > hi)).sum())
    return stat, outside
