"""Benchmark: error of each user-level DP mean estimator against the true mean as the
samples per user m grow, at a small grid of (n, d, ε), with certified and paper constants;
the crossover m where each beats clip+Gaussian; and the cost of one call at n = 1,000 users,
d = 100,000.

Workload. Each user's vector is the mean of its m samples; samples lie in the l2 ball of
radius B (B = 1) around 0, with true mean μ (||μ|| = B/2) and per-sample spread B/2, so user
means are μ + (B/2)/sqrt(m d) N(0, I_d) (Gaussian approximation of an average of m
bounded samples). Every estimator gets the public B and a τ derived from m (no data peeking):

* gaussian:   clip at B, replace-one (sensitivity 2B/n), noise calibrated with dp-accounting;
* winsorized: [LEVY] WinsorizedMeanHighD, τ = (B/2)/sqrt(m)·(1 + sqrt(2 log(2n/γ)/d));
  certified = ε' calibrated with dp-accounting (RDP), paper = their closed-form ε';
* outlier_removal / friendlycore: friend radius from τ = 1.5·sqrt(2)·(B/2)/sqrt(m) (above the
  typical pairwise distance); certified = explicit sensitivity (30τK/n, resp. 8τK/(0.05n)),
  paper = the seed's σ² (outlier_removal) / the paper's Δ = τ log(1/ζ)/n (friendlycore);
* few_users:  [ESF] DP-Estimate-1 (one copy, no blocks), radius τ = the users' radius;
  one set of constants (the proof's ε/4, δ/4).

All at one query (T = 1), δ = 1e-5. Writes a markdown table, a JSON file and an SVG plot.

    python scripts/benchmarks/bench_estimators.py --out /tmp/bench/estimators
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import dp_accounting
import torch

from fedudp.aggregators import GaussianAggregator
from fedudp.aggregators import friendlycore
from fedudp.aggregators import few_users
from fedudp.aggregators import outlier
from fedudp.aggregators import winsorized
from fedudp.protocol.contributions import Sampling
from fedudp.privacy.accountant import calibrate_noise_multiplier
from fedudp.privacy.mechanisms import next_pow2

B, DELTA, GAMMA = 1.0, 1e-5, 0.1
F64 = torch.float64


def users(n: int, d: int, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mu = torch.zeros(d, dtype=F64)
    mu[0] = B / 2
    X = mu + (B / 2) / math.sqrt(m * d) * torch.randn(n, d, generator=g, dtype=F64)
    return X, mu


def tau_center(n: int, d: int, m: int) -> float:
    return (B / 2) / math.sqrt(m) * (1 + math.sqrt(2 * math.log(2 * n / GAMMA) / d))


def tau_pair(m: int) -> float:
    return 1.5 * math.sqrt(2) * (B / 2) / math.sqrt(m)


def make(name: str, mode: str, n: int, d: int, m: int, eps: float):
    """The estimator ``name`` with ``mode`` constants, or a string saying why it cannot run."""
    s = Sampling(1.0, n)
    gev = lambda z: dp_accounting.GaussianDpEvent(z)  # noqa: E731
    if name == "gaussian":
        z = calibrate_noise_multiplier(gev, eps, DELTA, 1)
        return GaussianAggregator(B, 2 * z, s)  # replace-one: sensitivity 2B
    if name == "winsorized":
        coords = next_pow2(d)
        if mode == "paper":
            e1 = winsorized.closed_form_eps_coord(eps, DELTA, 1, coords)
        else:
            e1 = 1.0 / calibrate_noise_multiplier(
                lambda z: winsorized.winsorized_round_event(1.0 / z, coords), eps, DELTA, 1
            )
        return winsorized.WinsorizedAggregator(d, tau_center(n, d, m), B, e1, s, gamma=GAMMA)
    if name == "outlier_removal":
        need = outlier.min_users_at(eps / 2, 1, DELTA / 4)
        if n < need:
            return f"needs n>={need}"
        tau = tau_pair(m)
        if mode == "paper":
            zeta = DELTA / (2 * (math.exp(eps) + 2))
            sens = tau * math.log(1 / zeta) / n
            z = outlier.paper_sigma(tau, n, eps, DELTA, 1) / sens
        else:
            sens = outlier.sensitivity(tau, n, DELTA / 4)
            z = calibrate_noise_multiplier(gev, eps / 2, DELTA / 2, 1)
        return outlier.OutlierRemovalAggregator(tau, z, sens, s, eps / 2, 1, DELTA / 2, need)
    if name == "friendlycore":
        tau = tau_pair(m)
        z = calibrate_noise_multiplier(
            lambda z: friendlycore.friendlycore_round_event(z, z), eps, DELTA / 2, 1
        )
        if friendlycore.friendlycore_failure(n, z) > DELTA / 4:
            return "needs more n"
        if mode == "paper":
            zeta = DELTA / (2 * (math.exp(eps) + 2))
            sens = tau * math.log(1 / zeta) / n
        else:
            sens = friendlycore.friendlycore_sensitivity(tau, n, DELTA / 4)
        return friendlycore.FriendlyCoreAggregator(tau, z, sens, s, z, DELTA / 2, 0)
    if name == "few_users":
        try:
            return few_users.FewUsersAggregator(
                d,
                (B / 2) / math.sqrt(m) * (1 + math.sqrt(2 * math.log(2 * n / GAMMA) / d)),
                eps,
                DELTA,
                1,
                s,
            )
        except ValueError as err:
            return str(err).split(":")[0]
    raise ValueError(name)


ESTIMATORS = [
    ("gaussian", "certified"),
    ("winsorized", "certified"),
    ("winsorized", "paper"),
    ("outlier_removal", "certified"),
    ("outlier_removal", "paper"),
    ("friendlycore", "certified"),
    ("friendlycore", "paper"),
    ("few_users", "certified"),
]


def mse(agg, X, mu, reps: int) -> tuple[float, int]:
    errs, halted = [], 0
    for r in range(reps):
        if isinstance(agg, outlier.OutlierRemovalAggregator):
            agg.at = None  # a fresh AboveThreshold per query
        out = agg(X, rng=torch.Generator().manual_seed(1000 + r))
        if out.halted:
            halted += 1
        else:
            errs.append(float(((out.mean.to(F64) - mu) ** 2).sum()))
    return (sum(errs) / len(errs) if errs else math.inf), halted


def svg_plot(series: dict[str, list[tuple[float, float]]], title: str, path: Path) -> None:
    """A log-log line plot as plain SVG (no plotting dependency)."""
    pts = [p for v in series.values() for p in v if p[1] > 0 and math.isfinite(p[1])]
    if not pts:
        return
    lx = [math.log10(x) for x, _ in pts]
    ly = [math.log10(y) for _, y in pts]
    x0, x1, y0, y1 = min(lx), max(lx), min(ly), max(ly)
    W_, H_, M = 720, 440, 60
    sx = lambda v: M + (math.log10(v) - x0) / max(x1 - x0, 1e-9) * (W_ - 2 * M - 160)  # noqa: E731
    sy = lambda v: H_ - M - (math.log10(v) - y0) / max(y1 - y0, 1e-9) * (H_ - 2 * M)  # noqa: E731
    colors = ["#000", "#1f77b4", "#aec7e8", "#d62728", "#ff9896", "#2ca02c", "#98df8a", "#9467bd"]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W_}" height="{H_}" font-size="11">',
        f'<text x="{M}" y="20">{title}</text>',
        f'<line x1="{M}" y1="{H_ - M}" x2="{W_ - M - 160}" y2="{H_ - M}" stroke="#000"/>',
        f'<line x1="{M}" y1="{M}" x2="{M}" y2="{H_ - M}" stroke="#000"/>',
        f'<text x="{(W_ - 160) // 2}" y="{H_ - 20}">samples per user m (log)</text>',
        f'<text x="5" y="{M - 10}">MSE (log)</text>',
    ]
    for e in range(math.floor(x0), math.ceil(x1) + 1):
        if x0 - 1e-9 <= e <= x1 + 1e-9:
            out.append(f'<text x="{sx(10**e) - 10:.0f}" y="{H_ - M + 15}">1e{e}</text>')
    for e in range(math.floor(y0), math.ceil(y1) + 1):
        if y0 - 1e-9 <= e <= y1 + 1e-9:
            out.append(f'<text x="{M - 40}" y="{sy(10**e) + 4:.0f}">1e{e}</text>')
    for i, (name, v) in enumerate(series.items()):
        v = [(x, y) for x, y in v if y > 0 and math.isfinite(y)]
        c = colors[i % len(colors)]
        if len(v) > 1:
            d = " ".join(
                f"{'M' if j == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for j, (x, y) in enumerate(v)
            )
            out.append(f'<path d="{d}" fill="none" stroke="{c}" stroke-width="1.5"/>')
        for x, y in v:
            out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{c}"/>')
        out.append(f'<text x="{W_ - M - 150}" y="{M + 15 * i}" fill="{c}">{name}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out))


def cost_per_call(n: int, d: int, eps: float) -> dict[str, float | str]:
    X, _ = users(n, d, 100, 0)
    res = {}
    for name, mode in ESTIMATORS:
        if mode != "certified":
            continue
        agg = make(name, mode, n, d, 100, eps)
        note = ""
        if isinstance(agg, str) and name == "friendlycore":
            # below its privacy minimum at this n: time the same computation anyway
            tau = tau_pair(100)
            agg = friendlycore.FriendlyCoreAggregator(
                tau,
                1.0,
                friendlycore.friendlycore_sensitivity(tau, n, DELTA / 4),
                Sampling(1.0, n),
                1.0,
                DELTA / 2,
                0,
            )
            note = " (timing only: n is below its privacy minimum)"
        if isinstance(agg, str):
            res[name] = agg
            continue
        t = time.perf_counter()
        agg(X, rng=torch.Generator().manual_seed(0))
        res[name + note] = time.perf_counter() - t
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--grid",
        nargs="*",
        default=["4000,16,1", "4000,16,10", "1000,256,10"],
        help="n,d,eps triples",
    )
    ap.add_argument(
        "--m", nargs="+", type=int, default=[1, 10, 100, 1000, 10_000, 100_000, 1_000_000]
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--cost", default="1000,100000,10", help="n,d,eps for the cost per call ('' to skip)"
    )
    ap.add_argument("--out", default="bench_estimators")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(torch.get_num_threads())
    report = {"grid": [], "cost": None}
    lines = []
    for g in a.grid:
        n, d, eps = int(g.split(",")[0]), int(g.split(",")[1]), float(g.split(",")[2])
        rows = {}
        for name, mode in ESTIMATORS:
            key = f"{name}/{mode}"
            rows[key] = []
            for m in a.m:
                X, mu = users(n, d, m, seed=m)
                agg = make(name, mode, n, d, m, eps)
                if isinstance(agg, str):
                    rows[key].append({"m": m, "mse": None, "note": agg})
                    continue
                v, h = mse(agg, X, mu, a.reps)
                rows[key].append({"m": m, "mse": v, "halted": h})
            print(
                f"n={n} d={d} eps={eps:g} {key}: "
                + " ".join(f"{r['mse']:.2e}" if r["mse"] is not None else "n/a" for r in rows[key]),
                flush=True,
            )
        gauss = {r["m"]: r["mse"] for r in rows["gaussian/certified"]}
        cross = {}
        for key, rs in rows.items():
            if key.startswith("gaussian"):
                continue
            wins = [r["m"] for r in rs if r["mse"] is not None and r["mse"] < gauss[r["m"]]]
            cross[key] = min(wins) if wins else None
        report["grid"].append({"n": n, "d": d, "eps": eps, "rows": rows, "crossover_m": cross})
        lines.append(
            f"\n### n = {n}, d = {d}, ε = {eps:g}, δ = {DELTA:g} (MSE against the true mean)\n"
        )
        lines.append(
            "| estimator | " + " | ".join(f"m={m:g}" for m in a.m) + " | beats gaussian from m = |"
        )
        lines.append("|---|" + "---:|" * (len(a.m) + 1))
        for key, rs in rows.items():
            cells = []
            for r in rs:
                if r["mse"] is None:
                    cells.append(r["note"])
                elif not math.isfinite(r["mse"]):
                    cells.append("halted")
                else:
                    cells.append(
                        f"{r['mse']:.2e}" + (f" (h{r['halted']})" if r.get("halted") else "")
                    )
            c = (
                "—"
                if key.startswith("gaussian")
                else (f"{cross[key]:g}" if cross[key] else f"> {a.m[-1]:g}")
            )
            lines.append(f"| {key} | " + " | ".join(cells) + f" | {c} |")
        svg_plot(
            {k: [(r["m"], r["mse"]) for r in rs if r["mse"] is not None] for k, rs in rows.items()},
            f"MSE vs m: n={n} d={d} eps={eps:g}",
            out / f"mse_n{n}_d{d}_eps{eps:g}.svg",
        )
    if a.cost:
        n, d, eps = (
            int(a.cost.split(",")[0]),
            int(a.cost.split(",")[1]),
            float(a.cost.split(",")[2]),
        )
        c = cost_per_call(n, d, eps)
        report["cost"] = {"n": n, "d": d, "eps": eps, "seconds": c}
        lines.append(
            f"\n### Cost per call, n = {n}, d = {d:,}, ε = {eps:g} (certified constants; "
            f"{torch.get_num_threads()} threads)\n"
        )
        lines.append("| estimator | seconds |\n|---|---:|")
        for k, v in c.items():
            lines.append(f"| {k} | {v:.2f} |" if isinstance(v, float) else f"| {k} | {v} |")
    text = "\n".join(lines)
    print(text)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
