"""The files of a run's tracking (``fedudp.tracking``), beside the run folder's own: the state
file that names the tracked run (``tracking.json``), the sweep folder's lock, the embedded MLflow
store (a SQLite database and its artifacts folder), the run folder's files logged as artifacts,
and the flattening of a config or a metrics line into dotted keys. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "STATE_FILE",
    "TB_DIR",
    "STORE_FILE",
    "ARTIFACTS_DIR",
    "ARTIFACT_FILES",
    "clear",
    "flatten",
    "numeric",
    "param_value",
    "read_state",
    "write_state",
    "locked",
    "quiet_store_logs",
    "probe_sqlite",
    "embedded_uri",
    "artifacts",
]

STATE_FILE = "tracking.json"  # in a run folder: the MLflow run (or TensorBoard folder) of it
TB_DIR = "tb"  # TensorBoard event files of a run
STORE_FILE = "mlflow.db"  # the embedded MLflow store (SQLite)
ARTIFACTS_DIR = "mlartifacts"  # the embedded store's artifacts, beside it
# the run folder's files logged as artifacts at the end (plus every *.png / *.md there)
ARTIFACT_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "ledger.json",
    "ledger.jsonl",
    "summary.json",
    "owners.csv",
)


def clear(folder: Path) -> None:
    """Forget a run folder's tracking state (a run started afresh gets a new tracked run).

    Parameters
    ----------
    folder : Path
        The run folder (its state file and TensorBoard folder are removed).
    """
    import shutil

    folder = Path(folder)
    (folder / STATE_FILE).unlink(missing_ok=True)
    shutil.rmtree(folder / TB_DIR, ignore_errors=True)


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """``{"train": {"rounds": 3}}`` -> ``{"train.rounds": 3}`` (an empty dict stays a value).

    Parameters
    ----------
    d : Mapping
        A nested dict.
    prefix : str, default ""
        Put before every key.

    Returns
    -------
    dict[str, Any]
        Dotted keys to the leaf values.
    """
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def numeric(d: dict) -> dict[str, float]:
    """The finite numbers of a (flattened) dict as floats; booleans as 0/1.

    Parameters
    ----------
    d : dict
        A dict, nested or flat.

    Returns
    -------
    dict[str, float]
        Its finite numbers under dotted keys.
    """
    out = {}
    for k, v in flatten(d).items():
        if isinstance(v, bool):
            v = float(v)
        if isinstance(v, (int, float)) and math.isfinite(v):
            out[k] = float(v)
    return out


def param_value(v: Any) -> str:
    """``v`` as an MLflow parameter value: a string, JSON otherwise, cut at MLflow's limit.

    Parameters
    ----------
    v : Any
        A parameter's value.

    Returns
    -------
    str
        At most 6000 characters.
    """
    text = v if isinstance(v, str) else json.dumps(v)
    return text[:6000]  # MLflow's limit on a parameter value


def read_state(path: Path) -> dict:
    """The state file at ``path`` (``{}`` when missing, unreadable or not a JSON object).

    Parameters
    ----------
    path : Path
        The state file.

    Returns
    -------
    dict
    """
    try:
        state = json.loads(path.read_text())
        return state if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}


def write_state(path: Path, state: dict) -> None:
    """Write the state file at ``path`` atomically (a temporary file, then a rename).

    Parameters
    ----------
    path : Path
        The state file.
    state : dict
        What it holds (JSON).
    """
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``folder`` (a sweep's jobs may run in parallel processes).

    Parameters
    ----------
    folder : Path
        The folder whose ``.tracking.lock`` is locked.

    Yields
    ------
    None
        While the lock is held (without ``fcntl``: no lock).
    """
    try:
        import fcntl
    except ImportError:  # no fcntl (Windows): jobs of one sweep run one at a time there
        yield
        return
    with open(folder / ".tracking.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def quiet_store_logs() -> None:
    """MLflow's and Alembic's INFO lines while an embedded store creates its tables."""
    for name in ("mlflow.store.db.utils", "alembic", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)


def probe_sqlite(uri: str) -> None:
    """A SQLite store that cannot be opened for writing fails here at once (MLflow retries
    opening a database with backoff for about 100 s before it gives up).

    Parameters
    ----------
    uri : str
        A tracking URI (only ``sqlite:///`` files are probed).

    Raises
    ------
    OSError
        When the SQLite store cannot be opened for writing.
    """
    if not uri.startswith("sqlite:///"):
        return
    path = uri[len("sqlite:///") :].split("?", 1)[0]
    if path in ("", ":memory:"):
        return
    import sqlite3

    try:
        con = sqlite3.connect(path, timeout=10)
        try:
            con.execute("BEGIN IMMEDIATE")  # takes the write lock: a read-only store fails
            con.execute("ROLLBACK")
        finally:
            con.close()
    except sqlite3.Error as e:
        raise OSError(f"cannot write the SQLite store {path}: {e}") from None


def embedded_uri(folder: Path) -> str:
    """The URI of the embedded MLflow store in ``folder`` (``sqlite:///<folder>/mlflow.db``).

    Parameters
    ----------
    folder : Path
        The folder of the store.

    Returns
    -------
    str
    """
    return f"sqlite:///{(folder / STORE_FILE).absolute()}"


def artifacts(out: Path) -> list[Path]:
    """The files of run folder ``out`` logged as artifacts: ``ARTIFACT_FILES`` and its plots and
    tables (``*.png``, ``*.md``).

    Parameters
    ----------
    out : Path
        The run folder.

    Returns
    -------
    list[Path]
        The files that exist, ``ARTIFACT_FILES`` first.
    """
    files = [out / n for n in ARTIFACT_FILES if (out / n).is_file()]
    return files + sorted(p for p in out.iterdir() if p.is_file() and p.suffix in (".png", ".md"))
