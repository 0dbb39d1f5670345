"""Privacy accounting on Google's dp-accounting (docs/algorithms.md#privacy-accounting).

* ``Accountant`` composes the ``DpEvent`` of every release with a ``PLDAccountant``
  (primary; tight for Poisson-sampled Gaussians) and an ``RdpAccountant`` (cross-check),
  both under ``ADD_OR_REMOVE_ONE`` at the stated unit. No RDP formula is written here.
  ``ParallelAccountant`` (disjoint parts) and ``GroupAccountant`` (record level read at user
  level) answer the same questions; ``fedudp.privacy.protocol.AccountantLike`` is their type.
* The epsilon of one composed event, with bounded work: ``fedudp.privacy.bounded``; the PLD
  engine behind it (the only module that reads dp-accounting's private names):
  ``fedudp.privacy.pld_fast``. ``engine="public"`` computes the same bounds from
  dp-accounting's public API alone.
* Calibration (``calibrate_noise_multiplier``, ...): ``fedudp.privacy.calibration``; the ledger
  (``Ledger``, ``LedgerEntry``): ``fedudp.privacy.ledger``. Both are re-exported here, so
  ``from fedudp.privacy.accountant import X`` keeps working for every name in ``__all__``
  (``GroupConversion`` too: ``fedudp.privacy.group``).

Cost per round (docs/results/ledger/README.md): the PLD of an event is built once (the
expensive part of dp-accounting's Poisson-sampled Gaussian), a state's epsilon is computed
once (the budget check before a round and the ledger after it ask the same question), and a
long run of one event is read off a grid of counts on which epsilon is computed (an upper
envelope within ``LEDGER_TOL`` of the exact value, the exact value wherever it decides the
budget); see ``Accountant``.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import dp_accounting

from fedudp.privacy.bounded import (
    MAX_PLD_BUILD,
    MAX_PLD_POINTS,
    MAX_PLD_WINDOW,
    bounded_epsilon,
    check_engine,
    composed_event,
    event_epsilon,
    forget_all,
    pld_interval,
    pld_size,
    pld_supports,
    pld_too_large,
    quiet_absl,
    rdp_accountant,
    rdp_runs_epsilon,
    with_rdp,
)
from fedudp.privacy.calibration import (
    MAX_NOISE_MULTIPLIER,
    MIN_NOISE_MULTIPLIER,
    BudgetError,
    calibrate_noise_multiplier,
    rounds_text,
    schedule_epsilon,
    validate_budget,
)
from fedudp.privacy.distributed_rdp import DistributedDpEvent, distributed_rdp_epsilon
from fedudp.privacy.group import GroupConversion
from fedudp.privacy.ledger import Ledger, LedgerEntry
from fedudp.privacy.pld_fast import event_key, fast_atom, fast_epsilon

__all__ = [
    "ADJACENCY",
    "EXACT_ROUNDS",
    "LEDGER_TOL",
    "MAX_NOISE_MULTIPLIER",
    "MAX_PLD_BUILD",
    "MAX_PLD_POINTS",
    "MAX_PLD_WINDOW",
    "MIN_NOISE_MULTIPLIER",
    "Accountant",
    "ApproxDp",
    "BudgetError",
    "GroupAccountant",
    "GroupConversion",
    "Ledger",
    "LedgerEntry",
    "Parallel",
    "ParallelAccountant",
    "accountant_for",
    "basic_composition",
    "calibrate_noise_multiplier",
    "event_epsilon",
    "forget_all",
    "pld_interval",
    "pld_too_large",
    "rounds_text",
    "schedule_epsilon",
    "validate_budget",
]

# kept for ``from fedudp.privacy.accountant import _quiet_absl`` (fedudp.privacy.events)
_quiet_absl = quiet_absl

ADJACENCY = "add_or_remove_one"
# The ledger's epsilon after c rounds of one event is at most this much above dp-accounting's
# direct computation of those c rounds (the grid's envelope, ``Accountant``); exact up to
# ``EXACT_ROUNDS`` rounds of a run and wherever it would exceed the target.
LEDGER_TOL = 1e-3
EXACT_ROUNDS = 32


@dataclass(frozen=True)
class ApproxDp:
    """An (epsilon, delta)-DP block that dp-accounting 0.6 has no event for
    (docs/algorithms.md#blocks-without-a-dp-accounting-event): AboveThreshold's pure budget,
    a failure probability that enters delta (ASI's zeta, a concentration check passing
    wrongly), Esfandiari's (4ε, 4δ) sampler. Blocks compose with everything else by basic
    composition (``basic_composition``)."""

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


# what one release composes (fedudp.privacy.protocol.Release)
_Release: TypeAlias = dp_accounting.DpEvent | ApproxDp | Parallel | DistributedDpEvent


def basic_composition(blocks: list[tuple[ApproxDp, int]] | list[ApproxDp]) -> ApproxDp:
    """Basic composition (Dwork–Roth Thm 3.16): k mechanisms (ε_i, δ_i)-DP compose to
    (Σε_i, Σδ_i)-DP, adaptively. Entries are blocks or (block, count) pairs."""
    eps = dlt = 0.0
    for b in blocks:
        blk, c = b if isinstance(b, tuple) else (b, 1)
        eps += c * blk.epsilon
        dlt += c * blk.delta
    return ApproxDp(eps, min(dlt, 1.0 - 1e-12))  # delta >= 1: nothing is left for the events


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
        """The exact epsilon after ``c`` releases (memoized)."""
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
        """Epsilon after ``c`` releases (``threshold``: above it, the exact value)."""
        if c <= EXACT_ROUNDS:
            return self.exact(c)
        self._extend(c)
        v = self.values[bisect.bisect_left(self.grid, c)]
        return self.exact(c) if v > threshold else v


def _distributed(runs: Sequence[Sequence[Any]]) -> bool:
    """Whether the runs are distributed events (``compose`` never mixes the two kinds)."""
    return any(isinstance(e, DistributedDpEvent) for e, _ in runs)


def _pld_supports(event: object) -> bool:
    return not isinstance(event, DistributedDpEvent) and pld_supports(event)


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
      (``FastPLD``: never below the direct value up to dp-accounting's own rounding, above it
      by about 1e-6 x d(eps)/d(log delta), a few 1e-6 at most).

    Every number is a function of the composed events alone (not of the order of questions), so
    an accountant recomposed from a checkpoint reports the same epsilon bit for bit.

    Parameters
    ----------
    pld_interval : float
        The PLD grid (``pld_interval(target)``: the one the noise was calibrated on).
    target_epsilon : float or None
        The budget: above it epsilon is computed exactly rather than read off the grid.
    engine : {"fast", "public"}
        ``fast``: dp-accounting's computation through ``fedudp.privacy.pld_fast`` (memoized,
        sampled Gaussians self-composed once for all counts). ``public``: dp-accounting's
        public ``PLDAccountant``/``RdpAccountant`` ``compose`` and ``get_epsilon`` only
        (``fedudp.privacy.bounded``): the same epsilon up to ``EXACT_ROUNDS`` rounds of a run,
        within ``LEDGER_TOL`` beyond (tests/privacy/test_accountant_seam.py).
    """

    def __init__(
        self,
        pld_interval: float = 1e-4,
        target_epsilon: float | None = None,
        engine: str = "fast",
    ) -> None:
        self.pld_interval = pld_interval
        self.engine = check_engine(engine)
        self.target_epsilon = target_epsilon
        self.runs: list[list] = []  # [event, count]
        self.blocks: list[tuple[ApproxDp, int]] = []  # basic composition on top of the events
        self._canon: list[list] = []  # the runs without NoOpDpEvent, neighbours merged
        self._series: OrderedDict = OrderedDict()

    @property
    def events(self) -> list[dp_accounting.DpEvent]:
        """Every composed event, one per release (the runs expanded)."""
        return [e for e, c in self.runs for _ in range(c)]

    def supports(self, event: dp_accounting.DpEvent | ApproxDp | DistributedDpEvent) -> bool:
        """Whether ``event`` can be composed (a block, an event PLD or RDP supports, or a
        ``DistributedDpEvent``), and composed with what this accountant holds (distributed
        events mix with blocks and ``NoOpDpEvent``s only)."""
        if isinstance(event, (ApproxDp, dp_accounting.NoOpDpEvent)):
            return True
        if self._mixes(event):
            return False
        if isinstance(event, DistributedDpEvent):
            return True
        return pld_supports(event) or rdp_accountant().supports(event)

    def _mixes(self, event: object) -> bool:
        """Whether ``event`` and the composed events are distributed and dp-accounting ones."""
        if not self._canon:  # compose keeps one kind: the first run's tells it
            return False
        held = isinstance(self._canon[0][0], DistributedDpEvent)
        return isinstance(event, DistributedDpEvent) != held

    def _check_mix(self, event: object) -> None:
        if not isinstance(event, (ApproxDp, dp_accounting.NoOpDpEvent)) and self._mixes(event):
            held = "dp-accounting" if isinstance(event, DistributedDpEvent) else "distributed"
            raise dp_accounting.UnsupportedEventError(
                f"cannot compose {event} with the {held} events already composed: "
                "one accountant per kind"
            )

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
        None when nothing was, or when an ``ApproxDp`` block or a ``DistributedDpEvent`` (no
        dp-accounting event) was."""
        if self.blocks or not self.runs or _distributed(self.runs):
            return None
        return composed_event(self.runs)

    def compose(
        self,
        event: dp_accounting.DpEvent | ApproxDp | Parallel | DistributedDpEvent,
        count: int = 1,
    ) -> None:
        """Compose ``count`` releases of ``event`` (a ``DpEvent``, an ``ApproxDp`` block or a
        ``DistributedDpEvent``, whose RDP curves add up).

        Raises
        ------
        ValueError
            For a ``NonPrivateDpEvent``.
        dp_accounting.UnsupportedEventError
            For an event neither PLD nor RDP supports (a ``Parallel`` one included: that is
            ``ParallelAccountant``'s), or a ``DistributedDpEvent`` mixed with dp-accounting
            events other than ``NoOpDpEvent`` (either way round).
        """
        if isinstance(event, Parallel):
            raise dp_accounting.UnsupportedEventError(f"neither PLD nor RDP supports {event}")
        if isinstance(event, dp_accounting.NonPrivateDpEvent):
            raise ValueError("a non-private release cannot be composed into a DP ledger")
        if isinstance(event, ApproxDp):
            if self.blocks and self.blocks[-1][0] == event:
                self.blocks[-1] = (event, self.blocks[-1][1] + count)
            else:
                self.blocks.append((event, count))
            return
        self._check_mix(event)
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
        key = (tuple((event_key(e), c) for e, c in prefix), event_key(event), delta)
        if key in self._series:
            self._series.move_to_end(key)
            return self._series[key]
        interval = self.pld_interval
        prefix = [tuple(r) for r in prefix]

        def exact(c: int) -> float:
            return bounded_epsilon(
                composed_event(prefix + [(event, c)]), delta, interval, self.engine
            )

        # the public engine reads every grid value off dp-accounting's own accountants
        atom = None if prefix or self.engine == "public" else fast_atom(event)

        def grid(c: int) -> float:
            ev = composed_event([(event, c)])
            if atom is None or pld_size(ev, interval) > MAX_PLD_WINDOW:
                return exact(c)
            v = fast_epsilon(atom[0], atom[1], atom[2] * c, delta, interval)
            return exact(c) if v is None else with_rdp(v, ev, delta)

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
        if _distributed(runs):
            return distributed_rdp_epsilon(runs, delta)
        if not rdp_only and all(pld_supports(e) for e, _ in runs):
            threshold = math.inf if self.target_epsilon is None else self.target_epsilon - spent
            return self._series_for(runs[:-1], runs[-1][0], delta).value(runs[-1][1], threshold)
        return rdp_runs_epsilon(runs, delta, self.engine)

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
        """The RDP accountant's (looser) epsilon, as a cross-check; None if unsupported (for
        ``DistributedDpEvent``s, ``epsilon``'s value: it is RDP)."""
        if not self.runs and not self.blocks:
            return 0.0
        d_ev, e_blk = self._split(delta)
        e = self._events_epsilon(self._canon, d_ev, rdp_only=True)
        return None if e is None else float(e) + e_blk

    def epsilon_if(
        self,
        event: dp_accounting.DpEvent | ApproxDp | Parallel | DistributedDpEvent,
        delta: float,
        count: int = 1,
    ) -> float:
        """Epsilon after composing ``event`` ``count`` more times, without composing it.

        Raises
        ------
        TypeError
            For an event neither PLD nor RDP supports (a ``Parallel`` one included).
        dp_accounting.UnsupportedEventError
            For a ``DistributedDpEvent`` mixed with dp-accounting events (``compose``).
        """
        if isinstance(event, Parallel):
            raise TypeError(f"neither PLD nor RDP supports {event}")
        self._check_mix(event)
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
        self,
        parts: int,
        pld_interval: float = 1e-4,
        target_epsilon: float | None = None,
        engine: str = "fast",
    ) -> None:
        self.parts = [Accountant(pld_interval, target_epsilon, engine) for _ in range(parts)]

    def compose(self, event: _Release, count: int = 1) -> None:
        """Compose ``count`` of a ``Parallel`` event (one event per part) or of an ``ApproxDp``
        block (into every part)."""
        if isinstance(event, ApproxDp):
            for a in self.parts:
                a.compose(event, count)
            return
        if not isinstance(event, Parallel) or len(event.parts) != len(self.parts):
            raise ValueError(f"expected a Parallel event of {len(self.parts)} parts, got {event}")
        for a, e in zip(self.parts, event.parts):
            a.compose(e, count)

    def epsilon(self, delta: float) -> float:
        """The worst part's epsilon at ``delta`` (parallel composition)."""
        return max(a.epsilon(delta) for a in self.parts)

    def epsilon_rdp(self, delta: float) -> float | None:
        """The worst part's RDP epsilon; None if RDP does not support every part."""
        eps = [e for a in self.parts if (e := a.epsilon_rdp(delta)) is not None]
        return None if len(eps) < len(self.parts) else max(eps)

    def epsilon_if(self, event: _Release, delta: float, count: int = 1) -> float:
        """The worst part's epsilon after ``count`` more of ``event``, without composing it."""
        if isinstance(event, ApproxDp):
            return max(a.epsilon_if(event, delta, count) for a in self.parts)
        if not isinstance(event, Parallel) or len(event.parts) != len(self.parts):
            raise ValueError(f"expected a Parallel event of {len(self.parts)} parts, got {event}")
        return max(a.epsilon_if(e, delta, count) for a, e in zip(self.parts, event.parts))

    def part_epsilons(self, delta: float) -> list[float]:
        """Each part's epsilon at ``delta``."""
        return [a.epsilon(delta) for a in self.parts]


class GroupAccountant:
    """An accountant at record level read at user level through a ``GroupConversion``: events
    are composed record-level by ``inner`` (``Accountant`` or ``ParallelAccountant``); epsilon
    at the user-level δ is k times the record-level epsilon at the conversion's δ'."""

    def __init__(self, inner: Accountant | ParallelAccountant, group: GroupConversion) -> None:
        self.inner, self.group = inner, group

    def compose(self, event: _Release, count: int = 1) -> None:
        """Compose ``count`` releases of ``event`` at record level."""
        self.inner.compose(event, count)

    def epsilon(self, delta: float) -> float:
        """User-level epsilon: k times the record-level epsilon at the conversion's δ'."""
        return self.group.user_epsilon(self.inner.epsilon(self.group.record_delta))

    def epsilon_rdp(self, delta: float) -> float | None:
        """User-level RDP epsilon (k times the record level's at δ'); None if unsupported."""
        e = self.inner.epsilon_rdp(self.group.record_delta)
        return None if e is None else self.group.user_epsilon(e)

    def epsilon_if(self, event: _Release, delta: float, count: int = 1) -> float:
        """User-level epsilon after ``count`` more of ``event``, without composing it."""
        eps = self.inner.epsilon_if(event, self.group.record_delta, count)
        return self.group.user_epsilon(eps)

    def record_epsilon(self) -> float:
        """The record-level epsilon at the conversion's δ' (what the noise is calibrated to)."""
        return self.inner.epsilon(self.group.record_delta)


def accountant_for(
    event: dp_accounting.DpEvent | ApproxDp | Parallel,
    group: GroupConversion | None = None,
    target_epsilon: float | None = None,
    engine: str = "fast",
) -> Accountant | ParallelAccountant | GroupAccountant:
    """The accountant for a run whose rounds release events like ``event``, on the PLD grid
    the noise was calibrated on (that of the events' own target: ε' = ε/k for record-level
    events under group privacy; a coarser grid would stop a calibrated run early).

    Parameters
    ----------
    event
        One round's release: a dp-accounting event, an ``ApproxDp`` or a ``Parallel`` event.
    group
        The conversion to user level where the events are record-level (group privacy).
    target_epsilon
        The events' target, above which epsilon is computed exactly (``Accountant``).
    engine
        ``Accountant``'s engine: ``"fast"`` or ``"public"`` (dp-accounting's public API).

    Returns
    -------
    Accountant or ParallelAccountant or GroupAccountant
        One per part of a ``Parallel`` event; read at user level through ``group`` if given.
    """
    target = (
        group.record_epsilon(target_epsilon)
        if group is not None and target_epsilon
        else target_epsilon
    )
    interval = pld_interval(target)
    acc = (
        ParallelAccountant(len(event.parts), interval, target, engine)
        if isinstance(event, Parallel)
        else Accountant(interval, target, engine)
    )
    return GroupAccountant(acc, group) if group is not None else acc
