"""Benchmark: fedudp's two DP paths at 1 and 2 threads (``engine_opts.threads``), s/round.

Two workloads, both the paper CNN (``model.name=cnn``) on ``--num-records`` (10,000) MNIST
training records (``dataset.num_records``, iid, one record per user), ``method=full_dp``, every user every
round (``train.sampling_rate=1``), a fixed noise multiplier with ``privacy.epsilon=1e6`` (the
budget never stops the run), ``engine=local``, evaluation only after the last round:

* ``server``: ``privacy.placement=server aggregator=auto`` (clip + Gaussian on the billboard),
  owners of 20 records (500 at 10,000 records), C = 1, z = 1, one local step per user at lr 0.05 (batch 32): the release of
  ``scripts/benchmarks/bench_pfl.py``'s fedudp side at 1 record per user;
* ``local_dpsgd``: ``privacy.placement=local_dpsgd`` (owner-side DP-SGD: Poisson-sampled
  records, per-record clipping at C = 15, noise z = 5 inside each owner, the billboard averages
  the owners' deltas), 64 owners (of 156–157 records at 10,000), one local epoch at batch 32 and lr 0.05
  (Huang et al.'s Table 1 protocol at n = 64, iid instead of 8 classes per owner): one round is
  one DP-SGD epoch of every owner.

Each repetition is a fresh process (``--worker``) running ``--rounds`` R rounds with
``engine_opts.threads`` T and ``OMP_NUM_THREADS=MKL_NUM_THREADS=T``; its number is the mean of
the round loop's own per-round seconds over rounds 2..R-1 (round 1 is warm-up, round R holds the
test evaluation). The repetitions are interleaved: rep 1 of (server, T=1), (server, T=2),
(local_dpsgd, T=1), (local_dpsgd, T=2), then rep 2, ... Reported: min and median over the
repetitions per (path, T), the speed-up T=1 / T=2 of the mins and of the medians, the workers'
``ru_maxrss``, and the 1-minute load average at the start and the end (two threads only help
where a second core is free: on a shared machine the T=2 numbers measure the load as much as
the code).

    .venv/bin/python scripts/benchmarks/bench_threads.py --data-root DATA --reps 5 \\
        --json docs/results/threads/bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATHS = ("server", "local_dpsgd")


def make_cfg(path: str, data_root: str, threads: int, rounds: int, seed: int, records: int):
    sys.path.insert(0, str(ROOT))
    from fedudp.config import RunConfig

    cfg = RunConfig()
    cfg.progress = False
    cfg.method = "full_dp"
    cfg.aggregator = "auto"
    cfg.engine = "local"
    cfg.seed = seed
    cfg.privacy.placement = path
    cfg.privacy.unit = "user"
    cfg.privacy.epsilon = 1e6  # the budget never stops the run
    cfg.dataset.name = "mnist"
    cfg.dataset.root = data_root
    cfg.dataset.num_records = records
    cfg.model.name = "cnn"
    cfg.partition.records_per_user = 1
    cfg.partition.scheme = "iid"
    cfg.train.rounds = rounds
    cfg.train.lr = 0.05
    cfg.train.batch_size = 32
    cfg.train.local_epochs = 1
    cfg.train.sampling_rate = 1.0
    cfg.train.eval_every = 10**6  # evaluate after the last round only
    cfg.engine_opts.threads = threads
    if path == "server":
        cfg.partition.num_owners = records // 20  # owners of 20 records
        cfg.privacy.clip = 1.0
        cfg.privacy.noise_multiplier = 1.0
    else:
        cfg.partition.num_owners = 64
        cfg.privacy.clip = 15.0
        cfg.privacy.noise_multiplier = 5.0
    return cfg


def worker(a) -> None:
    import torch

    from fedudp.run import execute, prepare

    cfg = make_cfg(a.worker, a.data_root, a.threads, a.rounds, a.seed, a.num_records)
    p = prepare(cfg)
    infos: list[dict] = []
    res = execute(p, infos.append)
    if res.stop_reason != "completed" or len(infos) != a.rounds:
        raise SystemExit(f"run stopped early: {res.stop_reason} {res.message}")
    Path(a.out).write_text(
        json.dumps(
            {
                "torch_threads": torch.get_num_threads(),
                "round_seconds": [i["seconds"] for i in infos],
                "users_per_round": [i.get("users_used") for i in infos],
            }
        )
    )


def run_one(a, path: str, threads: int, out: Path) -> dict:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        FLWR_TELEMETRY_ENABLED="0",
        RAY_USAGE_STATS_ENABLED="0",
    )
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        path,
        "--threads",
        str(threads),
        "--data-root",
        a.data_root,
        "--rounds",
        str(a.rounds),
        "--seed",
        str(a.seed),
        "--num-records",
        str(a.num_records),
        "--out",
        str(out),
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    text = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    _, status, ru = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed:\n{text[-3000:]}")
    res = json.loads(out.read_text())
    res.update(
        path=path,
        threads=threads,
        s_per_round=statistics.mean(res["round_seconds"][1:-1]),
        ru_maxrss_mib=ru.ru_maxrss / 1024,
        cpu_seconds=ru.ru_utime + ru.ru_stime,
        wall_seconds=time.perf_counter() - t0,
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data-root",
        default=os.environ.get("FEDUDP_DATA"),
        help="folder holding mnist/ IDX files (default: $FEDUDP_DATA)",
    )
    ap.add_argument("--rounds", type=int, default=4, help="rounds per repetition (2..R-1 counted)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--num-records",
        type=int,
        default=10_000,
        help="dataset.num_records (server: records / 20 owners; local_dpsgd: 64 owners)",
    )
    ap.add_argument("--json", help="write every run and the summary here")
    ap.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a.data_root:
        raise SystemExit(
            "bench_threads.py: error: --data-root <folder with mnist/ IDX files> is required "
            "(or set FEDUDP_DATA)"
        )
    if a.worker:
        a.threads = a.threads[0]
        sys.path.insert(0, str(ROOT))
        worker(a)
        return
    if a.rounds < 3 or a.reps < 1:
        raise SystemExit("bench_threads.py: error: --rounds must be >= 3 and --reps >= 1")
    load_start = os.getloadavg()
    print(
        f"{a.reps} reps x {a.paths} x threads {a.threads}, {a.rounds} rounds each (2..R-1 "
        f"counted); load average {load_start[0]:.2f}",
        flush=True,
    )
    t_all = time.perf_counter()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_threads_") as tmp:
        for rep in range(a.reps):
            for path in a.paths:
                for t in a.threads:
                    r = run_one(a, path, t, Path(tmp) / f"{path}_{t}.json")
                    r["rep"] = rep + 1
                    r["load_average_after"] = os.getloadavg()[0]
                    runs.append(r)
                    print(
                        f"rep {rep + 1} {path:11s} threads {t}: {r['s_per_round']:.3f} s/round "
                        f"(rounds {' '.join(f'{s:.2f}' for s in r['round_seconds'])}), users "
                        f"{r['users_per_round'][-1]}, peak RSS {r['ru_maxrss_mib']:.0f} MiB, "
                        f"load {r['load_average_after']:.2f}",
                        flush=True,
                    )
    wall = time.perf_counter() - t_all
    load_end = os.getloadavg()
    summary: dict = {}
    lines = [
        "| path | threads | s/round min | s/round median | T=1 / T, mins / medians "
        "| peak RSS MiB (max) | reps |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for path in a.paths:
        summary[path] = {}
        for t in a.threads:
            v = [r["s_per_round"] for r in runs if r["path"] == path and r["threads"] == t]
            summary[path][t] = {
                "s_per_round": v,
                "min": min(v),
                "median": statistics.median(v),
                "peak_rss_mib_max": max(
                    r["ru_maxrss_mib"] for r in runs if r["path"] == path and r["threads"] == t
                ),
            }
        base = summary[path][a.threads[0]]
        for t in a.threads:
            s = summary[path][t]
            s["speedup_mins"] = base["min"] / s["min"]
            s["speedup_medians"] = base["median"] / s["median"]
            lines.append(
                f"| {path} | {t} | {s['min']:.3f} | {s['median']:.3f} "
                f"| {s['speedup_mins']:.2f} / {s['speedup_medians']:.2f} "
                f"| {s['peak_rss_mib_max']:.0f} | {len(s['s_per_round'])} |"
            )
    table = "\n".join(lines)
    print("\n" + table)
    print(
        f"\nwall time {wall:.0f} s; load average {load_start[0]:.2f} at the start, "
        f"{load_end[0]:.2f} at the end",
        flush=True,
    )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(
            json.dumps(
                {
                    "command": shlex.join(sys.argv),
                    "args": {k: v for k, v in vars(a).items() if k not in ("worker", "out")},
                    "cpus": os.cpu_count(),
                    "load_average_start": load_start,
                    "load_average_end": load_end,
                    "wall_seconds": wall,
                    "table": table,
                    "summary": summary,
                    "runs": runs,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
