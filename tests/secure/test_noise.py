"""The integer noise shares: the discrete Gaussian's pmf, mean and variance; Skellam's variance.

Goodness of fit: a chi-square test of ``N = 200,000`` draws against the exact pmf
``∝ exp(-x^2 / (2 sigma^2))`` over the support points whose expected count is at least 5 (the
tails pooled), at level ``alpha = 1e-3``. Its power is computed exactly (noncentral
chi-square, from the alternative's exact pmf) in :func:`test_power_is_stated` and the weakened
twins are run through the same test:

* the rounded continuous Gaussian ``round(N(0, sigma^2))`` (the usual wrong sampler): power
  above 0.999 at sigma = 0.5 (at sigma >= 3 the two pmfs differ by less than a test of this
  size sees: power 0.03 at sigma = 3);
* a sampler whose scale is 2 % short (``0.98 sigma``: too little noise): power above 0.99 at
  sigma = 3 and 20.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from fedudp.secure.noise import discrete_gaussian, noise_share, skellam

N = 200_000
ALPHA = 1e-3


def dg_pmf(sigma: float, support: np.ndarray) -> np.ndarray:
    span = np.arange(-int(40 * sigma) - 40, int(40 * sigma) + 41)
    w = np.exp(-(span.astype(float) ** 2) / (2 * sigma * sigma))
    return np.exp(-(support.astype(float) ** 2) / (2 * sigma * sigma)) / w.sum()


def rounded_gaussian_pmf(sigma: float, support: np.ndarray) -> np.ndarray:
    return stats.norm.cdf(support + 0.5, scale=sigma) - stats.norm.cdf(support - 0.5, scale=sigma)


def bins(sigma: float):
    """Support points with expected count >= 5 under the null; the rest pooled as two tails."""
    lim = int(40 * sigma) + 40
    xs = np.arange(-lim, lim + 1)
    p = dg_pmf(sigma, xs)
    inner = xs[p * N >= 5]
    return inner, xs


def binned(pmf, sigma):
    inner, xs = bins(sigma)
    p = pmf(sigma, xs)
    lo, hi = inner[0], inner[-1]
    return np.concatenate([[p[xs < lo].sum()], pmf(sigma, inner), [p[xs > hi].sum()]])


def counts(x: np.ndarray, sigma: float) -> np.ndarray:
    inner, _ = bins(sigma)
    lo, hi = inner[0], inner[-1]
    c = np.bincount(np.clip(x, lo - 1, hi + 1) - (lo - 1), minlength=len(inner) + 2)
    return c


def chi2_pvalue(x: np.ndarray, sigma: float) -> float:
    p0 = binned(dg_pmf, sigma)
    c = counts(x, sigma)
    keep = p0 * N > 0
    stat = float(np.sum((c[keep] - N * p0[keep]) ** 2 / (N * p0[keep])))
    return float(stats.chi2.sf(stat, df=int(keep.sum()) - 1))


def power(alt_pmf, sigma: float) -> float:
    p0, q = binned(dg_pmf, sigma), binned(alt_pmf, sigma)
    keep = p0 > 0
    df = int(keep.sum()) - 1
    lam = N * float(np.sum((q[keep] - p0[keep]) ** 2 / p0[keep]))
    return float(stats.ncx2.sf(stats.chi2.isf(ALPHA, df), df, lam))


def short_pmf(sigma, support):
    """The weakened twin's pmf: the discrete Gaussian of scale 0.98 sigma."""
    return dg_pmf(0.98 * sigma, support)


@pytest.mark.parametrize("sigma", [0.5, 3.0, 20.0])
def test_discrete_gaussian_fits_the_exact_pmf(sigma):
    x = discrete_gaussian(N, sigma, np.random.default_rng(int(sigma * 10)))
    assert x.dtype == np.int64 and x.shape == (N,)
    assert chi2_pvalue(x, sigma) > ALPHA
    var = float(np.sum(np.arange(-500, 501) ** 2 * dg_pmf(sigma, np.arange(-500, 501))))
    assert abs(x.mean()) < 5 * math.sqrt(var / N)
    assert abs(x.var() - var) < 5 * var * math.sqrt(2 / N) + 1e-3


def test_power_is_stated():
    assert power(rounded_gaussian_pmf, 0.5) > 0.999
    assert power(short_pmf, 3.0) > 0.99
    assert power(short_pmf, 20.0) > 0.99


@pytest.mark.parametrize("sigma", [0.5])
def test_the_rounded_gaussian_twin_is_caught(sigma):
    twin = np.rint(np.random.default_rng(1).normal(0, sigma, N)).astype(np.int64)
    assert chi2_pvalue(twin, sigma) < ALPHA


def test_the_short_scale_twin_is_caught():
    twin = discrete_gaussian(N, 0.98 * 20.0, np.random.default_rng(2))
    assert chi2_pvalue(twin, 20.0) < ALPHA


def test_skellam_variance_and_symmetry():
    for sigma in (1.0, 7.0):
        x = skellam(N, sigma, np.random.default_rng(3))
        assert x.dtype == np.int64
        assert abs(x.mean()) < 5 * sigma / math.sqrt(N)
        kurt = 3 + 1 / (sigma * sigma / 2) / 2  # Skellam(mu, mu): excess kurtosis 1/(2 mu)
        se = sigma * sigma * math.sqrt((kurt - 1) / N)
        assert abs(x.var() - sigma * sigma) < 5 * se


def test_zero_sigma_and_bad_input():
    rng = np.random.default_rng(0)
    for kind in ("ddgauss", "skellam"):
        z = noise_share(kind, (3, 4), 0.0, rng)
        assert z.shape == (3, 4) and z.dtype == np.int64 and not z.any()
        with pytest.raises(ValueError, match="sigma"):
            noise_share(kind, 3, -1.0, rng)
    with pytest.raises(ValueError, match="ddgauss, skellam"):
        noise_share("gauss", 3, 1.0, rng)
    assert noise_share("ddgauss", (2, 5), 4.0, rng).shape == (2, 5)
