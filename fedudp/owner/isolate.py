"""``engine=local``: a user whose training step raises is dropped alone
(docs/architecture.md#failures).

The local engine computes the whole cohort in one batched call of ``Owners.reply``. When that
call raises, the failure path here finds the user(s) whose computation raises by running the
same call on subsets of the cohort's users (bisection: a subset that raises is split in two,
down to single users), drops them, and computes the reply once more without them, so the reply
is the one of the federation without those users (``Federation.without_user``), as the Flower
client mod drops such a user alone (``fedudp.flower.guard``). The happy path is the one call.

* Units are users (``privacy.placement=server``): the reply is computed for the other sampled
  users; each dropped user contributes zero and is not counted (``OwnerReply.failed``, as a
  non-finite user in ``make_reply``).
* Units are owners (owner-side DP-SGD, owner-level updates, ``privacy.unit=owner``): each probe
  runs the owners' computation on a federation holding only the probed users, and the reply is
  computed on the federation without the raising users (every owner still answers).

The dropped users are named in a warning (the owner side's log) and counted per owner in the
reply (``OwnerReply.raised``: the count and the one-line reasons, the round's
``raised_users`` metrics). A failure not tied to single users keeps today's behaviour, the
original exception propagates (a fedudp bug stops the run): the computation raises without any
user, or at least two users are computed and each raises alone, or a raising set of users has
no raising half (users that raise only together, or a cohort too large for memory), or the
reply without the raising users raises again. ``ConfigError`` (and ``DataError``),
``OwnerFailure``, ``RunInterrupted`` and any ``BaseException`` that is not an ``Exception``
(``KeyboardInterrupt``) are never caught.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedudp.data.federation import Federation
from fedudp.errors import ConfigError, one_line
from fedudp.protocol.contributions import Constraint
from fedudp.protocol.messages import OwnerFailure, OwnerReply, Raised
from fedudp.stopping import RunInterrupted

if TYPE_CHECKING:
    from fedudp.owner.owners import Owners, Params

__all__ = ["isolated_reply", "isolated_vectors", "without_users", "NEVER_ISOLATED"]

log = logging.getLogger(__name__)

# never taken for one user's fault: bad input, an owner's infrastructure, a stop signal
NEVER_ISOLATED: tuple[type[BaseException], ...] = (ConfigError, OwnerFailure, RunInterrupted)


def without_users(fed: Federation, users: np.ndarray) -> Federation:
    """The federation without the users ``users``: ``Federation.without_user`` for each.

    Parameters
    ----------
    fed : Federation
        The federation.
    users : np.ndarray
        User indices into ``fed``.

    Returns
    -------
    Federation
        Their records removed, every other user keeping its records, owner and identity,
        every owner kept (possibly with no users).
    """
    drop = np.zeros(fed.num_users, dtype=bool)
    drop[np.asarray(users, dtype=np.int64)] = True
    sizes = np.diff(fed.user_offsets)
    keep_records = np.repeat(~drop, sizes)
    offs = np.concatenate([[0], np.cumsum(sizes[~drop])]).astype(fed.user_offsets.dtype)
    per_owner = np.bincount(fed.user_owner[~drop], minlength=fed.num_owners)
    ou = np.concatenate([[0], np.cumsum(per_owner)]).astype(fed.owner_user_offsets.dtype)
    keep = np.flatnonzero(keep_records)
    return Federation(
        fed.x[keep],
        fed.y[keep],
        offs,
        fed.user_owner[~drop],
        ou,
        fed.x_test,
        fed.y_test,
        fed.test_offsets,
        fed.num_classes,
        fed.owner_classes,
        fed.owner_ids.copy(),
        fed.user_ids[~drop],
    )


def isolated_reply(
    owners: Owners,
    fed: Federation,
    shared: Params,
    personal: Params,
    units: np.ndarray,
    round_: int,
    constraint: Constraint,
) -> OwnerReply:
    """``owners.reply(fed, shared, personal, units, round_, constraint)``; where it raises, the
    reply without the user(s) whose computation raises alone (see the module doc), or the
    original exception where the failure is not tied to single users.

    Parameters
    ----------
    owners, fed, shared, personal, units, round_, constraint
        As ``Owners.reply``: ``units`` are users here, or owners when
        ``owners.spec.cohort_is_owners``.

    Returns
    -------
    OwnerReply
        The reply; its ``failed`` counts the dropped users where units are users, its
        ``raised`` the dropped users per owner with their reasons.
    """
    try:
        return owners.reply(fed, shared, personal, units, round_, constraint)
    except NEVER_ISOLATED:
        raise
    except Exception as e:  # noqa: BLE001  (the failure path below; a bug is re-raised)
        first = e
    by_owner = owners.spec.cohort_is_owners
    if by_owner:  # every user of the sampled owners
        cands = np.flatnonzero(np.isin(fed.user_owner, units))
    else:
        cands = np.asarray(units, dtype=np.int64)

    def compute(users: np.ndarray) -> OwnerReply:
        if by_owner:
            rest = np.setdiff1d(np.arange(fed.num_users), users)
            return owners.reply(
                without_users(fed, rest), shared, personal, units, round_, constraint
            )
        return owners.reply(fed, shared, personal, users, round_, constraint)

    progress, owners.on_progress = owners.on_progress, None  # probes are no progress
    try:
        bad = _raising_users(cands, first, compute)
        if bad is None:
            raise first
        drop = np.array(sorted(bad), dtype=np.int64)
        try:
            if by_owner:
                rep = owners.reply(
                    without_users(fed, drop), shared, personal, units, round_, constraint
                )
            else:
                rep = compute(cands[~np.isin(cands, drop)])
        except NEVER_ISOLATED:
            raise
        except Exception as again:  # noqa: BLE001  (re-raised as the first)
            first.add_note(
                f"engine=local: the reply without the {len(drop)} user(s) whose step raised "
                f"alone raised too ({one_line(again)}): not one user's fault"
            )
            raise first from None
    finally:
        owners.on_progress = progress
    for u in drop:
        log.warning(
            "engine=local round %s: user %s of owner %s dropped: its training step raised: %s",
            round_,
            int(fed.user_ids[u]),
            int(fed.owner_ids[fed.user_owner[u]]),
            bad[int(u)],
        )
    rep.raised = rep.raised + _per_owner(fed, bad)
    if not by_owner:  # each dropped user contributes zero and is not counted
        rep.failed += len(drop)
    return rep


def isolated_vectors(
    owners: Owners,
    fed: Federation,
    shared: Params,
    personal: Params,
    users: np.ndarray,
    round_: int,
    one_step: bool = False,
) -> tuple[list[tuple[np.ndarray, torch.Tensor]], tuple[Raised, ...]]:
    """``owners.user_vectors`` of the ``users`` (each chunk's users and their vectors); where
    that raises, the vectors without the user(s) whose step raises alone (as
    ``isolated_reply``: bisection, the original exception where the failure is not tied to
    single users), with the dropped users per owner (a distributed mechanism's owners encode
    each user on its own, so they need the users, not a reply).

    Parameters
    ----------
    owners, fed, shared, personal, users, round_, one_step
        As ``Owners.user_vectors``.

    Returns
    -------
    tuple
        (the chunks, the dropped users per owner with their reasons).
    """

    def compute(us: np.ndarray) -> list[tuple[np.ndarray, torch.Tensor]]:
        return list(owners.user_vectors(fed, shared, personal, us, round_, one_step))

    users = np.asarray(users, dtype=np.int64)
    try:
        return compute(users), ()
    except NEVER_ISOLATED:
        raise
    except Exception as e:  # noqa: BLE001  (the failure path below; a bug is re-raised)
        first = e
    progress, owners.on_progress = owners.on_progress, None  # probes are no progress
    try:
        bad = _raising_users(users, first, compute)
        if bad is None:
            raise first
        got = compute(users[~np.isin(users, np.array(sorted(bad), dtype=np.int64))])
    finally:
        owners.on_progress = progress
    for u in sorted(bad):
        log.warning(
            "round %s: user %s of owner %s dropped: its training step raised: %s",
            round_,
            int(fed.user_ids[u]),
            int(fed.owner_ids[fed.user_owner[u]]),
            bad[u],
        )
    return got, _per_owner(fed, bad)


def _raising_users(
    cands: np.ndarray, first: Exception, compute: Callable[[np.ndarray], object]
) -> dict[int, str] | None:
    """{user: one-line reason} of the users in ``cands`` whose computation raises alone (the
    whole of ``cands`` raised ``first``), by bisection; None where the failure is not tied to
    single users (see the module doc)."""

    def raises(users: np.ndarray) -> Exception | None:
        try:
            compute(users)
        except NEVER_ISOLATED:
            raise
        except Exception as e:  # noqa: BLE001  (a probe: what the bisection looks for)
            return e
        return None

    if not len(cands) or raises(cands[:0]) is not None:
        return None  # the owners' code raises without any user
    bad: dict[int, str] = {}
    todo: list[tuple[np.ndarray, Exception]] = [(cands, first)]
    while todo:
        users, why = todo.pop()
        if len(users) == 1:
            bad[int(users[0])] = one_line(why)
            continue
        halves = (users[: len(users) // 2], users[len(users) // 2 :])
        got = [(h, raises(h)) for h in halves]
        failing = [(h, e) for h, e in got if e is not None]
        if not failing:
            return None  # raises only together (an interaction, a cohort too large)
        todo.extend(failing)
    if len(cands) >= 2 and len(bad) == len(cands):
        return None  # every user raises alone: the code's failure, not one user's
    return bad


def _per_owner(fed: Federation, bad: dict[int, str]) -> tuple[Raised, ...]:
    """The dropped users counted per owner (global owner id), with their reasons."""
    by: dict[int, list[str]] = {}
    for u in sorted(bad):
        by.setdefault(int(fed.owner_ids[fed.user_owner[u]]), []).append(bad[u])
    return tuple(Raised(j, len(r), tuple(r)) for j, r in sorted(by.items()))
