"""Each ledger line says how many owners failed in its round (issue 52: a lost node, a fault or
a timeout is an owner failure, released from the others under the fail-closed rule): the
count equals the metrics line's ``failed_owners``, and a round without failures says 0."""

from __future__ import annotations

import json

from conftest import tiny_cfg
from fedudp.run import run


def test_the_ledger_line_counts_the_rounds_failed_owners(tmp_path):
    cfg = tiny_cfg(
        "joint_dp",
        train__rounds=8,
        train__owner_dropout=0.2,
        train__min_owners=1,
        privacy__noise_multiplier=3.0,
        privacy__epsilon=50.0,
    )
    s = run(cfg, tmp_path)
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lines = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()][1:]
    released = {m["round"]: m["failed_owners"] for m in metrics if not m.get("withheld")}
    assert len(lines) == s["releases_made"] and {e["round"] for e in lines} == set(released)
    assert {e["round"]: e["owners_failed"] for e in lines} == released
    assert any(released.values()) and not all(released.values())  # both kinds of round seen
    entries = json.loads((tmp_path / "ledger.json").read_text())["entries"]
    assert [e["owners_failed"] for e in entries] == [e["owners_failed"] for e in lines]
