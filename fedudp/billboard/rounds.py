"""THE round loop, written once for both engines (docs/architecture.md#one-round-as-data;
Flower's Strategy.start).

Each round: check the budget *before* releasing (stop cleanly rather than exceed the target
ε), the billboard's own seeded Poisson sample, the cohort's replies (collected by the engine's
``Transport``), the billboard's release (rows or sums, the aggregator decides), the server step,
evaluation, the per-round metrics line. An engine supplies only how replies are collected and
how owners are evaluated.

Stops (``stop_reason``): ``completed``; ``budget`` (the next release would exceed ε);
``halted`` (AboveThreshold said stop); ``diverged`` (the released shared parameters became
non-finite, kept at their last finite value; a round whose every sampled unit sent a non-finite
vector stops a run without privacy; in a private one it is not a stop, since that would
depend on the users' data: the run's end names such rounds); ``interrupted``
(SIGINT/SIGTERM: the round in progress is abandoned before its release, so the ledger holds
exactly the releases that happened; a signal during the release is deferred to its end; where
the loop runs outside the main thread, as in Flower's ServerApp, the main thread's ``StopFlag``
is polled at the same points and in the transport's waits); ``failed`` (fail closed,
``Billboard.withhold``: every round was withheld because owners failed, so nothing was released
and no ε spent; or a training algorithm's schedule, which cannot skip a round, had one withheld;
or no owner can answer again, ``Collected.gone``: a Flower run's whole cluster lost).
A withheld round releases nothing, composes nothing and leaves the shared parameters as they
are; its metrics line says why (``withheld``) and lists the failed owners' reasons, and a run
that completed with withheld rounds says so in its one-line message (``completion_notes``: the
summary's ``stop_message``).

Checkpoints (``fedudp.protocol.checkpoint``): after every ``checkpoint.every``-th completed round
the billboard's and the transport's state and the metrics so far; a resumed run restores them
and continues with the next round.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from fedudp.billboard.server import Billboard
from fedudp.protocol.checkpoint import Checkpointer, CheckpointError, warn
from fedudp.protocol.messages import Failure, OwnerReply, raised_metrics
from fedudp.stopping import RunInterrupted, StopSignals

__all__ = [
    "Params",
    "Collected",
    "Evaluation",
    "Transport",
    "RoundsResult",
    "summarize",
    "run_rounds",
    "completion_notes",
]

Params = dict[str, torch.Tensor]


@dataclass
class Collected:
    """The cohort's replies, and the owners excluded from the round with their reasons.

    Attributes
    ----------
    replies : list[OwnerReply]
        The answering owners' replies (their shared parts, private data).
    failures : list[Failure]
        The owners excluded from the round, with their reasons.
    observed : dict
        The simulator's own observations of the owners (``sim_*``: e.g. a distributed
        mechanism's user counts and modular wraps), written to the round's metrics line; the
        billboard never reads them.
    gone : str
        Non-empty: no owner can answer again (every Ray actor of a Flower run is lost: the
        cluster is gone), and why. The round is withheld or released as its failures say, and
        the run ends ``failed`` with this reason (resumable elsewhere) instead of withholding
        every remaining round.
    """

    replies: list[OwnerReply]
    failures: list[Failure] = field(default_factory=list)
    observed: dict = field(default_factory=dict)
    gone: str = ""


@dataclass
class Evaluation:
    """Each owner's test accuracy and loss (NaN for an owner that failed to answer).

    Attributes
    ----------
    accuracy, loss : np.ndarray
        Each owner's test accuracy and loss, shape ``[owners]``.
    failures : list[Failure]
        The owners that failed to answer, with their reasons.
    """

    accuracy: np.ndarray
    loss: np.ndarray
    failures: list[Failure] = field(default_factory=list)


class Transport(Protocol):
    """How an engine reaches its owners (in-process vectorized, or Flower messages).

    Attributes
    ----------
    stop_flag : StopFlag, optional
        Where present, the main thread's flag ``run_rounds`` polls when it runs outside the
        main thread (Flower's ServerApp).
    """

    def train(self, shared: Params, cohort: np.ndarray | None, round_: int) -> Collected:
        """Owners update their personal parameters; those with sampled units (``cohort``: the
        billboard's unit ids, None without a billboard) reply with their shared parts."""
        ...

    def evaluate(
        self, shared: Params, round_: int, while_waiting: Callable[[], None] | None = None
    ) -> Evaluation:
        """Every owner scores ``shared`` with its own personal parameters; ``while_waiting``
        runs on the server meanwhile (or before, for an engine that cannot overlap)."""
        ...

    def personal(self) -> Params:
        """The personal parameters the server can see (the local engine's; {} for Flower)."""
        ...

    def info(self) -> dict:
        """Engine facts for summary.json."""
        ...

    def will_checkpoint(self, round_: int, folder: Path) -> None:
        """Round ``round_`` will be checkpointed (owners that keep their own state save it to
        ``folder`` while they train)."""
        ...

    def checkpoint_state(self, round_: int) -> dict | None:
        """The owners' state after ``round_`` as a checkpoint holds it (None: it cannot be
        checkpointed this round)."""
        ...

    def restore(self, state: dict, folder: Path) -> None:
        """Continue from ``checkpoint_state`` (``folder``: where owners saved their own state)."""
        ...


@dataclass
class RoundsResult:
    """What ``run_rounds`` returns.

    Attributes
    ----------
    shared, personal : Params
        The final shared (released) parameters; the personal ones the server sees.
    owner_accuracy, owner_loss : np.ndarray
        Each owner's last test accuracy and loss, shape ``[owners]``.
    rounds_completed : int
        Rounds released (or withheld) before the stop.
    stop_reason : str
        ``completed``, ``budget``, ``halted``, ``diverged``, ``interrupted`` or ``failed``.
    history : list[dict]
        The per-round metrics lines.
    extra : dict
        The transport's engine facts (``Transport.info``).
    message : str
        Why a run diverged, failed or was interrupted, or its completion notes (one line).
    signum : int or None
        The signal that interrupted it.
    """

    shared: Params
    personal: Params
    owner_accuracy: np.ndarray
    owner_loss: np.ndarray
    rounds_completed: int
    stop_reason: str  # completed | budget | halted | diverged | interrupted | failed
    history: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    message: str = ""  # why a run diverged or was interrupted (one line)
    signum: int | None = None  # the signal that interrupted it


def summarize(acc: np.ndarray, loss: np.ndarray, sizes: np.ndarray) -> dict:
    """Mean / std / test-size-weighted accuracy and mean loss over owners with test records.

    Parameters
    ----------
    acc, loss
        Each owner's accuracy and loss.
    sizes
        Each owner's test records (owners with none, or a non-finite accuracy, are left out).

    Returns
    -------
    dict
        ``accuracy_mean``, ``accuracy_std``, ``accuracy_weighted``, ``loss`` (None when no owner
        counts).
    """
    ok = (sizes > 0) & np.isfinite(acc)
    if not ok.any():
        return {
            "loss": None,
            "accuracy_mean": None,
            "accuracy_std": None,
            "accuracy_weighted": None,
        }
    w = sizes[ok] / sizes[ok].sum()
    return {
        "loss": float(np.mean(loss[ok])),
        "accuracy_mean": float(np.mean(acc[ok])),
        "accuracy_std": float(np.std(acc[ok])),
        "accuracy_weighted": float(np.sum(w * acc[ok])),
    }


def _failures(kind: str, failures: list[Failure]) -> dict:
    if not failures:
        return {f"failed_{kind}_owners": 0}
    return {
        f"failed_{kind}_owners": len(failures),
        f"failed_{kind}": [
            {"owner": f.owner, "units": f.units, "reason": f.reason} for f in failures
        ],
    }


def _loop_state(
    billboard: Billboard | None, transport: Transport, round_: int, history: list[dict]
) -> dict:
    """A checkpoint after ``round_`` (``fedudp.protocol.checkpoint``): billboard, transport, the
    metrics so far. Everything else a round draws is keyed by (seed, purpose, round)."""
    from fedudp.plain import jsonable

    return {
        "billboard": billboard.state() if billboard is not None else None,
        "transport": transport.checkpoint_state(round_),
        "history": json.dumps(jsonable(history)),
    }


def _restore_loop(
    state: dict, billboard: Billboard | None, transport: Transport, checkpoint: Checkpointer
) -> tuple[int, list[dict]]:
    """(round, metrics so far) of a checkpoint, billboard and transport restored from it."""
    if (billboard is None) != (state["billboard"] is None):
        raise CheckpointError("written by a run with another billboard")
    if billboard is not None:
        billboard.restore(state["billboard"])
    r = int(state["round"])
    transport.restore(state["transport"], checkpoint.owners_dir(r))
    return r, json.loads(state["history"])


def _save_checkpoint(
    checkpoint: Checkpointer,
    billboard: Billboard | None,
    transport: Transport,
    round_: int,
    history: list[dict],
) -> None:
    """Round ``round_``'s checkpoint, unless the billboard or the transport cannot give its
    state this round (a Flower owner did not save its own; a training algorithm's plan that
    keeps no checkpointable state): then the previous checkpoint stays the newest."""
    try:
        state = _loop_state(billboard, transport, round_, history)
        if state["transport"] is None:
            raise CheckpointError("an owner did not save its state")
    except CheckpointError as e:
        if str(e) not in checkpoint.warned:  # once per reason, not every round
            checkpoint.warned.add(str(e))
            warn(f"round {round_}: no checkpoint ({e}); the previous one stays the newest")
        return
    checkpoint.save(round_, state)


def run_rounds(
    rounds: int,
    eval_every: int,
    billboard: Billboard | None,
    transport: Transport,
    test_sizes: np.ndarray,
    on_round: Callable[[dict], None] | None = None,
    checkpoint: Checkpointer | None = None,
) -> RoundsResult:
    """Run up to ``rounds`` rounds; ``test_sizes`` weight the accuracy summary. With
    ``checkpoint``, a checkpoint after every ``checkpoint.every``-th completed round, and a
    run that starts from ``checkpoint.resumed`` (a resumed run) if it is set.

    Parameters
    ----------
    rounds, eval_every, billboard, transport, test_sizes, on_round, checkpoint
        Evaluate every ``eval_every``-th round and the last; no billboard: nothing released.

    Returns
    -------
    RoundsResult"""
    bb = billboard
    done, stop, message, signum = 0, "completed", "", None
    history: list[dict] = []
    withheld: list[str] = []  # this run's withheld rounds (fail closed), why
    if checkpoint is not None and checkpoint.resumed is not None:
        done, history = _restore_loop(checkpoint.resumed, bb, transport, checkpoint)
    shared = bb.shared_params() if bb is not None else {}
    ev: Evaluation | None = None
    budget_ok: bool | None = None  # next round's check, computed while owners evaluate

    def check_budget() -> None:
        nonlocal budget_ok
        budget_ok = bb.within_budget() if bb is not None else True

    def record(info: dict, t0: float) -> None:
        info["seconds"] = time.perf_counter() - t0
        history.append(info)
        if on_round is not None:
            on_round(info)

    with StopSignals(getattr(transport, "stop_flag", None)) as signals:
        for r in range(done + 1, rounds + 1):
            t0 = time.perf_counter()
            try:
                signals.check()
                if budget_ok is None:
                    check_budget()
                ok, budget_ok = budget_ok, None
                if not ok:
                    stop = "budget"
                    break
                cohort = np.flatnonzero(bb.sample(r)) if bb is not None else None
                got, info = _train_round(transport, shared, cohort, r, checkpoint)
                with signals.critical():  # released, ledgered and recorded, or none of it
                    if bb is not None and cohort is not None:
                        released, stop, message = _release_round(bb, r, got, cohort, info, withheld)
                        if released:
                            shared = bb.shared_params()
                    done = r
                    if got.gone and stop == "completed":  # no owner can answer again
                        stop, message = "failed", f"round {r}: {got.gone}; stopped after it"
                if stop == "completed" and (r % eval_every == 0 or r == rounds):
                    ev = transport.evaluate(shared, r, check_budget if r < rounds else None)
                    info.update(summarize(ev.accuracy, ev.loss, test_sizes))
                    info.update(_failures("eval", ev.failures))
                with signals.critical():
                    record(info, t0)
                    if stop == "completed" and checkpoint is not None and checkpoint.due(r):
                        _save_checkpoint(checkpoint, bb, transport, r, history)
            except RunInterrupted as e:
                stop, signum = "interrupted", e.signum
                if done == r and (not history or history[-1] is not info):
                    record(info, t0)  # released before the signal: recorded, unevaluated
                message = f"{e} in round {r}: stopped after round {done}" + (
                    "" if done == r else f", nothing of round {r} released"
                )
                break
            if stop != "completed":
                break
    stop, message = _run_end(stop, message, withheld, bb, history, done)
    return _result(transport, shared, ev, test_sizes, done, stop, history, message, signum)


def _train_round(
    transport: Transport,
    shared: Params,
    cohort: np.ndarray | None,
    r: int,
    checkpoint: Checkpointer | None,
) -> tuple[Collected, dict]:
    """Round ``r``'s training on the owners (told first when a checkpoint is due after it):
    what they sent, and the round's metrics line so far (failures, users dropped alone)."""
    if checkpoint is not None and checkpoint.due(r):
        transport.will_checkpoint(r, checkpoint.owners_dir(r))
    got = transport.train(shared, cohort, r)
    info: dict = {"round": r, "failed_owners": len(got.failures)}
    if got.failures:
        info["failures"] = _failures("train", got.failures)["failed_train"]
    info.update(raised_metrics(got.replies))  # users dropped alone (isolate)
    info.update(got.observed)  # the simulator's observations (never the billboard's input)
    return got, info


def _result(
    transport: Transport,
    shared: Params,
    ev: Evaluation | None,
    test_sizes: np.ndarray,
    done: int,
    stop: str,
    history: list[dict],
    message: str,
    signum: int | None,
) -> RoundsResult:
    """The run's result, with a final evaluation when the last recorded round has none (not
    after an interrupt: NaN accuracies when nothing was evaluated)."""
    if stop != "interrupted" and (ev is None or (history and "accuracy_mean" not in history[-1])):
        ev = transport.evaluate(shared, done)
    if ev is None:  # interrupted before any evaluation
        n = len(test_sizes)
        ev = Evaluation(np.full(n, np.nan), np.full(n, np.nan))
    return RoundsResult(
        shared,
        transport.personal(),
        ev.accuracy,
        ev.loss,
        done,
        stop,
        history,
        transport.info(),
        message,
        signum,
    )


def _release_round(
    bb: Billboard,
    r: int,
    got: Collected,
    cohort: np.ndarray,
    info: dict,
    withheld: list[str],
) -> tuple[bool, str, str]:
    """Round ``r``'s release on the billboard from the owners' replies, or its withholding when
    too few owners answered or they hold too few declared user slots (fail closed,
    ``Billboard.withhold``: decided from which owners failed and their public capacities, never
    from the sample; nothing released, the reason appended to ``withheld``). Fills the round's
    ``info``; returns (released, stop, message): stop is "completed" to go on, "halted" (the
    estimator stopped), "diverged", or "failed" (a training algorithm's schedule cannot skip a
    withheld round)."""
    lost = sum(f.units for f in got.failures)
    why = bb.withhold(r, [f.owner for f in got.failures])
    if why is not None:  # fail closed: nothing released this round
        withheld.append(f"round {r}: {why}")
        info.update(cohort=len(cohort), failed_units=lost, withheld=why)
        if bb.plan is not None:
            return (
                False,
                "failed",
                (
                    f"round {r} withheld ({why}); a training algorithm's schedule "
                    "cannot skip a round: stopped"
                ),
            )
        return False, "completed", ""
    agg = bb.release(got.replies, r, bb.answered_owners([f.owner for f in got.failures]))
    failed = sum(rep.failed for rep in got.replies) + sum(f.units for f in got.failures)
    info.update(
        cohort=len(cohort),
        failed_units=failed,
        users_used=agg.users_used,
        **{f"agg_{k}": v for k, v in agg.diagnostics.items()},
    )
    if bb.ledger.entries:
        info["epsilon"] = bb.ledger.entries[-1].epsilon
    if agg.halted:
        return True, "halted", ""
    if bb.diverged:
        return (
            True,
            "diverged",
            (
                f"round {r}: the shared parameters became non-finite (kept at their "
                "last finite value); likely cause: train.lr or train.server_lr too large"
            ),
        )
    # a round whose every live sampled unit sent a non-finite vector: in a private run a
    # diagnostic, never a stop, since whether the run goes on would then depend on those users'
    # data (a neighbour without them releases the noise alone and continues) and on the secret
    # sample; the run's end names such rounds (``completion_notes``), and a real divergence
    # shows in the released parameters (``bb.diverged`` above, post-processing of the
    # release). A run without privacy (no accountant) stops there, as it always did.
    live = len(cohort) - lost
    if live > 0 and failed - lost >= live:
        if bb.accountant is None:
            return (
                True,
                "diverged",
                (
                    f"round {r}: every sampled unit failed ({failed} of {len(cohort)}: "
                    "non-finite vectors or failed owners); likely cause: train.lr too large"
                ),
            )
        info["all_units_nonfinite"] = True
    return True, "completed", ""


def _run_end(
    stop: str,
    message: str,
    withheld: list[str],
    bb: Billboard | None,
    history: list[dict],
    done: int,
) -> tuple[str, str]:
    """A completed run's final (stop, message): ``failed`` when every round was withheld
    (nothing released, no ε spent), else its ``completion_notes``."""
    if stop != "completed":
        return stop, message
    if withheld and bb is not None and not bb.ledger.entries:
        return "failed", (
            f"every round was withheld (owners failed), nothing released, "
            f"no epsilon spent; {withheld[-1]}"
        )
    return stop, message or completion_notes(history, done)


def completion_notes(history: Sequence[Mapping[str, Any]], done: int) -> str:
    """The one-line note of a run that completed with rounds that released nothing (withheld,
    fail closed) or in which every sampled unit's vector was non-finite ('' when there were
    none): the summary's ``stop_message``, so that such a run does not read as a plain
    ``completed``. Both engines' round loop calls it (``drive``).

    Parameters
    ----------
    history : Sequence[Mapping[str, Any]]
        The per-round metrics lines.
    done : int
        Rounds completed.

    Returns
    -------
    str
        The note, '' when no round was withheld or all non-finite.
    """
    held = [int(h["round"]) for h in history if h.get("withheld") and "round" in h]
    empty = [int(h["round"]) for h in history if h.get("all_units_nonfinite") and "round" in h]

    def rounds(xs: list[int]) -> str:
        return ", ".join(map(str, xs[:20])) + (" ..." if len(xs) > 20 else "")

    notes = []
    if held:
        notes.append(
            f"{len(held)} of {done} rounds withheld (rounds {rounds(held)}): nothing released "
            "in them, no epsilon spent for them"
        )
    if empty:
        notes.append(
            f"{len(empty)} released round(s) in which every sampled unit's vector was "
            f"non-finite (rounds {rounds(empty)}; released the noise alone, accounted); likely "
            "cause: train.lr too large"
        )
    return "; ".join(notes)
