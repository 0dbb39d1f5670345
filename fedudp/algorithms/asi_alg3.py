"""Asi & Liu, "User-level DP Stochastic Convex Optimization: Efficient Algorithms with Optimal
Rates" (seed 003_60e5b11bfa501c93.txt), §4 Algorithm 3 (Theorem 4.1;
docs/algorithms.md#asi-and-liu-algorithm-3).

    one instance of Algorithm 2 (``aggregator=outlier_removal``: ONE AboveThreshold across all T
    queries, its ε/2 spent once per run) answers the T queries
    q_t(Z) = (1/m) Σ_j ∇l(θ_t + y_j; z_j),  y_j ~ Unif(B(0, r)) fresh per record  (randomized
        smoothing, the owner hook ``fedudp.algorithms.smoothing.Smoothing``, public randomness)
    θ_{t+1} = Π_Θ(θ_t - η ĝ_t)   (Θ: ||θ|| <= R)
    if Algorithm 2 halted: return θ_0
    return θ̂ = (1/T) Σ_t θ_t   (the averaged iterate)

Parameters (Thm 4.1), each overridable: R̂ = R (``algorithm.radius``); r = d^{1/4} R̂ / sqrt(T)
(``algorithm.smoothing_radius``); η = (R̂/G) min{sqrt(m) n ε / (T sqrt(d log²(mnd/δ))), T^{-3/4},
sqrt(nm)/T} (``algorithm.step_size``); τ = G log(n d m e^ε T / δ) / sqrt(m) (``estimator.tau``);
T = m²n² + mn sqrt(d) is infeasible here: ``train.rounds`` replaces it (both in summary.json).
The paper runs Algorithm 2 at δ/(2Tmnd) (for its utility proof); here Algorithm 2 is calibrated
at the run's (ε, δ) by the accountant (``privacy.accounting=certified``) or with its σ² read as
written (``paper``), the same estimator every other run uses.
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np

from fedudp.aggregators.outlier import OutlierRemovalAggregator
from fedudp.algorithms import Context, Requirements, Setup, register
from fedudp.algorithms.schedule import AlgorithmPlan, Phase
from fedudp.algorithms.smoothing import Smoothing
from fedudp.protocol.contributions import Sampling

__all__ = [
    "SEED",
    "REQUIRES",
    "paper_parameters",
    "phase",
    "smoothing",
    "setup",
]

SEED = "003_60e5b11bfa501c93.txt (Asi & Liu), Algorithm 3, Theorem 4.1"


REQUIRES = Requirements(methods=("full_dp", "joint_dp"), aggregator="outlier_removal")


def paper_parameters(
    n: int, m: int, d: int, eps: float, delta: float, G: float, R: float, T: int
) -> dict:
    """Theorem 4.1's r, η, τ for T steps, and the paper's T.

    Parameters
    ----------
    n, m, d : int
        Users, records per user, dimension.
    eps, delta : float
        The target (ε, δ).
    G, R : float
        The Lipschitz constant and the ball's radius.
    T : int
        The steps.

    Returns
    -------
    dict
        ``smoothing_radius``, ``step_size``, ``tau``, ``paper_T``.
    """
    logs = math.log(m * n * d / delta) ** 2
    eta = (R / G) * min(
        math.sqrt(m) * n * eps / (T * math.sqrt(d * logs)), T**-0.75, math.sqrt(n * m) / T
    )
    return {
        "smoothing_radius": d**0.25 * R / math.sqrt(T),
        "step_size": eta,
        "tau": G * (math.log(n * d * m * T / delta) + eps) / math.sqrt(m),
        "paper_T": m**2 * n**2 + m * n * math.sqrt(d),
    }


def phase(
    ctx: Context,
    n: int,
    R: float,
    T: int,
    units: np.ndarray | None = None,
    centre: str = "zero",
    reg: float = 0.0,
) -> tuple[Phase, dict]:
    """One run of Algorithm 3 on ``n`` users (``units``) for ``T`` steps from the phase's start,
    inside the ball of radius R around ``centre``.

    Parameters
    ----------
    ctx : Context
        The run's public values.
    n : int
        The phase's users.
    R : float
        The ball's radius.
    T : int
        The phase's steps.
    units : np.ndarray, optional
        The phase's fixed cohort (billboard unit ids; None: every unit).
    centre : str, default "zero"
        The ball's centre, ``"zero"`` or ``"start"``.
    reg : float, default 0.0
        λ of the public regulariser.

    Returns
    -------
    tuple[Phase, dict]
        The phase and its summary entry.
    """
    a = ctx.params
    G = a.lipschitz or ctx.bound
    p = paper_parameters(n, ctx.m, ctx.dim, ctx.epsilon, ctx.delta, G, R, T)
    tau = ctx.tau if ctx.tau is not None else p["tau"]
    agg = cast(
        OutlierRemovalAggregator, ctx.estimator("outlier_removal", Sampling(1.0, n), T, tau=tau)
    )
    eta = a.step_size or p["step_size"]
    info = {
        "users": n,
        "rounds": T,
        "tau": tau,
        "tau_paper": p["tau"],
        "step_size": eta,
        "step_size_paper": p["step_size"],
        "paper_T": p["paper_T"],
        "R": R,
        "noise_multiplier": agg.noise_multiplier,
        "sensitivity": agg.sensitivity,
        "min_users_required": agg.min_users_required,
    }
    return Phase(T, agg, eta, units=units, reg=reg, radius=R, ball_centre=centre), info


def smoothing(ctx: Context, R: float, T: int) -> float:
    """The smoothing radius: ``algorithm.smoothing_radius``, else Theorem 4.1's d^¼ R / √T.

    Parameters
    ----------
    ctx : Context
        The run's public values.
    R : float
        The ball's radius.
    T : int
        The steps.

    Returns
    -------
    float
    """
    a = ctx.params
    return (
        a.smoothing_radius if a.smoothing_radius is not None else ctx.dim**0.25 * R / math.sqrt(T)
    )


def setup(ctx: Context) -> Setup:
    """Asi & Liu's Algorithm 3 for this run (one phase, one AboveThreshold).

    Parameters
    ----------
    ctx : Context
        The run's public values.

    Returns
    -------
    Setup
    """
    a = ctx.params
    n, T, R = ctx.n_users, ctx.rounds, a.radius
    ph, info = phase(ctx, n, R, T)
    averaged = True if a.averaged is None else a.averaged
    plan = AlgorithmPlan([ph], n, averaged)
    r = smoothing(ctx, R, T)
    summary = {
        "seed": SEED,
        "configured_T": T,
        "smoothing_radius": r,
        "smoothing_radius_paper": ctx.dim**0.25 * R / math.sqrt(T),
        **info,
        "theorem_conditions": {"0<eps<10": 0 < ctx.epsilon < 10},
    }
    notes = [
        "asi_alg3: ONE AboveThreshold instance (budget ε/2, the one-off block) across all "
        "T queries; an AboveThreshold halt ends the run and returns θ_0",
        "randomized-smoothing perturbations are public randomness (seeded per round and user)",
    ]
    return Setup(
        ph.aggregator, plan, Sampling(1.0, n), summary, notes, owner_hooks=Smoothing(r, ctx.seed)
    )


register("asi_alg3", REQUIRES, setup)
