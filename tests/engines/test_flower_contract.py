"""The run-config contract of ``fedudp.flower`` (fedudp/flower/contract.py): each broken rule is an
error naming the key, before any calibration or training; the docs' table is the code's; the
noise the wrapper announces before round 1 is the release's own, recomputed here from literal
constants."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import FedAvg

from fedudp.aggregators import GaussianAggregator, Sampling
from fedudp.flower import UserLevelDP
from fedudp.flower.contract import (
    BY_NAME,
    KEYS,
    TABLE_BEGIN,
    TABLE_END,
    RunConfigError,
    check_app,
    checked,
    markdown_table,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "flower_user_dp"
INIT = ArrayRecord({"w": Array(np.zeros(8, np.float32))})
BASE = {
    "fedudp.privacy.epsilon": 2.0,
    "fedudp.privacy.delta": 1e-5,
    "fedudp.public.users": 40,
    "num-server-rounds": 2,
    "fedudp.privacy.noise_multiplier": 1.0,  # no calibration: fast
    "fedudp.train.sampling_rate": 0.5,
}


def test_the_base_config_builds_the_wrapper():
    s = UserLevelDP.from_run_config(FedAvg(), BASE, INIT)
    assert s.rounds == 2 and s.aggregator.noise_multiplier == 1.0
    assert s.randomness.is_secure  # the wrapper's default


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"fedudp.estimator.trimm": 0.1}, "fedudp.estimator.trimm"),  # a typo
        ({"fedudp.train.lr": 0.1}, "fedudp.train.lr"),  # a fedudp engine key, not the wrapper's
        ({"fedudp.dataset.name": "mnist"}, "fedudp.dataset.name"),
    ],
)
def test_an_unknown_fedudp_key_is_named(extra, key):
    with pytest.raises(RunConfigError, match=rf"^{key}: not a fedudp\.flower run-config key"):
        UserLevelDP.from_run_config(FedAvg(), {**BASE, **extra}, INIT)


def test_a_close_typo_gets_a_suggestion():
    with pytest.raises(RunConfigError, match=r"did you mean fedudp\.privacy\.epsilon\?"):
        checked({**BASE, "fedudp.privacy.epsilom": 1.0})


@pytest.mark.parametrize("key", ["fedudp.privacy.epsilon", "fedudp.public.users"])
def test_a_missing_required_key_is_named(key):
    rc = {k: v for k, v in BASE.items() if k != key}
    with pytest.raises(RunConfigError, match=rf"^{key}: required in the run config"):
        UserLevelDP.from_run_config(FedAvg(), rc, INIT)


def test_no_number_of_rounds_is_named():
    rc = {k: v for k, v in BASE.items() if k != "num-server-rounds"}
    with pytest.raises(RunConfigError, match=r"^num-server-rounds: required"):
        UserLevelDP.from_run_config(FedAvg(), rc, INIT)
    # an app without num-server-rounds declares fedudp.train.rounds instead
    assert UserLevelDP.from_run_config(FedAvg(), {**rc, "fedudp.train.rounds": 3}, INIT).rounds == 3


def test_a_rounds_mismatch_is_refused_in_the_config_and_at_start():
    with pytest.raises(RunConfigError, match=r"^fedudp\.train\.rounds: 3 differs from num-server"):
        UserLevelDP.from_run_config(FedAvg(), {**BASE, "fedudp.train.rounds": 3}, INIT)
    same = UserLevelDP.from_run_config(FedAvg(), {**BASE, "fedudp.train.rounds": 2}, INIT)
    assert same.rounds == 2
    # start() with another T than the calibrated one: refused before any message (no grid used)
    with pytest.raises(RunConfigError, match=r"^num-server-rounds: .*num_rounds=5.* 2 rounds"):
        same.start(grid=None, initial_arrays=INIT, num_rounds=5)
    assert same.ledger.entries == [] and same.epsilon == 0.0


@pytest.mark.parametrize(
    "key, value, want",
    [
        ("fedudp.public.users", 40.5, "expected int"),
        ("fedudp.privacy.epsilon", "4", "expected float"),
        ("fedudp.privacy.epsilon", True, "expected float"),
        ("fedudp.privacy.randomness", 1, "expected str"),
        ("num-server-rounds", 0, "must be >= 1"),
    ],
)
def test_a_wrong_type_is_named(key, value, want):
    with pytest.raises(RunConfigError, match=rf"^{key}: {want}"):
        checked({**BASE, key: value})


def test_an_int_is_a_float():
    assert checked({**BASE, "fedudp.privacy.epsilon": 4})["fedudp.privacy.epsilon"] == 4.0


def test_an_undeclared_override_is_named_before_flwr_run():
    """Flower refuses ``--run-config`` overrides of keys the app does not declare (its
    ``fuse_dicts``, which the SuperLink calls, raising behind the CLI's bare ``[code: 15]``);
    ``check_app`` names the key for exactly those overrides."""
    from flwr.common.config import fuse_dicts

    from fedudp.flower.contract import declared

    base = declared(EXAMPLE)
    assert base["fedudp.privacy.epsilon"] == 4.0 and base["num-server-rounds"] == 3
    for over, undeclared in [
        ({"fedudp.estimator.beta": 0.2}, True),
        ({"fedudp.privacy.noise_multiplier": 2.0}, True),
        ({"fedudp.privacy.epsilon": 2.0, "num-server-rounds": 2}, False),
        ({"fedudp.privacy.randomness": "seeded", "fedudp.seed": 3}, False),
    ]:
        try:
            fuse_dicts(base, over)
            flower_refuses = False
        except ValueError:
            flower_refuses = True
        assert flower_refuses == undeclared
        if undeclared:
            key = next(iter(over))
            with pytest.raises(RunConfigError, match=rf"^{key}: not declared in \[tool\.flwr"):
                check_app(EXAMPLE, over)
        else:
            assert check_app(EXAMPLE, over)["rounds"] == over.get("num-server-rounds", 3)
    # the string form flwr run takes, and an unknown key even if declared nowhere
    with pytest.raises(RunConfigError, match=r"^fedudp\.estimator\.beta: not declared"):
        check_app(EXAMPLE, "fedudp.estimator.beta=0.2 num-server-rounds=2")
    with pytest.raises(RunConfigError, match=r"^fedudp\.train\.lr: not a fedudp\.flower"):
        check_app(EXAMPLE, "fedudp.train.lr=0.2")


def test_the_check_command_names_the_key():
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedudp.flower.contract",
            "check",
            str(EXAMPLE),
            "--run-config",
            "fedudp.estimator.tau=0.5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stderr.startswith("error: fedudp.estimator.tau: not declared")
    ok = subprocess.run(
        [sys.executable, "-m", "fedudp.flower.contract", "check", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0 and "T = 3 rounds" in ok.stdout, ok.stderr


def test_the_docs_table_is_the_codes():
    text = (ROOT / "docs" / "flower-apps.md").read_text()
    assert TABLE_BEGIN in text and TABLE_END in text, "docs/flower-apps.md lost its table markers"
    table = text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip()
    assert table == markdown_table(), (
        "docs/flower-apps.md's run-config table differs from fedudp.flower.contract.KEYS: "
        "paste `python -m fedudp.flower.contract table` between its markers"
    )


def test_every_contract_key_is_a_fedudp_config_key_with_the_same_default():
    """The keys that set a fedudp config key name one that exists, and their defaults are the
    config's, except where the wrapper differs on purpose (randomness: secure; the
    estimator: gaussian, which is what auto means for full_dp; T: required)."""
    from omegaconf import OmegaConf

    from fedudp.config import RunConfig, config_from_overrides

    defaults = OmegaConf.structured(RunConfig)
    on_purpose = {
        "fedudp.privacy.randomness",
        "fedudp.aggregator",
        "fedudp.public.records_per_user",
        "fedudp.train.rounds",
    }
    for key in KEYS:
        if key.config_key is None:
            continue
        value = key.default if isinstance(key.default, str) and not key.required else key.type(1)
        config_from_overrides({key.config_key: value})  # a ConfigError if the key is not there
        if key.required or key.name in on_purpose:
            continue
        assert OmegaConf.select(defaults, key.config_key) == key.default, key.name
    assert len(BY_NAME) == len(KEYS)


def test_the_noise_is_announced_before_round_1_and_a_dominating_noise_warns(caplog):
    """clip + Gaussian at z = 1.5, C = 0.5, q = 0.25, N = 80 on d = 400 shared coordinates: the
    noise on the released mean has std z·C/(q·N) = 0.0375 per coordinate and norm
    0.0375·20 = 0.75 > C = 0.5 (warned); against a declared typical norm of 2.0, not."""
    init = ArrayRecord(
        {"w": Array(np.zeros((20, 20), np.float32)), "head": Array(np.zeros(7, np.float32))}
    )
    agg = GaussianAggregator(0.5, 1.5, Sampling(0.25, 80))
    s = UserLevelDP(FedAvg(), agg, delta=1e-5, personal=["head"])
    logging.getLogger("flwr").propagate = True
    with caplog.at_level(logging.INFO, logger="flwr"):
        u = s.log_utility(init)
    assert u["dim"] == 400 and u["expected_cohort"] == 20.0
    assert u["noise_std"] == pytest.approx(1.5 * 0.5 / (0.25 * 80), rel=1e-12)
    assert u["noise_norm"] == pytest.approx(0.0375 * 20, rel=1e-12)
    assert u["typical_norm"] == 0.5 and u["typical_from"] == "the clip C"
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "the noise dominates" in warned[0].getMessage()
    assert "q*N = 0.25*80 = 20" in caplog.text
    caplog.clear()
    quiet = UserLevelDP(FedAvg(), agg, delta=1e-5, personal=["head"], expected_update_norm=2.0)
    with caplog.at_level(logging.INFO, logger="flwr"):
        quiet.log_utility(init)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert quiet.ledger.extra["utility_before_round_1"]["typical_norm"] == 2.0


def test_the_release_has_the_announced_noise():
    """The announced std is the release's: the wrapper's estimator releasing an empty cohort
    (all noise) many times has that empirical std per coordinate."""
    import torch

    from fedudp.protocol.contributions import Contribution

    agg = GaussianAggregator(0.5, 1.5, Sampling(0.25, 80))
    s = UserLevelDP(FedAvg(), agg, delta=1e-5)
    u = s.log_utility(ArrayRecord({"w": Array(np.zeros(4000, np.float32))}))
    g = torch.Generator().manual_seed(1)
    empty = Contribution(None, torch.zeros(4000, dtype=torch.float64), 0, 0)
    noise = agg.release(empty, rng=g).mean.to(torch.float64)
    assert float(noise.std()) == pytest.approx(u["noise_std"], rel=0.05)


@pytest.mark.parametrize(
    "extra, key, want",
    [
        ({"fedudp.train.sampling_rate": 1.0}, "fedudp.public.users", "needs n >= 477 units"),
        ({"fedudp.public.users": 1000}, "fedudp.train.sampling_rate", "sampling_rate=1"),
    ],
)
def test_an_estimators_requirement_names_the_run_config_key(extra, key, want):
    """outlier_removal at epsilon 8, T 10 needs N >= 477 and q = 1 (the builder's refusals,
    which name fedudp's config keys ``partition`` and ``train.sampling_rate``): the run-config
    key to change is named first."""
    rc = {
        **BASE,
        "num-server-rounds": 10,
        "fedudp.privacy.epsilon": 8.0,
        "fedudp.aggregator": "outlier_removal",
        **extra,
    }
    rc.pop("fedudp.privacy.noise_multiplier")
    with pytest.raises(RunConfigError, match=rf"^{key}: .*{want}"):
        UserLevelDP.from_run_config(FedAvg(), rc, INIT)


def test_the_contracts_estimator_keys_are_the_registered_estimators_options():
    """The contract's ``fedudp.estimator.*`` keys are exactly the options (``Option``: name,
    type, default) that the estimators it names declare in the registry; a new option of one of
    them, or a changed default, fails here until the contract says it too."""
    from fedudp.aggregators import REGISTRY

    agg_key = BY_NAME["fedudp.aggregator"]
    named = [n for n in REGISTRY.names() if f"`{n}`" in agg_key.meaning]
    assert agg_key.default in named and len(named) >= 6, named
    contract = {
        k.name.removeprefix("fedudp.estimator."): k
        for k in KEYS
        if k.name.startswith("fedudp.estimator.")
    }
    declared: dict[str, object] = {}
    for name in named:
        for opt in REGISTRY[name].options:
            declared.setdefault(opt.name, opt)
            key = contract.get(opt.name)
            assert key is not None, (
                f"aggregator={name}: option {opt.name} missing from the contract"
            )
            assert key.type is opt.type, (name, opt.name, key.type, opt.type)
            assert key.default == opt.default, (name, opt.name, key.default, opt.default)
            assert key.config_key == f"estimator.{opt.name}"
    assert sorted(contract) == sorted(declared)
