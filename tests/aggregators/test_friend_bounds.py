"""Friend counts from low-rank bounds (fedudp/aggregators/friend_bounds.py, issue 40).

The bracket must contain every exact count; rows made exact must equal ``friend_counts``; and
outlier removal and FriendlyCore must release what they released before the bounds existed (the
values recorded at 5c7eba9 in ``data/rows_fixture.npz``), with the same generator draws, when the
bounds decide (a small rank and no minimum size force that path on the small fixture).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.aggregators import make_rows_fixture as fx
from fedudp.aggregators import friend_bounds
from fedudp.aggregators import friendlycore
from fedudp.aggregators import outlier as O
from fedudp.protocol.contributions import Sampling
from fedudp.aggregators.rows import CohortRows
from fedudp.privacy.mechanisms import AboveThreshold

REC = np.load(fx.OUT)
NAMES = ("clustered", "iid")
RADII = (0.2, 0.3, 0.45, 0.6, 1.0)


def exact(name: str) -> torch.Tensor:
    return torch.from_numpy(REC[f"{name}/friend_counts/prune=True"])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "rank,block,tile", ((0, 64, 4096), (4, 7, 16), (16, 300, 4096), (40, 33, 50))
)
def test_bracket_contains_the_exact_counts(monkeypatch, name, rank, block, tile):
    monkeypatch.setattr(friend_bounds, "TILE_COLUMNS", tile)
    G = torch.from_numpy(REC[name])
    b = friend_bounds.friend_bounds(CohortRows(G, fx.N), RADII, rank=rank, block=block)
    want = exact(name)
    assert torch.equal(b.total_low, b.low.sum(1)) and torch.equal(b.total_high, b.high.sum(1))
    assert b.low.shape == want.shape == b.high.shape
    assert bool((b.low <= want).all()) and bool((want <= b.high).all())
    assert bool((b.low >= 1).all())  # a row is its own friend
    # the bracket decides something: more directions, fewer open pairs
    open_pairs = int((b.high - b.low).sum())
    assert open_pairs < fx.N * fx.N * len(RADII)


@pytest.mark.parametrize("name", NAMES)
def test_totals_only_bracket_the_total(monkeypatch, name):
    """A radius counted for its total only: a tight bracket of Σ_j f_j (the score's), the
    trivial per-row bracket [1, n]; the per-row radii are unaffected."""
    monkeypatch.setattr(friend_bounds, "TILE_COLUMNS", 40)
    G = torch.from_numpy(REC[name])
    V = CohortRows(G, fx.N)
    both = friend_bounds.friend_bounds(V, RADII, rank=8, block=30)
    flags = (True, False, True, False, False)
    part = friend_bounds.friend_bounds(V, RADII, rank=8, block=30, totals=flags)
    want = exact(name).sum(1)
    assert bool((part.total_low <= want).all()) and bool((want <= part.total_high).all())
    for k, only in enumerate(flags):
        if only:
            assert bool((part.low[k] == 1).all()) and bool((part.high[k] == fx.N).all())
            assert part.total_low[k] == both.total_low[k]
            assert part.total_high[k] == both.total_high[k]
        else:
            assert torch.equal(part.low[k], both.low[k]) and torch.equal(part.high[k], both.high[k])
    with pytest.raises(ValueError, match="one flag per radius"):
        friend_bounds.friend_bounds(V, RADII, totals=(True,))


def test_norm_margin_grows_with_the_width():
    assert friend_bounds.norm_margin(28938, 128) == friend_bounds.MARGIN_NORM
    assert friend_bounds.norm_margin(10**7, 128) > 10 * friend_bounds.MARGIN_NORM


def test_more_directions_decide_more_pairs():
    G = torch.from_numpy(REC["clustered"])
    V = CohortRows(G, fx.N)
    opened = []
    for k in (0, 8, 64):
        b = friend_bounds.friend_bounds(V, RADII, rank=k)
        opened.append(int((b.high - b.low).sum()))
    assert opened[0] > opened[1] > opened[2]


def test_weakened_twin_without_the_residual_term_is_caught(monkeypatch):
    """Dropping |<Qa, Qb>| <= ρ_a ρ_b (pretending the directions hold all of every row) gives a
    bracket that misses exact counts: the containment check above catches it."""
    G = torch.from_numpy(REC["iid"])
    monkeypatch.setattr(friend_bounds, "residual_norms", lambda sq, Y: torch.zeros_like(sq))
    b = friend_bounds.friend_bounds(CohortRows(G, fx.N), RADII, rank=8)
    want = exact("iid")
    assert not (bool((b.low <= want).all()) and bool((want <= b.high).all()))


@pytest.mark.parametrize("name", NAMES)
def test_exact_rows_equal_friend_counts(name):
    G = torch.from_numpy(REC[name])
    V = CohortRows(G, fx.N)
    b = friend_bounds.friend_bounds(V, RADII, rank=4)
    which = torch.zeros(fx.N, dtype=torch.bool)
    which[::7] = True
    which[fx.RECEIVED :] = True  # padding rows too
    e = friend_bounds.exact_counts(V, b, which, (1, 3))
    want = exact(name)
    for k in (1, 3):
        assert torch.equal(e.low[k, which], want[k, which])
        assert torch.equal(e.high[k, which], want[k, which])
        assert torch.equal(e.low[k, ~which], b.low[k, ~which])  # the rest untouched
    assert torch.equal(e.low[0], b.low[0]) and torch.equal(e.high[2], b.high[2])


@pytest.fixture
def bounded(monkeypatch):
    """The bounds path on the small fixture: no minimum size, 8 directions, 50-row blocks."""
    monkeypatch.setattr(friend_bounds, "MIN_ROWS", 0)
    monkeypatch.setattr(friend_bounds, "BOUND_RANK", 8)
    monkeypatch.setattr(friend_bounds, "BLOCK_ROWS", 50)
    calls: list[int] = []
    real = friend_bounds.exact_counts

    def spy(V, bounds, which, ks):
        calls.append(int(which.sum()) if which.dtype == torch.bool else len(which))
        return real(V, bounds, which, ks)

    monkeypatch.setattr(friend_bounds, "exact_counts", spy)
    return calls


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max() + 1))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tau", (0.15, 0.3, 0.6, 1.2, 2.0))
@pytest.mark.parametrize("exact_fraction", (1.0, 0.25))
def test_filters_release_the_recorded_values_through_the_bounds(
    bounded, monkeypatch, name, tau, exact_fraction
):
    """exact_fraction 1: every open row made exact on its own; 0.25: the default switch to one
    full exact pass when many rows are open."""
    monkeypatch.setattr(friend_bounds, "EXACT_FRACTION", exact_fraction)
    G = torch.from_numpy(REC[name])
    agg = O.OutlierRemovalAggregator(tau, 2.0, 0.01, Sampling(1.0, fx.N), 5.0, 3, 1e-6, 1)
    rng = torch.Generator().manual_seed(11)
    key = f"{name}/outlier/tau={tau}"
    for r, (want_kept, want_score) in enumerate(zip(REC[f"{key}/kept"], REC[f"{key}/scores"])):
        a = agg.estimate(G, rng=rng)
        d = a.diagnostics
        assert a.users_used == int(want_kept)
        assert d["score_low"] <= float(want_score) <= d["score_high"]
        if d["score"] is not None:
            assert d["score"] == float(want_score)
        close(a.mean.numpy(), REC[f"{key}/means"][r])
        if a.halted:
            break
    mean, kept, mass = fx.friendly(G, tau, seed=13)
    key = f"{name}/friendlycore/tau={tau}"
    assert kept == int(REC[f"{key}/kept"]) and mass == float(REC[f"{key}/mass"])
    close(mean, REC[f"{key}/mean"])


def test_the_bounds_path_resolves_open_rows_and_leaves_scores_open(bounded, monkeypatch):
    """Across the fixture some keep decisions needed exact rows and some scores were decided
    from their bracket alone (else the test above would not exercise the bounds)."""
    monkeypatch.setattr(friend_bounds, "EXACT_FRACTION", 1.0)
    open_scores = 0
    for name in NAMES:
        G = torch.from_numpy(REC[name])
        for tau in (0.15, 0.3, 0.6, 1.2, 2.0):
            agg = O.OutlierRemovalAggregator(tau, 2.0, 0.01, Sampling(1.0, fx.N), 5.0, 1, 1e-6, 1)
            a = agg.estimate(G, rng=torch.Generator().manual_seed(11))
            open_scores += a.diagnostics["score"] is None
            fx.friendly(G, tau, seed=13)  # FriendlyCore: open keep decisions made exact
    resolved = sum(1 for c in bounded if c > 0)
    assert resolved > 0 and open_scores > 0


def test_generator_state_is_unchanged_by_the_bounds(bounded, monkeypatch):
    G = torch.from_numpy(REC["clustered"])
    states = []
    for min_rows in (0, 10**9):  # the bounds, then the exact counts
        monkeypatch.setattr(friend_bounds, "MIN_ROWS", min_rows)
        agg = friendlycore.FriendlyCoreAggregator(
            0.6, 2.0, 0.01, Sampling(1.0, fx.N), 0.05, 1e-6, 1
        )
        rng = torch.Generator().manual_seed(5)
        a = agg.estimate(G, rng=rng)
        states.append((a.mean.clone(), a.users_used, rng.get_state()))
    assert torch.equal(states[0][2], states[1][2]) and states[0][1] == states[1][1]
    assert torch.allclose(states[0][0], states[1][0], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("seed", range(40))
def test_above_threshold_between_answers_as_the_exact_test(seed):
    g = torch.Generator().manual_seed(seed)
    value = float(torch.rand(1, generator=g)) * 100
    width = float(torch.rand(1, generator=g)) * 30
    low, high = value - width * float(torch.rand(1, generator=g)), value + width * 0.5
    a = AboveThreshold(50.0, 1.0, rng=torch.Generator().manual_seed(seed), sensitivity=2.0)
    b = AboveThreshold(50.0, 1.0, rng=torch.Generator().manual_seed(seed), sensitivity=2.0)
    asked: list[int] = []

    def exact() -> float:
        asked.append(1)
        return value

    assert a.test(value) == b.test_between(low, high, exact)
    assert torch.equal(a.rng.get_state(), b.rng.get_state())
    assert a.halted == b.halted and a.queries == b.queries == 1


def test_above_threshold_between_asks_only_when_open():
    a = AboveThreshold(50.0, 1.0, rng=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="low <= high"):
        a.test_between(3.0, 2.0, lambda: 2.5)
    asked: list[float] = []
    assert a.test_between(1e6, 2e6, lambda: asked.append(1) or 1.5e6) is True
    assert asked == []  # far above: decided from the bracket
    with pytest.raises(ValueError, match="outside"):
        AboveThreshold(50.0, 1.0, rng=torch.Generator().manual_seed(0)).test_between(
            -1e6, 1e6, lambda: 2e6
        )
    b = AboveThreshold(50.0, 1.0, rng=torch.Generator().manual_seed(0))
    assert b.test_between(-2e6, -1e6, lambda: asked.append(1) or -1.5e6) is False
    assert asked == [] and b.halted
