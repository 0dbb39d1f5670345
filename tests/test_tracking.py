"""Experiment tracking (``fedudp.tracking``, docs/tracking.md) against the real libraries, and
``checkpoint.keep_after_finish``.

MLflow runs are read back with MLflow's own client from the embedded SQLite store; TensorBoard
events with TensorBoard's own ``EventAccumulator``. The MLflow tests are marked slow: creating an
embedded store runs MLflow's database migrations (5-10 s on two cores) and importing MLflow takes
a few seconds more; the rest of the file runs in a few seconds.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import interrupt_after, tiny_cfg
from fedudp import tracking
from fedudp.config import ConfigError, RunConfig, config_from_overrides
from fedudp.protocol import checkpoint
from fedudp.run import run

ROOT = Path(__file__).resolve().parent.parent
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "ledger.jsonl",
    "ledger.json",
    "owners.csv",
    "summary.json",
)
# the 2x2 sweep's small federation (each run about a second)
SMALL = [
    "dataset.num_records=160",
    "dataset.pool_train=1000",
    "dataset.pool_test=200",
    "dataset.features=12",
    "partition.num_owners=4",
    "train.batch_size=8",
    "progress=false",
]


def cfg(method: str = "full_dp", **kw) -> RunConfig:
    return tiny_cfg(method, **{k.replace(".", "__"): v for k, v in kw.items()})


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def env() -> dict[str, str]:
    return dict(
        os.environ, FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1"
    )


def fedudp(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedudp.run", *args],
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def warnings_of(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("fedudp: warning: tracking")]


# -- off by default, never required ---------------------------------------------------------------
def test_tracking_is_off_by_default_and_the_module_imports_no_tracking_library():
    assert RunConfig().tracking.kind.value == "none"
    assert RunConfig().checkpoint.keep_after_finish.value == "none"
    tree = ast.parse(Path(tracking.__file__).read_text())
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {(n.module or "").split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert not top & {"mlflow", "tensorboard", "torch", "tensorboardX"}


def test_tracking_none_writes_nothing_of_its_own(tmp_path):
    run(cfg(**{"train.rounds": 2}), tmp_path)
    assert not {
        tracking.STATE_FILE,
        tracking.TB_DIR,
        tracking.STORE_FILE,
        tracking.ARTIFACTS_DIR,
    } & {p.name for p in tmp_path.iterdir()}


def test_the_command_line_shorthand_and_the_dotted_key_agree():
    assert config_from_overrides({"tracking": "mlflow"}).tracking.kind.value == "mlflow"
    assert (
        config_from_overrides({"tracking.kind": "tensorboard"}).tracking.kind.value == "tensorboard"
    )
    with pytest.raises(ConfigError, match="tracking"):
        config_from_overrides({"tracking": "wandb"})
    from hydra import compose, initialize_config_dir

    from fedudp.config import register
    from fedudp.cli import CONF_DIR

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for over in (["tracking=mlflow"], ["tracking.kind=mlflow"]):
            c = compose(config_name="config", overrides=over + ["tracking.uri=http://127.0.0.1:9"])
            assert (c.tracking.kind.value, c.tracking.uri) == ("mlflow", "http://127.0.0.1:9")
        assert compose(config_name="config").tracking.kind.value == "none"


@pytest.mark.parametrize("kind,package", [("mlflow", "mlflow"), ("tensorboard", "tensorboard")])
def test_a_missing_extra_is_one_line_naming_it_before_any_work(
    tmp_path, monkeypatch, kind, package
):
    import importlib.util

    import fedudp.run as run_mod

    real = importlib.util.find_spec
    monkeypatch.setattr(
        tracking.importlib.util,
        "find_spec",
        lambda name, *a: None if name == package else real(name, *a),
    )
    monkeypatch.setattr(run_mod, "prepare", lambda *a, **k: pytest.fail("work started"))
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        run(cfg(**{"tracking.kind": kind}), out)
    text = str(e.value)
    assert "\n" not in text and "fedudp[tracking]" in text and f"tracking.kind={kind}" in text
    assert not out.exists()


def test_simulate_without_a_folder_refuses_tracking():
    import fedudp

    with pytest.raises(ConfigError, match="out=<folder>"):
        fedudp.simulate({"tracking": "tensorboard", "train.rounds": 1})


def test_helpers_flatten_and_keep_the_finite_numbers():
    assert tracking.flatten({"a": {"b": 1, "c": {}}, "d": [1]}) == {"a.b": 1, "a.c": {}, "d": [1]}
    got = tracking.numeric(
        {"round": 2, "x": None, "y": float("nan"), "ok": True, "s": "t", "n": {"z": 0.5}}
    )
    assert got == {"round": 2.0, "ok": 1.0, "n.z": 0.5}


# -- TensorBoard ----------------------------------------------------------------------------------
def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def test_tensorboard_scalars_read_back_with_tensorboards_reader(tmp_path):
    run(cfg(**{"train.rounds": 3, "tracking.kind": "tensorboard"}), tmp_path)
    metrics = lines(tmp_path / "metrics.jsonl")
    got = scalars(tmp_path / tracking.TB_DIR)
    for key in ("accuracy_mean", "loss", "epsilon", "cohort", "users_used", "failed_units"):
        assert [s for s, _ in got[key]] == [1, 2, 3], key
        assert [v for _, v in got[key]] == pytest.approx([m[key] for m in metrics], rel=1e-6), key
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert got["final/accuracy_mean"][0][1] == pytest.approx(summary["accuracy_mean"], rel=1e-6)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / tracking.TB_DIR))
    ea.Reload()
    assert "config/text_summary" in ea.Tags()["tensors"]
    assert json.loads((tmp_path / tracking.STATE_FILE).read_text())["kind"] == "tensorboard"


@pytest.mark.parametrize("before", ["none", "tensorboard"])
def test_tensorboard_on_resume_has_each_round_once(tmp_path, monkeypatch, before):
    """Interrupted after round 3, its newest checkpoint lost (so round 3 is made again), resumed
    with tracking=tensorboard: each round once, with metrics.jsonl's values. Untracked before:
    tracking is no part of a run's identity, the earlier rounds come from metrics.jsonl."""
    over = {"train.rounds": 4, "privacy.noise_multiplier": 2.0, "privacy.epsilon": 50.0}
    interrupt_after(monkeypatch, 3)
    assert run(cfg(**over, **{"tracking.kind": before}), tmp_path)["stop_reason"] == "interrupted"
    monkeypatch.undo()
    checkpoint.ckpt_path(tmp_path, 3).unlink()
    s = run(cfg(**over, resume=str(tmp_path), **{"tracking.kind": "tensorboard"}), "ignored")
    assert s["rounds_completed"] == 4
    got = scalars(tmp_path / tracking.TB_DIR)
    assert [st for st, _ in got["accuracy_mean"]] == [1, 2, 3, 4]
    assert [v for _, v in got["accuracy_mean"]] == pytest.approx(
        [m["accuracy_mean"] for m in lines(tmp_path / "metrics.jsonl")], rel=1e-6
    )


# -- checkpoint.keep_after_finish -----------------------------------------------------------------
@pytest.mark.parametrize("policy,kept", [("none", []), ("last", [3]), ("all", [3, 2])])
def test_keep_after_finish(tmp_path, policy, kept):
    s = run(cfg(**{"train.rounds": 3, "checkpoint.keep_after_finish": policy}), tmp_path)
    assert s["stop_reason"] == "completed"
    assert checkpoint.rounds_on_disk(tmp_path) == kept
    # a finished run is never resumed: re-running it, or resuming it, is skipped
    again = cfg(**{"train.rounds": 3, "checkpoint.keep_after_finish": policy}, resume=str(tmp_path))
    assert run(again, "ignored")["skipped"]


def test_an_interrupted_run_keeps_its_checkpoints_whatever_the_policy(tmp_path, monkeypatch):
    over = {
        "train.rounds": 4,
        "privacy.noise_multiplier": 2.0,
        "privacy.epsilon": 50.0,
        "checkpoint.keep_after_finish": "none",
    }
    interrupt_after(monkeypatch, 2)
    assert run(cfg(**over), tmp_path)["stop_reason"] == "interrupted"
    monkeypatch.undo()
    assert checkpoint.rounds_on_disk(tmp_path) == [2, 1]
    assert run(cfg(**over, resume=str(tmp_path)), "ignored")["rounds_completed"] == 4
    assert checkpoint.rounds_on_disk(tmp_path) == []


def test_keep_after_finish_removes_owner_folders_too(tmp_path):
    for r in (1, 2, 3):
        checkpoint.ckpt_path(tmp_path, r).write_bytes(b"x")
        checkpoint.owners_dir(tmp_path, r).mkdir()
    assert checkpoint.keep_after_finish(tmp_path, "last") == [3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000003.owners", "ckpt-000003.pt"]
    assert checkpoint.keep_after_finish(tmp_path, "none") == [] and not list(tmp_path.iterdir())
    with pytest.raises(ValueError):
        checkpoint.keep_after_finish(tmp_path, "some")


# -- MLflow ---------------------------------------------------------------------------------------
def client(folder: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{(folder / tracking.STORE_FILE).absolute()}")


def runs_of(c) -> list:
    exp = c.get_experiment_by_name("fedudp")
    return list(c.search_runs([exp.experiment_id], max_results=100))


@pytest.mark.slow
def test_a_2x2_sweep_is_one_parent_with_four_children(tmp_path):
    sweep = tmp_path / "sweep"
    p = fedudp(
        "-m",
        "method=fedavg,full_dp",
        "privacy.epsilon=1,8",
        "train.rounds=2",
        "tracking=mlflow",
        *SMALL,
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert not warnings_of(p.stderr), p.stderr[-3000:]
    c = client(sweep)
    runs = runs_of(c)
    parents = [r for r in runs if r.data.tags.get("role") == "sweep"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 4 and len(runs) == 5
    parent = parents[0]
    assert parent.data.tags["sweep_dir"] == str(sweep.absolute())
    assert parent.info.status == "FINISHED"
    assert "comparison.md" in [a.path for a in c.list_artifacts(parent.info.run_id)]
    seen = set()
    for r in children:
        assert r.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert r.info.status == "FINISHED"
        folder = Path(r.data.tags["run_dir"])
        assert folder.parent == sweep.absolute() and r.info.run_name == folder.name
        config = lines(folder / "metrics.jsonl")
        summary = json.loads((folder / "summary.json").read_text())
        # params: the resolved config, dotted keys
        params = r.data.params
        assert params["method"] == summary["method"] and params["train.rounds"] == "2"
        assert params["partition.num_owners"] == "4" and params["tracking.kind"] == "mlflow"
        seen.add((params["method"], float(params["privacy.epsilon"])))
        # tags: the run's setting
        tags = r.data.tags
        assert (tags["method"], tags["aggregator"], tags["guarantee"]) == (
            summary["method"],
            summary["aggregator"],
            summary["guarantee"],
        )
        assert tags["stop_reason"] == "completed"
        if summary["method"] == "full_dp":
            assert (tags["placement"], tags["accounting"], tags["epsilon_kind"]) == (
                "server",
                "certified",
                "certified",
            )
        # metrics: one value per round, as metrics.jsonl has them
        for key in ("accuracy_mean", "loss", "cohort", "users_used", "failed_units"):
            hist = c.get_metric_history(r.info.run_id, key)
            assert sorted(m.step for m in hist) == [1, 2], key
            assert [m.value for m in sorted(hist, key=lambda m: m.step)] == pytest.approx(
                [m[key] for m in config]
            ), key
        if summary["method"] == "full_dp":
            eps = c.get_metric_history(r.info.run_id, "epsilon")
            assert max(m.value for m in eps) == pytest.approx(summary["epsilon"])
        assert r.data.metrics["final/accuracy_mean"] == pytest.approx(summary["accuracy_mean"])
        # artifacts: the run folder's files, read back through MLflow
        names = {a.path for a in c.list_artifacts(r.info.run_id)}
        assert {"ledger.json", "summary.json", "config.yaml", "metrics.jsonl"} <= names
        import mlflow.artifacts

        local = mlflow.artifacts.download_artifacts(
            run_id=r.info.run_id,
            artifact_path="summary.json",
            tracking_uri=c.tracking_uri,
            dst_path=str(tmp_path / "dl" / r.info.run_id),
        )
        assert json.loads(Path(local).read_text()) == summary
        assert checkpoint.rounds_on_disk(folder) == []  # keep_after_finish=none
    assert seen == {("fedavg", 1.0), ("fedavg", 8.0), ("full_dp", 1.0), ("full_dp", 8.0)}
    # the store's artifacts (copies of each run's summary.json) are not runs of the sweep
    from fedudp.report import load_summaries

    assert sorted(s["_dir"] for s in load_summaries(sweep)) == sorted(
        str(Path(r.data.tags["run_dir"])) for r in children
    )
    table = (sweep / "comparison.md").read_text()
    assert "(seeds 0, 0)" not in table and table.count("| 1 |") == 4


@pytest.mark.slow
def test_an_unreachable_server_is_one_warning_and_the_run_completes(tmp_path):
    """A closed loopback port: MLflow's retries are off (tracking.HTTP_DEFAULTS), so the run
    does not wait for minutes; every file is written."""
    out = tmp_path / "run"
    p = fedudp(
        "tracking=mlflow",
        "tracking.uri=http://127.0.0.1:9",
        "train.rounds=2",
        *SMALL,
        f"hydra.run.dir={out}",
        cwd=tmp_path,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got = warnings_of(p.stderr)
    assert len(got) == 1 and "127.0.0.1:9" in got[0] and "the run goes on" in got[0], p.stderr
    for name in RUN_FILES:
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "completed" and summary["rounds_completed"] == 2
    assert len(lines(out / "metrics.jsonl")) == 2


@pytest.mark.slow
def test_an_unwritable_store_is_one_warning_and_the_run_completes(tmp_path, capsys):
    store = tmp_path / "ro"
    store.mkdir()
    store.chmod(0o500)
    if os.access(store, os.W_OK):  # root ignores the mode bits
        (store / "mlflow.db").mkdir()  # a folder where the database file should be
    out = tmp_path / "run"
    s = run(
        cfg(
            **{
                "train.rounds": 2,
                "tracking.kind": "mlflow",
                "tracking.uri": f"sqlite:///{store / 'mlflow.db'}",
            }
        ),
        out,
    )
    assert s["stop_reason"] == "completed"
    assert len(warnings_of(capsys.readouterr().err)) == 1
    for name in RUN_FILES:
        assert (out / name).is_file(), name


@pytest.mark.slow
def test_resume_continues_the_same_mlflow_run(tmp_path, monkeypatch):
    """Interrupted after round 3; the newest checkpoint is then lost, so the resumed run goes
    back to round 2 and recomputes round 3, which its MLflow run already holds: still one value
    per round, one run, the same run id."""
    over = {
        "train.rounds": 5,
        "privacy.noise_multiplier": 2.0,
        "privacy.epsilon": 50.0,
        "tracking.kind": "mlflow",
        "checkpoint.keep_after_finish": "last",
    }
    interrupt_after(monkeypatch, 3)
    assert run(cfg(**over), tmp_path)["stop_reason"] == "interrupted"
    monkeypatch.undo()
    first = json.loads((tmp_path / tracking.STATE_FILE).read_text())
    c = client(tmp_path)
    assert c.get_run(first["run_id"]).info.status == "KILLED"
    checkpoint.ckpt_path(tmp_path, 3).unlink()
    s = run(cfg(**over, resume=str(tmp_path)), "ignored")
    assert s["rounds_completed"] == 5
    assert json.loads((tmp_path / tracking.STATE_FILE).read_text())["run_id"] == first["run_id"]
    runs = runs_of(c)
    assert [r.info.run_id for r in runs] == [first["run_id"]]
    r = c.get_run(first["run_id"])
    assert r.info.status == "FINISHED" and r.data.tags["resumed_from_round"] == "2"
    assert r.data.params["train.rounds"] == "5"
    metrics = lines(tmp_path / "metrics.jsonl")
    hist = sorted(c.get_metric_history(r.info.run_id, "accuracy_mean"), key=lambda m: m.step)
    assert [m.step for m in hist] == [1, 2, 3, 4, 5]
    assert [m.value for m in hist] == pytest.approx([m["accuracy_mean"] for m in metrics])
    assert checkpoint.rounds_on_disk(tmp_path) == [5]  # keep_after_finish=last


@pytest.mark.slow
def test_rounds_a_killed_run_never_wrote_to_mlflow_come_from_metrics_jsonl(tmp_path, monkeypatch):
    """A process killed with rounds still in the tracker's buffer (written every FLUSH_S s):
    the MLflow run holds none of them; the resumed run logs them from metrics.jsonl, once."""
    over = {
        "train.rounds": 4,
        "privacy.noise_multiplier": 2.0,
        "privacy.epsilon": 50.0,
        "tracking.kind": "mlflow",
    }
    monkeypatch.setattr(tracking, "FLUSH_S", 1e9)
    monkeypatch.setattr(tracking.Tracker, "finish", lambda self, summary, out: None)  # "killed"
    interrupt_after(monkeypatch, 2)
    assert run(cfg(**over), tmp_path)["stop_reason"] == "interrupted"
    monkeypatch.undo()
    run_id = json.loads((tmp_path / tracking.STATE_FILE).read_text())["run_id"]
    c = client(tmp_path)
    assert c.get_metric_history(run_id, "accuracy_mean") == []
    assert run(cfg(**over, resume=str(tmp_path)), "ignored")["rounds_completed"] == 4
    hist = sorted(c.get_metric_history(run_id, "accuracy_mean"), key=lambda m: m.step)
    assert [m.step for m in hist] == [1, 2, 3, 4]
    assert [m.value for m in hist] == pytest.approx(
        [m["accuracy_mean"] for m in lines(tmp_path / "metrics.jsonl")]
    )
    assert [r.info.run_id for r in runs_of(c)] == [run_id]


# -- a heuristic ε is never logged under the bare name (issue 49) ---------------------------------
def _logged_names(tmp_path: Path, accounting: str) -> tuple[list[dict], set[str]]:
    run(
        cfg(
            "joint_dp",
            **{"train.rounds": 2, "privacy.accounting": accounting, "tracking.kind": "tensorboard"},
        ),
        tmp_path,
    )
    return lines(tmp_path / "metrics.jsonl"), set(scalars(tmp_path / tracking.TB_DIR))


def _heuristic_checks(metrics: list[dict], tags: set[str], summary: dict) -> None:
    assert summary["epsilon_kind"] == "heuristic"
    assert all("epsilon" not in m and m["epsilon_heuristic"] > 0 for m in metrics)
    assert {"epsilon_heuristic", "final/epsilon_heuristic"} <= tags
    assert not tags & {"epsilon", "final/epsilon", "final/epsilon_rdp"}


def test_a_heuristic_epsilon_is_logged_as_epsilon_heuristic(tmp_path):
    metrics, tags = _logged_names(tmp_path / "paper", "paper")
    summary = json.loads((tmp_path / "paper" / "summary.json").read_text())
    _heuristic_checks(metrics, tags, summary)
    got = scalars(tmp_path / "paper" / tracking.TB_DIR)["epsilon_heuristic"]
    assert [v for _, v in got] == pytest.approx([m["epsilon_heuristic"] for m in metrics])
    # a certified run keeps the bare name
    metrics, tags = _logged_names(tmp_path / "certified", "certified")
    assert all("epsilon_heuristic" not in m and m["epsilon"] > 0 for m in metrics)
    assert {"epsilon", "final/epsilon"} <= tags and "epsilon_heuristic" not in tags
    # the report reads both names (its per-round ε curves)
    from fedudp.report.report_plots import _run_curve

    for folder in ("paper", "certified"):
        curve = _run_curve({"_dir": str(tmp_path / folder), "_config": {}})
        assert sorted(curve.epsilon) == [1, 2] and all(e > 0 for e in curve.epsilon.values())


def test_twin_logging_the_bare_name_is_caught(tmp_path, monkeypatch):
    # the weakened twin: no renaming anywhere (as before issue 49)
    import fedudp.run as runner

    monkeypatch.setattr(runner, "labelled_epsilon", lambda line, kind: line)
    monkeypatch.setattr(tracking, "labelled_epsilon", lambda line, kind: line)
    monkeypatch.setattr(tracking, "epsilon_metric", lambda kind: "epsilon")
    metrics, tags = _logged_names(tmp_path, "paper")
    summary = json.loads((tmp_path / "summary.json").read_text())
    with pytest.raises(AssertionError):
        _heuristic_checks(metrics, tags, summary)


def test_final_metrics_are_named_by_the_summarys_kind():
    s = {"epsilon": 1.5, "epsilon_rdp": 1.7, "accuracy_mean": 0.5}
    assert tracking._final({**s, "epsilon_kind": "certified"}) == s
    assert tracking._final({**s, "epsilon_kind": "heuristic"}) == {
        "epsilon_heuristic": 1.5,
        "epsilon_rdp_heuristic": 1.7,
        "accuracy_mean": 0.5,
    }
    assert set(tracking._final({**s, "epsilon_kind": "weakened"})) == {
        "epsilon_weakened",
        "epsilon_rdp_weakened",
        "accuracy_mean",
    }


@pytest.mark.slow
def test_mlflow_logs_a_heuristic_epsilon_as_epsilon_heuristic(tmp_path):
    run(
        cfg(
            "joint_dp",
            **{"train.rounds": 2, "privacy.accounting": "paper", "tracking.kind": "mlflow"},
        ),
        tmp_path,
    )
    c = client(tmp_path)
    (r,) = runs_of(c)
    assert r.data.tags["epsilon_kind"] == "heuristic"
    hist = c.get_metric_history(r.info.run_id, "epsilon_heuristic")
    metrics = lines(tmp_path / "metrics.jsonl")
    assert [m.value for m in sorted(hist, key=lambda m: m.step)] == pytest.approx(
        [m["epsilon_heuristic"] for m in metrics]
    )
    assert c.get_metric_history(r.info.run_id, "epsilon") == []
    assert "final/epsilon_heuristic" in r.data.metrics and "final/epsilon" not in r.data.metrics
