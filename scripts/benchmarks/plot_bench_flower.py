"""Plot ``scripts/benchmarks/bench_flower.py --json`` results: seconds per round of each side, one panel
per results file (its CPUs: all, or the ones ``--cpus`` pinned every run to).

Each bar is a side's minimum over the repetitions, the black tick its median; the label under
a bar gives the side's mean busy cores in the counted rounds (its process tree's CPU seconds
over their wall time, median over the repetitions) and its ratio of mins to Flower's default
(``plain``) of the same file.

    .venv/bin/python scripts/benchmarks/plot_bench_flower.py docs/results/bench_flower/bench_n512_cores.json \\
        docs/results/bench_flower/bench_n512_cpu0.json --out docs/results/bench_flower/cores.png

A results file that is not on disk is read from the result folder's packed raw files (the two
above are in docs/results/bench_flower/raw.jsonl; scripts/tools/results_archive.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import results_archive  # noqa: E402  (scripts/tools/: a result folder's raw.jsonl)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="bench_flower.py --json files")
    ap.add_argument("--out", required=True, help="PNG to write")
    a = ap.parse_args()
    panels = []
    for f in a.results:
        try:
            rows = json.loads(results_archive.read_text(f))
            assert isinstance(rows, list) and all("min" in r and "config" in r for r in rows)
        except (OSError, ValueError, AssertionError):
            raise SystemExit(
                f"plot_bench_flower.py: error: {f} is not a bench_flower.py --json "
                "file; run scripts/benchmarks/bench_flower.py with --json first"
            )
        panels.append((f, rows))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.8), squeeze=False)
    for ax, (f, rows) in zip(axes[0], panels):
        base = {r["n"]: r["min"] for r in rows if r["config"] == "plain"}
        labels, mins, meds = [], [], []
        for r in rows:
            kind = r["config"].split(":")[0]
            name = (
                "plain Flower" + kind[5:]
                if kind.startswith("plain")
                else "engine=flower"
                if kind == "fedudp"
                else "engine=" + kind
            )
            busy = r.get("busy_cores")
            ratio = (
                f"\n{base[r['n']] / r['min']:.1f}x faster"
                if r["n"] in base and r["config"] != "plain" and r["min"] < base[r["n"]]
                else ""
            )
            labels.append(f"{name}\n{busy:.2f} cores{ratio}" if busy is not None else name)
            mins.append(r["min"])
            meds.append(r["median"])
        x = range(len(rows))
        ax.bar(
            x,
            mins,
            color=["#999999" if r["config"].startswith("plain") else "#3b75af" for r in rows],
        )
        ax.scatter(x, meds, marker="_", s=400, color="black", zorder=3, label="median")
        top = max(meds)
        for i, v, m in zip(x, mins, meds):
            ax.text(i, max(v, m) + 0.01 * top, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), labels, fontsize=7.5)
        cpus = rows[0].get("pinned_cpus")
        ns = sorted({r["n"] for r in rows})
        where = "all CPUs" if not cpus else f"every run pinned to CPU {', '.join(map(str, cpus))}"
        ax.set_title(f"n = {', '.join(map(str, ns))}: {where}", fontsize=10)
        ax.set_ylabel("seconds per round (bar: min, tick: median)")
        ax.legend(fontsize=8)
    fig.suptitle(
        "Paper CNN FedAvg on MNIST: plain Flower vs fedudp\n(one torch thread per "
        "process; local@T: T threads)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
