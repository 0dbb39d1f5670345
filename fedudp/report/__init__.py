"""Reports on results folders: ``fedudp-report`` (``fedudp.report.cli``).

One package, imports running one way: ``report`` (the comparison table, ``load_summaries``,
the Hydra ``ComparisonCallback``) at the bottom; ``paper_report`` (the paper's layouts,
``--paper``) and ``report_plots`` (``--plots``: accuracy and ε per round, the privacy–utility
frontier) above it; ``cli`` (the command) on top. The ε labels (``epsilon_kind``,
``epsilon_display``, ``HEURISTIC_MARK``) live with the privacy code in
``fedudp.privacy.labels`` and are re-exported here. The names below are the package's public
API (``from fedudp.report import comparison_table, load_summaries, main``); the layouts and the
figures are imported from their modules, so that importing the package loads neither.
"""

from __future__ import annotations

from fedudp.privacy.labels import (
    HEURISTIC_MARK,
    WEAKENED_MARK,
    epsilon_display,
    epsilon_kind,
    is_heuristic,
    mark_epsilon,
)
from fedudp.report.cli import PAPER_LAYOUTS, main
from fedudp.report.report import (
    HEADLINE_KEYS,
    NOT_SETTINGS,
    SUMMARY_KEY_FIELDS,
    ComparisonCallback,
    comparison_table,
    flat_settings,
    group_order,
    groups_of,
    load_summaries,
    varying_keys,
)

__all__ = [
    "HEADLINE_KEYS",
    "HEURISTIC_MARK",
    "NOT_SETTINGS",
    "PAPER_LAYOUTS",
    "SUMMARY_KEY_FIELDS",
    "WEAKENED_MARK",
    "ComparisonCallback",
    "comparison_table",
    "epsilon_display",
    "epsilon_kind",
    "flat_settings",
    "group_order",
    "groups_of",
    "is_heuristic",
    "load_summaries",
    "main",
    "mark_epsilon",
    "varying_keys",
]
