"""What crosses the owner -> billboard boundary (docs/architecture.md#the-owner-boundary).

An ``OwnerReply`` carries shared-parameter vectors only: ``param_names`` lists the shared
parameters the vectors concatenate (in order), ``contribution`` the rows or the clipped sum the
aggregator's ``Constraint`` asked for; personal parameters have no field here. Owners build
replies with ``make_reply`` and the billboard consumes nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from fedudp.privacy.mechanisms import row_norms64
from fedudp.protocol.contributions import Constraint, Contribution, finite_rows

__all__ = [
    "Failure",
    "make_reply",
    "OwnerFailure",
    "OwnerReply",
    "Raised",
    "raised_metrics",
    "rows_reply",
]


class OwnerFailure(Exception):
    """An owner could not take part in a round (its infrastructure, not a bug in fedudp): the
    billboard excludes it from that round's release and records the reason. The message
    carries ``TAG`` so that the billboard recognizes it in a Flower error reply.

    Parameters
    ----------
    reason : str
        Why the owner could not take part.
    """

    TAG = "[fedudp.OwnerFailure]"

    def __init__(self, reason: str) -> None:
        super().__init__(f"{self.TAG} {reason}")


@dataclass(frozen=True)
class Failure:
    """An owner excluded from a round: ``units`` of its sampled units did not contribute.

    Parameters
    ----------
    owner : int
        The owner.
    units : int
        Its sampled units that did not contribute.
    reason : str
        Why.
    """

    owner: int
    units: int
    reason: str


@dataclass(frozen=True)
class Raised:
    """Users of one owner dropped from a round because their training step raised
    (``fedudp.owner.isolate``): ``owner`` (global id), how many ``users``, their one-line
    ``reasons``.

    Parameters
    ----------
    owner : int
        The owner.
    users : int
        Its users dropped.
    reasons : tuple of str
        The exceptions' one-line reasons.
    """

    owner: int
    users: int
    reasons: tuple[str, ...]


@dataclass
class OwnerReply:
    """What an owner sends the billboard for one round.

    Parameters
    ----------
    param_names : tuple of str
        The shared parameters the vectors are of, in order.
    contribution : Contribution
        The constrained rows or their clipped sum and count.
    failed : int, default 0
        Units excluded on the owner for a NaN/inf vector or a raise (a diagnostic).
    raised : tuple of Raised, default ()
        Users dropped for a step that raised, per owner.
    """

    param_names: tuple[str, ...]
    contribution: Contribution
    failed: int = 0  # units excluded on the owner for a NaN/inf vector or a raise (diagnostic)
    raised: tuple[Raised, ...] = ()  # users dropped for a step that raised, per owner


def raised_metrics(replies: Iterable[OwnerReply]) -> dict:
    """A round's ``raised_users`` (how many users were dropped because their step raised) and
    ``raised`` (per owner: ``owner``, ``raised_users``, ``reasons``); empty where none was.

    Parameters
    ----------
    replies : iterable of OwnerReply
        The round's replies.

    Returns
    -------
    dict
        ``raised_users`` and ``raised``, or empty.
    """
    got = [r for rep in replies for r in rep.raised]
    if not got:
        return {}
    return {
        "raised_users": sum(r.users for r in got),
        "raised": [
            {"owner": r.owner, "raised_users": r.users, "reasons": list(r.reasons)} for r in got
        ],
    }


def make_reply(
    G: torch.Tensor,
    names: tuple[str, ...],
    constraint: Constraint,
    weights: np.ndarray | None = None,
    owned: bool = False,
) -> OwnerReply:
    """Drop non-finite rows (they contribute zero; docs/architecture.md#failures), then apply the
    aggregator's owner-side constraint (rows, or the sum of clipped rows and a count).
    ``weights``: owner-level updates averaged by weight (the rows are scaled before summing).
    ``owned``: G is the caller's scratch buffer, which may be overwritten (clipped in place).

    Float32 rows to be clipped are screened by their float64 norms, computed once for both: a
    float32 row is finite exactly when the float64 sum of its squares is (no float32 square
    overflows float64), so no element-wise mask of G is made.

    Parameters
    ----------
    G : torch.Tensor
        The owner's units' vectors, [n, d].
    names : tuple of str
        The shared parameters the vectors are of.
    constraint : Constraint
        The aggregator's owner side.
    weights : numpy.ndarray or None, default None
        Per-row weights of owner-level updates (None: unweighted).
    owned : bool, default False
        ``G`` may be overwritten (clipped in place).

    Returns
    -------
    OwnerReply
        The reply (non-finite rows counted in ``failed``).
    """
    norms = None
    if (
        weights is None
        and not constraint.rows
        and constraint.clip is not None
        and G.dtype in (torch.float32, torch.float16, torch.bfloat16)
    ):
        norms = row_norms64(G)
        ok = torch.isfinite(norms).to(G.device)
    else:
        ok = finite_rows(G)
    failed = int((~ok).sum())
    if failed:
        G = G[ok]
        norms = None if norms is None else norms[ok.cpu()]
    if weights is None:
        return OwnerReply(names, constraint.apply(G, norms, inplace=owned and not failed), failed)
    w = np.asarray(weights, dtype=np.float64)[ok.cpu().numpy()]
    c = constraint.apply(G * torch.from_numpy(w).to(G.device, G.dtype).unsqueeze(1))
    c.weight = float(w.sum())
    return OwnerReply(names, c, failed)


def rows_reply(
    chunks: Iterable[torch.Tensor],
    units: int,
    dim: int,
    dtype: torch.dtype,
    names: tuple[str, ...],
    device: torch.device | None = None,
) -> OwnerReply:
    """The reply of an aggregator that takes rows (``Constraint(rows=True)``), from the row
    chunks of at most ``units`` units as the owners compute them: each chunk's finite rows are
    written, in order, into one [units, dim] matrix allocated up front, so the rows are held
    once (not a list of chunks and then their concatenation, ``Contribution.merge``). Non-finite
    rows are dropped (they contribute zero, as in ``make_reply``) and counted in ``failed``.
    ``device``: where the matrix lives (the chunks', ``engine_opts.device``; None: the CPU).

    Parameters
    ----------
    chunks : iterable of torch.Tensor
        The row chunks, in order.
    units : int
        At most this many units.
    dim : int
        The vectors' length.
    dtype : torch.dtype
        The matrix's dtype.
    names : tuple of str
        The shared parameters the vectors are of.
    device : torch.device or None, default None
        Where the matrix lives (None: the CPU).

    Returns
    -------
    OwnerReply
        The reply of the finite rows (the others counted in ``failed``).

    Raises
    ------
    ValueError
        When the chunks hold more rows than ``units``.
    """
    out = torch.empty(units, dim, dtype=dtype, device=device)
    at = failed = 0
    for G in chunks:
        ok = finite_rows(G)
        bad = int((~ok).sum())
        if bad:
            G, failed = G[ok], failed + bad
        if at + len(G) > units:
            raise ValueError(f"rows_reply: more than the {units} units' rows announced")
        out[at : at + len(G)].copy_(G)
        at += len(G)
    return OwnerReply(names, Constraint(rows=True).apply(out[:at]), failed)
