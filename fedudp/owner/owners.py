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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from fedudp.data.federation import Federation
from fedudp.owner import ghost, local_sgd, per_sample
from fedudp.owner.dpsgd import DpSgdSpec, dpsgd_deltas
from fedudp.owner.one_step import one_step_vectors
from fedudp.protocol.choices import OwnerWeights, SharedUpdate, Unit
from fedudp.protocol.contributions import Constraint, Contribution, finite_rows
from fedudp.protocol.messages import OwnerReply, make_reply, rows_reply
from fedudp.protocol.methods import MethodSpec
from fedudp.randomness import Purpose

Params = local_sgd.Params


@dataclass(frozen=True)
class OwnerTraining:
    """Public hyperparameters of the owner side: users' (and owners') local SGD (``user``), the
    personal update (``personal``), whether a user's vector is its ``delta`` or mean
    ``gradient``, and how owner-level updates are weighted (``uniform`` or ``size``)."""

    user: local_sgd.LocalSpec
    personal: local_sgd.LocalSpec
    mode: str
    owner_weights: str = OwnerWeights.uniform.value
    # privacy.group_privacy: owner DP-SGD samples and clips records, not users
    dpsgd_records: bool = False
    # owner-side DP-SGD (``owner_dpsgd``): each owner's PUBLIC capacity, indexed by global owner
    # id, in DP-SGD units (users; records with ``dpsgd_records``). The sampling rate, the step
    # count and the divisor come from it, never from the data (``fedudp.owner.dpsgd``)
    dpsgd_capacity: tuple[int, ...] | None = None
    # each owner's PUBLIC record count (global owner id): the ``owner_weights=size`` weights of
    # owner-side DP-SGD's deltas (the actual counts would be data the billboard reads)
    public_owner_records: tuple[int, ...] | None = None
    # users of unequal sizes (natural federations): vmap the cohort in chunks of users sorted by
    # record count, so a chunk's steps follow its largest user with little padding
    # (docs/results/natural_speed); rows are handed on in the cohort's order
    sort_users: bool = False
    # privacy.randomness=secure: owner-side DP-SGD's sampling and noise from OS entropy
    secure_randomness: bool = False


def user_units(fed: Federation, users: np.ndarray) -> local_sgd.Units:
    lo = fed.user_owner[users]
    oo = fed.owner_offsets
    return local_sgd.Units(
        fed.user_offsets[users],
        np.diff(fed.user_offsets)[users],
        fed.owner_ids[lo],
        oo[lo],
        np.diff(oo)[lo],
    )


def owner_units(fed: Federation, owners: np.ndarray) -> local_sgd.Units:
    oo = fed.owner_offsets
    starts, sizes = oo[owners], np.diff(oo)[owners]
    return local_sgd.Units(starts, sizes, fed.owner_ids[owners], starts, sizes)


# one-step users' vectors from one batched forward/backward (``fedudp.owner.one_step``); False:
# every user through ``local_sgd`` (the reference path the tests compare it with)
ONE_STEP = True
# records per one-step chunk: its vectors, per-record weight gradients and their clipped copy
# are the chunk's memory (about 0.7 MiB a record for the paper CNN)
ONE_STEP_RECORDS = 128
# the one-step users of a clipped sum clipped without building their vectors (``fedudp.owner.
# ghost``: norms from the layers' inputs and output gradients, the clipped sum as one weighted
# weight-gradient pass), where every shared layer is of a kind it covers; False: their vectors
# built, clipped and summed (``one_step`` + ``make_reply``, the reference path)
GHOST = True
# records per ghost chunk: no [users, d] matrix is held, only activations, output gradients and
# the chunk's per-layer Grams or per-user weight gradients; a model with convolutions holds
# much more per record (its activations, per-record convolution weight gradients): 128, as
# ONE_STEP_RECORDS (docs/results/ghost)
GHOST_RECORDS = 512
GHOST_RECORDS_CONV = 128
# records per evaluation forward for a model with convolutions: the paper CNN's forward over
# 10,000 records takes 0.74-0.76 s in chunks of 32-128 records against 1.36 s in chunks of 512
# (one thread; its activations then outgrow the caches)
EVAL_RECORDS_CONV = 128


class OwnerHooks:
    """The owner computation's declared extension points (a training algorithm's,
    ``fedudp.algorithms``). Each returns None for the plain behaviour."""

    def personal_round(
        self, owners: Owners, fed: Federation, shared: Params, personal: Params, round_: int
    ) -> Params | None:
        """Every owner's personal parameters after this round (instead of epochs of SGD on all
        its records)."""
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
        """[len(sub), d_shared]: the users' shared vectors in ``gradient`` mode (instead of
        their mean gradients at the broadcast)."""
        return None


class Owners:
    """The owner side of a run: model, shared/personal split, local training (see module doc).
    ``hooks``: a training algorithm's ``OwnerHooks`` (None: the plain owner)."""

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
        if self.on_progress is not None:
            self.on_progress(stage, int(done), int(total))

    @property
    def trains_personal(self) -> bool:
        return bool(self.spec.personal) and self.training.personal.epochs > 0

    def initial_personal(self, owners: int) -> Params:
        return {
            k: v.unsqueeze(0).expand(owners, *v.shape).clone()
            for k, v in self.public_personal.items()
        }

    def personal_round(
        self, fed: Federation, shared: Params, personal: Params, round_: int
    ) -> Params:
        """Every owner's personal parameters after its epochs of SGD on all its records, the
        shared parameters fixed at the broadcast. No noise: they never leave the owner.
        A training algorithm's ``hooks.personal_round`` replaces this update."""
        hooked = self.hooks.personal_round(self, fed, shared, personal, round_)
        if hooked is not None:
            return hooked
        if not self.trains_personal:
            return personal
        spec = self.training.personal
        units = owner_units(fed, np.arange(fed.num_owners))
        new = {k: v.clone() for k, v in personal.items()}
        for sel in local_sgd.chunks(units.sizes, self.budget, spec.batch_size):
            orders = local_sgd.batch_orders(units.subset(sel), spec, round_, Purpose.PERSONAL_ORDER)
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
        self, fed: Federation, shared: Params, personal: Params, users: np.ndarray, round_: int
    ) -> Iterator[tuple[np.ndarray, torch.Tensor]]:
        """(users, [len, d_shared]) chunks of the users' shared vectors at the broadcast.

        ``delta``: the change of the shared parameters after the user's epochs of SGD on its own
        records; ``gradient``: its average gradient. Personal parameters are frozen at the
        public copy (certified joint_dp, docs/algorithms.md#certified-vs-paper-accounting) or, with
        ``spec.feedback`` (paper mode, owner level), at the user's owner's own parameters.
        """
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
                orders = local_sgd.batch_orders(
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
        """Row chunks for the billboard's sampled ``units`` of this federation: users, or with
        ``privacy.unit=owner`` owners (each the mean of all its users' vectors)."""
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
        """[len(owners), d_shared]: each owner's owner-level update (``owner_sgd`` or
        ``owner_dpsgd``) from the broadcast ``shared``. ``fractions``: with an adaptive DP-SGD
        clip (``constraint.dpsgd_count_noise``), filled with each owner's released unclipped
        fraction (``fedudp.owner.dpsgd``)."""
        spec, names = self.training.user, self.spec.shared
        if self.spec.update == "owner_dpsgd":
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
            orders = local_sgd.batch_orders(units.subset(rows), spec, round_, Purpose.OWNER_ORDER)
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

    def _one_step_owners(self, sizes: np.ndarray) -> np.ndarray:
        """[O] bool: which owners' ``owner_sgd`` delta is one SGD step on all their records (one
        epoch, at most a batch of records, no personal layers of their own in the forward) and
        is computed by the one-step path (``fedudp.owner.one_step``: -lr times the owner's mean
        gradient at the broadcast parameters, one batched forward/backward per chunk of owners;
        the same arithmetic as ``local_sgd``'s single step up to float summation order)."""
        spec = self.training.user
        no = np.zeros(len(sizes), dtype=bool)
        if not ONE_STEP or spec.epochs != 1 or (self.spec.feedback and self.spec.personal):
            return no
        if not len(sizes) or not per_sample.supported(self.model, self.spec.shared):
            return no
        return (sizes >= 1) & (sizes <= spec.batch_size)

    def _one_step_rows(
        self,
        G: torch.Tensor,
        rows: np.ndarray,
        fed: Federation,
        shared: Params,
        starts: np.ndarray,
        sizes: np.ndarray,
    ) -> None:
        """Writes the one-step deltas of the units ``rows`` (records ``starts[r] ..
        starts[r] + sizes[r]``) into those rows of ``G``."""
        for sel, V in self._one_step_chunks(
            fed, shared, starts[rows], sizes[rows], -self.training.user.lr
        ):
            G[torch.from_numpy(rows[sel])] = V
            self.report_progress("owners", int(sel[-1]) + 1, len(G))

    def _one_step_chunks(
        self, fed: Federation, shared: Params, starts: np.ndarray, sizes: np.ndarray, scale: float
    ) -> Iterator[tuple[np.ndarray, torch.Tensor]]:
        """Yields ``(sel, V)`` for consecutive chunks of the units (records ``starts[i] ..
        starts[i] + sizes[i]``) of at most ``min(budget, ONE_STEP_RECORDS)`` records: ``sel``
        indexes ``starts``; ``V`` [len(sel), d_shared] is ``scale`` times each unit's mean
        gradient at the broadcast parameters (``one_step.one_step_vectors``, one batched
        forward/backward). ``V`` lives in one scratch matrix that the next chunk overwrites:
        use it before asking for the next."""
        params = {**dict(self.public_personal), **shared}
        buf = None
        for sel in local_sgd.chunks(sizes, min(self.budget, ONE_STEP_RECORDS)):
            if buf is None or len(buf) < len(sel):
                buf = torch.empty(len(sel), self.shared_dim, dtype=self.dtype, device=self.device)
            yield (
                sel,
                one_step_vectors(
                    self.model,
                    params,
                    fed.x,
                    fed.y,
                    starts[sel],
                    sizes[sel],
                    self.spec.shared,
                    scale,
                    into=buf,
                ),
            )

    def reply(
        self,
        fed: Federation,
        shared: Params,
        personal: Params,
        units: np.ndarray,
        round_: int,
        constraint: Constraint,
    ) -> OwnerReply:
        """The owners' reply for their sampled ``units``: shared parts only, constrained chunk
        by chunk (the cohort matrix is never built when sums suffice)."""
        if self.spec.update != "user_vectors":
            adaptive = (
                self.spec.update == "owner_dpsgd" and constraint.dpsgd_count_noise is not None
            )
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
        if constraint.rows and self.training.sort_users and self.spec.unit != Unit.owner:
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
        if constraint.rows:  # written into one matrix as the chunks come (held once)
            return rows_reply(
                self.unit_vectors(fed, shared, personal, units, round_),
                len(units),
                self.shared_dim,
                self.dtype,
                self.spec.shared,
                device=self.device,
            )
        fast = self._one_step_units(fed, units, constraint) if ONE_STEP else None
        parts = []
        if fast is not None and fast.any():
            parts.append(self._one_step_reply(fed, shared, units[fast], constraint))
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
        convolutions and the loop's small per-user batches (one thread, the paper CNN, users of
        10 to 32 records: 7-20 % faster than the loop; docs/results/bench_pfl)."""
        if constraint.rows or constraint.clip is None or self.spec.unit == Unit.owner:
            return None
        if self.spec.feedback and self.spec.personal:
            return None
        if type(self.hooks).user_gradients is not OwnerHooks.user_gradients:
            return None
        if not len(units) or not (
            per_sample.supported(self.model, self.spec.shared) or self._ghost(fed, np.ones(1))
        ):
            return None
        spec = self.training.user
        sizes = np.diff(fed.user_offsets)[units]
        if self.training.mode == SharedUpdate.delta.value:
            if spec.epochs != 1:
                return None
            return sizes <= spec.batch_size
        return (sizes <= ONE_STEP_RECORDS) | ~local_sgd.loop_units(self.model, sizes, None)

    def _one_step_reply(
        self, fed: Federation, shared: Params, units: np.ndarray, constraint: Constraint
    ) -> OwnerReply:
        """The users ``units``' vectors from one batched forward/backward per chunk of the
        record budget (``_one_step_chunks``), constrained as every other path's, chunk by
        chunk (in place in the chunk's scratch matrix)."""
        names = self.spec.shared
        scale = -self.training.user.lr if self.training.mode == SharedUpdate.delta.value else 1.0
        sub = user_units(fed, units)
        if self._ghost(fed, sub.sizes):
            return self._ghost_reply(fed, shared, sub.starts, sub.sizes, scale, constraint)
        parts = []
        for sel, G in self._one_step_chunks(fed, shared, sub.starts, sub.sizes, scale):
            parts.append(make_reply(G, names, constraint, owned=True))
            self.report_progress("users", int(sel[-1]) + 1, len(units))
        c = Contribution.merge(
            [p.contribution for p in parts], self.shared_dim, self.dtype, constraint.rows
        )
        return OwnerReply(names, c, sum(p.failed for p in parts))

    def _ghost(self, fed: Federation, sizes: np.ndarray) -> bool:
        """Whether the one-step users (``sizes`` records each) take the ghost path
        (``fedudp.owner.ghost``): ``GHOST`` on, every shared layer of a kind it covers, and
        either no other batched path covers the model (``per_sample``) or at least half of the
        shared parameters sit in weights whose norm takes the Gram form for the largest of these
        users (``ghost.gram_share``: layer shapes only; where every weight gradient would be
        materialized anyway, today's path costs the same or less: the paper CNN at 10 records
        per user). Either path releases the same sum up to float rounding."""
        names = self.spec.shared
        if not GHOST or not len(sizes) or not ghost.supported(self.model, names):
            return False
        if not per_sample.supported(self.model, names):
            return True
        k = min(int(sizes.max()), GHOST_RECORDS)
        key = (tuple(fed.x.shape[1:]), fed.x.dtype, k)
        cache = self.__dict__.setdefault("_gram_share", {})
        if key not in cache:
            cache[key] = ghost.gram_share(self.model, key[0], key[1], names, k)
        return bool(cache[key] >= 0.5)

    def _ghost_reply(
        self,
        fed: Federation,
        shared: Params,
        starts: np.ndarray,
        sizes: np.ndarray,
        scale: float,
        constraint: Constraint,
    ) -> OwnerReply:
        """The clipped sum of the users (records ``starts[i] .. starts[i] + sizes[i]``) whose
        vectors are ``scale`` times their mean gradients at the broadcast, chunk by chunk of at
        most ``min(budget, GHOST_RECORDS)`` records (``GHOST_RECORDS_CONV`` for a model with
        convolutions), without building the vectors
        (``ghost.clipped_sum``: ``make_reply``'s semantics)."""
        names = self.spec.shared
        params = {**dict(self.public_personal), **shared}
        parts, failed = [], 0
        cap = GHOST_RECORDS_CONV if local_sgd.has_conv(self.model) else GHOST_RECORDS
        for sel in local_sgd.chunks(sizes, min(self.budget, cap)):
            gg = ghost.ghost_gradients(
                self.model, params, fed.x, fed.y, starts[sel], sizes[sel], names, scale
            )
            c, bad = ghost.clipped_sum(gg, constraint)
            parts.append(c)
            failed += bad
            self.report_progress("users", int(sel[-1]) + 1, len(sizes))
        c = Contribution.merge(parts, self.shared_dim, self.dtype, constraint.rows)
        return OwnerReply(names, c, failed)

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

    def evaluate(
        self, fed: Federation, shared: Params, personal: Params
    ) -> tuple[np.ndarray, np.ndarray]:
        """(accuracy, loss) of each owner on its test shard with its own personal parameters
        (NaN for an empty shard). A shard is evaluated in pieces of at most the evaluation
        budget (a convolution model: ``EVAL_RECORDS_CONV`` records, whose forward on the CPU
        is fastest in such chunks), several owners' pieces in one forward where they fit; each
        owner's pieces' sums are added up in float64, in order. The pieces depend only on the
        owner's own shard, so both engines compute the same numbers."""
        sizes = np.diff(fed.test_offsets)
        O = fed.num_owners
        piece = (
            min(self.budget, EVAL_RECORDS_CONV) if local_sgd.has_conv(self.model) else self.budget
        )
        counts = np.maximum(-(-sizes // piece), 1)  # an empty shard: one empty piece
        owner = np.repeat(np.arange(O), counts)
        k = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
        starts = fed.test_offsets[:-1][owner] + k * piece
        offsets = np.append(starts, fed.test_offsets[-1])
        last = np.append(owner[1:] != owner[:-1], True)  # an owner's last piece
        correct, loss = np.zeros(O), np.zeros(O)
        reported = 0
        for sel in local_sgd.chunks(np.maximum(np.diff(offsets), 1), piece):
            c, l = local_sgd.evaluate_sums(
                self.model,
                shared,
                local_sgd.select(personal, owner[sel]),
                fed.x_test,
                fed.y_test,
                offsets[sel[0] : sel[-1] + 2],
            )
            np.add.at(correct, owner[sel], c)
            np.add.at(loss, owner[sel], l)
            done = int(owner[sel[-1]]) + int(last[sel[-1]])  # owners with every piece done
            if done > reported:
                reported = done
                self.report_progress("evaluating", done, O)
        n = np.maximum(sizes, 1)
        acc, loss = correct / n, loss / n
        acc[sizes == 0] = np.nan
        loss[sizes == 0] = np.nan
        return acc, loss
