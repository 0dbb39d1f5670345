"""What ``scripts/benchmarks/bench_pfl.py``'s two side workers share (standard library only: the pfl worker
runs with pfl's Python): their command line and a reading of the process's own memory."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def start_worker(
    description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """The arguments ``bench_pfl.worker_cmd`` passes to a side worker, parsed (``extra`` adds a
    worker's own); torch limited to ``--threads`` threads (OpenMP and MKL too) and the
    repository root put on ``sys.path`` (for ``fedudp.models.cnn``, which needs only torch)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--workload", required=True, help="the .npz bench_pfl.py prepared")
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--epochs", type=int, required=True)
    ap.add_argument("--clip", type=float, required=True)
    ap.add_argument("--noise-multiplier", type=float, required=True)
    ap.add_argument("--server-lr", type=float, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--final-params", help="also write the final weights here (.npz)")
    if extra is not None:
        extra(ap)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    sys.path.insert(0, str(ROOT))
    return a


def status_kib(key: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``); 0 where absent."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0
