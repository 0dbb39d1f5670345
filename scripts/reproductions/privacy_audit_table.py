"""The privacy-audit table of docs/results/privacy_audit/audit_table.md.

Runs ``fedudp-audit``'s own functions on every case below, one JSON line per finished case in
``<out>/runs.jsonl`` (rerunning skips the finished ones: resumable), then writes the Markdown
table ``<out>/audit_table.md`` from all finished lines.

    .venv/bin/python scripts/reproductions/privacy_audit_table.py [--out docs/results/privacy_audit] [--only NAME]

Cases: the server-side clip + Gaussian release at ε = 1, δ = 1e-5 (one release), correct, with
the noise times 0.7 and 0.3, and with clipping off, 200,000 releases per side; owner-side DP-SGD
(``privacy.placement=local_dpsgd``, B = 32) on the add/remove pairs 10 -> 9 and 33 -> 32 users,
correct and with its schedule taken from the data (a schedule read from the data, a negative
control); the false-alarm rate of the correct Gaussian release (20 seeds) and of owner-side
DP-SGD (20 seeds per pair), and the detection rate of the 0.7 noise cut (20 seeds); 80 more
seeds of the correct Gaussian release.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from resumable import run_resumable  # this folder

GAUSSIAN = {"privacy.epsilon": 1.0, "privacy.delta": 1e-5, "train.rounds": 1}
DPSGD = {
    "privacy.placement": "local_dpsgd",
    "privacy.epsilon": 1.0,
    "privacy.delta": 1e-5,
    "train.batch_size": 32,
}

# name -> (kind, broken, users (local_dpsgd), releases per side, seeds)
CASES = {
    "gaussian": ("gaussian", "", None, 200_000, [0]),
    "gaussian noise x0.7": ("gaussian", "noise=0.7", None, 200_000, [0]),
    "gaussian noise x0.3": ("gaussian", "noise=0.3", None, 200_000, [0]),
    "gaussian clip off": ("gaussian", "clip=off", None, 200_000, [0]),
    "local_dpsgd 10->9": ("local_dpsgd", "", 10, 50_000, [0]),
    "local_dpsgd 33->32": ("local_dpsgd", "", 33, 50_000, [0]),
    "local_dpsgd 10->9 schedule=data": ("local_dpsgd", "schedule=data", 10, 50_000, [0]),
    "local_dpsgd 33->32 schedule=data": ("local_dpsgd", "schedule=data", 33, 50_000, [0]),
    "false alarms: gaussian": ("gaussian", "", None, 200_000, list(range(1, 21))),
    "detections: gaussian noise x0.7": ("gaussian", "noise=0.7", None, 200_000, list(range(1, 21))),
    "false alarms: local_dpsgd 10->9": ("local_dpsgd", "", 10, 10_000, list(range(1, 21))),
    "false alarms: local_dpsgd 33->32": ("local_dpsgd", "", 33, 10_000, list(range(1, 21))),
    "false alarms: gaussian, seeds 21-100": ("gaussian", "", None, 200_000, list(range(21, 101))),
}


def run_case(name: str) -> dict:
    from fedudp.aggregators import Sampling
    from fedudp.build import estimator as build_aggregator
    from fedudp.config import config_from_overrides
    from fedudp.build import planned_units
    from fedudp.audit import audit, audit_local_dpsgd

    kind, broken, users, trials, seeds = CASES[name]
    t0 = time.perf_counter()
    rows = []
    for s in seeds:
        if kind == "gaussian":
            cfg = config_from_overrides({"method": "full_dp", **GAUSSIAN})
            agg = build_aggregator(
                cfg, Sampling(cfg.train.sampling_rate, planned_units(cfg)[1]), 1, 8
            )
            r = audit(agg, 8, trials, cfg.privacy.delta, s, broken, cfg.estimator["bound"])
        else:
            r = audit_local_dpsgd(DPSGD, users, trials, s, broken)
        rows.append(
            {
                "seed": s,
                "claimed": r.claimed_epsilon,
                "lower_bound": r.lower_bound,
                "by": f"{r.samples.best.method}, {r.samples.best.statistic}",
                "violation": r.violation,
                "seconds": r.seconds,
                "power": r.power,
                "notes": r.samples.notes,
                "bounds": {f"{b.method} / {b.statistic}": b.epsilon for b in r.samples.bounds},
            }
        )
        print(name, rows[-1], flush=True)
    return {
        "name": name,
        "kind": kind,
        "broken": broken,
        "users": users,
        "trials": trials,
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
    }


def render(done: list[dict]) -> str:
    by = {d["name"]: d for d in done}
    out = [
        "# Privacy audit table",
        "",
        "Written by `.venv/bin/python scripts/reproductions/privacy_audit_table.py` (functions of "
        "`fedudp-audit`). ε claimed: the ledger's ε for the one audited release; lower bound: "
        "99% jointly over the bounds tried (Bonferroni). 2 cores, shared with other work.",
        "",
        "| case | mechanism | adjacency pair | releases per side | broken | ε claimed "
        "| ε lower bound (99%) | by | verdict | power (noise cut detected, prob. ≈ 1/2) "
        "| wall time |",
        "|---|---|---|---:|---|---:|---:|---|---|---|---:|",
    ]
    for name, (kind, broken, users, trials, seeds) in CASES.items():
        if name not in by or len(seeds) > 1:
            continue
        d, r = by[name], by[name]["rows"][0]
        mech = (
            "clip + Gaussian (server), ε = 1, δ = 1e-5"
            if kind == "gaussian"
            else "owner-side DP-SGD, B = 32, ε = 1, δ = 1e-5"
        )
        pair = (
            "canary user at the clip norm, in D only"
            if kind == "gaussian"
            else f"owner of {users} users → {users - 1} (capacity {users})"
        )
        p = r["power"] or {}
        power = "; ".join(f"{k}: {v:.3f}×" for k, v in p.items()) or "-"
        verdict = "**violation**" if r["violation"] else "consistent"
        out.append(
            f"| {name} | {mech} | {pair} | {trials:,} | {broken or '-'} "
            f"| {r['claimed']:.3f} | {r['lower_bound']:.3f} | {r['by']} | {verdict} "
            f"| {power} | {d['wall_s']:.0f} s |"
        )
    out += [
        "",
        "## Over seeds",
        "",
        "| case | releases per side | seeds | violations flagged | rate | lower bound: min / median / max | wall time |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    import statistics

    for name, (kind, broken, users, trials, seeds) in CASES.items():
        if name not in by or len(seeds) == 1:
            continue
        d = by[name]
        lbs = [r["lower_bound"] for r in d["rows"]]
        bad = sum(r["violation"] for r in d["rows"])
        out.append(
            f"| {name} | {trials:,} | {len(lbs)} | {bad} | {bad / len(lbs):.2f} "
            f"| {min(lbs):.3f} / {statistics.median(lbs):.3f} / {max(lbs):.3f} "
            f"| {d['wall_s']:.0f} s |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/results/privacy_audit")
    ap.add_argument("--only", action="append", default=[], help="case name (repeatable)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [
        (name, lambda name=name: run_case(name)) for name in CASES if not a.only or name in a.only
    ]
    run_resumable(
        out / "runs.jsonl", out / "audit_table.md", jobs, key=lambda d: d["name"], render=render
    )


if __name__ == "__main__":
    main()
