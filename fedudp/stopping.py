"""Stop signals for a run (standard library only): SIGINT/SIGTERM as ``RunInterrupted``.

``StopSignals`` is what the round loop (``fedudp.billboard.rounds.run_rounds``) runs under:
a signal raises ``RunInterrupted`` at once, or, inside ``critical()`` (a release being
ledgered and recorded), at the section's end. ``StopFlag`` is for a round loop that runs
outside the main thread (Flower's ServerApp, ``fedudp.flower.server_app``): the main thread
only records the signal, and the loop and the transport's waits poll it. Moved out of the round
loop so that OS signal handling is its own, dependency-free module.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeAlias

__all__ = [
    "RunInterrupted",
    "StopFlag",
    "StopSignals",
]

# what signal.signal() takes and returns: a handler, SIG_DFL / SIG_IGN, or None (not set in Python)
_Handler: TypeAlias = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class RunInterrupted(Exception):
    """SIGINT or SIGTERM arrived during a run (``signum``).

    Parameters
    ----------
    signum : int
        The signal's number (the message is its name).

    Attributes
    ----------
    signum : int
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopFlag:
    """A stop signal caught by the main thread for a round loop that runs in another thread
    (Flower's ServerApp): ``catching()`` installs SIGINT/SIGTERM handlers that only record the
    signal (a second one acts as the signal's default would); the loop and the transport's
    waits poll ``signum``.

    Attributes
    ----------
    signum : int or None
        The first stop signal caught (None: none yet).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[signal.Signals, _Handler] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second signal: no more waiting
            signal.signal(signum, signal.SIG_DFL)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
            return
        self.signum = signum

    def check(self) -> None:
        """Raise ``RunInterrupted`` if a stop signal arrived."""
        if self.signum is not None:
            raise RunInterrupted(self.signum)

    @contextlib.contextmanager
    def catching(self):
        """The handlers, installed while the block runs (main thread only; else a no-op)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
        try:
            yield self
        finally:
            for sig, old in self._old.items():
                signal.signal(sig, old)
            self._old.clear()


class StopSignals:
    """SIGINT/SIGTERM as ``RunInterrupted`` (main thread only), deferred inside ``critical()``;
    in another thread, the ``flag`` the main thread sets, polled by ``check()`` (each round,
    the end of each critical section, and the transport's waits).

    Parameters
    ----------
    flag : StopFlag, optional
        The main thread's flag, polled by ``check()``.

    Attributes
    ----------
    pending : int or None
        A signal deferred until the critical section ends.
    """

    def __init__(self, flag: StopFlag | None = None) -> None:
        self.pending: int | None = None
        self.flag = flag
        self._depth = 0
        self._old: dict[signal.Signals, _Handler] = {}

    def check(self) -> None:
        if not self._depth and self.flag is not None:
            self.flag.check()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self._depth:
            self.pending = signum
            return
        raise RunInterrupted(signum)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    @contextlib.contextmanager
    def critical(self):
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if not self._depth and self.pending is not None:
            signum, self.pending = self.pending, None
            raise RunInterrupted(signum)
        self.check()
