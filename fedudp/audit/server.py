"""Audits of the billboard's release (``privacy.placement=server``, the default): the
configured aggregator on ``--dim``-vectors with a worst-case canary unit (``audit``), or on a
given neighbouring pair of owner-side contributions (``audit_pair``, e.g. ``fedudp.leak``).

``audit``: D holds a worst-case canary unit (at the clip norm, or at ``bound`` for an
aggregator that does not clip, along e_1), D' does not (add/remove) or holds it at the opposite
extreme (replace-one); the canary is included by Poisson sampling at the configured rate. A
stateful mechanism in ``SEQUENCE_AUDITED`` goes to ``audit_sequence`` (one release).
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING

import numpy as np

from fedudp.audit.result import (
    ALPHA,
    AuditResult,
    detection_power,
    is_stateful,
    one_release_epsilon,
    parse_break,
    weaken,
)
from fedudp.audit.sequence import SEQUENCE_AUDITED, audit_sequence

if TYPE_CHECKING:
    from fedudp.aggregators.base import Aggregator
    from fedudp.protocol.contributions import Constraint, Contribution

__all__ = ["audit", "audit_pair"]


def audit(
    agg: Aggregator,
    dim: int,
    trials: int,
    delta: float,
    seed: int = 0,
    broken: str = "",
    bound: float = 1.0,
    background: float = 0.1,
) -> AuditResult:
    """Audit ``agg`` (built for ``dim``-vectors) with ``trials`` releases on each of D and D'
    (the module docstring).

    Parameters
    ----------
    agg : Aggregator
        The configured mechanism (``--break noise`` weakens it in place).
    dim : int
        The length of the audited vectors.
    trials : int
        Releases per side.
    delta : float
        The ledger's δ.
    seed : int, default 0
        The audit's seed.
    broken : str, default ""
        ``--break``: ``noise=FACTOR`` or ``clip=off``.
    bound : float, default 1.0
        The canary's norm where the aggregator does not clip (``estimator.bound``).
    background : float, default 0.1
        The other units' spread, as a fraction of the bound.

    Returns
    -------
    AuditResult
        The claim, the lower bound and the audit's power.

    Raises
    ------
    ValueError
        A ``--break`` that does not apply to this mechanism.
    """
    from fedudp.privacy.audit_stats import audit_samples

    if agg.name in SEQUENCE_AUDITED:  # an adaptive clip, a tree, a banded mechanism
        return audit_sequence(agg, dim, trials, 1, delta, seed, broken, bound, background)
    fresh = is_stateful(agg)  # e.g. outlier removal's AboveThreshold: a fresh copy per release
    t0 = time.perf_counter()
    claimed = one_release_epsilon(agg, delta)
    kind, factor = parse_break(broken)
    constraint, bound, canary_norm = _broken_constraint(agg, kind, factor, bound)
    outs = _canary_releases(
        agg, constraint, canary_norm, dim, trials, seed, bound, background, fresh
    )
    # an unsampled clip + Gaussian release is Gaussian with the same covariance on both sides
    gaussian = agg.name == "gaussian" and agg.sampling.rate >= 1.0
    samples = audit_samples(outs["D"], outs["D'"], delta, ALPHA, gaussian=gaussian)
    power = (
        detection_power(samples, claimed, delta, trials, factor or 1.0, gaussian)
        if kind != "clip=off"
        else None
    )
    return AuditResult(
        agg.name,
        agg.adjacency,
        trials,
        delta,
        claimed,
        samples,
        canary_norm,
        broken,
        time.perf_counter() - t0,
        power,
        gaussian,
        claim_heuristic=getattr(agg, "guarantee", "certified") == "heuristic",
    )


def _broken_constraint(
    agg: Aggregator, kind: str, factor: float | None, bound: float
) -> tuple[Constraint, float, float]:
    """``--break`` applied: the noise weakened in place (``noise=FACTOR``) or the owners'
    clip removed (``clip=off``, the canary at 10 times the clip); (the owners' constraint, the
    bound, the canary's norm)."""
    from fedudp.protocol.contributions import Constraint

    constraint: Constraint = agg.constraint
    if kind == "schedule=data":
        raise ValueError("--break schedule=data applies to privacy.placement=local_dpsgd")
    if kind == "noise":
        assert factor is not None  # noise=FACTOR
        weaken(agg, factor)
    bound = constraint.clip if constraint.clip is not None else float(bound)
    canary_norm = bound
    if kind == "clip=off":
        if constraint.clip is None:
            raise ValueError("--break clip=off needs a clipping aggregator")
        constraint, canary_norm = Constraint(rows=constraint.rows, clip=None), 10.0 * bound
    return constraint, bound, canary_norm


def _canary_releases(
    agg: Aggregator,
    constraint: Constraint,
    canary_norm: float,
    dim: int,
    trials: int,
    seed: int,
    bound: float,
    background: float,
    fresh: bool,
) -> dict[str, np.ndarray]:
    """``trials`` seeded releases of ``agg`` on D (the canary at ``canary_norm`` along e_1,
    Poisson-sampled at the rate) and on D' (absent, or at the opposite extreme for a
    replace-one estimator), over a concentrated public background cohort: side -> [trials,
    dim]. ``fresh``: a fresh copy of ``agg`` per release."""
    import torch

    from fedudp.protocol.contributions import Contribution

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
        vals = np.empty((trials, dim))
        for t in range(trials):
            parts = [base]
            if rng.random() < q:
                if side == "D":
                    parts.append(with_canary)
                elif replace_one:
                    parts.append(opposite)
            c = Contribution.merge(parts, dim, torch.float64, constraint.rows)
            gen = torch.Generator().manual_seed(int(rng.integers(0, 2**62)))
            one = copy.deepcopy(agg) if fresh else agg
            vals[t] = one.release(c, rng=gen).mean.to(torch.float64).numpy()
        outs[side] = vals
    return outs


def audit_pair(
    agg: Aggregator,
    on_d: Contribution,
    on_dprime: Contribution,
    trials: int,
    delta: float,
    seed: int = 0,
) -> AuditResult:
    """Audit the billboard's release on a given neighbouring pair of owner-side contributions
    (e.g. ``fedudp.leak``): ``trials`` seeded releases of each.

    Parameters
    ----------
    agg : Aggregator
        The configured mechanism.
    on_d, on_dprime : Contribution
        The owners' summed contributions on D and on D'.
    trials : int
        Releases per side.
    delta : float
        The ledger's δ.
    seed : int, default 0
        The audit's seed.

    Returns
    -------
    AuditResult
        The claim and the lower bound (``canary_norm``: the norm of the pair's difference).
    """
    import torch

    from fedudp.privacy.audit_stats import audit_samples

    t0 = time.perf_counter()
    claimed = one_release_epsilon(agg, delta)
    assert on_d.total is not None and on_dprime.total is not None  # clipped sums
    diff = on_d.total.to(torch.float64) - on_dprime.total.to(torch.float64)
    rng = np.random.default_rng([seed, 2])
    outs = {}
    for side, c in (("D", on_d), ("D'", on_dprime)):
        vals = np.empty((trials, int(diff.numel())))
        for t in range(trials):
            gen = torch.Generator().manual_seed(int(rng.integers(0, 2**62)))
            vals[t] = agg.release(c, rng=gen).mean.to(torch.float64).numpy()
        outs[side] = vals
    gaussian = agg.name == "gaussian" and agg.sampling.rate >= 1.0
    samples = audit_samples(outs["D"], outs["D'"], delta, ALPHA, gaussian=gaussian)
    norm = float(torch.linalg.vector_norm(diff))
    return AuditResult(
        agg.name,
        agg.adjacency,
        trials,
        delta,
        claimed,
        samples,
        norm,
        "",
        time.perf_counter() - t0,
        None,
        gaussian,
    )
