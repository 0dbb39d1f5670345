"""Memory of a benchmark's process tree, read from /proc (Linux): the benchmarks that start
their measured side as a subprocess in its own session sample it every fraction of a second."""
from __future__ import annotations

from pathlib import Path


def status_kib(key: str, pid: str | int = "self") -> int:
    """A ``/proc/<pid>/status`` value in KiB (``VmRSS``, ``VmHWM``, ...); 0 if absent."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def session_tree(sid: int) -> tuple[int, int]:
    """(summed VmRSS in bytes, number of processes) of the processes in session ``sid`` (a
    subprocess started with ``start_new_session=True`` and everything it starts). Shared pages
    count once per process."""
    total = count = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[3]) != sid:
                continue
            total += status_kib("VmRSS", d.name) * 1024
            count += 1
        except (OSError, ValueError, IndexError):
            continue
    return total, count
