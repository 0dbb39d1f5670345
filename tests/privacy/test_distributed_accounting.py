"""The guard of ``fedudp/privacy/distributed.py`` (``distributed_rdp.py``, ``distributed_calibration.py``)
(docs/algorithms.md#distributed-dp): the distributed discrete Gaussian (Kairouz, Liu & Steinke
2021, Prop. 14) and Skellam (Agarwal, Kairouz & Liu 2021) RDP curves, Zhu–Wang's Poisson
subsampling, the calibration and the accountant's composition.

Checked against numbers obtained without the module: dp-accounting's own RDP accountant on
``GaussianDpEvent``/``ZCDpEvent``/``PoissonSampledDpEvent`` where the mechanisms coincide with
the Gaussian, and the literal numbers of Google's reference accounting
(docs/results/distributed_dp/reference_parity.md). Each hole has a weakened twin that the same
check catches.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

import fedudp.privacy.distributed_rdp as dist
from fedudp.privacy.accountant import Accountant, ApproxDp, GroupAccountant, GroupConversion
from fedudp.privacy.distributed import (
    RDP_ORDERS,
    DistributedDpEvent,
    calibrate_local_std,
    ddg_tau,
    distributed_event,
    distributed_params,
    heuristic_scale,
    rdp_epsilon,
    rounded_l1_bound,
    rounded_l2_bound,
    subsampled_rdp,
)

DELTA = 1e-5


@pytest.fixture(autouse=True)
def _fresh_curves():
    """The per-event curve cache is cleared around each test (twins patch the formulas)."""
    dist._curve.cache_clear()
    yield
    dist._curve.cache_clear()


def _rdp_gaussian_epsilon(event: dp_accounting.DpEvent, count: int, delta: float) -> float:
    acc = rdp_privacy_accountant.RdpAccountant(orders=[float(a) for a in RDP_ORDERS])
    acc.compose(event, count)
    return acc.get_epsilon(delta)


def _event(noise: str, s: float, n: int, l2: float, dim: int, rate: float = 1.0):
    return DistributedDpEvent(noise, s, n, l2, rounded_l1_bound(l2, dim), dim, 1.0, rate)


# ---- q = 1: the Gaussian where both apply ------------------------------------------------


def _gaussian_parity(make_event) -> float:
    """Largest |ε - dp-accounting's| over settings where τ ≈ 0 (the DDG is the Gaussian)."""
    worst = 0.0
    for s, n, l2, rounds in ((50.0, 4, 3.0, 1), (20.0, 100, 40.0, 10), (8.0, 9, 2.5, 50)):
        ev = make_event(s, n, l2)
        mine = ev.epsilon(DELTA, rounds)
        z = math.sqrt(n) * s / l2  # the aggregate's std over the sensitivity
        gauss = _rdp_gaussian_epsilon(dp_accounting.GaussianDpEvent(z), rounds, DELTA)
        zcdp = _rdp_gaussian_epsilon(dp_accounting.ZCDpEvent(l2**2 / (2 * n * s**2)), rounds, DELTA)
        worst = max(worst, abs(mine - gauss), abs(mine - zcdp))
    return worst


def test_ddg_at_q1_is_dp_accountings_gaussian():
    assert ddg_tau(8.0, 100) < 1e-250  # τ vanishes at these stds
    assert _gaussian_parity(lambda s, n, l2: _event("ddgauss", s, n, l2, 16)) < 1e-9


def test_ddg_twin_forgetting_the_sum_of_shares_is_caught(monkeypatch):
    # weakened twin: the aggregate's std taken as one share's (no √n): far too small an ε
    real = dist.ddg_rdp
    monkeypatch.setattr(dist, "ddg_rdp", lambda a, l2, l1, s, n, d: real(a, l2, l1, s, 1, d))
    assert _gaussian_parity(lambda s, n, l2: _event("ddgauss", s, n, l2, 16)) > 0.1


def test_skellam_tends_to_the_gaussian_at_large_scale():
    # z = 1 fixed; the integer grid refined by c: Skellam's extra term is O(1/μ)
    gaps = []
    for c in (1.0, 10.0, 100.0):
        ev = _event("skellam", 50.0 * c, 4, 100.0 * c, 16)
        gauss = _rdp_gaussian_epsilon(dp_accounting.GaussianDpEvent(1.0), 1, DELTA)
        gaps.append(ev.epsilon(DELTA) - gauss)
    assert all(g >= 0 for g in gaps)  # never below the Gaussian
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-4


def test_skellam_twin_with_variance_ns_is_caught(monkeypatch):
    # weakened twin: the aggregate's variance taken as n·s (not n·s²): far from the Gaussian
    real = dist.skellam_rdp
    monkeypatch.setattr(dist, "skellam_rdp", lambda a, l2, l1, s, n: real(a, l2, l1, s**0.5, n))
    ev = _event("skellam", 5000.0, 4, 10000.0, 16)
    gauss = _rdp_gaussian_epsilon(dp_accounting.GaussianDpEvent(1.0), 1, DELTA)
    assert abs(ev.epsilon(DELTA) - gauss) > 1.0  # the check of the test above fails


# ---- Poisson subsampling -----------------------------------------------------------------

# Zhu–Wang's general bound against dp-accounting's tight sampled Gaussian (ε over the rounds):
# at these settings the ratio measured is 1.16 (q = 0.01, z = 1), 1.03 (q = 1e-3, z = 1) and
# 1.32 (q = 0.01, z = 2)
ZHU_WANG_FACTOR = 1.35


def _zhu_wang_ratios(bound) -> list[float]:
    out = []
    for q, z, rounds in ((0.01, 1.0, 1000), (0.001, 1.0, 10000), (0.01, 2.0, 1000)):
        curve = np.array([bound(a, q, lambda j, z=z: j / (2 * z**2)) for a in RDP_ORDERS])
        mine = rdp_epsilon(RDP_ORDERS, rounds * curve, DELTA)
        tight = _rdp_gaussian_epsilon(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds, DELTA
        )
        out.append(mine / tight)
    return out


def test_zhu_wang_bound_is_above_the_tight_one_within_a_factor():
    ratios = _zhu_wang_ratios(subsampled_rdp)
    assert all(1.0 <= r <= ZHU_WANG_FACTOR for r in ratios), ratios
    assert subsampled_rdp(7, 1.0, lambda j: 0.3 * j) == pytest.approx(2.1)  # q = 1: unsampled
    assert math.isinf(subsampled_rdp(5, 0.1, lambda j: math.inf))


def test_zhu_wang_twin_without_the_first_term_is_caught():
    # weakened twin: the (1-q)^(α-1)(1+(α-1)q) term dropped: below the tight curve
    def twin(order, q, rdp):
        a = order
        j = np.arange(2, a + 1)
        from scipy import special

        lc = special.gammaln(a + 1) - special.gammaln(j + 1) - special.gammaln(a - j + 1)
        t = lc + j * np.log(q) + (a - j) * np.log1p(-q) + (j - 1) * np.array([rdp(i) for i in j])
        t[1:] += np.log(3.0)
        return float(special.logsumexp(t) / (a - 1))

    assert min(_zhu_wang_ratios(twin)) < 1.0


# ---- τ and rounding ----------------------------------------------------------------------


def _tau_setting() -> DistributedDpEvent:
    return _event("ddgauss", 0.5, 100, 2000.0, 2**16, rate=0.05)


def test_tau_term_raises_epsilon_at_small_local_std(monkeypatch):
    real = _tau_setting().epsilon(DELTA, 100)
    big = _event("ddgauss", 5.0, 100, 20000.0, 2**16, rate=0.05).epsilon(DELTA, 100)
    dist._curve.cache_clear()
    monkeypatch.setattr(dist, "ddg_tau", lambda s, n: 0.0)  # weakened twin: τ dropped
    assert real > 1.01 * _tau_setting().epsilon(DELTA, 100)  # τ matters at s = 0.5
    # at s = 5, τ ≈ 0: the twin and the module agree (same z = √n·s/l2 as above)
    assert _event("ddgauss", 5.0, 100, 20000.0, 2**16, rate=0.05).epsilon(DELTA, 100) == big


def _built(**kw) -> DistributedDpEvent:
    base = dict(clip=1.0, local_std=1.0, scale=50.0, beta=math.exp(-0.5), dim=1024, owners=10)
    return distributed_event("ddgauss", **{**base, "rate": 0.1, **kw})


def test_rounding_inflation_is_accounted(monkeypatch):
    ev = _built()
    assert ev.l2 == rounded_l2_bound(50.0, math.exp(-0.5), 1024) > 50.0
    assert rounded_l2_bound(50.0, 0.0, 1024) == 50.0 + 32.0  # β = 0: l2 + √d
    real = ev.epsilon(DELTA, 100)
    monkeypatch.setattr(dist, "rounded_l2_bound", lambda l2, beta, dim: l2)  # twin: none
    twin = _built()
    assert twin.l2 == 50.0  # the check `l2 > clip·scale` the real event passes fails here
    assert twin.epsilon(DELTA, 100) < real


def test_epsilon_is_monotone_in_owners_rate_and_std():
    eps = lambda **kw: _built(**kw).epsilon(DELTA, 100)  # noqa: E731
    assert eps(owners=5) > eps(owners=10) > eps(owners=40)
    assert eps(rate=0.01) < eps(rate=0.1) < eps(rate=1.0)
    assert eps(local_std=0.5) > eps(local_std=1.0) > eps(local_std=2.0)
    sk = lambda s: distributed_event(  # noqa: E731
        "skellam", clip=1.0, local_std=s, scale=50.0, beta=0.0, dim=1024, owners=10, rate=0.1
    ).epsilon(DELTA, 100)
    assert sk(0.5) > sk(1.0) > sk(2.0)


# ---- reference parity --------------------------------------------------------------------
# Google's distributed_dp/accounting_utils.py (google-research/federated a5af8c4), its
# tensorflow_privacy get_privacy_spent replaced by dp-accounting's compute_epsilon, at the
# EMNIST setting of Kairouz et al. 2021: 100 of 3400 clients a round, 1500 rounds,
# δ = 1/3400, β = e^-0.5, k = 4, d = 2^20, clip 0.03 (reference_parity.md).
EMNIST = dict(delta=1 / 3400, rounds=1500, clip=0.03, beta=math.exp(-0.5), dim=2**20)
EMNIST_RUN = dict(owners=100, rate=100 / 3400)
# (noise, bits, target ε, reference scale, reference local std, reference ε at them)
REFERENCE = [
    ("ddgauss", 16, 3.0, 146759.71480763907, 0.005574215081206461, 3.0000000018477984),
    ("ddgauss", 16, 6.0, 241886.35365055755, 0.0033740190206435565, 5.9999999987752215),
    ("ddgauss", 16, 10.0, 303711.9942907253, 0.0026813299255916984, 10.000000067585324),
    ("ddgauss", 20, 3.0, 2364155.4975732253, 0.005536393266458029, 3.00000000095495),
    ("ddgauss", 20, 6.0, 3879966.507029786, 0.003365452017356645, 5.99999995014304),
    ("ddgauss", 20, 10.0, 4867200.8813121915, 0.0026769774793967017, 10.000000041523505),
    ("ddgauss", 12, 10.0, 8531.221131192051, 0.005994043944577806, 10.000000045537295),
    ("skellam", 16, 3.0, 146759.71360515046, 0.0055742151270068915, 3.0000000018481936),
    ("skellam", 16, 6.0, 241886.3519025238, 0.003374019045210856, 5.999999998774888),
    ("skellam", 16, 10.0, 303711.99220623897, 0.0026813299442149797, 10.000000067586656),
    ("skellam", 20, 3.0, 2364155.497518175, 0.00553639326658719, 3.0000000009549708),
    ("skellam", 20, 6.0, 3879966.506941145, 0.003365452017434376, 5.999999950143289),
    ("skellam", 20, 10.0, 4867200.88120613, 0.002676977479456576, 10.000000041524837),
    ("skellam", 12, 10.0, 8531.039641510344, 0.005994171766850725, 10.000000045407065),
]
# where the reference's minimize_scalar returns a scale that does not fit the bits
REFERENCE_UNFIT = [
    ("ddgauss", 12, 3.0, 0.1546747996845975, 611.4562368318136, 3.000000026301591),
    ("ddgauss", 12, 6.0, 0.14581638178928386, 394.27879150811475, 6.000000070815679),
    ("skellam", 12, 3.0, 0.15467497348096332, 611.456267867255, 3.000000026301487),
    ("skellam", 12, 6.0, 0.14581694561566821, 394.27853231002786, 6.000000070816427),
]


def _emnist_eps(noise: str, scale: float, std: float) -> float:
    kw = {k: EMNIST[k] for k in ("clip", "beta", "dim")}
    ev = distributed_event(noise, local_std=std, scale=scale, **kw, **EMNIST_RUN)
    return ev.epsilon(EMNIST["delta"], EMNIST["rounds"])


@pytest.mark.parametrize("row", REFERENCE + REFERENCE_UNFIT, ids=lambda r: f"{r[0]}-{r[1]}-{r[2]}")
def test_reference_parity_epsilon(row):
    noise, _, _, scale, std, ref = row
    assert _emnist_eps(noise, scale, std) == pytest.approx(ref, rel=1e-9)


def test_reference_parity_twin_without_rounding_is_caught(monkeypatch):
    monkeypatch.setattr(dist, "rounded_l2_bound", lambda l2, beta, dim: l2)
    noise, _, _, scale, std, ref = REFERENCE[0]
    assert abs(_emnist_eps(noise, scale, std) / ref - 1) > 1e-3


def _params(row):
    noise, bits, target = row[:3]
    return distributed_params(noise, epsilon=target, bits=bits, k=4, **EMNIST, **EMNIST_RUN)


@pytest.mark.parametrize("row", [REFERENCE[2], REFERENCE[9]], ids=lambda r: f"{r[0]}-{r[1]}")
def test_reference_parity_params(row):
    scale, std = _params(row)
    assert scale == pytest.approx(row[3], rel=1e-5) and std == pytest.approx(row[4], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("row", REFERENCE, ids=lambda r: f"{r[0]}-{r[1]}-{r[2]}")
def test_reference_parity_params_all(row):
    scale, std = _params(row)
    assert scale == pytest.approx(row[3], rel=1e-5) and std == pytest.approx(row[4], rel=1e-6)


def test_unfit_reference_setting_is_refused():
    row = REFERENCE_UNFIT[0]
    # the reference's point leaves k stds of the sum at 1/0.54 of the range: it does not fit
    ratio = heuristic_scale(row[4], EMNIST["clip"], 12, 100, EMNIST["dim"], 4) / row[3]
    assert ratio < 0.6
    with pytest.raises(ValueError, match=r"bits=12 too small for n=100 owners and k=4"):
        _params(row)


# ---- calibration -------------------------------------------------------------------------


def _meets(noise: str, std: float, target: float, **kw) -> bool:
    ev = distributed_event(noise, local_std=std, **kw)
    return ev.epsilon(DELTA, 200) <= target


@pytest.mark.parametrize("noise", ["ddgauss", "skellam"])
def test_calibration_meets_the_target_tightly(noise):
    kw = dict(clip=1.0, scale=20.0, beta=math.exp(-0.5), dim=4096, owners=20, rate=0.05)
    std = calibrate_local_std(noise, epsilon=2.0, delta=DELTA, rounds=200, **kw)
    assert _meets(noise, std, 2.0, **kw)
    assert not _meets(noise, 0.99 * std, 2.0, **kw)
    # weakened twin: calibrated for all 40 owners while only the declared 20 survive
    twin = calibrate_local_std(noise, epsilon=2.0, delta=DELTA, rounds=200, **{**kw, "owners": 40})
    assert not _meets(noise, twin, 2.0, **kw)


def test_calibrated_params_fit_the_bits():
    kw = dict(epsilon=4.0, delta=DELTA, rounds=100, clip=1.0, beta=math.exp(-0.5), dim=4096)
    scale, std = distributed_params("ddgauss", bits=14, owners=20, rate=0.1, k=4, **kw)
    assert scale <= heuristic_scale(std, 1.0, 14, 20, 4096, 4)  # k stds fit 2^14
    assert scale * (1 + 1e-6) > heuristic_scale(std, 1.0, 14, 20, 4096, 4)  # the largest


# ---- impossible settings -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: heuristic_scale(1.0, 1.0, 3, 100, 16, 4), r"bits=3 too small for n=100 owners"),
        (
            lambda: distributed_params(
                "ddgauss",
                epsilon=1,
                delta=DELTA,
                rounds=1,
                clip=1,
                bits=3,
                beta=0,
                dim=16,
                owners=100,
                rate=1,
                k=4,
            ),
            r"bits=3 too small",
        ),
        (
            lambda: calibrate_local_std(
                "ddgauss",
                epsilon=0.0,
                delta=DELTA,
                rounds=1,
                clip=1,
                scale=1,
                beta=0,
                dim=16,
                owners=2,
                rate=1,
            ),
            r"^epsilon must be",
        ),
        (
            lambda: calibrate_local_std(
                "gauss",
                epsilon=1.0,
                delta=DELTA,
                rounds=1,
                clip=1,
                scale=1,
                beta=0,
                dim=16,
                owners=2,
                rate=1,
            ),
            r"^noise must be",
        ),
        (
            lambda: calibrate_local_std(
                "skellam",
                epsilon=1.0,
                delta=DELTA,
                rounds=1,
                clip=1,
                scale=1,
                beta=1.0,
                dim=16,
                owners=2,
                rate=1,
            ),
            r"^beta must be",
        ),
        (lambda: _built(rate=0.0), r"^rate must be"),
    ],
)
def test_impossible_settings_are_one_line_errors(call, match):
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)


# ---- composition in the accountant -------------------------------------------------------


def test_accountant_sums_the_curves_of_differing_rounds():
    a, b = _built(owners=10), _built(owners=14)  # the survivors changed
    acc = Accountant()
    before = acc.epsilon_if(a, DELTA, 3)
    acc.compose(a, 3)
    acc.compose(dp_accounting.NoOpDpEvent())  # a round that released nothing
    acc.compose(b)
    expected = rdp_epsilon(RDP_ORDERS, 3 * a.rdp() + b.rdp(), DELTA)
    assert acc.epsilon(DELTA) == expected == acc.epsilon_rdp(DELTA)
    assert before == a.epsilon(DELTA, 3)
    assert acc.primary == "rdp" and acc.composed_event() is None and acc.supports(b)
    # the checkpoint's runs recomposed one by one give the same ε
    again = Accountant()
    for ev, c in acc.runs:
        again.compose(ev, c)
    assert again.epsilon(DELTA) == expected
    # blocks: basic composition on top, at the δ they leave
    acc.compose(ApproxDp(0.1, 1e-6))
    assert acc.epsilon(DELTA) == pytest.approx(
        rdp_epsilon(RDP_ORDERS, 3 * a.rdp() + b.rdp(), DELTA - 1e-6) + 0.1, abs=1e-12
    )
    group = GroupAccountant(Accountant(), GroupConversion(1, DELTA))
    group.compose(a)
    assert group.epsilon(DELTA) == a.epsilon(DELTA)


def test_accountant_twin_accounting_every_round_at_the_first_is_caught():
    class FirstOnly(Accountant):  # weakened twin: later rounds accounted at the first event
        def compose(self, event, count=1):
            if self.runs and isinstance(event, DistributedDpEvent):
                event = self.runs[0][0]
            super().compose(event, count)

    a, b = _built(owners=10), _built(owners=8)  # fewer survivors: more ε
    expected = rdp_epsilon(RDP_ORDERS, a.rdp() + b.rdp(), DELTA)
    for cls, ok in ((Accountant, True), (FirstOnly, False)):
        acc = cls()
        acc.compose(a)
        acc.compose(b)
        assert (acc.epsilon(DELTA) == expected) is ok


def test_mixing_kinds_is_refused():
    acc = Accountant()
    acc.compose(_built())
    with pytest.raises(dp_accounting.UnsupportedEventError, match="one accountant per kind"):
        acc.compose(dp_accounting.GaussianDpEvent(1.0))
    other = Accountant()
    other.compose(dp_accounting.GaussianDpEvent(1.0))
    assert not other.supports(_built())
    with pytest.raises(dp_accounting.UnsupportedEventError, match="one accountant per kind"):
        other.epsilon_if(_built(), DELTA)


def test_event_text_is_one_readable_line():
    ev = _built()
    text = str(ev)
    assert text.startswith("DistributedDpEvent(noise=ddgauss, local_std=50.0, owners=10,")
    assert "\n" not in text and f"l2={ev.l2!r}" in text and "rate=0.1)" in text
