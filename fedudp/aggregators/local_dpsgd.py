"""``privacy.placement=local_dpsgd``: DP-SGD inside the owners, a plain mean on the billboard.

Huang et al. (001) §4, the owner-side reading of its experiments (docs/algorithms.md#owner-side-dp-sgd):
owner j runs DP-SGD on the shared
parameters (``fedudp.owner.dpsgd``): per step a ``PoissonSampledDpEvent(q_j, GaussianDpEvent(z))``
for its users, q_j = min(B, M_j)/M_j, ceil(M_j/B) steps per epoch, E epochs per round, where M_j
is owner j's PUBLIC capacity: its planned user count (the config's ⌊N/n⌋/⌈N/n⌉ records per
owner cut into users of ``partition.records_per_user``), fixed before any data is read. The
schedule and the divisor never read the users an owner actually holds, so adding or removing one
user of one owner (the adjacency) changes only whether that user's clipped gradient can enter a
step's sum. The billboard averages the owners' noisy deltas, uniformly or weighted by the
owners' public (planned) record counts, and adds nothing. A user belongs to one owner, so the
run's ε is the worst owner's (parallel composition): owners with the same M_j form one part of a
``Parallel`` event; z is calibrated so that the worst part meets (ε, δ).

With ``privacy.group_privacy`` (Huang et al. Table 4's reading, docs/algorithms.md#group-privacy)
the owners' DP-SGD samples and clips *records* instead (q_j = min(B, records_j)/records_j,
ceil(records_j/B) steps per
epoch, records_j the owner's public planned record count; adjacency add/remove one record); events are record-level and the user-level ε is k
times the record-level one at the ``GroupConversion``'s δ', k = records_per_user; z is
calibrated to (ε/k, δ').

With ``privacy.clip_policy=adaptive`` (Andrew et al. 2021, per DP-SGD step;
docs/algorithms.md#adaptive-clipping) each step of owner j also releases its sampled units'
noisy unclipped count Σ (b_i - 1/2) + N(0, σ_b²) (sensitivity 1/2), so the step is the pair
(clipped sum with multiplier z_Δ, count with std σ_b): one Gaussian of effective multiplier
z = (z_Δ⁻² + (2σ_b)⁻²)^(-1/2), the same event as a fixed-clip step at z. z is calibrated as for
a fixed clip and split (σ_b = ``clip_count_noise``; default z·sqrt(10)/2, which gives the count a
tenth of each step's budget: z_Δ = z / sqrt(0.9)). Each owner reports the mean of its steps' released fractions (post-processing of its own
releases); the billboard averages them over the reporting owners and moves the clip that every
owner uses next round, C ← C·exp(-η (f̄ - γ)) (post-processing: each user's data enters only
its owner's releases, so parallel composition still holds under the adaptive composition).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dp_accounting
import numpy as np
import torch

from fedudp.aggregators.adaptive_clip import (
    DEFAULT_CLIP_LR,
    DEFAULT_QUANTILE,
    next_clip,
    update_noise_multiplier,
)
from fedudp.aggregators.base import Aggregate, Aggregator, ParameterError, check_declarations
from fedudp.aggregators.plain_values import (
    calibrate,
    check_budget,
    check_count,
    check_fraction,
    check_positive,
    check_sampling,
    choice,
)
from fedudp.privacy.accountant import GroupConversion, Parallel
from fedudp.protocol.contributions import Constraint, Contribution, Sampling

__all__ = [
    "COUNT_SHARE",
    "default_count_noise",
    "LocalDpSgdMean",
    "owner_rates",
    "owner_round_event",
]


def owner_rates(capacity: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(q_j, steps per epoch) for owners of public capacity M_j (``capacity``): q = min(B, M)/M,
    ceil(M/B). Pass capacities, never the users an owner actually holds.

    Parameters
    ----------
    capacity : numpy.ndarray
        M_j.
    batch : int
        B.

    Returns
    -------
    tuple of numpy.ndarray
        (q_j, steps per epoch).
    """
    capacity = np.asarray(capacity, dtype=np.int64)
    b = np.minimum(batch, capacity)
    return b / np.maximum(capacity, 1), -(-capacity // batch)


def owner_round_event(z: float, q: float, steps: int) -> dp_accounting.DpEvent:
    """One round of one owner's DP-SGD: ``steps`` Poisson-sampled Gaussian steps.

    Parameters
    ----------
    z : float
        The noise multiplier.
    q : float
        The sampling rate.
    steps : int
        The steps.

    Returns
    -------
    dp_accounting.DpEvent
        The composed steps.
    """
    g = dp_accounting.GaussianDpEvent(z)
    step = g if q >= 1.0 else dp_accounting.PoissonSampledDpEvent(float(q), g)
    return dp_accounting.SelfComposedDpEvent(step, int(steps))


COUNT_SHARE = 0.1  # the default adaptive clip's count: a tenth of each step's budget


def default_count_noise(noise_multiplier: float) -> float:
    """σ_b with (2σ_b)⁻² = COUNT_SHARE · z⁻²: the count takes a tenth of each step's Gaussian
    budget, so z_Δ = z / sqrt(0.9). (The server's default, expected cohort / 20, would leave
    nothing for the update once z > B / 10 with DP-SGD's small batches.)

    Parameters
    ----------
    noise_multiplier : float
        z.

    Returns
    -------
    float
        σ_b.
    """
    return float(noise_multiplier) / (2.0 * COUNT_SHARE**0.5)


def _owner_event(q: float, s: int) -> Callable[[float], dp_accounting.DpEvent]:
    """One round's event of an owner class (rate q, s steps) as a function of z."""
    return lambda z: owner_round_event(z, q, s)


class LocalDpSgdMean(Aggregator):
    """The billboard's side of ``privacy.placement=local_dpsgd`` (see the module docstring).

    Parameters
    ----------
    noise_multiplier : float
        z (the effective z with an adaptive clip).
    clip : float
        The per-unit clip.
    batch : int
        B.
    epochs : int
        Local epochs per round.
    owner_units : numpy.ndarray
        Each owner's public capacity M_j.
    sampling : Sampling
        The owners' sampling.
    group : GroupConversion or None, default None
        The group-privacy conversion of record-level DP-SGD.
    adaptive : bool, default False
        The clip follows ``quantile``.
    quantile : float, default DEFAULT_QUANTILE
        γ.
    clip_lr : float, default DEFAULT_CLIP_LR
        η.
    count_noise : float or None, default None
        σ_b (None: ``default_count_noise``).

    Raises
    ------
    ParameterError
        With ``adaptive``: when ``clip_quantile`` is not in (0, 1) or ``clip_lr`` not positive.
    """

    trust = "owners add DP-SGD noise; the billboard sees each owner's noisy update"
    name = "local_dpsgd"
    noise_multiplier: float
    count_noise: float | None  # the adaptive clip's count noise (None: a fixed clip)
    inputs = (
        "clip",
        "epsilon",
        "delta",
        "rounds",
        "batch_size",
        "local_epochs",
        "owner_units",
        "sampling",
        "group_size",
        "accounting",
        "clip_policy",
        "clip_quantile",
        "clip_lr",
        "clip_count_noise",
    )
    noise_inputs = tuple(k for k in inputs if k != "rounds")
    fixed_noise = True
    closed_form_note = "has no closed form for owner-side DP-SGD"
    private = True
    needs_per_user_vectors = False
    accountant = (
        "dp_accounting.PLDAccountant per owner class (RDP cross-check); the worst "
        "owner's ε by parallel composition"
    )

    def __init__(
        self,
        noise_multiplier: float,
        clip: float,
        batch: int,
        epochs: int,
        owner_units: np.ndarray,
        sampling: Sampling,
        group: GroupConversion | None = None,
        *,
        adaptive: bool = False,
        quantile: float = DEFAULT_QUANTILE,
        clip_lr: float = DEFAULT_CLIP_LR,
        count_noise: float | None = None,
    ) -> None:
        """``owner_units``: each owner's public DP-SGD capacity M_j (users; records with
        ``group``), the same numbers the owners' schedule uses (``OwnerTraining.dpsgd_capacity``).
        ``adaptive``: the clip follows the ``quantile`` of the units' gradient norms (module doc);
        ``noise_multiplier`` is then the effective z that is accounted."""
        self.noise_multiplier, self.clip = float(noise_multiplier), float(clip)
        self.initial_clip = self.clip
        self.adaptive = bool(adaptive)
        if self.adaptive:
            check_fraction("clip_quantile", quantile)
            if not 0.0 < float(quantile) < 1.0:
                raise ParameterError(
                    "clip_quantile", f"clip_quantile must be in (0, 1), got {quantile}"
                )
            check_positive("clip_lr", clip_lr)
            self.quantile, self.clip_lr = float(quantile), float(clip_lr)
            self.count_noise = (
                float(count_noise)
                if count_noise is not None
                else default_count_noise(self.noise_multiplier)
            )
            check_positive("clip_count_noise", self.count_noise)
            self.update_multiplier = update_noise_multiplier(
                self.noise_multiplier, self.count_noise
            )
        else:
            self.count_noise = None
            self.update_multiplier = self.noise_multiplier
        self.batch, self.epochs, self.sampling = int(batch), int(epochs), sampling
        self.group = group
        if group is not None:
            self.guarantee = "certified" if group.form == "certified" else "heuristic"
        users, counts = np.unique(np.asarray(owner_units, dtype=np.int64), return_counts=True)
        q, steps = owner_rates(users, self.batch)
        # one part per distinct capacity: (M_j, owners with it, q_j, steps per round)
        self.classes = [
            (int(m), int(c), float(qq), int(s) * self.epochs)
            for m, c, qq, s in zip(users, counts, q, steps)
        ]

    @classmethod
    def calibrated(
        cls,
        *,
        clip: float,
        epsilon: float,
        delta: float,
        rounds: int,
        batch_size: int,
        local_epochs: int,
        owner_units: np.ndarray,
        sampling: Sampling,
        group_size: int | None = None,
        accounting: str = "certified",
        clip_policy: str = "fixed",
        clip_quantile: float = DEFAULT_QUANTILE,
        clip_lr: float = DEFAULT_CLIP_LR,
        clip_count_noise: float | None = None,
    ) -> LocalDpSgdMean:
        """Owner-side DP-SGD whose worst owner meets (ε, δ) over ``rounds`` rounds of
        ``local_epochs`` epochs of Poisson-sampled batches of ``batch_size``, per-unit clip
        ``clip`` (a fixed z: the constructor).

        Parameters
        ----------
        clip : float
            The per-unit clip.
        epsilon, delta : float
            The target (ε, δ).
        rounds : int
            T.
        batch_size : int
            B.
        local_epochs : int
            Epochs per round.
        owner_units : numpy.ndarray
            Each owner's public capacity M_j (users; records with ``group_size``), fixed
            before any data is read.
        sampling : Sampling
            The owners' sampling.
        group_size : int or None, default None
            k: DP-SGD on records, converted to user level by group privacy over k records per
            user (None: DP-SGD on users).
        accounting : {"certified", "paper"}, default "certified"
            The group-privacy conversion: the standard form, or Huang et al.'s (heuristic).
        clip_policy : {"fixed", "adaptive"}, default "fixed"
            The clip.
        clip_quantile, clip_lr, clip_count_noise
            The adaptive clip's γ, η and σ_b.

        Returns
        -------
        LocalDpSgdMean
            The calibrated estimator.

        Raises
        ------
        ParameterError
            A plain value out of range, or an unreachable target.
        """
        check_budget(epsilon, delta, rounds)
        cls._check_schedule(clip, batch_size, local_epochs, sampling, owner_units)
        form = choice("accounting", accounting, ("certified", "paper"))
        if group_size is not None:
            check_count("group_size", group_size)
        group, eps, dlt = cls._group(group_size, epsilon, delta, form)
        probe = cls(1.0, clip, batch_size, local_epochs, owner_units, sampling, group)
        # the worst part must meet (ε, δ): the largest per-part z
        z = max(calibrate(_owner_event(q, s), eps, dlt, rounds) for _, _, q, s in probe.classes)
        return cls(
            z,
            clip,
            batch_size,
            local_epochs,
            owner_units,
            sampling,
            group,
            **cls._adaptive(clip_policy, clip_quantile, clip_lr, clip_count_noise),
        )

    @staticmethod
    def _check_schedule(
        clip: float, batch_size: int, local_epochs: int, sampling: Sampling, owner_units: np.ndarray
    ) -> None:
        check_positive("clip", clip)
        check_count("batch_size", batch_size)
        check_count("local_epochs", local_epochs)
        check_sampling(sampling)
        units = np.asarray(owner_units)
        if not (
            units.ndim == 1
            and units.size
            and np.issubdtype(units.dtype, np.integer)
            and (units >= 0).all()
        ):
            raise ParameterError(
                "owner_units",
                "owner_units must be a non-empty sequence of "
                f"integers >= 0 (each owner's public capacity), got {owner_units!r}",
            )

    @staticmethod
    def _adaptive(policy: str, quantile: float, clip_lr: float, count_noise: float | None) -> dict:
        return {
            "adaptive": choice("clip_policy", policy, ("fixed", "adaptive")) == "adaptive",
            "quantile": quantile,
            "clip_lr": clip_lr,
            "count_noise": count_noise,
        }

    @classmethod
    def with_noise_multiplier(
        cls,
        noise_multiplier: float,
        *,
        clip: float,
        epsilon: float,
        delta: float,
        batch_size: int,
        local_epochs: int,
        owner_units: np.ndarray,
        sampling: Sampling,
        group_size: int | None = None,
        accounting: str = "certified",
        clip_policy: str = "fixed",
        clip_quantile: float = DEFAULT_QUANTILE,
        clip_lr: float = DEFAULT_CLIP_LR,
        clip_count_noise: float | None = None,
    ) -> LocalDpSgdMean:
        """Owner-side DP-SGD with the given noise multiplier (the accountant then tracks ε;
        ``epsilon`` and ``delta`` set the group-privacy conversion's grid where there is one).

        Parameters
        ----------
        noise_multiplier : float
            z.
        clip, epsilon, delta, batch_size, local_epochs, owner_units, sampling, group_size, accounting, clip_policy, clip_quantile, clip_lr, clip_count_noise
            As for ``calibrated``.

        Returns
        -------
        LocalDpSgdMean
            The estimator.
        """
        check_positive("noise_multiplier", noise_multiplier)
        form = choice("accounting", accounting, ("certified", "paper"))
        group = cls._group(group_size, epsilon, delta, form)[0]
        return cls(
            noise_multiplier,
            clip,
            batch_size,
            local_epochs,
            owner_units,
            sampling,
            group,
            **cls._adaptive(clip_policy, clip_quantile, clip_lr, clip_count_noise),
        )

    @staticmethod
    def _group(
        size: int | None, epsilon: float, delta: float, form: str
    ) -> tuple[GroupConversion | None, float, float]:
        """(the group conversion, the record-level (ε, δ) to calibrate to); None: user level."""
        if size is None:
            return None, epsilon, delta
        group = GroupConversion.for_user_budget(int(size), epsilon, delta, form)
        return group, group.record_epsilon(epsilon), group.record_delta

    @property
    def noise_std(self) -> float:
        """Noise std per coordinate on each owner's per-step sum of clipped user gradients
        (z_Δ C with an adaptive clip)."""
        return self.update_multiplier * self.clip

    @property
    def constraint(self) -> Constraint:
        return Constraint(
            rows=False,
            clip=None,
            dpsgd_noise=self.update_multiplier,
            dpsgd_clip=self.clip,
            dpsgd_count_noise=self.count_noise,
        )

    def release(self, c: Contribution, *, rng: torch.Generator | None = None) -> Aggregate:
        diag: dict[str, Any] = {"cohort": c.count}
        if self.adaptive:
            used = self.clip
            if c.fraction_reports:
                fraction = c.fraction_sum / c.fraction_reports
                self.clip = next_clip(used, fraction, self.quantile, self.clip_lr)
                diag["unclipped_fraction_noisy"] = fraction
            diag.update(clip=used, next_clip=self.clip)
        return Aggregate(mean=c.weighted_mean(), users_used=c.count, diagnostics=diag)

    def checkpoint_state(self) -> dict:
        return {"clip": self.clip} if self.adaptive else {}

    def restore_checkpoint_state(self, state: dict) -> None:
        want = {"clip"} if self.adaptive else set()
        if set(state) != want:
            raise ValueError(
                f"placement=local_dpsgd: expected the state {sorted(want)}, got {sorted(state)}"
            )
        if self.adaptive:
            self.clip = float(state["clip"])

    def ledger_notes(self) -> list[str]:
        what = "records" if self.group else "users"
        parts = "; ".join(
            f"{c} owners with capacity M_j={m} {what}: q_j={q:.6g}, {s} steps per round"
            for m, c, q, s in self.classes
        )
        notes = [
            f"privacy.placement=local_dpsgd: DP-SGD inside each owner (noise multiplier "
            f"{self.noise_multiplier:.6g}, per-{what[:-1]} clip {self.clip:g}, batch "
            f"{self.batch}); the billboard averages without noise. Parts (parallel "
            f"composition, epsilon is the worst part's): {parts}. PUBLIC (fixed from the "
            f"config before any data is read): each owner's capacity M_j, its planned "
            f"{what[:-1]} count; the sampling rate q_j = min(B, M_j)/M_j, the "
            f"ceil(M_j/B) steps per epoch, the divisor min(B, M_j) and the size weights "
            f"(planned record counts) are computed from it, never from the {what} an "
            f"owner holds, so adding or removing one {what[:-1]} changes only whether its "
            f"clipped gradient enters a step's sum (add/remove-one-{what[:-1]} adjacency)"
        ]
        if self.adaptive:
            notes.append(
                f"adaptive clip (Andrew et al. 2021, per DP-SGD step): each step releases the "
                f"clipped sum with noise multiplier z_update={self.update_multiplier:.6g} and "
                f"the unclipped count with noise std {self.count_noise:.6g} (sensitivity 1/2); "
                f"accounted as one Gaussian of effective multiplier z={self.noise_multiplier:.6g}"
                f" per step; the billboard moves the clip from the owners' mean released "
                f"fraction: target quantile {self.quantile:g}, clip learning rate "
                f"{self.clip_lr:g}, initial clip {self.initial_clip:g}"
            )
        if self.group is not None:
            g = self.group
            notes.append(
                f"privacy.group_privacy: the events are record-level (add/remove one record); "
                f"the ledger's epsilon is user-level, {g.size} x the record-level epsilon at "
                f"delta'={g.record_delta:.6g}, by group privacy over a user's {g.size} records "
                + (
                    "(k e^{(k-1)eps'} delta' <= delta: certified)"
                    if g.form == "certified"
                    else "in the paper's form k e^{k eps'} delta', which gives user-level delta "
                    "e^eps times the stated one: heuristic"
                )
            )
        return notes

    def dp_event(self) -> Parallel:
        return Parallel(
            tuple(owner_round_event(self.noise_multiplier, q, s) for _, _, q, s in self.classes)
        )


check_declarations(LocalDpSgdMean)  # built by the builder directly (placement=local_dpsgd)
