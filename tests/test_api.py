"""The Python API (``fedudp.simulate``) and the examples of docs/python.md ("Use from Python",
once the README's section), run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fedudp

# the examples moved with the README's "Use from Python" section to the documentation site
README = Path(__file__).resolve().parent.parent / "docs" / "python.md"


def readme_examples() -> list[str]:
    text = README.read_text()
    section = text.split("# Use from Python", 1)[1]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_readme_example_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    first, estimator, calibrated, own = readme_examples()
    exec(compile(first, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "completed 3"
    assert out[1] == "epsilon 1.000 (certified)"
    assert "summary.json" in out[6] and "config.yaml" in out[6]
    assert out[-1].startswith("train.roundz")
    assert (tmp_path / "runs" / "fedavg" / "summary.json").is_file()
    exec(compile(estimator, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "(5,) GaussianDpEvent(noise_multiplier=1.1)"
    exec(compile(calibrated, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "1200 0.709"
    exec(compile(own, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "300 300"


def test_simulate_in_memory_equals_the_run_folder(tmp_path):
    over = {
        "method": "full_dp",
        "train.rounds": 2,
        "partition.num_owners": 4,
        "dataset.num_records": 200,
    }
    mem = fedudp.simulate(over)
    disk = fedudp.simulate(over, out=tmp_path / "run")
    assert mem.out is None and disk.out == tmp_path / "run"
    assert mem.epsilon == disk.epsilon and mem.epsilon_kind == "certified"
    assert mem.accuracy == disk.accuracy
    for k in mem.shared:
        assert (mem.shared[k] == disk.shared[k]).all()
    assert [h["accuracy_mean"] for h in mem.history] == [h["accuracy_mean"] for h in disk.history]
    again = fedudp.simulate(over, out=tmp_path / "run")  # finished before: read back
    assert again.summary.get("skipped") and again.shared is None
    assert [h["round"] for h in again.history] == [h["round"] for h in disk.history]


def test_simulate_refuses_what_is_not_a_config():
    with pytest.raises(TypeError, match="RunConfig or a mapping"):
        fedudp.simulate([("train.rounds", 1)])
    with pytest.raises(fedudp.ConfigError, match="privacy.epsilon"):
        fedudp.simulate({"privacy.epsilon": -1.0})


def test_package_exports_only_what_it_documents():
    assert set(fedudp.__all__) == {
        "simulate",
        "SimulationResult",
        "RunConfig",
        "ConfigError",
        "config_from_overrides",
        "Records",
        "from_arrays",
    }
    with pytest.raises(AttributeError):
        fedudp.nothing_here
