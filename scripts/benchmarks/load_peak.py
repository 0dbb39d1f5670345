"""Peak resident memory of one fedudp run before its first round and over the whole run.

Runs the ``fedudp`` command line in this process (arguments as given after ``--``) with the
round loop (``fedudp.run.execute``) wrapped so that the process's high-water mark (``VmHWM``)
is read when the first round is about to start, and again at the end; prints one JSON line.
``--tree`` runs another checkout's ``fedudp`` (a ``git worktree`` of an older commit, say).

    python scripts/benchmarks/load_peak.py [--tree DIR] -- dataset.name=mnist ...
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def main() -> None:
    args = sys.argv[1:]
    cut = args.index("--") if "--" in args else len(args)
    opts, run_args = args[:cut], args[cut + 1 :]
    if opts[:1] == ["--tree"]:
        sys.path.insert(0, str(Path(opts[1]).resolve()))
    import fedudp.run as run_mod
    from fedudp.cli import main as cli_main

    seen: dict[str, float] = {}
    original = run_mod.execute
    start = time.perf_counter()

    def execute(*a, **k):  # type: ignore[no-untyped-def]
        seen["before_round_1_mib"] = _hwm_mib()
        seen["load_s"] = time.perf_counter() - start
        return original(*a, **k)

    run_mod.execute = execute
    sys.argv = ["fedudp", *run_args]
    cli_main()
    seen["whole_run_mib"] = _hwm_mib()
    seen["fedudp"] = str(Path(run_mod.__file__).parent)
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
