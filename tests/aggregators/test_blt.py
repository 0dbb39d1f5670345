"""BLT correlated noise (``aggregator=dp_mf_blt``): the streaming noise against C⁻¹ζ computed
densely, its memory, its event and ε, its participation, a real run's ledger, its sequence
audit, and the weakened twins each check catches."""

from __future__ import annotations

import json

import dp_accounting
import numpy as np
import pytest
import torch

from fedudp.aggregators import REGISTRY, BltAggregator, Sampling
from fedudp.aggregators.base import ParameterError
from fedudp.config import ConfigError
from fedudp.privacy.blt import blt_coefficients, minsep_sensitivity_squared
from fedudp.protocol.contributions import Contribution
from tests.conftest import tiny_cfg


def toeplitz(c: np.ndarray) -> np.ndarray:
    n = c.size
    m = np.zeros((n, n))
    for k, v in enumerate(c):
        m += v * np.eye(n, k=-k)
    return m


def streamed(agg: BltAggregator, dim: int, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """(w, ζ), each [n, dim]: the streamed noise and the ζ the same generator draws."""
    g, h = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    w = np.stack([agg.noise_increment(dim, g).numpy() for _ in range(agg.rounds)])
    zeta = np.stack(
        [
            (agg.noise_std * torch.randn(dim, generator=h, dtype=torch.float64)).numpy()
            for _ in range(agg.rounds)
        ]
    )
    return w, zeta


class DroppedBuffer(BltAggregator):
    """A twin that keeps only nbuf - 1 buffers (forgets the last one's contribution)."""

    def noise_increment(self, dim, rng):
        if self._state is not None:
            self._state[-1] = 0.0
        return super().noise_increment(dim, rng)


@pytest.mark.parametrize("cls,ok", [(BltAggregator, True), (DroppedBuffer, False)])
def test_streaming_noise_is_the_dense_inverse_times_zeta(cls, ok):
    agg = cls(1.5, 1.1, Sampling(0.25, 40), rounds=16, buffers=4)
    w, zeta = streamed(agg, dim=5)
    C = toeplitz(blt_coefficients(agg.theta, agg.omega, agg.rounds))
    dense = np.linalg.solve(C, zeta)
    assert np.allclose(w, dense, rtol=0, atol=1e-12) is ok
    # memory: nbuf model-sized float64 buffers, the state and nothing else
    assert agg._state is not None
    assert agg._state.shape == (4, 5) and agg._state.dtype == torch.float64
    assert set(agg.checkpoint_state()) == {"t", "buffers", "theta", "omega"}


def test_release_steps_with_the_sum_plus_noise_over_the_public_divisor():
    agg = BltAggregator(1.0, 1.0, Sampling(0.25, 40), rounds=4, buffers=3)
    total = torch.full((3,), 2.0, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    out = agg.release(Contribution(None, total, 7), rng=g)
    ref = BltAggregator(1.0, 1.0, Sampling(0.25, 40), rounds=4, buffers=3)
    w = ref.noise_increment(3, torch.Generator().manual_seed(0))
    torch.testing.assert_close(out.mean, (total + w) / 10.0, rtol=0, atol=1e-15)
    for _ in range(3):
        agg.release(Contribution(None, total, 7), rng=g)
    with pytest.raises(ValueError, match="train.rounds=4"):
        agg.release(Contribution(None, total, 7), rng=g)


def test_event_is_one_gaussian_and_epsilon_matches_dp_accounting():
    """z = 2 given: round 1 is GaussianDpEvent(2) for the whole run, the others nothing; the
    run's ε is the PLD ε of one Gaussian at the literal 2. A twin charging the Gaussian once per
    round claims a different (larger) ε, and one charging a single round's sensitivity would
    need a smaller ζ: the noise std is z·sens·clip with sens > 1."""
    agg = BltAggregator(0.5, 2.0, Sampling(0.125, 80), rounds=24, buffers=3)
    events = [agg.round_event(r) for r in range(1, 25)]
    assert events[0] == dp_accounting.GaussianDpEvent(2.0)
    assert all(isinstance(e, dp_accounting.NoOpDpEvent) for e in events[1:])
    ours = dp_accounting.pld.PLDAccountant()
    ours.compose(dp_accounting.ComposedDpEvent(events))
    ref = dp_accounting.pld.PLDAccountant()
    ref.compose(dp_accounting.GaussianDpEvent(2.0))
    assert ours.get_epsilon(1e-5) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-12)
    c = blt_coefficients(agg.theta, agg.omega, 24)
    assert agg.sensitivity**2 == pytest.approx(minsep_sensitivity_squared(c, 8, 24))
    assert agg.sensitivity > float(np.linalg.norm(c)) + 0.1  # k = 3 participations, not 1
    assert agg.noise_std == pytest.approx(2.0 * agg.sensitivity * 0.5)


def test_calibrated_meets_the_budget():
    agg = BltAggregator.calibrated(
        clip=1.0, epsilon=2.0, delta=1e-5, rounds=20, sampling=Sampling(0.25, 100), buffers=3
    )
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(agg.noise_multiplier))
    assert 1.99 < acc.get_epsilon(1e-5) <= 2.0 + 1e-6


class NoSeparation(BltAggregator):
    """A twin whose plan ignores the min-separation: every unit in every round."""

    def participation(self, seed):
        plan = super().participation(seed)
        plan.sample = lambda round_: np.ones(self.sampling.population, dtype=bool)
        return plan


class SingleParticipation(BltAggregator):
    """A twin whose sensitivity counts one participation (k = 1): ||C[:, 0]||."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.sensitivity = float(
            np.linalg.norm(blt_coefficients(self.theta, self.omega, self.rounds))
        )


@pytest.mark.parametrize(
    "cls,ok", [(BltAggregator, True), (NoSeparation, False), (SingleParticipation, False)]
)
def test_every_units_rounds_fit_the_stated_sensitivity(cls, ok):
    """Each unit's actual rounds under the plan: ||C 1_rounds|| <= the ledger's sensitivity."""
    agg = cls(1.0, 1.0, Sampling(0.25, 200), rounds=12, buffers=3)
    plan = agg.participation(seed=5)
    masks = np.stack([plan.sample(r) for r in range(1, 13)])  # [rounds, units]
    C = toeplitz(blt_coefficients(agg.theta, agg.omega, 12))
    worst = float(np.max(np.linalg.norm(C @ masks.astype(float), axis=0)))
    assert (worst <= agg.sensitivity + 1e-12) is ok, (worst, agg.sensitivity)


def test_bad_values_are_one_line_errors_naming_the_key():
    with pytest.raises(ParameterError, match="estimator.buffers"):
        BltAggregator(1.0, 1.0, Sampling(0.25, 40), rounds=8, buffers=0)
    with pytest.raises(ParameterError, match="estimator.min_separation"):
        BltAggregator(1.0, 1.0, Sampling(0.25, 40), rounds=8, min_separation=5)
    from fedudp import build

    for kw in (
        {"train__sampling_rate": 0.3},
        {"train__sampling_rate": 0.25, "estimator__min_separation": 6},
        {"train__sampling_rate": 0.25, "estimator__buffers": 99},
    ):
        cfg = tiny_cfg("full_dp", aggregator="dp_mf_blt", **kw)
        with pytest.raises(ConfigError, match="estimator.") as e:
            build.prepare(cfg)
        assert "\n" not in str(e.value)


def test_state_survives_a_checkpoint():
    a = BltAggregator(1.0, 1.0, Sampling(0.25, 40), rounds=8, buffers=3)
    g = torch.Generator().manual_seed(0)
    c = Contribution(None, torch.zeros(4, dtype=torch.float64), 1)
    for _ in range(3):
        a.release(c, rng=g)
    b = BltAggregator(1.0, 1.0, Sampling(0.25, 40), rounds=8, buffers=3)
    b.restore_checkpoint_state(a.checkpoint_state())
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(a.release(c, rng=g1).mean, b.release(c, rng=g2).mean)


def test_registered_beside_tree_and_banded():
    assert REGISTRY["dp_mf_blt"] is BltAggregator
    assert {"buffers", "min_separation"} <= {o.name for o in BltAggregator.options}


def test_a_local_run_states_the_mechanism_in_its_ledger(tmp_path):
    """A real run (engine=local, the synthetic default): ε is the PLD ε of GaussianDpEvent(z)
    at the summary's z, and the ledger names BLT, z, the sensitivity and the buffers."""
    from fedudp.run import run

    cfg = tiny_cfg(
        "full_dp",
        aggregator="dp_mf_blt",
        train__sampling_rate=0.25,
        train__rounds=4,
        estimator__buffers=3,
    )
    s = run(cfg, tmp_path)
    assert s["rounds_completed"] == 4 and s["aggregator"] == "dp_mf_blt"
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(s["noise_multiplier"]))
    assert s["epsilon"] == pytest.approx(acc.get_epsilon(s["delta"]), rel=1e-3)
    ledger = json.dumps(json.loads((tmp_path / "ledger.json").read_text()))
    agg = BltAggregator(1.0, s["noise_multiplier"], Sampling(0.25, 160), rounds=4, buffers=3)
    assert "buffered linear Toeplitz" in ledger and "3 buffers" in ledger
    assert f"z={s['noise_multiplier']:.6g}" in ledger
    assert f"sensitivity {agg.sensitivity:.6g}" in ledger


def test_sequence_audit_is_consistent_and_a_half_noise_twin_is_caught():
    from fedudp.audit import audit_sequence
    from fedudp.audit.sequence import SEQUENCE_AUDITED

    assert "dp_mf_blt" in SEQUENCE_AUDITED

    def make():
        return BltAggregator.calibrated(
            clip=1.0, epsilon=1.0, delta=1e-5, rounds=8, sampling=Sampling(0.25, 40), buffers=3
        )

    r = audit_sequence(make(), dim=2, trials=6_000, releases=8, delta=1e-5, seed=0)
    assert r.claimed_epsilon == pytest.approx(1.0, abs=2e-3)
    assert r.samples.gaussian_used and not r.violation, r.samples.bounds
    assert r.lower_bound > 0.5, r.samples.bounds
    w = audit_sequence(
        make(), dim=2, trials=6_000, releases=8, delta=1e-5, seed=0, broken="noise=0.5"
    )
    assert w.violation and w.lower_bound > 1.5, w.samples.bounds


def test_a_resumed_run_goes_on_with_the_checkpoints_matrix():
    """Another machine's optimiser may land a few ulps away: the resumed stream keeps the
    checkpoint's θ, ω (the whole run is one Toeplitz C, whose sensitivity z is relative to),
    and its noise equals the uninterrupted run's."""
    a = BltAggregator(1.0, 1.0, Sampling(0.25, 40), rounds=8, buffers=3)
    g = torch.Generator().manual_seed(0)
    c = Contribution(None, torch.zeros(4, dtype=torch.float64), 1)
    for _ in range(3):
        a.release(c, rng=g)
    state = a.checkpoint_state()
    b = BltAggregator(1.0, 1.0, Sampling(0.25, 40), rounds=8, buffers=3)
    b.theta = [t * (1 + 1e-9) for t in b.theta]  # a slightly different optimum
    b.restore_checkpoint_state(state)
    assert np.array_equal(b.theta, a.theta) and np.array_equal(b.omega, a.omega)
    assert b.sensitivity == a.sensitivity
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(a.release(c, rng=g1).mean, b.release(c, rng=g2).mean)
    with pytest.raises(ValueError, match="buffers"):
        BltAggregator(1.0, 1.0, Sampling(0.25, 40), rounds=8, buffers=2).restore_checkpoint_state(
            state
        )
