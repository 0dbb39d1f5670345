"""scripts/ is sorted by purpose and every script path the repository cites exists.

(a) Every script lives in ``scripts/benchmarks/``, ``scripts/reproductions/`` or ``scripts/tools/``
    and is listed in ``scripts/README.md``.
(b) Every ``scripts/<folder>/<name>.py`` named in a text file of the repository (code, docs,
    result write-ups; not recorded data such as JSON, whose commands are what ran then, nor a
    path inside another folder such as a worktree of an old commit) is a
    file of the repository, so a moved script cannot leave a stale reference behind.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_repository_links import read_text, repo_files

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("benchmarks", "reproductions", "tools")
DATA = (".json", ".jsonl", ".csv", ".npz", ".png", ".svg")
CITED = re.compile(r"(?<![\w/.-])scripts/[A-Za-z0-9_/]+\.py")  # not inside another path


def test_every_script_is_sorted_and_listed():
    scripts = [f for f in repo_files() if f.startswith("scripts/") and f.endswith(".py")]
    assert scripts, "no scripts found"
    loose = [f for f in scripts if f.split("/")[1] not in FOLDERS]
    assert not loose, f"scripts outside {', '.join(FOLDERS)}: {loose}"
    listing = (ROOT / "scripts" / "README.md").read_text(encoding="utf-8")
    missing = [f for f in scripts if f"({f.removeprefix('scripts/')})" not in listing]
    assert not missing, f"scripts/README.md does not list: {missing}"


def test_cited_script_paths_exist():
    files = set(repo_files())
    bad = []
    for rel in sorted(files):
        if rel.endswith(DATA):
            continue
        text = read_text(rel)
        if text is None:
            continue
        for no, line in enumerate(text.splitlines(), 1):
            bad += [f"{rel}:{no}: {m}" for m in CITED.findall(line) if m not in files]
    assert not bad, "script paths that do not exist (moved? see scripts/README.md):\n" + "\n".join(
        bad[:30]
    )
