"""dp-accounting's warnings never configure the root logger behind a run's back
(``fedudp.privacy.bounded.quiet_absl`` holds ``fedudp.logs.root_placeholder``): absl's ``log()``
runs ``logging.basicConfig()`` on a bare root logger whatever the absl logger's level, and every
propagated line would be printed twice from then on."""

from __future__ import annotations

import logging

from absl import logging as absl_logging

from fedudp.privacy.bounded import quiet_absl


def _bare_root():
    root = logging.getLogger()
    saved = root.handlers[:]
    for h in saved:
        root.removeHandler(h)
    return root, saved


def test_a_warning_inside_quiet_absl_leaves_the_root_logger_bare():
    root, saved = _bare_root()
    try:
        with quiet_absl():
            absl_logging.warning("an excluded RDP order")
        assert root.handlers == []
        # weakened twin: the same warning with the absl level raised alone (the old
        # quiet_absl) configures the root logger
        absl = logging.getLogger("absl")
        level = absl.level
        absl.setLevel(logging.ERROR)
        try:
            absl_logging.warning("an excluded RDP order")
        finally:
            absl.setLevel(level)
        assert root.handlers, "the twin should have configured the root logger"
    finally:
        for h in root.handlers[:]:
            root.removeHandler(h)
        for h in saved:
            root.addHandler(h)
