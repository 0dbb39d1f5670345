"""Local SGD and gradients, vectorized over units with ``torch.func``
(docs/architecture.md#engines).

The math under the owner component (``fedudp.owner.owners``); pure functions of tensors.

A *unit* here is a set of contiguous records trained as one: a user (for the per-user shared
vectors the billboard aggregates) or a whole owner (for its personal-parameter update, or
per_silo training). Every unit runs its own plain minibatch SGD trajectory; ``vmap`` runs
many trajectories at once, padding shorter units with masked records. A masked step has
zero gradient, so a unit of ``n`` records takes exactly ``ceil(n / batch)`` real steps per
epoch, the same steps a per-unit Python loop takes: the engine-equivalence test relies on it.

Randomness (batch order) is a pure function of (seed, round, epoch, purpose, owner), so the
result does not depend on how units are chunked, on the engine, or on scheduling order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import grad, vmap

from fedudp.owner.gradients import bound, masked_loss, mean_gradients_loop, mean_gradients_vmap

__all__ = [
    "AUTO_CHUNK_CONV",
    "AUTO_CHUNK_DENSE",
    "LOOP_MIN_RECORDS",
    "LocalSpec",
    "Params",
    "Units",
    "chunk_budget",
    "chunks",
    "expand",
    "flat_delta",
    "flatten",
    "has_conv",
    "local_sgd",
    "loop_units",
    "mean_gradients",
    "select",
]

Params = dict[str, torch.Tensor]


@dataclass(frozen=True)
class LocalSpec:
    """How units train locally (public hyperparameters).

    Parameters
    ----------
    seed, lr, batch_size, epochs : int, float, int, int
        The run's seed (the batch orders' key), the step size, records per step and passes
        over a unit's records per round.
    """

    seed: int
    lr: float
    batch_size: int
    epochs: int


@dataclass(frozen=True)
class Units:
    """Units as record ranges: unit i owns records ``starts[i] .. starts[i] + sizes[i]``.

    Parameters
    ----------
    starts, sizes : np.ndarray
        Each unit's first record (indices into the record arrays passed alongside: global or
        one owner's shard) and record count.
    owners : np.ndarray
        Each unit's owner id.
    owner_starts, owner_sizes : np.ndarray
        The index of that owner's first record in the same arrays and its record count (the
        batch-order keys are drawn per owner).
    """

    starts: np.ndarray
    sizes: np.ndarray
    owners: np.ndarray
    owner_starts: np.ndarray
    owner_sizes: np.ndarray

    def __len__(self) -> int:
        return len(self.starts)

    def subset(self, sel: np.ndarray) -> Units:
        """The units ``sel`` (``np.ndarray``: indices or a mask), in that order (``Units``)."""
        return Units(
            self.starts[sel],
            self.sizes[sel],
            self.owners[sel],
            self.owner_starts[sel],
            self.owner_sizes[sel],
        )


def local_sgd(
    model: nn.Module,
    trainable: Params,
    frozen_per_unit: Params,
    frozen_common: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    orders: np.ndarray,
    spec: LocalSpec,
    path: str = "auto",
) -> Params:
    """Run each unit's SGD (``spec.epochs`` passes, batches of ``spec.batch_size``) at once.

    Two paths, the same steps on the same records (results equal up to float summation order):
    ``vmap`` over the units, one batched step per step index, and units one after another with
    ordinary autograd on each unit's real records.

    Parameters
    ----------
    model : nn.Module
        The model.
    trainable, frozen_per_unit, frozen_common : Params
        The trained parameters and each unit's frozen ones (a leading unit dimension), and
        frozen parameters shared by all units.
    x, y, orders, spec : Tensor, Tensor, np.ndarray, LocalSpec
        The records, their labels, [U, E, L] ``batch_orders`` and the local training.
    path : str
        ``"auto"``: each unit takes the path ``loop_units`` gives it (the loop for convolution
        models whose unit steps are large enough, vmap for the rest); ``"loop"`` or ``"vmap"``
        force one for all units.

    Returns
    -------
    Params
        The trained ``trainable`` (the inputs are not modified).

    Raises
    ------
    ValueError
        An unknown ``path``.
    """
    U, _E, L = orders.shape
    if U == 0 or L == 0:
        return trainable
    if path not in ("auto", "loop", "vmap"):
        raise ValueError(f"local_sgd: path must be auto, loop or vmap, got {path!r}")
    if path == "auto":
        looped = loop_units(model, (orders[:, 0, :] >= 0).sum(1), spec.batch_size)
        if looped.all():
            path = "loop"
        elif not looped.any():
            path = "vmap"
    if path == "loop":
        return _local_sgd_loop(model, trainable, frozen_per_unit, frozen_common, x, y, orders, spec)
    if path == "vmap":
        return _local_sgd_vmap(model, trainable, frozen_per_unit, frozen_common, x, y, orders, spec)
    # both: each unit's steps do not depend on the other units
    out = {k: v.detach().clone() for k, v in trainable.items()}
    for sel, run in (
        (np.flatnonzero(looped), _local_sgd_loop),
        (np.flatnonzero(~looped), _local_sgd_vmap),
    ):
        o = orders[sel]
        width = int((o[:, 0, :] >= 0).sum(1).max())  # valid entries come first
        got = run(
            model,
            select(trainable, sel),
            select(frozen_per_unit, sel),
            frozen_common,
            x,
            y,
            np.ascontiguousarray(o[:, :, :width]),
            spec,
        )
        t = torch.from_numpy(sel)
        for k in out:
            out[k][t] = got[k].detach()
    return out


def _local_sgd_vmap(
    model: nn.Module,
    trainable: Params,
    frozen_per_unit: Params,
    frozen_common: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    orders: np.ndarray,
    spec: LocalSpec,
) -> Params:
    """``local_sgd`` vmapped: step s of every unit at once, units padded with masked records
    (a masked step has zero gradient)."""
    _U, E, L = orders.shape

    def unit_loss(
        tr: Params, fr: Params, xb: torch.Tensor, yb: torch.Tensor, mb: torch.Tensor
    ) -> torch.Tensor:
        return masked_loss(model, {**frozen_common, **fr, **tr}, xb, yb, mb)

    g = vmap(grad(unit_loss), in_dims=(0, 0, 0, 0, 0))
    b = spec.batch_size
    steps = -(-L // b)
    dtype = next(iter(trainable.values())).dtype
    for e in range(E):
        ord_e = torch.from_numpy(orders[:, e]).to(x.device)
        for s in range(steps):
            if not (orders[:, e, s * b : (s + 1) * b] >= 0).any():  # numpy: no device sync
                continue
            idx = ord_e[:, s * b : (s + 1) * b]
            mask = idx >= 0
            ic = idx.clamp(min=0)
            grads = g(trainable, frozen_per_unit, x[ic], y[ic], mask.to(dtype))
            trainable = {k: v - spec.lr * grads[k] for k, v in trainable.items()}
    return trainable


# a unit's local SGD runs in the per-unit loop (models with convolutions) when its steps hold
# this many records or more on average (measured: docs/benchmarks.md, bench_local.py)
LOOP_MIN_RECORDS = 8


def has_conv(model: nn.Module) -> bool:
    """Whether ``model`` holds a convolution.

    Parameters
    ----------
    model : nn.Module
        The model.

    Returns
    -------
    bool
    """
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())


def loop_units(model: nn.Module, sizes: np.ndarray, batch: int | None) -> np.ndarray:
    """Which units ``local_sgd`` or ``mean_gradients`` runs one after another, not vmapped.

    Under ``vmap`` every unit's convolutions become one grouped convolution and its
    max-pooling a batched one, which on the CPU cost more per record than the same work as
    ordinary per-unit calls; the per-call overhead of a step is what ``vmap`` amortizes, and
    it only wins where steps are small (measured: docs/benchmarks.md). Dense models stay
    vmapped: their batched matmuls are cheap and the per-call overhead dominates.

    Parameters
    ----------
    model : nn.Module
        The model (only whether it holds a convolution is read).
    sizes : np.ndarray
        Each unit's record count.
    batch : int or None
        Records per step (``local_sgd``), or None for one step of all of a unit's records
        (``mean_gradients``).

    Returns
    -------
    np.ndarray
        [U] bool: for a model with convolutions, the units whose steps hold at least
        ``LOOP_MIN_RECORDS`` records on average (records / ceil(records / batch)); none
        otherwise.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    if not has_conv(model):
        return np.zeros(len(sizes), dtype=bool)
    if batch is None:
        return sizes >= LOOP_MIN_RECORDS
    steps = np.maximum(-(-sizes // max(int(batch), 1)), 1)
    return (sizes > 0) & (sizes >= LOOP_MIN_RECORDS * steps)


def _local_sgd_loop(
    model: nn.Module,
    trainable: Params,
    frozen_per_unit: Params,
    frozen_common: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    orders: np.ndarray,
    spec: LocalSpec,
) -> Params:
    """``local_sgd`` unit by unit: plain minibatch SGD with ``torch.autograd`` on each unit's
    real records (no padding), the update ``w - lr * g`` in place on a copy of ``trainable``."""
    U, E, _L = orders.shape
    names = tuple(trainable)
    out = {k: v.detach().clone() for k, v in trainable.items()}
    b, lr = spec.batch_size, spec.lr
    sizes = (orders[:, 0, :] >= 0).sum(1)
    ords = torch.from_numpy(orders).to(x.device)
    every = (*frozen_common, *frozen_per_unit, *names)
    with torch.enable_grad(), bound(model, every) as bind:
        for u in range(U):
            m = int(sizes[u])
            if m == 0:
                continue
            leaves = [out[k][u].detach().requires_grad_(True) for k in names]
            bind(
                {
                    **frozen_common,
                    **{k: v[u] for k, v in frozen_per_unit.items()},
                    **dict(zip(names, leaves)),
                }
            )
            for e in range(E):
                order = ords[u, e, :m]
                for s in range(0, m, b):
                    idx = order[s : s + b]
                    out_b = model(x[idx])
                    loss = F.cross_entropy(out_b, y[idx])
                    grads = torch.autograd.grad(loss, leaves)
                    with torch.no_grad():
                        torch._foreach_sub_(leaves, torch._foreach_mul(grads, lr))
    return out


def mean_gradients(
    model: nn.Module,
    trainable: Params,
    frozen_per_unit: Params,
    frozen_common: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    units: Units,
    path: str = "auto",
) -> Params:
    """Each unit's average gradient over all its records, w.r.t. ``trainable``.

    Paths as in ``local_sgd`` (a unit's records are one step): ``vmap`` over the units (padded
    to the largest), or unit by unit with ordinary autograd.

    Parameters
    ----------
    model, trainable, frozen_per_unit, frozen_common, x, y
        As in ``local_sgd``.
    units : Units
        The units' records.
    path : str
        ``"auto"`` (``loop_units`` per unit: the loop for units of ``LOOP_MIN_RECORDS``
        records or more of a convolution model), ``"loop"`` or ``"vmap"``.

    Returns
    -------
    Params
        [U, ...] each unit's mean gradient.

    Raises
    ------
    ValueError
        An unknown ``path``.
    """
    if path not in ("auto", "loop", "vmap"):
        raise ValueError(f"mean_gradients: path must be auto, loop or vmap, got {path!r}")
    sizes = np.asarray(units.sizes)
    if path == "auto":
        looped = loop_units(model, sizes, None)
        path = "loop" if len(sizes) and looped.all() else "vmap" if not looped.any() else "auto"
    starts = np.asarray(units.starts)
    if path == "loop":
        return mean_gradients_loop(
            model, trainable, frozen_per_unit, frozen_common, x, y, starts, sizes
        )
    if path == "vmap":
        return mean_gradients_vmap(
            model, trainable, frozen_per_unit, frozen_common, x, y, starts, sizes
        )
    out = {k: torch.empty_like(v) for k, v in trainable.items()}
    for sel, run in (
        (np.flatnonzero(looped), mean_gradients_loop),
        (np.flatnonzero(~looped), mean_gradients_vmap),
    ):
        sub = units.subset(sel)
        got = run(
            model,
            select(trainable, sel),
            select(frozen_per_unit, sel),
            frozen_common,
            x,
            y,
            sub.starts,
            sub.sizes,
        )
        t = torch.from_numpy(sel)
        for k in out:
            out[k][t] = got[k].detach()
    return out


def expand(params: Mapping[str, torch.Tensor], n: int) -> Params:
    """Broadcast unbatched ``params`` to a leading unit dimension of size ``n`` (a copy).

    Parameters
    ----------
    params, n : Mapping of str to Tensor, int
        Unbatched parameters and the units.

    Returns
    -------
    Params
        [n, ...] copies.
    """
    return {k: v.unsqueeze(0).expand(n, *v.shape).clone() for k, v in params.items()}


def flatten(params: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> torch.Tensor:
    """The named batched ``params`` of each unit, concatenated in ``names`` order.

    Parameters
    ----------
    params, names : Mapping of str to Tensor, tuple of str
        Batched parameters [U, ...] and which, in order.

    Returns
    -------
    Tensor
        [U, d].
    """
    return torch.cat([params[k].reshape(params[k].shape[0], -1) for k in names], dim=1)


def flat_delta(
    end: Mapping[str, torch.Tensor],
    start: Mapping[str, torch.Tensor],
    names: tuple[str, ...],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``flatten(end) - start``, with ``start`` every unit's common (unbatched) start.

    Parameters
    ----------
    end, start, names : Mapping, Mapping, tuple of str
        Batched [U, ...] and unbatched parameters, and which, in order.
    out : Tensor or None
        [U, d] to write into (no intermediate [U, d] copies).

    Returns
    -------
    Tensor
        [U, d] (``out`` when given).
    """
    U = next(iter(end.values())).shape[0] if names else 0
    if out is None:
        out = torch.empty(
            U,
            sum(int(start[k].numel()) for k in names),
            dtype=end[names[0]].dtype if names else torch.float32,
            device=end[names[0]].device if names else None,
        )
    c = 0
    for k in names:
        n = int(start[k].numel())
        torch.sub(end[k].reshape(U, n), start[k].reshape(1, n), out=out[:, c : c + n])
        c += n
    return out


AUTO_CHUNK_CONV = 512
AUTO_CHUNK_DENSE = 8192


def chunk_budget(requested: int, model: nn.Module) -> int:
    """Records per vmapped chunk: ``engine_opts.chunk_records``, or the automatic budget.

    Parameters
    ----------
    requested : int
        ``engine_opts.chunk_records`` (0: auto).
    model : nn.Module
        The model (a model's own ``auto_chunk_records`` bound is taken when set).

    Returns
    -------
    int
        ``requested``, else the model's bound, else 512 records for models with convolutions
        (per-owner conv weights become grouped convolutions, whose CPU backward slows down
        with the group count: docs/benchmarks.md) and 8192 for dense models (fewer, larger
        matmuls win).
    """
    if requested:
        return int(requested)
    hint = getattr(model, "auto_chunk_records", None)  # a model's own bound (memory)
    if hint:
        return int(hint)
    conv = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    return AUTO_CHUNK_CONV if conv else AUTO_CHUNK_DENSE


def chunks(sizes: np.ndarray, budget: int, per_unit_cap: int | None = None) -> Iterator[np.ndarray]:
    """Consecutive index groups whose padded size (count x max size) stays within ``budget``.

    Parameters
    ----------
    sizes : np.ndarray
        Each unit's record count.
    budget : int
        Padded records per group (a unit larger than it is a group alone).
    per_unit_cap : int or None
        Count each unit as at most this many records. Local SGD gathers one batch per unit
        per step, so with ``per_unit_cap=batch_size`` the budget bounds the records in one
        vmapped step (what sets speed and memory there), not the units' total sizes.

    Yields
    ------
    np.ndarray
        The indices of each group, in order.
    """
    if per_unit_cap is not None:
        sizes = np.minimum(sizes, max(int(per_unit_cap), 1))
    i, n = 0, len(sizes)
    while i < n:
        j, mx = i + 1, int(sizes[i])
        while j < n and (j - i + 1) * max(mx, int(sizes[j])) <= budget:
            mx = max(mx, int(sizes[j]))
            j += 1
        yield np.arange(i, j)
        i = j


def select(params: Params, idx: np.ndarray) -> Params:
    """Rows ``idx`` of batched ``params``.

    Parameters
    ----------
    params, idx : Params, np.ndarray
        Batched parameters [U, ...] and unit indices.

    Returns
    -------
    Params
        [len(idx), ...].
    """
    t = torch.from_numpy(np.asarray(idx))
    return {k: v[t] for k, v in params.items()}
