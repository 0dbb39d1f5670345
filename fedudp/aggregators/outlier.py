"""Outlier-removal user-level mean estimation: Asi & Liu [ASI, seed 003] Algorithm 2 after
FriendlyCore (Tsfadia et al. 2022); docs/algorithms.md#outlier-removal and
docs/algorithms.md#friendlycore.

Pieces (pure functions, vectorized, on the vectors' device):

* ``friend_counts``: for every user, how many users (itself included) lie within each given
  radius, from the Gram matrix ||a-b||² = ||a||² + ||b||² - 2<a,b> in float64 blocks of
  centred rows (BLAS), each pair once; the rows stay as the owners sent them and are converted
  one block at a time (never the full n x n distances nor an n x d float64 copy).
* ``decided_counts``: the estimators' counts. From 4,096 rows on (``friends.worth_bounding``),
  every count is first bracketed by a rank-128 projection (``fedudp.aggregators.friends``) and
  made exact only where a keep probability depends on it; the score goes to AboveThreshold as a
  bracket (``AboveThreshold.test_between``) and is computed exactly only if the drawn noise
  leaves the test open. Releases and draws are those of the exact counts.
* ``concentration_score``: s = (1/n) Σ_j Σ_j' 1(||v_j - v_j'|| <= τ) ∈ [0, n]. Replacing one
  user changes at most 2(n-1) indicators, so s has sensitivity 2(n-1)/n < 2, not the 1 the
  paper's AboveThreshold assumes: both its noises are scaled by ``SCORE_SENSITIVITY = 2``.
* ``keep_probabilities``: p_j = 0 if f_j < n/2, 1 if f_j >= 2n/3, (f_j - n/2)/(n/6) between,
  with f_j the count within 2τ.
* ``filtered_mean``: keep each user independently with p_j, average the kept (0 if none;
  summed in float64, a chunk of kept rows at a time).

Aggregators (unit: user, or owner with ``privacy.unit=owner``; adjacency **replace-one** with
a public n: every unit every round, missing rows count as zero vectors):

* ``OutlierRemovalAggregator`` (``aggregator=outlier_removal``): [ASI] Alg. 2 with **one**
  AboveThreshold instance (budget ε/2, threshold 4n/5) across all T rounds; on ⊥ it outputs 0
  and halts the run (``halted_at_round`` in summary.json).
* ``FriendlyCoreAggregator`` (``aggregator=friendlycore``): the FriendlyCore filter as its own
  per-round estimator: each round a fresh Laplace concentration check (pure, LaplaceDpEvent),
  the filter and the Gaussian mean; a failed check releases 0 for that round (no halt). Its
  check costs compose over rounds (≈ sqrt(T) users needed, vs log T for the AT version).

Calibration (docs/algorithms.md#outlier-removal):

* ``certified``/``accountant``: explicit replace-one sensitivity Δ = 30 τ K(ζ)/n of the kept
  mean (all kept points within 10τ of each other, |S| >= 2n/3, |S Δ S'| <= K(ζ) with
  probability >= 1-ζ), Gaussian noise multiplier z = σ/Δ composed with dp-accounting (PLD/RDP).
  K: 1 (the replaced user) + a Chernoff bound on a sum of independent Bernoullis whose total
  mean is at most 6 (each p_j moves by at most 6/n when one other user changes: [ASI] Lemma
  3.3's "≤ 2" is too small for these thresholds, so we use the larger, safe value).
  The failure probabilities (AT passing a non-concentrated query; the coupling's ζ per round)
  are charged to δ with basic composition (``ApproxDp``), as is AboveThreshold's pure ε/2.
* ``closed_form``/``paper``: the seed's σ² = 8 τ² T log(e^ε T/δ) log(e^{ε/2}/δ)/(n² ε²) per
  coordinate, as written (its ≲ hides a constant: the ledger reports what the accountant
  certifies for Δ above and that σ, which is far larger than ε).

Privacy requires n >= 7.5 α_AT (so that a ⊤ implies true score >= 2n/3); below it the
configuration is refused (it would break privacy), not warned about.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import dp_accounting
import torch

from fedudp.aggregators import friends
from fedudp.aggregators.base import (
    BETA,
    BOUND,
    TAU,
    Aggregate,
    ParameterError,
    RowsAggregator,
    calibrate,
    check_budget,
    check_fraction,
    check_positive,
    check_sampling,
    choice,
    concentration_radius,
    register,
)
from fedudp.aggregators.friends import FriendBounds
from fedudp.aggregators.rows import DISTANCE_CHUNK, CohortRows, as_cohort, chunks_bytes, outer_rows
from fedudp.privacy.accountant import ApproxDp, schedule_epsilon
from fedudp.privacy.mechanisms import AboveThreshold, laplace
from fedudp.protocol.contributions import Sampling

SCORE_SENSITIVITY = 2.0
DIAMETER_FACTOR = 30.0  # Δ = 30 τ K / n (docs/algorithms.md#outlier-removal)
COUPLING_MEAN = 6.0  # Σ_j |p_j - p'_j| <= 6 (n-1)/n under replace-one


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
    products are spent only on pairs near a radius (all of them for unconcentrated data)."""
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
        sq[s : s + len(B)] = friends.squared_norms(B)
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
    inner blocks, one distance block and its masks, the norms and counts, two working chunks."""
    outer = min(rows, outer_rows(dim))
    inner = min(outer, DISTANCE_CHUNK)
    return (
        8 * ((outer + inner) * dim + 2 * outer * inner + (2 + radii) * rows + 2 * dim)
        + outer * inner
        + chunks_bytes()
    )


def exact_bounds(V: torch.Tensor | CohortRows, radii: tuple[float, ...]) -> FriendBounds:
    """Every count exact (``friend_counts``), as a ``FriendBounds`` with low = high."""
    rows = as_cohort(V)
    counts = friend_counts(rows, radii)
    total = counts.sum(1)
    return FriendBounds(tuple(radii), counts, counts, total, total, torch.empty(0), torch.empty(0))


def bracketed(
    V: torch.Tensor | CohortRows, radii: tuple[float, ...], totals: tuple[bool, ...] | None = None
) -> FriendBounds:
    """``friends.friend_bounds`` where bounds pay off (``friends.worth_bounding``), else every
    count exact (``exact_bounds``)."""
    rows = as_cohort(V)
    if friends.worth_bounding(rows.n, rows.d):
        return friends.friend_bounds(rows, radii, totals=totals)
    return exact_bounds(rows, radii)


def decided_counts(
    V: torch.Tensor | CohortRows,
    radii: tuple[float, ...],
    k: int,
    prob: Callable[[torch.Tensor], torch.Tensor],
    bounds: FriendBounds | None = None,
) -> FriendBounds:
    """Friend counts bracketed (``friends.friend_bounds``) and made exact for radius ``radii[k]``
    wherever the keep probability ``prob`` (non-decreasing in the count) differs at the two
    ends of a row's bracket: ``prob(result.low[k])`` is then exactly ``prob`` of the exact
    counts. Small cohorts (``friends.worth_bounding``) get every count exact; so does a cohort
    where more than ``friends.EXACT_FRACTION`` of the rows are open (one full pass is cheaper)."""
    rows = as_cohort(V)
    if bounds is None:
        bounds = bracketed(rows, radii)
    if bounds.exact:
        return bounds
    undecided = prob(bounds.low[k]) != prob(bounds.high[k])
    if float(undecided.sum()) > friends.EXACT_FRACTION * rows.n:
        return exact_bounds(rows, radii)
    return friends.exact_counts(rows, bounds, undecided, (k,))


def concentration_score(counts_tau: torch.Tensor) -> float:
    """s = (1/n) Σ_j #{j' within τ of j} ∈ [0, n] (sensitivity < 2 under replace-one)."""
    n = counts_tau.numel()
    return float(counts_tau.sum()) / n if n else 0.0


def keep_probabilities(counts_2tau: torch.Tensor, n: int) -> torch.Tensor:
    """[ASI] Alg. 2: p = clip((f - n/2)/(n/6), 0, 1) with f the friends within 2τ."""
    return ((counts_2tau.to(torch.float64) - n / 2) / (n / 6)).clamp(0.0, 1.0)


def filtered_mean(
    V: torch.Tensor | CohortRows, p: torch.Tensor, *, rng: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Keep row j with probability p_j (independently); mean of the kept rows (0 if none), in
    the rows' dtype: summed in float64 from the kept rows, a chunk of them at a time."""
    rows = as_cohort(V)
    # privacy sampling on the CPU generator whatever the rows' device (engine_opts.device)
    keep = torch.rand(p.shape, generator=rng, dtype=torch.float64) < p.cpu()
    k = int(keep.sum())
    if k == 0:
        return torch.zeros(rows.d, dtype=rows.dtype, device=rows.device), 0
    total = rows.sum_rows(torch.nonzero(keep).squeeze(1).to(rows.device))
    return (total / k).to(rows.dtype), k


def chernoff_count(mean: float, zeta: float) -> int:
    """Smallest k >= mean with P(X >= k) <= zeta for X a sum of independent Bernoullis of total
    mean <= ``mean`` (Chernoff: P(X >= k) <= e^{-μ} (eμ/k)^k)."""
    k = max(1, math.ceil(mean))
    while -mean + k * (1 + math.log(mean / k)) > math.log(zeta):
        k += 1
    return k


def sensitivity(tau: float, n: int, zeta: float) -> float:
    """Replace-one l2 sensitivity of the filtered mean under the good event, w.p. >= 1-ζ."""
    return DIAMETER_FACTOR * tau * (1 + chernoff_count(COUPLING_MEAN, zeta)) / n


def at_false_pass(n: int, eps_at: float, queries: int) -> float:
    """Probability that some ⊤ of an AboveThreshold(ε_AT, threshold 4n/5, sensitivity 2) over
    ``queries`` queries comes from a query below 2n/3: γ with α_AT(γ) = 2n/15
    (docs/algorithms.md#abovethreshold), i.e.
    γ = 2T exp(-(2n/15) ε_AT / (8·2))."""
    return min(1.0, 2 * queries * math.exp(-(2 * n / 15) * eps_at / (8 * SCORE_SENSITIVITY)))


def min_users_at(eps_at: float, queries: int, gamma: float) -> int:
    """n >= 7.5 α_AT with α_AT = 8·2·log(2T/γ)/ε_AT (so that 4n/5 - α_AT >= 2n/3; [ASI]
    Prop. 3.6 with the score's sensitivity 2)."""
    return math.ceil(7.5 * 8 * SCORE_SENSITIVITY * math.log(2 * queries / gamma) / eps_at)


def paper_sigma(tau: float, n: int, eps: float, delta: float, rounds: int) -> float:
    """[ASI] Alg. 2 per-coordinate noise std, as written (paper mode)."""
    var = (
        8
        * tau**2
        * rounds
        * math.log(math.exp(eps) * rounds / delta)
        * math.log(math.exp(eps / 2) / delta)
        / (n**2 * eps**2)
    )
    return math.sqrt(var)


def default_filter_tau(bound: float, n: int, rounds: int, beta: float, m: int) -> float:
    """τ = G sqrt(log(2nT/γ)/m) (``filter_tau`` from plain values)."""
    return bound * math.sqrt(math.log(2 * n * rounds / beta) / m)


def _filter_options(bound, tau, records_per_unit, beta, accounting, sampling, rounds, name):
    """The plain options both filters share: (τ, paper accounting?)."""
    check_sampling(sampling, name)
    check_fraction("beta", beta)
    if bound is not None or tau is None:
        check_positive("bound", bound)
    paper = choice("accounting", accounting, ("certified", "paper")) == "paper"
    tau = concentration_radius(
        tau,
        lambda m: default_filter_tau(bound, sampling.population, rounds, beta, m),
        records_per_unit,
    )
    return tau, paper


def paper_sensitivity(tau: float, n: int, eps: float, delta: float, rounds: int) -> float:
    """[ASI] Lemma 3.5 read with constant 1: Δ = τ log(1/ζ')/n, ζ' = δ/(2(e^ε + 1 + T))."""
    zeta = delta / (2 * (math.exp(eps) + 1 + rounds))
    return tau * math.log(1 / zeta) / n


class _FilterGaussian(RowsAggregator):
    """Shared body: friend counts, filter, Gaussian noise of std ``noise_std`` per coordinate."""

    noise_multiplier: float
    min_users_required: int

    def __init__(
        self,
        tau: float,
        noise_multiplier: float,
        delta_sens: float,
        sampling: Sampling,
        min_users_required: int,
    ) -> None:
        if sampling.rate < 1.0:
            raise ValueError(
                f"aggregator={self.name} is replace-one with a public n: it needs "
                "train.sampling_rate=1 (no amplification claimed)"
            )
        self.tau, self.sampling = float(tau), sampling
        self.noise_multiplier, self.sensitivity = float(noise_multiplier), float(delta_sens)
        self.min_users_required = int(min_users_required)

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * self.sensitivity

    def _cohort(self, G: torch.Tensor) -> CohortRows:
        return CohortRows(G, self.sampling.population, self.chunk_rows)  # missing: zero rows

    def _noisy(self, mean: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
        # drawn on the CPU generator, moved to the mean's device (engine_opts.device)
        noise = torch.randn(mean.shape, generator=rng, dtype=torch.float64)
        return (mean.to(torch.float64) + (self.noise_std * noise).to(mean.device)).to(mean.dtype)

    def working_bytes(self, rows: int, dim: int) -> int:
        return friend_counts_bytes(rows, dim, radii=2)

    def _diag(self, G: torch.Tensor, score: tuple[float, float], kept: int, passed: bool) -> dict:
        """``score``: its bracket (low, high); equal when it was computed exactly, else the
        exact score was not needed for the decision and ``score`` is None."""
        n = self.sampling.population
        low, high = score
        exact = low if low == high else None
        return {
            "score": exact,
            "score_fraction": None if exact is None else exact / n,
            "score_low": low,
            "score_high": high,
            "kept_fraction": kept / n,
            "concentration_check_failed": not passed,
            "cohort": int(G.shape[0]),
            "min_users_met": n >= self.min_users_required,
            "min_users_required": self.min_users_required,
        }


@register
class OutlierRemovalAggregator(_FilterGaussian):
    """``aggregator=outlier_removal``: [ASI] Alg. 2, one AboveThreshold across all rounds."""

    name = "outlier_removal"
    inputs = (
        "epsilon",
        "delta",
        "rounds",
        "sampling",
        "records_per_unit",
        "accounting",
        "calibration",
    )
    options = (BOUND, TAU, BETA)
    replace_one = True
    calibrations = ("accountant", "closed_form")
    accountant = (
        "dp_accounting PLD/RDP for the Gaussian releases; AboveThreshold ε/2 and the "
        "failure probabilities by basic composition (ApproxDp)"
    )

    def __init__(
        self,
        tau: float,
        noise_multiplier: float,
        delta_sens: float,
        sampling: Sampling,
        eps_at: float,
        rounds: int,
        delta_reserved: float,
        min_users_required: int,
    ) -> None:
        super().__init__(tau, noise_multiplier, delta_sens, sampling, min_users_required)
        self.eps_at, self.rounds, self.delta_reserved = (
            float(eps_at),
            int(rounds),
            float(delta_reserved),
        )
        self.at: AboveThreshold | None = None
        self.halted_at: int | None = None

    @classmethod
    def calibrated(
        cls,
        *,
        epsilon: float,
        delta: float,
        rounds: int,
        sampling: Sampling,
        bound: float | None = None,
        tau: float | None = None,
        records_per_unit: int | None = None,
        beta: float = 0.1,
        accounting: str = "certified",
        calibration: str = "accountant",
    ) -> OutlierRemovalAggregator:
        """[ASI] Alg. 2 for ``rounds`` releases over all ``sampling.population`` units (rate 1)
        meeting (ε, δ): ε/2 for the one AboveThreshold, ε/2 (at δ/2) for the T Gaussian releases,
        δ/4 for AT passing a non-concentrated query, δ/4 for the coupling's ζ over T rounds.

        ``tau``: the filter radius; None derives [ASI] §4.3's bound·sqrt(log(2nT/β)/m) from
        ``bound`` and ``records_per_unit`` m. ``accounting``: ``"certified"`` (explicit
        sensitivity 30τK/n) or ``"paper"`` (the seed's Δ, heuristic). ``calibration``:
        ``"accountant"`` (z from dp-accounting) or ``"closed_form"`` (the seed's σ, refused
        where the accountant does not certify it within ε)."""
        check_budget(epsilon, delta, rounds)
        tau, paper = _filter_options(
            bound, tau, records_per_unit, beta, accounting, sampling, rounds, cls.name
        )
        calibration = choice("calibration", calibration, ("accountant", "closed_form"))
        n = sampling.population
        eps_at = epsilon / 2
        need = min_users_at(eps_at, rounds, delta / 4)
        if n < need:
            raise ParameterError(
                "sampling.population",
                f"sampling.population must be >= {need} units for "
                f"outlier_removal's privacy proof (7.5 α_AT for AboveThreshold at "
                f"epsilon/2={eps_at:g}, rounds={rounds}, failure delta/4), got {n}",
                need=need,
            )
        sens = (
            paper_sensitivity(tau, n, epsilon, delta, rounds)
            if paper
            else sensitivity(tau, n, delta / (4 * rounds))
        )
        if calibration == "closed_form":
            z = paper_sigma(tau, n, epsilon, delta, rounds) / sens
            got = eps_at + schedule_epsilon(dp_accounting.GaussianDpEvent, z, rounds, delta / 2)
            if got > epsilon * (1 + 1e-6):
                raise ParameterError(
                    "calibration",
                    f"calibration='closed_form': the paper's σ certifies "
                    f"ε={got:.3g} > epsilon={epsilon:g} with the explicit sensitivity 30τK/n; use "
                    "accounting='paper' (heuristic) or calibration='accountant'",
                    got=got,
                )
        else:
            z = calibrate(dp_accounting.GaussianDpEvent, epsilon - eps_at, delta / 2, rounds)
        agg = cls(tau, z, sens, sampling, eps_at, rounds, delta / 2, need)
        return agg.as_heuristic() if paper else agg

    def estimate(self, G: torch.Tensor, *, rng: torch.Generator) -> Aggregate:
        if self.at is None:  # one instance: the threshold drawn once
            seed = int(torch.randint(0, 2**62, (1,), generator=rng))
            self.at = AboveThreshold(
                4 * self.sampling.population / 5,
                self.eps_at,
                rng=torch.Generator().manual_seed(seed),
                sensitivity=SCORE_SENSITIVITY,
            )
        if self.at.halted:
            raise RuntimeError("outlier_removal: AboveThreshold already halted; no more answers")
        n = self.sampling.population
        V = self._cohort(G)
        radii = (self.tau, 2 * self.tau)
        held = [bracketed(V, radii, totals=(True, False))]  # τ: only the score's total

        def score_bracket() -> tuple[float, float]:  # concentration_score's value at each end
            b = held[0]
            return (int(b.total_low[0]) / V.n, int(b.total_high[0]) / V.n) if V.n else (0.0, 0.0)

        bracket = score_bracket()

        def exact_score() -> float:  # only when the noise leaves the test open
            held[0] = exact_bounds(V, radii)
            return concentration_score(held[0].low[0])

        passed = self.at.test_between(*bracket, exact_score)
        bracket = score_bracket()  # exact (low = high) if the test needed the exact score
        if not passed:
            self.halted_at = self.at.queries
            return Aggregate(
                mean=G.new_zeros(G.shape[1]),
                users_used=0,
                halted=True,
                diagnostics=self._diag(G, bracket, 0, False) | {"halted": True},
            )
        counts = decided_counts(V, radii, 1, lambda c: keep_probabilities(c, n), held[0])
        p = keep_probabilities(counts.low[1], n)
        mean, kept = filtered_mean(V, p, rng=rng)
        return Aggregate(
            mean=self._noisy(mean, rng),
            users_used=kept,
            diagnostics=self._diag(G, bracket, kept, True),
        )

    def dp_event(self) -> dp_accounting.DpEvent:
        return dp_accounting.GaussianDpEvent(self.noise_multiplier)

    def one_off_event(self) -> ApproxDp:
        """AboveThreshold's pure ε/2 (one instance) and the δ reserved for the failures."""
        return ApproxDp(self.eps_at, self.delta_reserved)

    def checkpoint_state(self) -> dict:
        """The one AboveThreshold across rounds: its noisy threshold, queries, halt and RNG."""
        at = self.at
        return {
            "halted_at": self.halted_at,
            "at": None
            if at is None
            else {
                "noisy_threshold": float(at.noisy_threshold),
                "halted": bool(at.halted),
                "queries": int(at.queries),
                "rng": at.rng.get_state(),
            },
        }

    def restore_checkpoint_state(self, state: dict) -> None:
        self.halted_at = state["halted_at"]
        saved = state["at"]
        if saved is None:
            self.at = None
            return
        self.at = AboveThreshold(
            4 * self.sampling.population / 5,
            self.eps_at,
            rng=torch.Generator(),
            sensitivity=SCORE_SENSITIVITY,
        )
        self.at.rng.set_state(saved["rng"])
        self.at.noisy_threshold = saved["noisy_threshold"]
        self.at.halted, self.at.queries = saved["halted"], saved["queries"]


@register
class FriendlyCoreAggregator(_FilterGaussian):
    """``aggregator=friendlycore``: the FriendlyCore filter as its own per-round estimator.

    Per round: keep user j with p_j = clip((f_j - n/2 - 1)/(n/6), 0, 1) (f_j: friends within 2τ;
    p_j > 0 needs more than n/2 + 1 friends, so any two kept users, even across neighbouring
    datasets, share a friend: the kept set has diameter <= 4τ); check the kept mass
    P = Σ p_j privately (sensitivity < 7: the replaced user's p moves by <= 1, every other by
    <= 6/n) with Lap(7b) against ``MASS_RELEASE`` n; on a pass release the kept mean plus
    Gaussian noise, else 0 for that round. No score threshold: unlike [ASI] Alg. 2 it keeps
    working up to ~45% far-away corrupted users (their p is 0; the honest 55% keep mass
    ≈ 0.16 n). Sensitivity of the kept mean (sets within diameter D, |S Δ S'| <= K, both of
    size >= s): 2 D K / s, with D = 4τ, s = ``MASS_MIN`` n, K = 2 + Chernoff(6, ζ).
    Failure terms charged to δ per round: the check passing with P < ``MASS_FLOOR`` n, |S| < s
    given P >= ``MASS_FLOOR`` n (Chernoff lower tail), and ζ.
    """

    name = "friendlycore"
    inputs = ("epsilon", "delta", "rounds", "sampling", "records_per_unit", "accounting")
    options = (BOUND, TAU, BETA)
    replace_one = True
    closed_form_note = (
        "has no seed closed form for aggregator=friendlycore (FriendlyCore is not one of the seeds)"
    )
    accountant = (
        "dp_accounting PLD/RDP (Laplace mass check + Gaussian per round); failure "
        "probabilities in δ by basic composition"
    )

    def __init__(
        self,
        tau: float,
        noise_multiplier: float,
        delta_sens: float,
        sampling: Sampling,
        check_multiplier: float,
        delta_reserved: float,
        min_users_required: int,
    ) -> None:
        super().__init__(tau, noise_multiplier, delta_sens, sampling, min_users_required)
        self.check_multiplier, self.delta_reserved = float(check_multiplier), float(delta_reserved)

    @property
    def check_scale(self) -> float:
        return self.check_multiplier * MASS_SENSITIVITY

    @classmethod
    def calibrated(
        cls,
        *,
        epsilon: float,
        delta: float,
        rounds: int,
        sampling: Sampling,
        bound: float | None = None,
        tau: float | None = None,
        records_per_unit: int | None = None,
        beta: float = 0.1,
        accounting: str = "certified",
    ) -> FriendlyCoreAggregator:
        """FriendlyCore for ``rounds`` releases over all ``sampling.population`` units (rate 1)
        meeting (ε, δ): per round a Laplace mass check (noise multiplier b = z) and a Gaussian
        (z), composed with dp-accounting at δ/2; the rest of δ covers the failure terms.

        ``tau``: the friend radius; None derives bound·sqrt(log(2nT/β)/m) from ``bound`` and
        ``records_per_unit`` m. ``accounting``: ``"certified"`` (sensitivity 2DK/s) or
        ``"paper"`` (the seed's Δ, heuristic). No closed form (always the accountant)."""
        check_budget(epsilon, delta, rounds)
        tau, paper = _filter_options(
            bound, tau, records_per_unit, beta, accounting, sampling, rounds, cls.name
        )
        n = sampling.population
        sens = (
            paper_sensitivity(tau, n, epsilon, delta, rounds)
            if paper
            else friendlycore_sensitivity(tau, n, delta / (4 * rounds))
        )
        z = calibrate(lambda z: friendlycore_round_event(z, z), epsilon, delta / 2, rounds)
        need = n
        while rounds * friendlycore_failure(need, z) <= delta / 4 and need > 1:
            need = max(1, need // 2)
        while rounds * friendlycore_failure(need, z) > delta / 4:
            need += max(1, need // 64)
        if n < need:
            raise ParameterError(
                "sampling.population",
                f"sampling.population must be >= {need} units for "
                f"friendlycore, so that a release with a small kept set has probability <= "
                f"delta/(4 rounds) (mass check multiplier {z:.3g}), got {n}",
                need=need,
                z=z,
            )
        agg = cls(tau, z, sens, sampling, z, delta / 2, need)
        return agg.as_heuristic() if paper else agg

    def estimate(self, G: torch.Tensor, *, rng: torch.Generator) -> Aggregate:
        n = self.sampling.population
        V = self._cohort(G)
        counts = decided_counts(V, (2 * self.tau,), 0, lambda c: friendly_keep_probabilities(c, n))
        p = friendly_keep_probabilities(counts.low[0], n)
        mass = float(p.sum())
        noisy = mass + float(laplace((1,), self.check_scale, rng=rng)[0])
        diag = {
            "kept_mass_fraction": mass / n,
            "cohort": int(G.shape[0]),
            "min_users_met": n >= self.min_users_required,
            "min_users_required": self.min_users_required,
        }
        if noisy < MASS_RELEASE * n:  # check failed: release 0 this round
            return Aggregate(
                mean=G.new_zeros(G.shape[1]),
                users_used=0,
                diagnostics=diag | {"kept_fraction": 0.0, "concentration_check_failed": True},
            )
        mean, kept = filtered_mean(V, p, rng=rng)
        return Aggregate(
            mean=self._noisy(mean, rng),
            users_used=kept,
            diagnostics=diag | {"kept_fraction": kept / n, "concentration_check_failed": False},
        )

    def dp_event(self) -> dp_accounting.DpEvent:
        return friendlycore_round_event(self.noise_multiplier, self.check_multiplier)

    def one_off_event(self) -> ApproxDp:
        return ApproxDp(0.0, self.delta_reserved)


MASS_SENSITIVITY = 7.0
MASS_RELEASE, MASS_FLOOR, MASS_MIN = 0.15, 0.10, 0.05


def friendly_keep_probabilities(counts_2tau: torch.Tensor, n: int) -> torch.Tensor:
    """p = clip((f - n/2 - 1)/(n/6), 0, 1): positive only with more than n/2 + 1 friends."""
    return ((counts_2tau.to(torch.float64) - n / 2 - 1) / (n / 6)).clamp(0.0, 1.0)


def friendlycore_sensitivity(tau: float, n: int, zeta: float) -> float:
    """2 D K / s with D = 4τ, s = MASS_MIN n, K = 2 + Chernoff(6, ζ) (see the class docstring)."""
    return 2 * 4 * tau * (2 + chernoff_count(COUPLING_MEAN, zeta)) / (MASS_MIN * n)


def friendlycore_round_event(
    noise_multiplier: float, check_multiplier: float
) -> dp_accounting.DpEvent:
    """One FriendlyCore round: the Laplace mass check (noise multiplier b = scale / 7) and the
    Gaussian release of the kept mean (z = σ/Δ)."""
    return dp_accounting.ComposedDpEvent(
        [
            dp_accounting.LaplaceDpEvent(check_multiplier),
            dp_accounting.GaussianDpEvent(noise_multiplier),
        ]
    )


def friendlycore_failure(n: int, check_multiplier: float) -> float:
    """Per-round probability (either dataset) that a release happens with a kept set smaller than
    MASS_MIN n: check passing with P < MASS_FLOOR n, or |S| < MASS_MIN n given P >= MASS_FLOOR n."""
    false_pass = 0.5 * math.exp(
        -(MASS_RELEASE - MASS_FLOOR) * n / (MASS_SENSITIVITY * check_multiplier)
    )
    eta = 1 - MASS_MIN / MASS_FLOOR
    small = math.exp(-(eta**2) * MASS_FLOOR * n / 2)
    return 2 * (false_pass + small)
