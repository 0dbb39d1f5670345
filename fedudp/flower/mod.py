"""The client side of user-level DP inside any Flower app: ``user_level_mod``
(docs/flower-apps.md; the server side is ``fedudp.flower.strategy.UserLevelDP``).

On a training message the mod samples the client's users (Poisson at the rate the server
sends, from public keyed randomness or this process's OS entropy), runs the app's own training
step once per sampled user on that user's data only, and replies with the sum of the users'
clipped model updates and their count (or, for an estimator that needs them, the clipped rows).
The app's data loader selects a user because the mod hands it a context whose ``partition-id``
is the user's global index and whose ``num-partitions`` is the number of users: a Flower app
that loads ``partition_id`` of ``num_partitions`` needs no change. Parameters named by
``personal`` (fnmatch patterns) are joint DP's personal layers: they are never sent. Each
user's update is computed at the broadcast, whose personal layers are the server's untouched
initial (public) values, so that a user's update depends on the broadcast and that user's
records only (fedudp's certified joint DP, docs/algorithms.md#certified-vs-paper-accounting).
The client's own personal layers are trained on all its users' records every round (the app's
training step once per user, in order, each starting from the previous one's personal layers
and the broadcast's shared ones), kept in ``context.state``, and put into every evaluation
message's model before the app evaluates.

The client side never imports the billboard (tests/test_layers.py): what it shares with the
server is ``fedudp.flower.wire``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from logging import WARNING
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from flwr.app import (
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

from fedudp.flower.guard import NO_WRAPPER, foreign_keys, one_line, stacked_mods, user_rows
from fedudp.flower.secure_mod import K_REVEAL_ASK, reveal_reply, secure_round, share_reply
from fedudp.flower.wire import (
    K_CLIENT_PARTITION,
    K_CLIENT_PARTITIONS,
    K_CONTRIB,
    K_COUNTS,
    K_DP,
    K_PERSONAL,
    K_USER_ID,
    K_USERS,
    error_reason,
    flat,
    is_personal,
    to_numpy,
    to_record,
    user_metrics,
    weighted_metrics,
)
from fedudp.protocol.contributions import Constraint
from fedudp.randomness import Purpose, Randomness

if TYPE_CHECKING:
    from fedudp.flower.fast import TorchTraining
    from fedudp.flower.guard import UserRows

__all__ = ["user_level_mod", "client_users", "sampled_users", "CallNext"]

# what a mod calls to run the rest of the ClientApp (Flower's ``ClientAppCallable``)
CallNext = Callable[[Message, Context], Message]


def _fast_configs(msg: Message, context: Context) -> dict[str, Any]:
    """What the fast path reads its keyed settings from: the training message's config records
    and, under ``fedudp.flower.fast_data.RUN_CONFIG``, the client's run config."""
    from fedudp.flower.fast_data import RUN_CONFIG

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
    users' sample; independent draws per user, so still Poisson over all users).

    Parameters
    ----------
    users : Sequence[int]
        The client's users (global indices).
    randomness : Randomness or int
        ``Randomness.seeded``/a seed, or ``Randomness.secure``.
    round_ : int
    rate : float
        q.
    population : int
        N.

    Returns
    -------
    list[int]
    """
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
        (``fedudp.flower.fast.TorchTraining``): the sampled users' updates are then computed
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

    Raises
    ------
    ValueError
        When ``users_per_client`` < 1.
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
        return to_record({k2: keep[k2] if k2 in keep else arrays[k2] for k2 in arrays})

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
        if K_REVEAL_ASK in msg.content:  # distributed DP: the server asks for pair seeds
            return reveal_reply(msg, context)
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
        sec = secure_round(msg, context)  # distributed DP: a masked share replaces the sum
        arrays_key = next(iter(msg.content.array_records.keys()))
        # every user's update at the broadcast: its personal layers are the server's initial,
        # public values (the server never moves them), never this client's own
        base = cast(ArrayRecord, msg.content[arrays_key])
        names = [k2 for k2 in base if not is_personal(k2, patterns)]
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
        # alone (zero, uncounted), never the client's other users (fedudp.flower.guard)
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
        out = self.reply(msg, rnd, got, len(mine), int(G.shape[1]), kept)
        return out if sec is None else share_reply(out, msg, sec, rnd.round, G, sampled, got.kept)

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
        start = flat(base, names)
        if self.fast is not None:  # fedudp.flower.fast: every sampled user's update at once
            at = {k2: to_numpy(base[k2]) for k2 in base}
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
            at = {k2: to_numpy(mixed[k2]) for k2 in mixed}
            own_names = [k2 for k2 in base if is_personal(k2, patterns)]
            cfg = _fast_configs(msg, context)
            own_arrays = self.fast.personal(at, own_names, mine, total, cfg)
            context.state[K_PERSONAL] = to_record(own_arrays)
            return None
        own = self.kept(context)
        for u in mine:
            try:
                reply = self.train_as(
                    msg, arrays_key, self.with_personal(base, own), context, u, total, call_next
                )
                if reply.has_error():
                    raise RuntimeError(error_reason(reply.error.reason))
                got = cast(
                    ArrayRecord, reply.content[next(iter(reply.content.array_records.keys()))]
                )
                mine_own = {k2: got[k2] for k2 in got if is_personal(k2, patterns)}
                if not all(np.isfinite(to_numpy(a)).all() for a in mine_own.values()):
                    raise ValueError("non-finite personal layers")
            except Exception as e:  # noqa: BLE001  (skipped alone: its reason logged here)
                log(WARNING, "user_level_mod: user %s's personal step skipped: %s", u, one_line(e))
                continue
            own = to_record(mine_own)
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
            out["metrics"] = weighted_metrics(metrics)
        if rnd.rows:
            rows_out = c.rows if c.rows is not None else torch.zeros(0, dim)
            out[K_CONTRIB] = to_record({"rows": rows_out.to(torch.float64).numpy()})
        else:
            assert c.total is not None  # not rows: the clipped sum
            out[K_CONTRIB] = to_record({"sum": c.total.to(torch.float64).numpy()})
        return Message(out, reply_to=msg)


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
    evaluation it is the client's own). A ``LookupError`` outside the mod.

    Parameters
    ----------
    context : flwr.app.Context

    Returns
    -------
    tuple[list[int], int]

    Raises
    ------
    LookupError
        No ``user_level_mod`` handled this message.
    """
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
            f"the app replied with error {reply.error.code}: {error_reason(reply.error.reason)}"
        )
    if not reply.content.array_records:
        raise ValueError("the app's training reply has no ArrayRecord")
    got = cast(ArrayRecord, reply.content[next(iter(reply.content.array_records.keys()))])
    missing = [k for k in names if k not in got]
    if missing:
        raise ValueError(f"the app's training reply lacks the arrays {missing[:5]}")
    row = flat(got, names)
    if row.shape != start.shape:
        raise ValueError(
            f"the app's training reply has {row.numel()} shared values, "
            f"the broadcast {start.numel()}"
        )
    return row - start, user_metrics(reply)


def _copy_with(msg: Message, content: RecordDict) -> Message:
    """``msg`` with another content (same metadata), for the app's own training step."""
    m = copy.copy(msg)
    m.content = content
    return m
