"""Row (b) of the privacy audit table (issue 49): a run killed after round 5 and resumed.

The scenario: ``method=joint_dp`` on the test suite's tiny federation (4 owners, 160 one-record
users, 12 features), 6 rounds, q = 0.5, ε = 2 (δ default), ``checkpoint.every=3``; the process
SIGKILLs itself right after round 5's metrics and ledger lines are written (two rounds past its
checkpoint of round 3), then ``resume=<run folder>``. Both processes are children run on the
source tree ``--tree`` (the tree before the fix, a worktree of 13691d9, or this checkout).

Measured, from the files alone: the releases made (every ledger line of the killed run as it
died, plus the resumed run's lines beyond its checkpoint; a seeded release with the SHA-256 of
one already made is that same release), the ε summary.json and ledger.jsonl report, and the ε of
the composition of every release made (``fedudp.privacy.ledger_epsilon.epsilon_of_ledger`` of
this checkout, on the tree's own head line). A resumed run is sound when the latter is not
above the former. The noise multiplier is calibrated once (``privacy.epsilon=2`` for 6 rounds,
by the first child) and passed to the others as ``privacy.noise_multiplier``.

Usage::

    git worktree add /tmp/wt-before 13691d9
    .venv/bin/python scripts/reproductions/paths_resume.py --tree /tmp/wt-before --label before
    .venv/bin/python scripts/reproductions/paths_resume.py --label after
    git worktree remove --force /tmp/wt-before

Each appends its rows to ``--out`` (default docs/results/privacy_audit/paths_resume.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = {
    "method": "joint_dp",
    "progress": False,
    "dataset.num_records": 160,
    "dataset.pool_train": 1000,
    "dataset.pool_test": 200,
    "dataset.features": 12,
    "partition.num_owners": 4,
    "train.batch_size": 8,
    "train.rounds": 6,
    "train.sampling_rate": 0.5,
    "privacy.epsilon": 2.0,
    "checkpoint.every": 3,
}
KILL_ROUND, CHECKPOINT_ROUND = 5, 3

CHILD = r"""
import json, os, signal, sys
import torch
torch.set_num_threads(1)
import fedudp.run as fr
from fedudp.config import config_from_overrides
out, kill, overrides = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
if kill:
    write = fr._RoundWriter.__call__
    def dies(self, info):
        write(self, info)
        if info.get("round") == kill:
            os.kill(os.getpid(), signal.SIGKILL)
    fr._RoundWriter.__call__ = dies
s = fr.run(config_from_overrides(overrides), out)
print(json.dumps({"noise_multiplier": s["noise_multiplier"], "stop_reason": s["stop_reason"]}))
"""


def _child(tree: Path, out: Path, kill: int, overrides: dict) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=str(tree),
        FLWR_TELEMETRY_ENABLED="0",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    cmd = [sys.executable, "-c", CHILD, str(out), str(kill), json.dumps(overrides)]
    return subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True)


def case(tree: Path, randomness: str, z: float | None, work: Path) -> dict:
    """Kill after round 5, resume; what the files say."""
    sys.path.insert(0, str(ROOT))
    from fedudp.privacy.ledger_epsilon import epsilon_of_ledger
    from fedudp.protocol import ledger_file

    out = work / randomness
    shutil.rmtree(out, ignore_errors=True)
    overrides = {**SCENARIO, "privacy.randomness": randomness}
    if z is not None:
        overrides["privacy.noise_multiplier"] = z
    t0 = time.perf_counter()
    p = _child(tree, out, KILL_ROUND, overrides)
    if p.returncode != -signal.SIGKILL:
        raise SystemExit(f"the killed run ended with {p.returncode}: {p.stderr[-1500:]}")
    _, killed = ledger_file.read(out / "ledger.jsonl")
    p = _child(tree, out, 0, {**overrides, "resume": str(out)})
    if p.returncode:
        raise SystemExit(f"the resumed run failed: {p.stderr[-1500:]}")
    seconds = time.perf_counter() - t0
    head, entries = ledger_file.read(out / "ledger.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    same = {(e.round, e.release_sha256) for e in killed if e.release_sha256 is not None}
    n = len([e for e in killed if e.round <= CHECKPOINT_ROUND])
    new = [e for e in entries[n:] if not e.superseded]
    again = [e for e in new if (e.round, e.release_sha256) in same]
    if randomness == "seeded" and not again and all(e.release_sha256 is None for e in killed):
        # a tree that records no SHA-256: a seeded re-release is identical by construction
        # (same keyed sample and noise); its ε and event must be the killed run's
        again = [e for e in new if e.round <= KILL_ROUND]
        assert [(e.round, e.event, e.epsilon) for e in again] == [
            (e.round, e.event, e.epsilon) for e in killed[n:]
        ]
    made = list(killed) + [e for e in new if e not in again]
    eps_made = epsilon_of_ledger(head, made)
    return {
        "randomness": randomness,
        "noise_multiplier": summary["noise_multiplier"],
        "processes_released": len(killed) + len(new),
        "rereleased_identical": len(again),
        "releases_made": len(made),
        "ledger_entries": len(entries),
        "ledger_superseded": sum(e.superseded for e in entries),
        "summary_epsilon": summary["epsilon"],
        "ledger_epsilon": epsilon_of_ledger(head, entries),
        "epsilon_of_releases_made": eps_made,
        "target_epsilon": SCENARIO["privacy.epsilon"],
        "rounds_completed": summary["rounds_completed"],
        "stop_reason": summary["stop_reason"],
        "resume_record": (head.get("extra") or {}).get("resumes"),
        "sound": eps_made <= summary["epsilon"] * (1 + 1e-12),
        "seconds": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=ROOT, help="the fedudp source tree to run")
    ap.add_argument("--label", default="after")
    ap.add_argument("--noise-multiplier", type=float, default=None, help="skip the calibration")
    ap.add_argument(
        "--out", type=Path, default=ROOT / "docs/results/privacy_audit/paths_resume.jsonl"
    )
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        z = a.noise_multiplier
        rows = []
        for randomness in ("secure", "seeded"):
            row = case(a.tree.resolve(), randomness, z, Path(tmp))
            z = row["noise_multiplier"] if z is None else z
            rows.append(row)
    commit = subprocess.run(
        ["git", "-C", str(a.tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    with open(a.out, "a") as f:
        for row in rows:
            line = {"row": "b", "label": a.label, "tree_commit": commit, **row}
            f.write(json.dumps(line) + "\n")
            print(json.dumps(line))
    print(f"wall time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
