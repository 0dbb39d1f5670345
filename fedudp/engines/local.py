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
from fedudp.owner.secure_reply import owner_randomness, secure_reply
from fedudp.protocol.contributions import ConstraintSource, current_constraint
from fedudp.protocol.messages import Failure
from fedudp.randomness import Purpose, numpy_rng
from fedudp.secure.masks import MaskKeys
from fedudp.secure.public import mask_secret

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
    owner_dropout : float, default 0.0
        Simulated infrastructure (``train.owner_dropout``): each owner drops out of each round
        with this probability (keyed by ``seed`` and the round, never by data): it sends
        nothing and is reported as a failed owner (fail closed below ``train.min_owners``).
    seed : int, default 0
        The run seed (the dropouts' key).

    Attributes
    ----------
    personal_params : dict of str to torch.Tensor
        Every owner's personal parameters, stacked over owners (``[owners, ...]``).
    """

    def __init__(
        self,
        owners: Owners,
        fed: Federation,
        constraint: ConstraintSource,
        owner_dropout: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.owners, self.fed, self.constraint = owners, fed, constraint
        self.personal_params = owners.initial_personal(fed.num_owners)
        self.owner_dropout, self.seed = float(owner_dropout), int(seed)
        self._mask_keys: MaskKeys | None = None  # the owners' pairwise seeds (distributed)

    def dropped(self, round_: int) -> np.ndarray:
        """The global ids of the owners that drop out of round ``round_`` (simulated)."""
        if not self.owner_dropout:
            return np.zeros(0, dtype=np.int64)
        out = numpy_rng(self.seed, Purpose.DROPOUT, round_).random(self.fed.num_owners)
        return np.asarray(self.fed.owner_ids, dtype=np.int64)[out < self.owner_dropout]

    def mask_keys(self) -> MaskKeys:
        """The owners' pairwise-mask seeds, made once on the owner side (OS entropy under
        ``privacy.randomness=secure``; never handed to the billboard)."""
        if self._mask_keys is None:
            secret = mask_secret(owner_randomness(self.owners))
            self._mask_keys = MaskKeys(secret, int(np.max(self.fed.owner_ids)) + 1)
        return self._mask_keys

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
        gone = self.dropped(round_)
        failures = []
        if len(gone):
            index = {int(g): j for j, g in enumerate(self.fed.owner_ids)}
            owner_of = cohort if self.owners.spec.cohort_is_owners else self.fed.user_owner[cohort]
            lost = np.isin(owner_of, [index[int(g)] for g in gone])
            failures = [
                Failure(
                    int(g),
                    int((owner_of[lost] == index[int(g)]).sum()),
                    "dropped out (simulated: train.owner_dropout)",
                )
                for g in gone
            ]
            cohort = cohort[~lost]
        if constraint.secure is not None:  # masked shares of every surviving owner
            reply, observed = secure_reply(
                self.owners,
                self.fed,
                shared,
                self.personal_params,
                cohort,
                round_,
                constraint,
                keys=self.mask_keys(),
                roster=[int(g) for g in self.fed.owner_ids],
                dropped=[int(g) for g in gone],
            )
            return Collected([reply], failures, observed)
        # a user whose step raises is dropped alone, on the failure path only (isolate)
        return Collected(
            [
                isolated_reply(
                    self.owners, self.fed, shared, self.personal_params, cohort, round_, constraint
                )
            ],
            failures,
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
        """The stacked personal parameters of the checkpoint (same names, shapes, dtypes), or
        of its owners' folder for a checkpoint of engine=flower."""
        from fedudp.protocol import checkpoint
        from fedudp.protocol.checkpoint import CheckpointError

        if "owners_saved" in state:  # engine=flower's: each node wrote its owners' rows
            saved = (
                checkpoint.load_owners_personal(folder, range(self.fed.num_owners))
                if state["owners_saved"] and folder is not None
                else {k: v.clone() for k, v in self.personal_params.items()}
            )
        else:
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
        The run's settings (the seed and ``owner_dropout``).
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
    return drive(LocalTransport(owners, fed, constraint, settings.owner_dropout, settings.seed))
