"""Bounded calibration (issue 37): any (epsilon, delta, rounds, q) answers in seconds, with a
noise multiplier or a one-line refusal naming the key, never a hang or a raw scipy error.

Before: 1e9 rounds at q = 0.01 computed ``size ** 1e9`` inside dp-accounting's sparse
self-composition (no answer in 150 s), 1e7 rounds ended in brentq's ValueError (PLD at the
1e-4 grid is above RDP there, so RDP's z did not bracket PLD's), owner-side DP-SGD at 1e7
rounds and the tree at 1e8 (1e6 trees composed one by one) gave no answer in 100 s / 60 s.

The wall-clock guard is pytest-timeout's (generous: these answer in about a second); speed
itself is not asserted. Values are checked against dp-accounting's own accountants fed literal
events (``direct_rdp``), or against the accountant's rule: epsilon is the smaller of PLD and
RDP, PLD left out where its PMF would exceed ``MAX_PLD_WINDOW`` values.
"""

from __future__ import annotations


import dp_accounting
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

import fedudp.privacy.accountant as A
from fedudp.privacy import bounded, pld_fast
from fedudp.aggregators.base import ParameterError
from fedudp.protocol.contributions import Sampling
from fedudp.aggregators.gaussian import GaussianAggregator
from fedudp.aggregators.local_dpsgd import LocalDpSgdMean, owner_round_event
from fedudp.aggregators.tree import TreeAggregator, run_event, tree_event
from fedudp.privacy.accountant import BudgetError, calibrate_noise_multiplier

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
EPS, DELTA = 1.0, 1e-5


def sampled(z: float, q: float) -> dp_accounting.DpEvent:
    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))


def direct_rdp(event: dp_accounting.DpEvent, delta: float) -> float:
    acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=ADD_REMOVE)
    acc.compose(event)
    return acc.get_epsilon(delta)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("rounds", [10**7, 10**9])
def test_long_schedules_calibrate_to_rdps_noise_and_meet_the_target(rounds):
    agg = GaussianAggregator.calibrated(
        clip=1.0, epsilon=EPS, delta=DELTA, rounds=rounds, sampling=Sampling(0.01, 1000)
    )
    z = agg.noise_multiplier
    schedule = dp_accounting.SelfComposedDpEvent(sampled(z, 0.01), rounds)
    # dp-accounting's RDP (literal event) certifies the target; 1 % less noise does not
    assert direct_rdp(schedule, DELTA) <= EPS + 1e-9
    weaker = dp_accounting.SelfComposedDpEvent(sampled(0.99 * z, 0.01), rounds)
    assert direct_rdp(weaker, DELTA) > EPS
    # the accountant's value of the schedule (the ledger's exact value at the budget's edge)
    got = A.event_epsilon(schedule, DELTA, A.pld_interval(EPS))
    assert got <= EPS and got == pytest.approx(direct_rdp(schedule, DELTA), rel=1e-6)


@pytest.mark.timeout(20)
def test_pld_above_rdp_at_1e7_rounds_gives_rdps_noise_not_a_scipy_error():
    # at 1e7 rounds of q = 0.01 the PLD (grid 1e-4) fits but lies above RDP: before, brentq
    # raised "did not bracket"; now the smaller bound decides
    rounds, q = 10**7, 0.01
    z = calibrate_noise_multiplier(lambda s: sampled(s, q), EPS, DELTA, rounds)
    ev = dp_accounting.SelfComposedDpEvent(sampled(z, q), rounds)
    pld = pld_fast.direct_pld_epsilon(ev, DELTA, A.pld_interval(EPS))
    rdp = direct_rdp(ev, DELTA)
    assert bounded.pld_size(ev, A.pld_interval(EPS)) <= A.MAX_PLD_WINDOW  # PLD was computed
    assert rdp <= EPS < pld  # and lost to RDP
    assert A.event_epsilon(ev, DELTA, A.pld_interval(EPS)) == pytest.approx(rdp, rel=1e-9)


@pytest.mark.timeout(20)
def test_owner_side_dpsgd_at_1e7_rounds_answers():
    units = [100] * 10
    agg = LocalDpSgdMean.calibrated(
        clip=1.0,
        epsilon=EPS,
        delta=DELTA,
        rounds=10**7,
        batch_size=8,
        local_epochs=1,
        owner_units=units,
        sampling=Sampling(0.01, 1000),
    )
    z = agg.noise_multiplier
    for _, _, q, steps in agg.classes:
        ev = dp_accounting.SelfComposedDpEvent(owner_round_event(z, q, steps), 10**7)
        assert direct_rdp(ev, DELTA) <= EPS + 1e-9


@pytest.mark.timeout(20)
def test_the_tree_at_1e8_rounds_is_one_self_composed_event_and_answers():
    rounds, q = 10**8, 0.01
    agg = TreeAggregator.calibrated(
        clip=1.0, epsilon=EPS, delta=DELTA, rounds=rounds, sampling=Sampling(q, 1000)
    )
    z = agg.noise_multiplier
    # 1e6 trees of k = 100 rounds: k Gaussians of z / sqrt(depth) composed is one Gaussian
    ev = run_event(z, rounds, 100)
    assert ev == dp_accounting.SelfComposedDpEvent(tree_event(z, 100), 10**6)
    assert A.event_epsilon(ev, DELTA) <= EPS
    assert A.event_epsilon(run_event(0.99 * z, rounds, 100), DELTA) > EPS


def test_the_trees_calibration_event_is_the_ledgers_composition():
    # the ledger composes the tree's round events (a tree's at its first round, nothing at the
    # others): its epsilon after the run equals that of run_event, a shorter last tree included
    z, rounds, k = 20.0, 250, 100
    agg = TreeAggregator.with_noise_multiplier(
        z, clip=1.0, sampling=Sampling(1 / k, 1000), rounds=rounds
    )
    acc = A.Accountant(A.pld_interval(EPS), EPS)
    for r in range(1, rounds + 1):
        acc.compose(agg.round_event(r))
    assert acc.epsilon(DELTA) == A.event_epsilon(run_event(z, rounds, k), DELTA)
    assert run_event(z, rounds, k) == dp_accounting.ComposedDpEvent(
        [dp_accounting.SelfComposedDpEvent(tree_event(z, k), 2), tree_event(z, 50)]
    )


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "eps,delta,rounds,q,key",
    [
        (1.0, 1e-5, 10**15, 0.01, "privacy.epsilon"),  # no noise reaches it
        (1e-6, 1e-5, 100, 0.01, "privacy.epsilon"),
        (1.0, 0.5, 1000, 0.01, "privacy.delta"),  # delta covers every release
        (1.0, 1e-5, 1000, 1e-9, "privacy.delta"),  # a user is almost never sampled
    ],
)
def test_absurd_inputs_are_one_line_budget_errors_naming_the_key(eps, delta, rounds, q, key):
    with pytest.raises(ParameterError) as info:
        GaussianAggregator.calibrated(
            clip=1.0, epsilon=eps, delta=delta, rounds=rounds, sampling=Sampling(q, 1000)
        )
    err = info.value.facts["config"]  # what the config builder raises
    assert isinstance(err, BudgetError) and str(err).startswith(key + "=")
    assert "\n" not in str(err)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "eps,delta,rounds,q",
    [
        (1e4, 1e-5, 100, 0.01),  # tiny noise: its PLD is not built (RDP)
        (1.0, 1e-100, 1000, 0.01),
        (100.0, 1e-5, 10**9, 0.01),
        (1.0, 1e-5, 10**9, 1e-6),
    ],
)
def test_extreme_but_valid_inputs_answer_and_meet_the_target(eps, delta, rounds, q):
    z = calibrate_noise_multiplier(lambda s: sampled(s, q), eps, delta, rounds)
    ev = dp_accounting.SelfComposedDpEvent(sampled(z, q), rounds)
    assert A.event_epsilon(ev, delta, A.pld_interval(eps)) <= eps
    # never above what dp-accounting's RDP certifies for the same literal schedule
    assert A.event_epsilon(ev, delta, A.pld_interval(eps)) <= direct_rdp(ev, delta) + 1e-9


def test_a_sparse_pld_self_composes_as_dp_accounting_does():
    # huge noise: dp-accounting's PLD is sparse (a few losses); it turns dense once the k-fold
    # sum may hold more than 1000 values, which fedudp decides without computing size ** k
    q, z, interval = 0.01, 64.0, 1e-4
    fast = pld_fast.FastPLD(q, z, interval)
    assert not fast.dense
    for k in (2, 5, 40):
        want = fast.raw.self_compose(k)
        got = fast.self_composed(k)
        for d in (1e-5, 1e-7):
            assert got.get_epsilon_for_delta(d) == want.get_epsilon_for_delta(d)
    pmf = fast._pmfs[0]
    assert pld_fast.sparse_goes_dense(pmf, 10**9) and not pld_fast.sparse_goes_dense(pmf, 1)
    assert pld_fast.sparse_goes_dense(pmf, 2) == (pmf.size**2 > 1000)
