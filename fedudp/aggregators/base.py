"""The one interface every user-level DP mean estimator implements (ARCHITECTURE.md §4).

An *aggregator* runs on the billboard server. Each round it receives the per-unit
vectors ``G`` (one row per sampled privacy unit: a user, or an owner when
``privacy.unit=owner``), releases a (noisy) estimate of their mean, and describes what
that release cost as a ``dp_accounting.DpEvent`` so the accountant can compose it.

Aggregators that do not need the rows one by one (``none``, ``gaussian``) set
``needs_per_user_vectors = False``: owners then send ``owner_contribution(G_owner)`` (the
sum of their clipped rows and a count) and the billboard calls ``release(total, count)``.
Same privacy (the billboard is trusted), far less traffic and memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import dp_accounting
import torch


@dataclass(frozen=True)
class Sampling:
    """How units enter one release.

    ``rate`` is the Poisson sampling probability ``q`` of each unit (1.0: every unit, every
    round); ``population`` is the public number of units ``N_units``. Clip+Gaussian divides
    its noisy sum by the public constant ``rate * population`` (ALGORITHMS.md §7.2).
    """

    rate: float
    population: int

    def __post_init__(self) -> None:
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"sampling rate must be in (0, 1], got {self.rate}")
        if self.population < 1:
            raise ValueError(f"population must be >= 1, got {self.population}")

    @property
    def expected_cohort(self) -> float:
        return self.rate * self.population


@dataclass
class Aggregate:
    """What one aggregator call returns.

    ``mean`` is the released estimate (d,). ``users_used`` counts the rows that entered
    the statistic. ``diagnostics`` are simulator observations (clipped / kept fractions,
    whether a concentration check failed): they are *not* part of the DP release and
    nothing that changes later releases may read them (ALGORITHMS.md §7.8).
    """

    mean: torch.Tensor
    users_used: int
    diagnostics: dict[str, Any] = field(default_factory=dict)
    halted: bool = False


@runtime_checkable
class Aggregator(Protocol):
    """User-level mean estimator on the billboard (ARCHITECTURE.md §4)."""

    name: str
    needs_per_user_vectors: bool
    private: bool

    def __call__(self, G: torch.Tensor, *, rng: torch.Generator) -> Aggregate:
        """Release an estimate of the mean of the rows of ``G`` (n_units x d)."""
        ...

    def dp_event(self, sampling: Sampling) -> dp_accounting.DpEvent:
        """The event one call releases, for the accountant (``NonPrivateDpEvent`` if none)."""
        ...


def clip_rows(G: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale each row of ``G`` to l2 norm at most ``clip``; returns (clipped, was_clipped)."""
    norms = torch.linalg.vector_norm(G, dim=1)
    factor = torch.clamp(clip / torch.clamp(norms, min=1e-12), max=1.0)
    return G * factor.unsqueeze(1).to(G.dtype), norms > clip


def finite_rows(G: torch.Tensor) -> torch.Tensor:
    """Boolean mask of rows with only finite entries (NaN/inf rows are excluded upstream)."""
    return torch.isfinite(G).all(dim=1)
