"""Benchmark: per-user clipping without per-user gradients (``fedudp.owner.ghost``) against
today's one-step path and a non-private batched backward pass, on large models.

Server placement, clip + Gaussian (``method=full_dp aggregator=gaussian``), every user sampled,
one SGD step per user (one epoch, users of at most a batch of records: the one-step users of
``Owners._one_step_units``). Per configuration (model x users x records per user), one process
prepares the run through the library (``fedudp.build.prepare``, random MNIST-shaped records:
the cost does not depend on the values) and times, interleaved, ``--reps`` times each:

* ``old``: ``Owners.reply`` for the whole cohort with ``Kernels(ghost=False)`` (every user's
  vector built from one batched forward/backward, ``one_step``, then clipped with float64 norms
  and summed, ``make_reply``): the path before the ghost module;
* ``ghost``: the same call with ``Kernels(ghost=True)`` (the ghost path is checked to be taken,
  and its clipped sum to equal the old one to float tolerance);
* ``plain``: a non-private batched forward/backward over the same records in plain PyTorch
  (sum of the cross-entropies, chunks of ``--plain-chunk`` records, gradients accumulated);
* ``floor`` (``--floor``): the same non-private pass at its fastest known setting on this CPU,
  chunks of ``--floor-chunk`` records (128) with every convolution's output converted to
  channels-last memory format by a forward hook (what fedudp's per-record passes do on the
  CPU, ``fedudp.owner.kernels.Kernels.channels_last``): the strongest floor for the ratio.

The owner reply is the part of a round that differs between the paths (the billboard's noise
and the evaluation are the same on both and excluded). Reported: min and median seconds, the
per-user cost (median / users), the ratios old/ghost and ghost/plain, and the peak resident
memory of the process while each side runs (sampled every 5 ms from /proc; the prepared run's
memory included, which each side shares). Each side's seconds are wall and CPU (the process's
user + system time, ``time.process_time``: at one thread the better measure on a shared,
loaded machine, where wall time includes waiting for a core); a CPU row follows each wall row.

Models: ``mlp`` 784-1024-256-10 (1,068,810 parameters), ``wide_cnn`` conv 5x5 32 -> pool ->
conv 5x5 64 -> pool -> 3136-256-10 (857,738 parameters), ``cnn`` the paper CNN (44,628).

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python scripts/benchmarks/bench_ghost.py \\
        --configs mlp:500:1 mlp:10000:1 mlp:500:10 wide_cnn:500:1 wide_cnn:10000:1 \\
        wide_cnn:500:10 cnn:500:1 cnn:500:10 --reps 5 --threads 1 --json out.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def make_model(name: str):
    import torch.nn as nn

    if name == "mlp":
        return nn.Sequential(
            nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10)
        )
    if name == "wide_cnn":
        return nn.Sequential(
            nn.Unflatten(1, (1, 28, 28)),
            nn.Conv2d(1, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(3136, 256),
            nn.ReLU(),
            nn.Linear(256, 10),
        )
    if name == "cnn":
        from fedudp.models.cnn import PaperCNN

        return nn.Sequential(nn.Unflatten(1, (1, 28, 28)), PaperCNN())
    raise SystemExit(f"--configs: unknown model {name!r} (mlp, wide_cnn, cnn)")


class PeakRss:
    """The largest VmRSS of this process while the block runs (a sampling thread)."""

    def __enter__(self):
        from proctree import status_kib

        self._read = status_kib
        self.peak = status_kib("VmRSS")
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._read("VmRSS"))

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._read("VmRSS"))
        return False


def worker(
    model_name: str,
    users: int,
    rpu: int,
    reps: int,
    old_reps: int,
    chunk: int,
    floor_chunk: int | None = None,
) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F

    import dataclasses

    from fedudp.build import prepare
    from fedudp.config import RunConfig
    from fedudp.owner import ghost
    from fedudp.owner.kernels import Kernels

    torch.manual_seed(0)
    model = make_model(model_name)
    n = users * rpu
    cfg = RunConfig()
    cfg.progress = False
    cfg.method = "full_dp"
    cfg.aggregator = "gaussian"
    cfg.dataset.features = 784
    cfg.dataset.num_records = n
    cfg.dataset.pool_train = 3 * n + 2000  # the paper partition draws classes from a pool
    cfg.dataset.pool_test = 100
    cfg.partition.num_owners = 10
    cfg.partition.records_per_user = rpu
    cfg.train.rounds = 1
    cfg.train.batch_size = max(32, rpu)
    cfg.checkpoint.every = 0
    p = prepare(cfg, model_object=model)
    fed, owners = p.fed, p.owners
    assert p.aggregator is not None and p.billboard is not None
    constraint = p.aggregator.constraint
    shared = p.billboard.shared_params()
    units = np.arange(fed.num_users)
    d = owners.shared_dim
    calls: list[int] = []
    forms: dict[str, str] = {}
    orig = ghost.ghost_gradients

    def counted(*a, **k):
        calls.append(1)
        out = orig(*a, **k)
        forms.update(out.forms)
        return out

    ghost.ghost_gradients = counted
    plain_model = copy.deepcopy(owners.model).requires_grad_(True)
    x, y = fed.x[:n], fed.y[:n]

    def run_old():
        owners.training = dataclasses.replace(owners.training, kernels=Kernels(ghost=False))
        return owners.reply(fed, shared, {}, units, 1, constraint)

    def run_ghost():
        owners.training = dataclasses.replace(owners.training, kernels=Kernels(ghost=True))
        calls.clear()
        out = owners.reply(fed, shared, {}, units, 1, constraint)
        assert calls, "the ghost path was not taken"
        return out

    def run_plain(m=plain_model, chunk=chunk):
        m.zero_grad(set_to_none=True)
        for s in range(0, n, chunk):
            F.cross_entropy(m(x[s : s + chunk]), y[s : s + chunk], reduction="sum").backward()
        return None

    sides = [("old", run_old), ("ghost", run_ghost), ("plain", run_plain)]
    if floor_chunk:
        floor_model = copy.deepcopy(owners.model).requires_grad_(True)
        for m in floor_model.modules():
            if isinstance(m, torch.nn.Conv2d):
                m.register_forward_hook(
                    lambda mod, i, o: o.contiguous(memory_format=torch.channels_last)
                )
        sides.append(("floor", lambda: run_plain(floor_model, floor_chunk)))
    times: dict[str, list[float]] = {k: [] for k, _ in sides}
    cpu: dict[str, list[float]] = {k: [] for k, _ in sides}
    peak: dict[str, int] = {k: 0 for k, _ in sides}
    replies = {}
    for r in range(reps):
        for side, fn in sides:
            if side == "old" and r >= old_reps:
                continue
            with PeakRss() as pk:
                t, c = time.perf_counter(), time.process_time()
                out = fn()
                times[side].append(time.perf_counter() - t)
                cpu[side].append(time.process_time() - c)
            peak[side] = max(peak[side], pk.peak)
            if out is not None:
                replies[side] = out
    a, b = replies["ghost"].contribution, replies["old"].contribution
    assert a.total is not None and b.total is not None
    diff = float((a.total - b.total).abs().max())
    scale = float(b.total.abs().max())
    assert (a.count, a.clipped) == (b.count, b.clipped), (
        (a.count, a.clipped),
        (b.count, b.clipped),
    )
    return {
        "model": model_name,
        "params": d,
        "users": users,
        "records_per_user": rpu,
        "threads": torch.get_num_threads(),
        "times": times,
        "cpu_times": cpu,
        "peak_rss_mib": {k: v / 1024 for k, v in peak.items()},
        "max_abs_diff": diff,
        "max_abs_total": scale,
        "clipped": a.clipped,
        "count": a.count,
        "forms": forms,
        "floor_chunk": floor_chunk,
    }


def summarize(rec: dict, key: str = "times") -> str:
    """One table row of ``rec``'s wall (``times``) or CPU (``cpu_times``) seconds."""
    t = rec[key]
    mn = {k: min(v) for k, v in t.items()}
    md = {k: statistics.median(v) for k, v in t.items()}
    U = rec["users"]
    return (
        f"| {rec['model']} | {rec['params']:,} | {U:,} | {rec['records_per_user']} "
        f"| {mn['old']:.3f} / {md['old']:.3f} ({len(t['old'])}) "
        f"| {mn['ghost']:.3f} / {md['ghost']:.3f} | {mn['plain']:.3f} / {md['plain']:.3f} "
        f"| {1e3 * md['old'] / U:.2f} | {1e3 * md['ghost'] / U:.3f} "
        f"| {md['old'] / md['ghost']:.1f} | {md['ghost'] / md['plain']:.2f} "
        f"| {rec['peak_rss_mib']['old']:.0f} / {rec['peak_rss_mib']['ghost']:.0f} / "
        f"{rec['peak_rss_mib']['plain']:.0f} |"
    )


HEADER = (
    "| model | parameters | users | records/user | old s (min / median, reps) | ghost s "
    "(min / median) | plain s (min / median) | old ms/user | ghost ms/user | old/ghost "
    "| ghost/plain | peak RSS MiB old / ghost / plain |\n|" + "---|" * 12
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--configs", nargs="+", default=["mlp:500:1"], help="model:users:records_per_user"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--old-reps", type=int, default=None, help="reps of the old path (default --reps)"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--plain-chunk", type=int, default=512)
    ap.add_argument("--floor", action="store_true", help="also time the floor side (module doc)")
    ap.add_argument("--floor-chunk", type=int, default=128)
    ap.add_argument("--json", default=None, help="append one JSON line per configuration")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        m, u, k = args.worker.split(":")
        rec = worker(
            m,
            int(u),
            int(k),
            args.reps,
            args.old_reps or args.reps,
            args.plain_chunk,
            args.floor_chunk if args.floor else None,
        )
        print("RESULT " + json.dumps(rec), flush=True)
        return
    print(HEADER, flush=True)
    for c in args.configs:
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        cmd = [sys.executable, __file__, "--worker", c, "--reps", str(args.reps), "--threads",
               str(args.threads), "--plain-chunk", str(args.plain_chunk)]  # fmt: skip
        if args.floor:
            cmd += ["--floor", "--floor-chunk", str(args.floor_chunk)]
        if args.old_reps:
            cmd += ["--old-reps", str(args.old_reps)]
        t0 = time.time()
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
        if res.returncode or not line:
            print(f"{c}: failed ({res.returncode})\n{res.stderr[-3000:]}", file=sys.stderr)
            continue
        rec = json.loads(line[-1][7:])
        rec["wall_s"] = time.time() - t0
        rec["loadavg"] = os.getloadavg()
        print(summarize(rec), flush=True)
        print(summarize(rec, "cpu_times").replace("| ", "| CPU: ", 1), flush=True)
        if "floor" in rec["times"]:
            f, g = rec["times"]["floor"], rec["times"]["ghost"]
            print(
                f"floor s (min / median): {min(f):.3f} / {statistics.median(f):.3f}; "
                f"ghost / floor {statistics.median(g) / statistics.median(f):.2f}",
                flush=True,
            )
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
