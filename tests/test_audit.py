"""Statistical privacy audits: the shipped bounds of ``fedudp.privacy.audit_stats`` on samples of
mechanisms whose true ε is known (dp-accounting), each with a weakened twin the bound must catch.

Each coordinate of one release call is an independent instance of the scalar mechanism (the noise
is i.i.d. per coordinate and the estimators treat coordinates alike), so one call with
d = 200,000 coordinates gives 200,000 draws."""

from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
import torch

from fedudp.aggregators import Contribution, GaussianAggregator, Sampling
from fedudp.aggregators.winsorized import winsorized_mean_1d
from fedudp.privacy.accountant import Accountant, calibrate_noise_multiplier
from fedudp.privacy.audit_stats import (
    audit_samples,
    clopper_pearson,
    gaussian_epsilon,
    gaussian_fit,
    gaussian_mu_for_epsilon,
    power_gaussian,
    threshold_bound,
)

DRAWS = 200_000
DELTA = 1e-5


def _split(a, b):
    h = len(a) // 2
    return a[:h], b[:h], a[h:], b[h:]


def test_clopper_pearson_matches_the_textbook_interval():
    # the exact two-sided 95% interval for 5 of 10 is [0.1871, 0.8129]
    lo, hi = clopper_pearson(np.array([5]), 10, 0.025)
    assert lo[0] == pytest.approx(0.18709, abs=1e-4) and hi[0] == pytest.approx(0.81291, abs=1e-4)
    lo, hi = clopper_pearson(np.array([0, 10]), 10, 0.05)
    assert lo[0] == 0.0 and hi[1] == 1.0


def test_gaussian_epsilon_is_dp_accountings_gaussian_mechanism():
    # μ-GDP with μ = 1/σ: the optimistic PLD sits just below the accountant's pessimistic one
    for sigma in (1.0, 3.7314, 10.0):
        acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
        acc.compose(dp_accounting.GaussianDpEvent(sigma))
        pess = acc.get_epsilon(DELTA)
        assert gaussian_epsilon(1 / sigma, DELTA) <= pess + 1e-9
        assert gaussian_epsilon(1 / sigma, DELTA) == pytest.approx(pess, rel=2e-3)
    # literal constant: σ = 3.7314 is the Gaussian mechanism at ε = 1, δ = 1e-5
    assert gaussian_mu_for_epsilon(1.0, DELTA) == pytest.approx(1 / 3.7314, rel=1e-3)


def test_gaussian_release_audit_matches_accountant():
    """clip+Gaussian billboard: D has one more user at the clip boundary than D'."""
    C, n = 1.0, 100
    z = calibrate_noise_multiplier(lambda s: dp_accounting.GaussianDpEvent(s), 1.0, DELTA, 1)
    agg = GaussianAggregator(C, z, Sampling(1.0, n))
    acc = Accountant()
    acc.compose(agg.dp_event())
    eps = acc.epsilon(DELTA)
    base = torch.full((DRAWS,), 3.0, dtype=torch.float64)  # the other users' clipped sum
    with_user = agg.release(
        Contribution(None, base + C, n), rng=torch.Generator().manual_seed(1)
    ).mean.numpy()
    without = agg.release(
        Contribution(None, base, n - 1), rng=torch.Generator().manual_seed(2)
    ).mean.numpy()
    r = audit_samples(with_user, without, DELTA, gaussian=True)
    assert r.gaussian_used and r.lower_bound <= eps, r
    assert r.lower_bound >= 0.9 * eps, r  # the Gaussian-DP fit is near-tight
    lb, _ = threshold_bound(*_split(with_user, without), DELTA, 0.05)
    assert 0.3 * eps <= lb <= eps  # distribution-free: valid, weaker


@pytest.mark.parametrize("cut,caught", [(1.0, False), (0.7, True), (0.5, True)])
def test_gaussian_release_audit_catches_a_noise_cut(cut, caught):
    """The audit has teeth: 0.7 × the claimed noise is caught at 200,000 draws per side."""
    C, n = 1.0, 100
    z = calibrate_noise_multiplier(lambda s: dp_accounting.GaussianDpEvent(s), 1.0, DELTA, 1)
    acc = Accountant()
    acc.compose(dp_accounting.GaussianDpEvent(z))
    agg = GaussianAggregator(C, z * cut, Sampling(1.0, n))
    base = torch.zeros(DRAWS, dtype=torch.float64)
    a = agg.release(
        Contribution(None, base + C, n), rng=torch.Generator().manual_seed(3)
    ).mean.numpy()
    b = agg.release(
        Contribution(None, base, n - 1), rng=torch.Generator().manual_seed(4)
    ).mean.numpy()
    r = audit_samples(a, b, DELTA, gaussian=True)
    assert (r.lower_bound > acc.epsilon(DELTA)) == caught, r


def test_power_says_a_cut_to_0_7_is_detectable_at_200k():
    mu = gaussian_mu_for_epsilon(1.0, DELTA)
    f = power_gaussian(1.0, DELTA, mu, DRAWS, 0.05)
    assert 0.9 < f < 1.0
    assert power_gaussian(1.0, DELTA, mu, 2_000, 0.05) < f  # fewer releases, less power


def test_the_gaussian_fit_is_not_used_where_its_model_fails():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0, 1.0, 50_000), rng.normal(0, 1.3, 50_000)  # unequal variances
    assert not gaussian_fit(a, b, 0.05).model_ok
    mix = np.where(rng.random(50_000) < 0.5, rng.normal(0, 1, 50_000), rng.normal(4, 1, 50_000))
    assert not gaussian_fit(mix, rng.normal(size=50_000), 0.05).model_ok
    r = audit_samples(a, b, DELTA, gaussian=True)
    assert not r.gaussian_used and "variances differ" in r.notes[0]
    # ... while the distribution-free test still sees the spread change
    assert r.lower_bound > 0.2


def test_identical_distributions_give_small_bounds_over_seeds():
    for s in range(5):
        rng = np.random.default_rng(s)
        r = audit_samples(
            rng.normal(size=(40_000, 3)), rng.normal(size=(40_000, 3)), DELTA, gaussian=True
        )
        assert r.lower_bound < 0.1, (s, r.bounds)


def test_winsorized_mean_1d_audit_against_its_epsilon():
    """WinsorizedMean1D (PrivateRange + Laplace), replace-one: each column an instance."""
    n, eps, tau, B = 40, 1.0, 0.05, 1.0
    g = torch.Generator().manual_seed(0)
    col = 0.2 + tau * (2 * torch.rand(n, generator=g, dtype=torch.float64) - 1)
    X = col[:, None].expand(n, DRAWS).clone()
    Y = X.clone()
    Y[0] = -B  # adversarial replacement
    a, _ = winsorized_mean_1d(X, tau, B, eps, rng=torch.Generator().manual_seed(1))
    b, _ = winsorized_mean_1d(Y, tau, B, eps, rng=torch.Generator().manual_seed(2))
    lb, _ = threshold_bound(*_split(a.numpy(), b.numpy()), 0.0, 0.05)
    assert lb <= eps, lb
    assert lb >= 0.25 * eps, lb  # distribution-free, half the draws: far from tight
    # its twin with a quarter of the Laplace noise (ε times 4) exceeds the claim
    a2, _ = winsorized_mean_1d(X, tau, B, 4 * eps, rng=torch.Generator().manual_seed(1))
    b2, _ = winsorized_mean_1d(Y, tau, B, 4 * eps, rng=torch.Generator().manual_seed(2))
    lb2, _ = threshold_bound(*_split(a2.numpy(), b2.numpy()), 0.0, 0.05)
    assert lb2 > eps, lb2
