"""``engine_opts.owners_per_node``: blocks of owners per Flower SuperNode, one message per node
and round, equal to the local engine; a failed node fails every owner of its block; the
distributed path with a mask per owner and a reveal per surviving owner."""

from __future__ import annotations

import json

import numpy as np
import pytest

import fedudp.flower.wire as flower_wire
from flower_faults import inject
from fedudp.run import run
from test_flower_engine import (  # noqa: F401
    Capture,
    _assert_equivalent,
    _both,
    _metrics,
    one_ray_for_the_module,
    tiny,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_ray_for_the_module")]


def _train_replies(cap) -> list:
    return [m for m in cap.received if m.metadata.message_type == "train"]


@pytest.mark.parametrize(
    "method,per,kw",
    [
        ("fedavg", 2, {"train.rounds": 2}),
        # uneven blocks [0, 3) and [3, 4); a Poisson cohort (some owners without units)
        (
            "joint_dp",
            3,
            {"train.sampling_rate": 0.5, "privacy.noise_multiplier": 3.0, "privacy.epsilon": 5.0},
        ),
    ],
)
def test_blocks_match_the_local_engine(method, per, kw, tmp_path, monkeypatch):
    kw = {**kw, "engine_opts.owners_per_node": per}
    cap, out = _both(kw, method, tmp_path, monkeypatch)
    _assert_equivalent(cap, out)
    t = cap.flower_transport
    nodes = -(-4 // per)
    assert len(t.node_of_block) == nodes == out["flower"][0]["flower_nodes"]
    rounds = len(out["flower"][1])
    assert len(_train_replies(cap)) == nodes * rounds  # one message per node and round


def test_a_failed_node_fails_every_owner_of_its_block(tmp_path, monkeypatch):
    cap = Capture(monkeypatch)
    inject(monkeypatch, {(2, 2): "raise"})  # the node of owners 2 and 3 fails in round 2
    cfg = tiny(
        "joint_dp",
        "flower",
        **{
            "privacy.noise_multiplier": 3.0,
            "privacy.epsilon": 5.0,
            "engine_opts.owners_per_node": 2,
        },
    )
    s = run(cfg, tmp_path)
    m = _metrics(tmp_path)
    users = np.diff(cap.flower_transport.fed.owner_user_offsets)
    assert s["stop_reason"] == "completed"
    assert m[0]["failed_owners"] == 0
    assert m[1]["failed_owners"] == 2 and m[1]["failed_units"] == users[2] + users[3]
    assert m[1]["users_used"] == 120 - users[2] - users[3]
    assert [(f["owner"], f["units"]) for f in m[1]["failures"]] == [
        (2, int(users[2])),
        (3, int(users[3])),
    ]
    assert len(json.loads((tmp_path / "ledger.json").read_text())["entries"]) == 3


DIST = {"privacy.placement": "distributed", "train.min_owners": 2, "train.rounds": 2}


def test_distributed_blocks_send_a_share_per_owner(tmp_path, monkeypatch):
    cap, out = _both({**DIST, "engine_opts.owners_per_node": 2}, "joint_dp", tmp_path, monkeypatch)
    loc, flo = cap.results["local"], cap.results["flower"]
    for k in loc.shared:
        np.testing.assert_allclose(flo.shared[k], loc.shared[k], atol=1e-8, rtol=0)
    for a, b in zip(out["local"][1], out["flower"][1]):
        assert a["epsilon"] == b["epsilon"] and a["agg_survivors"] == b["agg_survivors"] == 4
    stacked = [
        m.content[flower_wire.K_VECTORS]["shares"].numpy()
        for m in _train_replies(cap)
        if flower_wire.K_VECTORS in m.content
    ]
    assert len(stacked) == 2 * 2 and all(v.shape[0] == 2 for v in stacked)
    assert all(v.dtype == np.uint64 for v in stacked)


@pytest.mark.slow
def test_a_failed_node_is_unmasked_by_the_other_blocks_reveals(tmp_path, monkeypatch):
    inject(monkeypatch, {(2, 0): "raise"})  # the node of owners 0 and 1 fails in round 2
    cfg = tiny("joint_dp", "flower", **{**DIST, "engine_opts.owners_per_node": 2})
    s = run(cfg, tmp_path)
    m = _metrics(tmp_path)
    assert s["stop_reason"] == "completed"
    assert m[1]["failed_owners"] == 2 and m[1]["agg_survivors"] == 2
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert [int(e["event"].split("owners=")[1].split(",")[0]) for e in ledger["entries"]] == [4, 2]
