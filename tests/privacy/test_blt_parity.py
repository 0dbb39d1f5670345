"""ε parity of ``aggregator=dp_mf_blt`` with a published BLT setting of the reference.

The published side (literal constants below) is Google's federated-compute accounting for BLT
DP-FTRL: repository google-parfait/federated-compute, file
``fcp/confidentialcompute/python/accounting_test.py``, ``AccountingTest.test_zcdp_for_blt``
(added in commit 86887cbc804a, 2026-04-10; unchanged at de83f70c3b35, 2026-08-20) and its
inverse ``AccountingTest.test_noise_multiplier_for_blt`` (commit 3ee822d13772). A 4-buffer BLT
built with jax_privacy's ``BufferedToeplitz`` (``buf_decay`` = θ, ``output_scale`` = ω), over
``total_steps`` n = 100 with ``min_separation`` b = 50 and ``max_participations`` 2 (or None:
ceil(n / b) = 2), at ``noise_multiplier`` 1.0 (noise std over the clip) is ρ-zCDP with
ρ = 3.17226586 (``assertAlmostEqual(..., places=6)``), ρ = sens² / (2 z²); conversely a target
ρ = 3.17226586 gives noise multiplier 1.0 (places=6).

fedudp's side: ``fedudp.privacy.blt`` (coefficients and min-separation sensitivity) and the
released ``BltAggregator`` (n = 100 rounds, rate 1/50 so b = 50, going on with the published
θ, ω as a resumed run does), whose ledger event is one ``GaussianDpEvent(z)``, z = σ /
(sens · clip). Its ρ = 1 / (2 z²) at the published σ, its σ at the published ρ, and its ledger
ε (PLD) against the exact (ε, δ) of the published ρ's Gaussian (Balle & Wang 2018, Theorem 8).
docs/results/beyond_seeds/README.md#blt has the numbers (``scripts/reproductions/blt_parity.py``).

Weakened twins, each caught: a sensitivity of one participation (k = 1), one from the pattern
b - 1, 2b - 1, ... (not the worst), and a ledger event that leaves the sensitivity out
(z = σ / clip).
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from scipy.stats import norm

import fedudp.aggregators.blt as blt_module
from fedudp.aggregators import BltAggregator, Sampling
from fedudp.privacy.accountant import accountant_for
from fedudp.privacy.blt import blt_coefficients, max_participations, minsep_sensitivity_squared

# the published setting (accounting_test.py, see the module doc): literal
THETA = (0.9999999999921251, 0.9944453083640997, 0.8985923474607591, 0.4912001418098778)
OMEGA = (0.0070314825502323835, 0.10613806907600574, 0.1898159060327625, 0.1966594748073734)
ROUNDS, MIN_SEP, PUBLISHED_K = 100, 50, 2
PUBLISHED_Z = 1.0  # noise std / clip
PUBLISHED_RHO = 3.17226586
PLACES_6 = 5e-7  # assertAlmostEqual(places=6): |difference| rounds to 0 at 6 decimals

CLIP = 0.5
SAMPLING = Sampling(1.0 / MIN_SEP, 200)  # b = 1 / rate = 50, each group whole (p = 1)
DELTA = 1e-5


def exact_gaussian_delta(epsilon: float, rho: float) -> float:
    """δ(ε) of the Gaussian mechanism that is exactly ρ-zCDP (z = 1 / sqrt(2ρ))."""
    z = 1.0 / math.sqrt(2.0 * rho)
    return float(
        norm.cdf(-epsilon * z + 0.5 / z) - math.exp(epsilon) * norm.cdf(-epsilon * z - 0.5 / z)
    )


def one_participation(c: np.ndarray, b: int, n: int) -> float:
    """Twin: ||C[:, 0]||², as if a unit took part once (the min-separation's k ignored)."""
    c = np.asarray(c, dtype=np.float64)[:n]
    return float(c @ c)


def late_pattern(c: np.ndarray, b: int, n: int) -> float:
    """Twin: the pattern b - 1, 2b - 1, ... (fewer rows reached than 0, b, 2b, ...)."""
    c = np.asarray(c, dtype=np.float64)[:n]
    v = np.zeros(n)
    for start in range(b - 1, n, b):
        v[start:] += c[: n - start]
    return float(v @ v)


class EventWithoutSensitivity(BltAggregator):
    """Twin: the ledger's event at z = σ / clip, the sensitivity left out of it."""

    def round_event(self, round_: int) -> dp_accounting.DpEvent:
        if round_ != 1:
            return dp_accounting.NoOpDpEvent()
        return dp_accounting.GaussianDpEvent(self.noise_multiplier * self.sensitivity)


def published_matrix(agg: BltAggregator) -> BltAggregator:
    """``agg`` going on with the published θ, ω (the path a resumed run takes)."""
    agg.restore_checkpoint_state(
        {"t": 0, "buffers": None, "theta": list(THETA), "omega": list(OMEGA)}
    )
    return agg


def released(cls: type[BltAggregator], noise_over_clip: float) -> BltAggregator:
    """fedudp's BLT for the published setting at noise std ``noise_over_clip``·clip."""
    probe = published_matrix(cls(CLIP, 1.0, SAMPLING, rounds=ROUNDS, buffers=4))
    z = noise_over_clip / probe.sensitivity
    agg = cls.with_noise_multiplier(z, clip=CLIP, sampling=SAMPLING, rounds=ROUNDS, buffers=4)
    return published_matrix(agg)


def ledger(agg: BltAggregator) -> tuple[float, float]:
    """(ρ, ε at δ): ρ of the run's one Gaussian, ε of its rounds' events (fedudp's ledger)."""
    events = [agg.round_event(r) for r in range(1, ROUNDS + 1)]
    gaussians = [e for e in events if isinstance(e, dp_accounting.GaussianDpEvent)]
    assert len(gaussians) == 1 and isinstance(events[0], dp_accounting.GaussianDpEvent)
    acc = accountant_for(agg.dp_event())
    for e in events:
        acc.compose(e)
    return 1.0 / (2.0 * gaussians[0].noise_multiplier ** 2), acc.epsilon(DELTA)


@pytest.mark.parametrize(
    "sens2,ok",
    [(minsep_sensitivity_squared, True), (one_participation, False), (late_pattern, False)],
)
def test_sensitivity_gives_the_published_rho(sens2, ok):
    assert max_participations(ROUNDS, MIN_SEP) == PUBLISHED_K
    c = blt_coefficients(np.array(THETA), np.array(OMEGA), ROUNDS)
    s2 = sens2(c, MIN_SEP, ROUNDS)
    rho = s2 / (2.0 * PUBLISHED_Z**2)  # the reference's zcdp_for_blt at noise multiplier 1
    z_at_target = math.sqrt(s2 / (2.0 * PUBLISHED_RHO))  # its noise_multiplier_for_blt
    matches = abs(rho - PUBLISHED_RHO) < PLACES_6 and abs(z_at_target - PUBLISHED_Z) < PLACES_6
    assert matches is ok, (rho, z_at_target)


@pytest.mark.parametrize(
    "cls,sens2,ok",
    [
        (BltAggregator, None, True),
        (BltAggregator, one_participation, False),
        (BltAggregator, late_pattern, False),
        (EventWithoutSensitivity, None, False),
    ],
)
def test_the_released_mechanism_has_the_published_rho_and_epsilon(cls, sens2, ok, monkeypatch):
    """What is released: ζ's std at the published noise multiplier and at the published ρ, the
    ledger's ρ, and its ε at δ = 1e-5 against the exact ε of the published ρ's Gaussian."""
    if sens2 is not None:  # the estimator's own sensitivity replaced by the twin's
        monkeypatch.setattr(blt_module, "minsep_sensitivity_squared", sens2)
    agg = released(cls, PUBLISHED_Z)
    assert agg.noise_std == pytest.approx(PUBLISHED_Z * CLIP, rel=1e-12)
    assert (agg.bands, agg.participations, agg.buffers) == (MIN_SEP, PUBLISHED_K, 4)
    rho, eps = ledger(agg)
    # the published ρ as the target: the noise std the estimator then releases, over the clip
    at_target = cls.with_noise_multiplier(
        1.0 / math.sqrt(2.0 * PUBLISHED_RHO),
        clip=CLIP,
        sampling=SAMPLING,
        rounds=ROUNDS,
        buffers=4,
    )
    z_at_target = published_matrix(at_target).noise_std / CLIP
    # the ledger's ε must be the published ρ's: δ(ε) of that Gaussian is δ there
    delta_at_eps = exact_gaussian_delta(eps, PUBLISHED_RHO)
    checks = (
        abs(rho - PUBLISHED_RHO) < PLACES_6,
        abs(z_at_target - PUBLISHED_Z) < PLACES_6,
        delta_at_eps == pytest.approx(DELTA, rel=1e-5),
    )
    assert all(checks) is ok, (rho, z_at_target, eps, delta_at_eps)
