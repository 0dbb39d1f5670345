"""``privacy.placement=distributed`` on engine=flower (issue 51): each owner's ClientApp sends
one masked share (uint64, the padded length), the billboard decodes only the sum, and with
the same seed both engines release the same values (the same shares, masks and noise, keyed by
public ids); an owner that fails has its masks removed with the pair seeds the survivors
reveal (a second exchange), and the round is accounted at its survivors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import fedudp.flower.wire as flower_wire
from flower_faults import inject
from fedudp.run import run
from test_flower_engine import Capture, _metrics, one_ray_for_the_module, tiny  # noqa: F401

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_ray_for_the_module")]

KW = {"privacy.placement": "distributed", "train.min_owners": 2, "train.rounds": 2}


def test_flower_sends_masked_shares_and_matches_the_local_engine(tmp_path, monkeypatch):
    cap = Capture(monkeypatch)
    out = {}
    for eng in ("local", "flower"):
        out[eng] = (run(tiny("joint_dp", eng, **KW), tmp_path / eng), _metrics(tmp_path / eng))
    loc, flo = cap.results["local"], cap.results["flower"]
    for k in loc.shared:
        torch.testing.assert_close(flo.shared[k], loc.shared[k], atol=1e-8, rtol=0)
    for a, b in zip(out["local"][1], out["flower"][1]):
        assert a["epsilon"] == b["epsilon"] and a["agg_survivors"] == b["agg_survivors"] == 4
    padded = cap.flower_transport.constraint().secure.padded
    shares = [
        m.content[flower_wire.K_VECTORS]["share"].numpy()
        for m in cap.received
        if flower_wire.K_VECTORS in m.content
    ]
    assert len(shares) == 2 * 4  # one per owner and round, nothing else
    for v in shares:
        assert v.dtype == np.uint64 and v.shape == (padded,)
    for m in cap.received:  # no float vector reached the billboard
        for rec in m.content.array_records.values():
            for arr in rec.values():
                assert arr.numpy().dtype == np.uint64 or m.metadata.message_type == "evaluate"


@pytest.mark.slow
def test_a_failed_owner_is_unmasked_by_the_survivors_reveals(tmp_path, monkeypatch):
    inject(monkeypatch, {(2, 1): "raise"})  # owner 1 fails in round 2
    s = run(tiny("joint_dp", "flower", **KW), tmp_path)
    m = _metrics(tmp_path)
    assert s["stop_reason"] == "completed"
    assert m[1]["failed_owners"] == 1 and m[1]["agg_survivors"] == 3
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert [int(e["event"].split("owners=")[1].split(",")[0]) for e in ledger["entries"]] == [4, 3]
    assert ledger["trust"] == "server: untrusted (secure aggregation)"
