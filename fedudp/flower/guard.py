"""What ``fedudp.flower`` refuses and drops so that a neighbour changes nothing but the noisy
release (docs/flower-apps.md#bad-users-and-refusals).

* **One user, never the client.** A sampled user whose update is NaN/inf is dropped by the rule
  of fedudp's own engine (``fedudp.protocol.messages.make_reply``: it contributes zero and is
  not counted); a user whose training step raises (or whose step's reply is an error) is dropped
  alone, its reason logged on the client and counted in the reply. Neither ever fails the
  client's other users, so whether a client answers (the server's release decision) never
  depends on one user's data. ``user_rows`` is that rule for the mod's per-user and fast paths.
* **Never in the clear, never twice noised.** A training message without ``UserLevelDP``'s
  record is refused by the mod (it never sends the app's plain update), and a Flower DP wrapper
  or mod stacked with fedudp's (``DifferentialPrivacy*Clipping``, ``fixedclipping_mod``,
  ``adaptiveclipping_mod``, ``LocalDpMod``) is refused with one line: ``stacked_strategy``
  (inside ``UserLevelDP``), ``outer_wrapper`` (around it, seen at the first
  ``configure_train``), ``stacked_mods`` (the mods after ``user_level_mod`` in the ClientApp's
  chain) and ``foreign_keys`` (another DP wrapper's config keys in the training message).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedudp.errors import one_line as one_line  # re-exported: fedudp.flower, flower_fast
from fedudp.protocol.contributions import Constraint, Contribution, finite_rows
from fedudp.protocol.messages import make_reply

__all__ = [
    "UserRows",
    "user_rows",
    "flower_dp_name",
    "stacked_strategy",
    "outer_wrapper",
    "stacked_mods",
    "foreign_keys",
    "FOREIGN_KEYS",
    "NO_WRAPPER",
]

# the config keys Flower's client-side DP wrappers send their mods (flwr.supercore.
# differential_privacy.KEY_CLIPPING_NORM / KEY_NORM_BIT)
FOREIGN_KEYS = ("clipping_norm", "norm_bit")

NO_WRAPPER = (
    "user_level_mod: this training message has no 'fedudp.dp' record, so the server is not "
    "wrapped in fedudp.flower.UserLevelDP; nothing was trained or sent (the mod never sends the "
    "app's plain update): wrap the ServerApp's strategy in UserLevelDP(strategy, aggregator, ...)"
)


@dataclass
class UserRows:
    """The sampled users' contribution after the drop rule, and what was dropped.

    Attributes
    ----------
    contribution : Contribution
        The constraint applied to the kept users' rows (their clipped sum and count, or rows).
    kept : list of int
        Indices (into the sampled users) of the users that contribute.
    nonfinite : list of int
        Indices of the users whose update was NaN/inf (dropped, not counted).
    raised : dict of int to str
        Indices of the users whose training step raised, and the one-line reason (dropped, not
        counted).
    """

    contribution: Contribution
    kept: list[int]
    nonfinite: list[int]
    raised: dict[int, str] = field(default_factory=dict)


def user_rows(G: torch.Tensor, constraint: Constraint, raised: Mapping[int, str]) -> UserRows:
    """The rule of fedudp's own engine on the sampled users' updates ``G`` ([users, d], the rows
    of users whose step raised are ignored, whatever they hold): non-finite rows dropped and the
    constraint applied to the others by ``make_reply`` itself (not a copy of it); the users whose
    step raised dropped the same way.

    Parameters
    ----------
    G : torch.Tensor
        The sampled users' updates, [users, d].
    constraint : Constraint
        The server's (clip, rows or sum).
    raised : Mapping[int, str]
        {row: reason} of the users whose step raised.

    Returns
    -------
    UserRows
    """
    bad = torch.zeros(len(G), dtype=torch.bool)
    if raised:
        bad[torch.tensor(sorted(raised), dtype=torch.long)] = True
    ok = finite_rows(G) if len(G) else torch.zeros(0, dtype=torch.bool)
    reply = make_reply(G[~bad], (), constraint)  # drops the non-finite rows, counts the others
    nonfinite = [i for i in range(len(G)) if not bad[i] and not ok[i]]
    kept = [i for i in range(len(G)) if not bad[i] and ok[i]]
    assert reply.failed == len(nonfinite) and reply.contribution.count == len(kept)
    return UserRows(reply.contribution, kept, nonfinite, dict(raised))


# -- Flower's own DP wrappers and mods ------------------------------------------------------------
_MODS = ("fixedclipping_mod", "adaptiveclipping_mod", "LocalDpMod")


def flower_dp_name(obj: Any) -> str | None:
    """The name of a Flower DP strategy wrapper or client mod (``obj`` one of them, or its
    class), else None: a class of ``flwr`` whose name (or a base's) starts with
    ``DifferentialPrivacy``, ``LocalDpMod``, or the functions ``fixedclipping_mod`` /
    ``adaptiveclipping_mod``.

    Parameters
    ----------
    obj : Any

    Returns
    -------
    str or None
    """
    cls = obj if isinstance(obj, type) else type(obj)
    for c in getattr(cls, "__mro__", ()):
        mod = str(getattr(c, "__module__", ""))
        if mod.startswith("flwr") and (
            c.__name__.startswith("DifferentialPrivacy") or c.__name__ in _MODS
        ):
            return cls.__name__
    if callable(obj) and str(getattr(obj, "__module__", "")).startswith("flwr"):
        name = str(getattr(obj, "__name__", ""))
        if name in _MODS:
            return name
    return None


def _refusal(name: str, where: str) -> str:
    return (
        f"UserLevelDP: Flower's {name} is stacked {where} fedudp's user-level DP; it would clip "
        "and noise a second time, outside fedudp's ledger: remove it (UserLevelDP and "
        "user_level_mod clip, noise and account on their own)"
    )


def stacked_strategy(strategy: Any, depth: int = 8) -> str | None:
    """Why ``strategy`` (the one ``UserLevelDP`` wraps), or one it wraps (``.strategy``), is a
    Flower DP wrapper (None: none is).

    Parameters
    ----------
    strategy : Any
    depth : int, default 8
        How many ``.strategy`` levels are followed.

    Returns
    -------
    str or None
        The one-line refusal; None when there is nothing to refuse.
    """
    s = strategy
    for _ in range(depth):
        if s is None:
            return None
        name = flower_dp_name(s)
        if name is not None:
            return _refusal(name, "inside")
        s = getattr(s, "strategy", None)
    return None


def outer_wrapper(me: Any, depth: int = 16) -> str | None:
    """Why the call stack of ``me``'s method shows a Flower DP wrapper calling it (a strategy
    wrapped around ``UserLevelDP``), None if it shows none. Frames' ``self`` only.

    Parameters
    ----------
    me : Any
        The ``UserLevelDP``.
    depth : int, default 16
        How many frames are looked at.

    Returns
    -------
    str or None
        The one-line refusal; None when there is nothing to refuse.
    """
    f = sys._getframe(1)
    for _ in range(depth):
        f = f.f_back  # type: ignore[assignment]
        if f is None:
            return None
        caller = f.f_locals.get("self")
        if caller is not None and caller is not me:
            name = flower_dp_name(caller)
            if name is not None:
                return _refusal(name, "around")
    return None


def _chain(fn: Any, depth: int, limit: int = 2000) -> Iterator[Any]:
    """The objects reachable from a mod chain's callable: closure cells (Flower's ``make_ffn``
    keeps the next mod and callable there), ``__wrapped__``, a bound method's ``__self__``;
    each once, at most ``depth`` links deep and ``limit`` objects in all."""
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = [(fn, depth)]
    while todo and len(seen) < limit:
        o, d = todo.pop()
        if o is None or d <= 0 or id(o) in seen or not callable(o):
            continue
        seen.add(id(o))
        yield o
        nxt: list[Any] = [getattr(o, "__wrapped__", None), getattr(o, "__self__", None)]
        for cell in getattr(o, "__closure__", None) or ():
            try:
                nxt.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        todo.extend((n, d - 1) for n in nxt)


def stacked_mods(call_next: Callable[..., Any], depth: int = 24) -> str | None:
    """Why the rest of the ClientApp's chain (``call_next``) holds a Flower DP mod (None: it
    holds none).

    Parameters
    ----------
    call_next : callable
    depth : int, default 24

    Returns
    -------
    str or None
        The one-line refusal; None when there is nothing to refuse.
    """
    for o in _chain(call_next, depth):
        name = flower_dp_name(o)
        if name is not None:
            return _refusal(name, "after user_level_mod (it would act on each user) with")
    return None


def foreign_keys(configs: Mapping[str, Any]) -> str | None:
    """Why the training message's config records carry another DP wrapper's keys (a Flower
    ``DifferentialPrivacyClientSide*`` wrapper somewhere around the server), None if none.

    Parameters
    ----------
    configs : Mapping[str, Any]
        The training message's config records.

    Returns
    -------
    str or None
        The one-line refusal; None when there is nothing to refuse.
    """
    found: Sequence[str] = sorted(
        {k for key, rec in configs.items() if not str(key).startswith("fedudp.") for k in rec}
        & set(FOREIGN_KEYS)
    )
    if not found:
        return None
    return (
        f"user_level_mod: the training message carries {', '.join(map(repr, found))}, the key "
        "of Flower's DifferentialPrivacyClientSide*Clipping wrapper: a second DP wrapper is "
        "stacked with UserLevelDP (a second clipping and noise, outside fedudp's ledger): "
        "remove it"
    )
