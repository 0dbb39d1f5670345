"""Benchmark: a round of distributed DP (ddgauss, skellam at 16 bits, owners adding integer
noise shares under simulated secure aggregation) against a round of central DP (the server's
clip + Gaussian) on the same setup, sides interleaved in one process, ``--reps`` repetitions
(min and median of the per-round seconds, and of the per-rep ratios).

Setups: those of ``scripts/reproductions/distributed_dp.py`` (``huang64``: Huang et al.'s
n = 64 joint-DP MNIST setup; ``natural``: the natural-user federation of
docs/results/natural_mnist), each rep one run of ``--rounds`` rounds at ε = 8, no dropout;
the per-round time is the metrics' ``seconds`` of each round (owners' work, the release and
the evaluation; the data is loaded before the clock starts), the mean over the run's rounds.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/benchmarks/bench_distributed.py \\
        --data-root DATA --setup huang64 --reps 5 --out docs/results/distributed_dp/speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "reproductions"))
import distributed_dp  # noqa: E402  (the grid's setups and config composition)

MECHS = ("central", "ddgauss", "skellam")


def one(setup: str, mech: str, a: argparse.Namespace) -> float:
    """Mean seconds per round of one run."""
    from fedudp.run import run

    over = distributed_dp.overrides(setup, mech, 16, 0.0, 8.0)
    over["train.rounds"] = a.rounds
    name = distributed_dp.run_name(setup, mech, 16, 0.0, 8.0)
    with tempfile.TemporaryDirectory() as tmp:
        s = run(distributed_dp.compose(name, over, a), Path(tmp) / "run")
        assert s["stop_reason"] == "completed", s
        rows = [
            json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
        ]
    secs = [float(r["seconds"]) for r in rows if "seconds" in r and r.get("round", 0) >= 1]
    return sum(secs) / len(secs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-root", help="MNIST IDX folder (huang64)")
    ap.add_argument("--fed", help="natural_mnist.py's FED.npz (natural)")
    ap.add_argument("--setup", choices=("huang64", "natural"), default="huang64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="a JSON file for the numbers")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    t0 = time.time()
    per: dict[str, list[float]] = {m: [] for m in MECHS}
    for rep in range(a.reps):
        order = MECHS if rep % 2 == 0 else MECHS[::-1]  # interleaved, alternating order
        for m in order:
            per[m].append(one(a.setup, m, a))
            print(json.dumps({"rep": rep, "mechanism": m, "s_per_round": per[m][-1]}), flush=True)
    out = {
        "setup": a.setup,
        "reps": a.reps,
        "rounds_per_rep": a.rounds,
        "threads": a.threads,
        "wall_s": round(time.time() - t0, 1),
        "s_per_round": {
            m: {"min": min(v), "median": statistics.median(v), "all": v} for m, v in per.items()
        },
        "ratio_to_central": {
            m: {
                "min": min(r := [x / c for x, c in zip(per[m], per["central"])]),
                "median": statistics.median(r),
            }
            for m in MECHS[1:]
        },
    }
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
