"""engine=flower across a two-node loopback Ray cluster, and the loss of one node (issue 52).

The test starts the cluster itself: ``ray start --head --block`` and ``ray start --block
--address=…`` (one CPU each, custom resources ``fedudp_head`` / ``fedudp_worker`` telling them
apart), each in its own session so that exactly its processes are stopped, by PID, in a
finalizer (never ``ray stop``, which stops every Ray on the machine). Then:

1. a joint_dp run on the cluster has owners on both nodes (worker processes of both sessions)
   and the local engine's accuracy, ε and ledger;
2. a run whose worker node's raylet is SIGKILLed once round 1 is written survives: the round
   that lost the node records its owners as failed (``ray: …`` reasons in the metrics line's
   ``failures``, or ``failed_eval`` when the loss hit an evaluation),
   released from the head's owners (fail closed), the ledger's line of the round counting them
   (``owners_failed``); the run is then interrupted (SIGTERM);
3. ``resume=`` on the same cluster, its worker node dead (and, for the first seconds, still
   listed alive by Ray, its CPU counted: the actor meant for it is never placed and must take no
   message), finishes the run on the head's actors: the rounds kept from the checkpoint are the
   interrupted run's lines, those after it have no failures, the ε is the uninterrupted local
   run's, and the result equals the same checkpoint resumed by the local engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from test_flower_ray_cluster import (
    ROOT,
    VENV_BIN,
    free_port,
    loopback_env,
    session_pids,
    stop_session,
)

COMMON = [
    "method=joint_dp",
    "partition.num_owners=4",
    "dataset.num_records=80",
    "dataset.pool_train=400",
    "dataset.pool_test=80",
    "dataset.features=8",
    "progress=false",
    "engine_opts.threads=1",
]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# A worker node on loopback: Ray's multi-node mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER unset, or
# ``ray start --address`` refuses), without its rewrite of 127.0.0.1 into the host's network
# address (the head, in single-machine mode, listens on 127.0.0.1 only); docs/engines.md
WORKER_RAY = (
    "import sys, ray._private.services as s\n"
    "s.resolve_ip_for_localhost = lambda host: host\n"
    "from ray.scripts.scripts import main\n"
    "sys.argv[0] = 'ray'\n"
    "main()\n"
)


def start_node(args: list[str], log: Path, env: dict, worker: bool = False) -> subprocess.Popen:
    f = open(log, "w")
    ray = [sys.executable, "-c", WORKER_RAY] if worker else [str(VENV_BIN / "ray")]
    if worker:
        env = {k: v for k, v in env.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    proc = subprocess.Popen(
        [*ray, "start", "--block", *args, "--disable-usage-stats"],
        env=env,
        stdout=f,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    f.close()
    t_end = time.time() + 120
    while "Ray runtime started" not in log.read_text():
        assert proc.poll() is None, log.read_text()[-2000:]
        assert time.time() < t_end, "ray start timed out"
        time.sleep(0.5)
    return proc


@pytest.fixture
def two_nodes(tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="r2", dir="/tmp")  # short: Ray's socket paths
    env = loopback_env(ray_tmp)
    port = free_port()
    procs: list[subprocess.Popen] = []
    try:
        procs.append(
            start_node(
                [
                    "--head",
                    "--node-ip-address=127.0.0.1",
                    f"--port={port}",
                    "--num-cpus=1",
                    '--resources={"fedudp_head": 1}',
                    "--include-dashboard=false",
                    f"--temp-dir={ray_tmp}",
                ],
                tmp_path / "head.log",
                env,
            )
        )
        procs.append(
            start_node(
                [
                    f"--address=127.0.0.1:{port}",
                    "--node-ip-address=127.0.0.1",
                    "--num-cpus=1",
                    '--resources={"fedudp_worker": 1}',
                ],
                tmp_path / "worker.log",
                env,
                worker=True,
            )
        )
        yield f"127.0.0.1:{port}", env, procs[0], procs[1]
    finally:
        for p in reversed(procs):
            stop_session(p)
        import shutil

        shutil.rmtree(ray_tmp, ignore_errors=True)
    for p in procs:
        assert not session_pids(p.pid)


def fedudp(args: list[str], env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [str(VENV_BIN / "fedudp"), *COMMON, *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


def comparable(folder: Path) -> tuple:
    s = json.loads((folder / "summary.json").read_text())
    ledger = json.loads((folder / "ledger.json").read_text())
    for e in ledger.get("entries", []):  # the released bytes' hash: the sums' float order
        e.pop("release_sha256", None)  # differs across engines outside equivalence mode
    events = json.dumps(ledger, sort_keys=True, default=str)
    return s["accuracy_mean"], s["epsilon"], s["rounds_completed"], events


def failed(r: dict) -> list[dict]:
    """A metrics line's failed owners, in training and in evaluation."""
    return [*r.get("failures", []), *r.get("failed_eval", [])]


def rounds_of(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_equal_local_and_a_lost_node_is_an_owner_failure(tmp_path, two_nodes):
    address, env, head, worker = two_nodes
    flower = ["engine=flower", f"engine_opts.address={address}", "engine_opts.timeout_s=60"]

    # 1. across both nodes: the local engine's numbers
    local, across = tmp_path / "local", tmp_path / "across"
    out = finish(fedudp(["train.rounds=2", f"hydra.run.dir={local}"], env))
    assert (local / "summary.json").is_file(), out[-3000:]
    p = fedudp([*flower, "train.rounds=2", f"hydra.run.dir={across}"], env)
    on_head, on_worker = set(), set()  # each node's processes while the run runs (its actors

    def sample() -> None:  # exit with the driver)
        while p.poll() is None:
            on_head.update(session_pids(head.pid))
            on_worker.update(session_pids(worker.pid))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample)
    sampler.start()
    out = finish(p)
    sampler.join()
    assert p.returncode == 0, out[-3000:]
    assert comparable(across) == comparable(local)
    pids = set(json.loads((across / "summary.json").read_text())["flower_worker_pids"])
    assert pids & on_head and pids & on_worker, (pids, on_head, on_worker)

    # 2. the worker node lost once round 1 is written: its owners fail, the run goes on; it is
    # interrupted (SIGTERM) as soon as the round that lost the node is checkpointed
    lossy, rounds_n = tmp_path / "lossy", 16
    args = [*flower, f"train.rounds={rounds_n}", "checkpoint.every=1"]
    p = fedudp([*args, f"hydra.run.dir={lossy}"], env)
    raylet = [q for q in session_pids(worker.pid) if "raylet" in _cmdline(q)]
    assert raylet
    seen: dict = {}

    def watcher() -> None:
        t_end = time.time() + 300
        while time.time() < t_end and p.poll() is None:
            rounds = rounds_of(lossy)
            if rounds and "killed" not in seen:
                for q in raylet:
                    os.kill(q, signal.SIGKILL)
                seen["killed"] = len(rounds)
            hit = [r["round"] for r in rounds if failed(r)]
            if hit and "term" not in seen and (lossy / f"ckpt-{hit[0]:06d}.pt").is_file():
                seen["term"] = len(rounds)  # once the round that lost the node is checkpointed
                p.send_signal(signal.SIGTERM)
            time.sleep(0.02)

    th = threading.Thread(target=watcher)
    th.start()
    out = finish(p)
    th.join()
    rounds = rounds_of(lossy)
    assert "killed" in seen and "term" in seen, (seen, out[-3000:])
    lost = [r for r in rounds if failed(r)]  # the loss hits a train or an evaluate message
    assert lost and all("ray:" in f["reason"] for r in lost for f in failed(r)), lost
    assert all(r["failed_owners"] < 4 for r in lost)  # the head's owners answered: released
    ledger = {  # the ledger's round line counts the failed owners of a round it released
        e["round"]: e
        for e in map(json.loads, (lossy / "ledger.jsonl").read_text().splitlines()[1:])
    }
    assert all(ledger[r["round"]]["owners_failed"] == r["failed_owners"] for r in rounds)
    assert "a fedudp bug" not in out
    assert p.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert json.loads((lossy / "summary.json").read_text())["stop_reason"] == "interrupted"

    # 3. resumed on the same cluster, the worker node dead: the run finishes on the head
    import shutil

    twin = tmp_path / "lossy_local"
    shutil.copytree(lossy, twin)
    before = rounds_of(lossy)
    ckpt = max(int(f.name[5:-3]) for f in lossy.glob("ckpt-*.pt"))  # resumed from
    p = fedudp([*args, f"resume={lossy}"], env)
    out = finish(p, timeout=300)
    assert p.returncode == 0, out[-3000:]
    s = json.loads((lossy / "summary.json").read_text())
    # a release made after the checkpoint (SIGTERM came between the two) is composed into ε and
    # its round computed again: the run then ends on the budget that many rounds early
    again = s["releases_superseded"]
    assert s["releases_made"] == rounds_n and s["rounds_completed"] == rounds_n - again, s
    assert s["stop_reason"] == ("budget" if again else "completed"), s
    assert len(s["flower_worker_pids"]) == 1 and not set(s["flower_worker_pids"]) & on_worker
    after = rounds_of(lossy)
    assert [r["round"] for r in after] == list(range(1, rounds_n - again + 1))
    assert after[:ckpt] == before[:ckpt]  # the checkpoint's rounds, the lost node's included
    assert any(failed(r) for r in after[:ckpt])
    assert not any(failed(r) for r in after[ckpt:]), after[ckpt:]
    full = tmp_path / "full_local"
    out = finish(fedudp([f"train.rounds={rounds_n}", f"hydra.run.dir={full}"], env))
    assert (full / "summary.json").is_file(), out[-3000:]
    assert s["epsilon"] == json.loads((full / "summary.json").read_text())["epsilon"]
    # the same checkpoint resumed by the local engine: the same finished run
    out = finish(fedudp([f"train.rounds={rounds_n}", "checkpoint.every=1", f"resume={twin}"], env))
    assert (twin / "summary.json").is_file(), out[-3000:]
    assert comparable(twin) == comparable(lossy), out[-3000:]
