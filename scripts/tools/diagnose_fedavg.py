"""Tool: does standard FedAvg of the Huang grid fall short for lack of rounds or of tuning?

Answers, for one (dataset, n) of the grid: the accuracy curve under other learning rates, batch
sizes or round counts than Table 3's (written up for Fashion-MNIST n = 512 in
docs/results/huang_table1/fedavg_fashion_n512.md).

Runs fedudp itself (``+experiment=huang_table1``, ``method=fedavg``, seed 0, the grid's partition)
once per setting, each setting a comma-separated list of overrides of what the paper leaves
unspecified (``train.lr``, ``train.batch_size``) or, as a control, of Table 3's ``train.rounds``.
Prints the accuracy curve (mean over owners' test shards, global model) at a few rounds, so one
sees whether a setting is still climbing when Table 3's T rounds end. The first row should be the
grid's run (its metrics.jsonl is read and printed for comparison when present).

Usage:

    # DATA: the folder holding mnist/ and fashion_mnist/ IDX files (or set FEDUDP_DATA instead)
    OMP_NUM_THREADS=1 .venv/bin/python scripts/tools/diagnose_fedavg.py --data-root DATA --dataset fashion_mnist --n 512 \
        --settings train.lr=0.05 train.lr=0.2 train.batch_size=8 train.rounds=80
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "reproductions"))
sys.path.insert(0, str(ROOT / "scripts" / "tools"))
import results_archive  # noqa: E402  (scripts/tools/: the grid's runs, packed in raw.tar.xz)


def curve(metrics: Path, at: list[int]) -> list[str]:
    acc = {
        r["round"]: r["accuracy_mean"]
        for r in map(json.loads, results_archive.read_text(metrics).splitlines())
    }
    return [f"{acc[t]:.3f}" if t in acc else "" for t in at]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="fashion_mnist", choices=["mnist", "fashion_mnist"])
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument(
        "--settings",
        nargs="+",
        default=["train.lr=0.05"],
        help="comma-separated overrides per setting",
    )
    ap.add_argument("--at", type=int, nargs="+", default=[5, 10, 15, 20, 40, 80])
    ap.add_argument("--out", default="/tmp/diagnose_fedavg")
    ap.add_argument(
        "--data-root",
        default=os.environ.get("FEDUDP_DATA"),
        help="folder holding the IDX files (<root>/mnist/, <root>/fashion_mnist/); default: $FEDUDP_DATA",
    )
    a = ap.parse_args()
    if not a.data_root:
        raise SystemExit(
            "diagnose_fedavg.py: error: --data-root <folder with the MNIST IDX files> is "
            "required (or set FEDUDP_DATA)"
        )
    from reproduce_huang import compose
    from fedudp.run import run

    head = " | ".join(f"round {t}" for t in a.at)
    print(f"| setting | {head} | final | seconds |")
    print("|---|" + "---:|" * (len(a.at) + 2))
    grid_run = (
        ROOT
        / "docs/results/huang_table1/runs"
        / a.dataset
        / f"n{a.n}"
        / "fedavg_s0"
        / "metrics.jsonl"
    )
    if results_archive.is_file(grid_run):
        print(
            f"| the grid's run (lr 0.05, batch 32, Table 3's T) | {' | '.join(curve(grid_run, a.at))} | | |",
            flush=True,
        )
    for setting in a.settings:
        over = {"dataset.name": a.dataset, "partition.num_owners": a.n, "method": "fedavg"}
        over.update(kv.split("=", 1) for kv in setting.split(",") if kv)
        folder = Path(a.out) / a.dataset / f"n{a.n}" / setting.replace("/", "_")
        t0 = time.time()
        s = run(compose(over, a.data_root, 1), folder)
        secs = s.get("seconds", time.time() - t0)
        print(
            f"| {setting} | {' | '.join(curve(folder / 'metrics.jsonl', a.at))} | "
            f"{s['accuracy_mean']:.3f} | {secs:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
