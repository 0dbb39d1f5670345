"""Huang et al. (001) as published: the resumable grid behind docs/results/huang_table1/ (and the
Table 2 / Figure 1 reports, made from the same run folder).

Runs ``+experiment=huang_table1`` (standard FedAvg, DP-SGD inside the owners, clip 15,
δ = 1/N, E and T from the paper's Table 3) one configuration after another, in priority
order: the four methods row by row (n = 256, 64, 512, 128, 16, 4) at seed 0 with certified
accounting; Figure 1's other ε (n = 64); Table 2's personal-layer subsets (n = 256, certified, then paper mode); a corner of
Table 4 (n = 256, 5 records per user: user-level clipping, and the paper's group privacy); joint-DP
in ``paper`` mode; more of Table 4 in the paper's reading (n = 256: m/r ∈ {2, 10}, and joint-DP at
ε ∈ {3, 8} with m/r = 5); the server placement (the billboard-side reading) at n ∈ {16, 256, 512}; second seeds at
n ∈ {64, 256}; then Fashion-MNIST. Every run writes its small outputs (config, summary, ledger,
metrics, owners) under ``--out``; a finished run is skipped, so re-running the script continues
the grid. Several workers may share one grid (one per core): each claims a run under
``--out/.claims`` (its pid) before starting it. Each finished run appends its wall time to
``grid_times.jsonl``. The committed grid is packed in ``docs/results/huang_table1/raw.tar.xz``
(``scripts/tools/results_archive.py``): ``--list`` reads it as it is, a run first unpacks it (``runs/``
is gitignored), and ``python scripts/tools/results_archive.py pack docs/results/huang_table1 runs``
folds the new runs back in.

    # DATA: the folder holding mnist/ and fashion_mnist/ IDX files (or set FEDUDP_DATA instead)
    .venv/bin/python scripts/reproductions/reproduce_huang.py --data-root DATA   # the whole grid, resumable
    .venv/bin/python scripts/reproductions/reproduce_huang.py --list          # what it would run, in order
    .venv/bin/python scripts/reproductions/reproduce_huang.py --only 'mnist/n256/*'
    .venv/bin/python scripts/reproductions/reproduce_huang.py --first 'mnist/n256/*server*'   # those first
    OMP_NUM_THREADS=1 .venv/bin/python scripts/reproductions/reproduce_huang.py --threads 1 &   # two workers
    OMP_NUM_THREADS=1 .venv/bin/python scripts/reproductions/reproduce_huang.py --threads 1 &   # on 2 cores
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "tools"))
import results_archive  # noqa: E402  (scripts/tools/: the result folder's raw.tar.xz)

ROWS = [256, 64, 512, 128, 16, 4]
METHODS = ["per_silo", "fedavg", "full_dp", "joint_dp"]


FIG1_EPS = [100.0, 5.0, 10.0, 2.0]  # Figure 1's other ε (ε = 1 is Table 1's run), extremes first
FIG1_N = [64]
ABLATION_CLIP_N = [64, 4]  # clip 1 instead of 15 (ablation, not in the paper)
TABLE4 = [(256, 5)]  # (n, records per user m/r): a corner of Table 4 the machine allows
# (n, m/r, ε): more of Table 4 in the paper's reading (group privacy, paper mode): joint-DP at each,
# full-DP too where ε = 1 (the paper's Table 4 has full-DP at ε = 1 only)
TABLE4_PAPER = [(256, 2, 1.0), (256, 10, 1.0), (256, 5, 3.0), (256, 5, 8.0)]
TABLE2_PERSONAL = [
    ["conv1"],
    ["conv2"],
    ["conv1", "conv2"],
    ["conv1", "fc1"],
    ["conv2", "fc1"],
    ["conv1", "conv2", "fc1"],
]  # [fc1] and none (full-DP) are Table 1's runs


def grid(datasets: list[str]) -> list[tuple[str, dict]]:
    """(run name, overrides) in priority order."""
    out: list[tuple[str, dict]] = []

    def add(
        ds,
        n,
        method,
        placement="local_dpsgd",
        accounting="certified",
        seed=0,
        eps=None,
        personal=None,
        rpu=None,
        group=False,
        clip=None,
    ):
        private = method in ("full_dp", "joint_dp")
        tag = (
            ("_personal-" + "+".join(personal) if personal else "")
            + (f"_eps{eps:g}" if eps else "")
            + (f"_rpu{rpu}" if rpu else "")
            + ("_group" if group else "")
            + (f"_clip{clip:g}" if clip else "")
        )
        name = (
            f"{ds}/n{n}/{method}{tag}_{placement}_{accounting}_s{seed}"
            if private
            else f"{ds}/n{n}/{method}_s{seed}"
        )
        over = {
            "dataset.name": ds,
            "partition.num_owners": n,
            "method": method,
            "seed": seed,
            "privacy.placement": placement,
            "privacy.accounting": accounting,
        }
        if eps:
            over["privacy.epsilon"] = eps
        if personal:
            over["model.personal"] = "[" + ",".join(f"{p}.*" for p in personal) + "]"
        if rpu:
            over["partition.records_per_user"] = rpu
        if group:
            over["privacy.group_privacy"] = "true"
        if clip:
            over["privacy.clip"] = clip
        if (name, over) not in out:
            out.append((name, over))

    for ds in datasets:
        for n in ROWS:
            for m in METHODS:
                add(ds, n, m)
        if ds != datasets[0]:
            continue
        for n in FIG1_N:  # Figure 1: accuracy vs ε
            for eps in FIG1_EPS:
                for m in ("full_dp", "joint_dp"):
                    add(ds, n, m, eps=eps)
        for n in ABLATION_CLIP_N:  # ablation (not in the paper): is clip 15 what drowns
            for m in (
                "full_dp",
                "joint_dp",
            ):  # the shared layers? (docs/results/huang_table1/dp_collapse.md)
                add(ds, n, m, clip=1.0)
        for personal in TABLE2_PERSONAL:  # Table 2: which layers are personal (n = 256)
            add(ds, 256, "joint_dp", personal=personal)
        for personal in TABLE2_PERSONAL:  # ... and in paper mode: is the certified column's
            add(
                ds, 256, "joint_dp", personal=personal, accounting="paper"
            )  # reversal due to the public personal value?
        for n, rpu in TABLE4:  # Table 4: user-level clipping (certified) and the
            for m in ("joint_dp", "full_dp"):  # paper's group-privacy reading (paper mode)
                add(ds, n, m, rpu=rpu)
                add(ds, n, m, rpu=rpu, accounting="paper", group=True)
        for n in ROWS:
            add(ds, n, "joint_dp", accounting="paper")
        for n, rpu, eps in TABLE4_PAPER:  # Table 4, further cells (the paper's reading first)
            for m in ("joint_dp", "full_dp") if eps == 1.0 else ("joint_dp",):
                add(
                    ds,
                    n,
                    m,
                    rpu=rpu,
                    accounting="paper",
                    group=True,
                    eps=None if eps == 1.0 else eps,
                )
        for n in (16, 256, 512):
            for m in ("full_dp", "joint_dp"):
                add(ds, n, m, placement="server")
        for n in (64, 256):
            for m in METHODS:
                add(ds, n, m, seed=1)
    return out


def claim(out: Path, name: str) -> Path | None:
    """Claim a run for this process (several workers can share one grid): a file under
    ``out/.claims`` holding our pid; None if a live process holds it. A dead holder's claim
    is taken over."""
    path = out / ".claims" / name.replace("/", "__")
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(path.read_text() or "0")
                os.kill(pid, 0)
                return None  # a live worker runs it
            except (ValueError, ProcessLookupError, FileNotFoundError):
                path.unlink(missing_ok=True)  # stale: its worker is gone
                continue
            except PermissionError:
                return None
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return path
    return None


def compose(over: dict, data_root: str, threads: int):
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    from fedudp.config import register
    from fedudp.cli import CONF_DIR

    register()
    args = [
        "+experiment=huang_table1",
        f"dataset.root={data_root}",
        "progress=false",
        f"engine_opts.threads={threads}",
    ] + [f"{k}={v}" for k, v in over.items()]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return OmegaConf.to_object(hydra_compose(config_name="config", overrides=args))


def run_state(folder: Path) -> str:
    """'done' (completed or budget stop), 'part' (interrupted: resumes from its checkpoint) or 'todo'."""
    summary = folder / "summary.json"  # on disk, else in the packed grid
    if results_archive.is_file(summary) and json.loads(results_archive.read_text(summary)).get(
        "stop_reason"
    ) in ("completed", "budget"):
        return "done"
    if results_archive.is_file(summary) or list(folder.glob("ckpt-*.pt")):
        return "part"
    return "todo"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "huang_table1" / "runs"))
    ap.add_argument(
        "--data-root",
        default=os.environ.get("FEDUDP_DATA"),
        help="folder holding the IDX files (<root>/mnist/, <root>/fashion_mnist/); default: $FEDUDP_DATA",
    )
    ap.add_argument("--datasets", nargs="+", default=["mnist", "fashion_mnist"])
    ap.add_argument("--only", nargs="*", default=["*"], help="fnmatch patterns over run names")
    ap.add_argument(
        "--first",
        nargs="*",
        default=[],
        help="fnmatch patterns of runs to take before the rest (in this order)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args()
    if not a.data_root and not a.list:
        raise SystemExit(
            "reproduce_huang.py: error: --data-root <folder with the MNIST IDX files> is "
            "required (or set FEDUDP_DATA)"
        )
    from fedudp.run import run

    out = Path(a.out)
    todo = [
        (name, over)
        for name, over in grid(a.datasets)
        if any(fnmatch.fnmatch(name, p) for p in a.only)
    ]
    rank = {
        name: next((i for i, pat in enumerate(a.first) if fnmatch.fnmatch(name, pat)), len(a.first))
        for name, _ in todo
    }
    todo.sort(key=lambda item: rank[item[0]])  # stable: priority order otherwise
    if a.list:
        for name, _ in todo:
            print(f"{run_state(out / name):5s} {name}")
        return 0
    packed = results_archive.archive_folder(out)
    if packed is not None:  # the committed grid on disk: its runs skipped, grid_times continued
        results_archive.unpack(packed)
    for name, over in todo:
        if run_state(out / name) == "done":
            continue  # finished (run() would also skip it)
        held = claim(out, name)
        if held is None:
            continue  # another worker has it
        t0 = time.time()
        if list((out / name).glob("ckpt-*.pt")):  # an interrupted run: continue it
            over = {**over, "resume": str(out / name)}
        try:
            s = run(compose(over, a.data_root, a.threads), out / name)
        except Exception:  # noqa: BLE001  (log, go on with the grid)
            (out / "grid_errors.log").open("a").write(f"{name}\n{traceback.format_exc()}\n")
            print(f"FAILED {name} (see grid_errors.log)", flush=True)
            continue
        finally:
            held.unlink(missing_ok=True)
        if s.get("skipped"):
            continue
        if s["stop_reason"] == "interrupted":  # SIGINT/SIGTERM: end the grid, not just this run
            print(f"interrupted in {name}; re-run the script to continue the grid", flush=True)
            return 130
        rec = {
            "run": name,
            "seconds": round(time.time() - t0, 1),
            "accuracy_mean": s["accuracy_mean"],
            "epsilon": s["epsilon"],
            "rounds": s["rounds_completed"],
            "stop_reason": s["stop_reason"],
        }
        if "resume" in over:  # seconds are this process's part only
            rec["resumed"] = True
        with open(out / "grid_times.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)
    if packed is not None:
        print(f"fold the runs in: python scripts/tools/results_archive.py pack {packed} {out.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
