"""The paper's layouts beside its numbers: ``fedudp-report DIR --paper huang_table1``,
``huang_table2``, ``huang_table4``, ``huang_fig1``.

A layout has rows (n for Table 1; the personal layers for Table 2; (n, m/r) for Table 4;
(n, ε) for Figure 1) and columns (methods and variants), each cell the mean ± std over seeds of
the mean over owners of each owner's test accuracy, the paper's number and the difference beside
it, the best of the compared columns in bold as in the paper. Writes ``<name>.md``,
``<name>.csv`` and ``<name>.png`` (ours solid, the paper's dashed) and, for Table 1, states the
paper's qualitative claims as holds / does not hold on the numbers found."""

from __future__ import annotations

import csv
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedudp.privacy.labels import HEURISTIC_MARK, is_heuristic

__all__ = ["HUANG_TABLE1", "HUANG_TABLE2", "HUANG_TABLE4", "PROTOCOL", "Layout", "LAYOUTS",
           "PRESET_HYPER", "write_paper_report"]  # fmt: skip

# Huang et al. (001) Table 1: test accuracy, mean ± std over 5 runs, ε = 1
HUANG_TABLE1 = {
    "mnist": {
        4: {
            "per_silo": (0.9445, 0.0069),
            "fedavg": (0.9602, 0.0017),
            "full_dp": (0.4444, 0.0844),
            "joint_dp": (0.4658, 0.0307),
        },
        16: {
            "per_silo": (0.9457, 0.0038),
            "fedavg": (0.9468, 0.0014),
            "full_dp": (0.2926, 0.0239),
            "joint_dp": (0.3207, 0.0690),
        },
        64: {
            "per_silo": (0.9209, 0.0010),
            "fedavg": (0.9402, 0.0037),
            "full_dp": (0.6982, 0.0314),
            "joint_dp": (0.7651, 0.0401),
        },
        128: {
            "per_silo": (0.8639, 0.0010),
            "fedavg": (0.9376, 0.0043),
            "full_dp": (0.8081, 0.0240),
            "joint_dp": (0.8169, 0.0160),
        },
        256: {
            "per_silo": (0.7678, 0.0015),
            "fedavg": (0.9196, 0.0028),
            "full_dp": (0.7399, 0.0324),
            "joint_dp": (0.7835, 0.0136),
        },
        512: {
            "per_silo": (0.7240, 0.0001),
            "fedavg": (0.9326, 0.0093),
            "full_dp": (0.6023, 0.0621),
            "joint_dp": (0.7423, 0.0832),
        },
    },
    "fashion_mnist": {
        4: {
            "per_silo": (0.8888, 0.0253),
            "fedavg": (0.8759, 0.0042),
            "full_dp": (0.4560, 0.0142),
            "joint_dp": (0.4533, 0.0121),
        },
        16: {
            "per_silo": (0.8575, 0.0135),
            "fedavg": (0.8301, 0.0078),
            "full_dp": (0.4044, 0.0473),
            "joint_dp": (0.4205, 0.0539),
        },
        64: {
            "per_silo": (0.8498, 0.0041),
            "fedavg": (0.8232, 0.0088),
            "full_dp": (0.5354, 0.0249),
            "joint_dp": (0.5564, 0.0207),
        },
        128: {
            "per_silo": (0.7506, 0.0017),
            "fedavg": (0.7676, 0.0123),
            "full_dp": (0.6593, 0.0137),
            "joint_dp": (0.6719, 0.0272),
        },
        256: {
            "per_silo": (0.6489, 0.0004),
            "fedavg": (0.8010, 0.0018),
            "full_dp": (0.6749, 0.0160),
            "joint_dp": (0.6908, 0.0145),
        },
        512: {
            "per_silo": (0.6355, 0.0007),
            "fedavg": (0.8242, 0.0069),
            "full_dp": (0.6484, 0.0227),
            "joint_dp": (0.6667, 0.0062),
        },
    },
}


# Table 2 (n = 256 per its numbers, ε = 1): joint-DP accuracy by personal layers (() = full-DP)
HUANG_TABLE2 = {
    (): (0.7399, 0.0324),
    ("conv1",): (0.7240, 0.0130),
    ("conv2",): (0.7090, 0.0014),
    ("conv1", "conv2"): (0.1863, 0.0329),
    ("fc1",): (0.7835, 0.0136),
    ("conv1", "fc1"): (0.6606, 0.0259),
    ("conv2", "fc1"): (0.7291, 0.0320),
    ("conv1", "conv2", "fc1"): (0.1727, 0.0419),
}
# Table 4 (MNIST): (n, m/r) -> full-DP ε=1, joint-DP ε=1, 3, 8 (per-silo and FedAvg as Table 1)
HUANG_TABLE4 = {
    (4, 1): (0.4444, 0.4658, 0.5841, 0.8103),
    (4, 2): (0.2867, 0.3297, 0.5011, 0.6576),
    (4, 5): (0.1986, 0.2064, 0.2867, 0.4802),
    (4, 10): (0.1526, 0.1708, 0.2644, 0.3709),
    (4, 20): (0.1517, 0.1691, 0.1864, 0.2741),
    (256, 1): (0.7399, 0.7835, 0.8124, 0.8896),
    (256, 2): (0.2606, 0.3930, 0.6962, 0.8160),
    (256, 5): (0.1700, 0.2517, 0.3715, 0.7020),
    (256, 10): (0.1450, 0.1603, 0.2764, 0.4703),
    (256, 20): (0.1089, 0.1297, 0.2400, 0.2941),
}


PROTOCOL = (
    "standard FedAvg, E and T of Table 3; DP-SGD inside the owners\n(clip 15, batch 32, "
    "δ = 1e-4), server placement where marked"
)


def _config(s: dict, key: str, default: Any = None) -> Any:
    node: Any = s.get("_config", {})
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _is(
    method: str,
    placement: str | None = None,
    accounting: str | None = None,
    epsilon: float | None = None,
) -> Callable[[dict], bool]:
    def f(s: dict) -> bool:
        return (
            s.get("method") == method
            and (placement is None or s.get("placement") == placement)
            and (accounting is None or s.get("accounting") == accounting)
            and (epsilon is None or s.get("target_epsilon") == epsilon)
        )

    return f


@dataclass
class Layout:
    """Rows, columns and the paper's numbers of one table or figure."""

    title: str
    row_of: Callable[[dict], Any]  # a run's row key, None: not in this layout
    row_label: Callable[[Any], str]
    columns: list[tuple[str, Callable[[dict], bool], Callable[[Any], tuple | None]]]
    compared: tuple[str, ...] = ()  # bold the best of these columns
    x_of: Callable[[Any], float] | None = None  # the plot: x per row ...
    series_of: Callable[[Any], str] = lambda row: ""  # ... and one line per series
    x_label: str = ""
    paper_rows: Callable[[str], list] = lambda series: []  # rows with a paper number, per series
    claims: Callable[[dict, list], list[str]] | None = None  # the paper's claims, judged
    extra: dict = field(default_factory=dict)
    # a horizontal reference line per series (Figure 1: per-silo at that n), from the runs
    reference: Callable[[dict], tuple[str, str] | None] | None = None


def _t1(key: str) -> Callable[[Any], tuple | None]:
    return lambda row: HUANG_TABLE1.get(row[0], {}).get(row[1], {}).get(key)


def _personal(s: dict) -> tuple[str, ...]:
    if s.get("method") == "full_dp":
        return ()
    pats = _config(s, "model.personal", []) or ["fc1"]
    return tuple(sorted({p.split(".")[0] for p in pats}))


def _default_split(s: dict) -> bool:
    """The presets' parameter split: full-DP, or joint-DP with FC1 personal (Table 1, Fig. 1)."""
    return _personal(s) in ((), ("fc1",))


def _records_per_user(s: dict) -> int:
    return int(_config(s, "partition.records_per_user", 1) or 1)


def _t4_is(method: str, eps: float, accounting: str, group: bool) -> Callable[[dict], bool]:
    """Table 4's cells: user-level clipping (certified), or record-level DP-SGD with the
    group-privacy conversion (``privacy.group_privacy``; the paper's form in paper mode)."""
    base = _is(method, "local_dpsgd", accounting, eps)
    return lambda s: base(s) and bool(_config(s, "privacy.group_privacy", False)) == group


def _t4(i: int) -> Callable[[Any], tuple | None]:
    return lambda row: (HUANG_TABLE4[row][i], None) if row in HUANG_TABLE4 else None


LAYOUTS = {
    "huang_table1": Layout(
        "Huang et al. Table 1 (ε = 1, δ = 1e-4)",
        lambda s: (
            (s.get("dataset", "mnist"), int(s["num_owners"]))
            if _records_per_user(s) == 1
            and s.get("target_epsilon") in (None, 1.0)
            and _default_split(s)
            else None
        ),
        lambda row: f"{row[0]} | {row[1]} | {10_000 / row[1]:.2f}",
        [
            ("per-silo", _is("per_silo"), _t1("per_silo")),
            ("FedAvg (no DP)", _is("fedavg"), _t1("fedavg")),
            ("full-DP", _is("full_dp", "local_dpsgd", "certified"), _t1("full_dp")),
            ("joint-DP", _is("joint_dp", "local_dpsgd", "certified"), _t1("joint_dp")),
            (
                "joint-DP, paper mode (heuristic)",
                _is("joint_dp", "local_dpsgd", "paper"),
                _t1("joint_dp"),
            ),
            ("full-DP, server placement", _is("full_dp", "server", "certified"), lambda row: None),
            (
                "joint-DP, server placement",
                _is("joint_dp", "server", "certified"),
                lambda row: None,
            ),
        ],
        compared=("per-silo", "full-DP", "joint-DP"),
        x_of=lambda row: row[1],
        series_of=lambda row: row[0],
        x_label="owners n (N = 10,000 records, one per user)",
        paper_rows=lambda ds: [(ds, n) for n in sorted(HUANG_TABLE1.get(ds, {}))],
        claims=lambda c, r: _claims(c, r),
        extra={"row_header": "dataset | n | m"},
    ),
    "huang_table2": Layout(
        "Huang et al. Table 2 (joint-DP by personal layers, ε = 1)",
        lambda s: (
            _personal(s)
            if s.get("method") in ("full_dp", "joint_dp")
            and s.get("placement") == "local_dpsgd"
            and s.get("accounting") in ("certified", "paper")
            and s.get("target_epsilon") == 1.0
            and _records_per_user(s) == 1
            and int(s["num_owners"]) == 256
            and s.get("dataset", "mnist") == "mnist"
            else None
        ),
        lambda row: " + ".join(row) or "none (full-DP)",
        # certified: shared gradients at the public personal value
        # (docs/algorithms.md#certified-vs-paper-accounting); paper mode: at the owner's own personal layers, as the paper trains (heuristic)
        [
            (
                "certified",
                lambda s: s.get("accounting") == "certified",
                lambda row: HUANG_TABLE2.get(row),
            ),
            (
                "paper mode (heuristic)",
                lambda s: s.get("accounting") == "paper",
                lambda row: HUANG_TABLE2.get(row),
            ),
        ],
        extra={"row_header": "personal layers"},
        claims=lambda c, r: _claims_table2(c, r),
    ),
    "huang_table4": Layout(
        "Huang et al. Table 4 (records per user m/r)",
        lambda s: (
            (int(s["num_owners"]), _records_per_user(s))
            if _default_split(s)
            and s.get("dataset", "mnist") == "mnist"
            and int(s["num_owners"]) in (4, 256)
            else None
        ),
        lambda row: f"{row[0]} | {row[1]}",
        [
            (f"{m}-DP ε={e:g}{lab}", _t4_is(f"{m}_dp", e, acc, grp), _t4(i))
            for acc, grp, lab in (
                ("certified", False, ""),
                ("paper", True, f" {HEURISTIC_MARK}, paper group privacy"),
                ("certified", True, ", group privacy (certified)"),
            )
            for i, (m, e) in enumerate(
                (("full", 1.0), ("joint", 1.0), ("joint", 3.0), ("joint", 8.0))
            )
        ],
        x_of=lambda row: row[1],
        series_of=lambda row: f"n={row[0]}",
        x_label="records per user m/r",
        paper_rows=lambda ser: sorted(r for r in HUANG_TABLE4 if f"n={r[0]}" == ser),
        extra={"row_header": "n | m/r"},
    ),
    "huang_fig1": Layout(
        "Huang et al. Figure 1 (accuracy vs ε; the paper gives a plot, no numbers)",
        lambda s: (
            (int(s["num_owners"]), float(s["target_epsilon"]))
            if s.get("target_epsilon")
            and _default_split(s)
            and _records_per_user(s) == 1
            and s.get("dataset", "mnist") == "mnist"
            else None
        ),
        lambda row: f"{row[0]} | {row[1]:g}",
        [
            ("full-DP", _is("full_dp", "local_dpsgd", "certified"), lambda row: None),
            ("joint-DP", _is("joint_dp", "local_dpsgd", "certified"), lambda row: None),
        ],
        x_of=lambda row: row[1],
        series_of=lambda row: f"n={row[0]}",
        x_label="ε",
        extra={"row_header": "n | ε"},
        claims=lambda c, r: _claims_fig1(c, r),
        reference=lambda s: (
            (f"n={int(s['num_owners'])}", "per-silo (no DP)")
            if s.get("method") == "per_silo"
            and _records_per_user(s) == 1
            and s.get("dataset", "mnist") == "mnist"
            else None
        ),
    ),
}


# The presets' hyperparameters (conf/experiment/huang_table1.yaml: the paper's clip, and
# the lr and batch it leaves unspecified). Runs made with others (ablations beside the grid) are
# kept out of every layout, which compares with the paper's protocol only.
PRESET_HYPER = {"privacy.clip": 15.0, "train.lr": 0.05, "train.batch_size": 32}


def _preset_hyper(s: dict) -> bool:
    """True when the run used the presets' clip, lr and batch (or its config does not say)."""
    return all(_config(s, key) in (None, value) for key, value in PRESET_HYPER.items())


def _cells(layout: Layout, summaries: list[dict]) -> dict[tuple[Any, str], list[float]]:
    out: dict[tuple[Any, str], list[float]] = {}
    for s in summaries:
        if s.get("stop_reason") not in ("completed", "budget") or not _preset_hyper(s):
            continue
        row = layout.row_of(s)
        if row is None:
            continue
        for label, match, _ in layout.columns:
            # a heuristic ε only under a column that says so, and never under one that does not
            if match(s) and is_heuristic(s) == (HEURISTIC_MARK in label):
                out.setdefault((row, label), []).append(float(s["accuracy_mean"]))
    return out


def _claims(cells: dict, rows: list) -> list[str]:
    def mean(row, label):
        v = cells.get((row, label))
        return float(np.mean(v)) if v else None

    lines = []
    for ds in sorted({r[0] for r in rows}):
        rs = [r for r in rows if r[0] == ds]
        pairs = [(r[1], mean(r, "joint-DP"), mean(r, "full-DP")) for r in rs]
        pairs = [p for p in pairs if None not in p]
        if pairs:
            ok = all(j >= f for _, j, f in pairs)
            lines.append(
                f"- {ds}: joint-DP ≥ full-DP at ε = 1 (certified): "
                f"{'holds' if ok else 'does not hold'} on the n run ("
                + ", ".join(f"n={n}: {j:.3f} vs {f:.3f}" for n, j, f in pairs)
                + ")"
            )
        big = [(r[1], mean(r, "joint-DP"), mean(r, "per-silo")) for r in rs if r[1] >= 256]
        big = [p for p in big if None not in p]
        if big:
            ok = all(j > p for _, j, p in big)
            lines.append(
                f"- {ds}: joint-DP beats per-silo for n ≥ 256: "
                f"{'holds' if ok else 'does not hold'} on the n run ("
                + ", ".join(f"n={n}: {j:.3f} vs {p:.3f}" for n, j, p in big)
                + ")"
            )
        for label in ("full-DP", "joint-DP"):
            seq = [(r[1], mean(r, label)) for r in rs if mean(r, label) is not None]
            if len(seq) >= 3:
                v = [x for _, x in seq]
                mono = all(a <= b for a, b in itertools.pairwise(v)) or all(
                    a >= b for a, b in itertools.pairwise(v)
                )
                lines.append(
                    f"- {ds}: {label} accuracy non-monotone in n: "
                    f"{'does not hold' if mono else 'holds'} ("
                    + ", ".join(f"n={n}: {x:.3f}" for n, x in seq)
                    + ")"
                )
    return lines or ["- not enough runs yet to judge any claim"]


def _claims_table2(cells: dict, rows: list) -> list[str]:
    """Personalising a layer below a shared one (conv1 or conv2 personal; FC2 is always shared
    and above them) hurts: each such subset scores below FC1 alone personal. Judged per
    column (certified, paper mode), each on its own runs."""
    out = []
    for col in ("certified", "paper mode (heuristic)"):
        mean = {r: float(np.mean(cells[(r, col)])) for r in rows if (r, col) in cells}
        top = mean.get(("fc1",))
        below = {r: v for r, v in mean.items() if any(l in ("conv1", "conv2") for l in r)}
        if top is None or not below:
            if mean:
                out.append(
                    f"- personalising layers below shared ones hurts ({col}): not enough runs "
                    "yet (needs FC1 alone and a subset with a convolution personal)"
                )
            continue
        ok = all(v < top for v in below.values())
        out.append(
            f"- personalising layers below shared ones hurts ({col}): "
            f"{'holds' if ok else 'does not hold'} (FC1 alone {top:.3f}; "
            + ", ".join(f"{' + '.join(r)} {v:.3f}" for r, v in sorted(below.items()))
            + ")"
        )
    return out or [
        "- personalising layers below shared ones hurts: not enough runs yet (needs FC1 "
        "alone and a subset with a convolution personal)"
    ]


def _claims_fig1(cells: dict, rows: list) -> list[str]:
    """Joint-DP's advantage over full-DP shrinks as ε grows: per n, the gap at the largest ε
    run is below the gap at the smallest."""
    lines = []
    for n in sorted({r[0] for r in rows}):
        gaps = [
            (r[1], float(np.mean(cells[(r, "joint-DP")])) - float(np.mean(cells[(r, "full-DP")])))
            for r in sorted(rows)
            if r[0] == n and (r, "joint-DP") in cells and (r, "full-DP") in cells
        ]
        if len(gaps) < 2:
            continue
        ok = gaps[-1][1] < gaps[0][1]
        lines.append(
            f"- n={n}: joint-DP's advantage over full-DP shrinks as ε grows: "
            f"{'holds' if ok else 'does not hold'} (joint − full: "
            + ", ".join(f"ε={e:g}: {g:+.3f}" for e, g in gaps)
            + ")"
        )
    return lines or [
        "- joint-DP's advantage shrinking with ε: not enough runs yet (needs two ε "
        "with both methods at one n)"
    ]


def write_paper_report(name: str, summaries: list[dict], out: Path) -> str:
    """Write the layout ``name`` under ``out``; returns the Markdown."""
    layout = LAYOUTS[name]
    out.mkdir(parents=True, exist_ok=True)
    cells = _cells(layout, summaries)
    rows = sorted({r for r, _ in cells}, key=lambda r: (len(r), r) if isinstance(r, tuple) else r)
    labels = [c[0] for c in layout.columns if any((r, c[0]) in cells for r in rows)]
    md = [
        f"# {layout.title}, reproduced",
        "",
        "Each cell: ours, mean ± std over seeds (runs) / the paper's number (ours − paper).",
        "",
        f"| {layout.extra.get('row_header', 'row')} | " + " | ".join(labels) + " |",
        "|" + "---|" * (len(layout.extra.get("row_header", "row").split("|")) + len(labels)),
    ]
    table = []
    for row in rows:
        means = {lb: float(np.mean(cells[(row, lb)])) for lb in labels if (row, lb) in cells}
        best = max((means[lb] for lb in layout.compared if lb in means), default=None)
        line = [layout.row_label(row)]
        for label, _, paper_of in layout.columns:
            if label not in labels:
                continue
            v = cells.get((row, label))
            if not v:
                line.append("—")
                continue
            m, sd = float(np.mean(v)), float(np.std(v))
            ours = f"{m:.3f}" + (f" ± {sd:.3f}" if len(v) > 1 else "") + f" ({len(v)})"
            if label in layout.compared and best is not None and m == best:
                ours = f"**{ours}**"
            p = paper_of(row)
            line.append(ours + (f" / {p[0]:.3f} ({m - p[0]:+.3f})" if p else ""))
            table.append(
                {
                    "row": layout.row_label(row).replace(" | ", "/"),
                    "column": label,
                    "ours_mean": m,
                    "ours_std": sd,
                    "runs": len(v),
                    "paper_mean": p[0] if p else None,
                    "diff": m - p[0] if p else None,
                }
            )
        md.append("| " + " | ".join(line) + " |")
    if layout.compared:
        md += ["", "Bold: the best of " + ", ".join(layout.compared) + "."]
    if any(HEURISTIC_MARK in lb for lb in labels):
        md += [
            "",
            f"{HEURISTIC_MARK}: ε from privacy.accounting=paper (the paper's unproven "
            "accounting or group-privacy form), not a proven (ε, δ) guarantee.",
        ]
    refs = _references(layout, summaries, {layout.series_of(r) for r in rows})
    if refs:
        md += [
            "",
            "Reference lines: "
            + "; ".join(
                f"{ser}: {lb} {np.mean(v):.3f} ({len(v)})" for (ser, lb), v in sorted(refs.items())
            ),
        ]
    if layout.claims is not None:
        md += ["", "The paper's claims on these numbers:", ""] + layout.claims(cells, rows)
    text = "\n".join(md)
    (out / f"{name}.md").write_text(text + "\n")
    with open(out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(
            f, fieldnames=["row", "column", "ours_mean", "ours_std", "runs", "paper_mean", "diff"]
        )
        w.writeheader()
        w.writerows(table)
    if layout.x_of is not None and cells:
        _plot(name, layout, cells, rows, out, refs)
    return text


def _references(
    layout: Layout, summaries: list[dict], series: set
) -> dict[tuple[str, str], list[float]]:
    out: dict[tuple[str, str], list[float]] = {}
    if layout.reference is None:
        return out
    for s in summaries:
        ref = layout.reference(s) if s.get("stop_reason") in ("completed", "budget") else None
        if ref is not None and ref[0] in series:
            out.setdefault(ref, []).append(float(s["accuracy_mean"]))
    return out


def _plot(
    name: str, layout: Layout, cells: dict, rows: list, out: Path, refs: dict | None = None
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_of = layout.x_of
    assert x_of is not None  # only layouts with a plot are plotted
    series = list(dict.fromkeys(layout.series_of(r) for r in sorted(rows)))  # numeric order
    fig, axes = plt.subplots(1, len(series), figsize=(6.5 * len(series), 4.5), squeeze=False)
    most = 0
    for ax, ser in zip(axes[0], series):
        rs = sorted((r for r in rows if layout.series_of(r) == ser), key=x_of)
        for i, (label, _, paper_of) in enumerate(layout.columns):
            pts = [(x_of(r), float(np.mean(cells[(r, label)]))) for r in rs if (r, label) in cells]
            if not pts:
                continue
            ax.plot(*zip(*pts), "o-", color=f"C{i}", label=f"{label} (ours)")
            pp = [
                (x_of(r), paper[0])
                for r in sorted(set(rs) | set(layout.paper_rows(ser)), key=x_of)
                if (paper := paper_of(r))
            ]
            if pp and "paper mode" not in label:
                ax.plot(*zip(*pp), "--", color=f"C{i}", alpha=0.6, label=f"{label} (paper)")
        for (rser, label), v in (refs or {}).items():
            if rser == ser:
                ax.axhline(float(np.mean(v)), color="gray", ls=":", label=label)
        ax.set_xscale("log", base=2 if name != "huang_fig1" else 10)
        ax.set_xlabel(layout.x_label)
        ax.set_ylabel("mean over owners of test accuracy")
        data = "" if layout.title.startswith("Huang et al. Table 1") else "MNIST, "
        ax.set_title(
            f"{data}{ser}: {layout.title}\n{PROTOCOL};\ncertified accounting unless marked",
            fontsize=8,
        )
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        handles = ax.get_legend_handles_labels()[0]  # below the panel: never over the data
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
        most = max(most, len(handles))
    fig.set_size_inches(6.5 * len(series), 4.5 + 0.16 * -(-most // 2))
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120, bbox_inches="tight")
    plt.close(fig)
