"""``root_placeholder`` for the Flower wrapper (``fedudp.logs``, where it is written once)."""

from __future__ import annotations

from fedudp.logs import root_placeholder

__all__ = ["root_placeholder"]
