"""The row estimators' throughput paths equal their direct forms (issue 40).

PrivateRange from bin counts (``_range_from_counts``) against the 2n+1-segment form
(``_range_from_bins``, still used above ``HISTOGRAM_BINS``): the same μ̂ and the same generator
state afterwards. The two-product Hadamard transform (``fwht_gemm``) against the Hadamard
matrix.
"""

from __future__ import annotations

import pytest
import torch

from fedudp.aggregators.winsorized import _range_from_bins, _range_from_counts
from fedudp.privacy.mechanisms import _hadamard, fwht, fwht_gemm


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
