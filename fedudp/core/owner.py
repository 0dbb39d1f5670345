"""Owner-side math, vectorized over units with ``torch.func`` (ARCHITECTURE.md §3, §5).

A *unit* here is a set of contiguous records trained as one: a user (for the per-user shared
vectors the billboard aggregates) or a whole owner (for its personal-parameter update, or
per_silo training). Every unit runs its own plain minibatch SGD trajectory; ``vmap`` runs
many trajectories at once, padding shorter units with masked records. A masked step has
zero gradient, so a unit of ``n`` records takes exactly ``ceil(n / batch)`` real steps per
epoch, the same steps a per-unit Python loop takes: the engine-equivalence test relies on it.

Randomness (batch order) is a pure function of (seed, round, epoch, purpose, owner), so the
result does not depend on how units are chunked, on the engine, or on scheduling order.

Huang et al. (001) Alg. 1 / §4: each sampled user's vector is the average gradient (or the
local delta after E epochs) on the *shared* parameters; the personal parameters are updated
on the owner's own records without noise and never leave the owner.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

Params = dict[str, torch.Tensor]

PURPOSE_USER_ORDER = 1
PURPOSE_PERSONAL_ORDER = 2


@dataclass(frozen=True)
class LocalSpec:
    """How units train locally (public hyperparameters)."""

    seed: int
    lr: float
    batch_size: int
    epochs: int


@dataclass(frozen=True)
class Units:
    """Units as record ranges: unit i owns records ``starts[i] .. starts[i] + sizes[i]``.

    ``starts`` index the record arrays passed alongside (global or one owner's shard).
    ``owners`` is each unit's owner id; ``owner_starts`` the index of that owner's first
    record in the same arrays (the batch-order keys are drawn per owner).
    """

    starts: np.ndarray
    sizes: np.ndarray
    owners: np.ndarray
    owner_starts: np.ndarray
    owner_sizes: np.ndarray

    def __len__(self) -> int:
        return len(self.starts)

    def subset(self, sel: np.ndarray) -> "Units":
        return Units(self.starts[sel], self.sizes[sel], self.owners[sel],
                     self.owner_starts[sel], self.owner_sizes[sel])


def epoch_keys(seed: int, round_: int, epoch: int, purpose: int, owner: int, n: int) -> np.ndarray:
    """Sort keys for one owner's ``n`` records in one epoch (public randomness)."""
    return np.random.default_rng([seed, purpose, round_, epoch, owner]).random(n)


def batch_orders(units: Units, spec: LocalSpec, round_: int, purpose: int) -> np.ndarray:
    """Per unit and epoch, its records in visiting order, padded with -1: [U, E, L]."""
    L = int(units.sizes.max()) if len(units) else 0
    U = len(units)
    out = np.full((U, spec.epochs, L), -1, dtype=np.int64)
    if U == 0 or L == 0:
        return out
    col = np.arange(L)[None, :]
    valid = col < units.sizes[:, None]
    idx = units.starts[:, None] + np.minimum(col, units.sizes[:, None] - 1)  # absolute
    rel = idx - units.owner_starts[:, None]                                   # within owner
    owners = np.unique(units.owners)
    for e in range(spec.epochs):
        keys = np.full((U, L), np.inf)
        for o in owners:
            rows = np.flatnonzero(units.owners == o)
            k = epoch_keys(spec.seed, round_, e, purpose, int(o), int(units.owner_sizes[rows[0]]))
            keys[rows] = np.where(valid[rows], k[rel[rows]], np.inf)
        order = np.argsort(keys, axis=1, kind="stable")
        out[:, e] = np.where(np.take_along_axis(valid, order, 1), np.take_along_axis(idx, order, 1), -1)
    return out


def _loss(model: nn.Module, params: Mapping[str, torch.Tensor], xb: torch.Tensor,
          yb: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
    out = functional_call(model, dict(params), (xb,))
    per = F.cross_entropy(out, yb, reduction="none")
    return (per * mb).sum() / mb.sum().clamp(min=1.0)


def local_sgd(model: nn.Module, trainable: Params, frozen_per_unit: Params, frozen_common: Params,
              x: torch.Tensor, y: torch.Tensor, orders: np.ndarray, spec: LocalSpec) -> Params:
    """Run each unit's SGD (``spec.epochs`` passes, batches of ``spec.batch_size``) at once.

    ``trainable`` and ``frozen_per_unit`` have a leading unit dimension; ``frozen_common``
    is shared by all units. Returns the trained ``trainable``.
    """
    U, E, L = orders.shape
    if U == 0 or L == 0:
        return trainable

    def unit_loss(tr: Params, fr: Params, xb: torch.Tensor, yb: torch.Tensor, mb: torch.Tensor):
        return _loss(model, {**frozen_common, **fr, **tr}, xb, yb, mb)

    g = vmap(grad(unit_loss), in_dims=(0, 0, 0, 0, 0))
    b = spec.batch_size
    steps = -(-L // b)
    dtype = next(iter(trainable.values())).dtype
    for e in range(E):
        ord_e = torch.from_numpy(orders[:, e])
        for s in range(steps):
            idx = ord_e[:, s * b:(s + 1) * b]
            mask = idx >= 0
            if not bool(mask.any()):
                continue
            ic = idx.clamp(min=0)
            grads = g(trainable, frozen_per_unit, x[ic], y[ic], mask.to(dtype))
            trainable = {k: v - spec.lr * grads[k] for k, v in trainable.items()}
    return trainable


def mean_gradients(model: nn.Module, trainable: Params, frozen_per_unit: Params,
                   frozen_common: Params, x: torch.Tensor, y: torch.Tensor,
                   units: Units) -> Params:
    """Each unit's average gradient over all its records, w.r.t. ``trainable`` ([U, ...])."""
    U, L = len(units), int(units.sizes.max()) if len(units) else 0
    col = np.arange(L)[None, :]
    mask = torch.from_numpy(col < units.sizes[:, None])
    idx = torch.from_numpy(units.starts[:, None] + np.minimum(col, units.sizes[:, None] - 1))

    def unit_loss(tr, fr, xb, yb, mb):
        return _loss(model, {**frozen_common, **fr, **tr}, xb, yb, mb)

    dtype = next(iter(trainable.values())).dtype
    return vmap(grad(unit_loss), in_dims=(0, 0, 0, 0, 0))(
        trainable, frozen_per_unit, x[idx], y[idx], mask.to(dtype))


def expand(params: Mapping[str, torch.Tensor], n: int) -> Params:
    """Broadcast unbatched params to a leading unit dimension of size ``n`` (a copy)."""
    return {k: v.unsqueeze(0).expand(n, *v.shape).clone() for k, v in params.items()}


def flatten(params: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> torch.Tensor:
    """[U, d]: the named batched params of each unit, concatenated in ``names`` order."""
    return torch.cat([params[k].reshape(params[k].shape[0], -1) for k in names], dim=1)


def user_shared_vectors(model: nn.Module, shared: Params, personal_src: Params,
                        personal_batched: bool, x: torch.Tensor, y: torch.Tensor,
                        users: Units, spec: LocalSpec, mode: str, round_: int,
                        names: tuple[str, ...]) -> torch.Tensor:
    """[U, d_shared]: each user's shared-parameter vector at the broadcast ``shared``.

    ``mode="delta"``: the change of the shared parameters after ``spec.epochs`` of SGD on
    the user's own records (personal parameters frozen at ``personal_src``).
    ``mode="gradient"``: the average gradient over the user's records.
    ``personal_src`` is either one public copy (``personal_batched=False``: certified
    joint_dp, option (c) of ALGORITHMS.md §3.2) or one row per user (paper mode: the owner's
    own personal parameters, which is the heuristic feedback path).
    """
    U = len(users)
    fr_unit = personal_src if personal_batched else {}
    fr_common = {} if personal_batched else dict(personal_src)
    start = expand(shared, U)
    if mode == "gradient":
        g = mean_gradients(model, start, fr_unit, fr_common, x, y, users)
        return flatten(g, names)
    orders = batch_orders(users, spec, round_, PURPOSE_USER_ORDER)
    end = local_sgd(model, start, fr_unit, fr_common, x, y, orders, spec)
    return flatten(end, names) - flatten(start, names)


def personal_update(model: nn.Module, shared: Params, personal: Params, x: torch.Tensor,
                    y: torch.Tensor, owners: Units, spec: LocalSpec, round_: int) -> Params:
    """Owners' personal parameters ([O, ...]) after ``spec.epochs`` of SGD on all their records,
    with the shared parameters fixed at the broadcast. No noise: they never leave the owner."""
    if spec.epochs == 0 or not personal:
        return personal
    orders = batch_orders(owners, spec, round_, PURPOSE_PERSONAL_ORDER)
    return local_sgd(model, personal, {}, dict(shared), x, y, orders, spec)


@torch.no_grad()
def evaluate_owners(model: nn.Module, shared: Params, personal: Params, x: torch.Tensor,
                    y: torch.Tensor, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(accuracy, mean loss) of each owner on its test shard with its own personal params.

    ``personal`` has a leading owner dimension (may be empty); ``offsets`` [O+1] delimit
    the owners' test records in ``x``.
    """
    O = len(offsets) - 1
    sizes = np.diff(offsets)
    L = int(sizes.max()) if O else 0
    if L == 0:
        return np.full(O, np.nan), np.full(O, np.nan)
    col = np.arange(L)[None, :]
    valid = col < sizes[:, None]
    idx = torch.from_numpy(offsets[:-1, None] + np.minimum(col, np.maximum(sizes[:, None] - 1, 0)))
    mask = torch.from_numpy(valid)

    def one(pers, xb):
        return functional_call(model, {**shared, **pers}, (xb,))

    logits = vmap(one, in_dims=(0, 0))(personal, x[idx]) if personal else \
        functional_call(model, dict(shared), (x[idx].reshape(O * L, *x.shape[1:]),)).reshape(O, L, -1)
    yy = y[idx]
    correct = ((logits.argmax(-1) == yy) & mask).sum(1).double()
    loss = (F.cross_entropy(logits.reshape(O * L, -1), yy.reshape(-1), reduction="none")
            .reshape(O, L) * mask).sum(1).double()
    n = torch.from_numpy(np.maximum(sizes, 1)).double()
    acc = (correct / n).numpy()
    los = (loss / n).numpy()
    acc[sizes == 0] = np.nan
    los[sizes == 0] = np.nan
    return acc, los
