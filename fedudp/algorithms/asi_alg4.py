"""Asi & Liu (seed 003_60e5b11bfa501c93.txt), §4.1 Algorithm 4: localization for μ-strongly
convex losses (Theorem 4.11; per-phase parameters from App. B.4,
docs/algorithms.md#asi-and-liu-algorithm-4).

    k = ceil(log log(mn)) phases (``algorithm.phases``); disjoint users D_1..D_k (a public random
    split), |D_i| = n_i = floor(n / 2^{k+1-i})
    θ_i = Algorithm3(D_i, ε, δ, θ_{i-1}, r_i, T_i, η_i, τ_i, R̂_i), i = 1..k;  return θ_k

    E_i = (4C²G²/μ)(1/(n_i m) + d log²(n_i d m/δ)/(n_i² ε² m)),  C = 1 (Thm 4.1's constant)
    D_i = 16 E_i (2G²/(μ 16 E_0))^{1/2^i},  R̂_1 = 2G/μ,  R̂_i = sqrt(2 D_{i-1}/μ)
    r_i, η_i, τ_i: Theorem 4.1 with n_i and R̂_i (``fedudp.algorithms.asi_alg3``); phase i
    projects on the ball of radius R̂_i around θ_{i-1}.

The loss is made μ-strongly convex by the public regulariser (μ/2)||θ||² (``algorithm.
strong_convexity``), whose gradient μθ the billboard adds to every released mean. Each phase has
its own Algorithm 2 instance (one AboveThreshold per phase, on that phase's users); phases use
disjoint users, so they compose in PARALLEL (a ``Parallel`` event, one part per phase).
``train.rounds`` is split evenly over the phases (the paper's T_i = m²n_i² + m n_i sqrt(d) is
recorded per phase).
"""

from __future__ import annotations

import math

from fedudp.algorithms import (
    Context,
    Requirements,
    Setup,
    need,
    public_permutation,
    register,
    split_rounds,
)
from fedudp.algorithms.asi_alg3 import phase, smoothing
from fedudp.algorithms.schedule import AlgorithmPlan
from fedudp.algorithms.smoothing import Smoothing
from fedudp.protocol.contributions import Sampling

__all__ = [
    "SEED",
    "REQUIRES",
    "phase_sizes",
    "radii",
    "setup",
]

SEED = "003_60e5b11bfa501c93.txt (Asi & Liu), Algorithm 4, Theorem 4.11, App. B.4"


REQUIRES = Requirements(methods=("full_dp", "joint_dp"), aggregator="outlier_removal")


def phase_sizes(n: int, m: int, phases: int | None = None) -> list[int]:
    """The phases' users n_i = n / 2^(k+1-i), k = ``phases`` or ⌈log log(mn)⌉.

    Parameters
    ----------
    n, m : int
        Users and records per user.
    phases : int, optional
        k (None: the paper's).

    Returns
    -------
    list[int]
    """
    k = phases or max(1, math.ceil(math.log(max(math.log(m * n), 1.0 + 1e-12))))
    return [n // 2 ** (k + 1 - i) for i in range(1, k + 1)]


def radii(
    sizes: list[int], n: int, m: int, d: int, eps: float, delta: float, G: float, mu: float
) -> list[float]:
    """R̂_1 = 2G/μ, R̂_i = sqrt(2 D_{i-1}/μ) (App. B.4 with C = 1).

    Parameters
    ----------
    sizes : list[int]
        The phases' users.
    n, m, d : int
        Users, records per user, dimension.
    eps, delta : float
        The target (ε, δ).
    G, mu : float
        The Lipschitz constant and the strong convexity μ.

    Returns
    -------
    list[float]
        Each phase's radius.
    """

    def E(ni: float) -> float:
        return (4 * G**2 / mu) * (
            1 / (ni * m) + d * math.log(ni * d * m / delta) ** 2 / (ni**2 * eps**2 * m)
        )

    k = len(sizes)
    e0 = E(max(n / 2 ** (k + 1), 1.0))
    D = [
        16 * E(ni) * (2 * G**2 / (mu * 16 * e0)) ** (1 / 2 ** (i + 1)) for i, ni in enumerate(sizes)
    ]
    return [2 * G / mu] + [math.sqrt(2 * D[i - 1] / mu) for i in range(1, k)]


def setup(ctx: Context) -> Setup:
    """Asi & Liu's Algorithm 4 for this run (phases of Alg. 3 on disjoint users).

    Parameters
    ----------
    ctx : Context
        The run's public values.

    Returns
    -------
    Setup

    Raises
    ------
    ParameterError
        When a phase would have no user, or the rounds cannot be split over the phases.
    """
    a = ctx.params
    n, m, d, mu = ctx.n_users, ctx.m, ctx.dim, a.strong_convexity
    G = a.lipschitz or ctx.bound
    sizes = phase_sizes(n, m, a.phases)
    need(min(sizes) >= 1, "phases", f"{len(sizes)} phases leave a phase with no user of n={n}")
    rounds = split_rounds(ctx.rounds, len(sizes))
    Rs = radii(sizes, n, m, d, ctx.epsilon, ctx.delta, G, mu)
    perm = public_permutation(ctx.seed, n)
    phases, info, start = [], [], 0
    for i, (ni, Ti, Ri) in enumerate(zip(sizes, rounds, Rs)):
        ph, inf = phase(
            ctx,
            ni,
            Ri,
            Ti,
            units=perm[start : start + ni],
            centre="zero" if i == 0 else "start",
            reg=mu,
        )
        start += ni
        phases.append(ph)
        info.append({"phase": i + 1, **inf})
    averaged = True if a.averaged is None else a.averaged
    plan = AlgorithmPlan(phases, n, averaged)
    # one smoothing radius for the run (the owners' hook); Thm 4.1's r for the first phase
    r = smoothing(ctx, Rs[0], rounds[0])
    summary = {
        "seed": SEED,
        "phases": len(sizes),
        "phase_users": sizes,
        "mu": mu,
        "G": G,
        "smoothing_radius": r,
        "configured_T": ctx.rounds,
        "paper_T": sum(p["paper_T"] for p in info),
        "phase_detail": info,
        "theorem_conditions": {
            "n>log(mdn)log(mdn/delta)/eps": n
            > math.log(m * d * n) * math.log(m * d * n / ctx.delta) / ctx.epsilon
        },
        "users_unused": n - start,
    }
    notes = [
        f"asi_alg4: {len(sizes)} phases on disjoint users ({sizes} of n={n}), each a run of "
        "Alg. 3 with its own AboveThreshold: composed in PARALLEL (one Parallel part per "
        "phase; the run's epsilon is the worst phase's)",
        "the regulariser gradient μθ is public: added by the billboard, post-processing",
    ]
    return Setup(
        phases[0].aggregator,
        plan,
        Sampling(1.0, n),
        summary,
        notes,
        owner_hooks=Smoothing(r, ctx.seed),
    )


register("asi_alg4", REQUIRES, setup)
