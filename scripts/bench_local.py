"""Benchmark: ``engine=local`` per round vs a plain single-process PyTorch loop (issue 2).

Workload (``../shared/bench-reference/README.md``): FedAvg, every owner participating, one user
per owner (``partition.records_per_user`` >= the owner's size), the local delta after one epoch
of minibatch SGD at batch 32 and lr 0.05, the paper CNN (``model.name=cnn``), 10,000
MNIST-shaped training records split over ``n`` owners (paper split, sizes floor/ceil(N/n)).

* ``local``: ``fedudp.run.run`` with ``engine=local`` (owners batched with ``torch.func``,
  ``engine_opts.chunk_records`` records per vmapped chunk); per-round seconds as the engine
  reports them in ``metrics.jsonl`` (evaluation only after the last round, which is not timed).
* ``plain``: this script's own loop: owners one after another, each loads the global weights
  into a ``PaperCNN``, runs one epoch of ``torch.optim.SGD`` over its records in the same batch
  order (the per-owner public keys ``default_rng([seed, 1, round, epoch, owner])``, sorted),
  and the global model moves by the mean of the owners' deltas (fedavg, server_lr 1).

Both run in this one process on the same data, one after the other per ``n`` (machines are
noisy: compare within a run). Reported: the median of rounds 2..3 per-round wall time. After
the timed rounds the two final global models are compared (they do the same arithmetic up to
float32 summation order; a large gap would mean the loop is not doing the same work).

Data: real MNIST from ``--data-root`` (``<root>/mnist/*-idx?-ubyte[.gz]``) when present, else
synthetic MNIST-shaped data generated here (smooth per-class patterns + Gaussian noise, as in
the reference workload), written as IDX files to a temporary folder and read through the same
``dataset.name=mnist`` path.

    .venv/bin/python scripts/bench_local.py                    # n = 16 128 512
    .venv/bin/python scripts/bench_local.py --n 512 --chunk-records 1024 2048 8192
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

N_RECORDS = 10_000
LR, BATCH, EPOCHS = 0.05, 32, 1
PURPOSE_USER_ORDER = 1          # fedudp.core.owner's purpose tag for users' batch orders


# -- data --------------------------------------------------------------------------------------
def _has_mnist(root: Path) -> bool:
    stems = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    return all(any((d / (s + ext)).exists() for d in (root / "mnist", root) for ext in (".gz", ""))
               for s in stems)


def _write_idx(path: Path, arr: np.ndarray) -> None:
    head = struct.pack(">II", 2051, arr.shape[0]) + struct.pack(">II", *arr.shape[1:]) \
        if arr.ndim == 3 else struct.pack(">II", 2049, arr.shape[0])
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(head + arr.astype(np.uint8).tobytes())


def synthetic_mnist(root: Path, n_train: int = 20_000, n_test: int = 10_000, seed: int = 1234,
                    amp: float = 0.4) -> Path:
    """MNIST-shaped IDX files: per-class smooth patterns (5x5 box blur of noise, unit std)
    times ``amp`` plus N(0,1) noise, mapped to uint8 -- learnable, not trivially separable."""
    rng = np.random.default_rng(seed)
    raw = rng.standard_normal((10, 28, 28)).astype(np.float32)
    pad = np.pad(raw, ((0, 0), (2, 2), (2, 2)), mode="wrap")
    mu = sum(pad[:, dy:dy + 28, dx:dx + 28] for dy in range(5) for dx in range(5))
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
    cfg.partition.records_per_user = N_RECORDS        # >= any owner's size: one user per owner
    cfg.train.rounds = rounds
    cfg.train.lr = LR
    cfg.train.batch_size = BATCH
    cfg.train.local_epochs = EPOCHS
    cfg.train.sampling_rate = 1.0
    cfg.train.eval_every = 10 ** 6                     # evaluate after the last round only
    cfg.engine_opts.threads = threads
    if chunk_records is not None:
        cfg.engine_opts.chunk_records = chunk_records
    return cfg


# -- engine=local ------------------------------------------------------------------------------
def run_local(cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    from fedudp.engines import local as L
    from fedudp.run import run
    captured: dict = {}
    orig = L.LocalEngine.run

    def spy(self, *a, **k):            # keep the final global model for the cross-check
        res = orig(self, *a, **k)
        captured["shared"] = {k2: v.detach().clone() for k2, v in res.shared.items()}
        return res

    L.LocalEngine.run = spy
    try:
        with tempfile.TemporaryDirectory(prefix="bench_local_") as d:
            run(cfg, d)
            rows = [json.loads(line) for line in open(Path(d) / "metrics.jsonl")]
    finally:
        L.LocalEngine.run = orig
    return [r["seconds"] for r in rows], captured["shared"]


# -- the plain loop ----------------------------------------------------------------------------
def run_plain(cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    from fedudp.data.federation import build_federation
    from fedudp.models import build_model
    fed = build_federation(cfg)
    assert fed.num_users == fed.num_owners, "expected one user per owner"
    net = build_model(cfg, fed.input_shape, fed.num_classes)     # same seeded initialization
    glob = {k: v.detach().clone() for k, v in net.state_dict().items()}
    owners = [fed.owner(j) for j in range(fed.num_owners)]
    seconds = []
    for r in range(1, cfg.train.rounds + 1):
        t0 = time.perf_counter()
        delta_sum = {k: torch.zeros_like(v) for k, v in glob.items()}
        for od in owners:
            net.load_state_dict(glob)
            net.train()
            opt = torch.optim.SGD(net.parameters(), lr=cfg.train.lr)
            m = int(od.x.shape[0])
            for e in range(cfg.train.local_epochs):
                keys = np.random.default_rng([cfg.seed, PURPOSE_USER_ORDER, r, e, od.owner]).random(m)
                perm = torch.from_numpy(np.argsort(keys, kind="stable"))
                for s in range(0, m, cfg.train.batch_size):
                    idx = perm[s:s + cfg.train.batch_size]
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(net(od.x[idx]), od.y[idx]).backward()
                    opt.step()
            with torch.no_grad():
                for k, v in net.state_dict().items():
                    delta_sum[k] += v - glob[k]
        glob = {k: glob[k] + delta_sum[k] / len(owners) for k in glob}
        seconds.append(time.perf_counter() - t0)
    return seconds, glob


def median_23(sec: list[float]) -> float:
    return statistics.median(sec[1:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--rounds", type=int, default=4,
                    help="rounds per run (>= 3; median of rounds 2..3; the last one also evaluates)")
    ap.add_argument("--data-root", default="/work/shared/data")
    ap.add_argument("--chunk-records", type=int, nargs="+", default=[None],
                    help="engine_opts.chunk_records values to time (default: the config default)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    if a.rounds < 3:
        raise SystemExit("--rounds must be >= 3")
    from fedudp.config import EngineConfig
    from fedudp.engines.local import AUTO_CHUNK_CONV

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
    print(f"data: {data}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"model cnn, fedavg, 1 user/owner, E={EPOCHS}, batch {BATCH}, lr {LR}; "
          f"median of rounds 2-3", flush=True)

    results = []
    for n in a.n:
        for ck in a.chunk_records:
            cfg = make_cfg(n, a.rounds, str(root), ck, a.threads)
            chunk = cfg.engine_opts.chunk_records
            t_local, w_local = run_local(cfg)
            t_plain, w_plain = run_plain(make_cfg(n, a.rounds, str(root), ck, a.threads))
            diff = max(float((w_local[k] - w_plain[k]).abs().max()) for k in w_plain)
            scale = max(float(w_plain[k].abs().max()) for k in w_plain)
            row = {"n": n, "chunk_records": chunk, "local_s": median_23(t_local),
                   "plain_s": median_23(t_plain), "local_rounds": t_local, "plain_rounds": t_plain,
                   "max_abs_param_diff": diff, "max_abs_param": scale}
            row["ratio"] = row["local_s"] / row["plain_s"]
            results.append(row)
            print(f"  n={n} chunk_records={chunk}: local {[f'{s:.2f}' for s in t_local]} "
                  f"plain {[f'{s:.2f}' for s in t_plain]}  |w_local - w_plain|max={diff:.2e}",
                  flush=True)

    print()
    print("| n | chunk_records | local engine s/round | plain loop s/round | ratio local/plain |")
    print("|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['n']} | {r['chunk_records']} | {r['local_s']:.2f} | {r['plain_s']:.2f} "
              f"| {r['ratio']:.2f} |")
    print(f"\n(default engine_opts.chunk_records = {EngineConfig().chunk_records}: auto, "
          f"{AUTO_CHUNK_CONV} for models with convolutions)")
    if a.json:
        Path(a.json).write_text(json.dumps({"data": data, "results": results}, indent=2))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
