"""An empirical privacy audit of one configured release: ``fedudp-audit [overrides]`` (issue 10).

The configured aggregator (built and calibrated exactly as a run builds it, on ``--dim``-vectors)
releases many times on two neighbouring cohorts: D holds a worst-case *canary* unit (at the clip
norm, or at the bound for the replace-one estimators, along e_1), D' does not (add/remove) or
holds it at the opposite extreme (replace-one). Every release is the aggregator's own owner side
(``constraint``) and billboard side (``release``) with a fresh seeded generator, Poisson
inclusion of the canary at the configured rate. A threshold attack on the released coordinate
along e_1 gives, with Clopper–Pearson bounds (95%, Bonferroni over thresholds and sides), a
lower bound on ε at the ledger's δ, printed beside the ε the accountant claims for one release.
A lower bound above the claim is a violation: the mechanism releases less noise (or more
influence) than it is accounted for. ``--break noise=0.3`` and ``--break clip=off`` break the
mechanism on purpose, to show that the audit catches it.

Power: the bound is only as tight as the canary's real influence; for the robust estimators the
certified sensitivity (a worst case over all datasets) far exceeds one unit's influence on a
typical cohort, so their audit bound stays well below the claim and says little (it is said).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from fedudp.aggregators.base import Aggregator, Constraint, Contribution
from fedudp.privacy.accountant import Accountant, ParallelAccountant, Parallel, pld_interval


def epsilon_lower_bound(on_d: np.ndarray, on_dprime: np.ndarray, delta: float,
                        alpha: float = 0.05, thresholds: int = 60) -> float:
    """Largest ε consistent (w.p. 1-α) with some rejection region {x > t} or {x < t}: for each
    threshold and side, a Clopper–Pearson lower bound on P[M(D) ∈ S] and an upper bound on
    P[M(D') ∈ S], ε >= log((p1 - δ) / p2) (Bonferroni over thresholds and sides)."""
    from scipy.stats import beta
    qs = np.quantile(np.concatenate([on_d, on_dprime]), np.linspace(0.01, 0.99, thresholds))
    a = alpha / (4 * thresholds)
    best = 0.0
    for x, y in ((on_d, on_dprime), (on_dprime, on_d)):
        for sign in (1.0, -1.0):
            for t in qs:
                k1, n1 = int((sign * x > sign * t).sum()), len(x)
                k2, n2 = int((sign * y > sign * t).sum()), len(y)
                p1 = beta.ppf(a, k1, n1 - k1 + 1) if k1 > 0 else 0.0
                p2 = beta.ppf(1 - a, k2 + 1, n2 - k2) if k2 < n2 else 1.0
                if p1 - delta > 0 and p2 > 0:
                    best = max(best, math.log((p1 - delta) / p2))
    return best


@dataclass
class AuditResult:
    mechanism: str
    adjacency: str
    trials: int
    delta: float
    claimed_epsilon: float
    lower_bound: float
    canary_norm: float
    broken: str
    seconds: float

    @property
    def violation(self) -> bool:
        return self.lower_bound > self.claimed_epsilon * (1 + 1e-9)

    @property
    def low_power(self) -> bool:
        return not self.violation and self.lower_bound < 0.5 * self.claimed_epsilon


def one_release_epsilon(agg: Aggregator, delta: float) -> float:
    """The accountant's ε of one release of ``agg`` (its one-off block included)."""
    event = agg.dp_event()
    acc = (ParallelAccountant(len(event.parts), pld_interval(1.0)) if isinstance(event, Parallel)
           else Accountant(pld_interval(1.0)))
    once = agg.one_off_event()
    if once is not None:
        acc.compose(once)
    acc.compose(event)
    return acc.epsilon(delta)


NOISE_BREAKABLE = ("gaussian", "outlier_removal", "friendlycore")   # noise = multiplier × sensitivity


def audit(agg: Aggregator, dim: int, trials: int, delta: float, seed: int = 0,
          broken: str = "", bound: float = 1.0, background: float = 0.1) -> AuditResult:
    """Audit ``agg`` (built for ``dim``-vectors) with ``trials`` releases on each of D and D'.
    ``bound``: the canary's norm where the aggregator does not clip (``estimator.bound``)."""
    t0 = time.perf_counter()
    claimed = one_release_epsilon(agg, delta)
    constraint: Constraint = agg.constraint
    if broken.startswith("noise="):
        if agg.name not in NOISE_BREAKABLE:
            raise SystemExit(f"fedudp-audit: --break noise is available for {NOISE_BREAKABLE}")
        agg.noise_multiplier = agg.noise_multiplier * float(broken.split("=", 1)[1])
    bound = constraint.clip if constraint.clip is not None else float(bound)
    canary_norm = bound
    if broken == "clip=off":
        if constraint.clip is None:
            raise SystemExit("fedudp-audit: --break clip=off needs a clipping aggregator")
        constraint, canary_norm = Constraint(rows=constraint.rows, clip=None), 10.0 * bound
    n, q = agg.sampling.population, agg.sampling.rate
    replace_one = agg.adjacency == "replace_one"
    g = torch.Generator().manual_seed(seed)
    # the other units: a concentrated cohort around a common point (public, fixed)
    others = background * bound * (torch.rand(n - 1, dim, generator=g, dtype=torch.float64) - 0.5)
    canary = torch.zeros(dim, dtype=torch.float64)
    canary[0] = canary_norm
    rng = np.random.default_rng([seed, 1])
    # the owner side applied once per part; a trial merges the parts as the billboard does
    base, with_canary = constraint.apply(others), constraint.apply(canary[None])
    opposite = constraint.apply(-canary[None])
    outs = {}
    for side in ("D", "D'"):
        vals = np.empty(trials)
        for t in range(trials):
            parts = [base]
            if rng.random() < q:
                if side == "D":
                    parts.append(with_canary)
                elif replace_one:
                    parts.append(opposite)
            c = Contribution.merge(parts, dim, torch.float64, constraint.rows)
            gen = torch.Generator().manual_seed(int(rng.integers(0, 2 ** 62)))
            vals[t] = float(agg.release(c, rng=gen).mean[0])
        outs[side] = vals
    lb = epsilon_lower_bound(outs["D"], outs["D'"], delta)
    return AuditResult(agg.name, agg.adjacency, trials, delta, claimed, lb, canary_norm, broken,
                       time.perf_counter() - t0)


def audit_pair(agg: Aggregator, on_d: Contribution, on_dprime: Contribution, trials: int,
               delta: float, seed: int = 0) -> AuditResult:
    """Audit the billboard's release on a given neighbouring pair of owner-side contributions
    (e.g. ``fedudp.privacy.leak``): ``trials`` seeded releases of each, the threshold attack on
    the output projected on the direction the pair differs in."""
    t0 = time.perf_counter()
    claimed = one_release_epsilon(agg, delta)
    diff = on_d.total.to(torch.float64) - on_dprime.total.to(torch.float64)
    direction = diff / torch.linalg.vector_norm(diff).clamp(min=1e-300)
    rng = np.random.default_rng([seed, 2])
    outs = {}
    for side, c in (("D", on_d), ("D'", on_dprime)):
        vals = np.empty(trials)
        for t in range(trials):
            gen = torch.Generator().manual_seed(int(rng.integers(0, 2 ** 62)))
            vals[t] = float(agg.release(c, rng=gen).mean.to(torch.float64) @ direction)
        outs[side] = vals
    lb = epsilon_lower_bound(outs["D"], outs["D'"], delta)
    norm = float(torch.linalg.vector_norm(diff))
    return AuditResult(agg.name, agg.adjacency, trials, delta, claimed, lb, norm, "", time.perf_counter() - t0)


def _print_result(r: AuditResult, pair: str = "") -> None:
    verdict = ("VIOLATION: the release is less private than its ledger claims" if r.violation
               else "consistent with the ledger")
    what = f"{r.mechanism} ({pair})" if pair else r.mechanism
    print(f"| mechanism | adjacency | trials per side | δ | ε claimed (one release) "
          f"| ε lower bound (95%) | broken | verdict | seconds |\n|---|---|---:|---:|---:|---:|---|---|---:|\n"
          f"| {what} | {r.adjacency} | {r.trials} | {r.delta:g} | {r.claimed_epsilon:.3f} "
          f"| {r.lower_bound:.3f} | {r.broken or '-'} | {verdict} | {r.seconds:.1f} |")


def _main_pair(a, over: dict) -> int:
    """``--pair paper_leak``: the paper-mode leak pair (``fedudp.privacy.leak``)."""
    from fedudp.config import ConfigError
    from fedudp.privacy.leak import clipped_sums, leak_config
    try:
        pair = clipped_sums(leak_config(**over))
    except (ConfigError, ValueError) as e:
        print(f"fedudp-audit: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    cfg = pair.prepared.cfg
    print(f"pair: {a.pair} (privacy.accounting={cfg.privacy.accounting}): adding the canary user "
          f"moves the clipped sum by {pair.moved:.2f} C (the accountant assumes at most 1 C)")
    r = audit_pair(pair.prepared.aggregator, pair.with_user, pair.without_user, a.trials,
                   cfg.privacy.delta, a.seed)
    _print_result(r, f"{a.pair}, {cfg.privacy.accounting}")
    return 1 if r.violation else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fedudp-audit", description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="fedudp config overrides (key=value, as for fedudp)")
    ap.add_argument("--trials", type=int, default=100_000, help="releases on each neighbour")
    ap.add_argument("--dim", type=int, default=8, help="length of the audited vectors")
    ap.add_argument("--rounds", type=int, default=None,
                    help="releases the noise is calibrated for (default: train.rounds)")
    ap.add_argument("--break", dest="broken", default="", choices=["", "noise=0.3", "clip=off"],
                    help="break the mechanism on purpose (the audit must catch it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pair", default="", choices=["", "paper_leak"],
                    help="audit a built-in neighbouring pair through the configured release "
                         "instead of a canary: paper_leak = issue 10's joint-DP pair "
                         "(overrides such as privacy.accounting=certified|paper apply to it)")
    a = ap.parse_args(argv)
    if a.pair:
        if a.broken:
            print("fedudp-audit: error: --break applies to the canary audit, not to --pair",
                  file=sys.stderr)
            return 2
        return _main_pair(a, dict(o.split("=", 1) for o in a.overrides))
    from fedudp.aggregators import Sampling, build_aggregator
    from fedudp.config import ConfigError, config_from_overrides, validate
    from fedudp.core.methods import method_spec
    from fedudp.data.federation import planned_shape, planned_units
    from fedudp.models import build_model
    try:
        over = dict(o.split("=", 1) for o in a.overrides)
        cfg = config_from_overrides({"method": "full_dp", **over})
        validate(cfg)
        spec = method_spec(cfg, build_model(cfg, *planned_shape(cfg)))
        if not spec.private:
            raise ConfigError("method: the audit needs a private method (full_dp or joint_dp)")
        n_owners, n_users = planned_units(cfg)
        population = n_owners if spec.cohort_is_owners else n_users
        agg = build_aggregator(cfg, Sampling(cfg.train.sampling_rate, population),
                               a.rounds or cfg.train.rounds, a.dim)
    except (ConfigError, ValueError) as e:
        print(f"fedudp-audit: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if agg.name == "local_dpsgd":
        print("fedudp-audit: error: privacy.placement=local_dpsgd releases inside the owners; "
              "audit privacy.placement=server", file=sys.stderr)
        return 2
    r = audit(agg, a.dim, a.trials, cfg.privacy.delta, a.seed, a.broken, cfg.estimator.bound)
    _print_result(r)
    if r.low_power:
        print("note: the lower bound is far below the claim: this audit has little power here "
              "(one unit's real influence on this cohort is much smaller than the certified "
              "sensitivity, or too few trials); it cannot confirm the constant, only catch a "
              "gross violation", file=sys.stderr)
    return 1 if r.violation else 0


if __name__ == "__main__":
    raise SystemExit(main())
