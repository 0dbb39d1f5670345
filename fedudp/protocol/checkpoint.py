"""Checkpoints of the round loop: atomic, checksummed, the last few kept
(docs/architecture.md#checkpoints-and-stops).

``fedudp.billboard.rounds.run_rounds`` writes one after every ``checkpoint.every``-th completed
round: the billboard's state (shared parameters, the released ledger entries from which the
accountant is recomposed event by event, the aggregator's own state and RNG), the transport's
(the local engine's stacked personal parameters; for ``engine=flower`` the round whose files
the owners wrote themselves, ``ckpt-<round>.owners/owner-<j>.pt``), the round index and the
metrics so far. Every other random stream is keyed by (seed, purpose, round, ...)
(``fedudp.randomness``), so nothing else needs saving.

File format: ``MAGIC``, the SHA-256 of the payload, the payload (``torch.save`` of plain types
and tensors, loaded with ``weights_only=True``). Written to a temporary file, fsynced, renamed
over ``ckpt-<round:06d>.pt`` and the folder fsynced: a crash leaves the previous checkpoint or
the new one, never half of one; a damaged file fails its checksum and the previous one is used.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "KEEP_AFTER_FINISH",
    "MAGIC",
    "atomic_write",
    "block_file",
    "Checkpointer",
    "CheckpointError",
    "ckpt_path",
    "dump",
    "fsync_dir",
    "keep_after_finish",
    "load_bytes",
    "load_file",
    "load_owners_personal",
    "save_owners_personal",
    "owner_file",
    "owner_state_files",
    "owners_dir",
    "plain",
    "remove_all",
    "rounds_on_disk",
    "warn",
]

MAGIC = b"FEDUDP-CKPT-1\n"
_NAME = re.compile(r"^ckpt-(\d{6,})\.pt$")
_OWNERS = re.compile(r"^ckpt-(\d{6,})\.owners$")


class CheckpointError(Exception):
    """A checkpoint file cannot be used (damaged, truncated, another run's); says why."""


def ckpt_path(folder: Path, round_: int) -> Path:
    """The checkpoint file of round ``round_`` in ``folder``.

    Parameters
    ----------
    folder : pathlib.Path
        The run folder's checkpoint folder.
    round_ : int
        The round.

    Returns
    -------
    pathlib.Path
        The file's path.
    """
    return Path(folder) / f"ckpt-{round_:06d}.pt"


def owners_dir(folder: Path, round_: int) -> Path:
    """Where the owners of a Flower run write their own personal state for a checkpoint.

    Parameters
    ----------
    folder : pathlib.Path
        The checkpoint folder.
    round_ : int
        The round.

    Returns
    -------
    pathlib.Path
        The owners' folder of that round.
    """
    return Path(folder) / f"ckpt-{round_:06d}.owners"


def owner_file(folder: Path | str, owner: int) -> Path:
    """The file of one owner's personal state in an owners' folder.

    Parameters
    ----------
    folder : pathlib.Path or str
        The owners' folder.
    owner : int
        The owner's id.

    Returns
    -------
    pathlib.Path
        The file's path.
    """
    return Path(folder) / f"owner-{owner}.pt"


def block_file(folder: Path | str, first: int, last: int) -> Path:
    """The file of a block of owners' personal state (owners ``first`` .. ``last``, stacked in
    that order: one engine=flower node holding several owners writes one file).

    Parameters
    ----------
    folder : pathlib.Path or str
        The owners' folder.
    first, last : int
        The block's first and last owner ids.

    Returns
    -------
    pathlib.Path
        The file's path.
    """
    return Path(folder) / f"owners-{first}-{last}.pt"


_OWNER_FILE = re.compile(r"^owner-(\d+)\.pt$")
_BLOCK_FILE = re.compile(r"^owners-(\d+)-(\d+)\.pt$")


def owner_state_files(folder: Path | str) -> dict[int, tuple[Path, int]]:
    """Where each owner's personal state is in an owners' folder: owner -> (file, its row in
    the file's stacked parameters), from ``owner-<j>.pt`` (row 0) and ``owners-<a>-<b>.pt``
    files (rows 0 .. b - a).

    Parameters
    ----------
    folder : pathlib.Path or str
        The owners' folder (missing: none).

    Returns
    -------
    dict of int to (pathlib.Path, int)
    """
    out: dict[int, tuple[Path, int]] = {}
    folder = Path(folder)
    if not folder.is_dir():
        return out
    for p in sorted(folder.iterdir()):
        if m := _OWNER_FILE.match(p.name):
            out[int(m.group(1))] = (p, 0)
        elif m := _BLOCK_FILE.match(p.name):
            a, b = int(m.group(1)), int(m.group(2))
            out.update({j: (p, j - a) for j in range(a, b + 1)})
    return out


def load_owners_personal(folder: Path | str, owners: Sequence[int]) -> dict:
    """The personal parameters of ``owners`` from an owners' folder, stacked in that order
    (each file read once, whichever blocks wrote them).

    Parameters
    ----------
    folder : pathlib.Path or str
        The owners' folder.
    owners : sequence of int
        The owner ids.

    Returns
    -------
    dict of str to torch.Tensor
        ``[len(owners), ...]`` each.

    Raises
    ------
    CheckpointError
        An owner without a state file, or a file that does not load.
    """
    where = owner_state_files(folder)
    files: dict[Path, dict] = {}
    rows = []
    for j in owners:
        if j not in where:
            raise CheckpointError(f"no state file for owner {j} in {folder}")
        path, row = where[j]
        if path not in files:
            files[path] = load_file(path)["personal"]
        rows.append({k: v[row : row + 1] for k, v in files[path].items()})
    if len(rows) == 1:
        return rows[0]
    return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}


def save_owners_personal(folder: Path | str, block: range, personal: dict) -> Path:
    """Write the personal parameters of the owners ``block`` (stacked in that order) as one
    state file: ``owner-<j>.pt`` for one owner, ``owners-<a>-<b>.pt`` for a block; one atomic
    write (``atomic_write``).

    Parameters
    ----------
    folder : pathlib.Path or str
        The owners' folder.
    block : range
        The owners, consecutive.
    personal : dict of str to torch.Tensor
        ``[len(block), ...]`` each.

    Returns
    -------
    pathlib.Path
        The file written.
    """
    path = (
        owner_file(folder, block[0]) if len(block) == 1 else block_file(folder, block[0], block[-1])
    )
    atomic_write(path, dump({"personal": personal}))
    return path


def dump(state: dict) -> bytes:
    """Checkpoint bytes: magic, SHA-256 of the payload, payload.

    Parameters
    ----------
    state : dict
        The checkpoint's state.

    Returns
    -------
    bytes
        The checkpoint's bytes.
    """
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    return MAGIC + hashlib.sha256(payload).digest() + payload


def load_bytes(data: bytes) -> dict:
    """Inverse of ``dump``; ``CheckpointError`` if the bytes are not an intact checkpoint.

    Parameters
    ----------
    data : bytes
        A checkpoint's bytes.

    Returns
    -------
    dict
        The state.

    Raises
    ------
    CheckpointError
        The bytes are not an intact checkpoint.
    """
    if not data.startswith(MAGIC):
        raise CheckpointError("not a fedudp checkpoint (bad magic)" if data else "empty file")
    head = len(MAGIC)
    digest, payload = data[head : head + 32], data[head + 32 :]
    if len(digest) < 32 or hashlib.sha256(payload).digest() != digest:
        raise CheckpointError("checksum mismatch (truncated or damaged)")
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as e:  # noqa: BLE001  (any unpickling error: unusable)
        raise CheckpointError(f"unreadable payload ({type(e).__name__})") from None
    if not isinstance(state, dict):
        raise CheckpointError("payload is not a checkpoint dict")
    return state


def load_file(path: Path) -> dict:
    """``load_bytes`` of a file.

    Parameters
    ----------
    path : pathlib.Path
        The checkpoint file.

    Returns
    -------
    dict
        The state.

    Raises
    ------
    CheckpointError
        The file is not an intact checkpoint.
    """
    try:
        return load_bytes(Path(path).read_bytes())
    except OSError as e:
        raise CheckpointError(e.strerror or str(e)) from None


def atomic_write(path: Path, data: bytes) -> None:
    """Temporary file in the same folder, fsync, rename over ``path``, fsync the folder.

    Parameters
    ----------
    path : pathlib.Path
        The file.
    data : bytes
        Its new content.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Flush a folder's entries to disk (a rename in it is durable).

    Parameters
    ----------
    folder : pathlib.Path
        The folder.
    """
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def rounds_on_disk(folder: Path) -> list[int]:
    """Rounds of the checkpoint files in ``folder``, newest first.

    Parameters
    ----------
    folder : pathlib.Path
        The checkpoint folder.

    Returns
    -------
    list of int
        The rounds, newest first.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = (_NAME.match(p.name) for p in folder.iterdir())
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


def remove_all(folder: Path) -> None:
    """Delete every checkpoint file and owners' folder in ``folder`` (a run started afresh).

    Parameters
    ----------
    folder : pathlib.Path
        The checkpoint folder.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        if _NAME.match(p.name):
            p.unlink(missing_ok=True)
        elif _OWNERS.match(p.name):
            shutil.rmtree(p, ignore_errors=True)


KEEP_AFTER_FINISH = ("none", "last", "all")


def keep_after_finish(folder: Path, policy: str) -> list[int]:
    """Once a run has finished (it is never resumed: re-running it is skipped), keep ``policy``
    of its checkpoints: ``none`` removes every checkpoint file and owners' folder, ``last``
    keeps the newest checkpoint (and its owners' folder), ``all`` leaves what the run kept.
    Returns the rounds whose checkpoints remain.

    Parameters
    ----------
    folder : pathlib.Path
        The checkpoint folder.
    policy : str
        ``checkpoint.keep_after_finish``'s value.

    Returns
    -------
    list of int
        The rounds kept.

    Raises
    ------
    ValueError
        When ``policy`` is not one of ``none``, ``last``, ``all``.
    """
    if policy not in KEEP_AFTER_FINISH:
        raise ValueError(f"keep_after_finish: one of {KEEP_AFTER_FINISH}, got {policy!r}")
    folder = Path(folder)
    if policy == "none":
        remove_all(folder)
    elif policy == "last":
        Checkpointer(folder, keep=1).prune()
    return rounds_on_disk(folder)


def warn(message: str) -> None:
    """Print a checkpoint warning on stderr.

    Parameters
    ----------
    message : str
        The warning.
    """
    print(f"fedudp: warning: {message}", file=sys.stderr, flush=True)


@dataclass
class Checkpointer:
    """Writes the round loop's checkpoints into a run folder and finds the newest usable one.

    ``every``: a checkpoint after every ``every``-th completed round (0: none); ``keep``: how
    many are kept (older ones and their owners' folders are removed after each save);
    ``identity``: a string that must match on load (the run's configuration), so that a
    checkpoint of another run is never used; ``same_identity`` (optional) decides that match
    instead of string equality (a configuration written before a key existed, with that key at
    its default, is the same run). ``resumed`` is the state a resumed run starts from (set by
    ``load_latest``).

    Parameters
    ----------
    folder : pathlib.Path
        The checkpoint folder.
    every : int, default 1
        Write a checkpoint every this many rounds.
    keep : int, default 2
        The newest checkpoints kept.
    identity : str, default ""
        The run's identity a checkpoint must carry.
    resumed : dict or None, default None
        The checkpoint the run resumed from.
    report : callable, default warn
        Where warnings go.
    verify_state : callable or None, default None
        Checks a loaded state (raises ``CheckpointError``).
    same_identity : callable or None, default None
        Decides whether a checkpoint's identity is this run's.
    warned : set
        The warnings already given.
    """

    folder: Path
    every: int = 1
    keep: int = 2
    identity: str = ""
    resumed: dict | None = None
    report: Callable[[str], None] = warn
    verify_state: Callable[[dict], None] | None = field(default=None, repr=False)
    same_identity: Callable[[str], bool] | None = field(default=None, repr=False)
    warned: set = field(default_factory=set, repr=False)

    def due(self, round_: int) -> bool:
        """Whether round ``round_`` writes a checkpoint (every ``every`` rounds).

        Parameters
        ----------
        round_ : int
            The round.

        Returns
        -------
        bool
            True every ``every`` rounds.
        """
        return self.every > 0 and round_ % self.every == 0

    def owners_dir(self, round_: int) -> Path:
        """The owners' folder of round ``round_``.

        Parameters
        ----------
        round_ : int
            The round.

        Returns
        -------
        pathlib.Path
            The folder.
        """
        return owners_dir(self.folder, round_)

    def save(self, round_: int, state: dict) -> Path:
        """Atomically write ``state`` as round ``round_``'s checkpoint, then prune.

        Parameters
        ----------
        round_ : int
            The round.
        state : dict
            Its state.

        Returns
        -------
        pathlib.Path
            The checkpoint file.
        """
        path = ckpt_path(self.folder, round_)
        atomic_write(path, dump({**state, "round": int(round_), "identity": self.identity}))
        self.prune()
        return path

    def prune(self) -> None:
        """Keep the newest ``keep`` checkpoints; drop older ones and every owners' folder that
        belongs to no kept checkpoint (also one written for a round that was abandoned)."""
        kept = set(rounds_on_disk(self.folder)[: max(self.keep, 1)])
        for p in Path(self.folder).iterdir():
            m = _NAME.match(p.name) or _OWNERS.match(p.name)
            if m and int(m.group(1)) not in kept:
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)

    def _verify_owner_files(self, round_: int, state: dict) -> None:
        """A Flower run's checkpoint is usable only with every owner's own file intact."""
        saved = (state.get("transport") or {}).get("owners_saved") or []
        folder = self.owners_dir(round_)
        where, loaded = owner_state_files(folder), set()
        for j in saved:
            path = where.get(j, (owner_file(folder, j), 0))[0]
            if path in loaded:
                continue
            try:
                load_file(path)
            except (CheckpointError, OSError) as e:
                raise CheckpointError(f"owner {j}'s state {path}: {e}") from None
            loaded.add(path)

    def load_latest(self) -> dict | None:
        """The newest checkpoint that loads, checks and belongs to this run; each unusable one
        is reported (naming the file) and the previous one tried. None if there is none."""
        for r in rounds_on_disk(self.folder):
            path = ckpt_path(self.folder, r)
            try:
                state = load_file(path)
                if state.get("round") != r:
                    raise CheckpointError(f"holds round {state.get('round')}, named {r}")
                theirs = state.get("identity")
                same = theirs == self.identity or (
                    self.same_identity is not None
                    and isinstance(theirs, str)
                    and self.same_identity(theirs)
                )
                if not same:
                    raise CheckpointError("written by a run of another configuration")
                self._verify_owner_files(r, state)
                if self.verify_state is not None:
                    self.verify_state(state)
            except CheckpointError as e:
                self.report(f"checkpoint {path} is unusable: {e}; trying the previous one")
                continue
            self.resumed = state
            return state
        return None


def plain(x: Any) -> Any:
    """Python scalars for numpy ones (a checkpoint loads with ``weights_only=True``).

    Parameters
    ----------
    x : Any
        A value, nested containers included.

    Returns
    -------
    Any
        The value with numpy scalars as Python ones.
    """
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, torch.Tensor):
        return x.item()
    return x
