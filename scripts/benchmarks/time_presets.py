"""Wall time, CPU time and peak memory of each seed-algorithm preset, run as shipped.

Each preset (``fedudp +experiment=<name>``, default: the six seed training algorithms) runs in
its own process, one after the other, into a temporary folder (``progress=false``); the table
gives its wall time, its CPU time (user + system, ``os.wait4`` of that process), its peak
resident memory (``ru_maxrss`` of that process) and what the run reported (rounds, stop reason,
ε, accuracy). Nothing else of fedudp runs meanwhile; say in ``--note`` what else the machine did.

    .venv/bin/python scripts/benchmarks/time_presets.py --out docs/results/presets/README.md
    .venv/bin/python scripts/benchmarks/time_presets.py levy_alg3 huang_alg1          # some of them
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEED_PRESETS = ["levy_alg3", "levy_alg4", "asi_alg3", "asi_alg4", "huang_alg1", "huang_alg2"]


def run_one(name: str, folder: Path, threads: int | None) -> dict:
    exe = Path(sys.executable).parent / "fedudp"
    cmd = [str(exe), f"+experiment={name}", "progress=false", f"hydra.run.dir={folder}"]
    if threads:
        cmd.append(f"engine_opts.threads={threads}")
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    folder.mkdir(parents=True, exist_ok=True)
    log = folder.parent / f"{name}.log"
    t = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        _, status, ru = os.wait4(p.pid, 0)  # this child's own resource usage
    wall = time.perf_counter() - t
    p.returncode = os.waitstatus_to_exitcode(status)
    row = {
        "preset": name,
        "exit": p.returncode,
        "wall_s": wall,
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "peak_rss_mib": ru.ru_maxrss / 1024,  # the largest process of the run (KiB)
        "command": " ".join(["fedudp", *cmd[1:3]]),
    }
    summary = folder / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        row.update(
            {
                k: s.get(k)
                for k in (
                    "rounds_completed",
                    "stop_reason",
                    "epsilon",
                    "epsilon_display",
                    "accuracy_mean",
                    "guarantee",
                )
            }
        )
    else:
        row["error"] = log.read_text().strip().splitlines()[-1:]
    return row


def table(rows: list[dict]) -> str:
    out = [
        "| preset | wall s | CPU s | peak RSS MiB | rounds | stop | ε | guarantee | accuracy |",
        "|---|---:|---:|---:|---:|---|---|---|---:|",
    ]
    for r in rows:
        acc = r.get("accuracy_mean")
        out.append(
            f"| `{r['preset']}` | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
            f"{r['peak_rss_mib']:.0f} | {r.get('rounds_completed', '-')} | "
            f"{r.get('stop_reason', 'exit ' + str(r['exit']))} | "
            f"{r.get('epsilon_display') or '-'} | {r.get('guarantee', '-')} | "
            f"{'-' if acc is None else f'{acc:.4f}'} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("presets", nargs="*", default=SEED_PRESETS)
    ap.add_argument("--out", help="write the Markdown table (and the command) here")
    ap.add_argument("--threads", type=int, default=0, help="engine_opts.threads (0: default)")
    ap.add_argument("--note", default="", help="what else the machine was doing")
    a = ap.parse_args()
    known = {p.stem for p in (ROOT / "conf/experiment").glob("*.yaml")}
    if bad := [p for p in a.presets if p not in known]:
        raise SystemExit(f"unknown preset(s) {bad}; known: {sorted(known)}")
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedudp_presets_") as tmp:
        for name in a.presets:
            r = run_one(name, Path(tmp) / name, a.threads or None)
            rows.append(r)
            print(
                f"{name}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, exit {r['exit']}, "
                f"{r.get('stop_reason')}, eps {r.get('epsilon_display')}",
                flush=True,
            )
    total = time.perf_counter() - t0
    text = table(rows)
    print(text)
    if a.out:
        cmd = " ".join(["python", "scripts/benchmarks/time_presets.py", *sys.argv[1:]])
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(
            "# Seed-algorithm presets as shipped: wall time, CPU time, peak memory\n\n"
            f"Command (total wall time {total:.0f} s):\n\n    {cmd}\n\n"
            f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}."
            + (f"\n\nNote: {a.note}" if a.note else "")
            + "\n\n"
            + text
            + "\n\n"
            "Each preset is `fedudp +experiment=<preset> progress=false` in a fresh process "
            "(`scripts/benchmarks/time_presets.py`); ε as the run prints it (`(heuristic)` where the "
            "preset's accounting is the paper's).\n"
        )
        (Path(a.out).parent / "presets.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
