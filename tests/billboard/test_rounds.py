"""The guard of ``fedudp/billboard/rounds.py``: THE round loop (``run_rounds``), its stops, metrics
lines and checkpoints, driven through the ``Transport`` protocol.

A small fake transport written here answers for the owners: unit k's vector is the gradient
u - t_k of 0.5·||u - t_k||² (so every round depends on the last), built into replies with
``make_reply`` as owners build them; it can fail units or owners and scores owners with fixed
numbers. The billboard is a real one built from plain values, so the loop itself is under test:
the expected shared parameters follow in closed form, epsilons come from fresh accountants.
"""

from __future__ import annotations

import math
import signal
from dataclasses import asdict

import dp_accounting
import numpy as np
import pytest
import torch

from conftest import interrupt_after
from fedudp.aggregators import GaussianAggregator, MeanAggregator, Sampling
from fedudp.aggregators.base import Aggregate
from fedudp.protocol.contributions import Contribution
from fedudp.billboard.server import Billboard, ServerStep
from fedudp.protocol.checkpoint import Checkpointer
from fedudp.protocol.messages import Failure, OwnerReply, make_reply
from fedudp.billboard.rounds import Collected, Evaluation, completion_notes, run_rounds
from fedudp.privacy.accountant import ADJACENCY, Ledger, accountant_for

N = 6  # units (users): owner 0 holds 0..2, owner 1 3..5
OWNER = np.array([0, 0, 0, 1, 1, 1])
CAPACITY = (3, 3)  # each owner's declared user slots (the fail-closed rule's public count)
TARGETS = torch.tensor(
    [
        [1.0, 0.0, 2.0, -1.0, 0.5],
        [3.0, 1.0, 0.0, 0.0, 0.5],
        [-1.0, 2.0, 1.0, 1.0, 0.5],
        [0.0, 0.0, 0.0, 4.0, 0.5],
        [2.0, -2.0, 3.0, 0.0, 0.5],
        [1.0, 1.0, 0.0, 2.0, 0.5],
    ]
)
TBAR = TARGETS.mean(0)
LR = 0.5
TEST_SIZES = np.array([10, 30, 0])  # the third owner has no test records
DELTA = 1e-5


class FakeTransport:
    """The ``Transport`` protocol over in-memory units (train / evaluate / personal / info and
    the checkpoint hooks). ``nan_round``: every row non-finite; ``lost``: round -> the owners
    whose units fail (reported as ``Failure``); ``nan_total_round``: a reply whose sum is NaN."""

    def __init__(self, constraint, nan_round=None, lost=None, nan_total_round=None, eval_lost=None):
        self.constraint = constraint
        self.nan_round, self.lost = nan_round, lost or {}
        self.nan_total_round, self.eval_lost = nan_total_round, eval_lost or {}
        self.trained: list[tuple[int, np.ndarray, torch.Tensor]] = []
        self.evaluated: list[tuple[int, torch.Tensor, bool]] = []
        self.restored = None

    def train(self, shared, cohort, round_):
        u = torch.cat([shared[k].reshape(-1) for k in shared])
        self.trained.append((round_, cohort.copy(), u.clone()))
        replies, failures = [], []
        for j in (0, 1):
            units = cohort[OWNER[cohort] == j]
            if j in self.lost.get(round_, ()):
                failures.append(Failure(j, int(len(units)), "owner unreachable"))
                continue
            G = u.unsqueeze(0) - TARGETS[units]
            if round_ == self.nan_round:
                G = torch.full_like(G, math.nan)
            replies.append(make_reply(G, tuple(shared), self.constraint))
        if round_ == self.nan_total_round:
            replies = [
                OwnerReply(
                    tuple(shared), Contribution(None, torch.full((5,), math.nan), len(cohort))
                )
            ]
        return Collected(replies, failures)

    def evaluate(self, shared, round_, while_waiting=None):
        if while_waiting is not None:
            while_waiting()
        u = torch.cat([shared[k].reshape(-1) for k in shared])
        self.evaluated.append((round_, u.clone(), while_waiting is not None))
        acc = np.array([0.1 * round_, 0.5, 0.9])
        loss = np.array([1.0, 2.0, 3.0]) * (round_ + 1)
        failures = []
        if round_ in self.eval_lost:
            acc[1] = loss[1] = np.nan
            failures = [Failure(1, 0, self.eval_lost[round_])]
        return Evaluation(acc, loss, failures)

    def personal(self):
        return {}

    def info(self):
        return {"transport": "fake"}

    def will_checkpoint(self, round_, folder):
        pass

    def checkpoint_state(self, round_):
        return {"trained_rounds": [r for r, _, _ in self.trained]}

    def restore(self, state, folder):
        self.restored = state


def shared0():
    return {"w": torch.zeros(3), "b": torch.zeros(2)}


def ledger(private: bool, target=None) -> Ledger:
    return Ledger(
        unit="user",
        adjacency=ADJACENCY,
        accounting="certified",
        guarantee="certified",
        mechanism="gaussian" if private else "none",
        accountant="pld",
        delta=DELTA,
        target_epsilon=target,
    )


def mean_board(aggregator=None) -> Billboard:
    s = Sampling(1.0, N)
    return Billboard(
        shared0(),
        aggregator or MeanAggregator(s),
        s,
        ledger(False),
        seed=0,
        step=ServerStep(LR, "gradient"),
        owner_units=CAPACITY,
    )


def gaussian_board(z=20.0, rate=1.0, target=None, seed=0) -> Billboard:
    s = Sampling(rate, N)
    agg = GaussianAggregator(10.0, z, s)
    return Billboard(
        shared0(),
        agg,
        s,
        ledger(True, target),
        accountant_for(Billboard.first_event(agg), None, target),
        seed=seed,
        step=ServerStep(LR, "gradient"),
        target_epsilon=target,
        delta=DELTA,
        owner_units=CAPACITY,
    )


def u_after(r: int) -> torch.Tensor:
    """Closed form of u_r = u_{r-1} - LR·(u_{r-1} - t̄) from u_0 = 0 (every unit, plain mean)."""
    return TBAR * (1 - (1 - LR) ** r)


def run(bb, transport, rounds=3, eval_every=1, checkpoint=None):
    lines = []
    res = run_rounds(
        rounds, eval_every, bb, transport, TEST_SIZES, on_round=lines.append, checkpoint=checkpoint
    )
    return res, lines


def test_rounds_run_in_order_step_the_billboard_and_report_metrics():
    bb = mean_board()
    tr = FakeTransport(bb.aggregator.constraint)
    res, lines = run(bb, tr, rounds=3)
    assert (res.stop_reason, res.rounds_completed, res.message) == ("completed", 3, "")
    assert [r for r, _, _ in tr.trained] == [1, 2, 3]
    for r, cohort, u in tr.trained:  # each round trains at the previous round's broadcast
        assert np.array_equal(cohort, np.arange(N))
        torch.testing.assert_close(u, u_after(r - 1))
    torch.testing.assert_close(torch.cat([res.shared["w"], res.shared["b"]]), u_after(3))
    assert res.history == lines and [x["round"] for x in lines] == [1, 2, 3]
    for r, x in enumerate(lines, 1):
        assert {
            "round",
            "failed_owners",
            "cohort",
            "failed_units",
            "users_used",
            "agg_cohort",
            "epsilon",
            "loss",
            "accuracy_mean",
            "accuracy_std",
            "accuracy_weighted",
            "failed_eval_owners",
            "seconds",
        } <= set(x)
        assert (
            x["failed_owners"],
            x["cohort"],
            x["failed_units"],
            x["users_used"],
            x["agg_cohort"],
            x["epsilon"],
            x["failed_eval_owners"],
        ) == (0, 6, 0, 6, 6, None, 0)
        # the summary over owners with test records (sizes 10 and 30; the third has none)
        acc = [0.1 * r, 0.5]
        assert x["accuracy_mean"] == pytest.approx(np.mean(acc))
        assert x["accuracy_std"] == pytest.approx(np.std(acc))
        assert x["accuracy_weighted"] == pytest.approx((10 * acc[0] + 30 * acc[1]) / 40)
        assert x["loss"] == pytest.approx(1.5 * (r + 1))
        assert x["seconds"] >= 0
    assert "failures" not in lines[0]
    np.testing.assert_allclose(res.owner_accuracy, [0.3, 0.5, 0.9])
    assert res.personal == {} and res.extra == {"transport": "fake"}
    assert [e.round for e in bb.ledger.entries] == [1, 2, 3]


def test_eval_every_cadence_and_the_last_round():
    bb = mean_board()
    tr = FakeTransport(bb.aggregator.constraint)
    res, lines = run(bb, tr, rounds=5, eval_every=2)
    # every 2nd round and the last one; the budget check overlaps all but the last evaluation
    assert [(r, waited) for r, _, waited in tr.evaluated] == [(2, True), (4, True), (5, False)]
    assert [("accuracy_mean" in x) for x in lines] == [False, True, False, True, True]
    torch.testing.assert_close(tr.evaluated[-1][1], u_after(5))
    np.testing.assert_allclose(res.owner_accuracy, [0.5, 0.5, 0.9])


def test_budget_stop_releases_exactly_the_rounds_the_target_allows():
    event = dp_accounting.GaussianDpEvent(20.0)
    target = 0.26
    acc = accountant_for(event, None, target)
    eps = []
    for _ in range(3):
        acc.compose(event)
        eps.append(acc.epsilon(DELTA))
    assert eps[1] < target < eps[2]  # ε after 2 rounds fits, after 3 does not
    bb = gaussian_board(20.0, target=target)
    tr = FakeTransport(bb.aggregator.constraint)
    res, lines = run(bb, tr, rounds=6)
    assert (res.stop_reason, res.rounds_completed) == ("budget", 2)
    assert [r for r, _, _ in tr.trained] == [1, 2]  # round 3 never trained
    assert [e.round for e in bb.ledger.entries] == [1, 2]  # nor released
    assert [x["epsilon"] for x in lines] == eps[:2]
    assert [r for r, _, _ in tr.evaluated] == [1, 2]  # no evaluation beyond
    # a target below one round's ε: nothing released, the initial parameters evaluated
    bb0 = gaussian_board(20.0, target=eps[0] / 2)
    tr0 = FakeTransport(bb0.aggregator.constraint)
    res0, lines0 = run(bb0, tr0, rounds=3)
    assert (res0.stop_reason, res0.rounds_completed, lines0, tr0.trained) == ("budget", 0, [], [])
    assert bb0.ledger.entries == [] and [r for r, _, _ in tr0.evaluated] == [0]
    torch.testing.assert_close(torch.cat([res0.shared["w"], res0.shared["b"]]), torch.zeros(5))


def test_diverged_on_a_non_finite_step_keeps_the_last_finite_parameters():
    bb = mean_board()
    tr = FakeTransport(bb.aggregator.constraint, nan_total_round=2)
    res, lines = run(bb, tr, rounds=4)
    assert (res.stop_reason, res.rounds_completed) == ("diverged", 2)
    assert res.message.startswith("round 2: the shared parameters became non-finite")
    torch.testing.assert_close(torch.cat([res.shared["w"], res.shared["b"]]), u_after(1))
    assert [r for r, _, _ in tr.trained] == [1, 2] and len(bb.ledger.entries) == 2
    # round 2 is recorded unevaluated; the final evaluation scores the last finite parameters
    assert [x["round"] for x in lines] == [1, 2] and "accuracy_mean" not in lines[1]
    assert [r for r, _, _ in tr.evaluated] == [1, 2]
    torch.testing.assert_close(tr.evaluated[-1][1], u_after(1))


def test_a_round_whose_every_sampled_unit_fails_is_released_and_named_not_a_stop():
    # in a private run, whether the run goes on must not depend on those users' data: a
    # neighbour without them releases the noise alone and continues, so the round is released
    # (zero contributed, accounted) and the run's end names it
    bb = gaussian_board(z=2.0)
    tr = FakeTransport(bb.aggregator.constraint, nan_round=2)
    res, lines = run(bb, tr, rounds=4)
    assert (res.stop_reason, res.rounds_completed) == ("completed", 4)
    assert lines[1]["failed_units"] == 6 and lines[1]["users_used"] == 0
    assert lines[1]["all_units_nonfinite"] is True
    assert "every sampled unit's vector was non-finite (rounds 2;" in res.message
    assert [e.round for e in bb.ledger.entries] == [1, 2, 3, 4]
    assert not any(x.get("all_units_nonfinite") for i, x in enumerate(lines) if i != 1)


def test_without_privacy_every_sampled_unit_failing_stops_diverged():
    bb = mean_board()
    tr = FakeTransport(bb.aggregator.constraint, nan_round=2)
    res, lines = run(bb, tr, rounds=4)
    assert (res.stop_reason, res.rounds_completed) == ("diverged", 2)
    assert "every sampled unit failed (6 of 6" in res.message
    assert lines[1]["failed_units"] == 6 and lines[1]["users_used"] == 0
    # nothing was contributed: the mean of no vectors is zero and u did not move
    torch.testing.assert_close(torch.cat([res.shared["w"], res.shared["b"]]), u_after(1))


def test_a_completed_run_with_withheld_rounds_names_them_at_its_end():
    bb = gaussian_board(z=2.0)
    res, _ = run(bb, FakeTransport(bb.aggregator.constraint, lost={2: (0, 1)}), rounds=3)
    assert res.stop_reason == "completed"
    assert res.message.startswith("1 of 3 rounds withheld (rounds 2)")
    ok = gaussian_board(z=2.0)
    res_ok, _ = run(ok, FakeTransport(ok.aggregator.constraint), rounds=3)
    assert res_ok.message == ""  # nothing to say: every round released
    # the note is written once, in the round loop both engines run
    assert completion_notes([{"round": 1}, {"round": 2, "withheld": "x"}], 2).startswith(
        "1 of 2 rounds withheld (rounds 2)"
    )


# -- fail closed (Billboard.withhold) -------------------------------------------------------------
def fresh_epsilon(z: float, releases: int, rate: float = 1.0) -> float:
    """dp-accounting's PLD for ``releases`` Poisson(rate)-sampled Gaussian(z) releases."""
    acc = dp_accounting.pld.PLDAccountant()
    if releases:
        acc.compose(
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(z)),
                releases,
            )
        )
    return acc.get_epsilon(DELTA)


def test_every_owner_failing_releases_nothing_spends_nothing_and_ends_failed():
    bb = gaussian_board(z=2.0)
    tr = FakeTransport(bb.aggregator.constraint, lost={r: (0, 1) for r in (1, 2, 3)})
    res, lines = run(bb, tr, rounds=3)
    assert res.stop_reason == "failed" and "every round was withheld" in res.message
    assert bb.ledger.entries == [] and bb.ledger.epsilon == 0.0
    assert bb.accountant.epsilon(DELTA) == 0.0  # nothing composed
    torch.testing.assert_close(torch.cat([res.shared["w"], res.shared["b"]]), torch.zeros(5))
    assert bb.withheld == [1, 2, 3] and [x["round"] for x in lines] == [1, 2, 3]
    for x in lines:  # why, and each owner's reason, in the metrics line
        assert "nothing released" in x["withheld"] and "epsilon" not in x
        assert [f["reason"] for f in x["failures"]] == ["owner unreachable"] * 2
    # the same run without failures releases every round (the test has teeth)
    ok = gaussian_board(z=2.0)
    res_ok, _ = run(ok, FakeTransport(ok.aggregator.constraint), rounds=3)
    assert res_ok.stop_reason == "completed" and len(ok.ledger.entries) == 3


def test_a_withheld_round_spends_nothing_and_the_next_rounds_release():
    bb = gaussian_board(z=2.0)
    tr = FakeTransport(bb.aggregator.constraint, lost={2: (0, 1)})
    res, lines = run(bb, tr, rounds=4)
    assert res.stop_reason == "completed" and res.rounds_completed == 4
    assert [e.round for e in bb.ledger.entries] == [1, 3, 4] and bb.withheld == [2]
    assert bb.ledger.epsilon == pytest.approx(fresh_epsilon(2.0, 3), rel=1e-3)
    assert "withheld" in lines[1] and "epsilon" not in lines[1]
    # round 3 trained at the parameters round 1 released: round 2 moved nothing
    assert torch.equal(tr.trained[2][2], tr.trained[1][2])


def test_min_owners_and_min_users_count_answering_owners_and_their_declared_slots():
    # one owner of two lost: released under the default minimum (1 owner, 1 user slot) ...
    bb = gaussian_board(z=2.0)
    run(bb, FakeTransport(bb.aggregator.constraint, lost={1: (1,)}), rounds=1)
    assert [e.round for e in bb.ledger.entries] == [1]
    # ... withheld when 2 owners must answer
    bb2 = gaussian_board(z=2.0)
    bb2.min_owners = 2
    res2, _ = run(bb2, FakeTransport(bb2.aggregator.constraint, lost={1: (1,)}), rounds=1)
    assert bb2.ledger.entries == [] and res2.stop_reason == "failed"
    # ... or when the answering owner declares fewer user slots than min_users (3 < 4)
    bb3 = gaussian_board(z=2.0)
    bb3.min_users = 4
    res3, lines3 = run(bb3, FakeTransport(bb3.aggregator.constraint, lost={1: (1,)}), rounds=1)
    assert bb3.ledger.entries == []
    assert "holding 3 user slot(s) (declared)" in lines3[0]["withheld"]
    # every owner answering always meets a minimum the declared capacities can meet: an empty
    # Poisson sample releases the noise alone, as accounted (withholding it would make the
    # release depend on the sample)
    bb4 = gaussian_board(z=2.0, rate=1e-9)
    bb4.min_owners, bb4.min_users = 2, 6
    res4, lines4 = run(bb4, FakeTransport(bb4.aggregator.constraint), rounds=2)
    assert [x["cohort"] for x in lines4] == [0, 0] and len(bb4.ledger.entries) == 2
    assert res4.stop_reason == "completed"
    # the same empty sample with owner 1 failing, 3 slots answering >= 3: released
    bb5 = gaussian_board(z=2.0, rate=1e-9)
    bb5.min_users = 3
    run(bb5, FakeTransport(bb5.aggregator.constraint, lost={1: (1,), 2: (1,)}), rounds=2)
    assert len(bb5.ledger.entries) == 2 and bb5.withheld == []


def test_a_minimum_no_federation_can_meet_is_refused():
    with pytest.raises(ValueError, match="train.min_owners=3: there are only 2 owners"):
        Billboard(
            shared0(),
            MeanAggregator(Sampling(1.0, N)),
            Sampling(1.0, N),
            ledger(False),
            seed=0,
            min_owners=3,
            owner_units=CAPACITY,
        )
    with pytest.raises(ValueError, match="train.min_users=7: the owners' declared user slots"):
        Billboard(
            shared0(),
            MeanAggregator(Sampling(1.0, N)),
            Sampling(1.0, N),
            ledger(False),
            seed=0,
            min_users=7,
            owner_units=CAPACITY,
        )


def test_without_declared_capacities_a_failure_is_refused_not_guessed():
    bb = gaussian_board(z=2.0)
    bb.owner_units = None
    assert bb.withhold(1, []) is None  # nothing failed: nothing to decide
    with pytest.raises(ValueError, match="no declared owner capacities"):
        bb.withhold(1, [1])


def test_a_checkpoint_after_a_withheld_round_resumes(tmp_path):
    bb = gaussian_board(z=2.0)
    ck = Checkpointer(tmp_path, every=1, keep=5)
    run(bb, FakeTransport(bb.aggregator.constraint, lost={2: (0, 1)}), rounds=3, checkpoint=ck)
    state = bb.state()
    assert state["withheld"] == [2] and [e["round"] for e in state["entries"]] == [1, 3]
    fresh = gaussian_board(z=2.0)
    fresh.restore(state)
    assert fresh.next_round == 4 and fresh.withheld == [2]
    assert fresh.accountant.epsilon(DELTA) == bb.accountant.epsilon(DELTA)


def test_failures_reported_by_the_transport_appear_in_the_metrics():
    bb = mean_board()
    tr = FakeTransport(bb.aggregator.constraint, lost={2: (0,)}, eval_lost={3: "eval timeout"})
    res, lines = run(bb, tr, rounds=3)
    assert res.stop_reason == "completed"
    assert lines[1]["failed_owners"] == 1 and lines[1]["failed_units"] == 3
    assert lines[1]["failures"] == [{"owner": 0, "units": 3, "reason": "owner unreachable"}]
    assert lines[1]["users_used"] == 3 and lines[1]["cohort"] == 6
    assert "failures" not in lines[0] and lines[0]["failed_units"] == 0
    # round 2 stepped on owner 1's units only: u_2 = u_1 - LR·(u_1 - mean(t_3..t_5))
    u1 = u_after(1)
    u2 = u1 - LR * (u1 - TARGETS[3:].mean(0))
    torch.testing.assert_close(tr.trained[2][2], u2)
    # an evaluation failure: reported, and the owner left out of the summary
    assert lines[2]["failed_eval_owners"] == 1
    assert lines[2]["failed_eval"] == [{"owner": 1, "units": 0, "reason": "eval timeout"}]
    assert lines[2]["accuracy_mean"] == pytest.approx(0.1 * 3)
    assert lines[2]["accuracy_weighted"] == pytest.approx(0.1 * 3)


class HaltOnSecond(MeanAggregator):
    """The plain mean whose second release says stop (as an AboveThreshold does)."""

    def __init__(self, sampling):
        super().__init__(sampling)
        self.calls = 0

    def release(self, c, *, rng=None):
        self.calls += 1
        agg = super().release(c, rng=rng)
        return Aggregate(agg.mean, agg.users_used, agg.diagnostics, halted=self.calls == 2)


def test_halted_release_is_recorded_and_does_not_step():
    bb = mean_board(HaltOnSecond(Sampling(1.0, N)))
    tr = FakeTransport(bb.aggregator.constraint)
    res, lines = run(bb, tr, rounds=4)
    assert (res.stop_reason, res.rounds_completed) == ("halted", 2)
    assert len(bb.ledger.entries) == 2 and [x["round"] for x in lines] == [1, 2]
    torch.testing.assert_close(torch.cat([res.shared["w"], res.shared["b"]]), u_after(1))


def test_interrupted_then_resumed_run_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    # Poisson sampling at rate 0.5 and Gaussian noise: cohorts and noise keyed by round
    whole = gaussian_board(z=20.0, rate=0.5, seed=5)
    tr_whole = FakeTransport(whole.aggregator.constraint)
    ref, ref_lines = run(whole, tr_whole, rounds=4)
    assert ref.stop_reason == "completed"

    # the same run, stopped by SIGINT right after round 2's checkpoint ...
    interrupt_after(monkeypatch, 2)
    first = gaussian_board(z=20.0, rate=0.5, seed=5)
    tr1 = FakeTransport(first.aggregator.constraint)
    stopped, _ = run(first, tr1, rounds=4, checkpoint=Checkpointer(tmp_path, every=1))
    assert (stopped.stop_reason, stopped.rounds_completed, stopped.signum) == (
        "interrupted",
        2,
        signal.SIGINT,
    )
    assert [r for r, _, _ in tr1.trained] == [1, 2] and len(first.ledger.entries) == 2
    monkeypatch.undo()

    # ... and resumed from it by a fresh billboard and transport
    ck = Checkpointer(tmp_path, every=1)
    assert ck.load_latest()["round"] == 2
    second = gaussian_board(z=20.0, rate=0.5, seed=5)
    tr2 = FakeTransport(second.aggregator.constraint)
    res, lines = run(second, tr2, rounds=4, checkpoint=ck)
    assert tr2.restored == {"trained_rounds": [1, 2]}
    assert [r for r, _, _ in tr2.trained] == [3, 4]
    assert (res.stop_reason, res.rounds_completed) == ("completed", 4)
    assert torch.equal(second.u, whole.u)
    assert [asdict(e) for e in second.ledger.entries] == [asdict(e) for e in whole.ledger.entries]
    for (r, c, u), (r2, c2, u2) in zip(tr_whole.trained[2:], tr2.trained):
        assert r == r2 and np.array_equal(c, c2) and torch.equal(u, u2)
    strip = lambda xs: [{k: v for k, v in x.items() if k != "seconds"} for x in xs]  # noqa: E731
    assert strip(res.history) == strip(ref_lines)
    assert [x["round"] for x in lines] == [3, 4]


def test_a_secure_run_resumes_with_fresh_entropy(tmp_path):
    """``Randomness.secure``: a run checkpointed after round 2 resumes (nothing to restore for
    the generators: the resumed rounds draw fresh OS entropy), its ledger continues 3, 4 with
    the accounted ε of 4 releases; the resumed rounds' cohorts are not the seeded ones."""
    from fedudp.randomness import Randomness

    def secure_board():
        bb = gaussian_board(z=2.0, rate=0.5, seed=5)
        bb.randomness = Randomness.secure(5)
        return bb

    first = secure_board()
    run(
        first,
        FakeTransport(first.aggregator.constraint),
        rounds=2,
        checkpoint=Checkpointer(tmp_path, every=1),
    )
    ck = Checkpointer(tmp_path, every=1)
    ck.resumed = ck.load_latest()
    assert ck.resumed["round"] == 2
    second = secure_board()
    tr = FakeTransport(second.aggregator.constraint)
    res, lines = run(second, tr, rounds=4, checkpoint=ck)
    assert (res.stop_reason, res.rounds_completed) == ("completed", 4)
    assert [e.round for e in second.ledger.entries] == [1, 2, 3, 4]
    assert second.ledger.epsilon == pytest.approx(fresh_epsilon(2.0, 4, 0.5), rel=1e-3)
    seeded = gaussian_board(z=2.0, rate=0.5, seed=5)
    assert any(not np.array_equal(c, np.flatnonzero(seeded.sample(r))) for r, c, _ in tr.trained)


class _GoneAt(FakeTransport):
    """Every owner lost from round ``at`` on, and no owner can answer again (``gone``)."""

    def __init__(self, constraint, at: int, say: bool = True) -> None:
        super().__init__(constraint, lost={r: (0, 1) for r in range(at, 10)})
        self.at, self.say = at, say

    def train(self, shared, cohort, round_):
        got = super().train(shared, cohort, round_)
        if round_ >= self.at and self.say:
            got.gone = "every Ray actor of the simulation is lost"
        return got


def test_a_transport_that_can_answer_no_more_ends_the_run_failed_after_that_round():
    bb = gaussian_board(z=2.0)
    res, lines = run(bb, _GoneAt(bb.aggregator.constraint, at=2), rounds=5)
    assert res.stop_reason == "failed" and res.rounds_completed == 2
    assert res.message == "round 2: every Ray actor of the simulation is lost; stopped after it"
    assert [e.round for e in bb.ledger.entries] == [1] and bb.withheld == [2]
    assert [x["round"] for x in lines] == [1, 2] and "withheld" in lines[1]
    # the twin that does not say so withholds every remaining round and calls the run completed
    twin = gaussian_board(z=2.0)
    res_twin, _ = run(twin, _GoneAt(twin.aggregator.constraint, at=2, say=False), rounds=5)
    assert res_twin.stop_reason == "completed" and twin.withheld == [2, 3, 4, 5]
