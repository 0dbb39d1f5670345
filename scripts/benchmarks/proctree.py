"""Memory and CPU time of a benchmark's process tree, read from /proc (Linux): the benchmarks
that start their measured side as a subprocess in its own session sample it every fraction of
a second."""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def status_kib(key: str, pid: str | int = "self") -> int:
    """A ``/proc/<pid>/status`` value in KiB (``VmRSS``, ``VmHWM``, ...); 0 if absent."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def session_sample(sid: int) -> tuple[int, int, dict[int, float]]:
    """(summed VmRSS in bytes, number of processes, CPU seconds (user + system) by pid) of the
    processes in session ``sid`` (a subprocess started with ``start_new_session=True`` and
    everything it starts). Shared pages count once per process. A caller that keeps each
    pid's largest CPU reading over its samples has the tree's CPU time, up to what a process
    spent after its last sample. A process that has ended but is not yet reaped (a zombie,
    state ``Z``) has no memory: its final CPU time is read, but it is not counted and adds no
    RSS, so ``count`` can be smaller than ``len(cpu)``."""
    total = count = 0
    cpu: dict[int, float] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[3]) != sid:  # field 6 (session); stat[k] is field k + 3
                continue
            cpu[int(d.name)] = (int(stat[11]) + int(stat[12])) / _TICK  # utime, stime
            if stat[0] == "Z":  # field 3 (state): ended, not yet reaped; no memory left
                continue
            rss = status_kib("VmRSS", d.name) * 1024
            if rss == 0:  # it ended between the two reads (a loaded machine): no memory left
                continue
            total += rss
            count += 1
        except (OSError, ValueError, IndexError):
            continue
    return total, count, cpu


def session_tree(sid: int) -> tuple[int, int]:
    """(summed VmRSS in bytes, number of processes) of session ``sid`` (``session_sample``)."""
    return session_sample(sid)[:2]
