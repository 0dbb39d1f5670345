"""``privacy.placement=local_dpsgd``: DP-SGD inside the owners, a plain mean on the billboard.

Huang et al. (001) §4, the owner-side reading of its experiments (docs/algorithms.md#owner-side-dp-sgd):
owner j runs DP-SGD on the shared
parameters (``fedudp.core.dpsgd``): per step a ``PoissonSampledDpEvent(q_j, GaussianDpEvent(z))``
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
"""
from __future__ import annotations

import dp_accounting
import numpy as np
import torch

from fedudp.aggregators.base import Aggregate, Aggregator, Constraint, Contribution, Sampling
from fedudp.config import Accounting, Calibration, ConfigError, RunConfig
from fedudp.data.federation import planned_owner_records, planned_owner_users
from fedudp.privacy.accountant import GroupConversion, Parallel, calibrate_noise_multiplier


def owner_rates(capacity: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(q_j, steps per epoch) for owners of public capacity M_j (``capacity``): q = min(B, M)/M,
    ceil(M/B). Pass capacities, never the users an owner actually holds."""
    capacity = np.asarray(capacity, dtype=np.int64)
    b = np.minimum(batch, capacity)
    return b / np.maximum(capacity, 1), -(-capacity // batch)


def owner_round_event(z: float, q: float, steps: int) -> dp_accounting.DpEvent:
    """One round of one owner's DP-SGD: ``steps`` Poisson-sampled Gaussian steps."""
    g = dp_accounting.GaussianDpEvent(z)
    step = g if q >= 1.0 else dp_accounting.PoissonSampledDpEvent(float(q), g)
    return dp_accounting.SelfComposedDpEvent(step, int(steps))


class LocalDpSgdMean(Aggregator):
    """The billboard's side of ``privacy.placement=local_dpsgd`` (see the module docstring)."""

    name = "local_dpsgd"
    private = True
    needs_per_user_vectors = False
    accountant = ("dp_accounting.PLDAccountant per owner class (RDP cross-check); the worst "
                  "owner's ε by parallel composition")

    def __init__(self, noise_multiplier: float, clip: float, batch: int, epochs: int,
                 owner_units: np.ndarray, sampling: Sampling,
                 group: GroupConversion | None = None) -> None:
        """``owner_units``: each owner's public DP-SGD capacity M_j (users; records with
        ``group``), the same numbers the owners' schedule uses (``OwnerTraining.dpsgd_capacity``)."""
        self.noise_multiplier, self.clip = float(noise_multiplier), float(clip)
        self.batch, self.epochs, self.sampling = int(batch), int(epochs), sampling
        self.group = group
        if group is not None:
            self.guarantee = "certified" if group.form == "certified" else "heuristic"
        users, counts = np.unique(np.asarray(owner_units, dtype=np.int64), return_counts=True)
        q, steps = owner_rates(users, self.batch)
        # one part per distinct capacity: (M_j, owners with it, q_j, steps per round)
        self.classes = [(int(m), int(c), float(qq), int(s) * self.epochs)
                        for m, c, qq, s in zip(users, counts, q, steps)]

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        if Calibration(cfg.privacy.calibration) == Calibration.closed_form:
            raise ConfigError("privacy.calibration: closed_form has no closed form for owner-side "
                              "DP-SGD; use accountant")

    @classmethod
    def from_config(cls, cfg: RunConfig, sampling: Sampling, rounds: int, dim: int
                    ) -> "LocalDpSgdMean":
        p, t = cfg.privacy, cfg.train
        users = planned_owner_records(cfg) if p.group_privacy else planned_owner_users(cfg)
        group = None
        eps, delta = p.epsilon, p.delta
        if p.group_privacy:
            group = GroupConversion.for_user_budget(int(cfg.partition.records_per_user), p.epsilon,
                                                    p.delta, Accounting(p.accounting).value)
            eps, delta = group.record_epsilon(p.epsilon), group.record_delta
        probe = cls(1.0, p.clip, t.batch_size, t.local_epochs, users, sampling, group)
        z = p.noise_multiplier
        if z is None:        # the worst part must meet (ε, δ): the largest per-part z
            z = max(calibrate_noise_multiplier(
                lambda z, q=q, s=s: owner_round_event(z, q, s), eps, delta, rounds)
                for _, _, q, s in probe.classes)
        return cls(z, p.clip, t.batch_size, t.local_epochs, users, sampling, group)

    @property
    def noise_std(self) -> float:
        """Noise std per coordinate on each owner's per-step sum of clipped user gradients."""
        return self.noise_multiplier * self.clip

    @property
    def constraint(self) -> Constraint:
        return Constraint(rows=False, clip=None, dpsgd_noise=self.noise_multiplier,
                          dpsgd_clip=self.clip)

    def release(self, c: Contribution, *, rng: torch.Generator | None = None) -> Aggregate:
        return Aggregate(mean=c.weighted_mean(), users_used=c.count, diagnostics={"cohort": c.count})

    def ledger_notes(self) -> list[str]:
        what = "records" if self.group else "users"
        parts = "; ".join(f"{c} owners with capacity M_j={m} {what}: q_j={q:.6g}, {s} steps "
                          "per round" for m, c, q, s in self.classes)
        notes = [f"privacy.placement=local_dpsgd: DP-SGD inside each owner (noise multiplier "
                 f"{self.noise_multiplier:.6g}, per-{what[:-1]} clip {self.clip:g}, batch "
                 f"{self.batch}); the billboard averages without noise. Parts (parallel "
                 f"composition, epsilon is the worst part's): {parts}. PUBLIC (fixed from the "
                 f"config before any data is read): each owner's capacity M_j, its planned "
                 f"{what[:-1]} count; the sampling rate q_j = min(B, M_j)/M_j, the "
                 f"ceil(M_j/B) steps per epoch, the divisor min(B, M_j) and the size weights "
                 f"(planned record counts) are computed from it, never from the {what} an "
                 f"owner holds, so adding or removing one {what[:-1]} changes only whether its "
                 f"clipped gradient enters a step's sum (add/remove-one-{what[:-1]} adjacency)"]
        if self.group is not None:
            g = self.group
            notes.append(
                f"privacy.group_privacy: the events are record-level (add/remove one record); "
                f"the ledger's epsilon is user-level, {g.size} x the record-level epsilon at "
                f"delta'={g.record_delta:.6g}, by group privacy over a user's {g.size} records "
                + ("(k e^{(k-1)eps'} delta' <= delta: certified)" if g.form == "certified" else
                   "in the paper's form k e^{k eps'} delta', which gives user-level delta "
                   "e^eps times the stated one: heuristic"))
        return notes

    def dp_event(self) -> Parallel:
        return Parallel(tuple(owner_round_event(self.noise_multiplier, q, s)
                              for _, _, q, s in self.classes))
