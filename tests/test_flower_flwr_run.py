"""``flwr run . --stream`` through ``[tool.flwr.app]`` in pyproject.toml (issue 4).

Flower's state and ports are isolated: a temporary ``FLWR_HOME`` whose ``config.toml``
names a SuperLink this test starts itself (``flower-superlink --simulation`` on a free
loopback port, its own session, runtime dependency installation and update checks off),
so nothing touches ``~/.flwr`` or Flower's default ports; the SuperLink and every process
of its session are stopped at the end. The run's outputs (``output-dir`` from
``--run-config``) must match ``engine=local`` on the same config in equivalence mode.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_flower_ray_cluster import free_port, loopback_env, session_pids, stop_session  # noqa: E402

VENV_BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent

OVERRIDES = {"method": "'joint_dp'", "train.rounds": "2", "train.batch_size": "8",
             "dataset.num_records": "90", "dataset.features": "10",
             "engine_opts.chunk_records": "1", "engine_opts.threads": "1",
             "engine_opts.float64": "true"}


def _healthy(port: int) -> bool:
    import httpx
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).is_success
    except httpx.HTTPError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_flwr_run_stream_matches_local_engine(tmp_path):
    home = tmp_path / "flwr_home"
    home.mkdir()
    port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "fedudp-test"\n\n[superlink.fedudp-test]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    env = loopback_env(str(tmp_path))
    env.update(FLWR_HOME=str(home), FLWR_DISABLE_UPDATE_CHECK="1",
               PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}")
    log = open(tmp_path / "superlink.out", "w")
    link = subprocess.Popen(
        [str(VENV_BIN / "flower-superlink"), "--insecure", "--simulation", "--isolation",
         "subprocess", "--host", "127.0.0.1", "--port", str(port),
         "--disable-runtime-dependency-installation"],
        env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    out = tmp_path / "out"
    try:
        t_end = time.time() + 120
        while not _healthy(port):
            assert link.poll() is None, (tmp_path / "superlink.out").read_text()[-3000:]
            assert time.time() < t_end, "SuperLink did not start"
            time.sleep(0.5)
        rc = " ".join(f"{k}={v}" for k, v in OVERRIDES.items()) + f" output-dir='{out}'"
        proc = subprocess.run(
            [str(VENV_BIN / "flwr"), "run", ".", "fedudp-test", "--stream",
             "--federation-config", "num-supernodes=3", "--run-config", rc],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        t_end = time.time() + 60      # the stream may end just before the files are closed
        while not (out / "summary.json").exists() and time.time() < t_end:
            time.sleep(0.5)
        summary = json.loads((out / "summary.json").read_text())
    finally:
        stop_session(link)
        log.close()
    assert not session_pids(link.pid)
    assert summary["engine"] == "flower" and summary["num_owners"] == 3
    assert summary["rounds_completed"] == 2
    flower_rounds = [json.loads(line) for line in open(out / "metrics.jsonl")]

    # the same run on engine=local, in this process
    from fedudp.engines.flower_app import cfg_from_overrides
    from fedudp.run import run
    import tomllib
    cfg_over = {k: tomllib.loads(f"v = {v}")["v"] for k, v in OVERRIDES.items()}
    cfg = cfg_from_overrides({**cfg_over, "partition.num_owners": 3, "progress": False})
    local = run(cfg, tmp_path / "local")
    local_rounds = [json.loads(line) for line in open(tmp_path / "local" / "metrics.jsonl")]
    assert [r["accuracy_mean"] for r in flower_rounds] == [r["accuracy_mean"] for r in local_rounds]
    assert summary["epsilon"] == local["epsilon"]
