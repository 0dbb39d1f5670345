"""Benchmark: ``engine=local`` per round vs a plain single-process PyTorch loop.

Workload (the reference workload the local engine is measured against): FedAvg, every owner participating, one user
per owner (``partition.records_per_user`` >= the owner's size), the local delta after one epoch
of minibatch SGD at batch 32 and lr 0.05, the paper CNN (``model.name=cnn``), 10,000
MNIST-shaped training records split over ``n`` owners (paper split, sizes floor/ceil(N/n)).

* ``local``: fedudp's own round loop (``fedudp.billboard.rounds.run_rounds`` on the local engine,
  owners in chunks of ``engine_opts.chunk_records`` records, each owner's SGD run with ordinary
  autograd one owner after another, or vmapped with ``torch.func`` where steps are small, see
  ``--loop-min-records``); its per-round seconds as the loop reports them (evaluation only after
  the last round, not used).
* ``plain``: this script's own loop: owners one after another, each loads the global weights
  into a ``PaperCNN``, runs one epoch of ``torch.optim.SGD`` over its records in the same batch
  order (the per-owner public keys of ``Purpose.OWNER_ORDER``, as standard FedAvg, sorted), and the global model
  moves by the mean of the owners' deltas (fedavg, server_lr 1).

Interleaved in one process: after each fedudp round (the loop's ``on_round`` hook) the plain
loop runs its own round of the same number, so both sides see the same machine state. Round 1
(warm-up) and the last round (evaluation) are not counted; reported: min and median of the
rest (``--rounds 7``: five rounds per side). After the run the two final global models are
compared (same arithmetic up to float32 summation order).

Paths (``--loop-min-records``): ``fedudp.owner.local_sgd`` trains a unit (here an owner) one after
another with ordinary autograd when its steps hold ``LOOP_MIN_RECORDS`` records or more on
average, vmapped otherwise; ``--loop-min-records 1000000`` times the all-vmapped path (the
engine before issue 25) in the same checkout. Peak memory: the process's maximum resident set
size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) after each run, both sides together and
cumulative over the runs of one invocation (run one ``--n`` per invocation to attribute it).

Data: real MNIST from ``--data-root`` (required, or the environment variable ``FEDUDP_DATA``;
``<root>/mnist/*-idx?-ubyte[.gz]``) when present there, else synthetic MNIST-shaped data generated
here (smooth per-class patterns + Gaussian noise, as in the reference workload), written as IDX
files to a temporary folder and read through the same ``dataset.name=mnist`` path.

    .venv/bin/python scripts/benchmarks/bench_local.py --data-root DATA            # n = 16 128 512
    .venv/bin/python scripts/benchmarks/bench_local.py --data-root DATA --n 512 --chunk-records 1024 2048 8192
    .venv/bin/python scripts/benchmarks/bench_local.py --data-root DATA --n 128 --loop-min-records 8 1000000
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import resource
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

N_RECORDS = 10_000
LR, BATCH, EPOCHS = 0.05, 32, 1


# -- data --------------------------------------------------------------------------------------
def _has_mnist(root: Path) -> bool:
    stems = [
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ]
    return all(
        any((d / (s + ext)).exists() for d in (root / "mnist", root) for ext in (".gz", ""))
        for s in stems
    )


def _write_idx(path: Path, arr: np.ndarray) -> None:
    head = (
        struct.pack(">II", 2051, arr.shape[0]) + struct.pack(">II", *arr.shape[1:])
        if arr.ndim == 3
        else struct.pack(">II", 2049, arr.shape[0])
    )
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(head + arr.astype(np.uint8).tobytes())


def synthetic_mnist(
    root: Path, n_train: int = 20_000, n_test: int = 10_000, seed: int = 1234, amp: float = 0.4
) -> Path:
    """MNIST-shaped IDX files: per-class smooth patterns (5x5 box blur of noise, unit std)
    times ``amp`` plus N(0,1) noise, mapped to uint8 -- learnable, not trivially separable."""
    rng = np.random.default_rng(seed)
    raw = rng.standard_normal((10, 28, 28)).astype(np.float32)
    pad = np.pad(raw, ((0, 0), (2, 2), (2, 2)), mode="wrap")
    mu = sum(pad[:, dy : dy + 28, dx : dx + 28] for dy in range(5) for dx in range(5))
    mu /= mu.std(axis=(1, 2), keepdims=True)

    def make(m: int, r: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        y = r.integers(0, 10, size=m)
        x = amp * mu[y] + r.standard_normal((m, 28, 28), dtype=np.float32)
        return np.clip(np.round(128 + 40 * x), 0, 255).astype(np.uint8), y.astype(np.uint8)

    d = root / "mnist"
    d.mkdir(parents=True, exist_ok=True)
    tx, ty = make(n_train, np.random.default_rng([seed, 1]))
    vx, vy = make(n_test, np.random.default_rng([seed, 2]))
    _write_idx(d / "train-images-idx3-ubyte.gz", tx)
    _write_idx(d / "train-labels-idx1-ubyte.gz", ty)
    _write_idx(d / "t10k-images-idx3-ubyte.gz", vx)
    _write_idx(d / "t10k-labels-idx1-ubyte.gz", vy)
    return root


# -- config ------------------------------------------------------------------------------------
def make_cfg(n: int, rounds: int, data_root: str, chunk_records: int | None, threads: int):
    from fedudp.config import RunConfig

    cfg = RunConfig()
    cfg.progress = False
    cfg.method = "fedavg"
    cfg.engine = "local"
    cfg.dataset.name = "mnist"
    cfg.dataset.root = data_root
    cfg.dataset.num_records = N_RECORDS
    cfg.model.name = "cnn"
    cfg.partition.num_owners = n
    cfg.partition.records_per_user = N_RECORDS  # >= any owner's size: one user per owner
    cfg.train.rounds = rounds
    cfg.train.lr = LR
    cfg.train.batch_size = BATCH
    cfg.train.local_epochs = EPOCHS
    cfg.train.sampling_rate = 1.0
    cfg.train.eval_every = 10**6  # evaluate after the last round only
    cfg.engine_opts.threads = threads
    if chunk_records is not None:
        cfg.engine_opts.chunk_records = chunk_records
    return cfg


# -- the plain loop ----------------------------------------------------------------------------
class PlainLoop:
    """FedAvg in plain PyTorch: owners one after another, same data, init and batch orders."""

    def __init__(self, cfg) -> None:
        from fedudp import build

        fed = build.federation(cfg)
        assert fed.num_users == fed.num_owners, "expected one user per owner"
        self.cfg = cfg
        self.net = build.model(cfg).requires_grad_(True)  # same seeded init
        self.glob = {k: v.detach().clone() for k, v in self.net.state_dict().items()}
        self.owners = [fed.owner(j) for j in range(fed.num_owners)]

    def round(self, r: int) -> float:
        from fedudp.randomness import Purpose, numpy_rng

        cfg, net, glob = self.cfg, self.net, self.glob
        t0 = time.perf_counter()
        delta_sum = {k: torch.zeros_like(v) for k, v in glob.items()}
        for od in self.owners:
            net.load_state_dict(glob)
            net.train()
            opt = torch.optim.SGD(net.parameters(), lr=cfg.train.lr)
            m = int(od.x.shape[0])
            for e in range(cfg.train.local_epochs):
                keys = numpy_rng(cfg.seed, Purpose.OWNER_ORDER, r, e, int(od.owner_ids[0])).random(
                    m
                )
                perm = torch.from_numpy(np.argsort(keys, kind="stable"))
                for s in range(0, m, cfg.train.batch_size):
                    idx = perm[s : s + cfg.train.batch_size]
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(net(od.x[idx]), od.y[idx]).backward()
                    opt.step()
            with torch.no_grad():
                for k, v in net.state_dict().items():
                    delta_sum[k] += v - glob[k]
        self.glob = {k: glob[k] + delta_sum[k] / len(self.owners) for k in glob}
        return time.perf_counter() - t0


# -- both, interleaved ---------------------------------------------------------------------------
def run_interleaved(cfg) -> tuple[list[float], list[float], float, float]:
    """(local seconds per round, plain seconds per round, max |w_local - w_plain|, max |w|)."""
    from fedudp.run import execute, prepare

    plain = PlainLoop(cfg)
    p = prepare(cfg)
    t_plain: list[float] = []
    t_local: list[float] = []

    def on_round(info: dict) -> None:
        t_local.append(info["seconds"])
        t_plain.append(plain.round(info["round"]))

    res = execute(p, on_round)
    diff = max(float((res.shared[k] - plain.glob[k]).abs().max()) for k in plain.glob)
    scale = max(float(plain.glob[k].abs().max()) for k in plain.glob)
    return t_local, t_plain, diff, scale


def counted(sec: list[float]) -> list[float]:
    """Rounds 2 .. R-1: no warm-up, no evaluation."""
    return sec[1:-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument(
        "--rounds",
        type=int,
        default=7,
        help="rounds per run (>= 7: rounds 2..R-1 counted, at least five per side)",
    )
    ap.add_argument(
        "--data-root",
        default=os.environ.get("FEDUDP_DATA"),
        help="folder holding <root>/mnist/ IDX files (one without them: synthetic "
        "MNIST-shaped data); default: $FEDUDP_DATA",
    )
    ap.add_argument(
        "--chunk-records",
        type=int,
        nargs="+",
        default=[None],
        help="engine_opts.chunk_records values to time (default: the config default)",
    )
    ap.add_argument(
        "--loop-min-records",
        type=int,
        nargs="+",
        default=[None],
        help="fedudp.owner.local_sgd.LOOP_MIN_RECORDS values to time (default: the "
        "module's; 1000000: every unit vmapped)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    if not a.data_root:
        raise SystemExit(
            "bench_local.py: error: --data-root <folder with the MNIST IDX files> is "
            "required (or set FEDUDP_DATA)"
        )
    if a.rounds < 7:
        raise SystemExit("--rounds must be >= 7 (five counted rounds per side)")
    from fedudp.config import EngineConfig
    from fedudp.owner import local_sgd
    from fedudp.owner.local_sgd import AUTO_CHUNK_CONV

    default_loop_min = local_sgd.LOOP_MIN_RECORDS

    tmp = None
    root = Path(a.data_root)
    if _has_mnist(root):
        data = f"MNIST from {root}"
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_mnist_")
        root = synthetic_mnist(Path(tmp.name))
        data = f"synthetic MNIST-shaped data (no MNIST under {a.data_root})"
    if a.threads:
        torch.set_num_threads(a.threads)
    print(
        f"data: {data}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"model cnn, fedavg, 1 user/owner, E={EPOCHS}, batch {BATCH}, lr {LR}; "
        f"rounds 2..{a.rounds - 1} counted, local and plain interleaved",
        flush=True,
    )

    results = []
    for n, ck, lm in itertools.product(a.n, a.chunk_records, a.loop_min_records):
        local_sgd.LOOP_MIN_RECORDS = default_loop_min if lm is None else lm
        cfg = make_cfg(n, a.rounds, str(root), ck, a.threads)
        t_local, t_plain, diff, scale = run_interleaved(cfg)
        lo, pl = counted(t_local), counted(t_plain)
        ratios = [x / y for x, y in zip(lo, pl)]
        row = {
            "n": n,
            "chunk_records": cfg.engine_opts.chunk_records,
            "loop_min_records": local_sgd.LOOP_MIN_RECORDS,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "local_min": min(lo),
            "local_median": statistics.median(lo),
            "plain_min": min(pl),
            "plain_median": statistics.median(pl),
            "ratio_of_mins": min(lo) / min(pl),
            "ratio_of_medians": statistics.median(lo) / statistics.median(pl),
            "ratio_per_round_min": min(ratios),
            "ratio_per_round_median": statistics.median(ratios),
            "local_rounds": t_local,
            "plain_rounds": t_plain,
            "max_abs_param_diff": diff,
            "max_abs_param": scale,
        }
        results.append(row)
        print(
            f"  n={n} chunk_records={row['chunk_records']} loop_min_records="
            f"{row['loop_min_records']}: local {[f'{s:.2f}' for s in t_local]} "
            f"plain {[f'{s:.2f}' for s in t_plain]}  |w_local - w_plain|max={diff:.2e}  "
            f"peak RSS {row['peak_rss_mib']:.0f} MiB",
            flush=True,
        )
    local_sgd.LOOP_MIN_RECORDS = default_loop_min

    print()
    print(
        "| n | chunk_records | loop_min_records | local s/round min / median "
        "| plain s/round min / median | ratio of mins | ratio of medians "
        "| per-round ratio min / median | peak RSS MiB |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['n']} | {r['chunk_records']} | {r['loop_min_records']} "
            f"| {r['local_min']:.2f} / {r['local_median']:.2f} "
            f"| {r['plain_min']:.2f} / {r['plain_median']:.2f} | {r['ratio_of_mins']:.2f} "
            f"| {r['ratio_of_medians']:.2f} | {r['ratio_per_round_min']:.2f} / "
            f"{r['ratio_per_round_median']:.2f} | {r['peak_rss_mib']:.0f} |"
        )
    print(
        f"\n(default engine_opts.chunk_records = {EngineConfig().chunk_records}: auto, "
        f"{AUTO_CHUNK_CONV} for models with convolutions)"
    )
    if a.json:
        Path(a.json).write_text(json.dumps({"data": data, "results": results}, indent=2))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
