"""The audit's printed report: the table's header and rows, each audit's bounds and power,
and the closing counts (false alarms or detections) and low-power note."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedudp.audit.result import AuditResult

__all__ = ["TABLE_HEAD", "details", "finish", "row", "verdict"]


def verdict(r: AuditResult) -> str:
    """The table's verdict on one audit.

    Parameters
    ----------
    r : AuditResult
        The audit.

    Returns
    -------
    str
        A violation, or consistent with the ledger (with low power where it is said).
    """
    if r.violation:
        return "VIOLATION: less private than its ledger claims"
    return "consistent with the ledger" + (", low power" if r.low_power else "")


TABLE_HEAD = (
    "| mechanism | adjacency | releases per side | δ | ε claimed (one release) "
    "| ε lower bound (99%) | by | broken | verdict | seconds |\n"
    "|---|---|---:|---:|---:|---:|---|---|---|---:|"
)


def row(r: AuditResult, what: str = "") -> str:
    """One audit's row of the table (``TABLE_HEAD``).

    Parameters
    ----------
    r : AuditResult
        The audit.
    what : str, default ""
        The mechanism column (default: ``r.mechanism``).

    Returns
    -------
    str
        The markdown row.
    """
    b = r.samples.best
    return (
        f"| {what or r.mechanism} | {r.adjacency} | {r.trials} | {r.delta:g} "
        f"| {r.claimed_epsilon:.3f}{' (heuristic)' if r.claim_heuristic else ''} "
        f"| {r.lower_bound:.3f} | {b.method}, {b.statistic} "
        f"| {r.broken or '-'} | {verdict(r)} | {r.seconds:.1f} |"
    )


def details(r: AuditResult) -> list[str]:
    """One audit's lines below the table: every bound tried, the notes and the power.

    Parameters
    ----------
    r : AuditResult
        The audit.

    Returns
    -------
    list of str
        The indented lines.
    """
    lines = [
        f"  {b.method} on the {b.statistic}: ε >= {b.epsilon:.3f} ({b.detail})"
        for b in r.samples.bounds
    ]
    lines += [f"  note: {n}" for n in r.samples.notes]
    if r.power:
        parts = []
        if "gaussian" in r.power:
            parts.append(f"Gaussian-DP fit: a noise cut to {r.power['gaussian']:.3f}x")
        parts.append(f"threshold test alone: to {r.power['threshold']:.3f}x")
        lines.append(
            f"  power at {r.trials} releases per side (detected with probability about "
            f"1/2): " + "; ".join(parts) + " of the configured noise"
        )
    return lines


def finish(results: list[AuditResult], repeat: int, broken: str, seed: int) -> int:
    """Print the audits' details (the first one's alone when repeated), the count of audits
    that flagged a violation over the seeds, and the low-power note.

    Parameters
    ----------
    results : list of AuditResult
        The audits.
    repeat : int
        ``--repeat``: audits per configuration (seeds ``seed``..``seed + repeat - 1``).
    broken : str
        ``--break`` ("" : the count is of false alarms, else of detections).
    seed : int
        ``--seed``.

    Returns
    -------
    int
        The exit status: 1 if any audit flagged a violation, else 0.
    """
    for r in results[:1] if repeat > 1 else results:
        print("\n".join(details(r)))
    if repeat > 1:
        bad = sum(r.violation for r in results)
        what = "false alarms" if not broken else "detections"
        print(
            f"{what}: {bad} of {len(results)} audits flagged a violation "
            f"(seeds {seed}..{seed + repeat - 1})"
        )
    if any(r.low_power for r in results):
        print(
            "note: the lower bound is far below the claim: this audit has little power here "
            "(one unit's real influence on this cohort is much smaller than the certified "
            "sensitivity, or too few releases); it cannot confirm the constant, only catch a "
            "gross violation",
            file=sys.stderr,
        )
    return 1 if any(r.violation for r in results) else 0
