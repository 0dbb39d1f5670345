"""Adaptive clipping (Andrew et al. 2021): what it releases and what the ledger is told.

Constants are literal here, not read back from the module: z_update for z = 1 and σ_b = 5 is
(1 - 1/100)^(-1/2) = 1.005037815259212, and a run of 10 rounds at q = 0.1 is one
PoissonSampledDpEvent(0.1, GaussianDpEvent(1.0)) composed 10 times in dp-accounting.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch

from fedudp.aggregators import AdaptiveClipGaussian, Sampling
from fedudp.aggregators.adaptive_clip import (
    effective_noise_multiplier,
    next_clip,
    update_noise_multiplier,
)
from fedudp.aggregators.base import ParameterError
from fedudp.protocol.contributions import Contribution
from fedudp.config import ConfigError
from fedudp.privacy.accountant import Accountant
from tests.conftest import tiny_cfg


def test_update_multiplier_split_has_the_papers_constant():
    assert update_noise_multiplier(1.0, 5.0) == pytest.approx(1.005037815259212, rel=1e-12)
    assert effective_noise_multiplier(1.005037815259212, 5.0) == pytest.approx(1.0, rel=1e-12)
    with pytest.raises(ParameterError, match="clip_count_noise"):
        update_noise_multiplier(2.0, 1.0)  # 2 σ_b = z: nothing left for the update


def _eps(event, rounds: int, delta: float = 1e-5) -> float:
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(event, rounds)
    return acc.get_epsilon(delta)


def test_round_event_is_the_effective_gaussian_and_the_ledger_agrees():
    agg = AdaptiveClipGaussian(1.0, 1.0, Sampling(0.1, 1000), count_noise=5.0)
    assert agg.dp_event() == dp_accounting.PoissonSampledDpEvent(
        0.1, dp_accounting.GaussianDpEvent(1.0)
    )
    direct = _eps(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.0)), 10)
    acc = Accountant()
    for _ in range(10):
        acc.compose(agg.dp_event())
    assert acc.epsilon(1e-5) == pytest.approx(direct, abs=1e-3)
    # the weakened twin: accounting only the update's share (forgetting the count) claims less
    twin = _eps(
        dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.005037815259212)),
        10,
    )
    assert twin < direct - 1e-3


def test_calibrated_meets_the_budget_and_splits_the_noise():
    s = Sampling(0.2, 500)
    agg = AdaptiveClipGaussian.calibrated(clip=1.0, epsilon=2.0, delta=1e-5, rounds=20, sampling=s)
    assert agg.count_noise == pytest.approx(100 / 20)  # expected cohort / 20
    assert effective_noise_multiplier(agg.update_multiplier, agg.count_noise) == pytest.approx(
        agg.noise_multiplier, rel=1e-12
    )
    assert _eps(agg.dp_event(), 20) <= 2.0 + 1e-6
    with pytest.raises(ParameterError, match="clip_count_noise"):
        AdaptiveClipGaussian.calibrated(
            clip=1.0, epsilon=2.0, delta=1e-5, rounds=20, sampling=s, clip_count_noise=0.1
        )


def _release_many(agg_cls, reps: int, count: int, clipped: int):
    """The released mean's noise (times qN) and the released unclipped fraction, ``reps`` times
    from an all-zero sum, at a fixed clip."""
    means, fracs = [], []
    g = torch.Generator().manual_seed(0)
    for _ in range(reps):
        agg = agg_cls(2.0, 1.0, Sampling(0.5, 200), count_noise=4.0, clip_lr=1e-9)
        c = Contribution(None, torch.zeros(50, dtype=torch.float64), count, clipped)
        out = agg.release(c, rng=g)
        means.append(out.mean.numpy() * 100)
        fracs.append(out.diagnostics["unclipped_fraction_noisy"])
    return np.concatenate(means), np.asarray(fracs)


class HalfCountNoise(AdaptiveClipGaussian):
    """A weakened twin: the count's noise drawn at half the std the ledger is told."""

    def release(self, c, *, rng):
        self.count_noise /= 2
        try:
            return super().release(c, rng=rng)
        finally:
            self.count_noise *= 2


@pytest.mark.parametrize("cls,ok", [(AdaptiveClipGaussian, True), (HalfCountNoise, False)])
def test_released_noise_has_the_accounted_scales(cls, ok):
    """The update sum's noise std is z_update * C, the count's is σ_b (measured)."""
    noise, frac = _release_many(cls, 4000, count=100, clipped=30)
    z_upd = update_noise_multiplier(1.0, 4.0)  # 1.0080000...: literal below
    assert z_upd == pytest.approx((1 - 1 / 64) ** -0.5, rel=1e-12)
    assert noise.std() == pytest.approx(z_upd * 2.0, rel=0.02)
    # Σ(b_i - 1/2) = 70 - 50 = 20 before noise; fraction = (20 + N(0, 16)) / 100 + 1/2
    count_noise = (frac - 0.5) * 100 - 20
    assert abs(count_noise.mean()) < 0.3
    assert (abs(float(count_noise.std()) - 4.0) < 0.2) is ok


def test_clip_follows_the_target_quantile_on_known_norms():
    """Norms uniform on [0, 10] each round: the 0.3-quantile is 3."""
    rng = np.random.default_rng(1)
    agg = AdaptiveClipGaussian(
        0.1, 1.0, Sampling(1.0, 2000), quantile=0.3, clip_lr=0.2, count_noise=5.0
    )
    g = torch.Generator().manual_seed(1)
    clips = []
    for _ in range(300):
        norms = rng.uniform(0, 10, 2000)
        dirs = rng.normal(size=(2000, 4))
        G = torch.from_numpy(dirs / np.linalg.norm(dirs, axis=1, keepdims=True) * norms[:, None])
        agg.release(agg.constraint.apply(G), rng=g)
        clips.append(agg.clip)
    assert np.mean(clips[-100:]) == pytest.approx(3.0, abs=0.15)
    assert clips[0] < 0.2  # it started far below


def test_next_clip_is_geometric():
    assert next_clip(2.0, 0.8, 0.5, 0.2) == pytest.approx(2.0 * math.exp(-0.2 * 0.3))
    assert next_clip(2.0, 0.5, 0.5, 0.2) == 2.0


def test_state_survives_a_checkpoint():
    a = AdaptiveClipGaussian(1.0, 1.0, Sampling(1.0, 100))
    a.release(Contribution(None, torch.zeros(3), 100, 100), rng=torch.Generator().manual_seed(0))
    b = AdaptiveClipGaussian(1.0, 1.0, Sampling(1.0, 100))
    b.restore_checkpoint_state(a.checkpoint_state())
    assert b.clip == a.clip != 1.0


@pytest.mark.parametrize(
    "kw,key",
    [
        ({"aggregator": "winsorized"}, "privacy.clip_policy"),
        (
            {"privacy.placement": "local_dpsgd", "privacy.clip_count_noise": 0.01},
            "privacy.clip_count_noise",
        ),
        ({"privacy.clip_quantile": 1.0}, "privacy.clip_quantile"),
        ({"privacy.clip_count_noise": 0.01}, "privacy.clip_count_noise"),
    ],
)
def test_config_errors_name_the_key(kw, key):
    from fedudp import build

    cfg = tiny_cfg(
        "full_dp",
        **{"privacy__clip_policy": "adaptive", **{k.replace(".", "__"): v for k, v in kw.items()}},
    )
    with pytest.raises(ConfigError, match=key):
        build.prepare(cfg)
