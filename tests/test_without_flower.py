"""Flower is an extra (``pip install 'fedudp[flower]'``): without ``flwr`` and ``ray`` the local
engine runs, ``engine=flower`` is one line saying what to install (before any long work), and
``import fedudp.flower`` is an ``ImportError`` with the same hint.

A fresh interpreter whose ``sys.meta_path`` refuses ``flwr`` and ``ray`` (as an environment
without the extra would) runs each check; the weakened twin (the same script without the
blocker) shows that the blocker is what the checks see: there, ``flwr`` imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HINT = (
    "engine=flower needs Flower: pip install 'fedudp[flower]' (the local engine needs nothing more)"
)

BLOCK = """
import importlib.abc, sys

class NoFlower(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("flwr", "ray"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoFlower())
"""

CHECKS = """
import json, sys, tempfile
import torch

torch.set_num_threads(1)
out = {}
try:
    import flwr  # noqa: F401
    out["flwr"] = "importable"
except ImportError:
    out["flwr"] = "absent"
import fedudp

cfg = {"method": "joint_dp", "train.rounds": 1, "partition.num_owners": 2,
       "dataset.num_records": 40, "dataset.pool_train": 200, "dataset.pool_test": 50,
       "dataset.features": 6, "train.batch_size": 8, "progress": False}
res = fedudp.simulate(cfg)
out["local"] = [res.stop_reason, res.rounds_completed, res.epsilon is not None]
try:
    fedudp.simulate({**cfg, "engine": "flower"}, out=tempfile.mkdtemp())
    out["flower_engine"] = None
except fedudp.ConfigError as e:
    out["flower_engine"] = str(e)
try:
    import fedudp.flower  # noqa: F401
    out["flower_package"] = None
except ImportError as e:
    out["flower_package"] = str(e)
out["loaded"] = sorted(m for m in sys.modules if m.split(".")[0] in ("flwr", "ray"))
print("RESULT " + json.dumps(out))
"""


def _run(script: str) -> dict:
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_without_flwr_and_ray_the_local_engine_runs_and_flower_says_what_to_install():
    got = _run(BLOCK + CHECKS)
    assert got["flwr"] == "absent"
    assert got["local"] == ["completed", 1, True]
    # exactly the one line, before any long work (a ConfigError, not an ImportError deep down)
    assert got["flower_engine"] == HINT
    assert (
        got["flower_package"] is not None
        and "pip install 'fedudp[flower]'" in (got["flower_package"])
    )
    assert "\n" not in got["flower_package"]
    assert got["loaded"] == []


TWIN = """
import json, sys
import fedudp.engines
fedudp.engines.require("flower")
import fedudp.flower
print("RESULT " + json.dumps({"flwr": "flwr" in sys.modules, "mod": fedudp.flower.__name__}))
"""


def test_the_blocker_is_what_the_check_sees():
    """Weakened twin: the same interpreter without the blocker imports ``fedudp.flower`` and
    passes the engine check (``fedudp.engines.require``, what a run calls first): the checks
    above see the blocker, not a missing install (no Flower run is started here)."""
    assert _run(TWIN) == {"flwr": True, "mod": "fedudp.flower"}
    try:
        _run(BLOCK + TWIN)
    except AssertionError as e:  # with the blocker: the one line
        assert HINT in str(e)
    else:
        raise AssertionError("the blocker let engine=flower through")
