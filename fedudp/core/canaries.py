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
cos(c_k, Δ) is a sample from the "observed" distribution. A random direction that was never
inserted has cosine about N(0, 1/d) with Δ in d dimensions: the null distribution, which the
paper uses analytically. The observed cosines are fitted with N(μ̂, σ̂²), and the estimate is the
ε at δ of telling N(0, σ̂²) from N(μ̂, σ̂²): a μ-GDP pair with μ = μ̂/σ̂, whose ε comes from
dp-accounting's Gaussian privacy loss distribution (``fedudp.privacy.audit_stats
.gaussian_epsilon``). The equal-variance form is used; the paper also allows unequal variances.
A 95 % interval comes from a bootstrap over the canaries. The estimate is for an adversary who
sees only the final model, so it is expected below the ledger's ε for a correct mechanism. It is
an estimate, not a bound, and is reported as such.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from fedudp.aggregators.base import Contribution
from fedudp.privacy.audit_stats import gaussian_epsilon
from fedudp.randomness import Purpose, numpy_rng

BOOTSTRAP = 1000
LEVEL = 0.95


class Canaries:
    """``count`` canary units in a ``dim``-dimensional release, sampled at ``rate``."""

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

    def add(self, c: Contribution, round_: int, clip: float, rows: bool
            ) -> tuple[Contribution, int]:
        """``c`` with this round's sampled canaries' updates ``clip · c_k`` added, and how many."""
        ks = self.sampled(round_)
        if not len(ks):
            return c, 0
        V = torch.from_numpy(np.stack([clip * self.direction(int(k)) for k in ks]))
        if rows:
            base = c.rows if c.rows is not None else torch.zeros(0, self.dim)
            return Contribution(torch.cat([base, V.to(base.dtype)]), None, c.count + len(ks),
                                c.clipped), len(ks)
        total = c.total + V.sum(0).to(c.total.dtype)
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
        """The one-run estimate at ``delta`` from the final update Δ (module doc)."""
        cos = self.cosines(delta_u)
        mu = gdp_mu(cos)
        # ε is increasing in μ: the bootstrap's μ quantiles give ε's (ε computed three times)
        rng = np.random.default_rng(self.seed if seed is None else seed)
        boot = [gdp_mu(cos[rng.integers(0, len(cos), len(cos))]) for _ in range(BOOTSTRAP)]
        lo, hi = np.quantile(boot, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
        return {"canaries": self.count, "canary_epsilon": gaussian_epsilon(mu, delta),
                "canary_epsilon_interval": [gaussian_epsilon(float(lo), delta),
                                            gaussian_epsilon(float(hi), delta)],
                "canary_level": LEVEL, "canary_mu": mu,
                "canary_cosine_mean": float(cos.mean()), "canary_cosine_std": float(cos.std(ddof=1)),
                "canary_null_std": 1.0 / math.sqrt(self.dim), "canary_delta": float(delta)}


def gdp_mu(cos: np.ndarray) -> float:
    """μ̂/σ̂ of the canaries' cosines (0 when the mean is not positive): the μ of the μ-GDP pair
    N(0, σ̂²) against N(μ̂, σ̂²)."""
    mu, sd = float(np.mean(cos)), float(np.std(cos, ddof=1))
    return mu / sd if sd > 0 and mu > 0 else 0.0


def epsilon_from_cosines(cos: np.ndarray, delta: float) -> float:
    """ε at δ of N(0, σ̂²) against N(μ̂, σ̂²), μ̂ and σ̂ the canaries' cosines' mean and std."""
    return gaussian_epsilon(gdp_mu(cos), delta)
