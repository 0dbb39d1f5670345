"""Per-record gradients from one batched forward/backward (the DP-SGD owners' hot loop).

``torch.func.vmap(grad(loss))`` computes each record's gradient as a batch of one: on the CPU
every convolution's weight gradient then runs per record (a grouped convolution), well above
the cost of a plain minibatch step. Here, for models whose parameters all sit in ``nn.Linear``
and ``nn.Conv2d`` modules (groups = 1; the paper CNN, the linear model), the forward and the
backward run batched as in plain SGD, forward hooks keep each layer's input and output, one
``autograd.grad`` of the summed loss gives every layer's output gradient, and each record's
parameter gradients follow exactly (Goodfellow 2015; Rochette et al. 2019 for convolutions):

    Linear:  dW_b = g_b^T a_b (summed over any middle dims),  db_b = Σ g_b
    Conv2d:  dW_b[o, c, i, j] = Σ_{h,w} g_b[o, h, w] · pad(a_b)[c, s·h + d·i, s·w + d·j],
             db_b = Σ_{h,w} g_b

A Conv2d's per-record weight gradients come from aten's weight-only convolution backward (the
kernel autograd runs for the batched step), with the records as groups: ``BLOCK`` records'
inputs reshaped to one image of ``BLOCK·C_in`` channels, their output gradients to one of
``BLOCK·C_out``, and ``groups = BLOCK``, so group ``b`` is record ``b``'s own weight gradient.
Stride, padding and dilation are the layer's own. On the CPU it is faster than a grouped
convolution with each record's output gradient as the kernel (Rochette et al. 2019) from 8
input channels on; blocks of 32 records keep a block's operands in cache. Below 8 input
channels (a first layer on images) that grouped convolution is the faster one, and it is what
runs there (``KERNELS_BELOW``), block by block. Measured costs: docs/benchmarks.md
("The owner side's kernels").

On the CPU, every shared convolution's output can be taken on in channels-last memory format
(``channels_last``, the owner side's ``Kernels.channels_last``): the same values, and the
layers after it (ReLU, max-pooling, the next convolution) run on channels-last activations,
where PyTorch's CPU max-pooling is vectorized (over NCHW it is several times slower). Only the
per-record passes here do it, never the model itself, and only where ``channels_last_ok``
found, once per model and record shape, that the model's forward takes it with the same output
on a public example batch (a ``view`` of a convolution's output, for one, does not): otherwise
the model's own layout is kept.

The loss of a record is its own cross-entropy, so the summed loss's per-layer output gradients
are the records' own. ``supported(model, names)`` says whether a model qualifies; callers fall
back to ``vmap`` otherwise. Tests compare both on the CNN and the linear model in float64.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from fedudp.models.cnn import channels_last as to_channels_last
from fedudp.models.validate import fast_per_record

__all__ = [
    "BLOCK",
    "KERNELS_BELOW",
    "channels_last_ok",
    "conv2d_weight_blocks",
    "conv2d_weight_per_record",
    "conv_weight_grad",
    "per_record_gradients",
    "supported",
    "weighted_layer_grads",
]

# records per grouped weight-gradient call (module doc)
BLOCK = 32
# below this many input channels, the grouped convolution with the output gradients as kernels
# (module doc)
KERNELS_BELOW = 8
# model -> {(shared conv paths, record shape, dtype, parameter dtypes, modes): the probe's answer}
_CL_OK: weakref.WeakKeyDictionary[nn.Module, dict[tuple, bool]] = weakref.WeakKeyDictionary()


def _owner_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Module path -> module, for the modules that own parameters directly."""
    return {
        name: mod
        for name, mod in model.named_modules()
        if any(True for _ in mod.parameters(recurse=False))
    }


def _join(path: str, leaf: str) -> str:
    return f"{path}.{leaf}" if path else leaf


def supported(model: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether the per-record passes here cover the parameters ``names`` of ``model``.

    Parameters
    ----------
    model : nn.Module
        The model (its structure only is read).
    names : tuple of str
        Parameter names.

    Returns
    -------
    bool
        Every module owning one of ``names`` is a Linear, or a Conv2d with groups = 1 (the rule
        is the models layer's, ``fedudp.models.validate.fast_per_record``, where it is
        documented).
    """
    return fast_per_record(model, names)


def per_record_gradients(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    names: tuple[str, ...],
    channels_last: bool = True,
) -> dict[str, torch.Tensor]:
    """Each record's gradient of its cross-entropy, from one batched forward/backward.

    Parameters
    ----------
    model : nn.Module
        A model with ``supported(model, names)``.
    params : Mapping of str to Tensor
        All the model's parameters, unbatched.
    x, y : Tensor
        The records and their labels.
    names : tuple of str
        The parameters to differentiate.
    channels_last : bool
        ``Kernels.channels_last`` (``weighted_layer_grads``).

    Returns
    -------
    dict of str to Tensor
        ``{name: [R, *shape]}`` for each of ``names``.
    """
    # unit weights: the summed cross-entropy, each output gradient one record's
    w = torch.ones(len(y), dtype=params[names[0]].dtype, device=params[names[0]].device)
    order, mods, inputs, gouts = weighted_layer_grads(
        model, params, x, y, names, w, "per_record_gradients", channels_last
    )
    grads: dict[str, torch.Tensor] = {}
    for path, a, g in zip(order, inputs, gouts):
        mod = mods[path]
        R = g.shape[0]
        if isinstance(mod, nn.Linear):
            g3, a3 = g.reshape(R, -1, g.shape[-1]), a.reshape(R, -1, a.shape[-1])
            grads[_join(path, "weight")] = torch.bmm(g3.transpose(1, 2), a3)
            grads[_join(path, "bias")] = g3.sum(1)
        else:
            assert isinstance(mod, nn.Conv2d)  # supported(): Linear or Conv2d layers only
            grads[_join(path, "weight")] = conv2d_weight_per_record(a, g, mod)
            grads[_join(path, "bias")] = g.sum((2, 3))
    return {n: grads[n] for n in names}


def weighted_layer_grads(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    names: tuple[str, ...],
    w: torch.Tensor,
    who: str,
    channels_last: bool = True,
) -> tuple[list[str], dict[str, nn.Module], list[torch.Tensor], list[torch.Tensor]]:
    """One batched forward/backward of ``Σ_r w_r ℓ_r`` (each record's cross-entropy times its
    weight) at ``params``. The owners' one-step and ghost paths share it.

    Parameters
    ----------
    model : nn.Module
        The model; every module owning one of ``names`` is hooked.
    params : Mapping of str to Tensor
        All the model's parameters, unbatched.
    x, y : Tensor
        The records and their labels.
    names : tuple of str
        The parameters whose layers' inputs and output gradients are kept.
    w : Tensor
        [R] each record's loss weight.
    who : str
        The caller's name, for the error.
    channels_last : bool
        ``Kernels.channels_last``: on the CPU, take the shared convolutions' outputs in
        channels-last memory format where ``channels_last_ok`` says the model's forward gives
        the same output that way (module doc). False: the model's own layout.

    Returns
    -------
    tuple
        (the module paths owning ``names``, sorted; path -> module; each path's input ``a``;
        each path's output gradient ``g``, detached).

    Raises
    ------
    NotImplementedError
        A layer called twice per forward (its output gradient would not be one record's).
    """
    mods = _owner_modules(model)
    paths = sorted({n.rpartition(".")[0] for n in names})
    convs = {p for p in paths if isinstance(mods[p], nn.Conv2d)}
    on = channels_last and bool(convs) and x.device.type == "cpu"
    if not (on and channels_last_ok(model, params, sorted(convs), tuple(x.shape[1:]), x.dtype)):
        convs = set()
    saved: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for path in paths:

        def hook(mod, inp, out, path=path):
            if path in saved:
                raise NotImplementedError(f"{who}: {path} is called twice")
            if path in convs:  # the same values (module doc)
                out = to_channels_last(out)
            saved[path] = (inp[0].detach(), out)
            return out

        hooks.append(mods[path].register_forward_hook(hook))
    try:
        with torch.enable_grad():
            at = {
                k: v.detach().requires_grad_(True) if k in names else v.detach()
                for k, v in params.items()
            }
            out = functional_call(model, at, (x,))
            loss = (F.cross_entropy(out, y, reduction="none") * w).sum()
            gouts = torch.autograd.grad(loss, [saved[p][1] for p in paths])
    finally:
        for h in hooks:
            h.remove()
    return paths, mods, [saved[p][0] for p in paths], [g.detach() for g in gouts]


def channels_last_ok(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    convs: Sequence[str],
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> bool:
    """Whether ``model``'s forward takes its convolutions' outputs in channels-last format.

    Tried on a public example batch of two records of ``shape`` and ``dtype`` (a fixed-seed
    normal draw; zeros for integer records), never data: once per model, paths, record shape
    and dtype, parameter dtypes and modules' modes (remembered). The model runs in its own mode
    (a branch on ``self.training`` is tried as the pass will take it), without gradients, both
    forwards from the same seed of a forked RNG (the global one is left as it was), its buffers
    restored afterwards (batch-norm statistics).

    Parameters
    ----------
    model : nn.Module
        The model.
    params : Mapping of str to Tensor
        All its parameters, unbatched.
    convs : Sequence of str
        Module paths of the convolutions whose outputs are converted.
    shape : tuple of int
        One record's shape.
    dtype : torch.dtype
        The records' dtype.

    Returns
    -------
    bool
        The forward returns the same output with the outputs of ``convs`` in channels-last
        memory format. An exception from either forward means False, and so does a difference
        (a dropout mask drawn over channels-last memory differs: kept off, conservatively).
    """
    modes = tuple(m.training for m in model.modules())
    dtypes = tuple(sorted({str(v.dtype) for v in params.values()}))
    key = (tuple(convs), shape, dtype, dtypes, modes)
    memo = _CL_OK.setdefault(model, {})
    if key in memo:
        return memo[key]
    at = {k: v.detach() for k, v in params.items()}
    mods = _owner_modules(model)
    if dtype.is_floating_point:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(2, *shape, generator=gen, dtype=torch.float64).to(dtype)
    else:
        x = torch.zeros(2, *shape, dtype=dtype)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    hooks = []
    memo[key] = False
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            try:
                torch.manual_seed(0)  # the same dropout draws on both sides
                ref = functional_call(model, at, (x,))
                for p in convs:
                    hooks.append(mods[p].register_forward_hook(lambda m, i, o: to_channels_last(o)))
                torch.manual_seed(0)
                out = functional_call(model, at, (x,))
            except Exception:  # noqa: BLE001 - the model's own code: a layout it does not take
                return False
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():  # a batch-norm layer in training mode updated its statistics
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
    if not (isinstance(ref, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    if ref.shape != out.shape or ref.dtype != out.dtype:
        return False
    tol = 1e-4 if ref.dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-9
    scale = float(ref.abs().max().clamp(min=1))
    memo[key] = bool(torch.allclose(out, ref, rtol=tol, atol=tol * scale))
    return memo[key]


def conv2d_weight_per_record(
    a: torch.Tensor, g: torch.Tensor, mod: nn.Conv2d, block: int | None = None
) -> torch.Tensor:
    """Each record's gradient of a convolution's weight (``conv2d_weight_blocks``, joined).

    Parameters
    ----------
    a : Tensor
        [R, C_in, H, W] the records' inputs to ``mod``.
    g : Tensor
        [R, C_out, H_o, W_o] their output gradients.
    mod : nn.Conv2d
        The convolution (groups = 1, zero padding).
    block : int or None
        Records per grouped call (``BLOCK`` unless told).

    Returns
    -------
    Tensor
        [R, C_out, C_in, kh, kw].
    """
    blocks = list(conv2d_weight_blocks(a, g, mod, block))
    if not blocks:  # no records
        return g.new_empty(0, g.shape[1], *mod.weight.shape[1:])
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def conv2d_weight_blocks(
    a: torch.Tensor, g: torch.Tensor, mod: nn.Conv2d, block: int | None = None
) -> Iterator[torch.Tensor]:
    """The records' weight gradients of ``conv2d_weight_per_record``, a block at a time.

    aten's weight-only convolution backward with the block's records as the groups of one
    batch-of-one convolution (module docstring).

    Parameters
    ----------
    a, g, mod
        As in ``conv2d_weight_per_record``.
    block : int or None
        Records per block (``BLOCK`` unless told).

    Yields
    ------
    Tensor
        [n, C_out, C_in, kh, kw] per block, in record order.
    """
    R, c_in, c_out = a.shape[0], a.shape[1], g.shape[1]
    kshape = tuple(mod.weight.shape[1:])
    b = max(1, min(BLOCK if block is None else block, R))
    if c_in < KERNELS_BELOW:
        for s in range(0, R, b):
            yield _output_gradients_as_kernels(a[s : s + b], g[s : s + b], mod)
        return
    # the grouped weight's shape, dtype and layout enter the kernel; its values do not
    w = torch.empty(b * c_out, *kshape, dtype=g.dtype, device=g.device)
    for s in range(0, R, b):
        n = min(b, R - s)
        yield conv_weight_grad(
            g[s : s + n].reshape(1, n * c_out, *g.shape[2:]),
            a[s : s + n].reshape(1, n * c_in, *a.shape[2:]),
            w[: n * c_out],
            mod,
            n,
        ).reshape(n, c_out, *kshape)


def conv_weight_grad(
    g: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, mod: nn.Conv2d, groups: int
) -> torch.Tensor:
    """The weight gradient of a convolution, summed over a batch (aten's weight-only backward).

    Parameters
    ----------
    g : Tensor
        The batch's output gradients.
    a : Tensor
        The batch's inputs.
    weight : Tensor
        A tensor of the weight's shape, dtype and layout (its values do not enter a weight
        gradient).
    mod : nn.Conv2d
        Its stride, padding and dilation are used.
    groups : int
        The convolution's groups.

    Returns
    -------
    Tensor
        The weight gradient, the kernel autograd runs.
    """
    return torch.ops.aten.convolution_backward(
        g,
        a,
        weight,
        None,
        mod.stride,
        mod.padding,
        mod.dilation,
        False,
        (0, 0),
        groups,
        (False, True, False),
    )[1]


def _output_gradients_as_kernels(a: torch.Tensor, g: torch.Tensor, mod: nn.Conv2d) -> torch.Tensor:
    """[R, C_out, C_in, kh, kw]: the records' weight gradients as one grouped convolution of the
    padded inputs, records as channels ([C_in, R, H_p, W_p]), with each record's output gradient
    as the kernel ([R·C_out, 1, H_o, W_o], dilated by the layer's stride, strided by its
    dilation), R groups (Rochette et al. 2019); faster than the records-as-groups backward for
    inputs of few channels (module doc)."""
    R, c_in = a.shape[0], a.shape[1]
    c_out, kh, kw = mod.weight.shape[0], mod.weight.shape[2], mod.weight.shape[3]
    ph, pw = cast(tuple[int, int], mod.padding)  # fast_per_record(): numeric padding
    inp = F.pad(a, (pw, pw, ph, ph)).transpose(0, 1)
    ker = g.reshape(R * c_out, 1, g.shape[2], g.shape[3])
    out = F.conv2d(inp, ker, stride=mod.dilation, dilation=mod.stride, groups=R)
    out = out[:, :, :kh, :kw]  # a stride that does not divide: extra taps
    return out.reshape(c_in, R, c_out, kh, kw).permute(1, 2, 0, 3, 4)
