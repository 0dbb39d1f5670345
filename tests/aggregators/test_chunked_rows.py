"""The row estimators read the cohort's rows in float64 chunks (fedudp/aggregators/rows.py):
the same releases as on one whole float64 matrix, the noise drawn from the same generator in
the same order, and the memory the pre-flight check counts (fedudp/aggregators/memory.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fedudp.aggregators import memory
from fedudp.aggregators import friendlycore
from fedudp.aggregators import private_range as prange
from fedudp.aggregators import outlier, winsorized
from fedudp.protocol.contributions import Constraint, Contribution, Sampling
from fedudp.aggregators.few_users import FewUsersAggregator
from fedudp.aggregators.friendlycore import FriendlyCoreAggregator
from fedudp.aggregators.outlier import OutlierRemovalAggregator
from fedudp.aggregators.friend_counts import friend_counts
from fedudp.aggregators.rows import CohortRows
from fedudp.aggregators.winsorized import WinsorizedAggregator, winsorized_mean_rows
from fedudp.config import ConfigError
from fedudp.protocol.messages import make_reply, rows_reply
from fedudp.privacy.mechanisms import RandomRotation, laplace

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[2]


def gen(seed):
    return torch.Generator().manual_seed(seed)


# -- the former whole-matrix estimators, verbatim (before the rows were chunked) -----------------
def legacy_pad(G, n):
    if G.shape[0] < n:
        G = torch.cat([G, G.new_zeros(n - G.shape[0], G.shape[1])])
    return G


def legacy_friend_counts(V, radii, chunk=1024):
    n = V.shape[0]
    V = V.to(F64)
    V = V - V.mean(0, keepdim=True)
    sq = (V * V).sum(1)
    out = torch.zeros(len(radii), n, dtype=torch.int64)
    for i in range(0, n, chunk):
        blk = V[i : i + chunk]
        d2 = torch.addmm(sq[None, :], blk, V.T, alpha=-2.0)
        d2 += sq[i : i + chunk, None]
        idx = torch.arange(i, min(i + chunk, n))
        d2[idx - i, idx] = 0.0
        for k, r in enumerate(radii):
            out[k, i : i + chunk] = (d2 <= r * r).sum(1)
    return out


def legacy_filtered_mean(V, p, rng):
    keep = torch.rand(p.shape, generator=rng, dtype=F64) < p
    k = int(keep.sum())
    if k == 0:
        return V.new_zeros(V.shape[1]), 0
    return V[keep].mean(0), k


def legacy_winsorized(agg, G, rng):
    n = agg.sampling.population
    X = legacy_pad(G.to(F64), n)
    rot = RandomRotation(agg.dim, rng=rng)
    Y = rot.rotate(X)
    tau, eps, h = agg.tau_coord, agg.eps_coord, agg.h
    mu = prange.private_range(Y, tau, agg.bound, eps / 2, rng=rng)  # tensor path: unchanged
    stat, frac = winsorized.winsorized_sum(Y, mu, h * tau)
    out = stat / n + laplace((Y.shape[1],), 4 * h * tau / (n * eps), rng=rng)
    return rot.invert(out).to(G.dtype), mu, frac


def legacy_outlier_removal(agg, G, rng):
    if agg.at is None:
        seed = int(torch.randint(0, 2**62, (1,), generator=rng))
        agg.at = outlier.AboveThreshold(
            4 * agg.sampling.population / 5,
            agg.eps_at,
            rng=torch.Generator().manual_seed(seed),
            sensitivity=outlier.SCORE_SENSITIVITY,
        )
    n = agg.sampling.population
    V = legacy_pad(G, n)
    counts = legacy_friend_counts(V, (agg.tau, 2 * agg.tau))
    score = outlier.concentration_score(counts[0])
    p = outlier.keep_probabilities(counts[1], n)
    if not agg.at.test(score):
        return G.new_zeros(G.shape[1]), 0, counts
    mean, kept = legacy_filtered_mean(V, p, rng)
    return agg._noisy(mean, rng), kept, counts


def legacy_friendlycore(agg, G, rng):
    n = agg.sampling.population
    V = legacy_pad(G, n)
    counts = legacy_friend_counts(V, (2 * agg.tau,))
    p = friendlycore.friendly_keep_probabilities(counts[0], n)
    noisy = float(p.sum()) + float(laplace((1,), agg.check_scale, rng=rng)[0])
    if noisy < friendlycore.MASS_RELEASE * n:
        return G.new_zeros(G.shape[1]), 0, counts
    mean, kept = legacy_filtered_mean(V, p, rng)
    return agg._noisy(mean, rng), kept, counts


def legacy_dp_estimate_1(X, radius, eps, delta, tries, rng, batch=64):
    from fedudp.aggregators.few_users import log_accept, uniform_in_balls

    n, d = X.shape
    X = X.to(F64)
    u = float(torch.rand((), generator=rng, dtype=F64))
    budget = 1 if tries <= 1 else max(1, math.ceil(math.log1p(-u) / math.log1p(-1.0 / tries)))
    p_garbage = float(torch.sigmoid(torch.tensor(math.log(4 / delta) - 2 * eps * n / 3, dtype=F64)))
    sq = (X * X).sum(1)
    done = 0
    while done < budget:
        b = min(batch, budget - done)
        garbage = torch.rand(b, generator=rng, dtype=F64) < p_garbage
        keep_garbage = torch.rand(b, generator=rng, dtype=F64) < 1 / 3
        idx = torch.randint(0, n, (b,), generator=rng)
        P = uniform_in_balls(X[idx], radius, rng=rng)
        d2 = (P * P).sum(1, keepdim=True) + sq[None] - 2 * P @ X.T
        f = (d2 <= radius * radius).sum(1).clamp(min=1)
        acc = torch.log(torch.rand(b, generator=rng, dtype=F64)) < log_accept(f, n, eps)
        stop = torch.where(garbage, keep_garbage, acc)
        if bool(stop.any()):
            j = int(torch.nonzero(stop)[0])
            return None if bool(garbage[j]) else P[j]
        done += b
    return None


def legacy_few_users(agg, G, rng):
    n = agg.sampling.population
    X = legacy_pad(G.to(F64), n)
    rot = RandomRotation(agg.dim, rng=rng) if agg.rotate else None
    Y = rot.rotate(X) if rot is not None else X
    db = Y.shape[1] // agg.blocks
    est = []
    for b in range(agg.blocks):
        outs = []
        for _ in range(agg.copies):
            p = legacy_dp_estimate_1(
                Y[:, b * db : (b + 1) * db], agg.radius, agg.eps1, agg.delta1, agg.tries, rng
            )
            if p is not None:
                outs.append(p)
        est.append(torch.stack(outs).median(0).values if outs else Y.new_zeros(db))
    y = torch.cat(est)
    return (rot.invert(y) if rot is not None else y).to(G.dtype)


# -- inputs ----------------------------------------------------------------------------------
def spread_rows(n, d, dtype, seed=0, received=None):
    """Rows at scales from 0.05 to 2 (so friend counts vary from most users to few)."""
    g = gen(seed)
    scale = torch.linspace(0.05, 2.0, n, dtype=F64)[torch.randperm(n, generator=g)]
    X = 0.4 + torch.randn(n, d, generator=g, dtype=F64) * scale[:, None] / math.sqrt(d)
    return X[: received or n].to(dtype)


def same_state(a: torch.Generator, b: torch.Generator) -> bool:
    return torch.equal(a.get_state(), b.get_state())


CASES = [(F64, None), (torch.float32, None), (torch.float32, 7)]  # dtype, missing units
CASE_IDS = ["f64", "f32", "f32-padded"]


def close(a, b):
    tol = dict(rtol=1e-10, atol=1e-12) if a.dtype == F64 else dict(rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(a, b, **tol)


# -- winsorized --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,missing", CASES, ids=CASE_IDS)
def test_winsorized_chunks_release_the_whole_matrix_values(dtype, missing):
    n, d = 60, 37  # d' = 64: padded rotation
    G = spread_rows(n, d, dtype, seed=1, received=n - (missing or 0))
    outs = {}
    for chunk in (3, None, 10**6):
        agg = WinsorizedAggregator(d, 0.01, 1.0, 1.5, Sampling(1.0, n))
        agg.chunk_rows = chunk
        rng = gen(11)
        out = agg.release(Contribution(G, None, len(G)), rng=rng)
        outs[chunk] = (out, rng)
    ref_rng = gen(11)
    ref, mu, frac = legacy_winsorized(
        WinsorizedAggregator(d, 0.01, 1.0, 1.5, Sampling(1.0, n)), G, ref_rng
    )
    assert 0 < frac < 1  # some entries clipped, some not
    for chunk, (out, rng) in outs.items():
        assert out.mean.dtype == dtype and out.users_used == len(G)
        close(out.mean, ref)
        assert same_state(rng, ref_rng), chunk  # the same draws, in the same number
        assert out.diagnostics["clipped_fraction"] == pytest.approx(frac, rel=1e-12)


@pytest.mark.parametrize("chunk", [3, None])
def test_winsorized_skips_the_second_rotation_when_nothing_is_clipped(chunk, monkeypatch):
    n, d = 50, 24
    G = (0.2 + 0.001 * torch.randn(n, d, generator=gen(3), dtype=F64)).to(torch.float32)
    make = lambda: WinsorizedAggregator(d, 0.2, 1.0, 1.5, Sampling(1.0, n))  # noqa: E731
    ref_rng = gen(12)
    ref, _, frac = legacy_winsorized(make(), G, ref_rng)
    assert frac == 0
    rotated = []
    real = RandomRotation.rotate_block
    monkeypatch.setattr(
        RandomRotation,
        "rotate_block",
        lambda self, X, *bufs: rotated.append(len(X)) or real(self, X, *bufs),
    )
    agg = make()
    agg.chunk_rows = chunk
    rng = gen(12)
    out = agg.release(Contribution(G, None, n), rng=rng)
    assert sum(rotated) == n  # one pass over the rows
    close(out.mean, ref)
    assert same_state(rng, ref_rng) and out.diagnostics["clipped_fraction"] == 0


def test_winsorized_two_passes_store_bins_and_find_the_same_centers():
    n, d = 45, 20
    G = spread_rows(n, d, torch.float32, seed=2)
    tau, bound, eps = 0.03, 1.0, 2.0
    rot_a, rot_b = RandomRotation(d, rng=gen(5)), RandomRotation(d, rng=gen(5))
    a, da = winsorized_mean_rows(
        CohortRows(G, n + 5, chunk=4), tau, bound, eps, rng=gen(6), rotation=rot_a, n_public=n + 5
    )
    Y = rot_b.rotate(legacy_pad(G.to(F64), n + 5))
    rng = gen(6)
    mu = prange.private_range(Y, tau, bound, eps / 2, rng=rng)
    assert torch.equal(da["center"], mu)  # bins are integers: exactly the same μ̂
    assert len(set(mu.tolist())) > 1
    assert prange.bin_dtype(tau, bound) == torch.uint8
    assert prange.bin_dtype(1e-3, 1e9) == torch.int64
    assert prange.bin_dtype(1e-3, 10.0) == torch.int16


# -- friend counts, outlier removal, FriendlyCore ----------------------------------------------
@pytest.mark.parametrize("chunk,outer", [(1, 1), (3, 7), (5, 5), (16, 40), (1024, None)])
def test_friend_counts_blocks_count_each_pair_as_the_whole_matrix_does(chunk, outer):
    n = 53
    V = spread_rows(n, 29, torch.float32, seed=3)
    radii = (0.5, 1.0, 1.6)
    want = legacy_friend_counts(V, radii)
    assert 0 < int(want[1].min()) < int(want[1].max()) < n  # counts vary
    got = friend_counts(CohortRows(V, n + 4), radii, chunk=chunk, outer=outer)
    assert torch.equal(got, legacy_friend_counts(legacy_pad(V, n + 4), radii))
    assert torch.equal(friend_counts(V, radii, chunk=chunk, outer=outer), want)
    assert torch.equal(friend_counts(V, radii, chunk=chunk, outer=outer, prune=False), want)


def test_friend_counts_decided_by_norms_are_the_gram_answers(monkeypatch):
    # a tight core, a shell at distance ~1 and far rows: whole blocks are friends or not by
    # their norms alone (no Gram block), the rest by their products; the counts are the same
    g = gen(7)
    n, d = 90, 31
    core = 0.01 * torch.randn(40, d, generator=g, dtype=F64)
    shell = torch.nn.functional.normalize(torch.randn(30, d, generator=g, dtype=F64), dim=1)
    far = 5.0 + torch.randn(20, d, generator=g, dtype=F64)
    V = torch.cat([core, shell, far])[torch.randperm(n, generator=g)].to(torch.float32)
    radii = (0.3, 1.2, 2.5)
    want = legacy_friend_counts(V, radii)
    grams = []
    real = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: grams.append(a[1].shape) or real(*a, **k))
    for chunk, outer in [(8, 16), (10, 10), (4, 90)]:
        grams.clear()
        assert torch.equal(friend_counts(V, radii, chunk=chunk, outer=outer, prune=False), want)
        full = len(grams)
        grams.clear()
        assert torch.equal(friend_counts(V, radii, chunk=chunk, outer=outer), want)
        assert len(grams) < full, (chunk, outer)  # some blocks decided by their norms
    grams.clear()  # all within the smallest radius: no products
    tight = 0.3 + 0.01 * torch.randn(n, d, generator=g, dtype=F64)
    assert torch.equal(friend_counts(tight, radii, chunk=8, outer=16), torch.full((3, n), n))
    assert grams == []


def outlier_agg(n, tau, z=2.0, sens=0.01):
    return OutlierRemovalAggregator(
        tau,
        z,
        sens,
        Sampling(1.0, n),
        eps_at=50.0,
        rounds=3,
        delta_reserved=1e-6,
        min_users_required=1,
    )


def friendly_agg(n, tau, z=2.0, sens=0.01):
    return FriendlyCoreAggregator(
        tau,
        z,
        sens,
        Sampling(1.0, n),
        check_multiplier=0.05,
        delta_reserved=1e-6,
        min_users_required=1,
    )


def clustered_rows(n, d, dtype, received, seed=4):
    """90% within a small ball around 0 (where the missing units' zero rows lie), 10% far
    away: the concentration check passes."""
    g = gen(seed)
    X = 0.05 * torch.randn(n, d, generator=g, dtype=F64) / math.sqrt(d)
    X[: n // 10] += 3.0
    return X[torch.randperm(n, generator=g)][:received].to(dtype)


@pytest.mark.parametrize("dtype,missing", CASES, ids=CASE_IDS)
@pytest.mark.parametrize(
    "make,legacy,rows",
    [
        (outlier_agg, legacy_outlier_removal, clustered_rows),
        (friendly_agg, legacy_friendlycore, lambda n, d, dt, rec: spread_rows(n, d, dt, 5, rec)),
    ],
    ids=["outlier_removal", "friendlycore"],
)
def test_filters_chunks_release_the_whole_matrix_values(make, legacy, rows, dtype, missing):
    n, d = 70, 19
    G = rows(n, d, dtype, n - (missing or 0))
    tau = 0.8 if make is friendly_agg else 0.1
    ref_rng = gen(21)
    ref, kept, counts = legacy(make(n, tau), G, ref_rng)
    assert kept > 0
    if make is friendly_agg:  # some users kept with 0 < p < 1
        p = friendlycore.friendly_keep_probabilities(counts[0], n)
        assert bool(((p > 0) & (p < 1)).any())
    for chunk in (1, 4, None, 10**6):
        agg = make(n, tau)
        agg.chunk_rows = chunk
        rng = gen(21)
        out = agg.release(Contribution(G, None, len(G)), rng=rng)
        assert out.users_used == kept and not out.diagnostics["concentration_check_failed"]
        assert out.mean.dtype == dtype
        close(out.mean, ref)
        assert same_state(rng, ref_rng), chunk


def test_outlier_removal_halt_is_the_same_with_chunks():
    n, d = 60, 9
    G = spread_rows(n, d, torch.float32, seed=6)
    ref_rng = gen(8)
    ref, kept, _ = legacy_outlier_removal(outlier_agg(n, 0.01), G, ref_rng)
    agg = outlier_agg(n, 0.01)
    agg.chunk_rows = 4
    rng = gen(8)
    out = agg.release(Contribution(G, None, n), rng=rng)
    assert out.halted and kept == 0 and torch.equal(out.mean, ref) and same_state(rng, ref_rng)


# -- few users -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,missing", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("blocks", [1, 4])
def test_few_users_chunks_release_the_whole_matrix_values(blocks, dtype, missing):
    n, d = 120, 13
    G = clustered_rows(n, d, dtype, n - (missing or 0), seed=9)

    def make():
        return FewUsersAggregator(
            d, 0.05, 400.0, 1e-5, 1, Sampling(1.0, n), copies=2, blocks=blocks, tries=50.0
        )

    ref_rng = gen(31)
    ref = legacy_few_users(make(), G, ref_rng)
    assert float(ref.abs().max()) > 0  # not garbage everywhere
    for chunk in (5, None):
        agg = make()
        agg.chunk_rows = chunk
        rng = gen(31)
        out = agg.release(Contribution(G, None, len(G)), rng=rng)
        close(out.mean, ref)
        assert same_state(rng, ref_rng)


# -- the rows held once ----------------------------------------------------------------------
def test_cohort_rows_pad_virtually_and_read_float64_in_place():
    G = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    rows = CohortRows(G, 6, chunk=4)
    assert rows.shape == (6, 3) and len(rows) == 6
    got = torch.cat([B for _, B in rows.chunks()])
    assert got.dtype == F64 and torch.equal(got, legacy_pad(G.to(F64), 6))
    assert torch.equal(
        rows.take(torch.tensor([5, 1])), torch.tensor([[0.0] * 3, [3.0, 4, 5]], dtype=F64)
    )
    assert torch.equal(rows.column_sum(), G.to(F64).sum(0))
    assert torch.equal(rows.sum_rows(torch.tensor([0, 3, 4])), G[[0, 3]].to(F64).sum(0))
    X = torch.randn(50, 3, dtype=F64)
    whole = CohortRows(X, 50)
    assert whole.block(10, 20).data_ptr() == X[10:20].data_ptr()  # no copy of float64 rows
    c = whole.block(0, 5, centre=X.mean(0))
    assert torch.equal(c, X[:5] - X.mean(0)) and torch.equal(X, whole.G)


def test_merge_holds_the_rows_once():
    G = torch.randn(10, 4)
    one = Contribution.merge([Contribution(G, None, 10)], 4, torch.float32, True)
    assert one.rows.data_ptr() == G.data_ptr() and one.count == 10
    parts = [
        Contribution(G[:3], None, 3),
        Contribution(None, None, 0),
        Contribution(G[3:].double(), None, 7),
    ]
    merged = Contribution.merge(parts, 4, torch.float32, True)
    assert torch.equal(merged.rows, G) and merged.count == 10
    empty = Contribution.merge([], 4, torch.float32, True)
    assert empty.rows.shape == (0, 4)


def test_rows_reply_writes_the_chunks_into_one_matrix():
    g = gen(0)
    chunks = [torch.randn(3, 5, generator=g), torch.randn(4, 5, generator=g)]
    chunks[1][2, 1] = float("nan")
    rep = rows_reply(iter(chunks), 7, 5, torch.float32, ("w",))
    parts = [make_reply(c, ("w",), Constraint(rows=True)) for c in chunks]
    want = Contribution.merge([p.contribution for p in parts], 5, torch.float32, True)
    assert torch.equal(rep.contribution.rows, want.rows) and rep.failed == 1
    assert rep.contribution.count == want.count == 6
    with pytest.raises(ValueError, match="more than"):
        rows_reply(iter(chunks), 5, 5, torch.float32, ("w",))


# -- the memory the pre-flight check counts --------------------------------------------------
GIB = memory.GIB


def load_aggregators(n=60_000, dim=28_938):
    """The row estimators at the load run's size (joint_dp: 28,938 shared coordinates)."""
    s = Sampling(1.0, n)
    w = WinsorizedAggregator(dim, 0.5, 1.0, 1e-3, s)
    return [
        w,
        outlier_agg(n, 0.5),
        friendly_agg(n, 0.5),
        FewUsersAggregator(dim, 0.5, 1.0, 1e-5, 1, s),
        FewUsersAggregator(dim, 0.5, 1.0, 1e-5, 1, s, blocks=4),
    ]


def test_rows_bytes_counts_the_rows_once_plus_the_owners_copy_and_the_chunks():
    n, dim = 60_000, 28_938
    matrix = n * dim * 4
    for agg in load_aggregators(n, dim):
        need = memory.rows_bytes(n, dim, 4, agg)
        work = agg.working_bytes(n, dim)
        assert need == matrix + max(matrix * (memory.OWNER_ROW_COPIES - 1), work), agg.name
        assert need < 20 * GIB, agg.name  # was 36.7 GiB (two float64 copies)
    w = load_aggregators(n, dim)[0]
    # 8 bins here: the winsorized mean counts them per coordinate (no n x d' bins stored); its
    # work is three float64 blocks of 32 rotated rows and one PrivateRange block of int64 words
    nbins = math.ceil(w.bound / w.tau_coord)
    assert nbins == 8 <= winsorized.COUNT_BINS
    words = 8 * prange.range_block(n) * (2 * n + 1)
    assert 3 * 32 * 32_768 * 8 + words <= w.working_bytes(n, dim) < 128 * 2**20
    # a narrow radius (more than COUNT_BINS bins) stores one byte per coordinate and row
    narrow = WinsorizedAggregator(dim, 0.05, 1.0, 1e-3, Sampling(1.0, n))
    assert prange.bin_dtype(narrow.tau_coord, narrow.bound) == torch.uint8
    assert n * 32_768 <= narrow.working_bytes(n, dim) < n * 32_768 + 1 * GIB
    few = load_aggregators(n, dim)[-1]  # blocks=4: one float64 block of d'/4
    assert few.working_bytes(n, dim) >= n * 32_768 // 4 * 8
    assert memory.rows_bytes(n, 44_628, 4) == n * 44_628 * 4 * memory.OWNER_ROW_COPIES


def test_check_rows_fit_refuses_what_still_does_not_fit():
    agg = outlier_agg(60_000, 0.5)
    need = memory.check_rows_fit(agg, 28_938, 4, available=64 * GIB)
    assert 2 * 6.4 * GIB < need < 2 * 6.5 * GIB + 1.5 * GIB
    with pytest.raises(
        ConfigError, match=r"outlier_removal: its per-unit rows need about 1\d\.\d GiB"
    ):
        memory.check_rows_fit(agg, 28_938, 4, available=need - 1)
    assert memory.check_rows_fit(agg, 28_938, 4, available=need) == need


MEASURE = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads(1)
    from fedudp.aggregators import private_range as prange, rows
    from fedudp.protocol.contributions import Constraint, Contribution, Sampling
    from fedudp.aggregators.friendlycore import FriendlyCoreAggregator
    from fedudp.aggregators.winsorized import WinsorizedAggregator
    rows.WORK_BYTES, rows.OUTER_BYTES, prange.RANGE_ELEMS = 4 << 20, 32 << 20, 1 << 18
    name, n, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    G = torch.rand(n, d, generator=torch.Generator().manual_seed(0)) * 0.01
    s = Sampling(1.0, n)
    agg = (WinsorizedAggregator(d, 0.05, 1.0, 1.0, s) if name == "winsorized" else
           FriendlyCoreAggregator(0.26, 2.0, 0.01, s, 0.05, 1e-6, 1))   # 2τ ~ the distances
    agg.release(Contribution(G[:50], None, 50), rng=torch.Generator().manual_seed(1))  # warm up
    def rss(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    before = rss("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")   # reset the peak (VmHWM) to now
    agg.release(Contribution(G, None, n), rng=torch.Generator().manual_seed(2))
    print(json.dumps({"extra": rss("VmHWM:") - before, "work": agg.working_bytes(n, d),
                      "float64_copy": n * d * 8}))
""")


@pytest.mark.parametrize("name,n,d", [("winsorized", 800, 16_000), ("friendlycore", 1500, 16_000)])
def test_a_release_stays_within_the_memory_the_check_counts(name, n, d):
    # budgets lowered to a few MiB; the rows are float32 (51 MB / 96 MB): the release adds at
    # most what working_bytes counts, less than one float64 copy of them (what it used to make)
    p = subprocess.run(
        [sys.executable, "-c", MEASURE, name, str(n), str(d)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    slack = 40 << 20  # allocator and interpreter noise
    assert got["extra"] <= got["work"] + slack, got
    assert got["work"] < got["float64_copy"], got
