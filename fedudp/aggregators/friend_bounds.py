"""Friend counts decided from low-rank bounds, exact where a decision needs them (issue 40).

The filters of ``outlier_removal`` and ``friendlycore`` (``fedudp.aggregators.outlier``,
``fedudp.aggregators.friendlycore``) need, for every user j, the number of users within a radius
r of it. ``friend_counts.friend_counts`` computes every count exactly from the n x n float64
Gram matrix: n²d/2 multiply-adds (the measured cost: docs/estimators.md#friend-counts). But the
filters use the counts only through a few decisions:

* the keep probability p_j = clip((f_j - a)/(n/6), 0, 1) is 0 below a and 1 above a + n/6, so
  f_j matters only in between;
* the concentration score s = (1/n) Σ_j f_j matters only through AboveThreshold's comparison
  with its noisy threshold (``AboveThreshold.test_between``).

This module brackets every count between two exact integers, ``low <= f_j <= high``, at the cost
of a rank-k problem, and computes exact counts only for the rows whose decision the bracket
leaves open. The decisions, the released values and the generator's draws are those of the
exact counts (tests/aggregators/test_friend_bounds.py).

The bracket. Let P be k orthonormal directions (rows of a k x d matrix) and Q = I - PᵀP. For two
centred rows a, b: <a, b> = <Pa, Pb> + <Qa, Qb> and |<Qa, Qb>| <= ρ_a ρ_b with
ρ² = ||a||² - ||Pa||² (Cauchy-Schwarz), so

    ||a||² + ||b||² - 2<Pa, Pb> - 2 ρ_a ρ_b  <=  ||a - b||²  <=  ... + 2 ρ_a ρ_b.

A pair is surely within r when the upper side is below r², surely not when the lower side is
above it; otherwise it is open. P is the top-k principal directions of evenly spaced rows
(any orthonormal P gives valid bounds; a good one decides more pairs; how many it leaves open
on real rows: docs/estimators.md#friend-counts).

Rounding. Everything is float64. A pair is decided only with the margin
``MARGIN_REL`` r² + ν (||a||² + ||b||²) (ν = ``norm_margin(d, k)``, at least ``MARGIN_NORM``),
far above the rounding of the projection,
of ρ (whose square root turns an absolute error e of ρ² into at most sqrt(e)) and of the exact
Gram formula (about d 2^-53 (||a||² + ||b||²)): a decided pair gets the answer the exact float64
Gram block gives it.

Cost: two passes over the rows (their mean; then norms and the k projections, n d k), an
eigenproblem of 4k sample rows, and the pairwise rank-k products (n² k / 2, in cache-sized
tiles). The open rows' exact counts cost one more pass (n d per open row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedudp.aggregators.rows import CohortRows, as_cohort

F64 = torch.float64
BOUND_RANK = 128  # principal directions of the bound
MIN_ROWS = 4096  # below this many rows (or width <= 4 k) the exact counts are cheap: use them
BLOCK_ROWS = 256  # rows per block of the pairwise rank-k pass
TILE_COLUMNS = 4096  # columns per tile of that pass (its products and counts stay in cache)
MARGIN_REL = 1e-6  # of r²
MARGIN_NORM = 1e-4  # of ||a||² + ||b||², at least (``norm_margin``)
EXACT_FRACTION = 0.25  # more open rows than this fraction: one full exact pass instead


@dataclass(frozen=True)
class FriendBounds:
    """``low[k, j] <= #{j' : ||V_j - V_j'|| <= radii[k]} <= high[k, j]`` (j' = j included) and
    ``total_low[k] <= Σ_j count <= total_high[k]``, exact integers. A radius counted for its
    total only (``friend_bounds(totals=...)``) has the trivial per-row bracket [1, n] and a
    tight total. ``centre`` and ``sq``: the centring mean and the centred rows' float64 squared
    norms the counts were computed from.

    Parameters
    ----------
    radii : tuple of float
        The radii.
    low, high : torch.Tensor
        The per-row bracket of each count, [len(radii), n] int64.
    total_low, total_high : torch.Tensor
        The bracket of each radius' total, [len(radii)] int64.
    centre : torch.Tensor
        The rows' centre (float64).
    sq : torch.Tensor
        The centred rows' float64 squared norms.
    """

    radii: tuple[float, ...]
    low: torch.Tensor
    high: torch.Tensor
    total_low: torch.Tensor
    total_high: torch.Tensor
    centre: torch.Tensor
    sq: torch.Tensor

    def open_rows(self, k: int) -> torch.Tensor:
        """Rows whose count for radius ``radii[k]`` is not known exactly.

        Parameters
        ----------
        k : int
            The radius' index.

        Returns
        -------
        torch.Tensor
            Bool mask [n].
        """
        return self.low[k] != self.high[k]

    @property
    def exact(self) -> bool:
        """Every row's count known."""
        return bool(torch.equal(self.low, self.high))

    def total_known(self, k: int) -> bool:
        """Whether the total for radius ``radii[k]`` is known exactly.

        Parameters
        ----------
        k : int
            The radius' index.

        Returns
        -------
        bool
            ``total_low[k] == total_high[k]``.
        """
        return int(self.total_low[k]) == int(self.total_high[k])


def worth_bounding(n: int, d: int, rank: int | None = None) -> bool:
    """Whether bounds pay off: at least ``MIN_ROWS`` rows and a width above four times the rank.

    Parameters
    ----------
    n : int
        The rows.
    d : int
        Their width.
    rank : int or None, default None
        The bound's rank (None: ``BOUND_RANK``).

    Returns
    -------
    bool
        Bounds pay off.
    """
    k = BOUND_RANK if rank is None else rank
    return n >= MIN_ROWS and d > 4 * k


def principal_directions(rows: CohortRows, centre: torch.Tensor, rank: int) -> torch.Tensor:
    """[k, d] orthonormal rows (k <= ``rank``): the top principal directions of up to 4·rank
    evenly spaced centred rows (deterministic: no generator is drawn from).

    Parameters
    ----------
    rows : CohortRows
        The rows.
    centre : torch.Tensor
        Their centre.
    rank : int
        The most directions.

    Returns
    -------
    torch.Tensor
        [k, d] float64.
    """
    n = rows.n
    m = min(n, 4 * rank)
    idx = torch.linspace(0, n - 1, m, dtype=F64).round().to(torch.int64).unique()
    S = rows.take(idx, centre=centre)
    ev, U = torch.linalg.eigh(S @ S.T)
    keep = ev > ev.max().clamp_min(0) * 1e-12 if len(ev) else ev > 0
    U, ev = U[:, keep][:, -rank:], ev[keep][-rank:]
    if len(ev) == 0:
        return torch.zeros(0, rows.d, dtype=F64, device=rows.device)
    P = (U.T @ S) / ev.sqrt()[:, None]
    Qm, _ = torch.linalg.qr(P.T)  # re-orthonormalized: the bounds assume orthonormal rows
    return Qm.T.contiguous()


def norm_margin(d: int, k: int) -> float:
    """ν: a pair is decided only beyond ν (||a||² + ||b||²) of a radius. ρ² = ||a||² - ||Pa||²
    carries a float64 error of at most e = 4 (d + k) sqrt(k + 1) 2^-53 ||a||² (the norms and the
    k projections, each a sum of d products), so ρ's error is at most sqrt(e) ||a|| and
    2 ρ_a ρ_b's at most 2 sqrt(e)(||a||² + ||b||²); ν is 8 sqrt(e), and never below
    ``MARGIN_NORM``.

    Parameters
    ----------
    d : int
        The rows' width.
    k : int
        The directions.

    Returns
    -------
    float
        ν (at least ``MARGIN_NORM``).
    """
    e = 4 * (d + k) * math.sqrt(k + 1) * 2.0**-53
    return max(MARGIN_NORM, 8 * math.sqrt(e))


def squared_norms(B: torch.Tensor) -> torch.Tensor:
    """Each row's float64 squared norm (``friend_counts.friend_counts`` uses this too, so both paths
    see the same values).

    Parameters
    ----------
    B : torch.Tensor
        Float64 rows.

    Returns
    -------
    torch.Tensor
        [len(B)] float64.
    """
    return torch.einsum("ij,ij->i", B, B)


def residual_norms(sq: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """ρ = sqrt(||a||² - ||Pa||²) per row (clamped at 0): the norms outside the directions,
    whose products bound the inner products the projection leaves out.

    Parameters
    ----------
    sq : torch.Tensor
        The squared norms, [n].
    Y : torch.Tensor
        The projections, [n, k].

    Returns
    -------
    torch.Tensor
        ρ, [n] float64.
    """
    return (sq - (Y * Y).sum(1)).clamp_min(0.0).sqrt()


def friend_bounds(
    V: torch.Tensor | CohortRows,
    radii: tuple[float, ...],
    rank: int | None = None,
    block: int | None = None,
    totals: tuple[bool, ...] | None = None,
) -> FriendBounds:
    """Bracket every row's friend count for each radius (module docstring): one pass over the
    rows for their norms and ``rank`` projections, then the rank-k pairs, ``block`` rows against
    every later row in tiles of ``TILE_COLUMNS`` columns (each pair once, counted for both
    rows).

    Parameters
    ----------
    V : torch.Tensor or CohortRows
        The rows, kept as given.
    radii : tuple of float
        The friend radii.
    rank : int or None, default None
        The principal directions of the bound (None: ``BOUND_RANK``).
    block : int or None, default None
        Rows per block of the pairwise pass (None: ``BLOCK_ROWS``).
    totals : tuple of bool or None, default None
        ``totals[k]``: only the sum over rows is needed for ``radii[k]`` (cheaper).

    Returns
    -------
    FriendBounds
        Every count bracketed between two exact integers, and the totals.

    Raises
    ------
    ValueError
        ``totals`` does not hold one flag per radius.
    """
    rows = as_cohort(V)
    n, dev = rows.n, rows.device
    k = BOUND_RANK if rank is None else int(rank)
    b = BLOCK_ROWS if block is None else max(1, int(block))
    tile = max(TILE_COLUMNS, b)  # a block's own columns lie in its first tile
    only_total = tuple(bool(x) for x in totals) if totals is not None else (False,) * len(radii)
    if len(only_total) != len(radii):
        raise ValueError(f"totals: one flag per radius, got {len(only_total)} for {len(radii)}")
    centre = rows.column_sum() / n if n else torch.zeros(rows.d, dtype=F64, device=dev)
    sq, Y = _projected(rows, centre, k)
    rho = residual_norms(sq, Y)
    nu = norm_margin(rows.d, Y.shape[1])
    sides = _augmented(Y, rho, sq, nu)
    low, high, t_low, t_high = _count_pairs(sides, radii, only_total, b, tile)
    for kk in range(len(radii)):
        if only_total[kk]:  # trivial per-row bracket, tight total (itself included)
            low[kk], high[kk] = 1, n
            t_low[kk] += n
            t_high[kk] += n
        else:
            t_low[kk], t_high[kk] = int(low[kk].sum()), int(high[kk].sum())
    return FriendBounds(
        tuple(float(x) for x in radii),
        low,
        high,
        torch.tensor(t_low, dtype=torch.int64),
        torch.tensor(t_high, dtype=torch.int64),
        centre,
        sq,
    )


def _projected(rows: CohortRows, centre: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over the centred rows: their float64 squared norms (as ``friend_counts``) and
    their projections on the top-``k`` principal directions ([n], [n, r])."""
    n, dev = rows.n, rows.device
    P = principal_directions(rows, centre, k) if k > 0 and n else None
    r = 0 if P is None else P.shape[0]
    sq = torch.empty(n, dtype=F64, device=dev)
    Y = torch.empty(n, r, dtype=F64, device=dev)
    step = rows.rows_per_chunk()
    buf = torch.empty(min(step, n), rows.d, dtype=F64, device=dev)
    for s in range(0, n, step):  # one pass: norms (as friend_counts) and projections
        B = rows.block(s, min(n, s + step), centre=centre, out=buf)
        sq[s : s + len(B)] = squared_norms(B)
        if P is not None and r:
            torch.mm(B, P.T, out=Y[s : s + len(B)])
    del buf
    return sq, Y


def _augmented(
    Y: torch.Tensor, rho: torch.Tensor, sq: torch.Tensor, nu: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The augmented columns whose products bracket <a,b> - ||a||²/2 - ||b||²/2 by one matrix
    product each: (L_left, L_right, H_left, H_right)."""
    n, dev = len(sq), sq.device
    # lo_side: <Pa,Pb> + ρ_a ρ_b - (1-ν)(|a|²+|b|²)/2  (>= -r²(1+μ)/2: maybe friends)
    # hi_side: <Pa,Pb> - ρ_a ρ_b - (1+ν)(|a|²+|b|²)/2  (> -r²(1-μ)/2: surely friends)
    one = torch.ones(n, 1, dtype=F64, device=dev)
    h_lo = (1 - nu) * sq[:, None] / 2
    h_hi = (1 + nu) * sq[:, None] / 2
    L_left = torch.cat([Y, rho[:, None], -h_lo, -one], 1)
    L_right = torch.cat([Y, rho[:, None], one, h_lo], 1)
    H_left = torch.cat([Y, rho[:, None], -h_hi, -one], 1)
    H_right = torch.cat([Y, -rho[:, None], one, h_hi], 1)
    return L_left, L_right, H_left, H_right


def _count_pairs(
    sides: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    radii: tuple[float, ...],
    only_total: tuple[bool, ...],
    b: int,
    tile: int,
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """The rank-k pairs: ``b`` rows against every later row in tiles of ``tile`` columns, each
    pair once and counted for both rows (itself included): per radius the low and high counts
    per row, or only their totals where ``only_total``."""
    L_left, L_right, H_left, H_right = sides
    n, dev = L_left.shape[0], L_left.device
    maybe_at = [-(rr * rr) * (1 + MARGIN_REL) / 2 for rr in radii]
    sure_at = [-(rr * rr) * (1 - MARGIN_REL) / 2 for rr in radii]
    low = torch.zeros(len(radii), n, dtype=torch.int64, device=dev)
    high = torch.zeros_like(low)
    t_low, t_high = [0] * len(radii), [0] * len(radii)
    bt = min(b, n)
    tri = torch.ones(bt, bt, dtype=torch.bool, device=dev).triu(1)
    lo_buf = torch.empty(bt, min(tile, n), dtype=F64, device=dev)
    hi_buf = torch.empty_like(lo_buf)
    yes = torch.empty(bt, min(tile, n), dtype=torch.bool, device=dev)
    for i0 in range(0, n, b):
        i1 = min(n, i0 + b)
        m = i1 - i0
        for j0 in range(i0, n, tile):  # tiles that stay in cache between the product and counts
            j1 = min(n, j0 + tile)
            w = j1 - j0
            lo_v = torch.mm(L_left[i0:i1], L_right[j0:j1].T, out=lo_buf[:m, :w])
            hi_v = torch.mm(H_left[i0:i1], H_right[j0:j1].T, out=hi_buf[:m, :w])
            for kk in range(len(radii)):
                for v, thr, out, tot, strict in (
                    (lo_v, maybe_at[kk], high, t_high, False),
                    (hi_v, sure_at[kk], low, t_low, True),
                ):
                    got = yes[:m, :w]
                    (torch.gt if strict else torch.ge)(v, thr, out=got)
                    if j0 == i0:
                        got[:, :m] &= tri[:m, :m]  # the block's own pairs: i < j only
                    if only_total[kk]:
                        tot[kk] += 2 * int(torch.count_nonzero(got))
                        continue
                    u = got.view(torch.uint8)  # counted as bytes: faster than bool sums
                    out[kk, i0:i1] += u.sum(1, dtype=torch.int32)
                    out[kk, j0:j1] += u.sum(0, dtype=torch.int32)
        low[:, i0:i1] += 1  # itself
        high[:, i0:i1] += 1
    return low, high, t_low, t_high


def exact_counts(
    V: torch.Tensor | CohortRows, bounds: FriendBounds, which: torch.Tensor, ks: tuple[int, ...]
) -> FriendBounds:
    """``bounds`` with the counts of the rows ``which`` (a bool mask or indices) made exact for
    the radii ``ks``: each such row against every row, ||a||² + ||b||² - 2<a,b> from float64
    Gram blocks of the centred rows (as ``friend_counts.friend_counts``), itself at distance 0.

    Parameters
    ----------
    V : torch.Tensor or CohortRows
        The rows.
    bounds : FriendBounds
        Their bounds.
    which : torch.Tensor
        A bool mask or indices of the rows to make exact.
    ks : tuple of int
        The radii's indices.

    Returns
    -------
    FriendBounds
        The bounds with those counts exact.
    """
    rows = as_cohort(V)
    idx = torch.nonzero(which).squeeze(1) if which.dtype == torch.bool else which.to(torch.int64)
    if len(idx) == 0:
        return bounds
    low, high = bounds.low.clone(), bounds.high.clone()
    sq = bounds.sq
    r2 = [bounds.radii[k] ** 2 for k in ks]
    step = rows.rows_per_chunk()
    buf = torch.empty(min(step, rows.n), rows.d, dtype=F64, device=rows.device)
    for a0 in range(0, len(idx), step):
        ia = idx[a0 : a0 + step]
        A = rows.take(ia, centre=bounds.centre)
        got = torch.zeros(len(ks), len(ia), dtype=torch.int64, device=rows.device)
        for s in range(0, rows.n, step):
            B = rows.block(s, min(rows.n, s + step), centre=bounds.centre, out=buf)
            d2 = torch.addmm(sq[None, s : s + len(B)], A, B.T, alpha=-2.0)
            d2 += sq[ia, None]
            own = (ia >= s) & (ia < s + len(B))
            if bool(own.any()):
                at = torch.nonzero(own).squeeze(1)
                d2[at, ia[at] - s] = 0.0  # a point is its own friend, exactly
            for j, rr in enumerate(r2):
                got[j] += (d2 <= rr).sum(1)
        for j, k in enumerate(ks):
            low[k, ia] = got[j]
            high[k, ia] = got[j]
    # both brackets of a total hold: keep the tighter ends
    t_low = torch.maximum(bounds.total_low, low.sum(1))
    t_high = torch.minimum(bounds.total_high, high.sum(1))
    return FriendBounds(bounds.radii, low, high, t_low, t_high, bounds.centre, bounds.sq)


__all__ = [
    "BOUND_RANK",
    "FriendBounds",
    "exact_counts",
    "friend_bounds",
    "norm_margin",
    "principal_directions",
    "residual_norms",
    "squared_norms",
    "worth_bounding",
]
