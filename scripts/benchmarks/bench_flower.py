"""Benchmark: fedudp's ``engine=flower`` (and ``engine=local``) vs a plain Flower FedAvg app.

The documented workload (the one ``scripts/benchmarks/bench_local.py`` uses): the paper CNN
(``model.name=cnn``) on 10,000 MNIST training records split over ``n`` owners, one user per
owner, FedAvg, every owner every round, one local epoch of minibatch SGD at batch 32 and
lr 0.05. All sides use the same model (``fedudp.build.model``), data and owners
(``fedudp.build.federation``):

* ``plain``: Flower's own ``FedAvg`` strategy (``fraction_train=fraction_evaluate=1``) on
  Flower's simulation (``run_simulation``, Ray backend, one ClientApp per owner); the ClientApp
  trains the full model with a plain PyTorch SGD loop (same lr, batch size and epochs) on its
  shard and returns it; every owner evaluates every round;
* ``fedudp:<method>:<aggregator>``: ``fedudp.run.run`` with ``engine=flower`` on the same
  simulation (the billboard ServerApp; owners reply with per-user shared vectors or, for
  ``aggregator=gaussian``, the sum of clipped vectors and a count), every owner evaluated every
  round;
* ``local:<method>:<aggregator>``: the same fedudp run with ``engine=local`` (one process) at
  one torch thread; ``local@T:<method>:<aggregator>`` at ``T`` threads.

Cores: every process runs one torch thread, and Flower's simulation (both Flower sides) starts
one Ray actor per ``client_resources.num_cpus = 1`` of the machine's CPUs, so on a 2-core
machine it trains two owners at a time on both cores. ``local`` uses one core; ``local@2``
gives the local engine the same two cores as two torch threads; ``plain@C`` starts Ray with
``C`` CPUs (``ray.init(num_cpus=C)``: ``C`` actors; the driver, Ray's own processes and the
actor still run side by side). ``--cpus 0`` pins every run's whole process tree to CPU 0
(``os.sched_setaffinity`` before it starts; its children inherit it): every side on one core. The table reports each run's
mean busy cores (its process tree's CPU seconds over its wall time) so that the sides'
resources are on the page.

Every run is a fresh process (its own session). Repetitions are interleaved: rep 1 runs every
config, then rep 2, ...; a run's seconds per round is the median over its rounds 2..R (round 1
includes actor warm-up and imports); reported per config: the min and the median over the reps,
and the ratio to ``plain`` of each. Peak memory: the peak of the summed RSS of every process of
the run's session (driver, Ray raylet/GCS and workers), sampled every 0.2 s, and the driver's
own peak RSS; the max over the reps. CPU: each process's user + system seconds, read with
the memory samples (``proctree.session_sample``).

Data: real MNIST from ``--data-root`` (or ``$FEDUDP_DATA``; ``<root>/mnist/*-idx?-ubyte[.gz]``),
else synthetic MNIST-shaped data (``bench_local.synthetic_mnist``) read the same way.

    .venv/bin/python scripts/benchmarks/bench_flower.py --data-root DATA --n 128 512 --rounds 3 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on 127.0.0.1 only
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import fedudp  # noqa: E402,F401  (before flwr/ray: turns their telemetry off)
from proctree import session_sample  # noqa: E402  (scripts/benchmarks/proctree.py, this script's folder)


def base_cfg(
    n: int,
    rounds: int,
    method: str,
    aggregator: str = "auto",
    data_root: str = "",
    engine: str = "flower",
    threads: int = 1,
):
    """The documented workload (bench_local.make_cfg) on ``engine``, ``threads`` torch threads
    per process."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_local

    cfg = bench_local.make_cfg(n, rounds, data_root, None, threads)
    cfg.method = method
    cfg.aggregator = aggregator
    cfg.engine = engine
    cfg.train.eval_every = 1  # every owner evaluated every round, as plain does
    cfg.engine_opts.num_cpus = 1.0
    return cfg


# ------------------------------------------------------------------------------------------
# plain Flower FedAvg app (Flower's own strategy), same model / data / owners. Module level
# (and imported as ``bench_flower``, not ``__main__``) so that Ray workers import it by
# reference and keep ``_PLAIN_CACHE`` between messages, like fedudp's own ClientApp.
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

_PLAIN_CACHE: dict = {}


def _plain_env(cfg_json: str):
    if cfg_json not in _PLAIN_CACHE:
        from fedudp import build
        from fedudp.config import config_from_json as cfg_from_json

        cfg = cfg_from_json(cfg_json)
        torch.set_num_threads(1)
        fed = build.federation(cfg)
        _PLAIN_CACHE.clear()
        _PLAIN_CACHE[cfg_json] = (cfg, fed, build.model(cfg).requires_grad_(True))
    return _PLAIN_CACHE[cfg_json]


plain_client_app = ClientApp()


@plain_client_app.train()
def _plain_train(msg: Message, context: Context) -> Message:
    cfg, fed, model = _plain_env(str(msg.content["config"]["cfg"]))
    od = fed.owner(int(context.node_config["partition-id"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
    n, b = int(od.x.shape[0]), cfg.train.batch_size
    rng = np.random.default_rng(
        [cfg.seed, int(msg.content["config"]["server-round"]), int(od.owner_ids[0])]
    )
    for _ in range(cfg.train.local_epochs):
        perm = torch.from_numpy(rng.permutation(n))
        for s in range(0, n, b):
            idx = perm[s : s + b]
            opt.zero_grad()
            F.cross_entropy(model(od.x[idx]), od.y[idx]).backward()
            opt.step()
    return Message(
        RecordDict(
            {
                "arrays": ArrayRecord(model.state_dict()),
                "metrics": MetricRecord({"num-examples": n}),
            }
        ),
        reply_to=msg,
    )


@plain_client_app.evaluate()
def _plain_evaluate(msg: Message, context: Context) -> Message:
    cfg, fed, model = _plain_env(str(msg.content["config"]["cfg"]))
    od = fed.owner(int(context.node_config["partition-id"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    model.eval()
    with torch.no_grad():
        logits = model(od.x_test)
        acc = float((logits.argmax(1) == od.y_test).double().mean())
        loss = float(F.cross_entropy(logits, od.y_test))
    return Message(
        RecordDict(
            {
                "metrics": MetricRecord(
                    {"accuracy": acc, "loss": loss, "num-examples": int(od.x_test.shape[0])}
                )
            }
        ),
        reply_to=msg,
    )


def run_plain(n: int, rounds: int, data_root: str, cpus: int | None = None) -> dict:
    import torch
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    from fedudp import build
    from fedudp.config import config_to_json as cfg_to_json

    cfg = base_cfg(n, rounds, "fedavg", data_root=data_root)
    build.federation(cfg)  # built as before; the result itself is not used
    model = build.model(cfg).requires_grad_(True)
    cfg_json = cfg_to_json(cfg)
    stamps: list[float] = []
    walls: list[float] = []  # time.time() at the stamps (for the CPU window)
    out: dict = {}

    class TimedFedAvg(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            stamps.append(time.perf_counter())
            walls.append(time.time())
            return super().configure_train(server_round, arrays, config, grid)

    server = ServerApp()

    @server.main()
    def main(grid, context) -> None:
        strategy = TimedFedAvg(
            fraction_train=1.0,
            fraction_evaluate=1.0,
            min_train_nodes=n,
            min_evaluate_nodes=n,
            min_available_nodes=n,
        )
        res = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(model.state_dict()),
            num_rounds=rounds,
            train_config=ConfigRecord({"cfg": cfg_json}),
            evaluate_config=ConfigRecord({"cfg": cfg_json}),
        )
        stamps.append(time.perf_counter())
        walls.append(time.time())
        acc = res.evaluate_metrics_clientapp.get(rounds, {})
        out["accuracy"] = float(acc["accuracy"]) if "accuracy" in acc else None

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_flower  # by reference in the Ray workers (see above)

    run_simulation(
        server_app=server,
        client_app=bench_flower.plain_client_app,
        num_supernodes=n,
        backend_config={
            "client_resources": {"num_cpus": 1.0, "num_gpus": 0.0},
            "init_args": {} if cpus is None else {"num_cpus": cpus},
        },
    )
    out["round_seconds"] = [b - a for a, b in zip(stamps, stamps[1:])]
    out["t_rounds_end"] = walls[-1]
    return out


def row_mean_aggregator():
    """``fedudp:fedavg:rows``: a plain mean that needs the per-user rows, to time the
    per-user-vector path (owners send [n_users, d]) with no privacy cost in the way."""
    import dp_accounting
    from fedudp.aggregators import Aggregate
    from fedudp.aggregators.base import RowsAggregator

    class RowMean(RowsAggregator):
        name = "none"
        private = False
        inputs = ("sampling",)  # what calibrated takes

        def __init__(self, sampling) -> None:
            self.sampling = sampling

        @classmethod
        def calibrated(cls, *, sampling):
            return cls(sampling)

        def estimate(self, G, *, rng=None):
            return Aggregate(mean=G.mean(0), users_used=int(G.shape[0]), diagnostics={})

        def dp_event(self):
            return dp_accounting.NonPrivateDpEvent()

    return RowMean


def run_fedudp(
    n: int, rounds: int, method: str, aggregator: str, data_root: str, engine: str, threads: int = 1
) -> dict:
    from fedudp import aggregators
    from fedudp.run import run

    if aggregator == "rows":  # the billboard asks the owners for rows (see RowMean)
        aggregators.REGISTRY.remove("none")  # replaced for this benchmark's process
        aggregators.REGISTRY.add("none", row_mean_aggregator())
        aggregator = "none"
    elif aggregator not in ("auto", *aggregators.REGISTRY.names()):
        raise SystemExit(f"unknown aggregator {aggregator}")
    d = tempfile.mkdtemp(prefix="bench_fedudp_")
    torch.set_num_threads(threads)
    summary = run(base_cfg(n, rounds, method, aggregator, data_root, engine, threads), d)
    rows = [json.loads(line) for line in open(Path(d) / "metrics.jsonl")]
    return {
        "round_seconds": [r["seconds"] for r in rows],
        "accuracy": summary["accuracy_mean"],
        "epsilon": summary["epsilon"],
        # the last round's end: its metrics line is appended as it ends
        "t_rounds_end": os.stat(Path(d) / "metrics.jsonl").st_mtime,
    }


# ------------------------------------------------------------------------------------------
def measure(
    kind: str,
    n: int,
    rounds: int,
    method: str,
    aggregator: str,
    data_root: str,
    cpus: list[int] | None = None,
) -> dict:
    """Run one configuration in a fresh process (its own session), on the CPUs ``cpus`` (None:
    all); sample its memory and CPU time."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--n",
        str(n),
        "--rounds",
        str(rounds),
        "--method",
        method,
        "--aggregator",
        aggregator,
        "--out",
        path,
        "--data-root",
        data_root,
    ]
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=pin,
    )
    peak = [0]
    cpu: dict[int, float] = {}
    series: list[tuple[float, float]] = []  # (time.time(), the tree's CPU seconds so far)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            rss, _, by_pid = session_sample(proc.pid)
            peak[0] = max(peak[0], rss)
            for pid, sec in by_pid.items():
                cpu[pid] = max(cpu.get(pid, 0.0), sec)
            series.append((time.time(), sum(cpu.values())))
            time.sleep(0.2)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    _, err = proc.communicate()
    done.set()
    th.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} n={n} failed:\n{err[-3000:]}")
    res = json.loads(Path(path).read_text())
    os.unlink(path)
    steady = res["round_seconds"][1:] or res["round_seconds"]
    plain = kind.startswith("plain")
    res.update(
        kind=kind,
        n=n,
        method="fedavg (Flower FedAvg)" if plain else method,
        aggregator="flower" if plain else aggregator,
        round_s=statistics.median(steady),
        total_s=time.perf_counter() - t0,
        peak_rss_mb=peak[0] / 2**20,
        cpu_s=sum(cpu.values()),
    )
    res["busy_cores"] = steady_cores(series, res["t_rounds_end"], sum(steady))
    return res


def steady_cores(series: list[tuple[float, float]], t_end: float, wall: float) -> float:
    """Mean busy cores of the counted rounds: the tree's CPU seconds over the ``wall`` seconds
    before the last round ended (``t_end``, wall-clock), read from the samples nearest those
    times, over the time between the two samples."""

    def at(t: float) -> tuple[float, float]:
        return min(series, key=lambda s: abs(s[0] - t))

    (t0, c0), (t1, c1) = at(t_end - wall), at(t_end)
    return (c1 - c0) / (t1 - t0) if t1 > t0 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per run (2..R counted)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions per config")
    ap.add_argument(
        "--configs",
        nargs="+",
        default=["plain", "fedudp:fedavg:none", "local:fedavg:none", "local@2:fedavg:none"],
        help="plain[@C] (Ray on C CPUs, default all) | "
        "fedudp:<method>:<aggregator> (engine=flower) | "
        "local[@T]:<method>:<aggregator> (engine=local, T torch threads, "
        "default 1); aggregator 'rows': per-user vectors sent, see RowMean",
    )
    ap.add_argument(
        "--data-root",
        default=os.environ.get("FEDUDP_DATA"),
        help="folder holding <root>/mnist/ IDX files (else synthetic MNIST-shaped "
        "data); default: $FEDUDP_DATA",
    )
    ap.add_argument(
        "--cpus",
        type=int,
        nargs="+",
        default=None,
        help="pin every run's process tree to these CPUs (default: all)",
    )
    ap.add_argument("--json", type=str, default=None, help="write all results here")
    ap.add_argument("--child", type=str, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--method", type=str, default="joint_dp", help=argparse.SUPPRESS)
    ap.add_argument("--aggregator", type=str, default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=str, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        n = a.n[0]
        kind, _, threads = a.child.partition("@")
        res = (
            run_plain(n, a.rounds, a.data_root, int(threads) if threads else None)
            if kind == "plain"
            else run_fedudp(
                n,
                a.rounds,
                a.method,
                a.aggregator,
                a.data_root,
                "local" if kind == "local" else "flower",
                int(threads or 1),
            )
        )
        res["driver_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        Path(a.out).write_text(json.dumps(res))
        return
    if a.rounds < 2 or a.reps < 1:
        raise SystemExit("bench_flower.py: error: --rounds must be >= 2 and --reps >= 1")
    if a.cpus is not None and not set(a.cpus) <= os.sched_getaffinity(0):
        raise SystemExit(
            f"bench_flower.py: error: --cpus {a.cpus}: this process may run on "
            f"CPUs {sorted(os.sched_getaffinity(0))} only"
        )
    for c in a.configs:
        kind, _, threads = c.split(":")[0].partition("@")
        if kind not in ("plain", "fedudp", "local") or (
            threads and (kind == "fedudp" or not threads.isdigit() or int(threads) < 1)
        ):
            raise SystemExit(
                f"bench_flower.py: error: --configs {c}: expected plain[@C], "
                "fedudp:<method>:<aggregator> or local[@T]:<method>:<aggregator> "
                "with C Ray's CPUs and T torch threads, positive integers"
            )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_local

    tmp = None
    if a.data_root and bench_local._has_mnist(Path(a.data_root)):
        root, data = a.data_root, f"MNIST from {a.data_root}"
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_mnist_")
        root = str(bench_local.synthetic_mnist(Path(tmp.name)))
        data = f"synthetic MNIST-shaped data (no MNIST under {a.data_root})"
    print(
        f"data: {data}; model cnn, fedavg workload, {a.rounds} rounds per run (2..R counted), "
        f"{a.reps} interleaved reps, one thread per process"
        f"{'' if a.cpus is None else f', every run pinned to CPUs {a.cpus}'}",
        flush=True,
    )
    runs: dict = {}
    t_all = time.perf_counter()
    for n in a.n:
        for rep in range(a.reps):
            for c in a.configs:
                kind, method, agg = (
                    (c.split(":") + ["", ""])[:3] if not c.startswith("plain") else (c, "", "")
                )
                r = measure(kind, n, a.rounds, method or "fedavg", agg or "auto", root, a.cpus)
                runs.setdefault((n, c), []).append(r)
                print(
                    f"  n={n} rep {rep + 1} {c}: {r['round_s']:.2f} s/round "
                    f"(peak {r['peak_rss_mb']:.0f} MB, {r['total_s']:.0f} s, "
                    f"{r['busy_cores']:.2f} cores busy)",
                    flush=True,
                )
    results = []
    print(
        "\n| n | config | s/round min | s/round median | ratio to plain (min / median) | "
        "peak RSS tree (MB) | driver (MB) | busy cores, counted rounds (median) | accuracy |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    for n in a.n:
        base = runs.get((n, "plain"))  # Flower as it runs by default: the ratios' base
        for c in a.configs:
            rs = runs[(n, c)]
            per = [r["round_s"] for r in rs]
            mn, md = min(per), statistics.median(per)
            ratio = "-"
            if base:
                bp = [r["round_s"] for r in base]
                ratio = f"{mn / min(bp):.2f} / {md / statistics.median(bp):.2f}"
            acc = rs[-1].get("accuracy")
            row = {
                "n": n,
                "config": c,
                "round_s": per,
                "min": mn,
                "median": md,
                "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                "driver_peak_rss_mb": max(r["driver_peak_rss_mb"] for r in rs),
                "accuracy": acc,
                "ratio": ratio,
                "busy_cores": statistics.median(r["busy_cores"] for r in rs),
                "pinned_cpus": a.cpus,
            }
            results.append(row)
            print(
                f"| {n} | {c} | {mn:.2f} | {md:.2f} | {ratio} | {row['peak_rss_mb']:.0f} | "
                f"{row['driver_peak_rss_mb']:.0f} | {row['busy_cores']:.2f} | "
                f"{'-' if acc is None else f'{acc:.3f}'} |",
                flush=True,
            )
    print(f"\nwall time {time.perf_counter() - t_all:.0f} s", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
