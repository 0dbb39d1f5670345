"""What the billboard, the Flower wrapper and the tuning code need from an accountant.

``AccountantLike`` is the typed interface that ``fedudp.privacy.accountant.accountant_for``'s
three accountants (``Accountant``, ``ParallelAccountant``, ``GroupAccountant``) share: compose
a release, and read epsilon at a delta (now, from RDP as a cross-check, or after one more
release without composing it). ``tests/privacy/test_accountant_seam.py`` checks that each of
them is one.
"""

from __future__ import annotations

from typing import Protocol, TypeAlias, runtime_checkable

import dp_accounting

from fedudp.privacy.accountant import ApproxDp, Parallel
from fedudp.privacy.distributed_rdp import DistributedDpEvent

__all__ = ["AccountantLike", "Release"]

# what one release composes: a dp-accounting event, an (ε, δ) block, one event per part, or a
# round of a distributed mechanism
Release: TypeAlias = dp_accounting.DpEvent | ApproxDp | Parallel | DistributedDpEvent


@runtime_checkable
class AccountantLike(Protocol):
    """An accountant of released events, read at a delta.

    Implemented by ``Accountant``, ``ParallelAccountant`` and ``GroupAccountant``
    (``fedudp.privacy.accountant.accountant_for`` builds the one a run needs).
    """

    def compose(self, event: Release, count: int = 1) -> None:
        """Compose ``count`` releases of ``event``.

        Parameters
        ----------
        event : DpEvent, ApproxDp, Parallel or DistributedDpEvent
            One release.
        count : int
            How many releases of it.
        """
        ...

    def epsilon(self, delta: float) -> float:
        """Epsilon at ``delta`` of everything composed so far.

        Parameters
        ----------
        delta : float
            The run's delta.

        Returns
        -------
        float
            The certified epsilon (0 before any release).
        """
        ...

    def epsilon_rdp(self, delta: float) -> float | None:
        """RDP's (looser) epsilon at ``delta``, the cross-check.

        Returns
        -------
        float or None
            None where RDP does not support a composed event.
        """
        ...

    def epsilon_if(self, event: Release, delta: float, count: int = 1) -> float:
        """Epsilon at ``delta`` after ``count`` more releases of ``event``, not composing it.

        Returns
        -------
        float
            What ``epsilon(delta)`` would be after ``compose(event, count)``.
        """
        ...
