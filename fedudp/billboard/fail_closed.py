"""The fail-closed rule, written once for both engines (docs/algorithms.md#fail-closed).

A round is released only if enough owners (clients) answered: at least ``min_owners`` of them,
holding together at least ``min_users`` declared user slots. Both counts are public: which
owners answered is a property of their infrastructure (assumed independent of the data, as the
failures themselves), and an owner's slots are its declared capacity (``public.owner_capacity``,
the planned per-owner user count, a Flower client's ``users-per-client``), never the number of
its users that were sampled or that contributed. The decision therefore depends neither on the
secret Poisson sample nor on one user's presence: a released round's inclusion probability is
exactly the q the ledger composes, and a neighbour (one user added or removed) is withheld in
exactly the rounds the dataset is.

``fedudp.billboard.server.Billboard.withhold`` (fedudp's engines) and
``fedudp.flower.UserLevelDP`` (the Flower wrapper) both call :func:`withhold_reason`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

__all__ = [
    "answered_slots",
    "withhold_reason",
    "minimum_error",
]


def answered_slots(capacity: Sequence[int] | np.ndarray, failed: Collection[int]) -> int:
    """The declared user slots of the owners that answered: every owner's public ``capacity``
    (indexed by owner id) but those of the ``failed`` owner ids.

    Parameters
    ----------
    capacity : sequence of int
        Each owner's public capacity, in the billboard's sampling units.
    failed : collection of int
        The ids of the owners that failed this round.

    Returns
    -------
    int
        The sum of the capacities of the owners not in ``failed``.

    Raises
    ------
    ValueError
        When a failed owner id is outside ``0..len(capacity) - 1``.
    """
    cap = np.asarray(capacity, dtype=np.int64)
    gone = np.unique(np.asarray(sorted(failed), dtype=np.int64))
    if gone.size and (gone.min() < 0 or gone.max() >= cap.size):
        raise ValueError(f"failed owner ids {gone.tolist()} outside 0..{cap.size - 1}")
    return int(cap.sum() - cap[gone].sum())


def withhold_reason(
    answered_owners: int,
    slots: int,
    failed_owners: int,
    min_owners: int,
    min_users: int,
    *,
    who: str = "owner",
    key: str = "train.",
) -> str | None:
    """Why a round must release nothing (None: release), from public numbers only.

    Parameters
    ----------
    answered_owners : int
        How many owners (clients) answered with a valid contribution.
    slots : int
        The declared user slots those owners hold (``answered_slots``; a Flower client's
        reported ``users``), never the sampled count.
    failed_owners : int
        How many owners failed (for the message only: the decision does not read it).
    min_owners, min_users : int
        The declared minimum (``train.min_owners``, ``train.min_users``).
    who : str
        What an owner is called in the message (``"client"`` for Flower).
    key : str
        The prefix of the minimum's config keys in the message.

    Returns
    -------
    str or None
        The reason, naming the counts and the keys; None when the round is released.
    """
    if answered_owners >= min_owners and slots >= min_users:
        return None
    return (
        f"{answered_owners} {who}(s) answered holding {slots} user slot(s) (declared), "
        f"{failed_owners} failed ({key}min_owners={min_owners}, {key}min_users={min_users})"
    )


def minimum_error(
    min_owners: int, min_users: int, capacity: Sequence[int] | np.ndarray
) -> str | None:
    """Why the declared minimum can never be met even with every owner answering (None: it
    can): every round would be withheld, so refuse the run before any work.

    Parameters
    ----------
    min_owners, min_users : int
        The declared minimum (``train.min_owners``, ``train.min_users``).
    capacity : sequence of int
        Each owner's public capacity (declared user slots).

    Returns
    -------
    str or None
        The reason naming the config key; None when the minimum can be met.
    """
    cap = np.asarray(capacity, dtype=np.int64)
    if min_owners > cap.size:
        return (
            f"train.min_owners={min_owners}: there are only {cap.size} owners "
            "(partition.num_owners); every round would be withheld"
        )
    if min_users > int(cap.sum()):
        return (
            f"train.min_users={min_users}: the owners' declared user slots total "
            f"{int(cap.sum())}; every round would be withheld"
        )
    return None
