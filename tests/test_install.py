"""fedudp installs as an ordinary package: the Hydra config tree and its presets (the
checkout's top-level ``conf/``, linked into the package as ``fedudp/conf -> ../conf``) are package
data, so a non-editable install runs without the checkout.

The fast test checks that ``fedudp/conf`` is that link and that ``pyproject.toml``'s package-data
declaration covers every file under ``conf/``. The slow test is the real proof: it builds a wheel
from a copy of the sources (the link kept as a link, so the build must resolve it),
installs it with ``--no-deps --target`` into a temporary folder (the dependencies come from the
running venv), and runs the CLI, a preset and ``fedudp.simulate`` from outside the repository with
that folder on ``PYTHONPATH``. ``PYTHONPATH`` comes before the editable install's finder (appended
to ``sys.meta_path``) and its ``.pth`` entries, so the installed copy is the one imported; the test
checks that it is.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"  # fedudp/conf links here
PKG = ROOT / "fedudp"
# what the sdist-free wheel build needs from the checkout (the rest of the tree is left alone)
BUILD_FILES = ("pyproject.toml", "README.md", "MANIFEST.in", "LICENSE", "setup.cfg")


def conf_files() -> set[str]:
    """Every file of the config tree, relative to the package (``conf/experiment/x.yaml``)."""
    return {
        p.relative_to(CONF.parent).as_posix()
        for p in CONF.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_package_data_declares_every_config_file():
    link = PKG / "conf"
    assert link.is_symlink() and os.readlink(link) == "../conf", "fedudp/conf must link ../conf"
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["fedudp"]
    declared = {  # the patterns as setuptools reads them: relative to the package, via the link
        Path(m).as_posix() for pat in patterns for m in glob.glob(pat, root_dir=PKG, recursive=True)
    }
    files = conf_files()
    assert "conf/config.yaml" in files and any(f.startswith("conf/experiment/") for f in files)
    assert files - declared == set(), "files under conf/ not shipped as package data"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        FLWR_TELEMETRY_ENABLED="0",
        RAY_USAGE_STATS_ENABLED="0",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        **extra,
    )
    return env


def _pip(*args: str, cwd: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pip", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def build_wheel(base: Path) -> Path:
    """A wheel built from a copy of the package sources (the checkout gets no build/ folder)."""
    src, dist = base / "src", base / "dist"
    src.mkdir()
    for name in BUILD_FILES:
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, src / name)
    shutil.copytree(CONF, src / "conf")
    shutil.copytree(
        ROOT / "fedudp",
        src / "fedudp",
        symlinks=True,  # fedudp/conf stays a link to ../conf: the build resolves it
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
    )
    assert (src / "fedudp" / "conf").is_symlink()
    # the venv's setuptools builds offline and in about a second; without one, pip's isolated
    # build fetches the build-system requirements from the index
    local = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    _pip("wheel", "-q", "--no-deps", *local, "-w", str(dist), str(src), cwd=base)
    wheels = list(dist.glob("fedudp-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_non_editable_install_runs_outside_the_repository(tmp_path):
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"fedudp/{f}" for f in conf_files()}
    assert "fedudp/conf/config.yaml" in shipped and shipped <= names, shipped - names

    site, work = tmp_path / "site", tmp_path / "work"
    _pip(
        "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel), cwd=tmp_path
    )
    work.mkdir()
    env = _env(PYTHONPATH=str(site))

    def py(*args: str) -> subprocess.CompletedProcess:
        r = subprocess.run(
            [sys.executable, *args], cwd=work, env=env, capture_output=True, text=True, timeout=240
        )
        assert r.returncode == 0, r.stdout + r.stderr
        return r

    def installed(path: str) -> bool:
        return Path(path).resolve().is_relative_to(site.resolve())

    # the CLI, with the config tree of the installed copy
    out = tmp_path / "out"
    py(
        "-m",
        "fedudp.run",
        "train.rounds=1",
        "partition.num_owners=4",
        "dataset.num_records=200",
        f"hydra.run.dir={out}",
    )
    s = json.loads((out / "summary.json").read_text())
    assert s["rounds_completed"] == 1
    sources = yaml.safe_load((out / ".hydra" / "hydra.yaml").read_text())
    main = [
        c["path"] for c in sources["hydra"]["runtime"]["config_sources"] if c["provider"] == "main"
    ]
    assert len(main) == 1 and installed(main[0]), main

    # a preset, composed from the installed package data
    job = yaml.safe_load(py("-m", "fedudp.run", "+experiment=huang_table1", "--cfg", "job").stdout)
    preset = yaml.safe_load(
        (site / "fedudp" / "conf" / "experiment" / "huang_table1.yaml").read_text()
    )
    assert job["privacy"]["clip"] == preset["privacy"]["clip"]
    assert job["dataset"]["name"] == preset["dataset"]["name"]

    # the Python API
    r = py(
        "-c",
        "import fedudp, fedudp.cli; print(fedudp.__file__); print(fedudp.cli.CONF_DIR); "
        "r = fedudp.simulate({'train.rounds': 1, 'partition.num_owners': 4, "
        "'dataset.num_records': 200}); print(r.stop_reason)",
    )
    file, conf_dir, stop = r.stdout.strip().splitlines()[-3:]
    assert installed(file) and installed(conf_dir), (file, conf_dir)
    assert stop == "completed"
