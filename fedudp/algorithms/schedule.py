"""The one ``Plan`` the seeds' training algorithms configure (``fedudp.billboard.plan`` hooks).

An algorithm is a list of ``Phase``s on the one round loop. A phase has its rounds, its cohort
(a fixed set of billboard units, disjoint from the other phases' units, or a per-round sampler),
its estimator (an aggregator from the registry, calibrated for that phase), its step size, a
public regulariser (λ (u - centre), centre the previous phase's output or 0) and a projection
ball. The plan

* samples each round's cohort (public randomness),
* reports each round's event: with several phases, a ``Parallel`` event with the active phase's
  event in its part and ``NoOpDpEvent`` in the others (disjoint users: parallel composition,
  the run's ε is the worst phase's); a per-round ``event_fn`` otherwise (Huang Alg. 2),
* steps u <- Π(u - η (ĝ + λ (u - c))), keeps the averaged iterate (the mean of the iterates the
  gradients were queried at, [ASI] Alg. 3 / [HUANG] Alg. 1) and, at a phase's end, sets u to
  the phase's output (the averaged iterate, or the last one), the next phase's start,
* on an AboveThreshold halt returns the phase's starting point ([ASI] Alg. 3: θ_0).

Everything here is post-processing of the DP releases and public randomness.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import dp_accounting
import numpy as np
import torch

from fedudp.aggregators.base import Aggregator
from fedudp.billboard.plan import Plan
from fedudp.privacy.accountant import ApproxDp, Parallel

__all__ = [
    "Phase",
    "AlgorithmPlan",
]


@dataclass
class Phase:
    """One phase of a training algorithm's schedule.

    Attributes
    ----------
    rounds : int
        The phase's rounds.
    aggregator : Aggregator
        Its estimator.
    step_size : float
        Its step size.
    units : np.ndarray or None
        Its fixed cohort (billboard unit ids); None: the plan's ``sampler``.
    reg : float, default 0.0
        λ of the public regulariser (λ/2)||u - centre||².
    reg_centre, ball_centre : str
        ``"zero"`` or ``"start"`` (this phase's starting point).
    radius : float or None
        The projection ball's radius (None: no projection).
    """

    rounds: int
    aggregator: Aggregator
    step_size: float
    units: np.ndarray | None = None  # fixed cohort (billboard unit ids); None: ``sampler``
    reg: float = 0.0  # λ of the public regulariser (λ/2)||u - centre||²
    reg_centre: str = "zero"  # "zero" or "start" (this phase's starting point)
    radius: float | None = None  # projection ball radius (None: no projection)
    ball_centre: str = "zero"  # "zero" or "start"


class AlgorithmPlan(Plan):
    """A training algorithm's phases as the billboard's ``Plan``.

    Parameters
    ----------
    phases : list[Phase]
        The phases, in order.
    population : int
        The billboard's units.
    averaged : bool
        Whether the result is the averaged iterate.
    sampler : Callable[[int], np.ndarray], optional
        The round's cohort mask, for phases without fixed ``units``.
    event_fn : Callable[[int], object], optional
        The round's accounting event (None: from the phases' estimators).

    Raises
    ------
    ValueError
        When ``phases`` is empty.
    """

    def __init__(
        self,
        phases: list[Phase],
        population: int,
        averaged: bool,
        sampler: Callable[[int], np.ndarray] | None = None,
        event_fn: Callable[[int], object] | None = None,
    ) -> None:
        if not phases:
            raise ValueError("an algorithm needs at least one phase")
        self.phases, self.population, self.averaged = phases, int(population), bool(averaged)
        self.sampler, self.event_fn = sampler, event_fn
        self.ends = np.cumsum([p.rounds for p in phases])
        self.start_u: torch.Tensor | None = None
        self.sum_u: torch.Tensor | None = None
        self.halted = False
        self._mask_cache: tuple[int, np.ndarray] | None = None

    @property
    def rounds(self) -> int:
        return int(self.ends[-1])

    # -- checkpoints (fedudp.protocol.checkpoint via Billboard.state) ---------------------------------
    def checkpoint_state(self) -> dict:
        """What continuing exactly needs: the phase's start and the running sum of its iterates
        (the averaged iterate), the halt flag, and each phase estimator's own state (an
        AboveThreshold's noisy threshold, queries and RNG). Cohorts and noise are keyed by round."""
        return {
            "start_u": None if self.start_u is None else self.start_u.clone(),
            "sum_u": None if self.sum_u is None else self.sum_u.clone(),
            "halted": bool(self.halted),
            "phases": [ph.aggregator.checkpoint_state() for ph in self.phases],
        }

    def restore_checkpoint_state(self, state: dict) -> None:
        if len(state["phases"]) != len(self.phases):
            from fedudp.protocol.checkpoint import CheckpointError

            raise CheckpointError(
                f"the plan has {len(self.phases)} phases, the checkpoint {len(state['phases'])}"
            )
        self.start_u = None if state["start_u"] is None else state["start_u"].clone()
        self.sum_u = None if state["sum_u"] is None else state["sum_u"].clone()
        self.halted = bool(state["halted"])
        self._mask_cache = None
        for ph, st in zip(self.phases, state["phases"]):
            ph.aggregator.restore_checkpoint_state(st)

    def phase_of(self, round_: int) -> int:
        return min(int(np.searchsorted(self.ends, round_, side="left")), len(self.phases) - 1)

    # -- hooks -------------------------------------------------------------------------------
    def sample(self, round_: int) -> np.ndarray:
        if self._mask_cache is not None and self._mask_cache[0] == round_:
            return self._mask_cache[1]
        ph = self.phases[self.phase_of(round_)]
        if ph.units is not None:
            mask = np.zeros(self.population, dtype=bool)
            mask[ph.units] = True
        elif self.sampler is not None:
            mask = self.sampler(round_)
        else:
            mask = np.ones(self.population, dtype=bool)
        self._mask_cache = (round_, mask)
        return mask

    def cohort(self, round_: int) -> np.ndarray:
        """The round's sampled unit ids (what the owner hook ``PersonalStep`` asks)."""
        return np.flatnonzero(self.sample(round_))

    def event(self, round_: int) -> dp_accounting.DpEvent | Parallel | None:
        if self.event_fn is not None:
            return self.event_fn(round_)
        if len(self.phases) == 1:
            return None
        p = self.phase_of(round_)
        return Parallel(
            tuple(
                ph.aggregator.dp_event() if i == p else dp_accounting.NoOpDpEvent()
                for i, ph in enumerate(self.phases)
            )
        )

    def one_off(self) -> dp_accounting.DpEvent | ApproxDp | Parallel | None:
        if len(self.phases) == 1 and self.event_fn is None:
            return None
        offs = [ph.aggregator.one_off_event() for ph in self.phases]
        if all(o is None for o in offs):
            return None
        if self.event_fn is not None:  # one estimator, one block (parts compose it each)
            return offs[0]
        return Parallel(tuple(o if o is not None else ApproxDp(0.0, 0.0) for o in offs))

    def aggregator(self, round_: int) -> Aggregator:
        return self.phases[self.phase_of(round_)].aggregator

    def step(self, u: torch.Tensor, mean: torch.Tensor | None, round_: int) -> torch.Tensor:
        p = self.phase_of(round_)
        ph = self.phases[p]
        first = round_ == (int(self.ends[p - 1]) if p else 0) + 1
        if first or self.start_u is None:
            self.start_u = u.clone()
            self.sum_u = torch.zeros_like(u, dtype=torch.float64)
        if mean is None:  # AboveThreshold halted: the phase's start (θ_0)
            self.halted = True
            return self.start_u.clone()
        u64 = u.to(torch.float64)
        assert self.sum_u is not None  # set with start_u
        self.sum_u += u64  # the iterate this round's gradients were taken at
        g = mean.to(torch.float64)
        if ph.reg:
            centre = self.start_u.to(torch.float64) if ph.reg_centre == "start" else 0.0
            g = g + ph.reg * (u64 - centre)
        new = u64 - ph.step_size * g
        if ph.radius is not None:
            c = (
                self.start_u.to(torch.float64)
                if ph.ball_centre == "start"
                else torch.zeros_like(new)
            )
            dist = float(torch.linalg.vector_norm(new - c))
            if dist > ph.radius:
                new = c + (new - c) * (ph.radius / dist)
        # the phase's output (its average, if averaged) starts the next phase
        if round_ == int(self.ends[p]) and self.averaged:
            new = self.sum_u / ph.rounds
        return new.to(u.dtype)
