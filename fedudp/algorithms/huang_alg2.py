"""Huang et al. (seed 001_40594ba3d5609f29.txt), App. B Algorithm 2 (A_NSSGD, Theorem B.1,
Lemma B.4; docs/algorithms.md#huang-algorithm-2): the smooth case.

    per step t: owner j_t sampled; each of its r users k sends X_k = its mean gradient on the
        SHARED coordinates; g_t = WinsorizedMeanHighD({X_k}) (``aggregator=winsorized`` over the
        r users, public n = r); u <- Π_U(u - η g_t); x_{j_t} <- x_{j_t} - η (plain average of its
        records' personal gradients; the owner hook ``fedudp.algorithms.personal_step.PersonalStep``)
    return the averaged shared iterate

Owner sampling (``privacy.accounting``):
* ``certified``: exactly one owner per step, j_t ~ Unif[n] (public randomness). A user is
  touched only in its owner's steps; the winsorized estimator is calibrated for K = the largest
  number of steps any owner gets in the (public, data-independent) schedule, and the ledger
  composes each round's release in the part of the sampled owner (a ``Parallel`` event over the
  owners, ``NoOpDpEvent`` elsewhere): the run's ε is the worst owner's. No amplification is
  claimed: the release is computed on the whole sampled owner, so a sample without the user's
  owner is not close to one with it.
* ``paper``: owners Poisson-sampled at rate 1/n (the paper's amplification); each step's
  (ε_call, δ_call) release is amplified to (log(1 + (e^ε_call - 1)/n), δ_call/n) and the T
  steps compose by basic composition (``ApproxDp`` blocks), ε_call = log(1 + n(e^{ε/T} - 1)),
  δ_call = nδ/(2T); labelled heuristic (the amplification argument does not cover a release
  computed on a whole owner, see above).

τ (Lemma B.4): L sqrt(r/m) (sqrt(log(1/γ)) + sqrt(ℓ log(R H m/(ℓ L)))) (``estimator.tau``);
η = R/(L sqrt(T)) (not stated by the paper; ``algorithm.step_size``); the paper's
T = n²/log(1/δ) is recorded beside ``train.rounds``. Every owner must hold the same number r of
users (public n of the estimator).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import dp_accounting
import numpy as np

from fedudp.aggregators.winsorized import WinsorizedAggregator, winsorized_round_event
from fedudp.algorithms import Context, Requirements, Setup, register
from fedudp.algorithms.personal_step import PersonalStep
from fedudp.algorithms.schedule import AlgorithmPlan, Phase
from fedudp.privacy.accountant import ApproxDp, Parallel, calibrate_noise_multiplier
from fedudp.privacy.mechanisms import next_pow2
from fedudp.protocol.contributions import Sampling
from fedudp.randomness import Purpose, numpy_rng

__all__ = [
    "SEED",
    "REQUIRES",
    "lemma_b4_tau",
    "setup",
]

SEED = "001_40594ba3d5609f29.txt (Huang et al.), Algorithm 2, Theorem B.1, Lemma B.4"


REQUIRES = Requirements(methods=("joint_dp", "full_dp"), aggregator="winsorized", equal_owners=True)


def lemma_b4_tau(L: float, r: int, m: int, ell: int, R: float, H: float, gamma: float) -> float:
    """Lemma B.4's τ = L √(r/m) (√log(1/γ) + √(ℓ log max(R H m / (ℓ L), e))).

    Parameters
    ----------
    L, R, H : float
        Lipschitz constant, radius, smoothness.
    r, m, ell : int
        Users per owner, records per user, shared coordinates ℓ.
    gamma : float
        The failure probability γ.

    Returns
    -------
    float
    """
    return (
        L
        * math.sqrt(r / m)
        * (
            math.sqrt(math.log(1 / gamma))
            + math.sqrt(ell * math.log(max(R * H * m / (ell * L), math.e)))
        )
    )


def _paper_estimator(
    ctx: Context, tau: float, r: int, ell: int
) -> tuple[WinsorizedAggregator, Callable[[int], ApproxDp | Parallel], None]:
    """Paper mode: each step's release calibrated to the paper's amplified per-call budget,
    composed by basic composition (heuristic)."""
    n, eps, delta, T = ctx.n_owners, ctx.epsilon, ctx.delta, ctx.rounds
    eps_call = math.log1p(n * math.expm1(eps / T))
    delta_call = min(n * delta / (2 * T), 0.5)
    coords = next_pow2(ell)
    z = calibrate_noise_multiplier(
        lambda z: winsorized_round_event(1.0 / z, coords), eps_call, delta_call, 1
    )
    agg = WinsorizedAggregator(
        ell, tau, ctx.bound, 1.0 / z, Sampling(1.0, r), gamma=ctx.beta
    ).as_heuristic()
    block = ApproxDp(math.log1p(math.expm1(eps_call) / n), delta_call / n)

    def event_fn(round_: int) -> ApproxDp | Parallel:
        return block

    return agg, event_fn, None


def _certified_estimator(
    ctx: Context, owners_of: Callable[[int], np.ndarray], tau: float, r: int
) -> tuple[WinsorizedAggregator, Callable[[int], ApproxDp | Parallel], int]:
    """Certified mode: one owner per step; each release in that owner's part of a Parallel
    event, the estimator calibrated for the most steps any owner takes (``K``)."""
    n, T = ctx.n_owners, ctx.rounds
    counts = np.bincount([int(owners_of(t)[0]) for t in range(1, T + 1)], minlength=n)
    K = int(counts.max())
    agg = cast(WinsorizedAggregator, ctx.estimator("winsorized", Sampling(1.0, r), K, tau=tau))
    ev, noop = agg.dp_event(), dp_accounting.NoOpDpEvent()

    def event_fn(round_: int) -> ApproxDp | Parallel:
        j = int(owners_of(round_)[0])
        return Parallel(tuple(ev if i == j else noop for i in range(n)))

    return agg, event_fn, K


def _notes(paper: bool) -> list[str]:
    return [
        "huang_alg2: WinsorizedMeanHighD over the sampled owner's r users, on the SHARED "
        "coordinates only; personal blocks move without noise",
        (
            "paper mode: owners Poisson-sampled at 1/n, each step's release amplified by the "
            "paper's owner-subsampling claim and composed by basic composition: heuristic"
        )
        if paper
        else (
            "certified: one owner per step; each round's release composed in the sampled "
            "owner's part of a Parallel event (parallel composition over owners, no "
            "amplification claimed)"
        ),
    ]


def setup(ctx: Context) -> Setup:
    """Huang et al.'s Algorithm 2 for this run (``Context``: the run's plain values).

    Parameters
    ----------
    ctx
        The run's public values: owners, users per owner, dimension, rounds, (ε, δ), the
        algorithm's parameters, and the registered estimators.

    Returns
    -------
    Setup
        The winsorized estimator, the one-phase plan with its owner sampler and per-round
        events, the summary and notes, and the personal step as the owner hook.
    """
    a = ctx.params
    n, r, ell, T = ctx.n_owners, int(ctx.owner_users[0]), ctx.dim, ctx.rounds
    m_owner = r * ctx.m
    L = a.lipschitz or ctx.bound
    delta = ctx.delta
    paper = ctx.paper
    tau = (
        ctx.tau
        if ctx.tau is not None
        else lemma_b4_tau(L, r, m_owner, ell, a.radius, a.smoothness, ctx.beta)
    )
    offs = np.concatenate([[0], np.cumsum(ctx.owner_users)])
    seed, U = ctx.seed, ctx.n_users

    def owners_of(round_: int) -> np.ndarray:
        if paper:  # Poisson at 1/n
            return np.flatnonzero(numpy_rng(seed, Purpose.SAMPLE, round_).random(n) < 1.0 / n)
        return np.array([numpy_rng(seed, Purpose.SCHEDULE, round_).integers(n)])

    def sampler(round_: int) -> np.ndarray:
        mask = np.zeros(U, dtype=bool)
        for j in owners_of(round_):
            mask[offs[j] : offs[j + 1]] = True
        return mask

    agg, event_fn, K = (
        _paper_estimator(ctx, tau, r, ell)
        if paper
        else _certified_estimator(ctx, owners_of, tau, r)
    )
    eta = a.step_size or a.radius / (L * math.sqrt(T))
    averaged = True if a.averaged is None else a.averaged
    plan = AlgorithmPlan(
        [Phase(T, agg, eta, radius=a.radius)], U, averaged, sampler=sampler, event_fn=event_fn
    )
    summary = {
        "seed": SEED,
        "configured_T": T,
        "paper_T": n**2 / math.log(1 / delta),
        "owners": n,
        "users_per_owner": r,
        "tau": tau,
        "step_size": eta,
        "eps_coord": agg.eps_coord,
        "max_steps_per_owner": K,
        "owner_sampling": "Poisson at 1/n (amplified, heuristic)"
        if paper
        else "one owner per step, uniform; parallel composition over owners",
        "min_users_required": agg.min_users_required,
        "theorem_conditions": {"r>=min_users": r >= (agg.min_users_required or 0)},
    }
    return Setup(
        agg,
        plan,
        Sampling(1.0, U),
        summary,
        _notes(paper),
        owner_hooks=PersonalStep(eta, plan.cohort, seed),
    )


register("huang_alg2", REQUIRES, setup)
