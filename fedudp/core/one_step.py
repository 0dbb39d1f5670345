"""Clipped sums of one-step user vectors without the per-user vectors (the server placement's
hot path when every user's local training is a single SGD step).

When each sampled user holds at most ``batch_size`` records and trains one epoch (or the vector
is its average gradient), its vector is v_u = s · ḡ_u with ḡ_u = (1/k_u) Σ_{r ∈ u} ∇ℓ_r(θ) at the
broadcast θ (s = -lr for the delta, 1 for the gradient). Clip + Gaussian only needs
Σ_u clip_C(v_u), the count and how many were clipped, so the [users, d] matrix of vectors (the
vmapped path's memory peak) is never built:

1. one batched forward/backward of the summed loss Σ_r ℓ_r / k_{u(r)}, hooks keeping every
   shared layer's input a_r and output gradient g_r (``fedudp.core.per_sample``: Linear and
   Conv2d layers, records independent);
2. each user's squared norm, layer by layer, in float64: a Linear layer's weight gradient of
   user u is Σ_{r∈u} g_r a_rᵀ, whose squared norm is Σ_{r,r'∈u} (g_r·g_r')(a_r·a_r') (the
   records' Gram matrices, "ghost norms", Li et al. 2022); a Conv2d's per-record weight
   gradients (``per_sample.conv2d_weight_per_record``) summed per user; biases from the summed
   output gradients;
3. the clip factors from those norms, exactly as ``privacy.mechanisms.clip_factors`` (norms in
   float64, clipped users shrunk by 4 ulps);
4. the clipped sum Σ_u c_u v_u = s · Σ_r c_{u(r)} g_r ⊗ a_r per layer: one weighted matmul
   (Linear) or one weight-gradient convolution (Conv2d).

The result equals clipping and summing the per-user vectors up to float summation order
(tests/core/test_one_step.py compares both on the paper CNN and the linear model). A user whose
norm is not finite is left out and counted as failed, as ``make_reply`` does for a non-finite row.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from fedudp.core import per_sample
from fedudp.privacy.mechanisms import clip_factors_from_norms


def one_step_clipped_sum(model: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor,
                         y: torch.Tensor, starts: np.ndarray, sizes: np.ndarray,
                         names: tuple[str, ...], scale: float, clip: float
                         ) -> tuple[torch.Tensor, int, int, int]:
    """(clipped sum [d] in the parameters' dtype, users summed, users clipped, users failed) of
    the users whose records are ``starts[i] .. starts[i] + sizes[i]`` of ``x``/``y``, each user's
    vector ``scale`` times its mean gradient at ``params`` w.r.t. ``names`` (module doc).
    Requires ``per_sample.supported(model, names)``; every size >= 1."""
    sizes = np.asarray(sizes, dtype=np.int64)
    U = len(sizes)
    dtype = params[names[0]].dtype
    d = sum(int(params[n].numel()) for n in names)
    if U == 0:
        return torch.zeros(d, dtype=dtype), 0, 0, 0
    rec = torch.from_numpy(np.concatenate([np.arange(a, a + k) for a, k in zip(starts, sizes)]))
    of = torch.from_numpy(np.repeat(np.arange(U), sizes))
    inv_k = torch.from_numpy(1.0 / sizes).to(dtype)[of]
    mods = {n: m for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
    layers = sorted({n.rpartition(".")[0] for n in names})
    saved: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for path in layers:
        def hook(mod, inp, out, path=path):
            if path in saved:
                raise NotImplementedError(f"one_step_clipped_sum: {path} is called twice")
            saved[path] = (inp[0].detach(), out)
        hooks.append(mods[path].register_forward_hook(hook))
    try:
        with torch.enable_grad():
            at = {k: v.detach().requires_grad_(True) if k in names else v.detach()
                  for k, v in params.items()}
            out = functional_call(model, at, (x[rec],))
            loss = (F.cross_entropy(out, y[rec], reduction="none") * inv_k).sum()
            gouts = torch.autograd.grad(loss, [saved[p][1] for p in layers])
    finally:
        for h in hooks:
            h.remove()
    act = {p: saved[p][0] for p in layers}
    grad_out = dict(zip(layers, (g.detach() for g in gouts)))
    sq = torch.zeros(U, dtype=torch.float64)
    for p in layers:
        sq += _user_sq_norms(mods[p], act[p], grad_out[p], of, U, sizes,
                             {leaf for n in names for leaf in [n.rpartition(".")[2]]
                              if n.rpartition(".")[0] == p})
    norms = abs(float(scale)) * sq.sqrt()
    ok = torch.isfinite(norms)
    factor, was = clip_factors_from_norms(torch.where(ok, norms, torch.zeros_like(norms)), clip)
    factor = torch.where(ok, factor.to(torch.float64), torch.zeros_like(norms))
    w = (float(scale) * factor).to(dtype)[of]                  # per record: s · c_{u(r)}
    keep = ok[of]                                              # records of users left in
    parts = {}
    for p in layers:
        mod, a, g = mods[p], act[p], grad_out[p]
        if not bool(keep.all()):            # 0 · inf is nan: drop the failed users' records
            a, g = a[keep], g[keep]
            wk = w[keep]
        else:
            wk = w
        gw = g * wk.reshape(-1, *([1] * (g.dim() - 1)))
        if isinstance(mod, nn.Linear):
            parts[f"{p}.weight" if p else "weight"] = gw.reshape(-1, g.shape[-1]).T @ a.reshape(
                -1, a.shape[-1])
            parts[f"{p}.bias" if p else "bias"] = gw.reshape(-1, g.shape[-1]).sum(0)
        else:
            parts[f"{p}.weight" if p else "weight"] = torch.nn.grad.conv2d_weight(
                a, mod.weight.shape, gw, stride=mod.stride, padding=mod.padding,
                dilation=mod.dilation, groups=1)
            parts[f"{p}.bias" if p else "bias"] = gw.sum((0, 2, 3))
    total = torch.cat([parts[n].reshape(-1) for n in names]).to(dtype)
    bad = int((~ok).sum())
    return total, U - bad, int((was & ok).sum()), bad


def _user_sq_norms(mod: nn.Module, a: torch.Tensor, g: torch.Tensor, of: torch.Tensor, U: int,
                   sizes: np.ndarray, leaves: set[str]) -> torch.Tensor:
    """[U] float64: Σ over this layer's shared parameters of each user's squared gradient norm
    (the user's gradient: Σ_{r∈u} of its records' gradients, the 1/k_u already in g)."""
    out = torch.zeros(U, dtype=torch.float64)
    if isinstance(mod, nn.Linear):
        if a.dim() != 2:
            raise NotImplementedError("one_step_clipped_sum: Linear inputs with middle dims")
        g64, a64 = g.to(torch.float64), a.to(torch.float64)
        if "weight" in leaves:
            if int(sizes.max()) == 1:
                out += g64.square().sum(1)[_first(of, U)] * a64.square().sum(1)[_first(of, U)]
            else:
                out += _gram_norms(g64, a64, of, U, sizes)
        if "bias" in leaves:
            out += torch.zeros(U, g.shape[1], dtype=torch.float64).index_add_(0, of, g64
                                                                              ).square().sum(1)
        return out
    if "weight" in leaves:
        per = per_sample.conv2d_weight_per_record(a, g, mod).reshape(len(of), -1)
        out += torch.zeros(U, per.shape[1], dtype=torch.float64).index_add_(
            0, of, per.to(torch.float64)).square().sum(1)
    if "bias" in leaves:
        out += torch.zeros(U, g.shape[1], dtype=torch.float64).index_add_(
            0, of, g.sum((2, 3)).to(torch.float64)).square().sum(1)
    return out


def _first(of: torch.Tensor, U: int) -> torch.Tensor:
    """The record index of each user's (only) record, users in order."""
    return torch.arange(U) if len(of) == U else torch.searchsorted(of, torch.arange(U))


def _gram_norms(g: torch.Tensor, a: torch.Tensor, of: torch.Tensor, U: int,
                sizes: np.ndarray) -> torch.Tensor:
    """||Σ_{r∈u} g_r a_rᵀ||² = Σ_{r,r'∈u} (g_r·g_r')(a_r·a_r') per user, users padded to the
    largest size with zero records."""
    k = int(sizes.max())
    pos = torch.arange(len(of)) - torch.from_numpy(np.repeat(np.cumsum(sizes) - sizes, sizes))
    G = torch.zeros(U, k, g.shape[1], dtype=g.dtype)
    A = torch.zeros(U, k, a.shape[1], dtype=a.dtype)
    G[of, pos] = g
    A[of, pos] = a
    return (torch.bmm(G, G.transpose(1, 2)) * torch.bmm(A, A.transpose(1, 2))).sum((1, 2))
