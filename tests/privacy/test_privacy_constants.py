"""Every privacy constant tested with power.

For each private aggregator, an ε computed *independently* of its code: from the noise its
releases actually carry (measured on many draws) and the seeds' sensitivities and mechanism
theorems written here as literals, composed with dp-accounting directly (not through
``fedudp.privacy.accountant``). It must match the ε the aggregator was calibrated to (the
ledger's claim) within the measurement error. Its **half-noise twin** (the same claim, half the
noise, or twice the per-step ε) must fail the same check: so dropping a constant such as the
outlier filter's (1+K), halving AboveThreshold's query noise, ``ZCDpEvent(ε²/8)`` for a pure
ε step, or a Laplace event claiming twice the noise added, all fail here.

Unit: a user; adjacency as each estimator states (add/remove for clip+Gaussian, replace-one
with a public n for the robust estimators).
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import pld, rdp

import fedudp.aggregators.few_users as few_users_mod
import fedudp.aggregators.outlier as outlier_mod
import fedudp.aggregators.winsorized as winsorized_mod
import fedudp.privacy.mechanisms as mechanisms_mod
from fedudp.aggregators import Sampling
from fedudp.aggregators import friend_counts as fcounts
from fedudp.aggregators import friend_filter
from fedudp.aggregators import friendlycore
from fedudp.build import estimator as build_aggregator
from fedudp.protocol.contributions import Contribution
from fedudp.config import config_from_overrides

TOL = 0.04  # relative: the measured noise scales carry ~1% error each


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make(name: str, n: int, rounds: int, dim: int, q: float = 1.0, **over):
    cfg = config_from_overrides(
        {"method": "full_dp", "aggregator": name, "train.sampling_rate": q, **over}
    )
    return build_aggregator(cfg, Sampling(q, n), rounds, dim), cfg


def pld_epsilon(parts: list[tuple[dp_accounting.DpEvent, int]], delta: float) -> float:
    acc = pld.PLDAccountant(value_discretization_interval=1e-4)
    for event, times in parts:
        acc.compose(event, times)
    return acc.get_epsilon(delta)


def rdp_epsilon(parts: list[tuple[dp_accounting.DpEvent, int]], delta: float) -> float:
    acc = rdp.RdpAccountant([1 + x / 20 for x in range(1, 200)] + list(range(12, 257)))
    for event, times in parts:
        acc.compose(event, times)
    return acc.get_epsilon(delta)


def chernoff_k(mean: float, zeta: float) -> int:
    """Literal: smallest integer k >= mean with e^{-mean} (e mean / k)^k <= zeta."""
    k = math.ceil(mean)
    while math.exp(-mean) * (math.e * mean / k) ** k > zeta:
        k += 1
    return k


def identical_rows(monkeypatch) -> None:
    """Every cohort below has identical rows: every user is every user's friend. The O(n² d)
    friend counts are then replaced by that answer (checked against the real ones once)."""
    V = torch.full((50, 3), 0.7, dtype=torch.float64)
    assert torch.equal(fcounts.friend_counts(V, (0.1, 0.2)), torch.full((2, 50), 50))
    monkeypatch.setattr(
        fcounts,
        "friend_counts",
        lambda V, radii, chunk=1024: torch.full(
            (len(radii), V.shape[0]), V.shape[0], dtype=torch.int64
        ),
    )


def record_laplace(module, monkeypatch) -> tuple[list[float], object]:
    """Patch ``module.laplace`` to record the first value of every draw; (draws, the real one)."""
    draws: list[float] = []
    real = module.laplace

    def laplace(shape, scale, *, rng, **kw):
        x = real(shape, scale, rng=rng, **kw)
        draws.append(float(x[0]))
        return x

    monkeypatch.setattr(module, "laplace", laplace)
    return draws, real


def mean_abs(values: list[float]) -> float:
    """E|Lap(b)| = b: the measured Laplace scale."""
    return float(np.mean(np.abs(values)))


# -- clip + Gaussian (add/remove, Poisson q) ---------------------------------------------------


def gaussian_eps(agg, dim: int, T: int, delta: float, releases: int = 25) -> float:
    zero = Contribution(None, torch.zeros(dim, dtype=torch.float64), 0)
    noise = torch.cat(
        [agg.release(zero, rng=gen(s)).mean.to(torch.float64) for s in range(releases)]
    )
    z = float(noise.std()) * agg.sampling.expected_cohort / agg.clip  # sensitivity C
    event = dp_accounting.GaussianDpEvent(z)
    q = agg.sampling.rate
    return pld_epsilon(
        [(event if q >= 1 else dp_accounting.PoissonSampledDpEvent(q, event), T)], delta
    )


def test_gaussian_independent_epsilon_and_half_noise_twin():
    from fedudp.privacy.accountant import Accountant, pld_interval

    delta, T, q = 1e-5, 20, 0.05
    agg, _ = make(
        "gaussian",
        2000,
        T,
        2000,
        q,
        **{
            "privacy.noise_multiplier": 1.1,
            "privacy.delta": delta,
            "privacy.clip": 0.7,
            "privacy.epsilon": 100.0,
        },
    )
    acc = Accountant(pld_interval(1.0))
    for _ in range(T):
        acc.compose(agg.dp_event())
    claimed = acc.epsilon(delta)  # what the ledger says after T rounds
    assert gaussian_eps(agg, 2000, T, delta) == pytest.approx(claimed, rel=TOL)
    agg.noise_multiplier *= 0.5
    assert gaussian_eps(agg, 2000, T, delta) > 1.5 * claimed


# -- outlier removal ([ASI] Alg. 2): one AboveThreshold + Gaussian, replace-one -----------------


def outlier_eps(agg, n: int, T: int, eps: float, delta: float, monkeypatch) -> float:
    """ε_AT from the AboveThreshold draws (threshold Lap(b1), queries Lap(b2), score sensitivity
    2: ε_AT = 2/b1 + 2·2/b2, Dwork–Roth Thm 3.23), plus T Gaussian releases at the measured σ
    over Δ = 30 τ (1 + K)/n ([ASI] Lemma 3.5 read with explicit constants: kept points within
    10τ·3 of each other, K = 1 + Chernoff(6, ζ)), at what remains of δ after the AT's false
    pass γ = 2T exp(-(2n/15) ε_AT / 16) and the coupling's T ζ, ζ = δ/(4T)."""
    draws, real = record_laplace(mechanisms_mod, monkeypatch)
    small = Contribution(torch.zeros(n, 4, dtype=torch.float64), None, n)  # a concentrated cohort
    twin_noise = agg.noise_multiplier
    at_agg = type(agg)(
        agg.tau,
        twin_noise,
        agg.sensitivity,
        agg.sampling,
        agg.eps_at,
        agg.rounds,
        agg.delta_reserved,
        agg.min_users_required,
    )
    for s in range(1500):  # a fresh instance each: [threshold, query]
        at_agg.at = None
        at_agg.release(small, rng=gen(s))
    monkeypatch.setattr(mechanisms_mod, "laplace", real)
    b1, b2 = mean_abs(draws[0::2]), mean_abs(draws[1::2])
    eps_at = 2 / b1 + 4 / b2
    d = 2048
    v = torch.full((d,), 0.3, dtype=torch.float64)
    G = v.expand(n, d).clone()  # all users equal: everyone kept, mean exact
    agg.at = None
    noise = torch.cat(
        [agg.release(Contribution(G, None, n), rng=gen(10_000 + s)).mean - v for s in range(8)]
    )
    zeta = delta / (4 * T)
    sens = 30 * agg.tau * (1 + chernoff_k(6.0, zeta)) / n
    gamma = 2 * T * math.exp(-(2 * n / 15) * eps_at / 16)
    left = delta - gamma - T * zeta
    assert left > 0
    z = float(noise.std()) / sens
    return eps_at + pld_epsilon([(dp_accounting.GaussianDpEvent(z), T)], left)


def test_outlier_removal_independent_epsilon_and_half_noise_twins(monkeypatch):
    identical_rows(monkeypatch)
    eps, delta, T, n = 8.0, 1e-5, 5, 500
    agg, _ = make(
        "outlier_removal",
        n,
        T,
        2048,
        **{"privacy.epsilon": eps, "privacy.delta": delta, "estimator.tau": 0.2},
    )
    assert outlier_eps(agg, n, T, eps, delta, monkeypatch) == pytest.approx(eps, rel=TOL)
    agg.noise_multiplier *= 0.5  # half the Gaussian noise
    assert outlier_eps(agg, n, T, eps, delta, monkeypatch) > (1 + 3 * TOL) * eps
    agg.noise_multiplier *= 2
    agg.eps_at *= 1.5  # AT noise scaled by 2/3 (e.g. query noise halved)
    assert outlier_eps(agg, n, T, eps, delta, monkeypatch) > (1 + 3 * TOL) * eps


# -- FriendlyCore filter: Laplace mass check + Gaussian, per round -----------------------------


def friendlycore_eps(agg, n: int, T: int, delta: float, monkeypatch) -> float:
    """Per round: the kept-mass check Lap(b) over mass sensitivity 7 and the Gaussian release at
    the measured σ over Δ = 2 D K / s (D = 4τ, s = n/20, K = 2 + Chernoff(6, ζ)); δ less the
    failure terms T (½ e^{-(0.15 - 0.10) n / b} + e^{-(1/2)² 0.10 n / 2} + ζ), ζ = δ/(4T)."""
    draws, real = record_laplace(friendlycore, monkeypatch)
    d = 2048
    v = torch.full((d,), -0.2, dtype=torch.float64)
    G = v.expand(n, d).clone()
    noise = torch.cat(
        [agg.release(Contribution(G, None, n), rng=gen(s)).mean - v for s in range(8)]
    )
    small = Contribution(torch.zeros(n, 4, dtype=torch.float64), None, n)
    for s in range(2000):
        agg.release(small, rng=gen(100 + s))
    monkeypatch.setattr(friendlycore, "laplace", real)
    b = mean_abs(draws)
    zeta = delta / (4 * T)
    sens = 2 * (4 * agg.tau) * (2 + chernoff_k(6.0, zeta)) / (0.05 * n)
    fail = 0.5 * math.exp(-(0.15 - 0.10) * n / b) + math.exp(-0.25 * 0.10 * n / 2) + zeta
    left = delta - T * fail
    assert left > 0
    z = float(noise.std()) / sens
    return pld_epsilon(
        [
            (
                dp_accounting.ComposedDpEvent(
                    [dp_accounting.LaplaceDpEvent(b / 7.0), dp_accounting.GaussianDpEvent(z)]
                ),
                T,
            )
        ],
        left,
    )


def test_friendlycore_independent_epsilon_and_half_noise_twin(monkeypatch):
    identical_rows(monkeypatch)
    eps, delta, T, n = 8.0, 1e-5, 3, 3000
    agg, _ = make(
        "friendlycore",
        n,
        T,
        2048,
        **{"privacy.epsilon": eps, "privacy.delta": delta, "estimator.tau": 0.2},
    )
    # calibrated at δ/2 (the other half reserved for the failure terms): the independent ε at
    # δ minus the actual failure terms is at most the claim, and close to it
    got = friendlycore_eps(agg, n, T, delta, monkeypatch)
    assert eps * (1 - 2 * TOL) <= got <= eps * (1 + TOL)
    agg.noise_multiplier *= 0.5
    agg.check_multiplier *= 0.5
    assert friendlycore_eps(agg, n, T, delta, monkeypatch) > (1 + 3 * TOL) * eps


# -- WinsorizedMeanHighD ([LEVY] Alg. 2): per rotated coordinate, EM + Laplace, replace-one ----


def winsorized_eps(agg, n: int, T: int, delta: float, monkeypatch) -> float:
    """Per round and rotated coordinate (d' of them): PrivateRange, an exponential mechanism on
    a sensitivity-1 score at the ε it is called with (pure ε-DP ⇒ ε²/2-zCDP, Bun–Steinke), and
    the measured Laplace noise over the winsorized mean's sensitivity 2 h τ'/n (h = 2,
    τ' = 10 τ sqrt(log(d' n/γ)/d'), [LEVY] Lemma 2); RDP composition over d' T."""
    lap, em = [], []
    real_lap, real_range = winsorized_mod.laplace, winsorized_mod.private_range

    def laplace(shape, scale, *, rng, **kw):
        x = real_lap(shape, scale, rng=rng, **kw)
        lap.extend(x.tolist())
        return x

    def private_range(X, tau, bound, eps, *, rng, **kw):
        em.append(eps)
        return real_range(X, tau, bound, eps, rng=rng, **kw)

    monkeypatch.setattr(winsorized_mod, "laplace", laplace)
    monkeypatch.setattr(winsorized_mod, "private_range", private_range)
    G = torch.rand(n, agg.dim, generator=gen(1), dtype=torch.float64) * 0.1
    for s in range(600):
        agg.release(Contribution(G, None, n), rng=gen(s))
    monkeypatch.setattr(winsorized_mod, "laplace", real_lap)
    monkeypatch.setattr(winsorized_mod, "private_range", real_range)
    dp = 1 << (agg.dim - 1).bit_length()
    assert len(lap) == 600 * dp and len(set(em)) == 1
    tau_coord = 10 * agg.tau * math.sqrt(math.log(dp * n / agg.gamma) / dp)
    sens = 2 * 2 * tau_coord / n
    b = mean_abs(lap)
    return rdp_epsilon(
        [
            (dp_accounting.ZCDpEvent(em[0] ** 2 / 2), dp * T),
            (dp_accounting.LaplaceDpEvent(b / sens), dp * T),
        ],
        delta,
    )


def test_winsorized_independent_epsilon_and_half_noise_twin(monkeypatch):
    eps, delta, T, n = 2.0, 1e-5, 3, 200
    agg, _ = make(
        "winsorized",
        n,
        T,
        16,
        **{"privacy.epsilon": eps, "privacy.delta": delta, "estimator.tau": 0.05},
    )
    assert winsorized_eps(agg, n, T, delta, monkeypatch) == pytest.approx(eps, rel=TOL)
    agg.eps_coord *= 2  # half the Laplace noise, twice the EM's ε
    assert winsorized_eps(agg, n, T, delta, monkeypatch) > 1.5 * eps


# -- few users ([ESF] DP-Estimate-1/2): (4ε1, 4δ1) per run of the sampler, basic composition --


def few_users_eps(agg, n: int, T: int, monkeypatch) -> tuple[float, float]:
    """[ESF] Thm 6 constants: DP-Estimate-1 run at (ε1, δ1) is (4ε1, 4δ1)-DP; copies × blocks
    runs per round and T rounds compose basically. The (ε1, δ1) the sampler actually runs with
    are recorded; its acceptance rule is checked against the literal formula."""
    calls = []
    real = few_users_mod.dp_estimate_1

    def dp_estimate_1(X, radius, eps, delta, tries, **kw):
        calls.append((eps, delta))
        return real(X, radius, eps, delta, tries, **kw)

    monkeypatch.setattr(few_users_mod, "dp_estimate_1", dp_estimate_1)
    G = torch.rand(n, agg.dim, generator=gen(2), dtype=torch.float64) * 0.05
    agg.release(Contribution(G, None, n), rng=gen(3))
    monkeypatch.setattr(few_users_mod, "dp_estimate_1", real)
    assert len(calls) == agg.copies * agg.blocks
    eps1, delta1 = calls[0]
    f = torch.tensor([1.0, n / 3, 2 * n / 3, n], dtype=torch.float64)
    literal = torch.log(n / (3 * f)) + eps1 * (
        torch.minimum(f, torch.tensor(2 * n / 3)) - 2 * n / 3
    )
    torch.testing.assert_close(few_users_mod.log_accept(f, n, eps1), literal)
    runs = len(calls) * T
    return 4 * eps1 * runs, 4 * delta1 * runs


def test_few_users_independent_epsilon_and_twin(monkeypatch):
    eps, delta, T, n = 8.0, 1e-5, 2, 3000
    agg, _ = make(
        "few_users",
        n,
        T,
        8,
        **{
            "privacy.epsilon": eps,
            "privacy.delta": delta,
            "estimator.tau": 0.1,
            "estimator.copies": 3,
        },
    )
    got_eps, got_delta = few_users_eps(agg, n, T, monkeypatch)
    assert got_eps == pytest.approx(eps, rel=1e-12) and got_delta == pytest.approx(delta, rel=1e-12)
    agg.eps1 *= 2
    assert few_users_eps(agg, n, T, monkeypatch)[0] == pytest.approx(2 * eps)


# -- worst-case neighbouring pairs: how much of the calibrated sensitivity one unit really moves --
#
# The pair is the estimator's own hardest case we know: for the filters, a line of users whose
# friend counts (within 2τ) lie between n/2 and 2n/3 (fractional keep probabilities), the
# replaced user at one end of it in D and far away in D'; for the winsorized mean, the replaced
# user at one clipping edge in D and at the other in D'; for few_users' score, the replaced user
# inside the candidate's ball in D and outside in D'. The noise-free change (expected and
# largest over coupled keep draws) is reported as a fraction of the calibrated sensitivity; the
# asserted floors are the measured values with a margin (they guard that the pair exercises
# the mechanism), the ceiling is the certificate itself.


def _filter_pair_changes(friendly: bool, n: int = 300, tau: float = 1.0, seeds: int = 300):
    L = 4 * tau * (n - 1) / (0.55 * n)  # interior users see ~0.55 n within 2τ
    others = torch.zeros(n - 1, 2, dtype=torch.float64)
    others[:, 0] = torch.linspace(0, L, n - 1)
    keep = friendlycore.friendly_keep_probabilities if friendly else outlier_mod.keep_probabilities

    def filtered(canary, seed):
        V = torch.cat([canary[None], others])
        counts = fcounts.friend_counts(V, (2 * tau,))
        p = keep(counts[0], n)
        return friend_filter.filtered_mean(V, p, rng=gen(seed))[0], p

    inside = torch.tensor([0.0, 0.0], dtype=torch.float64)
    far = torch.tensor([1e4 * tau, 0.0], dtype=torch.float64)
    changes, fractional = [], None
    for s in range(seeds):
        (a, p), (b, _) = filtered(inside, s), filtered(far, s)  # same seed: coupled keeps
        changes.append(float(torch.linalg.vector_norm(a - b)))
        fractional = int(((p > 0) & (p < 1)).sum())
    zeta = 1e-5 / 20
    sens = (
        friendlycore.friendlycore_sensitivity(tau, n, zeta)
        if friendly
        else outlier_mod.sensitivity(tau, n, zeta)
    )
    return np.array(changes) / sens, fractional


@pytest.mark.parametrize("friendly,mean_floor,max_floor", [(False, 2e-3, 1e-2), (True, 4e-4, 2e-3)])
def test_filter_worst_case_pair_fraction_of_calibrated_sensitivity(friendly, mean_floor, max_floor):
    frac, fractional = _filter_pair_changes(friendly)
    assert fractional > 100  # most users in the fractional band
    # measured (n = 300): outlier_removal mean 0.46%, largest 5.1% of 30τ(1+K)/n;
    # friendlycore mean 0.10%, largest 0.67% of 2·4τ(2+K)/(n/20): the certificates are loose
    assert frac.mean() >= mean_floor and frac.max() >= max_floor
    assert frac.max() <= 1.0


def test_winsorized_pair_attains_the_laplace_sensitivity():
    # the replaced row from the lower clipping edge to the upper, same centre: the winsorized
    # sum moves by exactly 2 h τ' per coordinate, the sensitivity the Laplace noise is scaled to
    n, h, tau_c = 50, 2.0, 0.3
    center = torch.tensor([0.1, -0.2, 0.05], dtype=torch.float64)
    X = center + 0.1 * tau_c * torch.randn(n, 3, generator=gen(4), dtype=torch.float64)
    Y = X.clone()
    X[0], Y[0] = center - 10 * tau_c, center + 10 * tau_c
    a, _ = winsorized_mod.winsorized_sum(X, center, h * tau_c)
    b, _ = winsorized_mod.winsorized_sum(Y, center, h * tau_c)
    torch.testing.assert_close((b - a) / (2 * h * tau_c), torch.ones(3, dtype=torch.float64))


def test_few_users_score_pair_attains_sensitivity_one():
    # DP-Estimate-1's density exp(ε min(f(p), 2n/3)): the replaced user inside p's ball in D,
    # outside in D', moves f(p) by exactly 1 (the exponent by exactly ε) below the 2n/3 cap
    n, eps = 30, 0.5
    X = torch.zeros(n, 2, dtype=torch.float64)
    X[: n // 2] += 5.0  # half the users far from p
    p = torch.zeros(2, dtype=torch.float64)
    Y = X.clone()
    Y[-1] = torch.tensor([50.0, 0.0])
    f = lambda Z: int(((Z - p).square().sum(1) <= 1.0).sum())  # noqa: E731
    assert f(X) - f(Y) == 1 and f(X) < 2 * n / 3
    la = few_users_mod.log_accept(torch.tensor([f(X), f(Y)]), n, eps)
    # log acceptance moves by ε plus the 1/f proposal correction log(f/(f-1)) of Alg. 1
    assert float(la[0] - la[1]) == pytest.approx(eps - math.log(f(X) / f(Y)))
