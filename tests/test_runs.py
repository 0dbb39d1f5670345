"""End to end on the local engine: models, the owner boundary, the four methods, budget stop,
config errors (docs/architecture.md#configuration-and-outputs;
docs/algorithms.md#certified-vs-paper-accounting, docs/algorithms.md#paper-cnn)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import tiny_cfg, tiny_mnist
from fedudp.config import ConfigError, RunConfig, register
from fedudp.owner import owners as OW
from fedudp.models.cnn import PAPER_TABLE2_COUNTS, PaperCNN, layer_counts
from fedudp.cli import CONF_DIR
from fedudp.run import execute, prepare, run

ROOT = Path(__file__).resolve().parent.parent
SUMMARY_KEYS = {
    "accuracy_mean",
    "accuracy_std",
    "accuracy_weighted",
    "epsilon",
    "delta",
    "unit",
    "adjacency",
    "accounting",
    "guarantee",
    "rounds_completed",
    "seconds",
}


# -- models ------------------------------------------------------------------------------------
def test_paper_cnn_parameter_counts():
    counts = layer_counts(PaperCNN())
    assert counts == {"conv1": 416, "conv2": 12_832, "fc1": 15_690, "fc2": 15_690}
    assert PAPER_TABLE2_COUNTS["conv1"] == 416 and PAPER_TABLE2_COUNTS["conv2"] == 12_832


def test_paper_cnn_averages_its_two_heads():
    m = PaperCNN()
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        h = torch.nn.functional.max_pool2d(torch.relu(m.conv1(x)), 2)
        h = torch.nn.functional.max_pool2d(torch.relu(m.conv2(h)), 2).flatten(1)
        assert torch.allclose(m(x), 0.5 * (m.fc1(h) + m.fc2(h)), atol=1e-6)


def test_unknown_personal_pattern_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="model.personal"):
        run(tiny_cfg("joint_dp", **{"model.personal": ["nonexistent.*"]}), tmp_path)


# -- the owner boundary ------------------------------------------------------------------------
def _prepared(method, **kw):
    cfg = tiny_cfg(method, **kw)
    return cfg, prepare(cfg)


@pytest.mark.parametrize(
    "method,aggregator",
    [("joint_dp", "auto"), ("full_dp", "auto"), ("fedavg", "auto"), ("joint_dp", "winsorized")],
)
@pytest.mark.parametrize("accounting", ["certified", "paper"])
def test_no_personal_parameter_leaves_an_owner(monkeypatch, method, aggregator, accounting):
    sent = []

    def spying(orig):
        def spy(*a, **kw):
            rep = orig(*a, **kw)
            sent.append(rep)
            return rep

        return spy

    # every reply that leaves the owners: Owners.reply is what both engines send (sums, rows,
    # whichever path built them: make_reply, rows_reply, the one-step or the ghost path)
    monkeypatch.setattr(OW.Owners, "reply", spying(OW.Owners.reply))
    kw = {"privacy.accounting": accounting}
    if aggregator == "winsorized":
        kw.update({"estimator.bound": 10.0})
    cfg, p = _prepared(method, aggregator=aggregator, **kw)
    execute(p)
    assert len(sent) >= cfg.train.rounds
    personal = set(p.spec.personal)
    if method == "joint_dp":
        assert personal, "joint_dp must keep something personal"
    d_shared = sum(t.numel() for k, t in p.owners.model.named_parameters() if k in p.spec.shared)
    for rep in sent:
        assert not personal & set(rep.param_names)
        assert set(rep.param_names) == set(p.spec.shared)
        c = rep.contribution
        payload = c.rows if c.rows is not None else c.total
        assert (c.rows is not None) == (aggregator == "winsorized")
        assert payload.shape[-1] == d_shared == p.billboard.dim


def test_joint_dp_without_noise_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="aggregator"):
        run(tiny_cfg("joint_dp", aggregator="none"), tmp_path)


def test_per_silo_sends_nothing(monkeypatch):
    sent = []
    monkeypatch.setattr(OW.Owners, "reply", lambda *a, **k: sent.append(a))  # what leaves
    cfg, p = _prepared("per_silo")
    res = execute(p)
    assert p.billboard is None and sent == [] and res.rounds_completed == cfg.train.rounds


def _vectors(p, personal, rnd=2):
    users = np.arange(p.fed.num_users)
    shared = p.billboard.shared_params()
    return torch.cat([G for _, G in p.owners.user_vectors(p.fed, shared, personal, users, rnd)])


@pytest.mark.parametrize("mode", ["delta", "gradient"])
def test_certified_vectors_do_not_depend_on_personal_state(mode):
    cfg, p = _prepared("joint_dp", **{"train.shared_update": mode})
    personal = p.owners.initial_personal(p.fed.num_owners)
    personal = p.owners.personal_round(p.fed, p.billboard.shared_params(), personal, 1)
    before = _vectors(p, personal)  # owners fine-tuned their personal layer
    g = torch.Generator().manual_seed(5)
    personal = {k: v + torch.randn(v.shape, generator=g) for k, v in personal.items()}
    assert torch.equal(before, _vectors(p, personal))  # bit-identical: no feedback


def test_paper_mode_feeds_personal_state_back_and_says_heuristic(tmp_path):
    cfg, p = _prepared("joint_dp", **{"privacy.accounting": "paper"})
    personal = p.owners.initial_personal(p.fed.num_owners)
    before = _vectors(p, personal)
    g = torch.Generator().manual_seed(5)
    personal = {k: v + torch.randn(v.shape, generator=g) for k, v in personal.items()}
    assert not torch.equal(before, _vectors(p, personal))
    s = run(tiny_cfg("joint_dp", **{"privacy.accounting": "paper"}), tmp_path)
    assert s["guarantee"] == "heuristic"
    led = json.loads((tmp_path / "ledger.json").read_text())
    assert led["guarantee"] == "heuristic" and any("heuristic" in n for n in led["notes"])


def test_a_run_records_the_version_and_source_commit_that_produced_it(tmp_path):
    """summary.json names fedudp's version (the installed metadata, as ``fedudp.__version__`` and
    ``fedudp --version``) and, from a git checkout, the commit and whether it was modified."""
    from importlib.metadata import version

    import fedudp

    s = run(tiny_cfg("fedavg", **{"train.rounds": 1}), tmp_path)
    assert s["fedudp_version"] == version("fedudp") == fedudp.__version__
    root = Path(fedudp.__file__).resolve().parents[1]
    git = lambda *a: subprocess.run(
        ["git", "-C", str(root), *a],
        capture_output=True,  # noqa: E731
        text=True,
    )
    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        assert s["source"] == {"commit": None, "modified": None}
    else:
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip())
        assert s["source"] == {"commit": head.stdout.strip(), "modified": dirty}
    assert json.loads((tmp_path / "summary.json").read_text())["source"] == s["source"]


def test_the_source_is_read_when_the_run_starts_not_when_it_ends(tmp_path, monkeypatch):
    """A checkout that moves during a long run (a commit, an edit) does not relabel it: the
    commit recorded is the one read before the run's first step."""
    import fedudp.run as run_mod

    calls = []

    def moving_checkout():
        calls.append(len(calls))
        name = "start" if len(calls) == 1 else "moved"
        return {"fedudp_version": "x", "source": {"commit": name, "modified": False}}

    monkeypatch.setattr(run_mod, "provenance", moving_checkout)
    s = run(tiny_cfg("fedavg", **{"train.rounds": 1}), tmp_path)
    assert calls and s["source"] == {"commit": "start", "modified": False}


def test_fedudp_version_prints_the_package_version(monkeypatch, capsys):
    from importlib.metadata import version

    from fedudp.cli import main

    monkeypatch.setattr(sys, "argv", ["fedudp", "--version"])
    main()
    assert capsys.readouterr().out.strip() == f"fedudp {version('fedudp')}"


# -- the four methods end to end ---------------------------------------------------------------
@pytest.mark.parametrize("method", ["per_silo", "fedavg", "full_dp", "joint_dp"])
def test_method_end_to_end(method, tmp_path):
    s = run(tiny_cfg(method), tmp_path)
    for f in ("config.yaml", "metrics.jsonl", "owners.csv", "ledger.json", "summary.json"):
        assert (tmp_path / f).stat().st_size > 0
    assert SUMMARY_KEYS <= set(s) and s["rounds_completed"] == 3
    assert json.loads((tmp_path / "summary.json").read_text())["method"] == method
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all({"loss", "accuracy_mean", "seconds"} <= set(r) for r in rows)
    owners = (tmp_path / "owners.csv").read_text().splitlines()
    assert len(owners) == 1 + 4
    assert 0.0 <= s["accuracy_mean"] <= 1.0
    if method in ("full_dp", "joint_dp"):
        assert s["guarantee"] == "certified" and s["unit"] == "user"
        assert s["adjacency"] == "add_or_remove_one" and s["delta"] == 1e-5
        assert 0.9 < s["epsilon"] <= 1.0 + 1e-6  # the whole budget, not more
        assert all("epsilon" in r for r in rows)
        eps = [r["epsilon"] for r in rows]
        assert eps == sorted(eps)
    else:
        assert s["epsilon"] is None and s["guarantee"] == "none"


def test_training_beats_chance_and_is_seeded(tmp_path):
    kw = {"train.rounds": 8, "dataset.num_records": 400}
    a = run(tiny_cfg("fedavg", **kw), tmp_path / "a")
    b = run(tiny_cfg("fedavg", **kw), tmp_path / "b")
    assert a["accuracy_mean"] > 0.3  # 10 classes: chance is 0.1
    assert a["accuracy_mean"] == b["accuracy_mean"]


def test_owner_unit_accounts_owners(tmp_path):
    s = run(tiny_cfg("full_dp", **{"privacy.unit": "owner"}), tmp_path)
    assert s["unit"] == "owner" and s["epsilon"] <= 1.0 + 1e-6
    led = json.loads((tmp_path / "ledger.json").read_text())
    assert led["unit"] == "owner"


def test_budget_stop_before_exceeding(tmp_path):
    # a fixed (too small) noise multiplier: the run stops before the round that would exceed
    s = run(tiny_cfg("full_dp", **{"privacy.noise_multiplier": 6.0, "train.rounds": 40}), tmp_path)
    assert s["stop_reason"] == "budget" and 1 <= s["rounds_completed"] < 40
    assert s["epsilon"] <= 1.0
    led = json.loads((tmp_path / "ledger.json").read_text())
    assert len(led["entries"]) == s["rounds_completed"]
    assert all(e["epsilon"] <= 1.0 for e in led["entries"])


def test_refuses_to_start_when_one_round_exceeds(tmp_path):
    with pytest.raises(ConfigError, match="privacy.epsilon"):
        run(tiny_cfg("full_dp", **{"privacy.noise_multiplier": 0.1}), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_cnn_on_idx_images(tmp_path):
    root = tiny_mnist(tmp_path / "data")
    cfg = tiny_cfg(
        "joint_dp",
        **{
            "dataset.name": "mnist",
            "dataset.root": str(root),
            "dataset.num_records": 200,
            "train.rounds": 2,
            "train.lr": 0.05,
        },
    )
    s = run(cfg, tmp_path / "out")
    assert s["num_records"] == 200 and s["rounds_completed"] == 2
    assert s["shared_dim"] == 416 + 12_832 + 15_690  # fc1 personal


# -- config errors -----------------------------------------------------------------------------
def _compose(overrides):
    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_typo_key_is_rejected_naming_it():
    with pytest.raises(Exception, match="epsilonn"):
        _compose(["privacy.epsilonn=1"])
    with pytest.raises(Exception, match="method"):
        _compose(["method=joint-dp"])


@pytest.mark.parametrize(
    "override,key",
    [
        ("privacy.epsilon=0", "privacy.epsilon"),
        ("privacy.epsilon=-1", "privacy.epsilon"),
        ("privacy.delta=1", "privacy.delta"),
        ("privacy.delta=0", "privacy.delta"),
        ("partition.num_owners=20000", "partition.num_owners"),
        ("train.sampling_rate=1.5", "train.sampling_rate"),
        ("privacy.clip=0", "privacy.clip"),
    ],
)
def test_bad_values_are_rejected_naming_the_key(override, key, tmp_path):
    cfg: RunConfig = OmegaConf.to_object(_compose([override]))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        run(cfg, tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing started


def test_missing_data_folder_fails_before_work(tmp_path):
    cfg = tiny_cfg("fedavg", **{"dataset.name": "mnist", "dataset.root": str(tmp_path / "none")})
    with pytest.raises(ConfigError, match="dataset.root"):
        run(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _cli_in_process(argv: list[str], monkeypatch) -> subprocess.CompletedProcess:
    """``fedudp <argv>`` in this process: its exit status and what it wrote on stderr."""
    import contextlib
    import io

    from fedudp.cli import main

    monkeypatch.setattr(sys, "argv", ["fedudp", *argv])
    err, code = io.StringIO(), 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(argv, code, "", err.getvalue())


@pytest.mark.parametrize(
    "args,key,process",
    [
        # a fresh process where a run reaches another part of fedudp (anything a first import
        # prints would break the one line); the other cases end in the same preflight as the
        # first one and run in this process
        (["privacy.epsilon=0"], "privacy.epsilon", True),  # a bad value
        (["privacy.epsilonn=1"], "privacy.epsilonn", False),  # a typo in a key
        (["method=joint-dp"], "method", False),  # an unknown choice
        (["-m", "method=full_dp,joint_dp", "privacy.epsilonn=1"], "privacy.epsilonn", False),
        (["method=full_dp", "privacy.noise_multiplier=0.1"], "privacy.epsilon", True),  # budget
        (["dataset.name=mnist", "dataset.root=/nonexistent"], "dataset.root", True),  # data files
        (["aggregator=winsorized", "train.sampling_rate=0.5"], "train.sampling_rate", True),
    ],
)
def test_cli_user_errors_are_one_line_and_exit_2(tmp_path, args, key, process, monkeypatch):
    argv = [*args, f"hydra.run.dir={tmp_path}", f"hydra.sweep.dir={tmp_path}"]
    if not process:
        monkeypatch.chdir(ROOT)
        p = _cli_in_process(argv, monkeypatch)
    else:
        env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0")
        p = subprocess.run(
            [sys.executable, "-m", "fedudp.run", *argv],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=120,
        )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith(f"fedudp: error: {key}"), p.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir"])
def test_cli_output_folder_it_cannot_create_is_one_line(tmp_path, key):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0")
    args = ["-m", "method=fedavg"] if key == "hydra.sweep.dir" else []
    p = subprocess.run(
        [sys.executable, "-m", "fedudp.run", *args, "train.rounds=1", f"{key}={blocker}/x"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr
    assert (
        len(lines) == 1
        and lines[0].startswith(f"fedudp: error: {key}=")
        and "is a file, not a folder" in lines[0]
    ), p.stderr


def test_progress_bar_marks_a_heuristic_epsilon(tmp_path, capsys):
    cfg = tiny_cfg("joint_dp", **{"privacy.accounting": "paper", "train.rounds": 1})
    cfg.progress = True
    run(cfg, tmp_path / "paper")
    assert "eps (heuristic)=" in capsys.readouterr().err
    cfg = tiny_cfg("joint_dp", **{"train.rounds": 1})
    cfg.progress = True
    run(cfg, tmp_path / "certified")
    err = capsys.readouterr().err
    assert "eps=" in err and "heuristic" not in err
