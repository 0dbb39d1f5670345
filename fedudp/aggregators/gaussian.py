"""Clip + Gaussian (DP-FedAvg at the privacy unit) and the non-private plain mean.

Clip+Gaussian is not from the seeds; it is the range-based baseline
(docs/algorithms.md#gaussian-mean, docs/algorithms.md#choosing-an-estimator). Under Poisson sampling of units with rate ``q`` from a public population
``N_units`` it releases

    ( sum_{k in S} clip_C(g_k) + N(0, z^2 C^2 I) ) / (q * N_units)

The denominator is a public constant, never the realized cohort |S|. Adjacency is
add/remove-one *unit* (the sampled unit: user, or owner with ``privacy.unit=owner``):
adding or removing one unit moves the pre-noise sum by at most C (replacing one, by at
most 2C). The event is ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` under
``ADD_OR_REMOVE_ONE`` (plain ``GaussianDpEvent(z)`` when q = 1).
"""

from __future__ import annotations

import dp_accounting
import torch

from fedudp.aggregators.base import (
    Aggregate,
    Aggregator,
    ClippedSumAggregator,
    check_noise_scale,
    register,
)
from fedudp.aggregators.plain_values import calibrate, check_budget, check_positive, check_sampling
from fedudp.protocol.contributions import Constraint, Contribution, Sampling

__all__ = [
    "gaussian_round_event",
    "GaussianAggregator",
    "MeanAggregator",
]


@register
class GaussianAggregator(ClippedSumAggregator):
    """Clip each unit's vector to l2 norm ``clip``, sum, add N(0, (z*clip)^2 I), divide by q*N.

    Parameters
    ----------
    clip : float
        The l2 clip norm C of each unit's vector.
    noise_multiplier : float
        z: the noise on the clipped sum is N(0, (z C)² I).
    sampling : Sampling
        Poisson sampling rate q and public population N (the divisor q N).
    noise_scale : float, default 1.0
        1.0, or below 1 for a deliberately weakened mechanism (audits).

    Raises
    ------
    ValueError
        When ``clip`` is not > 0 or the noise multiplier is negative.
    """

    name = "gaussian"
    inputs = ("clip", "epsilon", "delta", "rounds", "sampling", "noise_scale")
    noise_inputs = ("clip", "sampling", "noise_scale")
    private = True

    def __init__(
        self, clip: float, noise_multiplier: float, sampling: Sampling, noise_scale: float = 1.0
    ) -> None:
        """``noise_scale``: 1.0, or below 1 for a deliberately weakened mechanism that checks
        an audit (``audit.noise_scale``: the noise drawn is that times what is accounted)."""
        if not clip > 0:
            raise ValueError(f"privacy.clip must be > 0, got {clip}")
        if not noise_multiplier >= 0:
            raise ValueError(f"noise multiplier must be >= 0, got {noise_multiplier}")
        self.clip = float(clip)
        self.noise_multiplier = float(noise_multiplier)
        self.sampling = sampling
        self.noise_scale = check_noise_scale(noise_scale)

    closed_form_note = (
        "has no closed form for clip+Gaussian (the paper's Alg. 1 constant c2 is unknown)"
    )
    fixed_noise = True

    @classmethod
    def calibrated(
        cls,
        *,
        clip: float,
        epsilon: float,
        delta: float,
        rounds: int,
        sampling: Sampling,
        noise_scale: float = 1.0,
    ) -> GaussianAggregator:
        """Clip to ``clip``, with the smallest noise multiplier z whose ``rounds`` releases,
        Poisson-sampled at ``sampling.rate`` (plain Gaussian at rate 1), meet (ε, δ) under the
        PLD accountant. (A fixed z: ``GaussianAggregator(clip, z, sampling)``.)

        Parameters
        ----------
        clip : float
            The l2 clip norm C.
        epsilon, delta : float
            The target (ε, δ) over the run.
        rounds : int
            The releases the budget covers.
        sampling : Sampling
            The Poisson sampling of the units.
        noise_scale : float, default 1.0
            Below 1: a deliberately weakened mechanism (its accounted noise unchanged).

        Returns
        -------
        GaussianAggregator
            The calibrated estimator.

        Raises
        ------
        ParameterError
            A plain value out of range, or a target the accountant cannot reach.
        """
        check_sampling(sampling)
        check_budget(epsilon, delta, rounds)
        check_positive("clip", clip)
        z = calibrate(lambda s: gaussian_round_event(s, sampling.rate), epsilon, delta, rounds)
        return cls(clip, z, sampling, noise_scale)

    @classmethod
    def with_noise_multiplier(
        cls, noise_multiplier: float, *, clip: float, sampling: Sampling, noise_scale: float = 1.0
    ) -> GaussianAggregator:
        """Clip to ``clip`` with the given noise multiplier (the accountant then tracks ε).

        Parameters
        ----------
        noise_multiplier : float
            z.
        clip : float
            The l2 clip norm C.
        sampling : Sampling
            The Poisson sampling of the units.
        noise_scale : float, default 1.0
            Below 1: a deliberately weakened mechanism.

        Returns
        -------
        GaussianAggregator
            The estimator.
        """
        check_sampling(sampling)
        check_positive("clip", clip)
        check_positive("noise_multiplier", noise_multiplier)
        return cls(clip, noise_multiplier, sampling, noise_scale)

    def release(self, c: Contribution, *, rng: torch.Generator) -> Aggregate:
        """Billboard side: add Gaussian noise to the sum and divide by q * N_units."""
        total = c.total
        assert total is not None  # a clipped-sum estimator receives the sum
        # drawn in float64, added in float64, cast afterwards: float32's sampler is truncated at
        # |z| ≈ 5.77 with a point mass there, which would underestimate δ
        # (docs/algorithms.md#laplace-and-gaussian-noise). Drawn on the CPU generator whatever
        # the sum's device (engine_opts.device): the same seed, the same noise bit for bit
        noise = torch.randn(total.shape, generator=rng, dtype=torch.float64)
        noise *= self.noise_scale  # 1.0 unless audit.noise_scale weakens it on purpose
        mean = (
            (total.to(torch.float64) + (self.noise_std * noise).to(total.device))
            / self.sampling.expected_cohort
        ).to(total.dtype)
        diag = {"clipped_fraction": (c.clipped / c.count) if c.count else 0.0, "cohort": c.count}
        return Aggregate(mean=mean, users_used=c.count, diagnostics=diag)

    def dp_event(self) -> dp_accounting.DpEvent:
        return gaussian_round_event(self.noise_multiplier, self.sampling.rate)


def gaussian_round_event(noise_multiplier: float, rate: float) -> dp_accounting.DpEvent:
    """One clip+Gaussian release (noise multiplier z = sigma / C), Poisson-sampled at ``rate``.

    Parameters
    ----------
    noise_multiplier : float
        z = σ / C.
    rate : float
        The Poisson sampling rate q (1: no amplification).

    Returns
    -------
    dp_accounting.DpEvent
        ``GaussianDpEvent(z)``, Poisson-sampled at ``rate`` where it is below 1.
    """
    g = dp_accounting.GaussianDpEvent(noise_multiplier)
    return g if rate >= 1.0 else dp_accounting.PoissonSampledDpEvent(rate, g)


@register
class MeanAggregator(Aggregator):
    """``aggregator=none``: the plain (non-private) mean of the received vectors (FedAvg).

    Parameters
    ----------
    sampling : Sampling or None, default None
        The cohort's sampling (None: every unit, population 1).
    """

    name = "none"
    inputs = ("sampling",)
    needs_per_user_vectors = False
    private = False

    def __init__(self, sampling: Sampling | None = None) -> None:
        self.sampling = sampling or Sampling(1.0, 1)

    @classmethod
    def calibrated(cls, *, sampling: Sampling | None = None) -> MeanAggregator:
        """Nothing to calibrate (not private): the plain mean.

        Parameters
        ----------
        sampling : Sampling or None, default None
            The cohort's sampling.

        Returns
        -------
        MeanAggregator
            The plain mean.
        """
        if sampling is not None:
            check_sampling(sampling)
        return cls(sampling)

    @property
    def constraint(self) -> Constraint:
        return Constraint(rows=False, clip=None)

    def release(self, c: Contribution, *, rng: torch.Generator | None = None) -> Aggregate:
        return Aggregate(
            mean=c.weighted_mean(), users_used=c.count, diagnostics={"cohort": c.count}
        )

    def dp_event(self) -> dp_accounting.DpEvent:
        return dp_accounting.NonPrivateDpEvent()
