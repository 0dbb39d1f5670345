"""Tool: which commits produced the committed results of each docs/results/<name>/ folder?

Answers, from git alone: for each result folder, the commits that added its data files (every
file but the Markdown write-ups: JSON, CSV, PNG, run folders), first and last, and the commits
that changed data files already there afterwards (regenerated, relabelled or scrubbed; their
subjects say which), plus the source commits recorded by run folders made since fedudp 0.2.0
(``summary.json``'s ``source``). A result is the output of the code at the commit that added it
(results are committed with, or right after, the code that made them); whether the current code
still reproduces it is a separate question that only a re-run answers (each folder's README
states what was re-run and the drift found). Raw files packed into a folder's ``raw.tar.xz`` or
``raw.jsonl`` (scripts/tools/results_archive.py) keep their history under their original paths; the
commits that only packed them (subject ``results: consolidate ...``) are not counted as adding
or changing data, and the packed ``summary.json`` files are read in place.

Usage:

    .venv/bin/python scripts/tools/results_provenance.py                 # every folder
    .venv/bin/python scripts/tools/results_provenance.py huang_table1    # one folder
    .venv/bin/python scripts/tools/results_provenance.py --markdown      # one table row per folder
    .venv/bin/python scripts/tools/results_provenance.py --runs huang_table1   # each run folder's commit
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = "docs/results"
PACKING = "results: consolidate"  # commits that only moved raw files into the folder's archive
sys.path.insert(0, str(ROOT / "scripts" / "tools"))
import results_archive  # noqa: E402  (scripts/tools/: the folders' packed raw files)


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def data_history(folder: str) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """(commits adding data files, commits modifying them), each (hash, date, subject), oldest
    first; data files are the folder's tracked files that are not Markdown."""
    spec = [f"{RESULTS}/{folder}", f":!{RESULTS}/{folder}/**/*.md", f":!{RESULTS}/{folder}/*.md"]
    out: dict[str, list] = {"A": [], "M": []}
    for kind in out:
        log = git(
            "log", "--reverse", f"--diff-filter={kind}", "--format=%h%x09%ad%x09%s",
            "--date=short", "--", *spec,
        )  # fmt: skip
        rows = [tuple(line.split("\t", 2)) for line in log.splitlines() if line]
        out[kind] = [r for r in rows if not r[2].startswith(PACKING)]
    return out["A"], out["M"]


def recorded_sources(folder: str) -> dict[str, int]:
    """source commit (with '+modified' where the tree was) -> number of run folders recording it."""
    counts: dict[str, int] = defaultdict(int)
    for p in results_archive.rglob(ROOT / RESULTS / folder, "summary.json"):
        try:
            src = json.loads(results_archive.read_text(p)).get("source")
        except (OSError, ValueError):
            continue
        if isinstance(src, dict) and src.get("commit"):
            counts[src["commit"][:7] + ("+modified" if src.get("modified") else "")] += 1
    return dict(counts)


def run_commits(folder: str) -> list[str]:
    """'<run folder> <commit> <date>' for each summary.json under the folder: the commit that
    added it (the code that produced the run, unless its summary records another source)."""
    out = []
    for p in results_archive.rglob(ROOT / RESULTS / folder, "summary.json"):
        rel = p.relative_to(ROOT).as_posix()
        log = git("log", "--diff-filter=A", "--format=%h %ad", "--date=short", "-1", "--", rel)
        out.append(f"{p.parent.relative_to(ROOT / RESULTS / folder).as_posix()} {log.strip()}")
    return out


def report(folder: str, markdown: bool) -> str:
    added, modified = data_history(folder)
    readme = git("log", "--format=%h %ad", "--date=short", "-1", "--", f"{RESULTS}/{folder}")
    sources = recorded_sources(folder)
    if markdown:
        if not added:
            return (
                f"| {folder} | (numbers in the README only) | last edit {readme.strip() or '-'} "
                "| - | - |"
            )
        mods = (
            f"{len(modified)} commit(s), last {modified[-1][0]} ({modified[-1][1]})"
            if modified
            else "-"
        )
        src = ", ".join(f"{k} ({v})" for k, v in sources.items()) or "-"
        return (
            f"| {folder} | {added[0][0]} ({added[0][1]}) | {added[-1][0]} ({added[-1][1]}) "
            f"| {mods} | {src} |"
        )
    lines = [f"{RESULTS}/{folder}/"]
    if not added:
        lines.append(f"  no data files; README last changed {readme.strip() or '-'}")
    for label, rows in (("added by", added), ("changed by", modified)):
        for h, d, s in rows:
            lines.append(f"  {label:10s} {h} {d} {s[:90]}")
    for k, v in sources.items():
        lines.append(f"  recorded   {k}: {v} run(s)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folders", nargs="*", help="folder names under docs/results (default: all)")
    ap.add_argument("--markdown", action="store_true", help="one table row per folder")
    ap.add_argument("--runs", action="store_true", help="the commit that added each run folder")
    a = ap.parse_args()
    names = a.folders or sorted(p.name for p in (ROOT / RESULTS).iterdir() if p.is_dir())
    bad = [n for n in names if not (ROOT / RESULTS / n).is_dir()]
    if bad:
        raise SystemExit(f"results_provenance.py: error: no folder {RESULTS}/{bad[0]}")
    if a.markdown:
        print(
            "| folder | first data added | last data added | data changed afterwards by "
            "| source recorded by runs |\n|---|---|---|---|---|"
        )
    for n in names:
        print("\n".join(run_commits(n)) if a.runs else report(n, a.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
