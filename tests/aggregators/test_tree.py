"""DP-FTRL tree aggregation: the noise its prefix sums carry, its event, its participation.

Literal constants: a tree of 8 rounds has depth ceil(log2 9) = 4; the noise of the prefix sum
after round t is the sum of popcount(t) independent nodes (t = 1..8: 1 1 2 1 2 2 3 1)."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant

from fedudp.aggregators import Sampling, TreeAggregator
from fedudp.aggregators.base import ParameterError
from fedudp.protocol.contributions import Contribution
from fedudp.aggregators.tree import tree_depth, tree_event
from fedudp.config import ConfigError
from tests.conftest import tiny_cfg

POPCOUNT = [1, 1, 2, 1, 2, 2, 3, 1]


def _prefix_noise(cls, reps: int = 600, dim: int = 64, k: int = 8) -> np.ndarray:
    """[t, reps * dim]: the noise of the released prefix sums (zero data), z = 1, C = 2."""
    out = np.zeros((k, reps * dim))
    g = torch.Generator().manual_seed(3)
    for r in range(reps):
        agg = cls(2.0, 1.0, Sampling(1 / k, 80), rounds=k)
        s = np.zeros(dim)
        for t in range(k):
            rel = agg.release(Contribution(None, torch.zeros(dim, dtype=torch.float64), 10), rng=g)
            s = s + rel.mean.numpy() * 10  # times the public N/k = 10
            out[t, r * dim : (r + 1) * dim] = s
    return out


class NoSubtract(TreeAggregator):
    """A twin that adds each new node without removing the nodes it replaces."""

    def noise_increment(self, dim, rng):
        if self._t == self.k:
            self._t, self._stack = 0, []
        self._t += 1
        fresh = self.noise_std * torch.randn(dim, generator=rng, dtype=torch.float64)
        self._stack.append((self._t & -self._t, fresh))
        return fresh


class HalfNoise(TreeAggregator):
    """A twin whose nodes carry half the std the ledger is told."""

    @property
    def noise_std(self):
        return 0.5 * self.noise_multiplier * self.clip


@pytest.mark.parametrize(
    "cls,ok", [(TreeAggregator, True), (NoSubtract, False), (HalfNoise, False)]
)
def test_prefix_sums_carry_exactly_the_accounted_noise(cls, ok):
    noise = _prefix_noise(cls)
    want = 2.0 * np.sqrt(POPCOUNT)  # zC sqrt(#nodes tiling [1, t])
    got = noise.std(axis=1)
    assert np.abs(noise.mean(axis=1)).max() < 0.1
    assert bool(np.all(np.abs(got / want - 1) < 0.03)) is ok, (got, want)


def test_a_restart_begins_a_fresh_tree():
    agg = TreeAggregator(1.0, 1.0, Sampling(0.25, 40), rounds=12)
    g = torch.Generator().manual_seed(0)
    held = []
    for _ in range(12):
        agg.release(Contribution(None, torch.zeros(3, dtype=torch.float64), 1), rng=g)
        held.append((agg._t, len(agg._stack)))
    assert held == [(1, 1), (2, 1), (3, 2), (4, 1)] * 3


def test_depth_and_sensitivity_counts():
    assert [tree_depth(k) for k in (1, 2, 3, 4, 7, 8, 9)] == [1, 2, 2, 3, 3, 4, 4]
    # the completed dyadic nodes containing each leaf of an 8-round tree: at most 4
    k = 8
    nodes = [
        (s, e) for size in (1, 2, 4, 8) for s in range(1, k + 1, size) if (e := s + size - 1) <= k
    ]
    assert max(sum(s <= leaf <= e for s, e in nodes) for leaf in range(1, k + 1)) == 4


def test_event_is_dp_accountings_tree_event():
    """3 trees of 4 rounds, z = 3: the ledger's events' RDP equals dp-accounting's
    SingleEpochTreeAggregationDpEvent (its REPLACE_SPECIAL relation), and its PLD value is
    no larger; a twin that ignores the depth (plain z) claims less."""
    agg = TreeAggregator(1.0, 3.0, Sampling(0.25, 400), rounds=12)
    events = [agg.round_event(r) for r in range(1, 13)]
    assert events[0] == dp_accounting.GaussianDpEvent(3.0 / math.sqrt(3))
    assert all(isinstance(e, dp_accounting.NoOpDpEvent) for i, e in enumerate(events) if i % 4)
    ours = rdp_privacy_accountant.RdpAccountant()
    ours.compose(dp_accounting.ComposedDpEvent(events))
    ref = rdp_privacy_accountant.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL
    )
    ref.compose(dp_accounting.SingleEpochTreeAggregationDpEvent(3.0, 4), 3)
    assert ours.get_epsilon(1e-5) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-9)
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(dp_accounting.ComposedDpEvent(events))
    assert pld.get_epsilon(1e-5) <= ref.get_epsilon(1e-5)
    twin = dp_accounting.pld.PLDAccountant()
    twin.compose(dp_accounting.GaussianDpEvent(3.0), 3)
    assert twin.get_epsilon(1e-5) < pld.get_epsilon(1e-5) - 0.1
    # a short last tree: 10 rounds = 4 + 4 + 2, the last of depth 2
    short = TreeAggregator(1.0, 3.0, Sampling(0.25, 400), rounds=10)
    assert (
        short.round_event(9)
        == tree_event(3.0, 2)
        == dp_accounting.GaussianDpEvent(3.0 / math.sqrt(2))
    )


def test_calibrated_meets_the_budget():
    agg = TreeAggregator.calibrated(
        clip=1.0, epsilon=2.0, delta=1e-5, rounds=20, sampling=Sampling(0.2, 1000)
    )
    acc = dp_accounting.pld.PLDAccountant()
    for r in range(1, 21):
        acc.compose(agg.round_event(r))
    assert acc.get_epsilon(1e-5) <= 2.0 + 1e-6
    assert acc.get_epsilon(1e-5) > 1.9


def test_participation_is_once_per_tree_and_stable_under_add_remove():
    agg = TreeAggregator(1.0, 1.0, Sampling(0.25, 1000), rounds=8)
    plan = agg.participation(seed=7)
    masks = np.stack([plan.sample(r) for r in range(1, 9)])
    assert (masks[:4].sum(0) == 1).all() and (masks[4:].sum(0) == 1).all()
    assert (masks[:4] == masks[4:]).all()
    bigger = TreeAggregator(1.0, 1.0, Sampling(0.25, 1001), rounds=8).participation(seed=7)
    assert (bigger.group[:1000] == plan.group).all()  # one more unit moves no other


def test_state_survives_a_checkpoint():
    a = TreeAggregator(1.0, 1.0, Sampling(0.125, 80), rounds=8)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        a.release(Contribution(None, torch.zeros(4, dtype=torch.float64), 1), rng=g)
    b = TreeAggregator(1.0, 1.0, Sampling(0.125, 80), rounds=8)
    b.restore_checkpoint_state(a.checkpoint_state())
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    c = Contribution(None, torch.zeros(4, dtype=torch.float64), 1)
    assert torch.equal(a.release(c, rng=g1).mean, b.release(c, rng=g2).mean)


def test_a_rate_that_is_not_one_over_k_is_refused():
    with pytest.raises(ParameterError, match="sampling"):
        TreeAggregator(1.0, 1.0, Sampling(0.3, 100), rounds=4)
    from fedudp import build

    cfg = tiny_cfg("full_dp", aggregator="dp_ftrl_tree", train__sampling_rate=0.3)
    with pytest.raises(ConfigError, match="train.sampling_rate"):
        build.prepare(cfg)


def test_an_unreachable_budget_names_the_runs_rounds(monkeypatch):
    # issue 49: 1e8 rounds were refused "in 1 rounds" (the whole run's event is calibrated as
    # one release); the refusal names the run's rounds, pluralised, and what to change
    from fedudp.aggregators import plain_values, tree
    from fedudp.privacy.accountant import BudgetError, rounds_text

    def refused(calibrate_fn):
        monkeypatch.setattr(tree, "calibrate", calibrate_fn)
        with pytest.raises(ParameterError) as e:
            TreeAggregator.calibrated(
                clip=1.0, epsilon=1.0, delta=1e-5, rounds=10**8, sampling=Sampling(1.0, 1000)
            )
        return e.value

    err = refused(plain_values.calibrate)
    config = err.facts["config"]
    assert isinstance(config, BudgetError)
    assert "is unreachable in 100,000,000 rounds even with noise multiplier" in str(config)
    assert str(config).endswith("lower train.rounds or raise privacy.epsilon")
    assert "is not met in 100,000,000 rounds even" in str(err)
    # the weakened twin: the run's rounds not passed (the message said "in 1 rounds")
    twin = refused(lambda f, e, d, r, **kw: plain_values.calibrate(f, e, d, r))
    assert "in 1 round even" in str(twin.facts["config"])
    assert "100,000,000" not in str(twin.facts["config"])
    assert [rounds_text(n) for n in (1, 2, 1000)] == ["1 round", "2 rounds", "1,000 rounds"]
