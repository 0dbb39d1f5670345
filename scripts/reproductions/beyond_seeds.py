"""Beyond the seeds on Huang et al.'s Table 1 protocol: fixed clips, adaptive clipping, DP-FTRL
(tree), the privacy cost of choosing the clip, and the one-run canary estimate.

Every run is ``fedudp +experiment=huang_table1 privacy.placement=server`` (MNIST, 10,000 records,
one record per user, the paper CNN, FC1 personal under joint DP, certified accounting, Table 3's
E and T for n) with one mechanism:

* ``clip<C>``: clip + Gaussian at a fixed clip C (15 is the preset's; the sweep over C is the
  tuning, and ``fedudp.tuning.select_best`` gives the ε of choosing it);
* ``adaptive``: ``privacy.clip_policy=adaptive`` from clip 1, target quantile 0.5;
* ``tree``: ``aggregator=dp_ftrl_tree`` with k = 10 public groups (``train.sampling_rate=0.1``);
  over Table 3's T = 10 rounds (n = 64) that is one tree, each user trained in one round;
* ``banded``: ``aggregator=dp_mf_banded`` (BSR banded matrix factorization) with b = 10 bands
  at ``train.sampling_rate=0.1`` (each group whole, one cycle over T = 10); ``banded_amp``: b = 5
  bands at the same rate, each group sampled at 0.5 (two cycles, amplified by sampling);
* ``blt``: ``aggregator=dp_mf_blt`` (buffered linear Toeplitz, 4 buffers) with min-separation
  b = 10 at ``train.sampling_rate=0.1`` (each group whole; one Gaussian for the run, no
  amplification);
* ``canary`` / ``canary_half``: clip 1 with ``audit.canaries`` (the one-run estimate), and the
  same with ``audit.noise_scale=0.5`` (a deliberately weakened twin); ``canary_sparse`` /
  ``canary_sparse_half``: the same pair with 100 users a round (``train.sampling_rate=0.01``)
  over 50 rounds, where the noise, not the data, dominates the final update.

``--natural FED.npz`` runs the same mechanisms on the natural-user federation of
docs/results/natural_mnist (``scripts/reproductions/natural_mnist.py --data-root DATA --out FED.npz``: 2,000
users of 1 to 107 records, 32 owners of 4 to 273 users) with that page's settings (20 rounds,
``train.sampling_rate=0.2``, clip 0.5); its clips are 0.1, 0.5 (the page's) and 2, the tree and
``banded`` use k = b = 5 groups at the same rate, ``banded_amp`` b = 2 groups sampled at 0.4.

Runs are resumable: a run whose folder has a summary.json is not redone. Each run's wall time
goes to ``runs/times.jsonl``; the table goes to README.md's marked section. The committed runs are
packed in the folder's ``raw.tar.xz`` (``scripts/tools/results_archive.py``): the table is read from it
as it is; running more first unpacks it (``runs/`` is gitignored), and ``python
scripts/tools/results_archive.py pack docs/results/beyond_seeds runs`` folds the new runs back in.

    .venv/bin/python scripts/reproductions/beyond_seeds.py --data DATA --n 64 --epsilon 1 8

``--blt-table`` writes ``blt.json`` and README.md's BLT block without training: for n rounds and
min-separation b (every unit at most k = ceil(n / b) times, fixed participation) the expected
squared error of the n prefix sums per coordinate, as one Gaussian of the whole run at noise
multiplier z and clip 1, is z²·loss: BLT ||A C⁻¹||_F²·sens(C)² (``fedudp.privacy.blt``), banded
(BSR, b bands, column norms 1) ||A C̃⁻¹||_F²·k, the tree (restarted every k = b rounds)
depth·trees·Σ_t nodes(t); RMSE = sqrt(loss / n), and times the z of one Gaussian meeting
ε = 1 and 8 (δ = 1e-5). Memory: the model-sized float64 vectors a round holds. ε parity: each
``blt`` run's ledger ε against the analytic Gaussian mechanism (Balle & Wang 2018, Theorem 8) at
its z.

    .venv/bin/python scripts/reproductions/beyond_seeds.py --blt-table
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "tools"))
import results_archive  # noqa: E402  (scripts/tools/: the result folder's raw.tar.xz)

OUT = ROOT / "docs" / "results" / "beyond_seeds"
BLT_SETTINGS = ((10, 10), (64, 64), (64, 8), (256, 256), (256, 32))  # (rounds n, min-sep b)
BUFFERS = (1, 2, 3, 4, 5, 7)
CLIPS = (0.1, 1.0, 15.0)
NATURAL_CLIPS = (0.1, 0.5, 2.0)
# docs/results/natural_mnist's settings (its public numbers are declared, checked against the data)
NATURAL = [
    "dataset.name=npz",
    "dataset.columns.owner=owner",
    "partition.owner_rule=given",
    "partition.num_owners=32",
    "public.users=2000",
    "public.owner_capacity=273",
    "public.records_per_user=107",
    "dataset.classes=10",
    "dataset.input_shape=[1,28,28]",
    "model.name=cnn",
    "model.personal=[fc1.*]",
    "train.rounds=20",
    "train.lr=0.05",
    "train.batch_size=16",
    "privacy.delta=1e-5",
]


def natural_mechanisms() -> dict[str, list[str]]:
    m = {f"clip{c:g}": [f"privacy.clip={c}", "train.sampling_rate=0.2"] for c in NATURAL_CLIPS}
    m["adaptive"] = ["privacy.clip_policy=adaptive", "privacy.clip=0.5", "train.sampling_rate=0.2"]
    m["tree"] = ["aggregator=dp_ftrl_tree", "privacy.clip=0.5", "train.sampling_rate=0.2"]
    m["banded"] = ["aggregator=dp_mf_banded", "privacy.clip=0.5", "train.sampling_rate=0.2"]
    m["banded_amp"] = [
        "aggregator=dp_mf_banded",
        "privacy.clip=0.5",
        "train.sampling_rate=0.2",
        "estimator.bands=2",
    ]
    m["blt"] = [
        "aggregator=dp_mf_blt",
        "privacy.clip=0.5",
        "train.sampling_rate=0.2",
        "estimator.buffers=4",
    ]
    return m


def mechanisms(canaries: int) -> dict[str, list[str]]:
    m = {f"clip{c:g}": [f"privacy.clip={c}"] for c in CLIPS}
    m["adaptive"] = ["privacy.clip_policy=adaptive", "privacy.clip=1.0"]
    m["tree"] = ["aggregator=dp_ftrl_tree", "privacy.clip=1.0", "train.sampling_rate=0.1"]
    m["banded"] = ["aggregator=dp_mf_banded", "privacy.clip=1.0", "train.sampling_rate=0.1"]
    m["banded_amp"] = [
        "aggregator=dp_mf_banded",
        "privacy.clip=1.0",
        "train.sampling_rate=0.1",
        "estimator.bands=5",
    ]
    m["blt"] = [
        "aggregator=dp_mf_blt",
        "privacy.clip=1.0",
        "train.sampling_rate=0.1",
        "estimator.buffers=4",
    ]
    m["canary"] = ["privacy.clip=1.0", f"audit.canaries={canaries}"]
    m["canary_half"] = ["privacy.clip=1.0", f"audit.canaries={canaries}", "audit.noise_scale=0.5"]
    sparse = [
        "privacy.clip=1.0",
        f"audit.canaries={canaries}",
        "train.sampling_rate=0.01",
        "train.rounds=50",
    ]
    m["canary_sparse"] = sparse
    m["canary_sparse_half"] = [*sparse, "audit.noise_scale=0.5"]
    return m


def grid(a) -> list[tuple[str, list[str]]]:
    out = []
    if a.natural:
        for method in a.methods:
            for eps in a.epsilon:
                for name, over in natural_mechanisms().items():
                    out.append(
                        (
                            f"natural/{method}/eps{eps:g}/{name}",
                            [f"method={method}", f"privacy.epsilon={eps}", *over],
                        )
                    )
        return out
    for n in a.n:
        for method in a.methods:
            for eps in a.epsilon:
                for name, over in mechanisms(a.canaries).items():
                    if name.startswith("canary") and (method != "full_dp" or eps != a.epsilon[-1]):
                        continue
                    key = f"n{n}/{method}/eps{eps:g}/{name}"
                    out.append(
                        (
                            key,
                            [
                                f"partition.num_owners={n}",
                                f"method={method}",
                                f"privacy.epsilon={eps}",
                                *over,
                            ],
                        )
                    )
    return out


def run(key: str, over: list[str], a) -> None:
    folder = OUT / "runs" / key
    if (folder / "summary.json").is_file():
        return
    folder.mkdir(parents=True, exist_ok=True)
    exe = Path(sys.executable).parent / "fedudp"
    if a.natural:
        head, shown_head = (
            [*NATURAL, f"dataset.path={a.natural}"],
            [*NATURAL, "dataset.path=FED.npz"],
        )
    else:
        head = ["+experiment=huang_table1", "privacy.placement=server", f"dataset.root={a.data}"]
        shown_head = ["+experiment=huang_table1", "privacy.placement=server", "dataset.root=DATA"]
    cmd = [
        str(exe),
        *head,
        *over,
        "progress=false",
        f"engine_opts.threads={a.threads}",
        "checkpoint.every=0",
        f"hydra.run.dir={folder}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "FLWR_TELEMETRY_ENABLED": "0"}
    t = time.perf_counter()
    with open(folder / "run.out", "w") as f:
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t
    sys.path.insert(0, str(ROOT / "scripts" / "tools"))
    from scrub_paths import scrub

    scrub(folder, {k: v for k, v in ((a.data, "DATA"), (a.natural, "FED.npz")) if k})
    shown = " ".join(["fedudp", *shown_head, *over])
    with open(OUT / "runs" / "times.jsonl", "a") as f:
        f.write(
            json.dumps({"run": key, "exit": rc, "wall_s": round(wall, 1), "command": shown}) + "\n"
        )
    print(f"{key}: exit {rc} in {wall:.0f} s", flush=True)


def table() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from fedudp import report
    from fedudp.tuning import select_best

    times = {}
    tf = OUT / "runs" / "times.jsonl"
    if results_archive.is_file(tf):
        for line in results_archive.read_text(tf).splitlines():
            r = json.loads(line)
            times[r["run"]] = r
    rows = [
        "| n | method | ε target | mechanism | accuracy (mean over owners) | ledger ε | "
        "ε incl. choosing the clip | canary estimate (95 % interval) | wall (s) |",
        "|---:|---|---:|---|---:|---:|---:|---|---:|",
    ]
    runs = results_archive.glob(OUT / "runs", "*/*/*/*/summary.json")
    by_cell: dict = {}
    for p in runs:
        key = str(p.parent.relative_to(OUT / "runs"))
        s = json.loads(results_archive.read_text(p))
        s["_dir"], s["_key"] = str(p.parent), key
        n, method, eps, mech = key.split("/")
        by_cell.setdefault((n, method, eps), {})[mech] = s
    for (n, method, eps), cell in sorted(
        by_cell.items(),
        key=lambda kv: (
            int(kv[0][0][1:]) if kv[0][0][1:].isdigit() else 10**9,
            kv[0][1],
            float(kv[0][2][3:]),
        ),
    ):
        clips = NATURAL_CLIPS if n == "natural" else CLIPS
        order = list(natural_mechanisms() if n == "natural" else mechanisms(2))
        fixed = [cell[f"clip{c:g}"] for c in clips if f"clip{c:g}" in cell]
        chosen = tuned = None
        if len(fixed) == len(clips):
            for s in fixed:
                from omegaconf import OmegaConf

                s["_config"] = OmegaConf.to_container(
                    OmegaConf.create(results_archive.read_text(Path(s["_dir"]) / "config.yaml"))
                )
            a, b = report.groups_of(fixed)
            sel = select_best({**a, **b}, "accuracy_mean")
            chosen, tuned = sel["settings"].get("privacy.clip"), sel["tuning_epsilon"]
        for mech, s in sorted(cell.items(), key=lambda kv: order.index(kv[0])):
            label = mech + (" (chosen)" if mech == f"clip{chosen:g}" else "") if chosen else mech
            inc = f"{tuned:.3f}" if (tuned is not None and mech == f"clip{chosen:g}") else "-"
            can = "-"
            if s.get("canary_epsilon_estimate"):  # Andrew et al.'s estimate, not a bound
                est = s["canary_epsilon_estimate"]
                can = f"{est['value']:.3f} ({est['ci'][0]:.3f}-{est['ci'][1]:.3f})"
            elif s.get("canary_epsilon") is not None:  # runs before issue 37: the old form
                lo, hi = s["canary_epsilon_interval"]
                can = f"{s['canary_epsilon']:.3f} ({lo:.3f}-{hi:.3f}, old equal-variance form)"
            wall = times.get(s["_key"], {}).get("wall_s", "-")
            rows.append(
                f"| {n if n == 'natural' else n[1:]} | {method} | {eps[3:]} | {label} | {s['accuracy_mean']:.4f} | "
                f"{s['epsilon_display']} | {inc} | {can} | {wall} |"
            )
    return rows


def write_readme() -> None:
    path = OUT / "README.md"
    text = path.read_text() if path.is_file() else ""
    block = "<!-- beyond_seeds:table -->\n" + "\n".join(table()) + "\n<!-- /beyond_seeds:table -->"
    if "<!-- beyond_seeds:table -->" in text:
        head, rest = text.split("<!-- beyond_seeds:table -->", 1)
        text = head + block + rest.split("<!-- /beyond_seeds:table -->", 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def tree_loss(n: int, k: int) -> float:
    """fedudp's tree restarted every k rounds: depth · trees · Σ_t nodes(t) (z = 1)."""
    sys.path.insert(0, str(ROOT))
    from fedudp.aggregators.tree import tree_depth

    nodes = [(t // k) * bin(k).count("1") + bin(t % k).count("1") for t in range(1, n + 1)]
    return tree_depth(k) * -(-n // k) * float(sum(nodes))


def bsr_loss(n: int, b: int) -> float:
    """BSR with b bands at min-separation b: ||A C̃⁻¹||_F² · k (disjoint column supports)."""
    import numpy as np

    from fedudp.aggregators.banded import strategy_matrix
    from fedudp.privacy.blt import max_participations

    C = strategy_matrix(b, n)
    A = np.tril(np.ones((n, n)))
    return float(np.linalg.norm(A @ np.linalg.inv(C)) ** 2) * max_participations(n, b)


def analytic_gaussian_epsilon(z: float, delta: float) -> float:
    """ε of the Gaussian mechanism of multiplier z at δ (Balle & Wang 2018, Theorem 8)."""
    from scipy.stats import norm

    def d(eps: float) -> float:
        return norm.cdf(-eps * z + 0.5 / z) - math.exp(eps) * norm.cdf(-eps * z - 0.5 / z)

    lo, hi = 0.0, 200.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if d(mid) > delta else (lo, mid)
    return hi


def gaussian_z(eps: float, delta: float) -> float:
    """The z of one Gaussian meeting (ε, δ) (bisection on ``analytic_gaussian_epsilon``)."""
    lo, hi = 0.05, 500.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if analytic_gaussian_epsilon(mid, delta) <= eps else (mid, hi)
    return hi


def blt_rows(dim: int) -> list[dict]:
    """The prefix-sum error and memory rows (module doc, ``--blt-table``)."""
    sys.path.insert(0, str(ROOT))
    from fedudp.aggregators.tree import tree_depth
    from fedudp.privacy.blt import blt_loss, max_participations, optimal_blt

    out = []
    z = {e: gaussian_z(e, 1e-5) for e in (1.0, 8.0)}
    for n, b in BLT_SETTINGS:
        k = max_participations(n, b)
        mech: list[tuple[str, float, int]] = [
            ("tree", tree_loss(n, b), tree_depth(b) + 1),
            ("banded", bsr_loss(n, b), b),
        ]
        for m in BUFFERS:
            t = time.perf_counter()
            th, om = optimal_blt(n, b, m)
            mech.append((f"blt{m}", blt_loss(th, om, n, b), m + 1))
            print(f"n={n} b={b} nbuf={m}: {time.perf_counter() - t:.2f} s", flush=True)
        for name, loss, vectors in mech:
            rmse = math.sqrt(loss / n)
            out.append(
                {
                    "n": n,
                    "b": b,
                    "k": k,
                    "mechanism": name,
                    "loss": loss,
                    "rmse_z1": rmse,
                    "rmse_eps1": rmse * z[1.0],
                    "rmse_eps8": rmse * z[8.0],
                    "vectors": vectors,
                    "bytes": vectors * dim * 8,
                }
            )
    return out


def blt_parity() -> list[dict]:
    """Each ``blt`` run's ledger ε against the analytic Gaussian ε at its z."""
    out = []
    for p in sorted(results_archive.glob(OUT / "runs", "*/*/*/blt/summary.json")):
        s = json.loads(results_archive.read_text(p))
        ref = analytic_gaussian_epsilon(s["noise_multiplier"], s["delta"])
        out.append(
            {
                "run": str(p.parent.relative_to(OUT / "runs")),
                "z": s["noise_multiplier"],
                "delta": s["delta"],
                "ledger_epsilon": s["epsilon"],
                "analytic_gaussian_epsilon": ref,
                "accuracy_mean": s["accuracy_mean"],
                "shared_dim": s.get("shared_dim"),
            }
        )
    return out


def blt_markdown(data: dict) -> list[str]:
    """README.md's BLT tables."""
    lines = [
        "| n | b | k | mechanism | prefix-sum RMSE (z = 1) | RMSE at ε = 1 | RMSE at ε = 8 | "
        "vectors held | noise memory (bytes) |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in data["error"]:
        lines.append(
            f"| {r['n']} | {r['b']} | {r['k']} | {r['mechanism']} | {r['rmse_z1']:.4f} | "
            f"{r['rmse_eps1']:.3f} | {r['rmse_eps8']:.4f} | {r['vectors']} | {r['bytes']:,} |"
        )
    lines += [
        "",
        "| run | z | ledger ε | analytic Gaussian ε (Balle & Wang 2018) | accuracy |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in data["parity"]:
        lines.append(
            f"| {r['run']} | {r['z']:.6f} | {r['ledger_epsilon']:.6f} | "
            f"{r['analytic_gaussian_epsilon']:.6f} | {r['accuracy_mean']:.4f} |"
        )
    return lines


def write_blt(dim: int = 0) -> None:
    """``--blt-table``: blt.json and README.md's BLT block (prefix-sum error, memory, ε parity;
    no training)."""
    t = time.perf_counter()
    par = blt_parity()
    dim = dim or next((r["shared_dim"] for r in par if r["shared_dim"]), 1)
    data = {"dim": dim, "error": blt_rows(dim), "parity": par}
    data["wall_s"] = round(time.perf_counter() - t, 1)
    (OUT / "blt.json").write_text(json.dumps(data, indent=1) + "\n")
    path = OUT / "README.md"
    text = path.read_text()
    block = "<!-- blt:table -->\n" + "\n".join(blt_markdown(data)) + "\n<!-- /blt:table -->"
    if "<!-- blt:table -->" in text:
        head, rest = text.split("<!-- blt:table -->", 1)
        text = head + block + rest.split("<!-- /blt:table -->", 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
    print(f"wrote {OUT / 'blt.json'} in {data['wall_s']} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data", default=os.environ.get("FEDUDP_DATA"), help="folder holding mnist/ IDX files"
    )
    ap.add_argument("--n", type=int, nargs="+", default=[64])
    ap.add_argument("--methods", nargs="+", default=["full_dp", "joint_dp"])
    ap.add_argument("--epsilon", type=float, nargs="+", default=[1.0, 8.0])
    ap.add_argument("--canaries", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="*", help="run only these mechanisms")
    ap.add_argument(
        "--natural",
        metavar="FED.npz",
        help="the natural-user federation instead of Huang's protocol",
    )
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--blt-table", action="store_true", help="blt.json only (no training)")
    a = ap.parse_args()
    if a.blt_table:
        write_blt()
        return
    if not a.table_only:
        if not a.data and not a.natural:
            raise SystemExit(
                "beyond_seeds.py: error: --data (or $FEDUDP_DATA): the folder with mnist/"
            )
        results_archive.unpack(OUT)  # the committed runs on disk: skipped, times.jsonl continued
        for key, over in grid(a):
            if a.only and key.rsplit("/", 1)[1] not in a.only:
                continue
            run(key, over, a)
            write_readme()
        print(
            "fold the runs in: python scripts/tools/results_archive.py pack docs/results/beyond_seeds runs"
        )
    write_readme()


if __name__ == "__main__":
    main()
