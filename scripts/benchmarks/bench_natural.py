"""Benchmark: owner-side cost per record of a natural federation (users of 1 to 500 records)
vs the planned one-record-per-user federation, on the same 10,000 records.

Workload: ``method=full_dp`` with the server placement (each sampled user's shared vector
clipped and summed by its owner, Gaussian noise on the billboard), the paper CNN
(``model.name=cnn``), 16 owners, ``train.sampling_rate=1`` (every user in every round),
``engine=local``, one torch thread. A user's vector is its local delta after one epoch of SGD
(batch 32, lr 0.05; ``train.shared_update=delta``) or its mean gradient
(``train.shared_update=gradient``).

* ``A``: the planned path, ``dataset.name=mnist``, ``dataset.num_records=10000``,
  ``partition.records_per_user=1``: 10,000 users of one record.
* ``B``: the same 10,000 records (A's training records, as A's federation holds them), dealt
  into natural users whose sizes are drawn log-uniformly in [1, --max-records] until they hold
  every record (the last user takes what is left), given in memory (``fedudp.from_arrays``,
  ``dataset.name=memory``, ``partition.owner_rule=random``, ``dataset.test_fraction=0``, the
  public numbers declared from the data), built by ``fedudp.build.prepare(cfg, records=...)``.

Variants of B that change nothing in fedudp (same users, same vectors up to float summation
order; the script checks the cohort sums agree):

Side names (``--plan``, the JSON, the table): ``A``, ``B``, ``B_sorted_owner``,
``B_sorted_cohort``, ``B_skip_done``:

* ``B sorted/owner``: a copy of B's federation with each owner's users laid out by size
  (ascending); what a data layout sorted by the user can get today.
* ``B sorted/cohort``: B with the cohort handed to the transport ordered by user size (the
  billboard's cohort is a set; the owner side would sort it before chunking).
* ``B skip-done`` (delta only): B with cohort sorted by size, descending, and
  ``local_sgd.local_sgd`` swapped, for this variant's rounds only, for a copy that leaves out of
  each vmapped step the users whose records are all used (their update is zero there).

Timing: one owner-side round = ``LocalTransport.train(shared, cohort, r)`` at the broadcast
parameters for the whole cohort (what ``run_rounds`` does before the release), for every
variant and ``engine_opts.chunk_records`` value, interleaved in one process (every variant
once, then again, ``--reps`` times); the first repetition is warm-up and not counted. Per
variant: seconds per round and per record, min and median; ratios to A at the same chunk size
and at the default (auto: 512 for the CNN). Padding: records the vmapped steps evaluate (units x
padded length, summed over the chunks ``local_sgd.chunks`` forms with the same budget) over the
records held. What is timed is ``--plan``: ``mode:side:chunk,chunk,...`` items (default
``DEFAULT_PLAN``, about 19 minutes on 2 busy cores); ``--from-json`` redraws table and plot.

    .venv/bin/python scripts/benchmarks/bench_natural.py --data-root DATA \\
        --json docs/results/natural_speed/natural_speed.json --plot docs/results/natural_speed/natural_speed.png
    .venv/bin/python scripts/benchmarks/bench_natural.py --plan delta:A:512 delta:B:512 delta:B_sorted_cohort:512
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "benchmarks"))

N_RECORDS, N_OWNERS = 10_000, 16
LR, BATCH, EPOCHS = 0.05, 32, 1
PLOT_TITLE = (
    f"owner-side round (LocalTransport.train), 10,000 MNIST records, cnn, full_dp, "
    f"{N_OWNERS} owners, 1 torch thread"
)


# -- configs ------------------------------------------------------------------------------------
def base_cfg(mode: str, chunk: int):
    from fedudp.config import RunConfig

    cfg = RunConfig()
    cfg.progress = False
    cfg.method = "full_dp"
    cfg.engine = "local"
    cfg.model.name = "cnn"
    cfg.partition.num_owners = N_OWNERS
    cfg.train.rounds = 20
    cfg.train.lr = LR
    cfg.train.batch_size = BATCH
    cfg.train.local_epochs = EPOCHS
    cfg.train.sampling_rate = 1.0
    cfg.train.shared_update = mode
    cfg.train.eval_every = 10**6
    cfg.engine_opts.threads = 1
    cfg.engine_opts.chunk_records = chunk
    return cfg


def cfg_a(mode: str, chunk: int, root: str):
    cfg = base_cfg(mode, chunk)
    cfg.dataset.name = "mnist"
    cfg.dataset.root = root
    cfg.dataset.num_records = N_RECORDS
    cfg.partition.records_per_user = 1
    return cfg


def cfg_b(mode: str, chunk: int, public: dict | None):
    cfg = base_cfg(mode, chunk)
    cfg.dataset.name = "memory"
    cfg.dataset.test_fraction = 0.0
    cfg.dataset.classes, cfg.dataset.input_shape = 10, [1, 28, 28]  # MNIST's, declared
    cfg.partition.owner_rule = "random"
    if public is not None:
        cfg.public.users = public["users"]
        cfg.public.owner_capacity = public["owner_capacity"]
        cfg.public.records_per_user = public["records_per_user"]
    return cfg


# -- B's users -----------------------------------------------------------------------------------
def natural_sizes(n: int, max_records: int, seed: int) -> np.ndarray:
    """User sizes drawn log-uniformly in [1, max_records] until they hold ``n`` records."""
    rng = np.random.default_rng([seed, 7])
    out, left = [], n
    while left > 0:
        s = int(
            np.clip(np.floor(np.exp(rng.uniform(0.0, np.log(max_records + 1)))), 1, max_records)
        )
        s = min(s, left)
        out.append(s)
        left -= s
    return np.array(out, dtype=np.int64)


def natural_records(x: torch.Tensor, y: torch.Tensor, sizes: np.ndarray, seed: int):
    import fedudp

    perm = np.random.default_rng([seed, 8]).permutation(len(y))
    user = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    return fedudp.from_arrays(x.numpy()[perm], y.numpy()[perm], user)


def sorted_by_size(fed):
    """A copy of ``fed`` with each owner's users laid out by size (ascending, stable)."""
    sizes = np.diff(fed.user_offsets)
    ou = fed.owner_user_offsets
    order = np.concatenate(
        [ou[j] + np.argsort(sizes[ou[j] : ou[j + 1]], kind="stable") for j in range(fed.num_owners)]
    )
    recs = np.concatenate([np.arange(fed.user_offsets[u], fed.user_offsets[u + 1]) for u in order])
    t = torch.from_numpy(recs)
    return dataclasses.replace(
        fed,
        x=fed.x[t].contiguous(),
        y=fed.y[t].contiguous(),
        user_offsets=np.r_[0, np.cumsum(sizes[order])].astype(np.int64),
        user_owner=fed.user_owner[order].copy(),
        user_ids=fed.user_ids[order].copy(),
    )


# -- local SGD that skips users whose records are used up (the idea, not fedudp's code) -----------
def local_sgd_skip_done(model, trainable, frozen_per_unit, frozen_common, x, y, orders, spec):
    """``fedudp.owner.local_sgd.local_sgd`` with each step's vmapped gradient taken over the units
    that still have records in that step only (a finished unit's masked gradient is zero)."""
    from torch.func import grad, vmap
    from fedudp.owner.gradients import masked_loss as _loss

    U, E, L = orders.shape
    if U == 0 or L == 0:
        return trainable

    def unit_loss(tr, fr, xb, yb, mb):
        return _loss(model, {**frozen_common, **fr, **tr}, xb, yb, mb)

    g = vmap(grad(unit_loss), in_dims=(0, 0, 0, 0, 0))
    b = spec.batch_size
    dtype = next(iter(trainable.values())).dtype
    for e in range(E):
        ord_e = torch.from_numpy(orders[:, e])
        for s in range(-(-L // b)):
            idx = ord_e[:, s * b : (s + 1) * b]
            mask = idx >= 0
            active = mask.any(1)
            if not bool(active.any()):
                continue
            width = int(mask.sum(1).max())
            if bool(active.all()):
                ic = idx[:, :width].clamp(min=0)
                grads = g(trainable, frozen_per_unit, x[ic], y[ic], mask[:, :width].to(dtype))
                trainable = {k: v - spec.lr * grads[k] for k, v in trainable.items()}
                continue
            a = torch.nonzero(active).squeeze(1)
            ic = idx[a, :width].clamp(min=0)
            grads = g(
                {k: v[a] for k, v in trainable.items()},
                {k: v[a] for k, v in frozen_per_unit.items()},
                x[ic],
                y[ic],
                mask[a, :width].to(dtype),
            )
            trainable = {
                k: v.index_add(0, a, grads[k], alpha=-spec.lr) for k, v in trainable.items()
            }
    return trainable


# -- padding ------------------------------------------------------------------------------------
def padding(sizes: np.ndarray, budget: int, mode: str, skip_done: bool = False) -> dict:
    """Chunks, vmapped steps and records evaluated by ``Owners.user_vectors`` for users of
    ``sizes`` (in cohort order), against the records held."""
    from fedudp.owner import local_sgd

    delta = mode == "delta"
    n_chunks = steps = evaluated = widest = 0
    for sel in local_sgd.chunks(sizes, budget, BATCH if delta else None):
        s = sizes[sel]
        L = int(s.max())
        n_chunks += 1
        if not delta:
            steps += 1
            evaluated += len(sel) * L
            widest = max(widest, len(sel) * L)
            continue
        for k in range(-(-L // BATCH)):
            w = min(BATCH, L - k * BATCH)
            units = int((s > k * BATCH).sum()) if skip_done else len(sel)
            steps += 1
            evaluated += units * w
            widest = max(widest, units * w)
    held = int(sizes.sum())
    return {
        "chunks": n_chunks,
        "vmapped_steps": steps,
        "records_evaluated": int(evaluated),
        "records_held": held,
        "padding_factor": evaluated / held,
        "largest_step_records": int(widest),
    }


# -- variants -----------------------------------------------------------------------------------
class Variant:
    def __init__(
        self,
        name: str,
        side: str,
        mode: str,
        chunk: int,
        p,
        fed=None,
        cohort_order: str = "layout",
        skip_done: bool = False,
    ) -> None:
        from fedudp.engines.local import LocalTransport

        self.name, self.side, self.mode, self.chunk = name, side, mode, chunk
        self.p, self.skip_done = p, skip_done
        self.fed = fed if fed is not None else p.fed
        self.transport = LocalTransport(p.owners, self.fed, p.aggregator.constraint)
        self.shared = p.billboard.shared_params()
        cohort = np.flatnonzero(p.billboard.sample(1))
        sizes = np.diff(self.fed.user_offsets)[cohort]
        if cohort_order == "ascending":
            cohort = cohort[np.argsort(sizes, kind="stable")]
        elif cohort_order == "descending":
            cohort = cohort[np.argsort(-sizes, kind="stable")]
        self.cohort = cohort
        self.sizes = np.diff(self.fed.user_offsets)[cohort]
        self.pad = padding(self.sizes, p.owners.budget, mode, skip_done)
        self.seconds: list[float] = []
        self.totals: dict[int, torch.Tensor] = {}

    def round(self, r: int) -> float:
        from fedudp.owner import local_sgd

        keep = local_sgd.local_sgd
        if self.skip_done:
            local_sgd.local_sgd = local_sgd_skip_done
        try:
            t0 = time.perf_counter()
            got = self.transport.train(self.shared, self.cohort, r)
            sec = time.perf_counter() - t0
        finally:
            local_sgd.local_sgd = keep
        c = got.replies[0].contribution
        assert c.count == len(self.cohort), (c.count, len(self.cohort))
        self.totals[r] = c.total.detach().clone()
        self.seconds.append(sec)
        return sec

    def row(self) -> dict:
        sec = self.seconds[1:]
        n = int(self.sizes.sum())
        return {
            "name": self.name,
            "side": self.side,
            "mode": self.mode,
            "chunk_records": self.chunk,
            "budget": self.p.owners.budget,
            "users": int(len(self.cohort)),
            "records": n,
            "min_s": min(sec),
            "median_s": statistics.median(sec),
            "min_s_per_record": min(sec) / n,
            "median_s_per_record": statistics.median(sec) / n,
            "seconds_all_reps": self.seconds,
            **self.pad,
        }


SIDES = ("A", "B", "B_sorted_owner", "B_sorted_cohort", "B_skip_done")
DEFAULT_PLAN = [
    "delta:A:512,2048,8192",
    "delta:B:512,2048,8192",
    "delta:B_sorted_cohort:512",
    "delta:B_skip_done:512,2048,8192",
    "gradient:A:512,2048",
    "gradient:B:512,2048",
    "gradient:B_sorted_owner:512",
    "gradient:B_sorted_cohort:512,2048",
]


def parse_plan(items: list[str]) -> dict[str, dict[str, list[int]]]:
    """``mode:side:chunk,chunk,...`` items as {mode: {side: [chunks]}}."""
    plan: dict[str, dict[str, list[int]]] = {}
    for it in items:
        mode, side, cks = it.split(":")
        if mode not in ("delta", "gradient") or side not in SIDES:
            raise SystemExit(f"--plan {it!r}: mode delta|gradient, side one of {SIDES}")
        if side == "B_skip_done" and mode != "delta":
            raise SystemExit(
                "--plan: B_skip_done changes local SGD (train.shared_update=delta) only"
            )
        plan.setdefault(mode, {})[side] = sorted(int(c) for c in cks.split(","))
    for mode, sides in plan.items():
        if "A" not in sides:
            raise SystemExit(f"--plan: mode {mode} needs A at one chunk size at least")
    return plan


def build_variants(
    mode: str, sides: dict[str, list[int]], root: str, max_records: int, seed: int
) -> tuple[list[Variant], dict]:
    """The mode's variants, ordered by chunk size and then A, B, B's variants (so that every
    repetition times A right before B)."""
    from fedudp import build

    a_chunks = sides["A"]
    b_chunks = sorted({c for s, cks in sides.items() if s != "A" for c in cks})
    prep_a = {ck: build.prepare(cfg_a(mode, ck, root)) for ck in a_chunks}
    first = prep_a[a_chunks[0]]
    assert first.fed.num_users == N_RECORDS and first.fed.num_records == N_RECORDS
    # B: A's own training records, in natural users
    sizes = natural_sizes(N_RECORDS, max_records, seed)
    recs = natural_records(first.fed.x, first.fed.y, sizes, seed)
    train, _ = build.natural_records(cfg_b(mode, b_chunks[0] if b_chunks else 512, None), recs)
    public = build.natural_numbers(train)
    info = {
        "b_users": int(len(sizes)),
        "b_size_min": int(sizes.min()),
        "b_size_median": float(np.median(sizes)),
        "b_size_mean": float(sizes.mean()),
        "b_size_max": int(sizes.max()),
        "b_public": public,
        "b_sizes_hist_edges": [1, 2, 5, 10, 20, 50, 100, 200, 501],
        "b_sizes_hist": np.histogram(sizes, bins=[1, 2, 5, 10, 20, 50, 100, 200, 501])[0].tolist(),
    }
    prep_b = {}
    for ck in b_chunks:
        prep_b[ck] = build.prepare(cfg_b(mode, ck, public), records=recs)
        assert prep_b[ck].fed.num_records == N_RECORDS and prep_b[ck].fed.num_users == len(sizes)
    out: list[Variant] = []
    for ck in sorted(set(a_chunks) | set(b_chunks)):
        if ck in a_chunks:
            out.append(Variant(f"A chunk={ck}", "A", mode, ck, prep_a[ck]))
        if ck in b_chunks:
            pb = prep_b[ck]
            if ck in sides.get("B", []):
                out.append(Variant(f"B chunk={ck}", "B", mode, ck, pb))
            if ck in sides.get("B_sorted_owner", []):
                out.append(
                    Variant(
                        f"B sorted/owner chunk={ck}",
                        "B_sorted_owner",
                        mode,
                        ck,
                        pb,
                        fed=sorted_by_size(pb.fed),
                    )
                )
            if ck in sides.get("B_sorted_cohort", []):
                out.append(
                    Variant(
                        f"B sorted/cohort chunk={ck}",
                        "B_sorted_cohort",
                        mode,
                        ck,
                        pb,
                        cohort_order="ascending",
                    )
                )
            if ck in sides.get("B_skip_done", []):
                out.append(
                    Variant(
                        f"B skip-done chunk={ck}",
                        "B_skip_done",
                        mode,
                        ck,
                        pb,
                        cohort_order="descending",
                        skip_done=True,
                    )
                )
    # the padding of every B arrangement at every chunk size (computed, not timed)
    pads = {}
    if prep_b:
        fed_b = next(iter(prep_b.values())).fed
        b_sizes = np.diff(fed_b.user_offsets)  # cohort = every user, in layout order
        by_owner = np.diff(sorted_by_size(fed_b).user_offsets)
        for ck in sorted(set(a_chunks) | set(b_chunks) | {256, 512, 1024, 2048, 4096, 8192}):
            pads[ck] = {
                "B": padding(b_sizes, ck, mode),
                "B_sorted_owner": padding(by_owner, ck, mode),
                "B_sorted_cohort": padding(np.sort(b_sizes), ck, mode),
            }
            if mode == "delta":
                pads[ck]["B_skip_done"] = padding(np.sort(b_sizes)[::-1], ck, mode, True)
    info["padding_by_chunk"] = pads
    return out, info


def agreement(variants: list[Variant]) -> dict:
    """Max |difference| of each B variant's cohort sum from plain B's at the same chunk size and
    round (same users, same vectors: float summation order only), and across chunk sizes."""
    out = {}
    for side in ("A", "B", "B_sorted_owner", "B_sorted_cohort", "B_skip_done"):
        vs = [v for v in variants if v.side == side]
        ref = {v.chunk: v for v in variants if v.side == "B"}
        if not vs:
            continue
        worst, scale = 0.0, 0.0
        for v in vs:
            base = vs[0] if side == "A" else ref.get(v.chunk, next(iter(ref.values()), vs[0]))
            for r, t in v.totals.items():
                worst = max(worst, float((t - base.totals[r]).abs().max()))
                scale = max(scale, float(t.abs().max()))
        out[side] = {"max_abs_diff": worst, "max_abs_total": scale}
    return out


# -- report -------------------------------------------------------------------------------------
def table(rows: list[dict], default_chunk: int) -> str:
    """Markdown table; ratios against A at the same chunk size and at the default chunk size
    (``engine_opts.chunk_records=0``: auto, 512 for the CNN: today's runs)."""
    a = {(r["mode"], r["chunk_records"]): r for r in rows if r["side"] == "A"}
    lines = [
        "| mode | side | chunk_records | users | chunks | vmapped steps | padding | "
        "s/round min / median | µs/record min / median | vs A same chunk: ratio of mins / "
        f"medians | vs A at {default_chunk} (default): ratio of mins / medians |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(r: dict, ref: dict | None) -> str:
        if ref is None:
            return "–"
        return f"{r['min_s'] / ref['min_s']:.2f} / {r['median_s'] / ref['median_s']:.2f}"

    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['side']} | {r['chunk_records']} | {r['users']} | {r['chunks']} | "
            f"{r['vmapped_steps']} | {r['padding_factor']:.2f} | {r['min_s']:.2f} / "
            f"{r['median_s']:.2f} | {1e6 * r['min_s_per_record']:.0f} / "
            f"{1e6 * r['median_s_per_record']:.0f} | {ratio(r, a.get((r['mode'], r['chunk_records'])))} "
            f"| {ratio(r, a.get((r['mode'], default_chunk)))} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in rows}, key=lambda m: m != "delta")
    fig, axes = plt.subplots(1, len(modes), figsize=(6.2 * len(modes), 4.6), squeeze=False)
    style = {
        "A": ("A: 1 record/user (planned)", "k", "o"),
        "B": ("B: natural users, 1-500 records", "tab:red", "s"),
        "B_sorted_owner": ("B, users sorted by size in each owner", "tab:orange", "^"),
        "B_sorted_cohort": ("B, cohort sorted by size", "tab:blue", "v"),
        "B_skip_done": ("B, sorted + finished users skipped", "tab:green", "D"),
    }
    for ax, mode in zip(axes[0], modes):
        for side, (label, color, marker) in style.items():
            rs = sorted(
                (r for r in rows if r["mode"] == mode and r["side"] == side),
                key=lambda r: r["chunk_records"],
            )
            if not rs:
                continue
            xs = [r["chunk_records"] for r in rs]
            ax.plot(
                xs,
                [1e6 * r["min_s_per_record"] for r in rs],
                color=color,
                marker=marker,
                label=label + " (min)",
            )
            ax.plot(
                xs,
                [1e6 * r["median_s_per_record"] for r in rs],
                color=color,
                ls=":",
                marker=marker,
                mfc="none",
                alpha=0.7,
            )
        ax.set_xscale("log", base=2)
        ticks = sorted({r["chunk_records"] for r in rows if r["mode"] == mode})
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(c) for c in ticks])
        ax.minorticks_off()
        ax.legend(fontsize=8, title="solid: min, dotted: median (5 rounds)", title_fontsize=8)
        ax.set_xlabel("engine_opts.chunk_records (records per vmapped chunk)")
        ax.set_ylabel("owner-side seconds per record (µs)")
        ax.set_title(f"train.shared_update={mode}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--data-root",
        default=os.environ.get("FEDUDP_DATA"),
        help="folder holding <root>/mnist/ IDX files (else synthetic MNIST-shaped data)",
    )
    ap.add_argument(
        "--plan",
        nargs="+",
        default=DEFAULT_PLAN,
        help="what to time: mode:side:chunk_records,... with mode delta|gradient and "
        f"side one of {', '.join(SIDES)} (default: %(default)s)",
    )
    ap.add_argument("--reps", type=int, default=6, help="rounds per variant (the first is warm-up)")
    ap.add_argument("--max-records", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument(
        "--from-json",
        help="no timing: print the table and draw --plot from this file, written by an earlier run",
    )
    a = ap.parse_args()
    if a.from_json:
        from fedudp.owner.local_sgd import AUTO_CHUNK_CONV

        saved = json.loads(Path(a.from_json).read_text())
        print(table(saved["results"], AUTO_CHUNK_CONV))
        if a.plot:
            plot(saved["results"], a.plot, saved.get("plot_title", PLOT_TITLE))
        return
    if a.reps < 6:
        raise SystemExit("--reps must be >= 6 (five counted per variant)")
    plan = parse_plan(a.plan)
    torch.set_num_threads(1)
    from bench_local import _has_mnist, synthetic_mnist
    from fedudp.owner.local_sgd import AUTO_CHUNK_CONV

    tmp = None
    root = Path(a.data_root) if a.data_root else Path("/nonexistent")
    if _has_mnist(root):
        data = f"MNIST from {root}"
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_mnist_")
        root = synthetic_mnist(Path(tmp.name))
        data = f"synthetic MNIST-shaped data (no MNIST under {a.data_root})"
    t_start = time.perf_counter()
    head = (
        f"data: {data}; torch {torch.__version__}, {torch.get_num_threads()} thread; "
        f"cnn, full_dp (server placement), {N_OWNERS} owners, E={EPOCHS}, batch {BATCH}, "
        f"lr {LR}; {a.reps} rounds per variant interleaved, first not counted"
    )
    print(head, flush=True)
    rows, infos, agree = [], {}, {}
    for mode, sides in plan.items():
        variants, info = build_variants(mode, sides, str(root), a.max_records, a.seed)
        infos[mode] = info
        print(
            f"[{mode}] B: {info['b_users']} users, sizes {info['b_size_min']}..{info['b_size_max']} "
            f"(median {info['b_size_median']:.0f}, mean {info['b_size_mean']:.1f}); "
            f"{len(variants)} variants",
            flush=True,
        )
        for rep in range(a.reps):
            for v in variants:
                v.round(rep + 1)
            print(
                f"  [{mode}] rep {rep + 1}/{a.reps} ({time.perf_counter() - t_start:.0f} s): "
                + "  ".join(f"{v.name}: {v.seconds[-1]:.2f}s" for v in variants),
                flush=True,
            )
        agree[mode] = agreement(variants)
        rows += [v.row() for v in variants]
        del variants
    wall = time.perf_counter() - t_start
    print()
    print(table(rows, AUTO_CHUNK_CONV))
    print(f"\nagreement of cohort sums: {json.dumps(agree)}")
    print(f"wall time {wall:.0f} s")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(
            json.dumps(
                {
                    "command": " ".join(sys.argv),
                    "data": data,
                    "head": head,
                    "wall_s": wall,
                    "machine": f"{platform.platform()}, {os.cpu_count()} cores",
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "natural_users": infos,
                    "agreement": agree,
                    "plot_title": PLOT_TITLE,
                    "results": rows,
                },
                indent=2,
            )
        )
    if a.plot:
        plot(rows, a.plot, PLOT_TITLE)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
