"""Load run: all 60,000 MNIST training records over 1,024 owners, on each engine.

``python scripts/load_run.py --data DATA [--engines local,flower] [--rounds 2]
[--threads 1] [--note TEXT] [KEY=VALUE ...]`` runs ``fedudp`` once per engine (a subprocess,
its own output folder ``--runs``/<engine>) and records its wall time and the peak
resident memory of its whole process tree (the driver plus every descendant: Ray's raylet, GCS,
agents and ClientApp workers on ``engine=flower``), sampled from /proc every ``--every`` s.
The table, the exact commands and ``--note`` go to ``--out``/README.md. Extra ``KEY=VALUE``
arguments are fedudp overrides for both engines.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tree_rss(root: int) -> tuple[int, int]:
    """(RSS of ``root``, RSS of ``root`` and all its descendants), bytes, from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue
        ppid = int(raw[raw.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(name))
    own = total = 0
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        rss = _rss(pid)
        total += rss
        if pid == root:
            own = rss
    return own, total


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def overrides(engine: str, args: argparse.Namespace, out: Path) -> list[str]:
    """The fedudp overrides of one engine's load run."""
    o = [f"engine={engine}", f"method={args.method}", "dataset.name=mnist", f"dataset.root={args.data}",
         "dataset.num_records=60000", "partition.num_owners=1024", f"partition.scheme={args.scheme}",
         f"train.rounds={args.rounds}",
         f"engine_opts.threads={args.threads}", f"hydra.run.dir={out}", "progress=false"]
    if engine == "flower":     # one ClientApp at a time on this machine's cores: one thread busy
        o.append(f"engine_opts.num_cpus={args.flower_cpus}")
    return o + list(args.extra)


def measure(cmd: list[str], every: float, env: dict) -> dict:
    """Run ``cmd``; wall time, peak RSS of the driver and of its process tree, exit status."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    peak_own = peak_tree = 0
    while proc.poll() is None:
        own, tree = tree_rss(proc.pid)
        peak_own, peak_tree = max(peak_own, own), max(peak_tree, tree)
        time.sleep(every)
    out, err = proc.communicate()
    return {"seconds": time.perf_counter() - t0, "peak_rss_driver": peak_own,
            "peak_rss_tree": peak_tree, "returncode": proc.returncode,
            "stdout_tail": out[-2000:], "stderr_tail": err[-4000:]}


def write_readme(path: Path, rows: list[dict], args: argparse.Namespace) -> None:
    gib = 1024 ** 3
    lines = ["# Load: all 60,000 MNIST training records, 1,024 owners", "",
             "Produced by `scripts/load_run.py`; one fedudp run per engine. Peak memory is the "
             "largest sum of VmRSS over the run's whole process tree (driver and every "
             f"descendant: Ray's raylet, GCS, agents and workers), sampled every {args.every} s "
             "(so a shorter peak can be missed; shared pages are counted once per process).", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
             f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", ""]
    if args.note:
        lines += [f"Note: {args.note}", ""]
    lines += ["| engine | rounds done | stop | accuracy (mean over owners) | epsilon | wall time (s) | "
              "seconds per round | peak RSS driver (GiB) | peak RSS tree (GiB) | exit |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r.get("summary") or {}
        acc = s.get("accuracy_mean")
        eps = s.get("epsilon")
        lines.append(f"| {r['engine']} | {s.get('rounds_completed', '-')} | {s.get('stop_reason', '-')} | "
                     f"{'-' if acc is None else f'{acc:.4f}'} | {'-' if eps is None else f'{eps:.3f}'} | "
                     f"{r['seconds']:.0f} | {', '.join(map(str, r.get('round_seconds', [])))} | "
                     f"{r['peak_rss_driver'] / gib:.2f} | {r['peak_rss_tree'] / gib:.2f} | "
                     f"{r['returncode']} |")
    lines += ["", "Commands (as run, from the repository root):", ""]
    lines += [f"    {r['command']}" for r in rows]
    calls = list(dict.fromkeys(r.get("invocation", args.invocation) for r in rows))
    if (path.parent / "preflight.json").is_file() and args.invocation not in calls:
        calls.append(args.invocation)
    lines += ["", "The script, as called:", ""] + [f"    {c}" for c in calls] + [""]
    pre = path.parent / "preflight.json"
    if pre.is_file():
        lines += ["Estimators that need the cohort's per-unit rows, at this size (`--preflight`: "
                  "`method=joint_dp|full_dp aggregator=<name>`, one round): each is refused "
                  "before any work (exit 2) with the memory it would need, or it fits.", "",
                  "| aggregator | method | exit | seconds | message |", "|---|---|---|---|---|"]
        for q in json.loads(pre.read_text()):
            lines.append(f"| {q['aggregator']} | {q['method']} | {q['returncode']} | {q['seconds']} | "
                         f"{q['message'].replace('|', '/') or '(ran)'} |")
        lines.append("")
    failed = [r for r in rows if r["returncode"] != 0]
    for r in failed:
        lines += [f"`{r['engine']}` exited {r['returncode']}; end of its stderr:", "", "```",
                  r["stderr_tail"].strip()[-1500:], "```", ""]
    path.write_text("\n".join(lines))


ROW_ESTIMATORS = ("winsorized", "outlier_removal", "friendlycore", "few_users")


def preflight(args: argparse.Namespace, env: dict) -> list[dict]:
    """Each estimator that needs the cohort's rows, at the load's size: it either fits or is
    refused before any work; the first stderr line says how much memory it would need."""
    out = []
    for agg in ROW_ESTIMATORS:
        for method in ("joint_dp", "full_dp"):
            o = [f"method={method}", f"aggregator={agg}", "dataset.name=mnist", f"dataset.root={args.data}",
                 "dataset.num_records=60000", "partition.num_owners=1024",
                 f"partition.scheme={args.scheme}", "train.rounds=1",
                 f"hydra.run.dir={Path(args.runs) / 'preflight' / (agg + '_' + method)}", "progress=false"]
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "fedudp.run", *o], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=args.preflight_timeout)
            line = next((ln for ln in p.stderr.splitlines() if ln.startswith("fedudp: error")), "")
            out.append({"aggregator": agg, "method": method, "returncode": p.returncode,
                        "seconds": round(time.perf_counter() - t0, 1), "message": line})
            print(f"[preflight] {agg} {method}: exit {p.returncode} {line[:160]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="local,flower")
    ap.add_argument("--data", default=os.environ.get("FEDUDP_DATA"),
                    help="folder holding mnist/ IDX files; default: $FEDUDP_DATA")
    ap.add_argument("--method", default="joint_dp")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scheme", default="iid", help="partition.scheme (paper_classes cannot place "
                    "all 60,000 MNIST records on 1,024 owners of 8 classes each: classes run out)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--flower-cpus", type=float, default=float(os.cpu_count() or 1),
                    help="engine_opts.num_cpus per ClientApp (default: all cores, one at a time)")
    ap.add_argument("--every", type=float, default=0.5, help="memory sampling interval (s)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "load"))
    ap.add_argument("--runs", default="/tmp/fedudp_load_runs",
                    help="where the runs' own folders go (checkpoints are large)")
    ap.add_argument("--note", default="")
    ap.add_argument("extra", nargs="*", help="more fedudp overrides (KEY=VALUE)")
    ap.add_argument("--preflight", action="store_true",
                    help="also run each row estimator at this size (refused before work or fits)")
    ap.add_argument("--preflight-timeout", type=float, default=600)
    ap.add_argument("--readme-only", action="store_true",
                    help="rewrite README.md from results.json and the run folders (no runs)")
    args = ap.parse_args()
    if not args.data and not args.readme_only:
        raise SystemExit("load_run.py: error: --data <folder with the MNIST IDX files> is "
                         "required (or set FEDUDP_DATA)")
    args.invocation = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    out = Path(args.out)
    if args.preflight:
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
        out.mkdir(parents=True, exist_ok=True)
        (out / "preflight.json").write_text(json.dumps(preflight(args, env), indent=2))
        if args.engines == "none":
            args.readme_only = True
    if args.readme_only:
        rows = json.loads((out / "results.json").read_text())
        for r in rows:
            metrics = Path(args.runs) / r["engine"] / "metrics.jsonl"
            if metrics.is_file() and not r.get("round_seconds"):
                r["round_seconds"] = [round(json.loads(x)["seconds"], 1)
                                      for x in metrics.read_text().splitlines()]
        (out / "results.json").write_text(json.dumps(rows, indent=2))
        write_readme(out / "README.md", rows, args)
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    old = out / "results.json"       # rows of engines not run now are kept
    keep = [r for r in (json.loads(old.read_text()) if old.is_file() else [])
            if r["engine"] not in args.engines.split(",")]
    rows = list(keep)
    for engine in args.engines.split(","):
        run_dir = Path(args.runs) / engine
        cmd = [sys.executable, "-m", "fedudp.run", *overrides(engine, args, run_dir)]
        shown = " ".join(shlex.quote(c) for c in ["OMP_NUM_THREADS=" + str(args.threads),
                                                   "python", *cmd[1:]])
        print(f"[{engine}] {shown}", flush=True)
        r = measure(cmd, args.every, env)
        summary = run_dir / "summary.json"
        metrics = run_dir / "metrics.jsonl"
        r.update(engine=engine, command=shown, invocation=args.invocation,
                 summary=json.loads(summary.read_text()) if summary.is_file() else None,
                 round_seconds=[round(json.loads(x)["seconds"], 1) for x in
                                metrics.read_text().splitlines()] if metrics.is_file() else [])
        print(f"[{engine}] exit {r['returncode']} in {r['seconds']:.0f} s, peak tree RSS "
              f"{r['peak_rss_tree'] / 1024 ** 3:.2f} GiB", flush=True)
        rows.append(r)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(
            [{k: v for k, v in x.items() if k not in ("stdout_tail",)} for x in rows], indent=2))
        write_readme(out / "README.md", rows, args)


if __name__ == "__main__":
    main()
