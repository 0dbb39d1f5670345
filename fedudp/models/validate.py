"""Refuse, before any work, model layers that break per-user privacy or per-record gradients
(in the style of Opacus's ``ModuleValidator``), and say which path computes per-record gradients.

``check_model(model)`` raises a one-line ``ValueError`` naming the first offending layer by its
qualified name and type (``body.1 (BatchNorm2d)``) and the usual replacement. Refused:

* a model without parameters, or with lazy (uninitialised) parameters;
* ``BatchNorm1d/2d/3d``, ``SyncBatchNorm`` (and their lazy forms): a record's output depends on
  the other records of its batch, so one user's records influence another's gradients (no
  per-record sensitivity), and the running statistics are state learned from the data outside
  the parameters (released without noise). Replacement: ``nn.GroupNorm`` or ``nn.LayerNorm``;
* ``InstanceNorm1d/2d/3d`` with ``track_running_stats=True``: per-record normalisation is fine,
  the running statistics are not (same reason). Replacement: ``track_running_stats=False`` (the
  default) or ``nn.GroupNorm``;
* ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU``: ``aten::rnn_tanh / lstm / gru`` have no ``vmap``
  batching rule (torch 2.13), so per-unit training and evaluation fail. Replacement: a cell
  written from ``nn.Linear`` layers (``fedudp.models.char_rnn.GRULayer``);
* ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``max_norm``: renormalises its weight in place
  during forward (a parameter changed outside the gradient step). Replacement: ``max_norm=None``;
* spectral normalisation (``torch.nn.utils.spectral_norm`` or
  ``torch.nn.utils.parametrizations.spectral_norm``): its power-iteration vectors are buffers
  updated in place by every training forward. Replacement: remove it (or weight decay);
* generic rule, any other module: a buffer whose name marks running state, i.e. whose own name
  starts with ``running_``, ``moving_`` or ``ema_``, ends with ``_ema``, or is
  ``num_batches_tracked``. Every other buffer (a fixed mask, a positional table, normalisation
  constants; any dtype) is accepted as a constant: ``functional_call`` passes only parameters,
  so a buffer is one read-only tensor shared by every user and owner, never trained or released.
  A buffer updated under another name is caught by ``check_model(model, example=x)``: one
  forward on the caller's example batch (no gradient), refusing any buffer or parameter the
  forward changed in place or replaced (PyTorch's tensor version counters).

``nn.Dropout`` (and every random layer) is refused: the owner computation runs under
``torch.func.vmap`` with every random stream keyed by the run's public randomness
(``fedudp.randomness``), and a dropout mask drawn from torch's global generator inside a
vmapped forward would be neither keyed nor reproducible; remove it (or set p=0).

Per-record gradients (DP-SGD): ``fast_per_record(model, names)`` says whether every parameter in
``names`` sits in a layer the one-pass batched path (``fedudp.core.per_sample``) handles;
otherwise ``torch.func.vmap(grad(...))`` computes them, one record as a batch of one:

    =========================================  ==================================
    layer owning the parameter                 per-record gradient path
    =========================================  ==================================
    nn.Linear                                  fast (one batched backward)
    nn.Conv2d, groups = 1, zero padding,       fast (one grouped convolution)
    numeric (not "same"/"valid") padding
    nn.Conv2d grouped / other padding modes    vmap
    nn.Conv1d, nn.Conv3d, ConvTranspose*       vmap
    nn.Embedding                               vmap
    GRU layer (fedudp.models.char_rnn):
      ``ih``, an nn.Linear applied once to     fast
      the whole sequence
      ``hh``, a RecurrentLinear (an nn.Linear  vmap (the fast path needs each layer
      subclass) applied at every step          applied once per forward)
    subclasses of nn.Linear / nn.Conv2d        vmap (the type must be exact)
    nn.LayerNorm, nn.GroupNorm, affine         vmap
    InstanceNorm
    any parameter held directly by a custom    vmap
    module (e.g. SharedPersonalLogistic's
    ``personal.bias``: it is personal, so the
    fast path only needs the shared names)
    =========================================  ==================================

Only the parameters named matter: joint_dp's DP-SGD differentiates the shared parameters, so a
model qualifies when its shared layers do (the linear model's shared ``nn.Linear``). The rule is
by type alone: an exact ``nn.Linear`` applied more than once per forward (a hand-written
recurrence, a block reused) qualifies, and ``per_sample`` then raises "called twice" when it
runs; give such a layer its own subclass (as ``RecurrentLinear`` does).
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

RUNNING_STATE = re.compile(r"^(running_|moving_|ema_)|_ema$|^num_batches_tracked$")


def _where(name: str, mod: nn.Module) -> str:
    return f"{name or '<model>'} ({type(mod).__name__})"


def _spectral(mod: nn.Module) -> bool:
    from torch.nn.utils.spectral_norm import SpectralNorm
    if any(isinstance(h, SpectralNorm) for h in mod._forward_pre_hooks.values()):
        return True
    return type(mod).__name__ == "_SpectralNorm"        # the parametrizations form's module


def _layer_problem(mod: nn.Module) -> str | None:
    """Why ``mod`` itself (not its children) is refused, with the replacement; None if fine."""
    if isinstance(mod, _BatchNorm):       # BatchNorm1d/2d/3d, SyncBatchNorm, LazyBatchNorm*
        return ("mixes the records of a batch (one record's output depends on the others) and "
                "keeps running statistics learned from the data outside the parameters, so "
                "neither per-record gradients nor per-user privacy hold; replace it with "
                "nn.GroupNorm or nn.LayerNorm")
    if isinstance(mod, _InstanceNorm) and mod.track_running_stats:
        return ("keeps running statistics (track_running_stats=True), state learned from the data "
                "outside the parameters and released without noise; use "
                "track_running_stats=False (the default) or nn.GroupNorm")
    if isinstance(mod, nn.modules.dropout._DropoutNd) and mod.p > 0:
        return ("draws random masks from torch's global generator inside the vmapped owner "
                "computation, outside fedudp's keyed randomness (neither reproducible nor the "
                "same on both engines); remove it or set p=0")
    if isinstance(mod, nn.RNNBase):
        return ("has no torch.func.vmap batching rule, so per-user training and evaluation fail; "
                "write the cell from nn.Linear layers (fedudp.models.char_rnn.GRULayer is a GRU)")
    if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.max_norm is not None:
        return ("renormalises its weight in place during forward (max_norm), changing a parameter "
                "outside the gradient step; use max_norm=None")
    if _spectral(mod):
        return ("is spectral-normalised: its power-iteration vectors are buffers updated in place "
                "by every training forward; remove the spectral normalisation")
    for bname, _ in mod.named_buffers(recurse=False):
        if RUNNING_STATE.search(bname):
            return (f"has buffer {bname!r}, running state updated from the data outside the "
                    "parameters (released without noise); compute it from parameters instead "
                    "(e.g. nn.GroupNorm or nn.LayerNorm for normalisation statistics)")
    return None


def check_model(model: nn.Module, example: torch.Tensor | None = None) -> None:
    """Refuse (one-line ``ValueError``) a model whose layers break per-record gradients or
    per-user privacy (the module docstring's list), naming the layer and its replacement.
    ``example``: a batch of inputs; also run one forward on it (no gradient, the model's mode)
    and refuse any buffer or parameter it changed."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"a model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.named_parameters())
    if not params:
        raise ValueError(f"model {type(model).__name__} has no parameters; nothing to train")
    for name, p in params:
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise ValueError(f"parameter {name} of {type(model).__name__} is uninitialised (a lazy "
                             "layer); give the layer its input size (e.g. nn.Linear, not nn.LazyLinear)")
    for name, mod in model.named_modules():
        why = _layer_problem(mod)
        if why:
            raise ValueError(f"model layer {_where(name, mod)} {why}")
    if example is not None:
        _probe(model, example)


def _state(model: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """Every buffer and parameter with its version counter (the tensor itself is kept, so a
    replaced one is told apart by identity)."""
    out = {}
    for kind, items in (("buffer", model.named_buffers()), ("parameter", model.named_parameters())):
        for n, t in items:
            out[f"{kind} {n}"] = (t, t._version)
    return out


def _probe(model: nn.Module, example: torch.Tensor) -> None:
    before = _state(model)
    with torch.no_grad():
        model(example)
    after = _state(model)
    for key, (t, version) in before.items():
        now = after.get(key)
        if now is None or now[0] is not t or now[1] != version:
            kind, _, n = key.partition(" ")
            owner = n.rpartition(".")[0]
            mod = model.get_submodule(owner)
            raise ValueError(f"model layer {_where(owner, mod)} changed its {kind} {n!r} during "
                             "forward: state updated from the data outside the gradient step; "
                             "keep layer state in parameters (e.g. nn.GroupNorm, not running "
                             "statistics)")


def fast_per_record(model: nn.Module, names: Iterable[str] | None = None) -> bool:
    """Whether DP-SGD's one-pass per-record gradients (``fedudp.core.per_sample``) cover the
    parameters ``names`` (all of the model's when None): each sits in a module that is exactly
    an ``nn.Linear``, or an ``nn.Conv2d`` with groups = 1, zero padding and numeric padding.
    False means the vmap path. ``fedudp.core.per_sample.supported`` applies this rule (core
    sits above models)."""
    owners = {name: mod for name, mod in model.named_modules()
              if any(True for _ in mod.parameters(recurse=False))}
    names = tuple(n for n, _ in model.named_parameters()) if names is None else tuple(names)
    for n in names:
        mod = owners.get(n.rpartition(".")[0])
        if mod is None or type(mod) not in (nn.Linear, nn.Conv2d):
            return False
        if isinstance(mod, nn.Conv2d) and (mod.groups != 1 or mod.padding_mode != "zeros"
                                           or isinstance(mod.padding, str)):
            return False
    return True
