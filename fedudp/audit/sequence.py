"""Audits of stateful and sequential mechanisms (``audit_sequence``): an adaptive clip, a
tree (``dp_ftrl_tree``), a banded mechanism (``dp_mf_banded``), a BLT (``dp_mf_blt``).

Every trial starts from a fresh copy of the configured aggregator (never one reused across
trials: an adaptive clip carried from trial to trial drifts, and the audit would then measure
that drift, not the mechanism); one trial is T releases of that fresh copy on D (the canary in
every round it takes part in, ``canary_rounds``) or D' (absent), and the statistic sees the whole
released sequence, scored on the linear discriminant.

Adaptive clipping: the clip C_t is public (computed from earlier releases), so each round's
release is centred by the background's clipped sum and unclipped count at C_t and scaled by
its noise (z_Δ C_t for the sum, σ_b for the count): with every unit in every round (sampling
rate 1) the residuals are exactly Gaussian with a fixed shift whatever the clip does, the
canary being held at twice the current clip (always clipped to C_t, never counted as
unclipped).
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from fedudp.audit.result import (
    ALPHA,
    AuditResult,
    detection_power,
    parse_break,
    releases_epsilon,
    weaken,
)

if TYPE_CHECKING:
    import torch

    from fedudp.aggregators.base import Aggregator
    from fedudp.privacy.audit_stats import SampleAudit
    from fedudp.protocol.contributions import Constraint, Contribution

__all__ = ["LINEAR_NOISE", "SEQUENCE_AUDITED", "audit_sequence", "canary_rounds"]


def canary_rounds(agg: Aggregator, releases: int, rng: np.random.Generator) -> np.ndarray:
    """The rounds of one trial the canary unit takes part in, by the mechanism's own
    participation rule, the canary in the worst-case public group: a tree's unit in group 0
    trains in the first round of every tree (its leaf lies in the most noisy nodes); a banded
    mechanism's (and a BLT's) in the first round of every cycle of b rounds, sampled there at
    the group rate (for the BLT the worst pattern 0, b, 2b, ...);
    any other aggregator's Poisson-sampled at its rate in every round.

    Parameters
    ----------
    agg : Aggregator
        The mechanism.
    releases : int
        Releases per trial.
    rng : numpy.random.Generator
        The audit's generator (sampled rounds).

    Returns
    -------
    numpy.ndarray
        [releases] bool.
    """
    r = np.arange(releases)
    mech: Any = agg  # a tree's or a banded mechanism's own attributes, by name
    if agg.name == "dp_ftrl_tree":
        return r % mech.k == 0
    if agg.name in ("dp_mf_banded", "dp_mf_blt"):
        return (r % mech.bands == 0) & (rng.random(releases) < mech.group_rate)
    return rng.random(releases) < agg.sampling.rate


# mechanisms whose release is (clipped sum + noise) / (public divisor), with noise independent
# across coordinates and a state (the noise history) kept per coordinate
LINEAR_NOISE = ("dp_ftrl_tree", "dp_mf_banded", "dp_mf_blt")
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
    (``releases_epsilon``); an adaptive clip's rounds as the module docstring says.

    Parameters
    ----------
    agg, dim, trials, delta, seed, broken, bound, background
        As for ``fedudp.audit.server.audit`` (``agg`` is a template: never changed).
    releases : int
        Releases per trial.

    Returns
    -------
    AuditResult
        The claim for ``releases`` releases, the lower bound and the audit's power.

    Raises
    ------
    ValueError
        Fewer than one release, a mechanism that does not clip, or a ``--break`` that does not
        apply to it.
    """
    import torch

    t0 = time.perf_counter()
    releases = int(releases)
    if releases < 1:
        raise ValueError(f"--sequence {releases}: at least one release per trial")
    claimed = releases_epsilon(agg, delta, releases)
    kind, factor = parse_break(broken)
    template, constraint = _sequence_template(agg, kind, factor)
    assert constraint.clip is not None  # checked: a clipping aggregator
    bound = constraint.clip
    canary_norm = 10.0 * bound if kind == "clip=off" else bound
    n = template.sampling.population
    g = torch.Generator().manual_seed(seed)
    others = background * bound * (torch.rand(n - 1, dim, generator=g, dtype=torch.float64) - 0.5)
    rng = np.random.default_rng([seed, 3])
    fixed_base = constraint.apply(others)
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
        outs[side] = _fresh_sequences(
            template, side == "D", others, fixed_base, canary_norm, kind, trials, releases, rng
        )
    return _sequence_result(
        template, outs, releases, delta, claimed, trials, canary_norm, broken, factor, t0
    )


def _sequence_template(
    agg: Aggregator, kind: str, factor: float | None
) -> tuple[Aggregator, Constraint]:
    """A copy of ``agg`` to start every trial from, ``--break noise`` applied to it, and its
    owners' constraint; a ``--break`` that does not apply, or no clip, is refused."""
    if kind == "schedule=data":
        raise ValueError("--break schedule=data applies to privacy.placement=local_dpsgd")
    template = copy.deepcopy(agg)
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
    return template, constraint


def _fresh_sequences(
    template: Aggregator,
    with_canary: bool,
    others: torch.Tensor,
    fixed_base: Contribution,
    canary_norm: float,
    kind: str,
    trials: int,
    releases: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """[trials, releases·width]: ``trials`` runs of a fresh copy of ``template`` each, on the
    background ``others`` with (``with_canary``) or without the canary in the rounds
    ``canary_rounds`` draws; an adaptive clip's rounds centred by the background at the public
    current clip and scaled by its noise (width ``dim + 1``: its noisy unclipped fraction)."""
    import torch

    from fedudp.protocol.contributions import Constraint, Contribution

    dim = int(others.shape[1])
    adaptive = template.name == "gaussian_adaptive"
    qn = template.sampling.expected_cohort
    width = dim + (1 if adaptive else 0)
    # the background's clipped sum at a clip C_t: unchanged while every background vector fits
    largest = float(torch.linalg.vector_norm(others, dim=1).max()) if len(others) else 0.0
    unclipped_base = Constraint(rows=False, clip=None).apply(others)
    constraint = template.constraint
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
                canary_part = cons.apply(canary)
            else:
                cons, base = constraint, fixed_base
                canary = torch.zeros(1, dim, dtype=torch.float64)
                canary[0, 0] = canary_norm
                canary_part = (
                    Constraint(rows=False, clip=None) if kind == "clip=off" else cons
                ).apply(canary)
            parts = [base] + ([canary_part] if with_canary and present[r] else [])
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
    return vals


def _sequence_result(
    template: Aggregator,
    outs: dict[str, np.ndarray],
    releases: int,
    delta: float,
    claimed: float,
    trials: int,
    canary_norm: float,
    broken: str,
    factor: float | None,
    t0: float,
) -> AuditResult:
    """The sequence audit's bounds on the two samples ``outs``, its power and its result."""
    from fedudp.privacy.audit_stats import audit_samples

    q = template.sampling.rate
    # Gaussian by construction: no sampling anywhere in the sequence (a tree; a banded
    # mechanism taking its whole group; Poisson at rate 1)
    gaussian = (
        template.name == "dp_ftrl_tree"
        or (
            template.name in ("dp_mf_banded", "dp_mf_blt") and cast(Any, template).group_rate >= 1.0
        )
        or (template.name in ("gaussian", "gaussian_adaptive") and q >= 1.0)
    )
    samples: SampleAudit = audit_samples(
        outs["D"], outs["D'"], delta, ALPHA, gaussian=gaussian, discriminant=True
    )
    power = (
        detection_power(samples, claimed, delta, trials, factor or 1.0, gaussian)
        if parse_break(broken)[0] != "clip=off"
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
