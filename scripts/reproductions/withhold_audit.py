"""The billboard's fail-closed withholding with one failing owner: does the release decision read
the secret Poisson sample? (issue 49, audit row (c)).

Four owners of ten users each (N = 40, every owner's declared capacity 10); owner 3 fails in
every round (reported as a ``Failure``, as ``engine=flower`` now asks every owner each round).
For each case (q, ``train.min_users``) the billboard's own seeded sample and its ``withhold``
decision are run for ``--rounds`` rounds, no training. Measured: rounds released; a unit's
inclusion probability given release (units at the answering owners, sampled in released rounds,
over released rounds x 30; a 95% Clopper–Pearson interval); the ε per release that inclusion
probability implies for the same Poisson-subsampled Gaussian (dp-accounting PLD, δ = 1e-5),
against the ε per release the ledger composes (at the declared q). The noise multiplier z of
each case is calibrated so that the ledger's ε per release is the audit's (1.27 at q = 0.02,
0.65 at q = 0.5).

``--tree`` is the fedudp source tree to import (default: this checkout): the tree before the
fix (its ``withhold(round, answered_owners, answered_units, failed_owners)``, the sampled count)
or after it (``withhold(round, failed_owner_ids)``, declared slots)::

    git worktree add /tmp/wt-withhold 13691d9
    .venv/bin/python scripts/reproductions/withhold_audit.py --tree /tmp/wt-withhold \\
        --label before --out /tmp/withhold_before.jsonl
    .venv/bin/python scripts/reproductions/withhold_audit.py --label after \\
        --out /tmp/withhold_after.jsonl
    git worktree remove /tmp/wt-withhold
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWNERS, PER_OWNER, FAILING, DELTA = 4, 10, 3, 1e-5
CASES = (
    {"q": 0.02, "min_users": 1, "ledger_eps": 1.27},
    {"q": 0.5, "min_users": 18, "ledger_eps": 0.65},
)


def per_release_epsilon(q: float, z: float) -> float:
    """ε of one Poisson(q)-subsampled Gaussian(z) release at δ (dp-accounting PLD)."""
    import dp_accounting as dpa

    acc = dpa.pld.PLDAccountant()
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)))
    return float(acc.get_epsilon(DELTA))


def calibrate(q: float, target: float) -> float:
    """The z whose one release at rate q has ε = target (bisection on log z)."""
    lo, hi = math.log(0.05), math.log(100.0)
    for _ in range(25):
        mid = 0.5 * (lo + hi)
        if per_release_epsilon(q, math.exp(mid)) > target:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)


def board(q: float, z: float, min_users: int, seed: int):
    """A real billboard over N = 40 users (4 owners x 10), the tree's own constructor."""
    import numpy as np
    import torch

    from fedudp.aggregators import GaussianAggregator, Sampling
    from fedudp.billboard.server import Billboard
    from fedudp.privacy.accountant import ADJACENCY, Ledger, accountant_for

    s = Sampling(q, OWNERS * PER_OWNER)
    agg = GaussianAggregator(1.0, z, s)
    led = Ledger(
        unit="user",
        adjacency=ADJACENCY,
        accounting="certified",
        guarantee="certified",
        mechanism="gaussian",
        accountant="pld",
        delta=DELTA,
        target_epsilon=None,
    )
    kw: dict = {"seed": seed, "delta": DELTA, "min_owners": 1, "min_users": min_users}
    if "owner_units" in inspect.signature(Billboard.__init__).parameters:
        kw["owner_units"] = np.full(OWNERS, PER_OWNER)
    acc = accountant_for(Billboard.first_event(agg), None, None)
    return Billboard({"w": torch.zeros(1)}, agg, s, led, acc, **kw)


def simulate(q: float, z: float, min_users: int, rounds: int, seed: int) -> dict:
    import numpy as np

    from fedudp.privacy.audit_stats import clopper_pearson

    bb = board(q, z, min_users, seed)
    old = "answered_units" in inspect.signature(bb.withhold).parameters
    owner = np.repeat(np.arange(OWNERS), PER_OWNER)
    released = included = 0
    for r in range(1, rounds + 1):
        cohort = np.flatnonzero(bb.sample(r))
        lost = int((owner[cohort] == FAILING).sum())
        if old:  # the sampled count of the owners that answered
            why = bb.withhold(r, OWNERS - 1, len(cohort) - lost, 1)
        else:  # which owners failed, against their declared capacities
            why = bb.withhold(r, [FAILING])
        if why is None:
            released += 1
            included += len(cohort) - lost
    trials = released * (OWNERS - 1) * PER_OWNER
    p = included / trials if trials else float("nan")
    lo, hi = clopper_pearson(np.array([included]), trials, 0.025) if trials else ([math.nan],) * 2
    return {
        "released": released,
        "inclusion_given_release": p,
        "inclusion_ci95": [float(lo[0]), float(hi[0])],
        "epsilon_per_release_implied": per_release_epsilon(p, z) if trials else None,
        "epsilon_per_release_implied_upper": per_release_epsilon(float(hi[0]), z)
        if trials
        else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, default=ROOT, help="the fedudp source tree to import")
    ap.add_argument("--label", required=True, help="before | after (written to each line)")
    ap.add_argument("--rounds", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="JSON lines, one per case")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error(f"--rounds {a.rounds}: must be >= 1")
    sys.path.insert(0, str(a.tree.resolve()))
    import fedudp

    where = Path(fedudp.__file__).resolve().parents[1]
    if where != a.tree.resolve():
        ap.error(f"--tree {a.tree}: imported fedudp from {where} instead")
    lines = []
    for case in CASES:
        t0 = time.perf_counter()
        z = calibrate(case["q"], case["ledger_eps"])
        got = simulate(case["q"], z, case["min_users"], a.rounds, a.seed)
        lines.append(
            {
                "label": a.label,
                "tree": "." if a.tree.resolve() == ROOT.resolve() else a.tree.name,
                "owners": OWNERS,
                "users_per_owner": PER_OWNER,
                "failing_owner": FAILING,
                "q": case["q"],
                "min_users": case["min_users"],
                "z": round(z, 6),
                "delta": DELTA,
                "rounds": a.rounds,
                "seed": a.seed,
                "epsilon_per_release_ledger": per_release_epsilon(case["q"], z),
                **got,
                "seconds": round(time.perf_counter() - t0, 2),
            }
        )
        print(json.dumps(lines[-1]))
    a.out.write_text("".join(json.dumps(x) + "\n" for x in lines))


if __name__ == "__main__":
    main()
