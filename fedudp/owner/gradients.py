"""The per-unit passes under ``fedudp.owner.local_sgd``: the masked loss of the vmapped paths'
padded batches, binding one unit's parameters into the model (``bound``, the per-unit loops'),
and each unit's mean gradient over all its records on either path (``mean_gradients_vmap``,
``mean_gradients_loop``; ``local_sgd.mean_gradients`` chooses). Pure functions of tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

__all__ = ["LOOP_MAX_BATCH", "bound", "masked_loss", "mean_gradients_loop", "mean_gradients_vmap"]

Params = dict[str, torch.Tensor]


def masked_loss(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    xb: torch.Tensor,
    yb: torch.Tensor,
    mb: torch.Tensor,
) -> torch.Tensor:
    """The mean cross-entropy of a padded batch's real records (the vmapped paths' loss).

    A masked (padding) slot reads another unit's record: its input is zeroed, so that a
    NaN/inf record of one unit never reaches another's gradient (NaN * 0 is NaN).

    Parameters
    ----------
    model : nn.Module
        The model.
    params : Mapping of str to Tensor
        All its parameters (one unit's).
    xb, yb : Tensor
        The batch's records and labels.
    mb : Tensor
        [B] 1 for a real record, 0 for padding.

    Returns
    -------
    Tensor
        The mean over the real records (0 for none).
    """
    keep = mb.reshape(-1, *([1] * (xb.dim() - 1))) > 0
    xb = torch.where(keep, xb, torch.zeros((), dtype=xb.dtype, device=xb.device))
    out = functional_call(model, dict(params), (xb,))
    per = F.cross_entropy(out, yb, reduction="none")
    return (per * mb).sum() / mb.sum().clamp(min=1.0)


@contextmanager
def bound(model: nn.Module, names: tuple[str, ...]) -> Iterator:
    """A context in which ``bind(params)`` puts tensors into ``model`` in place of its own.

    ``model(x)`` then computes what ``functional_call(model, params, (x,))`` does, without
    re-parametrizing at every call; the module's own tensors are back on exit. For loops that
    call one model many times with the same names.

    Parameters
    ----------
    model : nn.Module
        The model.
    names : tuple of str
        The parameters (or buffers) to replace.

    Yields
    ------
    callable
        ``bind(params)``: puts ``params[name]`` in place of each of ``names``.

    Raises
    ------
    KeyError
        A name that is neither a parameter nor a buffer of the model.
    """
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


def mean_gradients_vmap(
    model: nn.Module,
    trainable: Params,
    frozen_per_unit: Params,
    frozen_common: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    starts: np.ndarray,
    sizes: np.ndarray,
) -> Params:
    """``local_sgd.mean_gradients`` vmapped over the units, padded to the largest.

    Parameters
    ----------
    model, trainable, frozen_per_unit, frozen_common, x, y
        As in ``local_sgd.mean_gradients``.
    starts, sizes : np.ndarray
        Unit u's records are ``starts[u] .. starts[u] + sizes[u]``.

    Returns
    -------
    Params
        [U, ...] each unit's mean gradient.
    """
    L = int(sizes.max()) if len(starts) else 0
    col = np.arange(L)[None, :]
    mask = torch.from_numpy(col < sizes[:, None]).to(x.device)
    idx = torch.from_numpy(starts[:, None] + np.minimum(col, sizes[:, None] - 1))
    idx = idx.to(x.device)

    def unit_loss(tr, fr, xb, yb, mb):
        return masked_loss(model, {**frozen_common, **fr, **tr}, xb, yb, mb)

    dtype = next(iter(trainable.values())).dtype
    return vmap(grad(unit_loss), in_dims=(0, 0, 0, 0, 0))(
        trainable, frozen_per_unit, x[idx], y[idx], mask.to(dtype)
    )


# the per-unit loop of ``mean_gradients`` takes a large unit's records in batches of at most
# this many (memory); its gradient is the sum over the batches divided by the unit's size
LOOP_MAX_BATCH = 1024


def mean_gradients_loop(
    model: nn.Module,
    trainable: Params,
    frozen_per_unit: Params,
    frozen_common: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    starts: np.ndarray,
    sizes: np.ndarray,
) -> Params:
    """``local_sgd.mean_gradients`` unit by unit, with ordinary autograd on each unit's records
    (in batches of at most ``LOOP_MAX_BATCH``) and its parameters bound into the model.

    Parameters
    ----------
    model, trainable, frozen_per_unit, frozen_common, x, y
        As in ``local_sgd.mean_gradients``.
    starts, sizes : np.ndarray
        Unit u's records are ``starts[u] .. starts[u] + sizes[u]``.

    Returns
    -------
    Params
        [U, ...] each unit's mean gradient.
    """
    names = tuple(trainable)
    out = {k: torch.zeros_like(v) for k, v in trainable.items()}
    every = (*frozen_common, *frozen_per_unit, *names)
    with torch.enable_grad(), bound(model, every) as bind:
        for u in range(len(starts)):
            a, m = int(starts[u]), int(sizes[u])
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
