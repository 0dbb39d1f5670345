"""Plots for any sweep folder: ``fedudp-report SWEEP --plots`` (or ``--out DIR``).

Writes, beside the comparison table (``report.md``, the table ``fedudp-report`` prints, with the
two figures below it):

* ``curves.png``: test accuracy (mean over owners) and ε per round, two panels, one colour per
  group of the table (runs that differ only in ``seed``, ``fedudp.report.groups_of``): a thick
  line for the mean over the group's seeds (over the seeds that have that round), a thin line
  for each seed. Read from each run's ``metrics.jsonl``.
* ``frontier.png``: the privacy–utility frontier, final accuracy (``summary.json``'s
  ``accuracy_mean``, mean ± std over seeds) against the ε spent (``summary.json``'s
  ``epsilon``, mean over seeds). One line per setting that is not the ε target (usually one
  per method): its points are its groups, sorted by ε. Groups without an ε (fedavg, per_silo:
  no DP, ε = ∞) are horizontal reference lines, labelled so.

A heuristic ε (``epsilon_kind: heuristic``, ``privacy.accounting=paper``) is drawn dashed with
hollow markers and its legend entry ends ``(heuristic)``, in both figures. Legend labels name
the keys that differ between groups (``method=joint_dp, privacy.epsilon=1.0``), as the table's
first columns do. ``group_series`` returns the numbers the figures draw.
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedudp.privacy.labels import HEURISTIC_MARK, epsilon_kind, metric_epsilon
from fedudp.report.report import _value, comparison_table, group_order, groups_of, varying_keys

__all__ = [
    "RunCurve",
    "GroupSeries",
    "group_series",
    "frontier_lines",
    "plot_curves",
    "plot_frontier",
    "write_report",
]

# Keys that set the privacy level: a frontier line runs along them (every other differing key
# separates lines). target_epsilon: the key of runs without config.yaml.
_EPSILON_KEYS = ("privacy.epsilon", "privacy.noise_multiplier", "target_epsilon")
_NO_CONFIG = "(no config.yaml)"


@dataclass
class RunCurve:
    """One run's per-round numbers (``metrics.jsonl``): ``{round: value}``, rounds without the
    value (not evaluated that round, no DP) left out.

    Attributes
    ----------
    folder : str
        The run folder.
    seed : Any
        The run's seed.
    accuracy, epsilon : dict[int, float]
        Round to mean test accuracy; round to ε spent.
    """

    folder: str
    seed: Any
    accuracy: dict[int, float]
    epsilon: dict[int, float]


@dataclass
class GroupSeries:
    """One group of the table (one row): what the figures draw for it.

    Attributes
    ----------
    label : str
        The differing keys, e.g. ``"method=joint_dp, privacy.epsilon=1.0"``.
    settings : dict[str, Any]
        Those keys' values.
    method, epsilon_kind : str or None
        The method; ``certified``, ``heuristic`` or None (no DP).
    deltas : tuple[float, ...]
        The runs' δ.
    runs : list[RunCurve]
        The group's runs (one per seed).
    accuracy, epsilon : dict[int, float]
        Round to the mean over the runs that have that round.
    final_accuracy, final_accuracy_std, final_epsilon : float or None
        summary.json's accuracy (mean, population std over runs) and mean ε (None: no ε).
    with_config : bool, default True
        Whether the runs have a config.yaml.
    frontier_key : tuple
        The settings one frontier line shares.
    """

    label: str  # the differing keys, e.g. "method=joint_dp, privacy.epsilon=1.0"
    settings: dict[str, Any]  # those keys' values
    method: str | None
    epsilon_kind: str | None  # certified | heuristic | None (no DP)
    deltas: tuple[float, ...]
    runs: list[RunCurve]
    accuracy: dict[int, float]  # round -> mean over the runs that have that round
    epsilon: dict[int, float]
    final_accuracy: float | None  # summary.json accuracy_mean, mean over runs
    final_accuracy_std: float | None  # std (population) over runs
    final_epsilon: float | None  # summary.json epsilon, mean over runs; None: no ε
    with_config: bool = True
    frontier_key: tuple = field(default=())  # the settings one frontier line shares

    @property
    def heuristic(self) -> bool:
        return self.epsilon_kind == "heuristic"

    @property
    def private(self) -> bool:
        return self.final_epsilon is not None

    @property
    def display_label(self) -> str:
        """The legend text: the label, the runs averaged, and the heuristic mark."""
        n = len(self.runs)
        text = f"{self.label} [{n} seed{'s' if n != 1 else ''}]"
        if self.heuristic:
            text += f" {HEURISTIC_MARK}"
        return text


def _metrics(folder: str) -> list[dict]:
    path = Path(folder) / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def _run_curve(s: dict) -> RunCurve:
    acc: dict[int, float] = {}
    eps: dict[int, float] = {}
    for m in _metrics(s["_dir"]):
        r = m.get("round")
        if not isinstance(r, int):
            continue
        if (a := _finite(m.get("accuracy_mean"))) is not None:
            acc[r] = a
        if (e := _finite(metric_epsilon(m))) is not None:  # epsilon or epsilon_heuristic
            eps[r] = e
    saved = s.get("_config")  # the run's config.yaml as a dict
    return RunCurve(s["_dir"], saved.get("seed") if isinstance(saved, dict) else None, acc, eps)


def _mean_per_round(curves: list[dict[int, float]]) -> dict[int, float]:
    rounds = sorted({r for c in curves for r in c})
    return {r: float(np.mean([c[r] for c in curves if r in c])) for r in rounds}


def _label(settings: dict, varying: list[str], method: Any) -> str:
    keys = ["method"] + [k for k in varying if k != "method"]
    parts = []
    for k in keys:
        v = settings.get(k, method if k == "method" else None)
        if k == "method" or k in settings:
            parts.append(f"{k}={_value(v)}")
    return ", ".join(parts)


def group_series(summaries: list[dict]) -> list[GroupSeries]:
    """One ``GroupSeries`` per group of the comparison table, in the table's order (runs with a
    config.yaml first, then those without).

    Parameters
    ----------
    summaries
        ``load_summaries``' summaries.

    Returns
    -------
    list of GroupSeries
        The groups' curves and final numbers.
    """
    out: list[GroupSeries] = []
    for groups, with_config in zip(groups_of(summaries), (True, False)):
        if not groups:
            continue
        _, varying = varying_keys(groups)
        for settings, ss in sorted(groups.values(), key=group_order(varying)):
            method = settings.get("method", ss[0].get("method"))
            runs = [_run_curve(s) for s in ss]
            accs = [a for s in ss if (a := _finite(s.get("accuracy_mean"))) is not None]
            epss = [e for s in ss if (e := _finite(s.get("epsilon"))) is not None]
            kinds = {epsilon_kind(s) for s in ss}
            kind = (
                "heuristic"
                if "heuristic" in kinds
                else ("certified" if "certified" in kinds else None)
            )
            label = _label(settings, varying, method)
            if not with_config:
                label = f"{_NO_CONFIG} {label}"
            line = tuple((k, settings.get(k)) for k in varying if k not in _EPSILON_KEYS)
            out.append(
                GroupSeries(
                    label=label,
                    settings={k: settings.get(k) for k in varying if k in settings},
                    method=None if method is None else str(method),
                    epsilon_kind=kind,
                    deltas=tuple(
                        sorted(
                            {float(s["delta"]) for s in ss if _finite(s.get("delta")) is not None}
                        )
                    ),
                    runs=runs,
                    accuracy=_mean_per_round([r.accuracy for r in runs]),
                    epsilon=_mean_per_round([r.epsilon for r in runs]),
                    final_accuracy=float(np.mean(accs)) if accs else None,
                    final_accuracy_std=float(np.std(accs)) if accs else None,
                    final_epsilon=float(np.mean(epss)) if epss else None,
                    with_config=with_config,
                    frontier_key=(with_config, str(method), kind) + line,
                )
            )
    return out


def _epsilon(g: GroupSeries) -> float:
    """A frontier group's ε (its lines hold private groups only)."""
    assert g.final_epsilon is not None
    return g.final_epsilon


def frontier_lines(
    series: list[GroupSeries],
) -> tuple[list[tuple[str, list[GroupSeries]]], list[GroupSeries]]:
    """The privacy–utility frontier's lines.

    A line holds the groups that share every differing key but the ε target, and the kind of
    ε; its label names those keys.

    Parameters
    ----------
    series
        ``group_series``' groups.

    Returns
    -------
    tuple
        (the lines: (label, groups sorted by ε), the reference groups without ε).
    """
    lines: dict[tuple, list[GroupSeries]] = {}
    refs = []
    for g in series:
        if g.private and g.final_accuracy is not None:
            lines.setdefault(g.frontier_key, []).append(g)
        elif g.final_accuracy is not None:
            refs.append(g)
    out = []
    for key, gs in lines.items():
        with_config, method, kind = key[:3]
        label = ", ".join(
            [f"method={method}"] + [f"{k}={_value(v)}" for k, v in key[3:] if k != "method"]
        )
        if not with_config:
            label = f"{_NO_CONFIG} {label}"
        if kind == "heuristic":
            label += f" {HEURISTIC_MARK}"
        out.append((label, sorted(gs, key=_epsilon)))
    return out, refs


# -- drawing --------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _color(i: int) -> str:
    return f"C{i % 10}"


def _style(heuristic: bool) -> dict:
    return {"ls": "--" if heuristic else "-"}


def _marker(i: int) -> str:
    return "osD^v<>ph*"[(i // 10) % 10]


def _delta_text(series: list[GroupSeries]) -> tuple[str, bool]:
    """(the ε axis's δ text, whether δ differs between groups and so goes into the labels)."""
    deltas = sorted({d for g in series if g.private for d in g.deltas})
    if len(deltas) == 1:
        return f"δ={deltas[0]:g}", False
    if not deltas:
        return "", False
    return "each group's δ (in the legend)", True


def _with_delta(label: str, g: GroupSeries, show: bool) -> str:
    return label + (f", δ={'/'.join(f'{d:g}' for d in g.deltas)}" if show and g.deltas else "")


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width)) if text else ""


def _common_line(summaries: list[dict]) -> str:
    table = comparison_table(summaries)
    first = table.splitlines()[0] if table else ""
    if first.startswith("Common settings: "):
        return first.split("; every other key")[0]
    return ""


def plot_curves(series: list[GroupSeries], path: Path, title: str, subtitle: str = "") -> None:
    """Two panels, accuracy and ε per round; a shared legend below them."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    delta, delta_in_label = _delta_text(series)
    fig, (ax_a, ax_e) = plt.subplots(1, 2, figsize=(12, 4.6))
    for i, g in enumerate(series):
        c, st, mk = _color(i), _style(g.heuristic), _marker(i)
        face = "none" if g.heuristic else c
        label = _with_delta(g.display_label, g, delta_in_label)
        if not g.private:
            label += " (no DP: no ε)"
        for ax, mean, per_run in (
            (ax_a, g.accuracy, [r.accuracy for r in g.runs]),
            (ax_e, g.epsilon, [r.epsilon for r in g.runs]),
        ):
            if len(g.runs) > 1:
                for cur in per_run:
                    if cur:
                        ax.plot(list(cur), list(cur.values()), color=c, lw=0.7, alpha=0.45, **st)
            if mean:
                ax.plot(
                    list(mean),
                    list(mean.values()),
                    color=c,
                    lw=2,
                    marker=mk,
                    ms=5,
                    mfc=face,
                    label=label if ax is ax_a else None,
                    **st,
                )
        if not g.accuracy:  # no per-round accuracy: still in the legend
            ax_a.plot([], [], color=c, lw=2, marker=mk, mfc=face, label=label, **st)
    ax_a.set_ylabel("test accuracy (mean over owners)")
    ax_a.set_title("Test accuracy per round")
    ax_e.set_ylabel(f"ε spent at {delta} (cumulative)" if delta else "ε spent (no DP here)")
    curves = [tuple(g.epsilon.items()) for g in series if g.epsilon]
    ax_e.set_title(
        "Privacy spent per round (no line: no DP)"
        + ("\nequal ε every round: those lines coincide" if len(set(curves)) < len(curves) else "")
    )
    for ax in (ax_a, ax_e):
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if not any(g.epsilon for g in series):
        ax_e.set_xlim(ax_a.get_xlim())
        ax_e.text(
            0.5,
            0.5,
            "no group has an ε (no DP)",
            ha="center",
            va="center",
            transform=ax_e.transAxes,
            color="gray",
        )
    heading = title + ("\n" + _wrap(subtitle, 150) if subtitle else "")
    fig.suptitle(heading, fontsize=10)
    handles, labels = ax_a.get_legend_handles_labels()
    note = (
        "thick line: mean over the group's seeds; thin lines: each seed; "
        f'dashed line, hollow markers, "{HEURISTIC_MARK}": heuristic ε'
    )
    fig.tight_layout()
    ncol = 1 if max((len(lb) for lb in labels), default=0) > 60 else 2
    fig.legend(
        handles,
        labels,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=ncol,
        fontsize=8,
        title=note,
        title_fontsize=8,
        frameon=False,
    )
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_frontier(series: list[GroupSeries], path: Path, title: str, subtitle: str = "") -> None:
    """Final accuracy against ε spent, one line per non-ε setting; no-DP groups as
    horizontal reference lines. The legend sits right of the axes."""
    plt = _plt()
    lines, refs = frontier_lines(series)
    delta, delta_in_label = _delta_text(series)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    eps = [_epsilon(g) for _, gs in lines for g in gs]
    for i, (label, gs) in enumerate(lines):
        heur = any(g.heuristic for g in gs)
        c, mk = _color(i), _marker(i)
        x = [g.final_epsilon for g in gs]
        y = [g.final_accuracy for g in gs]
        err = [g.final_accuracy_std if len(g.runs) > 1 else 0.0 for g in gs]
        ax.errorbar(
            x,
            y,
            yerr=err if any(err) else None,
            color=c,
            marker=mk,
            ms=7,
            lw=2,
            mfc="none" if heur else c,
            mew=1.5,
            capsize=3,
            label=_with_delta(label, gs[0], delta_in_label),
            **_style(heur),
        )
    for j, g in enumerate(refs):
        c = _color(len(lines) + j)
        what = "no DP, ε = ∞" if g.epsilon_kind is None else "no ε released"
        ax.axhline(
            g.final_accuracy,
            color=c,
            ls=":",
            lw=1.8,
            label=f"{g.label} ({what}): {g.final_accuracy:.3f} [{len(g.runs)} seed"
            f"{'s' if len(g.runs) != 1 else ''}]",
        )
    if eps and min(eps) > 0 and max(eps) / min(eps) >= 10:
        ax.set_xscale("log")
    if eps:
        lo, hi = min(eps), max(eps)
        pad = (hi - lo) * 0.08 or max(hi * 0.1, 0.1)
        if ax.get_xscale() == "linear":
            ax.set_xlim(max(0.0, lo - pad), hi + pad)
    else:
        ax.text(
            0.5,
            0.5,
            "no group has an ε: reference lines only",
            ha="center",
            va="center",
            transform=ax.transAxes,
            color="gray",
        )
        ax.set_xticks([])
    ax.set_xlabel(
        f"ε spent at {delta} (summary.json, mean over seeds)" if delta else "ε spent (no DP here)"
    )
    ax.set_ylabel("final test accuracy (mean over owners)\nmean ± std over seeds")
    heading = title + ("\n" + _wrap(subtitle, 100) if subtitle else "")
    ax.set_title(heading, fontsize=9)
    ax.grid(alpha=0.3)
    note = (
        "one line per method/setting, its points sorted by ε; error bars: std over seeds;\n"
        f'dotted: no-DP reference line; dashed, hollow markers, "{HEURISTIC_MARK}": heuristic ε'
    )
    fig.tight_layout()  # the axes first; the legend then goes right of them
    ax.legend(
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        fontsize=8,
        title=note,
        title_fontsize=7,
        frameon=False,
        alignment="left",
    )
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_report(summaries: list[dict], out: Path, name: str = "") -> dict[str, Path]:
    """Write ``report.md`` (the comparison table, the figures and what they show),
    ``curves.png`` and ``frontier.png`` under ``out``.

    Parameters
    ----------
    summaries
        ``load_summaries``' summaries.
    out
        The folder to write into (created).
    name
        The sweep's name in the titles.

    Returns
    -------
    dict of str to Path
        The written files by kind (``report``, ``curves``, ``frontier``).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    series = group_series(summaries)
    table = comparison_table(summaries)
    subtitle = _common_line(summaries)
    tag = f" — {name}" if name else ""
    paths = {
        "report": out / "report.md",
        "curves": out / "curves.png",
        "frontier": out / "frontier.png",
    }
    plot_curves(series, paths["curves"], f"Accuracy and ε per round{tag}", subtitle)
    plot_frontier(series, paths["frontier"], f"Privacy–utility frontier{tag}", subtitle)
    md = [
        f"# fedudp-report{tag}",
        "",
        table,
        "",
        "## Accuracy and ε per round",
        "",
        "One colour per row of the table. Thick line: the mean over the row's seeds at each "
        "round (over the seeds that reached it); thin lines: each seed (drawn when a row has "
        "more than one). ε: cumulative, as the ledger accounts it after each round; rows "
        "without DP have no ε line. Dashed lines with hollow markers and `(heuristic)`: a "
        "heuristic ε (privacy.accounting=paper).",
        "",
        "![accuracy and ε per round](curves.png)",
        "",
        "## Privacy–utility frontier",
        "",
        "Final test accuracy (mean over owners; mean ± std over seeds) against the ε spent "
        "(summary.json; mean over seeds). One line per setting other than the ε target "
        "(usually one per method), its points the rows sorted by ε. Dotted horizontal lines: "
        "rows without DP (ε = ∞). Dashed, hollow, `(heuristic)`: a heuristic ε.",
        "",
        "![privacy–utility frontier](frontier.png)",
    ]
    paths["report"].write_text("\n".join(md) + "\n")
    return paths
