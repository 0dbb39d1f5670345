"""Every printed ε is a readable number (issue 49: ``fedudp-report --select-best ...
--sweep-mean 1e300`` printed a 300-digit tuning-inclusive ε): fixed point below 1e6, four
significant digits in scientific notation from there, ``inf`` where infinite."""

from __future__ import annotations

import math

import pytest

from fedudp.privacy.labels import epsilon_display, epsilon_text
from fedudp.tuning import select_best, selection_lines
from tests.privacy.test_tuning import ISSUE_RUN, _groups, _sweep


@pytest.mark.parametrize(
    "eps,text",
    [
        (1.0, "1.000"),
        (15.8812, "15.881"),
        (999_999.4, "999999.400"),
        (1e6, "1.000e+06"),
        (6.9078e300, "6.908e+300"),
        (math.inf, "inf"),
    ],
)
def test_epsilon_text(eps, text):
    assert epsilon_text(eps) == text
    assert epsilon_display(eps, "heuristic") == f"{text} (heuristic)"


def _old_text(eps, digits=3):
    """The weakened twin: fixed point whatever the size (as before issue 49)."""
    return f"{float(eps):.{digits}f}"


def test_a_huge_declared_sweep_mean_prints_a_short_epsilon(monkeypatch):
    runs = _sweep(ISSUE_RUN, 3, 1)
    sel = select_best(_groups(runs), "accuracy_mean", sweep_size="poisson", sweep_mean=1e300)
    eps = sel["tuning_epsilon"]
    assert eps > 1e6  # a mean of 1e300 candidates: no guarantee left to speak of
    line = next(ln for ln in selection_lines(sel, []) if "tuning-inclusive" in ln)
    cell = line.split("|")[2].strip()
    assert cell == epsilon_text(eps) and len(cell) <= 16 and ("e+" in cell or cell == "inf")
    # the twin prints every digit
    import fedudp.tuning as tuning

    monkeypatch.setattr(tuning, "epsilon_text", _old_text)
    twin = next(ln for ln in selection_lines(sel, []) if "tuning-inclusive" in ln)
    if math.isfinite(eps):
        assert len(twin.split("|")[2].strip()) > 100
