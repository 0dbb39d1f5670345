"""Owners in blocks per Flower SuperNode (``engine_opts.owners_per_node``; docs/engines.md).

The plan is public: it depends on the number of owners and the declared block size only.
Node ``k`` holds owners ``[k·b, min((k+1)·b, n))``; with ``b = 1`` node ``k`` is owner ``k``,
as the Flower engine always had it. A node computes its whole block with the owners' vectorized
path (``fedudp.owner.isolate.isolated_reply`` or ``fedudp.owner.secure_reply.secure_reply``
over the block's federation, as ``engine=local`` does over all owners).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sized
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from fedudp.flower.wire import K_EVAL
from fedudp.protocol.messages import Failure

__all__ = [
    "owner_blocks",
    "block_units",
    "block_of_owner",
    "mark_block",
    "read_block",
    "block_eval_record",
    "block_failures",
]


def owner_blocks(num_owners: int, per_node: int) -> list[range]:
    """The owners of each SuperNode, in contiguous blocks.

    Parameters
    ----------
    num_owners : int
        The federation's owners (n).
    per_node : int
        ``engine_opts.owners_per_node`` (b >= 1).

    Returns
    -------
    list of range
        Block ``k`` is ``range(k·b, min((k+1)·b, n))``; ``ceil(n / b)`` blocks.

    Raises
    ------
    ValueError
        ``per_node`` below 1.
    """
    if int(per_node) < 1:
        raise ValueError(f"engine_opts.owners_per_node: must be >= 1, got {per_node}")
    b = int(per_node)
    return [range(a, min(a + b, num_owners)) for a in range(0, num_owners, b)]


def block_of_owner(blocks: list[range]) -> np.ndarray:
    """Each owner's block index.

    Parameters
    ----------
    blocks : list of range
        ``owner_blocks``' plan.

    Returns
    -------
    numpy.ndarray
        ``[n]`` int64: the block of owner ``j``.
    """
    out = np.zeros(sum(len(r) for r in blocks), dtype=np.int64)
    for k, r in enumerate(blocks):
        out[r.start : r.stop] = k
    return out


def block_units(
    units: Mapping[int, np.ndarray],
    block: range,
    owner_user_offsets: np.ndarray,
    cohort_is_owners: bool,
) -> np.ndarray:
    """A block's sampled units, indexed within the block's federation.

    Parameters
    ----------
    units : mapping of int to numpy.ndarray
        Each sampled owner's units: its users' local ids, or ``[0]`` for the owner itself
        (owner-level units).
    block : range
        The block's owners.
    owner_user_offsets : numpy.ndarray
        The whole federation's ``owner_user_offsets``.
    cohort_is_owners : bool
        Units are owners (the block's sampled owners, ``j - block.start``), not users.

    Returns
    -------
    numpy.ndarray
        int64, owner by owner in block order (users: their index among the block's users).
    """
    if cohort_is_owners:
        return np.array([j - block.start for j in block if j in units], dtype=np.int64)
    base = int(owner_user_offsets[block.start])
    parts = [
        np.asarray(units[j], dtype=np.int64) + int(owner_user_offsets[j]) - base
        for j in block
        if j in units
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


# -- the block's fields in engine=flower's records ---------------------------------------------
_K_BLOCK_START, _K_BLOCK_STOP, _K_NUM_OWNERS = "block_start", "block_stop", "num_owners"


def mark_block(rec: ConfigRecord, block: range, num_owners: int) -> ConfigRecord:
    """``rec`` (a ``K_RUN`` record) told which block of owners it is for.

    Parameters
    ----------
    rec : flwr.app.ConfigRecord
        The run record (changed in place).
    block : range
        The node's owners.
    num_owners : int
        The federation's owners (the masks' peers under a distributed mechanism).

    Returns
    -------
    flwr.app.ConfigRecord
        ``rec``.
    """
    rec[_K_BLOCK_START], rec[_K_BLOCK_STOP] = int(block.start), int(block.stop)
    rec[_K_NUM_OWNERS] = int(num_owners)
    return rec


def read_block(rec: ConfigRecord) -> tuple[range, int] | None:
    """``mark_block``'s block and number of owners; None for a one-owner node's record.

    Parameters
    ----------
    rec : flwr.app.ConfigRecord
        A ``K_RUN`` record.

    Returns
    -------
    tuple of (range, int) or None
    """
    if _K_BLOCK_STOP not in rec:
        return None
    r: Any = rec
    return range(int(r[_K_BLOCK_START]), int(r[_K_BLOCK_STOP])), int(r[_K_NUM_OWNERS])


def block_eval_record(
    first: int, accuracy: Iterable[float], loss: Iterable[float], examples: int
) -> RecordDict:
    """A block of owners' evaluation (``K_EVAL``): one accuracy and loss per owner.

    Parameters
    ----------
    first : int
        The block's first owner.
    accuracy, loss : iterable of float
        Each owner's, on its test shard with its own personal parameters, in block order.
    examples : int
        The block's test records.

    Returns
    -------
    flwr.app.RecordDict
    """
    return RecordDict(
        {
            K_EVAL: MetricRecord(
                {
                    "owner": int(first),
                    "accuracies": [float(a) for a in accuracy],
                    "losses": [float(v) for v in loss],
                    "num-examples": int(examples),
                }
            )
        }
    )


def block_failures(
    failed: Mapping[int, str], blocks: list[range], units: Mapping[int, Sized]
) -> list[Failure]:
    """The owners' failures of failed nodes: every owner of a failed node's block fails, each
    with its own sampled units (what ``Billboard.withhold`` and the round line count).

    Parameters
    ----------
    failed : mapping of int to str
        The failed nodes (block index) and why.
    blocks : list of range
        ``owner_blocks``' plan.
    units : mapping of int to sized
        Each sampled owner's units (an owner absent: none).

    Returns
    -------
    list of Failure
        By node, then owner.
    """
    return [
        Failure(j, len(units.get(j, ())), reason)
        for k, reason in sorted(failed.items())
        for j in blocks[k]
    ]
