"""Benchmark: personal training and evaluation at the owners' speed (issue 40), on the
natural-user MNIST federation of docs/results/natural_mnist (2,000 users, 32 owners; built by
``scripts/reproductions/natural_mnist.py --out FED.npz``), the paper CNN, one torch thread.

Timed in one process, interleaved, ``--reps`` counted repetitions after one warm-up:

* ``per_silo personal_round``: every owner's epoch of SGD on the whole model over all its
  records (``Owners.personal_round``, method=per_silo);
* ``fedavg owner_deltas (all owners)``: FedAvg's owner training of every owner, the same
  records, epochs, batch and learning rate (``Owners.owner_deltas`` over all 32 owners);
* ``joint_dp personal_round``: joint DP's personal step (``fc1.*`` trained, the rest frozen at
  the broadcast) over all records;
* evaluation of every owner's test shard (``Owners.evaluate``) for per_silo and joint_dp on the
  per-owner loop (``evaluation.evaluate_sums`` path ``auto``) and on the vmapped forward
  (``vmap``, the path before issue 40), and FedAvg's (no personal parameters).

    .venv/bin/python scripts/benchmarks/bench_personal.py --npz FED.npz --reps 5 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def cfg(method: str, npz: str):
    from fedudp.config import RunConfig

    c = RunConfig()
    c.progress = False
    c.method = method
    c.engine = "local"
    c.dataset.name, c.dataset.path, c.dataset.columns.owner = "npz", npz, "owner"
    c.partition.owner_rule, c.partition.num_owners = "given", 32
    c.public.users, c.public.owner_capacity, c.public.records_per_user = 2000, 273, 107
    c.dataset.classes, c.dataset.input_shape = 10, [1, 28, 28]
    c.model.name, c.model.personal = "cnn", ["fc1.*"]
    c.train.rounds, c.train.sampling_rate = 2, 0.2
    c.train.lr, c.train.batch_size = 0.05, 16
    c.privacy.clip, c.privacy.delta, c.privacy.epsilon = 0.5, 1e-5, 1.0
    c.engine_opts.threads = 1
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--npz", required=True, help="the natural MNIST federation (natural_mnist.py)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="write the timings here")
    a = ap.parse_args()
    if not Path(a.npz).is_file():
        ap.error(f"--npz: no file {a.npz} (build it with scripts/reproductions/natural_mnist.py)")

    from fedudp import build
    from fedudp.owner import evaluation

    torch.set_num_threads(1)
    P = {m: build.prepare(cfg(m, a.npz)) for m in ("per_silo", "fedavg", "joint_dp")}
    fed = P["fedavg"].fed
    O = fed.num_owners
    shared_f = P["fedavg"].billboard.shared_params()
    shared_j = P["joint_dp"].billboard.shared_params()
    silo, fedavg, joint = P["per_silo"].owners, P["fedavg"].owners, P["joint_dp"].owners
    everyone = np.arange(O)
    # the trained personal parameters of round 1 (evaluated below)
    p_silo = silo.personal_round(fed, {}, silo.initial_personal(O), 1)
    p_joint = joint.personal_round(fed, shared_j, joint.initial_personal(O), 1)
    real = evaluation.evaluate_sums

    def vmapped(*args, **kw):
        return real(*args, **{**kw, "path": "vmap"})

    def evaluate(owners, shared, personal, path):
        evaluation.evaluate_sums = real if path == "auto" else vmapped
        try:
            return owners.evaluate(fed, shared, personal)
        finally:
            evaluation.evaluate_sums = real

    tasks = {
        "per_silo personal_round": lambda: silo.personal_round(
            fed, {}, silo.initial_personal(O), 1
        ),
        "fedavg owner_deltas (all owners)": lambda: fedavg.owner_deltas(
            fed,
            shared_f,
            {},
            everyone,
            1,
            None,  # type: ignore[arg-type]  # owner_sgd: unused
        ),
        "joint_dp personal_round": lambda: joint.personal_round(
            fed, shared_j, joint.initial_personal(O), 1
        ),
        "per_silo evaluate (loop)": lambda: evaluate(silo, {}, p_silo, "auto"),
        "per_silo evaluate (vmap, before)": lambda: evaluate(silo, {}, p_silo, "vmap"),
        "joint_dp evaluate (loop)": lambda: evaluate(joint, shared_j, p_joint, "auto"),
        "joint_dp evaluate (vmap, before)": lambda: evaluate(joint, shared_j, p_joint, "vmap"),
        "fedavg evaluate": lambda: fedavg.evaluate(fed, shared_f, {}),
    }
    seconds: dict[str, list[float]] = {k: [] for k in tasks}
    loads = []
    for rep in range(a.reps + 1):
        for name, task in tasks.items():
            loads.append(os.getloadavg()[0])
            t0 = time.perf_counter()
            task()
            dt = time.perf_counter() - t0
            if rep:
                seconds[name].append(dt)
        print(f"rep {rep} done", file=sys.stderr)
    # the two evaluation paths agree (accuracy exactly, loss to float rounding)
    for owners, shared, personal in ((silo, {}, p_silo), (joint, shared_j, p_joint)):
        acc_l, loss_l = evaluate(owners, shared, personal, "auto")
        acc_v, loss_v = evaluate(owners, shared, personal, "vmap")
        assert np.array_equal(acc_l, acc_v, equal_nan=True)
        assert np.allclose(loss_l, loss_v, rtol=1e-5, equal_nan=True)
    rows = {
        k: {"min": min(v), "median": statistics.median(v), "all": v} for k, v in seconds.items()
    }
    print("| what | seconds min | median |")
    print("|---|---:|---:|")
    for k, r in rows.items():
        print(f"| {k} | {r['min']:.2f} | {r['median']:.2f} |")
    load = {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}
    print(f"load average (1 min) at each task's start: {load}")
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {"records": int(len(fed.y)), "owners": O, "seconds": rows, "load": load}, indent=1
            )
        )


if __name__ == "__main__":
    main()
