"""THE round loop, written once for both engines (ARCHITECTURE.md §3; Flower's Strategy.start).

Each round: check the budget *before* releasing (stop cleanly rather than exceed the target
ε), the billboard's own seeded Poisson sample, the cohort's replies (collected by the engine's
``Transport``), the billboard's release (rows or sums, the aggregator decides), the server step,
evaluation, the per-round metrics line. An AboveThreshold halt or the budget ends the run
cleanly. An engine supplies only how replies are collected and how owners are evaluated.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from fedudp.core.billboard import Billboard
from fedudp.core.messages import Failure, OwnerReply

Params = dict[str, torch.Tensor]


@dataclass
class Collected:
    """The cohort's replies, and the owners excluded from the round with their reasons."""

    replies: list[OwnerReply]
    failures: list[Failure] = field(default_factory=list)


@dataclass
class Evaluation:
    """Each owner's test accuracy and loss (NaN for an owner that failed to answer)."""

    accuracy: np.ndarray
    loss: np.ndarray
    failures: list[Failure] = field(default_factory=list)


class Transport(Protocol):
    """How an engine reaches its owners (in-process vectorized, or Flower messages)."""

    def train(self, shared: Params, cohort: np.ndarray | None, round_: int) -> Collected:
        """Owners update their personal parameters; those with sampled units (``cohort``: the
        billboard's unit ids, None without a billboard) reply with their shared parts."""
        ...

    def evaluate(self, shared: Params, round_: int,
                 while_waiting: Callable[[], None] | None = None) -> Evaluation:
        """Every owner scores ``shared`` with its own personal parameters; ``while_waiting``
        runs on the server meanwhile (or before, for an engine that cannot overlap)."""
        ...

    def personal(self) -> Params:
        """The personal parameters the server can see (the local engine's; {} for Flower)."""
        ...

    def info(self) -> dict:
        """Engine facts for summary.json."""
        ...


@dataclass
class RoundsResult:
    shared: Params
    personal: Params
    owner_accuracy: np.ndarray
    owner_loss: np.ndarray
    rounds_completed: int
    stop_reason: str            # completed | budget | halted
    history: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def summarize(acc: np.ndarray, loss: np.ndarray, sizes: np.ndarray) -> dict:
    """Mean / std / test-size-weighted accuracy and mean loss over owners with test records."""
    ok = (sizes > 0) & np.isfinite(acc)
    w = sizes[ok] / sizes[ok].sum()
    return {"loss": float(np.mean(loss[ok])), "accuracy_mean": float(np.mean(acc[ok])),
            "accuracy_std": float(np.std(acc[ok])), "accuracy_weighted": float(np.sum(w * acc[ok]))}


def _failures(kind: str, failures: list[Failure]) -> dict:
    if not failures:
        return {f"failed_{kind}_owners": 0}
    return {f"failed_{kind}_owners": len(failures),
            f"failed_{kind}": [{"owner": f.owner, "units": f.units, "reason": f.reason}
                               for f in failures]}


def run_rounds(rounds: int, eval_every: int, billboard: Billboard | None, transport: Transport,
               test_sizes: np.ndarray, on_round: Callable[[dict], None] | None = None
               ) -> RoundsResult:
    """Run up to ``rounds`` rounds; ``test_sizes`` weight the accuracy summary."""
    bb = billboard
    shared = bb.shared_params() if bb is not None else {}
    done, stop, history = 0, "completed", []
    ev: Evaluation | None = None
    budget_ok: bool | None = None       # next round's check, computed while owners evaluate

    def check_budget() -> None:
        nonlocal budget_ok
        budget_ok = bb.within_budget() if bb is not None else True

    for r in range(1, rounds + 1):
        t0 = time.perf_counter()
        if budget_ok is None:
            check_budget()
        ok, budget_ok = budget_ok, None
        if not ok:
            stop = "budget"
            break
        cohort = np.flatnonzero(bb.sample(r)) if bb is not None else None
        got = transport.train(shared, cohort, r)
        info: dict = {"round": r, "failed_owners": len(got.failures)}
        if got.failures:
            info["failures"] = _failures("train", got.failures)["failed_train"]
        halted = False
        if bb is not None:
            agg = bb.release(got.replies, r)
            shared = bb.shared_params()
            failed = sum(rep.failed for rep in got.replies) + sum(f.units for f in got.failures)
            info.update(cohort=int(len(cohort)), failed_units=failed, users_used=agg.users_used,
                        **{f"agg_{k}": v for k, v in agg.diagnostics.items()})
            if bb.ledger.entries:
                info["epsilon"] = bb.ledger.entries[-1].epsilon
            halted = agg.halted
        done = r
        if halted:
            stop = "halted"
        elif r % eval_every == 0 or r == rounds:
            ev = transport.evaluate(shared, r, check_budget if r < rounds else None)
            info.update(summarize(ev.accuracy, ev.loss, test_sizes))
            info.update(_failures("eval", ev.failures))
        info["seconds"] = time.perf_counter() - t0
        history.append(info)
        if on_round is not None:
            on_round(info)
        if halted:
            break
    if ev is None or (history and "accuracy_mean" not in history[-1]):
        ev = transport.evaluate(shared, done)
    return RoundsResult(shared, transport.personal(), ev.accuracy, ev.loss, done, stop, history,
                        transport.info())
