"""``fedudp-audit``: the user-facing empirical audit catches broken releases, server side and
inside the owners (owner-side DP-SGD through the real owner path), and prints its power."""
from __future__ import annotations

import dp_accounting
import pytest

from fedudp.aggregators import GaussianAggregator, Sampling
from fedudp.audit import audit, audit_local_dpsgd, main, one_release_epsilon


def gaussian(z_scale: float = 1.0) -> GaussianAggregator:
    from fedudp.privacy.accountant import calibrate_noise_multiplier
    z = calibrate_noise_multiplier(dp_accounting.GaussianDpEvent, 1.0, 1e-5, 1)
    return GaussianAggregator(1.0, z * z_scale, Sampling(1.0, 50))


def test_claimed_epsilon_is_the_ledgers_for_one_release():
    assert one_release_epsilon(gaussian(), 1e-5) == pytest.approx(1.0, rel=2e-3)


@pytest.mark.parametrize("broken,violation", [("", False), ("noise=0.7", True), ("clip=off", True)])
def test_audit_is_consistent_and_catches_broken_mechanisms(broken, violation):
    r = audit(gaussian(), dim=4, trials=40_000, delta=1e-5, seed=1, broken=broken)
    assert r.violation == violation, r
    assert r.samples.gaussian_used                       # unsampled Gaussian: the near-optimal fit
    if not broken:
        assert 0.8 <= r.lower_bound <= 1.0, r
        assert 0.85 < r.power["gaussian"] < 1.0 and r.power["threshold"] < r.power["gaussian"]


def test_subsampled_release_is_audited_without_the_gaussian_model():
    agg = GaussianAggregator(1.0, 1.0, Sampling(0.5, 50))
    r = audit(agg, dim=4, trials=5_000, delta=1e-5, seed=0)
    assert not r.gaussian_by_construction and not r.samples.gaussian_used
    assert all(b.method == "threshold (held-out)" for b in r.samples.bounds)


def test_cli_reports_and_exits_nonzero_on_a_violation(capsys):
    assert main(["privacy.epsilon=1", "train.rounds=1", "dataset.num_records=200",
                 "partition.num_owners=4", "--trials", "20000", "--break", "noise=0.6"]) == 1
    out = capsys.readouterr().out
    assert "| gaussian (seed 0) | add_or_remove_one | 20000 |" in out and "VIOLATION" in out
    assert "power at 20000 releases per side" in out


@pytest.mark.parametrize("bad", ["noise=abc", "noise=0", "noise=-1", "clip=on", "speed=2"])
def test_cli_refuses_a_bad_break_in_one_line(capsys, bad):
    assert main(["--break", bad, "--trials", "1000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedudp-audit: error: --break") and "\n" not in err


def test_cli_false_alarm_count_over_seeds(capsys):
    assert main(["privacy.epsilon=1", "train.rounds=1", "dataset.num_records=200",
                 "partition.num_owners=4", "--trials", "4000", "--repeat", "3"]) == 0
    out = capsys.readouterr().out
    assert "false alarms: 0 of 3 audits" in out and "(seed 2)" in out


# -- owner-side DP-SGD ---------------------------------------------------------------------------
@pytest.mark.parametrize("users", [10, 33])        # m_j < B, and m_j crossing B = 32
def test_local_dpsgd_audit_pairs_through_the_owner_path(users):
    r = audit_local_dpsgd({}, users, 3_000, seed=0)
    assert r.claimed_epsilon == pytest.approx(1.0, abs=2e-3)
    assert r.canary_norm >= 2.0                   # the canary's gradient is clipped to C
    assert not r.violation, r.samples.bounds
    assert r.samples.gaussian_used == (users == 10)      # q = 1, one step: Gaussian


def test_local_dpsgd_audit_catches_the_data_dependent_schedule():
    # a schedule read from the data: removing a user of 33 drops a noisy step (2 -> 1)
    r = audit_local_dpsgd({}, 33, 3_000, seed=0, broken="schedule=data")
    assert r.violation and r.lower_bound > 2.0, r.samples.bounds


@pytest.mark.slow
def test_local_dpsgd_audit_catches_a_noise_cut():
    r = audit_local_dpsgd({}, 10, 20_000, seed=0, broken="noise=0.5")
    assert r.violation, r.samples.bounds


def test_cli_audits_local_dpsgd(capsys):
    assert main(["privacy.placement=local_dpsgd", "--owner-users", "10", "--trials", "2000"]) == 0
    out = capsys.readouterr().out
    assert "| local_dpsgd, owner of 10 -> 9 users, B=32 (seed 0) | add_or_remove_one | 2000 |" in out
    assert main(["privacy.placement=local_dpsgd", "--trials", "1000", "--break", "clip=off"]) == 2


@pytest.mark.parametrize("accounting,violation", [("paper", True), ("certified", False)])
def test_cli_audits_the_paper_mode_leak_pair(capsys, accounting, violation):
    # the paper-mode pair moves the clipped sum by ~15 C, so its one release at a
    # claimed ε = 1 is measurably far less private; certified mode's pair moves it by C
    assert main(["--pair", "paper_leak", f"privacy.accounting={accounting}",
                 "--trials", "4000"]) == int(violation)
    out = capsys.readouterr().out
    moved = float(out.split("moves the clipped sum by ")[1].split(" C")[0])
    row = next(line for line in out.splitlines() if line.startswith("| gaussian (paper_leak"))
    bound = float(row.split("|")[6])
    if violation:
        assert moved > 10 and bound > 4, out
    else:
        assert moved <= 1.0 + 1e-6 and bound <= 1.0, out


def test_a_heuristic_claim_is_marked_in_the_audit_row(capsys):
    assert main(["--pair", "paper_leak", "privacy.accounting=paper", "--trials", "1000"]) == 1
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| gaussian ("))
    assert row.split("|")[5].strip() == "1.000 (heuristic)"
