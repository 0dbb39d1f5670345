"""Owners -> users -> records (docs/algorithms.md#data-partition, Huang et al. §4).

* ``owner_sizes``: N records split evenly, sizes floor(N/n) or ceil(N/n).
* ``paper_classes``: each owner draws ``k`` (paper: 8) of the classes uniformly and fills its
  quota from them, disjointly and as class-balanced as availability allows (round robin over
  its classes, from a shuffled pool). The N-record training subset is the union of quotas.
  The test pool is split with the *same* per-owner class sets.
* ``iid``: a uniformly random N-subset split evenly. ``dirichlet``: class proportions
  p_j ~ Dir(alpha) per owner, the same proportions used for its test shard.
* ``assign_users``: an owner's records, shuffled, cut into users of ``records_per_user``.
All functions are pure given a ``numpy.random.Generator``.

Neighbours: a planned federation is drawn from public numbers (N, owners, records per user, the
scheme) and the seed before any neighbour exists; its user-level neighbour is the plan with one
user removed in place (``Federation.without_user``), so nothing here is dealt again and every
other user keeps its owner. Natural users are grouped by ``fedudp.data.owner_rules`` instead.
"""

from __future__ import annotations

from collections import deque

import numpy as np

__all__ = [
    "owner_sizes",
    "paper_classes",
    "iid",
    "dirichlet",
    "assign_users",
]


def owner_sizes(total: int, owners: int) -> np.ndarray:
    """Split ``total`` records over ``owners`` as evenly as possible (the first ones one more).

    Parameters
    ----------
    total, owners : int
        The record and owner counts.

    Returns
    -------
    numpy.ndarray
        int64 ``[owners]`` sizes summing to ``total``.

    Raises
    ------
    ValueError
        ``owners`` is below 1 or above ``total``.
    """
    if owners < 1 or owners > total:
        raise ValueError(f"cannot split {total} records over {owners} owners")
    base, extra = divmod(total, owners)
    return np.array([base + 1] * extra + [base] * (owners - extra), dtype=np.int64)


def _class_pools(labels: np.ndarray, classes: int, rng: np.random.Generator) -> list[deque]:
    return [deque(rng.permutation(np.flatnonzero(labels == c)).tolist()) for c in range(classes)]


def _round_robin_fill(
    pools: list[deque], owner_classes: list[np.ndarray], quotas: np.ndarray, strict: bool
) -> list[np.ndarray]:
    """Owners take one record per turn, cycling over their own classes, until quotas are met.

    Interleaving owners keeps the split fair when a class runs short. With ``strict`` an
    owner that cannot fill its quota from its classes is an error; otherwise it keeps fewer.
    """
    taken: list[list[int]] = [[] for _ in quotas]
    cursor = [0] * len(quotas)
    active = [j for j in range(len(quotas)) if quotas[j] > 0]
    while active:
        still = []
        for j in active:
            cls = owner_classes[j]
            for _ in range(len(cls)):
                c = cls[cursor[j] % len(cls)]
                cursor[j] += 1
                if pools[c]:
                    taken[j].append(pools[c].popleft())
                    break
            else:
                if strict:
                    raise ValueError(
                        f"owner {j}: its classes {list(cls)} ran out of records "
                        f"({len(taken[j])} of {quotas[j]} filled)"
                    )
                continue
            if len(taken[j]) < quotas[j]:
                still.append(j)
        active = still
    return [np.array(t, dtype=np.int64) for t in taken]


def paper_classes(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    total: int,
    owners: int,
    classes_per_owner: int,
    classes: int,
    test_per_owner: int,
    rng: np.random.Generator,
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Each owner draws ``classes_per_owner`` classes and fills its quota from them, round robin.

    Parameters
    ----------
    train_labels, test_labels : numpy.ndarray
        The pool's int labels.
    total, owners : int
        The training records to deal and the owner count.
    classes_per_owner, classes : int
        Classes per owner and in all.
    test_per_owner : int
        Test records per owner (fewer where its classes run short).
    rng : numpy.random.Generator
        The draws' generator.

    Returns
    -------
    tuple of list of numpy.ndarray
        (train indices, test indices, classes) per owner.

    Raises
    ------
    ValueError
        ``classes_per_owner > classes``, or an owner's classes run out of training records.
    """
    if classes_per_owner > classes:
        raise ValueError(f"partition.classes_per_owner={classes_per_owner} > {classes} classes")
    owner_classes = [
        np.sort(rng.choice(classes, classes_per_owner, replace=False)) for _ in range(owners)
    ]
    train = _round_robin_fill(
        _class_pools(train_labels, classes, rng),
        owner_classes,
        owner_sizes(total, owners),
        strict=True,
    )
    test = _round_robin_fill(
        _class_pools(test_labels, classes, rng),
        owner_classes,
        np.full(owners, test_per_owner),
        strict=False,
    )
    return train, test, owner_classes


def iid(
    n_train: int,
    n_test: int,
    total: int,
    owners: int,
    test_per_owner: int,
    rng: np.random.Generator,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Uniformly random owner shards of ``total`` training and ``test_per_owner`` test records.

    Parameters
    ----------
    n_train, n_test : int
        The pool's training and test sizes.
    total, owners : int
        The training records to deal and the owner count.
    test_per_owner : int
        Test records per owner.
    rng : numpy.random.Generator
        The draws' generator.

    Returns
    -------
    tuple of list of numpy.ndarray
        (train indices, test indices) per owner.

    Raises
    ------
    ValueError
        ``owners`` is below 1 or above ``total`` (``owner_sizes``).
    """
    sizes = owner_sizes(total, owners)
    sub = rng.permutation(n_train)[:total]
    train = np.split(sub, np.cumsum(sizes)[:-1])
    tsub = rng.permutation(n_test)[: test_per_owner * owners]
    test = np.split(tsub, owners)
    return train, test


def dirichlet(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    total: int,
    owners: int,
    alpha: float,
    classes: int,
    test_per_owner: int,
    rng: np.random.Generator,
) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Label-skewed shards: each owner's class mix drawn from ``Dirichlet(alpha)``.

    Parameters
    ----------
    train_labels, test_labels : numpy.ndarray
        The pool's int labels.
    total, owners : int
        The training records to deal and the owner count.
    alpha : float
        The Dirichlet concentration.
    classes, test_per_owner : int
        The class count and test records per owner.
    rng : numpy.random.Generator
        The draws' generator.

    Returns
    -------
    tuple
        (train indices, test indices) per owner and the ``[owners, classes]`` mixes.

    Raises
    ------
    ValueError
        The training records run out before every owner's quota is met.
    """
    props = rng.dirichlet(np.full(classes, alpha), size=owners)

    def fill(labels: np.ndarray, quotas: np.ndarray) -> list[np.ndarray]:
        pools = _class_pools(labels, classes, rng)
        out = []
        for j, q in enumerate(quotas):
            p = props[j].copy()
            got: list[int] = []
            while len(got) < q:
                avail = np.array([len(pl) > 0 for pl in pools])
                if not avail.any():
                    break
                w = p * avail
                w = w / w.sum() if w.sum() > 0 else avail / avail.sum()
                counts = rng.multinomial(q - len(got), w)
                for c in np.flatnonzero(counts):
                    k = min(counts[c], len(pools[c]))
                    got += [pools[c].popleft() for _ in range(k)]
            out.append(np.array(got, dtype=np.int64))
        return out

    train = fill(train_labels, owner_sizes(total, owners))
    if any(len(t) < q for t, q in zip(train, owner_sizes(total, owners))):
        raise ValueError("dirichlet partition ran out of training records")
    test = fill(test_labels, np.full(owners, test_per_owner))
    return train, test, props


def assign_users(n_records: int, records_per_user: int, rng: np.random.Generator) -> np.ndarray:
    """User index (0..r-1) of each of an owner's records: shuffled, ``records_per_user`` each.

    The last user holds fewer when ``records_per_user`` does not divide the owner's size.

    Parameters
    ----------
    n_records, records_per_user : int
        The owner's record count and records per user.
    rng : numpy.random.Generator
        The shuffle's generator.

    Returns
    -------
    numpy.ndarray
        int64 user index per record.
    """
    order = rng.permutation(n_records)
    users = np.empty(n_records, dtype=np.int64)
    users[order] = np.arange(n_records) // records_per_user
    return users
