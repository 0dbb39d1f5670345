"""Test helper (the fault matrix of tests/test_faults.py): a fedudp run that SIGKILLs itself at a chosen point.

``python tests/kill_run.py OUT ROUND PHASE KEY=VALUE...`` runs ``fedudp.run.run`` on
``tiny_cfg(**overrides)`` (``KEY=VALUE`` parsed as JSON when it can be) in OUT and kills its
own process with SIGKILL (no handler, no cleanup) at:

* ``before_checkpoint``: round ROUND's metrics and ledger lines written, its checkpoint not;
* ``after_checkpoint``: round ROUND's checkpoint written;
* ``mid_checkpoint``: half of round ROUND's checkpoint bytes written to its temporary file;
* ``after_round``: round ROUND's metrics and ledger lines written, whether or not a checkpoint
  is due after it (with ``checkpoint.every=3``, ROUND 5 dies two rounds past its checkpoint);
* ``after_release``: round ROUND released (its ledger line durable), the shared parameters not
  yet broadcast and its metrics line not written.

Without ROUND (``0``) the run is not killed. ``resume`` is a key like any other.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import tiny_cfg  # noqa: E402
import fedudp.run  # noqa: E402
from fedudp.billboard.server import Billboard  # noqa: E402
from fedudp.protocol import checkpoint  # noqa: E402
from fedudp.run import run  # noqa: E402


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def arm(kill_round: int, phase: str) -> None:
    """Patch the checkpointer so that the process dies at (``kill_round``, ``phase``)."""
    save, write = checkpoint.Checkpointer.save, checkpoint.atomic_write

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def patched_save(self, round_, state):
        if round_ == kill_round and phase == "before_checkpoint":
            die()
        path = save(self, round_, state)
        if round_ == kill_round and phase == "after_checkpoint":
            die()
        return path

    def patched_write(path, data):
        if phase == "mid_checkpoint" and Path(path).name == f"ckpt-{kill_round:06d}.pt":
            tmp = Path(path).with_name(f".{Path(path).name}.tmp{os.getpid()}")
            with open(tmp, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
            die()
        write(path, data)

    checkpoint.Checkpointer.save = patched_save
    checkpoint.atomic_write = patched_write
    writer, release = fedudp.run._RoundWriter.__call__, Billboard.release

    def patched_writer(self, info):
        writer(self, info)
        if phase == "after_round" and info.get("round") == kill_round:
            die()

    def patched_release(self, replies, round_, answered=None):
        agg = release(self, replies, round_, answered)
        if phase == "after_release" and round_ == kill_round:
            die()
        return agg

    fedudp.run._RoundWriter.__call__ = patched_writer
    Billboard.release = patched_release


def main(argv: list[str]) -> None:
    out, kill_round, phase, *pairs = argv
    kw = {k.replace(".", "__"): _value(v) for k, v in (p.split("=", 1) for p in pairs)}
    method = kw.pop("method", "joint_dp")
    if int(kill_round):
        arm(int(kill_round), phase)
    summary = run(tiny_cfg(method, **kw), out)
    print(json.dumps({"stop_reason": summary["stop_reason"]}))


if __name__ == "__main__":
    main(sys.argv[1:])
