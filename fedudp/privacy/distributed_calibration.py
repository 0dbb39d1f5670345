"""The local noise std and the scale of the distributed mechanisms for a target (ε, δ)
(docs/algorithms.md#distributed-dp).

``calibrate_local_std`` bisects the float-domain std of one owner's share at a given scale;
``heuristic_scale`` is Kairouz, Liu & Steinke's (2021, Sec. 4.2/4.4) choice of the scale that
keeps k stds of the noisy aggregate within 2^bits; ``distributed_params`` chooses both jointly
(the largest scale whose calibrated std still fits the bits), by bisection. Re-exported by
``fedudp.privacy.distributed``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fedudp.privacy.distributed_rdp import NOISES, distributed_event

__all__ = ["calibrate_local_std", "distributed_params", "heuristic_scale"]

_RTOL = 1e-10  # the local std's bisection: relative width
_SCALE_RTOL = 1e-7  # the scale's bisection: relative width
_STEPS = 200  # at most this many doublings/halvings while bracketing


def _check(**kw: Any) -> None:
    """One-line ValueErrors naming the first impossible input (before any long work)."""
    if "noise" in kw and kw["noise"] not in NOISES:
        raise ValueError(f"noise must be one of {', '.join(NOISES)}, got {kw['noise']!r}")
    for name in ("epsilon", "clip", "scale", "k", "rho"):
        if name in kw and not (kw[name] > 0 and math.isfinite(kw[name])):
            raise ValueError(f"{name} must be finite and > 0, got {kw[name]}")
    if "delta" in kw and not 0 < kw["delta"] < 1:
        raise ValueError(f"delta must be in (0, 1), got {kw['delta']}")
    if "beta" in kw and not 0 <= kw["beta"] < 1:
        raise ValueError(f"beta must be in [0, 1), got {kw['beta']}")
    if "rate" in kw and not 0 < kw["rate"] <= 1:
        raise ValueError(f"rate must be in (0, 1], got {kw['rate']}")
    for name in ("rounds", "dim", "owners", "bits"):
        if name in kw and (int(kw[name]) != kw[name] or kw[name] < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {kw[name]}")


def _smallest(
    meets: Callable[[float], bool], start: float, what: str, rtol: float = _RTOL
) -> float:
    """The smallest x > 0 with ``meets(x)`` (monotone: false below, true above), returned from
    above within a relative ``rtol``."""
    lo = hi = start
    for _ in range(_STEPS):
        if meets(hi):
            break
        lo, hi = hi, 2.0 * hi
    else:
        raise ValueError(f"no {what} up to {hi:.3g} meets the target")
    if lo == hi:
        for _ in range(_STEPS):
            lo = hi / 2.0
            if not meets(lo):
                break
            hi = lo
        else:
            return hi
    while hi / lo - 1.0 > rtol:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if meets(mid) else (mid, hi)
    return hi


def calibrate_local_std(
    noise: str,
    *,
    epsilon: float,
    delta: float,
    rounds: int,
    clip: float,
    scale: float,
    beta: float,
    dim: int,
    owners: int,
    rate: float,
) -> float:
    """The smallest float-domain std of one owner's share whose ``rounds`` rounds meet
    (``epsilon``, ``delta``), by bisection (ε decreases with the std).

    Parameters
    ----------
    noise : {"ddgauss", "skellam"}
        The noise shares' distribution.
    epsilon : float
        The target ε (> 0).
    delta : float
        The target δ, in (0, 1).
    rounds : int
        Rounds composed.
    clip : float
        One user's l2 clip (float domain).
    scale : float
        1/γ, applied before rounding.
    beta : float
        Conditional rounding's β in [0, 1).
    dim : int
        The padded dimension.
    owners : int
        The DECLARED MINIMUM of surviving owners (a round with more is accounted at its count,
        which spends less; one with fewer releases nothing).
    rate : float
        Users' Poisson sampling rate.

    Returns
    -------
    float
        The local std (float domain), within a relative 1e-10 above the exact threshold.

    Raises
    ------
    ValueError
        One line naming the impossible input.
    """
    _check(noise=noise, epsilon=epsilon, delta=delta, rounds=rounds, clip=clip, scale=scale)
    _check(beta=beta, dim=dim, owners=owners, rate=rate)
    # start near the Gaussian's std for one round at this ε (the bracket moves from there)
    start = clip * math.sqrt(2.0 * math.log(1.25 / delta)) / (epsilon * math.sqrt(owners))
    kw = {"clip": clip, "scale": scale, "beta": beta, "dim": dim, "owners": owners, "rate": rate}
    return _calibrate(noise, epsilon, delta, rounds, kw, start, _RTOL)


def _calibrate(
    noise: str,
    epsilon: float,
    delta: float,
    rounds: int,
    kw: dict[str, Any],
    start: float,
    rtol: float,
) -> float:
    """``calibrate_local_std`` on checked inputs, from ``start``, within ``rtol`` above."""

    def meets(std: float) -> bool:
        return distributed_event(noise, local_std=std, **kw).epsilon(delta, rounds) <= epsilon

    return _smallest(meets, start, "local_std", rtol)


def heuristic_scale(
    local_std: float,
    clip: float,
    bits: int,
    owners: int,
    dim: int,
    k: float,
    rho: float = 1.0,
) -> float:
    """The scale 1/γ that keeps ``k`` stds of the noisy, rounded aggregate within 2^bits,
    treating the aggregate as subgaussian (Kairouz, Liu & Steinke 2021, Sec. 4.2/4.4): the
    solution of ``2^b = 2k·sqrt(ρ/d·(C n)² + (γ²/4 + σ²)·n)/γ``, i.e.
    ``sqrt(2^(2b) - n k²) / (2k·sqrt(ρ/d·C² n² + n σ²))``.

    Parameters
    ----------
    local_std : float
        σ, one share's std (float domain), >= 0.
    clip : float
        C, one user's l2 clip (float domain).
    bits : int
        b, the bits per coordinate of the modular sum.
    owners : int
        n, the shares summed.
    dim : int
        d, the padded dimension.
    k : float
        Stds of the aggregate kept within the range.
    rho : float
        The rotation's flatness ρ (1 for the randomized Hadamard transform's heuristic).

    Returns
    -------
    float
        The scale.

    Raises
    ------
    ValueError
        ``bits=B too small for n=... owners and k=...`` when ``2^(2b) <= n k²``; one line naming
        any other impossible input.
    """
    _check(clip=clip, bits=bits, owners=owners, dim=dim, k=k, rho=rho)
    if not (local_std >= 0 and math.isfinite(local_std)):
        raise ValueError(f"local_std must be finite and >= 0, got {local_std}")
    room = 2.0 ** (2.0 * bits) - owners * k**2
    if room <= 0:
        raise ValueError(
            f"bits={bits} too small for n={owners} owners and k={k}: need 2^(2*bits) > n*k^2 "
            "(raise bits, or lower k or the owners per round)"
        )
    spread = rho / dim * clip**2 * owners**2 + owners * local_std**2
    return math.sqrt(room) / (2.0 * k * math.sqrt(spread))


def _largest_fitting(fits: Callable[[float, float], bool], top: float) -> float | None:
    """The largest scale below ``top`` (which never fits) with ``fits(scale, rtol)``, within
    a relative _SCALE_RTOL from below; None if none down to top/2^64. The downward scan may use
    a coarse std (rtol 1e-3): it is an over-estimate, so a coarse fit is a fit."""
    hi, lo = top, top / 2.0
    for _ in range(64):
        if fits(lo, 1e-3):
            break
        hi, lo = lo, lo / 2.0
    else:
        return None
    while hi / lo - 1.0 > _SCALE_RTOL:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if fits(mid, _RTOL) else (lo, mid)
    return lo


def distributed_params(
    noise: str,
    *,
    epsilon: float,
    delta: float,
    rounds: int,
    clip: float,
    bits: int,
    beta: float,
    dim: int,
    owners: int,
    rate: float,
    k: float,
    rho: float = 1.0,
) -> tuple[float, float]:
    """(scale, local_std) chosen jointly, as the reference's ``ddgauss_params`` /
    ``skellam_params`` intend: the scale solves ``scale = heuristic_scale(σ(scale))`` where
    σ(scale) is ``calibrate_local_std`` at that scale. Of the scales that fit
    (``scale <= heuristic_scale(σ(scale))``) the largest (the finest grid) is taken: the
    bracket starts at ``heuristic_scale(0)``, which never fits, halves until a scale fits, and
    bisects to a relative 1e-7 on the fitting side.

    Parameters
    ----------
    noise : {"ddgauss", "skellam"}
        The noise shares' distribution.
    epsilon : float
        The target ε (> 0).
    delta : float
        The target δ, in (0, 1).
    rounds : int
        Rounds composed.
    clip : float
        One user's l2 clip (float domain).
    bits : int
        Bits per coordinate of the modular sum.
    beta : float
        Conditional rounding's β in [0, 1).
    dim : int
        The padded dimension.
    owners : int
        The declared minimum of surviving owners.
    rate : float
        Users' Poisson sampling rate.
    k : float
        Stds of the aggregate kept within 2^bits (``heuristic_scale``).
    rho : float
        The rotation's flatness (``heuristic_scale``).

    Returns
    -------
    tuple of float
        (scale, local_std), the std in the float domain, calibrated at that scale.

    Raises
    ------
    ValueError
        One line naming the impossible input (bits too small included).
    """
    _check(noise=noise, epsilon=epsilon, delta=delta, rounds=rounds, clip=clip, bits=bits)
    _check(beta=beta, dim=dim, owners=owners, rate=rate, k=k, rho=rho)
    top = heuristic_scale(0.0, clip, bits, owners, dim, k, rho)

    kw = {"clip": clip, "beta": beta, "dim": dim, "owners": owners, "rate": rate}
    hint = [clip / math.sqrt(owners)]  # the last std found: where the next bracket starts

    def std(scale: float, rtol: float = _RTOL) -> float:
        hint[0] = _calibrate(noise, epsilon, delta, rounds, {**kw, "scale": scale}, hint[0], rtol)
        return hint[0]

    def fits(scale: float, rtol: float = _RTOL) -> bool:
        return scale <= heuristic_scale(std(scale, rtol), clip, bits, owners, dim, k, rho)

    lo = _largest_fitting(fits, top)
    if lo is None:
        raise ValueError(
            f"bits={bits} too small for n={owners} owners and k={k} at epsilon={epsilon}: no "
            "scale keeps k stds of the noisy sum within 2^bits (raise bits or lower k)"
        )
    return lo, std(lo)
