"""Outlier-removal user-level mean estimation: Asi & Liu [ASI, seed 003] Algorithm 2 after
FriendlyCore (Tsfadia et al. 2022); docs/algorithms.md#outlier-removal.

Pieces (pure functions, vectorized, on the vectors' device); the friend counts are
``fedudp.aggregators.friend_counts``'s, the filter's shared body (keep, average, Gaussian
noise) ``fedudp.aggregators.friend_filter``'s:

* ``concentration_score``: s = (1/n) Σ_j Σ_j' 1(||v_j - v_j'|| <= τ) ∈ [0, n]. Replacing one
  user changes at most 2(n-1) indicators, so s has sensitivity 2(n-1)/n < 2, not the 1 the
  paper's AboveThreshold assumes: both its noises are scaled by ``SCORE_SENSITIVITY = 2``.
  The score goes to AboveThreshold as a bracket (``AboveThreshold.test_between``) and is
  computed exactly only if the drawn noise leaves the test open.
* ``keep_probabilities``: p_j = 0 if f_j < n/2, 1 if f_j >= 2n/3, (f_j - n/2)/(n/6) between,
  with f_j the count within 2τ.

``OutlierRemovalAggregator`` (``aggregator=outlier_removal``; unit: user, or owner with
``privacy.unit=owner``; adjacency **replace-one** with a public n: every unit every round,
missing rows count as zero vectors): [ASI] Alg. 2 with **one** AboveThreshold instance (budget
ε/2, threshold 4n/5) across all T rounds; on ⊥ it outputs 0 and halts the run
(``halted_at_round`` in summary.json). The per-round alternative is FriendlyCore
(``fedudp.aggregators.friendlycore``).

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

from fedudp.aggregators.base import BETA, BOUND, TAU, Aggregate, ParameterError, register
from fedudp.aggregators.friend_counts import bracketed, decided_counts, exact_bounds
from fedudp.aggregators.friend_filter import (
    COUPLING_MEAN,
    FilterGaussian,
    chernoff_count,
    filter_options,
    filtered_mean,
    paper_sensitivity,
)
from fedudp.aggregators.plain_values import calibrate, check_budget, choice
from fedudp.privacy.accountant import ApproxDp, schedule_epsilon
from fedudp.privacy.mechanisms import AboveThreshold
from fedudp.protocol.contributions import Sampling

__all__ = [
    "DIAMETER_FACTOR",
    "SCORE_SENSITIVITY",
    "OutlierRemovalAggregator",
    "at_false_pass",
    "concentration_score",
    "keep_probabilities",
    "min_users_at",
    "paper_sigma",
    "sensitivity",
]

SCORE_SENSITIVITY = 2.0
DIAMETER_FACTOR = 30.0  # Δ = 30 τ K / n (docs/algorithms.md#outlier-removal)


def concentration_score(counts_tau: torch.Tensor) -> float:
    """s = (1/n) Σ_j #{j' within τ of j} ∈ [0, n] (sensitivity < 2 under replace-one).

    Parameters
    ----------
    counts_tau : torch.Tensor
        The friend counts within τ, [n].

    Returns
    -------
    float
        s.
    """
    n = counts_tau.numel()
    return float(counts_tau.sum()) / n if n else 0.0


def keep_probabilities(counts_2tau: torch.Tensor, n: int) -> torch.Tensor:
    """[ASI] Alg. 2: p = clip((f - n/2)/(n/6), 0, 1) with f the friends within 2τ.

    Parameters
    ----------
    counts_2tau : torch.Tensor
        The friend counts within 2τ, [n].
    n : int
        The public n.

    Returns
    -------
    torch.Tensor
        p, [n] float64.
    """
    return ((counts_2tau.to(torch.float64) - n / 2) / (n / 6)).clamp(0.0, 1.0)


def sensitivity(tau: float, n: int, zeta: float) -> float:
    """Replace-one l2 sensitivity of the filtered mean under the good event, w.p. >= 1-ζ.

    Parameters
    ----------
    tau : float
        τ.
    n : int
        The public n.
    zeta : float
        ζ, the coupling's failure probability.

    Returns
    -------
    float
        Δ = 30 τ K(ζ) / n.
    """
    return DIAMETER_FACTOR * tau * (1 + chernoff_count(COUPLING_MEAN, zeta)) / n


def at_false_pass(n: int, eps_at: float, queries: int) -> float:
    """Probability that some ⊤ of an AboveThreshold(ε_AT, threshold 4n/5, sensitivity 2) over
    ``queries`` queries comes from a query below 2n/3: γ with α_AT(γ) = 2n/15
    (docs/algorithms.md#abovethreshold), i.e.
    γ = 2T exp(-(2n/15) ε_AT / (8·2)).

    Parameters
    ----------
    n : int
        The public n.
    eps_at : float
        ε_AT.
    queries : int
        T.

    Returns
    -------
    float
        γ (at most 1).
    """
    return min(1.0, 2 * queries * math.exp(-(2 * n / 15) * eps_at / (8 * SCORE_SENSITIVITY)))


def min_users_at(eps_at: float, queries: int, gamma: float) -> int:
    """n >= 7.5 α_AT with α_AT = 8·2·log(2T/γ)/ε_AT (so that 4n/5 - α_AT >= 2n/3; [ASI]
    Prop. 3.6 with the score's sensitivity 2).

    Parameters
    ----------
    eps_at : float
        ε_AT.
    queries : int
        T.
    gamma : float
        The failure probability γ.

    Returns
    -------
    int
        The smallest n.
    """
    return math.ceil(7.5 * 8 * SCORE_SENSITIVITY * math.log(2 * queries / gamma) / eps_at)


def paper_sigma(tau: float, n: int, eps: float, delta: float, rounds: int) -> float:
    """[ASI] Alg. 2 per-coordinate noise std, as written (paper mode).

    Parameters
    ----------
    tau : float
        τ.
    n : int
        The public n.
    eps, delta : float
        The target (ε, δ).
    rounds : int
        T.

    Returns
    -------
    float
        σ per coordinate.
    """
    var = (
        8
        * tau**2
        * rounds
        * math.log(math.exp(eps) * rounds / delta)
        * math.log(math.exp(eps / 2) / delta)
        / (n**2 * eps**2)
    )
    return math.sqrt(var)


@register
class OutlierRemovalAggregator(FilterGaussian):
    """``aggregator=outlier_removal``: [ASI] Alg. 2, one AboveThreshold across all rounds.

    Parameters
    ----------
    tau : float
        The filter radius τ.
    noise_multiplier : float
        z = σ / Δ.
    delta_sens : float
        Δ, the kept mean's replace-one sensitivity.
    sampling : Sampling
        Rate 1 and the public n.
    eps_at : float
        AboveThreshold's pure ε.
    rounds : int
        T (AboveThreshold's queries).
    delta_reserved : float
        The δ the failure probabilities take.
    min_users_required : int
        The n AboveThreshold's proof needs.
    """

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
        The derived ``tau``: [ASI] §4.3's bound·sqrt(log(2nT/β)/m).

        Parameters
        ----------
        epsilon, delta : float
            The target (ε, δ) over the run.
        rounds : int
            T.
        sampling : Sampling
            Rate 1 and the public n.
        bound : float or None, default None
            The a-priori bound on each unit's vector (derives ``tau`` when it is None).
        tau : float or None, default None
            The filter radius.
        records_per_unit : int or None, default None
            m, for the derived ``tau``.
        beta : float, default 0.1
            The failure probability of the derived ``tau``.
        accounting : {"certified", "paper"}, default "certified"
            The explicit sensitivity 30τK/n, or the seed's Δ (heuristic).
        calibration : {"accountant", "closed_form"}, default "accountant"
            z from dp-accounting, or the seed's σ (refused where the accountant does not certify
            it within ε).

        Returns
        -------
        OutlierRemovalAggregator
            The calibrated estimator (``as_heuristic`` with ``accounting="paper"``).

        Raises
        ------
        ParameterError
            A plain value out of range, too few units for AboveThreshold's proof, or a closed form
            the accountant does not certify.
        """
        check_budget(epsilon, delta, rounds)
        tau, paper = filter_options(
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
            z = _closed_form_z(tau, n, epsilon, delta, rounds, eps_at, sens)
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


def _closed_form_z(
    tau: float, n: int, epsilon: float, delta: float, rounds: int, eps_at: float, sens: float
) -> float:
    """``calibration='closed_form'``: the paper's σ over the sensitivity, refused (a
    ``ParameterError`` naming calibration) where the accountant does not certify it within ε."""
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
    return z
