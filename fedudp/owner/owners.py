"""THE owner-side computation, written once for both engines
(docs/architecture.md#one-round-as-data, docs/architecture.md#engines).

Huang et al. (001) Alg. 1 / §4, the owner's step of a round: update the personal parameters on
all of the owner's records without noise (they never leave the owner), then compute, for each
sampled user, the average gradient (or the local delta after E epochs) on the *shared*
parameters, and reply with what the aggregator's ``Constraint`` asks for (rows, or the sum of
clipped rows and a count). With ``privacy.unit=owner`` an owner's unit vector is the mean of
all its users' vectors.

Owner-level updates (``MethodSpec.update``): standard FedAvg sends the owner's delta after E
epochs of SGD over all its records (``owner_sgd``); ``privacy.placement=local_dpsgd`` the delta
after E epochs of DP-SGD over its users (``owner_dpsgd``, ``fedudp.owner.dpsgd``); both are
weighted by ``train.owner_weights`` (uniform, or the owner's record count).

``Owners`` works on any group of owners held as a ``Federation``: ``engine=local`` passes the
whole federation (owners batched with ``vmap`` in chunks of ``engine_opts.chunk_records``
records), a Flower ``ClientApp`` its own one-owner shard (``Federation.owner(j)``). Personal
parameters are stacked ``[owners here, ...]``. Batch orders are keyed by the global owner id,
so both engines compute the same vectors. A new owner-side training mode belongs here.

The owners' settings are ``fedudp.owner.settings.OwnerTraining`` (the batched paths they may
take: ``OwnerTraining.kernels``, ``fedudp.owner.kernels``); the batched one-step and ghost
paths are ``fedudp.owner.batched``, evaluation ``fedudp.owner.evaluation``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn as nn

from fedudp.data.federation import Federation
from fedudp.owner import local_sgd, per_sample
from fedudp.owner.evaluation import evaluate_owners
from fedudp.owner.kernels import ONE_STEP_RECORDS
from fedudp.owner.orders import batch_orders
from fedudp.owner.owner_level import OwnerLevel, owner_units
from fedudp.owner.settings import OwnerTraining
from fedudp.protocol.choices import SharedUpdate, Unit
from fedudp.protocol.contributions import Constraint, Contribution
from fedudp.protocol.messages import OwnerReply, make_reply, rows_reply
from fedudp.protocol.methods import MethodSpec
from fedudp.randomness import Purpose

__all__ = ["OwnerHooks", "Owners", "Params", "user_units"]

Params = local_sgd.Params


def user_units(fed: Federation, users: np.ndarray) -> local_sgd.Units:
    """The users ``users`` of ``fed`` as units of records.

    Parameters
    ----------
    fed : Federation
        The federation.
    users : np.ndarray
        User indices into ``fed``.

    Returns
    -------
    local_sgd.Units
        Each user's records, owner id and owner's records.
    """
    lo = fed.user_owner[users]
    oo = fed.owner_offsets
    return local_sgd.Units(
        fed.user_offsets[users],
        np.diff(fed.user_offsets)[users],
        fed.owner_ids[lo],
        oo[lo],
        np.diff(oo)[lo],
    )


class OwnerHooks:
    """The owner computation's declared extension points (a training algorithm's,
    ``fedudp.algorithms``): subclass and override; each returns None for the plain
    behaviour. Takes no parameters."""

    def personal_round(
        self, owners: Owners, fed: Federation, shared: Params, personal: Params, round_: int
    ) -> Params | None:
        """Every owner's personal parameters after this round.

        Parameters
        ----------
        owners : Owners
            The owner side.
        fed : Federation
            The owners here.
        shared, personal : Params
            The broadcast shared parameters; every owner's personal parameters, stacked.
        round_ : int
            The round.

        Returns
        -------
        Params or None
            The new personal parameters (instead of epochs of SGD on all the owner's
            records), or None for the plain update.
        """
        return None

    def user_gradients(
        self,
        owners: Owners,
        fed: Federation,
        shared: Params,
        fr_unit: Params,
        fr_common: Params,
        sub: local_sgd.Units,
        user_ids: np.ndarray,
        round_: int,
    ) -> torch.Tensor | None:
        """The users' shared vectors in ``gradient`` mode.

        Parameters
        ----------
        owners : Owners
            The owner side.
        fed : Federation
            The owners here.
        shared : Params
            The broadcast shared parameters.
        fr_unit, fr_common : Params
            The frozen personal parameters, per unit and common (``Owners._frozen``).
        sub : local_sgd.Units
            The users as units of records.
        user_ids : np.ndarray
            Their global ids.
        round_ : int
            The round.

        Returns
        -------
        Tensor or None
            [len(sub), d_shared] (instead of their mean gradients at the broadcast), or None
            for the plain vectors.
        """
        return None


class Owners(OwnerLevel):
    """The owner side of a run: model, shared/personal split, local training (module doc).

    Parameters
    ----------
    model : nn.Module
        The model (on ``engine_opts.device``).
    spec : MethodSpec
        The method: shared/personal split, unit, update kind.
    training : OwnerTraining
        The owner side's public settings, its batched paths (``training.kernels``) included.
    budget : int
        Records per chunk (``engine_opts.chunk_records``, resolved).
    hooks : OwnerHooks or None
        A training algorithm's extension points (None: the plain owner).
    """

    def __init__(
        self,
        model: nn.Module,
        spec: MethodSpec,
        training: OwnerTraining,
        budget: int,
        hooks: OwnerHooks | None = None,
    ) -> None:
        self.model, self.spec, self.training, self.budget = model, spec, training, int(budget)
        self.hooks = hooks if hooks is not None else OwnerHooks()
        init = dict(model.named_parameters())
        # x_pub: the public (seeded, data-independent) initial personal parameters
        self.public_personal = {k: init[k].detach().clone() for k in spec.personal}
        self.shared_dim = sum(int(init[k].numel()) for k in spec.shared)
        self.dtype = next(iter(init.values())).dtype
        # engine_opts.device: where the model lives (fedudp.build moves it); every tensor the
        # owner side creates is made there, every number it hands back comes through the CPU
        self.device = next((v.device for v in init.values()), torch.device("cpu"))
        # progress inside a round (the run's progress bar): called as (stage, done, total) after
        # each chunk of units; None: silent. It changes nothing the owners compute.
        self.on_progress: Callable[[str, int, int], None] | None = None

    def report_progress(self, stage: str, done: int, total: int) -> None:
        """Progress inside a round: ``on_progress(stage, done, total)`` when set.

        Parameters
        ----------
        stage : str
            What is being computed (``"users"``, ``"owners"``, ...).
        done, total : int
            Units done and in all.
        """
        if self.on_progress is not None:
            self.on_progress(stage, int(done), int(total))

    @property
    def trains_personal(self) -> bool:
        """Whether the method has personal parameters and trains them (epochs > 0)."""
        return bool(self.spec.personal) and self.training.personal.epochs > 0

    def initial_personal(self, owners: int) -> Params:
        """The public initial personal parameters, stacked for ``owners`` owners.

        Parameters
        ----------
        owners : int
            The number of owners.

        Returns
        -------
        Params
            [owners, ...] copies of the public initial personal parameters.
        """
        return {
            k: v.unsqueeze(0).expand(owners, *v.shape).clone()
            for k, v in self.public_personal.items()
        }

    def personal_round(
        self, fed: Federation, shared: Params, personal: Params, round_: int
    ) -> Params:
        """Every owner's personal parameters after its epochs of SGD on all its records.

        The shared parameters are fixed at the broadcast. No noise: they never leave the
        owner. A training algorithm's ``hooks.personal_round`` replaces this update.

        Parameters
        ----------
        fed : Federation
            The owners here.
        shared, personal : Params
            The broadcast shared parameters; every owner's personal parameters, stacked.
        round_ : int
            The round (the batch orders' key).

        Returns
        -------
        Params
            The new personal parameters, stacked.
        """
        hooked = self.hooks.personal_round(self, fed, shared, personal, round_)
        if hooked is not None:
            return hooked
        if not self.trains_personal:
            return personal
        spec = self.training.personal
        units = owner_units(fed, np.arange(fed.num_owners))
        new = {k: v.clone() for k, v in personal.items()}
        for sel in local_sgd.chunks(units.sizes, self.budget, spec.batch_size):
            orders = batch_orders(units.subset(sel), spec, round_, Purpose.PERSONAL_ORDER)
            out = local_sgd.local_sgd(
                self.model,
                local_sgd.select(personal, sel),
                {},
                dict(shared),
                fed.x,
                fed.y,
                orders,
                spec,
            )
            for k in new:
                new[k][torch.from_numpy(sel)] = out[k].detach()
            self.report_progress("personal", int(sel[-1]) + 1, fed.num_owners)
        return new

    def user_vectors(
        self,
        fed: Federation,
        shared: Params,
        personal: Params,
        users: np.ndarray,
        round_: int,
        one_step: bool = False,
    ) -> Iterator[tuple[np.ndarray, torch.Tensor]]:
        """Chunks of the users' shared vectors at the broadcast.

        ``delta``: the change of the shared parameters after the user's epochs of SGD on its own
        records; ``gradient``: its average gradient. Personal parameters are frozen at the
        public copy (certified joint_dp, docs/algorithms.md#certified-vs-paper-accounting) or,
        with ``spec.feedback`` (paper mode, owner level), at the user's owner's own parameters.

        Parameters
        ----------
        fed : Federation
            The owners here.
        shared, personal : Params
            The broadcast shared parameters; every owner's personal parameters, stacked.
        users : np.ndarray
            User indices into ``fed``.
        round_ : int
            The round (the batch orders' key).
        one_step : bool, default False
            Users whose vector is one SGD step (or their mean gradient) first, from one batched
            forward/backward per chunk (``fedudp.owner.one_step``, where ``_one_step_users``
            allows it: equal to the other paths up to float rounding); the distributed path's
            owners, which encode each user's vector, take it as the clipped sum does.

        Yields
        ------
        tuple of (np.ndarray, Tensor)
            (the chunk's users, [len, d_shared] their vectors; each chunk its own tensor).
        """
        if one_step and (fast := self._one_step_users(fed, users, vectors=True)) is not None:
            if fast.any():
                sub, at = user_units(fed, users[fast]), users[fast]
                scale = -self.training.user.lr if self._delta_mode else 1.0
                for sel, V in self._one_step_chunks(fed, shared, sub.starts, sub.sizes, scale):
                    yield at[sel], V.detach().clone()  # the chunks' scratch matrix is reused
            users = users[~fast]
            if not len(users):
                return
        spec, names = self.training.user, self.spec.shared
        if self.training.sort_users and len(users) > 1:
            users = users[np.argsort(np.diff(fed.user_offsets)[users], kind="stable")]
        units = user_units(fed, users)
        delta = self.training.mode == SharedUpdate.delta.value
        done = 0
        for sel in local_sgd.chunks(units.sizes, self.budget, spec.batch_size if delta else None):
            sub = units.subset(sel)
            fr_unit, fr_common = self._frozen(fed, personal, fed.user_owner[users[sel]])
            start = local_sgd.expand(shared, len(sub))
            if delta:
                orders = batch_orders(
                    sub, spec, round_, Purpose.USER_ORDER, fed.user_ids[users[sel]]
                )
                end = local_sgd.local_sgd(
                    self.model, start, fr_unit, fr_common, fed.x, fed.y, orders, spec
                )
                G = local_sgd.flat_delta(end, shared, names)
            else:
                hooked = self.hooks.user_gradients(
                    self, fed, shared, fr_unit, fr_common, sub, fed.user_ids[users[sel]], round_
                )
                if hooked is not None:
                    G = hooked
                else:
                    G = local_sgd.flatten(
                        local_sgd.mean_gradients(
                            self.model, start, fr_unit, fr_common, fed.x, fed.y, sub
                        ),
                        names,
                    )
            done += len(sel)
            self.report_progress("users", done, len(users))
            yield users[sel], G.detach()

    def unit_vectors(
        self, fed: Federation, shared: Params, personal: Params, units: np.ndarray, round_: int
    ) -> Iterator[torch.Tensor]:
        """Row chunks for the billboard's sampled ``units`` of this federation.

        Parameters
        ----------
        fed, shared, personal, round_
            As in ``user_vectors``.
        units : np.ndarray
            Users, or with ``privacy.unit=owner`` owners (indices into ``fed``).

        Yields
        ------
        Tensor
            [len, d_shared] rows: users' vectors, or each owner's mean of its users' vectors.
        """
        if self.spec.unit != Unit.owner:
            for _, G in self.user_vectors(fed, shared, personal, units, round_):
                yield G
            return
        if not len(units):
            return
        ou = fed.owner_user_offsets
        users = np.concatenate([np.arange(ou[j], ou[j + 1]) for j in units])
        row = np.full(fed.num_owners, -1, dtype=np.int64)
        row[units] = np.arange(len(units))
        sums = torch.zeros(len(units), self.shared_dim, dtype=self.dtype, device=self.device)
        for us, G in self.user_vectors(fed, shared, personal, users, round_):
            at = torch.from_numpy(row[fed.user_owner[us]]).to(sums.device)
            sums.index_add_(0, at, G.to(sums.dtype))
        counts = torch.from_numpy(np.diff(ou)[units]).to(sums.device, sums.dtype)
        yield sums / counts.clamp(min=1).unsqueeze(1)

    def reply(
        self,
        fed: Federation,
        shared: Params,
        personal: Params,
        units: np.ndarray,
        round_: int,
        constraint: Constraint,
    ) -> OwnerReply:
        """The owners' reply for their sampled ``units``.

        Shared parts only, constrained chunk by chunk (the cohort matrix is never built when
        sums suffice); users of one SGD step take the batched paths ``training.kernels``
        allows (``fedudp.owner.batched``), which reply the same up to float rounding.

        Parameters
        ----------
        fed : Federation
            The owners here.
        shared, personal : Params
            The broadcast shared parameters; every owner's personal parameters, stacked.
        units : np.ndarray
            The sampled users (owners for owner-level updates or ``privacy.unit=owner``).
        round_ : int
            The round.
        constraint : Constraint
            What the aggregator asks for (rows, or a clipped sum and counts).

        Returns
        -------
        OwnerReply
            The constrained contribution and the count of units dropped as non-finite.
        """
        if self.spec.update != "user_vectors":
            return self._owner_level_reply(fed, shared, personal, units, round_, constraint)
        if constraint.rows and self.training.sort_users and self.spec.unit != Unit.owner:
            return self._sorted_rows_reply(fed, shared, personal, units, round_, constraint)
        if constraint.rows:  # written into one matrix as the chunks come (held once)
            return rows_reply(
                self.unit_vectors(fed, shared, personal, units, round_),
                len(units),
                self.shared_dim,
                self.dtype,
                self.spec.shared,
                device=self.device,
            )
        fast = (
            self._one_step_units(fed, units, constraint) if self.training.kernels.one_step else None
        )
        parts = []
        if fast is not None and fast.any():
            sub = user_units(fed, units[fast])
            parts.append(self._one_step_reply(fed, shared, sub.starts, sub.sizes, constraint))
            units = units[~fast]
        if len(units) or not parts:
            parts += [
                make_reply(G, self.spec.shared, constraint)
                for G in self.unit_vectors(fed, shared, personal, units, round_)
            ]
        if len(parts) == 1:
            return parts[0]
        c = Contribution.merge(
            [p.contribution for p in parts], self.shared_dim, self.dtype, constraint.rows
        )
        return OwnerReply(self.spec.shared, c, sum(p.failed for p in parts))

    def _sorted_rows_reply(
        self,
        fed: Federation,
        shared: Params,
        personal: Params,
        units: np.ndarray,
        round_: int,
        constraint: Constraint,
    ) -> OwnerReply:
        """``Owners.reply`` for rows of users computed in chunks sorted by record count
        (``OwnerTraining.sort_users``): the rows go to the estimator in the cohort's order."""
        # sorted chunks: the rows go to the estimator in the cohort's own order
        got = list(self.user_vectors(fed, shared, personal, units, round_))
        if not got:
            return make_reply(
                torch.zeros(0, self.shared_dim, dtype=self.dtype, device=self.device),
                self.spec.shared,
                constraint,
            )
        done = np.concatenate([u for u, _ in got])
        G = torch.cat([g for _, g in got])
        where = {int(u): i for i, u in enumerate(done)}
        G = G[torch.from_numpy(np.array([where[int(u)] for u in units], dtype=np.int64))]
        return make_reply(G, self.spec.shared, constraint)

    def _one_step_units(
        self, fed: Federation, units: np.ndarray, constraint: Constraint
    ) -> np.ndarray | None:
        """Which of the sampled users ``units`` take the one-step path
        (``fedudp.owner.one_step``: their vectors from one batched forward/backward), or None
        where it does not apply. It applies to clipped sums of users (not owners) at parameters common
        to all users (no owner's own personal layers in the forward), on Linear / Conv2d shared
        layers, with the plain owner hooks; a user takes it when its vector is one SGD step (one
        epoch, no more records than a batch) or its mean gradient (for a convolution model, over
        at most ``ONE_STEP_RECORDS`` records; larger users loop in ``local_sgd``). It is faster than
        both of ``local_sgd``'s paths for such users on the CPU: the vmapped one's grouped
        convolutions and the loop's small per-user batches (measured in docs/benchmarks.md)."""
        if constraint.rows or constraint.clip is None:
            return None
        return self._one_step_users(fed, units)

    @property
    def _delta_mode(self) -> bool:
        return self.training.mode == SharedUpdate.delta.value

    def _one_step_users(
        self, fed: Federation, units: np.ndarray, vectors: bool = False
    ) -> np.ndarray | None:
        """``_one_step_units``' rule without the constraint: which users take the one-step
        path, or None where it does not apply (``vectors``: the users' vectors are needed, so
        the ghost path, which gives only a clipped sum, does not count)."""
        if self.spec.unit == Unit.owner or not self.training.kernels.one_step:
            return None
        if self.spec.feedback and self.spec.personal:
            return None
        if type(self.hooks).user_gradients is not OwnerHooks.user_gradients:
            return None
        if not len(units) or not (
            per_sample.supported(self.model, self.spec.shared)
            or (not vectors and self._ghost(fed, np.ones(1)))
        ):
            return None
        spec = self.training.user
        sizes = np.diff(fed.user_offsets)[units]
        if self.training.mode == SharedUpdate.delta.value:
            if spec.epochs != 1:
                return None
            return sizes <= spec.batch_size
        return (sizes <= ONE_STEP_RECORDS) | ~local_sgd.loop_units(self.model, sizes, None)

    def evaluate(
        self, fed: Federation, shared: Params, personal: Params
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each owner's accuracy and loss on its test shard (``evaluation.evaluate_owners``).

        Parameters
        ----------
        fed : Federation
            The owners and their test shards.
        shared, personal : Params
            The shared parameters; every owner's personal parameters, stacked.

        Returns
        -------
        tuple of np.ndarray
            (accuracy, loss) per owner, NaN for an empty shard; the pieces depend only on the
            owner's own shard, so both engines compute the same numbers.
        """
        return evaluate_owners(self.model, self.budget, fed, shared, personal, self.report_progress)
