"""A two-node Ray cluster on 127.0.0.1 for the benchmarks: a head and one worker node, each
``ray start --block`` in a session of its own, stopped by that session (never ``ray stop``,
which stops every Ray on the machine).

The head runs in Ray's single-machine mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: it listens
on 127.0.0.1); the worker node needs Ray's multi-node mode (``ray start --address`` refuses
otherwise) without its rewrite of 127.0.0.1 into the host's network address, hence the small
wrapper ``WORKER_RAY`` (docs/engines.md, "Multi-node").
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["LoopbackCluster", "loopback_env", "session_pids"]

WORKER_RAY = (
    "import sys, ray._private.services as s\n"
    "s.resolve_ip_for_localhost = lambda host: host\n"
    "from ray.scripts.scripts import main\n"
    "sys.argv[0] = 'ray'\n"
    "main()\n"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback_env(tmp: str) -> dict[str, str]:
    """This process's environment for Ray and Flower on loopback, telemetry off.

    Parameters
    ----------
    tmp : str
        A folder for Flower's home (``FLWR_HOME``).

    Returns
    -------
    dict[str, str]
    """
    env = dict(os.environ)
    env.update(
        FLWR_TELEMETRY_ENABLED="0",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0",
        FLWR_HOME=os.path.join(tmp, "flwr"),
    )
    env.pop("RAY_ADDRESS", None)
    return env


def session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` (field 6 of ``/proc/<pid>/stat``).

    Parameters
    ----------
    sid : int

    Returns
    -------
    list[int]
    """
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:
                out.append(int(d.name))
    return out


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the session of ``proc``, then SIGKILL what is left of it after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    t_end = time.time() + 30
    while time.time() < t_end and session_pids(proc.pid):
        time.sleep(0.5)
    for pid in session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


class LoopbackCluster:
    """A head and a worker node on 127.0.0.1, one CPU each (a context manager).

    Attributes
    ----------
    address : str
        The head's GCS address, for ``engine_opts.address``.
    env : dict[str, str]
        The environment a driver on this cluster runs with.
    sessions : dict[str, int]
        ``{"head": sid, "worker": sid}``: every process of a node is in its session.
    """

    def __init__(self, cpus_per_node: int = 1, log_dir: str | Path | None = None) -> None:
        self.cpus = int(cpus_per_node)
        self.tmp = tempfile.mkdtemp(prefix="rb", dir="/tmp")  # short: Ray's socket paths
        self.logs = Path(log_dir or self.tmp)
        self.env = loopback_env(self.tmp)
        self.address = ""
        self.sessions: dict[str, int] = {}
        self._procs: list[subprocess.Popen] = []

    def _start(self, name: str, args: list[str], worker: bool) -> None:
        log = self.logs / f"ray-{name}.log"
        env = dict(self.env)
        if worker:
            env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
            ray = [sys.executable, "-c", WORKER_RAY]
        else:
            ray = [str(Path(sys.executable).parent / "ray")]
        with open(log, "w") as f:
            proc = subprocess.Popen(
                [*ray, "start", "--block", *args, "--disable-usage-stats"],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._procs.append(proc)
        self.sessions[name] = proc.pid
        t_end = time.time() + 180
        while "Ray runtime started" not in log.read_text():
            if proc.poll() is not None or time.time() > t_end:
                raise RuntimeError(f"ray start ({name}) failed: {log.read_text()[-1500:]}")
            time.sleep(0.5)

    def __enter__(self) -> LoopbackCluster:
        port = _free_port()
        try:
            self._start(
                "head",
                [
                    "--head",
                    "--node-ip-address=127.0.0.1",
                    f"--port={port}",
                    f"--num-cpus={self.cpus}",
                    "--include-dashboard=false",
                    f"--temp-dir={self.tmp}",
                ],
                worker=False,
            )
            self.address = f"127.0.0.1:{port}"
            self._start(
                "worker",
                [
                    f"--address={self.address}",
                    "--node-ip-address=127.0.0.1",
                    f"--num-cpus={self.cpus}",
                ],
                worker=True,
            )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self._procs):
            _stop(p)
        self._procs.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)
