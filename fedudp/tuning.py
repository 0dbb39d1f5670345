"""The privacy cost of choosing the best configuration of a sweep (``fedudp-report --select-best``).

Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022
(arXiv:2110.03620); Liu & Talwar, "Private Selection from Private Candidates", STOC 2019
(arXiv:1811.07971) for the geometric case; docs/algorithms.md#the-privacy-cost-of-tuning.

A **candidate** is one configuration of the sweep; its k seeds are all run and its score is
their mean, so the candidate's privacy event is the k-fold composition of the single-run event
(``events.candidate_event``). Each run's summary carries its whole privacy spend as one
dp-accounting event (``dp_event``). The rule, declared before the sweep (``declared_sweep``):

* **grid** (default): the candidates are a fixed set and every run was looked at, so the choice
  costs the plain composition of all runs of all configurations (``events.composed_selection``;
  PLD where dp-accounting supports the events, else RDP). A random-count bound is refused here:
  a grid's count is not random.
* **random count** (``poisson`` / ``geometric`` / ``logarithmic`` / ``negative_binomial``): the
  number of candidates was drawn, before the sweep, from a truncated negative binomial whose
  mean (and, for ``negative_binomial``, shape η > 0) was *declared* then. The mean is that
  declared one, never the number of candidates or runs that happen to be present. Every
  candidate must be the same mechanism (same event, same number of seeds); then the best one
  costs ``RepeatAndSelectDpEvent(candidate event, mean, shape)`` under dp-accounting's RDP
  accountant (``events.repeat_and_select``). Refused, with the reason, where the candidates'
  events differ. The bound covers releasing the chosen candidate (and its score) only, not the
  other candidates or the drawn count.

What the selection covers: the released models and a score computed from them. fedudp's accuracy
is measured on the owners' test records with their personal parameters, outside the DP guarantee
(docs/algorithms.md#what-is-released), so selecting by it leaks through the score itself; the
report says so. A score on public data (or a DP score) is what the theorems assume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fedudp.privacy.events import (
    SHAPES,
    candidate_event,
    composed_selection,
    event_from_json,
    pld_or_rdp_epsilon,
    repeat_and_select,
)
from fedudp.privacy.labels import epsilon_text

__all__ = [
    "SelectionError",
    "SweepRule",
    "declared_sweep",
    "select_best",
    "selection_lines",
]

# the random-count distributions: name -> the truncated negative binomial's shape η (None: the
# shape is declared with the mean, --sweep-shape)
_RANDOM_SIZES: dict[str, float | None] = {**SHAPES, "negative_binomial": None}
_SWEEP_SIZES = ("grid", *_RANDOM_SIZES)


class SelectionError(ValueError):
    """The sweep cannot be selected from (a one-line reason naming the run, flag or metric)."""


@dataclass(frozen=True)
class SweepRule:
    """How the sweep's candidates were chosen, as declared before it ran (``declared_sweep``).

    Parameters
    ----------
    size
        ``grid`` (a fixed set), or the distribution a random count of candidates was drawn from.
    mean
        The count's declared mean.
    shape
        The truncated negative binomial's shape (Poisson: ``math.inf``).
    """

    size: str = "grid"
    mean: float | None = None
    shape: float | None = None

    @property
    def random(self) -> bool:
        return self.size != "grid"

    def describe(self) -> str:
        """``Poisson(mean 10, declared)``; ``grid`` for a grid."""
        if not self.random:
            return "grid"
        m = f"mean {self.mean:g}, declared"
        if self.size == "poisson":
            return f"Poisson({m})"
        if self.size == "negative_binomial":
            return f"truncated negative binomial(η {self.shape:g}, {m})"
        return f"{self.size} (truncated negative binomial η = {self.shape:g}; {m})"


def declared_sweep(
    size: str = "grid", mean: float | None = None, shape: float | None = None
) -> SweepRule:
    """The rule a sweep declared, checked before any summary is read.

    Parameters
    ----------
    size
        ``--sweep-size``: ``grid`` (a fixed set of candidates), or the distribution their number
        was drawn from (``poisson``, ``geometric``, ``logarithmic``, ``negative_binomial``).
    mean
        ``--sweep-mean``: that distribution's declared mean (a random count needs it).
    shape
        ``--sweep-shape``: ``negative_binomial``'s declared shape η > 0.

    Returns
    -------
    SweepRule
        The rule.

    Raises
    ------
    SelectionError
        An unknown size, a random count without its mean (or shape), or a grid given either.
    """
    if size not in _SWEEP_SIZES:
        raise SelectionError(f"--sweep-size must be one of {', '.join(_SWEEP_SIZES)}, got {size!r}")
    if size == "grid":
        for flag, v in (("--sweep-mean", mean), ("--sweep-shape", shape)):
            if v is not None:
                raise SelectionError(
                    f"{flag}: a grid's candidates are a fixed set, not a random "
                    f"count; drop {flag}, or name the distribution the number of "
                    "candidates was drawn from before the sweep with --sweep-size "
                    f"{'|'.join(_RANDOM_SIZES)}"
                )
        return SweepRule()
    if mean is None:
        raise SelectionError(
            f"--sweep-size {size}: declare the mean of the distribution the number "
            "of candidates was drawn from, fixed before the sweep, with "
            "--sweep-mean M (the count of runs present is not that mean)"
        )
    if (
        isinstance(mean, bool)
        or not isinstance(mean, (int, float))
        or not math.isfinite(mean)
        or mean < 1
    ):
        raise SelectionError(
            f"--sweep-mean must be a finite number >= 1 (dp-accounting's "
            f"RepeatAndSelect), got {mean!r}"
        )
    fixed = _RANDOM_SIZES[size]
    if fixed is not None:
        if shape is not None:
            raise SelectionError(
                f"--sweep-shape: --sweep-size {size} fixes the shape "
                f"(η = {fixed:g}); drop --sweep-shape, or use --sweep-size "
                "negative_binomial with --sweep-shape ETA"
            )
        shape = fixed
    else:
        if shape is None:
            raise SelectionError(
                "--sweep-size negative_binomial: declare its shape η > 0 with "
                "--sweep-shape ETA (geometric is η = 1, logarithmic η = 0, "
                "poisson η = inf)"
            )
        if (
            isinstance(shape, bool)
            or not isinstance(shape, (int, float))
            or not math.isfinite(shape)
            or shape <= 0
        ):
            raise SelectionError(
                f"--sweep-shape must be a finite number > 0 for negative_binomial, got {shape!r}"
            )
    return SweepRule(size, float(mean), float(shape))


def _metric(s: dict, metric: str) -> float:
    v = s.get(metric)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise SelectionError(
            f"--select-best {metric}: run {s.get('_dir', '?')} has no finite "
            f"{metric} (got {v!r}); choose a numeric summary key such as "
            "accuracy_mean or loss"
        )
    return float(v)


def _seeds(n: int) -> str:
    return f"{n} seed{'s' if n != 1 else ''}"


def _private_runs(items: list) -> tuple[list[dict], float]:
    """Every run of the candidates ``items`` and their one δ; ``SelectionError`` when a run is
    not private, has no ``dp_event``, or the runs' δ differ."""
    runs = [s for _, rs in items for s in rs]
    for s in runs:
        if s.get("epsilon") is None:
            raise SelectionError(
                f"--select-best: run {s.get('_dir', '?')} is not private "
                f"(method={s.get('method')}); its data are not protected, so no "
                "selection ε exists; select among private runs only"
            )
        if not isinstance(s.get("dp_event"), dict):
            raise SelectionError(
                f"--select-best: run {s.get('_dir', '?')} has no dp_event in its "
                "summary.json (its ledger composes blocks without a dp-accounting "
                "event, or it was written by an older fedudp); rerun it"
            )
    deltas = {float(s["delta"]) for s in runs}
    if len(deltas) != 1:
        raise SelectionError(
            f"--select-best: the runs use different privacy.delta {sorted(deltas)};"
            " a selection ε needs one δ"
        )
    return runs, deltas.pop()


def select_best(
    groups: dict,
    metric: str,
    *,
    lower: bool = False,
    sweep_size: str = "grid",
    sweep_mean: float | None = None,
    sweep_shape: float | None = None,
) -> dict[str, Any]:
    """The best candidate of a sweep and the ε of choosing it under the declared rule.

    Parameters
    ----------
    groups
        ``report.groups_of``'s ``{key: (settings, runs)}``: one group per candidate, its runs
        (summaries) the seeds.
    metric
        The summary key whose mean over a candidate's runs decides (e.g. ``accuracy_mean``).
    lower
        The lowest mean wins (e.g. ``loss``) instead of the highest.
    sweep_size, sweep_mean, sweep_shape
        The rule declared before the sweep (``declared_sweep``; module doc): ``grid``, or the
        distribution the number of candidates was drawn from, with its mean and shape.

    Returns
    -------
    dict
        The choice (``settings``, ``score``, ``chosen_runs``), the single-run and candidate ε,
        and the tuning-inclusive ``tuning_epsilon`` with its ``rule`` and accountant (or the
        reason it was ``refused``); ``selection_lines`` prints it.

    Raises
    ------
    SelectionError
        A bad rule, no runs, a run that is not private or has no ``dp_event``, or runs with
        different δ.
    """
    rule = declared_sweep(sweep_size, sweep_mean, sweep_shape)
    items = [(settings, runs) for settings, runs in groups.values()]
    if not items:
        raise SelectionError("--select-best: the sweep has no runs")
    runs, delta = _private_runs(items)
    scored = [
        (sum(_metric(s, metric) for s in rs) / len(rs), settings, rs) for settings, rs in items
    ]
    score, settings, chosen = (min if lower else max)(scored, key=lambda t: t[0])
    candidates = [candidate_event([event_from_json(s["dp_event"]) for s in rs]) for _, rs in items]
    chosen_event = candidate_event([event_from_json(s["dp_event"]) for s in chosen])
    cand_eps, cand_acc = pld_or_rdp_epsilon(chosen_event, delta)
    seeds = sorted({len(rs) for _, rs in items})
    heuristic = any(s.get("guarantee") == "heuristic" for s in runs)
    out: dict[str, Any] = {
        "metric": metric,
        "lower_is_better": lower,
        "score": score,
        "settings": settings,
        "chosen_runs": [s.get("_dir") for s in chosen],
        "configurations": len(items),
        "runs": len(runs),
        "seeds": seeds,
        "delta": delta,
        "heuristic": heuristic,
        "single_run_epsilon": max(float(s["epsilon"]) for s in chosen),
        "candidate_epsilon": cand_eps,
        "candidate_accountant": cand_acc,
        "sweep_size": rule.size,
        "sweep_mean": rule.mean,
        "sweep_shape": rule.shape,
        "rule": None,
        "tuning_epsilon": None,
        "tuning_accountant": None,
        "refused": None,
    }
    return _with_tuning_epsilon(out, rule, items, runs, candidates)


def _with_tuning_epsilon(
    out: dict[str, Any], rule: SweepRule, items: list, runs: list[dict], candidates: list
) -> dict[str, Any]:
    """``out`` with the selection's ε under ``rule`` (grid: the composition of every run;
    random: RepeatAndSelect, or refused when the candidates are not one mechanism)."""
    seeds, delta = out["seeds"], out["delta"]
    per = (
        f"{len(items)} configurations × {_seeds(seeds[0])}"
        if len(seeds) == 1
        else f"{len(items)} configurations of {seeds[0]}-{seeds[-1]} seeds"
    )
    if not rule.random:
        eps, acc = composed_selection([event_from_json(s["dp_event"]) for s in runs], delta)
        out.update(
            rule=f"grid: composition of {len(runs)} runs ({per})",
            tuning_epsilon=eps,
            tuning_accountant=acc,
        )
        return out
    head = f"RepeatAndSelect, {rule.describe()}"
    distinct = {repr(e) for e in candidates}
    if len(distinct) > 1:
        why = (
            f"the candidates have different seed counts ({', '.join(map(str, seeds))})"
            if len(seeds) > 1
            else "their privacy events differ"
        )
        out.update(
            rule=head,
            refused=(
                f"the {len(items)} candidates are not one mechanism ({why}: {len(distinct)} distinct "
                "events); Papernot & Steinke's bound needs every candidate to be the same DP "
                "algorithm; if the candidates were a fixed set, use --sweep-size grid"
            ),
        )
        return out
    assert rule.mean is not None and rule.shape is not None  # a random rule declares both
    out.update(
        rule=f"{head}, per-candidate event = "
        + (f"{_seeds(seeds[0])} composed" if seeds[0] > 1 else "one run"),
        tuning_epsilon=repeat_and_select(candidates[0], rule.mean, rule.shape, delta),
        tuning_accountant="rdp",
    )
    return out


def selection_lines(sel: dict[str, Any], varying: list[str]) -> list[str]:
    """The selection as Markdown lines (a heading, the choice, a table of ε, the caveats).

    Parameters
    ----------
    sel
        ``select_best``'s result.
    varying
        The keys that differ between candidates (shown for the choice).

    Returns
    -------
    list of str
        The lines.
    """
    mark = " (heuristic)" if sel["heuristic"] else ""
    chosen = ", ".join(f"{k}={sel['settings'].get(k)}" for k in varying) or "the only configuration"
    way = "lowest" if sel["lower_is_better"] else "highest"
    k = len(sel["chosen_runs"])
    lines = [
        f"## Best configuration by {sel['metric']} ({way} mean over its seeds)",
        "",
        f"Chosen: {chosen}: {sel['metric']} {sel['score']:.4f} over {k} run(s); "
        f"{sel['configurations']} configurations (candidates), {sel['runs']} runs in the "
        f"sweep, δ = {sel['delta']:g}.",
        "",
        "| ε of | ε | accountant | rule |",
        "|---|---:|---|---|",
        f"| one run (the chosen configuration's ledger) | {epsilon_text(sel['single_run_epsilon'])}{mark} "
        f"| the run's ledger | the run alone, no choice made from the sweep |",
    ]
    if k > 1:
        lines.append(
            f"| one candidate (the chosen configuration's {k} seeds composed) | "
            f"{epsilon_text(sel['candidate_epsilon'])}{mark} | dp-accounting "
            f"{sel['candidate_accountant'].upper()} | its {k} runs, no choice made |"
        )
    if sel["tuning_epsilon"] is not None:
        lines.append(
            f"| the choice (tuning-inclusive) | {epsilon_text(sel['tuning_epsilon'])}{mark} | "
            f"dp-accounting {sel['tuning_accountant'].upper()} | {sel['rule']} |"
        )
    else:
        lines.append(
            f"| the choice (tuning-inclusive) | refused | - | {sel['rule']}: {sel['refused']} |"
        )
    if sel["sweep_size"] == "grid":
        lines += [
            "",
            "Rule: the candidates were a fixed set (a grid) and every run was looked at, "
            "so the choice costs the composition of all runs of all configurations. A "
            "random-count bound (Papernot & Steinke 2022) applies only when the number of "
            "candidates was drawn before the sweep: --sweep-size poisson|geometric|"
            "logarithmic|negative_binomial with --sweep-mean (declared).",
        ]
    else:
        lines += [
            "",
            "Rule: Papernot & Steinke 2022 (Liu & Talwar 2019 for the geometric case): "
            "valid only if the number of candidates was drawn from this distribution, with "
            "this mean, before the sweep, independently of the data; a candidate is one "
            "configuration, its seeds composed into one event. It covers releasing the "
            "chosen candidate (and its score) only: the other candidates' models and scores, "
            "the drawn count and this report's table of every run are outside it.",
        ]
    lines += [
        "",
        f"The choice reads {sel['metric']}, which fedudp computes on the owners' test "
        "records with their personal parameters, outside the DP guarantee: the ε above cover "
        "the released models, not what the score itself reveals (a score on public data, or a "
        "DP score, is what the bound assumes).",
    ]
    return lines
