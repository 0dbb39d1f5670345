"""Outlier removal ([ASI] Alg. 2), FriendlyCore filter and [ESF] few-user estimator: what
they release (sensitivity, noise scale, accounting) and how they behave on corrupted users."""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedudp.aggregators import GaussianAggregator
from fedudp.aggregators import friend_counts as fcounts
from fedudp.aggregators import friend_filter
from fedudp.aggregators import friendlycore
from fedudp.build import estimator as build_aggregator
from fedudp.aggregators import few_users
from fedudp.aggregators import outlier
from fedudp.protocol.contributions import Sampling
from fedudp.aggregators.winsorized import WinsorizedAggregator
from fedudp.config import ConfigError
from fedudp.privacy.accountant import Accountant, calibrate_noise_multiplier
from fedudp.run import run
from tests.conftest import tiny_cfg

F64 = torch.float64
N, D, EPS, DELTA = 2000, 16, 10.0, 1e-5


def concentrated(n=N, d=D, m=100, corrupt=0.0, far=5.0, seed=1):
    """User means of m samples (per-coordinate std 0.5) around mu; a fraction at mu + far."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.full((d,), 0.2, dtype=F64)
    X = mu + torch.randn(n, d, generator=g, dtype=F64) * 0.5 / math.sqrt(m)
    X[: int(corrupt * n)] = mu + far
    return X, mu


def tau_for(m, d=D):
    return 2 * 0.5 * math.sqrt(2 * d / m)  # twice the typical pairwise distance


def outlier_agg(tau, n=N, eps=EPS, delta=DELTA, rounds=1):
    z = calibrate_noise_multiplier(
        lambda z: dp_accounting.GaussianDpEvent(z), eps / 2, delta / 2, rounds
    )
    return outlier.OutlierRemovalAggregator(
        tau,
        z,
        outlier.sensitivity(tau, n, delta / (4 * rounds)),
        Sampling(1.0, n),
        eps / 2,
        rounds,
        delta / 2,
        outlier.min_users_at(eps / 2, rounds, delta / 4),
    )


def friendly_agg(tau, n=N, eps=EPS, delta=DELTA, rounds=1):
    z = calibrate_noise_multiplier(
        lambda z: friendlycore.friendlycore_round_event(z, z), eps, delta / 2, rounds
    )
    return friendlycore.FriendlyCoreAggregator(
        tau,
        z,
        friendlycore.friendlycore_sensitivity(tau, n, delta / (4 * rounds)),
        Sampling(1.0, n),
        z,
        delta / 2,
        0,
    )


def mean_error(agg_factory, X, mu, reps=5):
    errs, halted = [], 0
    for r in range(reps):
        out = agg_factory()(X, rng=torch.Generator().manual_seed(100 + r))
        if out.halted:
            halted += 1
        else:
            errs.append(float((out.mean - mu).norm()))
    return (sum(errs) / len(errs) if errs else math.nan), halted


def test_chernoff_count_bounds_the_tail():
    # Poisson(6) is the extreme Bernoulli sum of mean 6; its exact tail must be below zeta
    for zeta in (1e-3, 1e-6, 1e-9):
        k = friend_filter.chernoff_count(6.0, zeta)
        tail = 1 - sum(math.exp(-6) * 6**i / math.factorial(i) for i in range(k))
        assert tail <= zeta
        assert friend_filter.chernoff_count(6.0, zeta) > 6


# -- pre-noise statistics under an adversarial replace-one neighbour ---------------------------
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    j=st.integers(0, 59),
    new=st.lists(st.floats(-3, 3), min_size=4, max_size=4),
    tau=st.floats(0.05, 2.0),
)
def test_friend_counts_score_and_mass_sensitivity(seed, j, new, tau):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(60, 4, generator=g, dtype=F64) * 0.3
    Y = X.clone()
    Y[j] = torch.tensor(new, dtype=F64)
    cx, cy = (
        fcounts.friend_counts(X, (tau, 2 * tau), chunk=16),
        fcounts.friend_counts(Y, (tau, 2 * tau), chunk=16),
    )
    brute = (torch.cdist(X, X) <= tau).sum(1)
    assert torch.equal(cx[0], brute)
    n = 60
    assert (
        abs(outlier.concentration_score(cx[0]) - outlier.concentration_score(cy[0]))
        <= 2 * (n - 1) / n + 1e-12
    )
    # every other user's friend count moves by at most 1
    others = torch.arange(n) != j
    assert int((cx[1] - cy[1])[others].abs().max()) <= 1
    px, py = outlier.keep_probabilities(cx[1], n), outlier.keep_probabilities(cy[1], n)
    assert float((px - py)[others].abs().max()) <= 6 / n + 1e-12
    fx, fy = (
        friendlycore.friendly_keep_probabilities(cx[1], n),
        friendlycore.friendly_keep_probabilities(cy[1], n),
    )
    assert abs(float(fx.sum() - fy.sum())) <= friendlycore.MASS_SENSITIVITY


@pytest.mark.parametrize("kind", ["outlier_removal", "friendlycore"])
@pytest.mark.parametrize("adversary", ["far", "edge", "center"])
def test_filtered_mean_sensitivity_under_coupling(kind, adversary):
    """Same randomness for both neighbours = the proof's coupling: the kept means differ by at
    most the sensitivity the Gaussian noise is calibrated to."""
    n, m = 600, 100
    tau = tau_for(m)
    X, mu = concentrated(n=n, m=m)
    Y = X.clone()
    Y[0] = {"far": mu + 50.0, "edge": mu + 2 * tau / math.sqrt(D), "center": mu}[adversary]
    if kind == "outlier_removal":
        sens, keep = outlier.sensitivity(tau, n, 1e-6), outlier.keep_probabilities
    else:
        sens, keep = (
            friendlycore.friendlycore_sensitivity(tau, n, 1e-6),
            friendlycore.friendly_keep_probabilities,
        )
    worst = 0.0
    for s in range(50):
        means = []
        for V in (X, Y):
            p = keep(fcounts.friend_counts(V, (2 * tau,))[0], n)
            mean, _ = friend_filter.filtered_mean(V, p, rng=torch.Generator().manual_seed(s))
            means.append(mean)
        worst = max(worst, float((means[0] - means[1]).norm()))
    assert worst <= sens
    assert worst > 0 or adversary == "center"


# -- noise scale and accountant ---------------------------------------------------------------
@pytest.mark.parametrize("make", [outlier_agg, friendly_agg])
def test_noise_scale_matches_calibration(make):
    # 500 users (above outlier removal's 327 minimum at this budget): the check is the noise's
    # std over the d coordinates, which n does not enter (2,000 users x 100k: 40 s, 1.6 GB)
    n, d = 500, 100_000
    tau = 0.5
    agg = make(tau, n=n)
    v = torch.full((d,), 0.3, dtype=F64)
    X = v.expand(n, d).clone()  # all identical: every user kept, mean = v exactly
    out = agg(X, rng=torch.Generator().manual_seed(0))
    assert not out.halted and out.users_used == n
    resid = out.mean - v
    assert float(resid.std()) == pytest.approx(agg.noise_std, rel=0.015)
    assert abs(float(resid.mean())) < 5 * agg.noise_std / math.sqrt(d)
    # the ledger's epsilon for one round equals the target (events + one-off block)
    acc = Accountant()
    acc.compose(agg.one_off_event())
    acc.compose(agg.dp_event())
    assert acc.epsilon(DELTA) == pytest.approx(EPS, rel=0.01)
    assert acc.epsilon(DELTA) <= EPS * (1 + 1e-3)


def test_error_scales_with_tau_not_bound():
    """Noise (and error) of the concentration-based estimators is ∝ τ ~ 1/sqrt(m); clip+Gaussian
    stays ∝ its bound B whatever m is."""
    errs = {}
    for m in (100, 10_000):
        X, _ = concentrated(m=m)
        mu = X.mean(0)  # the privacy part of the error: distance to the empirical mean
        tau = tau_for(m)
        errs[("or", m)] = mean_error(lambda: outlier_agg(tau), X, mu)[0]
        errs[("fc", m)] = mean_error(lambda: friendly_agg(tau), X, mu)[0]
        z = calibrate_noise_multiplier(lambda z: dp_accounting.GaussianDpEvent(z), EPS, DELTA, 1)
        errs[("gauss", m)] = mean_error(
            lambda: GaussianAggregator(2.0, z / 2, Sampling(1.0, N)), X, mu
        )[0]
    for k in ("or", "fc"):
        assert 7 < errs[(k, 100)] / errs[(k, 10_000)] < 13, errs
    assert 0.8 < errs[("gauss", 100)] / errs[("gauss", 10_000)] < 1.25, errs


# -- robustness to corrupted users -------------------------------------------------------------
FACTOR = 1.5  # "within a stated factor of the clean error"


def test_corrupted_users_each_estimator_as_its_guarantee_says(capsys):
    m = 100
    tau = tau_for(m)
    s = Sampling(1.0, N)
    z = calibrate_noise_multiplier(lambda z: dp_accounting.GaussianDpEvent(z), EPS, DELTA, 1)
    factories = {
        "outlier_removal": lambda: outlier_agg(tau),
        "friendlycore": lambda: friendly_agg(tau),
        "few_users": lambda: few_users.FewUsersAggregator(D, tau, EPS, DELTA, 1, s),
        "gaussian": lambda: GaussianAggregator(4.0, z / 2, s),
        "winsorized": lambda: WinsorizedAggregator(D, tau, 30.0, 0.3, s),
    }
    table = {}
    for frac in (0.0, 0.10, 0.25, 0.30, 0.45):
        X, mu = concentrated(m=m, corrupt=frac, far=5.0)
        table[frac] = {k: mean_error(f, X, mu) for k, f in factories.items()}
    with capsys.disabled():
        print("\ncorrupted  " + "  ".join(f"{k:>16}" for k in factories))
        for frac, row in table.items():
            print(
                f"{frac:9.2f}  " + "  ".join(f"{row[k][0]:10.4f}/h{row[k][1]}" for k in factories)
            )
    clean = {k: table[0.0][k][0] for k in factories}
    # Asi & Liu: fine at 10%, AboveThreshold halts (every repetition) at 30% and 45%
    assert table[0.10]["outlier_removal"][0] <= FACTOR * clean["outlier_removal"]
    assert table[0.30]["outlier_removal"][1] == 5 and table[0.45]["outlier_removal"][1] == 5
    # FriendlyCore filter: within the factor up to 45%
    for frac in (0.10, 0.25, 0.30, 0.45):
        assert table[frac]["friendlycore"][0] <= FACTOR * clean["friendlycore"], frac
    # Esfandiari: within the factor up to 25% (45% only reported above)
    for frac in (0.10, 0.25):
        assert table[frac]["few_users"][0] <= FACTOR * clean["few_users"], frac
    # clip+Gaussian and winsorized are dragged toward the corrupted users
    for k in ("gaussian", "winsorized"):
        assert table[0.10][k][0] > 3 * clean[k], (k, table[0.10][k])
        assert table[0.10][k][0] < table[0.25][k][0] < table[0.45][k][0], (
            k
        )  # grows with the fraction


# -- Esfandiari specifics ----------------------------------------------------------------------
def test_few_users_privacy_conditions_and_log_space():
    # acceptance probability never above one once the conditions hold; n = 10^4 does not overflow
    few_users.check_privacy_conditions(10_000, 0.5, 1e-6, 1000)
    la = few_users.log_accept(torch.arange(1, 10_001), 10_000, 0.5)
    assert torch.isfinite(la).all() and float(la.max()) <= 0
    with pytest.raises(ValueError, match="too few users"):
        few_users.check_privacy_conditions(20, 0.25, 1e-6, 1000)
    need = few_users.min_users(0.25, 1e-6, 1000)
    few_users.check_privacy_conditions(need, 0.25, 1e-6, 1000)
    with pytest.raises(ValueError):
        few_users.check_privacy_conditions(need - 1, 0.25, 1e-6, 1000)


def test_few_users_geometric_stop_returns_garbage_on_spread_data():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(400, 8, generator=g, dtype=F64) * 100.0  # nowhere 2/3 of the points
    p, info = few_users.dp_estimate_1(X, 0.1, 2.5, 1e-6, 50, rng=torch.Generator().manual_seed(1))
    assert p is None and info["garbage"] in ("G1", "G2") and info["tries"] <= info["budget"]


def test_few_users_within_radius_on_two_thirds_in_a_ball():
    n, d, r = 300, 8, 0.1
    g = torch.Generator().manual_seed(3)
    x = torch.full((d,), 1.0, dtype=F64)
    X = x + r * torch.nn.functional.normalize(
        torch.randn(n, d, generator=g, dtype=F64), dim=1
    ) * torch.rand(n, 1, generator=g, dtype=F64)
    X[: n // 4] = torch.randn(n // 4, d, generator=g, dtype=F64) * 50  # arbitrary rest
    ok = 0
    for s in range(20):
        p, info = few_users.dp_estimate_1(
            X, r * math.sqrt(d), 2.0, 1e-6, 1000, rng=torch.Generator().manual_seed(s)
        )
        ok += p is not None and float((p - x).norm()) <= (1 + math.sqrt(d)) * r
    assert ok >= 18


# -- configuration: minimum users, errors, halting end to end ---------------------------------
def test_outlier_removal_refuses_too_few_users():
    cfg = tiny_cfg("full_dp", aggregator="outlier_removal", **{"train.sampling_rate": 1.0})
    with pytest.raises(ConfigError, match="needs n >= "):
        build_aggregator(cfg, Sampling(1.0, 160), 3, dim=10)


def test_few_users_refuses_too_few_users_and_closed_form():
    cfg = tiny_cfg("full_dp", aggregator="few_users", **{"privacy.epsilon": 0.5})
    with pytest.raises(ConfigError, match="too few users"):
        build_aggregator(cfg, Sampling(1.0, 20), 3, dim=10)
    cfg = tiny_cfg("full_dp", aggregator="few_users", **{"privacy.calibration": "closed_form"})
    with pytest.raises(ConfigError, match="closed_form"):
        build_aggregator(cfg, Sampling(1.0, 2000), 3, dim=10)


def big_user_cfg(agg, **kw):
    return tiny_cfg(
        "full_dp",
        aggregator=agg,
        **{
            "dataset.num_records": 3200,
            "dataset.pool_train": 5000,
            "partition.num_owners": 8,
            "model.name": "linear",
            "train.rounds": 4,
            "privacy.epsilon": 10.0,
            **kw,
        },
    )


@pytest.mark.parametrize("agg", ["outlier_removal", "friendlycore", "few_users"])
def test_estimators_end_to_end(tmp_path, agg):
    s = run(big_user_cfg(agg), tmp_path)
    led = json.loads((tmp_path / "ledger.json").read_text())
    assert s["aggregator"] == agg and s["adjacency"] == "replace_one"
    assert s["epsilon"] <= 10.0 * (1 + 1e-6) and led["entries"]
    assert "min_users_met" in s and "min_users_required" in s
    if s["stop_reason"] == "halted":
        assert s["halted_at_round"] == s["rounds_completed"]
    else:
        assert s["rounds_completed"] == 4


def test_outlier_removal_halt_is_a_clean_stop(tmp_path):
    # a τ far too small for the users' vectors: AboveThreshold halts in round 1, exit is clean
    s = run(big_user_cfg("outlier_removal", **{"estimator.tau": 1e-6}), tmp_path)
    assert s["stop_reason"] == "halted" and s["halted_at_round"] == 1
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["agg_concentration_check_failed"] is True
