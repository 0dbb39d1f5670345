"""Benchmark: owner-side DP-SGD (``privacy.placement=local_dpsgd``) vs a plain loop.

What bounds a Huang Table 1 run (``+experiment=huang_table1``): every run computes about
E·T·N per-record gradients of the paper CNN (N = 10,000 records; E·T = 100 epochs, 200 at n = 4),
DP-SGD per-user (here per-record: one record per user) gradients included. This script times
one DP-SGD epoch of all owners, both sides in one process, interleaved, ``--reps`` times each:

* ``fedudp``: ``Owners.owner_deltas`` of the run's own owner component (owner by owner, one
  batched forward/backward with exact per-record gradients, ``fedudp.owner.per_sample``; clip
  norms in float64; keyed Poisson sampling and noise; each owner's noisy step in place), exactly
  what a round of ``method=full_dp privacy.placement=local_dpsgd`` calls;
* ``plain``: this script's own DP-SGD in plain PyTorch + ``torch.func``, owners one after
  another: per step, the Poisson-sampled users' per-sample gradients with
  ``vmap(grad(loss), in_dims=(None, 0, 0))`` (the standard per-sample recipe, parameters not
  batched), clip at C with float64 norms, sum, Gaussian noise z·C, divide by B, SGD step;
* ``sgd``: plain non-private minibatch SGD over the same records (batch 32, owners one after
  another): the floor set by the CNN's forward/backward on this CPU.

Reported per side: per-record gradients per second (min and median seconds over the reps), the
ratio fedudp/plain, and the projected compute of the one-seed MNIST Table 1 grid (24 runs) at
the measured fedudp rate on 1 and 2 cores.

    # DATA: the folder holding mnist/ and fashion_mnist/ IDX files (or set FEDUDP_DATA instead)
    OMP_NUM_THREADS=1 .venv/bin/python scripts/benchmarks/bench_dpsgd.py --data-root DATA --n 64 256 --reps 5 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Table 1 (Huang et al. Table 3's E and T): epochs over the N records per run, by n
EPOCHS_PER_RUN = {4: 200, 16: 100, 64: 100, 128: 100, 256: 100, 512: 100}


def prepared(n: int, data_root: str, threads: int):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from fedudp.config import register
    from fedudp.cli import CONF_DIR
    from fedudp.run import prepare

    register()
    args = [
        "+experiment=huang_table1",
        f"dataset.root={data_root}",
        "progress=false",
        f"engine_opts.threads={threads}",
        f"partition.num_owners={n}",
        "method=full_dp",
        "train.local_epochs=1",
        "privacy.noise_multiplier=5.0",
        "checkpoint.every=0",
    ]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="config", overrides=args))
    return prepare(cfg)


def expected_gradients(p) -> int:
    """Per-user gradients in one DP-SGD epoch, in expectation: ceil(m_j/B) steps of
    min(B, m_j) sampled users per owner (more than m_j when B does not divide m_j)."""
    return int(
        sum(
            c * -(-m // p.cfg.train.batch_size) * min(p.cfg.train.batch_size, m)
            for m, c, _, _ in p.aggregator.classes
        )
    )


def fedudp_epoch(p, round_: int) -> int:
    """One DP-SGD epoch of every owner through the owner component."""
    fed = p.fed
    owners = np.arange(fed.num_owners)
    p.owners.owner_deltas(
        fed, p.billboard.shared_params(), {}, owners, round_, p.aggregator.constraint
    )
    return expected_gradients(p)


class Plain:
    """DP-SGD and SGD in plain PyTorch, owners one after another (see the module docstring)."""

    def __init__(self, p) -> None:
        from torch.func import functional_call, grad, vmap

        self.fed, self.model = p.fed, p.owners.model
        self.shared = p.billboard.shared_params()
        con = p.aggregator.constraint
        self.z, self.C = float(con.dpsgd_noise), float(con.dpsgd_clip)
        self.B, self.lr = p.cfg.train.batch_size, p.cfg.train.lr
        model = self.model

        def loss(params, x, y):
            return F.cross_entropy(functional_call(model, params, (x[None],)), y[None])

        self.per_sample = vmap(grad(loss), in_dims=(None, 0, 0))

    def dpsgd_epoch(self, round_: int) -> int:
        fed, rng, done = self.fed, np.random.default_rng(round_), 0
        for j in range(fed.num_owners):
            lo, hi = int(fed.owner_offsets[j]), int(fed.owner_offsets[j + 1])
            m = hi - lo
            q = min(self.B, m) / m
            params = {k: v.clone() for k, v in self.shared.items()}
            for _ in range(-(-m // self.B)):
                idx = lo + np.flatnonzero(rng.random(m) < q)
                if len(idx) == 0:
                    continue
                g = self.per_sample(params, self.fed.x[idx], self.fed.y[idx])
                flat = torch.cat([g[k].reshape(len(idx), -1) for k in params], 1)
                a = flat.numpy()
                norms = np.sqrt(np.einsum("ij,ij->i", a, a, dtype=np.float64))
                scale = torch.from_numpy(
                    np.minimum(1.0, self.C / np.maximum(norms, 1e-300))
                ).float()
                s = (flat * scale[:, None]).sum(0).double()
                s += self.z * self.C * torch.randn(s.shape, dtype=torch.float64)
                step = (s / (q * m)).float()
                i = 0
                for k, v in params.items():
                    params[k] = v - self.lr * step[i : i + v.numel()].reshape(v.shape)
                    i += v.numel()
                done += len(idx)
        return done

    def sgd_epoch(self, round_: int) -> int:
        fed = self.fed
        net = self.model
        with torch.enable_grad():
            for p_ in net.parameters():
                p_.requires_grad_(True)
            opt = torch.optim.SGD(net.parameters(), lr=self.lr)
            for j in range(fed.num_owners):
                lo, hi = int(fed.owner_offsets[j]), int(fed.owner_offsets[j + 1])
                perm = lo + np.random.default_rng(round_ * 1000 + j).permutation(hi - lo)
                for s in range(0, len(perm), self.B):
                    b = perm[s : s + self.B]
                    opt.zero_grad()
                    F.cross_entropy(net(fed.x[b]), fed.y[b]).backward()
                    opt.step()
            for p_ in net.parameters():
                p_.requires_grad_(False)
        return int(hi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--data-root",
        default=os.environ.get("FEDUDP_DATA"),
        help="folder holding the IDX files (<root>/mnist/, <root>/fashion_mnist/); default: $FEDUDP_DATA",
    )
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    if not a.data_root:
        raise SystemExit(
            "bench_dpsgd.py: error: --data-root <folder with the MNIST IDX files> is "
            "required (or set FEDUDP_DATA)"
        )
    torch.set_num_threads(a.threads)
    out = {}
    for n in a.n:
        p = prepared(n, a.data_root, a.threads)
        plain = Plain(p)
        fedudp_epoch(p, 0)  # warm-up (vmap tracing, allocator)
        plain.dpsgd_epoch(0)
        t = {"fedudp": [], "plain_dpsgd": [], "plain_sgd": []}
        grads = {}
        for r in range(1, a.reps + 1):  # interleaved: both sides see the same machine
            for side, f in (
                ("fedudp", lambda: fedudp_epoch(p, r)),
                ("plain_dpsgd", lambda: plain.dpsgd_epoch(r)),
                ("plain_sgd", lambda: plain.sgd_epoch(r)),
            ):
                t0 = time.perf_counter()
                grads[side] = f()
                t[side].append(time.perf_counter() - t0)
        N = int(p.fed.num_users)
        count = {
            "fedudp": expected_gradients(p),
            "plain_dpsgd": expected_gradients(p),
            "plain_sgd": N,
        }
        row = {
            side: {
                "min_s": min(v),
                "median_s": statistics.median(v),
                "gradients": count[side],
                "grads_per_s_median": count[side] / statistics.median(v),
            }
            for side, v in t.items()
        }
        row["ratio_fedudp_over_plain_dpsgd_median"] = (
            row["fedudp"]["median_s"] / row["plain_dpsgd"]["median_s"]
        )
        row["ratio_per_gradient_fedudp_over_plain_sgd"] = (
            row["plain_sgd"]["grads_per_s_median"] / row["fedudp"]["grads_per_s_median"]
        )
        out[n] = row
        print(
            f"n={n}: one DP-SGD epoch over {N} records ({count['fedudp']} per-user gradients in "
            f"expectation), {a.reps} reps, {a.threads} thread(s)"
        )
        for side in t:
            print(
                f"  {side:12s} min {row[side]['min_s']:.2f} s  median {row[side]['median_s']:.2f} s"
                f"  ({row[side]['grads_per_s_median']:.0f} gradients/s)"
            )
        print(
            f"  fedudp / plain DP-SGD: {row['ratio_fedudp_over_plain_dpsgd_median']:.2f}x   "
            f"per gradient, fedudp DP-SGD / plain SGD: {row['ratio_per_gradient_fedudp_over_plain_sgd']:.2f}x",
            flush=True,
        )
    dp_rate = statistics.median(r["fedudp"]["grads_per_s_median"] for r in out.values())
    sgd_rate = statistics.median(r["plain_sgd"]["grads_per_s_median"] for r in out.values())
    from fedudp.data.partition import owner_sizes

    per_method = sum(e * 10_000 for e in EPOCHS_PER_RUN.values())  # per-silo, FedAvg
    dp = sum(
        e * sum(-(-int(m) // 32) * min(32, int(m)) for m in owner_sizes(10_000, n))
        for n, e in EPOCHS_PER_RUN.items()
    )  # DP-SGD, per DP method
    sec = 2 * per_method / sgd_rate + 2 * dp / dp_rate
    proj = {
        "gradients": 2 * per_method + 2 * dp,
        "dp_rate": dp_rate,
        "sgd_rate": sgd_rate,
        "hours_one_core": sec / 3600,
        "hours_two_cores": sec / 3600 / 2,
    }
    print(
        f"Table 1 grid, one seed (24 runs): {proj['gradients'] / 1e6:.0f}M gradients; per-silo and "
        f"FedAvg at plain SGD's {sgd_rate:.0f}/s (bench_local.py: the engine is within a few % "
        f"of it), the DP runs at {dp_rate:.0f}/s: {proj['hours_one_core']:.1f} h on one core, "
        f"{proj['hours_two_cores']:.1f} h on two (one run per core)"
    )
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {"per_n": out, "projection": proj, "threads": a.threads, "reps": a.reps}, indent=1
            )
        )


if __name__ == "__main__":
    main()
