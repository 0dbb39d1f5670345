"""The runner: config -> checks (once) -> prepared run -> engine -> outputs
(docs/architecture.md#configuration-and-outputs); the ``fedudp`` command line that drives it
through Hydra is ``fedudp.cli``, the Python API (``fedudp.simulate``) calls it too.

``fedudp method=joint_dp privacy.epsilon=1 -m partition.num_owners=4,16,64``. One call is
one run; each run writes to its Hydra output folder: ``config.yaml`` (resolved),
``metrics.jsonl`` (one line per round, appended as it happens), ``owners.csv``,
``ledger.json`` and ``summary.json``; with ``tracking=mlflow|tensorboard`` the run is also
logged there (``fedudp.tracking``, docs/tracking.md). The run folder's own rules (another run's
folder, a finished run, resuming) are ``fedudp.run_folder``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from fedudp import notices, tracking
from fedudp.billboard.rounds import RoundsResult, Transport, run_rounds, summarize
from fedudp.build import (
    Checked,
    Prepared,
    RunSettings,
    check_config,
    prepare,
    run_guarantee,
    warn_min_users,
)
from fedudp.config import ConfigError, RunConfig, config_dict, jsonable
from fedudp.engines import execute_for
from fedudp.engines import require as require_engine
from fedudp.privacy.labels import epsilon_display, labelled_epsilon
from fedudp.protocol import checkpoint as checkpoints
from fedudp.protocol import ledger_file
from fedudp.provenance import provenance
from fedudp.run_folder import (
    check_resumable,
    finished_summary,
    start_outputs,
    write_owners,
)

__all__ = [
    "run",
    "run_with_result",
    "RunOutcome",
    "execute",
    "prepare",
    "Prepared",
    "summary_of",
]


def execute(
    p: Prepared,
    on_round: Callable[[dict], None] | None = None,
    grid: Any = None,
    checkpoint: checkpoints.Checkpointer | None = None,
) -> RoundsResult:
    """The round loop on the configured engine (``grid``: ``flwr run``'s, for engine=flower;
    ``checkpoint``: where and how often it checkpoints, and the state a resumed run starts
    from).

    Parameters
    ----------
    p : Prepared
        The prepared run (``fedudp.build.prepare``).
    on_round : Callable[[dict], None] or None
        Called with each round's metrics line.
    grid : Any, default None
        ``flwr run``'s grid (engine=flower only).
    checkpoint : Checkpointer or None
        The checkpointing (None: no checkpoints).

    Returns
    -------
    RoundsResult
        The round loop's result (final parameters, history, stop reason).
    """
    on_engine = execute_for(p.settings.engine)  # the engine registry (fedudp.engines)
    t = p.settings

    def drive(transport: Transport) -> RoundsResult:
        return run_rounds(
            t.rounds,
            t.eval_every,
            p.billboard,
            transport,
            np.diff(p.fed.test_offsets),
            on_round,
            checkpoint=checkpoint,
        )

    agg = p.aggregator  # asked each round: an adaptive clip changes between rounds
    constraint = (lambda: agg.constraint) if agg is not None else None
    return on_engine(p.cfg, p.settings, p.owners, p.fed, constraint, drive, grid=grid)


class RunOutcome(NamedTuple):
    """What one run gave (``run_with_result``).

    Attributes
    ----------
    summary : dict
        summary.json's content (``skipped: true`` for a run that had finished before).
    result : RoundsResult or None
        The round loop's result (final parameters, history); None for a skipped run.
    prepared : Prepared or None
        The prepared run (its ledger); None for a skipped run.
    folder : Path or None
        The run folder (``resume``'s where set); None for a run in memory.
    """

    summary: dict
    result: RoundsResult | None
    prepared: Prepared | None
    folder: Path | None


def run(
    cfg: RunConfig, out_dir: str | Path, grid: Any = None, *, sweep: tracking.Sweep | None = None
) -> dict:
    """One fedudp run in ``out_dir``; returns summary.json's content (``run_with_result``).

    Parameters
    ----------
    cfg : RunConfig
        The run's configuration.
    out_dir : str or Path
        The run folder (see ``run_with_result``).
    grid : Any, default None
        ``flwr run``'s grid (engine=flower).
    sweep : tracking.Sweep or None
        The Hydra sweep this run is a job of.

    Returns
    -------
    dict
        summary.json's content (``skipped: true`` where the run had finished before).

    Raises
    ------
    ConfigError
        A bad configuration, named, before any work.
    """
    return run_with_result(cfg, out_dir, grid, sweep=sweep).summary


def run_with_result(
    cfg: RunConfig,
    out_dir: str | Path | None,
    grid: Any = None,
    *,
    model_object: Any = None,
    records: Any = None,
    sweep: tracking.Sweep | None = None,
) -> RunOutcome:
    """One fedudp run: the configuration checked once (``fedudp.build.check_config``: the
    schema's ``validate``, the plugins, the names, the device, and the run's settings), the run
    prepared, executed and written.

    Parameters
    ----------
    cfg : RunConfig
        The run's configuration.
    out_dir : str or Path or None
        The run folder. A run of the same config that already finished there is not run
        again (its summary is returned, ``skipped: true``). metrics.jsonl and ledger.jsonl are
        appended and flushed every round; summary.json is written whatever the stop reason
        (also when the run fails, before the error propagates). With ``resume=<run folder>``
        (``out_dir`` is then ignored) the run in that folder continues from its newest usable
        checkpoint: same files, no round twice. Once the run has finished,
        ``checkpoint.keep_after_finish`` says which checkpoints stay. None: the run stays in
        memory (no file, no tracking, no progress bar; ``resume`` is not read).
    grid : Any
        ``flwr run``'s grid (engine=flower).
    model_object, records : Any
        Your own model and in-memory records (the Python API).
    sweep : tracking.Sweep or None
        The Hydra sweep this run is a job of (a tracked sweep's runs are children of one
        parent run; a resumed run is tracked on its own).

    Returns
    -------
    RunOutcome
        summary.json's content, the round loop's result, the prepared run and the folder.

    Raises
    ------
    ConfigError
        A bad configuration, named, before any work.
    """
    t_start = time.perf_counter()
    source = provenance()  # the code that runs: read at the start, not when the run ends
    checked = check_config(cfg)  # the run's one validate and one settings
    s = checked.settings
    if out_dir is None:
        return _in_memory(checked, grid, model_object, records, source)
    tracking.require(s.tracking)  # the extra's package, before any work
    require_engine(s.engine)  # engine=flower without the flower extra: one line, before any work
    resume = s.resume
    if resume:
        out_dir = resume
        sweep = None  # a resumed run is tracked on its own
        check_resumable(Path(out_dir), cfg)
    objects = model_object is not None or records is not None
    if objects and (resume or (Path(out_dir) / "config.yaml").exists()):
        # the config does not identify a Python object: such a run is never skipped or resumed
        raise ConfigError(
            f"{out_dir}: a run with a model object or in-memory records needs a "
            "new output folder (its config does not identify them)"
        )
    done = finished_summary(cfg, out_dir)
    if done is not None:
        return RunOutcome({**done, "skipped": True}, None, None, Path(out_dir))
    p = prepare(cfg, model_object=model_object, records=records, checked=checked)
    return _in_folder(p, Path(out_dir), grid, sweep, t_start, source)


def _in_memory(
    checked: Checked, grid: Any, model_object: Any, records: Any, source: dict
) -> RunOutcome:
    """A run without a folder (``fedudp.simulate`` without ``out``): prepared, executed and
    summarized in memory (its ``seconds`` not timed)."""
    kind = checked.settings.tracking
    if kind != "none":
        raise ConfigError(
            f"tracking.kind={kind}: logs a run folder's run; give simulate "
            "an out=<folder> (or leave tracking.kind=none)"
        )
    require_engine(checked.settings.engine)
    cfg = checked.cfg
    p = prepare(cfg, model_object=model_object, records=records, checked=checked)
    res = execute(p, None, grid)
    return RunOutcome(summary_of(cfg, p, res, source=source), res, p, None)


def _in_folder(
    p: Prepared,
    out_dir: Path,
    grid: Any,
    sweep: tracking.Sweep | None,
    t_start: float,
    source: dict,
) -> RunOutcome:
    """The prepared run on its engine, its folder written round by round and at the end."""
    cfg, s = p.cfg, p.settings
    metrics_path = out_dir / "metrics.jsonl"
    out, ckpt, sink, resumed_round = start_outputs(cfg, out_dir, s.resume, p, metrics_path)
    if p.billboard is not None:  # each release durable in ledger.jsonl before it leaves
        p.billboard.ledger_sink = sink.append
    tracker = _tracker(cfg, p, out, sweep, resumed_round)
    bar = _progress(s)
    heuristic = p.spec.private and run_guarantee(p.spec, p.aggregator) == "heuristic"
    shown: dict = {}  # the bar's postfix after the last round (accuracy, ε)
    if bar is not None:
        p.owners.on_progress = _in_round(bar, shown)
    on_round = _RoundWriter(p, metrics_path, sink, tracker, bar, heuristic, shown)
    if (notice := notices.rounds_notice(s.rounds, resumed_round or 0)) is not None:
        tracking.warn(notice)  # before round 1: a run of very many rounds says so

    res = None
    try:
        res = execute(p, on_round, grid, ckpt)
    except BaseException as e:
        failed = _write_outputs(
            cfg, p, out, None, t_start, error=f"{type(e).__name__}: {e}", source=source
        )
        tracker.finish(failed, out)
        if isinstance(e, checkpoints.CheckpointError):
            raise ConfigError(f"resume={out}: the checkpoint does not fit this run: {e}") from None
        raise
    finally:
        p.owners.on_progress = None
        if bar is not None:
            bar.close()
    if p.billboard is not None:  # a seeded resume's earlier releases not made again: composed
        p.billboard.settle_rereleases()
    summary = _write_outputs(cfg, p, out, res, t_start, source=source)
    if summary["stop_reason"] not in ("interrupted", "failed"):
        # finished: never resumed (a re-run is skipped), so only what the policy keeps stays
        checkpoints.keep_after_finish(out, s.keep_after_finish)
    tracker.finish(summary, out)
    return RunOutcome(summary, res, p, out)


class _RoundWriter:
    """``on_round`` of a run with a folder: the round's metrics line appended (and flushed:
    the file is whole after every round), the round logged to the tracker and shown on the
    progress bar (a heuristic ε is never shown bare). ledger.jsonl's lines were written by the
    billboard's ledger sink (``ledger``) before the round's release left it; an entry that
    reached the ledger another way is written here."""

    def __init__(
        self,
        p: Prepared,
        metrics_path: Path,
        ledger: ledger_file.LedgerFile,
        tracker: tracking.Tracker,
        bar: Any,
        heuristic: bool,
        shown: dict,
    ) -> None:
        self.p, self.metrics_path, self.ledger = p, metrics_path, ledger
        self.tracker, self.bar, self.heuristic, self.shown = tracker, bar, heuristic, shown
        # the ε's kind (certified, heuristic, weakened; None: no DP): its metric's name
        self.kind = run_guarantee(p.spec, p.aggregator) if p.spec.private else None
        self.timed = 0  # rounds this process ran: the second's speed estimates the run's length

    def __call__(self, info: dict) -> None:
        self.ledger.extend(self.p.ledger.entries[self.ledger.written :])
        # a heuristic (or weakened) ε is never logged under the bare name "epsilon"
        line = labelled_epsilon(info, self.kind)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(jsonable(line)) + "\n")
        self.tracker.log_round(line)
        self.timed += 1
        if self.timed == 2 and isinstance(info.get("seconds"), (int, float)):
            rounds, r = self.p.settings.rounds, int(info.get("round", 0))
            if (notice := notices.speed_notice(rounds, r, float(info["seconds"]))) is not None:
                tracking.warn(notice)
        if self.bar is not None:
            self.bar.update(1)
            eps_key = "eps (heuristic)" if self.heuristic else "eps"
            post = {"acc": info.get("accuracy_mean"), eps_key: info.get("epsilon")}
            self.shown.clear()
            self.shown.update({k: f"{v:.3f}" for k, v in post.items() if v is not None})
            self.bar.set_postfix(self.shown)


def _tracker(
    cfg: RunConfig, p: Prepared, out: Path, sweep: tracking.Sweep | None, resumed_round: int | None
) -> tracking.Tracker:
    """The run's tracker (``tracking.kind``; none: one that does nothing). A resumed run's
    rounds so far (metrics.jsonl) go to the tracked run where it does not hold them yet."""
    s = p.settings
    if s.tracking == "none":
        return tracking.Tracker()
    guarantee = run_guarantee(p.spec, p.aggregator) if p.spec.private else "none"
    tags = {
        "method": s.method,
        "aggregator": p.aggregator.name if p.aggregator else "none",
        "placement": s.placement or "none",
        "accounting": s.accounting if s.private else "none",
        "guarantee": guarantee,
        "engine": s.engine,
        "dataset": s.dataset,
        "unit": p.ledger.unit,
        "seed": s.seed,
    }
    t = tracking.start(
        s.tracking,
        out,
        uri=s.tracking_uri,
        experiment=s.tracking_experiment,
        config=config_dict(cfg),
        tags=tags,
        sweep=sweep,
        resumed_round=resumed_round,
    )
    if resumed_round is not None:
        t.backfill(
            [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        )
    return t


def _write_outputs(
    cfg: RunConfig,
    p: Prepared,
    out: Path,
    res: RoundsResult | None,
    t_start: float,
    error: str | None = None,
    *,
    source: dict | None = None,
) -> dict:
    """owners.csv, ledger.json and summary.json for whatever happened (``res`` None: failed)."""
    if res is not None:
        write_owners(out / "owners.csv", p.fed, res)
    (out / "ledger.json").write_text(json.dumps(jsonable(p.ledger.to_dict()), indent=2))
    summary = summary_of(cfg, p, res, t_start, error, source=source)
    (out / "summary.json").write_text(json.dumps(jsonable(summary), indent=2))
    return summary


def run_event_json(p: Prepared) -> dict | None:
    """The billboard accountant's composed event as JSON, where it is one ``DpEvent``."""
    from fedudp.privacy.accountant import Accountant
    from fedudp.privacy.events import event_to_json

    acc = getattr(p.billboard, "accountant", None) if p.billboard is not None else None
    ev = acc.composed_event() if isinstance(acc, Accountant) else None
    return event_to_json(ev) if ev is not None else None


def summary_of(
    cfg: RunConfig,
    p: Prepared,
    res: RoundsResult | None,
    t_start: float | None = None,
    error: str | None = None,
    *,
    source: dict | None = None,
) -> dict:
    """summary.json's content for a run that ended with ``res`` (None: failed with ``error``);
    ``seconds`` counts from ``t_start`` (None: not timed).

    Parameters
    ----------
    cfg : RunConfig
        The configuration.
    p : Prepared
        The prepared run (its federation, ledger, aggregator, settings).
    res : RoundsResult or None
        The round loop's result; None: the run failed.
    t_start : float or None
        ``time.perf_counter()`` at the start.
    error : str or None
        The failure's message (the stop message of a failed run).
    source : dict or None
        The code's provenance as read at the start (None: read now).

    Returns
    -------
    dict
        Accuracy (mean, std, weighted), loss, ε and its kind, rounds, stop reason, ... .
    """
    fed, spec, ledger, aggregator, s = p.fed, p.spec, p.ledger, p.aggregator, p.settings
    n = fed.num_owners
    summ = summarize(
        res.owner_accuracy if res is not None else np.full(n, np.nan),
        res.owner_loss if res is not None else np.full(n, np.nan),
        np.diff(fed.test_offsets),
    )
    live = [e for e in ledger.entries if not e.superseded]
    summary = {
        "method": s.method,
        "aggregator": aggregator.name if aggregator else "none",
        "placement": s.placement,
        "engine": s.engine,
        "dataset": s.dataset,
        "accuracy_mean": summ["accuracy_mean"],
        "accuracy_std": summ["accuracy_std"],
        "accuracy_weighted": summ["accuracy_weighted"],
        "loss": summ["loss"],
        **_privacy_fields(p),
        "rounds_completed": res.rounds_completed if res is not None else len(live),
        "rounds_planned": s.rounds,
        "stop_reason": res.stop_reason if res is not None else "failed",
        "stop_message": _stop_message(res, ledger, s.target_epsilon) if res is not None else error,
        # every release made, composed into epsilon: superseded ones were made before a resume
        # and their rounds computed again (docs/usage.md#checkpoint-and-resume)
        "releases_made": len(ledger.entries),
        "releases_superseded": len(ledger.entries) - len(live),
        "num_owners": fed.num_owners,
        "num_users": fed.num_users,
        "num_records": fed.num_records,
        "shared_dim": p.billboard.dim if p.billboard is not None else 0,
        "seconds": time.perf_counter() - t_start if t_start is not None else None,
        # the run's whole privacy spend as one dp-accounting event (fedudp.privacy.events), for
        # the privacy cost of choosing among runs (fedudp-report --select-best); None where the
        # ledger composes blocks without an event or per-owner / group-privacy accountants
        "dp_event": run_event_json(p) if spec.private else None,
        # what produced this folder: fedudp's version, the source commit, a modified checkout,
        # as read when the run started (``source``; None: read now)
        **(source if source is not None else provenance()),
    }
    _add_run_extras(summary, p, res)
    return summary


def _privacy_fields(p: Prepared) -> dict:
    """summary.json's ε and what kind of number it is, the budget, the unit, the guarantee."""
    spec, ledger, aggregator, s = p.spec, p.ledger, p.aggregator, p.settings
    guarantee = run_guarantee(spec, aggregator) if spec.private else "none"
    epsilon = ledger.epsilon if spec.private else None
    # epsilon stays a number for programs; epsilon_kind (beside it) says whether it is a proven
    # bound, epsilon_display is the text every fedudp output prints for it ("1.000 (heuristic)")
    kind = guarantee if spec.private else None
    return {
        "epsilon": epsilon,
        "epsilon_kind": kind,
        "epsilon_display": epsilon_display(epsilon, kind),
        "epsilon_rdp": ledger.entries[-1].epsilon_rdp
        if (spec.private and ledger.entries)
        else None,
        "target_epsilon": s.target_epsilon,
        "delta": s.delta,
        "unit": ledger.unit,
        "adjacency": ledger.adjacency,
        "accounting": ledger.accounting,
        "guarantee": guarantee,
        "noise_multiplier": aggregator.noise_multiplier if spec.private and aggregator else None,
    }


def _add_run_extras(summary: dict, p: Prepared, res: RoundsResult | None) -> None:
    """The canary estimate, the training algorithm's summary and what the round loop adds."""
    est = p.billboard.canary_estimate() if p.billboard is not None else None
    if est is not None:  # audit.canaries: an estimate beside the ledger's ε, not a bound
        summary.update(est)
    if p.algorithm is not None:
        summary["algorithm"] = p.algorithm.summary
    if res is not None:
        summary.update(res.extra)
        summary.update(warn_min_users(p.aggregator))
        if res.stop_reason == "halted":
            summary["halted_at_round"] = int(res.rounds_completed)
        if res.signum is not None:
            summary["signal"] = int(res.signum)


def _stop_message(res: RoundsResult, ledger: Any, target: float | None) -> str:
    """The run's stop message; a budget stop of a resumed run whose earlier releases were
    composed says so."""
    superseded = sum(e.superseded for e in ledger.entries)
    if res.stop_reason != "budget" or not superseded or res.message:
        return res.message
    return (
        f"the next release would exceed privacy.epsilon={target:g}: {superseded} release(s) "
        "made before the run was resumed (their rounds computed again with fresh randomness) "
        "are composed into its epsilon"
    )


def _in_round(bar: Any, shown: dict, every: float = 0.5) -> Callable[[str, int, int], None]:
    """Progress inside a round on the round bar: the last round's postfix plus the current
    stage, e.g. ``users=1200/5000`` (owners' chunks done, or on engine=flower owners replied),
    redrawn at most every ``every`` seconds and when a stage completes."""
    last = [0.0]

    def tick(stage: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - last[0] < every:
            return
        last[0] = now
        bar.set_postfix({**shown, stage: f"{done}/{total}"})

    return tick


def _progress(s: RunSettings) -> Any:
    """The round bar on stderr, a tqdm (``progress=false``: None)."""
    if not s.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=s.rounds, desc=s.method, file=sys.stderr, leave=False)


if __name__ == "__main__":  # ``python -m fedudp.run``: the command line, as ``fedudp``
    from fedudp.cli import main

    main()
