"""One owner, or a block of owners, as a Flower ``ClientApp`` (Message API;
docs/architecture.md#engines; blocks: docs/engines.md, "Multi-node").

With ``engine_opts.owners_per_node=1`` the node's partition id is the owner id: the owner
rebuilds, once per worker process, the model, split and federation from the run configuration
the billboard sends (all seeded, so every process gets the same) and takes its own shard. With
blocks, node ``k`` holds the owners its messages name (``fedudp.flower.blocks``) and builds
only their federation (``fedudp.build.federation(cfg, owners=...)``). Personal parameters stay
**only** in ``context.state`` (stacked over the node's owners), and the node runs
``fedudp.owner.owners.Owners`` on its owners, the code the local engine runs for all owners at
once. Under ``engine_opts.device=cuda`` the owners and the node's records live on the actor's
GPU (``fedudp.flower.actor_device``; an actor whose torch sees none fails as an owner): the
broadcast and the stored personal parameters are moved there, the replies, ``context.state``
and the checkpoints' state files get CPU tensors.

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
from fedudp.flower.actor_device import actor_device, cpu_reply, on_cpu, on_device
from fedudp.flower.blocks import block_eval_record, read_block
from fedudp.flower.wire import K_PERSONAL_IN, K_PERSONAL_OUT, K_STATE, K_STATE_RUN
from fedudp.owner.isolate import isolated_reply
from fedudp.owner.owners import Owners, Params
from fedudp.owner.secure_reply import owner_randomness, secure_reply
from fedudp.protocol import checkpoint
from fedudp.protocol.contributions import Reveal
from fedudp.protocol.messages import OwnerFailure
from fedudp.secure.masks import MaskKeys
from fedudp.secure.public import mask_secret

__all__ = [
    "client_app",
    "owner_side",
    "block_side",
    "mask_keys",
    "foreign",
    "query",
    "train",
    "evaluate",
    "NOT_FEDUDP",
]

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
        if key not in _CACHE or _CACHE[key][1] is None:  # None: a block node's owners only
            cfg = config_from_json(cfg_json)
            owners = _build_owners(cfg_json)
            _CACHE.clear()  # one run per process at a time
            _CACHE[key] = (owners, build.federation(cfg).to(owners.dtype, owners.device))
        return _CACHE[key]


_BLOCKS: dict[tuple[str, int, int], Federation] = {}


def block_side(cfg_json: str, block: range) -> tuple[Owners, Federation]:
    """(owners component, the block's federation) of a run: only the block's owners' records
    are read (``fedudp.build.federation(cfg, owners=block)``), once per process and block.

    Parameters
    ----------
    cfg_json : str
        The run's configuration as the billboard sends it.
    block : range
        The node's owners (``fedudp.flower.blocks.owner_blocks``).

    Returns
    -------
    tuple[Owners, Federation]
        The owners component and the block's federation (equal to the whole federation's
        ``block(a, b)``).
    """
    key = _key(cfg_json)
    with _LOCK:
        if not any(k[0] == key for k in _BLOCKS):
            _BLOCKS.clear()  # one run per process at a time
            _CACHE.clear()
        if key not in _CACHE:
            _CACHE[key] = (_build_owners(cfg_json), cast(Federation, None))
        owners = _CACHE[key][0]
        bk = (key, block.start, block.stop)
        if bk not in _BLOCKS:
            cfg = config_from_json(cfg_json)
            fed = build.federation(cfg, owners=block)
            _BLOCKS[bk] = fed.to(owners.dtype, owners.device)
        return owners, _BLOCKS[bk]


def _owners_only(cfg_json: str) -> Owners:
    """The owners component of a run (block mode: no federation built)."""
    key = _key(cfg_json)
    with _LOCK:
        if key not in _CACHE:
            _BLOCKS.clear()
            _CACHE.clear()
            _CACHE[key] = (_build_owners(cfg_json), cast(Federation, None))
        return _CACHE[key][0]


def _build_owners(cfg_json: str) -> Owners:
    """This actor's owners component, on its device (``engine_opts.device``: the actor's GPU
    under ``cuda``; ``OwnerFailure`` where its torch sees none, ``actor_device``)."""
    cfg = config_from_json(cfg_json)
    actor_device(str(cfg.engine_opts.device))  # nothing is cached when it raises: each retries
    return build.owners(cfg, actor=True)


def mask_keys(owners: Owners, fed: Federation | int) -> MaskKeys:
    """The owners' pairwise-mask seeds of a run (every owner's process derives the same ones
    from the run seed: a seeded simulation only, ``fedudp.secure.public.mask_secret``; the
    billboard's code never calls this).

    Parameters
    ----------
    owners : Owners
        The owner side (its randomness).
    fed : Federation or int
        The whole federation, or its number of owners.

    Returns
    -------
    MaskKeys
        The seeds.
    """
    n = fed if isinstance(fed, int) else fed.num_owners
    return MaskKeys(mask_secret(owner_randomness(owners)), n)


def _setup(
    msg: Message, context: Context
) -> tuple[ConfigRecord, Owners, Federation, Params, Params, range, int]:
    """The message's run record, the owners, this node's owners' federation (one owner, or a
    block), the broadcast, their personal parameters (stacked), the node's owners and the
    number of owners."""
    run = cast(ConfigRecord, msg.content[wire.K_RUN])
    cfg_json = str(run["cfg"])
    marked = read_block(run)
    if marked is None:  # one owner per node: its shard of the whole federation (as always)
        owners, fed = owner_side(cfg_json)
        j = int(context.node_config["partition-id"])
        shard, n = fed.owner(j), fed.num_owners
        block = range(int(shard.owner_ids[0]), int(shard.owner_ids[0]) + 1)
    else:
        block, n = marked
        owners, shard = block_side(cfg_json, block)
    dev = owners.device  # the wire, the state and the checkpoints hold CPU arrays
    shared = (
        on_device(wire.record_to_params(cast(ArrayRecord, msg.content[wire.K_SHARED])), dev)
        if wire.K_SHARED in msg.content
        else {}
    )
    key = _key(cfg_json)
    if K_STATE in context.state and context.state[K_STATE_RUN]["run"] == key:
        personal = on_device(wire.record_to_params(cast(ArrayRecord, context.state[K_STATE])), dev)
    elif K_PERSONAL_IN in run and owners.trains_personal:
        personal = on_device(_load_personal(str(run[K_PERSONAL_IN]), block), dev)
    else:
        personal = owners.initial_personal(len(block))
    return run, owners, shard, shared, personal, block, n


def _load_personal(folder: str, block: range) -> Params:
    """The block's personal parameters from the checkpoint's state files (one per owner or
    per block, whichever nodes wrote them), stacked."""
    return checkpoint.load_owners_personal(folder, list(block))


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
    cfg_json = str(run["cfg"])
    j = int(context.node_config["partition-id"])
    marked = read_block(run)
    if "reveal" in run:  # a survivor's pair seeds with the owners that dropped
        if marked is None:
            owners, fed = owner_side(cfg_json)
            block, n_owners = range(j, j + 1), fed.num_owners
        else:
            owners, (block, n_owners) = _owners_only(cfg_json), marked
        keys, round_ = mask_keys(owners, n_owners), int(cast(int, run["round"]))
        gone = [int(d) for d in np.frombuffer(cast(bytes, run["reveal"]), dtype=np.int64)]
        reveals = [Reveal(s, d, keys.pair_seed(s, d, round_)) for s in block for d in gone]
        return Message(wire.reveals_to_records(block.start, reveals), reply_to=msg)
    if config_from_json(cfg_json).engine_opts.owners_per_node > 1:
        # a node of blocks: which block is its partition id; the billboard checks the count
        # (nothing is read here: the block's records are read on its first message)
        return Message(
            RecordDict({wire.K_REPLY: MetricRecord({"owner": j, "pid": os.getpid()})}),
            reply_to=msg,
        )
    try:
        owners, fed = owner_side(cfg_json)
    except OwnerFailure:  # e.g. no CUDA device here: its train/evaluate fail as owner failures
        return Message(
            RecordDict({wire.K_REPLY: MetricRecord({"owner": j, "pid": os.getpid()})}),
            reply_to=msg,
        )
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
    run, owners, shard, shared, personal, block, n_owners = _setup(msg, context)
    round_ = int(cast(int, run["round"]))  # owner_message writes an int
    personal = owners.personal_round(shard, shared, personal, round_)
    j = block.start
    if personal:  # kept and checkpointed as CPU tensors: any engine or device resumes them
        kept = on_cpu(personal)
        context.state[K_STATE] = wire.params_to_record(kept)
        context.state[K_STATE_RUN] = ConfigRecord({"run": _key(str(run["cfg"]))})
        if K_PERSONAL_OUT in run and owners.trains_personal:
            checkpoint.save_owners_personal(str(run[K_PERSONAL_OUT]), block, kept)
    asked = wire.read_units(run)
    if asked is None:  # per_silo: nothing is sent
        return Message(wire.ack_record(j), reply_to=msg)
    units, constraint = asked
    if constraint.secure is not None:  # its masked shares (every owner is in the roster)
        rep, _observed = secure_reply(
            owners,
            shard,
            shared,
            personal,
            units,
            round_,
            constraint,
            keys=mask_keys(owners, n_owners),
            roster=range(n_owners),
            count_wraps=False,
        )
        return Message(
            wire.reply_to_records(cpu_reply(rep), j, time.perf_counter() - t0), reply_to=msg
        )
    # a user whose step raises is dropped alone, as on the local engine (owner.isolate; its
    # count crosses the wire in ``failed``, the reasons are logged here)
    rep = cpu_reply(isolated_reply(owners, shard, shared, personal, units, round_, constraint))
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
    run, owners, shard, shared, personal, block, _n = _setup(msg, context)
    acc, loss = owners.evaluate(shard, shared, personal)
    first, examples = block.start, int(shard.x_test.shape[0])
    if read_block(run) is not None:
        return Message(block_eval_record(first, acc, loss, examples), reply_to=msg)
    return Message(wire.eval_record(first, acc[0], loss[0], examples), reply_to=msg)
