"""Owner-level updates (``MethodSpec.update``: ``owner_sgd``, ``owner_dpsgd``): each owner's
delta after its local epochs on all its records (standard FedAvg) or after its DP-SGD epochs
over its users (``fedudp.owner.dpsgd``), weighted uniformly or by the owner's public size.

``OwnerLevel`` is a base of ``fedudp.owner.owners.Owners`` (its module doc); owners of one SGD
step take the batched one-step path (``fedudp.owner.batched``) where ``Kernels.one_step`` is
on.
"""

from __future__ import annotations

import numpy as np
import torch

from fedudp.data.federation import Federation
from fedudp.owner import local_sgd
from fedudp.owner.batched import BatchedPaths
from fedudp.owner.dpsgd import DpSgdSpec, dpsgd_deltas
from fedudp.owner.orders import batch_orders
from fedudp.protocol.choices import OwnerWeights
from fedudp.protocol.contributions import Constraint, finite_rows
from fedudp.protocol.messages import OwnerReply, make_reply
from fedudp.randomness import Purpose

__all__ = ["OwnerLevel", "owner_units"]

Params = local_sgd.Params


def owner_units(fed: Federation, owners: np.ndarray) -> local_sgd.Units:
    """The owners ``owners`` of ``fed`` as units of records (all of each owner's records).

    Parameters
    ----------
    fed : Federation
        The federation.
    owners : np.ndarray
        Owner indices into ``fed``.

    Returns
    -------
    local_sgd.Units
        Each owner's records and owner id.
    """
    oo = fed.owner_offsets
    starts, sizes = oo[owners], np.diff(oo)[owners]
    return local_sgd.Units(starts, sizes, fed.owner_ids[owners], starts, sizes)


class OwnerLevel(BatchedPaths):
    """The owner side's owner-level updates (module doc); a base of ``Owners``, whose
    parameters and attributes it reads (``BatchedPaths``)."""

    def _frozen(
        self, fed: Federation, personal: Params, owners: np.ndarray
    ) -> tuple[Params, Params]:
        """(per-unit personal params, common ones) at which shared updates are computed."""
        if self.spec.feedback and self.spec.personal:
            return local_sgd.select(personal, owners), {}
        return {}, dict(self.public_personal)

    def owner_deltas(
        self,
        fed: Federation,
        shared: Params,
        personal: Params,
        owners: np.ndarray,
        round_: int,
        constraint: Constraint,
        fractions: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Each owner's owner-level update (``owner_sgd`` or ``owner_dpsgd``).

        Parameters
        ----------
        fed : Federation
            The owners here.
        shared, personal : Params
            The broadcast shared parameters; every owner's personal parameters, stacked.
        owners : np.ndarray
            The owners (indices into ``fed``) whose updates are computed.
        round_ : int
            The round (the batch orders', samples' and noises' key).
        constraint : Constraint
            The aggregator's reply contract (owner-side DP-SGD's noise and clip).
        fractions : np.ndarray or None
            With an adaptive DP-SGD clip (``constraint.dpsgd_count_noise``), filled with each
            owner's released unclipped fraction (``fedudp.owner.dpsgd``).

        Returns
        -------
        Tensor
            [len(owners), d_shared] each owner's delta from the broadcast ``shared``.

        Raises
        ------
        ValueError
            Owner-side DP-SGD without the owners' public capacities.
        """
        if self.spec.update == "owner_dpsgd":
            return self._owner_dpsgd(fed, shared, personal, owners, round_, constraint, fractions)
        spec, names = self.training.user, self.spec.shared
        units = owner_units(fed, owners)
        G = torch.zeros(len(owners), self.shared_dim, dtype=self.dtype, device=self.device)
        one = self._one_step_owners(units.sizes)
        if one.any():
            self._one_step_rows(G, np.flatnonzero(one), fed, shared, units.starts, units.sizes)
        rest, done = np.flatnonzero(~one), int(one.sum())
        for sel in local_sgd.chunks(units.sizes[rest], self.budget, spec.batch_size):
            rows = rest[sel]
            fr_unit, fr_common = self._frozen(fed, personal, owners[rows])
            start = local_sgd.expand(shared, len(rows))
            orders = batch_orders(units.subset(rows), spec, round_, Purpose.OWNER_ORDER)
            end = local_sgd.local_sgd(
                self.model, start, fr_unit, fr_common, fed.x, fed.y, orders, spec
            )
            if int(rows[-1]) - int(rows[0]) + 1 == len(rows):  # consecutive: in place
                local_sgd.flat_delta(end, shared, names, out=G[int(rows[0]) : int(rows[-1]) + 1])
            else:
                G[torch.from_numpy(rows)] = local_sgd.flat_delta(end, shared, names)
            done += len(rows)
            self.report_progress("owners", done, len(owners))
        return G

    def _owner_dpsgd(
        self,
        fed: Federation,
        shared: Params,
        personal: Params,
        owners: np.ndarray,
        round_: int,
        constraint: Constraint,
        fractions: np.ndarray | None,
    ) -> torch.Tensor:
        """``owner_deltas`` for ``owner_dpsgd``: each owner's DP-SGD delta (``dpsgd_deltas``),
        its schedule from its public capacity, users (or records, with group privacy) as the
        DP-SGD units."""
        spec, names = self.training.user, self.spec.shared
        fr_unit, fr_common = self._frozen(fed, personal, owners)
        count_noise = constraint.dpsgd_count_noise
        assert constraint.dpsgd_noise is not None and constraint.dpsgd_clip is not None
        dp = DpSgdSpec(
            float(constraint.dpsgd_noise),
            float(constraint.dpsgd_clip),
            spec.batch_size,
            spec.epochs,
            spec.lr,
            spec.seed,
            None if count_noise is None else float(count_noise),
            secure=bool(self.training.secure_randomness),
            kernels=self.training.kernels,
        )
        if self.training.dpsgd_records:  # group privacy: every record is a DP-SGD unit
            n, oo = len(fed.y), fed.owner_offsets
            starts, sizes, first, count = np.arange(n), np.ones(n, np.int64), oo, np.diff(oo)
        else:
            ou = fed.owner_user_offsets
            starts, sizes, first, count = (
                fed.user_offsets[:-1],
                np.diff(fed.user_offsets),
                ou,
                np.diff(ou),
            )
        if self.training.dpsgd_capacity is None:
            raise ValueError(
                "owner-side DP-SGD needs each owner's public capacity "
                "(OwnerTraining.dpsgd_capacity)"
            )
        ids = fed.owner_ids[owners]
        capacity = np.asarray(self.training.dpsgd_capacity, dtype=np.int64)[ids]
        return dpsgd_deltas(
            self.model,
            shared,
            fr_unit,
            fr_common,
            fed.x,
            fed.y,
            starts,
            sizes,
            first[owners],
            count[owners],
            capacity,
            ids,
            dp,
            round_,
            names,
            self.budget,
            progress=lambda d, t: self.report_progress("DP-SGD steps", d, t),
            fractions=fractions,
        )

    def _owner_level_reply(
        self,
        fed: Federation,
        shared: Params,
        personal: Params,
        units: np.ndarray,
        round_: int,
        constraint: Constraint,
    ) -> OwnerReply:
        """``Owners.reply`` for owner-level updates: the owners' weighted deltas, with an
        adaptive DP-SGD clip's released fractions of the owners whose delta is sent."""
        adaptive = self.spec.update == "owner_dpsgd" and constraint.dpsgd_count_noise is not None
        fractions = np.zeros(len(units)) if adaptive else None
        G = self.owner_deltas(fed, shared, personal, units, round_, constraint, fractions)
        if adaptive:  # the released fractions of the owners whose delta is sent
            rep = self._weighted_reply(G, fed, units, constraint)
            ok = finite_rows(G).cpu().numpy()
            assert fractions is not None  # adaptive: filled by owner_deltas
            rep.contribution.fraction_sum = float(fractions[ok].sum())
            rep.contribution.fraction_reports = int(ok.sum())
            return rep
        return self._weighted_reply(G, fed, units, constraint)

    def _weighted_reply(
        self, G: torch.Tensor, fed: Federation, units: np.ndarray, constraint: Constraint
    ) -> OwnerReply:
        """Owner-level updates averaged uniformly or by owner size."""
        if self.training.owner_weights == OwnerWeights.uniform.value:
            w = np.ones(len(units))
        elif self.spec.update == "owner_dpsgd":  # public sizes: the actual ones are data
            w = np.asarray(self.training.public_owner_records, dtype=np.float64)[
                fed.owner_ids[units]
            ]
        else:
            w = np.diff(fed.owner_offsets)[units].astype(np.float64)
        return make_reply(G, self.spec.shared, constraint, weights=w)
