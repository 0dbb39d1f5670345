"""The documented installs are consistent: ``pip check`` in the venv finds no broken requirement
(docs/usage.md, "Sweeps over cores or a Ray cluster"; issue 52). The launchers extra, where
installed, imports beside flwr; its pins keep flwr's ``packaging`` and ray[default]'s
``virtualenv`` within what flwr accepts."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_pip_check_of_the_venv_passes():
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_launchers_extra_keeps_flwrs_pins():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    launchers = " ".join(extras["launchers"])
    assert "hydra-ray-launcher" in launchers and "hydra-joblib-launcher" in launchers
    # flwr 1.42 requires packaging<26; virtualenv>=21 (ray[default]) would need packaging>=26
    assert "packaging>=24,<26" in launchers and "virtualenv<21" in launchers
    assert any(x.startswith("flwr[simulation]") for x in extras["flower"])


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


@pytest.mark.skipif(
    not _installed("hydra_plugins.hydra_ray_launcher"),
    reason="the launchers extra is not installed",
)
def test_the_ray_launcher_imports_beside_flwr():
    import flwr  # noqa: F401
    import hydra_plugins.hydra_ray_launcher  # noqa: F401
