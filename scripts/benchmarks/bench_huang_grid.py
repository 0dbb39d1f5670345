"""Benchmark: how long the one-seed MNIST Table 1 grid of Huang et al. (24 runs) takes on this machine.

The speed target: the 24 runs (n ∈ {4, 16, 64, 128, 256, 512} × per-silo, FedAvg, full-DP,
joint-DP; ``+experiment=huang_table1``, seed 0, certified, DP-SGD inside the owners) in under 2 hours
on the 2-core machine. A full grid takes hours and the grid's own wall times
(``docs/results/huang_table1/raw.tar.xz``: ``runs/grid_times.jsonl``) were taken over several sessions beside tests
and on older code, so this script measures every run's cost directly and projects it:

* each of the 24 configurations, exactly as ``scripts/reproductions/reproduce_huang.py`` composes it, is prepared
  (validation, data, partition, the accountant's calibration of z over the run's T rounds: timed),
  then its first ``--rounds`` rounds run through the real round loop with checkpoints as the grid
  writes them (timed: every round of a run trains the same E epochs over the same records and
  evaluates once, so the per-round time is the same in every round);
* projected run time = preparation + T × (seconds per round);
* the runs go through ``--workers`` processes of one torch thread each (the grid's two workers on
  the 2 cores, so each measurement sees the other worker's load), in the grid's order;
* the grid's projected wall time is the 24 projected runs list-scheduled on the workers in the
  grid's order (what ``reproduce_huang.py`` run once per core does), and with the longest first.

    # DATA: the folder holding mnist/ and fashion_mnist/ IDX files (or set FEDUDP_DATA instead)
    OMP_NUM_THREADS=1 .venv/bin/python scripts/benchmarks/bench_huang_grid.py --data-root DATA \
        --json docs/results/bench_dpsgd/grid.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "reproductions"))


def table1_runs() -> list[tuple[str, dict]]:
    """The 24 one-seed MNIST Table 1 runs, in the grid script's order: its runs with the preset's
    defaults only (seed 0, DP-SGD in the owners, certified; no ε, layer, m/r or clip override)."""
    import reproduce_huang as rh

    base = {
        "dataset.name",
        "partition.num_owners",
        "method",
        "seed",
        "privacy.placement",
        "privacy.accounting",
    }
    return [
        (name, over)
        for name, over in rh.grid(["mnist"])
        if set(over) == base
        and over["seed"] == 0
        and over["privacy.placement"] == "local_dpsgd"
        and over["privacy.accounting"] == "certified"
    ]


def measure(job: tuple[str, dict, str, int]) -> dict:
    """Prepare one run and time its first ``rounds`` rounds (one torch thread)."""
    name, over, data_root, rounds = job
    import torch

    torch.set_num_threads(1)
    import reproduce_huang as rh
    from fedudp.run import execute, prepare
    from fedudp.run_folder import checkpointer

    cfg = rh.compose(over, data_root, 1)
    T = int(cfg.train.rounds)
    t0 = time.perf_counter()
    p = prepare(cfg)
    prep = time.perf_counter() - t0
    p.cfg.train.rounds = min(rounds, T)  # z stays calibrated for the run's T rounds
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        execute(p, None, None, checkpointer(Path(out), cfg, p.settings))
        per_round = (time.perf_counter() - t0) / p.cfg.train.rounds
    return {
        "run": name,
        "prepare_s": round(prep, 2),
        "round_s": round(per_round, 2),
        "T": T,
        "E": int(cfg.train.local_epochs),
        "projected_s": round(prep + T * per_round, 1),
    }


def makespan(times: list[float], workers: int) -> float:
    """List scheduling: each run, in the given order, goes to the first free worker."""
    free = [0.0] * workers
    for t in times:
        heapq.heappush(free, heapq.heappop(free) + t)
    return max(free)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--data-root",
        default=os.environ.get("FEDUDP_DATA"),
        help="folder holding the IDX files (<root>/mnist/, <root>/fashion_mnist/); default: $FEDUDP_DATA",
    )
    ap.add_argument("--rounds", type=int, default=1, help="rounds timed per run")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--only", default="", help="substring of the run names to keep")
    ap.add_argument("--json", help="also write the per-run numbers here")
    a = ap.parse_args()
    if not a.data_root:
        raise SystemExit(
            "bench_huang_grid.py: error: --data-root <folder with the MNIST IDX files> is "
            "required (or set FEDUDP_DATA)"
        )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs = [r for r in table1_runs() if a.only in r[0]]
    t0 = time.time()
    with mp.get_context("spawn").Pool(a.workers, maxtasksperchild=1) as pool:
        got = {
            r["run"]: r
            for r in pool.imap_unordered(measure, [(n, o, a.data_root, a.rounds) for n, o in runs])
        }
    rows = [got[n] for n, _ in runs]
    proj = [r["projected_s"] for r in rows]
    grid_order = makespan(proj, a.workers)
    lpt = makespan(sorted(proj, reverse=True), a.workers)
    print("| run | E | T | prepare s | s per round | projected run s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['run']} | {r['E']} | {r['T']} | {r['prepare_s']:.1f} | {r['round_s']:.1f} | {r['projected_s']:,.0f} |"
        )
    print(f"\nsum of projected runs: {sum(proj):,.0f} s ({sum(proj) / 3600:.2f} worker-hours)")
    print(
        f"grid on {a.workers} workers, grid order: {grid_order:,.0f} s ({grid_order / 3600:.2f} h); "
        f"longest first: {lpt:,.0f} s ({lpt / 3600:.2f} h)"
    )
    print(f"(this measurement: {time.time() - t0:,.0f} s wall)")
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "runs": rows,
                    "sum_s": sum(proj),
                    "grid_order_s": grid_order,
                    "longest_first_s": lpt,
                    "workers": a.workers,
                    "rounds_timed": a.rounds,
                    "wall_s": time.time() - t0,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
