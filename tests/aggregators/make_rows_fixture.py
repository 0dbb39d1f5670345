"""Record the row estimators' releases on fixed small inputs and seeds (issue 40).

Run from the repository root at the commit whose outputs are to be recorded:

    .venv/bin/python tests/aggregators/make_rows_fixture.py

It writes ``tests/aggregators/data/rows_fixture.npz`` (inputs and outputs, and the commit it
ran at). The committed file was made at 5c7eba9, the last commit before the row estimators were
restructured for throughput; ``test_rows_fixture.py`` checks that the current code releases the
same values from the same inputs and seeds. The inputs are stored in the file, so the check does
not depend on how they were drawn.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fedudp.protocol.contributions import Sampling  # noqa: E402
from fedudp.aggregators.friendlycore import FriendlyCoreAggregator  # noqa: E402
from fedudp.aggregators.outlier import OutlierRemovalAggregator  # noqa: E402
from fedudp.aggregators.friend_counts import friend_counts  # noqa: E402
from fedudp.aggregators.rows import CohortRows  # noqa: E402
from fedudp.aggregators.winsorized import WinsorizedAggregator  # noqa: E402
from fedudp.aggregators.private_range import private_range  # noqa: E402

OUT = Path(__file__).resolve().parent / "data" / "rows_fixture.npz"
N, RECEIVED, D = 300, 280, 200  # public n, rows received (the rest: zero rows), width


def inputs() -> dict[str, np.ndarray]:
    g = torch.Generator().manual_seed(40)
    # label-like clusters: 70% around one centre, 20% around another, 10% spread out
    X = 0.3 * torch.randn(RECEIVED, D, generator=g, dtype=torch.float64) / math.sqrt(D)
    X[: int(0.2 * RECEIVED)] += 0.5 / math.sqrt(D)
    X[int(0.9 * RECEIVED) :] *= 6.0
    iid = torch.randn(RECEIVED, D, generator=g, dtype=torch.float64) / math.sqrt(D)
    return {"clustered": X.float().numpy(), "iid": iid.float().numpy()}


def winsorized(G: torch.Tensor, tau: float, bound: float, eps: float, seed: int, chunk):
    agg = WinsorizedAggregator(D, tau, bound, eps, Sampling(1.0, N))
    agg.chunk_rows = chunk
    a = agg.estimate(G, rng=torch.Generator().manual_seed(seed))
    return a.mean.numpy(), a.diagnostics["clipped_fraction"]


def outlier(G: torch.Tensor, tau: float, seed: int, rounds: int):
    agg = OutlierRemovalAggregator(tau, 2.0, 0.01, Sampling(1.0, N), 5.0, rounds, 1e-6, 1)
    rng = torch.Generator().manual_seed(seed)
    means, kept, scores = [], [], []
    for _ in range(rounds):
        a = agg.estimate(G, rng=rng)
        means.append(a.mean.numpy())
        kept.append(a.users_used)
        scores.append(a.diagnostics["score"])
        if a.halted:
            break
    return np.stack(means), np.array(kept), np.array(scores)


def friendly(G: torch.Tensor, tau: float, seed: int):
    agg = FriendlyCoreAggregator(tau, 2.0, 0.01, Sampling(1.0, N), 0.05, 1e-6, 1)
    a = agg.estimate(G, rng=torch.Generator().manual_seed(seed))
    return a.mean.numpy(), a.users_used, a.diagnostics["kept_mass_fraction"]


def main() -> None:
    torch.set_num_threads(1)
    data = inputs()
    out: dict[str, np.ndarray] = dict(data)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    out["commit"] = np.array(commit)
    for name, X in data.items():
        G = torch.from_numpy(X)
        # friend counts: distances around the radii, both orders (pruned and not)
        radii = (0.2, 0.3, 0.45, 0.6, 1.0)
        for prune in (True, False):
            c = friend_counts(CohortRows(G, N), radii, prune=prune)
            out[f"{name}/friend_counts/prune={prune}"] = c.numpy()
        out[f"{name}/friend_counts/radii"] = np.array(radii)
        # winsorized: nothing clipped (wide tau) and clipping (narrow tau), one chunk / chunks
        for tag, tau, bound, eps in (("wide", 0.5, 1.0, 1.0), ("narrow", 0.004, 0.2, 2.0)):
            for chunk in (None, 37):
                mean, frac = winsorized(G, tau, bound, eps, seed=7, chunk=chunk)
                out[f"{name}/winsorized/{tag}/chunk={chunk}/mean"] = mean
                out[f"{name}/winsorized/{tag}/chunk={chunk}/clipped_fraction"] = np.array(frac)
        # PrivateRange alone on the float64 matrix
        mu = private_range(
            G.double(), 0.01, 0.3, 0.5, rng=torch.Generator().manual_seed(3), chunk_elems=5000
        )
        out[f"{name}/private_range"] = mu.numpy()
        for tau in (0.15, 0.3, 0.6, 1.2, 2.0):
            means, kept, scores = outlier(G, tau, seed=11, rounds=3)
            out[f"{name}/outlier/tau={tau}/means"] = means
            out[f"{name}/outlier/tau={tau}/kept"] = kept
            out[f"{name}/outlier/tau={tau}/scores"] = scores
            mean, kept1, mass = friendly(G, tau, seed=13)
            out[f"{name}/friendlycore/tau={tau}/mean"] = mean
            out[f"{name}/friendlycore/tau={tau}/kept"] = np.array(kept1)
            out[f"{name}/friendlycore/tau={tau}/mass"] = np.array(mass)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT.relative_to(ROOT)} at {commit}: {len(out)} arrays")


if __name__ == "__main__":
    main()
