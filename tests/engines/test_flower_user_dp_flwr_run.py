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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_example_runs_under_flwr_run(tmp_path):
    app = tmp_path / "app"
    shutil.copytree(ROOT / "examples" / "flower_user_dp", app)
    home, out = tmp_path / "flwr_home", tmp_path / "out"
    home.mkdir()
    bindir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLWR_", "RAY_"))}
    env.update(PATH=bindir + os.pathsep + env.get("PATH", ""), VIRTUAL_ENV=str(Path(bindir).parent),
               FLWR_HOME=str(home), FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0",
               FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
               FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(_free_port()),
               FLWR_LOCAL_CONTROL_API_PORT=str(_free_port()))
    flwr = shutil.which("flwr", path=bindir)
    try:
        run = subprocess.run([flwr, "run", ".", "--stream", "--run-config",
                              f"num-server-rounds=2 output-dir='{out}'"], cwd=app, env=env,
                             capture_output=True, text=True, timeout=480)
        log = run.stdout + run.stderr
        assert run.returncode == 0, log[-4000:]
        ls = subprocess.run([flwr, "ls", "--format", "json"], cwd=app, env=env,
                            capture_output=True, text=True, timeout=60)
        assert [r["status"] for r in json.loads(ls.stdout)["runs"]] == ["finished:completed"], log[-4000:]
        ledger = json.loads((out / "ledger.json").read_text())
        assert len(ledger["entries"]) == 2 and ledger["unit"] == "user"
        z = ledger["entries"][-1]["noise_multiplier"]
        acc = dp_accounting.pld.PLDAccountant()
        acc.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(z)), 2))
        assert ledger["entries"][-1]["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3)
    finally:
        assert _stop(str(home)) == [], "processes left behind"
