"""Withholding decided from public numbers only (issue 49, docs/algorithms.md#fail-closed).

Whether a round is released is itself an output. ``Billboard.withhold`` (both of fedudp's
engines) and ``fedudp.flower.UserLevelDP`` call one rule, ``fedudp.billboard.fail_closed``: the
owners that answered and their declared user slots, never the sampled count. Here, through the
real round loop (``run_rounds``) over a transport written here (4 owners of 10 users; owners
fail by index whatever their sample holds, as infrastructure does): the release decisions of a
federation, of its neighbours (one user removed at the failing owner or at an answering one, one
user added into a free declared slot) and of different Poisson samples (seeds) with the same
failing owners are identical. The weakened twin, the old rule (``train.min_users`` against the
sampled units the answering owners were sent), is caught by the same comparison. ``engine=flower``
asks every owner each round, so which owners fail cannot follow the sample either; its twin
(owners without sampled units not asked, as before) is caught. The local engine through
``run.execute`` is in tests/test_neighbours_paths.py, the Flower wrapper in
tests/engines/test_flower_withhold.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import fedudp.flower.strategy
from fedudp.aggregators import GaussianAggregator, MeanAggregator, Sampling
from fedudp.protocol.contributions import Constraint
from fedudp.billboard import fail_closed, release
from fedudp.billboard.rounds import Collected, Evaluation, run_rounds
from fedudp.billboard.server import Billboard
import fedudp.flower.wire as flower_wire
from fedudp.flower.server_app import FlowerTransport
from fedudp.flower.blocks import owner_blocks
from fedudp.privacy.accountant import ADJACENCY, Ledger, accountant_for
from fedudp.protocol.messages import Failure, make_reply

OWNERS, PER = 4, 10
N = OWNERS * PER
OWNER = np.repeat(np.arange(OWNERS), PER)
CAPACITY = (PER,) * OWNERS  # declared user slots
ROUNDS = 120
# owner 3 fails every round, owners 1 and 2 too in every fifth round (then 10 slots answer)
FAILING = {r: ({1, 2, 3} if r % 5 == 0 else {3}) for r in range(1, ROUNDS + 1)}
# neighbours of the federation: one user removed (at the failing owner, at an answering one),
# one added into a declared slot the base leaves free (user 9 of owner 0)
BASE_ABSENT = frozenset({9})
NEIGHBOURS = {
    "removed_at_failing": BASE_ABSENT | {35},
    "removed_at_answering": BASE_ABSENT | {14},
    "added": frozenset(),
}


class Owners:
    """The ``Transport`` protocol over in-memory users: user k's update is a fixed vector; the
    owners in ``failing[r]`` fail (``Failure(j, its sampled present units)``), every other owner
    replies on its own; ``absent`` users hold no data (a declared slot without a user)."""

    def __init__(self, constraint, failing, absent=frozenset()):
        self.constraint, self.failing, self.absent = constraint, failing, absent

    def train(self, shared, cohort, round_):
        present = np.array([u for u in cohort if u not in self.absent], dtype=np.int64)
        replies, failures = [], []
        for j in range(OWNERS):
            mine = present[OWNER[present] == j]
            if j in self.failing.get(round_, ()):
                failures.append(Failure(j, len(mine), "owner unreachable"))
                continue
            G = torch.ones(len(mine), 2, dtype=torch.float64) * torch.tensor(mine + 1.0)[:, None]
            replies.append(make_reply(G / N, ("w",), self.constraint))
        return Collected(replies, failures)

    def evaluate(self, shared, round_, while_waiting=None):
        if while_waiting is not None:
            while_waiting()
        return Evaluation(np.zeros(OWNERS), np.zeros(OWNERS))

    def personal(self):
        return {}

    def info(self):
        return {}


def board(seed, rate, min_users, cls=Billboard, private=False):
    """A real billboard over the 40 users; non-private unless ``private`` (the decision reads
    no accountant, and a non-private billboard runs many rounds fast)."""
    s = Sampling(rate, N)
    agg = GaussianAggregator(1.0, 2.0, s) if private else MeanAggregator(s)
    led = Ledger(
        unit="user",
        adjacency=ADJACENCY,
        accounting="certified",
        guarantee="certified",
        mechanism="gaussian" if private else "none",
        accountant="pld",
        delta=1e-5,
        target_epsilon=None,
    )
    acc = accountant_for(Billboard.first_event(agg), None, None) if private else None
    return cls(
        {"w": torch.zeros(2)},
        agg,
        s,
        led,
        acc,
        seed=seed,
        delta=1e-5 if private else None,
        min_users=min_users,
        owner_units=CAPACITY,
    )


def decisions(seed, absent, rate, min_users, cls=Billboard, rounds=ROUNDS, private=False) -> dict:
    """Every release decision of a run (and how it ended); the cohorts for the test's teeth."""
    bb = board(seed, rate, min_users, cls, private)
    cohorts, lines = [], []
    tr = Owners(bb.aggregator.constraint, FAILING, absent)
    inner = tr.train
    tr.train = lambda shared, cohort, r: (cohorts.append(cohort.copy()), inner(shared, cohort, r))[
        1
    ]
    res = run_rounds(rounds, rounds, bb, tr, np.ones(OWNERS), on_round=lines.append)
    return {
        "withheld": tuple(bb.withheld),
        "released": tuple(x["round"] for x in lines if "withheld" not in x),
        "stop": (res.stop_reason, res.rounds_completed),
        "_cohorts": cohorts,
        "_board": bb,
    }


def differences(rate, min_users, cls=Billboard, seeds=(0, 1, 2)) -> list[str]:
    """What differs between a federation and its neighbours (per seed), and between seeds."""
    public = ("withheld", "released", "stop")
    runs = {
        (s, name): decisions(s, absent, rate, min_users, cls)
        for s in seeds
        for name, absent in (("base", BASE_ABSENT), *NEIGHBOURS.items())
    }
    base = runs[seeds[0], "base"]
    found = [
        f"seed {s} {name}: {k}" for (s, name), v in runs.items() for k in public if v[k] != base[k]
    ]
    # the samples really differ between seeds (else the comparison across seeds has no teeth)
    assert len({tuple(map(len, runs[s, "base"]["_cohorts"])) for s in seeds}) == len(seeds)
    return found


# (q, train.min_users, rounds withheld): the audit's two cases, with one owner of four failing
# (30 slots answer, 10 in every fifth round)
CASES = [(0.02, 1, ()), (0.5, 18, tuple(range(5, ROUNDS + 1, 5))), (0.5, 31, "all")]


@pytest.mark.parametrize("rate,min_users,withheld", CASES)
def test_release_decisions_follow_only_the_failing_owners_and_declared_slots(
    rate, min_users, withheld
):
    assert differences(rate, min_users) == []
    got = decisions(0, BASE_ABSENT, rate, min_users)
    want = tuple(range(1, ROUNDS + 1)) if withheld == "all" else withheld
    assert got["withheld"] == want
    assert got["released"] == tuple(r for r in range(1, ROUNDS + 1) if r not in want)
    assert got["stop"] == (("failed", ROUNDS) if withheld == "all" else ("completed", ROUNDS))


def test_an_empty_sample_with_a_failing_owner_releases_the_noise_alone_as_accounted():
    got = decisions(0, BASE_ABSENT, 0.02, 1, rounds=12, private=True)
    empty = [r for r, c in enumerate(got["_cohorts"], 1) if not (OWNER[c] != 3).any()]
    assert empty and got["released"] == tuple(range(1, 13))  # released, run not stopped
    assert [e.round for e in got["_board"].ledger.entries] == list(range(1, 13))  # composed
    assert got["stop"] == ("completed", 12)


class SampledCount(Billboard):
    """The weakened twin: the rule before issue 49, ``train.min_users`` against the sampled
    units held by the owners that answered (a secret of the Poisson sample, and of the data:
    an absent user is no unit of its owner)."""

    absent: frozenset = BASE_ABSENT

    def withhold(self, round_, failed):
        cohort = np.flatnonzero(self.sample(round_))
        lost = sum(1 for u in cohort if OWNER[u] in failed and u not in self.absent)
        if failed and not (
            OWNERS - len(failed) >= self.min_owners and len(cohort) - lost >= self.min_users
        ):
            self.next_round = round_ + 1
            self.withheld.append(int(round_))
            return "withheld on the sampled count"
        return None


@pytest.mark.parametrize("rate,min_users", [(0.02, 1), (0.5, 18)])
def test_twin_reading_the_sampled_count_is_caught(rate, min_users):
    found = differences(rate, min_users, SampledCount)
    assert any(f.startswith("seed 1 base") for f in found), found  # across samples


def test_twin_is_caught_between_neighbours_of_one_sample():
    # the neighbour without user 35 (at the failing owner) under the same sample: its unit
    # counts as answering in the twin, so a round at the threshold differs
    class Neighbour(SampledCount):
        absent = NEIGHBOURS["removed_at_failing"]

    for seed in range(40):
        a = decisions(seed, BASE_ABSENT, 0.5, 18, SampledCount)["withheld"]
        b = decisions(seed, NEIGHBOURS["removed_at_failing"], 0.5, 18, Neighbour)["withheld"]
        if a != b:
            break
    assert a != b, "the twin was never caught between neighbours"
    # the rule itself, same seeds: never
    assert (
        decisions(seed, BASE_ABSENT, 0.5, 18)["withheld"]
        == decisions(seed, NEIGHBOURS["removed_at_failing"], 0.5, 18)["withheld"]
    )


def test_one_rule_for_both_engines():
    # both hold the release path, which calls the one rule (tests/billboard/test_release_path.py)
    assert fedudp.flower.strategy.ReleaseGate is release.ReleaseGate
    assert release.withhold_reason is fail_closed.withhold_reason
    assert fail_closed.answered_slots(CAPACITY, {3}) == 30
    assert fail_closed.answered_slots(CAPACITY, set()) == 40
    with pytest.raises(ValueError, match="outside 0..3"):
        fail_closed.answered_slots(CAPACITY, {4})
    # released exactly when both counts meet the minimum; the message names the keys
    assert fail_closed.withhold_reason(3, 30, 1, 3, 30) is None
    why = fail_closed.withhold_reason(3, 30, 1, 3, 31)
    assert why == (
        "3 owner(s) answered holding 30 user slot(s) (declared), 1 failed "
        "(train.min_owners=3, train.min_users=31)"
    )
    assert fail_closed.withhold_reason(2, 30, 2, 3, 1) is not None


# -- engine=flower: every owner is asked, so which owners fail does not follow the sample ------
class FakeFlowerTransport(FlowerTransport):
    """``FlowerTransport.train`` over a grid written here: owner 3 never answers (timeout)."""

    def __init__(self):  # no grid, no Ray: only what ``train`` reads
        self.fed = SimpleNamespace(
            num_owners=OWNERS,
            user_owner=OWNER,
            owner_user_offsets=np.arange(0, N + 1, PER),
            present=lambda cohort, owners=False: np.asarray(cohort)[np.asarray(cohort) < N],
        )
        self.owners = SimpleNamespace(
            spec=SimpleNamespace(cohort_is_owners=False), trains_personal=False, shared_dim=2
        )
        self.asked: list[list[int]] = []
        self.constraint = Constraint(rows=False, clip=1.0)
        self.blocks = owner_blocks(OWNERS, 1)  # the public plan: node k holds owner k

    def _message(self, j, round_, kind, shared, units=None):
        rec = flower_wire.run_record("{}", round_, j, units, Constraint(rows=False, clip=1.0))
        return SimpleNamespace(content={flower_wire.K_RUN: rec})

    def _exchange(self, msgs, round_, while_waiting=None, stage="owners"):
        self.asked.append(sorted(msgs))
        return {}, {j: "timeout" for j in msgs if j == 3}


class OnlySampledOwners(FakeFlowerTransport):
    """The weakened twin: owners without sampled units are not asked (the transport before
    issue 49), so owner 3 fails only in rounds where the sample gave it units."""

    def _exchange(self, msgs, round_, while_waiting=None, stage="owners"):
        sampled = {
            j: m
            for j, m in msgs.items()
            if len(flower_wire.read_units(m.content[flower_wire.K_RUN])[0])
        }
        return super()._exchange(sampled, round_, while_waiting, stage)


def failed_owner_sets(transport, rate=0.02, rounds=60) -> set[tuple[int, ...]]:
    bb = board(0, rate, 1)
    out = set()
    for r in range(1, rounds + 1):
        got = transport.train({"w": torch.zeros(2)}, np.flatnonzero(bb.sample(r)), r)
        out.add(tuple(f.owner for f in got.failures))
    return out


def test_engine_flower_asks_every_owner_each_round():
    tr = FakeFlowerTransport()
    assert failed_owner_sets(tr) == {(3,)}  # whatever the sample
    assert all(asked == list(range(OWNERS)) for asked in tr.asked)
    # the twin: owner 3's failure (and so the decision) follows its sampled units
    assert failed_owner_sets(OnlySampledOwners()) == {(), (3,)}


def test_prepare_refuses_a_minimum_no_federation_can_meet():
    from conftest import tiny_cfg  # 4 owners, 160 one-record users

    from fedudp import build
    from fedudp.config import ConfigError

    with pytest.raises(ConfigError, match="train.min_owners=5: there are only 4 owners"):
        build.prepare(tiny_cfg("full_dp", train__min_owners=5))
    with pytest.raises(ConfigError, match="train.min_users=161: .* declared user slots total 160"):
        build.prepare(tiny_cfg("full_dp", train__min_users=161))
    assert build.prepare(tiny_cfg("full_dp", train__min_owners=4, train__min_users=160)).billboard
