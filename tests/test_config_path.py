"""The one-way config path (docs/architecture.md#configuration-and-outputs): the schema checks
only the configuration's own values and imports nothing above the foundation modules; a run
validates its config once and reads its plain settings once (``fedudp.build.check_config``),
whichever entry point starts it (the runner, the Python API, with or without a run folder)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import fedudp
import fedudp.build.assemble as assemble
import fedudp.build.run_settings as run_settings
import fedudp.config.validation as validation
from conftest import tiny_cfg
from fedudp.config import ConfigError, validate
from fedudp.run import run_with_result

HEAVY = ("torch", "fedudp.build", "fedudp.plugins", "fedudp.aggregators", "fedudp.data")


def _imported_by(module: str) -> list[str]:
    """The heavy modules a fresh interpreter holds after ``import <module>``."""
    code = (
        f"import sys, json, {module}\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({HEAVY!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_schema_imports_nothing_above_the_foundation():
    assert _imported_by("fedudp.config") == []
    # the twin: the probe sees a module that imports one of them (the plugin loader, which
    # ``validate`` imported before the path was one way)
    assert "fedudp.plugins" in _imported_by("fedudp.plugins")


def test_the_schema_checks_its_own_values_only(monkeypatch):
    """``validate`` neither imports the plugins nor asks torch about a CUDA device: the
    builder's ``check_config`` does, once."""
    import torch

    def no_query(*a, **k):
        raise AssertionError("the schema queried CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", no_query)
    cfg = tiny_cfg("full_dp", **{"engine_opts.device": "cuda", "plugins": ["no_such_plugin_mod"]})
    validate(cfg)  # its own values are fine: no import, no query
    assert "no_such_plugin_mod" not in sys.modules
    with pytest.raises(ConfigError, match=r"^plugins: no module 'no_such_plugin_mod'"):
        fedudp.build.check_config(cfg)
    with pytest.raises(ConfigError, match=r"^engine_opts\.device: must be cpu, cuda or cuda:N"):
        validate(tiny_cfg("full_dp", **{"engine_opts.device": "gpu"}))


@pytest.fixture
def counts(monkeypatch):
    """How many times a run validates its config and makes its settings: a counter inside the
    one function of each (every caller counted, whatever name it imported them under)."""
    seen = {"validate": 0, "settings": 0}
    privacy, made = validation._check_privacy, run_settings.RunSettings

    def counted_privacy(cfg):  # validate runs it exactly once per call
        seen["validate"] += 1
        return privacy(cfg)

    class Counted(made):  # settings builds exactly one per call
        def __init__(self, *a, **k):
            seen["settings"] += 1
            super().__init__(*a, **k)

    monkeypatch.setattr(validation, "_check_privacy", counted_privacy)
    monkeypatch.setattr(run_settings, "RunSettings", Counted)
    return seen


def _runs(tmp_path) -> dict:
    """The entry points of one run each: the runner (a folder), the API in memory and with a
    folder."""
    cfg = lambda: tiny_cfg("full_dp", **{"train.rounds": 1})  # noqa: E731
    return {
        "run_with_result": lambda: run_with_result(cfg(), tmp_path / "a"),
        "simulate": lambda: fedudp.simulate(cfg()),
        "simulate(out=)": lambda: fedudp.simulate(cfg(), out=tmp_path / "b"),
    }


def _calls_per_run(counts: dict, start) -> dict:
    counts.update(validate=0, settings=0)
    start()
    return dict(counts)


def test_a_run_validates_and_reads_its_settings_once(counts, tmp_path):
    for name, start in _runs(tmp_path).items():
        assert _calls_per_run(counts, start) == {"validate": 1, "settings": 1}, name


def test_twin_a_second_validate_is_counted(counts, tmp_path, monkeypatch):
    """The weakened twin: ``prepare`` checking the config again (as before the path was one
    way: ``run.py``, ``build.check`` and ``api.simulate`` each validated) is caught."""
    from fedudp.build.run_settings import settings

    rest = assemble.check_run

    def again(cfg):
        validate(cfg)
        settings(cfg)
        rest(cfg)

    monkeypatch.setattr(assemble, "check_run", again)
    for name, start in _runs(tmp_path).items():
        assert _calls_per_run(counts, start) == {"validate": 2, "settings": 2}, name
