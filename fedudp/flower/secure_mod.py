"""The client side of distributed DP inside a Flower app: what ``user_level_mod`` sends when
``UserLevelDP`` wraps a distributed estimator (``ddgauss``/``skellam``;
docs/flower-apps.md#distributed-dp-and-flowers-secagg; the server side is
``fedudp.flower.distributed``).

The round's ``fedudp.dp`` record then carries the public encoding (``secure``: the
``SecureEncoding`` as JSON, as engine=flower's wire sends it) and the round's roster (the node
ids asked, sorted; a client's position in it is its owner id). The client encodes its sampled
users' updates into one masked share with ``fedudp.secure.share.owner_share``, the rule
fedudp's own engines use (each user rounded on the stream of (round, its global index), the
client's noise share on that of (round, its position)), and replies with that uint64 vector and
its counts: no float vector of its users leaves it. Asked by the server for its pair seeds with
the clients that dropped (a ``train`` message carrying only ``K_REVEAL_ASK``), it answers with
``fedudp.flower.wire.reveals_to_records``.

Simulation only: the pairwise masks come from one secret derived from the run seed
(``fedudp.secure.public.mask_secret``), which every client receives; a deployment needs SecAgg's
key agreement between the clients (Diffie-Hellman pair keys, Shamir shares of them for the
unmasking) instead.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

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
from flwr.common.constant import ErrorCode

from fedudp.flower.wire import K_CONTRIB, K_COUNTS, K_DP, K_SECURE, reveals_to_records
from fedudp.protocol.contributions import Reveal
from fedudp.randomness import Randomness
from fedudp.secure.encoding import SecureEncoding
from fedudp.secure.masks import MaskKeys
from fedudp.secure.public import mask_secret, round_signs
from fedudp.secure.share import owner_share

__all__ = [
    "K_REVEAL_ASK",
    "SEEDED_ONLY",
    "SecureRound",
    "encoding_from_text",
    "encoding_to_text",
    "mask_keys",
    "reveal_reply",
    "roster_bytes",
    "roster_of",
    "secure_round",
    "share_reply",
]

#: a ConfigRecord in a message from the server: reveal your pair seeds with these positions
K_REVEAL_ASK = "fedudp.dp.reveal"

SEEDED_ONLY = (
    "a distributed estimator (ddgauss/skellam) in a Flower app runs only as a seeded simulation "
    "(randomness='seeded', run config fedudp.privacy.randomness = \"seeded\"): its pairwise "
    "masks are derived from the run seed; a deployment needs SecAgg's key agreement instead "
    "(docs/flower-apps.md#distributed-dp-and-flowers-secagg)"
)


def encoding_to_text(enc: SecureEncoding) -> str:
    """The encoding as engine=flower's wire sends it (``wire.run_record``: its fields as JSON).

    Parameters
    ----------
    enc : SecureEncoding

    Returns
    -------
    str
    """
    return json.dumps(asdict(enc))


def encoding_from_text(text: str) -> SecureEncoding:
    """``encoding_to_text`` read back (``SecureEncoding`` checks every field).

    Parameters
    ----------
    text : str

    Returns
    -------
    SecureEncoding
    """
    return SecureEncoding(**json.loads(text))


def roster_bytes(nodes: Sequence[int]) -> bytes:
    """The round's roster (node ids, uint64) as bytes.

    Parameters
    ----------
    nodes : sequence of int

    Returns
    -------
    bytes
    """
    return np.asarray([int(n) for n in nodes], dtype=np.uint64).tobytes()


def roster_of(data: bytes) -> tuple[int, ...]:
    """``roster_bytes`` read back.

    Parameters
    ----------
    data : bytes

    Returns
    -------
    tuple of int
    """
    return tuple(int(n) for n in np.frombuffer(bytes(data), dtype=np.uint64))


def mask_keys(seed: int, owners: int) -> MaskKeys:
    """The round's pairwise-mask seeds of a seeded simulation (``mask_secret`` of the run seed).

    Parameters
    ----------
    seed : int
        The run seed.
    owners : int
        The roster's size.

    Returns
    -------
    MaskKeys
    """
    return MaskKeys(mask_secret(Randomness.seeded(int(seed))), int(owners))


@dataclass(frozen=True)
class SecureRound:
    """A distributed round as the client reads it from the ``fedudp.dp`` record.

    Parameters
    ----------
    encoding : SecureEncoding
        The public encoding.
    roster : tuple of int
        The node ids asked this round, sorted.
    owner : int
        This client's position in the roster.
    seed : int
        The run seed (rotation, rounding, noise shares and masks: a seeded simulation).
    """

    encoding: SecureEncoding
    roster: tuple[int, ...]
    owner: int
    seed: int


def secure_round(msg: Message, context: Context) -> SecureRound | None:
    """The round's distributed settings (None: not a distributed round).

    Parameters
    ----------
    msg : flwr.app.Message
        A training message with the server's ``fedudp.dp`` record.
    context : flwr.app.Context
        This client's (its ``node_id`` locates it in the roster).

    Returns
    -------
    SecureRound or None

    Raises
    ------
    ValueError
        Not a seeded simulation, or this node is not in the round's roster.
    """
    r: Any = msg.content[K_DP]  # the server's own record (UserLevelDP.configure_train)
    if "secure" not in r:
        return None
    if str(r.get("randomness", "")) != Randomness.SEEDED or "seed" not in r:
        raise ValueError(f"user_level_mod: {SEEDED_ONLY}")
    roster = roster_of(r["roster"])
    node = int(context.node_id)
    if node not in roster:
        raise ValueError(f"user_level_mod: node {node} is not in the round's roster")
    return SecureRound(
        encoding_from_text(str(r["secure"])), roster, roster.index(node), int(r["seed"])
    )


def share_reply(
    plain: Message,
    msg: Message,
    sec: SecureRound,
    round_: int,
    updates: torch.Tensor,
    sampled: Sequence[int],
    kept: Sequence[int],
) -> Message:
    """The client's masked share in place of its clipped sum: one uint64 vector and its declared
    capacity; no count of its users and none of the app's metrics (data, under an untrusted
    server: they are logged on the client only).

    Parameters
    ----------
    plain : flwr.app.Message
        The mod's plain reply (its float contribution is dropped here, never sent).
    msg : flwr.app.Message
        The training message.
    sec : SecureRound
        The round's distributed settings.
    round_ : int
        The round.
    updates : torch.Tensor
        The sampled users' updates ``[users, d]``.
    sampled : sequence of int
        The sampled users' global indices (the rows' order).
    kept : sequence of int
        The rows kept (finite, the step did not raise).

    Returns
    -------
    flwr.app.Message
    """
    enc = sec.encoding
    idx = [int(i) for i in kept]
    rows = updates[idx].detach().to("cpu", torch.float64).numpy() if idx else np.zeros((0, enc.dim))
    masked, _ = owner_share(
        rows,
        [int(sampled[i]) for i in idx],
        sec.owner,
        enc,
        Randomness.seeded(sec.seed),
        round_,
        round_signs(sec.seed, round_, enc.padded),
        mask_keys(sec.seed, len(sec.roster)),
        range(len(sec.roster)),
    )
    # under an untrusted server no count of users and no metric of theirs leaves the client:
    # only its declared capacity (public), which the fail-closed rule reads
    declared: Any = plain.content[K_COUNTS]
    out = RecordDict(
        {
            K_COUNTS: MetricRecord(
                {
                    "count": 0,
                    "clipped": 0,
                    "users": int(declared["users"]),
                    "failed": 0,
                    "raised": 0,
                }
            )
        }
    )
    out[K_CONTRIB] = ArrayRecord({"share": Array(np.ascontiguousarray(masked))})
    out[K_SECURE] = ConfigRecord({"owner": int(sec.owner), "round": int(round_)})
    return Message(out, reply_to=msg)


def reveal_reply(msg: Message, context: Context) -> Message:
    """A survivor's pair seeds with the positions the server names as dropped (an error reply,
    ``MOD_FAILED_PRECONDITION`` with the reason, for a request it cannot answer).

    Parameters
    ----------
    msg : flwr.app.Message
        The server's message with ``K_REVEAL_ASK`` (round, roster, dropped, seed).
    context : flwr.app.Context

    Returns
    -------
    flwr.app.Message
        ``fedudp.flower.wire.reveals_to_records``; an error reply when this node is not in the
        roster, a dropped position is itself or outside it, or the request is malformed.
    """
    try:
        return Message(_reveals(msg.content[K_REVEAL_ASK], int(context.node_id)), reply_to=msg)
    except (KeyError, TypeError, ValueError) as e:
        return Message(error=Error(ErrorCode.MOD_FAILED_PRECONDITION, str(e)), reply_to=msg)


def _reveals(r: Any, node: int) -> RecordDict:
    """The seeds a reveal request ``r`` asks node ``node`` for."""
    roster = roster_of(r["roster"])
    if node not in roster:
        raise ValueError(f"user_level_mod: node {node} is not in the round's roster")
    j, round_ = roster.index(node), int(r["round"])
    gone = [int(d) for d in np.frombuffer(bytes(r["dropped"]), dtype=np.int64)]
    if any(d == j or not 0 <= d < len(roster) for d in gone):
        raise ValueError(f"user_level_mod: a reveal asked for positions {gone} (own: {j})")
    keys = mask_keys(int(r["seed"]), len(roster))
    return reveals_to_records(j, [Reveal(j, d, keys.pair_seed(j, d, round_)) for d in gone])
