"""Privacy accounting on Google's dp-accounting (docs/algorithms.md#privacy-accounting).

* ``Accountant`` composes the ``DpEvent`` of every release with a ``PLDAccountant``
  (primary; tight for Poisson-sampled Gaussians) and an ``RdpAccountant`` (cross-check),
  both under ``ADD_OR_REMOVE_ONE`` at the stated unit. No RDP formula is written here.
* ``calibrate_noise_multiplier`` finds the smallest noise multiplier z = sigma / C whose
  whole schedule (all rounds, the sampling rate) stays within the target (epsilon, delta),
  with ``dp_accounting.calibrate_dp_mechanism`` over a PLD accountant.
* ``Ledger`` records, per round, what was released: unit, adjacency, sigma, epsilon so far.
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from fedudp.errors import ConfigError

ADJACENCY = "add_or_remove_one"
_RELATION = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
# Noise multipliers beyond this are treated as "target unreachable" (the run would be noise).
MAX_NOISE_MULTIPLIER = 1e4
MIN_NOISE_MULTIPLIER = 1e-6     # calibration below it: the target does not need noise


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
    return ApproxDp(eps, min(dlt, 1.0 - 1e-12))   # delta >= 1: nothing is left for the events


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


class Accountant:
    """Composes released events; reports epsilon at a delta (PLD, RDP as cross-check).

    Rounds usually release the same event; consecutive identical events are kept as one
    ``SelfComposedDpEvent`` and epsilon is computed on a fresh PLD accountant from those
    runs, exactly as the calibration does (incremental PLD composition adds discretization
    pessimism round by round and would not match the calibrated schedule).
    """

    def __init__(self, pld_interval: float = 1e-4) -> None:
        self.pld_interval = pld_interval
        self.runs: list[list] = []   # [event, count]
        self.blocks: list[tuple[ApproxDp, int]] = []   # basic composition on top of the events

    @property
    def events(self) -> list[dp_accounting.DpEvent]:
        return [e for e, c in self.runs for _ in range(c)]

    def supports(self, event) -> bool:
        if isinstance(event, ApproxDp):
            return True
        return _pld(self.pld_interval).supports(event) or _rdp().supports(event)

    @property
    def primary(self) -> str:
        """``pld`` when PLD supports every composed event, else ``rdp`` (e.g. ``ZCDpEvent``
        for pure-DP steps, which dp-accounting's PLD cannot represent;
        docs/algorithms.md#events-and-accountants)."""
        if not self.runs:
            return "pld"
        return "pld" if _pld(self.pld_interval).supports(self._composed()) else "rdp"

    def compose(self, event, count: int = 1) -> None:
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

    def _composed(self, extra: dp_accounting.DpEvent | None = None, count: int = 1
                  ) -> dp_accounting.DpEvent:
        runs = [list(r) for r in self.runs]
        if extra is not None:
            if runs and runs[-1][0] == extra:
                runs[-1][1] += count
            else:
                runs.append([extra, count])
        parts = [dp_accounting.SelfComposedDpEvent(e, c) for e, c in runs]
        return parts[0] if len(parts) == 1 else dp_accounting.ComposedDpEvent(parts)

    def _split(self, delta: float, extra=None, count: int = 1):
        """(events' delta budget, blocks' epsilon) after basic composition of the blocks."""
        blocks = list(self.blocks)
        if isinstance(extra, ApproxDp):
            blocks.append((extra, count))
        b = basic_composition(blocks)
        left = delta - b.delta
        if left < 0 and b.delta <= delta * (1 + 1e-9):     # the blocks spend exactly δ (rounding)
            left = 0.0
        return left, b.epsilon

    def _events_epsilon(self, event, delta: float, rdp_only: bool = False) -> float | None:
        return event_epsilon(event, delta, self.pld_interval, rdp_only)

    def epsilon(self, delta: float) -> float:
        """Epsilon at ``delta`` of everything composed so far: the events with PLD (RDP for
        events PLD cannot represent) at delta minus the blocks' delta, plus the blocks'
        epsilon (basic composition)."""
        if not self.runs and not self.blocks:
            return 0.0
        d_ev, e_blk = self._split(delta)
        return float(self._events_epsilon(self._composed() if self.runs else None, d_ev)) + e_blk

    def epsilon_rdp(self, delta: float) -> float | None:
        """The RDP accountant's (looser) epsilon, as a cross-check; None if unsupported."""
        if not self.runs and not self.blocks:
            return 0.0
        d_ev, e_blk = self._split(delta)
        e = self._events_epsilon(self._composed() if self.runs else None, d_ev, rdp_only=True)
        return None if e is None else float(e) + e_blk

    def epsilon_if(self, event, delta: float, count: int = 1) -> float:
        """Epsilon after composing ``event`` ``count`` more times, without composing it."""
        d_ev, e_blk = self._split(delta, event, count)
        if isinstance(event, ApproxDp):
            ev = self._composed() if self.runs else None
        else:
            ev = self._composed(event, count)
        return float(self._events_epsilon(ev, d_ev)) + e_blk


class ParallelAccountant:
    """``Accountant``'s interface over ``Parallel`` events: one accountant per part, ε the max."""

    def __init__(self, parts: int, pld_interval: float = 1e-4) -> None:
        self.parts = [Accountant(pld_interval) for _ in range(parts)]

    def compose(self, event, count: int = 1) -> None:
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
        eps = [a.epsilon_rdp(delta) for a in self.parts]
        return None if any(e is None for e in eps) else max(eps)

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
    def for_user_budget(cls, size: int, epsilon: float, delta: float, form: str) -> "GroupConversion":
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
        return (f"GroupConversion(k={self.size}, record_delta={self.record_delta:.6g}, "
                f"form={self.form})")


class GroupAccountant:
    """An accountant at record level read at user level through a ``GroupConversion``: events
    are composed record-level by ``inner`` (``Accountant`` or ``ParallelAccountant``); epsilon
    at the user-level δ is k times the record-level epsilon at the conversion's δ'."""

    def __init__(self, inner, group: GroupConversion) -> None:
        self.inner, self.group = inner, group

    def compose(self, event, count: int = 1) -> None:
        self.inner.compose(event, count)

    def epsilon(self, delta: float) -> float:
        return self.group.user_epsilon(self.inner.epsilon(self.group.record_delta))

    def epsilon_rdp(self, delta: float) -> float | None:
        e = self.inner.epsilon_rdp(self.group.record_delta)
        return None if e is None else self.group.user_epsilon(e)

    def epsilon_if(self, event, delta: float, count: int = 1) -> float:
        return self.group.user_epsilon(self.inner.epsilon_if(event, self.group.record_delta, count))

    def record_epsilon(self) -> float:
        return self.inner.epsilon(self.group.record_delta)


def event_epsilon(event: dp_accounting.DpEvent | None, delta: float, interval: float = 1e-4,
                  rdp_only: bool = False) -> float | None:
    """Epsilon of one (composed) event at ``delta``: PLD, or RDP for events PLD cannot
    represent (or when ``rdp_only``); None if neither supports it, inf when delta <= 0."""
    if event is None:       # nothing but blocks: fine while they leave δ >= 0
        return 0.0 if delta >= 0 else math.inf
    if delta <= 0:          # events need some δ: none is left
        return math.inf
    if not rdp_only:
        acc = _pld(interval)
        if acc.supports(event):
            acc.compose(event)
            return float(acc.get_epsilon(delta))
    acc = _rdp()
    if not acc.supports(event):
        return None
    with _quiet_absl():
        acc.compose(event)
        return float(acc.get_epsilon(delta))


def schedule_epsilon(make_event: Callable[[float], dp_accounting.DpEvent], noise: float,
                     rounds: int, delta: float, interval: float = 1e-4) -> float:
    """Epsilon of ``rounds`` self-composed releases of ``make_event(noise)`` (PLD; RDP for
    events PLD cannot represent)."""
    return event_epsilon(dp_accounting.SelfComposedDpEvent(make_event(noise), rounds), delta, interval)


def calibrate_noise_multiplier(make_event: Callable[[float], dp_accounting.DpEvent],
                               target_epsilon: float, delta: float, rounds: int,
                               tol: float = 1e-3) -> float:
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
            f"{rounds} rounds even with noise multiplier {MAX_NOISE_MULTIPLIER:g}")

    def event(z: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(make_event(z), rounds)

    if not _pld(interval).supports(event(1.0)):          # pure-DP steps: RDP only
        with _quiet_absl():
            return float(dp_accounting.calibrate_dp_mechanism(
                _rdp, event, target_epsilon, delta,
                bracket_interval=dp_accounting.LowerEndpointAndGuess(1e-6, 1.0), tol=tol))

    # RDP is an upper bound on epsilon, so its calibration brackets the PLD one from above;
    # it is also fast where PLD is slow (small noise, large epsilon).
    with _quiet_absl():
        z_hi = float(dp_accounting.calibrate_dp_mechanism(
            _rdp, event, target_epsilon, delta,
            bracket_interval=dp_accounting.LowerEndpointAndGuess(1e-4, 1.0), tol=tol / 10))
    z_lo = z_hi / 2
    while (eps_lo := schedule_epsilon(make_event, z_lo, rounds, delta, interval)) <= target_epsilon:
        # ε = 0 at a finite noise, or no floor in sight: δ covers the release whatever the noise
        if eps_lo == 0.0 or z_lo < MIN_NOISE_MULTIPLIER:
            raise BudgetError(
                f"privacy.delta={delta} is too large for this schedule: (epsilon={target_epsilon}, "
                f"delta={delta}) holds for any noise multiplier (e.g. delta >= the sampling "
                "rate); choose delta well below the chance that a user is sampled")
        z_hi, z_lo = z_lo, z_lo / 2
    z = dp_accounting.calibrate_dp_mechanism(
        lambda: _pld(interval), event, target_epsilon, delta,
        bracket_interval=dp_accounting.ExplicitBracketInterval(z_lo, z_hi), tol=tol)
    return float(z)


def validate_budget(epsilon: float, delta: float) -> None:
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise BudgetError(f"privacy.epsilon must be a finite number > 0, got {epsilon}")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise BudgetError(f"privacy.delta must be in (0, 1), got {delta}")


@dataclass
class LedgerEntry:
    round: int
    event: str
    noise_multiplier: float | None
    noise_std: float | None
    sampling_rate: float
    epsilon: float | None
    epsilon_rdp: float | None


@dataclass
class Ledger:
    """Per-run privacy record (written to ``ledger.json``)."""

    unit: str
    adjacency: str
    accounting: str
    guarantee: str
    mechanism: str
    accountant: str
    delta: float
    target_epsilon: float | None
    notes: list[str] = field(default_factory=list)
    entries: list[LedgerEntry] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def epsilon(self) -> float | None:
        return self.entries[-1].epsilon if self.entries else (0.0 if self.private else None)

    @property
    def private(self) -> bool:
        return self.mechanism != "none"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["epsilon"] = self.epsilon
        # beside the number, what it is: a proven bound (certified) or not (heuristic)
        d["epsilon_kind"] = self.guarantee if self.private else None
        d["rounds_released"] = len(self.entries)
        return d


def accountant_for(event, group: GroupConversion | None = None,
                   target_epsilon: float | None = None):
    """The accountant for a run whose rounds release events like ``event``: one ``Accountant``,
    or a ``ParallelAccountant`` with one part per part of a ``Parallel`` event (disjoint units),
    read at user level through ``group`` where the events are record-level. Its PLD grid is the
    one the noise was calibrated on: that of the events' own target (ε' = ε/k for record-level
    events under group privacy), since a coarser grid is more pessimistic and would stop a
    calibrated run before its last round."""
    target = (group.record_epsilon(target_epsilon) if group is not None and target_epsilon
              else target_epsilon)
    interval = pld_interval(target)
    acc = (ParallelAccountant(len(event.parts), interval) if isinstance(event, Parallel)
           else Accountant(interval))
    return GroupAccountant(acc, group) if group is not None else acc
