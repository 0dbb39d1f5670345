"""fedudp's own ``engine=flower``: a completed run's note (withheld rounds, written by the
round loop both engines run, ``fedudp.billboard.rounds.completion_notes``) is warned in the
ServerApp's log; the twin that leaves the result as it is warns nothing."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from fedudp.billboard.rounds import RoundsResult, completion_notes
from fedudp.flower.server_app import final_status


def result(history: list[dict], stop: str = "completed") -> RoundsResult:
    msg = completion_notes(history, len(history)) if stop == "completed" else ""
    return RoundsResult({}, {}, np.zeros(1), np.zeros(1), len(history), stop, history, {}, msg)


@pytest.mark.parametrize("twin", [False, True])
def test_a_run_with_withheld_rounds_says_so_at_its_end(twin, caplog):
    caplog.set_level(logging.WARNING)
    hist = [{"round": 1}, {"round": 2, "withheld": "1 owner(s) answered"}, {"round": 3}]
    res = result(hist) if twin else final_status(result(hist))
    assert res.message.startswith("1 of 3 rounds withheld (rounds 2)")
    warned = any("rounds withheld" in r.getMessage() for r in caplog.records)
    assert warned is (not twin)
    # nothing to say: every round released
    caplog.clear()
    assert final_status(result([{"round": 1}])).message == ""
    assert not caplog.records
