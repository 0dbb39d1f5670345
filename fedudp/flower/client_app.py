"""One owner as a Flower ``ClientApp`` (Message API; docs/architecture.md#engines).

The node's partition id is the owner id. The owner rebuilds, once per worker process, the
model, split and federation from the run configuration the billboard sends (all seeded, so
every process gets the same), takes its own shard, keeps its personal parameters **only** in
``context.state``, and runs ``fedudp.owner.owners.Owners`` on that shard, the code the local
engine runs for all owners at once:

* ``@train``: personal update (no noise), then the reply for its sampled units under the
  aggregator's ``Constraint`` sent with the message (shared parts only);
* ``@evaluate``: accuracy and loss on its test shard with its own personal parameters;
* ``@query``: which owner this node is; under a distributed mechanism, a survivor's pair
  seeds with the owners that dropped (the billboard removes their masks with them).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import cast

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

import fedudp.flower.wire as wire
from fedudp import build
from fedudp.config import config_from_json
from fedudp.data.federation import Federation
from fedudp.flower.wire import K_PERSONAL_IN, K_PERSONAL_OUT, K_STATE, K_STATE_RUN
from fedudp.owner.isolate import isolated_reply
from fedudp.owner.owners import Owners, Params
from fedudp.owner.secure_reply import owner_randomness, secure_reply
from fedudp.protocol import checkpoint
from fedudp.protocol.contributions import Reveal
from fedudp.secure.masks import MaskKeys
from fedudp.secure.public import mask_secret

__all__ = ["client_app", "owner_side", "foreign", "query", "train", "evaluate", "NOT_FEDUDP"]

_CACHE: dict[str, tuple[Owners, Federation]] = {}
_LOCK = threading.Lock()


def _key(cfg_json: str) -> str:
    return hashlib.sha1(cfg_json.encode()).hexdigest()


def owner_side(cfg_json: str) -> tuple[Owners, Federation]:
    """(owners component, whole federation) of a run, built once per process.

    Parameters
    ----------
    cfg_json : str
        The run's configuration as the billboard sends it (``K_RUN``'s ``cfg``).

    Returns
    -------
    tuple[Owners, Federation]
        Built by ``fedudp.build`` from that configuration (seeded: every process the same).
    """
    key = _key(cfg_json)
    with _LOCK:
        if key not in _CACHE:
            cfg = config_from_json(cfg_json)
            owners = build.owners(cfg)
            _CACHE.clear()  # one run per process at a time
            _CACHE[key] = (owners, build.federation(cfg).to(owners.dtype))
        return _CACHE[key]


def mask_keys(owners: Owners, fed: Federation) -> MaskKeys:
    """The owners' pairwise-mask seeds of a run (every owner's process derives the same ones
    from the run seed: a seeded simulation only, ``fedudp.secure.public.mask_secret``; the
    billboard's code never calls this).

    Parameters
    ----------
    owners : Owners
        The owner side (its randomness).
    fed : Federation
        The whole federation (its number of owners).

    Returns
    -------
    MaskKeys
        The seeds.
    """
    return MaskKeys(mask_secret(owner_randomness(owners)), fed.num_owners)


def _setup(
    msg: Message, context: Context
) -> tuple[ConfigRecord, Owners, Federation, Params, Params]:
    run = cast(ConfigRecord, msg.content[wire.K_RUN])
    owners, fed = owner_side(str(run["cfg"]))
    j = int(context.node_config["partition-id"])
    shard = fed.owner(j)
    shared = (
        wire.record_to_params(cast(ArrayRecord, msg.content[wire.K_SHARED]))
        if wire.K_SHARED in msg.content
        else {}
    )
    key = _key(str(run["cfg"]))
    if K_STATE in context.state and context.state[K_STATE_RUN]["run"] == key:
        personal = wire.record_to_params(cast(ArrayRecord, context.state[K_STATE]))
    elif K_PERSONAL_IN in run and owners.trains_personal:
        personal = checkpoint.load_file(checkpoint.owner_file(str(run[K_PERSONAL_IN]), j))[
            "personal"
        ]
    else:
        personal = owners.initial_personal(1)
    return run, owners, shard, shared, personal


client_app = ClientApp()

# the error code of a reply to a message that is not fedudp's (a foreign ServerApp)
NOT_FEDUDP = ErrorCode.CLIENT_APP_RAISED_EXCEPTION


def foreign(msg: Message) -> Message | None:
    """An error reply when ``msg`` was not sent by fedudp's billboard (no run record).

    A foreign ServerApp (e.g. Flower's own FedAvg) records a failure that says what was
    expected, instead of the owner crashing on a missing key.

    Parameters
    ----------
    msg : flwr.app.Message

    Returns
    -------
    flwr.app.Message or None
        The error reply; None for a message of fedudp's billboard.
    """
    if wire.K_RUN in msg.content:
        return None
    got = sorted(msg.content.keys())
    return Message(
        error=Error(
            NOT_FEDUDP,
            (
                f"fedudp's ClientApp answers fedudp's billboard only: the message has no "
                f"'{wire.K_RUN}' record (it has {got}); run it with fedudp's ServerApp "
                "(`flwr run .` in the fedudp project), or add user-level DP to your own app with "
                "fedudp.flower's strategy wrapper and client mod"
            ),
        ),
        reply_to=msg,
    )


@client_app.query()
def query(msg: Message, context: Context) -> Message:
    """Which owner this node is (its partition id) and its process id.

    Parameters
    ----------
    msg : flwr.app.Message
    context : flwr.app.Context

    Returns
    -------
    flwr.app.Message

    Raises
    ------
    ValueError
        The federation's number of owners is not the number of SuperNodes.
    """
    if (err := foreign(msg)) is not None:
        return err
    run = cast(ConfigRecord, msg.content[wire.K_RUN])
    owners, fed = owner_side(str(run["cfg"]))
    j = int(context.node_config["partition-id"])
    if "reveal" in run:  # a survivor's pair seeds with the owners that dropped
        keys, round_ = mask_keys(owners, fed), int(cast(int, run["round"]))
        gone = [int(d) for d in np.frombuffer(cast(bytes, run["reveal"]), dtype=np.int64)]
        reveals = [Reveal(j, d, keys.pair_seed(j, d, round_)) for d in gone]
        return Message(wire.reveals_to_records(j, reveals), reply_to=msg)
    n = int(context.node_config.get("num-partitions", fed.num_owners))
    if n != fed.num_owners or not 0 <= j < n:
        raise ValueError(
            f"node has partition-id {j} of {n}, but partition.num_owners="
            f"{fed.num_owners}: start Flower with num-supernodes equal to it"
        )
    return Message(
        RecordDict({wire.K_REPLY: MetricRecord({"owner": j, "pid": os.getpid()})}),
        reply_to=msg,
    )


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """The owner's round: its personal update (no noise), then its reply for its sampled units
    under the aggregator's constraint (shared parts only).

    Parameters
    ----------
    msg : flwr.app.Message
    context : flwr.app.Context
        Its ``state`` holds the owner's personal parameters (never sent).

    Returns
    -------
    flwr.app.Message
    """
    if (err := foreign(msg)) is not None:
        return err
    t0 = time.perf_counter()
    run, owners, shard, shared, personal = _setup(msg, context)
    round_ = int(cast(int, run["round"]))  # owner_message writes an int
    personal = owners.personal_round(shard, shared, personal, round_)
    j = int(shard.owner_ids[0])
    if personal:
        context.state[K_STATE] = wire.params_to_record(personal)
        context.state[K_STATE_RUN] = ConfigRecord({"run": _key(str(run["cfg"]))})
        if K_PERSONAL_OUT in run and owners.trains_personal:
            checkpoint.atomic_write(
                checkpoint.owner_file(str(run[K_PERSONAL_OUT]), j),
                checkpoint.dump({"personal": personal}),
            )
    asked = wire.read_units(run)
    if asked is None:  # per_silo: nothing is sent
        return Message(wire.ack_record(j), reply_to=msg)
    units, constraint = asked
    if constraint.secure is not None:  # its masked share (every owner is in the roster)
        _, fed = owner_side(str(run["cfg"]))
        rep, _observed = secure_reply(
            owners,
            shard,
            shared,
            personal,
            units,
            round_,
            constraint,
            keys=mask_keys(owners, fed),
            roster=range(fed.num_owners),
            count_wraps=False,
        )
        return Message(wire.reply_to_records(rep, j, time.perf_counter() - t0), reply_to=msg)
    # a user whose step raises is dropped alone, as on the local engine (owner.isolate; its
    # count crosses the wire in ``failed``, the reasons are logged here)
    rep = isolated_reply(owners, shard, shared, personal, units, round_, constraint)
    return Message(wire.reply_to_records(rep, j, time.perf_counter() - t0), reply_to=msg)


@client_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Accuracy and loss on the owner's test shard with its own personal parameters.

    Parameters
    ----------
    msg : flwr.app.Message
    context : flwr.app.Context

    Returns
    -------
    flwr.app.Message
    """
    if (err := foreign(msg)) is not None:
        return err
    _run, owners, shard, shared, personal = _setup(msg, context)
    acc, loss = owners.evaluate(shard, shared, personal)
    return Message(
        wire.eval_record(int(shard.owner_ids[0]), acc[0], loss[0], int(shard.x_test.shape[0])),
        reply_to=msg,
    )
