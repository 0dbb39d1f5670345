"""DP primitives shared by the user-level mean estimators (docs/algorithms.md#shared-primitives).

* Laplace and Gaussian noise from a seeded ``torch.Generator``;
* the exponential mechanism in log space (Gumbel-max), batched over independent instances;
* AboveThreshold (sparse vector, [ASI] Algorithm 1 / Dwork-Roth Thm 3.24), one instance
  spanning a whole stream of queries;
* the randomized Hadamard rotation of [LEVY] Alg. 2 with a fast Walsh-Hadamard transform
  (O(d log d) per vector, vectorized over rows, padding to a power of two);
* ``clip_factors``: the per-row l2 clipping factors of every clip+Gaussian step (owner-side
  clipping and DP-SGD), norms in float64; ``finite_clip_factors``: the same with a non-finite
  row dropped (factor 0);
* ``pure_dp_event``: how a pure eps0-DP step (exponential mechanism, AboveThreshold) enters
  dp-accounting: ``ZCDpEvent(eps0**2 / 2)`` (every eps0-DP mechanism is eps0^2/2-zCDP, Bun &
  Steinke 2016, Prop. 1.4), composed by the RDP accountant
  (docs/algorithms.md#events-and-accountants).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import dp_accounting
import numpy as np
import torch

__all__ = [
    "laplace",
    "gaussian",
    "row_norms64",
    "clip_factors",
    "finite_clip_factors",
    "exponential_mechanism",
    "pure_dp_event",
    "AboveThreshold",
    "next_pow2",
    "fwht",
    "fwht_gemm",
    "fwht_factors",
    "fwht_into",
    "rotated_coordinate_radius",
    "RandomRotation",
]


def laplace(
    shape: tuple[int, ...] | torch.Size,
    scale: float,
    *,
    rng: torch.Generator,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """i.i.d. Laplace noise Lap(scale): density ∝ exp(-|x|/scale), variance 2 scale².

    Parameters
    ----------
    shape
        The noise's shape.
    scale
        The Laplace scale b.
    rng
        The generator the noise is drawn from (a stream of ``fedudp.randomness``).
    dtype
        The noise's dtype (float64 by default).

    Returns
    -------
    torch.Tensor
        The noise.
    """
    u = torch.rand(shape, generator=rng, dtype=dtype)
    e = -torch.log1p(-u)  # Exp(1), u in [0, 1)
    sign = torch.where(torch.rand(shape, generator=rng, dtype=dtype) < 0.5, -1.0, 1.0).to(dtype)
    return scale * sign * e


def gaussian(
    shape: tuple[int, ...] | torch.Size,
    std: float,
    *,
    rng: torch.Generator,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """i.i.d. Gaussian noise N(0, std²).

    Parameters
    ----------
    shape
        The noise's shape.
    std
        The standard deviation.
    rng
        The generator the noise is drawn from (a stream of ``fedudp.randomness``).
    dtype
        The noise's dtype (float64 by default).

    Returns
    -------
    torch.Tensor
        The noise.
    """
    return std * torch.randn(shape, generator=rng, dtype=dtype)


# Scaling a float32 row by a float32 factor rounds each coordinate by at most 2^-24 relative,
# and the factor itself was rounded once: shrinking clipped rows by 4 ulps keeps their norm at
# most ``clip`` in any dtype (the bound the noise is calibrated for), at a 2.4e-7 relative cost.
_CLIP_SHRINK = 1.0 - 4 * 2.0**-24


def _blocks(G: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [G] if isinstance(G, torch.Tensor) else list(G)


# row_norms64: rows this long take the float64-buffer dot product, in segments of this many
_LONG = 32_768
_SEGMENT = 65_536


def _sq_long_rows(B: torch.Tensor) -> torch.Tensor:
    """[n] float64 sums of squares of the rows of the float32 CPU ``B`` [n, d]: each row's
    segments converted to float64 (exactly) in one buffer, then BLAS's float64 dot product."""
    n, d = B.shape
    buf = torch.empty(min(d, _SEGMENT), dtype=torch.float64)
    out = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        row = B[i]
        for s in range(0, d, _SEGMENT):
            b = buf[: min(_SEGMENT, d - s)]
            b.copy_(row[s : s + len(b)])
            out[i] += torch.dot(b, b)
    return out


def row_norms64(G: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """float64 l2 norm of each row of ``G``.

    On the CPU the sum of squares is accumulated in float64 (products of float32 values are
    exact in float64): by numpy's einsum rather than torch's float64 reduction of a float32
    tensor, which converts element by element; rows of ``_LONG`` entries or more are instead
    converted ``_SEGMENT`` entries at a time into a float64 buffer that stays in cache, whose
    dot product with itself (BLAS) is taken. The timings:
    docs/benchmarks.md#figures-from-the-codes-docstrings.

    Parameters
    ----------
    G
        ``[n, d]`` (any float dtype), or row-aligned blocks ``[n, d_1], [n, d_2], ...`` taken as
        one concatenated row (no copy made).

    Returns
    -------
    torch.Tensor
        float64 ``[n]``.
    """
    sq: torch.Tensor | None = None
    for B in _blocks(G):
        if B.device.type == "cpu" and B.dtype == torch.float32 and B.shape[1] >= _LONG:
            s = _sq_long_rows(B.detach())
        elif B.device.type == "cpu" and B.dtype in (torch.float32, torch.float64):
            A = B.detach().contiguous().numpy()
            s = torch.from_numpy(np.einsum("ij,ij->i", A, A, dtype=np.float64))
        else:
            s = torch.linalg.vector_norm(B.detach(), dim=1, dtype=torch.float64).cpu() ** 2
        sq = s if sq is None else sq + s
    assert sq is not None, "at least one block"
    return torch.sqrt(sq)


def clip_factors(
    G: torch.Tensor | Sequence[torch.Tensor], clip: float, norms: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipping factor of each row of ``G``.

    The norms, which decide the branch, are computed in float64; clipped rows are shrunk by a
    further 4 ulps so that the cast and the multiplication cannot push them above ``clip``.

    Parameters
    ----------
    G
        A tensor ``[n, d]``, or row-aligned blocks as in ``row_norms64``.
    clip
        The l2 bound.
    norms
        ``row_norms64(G)`` where the caller has them already.

    Returns
    -------
    tuple of torch.Tensor
        (factor, was_clipped) per row: scaling row i by ``factor[i]`` (in ``G``'s dtype) leaves
        its l2 norm at most ``clip``; rows within ``clip`` keep factor 1.
    """
    first = _blocks(G)[0]
    norms = row_norms64(G) if norms is None else norms
    was = norms > clip
    factor = torch.where(was, clip / norms.clamp(min=1e-300) * _CLIP_SHRINK, torch.ones_like(norms))
    return factor.to(first.dtype).to(first.device), was.to(first.device)


def finite_clip_factors(
    G: torch.Tensor | Sequence[torch.Tensor], clip: float, norms: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``clip_factors``, where a row whose float64 norm is not finite is dropped.

    A row with a NaN or inf entry (for float32 rows exactly those, as in ``make_reply``: no
    float32 square overflows float64) gets factor 0, is not counted as clipped, and ``finite``
    False. A dropped row contributes exactly zero only if the caller zeroes it before any product
    (NaN * 0 is NaN): ``torch.where(finite, row, 0)``. The one rule for a privacy unit with a
    non-finite vector inside a clipped sum (owner-side DP-SGD's users and records,
    ``fedudp.owner.ghost``): it is absent, never the NaN that would make its owner's whole noisy
    sum non-finite.

    Parameters
    ----------
    G
        A tensor ``[n, d]``, or row-aligned blocks as in ``row_norms64``.
    clip
        The l2 bound.
    norms
        ``row_norms64(G)`` where the caller has them already.

    Returns
    -------
    tuple of torch.Tensor
        (factor, was_clipped, finite) per row.
    """
    norms = row_norms64(G) if norms is None else norms
    ok = torch.isfinite(norms)
    factor, was = clip_factors(G, clip, norms)
    ok = ok.to(factor.device)
    factor = torch.where(ok, factor, torch.zeros_like(factor))
    return factor, was & ok, ok


def _gumbel(
    shape: tuple[int, ...] | torch.Size, *, rng: torch.Generator, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    u = torch.rand(shape, generator=rng, dtype=dtype).clamp(min=torch.finfo(dtype).tiny)
    return -torch.log(-torch.log(u))


def exponential_mechanism(log_weights: torch.Tensor, *, rng: torch.Generator) -> torch.Tensor:
    """Sample an index of the last dimension with P(i) ∝ exp(log_weights[..., i]).

    Gumbel-max in log space: ``argmax(log_w + Gumbel)``; ``-inf`` entries are never chosen.

    Parameters
    ----------
    log_weights
        The log-weights; for a score c with sensitivity Δ and budget eps, pass
        ``log_w = -eps * c / (2 Δ)`` (plus ``log(multiplicity)`` where one entry stands for
        several equal-score outcomes).
    rng
        The generator the Gumbel noise is drawn from.

    Returns
    -------
    torch.Tensor
        The chosen index (one per leading position).
    """
    g = _gumbel(log_weights.shape, rng=rng, dtype=log_weights.dtype)
    return torch.argmax(log_weights + g, dim=-1)


def pure_dp_event(eps0: float) -> dp_accounting.DpEvent:
    """A pure eps0-DP step for the RDP accountant (eps0-DP => eps0²/2-zCDP).

    Parameters
    ----------
    eps0
        The step's ε.

    Returns
    -------
    dp_accounting.DpEvent
        The event.
    """
    if not eps0 > 0:
        raise ValueError(f"pure DP step needs eps0 > 0, got {eps0}")
    return dp_accounting.ZCDpEvent(eps0**2 / 2)


class AboveThreshold:
    """Sparse vector over a stream of sensitivity-``sensitivity`` queries
    (docs/algorithms.md#abovethreshold).

    The noisy threshold is drawn once per instance; each query gets fresh Lap(4 s / eps)
    noise; the instance halts at the first query whose noisy value falls *below* the noisy
    threshold (the [ASI] orientation). The whole stream is ``eps``-DP: its cost is paid once,
    not per query (``dp_event`` is the one-off event).

    Parameters
    ----------
    threshold
        The public threshold.
    eps
        The budget of the whole stream.
    sensitivity
        The queries' sensitivity s.
    rng
        The generator the noise is drawn from.
    """

    def __init__(
        self, threshold: float, eps: float, *, rng: torch.Generator, sensitivity: float = 1.0
    ) -> None:
        if not eps > 0:
            raise ValueError(f"AboveThreshold needs eps > 0, got {eps}")
        self.eps, self.sensitivity, self.rng = float(eps), float(sensitivity), rng
        self.noisy_threshold = threshold - float(laplace((1,), 2 * sensitivity / eps, rng=rng)[0])
        self.halted = False
        self.queries = 0

    def test(self, value: float) -> bool:
        """True (⊤: carry on) or False (⊥: halt; every later call raises)."""
        return self.test_between(value, value, lambda: value)

    def test_between(self, low: float, high: float, value: Callable[[], float]) -> bool:
        """``test(v)`` for a query known to lie in [``low``, ``high``], computing v (``value()``)
        only when the drawn noise leaves the answer open: the same noise draw and the same
        answer as ``test(value())`` (v + ν is monotone in v), so the same privacy."""
        if self.halted:
            raise RuntimeError("AboveThreshold already halted")
        if not low <= high:
            raise ValueError(f"AboveThreshold.test_between needs low <= high, got {low} > {high}")
        self.queries += 1
        nu = float(laplace((1,), 4 * self.sensitivity / self.eps, rng=self.rng)[0])
        if high + nu < self.noisy_threshold:
            below = True
        elif low + nu >= self.noisy_threshold:
            below = False
        else:
            v = float(value())
            if not low <= v <= high:
                raise ValueError(f"AboveThreshold.test_between: value {v} outside [{low}, {high}]")
            below = v + nu < self.noisy_threshold
        if below:
            self.halted = True
            return False
        return True

    def dp_event(self) -> dp_accounting.DpEvent:
        return pure_dp_event(self.eps)

    @staticmethod
    def accuracy(eps: float, queries: int, gamma: float) -> float:
        """alpha_AT = 8 log(2T/gamma)/eps: with prob >= 1-gamma every ⊤ has q >= Δ - alpha and
        the halting query has q <= Δ + alpha (sensitivity 1)."""
        return 8 * math.log(2 * queries / gamma) / eps


# -- randomized Hadamard rotation ----------------------------------------------------------------
def next_pow2(d: int) -> int:
    """The smallest power of two at least ``d`` (1 for ``d <= 1``).

    Parameters
    ----------
    d
        A length.

    Returns
    -------
    int
        The power of two.
    """
    return 1 if d <= 1 else 1 << (d - 1).bit_length()


def _hadamard(f: int, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=dtype, device=device)
    while H.shape[0] < f:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


def fwht(x: torch.Tensor, block_bits: int = 6) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform along the last dim (length a power of two):
    ``x @ H`` with H the Sylvester matrix, in O(d log d) per row.

    H_{2^L} = H_{2^{l_1}} ⊗ ... ⊗ H_{2^{l_r}} with l_i <= ``block_bits``: each factor is one
    small dense batched matmul over its axis, so the data is swept ceil(L / block_bits) times
    instead of L (the butterfly's memory traffic dominated on CPU). Work per row stays
    O(d · 2^block_bits) = O(d log d) up to the constant block size.

    Parameters
    ----------
    x
        Rows ``[..., d]``, d a power of two.
    block_bits
        The largest factor's bits.

    Returns
    -------
    torch.Tensor
        ``x @ H``.

    Raises
    ------
    ValueError
        A length that is not a power of two.
    """
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"fwht needs a power-of-two length, got {d}")
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    L = d.bit_length() - 1
    inner = 1  # product of the factor sizes already applied (low bits)
    while inner < d:
        f = 1 << min(block_bits, L - (inner.bit_length() - 1))
        H = _hadamard(f, y.dtype, y.device)
        # axis layout: [rows * outer, f, inner]; H acts on the f axis
        y = torch.matmul(H, y.reshape(-1, f, inner)).reshape(-1, d)
        inner *= f
    return y.reshape(*lead, d)


def fwht_gemm(x: torch.Tensor) -> torch.Tensor:
    """``fwht`` (the same transform, ``x @ H``) as two large matrix products: a row of length
    2^L read as an [a, b] matrix M (a = 2^floor(L/2), b = 2^ceil(L/2)) becomes H_a M H_b, since
    H_{ab} = H_a ⊗ H_b. Each product is a BLAS GEMM with a long inner loop, faster on CPU than
    ``fwht``'s small batched products for more multiply-adds (docs/benchmarks.md). Values
    equal ``fwht``'s up to float rounding (a different summation order); each row is
    transformed on its own (no value of another row enters it). L > 18: ``fwht``.

    Parameters
    ----------
    x : torch.Tensor
        Rows ``[..., d]``, d a power of two.

    Returns
    -------
    torch.Tensor
        The transformed rows, same shape.

    Raises
    ------
    ValueError
        ``d`` is not a power of two.
    """
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"fwht needs a power-of-two length, got {d}")
    L = d.bit_length() - 1
    if L > 18 or L < 2:
        return fwht(x)
    a, b = 1 << (L // 2), 1 << (L - L // 2)
    lead = x.shape[:-1]
    Ha, Hb = _hadamard(a, x.dtype, x.device), _hadamard(b, x.dtype, x.device)
    y = torch.matmul(x.reshape(-1, b), Hb).reshape(-1, a, b)
    return torch.matmul(Ha, y).reshape(*lead, d)


def fwht_factors(d: int) -> tuple[int, ...]:
    """The Kronecker factor sizes ``fwht_into`` applies to a row of length d = 2^L, in order:
    the first acts on the last axis (one plain GEMM), the others on axes of stride >= 64
    (batched products of wide matrices). L <= 6: one factor; else 64 first and the other L-6
    bits split in two (2^15: 64, 32, 16).

    Parameters
    ----------
    d : int
        The row length, a power of two.

    Returns
    -------
    tuple of int
        The factor sizes; their product is ``d``.

    Raises
    ------
    ValueError
        ``d`` is not a positive power of two.
    """
    if d < 1 or d & (d - 1):
        raise ValueError(f"fwht needs a power-of-two length, got {d}")
    L = d.bit_length() - 1
    if L <= 6:
        return (d,)
    rest = L - 6
    lo, hi = rest // 2, rest - rest // 2
    return tuple(1 << b for b in (6, hi, lo) if b)


def fwht_into(x: torch.Tensor, out: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """``fwht(x)`` for the rows of ``x`` [r, d] written into ``out`` (same shape, contiguous),
    with ``work`` (same shape, contiguous) as scratch; ``x`` is only read. For blocks of a few
    dozen rows that stay in cache: the factors of ``fwht_factors`` (2^15: 64, 32, 16) cost 112
    multiply-adds per value against ``fwht_gemm``'s 384 (the timings: docs/benchmarks.md). Values
    equal ``fwht``'s up to float rounding; each row is transformed on its own.

    Parameters
    ----------
    x : torch.Tensor
        Input rows ``[r, d]``, d a power of two (read only).
    out, work : torch.Tensor
        Result and scratch buffers, shape of ``x``, contiguous.

    Returns
    -------
    torch.Tensor
        ``out``, holding the transform.

    Raises
    ------
    ValueError
        ``d`` is not a power of two.
    """
    d = x.shape[-1]
    fs = fwht_factors(d)
    src, inner = x, 1
    # ping-pong so that the last factor lands in ``out``
    bufs = [out, work] if len(fs) % 2 else [work, out]
    for i, f in enumerate(fs):
        H = _hadamard(f, x.dtype, x.device)
        dst = bufs[i % 2]
        if inner == 1:
            torch.matmul(src.reshape(-1, f), H, out=dst.view(-1, f))
        else:
            torch.matmul(H, src.reshape(-1, f, inner), out=dst.view(-1, f, inner))
        src, inner = dst, inner * f
    return out


def rotated_coordinate_radius(tau: float, d: int, n: int, alpha: float) -> float:
    """[LEVY] Lemma 2: after the rotation (length d), n points within τ (l2) of a center lie
    within 10 τ sqrt(log(d n/α)/d) of it per coordinate, with probability >= 1-α.

    Parameters
    ----------
    tau
        The l2 radius τ.
    d
        The rotated length.
    n
        The number of points.
    alpha
        The failure probability α.

    Returns
    -------
    float
        The per-coordinate radius.
    """
    return 10 * tau * math.sqrt(math.log(max(d * n / alpha, 2.0)) / d)


class RandomRotation:
    """U = d'^{-1/2} H diag(omega), omega uniform in {±1}^{d'} ([LEVY] Alg. 2;
    docs/algorithms.md#randomized-hadamard-rotation).

    ``omega`` is public, data-independent randomness; one draw is shared by all rows of a call,
    drawn on the CPU generator and moved to the rows' device (``engine_opts.device``).
    ``rotate`` pads rows to d' = 2^ceil(log2 d) with zeros; ``invert`` drops the padding.

    Parameters
    ----------
    d
        The rows' length before padding.
    rng
        The CPU generator omega is drawn from.
    dtype
        The rotation's dtype.
    """

    def __init__(self, d: int, *, rng: torch.Generator, dtype: torch.dtype = torch.float64) -> None:
        self.d, self.dp = int(d), next_pow2(int(d))
        self.omega = torch.where(
            torch.rand(self.dp, generator=rng, dtype=dtype) < 0.5, -1.0, 1.0
        ).to(dtype)
        self.scale = 1.0 / math.sqrt(self.dp)

    def rotate(self, X: torch.Tensor) -> torch.Tensor:
        if X.shape[-1] != self.d:
            raise ValueError(f"expected last dim {self.d}, got {X.shape[-1]}")
        lead = X.shape[:-1]
        Z = X.new_zeros(*lead, self.dp) if self.dp != self.d else torch.empty_like(X)
        torch.mul(X, self.omega[: self.d].to(X.device, X.dtype), out=Z[..., : self.d])  # sign
        return fwht_gemm(Z).mul_(self.scale)

    def rotate_block(
        self, X: torch.Tensor, padded: torch.Tensor, out: torch.Tensor, work: torch.Tensor
    ) -> torch.Tensor:
        """``rotate(X)`` for a block of rows X [r, d] (any float dtype) through caller-owned
        float64 buffers of at least r rows and d' columns (reused block after block: no
        allocation per block): ``padded`` must hold zeros in its columns d..d'-1 (they are
        never written); returns ``out[:r]``. The products are ``fwht_into``'s, so the values
        equal ``rotate``'s up to float rounding."""
        r = X.shape[0]
        if X.shape[-1] != self.d:
            raise ValueError(f"expected last dim {self.d}, got {X.shape[-1]}")
        Z = padded[:r]
        torch.mul(X, self.omega[: self.d].to(Z.device), out=Z[:, : self.d])  # float64, sign
        return fwht_into(Z, out[:r], work[:r]).mul_(self.scale)

    def invert(self, Y: torch.Tensor) -> torch.Tensor:
        X = fwht(Y) * self.scale * self.omega.to(Y.device, Y.dtype)  # U^T = d'^{-1/2} D H
        return X[..., : self.d]
