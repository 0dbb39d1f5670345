"""The ghost path's per-layer arithmetic (``fedudp.owner.ghost``'s module doc): each shared
layer's contribution to the users' float64 squared norms, by layer kind, and what the weighted
sum keeps of it (each user's materialized weight gradient, each record's small rows).

The layers' contributions are added to the users' squared norms in the order
``ghost.ghost_gradients`` visits the layers (weight, then bias), in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from fedudp.owner import per_sample
from fedudp.owner.one_step import _conv_weight_per_user
from fedudp.privacy.mechanisms import row_norms64

__all__ = ["NORMS", "Chunk", "SavedLayer", "add_squared_norms", "costs", "param_names"]

NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def costs(mod: nn.Module, positions: int, k: int) -> tuple[int, int]:
    """The multiply-adds of a Linear or Conv2d weight's norm in either form, for one user.

    Parameters
    ----------
    mod : nn.Module
        A Linear or Conv2d layer.
    positions : int
        Output positions per record.
    k : int
        The user's records.

    Returns
    -------
    tuple of int
        (the Gram form's, the materialized form's).
    """
    if isinstance(mod, nn.Linear):
        fan_in, fan_out = mod.in_features, mod.out_features
    else:
        assert isinstance(mod, nn.Conv2d)
        c_out, c_in, kh, kw = mod.weight.shape
        fan_in, fan_out = c_in * kh * kw, c_out
    n = k * positions
    return n * n * (fan_in + fan_out), n * fan_in * fan_out


def param_names(path: str) -> tuple[str, str]:
    """(weight, bias) parameter names of the module at ``path`` (``""``: the model itself).

    Parameters
    ----------
    path : str
        The module's path in the model.

    Returns
    -------
    tuple[str, str]
    """
    return (f"{path}.weight", f"{path}.bias") if path else ("weight", "bias")


@dataclass
class SavedLayer:
    """One shared layer's saved state for the weighted sum.

    Parameters
    ----------
    path : str
        The module's path.
    mod : nn.Module
        The module.
    a, g : Tensor
        Its input (token ids for an Embedding) and output gradient.
    weight : Tensor or None
        The weight the forward used (shape, dtype, layout).
    per_user : dict of str to list of Tensor
        Materialized: each user's weight gradient, [U, *shape] as row blocks in user order.
    per_record : dict of str to Tensor
        Small: each record's bias rows, a normalization layer's affine parameters.
    """

    path: str
    mod: nn.Module
    a: torch.Tensor  # input (token ids for an Embedding)
    g: torch.Tensor  # output gradient
    weight: torch.Tensor | None  # the weight the forward used (shape, dtype, layout)
    # materialized: each user's weight gradient, [U, *shape] as row blocks in user order
    per_user: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # small: each record's bias rows, a normalization layer's affine parameters
    per_record: dict[str, torch.Tensor] = field(default_factory=dict)


def _per_user64(t: torch.Tensor, of: torch.Tensor, U: int) -> torch.Tensor:
    """[U, ...] float64: the rows of ``t`` [R, ...] summed per user."""
    return torch.zeros(U, *t.shape[1:], dtype=torch.float64, device=t.device).index_add_(
        0, of, t.double()
    )


def _sq_rows(t: torch.Tensor) -> torch.Tensor:
    """[n] float64 squared l2 norms of the rows of ``t`` [n, ...], on ``t``'s device."""
    return (row_norms64(t.reshape(t.shape[0], -1)) ** 2).to(t.device)


def _padded(
    t: torch.Tensor,
    of: torch.Tensor,
    pos: torch.Tensor,
    U: int,
    k: int,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """[U, k·P, F] (float64 unless told): each user's records' rows ``t`` [R, P, F] side by
    side, users padded with zero records to ``k``."""
    _, P, Fd = t.shape
    out = torch.zeros(U, k, P, Fd, dtype=dtype, device=t.device)
    out[of, pos] = t.to(dtype)
    return out.reshape(U, k * P, Fd)


def _gram_sq(G: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """[U] float64: Σ_{i,j} (G_i·G_j)(A_i·A_j) for each user's rows G [U, n, F_g], A [U, n, F_a]
    (the squared Frobenius norm of Gᵀ A, from the two Gram matrices)."""
    return (torch.bmm(G, G.transpose(1, 2)) * torch.bmm(A, A.transpose(1, 2))).sum((1, 2))


@dataclass(frozen=True)
class Chunk:
    """A chunk's users as ``ghost_gradients`` indexes them.

    Parameters
    ----------
    names : tuple of str
        The shared parameters.
    of, pos : Tensor
        [R] each record's user and its position within its user.
    U, k, R : int
        Users, the largest user's record count, records.
    sizes : np.ndarray
        Each user's record count.
    form : str or None
        A forced weight form (tests), or None for the cheaper one.
    """

    names: tuple[str, ...]
    of: torch.Tensor  # [R] each record's user
    pos: torch.Tensor  # [R] each record's position within its user
    U: int
    k: int  # the largest user's record count
    R: int
    sizes: np.ndarray
    form: str | None


def _linear(ch: Chunk, L: SavedLayer, sq: torch.Tensor, forms: dict[str, str]) -> None:
    """A Linear layer's squared norms added to ``sq`` (weight, then bias), in place."""
    mod, a, g = L.mod, L.a, L.g
    assert isinstance(mod, nn.Linear)
    wname, bname = param_names(L.path)
    of, pos, U, k, R = ch.of, ch.pos, ch.U, ch.k, ch.R
    g3, a3 = g.reshape(R, -1, g.shape[-1]), a.reshape(R, -1, a.shape[-1])
    P = g3.shape[1]
    if wname in ch.names:
        ghost_cost, mat_cost = costs(mod, P, k)  # the chunk's largest user (padded)
        use = ch.form or ("ghost" if ghost_cost <= mat_cost else "materialized")
        forms[wname] = use
        if use == "ghost" and P == 1 and k == 1:  # one row each: ||g||² ||a||²
            sq += _sq_rows(g3) * _sq_rows(a3)
        elif use == "ghost":
            sq += _gram_sq(_padded(g3, of, pos, U, k), _padded(a3, of, pos, U, k))
        else:
            W = (
                g3.transpose(1, 2) @ a3
                if k == 1
                else torch.bmm(
                    _padded(g3, of, pos, U, k, g.dtype).transpose(1, 2),
                    _padded(a3, of, pos, U, k, a.dtype),
                )
            )
            sq += _sq_rows(W)
            L.per_user[wname] = [W]
    if bname in ch.names:  # each record's bias gradient, kept for the weighted sum
        forms[bname] = "rows"
        L.per_record[bname] = rows = g3.sum(1)
        sq += _sq_rows(_per_user64(rows, of, U))


def _conv2d(ch: Chunk, L: SavedLayer, sq: torch.Tensor, forms: dict[str, str]) -> None:
    """A Conv2d layer's squared norms added to ``sq`` (weight, then bias), in place."""
    mod, a, g = L.mod, L.a, L.g
    assert isinstance(mod, nn.Conv2d)
    wname, bname = param_names(L.path)
    of, pos, U, k, R = ch.of, ch.pos, ch.U, ch.k, ch.R
    if wname in ch.names:
        c_out, _, kh, kw = mod.weight.shape
        ghost_cost, mat_cost = costs(mod, g.shape[2] * g.shape[3], k)
        use = ch.form or ("ghost" if ghost_cost <= mat_cost else "materialized")
        forms[wname] = use
        if use == "ghost":
            cols = F.unfold(
                a,
                (kh, kw),
                dilation=mod.dilation,
                padding=cast(tuple[int, int], mod.padding),  # supported(): numeric
                stride=mod.stride,
            )  # [R, K, L]
            g3 = g.reshape(R, c_out, -1).transpose(1, 2)  # [R, L, C_out]
            sq += _gram_sq(_padded(g3, of, pos, U, k), _padded(cols.transpose(1, 2), of, pos, U, k))
        else:
            assert L.weight is not None
            # one record each: the records' blocks, each block's norms while it is
            # fresh in cache (no [U, *shape] copy made)
            blocks = (
                per_sample.conv2d_weight_blocks(a, g, mod)
                if k == 1
                else iter([_conv_weight_per_user(a, g, L.weight, mod, ch.sizes)])
            )
            kept = L.per_user[wname] = []
            sqs = []
            for W in blocks:
                sqs.append(_sq_rows(W))
                kept.append(W)
            sq += torch.cat(sqs)
    if bname in ch.names:
        forms[bname] = "rows"
        L.per_record[bname] = rows = g.sum((2, 3))
        sq += _sq_rows(_per_user64(rows, of, U))


def _embedding(ch: Chunk, L: SavedLayer, sq: torch.Tensor, forms: dict[str, str]) -> None:
    """An Embedding's squared norms added to ``sq``, in place: each user's gradient rows, one
    per (user, token) present (module doc)."""
    mod, a, g = L.mod, L.a, L.g
    assert isinstance(mod, nn.Embedding)
    wname = param_names(L.path)[0]
    forms[wname] = "rows"
    ids = a.reshape(ch.R, -1)
    g3 = g.reshape(ch.R, ids.shape[1], -1)
    keep = (
        torch.ones_like(ids, dtype=torch.bool)
        if mod.padding_idx is None
        else ids != mod.padding_idx
    )
    key = (ch.of.unsqueeze(1) * mod.num_embeddings + ids)[keep]
    uniq, inv = torch.unique(key, return_inverse=True)
    rows = torch.zeros(len(uniq), g3.shape[2], dtype=torch.float64, device=g3.device)
    rows.index_add_(0, inv, g3[keep].double())
    sq.index_add_(0, uniq // mod.num_embeddings, (rows * rows).sum(1))


def _normalization(ch: Chunk, L: SavedLayer, sq: torch.Tensor, forms: dict[str, str]) -> None:
    """A normalization layer's squared norms added to ``sq``, in place: each record's (small)
    gradient materialized."""
    assert isinstance(L.mod, NORMS)
    wname, bname = param_names(L.path)
    pr = _norm_per_record(L.mod, L.a, L.g)
    for leaf, t in pr.items():
        n = wname if leaf == "weight" else bname
        if n in ch.names:
            forms[n] = "per-record"
            L.per_record[n] = t
            sq += _sq_rows(_per_user64(t, ch.of, ch.U))


def _norm_per_record(mod: nn.Module, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """{weight, bias: [R, *shape]}: each record's gradient of a normalization layer's affine
    parameters, x̂ (the normalized input) recomputed from the layer's input ``a``."""
    wname, bname = "weight", "bias"
    out: dict[str, torch.Tensor] = {}
    R = a.shape[0]
    if isinstance(mod, nn.LayerNorm):
        xh = F.layer_norm(a, mod.normalized_shape, None, None, mod.eps)
        nd = len(mod.normalized_shape)
        dims = tuple(range(1, a.dim() - nd))  # positions
        sw = (g * xh).sum(dims) if dims else g * xh
        sb = g.sum(dims) if dims else g
    elif isinstance(mod, nn.GroupNorm):
        xh = F.group_norm(a, mod.num_groups, None, None, mod.eps)
        dims = tuple(range(2, a.dim()))
        sw, sb = (g * xh).sum(dims), g.sum(dims)
    else:
        b = cast(nn.modules.batchnorm._BatchNorm, mod)
        assert b.running_mean is not None and b.running_var is not None
        shape = (1, -1) + (1,) * (a.dim() - 2)
        xh = (a - b.running_mean.reshape(shape)) / torch.sqrt(b.running_var.reshape(shape) + b.eps)
        dims = tuple(range(2, a.dim()))
        sw = (g * xh).sum(dims) if dims else g * xh
        sb = g.sum(dims) if dims else g
    if getattr(mod, "weight", None) is not None:
        out[wname] = sw.reshape(R, -1)
    if getattr(mod, "bias", None) is not None:
        out[bname] = sb.reshape(R, -1)
    return out


def add_squared_norms(ch: Chunk, L: SavedLayer, sq: torch.Tensor, forms: dict[str, str]) -> None:
    """One shared layer's contribution to the users' squared norms, added to ``sq`` in place.

    Parameters
    ----------
    ch : Chunk
        The chunk's users.
    L : SavedLayer
        The layer's saved input and output gradient; filled with what ``weighted_sum`` needs.
    sq : Tensor
        [U] float64, the users' squared norms so far.
    forms : dict of str to str
        Filled with each of the layer's shared parameters' form.
    """
    if isinstance(L.mod, nn.Linear):
        _linear(ch, L, sq, forms)
    elif isinstance(L.mod, nn.Conv2d):
        _conv2d(ch, L, sq, forms)
    elif isinstance(L.mod, nn.Embedding):
        _embedding(ch, L, sq, forms)
    else:  # normalization layers: each record's (small) gradient
        _normalization(ch, L, sq, forms)
