"""The public per-round random rotation of distributed DP: a randomized Hadamard transform.

Each owner rotates each of its users' clipped vectors by ``U = H D_s / sqrt(D)`` before scaling
and rounding (Kairouz, Liu & Steinke 2021, Sec. 4: the rotation flattens a vector so that its
coordinates are small and the modular wrap rare). ``H`` is the Walsh–Hadamard matrix of order
``D`` (a power of two: vectors are zero-padded), ``D_s`` the diagonal of random signs ``s``.
``U`` is orthonormal, so l2 norms (and hence the clip's sensitivity) are preserved, and, ``H``
being symmetric, its inverse is ``D_s H / sqrt(D)``. The signs are public (the billboard
unrotates the decoded sum with them) and drawn fresh each round: both sides call
:func:`rotation_signs` on the same generator (``Randomness.numpy_rng(Purpose.ROTATION, round)``).

The transform is a vectorized in-place butterfly (``O(n D log D)``, elementwise IEEE
operations only, so the result is the same on every machine); long inputs are transformed a
few rows at a time to keep the working set small.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "padded_dim",
    "rotate",
    "rotate_into",
    "rotation_signs",
    "unrotate",
]

# rows transformed together: about this many float64 values (8 MiB) per block
_BLOCK_VALUES = 1 << 20
# the butterflies of half-width below this run on a transposed copy (_fwht_rows)
_LOW = 64


def padded_dim(d: int) -> int:
    """The rotation's length: the smallest power of two at least ``d``.

    Parameters
    ----------
    d
        The vector length, at least 1.

    Returns
    -------
    int
        ``D = 2 ** ceil(log2 d)``.

    Raises
    ------
    ValueError
        If ``d`` is not a positive integer.
    """
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"padded_dim: the vector length must be a positive integer, not {d!r}")
    return 1 << (int(d) - 1).bit_length()


def rotation_signs(rng: np.random.Generator, D: int) -> np.ndarray:
    """The round's random signs: ``D`` independent fair ±1 draws from ``rng``.

    Parameters
    ----------
    rng
        The round's public rotation stream (the same on the owners and the billboard).
    D
        The padded length, a power of two (:func:`padded_dim`).

    Returns
    -------
    numpy.ndarray
        float64 ``[D]`` of ±1.

    Raises
    ------
    ValueError
        If ``D`` is not a power of two.
    """
    D = int(D)
    if D < 1 or D & (D - 1):
        raise ValueError(f"rotation_signs: D must be a power of two, not {D}")
    return 1.0 - 2.0 * rng.integers(0, 2, size=D).astype(np.float64)


def _check_signs(signs: np.ndarray) -> int:
    signs = np.asarray(signs)
    D = signs.shape[0] if signs.ndim == 1 else 0
    if D < 1 or D & (D - 1) or not np.all(np.abs(signs) == 1.0):
        raise ValueError(
            "rotation: signs must be a 1-D ±1 array whose length is a power of two "
            "(rotation_signs(rng, padded_dim(d)))"
        )
    return D


def _stages(Y: np.ndarray, tmp: np.ndarray, h0: int, h1: int) -> None:
    """The butterfly stages of half-width ``h0, 2 h0, ... < h1`` on each row of ``Y``, in place."""
    m, D = Y.shape
    h = h0
    while h < h1:
        v = Y.reshape(m, D // (2 * h), 2, h)
        a = v[:, :, 0, :]
        b = v[:, :, 1, :]
        t = tmp[: m * D // 2].reshape(m, D // (2 * h), h)
        np.add(a, b, out=t)
        np.subtract(a, b, out=b)
        a[...] = t
        h *= 2


def _fwht_rows(Y: np.ndarray, tmp: np.ndarray, work: np.ndarray) -> None:
    """The unnormalized Walsh–Hadamard transform of each row of ``Y`` [m, D], in place.

    The stages of small half-width (inner loops of a few elements, slow in numpy) run on the
    transposed ``[_LOW, D / _LOW]`` layout of each row, where they become long contiguous ones.
    """
    m, D = Y.shape
    if D < 4 * _LOW:
        _stages(Y, tmp, 1, D)
        return
    _stages(Y, tmp, _LOW, D)
    z = work[: m * D].reshape(m, _LOW, D // _LOW)
    np.copyto(z, Y.reshape(m, D // _LOW, _LOW).transpose(0, 2, 1))
    _stages(z.reshape(m, D), tmp, D // _LOW, D)
    np.copyto(Y.reshape(m, D // _LOW, _LOW), z.transpose(0, 2, 1))


def _transform(Y: np.ndarray) -> None:
    """``Y <- Y H / sqrt(D)`` row by row, in place, a block of rows at a time."""
    m, D = Y.shape
    step = max(1, _BLOCK_VALUES // D)
    rows = min(m, step)
    tmp = np.empty(max(1, rows * D // 2), dtype=np.float64)
    work = np.empty(rows * D if D >= 4 * _LOW else 1, dtype=np.float64)
    norm = 1.0 / np.sqrt(D)
    for s in range(0, m, step):
        block = Y[s : s + step]
        _fwht_rows(block, tmp, work)
        block *= norm


def rotate_into(
    X: np.ndarray, signs: np.ndarray, out: np.ndarray, gain: float | np.ndarray = 1.0
) -> np.ndarray:
    """:func:`rotate` into a preallocated ``out``, each row multiplied by ``gain`` first.

    Parameters
    ----------
    X
        float64 ``[n, d]``, ``d <= D``.
    signs
        The round's signs, float64 ``[D]``.
    out
        float64 ``[n, D]``, overwritten.
    gain
        A scalar or float64 ``[n]``: row ``i`` becomes ``U (gain_i x_i)`` (the encoder's clip
        factor times its scale), applied before the transform.

    Returns
    -------
    numpy.ndarray
        ``out``.

    Raises
    ------
    ValueError
        If the shapes do not match.
    """
    D = _check_signs(signs)
    n, d = X.shape
    if d > D or out.shape != (n, D) or out.dtype != np.float64:
        raise ValueError(f"rotate_into: X [n, d <= {D}] and out float64 [n, {D}] needed")
    np.multiply(X, signs[:d], out=out[:, :d])
    out[:, d:] = 0.0
    g = np.asarray(gain, dtype=np.float64)
    if g.ndim:
        out[:, :d] *= g[:, None]
    else:
        out[:, :d] *= g
    _transform(out)
    return out


def rotate(X: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """Rotate each row: zero-pad to ``D``, multiply by the signs, Hadamard-transform, ``/ sqrt(D)``.

    Parameters
    ----------
    X
        float ``[n, d]`` (or ``[d]``), ``d <= D``.
    signs
        The round's signs, float64 ``[D]`` (:func:`rotation_signs`).

    Returns
    -------
    numpy.ndarray
        float64 ``[n, D]`` (or ``[D]``): ``U x`` for each row ``x``; l2 norms preserved.

    Raises
    ------
    ValueError
        If the signs are not a ±1 power-of-two-long vector or a row is longer than ``D``.
    """
    D = _check_signs(signs)
    X = np.asarray(X, dtype=np.float64)
    one = X.ndim == 1
    X2 = X.reshape(1, -1) if one else X
    if X2.ndim != 2 or X2.shape[1] > D:
        raise ValueError(f"rotate: X must be [n, d] with d <= D = {D}, not shape {X.shape}")
    Y = rotate_into(X2, signs, np.empty((X2.shape[0], D), dtype=np.float64))
    return Y[0] if one else Y


def unrotate(y: np.ndarray, signs: np.ndarray, d: int) -> np.ndarray:
    """The exact inverse of :func:`rotate`: ``D_s H y / sqrt(D)``, cut to the first ``d``.

    Parameters
    ----------
    y
        float ``[D]`` or ``[n, D]``.
    signs
        The signs the rotation used.
    d
        The original length, ``1 <= d <= D``.

    Returns
    -------
    numpy.ndarray
        float64 ``[d]`` or ``[n, d]``.

    Raises
    ------
    ValueError
        If the shapes do not match the signs or ``d`` is out of range.
    """
    D = _check_signs(signs)
    y = np.asarray(y, dtype=np.float64)
    one = y.ndim == 1
    Y = np.array(y.reshape(1, -1) if one else y, dtype=np.float64, copy=True)
    if Y.ndim != 2 or Y.shape[1] != D:
        raise ValueError(f"unrotate: y must be [D] or [n, D] with D = {D}, not shape {y.shape}")
    if not 1 <= int(d) <= D:
        raise ValueError(f"unrotate: d must be in [1, {D}], not {d}")
    _transform(Y)
    Y *= signs
    out = Y[:, : int(d)]
    return out[0].copy() if one else np.ascontiguousarray(out)
