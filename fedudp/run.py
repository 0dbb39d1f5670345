"""The runner: config -> federation -> engine -> outputs
(docs/architecture.md#configuration-and-outputs); the ``fedudp`` command line that drives it
through Hydra is ``fedudp.cli``.

``fedudp method=joint_dp privacy.epsilon=1 -m partition.num_owners=4,16,64``. One call is
one run; each run writes to its Hydra output folder: ``config.yaml`` (resolved),
``metrics.jsonl`` (one line per round, appended as it happens), ``owners.csv``,
``ledger.json`` and ``summary.json``; with ``tracking=mlflow|tensorboard`` the run is also
logged there (``fedudp.tracking``, docs/tracking.md).
"""

from __future__ import annotations

import csv
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedudp import notices, tracking
from fedudp.billboard.rounds import RoundsResult, Transport, run_rounds, summarize
from fedudp.build import (
    Prepared,
    RunSettings,
    prepare,
    run_guarantee,
    settings,
    warn_min_users,
)
from fedudp.config import (
    ConfigError,
    RunConfig,
    config_dict,
    jsonable,
    validate,
    with_schema_defaults,
)
from fedudp.engines import execute_for
from fedudp.engines import require as require_engine
from fedudp.privacy.accountant import LedgerEntry
from fedudp.privacy.labels import epsilon_display, labelled_epsilon
from fedudp.protocol import checkpoint as checkpoints
from fedudp.protocol import ledger_file
from fedudp.provenance import provenance

if TYPE_CHECKING:
    from fedudp.data.federation import Federation

__all__ = [
    "run",
    "run_with_result",
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
    from)."""
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


def _same_config(out: Path, cfg: RunConfig) -> bool | None:
    """Whether ``out/config.yaml`` is this config (``progress``, ``engine_opts.threads`` and
    ``engine_opts.device`` aside: they change how a run is shown and scheduled, not the
    experiment, though a thread count or a GPU can move float rounding); None if there is none
    (an unreadable one counts as another run's)."""
    path = out / "config.yaml"
    if not path.is_file():
        return None
    try:
        theirs = saved_config(path)
    except Exception:  # noqa: BLE001
        return False
    return comparable(theirs) == comparable(config_dict(cfg))


def saved_config(path: Path) -> dict:
    """A run's saved config.yaml with the current schema's defaults for keys it predates
    (``config.with_schema_defaults``)."""
    from omegaconf import OmegaConf

    return with_schema_defaults(OmegaConf.load(path))


def comparable(d: Any) -> Any:
    """A config dict without what changes how a run is shown, scheduled, checkpointed, tracked
    or resumed, not what it computes (``progress``, ``engine_opts.threads``,
    ``engine_opts.device``, ``checkpoint``, ``tracking``, ``resume``)."""
    if not isinstance(d, dict):
        return d
    d = {k: v for k, v in d.items() if k not in ("progress", "checkpoint", "tracking", "resume")}
    if isinstance(d.get("engine_opts"), dict):
        d["engine_opts"] = {
            k: v for k, v in d["engine_opts"].items() if k not in ("threads", "device")
        }
    return d


def config_differences(out: Path, cfg: RunConfig) -> list[str]:
    """Dotted keys where ``out/config.yaml`` and ``cfg`` differ (``comparable`` parts)."""
    theirs = comparable(saved_config(out / "config.yaml"))
    mine = comparable(config_dict(cfg))

    def diff(a: Any, b: Any, prefix: str) -> list[str]:
        if isinstance(a, dict) and isinstance(b, dict):
            return [
                k
                for key in sorted(set(a) | set(b))
                for k in diff(a.get(key), b.get(key), f"{prefix}{key}.")
            ]
        return [] if a == b else [prefix.rstrip(".")]

    return diff(theirs, mine, "")


def finished_summary(cfg: RunConfig, out_dir: str | Path) -> dict | None:
    """summary.json of a run of this very config that already finished in ``out_dir`` (a
    re-run sweep skips it), else None. ``progress`` does not count; a run that stopped
    ``interrupted`` or ``failed`` has not finished."""
    out = Path(out_dir)
    if not (out / "summary.json").is_file() or not _same_config(out, cfg):
        return None
    try:
        summary = json.loads((out / "summary.json").read_text())
    except json.JSONDecodeError:
        return None
    return None if summary.get("stop_reason") in ("interrupted", "failed") else summary


OUTPUT_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "ledger.jsonl",
    "ledger.json",
    "owners.csv",
    "summary.json",
)


def _output_folder(out_dir: str | Path, cfg: RunConfig) -> Path:
    """The run's folder, writable. A folder holding another configuration's run is refused (runs
    are never mixed); an unfinished run of this very configuration is cleared and redone."""
    out = Path(out_dir)
    same = _same_config(out, cfg)
    if same is False:
        raise ConfigError(
            f"{out}: holds the outputs of another run (its config.yaml differs); "
            "choose another output folder (hydra.run.dir=...)"
        )
    for name in OUTPUT_FILES if same else ():
        (out / name).unlink(missing_ok=True)
    if same:
        checkpoints.remove_all(out)
        tracking.clear(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".fedudp_write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"{out}: cannot write the run's outputs there ({e.strerror or e})"
        ) from None
    return out


def run(
    cfg: RunConfig, out_dir: str | Path, grid: Any = None, *, sweep: tracking.Sweep | None = None
) -> dict:
    """One fedudp run in ``out_dir``; returns summary.json's content (``run_with_result``)."""
    return run_with_result(cfg, out_dir, grid, sweep=sweep)[0]


def run_with_result(
    cfg: RunConfig,
    out_dir: str | Path,
    grid: Any = None,
    *,
    model_object: Any = None,
    records: Any = None,
    sweep: tracking.Sweep | None = None,
) -> tuple[dict, RoundsResult | None, Prepared | None]:
    """One fedudp run; returns summary.json's content, the round loop's result (final
    parameters, history) and the prepared run (its ledger). A run of the same config that already
    finished in ``out_dir`` is not run again (its summary is returned, ``skipped: true``).
    metrics.jsonl and ledger.jsonl are appended and flushed every round; summary.json is
    written whatever the stop reason (also when the run fails, before the error propagates).
    With ``resume=<run folder>`` (``out_dir`` is then ignored) the run in that folder continues
    from its newest usable checkpoint: same files, no round twice. ``sweep``: the Hydra sweep
    this run is a job of (a tracked sweep's runs are children of one parent run). Once the run
    has finished, ``checkpoint.keep_after_finish`` says which checkpoints stay."""
    t_start = time.perf_counter()
    source = provenance()  # the code that runs: read at the start, not when the run ends
    validate(cfg)
    s = settings(cfg)
    tracking.require(s.tracking)  # the extra's package, before any work
    require_engine(s.engine)  # engine=flower without the flower extra: one line, before any work
    resume = s.resume
    if resume:
        out_dir = resume
        _check_resumable(Path(out_dir), cfg)
    objects = model_object is not None or records is not None
    if objects and (resume or (Path(out_dir) / "config.yaml").exists()):
        # the config does not identify a Python object: such a run is never skipped or resumed
        raise ConfigError(
            f"{out_dir}: a run with a model object or in-memory records needs a "
            "new output folder (its config does not identify them)"
        )
    done = finished_summary(cfg, out_dir)
    if done is not None:
        return {**done, "skipped": True}, None, None
    p = prepare(cfg, model_object=model_object, records=records)
    metrics_path = Path(out_dir) / "metrics.jsonl"
    out, ckpt, sink, resumed_round = _start_outputs(cfg, out_dir, resume, p, metrics_path)
    if p.billboard is not None:  # each release durable in ledger.jsonl before it leaves
        p.billboard.ledger_sink = sink.append
    tracker = _tracker(cfg, p, out, sweep, resumed_round)
    bar = _progress(p.settings)
    heuristic = p.spec.private and run_guarantee(p.spec, p.aggregator) == "heuristic"
    shown: dict = {}  # the bar's postfix after the last round (accuracy, ε)
    if bar is not None:
        p.owners.on_progress = _in_round(bar, shown)
    on_round = _RoundWriter(p, metrics_path, sink, tracker, bar, heuristic, shown)
    if (notice := notices.rounds_notice(p.settings.rounds, resumed_round or 0)) is not None:
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
    return summary, res, p


def _ledger_head(p: Prepared) -> dict:
    """ledger.jsonl's head line: the ledger without its entries and what they give."""
    return ledger_file.head(p.ledger)


def _start_outputs(
    cfg: RunConfig,
    out_dir: str | Path,
    resume: str | None,
    p: Prepared,
    metrics_path: Path,
) -> tuple[Path, checkpoints.Checkpointer, ledger_file.LedgerFile, int | None]:
    """The run folder, its checkpointer, the durable writer of ledger.jsonl (the billboard's
    ledger sink) and the round a resumed run starts from. A new run (``resume`` unset) writes
    its config.yaml, an empty metrics.jsonl and ledger.jsonl's head line; a resumed one
    continues from its newest usable checkpoint (``_resume_from``)."""
    ledger_path = Path(out_dir) / "ledger.jsonl"
    if resume:
        out = Path(out_dir)
        ckpt, written = _resume_from(out, cfg, p)
        resumed = ckpt.resumed
        assert resumed is not None  # _resume_from sets the checkpoint it resumes from
        return out, ckpt, ledger_file.LedgerFile(ledger_path, written), int(resumed["round"])
    out = _output_folder(out_dir, cfg)
    (out / "config.yaml").write_text(_to_yaml(config_dict(cfg)))
    metrics_path.write_text("")
    ledger_file.write(ledger_path, _ledger_head(p), [])
    return out, _checkpointer(out, cfg), ledger_file.LedgerFile(ledger_path), None


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


def _identity(cfg: RunConfig) -> str:
    """What a checkpoint must have been written by: this configuration (``comparable``)."""
    return json.dumps(comparable(config_dict(cfg)), sort_keys=True)


def _same_identity(cfg: RunConfig) -> Callable[[str], bool]:
    """A checkpoint's identity read through the current schema's defaults (as ``saved_config``
    reads an old config.yaml) equals this configuration's."""
    mine = comparable(config_dict(cfg))

    def same(identity: str) -> bool:
        from omegaconf import OmegaConf

        try:
            merged = OmegaConf.merge(
                OmegaConf.structured(RunConfig), OmegaConf.create(json.loads(identity))
            )
            theirs = jsonable(OmegaConf.to_container(merged, enum_to_str=True))
        except Exception:  # noqa: BLE001  (a key the schema no longer has: not this run)
            return False
        return comparable(theirs) == mine

    return same


def _checkpointer(out: Path, cfg: RunConfig) -> checkpoints.Checkpointer:
    s = settings(cfg)
    return checkpoints.Checkpointer(
        out,
        s.checkpoint_every,
        s.checkpoint_keep,
        _identity(cfg),
        same_identity=_same_identity(cfg),
    )


def _check_resumable(out: Path, cfg: RunConfig) -> None:
    """``resume=<folder>`` must name a run folder of this very configuration."""
    if not (out / "config.yaml").is_file():
        raise ConfigError(f"resume={out}: not a fedudp run folder (no config.yaml there)")
    if not _same_config(out, cfg):
        keys = config_differences(out, cfg) if (out / "config.yaml").is_file() else []
        raise ConfigError(
            f"resume={out}: that run's configuration differs from this one"
            + (f" in {', '.join(keys[:5])}" if keys else "")
            + f"; resume with the same overrides (see {out / 'config.yaml'})"
        )


def _resume_from(out: Path, cfg: RunConfig, p: Prepared) -> tuple[checkpoints.Checkpointer, int]:
    """Load the newest usable checkpoint in ``out`` (reporting each unusable one on stderr),
    cut metrics.jsonl back to its round and account for every release ledger.jsonl holds
    after it (``_releases_after``); returns the checkpointer and the number of entries
    ledger.jsonl then holds."""
    ckpt = _checkpointer(out, cfg)
    state = ckpt.load_latest()
    if state is None:
        raise ConfigError(
            f"resume={out}: no usable checkpoint (ckpt-*.pt) in that folder; "
            "run again without resume= to start it afresh"
        )
    history = json.loads(state["history"])
    entries = _releases_after(out, state, p)
    lines = [json.dumps(jsonable(h)) for h in history]
    checkpoints.atomic_write(out / "metrics.jsonl", "".join(x + "\n" for x in lines).encode())
    ledger_file.write(out / "ledger.jsonl", _ledger_head(p), entries)
    for name in ("ledger.json", "owners.csv", "summary.json"):  # rewritten at the end
        (out / name).unlink(missing_ok=True)
    return ckpt, len(entries)


def _releases_after(out: Path, state: dict, p: Prepared) -> list[LedgerEntry]:
    """The ledger a run resumed from checkpoint ``state`` starts with. Every release the
    killed run made is in its ledger.jsonl (durable before it left), also those after the
    checkpoint, whose rounds are computed again: a secure run's (fresh noise and sample) are
    each composed, marked ``superseded`` (the checkpoint's billboard recomposes them, so the
    budget check and ε count them; the run may stop earlier) and the head's
    ``extra.resumes`` says how many; a seeded run's are handed to the billboard, which
    composes any that its re-done round does not release again identically
    (``Billboard.rereleases``). ledger.jsonl is then the checkpoint's entries and these."""
    board = state["billboard"]
    if board is None:
        return []
    entries = [LedgerEntry(**e) for e in board["entries"]]
    secure = p.billboard is not None and p.billboard.randomness.is_secure
    try:
        got = ledger_file.after_checkpoint(out / "ledger.jsonl", entries, state["round"], secure)
        old_head, _ = ledger_file.read(out / "ledger.jsonl")
    except ValueError as e:
        raise ConfigError(f"resume={out}: {e}; its releases cannot be accounted") from None
    resumes = list((old_head.get("extra") or {}).get("resumes", []))
    if got.record is not None:
        resumes.append(got.record)
        checkpoints.warn(f"resume={out}: {got.record['note']}")
    if resumes:
        p.ledger.extra["resumes"] = resumes
    board["entries"] = board["entries"] + [checkpoints.plain(asdict(e)) for e in got.composed]
    board["rereleases"] = [checkpoints.plain(asdict(e)) for e in got.rereleases]
    return entries + got.composed


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
        _write_owners(out / "owners.csv", p.fed, res)
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
    ``seconds`` counts from ``t_start`` (None: not timed)."""
    fed, spec, ledger, aggregator, s = p.fed, p.spec, p.ledger, p.aggregator, p.settings
    n = fed.num_owners
    summ = summarize(
        res.owner_accuracy if res is not None else np.full(n, np.nan),
        res.owner_loss if res is not None else np.full(n, np.nan),
        np.diff(fed.test_offsets),
    )
    guarantee = run_guarantee(spec, aggregator) if spec.private else "none"
    epsilon = ledger.epsilon if spec.private else None
    live = [e for e in ledger.entries if not e.superseded]
    # epsilon stays a number for programs; epsilon_kind (beside it) says whether it is a proven
    # bound, epsilon_display is the text every fedudp output prints for it ("1.000 (heuristic)")
    kind = guarantee if spec.private else None
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
    est = p.billboard.canary_estimate() if p.billboard is not None else None
    if est is not None:  # audit.canaries: an estimate beside the ledger's ε, not a bound
        summary.update(est)
    if p.algorithm is not None:
        summary["algorithm"] = p.algorithm.summary
    if res is not None:
        summary.update(res.extra)
        summary.update(warn_min_users(aggregator))
        if res.stop_reason == "halted":
            summary["halted_at_round"] = int(res.rounds_completed)
        if res.signum is not None:
            summary["signal"] = int(res.signum)
    return summary


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


def _write_owners(path: Path, fed: Federation, res: RoundsResult) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["owner", "train_records", "users", "test_records", "accuracy", "loss", "classes"]
        )
        for j in range(fed.num_owners):
            cls = " ".join(map(str, fed.owner_classes[j])) if fed.owner_classes is not None else ""
            w.writerow(
                [
                    j,
                    int(fed.owner_sizes()[j]),
                    int(fed.owner_user_offsets[j + 1] - fed.owner_user_offsets[j]),
                    int(fed.test_offsets[j + 1] - fed.test_offsets[j]),
                    f"{res.owner_accuracy[j]:.6f}",
                    f"{res.owner_loss[j]:.6f}",
                    cls,
                ]
            )


def _to_yaml(d: dict) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(d))


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
