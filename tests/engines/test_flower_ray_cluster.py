"""engine=flower against an existing Ray cluster, started here on loopback.

``ray start --head --block`` runs in a subprocess in its own session (so that exactly the
processes it started can be stopped; ``ray stop`` would stop every Ray on the machine);
the simulation runs in a *fresh* process through ``engine_opts.address`` (Flower's Ray
backend skips ``ray.init`` when Ray is already initialized, so running it in this process
could silently ignore ``address``). The run must report that cluster's GCS address, and the
owners' worker processes must be that cluster's (their logs are under its ``--temp-dir``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env(tmp: str) -> dict:
    env = dict(os.environ)
    env.update(
        FLWR_TELEMETRY_ENABLED="0",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # Ray's single-machine mode: 127.0.0.1
        RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0",
        FLWR_HOME=os.path.join(tmp, "flwr"),
    )
    env.pop("RAY_ADDRESS", None)
    return env


def session_pids(sid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # field 6 of /proc/pid/stat: session id
                out.append(int(d.name))
    return out


def stop_session(proc: subprocess.Popen) -> None:
    """Stop the ``ray start --block`` we started and every process of its session."""
    sid = proc.pid
    try:
        os.killpg(sid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    t_end = time.time() + 30
    while time.time() < t_end and session_pids(sid):
        time.sleep(0.5)
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_flower_engine_runs_on_existing_loopback_ray_cluster(tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's socket paths
    port = free_port()
    env = loopback_env(ray_tmp)
    log = open(tmp_path / "ray_start.log", "w")
    head = subprocess.Popen(
        [
            str(VENV_BIN / "ray"),
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
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        t_end = time.time() + 120
        while "Ray runtime started" not in (tmp_path / "ray_start.log").read_text():
            assert head.poll() is None, (tmp_path / "ray_start.log").read_text()
            assert time.time() < t_end, "ray start timed out"
            time.sleep(0.5)
        address = f"127.0.0.1:{port}"
        out = tmp_path / "run"
        cmd = [
            str(VENV_BIN / "fedudp"),
            "engine=flower",
            "method=joint_dp",
            f"engine_opts.address={address}",
            "engine_opts.num_cpus=1",
            "partition.num_owners=3",
            "dataset.num_records=90",
            "dataset.pool_train=500",
            "dataset.pool_test=90",
            "dataset.features=10",
            "train.rounds=2",
            "progress=false",
            f"hydra.run.dir={out}",
        ]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["engine"] == "flower" and summary["rounds_completed"] == 2
        assert summary["ray_address"] == address
        pids = summary["flower_worker_pids"]
        assert pids and os.getpid() not in pids
        # the owners ran in worker processes of that cluster (same session, logs in its dir)
        assert set(pids) <= set(session_pids(head.pid)), (pids, session_pids(head.pid))
        logs = " ".join(p.name for p in Path(ray_tmp).rglob("worker-*"))
        for pid in pids:
            assert f"-{pid}." in logs, (pid, logs[:500])
    finally:
        stop_session(head)
        log.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not session_pids(head.pid)
