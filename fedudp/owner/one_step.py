"""One-step user vectors from one batched forward/backward (the server placement's hot path
when every user's local training is a single SGD step).

When a user holds at most ``batch_size`` records and trains one epoch (or its vector is its
average gradient), its vector is v_u = s · ḡ_u with ḡ_u = (1/k_u) Σ_{r ∈ u} ∇ℓ_r(θ) at the
broadcast θ (s = -lr for the delta, 1 for the gradient). The vmapped path computes each user's
step separately (grouped convolutions, batched pooling, per-user activations held at once:
the local engine's memory peak with one-record users). Here the users of a chunk share one
batched forward/backward of Σ_r (s / k_{u(r)}) ℓ_r, hooks keeping every shared layer's input
a_r and output gradient g_r (records are independent: ``fedudp.owner.per_sample``'s Linear and
Conv2d rule), and each user's gradient follows exactly:

    Linear:  W_u = Σ_{r∈u} g_r a_rᵀ (one batched matmul over the users' padded records),
             b_u = Σ_{r∈u} g_r
    Conv2d:  W_u = one weight-only convolution backward over the user's records (a user of one
             record: its per-record weight gradient, ``per_sample.conv2d_weight_per_record``,
             the chunk's records as the groups of weight-only convolution backwards),
             b_u = Σ_{r∈u} Σ_{h,w} g_r

The vectors then go through the owners' ordinary constraint (``make_reply``: non-finite rows
dropped, clipped with float64 norms, summed), so clipping and its sensitivity are exactly
those of the other paths; the vectors equal the vmapped path's and the per-user loop's up to
float rounding (tested on the paper CNN and the linear model). One-record users' vectors do not
depend on the number of threads (no reduction over records inside a kernel); a multi-record
user's convolution weight gradient is one oneDNN weight-gradient kernel over its records, whose
summation order follows the thread count, as the per-user loop's backward does (a resumed run
with the same ``engine_opts.threads`` is the uninterrupted one bit for bit).

Cost (one thread, the paper CNN): the chunk's batched forward/backward costs less per record
than the per-user loop's small batches, and the per-user weight-gradient kernels little more
than the batched one, so users of up to a batch of records take this path (measured:
docs/benchmarks.md, "The owner side's kernels"). ``Kernels.one_step`` (``fedudp.owner.kernels``)
turns the path off.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn as nn

from fedudp.owner import per_sample

__all__ = ["one_step_vectors"]


def one_step_vectors(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    starts: np.ndarray,
    sizes: np.ndarray,
    names: tuple[str, ...],
    scale: float,
    into: torch.Tensor | None = None,
    channels_last: bool = True,
) -> torch.Tensor:
    """Each user's vector, ``scale`` times its mean gradient, from one forward/backward.

    Parameters
    ----------
    model, params : nn.Module, Mapping of str to Tensor
        A model with ``per_sample.supported(model, names)`` and all its parameters,
        unbatched (the broadcast).
    x, y, starts, sizes : Tensor, Tensor, np.ndarray, np.ndarray
        The records, their labels; user ``i``'s records are ``starts[i] .. starts[i] +
        sizes[i]`` (every size >= 1).
    names, scale : tuple of str, float
        The vectors' parameters (flattened in this order); -lr for a one-step delta, 1 for
        the mean gradient.
    into : Tensor or None
        A buffer of at least U rows of width d to write into (a chunked caller reuses one).
    channels_last : bool
        ``Kernels.channels_last`` (``per_sample.weighted_layer_grads``).

    Returns
    -------
    Tensor
        [U, d] in the parameters' dtype (the first U rows of ``into`` when given).

    Raises
    ------
    NotImplementedError
        A Linear layer with middle dims, or a layer called twice per forward.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    U = len(sizes)
    dtype, dev = params[names[0]].dtype, params[names[0]].device
    d = sum(int(params[n].numel()) for n in names)
    if U == 0:
        return torch.zeros(0, d, dtype=dtype, device=dev)
    rec = torch.from_numpy(np.concatenate([np.arange(a, a + k) for a, k in zip(starts, sizes)]))
    rec = rec.to(x.device)
    of = torch.from_numpy(np.repeat(np.arange(U), sizes)).to(dev)
    w = (float(scale) / torch.from_numpy(sizes).to(dev, torch.float64)).to(dtype)[of]
    # each record's loss times s / k_u: its output gradients are its share of its user's vector
    layers, mods, inputs, gouts = per_sample.weighted_layer_grads(
        model, params, x[rec], y[rec], names, w, "one_step_vectors", channels_last
    )
    parts = _per_user_parts(layers, mods, inputs, gouts, params, names, of, sizes)
    flat = [parts[n].reshape(U, -1).to(dtype) for n in names]
    if into is None:
        return torch.cat(flat, dim=1)
    return torch.cat(flat, dim=1, out=into[:U])


def _per_user_parts(
    layers: list[str],
    mods: dict[str, nn.Module],
    inputs: list[torch.Tensor],
    gouts: list[torch.Tensor],
    params: Mapping[str, torch.Tensor],
    names: tuple[str, ...],
    of: torch.Tensor,
    sizes: np.ndarray,
) -> dict[str, torch.Tensor]:
    """{name: [U, *shape]}: each user's gradient of the parameters ``names`` from the layers'
    inputs and output gradients (module doc's formulas)."""
    U, single = len(sizes), int(sizes.max()) == 1
    parts: dict[str, torch.Tensor] = {}
    for p, a, g in zip(layers, inputs, gouts):
        mod = mods[p]
        wname, bname = (f"{p}.weight", f"{p}.bias") if p else ("weight", "bias")
        if isinstance(mod, nn.Linear):
            if a.dim() != 2:
                raise NotImplementedError("one_step_vectors: Linear inputs with middle dims")
            if wname in names:
                parts[wname] = (
                    g.unsqueeze(2) * a.unsqueeze(1)
                    if single
                    else torch.bmm(*_padded(g, a, of, U, sizes))
                )
            if bname in names:
                parts[bname] = g if single else _per_user(g, of, U)
        else:
            assert isinstance(mod, nn.Conv2d)  # per_sample.supported: Linear or Conv2d only
            if wname in names:
                parts[wname] = (
                    per_sample.conv2d_weight_per_record(a, g, mod)
                    if single
                    else _conv_weight_per_user(a, g, params[wname].detach(), mod, sizes)
                )
            if bname in names:
                gb = g.sum((2, 3))
                parts[bname] = gb if single else _per_user(gb, of, U)
    return parts


def _conv_weight_per_user(
    a: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, mod: nn.Conv2d, sizes: np.ndarray
) -> torch.Tensor:
    """[U, *W.shape]: each user's gradient of the convolution ``mod`` w.r.t. its weight (Σ over
    its records), one weight-only convolution backward (aten's, the kernel autograd runs) over
    the user's records, which are consecutive rows of ``a`` [R, C_in, H, W] and ``g``
    [R, C_out, H_o, W_o] (``sizes[u]`` rows each, in order). ``weight``: the weight the forward
    used (its shape, dtype and layout; its values do not enter a weight gradient)."""
    out = torch.empty(len(sizes), *weight.shape, dtype=g.dtype, device=g.device)
    ends = np.cumsum(sizes)
    for u, (s, e) in enumerate(zip(ends - sizes, ends)):
        out[u] = per_sample.conv_weight_grad(g[s:e], a[s:e], weight, mod, mod.groups)
    return out


def _per_user(t: torch.Tensor, of: torch.Tensor, U: int) -> torch.Tensor:
    """[U, ...]: the rows of ``t`` summed per user (in record order)."""
    return torch.zeros(U, *t.shape[1:], dtype=t.dtype, device=t.device).index_add_(0, of, t)


def _padded(
    g: torch.Tensor, a: torch.Tensor, of: torch.Tensor, U: int, sizes: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """([U, out, k], [U, k, in]): each user's records' output gradients and inputs, users padded
    to the largest size with zero records, for Σ_{r∈u} g_r a_rᵀ as one batched matmul."""
    k = int(sizes.max())
    first = torch.from_numpy(np.repeat(np.cumsum(sizes) - sizes, sizes)).to(of.device)
    pos = torch.arange(len(of), device=of.device) - first
    G = torch.zeros(U, k, g.shape[1], dtype=g.dtype, device=g.device)
    A = torch.zeros(U, k, a.shape[1], dtype=a.dtype, device=a.device)
    G[of, pos] = g
    A[of, pos] = a
    return G.transpose(1, 2), A
