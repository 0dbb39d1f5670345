"""Statistical privacy audits: run a mechanism on two neighbouring datasets many times and
lower-bound its ε from the best threshold test (Clopper-Pearson, Bonferroni over thresholds).
The lower bound must not exceed the accountant's ε (a violation means the released noise is
smaller than the ledger claims), and must come reasonably close to it (the noise is not
secretly larger than calibrated, so the bound is meaningful).

Each coordinate of one call is an independent instance of the scalar mechanism (the noise is
i.i.d. per coordinate and the estimators treat coordinates alike), so one call with d = 200,000
coordinates gives 200,000 draws."""
from __future__ import annotations

import math

import dp_accounting
import numpy as np
import torch
from scipy.stats import beta

from fedudp.aggregators import Contribution, GaussianAggregator, Sampling
from fedudp.aggregators.winsorized import winsorized_mean_1d
from fedudp.privacy.accountant import Accountant, calibrate_noise_multiplier

DRAWS = 200_000


def epsilon_lower_bound(on_d: np.ndarray, on_dprime: np.ndarray, delta: float,
                        alpha: float = 0.01, thresholds: int = 60) -> float:
    """Largest ε consistent (w.p. 1-α) with the rejection region {x > t}, over t and both sides."""
    qs = np.quantile(np.concatenate([on_d, on_dprime]), np.linspace(0.02, 0.98, thresholds))
    a = alpha / (2 * thresholds)
    best = 0.0
    for x, y in ((on_d, on_dprime), (on_dprime, on_d)):
        for t in qs:
            k1, n1 = int((x > t).sum()), len(x)        # P[M(x-side) in S] lower bound
            k2, n2 = int((y > t).sum()), len(y)        # P[M(y-side) in S] upper bound
            p1 = beta.ppf(a, k1, n1 - k1 + 1) if k1 > 0 else 0.0
            p2 = beta.ppf(1 - a, k2 + 1, n2 - k2) if k2 < n2 else 1.0
            if p1 - delta > 0 and p2 > 0:
                best = max(best, math.log((p1 - delta) / p2))
    return best


def test_gaussian_release_audit_matches_accountant():
    """clip+Gaussian billboard: D has one more user at the clip boundary than D'."""
    C, n, delta = 1.0, 100, 1e-5
    z = calibrate_noise_multiplier(lambda s: dp_accounting.GaussianDpEvent(s), 1.0, delta, 1)
    agg = GaussianAggregator(C, z, Sampling(1.0, n))
    acc = Accountant()
    acc.compose(agg.dp_event())
    eps = acc.epsilon(delta)
    base = torch.full((DRAWS,), 3.0, dtype=torch.float64)          # the other users' clipped sum
    with_user = agg.release(Contribution(None, base + C, n), rng=torch.Generator().manual_seed(1)).mean.numpy()
    without = agg.release(Contribution(None, base, n - 1), rng=torch.Generator().manual_seed(2)).mean.numpy()
    lb = epsilon_lower_bound(with_user, without, delta)
    assert lb <= eps, (lb, eps)
    assert lb >= 0.4 * eps, (lb, eps)          # 2e5 draws resolve tails down to ~1e-4


def test_gaussian_release_audit_catches_half_noise():
    """The audit has teeth: the same release with half the claimed noise violates the ledger."""
    C, n, delta = 1.0, 100, 1e-5
    z = calibrate_noise_multiplier(lambda s: dp_accounting.GaussianDpEvent(s), 1.0, delta, 1)
    acc = Accountant()
    acc.compose(dp_accounting.GaussianDpEvent(z))
    bad = GaussianAggregator(C, z / 2, Sampling(1.0, n))
    base = torch.zeros(DRAWS, dtype=torch.float64)
    a = bad.release(Contribution(None, base + C, n), rng=torch.Generator().manual_seed(1)).mean.numpy()
    b = bad.release(Contribution(None, base, n - 1), rng=torch.Generator().manual_seed(2)).mean.numpy()
    assert epsilon_lower_bound(a, b, delta) > acc.epsilon(delta)


def test_winsorized_mean_1d_audit_against_its_epsilon():
    """WinsorizedMean1D (PrivateRange + Laplace), replace-one: each column an instance."""
    n, eps, tau, B = 40, 1.0, 0.05, 1.0
    g = torch.Generator().manual_seed(0)
    col = 0.2 + tau * (2 * torch.rand(n, generator=g, dtype=torch.float64) - 1)
    X = col[:, None].expand(n, DRAWS).clone()
    Y = X.clone()
    Y[0] = -B                                                        # adversarial replacement
    a, _ = winsorized_mean_1d(X, tau, B, eps, rng=torch.Generator().manual_seed(1))
    b, _ = winsorized_mean_1d(Y, tau, B, eps, rng=torch.Generator().manual_seed(2))
    lb = epsilon_lower_bound(a.numpy(), b.numpy(), 0.0)
    assert lb <= eps, lb
    assert lb >= 0.3 * eps, lb
