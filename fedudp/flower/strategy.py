"""The server side of user-level DP inside any Flower app (Message API, flwr 1.42): the
strategy wrapper ``UserLevelDP`` (docs/flower-apps.md; the client side is
``fedudp.flower.mod.user_level_mod``).

Flower's own DP wrappers treat each client as one privacy unit. Here a client (an owner, a
silo) holds many users, and the privacy unit is the user. ``UserLevelDP(strategy, aggregator,
...)`` wraps any Flower strategy (``FedAvg``, ``FedAdam``, ``FedProx``, ...). It adds the user
sampling and the constraint (clip, rows or sum) to every training message, merges the clients'
contributions, releases one private mean update with fedudp's estimator (clip + Gaussian,
winsorized, outlier removal, FriendlyCore, few users), composes the release in a dp-accounting
ledger through the billboard's release path (``fedudp.billboard.release.ReleaseGate``: the
budget check, the fail-closed rule, the composition and the ledger, durable in ``ledger_path``
when one is given, written once for fedudp's billboard and this wrapper) and hands the wrapped
strategy a single update (the broadcast plus the released mean), which it applies as it would a
client's. Before a round whose release would exceed the target ε it stops training (no more
training messages; evaluation rounds go on) and says so. Every round's ε is in the round's
metrics (``epsilon``).

The user population N (the estimator's public denominator) is declared: ``num_users``; the
sampling rate q is ``user_sampling_rate``. Both are public, as fedudp's own engine treats them.

Randomness (docs/flower-apps.md#secure-randomness): by default the release noise is drawn on the
server, and each client's Poisson sample of its users on that client, from OS entropy
(``Randomness.secure``): nothing a client receives (the run config, the ``fedudp.dp`` record,
round numbers) lets it regenerate either. ``randomness=Randomness.seeded(seed)`` (run config
``fedudp.privacy.randomness = "seeded"``) keys both by the seed instead, which is then sent to
the clients: reproducible, for simulations only.

Fail closed (docs/flower-apps.md#fail-closed): a round whose successful replies come from fewer
than ``min_owners`` clients, or whose successful clients hold fewer than ``min_users`` users,
releases nothing and spends no ε; every failed client's reason is logged here; a run in which no
round released raises ``RunFailed`` from ``start`` (the ServerApp's run then ends failed).

The strategy never imports the owner side (tests/test_layers.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedudp.aggregators.base import Aggregator
from fedudp.billboard.release import ReleaseGate
from fedudp.flower.availability import availability_problem
from fedudp.flower.collect import Collected, collect
from fedudp.flower.configured import wrapper_arguments
from fedudp.flower.distributed import SIMULATION_NOTE, secure_rounds
from fedudp.flower.guard import outer_wrapper, stacked_strategy
from fedudp.flower.log_setup import root_placeholder
from fedudp.flower.outcome import RunFailed, finish, hand_over, log_utility, summary
from fedudp.flower.wire import K_DP, flat, is_personal, to_record, unflat
from fedudp.privacy.accountant import Ledger, accountant_for
from fedudp.privacy.protocol import AccountantLike
from fedudp.protocol import ledger_file
from fedudp.protocol.contributions import Constraint, Contribution
from fedudp.randomness import Purpose, Randomness

__all__ = ["UserLevelDP", "RunFailed"]

LEDGER_NOTES = [
    "fedudp.flower.UserLevelDP: user-level DP of the released "
    "shared update; the number of users and the sampling rate "
    "are public (declared)",
    "released outside the guarantee: the clients' training and evaluation "
    "metrics, and the counts of users dropped for a non-finite update or a "
    "training step that raised (nonfinite_users, raised_users)",
]


def _refusal(strategy: Strategy, aggregator: Aggregator, min_owners: int, min_users: int) -> None:
    """``ValueError`` for an estimator, a strategy or fail-closed minimums the wrapper refuses."""
    if not aggregator.private:
        raise ValueError("UserLevelDP needs a private estimator (its noise is the guarantee)")
    if hasattr(aggregator, "participation"):
        raise ValueError(
            f"UserLevelDP samples users by Poisson at the estimator's rate; "
            f"aggregator={aggregator.name} is accounted for its own cyclic "
            "participation, which that sampling would break: use clip + "
            "Gaussian (GaussianAggregator) or adaptive clipping here"
        )
    why = stacked_strategy(strategy)
    if why is not None:
        raise ValueError(why)
    if int(min_owners) < 1 or int(min_users) < 0:
        raise ValueError(
            f"UserLevelDP: min_owners must be >= 1 and min_users >= 0, got "
            f"{min_owners} / {min_users}"
        )


def _gate(
    aggregator: Aggregator,
    delta: float,
    target_epsilon: float | None,
    min_owners: int,
    min_users: int,
    randomness: Randomness,
) -> ReleaseGate:
    """The release path (``fedudp.billboard.release``, the billboard's too): the budget check,
    the fail-closed rule, the composition and the ledger of every release, with the estimator's
    one-off block composed and the public numbers in the ledger."""
    ledger = Ledger(
        unit="user",
        adjacency=aggregator.adjacency,
        accounting="certified",
        guarantee=aggregator.guarantee,
        mechanism=aggregator.name,
        accountant=aggregator.accountant,
        delta=float(delta),
        target_epsilon=target_epsilon,
        notes=list(LEDGER_NOTES),
        trust=aggregator.trust,
    )
    gate = ReleaseGate(
        ledger,
        accountant_for(aggregator.dp_event(), aggregator.group, target_epsilon),
        float(delta),
        target_epsilon,
        int(min_owners),
        int(min_users),
    )
    one_off = aggregator.one_off_event()
    if one_off is not None:
        gate.compose_once(one_off)
    ledger.extra["public"] = {
        "users": aggregator.sampling.population,
        "user_sampling_rate": aggregator.sampling.rate,
    }
    ledger.randomness = randomness.ledger_name
    ledger.extra["fail_closed"] = {"min_owners": gate.min_owners, "min_users": gate.min_users}
    return gate


class UserLevelDP(Strategy):
    """User-level DP around any Flower ``strategy`` (see the module doc).

    Adds the user sampling and the constraint (clip, rows or sum) to every training message,
    merges the clients' per-user contributions, releases one private mean update with the
    fedudp estimator, composes the release in a dp-accounting ledger (``self.ledger``) and hands
    ``strategy`` the broadcast plus the released mean as a single update. Every round's ε is in
    its metrics (``epsilon``). Clients run ``user_level_mod``.

    Parameters
    ----------
    strategy : Strategy
        The Flower strategy to wrap (``FedAvg``, ``FedAdam``, ``FedProx``, ...).
    aggregator : Aggregator
        A private fedudp estimator from plain values, e.g.
        ``GaussianAggregator.calibrated(clip=1.0, epsilon=2.0, delta=1e-5, rounds=10,
        sampling=Sampling(rate=0.2, population=num_users))``; its ``sampling`` states the public
        user sampling rate and population (the denominator).
    delta : float
        The ledger's δ.
    target_epsilon : float or None
        Stop training before a release would exceed it (None: report only).
    personal : Sequence[str]
        The parameter-name patterns (fnmatch) the clients keep: never sent, never updated here.
    seed : int
        The key of ``"seeded"`` randomness.
    randomness : str or Randomness
        Where the noise and the users' sampling come from: ``"secure"`` (default: OS entropy, on
        the server and on each client) or ``"seeded"`` (keyed by ``seed``, which the clients then
        receive: simulations only), or a ``fedudp.randomness.Randomness``.
    min_owners : int
        Fail closed: a round whose successful replies come from fewer clients releases nothing.
    min_users : int
        Fail closed: a round whose successful clients hold fewer users releases nothing.
    rounds : int or None
        The T the estimator was calibrated for (``start`` refuses another ``num_rounds``;
        ``from_run_config`` sets it).
    expected_update_norm : float or None
        A typical norm of the mean update, public (None: the clip C); ``start`` warns before
        round 1 when the release noise's expected norm exceeds it.
    ledger_path : str, Path or None
        A ``ledger.jsonl`` to keep the ledger in, durably (``fedudp.protocol.ledger_file``):
        its head line is written here, each release's line is flushed and fsynced before the
        released update leaves ``aggregate_train``, and the file is rewritten with the final
        head at the end of ``start``. None: the ledger is kept in memory only (``ledger``).

    Raises
    ------
    ValueError
        A non-private estimator, one accounted for its own cyclic participation (the tree,
        banded MF), or a fail-closed minimum out of range.
    """

    def __init__(
        self,
        strategy: Strategy,
        aggregator: Aggregator,
        *,
        delta: float,
        target_epsilon: float | None = None,
        personal: Sequence[str] = (),
        seed: int = 0,
        randomness: str | Randomness = "secure",
        min_owners: int = 1,
        min_users: int = 1,
        rounds: int | None = None,
        expected_update_norm: float | None = None,
        ledger_path: str | Path | None = None,
    ) -> None:
        _refusal(strategy, aggregator, min_owners, min_users)
        self.strategy, self.aggregator = strategy, aggregator
        self._outer_checked = False  # a Flower DP wrapper around this one: the first round
        self.personal = tuple(personal)
        self.randomness = (
            randomness
            if isinstance(randomness, Randomness)
            else Randomness(int(seed), str(randomness))
        )
        self.seed = self.randomness.seed
        self.withheld: list[tuple[int, str]] = []  # (round, why): nothing released
        self.event = aggregator.dp_event()
        # a distributed estimator: masked shares, reveals (fedudp.flower.distributed)
        self.secure = secure_rounds(aggregator, self.randomness, min_owners)
        self.gate = _gate(aggregator, delta, target_epsilon, min_owners, min_users, self.randomness)
        if self.secure is not None:
            self.ledger.notes += [*aggregator.ledger_notes(), SIMULATION_NOTE]
        self.ledger_path = None if ledger_path is None else Path(ledger_path)
        if self.ledger_path is not None:  # each release durable before it leaves
            ledger_file.write(self.ledger_path, ledger_file.head(self.ledger), [])
            self.gate.sink = ledger_file.LedgerFile(self.ledger_path).append
        self.stopped: str | None = None
        self._sent: dict[int, ArrayRecord] = {}
        # T the estimator was calibrated for (None: not declared; start() then takes any)
        self.rounds = None if rounds is None else int(rounds)
        self.expected_update_norm = (
            None if expected_update_norm is None else float(expected_update_norm)
        )
        self.utility: dict = {}  # what start() logged before round 1
        # a per-user-rows estimator's public bound B on a user's update norm, if it has one
        self.update_bound = getattr(aggregator, "bound", None)

    @classmethod
    def from_run_config(
        cls,
        strategy: Strategy,
        run_config: Mapping[str, Any],
        initial_arrays: ArrayRecord,
        personal: Sequence[str] = (),
        ledger_path: str | Path | None = None,
    ) -> UserLevelDP:
        """The wrapper configured through Flower's run config alone
        (``[tool.flwr.app.config]`` / ``--run-config``), under the run-config contract
        (``fedudp.flower.contract.KEYS``, docs/flower-apps.md#the-run-config-contract): ε, δ and
        N (``fedudp.public.users``) required, T from ``num-server-rounds`` (or
        ``fedudp.train.rounds``; both must agree), every other ``fedudp.*`` key optional with
        its default; an unknown key, a wrong type or a missing required key is a
        ``RunConfigError`` naming it. Randomness is ``secure`` unless set (the wrapper's
        default, unlike fedudp's own engines). The estimator is calibrated by fedudp's config
        builder over the shared parameters of ``initial_arrays`` (those not matching
        ``personal``); ``ledger_path``: the durable ``ledger.jsonl`` (the constructor's).

        Parameters
        ----------
        strategy : Strategy
            The Flower strategy to wrap.
        run_config : Mapping[str, Any]
            ``context.run_config``.
        initial_arrays : flwr.app.ArrayRecord
            The initial model (its shared parameters' count d).
        personal : Sequence[str]
            The personal parameters' patterns.
        ledger_path : str, Path or None

        Returns
        -------
        UserLevelDP

        Raises
        ------
        RunConfigError
            A key of the contract broken, named.
        """
        agg, kwargs, bound = wrapper_arguments(run_config, initial_arrays, personal)
        out = cls(strategy, agg, personal=personal, ledger_path=ledger_path, **kwargs)
        if bound is not None:  # per-user rows: the rows' declared bound B
            out.update_bound = bound
        return out

    # the release path's numbers, on the gate (one copy of each)
    @property
    def ledger(self) -> Ledger:
        """The run's ledger: one entry per release (``ReleaseGate.record``)."""
        return self.gate.ledger

    @property
    def accountant(self) -> AccountantLike:
        assert self.gate.accountant is not None  # a private estimator's (accountant_for)
        return self.gate.accountant

    @property
    def delta(self) -> float:
        assert self.gate.delta is not None  # set from the required delta
        return self.gate.delta

    @property
    def target_epsilon(self) -> float | None:
        return self.gate.target_epsilon

    @property
    def min_owners(self) -> int:
        return self.gate.min_owners

    @property
    def min_users(self) -> int:
        return self.gate.min_users

    @property
    def epsilon(self) -> float:
        """The ε of every release so far (and a one-off block), at ``delta``."""
        eps = self.gate.epsilon()
        assert eps is not None  # the gate of a private estimator has an accountant
        return eps

    def _constraint(self) -> Constraint:
        return self.aggregator.constraint

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's training messages, each with the round's ``K_DP`` record
        (the sampling rate, the constraint, N); none once the budget stops training.

        Parameters
        ----------
        server_round : int
        arrays : flwr.app.ArrayRecord
            The broadcast.
        config : flwr.app.ConfigRecord
        grid : flwr.serverapp.Grid

        Returns
        -------
        Iterable[flwr.app.Message]

        Raises
        ------
        ValueError
            A Flower DP wrapper around this one (noise twice).
        """
        if not self._outer_checked:  # a Flower DP wrapper around this one: refused
            self._outer_checked = True
            why = outer_wrapper(self)
            if why is not None:
                raise ValueError(why)
        if self.stopped is None and (why := self.gate.over_budget(self.event)) is not None:
            self.stopped = f"budget: round {server_round}'s {why}"
        if self.stopped is not None:
            log(WARNING, "UserLevelDP: no more training (%s)", self.stopped)
            return []
        self._sent[server_round] = arrays
        c = self._constraint()
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        for m in messages:
            rec = ConfigRecord(
                {
                    "round": int(server_round),
                    "randomness": self.randomness.mode,
                    "rate": float(self.aggregator.sampling.rate),
                    "rows": bool(c.rows),
                    "clip": float(c.clip) if c.clip is not None else -1.0,
                    "population": int(self.aggregator.sampling.population),
                    "personal": list(self.personal) or [""],
                }
            )
            if not self.randomness.is_secure:  # a seeded simulation: the clients' sample
                rec["seed"] = self.seed
            m.content[K_DP] = rec
        if self.secure is not None:  # the encoding and the round's roster
            shared = [k for k in arrays if not is_personal(k, self.personal)]
            dim = sum(int(np.prod(arrays[k].shape)) for k in shared)
            self.secure.configure(server_round, messages, dim, grid)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's one private update: the clients' contributions merged and released by
        the estimator, composed and ledgered (durably, with ``ledger_path``) before the update
        leaves; or nothing (withheld: fail closed) and no ε spent.

        Parameters
        ----------
        server_round : int
        replies : Iterable[flwr.app.Message]

        Returns
        -------
        tuple[flwr.app.ArrayRecord or None, flwr.app.MetricRecord or None]
        """
        replies = list(replies)
        sent = self._sent.pop(server_round, None)
        if sent is None:
            return None, None
        names = [k for k in sent if not is_personal(k, self.personal)]
        dim = sum(int(np.prod(sent[k].shape)) for k in names)
        if self.secure is not None:  # masked shares, decoded only as their sum
            return self.secure.aggregate(self, server_round, replies, sent, names)
        got = collect(replies, dim, server_round)
        # fail closed (the billboard's rule): answering clients and their declared user slots
        why = self.gate.withhold(
            len(got.parts), got.held, got.failed, who="client", key="fedudp.train."
        )
        if why is not None:  # nothing released, nothing composed, the model unchanged
            return None, self._withhold(server_round, why, got)
        c = Contribution.merge(got.parts, dim, torch.float64, self._constraint().rows)
        agg = self.aggregator.release(
            c, rng=self.randomness.torch_generator(Purpose.NOISE, server_round)
        )
        # composed and ledgered (durably, with ledger_path) before the update leaves
        entry = self.gate.record(
            server_round,
            self.event,
            self.aggregator,
            self.aggregator.sampling.rate,
            ledger_file.release_digest(agg),
            got.failed,
        )
        assert entry.epsilon is not None  # composed by a private estimator's accountant
        new = flat(sent, names) + agg.mean.to(torch.float64)
        updated = unflat(new, sent, names)
        arrays = to_record({k: updated.get(k, sent[k]) for k in sent})
        return hand_over(self, server_round, arrays, replies, got, c, entry.epsilon)

    def _withhold(self, server_round: int, why: str, got: Collected) -> MetricRecord:
        """A withheld round's metrics (and its warning)."""
        self.withheld.append((server_round, why))
        log(
            WARNING,
            "UserLevelDP round %s: withheld, nothing released, no epsilon spent (%s)",
            server_round,
            why,
        )
        return MetricRecord(
            {
                "withheld": 1,
                "failed_clients": got.failed,
                "nonfinite_users": got.nonfinite,
                "raised_users": got.raised,
                "epsilon": self.epsilon,
                "delta": self.delta,
            }
        )

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        *args: Any,
        **kwargs: Any,
    ) -> Result:
        """Flower's ``Strategy.start``; then ``RunFailed`` if no round released because every
        training round was withheld (fail closed): raised from the ServerApp's main, the run
        ends failed rather than completed.

        Parameters
        ----------
        grid : flwr.serverapp.Grid
        initial_arrays : flwr.app.ArrayRecord
        num_rounds : int
            Must be the T the estimator is calibrated for (``rounds``), when declared.

        Returns
        -------
        flwr.serverapp.strategy.Result

        Raises
        ------
        RunConfigError
            Another number of rounds.
        RunFailed
            No round released.
        """
        if self.rounds is not None and int(num_rounds) != self.rounds:
            from fedudp.flower.contract import RunConfigError

            raise RunConfigError(
                f"num-server-rounds: UserLevelDP.start(num_rounds={num_rounds}) but the estimator "
                f"is calibrated for {self.rounds} rounds (num-server-rounds / "
                "fedudp.train.rounds): pass the run config's number of rounds"
            )
        why = availability_problem(self.strategy, self.min_owners)
        if why is not None:
            log(WARNING, "UserLevelDP: %s", why)
        # logging configured once: dp-accounting's absl warnings add no root handler (whose
        # copy of every propagated Flower line would print each line twice)
        with root_placeholder():
            self.log_utility(initial_arrays)
            result = super().start(grid, initial_arrays, num_rounds, *args, **kwargs)
            self.finish(int(num_rounds))
        return result

    def finish(self, num_rounds: int) -> dict:
        """The run's outcome, in the log and the ledger (``fedudp.flower.outcome.finish``).

        Parameters
        ----------
        num_rounds : int

        Returns
        -------
        dict
            The outcome (``ledger.extra["outcome"]``).

        Raises
        ------
        RunFailed
            No round released.
        """
        return finish(self, num_rounds)

    def log_utility(self, initial_arrays: ArrayRecord) -> dict:
        """Before round 1: the expected cohort and the release noise against a typical update
        norm (``fedudp.flower.outcome.log_utility``).

        Parameters
        ----------
        initial_arrays : flwr.app.ArrayRecord

        Returns
        -------
        dict
            What was logged (also ``self.utility``).
        """
        return log_utility(self, initial_arrays)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's evaluation messages (unchanged).

        Parameters
        ----------
        server_round : int
        arrays : flwr.app.ArrayRecord
        config : flwr.app.ConfigRecord
        grid : flwr.serverapp.Grid

        Returns
        -------
        Iterable[flwr.app.Message]
        """
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The wrapped strategy's evaluation metrics (outside the DP guarantee).

        Parameters
        ----------
        server_round : int
        replies : Iterable[flwr.app.Message]

        Returns
        -------
        flwr.app.MetricRecord or None
        """
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        """Flower's strategy summary, logged by ``start`` before round 1
        (``fedudp.flower.outcome.summary``)."""
        summary(self)
