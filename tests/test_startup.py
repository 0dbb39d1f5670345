"""The command line starts light and reads the current directory's ``conf/``.

Structural, not timed (the times are scripts/benchmarks/bench_startup.py's,
docs/results/startup/README.md): ``import fedudp`` and ``import fedudp.cli`` load no heavy
library, ``fedudp --version`` and ``fedudp --help`` not even Hydra, ``fedudp-audit --help`` and
``fedudp-report --help`` no torch, scipy or dp_accounting (those come with the runner or the
audit, when the work starts). Composing the config (``--cfg job``, every run's preflight) does
import them: the schema's ``estimator.*`` defaults come from the estimator registry. Each check runs in a fresh
interpreter and reads its ``sys.modules``. Then the top-level ``conf/`` design: a user's
``./conf/experiment/<name>.yaml`` is found by ``fedudp +experiment=<name>``, one that shadows a
fedudp preset with other content is refused, and the checkout's own ``conf/`` is not added twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from fedudp.cli import CONF_DIR, preflight, user_searchpath

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "scipy", "dp_accounting", "numpy", "matplotlib", "flwr", "ray", "pandas")
HYDRA = ("hydra", "omegaconf")


def _env() -> dict[str, str]:
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0")
    # the checkout first, whatever installation the interpreter has
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def loaded_after(code: str, cwd: Path | str = ROOT) -> tuple[set[str], str]:
    """The top-level packages in ``sys.modules`` after ``code`` ran in a fresh interpreter
    (a ``SystemExit`` from a CLI's ``main`` is caught), and what it printed."""
    body = textwrap.indent(textwrap.dedent(code).strip(), "    ")
    probe = (
        f"import json, sys\ntry:\n{body}\nexcept SystemExit as e:\n    assert e.code in (0, None)\n"
        "import fedudp\nmods = sorted({m.split('.')[0] for m in sys.modules})\n"
        "print('\\nMODULES ' + json.dumps([fedudp.__file__, mods]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe], cwd=cwd, env=_env(), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    out, _, tail = r.stdout.rpartition("\nMODULES ")
    file, mods = json.loads(tail)
    assert Path(file).resolve().is_relative_to(ROOT), file  # this checkout's fedudp was probed
    return set(mods), out


@pytest.mark.parametrize("module", ["fedudp", "fedudp.cli"])
def test_importing_the_package_and_the_cli_loads_no_heavy_library(module):
    mods, _ = loaded_after(f"import {module}")
    assert mods.isdisjoint(HEAVY + HYDRA), sorted(mods & set(HEAVY + HYDRA))


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_version_and_help_answer_without_hydra(flag):
    mods, out = loaded_after(
        f"sys.argv = ['fedudp', {flag!r}]\nfrom fedudp.cli import main\nmain()"
    )
    first = out.strip().splitlines()[0]
    assert first.startswith("fedudp 0." if flag == "--version" else "usage: fedudp"), first
    assert mods.isdisjoint(HEAVY + HYDRA), sorted(mods & set(HEAVY + HYDRA))
    if flag == "--help":  # the presets, read from the config tree
        assert "huang_table1" in out and "tracking: mlflow, none, tensorboard" in out


@pytest.mark.parametrize("module", ["fedudp.audit", "fedudp.report"])
def test_the_other_clis_answer_help_without_torch_scipy_or_dp_accounting(module):
    mods, out = loaded_after(
        f"sys.argv = ['x', '--help']\nfrom {module} import main\nsys.exit(main())"
    )
    assert "usage:" in out
    bad = {"torch", "scipy", "dp_accounting"}
    assert mods.isdisjoint(bad), sorted(mods & bad)


# -- conf/: the presets at the top level, your own experiments in ./conf ------------------------
def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _fedudp(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedudp", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_package_config_tree_is_the_top_level_conf():
    assert Path(CONF_DIR).resolve() == (ROOT / "conf").resolve()
    assert (ROOT / "conf" / "config.yaml").is_file()
    assert any((ROOT / "conf" / "experiment").glob("*.yaml"))


def test_a_user_experiment_in_the_current_directory_is_found_by_the_cli(tmp_path, capsys):
    _write(
        tmp_path / "conf" / "experiment" / "mine.yaml",
        """\
        # @package _global_
        method: fedavg
        privacy: {epsilon: 2.5}
        train: {rounds: 7}
        """,
    )
    # the real command line in the user's folder (one process: it composes the schema)
    r = _fedudp("+experiment=mine", "train.lr=0.25", "--cfg", "job", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    job = yaml.safe_load(r.stdout)
    assert (job["method"], job["privacy"]["epsilon"], job["train"]["rounds"]) == ("fedavg", 2.5, 7)
    assert job["train"]["lr"] == 0.25  # the command line still wins over the file
    assert "mine" in _fedudp("--help", cwd=tmp_path).stdout  # listed beside the presets
    # the negative control, in this process: without ./conf on the path the name is unknown
    preflight(user_searchpath(["+experiment=mine"], cwd=tmp_path))  # found: no error
    with pytest.raises(SystemExit) as e:
        preflight(user_searchpath(["+experiment=mine"], cwd=tmp_path / "conf"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("fedudp: error:") and err.count("\n") == 1, err
    assert "experiment/mine" in err and "huang_table1" in err


def test_a_user_file_that_shadows_a_preset_is_refused(tmp_path):
    preset = Path(CONF_DIR) / "experiment" / "huang_table1.yaml"
    copy = _write(tmp_path / "conf" / "experiment" / "huang_table1.yaml", preset.read_text())
    assert user_searchpath(["x=1"], cwd=tmp_path)[0].startswith("hydra.searchpath=")  # same: ok
    copy.write_text(preset.read_text() + "seed: 3\n")
    r = _fedudp("+experiment=huang_table1", "--cfg", "job", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and str(copy) in line and "rename your file" in line


def test_the_search_path_override_sits_with_the_other_overrides(tmp_path):
    (tmp_path / "conf").mkdir()
    path = f"hydra.searchpath=['file://{(tmp_path / 'conf').resolve()}']"
    assert user_searchpath(["-m", "a=1", "b=2"], cwd=tmp_path) == ["-m", path, "a=1", "b=2"]
    assert user_searchpath(["--cfg", "job"], cwd=tmp_path) == ["--cfg", "job", path]
    # one given on the command line replaces it; no ./conf or the checkout's own: nothing added
    mine = ["hydra.searchpath=[pkg://x]"]
    assert user_searchpath(mine, cwd=tmp_path) == mine
    assert user_searchpath(["a=1"], cwd=tmp_path / "conf") == ["a=1"]
    assert user_searchpath(["a=1"], cwd=ROOT) == ["a=1"]
