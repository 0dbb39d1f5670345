"""Epsilon of one composed event: the smaller of PLD's and RDP's upper bounds, with bounded work.

Bounded work (``bounded_epsilon``): epsilon of a composition is the smaller of PLD's and RDP's
(both upper bounds); PLD is left out where its PMF would exceed ``MAX_PLD_WINDOW`` values or a
sampled Gaussian's PLD ``MAX_PLD_BUILD`` (very long schedules, tiny noise), so any (epsilon,
delta, rounds, q) answers in seconds (docs/algorithms.md#events-and-accountants).

Two engines compute the same bounds (``ENGINES``):

``fast`` (the default)
    ``fedudp.privacy.pld_fast``: dp-accounting's own computation, memoized, with each sampled
    Gaussian's PLD built once (it reads dp-accounting's private names; that module lists them).
``public``
    dp-accounting's public API only: ``PLDAccountant.compose`` / ``get_epsilon`` and
    ``RdpAccountant.compose`` / ``get_epsilon`` on the event, nothing cached. The window cap
    ``MAX_PLD_WINDOW`` needs a PMF's size, which only the fast engine reads; the public engine
    computes PLD wherever ``pld_supports`` holds (and ``MAX_PLD_BUILD`` allows), so very long
    schedules take as long as dp-accounting takes on them.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

from fedudp.logs import root_placeholder
from fedudp.privacy.pld_fast import (
    RELATION,
    direct_pld_epsilon,
    event_key,
    fast_pld,
    forget,
    lru_get,
    pld_accountant,
    sampled_gaussian,
)

__all__ = [
    "ENGINES",
    "MAX_PLD_BUILD",
    "MAX_PLD_POINTS",
    "MAX_PLD_WINDOW",
    "bounded_epsilon",
    "check_engine",
    "composed_event",
    "event_epsilon",
    "forget_all",
    "gaussian_pld_points",
    "pld_epsilon",
    "pld_interval",
    "pld_size",
    "pld_supports",
    "pld_too_large",
    "pld_tractable",
    "quiet_absl",
    "rdp_accountant",
    "rdp_epsilon",
    "rdp_event_epsilon",
    "rdp_runs_epsilon",
    "with_rdp",
]

ENGINES = ("fast", "public")


def check_engine(engine: str) -> str:
    """``engine`` if it is one of ``ENGINES``.

    Raises
    ------
    ValueError
        For any other value, naming the choices.
    """
    if engine not in ENGINES:
        raise ValueError(f"accountant engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    return engine


def pld_interval(target_epsilon: float | None) -> float:
    """PLD discretization: 1e-4 up to epsilon 1, coarser (relative 1e-4) above, for speed.

    PLD accounting with a coarser grid stays an upper bound on epsilon (pessimistic).

    Parameters
    ----------
    target_epsilon : float or None
        The target (None: 1).

    Returns
    -------
    float
        The interval.
    """
    return 1e-4 * max(1.0, float(target_epsilon or 1.0))


@contextlib.contextmanager
def quiet_absl() -> Iterator[None]:
    """dp-accounting's RDP logs a warning per excluded order; keep the terminal readable.

    Yields
    ------
    None
        While absl logs errors only.
    """
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        # absl's log() runs logging.basicConfig() on a bare root logger whatever its own level,
        # duplicating every propagated line from then on: a stand-in root handler while here
        with root_placeholder():
            yield
    finally:
        log.setLevel(level)


def rdp_accountant() -> rdp_privacy_accountant.RdpAccountant:
    """A fresh dp-accounting ``RdpAccountant`` under ``ADD_OR_REMOVE_ONE``.

    Returns
    -------
    dp_accounting.rdp.RdpAccountant
        An empty accountant.
    """
    return rdp_privacy_accountant.RdpAccountant(neighboring_relation=RELATION)


_RDP_VECTORS: OrderedDict = OrderedDict()  # event -> RDP at the default orders (None: unsupported)
# (q, z, interval, count) -> the k-fold sampled Gaussian's PLD size (``pld_size``): a pure
# function, kept so that asking it again (a calibration repeated for the same schedule) does not
# rebuild the PLD only to size it
_SIZES: OrderedDict = OrderedDict()


# -- RDP: additive over the orders ---------------------------------------------------------------
def _rdp_vector(event: dp_accounting.DpEvent) -> np.ndarray | None:
    """dp-accounting's RDP of one ``event`` at its default orders (None: unsupported)."""

    def make():
        acc = rdp_accountant()
        if not acc.supports(event):
            return None
        with quiet_absl():
            acc.compose(event)
        return acc.rdp

    return lru_get(_RDP_VECTORS, event_key(event), make, 64)


_RDP_ORDERS: np.ndarray | None = None


def rdp_runs_epsilon(
    runs: Sequence[Sequence[Any]], delta: float, engine: str = "fast"
) -> float | None:
    """RdpAccountant's epsilon of the runs [(event, count), ...] composed in order (None:
    unsupported); ``engine="public"``: ``RdpAccountant.compose`` on the runs' event.

    Parameters
    ----------
    runs : sequence of (DpEvent, int)
        The runs, in order.
    delta : float
        The δ at which ε is read.
    engine : str, default "fast"
        ``"fast"`` or ``"public"``.

    Returns
    -------
    float or None
        ε, or None where RDP does not support an event.
    """
    if engine == "public":
        return rdp_epsilon(composed_event(runs), delta, engine)
    global _RDP_ORDERS
    if _RDP_ORDERS is None:
        _RDP_ORDERS = rdp_accountant().orders
    total = np.zeros_like(_RDP_ORDERS, dtype=np.float64)
    for e, c in runs:
        r = _rdp_vector(e)
        if r is None:
            return None
        total += c * r
    with quiet_absl():
        return float(rdp_privacy_accountant.compute_epsilon(_RDP_ORDERS, total, delta)[0])


def _rdp_total(event: dp_accounting.DpEvent, count: int = 1) -> np.ndarray | None:
    """RDP of ``count`` x ``event`` at the default orders: the cached vector of each leaf event
    times its count (RDP adds over composition; None: unsupported)."""
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return 0.0 * _rdp_orders()
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return _rdp_total(event.event, count * event.count)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        total = 0.0 * _rdp_orders()
        for e in event.events:
            r = _rdp_total(e, count)
            if r is None:
                return None
            total = total + r
        return total
    r = _rdp_vector(event)
    return None if r is None else count * r


def _rdp_orders() -> np.ndarray:
    global _RDP_ORDERS
    if _RDP_ORDERS is None:
        _RDP_ORDERS = rdp_accountant().orders
    return _RDP_ORDERS


def rdp_event_epsilon(event: dp_accounting.DpEvent, delta: float) -> float | None:
    """RDP epsilon of ``event`` at ``delta`` (``_rdp_total``; None: unsupported).

    Parameters
    ----------
    event, delta : DpEvent, float
        The event and the δ at which ε is read.

    Returns
    -------
    float or None
        ε, or None where RDP does not support the event.
    """
    total = _rdp_total(event)
    if total is None:
        return None
    with quiet_absl():
        return float(rdp_privacy_accountant.compute_epsilon(_rdp_orders(), total, delta)[0])


def rdp_epsilon(event: dp_accounting.DpEvent, delta: float, engine: str = "fast") -> float | None:
    """RDP epsilon of ``event`` at ``delta`` (None: unsupported): ``rdp_event_epsilon``
    (``fast``), or a fresh ``RdpAccountant``'s ``compose`` and ``get_epsilon`` (``public``).

    Parameters
    ----------
    event, delta, engine : DpEvent, float, str
        As ``rdp_runs_epsilon``'s, for one event.

    Returns
    -------
    float or None
        ε, or None where RDP does not support the event.

    Raises
    ------
    ValueError
        An unknown ``engine``.
    """
    if check_engine(engine) == "fast":
        return rdp_event_epsilon(event, delta)
    acc = rdp_accountant()
    if not acc.supports(event):
        return None
    with quiet_absl():
        acc.compose(event)
        return float(acc.get_epsilon(delta))


def composed_event(runs: Sequence[Sequence[Any]]) -> dp_accounting.DpEvent:
    """The runs [(event, count), ...] as one event (each run self-composed).

    Parameters
    ----------
    runs : sequence of (DpEvent, int)
        The runs, in order (at least one).

    Returns
    -------
    DpEvent
        A ``SelfComposedDpEvent``, or a ``ComposedDpEvent`` of them.
    """
    parts = [dp_accounting.SelfComposedDpEvent(e, c) for e, c in runs]
    return parts[0] if len(parts) == 1 else dp_accounting.ComposedDpEvent(parts)


def event_epsilon(
    event: dp_accounting.DpEvent | None,
    delta: float,
    interval: float = 1e-4,
    rdp_only: bool = False,
    engine: str = "fast",
) -> float | None:
    """Epsilon of one (composed) event at ``delta``: PLD, or RDP for events PLD cannot
    represent (or when ``rdp_only``); None if neither supports it, inf when delta <= 0.
    PLD: the numbers of a fresh ``PLDAccountant`` (``direct_pld_epsilon``, memoized).

    Parameters
    ----------
    event : DpEvent or None
        The event (None: blocks only).
    delta, interval : float
        The δ at which ε is read; the PLD grid.
    rdp_only : bool, default False
        Use RDP even where PLD supports the event.
    engine : str, default "fast"
        ``"fast"`` or ``"public"``.

    Returns
    -------
    float or None
        ε (inf when ``delta <= 0``), or None where neither accountant supports the event.

    Raises
    ------
    ValueError
        An unknown ``engine``, where PLD supports the event.
    """
    if event is None:  # nothing but blocks: fine while they leave δ >= 0
        return 0.0 if delta >= 0 else math.inf
    if delta <= 0:  # events need some δ: none is left
        return math.inf
    if not rdp_only and pld_supports(event):
        return bounded_epsilon(event, delta, interval, engine)
    acc = rdp_accountant()
    if not acc.supports(event):
        return None
    with quiet_absl():
        acc.compose(event)
        return float(acc.get_epsilon(delta))


_PLD_SUPPORTS: dict = {}
# A Gaussian's PLD holds about (its privacy-loss range) / (grid interval) values: for noise
# multiplier z the loss ranges over ±(1/(2 z²) + 9.75/z) (dp-accounting's tails), which at
# the finest grid (1e-4) is 1e10 values for z = 0.001 (76 GiB: dp-accounting fails to allocate
# it). Above this many values PLD accounting is not attempted and RDP (an upper bound on ε, as
# PLD's is) is the accountant: such a mechanism is far from any useful target anyway.
MAX_PLD_POINTS = 5 * 10**7


def gaussian_pld_points(z: float, interval: float = 1e-4) -> float:
    """Estimated size of a Gaussian mechanism's PLD (noise multiplier z, sensitivity 1): at
    most 1.03x dp-accounting's, never below it (tests/privacy/test_accountant.py).

    Parameters
    ----------
    z, interval : float
        The noise multiplier (> 0) and the PLD grid.

    Returns
    -------
    float
        The estimated number of PLD values.
    """
    return 2.0 * (1.0 / (2.0 * z * z) + 10.0 / z) / interval


def pld_tractable(event: dp_accounting.DpEvent) -> bool:
    """Whether every Gaussian inside ``event`` has a PLD of at most ``MAX_PLD_POINTS`` values
    at the finest grid (``gaussian_pld_points``).

    Parameters
    ----------
    event : DpEvent
        The event.

    Returns
    -------
    bool
        No Gaussian inside is too large (other events count as tractable).
    """
    if isinstance(event, dp_accounting.GaussianDpEvent):
        z = float(event.noise_multiplier)
        return z == 0 or gaussian_pld_points(z) <= MAX_PLD_POINTS  # 0: non-private, no PLD
    if isinstance(
        event,
        (
            dp_accounting.PoissonSampledDpEvent,
            dp_accounting.SampledWithoutReplacementDpEvent,
            dp_accounting.SampledWithReplacementDpEvent,
            dp_accounting.SelfComposedDpEvent,
        ),
    ):
        return pld_tractable(event.event)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return all(pld_tractable(e) for e in event.events)
    return True


# A composition of many releases holds more values than one release: dp-accounting's k-fold
# self-composition keeps a window that grows with k (its Chernoff bounds), and its grid's
# pessimism adds up over the k releases (at 1e8 rounds of q = 0.01 its epsilon is 1.7 where RDP
# certifies 1.0). Beyond this many values PLD is not computed: RDP alone bounds epsilon. This
# bounds every epsilon's work (a few seconds) whatever the number of rounds; ordinary
# schedules at their own grid hold 1e5-3e5 values.
MAX_PLD_WINDOW = 2**20
# dp-accounting builds a Poisson-sampled Gaussian's PLD one value at a time in Python (about
# 1-2 s per 2e5 values on a busy 2-core machine): beyond this estimate (``gaussian_pld_points``;
# noise below about 0.22 at the finest grid) RDP alone bounds epsilon, so no step takes minutes.
# Ordinary calibrations (noise above about 0.45, so that their bracket's lower end z/2 stays
# above 0.22) compute exactly what they did before.
MAX_PLD_BUILD = 10**6


def pld_size(
    event: dp_accounting.DpEvent, interval: float, count: int = 1, engine: str = "fast"
) -> float:
    """About how many values the PLD of ``count`` x ``event`` holds (its largest PMF; the sum
    over a composition's parts); inf where a Gaussian would not fit (``pld_tractable``).
    ``engine="public"``: a sampled Gaussian's k-fold window is not read (0; see the module).

    Parameters
    ----------
    event : DpEvent
        The event.
    interval : float
        The PLD grid.
    count : int, default 1
        Its self-compositions.
    engine : str, default "fast"
        ``"fast"`` or ``"public"``.

    Returns
    -------
    float
        The estimated size; 0.0 for events without a sampled Gaussian or Gaussian.
    """
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return pld_size(event.event, interval, count * event.count, engine)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return sum(pld_size(e, interval, count, engine) for e in event.events)
    if isinstance(event, dp_accounting.GaussianDpEvent):  # k Gaussians: one of z / sqrt(k)
        z = float(event.noise_multiplier)
        return 0.0 if z == 0 else gaussian_pld_points(z / math.sqrt(count), interval)
    qz = sampled_gaussian(event)
    if qz is not None:
        if gaussian_pld_points(qz[1], interval) > MAX_PLD_BUILD:
            return math.inf
        if check_engine(engine) == "public":
            return 0.0
        q, z = qz
        return lru_get(
            _SIZES,
            (q, z, float(interval), int(count)),
            lambda: float(fast_pld(q, z, interval).window(count)),
            4096,
        )
    return 0.0


def pld_epsilon(
    event: dp_accounting.DpEvent, delta: float, interval: float, engine: str = "fast"
) -> float:
    """``PLDAccountant(ADD_OR_REMOVE_ONE, interval).compose(event).get_epsilon(delta)``:
    ``direct_pld_epsilon`` (``fast``: the same numbers, memoized) or that call itself
    (``public``).

    Parameters
    ----------
    event, delta, interval : DpEvent, float, float
        The event, the δ at which ε is read and the PLD grid.
    engine : str, default "fast"
        ``"fast"`` or ``"public"``.

    Returns
    -------
    float
        PLD's ε.

    Raises
    ------
    ValueError
        An unknown ``engine``.
    """
    if check_engine(engine) == "fast":
        return direct_pld_epsilon(event, delta, interval)
    acc = pld_accountant(interval)
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def with_rdp(
    pld_epsilon: float, event: dp_accounting.DpEvent, delta: float, engine: str = "fast"
) -> float:
    """The smaller of ``pld_epsilon`` and RDP's epsilon of ``event`` (where RDP supports it).

    Parameters
    ----------
    pld_epsilon : float
        PLD's ε of ``event``.
    event, delta, engine : DpEvent, float, str
        As ``rdp_epsilon``'s.

    Returns
    -------
    float
        The smaller ε.

    Raises
    ------
    ValueError
        An unknown ``engine``.
    """
    rdp = rdp_epsilon(event, delta, engine)
    return pld_epsilon if rdp is None else min(pld_epsilon, rdp)


def bounded_epsilon(
    event: dp_accounting.DpEvent, delta: float, interval: float, engine: str = "fast"
) -> float:
    """Epsilon of ``event`` (PLD-supported) at ``delta``: the smaller of two upper bounds, PLD
    (``direct_pld_epsilon``; left out where it would hold more than ``MAX_PLD_WINDOW`` values)
    and RDP. PLD is the smaller one for all but very long schedules; the calibration, the ledger
    and ``event_epsilon`` all read this one function.

    Parameters
    ----------
    event, delta, interval : DpEvent, float, float
        The event, the δ at which ε is read and the PLD grid.
    engine : str, default "fast"
        ``"fast"`` or ``"public"``.

    Returns
    -------
    float
        The smaller of PLD's and RDP's ε.

    Raises
    ------
    ValueError
        An unknown ``engine``.
    """
    pld = (
        pld_epsilon(event, delta, interval, engine)
        if pld_size(event, interval, engine=engine) <= MAX_PLD_WINDOW
        else math.inf
    )
    return with_rdp(pld, event, delta, engine)


def pld_too_large(event: dp_accounting.DpEvent) -> bool:
    """Whether ``event`` is one dp-accounting's PLD accountant supports but whose PLD would not
    fit (``pld_tractable``), so that the accountant composes it with RDP instead.

    Parameters
    ----------
    event : DpEvent
        The event.

    Returns
    -------
    bool
        PLD supports it but it is not ``pld_tractable``.
    """
    return (
        isinstance(event, dp_accounting.DpEvent)
        and pld_accountant().supports(event)
        and not pld_tractable(event)
    )


def pld_supports(event: dp_accounting.DpEvent) -> bool:
    """dp-accounting's PLD accountant supports ``event`` and its PLD fits (``pld_tractable``);
    otherwise the accountant is RDP.

    Parameters
    ----------
    event : DpEvent
        The event (the answer is cached).

    Returns
    -------
    bool
        PLD supports it and it is ``pld_tractable``.
    """
    key = event_key(event)
    if key not in _PLD_SUPPORTS:
        if len(_PLD_SUPPORTS) > 4096:
            _PLD_SUPPORTS.clear()
        _PLD_SUPPORTS[key] = pld_accountant().supports(event) and pld_tractable(event)
    return _PLD_SUPPORTS[key]


def forget_all() -> None:
    """Empty every cache of the accounting (this module's and ``pld_fast``'s): a fresh
    process's state. Every epsilon is a function of the events alone, so nothing changes."""
    forget()
    for cache in (_RDP_VECTORS, _SIZES, _PLD_SUPPORTS):
        cache.clear()
