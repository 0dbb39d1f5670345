"""Privacy accounting on Google's dp-accounting (docs/algorithms.md#privacy-accounting).

* ``Accountant`` composes the ``DpEvent`` of every release with a ``PLDAccountant``
  (primary; tight for Poisson-sampled Gaussians) and an ``RdpAccountant`` (cross-check),
  both under ``ADD_OR_REMOVE_ONE`` at the stated unit. No RDP formula is written here.
* ``calibrate_noise_multiplier`` finds the smallest noise multiplier z = sigma / C whose
  whole schedule (all rounds, the sampling rate) stays within the target (epsilon, delta),
  with ``dp_accounting.calibrate_dp_mechanism`` over a PLD accountant.
* ``Ledger`` records, per round, what was released: unit, adjacency, sigma, epsilon so far.

Bounded work (``_bounded_epsilon``): epsilon of a composition is the smaller of PLD's and RDP's
(both upper bounds); PLD is left out where its PMF would exceed ``MAX_PLD_WINDOW`` values or a
sampled Gaussian's PLD ``MAX_PLD_BUILD`` (very long schedules, tiny noise), so any (epsilon,
delta, rounds, q) answers in seconds (docs/algorithms.md#events-and-accountants).

Cost per round (docs/results/ledger/README.md): the PLD of an event is built once (the
expensive part of dp-accounting's Poisson-sampled Gaussian), a state's epsilon is computed
once (the budget check before a round and the ledger after it ask the same question), and a
long run of one event is read off a grid of counts on which epsilon is computed (an upper
envelope within ``LEDGER_TOL`` of the exact value, the exact value wherever it decides the
budget); see ``Accountant``.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting.pld import pld_pmf, pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as _PLD
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import fft as _fft
from scipy import special as _special

from fedudp.errors import ConfigError

ADJACENCY = "add_or_remove_one"
_RELATION = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
# Noise multipliers beyond this are treated as "target unreachable" (the run would be noise).
MAX_NOISE_MULTIPLIER = 1e4
MIN_NOISE_MULTIPLIER = 1e-6  # calibration below it: the target does not need noise
# The ledger's epsilon after c rounds of one event is at most this much above dp-accounting's
# direct computation of those c rounds (the grid's envelope, ``Accountant``); exact up to
# ``EXACT_ROUNDS`` rounds of a run and wherever it would exceed the target.
LEDGER_TOL = 1e-3
EXACT_ROUNDS = 32


class BudgetError(ConfigError):
    """The target (epsilon, delta) cannot be met by the configured schedule (a user error)."""


@dataclass(frozen=True)
class ApproxDp:
    """An (epsilon, delta)-DP block that dp-accounting 0.6 has no event for
    (docs/algorithms.md#blocks-without-a-dp-accounting-event): AboveThreshold's pure budget, a failure probability that enters delta (ASI's
    zeta, a concentration check passing wrongly), Esfandiari's (4ε, 4δ) sampler. Blocks
    compose with everything else by basic composition (``basic_composition``)."""

    epsilon: float
    delta: float = 0.0

    def __post_init__(self) -> None:
        if not (self.epsilon >= 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"block epsilon must be finite and >= 0, got {self.epsilon}")
        if not 0 <= self.delta < 1:
            raise ValueError(f"block delta must be in [0, 1), got {self.delta}")

    def __str__(self) -> str:
        return f"ApproxDp(epsilon={self.epsilon:.6g}, delta={self.delta:.3g})"


@dataclass(frozen=True)
class Parallel:
    """One round's releases on disjoint parts of the data (each owner's users under
    ``privacy.placement=local_dpsgd``): a unit is in one part only, so the run's ε is the worst
    part's (parallel composition). ``parts[i]`` is part i's event for one round."""

    parts: tuple

    def __str__(self) -> str:
        return "Parallel(" + ", ".join(str(p) for p in self.parts) + ")"


def basic_composition(blocks: list[tuple[ApproxDp, int]] | list[ApproxDp]) -> ApproxDp:
    """Basic composition (Dwork–Roth Thm 3.16): k mechanisms (ε_i, δ_i)-DP compose to
    (Σε_i, Σδ_i)-DP, adaptively. Entries are blocks or (block, count) pairs."""
    eps = dlt = 0.0
    for b in blocks:
        blk, c = b if isinstance(b, tuple) else (b, 1)
        eps += c * blk.epsilon
        dlt += c * blk.delta
    return ApproxDp(eps, min(dlt, 1.0 - 1e-12))  # delta >= 1: nothing is left for the events


def pld_interval(target_epsilon: float | None) -> float:
    """PLD discretization: 1e-4 up to epsilon 1, coarser (relative 1e-4) above, for speed.

    PLD accounting with a coarser grid stays an upper bound on epsilon (pessimistic)."""
    return 1e-4 * max(1.0, float(target_epsilon or 1.0))


def _pld(interval: float = 1e-4) -> pld_privacy_accountant.PLDAccountant:
    return pld_privacy_accountant.PLDAccountant(_RELATION, value_discretization_interval=interval)


@contextlib.contextmanager
def _quiet_absl():
    """dp-accounting's RDP logs a warning per excluded order; keep the terminal readable."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _rdp() -> rdp_privacy_accountant.RdpAccountant:
    return rdp_privacy_accountant.RdpAccountant(neighboring_relation=_RELATION)


# -- the PLD engine: dp-accounting's own computation, with what does not change kept -----------
# A PLDAccountant composing ``event`` builds one PrivacyLossDistribution per leaf event (for a
# Poisson-sampled Gaussian run of c rounds: ``from_gaussian_mechanism(z, sampling_prob=q)
# .self_compose(c)``), composes them onto ``identity`` and reads epsilon. ``_direct_pld_epsilon``
# does exactly that (bit for bit, tests/privacy/test_accountant.py) but builds each sampled
# Gaussian's PLD once; everything else is built by dp-accounting's own PLDAccountant.


def _lru_get(cache: OrderedDict, key: Any, make: Callable[[], Any], size: int) -> Any:
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
_FAST: OrderedDict = OrderedDict()  # (q, z, interval) -> _FastPLD
_RDP_VECTORS: OrderedDict = OrderedDict()  # event -> RDP at the default orders (None: unsupported)
# (q, z, interval, count) -> the k-fold sampled Gaussian's PLD size (``_pld_size``): a pure
# function, kept so that asking it again (a calibration repeated for the same schedule) does not
# rebuild the PLD only to size it
_SIZES: OrderedDict = OrderedDict()


def _event_key(event: dp_accounting.DpEvent) -> str:
    """A hashable, exact name for an event (dp-accounting's events are attrs classes whose repr
    lists every field; floats repr exactly)."""
    return repr(event)


def _sampled_gaussian(event: dp_accounting.DpEvent) -> tuple[float, float] | None:
    """(q, z) of a ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` (q = 0 and z = 0 excluded:
    dp-accounting composes nothing, or a non-private event)."""
    if (
        isinstance(event, dp_accounting.PoissonSampledDpEvent)
        and isinstance(event.event, dp_accounting.GaussianDpEvent)
        and event.sampling_probability != 0
        and event.event.noise_multiplier != 0
    ):
        return float(event.sampling_probability), float(event.event.noise_multiplier)
    return None


def _raw_sampled_gaussian(q: float, z: float, interval: float) -> _PLD.PrivacyLossDistribution:
    """The PLD dp-accounting's PLDAccountant builds for one ``PoissonSampledDpEvent(q,
    GaussianDpEvent(z))`` before self-composing it (its own code path, argument for argument)."""
    return _lru_get(
        _RAW,
        (q, z, interval),
        lambda: _PLD.from_gaussian_mechanism(
            standard_deviation=z,
            value_discretization_interval=interval,
            sampling_prob=q,
            neighboring_relation=_RELATION,
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
        acc = _pld(interval)
        cap = _Capture()
        acc._pld = cap  # collect instead of composing
        acc.compose(event, count)
        non_private = bool(getattr(acc, "_contains_non_dp_event", False))
        if acc._pld is not cap or not (cap.parts or non_private):
            # another dp-accounting layout: nothing was captured (never read that as ε = 0)
            raise _NotCaptured(repr(event))
        return tuple(cap.parts), non_private

    return _lru_get(_CAPTURED, (_event_key(event), count, interval), make, 4)


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
    qz = _sampled_gaussian(event)
    if qz is not None:  # from_gaussian_mechanism(z, sampling_prob=q).self_compose(count)
        parts.append(_fast_pld(*qz, interval).self_composed(count))
        return False
    sub, non_private = _captured(event, count, interval)
    parts.extend(sub)
    return non_private


def _direct_pld_epsilon(event: dp_accounting.DpEvent, delta: float, interval: float) -> float:
    """``PLDAccountant(ADD_OR_REMOVE_ONE, interval).compose(event).get_epsilon(delta)``, the
    same numbers (memoized; a sampled Gaussian's PLD built once)."""

    def make():
        parts: list = []
        try:
            if _pld_parts(event, interval, 1, parts):
                return math.inf
        except _NotCaptured:  # dp-accounting's own accountant, on the whole event
            acc = _pld(interval)
            acc.compose(event)
            return float(acc.get_epsilon(delta))
        pld = _PLD.identity(value_discretization_interval=interval)
        for p in parts:
            pld = pld.compose(p)
        return float(pld.get_epsilon_for_delta(delta))

    return _lru_get(_EPSILON, (_event_key(event), float(delta), float(interval)), make, 4096)


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


class _FastPLD:
    """k-fold ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` for many k: both dominating pairs
    (remove, add) of dp-accounting's PLD, self-composed as dp-accounting does. The add pair's
    epsilon (far below the remove pair's for small q) is computed only where its value at the
    next power of two does not already lie below the remove pair's (epsilon of either pair
    grows with the count, so that value bounds it)."""

    def __init__(self, q: float, z: float, interval: float) -> None:
        raw = _raw_sampled_gaussian(q, z, interval)
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
                    s.exact(k) if _sparse_goes_dense(p, k) else p.self_compose(k)
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
        assert self.remove is not None  # dense only (the caller checks ``dense``)
        eps = _trimmed_epsilon(self.remove.compose(k), delta)
        if self.add is None:
            return eps
        if self._add_epsilon(1 << (k - 1).bit_length(), delta) <= eps:
            return eps
        return max(eps, _trimmed_epsilon(self.add.compose(k), delta))


def _sparse_goes_dense(pmf: pld_pmf.PLDPmf, k: int) -> bool:
    """Whether ``SparsePLDPmf.self_compose(k)`` converts to dense (its test
    ``size ** k > _MAX_PMF_SPARSE_SIZE``, decided without computing the power); a one-value PMF
    is also composed densely beyond a thousand rounds (the same point mass)."""
    if not isinstance(pmf, pld_pmf.SparsePLDPmf) or k <= 1:
        return False
    size, cap = pmf.size, pld_pmf._MAX_PMF_SPARSE_SIZE
    if size <= 1:
        return k > 1000
    return k > cap.bit_length() or size**k > cap


def _fast_atom(event: dp_accounting.DpEvent) -> tuple[float, float, int] | None:
    """(q, z, m) when one ``event`` is m releases of a Poisson-sampled Gaussian (possibly inside
    ``SelfComposedDpEvent``s), else None."""
    m = 1
    while isinstance(event, dp_accounting.SelfComposedDpEvent):
        m *= event.count
        event = event.event
    qz = _sampled_gaussian(event)
    return None if qz is None or m < 1 else (qz[0], qz[1], m)


def _fast_pld(q: float, z: float, interval: float) -> _FastPLD:
    return _lru_get(_FAST, (q, z, interval), lambda: _FastPLD(q, z, interval), 2)


def _fast_epsilon(q: float, z: float, k: int, delta: float, interval: float) -> float | None:
    """Epsilon of k releases of the sampled Gaussian (``_FastPLD``); None for a sparse PLD."""
    fast = _fast_pld(q, z, interval)
    return fast.epsilon(k, delta) if fast.dense else None


# -- RDP: additive over the orders ---------------------------------------------------------------
def _rdp_vector(event: dp_accounting.DpEvent) -> np.ndarray | None:
    """dp-accounting's RDP of one ``event`` at its default orders (None: unsupported)."""

    def make():
        acc = _rdp()
        if not acc.supports(event):
            return None
        with _quiet_absl():
            acc.compose(event)
        return acc.rdp

    return _lru_get(_RDP_VECTORS, _event_key(event), make, 64)


_RDP_ORDERS: np.ndarray | None = None


def _rdp_runs_epsilon(runs: Sequence[Sequence[Any]], delta: float) -> float | None:
    """RdpAccountant's epsilon of the runs [(event, count), ...] composed in order."""
    global _RDP_ORDERS
    if _RDP_ORDERS is None:
        _RDP_ORDERS = _rdp().orders
    total = np.zeros_like(_RDP_ORDERS, dtype=np.float64)
    for e, c in runs:
        r = _rdp_vector(e)
        if r is None:
            return None
        total += c * r
    with _quiet_absl():
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
        _RDP_ORDERS = _rdp().orders
    return _RDP_ORDERS


def _rdp_event_epsilon(event: dp_accounting.DpEvent, delta: float) -> float | None:
    """RDP epsilon of ``event`` at ``delta`` (``_rdp_total``; None: unsupported)."""
    total = _rdp_total(event)
    if total is None:
        return None
    with _quiet_absl():
        return float(rdp_privacy_accountant.compute_epsilon(_rdp_orders(), total, delta)[0])


def _composed_event(runs: Sequence[Sequence[Any]]) -> dp_accounting.DpEvent:
    parts = [dp_accounting.SelfComposedDpEvent(e, c) for e, c in runs]
    return parts[0] if len(parts) == 1 else dp_accounting.ComposedDpEvent(parts)


# consecutive grid values differ by at most this (room left for the grid values' trim, _TRIM)
_GRID_GAP = 0.99 * LEDGER_TOL


class _Series:
    """Epsilon of ``prefix`` + c x ``event`` (at one delta) for c = 1, 2, ...: exact for
    c <= EXACT_ROUNDS; beyond, the value at the next point of a grid of counts whose consecutive
    values differ by at most _GRID_GAP (an upper envelope: epsilon grows with c), unless that
    value exceeds the threshold (what the budget leaves the events), where the exact value is
    used. The grid depends only on the series (not on which counts were asked, nor in which
    order): a run resumed from a checkpoint reads the very same numbers."""

    def __init__(self, exact: Callable[[int], float], grid_value: Callable[[int], float]) -> None:
        self._exact_fn, self._grid_fn = exact, grid_value
        self._exact: dict[int, float] = {}
        self.grid: list[int] = []
        self.values: list[float] = []

    def exact(self, c: int) -> float:
        if c not in self._exact:
            self._exact[c] = self._exact_fn(c)
        return self._exact[c]

    def _extend(self, c: int) -> None:
        if not self.grid:
            a = EXACT_ROUNDS
            self.grid, self.values = [a - 1, a], [self.exact(a - 1), self.exact(a)]
        while self.grid[-1] < c:
            a0, a = self.grid[-2], self.grid[-1]
            v0, va = self.values[-2], self.values[-1]
            slope = (va - v0) / (a - a0)
            step = min(2 * (a - a0), max(1, a // 8))
            if slope > 0:
                step = min(step, max(1, int(_GRID_GAP / slope)))
            while True:
                vb = self._grid_fn(a + step)
                if vb - va <= _GRID_GAP or step == 1:
                    break
                step = max(1, step // 2)
            self.grid.append(a + step)
            self.values.append(vb)

    def value(self, c: int, threshold: float = math.inf) -> float:
        if c <= EXACT_ROUNDS:
            return self.exact(c)
        self._extend(c)
        v = self.values[bisect.bisect_left(self.grid, c)]
        return self.exact(c) if v > threshold else v


class Accountant:
    """Composes released events; reports epsilon at a delta (PLD, RDP as cross-check).

    Rounds usually release the same event; consecutive identical events are kept as one run
    (``runs``: [event, count]) and epsilon is that of the whole composition, as a fresh
    dp-accounting PLD accountant computes it from the runs (``SelfComposedDpEvent`` each), which
    is how the calibration computed it (incremental PLD composition adds discretization
    pessimism round by round and would not match the calibrated schedule).

    At a small, constant cost per round (docs/results/ledger/README.md):

    * a state's epsilon is computed once (``epsilon_if`` before a round and ``epsilon`` after
      it ask about the same composition), each sampled Gaussian's PLD is built once, and
      ``NoOpDpEvent``s (nothing released) are left out of the computation;
    * after ``EXACT_ROUNDS`` rounds of a run, epsilon is read off a grid of counts of that run
      (``_Series``): an upper bound at most ``LEDGER_TOL`` above the exact value. Where that
      bound would exceed ``target_epsilon`` (the budget check's threshold, ``accountant_for``;
      less the blocks' epsilon) the exact value is computed, so budget stops fall where the
      exact epsilon puts them and a calibrated run is never stopped early by the envelope;
    * a Poisson-sampled Gaussian's grid values come from dp-accounting's self-composition with
      the count-free work done once and a pessimistic trim of the FFT noise in its upper tail
      (``_FastPLD``: never below the direct value up to dp-accounting's own rounding, above it
      by about 1e-6 x d(eps)/d(log delta), a few 1e-6 at most).

    Every number is a function of the composed events alone (not of the order of questions), so
    an accountant recomposed from a checkpoint reports the same epsilon bit for bit.
    """

    def __init__(self, pld_interval: float = 1e-4, target_epsilon: float | None = None) -> None:
        self.pld_interval = pld_interval
        self.target_epsilon = target_epsilon
        self.runs: list[list] = []  # [event, count]
        self.blocks: list[tuple[ApproxDp, int]] = []  # basic composition on top of the events
        self._canon: list[list] = []  # the runs without NoOpDpEvent, neighbours merged
        self._series: OrderedDict = OrderedDict()

    @property
    def events(self) -> list[dp_accounting.DpEvent]:
        return [e for e, c in self.runs for _ in range(c)]

    def supports(self, event: dp_accounting.DpEvent | ApproxDp) -> bool:
        if isinstance(event, ApproxDp):
            return True
        return _pld_supports(event) or _rdp().supports(event)

    @property
    def primary(self) -> str:
        """``pld`` when PLD supports every composed event, else ``rdp`` (e.g. ``ZCDpEvent``
        for pure-DP steps, which dp-accounting's PLD cannot represent;
        docs/algorithms.md#events-and-accountants)."""
        if not self.runs:
            return "pld"
        return "pld" if all(_pld_supports(e) for e, _ in self.runs) else "rdp"

    def composed_event(self) -> dp_accounting.DpEvent | None:
        """Everything composed so far as one ``DpEvent`` (runs of equal events self-composed);
        None when nothing was, or when an ``ApproxDp`` block (no dp-accounting event) was."""
        if self.blocks or not self.runs:
            return None
        return _composed_event(self.runs)

    def compose(self, event: dp_accounting.DpEvent | ApproxDp, count: int = 1) -> None:
        """Compose ``count`` releases of ``event`` (a ``DpEvent`` or an ``ApproxDp`` block)."""
        if isinstance(event, dp_accounting.NonPrivateDpEvent):
            raise ValueError("a non-private release cannot be composed into a DP ledger")
        if isinstance(event, ApproxDp):
            if self.blocks and self.blocks[-1][0] == event:
                self.blocks[-1] = (event, self.blocks[-1][1] + count)
            else:
                self.blocks.append((event, count))
            return
        if not self.supports(event):
            raise dp_accounting.UnsupportedEventError(f"neither PLD nor RDP supports {event}")
        if self.runs and self.runs[-1][0] == event:
            self.runs[-1][1] += count
        else:
            self.runs.append([event, count])
        self._canon = self._with(event, count)

    def _with(
        self, extra: dp_accounting.DpEvent | ApproxDp | None = None, count: int = 1
    ) -> list[list]:
        """The canonical runs (what the computation composes), with ``count`` x ``extra`` more."""
        runs = self._canon
        if extra is None or isinstance(extra, (dp_accounting.NoOpDpEvent, ApproxDp)) or count == 0:
            return runs
        if runs and runs[-1][0] == extra:
            return runs[:-1] + [[extra, runs[-1][1] + count]]
        return runs + [[extra, count]]

    def _split(
        self, delta: float, extra: dp_accounting.DpEvent | ApproxDp | None = None, count: int = 1
    ) -> tuple[float, float]:
        """(events' delta budget, blocks' epsilon) after basic composition of the blocks."""
        blocks = list(self.blocks)
        if isinstance(extra, ApproxDp):
            blocks.append((extra, count))
        b = basic_composition(blocks)
        left = delta - b.delta
        if abs(left) <= delta * 1e-9:  # the blocks spend exactly δ (rounding either way)
            left = 0.0
        return left, b.epsilon

    def _series_for(
        self, prefix: Sequence[Sequence[Any]], event: dp_accounting.DpEvent, delta: float
    ) -> _Series:
        key = (tuple((_event_key(e), c) for e, c in prefix), _event_key(event), delta)
        if key in self._series:
            self._series.move_to_end(key)
            return self._series[key]
        interval = self.pld_interval
        prefix = [tuple(r) for r in prefix]

        def exact(c: int) -> float:
            return _bounded_epsilon(_composed_event(prefix + [(event, c)]), delta, interval)

        atom = None if prefix else _fast_atom(event)

        def grid(c: int) -> float:
            ev = _composed_event([(event, c)])
            if atom is None or _pld_size(ev, interval) > MAX_PLD_WINDOW:
                return exact(c)
            v = _fast_epsilon(atom[0], atom[1], atom[2] * c, delta, interval)
            return exact(c) if v is None else _with_rdp(v, ev, delta)

        s = self._series[key] = _Series(exact, grid)
        while len(self._series) > 8:
            self._series.popitem(last=False)
        return s

    def _events_epsilon(
        self,
        runs: Sequence[Sequence[Any]],
        delta: float,
        rdp_only: bool = False,
        spent: float = 0.0,
    ) -> float | None:
        """Epsilon of the (canonical) runs at ``delta``: PLD, or RDP where PLD cannot represent
        them (or ``rdp_only``); None if neither supports them; inf when delta <= 0. ``spent``:
        the blocks' epsilon (the events' threshold is the target minus it)."""
        if not runs and not self.runs:  # nothing but blocks: fine while they leave δ >= 0
            return 0.0 if delta >= 0 else math.inf
        if delta <= 0:  # events need some δ: none is left
            return math.inf
        if not runs:  # only NoOpDpEvents: nothing released
            return 0.0
        if not rdp_only and all(_pld_supports(e) for e, _ in runs):
            threshold = math.inf if self.target_epsilon is None else self.target_epsilon - spent
            return self._series_for(runs[:-1], runs[-1][0], delta).value(runs[-1][1], threshold)
        return _rdp_runs_epsilon(runs, delta)

    def epsilon(self, delta: float) -> float:
        """Epsilon at ``delta`` of everything composed so far: the events with PLD (RDP for
        events PLD cannot represent) at delta minus the blocks' delta, plus the blocks'
        epsilon (basic composition)."""
        if not self.runs and not self.blocks:
            return 0.0
        d_ev, e_blk = self._split(delta)
        e = self._events_epsilon(self._canon, d_ev, spent=e_blk)
        assert e is not None, "compose() admits only events PLD or RDP supports"
        return float(e) + e_blk

    def epsilon_rdp(self, delta: float) -> float | None:
        """The RDP accountant's (looser) epsilon, as a cross-check; None if unsupported."""
        if not self.runs and not self.blocks:
            return 0.0
        d_ev, e_blk = self._split(delta)
        e = self._events_epsilon(self._canon, d_ev, rdp_only=True)
        return None if e is None else float(e) + e_blk

    def epsilon_if(
        self, event: dp_accounting.DpEvent | ApproxDp, delta: float, count: int = 1
    ) -> float:
        """Epsilon after composing ``event`` ``count`` more times, without composing it."""
        d_ev, e_blk = self._split(delta, event, count)
        runs = self._with(event, count)
        if not self.runs and not runs and not isinstance(event, ApproxDp) and count:
            # only NoOpDpEvents so far and asked about one: events present, nothing released
            return (math.inf if d_ev <= 0 else 0.0) + e_blk
        e = self._events_epsilon(runs, d_ev, spent=e_blk)
        if e is None:
            raise TypeError(f"neither PLD nor RDP supports {event}")
        return float(e) + e_blk


class ParallelAccountant:
    """``Accountant``'s interface over ``Parallel`` events: one accountant per part, ε the max."""

    def __init__(
        self, parts: int, pld_interval: float = 1e-4, target_epsilon: float | None = None
    ) -> None:
        self.parts = [Accountant(pld_interval, target_epsilon) for _ in range(parts)]

    def compose(self, event: dp_accounting.DpEvent | ApproxDp | Parallel, count: int = 1) -> None:
        if isinstance(event, ApproxDp):
            for a in self.parts:
                a.compose(event, count)
            return
        if not isinstance(event, Parallel) or len(event.parts) != len(self.parts):
            raise ValueError(f"expected a Parallel event of {len(self.parts)} parts, got {event}")
        for a, e in zip(self.parts, event.parts):
            a.compose(e, count)

    def epsilon(self, delta: float) -> float:
        return max(a.epsilon(delta) for a in self.parts)

    def epsilon_rdp(self, delta: float) -> float | None:
        eps = [e for a in self.parts if (e := a.epsilon_rdp(delta)) is not None]
        return None if len(eps) < len(self.parts) else max(eps)

    def epsilon_if(self, event: Parallel, delta: float, count: int = 1) -> float:
        return max(a.epsilon_if(e, delta, count) for a, e in zip(self.parts, event.parts))

    def part_epsilons(self, delta: float) -> list[float]:
        return [a.epsilon(delta) for a in self.parts]


@dataclass(frozen=True)
class GroupConversion:
    """User level from record level by group privacy (docs/algorithms.md#group-privacy; Huang et al.
    (001) Lemma 3.6): a mechanism (ε', δ')-DP for one-record changes is, for the ``size`` = k
    records of one user, (kε', k·e^{(k−1)ε'}·δ')-DP (the standard form, ``form="certified"``)
    or, as Huang et al. write it, (kε', k·e^{kε'}·δ') (``form="paper"``).

    ``for_user_budget`` picks the record-level (ε/k, δ') that yields the user-level target:
    certified δ' = δ / (k·e^{(k−1)ε/k}), the exact inverse of the standard form (at k = 1 it is
    δ); paper δ' = δ·r/m = δ/k as in the paper, which by its own form only gives user-level
    (ε, e^ε·δ): heuristic."""

    size: int
    record_delta: float
    form: str = "certified"

    @classmethod
    def for_user_budget(cls, size: int, epsilon: float, delta: float, form: str) -> GroupConversion:
        if size < 1:
            raise ValueError(f"group size must be >= 1, got {size}")
        if form not in ("certified", "paper"):
            raise ValueError(f"form must be certified or paper, got {form}")
        k = int(size)
        rd = delta / (k * math.exp((k - 1) * epsilon / k)) if form == "certified" else delta / k
        return cls(k, rd, form)

    def user_epsilon(self, record_epsilon: float) -> float:
        return self.size * record_epsilon

    def record_epsilon(self, user_epsilon: float) -> float:
        """The record-level ε' whose conversion is ``user_epsilon`` (what the noise is
        calibrated to, and whose PLD grid the ledger accounts on)."""
        return user_epsilon / self.size

    def user_delta(self, record_epsilon: float) -> float:
        """The user-level δ that group privacy gives at record level (record_epsilon, δ')."""
        k, e = self.size, record_epsilon
        return k * math.exp(((k - 1) if self.form == "certified" else k) * e) * self.record_delta

    def __str__(self) -> str:
        return (
            f"GroupConversion(k={self.size}, record_delta={self.record_delta:.6g}, "
            f"form={self.form})"
        )


class GroupAccountant:
    """An accountant at record level read at user level through a ``GroupConversion``: events
    are composed record-level by ``inner`` (``Accountant`` or ``ParallelAccountant``); epsilon
    at the user-level δ is k times the record-level epsilon at the conversion's δ'."""

    def __init__(self, inner: Accountant | ParallelAccountant, group: GroupConversion) -> None:
        self.inner, self.group = inner, group

    def compose(self, event: dp_accounting.DpEvent | ApproxDp | Parallel, count: int = 1) -> None:
        self.inner.compose(event, count)

    def epsilon(self, delta: float) -> float:
        return self.group.user_epsilon(self.inner.epsilon(self.group.record_delta))

    def epsilon_rdp(self, delta: float) -> float | None:
        e = self.inner.epsilon_rdp(self.group.record_delta)
        return None if e is None else self.group.user_epsilon(e)

    def epsilon_if(
        self, event: dp_accounting.DpEvent | ApproxDp | Parallel, delta: float, count: int = 1
    ) -> float:
        # accountant_for pairs a ParallelAccountant with Parallel events only
        eps = self.inner.epsilon_if(event, self.group.record_delta, count)  # type: ignore[arg-type]
        return self.group.user_epsilon(eps)

    def record_epsilon(self) -> float:
        return self.inner.epsilon(self.group.record_delta)


def event_epsilon(
    event: dp_accounting.DpEvent | None,
    delta: float,
    interval: float = 1e-4,
    rdp_only: bool = False,
) -> float | None:
    """Epsilon of one (composed) event at ``delta``: PLD, or RDP for events PLD cannot
    represent (or when ``rdp_only``); None if neither supports it, inf when delta <= 0.
    PLD: the numbers of a fresh ``PLDAccountant`` (``_direct_pld_epsilon``, memoized)."""
    if event is None:  # nothing but blocks: fine while they leave δ >= 0
        return 0.0 if delta >= 0 else math.inf
    if delta <= 0:  # events need some δ: none is left
        return math.inf
    if not rdp_only and _pld_supports(event):
        return _bounded_epsilon(event, delta, interval)
    acc = _rdp()
    if not acc.supports(event):
        return None
    with _quiet_absl():
        acc.compose(event)
        return float(acc.get_epsilon(delta))


class _MemoPLDAccountant(pld_privacy_accountant.PLDAccountant):
    """dp-accounting's PLDAccountant for ``calibrate_dp_mechanism``, answering through
    ``_direct_pld_epsilon`` (the same numbers, memoized: Brent's method re-evaluates the
    bracket's ends that the bracket search computed, and the run's accountant reuses the
    calibrated noise's PLD)."""

    def __init__(self, interval: float) -> None:
        super().__init__(_RELATION, value_discretization_interval=interval)
        self._events: list = []

    def _maybe_compose(self, event, count, do_compose):
        if do_compose:
            self._events.append(
                event if count == 1 else dp_accounting.SelfComposedDpEvent(event, count)
            )
        return super()._maybe_compose(event, count, False)

    def get_epsilon(self, target_delta: float) -> float:
        if not self._events:
            return 0.0
        ev = (
            self._events[0]
            if len(self._events) == 1
            else dp_accounting.ComposedDpEvent(self._events)
        )
        return _bounded_epsilon(ev, target_delta, self._value_discretization_interval)


_PLD_SUPPORTS: dict = {}
# A Gaussian's PLD holds about (its privacy-loss range) / (grid interval) values: for noise
# multiplier z the loss ranges over ±(1/(2 z²) + 9.75/z) (dp-accounting's tails), which at
# the finest grid (1e-4) is 1e10 values for z = 0.001 (76 GiB: dp-accounting fails to allocate
# it). Above this many values PLD accounting is not attempted and RDP (an upper bound on ε, as
# PLD's is) is the accountant: such a mechanism is far from any useful target anyway.
MAX_PLD_POINTS = 5 * 10**7


def _gaussian_pld_points(z: float, interval: float = 1e-4) -> float:
    """Estimated size of a Gaussian mechanism's PLD (noise multiplier z, sensitivity 1): at
    most 1.03x dp-accounting's, never below it (tests/privacy/test_accountant.py)."""
    return 2.0 * (1.0 / (2.0 * z * z) + 10.0 / z) / interval


def _pld_tractable(event: dp_accounting.DpEvent) -> bool:
    """Whether every Gaussian inside ``event`` has a PLD of at most ``MAX_PLD_POINTS`` values
    at the finest grid (``_gaussian_pld_points``)."""
    if isinstance(event, dp_accounting.GaussianDpEvent):
        z = float(event.noise_multiplier)
        return z == 0 or _gaussian_pld_points(z) <= MAX_PLD_POINTS  # 0: non-private, no PLD
    if isinstance(
        event,
        (
            dp_accounting.PoissonSampledDpEvent,
            dp_accounting.SampledWithoutReplacementDpEvent,
            dp_accounting.SampledWithReplacementDpEvent,
            dp_accounting.SelfComposedDpEvent,
        ),
    ):
        return _pld_tractable(event.event)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return all(_pld_tractable(e) for e in event.events)
    return True


# A composition of many releases holds more values than one release: dp-accounting's k-fold
# self-composition keeps a window that grows with k (its Chernoff bounds), and its grid's
# pessimism adds up over the k releases (at 1e8 rounds of q = 0.01 its epsilon is 1.7 where RDP
# certifies 1.0). Beyond this many values PLD is not computed: RDP alone bounds epsilon. This
# bounds every epsilon's work (a few seconds) whatever the number of rounds; ordinary
# schedules at their own grid hold 1e5-3e5 values.
MAX_PLD_WINDOW = 2**20
# dp-accounting builds a Poisson-sampled Gaussian's PLD one value at a time in Python (about
# 1-2 s per 2e5 values on a busy 2-core machine): beyond this estimate (``_gaussian_pld_points``;
# noise below about 0.22 at the finest grid) RDP alone bounds epsilon, so no step takes minutes.
# Ordinary calibrations (noise above about 0.45, so that their bracket's lower end z/2 stays
# above 0.22) compute exactly what they did before.
MAX_PLD_BUILD = 10**6


def _pld_size(event: dp_accounting.DpEvent, interval: float, count: int = 1) -> float:
    """About how many values the PLD of ``count`` x ``event`` holds (its largest PMF; the sum
    over a composition's parts); inf where a Gaussian would not fit (``_pld_tractable``)."""
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return _pld_size(event.event, interval, count * event.count)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return sum(_pld_size(e, interval, count) for e in event.events)
    if isinstance(event, dp_accounting.GaussianDpEvent):  # k Gaussians: one of z / sqrt(k)
        z = float(event.noise_multiplier)
        return 0.0 if z == 0 else _gaussian_pld_points(z / math.sqrt(count), interval)
    qz = _sampled_gaussian(event)
    if qz is not None:
        if _gaussian_pld_points(qz[1], interval) > MAX_PLD_BUILD:
            return math.inf
        q, z = qz
        return _lru_get(
            _SIZES,
            (q, z, float(interval), int(count)),
            lambda: float(_fast_pld(q, z, interval).window(count)),
            4096,
        )
    return 0.0


def _with_rdp(pld_epsilon: float, event: dp_accounting.DpEvent, delta: float) -> float:
    rdp = _rdp_event_epsilon(event, delta)
    return pld_epsilon if rdp is None else min(pld_epsilon, rdp)


def _bounded_epsilon(event: dp_accounting.DpEvent, delta: float, interval: float) -> float:
    """Epsilon of ``event`` (PLD-supported) at ``delta``: the smaller of two upper bounds, PLD
    (``_direct_pld_epsilon``; left out where it would hold more than ``MAX_PLD_WINDOW`` values)
    and RDP. PLD is the smaller one for all but very long schedules; the calibration, the ledger
    and ``event_epsilon`` all read this one function."""
    pld = (
        _direct_pld_epsilon(event, delta, interval)
        if _pld_size(event, interval) <= MAX_PLD_WINDOW
        else math.inf
    )
    return _with_rdp(pld, event, delta)


def pld_too_large(event: dp_accounting.DpEvent) -> bool:
    """Whether ``event`` is one dp-accounting's PLD accountant supports but whose PLD would not
    fit (``_pld_tractable``), so that the accountant composes it with RDP instead."""
    return (
        isinstance(event, dp_accounting.DpEvent)
        and _pld().supports(event)
        and not _pld_tractable(event)
    )


def _pld_supports(event: dp_accounting.DpEvent) -> bool:
    """dp-accounting's PLD accountant supports ``event`` and its PLD fits (``_pld_tractable``);
    otherwise the accountant is RDP."""
    key = _event_key(event)
    if key not in _PLD_SUPPORTS:
        if len(_PLD_SUPPORTS) > 4096:
            _PLD_SUPPORTS.clear()
        _PLD_SUPPORTS[key] = _pld().supports(event) and _pld_tractable(event)
    return _PLD_SUPPORTS[key]


def schedule_epsilon(
    make_event: Callable[[float], dp_accounting.DpEvent],
    noise: float,
    rounds: int,
    delta: float,
    interval: float = 1e-4,
) -> float:
    """Epsilon of ``rounds`` self-composed releases of ``make_event(noise)`` (PLD; RDP for
    events PLD cannot represent)."""
    eps = event_epsilon(
        dp_accounting.SelfComposedDpEvent(make_event(noise), rounds), delta, interval
    )
    assert eps is not None, "make_event builds events PLD or RDP supports"
    return eps


def rounds_text(rounds: int) -> str:
    """``1 round``, ``100,000,000 rounds``: a count of rounds as every message prints it."""
    return f"{int(rounds):,} round{'' if int(rounds) == 1 else 's'}"


def calibrate_noise_multiplier(
    make_event: Callable[[float], dp_accounting.DpEvent],
    target_epsilon: float,
    delta: float,
    rounds: int,
    tol: float = 1e-3,
) -> float:
    """Smallest noise multiplier whose ``rounds``-fold schedule meets (target_epsilon, delta).

    ``make_event(z)`` is one round's release. Raises ``BudgetError`` (naming the target)
    when even ``MAX_NOISE_MULTIPLIER`` does not reach it.
    """
    validate_budget(target_epsilon, delta)
    interval = pld_interval(target_epsilon)
    if rounds < 1:
        raise BudgetError(f"train.rounds must be >= 1, got {rounds}")
    if schedule_epsilon(make_event, MAX_NOISE_MULTIPLIER, rounds, delta, interval) > target_epsilon:
        raise BudgetError(
            f"privacy.epsilon={target_epsilon} at privacy.delta={delta} is unreachable in "
            f"{rounds_text(rounds)} even with noise multiplier {MAX_NOISE_MULTIPLIER:g}"
        )

    def event(z: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(make_event(z), rounds)

    if not _pld_supports(event(1.0)):  # pure-DP steps: RDP only
        with _quiet_absl():
            return float(
                dp_accounting.calibrate_dp_mechanism(
                    _rdp,
                    event,
                    target_epsilon,
                    delta,
                    bracket_interval=dp_accounting.LowerEndpointAndGuess(1e-6, 1.0),
                    tol=tol,
                )
            )

    # RDP is an upper bound on epsilon, so its calibration brackets the PLD one from above;
    # it is also fast where PLD is slow (small noise, large epsilon).
    with _quiet_absl():
        z_hi = float(
            dp_accounting.calibrate_dp_mechanism(
                _rdp,
                event,
                target_epsilon,
                delta,
                bracket_interval=dp_accounting.LowerEndpointAndGuess(1e-4, 1.0),
                tol=tol / 10,
            )
        )
    # what is calibrated is the accountant's epsilon (``_bounded_epsilon``: the smaller of PLD
    # and RDP), which at RDP's z is at most RDP's up to the last digit of its composition
    for _ in range(64):
        if (
            eps_hi := schedule_epsilon(make_event, z_hi, rounds, delta, interval)
        ) <= target_epsilon:
            break
        z_hi *= 1 + tol / 10
    else:
        raise BudgetError(
            f"privacy.epsilon={target_epsilon}: the noise calibration did not "
            f"converge in {rounds} rounds at privacy.delta={delta}"
        )

    def delta_too_large() -> BudgetError:
        return BudgetError(
            f"privacy.delta={delta} is too large for this schedule: (epsilon={target_epsilon}, "
            f"delta={delta}) holds for any noise multiplier (e.g. delta >= the sampling "
            "rate); choose delta well below the chance that a user is sampled"
        )

    if eps_hi == 0.0:  # ε = 0 at a finite noise: δ covers the release whatever the noise
        raise delta_too_large()
    if _pld_size(event(z_hi), interval) > MAX_PLD_WINDOW or (
        _direct_pld_epsilon(event(z_hi), delta, interval) > target_epsilon
    ):
        # PLD is not below the target at RDP's z (too long a schedule for its grid, or too
        # large a PLD): below that z RDP exceeds the target and PLD only grows (or stays out),
        # so RDP's z is the smallest that meets it
        return z_hi
    z_lo = z_hi / 2
    while (eps_lo := schedule_epsilon(make_event, z_lo, rounds, delta, interval)) <= target_epsilon:
        # ε = 0 at a finite noise, or no floor in sight: δ covers the release whatever the noise
        if eps_lo == 0.0 or z_lo < MIN_NOISE_MULTIPLIER:
            raise delta_too_large()
        z_hi, z_lo = z_lo, z_lo / 2
    try:
        z = dp_accounting.calibrate_dp_mechanism(
            lambda: _MemoPLDAccountant(interval),
            event,
            target_epsilon,
            delta,
            bracket_interval=dp_accounting.ExplicitBracketInterval(z_lo, z_hi),
            tol=tol,
        )
    except ValueError:  # no sign change seen by Brent's method (rounding at the ends)
        return z_hi  # meets the target (checked above): the safe end of the bracket
    return float(z)


def validate_budget(epsilon: float, delta: float) -> None:
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise BudgetError(f"privacy.epsilon must be a finite number > 0, got {epsilon}")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise BudgetError(f"privacy.delta must be in (0, 1), got {delta}")


@dataclass
class LedgerEntry:
    """One release in the ledger (a line of ``ledger.jsonl``, an entry of ``ledger.json``).

    Attributes
    ----------
    round : int
        The round that released.
    event : str
        The dp-accounting event composed for it, as text.
    noise_multiplier : float or None
        The release's noise multiplier z (None where no single multiplier describes it).
    noise_std : float or None
        The standard deviation of the noise added to the released sum.
    sampling_rate : float
        The privacy units' Poisson sampling rate q of the round.
    epsilon : float or None
        ε of everything released so far, at the ledger's δ (PLD; None without DP).
    epsilon_rdp : float or None
        The same from RDP, the cross-check.
    release_sha256 : str or None
        SHA-256 of the released values (a seeded resume shows a re-release identical by it;
        post-processing of the release, nothing more). None where not recorded.
    superseded : bool
        A release made before a resume whose round was computed again
        (docs/usage.md#checkpoint-and-resume): it was made, so it is composed (``epsilon``
        counts it), but the run continued from the release computed after it.
    """

    round: int
    event: str
    noise_multiplier: float | None
    noise_std: float | None
    sampling_rate: float
    epsilon: float | None
    epsilon_rdp: float | None
    release_sha256: str | None = None
    superseded: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The entry as a ledger line: the optional fields only where they are set."""
        d = asdict(self)
        if d["release_sha256"] is None:
            del d["release_sha256"]
        if not d["superseded"]:
            del d["superseded"]
        return d


@dataclass
class Ledger:
    """Per-run privacy record (``ledger.json``): what the ε certifies, and every release.

    Attributes
    ----------
    unit : str
        The privacy unit: ``user``, ``record`` or ``owner``.
    adjacency : str
        The neighbouring relation of the analysis (add/remove one unit, or replace-one with a
        public n).
    accounting : str
        ``certified`` or ``paper`` (``privacy.accounting``).
    guarantee : str
        ``certified`` (a proven bound) or ``heuristic``; ``none`` without DP.
    mechanism : str
        The estimator's name (``gaussian``, ``winsorized``, ...; ``none`` without DP).
    accountant : str
        How the events are composed (dp-accounting's PLD with an RDP cross-check, ...).
    delta : float
        The δ at which every ε is reported.
    target_epsilon : float or None
        The budget: a round whose release would exceed it is not run.
    notes : list of str
        What else the guarantee rests on (public numbers, assumptions).
    entries : list of LedgerEntry
        One per release, in order.
    extra : dict
        Declared public numbers and mechanism-specific records (``extra["public"]``, ...).
    randomness : str
        Where the release noise and the privacy sampling came from: ``seeded (simulation)``
        (keyed by the run seed) or ``secure`` (OS entropy).
    """

    # unit, adjacency, accounting, accountant and delta are None for a run without DP
    unit: str | None
    adjacency: str | None
    accounting: str | None
    guarantee: str
    mechanism: str
    accountant: str | None
    delta: float | None
    target_epsilon: float | None
    notes: list[str] = field(default_factory=list)
    entries: list[LedgerEntry] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    # where the release noise and the privacy sampling came from (fedudp.randomness.Randomness):
    # "seeded (simulation)" (keyed by the run seed) or "secure" (OS entropy)
    randomness: str = "seeded (simulation)"

    @property
    def epsilon(self) -> float | None:
        return self.entries[-1].epsilon if self.entries else (0.0 if self.private else None)

    @property
    def private(self) -> bool:
        return self.mechanism != "none"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["entries"] = [e.as_dict() for e in self.entries]
        d["epsilon"] = self.epsilon
        # beside the number, what it is: a proven bound (certified) or not (heuristic)
        d["epsilon_kind"] = self.guarantee if self.private else None
        # the rounds whose release the run continued from; every entry (superseded ones, made
        # before a resume and computed again, included) is a release composed into epsilon
        d["rounds_released"] = sum(not e.superseded for e in self.entries)
        return d


def accountant_for(
    event: dp_accounting.DpEvent | ApproxDp | Parallel,
    group: GroupConversion | None = None,
    target_epsilon: float | None = None,
) -> Accountant | ParallelAccountant | GroupAccountant:
    """The accountant for a run whose rounds release events like ``event``: one ``Accountant``,
    or a ``ParallelAccountant`` with one part per part of a ``Parallel`` event (disjoint units),
    read at user level through ``group`` where the events are record-level. Its PLD grid is the
    one the noise was calibrated on: that of the events' own target (ε' = ε/k for record-level
    events under group privacy), since a coarser grid is more pessimistic and would stop a
    calibrated run before its last round. The target (that of the events) is the threshold above
    which the accountant computes epsilon exactly rather than reading its grid (``Accountant``)."""
    target = (
        group.record_epsilon(target_epsilon)
        if group is not None and target_epsilon
        else target_epsilon
    )
    interval = pld_interval(target)
    acc = (
        ParallelAccountant(len(event.parts), interval, target)
        if isinstance(event, Parallel)
        else Accountant(interval, target)
    )
    return GroupAccountant(acc, group) if group is not None else acc
