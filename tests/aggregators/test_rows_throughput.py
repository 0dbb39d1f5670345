"""The row estimators' throughput paths equal their direct forms (issue 40).

PrivateRange from bin counts (``_range_from_counts``) against the 2n+1-segment form
(``_range_from_bins``, still used above ``HISTOGRAM_BINS``): the same μ̂ and the same generator
state afterwards. The two-product (``fwht_gemm``) and the blocked small-factor (``fwht_into``)
Hadamard transforms against the Hadamard matrix; the words-to-doubles draws (``uniforms_at``)
against ``torch.rand``; winsorized's counted bins against its stored bins.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedudp.aggregators import winsorized
from fedudp.aggregators.rows import CohortRows
from fedudp.aggregators.private_range import _range_from_bins, _range_from_counts, uniforms_at
from fedudp.aggregators.winsorized import winsorized_mean_rows
from fedudp.privacy.mechanisms import (
    RandomRotation,
    _hadamard,
    fwht,
    fwht_factors,
    fwht_gemm,
    fwht_into,
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n", [1, 2, 7, 301])
@pytest.mark.parametrize("nbins", [1, 2, 17, 200])
@pytest.mark.parametrize("spread", ["one_bin", "two_bins", "uniform", "edges"])
def test_range_from_counts_equals_the_segment_form(n, nbins, spread):
    k = 23
    g = gen(n * 1000 + nbins)
    if spread == "one_bin":
        b = torch.full((k, n), nbins // 2, dtype=torch.int64)
    elif spread == "two_bins":
        b = torch.randint(0, 2, (k, n), generator=g) * (nbins - 1)
    elif spread == "uniform":
        b = torch.randint(0, nbins, (k, n), generator=g)
    else:  # only the first and last bins, and one column all in the middle
        b = torch.randint(0, 2, (k, n), generator=g) * (nbins - 1)
        b[0] = nbins // 2
    tau, bound = 1.0 / nbins, 1.0  # ceil(bound / tau) = nbins
    for eps in (0.01, 1.0, 30.0):
        r1, r2 = gen(5), gen(5)
        want = _range_from_bins(b, tau, bound, eps, r1)
        got = _range_from_counts(b, nbins, tau, bound, eps, r2)
        assert torch.equal(got, want)
        assert torch.equal(r1.get_state(), r2.get_state())  # the same draws, as many


def test_range_from_counts_catches_a_shifted_draw():
    """A weakened twin: reading each segment's uniform one position off changes μ̂."""
    b = torch.randint(0, 9, (50, 30), generator=gen(1))
    want = _range_from_bins(b, 1 / 9, 1.0, 0.5, gen(2))
    r = gen(2)
    torch.rand(1, generator=r, dtype=torch.float64)  # every later draw shifted by one
    assert not torch.equal(_range_from_counts(b, 9, 1 / 9, 1.0, 0.5, r), want)


@pytest.mark.parametrize("d", [4, 8, 64, 512, 2048, 1 << 15])
def test_fwht_gemm_is_the_hadamard_transform(d):
    x = torch.randn(3, d, generator=gen(d), dtype=torch.float64)
    got = fwht_gemm(x)
    ref = x @ _hadamard(d, torch.float64) if d <= 2048 else fwht(x)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-11 * d**0.5)


@pytest.mark.parametrize("d", [1, 2, 64, 128, 1024, 1 << 13, 1 << 15, 1 << 17])
def test_fwht_into_is_the_hadamard_transform(d):
    """The small-factor blocked transform: ``x @ H`` into the caller's buffer, ``x`` untouched."""
    x = torch.randn(5, d, generator=gen(d + 1), dtype=torch.float64)
    x0 = x.clone()
    out, work = torch.empty_like(x), torch.empty_like(x)
    got = fwht_into(x, out, work)
    assert got.data_ptr() == out.data_ptr() and torch.equal(x, x0)
    ref = x @ _hadamard(d, torch.float64) if d <= 2048 else fwht(x)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-11 * d**0.5)
    assert math.prod(fwht_factors(d)) == d and max(fwht_factors(d)) <= 64 or d <= 64


def test_rotate_block_equals_rotate_bit_for_bit_on_float32_rows():
    """float32 rows times ±1 summed over 2^15 terms are exact in float64: the blocked
    products give ``rotate``'s values exactly, through reused buffers with zero padding."""
    rot = RandomRotation(1000, rng=gen(3))  # d' = 1024: 24 padding columns
    X = torch.randn(37, 1000, generator=gen(4)).to(torch.float32)
    padded = torch.zeros(8, rot.dp, dtype=torch.float64)
    out, work = torch.empty_like(padded), torch.empty_like(padded)
    for s in range(0, 37, 8):
        got = rot.rotate_block(X[s : s + 8], padded, out, work)
        assert torch.equal(got, rot.rotate(X[s : s + 8].to(torch.float64)))
        assert not padded[:, 1000:].any()  # the padding columns stay zero for the next block
    with pytest.raises(ValueError, match="last dim 1000"):
        rot.rotate_block(X[:, :999], padded, out, work)


@pytest.mark.parametrize("count", [1, 2, 1000, 4097])
def test_uniforms_at_reads_torch_rand_without_the_other_values(count):
    """The words' conversion gives ``torch.rand``'s doubles at the asked positions and leaves
    the generator where ``torch.rand`` leaves it (a reused, larger buffer included)."""
    for seed in (0, 7, 123456789):
        r1, r2 = gen(seed), gen(seed)
        torch.rand(3, generator=r1, dtype=torch.float64)  # not at the stream's start
        torch.rand(3, generator=r2, dtype=torch.float64)
        want = torch.rand(count, generator=r1, dtype=torch.float64)
        idx = torch.randint(0, count, (50,), generator=gen(seed + 1))
        got = uniforms_at(r2, count, idx, torch.empty(count + 11, dtype=torch.int64))
        assert torch.equal(got, want[idx])
        assert torch.equal(r1.get_state(), r2.get_state())


def test_uniforms_at_catches_a_dropped_mask():
    """A weakened twin: the word without the 53-bit mask is not ``torch.rand``'s double."""
    r1, r2 = gen(1), gen(1)
    want = torch.rand(64, generator=r1, dtype=torch.float64)
    w = torch.empty(64, dtype=torch.int64).random_(generator=r2)
    assert not torch.equal(w.to(torch.float64) * 2.0**-53, want)
    r3 = gen(1)
    assert torch.equal(uniforms_at(r3, 64, torch.arange(64)), want)


@pytest.mark.parametrize("zeros", [0, 13])
@pytest.mark.parametrize("tau", [0.4, 0.15, 0.02])  # 3 and 7 bins (counted); 50 (stored)
def test_winsorized_counts_and_stored_bins_release_the_same(zeros, tau, monkeypatch):
    """Pass 1 keeps per-column counts of v >= j (<= COUNT_BINS bins) or stores the bins: the
    same centres, clipped fraction, release and generator state, with padding rows counted
    (not rotated) and with entries clipped (pass 2)."""
    n, d = 60, 50
    G = (0.05 * torch.randn(n, d, generator=gen(9))).to(torch.float32)
    G[:5] *= 40  # a few rows far out: some entries clipped
    outs = []
    for count_bins in (winsorized.COUNT_BINS, 0):
        monkeypatch.setattr(winsorized, "COUNT_BINS", count_bins)
        rot, rng = RandomRotation(d, rng=gen(2)), gen(3)
        rows = CohortRows(G, n + zeros, chunk=7)
        mean, diag = winsorized_mean_rows(rows, tau, 1.0, 1.0, rng=rng, rotation=rot)
        outs.append((mean, diag, rng.get_state()))
    (m1, d1, s1), (m2, d2, s2) = outs
    assert torch.equal(d1["center"], d2["center"]) and torch.equal(s1, s2)
    assert d1["clipped_fraction"] == d2["clipped_fraction"] > 0
    torch.testing.assert_close(m1, m2, rtol=1e-12, atol=1e-12)
