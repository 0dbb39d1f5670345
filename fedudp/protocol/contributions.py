"""What passes between the owners and the billboard in one release: the boundary types.

The billboard's aggregator tells the owners how to constrain their units' vectors
(``Constraint``, the owner side of an estimator, pfl-research's ``constrain_sensitivity``); the
owners send back what that constraint makes of their sampled units (``Contribution``: each
unit's row, or the clipped sum and a count); ``Sampling`` is the public rule by which units
enter a release (docs/architecture.md#aggregator).

This module sits just below ``fedudp.aggregators`` (``tests/test_layers.py``): it imports only
the privacy math (``fedudp.privacy.mechanisms.clip_factors``), never an estimator, the owner or
the billboard, so that both sides and every estimator share one definition.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import torch

from fedudp.privacy.mechanisms import clip_factors

if TYPE_CHECKING:
    from fedudp.secure.encoding import SecureEncoding

__all__ = [
    "Constraint",
    "ConstraintSource",
    "Contribution",
    "MaskedShare",
    "Reveal",
    "Sampling",
    "clip_rows",
    "current_constraint",
    "finite_rows",
]


@dataclass(frozen=True)
class Sampling:
    """How units enter one release.

    ``rate`` is the Poisson sampling probability ``q`` of each unit (1.0: every unit, every
    round); ``population`` is the public number of units ``N_units``. Clip+Gaussian divides
    its noisy sum by the public constant ``rate * population`` (docs/algorithms.md#gaussian-mean).

    Parameters
    ----------
    rate : float
        The Poisson sampling probability q of each unit, in (0, 1].
    population : int
        The public number of units (at least 1).

    Raises
    ------
    ValueError
        ``rate`` outside (0, 1] or ``population`` below 1.
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
        """The expected number of units in one release, ``rate * population`` (public)."""
        return self.rate * self.population


@dataclass(frozen=True)
class MaskedShare:
    """One owner's message under a distributed mechanism (``Constraint.secure``): its users'
    rounded vectors summed with its integer noise share, reduced mod 2^bits and masked with the
    pairwise masks of every owner in the round's roster (``fedudp.secure.masks``). Alone it is
    uniform mod 2^bits; the billboard decodes only the sum of the survivors' shares.

    Parameters
    ----------
    owner : int
        The owner's global id.
    vector : numpy.ndarray
        uint64 [D], the masked message.
    """

    owner: int
    vector: np.ndarray


@dataclass(frozen=True)
class Reveal:
    """A surviving owner's pair seed with a dropped one, revealed so that the billboard can
    remove the masks the two shared (SecAgg's unmasking step, simulated: a deployment reveals
    Shamir shares of the dropped owner's key instead, docs/threat-model.md).

    Parameters
    ----------
    survivor, dropped : int
        The two owners' global ids.
    seed : bytes
        Their pair seed for the round.
    """

    survivor: int
    dropped: int
    seed: bytes


@dataclass
class Contribution:
    """What owners send for their sampled units: each unit's row (``rows``, [n, d]) or the sum
    of the constrained rows (``total``, [d]); ``count`` units, ``clipped`` of them clipped.
    ``weight``: the sum of the weights already applied to the rows of ``total`` (owner-level
    updates averaged by owner size, ``train.owner_weights=size``); None means ``count``.
    ``fraction_sum`` / ``fraction_reports``: owner-side DP-SGD with an adaptive clip, the sum of
    the owners' released unclipped fractions and how many owners reported one.

    Parameters
    ----------
    rows : torch.Tensor or None
        Each unit's row, [n, d] (estimators that need the cohort matrix), else None.
    total : torch.Tensor or None
        The sum of the constrained rows, [d], else None.
    count : int
        The units contributed.
    clipped : int, default 0
        How many of them were clipped.
    weight : float or None, default None
        The sum of the weights applied to the rows of ``total`` (None: ``count``).
    fraction_sum : float, default 0.0
        The sum of the owners' released unclipped fractions (owner-side adaptive clipping).
    fraction_reports : int, default 0
        How many owners reported one.
    shares : tuple of MaskedShare, default ()
        A distributed mechanism's masked messages, one per surviving owner (``rows`` and
        ``total`` are then None).
    roster : tuple of int, default ()
        The owners whose pairwise masks the shares carry (every owner asked this round).
    reveals : tuple of Reveal, default ()
        The survivors' pair seeds with the owners of the roster that dropped.
    round_ : int or None, default None
        The round the shares were encoded for (the public rotation is keyed by it).
    """

    rows: torch.Tensor | None
    total: torch.Tensor | None
    count: int
    clipped: int = 0
    weight: float | None = None
    fraction_sum: float = 0.0
    fraction_reports: int = 0
    shares: tuple[MaskedShare, ...] = ()
    roster: tuple[int, ...] = ()
    reveals: tuple[Reveal, ...] = ()
    round_: int | None = None

    @property
    def total_weight(self) -> float:
        """``weight``, or ``count`` where no weight was applied."""
        return float(self.count if self.weight is None else self.weight)

    def weighted_mean(self) -> torch.Tensor:
        """``total`` divided by the total weight (zeros when nothing was contributed).

        Returns
        -------
        torch.Tensor
            The [d] weighted mean of a summed contribution.
        """
        assert self.total is not None  # a summed contribution
        return self.total / max(self.total_weight, 1e-12) if self.count else self.total

    @staticmethod
    def merge(
        parts: Sequence[Contribution], dim: int, dtype: torch.dtype, rows: bool
    ) -> Contribution:
        """The cohort's contribution: rows stacked, or totals summed (in ``dtype``).

        Rows are held once: a single part's rows are returned as they are (no copy where the
        dtype matches; the billboard receives one reply per engine=local round), several parts
        are written into one matrix allocated up front (no list of converted copies). The
        result lives on the parts' device (``engine_opts.device``; the CPU when none has a
        tensor).

        Parameters
        ----------
        parts : sequence of Contribution
            The owners' contributions.
        dim : int
            The length of the vectors.
        dtype : torch.dtype
            The dtype of the merged rows or total.
        rows : bool
            Stack the rows (True) or sum the totals (False).

        Returns
        -------
        Contribution
            The cohort's contribution (counts, clipped counts, weights and fractions summed).
        """
        count = sum(p.count for p in parts)
        clipped = sum(p.clipped for p in parts)
        if any(p.shares or p.roster for p in parts):
            return Contribution._merge_shares(parts, count, clipped)
        device = next(
            (t.device for p in parts for t in (p.rows, p.total) if t is not None),
            torch.device("cpu"),
        )
        if rows:
            got = [p.rows for p in parts if p.rows is not None and len(p.rows)]
            if len(got) == 1:
                return Contribution(got[0].to(dtype), None, count, clipped)
            G = torch.empty(sum(len(g) for g in got), dim, dtype=dtype, device=device)
            at = 0
            for g in got:
                G[at : at + len(g)].copy_(g)
                at += len(g)
            return Contribution(G, None, count, clipped)
        total = torch.zeros(dim, dtype=dtype, device=device)
        for p in parts:
            if p.total is not None and p.count:
                total = total + p.total.to(dtype)
        weighted = any(p.weight is not None for p in parts)
        return Contribution(
            None,
            total,
            count,
            clipped,
            sum(p.total_weight for p in parts) if weighted else None,
            float(sum(p.fraction_sum for p in parts)),
            int(sum(p.fraction_reports for p in parts)),
        )

    @staticmethod
    def _merge_shares(parts: Sequence[Contribution], count: int, clipped: int) -> Contribution:
        """The cohort's masked shares, rosters and reveals gathered (nothing is decoded here:
        the distributed estimator's release sums and unmasks them)."""
        rounds = {p.round_ for p in parts if p.round_ is not None}
        if len(rounds) > 1:
            raise ValueError(f"masked shares of different rounds {sorted(rounds)} in one release")
        return Contribution(
            None,
            None,
            count,
            clipped,
            shares=tuple(s for p in parts for s in p.shares),
            roster=tuple(sorted({o for p in parts for o in p.roster})),
            reveals=tuple(r for p in parts for r in p.reveals),
            round_=next(iter(rounds), None),
        )


@dataclass(frozen=True)
class Constraint:
    """The owner side of an aggregator: send each unit's row (``rows``), or the sum of the rows
    clipped to l2 norm ``clip`` (``None``: unclipped, non-private) and their count. With
    ``dpsgd_noise`` the owners compute their updates with DP-SGD (noise multiplier ``dpsgd_noise``,
    per-user clip ``dpsgd_clip``; ``privacy.placement=local_dpsgd``). Small and serializable: a
    Flower owner receives it with the round instead of rebuilding the aggregator.

    Parameters
    ----------
    rows : bool
        Send each unit's row (True) or the clipped sum and count (False).
    clip : float or None, default None
        The l2 clip norm of each row (None: unclipped).
    dpsgd_noise : float or None, default None
        Owner-side DP-SGD's noise multiplier (None: no DP-SGD on the owners).
    dpsgd_clip : float or None, default None
        Owner-side DP-SGD's per-user clip norm.
    dpsgd_count_noise : float or None, default None
        An adaptive clip's noise on each DP-SGD step's unclipped count.
    secure : SecureEncoding or None, default None
        A distributed mechanism (``privacy.placement=distributed``): each owner encodes its
        sampled users' rows with it (clip, rotate, scale, round each user, sum, add its integer
        noise share, reduce mod 2^bits) and masks the result (``fedudp.owner.secure_reply``).
    """

    rows: bool
    clip: float | None = None
    dpsgd_noise: float | None = None
    dpsgd_clip: float | None = None
    dpsgd_count_noise: float | None = None  # an adaptive clip's noise on each step's count
    secure: SecureEncoding | None = None

    def apply(
        self, G: torch.Tensor, norms: torch.Tensor | None = None, inplace: bool = False
    ) -> Contribution:
        """The contribution of the rows ``G`` under this constraint.

        Parameters
        ----------
        G : torch.Tensor
            The units' vectors, [n, d].
        norms : torch.Tensor or None, default None
            ``row_norms64(G)`` where the caller has them.
        inplace : bool, default False
            The rows may be scaled in place (the caller's own buffer: no clipped copy of G
            is made).

        Returns
        -------
        Contribution
            The rows themselves, or their (clipped) sum, count and clipped count.
        """
        n = int(G.shape[0])
        if self.rows:
            return Contribution(G, None, n)
        if self.clip is None:
            return Contribution(None, G.sum(0), n)
        clipped, was = clip_rows(G, self.clip, norms, inplace)
        return Contribution(None, clipped.sum(0), n, int(was.sum()))


# what the engines are given: a constraint, a callable they ask each round (an estimator whose
# constraint changes between rounds, e.g. adaptive clipping), or None (no billboard)
ConstraintSource: TypeAlias = "Constraint | Callable[[], Constraint | None] | None"


def current_constraint(source: ConstraintSource) -> Constraint | None:
    """The constraint for this round: ``source`` itself, or what a zero-argument callable
    returns now (an estimator whose constraint changes between rounds, e.g. adaptive
    clipping's clip norm: the engines ask for it each round).

    Parameters
    ----------
    source : Constraint, callable or None
        What the engine was given.

    Returns
    -------
    Constraint or None
        This round's constraint (None: no billboard).
    """
    return source() if callable(source) else source


def clip_rows(
    G: torch.Tensor, clip: float, norms: torch.Tensor | None = None, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale each row of ``G`` to l2 norm at most ``clip`` (norms in float64,
    ``mechanisms.clip_factors``).

    Parameters
    ----------
    G : torch.Tensor
        The rows, [n, d].
    clip : float
        The l2 clip norm.
    norms : torch.Tensor or None, default None
        ``row_norms64(G)`` where the caller has them.
    inplace : bool, default False
        Scale ``G`` itself and return it.

    Returns
    -------
    tuple of torch.Tensor
        (clipped rows, boolean mask of the rows that were clipped).
    """
    factor, was = clip_factors(G, clip, norms)
    return (G.mul_(factor.unsqueeze(1)) if inplace else G * factor.unsqueeze(1)), was


def finite_rows(G: torch.Tensor) -> torch.Tensor:
    """Boolean mask of rows with only finite entries (NaN/inf rows are excluded upstream).

    Parameters
    ----------
    G : torch.Tensor
        The rows, [n, d].

    Returns
    -------
    torch.Tensor
        [n] bool, True where every entry of the row is finite.
    """
    return torch.isfinite(G).all(dim=1)
