"""A federation with natural-looking users built from the real MNIST (or Fashion-MNIST) files,
written as an NPZ that ``fedudp dataset.name=npz`` reads (docs/results/natural_mnist).

Construction (all from ``--seed``):

* users: ``--users`` users whose record counts are drawn from a log-normal (median
  ``--median``, shape 1.0), rounded, clipped to [1, ``--max-records``];
* labels: each user draws a Dirichlet(``--label-alpha``) mixture over the 10 classes and takes
  its records from the training pool with those proportions (without replacement, non-IID);
* owners: ``--owners`` owners whose shares of the users come from a Dirichlet(1) draw (at least
  two users each), users dealt to owners at random by those shares;
* test records: fedudp holds out ``dataset.test_fraction`` of each user's records.

    .venv/bin/python scripts/reproductions/natural_mnist.py --data-root DATA --out /tmp/natural/mnist.npz
    # prints the public numbers to declare (public.users, public.owner_capacity, ...)
    .venv/bin/python scripts/reproductions/natural_mnist.py --report RUNS --plot OUT.png
    # accuracy per round of every run below RUNS (one line per method and epsilon)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def build(
    data_root: str,
    dataset: str,
    users: int,
    median: float,
    max_records: int,
    label_alpha: float,
    owners: int,
    seed: int,
) -> dict[str, np.ndarray]:
    from fedudp.data.idx import load_idx_dataset

    tx, ty, _, _ = load_idx_dataset(dataset, data_root)
    rng = np.random.default_rng(seed)
    sizes = np.clip(np.rint(rng.lognormal(np.log(median), 1.0, users)), 1, max_records).astype(int)
    pools = [list(rng.permutation(np.flatnonzero(ty == c))) for c in range(10)]
    idx, user = [], []
    for u, n in enumerate(sizes):
        mix = rng.dirichlet(np.full(10, label_alpha))
        for c in rng.choice(10, size=n, p=mix):
            while not pools[c]:  # a class ran out: take the next one
                c = (c + 1) % 10
            idx.append(pools[c].pop())
            user.append(u)
    idx, user = np.array(idx), np.array(user)
    share = rng.dirichlet(np.ones(owners))
    counts = np.maximum(2, np.floor(share * (users - 2 * owners)).astype(int) + 2)
    while counts.sum() > users:
        counts[np.argmax(counts)] -= 1
    while counts.sum() < users:
        counts[rng.integers(owners)] += 1
    owner_of_user = rng.permutation(np.repeat(np.arange(owners), counts))
    x = (tx[idx].astype(np.float32) / 255.0 - 0.1307) / 0.3081  # MNIST's usual scaling
    return {
        "x": x[:, None].astype(np.float32),
        "y": ty[idx].astype(np.int64),
        "user": user,
        "owner": owner_of_user[user],
    }


def plot(runs: str, out: str) -> None:
    """Mean test accuracy over owners per round, one line per run (method, epsilon)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import results_archive  # scripts/tools/: the committed runs are packed in the folder's raw.tar.xz

    for summary in results_archive.rglob(runs, "summary.json"):
        s = json.loads(results_archive.read_text(summary))
        metrics = results_archive.read_text(summary.parent / "metrics.jsonl")
        rows = [json.loads(x) for x in metrics.splitlines()]
        label = s["method"] + (f", eps = {s['target_epsilon']:g}" if s["target_epsilon"] else "")
        ax.plot(
            [r["round"] for r in rows], [r["accuracy_mean"] for r in rows], marker=".", label=label
        )
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy, mean over owners")
    ax.set_title("natural users from MNIST: 2,000 users of 1-107 records, 32 unequal owners")
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", help="a sweep folder: plot its runs (with --plot) and stop")
    ap.add_argument("--plot", help="the PNG to write with --report")
    ap.add_argument("--data-root", help="folder with the MNIST IDX files")
    ap.add_argument("--dataset", default="mnist", choices=["mnist", "fashion_mnist"])
    ap.add_argument("--out", help="the NPZ file to write")
    ap.add_argument("--users", type=int, default=2000)
    ap.add_argument("--median", type=float, default=5.0)
    ap.add_argument("--max-records", type=int, default=500)
    ap.add_argument("--label-alpha", type=float, default=0.3)
    ap.add_argument("--owners", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.report:
        plot(a.report, a.plot or "natural_mnist.png")
        return
    if not a.data_root or not a.out:
        ap.error("--data-root and --out are required to build the federation")
    arrays = build(
        a.data_root, a.dataset, a.users, a.median, a.max_records, a.label_alpha, a.owners, a.seed
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez(a.out, **arrays)
    per_user = np.bincount(arrays["user"])
    first = np.unique(arrays["user"], return_index=True)[1]
    per_owner = np.bincount(arrays["owner"][first])
    records_owner = np.bincount(arrays["owner"], minlength=a.owners)
    print(
        json.dumps(
            {
                "records": int(len(arrays["y"])),
                "users": int(len(per_user)),
                "owners": int(a.owners),
                "records_per_user": {
                    "min": int(per_user.min()),
                    "median": float(np.median(per_user)),
                    "max": int(per_user.max()),
                },
                "users_per_owner": {
                    "min": int(per_owner.min()),
                    "median": float(np.median(per_owner)),
                    "max": int(per_owner.max()),
                },
                "records_per_owner": {
                    "min": int(records_owner.min()),
                    "max": int(records_owner.max()),
                },
                "declare": {
                    "public.users": int(len(per_user)),
                    "public.owner_capacity": int(per_owner.max()),
                    "public.records_per_user": int(per_user.max()),
                    "dataset.classes": 10,
                    "dataset.input_shape": list(arrays["x"].shape[1:]),
                },
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
