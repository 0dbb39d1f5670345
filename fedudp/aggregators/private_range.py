"""PrivateRange (Levy et al. [LEVY, seed 004] Alg. 6), the private centre of the winsorized
mean (``fedudp.aggregators.winsorized``; docs/algorithms.md#winsorized-mean).

``private_range``: the exponential mechanism over bins of width 2τ of [-B, B] with score
max(#below, #above), sampled run by run (at most 2n+1 runs of equal score per coordinate,
Gumbel-max in log space) so the B/τ bins are never materialized; vectorized over independent
coordinates. It runs on the rows themselves, on their bins (``Binned``) or on the bins' counts
per column (``Counted``), in column blocks of ``range_block`` columns, with the same draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedudp.privacy.mechanisms import exponential_mechanism

__all__ = [
    "HISTOGRAM_BINS",
    "RANGE_ELEMS",
    "Binned",
    "Counted",
    "bin_counts",
    "bin_dtype",
    "counts_suffice",
    "private_range",
    "range_bins",
    "range_block",
    "uniforms_at",
]

RANGE_ELEMS = 1 << 22  # segment weights per PrivateRange block (its columns: range_block)


def range_bins(
    X: torch.Tensor, tau: float, bound: float, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """PrivateRange's bin of each entry of ``X`` (as ``dtype``): l = max(1, ceil(B/τ)) bins of
    width 2τ from -B, values outside [-B, B] in the end bins; computed in float64.

    Parameters
    ----------
    X : torch.Tensor
        The entries.
    tau : float
        τ (bins of width 2τ).
    bound : float
        B.
    dtype : torch.dtype, default torch.int64
        The bins' dtype.

    Returns
    -------
    torch.Tensor
        The bins, shaped as ``X``.
    """
    nbins = max(1, math.ceil(bound / tau))
    return torch.floor((X.to(torch.float64) + bound) / (2 * tau)).clamp(0, nbins - 1).to(dtype)


def bin_dtype(tau: float, bound: float) -> torch.dtype:
    """The smallest integer dtype that holds every bin index (what a stored bin takes).

    Parameters
    ----------
    tau : float
        τ.
    bound : float
        B.

    Returns
    -------
    torch.dtype
        uint8, int16, int32 or int64.
    """
    top = max(1, math.ceil(bound / tau)) - 1
    for dt in (torch.uint8, torch.int16, torch.int32):
        if top <= torch.iinfo(dt).max:
            return dt
    return torch.int64


@dataclass(frozen=True)
class Binned:
    """The columns of an [n, k] matrix as their stored PrivateRange bins ``bins_t`` [k, n]
    (``range_bins`` in any integer dtype): what ``private_range`` needs of them.

    Parameters
    ----------
    bins_t : torch.Tensor
        The bins, [k, n].
    """

    bins_t: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        k, n = self.bins_t.shape
        return (n, k)


@dataclass(frozen=True)
class Counted:
    """The columns of an [n, k] matrix as their PrivateRange bin counts ``hist`` [k, nbins]
    (int64, each row summing to n): all ``private_range`` needs of them where it works from
    counts (at most ``HISTOGRAM_BINS`` bins and at most 2n+1).

    Parameters
    ----------
    hist : torch.Tensor
        The bin counts, [k, nbins] (int64).
    n : int
        The rows (each row of ``hist`` sums to n).
    """

    hist: torch.Tensor
    n: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, int(self.hist.shape[0]))


def private_range(
    X: torch.Tensor | Binned | Counted,
    tau: float,
    bound: float,
    eps: float,
    *,
    rng: torch.Generator,
    chunk_elems: int | None = None,
) -> torch.Tensor:
    """PrivateRange per column of ``X`` [n, k]: the sampled bin centers μ̂ [k] (eps-DP each).

    Bins: l = ceil(B/τ) consecutive bins of width 2τ over [-B, B]; X_i is mapped to its bin
    (values outside [-B, B] to the end bins). Score of a bin x: c(x) = max(#{X' < x}, #{X' > x})
    (sensitivity 1 under replace-one); P(x) ∝ exp(-eps c(x) / 2). Columns are processed in
    blocks of about ``chunk_elems`` segment weights (memory stays O(chunk), not O(n k)).
    ``X`` may be ``Binned`` (the columns' bins, stored) or ``Counted`` (their bin counts): the
    same blocks, draws and μ̂.

    Parameters
    ----------
    X : torch.Tensor, Binned or Counted
        The columns, as values, bins or bin counts.
    tau : float
        τ.
    bound : float
        B.
    eps : float
        The ε of each column.
    rng : torch.Generator
        The release's generator.
    chunk_elems : int or None, default None
        Segment weights per block (None: ``RANGE_ELEMS``).

    Returns
    -------
    torch.Tensor
        μ̂, [k] float64.

    Raises
    ------
    ValueError
        When ``X`` holds bin counts but counts do not suffice for its bins.
    """
    n, k = X.shape
    out = torch.empty(k, dtype=torch.float64)
    cols = range_block(n, chunk_elems)
    nbins = max(1, math.ceil(bound / tau))
    counted = counts_suffice(nbins, n)
    if isinstance(X, Counted) and not counted:
        raise ValueError(f"bin counts suffice only for <= {HISTOGRAM_BINS} and <= 2n+1 bins")
    words = torch.empty(min(k, cols) * (2 * n + 1), dtype=torch.int64) if counted else None
    for c0 in range(0, k, cols):
        if isinstance(X, Counted):
            h = X.hist[c0 : c0 + cols].to(torch.int64)
            out[c0 : c0 + cols] = _range_from_hist(h, n, tau, bound, eps, rng, words)
            continue
        if isinstance(X, Binned):
            b = X.bins_t[c0 : c0 + cols].to(torch.int64)
        else:
            b = range_bins(X[:, c0 : c0 + cols].T.contiguous(), tau, bound)
        if counted:
            out[c0 : c0 + cols] = _range_from_hist(
                bin_counts(b, nbins), n, tau, bound, eps, rng, words
            )
        else:
            out[c0 : c0 + cols] = _range_from_bins(b, tau, bound, eps, rng)
    return out


def counts_suffice(nbins: int, n: int) -> bool:
    """Whether PrivateRange works from bin counts (``_range_from_hist``) rather than sorted
    bins: at most ``HISTOGRAM_BINS`` bins and at most 2n+1.

    Parameters
    ----------
    nbins : int
        The bins.
    n : int
        The rows.

    Returns
    -------
    bool
        At most ``HISTOGRAM_BINS`` and at most 2n+1 bins.
    """
    return nbins <= min(HISTOGRAM_BINS, 2 * n + 1)


def bin_counts(b: torch.Tensor, nbins: int) -> torch.Tensor:
    """Each row's bin counts [k, nbins] (int64) of the bins ``b`` [k, n].

    Parameters
    ----------
    b : torch.Tensor
        The bins, [k, n].
    nbins : int
        The number of bins.

    Returns
    -------
    torch.Tensor
        [k, nbins] int64.
    """
    k = b.shape[0]
    return torch.zeros(k, nbins, dtype=torch.int64).scatter_add_(1, b, torch.ones_like(b))


_MASK53 = (1 << 53) - 1


def uniforms_at(
    rng: torch.Generator, count: int, idx: torch.Tensor, words: torch.Tensor | None = None
) -> torch.Tensor:
    """The float64 values at positions ``idx`` of ``torch.rand(count, generator=rng,
    dtype=torch.float64)``, advancing ``rng`` exactly as that call does, without the other
    values: the CPU generator's double is ((w mod 2^63) & (2^53 - 1)) · 2^-53 of the 64-bit word
    w that ``random_`` on int64 returns as w mod 2^63, so the words are drawn (into ``words``,
    a reusable int64 buffer of >= ``count`` entries) and only the needed ones converted, about
    20 % cheaper than the doubles. ``tests/aggregators/test_rows_throughput.py`` checks the
    values and the generator's state against ``torch.rand``; were the correspondence ever to
    change, these would still be independent uniforms on the 2^-53 grid (the mechanism's
    distribution is unchanged), only no longer ``torch.rand``'s.

    Parameters
    ----------
    rng : torch.Generator
        The generator.
    count : int
        The draw's length.
    idx : torch.Tensor
        The positions.
    words : torch.Tensor or None, default None
        A reusable int64 buffer of at least ``count`` entries for the drawn words.

    Returns
    -------
    torch.Tensor
        The float64 uniforms at ``idx``.
    """
    w = torch.empty(count, dtype=torch.int64) if words is None else words[:count]
    w.random_(generator=rng)
    return (w[idx] & _MASK53).to(torch.float64) * 2.0**-53


HISTOGRAM_BINS = 1 << 12  # at most this many bins (and <= 2n+1): PrivateRange from bin counts


def _range_from_counts(
    b: torch.Tensor, nbins: int, tau: float, bound: float, eps: float, rng: torch.Generator
) -> torch.Tensor:
    """``_range_from_bins`` from each row's bin counts (``_range_from_hist`` of ``bin_counts``):
    the same draws, the same μ̂."""
    return _range_from_hist(bin_counts(b, nbins), b.shape[1], tau, bound, eps, rng)


def _range_from_hist(
    h: torch.Tensor,
    n: int,
    tau: float,
    bound: float,
    eps: float,
    rng: torch.Generator,
    words: torch.Tensor | None = None,
) -> torch.Tensor:
    """``_range_from_bins`` from each row's bin counts h [k, nbins] over n values: the same
    draws, the same μ̂. ``words``: a reusable int64 buffer for the draws (``uniforms_at``).

    ``_range_from_bins`` lays out 2n+1 segments per row in sorted order (n occupied-bin entries,
    of which only a bin's first occurrence has a length, n-1 gaps, before, after) and draws
    Gumbel noise for all of them; a segment of length 0 has weight -inf and never wins. Here
    only the segments of positive length are formed, at most 2·nbins+1 per row, from the
    counts h_b: bin b (if occupied) sits at sorted position C_b = Σ_{b'<b} h_{b'} with cost
    max(C_b, n - C_b - h_b), the gap after it at position n + C_b + h_b - 1 with cost
    max(C_b + h_b, n - C_b - h_b), before and after at 2n-1 and 2n with cost n. The k(2n+1)
    uniforms are still drawn (the generator's order is kept); each segment reads the one at
    its position, its weight and Gumbel value computed by the same float64 operations, and the
    first maximum in position order wins, as ``argmax`` picks it."""
    k, nbins = h.shape
    dt, i64 = torch.float64, torch.int64
    below = torch.cumsum(h, 1) - h  # C_b
    upto = below + h
    occ = h > 0
    ar = torch.arange(nbins, dtype=i64)
    mark = torch.where(occ, ar, torch.full_like(ar, nbins))
    after = torch.flip(torch.cummin(torch.flip(mark, [1]), 1).values, [1])  # min occupied >= b
    nxt = torch.cat([after[:, 1:], torch.full((k, 1), nbins, dtype=i64)], 1)  # > b
    gap = occ & (nxt < nbins) & (nxt > ar + 1)
    first, last = after[:, :1], torch.where(occ, ar, torch.full_like(ar, -1)).amax(1, True)
    # slots in position order: occupied bins, gaps after them, before, after
    pos = torch.cat([below, n + upto - 1, torch.full_like(first, 2 * n - 1), 2 * n + 0 * first], 1)
    ninf = torch.tensor(-math.inf, dtype=dt)
    lens = torch.cat(
        [
            torch.where(occ, 1.0, 0.0).to(dt),
            torch.where(gap, nxt - ar - 1, 0).to(dt),
            first.to(dt),
            (nbins - 1 - last).to(dt),
        ],
        1,
    )
    costs = torch.cat(
        [
            torch.maximum(below, n - upto).to(dt),
            torch.maximum(upto.to(dt), n - upto.to(dt)),
            torch.full_like(first, n, dtype=dt),
            torch.full_like(first, n, dtype=dt),
        ],
        1,
    )
    logw = torch.where(lens > 0, torch.log(lens.clamp(min=1)) - eps * costs / 2, ninf)
    rows = torch.arange(k, dtype=i64)[:, None] * (2 * n + 1)
    at = (rows + pos.clamp(0, 2 * n)).reshape(-1)
    # exponential_mechanism's k(2n+1) draws, only the ones read converted
    uu = uniforms_at(rng, k * (2 * n + 1), at, words).reshape(pos.shape)
    g = -torch.log(-torch.log(uu.clamp(min=torch.finfo(dt).tiny)))
    seg = torch.argmax(logw + g, dim=1, keepdim=True)
    starts = torch.cat([ar.expand(k, -1), ar.expand(k, -1) + 1, 0 * first, last + 1], 1)
    start = starts.gather(1, seg).squeeze(1)
    length = lens.gather(1, seg).squeeze(1)
    r = torch.rand(k, generator=rng, dtype=dt)
    pick = start + torch.floor(r * length).to(i64).clamp(max=(length - 1).to(i64))
    return -bound + (pick.to(dt) + 0.5) * 2 * tau


def range_block(n: int, chunk_elems: int | None = None) -> int:
    """Columns per block of PrivateRange on n rows (the blocks fix the order of the draws).

    Parameters
    ----------
    n : int
        The rows.
    chunk_elems : int or None, default None
        Segment weights per block (None: ``RANGE_ELEMS``).

    Returns
    -------
    int
        Columns per block (at least 1).
    """
    return max(1, (RANGE_ELEMS if chunk_elems is None else chunk_elems) // (2 * n + 1))


def _private_range_rows(
    Xr: torch.Tensor, tau: float, bound: float, eps: float, rng: torch.Generator
) -> torch.Tensor:
    """PrivateRange for each row of ``Xr`` [k, n] (one independent instance per row)."""
    return _range_from_bins(range_bins(Xr, tau, bound), tau, bound, eps, rng)


def _range_from_bins(
    b: torch.Tensor, tau: float, bound: float, eps: float, rng: torch.Generator
) -> torch.Tensor:
    """PrivateRange for each row of the bins ``b`` [k, n] (int64; one instance per row)."""
    k, n = b.shape
    dt = torch.float64
    nbins = max(1, math.ceil(bound / tau))
    s, _ = torch.sort(b, dim=1)  # [k, n]
    # segments per row: n occupied bins (first occurrence only), n-1 gaps, before, after
    left = torch.searchsorted(s, s, right=False)
    right = torch.searchsorted(s, s, right=True)
    first = torch.ones_like(s, dtype=torch.bool)
    first[:, 1:] = s[:, 1:] != s[:, :-1]
    occ_len = first.to(dt)
    occ_cost = torch.maximum(left, n - right).to(dt)
    gap_len = (s[:, 1:] - s[:, :-1] - 1).clamp(min=0).to(dt)  # [k, n-1]
    idx = torch.arange(1, n, dtype=dt).unsqueeze(0)
    gap_cost = torch.maximum(idx, n - idx).expand_as(gap_len)
    pre_len, post_len = s[:, :1].to(dt), (nbins - 1 - s[:, -1:]).to(dt)
    lens = torch.cat([occ_len, gap_len, pre_len, post_len], dim=1)  # [k, 2n+1]
    costs = torch.cat(
        [occ_cost, gap_cost, torch.full_like(pre_len, n), torch.full_like(post_len, n)], dim=1
    )
    logw = torch.where(
        lens > 0, torch.log(lens.clamp(min=1)) - eps * costs / 2, torch.full_like(lens, -math.inf)
    )
    seg = exponential_mechanism(logw, rng=rng).unsqueeze(1)  # [k, 1]
    starts = torch.cat([s, s[:, :-1] + 1, torch.zeros_like(s[:, :1]), s[:, -1:] + 1], dim=1)
    start = starts.gather(1, seg).squeeze(1)
    length = lens.gather(1, seg).squeeze(1)
    u = torch.rand(k, generator=rng, dtype=dt)
    pick = start + torch.floor(u * length).to(torch.int64).clamp(max=(length - 1).to(torch.int64))
    return -bound + (pick.to(dt) + 0.5) * 2 * tau
