"""Levy et al. [LEVY, seed 004] winsorized user-level mean estimation
(docs/algorithms.md#winsorized-mean).

* ``private_range``: PrivateRange (Alg. 6): exponential mechanism over bins of width 2τ of
  [-B, B] with score max(#below, #above), sampled run by run (at most 2n+1 runs of equal
  score per coordinate, Gumbel-max in log space) so the B/τ bins are never materialized;
  vectorized over independent coordinates.
* ``winsorized_mean_1d``: WinsorizedMean1D (Alg. 1): clip to [μ̂ - hτ, μ̂ + hτ], average,
  add Lap(4hτ/(nε)) (h = 2 in the paper; ``halfwidth_factor``).
* ``WinsorizedAggregator`` (``aggregator=winsorized``): WinsorizedMeanHighD (Alg. 2): random
  Hadamard rotation, per-coordinate WinsorizedMean1D at radius τ' = 10 τ sqrt(log(dn/γ)/d),
  inverse rotation. The rotated rows are never held whole (``winsorized_mean_rows``): the
  cohort's rows stay as the owners sent them and two passes rotate float64 chunks of them,
  the first storing each rotated entry's PrivateRange bin (one byte where there are at most
  256 bins), the second summing the clipped entries. Used by every training method, this is Levy's Winsorized first-order
  optimization (Alg. 3) on the convex model: ``model.name=linear method=full_dp
  aggregator=winsorized train.shared_update=gradient``.

Unit: a user (or an owner with ``privacy.unit=owner``); adjacency **replace-one** with a
fixed public n (the papers' analysis): every unit participates (``train.sampling_rate=1``)
and missing rows (failed owners, NaN/inf) count as zero vectors, so n stays public.

Calibration (docs/algorithms.md#winsorized-mean). Per round and coordinate the release spends ε'/2 in
the exponential mechanism (pure: ``ZCDpEvent((ε'/2)^2/2)``) and ε'/2 in the Laplace noise
(``LaplaceDpEvent(2/ε')``: scale 4hτ'/(nε') over replace-one sensitivity 2hτ'/n), over the
d' = 2^ceil(log2 d) rotated coordinates, composed over the rounds with the RDP accountant.
``accountant``: ε' is the largest that meets (ε, δ) over the schedule. ``closed_form``: the
paper's ε' = ε_step / sqrt(8 d log(1/δ_step)) with ε_step = ε / (2 sqrt(2T log(2/δ))),
δ_step = δ/(2T) (advanced composition, [LEVY] Thm 10); the ledger then reports what the accountant
certifies for those constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import dp_accounting
import torch

from fedudp.aggregators.base import (
    BETA,
    BOUND,
    TAU,
    Aggregate,
    RowsAggregator,
    calibrate,
    check_budget,
    check_dim,
    check_fraction,
    check_positive,
    check_sampling,
    choice,
    concentration_radius,
    register,
)
from fedudp.aggregators.rows import CohortRows
from fedudp.privacy.mechanisms import (
    RandomRotation,
    exponential_mechanism,
    laplace,
    next_pow2,
    pure_dp_event,
    rotated_coordinate_radius,
)
from fedudp.protocol.contributions import Sampling

RANGE_ELEMS = 1 << 22  # segment weights per PrivateRange block (its columns: range_block)


def range_bins(
    X: torch.Tensor, tau: float, bound: float, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """PrivateRange's bin of each entry of ``X`` (as ``dtype``): l = max(1, ceil(B/τ)) bins of
    width 2τ from -B, values outside [-B, B] in the end bins; computed in float64."""
    nbins = max(1, math.ceil(bound / tau))
    return torch.floor((X.to(torch.float64) + bound) / (2 * tau)).clamp(0, nbins - 1).to(dtype)


def bin_dtype(tau: float, bound: float) -> torch.dtype:
    """The smallest integer dtype that holds every bin index (what a stored bin takes)."""
    top = max(1, math.ceil(bound / tau)) - 1
    for dt in (torch.uint8, torch.int16, torch.int32):
        if top <= torch.iinfo(dt).max:
            return dt
    return torch.int64


@dataclass(frozen=True)
class Binned:
    """The columns of an [n, k] matrix as their stored PrivateRange bins ``bins_t`` [k, n]
    (``range_bins`` in any integer dtype): what ``private_range`` needs of them."""

    bins_t: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        k, n = self.bins_t.shape
        return (n, k)


@dataclass(frozen=True)
class Counted:
    """The columns of an [n, k] matrix as their PrivateRange bin counts ``hist`` [k, nbins]
    (int64, each row summing to n): all ``private_range`` needs of them where it works from
    counts (at most ``HISTOGRAM_BINS`` bins and at most 2n+1)."""

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
    bins: at most ``HISTOGRAM_BINS`` bins and at most 2n+1."""
    return nbins <= min(HISTOGRAM_BINS, 2 * n + 1)


def bin_counts(b: torch.Tensor, nbins: int) -> torch.Tensor:
    """Each row's bin counts [k, nbins] (int64) of the bins ``b`` [k, n]."""
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
    distribution is unchanged), only no longer ``torch.rand``'s."""
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
    """Columns per block of PrivateRange on n rows (the blocks fix the order of the draws)."""
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


def winsorized_mean_1d(
    X: torch.Tensor,
    tau: float,
    bound: float,
    eps: float,
    *,
    rng: torch.Generator,
    halfwidth_factor: float = 2.0,
    n_public: int | None = None,
) -> tuple[torch.Tensor, dict]:
    """WinsorizedMean1D per column of ``X`` [n, k] (eps-DP per column, replace-one).

    ``n_public`` (default: the rows) is the public n the clipped sum is divided by.
    """
    return winsorized_mean_rows(
        CohortRows(X),
        tau,
        bound,
        eps,
        rng=rng,
        halfwidth_factor=halfwidth_factor,
        n_public=n_public,
    )


ROTATE_BLOCK = 32  # rows per rotated block: three float64 blocks of 2^15 values stay in cache
COUNT_BINS = 8  # at most this many bins: pass 1 counts them per column instead of storing them


def winsorized_mean_rows(
    rows: CohortRows,
    tau: float,
    bound: float,
    eps: float,
    *,
    rng: torch.Generator,
    rotation: RandomRotation | None = None,
    halfwidth_factor: float = 2.0,
    n_public: int | None = None,
    chunk_elems: int | None = None,
) -> tuple[torch.Tensor, dict]:
    """WinsorizedMean1D per column of the cohort's rows, rotated by ``rotation`` if given
    (WinsorizedMeanHighD's inner step), in two passes over blocks of rows:

    1. each block (``ROTATE_BLOCK`` rows, or the cohort's ``chunk``) is rotated in float64
       into reused buffers (``RandomRotation.rotate_block``) and its entries' PrivateRange
       bins v = floor((Y + B)/(2τ)) taken: with at most ``COUNT_BINS`` bins only their counts
       per column are kept (#{v >= j} per j: the same float64 arithmetic, floor(x) >= j iff
       x >= j), otherwise the bins are stored (``bin_dtype``, [k, n]); PrivateRange then runs on
       the counts or the bins in the same column blocks, with the same draws, as on a whole
       matrix;
    2. each block is rotated again, clipped to [μ̂ ± hτ] and summed (float64); Laplace noise.
       Where no entry lies outside [μ̂ ± hτ] (pass 1 keeps each column's float64 min and max)
       the clipped sums are pass 1's plain column sums: pass 2 is skipped.

    The rows past the received ones are zero vectors whose rotation is exactly zero: they are
    counted, not rotated. Memory: three float64 blocks, the counts (or the bins: n k bytes at
    most 2^8 bins), never the rotated n x k matrix. Same values as ``winsorized_mean_1d`` on
    the whole rotated matrix up to the summation order of the sums (for float32 rows the
    rotated values themselves are exact: float32 values times ±1 summed over at most 2^29
    terms fit float64's mantissa)."""
    n = rows.n
    n_pub = int(n_public or n)
    k = rotation.dp if rotation is not None else rows.d
    dev, f64 = rows.device, torch.float64
    step = min(rows.chunk or ROTATE_BLOCK, max(1, rows.received))
    out = torch.empty(step, k, dtype=f64, device=dev)
    padded, work = out, out  # the rotation's input and scratch blocks, only where it rotates
    if rotation is not None:
        padded = torch.zeros(step, k, dtype=f64, device=dev)
        work = torch.empty(step, k, dtype=f64, device=dev)

    def blocks():
        for s in range(0, rows.received, step):
            X = rows.stored(s, min(rows.received, s + step))
            if rotation is not None:
                yield s, rotation.rotate_block(X, padded, out, work)
            else:
                yield s, out[: len(X)].copy_(X)  # a float64 copy: the rows stay unwritten

    zeros = n - rows.received  # padding rows: exactly zero after the rotation
    nbins = max(1, math.ceil(bound / tau))
    counting = nbins <= COUNT_BINS and counts_suffice(nbins, n)
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
    mu = private_range(X, tau, bound, eps / 2, rng=rng, chunk_elems=chunk_elems)
    half = halfwidth_factor * tau
    lo, hi = (mu - half).to(dev), (mu + half).to(dev)
    if bool(((low >= lo) & (high <= hi)).all()):
        # nothing to clip (the usual case: τ' bounds the spread): the clipped sums are the
        # sums of pass 1, the same values in the same order; no second rotation
        stat, outside = total, 0
    else:
        stat = torch.zeros(k, dtype=f64, device=dev)
        outside = 0
        for _, Y in blocks():
            outside += int(((Y < lo) | (Y > hi)).sum())
            stat += torch.clamp(Y, lo, hi).sum(0)
        if zeros:
            z = torch.zeros((), dtype=f64, device=dev)
            stat += zeros * torch.clamp(z, lo, hi)
            outside += zeros * int(((z < lo) | (z > hi)).sum())
    frac = outside / (n * k) if n * k else 0.0
    scale = 4 * halfwidth_factor * tau / (n_pub * eps)  # (2hτ/n) / (eps/2)
    out_ = stat.cpu() / n_pub + laplace((k,), scale, rng=rng)
    return out_, {"clipped_fraction": frac, "laplace_scale": scale, "center": mu}


def winsorized_sum(
    X: torch.Tensor, center: torch.Tensor, halfwidth: float
) -> tuple[torch.Tensor, float]:
    """The pre-noise statistic: column sums of X clipped to [center ± halfwidth]. Replacing
    one row moves each column by at most 2·halfwidth (the sensitivity the Laplace noise uses)."""
    lo, hi = center - halfwidth, center + halfwidth
    clipped = torch.minimum(torch.maximum(X, lo), hi)
    frac = float(((X < lo) | (X > hi)).to(torch.float64).mean()) if X.numel() else 0.0
    return clipped.sum(0), frac


def winsorized_bytes(
    rows: int, dim: int, tau_coord: float, bound: float, chunk_elems: int | None = None
) -> int:
    """Peak bytes of one WinsorizedMeanHighD release beyond the rows: the stored bins (only
    above ``COUNT_BINS`` bins; their counts otherwise), three float64 blocks of
    ``ROTATE_BLOCK`` rotated rows and a bool block, and one PrivateRange block (its int64 words,
    or a dozen [cols, 2n+1] arrays in the sorted form above ``HISTOGRAM_BINS``)."""
    k = next_pow2(dim)
    nbins = max(1, math.ceil(bound / tau_coord))
    if nbins <= COUNT_BINS and counts_suffice(nbins, rows):
        bins = 2 * 8 * nbins * k
    else:
        bins = rows * k * torch.empty((), dtype=bin_dtype(tau_coord, bound)).element_size()
    cols = range_block(rows, chunk_elems)
    per_col = 8 if counts_suffice(nbins, rows) else 12 * 8
    block = per_col * min(k, cols) * (2 * rows + 1)
    return bins + 25 * ROTATE_BLOCK * k + block + 8 * 8 * k


def min_users(coords: int, eps_coord: float, bound: float, tau_coord: float, gamma: float) -> int:
    """Users PrivateRange needs on every coordinate: [LEVY] Thm 1's n ≳ (8/ε') log(B/τ')
    with a union bound over the d' coordinates (log(d' B/(τ' γ))); Thm 2's
    24 sqrt(d log(1/δ))/ε · log(d²B/(τγ)) is this with the paper's ε'."""
    return math.ceil(8 / eps_coord * max(1.0, math.log(coords * bound / (tau_coord * gamma))))


def default_tau(bound: float, n: int, m: int, gamma: float) -> float:
    """[LEVY] Corollary 1: user averages of m samples of norm ≤ B concentrate within
    τ = B sqrt(log(2n/γ)/(2m))."""
    return bound * math.sqrt(math.log(2 * n / gamma) / (2 * m))


@register
class WinsorizedAggregator(RowsAggregator):
    """``aggregator=winsorized``: WinsorizedMeanHighD on the billboard (see module docstring)."""

    name = "winsorized"
    inputs = ("dim", "epsilon", "delta", "rounds", "sampling", "records_per_unit", "calibration")
    options = (BOUND, TAU, BETA)
    replace_one = True
    calibrations = ("accountant", "closed_form")
    accountant = "dp_accounting.RdpAccountant (ZCDpEvent for the exponential mechanism)"

    def __init__(
        self,
        dim: int,
        tau: float,
        bound: float,
        eps_coord: float,
        sampling: Sampling,
        gamma: float = 0.1,
        halfwidth_factor: float = 2.0,
        min_users_required: int | None = None,
    ) -> None:
        if sampling.rate < 1.0:
            raise ValueError(
                "aggregator=winsorized is replace-one with a public n: it needs "
                "train.sampling_rate=1 (no amplification claimed)"
            )
        self.dim, self.dp = int(dim), next_pow2(int(dim))
        self.tau, self.bound, self.eps_coord = float(tau), float(bound), float(eps_coord)
        self.sampling, self.gamma, self.h = sampling, float(gamma), float(halfwidth_factor)
        n = sampling.population
        self.tau_coord = rotated_coordinate_radius(self.tau, self.dp, n, gamma)
        self.min_users_required = min_users_required
        self.noise_multiplier = 2.0 / self.eps_coord  # Laplace scale / sensitivity

    @classmethod
    def calibrated(
        cls,
        *,
        dim: int,
        epsilon: float,
        delta: float,
        rounds: int,
        sampling: Sampling,
        bound: float,
        tau: float | None = None,
        records_per_unit: int | None = None,
        beta: float = 0.1,
        calibration: str = "accountant",
    ) -> WinsorizedAggregator:
        """WinsorizedMeanHighD on ``dim``-vectors of l2 norm <= ``bound`` for ``rounds`` releases
        over all ``sampling.population`` units (rate 1) meeting (ε, δ).

        ``tau``: the users' concentration radius; None derives [LEVY] Corollary 1's
        bound·sqrt(log(2n/β)/(2m)) from ``records_per_unit`` m. ``beta``: the failure
        probability γ of the rotation's radius and of τ. ``calibration``: ``"accountant"`` (the
        largest per-coordinate ε' the RDP accountant certifies) or ``"closed_form"`` (the paper's
        ε', [LEVY] Thm 10)."""
        check_dim(dim)
        check_budget(epsilon, delta, rounds)
        check_sampling(sampling, cls.name)
        check_positive("bound", bound)
        check_fraction("beta", beta)
        calibration = choice("calibration", calibration, ("accountant", "closed_form"))
        n, coords = sampling.population, next_pow2(dim)
        tau = concentration_radius(tau, lambda m: default_tau(bound, n, m, beta), records_per_unit)
        if calibration == "closed_form":
            eps_coord = closed_form_eps_coord(epsilon, delta, rounds, coords)
        else:
            z = calibrate(lambda z: winsorized_round_event(1.0 / z, coords), epsilon, delta, rounds)
            eps_coord = 1.0 / z
        agg = cls(dim, tau, bound, eps_coord, sampling, gamma=beta)
        agg.min_users_required = min_users(coords, eps_coord, bound, agg.tau_coord, beta)
        return agg

    def estimate(self, G: torch.Tensor, *, rng: torch.Generator) -> Aggregate:
        n = self.sampling.population
        rows = CohortRows(G, n, self.chunk_rows)  # missing units: zero rows (never stored)
        rot = RandomRotation(self.dim, rng=rng)
        # per rotated coordinate |Y_j| <= ||X||_2 <= B (the l2 bound), docs/algorithms.md#winsorized-mean;
        # the rotated rows exist one float64 chunk at a time (two passes: range, clipped sum)
        est, diag = winsorized_mean_rows(
            rows,
            self.tau_coord,
            self.bound,
            self.eps_coord,
            rng=rng,
            rotation=rot,
            halfwidth_factor=self.h,
            n_public=n,
        )
        mean = rot.invert(est).to(G.device, G.dtype)  # on the rows' device (engine_opts.device)
        info = {
            "clipped_fraction": diag["clipped_fraction"],
            "cohort": int(G.shape[0]),
            "tau_coord": self.tau_coord,
            "eps_coord": self.eps_coord,
        }
        if self.min_users_required is not None:
            info.update(
                min_users_met=n >= self.min_users_required,
                min_users_required=self.min_users_required,
            )
        return Aggregate(mean=mean, users_used=int(G.shape[0]), diagnostics=info)

    def dp_event(self) -> dp_accounting.DpEvent:
        return winsorized_round_event(self.eps_coord, self.dp)

    def working_bytes(self, rows: int, dim: int) -> int:
        return winsorized_bytes(rows, dim, self.tau_coord, self.bound)


def winsorized_round_event(eps_coord: float, coords: int) -> dp_accounting.DpEvent:
    """One WinsorizedMeanHighD call: per coordinate an ε'/2 exponential mechanism and an
    ε'/2 Laplace mechanism (noise multiplier 2/ε'), over ``coords`` coordinates."""
    return dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(pure_dp_event(eps_coord / 2), coords),
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.LaplaceDpEvent(2.0 / eps_coord), coords
            ),
        ]
    )


def closed_form_eps_coord(eps: float, delta: float, rounds: int, dim: int) -> float:
    """[LEVY] Alg. 3 / Alg. 2 constants (docs/algorithms.md#winsorized-mean): per-step
    ε_s = ε/(2 sqrt(2T log(2/δ))),
    δ_s = δ/(2T); per coordinate ε_s / sqrt(8 d log(1/δ_s)). One call (T = 1 and no step
    split) uses ε / sqrt(8 d log(1/δ))."""
    if rounds == 1:
        eps_s, delta_s = eps, delta
    else:
        eps_s = eps / (2 * math.sqrt(2 * rounds * math.log(2 / delta)))
        delta_s = delta / (2 * rounds)
    return eps_s / math.sqrt(8 * dim * math.log(1 / delta_s))
