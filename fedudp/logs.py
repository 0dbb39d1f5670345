"""Logging configured once: no duplicate lines from dp-accounting (standard library only, the
bottom layer, so that the privacy layer and the Flower wrapper both use it).

dp-accounting's RDP accountant warns through ``absl.logging`` (``_compute_log_a_frac`` failing to
converge at some orders, which happens at a sampling rate q < 1), and ``absl.logging.log`` calls
``logging.basicConfig()`` whenever the root logger has no handler, whatever the level of the
``absl`` logger. That gives the root logger a stderr handler; Flower's ``flwr`` logger has its
own handler and propagates to the root, so from then on every ServerApp line is printed twice.

``root_placeholder()`` keeps the root logger from being configured behind the application's
back: while it is active, a root logger without handlers holds one ``_LastResort`` handler, so
absl finds a handler and configures nothing. That handler does what Python does for a record
no handler takes (``logging.lastResort``: WARNING and above to stderr), and nothing for a record
that a handler of its logger's chain (e.g. Flower's) has already printed. Leaving the block
removes it. ``UserLevelDP`` runs its calibration (``from_run_config``) and its rounds
(``start``) inside it, and the privacy layer's ``quiet_absl`` (every dp-accounting call that may
warn) holds it too, so a CLI or billboard run is not configured behind its back either.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["root_placeholder"]


def _handled_below_root(record: logging.LogRecord) -> bool:
    """Whether a handler of the record's logger or an ancestor below the root took it."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    root = logging.getLogger()
    while logger is not None and logger is not root:
        if logger.handlers:
            return True
        if not logger.propagate:
            return True  # it never reaches the root anyway
        logger = logger.parent
    return False


class _LastResort(logging.Handler):
    """Python's behaviour for a record that no handler takes (``logging.lastResort``)."""

    def emit(self, record: logging.LogRecord) -> None:
        last = logging.lastResort
        if last is None or _handled_below_root(record) or record.levelno < last.level:
            return
        last.handle(record)


@contextlib.contextmanager
def root_placeholder() -> Iterator[None]:
    """While active, a root logger without handlers holds a stand-in handler (Python's own
    last-resort behaviour), so that no library call (absl's ``log``) runs
    ``logging.basicConfig()`` and duplicates every propagated line; removed on exit. A root
    logger that already has handlers (the application configured logging) is left alone.

    Yields
    ------
    None
    """
    root = logging.getLogger()
    if root.handlers:
        yield
        return
    held = _LastResort()
    root.addHandler(held)
    try:
        yield
    finally:
        root.removeHandler(held)
