"""Row (a) of the privacy audit table (issue 49): owner-side DP-SGD and the Flower fast path on a
model that mixes the records of a batch (``fc(x - x.mean(0))``, ``nn.Linear`` only) and on the
plain one (``fc(x)``).

For each model and each batched kernel (DP-SGD's one-pass ``per_sample``, ghost clipping, the
Flower fast path's ``TorchTraining`` one-step updates clipped and summed as the mod does):

* the sensitivity of the owner's clipped sum to removing one user, noise-free, in units of the
  clip C: ``max_u ||S(D) - S(D without u)|| / C`` over every user u of a step of B users (one
  record each, features scaled so that every user's gradient is clipped), the kernel run
  directly (the check bypassed: what ran before issue 49);
* what the public entry does now: ``fedudp.build.prepare`` with ``privacy.placement=local_dpsgd``
  and ``TorchTraining.updates`` (refused, with the message; the plain model accepted);
* an ε lower bound at a claimed ε = 1 from ``fedudp.audit.audit_local_dpsgd`` (one owner of B
  users, B users per step: one Gaussian step) for the plain model, and for the mixing model with
  the check switched off (the hole as it was) and on (refused).

Writes ``docs/results/privacy_audit/paths_independence.jsonl`` (one line per row) and prints the
Markdown table. Usage::

    python scripts/reproductions/paths_independence.py [--trials 3000] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
FEATURES, CLASSES = 6, 3
OUTLIER = 100.0  # user 0's features scaled by this in the canary rows


class Plain(nn.Module):
    """``fc(x)``."""

    def __init__(self, input_shape=(FEATURES,), classes=CLASSES):
        super().__init__()
        self.fc = nn.Linear(int(input_shape[0]), int(classes))

    def forward(self, x):
        return self.fc(x)


class MeanCentred(Plain):
    """``fc(x - x.mean(0))``: mixes the records of a batch."""

    def forward(self, x):
        return self.fc(x - x.mean(0))


def _records(users: int, seed: int, outlier: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One record per user, features N(0, 50²) (every gradient clipped at C = 1); user 0's
    scaled by ``outlier`` (a canary far from the others)."""
    g = torch.Generator().manual_seed(seed)
    x = 50.0 * torch.randn(users, FEATURES, generator=g, dtype=torch.float64)
    x[0] *= outlier
    y = torch.randint(0, CLASSES, (users,), generator=g)
    return x, y


def _clipped_sum(rows: torch.Tensor, clip: float) -> torch.Tensor:
    from fedudp.privacy.mechanisms import clip_factors

    factor, _ = clip_factors([rows], clip)
    return (factor.unsqueeze(1) * rows).sum(0)


def owner_sum(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float):
    """The owner's clipped sum (one step, every user in it, one record each), by ``kind``."""
    from fedudp.owner import dpsgd

    names = tuple(n for n, _ in model.named_parameters())
    params = {k: v.detach() for k, v in model.named_parameters()}
    starts, sizes = np.arange(len(y)), np.ones(len(y), dtype=np.int64)
    if kind in ("per_sample", "ghost"):
        per_owner = {k: v.unsqueeze(0) for k, v in params.items()}  # owner 0 of one
        total, _ = dpsgd._owner_clipped_sum(
            model, per_owner, {}, {}, x, y, starts, sizes, 0, names, clip, kind == "ghost"
        )
        return total.double()
    assert kind == "fast"  # TorchTraining's one-step updates, clipped and summed as the mod does
    from fedudp.flower.fast import TorchTraining

    t = TorchTraining(model, lambda u, n: (x[u : u + 1], y[u : u + 1]), lr=1.0)
    t.check_independent = lambda x: None  # the check bypassed: the kernel as it ran before
    arrays = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    G, _, raised = t.updates(arrays, names, list(range(len(y))), len(y), {})
    assert not raised
    return _clipped_sum(G, clip)


def sensitivity(
    kind: str, make, users: int, seed: int = 0, clip: float = 1.0, outlier: float = 1.0
) -> float:
    """``max_u ||S(D) - S(D without u)|| / C`` (module doc)."""
    torch.manual_seed(seed)
    model = make().double()
    x, y = _records(users, seed, outlier)
    full = owner_sum(kind, model, x, y, clip)
    worst = 0.0
    for u in range(users):
        keep = torch.arange(users) != u
        worst = max(worst, float((full - owner_sum(kind, model, x[keep], y[keep], clip)).norm()))
    return worst / clip


def refusals(make) -> dict[str, str]:
    """What the public entry does with the model now: prepare (local_dpsgd) and the fast path."""
    from fedudp.build import prepare
    from fedudp.config import ConfigError, config_from_overrides
    from fedudp.flower.fast import TorchTraining

    out = {}
    over = {
        "method": "full_dp",
        "privacy.placement": "local_dpsgd",
        "dataset.name": "synthetic",
        "partition.scheme": "iid",
        "dataset.features": FEATURES,
        "dataset.classes": CLASSES,
        "train.rounds": 1,
        "progress": False,
    }
    try:
        prepare(config_from_overrides(over), model_object=make())
        out["prepare"] = "accepted"
    except ConfigError as e:
        out["prepare"] = str(e)
    x, y = _records(4, 0)
    model = make()
    t = TorchTraining(model, lambda u, n: (x[u : u + 1].float(), y[u : u + 1]), lr=0.1)
    arrays = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    try:
        t.updates(arrays, ("fc.weight", "fc.bias"), [0, 1, 2, 3], 4, {})
        out["fast"] = "accepted"
    except ValueError as e:
        out["fast"] = str(e)
    return out


def audit(target: str, users: int, trials: int, bypass: bool) -> dict:
    """``audit_local_dpsgd`` at a claimed ε = 1: one owner of ``users`` users, all in one step."""
    from fedudp.audit import audit_local_dpsgd
    from fedudp.config import ConfigError
    from fedudp.owner import independence

    over = {"model.target": target, "train.batch_size": users, "privacy.epsilon": 1.0}
    saved = independence.check
    if bypass:
        independence.check = lambda *a, **k: None  # the hole as it was (weakened twin)
    try:
        r = audit_local_dpsgd(over, users, trials, seed=0)
    except ConfigError as e:
        return {"refused": str(e)}
    finally:
        independence.check = saved
    return {
        "claimed_epsilon": r.claimed_epsilon,
        "lower_bound": r.lower_bound,
        "violation": r.violation,
        "trials": trials,
        "seconds": round(r.seconds, 1),
        "gaussian_by_construction": r.gaussian_by_construction,
        "canary_norm_over_C": round(r.canary_norm, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=3000, help="releases per side of each audit")
    ap.add_argument(
        "--out", default=str(ROOT / "docs/results/privacy_audit/paths_independence.jsonl")
    )
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = []
    models = {
        "fc(x - x.mean(0))": (MeanCentred, "__main__.MeanCentred"),
        "fc(x)": (Plain, "__main__.Plain"),
    }
    for label, (make, target) in models.items():
        sens = {
            f"{k}_B{b}{'_outlier' if o > 1 else ''}": round(sensitivity(k, make, b, outlier=o), 4)
            for k in ("per_sample", "ghost", "fast")
            for b in (8, 32)
            for o in (1.0, OUTLIER)
        }
        now = refusals(make)
        row = {"model": label, "sensitivity_over_C": sens, "now": now}
        row["audit"] = audit(target, 8, a.trials, bypass=False)
        if label.startswith("fc(x -"):
            row["audit_check_bypassed"] = audit(target, 8, a.trials, bypass=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
    wall = time.perf_counter() - t0
    cmd = "python scripts/reproductions/paths_independence.py" + (
        f" --trials {a.trials}" if a.trials != 3000 else ""
    )
    with open(a.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({**r, "command": cmd, "wall_s": round(wall, 1)}) + "\n")
    print(f"wall {wall:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
