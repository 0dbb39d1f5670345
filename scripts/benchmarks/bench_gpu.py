"""Benchmark: the local engine and a row estimator on the CPU against a CUDA device
(``engine_opts.device``; issue 40, "Device-agnostic engine").

One process, both sides, interleaved: after one warm-up of each side, rep 1 of the CPU side,
rep 1 of the CUDA side, rep 2 of the CPU side, ... (``--reps``, at least 5 for a committed
table). Reported per case and side: min and median seconds, the CPU/CUDA ratios of the mins and
of the medians, the peak memory of the side (CUDA: ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``; CPU: the process's ``VmHWM``, reset before each CPU repetition by
writing 5 to ``/proc/self/clear_refs`` where the kernel allows it, else the whole process's
high-water mark, said so in the output), and the largest difference between the two sides'
released means (float tolerance: the noise is the same draw on both sides, from the CPU
generator).

Cases (``--cases``, comma-separated):

* ``cnn512``: server placement, clip + Gaussian (``method=full_dp aggregator=gaussian``), the
  paper CNN (44,628 parameters) on ``--cnn-users`` (512) one-record users in 16 owners, every
  user sampled, one SGD step per user: one round = the owners' reply (``LocalTransport.train``)
  plus the billboard's release, evaluation excluded;
* ``mlp10k``: the same round on the 784-1024-256-10 MLP of ``bench_ghost.py`` (1,068,810
  parameters) at ``--mlp-users`` (10,000) one-record users;
* ``winsorized``: the winsorized estimator's release alone (``estimate``) on ``--rows-users``
  (60,000) i.i.d. Gaussian float32 rows of ``--rows-dim`` (28,938) coordinates with l2 norm about
  3.8 (as ``bench_rows.py``), built from plain values as ``method=joint_dp`` builds it (epsilon
  1, delta 1e-5, one round, bound 1). The rows live on each side's device (7 GB at the default
  size, on the GPU and in RAM): the rotation and the bins on the device, PrivateRange and the
  Laplace noise on the CPU. Not in the default ``--cases``: about a minute a repetition per side.

The records are random MNIST-shaped features (``dataset.name=synthetic``, 784 features): the
cost of a round does not depend on their values. CUDA timings synchronize the device before the
clock is read. With no CUDA device the script prints one line and exits 2 (it never reports a
CPU-only table as a comparison).

    .venv/bin/python scripts/benchmarks/bench_gpu.py --reps 5 \\
        --json docs/results/gpu/bench.json --md docs/results/gpu/bench.md
    .venv/bin/python scripts/benchmarks/bench_gpu.py --cases winsorized --reps 5 ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

CASES = ("cnn512", "mlp10k", "winsorized")
DEFAULT_CASES = ("cnn512", "mlp10k")


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_hwm() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def make_model(name: str) -> Any:
    import torch.nn as nn

    if name == "mlp":  # bench_ghost.py's 1,068,810-parameter MLP
        return nn.Sequential(
            nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10)
        )
    from fedudp.models.cnn import PaperCNN

    return nn.Sequential(nn.Unflatten(1, (1, 28, 28)), PaperCNN())


def round_side(model_name: str, users: int, device: str, seed: int) -> Callable[[int], Any]:
    """One prepared server-placement run on ``device``; returns ``step(r)``: round r's reply and
    release (what a round of the local engine computes, evaluation excluded), the release."""
    import numpy as np
    import torch

    from fedudp.protocol.contributions import current_constraint
    from fedudp.build import prepare
    from fedudp.config import RunConfig
    from fedudp.engines.local import LocalTransport

    torch.manual_seed(seed)
    cfg = RunConfig()
    cfg.progress = False
    cfg.seed = seed
    cfg.method = "full_dp"
    cfg.aggregator = "gaussian"
    cfg.privacy.placement = "server"
    cfg.privacy.clip = 1.0
    cfg.privacy.noise_multiplier = 1.0
    cfg.privacy.epsilon = 1e6  # never the budget that stops
    cfg.dataset.features = 784
    cfg.dataset.num_records = users
    cfg.dataset.pool_train = 3 * users + 2000  # the paper partition draws classes from a pool
    cfg.dataset.pool_test = 100
    cfg.partition.num_owners = 16
    cfg.partition.records_per_user = 1
    cfg.train.rounds = 1000
    cfg.train.lr = 0.05
    cfg.train.batch_size = 32
    cfg.train.local_epochs = 1
    cfg.train.sampling_rate = 1.0
    cfg.checkpoint.every = 0
    cfg.engine_opts.device = device
    p = prepare(cfg, model_object=make_model(model_name))
    bb, agg = p.billboard, p.aggregator
    assert bb is not None and agg is not None
    transport = LocalTransport(p.owners, p.fed, lambda: agg.constraint)
    assert current_constraint(transport.constraint) is not None
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def step(r: int) -> Any:
        cohort = np.flatnonzero(bb.sample(r))
        got = transport.train(bb.shared_params(), cohort, r)
        out = bb.release(got.replies, r)
        sync()
        return out.mean

    return step


def winsorized_side(users: int, dim: int, device: str, seed: int) -> Callable[[int], Any]:
    """The winsorized release alone on ``users`` x ``dim`` i.i.d. float32 rows on ``device``."""
    import torch

    from fedudp.protocol.contributions import Sampling
    from fedudp.aggregators.winsorized import WinsorizedAggregator

    g = torch.Generator().manual_seed(seed)
    G = torch.empty(users, dim, dtype=torch.float32, device=device)
    for s in range(0, users, 2048):  # made in CPU blocks (the same rows on both sides)
        e = min(users, s + 2048)
        G[s:e] = (torch.randn(e - s, dim, generator=g) * (3.8 / dim**0.5)).to(device)
    common = dict(epsilon=1.0, delta=1e-5, rounds=1, bound=1.0, records_per_unit=1)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def step(r: int) -> Any:
        agg = WinsorizedAggregator.calibrated(dim=dim, sampling=Sampling(1.0, users), **common)
        out = agg.estimate(G, rng=torch.Generator().manual_seed(2026))
        sync()
        return out.mean

    return step


def measure(case: str, args: argparse.Namespace, cuda: str) -> dict:
    import torch

    sides: dict[str, Callable[[int], Any]] = {}
    for dev in ("cpu", cuda):
        if case == "winsorized":
            sides[dev] = winsorized_side(args.rows_users, args.rows_dim, dev, args.seed)
        elif case == "cnn512":
            sides[dev] = round_side("cnn", args.cnn_users, dev, args.seed)
        else:
            sides[dev] = round_side("mlp", args.mlp_users, dev, args.seed)
    times: dict[str, list[float]] = {d: [] for d in sides}
    peak: dict[str, int] = {d: 0 for d in sides}
    hwm_reset = True
    means: dict[str, Any] = {}
    for r in range(args.reps + 1):  # r = 0: the warm-up of each side, not timed
        for dev, step in sides.items():
            if dev == "cpu":
                hwm_reset = _reset_hwm() and hwm_reset
            else:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            mean = step(r + 1)
            dt = time.perf_counter() - t0
            if r == 0:
                means[dev] = mean.detach().double().cpu()  # round 1 on both sides
                continue
            times[dev].append(dt)
            used = _kib("VmHWM") * 1024 if dev == "cpu" else torch.cuda.max_memory_allocated()
            peak[dev] = max(peak[dev], int(used))
            print(f"  {case} {dev} rep {r}: {dt:.3f} s", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"case": case, "sides": {}}
    for dev in sides:
        ts = times[dev]
        out["sides"][dev] = {
            "times_s": ts,
            "min_s": min(ts),
            "median_s": statistics.median(ts),
            "peak_bytes": peak[dev],
        }
    c, g = out["sides"]["cpu"], out["sides"][cuda]
    out["cpu_over_cuda_min"] = c["min_s"] / g["min_s"]
    out["cpu_over_cuda_median"] = c["median_s"] / g["median_s"]
    out["max_abs_diff_round1"] = float((means["cpu"] - means[cuda]).abs().max())
    out["cpu_peak_is_whole_process"] = not hwm_reset
    return out


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [
        f"CPU ({m['cpu']}, {m['torch_threads']} torch threads) against {m['cuda_device']} "
        f"(torch {m['torch']}, CUDA {m['cuda']}), {m['reps']} interleaved repetitions after one "
        f"warm-up each, commit {m['commit']}.",
        "",
        "| case | side | min s | median s | peak memory | CPU/CUDA (min) | CPU/CUDA (median) "
        "| max abs diff, round 1 |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in res["cases"]:
        for dev, s in c["sides"].items():
            what = "RSS HWM" if dev == "cpu" else "CUDA max allocated"
            if dev == "cpu" and c["cpu_peak_is_whole_process"]:
                what += " (whole process)"
            ratio = dev != "cpu"
            lines.append(
                f"| {c['case']} | {dev} | {s['min_s']:.3f} | {s['median_s']:.3f} | "
                f"{s['peak_bytes'] / 2**30:.2f} GiB {what} | "
                + (f"{c['cpu_over_cuda_min']:.2f}x | " if ratio else " | ")
                + (f"{c['cpu_over_cuda_median']:.2f}x | " if ratio else " | ")
                + (f"{c['max_abs_diff_round1']:.3g} |" if ratio else " |")
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"of {', '.join(CASES)}")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="the CUDA side (cuda or cuda:N)")
    ap.add_argument("--threads", type=int, default=0, help="CPU torch threads (0: default)")
    ap.add_argument("--cnn-users", type=int, default=512)
    ap.add_argument("--mlp-users", type=int, default=10000)
    ap.add_argument("--rows-users", type=int, default=60000)
    ap.add_argument("--rows-dim", type=int, default=28938)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--md", type=Path, help="write the Markdown table here")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        ap.error(f"--cases {args.cases}: expected a comma-separated list of {', '.join(CASES)}")
    if args.reps < 1:
        ap.error(f"--reps {args.reps}: need at least 1 (5 for a committed table)")
    import torch

    if not torch.cuda.is_available():
        print(
            f"no CUDA device: torch {torch.__version__} sees none (torch.cuda.is_available() "
            "is False); this benchmark compares the CPU with a CUDA device in one process",
            flush=True,
        )
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = "unknown"
    t0 = time.perf_counter()
    results = [measure(c, args, args.device) for c in cases]
    res = {
        "meta": {
            "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
            "commit": commit,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cuda_device": torch.cuda.get_device_name(torch.device(args.device)),
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "reps": args.reps,
            "wall_s": time.perf_counter() - t0,
        },
        "cases": results,
    }
    table = markdown(res)
    print(table, end="")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
