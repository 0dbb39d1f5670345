"""What a run's ε is and how every fedudp output prints it (standard library only).

One rule for summary.json (epsilon_kind, epsilon_display), the run's last line, the
Python API's SimulationResult.epsilon_kind and every table of fedudp-report: an ε from an
unproven accounting or conversion (privacy.accounting=paper) is heuristic and printed
1.000 (heuristic); an ε whose released noise was weakened for an audit
(audit.noise_scale < 1) is weakened and printed so; no DP is n/a (no DP). The runner
and the API import these labels from here, beside the accountant that decides them, not from
the report.
"""

from __future__ import annotations

__all__ = [
    "HEURISTIC_MARK",
    "WEAKENED_MARK",
    "epsilon_kind",
    "is_heuristic",
    "mark_epsilon",
    "SCIENTIFIC_FROM",
    "epsilon_text",
    "epsilon_display",
    "EPSILON_METRICS",
    "epsilon_metric",
    "labelled_epsilon",
    "metric_epsilon",
]

HEURISTIC_MARK = "(heuristic)"
WEAKENED_MARK = "(weakened, not a guarantee)"


def epsilon_kind(s: dict) -> str | None:
    """What a summary's ε is.

    Summaries written before ``epsilon_kind`` existed are read from ``guarantee``; one with
    neither counts as heuristic when its accounting is ``paper`` (never read a bound where none
    was proven).

    Parameters
    ----------
    s
        A run's ``summary.json``.

    Returns
    -------
    str or None
        ``"certified"``, ``"heuristic"`` (an unproven accounting or conversion,
        ``privacy.accounting=paper``), or None (no DP, no ε).
    """
    kind = s.get("epsilon_kind")
    if kind in ("certified", "heuristic", "weakened"):
        return kind
    guarantee = s.get("guarantee")
    if guarantee in ("certified", "heuristic", "weakened"):
        return guarantee
    if guarantee is None and s.get("accounting") == "paper":
        return "heuristic"
    if guarantee is None and s.get("epsilon") is not None:
        return "certified"
    return None


def is_heuristic(s: dict) -> bool:
    """Whether a summary's ε is heuristic (``epsilon_kind(s) == "heuristic"``).

    Parameters
    ----------
    s
        A run's ``summary.json``.

    Returns
    -------
    bool
        True for a heuristic ε.
    """
    return epsilon_kind(s) == "heuristic"


def mark_epsilon(text: str, heuristic: bool) -> str:
    """``1.000`` -> ``1.000 (heuristic)`` for a heuristic ε.

    Parameters
    ----------
    text
        The ε as text.
    heuristic
        Whether it is heuristic.

    Returns
    -------
    str
        The text, marked where heuristic.
    """
    return f"{text} {HEURISTIC_MARK}" if heuristic else text


# an ε at or above this prints in scientific notation (4 significant digits): no privacy is
# left to read in its digits, and a fixed-point ε of 1e300 is 300 digits long
SCIENTIFIC_FROM = 1e6


def epsilon_text(epsilon: float, digits: int = 3) -> str:
    """One ε as every fedudp output prints it.

    Parameters
    ----------
    epsilon
        The ε.
    digits
        The decimals below ``SCIENTIFIC_FROM``.

    Returns
    -------
    str
        ``1.000`` below ``SCIENTIFIC_FROM``, ``6.908e+300`` from there, ``inf`` where infinite.
    """
    eps = float(epsilon)
    if eps != eps or abs(eps) == float("inf"):
        return str(eps)  # nan, inf
    if abs(eps) >= SCIENTIFIC_FROM:
        return f"{eps:.3e}"
    return f"{eps:.{digits}f}"


def epsilon_display(epsilon: float | None, kind: str | None, digits: int = 3) -> str:
    """The text every fedudp output prints for a run's ε (``summary.json``'s ``epsilon_display``).

    Parameters
    ----------
    epsilon
        The ε, or None (no DP).
    kind
        ``epsilon_kind``'s value: a heuristic ε is printed ``1.000 (heuristic)``.
    digits
        The digits after the point.

    Returns
    -------
    str
        The ε as text.
    """
    if epsilon is None:
        return "n/a (no DP)"
    if kind == "weakened":  # audit.noise_scale < 1: the ledger's ε is not what was released
        return f"{epsilon_text(epsilon, digits)} {WEAKENED_MARK}"
    return mark_epsilon(epsilon_text(epsilon, digits), kind == "heuristic")


# the name a per-round ε is logged under (metrics.jsonl, MLflow, TensorBoard), by its kind: a
# bare ``epsilon`` is always a proven bound
EPSILON_METRICS = {
    "certified": "epsilon",
    "heuristic": "epsilon_heuristic",
    "weakened": "epsilon_weakened",
}


def epsilon_metric(kind: str | None) -> str:
    """The metric name of an ε of ``kind``.

    Parameters
    ----------
    kind
        ``epsilon_kind``'s value: certified, heuristic, weakened; None (no DP, no ε to log) gets
        the plain name.

    Returns
    -------
    str
        ``epsilon`` only for a certified ε (and None); ``epsilon_heuristic``,
        ``epsilon_weakened`` otherwise.
    """
    return EPSILON_METRICS.get(kind or "certified", "epsilon")


def labelled_epsilon(line: dict, kind: str | None) -> dict:
    """A round's metrics line with its ``epsilon`` under ``epsilon_metric(kind)``.

    Parameters
    ----------
    line
        The round's metrics.
    kind
        The run's ``epsilon_kind``.

    Returns
    -------
    dict
        A copy where renamed; the same dict where nothing is to rename.
    """
    name = epsilon_metric(kind)
    if name == "epsilon" or "epsilon" not in line:
        return line
    out = {k: v for k, v in line.items() if k != "epsilon"}
    out[name] = line["epsilon"]
    return out


def metric_epsilon(line: dict) -> float | None:
    """A round's ε from a metrics line of any kind.

    Parameters
    ----------
    line
        A line of ``metrics.jsonl`` (``epsilon``, ``epsilon_heuristic`` or ``epsilon_weakened``;
        lines written before the names existed use ``epsilon``).

    Returns
    -------
    float or None
        The ε, None where the line has none.
    """
    for name in EPSILON_METRICS.values():
        if line.get(name) is not None:
            return line[name]
    return None
