"""Tool: why do owner-side DP-SGD runs of the Huang grid end near chance?

Answers, for finished ``local_dpsgd`` run folders: how far the shared parameters walked from
their initial values against the walk the DP-SGD noise alone predicts, and how many ReLU units
still fire (written up in docs/results/huang_table1/dp_collapse.md).

For finished ``local_dpsgd`` runs of ``scripts/reproductions/reproduce_huang.py`` whose last checkpoints are
still on disk (``ckpt-*.pt``, kept out of git), this compares the billboard's shared parameters
``u`` with the run's seeded initial ``u0`` (rebuilt from the same config) and with what the
DP-SGD noise alone predicts:

* owner j's step adds N(0, (zC)^2 I) / (q_j m_j) times lr to its shared parameters,
  ceil(m_j/B) steps per epoch, E epochs per round; the billboard averages the n owners' deltas
  uniformly, so after r rounds the noise part of u - u0 has per-coordinate std
  sqrt(r * E * sum_j ceil(m_j/B) (lr z C / (q_j m_j))^2) / n  (a Gaussian random walk);
* observed: the std of u - u0 over the shared coordinates (noise plus the gradients' drift),
  and, on 2,000 training images, the fraction of the CNN's ReLU units that fire after conv1
  and conv2 (the shared layers) and of the flattened features that never fire: the ones FC1
  and FC2 see.

Usage:

    # DATA: the folder holding mnist/ and fashion_mnist/ IDX files (or set FEDUDP_DATA instead)
    OMP_NUM_THREADS=1 .venv/bin/python scripts/tools/diagnose_dp_collapse.py --data-root DATA \\
        mnist/n4/joint_dp_local_dpsgd_certified_s0 mnist/n4/full_dp_local_dpsgd_certified_s0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "reproductions"))
sys.path.insert(0, str(ROOT / "scripts" / "tools"))
import results_archive  # noqa: E402  (scripts/tools/: the grid's runs, packed in raw.tar.xz)


def predicted_noise_std(
    users: np.ndarray, batch: int, lr: float, z: float, clip: float, epochs: int, rounds: int
) -> float:
    """Per-coordinate std of the DP-SGD noise accumulated in the billboard's u after ``rounds``."""
    steps = -(-users // batch)
    per_step = lr * z * clip / np.minimum(batch, users)  # q_j m_j = min(B, m_j)
    return float(np.sqrt(rounds * epochs * np.sum(steps * per_step**2)) / len(users))


def relu_activity(model, x: torch.Tensor) -> tuple[float, float, float]:
    """(conv1 ReLU firing rate, conv2 ReLU firing rate, fraction of flat features never firing)."""
    with torch.no_grad():
        a1 = F.relu(model.conv1(x))
        a2 = F.relu(model.conv2(F.max_pool2d(a1, 2)))
        h = F.max_pool2d(a2, 2).flatten(1)
    return (
        float((a1 > 0).float().mean()),
        float((a2 > 0).float().mean()),
        float((h.abs().sum(0) == 0).float().mean()),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run names of scripts/reproductions/reproduce_huang.py")
    ap.add_argument("--dir", default=str(ROOT / "docs" / "results" / "huang_table1" / "runs"))
    ap.add_argument(
        "--data-root",
        default=os.environ.get("FEDUDP_DATA"),
        help="folder holding the IDX files (<root>/mnist/, <root>/fashion_mnist/); default: $FEDUDP_DATA",
    )
    a = ap.parse_args()
    if not a.data_root:
        raise SystemExit(
            "diagnose_dp_collapse.py: error: --data-root <folder with the MNIST IDX files> is "
            "required (or set FEDUDP_DATA)"
        )
    torch.set_num_threads(1)
    from reproduce_huang import compose, grid
    from fedudp.protocol.checkpoint import load_file
    from fedudp.run import prepare

    overrides = dict(grid(["mnist", "fashion_mnist"]))
    print(
        "| run | round | accuracy | noise std predicted | std of u − u0 | conv1 ReLU firing | "
        "conv2 ReLU firing | flat features never firing |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in a.runs:
        folder = Path(a.dir) / name
        summary = json.loads(results_archive.read_text(folder / "summary.json"))
        if summary.get("placement") != "local_dpsgd":
            raise SystemExit(f"{name}: not a privacy.placement=local_dpsgd run")
        acc = {
            json.loads(l)["round"]: json.loads(l)["accuracy_mean"]
            for l in results_archive.read_text(folder / "metrics.jsonl").splitlines()
            if l.strip()
        }
        p = prepare(compose(overrides[name], a.data_root, 1))
        cfg, bb, model = p.cfg, p.billboard, p.owners.model
        u0 = bb.u.detach().clone().to(torch.float64)
        users = np.diff(np.asarray(p.fed.owner_offsets)).astype(np.int64)
        x = p.fed.x[:2000]
        for ck in sorted(folder.glob("ckpt-*.pt")):
            state = load_file(ck)
            r = int(state["round"])
            u = torch.as_tensor(state["billboard"]["u"])
            bb.u.copy_(u.to(bb.u.dtype))
            model.load_state_dict({**model.state_dict(), **bb.shared_params()})
            pred = predicted_noise_std(
                users,
                cfg.train.batch_size,
                cfg.train.lr,
                float(summary["noise_multiplier"]),
                cfg.privacy.clip,
                cfg.train.local_epochs,
                r,
            )
            obs = float((u.to(torch.float64) - u0).std())
            f1, f2, dead = relu_activity(model, x)
            print(
                f"| {name} | {r} | {acc.get(r, float('nan')):.3f} | {pred:.2f} | {obs:.2f} | "
                f"{f1:.3f} | {f2:.3f} | {dead:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
