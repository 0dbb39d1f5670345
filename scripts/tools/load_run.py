"""Load run: all 60,000 MNIST training records over 1,024 owners, on each engine.

``python scripts/tools/load_run.py --data DATA [--engines local,flower] [--rounds 2]
[--threads 1] [--note TEXT] [KEY=VALUE ...]`` runs ``fedudp`` once per engine (a subprocess,
its own output folder ``--runs``/<engine>) and records its wall time and the peak
resident memory of its whole process tree (the driver plus every descendant: Ray's raylet, GCS,
agents and ClientApp workers on ``engine=flower``), sampled from /proc every ``--every`` s.
The table, the exact commands and ``--note`` go to ``--out``/README.md. Extra ``KEY=VALUE``
arguments are fedudp overrides for both engines.

``--aggregators winsorized,outlier_removal,friendlycore [--method joint_dp] [--rounds 1]
--engines none``: the estimators that need the cohort's per-unit rows, each one run of
``engine=local aggregator=<name>`` at this size, one after the other, measured the same way
(``rows_results.json``; their own table in README.md, with the estimator's diagnostics).
``--preflight``: only the pre-flight memory check of each row estimator at this size
(``fedudp.aggregators.memory.check_rows_fit``, no training): refused before any work (exit 2)
with the memory it would need, or it fits (with the estimate).

README.md is updated section by section (between ``<!-- load_run:NAME -->`` markers): a run
rewrites only its own section, text outside the markers (the reading) is kept. The data folder
is written as ``<folder with the MNIST IDX files>`` in the recorded commands.
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

ROOT = Path(__file__).resolve().parents[2]


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
        ppid = int(raw[raw.rindex(")") + 2 :].split()[1])
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
    o = [
        f"engine={engine}",
        f"method={args.method}",
        "dataset.name=mnist",
        f"dataset.root={args.data}",
        "dataset.num_records=60000",
        "partition.num_owners=1024",
        f"partition.scheme={args.scheme}",
        f"train.rounds={args.rounds}",
        f"engine_opts.threads={args.threads}",
        f"hydra.run.dir={out}",
        "progress=false",
    ]
    if engine == "flower":  # one ClientApp at a time on this machine's cores: one thread busy
        o.append(f"engine_opts.num_cpus={args.flower_cpus}")
    return o + list(args.extra)


def measure(cmd: list[str], every: float, env: dict) -> dict:
    """Run ``cmd``; wall time, peak RSS of the driver and of its process tree, exit status."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    peak_own = peak_tree = 0
    while proc.poll() is None:
        own, tree = tree_rss(proc.pid)
        peak_own, peak_tree = max(peak_own, own), max(peak_tree, tree)
        time.sleep(every)
    out, err = proc.communicate()
    return {
        "seconds": time.perf_counter() - t0,
        "peak_rss_driver": peak_own,
        "peak_rss_tree": peak_tree,
        "returncode": proc.returncode,
        "stdout_tail": out[-2000:],
        "stderr_tail": err[-4000:],
        "marks": [ln for ln in err.splitlines() if ln.startswith("load_run: ")],
    }


DATA_PLACEHOLDER = "<folder with the MNIST IDX files>"
GIB = 1024**3


def shown(text: str, args: argparse.Namespace) -> str:
    """``text`` with the data folder written as a placeholder (no machine's path in the docs)."""
    return text.replace(str(args.data), DATA_PLACEHOLDER) if args.data else text


def section(name: str, lines: list[str]) -> str:
    return "\n".join([f"<!-- load_run:{name} -->", *lines, f"<!-- /load_run:{name} -->"])


def update_readme(path: Path, name: str, lines: list[str], before: str = "## Reading") -> None:
    """Replace section ``name`` of README.md (between its markers); a new section goes before
    the line ``before`` (or at the end). Everything else in the file is kept."""
    text = path.read_text() if path.is_file() else ""
    block = section(name, lines)
    begin, end = f"<!-- load_run:{name} -->", f"<!-- /load_run:{name} -->"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    elif f"\n{before}" in text:
        head, rest = text.split(f"\n{before}", 1)
        text = head.rstrip("\n") + "\n\n" + block + "\n\n" + before + rest
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + block + "\n"
    path.write_text(text)


def machine_lines(args: argparse.Namespace) -> list[str]:
    """The machine, the date and the user's note, as lines of a README section."""
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
    ]
    return lines + ([f"Note: {args.note}", ""] if args.note else [])


def engines_lines(rows: list[dict], args: argparse.Namespace) -> list[str]:
    lines = [
        "# Load: all 60,000 MNIST training records, 1,024 owners (issue 11)",
        "",
        "Produced by `scripts/tools/load_run.py`; one fedudp run per engine. Peak memory is the "
        "largest sum of VmRSS over the run's whole process tree (driver and every "
        f"descendant: Ray's raylet, GCS, agents and workers), sampled every {args.every} s "
        "(so a shorter peak can be missed; shared pages are counted once per process).",
        "",
        *machine_lines(args),
    ]
    lines += [
        "| engine | rounds done | stop | accuracy (mean over owners) | epsilon | wall time (s) | "
        "seconds per round | peak RSS driver (GiB) | peak RSS tree (GiB) | exit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r.get("summary") or {}
        acc = s.get("accuracy_mean")
        eps = s.get("epsilon")
        lines.append(
            f"| {r['engine']} | {s.get('rounds_completed', '-')} | {s.get('stop_reason', '-')} | "
            f"{'-' if acc is None else f'{acc:.4f}'} | {'-' if eps is None else f'{eps:.3f}'} | "
            f"{r['seconds']:.0f} | {', '.join(map(str, r.get('round_seconds', [])))} | "
            f"{r['peak_rss_driver'] / GIB:.2f} | {r['peak_rss_tree'] / GIB:.2f} | "
            f"{r['returncode']} |"
        )
    lines += [
        "",
        f"Commands (as run, from the repository root; `{DATA_PLACEHOLDER}` is the folder "
        "given\nto `scripts/tools/load_run.py --data`, holding `mnist/`):",
        "",
    ]
    lines += [f"    {shown(r['command'], args)}" for r in rows]
    calls = list(dict.fromkeys(shown(r.get("invocation", args.invocation), args) for r in rows))
    lines += ["", "The script, as called:", ""] + [f"    {c}" for c in calls] + [""]
    for r in rows:
        if r["returncode"] != 0:
            lines += [
                f"`{r['engine']}` exited {r['returncode']}; end of its stderr:",
                "",
                "```",
                shown(r["stderr_tail"].strip()[-1500:], args),
                "```",
                "",
            ]
    return lines


def preflight_lines(pre: list[dict], args: argparse.Namespace) -> list[str]:
    lines = [
        "Estimators that need the cohort's per-unit rows, at this size (`--preflight`: "
        "`method=joint_dp|full_dp aggregator=<name>`, one round, the pre-flight memory "
        "check only, no training): each is refused before any work (exit 2) with the memory "
        "it would need, or it fits (exit 0, with the estimate).",
        "",
        f"    {shown(args.invocation, args)}",
        "",
        "| aggregator | method | exit | seconds | message |",
        "|---|---|---|---|---|",
    ]
    for q in pre:
        lines.append(
            f"| {q['aggregator']} | {q['method']} | {q['returncode']} | {q['seconds']} | "
            f"{shown(q['message'], args).replace('|', '/') or '(ran)'} |"
        )
    return lines + [""]


def metric_means(metrics: Path) -> dict:
    """The estimator's diagnostics of each round (metrics.jsonl ``agg_*`` keys) and its seconds."""
    if not metrics.is_file():
        return {}
    rounds = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    keep = (
        "agg_clipped_fraction",
        "agg_kept_fraction",
        "agg_score_fraction",
        "agg_score_low",
        "agg_score_high",
        "agg_kept_mass_fraction",
        "agg_concentration_check_failed",
        "agg_halted",
        "agg_garbage_blocks",
        "agg_cohort",
    )
    return {
        "round_seconds": [round(m["seconds"], 1) for m in rounds],
        "diagnostics": [{k: m[k] for k in keep if k in m} for m in rounds],
    }


def rows_lines(rows: list[dict], args: argparse.Namespace) -> list[str]:
    lines = [
        "## Row estimators at 60,000 users, 1,024 owners (issue 25)",
        "",
        "`--aggregators`: each estimator that needs the cohort's per-unit rows, one "
        "`engine=local` run after the other (nothing else of this script running), on the "
        "rows held once as the owners sent them (float32) and read in float64 chunks "
        "(`fedudp/aggregators/rows.py`). Wall time of the whole run (data, training of the "
        "60,000 users' vectors, the release, evaluation); peak RSS of the process tree "
        f"sampled every {args.every} s; the pre-flight estimate is "
        "`fedudp.aggregators.memory.rows_bytes` for this run, and the release's seconds "
        "are `Billboard.release` (merging the rows, the estimator, the accounting): the "
        "script runs each command through a wrapper that prints both (`TIMED` in "
        "scripts/tools/load_run.py), otherwise `python -m fedudp.run` as shown. Each row's "
        "machine state, date and threads are in the notes under the table.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}.",
        "",
    ]
    lines += [
        "| aggregator | method | rounds done | stop | epsilon | wall time (s) | seconds per round | "
        "release (s) | peak RSS driver (GiB) | peak RSS tree (GiB) | pre-flight estimate (GiB) | "
        "estimator diagnostics (round 1) | exit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r.get("summary") or {}
        eps = s.get("epsilon")
        diag = (r.get("diagnostics") or [{}])[0]
        text = ", ".join(
            f"{k[4:]}={v:.4g}" if isinstance(v, float) else f"{k[4:]}={v}" for k, v in diag.items()
        )
        est = r.get("estimate_bytes")
        rel = r.get("release_seconds")
        lines.append(
            f"| {r['aggregator']} | {r['method']} | {s.get('rounds_completed', '-')} | "
            f"{s.get('stop_reason', '-')} | {'-' if eps is None else f'{eps:.3f}'} | "
            f"{r['seconds']:.0f} | {', '.join(map(str, r.get('round_seconds', [])))} | "
            f"{'-' if rel is None else f'{rel:.0f}'} | "
            f"{r['peak_rss_driver'] / GIB:.2f} | {r['peak_rss_tree'] / GIB:.2f} | "
            f"{'-' if est is None else f'{est / GIB:.2f}'} | {text or '-'} | "
            f"{r['returncode']} |"
        )
    lines += [""] + [
        f"- `{r['aggregator']}` ({r.get('date', 'date not recorded')}): "
        f"{r.get('note') or 'no note'}"
        for r in rows
    ]
    lines += ["", "Commands (as run, from the repository root, one at a time):", ""]
    lines += [f"    {shown(r['command'], args)}" for r in rows]
    calls = list(dict.fromkeys(shown(r.get("invocation", args.invocation), args) for r in rows))
    lines += ["", "The script, as called:", ""] + [f"    {c}" for c in calls] + [""]
    for r in rows:
        if r["returncode"] != 0:
            lines += [
                f"`{r['aggregator']}` exited {r['returncode']}; end of its stderr:",
                "",
                "```",
                shown(r["stderr_tail"].strip()[-1500:], args),
                "```",
                "",
            ]
    return lines


ROW_ESTIMATORS = ("winsorized", "outlier_removal", "friendlycore", "few_users")

# The pre-flight check alone: fedudp.run as usual, stopped right after the memory check passes
# (``fedudp.build.assemble.check_rows_fit``); a refusal ends the run the usual way (exit 2).
CHECK_ONLY = """
import sys
import fedudp.build.assemble as build
from fedudp.aggregators.memory import GIB, available_bytes, check_rows_fit
def check(aggregator, dim, itemsize, available=None):
    need = check_rows_fit(aggregator, dim, itemsize, available)
    if aggregator is not None and aggregator.needs_per_user_vectors:
        print(f"fedudp: fits: aggregator={aggregator.name} needs about {need / GIB:.1f} GiB for "
              f"its per-unit rows ({dim} shared coordinates), "
              f"{available_bytes() / GIB:.1f} GiB is available", file=sys.stderr, flush=True)
        raise SystemExit(0)
    return need
build.check_rows_fit = check
from fedudp.cli import main
sys.argv[0] = "fedudp"
main()
"""


def preflight(args: argparse.Namespace, env: dict) -> list[dict]:
    """Each estimator that needs the cohort's rows, at the load's size: the pre-flight memory
    check only (no training); the stderr line says how much memory it would need."""
    out = []
    for agg in ROW_ESTIMATORS:
        for method in ("joint_dp", "full_dp"):
            o = [
                f"method={method}",
                f"aggregator={agg}",
                "dataset.name=mnist",
                f"dataset.root={args.data}",
                "dataset.num_records=60000",
                "partition.num_owners=1024",
                f"partition.scheme={args.scheme}",
                "train.rounds=1",
                f"hydra.run.dir={Path(args.runs) / 'preflight' / (agg + '_' + method)}",
                "progress=false",
            ]
            t0 = time.perf_counter()
            p = subprocess.run(
                [sys.executable, "-c", CHECK_ONLY, *o],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=args.preflight_timeout,
            )
            line = next(
                (
                    ln
                    for ln in p.stderr.splitlines()
                    if ln.startswith(("fedudp: error", "fedudp: fits"))
                ),
                "",
            )
            out.append(
                {
                    "aggregator": agg,
                    "method": method,
                    "returncode": p.returncode,
                    "seconds": round(time.perf_counter() - t0, 1),
                    "message": line,
                }
            )
            print(f"[preflight] {agg} {method}: exit {p.returncode} {line[:160]}", flush=True)
    return out


# A row estimator's run: fedudp.run as usual, with two lines more on stderr: the pre-flight
# memory estimate (``check_rows_fit``'s return value) and the wall time of each release
# (``Billboard.release``: merging the replies' rows, the estimator, the accounting).
TIMED = """
import sys, time
import fedudp.build.assemble as build
from fedudp.billboard.server import Billboard
from fedudp.aggregators.memory import check_rows_fit
def check(aggregator, dim, itemsize, available=None):
    need = check_rows_fit(aggregator, dim, itemsize, available)
    print(f"load_run: estimate {need} bytes", file=sys.stderr, flush=True)
    return need
build.check_rows_fit = check
release = Billboard.release
def timed(self, replies, round_, answered=None):
    t0 = time.perf_counter()
    try:
        return release(self, replies, round_, answered)
    finally:
        print(f"load_run: release {round_} {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
Billboard.release = timed
from fedudp.cli import main
sys.argv[0] = "fedudp"
main()
"""


def preflight_need(stderr: str) -> int | None:
    got = [ln.split()[2] for ln in stderr.splitlines() if ln.startswith("load_run: estimate ")]
    return int(got[-1]) if got else None


def release_seconds(stderr: str) -> float | None:
    got = [
        float(ln.split()[3]) for ln in stderr.splitlines() if ln.startswith("load_run: release ")
    ]
    return sum(got) if got else None


def run_rows(args: argparse.Namespace, env: dict, out: Path) -> None:
    """``--aggregators``: one engine=local run per row estimator, measured like the engines."""
    old = out / "rows_results.json"
    names = args.aggregators.split(",")
    keep = [
        r
        for r in (json.loads(old.read_text()) if old.is_file() else [])
        if (r["aggregator"], r["method"]) not in {(a, args.method) for a in names}
    ]
    rows = list(keep)
    for agg in names:
        run_dir = Path(args.runs) / f"{agg}_{args.method}"
        o = [*overrides("local", args, run_dir), f"aggregator={agg}"]
        text = " ".join(
            shlex.quote(c)
            for c in ["OMP_NUM_THREADS=" + str(args.threads), "python", "-m", "fedudp.run", *o]
        )
        print(f"[{agg}] {text}", flush=True)
        r = measure([sys.executable, "-c", TIMED, *o], args.every, env)
        summary = run_dir / "summary.json"
        r.update(
            aggregator=agg,
            method=args.method,
            command=text,
            invocation=args.invocation,
            note=args.note,
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            summary=json.loads(summary.read_text()) if summary.is_file() else None,
            **metric_means(run_dir / "metrics.jsonl"),
        )
        r["estimate_bytes"] = preflight_need("\n".join(r["marks"]))
        r["release_seconds"] = release_seconds("\n".join(r["marks"]))
        print(
            f"[{agg}] exit {r['returncode']} in {r['seconds']:.0f} s, peak tree RSS "
            f"{r['peak_rss_tree'] / GIB:.2f} GiB",
            flush=True,
        )
        rows.append(r)
        (out / "rows_results.json").write_text(
            json.dumps(
                [{k: v for k, v in x.items() if k not in ("stdout_tail",)} for x in rows], indent=2
            )
        )
        update_readme(out / "README.md", "rows", rows_lines(rows, args))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--engines", default="local,flower", help="engines to run (none: no engine run)"
    )
    ap.add_argument(
        "--data",
        default=os.environ.get("FEDUDP_DATA"),
        help="folder holding mnist/ IDX files; default: $FEDUDP_DATA",
    )
    ap.add_argument("--method", default="joint_dp")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--scheme",
        default="iid",
        help="partition.scheme (paper_classes cannot place "
        "all 60,000 MNIST records on 1,024 owners of 8 classes each: classes run out)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--flower-cpus",
        type=float,
        default=float(os.cpu_count() or 1),
        help="engine_opts.num_cpus per ClientApp (default: all cores, one at a time)",
    )
    ap.add_argument("--every", type=float, default=0.5, help="memory sampling interval (s)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "load"))
    ap.add_argument(
        "--runs",
        default="/tmp/fedudp_load_runs",
        help="where the runs' own folders go (checkpoints are large)",
    )
    ap.add_argument("--note", default="")
    ap.add_argument("extra", nargs="*", help="more fedudp overrides (KEY=VALUE)")
    ap.add_argument(
        "--aggregators",
        default="",
        help="row estimators to run one after the other on engine=local "
        "(e.g. winsorized,outlier_removal,friendlycore)",
    )
    ap.add_argument(
        "--preflight",
        action="store_true",
        help="also run the pre-flight memory check of each row estimator at this size",
    )
    ap.add_argument("--preflight-timeout", type=float, default=600)
    ap.add_argument(
        "--readme-only",
        action="store_true",
        help="rewrite README.md's sections from the JSON files (no runs)",
    )
    args = ap.parse_args()
    if not args.data and not args.readme_only:
        raise SystemExit(
            "load_run.py: error: --data <folder with the MNIST IDX files> is "
            "required (or set FEDUDP_DATA)"
        )
    args.invocation = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(args.threads),
        MKL_NUM_THREADS=str(args.threads),
        FLWR_TELEMETRY_ENABLED="0",
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONUNBUFFERED="1",
    )
    if args.readme_only:
        readme_only(args, out)
        return
    if args.preflight:
        pre = preflight(args, env)
        (out / "preflight.json").write_text(json.dumps(pre, indent=2))
        update_readme(out / "README.md", "preflight", preflight_lines(pre, args))
    if args.aggregators:
        run_rows(args, env, out)
    if args.engines in ("", "none"):
        return
    old = out / "results.json"  # rows of engines not run now are kept
    keep = [
        r
        for r in (json.loads(old.read_text()) if old.is_file() else [])
        if r["engine"] not in args.engines.split(",")
    ]
    rows = list(keep)
    for engine in args.engines.split(","):
        run_dir = Path(args.runs) / engine
        cmd = [sys.executable, "-m", "fedudp.run", *overrides(engine, args, run_dir)]
        text = " ".join(
            shlex.quote(c) for c in ["OMP_NUM_THREADS=" + str(args.threads), "python", *cmd[1:]]
        )
        print(f"[{engine}] {text}", flush=True)
        r = measure(cmd, args.every, env)
        summary = run_dir / "summary.json"
        metrics = run_dir / "metrics.jsonl"
        r.update(
            engine=engine,
            command=text,
            invocation=args.invocation,
            summary=json.loads(summary.read_text()) if summary.is_file() else None,
            round_seconds=[
                round(json.loads(x)["seconds"], 1) for x in metrics.read_text().splitlines()
            ]
            if metrics.is_file()
            else [],
        )
        print(
            f"[{engine}] exit {r['returncode']} in {r['seconds']:.0f} s, peak tree RSS "
            f"{r['peak_rss_tree'] / GIB:.2f} GiB",
            flush=True,
        )
        rows.append(r)
        (out / "results.json").write_text(
            json.dumps(
                [{k: v for k, v in x.items() if k not in ("stdout_tail",)} for x in rows], indent=2
            )
        )
        update_readme(out / "README.md", "engines", engines_lines(rows, args))


def readme_only(args: argparse.Namespace, out: Path) -> None:
    """Rewrite the README's sections from the JSON files (the engines' section only where
    its run folders add round seconds)."""
    res = out / "results.json"
    if res.is_file():
        rows = json.loads(res.read_text())
        for r in rows:
            metrics = Path(args.runs) / r["engine"] / "metrics.jsonl"
            if metrics.is_file() and not r.get("round_seconds"):
                r["round_seconds"] = [
                    round(json.loads(x)["seconds"], 1) for x in metrics.read_text().splitlines()
                ]
        res.write_text(json.dumps(rows, indent=2))
        update_readme(out / "README.md", "engines", engines_lines(rows, args))
    pre = out / "preflight.json"
    if pre.is_file():
        update_readme(
            out / "README.md", "preflight", preflight_lines(json.loads(pre.read_text()), args)
        )
    rr = out / "rows_results.json"
    if rr.is_file():
        update_readme(out / "README.md", "rows", rows_lines(json.loads(rr.read_text()), args))


if __name__ == "__main__":
    main()
