"""A federation from records with natural users: ``Records`` -> ``Federation``
(docs/your-data.md).

``layout(train, test, ...)`` lays grouped records out the way the rounds need them: owner by
owner, and within an owner user by user, each user one contiguous slice. Owners are numbered
0..n-1 in the sorted order of their ids; users within an owner in the order of their stable
keys. Every user keeps a stable key (``user_keys``): the user's integer id where it fits in
[0, 2³²), else a 32-bit BLAKE2b hash of its id. The key seeds the user's own randomness (its
batch order), so it does not move when another user is added or removed.

Test records: a test record belongs to the owner of its user where the user has training
records; otherwise to the owner its own ``owner`` column gives (``deal`` fills that column for
test sets without natural users, such as CIFAR's test batch). Without a test split,
``holdout`` keeps a fraction of every user's records for evaluation.
"""

from __future__ import annotations

import numpy as np
import torch

from fedudp.data.federation import Federation
from fedudp.data.owner_rules import keyed_u64, user_keys
from fedudp.data.records import Records
from fedudp.errors import DataError

__all__ = ["user_keys", "holdout", "deal", "deal_test_users", "layout", "owner_of_users"]


def holdout(records: Records, fraction: float, seed: int) -> tuple[Records, Records]:
    """(train, test): ``fraction`` of each user's records (rounded down; a user with one record
    keeps it for training) held out for evaluation.

    Which of a user's records are held out is a function of its key (``user_keys``), the
    records' positions among its own records and the seed only (the smallest keyed priorities,
    ``owner_rules.keyed_u64``), so removing or adding another user changes no user's split.

    Parameters
    ----------
    records : Records
        The records, each with its user (private data).
    fraction : float
        The share of each user's records held out, in [0, 1).
    seed : int
        The run's seed (public).

    Returns
    -------
    tuple of Records
        (train, test).

    Raises
    ------
    ValueError
        ``fraction`` is not in [0, 1).
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    users, inv = np.unique(records.user, return_inverse=True)
    counts = np.bincount(inv, minlength=len(users))
    by_user = np.argsort(inv, kind="stable")
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    rank = np.empty(len(records), dtype=np.uint64)  # a record's position among its user's
    rank[by_user] = (np.arange(len(records)) - np.repeat(starts, counts)).astype(np.uint64)
    base = keyed_u64(user_keys(users, records.source or "records"), seed, b"holdout")
    prio = _mix64(base[inv] + rank * np.uint64(0x9E3779B97F4A7C15))
    order = np.lexsort((prio, inv))  # user by user, each by its records' priorities
    take = np.where(counts > 1, np.minimum(np.floor(fraction * counts), counts - 1), 0)
    pos = np.arange(len(records)) - np.repeat(starts, counts)  # rank in ``order``'s user block
    is_test = np.zeros(len(records), dtype=bool)
    is_test[order] = pos < np.repeat(take, counts)
    return _subset(records, ~is_test), _subset(records, is_test)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (wrapping arithmetic)."""
    z = np.asarray(z, dtype=np.uint64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _subset(r: Records, keep: np.ndarray) -> Records:
    from dataclasses import replace

    return replace(
        r,
        x=r.x[keep],
        y=r.y[keep],
        user=r.user[keep],
        owner=None if r.owner is None else r.owner[keep],
        meta={k: v[keep] for k, v in r.meta.items()},
    )


def deal(records: Records, owners: np.ndarray, seed: int) -> Records:
    """Records without natural users (each its own) dealt to ``owners`` evenly at random
    (``default_rng(seed)``), as the owners' test shards. ``owners`` is the public owner list
    where the rule has one (``0..num_owners-1`` for ``random`` and ``dirichlet``), so the deal
    depends on the test set (not a neighbour's data) and public numbers only.

    Parameters
    ----------
    records : Records
        Test records without natural users.
    owners : numpy.ndarray
        The public owner ids to deal to.
    seed : int
        The run's seed (public).

    Returns
    -------
    Records
        ``records`` with an owner per record.
    """
    owners = np.asarray(owners)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(records))
    owner = np.empty(len(records), dtype=owners.dtype)
    owner[perm] = owners[np.arange(len(records)) % len(owners)]
    return records.with_owner(owner)


def deal_test_users(test: Records, train: Records, owners: np.ndarray, seed: int) -> Records:
    """``test`` with an owner per record: a user's training owner where it has training records,
    else ``owners[keyed hash of its key mod len(owners)]`` (``owner_rules.keyed_u64``): a
    test-only user's owner depends on its own key, the seed and ``owners`` only.

    Parameters
    ----------
    test, train : Records
        The test records and the grouped training records.
    owners : numpy.ndarray
        The public owner ids a test-only user may get.
    seed : int
        The run's seed (public).

    Returns
    -------
    Records
        ``test`` with an owner per record.
    """
    owners = np.asarray(owners)
    known = owner_of_users(train)
    users = np.unique(test.user)
    unseen = np.array([u not in known for u in users.tolist()], dtype=bool)
    if unseen.any():
        keys = user_keys(users[unseen], test.source or "test records")
        pick = keyed_u64(keys, seed, b"test-owner") % np.uint64(len(owners))
        known.update(zip(users[unseen].tolist(), owners[pick.astype(np.int64)].tolist()))
    own = np.array([known[u] for u in test.user.tolist()])
    return test.with_owner(own.astype(owners.dtype))


def owner_of_users(records: Records) -> dict:
    """user id -> owner id of grouped records.

    Parameters
    ----------
    records : Records
        Grouped records (an owner per record).

    Returns
    -------
    dict
        Each user's owner.
    """
    assert records.owner is not None, "grouped records"
    users, first = np.unique(records.user, return_index=True)
    return dict(zip(users.tolist(), records.owner[first].tolist()))


def layout(
    train: Records,
    test: Records | None,
    num_owners: int | None = None,
    owner_ids: np.ndarray | None = None,
) -> Federation:
    """The federation of grouped ``train`` records (every record has an owner) and their
    ``test`` records (see the module doc), in the rounds' layout.

    ``owner_ids``: every owner's id in order (sorted; the data's owners must be among them), an
    id the data lacks an owner without users; default the data's own. ``num_owners``: the
    declared owner count (an upper bound): owners without users are appended after the data's
    until there are that many. Both keep the federation's owner count public when an owner's
    last user leaves.

    Parameters
    ----------
    train, test, num_owners, owner_ids : Records, Records or None, int or None, array or None
        Grouped training records, their test records; the other two as above (default None).

    Returns
    -------
    Federation
        The records in the rounds' layout.

    Raises
    ------
    ValueError
        ``train`` has no owners, owners outside ``owner_ids``, or more owners than ``num_owners``.
    """
    if train.owner is None:
        raise ValueError("layout needs grouped records (an owner per record): use group_users")
    data_owners = np.unique(train.owner)
    if owner_ids is None:
        owner_ids = data_owners
    else:
        owner_ids = np.asarray(owner_ids)
        pos = np.searchsorted(owner_ids, data_owners)
        if (
            len(data_owners)
            and (
                (pos >= len(owner_ids))
                | (owner_ids[np.minimum(pos, len(owner_ids) - 1)] != data_owners)
            ).any()
        ):
            raise ValueError("layout: the data has owners outside owner_ids")
    total = len(owner_ids) if num_owners is None else int(num_owners)
    if total < len(owner_ids):
        raise ValueError(f"layout: {len(owner_ids)} owners, more than num_owners={total}")
    oidx = np.searchsorted(owner_ids, train.owner)
    users, uinv = np.unique(train.user, return_inverse=True)
    keys = user_keys(users, train.source or "records")
    order = np.lexsort((np.arange(len(train)), keys[uinv], oidx))
    uo = uinv[order]
    starts = np.flatnonzero(np.r_[True, uo[1:] != uo[:-1]])
    user_of_slot = uo[starts]
    user_offsets = np.r_[starts, len(order)].astype(np.int64)
    user_owner = oidx[order][starts].astype(np.int64)
    owner_user_offsets = np.searchsorted(user_owner, np.arange(total + 1)).astype(np.int64)
    tx, ty, toff = _test_layout(
        test,
        owner_ids,
        dict(zip(users.tolist(), user_owner[np.argsort(user_of_slot)].tolist())),
        train,
        total,
    )
    return Federation(
        x=torch.from_numpy(np.ascontiguousarray(train.x[order])),
        y=torch.from_numpy(train.y[order].astype(np.int64)),
        user_offsets=user_offsets,
        user_owner=user_owner,
        owner_user_offsets=owner_user_offsets,
        x_test=torch.from_numpy(np.ascontiguousarray(tx)),
        y_test=torch.from_numpy(ty),
        test_offsets=toff,
        num_classes=int(train.classes),
        owner_classes=None,
        user_ids=keys[user_of_slot],
    )


def _test_layout(
    test: Records | None,
    owner_ids: np.ndarray,
    owner_index_of_user: dict,
    train: Records,
    total: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(owner_ids)
    if test is None or len(test) == 0:
        return (
            np.zeros((0, *train.x.shape[1:]), dtype=train.x.dtype),
            np.zeros(0, np.int64),
            np.zeros(total + 1, np.int64),
        )
    idx = np.full(len(test), -1, dtype=np.int64)
    known = np.array([u in owner_index_of_user for u in test.user.tolist()], dtype=bool)
    if known.any():
        idx[known] = [owner_index_of_user[u] for u in test.user[known].tolist()]
    if (~known).any():
        if test.owner is None:
            u = test.user[~known][0]
            raise DataError(
                f"{test.source or 'test records'}: user {u!r} has test records but "
                "no training records and no owner; give the test set an owner column"
            )
        own = test.owner[~known]
        pos = np.searchsorted(owner_ids, own)
        bad = (pos >= n) | (owner_ids[np.minimum(pos, n - 1)] != own)
        if bad.any():
            raise DataError(
                f"{test.source or 'test records'}: owner {own[bad][0]!r} of a test "
                "record has no training users"
            )
        idx[~known] = pos
    order = np.argsort(idx, kind="stable")
    counts = np.bincount(idx, minlength=total)
    return (
        test.x[order],
        test.y[order].astype(np.int64),
        np.r_[0, np.cumsum(counts)].astype(np.int64),
    )
