"""Benchmark: ``fedudp.flower``'s user-level DP (``UserLevelDP`` + ``user_level_mod``) versus
plain Flower ``FedAvg`` on the same Flower app, the same data and the same n clients.

The app is the example's (``examples/flower_user_dp/user_dp_app/task.py``: model, data,
training step ``task.train``), each client holding 10 users (client p: users 10p .. 10p+9 of
10n, user u's records ``task.load_data(u, 10n)``):

* ``plain``: Flower's ``FedAvg``; the ClientApp's train step runs ``task.train`` once, on the
  union of the client's 10 users' records, and replies with the model;
* ``wrapped``: ``UserLevelDP(FedAvg(...), GaussianAggregator.calibrated(clip=1, ε=8, δ=1e-5,
  rounds=R, Sampling(rate=1.0, population=10n)), target_epsilon=8)`` with
  ``user_level_mod(users_per_client=10)``: the same ``task.train`` runs once per user (user
  sampling rate 1.0, so both sides touch the same records), each user's update clipped, the
  clipped sum sent, the Gaussian release and the ledger on the server (the per-user path);
* ``fast``: the same server, with ``user_level_mod(users_per_client=10,
  fast=TorchTraining(make_model, load_data, lr="lr"))`` (the example app's ClientApp): the
  client's sampled users' updates (one full-batch SGD step each, what ``task.train`` does) from
  one batched forward/backward (``fedudp.flower.fast``), clipped and summed as on the per-user
  path; the app's train step is not called in training.

Both sides: ``fraction_train=1`` (every client every round), no evaluation, Ray backend with
``client_resources = {num_cpus: 1, num_gpus: 0}`` on a fresh local Ray (``address: local``,
127.0.0.1 only), ``OMP_NUM_THREADS=1``. Every repetition runs in a fresh subprocess (Flower's
simulation keeps state between ``run_simulation`` calls in one process); the sides alternate
(plain, fast, wrapped, plain, fast, wrapped, ...; ``--sides`` picks them).

Measured in each repetition:

* s/round: ``time.perf_counter()`` at the start of each round's ``configure_train`` (the outer
  strategy) and after ``strategy.start`` returns; round 1 (actor warm-up) is excluded, the
  repetition's s/round is the mean of rounds 2..R; min and median over the repetitions;
* server-side strategy time per round (``configure_train`` + ``aggregate_train`` of the outer
  strategy; for ``wrapped`` also the release, the accountant's ``compose``, ``epsilon``,
  ``epsilon_rdp`` and ``epsilon_if``);
* client-side time per round, summed over the clients: the ClientApp's whole train handling
  (an outer timing mod) and the part inside the app's train step (model build, data load,
  ``task.train``, reply; on the fast side: ``TorchTraining.updates``, data loading included);
  the difference is the mod's own work (per-user messages and contexts, float64 flattening,
  clipping, records);
* wall time of the subprocess, and the peak over time of the summed RSS (and PSS, from
  ``/proc/<pid>/smaps_rollup``) of its process tree (the driver, Ray's GCS, raylet, agents and
  workers: every descendant of the subprocess, or member of its session), sampled every
  0.25 s from ``/proc``.

    .venv/bin/python scripts/benchmarks/bench_flower_user_dp.py --n 16 128 --reps 5 --rounds 6 \
        --json docs/results/flower_user_dp/bench.json --markdown docs/results/flower_user_dp/table.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "flower_user_dp"
SCRIPTS = ROOT / "scripts" / "benchmarks"
for _p in (str(ROOT), str(EXAMPLE), str(SCRIPTS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on 127.0.0.1 only
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

USERS_PER_CLIENT = 10
CLIP, EPSILON, DELTA = 1.0, 8.0, 1e-5
LR = 0.5
MARK = "BENCH_RESULT "


# ------------------------------------------------------------------------------------------
# The ClientApps (module level; the child imports this file as ``bench_flower_user_dp`` so
# that Ray's workers import it by reference and keep ``_CLIENT`` per worker process).
def _client_apps():
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from fedudp.flower import user_level_mod
    from fedudp.flower.fast import TorchTraining
    from user_dp_app.task import load_data, make_model, train

    torch.set_num_threads(1)
    acc = {"train_s": 0.0, "calls": 0}

    def fit(msg: Message, x, y) -> Message:
        """The one training step of both sides: the example app's own train_fn body."""
        model = make_model()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        loss = train(model, x, y, lr=float(msg.content["config"]["lr"]))
        return Message(
            RecordDict(
                {
                    "arrays": ArrayRecord(model.state_dict()),
                    "metrics": MetricRecord({"train_loss": loss, "num-examples": len(y)}),
                }
            ),
            reply_to=msg,
        )

    def timed(data_of):
        def train_fn(msg: Message, context: Context) -> Message:
            t0 = time.perf_counter()
            x, y = data_of(context)
            out = fit(msg, x, y)
            acc["train_s"] += time.perf_counter() - t0
            acc["calls"] += 1
            return out

        return train_fn

    def timing_mod(msg: Message, context: Context, call_next) -> Message:
        """Outermost mod: the client's whole handling of a train message, and the part spent
        in the app's train step; sent back in a "bench" record the server strips."""
        if msg.metadata.message_type != "train":
            return call_next(msg, context)
        acc["train_s"], acc["calls"] = 0.0, 0
        t0 = time.perf_counter()
        reply = call_next(msg, context)
        total = time.perf_counter() - t0
        if not reply.has_error():
            reply.content["bench"] = MetricRecord(
                {"client_s": total, "train_s": acc["train_s"], "train_calls": acc["calls"]}
            )
        return reply

    def union(context: Context):
        """The client's users' records, all together (plain FedAvg's client)."""
        p, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
        k = USERS_PER_CLIENT
        parts = [load_data(u, n * k) for u in range(p * k, (p + 1) * k)]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    def one_user(context: Context):
        """User ``partition-id`` of ``num-partitions`` (what user_level_mod hands the app)."""
        return load_data(
            int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
        )

    class TimedTraining(TorchTraining):
        """The example app's fast path, its ``updates`` (data loading included) timed as the
        "train step" (one call per client and round)."""

        def updates(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return super().updates(*a, **kw)
            finally:
                acc["train_s"] += time.perf_counter() - t0
                acc["calls"] += 1

    plain = ClientApp(mods=[timing_mod])
    plain.train()(timed(union))
    wrapped = ClientApp(mods=[timing_mod, user_level_mod(users_per_client=USERS_PER_CLIENT)])
    wrapped.train()(timed(one_user))
    fast_mod = user_level_mod(
        users_per_client=USERS_PER_CLIENT, fast=TimedTraining(make_model, load_data, lr="lr")
    )
    fast = ClientApp(mods=[timing_mod, fast_mod])
    fast.train()(timed(one_user))  # the app's step: not called in training on this path
    return plain, wrapped, fast, timed(one_user)


SIDES = ("plain", "fast", "wrapped")  # the order of each repetition
LABELS = {"plain": "plain", "fast": "fast (fast path)", "wrapped": "wrapped (per-user path)"}

if __name__ != "__main__":  # imported (the child, its Ray workers): the apps
    plain_client_app, wrapped_client_app, fast_client_app, one_user_step = _client_apps()


# ------------------------------------------------------------------------------------------
# One repetition (in the child process)
def _timed_method(obj, name: str, bucket: dict, key: str) -> None:
    """Replace ``obj.name`` by a wrapper adding its time to ``bucket[key]``."""
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            bucket[key] = bucket.get(key, 0.0) + time.perf_counter() - t0

    setattr(obj, name, wrapper)


def run_one(side: str, n: int, rounds: int) -> dict:
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    from fedudp.aggregators import GaussianAggregator, Sampling
    from fedudp.flower import ray_watchdog
    from fedudp.flower import UserLevelDP
    from user_dp_app.task import make_model

    import bench_flower_user_dp as mod  # by reference in the Ray workers (see above)

    stamps: list[tuple[float, float, float]] = []  # (before, after) the CPU read, tree CPU s
    server: list[dict] = []  # per round: server-side seconds by part
    clients: list[dict] = []  # per round: client-side seconds summed over the clients
    out: dict = {"side": side, "n": n, "rounds": rounds}

    me = os.getpid()

    def stamp() -> None:
        t0 = time.perf_counter()
        cpu = _tree_cpu(me)
        stamps.append((t0, time.perf_counter(), cpu))

    def strip_bench(server_round: int, replies) -> list:
        replies = list(replies)
        c = {"client_s": 0.0, "train_s": 0.0, "train_calls": 0, "replies": 0, "errors": 0}
        for r in replies:
            if r.has_error():
                c["errors"] += 1
                continue
            c["replies"] += 1
            if "bench" in r.content:
                b = r.content["bench"]
                for k in ("client_s", "train_s", "train_calls"):
                    c[k] += b[k]
                del r.content["bench"]
        clients.append(c)
        return replies

    def timing(base):
        class Timed(base):
            def configure_train(self, server_round, arrays, config, grid):
                stamp()
                server.append({})
                t0 = time.perf_counter()
                msgs = list(super().configure_train(server_round, arrays, config, grid))
                server[-1]["configure_train"] = time.perf_counter() - t0
                return msgs

            def aggregate_train(self, server_round, replies):
                replies = strip_bench(server_round, replies)
                t0 = time.perf_counter()
                res = super().aggregate_train(server_round, replies)
                server[-1]["aggregate_train"] = time.perf_counter() - t0
                return res

        return Timed

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        inner = dict(
            fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n
        )
        init = ArrayRecord(make_model().state_dict())
        if side == "plain":
            strategy = timing(FedAvg)(**inner)
        else:
            agg = GaussianAggregator.calibrated(
                clip=CLIP,
                epsilon=EPSILON,
                delta=DELTA,
                rounds=rounds,
                sampling=Sampling(rate=1.0, population=n * USERS_PER_CLIENT),
            )
            strategy = timing(UserLevelDP)(
                FedAvg(**inner), agg, delta=DELTA, target_epsilon=EPSILON, seed=0
            )

            class Parts(dict):  # the wrapper's own parts, into the current round's entry
                def __setitem__(self, k, v):  # (outside the rounds: not counted)
                    if server:
                        server[-1][k] = v

                def get(self, k, default=None):
                    return server[-1].get(k, default) if server else default

            parts = Parts()
            _timed_method(strategy.aggregator, "release", parts, "release")
            for name in ("compose", "epsilon", "epsilon_rdp", "epsilon_if"):
                _timed_method(strategy.accountant, name, parts, f"accountant.{name}")
            out["noise_multiplier"] = float(agg.noise_multiplier)
        res = strategy.start(
            grid=grid, initial_arrays=init, num_rounds=rounds, train_config=ConfigRecord({"lr": LR})
        )
        stamp()
        out["trained_rounds"] = len(res.train_metrics_clientapp)
        if side != "plain":
            out["epsilon"] = strategy.ledger.entries[-1].epsilon if strategy.ledger.entries else 0.0
            out["ledger_rounds"] = len(strategy.ledger.entries)
            out["users_per_round"] = [int(m["users"]) for m in res.train_metrics_clientapp.values()]

    ray_watchdog.start()  # the Ray this run starts ends with it, even after SIGKILL
    t0 = time.perf_counter()
    run_simulation(
        server_app=app,
        client_app={
            "plain": mod.plain_client_app,
            "wrapped": mod.wrapped_client_app,
            "fast": mod.fast_client_app,
        }[side],
        num_supernodes=n,
        backend_name="ray",
        backend_config={
            "client_resources": {"num_cpus": 1.0, "num_gpus": 0.0},
            "init_args": {"address": "local"},
        },
    )
    out["simulation_s"] = time.perf_counter() - t0
    import resource

    out["driver_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # a round: from after one CPU read to before the next (the reads themselves not counted)
    out["round_seconds"] = [b[0] - a[1] for a, b in zip(stamps, stamps[1:])]
    out["round_cpu_seconds"] = [b[2] - a[2] for a, b in zip(stamps, stamps[1:])]
    out["server_seconds"] = server
    out["client_seconds"] = clients
    if len(out["round_seconds"]) != rounds or out.get("trained_rounds") != rounds:
        raise SystemExit(
            f"{side} n={n}: {len(out['round_seconds'])} timed rounds, "
            f"{out.get('trained_rounds')} trained, expected {rounds}"
        )
    expect = n * USERS_PER_CLIENT if side == "wrapped" else n  # fast: one updates() a client
    bad = [c for c in clients if c["replies"] != n or c["train_calls"] != expect]
    if bad:
        raise SystemExit(f"{side} n={n}: incomplete rounds {bad}")
    return out


# ------------------------------------------------------------------------------------------
# In-process, no Ray: user_level_mod on one client versus the bare training steps
def profile_mod(n: int, reps: int = 200) -> None:
    """Time ``user_level_mod`` on one client's 10 users against the 10 bare training steps it
    calls (the app's own), in this process, then cProfile the mod (its own functions)."""
    import cProfile
    import pstats

    import torch

    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedudp.flower import K_DP, user_level_mod
    from fedudp.flower.fast import TorchTraining
    from user_dp_app.task import load_data, make_model, train

    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1  # a Message needs them
    import bench_flower_user_dp as mod_

    arrays = ArrayRecord(make_model().state_dict())
    k = USERS_PER_CLIENT

    def message(dp: bool) -> Message:
        c = RecordDict({"arrays": arrays, "config": ConfigRecord({"lr": LR})})
        if dp:
            c[K_DP] = ConfigRecord(
                {
                    "round": 1,
                    "seed": 0,
                    "rate": 1.0,
                    "rows": False,
                    "clip": CLIP,
                    "population": n * k,
                    "personal": [""],
                }
            )
        return Message(c, dst_node_id=1, message_type="train")

    def ctx(p: int, parts: int) -> Context:
        return Context(
            run_id=1,
            node_id=1,
            node_config={"partition-id": p, "num-partitions": parts},
            state=RecordDict(),
            run_config={},
        )

    step = mod_.one_user_step
    user_mod = user_level_mod(users_per_client=k)
    client = ctx(3, n)
    for _ in range(5):
        user_mod(message(True), client, step)
    t0 = time.perf_counter()
    for _ in range(reps):
        user_mod(message(True), client, step)
    t_mod = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        for u in range(3 * k, 4 * k):
            step(message(False), ctx(u, n * k))
    t_steps = (time.perf_counter() - t0) / reps
    print(
        f"one client, {k} users: user_level_mod {t_mod * 1e3:.2f} ms; the {k} bare training "
        f"steps {t_steps * 1e3:.2f} ms; the mod's own work {(t_mod - t_steps) * 1e3:.2f} ms "
        f"({(t_mod - t_steps) / k * 1e3:.3f} ms per user)"
    )
    fast_mod = user_level_mod(
        users_per_client=k, fast=TorchTraining(make_model, load_data, lr="lr")
    )
    for _ in range(5):
        fast_mod(message(True), client, step)
    t0 = time.perf_counter()
    for _ in range(reps):
        fast_mod(message(True), client, step)
    t_fast = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        xs = [load_data(u, n * k) for u in range(3 * k, 4 * k)]
        x, y = torch.cat([a for a, _ in xs]), torch.cat([b for _, b in xs])
        model = make_model()
        model.load_state_dict(arrays.to_torch_state_dict())
        train(model, x, y, lr=LR)
        ArrayRecord(model.state_dict())
    t_plain = (time.perf_counter() - t0) / reps
    print(
        f"one client, {k} users: user_level_mod with fast= {t_fast * 1e3:.2f} ms; plain "
        f"FedAvg's one training step on the union of the {k} users' records (data, model, "
        f"train, reply arrays) {t_plain * 1e3:.2f} ms"
    )
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(reps):
        user_mod(message(True), client, step)
    pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(r"flower\.py|array\.py.*numpy", 15)


# ------------------------------------------------------------------------------------------
# The parent: subprocesses, memory sampling, the table
def _proc_stat(pid: str) -> tuple[int, int] | None:
    """(parent pid, session id) of ``pid``."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        f = raw[raw.rindex(")") + 2 :].split()
        return int(f[1]), int(f[3])
    except (OSError, ValueError, IndexError):
        return None


def _tree(root: int) -> set[int]:
    """``root``, its descendants and the members of its session."""
    parent, session = {}, {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _proc_stat(d)
            if st is not None:
                parent[int(d)], session[int(d)] = st
    tree = {p for p, s in session.items() if s == root} | {root}
    grew = True
    while grew:
        new = {p for p, pp in parent.items() if pp in tree and p not in tree}
        tree |= new
        grew = bool(new)
    return {p for p in tree if p in parent}


def _tree_cpu(root: int) -> float:
    """CPU seconds (user + system) used so far by ``root``'s process tree (see ``_tree``)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in _tree(root):
        try:
            raw = Path(f"/proc/{pid}/stat").read_text()
            f = raw[raw.rindex(")") + 2 :].split()
            total += int(f[11]) + int(f[12])
        except (OSError, ValueError, IndexError):
            continue
    return total / tick


def _memory(pids: set[int]) -> tuple[int, int]:
    """(summed RSS, summed PSS) in bytes."""
    rss = pss = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return rss, pss


def _sources_sha1() -> str:
    """A fingerprint of fedudp's sources (others may edit them while this runs: each repetition
    records the version it ran)."""
    h = hashlib.sha1()
    for f in sorted((ROOT / "fedudp").rglob("*.py")):
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def measure(side: str, n: int, rounds: int) -> dict:
    """One repetition in a fresh subprocess (its own session); its tree's memory sampled."""
    env = {
        **os.environ,
        "BENCH_FLOWER_USER_DP_CHILD": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(EXAMPLE), str(SCRIPTS)]
            + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
    }
    env.pop("RAY_ADDRESS", None)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--one",
        side,
        "--n",
        str(n),
        "--rounds",
        str(rounds),
    ]
    load_before, sources = os.getloadavg()[0], _sources_sha1()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    peak = {"rss": 0, "pss": 0, "procs": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            pids = _tree(proc.pid)
            rss, pss = _memory(pids)
            if rss > peak["rss"]:
                peak["rss"], peak["procs"] = rss, len(pids)
            peak["pss"] = max(peak["pss"], pss)
            done.wait(0.25)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    done.set()
    th.join()
    lines = [line for line in stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{side} n={n} failed (rc {proc.returncode}):\n{stdout[-2000:]}\n{stderr[-4000:]}"
        )
    res = json.loads(lines[-1][len(MARK) :])
    steady = res["round_seconds"][1:] or res["round_seconds"]
    cpu = res["round_cpu_seconds"][1:] or res["round_cpu_seconds"]
    res.update(
        wall_s=wall,
        s_per_round=statistics.fmean(steady),
        cpu_s_per_round=statistics.fmean(cpu),
        load1_before=load_before,
        load1_after=os.getloadavg()[0],
        fedudp_sources_sha1=sources,
        peak_rss_mb=peak["rss"] / 2**20,
        peak_pss_mb=peak["pss"] / 2**20,
        peak_procs=peak["procs"],
    )
    srv = res["server_seconds"][1:] or res["server_seconds"]
    cli = res["client_seconds"][1:] or res["client_seconds"]
    res["server_s_per_round"] = {
        k: statistics.fmean(r.get(k, 0.0) for r in srv) for k in sorted({k for r in srv for k in r})
    }
    res["client_s_per_round"] = {
        k: statistics.fmean(r[k] for r in cli) for k in ("client_s", "train_s", "train_calls")
    }
    return res


def summarize(results: list[dict]) -> dict:
    out: dict = {}
    for n in sorted({r["n"] for r in results}):
        row: dict = {}
        for side in SIDES:
            rs = [r for r in results if r["n"] == n and r["side"] == side]
            if not rs:
                continue
            sp = [r["s_per_round"] for r in rs]
            cp = [r["cpu_s_per_round"] for r in rs]
            row[side] = {
                "reps": len(rs),
                "min": min(sp),
                "median": statistics.median(sp),
                "s_per_round": sp,
                "cpu_min": min(cp),
                "cpu_median": statistics.median(cp),
                "cpu_s_per_round": cp,
                "wall_s": [r["wall_s"] for r in rs],
                "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                "peak_pss_mb": max(r["peak_pss_mb"] for r in rs),
                "driver_peak_rss_mb": max(r["driver_peak_rss_mb"] for r in rs),
                "server": {
                    k: statistics.median(r["server_s_per_round"].get(k, 0.0) for r in rs)
                    for k in sorted({k for r in rs for k in r["server_s_per_round"]})
                },
                "client": {
                    k: statistics.median(r["client_s_per_round"][k] for r in rs)
                    for k in ("client_s", "train_s", "train_calls")
                },
            }
        for side, pre in (("wrapped", ""), ("fast", "fast_")):  # side / plain
            if "plain" in row and side in row:
                w, p = row[side], row["plain"]
                row[pre + "ratio_min"] = w["min"] / p["min"]
                row[pre + "ratio_median"] = w["median"] / p["median"]
                row[pre + "cpu_ratio_min"] = w["cpu_min"] / p["cpu_min"]
                row[pre + "cpu_ratio_median"] = w["cpu_median"] / p["cpu_median"]
        out[n] = row
    return out


def markdown(summary: dict) -> str:
    f = lambda xs: ", ".join(f"{x:.0f}" for x in xs)  # noqa: E731
    lines = [
        "| n clients (users) | side | s/round min | s/round median "
        "| side/plain (min / median) "
        "| CPU s/round min / median | CPU side/plain (min / median) "
        "| wall s per repetition | peak RSS MB of the tree (PSS MB; driver RSS MB) |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for n, row in summary.items():
        for side in SIDES:
            if side not in row:
                continue
            s = row[side]
            pre = {"wrapped": "", "fast": "fast_"}.get(side)
            ratio = (
                f"{row[pre + 'ratio_min']:.2f} / {row[pre + 'ratio_median']:.2f}"
                if pre is not None and pre + "ratio_min" in row
                else ""
            )
            cratio = (
                f"{row[pre + 'cpu_ratio_min']:.2f} / {row[pre + 'cpu_ratio_median']:.2f}"
                if pre is not None and pre + "cpu_ratio_min" in row
                else ""
            )
            lines.append(
                f"| {n} ({n * USERS_PER_CLIENT}) | {LABELS[side]} | {s['min']:.3f} | "
                f"{s['median']:.3f} | {ratio} | {s['cpu_min']:.3f} / "
                f"{s['cpu_median']:.3f} | {cratio} | {f(s['wall_s'])} | "
                f"{s['peak_rss_mb']:.0f} ({s['peak_pss_mb']:.0f}; "
                f"{s['driver_peak_rss_mb']:.0f}) |"
            )
    lines += [
        "",
        "Per round (medians over the repetitions of each repetition's mean over rounds "
        "2..R), seconds:",
        "",
        "| n | side | server configure_train | server aggregate_train "
        "| release (in aggregate) "
        "| accountant, both (epsilon_if in configure; compose, epsilon, epsilon_rdp in "
        "aggregate) | clients: whole train handling (sum) "
        "| clients: app train step (sum; fast: TorchTraining.updates) | train-step calls |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, row in summary.items():
        for side in SIDES:
            if side not in row:
                continue
            sv, cl = row[side]["server"], row[side]["client"]
            accnt = sum(v for k, v in sv.items() if k.startswith("accountant."))
            rel = f"{sv['release']:.4f}" if "release" in sv else ""
            acs = f"{accnt:.4f}" if "release" in sv else ""
            lines.append(
                f"| {n} | {LABELS[side]} | {sv.get('configure_train', 0):.4f} | "
                f"{sv.get('aggregate_train', 0):.4f} | {rel} | {acs} | "
                f"{cl['client_s']:.3f} | {cl['train_s']:.3f} | {cl['train_calls']:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[16, 128], help="clients (10 users each)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per side (interleaved)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per repetition (1: warm-up)")
    ap.add_argument("--json", type=str, default=None, help="write every repetition and the summary")
    ap.add_argument("--markdown", type=str, default=None, help="write the Markdown tables")
    ap.add_argument(
        "--one",
        choices=SIDES,
        default=None,
        help="run one repetition in this process and print its JSON",
    )
    ap.add_argument(
        "--sides",
        nargs="+",
        choices=SIDES,
        default=list(SIDES),
        help="the sides, in each repetition's order (default: plain fast wrapped)",
    )
    ap.add_argument(
        "--profile-mod",
        action="store_true",
        help="no Ray: time and profile user_level_mod on one client in-process",
    )
    a = ap.parse_args()
    if a.profile_mod:
        import torch

        torch.set_num_threads(1)
        profile_mod(a.n[0])
        return
    if a.one:
        if len(a.n) != 1:
            raise SystemExit("--one takes a single --n")
        res = run_one(a.one, a.n[0], a.rounds)
        print(MARK + json.dumps(res), flush=True)
        return
    if a.rounds < 2:
        raise SystemExit("--rounds must be >= 2 (round 1 is the warm-up)")
    t0 = time.perf_counter()
    results = []
    for n in a.n:
        for rep in range(a.reps):
            for side in a.sides:
                r = measure(side, n, a.rounds)
                r["rep"] = rep
                results.append(r)
                if a.json:  # every repetition so far, should the run be cut short
                    Path(a.json + ".partial").parent.mkdir(parents=True, exist_ok=True)
                    Path(a.json + ".partial").write_text(json.dumps({"repetitions": results}))
                print(
                    f"n={n:<4} rep={rep} {side:<8} s/round {r['s_per_round']:.3f} "
                    f"CPU s/round {r['cpu_s_per_round']:.3f} "
                    f"(rounds {', '.join(f'{x:.2f}' for x in r['round_seconds'])}) "
                    f"wall {r['wall_s']:.1f} s load {r['load1_before']:.1f} "
                    f"peak RSS {r['peak_rss_mb']:.0f} MB "
                    f"PSS {r['peak_pss_mb']:.0f} MB ({r['peak_procs']} procs)",
                    flush=True,
                )
    summary = summarize(results)
    table = markdown(summary)
    total = time.perf_counter() - t0
    versions = sorted({r["fedudp_sources_sha1"] for r in results})
    if len(versions) > 1:
        print(
            f"\nWARNING: fedudp's sources changed during the run: {versions} (per repetition "
            "in the JSON)"
        )
    print()
    print(table)
    print(f"\ntotal wall time {total:.0f} s")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(
            json.dumps(
                {
                    "command": " ".join([Path(sys.executable).name] + sys.argv),
                    "cpus": os.cpu_count(),
                    "total_wall_s": total,
                    "fedudp_sources_sha1": sorted({r["fedudp_sources_sha1"] for r in results}),
                    "summary": {str(k): v for k, v in summary.items()},
                    "repetitions": results,
                },
                indent=1,
            )
        )
    if a.markdown:
        Path(a.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(a.markdown).write_text(table + "\n")


if __name__ == "__main__":
    main()
