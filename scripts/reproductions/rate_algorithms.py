"""Rates of the seeds' training algorithms: excess population loss against n, m (or
records per user), ε (and ℓ for Huang) for each preset, run through fedudp itself
(``fedudp.run.prepare`` + ``execute``: the one round loop, the owner component, the registered
estimators), with the fitted log-log slope beside the theorem's.

Problem: the presets' synthetic convex problem (2-class logistic regression on f = 8 Gaussian
features, labels from the generator's softmax teacher, iid owners), so the population minimizer
is the teacher (shared block = teacher, personal offsets = 0). Excess population loss = the run's
mean owner test loss minus the teacher's on the same test shards (Asi Alg. 4: of the regularised
objective L + (μ/2)||θ||², its minimizer found by L-BFGS on 200,000 fresh samples).
Beside each point, ``ref``: the same schedule at ε = 500 (almost no privacy noise; for Asi at
ε = 10⁵ in certified mode, since paper mode's Δ = τ log(1/ζ)/n grows like ε and certified
Δ = 30τK/n still leaves visible noise at ε = 500), so ``priv`` = excess − ref is
the privacy part whose slope the theorems' privacy terms predict.

What differs from a plain ``fedudp +experiment=...`` run, and why (all recorded in results.json):
* privacy accounting is done once, at calibration (the noise of every release is the calibrated
  one); the per-round ε bookkeeping is switched off (``billboard.accountant = None``) because the
  trajectory does not depend on it and PLD for Huang Alg. 1's rate 1/(mn) costs ~1 s per round.
  Huang Alg. 1's noise multiplier is calibrated with dp-accounting's RDP accountant (slightly
  conservative, much faster than PLD at q = 1/(mn)) and passed as ``privacy.noise_multiplier``.
* the papers' T (Θ(m²n²) and similar) is replaced by a configured T (below), so the step sizes
  are set for that T (``algorithm.step_size``/``train.server_lr``) and the output is the last
  iterate (``algorithm.averaged=false``): with T ≪ the paper's T the average of early iterates
  would dominate the error. Asi's τ is the practical κ = 1 radius G sqrt(log(2nT/γ)/m)
  (docs/algorithms.md#outlier-removal; the paper's τ makes the noise larger than the signal at
  these sizes),
  and its smoothing radius r is Thm 4.1's formula at the paper's T (≈ 0: the loss is smooth).
  Levy Alg. 4 runs P = 3 phases (the paper's P is 11-13 here and would leave its last phases
  with a handful of users).

Huang's full-DP baseline vs joint DP (axis ``nk``): n owners at fixed N = mn, so nk grows,
``huang_alg1`` with and without ``algorithm.noise_personal`` at the same σ and T (η: the paper's
formula at nk + ℓ, and joint DP's η), the gap excess_full − excess_joint against nk beside the
theorem's sqrt(nk+ℓ) − sqrt(ℓ) (table.md's last table, huang_alg1_full_vs_joint.png).

    python scripts/reproductions/rate_algorithms.py --out docs/results/rates_algorithms
    python scripts/reproductions/rate_algorithms.py --out docs/results/rates_algorithms --resume --axes nk
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from fedudp.config import ConfigError, register
from fedudp.randomness import Purpose, numpy_rng
from fedudp.cli import CONF_DIR
from fedudp.run import execute, prepare

DELTA = 1e-6
REF_EPS = 500.0  # the near-non-private reference: the same schedule at ε = 500


def compose(preset: str, overrides: list[str]):
    from hydra import compose as hcompose, initialize_config_dir
    from omegaconf import OmegaConf

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        d = hcompose(
            config_name="config",
            overrides=[f"+experiment={preset}", "progress=false", "checkpoint.every=0", *overrides],
        )
    return OmegaConf.to_object(d)


def teacher(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic generator's softmax teacher (fedudp.data.synthetic): W [f, c], b [c]."""
    d = cfg.dataset
    rng = numpy_rng(cfg.seed, Purpose.SYNTHETIC_TEACHER)
    W = rng.standard_normal((d.features, d.classes)) * d.signal / np.sqrt(d.features)
    b = rng.standard_normal(d.classes) * 0.5
    return torch.from_numpy(W), torch.from_numpy(b)


def owner_losses(logits: torch.Tensor, y: torch.Tensor, offsets: np.ndarray) -> float:
    per = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    return float(
        np.mean([per[a:b].mean().item() for a, b in zip(offsets[:-1], offsets[1:]) if b > a])
    )


def reg_minimizer(cfg, mu: float) -> torch.Tensor:
    """argmin E[CE] + (μ/2)||θ||² over the full_dp parameter vector (shared.weight [c, f],
    shared.bias, personal.bias), by L-BFGS on 200,000 fresh samples of the generator."""
    W, b = teacher(cfg)
    g = np.random.default_rng([cfg.seed, 99])
    x = torch.from_numpy(g.standard_normal((200_000, W.shape[0])))
    p = torch.softmax(x @ W + b, 1)
    y = torch.multinomial(p, 1, generator=torch.Generator().manual_seed(cfg.seed)).squeeze(1)
    f, c = W.shape
    th = torch.zeros(c * f + 2 * c, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS(
        [th],
        max_iter=500,
        tolerance_grad=1e-12,
        tolerance_change=1e-14,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        Wm = th[: c * f].reshape(c, f)
        logits = x @ Wm.T + th[c * f : c * f + c] + th[c * f + c :]
        loss = torch.nn.functional.cross_entropy(logits, y) + mu / 2 * th.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return th.detach()


def excess(cfg, p, res, mu: float | None) -> float:
    fed = p.fed
    run_loss = float(np.nanmean(res.owner_loss))
    xt, yt = fed.x_test.to(torch.float64), fed.y_test
    if mu is None:
        W, b = teacher(cfg)
        return run_loss - owner_losses(xt @ W + b, yt, fed.test_offsets)
    th = reg_minimizer(cfg, mu)
    c, f = cfg.dataset.classes, cfg.dataset.features
    ref = owner_losses(
        xt @ th[: c * f].reshape(c, f).T + th[c * f : c * f + c] + th[c * f + c :],
        yt,
        fed.test_offsets,
    ) + mu / 2 * float(th.pow(2).sum())
    u = p.billboard.u.to(torch.float64)
    return run_loss + mu / 2 * float(u.pow(2).sum()) - ref


_Z: dict = {}


def rdp_noise(rate: float, rounds: int, eps: float, delta: float) -> float:
    """Huang Alg. 1: noise multiplier for `rounds` Poisson(rate)-sampled Gaussians (RDP)."""
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    key = (rate, rounds, eps, delta)
    if key not in _Z:
        _Z[key] = float(
            dp_accounting.calibrate_dp_mechanism(
                lambda: rdp_privacy_accountant.RdpAccountant(),
                lambda z: dp_accounting.SelfComposedDpEvent(
                    dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(z)),
                    rounds,
                ),
                eps,
                delta,
                bracket_interval=dp_accounting.LowerEndpointAndGuess(1e-3, 1.0),
                tol=1e-3,
            )
        )
    return _Z[key]


# -- experiments -------------------------------------------------------------------------------------
LEVY_BASE = {"n": 4000, "m": 10, "eps": 4.0}
ASI_BASE = {
    "asi_alg3": {"n": 4000, "m": 10, "eps": 2.0},
    "asi_alg4": {"n": 4000, "m": 10, "eps": 8.0},
}
HUANG1_BASE = {"N": 1000, "eps": 1.0, "f": 8, "k": 1}
HUANG2_BASE = {"n": 8, "eps": 32.0}
# Huang's full-DP baseline vs joint DP: owners at N = 1000 records, k personal coordinates each
NK_OWNERS = (5, 10, 20, 50, 100)
K_PERSONAL = 2  # the 2-class model's personal logit offset (personal.bias)
FULL_JOINT = "huang_alg1 joint (nk axis)"
FULL_BASE = "huang_alg1 full-DP baseline"
FULL_SAME_STEP = "huang_alg1 full-DP baseline, joint's η"


def levy(alg: str, n: int, m: int, eps: float, T: int = 12) -> tuple[str, list[str], None]:
    o = [
        f"dataset.num_records={n * m}",
        f"dataset.pool_train={n * m}",
        "partition.num_owners=20",
        f"partition.records_per_user={m}",
        f"privacy.epsilon={eps}",
        f"privacy.delta={DELTA}",
        f"train.rounds={T}",
        "train.server_lr=1.0",
    ]
    if alg == "levy_alg4":
        o += ["algorithm.phases=3"]
    return alg, o, None


def asi(
    alg: str, n: int, m: int, eps: float, T: int = 10, accounting: str = "paper"
) -> tuple[str, list[str], float | None]:
    if eps >= REF_EPS:  # reference: paper mode's Δ = τ log(1/ζ)/n grows like ε, and certified
        accounting, eps = "certified", 1e5  # Δ = 30τK/n still leaves noise at ε = 500
    tau = 5.0 * math.sqrt(math.log(2 * n * T / 0.1) / m)  # κ = 1, G = estimator.bound = 5
    d = 18
    r = d**0.25 * 10.0 / (m * n)  # Thm 4.1's r at the paper's T ≈ (mn)²
    o = [
        f"dataset.num_records={n * m}",
        f"dataset.pool_train={n * m}",
        "partition.num_owners=20",
        f"partition.records_per_user={m}",
        f"privacy.epsilon={eps}",
        f"privacy.delta={DELTA}",
        f"train.rounds={T}",
        f"estimator.tau={tau}",
        f"algorithm.smoothing_radius={r}",
        "algorithm.step_size=1.0",
        "algorithm.averaged=false",
        f"privacy.accounting={accounting}",
    ]
    if alg == "asi_alg4":
        o += ["algorithm.phases=2"]
    return alg, o, (0.1 if alg == "asi_alg4" else None)


def huang1(
    N: int,
    eps: float,
    f: int,
    k: int,
    method: str = "joint_dp",
    owners: int = 10,
    noise_personal: bool = False,
    step: float | None = None,
):
    """Record level at ε/k, δ/k·e^{-ε} for k records per user (group privacy,
    docs/algorithms.md#group-privacy).
    ``noise_personal``: the paper's full-DP baseline (σ on every owner's personal block too);
    ``step``: a fixed η (None: the paper's formula, at ℓ, or at nk + ℓ with noise_personal)."""
    T = N
    e, d = eps / k, (DELTA / k * math.exp(-eps) if eps < REF_EPS else DELTA)
    # reference: noise multiplier 0.1 (1% of the noise variance of the ε = 1 runs, z ≈ 1)
    z = rdp_noise(1.0 / N, T, e, d) if eps < REF_EPS else 0.1
    o = [
        f"dataset.num_records={N}",
        f"dataset.pool_train={max(N, 20000)}",
        f"partition.num_owners={owners}",
        f"dataset.features={f}",
        f"privacy.epsilon={e}",
        f"privacy.delta={d}",
        f"privacy.noise_multiplier={z}",
        f"train.rounds={T}",
        f"method={method}",
    ]
    if noise_personal:
        o.append("algorithm.noise_personal=true")
    if step is not None:
        o.append(f"algorithm.step_size={step}")
    return "huang_alg1", o, None


def huang1_joint_step(N: int, eps: float, f: int, k: int) -> float:
    """The step size joint DP's run takes (the paper's formula at ℓ = 2f + 2, preset R and L)."""
    from fedudp.algorithms.huang_alg1 import paper_step_size

    e, d = eps / k, (DELTA / k * math.exp(-eps) if eps < REF_EPS else DELTA)
    return paper_step_size(10.0, 3.0, N, N, 2 * f + 2, e, d)


def huang2(n: int, eps: float):
    """r = 1000 users per owner of 5 records; τ: the estimator's own default (Levy Cor. 1,
    B sqrt(log(2r/γ)/(2·5))); Lemma B.4's τ (≈ 27 > B here) leaves nothing to winsorize."""
    r, k = 1000, 5
    T = 10 * n
    tau = 5.0 * math.sqrt(math.log(2 * r / 0.1) / (2 * k))
    o = [
        f"dataset.num_records={n * r * k}",
        f"dataset.pool_train={n * r * k}",
        f"partition.num_owners={n}",
        f"partition.records_per_user={k}",
        f"privacy.epsilon={eps}",
        f"privacy.delta={DELTA}",
        f"train.rounds={T}",
        f"estimator.tau={tau}",
    ]
    return "huang_alg2", o, None


def sweeps(quick: bool):
    """(label, axis, x, build) with build(E) the point's run (E: the ε to use instead, for the
    non-private reference)."""
    ns = [2000, 4000, 8000, 16000]
    ms = [5, 10, 20, 40]
    L, A, H, H2 = LEVY_BASE, ASI_BASE, HUANG1_BASE, HUANG2_BASE
    out = []
    for alg in ("levy_alg3", "levy_alg4"):
        out += [
            (alg, "n", n, lambda E=None, n=n, alg=alg: levy(alg, n, L["m"], E or L["eps"]))
            for n in ns
        ]
        out += [
            (alg, "m", m, lambda E=None, m=m, alg=alg: levy(alg, L["n"], m, E or L["eps"]))
            for m in ms
        ]
        out += [
            (alg, "eps", e, lambda E=None, e=e, alg=alg: levy(alg, L["n"], L["m"], E or e))
            for e in (1.0, 2.0, 4.0, 8.0)
        ]
    for alg in ("asi_alg3", "asi_alg4"):
        B = A[alg]
        out += [
            (alg, "n", n, lambda E=None, n=n, alg=alg, B=B: asi(alg, n, B["m"], E or B["eps"]))
            for n in (2000, 4000, 8000)
        ]
        out += [
            (alg, "m", m, lambda E=None, m=m, alg=alg, B=B: asi(alg, B["n"], m, E or B["eps"]))
            for m in ms
        ]
        out += [
            (alg, "eps", e, lambda E=None, e=e, alg=alg, B=B: asi(alg, B["n"], B["m"], E or e))
            for e in (2.0, 4.0, 8.0, 16.0)
        ]
    B = A["asi_alg3"]
    out += [
        (
            "asi_alg3 certified",
            "eps",
            e,
            lambda E=None, e=e: asi("asi_alg3", B["n"], B["m"], E or e, accounting="certified"),
        )
        for e in (2.0, 8.0)
    ]
    out += [
        ("huang_alg1", "N=mn", N, lambda E=None, N=N: huang1(N, E or H["eps"], H["f"], H["k"]))
        for N in (500, 1000, 2000, 4000)
    ]
    out += [
        ("huang_alg1", "eps", e, lambda E=None, e=e: huang1(H["N"], E or e, H["f"], H["k"]))
        for e in (0.5, 1.0, 2.0, 4.0)
    ]
    out += [
        (
            "huang_alg1",
            "ell",
            2 * f + 2,
            lambda E=None, f=f: huang1(H["N"], E or H["eps"], f, H["k"]),
        )
        for f in (4, 8, 16, 32)
    ]
    out += [
        ("huang_alg1", "m/r", k, lambda E=None, k=k: huang1(H["N"], E or H["eps"], H["f"], k))
        for k in (1, 2, 4, 8)
    ]
    out += [
        (
            "huang_alg1 full_dp",
            "N=mn",
            N,
            lambda E=None, N=N: huang1(N, E or H["eps"], H["f"], H["k"], "full_dp"),
        )
        for N in (500, 1000, 2000)
    ]
    # full-DP baseline vs joint DP (Huang §3.2): n owners at fixed N = mn = 1000, so nk (k = 2
    # personal logit offsets per owner) grows; same σ (N, T, ε fixed) and T
    for n in NK_OWNERS:
        nk = n * K_PERSONAL
        out += [
            (
                FULL_JOINT,
                "nk",
                nk,
                lambda E=None, n=n: huang1(H["N"], E or H["eps"], H["f"], H["k"], owners=n),
            ),
            (
                FULL_BASE,
                "nk",
                nk,
                lambda E=None, n=n: huang1(
                    H["N"], E or H["eps"], H["f"], H["k"], owners=n, noise_personal=True
                ),
            ),
            (
                FULL_SAME_STEP,
                "nk",
                nk,
                lambda E=None, n=n: huang1(
                    H["N"],
                    E or H["eps"],
                    H["f"],
                    H["k"],
                    owners=n,
                    noise_personal=True,
                    step=huang1_joint_step(H["N"], E or H["eps"], H["f"], H["k"]),
                ),
            ),
        ]
    out += [
        ("huang_alg2", "n", n, lambda E=None, n=n: huang2(n, E or H2["eps"])) for n in (4, 8, 16)
    ]
    out += [
        ("huang_alg2", "eps", e, lambda E=None, e=e: huang2(H2["n"], E or e))
        for e in (16.0, 32.0, 64.0, 128.0)
    ]
    if quick:
        out = out[:2] + [o for o in out if o[0] == "huang_alg2"][:1]
    return out


# theorem slopes of the privacy term (convex Lipschitz bounds) per (algorithm, axis)
THEORY = {
    ("levy_alg3", "n"): "-1 (privacy; -1/2 statistical)",
    ("levy_alg3", "m"): "-1/2",
    ("levy_alg3", "eps"): "-1",
    ("levy_alg4", "n"): "-1 (privacy; -1/2 statistical)",
    ("levy_alg4", "m"): "-1/2",
    ("levy_alg4", "eps"): "-1",
    ("asi_alg3 certified", "eps"): "-1 (certified constants)",
    ("asi_alg3", "n"): "-1 (privacy; -1/2 statistical)",
    ("asi_alg3", "m"): "-1/2",
    ("asi_alg3", "eps"): "-1",
    ("asi_alg4", "n"): "-2 (privacy; -1 statistical)",
    ("asi_alg4", "m"): "-1",
    ("asi_alg4", "eps"): "-2",
    ("huang_alg1", "N=mn"): "-1 (privacy; -1/2 statistical)",
    ("huang_alg1", "eps"): "-1",
    ("huang_alg1", "ell"): "+1/2",
    ("huang_alg1", "m/r"): "+1 (group privacy: ∝ 1/r)",
    ("huang_alg1 full_dp", "N=mn"): "-1 (privacy; sqrt(nk+ℓ) not sqrt(ℓ))",
    ("huang_alg2", "n"): "-1 (privacy; -1/2 statistical)",
    ("huang_alg2", "eps"): "-1",
    (FULL_JOINT, "nk"): "0 (sqrt(ℓ) log(1/δ)/(εmn): independent of n at fixed mn)",
    (FULL_BASE, "nk"): "privacy ∝ sqrt(nk+ℓ)",
    (FULL_SAME_STEP, "nk"): "privacy ∝ sqrt(nk+ℓ) (same η as joint)",
}


_REF: dict = {}


def reference(build, seed: int) -> float:
    """Excess of the same schedule at ε = REF_EPS (what is left with almost no privacy noise:
    optimization and statistical error), cached by the overrides that do not name the budget."""
    preset, overrides, mu = build(REF_EPS)
    key = (preset, tuple(o for o in overrides if not o.startswith("privacy.")), seed)
    if key not in _REF:
        cfg = compose(preset, [*overrides, f"seed={seed}"])
        p = prepare(cfg)
        p.billboard.accountant = None
        _REF[key] = excess(cfg, p, execute(p), mu)
    return _REF[key]


def slope(xs, ys) -> float | None:
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if y is not None and y > 0]
    if len(pts) < 2:
        return None
    X = np.array([p[0] for p in pts])
    Y = np.array([p[1] for p in pts])
    return float(np.polyfit(X, Y, 1)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/results/rates_algorithms")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a few points only (smoke test)")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the points already in <out>/results.json, run the others",
    )
    ap.add_argument(
        "--axes",
        nargs="*",
        default=None,
        help="run only the points on these axes (e.g. nk: Huang's full-DP baseline vs "
        "joint DP); with --resume the other points are kept",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = json.loads((out / "results.json").read_text()) if a.resume else []
    done = {(r["algorithm"], r["axis"], r["x"]) for r in results}
    for label, axis, x, build in sweeps(a.quick):
        if (label, axis, x) in done or (a.axes is not None and axis not in a.axes):
            continue
        t0 = time.perf_counter()
        vals, info = [], {}
        note, refs = None, []
        for seed in range(a.seeds):
            preset, overrides, mu = build()
            cfg = compose(preset, [*overrides, f"seed={seed}"])
            try:
                p = prepare(cfg)
            except ConfigError as e:  # a regime the algorithm's conditions rule out
                note = str(e)
                break
            p.billboard.accountant = None  # ε fixed by the calibration (see module doc)
            res = execute(p)
            vals.append(excess(cfg, p, res, mu))
            refs.append(reference(build, seed))
            alg = p.algorithm.summary if p.algorithm is not None else {}
            info = {
                "stop": res.stop_reason,
                "rounds": res.rounds_completed,
                "step_size": alg.get("step_size"),
                "noised_dim": alg.get("noised_dim"),
                "personal_noise_std": alg.get("personal_noise_std"),
                "noise_multiplier": p.aggregator.noise_multiplier,
                "min_users_required": p.aggregator.min_users_required,
                "units": p.aggregator.sampling.population,
                "paper_T": alg.get("paper_T"),
                "configured_T": cfg.train.rounds,
                "overrides": overrides,
            }
        if note is not None:
            results.append(
                {
                    "algorithm": label,
                    "axis": axis,
                    "x": x,
                    "excess": None,
                    "stop": "infeasible",
                    "note": note,
                    "seconds": time.perf_counter() - t0,
                }
            )
            print(f"{label:20s} {axis:5s}={x:<8g} infeasible: {note}", flush=True)
            continue
        row = {
            "algorithm": label,
            "axis": axis,
            "x": x,
            "excess": float(np.mean(vals)),
            "excess_seeds": vals,
            "reference": float(np.mean(refs)),
            "privacy_part": float(np.mean(vals)) - float(np.mean(refs)),
            "seconds": time.perf_counter() - t0,
            **info,
        }
        results.append(row)
        print(
            f"{label:20s} {axis:5s}={x:<8g} excess {row['excess']:.4g} ref {row['reference']:.4g}  ({row['seconds']:.1f}s, "
            f"{info['stop']})",
            flush=True,
        )
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    wall = sum(r["seconds"] for r in results)  # every point's own time (also across --resume)
    write_report(results, out, wall, a.seeds)
    print(f"wall {wall:.0f} s")


def write_report(results: list[dict], out: Path, wall: float, seeds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict = {}
    for r in results:
        groups.setdefault((r["algorithm"], r["axis"]), []).append(r)
    lines = [
        f"Excess population loss (mean of {seeds} seeds; `ref`: the same schedule at ε = 500 (Asi: 10⁵, certified), "
        "i.e. optimization + statistical error; `priv` = excess − ref, the privacy part) and "
        "fitted log-log slopes beside the theorem's slope of the privacy term. δ = 1e-6 "
        "(Huang Alg. 1: δ/k·e^-ε at k records per user). Marks: `n<min`: fewer units than the "
        "estimator's utility minimum (privacy holds); `infeasible`: the configuration is refused "
        f"(too few users for AboveThreshold's privacy proof). Time: {wall:.0f} s, summed over the points.\n",
        "| algorithm | axis | x: excess (ref) | slope of excess | slope of priv | theorem (privacy term) |",
        "|---|---|---|---:|---:|---|",
    ]
    for (alg, axis), rows in groups.items():
        ok = [r for r in rows if r["excess"] is not None]
        s_ex = slope([r["x"] for r in ok], [r["excess"] for r in ok])
        s_pr = slope([r["x"] for r in ok], [r["privacy_part"] for r in ok])
        pts = ", ".join(
            (
                f"{r['x']:g}: infeasible"
                if r["excess"] is None
                else f"{r['x']:g}: {r['excess']:.3g} ({r['reference']:.3g})"
            )
            + (" halted" if r["stop"] == "halted" else "")
            + (
                " n<min"
                if r.get("min_users_required") and r["units"] < r["min_users_required"]
                else ""
            )
            for r in rows
        )
        f = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(
            f"| {alg} | {axis} | {pts} | {f(s_ex)} | {f(s_pr)} | {THEORY.get((alg, axis), '')} |"
        )
    lines += full_vs_joint(groups, out)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    for alg in sorted({k[0] for k in groups if k[1] != "nk"}):
        axes = [(k[1], v) for k, v in groups.items() if k[0] == alg]
        fig, axs = plt.subplots(1, len(axes), figsize=(4 * len(axes), 3.4), squeeze=False)
        for ax, (axis, rows) in zip(axs[0], axes):
            rows = [r for r in rows if r["excess"] is not None]
            xs = np.array([r["x"] for r in rows], dtype=float)
            ax.loglog(xs, [max(r["excess"], 1e-6) for r in rows], "o-", label="excess")
            ax.loglog(xs, [max(r["reference"], 1e-6) for r in rows], "s--", label="ref (ε=500)")
            pr = [r["privacy_part"] for r in rows]
            if all(v > 0 for v in pr):
                ax.loglog(xs, pr, "^:", label="excess − ref")
            s_ex, s_pr = slope(xs, [r["excess"] for r in rows]), slope(xs, pr)
            ax.set_title(
                f"{axis}: slope {'n/a' if s_ex is None else f'{s_ex:.2f}'}"
                f" (priv {'n/a' if s_pr is None else f'{s_pr:.2f}'})",
                fontsize=9,
            )
            ax.set_xlabel(axis)
            ax.set_ylabel("excess population loss")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(alg)
        fig.tight_layout()
        fig.savefig(out / f"{alg.replace(' ', '_')}.png", dpi=110)
        plt.close(fig)
    print("\n".join(lines))


def full_vs_joint(groups: dict, out: Path) -> list[str]:
    """Huang's full-DP baseline against joint DP on the nk axis: the gap excess_full − excess_joint
    per nk (per seed: the runs of one seed share data, sampled records and, at joint's η, the
    shared noise), its fitted log-log slope, and the theorem's: the privacy terms differ by
    ∝ sqrt(nk+ℓ) − sqrt(ℓ) (ℓ = 18), fitted over the same nk. Also ``full_vs_joint.png``."""
    joint = {r["x"]: r for r in groups.get((FULL_JOINT, "nk"), []) if r["excess"] is not None}
    if not joint:
        return []
    import matplotlib.pyplot as plt

    ell = 2 * HUANG1_BASE["f"] + 2
    lines = [
        "",
        f"Huang Alg. 1, full-DP baseline vs joint DP (n owners at N = mn = {HUANG1_BASE['N']}, "
        f"T = N, ε = {HUANG1_BASE['eps']}, same σ; k = {K_PERSONAL} personal coordinates per owner, "
        f"ℓ = {ell}): gap = excess_full − excess_joint (per seed in brackets), fitted log-log "
        "slope against nk beside the theorem's, the slope of sqrt(nk+ℓ) − sqrt(ℓ) over the same nk.",
        "",
        "| variant | nk: gap [seeds] (excess_full / excess_joint) | slope of gap | slope of priv gap | theorem |",
        "|---|---|---:|---:|---:|",
    ]
    fig, axs = plt.subplots(1, 2, figsize=(9, 3.6))
    xs_j = sorted(joint)
    axs[0].loglog(xs_j, [joint[x]["excess"] for x in xs_j], "o-", color="C0", label="joint DP")
    for label, mark, col in ((FULL_BASE, "s-", "C1"), (FULL_SAME_STEP, "^--", "C2")):
        rows = [
            r for r in groups.get((label, "nk"), []) if r["excess"] is not None and r["x"] in joint
        ]
        if not rows:
            continue
        xs = [r["x"] for r in rows]
        gaps = [r["excess"] - joint[r["x"]]["excess"] for r in rows]
        pgaps = [r["privacy_part"] - joint[r["x"]]["privacy_part"] for r in rows]
        seeds = [
            [a - b for a, b in zip(r["excess_seeds"], joint[r["x"]]["excess_seeds"])] for r in rows
        ]
        theory = [math.sqrt(x + ell) - math.sqrt(ell) for x in xs]
        s_g, s_p, s_t = slope(xs, gaps), slope(xs, pgaps), slope(xs, theory)
        f = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        pts = ", ".join(
            f"{x:g}: {g:.3g} [{', '.join(f'{v:.3g}' for v in sd)}] ({r['excess']:.3g} / "
            f"{joint[x]['excess']:.3g})"
            for x, g, sd, r in zip(xs, gaps, seeds, rows)
        )
        lines.append(f"| {label} | {pts} | {f(s_g)} | {f(s_p)} | {f(s_t)} |")
        axs[0].loglog(
            xs, [r["excess"] for r in rows], mark, color=col, label=label.replace("huang_alg1 ", "")
        )
        if all(g > 0 for g in gaps):
            axs[1].loglog(
                xs,
                gaps,
                mark,
                color=col,
                label=f"{label.replace('huang_alg1 ', '')} − joint (slope {f(s_g)})",
            )
            c = gaps[0] / theory[0]
            axs[1].loglog(xs, [c * t for t in theory], ":", color=col, alpha=0.6)
    axs[1].plot(
        [], [], ":", color="gray", label="∝ sqrt(nk+ℓ) − sqrt(ℓ) (theorem, from the first point)"
    )
    for ax, t in zip(axs, ("excess population loss", "gap to joint DP")):
        ax.set_xlabel("nk (n owners × k = 2 personal coordinates)")
        ax.set_ylabel(t)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"Huang Alg. 1: full-DP baseline vs joint DP (N = mn = {HUANG1_BASE['N']})", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(out / "huang_alg1_full_vs_joint.png", dpi=110)
    plt.close(fig)
    return lines


if __name__ == "__main__":
    main()
