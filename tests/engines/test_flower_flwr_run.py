"""The documented ``flwr run . --stream`` command (docs/engines.md, once the README's), run as a
new user would.

A fresh ``FLWR_HOME`` and the environment docs/engines.md tells a user to export; the command is
read from docs/engines.md itself (only ``output-dir`` is pointed at a temporary folder). ``flwr run``
starts its own background SuperLink (on free ports here, so that a SuperLink left by anyone
else is never reused) and exits 0 even when the run fails, so the run's status is read with
``flwr ls``. Every process that inherited this ``FLWR_HOME`` is stopped at the end.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> tuple[dict[str, str], list[str]]:
    """(the variables docs/engines.md exports for `flwr run`, the `flwr run` command) from it."""
    text = (ROOT / "docs" / "engines.md").read_text()
    exports = dict(
        kv.split("=", 1)
        for line in re.findall(r"^\s*export (FLWR_.*|RAY_.*)$", text, re.M)
        for kv in line.split()
    )
    cmd = re.search(r"^\s*(flwr run \. --stream .*)$", text, re.M).group(1)
    return exports, shlex.split(cmd)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids_with_env(key: str, value: str) -> list[int]:
    """PIDs whose environment holds key=value (every process the SuperLink spawns inherits it)."""
    needle = f"{key}={value}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def _stop(home: str) -> list[int]:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        pids = _pids_with_env("FLWR_HOME", home)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = _pids_with_env("FLWR_HOME", home)  # zombies have an empty environ
        if not pids:
            return []
    return pids


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readme_flwr_run(tmp_path):
    exports, cmd = readme_commands()
    assert exports.get("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION") == "1"
    home, out = tmp_path / "flwr_home", tmp_path / "out"
    home.mkdir()
    cmd = [re.sub(r"output-dir='[^']*'", f"output-dir='{out}'", a) for a in cmd]
    bindir = str(
        Path(sys.executable).parent
    )  # the activated venv's bin: `flwr`, `flower-superlink`
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLWR_", "RAY_"))}
    env.update(exports)
    env.update(
        PATH=bindir + os.pathsep + env.get("PATH", ""),
        VIRTUAL_ENV=str(Path(bindir).parent),
        FLWR_HOME=str(home),
        FLWR_TELEMETRY_ENABLED="0",
        RAY_USAGE_STATS_ENABLED="0",
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(_free_port()),
        FLWR_LOCAL_CONTROL_API_PORT=str(_free_port()),
    )
    flwr = shutil.which("flwr", path=bindir)
    try:
        run = subprocess.run(
            [flwr, *cmd[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=480
        )
        log = run.stdout + run.stderr
        assert run.returncode == 0, log
        assert "Starting local SuperLink" in log, log  # ours, not a leftover one
        ls = subprocess.run(
            [flwr, "ls", "--format", "json"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        runs = json.loads(ls.stdout)["runs"]
        assert [r["status"] for r in runs] == ["finished:completed"], (runs, log)
        for name in ("summary.json", "metrics.jsonl", "ledger.json", "owners.csv"):
            assert (out / name).is_file(), log
        s = json.loads((out / "summary.json").read_text())
        assert s["engine"] == "flower" and s["method"] == "fedavg" and s["rounds_completed"] == 3
        assert s["flower_nodes"] == s["num_owners"] >= 2
    finally:
        assert _stop(str(home)) == [], "processes left behind"
