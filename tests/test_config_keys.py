"""Unknown keys are refused with or without Hydra's '+' (issue 37): ``OmegaConf.to_object``
drops a key the schema lacks, so ``+train.roundz=3`` ran with the default rounds and
``+model._target_=mynets.GNNet`` trained the built-in model. A model's own arguments stay a
free-form dict: ``+model.kwargs.hidden=64``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from fedudp.config import check_known_keys, config_from_overrides, register
from fedudp.errors import ConfigError
from fedudp.cli import CONF_DIR, preflight

ROOT = Path(__file__).resolve().parents[1]


def composed(*overrides: str):
    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize(
    "override,key",
    [
        ("+train.roundz=3", "train.roundz"),
        ("+model._target_=mynets.GNNet", "model._target_"),
        ("+roundz=3", "roundz"),
        ("+privacy.extra.depth=2", "privacy.extra"),
    ],
)
def test_a_plus_key_the_schema_lacks_is_refused_naming_it(override, key):
    cfg = composed(override)
    # premise: Hydra accepted the key, and to_object would drop it without a word
    assert OmegaConf.select(cfg, key) is not None
    with pytest.raises(ConfigError) as info:
        check_known_keys(cfg)
    msg = str(info.value)
    assert msg.startswith(f"{key}: unknown key") and "\n" not in msg
    assert "model.kwargs" in msg and "model.target" in msg


def test_model_kwargs_is_a_free_dict_and_the_documented_plus_form_works():
    cfg = composed(
        "model.target=torch.nn.Identity", "+model.kwargs.hidden=64", "+model.kwargs.act=relu"
    )
    check_known_keys(cfg)  # no refusal
    run = OmegaConf.to_object(cfg)
    assert run.model.kwargs == {"hidden": 64, "act": "relu"}
    assert run.model.target == "torch.nn.Identity"
    # the library path takes the same key without '+'
    assert config_from_overrides({"model.kwargs.hidden": 64}).model.kwargs == {"hidden": 64}


def test_a_known_config_passes_and_the_library_path_names_unknown_keys():
    check_known_keys(composed("train.rounds=3", "method=fedavg"))
    with pytest.raises(ConfigError, match=r"^train\.roundz: unknown key.*model\.kwargs"):
        config_from_overrides({"train.roundz": 3})


@pytest.mark.parametrize(
    "args,key,hint",
    [
        (["+train.roundz=3"], "train.roundz", "+model.kwargs.hidden=64"),  # with '+'
        (["train.roundz=3"], "train.roundz", "+model.kwargs.hidden=64"),  # without
        (["+model._target_=mynets.GNNet"], "model._target_", "model.target="),
        (["model.kwargs.hidden=64"], "model.kwargs.hidden", "+model.kwargs.hidden="),
    ],
)
def test_the_cli_preflight_refuses_unknown_keys_in_one_line(capsys, args, key, hint):
    with pytest.raises(SystemExit) as info:
        preflight(args)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert info.value.code == 2
    assert len(lines) == 1 and lines[0].startswith(f"fedudp: error: {key}:"), err
    assert hint in lines[0]


@pytest.mark.slow  # a fresh interpreter: about 20 s on a loaded machine
def test_cli_plus_key_ends_before_any_work(tmp_path):
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0")
    p = subprocess.run(
        [sys.executable, "-m", "fedudp.run", "+train.roundz=3", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith("fedudp: error: train.roundz: unknown key")
    assert not (tmp_path / "config.yaml").exists() and not (tmp_path / "metrics.jsonl").exists()
