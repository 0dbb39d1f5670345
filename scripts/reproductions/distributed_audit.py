"""The empirical audit of the distributed mechanisms (issue 51): the numbers of
docs/results/distributed_dp/audit.md.

Every row is ``fedudp.audit.distributed.audit_distributed`` on a mechanism calibrated with
``DdgAggregator.calibrated`` / ``SkellamAggregator.calibrated`` for one round (C = 1,
δ = 1e-5, d = 64, 3 background users per owner, the heuristic scale, β = e^-0.5, k = 4): one
round of the whole protocol per trial (fresh rounding and noise streams, fresh mask keys, the
last owners dropping out, the billboard's release), the lower bound (99%) against the round's
accounted ε at its survivors. Twins: ``noise_scale=0.1`` (the owners add a tenth of the
accounted shares) and a ledger that accounts a round at every owner of the roster while 30 of 32
dropped. Then the false alarms of the real mechanisms over ``--seeds`` seeds.

Usage (about five minutes on one core)::

    .venv/bin/python scripts/reproductions/distributed_audit.py --seeds 20
"""

from __future__ import annotations

import argparse
import dataclasses
import time

ROW_HEAD = (
    "| mechanism | bits | owners | survivors | q | trials per side | accounted ε "
    "| audit lower bound (99%) | flagged? | seconds |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"
)


def calibrated(noise, *, owners=4, min_owners=3, epsilon=1.0, bits=16, rate=1.0, scale=1.0):
    from fedudp.aggregators import DdgAggregator, Sampling, SkellamAggregator

    cls = DdgAggregator if noise == "ddgauss" else SkellamAggregator
    return cls.calibrated(
        clip=1.0,
        epsilon=epsilon,
        delta=1e-5,
        rounds=1,
        sampling=Sampling(rate, round((3 * owners + 1) / rate)),
        dim=64,
        min_owners=min_owners,
        owner_units=[4] * owners,
        seed=0,
        noise_scale=scale,
        bits=bits,
    )


def row(label, agg, trials, dropped, seed=0, claim_at=None):
    """One audit's table row; ``claim_at``: a twin ledger accounting the round at that many
    owners instead of its survivors."""
    from fedudp.audit.distributed import audit_distributed

    t0 = time.perf_counter()
    r = audit_distributed(agg, trials, 1e-5, seed, dropped=dropped)
    if claim_at is not None:
        r = dataclasses.replace(r, claimed_epsilon=agg.dp_event_for(claim_at).epsilon(1e-5))
    claim, flagged = r.claimed_epsilon, r.violation
    e = agg.encoding
    return (
        f"| {label} | {e.bits} | {agg.owners} | {agg.owners - dropped} "
        f"| {agg.sampling.rate:g} | {trials} | {claim:.3f} | {r.lower_bound:.3f} "
        f"| {'**yes**' if flagged else 'no'} | {time.perf_counter() - t0:.1f} |"
    )


def main() -> None:
    import torch

    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--trials", type=int, default=2000)
    a = ap.parse_args()
    n = a.trials
    print(ROW_HEAD, flush=True)
    for label, agg, trials, dropped, claim_at in (
        ("ddgauss", calibrated("ddgauss"), n, 1, None),
        ("ddgauss, twin noise_scale=0.1", calibrated("ddgauss", scale=0.1), n, 1, None),
        ("ddgauss", calibrated("ddgauss", bits=12), n, 1, None),
        ("ddgauss, q = 0.5", calibrated("ddgauss", rate=0.5), n, 1, None),
        ("skellam", calibrated("skellam"), n, 0, None),
        ("skellam, twin noise_scale=0.1", calibrated("skellam", scale=0.1), n, 0, None),
        (
            "ddgauss (ε = 4)",
            calibrated("ddgauss", owners=32, min_owners=2, epsilon=4.0),
            3000,
            30,
            None,
        ),
        (
            "ddgauss (ε = 4), twin ledger at all 32 owners",
            calibrated("ddgauss", owners=32, min_owners=2, epsilon=4.0),
            3000,
            30,
            32,
        ),
    ):
        print(row(label, agg, trials, dropped, claim_at=claim_at), flush=True)
    from fedudp.audit.distributed import audit_distributed

    for noise, dropped in (("ddgauss", 1), ("skellam", 0)):
        agg = calibrated(noise)
        t0 = time.perf_counter()
        rs = [audit_distributed(agg, n, 1e-5, s, dropped=dropped) for s in range(a.seeds)]
        worst = max(r.lower_bound for r in rs)
        print(
            f"false alarms, {noise} ({agg.owners - dropped} of {agg.owners} owners, {n} trials, "
            f"accounted ε {rs[0].claimed_epsilon:.3f}): {sum(r.violation for r in rs)} of "
            f"{len(rs)} seeds flagged (seeds 0..{a.seeds - 1}; largest lower bound "
            f"{worst:.3f}; {time.perf_counter() - t0:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
