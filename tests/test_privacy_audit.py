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
    assert r.samples.gaussian_used  # unsampled Gaussian: the near-optimal fit
    if not broken:
        assert 0.8 <= r.lower_bound <= 1.0, r
        assert 0.85 < r.power["gaussian"] < 1.0 and r.power["threshold"] < r.power["gaussian"]


def test_subsampled_release_is_audited_without_the_gaussian_model():
    agg = GaussianAggregator(1.0, 1.0, Sampling(0.5, 50))
    r = audit(agg, dim=4, trials=5_000, delta=1e-5, seed=0)
    assert not r.gaussian_by_construction and not r.samples.gaussian_used
    assert all(b.method == "threshold (held-out)" for b in r.samples.bounds)


def test_cli_reports_and_exits_nonzero_on_a_violation(capsys):
    assert (
        main(
            [
                "privacy.epsilon=1",
                "train.rounds=1",
                "dataset.num_records=200",
                "partition.num_owners=4",
                "--trials",
                "20000",
                "--break",
                "noise=0.6",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "| gaussian (seed 0) | add_or_remove_one | 20000 |" in out and "VIOLATION" in out
    assert "power at 20000 releases per side" in out


@pytest.mark.parametrize("bad", ["noise=abc", "noise=0", "noise=-1", "clip=on", "speed=2"])
def test_cli_refuses_a_bad_break_in_one_line(capsys, bad):
    assert main(["--break", bad, "--trials", "1000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedudp-audit: error: --break") and "\n" not in err


def test_cli_false_alarm_count_over_seeds(capsys):
    assert (
        main(
            [
                "privacy.epsilon=1",
                "train.rounds=1",
                "dataset.num_records=200",
                "partition.num_owners=4",
                "--trials",
                "4000",
                "--repeat",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "false alarms: 0 of 3 audits" in out and "(seed 2)" in out


# -- owner-side DP-SGD ---------------------------------------------------------------------------
@pytest.mark.parametrize("users", [10, 33])  # m_j < B, and m_j crossing B = 32
def test_local_dpsgd_audit_pairs_through_the_owner_path(users):
    r = audit_local_dpsgd({}, users, 3_000, seed=0)
    assert r.claimed_epsilon == pytest.approx(1.0, abs=2e-3)
    assert r.canary_norm >= 2.0  # the canary's gradient is clipped to C
    assert not r.violation, r.samples.bounds
    assert r.samples.gaussian_used == (users == 10)  # q = 1, one step: Gaussian


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
    assert (
        "| local_dpsgd, owner of 10 -> 9 users, B=32 (seed 0) | add_or_remove_one | 2000 |" in out
    )
    assert main(["privacy.placement=local_dpsgd", "--trials", "1000", "--break", "clip=off"]) == 2


@pytest.mark.parametrize("accounting,violation", [("paper", True), ("certified", False)])
def test_cli_audits_the_paper_mode_leak_pair(capsys, accounting, violation):
    # the paper-mode pair moves the clipped sum by ~15 C, so its one release at a
    # claimed ε = 1 is measurably far less private; certified mode's pair moves it by C
    assert main(
        ["--pair", "paper_leak", f"privacy.accounting={accounting}", "--trials", "4000"]
    ) == int(violation)
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


# -- stateful and sequential mechanisms (issue 37) ----------------------------------------------
def adaptive(rounds: int = 1, population: int = 400):
    from fedudp.aggregators.adaptive_clip import AdaptiveClipGaussian

    return AdaptiveClipGaussian.calibrated(
        clip=1.0, epsilon=1.0, delta=1e-5, rounds=rounds, sampling=Sampling(1.0, population)
    )


def tree(rounds: int = 4):
    from fedudp.aggregators.tree import TreeAggregator

    return TreeAggregator.calibrated(
        clip=1.0, epsilon=1.0, delta=1e-5, rounds=rounds, sampling=Sampling(0.25, 40)
    )


def banded(rounds: int = 8, rate: float = 0.25, bands=None):
    from fedudp.aggregators.banded import BandedMatrixAggregator

    return BandedMatrixAggregator.calibrated(
        clip=1.0, epsilon=1.0, delta=1e-5, rounds=rounds, sampling=Sampling(rate, 40), bands=bands
    )


def test_sequence_claim_is_the_ledgers_for_the_same_releases():
    from fedudp.audit import releases_epsilon

    # calibrated for T releases: the claim of all T is the budget, of fewer it is less
    assert releases_epsilon(tree(8), 1e-5, 8) == pytest.approx(1.0, abs=2e-3)
    assert releases_epsilon(tree(8), 1e-5, 4) < 0.8  # one of the two trees
    assert releases_epsilon(banded(8), 1e-5, 8) == pytest.approx(1.0, abs=2e-3)
    assert releases_epsilon(adaptive(4), 1e-5, 4) == pytest.approx(1.0, abs=2e-3)
    assert releases_epsilon(adaptive(4), 1e-5, 1) == pytest.approx(
        one_release_epsilon(adaptive(4), 1e-5)
    )


def test_adaptive_clip_audit_starts_every_release_from_a_fresh_clip():
    # the audit reused one aggregator, whose clip drifted to 4e-261 and reported ε >= 8.5 at a
    # claim of 0.195; every release now starts at the initial clip and the template is unused
    agg = adaptive()
    r = audit(agg, dim=2, trials=3_000, delta=1e-5, seed=0)
    assert agg.clip == agg.initial_clip == 1.0
    assert r.claimed_epsilon == pytest.approx(1.0, abs=2e-3)
    assert not r.violation and r.samples.gaussian_used, r.samples.bounds
    assert r.lower_bound > 0.3, r.samples.bounds  # the audit sees the release at all


def test_adaptive_clip_audit_catches_half_the_noise():
    r = audit(adaptive(), dim=2, trials=3_000, delta=1e-5, seed=0, broken="noise=0.5")
    assert r.violation and r.lower_bound > 1.5, r.samples.bounds


@pytest.mark.slow
def test_adaptive_clip_sequence_is_audited_against_its_releases_epsilon():
    from fedudp.audit import audit_sequence

    # dim 1: 2 numbers per release, 6 per trial, so that the discriminant's direction, fitted on
    # a fifth of the trials, is sharp at this small trial count
    r = audit_sequence(adaptive(3), dim=1, trials=3_000, releases=3, delta=1e-5, seed=1)
    assert r.mechanism == "gaussian_adaptive, 3 releases"
    assert r.claimed_epsilon == pytest.approx(1.0, abs=2e-3)
    assert not r.violation and r.samples.gaussian_used, r.samples.bounds
    w = audit_sequence(
        adaptive(3), dim=1, trials=3_000, releases=3, delta=1e-5, seed=1, broken="noise=0.5"
    )
    assert w.violation, w.samples.bounds


@pytest.mark.parametrize("make", [tree, banded])
def test_tree_and_banded_sequences_are_consistent_and_a_half_noise_twin_is_caught(make):
    from fedudp.audit import audit_sequence

    agg = make()
    T = agg.rounds if hasattr(agg, "k") else 8
    r = audit_sequence(agg, dim=2, trials=6_000, releases=T, delta=1e-5, seed=0)
    assert r.claimed_epsilon == pytest.approx(1.0, abs=2e-3)
    assert r.samples.gaussian_used and not r.violation, r.samples.bounds
    assert r.lower_bound > 0.5, r.samples.bounds  # the whole sequence's separation is seen
    w = audit_sequence(
        make(), dim=2, trials=6_000, releases=T, delta=1e-5, seed=0, broken="noise=0.5"
    )
    assert w.violation and w.lower_bound > 1.5, w.samples.bounds


def test_a_single_release_says_little_about_a_tree():
    # the same tree audited one release at a time (its first round) against the whole
    # sequence: the canary's leaf lies in 3 of the tree's nodes, the first release shows one
    # of them (separation 1/z against sqrt(3)/z)
    from fedudp.audit import audit_sequence

    one = audit_sequence(tree(), dim=1, trials=20_000, releases=1, delta=1e-5, seed=0)
    whole = audit_sequence(tree(), dim=1, trials=20_000, releases=4, delta=1e-5, seed=0)
    ratio = one.samples.separation.mu_hat / whole.samples.separation.mu_hat
    assert 0.4 < ratio < 0.75, ratio  # 1/sqrt(3) = 0.577
    assert one.lower_bound < 0.6 < whole.lower_bound <= whole.claimed_epsilon


def test_batched_tree_runs_keep_a_state_per_block():
    """The tree and banded trials run side by side as blocks of one vector: every block's noise
    must be one run's (the prefix sums' variance is the tiling's node count: 1, 1, 2, 1 nodes
    for k = 4) and independent of the other blocks'."""
    import numpy as np
    import torch
    from fedudp.protocol.contributions import Constraint
    from fedudp.audit.sequence import _linear_sequences

    agg = tree()
    base = Constraint(rows=False, clip=None).apply(torch.zeros(1, 2, dtype=torch.float64))
    out = _linear_sequences(
        agg, False, base, 1.0, False, 2, 40_000, 4, np.random.default_rng(0), chunk=10_000
    )
    prefix = np.cumsum(out.reshape(-1, 4, 2), axis=1) * agg.sampling.expected_cohort
    var = prefix.var(axis=0).mean(axis=1) / agg.noise_std**2
    assert var == pytest.approx([1, 1, 2, 1], rel=0.05)
    assert abs(np.corrcoef(prefix[:-1, 0, 0], prefix[1:, 0, 0])[0, 1]) < 0.03


def test_local_dpsgd_adaptive_clip_is_audited():
    # it stopped with "dpsgd_deltas: an adaptive clip (spec.count_noise) needs fractions"
    r = audit_local_dpsgd({"privacy.clip_policy": "adaptive"}, 10, 2_000, seed=0)
    assert r.mechanism.startswith("local_dpsgd adaptive, owner of 10 -> 9")
    assert r.claimed_epsilon == pytest.approx(1.0, abs=2e-3)
    assert not r.violation and r.samples.gaussian_used, r.samples.bounds
    assert r.samples.best.statistic.startswith("linear discriminant")


def test_local_dpsgd_below_capacity_follows_the_capacity():
    r = audit_local_dpsgd({}, 7, 2_000, seed=0, capacity=10)
    assert "owner of 7 -> 6 users (capacity 10)" in r.mechanism
    assert not r.violation, r.samples.bounds


def test_local_dpsgd_on_natural_users_below_capacity():
    """Natural users (1..4 records each, from plain arrays, every public number declared): owner
    0 holds 7 users below its declared capacity 10, D' without one of them; the schedule and the
    claim are the declaration's on both sides (the audit re-prepares D' from the arrays)."""
    r = audit_local_dpsgd({}, 7, 2_000, seed=0, capacity=10, natural=4)
    assert "natural users (1..4 records), owner of 7 -> 6 users (capacity 10), B=32" in r.mechanism
    assert r.claimed_epsilon == pytest.approx(1.0, abs=2e-3)
    assert r.canary_norm >= 2.0
    assert not r.violation and r.samples.gaussian_used, r.samples.bounds  # M <= B: one step


@pytest.mark.parametrize("broken", ["noise=0.5", "schedule=data"])
def test_local_dpsgd_on_natural_users_catches_its_twins(broken):
    r = audit_local_dpsgd({}, 7, 2_000, seed=0, capacity=10, natural=4, broken=broken)
    assert r.violation and r.lower_bound > 1.3, r.samples.bounds


def test_cli_audits_natural_users(capsys):
    assert (
        main(
            [
                "privacy.placement=local_dpsgd",
                "--natural",
                "3",
                "--owner-users",
                "5:8",
                "--trials",
                "1000",
            ]
        )
        == 0
    )
    assert (
        "| local_dpsgd, natural users (1..3 records), owner of 5 -> 4 users (capacity 8), "
        "B=32 (seed 0) | add_or_remove_one | 1000 |"
    ) in capsys.readouterr().out
    assert main(["--natural", "3", "--trials", "1000"]) == 2
    assert "--natural" in capsys.readouterr().err


@pytest.mark.slow
def test_local_dpsgd_adaptive_clip_catches_a_noise_cut():
    r = audit_local_dpsgd(
        {"privacy.clip_policy": "adaptive"}, 10, 10_000, seed=0, broken="noise=0.5"
    )
    assert r.violation, r.samples.bounds


def test_cli_audits_a_tree_over_its_sequence(capsys):
    assert (
        main(
            [
                "aggregator=dp_ftrl_tree",
                "train.rounds=4",
                "train.sampling_rate=0.25",
                "privacy.epsilon=1",
                "--dim",
                "2",
                "--trials",
                "2000",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| dp_ftrl_tree, 4 releases (seed 0) | add_or_remove_one | 2000 | 1e-05 | 1.000 |" in out
    assert (
        main(
            [
                "aggregator=dp_ftrl_tree",
                "train.rounds=4",
                "train.sampling_rate=0.25",
                "--sequence",
                "100",
                "--trials",
                "2000",
            ]
        )
        == 2
    )
    assert "--sequence 100" in capsys.readouterr().err


@pytest.mark.parametrize("pair", [[], ["--pair", "paper_leak"]])
def test_the_audit_refuses_a_gpu_device_in_one_line(pair, capsys):
    """The audit and the leak pair build their canaries and replicas on the CPU: a device
    override is refused before any work, naming the key."""
    assert main([*pair, "engine_opts.device=cuda", "--trials", "1000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "engine_opts.device=cuda" in err[0] and "CPU only" in err[0]


def test_leak_config_refuses_a_gpu_device():
    from fedudp.config import ConfigError
    from fedudp.leak import leak_config

    with pytest.raises(ConfigError, match="engine_opts.device=cuda:0: the leak pair runs"):
        leak_config(**{"engine_opts.device": "cuda:0"})
    assert leak_config(**{"engine_opts.device": "cpu"}).engine_opts.device == "cpu"
