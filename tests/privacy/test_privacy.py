"""The clip+Gaussian billboard release (docs/algorithms.md#gaussian-mean); the accountant and
its calibration are guarded in tests/privacy/test_accountant.py.

Unit: a user (add/remove one user's whole vector). The Gaussian release adds
N(0, (z C)^2) to the sum of clipped vectors and divides by the public q*N_units.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from fedudp.aggregators import Constraint, GaussianAggregator, Sampling
from fedudp.aggregators.gaussian import gaussian_round_event


def test_gaussian_round_event_is_the_poisson_sampled_gaussian():
    # what the accountant is fed for one clip+Gaussian round (the accountant's own guard,
    # tests/privacy/test_accountant.py, uses these literal events)
    assert gaussian_round_event(1.3, 0.05) == dp_accounting.PoissonSampledDpEvent(
        0.05, dp_accounting.GaussianDpEvent(1.3)
    )
    assert gaussian_round_event(1.3, 1.0) == dp_accounting.GaussianDpEvent(1.3)


# -- the Gaussian aggregator: sensitivity of the pre-noise sum --------------------------------
finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=64)


@settings(max_examples=60, deadline=None)
@given(
    G=arrays(np.float64, st.tuples(st.integers(2, 12), st.integers(1, 6)), elements=finite),
    other=arrays(np.float64, 6, elements=finite),
    clip=st.floats(0.01, 50.0),
    i=st.integers(0, 100),
)
def test_pre_noise_sum_sensitivity(G, other, clip, i):
    agg = GaussianAggregator(clip, 1.0, Sampling(1.0, 100))
    G = torch.from_numpy(G)
    i = i % G.shape[0]
    s = agg.constraint.apply(G).total
    removed = agg.constraint.apply(torch.cat([G[:i], G[i + 1 :]])).total
    repl = G.clone()
    repl[i] = torch.from_numpy(other[: G.shape[1]])
    replaced = agg.constraint.apply(repl).total
    tol = 1e-9 * max(1.0, clip)
    assert torch.linalg.vector_norm(s - removed) <= clip + tol  # add/remove: C
    assert torch.linalg.vector_norm(s - replaced) <= 2 * clip + tol  # replace-one: 2C


def test_sensitivity_is_attained():
    # the bounds are tight: a far-away user moves the sum by exactly C (and 2C when replaced)
    agg = GaussianAggregator(1.0, 1.0, Sampling(1.0, 10))
    G = torch.tensor([[100.0, 0.0], [0.0, 3.0]], dtype=torch.float64)
    a = agg.constraint.apply(G).total
    b = agg.constraint.apply(G[1:]).total
    c = agg.constraint.apply(torch.tensor([[-100.0, 0.0], [0.0, 3.0]], dtype=torch.float64)).total
    assert float(torch.linalg.vector_norm(a - b)) == pytest.approx(1.0)
    assert float(torch.linalg.vector_norm(a - c)) == pytest.approx(2.0)


def test_noise_standard_deviation_statistical():
    """One release over d = 200,000 coordinates: the noise on the sum is N(0, (zC)^2)."""
    z, C, d = 1.7, 0.5, 200_000
    agg = GaussianAggregator(C, z, Sampling(1.0, 1))
    g = torch.Generator().manual_seed(1234)
    G = torch.zeros(1, d, dtype=torch.float64)
    G[0, 0] = 0.3  # one user; its vector enters unclipped (norm < C)
    out = agg(G, rng=g)
    noise = out.mean.clone()  # divided by q*N = 1
    noise[0] -= 0.3
    sd = float(noise.std())
    # the sample sd of 2e5 normals is within 1% of sigma with overwhelming probability
    assert sd == pytest.approx(z * C, rel=0.01)
    assert abs(float(noise.mean())) < 5 * z * C / math.sqrt(d)
    # and the same seed gives the same release
    assert torch.equal(agg(G, rng=torch.Generator().manual_seed(1234)).mean, out.mean)


def test_release_divides_by_public_expected_cohort_not_realized():
    agg = GaussianAggregator(10.0, 0.0, Sampling(0.25, 400))  # q*N = 100
    G = torch.ones(37, 3, dtype=torch.float64)  # realized cohort: 37
    out = agg(G, rng=torch.Generator().manual_seed(0))
    assert torch.allclose(out.mean, torch.full((3,), 37 / 100, dtype=torch.float64))
    assert out.users_used == 37
    assert isinstance(agg.dp_event(), dp_accounting.PoissonSampledDpEvent)
    assert agg.dp_event().sampling_probability == 0.25


def test_nonfinite_rows_are_excluded_before_release():
    from fedudp.protocol.messages import make_reply

    agg = GaussianAggregator(1.0, 1.0, Sampling(1.0, 10))
    G = torch.tensor([[0.5, 0.0], [float("nan"), 1.0], [float("inf"), 0.0], [0.0, 0.25]])
    rep = make_reply(G, ("w",), agg.constraint)
    assert rep.failed == 2 and rep.contribution.count == 2
    assert torch.equal(rep.contribution.total, torch.tensor([0.5, 0.25]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nonfinite_screening_by_norms_is_exact(dtype):
    """Clipped float32 rows are screened by their float64 norms (no element-wise mask): a row
    whose squares overflow float32 but not float64 is finite and kept; one NaN or inf anywhere
    drops its row. float64 rows (whose squares can overflow) keep the element-wise mask. With
    ``owned`` the caller's buffer is clipped in place and the release is the same."""
    from fedudp.protocol.messages import make_reply

    big = 3.0e38 if dtype == torch.float32 else 1.0e200
    G = torch.zeros(6, 5, dtype=dtype)
    G[0, 0] = big  # finite, squares above float32's range
    G[1] = 0.1
    G[2, 4] = float("nan")
    G[3, 1] = float("inf")
    G[4, 3] = float("-inf")
    G[5, 2] = -2.0
    constraint = Constraint(rows=False, clip=1.0)
    rep = make_reply(G.clone(), ("w",), constraint)
    assert rep.failed == 3 and rep.contribution.count == 3
    assert rep.contribution.clipped == 2  # rows 0 and 5
    # row 0 clipped to norm 1; in float64 its norm overflows to inf and its factor is 0 (a
    # release within the clip either way)
    first = 1.1 if dtype == torch.float32 else 0.1
    want = torch.tensor([first, 0.1, 0.1 - 1.0, 0.1, 0.1], dtype=torch.float64)
    torch.testing.assert_close(rep.contribution.total.double(), want, rtol=1e-6, atol=1e-6)
    finite = torch.zeros(3, 5, dtype=dtype)
    finite[0, 0], finite[1], finite[2, 2] = big, 0.1, -2.0
    buf = finite.clone()
    owned = make_reply(buf, ("w",), constraint, owned=True)
    kept = make_reply(finite.clone(), ("w",), constraint)
    assert torch.equal(owned.contribution.total, kept.contribution.total)
    assert not torch.equal(buf, finite)  # clipped in place: no copy made


def test_gaussian_noise_is_drawn_in_float64_then_cast():
    # float32's normal sampler never exceeds |z| ≈ 5.77 and has a point mass there, which
    # underestimates δ; the release must be the float64 draw, added in float64, cast afterwards
    from fedudp.aggregators import Contribution

    agg = GaussianAggregator(0.7, 3.3, Sampling(0.5, 40))
    total = torch.randn(10_000, generator=torch.Generator().manual_seed(3))  # float32 sum
    out = agg.release(Contribution(None, total, 17), rng=torch.Generator().manual_seed(9))
    z64 = torch.randn(10_000, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    want = ((total.double() + 0.7 * 3.3 * z64) / 20.0).float()
    assert out.mean.dtype == torch.float32 and torch.equal(out.mean, want)
    z32 = torch.randn(10_000, generator=torch.Generator().manual_seed(9), dtype=torch.float32)
    assert not torch.equal(out.mean, ((total + 0.7 * 3.3 * z32) / 20.0))


def test_friend_counts_far_from_the_origin_are_exact():
    # users at ||v|| ≈ 1e5 spaced 3 apart (radius 1): nobody is anybody's friend. A float32 Gram
    # matrix counts them all as friends (its rounding error there is ~1e3 in squared distance)
    from fedudp.aggregators.friend_counts import friend_counts

    n, d = 200, 8
    V = torch.full((n, d), 1e5, dtype=torch.float32)
    V[:, 0] += 3.0 * torch.arange(n, dtype=torch.float32)
    counts = friend_counts(V, (1.0, 2.9, 3.1))
    assert counts[0].tolist() == [1] * n and counts[1].tolist() == [1] * n
    assert counts[2].tolist() == [2] + [3] * (n - 2) + [2]  # neighbours at exactly 3
    # the float32 computation the function must not fall back to gets it wrong
    sq = (V * V).sum(1)
    d2 = torch.addmm(sq[None, :], V, V.T, alpha=-2.0) + sq[:, None]
    assert int((d2 <= 1.0).sum()) > 2 * n
