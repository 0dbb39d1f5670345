"""What each estimator of ``fedudp.flower.UserLevelDP`` needs, from the code's own calibration
(docs/flower-apps.md#what-each-estimator-needs).

For every estimator and (ε, T) at δ = 1e-5 on d shared coordinates (the example app's 210):

* ``refused below``: the smallest N that ``UserLevelDP.from_run_config`` accepts (bisection on
  the builder's own refusal; the estimator's privacy proof needs it);
* ``utility n``: the estimator's own ``min_users_required`` at that N (its utility guarantee's
  minimum; ``-``: none stated); the noise std on the released mean at the larger of the two;
* for clip + Gaussian (any q, no minimum): z, and the N at which the release noise's expected
  norm z·C·sqrt(d)/(q·N) equals the clip C, at q = 1 and q = 0.1.

    .venv/bin/python scripts/tools/flower_requirements.py [--dim 210] [--eps 1 4 8] [--rounds 10 100]

prints the Markdown table docs/flower-apps.md carries.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

ROWS = ("outlier_removal", "friendlycore", "few_users", "winsorized")


def release_noise(aggregator, dim):
    from fedudp.flower.outcome import release_noise as noise

    return noise(aggregator, dim)


def build(aggregator: str, n: int, eps: float, rounds: int, dim: int, rate: float = 1.0):
    """``UserLevelDP.from_run_config`` at these values (the code's calibration), or None if
    it refuses them."""
    import numpy as np
    from flwr.app import Array, ArrayRecord
    from flwr.serverapp.strategy import FedAvg

    from fedudp.config import ConfigError
    from fedudp.flower import UserLevelDP

    rc = {
        "fedudp.aggregator": aggregator,
        "fedudp.privacy.epsilon": float(eps),
        "fedudp.privacy.delta": 1e-5,
        "fedudp.public.users": int(n),
        "fedudp.train.sampling_rate": float(rate),
        "num-server-rounds": int(rounds),
    }
    init = ArrayRecord({"w": Array(np.zeros(dim, np.float32))})
    try:
        return UserLevelDP.from_run_config(FedAvg(), rc, init)
    except (ConfigError, ValueError):
        return None


def refused_below(aggregator: str, eps: float, rounds: int, dim: int, hi: int = 1 << 22) -> int:
    """The smallest N accepted (acceptance is monotone in N for these estimators: their
    refusals are lower bounds on N)."""
    lo = 1
    if build(aggregator, lo, eps, rounds, dim) is not None:
        return lo
    if build(aggregator, hi, eps, rounds, dim) is None:
        raise RuntimeError(f"{aggregator}: refused even at N = {hi}")
    while hi - lo > 1:  # build(lo) refused, build(hi) accepted
        mid = (lo + hi) // 2
        if build(aggregator, mid, eps, rounds, dim) is None:
            lo = mid
        else:
            hi = mid
    return hi


def gaussian_row(eps: float, rounds: int, dim: int) -> str:
    out = []
    for q in (1.0, 0.1):
        s = build("gaussian", 1000, eps, rounds, dim, rate=q)
        z = s.aggregator.noise_multiplier
        # noise norm z·C·sqrt(d)/(q·N) = C  <=>  N = z·sqrt(d)/q
        out.append((z, math.ceil(z * math.sqrt(dim) / q)))
    (z1, n1), (z2, n2) = out
    return (
        f"| `gaussian` | any | {eps:g} | {rounds} | — | — | z = {z1:.3g} (q = 1), {z2:.3g} (q = 0.1): "
        f"noise norm ≤ C from N = {n1:,} (q = 1), {n2:,} (q = 0.1) |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=210)
    p.add_argument("--eps", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    p.add_argument("--rounds", type=int, nargs="+", default=[10, 100])
    a = p.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    t0 = time.time()
    print(
        f"| estimator | q | ε | T | refused below N | utility n at that N | "
        f"noise on the mean (d = {a.dim}, δ = 1e-5, C = B = 1) |"
    )
    print("|---|---|---|---|---|---|---|")
    for eps in a.eps:
        for rounds in a.rounds:
            print(gaussian_row(eps, rounds, a.dim), flush=True)
    for name in ROWS:
        for eps in a.eps:
            for rounds in a.rounds:
                n = refused_below(name, eps, rounds, a.dim)
                need = build(name, n, eps, rounds, a.dim).aggregator.min_users_required
                at = max(n, need or 0)  # both the privacy proof's and the utility's minimum
                std, _ = release_noise(build(name, at, eps, rounds, a.dim).aggregator, a.dim)
                noise = (
                    "data-dependent"
                    if std is None
                    else f"std {std:.3g} per coordinate (norm {std * math.sqrt(a.dim):.3g})"
                )
                print(
                    f"| `{name}` | 1 | {eps:g} | {rounds} | {'any' if n == 1 else f'{n:,}'} | "
                    f"{'—' if need is None else f'{need:,}'} | at N = {at:,}: {noise} |",
                    flush=True,
                )
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
