"""The billboard server's round (Huang et al. (001) §2 billboard model;
docs/architecture.md#one-round-as-data).

The billboard samples units (Poisson, seeded; never Flower's client sampler), checks the
budget *before* releasing (composing the round's event must not exceed the target epsilon),
runs the aggregator on the cohort, composes the event into the ledger, takes a step on the
shared parameters and broadcasts them. Only this broadcast leaves the server, so every
owner's personal parameters are joint-DP with respect to the other owners' data. The budget
check, the fail-closed rule, the composition and the ledger are the release path's
(``fedudp.billboard.release.ReleaseGate``), which the Flower wrapper holds too.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedudp.aggregators.base import Aggregate, Aggregator
from fedudp.billboard.fail_closed import answered_slots, minimum_error
from fedudp.billboard.plan import Plan
from fedudp.billboard.release import Event, ReleaseGate
from fedudp.privacy.accountant import Ledger, LedgerEntry
from fedudp.protocol.checkpoint import CheckpointError, plain, warn
from fedudp.protocol.contributions import Contribution, Sampling
from fedudp.protocol.ledger_file import release_digest
from fedudp.protocol.messages import OwnerReply
from fedudp.randomness import Purpose, Randomness

if TYPE_CHECKING:
    from collections.abc import Callable

    from fedudp.billboard.canaries import Canaries
    from fedudp.privacy.protocol import AccountantLike

__all__ = ["Billboard", "Event", "ServerStep"]


@dataclass(frozen=True)
class ServerStep:
    """The billboard's plain step on the shared parameters from the released mean: u + lr·mean
    for local deltas (``mode="delta"``), u − lr·mean for gradients (``mode="gradient"``).

    Attributes
    ----------
    lr : float
        The server's step size.
    mode : str, default "delta"
        ``"delta"`` (step along the mean) or ``"gradient"`` (against it).
    """

    lr: float
    mode: str = "delta"

    def __call__(self, u: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        return u + self.lr * mean if self.mode == "delta" else u - self.lr * mean


class Billboard:
    """The server of the billboard model, from plain parts.

    Each round it samples units, releases a user-level DP mean of the owners' contributions
    through the one release path (``fedudp.billboard.release.ReleaseGate``: budget check,
    fail-closed rule, composition and ledger append), and steps the shared parameters.

    Parameters
    ----------
    shared
        The initial shared parameters (named tensors, in the order they are flattened).
    aggregator
        The estimator that releases.
    sampling
        The sampling of units.
    ledger
        The ledger it records into.
    accountant
        The accountant that composes its events (``fedudp.privacy.accountant.accountant_for``;
        None for a non-private aggregator).
    seed
        The seed of its keyed randomness.
    step
        Its step on the shared parameters.
    target_epsilon, delta
        The target ε it stops before exceeding (None: no stop), at ``delta``.
    plan
        A training algorithm's plan (``fedudp.billboard.plan``: the round's cohort, event,
        estimator and step).
    canaries
        Canary units whose updates join each release (``fedudp.billboard.canaries``).
    randomness
        Where its sample and noise come from (default ``Randomness.seeded(seed)``;
        ``Randomness.secure``: OS entropy).
    min_owners, min_users
        The fail-closed minimum (``withhold``), read against ``owner_units``.
    owner_units
        Each owner's public capacity in sampled units (its declared user slots; 1 where the
        units are owners), indexed by owner id.

    Raises
    ------
    ValueError
        A minimum the declared capacities cannot meet, or a private aggregator without an
        accountant.
    """

    def __init__(
        self,
        shared: Mapping[str, torch.Tensor],
        aggregator: Aggregator,
        sampling: Sampling,
        ledger: Ledger,
        # fedudp.privacy.accountant.accountant_for's: an Accountant, a ParallelAccountant or a
        # GroupAccountant (their shared interface is duck-typed: compose, epsilon, epsilon_if)
        accountant: AccountantLike | None = None,
        *,
        seed: int,
        step: ServerStep = ServerStep(1.0),
        target_epsilon: float | None = None,
        delta: float | None = None,
        plan: Plan | None = None,
        canaries: Canaries | None = None,
        randomness: Randomness | None = None,
        min_owners: int = 1,
        min_users: int = 1,
        owner_units: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        if owner_units is not None and (
            why := minimum_error(int(min_owners), int(min_users), owner_units)
        ):
            raise ValueError(why)
        if aggregator.private and accountant is None:
            raise ValueError(
                f"aggregator={aggregator.name} is private: the billboard needs an "
                "accountant (fedudp.privacy.accountant.accountant_for)"
            )
        self.names = tuple(shared)
        self.plan = plan  # a training algorithm's hooks (fedudp.billboard.plan)
        self.next_round = 1
        self.shapes = {k: tuple(shared[k].shape) for k in self.names}
        self.u = (
            torch.cat([shared[k].reshape(-1) for k in self.names]) if self.names else torch.zeros(0)
        )
        # audit.canaries (fedudp.billboard.canaries): K canary units whose updates join each release;
        # the estimate reads the final u against the initial one
        self.canaries = canaries
        self.u0 = self.u.clone() if canaries is not None else None
        self.aggregator, self.sampling = aggregator, sampling
        self.seed, self.step = seed, step
        self.randomness = randomness if randomness is not None else Randomness.seeded(seed)
        # each owner's public capacity (declared user slots), what the fail-closed rule counts
        self.owner_units = None if owner_units is None else tuple(int(c) for c in owner_units)
        self.withheld: list[int] = []  # the rounds that released nothing (fail closed)
        # the owners that answered each released round, where the event depends on it
        # (``Aggregator.survivor_event``: a distributed mechanism), for a checkpoint's restore
        self.answered: dict[int, int] = {}
        # a seeded resume: the releases the killed run made after its checkpoint, by round; a
        # re-release identical to one (same SHA-256) is that very release, any other is composed
        self.rereleases: dict[int, LedgerEntry] = {}
        ledger.randomness = self.randomness.ledger_name
        self.diverged = False  # the last step would have made u non-finite
        self.event = self.first_event(aggregator, plan) if aggregator.private else None
        # the release path (fedudp.billboard.release, the Flower wrapper's too): the budget
        # check, the fail-closed rule, the composition and the ledger of every release
        self.gate = ReleaseGate(
            ledger,
            accountant if aggregator.private else None,
            delta,
            target_epsilon,
            int(min_owners),
            int(min_users),
        )
        # a block spent once for the whole run (AboveThreshold's ε/2 and the failure
        # probabilities that enter δ, docs/algorithms.md#outlier-removal): composed up front,
        # conservatively
        self.one_off: Event | None = aggregator.one_off_event() if aggregator.private else None
        if aggregator.private and plan is not None and plan.one_off() is not None:
            self.one_off = plan.one_off()
        if self.one_off is not None:
            self.gate.compose_once(self.one_off)
            ledger.extra["one_off_event"] = str(self.one_off)

    # the release path's numbers, read and set on the gate (one copy of each)
    @property
    def ledger(self) -> Ledger:
        """The run's ledger: one entry per release (``ReleaseGate.record``)."""
        return self.gate.ledger

    @property
    def accountant(self) -> AccountantLike | None:
        return self.gate.accountant

    @accountant.setter
    def accountant(self, value: AccountantLike | None) -> None:
        self.gate.accountant = value

    @property
    def delta(self) -> float | None:
        return self.gate.delta

    @property
    def target_epsilon(self) -> float | None:
        return self.gate.target_epsilon

    @target_epsilon.setter
    def target_epsilon(self, value: float | None) -> None:
        self.gate.target_epsilon = value

    @property
    def min_owners(self) -> int:
        return self.gate.min_owners

    @min_owners.setter
    def min_owners(self, value: int) -> None:
        self.gate.min_owners = int(value)

    @property
    def min_users(self) -> int:
        return self.gate.min_users

    @min_users.setter
    def min_users(self, value: int) -> None:
        self.gate.min_users = int(value)

    @property
    def ledger_sink(self) -> Callable[[LedgerEntry], None] | None:
        """Where each ledger entry is made durable before its release leaves the billboard
        (``fedudp.protocol.ledger_file.LedgerFile.append``; None: kept in memory only)."""
        return self.gate.sink

    @ledger_sink.setter
    def ledger_sink(self, sink: Callable[[LedgerEntry], None] | None) -> None:
        self.gate.sink = sink

    @staticmethod
    def first_event(aggregator: Aggregator, plan: Plan | None = None) -> Event:
        """What round 1 releases: the plan's event where it has one, else the aggregator's."""
        e = plan.event(1) if plan is not None else None
        return aggregator.dp_event() if e is None else e

    @property
    def dim(self) -> int:
        return int(self.u.numel())

    def shared_params(self) -> dict[str, torch.Tensor]:
        """The broadcast: shared parameters as named tensors (a copy)."""
        out, i = {}, 0
        for k in self.names:
            n = math.prod(self.shapes[k])
            out[k] = self.u[i : i + n].reshape(self.shapes[k]).clone()
            i += n
        return out

    def sample(self, round_: int) -> np.ndarray:
        """Poisson sample of the ``population`` units at rate q (True: in this round's cohort),
        or the plan's cohort; every unit where the owners sample their own users
        (``Aggregator.samples_on_owners``: a distributed mechanism, whose amplification by
        sampling must hold against the billboard)."""
        mask = self.plan.sample(round_) if self.plan is not None else None
        if mask is not None:
            return mask
        q = self.sampling.rate
        # the population's real units (canaries, when there are any, are sampled by their own)
        n = self.sampling.population - (self.canaries.count if self.canaries is not None else 0)
        if q >= 1.0 or self.aggregator.samples_on_owners:  # (the owners sample: every unit)
            return np.ones(n, dtype=bool)
        return self.randomness.numpy_rng(Purpose.SAMPLE, round_).random(n) < q

    def noise_generator(self, round_: int) -> torch.Generator:
        return self.randomness.torch_generator(Purpose.NOISE, round_)

    def withhold(self, round_: int, failed: Collection[int]) -> str | None:
        """Fail closed: why round ``round_`` must release nothing (None: release).

        The rule (``ReleaseGate.withhold``, the Flower wrapper's too)
        reads public numbers only: the owners that answered (every owner but the ``failed``
        ids; each owner is asked every round, so which ones fail does not depend on the sample)
        and their declared capacities ``owner_units``; a round is withheld when fewer than
        ``min_owners`` owners answered or they hold fewer than ``min_users`` user slots. It
        never reads how many units were sampled or contributed: whether a round is released
        is itself an output, so it must not depend on the secret Poisson sample (a released
        round's inclusion probability would exceed the q the ledger composes) nor on one
        user's presence. An answering federation whose sample is empty releases the noise
        alone, as accounted (docs/algorithms.md#fail-closed). A withheld round composes
        nothing and leaves the shared parameters as they are; the next round is
        ``round_ + 1``.

        Parameters
        ----------
        round_ : int
            The round.
        failed : collection of int
            The ids of the owners that failed this round (``Failure.owner``).

        Returns
        -------
        str or None
            Why the round is withheld; None when it is released.

        Raises
        ------
        ValueError
            Owners failed but the billboard has no declared capacities (``owner_units``).
        """
        failed = {int(j) for j in failed}
        if self.owner_units is None:
            if not failed:
                return None  # no owner structure declared: nothing failed, nothing to decide
            raise ValueError(
                f"round {round_}: owners {sorted(failed)} failed but the billboard has no "
                "declared owner capacities (Billboard(owner_units=...)): the fail-closed "
                "rule reads only public numbers"
            )
        why = self.gate.withhold(
            len(self.owner_units) - len(failed),
            answered_slots(self.owner_units, failed),
            len(failed),
        )
        if why is None:
            return None
        self.next_round = round_ + 1
        self.withheld.append(int(round_))
        return f"{why}: nothing released, no epsilon spent"

    def epsilon_after_round(self) -> float | None:
        """Epsilon if this round's release were composed now (None for non-private runs)."""
        return self.gate.epsilon_if(self.round_event(self.next_round))

    def round_event(self, round_: int) -> Event | None:
        """What round ``round_`` releases: the plan's event where it has one, else the
        aggregator's (the same every round)."""
        e = self.plan.event(round_) if self.plan is not None else None
        return self.event if e is None else e

    def within_budget(self) -> bool:
        """Whether the next round's release stays within the budget (``ReleaseGate``)."""
        return self.gate.within_budget(self.round_event(self.next_round))

    def answered_owners(self, failed: Collection[int]) -> int | None:
        """How many owners answered when the ``failed`` ones did not (None: no owner
        structure declared)."""
        if self.owner_units is None:
            return None
        return len(self.owner_units) - len({int(j) for j in failed})

    def release(
        self, replies: Sequence[OwnerReply], round_: int, answered: int | None = None
    ) -> Aggregate:
        """Merge the owners' contributions (rows or clipped sums, as the aggregator's constraint
        asked), release, compose the event into the ledger and step the shared parameters.
        A halted estimator (AboveThreshold said stop) still released its answer: composed,
        but the shared parameters do not move. ``answered``: the owners that answered (public;
        an estimator whose event depends on it, ``Aggregator.survivor_event``, needs it)."""
        aggregator = (
            self.plan.aggregator(round_) if self.plan is not None else None
        ) or self.aggregator
        event = self.round_event(round_)
        if aggregator.survivor_event:
            if answered is None:
                raise ValueError(
                    f"aggregator={aggregator.name}: the release needs how many owners answered"
                )
            self.answered[int(round_)] = int(answered)
            event = aggregator.dp_event_for(int(answered))
        c = Contribution.merge(
            [r.contribution for r in replies],
            self.dim,
            self.u.dtype,
            aggregator.needs_per_user_vectors,
        )
        inserted = 0
        if self.canaries is not None:
            clip = aggregator.constraint.clip
            assert clip is not None  # canaries need clip + Gaussian (fedudp.build checks it)
            c, inserted = self.canaries.add(c, round_, clip, aggregator.needs_per_user_vectors)
        agg = aggregator.release(c, rng=self.noise_generator(round_))
        if inserted:  # the run's counts are its real users'; canaries said apart
            agg.users_used -= inserted
            agg.diagnostics["canaries"] = inserted
        digest = release_digest(agg)
        self.settle_rereleases(before=round_)
        earlier = self.rereleases.pop(round_, None)
        if earlier is not None and not self._same_release(earlier, event, digest):
            # the killed run released this round otherwise: that release was made, compose it
            warn(
                f"round {round_}: the release differs from the one the run made before it "
                "was resumed (engine_opts.threads or device changed?); both are composed"
            )
            self._record(replace(earlier, superseded=True), self._event_of(round_))
        # composed and ledgered (durably, with a sink) before the release leaves: step, broadcast
        failed = None
        if answered is not None and self.owner_units is not None:
            failed = len(self.owner_units) - int(answered)
        self.gate.record(round_, event, aggregator, self.sampling.rate, digest, failed)
        self.next_round = round_ + 1
        # the release may live on the owners' device (engine_opts.device): the billboard's
        # state stays on the CPU
        stepped = (
            self.plan.step(
                self.u, None if agg.halted else agg.mean.to(self.u.device, self.u.dtype), round_
            )
            if self.plan is not None
            else None
        )
        if stepped is not None:  # the plan's step (it also handles a halt)
            self.diverged = not bool(torch.isfinite(stepped).all())
            if not self.diverged:
                self.u = stepped
        elif not agg.halted:
            u = self.step(self.u, agg.mean.to(self.u.device, self.u.dtype))
            self.diverged = not bool(torch.isfinite(u).all())
            if not self.diverged:  # keep the last finite state
                self.u = u
        return agg

    def settle_rereleases(self, before: int | None = None) -> int:
        """Compose, as superseded, the releases a seeded run made before its resume whose rounds
        the resumed run passed (withheld) or did not reach (``before`` None: the run ended):
        they were made and nothing released them again. Returns how many."""
        due = sorted(r for r in self.rereleases if before is None or r < before)
        for r in due:
            self._record(replace(self.rereleases.pop(r), superseded=True), self._event_of(r))
        return len(due)

    def _same_release(self, earlier: LedgerEntry, event: Event | None, digest: str) -> bool:
        """Whether ``earlier`` (made before a resume) is this very release: seeded randomness
        (the same keyed sample and noise), the same event and the same released values."""
        return (
            not self.randomness.is_secure
            and earlier.release_sha256 == digest
            and earlier.event == str(event)
        )

    def _record(self, entry: LedgerEntry, event: Event | None) -> LedgerEntry:
        """Compose a superseded release (made before a resume) and ledger it durably; its ε is
        that of everything composed so far."""
        return self.gate.append(entry, event)

    def canary_estimate(self) -> dict | None:
        """The one-run ε estimate from the canaries (None without them)."""
        if self.canaries is None or self.delta is None or self.u0 is None:
            return None  # (u0 is kept exactly when there are canaries)
        return self.canaries.estimate(self.u - self.u0, self.delta)

    def state(self) -> dict:
        """What a checkpoint needs to continue this billboard exactly: the shared parameters,
        the ledger's entries (the accountant is recomposed from them, ``restore``), the
        aggregator's own state and a training algorithm's plan's. Sampling and noise are keyed
        by round: nothing to save. ``CheckpointError`` if a plan cannot be checkpointed."""
        plan = getattr(self, "plan", None)
        if plan is not None and not hasattr(plan, "checkpoint_state"):
            raise CheckpointError(f"{type(plan).__name__} keeps no checkpointable state")
        return {
            "u": self.u.clone(),
            "diverged": bool(self.diverged),
            "withheld": list(getattr(self, "withheld", [])),
            "answered": {str(r): n for r, n in getattr(self, "answered", {}).items()},
            "entries": [plain(asdict(e)) for e in self.ledger.entries],
            "rereleases": [plain(asdict(e)) for e in getattr(self, "rereleases", {}).values()],
            "aggregator": self.aggregator.checkpoint_state(),
            "plan": plan.checkpoint_state() if plan is not None else None,
        }

    def _event_of(self, round_: int) -> Event | None:
        """The event round ``round_`` released (a plan's, where an algorithm has one; the
        survivors' where the estimator's event depends on them)."""
        answered = getattr(self, "answered", {})
        if self.aggregator.survivor_event and round_ in answered:
            return self.aggregator.dp_event_for(answered[round_])
        of = getattr(self, "round_event", None)
        return of(round_) if of is not None else self.event

    def restore(self, state: dict) -> None:
        """Continue from ``state()``: each released entry must be the event this configuration
        releases in its round; the accountant composes them again one by one, in order (the
        one-off block was composed at construction), and the epsilon it then reports must
        equal the last entry's bit for bit, or the checkpoint is refused."""
        u = state["u"]
        if tuple(u.shape) != tuple(self.u.shape) or u.dtype != self.u.dtype:
            raise CheckpointError(
                f"shared parameters of shape {tuple(u.shape)} {u.dtype}, "
                f"this run has {tuple(self.u.shape)} {self.u.dtype}"
            )
        if self.ledger.entries:
            raise RuntimeError("restore() needs a fresh billboard")
        entries = [LedgerEntry(**e) for e in state["entries"]]
        # every round up to the checkpoint either released (an entry the run continued from)
        # or was withheld; superseded entries (releases made before a resume) are composed too
        withheld = [int(r) for r in state.get("withheld", [])]
        live = [e for e in entries if not e.superseded]
        rounds = [e.round for e in live]
        if rounds != sorted(rounds) or sorted(rounds + withheld) != list(
            range(1, len(live) + len(withheld) + 1)
        ):
            raise CheckpointError(
                "its ledger entries and withheld rounds are not rounds 1, 2, ... in order"
            )
        if hasattr(self, "answered"):
            self.answered = {int(r): int(n) for r, n in state.get("answered", {}).items()}
        if self.accountant is not None:
            events = [self._event_of(e.round) for e in entries]
            for e, event in zip(entries, events):
                if e.event != str(event):
                    raise CheckpointError(
                        f"round {e.round} released {e.event}, this configuration releases {event}"
                    )
            eps = self.gate.recompose(events)
            if entries and eps != entries[-1].epsilon:
                raise CheckpointError(
                    f"recomposed epsilon {eps!r} differs from the ledger's {entries[-1].epsilon!r}"
                )
        self.u = u.clone()
        self.diverged = bool(state["diverged"])
        self.ledger.entries[:] = entries
        if hasattr(self, "next_round"):  # withheld rounds leave gaps between entries
            self.next_round = len(live) + len(withheld) + 1
            self.withheld = withheld
            self.rereleases = {
                e.round: e for e in (LedgerEntry(**d) for d in state.get("rereleases", []))
            }
        self.aggregator.restore_checkpoint_state(state["aggregator"])
        plan = getattr(self, "plan", None)
        if plan is not None:
            plan.restore_checkpoint_state(state["plan"])
