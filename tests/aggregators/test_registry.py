"""The estimator registry's contract: an estimator declares the run values and options its
``calibrated`` takes, ``register`` checks them against its keywords, and the config builder
passes exactly those by keyword (no signature matching, no silent default, nothing set after
construction)."""

from __future__ import annotations

import pytest

from conftest import tiny_cfg
from fedudp import build
from fedudp.aggregators import (
    REGISTRY,
    GaussianAggregator,
    MeanAggregator,
    Option,
    Sampling,
    register,
)
from fedudp.aggregators.base import BOUND
from fedudp.config import ConfigError, RunConfig


def _kw(**over):
    return {k.replace(".", "__"): v for k, v in over.items()}


def test_register_refuses_a_keyword_the_declarations_leave_out():
    class Quiet(MeanAggregator):
        name = "test_quiet"
        inputs = ("sampling",)

        @classmethod
        def calibrated(cls, *, sampling, damping=0.5):  # damping would keep its default
            return cls(sampling)

    with pytest.raises(TypeError, match=r"calibrated takes \['damping', 'sampling'\]"):
        register(Quiet)
    assert "test_quiet" not in REGISTRY

    Quiet.options = (Option("damping", 0.5, float),)
    register(Quiet)  # declared: now it is an option, estimator.damping
    try:
        cfg = tiny_cfg("fedavg", aggregator="test_quiet")
        assert cfg.estimator["damping"] == 0.5
    finally:
        REGISTRY.remove("test_quiet")


def test_register_refuses_an_unknown_run_value_and_a_clashing_option():
    class Unknown(MeanAggregator):
        name = "test_unknown_input"
        inputs = ("sampling", "temperature")

        @classmethod
        def calibrated(cls, *, sampling, temperature):
            return cls(sampling)

    with pytest.raises(TypeError, match="temperature"):
        register(Unknown)

    class Clash(MeanAggregator):
        name = "test_clash"
        inputs = ("sampling",)
        options = (Option("bound", 2.0, float),)  # bound is declared with default 1.0

        @classmethod
        def calibrated(cls, *, sampling, bound):
            return cls(sampling)

    with pytest.raises(TypeError, match="'bound' is declared differently"):
        register(Clash)
    assert BOUND.default == 1.0


def test_the_builder_passes_the_declared_options_typed_and_names_a_wrong_one():
    over = {"aggregator": "few_users", "estimator.copies": 3, "estimator.kappa": 2}
    cfg = tiny_cfg("full_dp", **_kw(**over))
    opts = build.estimator_options(cfg, REGISTRY["few_users"])
    assert opts["copies"] == 3 and opts["kappa"] == 2.0 and isinstance(opts["kappa"], float)
    assert set(opts) == {o.name for o in REGISTRY["few_users"].options}
    bad = tiny_cfg("full_dp", **_kw(aggregator="few_users", **{"estimator.copies": 1.5}))
    with pytest.raises(ConfigError, match=r"^estimator\.copies: aggregator=few_users must be an"):
        build.estimator_options(bad, REGISTRY["few_users"])


def test_an_override_the_estimator_does_not_declare_is_an_error():
    cfg = tiny_cfg("full_dp")
    with pytest.raises(TypeError, match=r"takes no \['tau'\]"):
        build.estimator(cfg, Sampling(1.0, 40), 3, 4, name="gaussian", tau=0.3)


def test_the_audit_noise_scale_is_given_to_the_constructor():
    cfg = tiny_cfg("full_dp", **_kw(**{"audit.noise_scale": 0.5}))
    agg = build.estimator(cfg, Sampling(1.0, 40), 3, 4)
    want = GaussianAggregator.calibrated(
        clip=cfg.privacy.clip,
        epsilon=cfg.privacy.epsilon,
        delta=cfg.privacy.delta,
        rounds=3,
        sampling=Sampling(1.0, 40),
        noise_scale=0.5,
    )
    assert agg.noise_scale == want.noise_scale == 0.5
    assert agg.noise_multiplier == want.noise_multiplier  # the accounted noise is unchanged
    assert "noise_scale" not in vars(type(agg))  # an instance value, not a patched class one
    with pytest.raises(Exception, match="noise_scale"):
        GaussianAggregator(1.0, 1.0, Sampling(1.0, 4), noise_scale=2.0)


def test_every_estimator_option_is_a_config_key_with_its_default():
    cfg = RunConfig()
    options = REGISTRY.options()
    assert cfg.estimator == {name: o.default for name, o in options.items()}
    for cls in REGISTRY.values():
        for o in cls.options:
            assert build.config_key(o.name) == f"estimator.{o.name}"
