"""Owner rules that a neighbour cannot move: each user's owner from its own key and public numbers
(docs/your-data.md#grouping-users-into-owners).

A user-level guarantee compares a federation with its neighbours (one user removed or added).
Owner-side DP-SGD accounts every owner on its own, which assumes that the other users stay where
they are: a rule that deals the users round-robin from a permutation of all of them moves most
of them to another owner when one leaves, and the neighbour then changes far more than one
user's contribution. Every rule here is a function of the user's own key (``natural.user_keys``),
its own records (the Dirichlet rule reads its majority label) and public numbers (the seed,
``num_owners``, the class count, ``alpha``) only, so removing or adding a user changes no other
user's owner:

* ``random_owners``: ``blake2b(key, keyed with the seed) mod num_owners``. The owners' sizes are
  Binomial(U, 1/K), not within one user of each other: declare ``public.owner_capacity`` with
  room (``capacity_bound`` gives a bound exceeded with probability at most a stated value).
* ``dirichlet_owners``: a public table ``P(owner k | class c)`` from Dirichlet(alpha) class
  mixtures drawn with the seed (Sinkhorn-balanced so that every owner expects U/K users when the
  classes are equally frequent); a user whose majority label is ``c`` goes to the owner its own
  keyed uniform draw picks from column ``c``.

``keyed_uniform`` and ``keyed_u64`` are the keyed hashes themselves, for other per-user draws
that must not move with a neighbour (``natural.holdout``, test-only users).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from fedudp.errors import DataError

__all__ = [
    "user_keys",
    "keyed_u64",
    "keyed_uniform",
    "random_owners",
    "dirichlet_table",
    "dirichlet_owners",
    "capacity_bound",
]

_SINKHORN_STEPS, _SINKHORN_TOL, _FLOOR = 20_000, 1e-12, 1e-12


def user_keys(ids: np.ndarray, source: str = "records") -> np.ndarray:
    """A stable int64 key in [0, 2³²) per (distinct) user id; a collision is a ``DataError``.

    Parameters
    ----------
    ids : numpy.ndarray
        User ids (integers, strings, ...).
    source : str, default "records"
        The data's name, for the message.

    Returns
    -------
    numpy.ndarray
        int64 key per id: the id itself for integers in [0, 2**32), else a BLAKE2b-32 hash.

    Raises
    ------
    DataError
        Two ids hash to the same key.
    """
    ids = np.asarray(ids)
    if ids.dtype.kind in "iu" and (len(ids) == 0 or (ids.min() >= 0 and ids.max() < 2**32)):
        keys = ids.astype(np.int64)
    else:
        keys = np.array(
            [
                int.from_bytes(hashlib.blake2b(str(v).encode(), digest_size=4).digest(), "little")
                for v in ids.tolist()
            ],
            dtype=np.int64,
        )
    uniq, counts = np.unique(keys, return_counts=True)
    if len(uniq) != len(np.unique(ids)):
        clash = uniq[counts > 1][0]
        raise DataError(
            f"{source}: two user ids hash to the same key {int(clash)}; rename one "
            "of them (integer ids in [0, 2**32) are used as they are)"
        )
    return keys


def keyed_u64(keys: np.ndarray, seed: int, purpose: bytes) -> np.ndarray:
    """A uint64 per key: BLAKE2b-64 of the key (8 bytes, little endian), keyed with the seed and
    personalised with ``purpose`` (at most 16 bytes). A pure function of (seed, purpose, key).

    Parameters
    ----------
    keys : numpy.ndarray
        Integer keys (``natural.user_keys`` of the users, or any stable integer id).
    seed : int
        The run's seed (public).
    purpose : bytes
        What the draw is for (``b"owner"``, ``b"holdout"``, ...): draws of two purposes differ.

    Returns
    -------
    numpy.ndarray
        uint64 hashes, one per key.
    """
    secret = hashlib.blake2b(str(int(seed)).encode(), digest_size=32).digest()
    base = hashlib.blake2b(key=secret, person=purpose, digest_size=8)
    out = np.empty(len(keys), dtype=np.uint64)
    for i, v in enumerate(np.asarray(keys).tolist()):
        h = base.copy()
        h.update(int(v).to_bytes(8, "little", signed=True))
        out[i] = int.from_bytes(h.digest(), "little")
    return out


def keyed_uniform(keys: np.ndarray, seed: int, purpose: bytes) -> np.ndarray:
    """A float64 in [0, 1) per key, the top 53 bits of ``keyed_u64``.

    Parameters
    ----------
    keys : numpy.ndarray
        Integer keys.
    seed : int
        The run's seed (public).
    purpose : bytes
        What the draw is for (``keyed_u64``).

    Returns
    -------
    numpy.ndarray
        float64 draw per key.
    """
    return (keyed_u64(keys, seed, purpose) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def random_owners(keys: np.ndarray, num_owners: int, seed: int) -> np.ndarray:
    """Each user's owner in ``0..num_owners-1``: its keyed hash modulo ``num_owners``.

    Parameters
    ----------
    keys : numpy.ndarray
        The users' stable keys (``natural.user_keys``).
    num_owners : int
        The declared owner count (public).
    seed : int
        The run's seed (public).

    Returns
    -------
    numpy.ndarray
        int64 owner per user; a user's owner depends on its key and the seed only.
    """
    return (keyed_u64(keys, seed, b"owner") % np.uint64(num_owners)).astype(np.int64)


def dirichlet_table(num_owners: int, classes: int, alpha: float, seed: int) -> np.ndarray:
    """The public [num_owners, classes] table ``P(owner k | class c)`` (every column sums to 1).

    Each owner draws a class mixture ``p_k ~ Dirichlet(alpha)`` (a generator seeded by the
    keyed hash of the seed; entries floored at 1e-12); the matrix is then Sinkhorn-scaled to row sums classes/num_owners
    and column sums 1, which keeps its cross-ratios (the skew) and gives every owner U/K users in
    expectation when the classes are equally frequent. Depends on public numbers only.

    Parameters
    ----------
    num_owners, classes : int
        The declared owner and class counts (public).
    alpha : float
        The Dirichlet concentration (``partition.dirichlet_alpha``).
    seed : int
        The run's seed (public).

    Returns
    -------
    numpy.ndarray
        float64 ``[num_owners, classes]``, columns summing to 1.
    """
    rng = np.random.default_rng(int(keyed_u64(np.zeros(1, np.int64), seed, b"dirichlet")[0]))
    mix = rng.dirichlet(np.full(classes, float(alpha)), num_owners)
    a = np.maximum(mix.astype(np.float64), _FLOOR)
    row = classes / num_owners
    for _ in range(_SINKHORN_STEPS):
        a /= a.sum(0, keepdims=True)
        a *= row / a.sum(1, keepdims=True)
        if np.abs(a.sum(0) - 1).max() < _SINKHORN_TOL:
            break
    return a / a.sum(0, keepdims=True)


def dirichlet_owners(
    keys: np.ndarray, major: np.ndarray, num_owners: int, classes: int, alpha: float, seed: int
) -> np.ndarray:
    """Each user's owner under the label-skewed rule: its keyed uniform draw against column
    ``major[u]`` (its own majority label) of ``dirichlet_table``.

    Parameters
    ----------
    keys : numpy.ndarray
        The users' stable keys (``natural.user_keys``).
    major : numpy.ndarray
        Each user's majority label (its own records).
    num_owners, classes : int
        The declared owner and class counts (public).
    alpha : float
        The Dirichlet concentration (``partition.dirichlet_alpha``).
    seed : int
        The run's seed (public).

    Returns
    -------
    numpy.ndarray
        int64 owner per user; a user's owner depends on its key, its label and public numbers.
    """
    cdf = np.cumsum(dirichlet_table(num_owners, classes, alpha, seed), axis=0)  # [K, C]
    u = keyed_uniform(keys, seed, b"owner")
    col = cdf[:, np.asarray(major, dtype=np.int64)]  # [K, U]
    return np.minimum((u[None, :] >= col).sum(0), num_owners - 1).astype(np.int64)


def capacity_bound(users: int, num_owners: int, failure: float = 1e-6) -> int:
    """The smallest M with P(some owner of ``random_owners`` holds more than M of ``users``
    users) at most ``failure`` (a union bound over the owners of the Binomial(U, 1/K) tail): a
    ``public.owner_capacity`` to declare that the data exceeds with probability ``failure``.

    Parameters
    ----------
    users, num_owners : int
        The user count U and owner count K.
    failure : float, default 1e-6
        The allowed probability that some owner exceeds the bound.

    Returns
    -------
    int
        M, at least ``ceil(U / K)`` and at most U.
    """
    from scipy.stats import binom

    m = int(binom.isf(failure / num_owners, users, 1.0 / num_owners))  # P(size > m) <= share
    return max(min(m, users), math.ceil(users / num_owners))
