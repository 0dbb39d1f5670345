"""The row estimators' release alone, before and after (issue 40; docs/results/rows).

Builds one cohort of ``--users`` rows x ``--dim`` float32 values once (a saved ``.npy`` of real
per-user vectors with ``--rows``, or i.i.d. Gaussian rows of norm about ``--norm``), then times
each estimator's ``estimate`` (the release without the billboard's merge and accounting) in a
fresh subprocess per repetition, for each checkout given (``--side NAME=PATH``, e.g. a ``git
worktree`` of the commit before the change and this checkout), interleaved: rep 1 of every side,
then rep 2, ... Each subprocess loads the rows, builds the estimator from plain values as
``method=joint_dp`` builds it (epsilon 1, delta 1e-5, one round, bound 1, one record per user),
releases once on a fixed seed and reports the release's wall and CPU seconds, its peak resident
memory (``VmHWM``) and the memory before the release; the released means of each side are saved
so that the sides can be compared (``max_abs_diff`` against the first side).

    .venv/bin/python scripts/benchmarks/bench_rows.py --users 6000 --reps 3 \\
        --side before=/tmp/rows_before --side after=. --json /tmp/rows.json

Threads: ``--threads`` (OMP and torch) in every subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHILD = r"""
import json, os, resource, sys, time
import numpy as np, torch
torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
from fedudp.protocol.contributions import Sampling
name, rows_path, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
G = torch.from_numpy(np.load(rows_path))
n, d = G.shape
s = Sampling(1.0, n)
common = dict(epsilon=1.0, delta=1e-5, rounds=1, sampling=s, bound=1.0, records_per_unit=1)
if name == "winsorized":
    from fedudp.aggregators.winsorized import WinsorizedAggregator as A
    agg = A.calibrated(dim=d, **common)
elif name == "outlier_removal":
    from fedudp.aggregators.outlier import OutlierRemovalAggregator as A
    agg = A.calibrated(**common)
else:  # below its minimum n (8,509 here) built from the same constants at this n
    from fedudp.aggregators import outlier as O
    big = O.FriendlyCoreAggregator.calibrated(**dict(common, sampling=Sampling(1.0, 10**6)))
    tau = O.default_filter_tau(1.0, n, 1, 0.1, 1)
    sens = O.friendlycore_sensitivity(tau, n, 1e-5 / 4)
    z = big.noise_multiplier
    agg = O.FriendlyCoreAggregator(tau, z, sens, s, z, 1e-5 / 2, big.min_users_required)
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
before = hwm()
t0, c0 = time.perf_counter(), time.process_time()
a = agg.estimate(G, rng=torch.Generator().manual_seed(2026))
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
np.save(out_path, a.mean.numpy())
diag = {k: v for k, v in a.diagnostics.items() if isinstance(v, (int, float, bool))}
print("BENCH " + json.dumps({"wall_s": wall, "cpu_s": cpu, "peak_bytes": hwm(),
      "before_bytes": before, "users_used": a.users_used, "diagnostics": diag}))
"""

ESTIMATORS = ("winsorized", "friendlycore", "outlier_removal")


def cohort(args: argparse.Namespace, folder: Path) -> Path:
    """The rows as one float32 .npy (given, or i.i.d. Gaussian, made once)."""
    if args.rows:
        X = np.load(args.rows, mmap_mode="r")
        if X.ndim != 2 or X.dtype != np.float32:
            sys.exit(f"bench_rows: --rows {args.rows}: need a 2-d float32 array, got {X.dtype}")
        if args.users > X.shape[0]:
            sys.exit(f"bench_rows: --users {args.users} > the {X.shape[0]} rows of --rows")
        path = folder / "rows.npy"
        np.save(path, np.ascontiguousarray(X[: args.users]))
        return path
    rng = np.random.default_rng(args.seed)
    path = folder / "rows.npy"
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(args.users, args.dim))
    step = 2048
    for s in range(0, args.users, step):
        e = min(args.users, s + step)
        out[s:e] = rng.standard_normal((e - s, args.dim), dtype=np.float32) * (
            args.norm / np.sqrt(args.dim)
        )
    out.flush()
    del out
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--users", type=int, default=60000)
    p.add_argument("--dim", type=int, default=28938)
    p.add_argument("--norm", type=float, default=3.8, help="i.i.d. rows' typical l2 norm")
    p.add_argument("--rows", help="a float32 .npy of per-user rows (its first --users rows)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--estimators", default=",".join(ESTIMATORS))
    p.add_argument(
        "--side", action="append", required=True, help="NAME=PATH of a checkout (repeatable)"
    )
    p.add_argument("--skip", action="append", default=[], help="SIDE:ESTIMATOR:REPS_FROM")
    p.add_argument("--json", required=True, help="where to write every measurement")
    args = p.parse_args(argv)
    sides = []
    for spec in args.side:
        name, _, path = spec.partition("=")
        if not path or not (Path(path) / "fedudp").is_dir():
            sys.exit(f"bench_rows: --side {spec}: need NAME=PATH of a checkout with fedudp/")
        sides.append((name, str(Path(path).resolve())))
    names = [e for e in args.estimators.split(",") if e]
    bad = [e for e in names if e not in ESTIMATORS]
    if bad:
        sys.exit(f"bench_rows: --estimators: unknown {bad}; choose from {list(ESTIMATORS)}")
    skip = {}
    for spec in args.skip:
        side, est, start = spec.split(":")
        skip[(side, est)] = int(start)
    out: dict = {"args": vars(args), "runs": []}
    with tempfile.TemporaryDirectory(prefix="bench_rows_") as tmp:
        folder = Path(tmp)
        t0 = time.time()
        rows = cohort(args, folder)
        out["cohort_seconds"] = time.time() - t0
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
        env["BENCH_THREADS"] = str(args.threads)
        for rep in range(args.reps):
            for est in names:
                for side, path in sides:
                    if rep + 1 >= skip.get((side, est), 10**9):
                        continue
                    mean_path = folder / f"{side}_{est}_{rep}.npy"
                    cmd = [sys.executable, "-c", CHILD, est, str(rows), str(mean_path)]
                    t = time.time()
                    res = subprocess.run(
                        cmd,
                        cwd=path,
                        env=dict(env, PYTHONPATH=path),
                        capture_output=True,
                        text=True,
                    )
                    line = [x for x in res.stdout.splitlines() if x.startswith("BENCH ")]
                    if res.returncode or not line:
                        sys.exit(f"bench_rows: {side} {est} failed:\n{res.stderr[-2000:]}")
                    r = json.loads(line[0][6:])
                    r.update(side=side, estimator=est, rep=rep, process_s=time.time() - t)
                    r["load1"] = os.getloadavg()[0]
                    first = folder / f"{sides[0][0]}_{est}_{rep}.npy"
                    if first.exists() and side != sides[0][0]:
                        r["max_abs_diff"] = float(np.abs(np.load(mean_path) - np.load(first)).max())
                    out["runs"].append(r)
                    print(
                        f"{side:>8} {est:>16} rep {rep}: release {r['wall_s']:.1f} s "
                        f"(cpu {r['cpu_s']:.1f}), peak {r['peak_bytes'] / 2**30:.2f} GiB, "
                        f"load {r['load1']:.1f}"
                        + (f", max|diff| {r['max_abs_diff']:.3g}" if "max_abs_diff" in r else ""),
                        flush=True,
                    )
                    Path(args.json).write_text(json.dumps(out, indent=1))
    summary = {}
    for est in names:
        for side, _ in sides:
            w = [r["wall_s"] for r in out["runs"] if r["side"] == side and r["estimator"] == est]
            if w:
                summary[f"{side}/{est}"] = {
                    "min": min(w),
                    "median": statistics.median(w),
                    "n": len(w),
                }
    out["summary"] = summary
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
