"""Clip + Gaussian with an adaptive clip norm (``privacy.clip_policy=adaptive``).

Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with Adaptive Clipping",
NeurIPS 2021 (arXiv:1905.03871), Algorithm 1 with the geometric update. Not one of the seeds;
docs/algorithms.md#adaptive-clipping.

Each round the owners clip their sampled units' vectors to the current clip norm ``C_t`` (public:
it is computed from earlier releases only) and send, beside the clipped sum, how many of the units
were *not* clipped, ``Σ b_i`` with ``b_i = 1[||Δ_i|| <= C_t]``. The billboard releases two noisy
sums of the same Poisson-sampled cohort S:

    mean  = ( Σ_S clip_C(Δ_i) + N(0, (z_Δ C_t)² I) ) / (q N)
    b̄     = ( Σ_S (b_i - 1/2) + N(0, σ_b²) ) / (q N) + 1/2
    C_t+1 = C_t · exp(-η (b̄ - γ))

with γ the target quantile of the units' norms and η the clip's learning rate. Adding or removing
one unit moves the first sum by at most C_t in l2 and the second by exactly 1/2, so the pair,
each coordinate divided by its noise's std, is one Gaussian mechanism of l2 sensitivity
sqrt(z_Δ⁻² + (2 σ_b)⁻²): its effective noise multiplier is

    z = (z_Δ⁻² + (2 σ_b)⁻²)^(-1/2)        (the paper's Theorem 1)

and one round is ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` under add/remove-one unit,
exactly the event of a fixed-clip release with multiplier z. Calibration therefore finds z as for
fixed clipping and splits it: σ_b is given (default: the expected cohort / 20, the paper's
choice), and the update's share is z_Δ = (z⁻² - (2 σ_b)⁻²)^(-1/2), which needs 2 σ_b > z.
The denominators are the public q N, never the realized cohort.
"""

from __future__ import annotations

import math

import dp_accounting
import torch

from fedudp.aggregators.base import (
    Aggregate,
    ClippedSumAggregator,
    ParameterError,
    check_noise_scale,
    register,
)
from fedudp.aggregators.gaussian import gaussian_round_event
from fedudp.aggregators.plain_values import (
    calibrate,
    check_budget,
    check_fraction,
    check_positive,
    check_sampling,
)
from fedudp.protocol.contributions import Contribution, Sampling

__all__ = [
    "COUNT_NOISE_DIVISOR",
    "DEFAULT_CLIP_LR",
    "DEFAULT_QUANTILE",
    "AdaptiveClipGaussian",
    "effective_noise_multiplier",
    "next_clip",
    "update_noise_multiplier",
]

COUNT_NOISE_DIVISOR = 20.0  # σ_b = expected cohort / 20 (the paper's Section 3 default)
DEFAULT_QUANTILE = 0.5
DEFAULT_CLIP_LR = 0.2


def update_noise_multiplier(noise_multiplier: float, count_noise: float) -> float:
    """z_Δ with (z_Δ⁻² + (2 σ_b)⁻²)^(-1/2) = z: the update's share of the effective multiplier z
    when the count carries noise σ_b (infinite when z = 0 is asked, an error when 2 σ_b <= z).

    Parameters
    ----------
    noise_multiplier : float
        The effective z.
    count_noise : float
        σ_b.

    Returns
    -------
    float
        z_Δ, the noise multiplier of the update sum.

    Raises
    ------
    ParameterError
        When 2 σ_b <= z (the count's noise leaves the update no budget).
    """
    z, sb = float(noise_multiplier), float(count_noise)
    if z == 0.0:
        return 0.0
    rest = z**-2 - (2.0 * sb) ** -2
    if not rest > 0:
        raise ParameterError(
            "clip_count_noise",
            f"clip_count_noise={sb:g} leaves no privacy "
            f"budget for the update: adaptive clipping needs 2*clip_count_noise "
            f"> the effective noise multiplier {z:.4g}; raise clip_count_noise "
            "(default: expected cohort / 20) or the noise",
        )
    return rest**-0.5


def effective_noise_multiplier(update_multiplier: float, count_noise: float) -> float:
    """z = (z_Δ⁻² + (2 σ_b)⁻²)^(-1/2): the one Gaussian mechanism the pair of releases is.

    Parameters
    ----------
    update_multiplier : float
        z_Δ.
    count_noise : float
        σ_b.

    Returns
    -------
    float
        The effective z.
    """
    return (float(update_multiplier) ** -2 + (2.0 * float(count_noise)) ** -2) ** -0.5


def next_clip(clip: float, unclipped_fraction: float, quantile: float, clip_lr: float) -> float:
    """The geometric update C · exp(-η (b̄ - γ)): the clip grows while fewer than the target
    quantile's share of units fit under it, and shrinks while more do.

    Parameters
    ----------
    clip : float
        C_t.
    unclipped_fraction : float
        b̄: the noisy fraction of unclipped units.
    quantile : float
        γ.
    clip_lr : float
        η.

    Returns
    -------
    float
        C_{t+1}.
    """
    return float(clip) * math.exp(-float(clip_lr) * (float(unclipped_fraction) - float(quantile)))


@register
class AdaptiveClipGaussian(ClippedSumAggregator):
    """Clip + Gaussian whose clip follows a target quantile of the units' norms (module doc).

    Parameters
    ----------
    clip : float
        The initial clip C_0.
    noise_multiplier : float
        The effective noise multiplier z the ledger accounts.
    sampling : Sampling
        The Poisson sampling of the units.
    quantile : float, default DEFAULT_QUANTILE
        γ: the target fraction of unclipped units.
    clip_lr : float, default DEFAULT_CLIP_LR
        η: the clip's geometric learning rate.
    count_noise : float or None, default None
        σ_b, the noise on the unclipped count (None: the expected cohort over
        ``COUNT_NOISE_DIVISOR``).
    noise_scale : float, default 1.0
        Below 1: a deliberately weakened mechanism.

    Raises
    ------
    ParameterError
        When ``clip`` or ``clip_lr`` is not positive, ``noise_multiplier`` not > 0, or
        ``clip_quantile`` not in (0, 1).
    """

    name = "gaussian_adaptive"
    inputs = (
        "clip",
        "epsilon",
        "delta",
        "rounds",
        "sampling",
        "clip_quantile",
        "clip_lr",
        "clip_count_noise",
        "noise_scale",
    )
    noise_inputs = (
        "clip",
        "sampling",
        "clip_quantile",
        "clip_lr",
        "clip_count_noise",
        "noise_scale",
    )
    private = True
    fixed_noise = True
    closed_form_note = (
        "has no closed form for adaptive clipping (its noise is calibrated with the accountant)"
    )

    def __init__(
        self,
        clip: float,
        noise_multiplier: float,
        sampling: Sampling,
        *,
        quantile: float = DEFAULT_QUANTILE,
        clip_lr: float = DEFAULT_CLIP_LR,
        count_noise: float | None = None,
        noise_scale: float = 1.0,
    ) -> None:
        check_positive("clip", clip)
        if not noise_multiplier > 0:
            raise ParameterError(
                "noise_multiplier",
                f"noise_multiplier must be > 0 for adaptive clipping, got {noise_multiplier}",
            )
        check_fraction("clip_quantile", quantile)
        if not 0.0 < float(quantile) < 1.0:
            raise ParameterError(
                "clip_quantile", f"clip_quantile must be in (0, 1), got {quantile}"
            )
        check_positive("clip_lr", clip_lr)
        self.sampling = sampling
        self.initial_clip = float(clip)
        self.clip = float(clip)
        self.noise_multiplier = float(noise_multiplier)  # the effective z: what is accounted
        self.quantile = float(quantile)
        self.clip_lr = float(clip_lr)
        self.count_noise = (
            float(count_noise)
            if count_noise is not None
            else sampling.expected_cohort / COUNT_NOISE_DIVISOR
        )
        check_positive("clip_count_noise", self.count_noise)
        self.update_multiplier = update_noise_multiplier(self.noise_multiplier, self.count_noise)
        self.noise_scale = check_noise_scale(noise_scale)  # audit.noise_scale (1.0: accounted)

    @classmethod
    def calibrated(
        cls,
        *,
        clip: float,
        epsilon: float,
        delta: float,
        rounds: int,
        sampling: Sampling,
        clip_quantile: float = DEFAULT_QUANTILE,
        clip_lr: float = DEFAULT_CLIP_LR,
        clip_count_noise: float | None = None,
        noise_scale: float = 1.0,
    ) -> AdaptiveClipGaussian:
        """The smallest effective multiplier z meeting (ε, δ) over ``rounds`` Poisson-sampled
        releases (as for fixed clipping), split between the count (σ_b = ``clip_count_noise``,
        default expected cohort / 20) and the update.

        Parameters
        ----------
        clip : float
            The initial clip C_0.
        epsilon, delta : float
            The target (ε, δ) over the run.
        rounds : int
            The releases the budget covers.
        sampling : Sampling
            The Poisson sampling of the units.
        clip_quantile : float, default DEFAULT_QUANTILE
            γ.
        clip_lr : float, default DEFAULT_CLIP_LR
            η.
        clip_count_noise : float or None, default None
            σ_b (None: derived from z).
        noise_scale : float, default 1.0
            Below 1: a deliberately weakened mechanism.

        Returns
        -------
        AdaptiveClipGaussian
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
        return cls(
            clip,
            z,
            sampling,
            quantile=clip_quantile,
            clip_lr=clip_lr,
            count_noise=clip_count_noise,
            noise_scale=noise_scale,
        )

    @classmethod
    def with_noise_multiplier(
        cls,
        noise_multiplier: float,
        *,
        clip: float,
        sampling: Sampling,
        clip_quantile: float = DEFAULT_QUANTILE,
        clip_lr: float = DEFAULT_CLIP_LR,
        clip_count_noise: float | None = None,
        noise_scale: float = 1.0,
    ) -> AdaptiveClipGaussian:
        """A given *effective* noise multiplier z (what the ledger accounts), split as above.

        Parameters
        ----------
        noise_multiplier : float
            The effective z.
        clip, sampling, clip_quantile, clip_lr, clip_count_noise, noise_scale
            As for ``calibrated``.

        Returns
        -------
        AdaptiveClipGaussian
            The estimator.
        """
        check_sampling(sampling)
        check_positive("clip", clip)
        check_positive("noise_multiplier", noise_multiplier)
        return cls(
            clip,
            noise_multiplier,
            sampling,
            quantile=clip_quantile,
            clip_lr=clip_lr,
            count_noise=clip_count_noise,
            noise_scale=noise_scale,
        )

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise on the update *sum* at the current clip (z_Δ C_t)."""
        return self.update_multiplier * self.clip

    def release(self, c: Contribution, *, rng: torch.Generator) -> Aggregate:
        """The noisy mean at C_t, the noisy unclipped count, then C_t+1 (module doc). Both noises
        are drawn in float64 from the round's generator."""
        used = self.clip
        total = c.total
        assert total is not None  # a clipped-sum estimator receives the sum
        # on the CPU generator whatever the sum's device (engine_opts.device), then moved
        noise = torch.randn(total.shape, generator=rng, dtype=torch.float64)
        noise *= self.noise_scale  # 1.0 unless audit.noise_scale weakens it on purpose
        mean = (
            (total.to(torch.float64) + (self.update_multiplier * used * noise).to(total.device))
            / self.sampling.expected_cohort
        ).to(total.dtype)
        centred = (c.count - c.clipped) - 0.5 * c.count  # Σ (b_i - 1/2)
        count_noise = float(torch.randn((), generator=rng, dtype=torch.float64))
        fraction = (centred + self.count_noise * count_noise) / self.sampling.expected_cohort + 0.5
        self.clip = next_clip(used, fraction, self.quantile, self.clip_lr)
        diag = {
            "clipped_fraction": (c.clipped / c.count) if c.count else 0.0,
            "cohort": c.count,
            "clip": used,
            "next_clip": self.clip,
            "unclipped_fraction_noisy": fraction,
        }
        return Aggregate(mean=mean, users_used=c.count, diagnostics=diag)

    def dp_event(self) -> dp_accounting.DpEvent:
        """One round: the pair of releases as one Gaussian of multiplier z, Poisson-sampled."""
        return gaussian_round_event(self.noise_multiplier, self.sampling.rate)

    def ledger_notes(self) -> list[str]:
        return [
            f"adaptive clipping (Andrew et al. 2021): each round releases the clipped sum "
            f"with noise multiplier z_update={self.update_multiplier:.6g} and the unclipped "
            f"count with noise std {self.count_noise:.6g} (sensitivity 1/2); accounted as one "
            f"Gaussian of effective multiplier z={self.noise_multiplier:.6g}; target quantile "
            f"{self.quantile:g}, clip learning rate {self.clip_lr:g}, initial clip "
            f"{self.initial_clip:g}"
        ]

    def checkpoint_state(self) -> dict:
        return {"clip": self.clip}

    def restore_checkpoint_state(self, state: dict) -> None:
        if set(state) != {"clip"}:
            raise ValueError(
                f"aggregator={self.name}: expected the state {{'clip'}}, got {sorted(state)}"
            )
        self.clip = float(state["clip"])
