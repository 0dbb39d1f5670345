"""BLT matrices (fedudp.privacy.blt): coefficients against the dense matrix, the
min-separation sensitivity against brute force over every pattern, its weakened twins, and the
optimised loss against banded MF (BSR) and the tree at the same n."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from fedudp.aggregators.banded import strategy_matrix
from fedudp.aggregators.tree import tree_depth
from fedudp.privacy.blt import (
    blt_coefficients,
    blt_loss,
    inverse_coefficients,
    max_participations,
    minsep_sensitivity_squared,
    optimal_blt,
    prefix_error,
)

THETA = np.array([0.9, 0.5, 0.2])
OMEGA = np.array([0.3, 0.2, 0.1])


def toeplitz(c: np.ndarray) -> np.ndarray:
    n = c.size
    m = np.zeros((n, n))
    for k, v in enumerate(c):
        m += v * np.eye(n, k=-k)
    return m


def brute_sensitivity_squared(C: np.ndarray, b: int, k: int) -> float:
    """max ||C 1_S||² over every S of at most k rounds pairwise >= b apart."""
    n = C.shape[0]
    best = 0.0
    for size in range(1, k + 1):
        for S in itertools.combinations(range(n), size):
            if size > 1 and min(np.diff(S)) < b:
                continue
            v = C[:, list(S)].sum(axis=1)
            best = max(best, float(v @ v))
    return best


def test_coefficients_and_inverse_match_the_dense_matrix():
    # literal: c_1 = 0.3 + 0.2 + 0.1, c_2 = 0.3*0.9 + 0.2*0.5 + 0.1*0.2
    c = blt_coefficients(THETA, OMEGA, 12)
    assert c[:3] == pytest.approx([1.0, 0.6, 0.39], abs=1e-15)
    C = toeplitz(c)
    inv = inverse_coefficients(THETA, OMEGA, 12)
    np.testing.assert_allclose(toeplitz(inv), np.linalg.inv(C), atol=1e-12)
    A = np.tril(np.ones((12, 12)))
    assert prefix_error(inv) == pytest.approx(np.linalg.norm(A @ np.linalg.inv(C)) ** 2, rel=1e-12)


@pytest.mark.parametrize("n,b", [(9, 1), (10, 2), (10, 3), (11, 4), (8, 8)])
def test_sensitivity_is_the_brute_force_maximum(n, b):
    C = toeplitz(blt_coefficients(THETA, OMEGA, n))
    k = max_participations(n, b)
    assert k == math.ceil(n / b)
    exact = brute_sensitivity_squared(C, b, k)
    assert minsep_sensitivity_squared(blt_coefficients(THETA, OMEGA, n), b, n) == pytest.approx(
        exact, rel=1e-12
    )


def test_weakened_sensitivities_are_caught_by_brute_force():
    """A twin that counts one participation (k = 1), and one that ignores the min-separation
    (computes for b = n although units come back every b = 2 rounds): both claim less than the
    brute-force maximum."""
    n, b = 10, 2
    c = blt_coefficients(THETA, OMEGA, n)
    exact = brute_sensitivity_squared(toeplitz(c), b, max_participations(n, b))
    single = float(c @ c)  # k = 1
    ignoring = minsep_sensitivity_squared(c, n, n)  # as if b = n
    assert single < exact - 0.5 and ignoring < exact - 0.5
    assert single == pytest.approx(ignoring)


def test_sensitivity_refuses_coefficients_it_does_not_bound():
    with pytest.raises(ValueError, match="non-increasing"):
        minsep_sensitivity_squared(np.array([1.0, 1.2, 0.5]), 1, 3)


def tree_loss(n: int, k: int) -> float:
    """fedudp's tree restarted every k rounds, as one Gaussian of the whole run at multiplier 1:
    sens² = depth · (number of trees), each prefix sum carries popcount-many node noises."""
    trees = -(-n // k)
    nodes = [(t // k) * bin(k).count("1") + bin(t % k).count("1") for t in range(1, n + 1)]
    return tree_depth(k) * trees * float(sum(nodes))


def bsr_loss(n: int, b: int) -> float:
    """BSR with b bands at min-separation b, fixed participation: disjoint column supports,
    sens² = k (columns of norm 1)."""
    C = strategy_matrix(b, n)
    A = np.tril(np.ones((n, n)))
    return float(np.linalg.norm(A @ np.linalg.inv(C)) ** 2) * max_participations(n, b)


def test_optimised_blt_against_banded_and_tree():
    """n = 64: single participation (b = n) BLT with 4 buffers beats BSR (64 bands) and the
    tree; with b = 8 (k = 8) it is within 10 % of 8-banded BSR's loss (measured: 7.9 %, 3.9 %
    in RMSE: positive scales make C's coefficients sums of decaying exponentials, which cannot
    cut off at b as a band does) and beats the tree."""
    n = 64
    for b, margin in ((64, 1.0), (8, 1.10)):
        th, om = optimal_blt(n, b, 4)
        assert ((0 < th) & (th < 1)).all() and (om > 0).all() and om.sum() < 1
        loss = blt_loss(th, om, n, b)
        assert loss < tree_loss(n, b)
        assert loss < margin * bsr_loss(n, b), (loss, bsr_loss(n, b))
    # more buffers never hurt (the nbuf - 1 optimum is a start), and the result is cached
    assert blt_loss(*optimal_blt(n, 64, 4), n, 64) <= blt_loss(*optimal_blt(n, 64, 2), n, 64)
    assert optimal_blt(n, 64, 4)[0] is optimal_blt(n, 64, 4)[0]


def test_optimisation_is_deterministic_and_public():
    a = optimal_blt.__wrapped__(32, 4, 3)
    b = optimal_blt.__wrapped__(32, 4, 3)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    with pytest.raises(ValueError, match="buffers"):
        optimal_blt(32, 4, 0)


def test_every_round_participation_optimum_is_the_identity():
    """b = 1, k = n: the identity (plain clip + Gaussian) is optimal, loss n·n(n+1)/2 (as
    jax_privacy's optimiser tests expect); the BLT optimum is within 1 % of it."""
    n = 16
    th, om = optimal_blt(n, 1, 3)
    assert blt_loss(th, om, n, 1) == pytest.approx(n * n * (n + 1) / 2, rel=1e-2)
