"""Ray processes never outlive the run that started them, even after SIGKILL.

``start(pid)`` launches this file as a small separate process (its own session, standard
library only, no fedudp import). While the driver ``pid`` lives it records, every half second,
the driver's descendant processes whose command line names Ray (raylet, gcs_server, the
dashboard and runtime-env agents, ``ray::`` workers), each with its start time. When the
driver is gone (finished, crashed or SIGKILLed) it sends SIGTERM to those still alive (same pid
*and* start time, so a reused pid is never touched), SIGKILL after ``GRACE_S`` seconds, and
exits. Processes of other users of Ray are never descendants of the driver. Linux only
(``/proc``); elsewhere ``start`` does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

__all__ = ["start", "watch", "ray_descendants", "POLL_S", "GRACE_S"]

POLL_S = 0.5
GRACE_S = 5.0


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid``, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def ray_descendants(root: int) -> dict[int, int]:
    """{pid: start time} of ``root``'s descendants whose command line names Ray.

    Parameters
    ----------
    root : int
        A process id.

    Returns
    -------
    dict[int, int]
    """
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            children.setdefault(st[0], []).append(int(name))
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        st = _stat(pid)
        if st is not None and pid != os.getpid() and "ray" in _cmdline(pid).lower():
            out[pid] = st[1]
    return out


def _alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == start


def watch(driver: int) -> None:
    """Record the driver's Ray processes until it is gone, then end the ones still alive.

    Parameters
    ----------
    driver : int
        The process id of the run that started Ray.
    """
    first = _stat(driver)
    if first is None:
        return
    seen: dict[int, int] = {}
    while _alive(driver, first[1]):
        seen.update(ray_descendants(driver))
        time.sleep(POLL_S)
    left = {p: t for p, t in seen.items() if _alive(p, t)}
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    t_end = time.time() + GRACE_S
    while time.time() < t_end and any(_alive(p, t) for p, t in left.items()):
        time.sleep(0.2)
    for pid, t in left.items():
        if _alive(pid, t):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


_STARTED: set[int] = set()


def start(driver: int | None = None) -> subprocess.Popen | None:
    """Start one watchdog for ``driver`` (default: this process).

    Parameters
    ----------
    driver : int or None
        The process whose Ray descendants are ended when it is gone.

    Returns
    -------
    subprocess.Popen or None
        The watchdog; None where /proc is absent or one watches ``driver`` already.
    """
    driver = os.getpid() if driver is None else driver
    if driver in _STARTED or not os.path.isdir("/proc"):
        return None
    _STARTED.add(driver)
    return subprocess.Popen(
        [sys.executable, "-S", "-E", os.path.abspath(__file__), str(driver)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


if __name__ == "__main__":
    watch(int(sys.argv[1]))
