"""Clip + Gaussian (DP-FedAvg at the privacy unit) and the non-private plain mean.

Clip+Gaussian is not from the seeds; it is the range-based baseline of ALGORITHMS.md §6
and §7.2. Under Poisson sampling of units with rate ``q`` from a public population
``N_units`` it releases

    ( sum_{k in S} clip_C(g_k) + N(0, z^2 C^2 I) ) / (q * N_units)

The denominator is a public constant, never the realized cohort |S|. Adjacency is
add/remove-one *unit* (the sampled unit: user, or owner with ``privacy.unit=owner``):
adding or removing one unit moves the pre-noise sum by at most C (replacing one, by at
most 2C). The event is ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` under
``ADD_OR_REMOVE_ONE`` (plain ``GaussianDpEvent(z)`` when q = 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import dp_accounting
import torch

from fedudp.aggregators.base import Aggregate, Sampling, clip_rows


@dataclass
class OwnerContribution:
    """What an owner sends when the aggregator does not need per-unit vectors."""

    clipped_sum: torch.Tensor  # (d,)
    count: int
    clipped: int


class GaussianAggregator:
    """Clip each unit's vector to l2 norm ``clip``, sum, add N(0, (z*clip)^2 I), divide by q*N."""

    name = "gaussian"
    needs_per_user_vectors = False
    private = True

    def __init__(self, clip: float, noise_multiplier: float, sampling: Sampling) -> None:
        if not clip > 0:
            raise ValueError(f"privacy.clip must be > 0, got {clip}")
        if not noise_multiplier >= 0:
            raise ValueError(f"noise multiplier must be >= 0, got {noise_multiplier}")
        self.clip = float(clip)
        self.noise_multiplier = float(noise_multiplier)
        self.sampling = sampling

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise added to the *sum* (per coordinate)."""
        return self.noise_multiplier * self.clip

    def owner_contribution(self, G: torch.Tensor) -> OwnerContribution:
        """Owner side: sum of the clipped rows and their count."""
        clipped, was = clip_rows(G, self.clip)
        return OwnerContribution(clipped.sum(0), int(G.shape[0]), int(was.sum()))

    def release(self, total: torch.Tensor, count: int, *, rng: torch.Generator,
                clipped: int = 0) -> Aggregate:
        """Billboard side: add Gaussian noise to the sum and divide by q * N_units."""
        noise = torch.randn(total.shape, generator=rng, dtype=total.dtype, device=total.device)
        mean = (total + self.noise_std * noise) / self.sampling.expected_cohort
        diag = {"clipped_fraction": (clipped / count) if count else 0.0, "cohort": count}
        return Aggregate(mean=mean, users_used=count, diagnostics=diag)

    def __call__(self, G: torch.Tensor, *, rng: torch.Generator) -> Aggregate:
        c = self.owner_contribution(G)
        return self.release(c.clipped_sum, c.count, rng=rng, clipped=c.clipped)

    def dp_event(self, sampling: Sampling | None = None) -> dp_accounting.DpEvent:
        s = sampling or self.sampling
        return gaussian_round_event(self.noise_multiplier, s.rate)


def gaussian_round_event(noise_multiplier: float, rate: float) -> dp_accounting.DpEvent:
    """One clip+Gaussian release (noise multiplier z = sigma / C), Poisson-sampled at ``rate``."""
    g = dp_accounting.GaussianDpEvent(noise_multiplier)
    return g if rate >= 1.0 else dp_accounting.PoissonSampledDpEvent(rate, g)


class MeanAggregator:
    """``aggregator=none``: the plain (non-private) mean of the received vectors (FedAvg)."""

    name = "none"
    needs_per_user_vectors = False
    private = False

    def owner_contribution(self, G: torch.Tensor) -> OwnerContribution:
        return OwnerContribution(G.sum(0), int(G.shape[0]), 0)

    def release(self, total: torch.Tensor, count: int, *, rng: torch.Generator | None = None,
                clipped: int = 0) -> Aggregate:
        mean = total / max(count, 1)
        return Aggregate(mean=mean, users_used=count, diagnostics={"cohort": count})

    def __call__(self, G: torch.Tensor, *, rng: torch.Generator | None = None) -> Aggregate:
        c = self.owner_contribution(G)
        return self.release(c.clipped_sum, c.count)

    def dp_event(self, sampling: Sampling | None = None) -> dp_accounting.DpEvent:
        return dp_accounting.NonPrivateDpEvent()
