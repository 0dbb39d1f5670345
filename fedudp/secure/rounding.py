"""Conditional stochastic rounding of each user's scaled vector (Kairouz, Liu & Steinke 2021).

Each coordinate ``x`` is rounded to ``floor(x) + 1`` with probability ``x - floor(x)`` and to
``floor(x)`` otherwise (unbiased), and the whole row is redrawn while its rounded l2 norm
exceeds the declared bound (Sec. 4.1, Prop. 22: with the bound from ``beta``, a redraw is
needed with probability at most ``beta``). The bound is what makes one user's rounded vector's
sensitivity a declared, data-independent number, so **each user's** row is rounded on its own,
never the owner's sum: a neighbouring dataset (one user removed) changes the owner's integer
sum by exactly that user's rounded row, whose norm is at most the bound.

Row ``i`` draws only from ``rngs[i]`` (one stream per user,
``Randomness.numpy_rng(Purpose.ROUNDING, round, user_id)``), so a user's rounding, its redraws
included, does not depend on the other users of its owner.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "ConditionalRounder",
    "conditional_round",
    "rounded_rows_sum",
]


class ConditionalRounder:
    """Conditional rounding of rows of length ``D``, its scratch buffers allocated once.

    :func:`conditional_round` and :func:`rounded_rows_sum` use one per call; an encoder that
    rounds its rows a block at a time keeps one for all its blocks (:meth:`add_rows`).

    Parameters
    ----------
    D
        The row length.
    bound
        The l2 bound of one rounded row (float64 comparison).
    max_tries
        Draws allowed per row.

    Raises
    ------
    ValueError
        If the bound is negative or not finite, or ``max_tries < 1``.
    """

    def __init__(self, D: int, bound: float, max_tries: int = 1000) -> None:
        bound = float(bound)
        if not np.isfinite(bound) or bound < 0:
            raise ValueError(f"conditional_round: bound must be finite and >= 0, not {bound}")
        if int(max_tries) < 1:
            raise ValueError(f"conditional_round: max_tries must be >= 1, not {max_tries}")
        self.bound, self.max_tries = bound, int(max_tries)
        self.low = np.empty(D, dtype=np.float64)
        self.frac = np.empty(D, dtype=np.float64)
        self.u = np.empty(D, dtype=np.float64)
        self.up = np.empty(D, dtype=bool)
        self.ints = np.empty(D, dtype=np.int64)

    def round(self, x: np.ndarray, rng: np.random.Generator, row: int) -> np.ndarray:
        """Row ``x`` rounded, its norm at most the bound.

        Parameters
        ----------
        x
            float64 ``[D]``.
        rng
            The row's stream.
        row
            The row's index (for the error message).

        Returns
        -------
        numpy.ndarray
            float64 ``[D]`` of integers: a view of the rounder's buffer, overwritten by the
            next call.

        Raises
        ------
        RuntimeError
            If no draw within ``max_tries`` meets the bound.
        """
        low, frac, u, up = self.low, self.frac, self.u, self.up
        for _ in range(self.max_tries):
            np.floor(x, out=low)
            np.subtract(x, low, out=frac)  # exact for |x| < 2^52
            rng.random(out=u)
            np.less(u, frac, out=up)  # up with probability frac(x): unbiased
            np.add(low, up, out=low)
            if float(np.sqrt(np.dot(low, low))) <= self.bound:  # the norm in float64
                return low
        raise RuntimeError(
            f"conditional rounding: row {row} exceeded the l2 bound {self.bound:g} in "
            f"{self.max_tries} draws; the bound (from beta) is too tight for the clip and "
            "scale: raise beta or check the bound"
        )

    def add_rows(
        self, X: np.ndarray, rngs: Sequence[np.random.Generator], out: np.ndarray
    ) -> np.ndarray:
        """Round each row of ``X`` (row ``i`` with ``rngs[i]``) and add it into ``out``.

        Parameters
        ----------
        X
            float64 ``[n, D]``.
        rngs
            ``n`` generators.
        out
            int64 ``[D]``, added into.

        Returns
        -------
        numpy.ndarray
            ``out``.

        Raises
        ------
        ValueError
            As in :func:`conditional_round`.
        RuntimeError
            As in :func:`conditional_round`.
        """
        X = _checked(X, rngs)
        for i, rng in enumerate(rngs):
            np.copyto(self.ints, self.round(X[i], rng, i), casting="unsafe")  # exact integers
            out += self.ints
        return out


def _checked(X: np.ndarray, rngs: Sequence[np.random.Generator]) -> np.ndarray:
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2:
        raise ValueError(f"conditional_round: X must be [n, D], not shape {X.shape}")
    if len(rngs) != X.shape[0]:
        raise ValueError(f"conditional_round: {len(rngs)} generators for {X.shape[0]} rows")
    if X.size and not float(np.max(np.abs(X))) < 2.0**52:  # NaN fails too
        raise ValueError("conditional_round: X must be finite with |x| < 2^52 (float64 exact)")
    return X


def conditional_round(
    X: np.ndarray,
    bound: float,
    rngs: Sequence[np.random.Generator],
    max_tries: int = 1000,
) -> np.ndarray:
    """Round each row of ``X`` stochastically to integers, redrawn until its l2 norm <= ``bound``.

    Parameters
    ----------
    X
        float64 ``[n, D]``: the rotated, scaled rows (finite; ``|x| < 2^52``).
    bound
        The l2 bound of one rounded row (integer domain; from ``beta``:
        ``privacy.distributed.rounded_l2_bound``). Norms are compared in float64.
    rngs
        ``n`` generators, row ``i`` drawn from ``rngs[i]`` only (``D`` uniforms a draw).
    max_tries
        Draws allowed per row before giving up.

    Returns
    -------
    numpy.ndarray
        int64 ``[n, D]``, every row's norm at most ``bound``.

    Raises
    ------
    ValueError
        If the shapes, the bound or ``max_tries`` are invalid.
    RuntimeError
        If a row still exceeds the bound after ``max_tries`` draws (the bound is too tight for
        the declared ``beta``, or the row was not clipped and scaled as declared).
    """
    X = _checked(X, rngs)
    rounder = ConditionalRounder(X.shape[1], bound, max_tries)
    out = np.empty(X.shape, dtype=np.int64)
    for i, rng in enumerate(rngs):
        out[i] = rounder.round(X[i], rng, i)
    return out


def rounded_rows_sum(
    X: np.ndarray,
    bound: float,
    rngs: Sequence[np.random.Generator],
    max_tries: int = 1000,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The sum of :func:`conditional_round`'s rows (the same draws), without keeping them.

    Parameters
    ----------
    X
        float64 ``[n, D]``, as in :func:`conditional_round`.
    bound
        The l2 bound of one rounded row.
    rngs
        ``n`` generators, row ``i`` drawn from ``rngs[i]`` only.
    max_tries
        Draws allowed per row.
    out
        int64 ``[D]`` to add the rows into (a new zero vector if ``None``).

    Returns
    -------
    numpy.ndarray
        int64 ``[D]``: ``out`` plus the rounded rows.

    Raises
    ------
    ValueError
        As in :func:`conditional_round`.
    RuntimeError
        As in :func:`conditional_round`.
    """
    X = _checked(X, rngs)
    total = np.zeros(X.shape[1], dtype=np.int64) if out is None else out
    return ConditionalRounder(X.shape[1], bound, max_tries).add_rows(X, rngs, total)
