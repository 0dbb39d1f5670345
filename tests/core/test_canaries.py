"""One-run empirical privacy estimate with canaries (fedudp.core.canaries, audit.*)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from dp_accounting.pld import privacy_loss_distribution as pld

from fedudp.aggregators.base import Contribution
from fedudp.config import ConfigError
from fedudp.core.canaries import Canaries, epsilon_from_cosines
from fedudp.run import run
from tests.conftest import tiny_cfg


def test_directions_are_fixed_unit_vectors_and_sampling_is_keyed():
    c = Canaries(50, 30, 0.2, seed=4)
    assert np.linalg.norm(c.direction(3)) == pytest.approx(1.0)
    assert np.array_equal(c.direction(3), Canaries(50, 30, 0.2, seed=4).direction(3))
    assert not np.allclose(c.direction(3), c.direction(4))
    rates = np.mean([len(c.sampled(r)) for r in range(1, 401)]) / 50
    assert rates == pytest.approx(0.2, abs=0.02)
    assert np.array_equal(c.sampled(7), Canaries(50, 30, 0.2, seed=4).sampled(7))


def test_canaries_join_sums_and_rows_at_the_clip_norm():
    c = Canaries(5, 4, 1.0, seed=0)
    base = Contribution(None, torch.zeros(4, dtype=torch.float64), 10, 2)
    got, n = c.add(base, 1, 2.0, rows=False)
    assert n == 5 and got.count == 15 and got.clipped == 2
    want = sum(2.0 * c.direction(k) for k in range(5))
    np.testing.assert_allclose(got.total.numpy(), want)
    rows, n = c.add(Contribution(torch.zeros(3, 4), None, 3), 1, 2.0, rows=True)
    assert rows.rows.shape == (8, 4)
    np.testing.assert_allclose(torch.linalg.norm(rows.rows[3:].double(), dim=1).numpy(), 2.0,
                               rtol=1e-6)


def test_estimate_is_dp_accountings_gaussian_epsilon_of_mu_over_sigma():
    rng = np.random.default_rng(0)
    cos = rng.normal(0.01, 0.01, 20000)                 # μ/σ about 1
    mu = cos.mean() / cos.std(ddof=1)
    ref = pld.from_gaussian_mechanism(1.0 / mu, sensitivity=1.0, pessimistic_estimate=False,
                                      value_discretization_interval=1e-4,
                                      use_connect_dots=False).get_epsilon_for_delta(1e-5)
    assert epsilon_from_cosines(cos, 1e-5) == pytest.approx(ref, rel=1e-6)
    assert epsilon_from_cosines(-cos, 1e-5) == 0.0      # no signal: nothing estimated


AUDIT = {"audit__canaries": 100, "train__rounds": 10, "dataset__features": 400,
         "train__lr": 0.001, "privacy__noise_multiplier": 4.0, "privacy__epsilon": 100.0,
         "dataset__num_records": 2000, "dataset__pool_train": 4000, "partition__num_owners": 16}


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    out = {}
    for scale in (1.0, 0.5):
        d = tmp_path_factory.mktemp(f"scale{scale}")
        out[scale] = run(tiny_cfg("full_dp", **AUDIT, audit__noise_scale=scale), d)
    d = tmp_path_factory.mktemp("plain")
    out["plain"] = run(tiny_cfg("full_dp", **{**AUDIT, "audit__canaries": 0}), d)
    out["plain_metrics"] = [json.loads(x) for x in open(d / "metrics.jsonl")]
    return out


def test_the_estimate_tells_a_correct_mechanism_from_a_weakened_one(audited):
    ok, weak = audited[1.0], audited[0.5]
    assert ok["epsilon"] == weak["epsilon"]                     # the same ledger
    assert ok["canary_epsilon"] < ok["epsilon"]                 # below the bound: consistent
    assert weak["canary_epsilon"] > weak["epsilon"]             # above it: the bound is false
    assert weak["canary_epsilon_interval"][0] > ok["canary_epsilon_interval"][1] * 0.9
    assert weak["guarantee"] == "weakened" and "not a guarantee" in weak["epsilon_display"]
    assert ok["guarantee"] == "certified"


def test_canaries_are_not_users_of_the_run(audited):
    ok, plain = audited[1.0], audited["plain"]
    assert ok["num_users"] == plain["num_users"] and ok["num_owners"] == plain["num_owners"]
    assert "canary_epsilon" not in plain
    assert ok["canaries"] == 100


@pytest.mark.parametrize("kw,key", [
    ({"audit__canaries": 1}, "audit.canaries"),
    ({"audit__noise_scale": 0.0}, "audit.noise_scale"),
    ({"audit__canaries": 10, "aggregator": "winsorized"}, "audit.canaries"),
    ({"audit__noise_scale": 0.5, "privacy__placement": "local_dpsgd"}, "audit.noise_scale"),
])
def test_bad_audit_settings_name_the_key(kw, key):
    from fedudp import build
    with pytest.raises(ConfigError, match=key):
        build.prepare(tiny_cfg("full_dp", **kw))
