"""Experiment tracking of a run: MLflow or TensorBoard beside the run folder's own files
(docs/tracking.md).

``tracking=mlflow`` logs the resolved config as parameters (dotted keys), every numeric value of
each ``metrics.jsonl`` line as a metric at step = round, the run's setting as tags (method,
aggregator, placement, accounting, guarantee, ε kind, ...) and, at the end, the run folder's files
(config.yaml, metrics.jsonl, ledger.json, summary.json, owners.csv, plots) as artifacts. With no
``tracking.uri`` the store is embedded: a SQLite database ``mlflow.db`` (artifacts in
``mlartifacts/``) in the run folder, or in the sweep folder for a Hydra sweep, whose runs are
then the children of one parent run named after the sweep folder. ``tracking=tensorboard``
writes the same scalars (and the config as text and HParams) to ``<run folder>/tb``.

Tracking is optional and never required: this module imports neither MLflow nor TensorBoard
until a run asks for one (``pip install 'fedudp[tracking]'``; ``require`` names the extra as a
``ConfigError`` before any work), and a tracking failure during a run (server unreachable,
store unwritable) is reported once on stderr and the run goes on writing its own files.
Per-round MLflow metrics are buffered and written every few seconds (``FLUSH_S``) and at the
end by a writer thread, so a round does not wait for the store. The run id is kept in the run folder (``tracking.json``): ``resume=`` goes
on logging into the same run, without logging a round twice.

Only plain values come in (``fedudp.build.settings`` reads the config keys).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedudp.errors import ConfigError
from fedudp.privacy.labels import epsilon_metric, labelled_epsilon
from fedudp.tracking_files import (
    ARTIFACTS_DIR,
    STATE_FILE,
    STORE_FILE,
    TB_DIR,
    clear,
    flatten,
    numeric,
)
from fedudp.tracking_files import artifacts as _artifacts
from fedudp.tracking_files import embedded_uri as _embedded_uri
from fedudp.tracking_files import locked as _locked
from fedudp.tracking_files import param_value as _param_value
from fedudp.tracking_files import probe_sqlite as _probe_sqlite
from fedudp.tracking_files import quiet_store_logs as _quiet_store_logs
from fedudp.tracking_files import read_state as _read_state
from fedudp.tracking_files import write_state as _write_state

__all__ = [
    "EXTRA",
    "STATE_FILE",
    "TB_DIR",
    "STORE_FILE",
    "ARTIFACTS_DIR",
    "Sweep",
    "Tracker",
    "require",
    "start",
    "clear",
    "flatten",
    "numeric",
    "SweepCallback",
]

EXTRA = "pip install 'fedudp[tracking]'"
# MLflow's HTTP client retries with backoff for minutes by default: a run must not wait on an
# unreachable server (setdefault: a value the user exported wins)
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
# metrics are written to the store every FLUSH_S seconds (and at the end), not every round, by a
# writer thread of the tracker's own: one SQLite batch costs MLflow 20-50 ms whatever its size, a
# sizeable share of a small round. (MLflow's own asynchronous logging would do the same, but
# ending a run that used it waits ~1 s for MLflow's queue thread.)
FLUSH_S = 5.0
# summary.json's numbers also logged at the end, as final/<key> (the rest are parameters or tags)
FINAL = (
    "accuracy_mean",
    "accuracy_std",
    "accuracy_weighted",
    "loss",
    "epsilon",
    "epsilon_rdp",
    "noise_multiplier",
    "rounds_completed",
    "seconds",
)
# MLflow run status for each stop_reason (the rest: FINISHED)
STATUS = {"interrupted": "KILLED", "failed": "FAILED"}
PACKAGES = {"mlflow": "mlflow", "tensorboard": "tensorboard"}


@dataclass(frozen=True)
class Sweep:
    """The Hydra sweep a run is one job of: its folder (the parent run's key), the job's name
    and its own overrides.

    Attributes
    ----------
    folder, job : str
        The sweep's folder (the parent run's key); the job's name.
    overrides : tuple[str, ...]
        The job's own overrides.
    command : str
        The sweep's command line.
    """

    folder: str
    job: str
    overrides: tuple[str, ...] = ()
    command: str = ""


def require(kind: str) -> None:
    """Check that ``kind``'s package is installed (without importing it).

    Parameters
    ----------
    kind
        ``tracking.kind``: ``mlflow``, ``tensorboard`` or ``none``.

    Raises
    ------
    ConfigError
        The package is missing; the message names the extra to install.
    """
    package = PACKAGES.get(kind)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"tracking.kind={kind}: the '{package}' package is not installed; "
            f"install fedudp's tracking extra: {EXTRA}"
        )


def warn(message: str) -> None:
    print(f"fedudp: warning: {message}", file=sys.stderr, flush=True)


@dataclass
class Tracker:
    """What the run calls: ``log_round`` after every round, ``finish`` once at the end. The
    base class tracks nothing (``tracking=none``). Each call of a real tracker is guarded: the
    first failure is reported once (``fedudp: warning: tracking ...``) and the tracker turns
    itself off.

    Attributes
    ----------
    kind, where : str
        ``tracking.kind`` (default ``none``) and where it logs.
    failed : bool
        Set once it turned itself off after a failure.
    epsilon_kind : str or None
        The run's guarantee (a heuristic ε is logged as ``epsilon_heuristic``).
    """

    kind: str = "none"
    where: str = ""
    failed: bool = field(default=False, repr=False)
    # the run's guarantee (its tags'): a heuristic ε is logged as epsilon_heuristic, never as
    # the bare epsilon (fedudp.privacy.labels.epsilon_metric)
    epsilon_kind: str | None = None

    def log_round(self, info: dict) -> None:
        if not self.failed:
            with self._guard("logging round {}".format(info.get("round"))):
                self._log_round(labelled_epsilon(info, self.epsilon_kind))

    def backfill(self, history: list[dict]) -> None:
        """The rounds a resumed run had already made (its metrics.jsonl) that the tracked run
        does not hold: all of them for a run tracked from its resume on; for a continued MLflow
        run those after the last round it holds (a killed run loses the rounds still in its
        buffer); TensorBoard replaces them all (``purge_step``)."""
        for info in history:
            self.log_round(info)

    def finish(self, summary: dict, out: Path) -> None:
        if not self.failed:
            with self._guard("finishing"):
                self._finish(summary, Path(out))
        self._close()

    @contextlib.contextmanager
    def _guard(self, doing: str) -> Iterator[None]:
        try:
            yield
        except Exception as e:  # noqa: BLE001  (tracking never stops a run)
            self.fail(doing, e)

    def fail(self, doing: str, e: BaseException) -> None:
        if not self.failed:
            self.failed = True
            text = " ".join(str(e).split())[:300] or type(e).__name__
            warn(
                f"tracking ({self.kind} at {self.where}) failed while {doing}: "
                f"{type(e).__name__}: {text}; the run goes on without it (its own files are "
                "written as usual)"
            )
        self._close()

    def _log_round(self, info: dict) -> None:
        pass

    def _finish(self, summary: dict, out: Path) -> None:
        pass

    def _close(self) -> None:
        pass


def start(
    kind: str,
    out: Path,
    *,
    uri: str | None = None,
    experiment: str = "fedudp",
    config: dict | None = None,
    tags: dict[str, Any] | None = None,
    sweep: Sweep | None = None,
    resumed_round: int | None = None,
) -> Tracker:
    """The tracker of the run in ``out``. Never raises: a tracker that cannot start reports it
    once and tracks nothing.

    Parameters
    ----------
    kind
        ``tracking.kind``: ``mlflow``, ``tensorboard`` or anything else (no tracking).
    out
        The run folder.
    uri
        The MLflow tracking URI (None: the embedded store beside the run or sweep folder).
    experiment
        The MLflow experiment.
    config
        The resolved config (logged as parameters, dotted keys).
    tags
        The run's setting (method, aggregator, guarantee, ...), logged as tags.
    sweep
        The Hydra sweep the run is a job of (its runs become children of one parent run).
    resumed_round
        The round of the checkpoint a resumed run starts from: the tracked run recorded in
        ``out`` is continued.

    Returns
    -------
    Tracker
        ``Tracker`` (tracks nothing), or the MLflow or TensorBoard tracker.
    """
    out = Path(out)
    t: Tracker
    starter: Callable[..., None]
    if kind == "mlflow":
        mlflow_tracker = MlflowTracker(kind, uri or "embedded")
        t, starter = mlflow_tracker, mlflow_tracker.start
    elif kind == "tensorboard":
        tb_tracker = TensorBoardTracker(kind, str(out / TB_DIR))
        t, starter = tb_tracker, tb_tracker.start
    else:
        return Tracker()
    guarantee = (tags or {}).get("guarantee")
    t.epsilon_kind = guarantee if guarantee in ("certified", "heuristic", "weakened") else None
    with t._guard("starting"):
        starter(
            out,
            uri=uri,
            experiment=experiment,
            config=config or {},
            tags=tags or {},
            sweep=sweep,
            resumed_round=resumed_round,
        )
    return t


@dataclass
class MlflowTracker(Tracker):
    """One MLflow run (a child of the sweep's parent run in a sweep)."""

    client: Any = field(default=None, repr=False)
    run_id: str | None = None
    parent_run_id: str | None = None
    logged_through: int = 0  # rounds already in the run (a resumed run skips them)
    buffer: list = field(default_factory=list, repr=False)
    flushed: float = field(default_factory=time.monotonic)  # the last batch handed over
    writer: Any = field(default=None, repr=False)  # the writer thread (an executor)
    writes: list = field(default_factory=list, repr=False)  # its pending batches (futures)

    def start(
        self,
        out: Path,
        *,
        uri: str | None,
        experiment: str,
        config: dict,
        tags: dict,
        sweep: Sweep | None,
        resumed_round: int | None,
    ) -> None:
        for k, v in HTTP_DEFAULTS.items():
            os.environ.setdefault(k, v)
        _quiet_store_logs()
        from mlflow.tracking import MlflowClient

        state_path = out / STATE_FILE
        state = _read_state(state_path) if resumed_round is not None else {}
        if state.get("kind") == "mlflow" and state.get("run_id"):
            # resume: the run recorded in the folder, in the store it was logged to
            self.where = state["uri"]
            _probe_sqlite(state["uri"])
            self.client = MlflowClient(tracking_uri=state["uri"])
            self.run_id, self.parent_run_id = state["run_id"], state.get("parent_run_id")
            run = self.client.get_run(self.run_id)
            self.logged_through = max(
                (
                    m.step
                    for key in run.data.metrics
                    for m in self.client.get_metric_history(self.run_id, key)
                ),
                default=0,
            )
            self.client.update_run(self.run_id, status="RUNNING")
            self.client.set_tag(self.run_id, "resumed_from_round", str(resumed_round))
            return
        home = Path(sweep.folder) if sweep is not None else out
        uri = uri or _embedded_uri(home)
        self.where = uri
        artifacts = (
            None if uri != _embedded_uri(home) else (home / ARTIFACTS_DIR).absolute().as_uri()
        )
        home.mkdir(parents=True, exist_ok=True)
        with _locked(home):
            # one process at a time creates the embedded store, the experiment and the parent
            _probe_sqlite(uri)
            self.client = MlflowClient(tracking_uri=uri)
            experiment_id = self._experiment(experiment, artifacts)
            if sweep is not None:
                self.parent_run_id = self._parent(home, uri, experiment_id, sweep)
        run_tags: dict[str, str | None] = {k: str(v) for k, v in tags.items() if v is not None}
        run_tags["run_dir"] = str(out.absolute())
        if sweep is not None:
            run_tags.update(
                {
                    "mlflow.parentRunId": self.parent_run_id,
                    "sweep_dir": str(Path(sweep.folder).absolute()),
                    "overrides": " ".join(sweep.overrides),
                }
            )
        name = sweep.job if sweep is not None else out.name
        self.run_id = self.client.create_run(
            experiment_id, tags=run_tags, run_name=name
        ).info.run_id
        _write_state(
            state_path,
            {
                "kind": "mlflow",
                "uri": uri,
                "experiment_id": experiment_id,
                "run_id": self.run_id,
                "parent_run_id": self.parent_run_id,
            },
        )
        from mlflow.entities import Param

        params = [Param(k[:250], _param_value(v)) for k, v in sorted(flatten(config).items())]
        for i in range(0, len(params), 100):  # MLflow: 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[i : i + 100], synchronous=True)

    def _experiment(self, name: str, artifacts: str | None) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=artifacts)
        except Exception:  # created meanwhile by another process of the sweep (else: re-raised)
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def _parent(self, home: Path, uri: str, experiment_id: str, sweep: Sweep) -> str:
        """The sweep's parent run: recorded in the sweep folder, else found by its tag, else
        created (the caller holds the sweep folder's lock)."""
        path = home / STATE_FILE
        state = _read_state(path)
        folder = str(home.absolute())
        parent = state.get("parent_run_id") if state.get("uri") == uri else None
        if parent is None:
            found = self.client.search_runs(
                [experiment_id],
                filter_string=f"tags.sweep_dir = '{folder}' and tags.role = 'sweep'",
                max_results=1,
            )
            parent = found[0].info.run_id if found else None
        if parent is None:
            tags = {
                "role": "sweep",
                "sweep_dir": folder,
                "mlflow.note.content": f"fedudp sweep: {sweep.command}"
                if sweep.command
                else "fedudp sweep",
            }
            name = "/".join(home.absolute().parts[-2:])
            parent = self.client.create_run(experiment_id, tags=tags, run_name=name).info.run_id
        else:
            self.client.update_run(parent, status="RUNNING")
        _write_state(
            path,
            {"kind": "mlflow", "uri": uri, "experiment_id": experiment_id, "parent_run_id": parent},
        )
        return parent

    def _log_round(self, info: dict) -> None:
        step = int(info.get("round", 0))
        if step <= self.logged_through:  # logged before the run was resumed
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.buffer += [Metric(k, v, now, step) for k, v in numeric(info).items() if k != "round"]
        if time.monotonic() - self.flushed >= FLUSH_S:
            self._flush()

    def _flush(self) -> None:
        """Hand the buffered rounds' metrics to the writer thread; the error of a batch it has
        failed to write surfaces here (and is reported once)."""
        for f in [f for f in self.writes if f.done()]:
            self.writes.remove(f)
            f.result()
        batch, self.buffer = self.buffer, []
        if batch:
            if self.writer is None:
                from concurrent.futures import ThreadPoolExecutor

                self.writer = ThreadPoolExecutor(1, thread_name_prefix="fedudp-tracking")
            self.writes.append(self.writer.submit(self._write, batch))
        self.flushed = time.monotonic()

    def _write(self, batch: list) -> None:
        for i in range(0, len(batch), 1000):  # MLflow: 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000], synchronous=True)

    def _drain(self) -> None:
        """Wait for every batch handed to the writer thread (raising the first error)."""
        self._flush()
        writes, self.writes = self.writes, []
        for f in writes:
            f.result()

    def _finish(self, summary: dict, out: Path) -> None:
        self._drain()
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        step = int(summary.get("rounds_completed") or 0)
        metrics = [Metric(f"final/{k}", v, now, step) for k, v in _final(summary).items()]
        tags = [
            RunTag(k, str(summary[k]))
            for k in (
                "stop_reason",
                "epsilon_kind",
                "guarantee",
                "epsilon_display",
                "unit",
                "adjacency",
            )
            if summary.get(k) is not None
        ]
        self.client.log_batch(self.run_id, metrics=metrics, tags=tags, synchronous=True)
        for path in _artifacts(out):
            self.client.log_artifact(self.run_id, str(path))
        status = STATUS.get(str(summary.get("stop_reason")), "FINISHED")
        self.client.set_terminated(self.run_id, status=status)

    def _close(self) -> None:
        self.buffer, self.writes = [], []
        if self.writer is not None:
            self.writer.shutdown(wait=True, cancel_futures=True)
            self.writer = None


def _final(summary: dict) -> dict[str, float]:
    """summary.json's ``FINAL`` numbers, its ε under the name its kind gives
    (``epsilon_heuristic`` for a heuristic one)."""
    got = numeric(summary)
    mark = epsilon_metric(summary.get("epsilon_kind"))[len("epsilon") :]  # "" or "_heuristic"
    return {(k + mark if k in ("epsilon", "epsilon_rdp") else k): got[k] for k in FINAL if k in got}


@dataclass
class TensorBoardTracker(Tracker):
    """TensorBoard scalars (and the config as text and HParams) in ``<run folder>/tb``."""

    writer: Any = field(default=None, repr=False)

    def start(
        self,
        out: Path,
        *,
        uri: str | None,
        experiment: str,
        config: dict,
        tags: dict,
        sweep: Sweep | None,
        resumed_round: int | None,
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        logdir = out / TB_DIR
        continued = (
            resumed_round is not None
            and logdir.is_dir()
            and _read_state(out / STATE_FILE).get("kind") == "tensorboard"
        )
        # a resumed run writes every round again (``backfill``, then the rounds it makes):
        # purge_step=1 tells TensorBoard's reader to drop the earlier files' rounds, some of
        # which a killed run may never have flushed
        purge = 1 if resumed_round is not None else None
        self.writer = SummaryWriter(log_dir=str(logdir), purge_step=purge, flush_secs=int(FLUSH_S))
        _write_state(out / STATE_FILE, {"kind": "tensorboard", "logdir": TB_DIR})
        if continued:  # the config and HParams (step 0) are there already
            return
        from torch.utils.tensorboard.summary import hparams

        flat = flatten(config)
        hp = {
            k: (v if isinstance(v, (int, float, str, bool)) else json.dumps(v))
            for k, v in flat.items()
            if v is not None
        }
        eps = epsilon_metric(self.epsilon_kind)
        exp, ssi, sei = hparams(hp, {"accuracy_mean": 0.0, eps: 0.0, "loss": 0.0})
        for s in (exp, ssi, sei):
            self.writer.file_writer.add_summary(s)
        lines = [f"    {k}: {v}" for k, v in sorted(flat.items())]
        self.writer.add_text("config", "\n".join(lines), 0)
        if tags:
            self.writer.add_text("tags", "\n".join(f"    {k}: {v}" for k, v in tags.items()), 0)

    def _scalars(self, values: dict[str, float], step: int) -> None:
        """One event holding every value (much cheaper than ``add_scalar`` per value)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        self.writer.file_writer.add_summary(
            Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()]), step
        )

    def _log_round(self, info: dict) -> None:
        self._scalars(
            {k: v for k, v in numeric(info).items() if k != "round"}, int(info.get("round", 0))
        )

    def _finish(self, summary: dict, out: Path) -> None:
        step = int(summary.get("rounds_completed") or 0)
        self._scalars({f"final/{k}": v for k, v in _final(summary).items()}, step)
        text = json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict)}, indent=1)
        self.writer.add_text("summary", "\n".join("    " + ln for ln in text.splitlines()), step)
        self.writer.flush()

    def _close(self) -> None:
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.close()
            self.writer = None


try:  # the Hydra callback (a plain object where Hydra's callback API is absent)
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover
    Callback = object  # type: ignore[misc,assignment]


class SweepCallback(Callback):
    """At the end of a Hydra multirun whose runs were logged to MLflow: the sweep's parent run
    gets the comparison table (``comparison.md``, and any other table or plot in the sweep
    folder) and is marked finished. Nothing is imported
    when the sweep was not tracked."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        folder = Path(str(config.hydra.sweep.dir))
        state = _read_state(folder / STATE_FILE)
        if state.get("kind") != "mlflow" or not state.get("parent_run_id"):
            return
        t = MlflowTracker("mlflow", state.get("uri", ""))
        with t._guard("closing the sweep's parent run"):
            for k, v in HTTP_DEFAULTS.items():
                os.environ.setdefault(k, v)
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=state["uri"])
            for path in sorted(folder.iterdir()):  # comparison.md, fedudp-report's plots
                if path.is_file() and path.suffix in (".md", ".png"):
                    client.log_artifact(state["parent_run_id"], str(path))
            client.set_terminated(state["parent_run_id"], status="FINISHED")
