"""The clients' replies to one ``UserLevelDP`` training round, checked and read
(``fedudp.flower.strategy``).

A reply that has an error, lacks the mod's records, or holds a contribution that cannot be
right (neither ``sum`` nor ``rows``, the wrong length, a NaN/inf value) fails its client: it
contributes exactly zero against the public denominator, as a failed owner does on fedudp's own
engine, and its reason is logged. The others become ``Contribution``s for the estimator, with
the users each client holds (what the fail-closed rule counts) and the users it dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Message
from flwr.common import log

from fedudp.flower.wire import K_CONTRIB, K_COUNTS, error_reason, to_numpy, user_metrics
from fedudp.protocol.contributions import Contribution

__all__ = ["Collected", "collect", "bad_contribution"]


@dataclass
class Collected:
    """What a training round's replies hold.

    Attributes
    ----------
    parts : list[Contribution]
        One per client that replied usably.
    failed : int
        Clients failed (an error, missing records, an impossible contribution).
    held : int
        The users the usable clients declare (the fail-closed rule's count).
    nonfinite, raised : int
        Users the clients dropped for a non-finite update and for a step that raised.
    train_metrics : list[tuple[float, dict[str, float]]]
        The app's training metrics per client (weight, values).
    """

    parts: list[Contribution] = field(default_factory=list)
    failed: int = 0
    held: int = 0
    nonfinite: int = 0
    raised: int = 0
    train_metrics: list[tuple[float, dict[str, float]]] = field(default_factory=list)


def bad_contribution(rec: Any, dim: int) -> str | None:
    """Why a client's contribution record cannot be right (None: it can).

    Parameters
    ----------
    rec : flwr.app.ArrayRecord
        The reply's ``K_CONTRIB`` record.
    dim : int
        The number of shared values.

    Returns
    -------
    str or None
        Neither ``sum`` nor ``rows``, the wrong length, or a NaN/inf value; None if none.
    """
    key = "rows" if "rows" in rec else "sum" if "sum" in rec else None
    if key is None:
        return f"{K_CONTRIB} holds neither 'sum' nor 'rows'"
    a = np.asarray(to_numpy(rec[key]))
    ok_shape = a.shape == (dim,) if key == "sum" else a.ndim == 2 and a.shape[1] == dim
    if not ok_shape:
        return f"{K_CONTRIB}['{key}'] has shape {a.shape}, the shared parameters are {dim} values"
    if not np.isfinite(a).all():
        return f"{K_CONTRIB}['{key}'] is not finite"
    return None


def _failure(r: Message, dim: int) -> str | None:
    """Why reply ``r`` fails its client (None: it is usable)."""
    if r.has_error():
        return f"error {r.error.code}: {error_reason(r.error.reason)}"
    if K_CONTRIB not in r.content or K_COUNTS not in r.content:
        return (
            f"no {K_CONTRIB} / {K_COUNTS} in the reply (is fedudp.flower."
            "user_level_mod in the ClientApp's mods?)"
        )
    if "users" not in r.content[K_COUNTS]:
        return f"no users count in {K_COUNTS} (a user_level_mod older than this server)"
    return bad_contribution(r.content[K_CONTRIB], dim)


def collect(replies: Sequence[Message], dim: int, server_round: int) -> Collected:
    """The round's usable contributions, counts and metrics (failed clients logged).

    Parameters
    ----------
    replies : Sequence[flwr.app.Message]
        The clients' replies to the round's training messages.
    dim : int
        The number of shared values.
    server_round : int
        The round (the log's).

    Returns
    -------
    Collected
    """
    out = Collected()
    for r in replies:
        why = _failure(r, dim)
        if why is not None:  # contributes exactly zero against the public denominator
            out.failed += 1
            log(
                WARNING,
                "UserLevelDP round %s: client node %s failed: %s",
                server_round,
                r.metadata.src_node_id,
                why,
            )
            continue
        _read(r, dim, server_round, out)
    return out


def _read(r: Message, dim: int, server_round: int, out: Collected) -> None:
    """A usable reply into ``out``."""
    # the mod's own records (train_round): their keys' types are the ones written there
    rec: Any = r.content[K_CONTRIB]
    counts: Any = r.content[K_COUNTS]
    if "metrics" in r.content.metric_records:  # the app's, over the client's users
        out.train_metrics.append(user_metrics(r))
    out.held += int(counts["users"])
    n = int(counts["count"])
    # the users the client dropped (a NaN/inf update, a step that raised): zero, uncounted
    out.nonfinite += int(counts.get("failed", 0))
    out.raised += int(counts.get("raised", 0))
    if counts.get("failed", 0) or counts.get("raised", 0):
        log(
            WARNING,
            "UserLevelDP round %s: client node %s dropped %s user(s) with a non-finite "
            "update and %s whose training step raised (each contributes zero; the "
            "reasons are in that client's log)",
            server_round,
            r.metadata.src_node_id,
            int(counts.get("failed", 0)),
            int(counts.get("raised", 0)),
        )
    if "rows" in rec:
        G = torch.from_numpy(np.asarray(rec["rows"].numpy(), dtype=np.float64))
        out.parts.append(Contribution(G.reshape(-1, dim), None, n, int(counts["clipped"])))
    else:
        t = torch.from_numpy(np.asarray(rec["sum"].numpy(), dtype=np.float64))
        out.parts.append(Contribution(None, t.reshape(dim), n, int(counts["clipped"])))
