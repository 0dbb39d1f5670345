"""``ledger.jsonl``, durable: a release is on disk before it leaves the billboard
(docs/usage.md#checkpoint-and-resume).

The file is a head line (the ledger without its entries) and one line per release, in the order
the releases were composed. ``LedgerFile.append`` is the billboard's ledger sink
(``Billboard.ledger_sink``): it writes the entry's line, flushes and fsyncs before the billboard
steps and broadcasts the shared parameters, so a run killed at any point has every release it
made in its ledger (a line cut short by the kill is a release that never left). A resumed run
reads the file (``read``) to find the releases made after its checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fedudp.aggregators.base import Aggregate
from fedudp.plain import jsonable
from fedudp.privacy.accountant import Ledger, LedgerEntry
from fedudp.protocol.checkpoint import atomic_write

__all__ = [
    "after_checkpoint",
    "head",
    "LedgerFile",
    "read",
    "release_digest",
    "Resumed",
    "write",
]


def release_digest(agg: Aggregate) -> str:
    """SHA-256 of what a release puts out: the released mean's dtype, shape and bytes, and
    whether the estimator halted (a re-release is the same release exactly when it is equal).

    Parameters
    ----------
    agg : Aggregate
        The release.

    Returns
    -------
    str
        The hex SHA-256.
    """
    mean = agg.mean.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{mean.dtype}|{tuple(mean.shape)}|{bool(agg.halted)}|".encode())
    h.update(mean.reshape(-1).view(torch.uint8).numpy().tobytes() if mean.numel() else b"")
    return h.hexdigest()


def head(ledger: Ledger) -> dict[str, Any]:
    """``ledger.jsonl``'s head line: the ledger without its entries and what they give (its ε,
    the rounds released).

    Parameters
    ----------
    ledger : Ledger
        The run's ledger.

    Returns
    -------
    dict
        The head line's fields.
    """
    derived = ("entries", "epsilon", "rounds_released")
    return {k: v for k, v in ledger.to_dict().items() if k not in derived}


def _line(d: dict[str, Any]) -> str:
    return json.dumps(jsonable(d)) + "\n"


@dataclass
class LedgerFile:
    """Appends ledger entries to ``path``, each one flushed and fsynced before ``append``
    returns. ``written``: the entries the file holds after its head.

    Parameters
    ----------
    path : pathlib.Path
        The ``ledger.jsonl`` file.
    written : int, default 0
        The entries it holds after its head.
    """

    path: Path
    written: int = 0

    def append(self, entry: LedgerEntry) -> None:
        """Write ``entry``'s line durably (the billboard calls this before its release leaves).

        Parameters
        ----------
        entry : LedgerEntry
            The release's entry.
        """
        self.extend([entry])

    def extend(self, entries: list[LedgerEntry]) -> None:
        """Write ``entries``' lines durably, in one flush and fsync.

        Parameters
        ----------
        entries : list of LedgerEntry
            The entries, in order.
        """
        if not entries:
            return
        with open(self.path, "a") as f:
            f.write("".join(_line(e.as_dict()) for e in entries))
            f.flush()
            os.fsync(f.fileno())
        self.written += len(entries)


def write(path: Path, head: dict[str, Any], entries: list[LedgerEntry]) -> None:
    """Replace ``path`` atomically with ``head`` and ``entries`` (a new or resumed run).

    Parameters
    ----------
    path : pathlib.Path
        The ``ledger.jsonl`` file.
    head : dict
        Its head line.
    entries : list of LedgerEntry
        Its entries.
    """
    atomic_write(
        Path(path), "".join([_line(head)] + [_line(e.as_dict()) for e in entries]).encode()
    )


def read(path: Path) -> tuple[dict[str, Any], list[LedgerEntry]]:
    """(head, entries) of a ``ledger.jsonl``; a last line cut short (the process was killed while
    writing it, before the release left) is left out. ``ValueError`` naming the file for any
    other damage.

    Parameters
    ----------
    path : pathlib.Path
        The ``ledger.jsonl`` file.

    Returns
    -------
    tuple of (dict, list of LedgerEntry)
        The head and the entries.

    Raises
    ------
    ValueError
        Any damage but a last line cut short (naming the file).
    """
    lines = Path(path).read_text().splitlines()
    if not lines:
        raise ValueError(f"{path}: empty (no head line)")
    out: list[dict[str, Any]] = []
    for i, text in enumerate(lines):
        try:
            out.append(json.loads(text))
        except json.JSONDecodeError:
            if i == len(lines) - 1 and i > 0:
                break  # written when the process died: that release never left
            raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    head, rows = out[0], out[1:]
    try:
        entries = [LedgerEntry(**d) for d in rows]
    except TypeError as e:
        raise ValueError(f"{path}: not a ledger entry ({e})") from None
    return head, entries


def _key(e: LedgerEntry) -> tuple:
    return (e.round, e.event, e.release_sha256, e.superseded)


@dataclass
class Resumed:
    """What a resumed run's ledger holds beyond its checkpoint (``after_checkpoint``).

    ``composed``: releases made after the checkpoint that the resumed run composes (marked
    ``superseded``; every one of a secure run); ``rereleases``: those of a seeded run that its
    re-done rounds release again identically (by SHA-256) unless they differ
    (``Billboard.rereleases``); ``record``: the line ``ledger.jsonl``'s head keeps about it
    (``extra.resumes``), None where nothing was released after the checkpoint or every such
    release may come again identically.

    Parameters
    ----------
    composed : list of LedgerEntry
        Releases after the checkpoint that the resumed run composes.
    rereleases : list of LedgerEntry
        Those of a seeded run that its re-done rounds may release again identically.
    record : dict or None
        The line the head keeps about them (None: nothing to record).
    """

    composed: list[LedgerEntry]
    rereleases: list[LedgerEntry]
    record: dict[str, Any] | None


def after_checkpoint(
    path: Path, checkpoint_entries: list[LedgerEntry], round_: int, secure: bool
) -> Resumed:
    """The releases ``path`` (a killed run's ``ledger.jsonl``) holds after the checkpoint of
    round ``round_`` whose billboard had ``checkpoint_entries``. Each was made (ledger lines are
    durable before their release leaves), so none is dropped: with ``secure`` randomness (fresh
    noise and sample on every draw) or without a recorded SHA-256, each is composed; a seeded
    run's may be released again identically, which ``Billboard.release`` checks.
    ``ValueError`` (naming the file) where the file does not begin with the checkpoint's
    releases.

    Parameters
    ----------
    path : pathlib.Path
        The killed run's ``ledger.jsonl``.
    checkpoint_entries : list of LedgerEntry
        The checkpoint's billboard's entries.
    round_ : int
        The checkpoint's round.
    secure : bool
        The run's randomness is fresh on every draw.

    Returns
    -------
    Resumed
        What the file holds beyond the checkpoint.

    Raises
    ------
    ValueError
        The file does not begin with the checkpoint's releases (naming it).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: missing (the run's releases cannot be counted)")
    _, entries = read(path)
    n = len(checkpoint_entries)
    if [_key(e) for e in entries[:n]] != [_key(e) for e in checkpoint_entries]:
        raise ValueError(
            f"{path}: does not begin with the {n} releases of the checkpoint of round "
            f"{round_} (edited, or another run's)"
        )
    after = entries[n:]
    again: dict[int, LedgerEntry] = {}  # a seeded run's, by round (the first release of each)
    composed = []
    for e in after:
        if secure or e.superseded or e.release_sha256 is None or e.round in again:
            composed.append(replace(e, superseded=True))
        else:
            again[e.round] = e
    record = None
    if composed:
        record = {
            "resumed_at_round": int(round_),
            "releases_after_checkpoint": len(after),
            "composed": len(composed),
            "rounds": sorted({int(e.round) for e in composed}),
            "randomness": "secure" if secure else "seeded (simulation)",
            "note": (
                f"resumed at round {round_}, {len(composed)} release(s) made after the "
                "checkpoint composed (superseded: true)"
            ),
        }
    return Resumed(composed, list(again.values()), record)
