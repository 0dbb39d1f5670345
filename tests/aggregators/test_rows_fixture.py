"""The row estimators release the values recorded before their restructuring (issue 40).

``data/rows_fixture.npz`` holds fixed small inputs and what winsorized, outlier removal,
FriendlyCore, PrivateRange and the friend counts released from them on fixed seeds at the
commit named in the file (5c7eba9, before the blocked passes), made by ``make_rows_fixture.py``.
Counts, kept users, scores and clipped fractions (the privacy-relevant branches) must be equal;
released means equal up to float rounding of sums over rows (a different summation order).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.aggregators import make_rows_fixture as fx
from fedudp.aggregators.friend_counts import friend_counts
from fedudp.aggregators.rows import CohortRows
from fedudp.aggregators.private_range import private_range

REC = np.load(fx.OUT)
NAMES = ("clustered", "iid")


def close(got: np.ndarray, want: np.ndarray) -> None:
    """Equal up to float32 rounding of values of the releases' scale (sums in another order)."""
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max() + 1))


def test_fixture_records_its_commit():
    assert str(REC["commit"]) == "5c7eba9"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("prune", (True, False))
def test_friend_counts_unchanged(name, prune):
    G = torch.from_numpy(REC[name])
    radii = tuple(REC[f"{name}/friend_counts/radii"].tolist())
    got = friend_counts(CohortRows(G, fx.N), radii, prune=prune)
    assert np.array_equal(got.numpy(), REC[f"{name}/friend_counts/prune={prune}"])
    # and both equal the exact float64 distances, pair by pair, on this tiny cohort
    X = torch.zeros(fx.N, fx.D, dtype=torch.float64)
    X[: fx.RECEIVED] = G.double()
    d = torch.cdist(X, X)  # exact enough: no pair lies within 1e-9 of a radius here
    for k, r in enumerate(radii):
        assert float(((d - r).abs() / r).min()) > 1e-9
        assert np.array_equal(got[k].numpy(), (d <= r).sum(1).numpy())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "tag,tau,bound,eps", (("wide", 0.5, 1.0, 1.0), ("narrow", 0.004, 0.2, 2.0))
)
@pytest.mark.parametrize("chunk", (None, 37))
def test_winsorized_unchanged(name, tag, tau, bound, eps, chunk):
    G = torch.from_numpy(REC[name])
    mean, frac = fx.winsorized(G, tau, bound, eps, seed=7, chunk=chunk)
    key = f"{name}/winsorized/{tag}/chunk={chunk}"
    assert frac == float(REC[f"{key}/clipped_fraction"])
    close(mean, REC[f"{key}/mean"])


@pytest.mark.parametrize("name", NAMES)
def test_private_range_unchanged(name):
    G = torch.from_numpy(REC[name])
    mu = private_range(
        G.double(), 0.01, 0.3, 0.5, rng=torch.Generator().manual_seed(3), chunk_elems=5000
    )
    assert np.array_equal(mu.numpy(), REC[f"{name}/private_range"])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tau", (0.15, 0.3, 0.6, 1.2, 2.0))
def test_filters_unchanged(name, tau):
    G = torch.from_numpy(REC[name])
    means, kept, scores = fx.outlier(G, tau, seed=11, rounds=3)
    key = f"{name}/outlier/tau={tau}"
    assert np.array_equal(kept, REC[f"{key}/kept"])
    assert np.array_equal(scores, REC[f"{key}/scores"])
    close(means, REC[f"{key}/means"])
    mean, kept1, mass = fx.friendly(G, tau, seed=13)
    key = f"{name}/friendlycore/tau={tau}"
    assert kept1 == int(REC[f"{key}/kept"]) and mass == float(REC[f"{key}/mass"])
    close(mean, REC[f"{key}/mean"])
