"""Evaluation: every owner's accuracy and loss on its own test shard, with its own personal
parameters (docs/architecture.md#engines).

``evaluate_owners`` is ``Owners.evaluate``: a shard is evaluated in pieces of at most the
evaluation budget, several owners' pieces in one forward where they fit, each owner's pieces'
sums added up in float64, in order; the pieces depend only on the owner's own shard, so both
engines compute the same numbers. ``evaluate_sums`` is the forward over units of records.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, vmap

from fedudp.data.federation import Federation
from fedudp.owner.gradients import bound
from fedudp.owner.local_sgd import Params, chunks, has_conv, select

__all__ = ["EVAL_RECORDS_CONV", "evaluate_owners", "evaluate_sums"]

# records per evaluation forward for a model with convolutions: on the CPU its forward is
# fastest in chunks of 32-128 records (its activations outgrow the caches beyond;
# docs/benchmarks.md)
EVAL_RECORDS_CONV = 128


def evaluate_owners(
    model: nn.Module,
    budget: int,
    fed: Federation,
    shared: Params,
    personal: Params,
    progress: Callable[[str, int, int], None],
) -> tuple[np.ndarray, np.ndarray]:
    """Each owner's accuracy and loss on its test shard with its own personal parameters.

    Parameters
    ----------
    model : nn.Module
        The model.
    budget : int
        Records per forward (a convolution model: at most ``EVAL_RECORDS_CONV``).
    fed : Federation
        The owners and their test shards.
    shared : Params
        The shared parameters, unbatched.
    personal : Params
        Every owner's personal parameters, stacked [owners, ...].
    progress : callable
        ``progress(stage, done, total)`` as owners are done; it changes nothing.

    Returns
    -------
    tuple of np.ndarray
        (accuracy, loss) per owner, NaN for an empty shard.
    """
    sizes = np.diff(fed.test_offsets)
    O = fed.num_owners
    piece = min(budget, EVAL_RECORDS_CONV) if has_conv(model) else budget
    counts = np.maximum(-(-sizes // piece), 1)  # an empty shard: one empty piece
    owner = np.repeat(np.arange(O), counts)
    k = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    starts = fed.test_offsets[:-1][owner] + k * piece
    offsets = np.append(starts, fed.test_offsets[-1])
    last = np.append(owner[1:] != owner[:-1], True)  # an owner's last piece
    correct, loss = np.zeros(O), np.zeros(O)
    reported = 0
    for sel in chunks(np.maximum(np.diff(offsets), 1), piece):
        c, l = evaluate_sums(
            model,
            shared,
            select(personal, owner[sel]),
            fed.x_test,
            fed.y_test,
            offsets[sel[0] : sel[-1] + 2],
        )
        np.add.at(correct, owner[sel], c)
        np.add.at(loss, owner[sel], l)
        done = int(owner[sel[-1]]) + int(last[sel[-1]])  # owners with every piece done
        if done > reported:
            reported = done
            progress("evaluating", done, O)
    n = np.maximum(sizes, 1)
    acc, loss = correct / n, loss / n
    acc[sizes == 0] = np.nan
    loss[sizes == 0] = np.nan
    return acc, loss


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
    """Each unit's correct predictions and summed cross-entropy on its own records.

    Two paths, the same forwards up to float summation order: ``vmap`` over the units in one
    forward (padded to the largest unit, the padding masked out; without personal params, one
    plain forward), or unit by unit with the unit's own parameters bound into the model
    (``"loop"``). ``"auto"``: the loop for a model with convolutions and personal params, vmap
    otherwise (vmapped per-unit parameters turn a convolution model's forward into grouped
    convolutions and batched pooling, slower on the CPU than per-unit forwards:
    docs/benchmarks.md). Each record's loss is summed in float64.

    Parameters
    ----------
    model, shared : nn.Module, Params
        The model and the shared parameters, unbatched.
    personal : Params
        Each unit's personal parameters, with a leading unit dimension (may be empty).
    x, y : Tensor
        The records and their labels.
    offsets : np.ndarray
        [U + 1] consecutive: unit u's records are ``x[offsets[u]:offsets[u + 1]]``.
    path : str
        ``"auto"``, ``"loop"`` or ``"vmap"``.

    Returns
    -------
    tuple of np.ndarray
        (correct predictions, summed cross-entropy), float64 [U].

    Raises
    ------
    ValueError
        An unknown ``path``.
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
