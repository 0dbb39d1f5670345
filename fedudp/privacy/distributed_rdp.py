"""The RDP curves of the distributed discrete Gaussian and Skellam mechanisms and their event
(docs/algorithms.md#distributed-dp); ``fedudp.privacy.distributed`` is the public face.

Each owner adds an integer noise share of std ``local_std`` to the sum of its users' scaled,
rotated and stochastically rounded vectors; secure aggregation reveals only the sum over the
round's ``owners`` survivors. Everything here is in the integer (scaled) domain: a user's
clipped l2 norm ``C`` becomes ``C * scale`` before rounding, and rounding inflates it
(``rounded_l2_bound``).

* The distributed discrete Gaussian (``ddgauss``): the sum of n discrete Gaussians of
  parameter s is close to one of parameter s·√n; Kairouz, Liu & Steinke (2021), Prop. 14,
  bound its RDP by the least of three terms carrying the extra τ (``ddg_tau``).
* The Skellam mechanism (``skellam``): a sum of Skellam shares is Skellam (variance n·s²);
  Agarwal, Kairouz & Liu (2021) bound its RDP (``skellam_rdp``).
* Poisson sampling of users at rate q: the general upper bound of Zhu & Wang (2019) for
  integer orders (``subsampled_rdp``), taken with the unsampled curve's minimum at each order.

``DistributedDpEvent`` is one round (its own event kind: dp-accounting has no Poisson-sampled
event for these mechanisms); ``fedudp.privacy.accountant.Accountant`` composes it by summing
RDP curves and converts with dp-accounting's ``compute_epsilon`` (``rdp_epsilon``). The choice
of the local std and of the scale for a target (ε, δ): ``fedudp.privacy.distributed_calibration``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import special

__all__ = [
    "NOISES",
    "RDP_ORDERS",
    "DistributedDpEvent",
    "ddg_rdp",
    "ddg_tau",
    "distributed_event",
    "distributed_rdp_epsilon",
    "rdp_epsilon",
    "rounded_l1_bound",
    "rounded_l2_bound",
    "skellam_rdp",
    "subsampled_rdp",
]

# Zhu & Wang's bound needs integer orders
RDP_ORDERS: tuple[int, ...] = tuple(range(2, 129)) + (256,)
NOISES = ("ddgauss", "skellam")


def _positive(name: str, value: float, zero: bool = False) -> None:
    ok = value >= 0 if zero else value > 0
    if not (ok and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and {'>=' if zero else '>'} 0, got {value}")


def _dim(dim: int) -> None:
    if int(dim) != dim or dim < 1:
        raise ValueError(f"dim must be an integer >= 1, got {dim}")


def rounded_l2_bound(l2: float, beta: float, dim: int) -> float:
    """The l2 norm of one vector after conditional stochastic rounding to the integers.

    Kairouz, Liu & Steinke (2021), Thm 1 / Prop. 22: rounding each coordinate up or down at
    random (retrying until the norm passes, with failure probability ``beta``) leaves the norm
    at most ``min(l2 + √d, sqrt(l2² + d/4 + sqrt(2 ln(1/β))·(l2 + √d/2)))``; unconditional
    rounding (``beta = 0``) at most ``l2 + √d``.

    Parameters
    ----------
    l2 : float
        The vector's l2 norm bound before rounding, in the integer (scaled) domain.
    beta : float
        The conditional rounding's parameter, in [0, 1).
    dim : int
        The vector's dimension.

    Returns
    -------
    float
        The bound after rounding, in the integer domain.

    Raises
    ------
    ValueError
        For ``l2 <= 0``, ``beta`` outside [0, 1) or ``dim < 1``.
    """
    _positive("l2", l2)
    _dim(dim)
    if not 0 <= beta < 1:
        raise ValueError(f"beta must be in [0, 1), got {beta}")
    unconditional = l2 + math.sqrt(dim)
    if beta == 0:
        return float(unconditional)
    sq = l2**2 + 0.25 * dim + math.sqrt(2.0 * math.log(1.0 / beta)) * (l2 + 0.5 * math.sqrt(dim))
    return float(min(unconditional, math.sqrt(sq)))


def rounded_l1_bound(l2_rounded: float, dim: int) -> float:
    """The l1 norm bound of a rounded vector: ``l2·min(√d, l2)`` (Cauchy–Schwarz, and on the
    integer grid ``|x|₁ <= |x|₂²``).

    Parameters
    ----------
    l2_rounded : float
        Its l2 norm bound after rounding (``rounded_l2_bound``), integer domain.
    dim : int
        Its dimension.

    Returns
    -------
    float
        The l1 bound, integer domain.
    """
    _positive("l2_rounded", l2_rounded)
    _dim(dim)
    return float(l2_rounded * min(math.sqrt(dim), l2_rounded))


def ddg_tau(local_std: float, owners: int) -> float:
    """The τ of a sum of ``owners`` discrete Gaussians (Kairouz, Liu & Steinke 2021, Thm 1):
    ``10·Σ_{k=1}^{n-1} exp(-2π² s² k/(k+1))``, 0 for one owner.

    Parameters
    ----------
    local_std : float
        s: one share's std (the discrete Gaussian's parameter), integer domain.
    owners : int
        n: how many shares sum.

    Returns
    -------
    float
        τ.
    """
    _positive("local_std", local_std)
    if int(owners) != owners or owners < 1:
        raise ValueError(f"owners must be an integer >= 1, got {owners}")
    k = np.arange(1, int(owners), dtype=np.float64)
    return float(10.0 * np.sum(np.exp(-2.0 * math.pi**2 * local_std**2 * k / (k + 1.0))))


def ddg_rdp(
    orders: np.ndarray, l2: float, l1: float, local_std: float, owners: int, dim: int
) -> np.ndarray:
    """RDP of the distributed discrete Gaussian at ``orders``, unsampled (Kairouz, Liu &
    Steinke 2021, Prop. 14): with Δ₂ = l2/(√n·s), Δ₁ = l1/(√n·s) and τ = ``ddg_tau(s, n)``,
    ``min(α/2·Δ₂² + τd, α/2·(Δ₂² + 2Δ₁τ + τ²d), α/2·(Δ₂ + τ√d)²)``.

    Parameters
    ----------
    orders : numpy.ndarray
        The RDP orders α (> 1).
    l2 : float
        One user's l2 sensitivity, integer domain.
    l1 : float
        Its l1 sensitivity, integer domain.
    local_std : float
        s, one share's std, integer domain.
    owners : int
        n, the shares summed.
    dim : int
        d, the dimension.

    Returns
    -------
    numpy.ndarray
        The RDP at each order (float64).
    """
    a = np.asarray(orders, dtype=np.float64)
    tau = ddg_tau(local_std, owners)
    central = math.sqrt(owners) * local_std
    s2, s1 = l2 / central, l1 / central
    one = a / 2.0 * s2**2 + tau * dim
    two = a / 2.0 * (s2**2 + 2.0 * s1 * tau + tau**2 * dim)
    three = a / 2.0 * (s2 + math.sqrt(dim) * tau) ** 2
    return np.minimum(np.minimum(one, two), three)


def skellam_rdp(
    orders: np.ndarray, l2: float, l1: float, local_std: float, owners: int
) -> np.ndarray:
    """RDP of the distributed Skellam mechanism at ``orders``, unsampled (Agarwal, Kairouz &
    Liu 2021): the sum of n Skellam shares of variance s² is Skellam of variance μ = n·s²,
    whose RDP is ``α Δ₂²/(2μ) + min(((2α-1)Δ₂² + 6Δ₁)/(4μ²), 3Δ₁/(2μ))``.

    In the integer domain the scale does not appear (the reference's float-domain form carries
    it and reduces to this one).

    Parameters
    ----------
    orders : numpy.ndarray
        The RDP orders α (> 1).
    l2 : float
        One user's l2 sensitivity, integer domain.
    l1 : float
        Its l1 sensitivity, integer domain.
    local_std : float
        s, one share's std, integer domain.
    owners : int
        n, the shares summed.

    Returns
    -------
    numpy.ndarray
        The RDP at each order (float64).
    """
    a = np.asarray(orders, dtype=np.float64)
    mu = owners * local_std**2
    extra = np.minimum(((2.0 * a - 1.0) * l2**2 + 6.0 * l1) / (4.0 * mu**2), 1.5 * l1 / mu)
    return a * l2**2 / (2.0 * mu) + extra


def _subsampled(orders: Sequence[int], q: float, eps: np.ndarray) -> np.ndarray:
    """Zhu–Wang's bound at integer ``orders`` (0 < q < 1), all at once in log space;
    ``eps[i]`` is the unsampled RDP at order i + 2, for orders up to ``max(orders)``."""
    a = np.asarray(orders, dtype=np.float64)[:, None]
    j = np.arange(2, eps.size + 2, dtype=np.float64)[None, :]
    used = j <= a
    aj = np.where(used, a - j, 0.0)
    log_comb = special.gammaln(a + 1.0) - special.gammaln(j + 1.0) - special.gammaln(aj + 1.0)
    with np.errstate(over="ignore", invalid="ignore"):
        terms = log_comb + j * math.log(q) + aj * math.log1p(-q) + (j - 1.0) * eps[None, :]
    terms = terms + np.where(j >= 3, math.log(3.0), 0.0)  # orders 3..α carry the factor 3
    terms = np.where(used, terms, -np.inf)
    first = (a - 1.0) * math.log1p(-q) + np.log1p((a - 1.0) * q)
    total = special.logsumexp(np.concatenate((first, terms), axis=1), axis=1)
    return np.asarray(total / (a[:, 0] - 1.0), dtype=np.float64)


def _check_order_rate(order: int, q: float) -> None:
    if int(order) != order or order < 2:
        raise ValueError(f"the RDP order must be an integer >= 2, got {order}")
    if not 0 < q <= 1:
        raise ValueError(f"the sampling rate must be in (0, 1], got {q}")


def subsampled_rdp(order: int, q: float, rdp: Callable[[int], float]) -> float:
    """RDP at integer ``order`` of a mechanism of RDP ``rdp`` run on a Poisson sample at rate
    ``q``: the general upper bound of Zhu & Wang (2019, "Poisson subsampled Rényi DP"),

    ``(α-1)·ε'(α) <= log[(1-q)^(α-1)(1+(α-1)q) + C(α,2) q²(1-q)^(α-2) e^ε(2)
    + 3 Σ_{l=3}^α C(α,l) q^l (1-q)^(α-l) e^((l-1)ε(l))]``,

    in log space (``logsumexp``); an infinite ``rdp(l)`` makes it infinite.

    Parameters
    ----------
    order : int
        α >= 2.
    q : float
        The sampling rate, in (0, 1]; at 1, ``rdp(order)``.
    rdp : callable
        The unsampled mechanism's RDP at an integer order.

    Returns
    -------
    float
        The bound (not taken with the unsampled RDP's minimum: ``DistributedDpEvent.rdp`` is).
    """
    _check_order_rate(order, q)
    if q == 1:
        return float(rdp(int(order)))
    eps = np.array([rdp(j) for j in range(2, int(order) + 1)], dtype=np.float64)
    return float(_subsampled([int(order)], q, eps)[0])


def rdp_epsilon(orders: Sequence[int], rdp: Sequence[float] | np.ndarray, delta: float) -> float:
    """(ε, δ) from an RDP curve: dp-accounting's public conversion
    (``dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon``).

    Parameters
    ----------
    orders : sequence of int
        The orders.
    rdp : sequence of float
        The RDP at each order (may be inf).
    delta : float
        δ in (0, 1).

    Returns
    -------
    float
        The smallest ε the conversion certifies over the orders.
    """
    eps, _ = rdp_privacy_accountant.compute_epsilon(
        np.asarray(orders, dtype=np.float64), np.asarray(rdp, dtype=np.float64), delta
    )
    return float(eps)


def distributed_rdp_epsilon(runs: Sequence[Sequence[object]], delta: float) -> float:
    """ε at ``delta`` of runs ``[(event, count), ...]`` of ``DistributedDpEvent``s (others,
    e.g. ``NoOpDpEvent``, release nothing and are skipped): the sum of ``count`` times each
    event's RDP curve at ``RDP_ORDERS``, converted by ``rdp_epsilon``.

    Parameters
    ----------
    runs : sequence of (event, count)
        The composed rounds; events may differ per round (the survivor count changes).
    delta : float
        δ in (0, 1).

    Returns
    -------
    float
        The certified ε (0 when nothing was released).
    """
    total = np.zeros(len(RDP_ORDERS))
    released = False
    for event, count in runs:
        if isinstance(event, DistributedDpEvent) and int(count) > 0:  # type: ignore[call-overload]
            total += int(count) * event.rdp(RDP_ORDERS)  # type: ignore[call-overload]
            released = True
    return rdp_epsilon(RDP_ORDERS, total, delta) if released else 0.0


@dataclass(frozen=True)
class DistributedDpEvent:
    """One round of a distributed mechanism (its own event kind: dp-accounting has none that
    is Poisson-sampled), in the integer (scaled) domain.

    Parameters
    ----------
    noise : {"ddgauss", "skellam"}
        The noise shares' distribution.
    local_std : float
        Std of one owner's noise share, integer domain.
    owners : int
        How many shares sum (the round's surviving owners, public).
    l2 : float
        The l2 sensitivity of one user's rounded vector (integer domain, inflated by rounding).
    l1 : float
        Its l1 sensitivity (integer domain).
    dim : int
        The padded dimension.
    scale : float
        The scale 1/γ applied before rounding (recorded; the integer-domain bounds need it not).
    rate : float
        The Poisson sampling rate q of users, in (0, 1].
    """

    noise: str
    local_std: float
    owners: int
    l2: float
    l1: float
    dim: int
    scale: float
    rate: float

    def __post_init__(self) -> None:
        if self.noise not in NOISES:
            raise ValueError(f"noise must be one of {', '.join(NOISES)}, got {self.noise!r}")
        for name in ("local_std", "l2", "l1", "scale"):
            _positive(name, getattr(self, name))
        if int(self.owners) != self.owners or self.owners < 1:
            raise ValueError(f"owners must be an integer >= 1, got {self.owners}")
        _dim(self.dim)
        if not 0 < self.rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {self.rate}")

    def unsampled_rdp(self, orders: Sequence[int]) -> np.ndarray:
        """The RDP curve of one round without sampling (q = 1) at ``orders``."""
        a = np.asarray(orders, dtype=np.float64)
        if self.noise == "ddgauss":
            return ddg_rdp(a, self.l2, self.l1, self.local_std, int(self.owners), int(self.dim))
        return skellam_rdp(a, self.l2, self.l1, self.local_std, int(self.owners))

    def rdp(self, orders: Sequence[int] = RDP_ORDERS) -> np.ndarray:
        """Per-round RDP curve: at each order, the least of Zhu–Wang's subsampled bound and the
        unsampled RDP (as the reference accounting does).

        Parameters
        ----------
        orders : sequence of int
            Integer orders >= 2 (default ``RDP_ORDERS``).

        Returns
        -------
        numpy.ndarray
            The RDP at each order (a fresh array; may hold inf).
        """
        return np.array(_curve(self, tuple(int(a) for a in orders)))

    def epsilon(self, delta: float, count: int = 1) -> float:
        """ε at ``delta`` of ``count`` rounds of this event (RDP curves add up), converted by
        ``rdp_epsilon``.

        Parameters
        ----------
        delta : float
            δ in (0, 1).
        count : int
            Rounds composed.

        Returns
        -------
        float
            The certified ε.
        """
        return rdp_epsilon(RDP_ORDERS, count * self.rdp(RDP_ORDERS), delta)

    def __str__(self) -> str:
        return (
            f"DistributedDpEvent(noise={self.noise}, local_std={self.local_std!r}, "
            f"owners={self.owners}, l2={self.l2!r}, l1={self.l1!r}, dim={self.dim}, "
            f"scale={self.scale!r}, rate={self.rate!r})"
        )


@functools.lru_cache(maxsize=4096)
def _curve(event: DistributedDpEvent, orders: tuple[int, ...]) -> tuple[float, ...]:
    for a in orders:
        _check_order_rate(a, event.rate)
    plain = event.unsampled_rdp(orders)
    if event.rate == 1:
        return tuple(float(v) for v in plain)
    top = max(orders)
    eps = event.unsampled_rdp(range(2, top + 1))
    out = np.minimum(_subsampled(orders, event.rate, eps), plain)
    return tuple(float(v) for v in out)


def distributed_event(
    noise: str,
    *,
    clip: float,
    local_std: float,
    scale: float,
    beta: float,
    dim: int,
    owners: int,
    rate: float,
) -> DistributedDpEvent:
    """The event of one round, built in the integer domain from float-domain parameters: the
    l2 sensitivity is ``rounded_l2_bound(clip·scale, beta, dim)``, the l1 ``rounded_l1_bound``
    of it, the share's std ``local_std·scale``.

    Parameters
    ----------
    noise : {"ddgauss", "skellam"}
        The noise shares' distribution.
    clip : float
        C, one user's l2 clip norm (float domain).
    local_std : float
        One owner's noise std (float domain).
    scale : float
        1/γ, applied before rounding.
    beta : float
        Conditional rounding's β in [0, 1).
    dim : int
        The padded dimension.
    owners : int
        The shares summed (survivors of the round).
    rate : float
        Users' Poisson sampling rate.

    Returns
    -------
    DistributedDpEvent
        The round's event.
    """
    _positive("clip", clip)
    _positive("local_std", local_std)
    _positive("scale", scale)
    l2 = rounded_l2_bound(clip * scale, beta, dim)
    l1 = rounded_l1_bound(l2, dim)
    return DistributedDpEvent(noise, local_std * scale, owners, l2, l1, int(dim), scale, rate)
