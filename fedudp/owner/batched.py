"""The owners' batched one-step and ghost paths (``Owners``' share of ``fedudp.owner.one_step``
and ``fedudp.owner.ghost``): which owner-level units take the one-step path, the one-step
vectors chunk by chunk, whether one-step users take the ghost path, and the ghost path's
clipped sum.

``BatchedPaths`` is a base of ``fedudp.owner.owners.Owners``: its methods read the owner side's
model, method, settings (``OwnerTraining.kernels``: which paths are on) and record budget.
Every path computes what the reference path (``fedudp.owner.local_sgd``, every vector built
and clipped) computes, up to float rounding; which one runs follows public numbers only.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.nn as nn

from fedudp.data.federation import Federation
from fedudp.owner import ghost, local_sgd, per_sample
from fedudp.owner.kernels import GHOST_RECORDS, GHOST_RECORDS_CONV, ONE_STEP_RECORDS
from fedudp.owner.one_step import one_step_vectors
from fedudp.owner.settings import OwnerTraining
from fedudp.protocol.choices import SharedUpdate
from fedudp.protocol.contributions import Constraint, Contribution
from fedudp.protocol.messages import OwnerReply, make_reply
from fedudp.protocol.methods import MethodSpec

__all__ = ["BatchedPaths"]

Params = local_sgd.Params


class BatchedPaths:
    """The batched one-step and ghost computations of an owner side (module doc).

    Attributes
    ----------
    model : nn.Module
        The model.
    spec : MethodSpec
        The method (shared/personal split, update kind).
    training : OwnerTraining
        The owner side's settings; ``training.kernels`` says which paths are on.
    budget : int
        Records per chunk.
    public_personal : Params
        The public initial personal parameters.
    shared_dim : int
        The shared parameters' count.
    dtype : torch.dtype
        The parameters' dtype.
    device : torch.device
        Where the model lives.
    """

    model: nn.Module
    spec: MethodSpec
    training: OwnerTraining
    budget: int
    public_personal: Params
    shared_dim: int
    dtype: torch.dtype
    device: torch.device

    def report_progress(self, stage: str, done: int, total: int) -> None:
        """Progress inside a round (``Owners.report_progress``); it changes nothing.

        Parameters
        ----------
        stage : str
            What is being computed.
        done, total : int
            Units done and in all.
        """
        raise NotImplementedError

    def _one_step_owners(self, sizes: np.ndarray) -> np.ndarray:
        """[O] bool: which owners' ``owner_sgd`` delta is one SGD step on all their records (one
        epoch, at most a batch of records, no personal layers of their own in the forward) and
        is computed by the one-step path (``fedudp.owner.one_step``: -lr times the owner's mean
        gradient at the broadcast parameters, one batched forward/backward per chunk of owners;
        the same arithmetic as ``local_sgd``'s single step up to float summation order)."""
        spec = self.training.user
        no = np.zeros(len(sizes), dtype=bool)
        if (
            not self.training.kernels.one_step
            or spec.epochs != 1
            or (self.spec.feedback and self.spec.personal)
        ):
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
                    channels_last=self.training.kernels.channels_last,
                ),
            )

    def _ghost(self, fed: Federation, sizes: np.ndarray) -> bool:
        """Whether the one-step users (``sizes`` records each) take the ghost path
        (``fedudp.owner.ghost``): ``Kernels.ghost`` on, every shared layer of a kind it covers, and
        either no other batched path covers the model (``per_sample``) or at least half of the
        shared parameters sit in weights whose norm takes the Gram form for the largest of these
        users (``ghost.gram_share``: layer shapes only; where every weight gradient would be
        materialized anyway, today's path costs the same or less: the paper CNN at 10 records
        per user). Either path releases the same sum up to float rounding."""
        names = self.spec.shared
        if (
            not self.training.kernels.ghost
            or not len(sizes)
            or not ghost.supported(self.model, names)
        ):
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
                self.model,
                params,
                fed.x,
                fed.y,
                starts[sel],
                sizes[sel],
                names,
                scale,
                channels_last=self.training.kernels.channels_last,
            )
            c, bad = ghost.clipped_sum(gg, constraint)
            parts.append(c)
            failed += bad
            self.report_progress("users", int(sel[-1]) + 1, len(sizes))
        c = Contribution.merge(parts, self.shared_dim, self.dtype, constraint.rows)
        return OwnerReply(names, c, failed)

    def _one_step_reply(
        self,
        fed: Federation,
        shared: Params,
        starts: np.ndarray,
        sizes: np.ndarray,
        constraint: Constraint,
    ) -> OwnerReply:
        """The one-step users' (records ``starts[i] .. starts[i] + sizes[i]``) vectors from one
        batched forward/backward per chunk of the record budget (``_one_step_chunks``),
        constrained as every other path's, chunk by chunk (in place in the chunk's scratch
        matrix), or their clipped sum from the ghost path (``_ghost``)."""
        names = self.spec.shared
        scale = -self.training.user.lr if self.training.mode == SharedUpdate.delta.value else 1.0
        if self._ghost(fed, sizes):
            return self._ghost_reply(fed, shared, starts, sizes, scale, constraint)
        parts = []
        for sel, G in self._one_step_chunks(fed, shared, starts, sizes, scale):
            parts.append(make_reply(G, names, constraint, owned=True))
            self.report_progress("users", int(sel[-1]) + 1, len(sizes))
        c = Contribution.merge(
            [p.contribution for p in parts], self.shared_dim, self.dtype, constraint.rows
        )
        return OwnerReply(names, c, sum(p.failed for p in parts))
