"""DP primitives (docs/algorithms.md#shared-primitives): Laplace, exponential mechanism,
AboveThreshold, rotation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from scipy.linalg import hadamard

from fedudp.privacy.accountant import Accountant
from fedudp.privacy.mechanisms import (
    AboveThreshold,
    RandomRotation,
    clip_factors,
    exponential_mechanism,
    fwht,
    laplace,
    next_pow2,
    pure_dp_event,
    row_norms64,
)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_laplace_scale_statistical():
    x = laplace((200_000,), 0.7, rng=gen(1))
    assert float(x.abs().mean()) == pytest.approx(0.7, rel=0.01)  # E|X| = b
    assert stats.kstest(x.numpy()[:20_000], stats.laplace(scale=0.7).cdf).pvalue > 1e-3


def test_exponential_mechanism_frequencies():
    # scores 0,1,2 with sensitivity 1 at eps=2: P ∝ exp(-eps c / 2)
    eps, c = 2.0, torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    logw = (-eps * c / 2).expand(100_000, 3)
    picks = exponential_mechanism(logw, rng=gen(2))
    freq = torch.bincount(picks, minlength=3).double() / 100_000
    want = torch.softmax(-eps * c / 2, 0)
    assert torch.allclose(freq, want, atol=0.006)
    # -inf entries never chosen
    lw = torch.tensor([[0.0, -math.inf, 0.0]]).expand(1000, 3)
    assert (exponential_mechanism(lw, rng=gen(3)) != 1).all()


def test_pure_dp_event_accounts_eps0_for_one_step():
    acc = Accountant()
    acc.compose(pure_dp_event(0.5))
    assert acc.primary == "rdp"
    # eps0-DP => (eps0^2/2)-zCDP => eps(δ) = ρ + 2 sqrt(ρ log(1/δ)) at most (Bun-Steinke)
    rho = 0.125
    assert acc.epsilon(1e-5) <= rho + 2 * math.sqrt(rho * math.log(1e5)) + 1e-6


def test_above_threshold_halts_when_query_drops():
    at = AboveThreshold(threshold=50.0, eps=4.0, rng=gen(4))
    answers = [at.test(v) for v in [100, 100, 100, 0]]
    assert answers == [True, True, True, False] and at.halted
    with pytest.raises(RuntimeError):
        at.test(100)
    # the threshold noise is Lap(2/eps), drawn once; accuracy bound is the stated one
    draws = np.array([AboveThreshold(0.0, 2.0, rng=gen(s)).noisy_threshold for s in range(4000)])
    assert np.mean(np.abs(draws)) == pytest.approx(1.0, rel=0.06)  # E|Lap(1)| = 1
    assert AboveThreshold.accuracy(1.0, 10, 0.1) == pytest.approx(8 * math.log(200))


@pytest.mark.parametrize("d", [1, 2, 8, 64, 1024])
def test_fwht_matches_hadamard_matrix(d):
    x = torch.randn(5, d, dtype=torch.float64, generator=gen(d))
    H = torch.from_numpy(hadamard(d).astype(np.float64))
    assert torch.allclose(fwht(x), x @ H, atol=1e-9)


@pytest.mark.parametrize("d", [1, 3, 100, 1000])
def test_rotation_orthogonal_and_round_trip(d):
    rot = RandomRotation(d, rng=gen(d))
    dp = next_pow2(d)
    eye = torch.eye(dp, dtype=torch.float64)
    rot_full = RandomRotation(dp, rng=gen(d))  # same omega on the padded space
    U = rot_full.rotate(eye)  # rows: U e_i  -> U^T as a matrix
    assert torch.allclose(U @ U.T, eye, atol=1e-10)
    X = torch.randn(7, d, dtype=torch.float64, generator=gen(99))
    Y = rot.rotate(X)
    assert Y.shape == (7, dp)
    assert torch.allclose(torch.linalg.vector_norm(Y, dim=1), torch.linalg.vector_norm(X, dim=1))
    assert torch.allclose(rot.invert(Y), X, atol=1e-10)


def _lemma2_checks(rotate, d: int, draws: int, alpha: float) -> tuple[bool, int]:
    """(spikes flat, failures of the Hoeffding bound) for a rotation ``rotate(X, s)``."""
    eye = torch.eye(d, dtype=torch.float64)
    flat = all(
        torch.allclose(
            rotate(eye[:8], s).abs(), torch.full((8, d), d**-0.5, dtype=torch.float64), atol=1e-12
        )
        for s in range(5)
    )
    # the Hadamard's own columns: a fixed Hadamard (or signs applied after it) maps them to spikes
    X = torch.from_numpy(hadamard(d).astype(np.float64))[:8] / math.sqrt(d)
    bound = math.sqrt(2 * math.log(2 * d / alpha) / d)  # ||x|| = 1
    fails = sum(int((rotate(X, 100 + s).abs().amax(dim=1) > bound).sum()) for s in range(draws))
    return flat, fails


def test_rotation_is_the_randomized_hadamard_lemma2():
    # [LEVY] Lemma 2 rests on U = d^{-1/2} H D: (i) a spike e_j maps to a vector with every
    # coordinate of magnitude exactly d^{-1/2}, which no other orthogonal matrix does; (ii)
    # each rotated coordinate is a Rademacher sum with variance ||x||^2/d, so (Hoeffding plus a
    # union bound) max_i |(U x)_i| <= ||x|| sqrt(2 log(2d/α)/d) w.p. >= 1-α, even for the
    # vectors a Hadamard without the random signs maps to spikes.
    d, draws, alpha = 256, 100, 0.05
    flat, fails = _lemma2_checks(
        lambda X, s: RandomRotation(d, rng=gen(s)).rotate(X), d, draws, alpha
    )
    assert flat and fails <= 2 * alpha * 8 * draws
    # the same checks have power: each wrong rotation fails one of them
    H = torch.from_numpy(hadamard(d).astype(np.float64)) / math.sqrt(d)
    signs = lambda s: RandomRotation(d, rng=gen(s)).omega  # noqa: E731
    haar = lambda s: torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=gen(s)))[0]  # noqa: E731
    wrong = {
        "no signs": lambda X, s: X @ H,
        "signs after H": lambda X, s: (X @ H) * signs(s),
        "Haar orthogonal": lambda X, s: X @ haar(s),
    }
    for name, rotate in wrong.items():
        flat, fails = _lemma2_checks(rotate, d, 10 if name == "Haar orthogonal" else draws, alpha)
        assert not flat or fails > 2 * alpha * 8 * draws, name


def test_row_norms64_of_long_rows_in_float64_buffers():
    """Rows of ``_LONG`` entries or more take the float64-buffer dot product, segment by
    segment: the same float64 norms as the exact reference (a float32 accumulation would be off
    by ~1e-7 relative), on strided rows and blocks, with NaN and inf kept, and the clip decided
    on them for rows within 1e-7 of the clip."""
    from fedudp.privacy import mechanisms as m

    g = torch.Generator().manual_seed(5)
    d, clip = m._SEGMENT + 4_464, 15.0  # two segments, the second partial
    assert d >= m._LONG
    G = torch.randn(12, 2 * d, generator=g)[:, ::2]  # strided rows
    G = G / torch.linalg.vector_norm(G, dim=1, keepdim=True) * clip
    G = (G * (1 + (torch.rand(12, 1, generator=g) - 0.5) * 2e-7)).float()
    exact = torch.from_numpy(np.linalg.norm(G.double().numpy(), axis=1))
    torch.testing.assert_close(row_norms64(G), exact, rtol=1e-14, atol=0)
    blocks = [G[:, :40_000], G[:, 40_000:]]  # one long block, one short
    torch.testing.assert_close(row_norms64(blocks), exact, rtol=1e-14, atol=0)
    factor, was = clip_factors(G, clip)
    assert torch.equal(was, exact > clip) and 0 < int(was.sum()) < 12
    H = G.clone()
    H[3, 7] = float("nan")
    H[5, d - 1] = float("inf")
    n = row_norms64(H)
    assert torch.isnan(n[3]) and torch.isinf(n[5])
    torch.testing.assert_close(n[[0, 1, 2, 4]], exact[[0, 1, 2, 4]], rtol=1e-14, atol=0)


def test_clip_factors_bound_float32_rows_by_clip_exactly():
    """Clipping (owner side and DP-SGD) decides in float64 and never leaves a float32 row above
    the clip it is calibrated for, even for rows whose norm is within float32 rounding of it."""
    g = torch.Generator().manual_seed(3)
    d, clip = 29_000, 15.0
    G = torch.randn(400, d, generator=g)
    scale = torch.cat(
        [
            torch.full((100,), 0.3),
            torch.full((100,), 40.0),
            1 + (torch.rand(200, generator=g) - 0.5) * 1e-6,
        ]
    ).unsqueeze(1)
    G = (G / torch.linalg.vector_norm(G, dim=1, keepdim=True) * clip * scale).float()
    exact = torch.from_numpy(np.linalg.norm(G.double().numpy(), axis=1))
    torch.testing.assert_close(row_norms64(G), exact, rtol=1e-14, atol=0)
    blocks = [G[:, :416], G[:, 416:13_248], G[:, 13_248:]]
    torch.testing.assert_close(row_norms64(blocks), exact, rtol=1e-14, atol=0)
    factor, was = clip_factors(G, clip)
    assert torch.equal(was, exact > clip)
    assert factor.dtype == torch.float32
    after = np.linalg.norm((G * factor.unsqueeze(1)).double().numpy(), axis=1)
    assert after.max() <= clip  # never above, not even 1 ulp
    assert np.all(after[was.numpy()] >= clip * (1 - 1e-6))  # clipped rows land at clip
    assert torch.equal(factor[~was], torch.ones(int((~was).sum())))  # the others untouched
