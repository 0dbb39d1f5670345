"""Banded matrix factorization (``aggregator=dp_mf_banded``): correlated noise with
multi-participation accounting and amplification by sampling.

The factorization is the banded square root (BSR) of Kalinin & Lampert, "Banded Square Root
Matrix Factorization for Differentially Private Model Training", NeurIPS 2024
(arXiv:2405.13763); its participation scheme and privacy analysis are those of Choquette-Choo,
Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix Factorization: A
unified approach to private training", NeurIPS 2023 (arXiv:2306.08153), "cyclic Poisson"
sampling. Not one of the seeds; docs/algorithms.md#banded-matrix-factorization.

**The factorization.** SGD's shared parameters after round t are θ_0 - η·(x_1 + ... + x_t): the
workload is the prefix-sum matrix A (lower-triangular ones). Its square root is the Toeplitz
matrix with coefficients c_k = binom(2k, k) / 4^k (the series of (1 - x)^(-1/2): 1, 1/2, 3/8,
5/16, ...), so C·C = A. BSR keeps the first b of them (C is b-banded, lower-triangular
Toeplitz) and scales them so that every column has l2 norm at most 1: C̃ = C / ||c||, where
||c||² = c_0² + ... + c_{b-1}². The billboard releases C̃x + ζ with ζ_t ~ N(0, (zC)² I)
independent; what it steps with is its post-processing C̃⁻¹(C̃x + ζ) = x + w, w = C̃⁻¹ζ. The
recursion u_t = ζ_t - Σ_{k=1}^{b-1} c_k u_{t-k}, w_t = ||c|| u_t computes w online holding
b - 1 vectors (float64). b = 1 is clip + Gaussian (no correlation).

**Participation** (public, declared, never read from the data): each unit gets one of b groups
from the run's seed (``numpy_rng(seed, SCHEDULE, 0).integers(b, size=N)``, unit i's group
depends on i alone), round r draws its cohort from group (r - 1) mod b only, each unit of the
group independently with probability p = q·b (``numpy_rng(seed, SAMPLE, r)``); p = 1 takes
the whole group. So two rounds a unit can be in are at least b apart ("b-min-separation").

**Sensitivity and event.** C̃'s column j is non-zero in rows j..j+b-1 only, so the columns of
two rounds b or more apart have disjoint supports: a unit's participations move disjoint rows
of C̃x, each by at most C (its clipped vector) times a column norm <= 1. Choquette-Choo et al.
(2023, their amplification theorem for cyclic Poisson sampling) show that b-banded C̃ with column norms <= 1 under cyclic Poisson sampling has
exactly the privacy of DP-SGD with ceil(T / b) steps of sampling rate p and noise multiplier z:
one ``PoissonSampledDpEvent(p, GaussianDpEvent(z))`` (``GaussianDpEvent(z)`` at p = 1) per
cycle of b rounds, under add/remove-one unit, composed by the PLD accountant at the cycle's
first round (its other rounds are ``NoOpDpEvent``). The denominator is the public expected
cohort N·q.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import torch

from fedudp.aggregators.base import (
    Aggregate,
    ClippedSumAggregator,
    Option,
    ParameterError,
    register,
)
from fedudp.aggregators.plain_values import calibrate, check_budget, check_positive, check_sampling
from fedudp.aggregators.tree import CyclicParticipation
from fedudp.protocol.contributions import Contribution, Sampling
from fedudp.randomness import Purpose, numpy_rng

__all__ = [
    "BandedMatrixAggregator",
    "bsr_coefficients",
    "cycle_event",
    "cycles",
    "CyclicPoissonParticipation",
    "resolve_bands",
    "strategy_matrix",
]


def bsr_coefficients(bands: int) -> np.ndarray:
    """The first ``bands`` coefficients of the square root of the prefix-sum matrix:
    c_k = binom(2k, k) / 4^k (float64; c_0 = 1), computed as c_k = c_{k-1}·(2k - 1)/(2k).

    Parameters
    ----------
    bands : int
        b.

    Returns
    -------
    numpy.ndarray
        [b] float64.

    Raises
    ------
    ParameterError
        When ``bands`` < 1.
    """
    if int(bands) < 1:
        raise ParameterError("bands", f"bands must be >= 1, got {bands}")
    c = np.ones(int(bands), dtype=np.float64)
    for k in range(1, int(bands)):
        c[k] = c[k - 1] * (2 * k - 1) / (2 * k)
    return c


def strategy_matrix(bands: int, rounds: int) -> np.ndarray:
    """C̃ over ``rounds`` rounds: the b-banded lower-triangular Toeplitz matrix of the BSR
    coefficients, scaled to column norms <= 1 (for tests and the docs; the release never
    builds it).

    Parameters
    ----------
    bands : int
        b.
    rounds : int
        T.

    Returns
    -------
    numpy.ndarray
        [T, T] float64.
    """
    c = bsr_coefficients(bands)
    c = c / np.linalg.norm(c)
    m = np.zeros((rounds, rounds))
    for k, v in enumerate(c):
        m += v * np.eye(rounds, k=-k)
    return m


def resolve_bands(bands: int | None, rate: float) -> tuple[int, float]:
    """(b, p): the bands (default 1 / rate, which must then be whole) and the rate p = rate·b
    at which a round samples its group (a ``ParameterError`` naming what to change).

    Parameters
    ----------
    bands : int or None
        b (None: 1 / rate).
    rate : float
        The sampling rate.

    Returns
    -------
    tuple of (int, float)
        (b, p).

    Raises
    ------
    ParameterError
        ``bands`` not a whole number >= 1, or a rate that gives no valid group rate p.
    """
    q = float(rate)
    if bands is None:
        b = round(1.0 / q)
        if b < 1 or abs(b * q - 1.0) > 1e-9:
            raise ParameterError(
                "bands",
                f"bands: aggregator=dp_mf_banded defaults to "
                f"b = 1 / train.sampling_rate, which is not whole at rate {q:g}; "
                "set estimator.bands to b with b * train.sampling_rate <= 1",
            )
        return b, 1.0
    b = int(bands)
    if b < 1 or b != bands:
        raise ParameterError("bands", f"bands must be a whole number >= 1, got {bands}")
    p = q * b
    if p > 1.0 + 1e-9:
        raise ParameterError(
            "bands",
            f"bands: b = {b} groups at train.sampling_rate {q:g} "
            f"would sample each group at rate {p:g} > 1; use "
            f"estimator.bands <= {math.floor(1 / q + 1e-9)}",
        )
    return b, min(p, 1.0)


def cycle_event(noise_multiplier: float, group_rate: float) -> dp_accounting.DpEvent:
    """One cycle of b rounds: one DP-SGD step of rate p and multiplier z (module doc).

    Parameters
    ----------
    noise_multiplier : float
        z.
    group_rate : float
        p.

    Returns
    -------
    dp_accounting.DpEvent
        The cycle's event.
    """
    g = dp_accounting.GaussianDpEvent(noise_multiplier)
    return g if group_rate >= 1.0 else dp_accounting.PoissonSampledDpEvent(group_rate, g)


def cycles(rounds: int, bands: int) -> int:
    """ceil(T / b): the cycles a T-round run starts (each unit at most once per cycle).

    Parameters
    ----------
    rounds : int
        T.
    bands : int
        b.

    Returns
    -------
    int
        ceil(T / b).
    """
    return -(-int(rounds) // int(bands))


class CyclicPoissonParticipation(CyclicParticipation):
    """The billboard's plan (the hooks of ``fedudp.billboard.plan.Plan``, as the tree's): round r
    samples group (r - 1) mod b at rate p; the cycle's event at its first round, nothing at the
    others (``round_event``).

    Parameters
    ----------
    agg : BandedMatrixAggregator
        The banded mechanism.
    seed : int
        The groups' and the sampling's seed.
    """

    # the banded mechanism in the tree's slot: the hooks read only what both have (round_event,
    # sampling); a different class, not a subtype of TreeAggregator
    agg: BandedMatrixAggregator  # type: ignore[assignment]

    def __init__(self, agg: BandedMatrixAggregator, seed: int) -> None:
        self.agg = agg
        self.seed = int(seed)
        self.group = numpy_rng(seed, Purpose.SCHEDULE, 0).integers(
            0, agg.bands, size=agg.sampling.population
        )

    def sample(self, round_: int) -> np.ndarray:
        """The units of round ``round_``: its group, Poisson-sampled at the group rate.

        Parameters
        ----------
        round_ : int
            The round, from 1.

        Returns
        -------
        numpy.ndarray
            Bool mask over the units.
        """
        mask = self.group == (round_ - 1) % self.agg.bands
        if self.agg.group_rate < 1.0:
            mask &= (
                numpy_rng(self.seed, Purpose.SAMPLE, round_).random(mask.size) < self.agg.group_rate
            )
        return mask


@register
class BandedMatrixAggregator(ClippedSumAggregator):
    """BSR-banded correlated noise on the cohort's clipped sums (module doc).

    Parameters
    ----------
    clip : float
        The l2 clip norm C.
    noise_multiplier : float
        z.
    sampling : Sampling
        The units' sampling (cyclic groups of rate 1/b, Poisson within).
    bands : int or None, default None
        b (None: 1 / rate).
    """

    name = "dp_mf_banded"
    inputs = ("clip", "epsilon", "delta", "rounds", "sampling")
    options = (
        Option(
            "bands",
            None,
            int,
            nullable=True,
            help="the bands b of the noise's correlation (null: 1 / train.sampling_rate)",
        ),
    )
    noise_inputs = ("clip", "sampling", "bands")
    private = True
    fixed_noise = True
    closed_form_note = (
        "has no closed form for the banded matrix mechanism (the accountant calibrates it)"
    )

    def __init__(
        self, clip: float, noise_multiplier: float, sampling: Sampling, bands: int | None = None
    ) -> None:
        check_positive("clip", clip)
        check_positive("noise_multiplier", noise_multiplier)
        self.clip = float(clip)
        self.noise_multiplier = float(noise_multiplier)
        self.sampling = sampling
        self.bands, self.group_rate = resolve_bands(bands, sampling.rate)
        self.coefficients = bsr_coefficients(self.bands)
        self.scale = float(np.linalg.norm(self.coefficients))  # ||c||: C̃⁻¹ = ||c|| C⁻¹
        self._history: list[torch.Tensor] = []  # u_{t-1}, u_{t-2}, ... (at most b - 1)
        self._t = 0

    @classmethod
    def calibrated(
        cls,
        *,
        clip: float,
        epsilon: float,
        delta: float,
        rounds: int,
        sampling: Sampling,
        bands: int | None = None,
    ) -> BandedMatrixAggregator:
        """The smallest z whose ceil(T / b) cycles meet (ε, δ) under the PLD accountant.

        Parameters
        ----------
        clip : float
            The l2 clip norm C.
        epsilon, delta : float
            The target (ε, δ) over the run.
        rounds : int
            T.
        sampling : Sampling
            The units' sampling.
        bands : int or None, default None
            b (None: 1 / rate).

        Returns
        -------
        BandedMatrixAggregator
            The calibrated estimator.

        Raises
        ------
        ParameterError
            A plain value out of range, or an unreachable target.
        """
        check_sampling(sampling)
        check_budget(epsilon, delta, rounds)
        check_positive("clip", clip)
        b, p = resolve_bands(bands, sampling.rate)
        z = calibrate(
            lambda s: cycle_event(s, p), epsilon, delta, cycles(rounds, b), run_rounds=rounds
        )
        return cls(clip, z, sampling, bands)

    @classmethod
    def with_noise_multiplier(
        cls, noise_multiplier: float, *, clip: float, sampling: Sampling, bands: int | None = None
    ) -> BandedMatrixAggregator:
        """with_noise_multiplier.

        Parameters
        ----------
        noise_multiplier : float
            z.
        clip, sampling, bands
            As for ``calibrated``.

        Returns
        -------
        BandedMatrixAggregator
            The estimator.
        """
        check_sampling(sampling)
        check_positive("clip", clip)
        check_positive("noise_multiplier", noise_multiplier)
        return cls(clip, noise_multiplier, sampling, bands)

    def participation(self, seed: int) -> CyclicPoissonParticipation:
        """The billboard's plan: cyclic groups, Poisson within, one event per cycle.

        Parameters
        ----------
        seed : int
            The groups' seed.

        Returns
        -------
        CyclicPoissonParticipation
            The plan.
        """
        return CyclicPoissonParticipation(self, seed)

    def round_event(self, round_: int) -> dp_accounting.DpEvent:
        """The cycle's event at its first round, ``NoOpDpEvent`` at its other rounds.

        Parameters
        ----------
        round_ : int
            The round, from 1.

        Returns
        -------
        dp_accounting.DpEvent
            The round's event.
        """
        if (round_ - 1) % self.bands:
            return dp_accounting.NoOpDpEvent()
        return cycle_event(self.noise_multiplier, self.group_rate)

    def dp_event(self) -> dp_accounting.DpEvent:
        """Round 1's event (a cycle's); the billboard asks ``round_event`` per round."""
        return self.round_event(1)

    def noise_increment(self, dim: int, rng: torch.Generator) -> torch.Tensor:
        """w_t = ||c|| u_t, u_t = ζ_t - Σ_k c_k u_{t-k}, ζ_t ~ N(0, (zC)² I) (float64).

        Parameters
        ----------
        dim : int
            The vectors' length.
        rng : torch.Generator
            The release's generator.

        Returns
        -------
        torch.Tensor
            w_t, [dim] float64.
        """
        u = self.noise_std * torch.randn(dim, generator=rng, dtype=torch.float64)
        for k, prev in enumerate(self._history, start=1):
            u -= float(self.coefficients[k]) * prev
        self._t += 1
        if self.bands > 1:
            self._history = [u, *self._history][: self.bands - 1]
        return self.scale * u

    def release(self, c: Contribution, *, rng: torch.Generator) -> Aggregate:
        total = c.total
        assert total is not None  # a clipped-sum estimator receives the sum
        # drawn and held on the CPU (float64), moved to the sum's device (engine_opts.device)
        w = self.noise_increment(int(total.numel()), rng).reshape(total.shape).to(total.device)
        mean = ((total.to(torch.float64) + w) / self.sampling.expected_cohort).to(total.dtype)
        diag = {
            "clipped_fraction": (c.clipped / c.count) if c.count else 0.0,
            "cohort": c.count,
            "band_round": (self._t - 1) % self.bands + 1,
        }
        return Aggregate(mean=mean, users_used=c.count, diagnostics=diag)

    def ledger_notes(self) -> list[str]:
        return [
            f"banded matrix factorization (BSR, Kalinin & Lampert 2024) with {self.bands} "
            f"bands, column norms <= 1 (||c|| = {self.scale:.6g}); participation is cyclic "
            f"Poisson, not plain Poisson: each unit is in one public group of {self.bands} "
            f"(seeded), sampled at rate {self.group_rate:.6g} only in its group's rounds, so "
            f"its rounds are at least {self.bands} apart; each cycle of {self.bands} rounds "
            f"is one Poisson-sampled Gaussian of multiplier {self.noise_multiplier:.6g} "
            "(Choquette-Choo et al. 2023), composed at the cycle's first round; the "
            "denominator is the public N*q"
        ]

    def checkpoint_state(self) -> dict:
        return {"t": self._t, "history": [v.clone() for v in self._history]}

    def restore_checkpoint_state(self, state: dict) -> None:
        if set(state) != {"t", "history"}:
            raise ValueError(f"aggregator={self.name}: unexpected state {sorted(state)}")
        self._t = int(state["t"])
        self._history = [v.to(torch.float64) for v in state["history"]]
