"""``engine=local``: every owner in one process, batched with ``torch.func``
(docs/architecture.md#engines).

A transport only: the owners' computation is ``fedudp.owner.owners.Owners`` over the whole
federation (personal parameters stacked ``[n_owners, ...]``, users in vmapped chunks of at most
``engine_opts.chunk_records`` records); the round is ``fedudp.billboard.rounds.run_rounds``. With
chunk size 1, one thread and float64 it is the reference for the engine-equivalence test.
A user whose training step raises is dropped alone (``fedudp.owner.isolate``: only when the
cohort's call raises), as the Flower client mod drops it.

``engine_opts.device``: the model, the federation's records and the stacked personal parameters
live on the owners' device (``Owners.device``, placed by ``fedudp.build``); the broadcast comes
from the billboard on the CPU and is moved there each round; what leaves (the personal
parameters of the result and of a checkpoint) is moved back to the CPU
(docs/architecture.md#engines).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedudp.billboard.rounds import Collected, Evaluation, RoundsResult, Transport
from fedudp.config import RunConfig
from fedudp.data.federation import Federation
from fedudp.owner.isolate import isolated_reply
from fedudp.owner.owners import Owners, Params
from fedudp.protocol.contributions import ConstraintSource, current_constraint

if TYPE_CHECKING:
    from fedudp.build import RunSettings


__all__ = ["LocalTransport", "execute"]


class LocalTransport:
    """Owners in this process: their personal parameters live here, stacked.

    Parameters
    ----------
    owners : Owners
        The owners' training and evaluation kernels.
    fed : Federation
        The federation (every owner's private records).
    constraint : ConstraintSource
        Where the round's contribution constraint (from the aggregator) is read.

    Attributes
    ----------
    personal_params : dict of str to torch.Tensor
        Every owner's personal parameters, stacked over owners (``[owners, ...]``).
    """

    def __init__(self, owners: Owners, fed: Federation, constraint: ConstraintSource) -> None:
        self.owners, self.fed, self.constraint = owners, fed, constraint
        self.personal_params = owners.initial_personal(fed.num_owners)

    def _here(self, shared: Params) -> Params:
        """The broadcast on the owners' device (the same tensors where that is the CPU)."""
        dev = self.owners.device
        return {k: v.to(dev) for k, v in shared.items()}

    def train(self, shared: Params, cohort: np.ndarray | None, round_: int) -> Collected:
        shared = self._here(shared)
        self.personal_params = self.owners.personal_round(
            self.fed, shared, self.personal_params, round_
        )
        if cohort is None:
            return Collected([])
        cohort = self.fed.present(cohort, self.owners.spec.cohort_is_owners)
        constraint = current_constraint(self.constraint)
        assert constraint is not None  # a cohort comes from a billboard, with its aggregator
        # a user whose step raises is dropped alone, on the failure path only (isolate)
        return Collected(
            [
                isolated_reply(
                    self.owners, self.fed, shared, self.personal_params, cohort, round_, constraint
                )
            ]
        )

    def evaluate(
        self, shared: Params, round_: int, while_waiting: Callable[[], None] | None = None
    ) -> Evaluation:
        if while_waiting is not None:
            while_waiting()
        return Evaluation(*self.owners.evaluate(self.fed, self._here(shared), self.personal_params))

    def personal(self) -> Params:
        return {k: v.cpu() for k, v in self.personal_params.items()}

    def info(self) -> dict:
        return {}

    def will_checkpoint(self, round_: int, folder: Path) -> None:
        """Nothing to prepare: the personal parameters live here."""

    def checkpoint_state(self, round_: int) -> dict:
        return {"personal": {k: v.detach().cpu().clone() for k, v in self.personal_params.items()}}

    def restore(self, state: dict, folder: Path | None = None) -> None:
        """The stacked personal parameters of the checkpoint (same names, shapes, dtypes)."""
        from fedudp.protocol.checkpoint import CheckpointError

        saved = state["personal"]
        mine = self.personal_params
        if set(saved) != set(mine) or any(
            saved[k].shape != mine[k].shape or saved[k].dtype != mine[k].dtype for k in mine
        ):
            raise CheckpointError("personal parameters of other names or shapes")
        self.personal_params = {k: saved[k].to(mine[k].device).clone() for k in mine}


def execute(
    cfg: RunConfig,
    settings: RunSettings,
    owners: Owners,
    fed: Federation,
    constraint: ConstraintSource,
    drive: Callable[[Transport], RoundsResult],
    grid: Any = None,
) -> RoundsResult:
    """Run ``drive`` (the round loop) on an in-process transport (``grid``: Flower only).

    Parameters
    ----------
    cfg : RunConfig
        The configuration (unused here; the engines' common signature).
    settings : RunSettings
        The run's settings (unused here).
    owners, fed, constraint : Owners, Federation, ConstraintSource
        As ``LocalTransport`` takes them.
    drive : Callable[[Transport], RoundsResult]
        The round loop, run on the transport.
    grid : Any, default None
        Must be None (a Flower grid needs ``engine=flower``).

    Returns
    -------
    RoundsResult
        What ``drive`` returned.

    Raises
    ------
    ValueError
        ``grid`` is given.
    """
    if grid is not None:
        raise ValueError("engine=local runs in-process; a Flower grid needs engine=flower")
    return drive(LocalTransport(owners, fed, constraint))
