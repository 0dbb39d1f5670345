"""How a run stops — diverged, interrupted — and what it leaves behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_cfg
from fedudp.config import ConfigError
from fedudp.run import run

ROOT = Path(__file__).resolve().parents[2]


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_diverging_learning_rate_stops_with_diverged_and_keeps_the_last_finite_state(tmp_path):
    s = run(tiny_cfg("fedavg", **{"train.lr": 1e38, "train.rounds": 30}), tmp_path)
    assert s["stop_reason"] == "diverged" and s["rounds_completed"] < 30
    assert "round" in s["stop_message"] and "train.lr" in s["stop_message"]
    assert s["accuracy_mean"] is None or s["accuracy_mean"] == s["accuracy_mean"]  # not NaN
    for name in ("summary.json", "ledger.json", "ledger.jsonl", "metrics.jsonl", "owners.csv"):
        assert (tmp_path / name).is_file()


def test_cli_diverged_is_one_line_and_nonzero(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedudp.run",
            "train.lr=1e38",
            "train.rounds=30",
            "method=fedavg",
            "dataset.num_records=400",
            "partition.num_owners=4",
            f"hydra.run.dir={tmp_path}",
            "progress=false",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 3, p.stderr[-2000:]
    assert [ln for ln in p.stderr.splitlines() if ln.startswith("fedudp: diverged: round ")]


def test_ledger_jsonl_is_the_ledger_round_by_round(tmp_path):
    s = run(tiny_cfg("full_dp", **{"train.rounds": 4}), tmp_path)
    head, *entries = _lines(tmp_path / "ledger.jsonl")
    final = json.loads((tmp_path / "ledger.json").read_text())
    assert head["unit"] == final["unit"] == "user" and head["notes"] == final["notes"]
    assert entries == final["entries"] and len(entries) == s["rounds_completed"] == 4


def test_an_output_folder_of_another_run_is_refused(tmp_path):
    run(tiny_cfg("fedavg", **{"train.rounds": 1}), tmp_path)
    with pytest.raises(ConfigError, match="another run"):
        run(tiny_cfg("fedavg", **{"train.rounds": 2}), tmp_path)
    again = run(tiny_cfg("fedavg", **{"train.rounds": 1}), tmp_path)  # same config: finished
    assert again["skipped"]
    # thread count and progress display are not part of the experiment: still the same run
    again = run(
        tiny_cfg("fedavg", **{"train.rounds": 1, "engine_opts.threads": 1, "progress": True}),
        tmp_path,
    )
    assert again["skipped"]
    # a run saved before a config key existed (the key at its default) is still the same run
    saved = (tmp_path / "config.yaml").read_text()
    assert "\nalgorithm:" in saved and "\ncheckpoint:" in saved
    lines, skip = [], False
    for line in saved.splitlines():
        skip = line.startswith("algorithm:") or (skip and line.startswith(" "))
        if not skip:
            lines.append(line)
    (tmp_path / "config.yaml").write_text("\n".join(lines) + "\n")
    assert "algorithm" not in (tmp_path / "config.yaml").read_text()
    assert run(tiny_cfg("fedavg", **{"train.rounds": 1}), tmp_path)["skipped"]


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_run_within_seconds_with_every_file(tmp_path, sig, code):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedudp.run",
            "method=full_dp",
            "train.rounds=500",
            "dataset.num_records=2000",
            "partition.num_owners=8",
            "privacy.noise_multiplier=5",
            "privacy.epsilon=100",
            f"hydra.run.dir={tmp_path}",
            "progress=false",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "metrics.jsonl"
    t_end = time.time() + 120
    while time.time() < t_end and not (metrics.is_file() and len(_lines(metrics)) >= 3):
        time.sleep(0.05)
    assert metrics.is_file(), "the run never started"
    t0 = time.time()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert time.time() - t0 < 10
    assert proc.returncode == code, err[-2000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["stop_reason"] == "interrupted" and s["signal"] == sig
    rounds = [m["round"] for m in _lines(metrics)]
    assert rounds == list(range(1, s["rounds_completed"] + 1))  # no round after it
    led = _lines(tmp_path / "ledger.jsonl")[1:]
    assert (
        len(led)
        == s["rounds_completed"]
        == len(json.loads((tmp_path / "ledger.json").read_text())["entries"])
    )
    assert s["epsilon"] == led[-1]["epsilon"]
    assert (tmp_path / "owners.csv").is_file()
