"""``scripts/benchmarks/bench_flower_user_dp.py`` (user-level DP wrapper vs plain Flower FedAvg) at a tiny
size: the three sides run (each in its own subprocess), every round is timed, the tables name
them, the per-user path trains once per user, the fast path once per client (one batched
``TorchTraining.updates``), and both wrapped sides keep their ledger."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(360), pytest.mark.slow]  # three Ray simulations: ~75 s


def test_the_overhead_benchmark_runs_both_sides(tmp_path):
    js, md = tmp_path / "bench.json", tmp_path / "table.md"
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "benchmarks" / "bench_flower_user_dp.py"),
            "--n",
            "2",
            "--reps",
            "1",
            "--rounds",
            "2",
            "--json",
            str(js),
            "--markdown",
            str(md),
        ],
        capture_output=True,
        text=True,
        timeout=350,
        cwd=ROOT,
        env=env,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    out = json.loads(js.read_text())
    reps = out["repetitions"]
    assert [r["side"] for r in reps] == ["plain", "fast", "wrapped"]
    for r in reps:
        assert r["n"] == 2 and len(r["round_seconds"]) == 2
        assert all(t > 0 for t in r["round_seconds"]) and r["s_per_round"] > 0
        assert r["wall_s"] > 0 and r["peak_rss_mb"] > 0 and r["cpu_s_per_round"] >= 0
        calls = 2 * 10 if r["side"] == "wrapped" else 2  # once per user vs once per client
        assert all(c["train_calls"] == calls and c["replies"] == 2 for c in r["client_seconds"])
    for wrapped in reps[1:]:
        assert wrapped["ledger_rounds"] == 2 and 0 < wrapped["epsilon"] <= 8.0 * (1 + 1e-6)
        assert wrapped["users_per_round"] == [20, 20]  # rate 1: every user, every round
        assert wrapped["server_s_per_round"]["accountant.epsilon"] > 0
    s = out["summary"]["2"]
    assert s["plain"]["min"] > 0 and s["wrapped"]["min"] > 0 and s["ratio_median"] > 0
    assert s["fast"]["min"] > 0 and s["fast_ratio_median"] > 0
    table = md.read_text()
    for label in ("plain", "fast (fast path)", "wrapped (per-user path)"):
        assert f"| 2 (20) | {label} |" in table and f"| 2 (20) | {label} |" in p.stdout
