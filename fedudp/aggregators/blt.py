"""Buffered linear Toeplitz noise (``aggregator=dp_mf_blt``): correlated noise from ``nbuf``
buffers, multi-participation sensitivity under b-min-separation, no amplification.

McKenna, "Scaling up the Banded Matrix Factorization Mechanism for Differentially Private ML"
(arXiv:2405.15913); Dvijotham, McMahan, Pillutla, Steinke, Thakurta, "Efficient and
Near-Optimal Noise Generation for Streaming Differential Privacy" (arXiv:2404.16706). Not one
of the seeds; docs/algorithms.md#buffered-linear-toeplitz-blt. The matrix's math (coefficients,
sensitivity, the optimisation of θ, ω) is ``fedudp.privacy.blt``.

**Release.** C is the BLT of decays θ and scales ω optimised for the declared (n = the run's
rounds, b, nbuf) (public). The billboard releases Cx + ζ, ζ_t ~ N(0, (z·sens·clip)² I) iid, and
steps with its post-processing C⁻¹(Cx + ζ) = x + w, w = C⁻¹ζ, computed streaming:
w_t = ζ_t - Σ_i ω_i s_i, then s_i ← θ_i s_i + w_t. The state is the nbuf buffers s (float64,
model-sized); a round holds them and w_t: nbuf + 1 model-sized vectors.

**Participation** (public, declared): the banded mechanism's cyclic groups, b of them from the
seed; round r takes group (r - 1) mod b, each unit of it at rate p = q·b (p = 1: the whole
group). A unit's rounds are at least b apart, at most k = ceil(n / b) of them.

**Sensitivity and event.** C's coefficients are positive and non-increasing, so the worst
pattern is 0, b, 2b, ...: sens² = ||Σ_m C[:, m b]||² (exact, ``minsep_sensitivity_squared``);
with unit noise scaled by sens, the whole run is one Gaussian mechanism of multiplier z under
add/remove-one unit (a subset of that pattern, e.g. a Poisson-thinned one, moves Cx less: the
columns' inner products are non-negative). One ``GaussianDpEvent(z)`` for the run, composed at
round 1 (its other rounds ``NoOpDpEvent``); no amplification by the within-group sampling is
claimed. The denominator is the public N·q.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import torch

from fedudp.aggregators.banded import CyclicPoissonParticipation
from fedudp.aggregators.base import (
    Aggregate,
    ClippedSumAggregator,
    Option,
    ParameterError,
    register,
)
from fedudp.aggregators.plain_values import calibrate, check_budget, check_positive, check_sampling
from fedudp.privacy.blt import (
    blt_coefficients,
    max_participations,
    minsep_sensitivity_squared,
    optimal_blt,
)
from fedudp.protocol.contributions import Contribution, Sampling

__all__ = ["BltAggregator", "BltParticipation", "resolve_separation"]

MAX_BUFFERS = 16


def resolve_separation(min_separation: int | None, rate: float) -> tuple[int, float]:
    """(b, p): the min-separation (default 1 / rate, which must then be whole) and the rate
    p = rate·b at which a round samples its group.

    Parameters
    ----------
    min_separation : int or None
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
        A b that is not a whole number >= 1, or one that gives a group rate above 1.
    """
    q = float(rate)
    if min_separation is None:
        b = round(1.0 / q)
        if b < 1 or abs(b * q - 1.0) > 1e-9:
            raise ParameterError(
                "min_separation",
                f"min_separation: aggregator=dp_mf_blt defaults to b = 1 / train.sampling_rate, "
                f"not whole at rate {q:g}; set estimator.min_separation with b * rate <= 1",
            )
        return b, 1.0
    b = int(min_separation)
    if b < 1 or b != min_separation or q * b > 1.0 + 1e-9:
        raise ParameterError(
            "min_separation",
            f"min_separation must be a whole number in [1, {math.floor(1 / q + 1e-9)}] at "
            f"train.sampling_rate {q:g}, got {min_separation}; set estimator.min_separation",
        )
    return b, min(q * b, 1.0)


def _check_buffers(buffers: int) -> int:
    if int(buffers) != buffers or not 1 <= int(buffers) <= MAX_BUFFERS:
        raise ParameterError(
            "buffers",
            f"buffers must be a whole number in [1, {MAX_BUFFERS}], got {buffers}; "
            "set estimator.buffers (3 to 7 is typical)",
        )
    return int(buffers)


class BltParticipation(CyclicPoissonParticipation):
    """The banded mechanism's cyclic groups for BLT (b groups, round r takes group
    (r - 1) mod b at rate p); the run's event at round 1 (``agg.round_event``).

    Parameters
    ----------
    agg : BltAggregator
        The BLT mechanism.
    seed : int
        The groups' and the sampling's seed.
    """

    agg: BltAggregator  # type: ignore[assignment]

    def __init__(self, agg: BltAggregator, seed: int) -> None:
        super().__init__(agg, seed)  # type: ignore[arg-type]  # reads bands, group_rate, sampling


@register
class BltAggregator(ClippedSumAggregator):
    """Buffered-linear-Toeplitz correlated noise on the cohort's clipped sums (module doc).

    Parameters
    ----------
    clip : float
        The l2 clip norm C.
    noise_multiplier : float
        z of the whole run's Gaussian (ζ's std is z·sens·clip).
    sampling : Sampling
        The units' sampling (cyclic groups, rate q·b within).
    rounds : int
        n, the rounds C is built and its sensitivity computed for.
    buffers : int, default 4
        nbuf.
    min_separation : int or None, default None
        b (None: 1 / rate).
    """

    name = "dp_mf_blt"
    inputs = ("clip", "epsilon", "delta", "rounds", "sampling")
    options = (
        Option("buffers", 4, int, help="nbuf: the noise's model-sized buffers (3 to 7 typical)"),
        Option(
            "min_separation",
            None,
            int,
            nullable=True,
            help="b: a unit's rounds are at least b apart (null: 1 / train.sampling_rate)",
        ),
    )
    noise_inputs = ("clip", "sampling", "rounds", "buffers", "min_separation")
    private = True
    fixed_noise = True
    closed_form_note = "has no closed form for the BLT mechanism (the accountant calibrates it)"

    def __init__(
        self,
        clip: float,
        noise_multiplier: float,
        sampling: Sampling,
        rounds: int,
        buffers: int = 4,
        min_separation: int | None = None,
    ) -> None:
        check_positive("clip", clip)
        check_positive("noise_multiplier", noise_multiplier)
        check_positive("rounds", rounds)
        self.clip = float(clip)
        self.noise_multiplier = float(noise_multiplier)
        self.sampling = sampling
        self.rounds = int(rounds)
        self.buffers = _check_buffers(buffers)
        self.bands, self.group_rate = resolve_separation(min_separation, sampling.rate)
        self.theta, self.omega = optimal_blt(self.rounds, self.bands, self.buffers)
        self.participations = max_participations(self.rounds, self.bands)
        self.sensitivity = math.sqrt(
            minsep_sensitivity_squared(
                blt_coefficients(self.theta, self.omega, self.rounds), self.bands, self.rounds
            )
        )
        self._state: torch.Tensor | None = None  # [nbuf, dim] float64: the buffers s
        self._t = 0

    @property
    def min_separation(self) -> int:
        """b."""
        return self.bands

    @property
    def noise_std(self) -> float:
        """ζ's std per coordinate: z·sens·clip."""
        return self.noise_multiplier * self.sensitivity * self.clip

    @classmethod
    def calibrated(
        cls,
        *,
        clip: float,
        epsilon: float,
        delta: float,
        rounds: int,
        sampling: Sampling,
        buffers: int = 4,
        min_separation: int | None = None,
    ) -> BltAggregator:
        """The smallest z whose one Gaussian for the run meets (ε, δ) (PLD accountant).

        Parameters
        ----------
        clip : float
            The l2 clip norm C.
        epsilon, delta : float
            The target (ε, δ) over the run.
        rounds : int
            n.
        sampling : Sampling
            The units' sampling.
        buffers : int, default 4
            nbuf.
        min_separation : int or None, default None
            b.

        Returns
        -------
        BltAggregator
            The calibrated estimator.

        Raises
        ------
        ParameterError
            A plain value out of range, or an unreachable target.
        """
        check_sampling(sampling)
        check_budget(epsilon, delta, rounds)
        check_positive("clip", clip)
        _check_buffers(buffers)
        resolve_separation(min_separation, sampling.rate)
        z = calibrate(dp_accounting.GaussianDpEvent, epsilon, delta, 1, run_rounds=rounds)
        return cls(clip, z, sampling, rounds, buffers, min_separation)

    @classmethod
    def with_noise_multiplier(
        cls,
        noise_multiplier: float,
        *,
        clip: float,
        sampling: Sampling,
        rounds: int,
        buffers: int = 4,
        min_separation: int | None = None,
    ) -> BltAggregator:
        """with_noise_multiplier.

        Parameters
        ----------
        noise_multiplier : float
            z.
        clip, sampling, rounds, buffers, min_separation
            As for ``calibrated``.

        Returns
        -------
        BltAggregator
            The estimator.
        """
        check_sampling(sampling)
        return cls(clip, noise_multiplier, sampling, rounds, buffers, min_separation)

    def participation(self, seed: int) -> BltParticipation:
        """The billboard's plan: cyclic groups, the run's event at round 1.

        Parameters
        ----------
        seed : int
            The groups' seed.

        Returns
        -------
        BltParticipation
            The plan.
        """
        return BltParticipation(self, seed)

    def round_event(self, round_: int) -> dp_accounting.DpEvent:
        """``GaussianDpEvent(z)`` (the whole run) at round 1, ``NoOpDpEvent`` after.

        Parameters
        ----------
        round_ : int
            The round, from 1.

        Returns
        -------
        dp_accounting.DpEvent
            The round's event.
        """
        if round_ != 1:
            return dp_accounting.NoOpDpEvent()
        return dp_accounting.GaussianDpEvent(self.noise_multiplier)

    def dp_event(self) -> dp_accounting.DpEvent:
        """Round 1's event (the run's); the billboard asks ``round_event`` per round."""
        return self.round_event(1)

    def noise_increment(self, dim: int, rng: torch.Generator) -> torch.Tensor:
        """w_t = ζ_t - Σ_i ω_i s_i, then s_i ← θ_i s_i + w_t (float64; module doc).

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

        Raises
        ------
        ValueError
            Past the declared rounds (C and its sensitivity are for n rounds).
        """
        if self._t >= self.rounds:
            raise ValueError(
                f"aggregator=dp_mf_blt: built for train.rounds={self.rounds}, asked for more"
            )
        if self._state is None:
            self._state = torch.zeros(self.buffers, dim, dtype=torch.float64)
        w = self.noise_std * torch.randn(dim, generator=rng, dtype=torch.float64)
        omega = torch.tensor(np.array(self.omega), dtype=torch.float64)
        theta = torch.tensor(np.array(self.theta), dtype=torch.float64)
        w -= omega @ self._state
        self._state.mul_(theta[:, None]).add_(w)
        self._t += 1
        return w

    def release(self, c: Contribution, *, rng: torch.Generator) -> Aggregate:
        total = c.total
        assert total is not None  # a clipped-sum estimator receives the sum
        # drawn and held on the CPU (float64), moved to the sum's device (engine_opts.device)
        w = self.noise_increment(int(total.numel()), rng).reshape(total.shape).to(total.device)
        mean = ((total.to(torch.float64) + w) / self.sampling.expected_cohort).to(total.dtype)
        diag = {
            "clipped_fraction": (c.clipped / c.count) if c.count else 0.0,
            "cohort": c.count,
            "blt_round": self._t,
        }
        return Aggregate(mean=mean, users_used=c.count, diagnostics=diag)

    def ledger_notes(self) -> list[str]:
        return [
            f"buffered linear Toeplitz (BLT, McKenna 2024; Dvijotham et al. 2024) with "
            f"{self.buffers} buffers (decays {np.round(self.theta, 6).tolist()}, scales "
            f"{np.round(self.omega, 6).tolist()}), optimised for n={self.rounds} rounds at "
            f"min-separation b={self.bands}; participation is cyclic: each unit in one public "
            f"group of {self.bands} (seeded), sampled at rate {self.group_rate:.6g} only in its "
            f"group's rounds, at most k={self.participations} times; sensitivity "
            f"{self.sensitivity:.6g} (worst pattern 0, b, 2b, ...); the whole run is one "
            f"Gaussian of multiplier z={self.noise_multiplier:.6g} (no amplification), composed "
            "at round 1; the denominator is the public N*q"
        ]

    def checkpoint_state(self) -> dict:
        return {
            "t": self._t,
            "buffers": None if self._state is None else self._state.clone(),
            # the matrix the stream so far used: a resumed run must go on with the same one
            # (the sensitivity is that of one Toeplitz C over the whole run)
            "theta": [float(x) for x in self.theta],
            "omega": [float(x) for x in self.omega],
        }

    def restore_checkpoint_state(self, state: dict) -> None:
        if set(state) != {"t", "buffers", "theta", "omega"}:
            raise ValueError(f"aggregator={self.name}: unexpected state {sorted(state)}")
        theta, omega = [float(x) for x in state["theta"]], [float(x) for x in state["omega"]]
        if len(theta) != self.buffers or len(omega) != self.buffers:
            raise ValueError(
                f"aggregator={self.name}: the checkpoint has {len(theta)} buffers, "
                f"estimator.buffers={self.buffers}"
            )
        # go on with the checkpoint's matrix (another machine's optimiser may differ in the
        # last digits), and its sensitivity, so that z = sigma / sensitivity stays the run's
        self.theta, self.omega = np.array(theta), np.array(omega)
        self.sensitivity = math.sqrt(
            minsep_sensitivity_squared(
                blt_coefficients(self.theta, self.omega, self.rounds), self.bands, self.rounds
            )
        )
        self._t = int(state["t"])
        s = state["buffers"]
        self._state = None if s is None else s.to(torch.float64).clone()
