"""Benchmark: owners in blocks per Flower SuperNode (``engine_opts.owners_per_node``) against
the local engine, on one machine: a local Ray on loopback (one node, started by each run) or
a two-node Ray cluster on loopback (a head and a worker node, one CPU each, started by this
script and stopped by their sessions; ``_loopback_cluster.py``).

Workload: joint_dp on synthetic records (``--features``, default 20; 10 users per owner of
``--rpu`` records each, default 1), or on an uncompressed ``.npz`` written by this script
(``--grid memory``: the block's features are read by row from it), Poisson sampling
q = 0.5, a given noise multiplier (no calibration), ``R`` rounds, evaluation after the last
round only, no checkpoints unless ``--checkpoint-every``. Each run is a fresh process (its own
session); reported: the median seconds of rounds 2..R (the transport's ``train``, what the
billboard waits for), the connect time (``FlowerTransport._connect``: nodes up and the first
query answered) with its time points (``_cluster_child.py``), the wall time of the run, the
peak RSS (and peak anonymous RSS) of each Flower client actor (sampled every 0.2 s, labelled
by the node it ran on; also its last sample as an actor) and of the driver.

    .venv/bin/python scripts/benchmarks/bench_cluster.py --owners 1000 10000 --rounds 3 \\
        --cpus 2 --out docs/results/cluster
    .venv/bin/python scripts/benchmarks/bench_cluster.py --grid scale --reps 3 \\
        --out docs/results/cluster   # also memory, overhead, poll, heavy, trace

A grid appends each run to ``<out>/results.json`` as it finishes and skips the runs already
there (resumable); the plain form writes ``results.json`` and ``TABLE.md`` at its end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

T_START = time.time()  # a child run's time points are relative to this

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on 127.0.0.1 only
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from _cluster_grids import GRIDS, npz_file  # noqa: E402
from _cluster_report import plot, report, table  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BOOT = next(
    int(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines() if ln[:5] == "btime"
)
TICK = os.sysconf("SC_CLK_TCK")
TRACE = Path(__file__).resolve().parent / "_trace"  # sitecustomize: blocks served, by pid
TRACE_LOG = Path(f"/tmp/fedudp-bench-blocks-{os.getpid()}.log")
KEY_FIELDS = ("grid", "owners", "engine", "per", "nodes", "features", "rpu", "npz", "variant")


def _status_kib(pid: str) -> tuple[int, int]:
    rss = anon = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
        elif line.startswith("RssAnon:"):
            anon = int(line.split()[1])
    return rss, anon


class Sampler:
    """Peak RSS of every process of some sessions, every 0.2 s (a thread)."""

    def __init__(self, sessions: dict[int, str]) -> None:
        self.sessions = sessions  # sid -> node label
        self.peak: dict[int, dict] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _one(self, d: Path) -> None:
        stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
        node = self.sessions.get(int(stat[3]))
        if node is None:
            return
        rss, anon = _status_kib(d.name)
        cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
        p = self.peak.setdefault(
            int(d.name),
            {
                "rss": 0,
                "anon": 0,
                "node": node,
                "start": BOOT + int(stat[19]) / TICK,
                "pid": int(d.name),
            },
        )
        p["rss"], p["anon"], p["cmd"] = max(p["rss"], rss), max(p["anon"], anon), cmd
        if "ClientApp" in cmd:
            p.setdefault("t_actor", time.time())  # first seen as an actor
            p["last"], p["last_anon"] = rss, anon  # its last sample as an actor

    def _loop(self) -> None:
        while not self.done.is_set():
            for d in Path("/proc").iterdir():
                if d.name.isdigit():
                    try:
                        self._one(d)
                    except (OSError, ValueError, IndexError):
                        continue
            time.sleep(0.2)

    def stop(self) -> dict[int, dict]:
        self.done.set()
        self.thread.join()
        return self.peak


def _run_child(spec: dict, timeout: float, env: dict, sessions: dict[int, str]):
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
    sampler = Sampler({**sessions, proc.pid: "own"})
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)
        out, _ = proc.communicate()
        out += "\nTIMEOUT"
    peak = sampler.stop()
    return proc.pid, time.time() - t0, out, peak


def measure(spec: dict, timeout: float, env: dict | None = None, sessions=None) -> dict:
    """Run ``spec`` in a fresh session; timings, and peak RSS per process by its command line.

    Parameters
    ----------
    spec : dict
        The run (``_cluster_child.make_cfg``).
    timeout : float
        Seconds before the run is stopped.
    env : dict or None
        The driver's environment (None: this process's).
    sessions : dict[int, str] or None
        Other sessions whose processes to sample (a cluster's nodes), by session id: label.

    Returns
    -------
    dict
        One row of ``results.json``.
    """
    env = traced(env or dict(os.environ)) if spec.get("trace") else (env or dict(os.environ))
    pid, wall, out, peak = _run_child(spec, timeout, env, sessions or {})
    got = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(got[-1][7:]) if got else {"error": out[-600:]}
    actors = sorted(
        (p for p in peak.values() if "t_actor" in p),  # seen as a ClientApp actor once
        key=lambda p: -p["rss"],
    )
    rounds = res.get("rounds", [])
    row = {
        **{k: v for k, v in spec.items() if k != "address"},
        "wall_s": round(wall, 1),
        "s_per_round": round(statistics.median(rounds[1:] or rounds), 3) if rounds else None,
        "round_s": [round(r, 3) for r in rounds],
        "connect_s": None if res.get("connect_s") is None else round(res["connect_s"], 2),
        "actor_peak_rss_mib": [round(p["rss"] / 1024) for p in actors],
        "actor_peak_anon_mib": [round(p["anon"] / 1024) for p in actors],
        "actor_node": [p["node"] for p in actors],
        "actor_last_rss_mib": [round(p["last"] / 1024) for p in actors],
        "actor_last_anon_mib": [round(p["last_anon"] / 1024) for p in actors],
        "driver_peak_rss_mib": round(peak.get(pid, {"rss": 0})["rss"] / 1024),
        "driver_peak_anon_mib": round(peak.get(pid, {"anon": 0})["anon"] / 1024),
        "load1": round(os.getloadavg()[0], 2),
        **{k: res[k] for k in ("stop_reason", "flower_nodes", "error") if k in res},
    }
    if res.get("exchanges"):
        row["exchange_s"] = [round(x, 3) for x in res["exchanges"]]
    if "points" in res and actors:
        row["connect_points"] = _connect_points(res["points"], actors)
    if spec.get("trace"):
        row["actor_blocks"] = _blocks_served([p["pid"] for p in actors])
    return row


def traced(env: dict) -> dict:
    """``env`` with ``_trace/sitecustomize.py`` on the path, logging to ``TRACE_LOG``."""
    path = f"{TRACE}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(TRACE)
    return {**env, "PYTHONPATH": path, "FEDUDP_BENCH_BLOCK_LOG": str(TRACE_LOG)}


def _blocks_served(pids: list[int]) -> list[list[list[int]]]:
    """Per actor (as ``pids``): ``[block start, 1 if read then]`` for each block it served."""
    lines = TRACE_LOG.read_text().split("\n") if TRACE_LOG.is_file() else []
    got: dict[int, list[list[int]]] = {p: [] for p in pids}
    for ln in lines:
        if ln.strip():
            pid, start, _stop, new = map(int, ln.split())
            if pid in got:
                got[pid].append([start, new])
    return [got[p] for p in pids]


def _connect_points(pt: dict, actors: list[dict]) -> dict:
    """Seconds after the driver started: run called, actor processes started and first seen
    as actors, ``_connect`` started, nodes listed, first query answered."""
    t0 = pt["t_child0"]

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 2)

    return {
        "run_called": rel(pt.get("t_run0")),
        "actor_process_started": [rel(a["start"]) for a in actors],
        "actor_first_seen": [rel(a.get("t_actor")) for a in actors],
        "connect_start": rel(pt.get("t__connect0")),
        "nodes_listed": rel(pt.get("t_nodes")),
        "connect_end": rel(pt.get("t__connect1")),
        "run_end": rel(pt.get("t_end")),
    }


def _key(row: dict) -> tuple:
    return (*(row.get(k) for k in KEY_FIELDS), row.get("rep"))


def run_grid(name: str, reps: int, out: Path, timeout: float, rounds: int) -> None:
    """Run grid ``name`` (``_cluster_grids.GRIDS``), ``reps`` interleaved repetitions,
    appending each row to ``out/results.json`` as it finishes, skipping rows already there."""
    from _loopback_cluster import LoopbackCluster

    path = out / "results.json"
    rows = json.loads(path.read_text()) if path.is_file() else []
    done = {
        _key(r)
        for r in rows
        if "error" not in r and (r["engine"] == "local" or r["actor_peak_rss_mib"])
    }
    todo = [
        {**s, "grid": name, "rounds": rounds, "cpus": 2, "ckpt": 0, "rep": rep}
        for rep in range(reps)
        for s in GRIDS[name]()
    ]
    for s in todo:  # the file's path is part of the key
        if s.get("npz") is True:
            s["npz"] = str(npz_file(s["owners"], s["features"], s["rpu"], write=False))
    todo = [s for s in todo if _key(s) not in done]
    for s in todo:
        if s.get("npz"):
            npz_file(s["owners"], s["features"], s["rpu"])
    print(f"{len(todo)} runs to do", flush=True)
    cluster = None
    try:
        for s in todo:
            env, sessions = None, {}
            if s.get("nodes") == 2:
                if cluster is None:
                    cluster = LoopbackCluster(1)
                    if any(t.get("trace") for t in todo):  # the nodes' workers inherit it
                        cluster.env = traced(cluster.env)
                    cluster.__enter__()
                env = {**cluster.env}
                sessions = {v: k for k, v in cluster.sessions.items()}
                s = {**s, "address": cluster.address}
            row = measure(s, timeout, env, sessions)
            row["utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            rows.append(row)
            path.write_text(json.dumps(rows, separators=(",", ":")).replace("},{", "},\n{") + "\n")
            print(json.dumps(row), flush=True)
    finally:
        if cluster is not None:
            cluster.__exit__()


def _plain(a: argparse.Namespace) -> None:
    t0, rows = time.time(), []
    for n in a.owners:
        base = {"owners": n, "rounds": a.rounds, "cpus": a.cpus, "ckpt": a.checkpoint_every}
        base.update(features=a.features, rpu=a.rpu, nodes=1)
        rows.append(measure({**base, "engine": "local", "per": 1}, a.timeout))
        print(json.dumps(rows[-1]), flush=True)
        for per in a.per_node:
            spec = {**base, "engine": "flower", "per": per or -(-n // a.cpus)}
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--child", default=None)
    ap.add_argument("--grid", choices=sorted(GRIDS), default=None)
    ap.add_argument("--reps", type=int, default=1, help="--grid: interleaved repetitions")
    ap.add_argument("--owners", type=int, nargs="+", default=[1000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpus", type=int, default=2, help="client actors (Ray CPUs)")
    ap.add_argument("--per-node", type=int, nargs="+", default=[0], help="0: owners / cpus")
    ap.add_argument("--features", type=int, default=20)
    ap.add_argument("--rpu", type=int, default=1, help="records per user")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint.every")
    ap.add_argument("--out", default="")
    ap.add_argument("--report", action="store_true", help="print the grids' tables, plot")
    a = ap.parse_args(argv)
    if a.child:
        from _cluster_child import child

        child(json.loads(a.child), T_START)
    elif a.report:
        out = Path(a.out or "docs/results/cluster")
        print(report(out / "results.json"))
        plot(out / "results.json", out / "cluster.png")
    elif a.grid:
        run_grid(a.grid, a.reps, Path(a.out or "docs/results/cluster"), a.timeout, a.rounds)
    else:
        _plain(a)


if __name__ == "__main__":
    main()
