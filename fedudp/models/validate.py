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
* ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` and the cells ``nn.RNNCell`` / ``nn.LSTMCell`` /
  ``nn.GRUCell``: ``aten::rnn_tanh / lstm / gru`` and ``aten::*_cell`` have no ``vmap``
  batching rule (torch 2.13: the LSTM cell's forward fails, the GRU and RNN cells' per-record
  gradients do), so per-unit training and evaluation fail. Replacement: a recurrence written
  from ``nn.Linear`` layers (``fedudp.models.char_rnn.GRULayer``);
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

``probe(model, input_shape, classes, tokens)``: before any data is read, one forward on an
example batch made from the declared input shape (random features, or token id 0) checks that the
output is ``[batch, classes]`` (one logit per declared class: 7 outputs for 4 classes ran
silently, 3 ended in cross-entropy's IndexError), then each record's gradient through
``torch.func.vmap(grad(...))`` on that batch (the path every owner computation takes), naming
the layer that fails there (an ``autograd.Function`` without a vmap rule, an operation without a
batching rule) and what to use instead. ``fedudp.build.prepare`` runs it once per run, with
the one-pass kernel of ``fedudp.owner.per_sample`` on it where the model qualifies for it.

Per-record independence (a record's output and gradient depend on that record alone, which
every batched kernel assumes) is checked by ``fedudp.models.independence``, with the owners'
kernels (``fedudp.owner.independence``), right after ``probe``.

Per-record gradients (DP-SGD): ``fast_per_record(model, names)`` says whether every parameter in
``names`` sits in a layer the one-pass batched path (``fedudp.owner.per_sample``) handles;
otherwise ``torch.func.vmap(grad(...))`` computes them, one record as a batch of one:

    =========================================  ==================================
    layer owning the parameter                 per-record gradient path
    =========================================  ==================================
    nn.Linear                                  fast (one batched backward)
    nn.Conv2d, groups = 1, zero padding,       fast (records as conv groups)
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
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

__all__ = [
    "check_model",
    "fast_per_record",
    "PROBE_BATCH",
    "example_batch",
    "probe",
]

_RUNNING_STATE = re.compile(r"^(running_|moving_|ema_)|_ema$|^num_batches_tracked$")


def _where(name: str, mod: nn.Module) -> str:
    return f"{name or '<model>'} ({type(mod).__name__})"


def _spectral(mod: nn.Module) -> bool:
    from torch.nn.utils.spectral_norm import SpectralNorm

    if any(isinstance(h, SpectralNorm) for h in mod._forward_pre_hooks.values()):
        return True
    return type(mod).__name__ == "_SpectralNorm"  # the parametrizations form's module


def _layer_problem(mod: nn.Module) -> str | None:
    """Why ``mod`` itself (not its children) is refused, with the replacement; None if fine."""
    if isinstance(mod, _BatchNorm):  # BatchNorm1d/2d/3d, SyncBatchNorm, LazyBatchNorm*
        return (
            "mixes the records of a batch (one record's output depends on the others) and "
            "keeps running statistics learned from the data outside the parameters, so "
            "neither per-record gradients nor per-user privacy hold; replace it with "
            "nn.GroupNorm or nn.LayerNorm"
        )
    if isinstance(mod, _InstanceNorm) and mod.track_running_stats:
        return (
            "keeps running statistics (track_running_stats=True), state learned from the data "
            "outside the parameters and released without noise; use "
            "track_running_stats=False (the default) or nn.GroupNorm"
        )
    if isinstance(mod, nn.modules.dropout._DropoutNd) and mod.p > 0:
        return (
            "draws random masks from torch's global generator inside the vmapped owner "
            "computation, outside fedudp's keyed randomness (neither reproducible nor the "
            "same on both engines); remove it or set p=0"
        )
    if isinstance(mod, (nn.RNNBase, nn.RNNCellBase)):
        return (
            "has no torch.func.vmap batching rule (aten::lstm / gru / rnn_tanh and their "
            "*_cell forms), so per-user training and per-record gradients fail; write the "
            "recurrence from nn.Linear layers (fedudp.models.char_rnn.GRULayer is a GRU)"
        )
    if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.max_norm is not None:
        return (
            "renormalises its weight in place during forward (max_norm), changing a parameter "
            "outside the gradient step; use max_norm=None"
        )
    if _spectral(mod):
        return (
            "is spectral-normalised: its power-iteration vectors are buffers updated in place "
            "by every training forward; remove the spectral normalisation"
        )
    for bname, _ in mod.named_buffers(recurse=False):
        if _RUNNING_STATE.search(bname):
            return (
                f"has buffer {bname!r}, running state updated from the data outside the "
                "parameters (released without noise); compute it from parameters instead "
                "(e.g. nn.GroupNorm or nn.LayerNorm for normalisation statistics)"
            )
    return None


def check_model(model: nn.Module, example: torch.Tensor | None = None) -> None:
    """Refuse a model whose layers break per-record gradients or per-user privacy (the module
    docstring's list), naming the layer and its replacement.

    Parameters
    ----------
    model
        The model.
    example
        A batch of inputs: also run one forward on it (no gradient, the model's mode) and refuse
        any buffer or parameter it changed.

    Raises
    ------
    ValueError
        One line naming the offending layer (or the changed buffer) and what to use instead.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"a model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.named_parameters())
    if not params:
        raise ValueError(f"model {type(model).__name__} has no parameters; nothing to train")
    for name, p in params:
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise ValueError(
                f"parameter {name} of {type(model).__name__} is uninitialised (a lazy "
                "layer); give the layer its input size (e.g. nn.Linear, not nn.LazyLinear)"
            )
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
            raise ValueError(
                f"model layer {_where(owner, mod)} changed its {kind} {n!r} during "
                "forward: state updated from the data outside the gradient step; "
                "keep layer state in parameters (e.g. nn.GroupNorm, not running "
                "statistics)"
            )


def fast_per_record(model: nn.Module, names: Iterable[str] | None = None) -> bool:
    """Whether DP-SGD's one-pass per-record gradients (``fedudp.owner.per_sample``) cover the
    parameters ``names``.

    Each must sit in a module that is exactly an ``nn.Linear``, or an ``nn.Conv2d`` with
    groups = 1, zero padding and numeric padding. ``fedudp.owner.per_sample.supported`` applies
    this rule (the owner sits above models).

    Parameters
    ----------
    model
        The model.
    names
        Parameter names (all of the model's when None).

    Returns
    -------
    bool
        True: the one-pass path; False: the vmap path.
    """
    owners = {
        name: mod
        for name, mod in model.named_modules()
        if any(True for _ in mod.parameters(recurse=False))
    }
    names = tuple(n for n, _ in model.named_parameters()) if names is None else tuple(names)
    for n in names:
        mod = owners.get(n.rpartition(".")[0])
        if mod is None or type(mod) not in (nn.Linear, nn.Conv2d):
            return False
        if isinstance(mod, nn.Conv2d) and (
            mod.groups != 1 or mod.padding_mode != "zeros" or isinstance(mod.padding, str)
        ):
            return False
    return True


PROBE_BATCH = 2


def example_batch(
    input_shape: Sequence[int],
    classes: int,
    tokens: bool = False,
    dtype: torch.dtype = torch.float32,
    records: int = PROBE_BATCH,
    vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A public example batch of the declared shape: nothing read from the data.

    Parameters
    ----------
    input_shape
        The shape of one record's features.
    classes
        The labels are in ``[0, classes)``.
    tokens
        Token-id features (int64): id 0, or with ``vocab`` fixed random ids in ``[0, vocab)``.
    dtype
        The dtype of float features (fixed random values).
    records
        The number of records (``PROBE_BATCH`` where the callers do not say).
    vocab
        The vocabulary size for token features.

    Returns
    -------
    tuple of torch.Tensor
        (features, labels).
    """
    shape = (int(records), *(int(s) for s in input_shape))
    gen = torch.Generator().manual_seed(0)
    if tokens and vocab is None:
        x = torch.zeros(shape, dtype=torch.long)
    elif tokens and vocab is not None:
        x = torch.randint(0, max(1, int(vocab)), shape, generator=gen, dtype=torch.long)
    else:
        x = torch.randn(shape, generator=gen).to(dtype)
    return x, torch.arange(int(records)) % max(1, int(classes))


class _Innermost:
    """Which module's forward is running (forward pre-hooks push, forward hooks pop): after an
    exception raised inside a forward, ``where()`` names the innermost layer it came from."""

    def __init__(self, model: nn.Module) -> None:
        self.stack: list[tuple[str, nn.Module]] = []
        self.hooks = []
        for name, mod in model.named_modules():
            self.hooks.append(mod.register_forward_pre_hook(self._enter(name)))
            self.hooks.append(mod.register_forward_hook(self._leave))

    def _enter(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(mod: nn.Module, args: tuple[Any, ...]) -> None:  # None: the input is unchanged
            self.stack.append((name, mod))

        return hook

    def _leave(self, mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:  # output unchanged
        if self.stack:
            self.stack.pop()

    def where(self) -> str | None:
        return _where(*self.stack[-1]) if self.stack else None

    def __enter__(self) -> _Innermost:
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.hooks:
            h.remove()


def _advice(err: BaseException) -> str:
    text = str(err)
    if "autograd.Function" in text:
        return (
            "its torch.autograd.Function has no vmap rule: give it a setup_context "
            "staticmethod and generate_vmap_rule = True (or a vmap staticmethod), or write it "
            "from differentiable torch operations"
        )
    if "Batching rule not implemented" in text or "batching rule" in text:
        return (
            "an operation in it has no torch.func.vmap batching rule; write the layer from "
            "operations that have one (nn.Linear, nn.Conv2d, torch functions)"
        )
    return "every owner computation runs it under torch.func.vmap(grad(...)), one record at a time"


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def probe(
    model: nn.Module,
    input_shape: Sequence[int],
    classes: int,
    tokens: bool = False,
    per_record: bool = True,
) -> None:
    """Refuse a model that does not fit the declared data or the per-record path, before any data
    is read (the module docstring). The model's parameters are not changed.

    Parameters
    ----------
    model
        The model.
    input_shape
        The declared shape of one record's features.
    classes
        The declared number of classes: one forward on ``example_batch`` must give
        ``[batch, classes]``.
    tokens
        The features are token ids (int64) rather than floats.
    per_record
        Also check that each record's gradient through ``torch.func.vmap(grad(...))`` runs
        (False skips it: for a model whose vmap path is tested elsewhere).

    Raises
    ------
    ValueError
        One line saying what does not fit (the output's shape, the forward or the per-record
        gradient that failed).
    """
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap

    dtype = next(model.parameters()).dtype
    x, y = example_batch(input_shape, classes, tokens, dtype)
    shape = list(x.shape)
    with _Innermost(model) as inner:
        try:
            with torch.no_grad():
                out = model(x)
        except Exception as e:  # noqa: BLE001 -- any failure is the user's model
            at = inner.where()
            at = f"model layer {at}" if at else f"model {type(model).__name__}"
            raise ValueError(
                f"{at} fails on an example batch of shape {shape} (the declared "
                f"input shape {list(input_shape)}): {_first_line(e)}"
            ) from None
    want = [PROBE_BATCH, int(classes)]
    if not isinstance(out, torch.Tensor) or list(out.shape) != want:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"model output is {got} for a batch of {PROBE_BATCH} records; it must be "
            f"{want}: one logit per declared class (dataset.classes={int(classes)})"
        )
    if not per_record:
        return
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    with _Innermost(model) as inner:
        try:
            vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
        except Exception as e:  # noqa: BLE001
            at = inner.where()
            at = f"model layer {at}" if at else f"model {type(model).__name__}"
            raise ValueError(
                f"{at} fails in the per-record gradient path "
                f"(torch.func.vmap(grad(...))): {_first_line(e)}; "
                f"{_advice(e)}"
            ) from None
