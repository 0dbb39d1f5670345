"""Batch orders: each unit's records in visiting order per epoch (public randomness).

The order is a pure function of (seed, round, epoch, purpose, owner), or of the unit's own
stable identity for users, so the result does not depend on how units are chunked, on the
engine, or on scheduling order (``fedudp.owner.local_sgd`` trains in these orders).
"""

from __future__ import annotations

import numpy as np

from fedudp.owner.local_sgd import LocalSpec, Units
from fedudp.randomness import Purpose, numpy_rng

__all__ = ["batch_orders", "epoch_keys"]


def epoch_keys(
    seed: int, round_: int, epoch: int, purpose: Purpose, owner: int, n: int
) -> np.ndarray:
    """Sort keys for one owner's ``n`` records in one epoch (public randomness).

    Parameters
    ----------
    seed, round_, epoch, purpose, owner, n : int, int, int, Purpose, int, int
        The stream's keys (``owner``: the owner's global id) and the owner's record count.

    Returns
    -------
    np.ndarray
        [n] uniform keys.
    """
    return numpy_rng(seed, purpose, round_, epoch, owner).random(n)


def batch_orders(
    units: Units,
    spec: LocalSpec,
    round_: int,
    purpose: Purpose,
    unit_keys: np.ndarray | None = None,
) -> np.ndarray:
    """Per unit and epoch, its records in visiting order.

    Keys are drawn per owner (an owner's records, by position in the owner: owner-level
    training), or, with ``unit_keys``, per unit from that unit's own stable identity (users:
    a user's order must not move when another user of its owner is added or removed,
    docs/algorithms.md#certified-vs-paper-accounting).

    Parameters
    ----------
    units, spec, round_, purpose : Units, LocalSpec, int, Purpose
        The units, their local training (seed, epochs), the round and the order's stream.
    unit_keys : np.ndarray or None
        Each unit's stable id (users), or None for keys per owner.

    Returns
    -------
    np.ndarray
        [U, E, L] record indices, padded with -1.
    """
    L = int(units.sizes.max()) if len(units) else 0
    U = len(units)
    out = np.full((U, spec.epochs, L), -1, dtype=np.int64)
    if U == 0 or L == 0:
        return out
    col = np.arange(L)[None, :]
    valid = col < units.sizes[:, None]
    idx = units.starts[:, None] + np.minimum(col, units.sizes[:, None] - 1)  # absolute
    rel = idx - units.owner_starts[:, None]  # within owner
    owners = np.unique(units.owners)
    for e in range(spec.epochs):
        keys = np.full((U, L), np.inf)
        if unit_keys is not None:
            for i in np.flatnonzero(units.sizes > 1):  # one record: nothing to order
                size = int(units.sizes[i])
                keys[i, :size] = numpy_rng(spec.seed, purpose, round_, e, int(unit_keys[i])).random(
                    size
                )
            keys[units.sizes == 1, 0] = 0.0
        for o in owners if unit_keys is None else ():
            rows = np.flatnonzero(units.owners == o)
            if not valid[rows].any():  # an owner without records: nothing to order
                continue
            k = epoch_keys(spec.seed, round_, e, purpose, int(o), int(units.owner_sizes[rows[0]]))
            keys[rows] = np.where(valid[rows], k[rel[rows]], np.inf)
        order = np.argsort(keys, axis=1, kind="stable")
        out[:, e] = np.where(
            np.take_along_axis(valid, order, 1), np.take_along_axis(idx, order, 1), -1
        )
    return out
