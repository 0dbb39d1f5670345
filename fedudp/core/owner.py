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
after E epochs of DP-SGD over its users (``owner_dpsgd``, ``fedudp.core.dpsgd``); both are
weighted by ``train.owner_weights`` (uniform, or the owner's record count).

``Owners`` works on any group of owners held as a ``Federation``: ``engine=local`` passes the
whole federation (owners batched with ``vmap`` in chunks of ``engine_opts.chunk_records``
records), a Flower ``ClientApp`` its own one-owner shard (``Federation.owner(j)``). Personal
parameters are stacked ``[owners here, ...]``. Batch orders are keyed by the global owner id,
so both engines compute the same vectors. A new owner-side training mode belongs here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn as nn

from fedudp.aggregators.base import Constraint, Contribution
from fedudp.config import OwnerWeights, RunConfig, SharedUpdate, Unit
from fedudp.core import local_sgd
from fedudp.core.dpsgd import DpSgdSpec, dpsgd_deltas
from fedudp.core.messages import OwnerReply, make_reply
from fedudp.core.methods import MethodSpec, method_spec
from fedudp.data.federation import (Federation, planned_owner_records, planned_owner_users,
                                    planned_shape)
from fedudp.randomness import Purpose, numpy_rng


def uniform_ball(rng: np.random.Generator, k: int, d: int, radius: float) -> np.ndarray:
    """[k, d] points uniform in the l2 ball of ``radius`` (docs/algorithms.md#uniform-point-in-a-ball),
    float64."""
    g = rng.standard_normal((k, d))
    u = rng.random((k, 1))
    return radius * u ** (1.0 / d) * g / np.maximum(np.linalg.norm(g, axis=1, keepdims=True), 1e-300)

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
    # set by a training algorithm (fedudp.algorithms), 0 / None otherwise:
    # [ASI] Alg. 3 randomized smoothing: a user's gradient is the mean over its records z_j of
    # grad l(u + y_j; z_j), y_j ~ Unif(B(0, r)) fresh per record from public randomness
    smoothing_radius: float = 0.0
    # [HUANG] Alg. 1/2: instead of epochs over all records, the owners of the round's sampled
    # units (``Owners.round_units``) take one gradient step of this size on their personal
    # parameters, over the sampled units' records (no noise: they never leave the owner)
    personal_step: float | None = None
    # [HUANG] Alg. 1's full-DP baseline (``algorithm.noise_personal``): with ``personal_step``,
    # every owner's personal block also moves by -personal_step * b_j every step, b_j ~
    # N(0, personal_noise_std² I_k) drawn fresh (float64, keyed by (seed, PERSONAL_NOISE, round,
    # owner id)) for EVERY owner, sampled or not; the std is the per-coordinate std of the noise
    # of the shared step's released mean in the same round ("same σ"). Extra noise: the personal
    # blocks still never leave their owner, and the accounting is the shared release's
    personal_noise_std: float | None = None
    # privacy.group_privacy: owner DP-SGD samples and clips records, not users
    dpsgd_records: bool = False
    # owner-side DP-SGD (``owner_dpsgd``): each owner's PUBLIC capacity, indexed by global owner
    # id, in DP-SGD units (users; records with ``dpsgd_records``). The sampling rate, the step
    # count and the divisor come from it, never from the data (``fedudp.core.dpsgd``)
    dpsgd_capacity: tuple[int, ...] | None = None
    # each owner's PUBLIC record count (global owner id): the ``owner_weights=size`` weights of
    # owner-side DP-SGD's deltas (the actual counts would be data the billboard reads)
    public_owner_records: tuple[int, ...] | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "OwnerTraining":
        t = cfg.train
        records = planned_owner_records(cfg)
        capacity = records if cfg.privacy.group_privacy else planned_owner_users(cfg)
        return cls(local_sgd.LocalSpec(cfg.seed, t.lr, t.batch_size, t.local_epochs),
                   local_sgd.LocalSpec(cfg.seed, t.lr, t.batch_size, t.resolved_personal_epochs()),
                   SharedUpdate(t.shared_update).value, OwnerWeights(t.owner_weights).value,
                   dpsgd_records=bool(cfg.privacy.group_privacy),
                   dpsgd_capacity=tuple(int(c) for c in capacity),
                   public_owner_records=tuple(int(r) for r in records))


def user_units(fed: Federation, users: np.ndarray) -> local_sgd.Units:
    lo = fed.user_owner[users]
    oo = fed.owner_offsets
    return local_sgd.Units(fed.user_offsets[users], np.diff(fed.user_offsets)[users], fed.owner_ids[lo],
                   oo[lo], np.diff(oo)[lo])


def owner_units(fed: Federation, owners: np.ndarray) -> local_sgd.Units:
    oo = fed.owner_offsets
    starts, sizes = oo[owners], np.diff(oo)[owners]
    return local_sgd.Units(starts, sizes, fed.owner_ids[owners], starts, sizes)


class Owners:
    """The owner side of a run: model, shared/personal split, local training (see module doc)."""

    def __init__(self, model: nn.Module, spec: MethodSpec, training: OwnerTraining, budget: int
                 ) -> None:
        self.model, self.spec, self.training, self.budget = model, spec, training, int(budget)
        init = dict(model.named_parameters())
        # x_pub: the public (seeded, data-independent) initial personal parameters
        self.public_personal = {k: init[k].detach().clone() for k in spec.personal}
        self.shared_dim = sum(int(init[k].numel()) for k in spec.shared)
        self.dtype = next(iter(init.values())).dtype
        # the round's sampled units (public randomness, the billboard's plan), for
        # ``training.personal_step``; None: no sampled personal step
        self.round_units: Callable[[int], np.ndarray] | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "Owners":
        """Model (seeded init, float64 in equivalence mode), method split and training from the
        config alone: the billboard process and every Flower owner build the same."""
        from fedudp.models import build_model
        if cfg.engine_opts.threads:
            torch.set_num_threads(cfg.engine_opts.threads)
        model = build_model(cfg, *planned_shape(cfg))
        if cfg.engine_opts.float64:
            model = model.double()
        for p in model.parameters():
            p.requires_grad_(False)
        return cls(model, method_spec(cfg, model), OwnerTraining.from_config(cfg),
                   local_sgd.chunk_budget(cfg.engine_opts.chunk_records, model))

    @property
    def trains_personal(self) -> bool:
        return bool(self.spec.personal) and self.training.personal.epochs > 0

    def initial_personal(self, owners: int) -> Params:
        return {k: v.unsqueeze(0).expand(owners, *v.shape).clone()
                for k, v in self.public_personal.items()}

    def personal_round(self, fed: Federation, shared: Params, personal: Params, round_: int
                       ) -> Params:
        """Every owner's personal parameters after its epochs of SGD on all its records, the
        shared parameters fixed at the broadcast. No noise: they never leave the owner.
        With ``training.personal_step`` (Huang Alg. 1/2): one gradient step for the owners of the
        round's sampled units only (``personal_step_round``)."""
        if self.training.personal_step is not None:
            return self.personal_step_round(fed, shared, personal, round_)
        if not self.trains_personal:
            return personal
        spec = self.training.personal
        units = owner_units(fed, np.arange(fed.num_owners))
        new = {k: v.clone() for k, v in personal.items()}
        for sel in local_sgd.chunks(units.sizes, self.budget, spec.batch_size):
            orders = local_sgd.batch_orders(units.subset(sel), spec, round_, Purpose.PERSONAL_ORDER)
            out = local_sgd.local_sgd(self.model, local_sgd.select(personal, sel), {}, dict(shared), fed.x, fed.y,
                              orders, spec)
            for k in new:
                new[k][torch.from_numpy(sel)] = out[k].detach()
        return new

    def personal_step_round(self, fed: Federation, shared: Params, personal: Params, round_: int
                            ) -> Params:
        """[HUANG] Alg. 1/2's personal move: x_j <- x_j - eta * (mean over the round's sampled
        records of owner j of grad_x h(x_j, u, z)), for each owner j with sampled units; every
        other owner's x_j is unchanged. With ``training.personal_noise_std`` (Alg. 1's full-DP
        baseline) every owner here also takes x_j <- x_j - eta * b_j (``personal_noise``)."""
        units = self.round_units(round_) if self.round_units is not None else np.zeros(0, np.int64)
        noisy = bool(self.training.personal_noise_std)
        if not self.spec.personal or (not len(units) and not noisy):
            return personal
        new = {k: v.clone() for k, v in personal.items()}
        if len(units):
            self._personal_gradient_step(fed, shared, personal, np.asarray(units, dtype=np.int64), new)
        if noisy:
            eta = float(self.training.personal_step)
            for k, b in self.personal_noise(fed, round_).items():
                new[k] = (new[k].to(torch.float64) - eta * b).to(new[k].dtype)
        return new

    def personal_noise(self, fed: Federation, round_: int) -> Params:
        """[HUANG] Alg. 1's full-DP baseline: this round's b_j ~ N(0, personal_noise_std² I_k) for
        every owner here (float64, stacked like the personal parameters), each owner's drawn from
        the run's keyed randomness (``fedudp.randomness``) at (seed, PERSONAL_NOISE, round, its global owner id), so
        an owner's draw does not depend on which other owners share its process."""
        std, names = float(self.training.personal_noise_std), self.spec.personal
        shapes = [tuple(self.public_personal[k].shape) for k in names]
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        draws = np.stack([numpy_rng(self.training.user.seed, Purpose.PERSONAL_NOISE, round_, int(j))
                          .standard_normal(sum(sizes)) for j in fed.owner_ids])
        out, i = {}, 0
        for k, s, n in zip(names, shapes, sizes):
            out[k] = std * torch.from_numpy(draws[:, i:i + n]).reshape(len(fed.owner_ids), *s)
            i += n
        return out

    def _personal_gradient_step(self, fed: Federation, shared: Params, personal: Params,
                                units: np.ndarray, new: Params) -> None:
        """x_j -= eta * (owner j's sampled records' mean personal gradient), in ``new``."""
        owners = fed.user_owner[units]
        grads = local_sgd.mean_gradients(self.model, local_sgd.select(personal, owners), {}, dict(shared),
                                         fed.x, fed.y, user_units(fed, units))
        sizes = torch.from_numpy(np.diff(fed.user_offsets)[units].astype(np.float64))
        uniq, row = np.unique(owners, return_inverse=True)
        idx = torch.from_numpy(row)
        weight = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, idx, sizes)
        for k, g in grads.items():
            flat = (g.to(torch.float64).reshape(len(units), -1) * sizes.unsqueeze(1))
            tot = torch.zeros(len(uniq), flat.shape[1], dtype=torch.float64).index_add_(0, idx, flat)
            step = (tot / weight.unsqueeze(1)).reshape(len(uniq), *g.shape[1:]).to(new[k].dtype)
            new[k][torch.from_numpy(uniq)] -= self.training.personal_step * step

    def smoothed_gradients(self, fed: Federation, shared: Params, fr_unit: Params, fr_common: Params,
                           sub: local_sgd.Units, user_ids: np.ndarray, round_: int) -> torch.Tensor:
        """[ASI] Alg. 3 randomized smoothing: [len(sub), d_shared], each user's mean over its
        records z_j of grad l(u + y_j; z_j), y_j ~ Unif(B(0, r)) drawn per record (float64) from
        public randomness keyed by (round, the user's stable id)."""
        names, r, d = self.spec.shared, self.training.smoothing_radius, self.shared_dim
        sizes = sub.sizes.astype(np.int64)
        rec = np.concatenate([np.arange(s, s + k) for s, k in zip(sub.starts, sizes)])
        of = np.repeat(np.arange(len(sub)), sizes)
        Y = torch.cat([torch.from_numpy(uniform_ball(numpy_rng(self.training.user.seed, Purpose.SMOOTHING,
                                                               round_, int(uid)), int(k), d, r))
                       for uid, k in zip(user_ids, sizes)])
        base = local_sgd.flatten(local_sgd.expand(shared, len(rec)), names)
        flat = (base.to(torch.float64) + Y).to(base.dtype)
        trainable, i = {}, 0
        for k in names:
            n = shared[k].numel()
            trainable[k] = flat[:, i:i + n].reshape(len(rec), *shared[k].shape)
            i += n
        ones = np.ones(len(rec), dtype=np.int64)
        units = local_sgd.Units(rec, ones, np.zeros_like(ones), rec, ones)
        fr = local_sgd.select(fr_unit, of) if fr_unit else {}
        G = local_sgd.flatten(local_sgd.mean_gradients(self.model, trainable, fr, fr_common, fed.x,
                                                       fed.y, units), names)
        out = torch.zeros(len(sub), d, dtype=G.dtype).index_add_(0, torch.from_numpy(of), G)
        return out / torch.from_numpy(np.maximum(sizes, 1)).to(G.dtype).unsqueeze(1)

    def user_vectors(self, fed: Federation, shared: Params, personal: Params, users: np.ndarray,
                     round_: int) -> Iterator[tuple[np.ndarray, torch.Tensor]]:
        """(users, [len, d_shared]) chunks of the users' shared vectors at the broadcast.

        ``delta``: the change of the shared parameters after the user's epochs of SGD on its own
        records; ``gradient``: its average gradient. Personal parameters are frozen at the
        public copy (certified joint_dp, docs/algorithms.md#certified-vs-paper-accounting) or, with
        ``spec.feedback`` (paper mode, owner level), at the user's owner's own parameters.
        """
        spec, names = self.training.user, self.spec.shared
        units = user_units(fed, users)
        delta = self.training.mode == SharedUpdate.delta.value
        for sel in local_sgd.chunks(units.sizes, self.budget, spec.batch_size if delta else None):
            sub = units.subset(sel)
            fr_unit, fr_common = self._frozen(fed, personal, fed.user_owner[users[sel]])
            start = local_sgd.expand(shared, len(sub))
            if delta:
                orders = local_sgd.batch_orders(sub, spec, round_, Purpose.USER_ORDER,
                                                fed.user_ids[users[sel]])
                end = local_sgd.local_sgd(self.model, start, fr_unit, fr_common, fed.x, fed.y, orders, spec)
                G = local_sgd.flatten(end, names) - local_sgd.flatten(start, names)
            elif self.training.smoothing_radius > 0:
                G = self.smoothed_gradients(fed, shared, fr_unit, fr_common, sub,
                                            fed.user_ids[users[sel]], round_)
            else:
                G = local_sgd.flatten(local_sgd.mean_gradients(self.model, start, fr_unit, fr_common, fed.x, fed.y,
                                               sub), names)
            yield users[sel], G.detach()

    def unit_vectors(self, fed: Federation, shared: Params, personal: Params, units: np.ndarray,
                     round_: int) -> Iterator[torch.Tensor]:
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
        sums = torch.zeros(len(units), self.shared_dim, dtype=self.dtype)
        for us, G in self.user_vectors(fed, shared, personal, users, round_):
            sums.index_add_(0, torch.from_numpy(row[fed.user_owner[us]]), G.to(sums.dtype))
        counts = torch.from_numpy(np.diff(ou)[units]).to(sums.dtype)
        yield sums / counts.clamp(min=1).unsqueeze(1)

    def _frozen(self, fed: Federation, personal: Params, owners: np.ndarray) -> tuple[Params, Params]:
        """(per-unit personal params, common ones) at which shared updates are computed."""
        if self.spec.feedback and self.spec.personal:
            return local_sgd.select(personal, owners), {}
        return {}, dict(self.public_personal)

    def owner_deltas(self, fed: Federation, shared: Params, personal: Params, owners: np.ndarray,
                     round_: int, constraint: Constraint) -> torch.Tensor:
        """[len(owners), d_shared]: each owner's owner-level update (``owner_sgd`` or
        ``owner_dpsgd``) from the broadcast ``shared``."""
        spec, names = self.training.user, self.spec.shared
        if self.spec.update == "owner_dpsgd":
            fr_unit, fr_common = self._frozen(fed, personal, owners)
            dp = DpSgdSpec(float(constraint.dpsgd_noise), float(constraint.dpsgd_clip),
                           spec.batch_size, spec.epochs, spec.lr, spec.seed)
            if self.training.dpsgd_records:     # group privacy: every record is a DP-SGD unit
                n, oo = len(fed.y), fed.owner_offsets
                starts, sizes, first, count = np.arange(n), np.ones(n, np.int64), oo, np.diff(oo)
            else:
                ou = fed.owner_user_offsets
                starts, sizes, first, count = (fed.user_offsets[:-1], np.diff(fed.user_offsets),
                                               ou, np.diff(ou))
            if self.training.dpsgd_capacity is None:
                raise ValueError("owner-side DP-SGD needs each owner's public capacity "
                                 "(OwnerTraining.dpsgd_capacity)")
            ids = fed.owner_ids[owners]
            capacity = np.asarray(self.training.dpsgd_capacity, dtype=np.int64)[ids]
            return dpsgd_deltas(self.model, shared, fr_unit, fr_common, fed.x, fed.y, starts, sizes,
                                first[owners], count[owners], capacity, ids, dp, round_,
                                names, self.budget)
        units = owner_units(fed, owners)
        out = []
        for sel in local_sgd.chunks(units.sizes, self.budget, spec.batch_size):
            fr_unit, fr_common = self._frozen(fed, personal, owners[sel])
            start = local_sgd.expand(shared, len(sel))
            orders = local_sgd.batch_orders(units.subset(sel), spec, round_, Purpose.OWNER_ORDER)
            end = local_sgd.local_sgd(self.model, start, fr_unit, fr_common, fed.x, fed.y, orders,
                                      spec)
            out.append(local_sgd.flatten(end, names) - local_sgd.flatten(start, names))
        return torch.cat(out) if out else torch.zeros(0, self.shared_dim, dtype=self.dtype)

    def reply(self, fed: Federation, shared: Params, personal: Params, units: np.ndarray,
              round_: int, constraint: Constraint) -> OwnerReply:
        """The owners' reply for their sampled ``units``: shared parts only, constrained chunk
        by chunk (the cohort matrix is never built when sums suffice)."""
        if self.spec.update != "user_vectors":
            G = self.owner_deltas(fed, shared, personal, units, round_, constraint)
            if self.training.owner_weights == OwnerWeights.uniform.value:
                w = np.ones(len(units))
            elif self.spec.update == "owner_dpsgd":     # public sizes: the actual ones are data
                w = np.asarray(self.training.public_owner_records,
                               dtype=np.float64)[fed.owner_ids[units]]
            else:
                w = np.diff(fed.owner_offsets)[units].astype(np.float64)
            return make_reply(G, self.spec.shared, constraint, weights=w)
        parts = [make_reply(G, self.spec.shared, constraint)
                 for G in self.unit_vectors(fed, shared, personal, units, round_)]
        c = Contribution.merge([p.contribution for p in parts], self.shared_dim, self.dtype,
                               constraint.rows)
        return OwnerReply(self.spec.shared, c, sum(p.failed for p in parts))

    def evaluate(self, fed: Federation, shared: Params, personal: Params
                 ) -> tuple[np.ndarray, np.ndarray]:
        """(accuracy, loss) of each owner on its test shard with its own personal parameters."""
        sizes = np.diff(fed.test_offsets)
        acc, loss = np.zeros(fed.num_owners), np.zeros(fed.num_owners)
        for sel in local_sgd.chunks(np.maximum(sizes, 1), max(self.budget, int(sizes.max(initial=1)))):
            offs = fed.test_offsets[sel[0]:sel[-1] + 2]
            acc[sel], loss[sel] = local_sgd.evaluate_owners(self.model, shared, local_sgd.select(personal, sel),
                                                    fed.x_test, fed.y_test, offs)
        return acc, loss
