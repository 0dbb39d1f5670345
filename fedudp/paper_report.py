"""The paper's layout beside its numbers: ``fedudp-report DIR --paper huang_table1`` (issue 9).

Rows n (with m = N/n), columns the methods (per-silo, FedAvg, full-DP, joint-DP under the
paper's protocol, certified; joint-DP in ``paper`` mode; the server placement's full- and
joint-DP), mean ± std over seeds, the paper's number and the difference beside each cell, the
best of per-silo / full-DP / joint-DP in bold as in the paper. Writes ``<name>.md``,
``<name>.csv`` and ``<name>.png`` (accuracy vs n, ours solid, the paper's dashed) and states
the paper's qualitative claims as holds / does not hold on the numbers found.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Callable

import numpy as np

# Huang et al. (001) Table 1: test accuracy, mean ± std over 5 runs, ε = 1
HUANG_TABLE1 = {
    "mnist": {
        4: {"per_silo": (0.9445, 0.0069), "fedavg": (0.9602, 0.0017), "full_dp": (0.4444, 0.0844), "joint_dp": (0.4658, 0.0307)},
        16: {"per_silo": (0.9457, 0.0038), "fedavg": (0.9468, 0.0014), "full_dp": (0.2926, 0.0239), "joint_dp": (0.3207, 0.0690)},
        64: {"per_silo": (0.9209, 0.0010), "fedavg": (0.9402, 0.0037), "full_dp": (0.6982, 0.0314), "joint_dp": (0.7651, 0.0401)},
        128: {"per_silo": (0.8639, 0.0010), "fedavg": (0.9376, 0.0043), "full_dp": (0.8081, 0.0240), "joint_dp": (0.8169, 0.0160)},
        256: {"per_silo": (0.7678, 0.0015), "fedavg": (0.9196, 0.0028), "full_dp": (0.7399, 0.0324), "joint_dp": (0.7835, 0.0136)},
        512: {"per_silo": (0.7240, 0.0001), "fedavg": (0.9326, 0.0093), "full_dp": (0.6023, 0.0621), "joint_dp": (0.7423, 0.0832)},
    },
    "fashion_mnist": {
        4: {"per_silo": (0.8888, 0.0253), "fedavg": (0.8759, 0.0042), "full_dp": (0.4560, 0.0142), "joint_dp": (0.4533, 0.0121)},
        16: {"per_silo": (0.8575, 0.0135), "fedavg": (0.8301, 0.0078), "full_dp": (0.4044, 0.0473), "joint_dp": (0.4205, 0.0539)},
        64: {"per_silo": (0.8498, 0.0041), "fedavg": (0.8232, 0.0088), "full_dp": (0.5354, 0.0249), "joint_dp": (0.5564, 0.0207)},
        128: {"per_silo": (0.7506, 0.0017), "fedavg": (0.7676, 0.0123), "full_dp": (0.6593, 0.0137), "joint_dp": (0.6719, 0.0272)},
        256: {"per_silo": (0.6489, 0.0004), "fedavg": (0.8010, 0.0018), "full_dp": (0.6749, 0.0160), "joint_dp": (0.6908, 0.0145)},
        512: {"per_silo": (0.6355, 0.0007), "fedavg": (0.8242, 0.0069), "full_dp": (0.6484, 0.0227), "joint_dp": (0.6667, 0.0062)},
    },
}


def _is(method: str, placement: str | None = None, accounting: str | None = None) -> Callable[[dict], bool]:
    def f(s: dict) -> bool:
        return (s.get("method") == method and (placement is None or s.get("placement") == placement)
                and (accounting is None or s.get("accounting") == accounting))
    return f


# (column label, which summaries, the paper's column it reproduces or None)
COLUMNS = [
    ("per-silo", _is("per_silo"), "per_silo"),
    ("FedAvg (no DP)", _is("fedavg"), "fedavg"),
    ("full-DP", _is("full_dp", "local_dpsgd", "certified"), "full_dp"),
    ("joint-DP", _is("joint_dp", "local_dpsgd", "certified"), "joint_dp"),
    ("joint-DP, paper mode (heuristic)", _is("joint_dp", "local_dpsgd", "paper"), "joint_dp"),
    ("full-DP, server placement", _is("full_dp", "server", "certified"), None),
    ("joint-DP, server placement", _is("joint_dp", "server", "certified"), None),
]
COMPARED = ("per-silo", "full-DP", "joint-DP")      # the paper bolds the best of these


def _cells(summaries: list[dict], dataset: str) -> dict[tuple[int, str], list[float]]:
    out: dict[tuple[int, str], list[float]] = {}
    for s in summaries:
        if s.get("dataset", "mnist") != dataset or s.get("stop_reason") not in ("completed", "budget"):
            continue
        for label, match, _ in COLUMNS:
            if match(s):
                out.setdefault((int(s["num_owners"]), label), []).append(float(s["accuracy_mean"]))
    return out


def _claims(cells: dict, ns: list[int]) -> list[str]:
    def mean(n, label):
        v = cells.get((n, label))
        return float(np.mean(v)) if v else None

    lines = []
    pairs = [(n, mean(n, "joint-DP"), mean(n, "full-DP")) for n in ns]
    pairs = [p for p in pairs if None not in p]
    if pairs:
        ok = all(j >= f for _, j, f in pairs)
        lines.append(f"- joint-DP ≥ full-DP at ε = 1 (certified): {'holds' if ok else 'does not hold'} "
                     + ", ".join(f"n={n}: {j:.3f} vs {f:.3f}" for n, j, f in pairs))
    big = [(n, mean(n, "joint-DP"), mean(n, "per-silo")) for n in ns if n >= 256]
    big = [p for p in big if None not in p]
    if big:
        ok = all(j > p for _, j, p in big)
        lines.append(f"- joint-DP beats per-silo for n ≥ 256: {'holds' if ok else 'does not hold'} "
                     + ", ".join(f"n={n}: {j:.3f} vs {p:.3f}" for n, j, p in big))
    for label in ("full-DP", "joint-DP"):
        seq = [(n, mean(n, label)) for n in ns if mean(n, label) is not None]
        if len(seq) >= 3:
            v = [x for _, x in seq]
            mono = all(a <= b for a, b in zip(v, v[1:])) or all(a >= b for a, b in zip(v, v[1:]))
            lines.append(f"- {label} accuracy non-monotone in n: {'does not hold' if mono else 'holds'} "
                         + ", ".join(f"n={n}: {x:.3f}" for n, x in seq))
    return lines


def write_paper_report(layout: str, summaries: list[dict], out: Path) -> str:
    """Write the huang_table1 layout under ``out``; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    md, rows = [f"# Huang et al. Table 1, reproduced ({layout})", ""], []
    for dataset, paper in HUANG_TABLE1.items():
        cells = _cells(summaries, dataset)
        if not cells:
            continue
        ns = sorted({n for n, _ in cells} | set())
        labels = [c[0] for c in COLUMNS if any((n, c[0]) in cells for n in ns)]
        md += [f"## {dataset} (mean over owners of each owner's test accuracy; ours / paper (ours − paper))", "",
               "| n | m | " + " | ".join(labels) + " |", "|---:|---:|" + "---|" * len(labels)]
        for n in ns:
            means = {lb: float(np.mean(cells[(n, lb)])) for lb in labels if (n, lb) in cells}
            best = max((means[lb] for lb in COMPARED if lb in means), default=None)
            row = [str(n), f"{10_000 / n:.2f}"]
            for label, _, key in COLUMNS:
                if label not in labels:
                    continue
                v = cells.get((n, label))
                if not v:
                    row.append("—")
                    continue
                m, sd = float(np.mean(v)), float(np.std(v))
                ours = f"{m:.3f}" + (f" ± {sd:.3f}" if len(v) > 1 else "") + f" ({len(v)})"
                if label in COMPARED and best is not None and m == best:
                    ours = f"**{ours}**"
                p = paper.get(n, {}).get(key) if key else None
                row.append(ours + (f" / {p[0]:.3f} ({m - p[0]:+.3f})" if p else ""))
                rows.append({"dataset": dataset, "n": n, "column": label, "ours_mean": m,
                             "ours_std": sd, "runs": len(v), "paper_mean": p[0] if p else None,
                             "paper_std": p[1] if p else None, "diff": m - p[0] if p else None})
            md.append("| " + " | ".join(row) + " |")
        md += ["", "(k): runs (seeds) behind the cell; bold: best of per-silo, full-DP, joint-DP.", "",
               "Claims of the paper on these numbers:", ""] + _claims(cells, ns) + [""]
    text = "\n".join(md)
    (out / f"{layout}.md").write_text(text + "\n")
    with open(out / f"{layout}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["dataset"])
        w.writeheader()
        w.writerows(rows)
    _plot(layout, summaries, out)
    return text


def _plot(layout: str, summaries: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = [d for d in HUANG_TABLE1 if _cells(summaries, d)]
    if not datasets:
        return
    fig, axes = plt.subplots(1, len(datasets), figsize=(6.5 * len(datasets), 4.5), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        cells, paper = _cells(summaries, dataset), HUANG_TABLE1[dataset]
        for i, (label, _, key) in enumerate(COLUMNS):
            pts = sorted((n, float(np.mean(v))) for (n, lb), v in cells.items() if lb == label)
            if not pts:
                continue
            color = f"C{i}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=f"{label} (ours)")
            if key and label != "joint-DP, paper mode (heuristic)":
                pn = sorted(paper)
                ax.plot(pn, [paper[n][key][0] for n in pn], "--", color=color, alpha=0.6,
                        label=f"{label} (paper)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("owners n (N = 10,000 records, one per user)")
        ax.set_ylabel("mean over owners of test accuracy")
        ax.set_title(f"{dataset}: Huang et al. protocol, ε = 1, δ = 1e-4, certified")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(out / f"{layout}.png", dpi=120)
    plt.close(fig)
