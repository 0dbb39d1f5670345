"""``fedudp.train.min_owners`` against the wrapped strategy's availability settings.

A Flower Message-API strategy (``FedAvg`` and its subclasses) samples, each round,
``max(int(fraction_train * connected), min_train_nodes)`` nodes, and waits for at least that
many (and ``min_available_nodes``) to be connected. A round that starts while few nodes are
connected (the first one, typically) samples only ``min_train_nodes`` clients. If that is
fewer than ``UserLevelDP``'s fail-closed ``min_owners``, such a round is withheld, and with
``min_owners`` at the number of clients every early round is. ``availability_problem`` names
the mismatch before round 1 (``UserLevelDP.start`` logs it as a warning).
"""

from __future__ import annotations

from typing import Any

__all__ = ["availability_problem"]


def availability_problem(strategy: Any, min_owners: int) -> str | None:
    """One line naming ``fedudp.train.min_owners`` and the strategy's ``min_train_nodes`` /
    ``min_available_nodes`` when a round may sample fewer clients than ``min_owners``, else
    None (also for a strategy without ``min_train_nodes``: nothing to compare).

    Parameters
    ----------
    strategy : flwr.serverapp.strategy.Strategy
        The wrapped strategy (``UserLevelDP.strategy``).
    min_owners : int
        The wrapper's fail-closed minimum of successful clients per round.

    Returns
    -------
    str or None
    """
    train = getattr(strategy, "min_train_nodes", None)
    if not isinstance(train, int) or int(min_owners) <= train:
        return None
    avail = getattr(strategy, "min_available_nodes", None)
    name = type(strategy).__name__
    return (
        f"fedudp.train.min_owners = {int(min_owners)} exceeds the strategy's min_train_nodes = "
        f"{train} (min_available_nodes = {avail}): a round that starts with few clients "
        f"connected samples {train} and is withheld (nothing released); pass "
        f"{name}(min_train_nodes={int(min_owners)}, min_available_nodes={int(min_owners)}) or "
        "lower fedudp.train.min_owners"
    )
