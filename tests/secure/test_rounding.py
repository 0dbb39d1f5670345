"""Conditional stochastic rounding: unbiased, within its bound, one stream per user, per user.

The neighbour test: removing one user from an owner (the other users keep their streams)
changes the owner's integer sum by exactly that user's rounded row, whose l2 norm is at most
``rounded_bound`` (the sensitivity the accounting uses). Its weakened twin rounds the owner's
sum instead of each row; the same test catches it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import fedudp.secure.encoding as encoding
from fedudp.secure.encoding import SecureEncoding, encode_owner
from fedudp.secure.rotation import padded_dim, rotation_signs
from fedudp.secure.rounding import ConditionalRounder, conditional_round, rounded_rows_sum


def kairouz_bound(c: float, beta: float, D: int) -> float:
    """Kairouz, Liu & Steinke 2021, Thm 1: one rounded vector's l2 bound (test's own copy)."""
    tail = math.sqrt(2 * math.log(1 / beta)) if beta > 0 else math.inf
    return min(c + math.sqrt(D), math.sqrt(c * c + D / 4 + tail * (c + math.sqrt(D) / 2)))


def streams(ids, round_=3):
    """One fresh generator per user (the lead's Randomness.numpy_rng(ROUNDING, round, user))."""
    return [np.random.default_rng([round_, u]) for u in ids]


def test_unbiased():
    x = np.array([0.0, 0.1, 0.5, 0.9, -0.3, -2.75, 7.25, 1e6 + 0.5])
    X = np.tile(x, (4000, 1))
    R = conditional_round(X, 1e12, streams(range(4000)))
    assert R.dtype == np.int64 and R.shape == X.shape
    assert np.all((R == np.floor(X)) | (R == np.floor(X) + 1))
    tol = 5 * np.sqrt(0.25 / 4000)  # 5 standard errors
    np.testing.assert_allclose(R.mean(axis=0), x, atol=tol)


def test_conditional_with_kairouz_bound_is_nearly_unbiased():
    D, c, beta = 1024, 8.0, math.exp(-0.5)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(D)
    x *= c / np.linalg.norm(x)
    R = conditional_round(np.tile(x, (600, 1)), kairouz_bound(c, beta, D), streams(range(600)))
    assert abs(float(np.mean(R.mean(axis=0) - x))) < 0.01


def plain_round(X, bound, rngs, max_tries=1000):
    """Weakened twin: stochastic rounding that ignores the bound (no redraws)."""
    return np.stack([np.floor(x) + (g.random(x.shape[0]) < x - np.floor(x)) for x, g in
                     zip(X, rngs)]).astype(np.int64)  # fmt: skip


@pytest.mark.parametrize("rounder", [conditional_round, plain_round])
def test_every_row_within_its_bound(rounder):
    D = 512
    X = np.tile(np.random.default_rng(2).uniform(-3, 3, D), (300, 1))
    # a bound tight enough that unconditioned roundings exceed it often
    free = np.linalg.norm(plain_round(X, 0, streams(range(300), 9)), axis=1)
    bound = float(np.median(free))
    R = rounder(X, bound, streams(range(300)))
    over = int(np.sum(np.linalg.norm(R.astype(np.float64), axis=1) > bound))
    if rounder is conditional_round:
        assert over == 0
    else:
        assert over > 50  # the twin is caught


def test_impossible_bound_raises_one_line():
    with pytest.raises(RuntimeError, match="bound .*beta") as e:
        conditional_round(np.full((2, 8), 0.5), 0.5, streams(range(2)), max_tries=20)
    assert "\n" not in str(e.value)


def shared_stream(X, bound, rngs, max_tries=1000):
    """Weakened twin: every row drawn from the first row's stream."""
    return conditional_round(X, bound, [rngs[0]] * len(rngs), max_tries)


@pytest.mark.parametrize("rounder", [conditional_round, shared_stream])
def test_a_users_rounding_ignores_the_other_users(rounder):
    X = np.random.default_rng(4).uniform(-5, 5, (6, 256))
    full = rounder(X, 1e9, streams(range(6)))
    keep = [1, 3, 4]
    part = rounder(X[keep], 1e9, streams(keep))
    same = np.array_equal(full[keep], part)
    assert same if rounder is conditional_round else not same


def test_rounded_rows_sum_is_the_sum_of_the_rows():
    X = np.random.default_rng(5).uniform(-50, 50, (9, 300))
    rows = conditional_round(X, 1e4, streams(range(9)))
    total = rounded_rows_sum(X, 1e4, streams(range(9)), out=np.full(300, 7, dtype=np.int64))
    np.testing.assert_array_equal(total, rows.sum(axis=0) + 7)


class SumThenRound(ConditionalRounder):
    """Weakened twin: round the owner's sum (with its first user's stream), not each user."""

    def add_rows(self, X, rngs, out):
        s = X.sum(axis=0, keepdims=True)
        out += conditional_round(s, self.bound * len(X), rngs[:1], self.max_tries)[0]
        return out


def owner_sum(rows, ids, enc, signs):
    return encode_owner(rows, enc, signs, streams(ids), np.random.default_rng(0), reduced=False)


@pytest.mark.parametrize("twin", [False, True])
def test_neighbouring_owners_differ_by_one_rounded_row(monkeypatch, twin):
    """d = 4096, 20 users, c = C*scale = 10, beta = e^-0.5: the bound is about 34.2.

    Real code: the difference is exactly the removed user's rounded row (norm <= bound). The
    twin's difference carries two independent roundings of the sum (about sqrt(D/3) ~ 37 in
    norm) and exceeds the bound for every removed user whose stream it used.
    """
    if twin:
        monkeypatch.setattr(encoding, "ConditionalRounder", SumThenRound)
    d, n, C, scale, beta = 4096, 20, 1.0, 10.0, math.exp(-0.5)
    bound = kairouz_bound(C * scale, beta, padded_dim(d))
    enc = SecureEncoding("ddgauss", C, scale, 30, beta, 0.0, d, bound)
    signs = rotation_signs(np.random.default_rng(11), padded_dim(d))
    rows = np.random.default_rng(12).standard_normal((n, d)) * 0.05  # norms ~3.2: most unclipped
    rows[3] *= 100.0  # one clipped
    ids = list(range(100, 100 + n))
    full = owner_sum(rows, ids, enc, signs)
    norms = []
    for k in (0, 3, 19):
        keep = [i for i in range(n) if i != k]
        diff = full - owner_sum(rows[keep], [ids[i] for i in keep], enc, signs)
        norms.append(float(np.linalg.norm(diff.astype(np.float64))))
    if twin:
        assert norms[0] > bound  # user 0's removal changes the sum's rounding: caught
    else:
        assert max(norms) <= bound
