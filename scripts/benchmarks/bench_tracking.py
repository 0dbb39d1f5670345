"""Overhead of experiment tracking per round: the ``make run`` workload with tracking off, MLflow
and TensorBoard.

``python scripts/benchmarks/bench_tracking.py [--reps 5] [--out docs/results/tracking] [--runs DIR]
[KEY=VALUE ...]`` runs ``fedudp -m method=per_silo,fedavg,full_dp,joint_dp`` (the embedded
synthetic default: 64 owners, 10,000 users, 20 rounds; ``make run``) once per tracking kind per
repetition, each in a fresh process, the kinds interleaved (their order rotates every
repetition). Each process is the real command line (``fedudp.cli.main``) with a measuring shim:
the time at which every round's hook (metrics.jsonl line, ledger, tracker) returns, the time
spent in the tracker's per-round call, and in its start and finish.

Reported, per kind, over the repetitions (min and median): seconds per round (the period between
two rounds' hooks, round 1 of each run left out: it includes the run's warm-up), the tracker's
own time per round, its fixed cost per run (start: MLflow's import, the embedded store, the run;
finish: the summary and the artifacts) and the process's wall time. The table, the exact command
and the wall time go to ``--out``/README.md, the raw numbers to ``--out``/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("none", "mlflow", "tensorboard")
METHODS = "per_silo,fedavg,full_dp,joint_dp"


def child(kind: str, sweep_dir: str, report: str, extra: list[str]) -> None:
    """One repetition of one kind: the real command line, timed from inside."""
    import fedudp.cli as cli_mod
    import fedudp.run as run_mod
    from fedudp import tracking

    periods: list[dict] = []
    calls = {"log_round": [], "start": [], "finish": []}

    real_rounds = run_mod.run_rounds

    def timed_rounds(*args, **kwargs):
        hook = args[5] if len(args) > 5 else kwargs.get("on_round")
        last = [time.perf_counter()]

        def on_round(info):
            hook(info)
            now = time.perf_counter()
            periods.append(
                {"round": info["round"], "period": now - last[0], "compute": info.get("seconds")}
            )
            last[0] = now

        if len(args) > 5:
            args = args[:5] + (on_round,) + args[6:]
        else:
            kwargs["on_round"] = on_round
        return real_rounds(*args, **kwargs)

    run_mod.run_rounds = timed_rounds

    def timing(name, fn):
        def wrapped(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                calls[name].append(time.perf_counter() - t)

        return wrapped

    tracking.Tracker.log_round = timing("log_round", tracking.Tracker.log_round)
    tracking.Tracker.finish = timing("finish", tracking.Tracker.finish)
    run_mod.tracking.start = timing("start", tracking.start)

    t0 = time.perf_counter()
    sys.argv = [
        "fedudp",
        "-m",
        f"method={METHODS}",
        f"tracking={kind}",
        "progress=false",
        f"hydra.sweep.dir={sweep_dir}",
        *extra,
    ]
    try:
        cli_mod.main()
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    Path(report).write_text(
        json.dumps(
            {"kind": kind, "periods": periods, "calls": calls, "wall": time.perf_counter() - t0}
        )
    )


def summarize(rep: dict) -> dict:
    """One repetition: mean round period (rounds >= 2 of every run), mean tracker time per round,
    fixed per-run cost (start + finish), wall."""
    later = [p for p in rep["periods"] if p["round"] >= 2]
    runs = max(1, len(rep["calls"]["finish"]))
    return {
        "s_per_round": statistics.fmean(p["period"] for p in later),
        "compute_per_round": statistics.fmean(p["compute"] for p in later),
        "hook_ms": 1e3
        * (statistics.fmean(rep["calls"]["log_round"]) if rep["calls"]["log_round"] else 0.0),
        "fixed_per_run": (sum(rep["calls"]["start"]) + sum(rep["calls"]["finish"])) / runs,
        "wall": rep["wall"],
        "rounds": len(rep["periods"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "tracking"))
    ap.add_argument("--runs", default=None, help="folder for the sweeps (default: a temporary one)")
    ap.add_argument(
        "--note", default="", help="a paragraph added to the README (the machine's load, ...)"
    )
    ap.add_argument(
        "--render",
        metavar="RESULTS_JSON",
        help="only write the README again from a results.json of an earlier run",
    )
    ap.add_argument(
        "--child", nargs=3, metavar=("KIND", "SWEEP_DIR", "REPORT"), help=argparse.SUPPRESS
    )
    ap.add_argument("overrides", nargs="*", help="extra fedudp overrides for every run")
    a = ap.parse_args()
    if a.child:
        child(*a.child, a.overrides)
        return 0
    if a.render:
        saved = json.loads(Path(a.render).read_text())
        a.reps = len(saved["results"]["none"])
        a.overrides = saved.get("overrides", [])
        write(Path(a.out), saved["results"], a, saved["wall"])
        return 0
    t_all = time.perf_counter()
    runs = Path(a.runs) if a.runs else Path(tempfile.mkdtemp(prefix="bench_tracking_"))
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0")
    results: dict[str, list[dict]] = {k: [] for k in KINDS}
    for rep in range(a.reps):
        order = KINDS[rep % len(KINDS) :] + KINDS[: rep % len(KINDS)]
        for kind in order:
            sweep = runs / f"rep{rep}_{kind}"
            report = runs / f"rep{rep}_{kind}.json"
            cmd = [sys.executable, __file__, "--child", kind, str(sweep), str(report), *a.overrides]
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
                return 1
            warned = [ln for ln in p.stderr.splitlines() if "warning: tracking" in ln]
            if warned:
                print("\n".join(warned), file=sys.stderr)
                return 1
            s = summarize(json.loads(report.read_text()))
            results[kind].append(s)
            print(
                f"rep {rep} {kind:12s} {s['s_per_round']:.4f} s/round  hook {s['hook_ms']:.2f} ms"
                f"  fixed {s['fixed_per_run']:.2f} s/run  wall {s['wall']:.1f} s",
                flush=True,
            )
    wall = time.perf_counter() - t_all
    write(Path(a.out), results, a, wall)
    return 0


def write(out: Path, results: dict, a: argparse.Namespace, wall: float) -> None:
    out.mkdir(parents=True, exist_ok=True)

    def mm(kind: str, key: str) -> tuple[float, float]:
        xs = [r[key] for r in results[kind]]
        return min(xs), statistics.median(xs)

    base_min, base_med = mm("none", "s_per_round")
    rows = []
    for kind in KINDS:
        smin, smed = mm(kind, "s_per_round")
        paired = [
            r["s_per_round"] / b["s_per_round"] for r, b in zip(results[kind], results["none"])
        ]
        hmin, hmed = mm(kind, "hook_ms")
        fmin, fmed = mm(kind, "fixed_per_run")
        wmin, wmed = mm(kind, "wall")
        rows.append(
            f"| {kind} | {smin:.4f} | {smed:.4f} | {100 * (smin / base_min - 1):+.1f} % | "
            f"{100 * (smed / base_med - 1):+.1f} % | {100 * (min(paired) - 1):+.1f} % | "
            f"{100 * (statistics.median(paired) - 1):+.1f} % | {hmin:.3f} | {hmed:.3f} | "
            f"{100 * hmed / 1e3 / base_med:.2f} % | {fmed:.2f} | {wmin:.1f} | {wmed:.1f} |"
        )
    command = "python scripts/benchmarks/bench_tracking.py " + " ".join(
        shlex.quote(x) for x in [f"--reps={a.reps}", *a.overrides]
    )
    text = f"""# Tracking overhead per round

Produced by `scripts/benchmarks/bench_tracking.py` (its docstring says what is measured). Workload: `make
run`'s sweep, `fedudp -m method={METHODS}` on the embedded synthetic default (64 owners,
10,000 users of one record, 20 rounds, ε = 1), with `tracking=none`, `tracking=mlflow`
(embedded SQLite store in the sweep folder, one parent run and four children) and
`tracking=tensorboard` (`<run folder>/tb`); {a.reps} repetitions, each kind a fresh process,
interleaved (the order rotates every repetition).

* **s/round**: the period between two rounds' hooks (the round's work plus writing its
  metrics.jsonl line, its ledger lines and the tracker's call), averaged over rounds 2-20 of the
  four runs; min and median over the repetitions, and the change against `none`.
* **paired**: each repetition's s/round divided by that of `none` in the same repetition
  (the kinds of one repetition run one after the other, so a change of the machine's load
  between repetitions cancels), min and median over the repetitions.
* **tracker ms/round**: the time inside the tracker's per-round call, averaged over all
  rounds (MLflow: the round's metrics added to a buffer, written to the store every 5 s;
  TensorBoard: one event into the writer's queue), and that as a share of the median round.
* **fixed s/run**: the tracker's start and finish per run (MLflow: importing MLflow, opening or
  creating the store, the experiment, the parent and the run, logging the parameters; at the
  end the buffered metrics, the summary, the artifacts, the run's status). Paid once per run,
  not per round; the first run of a process also pays MLflow's import and the store's creation.

| tracking | s/round min | s/round median | vs none (min) | vs none (median) | paired vs none (min) | paired vs none (median) | tracker ms/round min | tracker ms/round median | tracker share of a round | fixed s/run (median) | wall s min | wall s median |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Command: `{command}` (total wall time {wall:.0f} s).
Machine: {platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}.
Raw numbers: [results.json](results.json).
"""
    (out / "README.md").write_text(text + (f"\n{a.note}\n" if getattr(a, "note", None) else ""))
    (out / "results.json").write_text(
        json.dumps(
            {"command": command, "wall": wall, "overrides": a.overrides, "results": results},
            indent=1,
        )
    )
    print(text)


if __name__ == "__main__":
    raise SystemExit(main())
