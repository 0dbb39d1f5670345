"""The public random rotation: orthonormal, exactly invertible, its signs from the generator."""

from __future__ import annotations

import numpy as np
import pytest

from fedudp.secure.rotation import padded_dim, rotate, rotate_into, rotation_signs, unrotate


def test_padded_dim():
    assert [padded_dim(d) for d in (1, 2, 3, 4, 5, 1000, 1024, 1025)] == [
        1, 2, 4, 4, 8, 1024, 1024, 2048,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="positive integer"):
        padded_dim(0)


@pytest.mark.parametrize("d", [1, 3, 100, 1000, 5000])
def test_rotation_is_orthonormal_and_inverse_exact(d):
    D = padded_dim(d)
    rng = np.random.default_rng(d)
    X = rng.standard_normal((7, d)) * rng.uniform(0.1, 10, size=(7, 1))
    signs = rotation_signs(np.random.default_rng(1), D)
    Y = rotate(X, signs)
    assert Y.shape == (7, D)
    np.testing.assert_allclose(np.linalg.norm(Y, axis=1), np.linalg.norm(X, axis=1), rtol=1e-12)
    back = unrotate(Y, signs, d)
    assert np.max(np.abs(back - X)) <= 1e-12 * np.max(np.abs(X))
    np.testing.assert_array_equal(unrotate(Y[2], signs, d), back[2])  # 1-D same as a row
    np.testing.assert_array_equal(rotate(X[2], signs), Y[2])


def test_rotation_is_the_randomized_hadamard_matrix():
    """Against the dense ``H diag(s) / sqrt(D)`` (Sylvester's construction)."""
    D = 256
    H = np.array([[1.0]])
    while H.shape[0] < D:
        H = np.block([[H, H], [H, -H]])
    signs = rotation_signs(np.random.default_rng(3), D)
    X = np.random.default_rng(4).standard_normal((3, 200))
    Xp = np.pad(X, ((0, 0), (0, D - 200)))
    dense = (H @ np.diag(signs)) / np.sqrt(D)  # U = H diag(s) / sqrt(D), applied as U x
    np.testing.assert_allclose(rotate(X, signs), Xp @ dense.T, atol=1e-12)


def test_rotate_into_applies_the_gains():
    D = 1024
    signs = rotation_signs(np.random.default_rng(0), D)
    X = np.random.default_rng(1).standard_normal((4, 700))
    g = np.array([0.5, 1.0, 2.0, 3.0])
    out = rotate_into(X, signs, np.empty((4, D)), g)
    np.testing.assert_allclose(out, rotate(X * g[:, None], signs), atol=1e-12)


def test_signs_come_from_the_generator():
    a = rotation_signs(np.random.default_rng(7), 4096)
    b = rotation_signs(np.random.default_rng(7), 4096)
    c = rotation_signs(np.random.default_rng(8), 4096)
    np.testing.assert_array_equal(a, b)
    assert set(np.unique(a)) == {-1.0, 1.0} and a.dtype == np.float64
    assert np.mean(a != c) > 0.4  # a different round: different signs
    assert abs(np.mean(a)) < 0.1  # fair
    x = np.random.default_rng(9).standard_normal((1, 3000))
    assert np.max(np.abs(unrotate(rotate(x, a), c, 3000) - x)) > 0.1  # wrong signs: wrong


def test_bad_signs_and_shapes():
    with pytest.raises(ValueError, match="power of two"):
        rotate(np.ones((1, 3)), np.ones(3))
    with pytest.raises(ValueError, match="d <= D"):
        rotate(np.ones((1, 9)), np.ones(8))
    with pytest.raises(ValueError, match="power of two"):
        rotation_signs(np.random.default_rng(0), 12)
