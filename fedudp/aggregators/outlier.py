"""Outlier-removal user-level mean estimation: Asi & Liu [ASI, seed 003] Algorithm 2 after
FriendlyCore (Tsfadia et al. 2022); docs/algorithms.md#outlier-removal and
docs/algorithms.md#friendlycore.

Pieces (pure functions, vectorized, on the vectors' device):

* ``friend_counts``: for every user, how many users (itself included) lie within each given
  radius, from the Gram matrix ||a-b||² = ||a||² + ||b||² - 2<a,b>, in row chunks (never the
  full n x n distance matrix at once).
* ``concentration_score``: s = (1/n) Σ_j Σ_j' 1(||v_j - v_j'|| <= τ) ∈ [0, n]. Replacing one
  user changes at most 2(n-1) indicators, so s has sensitivity 2(n-1)/n < 2, not the 1 the
  paper's AboveThreshold assumes: both its noises are scaled by ``SCORE_SENSITIVITY = 2``.
* ``keep_probabilities``: p_j = 0 if f_j < n/2, 1 if f_j >= 2n/3, (f_j - n/2)/(n/6) between,
  with f_j the count within 2τ.
* ``filtered_mean``: keep each user independently with p_j, average the kept (0 if none).

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

import dp_accounting
import torch

from fedudp.aggregators.base import (Aggregate, ParameterError, RowsAggregator, Sampling,
                                     calibrate, check_budget, check_fraction, check_positive,
                                     check_sampling, choice, concentration_radius,
                                     pad_to_population, register)
from fedudp.privacy.accountant import ApproxDp, schedule_epsilon
from fedudp.privacy.mechanisms import AboveThreshold, laplace

SCORE_SENSITIVITY = 2.0
DIAMETER_FACTOR = 30.0        # Δ = 30 τ K / n (docs/algorithms.md#outlier-removal)
COUPLING_MEAN = 6.0           # Σ_j |p_j - p'_j| <= 6 (n-1)/n under replace-one


def friend_counts(V: torch.Tensor, radii: tuple[float, ...], chunk: int = 1024) -> torch.Tensor:
    """counts[k, j] = #{j' : ||V_j - V_j'|| <= radii[k]} (j' = j included), via the Gram matrix.

    The distances decide who is a friend (a privacy-relevant branch): computed in float64 on
    centred rows, so that users far from the origin are not counted as friends by rounding."""
    n = V.shape[0]
    V = V.to(torch.float64)
    V = V - V.mean(0, keepdim=True)
    sq = (V * V).sum(1)
    out = torch.zeros(len(radii), n, dtype=torch.int64, device=V.device)
    for i in range(0, n, chunk):
        blk = V[i:i + chunk]
        # ||a||² + ||b||² - 2<a,b> in two passes (negative rounding is harmless: r² >= 0)
        d2 = torch.addmm(sq[None, :], blk, V.T, alpha=-2.0)
        d2 += sq[i:i + chunk, None]
        idx = torch.arange(i, min(i + chunk, n), device=V.device)
        d2[idx - i, idx] = 0.0                         # a point is its own friend, exactly
        for k, r in enumerate(radii):
            out[k, i:i + chunk] = (d2 <= r * r).sum(1)
    return out


def concentration_score(counts_tau: torch.Tensor) -> float:
    """s = (1/n) Σ_j #{j' within τ of j} ∈ [0, n] (sensitivity < 2 under replace-one)."""
    n = counts_tau.numel()
    return float(counts_tau.sum()) / n if n else 0.0


def keep_probabilities(counts_2tau: torch.Tensor, n: int) -> torch.Tensor:
    """[ASI] Alg. 2: p = clip((f - n/2)/(n/6), 0, 1) with f the friends within 2τ."""
    return ((counts_2tau.to(torch.float64) - n / 2) / (n / 6)).clamp(0.0, 1.0)


def filtered_mean(V: torch.Tensor, p: torch.Tensor, *, rng: torch.Generator
                  ) -> tuple[torch.Tensor, int]:
    """Keep row j with probability p_j (independently); mean of the kept rows (0 if none)."""
    keep = torch.rand(p.shape, generator=rng, dtype=torch.float64) < p
    k = int(keep.sum())
    if k == 0:
        return V.new_zeros(V.shape[1]), 0
    return V[keep.to(V.device)].mean(0), k


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
    var = (8 * tau ** 2 * rounds * math.log(math.exp(eps) * rounds / delta)
           * math.log(math.exp(eps / 2) / delta) / (n ** 2 * eps ** 2))
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
        tau, lambda m: default_filter_tau(bound, sampling.population, rounds, beta, m),
        records_per_unit)
    return tau, paper


def paper_sensitivity(tau: float, n: int, eps: float, delta: float, rounds: int) -> float:
    """[ASI] Lemma 3.5 read with constant 1: Δ = τ log(1/ζ')/n, ζ' = δ/(2(e^ε + 1 + T))."""
    zeta = delta / (2 * (math.exp(eps) + 1 + rounds))
    return tau * math.log(1 / zeta) / n


class _FilterGaussian(RowsAggregator):
    """Shared body: friend counts, filter, Gaussian noise of std ``noise_std`` per coordinate."""

    def __init__(self, tau: float, noise_multiplier: float, delta_sens: float,
                 sampling: Sampling, min_users_required: int) -> None:
        if sampling.rate < 1.0:
            raise ValueError(f"aggregator={self.name} is replace-one with a public n: it needs "
                             "train.sampling_rate=1 (no amplification claimed)")
        self.tau, self.sampling = float(tau), sampling
        self.noise_multiplier, self.sensitivity = float(noise_multiplier), float(delta_sens)
        self.min_users_required = int(min_users_required)

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * self.sensitivity

    def _filtered(self, G: torch.Tensor, rng: torch.Generator):
        n = self.sampling.population
        V = pad_to_population(G, n)
        counts = friend_counts(V, (self.tau, 2 * self.tau))
        score = concentration_score(counts[0])
        p = keep_probabilities(counts[1], n)
        return V, score, p

    def _noisy(self, mean: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
        noise = torch.randn(mean.shape, generator=rng, dtype=torch.float64)
        return (mean.to(torch.float64) + self.noise_std * noise).to(mean.dtype)

    def _diag(self, G, score, kept, passed) -> dict:
        n = self.sampling.population
        return {"score": score, "score_fraction": score / n, "kept_fraction": kept / n,
                "concentration_check_failed": not passed, "cohort": int(G.shape[0]),
                "min_users_met": n >= self.min_users_required,
                "min_users_required": self.min_users_required}

@register
class OutlierRemovalAggregator(_FilterGaussian):
    """``aggregator=outlier_removal``: [ASI] Alg. 2, one AboveThreshold across all rounds."""

    name = "outlier_removal"
    replace_one = True
    calibrations = ("accountant", "closed_form")
    accountant = ("dp_accounting PLD/RDP for the Gaussian releases; AboveThreshold ε/2 and the "
                  "failure probabilities by basic composition (ApproxDp)")

    def __init__(self, tau: float, noise_multiplier: float, delta_sens: float, sampling: Sampling,
                 eps_at: float, rounds: int, delta_reserved: float, min_users_required: int) -> None:
        super().__init__(tau, noise_multiplier, delta_sens, sampling, min_users_required)
        self.eps_at, self.rounds, self.delta_reserved = float(eps_at), int(rounds), float(delta_reserved)
        self.at: AboveThreshold | None = None
        self.halted_at: int | None = None

    @classmethod
    def calibrated(cls, *, epsilon: float, delta: float, rounds: int, sampling: Sampling,
                   bound: float | None = None, tau: float | None = None,
                   records_per_unit: int | None = None, beta: float = 0.1,
                   accounting: str = "certified", calibration: str = "accountant"
                   ) -> "OutlierRemovalAggregator":
        """[ASI] Alg. 2 for ``rounds`` releases over all ``sampling.population`` units (rate 1)
        meeting (ε, δ): ε/2 for the one AboveThreshold, ε/2 (at δ/2) for the T Gaussian releases,
        δ/4 for AT passing a non-concentrated query, δ/4 for the coupling's ζ over T rounds.

        ``tau``: the filter radius; None derives [ASI] §4.3's bound·sqrt(log(2nT/β)/m) from
        ``bound`` and ``records_per_unit`` m. ``accounting``: ``"certified"`` (explicit
        sensitivity 30τK/n) or ``"paper"`` (the seed's Δ, heuristic). ``calibration``:
        ``"accountant"`` (z from dp-accounting) or ``"closed_form"`` (the seed's σ, refused
        where the accountant does not certify it within ε)."""
        check_budget(epsilon, delta, rounds)
        tau, paper = _filter_options(bound, tau, records_per_unit, beta, accounting, sampling,
                                     rounds, cls.name)
        calibration = choice("calibration", calibration, ("accountant", "closed_form"))
        n = sampling.population
        eps_at = epsilon / 2
        need = min_users_at(eps_at, rounds, delta / 4)
        if n < need:
            raise ParameterError(
                "sampling.population", f"sampling.population must be >= {need} units for "
                f"outlier_removal's privacy proof (7.5 α_AT for AboveThreshold at "
                f"epsilon/2={eps_at:g}, rounds={rounds}, failure delta/4), got {n}", need=need)
        sens = (paper_sensitivity(tau, n, epsilon, delta, rounds) if paper
                else sensitivity(tau, n, delta / (4 * rounds)))
        if calibration == "closed_form":
            z = paper_sigma(tau, n, epsilon, delta, rounds) / sens
            got = eps_at + schedule_epsilon(dp_accounting.GaussianDpEvent, z, rounds, delta / 2)
            if got > epsilon * (1 + 1e-6):
                raise ParameterError(
                    "calibration", f"calibration='closed_form': the paper's σ certifies "
                    f"ε={got:.3g} > epsilon={epsilon:g} with the explicit sensitivity 30τK/n; use "
                    "accounting='paper' (heuristic) or calibration='accountant'", got=got)
        else:
            z = calibrate(dp_accounting.GaussianDpEvent, epsilon - eps_at, delta / 2, rounds)
        agg = cls(tau, z, sens, sampling, eps_at, rounds, delta / 2, need)
        agg.guarantee = "heuristic" if paper else "certified"
        return agg

    def estimate(self, G: torch.Tensor, *, rng: torch.Generator) -> Aggregate:
        if self.at is None:                       # one instance: the threshold drawn once
            seed = int(torch.randint(0, 2 ** 62, (1,), generator=rng))
            self.at = AboveThreshold(4 * self.sampling.population / 5, self.eps_at,
                                     rng=torch.Generator().manual_seed(seed),
                                     sensitivity=SCORE_SENSITIVITY)
        if self.at.halted:
            raise RuntimeError("outlier_removal: AboveThreshold already halted; no more answers")
        V, score, p = self._filtered(G, rng)
        if not self.at.test(score):
            self.halted_at = self.at.queries
            return Aggregate(mean=G.new_zeros(G.shape[1]), users_used=0, halted=True,
                             diagnostics=self._diag(G, score, 0, False) | {"halted": True})
        mean, kept = filtered_mean(V, p, rng=rng)
        return Aggregate(mean=self._noisy(mean, rng), users_used=kept,
                         diagnostics=self._diag(G, score, kept, True))

    def dp_event(self) -> dp_accounting.DpEvent:
        return dp_accounting.GaussianDpEvent(self.noise_multiplier)

    def one_off_event(self) -> ApproxDp:
        """AboveThreshold's pure ε/2 (one instance) and the δ reserved for the failures."""
        return ApproxDp(self.eps_at, self.delta_reserved)

    def checkpoint_state(self) -> dict:
        """The one AboveThreshold across rounds: its noisy threshold, queries, halt and RNG."""
        at = self.at
        return {"halted_at": self.halted_at, "at": None if at is None else {
            "noisy_threshold": float(at.noisy_threshold), "halted": bool(at.halted),
            "queries": int(at.queries), "rng": at.rng.get_state()}}

    def restore_checkpoint_state(self, state: dict) -> None:
        self.halted_at = state["halted_at"]
        saved = state["at"]
        if saved is None:
            self.at = None
            return
        self.at = AboveThreshold(4 * self.sampling.population / 5, self.eps_at,
                                 rng=torch.Generator(), sensitivity=SCORE_SENSITIVITY)
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
    replace_one = True
    closed_form_note = ("has no seed closed form for aggregator=friendlycore (FriendlyCore is "
                        "not one of the seeds)")
    accountant = ("dp_accounting PLD/RDP (Laplace mass check + Gaussian per round); failure "
                  "probabilities in δ by basic composition")

    def __init__(self, tau: float, noise_multiplier: float, delta_sens: float, sampling: Sampling,
                 check_multiplier: float, delta_reserved: float, min_users_required: int) -> None:
        super().__init__(tau, noise_multiplier, delta_sens, sampling, min_users_required)
        self.check_multiplier, self.delta_reserved = float(check_multiplier), float(delta_reserved)

    @property
    def check_scale(self) -> float:
        return self.check_multiplier * MASS_SENSITIVITY

    @classmethod
    def calibrated(cls, *, epsilon: float, delta: float, rounds: int, sampling: Sampling,
                   bound: float | None = None, tau: float | None = None,
                   records_per_unit: int | None = None, beta: float = 0.1,
                   accounting: str = "certified") -> "FriendlyCoreAggregator":
        """FriendlyCore for ``rounds`` releases over all ``sampling.population`` units (rate 1)
        meeting (ε, δ): per round a Laplace mass check (noise multiplier b = z) and a Gaussian
        (z), composed with dp-accounting at δ/2; the rest of δ covers the failure terms.

        ``tau``: the friend radius; None derives bound·sqrt(log(2nT/β)/m) from ``bound`` and
        ``records_per_unit`` m. ``accounting``: ``"certified"`` (sensitivity 2DK/s) or
        ``"paper"`` (the seed's Δ, heuristic). No closed form (always the accountant)."""
        check_budget(epsilon, delta, rounds)
        tau, paper = _filter_options(bound, tau, records_per_unit, beta, accounting, sampling,
                                     rounds, cls.name)
        n = sampling.population
        sens = (paper_sensitivity(tau, n, epsilon, delta, rounds) if paper
                else friendlycore_sensitivity(tau, n, delta / (4 * rounds)))
        z = calibrate(lambda z: friendlycore_round_event(z, z), epsilon, delta / 2, rounds)
        need = n
        while rounds * friendlycore_failure(need, z) <= delta / 4 and need > 1:
            need = max(1, need // 2)
        while rounds * friendlycore_failure(need, z) > delta / 4:
            need += max(1, need // 64)
        if n < need:
            raise ParameterError(
                "sampling.population", f"sampling.population must be >= {need} units for "
                f"friendlycore, so that a release with a small kept set has probability <= "
                f"delta/(4 rounds) (mass check multiplier {z:.3g}), got {n}", need=need, z=z)
        agg = cls(tau, z, sens, sampling, z, delta / 2, need)
        agg.guarantee = "heuristic" if paper else "certified"
        return agg

    def estimate(self, G: torch.Tensor, *, rng: torch.Generator) -> Aggregate:
        n = self.sampling.population
        V = pad_to_population(G, n)
        counts = friend_counts(V, (2 * self.tau,))
        p = friendly_keep_probabilities(counts[0], n)
        mass = float(p.sum())
        noisy = mass + float(laplace((1,), self.check_scale, rng=rng)[0])
        diag = {"kept_mass_fraction": mass / n, "cohort": int(G.shape[0]),
                "min_users_met": n >= self.min_users_required,
                "min_users_required": self.min_users_required}
        if noisy < MASS_RELEASE * n:              # check failed: release 0 this round
            return Aggregate(mean=G.new_zeros(G.shape[1]), users_used=0,
                             diagnostics=diag | {"kept_fraction": 0.0, "concentration_check_failed": True})
        mean, kept = filtered_mean(V, p, rng=rng)
        return Aggregate(mean=self._noisy(mean, rng), users_used=kept,
                         diagnostics=diag | {"kept_fraction": kept / n, "concentration_check_failed": False})

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


def friendlycore_round_event(noise_multiplier: float, check_multiplier: float) -> dp_accounting.DpEvent:
    """One FriendlyCore round: the Laplace mass check (noise multiplier b = scale / 7) and the
    Gaussian release of the kept mean (z = σ/Δ)."""
    return dp_accounting.ComposedDpEvent([dp_accounting.LaplaceDpEvent(check_multiplier),
                                          dp_accounting.GaussianDpEvent(noise_multiplier)])


def friendlycore_failure(n: int, check_multiplier: float) -> float:
    """Per-round probability (either dataset) that a release happens with a kept set smaller than
    MASS_MIN n: check passing with P < MASS_FLOOR n, or |S| < MASS_MIN n given P >= MASS_FLOOR n."""
    false_pass = 0.5 * math.exp(-(MASS_RELEASE - MASS_FLOOR) * n / (MASS_SENSITIVITY * check_multiplier))
    eta = 1 - MASS_MIN / MASS_FLOOR
    small = math.exp(-eta ** 2 * MASS_FLOOR * n / 2)
    return 2 * (false_pass + small)
