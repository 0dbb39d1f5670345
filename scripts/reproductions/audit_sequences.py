"""The audit of the stateful and sequential mechanisms (issue 37): docs/results/privacy_audit/
sequence_table.md.

Runs ``fedudp-audit``'s own functions on every case below, one JSON line per finished
(case, seed) in ``<out>/sequence_runs.jsonl`` (rerunning skips the finished ones: resumable),
then writes the Markdown table ``<out>/sequence_table.md`` from all finished lines.

    .venv/bin/python scripts/reproductions/audit_sequences.py [--out docs/results/privacy_audit] [--only NAME]
        [--table-only]

Cases (ε = 1, δ = 1e-5 for the audited releases unless said): adaptive clipping on the server
(one release per trial, and 4 releases per trial), adaptive owner-side DP-SGD, the DP-FTRL tree
(k = 4, 8 releases: two trees) and the banded mechanism (b = 4, 8 releases: two cycles; whole
groups, and sampled at p = 0.5 within the group), owner-side DP-SGD on an owner holding fewer
users than its public capacity (below and above the batch B = 32), on the planned federation
and on natural users (``--natural 4``: 1..4 records each, from plain arrays, every public
number declared); each correct at seed 0, its
noise × 0.5 twin at seed 0, and the correct mechanism over 20 seeds (the false-alarm rate). The
issue's own command (``fedudp-audit --trials 50000 aggregator=gaussian_adaptive``, the default
config, claim 0.195) is the first case.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from resumable import run_resumable  # this folder

SEEDS = list(range(1, 21))
SERVER = {
    "privacy.epsilon": 1.0,
    "privacy.delta": 1e-5,
    "dataset.num_records": 400,
    "partition.num_owners": 4,
}
ADAPTIVE = {**SERVER, "aggregator": "gaussian_adaptive"}
TREE = {**SERVER, "aggregator": "dp_ftrl_tree", "train.rounds": 8, "train.sampling_rate": 0.25}
BANDED = {**SERVER, "aggregator": "dp_mf_banded", "train.rounds": 8, "train.sampling_rate": 0.25}
BANDED_P = {
    **SERVER,
    "aggregator": "dp_mf_banded",
    "train.rounds": 8,
    "train.sampling_rate": 0.125,
    "estimator.bands": 4,
}
DPSGD = {
    "privacy.placement": "local_dpsgd",
    "privacy.epsilon": 1.0,
    "privacy.delta": 1e-5,
    "train.batch_size": 32,
}

# name -> (kind, overrides, releases or (users, capacity), dim, broken, trials, seeds, what)
CASES = {
    "issue command: adaptive, default config": (
        "server",
        {"aggregator": "gaussian_adaptive"},
        1,
        8,
        "",
        50_000,
        [0],
        "adaptive clip (server), default config (10,000 users, q = 1, 20 rounds calibrated)",
    ),
    "adaptive, 1 release": (
        "server",
        {**ADAPTIVE, "train.rounds": 1},
        1,
        2,
        "",
        50_000,
        [0],
        "adaptive clip (server), 400 users, q = 1",
    ),
    "adaptive, 1 release, noise x0.5": (
        "server",
        {**ADAPTIVE, "train.rounds": 1},
        1,
        2,
        "noise=0.5",
        20_000,
        [0],
        "adaptive clip (server), 400 users, q = 1",
    ),
    "adaptive, 4 releases": (
        "server",
        {**ADAPTIVE, "train.rounds": 4},
        4,
        1,
        "",
        20_000,
        [0],
        "adaptive clip (server), 400 users, q = 1",
    ),
    "adaptive, 4 releases, noise x0.5": (
        "server",
        {**ADAPTIVE, "train.rounds": 4},
        4,
        1,
        "noise=0.5",
        10_000,
        [0],
        "adaptive clip (server), 400 users, q = 1",
    ),
    "tree, 8 releases": (
        "server",
        TREE,
        8,
        2,
        "",
        100_000,
        [0],
        "DP-FTRL tree, k = 4 (two trees), 400 users",
    ),
    "tree, 8 releases, noise x0.5": (
        "server",
        TREE,
        8,
        2,
        "noise=0.5",
        20_000,
        [0],
        "DP-FTRL tree, k = 4 (two trees), 400 users",
    ),
    "banded, 8 releases": (
        "server",
        BANDED,
        8,
        2,
        "",
        100_000,
        [0],
        "banded MF, b = 4 (two cycles), whole groups (p = 1)",
    ),
    "banded, 8 releases, noise x0.5": (
        "server",
        BANDED,
        8,
        2,
        "noise=0.5",
        20_000,
        [0],
        "banded MF, b = 4 (two cycles), whole groups (p = 1)",
    ),
    "banded p=0.5, 8 releases": (
        "server",
        BANDED_P,
        8,
        2,
        "",
        100_000,
        [0],
        "banded MF, b = 4, groups sampled at p = 0.5",
    ),
    "banded p=0.5, 8 releases, noise x0.5": (
        "server",
        BANDED_P,
        8,
        2,
        "noise=0.5",
        100_000,
        [0],
        "banded MF, b = 4, groups sampled at p = 0.5",
    ),
    "local_dpsgd adaptive 10->9": (
        "dpsgd",
        {**DPSGD, "privacy.clip_policy": "adaptive"},
        (10, 10),
        0,
        "",
        50_000,
        [0],
        "owner-side DP-SGD, adaptive clip, B = 32",
    ),
    "local_dpsgd adaptive 10->9, noise x0.5": (
        "dpsgd",
        {**DPSGD, "privacy.clip_policy": "adaptive"},
        (10, 10),
        0,
        "noise=0.5",
        10_000,
        [0],
        "owner-side DP-SGD, adaptive clip, B = 32",
    ),
    "local_dpsgd 7->6, capacity 10": (
        "dpsgd",
        DPSGD,
        (7, 10),
        0,
        "",
        50_000,
        [0],
        "owner-side DP-SGD below capacity (M = 10 < B = 32)",
    ),
    "local_dpsgd 30->29, capacity 40": (
        "dpsgd",
        DPSGD,
        (30, 40),
        0,
        "",
        20_000,
        [0],
        "owner-side DP-SGD below capacity (M = 40 > B = 32)",
    ),
    "local_dpsgd 7->6, capacity 10, schedule=data": (
        "dpsgd",
        DPSGD,
        (7, 10),
        0,
        "schedule=data",
        10_000,
        [0],
        "owner-side DP-SGD below capacity (M = 10 < B = 32)",
    ),
    # owner-side DP-SGD on natural users (users of 1..4 records, built in memory from plain
    # arrays, every public number declared; owner 0 below its declared capacity)
    "natural 7->6, capacity 10": (
        "natural",
        DPSGD,
        (7, 10, 4),
        0,
        "",
        50_000,
        [0],
        "owner-side DP-SGD, natural users (1..4 records) below capacity (M = 10 < B = 32)",
    ),
    "natural 7->6, capacity 10, noise x0.5": (
        "natural",
        DPSGD,
        (7, 10, 4),
        0,
        "noise=0.5",
        10_000,
        [0],
        "owner-side DP-SGD, natural users (1..4 records) below capacity (M = 10 < B = 32)",
    ),
    "natural 7->6, capacity 10, schedule=data": (
        "natural",
        DPSGD,
        (7, 10, 4),
        0,
        "schedule=data",
        10_000,
        [0],
        "owner-side DP-SGD, natural users (1..4 records) below capacity (M = 10 < B = 32)",
    ),
    "natural 30->29, capacity 40": (
        "natural",
        DPSGD,
        (30, 40, 4),
        0,
        "",
        20_000,
        [0],
        "owner-side DP-SGD, natural users (1..4 records) below capacity (M = 40 > B = 32)",
    ),
    "natural 30->29, capacity 40, noise x0.3": (
        "natural",
        DPSGD,
        (30, 40, 4),
        0,
        "noise=0.3",
        20_000,
        [0],
        "owner-side DP-SGD, natural users (1..4 records) below capacity (M = 40 > B = 32)",
    ),
    "natural 30->29, capacity 40, schedule=data": (
        "natural",
        DPSGD,
        (30, 40, 4),
        0,
        "schedule=data",
        10_000,
        [0],
        "owner-side DP-SGD, natural users (1..4 records) below capacity (M = 40 > B = 32)",
    ),
    "false alarms: natural 7->6, capacity 10": (
        "natural",
        DPSGD,
        (7, 10, 4),
        0,
        "",
        5_000,
        SEEDS,
        "",
    ),
    "false alarms: natural 30->29, capacity 40": (
        "natural",
        DPSGD,
        (30, 40, 4),
        0,
        "",
        5_000,
        SEEDS,
        "",
    ),
    # false alarms: the correct mechanisms over 20 seeds
    "false alarms: adaptive, 1 release": (
        "server",
        {**ADAPTIVE, "train.rounds": 1},
        1,
        2,
        "",
        50_000,
        SEEDS,
        "",
    ),
    "false alarms: tree, 8 releases": ("server", TREE, 8, 2, "", 100_000, SEEDS, ""),
    "false alarms: banded, 8 releases": ("server", BANDED, 8, 2, "", 100_000, SEEDS, ""),
    "false alarms: banded p=0.5, 8 releases": ("server", BANDED_P, 8, 2, "", 100_000, SEEDS, ""),
    "false alarms: local_dpsgd adaptive 10->9": (
        "dpsgd",
        {**DPSGD, "privacy.clip_policy": "adaptive"},
        (10, 10),
        0,
        "",
        5_000,
        SEEDS,
        "",
    ),
    "false alarms: local_dpsgd 7->6, capacity 10": (
        "dpsgd",
        DPSGD,
        (7, 10),
        0,
        "",
        5_000,
        SEEDS,
        "",
    ),
    "false alarms: adaptive, 4 releases": (
        "server",
        {**ADAPTIVE, "train.rounds": 4},
        4,
        1,
        "",
        5_000,
        SEEDS,
        "",
    ),
    "false alarms: local_dpsgd 30->29, capacity 40": (
        "dpsgd",
        DPSGD,
        (30, 40),
        0,
        "",
        5_000,
        SEEDS,
        "",
    ),
    "false alarms: adaptive, 1 release, seeds 21-60": (
        "server",
        {**ADAPTIVE, "train.rounds": 1},
        1,
        2,
        "",
        50_000,
        list(range(21, 61)),
        "",
    ),
}


def command(name: str) -> str:
    kind, over, rel, dim, broken, trials, seeds, _ = CASES[name]
    args = [f"{k}={v}" for k, v in over.items()]
    if kind == "server":
        args += [f"--dim {dim}"] + ([f"--sequence {rel}"] if rel > 1 else [])
    else:
        args += [
            f"--owner-users {rel[0]}:{rel[1]}" if rel[0] != rel[1] else f"--owner-users {rel[0]}"
        ] + ([f"--natural {rel[2]}"] if kind == "natural" else [])
    args += [f"--trials {trials}"] + ([f"--break {broken}"] if broken else [])
    if len(seeds) > 1:
        args += [f"--seed {seeds[0]} --repeat {len(seeds)}"]
    return ".venv/bin/fedudp-audit " + " ".join(args)


def run_one(name: str, seed: int) -> dict:
    from fedudp import build
    from fedudp.aggregators import Sampling
    from fedudp.audit import audit_local_dpsgd, audit_sequence
    from fedudp.config import config_from_overrides

    kind, over, rel, dim, broken, trials, _, _ = CASES[name]
    t0 = time.perf_counter()
    if kind == "server":  # as fedudp-audit's main builds it
        cfg = config_from_overrides({"method": "full_dp", **over})
        s = build.check(cfg).settings
        spec = build.method(cfg, build.model(cfg))
        n_owners, n_users = build.planned_units(cfg)
        agg = build.estimator(
            cfg,
            Sampling(s.sampling_rate, n_owners if spec.cohort_is_owners else n_users),
            s.rounds,
            dim,
        )
        r = audit_sequence(agg, dim, trials, rel, s.delta, seed, broken, s.bound)
    else:
        r = audit_local_dpsgd(
            over,
            rel[0],
            trials,
            seed,
            broken,
            capacity=rel[1],
            natural=rel[2] if kind == "natural" else None,
        )
    return {
        "case": name,
        "seed": seed,
        "mechanism": r.mechanism,
        "trials": trials,
        "claimed": r.claimed_epsilon,
        "lower": r.lower_bound,
        "violation": r.violation,
        "by": f"{r.samples.best.method}, {r.samples.best.statistic}",
        "power": r.power,
        "mu_hat": r.samples.separation.mu_hat,
        "seconds": time.perf_counter() - t0,
    }


def render(done: list[dict]) -> str:
    by, seen = {}, set()
    for d in done:  # a case's rows at its current trial count, one per seed
        key = (d["case"], d["seed"], d["trials"])
        if d["case"] in CASES and d["trials"] == CASES[d["case"]][5] and key not in seen:
            seen.add(key)
            by.setdefault(d["case"], []).append(d)
    out = [
        "# Audit of the stateful and sequential mechanisms",
        "",
        "Written by `.venv/bin/python scripts/reproductions/audit_sequences.py` (functions of "
        "`fedudp-audit`; one JSON line per case and seed in "
        "[`sequence_runs.jsonl`](sequence_runs.jsonl)). ε claimed: the ledger's ε for the "
        "releases one trial covers; lower bound: 99% jointly over the bounds tried. "
        "2 cores, shared with five other jobs: wall times are long.",
        "",
        "| case | mechanism | releases per trial | trials per side | broken | ε claimed "
        "| ε lower bound (99%) | by | verdict | power (noise cut detected, prob. ≈ 1/2) "
        "| wall time | command |",
        "|---|---|---:|---:|---|---:|---:|---|---|---|---:|---|",
    ]
    for name, (kind, over, rel, dim, broken, trials, seeds, what) in CASES.items():
        if name not in by or len(seeds) > 1:
            continue
        d = by[name][0]
        nrel = rel if kind == "server" else 1
        p = d["power"]
        pw = "; ".join(f"{k}: {v:.3f}×" for k, v in p.items()) if p else "-"
        verdict = "**violation**" if d["violation"] else "consistent"
        out.append(
            f"| {name} | {what} | {nrel} | {trials:,} | {broken or '-'} "
            f"| {d['claimed']:.3f} | {d['lower']:.3f} | {d['by']} | {verdict} | {pw} "
            f"| {d['seconds']:.0f} s | `{command(name)}` |"
        )
    out += [
        "",
        "## False alarms over seeds",
        "",
        "| case | releases per trial | trials per side | seeds | flagged | rate "
        "| lower bound min / median / max | ε claimed | wall time | command |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for name, (kind, over, rel, dim, broken, trials, seeds, what) in CASES.items():
        if name not in by or len(seeds) == 1:
            continue
        ds = by[name]
        lows = [d["lower"] for d in ds]
        bad = sum(d["violation"] for d in ds)
        nrel = rel if kind == "server" else 1
        out.append(
            f"| {name.removeprefix('false alarms: ')} | {nrel} | {trials:,} "
            f"| {len(ds)} of {len(seeds)} | {bad} | {bad / len(ds):.2f} "
            f"| {min(lows):.3f} / {statistics.median(lows):.3f} / {max(lows):.3f} "
            f"| {ds[0]['claimed']:.3f} | {sum(d['seconds'] for d in ds):.0f} s "
            f"| `{command(name)}` |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/results/privacy_audit")
    ap.add_argument("--only", default="")
    ap.add_argument("--table-only", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.only and a.only not in CASES:
        raise SystemExit(f"audit_sequences: --only {a.only}: not a case ({', '.join(CASES)})")
    jobs = [
        ((name, seed, spec[5]), lambda name=name, seed=seed: run_one(name, seed))
        for name, spec in CASES.items()
        if not a.table_only and (not a.only or name == a.only)
        for seed in spec[6]
    ]
    run_resumable(
        out / "sequence_runs.jsonl",
        out / "sequence_table.md",
        jobs,
        key=lambda d: (d["case"], d["seed"], d["trials"]),
        render=render,
        echo=True,
    )


if __name__ == "__main__":
    main()
