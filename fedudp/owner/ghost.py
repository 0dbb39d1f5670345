"""Per-user clipping without per-user gradients ("ghost" norms and book-keeping; Goodfellow
2015, Li et al. 2022, Bu et al. 2023), for users whose contribution is one gradient.

A user u's vector is v_u = Σ_{r∈u} (s / k_u) ∇ℓ_r(θ) (s = -lr for a one-step delta, 1 for the
mean gradient; k_u its record count). The users of a chunk share one batched forward/backward of
Σ_r (s / k_{u(r)}) ℓ_r with hooks keeping every shared layer's input a_r and output gradient g_r
(records are independent, as in ``fedudp.owner.per_sample``), so g_r is record r's own share of
its user's vector. From them, per layer and without building any user's full vector:

* the user's squared gradient norm, accumulated over the layers in **float64** (the a's and g's
  are cast to float64 first: products of float32 values are exact there);
* the clipped sum Σ_u f_u v_u (f_u the clip factor) as one weight-gradient product per layer with
  the output gradients reweighted g_r -> f_{u(r)} g_r: the output gradients are linear in each
  record's loss weight, so this *is* the backward pass with per-record loss weights
  w_r = (s / k_u) f_u, without running the network backward a second time (book-keeping).

Per layer kind (positions p: a Linear's middle dims, a convolution's output pixels):

=========================  ==========================================================================
Linear (any middle dims)   W: ||Σ_{r,p} g_rp a_rpᵀ||² = Σ_{(r,p),(r',p')∈u} (g_rp·g_r'p')(a_rp·a_r'p')
                           (the user's Gram matrices, "ghost"), or the user's W_u materialized
                           (one batched matmul), whichever costs fewer multiply-adds; b: Σ g.
Conv2d (groups = 1)        W: the same identity on the unfolded input (F.unfold: each output
                           pixel's receptive field), or W_u materialized (``per_sample``'s
                           records-as-groups weight gradient in blocks, each block's norms taken
                           at once / one weight-gradient kernel per user); b: Σ_{r,p} g_rp.
Embedding                  W: the user's gradient rows Σ g over its positions holding token t,
                           one row per (user, token) present (the indicator cross term [t = t']
                           of the Gram form); ``padding_idx`` positions give nothing.
LayerNorm, GroupNorm,      W, b: each record's gradient (x̂ ⊙ g and g summed over positions, x̂ the
BatchNorm (eval only)      normalized input recomputed from a) materialized: they are small.
=========================  ==========================================================================

Both forms of a layer are exact; which one runs follows only the layer's shape and the
chunk's largest user (its cost), and changes nothing but float rounding. A BatchNorm in
training mode (its statistics mix the records of a batch), a convolution with groups, a
non-zero padding mode or string padding, an ``Embedding`` with ``max_norm`` or
``scale_grad_by_freq``, any other module owning a shared parameter, or a layer applied twice is
not supported: ``supported`` says False and the owners keep today's path (``fedudp.owner.
one_step``: every user's vector built, clipped with float64 norms and summed), or raise
``NotImplementedError`` where only the forward shows it (a layer called twice).

Semantics (``clipped_sum``) are those of ``make_reply`` on the users' vectors: a user whose
float64 squared norm is not finite is dropped and counted as failed (a NaN or inf among the
entries of its records' inputs and output gradients that enter its gradient reaches that sum:
no product of float32 values overflows float64, and inf * 0 is NaN); the others' float64 norms
decide the clip factor exactly as ``mechanisms.clip_factors`` (clip / ||v_u|| shrunk by 4 ulps,
1 within the clip); the count is the kept users, ``clipped`` those clipped.

Floating point. The float64 norm is the norm of the exact user gradient Σ g_r a_rᵀ of the
float32 a's and g's (rounding only in float64 sums). Today's path measures the float32 vector
it has built, so the clipped row it adds is within the clip in float32 too; here the clipped
contribution is formed inside the float32 weight-gradient product, whose rounding (relative
2^-24 per product and addition) is the kind the float32 sum of clipped rows has on today's
path. Two differences, stated: a user whose float32 vector would overflow to inf while its
float64 norm is finite is dropped on today's path and clipped here; and where a user's records'
gradients cancel (Σ_r ||g_r a_rᵀ|| much larger than ||v_u||), the float32 rounding of that
user's share is relative to the terms, not to ||v_u||. Users of one record without positions
(an MLP, one record per user) have no sum inside a user: each entry of f_u g_u a_uᵀ is one
rounded product, as tight as today's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import torch.nn as nn

from fedudp.owner import per_sample
from fedudp.owner.ghost_norms import Chunk, SavedLayer, add_squared_norms, costs, param_names
from fedudp.privacy.mechanisms import finite_clip_factors
from fedudp.protocol.contributions import Constraint, Contribution

__all__ = [
    "GhostGradients",
    "clipped_sum",
    "ghost_gradients",
    "gram_share",
    "layer_supported",
    "supported",
]


def _owner_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {
        name: mod
        for name, mod in model.named_modules()
        if any(True for _ in mod.parameters(recurse=False))
    }


def layer_supported(mod: nn.Module) -> bool:
    """Whether the ghost path covers this module's own parameters (module doc's table).

    Parameters
    ----------
    mod : nn.Module
        A module owning parameters directly.

    Returns
    -------
    bool
        Its kind and settings are covered (a BatchNorm only in eval mode).
    """
    t = type(mod)
    if t is nn.Linear:
        return True
    if t is nn.Conv2d:
        c = cast(nn.Conv2d, mod)
        return c.groups == 1 and c.padding_mode == "zeros" and not isinstance(c.padding, str)
    if t is nn.Embedding:
        e = cast(nn.Embedding, mod)
        return e.max_norm is None and not e.scale_grad_by_freq
    if t in (nn.LayerNorm, nn.GroupNorm):
        return True
    if t in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
        # training mode: the batch statistics couple the records (not independent)
        b = cast(nn.modules.batchnorm._BatchNorm, mod)
        return (not b.training) and b.running_mean is not None and b.running_var is not None
    return False


def supported(model: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether the ghost path covers the parameters ``names`` of ``model``.

    Parameters
    ----------
    model : nn.Module
        The model; only its structure and mode are read (public), never data.
    names : tuple of str
        Parameter names.

    Returns
    -------
    bool
        Every module owning one of ``names`` is of a kind the ghost path covers (module doc),
        and no BatchNorm of the model is in training mode.
    """
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules()):
        return False  # batch statistics couple the records, shared layer or not
    mods = _owner_modules(model)
    for n in names:
        mod = mods.get(n.rpartition(".")[0])
        if mod is None or not layer_supported(mod):
            return False
    return True


def gram_share(
    model: nn.Module,
    input_shape: tuple[int, ...],
    dtype: torch.dtype,
    names: tuple[str, ...],
    k: int,
) -> float:
    """The share of ``names`` whose weight norm takes the Gram form for users of ``k`` records.

    Read from the model's shapes only: the output positions of each layer come from one
    forward of a zero record of the declared ``input_shape`` (no data); the global RNG is left
    as it was.

    Parameters
    ----------
    model : nn.Module
        The model.
    input_shape : tuple of int
        One record's declared shape.
    dtype : torch.dtype
        The records' dtype (a floating dtype: the module's own is used).
    names : tuple of str
        The shared parameters.
    k : int
        Records of the largest user.

    Returns
    -------
    float
        The fraction of the parameters ``names`` that sit in Linear/Conv2d weights whose norm
        takes the Gram form (cheaper than materializing each user's weight gradient).
    """
    if dtype.is_floating_point:  # the module's own dtype (a float64 pool, a float32 module)
        dtype = next(model.parameters()).dtype
    mods = _owner_modules(model)
    paths = sorted({n.rpartition(".")[0] for n in names})
    positions: dict[str, int] = {}
    hooks = []
    for p in paths:
        if isinstance(mods[p], (nn.Linear, nn.Conv2d)):

            def hook(mod, inp, out, p=p):
                shape = out.shape[1:-1] if isinstance(mod, nn.Linear) else out.shape[2:]
                positions[p] = int(np.prod(shape)) if len(shape) else 1

            hooks.append(mods[p].register_forward_hook(hook))
    try:
        # no gradients, and the global RNG left as it was (a dropout layer draws from it)
        dev = _device(model)
        forked = [dev] if dev.type == "cuda" else []  # the device's RNG too (engine_opts.device)
        with torch.no_grad(), torch.random.fork_rng(devices=forked):
            model(torch.zeros(1, *input_shape, dtype=dtype, device=dev))
    finally:
        for h in hooks:
            h.remove()
    params = dict(model.named_parameters())
    total = sum(int(params[n].numel()) for n in names)
    gram = 0
    for n in names:
        p, leaf = n.rpartition(".")[0], n.rpartition(".")[2]
        if leaf == "weight" and p in positions:
            g, m = costs(mods[p], positions[p], k)
            gram += int(params[n].numel()) if g <= m else 0
    return gram / max(total, 1)


def _device(model: nn.Module) -> torch.device:
    """Where the module's parameters live (``engine_opts.device``; the CPU without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


@dataclass
class GhostGradients:
    """The users of a chunk, their gradients kept implicitly (built by ``ghost_gradients``).

    Parameters
    ----------
    names : tuple of str
        The parameters of the users' vectors, in flattening order.
    shapes : dict of str to torch.Size
        Each parameter's shape.
    dtype : torch.dtype
        The parameters' dtype.
    of : Tensor
        [R] each record's user.
    U : int
        The number of users.
    sq : Tensor
        [U] float64 squared norms of their vectors (over ``names``).
    finite : Tensor
        [U] bool: no non-finite input or output gradient among their records' and a finite
        norm.
    layers : list of SavedLayer
        Each shared layer's saved state.
    forms : dict of str to str
        Parameter name -> ``"ghost"``, ``"materialized"``, ``"per-record"`` or ``"rows"``.
    """

    names: tuple[str, ...]
    shapes: dict[str, torch.Size]
    dtype: torch.dtype
    of: torch.Tensor  # [R] each record's user
    U: int
    sq: torch.Tensor
    finite: torch.Tensor
    layers: list[SavedLayer]
    forms: dict[str, str]  # parameter name -> "ghost" | "materialized" | "per-record" | "rows"

    @property
    def norms(self) -> torch.Tensor:
        """[U] float64: the users' vectors' l2 norms."""
        return torch.sqrt(self.sq)

    def weighted_sum(self, factor: torch.Tensor) -> torch.Tensor:
        """Σ_u factor[u] v_u, as one weighted weight-gradient pass per layer.

        Parameters
        ----------
        factor : Tensor
            [U] each user's weight (a clip factor). Users with factor 0 contribute exactly
            zero even where their records are not finite (their rows are zeroed, not
            multiplied).

        Returns
        -------
        Tensor
            [d] in the parameters' dtype, flattened in ``names`` order.
        """
        f = factor.to(self.dtype)
        fr = f[self.of]  # per record
        zero = fr == 0
        drop = zero if bool(zero.any()) else None  # None: nothing to zero
        udrop = (f == 0) if drop is not None else None
        parts: dict[str, torch.Tensor] = {}
        for L in self.layers:
            wname, bname = param_names(L.path)
            for n, blocks in L.per_user.items():  # materialized: Σ_u f_u W_u
                s, acc = 0, None
                for t in blocks:
                    e = s + len(t)
                    d = udrop[s:e] if udrop is not None else None
                    term = f[s:e] @ _zero(d, t).reshape(len(t), -1)
                    acc, s = term if acc is None else acc + term, e
                assert acc is not None, "at least one block"
                parts[n] = acc
            for n, t in L.per_record.items():
                parts[n] = fr @ _zero(drop, t).reshape(len(fr), -1)
            need = [n for n in (wname, bname) if n in self.names and n not in parts]
            if not need:
                continue
            g = _zero(drop, L.g) * _b(fr, L.g)
            mod = L.mod
            if isinstance(mod, nn.Linear):
                g2 = g.reshape(-1, g.shape[-1])
                if wname in need:
                    a = _zero(drop, L.a)
                    parts[wname] = g2.T @ a.reshape(-1, a.shape[-1])
                if bname in need:
                    parts[bname] = g2.sum(0)
            elif isinstance(mod, nn.Conv2d):
                if wname in need:
                    assert L.weight is not None
                    a = _zero(drop, L.a)
                    parts[wname] = per_sample.conv_weight_grad(g, a, L.weight, mod, mod.groups)
                if bname in need:
                    parts[bname] = g.sum((0, 2, 3))
            else:
                assert isinstance(mod, nn.Embedding)
                ids = L.a.reshape(-1)
                out = torch.zeros(mod.num_embeddings, g.shape[-1], dtype=g.dtype, device=g.device)
                out.index_add_(0, ids, g.reshape(-1, g.shape[-1]))
                if mod.padding_idx is not None:
                    out[mod.padding_idx] = 0
                parts[wname] = out
        return torch.cat([parts[n].reshape(-1).to(self.dtype) for n in self.names])


def _zero(drop: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    """``t`` [n, ...] with the rows ``drop`` set to exact zeros (None: ``t`` itself)."""
    return t if drop is None else torch.where(_b(drop, t), 0.0, t)


def _b(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[R] -> broadcastable against ``like`` [R, ...]."""
    return v.reshape(-1, *([1] * (like.dim() - 1)))


def ghost_gradients(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    starts: np.ndarray,
    sizes: np.ndarray,
    names: tuple[str, ...],
    scale: float,
    form: str | None = None,
    channels_last: bool = True,
) -> GhostGradients:
    """The users' squared norms and their gradients kept implicitly (module doc).

    Parameters
    ----------
    model : nn.Module
        A model with ``supported(model, names)``.
    params : Mapping of str to Tensor
        All the model's parameters, unbatched (the broadcast).
    x, y : Tensor
        The records and their labels.
    starts, sizes : np.ndarray
        User ``i``'s records are ``starts[i] .. starts[i] + sizes[i]`` of ``x``/``y``; every
        size >= 1.
    names : tuple of str
        The parameters of the users' vectors.
    scale : float
        A user's vector is ``scale`` times its mean gradient at ``params``.
    form : str or None
        Force ``"ghost"`` or ``"materialized"`` for every Linear/Conv2d weight (tests; None:
        the cheaper one).
    channels_last : bool
        ``Kernels.channels_last`` (``per_sample.weighted_layer_grads``).

    Returns
    -------
    GhostGradients
        The chunk's users, their float64 squared norms and what ``weighted_sum`` needs.

    Raises
    ------
    NotImplementedError
        A shared layer called twice per forward.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    U = len(sizes)
    dtype, dev = params[names[0]].dtype, x.device  # every index and sum on the records' device
    rec = torch.from_numpy(np.concatenate([np.arange(a, a + k) for a, k in zip(starts, sizes)]))
    rec = rec.to(dev)
    of = torch.from_numpy(np.repeat(np.arange(U), sizes)).to(dev)
    first = torch.from_numpy(np.repeat(np.cumsum(sizes) - sizes, sizes)).to(dev)
    pos = torch.arange(len(of), device=dev) - first
    k = int(sizes.max())
    w = (float(scale) / torch.from_numpy(sizes).to(dev, torch.float64)).to(dtype)[of]
    # its output gradients are each record's share of its user's vector
    paths, mods, inputs, gouts = per_sample.weighted_layer_grads(
        model, params, x[rec], y[rec], names, w, "ghost_gradients", channels_last
    )
    ch = Chunk(names, of, pos, U, k, len(rec), sizes, form)
    sq = torch.zeros(U, dtype=torch.float64, device=dev)
    layers: list[SavedLayer] = []
    forms: dict[str, str] = {}
    for p, a, g in zip(paths, inputs, gouts):
        mod = mods[p]
        wname = param_names(p)[0]
        L = SavedLayer(p, mod, a, g, params[wname].detach() if wname in params else None)
        layers.append(L)
        add_squared_norms(ch, L, sq, forms)
    # a NaN or inf among the entries of a user's a's and g's that enter its gradient reaches its
    # float64 sum of squares (no float32 product overflows float64; inf * 0 is NaN)
    finite = torch.isfinite(sq)
    shapes = {n: params[n].shape for n in names}
    return GhostGradients(names, shapes, dtype, of, U, sq, finite, layers, forms)


def clipped_sum(gg: GhostGradients, constraint: Constraint) -> tuple[Contribution, int]:
    """The clipped sum ``make_reply`` would build from the users' vectors (module doc).

    Parameters
    ----------
    gg : GhostGradients
        The chunk's users.
    constraint : Constraint
        A clipped-sum constraint (``clip`` set, no rows).

    Returns
    -------
    tuple of (Contribution, int)
        The contribution (sum, kept count, clipped count) and the number of users dropped for
        a non-finite vector.
    """
    assert constraint.clip is not None and not constraint.rows
    dev = gg.sq.device
    factor, was, ok = finite_clip_factors(  # a non-finite user: factor 0, its rows zeroed
        torch.empty(gg.U, 0, dtype=gg.dtype, device=dev), constraint.clip, gg.norms
    )
    failed = int((~ok).sum())
    n = int(ok.sum())
    total = (
        gg.weighted_sum(factor)
        if n
        else torch.zeros(sum(s.numel() for s in gg.shapes.values()), dtype=gg.dtype, device=dev)
    )
    return Contribution(None, total, n, int(was.sum())), failed
