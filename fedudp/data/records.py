"""One split of a federation's records, with natural users, before it is laid out for rounds.

A federation is owners (silos) holding users holding records. ``Records`` keeps one split
(train or test) as flat per-record columns: the features ``x``, the label ``y``, the ``user``
each record belongs to and, once users have been grouped, the ``owner`` each record's user
belongs to. The readers (``fedudp.data.columnar``, ``.leaf``, ``.cifar``) return ``Records``; a
config builder then lays them out owner by owner and user by user.

Users are the privacy unit, so they are never split: ``Records`` refuses a user whose records
carry two owners, and every rule here moves whole users.

Rules (all seeded, so the same seed and the same records give the same result):

* ``group_users(records, "random", num_owners=K, seed=s)``: each user's owner is a keyed hash
  of its own key modulo K (``fedudp.data.owner_rules``), so removing or adding a user moves no
  other user; owner sizes are Binomial(U, 1/K).
* ``group_users(records, "column", column=c)``: each user's owner is the value of the metadata
  column ``records.meta[c]`` (a site, a hospital, a region, ...); a user with two values there
  is an error.
* ``group_users(records, "dirichlet", num_owners=K, alpha=a, seed=s)``: label-skewed, each user
  by its own key and majority label against a public table (``owner_rules.dirichlet_owners``).
* ``users_by_rule(records, "shuffle" | "dirichlet", records_per_user=r, ...)``: forms users for
  data without natural users (CIFAR); see its docstring.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from fedudp.errors import DataError

__all__ = ["Records", "Summary", "from_arrays", "group_users", "users_by_rule", "summary"]


def _where(source: str) -> str:
    return source or "records"


def _show(value: Any) -> str:
    """A value for a one-line message (``repr`` escapes newlines in string ids)."""
    return repr(value.item() if isinstance(value, np.generic) else value)


def _ids_ok(a: np.ndarray) -> bool:
    return a.ndim == 1 and a.dtype.kind in "iU" and (a.dtype.kind != "i" or a.dtype == np.int64)


def _first_conflict(user: np.ndarray, value: np.ndarray) -> tuple[Any, Any, Any] | None:
    """The first user (in sorted id order) holding two different ``value``s, with two of them."""
    if len(user) == 0:
        return None
    users, uinv = np.unique(user, return_inverse=True)
    _, vinv = np.unique(value, return_inverse=True)
    order = np.lexsort((vinv, uinv))
    su, sv = uinv[order], vinv[order]
    clash = np.flatnonzero((su[1:] == su[:-1]) & (sv[1:] != sv[:-1]))
    if len(clash) == 0:
        return None
    i = clash[0]
    return users[su[i]], value[order[i]], value[order[i + 1]]


@dataclass(frozen=True, eq=False)
class Records:
    """One split of a federation, one row per record (see the module doc).

    ``from_arrays`` converts dtypes; the constructor only checks them.

    Parameters
    ----------
    x
        Features ``[N, ...]``: float32 (images, tabular features) or int64 (token ids).
    y
        int64 labels ``[N]`` in ``[0, classes)``.
    user
        ``[N]`` user ids, int64 or str.
    owner
        ``[N]`` owner ids (int64 or str), or None while users are not yet grouped.
    classes
        The number of classes.
    meta
        Extra per-record columns (1-D, length N) by name, e.g. a column to group by.
    source
        The file or folder the records came from, named in error messages.

    Raises
    ------
    DataError
        A dtype, shape or label out of place (a ``ValueError``; one line naming ``source``).
    """

    x: np.ndarray
    y: np.ndarray
    user: np.ndarray
    owner: np.ndarray | None
    classes: int
    meta: Mapping[str, np.ndarray] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        self._check_arrays()
        self._check_values()

    def _fail(self, what: str) -> DataError:
        return DataError(f"{_where(self.source)}: {what}")

    def _check_arrays(self) -> None:
        for name in ("x", "y", "user"):
            if not isinstance(getattr(self, name), np.ndarray):
                raise self._fail(f"{name} must be a numpy array (use from_arrays to convert)")
        if self.x.ndim < 1 or self.x.dtype not in (np.float32, np.int64):
            raise self._fail(
                f"x must be [N, ...] float32 or int64, got {self.x.dtype} with "
                f"shape {self.x.shape} (from_arrays converts)"
            )
        if self.y.ndim != 1 or self.y.dtype != np.int64:
            raise self._fail(
                f"labels must be 1-D int64, got {self.y.dtype} with shape {self.y.shape}"
            )
        if not _ids_ok(self.user):
            raise self._fail(
                f"user ids must be 1-D int64 or str, got {self.user.dtype} with "
                f"shape {self.user.shape}"
            )
        if self.owner is not None and not (
            isinstance(self.owner, np.ndarray) and _ids_ok(self.owner)
        ):
            raise self._fail("owner ids must be None or a 1-D int64 or str numpy array")
        n = len(self.x)
        columns = {
            "y": self.y,
            "user": self.user,
            **({} if self.owner is None else {"owner": self.owner}),
        }
        columns.update({f"meta[{k!r}]": v for k, v in self.meta.items()})
        for name, col in columns.items():
            if not isinstance(col, np.ndarray) or col.ndim != 1 or len(col) != n:
                shape = getattr(col, "shape", type(col).__name__)
                raise self._fail(f"{name} must be 1-D with one entry per record ({n}), got {shape}")

    def _check_values(self) -> None:
        if (
            isinstance(self.classes, bool)
            or not isinstance(self.classes, (int, np.integer))
            or self.classes < 1
        ):
            raise self._fail(f"classes must be a positive int, got {self.classes!r}")
        bad = np.flatnonzero((self.y < 0) | (self.y >= self.classes))
        if len(bad):
            raise self._fail(
                f"label {int(self.y[bad[0]])} of record {int(bad[0])} is outside "
                f"[0, {int(self.classes)})"
            )
        if self.x.dtype.kind == "f" and not np.isfinite(self.x).all():
            row = int(np.flatnonzero(~np.isfinite(self.x.reshape(len(self.x), -1)).all(1))[0])
            raise self._fail(f"features of record {row} are NaN or infinite")
        if self.owner is not None:
            clash = _first_conflict(self.user, self.owner)
            if clash is not None:
                u, a, b = clash
                raise self._fail(
                    f"user {_show(u)} has records under two owners ({_show(a)} and "
                    f"{_show(b)}); a user's records must all belong to one owner"
                )

    def __len__(self) -> int:
        return len(self.y)

    @property
    def users(self) -> np.ndarray:
        """The distinct user ids, sorted."""
        return np.unique(self.user)

    @property
    def owners(self) -> np.ndarray | None:
        """The distinct owner ids, sorted (None while users are not grouped)."""
        return None if self.owner is None else np.unique(self.owner)

    def with_owner(self, owner: np.ndarray | None) -> Records:
        """A copy with the per-record ``owner`` column replaced (checked as a new ``Records``)."""
        return replace(self, owner=owner)

    def with_user(self, user: np.ndarray) -> Records:
        """A copy with new user ids and no owners (regrouping users voids their owners)."""
        return replace(self, user=user, owner=None)


# ------------------------------------------------------------------------------------ building


def _as_numpy(name: str, value: Any) -> np.ndarray:
    """A numpy array from a numpy array or a torch tensor; anything else is a TypeError."""
    if isinstance(value, np.ndarray):
        return value
    torch = sys.modules.get("torch")  # a tensor implies torch is imported already
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(value).__name__}")


def _ids(name: str, a: np.ndarray, source: str) -> np.ndarray:
    """Ids as int64 (integer input) or str (str input, or an object array of str only)."""
    if a.dtype.kind in "iu":
        return a.astype(np.int64, copy=False)
    if a.dtype.kind == "U":
        return a
    if a.dtype.kind == "O" and all(isinstance(v, str) for v in a.ravel()):
        return a.astype(str)
    raise DataError(f"{_where(source)}: {name} ids must be integers or strings, got {a.dtype}")


def _features(x: np.ndarray, source: str) -> np.ndarray:
    if x.dtype.kind in "fb":
        return x.astype(np.float32, copy=False)
    if x.dtype.kind in "iu":
        return x.astype(np.int64, copy=False)  # token ids: kept as integers
    raise DataError(f"{_where(source)}: features must be numeric, got {x.dtype}")


def _labels(y: np.ndarray, source: str) -> np.ndarray:
    if y.dtype.kind not in "iu":
        raise DataError(f"{_where(source)}: labels must be integers in [0, classes), got {y.dtype}")
    return y.astype(np.int64, copy=False)


def from_arrays(
    x: Any,
    y: Any,
    user: Any,
    owner: Any = None,
    classes: int | None = None,
    *,
    meta: Mapping[str, Any] | None = None,
    source: str = "",
) -> Records:
    """``Records`` from numpy arrays or torch tensors.

    Float or bool features become float32 and integer features int64 (token ids; an image given
    as uint8 is kept as integers, so scale it to floats first). Labels must be integers and become
    int64. Ids (user, owner, meta columns of ids) become int64 or str.

    Parameters
    ----------
    x
        The features, one row per record.
    y
        The integer labels.
    user
        The user id of each record.
    owner
        The owner id of each record (None: grouped later, e.g. with ``group_users``).
    classes
        The number of classes (default ``max(y) + 1``).
    meta
        Extra per-record id columns, by name.
    source
        Where the records come from (named in error messages).

    Returns
    -------
    Records
        The records, checked as in ``Records``.

    Raises
    ------
    TypeError
        An argument that is neither a numpy array nor a torch tensor.
    DataError
        Arrays that do not describe records (lengths, label range, ids).
    """
    xa, ya, ua = (_as_numpy(n, v) for n, v in (("x", x), ("y", y), ("user", user)))
    oa = None if owner is None else _ids("owner", _as_numpy("owner", owner), source)
    cols = {str(k): _as_numpy(f"meta[{k!r}]", v) for k, v in (meta or {}).items()}
    cols = {
        k: _ids(f"meta[{k!r}]", v, source) if v.dtype.kind in "OU" else v for k, v in cols.items()
    }
    ya = _labels(ya, source)
    if classes is None:
        if len(ya) == 0:
            raise DataError(
                f"{_where(source)}: no labels to infer the number of classes from; pass classes"
            )
        classes = int(ya.max()) + 1
    return Records(
        _features(xa, source), ya, _ids("user", ua, source), oa, int(classes), cols, source
    )


# ---------------------------------------------------------------------------- grouping users


def _user_index(records: Records) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct users, each record's index into them)."""
    return np.unique(records.user, return_inverse=True)


def _check_owners(num_owners: int | None, num_users: int, records: Records) -> int:
    if (
        isinstance(num_owners, bool)
        or not isinstance(num_owners, (int, np.integer))
        or num_owners < 1
    ):
        raise ValueError(f"num_owners must be a positive int, got {num_owners!r}")
    return int(num_owners)  # more owners than users: some hold none (an upper bound)


def _majority_labels(uinv: np.ndarray, y: np.ndarray, num_users: int, classes: int) -> np.ndarray:
    """Each user's most frequent label (ties: the smallest label)."""
    counts = np.zeros((num_users, classes), dtype=np.int64)
    np.add.at(counts, (uinv, y), 1)
    return counts.argmax(axis=1)


def _column_owners(records: Records, column: str | None) -> np.ndarray:
    if column is None or column not in records.meta:
        present = ", ".join(sorted(records.meta)) or "none"
        raise DataError(
            f"{_where(records.source)}: no metadata column {column!r} to group "
            f"users by (columns present: {present})"
        )
    values = _ids(f"meta[{column!r}]", np.asarray(records.meta[column]), records.source)
    clash = _first_conflict(records.user, values)
    if clash is not None:
        u, a, b = clash
        raise DataError(
            f"{_where(records.source)}: column {column!r} gives user {_show(u)} two "
            f"values ({_show(a)} and {_show(b)}); the 'column' rule needs one value "
            f"per user"
        )
    return values


def group_users(
    records: Records,
    rule: Literal["random", "column", "dirichlet"],
    *,
    num_owners: int | None = None,
    seed: int = 0,
    column: str | None = None,
    alpha: float | None = None,
) -> Records:
    """A copy of ``records`` with every user assigned to one owner by ``rule``.

    Every rule gives a user's owner from that user alone (its key ``natural.user_keys``, its own
    records) and public numbers, so removing or adding one user changes no other user's owner
    (``fedudp.data.owner_rules``, docs/your-data.md#grouping-users-into-owners). Users stay whole.

    Parameters
    ----------
    records
        The records, with their users.
    rule
        ``"random"`` (``num_owners``, ``seed``): a keyed hash of the user's key modulo
        ``num_owners`` (sizes Binomial(U, 1/K)). ``"column"`` (``column``): the owner is the
        user's value of ``records.meta[column]``. ``"dirichlet"`` (``num_owners``, ``alpha``,
        ``seed``): label-skewed; the user's keyed uniform draw against the public
        ``P(owner | class)`` column of its majority label (``owner_rules.dirichlet_owners``).
    num_owners, seed, column, alpha
        The rule's parameters, as above.

    Returns
    -------
    Records
        The records with owner ids int64 ``0..num_owners-1`` (or the column's values).

    Raises
    ------
    DataError
        A user with two values of ``column`` (naming the column and the user), or a rule's
        parameter missing or out of range.
    """
    from fedudp.data.owner_rules import dirichlet_owners, random_owners, user_keys

    if rule == "column":
        return records.with_owner(_column_owners(records, column))
    if rule not in ("random", "dirichlet"):
        raise ValueError(f"unknown grouping rule {rule!r}; use 'random', 'column' or 'dirichlet'")
    users, uinv = _user_index(records)
    k = _check_owners(num_owners, len(users), records)
    keys = user_keys(users, records.source or "records")
    if rule == "random":
        per_user = random_owners(keys, k, seed)
    else:
        if alpha is None or not alpha > 0:
            raise ValueError(f"the 'dirichlet' rule needs alpha > 0, got {alpha!r}")
        major = _majority_labels(uinv, records.y, len(users), records.classes)
        per_user = dirichlet_owners(keys, major, k, records.classes, alpha, seed)
    return records.with_owner(per_user[uinv])


# ---------------------------------------------------------------------------- forming users


def _shuffle_users(n: int, records_per_user: int, rng: np.random.Generator) -> np.ndarray:
    user = np.empty(n, dtype=np.int64)
    user[rng.permutation(n)] = np.arange(n) // records_per_user
    return user


def _draw_user(
    mix: np.ndarray, pools: list[list[int]], need: int, rng: np.random.Generator
) -> list[int]:
    """``need`` records drawn by class from ``mix``, renormalised over classes with records left."""
    out: list[int] = []
    while need > 0:
        left = np.array([len(p) for p in pools])
        w = mix * (left > 0)
        w = w / w.sum() if w.sum() > 0 else (left > 0) / (left > 0).sum()
        take = np.minimum(rng.multinomial(need, w), left)
        for c in np.flatnonzero(take):
            out += [pools[c].pop() for _ in range(take[c])]
        need -= int(take.sum())
    return out


def _dirichlet_users(
    y: np.ndarray, classes: int, records_per_user: int, alpha: float, rng: np.random.Generator
) -> np.ndarray:
    pools = [list(rng.permutation(np.flatnonzero(y == c))) for c in range(classes)]
    user = np.empty(len(y), dtype=np.int64)
    for u in range(-(-len(y) // records_per_user)):
        mix = rng.dirichlet(np.full(classes, float(alpha)))
        need = min(records_per_user, sum(len(p) for p in pools))
        user[_draw_user(mix, pools, need, rng)] = u
    return user


def users_by_rule(
    records: Records,
    rule: Literal["shuffle", "dirichlet"] = "shuffle",
    *,
    records_per_user: int,
    seed: int = 0,
    alpha: float | None = None,
) -> Records:
    """A copy of ``records`` with users formed by ``rule`` (for data with no natural users).

    Every record goes to exactly one user; users are int64 ``0..ceil(N / records_per_user)-1``;
    owners are reset to None (group the new users with ``group_users``).

    Parameters
    ----------
    records
        The records.
    rule
        ``"shuffle"``: the records are permuted with ``default_rng(seed)`` and dealt in
        consecutive runs of ``records_per_user``: user ``u`` holds permuted positions
        ``u*r .. u*r + r - 1``; when ``records_per_user`` does not divide N the last user is
        smaller. ``"dirichlet"`` (label-skewed, needs ``alpha > 0``): each class's records are
        shuffled; users ``0, 1, ...`` are filled in turn, each drawing a class mixture
        ``q_u ~ Dirichlet(alpha)`` and then ``records_per_user`` records whose classes are drawn
        from ``q_u`` (when a class runs out the mixture is renormalised over the classes that
        still have records); the last user takes what is left. Small ``alpha``: each user's
        records are mostly one class.
    records_per_user
        The records of each user.
    seed
        The permutation's (and the mixtures') seed.
    alpha
        The Dirichlet concentration (``"dirichlet"`` only).

    Returns
    -------
    Records
        The records with their new users.
    """
    if (
        isinstance(records_per_user, bool)
        or not isinstance(records_per_user, (int, np.integer))
        or records_per_user < 1
    ):
        raise ValueError(f"records_per_user must be a positive int, got {records_per_user!r}")
    rng = np.random.default_rng(seed)
    if rule == "shuffle":
        return records.with_user(_shuffle_users(len(records), int(records_per_user), rng))
    if rule == "dirichlet":
        if alpha is None or not alpha > 0:
            raise ValueError(f"the 'dirichlet' rule needs alpha > 0, got {alpha!r}")
        return records.with_user(
            _dirichlet_users(records.y, records.classes, int(records_per_user), alpha, rng)
        )
    raise ValueError(f"unknown user rule {rule!r}; use 'shuffle' or 'dirichlet'")


# ---------------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class Summary:
    """Sizes of a split: counts, and (min, median, max) of records per user / users per owner.

    Attributes
    ----------
    records, users, classes : int
        The counts of records, users and classes.
    owners : int or None
        The count of owners; None for records not grouped by owner.
    records_per_user : tuple of (int, float, int)
        (min, median, max) records per user.
    users_per_owner : tuple of (int, float, int) or None
        (min, median, max) users per owner; None without owners.
    """

    records: int
    users: int
    owners: int | None
    classes: int
    records_per_user: tuple[int, float, int]
    users_per_owner: tuple[int, float, int] | None

    def __str__(self) -> str:
        rpu = "/".join(f"{v:g}" for v in self.records_per_user)
        text = (
            f"{self.records} records, {self.users} users (records per user min/median/max "
            f"{rpu}), {self.classes} classes"
        )
        if self.users_per_owner is not None:
            upo = "/".join(f"{v:g}" for v in self.users_per_owner)
            text += f", {self.owners} owners (users per owner min/median/max {upo})"
        return text


def _spread(counts: np.ndarray) -> tuple[int, float, int]:
    if len(counts) == 0:
        return (0, 0.0, 0)
    return (int(counts.min()), float(np.median(counts)), int(counts.max()))


def summary(records: Records) -> Summary:
    """Users, owners and the spread of records per user (and users per owner when grouped).

    Parameters
    ----------
    records
        The records.

    Returns
    -------
    Summary
        The counts.
    """
    users, uinv = _user_index(records)
    per_user = np.bincount(uinv, minlength=len(users))
    per_owner = None
    if records.owner is not None:
        _, first = np.unique(uinv, return_index=True)
        _, oinv = np.unique(records.owner[first], return_inverse=True)
        per_owner = np.bincount(oinv)
    return Summary(
        len(records),
        len(users),
        None if per_owner is None else len(per_owner),
        records.classes,
        _spread(per_user),
        None if per_owner is None else _spread(per_owner),
    )
