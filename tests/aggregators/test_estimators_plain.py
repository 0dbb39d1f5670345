"""Every estimator built and calibrated from plain Python values (``Cls.calibrated(...)``).

``calibrated`` takes keyword-only plain numbers (no ``RunConfig``) and returns exactly what
the config builder (``fedudp.build.estimator``) returns for the same numbers: same class, same noise multiplier (bit for bit),
same ``dp_event()``, constraint and constants, and the same release for the same input and seed.
A bad plain value is a ``ValueError`` whose message starts with the parameter's name (not a
``ConfigError``); the config path keeps its ``ConfigError`` naming the config key.
"""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
import torch

from fedudp.aggregators import REGISTRY, LocalDpSgdMean, Sampling
from fedudp.aggregators.few_users import FewUsersAggregator
from fedudp.aggregators.gaussian import GaussianAggregator, MeanAggregator
from fedudp.aggregators.friendlycore import FriendlyCoreAggregator
from fedudp.aggregators.outlier import OutlierRemovalAggregator
from fedudp.aggregators.winsorized import WinsorizedAggregator
from fedudp.config import ConfigError, config_from_overrides
from fedudp.build import estimator, planned_owner_records, planned_owner_users
from fedudp.privacy.accountant import BudgetError

DELTA = 1e-5


def from_the_builder(name: str, overrides: dict, sampling: Sampling, rounds: int, dim: int):
    cfg = config_from_overrides({"method": "full_dp", "aggregator": name, **overrides})
    built = estimator(cfg, sampling, rounds, dim)
    assert type(built) is REGISTRY[name]
    return built


def matrix(n: int, dim: int, seed: int = 5) -> np.ndarray:
    """A concentrated cohort with a few far rows (numpy: ``agg(X, rng=0)`` takes it)."""
    rng = np.random.default_rng(seed)
    X = 0.3 + 0.05 * rng.standard_normal((n, dim))
    X[: n // 20] = 5.0 * rng.standard_normal((n // 20, dim))
    return X


def assert_same(a, b, dim: int, release: bool = True) -> None:
    assert type(a) is type(b)
    assert a.noise_multiplier == b.noise_multiplier  # exactly
    assert a.dp_event() == b.dp_event() and repr(a.dp_event()) == repr(b.dp_event())
    assert a.one_off_event() == b.one_off_event()
    assert a.constraint == b.constraint
    assert (a.guarantee, a.min_users_required, a.noise_std) == (
        b.guarantee,
        b.min_users_required,
        b.noise_std,
    )
    assert {k: repr(v) for k, v in vars(a).items()} == {k: repr(v) for k, v in vars(b).items()}
    if release:
        X = matrix(a.sampling.population, dim)
        ra, rb = a(X, rng=0), b(X, rng=0)
        assert torch.equal(ra.mean, rb.mean) and ra.users_used == rb.users_used
        assert ra.diagnostics.keys() == rb.diagnostics.keys()


# (registry name, config overrides, plain keyword arguments of ``calibrated``, sampling, rounds, dim)
CASES = {
    "gaussian": (
        "gaussian",
        {"privacy.epsilon": 3.0, "privacy.clip": 0.7},
        dict(clip=0.7, epsilon=3.0, delta=DELTA),
        Sampling(0.5, 60),
        2,
        6,
    ),
    "none": ("none", {}, {}, Sampling(0.3, 40), 2, 6),
    "winsorized-derived-tau": (
        "winsorized",
        {"privacy.epsilon": 2.0, "estimator.bound": 2.0, "partition.records_per_user": 4},
        dict(epsilon=2.0, delta=DELTA, bound=2.0, records_per_unit=4),
        Sampling(1.0, 120),
        3,
        6,
    ),
    "winsorized-closed-form": (
        "winsorized",
        {
            "privacy.epsilon": 2.0,
            "privacy.calibration": "closed_form",
            "estimator.tau": 0.3,
            "estimator.beta": 0.05,
        },
        dict(epsilon=2.0, delta=DELTA, bound=1.0, tau=0.3, beta=0.05, calibration="closed_form"),
        Sampling(1.0, 120),
        3,
        5,
    ),
    "outlier_removal": (
        "outlier_removal",
        {"privacy.epsilon": 8.0},
        dict(epsilon=8.0, delta=DELTA, bound=1.0, records_per_unit=1),
        Sampling(1.0, 450),
        2,
        8,
    ),
    "outlier_removal-paper": (
        "outlier_removal",
        {"privacy.epsilon": 8.0, "privacy.accounting": "paper", "estimator.tau": 0.5},
        dict(epsilon=8.0, delta=DELTA, tau=0.5, accounting="paper"),
        Sampling(1.0, 450),
        2,
        8,
    ),
    "friendlycore": (
        "friendlycore",
        {"privacy.epsilon": 8.0, "estimator.tau": 0.4},
        dict(epsilon=8.0, delta=DELTA, tau=0.4),
        Sampling(1.0, 1400),
        1,
        4,
    ),
    "few_users": (
        "few_users",
        {"privacy.epsilon": 8.0},
        dict(epsilon=8.0, delta=DELTA, bound=1.0, records_per_unit=1),
        Sampling(1.0, 60),
        1,
        8,
    ),
    "few_users-blocks": (
        "few_users",
        {
            "privacy.epsilon": 8.0,
            "estimator.copies": 3,
            "estimator.blocks": 2,
            "estimator.kappa": 1.5,
            "estimator.tries": 200.0,
            "partition.records_per_user": 3,
        },
        dict(
            epsilon=8.0,
            delta=DELTA,
            bound=1.0,
            records_per_unit=3,
            copies=3,
            blocks=2,
            kappa=1.5,
            tries=200.0,
        ),
        Sampling(1.0, 200),
        1,
        6,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_calibrated_equals_from_config(case):
    name, overrides, plain, sampling, rounds, dim = CASES[case]
    cls = REGISTRY[name]
    if "dim" in inspect.signature(cls.calibrated).parameters:
        plain = {**plain, "dim": dim}
    if "rounds" in inspect.signature(cls.calibrated).parameters:
        plain = {**plain, "rounds": rounds}
    assert_same(
        cls.calibrated(sampling=sampling, **plain),
        from_the_builder(name, overrides, sampling, rounds, dim),
        dim,
    )


@pytest.mark.parametrize("group", [False, True])
def test_local_dpsgd_calibrated_equals_from_config(group):
    over = {
        "method": "full_dp",
        "privacy.placement": "local_dpsgd",
        "privacy.epsilon": 4.0,
        "dataset.num_records": 150,
        "partition.num_owners": 4,
        "train.batch_size": 64,
    }
    if group:
        over |= {
            "privacy.group_privacy": True,
            "partition.records_per_user": 2,
            "privacy.accounting": "paper",
        }
    cfg = config_from_overrides(over)
    sampling = Sampling(1.0, 4)
    units = planned_owner_records(cfg) if group else planned_owner_users(cfg)
    a = LocalDpSgdMean.calibrated(
        clip=1.0,
        epsilon=4.0,
        delta=DELTA,
        rounds=2,
        batch_size=64,
        local_epochs=1,
        owner_units=[int(u) for u in units],
        sampling=sampling,
        group_size=2 if group else None,
        accounting="paper" if group else "certified",
    )
    built = estimator(cfg, sampling, 2, 6)
    assert type(built) is LocalDpSgdMean
    assert_same(a, built, 6, release=False)
    assert (a.group is not None) == group


def test_every_estimator_has_a_keyword_only_calibrated():
    for cls in [*REGISTRY.values(), LocalDpSgdMean]:
        params = list(inspect.signature(cls.calibrated).parameters.values())
        assert params and all(p.kind is p.KEYWORD_ONLY for p in params), cls.name


# -- bad plain values: ValueError naming the parameter -------------------------------------------
S1 = Sampling(1.0, 450)
BAD = [
    (GaussianAggregator, dict(clip=1.0, epsilon=-1, delta=DELTA, rounds=2, sampling=S1), "epsilon"),
    (GaussianAggregator, dict(clip=0.0, epsilon=1.0, delta=DELTA, rounds=2, sampling=S1), "clip"),
    (MeanAggregator, dict(sampling=(1.0, 10)), "sampling"),
    (
        WinsorizedAggregator,
        dict(dim=4, epsilon=1.0, delta=DELTA, rounds=2, sampling=S1, bound=0.0, tau=0.1),
        "bound",
    ),
    (
        WinsorizedAggregator,
        dict(
            dim=4,
            epsilon=1.0,
            delta=DELTA,
            rounds=2,
            sampling=Sampling(0.5, 450),
            bound=1.0,
            tau=0.1,
        ),
        "sampling.rate",
    ),
    (
        WinsorizedAggregator,
        dict(
            dim=4,
            epsilon=1.0,
            delta=DELTA,
            rounds=2,
            sampling=S1,
            bound=1.0,
            tau=0.1,
            calibration="paper",
        ),
        "calibration",
    ),
    (
        OutlierRemovalAggregator,
        dict(
            epsilon=8.0, delta=DELTA, rounds=2, sampling=S1, bound=1.0, records_per_unit=1, beta=1.5
        ),
        "beta",
    ),
    (
        OutlierRemovalAggregator,
        dict(epsilon=8.0, delta=DELTA, rounds=2, sampling=Sampling(1.0, 100), tau=0.5),
        "sampling.population",
    ),
    (
        FriendlyCoreAggregator,
        dict(epsilon=8.0, delta=DELTA, rounds=1, sampling=S1, tau=-1.0),
        "tau",
    ),
    (FriendlyCoreAggregator, dict(epsilon=8.0, delta=2.0, rounds=1, sampling=S1, tau=0.4), "delta"),
    (
        FriendlyCoreAggregator,
        dict(epsilon=8.0, delta=DELTA, rounds=1, sampling=S1, bound=1.0),
        "tau",
    ),
    (
        FewUsersAggregator,
        dict(dim=6, epsilon=8.0, delta=DELTA, rounds=1, sampling=S1, tau=0.1, blocks=16),
        "blocks",
    ),
    (
        FewUsersAggregator,
        dict(dim=6, epsilon=0.5, delta=DELTA, rounds=3, sampling=Sampling(1.0, 20), tau=0.1),
        "sampling.population",
    ),
    (
        LocalDpSgdMean,
        dict(
            clip=1.0,
            epsilon=1.0,
            delta=DELTA,
            rounds=0,
            batch_size=8,
            local_epochs=1,
            owner_units=[10, 12],
            sampling=Sampling(1.0, 2),
        ),
        "rounds",
    ),
    (
        LocalDpSgdMean,
        dict(
            clip=1.0,
            epsilon=1.0,
            delta=DELTA,
            rounds=2,
            batch_size=0,
            local_epochs=1,
            owner_units=[10, 12],
            sampling=Sampling(1.0, 2),
        ),
        "batch_size",
    ),
]


@pytest.mark.parametrize("cls,kwargs,param", BAD, ids=[f"{c.name}-{p}" for c, _, p in BAD])
def test_bad_plain_value_names_the_parameter(cls, kwargs, param):
    with pytest.raises(ValueError, match=rf"^{re.escape(param)}\b") as info:
        cls.calibrated(**kwargs)
    assert not isinstance(info.value, ConfigError)


def test_unreachable_budget_plain_and_config():
    with pytest.raises(ValueError, match=r"^epsilon is unreachable") as info:
        GaussianAggregator.calibrated(
            clip=1.0, epsilon=1e-6, delta=1e-12, rounds=2000, sampling=Sampling(1.0, 50)
        )
    assert not isinstance(info.value, ConfigError)
    with pytest.raises(
        BudgetError, match=r"^privacy\.epsilon=1e-06 at privacy\.delta=1e-12 is unreachable"
    ):
        from_the_builder(
            "gaussian",
            {"privacy.epsilon": 1e-6, "privacy.delta": 1e-12},
            Sampling(1.0, 50),
            2000,
            6,
        )


@pytest.mark.parametrize(
    "name,overrides,sampling,rounds,pattern",
    [
        (
            "outlier_removal",
            {"privacy.epsilon": 8.0},
            Sampling(1.0, 100),
            2,
            r"^partition: aggregator=outlier_removal needs n >= 429 units, got n=100",
        ),
        (
            "friendlycore",
            {"privacy.epsilon": 8.0, "estimator.tau": 0.4},
            Sampling(1.0, 450),
            1,
            r"^partition: aggregator=friendlycore needs n >= \d+ units.*Raise users",
        ),
        (
            "few_users",
            {"privacy.epsilon": 8.0, "estimator.blocks": 16},
            Sampling(1.0, 200),
            1,
            r"^estimator\.blocks must be a power of two <= 8, got 16$",
        ),
        (
            "gaussian",
            {"privacy.clip": 0.0},
            Sampling(1.0, 50),
            2,
            r"^privacy\.clip must be > 0, got 0",
        ),
        (
            "winsorized",
            {"estimator.tau": -1.0},
            Sampling(1.0, 50),
            2,
            r"^estimator\.tau must be > 0",
        ),
        ("winsorized", {}, Sampling(0.5, 50), 2, r"^train\.sampling_rate must be 1"),
    ],
)
def test_config_path_names_the_config_key(name, overrides, sampling, rounds, pattern):
    with pytest.raises(ConfigError, match=pattern):
        from_the_builder(name, overrides, sampling, rounds, 6)


def test_as_heuristic_is_a_labelled_copy_not_a_patch():
    """A training algorithm's paper mode labels its estimator heuristic with ``as_heuristic``:
    a copy with the same constants; the estimator it came from stays certified."""
    from fedudp.aggregators import GaussianAggregator, Sampling

    agg = GaussianAggregator(1.5, 2.0, Sampling(0.1, 100))
    h = agg.as_heuristic()
    assert (agg.guarantee, h.guarantee) == ("certified", "heuristic")
    assert h is not agg and type(h) is GaussianAggregator
    assert (h.clip, h.noise_multiplier, h.sampling) == (1.5, 2.0, Sampling(0.1, 100))
    assert h.noise_std == agg.noise_std == 3.0
