"""Friend counts: for every unit, how many units (itself included) lie within each radius.

* ``friend_counts``: every count exact, from the Gram matrix ||a-b||² = ||a||² + ||b||² - 2<a,b>
  in float64 blocks of centred rows (BLAS), each pair once; the rows stay as the owners sent
  them and are converted one block at a time (never the full n x n distances nor an n x d
  float64 copy).
* ``decided_counts``: the filters' counts (``outlier_removal``, ``friendlycore``). From 4,096
  rows on (``friend_bounds.worth_bounding``), every count is first bracketed by a rank-128
  projection (``fedudp.aggregators.friend_bounds``) and made exact only where a keep
  probability depends on it. Releases and draws are those of the exact counts.

The distances decide who is a friend (a privacy-relevant branch): everything is float64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from fedudp.aggregators import friend_bounds
from fedudp.aggregators.friend_bounds import FriendBounds
from fedudp.aggregators.rows import DISTANCE_CHUNK, CohortRows, as_cohort, chunks_bytes, outer_rows

__all__ = [
    "PRUNE_MARGIN",
    "bracketed",
    "decided_counts",
    "exact_bounds",
    "friend_counts",
    "friend_counts_bytes",
]

PRUNE_MARGIN = 1e-6  # relative: a pair decided by its norms alone is this far from a radius


@dataclass
class _Pairs:
    """``friend_counts``' blocks of pairs: the centred rows (``rows`` around ``centre``), their
    float64 squared norms ``sq`` (in the order ``order`` of the norms, None: the rows' own),
    the radii squared and their pruning thresholds, and the counts ``out`` being filled."""

    rows: CohortRows
    centre: torch.Tensor
    sq: torch.Tensor
    order: torch.Tensor | None
    norm: list[float]
    r2: list[float]
    sure: list[float]  # norms' sum below: friends
    apart: list[float]  # norms' difference above: not friends
    out: torch.Tensor

    def load(self, p0: int, p1: int, buf: torch.Tensor | None) -> torch.Tensor:
        """The centred float64 rows at positions p0..p1-1 (into ``buf``)."""
        if self.order is None:
            return self.rows.block(p0, p1, centre=self.centre, out=buf)
        return self.rows.take(self.order[p0:p1], centre=self.centre, out=buf)

    def plan(self, i0: int, i1: int, j0: int, j1: int) -> list[str]:
        """Per radius, for the pairs (positions i0..i1-1) x (j0..j1-1), j0 >= i0: "all" friends,
        "none", or "gram" (their products decide)."""
        if self.order is None:
            return ["gram"] * len(self.r2)
        norm = self.norm
        most = norm[i1 - 1] + norm[j1 - 1]
        least = norm[j0] - norm[i1 - 1] if j0 >= i1 else 0.0
        return [
            "all" if most <= self.sure[k] else "none" if least >= self.apart[k] else "gram"
            for k in range(len(self.r2))
        ]

    def count(
        self,
        i0: int,
        A: Callable[[], torch.Tensor],
        j0: int,
        B: Callable[[], torch.Tensor],
        both: bool,
        how: list[str],
        na: int,
        nb: int,
    ) -> None:
        """Count the friends among rows i0..i0+na-1 (``A()``) x j0..j0+nb-1 (``B()``), for
        both sides (``both``) or, for a diagonal block, once."""
        out, sq = self.out, self.sq
        d2 = None
        for k, rr in enumerate(self.r2):
            if how[k] == "all":
                out[k, i0 : i0 + na] += nb
                if both:
                    out[k, j0 : j0 + nb] += na
                continue
            if how[k] == "none":
                continue
            if d2 is None:
                a, b = A(), B()
                # ||a||² + ||b||² - 2<a,b> in two passes (negative rounding is harmless: r² >= 0)
                d2 = torch.addmm(sq[None, j0 : j0 + nb], a, b.T, alpha=-2.0)
                d2 += sq[i0 : i0 + na, None]
                if not both:  # a diagonal block: its own rows
                    idx = torch.arange(na, device=out.device)
                    d2[idx, idx + (i0 - j0)] = 0.0  # a point is its own friend, exactly
            near = d2 <= rr
            out[k, i0 : i0 + na] += near.sum(1)
            if both:
                out[k, j0 : j0 + nb] += near.sum(0)

    def outer_block(
        self,
        o0: int,
        o1: int,
        chunk: int,
        outer_buf: torch.Tensor | None,
        inner_buf: torch.Tensor | None,
    ) -> None:
        """Every pair with a row at positions o0..o1-1 and the other at or after it: the pairs
        inside the outer block, then the outer block against every later inner block (sorted
        by norm: stops at the first block farther than every radius)."""
        n, norm = self.rows.n, self.norm
        far = max(self.apart) if self.apart else 0.0
        held: list[torch.Tensor] = []

        def outer_rows_() -> torch.Tensor:  # converted once, when first needed
            if not held:
                held.append(self.load(o0, o1, outer_buf))
            return held[0]

        def part(p0: int, p1: int) -> Callable[[], torch.Tensor]:
            return lambda: outer_rows_()[p0 - o0 : p1 - o0]

        for i0 in range(o0, o1, chunk):  # pairs inside the outer block
            i1 = min(o1, i0 + chunk)
            sub = part(i0, i1)
            self.count(i0, sub, i0, sub, False, self.plan(i0, i1, i0, i1), i1 - i0, i1 - i0)
            for j0 in range(i1, o1, chunk):
                j1 = min(o1, j0 + chunk)
                how = self.plan(i0, i1, j0, j1)
                self.count(i0, sub, j0, part(j0, j1), True, how, i1 - i0, j1 - j0)
        for j0 in range(o1, n, chunk):  # against every later row, once
            j1 = min(n, j0 + chunk)
            if self.order is not None and norm[j0] - norm[o1 - 1] >= far:
                break  # sorted: every later block is farther
            how = self.plan(o0, o1, j0, j1)
            inner = partial(self.load, j0, j1, inner_buf)
            self.count(o0, outer_rows_, j0, inner, True, how, o1 - o0, j1 - j0)


def friend_counts(
    V: torch.Tensor | CohortRows,
    radii: tuple[float, ...],
    chunk: int | None = None,
    outer: int | None = None,
    prune: bool = True,
) -> torch.Tensor:
    """counts[k, j] = #{j' : ||V_j - V_j'|| <= radii[k]} (j' = j included), via the Gram matrix.

    The distances decide who is a friend (a privacy-relevant branch): computed in float64 on
    centred rows, so that users far from the origin are not counted as friends by rounding.
    ``V``: the rows (a tensor, or ``CohortRows`` with its virtual zero rows), kept as given;
    float64 copies exist one block at a time: an outer block of ``outer`` rows (default: as
    many as fit in ``rows.OUTER_BYTES``) against inner blocks of ``chunk`` rows (default
    ``rows.DISTANCE_CHUNK``, at most ``outer``; a ``CohortRows`` with its own chunk sets both).
    Each pair of rows is compared once, ||a-b||² = ||a||² + ||b||² - 2<a,b> from one float64
    BLAS block (``addmm``), and counted for both rows; a row with itself is distance 0, exactly.
    Never the full n x n distances nor the whole float64 matrix.

    ``prune``: the blocks are formed in the order of the centred rows' float64 norms, and a
    pair of blocks whose norms alone decide every pair for a radius skips the Gram block for it:
    ||a|| + ||b|| <= r (1 - ``PRUNE_MARGIN``) means friends, | ||a|| - ||b|| | >= r (1 + margin)
    means not (the triangle inequality). The margin is far above float64's rounding of the
    norms and of the Gram formula (~d 2^-53 relative), so such a pair gets the answer the Gram
    block would give it: the counts are the same, computed in float64 throughout; the O(n² d)
    products are spent only on pairs near a radius (all of them for unconcentrated data).

    Parameters
    ----------
    V : torch.Tensor or CohortRows
        The rows.
    radii : tuple of float
        The radii.
    chunk : int or None, default None
        Rows per inner block.
    outer : int or None, default None
        Rows per outer block.
    prune : bool, default True
        Skip the Gram blocks the norms decide.

    Returns
    -------
    torch.Tensor
        [len(radii), n] int64.
    """
    rows = as_cohort(V)
    n, d = rows.n, rows.d
    if outer is None:
        outer = rows.chunk or outer_rows(d)
    if chunk is None:
        chunk = rows.chunk or min(DISTANCE_CHUNK, outer)
    chunk, outer = max(1, int(chunk)), max(1, int(outer))
    dev = rows.device
    centre = rows.column_sum() / n if n else torch.zeros(d, dtype=torch.float64, device=dev)
    sq = torch.empty(n, dtype=torch.float64, device=dev)
    for s, B in rows.chunks(centre=centre):
        sq[s : s + len(B)] = friend_bounds.squared_norms(B)
    r2 = [r * r for r in radii]
    if prune:  # positions in the order of the norms
        order = torch.argsort(sq, stable=True)
        sq = sq[order]
    else:
        order = None
    norm = torch.sqrt(sq).tolist()
    sure = [r * (1 - PRUNE_MARGIN) for r in radii]  # norms' sum below: friends
    apart = [r * (1 + PRUNE_MARGIN) for r in radii]  # norms' difference above: not friends
    out = torch.zeros(len(radii), n, dtype=torch.int64, device=dev)
    pairs = _Pairs(rows, centre, sq, order, norm, r2, sure, apart, out)
    outer_buf = torch.empty(min(outer, n), d, dtype=torch.float64, device=dev) if n else None
    inner_buf = (
        torch.empty(min(chunk, n), d, dtype=torch.float64, device=dev) if outer < n else None
    )
    for o0 in range(0, n, outer):
        pairs.outer_block(o0, min(n, o0 + outer), chunk, outer_buf, inner_buf)
    if order is not None:  # back to the rows' own order
        out[:, order] = out.clone()
    return out


def friend_counts_bytes(rows: int, dim: int, radii: int = 2) -> int:
    """Peak bytes of ``friend_counts`` and the kept mean beyond the rows: the float64 outer and
    inner blocks, one distance block and its masks, the norms and counts, two working chunks.

    Parameters
    ----------
    rows : int
        The rows.
    dim : int
        Their width.
    radii : int, default 2
        The radii counted.

    Returns
    -------
    int
        Bytes.
    """
    outer = min(rows, outer_rows(dim))
    inner = min(outer, DISTANCE_CHUNK)
    return (
        8 * ((outer + inner) * dim + 2 * outer * inner + (2 + radii) * rows + 2 * dim)
        + outer * inner
        + chunks_bytes()
    )


def exact_bounds(V: torch.Tensor | CohortRows, radii: tuple[float, ...]) -> FriendBounds:
    """Every count exact (``friend_counts``), as a ``FriendBounds`` with low = high.

    Parameters
    ----------
    V : torch.Tensor or CohortRows
        The rows.
    radii : tuple of float
        The radii.

    Returns
    -------
    FriendBounds
        low = high = the exact counts.
    """
    rows = as_cohort(V)
    counts = friend_counts(rows, radii)
    total = counts.sum(1)
    return FriendBounds(tuple(radii), counts, counts, total, total, torch.empty(0), torch.empty(0))


def bracketed(
    V: torch.Tensor | CohortRows, radii: tuple[float, ...], totals: tuple[bool, ...] | None = None
) -> FriendBounds:
    """``friend_bounds.friend_bounds`` where bounds pay off (``friend_bounds.worth_bounding``), else every
    count exact (``exact_bounds``).

    Parameters
    ----------
    V : torch.Tensor or CohortRows
        The rows.
    radii : tuple of float
        The radii.
    totals : tuple of bool or None, default None
        Per radius: only the total is needed.

    Returns
    -------
    FriendBounds
        The bounds (exact for small cohorts).
    """
    rows = as_cohort(V)
    if friend_bounds.worth_bounding(rows.n, rows.d):
        return friend_bounds.friend_bounds(rows, radii, totals=totals)
    return exact_bounds(rows, radii)


def decided_counts(
    V: torch.Tensor | CohortRows,
    radii: tuple[float, ...],
    k: int,
    prob: Callable[[torch.Tensor], torch.Tensor],
    bounds: FriendBounds | None = None,
) -> FriendBounds:
    """Friend counts bracketed (``friend_bounds.friend_bounds``) and made exact for radius ``radii[k]``
    wherever the keep probability ``prob`` (non-decreasing in the count) differs at the two
    ends of a row's bracket: ``prob(result.low[k])`` is then exactly ``prob`` of the exact
    counts. Small cohorts (``friend_bounds.worth_bounding``) get every count exact; so does a cohort
    where more than ``friend_bounds.EXACT_FRACTION`` of the rows are open (one full pass is cheaper).

    Parameters
    ----------
    V : torch.Tensor or CohortRows
        The rows.
    radii : tuple of float
        The radii.
    k : int
        The radius whose keep probability decides.
    prob : callable
        Counts -> keep probabilities (non-decreasing).
    bounds : FriendBounds or None, default None
        The bounds already computed.

    Returns
    -------
    FriendBounds
        Bounds whose ``prob(low[k])`` is ``prob`` of the exact counts.
    """
    rows = as_cohort(V)
    if bounds is None:
        bounds = bracketed(rows, radii)
    if bounds.exact:
        return bounds
    undecided = prob(bounds.low[k]) != prob(bounds.high[k])
    if float(undecided.sum()) > friend_bounds.EXACT_FRACTION * rows.n:
        return exact_bounds(rows, radii)
    return friend_bounds.exact_counts(rows, bounds, undecided, (k,))
