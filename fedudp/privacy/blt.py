"""Buffered linear Toeplitz (BLT) matrices: coefficients, min-separation sensitivity, the
prefix-sum error, and the public optimisation of the parameters
(docs/algorithms.md#buffered-linear-toeplitz-blt).

A BLT with ``nbuf`` buffers, decays θ ∈ (0, 1)^nbuf and output scales ω > 0 is the
lower-triangular Toeplitz matrix C with coefficients c_0 = 1, c_k = Σ_i ω_i θ_i^(k-1) (k >= 1)
(McKenna 2024, arXiv:2405.15913; Dvijotham et al. 2024, arXiv:2404.16706). Its generating
function is rational, c(x) = P(x) / Q(x) with Q(x) = Π_i (1 - θ_i x) and
P(x) = Q(x) + x Σ_i ω_i Π_{j≠i} (1 - θ_j x), so y = Cx and x = C⁻¹y are both linear recursions
with ``nbuf`` states: C⁻¹y is computed streaming as x_t = y_t - Σ_i ω_i s_i, s_i ← θ_i s_i + x_t.

With Σ_i ω_i <= 1 the coefficients are positive and non-increasing (c_1 = Σ ω <= c_0 = 1, each
θ_i^(k-1) decreasing), the case in which the worst b-min-separated pattern of at most
k = ceil(n / b) participations is 0, b, 2b, ... (Kalinin & Lampert 2024, arXiv:2405.13763,
their Theorem 2; jax_privacy's ``toeplitz.minsep_sensitivity_squared``). Everything here
depends only on (n, b, nbuf): public, never data.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy.optimize import minimize
from scipy.signal import lfilter

__all__ = [
    "blt_coefficients",
    "inverse_coefficients",
    "max_participations",
    "minsep_sensitivity_squared",
    "optimal_blt",
    "prefix_error",
    "blt_loss",
]


def max_participations(rounds: int, min_separation: int) -> int:
    """k = ceil(n / b): the most rounds, pairwise at least b apart, in n rounds.

    Parameters
    ----------
    rounds : int
        n.
    min_separation : int
        b (1: every round).

    Returns
    -------
    int
        k.
    """
    return -(-int(rounds) // int(min_separation))


def blt_coefficients(theta: np.ndarray, omega: np.ndarray, n: int) -> np.ndarray:
    """C's Toeplitz coefficients c_0 = 1, c_k = Σ_i ω_i θ_i^(k-1), k < n (float64).

    Parameters
    ----------
    theta, omega : numpy.ndarray
        [nbuf] decays and output scales.
    n : int
        The coefficients wanted.

    Returns
    -------
    numpy.ndarray
        [n] float64.
    """
    th = np.asarray(theta, dtype=np.float64)
    om = np.asarray(omega, dtype=np.float64)
    powers = th[None, :] ** np.arange(max(n - 1, 0), dtype=np.float64)[:, None]
    return np.concatenate([[1.0], powers @ om])[:n]


def _polynomials(theta: np.ndarray, omega: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(P, Q), ascending powers of x: c(x) = P(x) / Q(x) (module doc)."""
    q = np.ones(1)
    for t in theta:
        q = np.convolve(q, [1.0, -float(t)])
    p = np.concatenate([q, [0.0]])
    for i, w in enumerate(omega):
        rest = np.ones(1)
        for j, t in enumerate(theta):
            if j != i:
                rest = np.convolve(rest, [1.0, -float(t)])
        p[1 : 1 + rest.size] += float(w) * rest
    return p[: q.size], q


def inverse_coefficients(theta: np.ndarray, omega: np.ndarray, n: int) -> np.ndarray:
    """C⁻¹'s Toeplitz coefficients (its first column), the impulse response of Q(x) / P(x).

    Parameters
    ----------
    theta, omega : numpy.ndarray
        [nbuf] decays and output scales.
    n : int
        The coefficients wanted.

    Returns
    -------
    numpy.ndarray
        [n] float64.
    """
    p, q = _polynomials(np.asarray(theta, float), np.asarray(omega, float))
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return np.asarray(lfilter(q, p, impulse), dtype=np.float64)


def minsep_sensitivity_squared(coefficients: np.ndarray, min_separation: int, n: int) -> float:
    """sens² = ||Σ_{m<k} C[:, m·b]||² for C lower-triangular Toeplitz of non-negative,
    non-increasing ``coefficients``: the maximum over every pattern of at most k = ceil(n / b)
    participations pairwise at least b apart, under unit-norm contributions (module doc).

    Parameters
    ----------
    coefficients : numpy.ndarray
        C's first column (length >= n; the first n are used).
    min_separation : int
        b.
    n : int
        The rounds.

    Returns
    -------
    float
        sens².

    Raises
    ------
    ValueError
        Coefficients negative or increasing (the formula would not be the maximum).
    """
    c = np.asarray(coefficients, dtype=np.float64)[:n]
    if (c < 0).any() or (np.diff(c) > 1e-15).any():
        raise ValueError("BLT sensitivity: C's coefficients must be non-negative, non-increasing")
    b = int(min_separation)
    v = np.zeros(n)
    for start in range(0, n, b):
        v[start:] += c[: n - start]
    return float(v @ v)


def prefix_error(inverse: np.ndarray) -> float:
    """||A C⁻¹||_F² for A the n×n prefix-sum matrix and C⁻¹ Toeplitz with first column
    ``inverse``: A C⁻¹ is Toeplitz with first column s = cumsum(inverse), so the norm is
    Σ_k (n - k) s_k².

    Parameters
    ----------
    inverse : numpy.ndarray
        [n] C⁻¹'s coefficients.

    Returns
    -------
    float
        The squared Frobenius norm.
    """
    s = np.cumsum(np.asarray(inverse, dtype=np.float64))
    n = s.size
    return float(np.sum((n - np.arange(n)) * s * s))


def blt_loss(theta: np.ndarray, omega: np.ndarray, n: int, min_separation: int) -> float:
    """The expected total squared error of the n prefix sums at noise multiplier 1 for the
    whole run: ||A C⁻¹||_F² · sens(C)² (McKenna 2024's objective).

    Parameters
    ----------
    theta, omega : numpy.ndarray
        [nbuf] decays and output scales.
    n : int
        Rounds.
    min_separation : int
        b.

    Returns
    -------
    float
        The loss.
    """
    c = blt_coefficients(theta, omega, n)
    sens2 = minsep_sensitivity_squared(c, min_separation, n)
    return prefix_error(inverse_coefficients(theta, omega, n)) * sens2


def _unpack(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """θ = sigmoid(u) ∈ (0, 1), ω = sigmoid(a)·softmax(v): ω > 0 with Σ ω < 1 (valid C)."""
    m = (x.size - 1) // 2
    theta = 1.0 / (1.0 + np.exp(-x[:m]))
    v = np.exp(x[m : 2 * m] - x[m : 2 * m].max())
    omega = v / v.sum() / (1.0 + math.exp(-float(x[-1])))
    return theta, omega


@functools.lru_cache(maxsize=64)
def optimal_blt(n: int, min_separation: int, buffers: int) -> tuple[np.ndarray, np.ndarray]:
    """θ, ω minimising ``blt_loss`` for (n, b, nbuf): L-BFGS-B in float64 on log(loss) over the
    valid parametrisation, from deterministic starts (decays spread geometrically towards 1);
    the best is kept. Depends only on its public arguments; cached.

    Parameters
    ----------
    n : int
        Rounds.
    min_separation : int
        b.
    buffers : int
        nbuf.

    Returns
    -------
    tuple of numpy.ndarray
        (θ, ω), each [nbuf] float64, θ decreasing.

    Raises
    ------
    ValueError
        ``buffers`` < 1, ``n`` < 1 or ``min_separation`` < 1.
    """
    if int(buffers) < 1 or int(n) < 1 or int(min_separation) < 1:
        raise ValueError(f"BLT: need buffers, rounds, min_separation >= 1 ({buffers}, {n})")
    m = int(buffers)

    def objective(x: np.ndarray) -> float:
        th, om = _unpack(x)
        return math.log(blt_loss(th, om, int(n), int(min_separation)))

    starts = []
    for span in (1.0, 2.0, 3.0):
        # decays 1 - 1/n^(j span / m)-ish: short to long memories; equal scales summing to ~1/2
        horizons = np.logspace(0.0, span * math.log10(max(n, 2)) / 1.5, m)
        theta0 = np.clip(1.0 - 1.0 / (1.0 + horizons), 1e-3, 1 - 1e-6)
        starts.append(np.concatenate([np.log(theta0 / (1 - theta0)), np.zeros(m), [0.0]]))
    if m > 1:  # the (nbuf - 1)-buffer optimum and a small new buffer: never worse than it
        th, om = optimal_blt(int(n), int(min_separation), m - 1)
        th = np.clip(np.append(th, 0.5), 1e-9, 1 - 1e-9)
        om = np.append(om, 1e-6 * float(om.sum()))
        total = min(float(om.sum()), 1 - 1e-9)
        starts.append(
            np.concatenate([np.log(th / (1 - th)), np.log(om), [math.log(total / (1 - total))]])
        )
    best: tuple[float, np.ndarray] | None = None
    for x0 in starts:
        res = minimize(objective, x0, method="L-BFGS-B", options={"maxiter": 500})
        if best is None or float(res.fun) < best[0]:
            best = (float(res.fun), np.asarray(res.x))
    assert best is not None
    theta, omega = _unpack(best[1])
    order = np.argsort(-theta)
    theta, omega = theta[order], omega[order]
    theta.setflags(write=False)
    omega.setflags(write=False)
    return theta, omega
