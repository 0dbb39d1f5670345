"""Levy et al., "Learning with User-Level Privacy" (seed 004_07414daf854bd785.txt), §5.1
Algorithm 4 (phased ERM for SCO, Theorem 4; docs/algorithms.md#levy-algorithm-4).

    P = ceil(log2(G n sqrt(m) ε / (σ d)))            phases (``algorithm.phases``; null: this P,
        capped at floor(log2 n) and at train.rounds, see ``default_phases``)
    λ = sqrt(G G_ / (n m) + σ² d² / (n² m ε²)) / R     G_ = min(G, σ sqrt(d)) (``algorithm.lam``)
    phase t = 1..P: n_t = floor(n / 2^t) users not used before (a public random split),
        λ_t = 4^t λ,  θ̂_t ≈ argmin (1/(m n_t)) Σ_{u ∈ S_t} Σ_j l(θ; z_j^u) + (λ_t/2)||θ - θ̂_{t-1}||²
        solved by Alg. 3 (WinsorizedMeanHighD on the users' mean gradients, ``aggregator=winsorized``
        calibrated for the phase's n_t and T_t) with the public regulariser's gradient
        λ_t (θ - θ̂_{t-1}) added by the billboard, step 1/(H + λ_t) (``algorithm.step_size``),
        projection on ||θ|| <= R, output the phase's averaged iterate.
    return θ̂_P

Privacy: phases use disjoint users, so each spends the full (ε, δ): the ledger composes them in
parallel (a ``Parallel`` event, one part per phase). Theorem 4 needs ε <= 1, δ <= 1/n² and
Corollary 2's T_t = (H/λ_t) log(n_t² m (G/G̃²) λ_t R ε² / d) steps per phase; ``train.rounds``
(split evenly over the phases) replaces it, both recorded in summary.json.
"""

from __future__ import annotations

import math
from typing import cast

from fedudp.aggregators.winsorized import WinsorizedAggregator
from fedudp.algorithms import (
    Context,
    Requirements,
    Setup,
    need,
    public_permutation,
    register,
    split_rounds,
)
from fedudp.algorithms.schedule import AlgorithmPlan, Phase
from fedudp.protocol.contributions import Sampling

__all__ = [
    "SEED",
    "REQUIRES",
    "paper_parameters",
    "default_phases",
    "corollary2_rounds",
    "setup",
]

SEED = "004_07414daf854bd785.txt (Levy et al.), Algorithm 4, Theorem 4"


REQUIRES = Requirements(methods=("full_dp", "joint_dp"), aggregator="winsorized")


def paper_parameters(n: int, m: int, d: int, eps: float, G: float, sigma: float, R: float) -> dict:
    """P and λ of Algorithm 4 (at least one phase).

    Parameters
    ----------
    n, m, d : int
        Users, records per user, dimension.
    eps, G, sigma, R : float
        ε, the Lipschitz constant, the noise scale σ, the radius.

    Returns
    -------
    dict
        ``phases`` (P), ``lam`` (λ), ``g_low``.
    """
    g_low = min(G, sigma * math.sqrt(d))
    P = max(1, math.ceil(math.log2(G * n * math.sqrt(m) * eps / (sigma * d))))
    lam = math.sqrt(G * g_low / (n * m) + sigma**2 * d**2 / (n**2 * m * eps**2)) / R
    return {"phases": P, "lam": lam, "g_low": g_low}


def default_phases(paper_phases: int, n: int, rounds: int) -> int:
    """``algorithm.phases: null``: the paper's P, capped so that every phase has a user and a round.

    The paper's n_t = n/2^t is real-valued; its P (Alg. 4 line 1) leaves n/2^P users in the
    last phase, between half of and all of σd/(G sqrt(m) ε) (sqrt(d/m)/ε with the default
    σ = G/sqrt(d)), whatever n is: below one user whenever m ε² > d, and often otherwise (e.g.
    P = 12 at n = 4000, m = 10, ε = 1, d = 20: n/2^P = 0.98). With n_t = floor(n/2^t) the largest
    usable P is floor(log2 n); ``train.rounds`` (split over the phases) caps it too. Where the
    paper's P fits, it is used unchanged; an explicit ``algorithm.phases`` is never capped (too
    many is an error).

    Parameters
    ----------
    paper_phases, n, rounds : int
        The paper's P, the users, ``train.rounds``.

    Returns
    -------
    int
    """
    return max(1, min(paper_phases, n.bit_length() - 1, rounds))


def corollary2_rounds(
    n_t: int, m: int, d: int, eps: float, G: float, sigma: float, R: float, H: float, mu: float
) -> int:
    """Corollary 2's T = (H/μ) log(n² m (G/G̃²) μ R ε² / d), G̃ = σ sqrt(d) (at least 1).

    Parameters
    ----------
    n_t, m, d : int
        The phase's users, records per user, dimension.
    eps, G, sigma, R, H, mu : float
        ε, Lipschitz constant, σ, radius, smoothness, the phase's λ (as μ).

    Returns
    -------
    int
    """
    g_tilde = sigma * math.sqrt(d)
    arg = n_t**2 * m * (G / g_tilde**2) * mu * R * eps**2 / d
    return max(1, math.ceil(H / mu * math.log(max(arg, math.e))))


def setup(ctx: Context) -> Setup:
    """Levy et al.'s Algorithm 4 for this run.

    Parameters
    ----------
    ctx : Context
        The run's public values; returns its ``Setup`` (``ParameterError``: too many phases)."""
    a = ctx.params
    n, m, d = ctx.n_users, ctx.m, ctx.dim
    G = a.lipschitz or ctx.bound
    sigma = a.sigma or G / math.sqrt(d)
    eps, delta, R = ctx.epsilon, ctx.delta, a.radius
    paper = paper_parameters(n, m, d, eps, G, sigma, R)
    P = a.phases or default_phases(paper["phases"], n, ctx.rounds)
    lam = a.lam if a.lam is not None else paper["lam"]
    need(n // 2**P >= 1, "phases", f"{P} phases halve n={n} users below one user")
    rounds = split_rounds(ctx.rounds, P)
    perm = public_permutation(ctx.seed, n)
    phases, info, start = [], [], 0
    for t in range(1, P + 1):
        n_t = n // 2**t
        lam_t = 4**t * lam
        users = perm[start : start + n_t]
        start += n_t
        agg = cast(
            WinsorizedAggregator, ctx.estimator("winsorized", Sampling(1.0, n_t), rounds[t - 1])
        )
        eta = a.step_size or 1.0 / (a.smoothness + lam_t)
        phases.append(
            Phase(rounds[t - 1], agg, eta, units=users, reg=lam_t, reg_centre="start", radius=R)
        )
        info.append(
            {
                "phase": t,
                "users": n_t,
                "lambda": lam_t,
                "step_size": eta,
                "rounds": rounds[t - 1],
                "eps_coord": agg.eps_coord,
                "tau": agg.tau,
                "paper_rounds": corollary2_rounds(n_t, m, d, eps, G, sigma, R, a.smoothness, lam_t),
                "min_users_required": agg.min_users_required,
            }
        )
    averaged = True if a.averaged is None else a.averaged
    plan = AlgorithmPlan(phases, n, averaged)
    conditions = {"eps<=1": eps <= 1, "delta<=1/n^2": delta <= 1 / n**2}
    summary = {
        "seed": SEED,
        "phases": P,
        "phases_paper": paper["phases"],
        "lambda": lam,
        "lambda_paper": paper["lam"],
        "G": G,
        "sigma": sigma,
        "R": R,
        "configured_T": ctx.rounds,
        "paper_T": sum(p["paper_rounds"] for p in info),
        "phase_detail": info,
        "theorem_conditions": conditions,
        "users_unused": n - start,
    }
    notes = [
        f"levy_alg4: {P} phases on disjoint users ({[p['users'] for p in info]} of n={n}), "
        "each (ε, δ) on its own users: composed in PARALLEL (one Parallel part per phase; "
        "the run's epsilon is the worst phase's)",
        "the regulariser λ_t (θ - θ̂_{t-1}) is public (θ̂_{t-1} is the previous phase's DP "
        "output): added by the billboard, post-processing",
    ]
    if not a.phases and P < paper["phases"]:
        Pp = paper["phases"]
        why = [f"leave phase {Pp} with n/2^P = {n / 2**Pp:.3g} users"] if n // 2**Pp < 1 else []
        if Pp > ctx.rounds:
            why.append(f"need {Pp} rounds, more than train.rounds={ctx.rounds}")
        notes.append(
            f"levy_alg4: the paper's P = {Pp} phases would {' and '.join(why)}: capped at "
            f"P = {P}, the largest with at least one user and one round per phase "
            "(algorithm.phases sets P)"
        )
    return Setup(phases[0].aggregator, plan, Sampling(1.0, n), summary, notes)


register("levy_alg4", REQUIRES, setup)
