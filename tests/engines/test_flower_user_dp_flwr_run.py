"""The example app (examples/flower_user_dp) under Flower's own tooling, run in place in the
checkout: ``flwr run . --stream`` on the simulation engine (a local SuperLink of its own: free
ports, a fresh FLWR_HOME) and ``flwr run . deploy --stream`` against a SuperLink and two
SuperNodes on loopback, the ``deploy`` connection in Flower's configuration file
(``$FLWR_HOME/config.toml``), never in the app's ``pyproject.toml``. Afterwards the example's
files are byte for byte what they were (``git status --porcelain`` of the folder unchanged: no
migration rewrote them); the ledger's ε equals a direct dp-accounting computation with the run's
constants; the server's history carries the app's training loss."""

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
EXAMPLE = ROOT / "examples" / "flower_user_dp"


def example_state() -> tuple[dict[str, bytes], str | None]:
    """(every file of the example but caches, byte for byte; ``git status --porcelain`` of the
    folder, None where there is no git checkout)."""
    files = {
        str(p.relative_to(EXAMPLE)): p.read_bytes()
        for p in sorted(EXAMPLE.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }
    try:
        git = subprocess.run(
            ["git", "status", "--porcelain", "--", str(EXAMPLE)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        status = git.stdout if git.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        status = None
    return files, status


def assert_history(out: Path, rounds: int) -> None:
    """The ServerApp's ``history.json`` (Flower's Result): each training round's metrics carry
    the app's ``train_loss`` beside epsilon, the users released and the failed clients."""
    history = json.loads((out / "history.json").read_text())["train_metrics_clientapp"]
    assert sorted(int(r) for r in history) == list(range(1, rounds + 1)), history
    for m in history.values():
        assert {"train_loss", "epsilon", "users", "failed_clients", "clients"} <= set(m), m
        assert m["failed_clients"] == 0 and 0.0 < m["train_loss"] < 5.0


def assert_direct_epsilon(ledger: dict) -> None:
    """The ledger's ε after its 2 releases equals dp-accounting's PLD for 2 Poisson(0.5)-sampled
    Gaussian releases at its noise multiplier, δ = 1e-5 (the example's run config)."""
    z = ledger["entries"][-1]["noise_multiplier"]
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(z)), 2
        )
    )
    assert ledger["entries"][-1]["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3)


def flwr_env(home: Path) -> tuple[str, dict]:
    """(the venv's bin folder, the environment for Flower's commands): this venv first on PATH,
    a fresh FLWR_HOME, no telemetry, no runtime dependency installation."""
    bindir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLWR_", "RAY_"))}
    env.update(
        PATH=bindir + os.pathsep + env.get("PATH", ""),
        VIRTUAL_ENV=str(Path(bindir).parent),
        FLWR_HOME=str(home),
        FLWR_TELEMETRY_ENABLED="0",
        RAY_USAGE_STATS_ENABLED="0",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
    )
    return bindir, env


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_example_runs_under_flwr_run(tmp_path):
    """``flwr run . --stream`` from the example's own folder, the simulation's 4 SuperNodes per
    run (``--federation-config``, Flower >= 1.28's way; nothing in the app's files)."""
    app = EXAMPLE
    before = example_state()
    home, out = tmp_path / "flwr_home", tmp_path / "out"
    home.mkdir()
    bindir, env = flwr_env(home)
    env.update(
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(_free_port()),
        FLWR_LOCAL_CONTROL_API_PORT=str(_free_port()),
    )
    flwr = shutil.which("flwr", path=bindir)
    try:
        run = subprocess.run(
            [
                flwr,
                "run",
                ".",
                "--stream",
                "--federation-config",
                "num-supernodes=4 client-resources-num-cpus=1",
                "--run-config",
                f"num-server-rounds=2 output-dir='{out}'",
            ],
            cwd=app,
            env=env,
            capture_output=True,
            text=True,
            timeout=480,
        )
        log = run.stdout + run.stderr
        assert run.returncode == 0, log[-4000:]
        assert example_state() == before, "flwr run changed the example's files"
        assert "Migrat" not in log and "legacy" not in log, log[-3000:]
        ls = subprocess.run(
            [flwr, "ls", "--format", "json"],
            cwd=app,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert [r["status"] for r in json.loads(ls.stdout)["runs"]] == ["finished:completed"], log[
            -4000:
        ]
        ledger = json.loads((out / "ledger.json").read_text())
        assert len(ledger["entries"]) == 2 and ledger["unit"] == "user"
        assert_direct_epsilon(ledger)
        assert_history(out, 2)
        # 4 SuperNodes x 10 users: the released rounds drew from all 40 users' slots
        assert ledger["extra"]["utility_before_round_1"]["expected_cohort"] == 20.0
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


def deploy(tmp_path: Path, run_config: str) -> dict:
    """The example on a SuperLink and two SuperNodes on loopback (insecure), started here;
    ``flwr run . deploy --stream --run-config <run_config>`` from the example's folder, the
    ``deploy`` connection in Flower's configuration file. Returns the command's return code and
    output, the servers' log tails, the run's status (``flwr ls``), the output folder and
    whether the example's files stayed as they were."""
    app = EXAMPLE
    before = example_state()
    # flwr 1.42's SuperLink serves its Runtime, Control and Fleet APIs on one HTTP port
    fleet = control = _free_port()
    home, out = tmp_path / "flwr_home", tmp_path / "out"
    home.mkdir()
    # Flower's configuration file: the docs' [superlink.deploy] connection (docs/flower-apps.md)
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n\n'
        f'[superlink.deploy]\naddress = "127.0.0.1:{control}"\ninsecure = true\n'
    )
    bindir, env = flwr_env(home)
    procs = []
    try:
        procs.append(
            subprocess.Popen(
                [
                    shutil.which("flower-superlink", path=bindir),
                    "--insecure",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(control),
                ],
                env=env,
                cwd=tmp_path,
                stdout=open(tmp_path / "superlink.log", "w"),
                stderr=subprocess.STDOUT,
            )
        )
        _wait_port(control)
        for p in range(2):
            procs.append(
                subprocess.Popen(
                    [
                        shutil.which("flower-supernode", path=bindir),
                        "--insecure",
                        "--superlink",
                        f"127.0.0.1:{fleet}",
                        "--port",
                        str(_free_port()),
                        "--node-config",
                        f"partition-id={p} num-partitions=2",
                    ],
                    env=env,
                    cwd=tmp_path,
                    stdout=open(tmp_path / f"supernode{p}.log", "w"),
                    stderr=subprocess.STDOUT,
                )
            )
        flwr = shutil.which("flwr", path=bindir)
        run = subprocess.run(
            [
                flwr,
                "run",
                ".",
                "deploy",
                "--stream",
                "--run-config",
                f"{run_config} output-dir='{out}'",
            ],
            cwd=app,
            env=env,
            capture_output=True,
            text=True,
            timeout=420,
        )
        ls = subprocess.run(
            [flwr, "ls", "deploy", "--format", "json"],
            cwd=app,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        logs = "".join(
            (tmp_path / f).read_text()[-1500:]
            for f in ("superlink.log", "supernode0.log", "supernode1.log")
        )
        try:
            status = [r["status"] for r in json.loads(ls.stdout)["runs"]]
        except (ValueError, KeyError):
            status = [ls.stdout[-500:] + ls.stderr[-500:]]
        return {
            "rc": run.returncode,
            "log": run.stdout + run.stderr,
            "logs": logs,
            "status": status,
            "out": out,
            "unchanged": example_state() == before,
        }
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        assert _stop(str(home)) == [], "processes left behind"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_example_runs_on_the_deployment_engine(tmp_path):
    """``flwr run`` against a SuperLink with two SuperNodes, in the wrapper's default secure
    mode: the ledger says so and its ε equals dp-accounting directly."""
    got = deploy(tmp_path, "num-server-rounds=2 fedudp.public.users=20")
    ledger_file = got["out"] / "ledger.json"
    assert got["rc"] == 0 and ledger_file.is_file(), got["log"][-3000:] + got["logs"]
    assert got["status"] == ["finished:completed"], (got["status"], got["log"][-3000:])
    assert got["unchanged"], "flwr run changed the example's files"
    assert "Migrat" not in got["log"], got["log"][-3000:]
    assert_history(got["out"], 2)
    ledger = json.loads(ledger_file.read_text())
    assert len(ledger["entries"]) == 2 and ledger["extra"]["public"]["users"] == 20
    assert ledger["randomness"] == "secure"
    assert_direct_epsilon(ledger)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_client_failing_on_the_deployment_engine_fails_the_run(tmp_path):
    """``fedudp.users-per-client=15`` (2 clients x 15 = 30 users > N = 20): every client's mod
    refuses every round. Nothing is released, no ε is spent (an empty ledger), each client's
    reason is in the ServerApp's log, and the run ends failed, not completed."""
    got = deploy(tmp_path, "num-server-rounds=2 fedudp.public.users=20 fedudp.users-per-client=15")
    log = got["log"]
    # flwr run's own exit status says nothing about the run: flwr ls does
    assert got["rc"] == 0, log[-3000:]
    assert got["status"] == ["finished:failed"], (got["status"], log[-3000:] + got["logs"])
    assert got["unchanged"]
    ledger = json.loads((got["out"] / "ledger.json").read_text())
    assert ledger["entries"] == [] and ledger["epsilon"] == 0.0
    # (Flower's stream may print a log line twice: with and without its colour prefix)
    for r in (1, 2):
        assert f"UserLevelDP round {r}: withheld, nothing released, no epsilon spent" in log
    reasons = {
        ln[ln.index("UserLevelDP round") :]
        for ln in log.splitlines()
        if "UserLevelDP round" in ln and "failed:" in ln
    }
    assert len(reasons) == 4, log[-3000:]  # 2 clients x 2 rounds, each with its reason
    assert all("15 users per client" in ln for ln in reasons)
    assert "every training round was withheld" in log
