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
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from fedudp.randomness import Purpose, numpy_rng

Params = dict[str, torch.Tensor]


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

    def subset(self, sel: np.ndarray) -> Units:
        return Units(
            self.starts[sel],
            self.sizes[sel],
            self.owners[sel],
            self.owner_starts[sel],
            self.owner_sizes[sel],
        )


def epoch_keys(
    seed: int, round_: int, epoch: int, purpose: Purpose, owner: int, n: int
) -> np.ndarray:
    """Sort keys for one owner's ``n`` records in one epoch (public randomness)."""
    return numpy_rng(seed, purpose, round_, epoch, owner).random(n)


def batch_orders(
    units: Units,
    spec: LocalSpec,
    round_: int,
    purpose: Purpose,
    unit_keys: np.ndarray | None = None,
) -> np.ndarray:
    """Per unit and epoch, its records in visiting order, padded with -1: [U, E, L].

    Keys are drawn per owner (an owner's records, by position in the owner: owner-level
    training), or, with ``unit_keys``, per unit from that unit's own stable identity (users:
    a user's order must not move when another user of its owner is added or removed,
    docs/algorithms.md#certified-vs-paper-accounting)."""
    L = int(units.sizes.max()) if len(units) else 0
    U = len(units)
    out = np.full((U, spec.epochs, L), -1, dtype=np.int64)
    if U == 0 or L == 0:
        return out
    col = np.arange(L)[None, :]
    valid = col < units.sizes[:, None]
    idx = units.starts[:, None] + np.minimum(col, units.sizes[:, None] - 1)  # absolute
    rel = idx - units.owner_starts[:, None]  # within owner
    owners = np.unique(units.owners)
    for e in range(spec.epochs):
        keys = np.full((U, L), np.inf)
        if unit_keys is not None:
            for i in np.flatnonzero(units.sizes > 1):  # one record: nothing to order
                size = int(units.sizes[i])
                keys[i, :size] = numpy_rng(spec.seed, purpose, round_, e, int(unit_keys[i])).random(
                    size
                )
            keys[units.sizes == 1, 0] = 0.0
        for o in owners if unit_keys is None else ():
            rows = np.flatnonzero(units.owners == o)
            if not valid[rows].any():  # an owner without records: nothing to order
                continue
            k = epoch_keys(spec.seed, round_, e, purpose, int(o), int(units.owner_sizes[rows[0]]))
            keys[rows] = np.where(valid[rows], k[rel[rows]], np.inf)
        order = np.argsort(keys, axis=1, kind="stable")
        out[:, e] = np.where(
            np.take_along_axis(valid, order, 1), np.take_along_axis(idx, order, 1), -1
        )
    return out


def _loss(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    xb: torch.Tensor,
    yb: torch.Tensor,
    mb: torch.Tensor,
) -> torch.Tensor:
    # a masked (padding) slot reads another unit's record: zero its input, so that a NaN/inf
    # record of one unit never reaches another's gradient (NaN * 0 is NaN)
    keep = mb.reshape(-1, *([1] * (xb.dim() - 1))) > 0
    xb = torch.where(keep, xb, torch.zeros((), dtype=xb.dtype, device=xb.device))
    out = functional_call(model, dict(params), (xb,))
    per = F.cross_entropy(out, yb, reduction="none")
    return (per * mb).sum() / mb.sum().clamp(min=1.0)


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

    ``trainable`` and ``frozen_per_unit`` have a leading unit dimension; ``frozen_common``
    is shared by all units. Returns the trained ``trainable`` (the inputs are not modified).

    Two paths, the same steps on the same records (results equal up to float summation order):
    ``vmap`` over the units, one batched step per step index, and units one after another with
    ordinary autograd on each unit's real records. ``path="auto"``: each unit takes the path
    ``loop_units`` gives it (the loop for convolution models whose unit steps are large enough,
    vmap for the rest); ``"loop"`` or ``"vmap"`` force one for all units.
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
        return _loss(model, {**frozen_common, **fr, **tr}, xb, yb, mb)

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
# this many records or more on average (scripts/benchmarks/bench_local.py, docs/results/bench_local/floor)
LOOP_MIN_RECORDS = 8


def has_conv(model: nn.Module) -> bool:
    """Whether ``model`` holds a convolution."""
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())


def loop_units(model: nn.Module, sizes: np.ndarray, batch: int | None) -> np.ndarray:
    """[U] bool: which units of ``sizes`` records ``local_sgd`` (steps of ``batch`` records) or
    ``mean_gradients`` (``batch=None``: one step of all its records) runs one after another with
    ordinary autograd rather than vmapped. For a model with convolutions, the units whose steps
    hold at least ``LOOP_MIN_RECORDS`` records on average (records / ceil(records / batch));
    none otherwise.

    Why: under ``vmap`` every unit's convolutions become one grouped convolution and its
    max-pooling a batched one, which on the CPU cost more per record than the same work as
    ordinary per-unit calls (1.3x at 32 records per step, one thread); the per-call overhead of a
    step (about a millisecond for the paper CNN) is what ``vmap`` amortizes, and it only wins
    where steps are small (break-even near 8 records per step, 2x at one record;
    docs/results/bench_local/floor). Dense models stay vmapped: their batched matmuls are cheap
    and the per-call overhead dominates."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if not has_conv(model):
        return np.zeros(len(sizes), dtype=bool)
    if batch is None:
        return sizes >= LOOP_MIN_RECORDS
    steps = np.maximum(-(-sizes // max(int(batch), 1)), 1)
    return (sizes > 0) & (sizes >= LOOP_MIN_RECORDS * steps)


@contextmanager
def bound(model: nn.Module, names: tuple[str, ...]) -> Iterator:
    """``bind(params)`` puts the tensors ``params[name]`` into ``model`` in place of its own
    parameters (or buffers) ``names``, so that ``model(x)`` computes what
    ``functional_call(model, params, (x,))`` does, without re-parametrizing at every call (about
    0.1 ms a call for the paper CNN, a tenth of a one-record step); the module's own tensors are
    back on exit. For loops that call one model many times with the same names."""
    # (the module's parameter or buffer table, the name, its own tensor): a plain tensor is bound
    # into the slot for the call and the module's own put back
    slots: list[tuple[dict[str, Any], str, Any]] = []
    for name in names:
        path, _, attr = name.rpartition(".")
        mod = model.get_submodule(path)
        table: dict[str, Any] = mod._parameters if attr in mod._parameters else mod._buffers
        if attr not in table:
            raise KeyError(f"bound: {name} is neither a parameter nor a buffer of the model")
        slots.append((table, attr, table[attr]))

    def bind(params: Mapping[str, torch.Tensor]) -> None:
        for (table, attr, _), name in zip(slots, names):
            table[attr] = params[name]

    try:
        yield bind
    finally:
        for table, attr, own in slots:
            table[attr] = own


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
    """Each unit's average gradient over all its records, w.r.t. ``trainable`` ([U, ...]).

    Paths as in ``local_sgd`` (a unit's records are one step): ``vmap`` over the units (padded
    to the largest), or unit by unit with ordinary autograd (``"auto"``: ``loop_units`` per unit,
    the loop for units of ``LOOP_MIN_RECORDS`` records or more of a convolution model)."""
    if path not in ("auto", "loop", "vmap"):
        raise ValueError(f"mean_gradients: path must be auto, loop or vmap, got {path!r}")
    sizes = np.asarray(units.sizes)
    if path == "auto":
        looped = loop_units(model, sizes, None)
        path = "loop" if len(sizes) and looped.all() else "vmap" if not looped.any() else "auto"
    if path == "loop":
        return _mean_gradients_loop(model, trainable, frozen_per_unit, frozen_common, x, y, units)
    if path == "vmap":
        return _mean_gradients_vmap(model, trainable, frozen_per_unit, frozen_common, x, y, units)
    out = {k: torch.empty_like(v) for k, v in trainable.items()}
    for sel, run in (
        (np.flatnonzero(looped), _mean_gradients_loop),
        (np.flatnonzero(~looped), _mean_gradients_vmap),
    ):
        got = run(
            model,
            select(trainable, sel),
            select(frozen_per_unit, sel),
            frozen_common,
            x,
            y,
            units.subset(sel),
        )
        t = torch.from_numpy(sel)
        for k in out:
            out[k][t] = got[k].detach()
    return out


def _mean_gradients_vmap(
    model: nn.Module,
    trainable: Params,
    frozen_per_unit: Params,
    frozen_common: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    units: Units,
) -> Params:
    L = int(units.sizes.max()) if len(units) else 0
    col = np.arange(L)[None, :]
    mask = torch.from_numpy(col < units.sizes[:, None]).to(x.device)
    idx = torch.from_numpy(units.starts[:, None] + np.minimum(col, units.sizes[:, None] - 1))
    idx = idx.to(x.device)

    def unit_loss(tr, fr, xb, yb, mb):
        return _loss(model, {**frozen_common, **fr, **tr}, xb, yb, mb)

    dtype = next(iter(trainable.values())).dtype
    return vmap(grad(unit_loss), in_dims=(0, 0, 0, 0, 0))(
        trainable, frozen_per_unit, x[idx], y[idx], mask.to(dtype)
    )


# the per-unit loop of ``mean_gradients`` takes a large unit's records in batches of at most
# this many (memory); its gradient is the sum over the batches divided by the unit's size
LOOP_MAX_BATCH = 1024


def _mean_gradients_loop(
    model: nn.Module,
    trainable: Params,
    frozen_per_unit: Params,
    frozen_common: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    units: Units,
) -> Params:
    names = tuple(trainable)
    out = {k: torch.zeros_like(v) for k, v in trainable.items()}
    every = (*frozen_common, *frozen_per_unit, *names)
    with torch.enable_grad(), bound(model, every) as bind:
        for u in range(len(units)):
            a, m = int(units.starts[u]), int(units.sizes[u])
            if m == 0:
                continue
            leaves = [trainable[k][u].detach().requires_grad_(True) for k in names]
            bind(
                {
                    **frozen_common,
                    **{k: v[u] for k, v in frozen_per_unit.items()},
                    **dict(zip(names, leaves)),
                }
            )
            for s in range(a, a + m, LOOP_MAX_BATCH):
                e = min(s + LOOP_MAX_BATCH, a + m)
                loss = F.cross_entropy(model(x[s:e]), y[s:e], reduction="sum") / m
                grads = torch.autograd.grad(loss, leaves)
                with torch.no_grad():
                    for k, g in zip(names, grads):
                        out[k][u] += g
    return out


def expand(params: Mapping[str, torch.Tensor], n: int) -> Params:
    """Broadcast unbatched params to a leading unit dimension of size ``n`` (a copy)."""
    return {k: v.unsqueeze(0).expand(n, *v.shape).clone() for k, v in params.items()}


def flatten(params: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> torch.Tensor:
    """[U, d]: the named batched params of each unit, concatenated in ``names`` order."""
    return torch.cat([params[k].reshape(params[k].shape[0], -1) for k in names], dim=1)


def flat_delta(
    end: Mapping[str, torch.Tensor],
    start: Mapping[str, torch.Tensor],
    names: tuple[str, ...],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[U, d]: ``flatten(end) - start`` with ``start`` unbatched (every unit's common start),
    written into ``out`` when given (no intermediate [U, d] copies)."""
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


@torch.no_grad()
def evaluate_sums(
    model: nn.Module,
    shared: Params,
    personal: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    offsets: np.ndarray,
    path: str = "auto",
) -> tuple[np.ndarray, np.ndarray]:
    """(correct predictions, summed cross-entropy), float64 [U], of each unit on its records
    ``x[offsets[u]:offsets[u + 1]]`` with its own personal params.

    ``personal`` has a leading unit dimension (may be empty); ``offsets`` [U+1] are consecutive.
    Two paths, the same forwards up to float summation order: ``vmap`` over the units in one
    forward (padded to the largest unit, the padding masked out; without personal params, one
    plain forward), or unit by unit with the unit's own parameters bound into the model
    (``"loop"``). ``"auto"``: the loop for a model with convolutions and personal params, vmap
    otherwise. Why: vmapped per-unit parameters turn a convolution model's forward into grouped
    convolutions and batched pooling, which on the CPU take about twice the time of per-unit
    forwards (per_silo and joint_dp's evaluation on the natural MNIST federation,
    docs/results/natural_speed, "Personal training"). Each record's loss is summed in float64.
    """
    if path not in ("auto", "loop", "vmap"):
        raise ValueError(f"evaluate_sums: path must be auto, loop or vmap, got {path!r}")
    O = len(offsets) - 1
    sizes = np.diff(offsets)
    L = int(sizes.max()) if O else 0
    if L == 0:
        return np.zeros(O), np.zeros(O)
    if path == "loop" or (path == "auto" and personal and has_conv(model)):
        return _evaluate_sums_loop(model, shared, personal, x, y, offsets)
    col = np.arange(L)[None, :]
    valid = col < sizes[:, None]
    # an empty unit reads a valid record (masked out), also where it sits after the last one
    idx = torch.from_numpy(
        np.minimum(
            offsets[:-1, None] + np.minimum(col, np.maximum(sizes[:, None] - 1, 0)), len(x) - 1
        )
    ).to(x.device)
    mask = torch.from_numpy(valid).to(x.device)

    def one(pers, xb):
        return functional_call(model, {**shared, **pers}, (xb,))

    logits = (
        vmap(one, in_dims=(0, 0))(personal, x[idx])
        if personal
        else functional_call(model, dict(shared), (x[idx].reshape(O * L, *x.shape[1:]),)).reshape(
            O, L, -1
        )
    )
    yy = y[idx]
    correct = ((logits.argmax(-1) == yy) & mask).sum(1).double()
    loss = (
        F.cross_entropy(logits.reshape(O * L, -1), yy.reshape(-1), reduction="none")
        .reshape(O, L)
        .double()
        * mask
    ).sum(1)
    return correct.cpu().numpy(), loss.cpu().numpy()


@torch.no_grad()
def _evaluate_sums_loop(
    model: nn.Module,
    shared: Params,
    personal: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    offsets: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """``evaluate_sums`` unit by unit: one plain forward per unit with its personal params
    bound into the model (``bound``)."""
    O = len(offsets) - 1
    correct, loss = np.zeros(O), np.zeros(O)
    with bound(model, (*shared, *personal)) as bind:
        for u in range(O):
            a, b = int(offsets[u]), int(offsets[u + 1])
            if b <= a:
                continue
            bind({**shared, **{k: v[u] for k, v in personal.items()}})
            logits = model(x[a:b])
            correct[u] = float((logits.argmax(-1) == y[a:b]).sum())
            loss[u] = float(F.cross_entropy(logits, y[a:b], reduction="none").double().sum())
    return correct, loss


AUTO_CHUNK_CONV, AUTO_CHUNK_DENSE = 512, 8192


def chunk_budget(requested: int, model: nn.Module) -> int:
    """``engine_opts.chunk_records`` (0: auto). Auto: 512 records per vmapped step for models with
    convolutions (per-owner conv weights become grouped convolutions, whose CPU backward slows
    down with the group count: scripts/benchmarks/bench_local.py measured 1.2-1.5x of a plain loop at 512
    vs 2.2-3x at 8192), 8192 for dense models (fewer, larger matmuls win)."""
    if requested:
        return int(requested)
    hint = getattr(model, "auto_chunk_records", None)  # a model's own bound (memory)
    if hint:
        return int(hint)
    conv = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    return AUTO_CHUNK_CONV if conv else AUTO_CHUNK_DENSE


def chunks(sizes: np.ndarray, budget: int, per_unit_cap: int | None = None) -> Iterator[np.ndarray]:
    """Consecutive index groups whose padded size (count x max size) stays within ``budget``.

    ``per_unit_cap``: count each unit as at most this many records. Local SGD gathers one
    batch per unit per step, so with ``per_unit_cap=batch_size`` the budget bounds the records
    in one vmapped step (what sets speed and memory there), not the units' total sizes.
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
    """Rows ``idx`` of batched params."""
    t = torch.from_numpy(np.asarray(idx))
    return {k: v[t] for k, v in params.items()}
