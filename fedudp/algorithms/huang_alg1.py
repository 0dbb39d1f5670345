"""Huang et al., "Learning across Data Owners with Joint Differential Privacy" (seed
001_40594ba3d5609f29.txt), §3.1 Algorithm 1 (A_NSGD, Theorem 3.1, Lemma 3.2;
docs/algorithms.md#huang-algorithm-1),
as stated: one record per step, noise on the shared coordinates only, averaged iterate.

    per step t: one record z of owner j (``privacy.accounting=certified``: Poisson-sampled at
        rate q = 1/(mn) over the mn records, the data flow the accountant certifies;
        ``paper``: exactly one record uniformly, with replacement across steps, accounted as the
        Poisson approximation and labelled heuristic, dp-accounting has no with-replacement
        sampling)
    u   <- Π_U(u - η (clip_L(∇_u h(x_j, u, z)) + b_t)),  b_t ~ N(0, σ² I_ℓ)   (the billboard:
        ``aggregator=gaussian`` at rate q, noise on the shared block only)
    x_j <- x_j - η ∇_x h(x_j, u, z)   (owner j's personal block, no noise; the owner hook
        ``fedudp.algorithms.personal_step.PersonalStep``; every other owner's x is unchanged)
    return ū = (1/T) Σ_t u^t   (the shared averaged iterate; personal blocks: last iterate)

Full-DP baseline (§3.2 table / App. A.3, ``algorithm.noise_personal=true``, ``method=joint_dp``):
noise N(0, σ² I_{nk+ℓ}) on ALL coordinates, same σ and T. The shared step is unchanged; inside
the owner hook (``PersonalStep.noise_std``) every owner's personal block takes
x_j <- x_j - η (∇_x h(x_j, u, z) [only if one of its records was sampled] + b_j), b_j ~ N(0, σ² I_k)
fresh every step for EVERY owner, σ the per-coordinate std of the shared step's released mean
(noise_std / (qN)). The personal blocks still never leave their owner; the accounting is that of
the shared release (the personal noise is extra). η: A.3's analysis tunes it for the noised
dimension, so the paper's formula is taken with nk + ℓ in place of ℓ (``algorithm.step_size``
overrides it for both).

One record per user (``partition.records_per_user=1``): the unit is the record (user level
follows by group privacy, [HUANG] Lemma 3.6: run at ε r/m). σ: calibrated by dp-accounting for T Poisson-
sampled Gaussian releases at rate 1/(mn), or ``privacy.noise_multiplier`` if set (the billboard
then stops before the budget is exceeded; the paper's σ = L sqrt(T log(1/δ))/(ε m n) holds only
up to an unknown constant c2 and is recorded, not used). Step size (not stated by the paper; derived
by balancing the proof's terms): η = R / (L T sqrt(1/(mn) + ℓ log(1/δ)/(ε² m² n²)))
(``algorithm.step_size``). T = Θ(m²n²) (proof of Thm 3.1) is infeasible: ``train.rounds``
replaces it; both in summary.json. In certified mode (joint_dp) the shared gradient is taken at
the public personal copy (docs/algorithms.md#certified-vs-paper-accounting); paper mode at x_j
(the feedback).
Personal update order: x_j moves before u's gradient is taken in the same round (the round
loop's order), a one-step lag against the paper's simultaneous update, only in paper mode.
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np

from fedudp.aggregators.gaussian import GaussianAggregator
from fedudp.algorithms import Context, Requirements, Setup, need, register
from fedudp.algorithms.personal_step import PersonalStep
from fedudp.algorithms.schedule import AlgorithmPlan, Phase
from fedudp.protocol.contributions import Sampling
from fedudp.randomness import Purpose, numpy_rng

__all__ = [
    "SEED",
    "REQUIRES",
    "check",
    "paper_step_size",
    "paper_sigma",
    "setup",
]

SEED = "001_40594ba3d5609f29.txt (Huang et al.), Algorithm 1, Theorem 3.1, Lemma 3.2"


REQUIRES = Requirements(methods=("joint_dp", "full_dp"), aggregator="gaussian")


def check(ctx: Context) -> None:
    """Huang et al.'s Algorithm 1's own checks.

    Parameters
    ----------
    ctx : Context
        The run's public values.

    Raises
    ------
    ParameterError
        When a user holds more than one record, or ``noise_personal`` without ``joint_dp``.
    """
    need(
        ctx.records_per_user == 1,
        "records_per_user",
        "algorithm.name=huang_alg1 samples one record per step: it needs one record per user "
        "(user level via group privacy: privacy.epsilon = ε r/m)",
    )
    need(
        not ctx.params.noise_personal or ctx.method == "joint_dp",
        "noise_personal",
        "the full-DP baseline noises the personal blocks of method=joint_dp (method=full_dp "
        f"has none), got method={ctx.method}",
    )


def paper_step_size(
    R: float, L: float, T: int, N: int, ell: int, eps: float, delta: float
) -> float:
    """η = R / (L T sqrt(1/N + ℓ log(1/δ)/(ε² N²))), N = mn records.

    Parameters
    ----------
    R, L : float
        The ball's radius and the Lipschitz constant.
    T, N, ell : int
        Steps, records, noised coordinates ℓ.
    eps, delta : float
        The target (ε, δ).

    Returns
    -------
    float
    """
    return R / (L * T * math.sqrt(1 / N + ell * math.log(1 / delta) / (eps**2 * N**2)))


def paper_sigma(L: float, T: int, N: int, eps: float, delta: float) -> float:
    """Algorithm 1's σ = L sqrt(T log(1/δ)) / (ε m n) (up to Lemma 3.2's unknown c2).

    Parameters
    ----------
    L : float
        The Lipschitz constant.
    T, N : int
        Steps and records (mn).
    eps, delta : float
        The target (ε, δ).

    Returns
    -------
    float
    """
    return L * math.sqrt(T * math.log(1 / delta)) / (eps * N)


def setup(ctx: Context) -> Setup:
    a = ctx.params
    N, T, ell = ctx.n_users, ctx.rounds, ctx.dim  # one record per user: N = mn
    L = a.lipschitz or ctx.clip
    eps, delta = ctx.epsilon, ctx.delta
    q = 1.0 / N
    paper = ctx.paper
    sampling = Sampling(q, N)
    agg = cast(GaussianAggregator, ctx.estimator("gaussian", sampling, T))
    if paper:  # the paper's sampling (one record, with replacement) and constants
        agg = agg.as_heuristic()
    # the full-DP baseline: noise on every owner's personal block too (nk more coordinates)
    nk = ctx.n_owners * ctx.personal_dim
    noised = ell + nk if a.noise_personal else ell
    eta = a.step_size or paper_step_size(a.radius, L, T, N, noised, eps, delta)
    seed = ctx.seed

    def sampler(round_: int) -> np.ndarray:
        if paper:  # one record, uniformly, with replacement
            mask = np.zeros(N, dtype=bool)
            mask[numpy_rng(seed, Purpose.SCHEDULE, round_).integers(N)] = True
            return mask
        return numpy_rng(seed, Purpose.SAMPLE, round_).random(N) < q  # Poisson at 1/(mn)

    averaged = True if a.averaged is None else a.averaged
    plan = AlgorithmPlan([Phase(T, agg, eta, radius=a.radius)], N, averaged, sampler=sampler)
    # σ per coordinate of the released mean, the shared step's noise (qN = 1 here: = z C)
    sigma_mean = agg.noise_std / sampling.expected_cohort
    hooks = PersonalStep(eta, plan.cohort, seed, sigma_mean if a.noise_personal else None)
    sigma = agg.noise_std
    summary = {
        "seed": SEED,
        "configured_T": T,
        "paper_T": N**2,
        "records": N,
        "rate": q,
        "step_size": eta,
        "step_size_paper": paper_step_size(a.radius, L, T, N, noised, eps, delta),
        "L": L,
        "R": a.radius,
        "sigma": sigma,
        "sigma_paper_formula": paper_sigma(L, T, N, eps, delta),
        "noise_multiplier": agg.noise_multiplier,
        "shared_dim": ell,
        "personal_dim_total": nk,
        "noise_personal": bool(a.noise_personal),
        "personal_noise_std": sigma_mean if a.noise_personal else None,
        "noised_dim": noised,
        "sampling": "with replacement (one record per step)" if paper else "Poisson at 1/(mn)",
        "theorem_conditions": {"mn>=10": N >= 10, "0<eps<=10": 0 < eps <= 10},
    }
    notes = [
        (
            f"huang_alg1 full-DP baseline (algorithm.noise_personal=true): noise N(0, σ²), "
            f"σ = {sigma_mean:.6g} (the shared step's per-coordinate std), on the shared "
            f"coordinates AND on every owner's personal block every step ({nk} personal "
            "coordinates, noised inside the owner component; they never leave their owner); "
            "the privacy accounting is unchanged: epsilon/delta are those of the shared "
            "release (the joint-DP guarantee), the personal noise is extra and not accounted"
            + (
                f"; step size {eta:.6g} (algorithm.step_size)"
                if a.step_size
                else f"; step size from the paper's formula at the noised dimension nk + ℓ = {noised}"
            )
        )
        if a.noise_personal
        else "huang_alg1: one record per step; noise N(0, σ²) on the SHARED coordinates only, the "
        "personal blocks move without noise and never leave their owner",
        (
            "paper mode: one record sampled with replacement per step, accounted as Poisson "
            "sampling at 1/(mn) (an approximation; dp-accounting has no with-replacement event): "
            "guarantee heuristic"
        )
        if paper
        else "certified: records Poisson-sampled at q = 1/(mn) exactly as accounted",
    ]
    return Setup(agg, plan, sampling, summary, notes, owner_hooks=hooks)


register("huang_alg1", REQUIRES, setup, check)
