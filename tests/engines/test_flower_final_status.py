"""fedudp's own ``engine=flower``: a completed run in which some rounds were withheld says so
at its end (the summary's ``stop_message`` and the ServerApp's log), not only ``completed``;
the twin that leaves the result as it is says nothing."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from fedudp.billboard.rounds import RoundsResult
from fedudp.engines.flower_server import final_status


def result(history: list[dict], stop: str = "completed") -> RoundsResult:
    return RoundsResult({}, {}, np.zeros(1), np.zeros(1), len(history), stop, history)


def said(res: RoundsResult) -> bool:
    """The end of the run names the withheld rounds."""
    return "withheld (rounds 2)" in res.message


@pytest.mark.parametrize("twin", [False, True])
def test_a_run_with_withheld_rounds_says_so_at_its_end(twin, caplog):
    caplog.set_level(logging.WARNING)
    hist = [{"round": 1}, {"round": 2, "withheld": "1 owner(s) answered"}, {"round": 3}]
    res = (lambda r: r)(result(hist)) if twin else final_status(result(hist))
    assert said(res) is (not twin)
    if not twin:
        assert res.message.startswith("1 of 3 rounds withheld") and res.stop_reason == "completed"
        assert any("rounds withheld" in r.getMessage() for r in caplog.records)
    # nothing to say: every round released, or another stop already explained
    assert final_status(result([{"round": 1}])).message == ""
    assert final_status(result(hist, "diverged")).message == ""
