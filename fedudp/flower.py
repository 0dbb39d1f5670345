"""User-level DP inside any Flower app (Message API, flwr 1.42): a strategy wrapper and a client
mod (docs/flower-apps.md).

Flower's own DP wrappers treat each client as one privacy unit. Here a client (an owner, a
silo) holds many users, and the privacy unit is the user:

* ``user_level_mod(users_per_client=k, personal=...)`` is a client mod. On a training message
  it samples the client's users (Poisson at the rate the server sends, from public keyed
  randomness), runs the app's own training step once per sampled user on that user's data
  only, and replies with the sum of the users' clipped model updates and their count (or, for
  an estimator that needs them, the clipped rows). The app's data loader selects a user
  because the mod hands it a context whose ``partition-id`` is the user's global index and
  whose ``num-partitions`` is the number of users: a Flower app that loads
  ``partition_id`` of ``num_partitions`` needs no change. Parameters named by ``personal``
  (fnmatch patterns) are joint DP's personal layers: they are never sent. Each user's update
  is computed at the broadcast, whose personal layers are the server's untouched initial
  (public) values, so that a user's update depends on the broadcast and that user's records
  only (fedudp's certified joint DP, docs/algorithms.md#certified-vs-paper-accounting). The
  client's own personal layers are trained on all its users' records every round (the app's
  training step once per user, in order, each starting from the previous one's personal
  layers and the broadcast's shared ones), kept in ``context.state``, and put into every
  evaluation message's model before the app evaluates.
* ``UserLevelDP(strategy, aggregator, ...)`` wraps any Flower strategy (``FedAvg``,
  ``FedAdam``, ``FedProx``, ...). It adds the user sampling and the constraint (clip, rows or
  sum) to every training message, merges the clients' contributions, releases one private mean
  update with fedudp's estimator (clip + Gaussian, winsorized, outlier removal, FriendlyCore,
  few users), composes the release in a dp-accounting ledger through the billboard's release
  path (``fedudp.billboard.release.ReleaseGate``: the budget check, the fail-closed rule, the
  composition and the ledger, durable in ``ledger_path`` when one is given, written once for
  fedudp's billboard and this wrapper) and hands the wrapped strategy a single update (the
  broadcast plus the released mean), which it applies as it would a client's. Before a round
  whose release would exceed the target ε it stops training (no more training messages;
  evaluation rounds go on) and says so. Every round's ε is in the round's metrics
  (``epsilon``).

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
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.common import log
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedudp.aggregators.base import Aggregator, Constraint, Contribution
from fedudp.billboard.release import ReleaseGate
from fedudp.flower_availability import availability_problem
from fedudp.flower_guard import (
    NO_WRAPPER,
    foreign_keys,
    one_line,
    outer_wrapper,
    stacked_mods,
    stacked_strategy,
    user_rows,
)
from fedudp.flower_logging import root_placeholder
from fedudp.privacy.accountant import Ledger, accountant_for
from fedudp.privacy.protocol import AccountantLike
from fedudp.protocol import ledger_file
from fedudp.randomness import Purpose, Randomness

if TYPE_CHECKING:
    from fedudp.flower_fast import TorchTraining
    from fedudp.flower_guard import UserRows

__all__ = [
    "UserLevelDP",
    "user_level_mod",
    "client_users",
    "K_DP",
    "K_CONTRIB",
    "K_COUNTS",
    "RunFailed",
]

# keys of the records the wrapper and the mod exchange (beside the app's own "arrays"/"config")
K_DP = "fedudp.dp"  # ConfigRecord in a training message
K_CONTRIB = "fedudp.contribution"  # ArrayRecord in a reply: "sum" [d] or "rows" [n, d]
K_COUNTS = (
    "fedudp.counts"  # MetricRecord in a reply: "count", "clipped", "users", "failed", "raised"
)
K_PERSONAL = "fedudp.personal"  # ArrayRecord in a client's context.state (never sent)


def _numpy(arr: Array) -> np.ndarray:
    """``arr.numpy()`` without parsing the .npy header for every array (numpy parses it with
    ``ast.literal_eval``, most of the mod's own time per user): the data of a C-ordered
    ``.npy`` are its last ``size · itemsize`` bytes; anything else goes through ``numpy()``."""
    try:
        dt = np.dtype(arr.dtype)
        shape = tuple(int(n) for n in arr.shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        data = arr.data
        head = bytes(data[: len(data) - nbytes][:256])
        if (
            arr.stype == "numpy.ndarray"
            and len(data) >= nbytes
            and head.startswith(b"\x93NUMPY")
            and b"'fortran_order': False" in head
            and repr(dt.str).encode() in head
        ):
            return np.frombuffer(
                data, dtype=dt, count=nbytes // max(dt.itemsize, 1), offset=len(data) - nbytes
            ).reshape(shape)
    except (TypeError, ValueError):
        pass
    return arr.numpy()


def _flat(arrays: ArrayRecord, names: Sequence[str]) -> torch.Tensor:
    return (
        torch.cat(
            [
                torch.from_numpy(np.array(_numpy(arrays[k]), dtype=np.float64)).reshape(-1)
                for k in names
            ]
        )
        if names
        else torch.zeros(0, dtype=torch.float64)
    )


def _unflat(vec: torch.Tensor, like: ArrayRecord, names: Sequence[str]) -> dict[str, np.ndarray]:
    out, i = {}, 0
    for k in names:
        ref = _numpy(like[k])
        n = ref.size
        out[k] = vec[i : i + n].numpy().reshape(ref.shape).astype(ref.dtype)
        i += n
    return out


def _record(arrays: dict) -> ArrayRecord:
    """An ArrayRecord of numpy arrays (or Flower ``Array``s), in the given key order."""
    return ArrayRecord(
        {
            k: v if isinstance(v, Array) else Array(np.ascontiguousarray(v))
            for k, v in arrays.items()
        }
    )


def _is_personal(name: str, patterns: Sequence[str]) -> bool:
    return any(
        fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") for p in patterns
    )


# -- server side --------------------------------------------------------------------------------
class RunFailed(RuntimeError):
    """No training round of a ``UserLevelDP`` run released (every one was withheld)."""


# what a mod calls to run the rest of the ClientApp (Flower's ``ClientAppCallable``)
CallNext = Callable[[Message, Context], Message]


def _reason(text: str | None, limit: int = 300) -> str:
    """A client's error reason on one line (the last non-empty lines of a traceback)."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    one = " | ".join(lines[-2:]) if lines else "?"
    return one if len(one) <= limit else one[:limit] + "..."


def _bad_contribution(rec: Any, dim: int) -> str | None:
    """Why a client's contribution record cannot be right (None: it can): neither ``sum`` nor
    ``rows``, the wrong length, or a NaN/inf value (the client is then failed: it contributes
    exactly zero, as a failed owner does on fedudp's own engine)."""
    key = "rows" if "rows" in rec else "sum" if "sum" in rec else None
    if key is None:
        return f"{K_CONTRIB} holds neither 'sum' nor 'rows'"
    a = np.asarray(_numpy(rec[key]))
    ok_shape = a.shape == (dim,) if key == "sum" else a.ndim == 2 and a.shape[1] == dim
    if not ok_shape:
        return f"{K_CONTRIB}['{key}'] has shape {a.shape}, the shared parameters are {dim} values"
    if not np.isfinite(a).all():
        return f"{K_CONTRIB}['{key}'] is not finite"
    return None


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
        self.strategy, self.aggregator = strategy, aggregator
        self._outer_checked = False  # a Flower DP wrapper around this one: the first round
        self.personal, self.seed = tuple(personal), int(seed)
        self.randomness = (
            randomness
            if isinstance(randomness, Randomness)
            else Randomness(self.seed, str(randomness))
        )
        self.seed = self.randomness.seed
        if int(min_owners) < 1 or int(min_users) < 0:
            raise ValueError(
                f"UserLevelDP: min_owners must be >= 1 and min_users >= 0, got "
                f"{min_owners} / {min_users}"
            )
        self.withheld: list[tuple[int, str]] = []  # (round, why): nothing released
        self.event = aggregator.dp_event()
        ledger = Ledger(
            unit="user",
            adjacency=aggregator.adjacency,
            accounting="certified",
            guarantee=aggregator.guarantee,
            mechanism=aggregator.name,
            accountant=aggregator.accountant,
            delta=float(delta),
            target_epsilon=target_epsilon,
            notes=[
                "fedudp.flower.UserLevelDP: user-level DP of the released "
                "shared update; the number of users and the sampling rate "
                "are public (declared)",
                "released outside the guarantee: the clients' training and evaluation "
                "metrics, and the counts of users dropped for a non-finite update or a "
                "training step that raised (nonfinite_users, raised_users)",
            ],
        )
        # the release path (fedudp.billboard.release, the billboard's too): the budget check,
        # the fail-closed rule, the composition and the ledger of every release
        self.gate = ReleaseGate(
            ledger,
            accountant_for(self.event, aggregator.group, target_epsilon),
            float(delta),
            target_epsilon,
            int(min_owners),
            int(min_users),
        )
        one_off = aggregator.one_off_event()
        if one_off is not None:
            self.gate.compose_once(one_off)
        self.ledger.extra["public"] = {
            "users": aggregator.sampling.population,
            "user_sampling_rate": aggregator.sampling.rate,
        }
        self.ledger.randomness = self.randomness.ledger_name
        self.ledger.extra["fail_closed"] = {
            "min_owners": self.min_owners,
            "min_users": self.min_users,
        }
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
        (``fedudp.flower_contract.KEYS``, docs/flower-apps.md#the-run-config-contract): ε, δ and
        N (``fedudp.public.users``) required, T from ``num-server-rounds`` (or
        ``fedudp.train.rounds``; both must agree), every other ``fedudp.*`` key optional with
        its default; an unknown key, a wrong type or a missing required key is a
        ``RunConfigError`` naming it. Randomness is ``secure`` unless set (the wrapper's
        default, unlike fedudp's own engines). The estimator is calibrated by fedudp's config
        builder over the shared parameters of ``initial_arrays`` (those not matching
        ``personal``); ``ledger_path``: the durable ``ledger.jsonl`` (the constructor's)."""
        from fedudp import build
        from fedudp.aggregators.base import Sampling
        from fedudp.config import config_from_overrides
        from fedudp.flower_contract import as_run_config_error, checked, config_overrides

        # the contract (fedudp/flower_contract.py): an unknown key, a wrong type, a missing
        # epsilon / delta / N, two different numbers of rounds: an error naming the key
        values = checked(run_config)
        over = config_overrides(values)
        secure = "fedudp.privacy.randomness" not in run_config  # the wrapper's default: secure
        # the app's own data: its public numbers are the declared ones (records per user: 1
        # unless declared, for the estimators that derive a radius from it)
        over = {"dataset.name": "memory", "public.owner_capacity": over["public.users"], **over}
        dim = sum(
            int(np.prod(initial_arrays[k].shape))
            for k in initial_arrays
            if not _is_personal(k, personal)
        )
        # (root_placeholder: dp-accounting's absl warnings configure no root logger)
        try:  # the builder's errors name fedudp config keys: named here as run-config keys
            with root_placeholder():
                cfg = config_from_overrides({"method": "full_dp", **over})
                build.check(cfg)
                s = build.settings(cfg)
                agg = build.estimator(
                    cfg, Sampling(s.sampling_rate, build.planned_units(cfg)[1]), s.rounds, dim
                )
        except ValueError as e:
            raise as_run_config_error(e) from None
        mode = Randomness.SECURE if secure else s.randomness
        assert s.delta is not None  # the run-config contract requires fedudp.privacy.delta
        out = cls(
            strategy,
            agg,
            delta=float(s.delta),
            target_epsilon=s.target_epsilon,
            personal=personal,
            seed=s.seed,
            randomness=Randomness(s.seed, mode),
            min_owners=s.min_owners,
            min_users=s.min_users,
            rounds=int(values["rounds"]),
            expected_update_norm=values.get("fedudp.expected-update-norm"),
            ledger_path=ledger_path,
        )
        if agg.constraint.rows:  # per-user rows: the rows' declared bound B
            out.update_bound = float(values["fedudp.estimator.bound"])
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
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        sent = self._sent.pop(server_round, None)
        if sent is None:
            return None, None
        names = [k for k in sent if not _is_personal(k, self.personal)]
        dim = sum(int(np.prod(sent[k].shape)) for k in names)
        parts, failed, held, nonfinite, raised = [], 0, 0, 0, 0
        train_metrics: list[tuple[float, dict[str, float]]] = []
        for r in replies:
            why = None
            if r.has_error():
                why = f"error {r.error.code}: {_reason(r.error.reason)}"
            elif K_CONTRIB not in r.content or K_COUNTS not in r.content:
                why = (
                    f"no {K_CONTRIB} / {K_COUNTS} in the reply (is fedudp.flower."
                    "user_level_mod in the ClientApp's mods?)"
                )
            elif "users" not in r.content[K_COUNTS]:
                why = f"no users count in {K_COUNTS} (a user_level_mod older than this server)"
            else:
                why = _bad_contribution(r.content[K_CONTRIB], dim)
            if why is not None:  # contributes exactly zero against the public denominator
                failed += 1
                log(
                    WARNING,
                    "UserLevelDP round %s: client node %s failed: %s",
                    server_round,
                    r.metadata.src_node_id,
                    why,
                )
                continue
            # the mod's own records (train_round): their keys' types are the ones written there
            rec: Any = r.content[K_CONTRIB]
            counts: Any = r.content[K_COUNTS]
            if "metrics" in r.content.metric_records:  # the app's, over the client's users
                train_metrics.append(_user_metrics(r))
            held += int(counts["users"])
            n = int(counts["count"])
            # the users the client dropped (a NaN/inf update, a step that raised): zero, uncounted
            nonfinite += int(counts.get("failed", 0))
            raised += int(counts.get("raised", 0))
            if counts.get("failed", 0) or counts.get("raised", 0):
                log(
                    WARNING,
                    "UserLevelDP round %s: client node %s dropped %s user(s) with a non-finite "
                    "update and %s whose training step raised (each contributes zero; the "
                    "reasons are in that client's log)",
                    server_round,
                    r.metadata.src_node_id,
                    int(counts.get("failed", 0)),
                    int(counts.get("raised", 0)),
                )
            if "rows" in rec:
                G = torch.from_numpy(np.asarray(rec["rows"].numpy(), dtype=np.float64))
                parts.append(Contribution(G.reshape(-1, dim), None, n, int(counts["clipped"])))
            else:
                t = torch.from_numpy(np.asarray(rec["sum"].numpy(), dtype=np.float64))
                parts.append(Contribution(None, t.reshape(dim), n, int(counts["clipped"])))
        # fail closed (the billboard's rule): answering clients and their declared user slots
        why = self.gate.withhold(len(parts), held, failed, who="client", key="fedudp.train.")
        if why is not None:  # nothing released, nothing composed, the model unchanged
            self.withheld.append((server_round, why))
            log(
                WARNING,
                "UserLevelDP round %s: withheld, nothing released, no epsilon spent (%s)",
                server_round,
                why,
            )
            return None, MetricRecord(
                {
                    "withheld": 1,
                    "failed_clients": failed,
                    "nonfinite_users": nonfinite,
                    "raised_users": raised,
                    "epsilon": self.epsilon,
                    "delta": self.delta,
                }
            )
        c = Contribution.merge(parts, dim, torch.float64, self._constraint().rows)
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
        )
        assert entry.epsilon is not None  # composed by a private estimator's accountant
        eps = entry.epsilon
        new = _flat(sent, names) + agg.mean.to(torch.float64)
        updated = _unflat(new, sent, names)
        arrays = _record({k: updated.get(k, sent[k]) for k in sent})
        # the wrapped strategy applies the one private update as it would a client's model; its
        # metrics: the app's training metrics over all the clients' users, record-weighted
        # (outside the DP guarantee, as the ledger says)
        app_metrics = (
            _weighted_metrics(train_metrics) if train_metrics else MetricRecord({"num-examples": 1})
        )
        inner_arrays, inner_metrics = self.strategy.aggregate_train(
            server_round,
            [
                Message(
                    RecordDict({"arrays": arrays, "metrics": app_metrics}),
                    reply_to=replies[0] if replies else None,
                )
            ]
            if replies
            else [],
        )
        metrics = MetricRecord(
            {
                "epsilon": eps,
                "users": int(c.count),
                "clients": len(parts),
                "failed_clients": failed,
                "nonfinite_users": nonfinite,
                "raised_users": raised,
                "delta": self.delta,
            }
        )
        shown = ", ".join(
            f"{k} {v:.4g}" for k, v in app_metrics.items() if k != "num-examples" and train_metrics
        )
        log(
            INFO,
            "UserLevelDP round %s: %s clients replied (%s failed), %s users released as one "
            "update, epsilon %.4f (delta %g)%s",
            server_round,
            len(parts),
            failed,
            c.count,
            eps,
            self.delta,
            f"; the app's training metrics: {shown}" if shown else "",
        )
        if inner_metrics is not None:
            for k, v in inner_metrics.items():
                if k not in metrics:
                    metrics[k] = v
        return (inner_arrays if inner_arrays is not None else arrays), metrics

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
        ends failed rather than completed."""
        if self.rounds is not None and int(num_rounds) != self.rounds:
            from fedudp.flower_contract import RunConfigError

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
        """The run's outcome, in the log and the ledger (``ledger.extra["outcome"]``): every
        round released, some withheld (a warning naming them), or none released (``RunFailed``:
        the ServerApp's run then ends failed, not completed)."""
        released = [e.round for e in self.ledger.entries]
        withheld = [r for r, _ in self.withheld]
        status = (
            "failed: nothing released"
            if num_rounds > 0 and not released
            else f"completed, {len(withheld)} of {num_rounds} rounds withheld"
            if withheld
            else "completed"
        )
        out = {
            "status": status,
            "rounds": num_rounds,
            "released": len(released),
            "withheld": [[r, why] for r, why in self.withheld],
            "stopped": self.stopped,
            "epsilon": self.epsilon,
        }
        self.ledger.extra["outcome"] = out
        if self.ledger_path is not None:  # the final head (outcome, utility) and every line
            ledger_file.write(self.ledger_path, ledger_file.head(self.ledger), self.ledger.entries)
        if status.startswith("failed"):
            if self.withheld:
                r, why = self.withheld[-1]
                reason = (
                    f"every training round was withheld, nothing released (round {r}: {why}); "
                    "see the clients' reasons above"
                )
            else:
                reason = f"no training round released ({self.stopped or 'no round was run'})"
            log(WARNING, "UserLevelDP: run failed: %s", reason)
            raise RunFailed(f"UserLevelDP: {reason}")
        if withheld:
            log(
                WARNING,
                "UserLevelDP: %s of %s training rounds were withheld and released nothing "
                "(rounds %s; the last: %s); %s released, epsilon %.4f",
                len(withheld),
                num_rounds,
                ", ".join(map(str, withheld[:20])) + (" ..." if len(withheld) > 20 else ""),
                self.withheld[-1][1],
                len(released),
                self.epsilon,
            )
        else:
            log(
                INFO,
                "UserLevelDP: %s of %s rounds released, epsilon %.4f at delta %g%s",
                len(released),
                num_rounds,
                self.epsilon,
                self.delta,
                f" ({self.stopped})" if self.stopped else "",
            )
        return out

    def log_utility(self, initial_arrays: ArrayRecord) -> dict:
        """Before round 1: the expected cohort q·N, the std per coordinate of the noise on the
        released mean update and its expected norm over the d shared coordinates, against a
        typical update norm (``expected_update_norm``, else the clip C: no user's clipped
        update is longer, so a mean of aligned updates is at most C). Warns when the noise's
        norm exceeds it. Public numbers only (the estimator's calibration, q, N, d)."""
        from fedudp.flower_contract import release_noise

        names = [k for k in initial_arrays if not _is_personal(k, self.personal)]
        dim = sum(int(np.prod(initial_arrays[k].shape)) for k in names)
        samp = self.aggregator.sampling
        std, how = release_noise(self.aggregator, dim)
        clip = self.aggregator.constraint.clip
        typical, what = (
            (self.expected_update_norm, "fedudp.expected-update-norm")
            if self.expected_update_norm is not None
            else (clip, "the clip C")
            if clip is not None
            else (self.update_bound, "the bound B (fedudp.estimator.bound)")
        )
        u: dict[str, Any] = {
            "expected_cohort": float(samp.rate * samp.population),
            "users": int(samp.population),
            "rate": float(samp.rate),
            "dim": dim,
            "noise_std": std,
            "noise_norm": None if std is None else std * float(np.sqrt(dim)),
            "typical_norm": typical,
            "typical_from": what,
        }
        self.utility = u
        self.ledger.extra["utility_before_round_1"] = dict(u, noise_from=how)
        if std is None:
            log(
                INFO,
                "UserLevelDP: %s; expected cohort q*N = %.4g*%d = %.4g users per round (%s)",
                self.aggregator.name,
                samp.rate,
                samp.population,
                u["expected_cohort"],
                how,
            )
            return u
        log(
            INFO,
            "UserLevelDP: %s, expected cohort q*N = %.4g*%d = %.4g users per round; noise on "
            "the released mean update: std %.4g per coordinate (%s), expected norm %.4g over "
            "d = %d shared coordinates",
            self.aggregator.name,
            samp.rate,
            samp.population,
            u["expected_cohort"],
            std,
            how,
            u["noise_norm"],
            dim,
        )
        if typical is not None and u["noise_norm"] > typical:
            log(
                WARNING,
                "UserLevelDP: the noise dominates: its expected norm %.4g per round exceeds a "
                "typical update norm %.4g (%s) by %.3gx; more users N, a larger q, fewer rounds, "
                "a larger epsilon or a smaller model would reduce it",
                u["noise_norm"],
                typical,
                what,
                u["noise_norm"] / typical,
            )
        return u

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        """Flower's strategy summary, logged by ``start`` before round 1: the estimator, the
        rounds it is calibrated for, the budget and the randomness (and, once rounds have run,
        the releases so far and their ε)."""
        n = len(self.ledger.entries)
        so_far = (
            f"{n} release{'s' if n != 1 else ''} so far, epsilon {self.epsilon:.4f}"
            if n or self.withheld
            else "nothing released yet"
        )
        log(
            INFO,
            "UserLevelDP: estimator %s for %s rounds, target epsilon %s at delta %g, "
            "randomness %s; %s%s",
            self.aggregator.name,
            self.rounds if self.rounds is not None else "any number of",
            f"{self.target_epsilon:g}" if self.target_epsilon is not None else "none",
            self.delta,
            self.randomness.ledger_name,
            so_far,
            f" ({self.stopped})" if self.stopped else "",
        )
        self.strategy.summary()


# -- client side --------------------------------------------------------------------------------
def _fast_configs(msg: Message, context: Context) -> dict[str, Any]:
    """What the fast path reads its keyed settings from: the training message's config records
    and, under ``fedudp.flower_fast_data.RUN_CONFIG``, the client's run config."""
    from fedudp.flower_fast_data import RUN_CONFIG

    return {**msg.content.config_records, RUN_CONFIG: dict(context.run_config)}


@dataclass(frozen=True)
class _Round:
    round: int
    randomness: Randomness
    rate: float
    rows: bool
    clip: float | None
    personal: tuple[str, ...]
    population: int


def _round_of(msg: Message) -> _Round:
    r: Any = msg.content[K_DP]  # the server's own record (configure_train)
    clip = float(r["clip"])
    # seeded only where the server says so and sends the seed; anything else: OS entropy here
    seeded = "randomness" in r and str(r["randomness"]) == Randomness.SEEDED and "seed" in r
    rand = Randomness.seeded(int(r["seed"])) if seeded else Randomness.secure()
    return _Round(
        int(r["round"]),
        rand,
        float(r["rate"]),
        bool(r["rows"]),
        None if clip < 0 else clip,
        tuple(p for p in r["personal"] if p),
        int(r["population"]),
    )


def sampled_users(
    users: Sequence[int], randomness: Randomness | int, round_: int, rate: float, population: int
) -> list[int]:
    """The users taking part this round: each independently with probability ``rate`` (Poisson)
    over the ``population`` users' global indices. Seeded (``randomness`` a seed or
    ``Randomness.seeded``): keyed by (seed, round), the billboard's own sample of fedudp's engine
    (``Billboard.sample``); secure: from this process's OS entropy (each client draws its own
    users' sample; independent draws per user, so still Poisson over all users)."""
    if rate >= 1.0:
        return list(users)
    rand = randomness if isinstance(randomness, Randomness) else Randomness.seeded(randomness)
    mask = rand.numpy_rng(Purpose.SAMPLE, round_).random(int(population)) < rate
    return [u for u in users if mask[int(u)]]


def user_level_mod(
    users_per_client: int | None = None,
    *,
    personal: Sequence[str] = (),
    users_of: Callable[[Context], Sequence[int]] | None = None,
    fast: TorchTraining | None = None,
    train_metrics: bool = True,
) -> Callable[[Message, Context, CallNext], Message]:
    """A Flower client mod that makes a client's training user-level DP (see the module doc).

    On a training message it samples the client's users, runs the app's own training step
    once per sampled user on that user's data only (the app's loader sees the user's global
    index as ``partition-id``), and replies with the users' clipped updates (their sum and count,
    or the rows); personal layers stay on the client. The server side is ``UserLevelDP``.

    Parameters
    ----------
    users_per_client : int or None
        The users each client holds: the client with partition-id p holds users
        p·k .. p·k + k − 1 of num-partitions · k, unless the run config sets
        ``fedudp.users-per-client``.
    personal : Sequence[str]
        Parameter-name patterns (fnmatch) kept on the client, never sent.
    users_of : callable or None
        ``users_of(context)``: another rule, returning the client's global user indices.
    fast : TorchTraining or None
        The app's training step declared as plain PyTorch SGD
        (``fedudp.flower_fast.TorchTraining``): the sampled users' updates are then computed
        together, without calling the app's train step; the users, the clipping and the reply
        are the same.
    train_metrics : bool, default True
        Send the app's scalar training metrics averaged over the round's sampled users
        (weighted by their ``num-examples``). They are outside the DP guarantee: with one
        sampled user at a client they are that user's own (docs/flower-apps.md#evaluation-and-
        the-apps-metrics). False: the reply carries the contribution and counts only.

    Returns
    -------
    callable
        The mod, ``mod(message, context, call_next)``, for ``ClientApp(mods=[...])``.
    """
    if users_per_client is not None and int(users_per_client) < 1:
        raise ValueError(f"users_per_client must be >= 1, got {users_per_client}")
    return _UserLevelMod(users_per_client, tuple(personal), users_of, fast, train_metrics)


class _UserLevelMod:
    """The mod ``user_level_mod`` returns (its parameters, same names): ``__call__`` passes
    anything but a fedudp training message to the app (with the client's own personal layers
    for an evaluation) and answers a training message with ``train_round``: the checks of the
    client's users against the server's N, the sampled users' updates (``user_updates``), the
    client's personal step (``personal_step``) and the reply (``reply``)."""

    def __init__(
        self,
        users_per_client: int | None,
        personal: tuple[str, ...],
        users_of: Callable[[Context], Sequence[int]] | None,
        fast: TorchTraining | None,
        train_metrics: bool,
    ) -> None:
        self.users_per_client = users_per_client
        self.personal = personal
        self.users_of = users_of
        self.fast = fast
        self.train_metrics = train_metrics

    # -- the client's users -----------------------------------------------------------------
    def per_client(self, context: Context) -> int:
        if "fedudp.users-per-client" in context.run_config:  # the run config decides
            return int(context.run_config["fedudp.users-per-client"])
        if self.users_per_client is None:
            raise ValueError(
                "user_level_mod: set fedudp.users-per-client in the run config or users_per_client="
            )
        return int(self.users_per_client)

    def users(self, context: Context) -> list[int]:
        if self.users_of is not None:
            return [int(u) for u in self.users_of(context)]
        p, k = int(context.node_config["partition-id"]), self.per_client(context)
        return list(range(p * k, (p + 1) * k))

    def population(self, context: Context, mine: Sequence[int]) -> int:
        """N outside a training message: the run config's (the server's), else the users'
        rule's own total."""
        if "fedudp.public.users" in context.run_config:
            return int(context.run_config["fedudp.public.users"])
        if self.users_of is None:
            return int(context.node_config.get("num-partitions", 1)) * self.per_client(context)
        return max(mine, default=-1) + 1

    def too_many(self, context: Context, rnd: _Round) -> str | None:
        """Why the clients' users by the per-client rule outnumber the N the server calibrated
        for (None: they do not; N is an upper bound, fewer users run unchanged)."""
        if self.users_of is not None:
            return None
        total = int(context.node_config.get("num-partitions", 1)) * self.per_client(context)
        if total <= rnd.population:
            return None
        return (
            f"user_level_mod: {context.node_config.get('num-partitions')} clients x "
            f"{self.per_client(context)} users per client = {total} users, more than the "
            f"server's estimator is calibrated for ({rnd.population}, fedudp.public.users)"
        )

    @staticmethod
    def outside(rnd: _Round, mine: Sequence[int]) -> str | None:
        """Why some of the client's user indices fall outside 0 .. N - 1 (None: none do)."""
        out = [u for u in mine if not 0 <= u < rnd.population]
        if not out:
            return None
        return (
            f"user_level_mod: users_of gave user indices {out[:5]} outside "
            f"0..{rnd.population - 1} (the server's estimator is calibrated for "
            f"{rnd.population} users)"
        )

    # -- personal layers (kept in the client's state, never sent) ---------------------------
    @staticmethod
    def kept(context: Context) -> ArrayRecord | None:
        return cast(ArrayRecord, context.state[K_PERSONAL]) if K_PERSONAL in context.state else None

    @staticmethod
    def with_personal(arrays: ArrayRecord, keep: ArrayRecord | None) -> ArrayRecord:
        if keep is None:
            return arrays
        return _record({k2: keep[k2] if k2 in keep else arrays[k2] for k2 in arrays})

    # -- the app's own training step on one user ----------------------------------------------
    @staticmethod
    def user_context(context: Context, u: int, total: int) -> Context:
        return Context(
            run_id=context.run_id,
            node_id=context.node_id,
            node_config={
                **context.node_config,
                **_client_keys(context),
                "partition-id": int(u),
                "num-partitions": int(total),
                K_USER_ID: int(u),
            },
            state=context.state,
            run_config=context.run_config,
        )

    def train_as(
        self,
        msg: Message,
        arrays_key: str,
        arrays: ArrayRecord,
        context: Context,
        u: int,
        total: int,
        call_next: CallNext,
    ) -> Message:
        """The app's own training step on user ``u``'s data only (partition u of ``total``),
        from ``arrays``."""
        content = RecordDict(
            {
                key: (arrays if key == arrays_key else rec)
                for key, rec in msg.content.items()
                if key != K_DP
            }
        )
        return call_next(_copy_with(msg, content), self.user_context(context, u, total))

    # -- the mod ------------------------------------------------------------------------------
    def __call__(self, msg: Message, context: Context, call_next: CallNext) -> Message:
        if str(msg.metadata.message_type).split(".")[0] != "train":
            return self.pass_through(msg, context, call_next)
        # never in the clear: no UserLevelDP record, no training; no second DP wrapper or mod
        why = (
            NO_WRAPPER
            if K_DP not in msg.content
            else foreign_keys(msg.content.config_records) or stacked_mods(call_next)
        )
        if why is not None:
            log(WARNING, "%s", why)
            return Message(error=Error(ErrorCode.MOD_FAILED_PRECONDITION, why), reply_to=msg)
        rnd = _round_of(msg)
        try:
            return self.train_round(msg, rnd, context, call_next)
        except ValueError as e:  # a setup error: the reason goes back to the server's log
            return Message(error=Error(ErrorCode.MOD_FAILED_PRECONDITION, str(e)), reply_to=msg)

    def pass_through(self, msg: Message, context: Context, call_next: CallNext) -> Message:
        """Any message but a fedudp training one goes to the app; an evaluation gets the
        client's own personal layers."""
        try:  # the client's users, for an evaluation on all its data (client_users)
            mine = self.users(context)
            _remember_users(context, mine, self.population(context, mine))
        except (ValueError, KeyError, TypeError):
            pass  # not configured for users: the app evaluates as it would without the mod
        keep = self.kept(context)
        if keep is not None and msg.content.array_records:  # evaluation: own personal
            key = next(iter(msg.content.array_records.keys()))
            content = RecordDict(
                {
                    k2: (self.with_personal(cast(ArrayRecord, rec), keep) if k2 == key else rec)
                    for k2, rec in msg.content.items()
                }
            )
            msg = _copy_with(msg, content)
        return call_next(msg, context)

    def train_round(
        self, msg: Message, rnd: _Round, context: Context, call_next: CallNext
    ) -> Message:
        patterns = self.personal or rnd.personal
        arrays_key = next(iter(msg.content.array_records.keys()))
        # every user's update at the broadcast: its personal layers are the server's initial,
        # public values (the server never moves them), never this client's own
        base = cast(ArrayRecord, msg.content[arrays_key])
        names = [k2 for k2 in base if not _is_personal(k2, patterns)]
        why = self.too_many(context, rnd)
        if why is not None:
            return Message(error=Error(ErrorCode.MOD_FAILED_PRECONDITION, why), reply_to=msg)
        total = rnd.population
        mine = self.users(context)
        _remember_users(context, mine, total)
        why = self.outside(rnd, mine)
        if why is not None:
            return Message(error=Error(ErrorCode.MOD_FAILED_PRECONDITION, why), reply_to=msg)
        sampled = sampled_users(mine, rnd.randomness, rnd.round, rnd.rate, total)
        G, metrics, raised = self.user_updates(
            msg, arrays_key, base, names, sampled, context, total, call_next
        )
        # fedudp's own rule (make_reply): a NaN/inf update or a step that raised is dropped
        # alone (zero, uncounted), never the client's other users (fedudp.flower_guard)
        got = user_rows(G, Constraint(rows=rnd.rows, clip=rnd.clip), raised)
        for i in got.nonfinite:
            log(WARNING, "user_level_mod: user %s dropped: a non-finite update", sampled[i])
        for i, why in got.raised.items():
            log(
                WARNING,
                "user_level_mod: user %s dropped: its training step raised: %s",
                sampled[i],
                why,
            )
        self.personal_step(msg, arrays_key, base, patterns, mine, context, total, call_next)
        kept = [metrics[i] for i in got.kept] if metrics else []
        return self.reply(msg, rnd, got, len(mine), int(G.shape[1]), kept)

    def user_updates(
        self,
        msg: Message,
        arrays_key: str,
        base: ArrayRecord,
        names: list[str],
        sampled: Sequence[int],
        context: Context,
        total: int,
        call_next: CallNext,
    ) -> tuple[torch.Tensor, list[tuple[float, dict[str, float]]], dict[int, str]]:
        """The sampled users' updates of the shared parameters ``names`` at the broadcast
        ``base`` ([users, d]), their training metrics (weight, values), and {index into
        ``sampled``: reason} for the users whose step raised or replied with an error (their
        rows are zeros, dropped by ``user_rows``), from the fast path or the app's step once
        per user."""
        start = _flat(base, names)
        if self.fast is not None:  # fedudp.flower_fast: every sampled user's update at once
            at = {k2: _numpy(base[k2]) for k2 in base}
            cfg = _fast_configs(msg, context)
            return self.fast.updates(at, names, sampled, total, cfg)
        rows, metrics, raised = [], [], {}
        for i, u in enumerate(sampled):
            try:
                reply = self.train_as(msg, arrays_key, base, context, u, total, call_next)
                row, m = _update_of(reply, names, start)
            except Exception as e:  # noqa: BLE001  (this user alone is dropped, with its reason)
                raised[i] = one_line(e)
                row, m = torch.zeros_like(start), (0.0, {})
            rows.append(row)
            metrics.append(m)
        G = torch.stack(rows) if rows else torch.zeros(0, len(start), dtype=torch.float64)
        return G, metrics, raised

    def personal_step(
        self,
        msg: Message,
        arrays_key: str,
        base: ArrayRecord,
        patterns: Sequence[str],
        mine: Sequence[int],
        context: Context,
        total: int,
        call_next: CallNext,
    ) -> None:
        """The client's own personal layers trained on all its users, kept in its state, never
        sent. A user whose step raises, replies with an error or leaves NaN/inf personal layers
        is skipped (the chain goes on from the previous user's), never failing the client."""
        if not patterns:
            return None
        if self.fast is not None:
            mixed = self.with_personal(base, self.kept(context))
            at = {k2: _numpy(mixed[k2]) for k2 in mixed}
            own_names = [k2 for k2 in base if _is_personal(k2, patterns)]
            cfg = _fast_configs(msg, context)
            own_arrays = self.fast.personal(at, own_names, mine, total, cfg)
            context.state[K_PERSONAL] = _record(own_arrays)
            return None
        own = self.kept(context)
        for u in mine:
            try:
                reply = self.train_as(
                    msg, arrays_key, self.with_personal(base, own), context, u, total, call_next
                )
                if reply.has_error():
                    raise RuntimeError(_reason(reply.error.reason))
                got = cast(
                    ArrayRecord, reply.content[next(iter(reply.content.array_records.keys()))]
                )
                mine_own = {k2: got[k2] for k2 in got if _is_personal(k2, patterns)}
                if not all(np.isfinite(_numpy(a)).all() for a in mine_own.values()):
                    raise ValueError("non-finite personal layers")
            except Exception as e:  # noqa: BLE001  (skipped alone: its reason logged here)
                log(WARNING, "user_level_mod: user %s's personal step skipped: %s", u, one_line(e))
                continue
            own = _record(mine_own)
        if own is not None:
            context.state[K_PERSONAL] = own
        return None

    def reply(
        self,
        msg: Message,
        rnd: _Round,
        got: UserRows,
        users: int,
        dim: int,
        metrics: list[tuple[float, dict[str, float]]],
    ) -> Message:
        """The counts (the kept users, the clipped ones, the client's declared users, the users
        dropped for a non-finite update and for a step that raised), the app's metrics over the
        kept users (if sent) and the clipped contribution (rows or sum)."""
        c = got.contribution
        out = RecordDict(
            {
                K_COUNTS: MetricRecord(
                    {
                        "count": int(c.count),
                        "clipped": int(c.clipped),
                        "users": users,
                        "failed": len(got.nonfinite),
                        "raised": len(got.raised),
                    }
                )
            }
        )
        if metrics and self.train_metrics:  # the app's metrics, record-weighted over users
            out["metrics"] = _weighted_metrics(metrics)
        if rnd.rows:
            rows_out = c.rows if c.rows is not None else torch.zeros(0, dim)
            out[K_CONTRIB] = _record({"rows": rows_out.to(torch.float64).numpy()})
        else:
            assert c.total is not None  # not rows: the clipped sum
            out[K_CONTRIB] = _record({"sum": c.total.to(torch.float64).numpy()})
        return Message(out, reply_to=msg)


K_USERS = "fedudp.users"  # ConfigRecord in a client's context.state: its users and N (not sent)
K_USER_ID = "fedudp.user-id"  # node_config of the app's training step: the user it trains
K_CLIENT_PARTITION = "fedudp.client-partition-id"  # node_config: the client's own partition-id
K_CLIENT_PARTITIONS = "fedudp.client-num-partitions"  # ... and num-partitions


def _client_keys(context: Context) -> dict:
    """The client's own ``partition-id`` / ``num-partitions`` under keys the mod never changes
    (the app's training step sees a user's index as ``partition-id``)."""
    nc = context.node_config
    if K_CLIENT_PARTITION in nc:  # already a user's context
        return {
            K_CLIENT_PARTITION: nc[K_CLIENT_PARTITION],
            K_CLIENT_PARTITIONS: nc[K_CLIENT_PARTITIONS],
        }
    out = {}
    if "partition-id" in nc:
        out[K_CLIENT_PARTITION] = nc["partition-id"]
    if "num-partitions" in nc:
        out[K_CLIENT_PARTITIONS] = nc["num-partitions"]
    return out


def _remember_users(context: Context, users: Sequence[int], total: int) -> None:
    context.state[K_USERS] = ConfigRecord(
        {"users": [int(u) for u in users] or [-1], "num-users": int(total), "n": len(users)}
    )


def client_users(context: Context) -> tuple[list[int], int]:
    """(the client's global user indices, N) as ``user_level_mod`` computed them for the
    message being handled, in training and in evaluation alike: the stable way for an app to
    load *all* of its client's data (``load_data(u, N)`` for each ``u``), e.g. to evaluate,
    whatever ``partition-id`` says (in training the mod sets it to one user's index, in
    evaluation it is the client's own). A ``LookupError`` outside the mod."""
    if K_USERS not in context.state:
        raise LookupError(
            "fedudp.flower.client_users: no user_level_mod in this ClientApp's mods (or it has "
            "no users rule: users_per_client= / fedudp.users-per-client / users_of=)"
        )
    rec: Any = context.state[K_USERS]  # the mod's own record (_remember_users)
    n = int(rec["n"])
    return [int(u) for u in list(rec["users"])[:n]], int(rec["num-users"])


def _update_of(
    reply: Message, names: Sequence[str], start: torch.Tensor
) -> tuple[torch.Tensor, tuple[float, dict[str, float]]]:
    """(a user's update of the shared parameters ``names`` from ``start``, its metrics) from
    the app's reply; an error reply, or one without the model's arrays, raises (the user is
    then dropped alone)."""
    if reply.has_error():
        raise RuntimeError(
            f"the app replied with error {reply.error.code}: {_reason(reply.error.reason)}"
        )
    if not reply.content.array_records:
        raise ValueError("the app's training reply has no ArrayRecord")
    got = cast(ArrayRecord, reply.content[next(iter(reply.content.array_records.keys()))])
    missing = [k for k in names if k not in got]
    if missing:
        raise ValueError(f"the app's training reply lacks the arrays {missing[:5]}")
    row = _flat(got, names)
    if row.shape != start.shape:
        raise ValueError(
            f"the app's training reply has {row.numel()} shared values, "
            f"the broadcast {start.numel()}"
        )
    return row - start, _user_metrics(reply)


def _user_metrics(reply: Message) -> tuple[float, dict[str, float]]:
    """(the user's weight: its ``num-examples``, else 1; the app's scalar training metrics)."""
    if "metrics" not in reply.content.metric_records:
        return 1.0, {}
    rec: Any = reply.content["metrics"]  # the app's MetricRecord
    vals = {
        k: float(v)
        for k, v in rec.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "num-examples"
    }
    return float(rec.get("num-examples", 1.0)), vals


def _weighted_metrics(parts: Sequence[tuple[float, dict[str, float]]]) -> MetricRecord:
    """Each metric's mean over the parts that report it, weighted by their records; and the
    records in all (``num-examples``)."""
    total = sum(w for w, _ in parts)
    out: dict[str, Any] = {"num-examples": round(total)}
    for key in sorted({k for _, vals in parts for k in vals}):
        ws = [(w, vals[key]) for w, vals in parts if key in vals]
        wsum = sum(w for w, _ in ws)
        if wsum > 0:
            out[key] = sum(w * v for w, v in ws) / wsum
    return MetricRecord(out)


def _copy_with(msg: Message, content: RecordDict) -> Message:
    """``msg`` with another content (same metadata), for the app's own training step."""
    import copy

    m = copy.copy(msg)
    m.content = content
    return m
