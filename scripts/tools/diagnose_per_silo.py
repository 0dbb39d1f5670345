"""Tool: does per-silo training of the Huang grid fall short for lack of epochs or of tuning?

Answers, for one (dataset, n) of the grid: each of the first owners' test accuracy under other
(epochs, lr) than the grid's, cheaply (written up for MNIST n = 512 and Fashion-MNIST n = 64 in
docs/results/huang_table1/per_silo_n512.md and per_silo_fashion_n64.md).

Per-silo trains each owner alone, so a subset of owners answers cheaply: the first ``--owners``
owners of the ``+experiment=huang_table1`` partition at ``--n`` (same records, classes, test
shards), each trained here with plain PyTorch minibatch SGD (batch 32) from the run's seeded
initial CNN, for each (epochs, lr) asked, and evaluated on its own test shard. The first row
(E·T = 100 epochs, lr 0.05) is the grid's setting, checked against that run's owners.csv.

Usage:

    # DATA: the folder holding mnist/ and fashion_mnist/ IDX files (or set FEDUDP_DATA instead)
    OMP_NUM_THREADS=1 .venv/bin/python scripts/tools/diagnose_per_silo.py --data-root DATA --n 512 --owners 64
    OMP_NUM_THREADS=1 .venv/bin/python scripts/tools/diagnose_per_silo.py --data-root DATA --dataset fashion_mnist --n 64 --owners 16
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "reproductions"))
sys.path.insert(0, str(ROOT / "scripts" / "tools"))
import results_archive  # noqa: E402  (scripts/tools/: the grid's runs, packed in raw.tar.xz)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="mnist", choices=["mnist", "fashion_mnist"])
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--owners", type=int, default=64)
    ap.add_argument(
        "--settings",
        nargs="+",
        default=["100:0.05", "400:0.05", "100:0.2", "1000:0.05"],
        help="epochs:lr pairs",
    )
    ap.add_argument(
        "--data-root",
        default=os.environ.get("FEDUDP_DATA"),
        help="folder holding the IDX files (<root>/mnist/, <root>/fashion_mnist/); default: $FEDUDP_DATA",
    )
    a = ap.parse_args()
    if not a.data_root:
        raise SystemExit(
            "diagnose_per_silo.py: error: --data-root <folder with the MNIST IDX files> is "
            "required (or set FEDUDP_DATA)"
        )
    torch.set_num_threads(1)
    from reproduce_huang import compose
    from fedudp.run import prepare

    p = prepare(
        compose(
            {"dataset.name": a.dataset, "partition.num_owners": a.n, "method": "per_silo"},
            a.data_root,
            1,
        )
    )
    fed, model = p.fed, p.owners.model
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    run_csv = (
        ROOT
        / "docs/results/huang_table1/runs"
        / a.dataset
        / f"n{a.n}"
        / "per_silo_s0"
        / "owners.csv"
    )
    if results_archive.is_file(run_csv):
        rows = list(csv.DictReader(io.StringIO(results_archive.read_text(run_csv))))
        key = next(k for k in rows[0] if "acc" in k)
        ran = np.mean([float(r[key]) for r in rows[: a.owners]])
        print(
            f"the grid run's per-silo accuracy on these {a.owners} owners (owners.csv): {ran:.3f}"
        )
    print("| epochs | lr | mean test accuracy over owners | train accuracy | seconds |")
    print("|---:|---:|---:|---:|---:|")
    for s in a.settings:
        epochs, lr = int(s.split(":")[0]), float(s.split(":")[1])
        t0, acc, tr = time.time(), [], []
        for j in range(a.owners):
            sh = fed.owner(j)
            net = type(model)().to(torch.float32)
            net.load_state_dict(init)
            opt = torch.optim.SGD(net.parameters(), lr=lr)
            rng = np.random.default_rng(j)
            m = len(sh.y)
            for _ in range(epochs):
                perm = rng.permutation(m)
                for b in range(0, m, 32):
                    idx = torch.from_numpy(perm[b : b + 32])
                    opt.zero_grad()
                    F.cross_entropy(net(sh.x[idx]), sh.y[idx]).backward()
                    opt.step()
            with torch.no_grad():
                acc.append(float((net(sh.x_test).argmax(1) == sh.y_test).float().mean()))
                tr.append(float((net(sh.x).argmax(1) == sh.y).float().mean()))
        print(
            f"| {epochs} | {lr:g} | {np.mean(acc):.3f} | {np.mean(tr):.3f} | {time.time() - t0:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
