"""What crosses the owner -> billboard boundary (ARCHITECTURE.md §3 rules).

An ``OwnerReply`` carries shared-parameter vectors only: ``param_names`` lists the shared
parameters the vectors concatenate (in order); personal parameters have no field here.
Engines build replies with ``make_reply`` and the billboard consumes nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fedudp.aggregators.base import finite_rows


@dataclass
class OwnerReply:
    param_names: tuple[str, ...]
    vectors: torch.Tensor | None        # [n_units, d] when the aggregator needs rows
    clipped_sum: torch.Tensor | None    # [d] otherwise (sum of the units' clipped vectors)
    count: int                          # units that contributed
    clipped: int                        # of which clipped (diagnostic)
    failed: int                         # units excluded for NaN/inf (diagnostic)


def make_reply(G: torch.Tensor, names: tuple[str, ...], aggregator) -> OwnerReply:
    """Drop non-finite rows (they contribute zero; ALGORITHMS.md §7.2), then either keep the
    rows or reduce them to the aggregator's owner-side contribution."""
    ok = finite_rows(G)
    failed = int((~ok).sum())
    if failed:
        G = G[ok]
    if aggregator.needs_per_user_vectors:
        return OwnerReply(names, G, None, int(G.shape[0]), 0, failed)
    c = aggregator.owner_contribution(G)
    return OwnerReply(names, None, c.clipped_sum, c.count, c.clipped, failed)
