"""Validate the one-run canary estimate where the truth is known (docs/results/privacy_audit/canaries.md).

A d-dimensional Gaussian mechanism with K canaries inserted at rate 1 (``fedudp.billboard.canaries
.simulated_release``): every round releases the canaries' ``C · c_k``, ``--others`` random
vectors of norm C and N(0, (zC)²) noise; Δ is the sum over the rounds. Adding or removing one
canary is then a Gaussian mechanism whose ε at δ dp-accounting gives exactly (``rounds``
Gaussian events at noise multiplier z). For each z and seed the script prints Andrew et al.'s
estimate (``fedudp.billboard.canaries.andrew_estimate``) and its 95 % bootstrap interval, and a
Markdown table over the seeds: the median estimate, its 10th-90th percentiles and how often
each interval (``ci``, ``ci_bootstrap``) holds the true ε.

    .venv/bin/python scripts/reproductions/canary_validation.py --dim 20000 --canaries 500 --seeds 10 \
        --noise 0.5 1 2 4 --rounds 1 --delta 1e-5
    .venv/bin/python scripts/reproductions/canary_validation.py --runs docs/results/privacy_audit/canary_runs

``--runs`` reads the run folders on disk, or packed: the committed ones are in
``docs/results/privacy_audit/raw.tar.xz`` (``canary_runs/...``; ``scripts/tools/results_archive.py``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def true_epsilon(z: float, rounds: int, delta: float) -> float:
    import dp_accounting

    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(z), rounds)
    return float(acc.get_epsilon(delta))


def runs_table(folder: str) -> list[str]:
    """The Markdown table of the canary runs under ``folder`` (each ``<name>/summary.json``,
    wall times from ``times.jsonl``): the ledger's ε beside the one-run estimate."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import results_archive  # scripts/tools/: run folders on disk or in the folder's raw.tar.xz

    times = {}
    tj = Path(folder) / "times.jsonl"
    if results_archive.is_file(tj):
        for line in results_archive.read_text(tj).splitlines():
            r = json.loads(line)
            times[r["run"]] = r["wall_s"]
    rows = [
        "| run | noise × | ledger ε (δ) | guarantee | accuracy | canaries, d | cosine mean·√d, "
        "std·√d | canary ε estimate | 95 % interval | bootstrap interval | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in results_archive.glob(folder, "*/summary.json"):
        s = json.loads(results_archive.read_text(f))
        e = s.get("canary_epsilon_estimate")
        if not e:
            continue
        cfg = results_archive.read_text(f.parent / "config.yaml")
        scale = "0.5" if "noise_scale: 0.5" in cfg else "1"
        r = e["dim"] ** 0.5
        rows.append(
            f"| {f.parent.name} | {scale} | {s['epsilon']:.3f} ({s['delta']:g}) | "
            f"{s['guarantee']} | {s['accuracy_mean']:.4f} | {e['canaries']}, {e['dim']} | "
            f"{e['cosine_mean'] * r:.3f}, {e['cosine_std'] * r:.3f} | {e['value']:.3f} | "
            f"{e['ci'][0]:.3f}-{e['ci'][1]:.3f} | "
            f"{e['ci_bootstrap'][0]:.3f}-{e['ci_bootstrap'][1]:.3f} | "
            f"{times.get(f.parent.name, '-')} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--runs", metavar="FOLDER", help="print the table of the canary runs under FOLDER and stop"
    )
    ap.add_argument("--dim", type=int, default=20000)
    ap.add_argument("--canaries", type=int, default=500)
    ap.add_argument("--others", type=int, default=0, help="random unit vectors per round")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--noise", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--rounds", type=int, nargs="+", default=[1])
    ap.add_argument("--delta", type=float, nargs="+", default=[1e-5])
    a = ap.parse_args(argv)
    if a.runs:
        print("\n".join(runs_table(a.runs)))
        return 0
    from fedudp.billboard.canaries import Canaries, andrew_estimate, simulated_release

    t0 = time.perf_counter()
    rows = []
    for rounds in a.rounds:
        for z in a.noise:
            runs = []
            for seed in range(a.seeds):
                c = Canaries(a.canaries, a.dim, 1.0, seed=1000 + seed)
                cos = c.cosines(
                    simulated_release(c, z, rounds, np.random.default_rng(seed), others=a.others)
                )
                per = {}
                for delta in a.delta:
                    e = andrew_estimate(cos, a.dim, delta, np.random.default_rng(seed))
                    per[delta] = e
                    print(
                        f"z={z:g} T={rounds} seed={seed} delta={delta:g}: estimate "
                        f"{e['value']:.3f} [{e['ci'][0]:.3f}, {e['ci'][1]:.3f}] "
                        f"bootstrap [{e['ci_bootstrap'][0]:.3f}, {e['ci_bootstrap'][1]:.3f}] "
                        f"sigma*sqrt(d)={e['cosine_std'] * a.dim**0.5:.3f}",
                        flush=True,
                    )
                runs.append(per)
            for delta in a.delta:
                truth = true_epsilon(z, rounds, delta)
                v = np.array([r[delta]["value"] for r in runs])
                cover = [
                    np.mean([r[delta][k][0] <= truth <= r[delta][k][1] for r in runs])
                    for k in ("ci", "ci_bootstrap")
                ]
                rows.append(
                    (z, rounds, delta, truth, np.median(v), *np.quantile(v, [0.1, 0.9]), *cover)
                )
    print(
        f"\nd = {a.dim}, K = {a.canaries} canaries at rate 1, {a.others} other unit vectors "
        f"per round, {a.seeds} seeds; wall {time.perf_counter() - t0:.0f} s\n"
    )
    print(
        "| z | rounds | δ | true ε (dp-accounting) | estimate, median over seeds | "
        "10th-90th percentile | 95 % interval (`ci`) holds the truth | "
        "bootstrap interval holds it |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for z, T, delta, truth, med, lo, hi, cover, cover_b in rows:
        print(
            f"| {z:g} | {T} | {delta:g} | {truth:.3f} | {med:.3f} | {lo:.3f}-{hi:.3f} | "
            f"{cover * 100:.0f} % | {cover_b * 100:.0f} % |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
