"""Rate check: user-level DP gradient descent on a synthetic convex problem with the
winsorized ([LEVY] Alg. 3) and outlier-removal ([ASI] Alg. 2 inside Alg. 3, smooth loss, r = 0)
estimators; excess population loss as the samples per user m grow at fixed n, ε, with the
papers' constants and certified ones (clip+Gaussian alongside for reference).

Problem: well-specified logistic regression in d dimensions; features x ~ N(0, I/d) scaled
into the unit ball (so every per-sample gradient has norm <= G = 1), labels from θ* (||θ*|| = 3),
which is then the population minimizer. Each of n users holds m i.i.d. samples; every step
every user sends its average gradient at θ_t (vectorized over users: one [n, m, d] tensor),
the estimator releases their mean, θ_{t+1} = Π_{||θ|| <= R}(θ_t - η ĝ_t); the output is the
last iterate (the loss is smooth, so [ASI] Alg. 3 runs with smoothing radius r = 0; a
non-private run of the same schedule reaches excess ≈ 3e-4, so what remains is the privacy
term). Excess loss L(θ̂) - L(θ*) on 200,000 fresh samples; mean over seeds.

Regimes where an estimator's privacy requirement fails (too few users) are reported as
infeasible, not run. τ follows the estimators' own defaults (no data peeking):
winsorized τ = G sqrt(log(2n/γ)/(2m)) ([LEVY] Cor. 1), outlier removal
τ = G sqrt(log(2nT/γ)/m) ([ASI] §4.3 practical default, κ = 1).

    python scripts/reproductions/rate_check.py --out /tmp/bench/rate
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import dp_accounting
import torch

from fedudp.aggregators import GaussianAggregator, MeanAggregator
from fedudp.aggregators import outlier
from fedudp.aggregators import winsorized
from fedudp.aggregators.base import Sampling
from fedudp.privacy.accountant import calibrate_noise_multiplier
from fedudp.privacy.mechanisms import next_pow2

DELTA, GAMMA, G_BOUND, RADIUS, THETA_NORM = 1e-5, 0.1, 1.0, 5.0, 3.0
F32 = torch.float32


def features(k: int, d: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(k, d, generator=g) / math.sqrt(d)
    return x / x.norm(dim=-1, keepdim=True).clamp(min=1.0)


def problem(n: int, m: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    theta = torch.zeros(d)
    theta[0] = THETA_NORM
    X = features(n * m, d, g).reshape(n, m, d)
    y = (torch.rand(n, m, generator=g) < torch.sigmoid(X @ theta)).to(F32)
    Xt = features(200_000, d, g)
    yt = (torch.rand(200_000, generator=g) < torch.sigmoid(Xt @ theta)).to(F32)
    return X, y, Xt, yt, theta


def loss(theta, X, y) -> float:
    z = X @ theta
    return float(torch.nn.functional.binary_cross_entropy_with_logits(z, y))


def user_gradients(theta, X, y) -> torch.Tensor:
    """[n, d]: each user's average logistic-loss gradient at θ (norm <= 1)."""
    r = torch.sigmoid(X @ theta) - y  # [n, m]
    return torch.einsum("nm,nmd->nd", r, X) / X.shape[1]


def make(name: str, mode: str, n: int, d: int, m: int, eps: float, T: int):
    s = Sampling(1.0, n)
    gev = lambda z: dp_accounting.GaussianDpEvent(z)  # noqa: E731
    if name == "none":
        return MeanAggregator()
    if name == "gaussian":
        z = calibrate_noise_multiplier(gev, eps, DELTA, T)
        return GaussianAggregator(G_BOUND, 2 * z, s)  # replace-one: sensitivity 2G
    if name == "winsorized":
        coords = next_pow2(d)
        tau = winsorized.default_tau(G_BOUND, n, m, GAMMA)
        if mode == "paper":
            e1 = winsorized.closed_form_eps_coord(eps, DELTA, T, coords)
        else:
            e1 = 1.0 / calibrate_noise_multiplier(
                lambda z: winsorized.winsorized_round_event(1.0 / z, coords), eps, DELTA, T
            )
        agg = winsorized.WinsorizedAggregator(d, tau, G_BOUND, e1, s, gamma=GAMMA)
        # below PrivateRange's minimum n only the utility guarantee is void (privacy holds): run it
        agg.min_users_required = winsorized.min_users(coords, e1, G_BOUND, agg.tau_coord, GAMMA)
        return agg
    if name == "outlier_removal":
        need = outlier.min_users_at(eps / 2, T, DELTA / 4)
        if n < need:
            return f"infeasible: needs n>={need}"
        tau = G_BOUND * math.sqrt(math.log(2 * n * T / GAMMA) / m)
        if mode == "paper":
            zeta = DELTA / (2 * (math.exp(eps) + 1 + T))
            sens = tau * math.log(1 / zeta) / n
            z = outlier.paper_sigma(tau, n, eps, DELTA, T) / sens
        else:
            sens = outlier.sensitivity(tau, n, DELTA / (4 * T))
            z = calibrate_noise_multiplier(gev, eps / 2, DELTA / 2, T)
        return outlier.OutlierRemovalAggregator(tau, z, sens, s, eps / 2, T, DELTA / 2, need)
    raise ValueError(name)


def train(agg, X, y, T: int, lr: float, seed: int) -> tuple[torch.Tensor, dict]:
    d = X.shape[2]
    theta = torch.zeros(d)
    info = {"halted_at": None, "kept": []}
    for t in range(T):
        Gm = user_gradients(theta, X, y)
        out = agg(Gm.to(torch.float64), rng=torch.Generator().manual_seed(seed * 1000 + t))
        if out.halted:
            info["halted_at"] = t + 1
            return torch.zeros(d), info  # [ASI] Alg. 3: halted -> return θ_0
        theta = theta - lr * out.mean.to(F32)
        nrm = float(theta.norm())
        if nrm > RADIUS:
            theta = theta * (RADIUS / nrm)
    return theta, info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--d", type=int, default=10)
    ap.add_argument("--m", nargs="+", type=int, default=[10, 100, 1000])
    ap.add_argument("--eps", nargs="+", type=float, default=[1.0, 10.0])
    ap.add_argument("--T", type=int, default=20)
    ap.add_argument("--lr", type=float, default=10.0)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument(
        "--only", nargs="*", default=None, help="estimator/mode keys to run (default all)"
    )
    ap.add_argument("--out", default="rate_check")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    combos = [
        ("none", "non-private"),
        ("gaussian", "certified"),
        ("winsorized", "certified"),
        ("winsorized", "paper"),
        ("outlier_removal", "certified"),
        ("outlier_removal", "paper"),
    ]
    if a.only:
        combos = [c for c in combos if f"{c[0]}/{c[1]}" in a.only]
    results = []
    for m in a.m:
        data = [problem(a.n, m, a.d, s) for s in range(a.seeds)]
        for eps in a.eps:
            for name, mode in combos:
                t0 = time.perf_counter()
                agg = make(name, mode, a.n, a.d, m, eps, a.T)
                if isinstance(agg, str):
                    results.append(
                        {
                            "m": m,
                            "eps": eps,
                            "estimator": f"{name}/{mode}",
                            "excess": None,
                            "note": agg,
                        }
                    )
                    print(f"m={m} eps={eps:g} {name}/{mode}: {agg}", flush=True)
                    continue
                ex, halts = [], 0
                for s, (X, y, Xt, yt, theta) in enumerate(data):
                    if isinstance(agg, outlier.OutlierRemovalAggregator):
                        agg.at = None  # one AboveThreshold per training run
                    th, info = train(agg, X, y, a.T, a.lr, s)
                    halts += info["halted_at"] is not None
                    ex.append(loss(th, Xt, yt) - loss(theta, Xt, yt))
                row = {
                    "m": m,
                    "eps": eps,
                    "estimator": f"{name}/{mode}",
                    "excess": sum(ex) / len(ex),
                    "halted_runs": halts,
                    "seconds": time.perf_counter() - t0,
                }
                need = getattr(agg, "min_users_required", None)
                if need is not None and a.n < need:
                    row["below_min_users"] = need
                results.append(row)
                print(
                    f"m={m} eps={eps:g} {name}/{mode}: excess {row['excess']:.4f} "
                    f"(halted {halts}/{a.seeds}) {row['seconds']:.1f}s",
                    flush=True,
                )
        del data
    # non-private reference: the statistical term alone
    lines = [
        f"n = {a.n} users, d = {a.d}, T = {a.T} steps, lr {a.lr}, δ = {DELTA:g}; "
        f"excess population loss (mean of {a.seeds} seeds)\n",
        "| estimator | ε | " + " | ".join(f"m={m}" for m in a.m) + " |",
        "|---|---:|" + "---:|" * len(a.m),
    ]
    for eps in a.eps:
        for name, mode in combos:
            key = f"{name}/{mode}"
            cells = []
            for m in a.m:
                r = next(
                    r for r in results if r["m"] == m and r["eps"] == eps and r["estimator"] == key
                )
                if r["excess"] is None:
                    cells.append(r["note"])
                else:
                    cells.append(
                        f"{r['excess']:.4f}"
                        + (f" (halted {r['halted_runs']})" if r["halted_runs"] else "")
                        + (f" (n < min {r['below_min_users']})" if r.get("below_min_users") else "")
                    )
            lines.append(f"| {key} | {eps:g} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
