"""FriendlyCore (Tsfadia et al. 2022) as its own per-round user-level mean estimator
(``aggregator=friendlycore``; docs/algorithms.md#friendlycore).

Each round: a fresh Laplace check of the kept mass (pure, ``LaplaceDpEvent``), the filter and
the Gaussian mean; a failed check releases 0 for that round (no halt). Its check costs compose
over rounds (about sqrt(T) units needed, against log T for outlier removal's one
AboveThreshold, ``fedudp.aggregators.outlier``). The friend counts: ``fedudp.aggregators.
friend_counts``; the shared filter body: ``fedudp.aggregators.friend_filter``.

Unit: user, or owner with ``privacy.unit=owner``; adjacency **replace-one** with a public n
(every unit every round, missing rows count as zero vectors).
"""

from __future__ import annotations

import math

import dp_accounting
import torch

from fedudp.aggregators.base import BETA, BOUND, TAU, Aggregate, ParameterError, register
from fedudp.aggregators.friend_counts import decided_counts
from fedudp.aggregators.friend_filter import (
    COUPLING_MEAN,
    FilterGaussian,
    chernoff_count,
    filter_options,
    filtered_mean,
    paper_sensitivity,
)
from fedudp.aggregators.plain_values import calibrate, check_budget
from fedudp.privacy.accountant import ApproxDp
from fedudp.privacy.mechanisms import laplace
from fedudp.protocol.contributions import Sampling

__all__ = [
    "MASS_FLOOR",
    "MASS_MIN",
    "MASS_RELEASE",
    "MASS_SENSITIVITY",
    "FriendlyCoreAggregator",
    "friendly_keep_probabilities",
    "friendlycore_failure",
    "friendlycore_round_event",
    "friendlycore_sensitivity",
]


@register
class FriendlyCoreAggregator(FilterGaussian):
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

    Parameters
    ----------
    tau : float
        The friend radius τ.
    noise_multiplier : float
        z = σ / Δ.
    delta_sens : float
        Δ, the kept mean's replace-one sensitivity.
    sampling : Sampling
        Rate 1 and the public n.
    check_multiplier : float
        b: the mass check's Laplace noise multiplier.
    delta_reserved : float
        The δ the failure terms take.
    min_users_required : int
        The n the failure terms need.
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
        ``"paper"`` (the seed's Δ, heuristic). No closed form (always the accountant).

        Parameters
        ----------
        epsilon, delta : float
            The target (ε, δ) over the run.
        rounds : int
            T.
        sampling : Sampling
            Rate 1 and the public n.
        bound : float or None, default None
            The a-priori bound (derives ``tau`` when it is None).
        tau : float or None, default None
            The friend radius.
        records_per_unit : int or None, default None
            m, for the derived ``tau``.
        beta : float, default 0.1
            The failure probability of the derived ``tau``.
        accounting : {"certified", "paper"}, default "certified"
            The sensitivity.

        Returns
        -------
        FriendlyCoreAggregator
            The calibrated estimator (``as_heuristic`` with ``accounting="paper"``).

        Raises
        ------
        ParameterError
            A plain value out of range, or too few units for the failure terms.
        """
        check_budget(epsilon, delta, rounds)
        tau, paper = filter_options(
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
MASS_RELEASE = 0.15  # the check passes when the noisy kept mass is at least this fraction of n
MASS_FLOOR = 0.10  # a pass with a kept mass below this fraction of n is a failure (in δ)
MASS_MIN = 0.05  # s / n: the smallest kept set the sensitivity assumes


def friendly_keep_probabilities(counts_2tau: torch.Tensor, n: int) -> torch.Tensor:
    """p = clip((f - n/2 - 1)/(n/6), 0, 1): positive only with more than n/2 + 1 friends.

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
    return ((counts_2tau.to(torch.float64) - n / 2 - 1) / (n / 6)).clamp(0.0, 1.0)


def friendlycore_sensitivity(tau: float, n: int, zeta: float) -> float:
    """2 D K / s with D = 4τ, s = MASS_MIN n, K = 2 + Chernoff(6, ζ) (see the class docstring).

    Parameters
    ----------
    tau : float
        τ.
    n : int
        The public n.
    zeta : float
        ζ.

    Returns
    -------
    float
        Δ.
    """
    return 2 * 4 * tau * (2 + chernoff_count(COUPLING_MEAN, zeta)) / (MASS_MIN * n)


def friendlycore_round_event(
    noise_multiplier: float, check_multiplier: float
) -> dp_accounting.DpEvent:
    """One FriendlyCore round: the Laplace mass check (noise multiplier b = scale / 7) and the
    Gaussian release of the kept mean (z = σ/Δ).

    Parameters
    ----------
    noise_multiplier : float
        z.
    check_multiplier : float
        b.

    Returns
    -------
    dp_accounting.DpEvent
        The composed Laplace and Gaussian events.
    """
    return dp_accounting.ComposedDpEvent(
        [
            dp_accounting.LaplaceDpEvent(check_multiplier),
            dp_accounting.GaussianDpEvent(noise_multiplier),
        ]
    )


def friendlycore_failure(n: int, check_multiplier: float) -> float:
    """Per-round probability (either dataset) that a release happens with a kept set smaller than
    MASS_MIN n: check passing with P < MASS_FLOOR n, or |S| < MASS_MIN n given P >= MASS_FLOOR n.

    Parameters
    ----------
    n : int
        The public n.
    check_multiplier : float
        b.

    Returns
    -------
    float
        The per-round failure probability.
    """
    false_pass = 0.5 * math.exp(
        -(MASS_RELEASE - MASS_FLOOR) * n / (MASS_SENSITIVITY * check_multiplier)
    )
    eta = 1 - MASS_MIN / MASS_FLOOR
    small = math.exp(-(eta**2) * MASS_FLOOR * n / 2)
    return 2 * (false_pass + small)
