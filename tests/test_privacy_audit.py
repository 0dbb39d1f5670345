"""``fedudp-audit``: the user-facing empirical audit catches a broken release (issue 10, part)."""
from __future__ import annotations

import dp_accounting
import numpy as np
import pytest

from fedudp.aggregators import GaussianAggregator, Sampling
from fedudp.privacy.audit import audit, epsilon_lower_bound, main, one_release_epsilon


def gaussian(z_scale: float = 1.0) -> GaussianAggregator:
    from fedudp.privacy.accountant import calibrate_noise_multiplier
    z = calibrate_noise_multiplier(dp_accounting.GaussianDpEvent, 1.0, 1e-5, 1)
    return GaussianAggregator(1.0, z * z_scale, Sampling(1.0, 50))


def test_claimed_epsilon_is_the_ledgers_for_one_release():
    assert one_release_epsilon(gaussian(), 1e-5) == pytest.approx(1.0, rel=2e-3)


@pytest.mark.parametrize("broken,violation", [("", False), ("noise=0.3", True), ("clip=off", True)])
def test_audit_is_consistent_and_catches_broken_mechanisms(broken, violation):
    r = audit(gaussian(), dim=4, trials=40_000, delta=1e-5, seed=1, broken=broken)
    assert r.violation == violation, r
    assert r.lower_bound >= 0.3 if not broken else r.lower_bound > 1.5


def test_lower_bound_of_identical_distributions_is_small():
    rng = np.random.default_rng(0)
    assert epsilon_lower_bound(rng.normal(size=20_000), rng.normal(size=20_000), 1e-5) < 0.15


def test_cli_reports_and_exits_nonzero_on_a_violation(capsys):
    assert main(["privacy.epsilon=1", "train.rounds=1", "dataset.num_records=200",
                 "partition.num_owners=4", "--trials", "20000", "--break", "noise=0.3"]) == 1
    out = capsys.readouterr().out
    assert "| gaussian | add_or_remove_one | 20000 |" in out and "VIOLATION" in out
