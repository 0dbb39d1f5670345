"""``fedudp.audit.distributed``: the empirical audit of the distributed discrete Gaussian and
Skellam mechanisms, one round of the whole protocol per trial (owners encode with fresh
rounding and noise streams, mask with fresh keys, some drop out and the survivors reveal, the
billboard's secure sum and decoding), add/remove one user.

The real mechanism's lower bound stays at or below the ε its ledger accounts for the round at
its survivors; weakened twins are flagged: owners adding a tenth of the accounted noise
(``noise_scale=0.1``, and ``--break noise=0.1``), and (slow) a ledger that accounts every owner
of the roster as a survivor while most dropped. The false-alarm rate over 20 seeds (slow) is
consistent with the audit's level; its numbers are in docs/results/distributed_dp/audit.md.
"""

from __future__ import annotations

import pytest
from scipy.stats import binom

from fedudp.aggregators import DdgAggregator, Sampling, SkellamAggregator
from fedudp.audit import ALPHA, main
from fedudp.audit.distributed import audit_distributed, check_audit, weaken_shares
from fedudp.privacy.distributed import distributed_event

DELTA = 1e-5
DIM = 64


def calibrated(cls=DdgAggregator, *, owners=4, min_owners=3, epsilon=1.0, noise_scale=1.0):
    """A mechanism calibrated for one round at (ε, 1e-5), every user sampled (q = 1)."""
    return cls.calibrated(
        clip=1.0,
        epsilon=epsilon,
        delta=DELTA,
        rounds=1,
        sampling=Sampling(1.0, 3 * owners + 1),
        dim=DIM,
        min_owners=min_owners,
        owner_units=[4] * owners,
        seed=0,
        noise_scale=noise_scale,
        bits=16,
    )


def test_real_ddgauss_stays_at_or_below_its_accounted_epsilon_at_its_survivors():
    agg = calibrated()
    r = audit_distributed(agg, 2000, DELTA, seed=0, dropped=1)
    # the claim: the round at its 3 survivors, recomputed from the event's plain values
    e = agg.encoding
    event = distributed_event(
        "ddgauss",
        clip=1.0,
        local_std=agg.accounted_std,
        scale=e.scale,
        beta=e.beta,
        dim=64,
        owners=3,
        rate=1.0,
    )
    assert r.claimed_epsilon == event.epsilon(DELTA) == pytest.approx(1.0, rel=1e-6)
    assert r.claimed_epsilon > agg.dp_event_for(4).epsilon(DELTA)  # fewer shares, more ε
    assert r.trials == 2000 and r.adjacency == "add_or_remove_one" and r.broken == ""
    assert r.lower_bound <= r.claimed_epsilon and not r.violation
    assert r.power is not None and 0 < r.power["threshold"] < 1  # a noise cut it would catch


def test_twin_owners_adding_a_tenth_of_the_noise_is_flagged():
    """``noise_scale=0.1``: the owners add a tenth of the accounted shares, the ledger is the
    real one; the audit's lower bound exceeds it."""
    real, twin = calibrated(), calibrated(noise_scale=0.1)
    assert twin.encoding.local_std == pytest.approx(0.1 * real.encoding.local_std)
    r = audit_distributed(twin, 1000, DELTA, seed=0, dropped=1)
    assert r.claimed_epsilon == real.dp_event_for(3).epsilon(DELTA)
    assert r.violation and r.lower_bound > r.claimed_epsilon


def test_real_skellam_is_consistent_and_its_broken_shares_are_flagged():
    agg = calibrated(SkellamAggregator)
    r = audit_distributed(agg, 600, DELTA, seed=1)
    assert r.claimed_epsilon == agg.dp_event_for(4).epsilon(DELTA)
    assert not r.violation and r.lower_bound <= r.claimed_epsilon
    broken = audit_distributed(agg, 600, DELTA, seed=1, broken="noise=0.1")
    assert broken.claimed_epsilon == r.claimed_epsilon  # the ledger is unchanged
    assert broken.violation and broken.broken == "noise=0.1"
    assert agg.encoding.local_std == calibrated(SkellamAggregator).encoding.local_std  # intact


def test_weaken_shares_copies_and_scales_only_the_owners_noise():
    agg = calibrated()
    twin = weaken_shares(agg, 0.25)
    assert twin is not agg and twin.encoding.local_std == 0.25 * agg.encoding.local_std
    assert twin.accounted_std == agg.accounted_std and agg.noise_scale == 1.0
    assert twin.dp_event_for(3) == agg.dp_event_for(3)


@pytest.mark.parametrize(
    ("dropped", "broken", "message"),
    [
        (2, "", "--dropped 2: 2 of 4 owners would survive, below train.min_owners=3"),
        (-1, "", "--dropped -1"),
        (0, "clip=off", "--break clip=off: the distributed mechanisms clip"),
        (0, "noise=0", "--break noise=0: the noise factor must be a number > 0"),
    ],
)
def test_refusals_are_one_line_before_any_work(dropped, broken, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_audit(calibrated(), dropped, broken)


def test_the_command_audits_a_distributed_run_and_flags_the_broken_shares(capsys):
    over = [
        "privacy.placement=distributed",
        "partition.num_owners=4",
        "train.min_owners=3",
        "--rounds",
        "1",
        "--dim",
        "16",
        "--trials",
        "600",
        "--dropped",
        "1",
    ]
    assert main([*over, "--break", "noise=0.1"]) == 1
    out = capsys.readouterr().out
    assert "ddgauss (16 bits, 3 of 4 owners)" in out and "VIOLATION" in out
    assert main([*over, "--dropped", "2"]) == 2  # 2 of 4 survive: below train.min_owners
    assert "below train.min_owners=3" in capsys.readouterr().err


@pytest.mark.slow
def test_false_alarms_over_20_seeds_are_consistent_with_the_level():
    """The real mechanism audited with 20 seeds: the count of flagged audits is plausible at
    the audit's level (each flags a correct mechanism with probability at most ALPHA = 1%):
    P(X >= count) >= 1e-3 for X ~ Binomial(20, ALPHA), i.e. at most 2 of 20."""
    agg = calibrated()
    results = [audit_distributed(agg, 2000, DELTA, seed=s, dropped=1) for s in range(20)]
    flagged = sum(r.violation for r in results)
    assert binom.sf(flagged - 1, len(results), ALPHA) >= 1e-3
    assert {r.claimed_epsilon for r in results} == {agg.dp_event_for(3).epsilon(DELTA)}


@pytest.mark.slow
def test_twin_ledger_reading_every_owner_as_a_survivor_is_flagged(monkeypatch):
    """Shares calibrated for 2 survivors, 30 of 32 owners drop: the real claim (2 survivors)
    holds, while a ledger that accounts the round at all 32 owners (16 times the noise
    variance it does not have) is flagged."""
    agg = calibrated(owners=32, min_owners=2, epsilon=4.0)
    real = audit_distributed(agg, 3000, DELTA, seed=0, dropped=30)
    assert real.claimed_epsilon == agg.dp_event_for(2).epsilon(DELTA)
    assert not real.violation
    at_survivors = DdgAggregator.dp_event_for
    monkeypatch.setattr(DdgAggregator, "dp_event_for", lambda self, n: at_survivors(self, 32))
    twin = audit_distributed(agg, 3000, DELTA, seed=0, dropped=30)
    assert twin.claimed_epsilon == agg.dp_event_for(32).epsilon(DELTA) < 1.0
    assert twin.violation and twin.lower_bound > twin.claimed_epsilon
