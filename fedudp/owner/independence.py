"""The owners' batched per-record kernels, as ``fedudp.models.independence`` compares them with
each record's own backward (the models layer does not import the owners).

``kernels(model)`` gives one entry per kernel a configuration can take on ``model``, each run on
the parameters that kernel covers (a kernel that covers none is left out, since no configuration
takes it):

* DP-SGD's one-pass per-record gradients (``per_sample.per_record_gradients``), on the
  parameters of the exact ``nn.Linear`` / ``nn.Conv2d`` layers;
* the one-step user vectors (``one_step.one_step_vectors``: the server placement's one-step users
  and the Flower fast path, ``fedudp.flower.fast``), on the same parameters, one record per user;
* ghost clipping (``ghost.ghost_gradients``), on the parameters of the layers it covers, one
  record per user: each record's gradient read back as the weighted sum with that record's
  indicator as the weights, and its float64 norm (``NORM``).

``check(model, input_shape, classes, tokens)`` runs ``fedudp.models.independence.
check_independent`` with all of them (``fedudp.build.probe_model`` and
``fedudp.flower.fast.TorchTraining`` call it before any work).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn as nn

from fedudp.models.independence import NORM, Kernel, check_independent
from fedudp.models.validate import example_batch
from fedudp.owner import ghost, one_step, per_sample

__all__ = ["GHOST", "ONE_STEP", "PER_RECORD", "check", "kernels"]

Params = Mapping[str, torch.Tensor]


def _unflatten(
    flat: torch.Tensor, params: Params, names: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    out, i = {}, 0
    for n in names:
        k = int(params[n].numel())
        out[n] = flat[:, i : i + k].reshape(flat.shape[0], *params[n].shape)
        i += k
    return out


def _per_record(model: nn.Module, names: tuple[str, ...]) -> Kernel:
    def run(params: Params, x: torch.Tensor, y: torch.Tensor) -> Mapping[str, torch.Tensor]:
        return per_sample.per_record_gradients(model, params, x, y, names)

    return run


def _ones(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(n, dtype=np.int64), np.ones(n, dtype=np.int64)


def _one_step(model: nn.Module, names: tuple[str, ...]) -> Kernel:
    def run(params: Params, x: torch.Tensor, y: torch.Tensor) -> Mapping[str, torch.Tensor]:
        starts, sizes = _ones(len(y))
        V = one_step.one_step_vectors(model, params, x, y, starts, sizes, names, 1.0)
        return _unflatten(V, params, names)

    return run


def _ghost(model: nn.Module, names: tuple[str, ...]) -> Kernel:
    def run(params: Params, x: torch.Tensor, y: torch.Tensor) -> Mapping[str, torch.Tensor]:
        R = len(y)
        starts, sizes = _ones(R)
        gg = ghost.ghost_gradients(model, params, x, y, starts, sizes, names, 1.0)
        eye = torch.eye(R, dtype=torch.float64, device=x.device)
        rows = torch.stack([gg.weighted_sum(eye[r]) for r in range(R)])
        return {**_unflatten(rows, params, names), NORM: gg.norms}

    return run


# the kernels' labels (the refusal names the kernel whose gradients differ)
PER_RECORD = "DP-SGD's one-pass kernel (fedudp.owner.per_sample)"
ONE_STEP = "the one-step kernel (fedudp.owner.one_step; the Flower fast path's)"
GHOST = "the ghost-clipping kernel (fedudp.owner.ghost)"


def kernels(model: nn.Module) -> dict[str, Kernel]:
    """Every batched per-record kernel a configuration can take on ``model`` (module doc).

    Parameters
    ----------
    model : nn.Module
        The model.

    Returns
    -------
    dict of str to Kernel
        Label (``PER_RECORD``, ``ONE_STEP``, ``GHOST``) -> the kernel, run on the parameters
        it covers; a kernel that covers none is left out.
    """
    every = tuple(n for n, _ in model.named_parameters())
    fast = tuple(n for n in every if per_sample.supported(model, (n,)))
    gh = tuple(n for n in every if ghost.supported(model, (n,)))
    out: dict[str, Kernel] = {}
    if fast:
        out[PER_RECORD] = _per_record(model, fast)
        out[ONE_STEP] = _one_step(model, fast)
    if gh:
        out[GHOST] = _ghost(model, gh)
    return out


def check(
    model: nn.Module, input_shape: Sequence[int], classes: int | None = None, tokens: bool = False
) -> None:
    """``fedudp.models.independence.check_independent`` with every kernel of ``kernels``.

    Parameters
    ----------
    model : nn.Module
        The model.
    input_shape : Sequence of int
        One record's declared shape.
    classes : int or None
        The declared classes; None (an app's model with no declaration, the Flower fast
        path): the width of the model's output on a public example record.
    tokens : bool
        Records are token ids.

    Raises
    ------
    ValueError
        One line naming the module that mixes records.
    """
    if classes is None:
        p = next(model.parameters(), None)
        if p is None:
            return
        x, _ = example_batch(input_shape, 1, tokens, p.dtype, records=1)
        state = {
            n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]
        }
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # the model's state untouched
            out = torch.func.functional_call(model, state, (x.to(p.device),))
        classes = int(out.shape[-1]) if isinstance(out, torch.Tensor) and out.dim() else 1
    check_independent(model, input_shape, classes, tokens, kernels(model))
