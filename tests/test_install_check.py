"""The documented installs are consistent: ``pip check`` in the venv finds no broken requirement
(docs/usage.md, "Sweeps over cores or a Ray cluster"; issue 52). The launchers extra, where
installed, imports beside flwr; its pins keep flwr's ``packaging`` and ray[default]'s
``virtualenv`` within what flwr accepts."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
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


def _clean_env() -> dict:
    """This process's environment without ``PYTHONPATH``/``PYTHONHOME``: an in-process Flower
    simulation earlier in the session sets ``PYTHONPATH`` to the driver's ``sys.path``
    (Flower's ``RayBackend.init_ray``), which would put this venv's packages before the
    scratch venv's own in every subprocess."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _launchers_venv(tmp: Path) -> Path:
    """A venv that sees this one's packages (a ``.pth`` naming its site-packages) with the
    launchers extra's requirements installed into it: what ``pip install '.[launchers]'`` does
    to the documented install, without changing this venv."""
    import site
    import venv

    venv.EnvBuilder(with_pip=True).create(tmp)
    py = tmp / "bin" / "python"
    theirs = subprocess.run(
        [str(py), "-c", "import site; print(site.getsitepackages()[0])"],
        env=_clean_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(theirs, "fedudp_main_venv.pth").write_text(site.getsitepackages()[0] + "\n")
    for name in ("setuptools",):  # the new venv's own (ensurepip's) would shadow this venv's
        shutil.rmtree(Path(theirs, name), ignore_errors=True)
        for d in Path(theirs).glob(f"{name}-*.dist-info"):
            shutil.rmtree(d)
    reqs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "launchers"
    ]
    proc = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", *reqs],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return py


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_launchers_extra_installs_cleanly_and_its_ray_sweep_runs_on_loopback(tmp_path):
    """The extra installed over the documented install: ``pip check`` clean, flwr's ray pin
    kept; then docs/usage.md's Ray-launcher sweep, as written for loopback, on a head started
    here (its own session, stopped by PID): both runs finish with the sequential numbers."""
    import json
    import signal
    import time

    py = _launchers_venv(tmp_path / "venv")
    check = subprocess.run(
        [str(py), "-m", "pip", "check"], env=_clean_env(), capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    versions = subprocess.run(
        [
            str(py),
            "-c",
            "import ray, flwr, hydra_plugins.hydra_ray_launcher as h; "
            "print(ray.__version__, flwr.__version__)",
        ],
        env=_clean_env(),
        capture_output=True,
        text=True,
    )
    assert versions.returncode == 0, versions.stderr[-2000:]
    import flwr
    import ray

    assert versions.stdout.split() == [ray.__version__, flwr.__version__]

    env = dict(
        _clean_env(),
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        FLWR_TELEMETRY_ENABLED="0",
        RAY_USAGE_STATS_ENABLED="0",
    )
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = str(ROOT)  # fedudp for the driver and the head's workers
    ray_tmp = Path(subprocess.check_output(["mktemp", "-d", "/tmp/rl.XXXX"], text=True).strip())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path / "head.log"
    ray_cli = "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"
    head = subprocess.Popen(
        [
            str(py),
            "-c",
            ray_cli,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            f"--temp-dir={ray_tmp}",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        t_end = time.time() + 120
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None and time.time() < t_end, log.read_text()[-2000:]
            time.sleep(0.5)
        sweep = tmp_path / "sweep"
        proc = subprocess.run(
            [
                str(py),
                "-c",
                "from fedudp.cli import main; main()",
                "-m",
                "hydra/launcher=ray",
                f"+hydra.launcher.ray.init.address=127.0.0.1:{port}",
                "+hydra.launcher.ray.init.object_store_memory=null",
                "+hydra.launcher.ray.remote.num_cpus=1",
                "method=per_silo,fedavg",
                "train.rounds=2",
                "progress=false",
                f"hydra.sweep.dir={sweep}",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    got = {
        json.loads(p.read_text())["method"]: json.loads(p.read_text())["accuracy_mean"]
        for p in sweep.glob("*/summary.json")
    }
    from fedudp.run import run
    from fedudp.config import RunConfig

    want = {}
    for method in ("per_silo", "fedavg"):
        cfg = RunConfig()
        cfg.method, cfg.train.rounds, cfg.progress = method, 2, False
        want[method] = run(cfg, tmp_path / method)["accuracy_mean"]
    assert got == want
