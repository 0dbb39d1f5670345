"""Results folders -> comparison tables (docs/architecture.md#configuration-and-outputs).

``fedudp-report <sweep dir>`` reads every ``summary.json`` below a folder and prints a
markdown table with one row per configuration (mean ± std over its runs, i.e. its seeds). Two
runs share a row only when their whole resolved ``config.yaml`` is the same, ``seed`` and the
keys in ``NOT_SETTINGS`` aside, and their privacy guarantee is the same; the keys that differ
between rows are the table's first columns, the rest is said once above it. Runs without a
``config.yaml`` are grouped by their summary fields (``SUMMARY_KEY_FIELDS``) in a table of their
own, never with runs that have one. An ε from heuristic accounting (``guarantee: heuristic``)
is printed ``1.000 (heuristic)`` wherever it appears (``epsilon_display``). The Hydra callback
prints the same table at the end of a multirun, so the quickstart ends with the comparison.
``--plots`` (or ``--out DIR``) also writes the table as ``report.md`` with two figures beside it,
accuracy and ε per round and the privacy–utility frontier (``fedudp.report.report_plots``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedudp.report.report import comparison_table, groups_of, load_summaries, varying_keys

__all__ = [
    "PAPER_LAYOUTS",
    "main",
]

PAPER_LAYOUTS = {"huang_table1", "huang_table2", "huang_table4", "huang_fig1"}


def _parser() -> argparse.ArgumentParser:
    """The command line of ``fedudp-report``."""
    ap = argparse.ArgumentParser(
        prog="fedudp-report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("folder", help="a run or sweep folder (searched recursively for summary.json)")
    ap.add_argument(
        "--paper",
        choices=sorted(PAPER_LAYOUTS),
        help="the paper's layout beside its numbers (Markdown, CSV and PNG in --out)",
    )
    ap.add_argument(
        "--plots",
        action="store_true",
        help="also write report.md (the table and the figures), curves.png (accuracy "
        "and ε per round, one line per row) and frontier.png (final accuracy "
        "against ε, one line per method) in --out",
    )
    ap.add_argument(
        "--out",
        help="folder for the --paper or --plots files (default: FOLDER); "
        "without --paper, --out implies --plots",
    )
    ap.add_argument(
        "--select-best",
        metavar="METRIC",
        help="choose the configuration (candidate) with the best mean METRIC over its "
        "seeds (a summary key, e.g. accuracy_mean) and report the tuning-inclusive "
        "ε, with the rule used, beside the single-run ε (fedudp.tuning). A "
        "candidate's k seeds are composed into one event. Grid (default): the "
        "plain composition of all runs of all configurations. Random count: "
        "dp-accounting's RepeatAndSelectDpEvent(candidate event, declared mean, "
        "shape) under RDP (Papernot & Steinke, ICLR 2022; Liu & Talwar, STOC 2019 "
        "for the geometric case); see docs/algorithms.md",
    )
    ap.add_argument(
        "--lower-is-better",
        action="store_true",
        help="with --select-best: the lowest METRIC wins (e.g. loss)",
    )
    ap.add_argument(
        "--sweep-size",
        default="grid",
        help="with --select-best, as declared BEFORE the sweep: grid (default: the "
        "candidates are a fixed set), or poisson / geometric / logarithmic / "
        "negative_binomial when the number of candidates was drawn from that "
        "truncated negative binomial (needs --sweep-mean)",
    )
    ap.add_argument(
        "--sweep-mean",
        type=float,
        metavar="M",
        help="with a random --sweep-size: the mean of the distribution the number of "
        "candidates was drawn from, fixed before the sweep (never the number of "
        "runs present)",
    )
    ap.add_argument(
        "--sweep-shape",
        type=float,
        metavar="ETA",
        help="with --sweep-size negative_binomial: its declared shape η > 0 "
        "(geometric is η = 1, logarithmic η = 0, poisson η = inf)",
    )
    return ap


def _declared_rule_error(a: argparse.Namespace) -> int | None:
    """2 (after the one-line error) when the --select-best/--sweep-* flags are inconsistent,
    checked before any summary is read; None when they are fine."""
    if a.select_best:  # the declared rule is checked before any summary is read
        from fedudp.tuning import SelectionError, declared_sweep

        try:
            declared_sweep(a.sweep_size, a.sweep_mean, a.sweep_shape)
        except SelectionError as err:
            print(f"fedudp-report: error: {err}", file=sys.stderr)
            return 2
    elif a.sweep_mean is not None or a.sweep_shape is not None or a.sweep_size != "grid":
        print(
            "fedudp-report: error: --sweep-size/--sweep-mean/--sweep-shape declare how the "
            "candidates of --select-best were chosen; add --select-best METRIC",
            file=sys.stderr,
        )
        return 2
    return None


def _print_selection(a: argparse.Namespace, summaries: list[dict]) -> int | None:
    """Print the --select-best choice and its tuning-inclusive ε; 2 on a selection error."""
    from fedudp.tuning import SelectionError, select_best, selection_lines

    with_cfg, without = groups_of(summaries)
    groups = {**with_cfg, **without}
    try:
        sel = select_best(
            groups,
            a.select_best,
            lower=a.lower_is_better,
            sweep_size=a.sweep_size,
            sweep_mean=a.sweep_mean,
            sweep_shape=a.sweep_shape,
        )
    except SelectionError as err:
        print(f"fedudp-report: error: {err}", file=sys.stderr)
        return 2
    print("\n" + "\n".join(selection_lines(sel, varying_keys(groups)[1])))
    return None


def main(argv: list[str] | None = None) -> int:
    """Run ``fedudp-report``.

    Parameters
    ----------
    argv
        The command-line arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status: 0, or 2 after a one-line error (bad flags, no ``summary.json``
        under the folder, a selection that cannot be made).
    """
    ap = _parser()
    a = ap.parse_args(argv)
    if a.paper and a.plots:
        ap.error("--plots draws the comparison table's figures; --paper draws its own layout")
    status = _declared_rule_error(a)
    if status is not None:
        return status
    summaries = load_summaries(a.folder)
    if not summaries:
        print(f"fedudp-report: no summary.json under {a.folder}", file=sys.stderr)
        return 2
    if a.paper:
        from fedudp.report.paper_report import write_paper_report

        print(write_paper_report(a.paper, summaries, Path(a.out or a.folder)))
        return 0
    print(comparison_table(summaries))
    if a.select_best:
        status = _print_selection(a, summaries)
        if status is not None:
            return status
    if a.plots or a.out:
        from fedudp.report.report_plots import write_report

        folder = Path(a.folder).resolve()
        paths = write_report(summaries, Path(a.out or a.folder), name=folder.name)
        print(f"\n(wrote {', '.join(p.name for p in paths.values())} in {paths['report'].parent})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
