"""Owner grouping under neighbours: does removing one user move the others? (issue 49, row (d))

Writes docs/results/privacy_audit/paths_grouping.md's numbers (one JSON line per measurement on
stdout, or appended to ``--jsonl``) for the fedudp on ``PYTHONPATH`` (run it once on a worktree of
the old commit and once on the current tree):

1. ``moved``: ``group_users`` on 40 natural users (labels of their own) over 4 owners, every user
   removed in turn, over ``--seeds`` seeds: the mean number of the other 39 users whose owner
   changes, for ``random`` and ``dirichlet``.
2. ``audit``: owner-side DP-SGD (``privacy.placement=local_dpsgd``, one round, claimed ε = 4 at
   δ = 1e-5, q = 1 and one step, so each owner's release is Gaussian by construction) on an
   adversarial pair: 8 users over 2 owners (``partition.owner_rule=random``, capacity 8, batch 8),
   every user's gradient clipped to C in its own direction (orthogonal one-hot features), user 0
   the canary. D is prepared from the 8 users' arrays; the real neighbour D' is prepared from the
   arrays without user 0 (the rule groups them again), and the accounted one is D's federation
   without user 0 (``Federation.without_user``: every other user stays). The release is both
   owners' noisy deltas, ``--trials`` per side with fresh DP-SGD noise each, scored by
   ``fedudp.privacy.audit_stats.audit_samples`` (Clopper-Pearson threshold bounds and the
   Gaussian-DP fit, jointly at 99%).

Usage (two to four minutes per tree on one core; docs/results/privacy_audit/paths_grouping.md)::

    PYTHONPATH=<tree> .venv/bin/python scripts/reproductions/audit_grouping.py \\
        --label after --jsonl docs/results/privacy_audit/paths_grouping.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time

import numpy as np

FEATURES, CLASSES, PAIR_USERS, PAIR_OWNERS = 8, 2, 8, 2


def _records(names: list[int], scale: float = 10.0):
    """User i: 3 records x = scale * e_(i mod FEATURES), label i % CLASSES (its own data)."""
    import fedudp

    x = np.zeros((3 * len(names), FEATURES), np.float32)
    for j, u in enumerate(names):
        x[3 * j : 3 * j + 3, u % FEATURES] = scale
    y = np.repeat(np.array([u % CLASSES for u in names], np.int64), 3)
    return fedudp.from_arrays(x, y, np.repeat(np.array(names, np.int64), 3), classes=CLASSES)


def moved(seeds: int) -> list[dict]:
    from fedudp.data.natural import owner_of_users
    from fedudp.data.records import group_users

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, 40)
    out = []
    for rule in ("random", "dirichlet"):
        counts = []
        for seed in range(seeds):

            def owners(keep: np.ndarray) -> dict:
                import fedudp

                users = np.repeat(keep, 2)
                r = fedudp.from_arrays(
                    np.zeros((len(users), 1), np.float32),
                    np.repeat(labels[keep], 2),
                    users,
                    classes=4,
                )
                kw = {"alpha": 0.5} if rule == "dirichlet" else {}
                return owner_of_users(group_users(r, rule, num_owners=4, seed=seed, **kw))

            base = owners(np.arange(40))
            for u in range(40):
                other = owners(np.delete(np.arange(40), u))
                counts.append(sum(base[v] != other[v] for v in other))
        out.append(
            {
                "what": "moved",
                "rule": rule,
                "users": 40,
                "owners": 4,
                "seeds": seeds,
                "mean_moved": float(np.mean(counts)),
                "max_moved": int(np.max(counts)),
            }
        )
    return out


def audit_pair(seed: int, trials: int) -> list[dict]:
    import torch

    from fedudp.audit import local_dpsgd as audit_mod
    from fedudp.build import prepare
    from fedudp.config import config_from_overrides
    from fedudp.privacy.audit_stats import audit_samples

    torch.set_num_threads(1)
    over = {
        "method": "full_dp",
        "privacy.placement": "local_dpsgd",
        "privacy.epsilon": 4.0,
        "privacy.delta": 1e-5,
        "privacy.clip": 1.0,
        "train.rounds": 1,
        "train.batch_size": PAIR_USERS,
        "train.local_epochs": 1,
        "progress": False,
        "dataset.name": "memory",
        "dataset.classes": CLASSES,
        "dataset.input_shape": [FEATURES],
        "dataset.test_fraction": 0.0,
        "partition.owner_rule": "random",
        "partition.num_owners": PAIR_OWNERS,
        "public.users": PAIR_USERS,
        "public.owner_capacity": PAIR_USERS,
        "public.records_per_user": 3,
        "engine_opts.float64": True,
        "seed": seed,
    }
    cfg = config_from_overrides(over)
    p = prepare(cfg, records=_records(list(range(PAIR_USERS))))
    q = prepare(cfg, records=_records(list(range(1, PAIR_USERS))))
    agg, owners = p.aggregator, p.owners
    assert agg is not None and p.billboard is not None and q.aggregator is not None
    claimed = audit_mod.one_release_epsilon(agg, 1e-5)
    assert audit_mod.one_release_epsilon(q.aggregator, 1e-5) == claimed  # the same public claim
    canary = int(np.flatnonzero(p.fed.user_ids == 0)[0])

    def owner_of(f) -> dict:
        return dict(zip(f.user_ids.tolist(), f.owner_ids[f.user_owner].tolist()))

    base, regrouped = owner_of(p.fed), owner_of(q.fed)
    n_moved = sum(base[u] != regrouped[u] for u in regrouped)
    shared = p.billboard.shared_params()
    cap = tuple([PAIR_USERS] * (8 * trials))
    owners.training = dataclasses.replace(owners.training, dpsgd_capacity=cap)

    def releases(fed, side: int) -> np.ndarray:
        """[trials, owners * d]: every owner's noisy delta, fresh DP-SGD noise per release."""
        parts = []
        for j in range(PAIR_OWNERS):
            shard = fed.owner(j)
            if shard.num_users == 0:
                raise SystemExit(f"seed {seed}: owner {j} holds no users; pick another seed")
            rep = audit_mod._replicate(shard, trials, (2 * j + side) * 2 * trials)
            d = owners.owner_deltas(
                rep, shared, owners.initial_personal(trials), np.arange(trials), 1, agg.constraint
            )
            parts.append(d.to(torch.float64).numpy())
        return np.concatenate(parts, 1)

    t0 = time.perf_counter()
    d = releases(p.fed, 0)
    rows = []
    for kind, fed in (
        ("fixed owners (Federation.without_user)", p.fed.without_user(canary)),
        ("regrouped (prepared without the canary)", q.fed),
    ):
        dp = releases(fed, 1)
        s = audit_samples(d, dp, 1e-5, audit_mod.ALPHA, gaussian=True)
        best = s.best
        rows.append(
            {
                "what": "audit",
                "neighbour": kind,
                "seed": seed,
                "rule": "random",
                "users": PAIR_USERS,
                "owners": PAIR_OWNERS,
                "owner_sizes": np.diff(p.fed.owner_user_offsets).tolist(),
                "owner_sizes_neighbour": np.diff(fed.owner_user_offsets).tolist(),
                "others_moved": n_moved if kind.startswith("regrouped") else 0,
                "releases_per_side": trials,
                "claimed_epsilon": round(claimed, 4),
                "noise_multiplier": round(float(agg.noise_multiplier), 4),
                "epsilon_lower_bound": round(best.epsilon, 4),
                "best_bound": f"{best.statistic}, {best.method}",
                "gdp_mu": round(s.separation.mu_hat, 4),
                "gdp_mu_lower": round(s.separation.mu_lower, 4),
                "gdp_model_ok": s.separation.model_ok,
                "verdict": (
                    "VIOLATION: less private than its ledger claims"
                    if best.epsilon > claimed * (1 + 1e-9)
                    else "consistent with the ledger"
                ),
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True, help="before | after (recorded in every line)")
    ap.add_argument("--trials", type=int, default=4000, help="releases per side")
    ap.add_argument("--seeds", type=int, default=5, help="seeds of the moved count")
    ap.add_argument("--pair-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jsonl", default="", help="append the lines here (else stdout)")
    a = ap.parse_args()
    import fedudp

    commit = subprocess.run(
        [
            "git",
            "-C",
            str(fedudp.__file__).rsplit("/fedudp/", 1)[0],
            "rev-parse",
            "--short",
            "HEAD",
        ],
        capture_output=True,
        text=True,
    ).stdout.strip()
    t0 = time.perf_counter()
    rows = moved(a.seeds)
    for s in a.pair_seeds:
        rows += audit_pair(s, a.trials)
    wall = round(time.perf_counter() - t0, 1)
    lines = [json.dumps({"label": a.label, "commit": commit, **r}) for r in rows]
    lines.append(json.dumps({"label": a.label, "commit": commit, "what": "wall", "seconds": wall}))
    if a.jsonl:
        with open(a.jsonl, "a") as fh:
            fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
