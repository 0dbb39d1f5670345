"""What produced a run: the fedudp version (from the installed package's metadata) and, where
the package is imported from a git checkout, the source commit and whether the checkout was
modified. Standard library only (``fedudp --version`` and every run folder read it)."""

from __future__ import annotations

import subprocess
from functools import lru_cache
from pathlib import Path

__all__ = [
    "ROOT",
    "version",
    "source",
    "provenance",
]

ROOT = Path(__file__).resolve().parents[1]  # the checkout (or site-packages) above fedudp/


@lru_cache(maxsize=1)
def version() -> str:
    """The installed distribution's version (``pyproject.toml``'s ``version``); ``0+unknown``
    when fedudp is imported without being installed.

    Returns
    -------
    str
    """
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("fedudp")
    except PackageNotFoundError:
        return "0+unknown"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def source() -> dict:
    """``{"commit": sha or None, "modified": bool or None}``: the commit of the checkout fedudp
    is imported from, and whether its tracked files differ from that commit (None for both
    where fedudp is not imported from a git checkout, e.g. an installed wheel).

    Returns
    -------
    dict
    """
    if not (ROOT / ".git").exists() or not (ROOT / "fedudp" / "provenance.py").is_file():
        return {"commit": None, "modified": None}
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": head.strip() if head else None,
        "modified": None if status is None else bool(status.strip()),
    }


def provenance() -> dict:
    """What a run folder records: ``fedudp_version`` and ``source`` (commit, modified).

    Returns
    -------
    dict
        ``{"fedudp_version": ..., "source": {"commit": ..., "modified": ...}}``.
    """
    return {"fedudp_version": version(), "source": source()}
