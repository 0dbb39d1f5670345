"""The PLD engine: dp-accounting's own computation, with what does not change kept.

This is the only module of fedudp that reads dp-accounting's private names
(``tests/privacy/test_accountant_seam.py`` checks it). Each one, and why:

``PLDAccountant._pld`` (assigned)
    ``_captured`` swaps an accountant's running PLD for a collector, so that the PLDs
    dp-accounting builds for a leaf event are kept and reused (composing them is the cheap part).
``PLDAccountant._contains_non_dp_event``
    read after that capture: whether the event was non-private (ε = ∞).
``PLDAccountant._maybe_compose`` (overridden), ``PLDAccountant._value_discretization_interval``
    ``MemoPLDAccountant``: ``calibrate_dp_mechanism`` gets an accountant that records the events
    instead of composing them, and answers through the caller's memoized ε.
``PrivacyLossDistribution._pmf_remove``, ``._pmf_add``, ``._symmetric``
    the two dominating pairs of a Poisson-sampled Gaussian's PLD, self-composed here.
``PLDPmf._probs``, ``._infinity_mass``, ``._discretization``, ``._lower_loss``,
``._pessimistic_estimate``
    a dense PMF's fields: ``_SelfCompositions`` runs dp-accounting's self-composition (its
    Chernoff window, the FFT, the tail mass) with the count-free work done once.
``pld_pmf._get_epsilon_for_delta``
    dp-accounting's ε of a PMF, fed after the pessimistic trim of its upper tail.
``pld_pmf._MAX_PMF_SPARSE_SIZE``
    when a sparse PMF's self-composition turns dense (``sparse_goes_dense``).

Where dp-accounting's layout differs (another version), each fast path falls back to
dp-accounting's public computation (``_NotCaptured``, ``FastPLD.dense``). The same numbers from
the public API alone: ``engine="public"`` of ``fedudp.privacy.accountant.Accountant``.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting.pld import pld_pmf, pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as _PLD
from scipy import fft as _fft
from scipy import special as _special

__all__ = [
    "RELATION",
    "FastPLD",
    "MemoPLDAccountant",
    "direct_pld_epsilon",
    "event_key",
    "fast_atom",
    "fast_epsilon",
    "fast_pld",
    "forget",
    "lru_get",
    "pld_accountant",
    "raw_sampled_gaussian",
    "sampled_gaussian",
    "sparse_goes_dense",
]

RELATION = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def pld_accountant(interval: float = 1e-4) -> pld_privacy_accountant.PLDAccountant:
    """A fresh dp-accounting ``PLDAccountant`` under ``ADD_OR_REMOVE_ONE`` at grid ``interval``.

    Parameters
    ----------
    interval : float, default 1e-4
        The PLD grid.

    Returns
    -------
    dp_accounting.pld.PLDAccountant
        An empty accountant.
    """
    return pld_privacy_accountant.PLDAccountant(RELATION, value_discretization_interval=interval)


# -- the PLD engine: dp-accounting's own computation, with what does not change kept -----------
# A PLDAccountant composing ``event`` builds one PrivacyLossDistribution per leaf event (for a
# Poisson-sampled Gaussian run of c rounds: ``from_gaussian_mechanism(z, sampling_prob=q)
# .self_compose(c)``), composes them onto ``identity`` and reads epsilon. ``direct_pld_epsilon``
# does exactly that (bit for bit, tests/privacy/test_accountant.py) but builds each sampled
# Gaussian's PLD once; everything else is built by dp-accounting's own PLDAccountant.


def lru_get(cache: OrderedDict, key: Any, make: Callable[[], Any], size: int) -> Any:
    """``cache[key]``, made by ``make()`` when absent; at most ``size`` entries (least recent out).

    Parameters
    ----------
    cache : OrderedDict
        The cache, updated in place.
    key, make : hashable, callable
        The entry's key; what builds its value.
    size : int
        The most entries kept.

    Returns
    -------
    object
        The cached or new value.
    """
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = make()
    cache[key] = value
    while len(cache) > size:
        cache.popitem(last=False)
    return value


_RAW: OrderedDict = OrderedDict()  # (q, z, interval) -> PrivacyLossDistribution
_CAPTURED: OrderedDict = OrderedDict()  # (event, count, interval) -> (parts, non-private)
_EPSILON: OrderedDict = OrderedDict()  # (event, delta, interval) -> epsilon (pure function)
_FAST: OrderedDict = OrderedDict()  # (q, z, interval) -> FastPLD


def forget() -> None:
    """Empty this module's caches (a fresh process's state; the numbers do not depend on them)."""
    for cache in (_RAW, _CAPTURED, _EPSILON, _FAST):
        cache.clear()


def event_key(event: dp_accounting.DpEvent) -> str:
    """A hashable, exact name for an event (dp-accounting's events are attrs classes whose repr
    lists every field; floats repr exactly).

    Parameters
    ----------
    event : DpEvent
        The event.

    Returns
    -------
    str
        Its ``repr``.
    """
    return repr(event)


def sampled_gaussian(event: dp_accounting.DpEvent) -> tuple[float, float] | None:
    """(q, z) of a ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` (q = 0 and z = 0 excluded:
    dp-accounting composes nothing, or a non-private event).

    Parameters
    ----------
    event : DpEvent
        The event.

    Returns
    -------
    tuple of float or None
        (q, z), or None for any other event.
    """
    if (
        isinstance(event, dp_accounting.PoissonSampledDpEvent)
        and isinstance(event.event, dp_accounting.GaussianDpEvent)
        and event.sampling_probability != 0
        and event.event.noise_multiplier != 0
    ):
        return float(event.sampling_probability), float(event.event.noise_multiplier)
    return None


def raw_sampled_gaussian(q: float, z: float, interval: float) -> _PLD.PrivacyLossDistribution:
    """The PLD dp-accounting's PLDAccountant builds for one ``PoissonSampledDpEvent(q,
    GaussianDpEvent(z))`` before self-composing it (its own code path, argument for argument).

    Parameters
    ----------
    q, z, interval : float
        Sampling rate, noise multiplier and PLD grid.

    Returns
    -------
    PrivacyLossDistribution
        The one-release PLD (the last four kept).
    """
    return lru_get(
        _RAW,
        (q, z, interval),
        lambda: _PLD.from_gaussian_mechanism(
            standard_deviation=z,
            value_discretization_interval=interval,
            sampling_prob=q,
            neighboring_relation=RELATION,
        ),
        4,
    )


class _NotCaptured(RuntimeError):
    """dp-accounting's PLDAccountant did not compose through ``_Capture`` (another version)."""


class _Capture:
    """Stands in for a PLDAccountant's running PLD: collects the PLDs it would compose."""

    def __init__(self) -> None:
        self.parts: list = []

    def compose(
        self, pld: _PLD.PrivacyLossDistribution, tail_mass_truncation: float | None = None
    ) -> _Capture:
        self.parts.append(pld)
        return self


def _captured(event: dp_accounting.DpEvent, count: int, interval: float) -> tuple[tuple, bool]:
    """The PLDs dp-accounting's PLDAccountant composes for ``count`` x ``event`` (a leaf event),
    built by that accountant itself, and whether it marked the event non-private."""

    def make():
        acc = pld_accountant(interval)
        cap = _Capture()
        acc._pld = cap  # collect instead of composing
        acc.compose(event, count)
        non_private = bool(getattr(acc, "_contains_non_dp_event", False))
        if acc._pld is not cap or not (cap.parts or non_private):
            # another dp-accounting layout: nothing was captured (never read that as ε = 0)
            raise _NotCaptured(repr(event))
        return tuple(cap.parts), non_private

    return lru_get(_CAPTURED, (event_key(event), count, interval), make, 4)


def _pld_parts(event: dp_accounting.DpEvent, interval: float, count: int, parts: list) -> bool:
    """PLDAccountant._maybe_compose's traversal: append the PLDs composing ``count`` x ``event``
    to ``parts``; True if a non-private event was met."""
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return False
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        return True
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return _pld_parts(event.event, interval, event.count * count, parts)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        non_private = False
        for e in event.events:
            non_private |= _pld_parts(e, interval, count, parts)
        return non_private
    qz = sampled_gaussian(event)
    if qz is not None:  # from_gaussian_mechanism(z, sampling_prob=q).self_compose(count)
        parts.append(fast_pld(*qz, interval).self_composed(count))
        return False
    sub, non_private = _captured(event, count, interval)
    parts.extend(sub)
    return non_private


def direct_pld_epsilon(event: dp_accounting.DpEvent, delta: float, interval: float) -> float:
    """``PLDAccountant(ADD_OR_REMOVE_ONE, interval).compose(event).get_epsilon(delta)``, the
    same numbers (memoized; a sampled Gaussian's PLD built once).

    Parameters
    ----------
    event : DpEvent
        The event, PLD-supported.
    delta, interval : float
        The δ at which ε is read; the PLD grid.

    Returns
    -------
    float
        ε (inf for a non-private part).
    """

    def make():
        parts: list = []
        try:
            if _pld_parts(event, interval, 1, parts):
                return math.inf
        except _NotCaptured:  # dp-accounting's own accountant, on the whole event
            acc = pld_accountant(interval)
            acc.compose(event)
            return float(acc.get_epsilon(delta))
        pld = _PLD.identity(value_discretization_interval=interval)
        for p in parts:
            pld = pld.compose(p)
        return float(pld.get_epsilon_for_delta(delta))

    return lru_get(_EPSILON, (event_key(event), float(delta), float(interval)), make, 4096)


# -- long runs of one sampled Gaussian: dp-accounting's self-composition, count after count ------
_TAIL = 1e-15  # dp-accounting's tail_mass_truncation in self_compose
# Where a self-composition's upper tail holds at most this fraction of delta (positive mass,
# FFT noise included), it is moved to infinite loss (pessimistic: delta(eps) can only grow, by
# at most this, so epsilon moves by ~1e-6 of d(eps)/d(log delta)): dp-accounting's epsilon
# search then does not walk through ~1e5 entries of rounding noise.
_TRIM = 1e-6


def _power(f: np.ndarray, k: int) -> np.ndarray:
    """f**k by repeated squaring: a fixed sequence of products for each k (so the same numbers
    whenever k is asked), about twice as fast here as numpy's complex power."""
    out: np.ndarray | None = None
    base = f
    while k:
        if k & 1:
            out = base.copy() if out is None else out * base
        k >>= 1
        if k:
            base = base * base
    assert out is not None, "k >= 1"
    return out


class _SelfCompositions:
    """``DensePLDPmf.self_compose(k)`` of one dense PMF for many k: dp-accounting's algorithm
    (common.self_convolve: Chernoff bounds on the k-fold sum from the log-MGF at 40 orders, an
    FFT of the PMF raised to the k-th power, the bounded window, the tail mass added to the
    infinite loss), with the count-free work (log-MGFs, the forward FFT) done once.
    ``exact(k)``: dp-accounting's numbers bit for bit; ``compose(k)``: the same PMF up to
    floating-point rounding (a real FFT, one length per dyadic block of counts, powers by
    squaring), about twice as fast."""

    def __init__(self, pmf: pld_pmf.PLDPmf) -> None:
        self.pmf = pmf
        probs = pmf._probs
        n = len(probs)
        self.orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / n
        self.log_mgfs = [_special.logsumexp(np.arange(n) * o, b=probs) for o in self.orders]
        self._fft: tuple = (0, None)  # (length, complex FFT) for exact()
        self._rfft: tuple = (0, None)  # (length, real FFT) for compose()

    def bounds(self, k: int) -> tuple[int, int]:
        """common.compute_self_convolve_bounds(probs, k, 1e-15), from the cached log-MGFs."""
        upper, lower = (len(self.pmf._probs) - 1) * k, 0
        for order, log_mgf in zip(self.orders, self.log_mgfs):
            bound = (k * log_mgf + math.log(2 / _TAIL)) / order
            if not math.isfinite(bound):
                continue
            if order > 0:
                upper = min(upper, math.ceil(bound))
            if order < 0:
                lower = max(lower, math.floor(bound))
        return lower, upper

    def _pmf(self, k: int, lo: int, window: np.ndarray) -> pld_pmf.PLDPmf:
        pmf = self.pmf
        inf_mass = _TAIL - math.expm1(k * math.log1p(-pmf._infinity_mass))
        return pld_pmf.DensePLDPmf(
            pmf._discretization,
            pmf._lower_loss * k + lo,
            window,
            inf_mass,
            pmf._pessimistic_estimate,
        )

    def exact(self, k: int) -> pld_pmf.PLDPmf:
        """``self.pmf.self_compose(k)``, the same operations on the same numbers."""
        probs = self.pmf._probs
        lo, hi = self.bounds(k)
        out_len = hi - lo + 1
        n_fft = _fft.next_fast_len(max(out_len, len(probs)))
        if self._fft[0] != n_fft:
            self._fft = (n_fft, _fft.fft(probs, n_fft))
        conv = np.real(_fft.ifft(self._fft[1] ** k))
        return self._pmf(k, lo, np.array(np.roll(conv, -lo)[:out_len]))

    def compose(self, k: int) -> pld_pmf.PLDPmf:
        probs = self.pmf._probs
        lo, hi = self.bounds(k)
        out_len = hi - lo + 1
        lo2, hi2 = self.bounds(1 << (k - 1).bit_length())
        n_fft = _fft.next_fast_len(max(out_len, hi2 - lo2 + 1, len(probs)), real=True)
        if self._rfft[0] != n_fft:
            self._rfft = (n_fft, _fft.rfft(probs, n_fft))
        conv = _fft.irfft(_power(self._rfft[1], k), n_fft)
        return self._pmf(k, lo, np.roll(conv, -lo)[:out_len])


def _trimmed_epsilon(pmf: pld_pmf.PLDPmf, delta: float) -> float:
    """dp-accounting's epsilon of ``pmf`` (``DensePLDPmf.get_epsilon_for_delta``: the same
    function on the same numbers, fed Python floats, which it walks twice as fast) after the
    pessimistic trim of its upper tail (``_TRIM``)."""
    probs = pmf._probs
    inf_mass = pmf._infinity_mass
    top = np.cumsum(np.clip(probs[::-1], 0.0, None))
    j = min(int(np.searchsorted(top, _TRIM * delta, side="right")), len(probs) - 1)
    if j > 0:
        probs, inf_mass = probs[: len(probs) - j], inf_mass + float(top[j - 1])
    disc = pmf._discretization
    upper_loss = (pmf._lower_loss + len(probs) - 1) * disc
    return float(
        pld_pmf._get_epsilon_for_delta(
            inf_mass, itertools.count(upper_loss, -disc), probs[::-1].tolist(), delta
        )
    )


class FastPLD:
    """k-fold ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` for many k: both dominating pairs
    (remove, add) of dp-accounting's PLD, self-composed as dp-accounting does. The add pair's
    epsilon (far below the remove pair's for small q) is computed only where its value at the
    next power of two does not already lie below the remove pair's (epsilon of either pair
    grows with the count, so that value bounds it).

    Parameters
    ----------
    q, z, interval : float
        Sampling rate, noise multiplier and PLD grid.

    Attributes
    ----------
    raw : PrivacyLossDistribution
        The one-release PLD (``raw_sampled_gaussian``).
    dense : bool
        Its PMFs are dense: ``epsilon`` is available.
    """

    def __init__(self, q: float, z: float, interval: float) -> None:
        raw = raw_sampled_gaussian(q, z, interval)
        self.raw = raw
        try:  # dp-accounting 0.6's PMF internals; another layout: its own public code path
            pmfs = [raw._pmf_remove] + ([] if raw._symmetric else [raw._pmf_add])
            # sparse PMFs (a few losses, e.g. huge noise) self-compose by dp-accounting's own code
            self.dense = all(
                isinstance(p, pld_pmf.DensePLDPmf) and hasattr(p, "_probs") for p in pmfs
            )
        except AttributeError:
            pmfs, self.dense = [], False
        dense_sides = [_SelfCompositions(p) for p in pmfs] if self.dense else []
        sides: list[_SelfCompositions | None] = list(dense_sides) if self.dense else [None, None]
        self.remove, self.add = sides[0], (sides[1] if len(sides) > 1 else None)
        self._add_at: dict = {}
        self._pmfs = pmfs
        # each pair as the dense PMF dp-accounting self-composes it as (a sparse one turns dense
        # once its k-fold sum could hold more than _MAX_PMF_SPARSE_SIZE values): for the size of
        # a k-fold composition (``window``) and for long runs of a sparse PMF
        self._dense_sides = (
            dense_sides if self.dense else [_SelfCompositions(p.to_dense_pmf()) for p in pmfs]
        )

    def window(self, k: int) -> int:
        """Values of the k-fold composition's largest PMF (dp-accounting's own bounds; 0 when
        its PMF layout is unknown here)."""
        sides = getattr(self, "_dense_sides", ())
        return max((b[1] - b[0] + 1 for b in (s.bounds(k) for s in sides)), default=0)

    def self_composed(self, k: int) -> _PLD.PrivacyLossDistribution:
        """The PLD dp-accounting's PLDAccountant composes for k releases (bit for bit)."""
        if not self.dense:
            if not getattr(self, "_pmfs", ()):
                return self.raw.self_compose(k)
            # SparsePLDPmf.self_compose(k), without its test size**k (a number of k digits:
            # 9 s at k = 1e7) nor, for one loss, its k - 1 compositions one by one
            return _PLD.PrivacyLossDistribution(
                *(
                    s.exact(k) if sparse_goes_dense(p, k) else p.self_compose(k)
                    for p, s in zip(self._pmfs, self._dense_sides)
                )
            )
        assert self.remove is not None  # dense: both sides built
        if self.add is None:
            return _PLD.PrivacyLossDistribution(self.remove.exact(k))
        return _PLD.PrivacyLossDistribution(self.remove.exact(k), self.add.exact(k))

    def _add_epsilon(self, k: int, delta: float) -> float:
        key = (k, delta)
        if key not in self._add_at:
            assert self.add is not None  # called only for an asymmetric pair
            self._add_at[key] = _trimmed_epsilon(self.add.compose(k), delta)
        return self._add_at[key]

    def epsilon(self, k: int, delta: float) -> float:
        """Epsilon of k releases at ``delta``: the remove pair's, or the add pair's if larger."""
        assert self.remove is not None  # dense only (the caller checks ``dense``)
        eps = _trimmed_epsilon(self.remove.compose(k), delta)
        if self.add is None:
            return eps
        if self._add_epsilon(1 << (k - 1).bit_length(), delta) <= eps:
            return eps
        return max(eps, _trimmed_epsilon(self.add.compose(k), delta))


def sparse_goes_dense(pmf: pld_pmf.PLDPmf, k: int) -> bool:
    """Whether ``SparsePLDPmf.self_compose(k)`` converts to dense (its test
    ``size ** k > _MAX_PMF_SPARSE_SIZE``, decided without computing the power); a one-value PMF
    is also composed densely beyond a thousand rounds (the same point mass).

    Parameters
    ----------
    pmf : PLDPmf
        One side's PMF.
    k : int
        The self-compositions.

    Returns
    -------
    bool
        The k-fold composition is computed densely.
    """
    if not isinstance(pmf, pld_pmf.SparsePLDPmf) or k <= 1:
        return False
    size, cap = pmf.size, pld_pmf._MAX_PMF_SPARSE_SIZE
    if size <= 1:
        return k > 1000
    return k > cap.bit_length() or size**k > cap


def fast_atom(event: dp_accounting.DpEvent) -> tuple[float, float, int] | None:
    """(q, z, m) when one ``event`` is m releases of a Poisson-sampled Gaussian (possibly inside
    ``SelfComposedDpEvent``s), else None.

    Parameters
    ----------
    event : DpEvent
        The event.

    Returns
    -------
    tuple of (float, float, int) or None
        (q, z, m), or None.
    """
    m = 1
    while isinstance(event, dp_accounting.SelfComposedDpEvent):
        m *= event.count
        event = event.event
    qz = sampled_gaussian(event)
    return None if qz is None or m < 1 else (qz[0], qz[1], m)


def fast_pld(q: float, z: float, interval: float) -> FastPLD:
    """The ``FastPLD`` of a sampled Gaussian (q, z) at grid ``interval`` (the last two kept).

    Parameters
    ----------
    q, z, interval : float
        Sampling rate, noise multiplier and PLD grid.

    Returns
    -------
    FastPLD
        The cached or new one.
    """
    return lru_get(_FAST, (q, z, interval), lambda: FastPLD(q, z, interval), 2)


def fast_epsilon(q: float, z: float, k: int, delta: float, interval: float) -> float | None:
    """Epsilon of k releases of the sampled Gaussian (``FastPLD``); None for a sparse PLD.

    Parameters
    ----------
    q, z, k : float, float, int
        Sampling rate, noise multiplier and the number of releases.
    delta, interval : float
        The δ at which ε is read; the PLD grid.

    Returns
    -------
    float or None
        ε, or None where the PLD is sparse.
    """
    fast = fast_pld(q, z, interval)
    return fast.epsilon(k, delta) if fast.dense else None


class MemoPLDAccountant(pld_privacy_accountant.PLDAccountant):
    """dp-accounting's PLDAccountant for ``calibrate_dp_mechanism``, answering through
    ``epsilon_of`` (the caller's bounded, memoized ε of the composed events: Brent's method
    re-evaluates the bracket's ends that the bracket search computed, and the run's accountant
    reuses the calibrated noise's PLD).

    Parameters
    ----------
    interval : float
        The PLD grid (``value_discretization_interval``).
    epsilon_of : callable
        ``epsilon_of(event, delta, interval)``: ε of the composed event at ``delta``.
    """

    def __init__(
        self, interval: float, epsilon_of: Callable[[dp_accounting.DpEvent, float, float], float]
    ) -> None:
        super().__init__(RELATION, value_discretization_interval=interval)
        self._events: list = []
        self._epsilon_of = epsilon_of

    def _maybe_compose(self, event, count, do_compose):
        if do_compose:
            self._events.append(
                event if count == 1 else dp_accounting.SelfComposedDpEvent(event, count)
            )
        return super()._maybe_compose(event, count, False)

    def get_epsilon(self, target_delta: float) -> float:
        """ε at ``target_delta`` of the events composed so far (0 for none)."""
        if not self._events:
            return 0.0
        ev = (
            self._events[0]
            if len(self._events) == 1
            else dp_accounting.ComposedDpEvent(self._events)
        )
        return self._epsilon_of(ev, target_delta, self._value_discretization_interval)
