"""The example app (examples/flower_user_dp) under Flower's own tooling: ``flwr run . --stream``
on the simulation engine, with a local SuperLink of its own (free ports, a fresh FLWR_HOME);
its ledger's ε equals a direct dp-accounting computation with the run's constants."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dp_accounting
import pytest

from test_flower_flwr_run import _free_port, _stop

ROOT = Path(__file__).resolve().parents[2]


def assert_direct_epsilon(ledger: dict) -> None:
    """The ledger's ε after its 2 releases equals dp-accounting's PLD for 2 Poisson(0.5)-sampled
    Gaussian releases at its noise multiplier, δ = 1e-5 (the example's run config)."""
    z = ledger["entries"][-1]["noise_multiplier"]
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(z)), 2))
    assert ledger["entries"][-1]["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3)


def flwr_env(home: Path) -> tuple[str, dict]:
    """(the venv's bin folder, the environment for Flower's commands): this venv first on PATH,
    a fresh FLWR_HOME, no telemetry, no runtime dependency installation."""
    bindir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLWR_", "RAY_"))}
    env.update(PATH=bindir + os.pathsep + env.get("PATH", ""), VIRTUAL_ENV=str(Path(bindir).parent),
               FLWR_HOME=str(home), FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0",
               FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
    return bindir, env


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_example_runs_under_flwr_run(tmp_path):
    app = tmp_path / "app"
    shutil.copytree(ROOT / "examples" / "flower_user_dp", app)
    home, out = tmp_path / "flwr_home", tmp_path / "out"
    home.mkdir()
    bindir, env = flwr_env(home)
    env.update(FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(_free_port()),
               FLWR_LOCAL_CONTROL_API_PORT=str(_free_port()))
    flwr = shutil.which("flwr", path=bindir)
    try:
        run = subprocess.run([flwr, "run", ".", "--stream", "--run-config",
                              f"fedudp.train.rounds=2 output-dir='{out}'"], cwd=app, env=env,
                             capture_output=True, text=True, timeout=480)
        log = run.stdout + run.stderr
        assert run.returncode == 0, log[-4000:]
        ls = subprocess.run([flwr, "ls", "--format", "json"], cwd=app, env=env,
                            capture_output=True, text=True, timeout=60)
        assert [r["status"] for r in json.loads(ls.stdout)["runs"]] == ["finished:completed"], log[-4000:]
        ledger = json.loads((out / "ledger.json").read_text())
        assert len(ledger["entries"]) == 2 and ledger["unit"] == "user"
        assert_direct_epsilon(ledger)
    finally:
        assert _stop(str(home)) == [], "processes left behind"


def _wait_port(port: int, timeout: float = 60.0) -> None:
    import socket
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_example_runs_on_the_deployment_engine(tmp_path):
    """A SuperLink and two SuperNodes on loopback (insecure), started here; ``flwr run`` against
    that SuperLink; the ledger's ε equals dp-accounting directly."""
    app = tmp_path / "app"
    shutil.copytree(ROOT / "examples" / "flower_user_dp", app)
    # flwr 1.42's SuperLink serves its Runtime, Control and Fleet APIs on one HTTP port
    fleet = control = _free_port()
    with open(app / "pyproject.toml", "a") as f:
        f.write(f'\n[tool.flwr.federations.deploy]\naddress = "127.0.0.1:{control}"\n'
                'insecure = true\n')
    home, out = tmp_path / "flwr_home", tmp_path / "out"
    home.mkdir()
    bindir, env = flwr_env(home)
    procs = []
    try:
        procs.append(subprocess.Popen(
            [shutil.which("flower-superlink", path=bindir), "--insecure",
             "--host", "127.0.0.1", "--port", str(control)],
            env=env, cwd=tmp_path, stdout=open(tmp_path / "superlink.log", "w"),
            stderr=subprocess.STDOUT))
        _wait_port(control)
        for p in range(2):
            procs.append(subprocess.Popen(
                [shutil.which("flower-supernode", path=bindir), "--insecure",
                 "--superlink", f"127.0.0.1:{fleet}", "--port", str(_free_port()),
                 "--node-config", f"partition-id={p} num-partitions=2"],
                env=env, cwd=tmp_path, stdout=open(tmp_path / f"supernode{p}.log", "w"),
                stderr=subprocess.STDOUT))
        run = subprocess.run([shutil.which("flwr", path=bindir), "run", ".", "deploy", "--stream",
                              "--run-config", f"fedudp.train.rounds=2 fedudp.public.users=20 output-dir='{out}'"],
                             cwd=app, env=env, capture_output=True, text=True, timeout=420)
        log = run.stdout + run.stderr
        logs = "".join((tmp_path / f).read_text()[-1500:] for f in
                       ("superlink.log", "supernode0.log", "supernode1.log"))
        assert run.returncode == 0 and (out / "ledger.json").is_file(), log[-3000:] + logs
        ledger = json.loads((out / "ledger.json").read_text())
        assert len(ledger["entries"]) == 2 and ledger["extra"]["public"]["users"] == 20
        assert_direct_epsilon(ledger)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        assert _stop(str(home)) == [], "processes left behind"
