"""Benchmark: the default test suite's wall time, before and after a change (issue 38).

Each run is one fresh ``python -m pytest`` over one source tree's ``tests/`` (the tree's root
is the working directory and first on ``PYTHONPATH``, so its ``fedudp`` is imported, also by
the CLI subprocesses its tests start), with the same arguments for both trees (by default the
default suite: ``-q -m "not slow" -p no:cacheprovider``), or each tree's own (``--before-args``,
``--after-args``: e.g. each tree's README test command). The trees alternate (before first on
even repetitions, after first on odd ones), so both see the same machine load. Every finished
run is appended to ``--json`` as one line (tree, repetition, wall seconds, exit code, pytest's
summary line, the load average before and after, and for a failed run the end of its output);
a rerun with the same ``--json`` skips the runs it holds (resumable); ``--only`` runs one tree's
missing repetitions (a failed run stays on record and counts as failed). ``--report`` prints
min and median per tree from that file. A ``--json`` packed in its result folder's raw.jsonl
(docs/results/startup's: ``suite_runs.jsonl``; scripts/tools/results_archive.py) is read from there,
and written back to disk before the first new line is appended to it.

    git worktree add /tmp/suite_before b590f44
    python scripts/benchmarks/bench_suite.py --before /tmp/suite_before --after . --runs 5 \\
        --json docs/results/startup/suite_runs.jsonl
    python scripts/benchmarks/bench_suite.py --json docs/results/startup/suite_runs.jsonl --report
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import results_archive  # noqa: E402  (scripts/tools/: a result folder's raw.jsonl)

DEFAULT_ARGS = ["-q", "-m", "not slow", "-p", "no:cacheprovider"]


def done_runs(path: Path) -> list[dict]:
    if not results_archive.is_file(path):
        return []
    text = results_archive.read_text(path)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def summary_line(out: str) -> str:
    """pytest's last line that counts tests (``N passed ... in S s``)."""
    for line in reversed(out.strip().splitlines()):
        if " in " in line and ("passed" in line or "failed" in line or "error" in line):
            return line.strip("= ").strip()
    return ""


def one_run(python: str, root: Path, pytest_args: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        PYTHONPATH=str(root.resolve()), FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0"
    )
    load0 = os.getloadavg()[0]
    t = time.perf_counter()
    r = subprocess.run(
        [python, "-m", "pytest", *pytest_args, "tests"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t
    out = {
        "wall_s": round(wall, 2),
        "rc": r.returncode,
        "summary": summary_line(r.stdout),
        "load_before": round(load0, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    if r.returncode != 0:  # what failed: pytest's short summary and the end of its output
        out["failure"] = (r.stdout + r.stderr)[-4000:]
    return out


def report(rows: list[dict]) -> str:
    lines = [
        "| tree | runs | min (s) | median (s) | failed runs |",
        "|---|---:|---:|---:|---:|",
    ]
    for tree in ("before", "after"):
        got = [r for r in rows if r["tree"] == tree]
        ok = [r["wall_s"] for r in got if r["rc"] == 0]
        if not got:
            continue
        lo = f"{min(ok):.1f}" if ok else "-"
        med = f"{statistics.median(ok):.1f}" if ok else "-"
        lines.append(f"| {tree} | {len(ok)} | {lo} | {med} | {len(got) - len(ok)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="the older source tree (a checkout)")
    ap.add_argument("--after", type=Path, help="the newer source tree")
    ap.add_argument("--runs", type=int, default=5, help="repetitions per tree (default 5)")
    ap.add_argument("--json", type=Path, required=True, help="JSON lines, appended per run")
    ap.add_argument("--python", default=sys.executable, help="the interpreter (both trees)")
    ap.add_argument("--report", action="store_true", help="print min/median from --json")
    ap.add_argument(
        "--pytest-args", default=" ".join(DEFAULT_ARGS), help="pytest's arguments (both trees)"
    )
    ap.add_argument(
        "--before-args", help="pytest's arguments for --before (default: --pytest-args)"
    )
    ap.add_argument("--after-args", help="pytest's arguments for --after (default: --pytest-args)")
    ap.add_argument(
        "--only",
        choices=("before", "after"),
        help="run this tree's repetitions only (e.g. one more run after a failed one)",
    )
    a = ap.parse_args(argv)
    if a.report:
        print(report(done_runs(a.json)))
        return 0
    trees = {"before": a.before, "after": a.after}
    for name, root in trees.items():
        if root is None or not (root / "tests").is_dir() or not (root / "fedudp").is_dir():
            ap.error(f"--{name}: {root} is not a fedudp source tree (no tests/ or fedudp/)")
    if a.runs < 1:
        ap.error("--runs must be >= 1")
    have = {(r["tree"], r["rep"]) for r in done_runs(a.json)}
    if not a.json.is_file() and results_archive.is_file(a.json):  # packed: continue it on disk
        a.json.write_text(results_archive.read_text(a.json))
    args = {
        "before": (a.before_args or a.pytest_args).split(),
        "after": (a.after_args or a.pytest_args).split(),
    }
    for rep in range(a.runs):
        order = ("before", "after") if rep % 2 == 0 else ("after", "before")
        for tree in order:
            if (tree, rep) in have or (a.only and tree != a.only):
                continue
            row = {
                "tree": tree,
                "rep": rep,
                "root": str(trees[tree]),
                "args": " ".join(args[tree]),
                **one_run(a.python, trees[tree], args[tree]),
            }
            with a.json.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    print(report(done_runs(a.json)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
