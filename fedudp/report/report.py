"""The comparison table of a results folder (docs/architecture.md#configuration-and-outputs).

``load_summaries`` reads every ``summary.json`` below a folder; ``comparison_table`` makes the
markdown table ``fedudp-report`` prints (one row per configuration, mean ± std over its seeds;
the command itself is ``fedudp.report.cli``). Two runs share a row only when their whole
resolved ``config.yaml`` is the same, ``seed`` and the keys in ``NOT_SETTINGS`` aside, and their
privacy guarantee is the same; the keys that differ between rows are the table's first columns,
the rest is said once above it. Runs without a ``config.yaml`` are grouped by their summary
fields (``SUMMARY_KEY_FIELDS``) in a table of their own, never with runs that have one. An ε
from heuristic accounting is printed ``1.000 (heuristic)`` wherever it appears
(``fedudp.privacy.labels.epsilon_display``). ``ComparisonCallback`` prints the same table at the
end of a Hydra multirun. The paper's layouts (``paper_report``) and the figures
(``report_plots``) sit above this module; nothing here imports them.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedudp.privacy.labels import (
    HEURISTIC_MARK,
    epsilon_kind,
    is_heuristic,
    mark_epsilon,
)

__all__ = [
    "NOT_SETTINGS",
    "SUMMARY_KEY_FIELDS",
    "HEADLINE_KEYS",
    "load_summaries",
    "flat_settings",
    "groups_of",
    "varying_keys",
    "group_order",
    "comparison_table",
    "ComparisonCallback",
]

try:
    from hydra.experimental.callback import Callback
except Exception:  # noqa: BLE001  # pragma: no cover - hydra is a dependency; keep report importable
    Callback = object  # type: ignore[misc,assignment]

# Config keys (dotted; a key names its whole subtree) that do not change what a run computes,
# so runs differing only there share a row. Everything else in config.yaml separates rows.
NOT_SETTINGS = (
    "seed",  # the replicate: a row averages over it
    "progress",  # a progress bar on stderr
    "resume",  # the run folder a run continued in (resumes are bit-identical)
    "checkpoint",  # checkpoint cadence and how many are kept (CheckpointConfig)
    "engine_opts.threads",  # torch threads: scheduling (fedudp.run_folder.comparable drops it too)
    "engine_opts.device",  # where the local engine computes: like threads, the same run up to
    # float rounding (noise drawn on the CPU, bit-identical; fedudp.run_folder.comparable drops it too)
    "engine_opts.chunk_records",  # records per vmapped chunk: memory and speed; batch order is
    # keyed by (seed, round, epoch, owner), not by chunk (local_sgd)
    "engine_opts.num_cpus",  # Ray resources per Flower client: scheduling
    "engine_opts.num_gpus",  # likewise (no fedudp code places tensors on a GPU)
    "engine_opts.address",  # which Ray cluster runs the simulation
    "dataset.download",  # whether missing files are fetched; the files are the same
    "hydra",  # Hydra's own settings, should a config carry them
)

# Runs without config.yaml: the summary fields that name their setting (a row per combination)
SUMMARY_KEY_FIELDS = (
    "method",
    "aggregator",
    "placement",
    "engine",
    "dataset",
    "accounting",
    "unit",
    "adjacency",
    "target_epsilon",
    "delta",
    "num_owners",
    "num_users",
    "num_records",
    "rounds_planned",
)

# Always named above a config table (with every other key whose value is not the default)
HEADLINE_KEYS = ("method", "aggregator", "dataset.name", "partition.num_owners", "train.rounds")

_METHOD_ORDER = {"per_silo": 0, "fedavg": 1, "full_dp": 2, "joint_dp": 3}


# -- reading runs ---------------------------------------------------------------------------
def load_summaries(folder: str | Path) -> list[dict]:
    """Every run's summary below ``folder``.

    Copies of run files that a tracker keeps below the folder (the embedded MLflow store's
    artifacts, ``tracking.ARTIFACTS_DIR``) are not runs and are skipped, so a tracked sweep's
    runs count once.

    Parameters
    ----------
    folder
        A run or sweep folder, searched recursively for ``summary.json``.

    Returns
    -------
    list of dict
        Each summary with its folder (``_dir``) and, where the run wrote one, its resolved
        config (``_config``, a dict).
    """
    from fedudp.tracking import ARTIFACTS_DIR

    out = []
    root = Path(folder)
    for p in sorted(root.rglob("summary.json")):
        if ARTIFACTS_DIR in p.relative_to(root).parts[:-1]:
            continue
        try:
            s = json.loads(p.read_text())
        except json.JSONDecodeError:
            continue
        s["_dir"] = str(p.parent)
        saved = p.parent / "config.yaml"
        if saved.is_file():
            from omegaconf import OmegaConf

            s["_config"] = OmegaConf.to_container(OmegaConf.load(saved))
        out.append(s)
    return out


def _hashable(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((str(k), _hashable(x)) for k, x in v.items()))
    return v


def _not_setting(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in NOT_SETTINGS)


def flat_settings(config: dict, defaults: bool = True) -> dict[str, Any]:
    """A resolved config as ``{dotted key: value}``, less ``NOT_SETTINGS``.

    Parameters
    ----------
    config
        A run's resolved ``config.yaml``.
    defaults
        First fill in the schema's defaults.

    Returns
    -------
    dict
        The settings by dotted key.
    """
    from fedudp.config import with_schema_defaults

    out: dict[str, Any] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict) and v:
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = _hashable(v)

    walk(with_schema_defaults(config) if defaults else config, "")
    return {k: v for k, v in out.items() if not _not_setting(k)}


def _schema_defaults() -> dict[str, Any]:
    from fedudp.config import RunConfig, config_dict

    return flat_settings(config_dict(RunConfig()), defaults=False)


# -- the table ------------------------------------------------------------------------------
_MISSING = object()


def _value(v: Any) -> str:
    if v is _MISSING:
        return "—"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return str(v).replace("|", "\\|")


def _sortable(v: Any) -> tuple:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, float(v), "")
    if v is None or v is _MISSING:
        return (2, 0.0, "")
    return (1, 0.0, _value(v))


def _fmt(vals: list[float | None], runs: int, digits: int = 4) -> str:
    """Mean ± std (population) of the values a group has; ``(n=k)`` when only k of its runs
    have one (a failed run has no accuracy)."""
    xs = [v for v in vals if v is not None]
    if not xs:
        return "n/a"
    text = (
        f"{xs[0]:.{digits}f}"
        if len(xs) == 1
        else f"{np.mean(xs):.{digits}f} ± {np.std(xs):.{digits}f}"
    )
    return text + (f" (n={len(xs)})" if len(xs) < runs else "")


def _group(summaries: list[dict]) -> tuple[dict, dict]:
    """(groups of runs with a config, groups of runs without), each ``{key: (settings, runs)}``;
    the key holds every setting and the guarantee."""
    with_cfg: dict[tuple, tuple[dict, list[dict]]] = {}
    without: dict[tuple, tuple[dict, list[dict]]] = {}
    for s in summaries:
        if isinstance(s.get("_config"), dict):
            settings, into = flat_settings(s["_config"]), with_cfg
        else:
            settings, into = {k: _hashable(s.get(k)) for k in SUMMARY_KEY_FIELDS}, without
        key = (
            tuple(sorted(settings.items(), key=lambda kv: kv[0])),
            s.get("guarantee"),
            epsilon_kind(s),
        )
        into.setdefault(key, (settings, []))[1].append(s)
    return with_cfg, without


def groups_of(summaries: list[dict]) -> tuple[dict, dict]:
    """The table's groups: runs that differ only in ``seed`` and ``NOT_SETTINGS``.

    Parameters
    ----------
    summaries
        ``load_summaries``' summaries.

    Returns
    -------
    tuple of dict
        (those with a config.yaml, those without), each ``{key: (settings, runs)}``.
    """
    return _group(summaries)


def varying_keys(groups: dict) -> tuple[list[str], list[str]]:
    """The keys of the groups' settings.

    Parameters
    ----------
    groups
        ``groups_of``'s ``{key: (settings, runs)}``.

    Returns
    -------
    tuple of list of str
        (every key some group has, the keys whose value differs between groups): the latter are
        the table's first columns.
    """
    keys: list[str] = []
    for settings, _ in groups.values():
        keys += [k for k in settings if k not in keys]
    varying = [k for k in keys if len({st.get(k, _MISSING) for st, _ in groups.values()}) > 1]
    return keys, varying


def group_order(varying: list[str]) -> Callable[[tuple[dict, list[dict]]], tuple]:
    """The table's row order: by method (per_silo, fedavg, full_dp, joint_dp), then the varying
    keys' values, then the guarantee.

    Parameters
    ----------
    varying
        ``varying_keys``' differing keys.

    Returns
    -------
    callable
        A key for ``sorted`` over ``(settings, runs)``.
    """

    def order(item: tuple[dict, list[dict]]) -> tuple:
        settings, ss = item
        method = settings.get("method", ss[0].get("method"))
        return (
            _METHOD_ORDER.get(str(method), 9),
            tuple(_sortable(settings.get(k, _MISSING)) for k in varying),
            str(ss[0].get("guarantee")),
        )

    return order


def _table(groups: dict, defaults: dict[str, Any] | None) -> list[str]:
    keys, varying = varying_keys(groups)
    first = next(iter(groups.values()))[0]
    common = [k for k in keys if k not in varying and k in first]
    if defaults is not None:  # a config table: the headline keys and what is not default
        shown = [k for k in common if k in HEADLINE_KEYS or defaults.get(k, _MISSING) != first[k]]
        tail = "; every other key at its default (seed and NOT_SETTINGS not compared)"
    else:
        shown, tail = common, ""
    lines = []
    if shown:
        lines.append(
            "Common settings: " + ", ".join(f"{k}={_value(first[k])}" for k in shown) + tail
        )
    runs_all = [s for _, ss in groups.values() for s in ss]
    stops = any(s.get("stop_reason") not in (None, "completed") for s in runs_all)
    canary = any(s.get("canary_epsilon_estimate") for s in runs_all)  # audit.canaries
    head = (
        varying
        + ["accuracy (mean over owners)", "weighted", "epsilon", "delta", "guarantee", "rounds"]
        + (["canary ε estimate (not a bound)"] if canary else [])
        + (["stopped"] if stops else [])
        + ["seconds", "runs"]
    )
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    for settings, ss in sorted(groups.values(), key=group_order(varying)):
        n = len(ss)
        eps = [s.get("epsilon") for s in ss]
        if all(e is None for e in eps):
            eps_s = "n/a (no DP)"
        else:
            eps_s = mark_epsilon(_fmt(eps, n, 3), any(is_heuristic(s) for s in ss))
        deltas = sorted({s.get("delta") for s in ss if s.get("delta") is not None})
        rounds = sorted({s.get("rounds_completed") for s in ss}, key=_sortable)
        rounds_s = (
            _value(rounds[0]) if len(rounds) == 1 else f"{_value(rounds[0])}–{_value(rounds[-1])}"
        )
        row = [_value(settings.get(k, _MISSING)) for k in varying]
        row += [
            _fmt([s.get("accuracy_mean") for s in ss], n),
            _fmt([s.get("accuracy_weighted") for s in ss], n),
            eps_s,
            ", ".join(f"{d:g}" for d in deltas) or "—",
            str(ss[0].get("guarantee")),
            rounds_s,
        ]
        if canary:
            row.append(_canary_cell(ss))
        if stops:
            c = Counter(str(s.get("stop_reason")) for s in ss)
            row.append(", ".join(k if v == n else f"{k} ×{v}" for k, v in sorted(c.items())))
        seeds = [s["_config"].get("seed") for s in ss if isinstance(s.get("_config"), dict)]
        repeat = len(seeds) > len(set(map(str, seeds)))
        row += [
            _fmt([s.get("seconds") for s in ss], n, 1),
            f"{n}" + (f" (seeds {', '.join(map(str, sorted(seeds, key=str)))})" if repeat else ""),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _canary_cell(ss: list[dict]) -> str:
    """The canary ε estimate of a group's runs: one run's value and interval, or mean ± std."""
    ests = [s.get("canary_epsilon_estimate") for s in ss]
    if len(ss) == 1 and ests[0] and ests[0].get("value") is not None:
        lo, hi = ests[0]["ci"]
        return f"{ests[0]['value']:.3f} [{lo:.3f}, {hi:.3f}]"
    return _fmt([e.get("value") if e else None for e in ests], len(ss), 3)


def comparison_table(summaries: list[dict]) -> str:
    """The comparison table: one row per configuration (see the module docstring), mean ± std
    over its runs.

    Parameters
    ----------
    summaries
        ``load_summaries``' summaries.

    Returns
    -------
    str
        The Markdown table (runs without a ``config.yaml`` in a table of their own).
    """
    with_cfg, without = _group(summaries)
    parts: list[str] = []
    if with_cfg:
        parts += _table(with_cfg, _schema_defaults())
    if without:
        if parts:
            parts += [""]
        parts += [
            "Runs without config.yaml, grouped by their summary fields only "
            f"({', '.join(SUMMARY_KEY_FIELDS)}, guarantee):",
            "",
        ]
        parts += _table(without, None)
    if any(s.get("canary_epsilon_estimate") for s in summaries):
        parts += [
            "",
            "canary ε estimate: audit.canaries' one-run estimate (Andrew et al. 2024, "
            "final model, null N(0, 1/d)) with its 95 % interval (ε over a confidence "
            "region of the canaries' cosine mean and std); an estimate, not a bound.",
        ]
    if any(is_heuristic(s) for s in summaries):
        parts += [
            "",
            f"{HEURISTIC_MARK}: ε from privacy.accounting=paper (a paper's unproven "
            "accounting or group-privacy form), not a proven (ε, δ) guarantee.",
        ]
    return "\n".join(parts).lstrip("\n")


class ComparisonCallback(Callback):
    """Prints the comparison table when a Hydra multirun ends."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        folder = Path(config.hydra.sweep.dir)
        summaries = load_summaries(folder)
        if summaries:
            table = comparison_table(summaries)
            (folder / "comparison.md").write_text(table + "\n")
            print("\n" + table + f"\n\n(results in {folder})")
