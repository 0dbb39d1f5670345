"""Distributed DP on MNIST: central DP against the distributed discrete Gaussian and Skellam
(docs/results/distributed_dp/), a resumable grid in priority order.

Two setups, one seed, ``method=joint_dp``:

* ``huang64``: Huang et al.'s n = 64 joint-DP setup (``+experiment=huang_table1
  partition.num_owners=64``: clip 15, δ = 1/N = 1e-4, E = 10 local epochs, one record per user),
  with ``train.rounds=ROUNDS_A`` instead of Table 3's T = 10 (a distributed round takes about
  100 s on one thread, see the README); central DP is the billboard-side reading
  (``privacy.placement=server``, clip + Gaussian);
* ``natural``: the natural-user federation of docs/results/natural_mnist (2,000 users, 32
  owners; its COMMON keys, 20 rounds), built by ``natural_mnist.py`` (``--fed``).

Against central DP (``aggregator=gaussian``, the server adds the noise) each setup runs
``privacy.placement=distributed`` with ``aggregator=ddgauss`` and ``skellam`` (owners add integer
noise shares; the server sees only the secure-aggregation sum), in this order: (1) 16 bits,
no dropout, ε = 1 and 8, both setups; (2) 12 and 20 bits on ``natural``; (3) 16 bits at
owner dropout 0.1 and 0.3 (central too) on ``natural``; then ``huang64`` at 12 bits, at 20 bits
and with dropout (a huang64 run costs about four natural ones).
``train.min_owners`` = n, ⌈0.8 n⌉, ⌈0.6 n⌉ at dropout 0, 0.1, 0.3. Each finished run
writes its full folder under ``--out`` (gitignored) and a condensed ``run.json`` (summary,
per-round metrics, the ledger's trust and notes) that ``docs/results/distributed_dp/raw.jsonl``
packs, one line per run (``scripts/tools/results_archive.py``); a run whose ``run.json`` is on
disk or packed is done, so re-running the script continues the grid. ``--report`` rewrites the
table of the README between its markers, ``--plot`` the PNG.

    # DATA: the folder holding mnist/ (or set FEDUDP_DATA); FED.npz from natural_mnist.py
    .venv/bin/python scripts/reproductions/natural_mnist.py --data-root DATA --out FED.npz
    .venv/bin/python scripts/reproductions/distributed_dp.py --list
    OMP_NUM_THREADS=1 .venv/bin/python scripts/reproductions/distributed_dp.py --data-root DATA \\
        --fed FED.npz --threads 1 --pack --stop-at 2026-12-02T08:00
    .venv/bin/python scripts/reproductions/distributed_dp.py --report --plot
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import reproduce_huang  # noqa: E402  (this folder: claim() and the resume state of a run folder)
import results_archive  # noqa: E402  (scripts/tools/: raw.jsonl, read packed or loose)

RESULT = ROOT / "docs" / "results" / "distributed_dp"
ROUNDS_A = 4  # Huang's T = 10 at n = 64, reduced for every huang64 row alike
NATURAL = {  # docs/results/natural_mnist/README.md's COMMON keys (dataset.path: --fed)
    "dataset.name": "npz",
    "dataset.columns.owner": "owner",
    "partition.owner_rule": "given",
    "partition.num_owners": 32,
    "public.users": 2000,
    "public.owner_capacity": 273,
    "public.records_per_user": 107,
    "dataset.classes": 10,
    "dataset.input_shape": "[1,28,28]",
    "model.name": "cnn",
    "model.personal": "[fc1.*]",
    "train.rounds": 20,
    "train.sampling_rate": 0.2,
    "train.lr": 0.05,
    "train.batch_size": 16,
    "privacy.clip": 0.5,
    "privacy.delta": 1e-5,
    "checkpoint.every": 0,
}
SETUPS = {
    "huang64": {"partition.num_owners": 64, "train.rounds": ROUNDS_A},
    "natural": NATURAL,
}
OWNERS = {"huang64": 64, "natural": 32}
MIN_SURVIVING = {0.0: 1.0, 0.1: 0.8, 0.3: 0.6}  # train.min_owners = ceil(fraction * n)
MECHS = ("central", "ddgauss", "skellam")


def run_name(setup: str, mech: str, bits: int, dropout: float, eps: float, seed: int = 0) -> str:
    """The run's folder under ``--out``, e.g. ``natural/ddgauss_b16_drop0_eps1``."""
    b = "" if mech == "central" else f"_b{bits}"
    return f"{setup}/{mech}{b}_drop{dropout:g}_eps{eps:g}" + (f"_s{seed}" if seed else "")


def overrides(setup: str, mech: str, bits: int, dropout: float, eps: float, seed: int = 0) -> dict:
    """The run's config overrides (without the data paths and threads)."""
    n = OWNERS[setup]
    over = {**SETUPS[setup], "method": "joint_dp", "seed": seed, "privacy.epsilon": eps}
    if mech == "central":
        over |= {"privacy.placement": "server", "aggregator": "gaussian"}
    else:
        over |= {"privacy.placement": "distributed", "aggregator": mech, "estimator.bits": bits}
    over["train.min_owners"] = math.ceil(MIN_SURVIVING[dropout] * n - 1e-9)
    if dropout:
        over["train.owner_dropout"] = dropout
    return over


def grid() -> list[tuple[str, dict]]:
    """(run name, overrides) in priority order (see the module docstring)."""
    out: list[tuple[str, dict]] = []

    def add(setup, mech, bits, dropout, eps, seed=0):
        args = (setup, mech, bits, dropout, eps, seed)
        out.append((run_name(*args), overrides(*args)))

    for eps in (1.0, 8.0):  # (1) 16 bits, no dropout; the cheaper setup first
        for setup in ("natural", "huang64"):
            for mech in MECHS:
                add(setup, mech, 16, 0.0, eps)
    for eps, mech in ((1.0, "central"), (8.0, "central"), (8.0, "ddgauss")):
        for seed in (1, 2):  # how far the seed moves the accuracy (the 0.01 goal's scale)
            add("natural", mech, 16, 0.0, eps, seed)
    # (2) fewer and more bits, (3) 16 bits with owners dropping out (central too); the cheap
    # natural rows of both first, so that each dimension is measured on one setup early
    bit_rows = [(b, e, m) for b in (12, 20) for e in (1.0, 8.0) for m in MECHS[1:]]
    drop_rows = [(p, e, m) for p in (0.1, 0.3) for e in (1.0, 8.0) for m in MECHS]
    for bits, eps, mech in bit_rows:
        add("natural", mech, bits, 0.0, eps)
    for dropout, eps, mech in drop_rows:
        add("natural", mech, 16, dropout, eps)
    for seed in (1, 2):
        add("huang64", "central", 16, 0.0, 1.0, seed)
    for bits, eps, mech in bit_rows[:4]:  # huang64 at 12 bits, where a wrap is likeliest
        add("huang64", mech, bits, 0.0, eps)
    for bits, eps, mech in bit_rows[4:]:
        add("huang64", mech, bits, 0.0, eps)
    for dropout, eps, mech in drop_rows:
        add("huang64", mech, 16, dropout, eps)
    return out


def command(name: str, over: dict) -> str:
    """The equivalent ``fedudp`` command line (data paths as DATA and FED.npz)."""
    pre = ["+experiment=huang_table1", "dataset.root=DATA"] if name.startswith("huang64") else []
    pre += ["dataset.path=FED.npz"] if name.startswith("natural") else []
    return "fedudp " + " ".join(pre + [f"{k}={v}" for k, v in over.items()])


def compose(name: str, over: dict, a: argparse.Namespace):
    """The run's config object (Hydra, the package's config folder)."""
    if name.startswith("huang64"):
        return reproduce_huang.compose(over, a.data_root, a.threads)
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    from fedudp.cli import CONF_DIR
    from fedudp.config import register

    register()
    args = [f"dataset.path={a.fed}", "progress=false", f"engine_opts.threads={a.threads}"]
    args += [f"{k}={v}" for k, v in over.items()]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return OmegaConf.to_object(hydra_compose(config_name="config", overrides=args))


def condense(folder: Path, name: str, over: dict, wall: float) -> dict:
    """The run's ``run.json``: what the table and the plot need, no machine path."""
    summary = json.loads((folder / "summary.json").read_text())
    ledger = json.loads((folder / "ledger.json").read_text())
    keep = (
        "round",
        "accuracy_mean",
        "accuracy_weighted",
        "epsilon",
        "seconds",
        "agg_modular_wraps",  # before a53a4db; since: sim_modular_wraps (never the billboard's)
        "sim_modular_wraps",
        "agg_survivors",
        "failed_owners",
        "withheld",
    )
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    setup, rest = name.split("/")
    return {
        "run": name,
        "setup": setup,
        "mechanism": rest.split("_")[0],
        "bits": over.get("estimator.bits"),
        "dropout": over.get("train.owner_dropout", 0.0),
        "min_owners": over["train.min_owners"],
        "seed": over["seed"],
        "command": command(name, over),
        "wall_s": round(wall, 1),
        "summary": {
            k: summary.get(k)
            for k in (
                "aggregator",
                "placement",
                "accuracy_mean",
                "accuracy_weighted",
                "epsilon",
                "target_epsilon",
                "delta",
                "rounds_completed",
                "rounds_planned",
                "releases_made",
                "stop_reason",
                "num_owners",
                "num_users",
                "shared_dim",
                "seconds",
                "source",
            )
        },
        "rounds": [{k: r[k] for k in keep if k in r} for r in rows],
        "ledger": {
            "trust": ledger.get("trust"),
            "mechanism": ledger.get("mechanism"),
            "epsilon": ledger.get("epsilon"),
            "notes": [n for n in ledger.get("notes", []) if "shares" in n or "encoding" in n],
            "noise_std_round1": (ledger.get("entries") or [{}])[0].get("noise_std"),
        },
    }


def refused(name: str, over: dict, message: str) -> dict:
    """The ``run.json`` of a configuration fedudp refused before any work (its one-line error)."""
    setup, rest = name.split("/")
    return {
        "run": name,
        "setup": setup,
        "mechanism": rest.split("_")[0],
        "bits": over.get("estimator.bits"),
        "dropout": over.get("train.owner_dropout", 0.0),
        "min_owners": over["train.min_owners"],
        "seed": over["seed"],
        "command": command(name, over),
        "target_epsilon": over["privacy.epsilon"],
        "refused": message.splitlines()[0],
    }


def records(out: Path) -> list[dict]:
    """Every finished run's ``run.json`` (on disk or packed), in grid order."""
    order = {name: i for i, (name, _) in enumerate(grid())}
    found = [
        json.loads(results_archive.read_text(p)) for p in results_archive.rglob(out, "run.json")
    ]
    return sorted(found, key=lambda r: order.get(r["run"], len(order)))


def is_done(out: Path, name: str) -> bool:
    return results_archive.is_file(out / name / "run.json")


def _fmt(x, spec: str = ".4f") -> str:
    return "—" if x is None else format(x, spec)


def _notes(recs: list[dict], spread: list[dict], refusals: list[dict]) -> str:
    """The lines below the table: refusals, the seeds' spread, wall time, code versions."""
    text = ""
    if refusals:
        text += "\nRefused before any work (fedudp's one-line error):\n\n"
        text += "\n".join(
            f"- {r['setup']}, {r['mechanism']}, {r['bits']} bits, dropout {r['dropout']:g}, "
            f"ε = {r['target_epsilon']:g}: `{r['refused']}`"
            for r in refusals
        )
        text += "\n"
    groups = sorted({r["run"].rsplit("_s", 1)[0] for r in spread})
    by_run = {r["run"]: r for r in recs}
    for base in groups:
        runs = [by_run[base]] if base in by_run else []
        runs += sorted(
            (r for r in spread if r["run"].rsplit("_s", 1)[0] == base), key=lambda r: r["seed"]
        )
        accs = [r["summary"]["accuracy_mean"] for r in runs]
        seeds = ", ".join(str(r.get("seed", 0)) for r in runs)
        text += (
            f"\nSeeds {seeds} of `{base}` (seeds 1 and up are not in the table): accuracy mean "
            f"{', '.join(f'{x:.4f}' for x in accs)} (range {max(accs) - min(accs):.4f}).\n"
        )
    made: dict[str, int] = {}
    for r in recs + spread:
        src = r["summary"].get("source") or {}
        key = (src.get("commit") or "?")[:7] + (
            " + uncommitted edits" if src.get("modified") else ""
        )
        made[key] = made.get(key, 0) + 1
    text += (
        "\nfedudp code the runs were made on (summary.json `source`): "
        + ", ".join(f"`{k}` ({v})" for k, v in sorted(made.items()))
        + ".\n"
    )
    wall = sum(r["wall_s"] for r in recs + spread)
    text += f"\nWall time of these runs: {wall / 60:.0f} min (the sum of their `wall_s`).\n"
    return text


def table(recs: list[dict]) -> str:
    """The Markdown table of the finished runs, and the 16-bit goal read off it."""
    refusals = [r for r in recs if "refused" in r]
    done_runs = {r["run"] for r in recs}
    recs = [r for r in recs if "refused" not in r]
    spread = [r for r in recs if r.get("seed", 0)]
    recs = [r for r in recs if not r.get("seed", 0)]
    central = {
        (r["setup"], r["dropout"], r["summary"]["target_epsilon"]): r
        for r in recs
        if r["mechanism"] == "central"
    }
    head = (
        "| setup | mechanism | bits | dropout | min owners | answered | ε target | ε spent | accuracy mean "
        "| weighted | Δ mean vs central | noise std × central | wraps | withheld rounds | s/round "
        "| × central |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines, goal = [], []
    for r in recs:
        s = r["summary"]
        c = central.get((r["setup"], r["dropout"], s["target_epsilon"]))
        spr = s["seconds"] / max(s["rounds_completed"], 1)
        delta = ratio = noise = None
        if c is not None and r is not c:
            delta = s["accuracy_mean"] - c["summary"]["accuracy_mean"]
            mine, theirs = r["ledger"]["noise_std_round1"], c["ledger"]["noise_std_round1"]
            noise = mine / theirs if mine and theirs else None
            cs = c["summary"]
            ratio = spr / (cs["seconds"] / max(cs["rounds_completed"], 1))
            if r["bits"] == 16 and r["dropout"] == 0.0:
                verdict = "within" if abs(delta) <= 0.01 else "NOT within"
                goal.append(
                    f"- {r['setup']}, {r['mechanism']}, ε = {s['target_epsilon']:g}: Δ = "
                    f"{delta:+.4f} ({verdict} 0.01); {ratio:.2f}× central's s/round "
                    f"({'meets' if ratio <= 1.5 else 'misses'} ≤ 1.5×)"
                )
        wraps = sum(x.get("sim_modular_wraps", x.get("agg_modular_wraps", 0)) for x in r["rounds"])
        withheld = sum(1 for x in r["rounds"] if x.get("withheld"))
        answered = [s["num_owners"] - x.get("failed_owners", 0) for x in r["rounds"]]
        span = f"{min(answered)}–{max(answered)}" if min(answered) < max(answered) else answered[0]
        lines.append(
            f"| {r['setup']} | {r['mechanism']} | {r['bits'] or '—'} | {r['dropout']:g} "
            f"| {r['min_owners']} | {span} | {s['target_epsilon']:g} | {_fmt(s['epsilon'], '.3f')} "
            f"| {_fmt(s['accuracy_mean'])} | {_fmt(s['accuracy_weighted'])} "
            f"| {_fmt(delta, '+.4f')} | {_fmt(noise, '.2f')} | {wraps if r['mechanism'] != 'central' else '—'} "
            f"| {withheld} | {spr:.1f} | {_fmt(ratio, '.2f')} |"
        )
    pending = [name for name, _ in grid() if name not in done_runs]
    text = head + "\n".join(lines) + "\n"
    text += _notes(recs, spread, refusals)
    text += "\nThe goal at 16 bits, no dropout (|Δ| ≤ 0.01, s/round ≤ 1.5× central):\n\n"
    text += "\n".join(goal or ["- no pair measured yet"]) + "\n"
    text += f"\n{len(done_runs)} of {len(grid())} runs done ({len(refusals)} refused); pending, in order: "
    text += (", ".join(f"`{p}`" for p in pending) or "none") + ".\n"
    return text


BEGIN, END = "<!-- table: distributed_dp.py --report -->", "<!-- /table -->"


def report(out: Path, readme: Path) -> None:
    """Rewrite the README's table between its markers."""
    text = readme.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme}: no {BEGIN} ... {END} markers to write the table between")
    head, rest = text.split(BEGIN, 1)
    readme.write_text(
        head + BEGIN + "\n" + table(records(out)) + END + rest.split(END, 1)[1], encoding="utf-8"
    )


def plot(out: Path, png: Path) -> None:
    """Accuracy against bits, one line per distributed mechanism, central DP as a horizontal
    line; one panel per setup and ε (no dropout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    refusals = [r for r in records(out) if "refused" in r]
    measured = [r for r in records(out) if "refused" not in r and r["dropout"] == 0.0]
    recs = [r for r in measured if not r.get("seed", 0)]
    others = [r for r in measured if r.get("seed", 0)]
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5), sharex=True)
    for i, setup in enumerate(("natural", "huang64")):
        for j, eps in enumerate((1.0, 8.0)):
            ax = axes[i][j]
            mine = [
                r for r in recs if r["setup"] == setup and r["summary"]["target_epsilon"] == eps
            ]
            for mech, color in (("ddgauss", "tab:blue"), ("skellam", "tab:orange")):
                pts = sorted(
                    (r["bits"], r["summary"]["accuracy_mean"])
                    for r in mine
                    if r["mechanism"] == mech
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=color, label=mech)
            for r in mine:
                if r["mechanism"] == "central":
                    acc = r["summary"]["accuracy_mean"]
                    ax.axhline(acc, color="k", ls="--", label="central DP")
                    ax.axhspan(acc - 0.01, acc + 0.01, color="k", alpha=0.08)
            for r in others:  # other seeds: central dotted, a distributed run hollow
                if r["setup"] != setup or r["summary"]["target_epsilon"] != eps:
                    continue
                acc = r["summary"]["accuracy_mean"]
                if r["mechanism"] == "central":
                    ax.axhline(acc, color="k", ls=":", lw=0.8)
                else:
                    color = "tab:blue" if r["mechanism"] == "ddgauss" else "tab:orange"
                    ax.plot([r["bits"]], [acc], marker="o", mfc="none", color=color)
            for bits in sorted(
                {
                    r["bits"]
                    for r in refusals
                    if (r["setup"], r["target_epsilon"], r["dropout"]) == (setup, eps, 0.0)
                }
            ):
                ax.annotate(
                    "refused",
                    (bits, 0.5),
                    xycoords=("data", "axes fraction"),
                    ha="center",
                    rotation=90,
                    color="gray",
                    fontsize=9,
                )
            ax.set_title(f"{setup}, ε = {eps:g}", fontsize=10)
            ax.set_xticks([12, 16, 20])
            ax.set_xlim(11, 21)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("test accuracy, mean over owners")
            if i == 1:
                ax.set_xlabel("bits per coordinate (modulus 2^b)")
            if mine:
                ax.legend(fontsize=8)
    fig.suptitle(
        "joint DP on MNIST: central vs distributed DP, no dropout\n"
        "(band: central ± 0.01; dotted / hollow: other seeds)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def pack(out: Path) -> None:
    """Fold every ``run.json`` on disk into the result folder's ``raw.jsonl`` (kept on disk)."""
    rel = out.relative_to(RESULT)
    paths = [str(p.relative_to(RESULT)) for p in out.rglob("run.json")]
    if paths:
        results_archive.pack(RESULT, paths or [str(rel)], "jsonl", remove=False)


def fits(name: str, out: Path, stop_at: dt.datetime | None) -> bool:
    """Whether the run should finish before ``stop_at``, judged by the slowest finished run of
    its setup and kind (central or distributed)."""
    if stop_at is None:
        return True
    setup, kind = name.split("/")[0], name.split("/")[1].startswith("central")
    walls = [
        r["wall_s"]
        for r in records(out)
        if "refused" not in r and r["setup"] == setup and (r["mechanism"] == "central") == kind
    ]
    need = max(walls, default=0.0)
    return dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=need) <= stop_at


def run_grid(a: argparse.Namespace, out: Path, todo: list[tuple[str, dict]]) -> int:
    from fedudp.errors import ConfigError
    from fedudp.run import run

    stop_at = (
        dt.datetime.fromisoformat(a.stop_at).replace(tzinfo=dt.timezone.utc) if a.stop_at else None
    )
    for name, over in todo:
        if is_done(out, name) or not fits(name, out, stop_at):
            continue
        if stop_at and dt.datetime.now(dt.timezone.utc) >= stop_at:
            break
        held = reproduce_huang.claim(out, name)
        if held is None:
            continue
        t0 = time.time()
        run_over = dict(over)
        if list((out / name).glob("ckpt-*.pt")):  # an interrupted run: continue it
            run_over["resume"] = str(out / name)
        try:
            s = run(compose(name, run_over, a), out / name)
        except ConfigError as e:  # refused before any work (e.g. bits too small): a result
            (out / name).mkdir(parents=True, exist_ok=True)
            rec = refused(name, over, str(e))
            (out / name / "run.json").write_text(json.dumps(rec, indent=1) + "\n")
            print(json.dumps(rec), flush=True)
            continue
        except Exception:  # noqa: BLE001  (log, go on with the grid)
            (out / "grid_errors.log").open("a").write(f"{name}\n{traceback.format_exc()}\n")
            print(f"FAILED {name} (see grid_errors.log)", flush=True)
            continue
        finally:
            held.unlink(missing_ok=True)
        if s.get("stop_reason") == "interrupted":
            print(f"interrupted in {name}; re-run the script to continue the grid", flush=True)
            return 130
        rec = condense(out / name, name, over, time.time() - t0)
        (out / name / "run.json").write_text(json.dumps(rec, indent=1) + "\n")
        print(json.dumps({"run": name, "wall_s": rec["wall_s"], **rec["summary"]}), flush=True)
        if a.pack:
            try:
                pack(out)
                report(out, RESULT / "README.md")
                plot(out, RESULT / "distributed_dp.png")
            except Exception:  # noqa: BLE001  (the grid goes on; --report --plot redo them)
                (out / "grid_errors.log").open("a").write(
                    f"pack {name}\n{traceback.format_exc()}\n"
                )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(RESULT / "runs"))
    ap.add_argument("--data-root", default=os.environ.get("FEDUDP_DATA"), help="MNIST IDX folder")
    ap.add_argument("--fed", help="the natural federation's NPZ (natural_mnist.py --out)")
    ap.add_argument("--only", nargs="*", default=["*"], help="fnmatch patterns over run names")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--stop-at", help="UTC time (ISO): start no run expected to end after it")
    ap.add_argument("--pack", action="store_true", help="after each run: raw.jsonl, table, plot")
    ap.add_argument("--list", action="store_true", help="the grid in order, done or todo")
    ap.add_argument("--report", action="store_true", help="rewrite the README's table")
    ap.add_argument("--plot", action="store_true", help="rewrite distributed_dp.png")
    a = ap.parse_args()
    out = Path(a.out)
    todo = [(n, o) for n, o in grid() if any(fnmatch.fnmatch(n, p) for p in a.only)]
    if a.list:
        for name, over in todo:
            print(f"{'done' if is_done(out, name) else 'todo':5s} {name}")
        return 0
    if a.report or a.plot:
        if a.report:
            report(out, RESULT / "README.md")
        if a.plot:
            plot(out, RESULT / "distributed_dp.png")
        return 0
    if not a.data_root or not a.fed:
        raise SystemExit(
            "distributed_dp.py: error: --data-root <MNIST IDX folder> (or FEDUDP_DATA) and "
            "--fed <FED.npz from natural_mnist.py> are required to run the grid"
        )
    return run_grid(a, out, todo)


if __name__ == "__main__":
    raise SystemExit(main())
