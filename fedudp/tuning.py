"""The privacy cost of choosing the best configuration of a sweep (``fedudp-report --select-best``).

Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022
(arXiv:2110.03620); docs/algorithms.md#the-privacy-cost-of-tuning. Each run's summary carries its
whole privacy spend as one dp-accounting event (``dp_event``); this module picks the best
configuration by a summary metric (the mean over its seeds) and reports, beside the chosen run's
own ε:

* **fixed K**: the sweep ran exactly these K runs and the choice looked at all of them, so the
  release is the composition of the K runs' events (``events.composed_selection``). Always valid.
* **random K** (``sweep_size`` poisson / geometric / logarithmic): valid only when the number of
  runs was drawn from that distribution (of mean K) *before* the sweep and every run is the same
  mechanism: then the best run costs ``RepeatAndSelectDpEvent(event, K, shape)``
  (``events.repeat_and_select``). Refused, with the reason, where the runs' events differ.

What the selection covers: the released models and a score computed from them. fedudp's accuracy
is measured on the owners' test records with their personal parameters, outside the DP guarantee
(docs/algorithms.md#what-is-released), so selecting by it leaks through the score itself; the
report says so. A score on public data (or a DP score) is what the theorem assumes.
"""
from __future__ import annotations

import math
from typing import Any

from fedudp.privacy.events import SHAPES, composed_selection, event_from_json, repeat_and_select

SWEEP_SIZES = ("fixed", *SHAPES)


class SelectionError(ValueError):
    """The sweep cannot be selected from (a one-line reason naming the run or the metric)."""


def _metric(s: dict, metric: str) -> float:
    v = s.get(metric)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise SelectionError(f"--select-best {metric}: run {s.get('_dir', '?')} has no finite "
                             f"{metric} (got {v!r}); choose a numeric summary key such as "
                             "accuracy_mean or loss")
    return float(v)


def select_best(groups: dict, metric: str, *, lower: bool = False, sweep_size: str = "fixed"
                ) -> dict[str, Any]:
    """The best group of ``groups`` (``report.groups_of``: ``{key: (settings, runs)}``) by the
    mean of ``metric`` over its runs, and the ε of the choice (module doc)."""
    if sweep_size not in SWEEP_SIZES:
        raise SelectionError(f"--sweep-size must be one of {', '.join(SWEEP_SIZES)}, got "
                             f"{sweep_size!r}")
    items = [(settings, runs) for settings, runs in groups.values()]
    if not items:
        raise SelectionError("--select-best: the sweep has no runs")
    runs = [s for _, rs in items for s in rs]
    for s in runs:
        if s.get("epsilon") is None:
            raise SelectionError(f"--select-best: run {s.get('_dir', '?')} is not private "
                                 f"(method={s.get('method')}); its data are not protected, so no "
                                 "selection ε exists; select among private runs only")
        if not isinstance(s.get("dp_event"), dict):
            raise SelectionError(f"--select-best: run {s.get('_dir', '?')} has no dp_event in its "
                                 "summary.json (its ledger composes blocks without a dp-accounting "
                                 "event, or it was written by an older fedudp); rerun it")
    deltas = {float(s["delta"]) for s in runs}
    if len(deltas) != 1:
        raise SelectionError(f"--select-best: the runs use different privacy.delta {sorted(deltas)};"
                             " a selection ε needs one δ")
    delta = deltas.pop()
    scored = [(sum(_metric(s, metric) for s in rs) / len(rs), settings, rs)
              for settings, rs in items]
    best = (min if lower else max)(scored, key=lambda t: t[0])
    score, settings, chosen = best
    events = [event_from_json(s["dp_event"]) for s in runs]
    fixed_eps, fixed_acc = composed_selection(events, delta)
    heuristic = any(s.get("guarantee") == "heuristic" for s in runs)
    out: dict[str, Any] = {
        "metric": metric, "lower_is_better": lower, "score": score, "settings": settings,
        "chosen_runs": [s.get("_dir") for s in chosen], "configurations": len(items),
        "runs": len(runs), "delta": delta, "heuristic": heuristic,
        "single_run_epsilon": max(float(s["epsilon"]) for s in chosen),
        "fixed_epsilon": fixed_eps, "fixed_accountant": fixed_acc, "sweep_size": sweep_size,
        "random_epsilon": None, "random_refused": None,
    }
    if sweep_size != "fixed":
        keys = {repr(sorted(s["dp_event"].items())) for s in runs}
        if len(keys) > 1:
            out["random_refused"] = (f"the {len(runs)} runs are not one mechanism (their privacy "
                                     f"events differ: {len(keys)} distinct); Papernot & Steinke's "
                                     "bound needs every run to be the same DP algorithm")
        else:
            out["random_epsilon"] = repeat_and_select(events[0], len(runs), sweep_size, delta)
    return out


def selection_lines(sel: dict[str, Any], varying: list[str]) -> list[str]:
    """The selection as Markdown lines (a heading, the choice, a table of ε, the caveats)."""
    mark = " (heuristic)" if sel["heuristic"] else ""
    chosen = ", ".join(f"{k}={sel['settings'].get(k)}" for k in varying) or "the only configuration"
    way = "lowest" if sel["lower_is_better"] else "highest"
    lines = [f"## Best configuration by {sel['metric']} ({way} mean over its seeds)", "",
             f"Chosen: {chosen}: {sel['metric']} {sel['score']:.4f} over {len(sel['chosen_runs'])} "
             f"run(s); {sel['configurations']} configurations, K = {sel['runs']} runs in the sweep, "
             f"δ = {sel['delta']:g}.", "",
             "| ε of | ε | accountant | holds when |", "|---|---:|---|---|",
             f"| one run (the chosen configuration's ledger) | {sel['single_run_epsilon']:.3f}{mark} "
             f"| the run's ledger | the run alone, no choice made from the sweep |",
             f"| the choice, fixed K = {sel['runs']} (composition of every run's events) | "
             f"{sel['fixed_epsilon']:.3f}{mark} | dp-accounting {sel['fixed_accountant'].upper()} | "
             "the sweep ran exactly these runs |"]
    if sel["sweep_size"] != "fixed":
        if sel["random_epsilon"] is not None:
            lines.append(f"| the choice, K ~ {sel['sweep_size']} of mean {sel['runs']} "
                         f"(RepeatAndSelectDpEvent, Papernot & Steinke 2022) | "
                         f"{sel['random_epsilon']:.3f}{mark} | dp-accounting RDP | the number of "
                         "runs was drawn from this distribution before the sweep |")
        else:
            lines.append(f"| the choice, K ~ {sel['sweep_size']} of mean {sel['runs']} | refused | "
                         f"- | {sel['random_refused']} |")
    lines += ["", f"The choice reads {sel['metric']}, which fedudp computes on the owners' test "
              "records with their personal parameters, outside the DP guarantee: the ε above cover "
              "the released models, not what the score itself reveals (a score on public data, or a "
              "DP score, is what the bound assumes)."]
    return lines
