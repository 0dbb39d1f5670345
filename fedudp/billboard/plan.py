"""The declared hooks a training algorithm gives the one round loop (docs/architecture.md#plan).

``run_rounds`` and the ``Billboard`` stay the only round; a seed's training algorithm
(``fedudp.algorithms``: Levy et al. Alg. 4, Asi & Liu Alg. 3/4, Huang et al. Alg. 1/2) changes
only what these hooks return. Every hook may return None for "the plain round's behaviour", so
a billboard without a plan (every existing method) is unchanged.

* ``sample(round_)``: the round's cohort as a boolean mask over the billboard's units (disjoint
  user phases, one owner per step, one record per step); public randomness only.
* ``event(round_)`` / ``one_off()``: what the round releases for the accountant (phases on
  disjoint users as a ``Parallel`` event: parallel composition), and the once-per-run block.
* ``aggregator(round_)``: the estimator that releases this round (one per phase).
* ``step(u, mean, round_)``: the server step from the released mean (None when an
  AboveThreshold halted): projection, a public regulariser's gradient, step sizes per phase,
  phase restarts and the averaged iterate. Post-processing of DP releases only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

__all__ = [
    "Plan",
]

if TYPE_CHECKING:
    import dp_accounting

    from fedudp.aggregators.base import Aggregator
    from fedudp.privacy.accountant import ApproxDp, Parallel


class Plan:
    """Default hooks: the plain round (billboard's Poisson sample, its aggregator and step).

    Methods
    -------
    sample(round_)
        The round's cohort mask over the billboard's units.
    event(round_)
        The round's accounting event.
    one_off()
        The once-per-run event.
    aggregator(round_)
        The estimator that releases this round.
    step(u, mean, round_)
        The server step from the released mean.

    Notes
    -----
    Every hook returns None here (the plain round's behaviour); see the module doc.
    """

    def sample(self, round_: int) -> np.ndarray | None:
        return None

    def event(self, round_: int) -> dp_accounting.DpEvent | Parallel | None:
        return None

    def one_off(self) -> dp_accounting.DpEvent | ApproxDp | Parallel | None:
        return None

    def aggregator(self, round_: int) -> Aggregator | None:
        return None

    def step(self, u: torch.Tensor, mean: torch.Tensor | None, round_: int) -> torch.Tensor | None:
        return None
