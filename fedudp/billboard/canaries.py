"""One-run empirical privacy estimate with random canary users (``audit.canaries=K``).

Andrew, Kairouz, Oh, Oprea, McMahan, Suriyakumar, "One-shot Empirical Privacy Estimation for
Federated Learning", ICLR 2024 (arXiv:2302.03098); docs/algorithms.md#one-run-canary-estimate.

K canary units join the population. Canary k's update is always ``C · c_k``, with c_k a fixed
random unit direction (Gaussian, normalised; seeded, not data). The billboard Poisson-samples
the canaries at the run's rate with its own keyed randomness and adds their updates to the
cohort's contribution before the release. With rows, it adds one row each; with sums, it adds to
the sum and the count. So every canary is treated exactly like a user whose clipped update has
norm C. Canaries hold no records and have no owner, so the accuracy the run reports is the real
owners' alone.

At the end, with Δ = (final shared vector) − (initial shared vector), each canary's cosine
cos(c_k, Δ) is a sample from the "observed" distribution, fitted with N(μ̂, σ̂²). A random
direction that was never inserted has cosine about N(0, 1/d) with Δ in d dimensions: the "null"
distribution, used analytically as the paper does. The estimate is the ε at δ of the pair
N(0, 1/d) against N(μ̂, σ̂²), two Gaussians with different variances, computed exactly
(:func:`two_gaussian_epsilon`). This is the paper's final-model variant; its all-iterates variant
(max over rounds against unseen canaries) is not built. The 95 % interval is ε over a
normal-theory confidence region of (μ, σ), with a bootstrap over the canaries beside it. The
estimate is for an adversary who sees only the final model. For a correct mechanism it is
expected at or below the ledger's ε, which bounds every iterate. It is an estimate, not a bound,
and is reported as such (``canary_epsilon_estimate``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from numpy.typing import ArrayLike
from scipy.stats import norm

from fedudp.protocol.contributions import Contribution
from fedudp.randomness import Purpose, numpy_rng

__all__ = [
    "Canaries",
    "ESTIMATOR",
    "KIND",
    "andrew_estimate",
    "region_interval",
    "hockey_stick",
    "two_gaussian_epsilon",
    "simulated_release",
]

_BOOTSTRAP = 1000
_LEVEL = 0.95


class Canaries:
    """``count`` canary units in a ``dim``-dimensional release, sampled at ``rate``.

    Parameters
    ----------
    count : int
        How many canary units (K, at least 2).
    dim : int
        The dimension of the released shared vector.
    rate : float
        Their Poisson sampling rate per round (the run's).
    seed : int
        The seed that keys their directions and their sample.

    Raises
    ------
    ValueError
        When ``count`` < 2.
    """

    def __init__(self, count: int, dim: int, rate: float, seed: int) -> None:
        if count < 2:
            raise ValueError(f"audit.canaries must be 0 (off) or >= 2, got {count}")
        self.count, self.dim, self.rate, self.seed = int(count), int(dim), float(rate), int(seed)

    def direction(self, k: int) -> np.ndarray:
        """c_k: a unit vector in float64, the same every time (keyed by the seed and k)."""
        v = numpy_rng(self.seed, Purpose.CANARY, k).standard_normal(self.dim)
        return v / np.linalg.norm(v)

    def sampled(self, round_: int) -> np.ndarray:
        """The canaries in round ``round_``'s cohort (Poisson at the run's rate, own keys)."""
        if self.rate >= 1.0:
            return np.arange(self.count)
        draw = numpy_rng(self.seed, Purpose.CANARY_SAMPLE, round_).random(self.count)
        return np.flatnonzero(draw < self.rate)

    def add(
        self, c: Contribution, round_: int, clip: float, rows: bool
    ) -> tuple[Contribution, int]:
        """``c`` with this round's sampled canaries' updates ``clip · c_k`` added, and how many."""
        ks = self.sampled(round_)
        if not len(ks):
            return c, 0
        V = torch.from_numpy(np.stack([clip * self.direction(int(k)) for k in ks]))
        if rows:
            base = c.rows if c.rows is not None else torch.zeros(0, self.dim)
            return Contribution(
                torch.cat([base, V.to(base.device, base.dtype)]), None, c.count + len(ks), c.clipped
            ), len(ks)
        assert c.total is not None  # not rows: the clipped sum
        total = c.total + V.sum(0).to(c.total.device, c.total.dtype)
        weight = None if c.weight is None else c.weight + len(ks)
        return Contribution(None, total, c.count + len(ks), c.clipped, weight), len(ks)

    def cosines(self, delta_u: torch.Tensor) -> np.ndarray:
        """cos(c_k, Δ) for every canary, in float64."""
        d = delta_u.detach().to(torch.float64).numpy()
        norm = float(np.linalg.norm(d))
        if norm == 0.0:
            return np.zeros(self.count)
        return np.array([float(self.direction(k) @ d) / norm for k in range(self.count)])

    def estimate(self, delta_u: torch.Tensor, delta: float, seed: int | None = None) -> dict:
        """The one-run estimate at ``delta`` from the final update Δ (module doc): the summary's
        ``canary_epsilon_estimate``, with ``canaries`` (K) beside it."""
        rng = np.random.default_rng(self.seed if seed is None else seed)
        return {
            "canaries": self.count,
            "canary_epsilon_estimate": andrew_estimate(self.cosines(delta_u), self.dim, delta, rng),
        }


ESTIMATOR = "Andrew et al. 2024 one-shot, final model (null N(0,1/d))"
KIND = "estimate, not a bound"


def andrew_estimate(
    cos: np.ndarray,
    dim: int,
    delta: float,
    rng: np.random.Generator | None = None,
    bootstrap: int = _BOOTSTRAP,
    level: float = _LEVEL,
) -> dict:
    """Andrew et al.'s one-shot estimate from the inserted canaries' cosines with the final
    model delta: μ̂, σ̂ of the cosines (σ̂ with ddof=1), the null N(0, 1/d) of a never-inserted
    direction, ε̂ = :func:`two_gaussian_epsilon` of the null against N(μ̂, σ̂²) at ``delta``.
    Two intervals at ``level``: ``ci``, ε's range over a normal-theory confidence region of
    (μ, σ) (:func:`region_interval`), and ``ci_bootstrap``, the percentile interval of
    ``bootstrap`` resamples of the canaries (each refits μ̂, σ̂ and recomputes ε̂). ε̂ is
    smallest where σ̂ equals the null's 1/√d, so noise in σ̂ pushes ε̂ and every resample up:
    the bootstrap interval sits above the truth more often than its level says (measured in
    docs/results/privacy_audit/canaries.md); ``ci`` is the one reported. An estimate, not a
    bound.

    Parameters
    ----------
    cos : np.ndarray
        The inserted canaries' cosines with the final Δ, shape ``[K]``.
    dim : int
        The dimension d of Δ (the null is N(0, 1/d)).
    delta : float
        The δ of the estimate.
    rng : np.random.Generator, optional
        The bootstrap's randomness (default seed 0).
    bootstrap : int, default 1000
        How many bootstrap resamples.
    level : float, default 0.95
        The intervals' confidence level.

    Returns
    -------
    dict
        ``value`` (ε̂, None without spread), ``ci``, ``ci_bootstrap``, the fit and its labels.

    Raises
    ------
    ValueError
        When ``cos`` is not one-dimensional with at least 2 entries.
    """
    cos = np.asarray(cos, dtype=np.float64)
    if cos.ndim != 1 or len(cos) < 2:
        raise ValueError(f"need the cosines of at least 2 canaries, got shape {cos.shape}")
    null_std = 1.0 / math.sqrt(dim)
    mu, sd = float(cos.mean()), float(cos.std(ddof=1))
    out: dict[str, Any] = {
        "value": None,
        "ci": None,
        "ci_method": "normal-theory region for (mu, sigma), Bonferroni",
        "level": level,
        "ci_bootstrap": None,
        "bootstrap": int(bootstrap),
        "estimator": ESTIMATOR,
        "kind": KIND,
        "threat_model": "final model only",
        "canaries": len(cos),
        "dim": int(dim),
        "delta": float(delta),
        "cosine_mean": mu,
        "cosine_std": sd,
        "null_std": null_std,
    }
    if not (sd > 0 and np.all(np.isfinite(cos))):  # e.g. Δ = 0: every cosine 0, nothing to fit
        out["note"] = "no estimate: the canaries' cosines have no spread (or are not finite)"
        return out
    out["value"] = float(two_gaussian_epsilon(0.0, null_std, mu, sd, delta))
    out["ci"] = region_interval(mu, sd, len(cos), dim, delta, level)
    rng = np.random.default_rng(0) if rng is None else rng
    idx = rng.integers(0, len(cos), (bootstrap, len(cos)))
    m, v = cos[idx].mean(1), cos[idx].std(1, ddof=1)
    keep = v > 0  # a resample of one repeated canary has none
    boot = two_gaussian_epsilon(0.0, null_std, m[keep], v[keep], delta)
    out["ci_bootstrap"] = [float(x) for x in np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])]
    return out


def region_interval(
    mu: float, sd: float, n: int, dim: int, delta: float, level: float = _LEVEL, grid: int = 41
) -> list[float]:
    """ε's [min, max] over a ``level`` confidence region of the observed cosines' (μ, σ) from
    ``n`` canaries, assuming they are Gaussian (the paper's model): a Bonferroni rectangle of
    Student's t interval for μ and the χ² interval for σ, each at 1 − (1 − level)/2, on a
    ``grid`` × ``grid`` lattice (its corners, edges and, where the rectangle holds them, μ = 0
    and σ = 1/√d, where ε is smallest).

    Parameters
    ----------
    mu, sd : float
        The observed cosines' mean and standard deviation.
    n : int
        How many canaries.
    dim : int
        The dimension d (the null's standard deviation is 1/√d).
    delta : float
        The δ of ε.
    level : float, default 0.95
        The region's confidence level.
    grid : int, default 41
        The lattice's points per side.

    Returns
    -------
    list[float]
        ``[min, max]`` of ε over the region.
    """
    from scipy.stats import chi2
    from scipy.stats import t as student_t

    a = (1 - level) / 2  # each of the two intervals
    half = student_t.ppf(1 - a / 2, n - 1) * sd / math.sqrt(n)
    s_lo = sd * math.sqrt((n - 1) / chi2.ppf(1 - a / 2, n - 1))
    s_hi = sd * math.sqrt((n - 1) / chi2.ppf(a / 2, n - 1))
    null_std = 1.0 / math.sqrt(dim)
    mus = np.linspace(mu - half, mu + half, grid)
    sds = np.linspace(s_lo, s_hi, grid)
    if mus[0] < 0 < mus[-1]:
        mus = np.append(mus, 0.0)
    if s_lo < null_std < s_hi:
        sds = np.append(sds, null_std)
    M, S = np.meshgrid(mus, sds)
    eps = np.asarray(two_gaussian_epsilon(0.0, null_std, M.ravel(), S.ravel(), delta))
    return [float(eps.min()), float(eps.max())]


def _mass(lo, hi, m, s):
    """N(m, s²)'s mass on [lo, hi] (lo may be -inf, hi +inf), elementwise, in float64; the
    tail that keeps precision (upper tail from sf, lower from cdf)."""
    a, b = (lo - m) / s, (hi - m) / s
    upper = norm.sf(a) - norm.sf(b)  # precise when both are above the mean
    lower = norm.cdf(b) - norm.cdf(a)  # precise when both are below it
    return np.clip(np.where(a > 0, upper, lower), 0.0, 1.0)


def hockey_stick(m1, s1, m2, s2, eps):
    """δ_{P‖Q}(ε) = P[L > ε] − e^ε Q[L > ε] for P = N(m1, s1²), Q = N(m2, s2²) with the privacy
    loss L(x) = log p(x)/q(x) = a x² + b x + c (exact, float64, elementwise over arrays).
    {L > ε} is a half-line (equal variances), the outside of two roots (a > 0) or the inside
    (a < 0).

    Parameters
    ----------
    m1, s1, m2, s2 : array_like
        Means and standard deviations of P and Q (broadcast together).
    eps : array_like
        The ε at which δ is evaluated.

    Returns
    -------
    np.ndarray
        δ_{P‖Q}(ε), clipped at 0, in float64.
    """
    m1, s1, m2, s2, eps = np.broadcast_arrays(
        *(np.asarray(v, dtype=np.float64) for v in (m1, s1, m2, s2, eps))
    )
    a = 0.5 / s2**2 - 0.5 / s1**2
    b = m1 / s1**2 - m2 / s2**2
    c = np.log(s2 / s1) - 0.5 * (m1 / s1) ** 2 + 0.5 * (m2 / s2) ** 2
    inf = np.full(a.shape, np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        # equal variances: b x + c > ε
        t = (eps - c) / b
        lin_lo = np.where(b > 0, t, -inf)
        lin_hi = np.where(b > 0, inf, t)
        disc = b**2 - 4 * a * (c - eps)
        # the roots of a x² + b x + (c − ε), in the form without cancellation when a is small
        qq = -0.5 * (b + np.where(b >= 0, 1.0, -1.0) * np.sqrt(np.maximum(disc, 0.0)))
        r1, r2 = qq / a, (c - eps) / qq
        left, right = np.minimum(r1, r2), np.maximum(r1, r2)
    equal = a == 0
    # a < 0: inside the roots (empty when disc <= 0)
    p_in = np.where(disc > 0, _mass(left, right, m1, s1), 0.0)
    q_in = np.where(disc > 0, _mass(left, right, m2, s2), 0.0)
    # a > 0: outside the roots (everything when disc <= 0)
    p_out = np.where(disc > 0, _mass(-inf, left, m1, s1) + _mass(right, inf, m1, s1), 1.0)
    q_out = np.where(disc > 0, _mass(-inf, left, m2, s2) + _mass(right, inf, m2, s2), 1.0)
    p = np.where(
        equal,
        np.where(b == 0, (c > eps).astype(float), _mass(lin_lo, lin_hi, m1, s1)),
        np.where(a > 0, p_out, p_in),
    )
    q = np.where(
        equal,
        np.where(b == 0, (c > eps).astype(float), _mass(lin_lo, lin_hi, m2, s2)),
        np.where(a > 0, q_out, q_in),
    )
    with np.errstate(divide="ignore", over="ignore"):  # q = 0: e^ε q = 0; overflow: δ < 0
        return np.maximum(p - np.exp(eps + np.log(q)), 0.0)


def two_gaussian_epsilon(
    m1: ArrayLike, s1: ArrayLike, m2: ArrayLike, s2: ArrayLike, delta: float, tol: float = 1e-10
) -> np.ndarray | float:
    """The smallest ε ≥ 0 with max(δ_{P‖Q}(ε), δ_{Q‖P}(ε)) ≤ δ for P = N(m1, s1²),
    Q = N(m2, s2²): the pair's tight (ε, δ), both directions (elementwise over arrays of the
    parameters; bisection on the non-increasing δ(ε) to ``tol``). The variances may differ,
    where the privacy loss is unbounded and every ε has a δ > 0. Not accounting: fedudp uses it
    only for the canary estimate.

    Parameters
    ----------
    m1, s1, m2, s2 : array_like
        Means and standard deviations of P and Q (broadcast together; deviations positive).
    delta : float
        The δ, in (0, 1).
    tol : float, default 1e-10
        The bisection's relative tolerance.

    Returns
    -------
    np.ndarray or float
        The smallest ε, a float for scalar parameters.

    Raises
    ------
    ValueError
        When ``delta`` is outside (0, 1), a deviation is not positive or a parameter not finite.
    """
    args = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (m1, s1, m2, s2)))
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if np.any(args[1] <= 0) or np.any(args[3] <= 0) or not np.all(np.isfinite(args)):
        raise ValueError(
            "two_gaussian_epsilon: the standard deviations must be positive and "
            "every parameter finite"
        )

    def over(eps):  # the pair is not (ε, δ)-DP
        return (
            np.maximum(
                hockey_stick(args[0], args[1], args[2], args[3], eps),
                hockey_stick(args[2], args[3], args[0], args[1], eps),
            )
            > delta
        )

    lo = np.zeros(args[0].shape)
    hi = np.ones(args[0].shape)
    for _ in range(200):  # an upper end: δ(ε) → 0 as ε → ∞
        up = over(hi)
        if not up.any():
            break
        lo, hi = np.where(up, hi, lo), np.where(up, 2 * hi, hi)
    for _ in range(200):
        if np.all(hi - lo <= tol * np.maximum(1.0, hi)):
            break
        mid = 0.5 * (lo + hi)
        up = over(mid)
        lo, hi = np.where(up, mid, lo), np.where(up, hi, mid)
    out = np.where(over(np.zeros(args[0].shape)), hi, 0.0)
    return out if out.ndim else float(out)


def simulated_release(
    canaries: Canaries,
    noise_multiplier: float,
    rounds: int,
    rng: np.random.Generator,
    clip: float = 1.0,
    others: int = 0,
) -> torch.Tensor:
    """Δ of a d-dimensional Gaussian mechanism with the canaries inserted, where the truth is
    known (the estimate's validation): each round releases the sum of ``others`` random
    vectors of norm ``clip`` (stand-ins for real users), the round's sampled canaries'
    ``clip · c_k`` and N(0, (z·clip)²) noise in every coordinate, float64; Δ is the sum over
    ``rounds``. With the canaries' rate 1 the final Δ is a Gaussian mechanism whose ε is that
    of ``rounds`` Gaussian releases at noise multiplier z (dp-accounting composes them).

    Parameters
    ----------
    canaries : Canaries
        The inserted canaries (their dimension and rate).
    noise_multiplier : float
        z: the noise's standard deviation is ``z · clip``.
    rounds : int
        How many releases are summed.
    rng : np.random.Generator
        The stand-in users' and the noise's randomness.
    clip : float, default 1.0
        The norm of every update.
    others : int, default 0
        Stand-in users per round.

    Returns
    -------
    torch.Tensor
        Δ, shape ``[d]``, float64.
    """
    d = canaries.dim
    total = torch.zeros(d, dtype=torch.float64)
    # a sequence of simulated releases of one mechanism (no training: the run's round loop is
    # billboard/rounds.py's); release i is keyed like round i + 1 for the canaries' sample
    for release in range(rounds):
        c, _ = canaries.add(
            Contribution(None, total.new_zeros(d), 0, 0), release + 1, clip, rows=False
        )
        assert c.total is not None  # rows=False: the clipped sum
        step = c.total.numpy().copy()
        if others:
            g = rng.standard_normal((others, d))
            step += clip * (g / np.linalg.norm(g, axis=1, keepdims=True)).sum(0)
        step += rng.normal(0.0, noise_multiplier * clip, d)
        total += torch.from_numpy(step)
    return total
