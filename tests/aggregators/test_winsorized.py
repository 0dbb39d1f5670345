"""Levy et al. winsorized mean (docs/algorithms.md#winsorized-mean): PrivateRange,
WinsorizedMean1D/HighD."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from scipy import stats

from conftest import tiny_cfg
from fedudp.aggregators import Sampling
from fedudp.build import estimator as build_aggregator
from fedudp.aggregators.private_range import private_range
from fedudp.aggregators.winsorized import winsorized_mean_1d, winsorized_sum, winsorized_round_event
from fedudp.privacy.accountant import schedule_epsilon


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def brute_scores(X: np.ndarray, tau: float, bound: float) -> np.ndarray:
    nb = math.ceil(bound / tau)
    b = np.clip(np.floor((X + bound) / (2 * tau)), 0, nb - 1)
    return np.array([max((b < k).sum(), (b > k).sum()) for k in range(nb)])


@settings(max_examples=40, deadline=None)
@given(
    X=st.lists(st.floats(-12, 12), min_size=2, max_size=15),
    new=st.floats(-12, 12),
    i=st.integers(0, 100),
)
def test_range_score_sensitivity_one(X, new, i):
    X = np.array(X)
    Y = X.copy()
    Y[i % len(X)] = new
    assert np.abs(brute_scores(X, 0.5, 10.0) - brute_scores(Y, 0.5, 10.0)).max() <= 1


def test_private_range_samples_the_exponential_mechanism():
    # the run-based sampler must match the brute-force distribution over all bins
    X = np.array([-3.1, -0.2, 0.1, 0.15, 0.4, 2.7, 2.8, 9.9])
    tau, bound, eps, k = 0.5, 5.0, 1.2, 60_000
    mu = private_range(torch.from_numpy(np.repeat(X[:, None], k, 1)), tau, bound, eps, rng=gen(1))
    bins = np.round((mu.numpy() + bound) / (2 * tau) - 0.5).astype(int)
    freq = np.bincount(bins, minlength=10) / k
    c = brute_scores(X, tau, bound)
    want = np.exp(-eps * c / 2) / np.exp(-eps * c / 2).sum()
    assert np.abs(freq - want).max() < 0.01


def test_private_range_never_materializes_bins():
    # B/τ = 1e12 bins: still instant, and the answer sits near the data
    X = torch.full((200, 3), 0.3, dtype=torch.float64) + 1e-3 * torch.randn(
        200, 3, generator=gen(2), dtype=torch.float64
    )
    mu = private_range(X, 1e-3, 1e9, 2.0, rng=gen(3))
    assert (mu - 0.3).abs().max() <= 4e-3


@settings(max_examples=60, deadline=None)
@given(
    X=st.lists(st.floats(-1e6, 1e6), min_size=2, max_size=20),
    new=st.floats(-1e9, 1e9),
    center=st.floats(-100, 100),
    h=st.floats(0.01, 10),
    i=st.integers(0, 100),
)
def test_winsorized_sum_sensitivity_replace_one(X, new, center, h, i):
    Xt = torch.tensor(X, dtype=torch.float64)[:, None]
    Yt = Xt.clone()
    Yt[i % len(X), 0] = new
    c = torch.tensor([center], dtype=torch.float64)
    a, _ = winsorized_sum(Xt, c, h)
    b, _ = winsorized_sum(Yt, c, h)
    # 2h exactly, up to float64 rounding of a sum of len(X) terms of size |center|+h
    rounding = 1e-13 * len(X) * (abs(center) + h)
    assert float((a - b).abs()) <= 2 * h + rounding


def test_1d_noise_is_the_calibrated_laplace():
    # concentrated data: output - mean ~ Lap(4hτ/(nε)) (KS over 20,000 independent columns)
    n, tau, eps, k = 400, 0.05, 1.0, 20_000
    X = 0.37 + 0.01 * torch.rand(n, k, generator=gen(4), dtype=torch.float64)
    out, diag = winsorized_mean_1d(X, tau, 10.0, eps, rng=gen(5))
    err = (out - X.mean(0)).numpy()
    scale = 4 * 2 * tau / (n * eps)
    assert diag["laplace_scale"] == pytest.approx(scale) and diag["clipped_fraction"] == 0.0
    assert stats.kstest(err, stats.laplace(scale=scale).cdf).pvalue > 1e-3


def test_1d_error_flat_in_B_unlike_range_laplace():
    n, tau, eps, k = 500, 0.02, 1.0, 4000
    X = 0.1 + tau * (torch.rand(n, k, generator=gen(6), dtype=torch.float64) - 0.5)
    rmse = []
    for B in (10 * tau, 1e2 * tau, 1e4 * tau):
        out, _ = winsorized_mean_1d(X, tau, B, eps, rng=gen(7))
        rmse.append(float(((out - X.mean(0)) ** 2).mean().sqrt()))
    assert max(rmse) / min(rmse) < 1.3  # flat in B
    assert rmse[-1] < (2 * 1e4 * tau / (n * eps)) / 20  # far below Lap(2B/(nε))'s sqrt(2)·2B/(nε)


def _users(n, d, m, rng, corrupt=0.0, far=50.0):
    """User averages of m samples of norm <= 1 around a common mean; a fraction corrupted."""
    mu = torch.full((d,), 0.3 / math.sqrt(d), dtype=torch.float64)
    Z = mu + (torch.rand(n, m, d, generator=rng, dtype=torch.float64) - 0.5) * (1.0 / math.sqrt(d))
    X = Z.mean(1)
    k = int(corrupt * n)
    if k:
        X[:k] = far / math.sqrt(d)
    return X, mu


def _agg(n, d, m, eps=2.0, delta=1e-6, rounds=1):
    cfg = tiny_cfg(
        "full_dp",
        aggregator="winsorized",
        **{"privacy.epsilon": eps, "privacy.delta": delta, "partition.records_per_user": m},
    )
    return build_aggregator(cfg, Sampling(1.0, n), rounds, d)


def test_highd_error_scales_with_tau_not_B():
    # user averages of m samples: tau ~ 1/sqrt(m), so the privacy error falls with m
    n, d = 20_000, 8
    errs = {}
    for m in (1, 16):
        agg = _agg(n, d, m)
        X, mu = _users(n, d, m, gen(8))
        e = [float(((agg(X, rng=gen(100 + s)).mean - X.mean(0)) ** 2).sum()) for s in range(5)]
        errs[m] = np.mean(e)
        assert agg.tau == pytest.approx(1.0 * math.sqrt(math.log(2 * n / 0.1) / (2 * m)))
    assert errs[16] < errs[1] / 6  # ideal ratio 16 (τ²); allow slack for the 1D bins


def test_highd_accounting_hits_target():
    n, d = 5000, 20
    agg = _agg(n, d, 4, eps=1.0, delta=1e-5, rounds=10)
    eps = schedule_epsilon(lambda z: winsorized_round_event(agg.eps_coord, agg.dp), 0.0, 10, 1e-5)
    assert eps == pytest.approx(1.0, rel=0.01) and eps <= 1.0 + 1e-9
    assert agg.dp == 32 and agg.adjacency == "replace_one"


def test_highd_dragged_by_far_corrupted_users_and_min_users_warning():
    n, d = 20_000, 8
    agg = _agg(n, d, 16)
    clean, mu = _users(n, d, 16, gen(9))
    bad, _ = _users(n, d, 16, gen(9), corrupt=0.3)
    e_clean = float(((agg(clean, rng=gen(10)).mean - mu) ** 2).sum())
    out = agg(bad, rng=gen(10))
    e_bad = float(((out.mean - mu) ** 2).sum())
    assert e_bad > 10 * e_clean  # winsorizing at a 30% outlier cluster drags the mean
    small = _agg(50, d, 16)
    res = small(clean[:50], rng=gen(11))  # far too few users: a warning, not an error
    assert res.diagnostics["min_users_met"] is False
    assert res.diagnostics["min_users_required"] > 50


def test_missing_rows_count_as_zero_and_q_below_one_rejected(tmp_path):
    agg = _agg(100, 4, 4)
    X = torch.full((100, 4), 0.2, dtype=torch.float64)
    assert agg(X[:60], rng=gen(1)).users_used == 60
    from fedudp.config import ConfigError
    from fedudp.run import run

    with pytest.raises(ConfigError, match="sampling_rate"):
        run(tiny_cfg("full_dp", aggregator="winsorized", **{"train.sampling_rate": 0.5}), tmp_path)


def test_winsorized_training_end_to_end(tmp_path):
    from fedudp.run import run

    s = run(
        tiny_cfg(
            "full_dp",
            aggregator="winsorized",
            **{"train.shared_update": "gradient", "privacy.epsilon": 5.0},
        ),
        tmp_path,
    )
    assert s["aggregator"] == "winsorized" and s["adjacency"] == "replace_one"
    assert s["epsilon"] <= 5.0 + 1e-9 and s["rounds_completed"] == 3
