"""Benchmark: fedudp's ``engine=flower`` vs a plain Flower FedAvg app.

Both run on Flower's simulation (``run_simulation``, Ray backend, one ClientApp per owner)
with the same model (``fedudp.build.model``), data and owners (``fedudp.build.federation``):

* ``fedudp``: ``fedudp.run.run`` with ``engine=flower`` (the billboard ServerApp; owners
  reply with per-user shared vectors or, for ``aggregator=gaussian``, the sum of clipped
  vectors and a count), every owner evaluated every round;
* ``plain``: Flower's own ``FedAvg`` strategy (``fraction_train=fraction_evaluate=1``); the
  ClientApp trains the full model with a plain PyTorch SGD loop (same lr, batch size and
  epochs) on its shard and returns it; every owner evaluates every round.

Per-round wall time is the median over rounds 2..R (round 1 includes actor warm-up); peak
memory is the peak of the summed RSS of every process of the run's session (driver, Ray
raylet/GCS and workers), sampled every 0.2 s, plus the driver's own peak RSS.

    .venv/bin/python scripts/bench_flower.py --n 16 128 512 --rounds 4
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

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # Ray on 127.0.0.1 only
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import fedudp  # noqa: E402,F401  (before flwr/ray: turns their telemetry off)


def base_cfg(n: int, rounds: int, method: str, aggregator: str = "auto"):
    from fedudp.config import RunConfig
    cfg = RunConfig()
    cfg.progress = False
    cfg.method = method
    cfg.aggregator = aggregator
    cfg.engine = "flower"
    cfg.partition.num_owners = n
    cfg.train.rounds = rounds
    cfg.engine_opts.threads = 1
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
    rng = np.random.default_rng([cfg.seed, int(msg.content["config"]["server-round"]), int(od.owner_ids[0])])
    for _ in range(cfg.train.local_epochs):
        perm = torch.from_numpy(rng.permutation(n))
        for s in range(0, n, b):
            idx = perm[s:s + b]
            opt.zero_grad()
            F.cross_entropy(model(od.x[idx]), od.y[idx]).backward()
            opt.step()
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"num-examples": n})}), reply_to=msg)


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
    return Message(RecordDict({"metrics": MetricRecord({
        "accuracy": acc, "loss": loss, "num-examples": int(od.x_test.shape[0])})}), reply_to=msg)


def run_plain(n: int, rounds: int) -> dict:
    import torch
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    from fedudp import build
    from fedudp.config import config_to_json as cfg_to_json

    cfg = base_cfg(n, rounds, "fedavg")
    fed = build.federation(cfg)
    model = build.model(cfg).requires_grad_(True)
    cfg_json = cfg_to_json(cfg)
    stamps: list[float] = []
    out: dict = {}

    class TimedFedAvg(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            stamps.append(time.perf_counter())
            return super().configure_train(server_round, arrays, config, grid)

    server = ServerApp()

    @server.main()
    def main(grid, context) -> None:
        strategy = TimedFedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=n,
                               min_evaluate_nodes=n, min_available_nodes=n)
        res = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                             num_rounds=rounds, train_config=ConfigRecord({"cfg": cfg_json}),
                             evaluate_config=ConfigRecord({"cfg": cfg_json}))
        stamps.append(time.perf_counter())
        acc = res.evaluate_metrics_clientapp.get(rounds, {})
        out["accuracy"] = float(acc["accuracy"]) if "accuracy" in acc else None

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_flower   # by reference in the Ray workers (see above)
    run_simulation(server_app=server, client_app=bench_flower.plain_client_app, num_supernodes=n,
                   backend_config={"client_resources": {"num_cpus": 1.0, "num_gpus": 0.0},
                                   "init_args": {}})
    out["round_seconds"] = [b - a for a, b in zip(stamps, stamps[1:])]
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


def run_fedudp(n: int, rounds: int, method: str, aggregator: str) -> dict:
    from fedudp import aggregators
    from fedudp.config import AggregatorName
    from fedudp.run import run
    if aggregator == "rows":    # the billboard asks the owners for rows (see RowMean)
        aggregators.REGISTRY["none"] = row_mean_aggregator()
        aggregator = "none"
    elif aggregator not in [a.value for a in AggregatorName]:
        raise SystemExit(f"unknown aggregator {aggregator}")
    d = tempfile.mkdtemp(prefix="bench_fedudp_")
    summary = run(base_cfg(n, rounds, method, aggregator), d)
    rows = [json.loads(line) for line in open(Path(d) / "metrics.jsonl")]
    return {"round_seconds": [r["seconds"] for r in rows], "accuracy": summary["accuracy_mean"],
            "epsilon": summary["epsilon"]}


# ------------------------------------------------------------------------------------------
def _session_rss(sid: int) -> int:
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[3]) != sid:
                continue
            for line in (d / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


def measure(kind: str, n: int, rounds: int, method: str, aggregator: str) -> dict:
    """Run one configuration in a fresh process (its own session); sample its memory."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, __file__, "--child", kind, "--n", str(n), "--rounds", str(rounds),
           "--method", method, "--aggregator", aggregator, "--out", path]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _session_rss(proc.pid))
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
    res.update(kind=kind, n=n, method=method if kind == "fedudp" else "fedavg (Flower FedAvg)",
               aggregator=aggregator if kind == "fedudp" else "flower",
               round_s=statistics.median(steady), total_s=time.perf_counter() - t0,
               peak_rss_mb=peak[0] / 2**20)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--configs", nargs="+",
                    default=["plain", "fedudp:joint_dp:gaussian", "fedudp:fedavg:none"],
                    help="plain | fedudp:<method>:<aggregator> (aggregator 'rows': per-user "
                         "vectors sent, see RowMean)")
    ap.add_argument("--json", type=str, default=None, help="write all results here")
    ap.add_argument("--child", type=str, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--method", type=str, default="joint_dp", help=argparse.SUPPRESS)
    ap.add_argument("--aggregator", type=str, default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=str, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        n = a.n[0]
        res = run_plain(n, a.rounds) if a.child == "plain" else \
            run_fedudp(n, a.rounds, a.method, a.aggregator)
        res["driver_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        Path(a.out).write_text(json.dumps(res))
        return
    results = []
    print(f"{'n':>5} {'config':<32} {'s/round':>8} {'ratio':>6} {'peak MB':>8} {'driver MB':>9} {'acc':>6}")
    for n in a.n:
        base = None
        for c in a.configs:
            kind, method, agg = (c.split(":") + ["", ""])[:3] if c != "plain" else ("plain", "", "")
            r = measure(kind, n, a.rounds, method or "fedavg", agg or "auto")
            if kind == "plain":
                base = r["round_s"]
            r["ratio_vs_plain"] = r["round_s"] / base if base else None
            results.append(r)
            ratio = f"{r['ratio_vs_plain']:.2f}" if r["ratio_vs_plain"] else "-"
            acc = f"{r['accuracy']:.3f}" if r.get("accuracy") is not None else "-"
            print(f"{n:>5} {c:<32} {r['round_s']:>8.3f} {ratio:>6} {r['peak_rss_mb']:>8.0f} "
                  f"{r['driver_peak_rss_mb']:>9.0f} {acc:>6}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
