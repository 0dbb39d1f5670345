"""Benchmark: how long the ``fedudp`` command takes to start, before and after a change.

Each measurement is one fresh interpreter running the command line of one source tree (its root
first on ``PYTHONPATH``; the probe checks that tree's ``fedudp`` is the one imported), timed from
outside (process start to exit). The two trees alternate within every repetition (before first on
even repetitions, after first on odd ones), so both see the same machine load. Reports min and
median over ``--runs`` repetitions. Results: docs/results/startup/README.md.

    python scripts/benchmarks/bench_startup.py --before /path/to/old/checkout --after . --runs 5

A tree whose ``fedudp/cli.py`` exists is driven through ``fedudp.cli.main`` (the console script's
target), an older one through ``fedudp.run.main``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the trivial run: one round of the default method (joint_dp: calibrated noise, the accountant)
# on a small synthetic federation, no progress bar
TRIVIAL = [
    "train.rounds=1",
    "dataset.num_records=1000",
    "partition.num_owners=8",
    "progress=false",
]
COMMANDS = {"--version": ["--version"], "--help": ["--help"], "one-round run": TRIVIAL}


def probe(root: Path, args: list[str]) -> str:
    entry = "fedudp.cli" if (root / "fedudp" / "cli.py").is_file() else "fedudp.run"
    return (
        "import sys, fedudp\n"
        f"assert fedudp.__file__.startswith({str(root.resolve())!r}), fedudp.__file__\n"
        f"sys.argv = ['fedudp', *{args!r}]\n"
        f"from {entry} import main\n"
        "main()\n"
    )


def once(python: str, root: Path, args: list[str], cwd: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of one fresh process."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        PYTHONPATH=str(root.resolve()), FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(
        [python, "-c", probe(root, args)], cwd=cwd, env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if r.returncode != 0:
        raise SystemExit(
            f"{root} {args}: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
        )
    return seconds, cpu


def commit(root: Path) -> str:
    r = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return r.stdout.strip() or "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the old source tree")
    ap.add_argument("--after", type=Path, required=True, help="the new source tree")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--json", type=Path, help="write every timing here")
    args = ap.parse_args()
    trees = {"before": args.before, "after": args.after}
    times: dict[str, dict[str, list[float]]] = {c: {t: [] for t in trees} for c in COMMANDS}
    cpu: dict[str, dict[str, list[float]]] = {c: {t: [] for t in trees} for c in COMMANDS}
    load = [os.getloadavg()]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)  # no ./conf here: neither tree's search path gets one
        for i in range(args.runs):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for name, cmd in COMMANDS.items():
                for tree in order:
                    extra = [f"hydra.run.dir={cwd / f'{tree}_{i}'}"] if cmd is TRIVIAL else []
                    s, c = once(args.python, trees[tree], cmd + extra, cwd)
                    times[name][tree].append(s)
                    cpu[name][tree].append(c)
                    print(f"run {i} {name:14s} {tree:6s} {s:6.2f} s  cpu {c:6.2f} s", flush=True)
    load.append(os.getloadavg())
    wall = time.perf_counter() - t0
    print(
        f"\n{os.cpu_count()} CPUs, load average {load[0][0]:.2f} at start, {load[1][0]:.2f} at end"
    )
    print(
        f"before: {args.before} ({commit(args.before)}); after: {args.after} ({commit(args.after)})"
    )
    print(f"wall time {wall:.0f} s, {args.runs} runs per cell\n")
    for title, table in (("wall", times), ("CPU (user + system)", cpu)):
        print(f"\n{title} seconds, min / median over {args.runs} fresh processes\n")
        print("| command | before min | before median | after min | after median |")
        print("|---|---:|---:|---:|---:|")
        for name, per in table.items():
            b, a = per["before"], per["after"]
            print(
                f"| `fedudp {' '.join(COMMANDS[name])}` | {min(b):.2f} | "
                f"{statistics.median(b):.2f} | {min(a):.2f} | {statistics.median(a):.2f} |"
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "times_s": times,
                    "cpu_s": cpu,
                    "commands": COMMANDS,
                    "load_average": load,
                    "cpus": os.cpu_count(),
                    "wall_s": wall,
                    "before": [str(args.before), commit(args.before)],
                    "after": [str(args.after), commit(args.after)],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
