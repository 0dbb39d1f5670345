"""Banded matrix factorization (BSR): its constants, the noise it releases, its event, its
participation.

Literal constants: the square root of the prefix-sum matrix has coefficients
binom(2k, k) / 4^k = 1, 1/2, 3/8, 5/16, 35/128, ...; with 4 bands ||c||² = 1 + 1/4 + 9/64 +
25/256 = 381/256 = 1.48828125."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch

from fedudp.aggregators import BandedMatrixAggregator, GaussianAggregator, Sampling
from fedudp.aggregators.banded import bsr_coefficients, strategy_matrix
from fedudp.aggregators.base import ParameterError
from fedudp.protocol.contributions import Contribution
from fedudp.config import ConfigError
from tests.conftest import tiny_cfg


def test_bsr_coefficients_are_the_square_root_of_the_prefix_sum():
    assert bsr_coefficients(5).tolist() == [1.0, 0.5, 0.375, 0.3125, 0.2734375]
    c = bsr_coefficients(4)
    assert float(c @ c) == 381 / 256
    # unbanded (b = T): C·C is the prefix-sum matrix exactly (lower-triangular ones)
    T = 7
    C = strategy_matrix(T, T) * math.sqrt(float(bsr_coefficients(T) @ bsr_coefficients(T)))
    np.testing.assert_allclose(C @ C, np.tril(np.ones((T, T))), atol=1e-12)


def test_sensitivity_under_cyclic_participation():
    """12 rounds, 4 bands: a unit of group g is in rounds g, g+4, g+8 (0-based); its columns'
    supports are disjoint, so ||C̃ Σ e_j||² is the number of its rounds (column norms 1, the
    last columns shorter). Two rounds closer than b apart overlap and cost more."""
    M = strategy_matrix(4, 12)
    norms = np.linalg.norm(M, axis=0)
    assert norms.max() == pytest.approx(1.0, abs=1e-12)
    for g in range(4):
        v = np.zeros(12)
        v[g::4] = 1.0
        assert np.linalg.norm(M @ v) ** 2 <= 3 + 1e-12
    v = np.zeros(12)
    v[0] = v[4] = v[8] = 1.0
    assert np.linalg.norm(M @ v) ** 2 == pytest.approx(3.0, abs=1e-12)
    close = np.zeros(12)
    close[0] = close[1] = 1.0  # 1 round apart: not allowed by the plan
    assert np.linalg.norm(M @ close) ** 2 > 2.5


def _noise(cls, reps: int = 400, dim: int = 50, T: int = 8, bands: int = 4) -> np.ndarray:
    """[T, reps * dim]: the noise w the billboard steps with (zero data), z = 1, C = 2."""
    out = np.zeros((T, reps * dim))
    g = torch.Generator().manual_seed(11)
    for r in range(reps):
        agg = cls(2.0, 1.0, Sampling(1 / bands, 4 * bands), bands=bands)
        for t in range(T):
            rel = agg.release(Contribution(None, torch.zeros(dim, dtype=torch.float64), 4), rng=g)
            out[t, r * dim : (r + 1) * dim] = rel.mean.numpy() * 4.0  # times the public N*q
    return out


class Unscaled(BandedMatrixAggregator):
    """A twin that forgets the column normalisation: w = C⁻¹ζ (too little noise by ||c||)."""

    def noise_increment(self, dim, rng):
        return super().noise_increment(dim, rng) / self.scale


class Independent(BandedMatrixAggregator):
    """A twin whose noise is not correlated across rounds (w_t = ||c|| ζ_t)."""

    def noise_increment(self, dim, rng):
        self._history = []
        return super().noise_increment(dim, rng)


@pytest.mark.parametrize(
    "cls,ok", [(BandedMatrixAggregator, True), (Unscaled, False), (Independent, False)]
)
def test_released_noise_is_exactly_the_accounted_gaussian(cls, ok):
    """C̃w must be white noise of std zC = 2 (the mechanism C̃x + ζ the ledger accounts)."""
    w = _noise(cls)
    zeta = strategy_matrix(4, 8) @ w
    std = zeta.std(axis=1)
    corr = np.corrcoef(zeta)[np.triu_indices(8, 1)]
    good = bool(np.all(np.abs(std / 2.0 - 1) < 0.03) and np.abs(corr).max() < 0.03)
    assert good is ok, (std, np.abs(corr).max())
    if cls is BandedMatrixAggregator:
        # and w itself is anti-correlated noise: prefix sums grow slower than independent noise
        assert w.sum(axis=0).std() < 2.0 * math.sqrt(8) * 0.9


def test_events_and_epsilon_against_dp_accounting():
    """12 rounds, q = 1/8, 4 bands: p = 1/2, cycles at rounds 1, 5, 9, each one
    PoissonSampled(1/2, Gaussian(1.2)); ε equals dp-accounting's PLD of three such steps.
    A twin that charges one cycle for the whole run claims less."""
    agg = BandedMatrixAggregator(1.0, 1.2, Sampling(0.125, 800), bands=4)
    assert agg.group_rate == 0.5
    events = [agg.round_event(r) for r in range(1, 13)]
    step = dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(1.2))
    assert [i for i, e in enumerate(events) if not isinstance(e, dp_accounting.NoOpDpEvent)] == [
        0,
        4,
        8,
    ]
    assert all(events[i] == step for i in (0, 4, 8))
    ours = dp_accounting.pld.PLDAccountant()
    ours.compose(dp_accounting.ComposedDpEvent(events))
    ref = dp_accounting.pld.PLDAccountant()
    ref.compose(dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(1.2)), 3)
    assert ours.get_epsilon(1e-5) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-9)
    once = dp_accounting.pld.PLDAccountant()
    once.compose(step)
    assert once.get_epsilon(1e-5) < ours.get_epsilon(1e-5) - 0.5
    # whole groups (the default b = 1/q): plain Gaussian per cycle
    whole = BandedMatrixAggregator(1.0, 1.2, Sampling(0.25, 800))
    assert (whole.bands, whole.group_rate) == (4, 1.0)
    assert whole.round_event(1) == dp_accounting.GaussianDpEvent(1.2)


def test_one_band_is_clip_plus_gaussian():
    """b = 1: no correlation, every unit in the one group at rate q: clip + Gaussian's event
    and the same calibrated multiplier."""
    s = Sampling(0.05, 2000)
    a = BandedMatrixAggregator.calibrated(
        clip=1.0, epsilon=2.0, delta=1e-5, rounds=30, sampling=s, bands=1
    )
    g = GaussianAggregator.calibrated(clip=1.0, epsilon=2.0, delta=1e-5, rounds=30, sampling=s)
    assert a.noise_multiplier == pytest.approx(g.noise_multiplier, rel=1e-12)
    assert a.dp_event() == g.dp_event()


def test_calibrated_meets_the_budget():
    agg = BandedMatrixAggregator.calibrated(
        clip=1.0, epsilon=2.0, delta=1e-5, rounds=20, sampling=Sampling(0.1, 1000), bands=5
    )
    acc = dp_accounting.pld.PLDAccountant()
    for r in range(1, 21):
        acc.compose(agg.round_event(r))
    assert 1.9 < acc.get_epsilon(1e-5) <= 2.0 + 1e-6


def test_participation_is_b_separated_and_stable_under_add_remove():
    agg = BandedMatrixAggregator(1.0, 1.0, Sampling(0.1, 3000), bands=5)
    plan = agg.participation(seed=3)
    masks = np.stack([plan.sample(r) for r in range(1, 21)])
    for i in range(3000):  # any two rounds of a unit are >= 5 apart
        rounds = np.flatnonzero(masks[:, i])
        assert (np.diff(rounds) % 5 == 0).all() and (np.diff(rounds) >= 5).all()
        assert (rounds % 5 == plan.group[i]).all()
    assert masks.mean() == pytest.approx(0.1, abs=0.01)
    bigger = BandedMatrixAggregator(1.0, 1.0, Sampling(0.1, 3001), bands=5).participation(seed=3)
    assert (bigger.group[:3000] == plan.group).all()


def test_state_survives_a_checkpoint():
    a = BandedMatrixAggregator(1.0, 1.0, Sampling(0.25, 80))
    g = torch.Generator().manual_seed(0)
    c = Contribution(None, torch.zeros(4, dtype=torch.float64), 1)
    for _ in range(3):
        a.release(c, rng=g)
    b = BandedMatrixAggregator(1.0, 1.0, Sampling(0.25, 80))
    b.restore_checkpoint_state(a.checkpoint_state())
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(a.release(c, rng=g1).mean, b.release(c, rng=g2).mean)


def test_bad_bands_are_refused_naming_the_key():
    with pytest.raises(ParameterError, match="bands"):
        BandedMatrixAggregator(1.0, 1.0, Sampling(0.3, 100))  # 1/q not whole
    with pytest.raises(ParameterError, match="bands"):
        BandedMatrixAggregator(1.0, 1.0, Sampling(0.3, 100), bands=4)  # p = 1.2
    from fedudp import build

    for kw in ({"train__sampling_rate": 0.3}, {"train__sampling_rate": 0.5, "estimator__bands": 3}):
        cfg = tiny_cfg("full_dp", aggregator="dp_mf_banded", **kw)
        with pytest.raises(ConfigError, match="estimator.bands"):
            build.prepare(cfg)


def test_the_wrapper_refuses_an_estimator_with_its_own_participation():
    """The tree's and the banded mechanism's accounting rests on cyclic groups; the wrapper's
    Poisson user sampling would break it, so it refuses them with a one-line error."""
    from flwr.serverapp.strategy import FedAvg
    from fedudp.aggregators import BandedMatrixAggregator, Sampling, TreeAggregator
    from fedudp.flower import UserLevelDP

    for agg in (
        TreeAggregator(1.0, 2.0, Sampling(0.25, 100), rounds=8),
        BandedMatrixAggregator(1.0, 2.0, Sampling(0.25, 100)),
    ):
        with pytest.raises(ValueError, match="cyclic participation"):
            UserLevelDP(FedAvg(), agg, delta=1e-5)
