"""An empirical privacy audit of one configured release: ``fedudp-audit [overrides]``.

The configured mechanism releases many times on two neighbouring datasets D and D', and
``fedudp.privacy.audit_stats`` turns the two samples into a lower bound on ε at the ledger's δ
(probability ≥ 99% jointly over the bounds tried), printed beside the ε the accountant claims for
one release. A lower bound above the claim is a violation: the mechanism releases less noise, or
lets one unit move it further, than it is accounted for.

What is audited:

* the billboard's release (``privacy.placement=server``, the default): the configured aggregator,
  built and calibrated exactly as a run builds it, on ``--dim``-vectors; D holds a worst-case
  *canary* unit (at the clip norm, or at the bound for the replace-one estimators, along e_1), D'
  does not (add/remove) or holds it at the opposite extreme (replace-one). Every release is the
  aggregator's own owner side (``constraint``) and billboard side (``release``) with a fresh seeded
  generator, the canary included by Poisson sampling at the configured rate;
* owner-side DP-SGD (``privacy.placement=local_dpsgd``): the real owner path
  (``Owners.owner_deltas``) on owner 0 of a configured federation whose owners hold ``M`` users
  each (their public capacity), D with all ``M``, D' without its first user (the canary: features
  scaled up and the label that maximizes its gradient, so its gradient is clipped); one round.
  ``--owner-users`` picks the M's (``m:M``: an owner holding m users below its public capacity
  M, D' m - 1, the schedule following M on both sides); ``--natural K``: natural users of
  1..K records each instead, built in memory from plain arrays with every public number declared
  (``natural_records``), the owner's capacity, q and steps the prepared run's own; the default pairs are one owner below the batch B and one
  crossing a multiple of B (``B//3`` and ``B+1``: 10 → 9 and 33 → 32 at B = 32);
* ``--pair paper_leak``: the joint-DP paper-mode leak pair (``fedudp.leak``).

Stateful and sequential mechanisms (``audit_sequence``): every trial starts from a fresh copy of
the configured aggregator (never one reused across trials: an adaptive clip carried from trial
to trial drifts, 1.0 to 4e-261 over 50,000 releases, and the audit then measured that drift,
not the mechanism). ``--sequence T`` makes one trial T releases of that fresh copy, on D (the
canary present in every round it takes part in: a tree's unit in the first round of every tree,
the leaf in the most nodes; a banded mechanism's in the first round of every cycle, sampled at
the group rate; Poisson at the rate otherwise) or D' (absent); the statistic sees the whole
released sequence (T × dim numbers, plus an adaptive clip's noisy unclipped count per round),
scored on the linear discriminant, the likelihood-ratio direction of correlated Gaussian noise
(the tree's prefix-sum noise, the banded C̃⁻¹ζ). The claim is the ledger's ε for the same T
releases. ``dp_ftrl_tree`` and ``dp_mf_banded`` default to T = the run's rounds (at most 64);
``gaussian_adaptive`` to T = 1, each release centred by the background's clipped sum and
count at the public current clip and scaled by its noise (exactly Gaussian residuals at
sampling rate 1). Owner-side DP-SGD with ``privacy.clip_policy=adaptive`` audits the owner's
release as it is sent: its noisy delta and its mean noisy unclipped fraction.

Tests: the distribution-free threshold test with its region chosen on a held-out half, on the
projection along the mean shift and on the squared distance from D''s mean; and, where the release
is Gaussian by construction (an unsampled Gaussian release, or one DP-SGD step with every user
in it), a Gaussian-DP fit of the projection, near-optimal there. The audit prints its power: the
noise cut it would detect at the given number of releases.

``--break`` weakens the mechanism on purpose, to show that the audit catches it:
``noise=FACTOR`` (any factor; the noise is multiplied by it; an adaptive clip's update and count
noises both), ``clip=off`` (server-side release:
the owners send unclipped vectors and the canary is 10 times the clip norm) and
``schedule=data`` (owner-side DP-SGD: the sampling rate, step count and divisor taken from the
users each neighbour actually holds: a schedule read from the data).

Power: for the robust estimators the certified sensitivity (a worst case over all datasets) far
exceeds one unit's influence on a typical cohort, so their audit bound stays well below the claim
and says little (it is said).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from fedudp.errors import ConfigError
from fedudp.memory import check_arrays

# torch, the estimators and the accountant (dp_accounting, scipy) are imported where they are used:
# `fedudp-audit --help` and a bad argument answer without them
if TYPE_CHECKING:
    from collections.abc import Callable

    from fedudp.aggregators.base import Aggregator
    from fedudp.build import Prepared
    from fedudp.data.federation import Federation
    from fedudp.data.records import Records
    from fedudp.privacy.audit_stats import SampleAudit
    from fedudp.protocol.contributions import Contribution

# the audit's level: every lower bound it prints holds with probability >= 99%, jointly over the
# bounds tried, so a correct mechanism is flagged in at most 1% of audits (a false alarm)
ALPHA = 0.01


@dataclass
class AuditResult:
    mechanism: str
    adjacency: str
    trials: int
    delta: float
    claimed_epsilon: float
    samples: SampleAudit
    canary_norm: float
    broken: str
    seconds: float
    power: dict[str, float] | None = None
    gaussian_by_construction: bool = False
    claim_heuristic: bool = False  # the claimed ε is the paper's heuristic accounting's

    @property
    def lower_bound(self) -> float:
        return self.samples.lower_bound

    @property
    def violation(self) -> bool:
        return self.lower_bound > self.claimed_epsilon * (1 + 1e-9)

    @property
    def low_power(self) -> bool:
        return not self.violation and self.lower_bound < 0.5 * self.claimed_epsilon


def one_release_epsilon(agg: Aggregator, delta: float) -> float:
    """The accountant's ε of one release of ``agg`` (its one-off block included)."""
    from fedudp.privacy.accountant import Accountant, Parallel, ParallelAccountant, pld_interval

    event = agg.dp_event()
    acc = (
        ParallelAccountant(len(event.parts), pld_interval(1.0))
        if isinstance(event, Parallel)
        else Accountant(pld_interval(1.0))
    )
    once = agg.one_off_event()
    if once is not None:
        acc.compose(once)
    acc.compose(event)
    return acc.epsilon(delta)


def releases_epsilon(agg: Aggregator, delta: float, releases: int) -> float:
    """The accountant's ε of the first ``releases`` releases of a fresh ``agg`` (its one-off
    block once, then round r's event for r = 1..releases: a tree's or a banded mechanism's whole
    event at the first round of each tree or cycle, as a run's ledger composes them)."""
    from fedudp.privacy.accountant import Accountant, pld_interval

    if releases == 1 and not hasattr(agg, "round_event"):
        return one_release_epsilon(agg, delta)
    acc = Accountant(pld_interval(1.0))
    once = agg.one_off_event()
    if once is not None:
        acc.compose(once)
    for r in range(1, int(releases) + 1):
        acc.compose(agg.round_event(r) if hasattr(agg, "round_event") else agg.dp_event())
    return acc.epsilon(delta)


def _stateful(agg: Aggregator) -> bool:
    """The aggregator carries state from one release to the next (an adaptive clip, a tree's or
    a banded mechanism's noise history): each audit trial must start from a fresh copy."""
    return bool(agg.checkpoint_state()) or hasattr(agg, "round_event")


def parse_break(broken: str) -> tuple[str, float | None]:
    """``""``, ``noise=FACTOR`` (FACTOR > 0), ``clip=off`` or ``schedule=data`` -> (kind, factor)."""
    if not broken:
        return "", None
    if broken.startswith("noise="):
        try:
            f = float(broken.split("=", 1)[1])
        except ValueError:
            f = -1.0
        if not f > 0:
            raise ValueError(
                f"--break {broken}: the noise factor must be a number > 0, e.g. noise=0.7"
            )
        return "noise", f
    if broken in ("clip=off", "schedule=data"):
        return broken, None
    raise ValueError(f"--break {broken}: use noise=FACTOR, clip=off or schedule=data")


NOISE_BREAKABLE = (
    "gaussian",
    "outlier_removal",
    "friendlycore",  # noise = multiplier × sensitivity
    "gaussian_adaptive",
    "dp_ftrl_tree",
    "dp_mf_banded",
)


def weaken(agg: Aggregator, factor: float) -> None:
    """``--break noise=FACTOR``: every noise of ``agg`` times ``factor``, in place (an adaptive
    clip's update and count noises both, so its effective multiplier is ``factor`` × z)."""
    if agg.name not in NOISE_BREAKABLE:
        raise ValueError(f"--break noise applies to {', '.join(NOISE_BREAKABLE)}")
    mech: Any = agg  # one of NOISE_BREAKABLE: its noise attributes, by name
    mech.noise_multiplier = mech.noise_multiplier * factor
    if agg.name == "gaussian_adaptive":
        mech.update_multiplier *= factor
        mech.count_noise *= factor


def _power(
    samples: SampleAudit, claimed: float, delta: float, trials: int, factor: float, gaussian: bool
) -> dict[str, float]:
    """Noise factors f detected with probability about 1/2 (the noise cut to f× the configured
    noise). A Gaussian release's separation is the one its claim implies (μ of μ-GDP at the
    claimed (ε, δ)); otherwise the projection's measured separation, rescaled to the configured
    noise, stands in for it (a planning number)."""
    from fedudp.privacy.audit_stats import gaussian_mu_for_epsilon, power_gaussian, power_threshold

    mu = (
        gaussian_mu_for_epsilon(claimed, delta)
        if gaussian
        else samples.separation.mu_hat * (factor if factor else 1.0)
    )
    tests = samples.tests
    out = {"threshold": power_threshold(claimed, delta, mu, trials, ALPHA, tests)}
    if gaussian:
        out["gaussian"] = power_gaussian(claimed, delta, mu, trials, ALPHA, tests)
    return out


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
    """Audit ``agg`` (built for ``dim``-vectors) with ``trials`` releases on each of D and D'.
    ``bound``: the canary's norm where the aggregator does not clip (``estimator.bound``)."""
    import torch

    from fedudp.privacy.audit_stats import audit_samples
    from fedudp.protocol.contributions import Constraint, Contribution

    if agg.name in SEQUENCE_AUDITED:  # an adaptive clip, a tree, a banded mechanism
        return audit_sequence(agg, dim, trials, 1, delta, seed, broken, bound, background)
    fresh = _stateful(agg)  # e.g. outlier removal's AboveThreshold: a fresh copy per release
    t0 = time.perf_counter()
    claimed = one_release_epsilon(agg, delta)
    constraint: Constraint = agg.constraint
    kind, factor = parse_break(broken)
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
    # an unsampled clip + Gaussian release is Gaussian with the same covariance on both sides
    gaussian = agg.name == "gaussian" and q >= 1.0
    samples = audit_samples(outs["D"], outs["D'"], delta, ALPHA, gaussian=gaussian)
    power = (
        _power(samples, claimed, delta, trials, factor or 1.0, gaussian)
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


def canary_rounds(agg: Aggregator, releases: int, rng: np.random.Generator) -> np.ndarray:
    """[releases] bool: the rounds of one trial the canary unit takes part in, by the
    mechanism's own participation rule, the canary in the worst-case public group: a tree's
    unit in group 0 trains in the first round of every tree (its leaf lies in the most noisy
    nodes); a banded mechanism's in the first round of every cycle of b rounds, sampled there at
    the group rate; any other aggregator's Poisson-sampled at its rate in every round."""
    r = np.arange(releases)
    mech: Any = agg  # a tree's or a banded mechanism's own attributes, by name
    if agg.name == "dp_ftrl_tree":
        return r % mech.k == 0
    if agg.name == "dp_mf_banded":
        return (r % mech.bands == 0) & (rng.random(releases) < mech.group_rate)
    return rng.random(releases) < agg.sampling.rate


# mechanisms whose release is (clipped sum + noise) / (public divisor), with noise independent
# across coordinates and a state (the noise history) kept per coordinate
LINEAR_NOISE = ("dp_ftrl_tree", "dp_mf_banded")
# audited by ``audit_sequence`` (one release or several per trial)
SEQUENCE_AUDITED = LINEAR_NOISE + ("gaussian_adaptive",)


def _linear_sequences(
    template: Aggregator,
    with_canary: bool,
    base: Contribution,
    canary_norm: float,
    unclipped: bool,
    dim: int,
    trials: int,
    releases: int,
    rng: np.random.Generator,
    chunk: int = 4096,
) -> np.ndarray:
    """[trials, releases·dim]: ``trials`` independent runs of a tree or banded mechanism, run
    side by side as the coordinate blocks of one fresh copy's release of a ``chunk·dim`` vector.
    Their noise is drawn independently per coordinate and their state (the tree's nodes, the
    banded history) is kept per coordinate, so block b of the vector is exactly one run of the
    mechanism on ``dim``-vectors with a state of its own (the tests check it against separate
    copies); the canary enters block b in the rounds ``canary_rounds`` draws for trial b."""
    import torch

    from fedudp.protocol.contributions import Contribution

    out = np.empty((trials, releases * dim))
    for a0 in range(0, trials, chunk):
        k = min(chunk, trials - a0)
        a: Any = copy.deepcopy(template)  # a tree or banded mechanism: its attributes by name
        present = np.stack([canary_rounds(a, releases, rng) for _ in range(k)])  # [k, T]
        clip = a.clip
        for r in range(releases):
            assert base.total is not None  # the background as a clipped sum
            total = base.total.to(torch.float64).repeat(k).reshape(k, dim).clone()
            count = np.full(k, base.count)
            if with_canary:
                amount = canary_norm if unclipped else min(canary_norm, clip)
                total[torch.from_numpy(present[:, r]), 0] += amount
                count = count + present[:, r]
            c = Contribution(None, total.reshape(-1), int(count.sum()), 0)
            gen = torch.Generator().manual_seed(int(rng.integers(0, 2**62)))
            out[a0 : a0 + k, r * dim : (r + 1) * dim] = (
                a.release(c, rng=gen).mean.to(torch.float64).reshape(k, dim).numpy()
            )
    return out


def audit_sequence(
    agg: Aggregator,
    dim: int,
    trials: int,
    releases: int,
    delta: float,
    seed: int = 0,
    broken: str = "",
    bound: float = 1.0,
    background: float = 0.1,
) -> AuditResult:
    """Audit the whole sequence of ``releases`` releases of a stateful mechanism: one trial is a
    fresh copy of ``agg`` (never used: ``copy.deepcopy`` of the template, so an adaptive clip, a
    tree's nodes and a banded mechanism's noise history start as a run starts) releasing
    ``releases`` times on D (a canary unit present in every round it takes part in,
    ``canary_rounds``) or on D' (the canary absent); ``trials`` trials per side. The statistic
    sees the whole released sequence, flattened (releases × dim, plus an adaptive clip's noisy
    unclipped count per round): the linear discriminant (covariance-whitened mean shift) is the
    likelihood-ratio direction of correlated Gaussian noise (the tree's prefix-sum noise, the
    banded mechanism's C̃⁻¹ζ). The claim is the ledger's ε for the same ``releases`` releases
    (``releases_epsilon``).

    Adaptive clipping: the clip C_t is public (computed from earlier releases), so each round's
    release is centred by the background's clipped sum and unclipped count at C_t and scaled by
    its noise (z_Δ C_t for the sum, σ_b for the count): with every unit in every round
    (sampling rate 1) the residuals are exactly Gaussian with a fixed shift whatever the clip
    does, the canary being held at twice the current clip (always clipped to C_t, never counted
    as unclipped)."""
    import torch

    from fedudp.privacy.audit_stats import audit_samples
    from fedudp.protocol.contributions import Constraint, Contribution

    t0 = time.perf_counter()
    template = agg
    releases = int(releases)
    if releases < 1:
        raise ValueError(f"--sequence {releases}: at least one release per trial")
    claimed = releases_epsilon(template, delta, releases)
    kind, factor = parse_break(broken)
    if kind == "schedule=data":
        raise ValueError("--break schedule=data applies to privacy.placement=local_dpsgd")
    template = copy.deepcopy(template)
    if kind == "noise":
        assert factor is not None  # noise=FACTOR
        weaken(template, factor)
    constraint: Constraint = template.constraint
    if constraint.clip is None:
        raise ValueError(
            f"aggregator={template.name}: the sequence audit needs a clipping aggregator"
        )
    if kind == "clip=off" and template.name == "gaussian_adaptive":
        raise ValueError("--break clip=off: use noise=FACTOR for adaptive clipping")
    adaptive = template.name == "gaussian_adaptive"
    bound = constraint.clip
    canary_norm = 10.0 * bound if kind == "clip=off" else bound
    n, q = template.sampling.population, template.sampling.rate
    qn = template.sampling.expected_cohort
    g = torch.Generator().manual_seed(seed)
    others = background * bound * (torch.rand(n - 1, dim, generator=g, dtype=torch.float64) - 0.5)
    rng = np.random.default_rng([seed, 3])
    width = dim + (1 if adaptive else 0)
    fixed_base = constraint.apply(others)
    # the background's clipped sum at a clip C_t: unchanged while every background vector fits
    largest = float(torch.linalg.vector_norm(others, dim=1).max()) if len(others) else 0.0
    unclipped_base = Constraint(rows=False, clip=None).apply(others)
    outs = {}
    if template.name in LINEAR_NOISE:
        for side in ("D", "D'"):
            outs[side] = _linear_sequences(
                template,
                side == "D",
                fixed_base,
                canary_norm,
                kind == "clip=off",
                dim,
                trials,
                releases,
                rng,
            )
    for side in () if outs else ("D", "D'"):
        vals = np.empty((trials, releases * width))
        for t in range(trials):
            # a fresh mechanism state per trial (its own attributes read by name)
            a: Any = copy.deepcopy(template)
            present = canary_rounds(a, releases, rng)
            for r in range(releases):
                clip_t = a.clip
                if adaptive:  # owners clip to the current C_t
                    cons = Constraint(rows=False, clip=clip_t)
                    base = unclipped_base if largest <= clip_t else cons.apply(others)
                    canary = torch.zeros(1, dim, dtype=torch.float64)
                    canary[0, 0] = 2.0 * clip_t
                    with_canary = cons.apply(canary)
                else:
                    cons, base = constraint, fixed_base
                    canary = torch.zeros(1, dim, dtype=torch.float64)
                    canary[0, 0] = canary_norm
                    with_canary = (
                        Constraint(rows=False, clip=None) if kind == "clip=off" else cons
                    ).apply(canary)
                parts = [base] + ([with_canary] if side == "D" and present[r] else [])
                c = Contribution.merge(parts, dim, torch.float64, False)
                gen = torch.Generator().manual_seed(int(rng.integers(0, 2**62)))
                out = a.release(c, rng=gen)
                mean = out.mean.to(torch.float64).numpy()
                row = vals[t, r * width : (r + 1) * width]
                if adaptive:
                    # centred by the background at C_t, scaled by the round's public noise
                    assert base.total is not None  # the background as a clipped sum
                    row[:dim] = (mean * qn - base.total.numpy()) / (a.update_multiplier * clip_t)
                    centred = (base.count - base.clipped) - 0.5 * base.count
                    frac = out.diagnostics["unclipped_fraction_noisy"]
                    row[dim] = ((frac - 0.5) * qn - centred) / a.count_noise
                else:
                    row[:] = mean
        outs[side] = vals
    # Gaussian by construction: no sampling anywhere in the sequence (a tree; a banded
    # mechanism taking its whole group; Poisson at rate 1)
    gaussian = (
        template.name == "dp_ftrl_tree"
        or (template.name == "dp_mf_banded" and cast(Any, template).group_rate >= 1.0)
        or (template.name in ("gaussian", "gaussian_adaptive") and q >= 1.0)
    )
    samples = audit_samples(
        outs["D"], outs["D'"], delta, ALPHA, gaussian=gaussian, discriminant=True
    )
    power = (
        _power(samples, claimed, delta, trials, factor or 1.0, gaussian)
        if kind != "clip=off"
        else None
    )
    name = template.name if releases == 1 else f"{template.name}, {releases} releases"
    return AuditResult(
        name,
        template.adjacency,
        trials,
        delta,
        claimed,
        samples,
        canary_norm,
        broken,
        time.perf_counter() - t0,
        power,
        gaussian,
        claim_heuristic=getattr(template, "guarantee", "certified") == "heuristic",
    )


def audit_pair(
    agg: Aggregator,
    on_d: Contribution,
    on_dprime: Contribution,
    trials: int,
    delta: float,
    seed: int = 0,
) -> AuditResult:
    """Audit the billboard's release on a given neighbouring pair of owner-side contributions
    (e.g. ``fedudp.leak``): ``trials`` seeded releases of each."""
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


# -- owner-side DP-SGD --------------------------------------------------------------------------
AUDIT_DPSGD = {
    "method": "full_dp",
    "privacy.placement": "local_dpsgd",
    "train.rounds": 1,
    "progress": False,
    "dataset.name": "synthetic",
    "dataset.features": 6,
    "dataset.classes": 3,
    "partition.scheme": "iid",
    "partition.num_owners": 4,
    "partition.records_per_user": 1,
    "engine_opts.float64": True,
}


def _replicate(f: Federation, k: int, first_id: int) -> Federation:
    """``k`` copies of the one-owner federation ``f`` as one federation, owner ids
    ``first_id, first_id + 2, ...`` (every copy draws its own DP-SGD randomness)."""
    from fedudp.data.federation import Federation

    users, recs = f.num_users, f.num_records
    offs = (f.user_offsets[:-1][None, :] + recs * np.arange(k)[:, None]).ravel()
    return Federation(
        x=f.x.repeat(k, *[1] * (f.x.dim() - 1)),
        y=f.y.repeat(k),
        user_offsets=np.append(offs, k * recs).astype(np.int64),
        user_owner=np.repeat(np.arange(k), users).astype(np.int64),
        owner_user_offsets=(users * np.arange(k + 1)).astype(np.int64),
        x_test=f.x_test[:0],
        y_test=f.y_test[:0],
        test_offsets=np.zeros(k + 1, np.int64),
        num_classes=f.num_classes,
        owner_classes=None,
        owner_ids=(first_id + 2 * np.arange(k)).astype(np.int64),
        user_ids=np.tile(f.user_ids, k),
    )


def _make_canary(p: Prepared, shard: Federation) -> float:
    """Turn the shard's first user into a worst-case canary, in place: the label that maximizes
    its mean gradient's norm at the broadcast parameters, and its features scaled up (never down)
    until that norm is twice the clip, so that its gradient is clipped to C at every step while
    its logits stay small (a canary whose logits explode would point its later gradients
    anywhere). Returns the norm over the clip."""
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad

    owners = p.owners
    names = owners.spec.shared
    assert p.billboard is not None and p.aggregator is not None  # a private method
    at = {
        **dict(owners.model.named_parameters()),
        **owners.public_personal,
        **p.billboard.shared_params(),
    }
    at = {k: v.detach() for k, v in at.items()}
    r0, r1 = int(shard.user_offsets[0]), int(shard.user_offsets[1])

    def norm_of(x: torch.Tensor, c: int) -> float:
        y = torch.full((r1 - r0,), c, dtype=shard.y.dtype)
        g = grad(lambda sh: F.cross_entropy(functional_call(owners.model, {**at, **sh}, (x,)), y))(
            {n: at[n] for n in names}
        )
        return float(
            torch.linalg.vector_norm(torch.cat([g[n].reshape(-1) for n in names]).to(torch.float64))
        )

    clip = float(cast(Any, p.aggregator).clip)  # local_dpsgd's clip
    label = max(range(shard.num_classes), key=lambda c: norm_of(shard.x[r0:r1], c))
    shard.y[r0:r1] = label
    for _ in range(60):
        norm = norm_of(shard.x[r0:r1], label)
        if norm >= 2 * clip:
            break
        shard.x[r0:r1] = shard.x[r0:r1] * min(10.0, 2.2 * clip / max(norm, 1e-12))
    return norm / clip


def natural_records(
    owners: int, users: int, capacity: int, max_records: int, features: int, classes: int, seed: int
) -> tuple[Records, dict[str, Any]]:
    """A natural-user federation as plain arrays, through ``fedudp.from_arrays``: owner 0 holds
    ``users`` users, every other owner ``capacity``; user i of an owner holds
    ``max_records - i % max_records`` records (unequal counts 1..max_records; owner 0's first
    user, the canary, the most). Features uniform in [0, 1), labels uniform over ``classes``;
    the owner column is given. Returns the ``Records`` and the public declarations (the run's
    own ``public.*``, ``dataset.classes``, ``dataset.input_shape`` and owner count: upper bounds
    that owner 0, below its capacity, does not reach)."""
    import fedudp

    rng = np.random.default_rng(seed)
    counts, user, owner = [], [], []
    for o in range(owners):
        for i in range(users if o == 0 else capacity):
            n = max_records - i % max_records
            counts.append(n)
            user += [f"o{o:03d}u{i:05d}"] * n
            owner += [o] * n
    total = int(sum(counts))
    x = rng.random((total, features)).astype(np.float32)
    y = rng.integers(0, classes, total).astype(np.int64)
    records = fedudp.from_arrays(
        x, y, np.array(user), np.array(owner, dtype=np.int64), classes=classes
    )
    declared = {
        "dataset.name": "memory",
        "partition.owner_rule": "given",
        "partition.num_owners": owners,
        "public.users": owners * capacity,
        "public.owner_capacity": capacity,
        "public.records_per_user": max_records,
        "dataset.classes": classes,
        "dataset.input_shape": [features],
        "dataset.test_fraction": 0.0,
    }
    return records, declared


def audit_local_dpsgd(
    overrides: dict,
    users: int,
    trials: int,
    seed: int = 0,
    broken: str = "",
    chunk: int = 2000,
    capacity: int | None = None,
    natural: int | None = None,
) -> AuditResult:
    """Owner-side DP-SGD's release (owner 0's noisy delta after one round) on D (``users``
    users) and D' (its first user removed), through the real owner path; ``trials`` releases per
    side, each with its own DP-SGD randomness. ``capacity``: the owner's public capacity M
    (default ``users``); M > ``users`` audits an owner holding fewer users than it declared
    (the schedule, q = min(B, M)/M and the divisor follow M on both sides).

    With an adaptive clip (``privacy.clip_policy=adaptive``) the owner releases, beside its
    delta, the mean of its steps' noisy unclipped fractions (``Owners.owner_deltas``'s
    ``fractions``): the audited release is the pair, scored on the linear discriminant (the
    two parts carry noise of different scales).

    ``natural=K``: a natural-user federation instead of the planned synthetic one
    (``natural_records``: users of 1..K records, built in memory from plain arrays, every
    public number declared; owner 0 holds ``users`` users below its declared capacity M).
    The owner's capacity, q and step count are then the prepared run's own (from
    ``public.owner_capacity``, checked to be M), D' is ``Federation.without_user`` of the canary,
    and the claim is re-checked on D' prepared from the arrays without the canary: the same
    capacity, noise multiplier and ε (nothing public read from the data)."""
    import torch

    from fedudp.build import prepare
    from fedudp.config import ConfigError, config_from_overrides
    from fedudp.owner.dpsgd import owner_rates
    from fedudp.privacy.audit_stats import audit_samples

    t0 = time.perf_counter()
    kind, factor = parse_break(broken)
    if kind == "clip=off":
        raise ValueError(
            "--break clip=off applies to the server-side release; use noise=FACTOR "
            "or schedule=data for privacy.placement=local_dpsgd"
        )
    if users < 2:
        raise ValueError(f"--owner-users {users}: the owner needs at least 2 users")
    cap_m = users if capacity is None else int(capacity)
    if cap_m < users:
        raise ValueError(
            f"--owner-users {users}:{cap_m}: the capacity M must be at least the "
            "users the owner holds"
        )
    over = {**AUDIT_DPSGD, **overrides, "seed": seed}
    records = records_without = None
    if natural is not None:
        if natural < 1:
            raise ValueError(f"--natural {natural}: users hold at least 1 record")
        records, declared = natural_records(
            int(over["partition.num_owners"]),
            users,
            cap_m,
            natural,
            int(over.get("dataset.features", 6)),
            int(over.get("dataset.classes", 3)),
            seed,
        )
        for k in (
            "dataset.features",
            "partition.scheme",
            "partition.records_per_user",
            "dataset.num_records",
        ):
            over.pop(k, None)
        over = {**over, **declared}
        # D' through the public API: the same arrays without the canary's records
        keep = records.user != records.user[0]
        assert records.owner is not None  # natural_records groups the users
        import fedudp

        records_without = fedudp.from_arrays(
            records.x[keep],
            records.y[keep],
            records.user[keep],
            records.owner[keep],
            classes=records.classes,
        )
    else:
        rpu = int(over.get("partition.records_per_user", 1))
        over["dataset.num_records"] = int(over["partition.num_owners"]) * cap_m * rpu
    p = prepare(config_from_overrides(over), records=records)
    if p.owners.training.dpsgd_records:
        raise ConfigError(
            "privacy.group_privacy: the owner-side audit removes one user; audit "
            "without group privacy"
        )
    if p.aggregator is None or p.aggregator.name != "local_dpsgd":
        raise ConfigError(
            "privacy.placement: the owner-side audit needs privacy.placement="
            "local_dpsgd and a private method"
        )
    agg, owners = p.aggregator, p.owners
    delta, batch = p.settings.delta, owners.training.user.batch_size
    assert agg is not None and delta is not None  # checked above: local_dpsgd, private
    claimed = one_release_epsilon(agg, delta)
    shard = p.fed.owner(0)
    if natural is not None:
        # the run's own public capacity of owner 0 (declared, not counted) and its claim on D'
        capacities = p.owners.training.dpsgd_capacity
        assert capacities is not None  # declared by the audit
        have = int(capacities[int(shard.owner_ids[0])])
        if shard.num_users != users or have != cap_m:
            raise ConfigError(
                f"public.owner_capacity: owner 0 holds {shard.num_users} users "
                f"at capacity {have}; the audit asked for {users} at {cap_m}"
            )
        q_ = prepare(config_from_overrides(over), records=records_without)
        assert q_.aggregator is not None
        if (
            q_.owners.training.dpsgd_capacity != p.owners.training.dpsgd_capacity
            or q_.aggregator.noise_multiplier != agg.noise_multiplier
            or one_release_epsilon(q_.aggregator, delta) != claimed
            or q_.fed.owner(0).num_users != users - 1
        ):
            raise ConfigError(
                "public.owner_capacity: the run without the canary user has "
                "another public schedule or claim (a number read from the data)"
            )
    elif shard.num_users != cap_m:
        raise ConfigError(
            f"dataset.num_records: owner 0 holds {shard.num_users} users, the "
            f"audit asked for {cap_m}"
        )
    for u in range(shard.num_users - 1, users - 1, -1):  # below capacity: the last users leave
        shard = shard.without_user(u)
    ratio = _make_canary(p, shard)
    neighbour = shard.without_user(0)
    constraint = agg.constraint
    adaptive = constraint.dpsgd_count_noise is not None
    if kind == "noise":
        dpsgd_noise, count_noise = constraint.dpsgd_noise, constraint.dpsgd_count_noise
        assert factor is not None and dpsgd_noise is not None  # noise=FACTOR on DP-SGD
        constraint = dataclasses.replace(
            constraint,
            dpsgd_noise=dpsgd_noise * factor,
            dpsgd_count_noise=(None if count_noise is None else count_noise * factor),
        )
    # the public capacity of every simulated owner (ids: D even, D' odd); schedule=data gives
    # each neighbour the count it holds (a schedule read from the data)
    cap = np.full(2 * trials, cap_m, dtype=np.int64)
    if kind == "schedule=data":
        cap[0::2] = users
        cap[1::2] = users - 1
    owners.training = dataclasses.replace(owners.training, dpsgd_capacity=tuple(cap.tolist()))
    assert p.billboard is not None  # a private method
    shared = p.billboard.shared_params()
    outs = {}
    for side, f, parity in (("D", shard, 0), ("D'", neighbour, 1)):
        parts = []
        for a in range(0, trials, chunk):
            n_k = min(chunk, trials - a)
            rep = _replicate(f, n_k, 2 * a + parity)
            personal = owners.initial_personal(n_k)
            fractions = np.zeros(n_k) if adaptive else None
            delta_k = (
                owners.owner_deltas(rep, shared, personal, np.arange(n_k), 1, constraint, fractions)
                .to(torch.float64)
                .numpy()
            )
            if adaptive:  # the owner's release: its delta and its mean noisy fraction
                assert fractions is not None  # adaptive: the owners report them
                delta_k = np.concatenate([delta_k, fractions[:, None]], axis=1)
            parts.append(delta_k)
        outs[side] = np.concatenate(parts)
    q, steps = owner_rates(np.array([cap_m]), batch)
    # one DP-SGD step with every user in it: the delta is Gaussian, same covariance on D and D'
    gaussian = (
        float(q[0]) >= 1.0
        and int(steps[0]) * owners.training.user.epochs == 1
        and kind != "schedule=data"
    )
    samples = audit_samples(
        outs["D"], outs["D'"], delta, ALPHA, gaussian=gaussian, discriminant=adaptive
    )
    power = (
        _power(samples, claimed, delta, trials, factor or 1.0, gaussian)
        if kind != "schedule=data"
        else None
    )
    name = (
        f"local_dpsgd{' adaptive' if adaptive else ''}"
        f"{f', natural users (1..{natural} records)' if natural is not None else ''}, "
        f"owner of {users} -> {users - 1} "
        f"users{'' if cap_m == users else f' (capacity {cap_m})'}, B={batch}"
    )
    from fedudp.build import run_guarantee

    res = AuditResult(
        name,
        "add_or_remove_one",
        trials,
        delta,
        claimed,
        samples,
        ratio,
        broken,
        time.perf_counter() - t0,
        power,
        gaussian,
        claim_heuristic=run_guarantee(p.spec, agg) == "heuristic",
    )
    return res


# -- command line -------------------------------------------------------------------------------
def _verdict(r: AuditResult) -> str:
    if r.violation:
        return "VIOLATION: less private than its ledger claims"
    return "consistent with the ledger" + (", low power" if r.low_power else "")


TABLE_HEAD = (
    "| mechanism | adjacency | releases per side | δ | ε claimed (one release) "
    "| ε lower bound (99%) | by | broken | verdict | seconds |\n"
    "|---|---|---:|---:|---:|---:|---|---|---|---:|"
)


def _row(r: AuditResult, what: str = "") -> str:
    b = r.samples.best
    return (
        f"| {what or r.mechanism} | {r.adjacency} | {r.trials} | {r.delta:g} "
        f"| {r.claimed_epsilon:.3f}{' (heuristic)' if r.claim_heuristic else ''} "
        f"| {r.lower_bound:.3f} | {b.method}, {b.statistic} "
        f"| {r.broken or '-'} | {_verdict(r)} | {r.seconds:.1f} |"
    )


def _details(r: AuditResult) -> list[str]:
    lines = [
        f"  {b.method} on the {b.statistic}: ε >= {b.epsilon:.3f} ({b.detail})"
        for b in r.samples.bounds
    ]
    lines += [f"  note: {n}" for n in r.samples.notes]
    if r.power:
        parts = []
        if "gaussian" in r.power:
            parts.append(f"Gaussian-DP fit: a noise cut to {r.power['gaussian']:.3f}x")
        parts.append(f"threshold test alone: to {r.power['threshold']:.3f}x")
        lines.append(
            f"  power at {r.trials} releases per side (detected with probability about "
            f"1/2): " + "; ".join(parts) + " of the configured noise"
        )
    return lines


def _main_pair(a: argparse.Namespace, over: dict) -> int:
    """``--pair paper_leak``: the paper-mode leak pair (``fedudp.leak``)."""
    from fedudp.config import ConfigError
    from fedudp.leak import clipped_sums, leak_config

    try:
        pair = clipped_sums(leak_config(**over))
    except (ConfigError, ValueError) as e:
        print(f"fedudp-audit: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    s = pair.prepared.settings
    print(
        f"pair: {a.pair} (privacy.accounting={s.accounting}): adding the canary user "
        f"moves the clipped sum by {pair.moved:.2f} C (the accountant assumes at most 1 C)"
    )
    r = audit_pair(
        pair.prepared.aggregator, pair.with_user, pair.without_user, a.trials, s.delta, a.seed
    )
    from fedudp.build import run_guarantee

    r.claim_heuristic = run_guarantee(pair.prepared.spec, pair.prepared.aggregator) == "heuristic"
    print(TABLE_HEAD)
    print(_row(r, f"{r.mechanism} ({a.pair}, {s.accounting})"))
    print("\n".join(_details(r)))
    return 1 if r.violation else 0


def _repeat(run_one: Callable[[int], AuditResult], seeds: list[int]) -> list[AuditResult]:
    out = []
    for s in seeds:
        r = run_one(s)
        print(_row(r, f"{r.mechanism} (seed {s})"), flush=True)
        out.append(r)
    return out


def releases_per_trial(a: argparse.Namespace, run_rounds: int, linear_noise: bool) -> int:
    """``--sequence`` where given (0 is refused, never read as "not given"), else the run's
    rounds (``--rounds``, else ``train.rounds``) for a mechanism whose noise is correlated
    across rounds, else one release."""
    if a.sequence is not None:
        return int(a.sequence)
    rounds = a.rounds if a.rounds is not None else run_rounds
    return int(rounds) if linear_noise else 1


def check_flags(a: argparse.Namespace, over: dict) -> str | None:
    """The command line's numbers, checked before any mechanism is built: the one-line reason
    a flag is refused (None: all fine). The releases an audit keeps (2 sides x trials x the
    released length, float64) must fit this machine's memory (``fedudp.models.footprint``);
    the released length is at least ``--dim`` on the server side and 1 owner-side, checked
    again once the sequence length is known."""
    for flag, value, least in (
        ("--trials", a.trials, 200),
        ("--dim", a.dim, 1),
        ("--repeat", a.repeat, 1),
        ("--sequence", a.sequence, 1),
        ("--rounds", a.rounds, 1),
        ("--natural", a.natural, 1),
    ):
        if value is not None and value < least:
            what = {
                "--trials": "releases per side",
                "--dim": "coordinate in the audited vectors",
                "--repeat": "audit (seed)",
                "--sequence": "release per trial",
                "--rounds": "round to calibrate the noise for",
                "--natural": "record per user",
            }[flag]
            return f"{flag} {value}: at least {least} {what}"
    server = over.get("privacy.placement", "server") != "local_dpsgd" and not a.pair
    try:
        check_arrays(
            f"--trials {a.trials}" + (f" with --dim {a.dim}" if server else ""),
            2 * a.trials * (a.dim if server else 1),
            8,
            "lower --trials" + (" or --dim" if server else ""),
        )
    except ConfigError as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fedudp-audit", description=__doc__.split("\n")[0])
    ap.add_argument(
        "overrides", nargs="*", help="fedudp config overrides (key=value, as for fedudp)"
    )
    ap.add_argument("--trials", type=int, default=100_000, help="releases on each neighbour")
    ap.add_argument(
        "--dim", type=int, default=8, help="length of the audited vectors (server side)"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="releases the noise is calibrated for (default: train.rounds; the "
        "owner-side audit runs one round calibrated for train.rounds=1 unless "
        "overridden)",
    )
    ap.add_argument(
        "--break",
        dest="broken",
        default="",
        help="weaken the mechanism on purpose (the audit must catch it): noise=FACTOR "
        "(any factor > 0), clip=off (server side), schedule=data (local_dpsgd)",
    )
    ap.add_argument(
        "--owner-users",
        default="",
        help="local_dpsgd: comma-separated owner sizes to audit, M (D: M users, D': "
        "M-1, public capacity M) or m:M (an owner below capacity: D holds m "
        "users, D' m-1, capacity M); default B//3 and B+1",
    )
    ap.add_argument(
        "--natural",
        type=int,
        default=None,
        metavar="K",
        help="local_dpsgd: natural users instead of the planned federation: users "
        "holding 1..K records each, built in memory from plain arrays "
        "(fedudp.from_arrays) with every public number declared (public.users, "
        "public.owner_capacity = M, public.records_per_user = K, "
        "dataset.classes, dataset.input_shape); with --owner-users m:M owner 0 "
        "holds m users below its capacity M, D' the same without one user",
    )
    ap.add_argument(
        "--sequence",
        type=int,
        default=None,
        help="releases per trial (server side): each trial is a fresh mechanism "
        "releasing this many times, audited as one sequence against the ε of as "
        "many releases; default: the run's rounds for dp_ftrl_tree and "
        "dp_mf_banded, 1 otherwise",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the audit with seeds seed..seed+K-1 and count violations (on the "
        "unbroken mechanism: the false-alarm rate)",
    )
    ap.add_argument(
        "--pair",
        default="",
        choices=["", "paper_leak"],
        help="audit a built-in neighbouring pair through the configured release "
        "instead of a canary: paper_leak = the joint-DP paper-mode pair "
        "(overrides such as privacy.accounting=certified|paper apply to it)",
    )
    a = ap.parse_args(argv)
    err = lambda m: (print(f"fedudp-audit: error: {m}", file=sys.stderr), 2)[1]  # noqa: E731
    try:
        over = dict(o.split("=", 1) for o in a.overrides)
    except ValueError:
        return err("overrides are key=value")
    try:
        parse_break(a.broken)
    except ValueError as e:
        return err(str(e))
    bad = check_flags(a, over)
    if bad:
        return err(bad)
    if over.get("engine_opts.device", "cpu") != "cpu":
        return err(
            f"engine_opts.device={over['engine_opts.device']}: the audit runs on the CPU only "
            "(its canaries and replicated owners are built there); drop the override"
        )
    if a.pair:
        if a.broken:
            return err("--break applies to the canary audit, not to --pair")
        return _main_pair(a, over)
    from fedudp import build
    from fedudp.aggregators import Sampling
    from fedudp.config import ConfigError, config_from_overrides

    try:
        placement = over.get("privacy.placement", "server")
        if placement == "local_dpsgd":
            return _main_local_dpsgd(a, over)
        if a.natural is not None:
            raise ValueError(
                "--natural: the natural-user audit is owner-side DP-SGD's "
                "(privacy.placement=local_dpsgd)"
            )
        cfg = config_from_overrides({"method": "full_dp", **over})
        build.check(cfg)
        spec, s = build.method(cfg, build.model(cfg)), build.settings(cfg)
        if not spec.private:
            raise ConfigError("method: the audit needs a private method (full_dp or joint_dp)")
        n_owners, n_users = build.planned_units(cfg)
        population = n_owners if spec.cohort_is_owners else n_users

        def make() -> Aggregator:
            return build.estimator(
                cfg, Sampling(s.sampling_rate, population), a.rounds or s.rounds, a.dim
            )

        first = make()
        releases = releases_per_trial(a, s.rounds, first.name in LINEAR_NOISE)
        if releases < 1:
            raise ValueError(f"--sequence {releases}: at least one release per trial")
        if releases > 64:
            raise ValueError(
                f"--sequence {releases}: at most 64 releases per trial; set "
                "--sequence (or train.rounds) lower"
            )
        # the releases kept: trials x (releases x dim) float64 numbers per side
        check_arrays(
            f"--trials {a.trials} with --dim {a.dim} and {releases} release(s) per trial",
            2 * a.trials * releases * a.dim,
            8,
            "lower --trials or --dim",
        )
        print(TABLE_HEAD)
        delta = s.delta
        assert delta is not None  # a private method's
        if releases > 1 or first.name in SEQUENCE_AUDITED:

            def one(seed: int) -> AuditResult:
                return audit_sequence(
                    make(), a.dim, a.trials, releases, delta, seed, a.broken, s.bound
                )

        else:

            def one(seed: int) -> AuditResult:
                return audit(make(), a.dim, a.trials, delta, seed, a.broken, s.bound)

        results = _repeat(one, list(range(a.seed, a.seed + a.repeat)))
    except (ConfigError, ValueError) as e:
        return err(str(e).splitlines()[0])
    return _finish(results, a)


def _main_local_dpsgd(a: argparse.Namespace, over: dict) -> int:
    from fedudp.config import config_from_overrides

    batch = config_from_overrides({**AUDIT_DPSGD, **over}).train.batch_size
    try:
        sizes = (
            [tuple(int(v) for v in m.split(":")) for m in a.owner_users.split(",")]
            if a.owner_users
            else [(max(2, batch // 3),), (batch + 1,)]
        )
        if any(len(m) not in (1, 2) for m in sizes):
            raise ValueError
    except ValueError:
        raise ValueError(
            f"--owner-users {a.owner_users}: comma-separated integers M or pairs m:M"
        ) from None
    if a.sequence not in (None, 1):
        raise ValueError("--sequence: the owner-side audit releases one round per trial")
    if a.rounds:
        over = {**over, "train.rounds": a.rounds}
    print(TABLE_HEAD)
    results = []
    for m in sizes:

        def one(s: int, m: tuple[int, ...] = m) -> AuditResult:
            return audit_local_dpsgd(
                over, m[0], a.trials, s, a.broken, capacity=m[-1], natural=a.natural
            )

        results += _repeat(one, list(range(a.seed, a.seed + a.repeat)))
    return _finish(results, a)


def _finish(results: list[AuditResult], a: argparse.Namespace) -> int:
    for r in results[:1] if a.repeat > 1 else results:
        print("\n".join(_details(r)))
    if a.repeat > 1:
        bad = sum(r.violation for r in results)
        what = "false alarms" if not a.broken else "detections"
        print(
            f"{what}: {bad} of {len(results)} audits flagged a violation "
            f"(seeds {a.seed}..{a.seed + a.repeat - 1})"
        )
    if any(r.low_power for r in results):
        print(
            "note: the lower bound is far below the claim: this audit has little power here "
            "(one unit's real influence on this cohort is much smaller than the certified "
            "sensitivity, or too few releases); it cannot confirm the constant, only catch a "
            "gross violation",
            file=sys.stderr,
        )
    return 1 if any(r.violation for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
