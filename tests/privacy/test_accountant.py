"""The guard of ``fedudp/privacy/accountant.py`` (docs/algorithms.md#privacy-accounting).

What the accountant computes is checked against numbers obtained *without* it: dp-accounting's
own PLD/RDP accountants fed literal events (noise multiplier, sampling rate, rounds, delta
written here as numbers), closed forms (the analytic Gaussian curve of Balle & Wang, the
composition of Gaussians, the group-privacy formula) and weakened twins that must fail.
Real dp-accounting throughout, no mocks (one bug reproduction stubs the value dp-accounting
provably returns, where computing it takes minutes).

Unit: whatever the events are for (a user in fedudp's runs); adjacency ADD_OR_REMOVE_ONE.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from scipy.optimize import brentq
from scipy.stats import norm

import fedudp.privacy.accountant as accountant_mod
import fedudp.privacy.calibration as calibration_mod
from fedudp.privacy import bounded, pld_fast
from fedudp.errors import ConfigError
from fedudp.privacy.accountant import (
    ADJACENCY,
    MAX_NOISE_MULTIPLIER,
    Accountant,
    ApproxDp,
    BudgetError,
    GroupAccountant,
    GroupConversion,
    Ledger,
    LedgerEntry,
    Parallel,
    ParallelAccountant,
    accountant_for,
    basic_composition,
    calibrate_noise_multiplier,
    event_epsilon,
    pld_interval,
    schedule_epsilon,
    validate_budget,
)

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
G = dp_accounting.GaussianDpEvent


def sampled_gaussian(z: float, q: float) -> dp_accounting.DpEvent:
    """One clip+Gaussian release at noise multiplier z, Poisson-sampled at rate q (q = 1: none)."""
    return G(z) if q >= 1.0 else dp_accounting.PoissonSampledDpEvent(q, G(z))


def direct_pld(event: dp_accounting.DpEvent, delta: float, interval: float = 1e-4) -> float:
    """dp-accounting's PLD accountant on ``event``, not through fedudp."""
    acc = pld_privacy_accountant.PLDAccountant(ADD_REMOVE, value_discretization_interval=interval)
    acc.compose(event)
    return acc.get_epsilon(delta)


def direct_rdp(event: dp_accounting.DpEvent, delta: float) -> float:
    acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=ADD_REMOVE)
    acc.compose(event)
    return acc.get_epsilon(delta)


def analytic_gaussian_epsilon(z: float, delta: float) -> float:
    """Balle & Wang (2018) Thm 8: the exact (eps, delta) curve of N(0, z^2) at sensitivity 1."""

    def d(eps):
        return norm.cdf(0.5 / z - eps * z) - math.exp(eps) * norm.cdf(-0.5 / z - eps * z) - delta

    return brentq(d, 0.0, 100.0)


# -- one release, composition, the cross-check -------------------------------------------------
# (moved from tests/privacy/test_privacy.py)
@pytest.mark.parametrize("z", [0.8, 2.0, 5.0])
def test_one_gaussian_release_matches_analytic_gaussian(z):
    acc = Accountant()
    acc.compose(dp_accounting.GaussianDpEvent(z))
    exact = analytic_gaussian_epsilon(z, 1e-5)
    assert acc.epsilon(1e-5) == pytest.approx(exact, rel=2e-3)
    assert acc.epsilon(1e-5) >= exact - 1e-9  # PLD is pessimistic, never optimistic
    assert acc.epsilon_rdp(1e-5) >= exact  # RDP is an upper bound


# (moved from tests/privacy/test_privacy.py)
@pytest.mark.parametrize("q,rounds,eps", [(1.0, 20, 1.0), (0.01, 500, 1.0), (0.05, 100, 3.0)])
def test_calibration_hits_target_within_1pct(q, rounds, eps):
    z = calibrate_noise_multiplier(lambda s: sampled_gaussian(s, q), eps, 1e-5, rounds)
    # re-account independently, on a finer PLD grid, straight from dp-accounting
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-5)
    pld.compose(dp_accounting.SelfComposedDpEvent(sampled_gaussian(z, q), rounds))
    got = pld.get_epsilon(1e-5)
    assert got <= eps * 1.0001
    assert got == pytest.approx(eps, rel=0.01)
    # a 2% smaller noise multiplier must overshoot: z is (nearly) the smallest that fits
    assert schedule_epsilon(lambda s: sampled_gaussian(s, q), 0.98 * z, rounds, 1e-5) > eps
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.SelfComposedDpEvent(sampled_gaussian(z, q), rounds))
    assert rdp.get_epsilon(1e-5) >= got * 0.999  # the cross-check is looser


# (moved from tests/privacy/test_privacy.py)
def test_accountant_composes_incrementally_like_the_schedule():
    ev = sampled_gaussian(1.5, 0.1)
    acc = Accountant()
    for _ in range(30):
        acc.compose(ev)
    assert acc.epsilon(1e-5) == pytest.approx(
        schedule_epsilon(lambda s: sampled_gaussian(s, 0.1), 1.5, 30, 1e-5), rel=1e-9
    )
    assert acc.epsilon_if(ev, 1e-5) > acc.epsilon(1e-5)


def test_composed_epsilon_equals_dp_accounting_on_literal_constants():
    # 20 rounds of clip+Gaussian at z = 1.1, Poisson q = 0.05, read at delta = 1e-5
    acc, at_once = Accountant(), Accountant()
    for _ in range(20):
        acc.compose(dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.1)))
    at_once.compose(
        dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.1)), 1
    )
    at_once.compose(
        dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.1)), 19
    )
    want = direct_pld(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.1)), 20
        ),
        1e-5,
    )
    assert acc.epsilon(1e-5) == pytest.approx(want, rel=1e-12)
    assert (
        at_once.runs
        == acc.runs
        == [[dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.1)), 20]]
    )  # one run of 20: same epsilon
    assert 1.0 < want < 3.0  # a sane number, not a degenerate 0 or inf
    # the RDP cross-check is dp-accounting's RDP on the same composition, and looser than PLD
    want_rdp = direct_rdp(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.1)), 20
        ),
        1e-5,
    )
    assert acc.epsilon_rdp(1e-5) == pytest.approx(want_rdp, rel=1e-12)
    assert acc.epsilon_rdp(1e-5) >= acc.epsilon(1e-5)
    assert acc.primary == "pld" and ADJACENCY == "add_or_remove_one"
    # one round fewer is strictly less private spending (the count is not dropped)
    fewer = direct_pld(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.1)), 19
        ),
        1e-5,
    )
    assert fewer < acc.epsilon(1e-5)


def test_mixed_gaussians_compose_to_the_closed_form_gaussian():
    # Gaussians at sensitivity 1 compose exactly to one Gaussian with z^-2 = sum z_i^-2:
    # 3 x z=2 and 4 x z=4 give 3/4 + 4/16 = 1, i.e. z = 1. Runs interleaved: [2, 2, 4, 4, 4, 4, 2].
    acc = Accountant()
    for z in (2.0, 2.0, 4.0, 4.0, 4.0, 4.0):
        acc.compose(G(z))
    acc.compose(G(2.0))  # not merged into the first run
    assert acc.runs == [[G(2.0), 2], [G(4.0), 4], [G(2.0), 1]]
    assert len(acc.events) == 7
    exact = analytic_gaussian_epsilon(1.0, 1e-5)
    assert acc.epsilon(1e-5) == pytest.approx(exact, rel=2e-3)
    assert acc.epsilon(1e-5) >= exact - 1e-9  # pessimistic, never optimistic
    # a twin that lost one release (z^-2 = 1 - 1/4): strictly smaller, and the check sees it
    assert analytic_gaussian_epsilon(1 / math.sqrt(0.75), 1e-5) < 0.95 * acc.epsilon(1e-5)


def test_empty_accountant_spent_nothing():
    acc = Accountant()
    assert acc.epsilon(1e-5) == 0.0 and acc.epsilon_rdp(1e-5) == 0.0
    assert acc.primary == "pld" and acc.events == []
    # asking what one release would cost is that release's own epsilon
    assert acc.epsilon_if(G(2.0), 1e-5) == pytest.approx(direct_pld(G(2.0), 1e-5), rel=1e-12)


def test_pure_dp_steps_are_accounted_by_rdp():
    # ZCDpEvent (a pure eps0 step as eps0^2/2-zCDP): PLD cannot represent it, RDP does
    acc = Accountant()
    acc.compose(dp_accounting.ZCDpEvent(0.125), 4)  # rho = 4 * 0.125 = 0.5
    assert acc.primary == "rdp"
    want = direct_rdp(dp_accounting.SelfComposedDpEvent(dp_accounting.ZCDpEvent(0.125), 4), 1e-5)
    assert acc.epsilon(1e-5) == pytest.approx(want, rel=1e-12)
    # Bun–Steinke: rho-zCDP => (rho + 2 sqrt(rho log(1/delta)), delta)-DP
    assert acc.epsilon(1e-5) <= 0.5 + 2 * math.sqrt(0.5 * math.log(1e5)) + 1e-9
    assert acc.epsilon(1e-5) > 0.5
    # a Gaussian on top: still RDP for the whole composition
    acc.compose(G(3.0))
    assert acc.primary == "rdp"
    assert acc.epsilon(1e-5) == pytest.approx(
        direct_rdp(
            dp_accounting.ComposedDpEvent(
                [
                    dp_accounting.SelfComposedDpEvent(dp_accounting.ZCDpEvent(0.125), 4),
                    dp_accounting.SelfComposedDpEvent(G(3.0), 1),
                ]
            ),
            1e-5,
        ),
        rel=1e-12,
    )


def test_event_epsilon_edges():
    assert event_epsilon(None, 1e-5) == 0.0
    assert event_epsilon(G(1.0), 0.0) == math.inf and event_epsilon(G(1.0), -1e-9) == math.inf
    assert event_epsilon(G(1.0), 1e-5) == pytest.approx(direct_pld(G(1.0), 1e-5), rel=1e-12)
    assert event_epsilon(G(1.0), 1e-5, rdp_only=True) == pytest.approx(
        direct_rdp(G(1.0), 1e-5), rel=1e-12
    )
    assert event_epsilon(dp_accounting.UnsupportedDpEvent(), 1e-5) is None
    assert schedule_epsilon(lambda z: G(z), 3.0, 9, 1e-5) == pytest.approx(
        direct_pld(dp_accounting.SelfComposedDpEvent(G(3.0), 9), 1e-5), rel=1e-12
    )


def test_refuses_events_it_cannot_account():
    acc = Accountant()
    with pytest.raises(ValueError, match="non-private"):
        acc.compose(dp_accounting.NonPrivateDpEvent())
    with pytest.raises(dp_accounting.UnsupportedEventError):
        acc.compose(dp_accounting.UnsupportedDpEvent())
    assert acc.runs == [] and acc.epsilon(1e-5) == 0.0  # nothing half-composed


# -- epsilon_if: the budget check asks without spending -----------------------------------------
def test_epsilon_if_does_not_compose_and_equals_composing_then_asking():
    acc = Accountant()
    acc.compose(G(2.0), 4)
    acc.compose(ApproxDp(0.1, 1e-7))
    runs, blocks, before = copy.deepcopy(acc.runs), list(acc.blocks), acc.epsilon(1e-5)
    # the same event again (the billboard's case), another event, a block; once or repeated
    for ev, count in ((G(2.0), 1), (G(5.0), 3), (ApproxDp(0.2, 1e-7), 2)):
        asked = acc.epsilon_if(ev, 1e-5, count)
        assert acc.runs == runs and acc.blocks == blocks  # state untouched
        assert acc.epsilon(1e-5) == before
        twin = copy.deepcopy(acc)
        twin.compose(ev, count)
        assert asked == pytest.approx(twin.epsilon(1e-5), rel=1e-12), ev
        assert asked > before


# -- blocks (basic composition) -----------------------------------------------------------------
# (moved from tests/aggregators/test_robust_estimators.py)
def test_basic_composition_and_blocks_on_top_of_events():
    b = basic_composition([(ApproxDp(0.5, 1e-6), 3), ApproxDp(0.25)])
    assert b.epsilon == pytest.approx(1.75) and b.delta == pytest.approx(3e-6)
    acc = Accountant()
    acc.compose(dp_accounting.GaussianDpEvent(2.0), 5)
    only_events = acc.epsilon(1e-5 - 4e-6)
    acc.compose(ApproxDp(0.3, 4e-6))
    assert acc.epsilon(1e-5) == pytest.approx(only_events + 0.3, rel=1e-9)
    assert acc.epsilon_if(ApproxDp(0.1, 0.0), 1e-5) == pytest.approx(only_events + 0.4, rel=1e-9)
    # blocks that eat the whole delta leave nothing for the Gaussian: infinite epsilon
    acc.compose(ApproxDp(0.0, 6e-6))
    assert acc.epsilon(1e-5) == math.inf


def test_blocks_merge_and_cap_and_validate():
    acc = Accountant()
    for _ in range(3):
        acc.compose(ApproxDp(0.5, 1e-7))
    acc.compose(ApproxDp(0.25))
    assert acc.blocks == [(ApproxDp(0.5, 1e-7), 3), (ApproxDp(0.25, 0.0), 1)]
    assert acc.runs == []
    assert acc.epsilon(1e-5) == pytest.approx(1.75, rel=1e-12)  # 3 * 0.5 + 0.25
    # basic composition never reports delta >= 1 (the cap), whatever the blocks add up to
    assert basic_composition([(ApproxDp(0.1, 0.6), 2)]).delta < 1.0
    for bad in [
        dict(epsilon=-0.1),
        dict(epsilon=math.inf),
        dict(epsilon=math.nan),
        dict(epsilon=1.0, delta=1.0),
        dict(epsilon=1.0, delta=-1e-9),
    ]:
        with pytest.raises(ValueError):
            ApproxDp(**bad)


def test_blocks_whose_delta_exceeds_the_budget_are_infinite_without_events_too():
    acc = Accountant()
    acc.compose(ApproxDp(1.0, 1e-3))
    with_event = copy.deepcopy(acc)
    with_event.compose(G(50.0))
    assert with_event.epsilon(1e-5) == math.inf  # the consistent answer, with an event
    assert acc.epsilon(1e-5) == math.inf  # blocks alone: the same answer
    assert acc.epsilon_if(ApproxDp(0.5), 1e-5) == math.inf


# -- calibration -------------------------------------------------------------------------------
def test_calibrated_gaussian_meets_target_and_99pct_twin_does_not():
    # 10 unsampled Gaussian rounds are one Gaussian at z / sqrt(10): the analytic curve decides
    z = calibrate_noise_multiplier(lambda s: dp_accounting.GaussianDpEvent(s), 1.0, 1e-5, 10)
    exact = analytic_gaussian_epsilon(z / math.sqrt(10), 1e-5)
    assert exact <= 1.0 and exact == pytest.approx(1.0, rel=0.01)
    assert analytic_gaussian_epsilon(0.99 * z / math.sqrt(10), 1e-5) > 1.0
    # and dp-accounting's own PLD (literal event) agrees that z meets the target
    assert direct_pld(
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), 10),
        1e-5,
        pld_interval(1.0),
    ) <= 1.0 * (1 + 1e-9)
    assert (
        direct_pld(
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(0.99 * z), 10),
            1e-5,
            pld_interval(1.0),
        )
        > 1.0
    )


def test_calibrated_sampled_gaussian_meets_target_and_99pct_twin_does_not():
    z = calibrate_noise_multiplier(
        lambda s: dp_accounting.PoissonSampledDpEvent(0.2, dp_accounting.GaussianDpEvent(s)),
        2.0,
        1e-5,
        10,
    )
    ev = lambda s: dp_accounting.SelfComposedDpEvent(  # noqa: E731
        dp_accounting.PoissonSampledDpEvent(0.2, dp_accounting.GaussianDpEvent(s)), 10
    )
    assert direct_pld(ev(z), 1e-5, pld_interval(2.0)) <= 2.0 * (1 + 1e-9)
    assert direct_pld(ev(0.99 * z), 1e-5, pld_interval(2.0)) > 2.0
    # the calibration meets the target on the accountant's grid, so a run's ledger does too
    acc = Accountant(pld_interval(2.0))
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.2, dp_accounting.GaussianDpEvent(z)), 10)
    assert acc.epsilon(1e-5) <= 2.0 * (1 + 1e-9)


def test_calibration_of_pure_dp_steps_goes_through_rdp():
    # a zCDP step of rho = 1/(2 z^2) (PLD cannot represent it): RDP calibration
    mk = lambda s: dp_accounting.ZCDpEvent(1 / (2 * s * s))  # noqa: E731
    z = calibrate_noise_multiplier(mk, 1.0, 1e-5, 10)
    assert direct_rdp(
        dp_accounting.SelfComposedDpEvent(dp_accounting.ZCDpEvent(1 / (2 * z * z)), 10), 1e-5
    ) <= 1.0 * (1 + 1e-9)
    z99 = 0.99 * z
    assert (
        direct_rdp(
            dp_accounting.SelfComposedDpEvent(dp_accounting.ZCDpEvent(1 / (2 * z99 * z99)), 10),
            1e-5,
        )
        > 1.0
    )


# (moved from tests/privacy/test_privacy.py)
@pytest.mark.parametrize(
    "eps,delta", [(0.0, 1e-5), (-1.0, 1e-5), (1.0, 0.0), (1.0, 1.0), (float("nan"), 1e-5)]
)
def test_bad_budget_rejected(eps, delta):
    with pytest.raises(BudgetError):
        calibrate_noise_multiplier(lambda s: sampled_gaussian(s, 1.0), eps, delta, 10)


# (moved from tests/privacy/test_privacy.py)
def test_unreachable_target_rejected():
    with pytest.raises(BudgetError, match="unreachable"):
        calibrate_noise_multiplier(lambda s: sampled_gaussian(s, 1.0), 1e-9, 1e-12, 10**6)


@pytest.mark.parametrize(
    "eps,delta,key",
    [
        (math.inf, 1e-5, "privacy.epsilon"),
        ("1.0", 1e-5, "privacy.epsilon"),
        (1.0, math.nan, "privacy.delta"),
        (1.0, -1e-5, "privacy.delta"),
        (1.0, 1.5, "privacy.delta"),
    ],
)
def test_validate_budget_names_the_key(eps, delta, key):
    with pytest.raises(BudgetError, match=rf"^{key} "):
        validate_budget(eps, delta)
    validate_budget(1.0, 1e-5)  # a good budget passes silently


@pytest.mark.parametrize("rounds", [0, -3])
def test_rounds_below_one_rejected(rounds):
    with pytest.raises(BudgetError, match=r"^train\.rounds must be >= 1"):
        calibrate_noise_multiplier(lambda s: G(s), 1.0, 1e-5, rounds)


def test_budget_error_is_a_user_error():
    # the command line prints ConfigErrors as one line; ConfigError is a ValueError
    assert issubclass(BudgetError, ConfigError) and issubclass(BudgetError, ValueError)
    assert MAX_NOISE_MULTIPLIER == 1e4


def test_calibration_terminates_when_every_noise_meets_the_target(monkeypatch):
    q, delta = 1e-3, 1e-2
    mk = lambda s: dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s))  # noqa: E731
    # premise, real dp-accounting: epsilon is 0 (delta(eps=0) <= q < delta, whatever z)
    assert schedule_epsilon(mk, 10.0, 1, delta) == 0.0
    assert schedule_epsilon(mk, 1.0, 1, delta) == 0.0
    real, calls = calibration_mod.schedule_epsilon, []

    def guarded(make_event, noise, rounds, d, interval=1e-4):
        calls.append(noise)
        if len(calls) > 60:
            raise RuntimeError(f"calibration loops: {len(calls)} evaluations, z now {noise:g}")
        # below z = 1 dp-accounting's PLD takes seconds to minutes; its value is still 0.0
        return real(make_event, noise, rounds, d, interval) if noise >= 1.0 else 0.0

    monkeypatch.setattr(calibration_mod, "schedule_epsilon", guarded)
    # a delta that covers the release whatever the noise is refused at once, naming the key
    with pytest.raises(BudgetError, match=r"^privacy\.delta=0\.01 is too large"):
        calibrate_noise_multiplier(mk, 1.0, delta, 1)
    assert len(calls) <= 3


# -- the PLD grid --------------------------------------------------------------------------------
def test_pld_interval_and_its_pessimism():
    assert pld_interval(None) == 1e-4 and pld_interval(0.5) == 1e-4 and pld_interval(1.0) == 1e-4
    assert pld_interval(10.0) == pytest.approx(1e-3) and pld_interval(50.0) == pytest.approx(5e-3)
    # a coarser grid stays an upper bound on the exact epsilon (more pessimistic, not less)
    exact = analytic_gaussian_epsilon(0.5, 1e-5)
    fine, coarse = Accountant(pld_interval(1.0)), Accountant(pld_interval(50.0))
    for acc in (fine, coarse):
        acc.compose(G(0.5))
        assert acc.epsilon(1e-5) >= exact - 1e-9
    assert coarse.epsilon(1e-5) >= fine.epsilon(1e-5) - 1e-9
    assert fine.epsilon(1e-5) == pytest.approx(exact, rel=1e-3)


# -- parallel composition (disjoint parts) -----------------------------------------------------
def test_parallel_epsilon_is_the_worst_part_and_parts_are_independent():
    acc = ParallelAccountant(3)
    acc.compose(Parallel((G(2.0), G(3.0), dp_accounting.NoOpDpEvent())), 5)
    e0 = direct_pld(dp_accounting.SelfComposedDpEvent(G(2.0), 5), 1e-5)
    e1 = direct_pld(dp_accounting.SelfComposedDpEvent(G(3.0), 5), 1e-5)
    assert acc.part_epsilons(1e-5) == pytest.approx([e0, e1, 0.0], rel=1e-12)
    assert acc.epsilon(1e-5) == pytest.approx(e0, rel=1e-12)
    assert acc.epsilon(1e-5) < e0 + e1  # max, not a (sequential) sum
    # composing in part 1 only moves part 1
    acc.compose(Parallel((dp_accounting.NoOpDpEvent(), G(2.5), dp_accounting.NoOpDpEvent())))
    p = acc.part_epsilons(1e-5)
    assert p[0] == pytest.approx(e0, rel=1e-12) and p[2] == 0.0 and p[1] > e1
    assert p[1] == pytest.approx(
        direct_pld(
            dp_accounting.ComposedDpEvent(
                [
                    dp_accounting.SelfComposedDpEvent(G(3.0), 5),
                    dp_accounting.SelfComposedDpEvent(G(2.5), 1),
                ]
            ),
            1e-5,
        ),
        rel=1e-12,
    )
    # the RDP cross-check is the worst part's too
    assert acc.epsilon_rdp(1e-5) == pytest.approx(
        max(a.epsilon_rdp(1e-5) for a in acc.parts), rel=1e-12
    )


def test_parallel_epsilon_if_blocks_and_bad_events():
    acc = ParallelAccountant(2)
    acc.compose(Parallel((G(2.0), G(3.0))), 2)
    before = acc.part_epsilons(1e-5)
    ev = Parallel((G(2.0), G(1.2)))  # the next round is worst in part 1
    asked = acc.epsilon_if(ev, 1e-5)
    assert acc.part_epsilons(1e-5) == before  # nothing composed
    twin = copy.deepcopy(acc)
    twin.compose(ev)
    assert asked == pytest.approx(twin.epsilon(1e-5), rel=1e-12)
    assert asked == pytest.approx(twin.part_epsilons(1e-5)[1], rel=1e-12)
    assert asked > max(before)
    # a block is spent by every unit, so in every part
    acc.compose(ApproxDp(0.25, 1e-7))
    assert all(a.blocks == [(ApproxDp(0.25, 1e-7), 1)] for a in acc.parts)
    for part, e in zip(
        acc.part_epsilons(1e-5),
        [direct_pld(dp_accounting.SelfComposedDpEvent(G(z), 2), 1e-5 - 1e-7) for z in (2.0, 3.0)],
    ):
        assert part == pytest.approx(e + 0.25, rel=1e-12)
    for bad in (G(1.0), Parallel((G(1.0),)), Parallel((G(1.0), G(1.0), G(1.0)))):
        with pytest.raises(ValueError, match="Parallel event of 2 parts"):
            acc.compose(bad)
    assert str(Parallel((G(1.0), G(2.0)))).startswith("Parallel(")


# -- group privacy -------------------------------------------------------------------------------
def test_group_conversion_certified_is_the_standard_group_formula():
    # k = 3 records per user, user-level target (2.0, 1e-5): record level (2/3, delta')
    g = GroupConversion.for_user_budget(3, 2.0, 1e-5, "certified")
    assert g.size == 3 and g.form == "certified"
    assert g.record_delta == pytest.approx(1e-5 / (3 * math.exp(2 * 2.0 / 3)), rel=1e-12)
    assert g.record_epsilon(2.0) == pytest.approx(2 / 3, rel=1e-12)
    assert g.user_epsilon(2 / 3) == pytest.approx(2.0, rel=1e-12)
    # (eps', delta') per record => (k eps', k e^{(k-1) eps'} delta') per group of k
    assert g.user_delta(2 / 3) == pytest.approx(
        3 * math.exp(2 * (2 / 3)) * g.record_delta, rel=1e-12
    )
    assert g.user_delta(2 / 3) == pytest.approx(1e-5, rel=1e-12)  # exactly the target
    # it bounds the exact group delta sum_{i<k} e^{i eps'} delta' (Vadhan, Lemma 2.2)
    assert g.user_delta(2 / 3) >= (1 + math.exp(2 / 3) + math.exp(4 / 3)) * g.record_delta
    # a smaller record epsilon spends less delta; k = 1 is no conversion at all
    assert g.user_delta(0.5) < 1e-5
    one = GroupConversion.for_user_budget(1, 2.0, 1e-5, "certified")
    assert (
        one.record_delta == 1e-5
        and one.user_delta(2.0) == pytest.approx(1e-5)
        and one.user_epsilon(0.7) == 0.7
    )


def test_group_conversion_paper_form_is_heuristic():
    # Huang et al.: delta' = delta / k and (k eps', k e^{k eps'} delta'), which at eps' = eps/k
    # gives e^eps delta > delta: not the target (hence heuristic)
    g = GroupConversion.for_user_budget(3, 2.0, 1e-5, "paper")
    assert g.record_delta == pytest.approx(1e-5 / 3, rel=1e-12)
    assert g.user_delta(2 / 3) == pytest.approx(3 * math.exp(3 * (2 / 3)) * (1e-5 / 3), rel=1e-12)
    assert g.user_delta(2 / 3) == pytest.approx(math.exp(2.0) * 1e-5, rel=1e-12)
    assert g.user_delta(2 / 3) > 7 * 1e-5
    certified = GroupConversion.for_user_budget(3, 2.0, 1e-5, "certified")
    assert certified.record_delta < g.record_delta  # certified asks more of each record
    assert "k=3" in str(g) and "paper" in str(g)


@pytest.mark.parametrize("size,form", [(0, "certified"), (-2, "paper"), (2, "exact"), (2, "")])
def test_group_conversion_bad_inputs(size, form):
    with pytest.raises(ValueError):
        GroupConversion.for_user_budget(size, 1.0, 1e-5, form)


def test_group_accountant_is_k_times_record_level_at_the_record_delta():
    g = GroupConversion.for_user_budget(2, 4.0, 1e-5, "certified")
    record_delta = 1e-5 / (2 * math.exp(4.0 / 2))  # literal: delta/(k e^{(k-1)eps/k})
    acc = GroupAccountant(Accountant(), g)
    acc.compose(G(6.0), 4)  # record level, z_eff = 3
    rec = direct_pld(dp_accounting.SelfComposedDpEvent(G(6.0), 4), record_delta)
    assert acc.record_epsilon() == pytest.approx(rec, rel=1e-9)
    assert acc.epsilon(1e-5) == pytest.approx(2 * rec, rel=1e-9)
    assert acc.epsilon_rdp(1e-5) == pytest.approx(
        2 * direct_rdp(dp_accounting.SelfComposedDpEvent(G(6.0), 4), record_delta), rel=1e-9
    )
    # within the budget (record eps <= eps/k) the (k eps', delta) it reports is a valid pair
    assert rec <= 4.0 / 2 and g.user_delta(rec) <= 1e-5
    # epsilon_if: k times the record-level answer, nothing composed
    before = acc.epsilon(1e-5)
    asked = acc.epsilon_if(G(6.0), 1e-5, 2)
    assert acc.epsilon(1e-5) == before
    assert asked == pytest.approx(
        2 * direct_pld(dp_accounting.SelfComposedDpEvent(G(6.0), 6), record_delta), rel=1e-9
    )


def test_group_accountant_over_parallel_parts():
    g = GroupConversion.for_user_budget(2, 4.0, 1e-5, "certified")
    acc = GroupAccountant(ParallelAccountant(2), g)
    acc.compose(Parallel((G(6.0), G(4.0))), 3)
    worst = direct_pld(dp_accounting.SelfComposedDpEvent(G(4.0), 3), g.record_delta)
    assert acc.epsilon(1e-5) == pytest.approx(2 * worst, rel=1e-9)
    assert acc.record_epsilon() == pytest.approx(worst, rel=1e-9)


# -- the accountant a run gets -----------------------------------------------------------------------
def test_accountant_for_picks_the_kind_and_the_calibration_grid():
    plain = accountant_for(G(1.0))
    assert type(plain) is Accountant and plain.pld_interval == 1e-4
    assert accountant_for(G(1.0), target_epsilon=10.0).pld_interval == pytest.approx(1e-3)
    par = accountant_for(Parallel((G(1.0), G(2.0), G(3.0))), target_epsilon=8.0)
    assert type(par) is ParallelAccountant and len(par.parts) == 3
    assert all(a.pld_interval == pytest.approx(8e-4) for a in par.parts)
    # record-level events under group privacy: the grid of the record-level target eps/k
    g = GroupConversion.for_user_budget(4, 8.0, 1e-5, "certified")
    grp = accountant_for(G(1.0), g, 8.0)
    assert type(grp) is GroupAccountant and grp.group is g
    assert type(grp.inner) is Accountant and grp.inner.pld_interval == pytest.approx(2e-4)
    gpar = accountant_for(Parallel((G(1.0), G(2.0))), g, 8.0)
    assert type(gpar.inner) is ParallelAccountant and len(gpar.inner.parts) == 2
    assert all(a.pld_interval == pytest.approx(2e-4) for a in gpar.inner.parts)


def test_accountant_for_keeps_a_calibrated_group_schedule_within_its_target():
    # k = 4 records a user, user-level (8.0, 1e-5): noise calibrated at record level (2.0, delta')
    g = GroupConversion.for_user_budget(4, 8.0, 1e-5, "certified")
    z = calibrate_noise_multiplier(lambda s: G(s), 2.0, g.record_delta, 10)
    acc = accountant_for(G(z), g, 8.0)
    for _ in range(10):
        assert acc.epsilon_if(G(z), 1e-5) <= 8.0 * (1 + 1e-9)  # the budget check passes
        acc.compose(G(z))
    assert 8.0 * 0.99 <= acc.epsilon(1e-5) <= 8.0 * (1 + 1e-9)
    assert acc.epsilon(1e-5) == pytest.approx(
        4 * analytic_gaussian_epsilon(z / math.sqrt(10), 1e-5 / (4 * math.exp(3 * 8.0 / 4))),
        rel=2e-3,
    )


# -- the ledger ----------------------------------------------------------------------------------
def _ledger(guarantee: str = "certified", mechanism: str = "gaussian", entries=2) -> Ledger:
    led = Ledger(
        unit="user",
        adjacency=ADJACENCY,
        accounting="certified",
        guarantee=guarantee,
        mechanism=mechanism,
        accountant="dp_accounting.PLDAccountant (RDP cross-check)",
        delta=1e-5,
        target_epsilon=2.0,
        notes=["N is public"],
        extra={"k": 2},
    )
    for r in range(1, entries + 1):
        led.entries.append(
            LedgerEntry(r, str(sampled_gaussian(1.1, 0.05)), 1.1, 0.77, 0.05, 0.5 * r, 0.6 * r)
        )
    return led


def test_ledger_dict_has_every_field_and_round_trips_through_json():
    led = _ledger()
    d = led.to_dict()
    for key in (
        "unit",
        "adjacency",
        "accounting",
        "guarantee",
        "mechanism",
        "accountant",
        "delta",
        "target_epsilon",
        "notes",
        "entries",
        "extra",
        "epsilon",
        "epsilon_kind",
        "rounds_released",
    ):
        assert key in d, key
    assert d["unit"] == "user" and d["adjacency"] == "add_or_remove_one"
    assert d["epsilon"] == 1.0 and d["rounds_released"] == 2  # the last entry's epsilon
    assert d["entries"][1] == {
        "round": 2,
        "event": str(sampled_gaussian(1.1, 0.05)),
        "noise_multiplier": 1.1,
        "noise_std": 0.77,
        "sampling_rate": 0.05,
        "epsilon": 1.0,
        "epsilon_rdp": 1.2,
    }
    back = json.loads(json.dumps(d))
    assert back == d
    # the dict rebuilds the very ledger (derived keys aside)
    fields = {
        k: v for k, v in back.items() if k not in ("epsilon", "epsilon_kind", "rounds_released")
    }
    rebuilt = Ledger(**{**fields, "entries": [LedgerEntry(**e) for e in fields["entries"]]})
    assert rebuilt == led and asdict(rebuilt) == asdict(led)


def test_ledger_marks_heuristic_and_certified_epsilon():
    assert _ledger("certified").to_dict()["epsilon_kind"] == "certified"
    assert _ledger("heuristic").to_dict()["epsilon_kind"] == "heuristic"
    fresh = _ledger("heuristic", entries=0)  # private, nothing released yet
    assert fresh.private and fresh.epsilon == 0.0 and fresh.to_dict()["rounds_released"] == 0
    # a non-private run has no epsilon at all, and no kind for it
    plain = _ledger("certified", mechanism="none", entries=0)
    assert not plain.private and plain.epsilon is None
    d = plain.to_dict()
    assert d["epsilon"] is None and d["epsilon_kind"] is None


# -- the ledger at a small, constant cost per round (docs/results/ledger/README.md) ---------------
# Beyond accountant_mod.EXACT_ROUNDS rounds of a run the accountant reads epsilon off a grid of
# counts: an upper envelope at most LEDGER_TOL above dp-accounting's direct computation (a fresh
# PLDAccountant composing SelfComposedDpEvent(event, rounds) at the same grid), never below it.
# Every "want" below is that direct computation on literal events.
HUANG = dp_accounting.PoissonSampledDpEvent(
    1 / 2000, dp_accounting.GaussianDpEvent(0.6129660146601268)
)


def assert_tracks(got: float, want: float, tol: float = 1e-3) -> None:
    """The ledger's epsilon: a valid upper bound on the direct one (up to float noise), <= tol above."""
    assert want - 1e-9 <= got <= want + tol, (got, want)


def test_constants_of_the_envelope():
    assert accountant_mod.LEDGER_TOL == 1e-3 and accountant_mod.EXACT_ROUNDS == 32


def test_huang_alg1_event_4000_rounds_within_1e_3_of_direct():
    # the preset's event: Poisson q = 1/2000, z calibrated for (1.0, 1e-5) over 4,000 rounds
    acc = accountant_for(HUANG, None, 1.0)
    assert acc.pld_interval == 1e-4 and acc.target_epsilon == 1.0
    got, k = {}, 0
    for stop in (33, 100, 1000, 4000):
        acc.compose(HUANG, stop - 1 - k)
        assert acc.epsilon_if(HUANG, 1e-5) <= 1.0  # the budget check passes
        acc.compose(HUANG)
        k = stop
        got[stop] = acc.epsilon(1e-5)
    assert acc.runs == [[HUANG, 4000]]  # no round forgotten
    want = {
        stop: direct_pld(dp_accounting.SelfComposedDpEvent(HUANG, stop), 1e-5)
        for stop in (100, 4000)
    }
    assert want[4000] == pytest.approx(0.99140716, abs=1e-7)  # the direct value, on record
    for stop in (100, 4000):
        assert_tracks(got[stop], want[stop])
    assert got[33] < got[100] < got[1000] < got[4000] <= 1.0
    # a twin that forgot 100 of the 4,000 rounds is below the direct value: caught
    assert direct_pld(dp_accounting.SelfComposedDpEvent(HUANG, 3900), 1e-5) < got[4000] - 1e-3


def test_exact_up_to_exact_rounds_and_a_forgetful_twin_is_caught():
    ev = dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.1))

    class Forgetful(Accountant):  # the weakened twin: loses round 7
        def compose(self, event, count=1):
            self.n = getattr(self, "n", 0) + count
            if self.n != 7:
                super().compose(event, count)

    for cls, ok in ((Accountant, True), (Forgetful, False)):
        acc = cls()
        for _ in range(20):
            acc.compose(ev)
        want = direct_pld(
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.1)), 20
            ),
            1e-5,
        )
        if ok:
            assert acc.epsilon(1e-5) == want  # bit for bit at <= 32 rounds
        else:
            with pytest.raises(AssertionError):
                assert_tracks(acc.epsilon(1e-5), want)


def test_long_runs_of_several_events_track_the_direct_computation():
    q01 = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0))
    gauss = dp_accounting.GaussianDpEvent(20.0)
    sgd = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(0.1, G(2.0)), 5)
    for ev, rounds in ((q01, 300), (gauss, 60), (sgd, 120)):
        acc, values = Accountant(), []
        for _ in range(rounds):
            acc.compose(ev)
            values.append(acc.epsilon(1e-5))
        for k in (40, rounds // 2 + 1, rounds):
            assert_tracks(values[k - 1], direct_pld(dp_accounting.SelfComposedDpEvent(ev, k), 1e-5))
        assert values == sorted(values)  # the envelope never goes down


def test_a_mixed_sequence_of_two_events():
    a = dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.1))
    b = dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(2.5))
    acc = Accountant()
    acc.compose(a, 40)
    for _ in range(50):  # the second run, after a 40-round prefix
        acc.compose(b)
    want = direct_pld(
        dp_accounting.ComposedDpEvent(
            [dp_accounting.SelfComposedDpEvent(a, 40), dp_accounting.SelfComposedDpEvent(b, 50)]
        ),
        1e-5,
    )
    assert_tracks(acc.epsilon(1e-5), want)
    assert acc.runs == [[a, 40], [b, 50]]
    # alternating releases: every state is a short run, computed exactly
    alt = Accountant()
    for ev in (a, b, a, b, a):
        alt.compose(ev)
    assert alt.epsilon(1e-5) == direct_pld(
        dp_accounting.ComposedDpEvent(
            [dp_accounting.SelfComposedDpEvent(e, 1) for e in (a, b, a, b, a)]
        ),
        1e-5,
    )
    # the RDP cross-check: dp-accounting's RDP on the same composition
    assert acc.epsilon_rdp(1e-5) == pytest.approx(
        direct_rdp(
            dp_accounting.ComposedDpEvent(
                [dp_accounting.SelfComposedDpEvent(a, 40), dp_accounting.SelfComposedDpEvent(b, 50)]
            ),
            1e-5,
        ),
        rel=1e-12,
    )


def test_parallel_parts_with_idle_rounds_track_their_own_direct_computation():
    # one part releases while the other idles (NoOp), as in Huang Alg. 2 and phased algorithms
    ev = dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.0))
    noop = dp_accounting.NoOpDpEvent()
    acc = ParallelAccountant(2)
    for r in range(120):
        acc.compose(Parallel((ev, noop) if r % 3 else (noop, ev)))
    w0 = direct_pld(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.0)), 80
        ),
        1e-5,
    )
    w1 = direct_pld(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.0)), 40
        ),
        1e-5,
    )
    p0, p1 = acc.part_epsilons(1e-5)
    assert_tracks(p0, w0)
    assert_tracks(p1, w1)
    assert acc.epsilon(1e-5) == max(p0, p1)
    # idle rounds release nothing: the epsilon is that of the releases alone
    assert acc.parts[1].runs[0] == [ev, 1] and len(acc.parts[1].runs) > 40


def test_group_conversion_over_a_long_run():
    g = GroupConversion.for_user_budget(2, 2.0, 1e-5, "certified")
    ev = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.2))
    acc = accountant_for(ev, g, 2.0)
    for _ in range(200):
        acc.compose(ev)
    record_delta = 1e-5 / (2 * math.exp(2.0 / 2))  # literal: delta/(k e^{(k-1)eps/k})
    want = direct_pld(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.2)), 200
        ),
        record_delta,
    )
    assert_tracks(acc.record_epsilon(), want)
    assert acc.epsilon(1e-5) == 2 * acc.record_epsilon()


def test_cached_paths_equal_dp_accounting_and_do_not_depend_on_the_caches():
    # the direct engine is dp-accounting's PLDAccountant, bit for bit, for every kind of event
    for ev in (
        HUANG,
        dp_accounting.SelfComposedDpEvent(HUANG, 7),
        G(2.0),
        dp_accounting.ComposedDpEvent([dp_accounting.LaplaceDpEvent(3.0), G(4.0)]),
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(0.1, G(1.5)), 4),
        dp_accounting.PoissonSampledDpEvent(0.2, G(MAX_NOISE_MULTIPLIER)),
    ):  # sparse PLD
        assert pld_fast.direct_pld_epsilon(ev, 1e-5, 1e-4) == direct_pld(ev, 1e-5), ev
    # the cached self-composition: dp-accounting's (exact()) and its rounding twin (compose())
    fast = pld_fast.fast_pld(1 / 2000, 0.6129660146601268, 1e-4)
    pmf = fast.raw._pmf_remove
    for k in (1, 10, 300):
        theirs, exact, twin = pmf.self_compose(k), fast.remove.exact(k), fast.remove.compose(k)
        assert exact._lower_loss == theirs._lower_loss and (exact._probs == theirs._probs).all()
        assert exact._infinity_mass == theirs._infinity_mass
        assert twin._lower_loss == theirs._lower_loss
        assert abs(twin._probs - theirs._probs).max() < 1e-15
    # a run asked round by round and one recomposed at once from cold caches: the same numbers
    ev = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0))
    live = Accountant(1e-4, 3.0)
    seen = []
    for _ in range(150):
        live.epsilon_if(ev, 1e-5)
        live.compose(ev)
        seen.append(live.epsilon(1e-5))
    accountant_mod.forget_all()  # every cache: a fresh process's state
    resumed = Accountant(1e-4, 3.0)
    resumed.compose(ev, 100)  # a checkpoint's 100 rounds, recomposed
    assert resumed.epsilon(1e-5) == seen[99]
    for r in range(100, 150):
        resumed.compose(ev)
        assert resumed.epsilon(1e-5) == seen[r]
    assert resumed.epsilon_rdp(1e-5) == live.epsilon_rdp(1e-5)


def test_epsilon_if_is_the_next_state_and_mutates_nothing_in_a_long_run():
    ev = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0))
    other = dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.0))
    acc = Accountant()
    acc.compose(ev, 80)
    acc.compose(ApproxDp(0.1, 1e-7))
    runs, blocks, before = copy.deepcopy(acc.runs), list(acc.blocks), acc.epsilon(1e-5)
    for e, count in (
        (ev, 1),
        (ev, 30),
        (other, 2),
        (ApproxDp(0.2), 1),
        (dp_accounting.NoOpDpEvent(), 5),
    ):
        asked = acc.epsilon_if(e, 1e-5, count)
        assert acc.runs == runs and acc.blocks == blocks and acc.epsilon(1e-5) == before
        twin = copy.deepcopy(acc)
        twin.compose(e, count)
        assert asked == twin.epsilon(1e-5), e  # the same state, the same number
        assert asked >= before


@pytest.mark.parametrize("block", [0.0, 0.3])
def test_budget_stop_falls_where_the_exact_epsilon_puts_it(block):
    # a fixed noise multiplier runs until the next round would exceed the target: the envelope
    # must not stop it early. Target: just above the direct epsilon of 90 rounds (plus a one-off
    # block of epsilon 0.3 spent up front, as AboveThreshold's, in the second case).
    ev = dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.1))
    eps90 = direct_pld(dp_accounting.SelfComposedDpEvent(ev, 90), 1e-5)
    eps91 = direct_pld(dp_accounting.SelfComposedDpEvent(ev, 91), 1e-5)
    target = block + eps90 + 0.1 * (eps91 - eps90)
    acc, rounds = Accountant(1e-4, target_epsilon=target), 0  # the grid of eps90
    if block:
        acc.compose(ApproxDp(block))
    while acc.epsilon_if(ev, 1e-5) <= target * (1 + 1e-9):
        acc.compose(ev)
        rounds += 1
        assert acc.epsilon(1e-5) <= target
    assert rounds == 90
    assert_tracks(acc.epsilon(1e-5), block + eps90)
    if block:
        return
    # a calibrated schedule runs to its last round
    z = calibrate_noise_multiplier(lambda s: sampled_gaussian(s, 0.05), 2.0, 1e-5, 150)
    acc = accountant_for(sampled_gaussian(z, 0.05), None, 2.0)
    for _ in range(150):
        assert acc.epsilon_if(sampled_gaussian(z, 0.05), 1e-5) <= 2.0 * (1 + 1e-9)
        acc.compose(sampled_gaussian(z, 0.05))
    assert_tracks(
        acc.epsilon(1e-5),
        direct_pld(
            dp_accounting.SelfComposedDpEvent(sampled_gaussian(z, 0.05), 150),
            1e-5,
            pld_interval(2.0),
        ),
    )


def test_without_dp_accountings_internals_the_public_path_gives_the_same_epsilon(monkeypatch):
    """The cached fast paths read dp-accounting 0.6's internals; where those are not there
    (another version), the accountant falls back to dp-accounting's public computation and
    never reads an empty capture as epsilon 0."""
    import dp_accounting

    from fedudp.privacy import pld_fast as A

    ev = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.1)),
            dp_accounting.LaplaceDpEvent(20.0),
        ]
    )
    direct = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4
    )
    direct.compose(dp_accounting.SelfComposedDpEvent(ev, 40))
    want = direct.get_epsilon(1e-5)
    for cache in (A._CAPTURED, A._EPSILON, A._FAST, A._RAW):
        cache.clear()

    class Elsewhere:  # a PLDAccountant that keeps its PLD under another name
        def __init__(self, *a, **k):
            self.inner = dp_accounting.pld.PLDAccountant(*a, **k)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(A.pld_privacy_accountant, "PLDAccountant", Elsewhere)
    monkeypatch.setattr(
        A.FastPLD,
        "__init__",
        lambda self, q, z, interval: (
            (
                setattr(self, "raw", A.raw_sampled_gaussian(q, z, interval)),
                setattr(self, "dense", False),
            )
            and None
        ),
    )
    acc = Accountant(1e-4)
    acc.compose(ev, 40)
    assert acc.epsilon(1e-5) == pytest.approx(want, rel=1e-9) and want > 0.5
    for cache in (A._CAPTURED, A._EPSILON, A._FAST, A._RAW):
        cache.clear()


# -- noise too small for a PLD: RDP accounts for it (no 76 GiB allocation) ------------------------
def test_a_gaussian_whose_pld_would_not_fit_is_accounted_with_rdp():
    tiny = dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(0.001))
    acc = Accountant(1e-4)
    acc.compose(tiny, 2)
    assert acc.primary == "rdp" and accountant_mod.pld_too_large(tiny)
    rdp = rdp_privacy_accountant.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    rdp.compose(dp_accounting.SelfComposedDpEvent(tiny, 2))
    assert acc.epsilon(1e-5) == pytest.approx(rdp.get_epsilon(1e-5), rel=1e-9)
    # a usable noise stays on PLD, with dp-accounting's PLD value
    ok = dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(0.5))
    acc = Accountant(1e-4)
    acc.compose(ok, 2)
    pld = pld_privacy_accountant.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4
    )
    pld.compose(dp_accounting.SelfComposedDpEvent(ok, 2))
    assert acc.primary == "pld" and not accountant_mod.pld_too_large(ok)
    assert acc.epsilon(1e-5) == pytest.approx(pld.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("z", [0.05, 0.2, 1.0])
def test_the_pld_size_estimate_bounds_dp_accountings_pld(z):
    """The estimate that routes tiny noise to RDP is an upper bound on the size of the PLD
    dp-accounting builds (within a factor 2 of it: it does not route usable noise away)."""
    pld = dp_accounting.pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=z, value_discretization_interval=1e-4
    )
    size = max(len(pld._pmf_remove._probs), len(pld._pmf_add._probs))  # noqa: SLF001
    est = bounded.gaussian_pld_points(z, 1e-4)
    assert size <= est <= 1.05 * size


def test_a_run_with_too_little_noise_is_a_one_line_budget_error(tmp_path):
    from conftest import tiny_cfg
    from fedudp.run import run

    cfg = tiny_cfg("full_dp", **{"privacy__noise_multiplier": 0.001, "train__rounds": 2})
    with pytest.raises(ConfigError, match=r"privacy.epsilon=.*noise multiplier 0.001 exceeds it"):
        run(cfg, tmp_path)


# -- a PLD's size asked again (every run of the same schedule calibrates again) -------------------
def test_a_pld_size_asked_again_rebuilds_no_pld_and_is_the_same(monkeypatch):
    """The sizes that gate PLD against RDP (``_SIZES``) are kept between calls: asking again
    (a calibration repeated for the same schedule visits the same noise multipliers) builds no
    PLD, and from cold caches the size is the same."""
    A = accountant_mod
    ev = dp_accounting.SelfComposedDpEvent(sampled_gaussian(1.0, 0.01), 100)
    size = bounded.pld_size(ev, 1e-4)
    assert 0 < size <= A.MAX_PLD_WINDOW
    built: list = []
    init = pld_fast.FastPLD.__init__

    def counting(self, *a):
        built.append(a)
        init(self, *a)

    monkeypatch.setattr(pld_fast.FastPLD, "__init__", counting)
    assert bounded.pld_size(ev, 1e-4) == size and built == []  # nothing rebuilt
    for cache in (bounded._SIZES, pld_fast._FAST, pld_fast._RAW):
        cache.clear()
    assert bounded.pld_size(ev, 1e-4) == size and built == [(0.01, 1.0, 1e-4)]  # rebuilt, the same
