"""Benchmark: owners in blocks per Flower SuperNode (``engine_opts.owners_per_node``) against
the local engine, on one machine (a local Ray on loopback).

Workload: joint_dp on synthetic records (20 features, 10 one-record users per owner, Poisson
sampling q = 0.5, a given noise multiplier: no calibration), ``n`` owners, ``R`` rounds,
evaluation after the last round only, no checkpoints unless ``--checkpoint-every`` (on the
Flower engine each owner writes and fsyncs its own state file). Each configuration runs in a fresh process (its own
session); reported: the median seconds of the rounds 2..R (a round: the transport's train
call, what the billboard waits for), the connect time (``FlowerTransport._connect``: nodes up
and the first query answered), the wall time of the whole run, and the peak RSS of each Ray
worker process of the run (the client actors; sampled every 0.2 s) and of the driver.

    .venv/bin/python scripts/benchmarks/bench_cluster.py --owners 1000 10000 --rounds 3 \\
        --cpus 2 --out docs/results/cluster

Writes ``<out>/results.json`` (one row per run) and ``<out>/README.md`` (the table, the
command and its wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on 127.0.0.1 only
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

ROOT = Path(__file__).resolve().parents[2]


def make_cfg(n: int, rounds: int, engine: str, per_node: int, cpus: int, checkpoint_every: int = 0):
    """The workload above on ``engine`` (``per_node`` owners per SuperNode)."""
    from fedudp.config import RunConfig

    cfg = RunConfig()
    cfg.progress = False
    cfg.method = "joint_dp"
    cfg.engine = engine
    cfg.dataset.num_records = 10 * n
    cfg.dataset.pool_train = 10 * n
    cfg.dataset.pool_test = max(2 * n, 1000)
    cfg.dataset.features = 20
    cfg.partition.num_owners = n
    cfg.partition.scheme = "iid"
    cfg.partition.records_per_user = 1
    cfg.train.rounds = rounds
    cfg.train.sampling_rate = 0.5
    cfg.train.eval_every = 10**6  # after the last round only
    cfg.privacy.noise_multiplier = 3.0
    cfg.privacy.epsilon = 1e6
    cfg.engine_opts.threads = 1
    cfg.engine_opts.num_cpus = 1.0
    cfg.engine_opts.owners_per_node = per_node
    cfg.checkpoint.every = checkpoint_every  # 0: none (each Flower owner writes its own file)
    return cfg


def child(spec: dict) -> None:
    """One run in this process; prints one JSON line of timings."""
    import torch

    torch.set_num_threads(1)
    import fedudp.engines.local as local
    from fedudp.run import run

    times: list[float] = []
    connect: list[float] = []

    def timed(cls, name, sink):
        orig = getattr(cls, name)

        def wrapper(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return orig(self, *a, **k)
            finally:
                sink.append(time.perf_counter() - t0)

        setattr(cls, name, wrapper)

    timed(local.LocalTransport, "train", times)
    if spec["engine"] == "flower":
        import fedudp.flower.server_app as server

        timed(server.FlowerTransport, "train", times)
        timed(server.FlowerTransport, "_connect", connect)
    cfg = make_cfg(
        spec["owners"], spec["rounds"], spec["engine"], spec["per"], spec["cpus"], spec["ckpt"]
    )
    with tempfile.TemporaryDirectory() as d:
        s = run(cfg, Path(d))
    print(
        "RESULT "
        + json.dumps(
            {
                "rounds": times,
                "connect_s": connect[0] if connect else None,
                "stop_reason": s["stop_reason"],
                "accuracy_mean": s.get("accuracy_mean"),
                "flower_nodes": s.get("flower_nodes"),
            }
        )
    )


def _rss_kib(pid: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def measure(spec: dict, timeout: float) -> dict:
    """Run ``spec`` in a fresh session; peak RSS per process, by its command line."""
    env = dict(os.environ)
    t0 = time.time()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
        cwd=ROOT,
    )
    peak: dict[int, tuple[int, str]] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for d in Path("/proc").iterdir():
                if not d.name.isdigit():
                    continue
                try:
                    stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
                    if int(stat[3]) != proc.pid:
                        continue
                    rss = _rss_kib(d.name)
                    cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
                    if rss > peak.get(int(d.name), (0, ""))[0]:
                        peak[int(d.name)] = (rss, cmd)
                except (OSError, ValueError, IndexError):
                    continue
            time.sleep(0.2)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)
        out, _ = proc.communicate()
        out += "\nTIMEOUT"
    done.set()
    th.join()
    wall = time.time() - t0
    got = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(got[-1][7:]) if got else {"error": out[-600:]}
    actors = sorted(
        (r for r, c in peak.values() if "ray::" in c and "ClientApp" in c), reverse=True
    ) or sorted((r for r, c in peak.values() if "default_worker" in c), reverse=True)
    driver = peak.get(proc.pid, (0, ""))[0]
    rounds = res.get("rounds", [])
    return {
        **spec,
        "wall_s": round(wall, 1),
        "s_per_round": round(statistics.median(rounds[1:] or rounds), 3) if rounds else None,
        "connect_s": None if res.get("connect_s") is None else round(res["connect_s"], 2),
        "actor_peak_rss_mib": [round(r / 1024) for r in actors],
        "driver_peak_rss_mib": round(driver / 1024),
        **{k: res[k] for k in ("stop_reason", "flower_nodes", "error") if k in res},
    }


def table(rows: list[dict]) -> str:
    head = (
        "| owners | engine | owners/node | nodes | s/round | connect s | actor peak RSS MiB "
        "| driver peak RSS MiB | wall s |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    body = ""
    for r in rows:
        body += (
            f"| {r['owners']} | {r['engine']} | {r['per'] if r['engine'] == 'flower' else '-'} "
            f"| {r.get('flower_nodes') or '-'} | {r['s_per_round']} | {r['connect_s'] or '-'} "
            f"| {', '.join(map(str, r['actor_peak_rss_mib'])) or '-'} "
            f"| {r['driver_peak_rss_mib']} | {r['wall_s']} |\n"
        )
    return head + body


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", default=None)
    ap.add_argument("--owners", type=int, nargs="+", default=[1000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpus", type=int, default=2, help="client actors (Ray CPUs)")
    ap.add_argument("--per-node", type=int, nargs="+", default=[0], help="0: owners / cpus")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint.every")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.child:
        child(json.loads(a.child))
        return
    t0 = time.time()
    rows = []
    for n in a.owners:
        rows.append(
            measure(
                {
                    "owners": n,
                    "engine": "local",
                    "per": 1,
                    "rounds": a.rounds,
                    "cpus": a.cpus,
                    "ckpt": a.checkpoint_every,
                },
                a.timeout,
            )
        )
        print(json.dumps(rows[-1]), flush=True)
        for per in a.per_node:
            b = per or -(-n // a.cpus)
            spec = {
                "owners": n,
                "engine": "flower",
                "per": b,
                "rounds": a.rounds,
                "cpus": a.cpus,
                "ckpt": a.checkpoint_every,
            }
            rows.append(measure(spec, a.timeout))
            print(json.dumps(rows[-1]), flush=True)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
        cmd = "scripts/benchmarks/bench_cluster.py " + " ".join(sys.argv[1:])
        (out / "TABLE.md").write_text(
            f"Command: `.venv/bin/python {cmd}` (wall {time.time() - t0:.0f} s)\n\n" + table(rows)
        )
        print(table(rows))


if __name__ == "__main__":
    main()
