"""A character-level next-character GRU for LEAF Shakespeare.

Input: int64 token ids ``[..., T]`` (LEAF Shakespeare: T = 80 characters over the 80-character
vocabulary ``fedudp.data.leaf.VOCAB``); output: logits ``[..., classes]`` for the character
that follows the window (classes = vocab by default):

    embed (Embedding vocab -> E) -> GRU layer 1 .. L (hidden H, unrolled over the T steps)
    -> head (Linear H -> classes) on the last step's hidden state.

The GRU is written out from ``nn.Linear`` layers rather than ``nn.GRU`` because ``nn.GRU`` does
not work under ``torch.func.vmap`` with per-unit parameters (torch 2.13): ``aten::gru.input``
has no batching rule, so a vmapped forward without ``grad`` (``evaluate_sums``) fails
("Batching rule not implemented for aten::gru.input"), and ``vmap(grad(...))`` over the head
alone (joint_dp's personal update, the recurrent weights shared and unbatched) fails with a
shape mismatch; only ``vmap(grad)`` over all the weights at once happened to work. The layers
here use only ``nn.Linear`` and elementwise ops, so every transform works on every split.

Each layer is PyTorch's GRU (``torch.nn.GRU``'s equations and weight layout, gates ordered
r, z, n in the rows of ``ih`` and ``hh``), with h_0 = 0 and, at step t, input x_t:

    [a_r, a_z, a_n] = ih(x_t) = W_i x_t + b_i          (all T steps in one matmul)
    [c_r, c_z, c_n] = hh(h_{t-1}) = W_h h_{t-1} + b_h
    r_t = sigmoid(a_r + c_r)                            reset gate
    z_t = sigmoid(a_z + c_z)                            update gate
    n_t = tanh(a_n + r_t * c_n)                         candidate
    h_t = (1 - z_t) * n_t + z_t * h_{t-1}  (computed as n_t + z_t * (h_{t-1} - n_t))

so copying ``nn.GRU``'s ``weight_ih_l{k}, bias_ih_l{k}, weight_hh_l{k}, bias_hh_l{k}`` into
``rnn.{k}.ih`` / ``rnn.{k}.hh`` gives the same outputs (tests/models/test_models.py checks it).
Initialisation follows ``nn.GRU``: every recurrent weight and bias U(-1/sqrt(H), 1/sqrt(H));
the embedding N(0, 1) and the head ``nn.Linear``'s default, as PyTorch's.

Parameter names: ``embed.weight``, ``rnn.{k}.ih.{weight,bias}``, ``rnn.{k}.hh.{weight,bias}``,
``head.{weight,bias}``. joint_dp keeps ``head.*`` personal by default (each owner's output
layer, the analogue of the paper CNN's FC1). The embedding and the recurrent maps ``rnn.{k}.hh``
(a ``RecurrentLinear``, applied T times) take the model off the per-record fast path
(``fedudp.owner.per_sample.supported`` is False), so DP-SGD uses the generic vmap path; ``head``
and the input projections ``rnn.{k}.ih`` (applied once, to the whole sequence) alone would qualify.

Memory grows with the records in one vmapped step (the 80 unrolled steps keep their
activations), hence ``auto_chunk_records`` (read by ``local_sgd.chunk_budget`` where it looks
for it). Its forward/backward timings and memory peak: docs/benchmarks.md#figures-from-the-codes-docstrings.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn as nn

from fedudp.models import register
from fedudp.models.split import SplitModel

__all__ = [
    "RecurrentLinear",
    "GRULayer",
    "CharGRU",
    "char_gru",
]


class RecurrentLinear(nn.Linear):
    """An ``nn.Linear`` applied at every step (the hidden-to-hidden map). Its own type keeps it
    off ``fedudp.owner.per_sample``'s one-pass path, which needs each layer applied once per
    forward (it would raise "called twice"); per-record gradients go through vmap instead.

    Takes ``nn.Linear``'s arguments (``in_features``, ``out_features``, ``bias``).
    """


class GRULayer(nn.Module):
    """One GRU layer (the equations above) over a sequence ``[..., T, in]``: ``ih`` an
    ``nn.Linear`` applied once to the whole sequence, ``hh`` a ``RecurrentLinear``.

    Parameters
    ----------
    input_size : int
        Features per step of the input sequence.
    hidden : int
        The hidden state's width H.
    """

    def __init__(self, input_size: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.ih = nn.Linear(input_size, 3 * hidden)
        self.hh = RecurrentLinear(hidden, 3 * hidden)
        bound = hidden**-0.5
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def forward(self, seq: torch.Tensor, all_steps: bool = True) -> torch.Tensor:
        """``[..., T, H]`` hidden states of every step (``all_steps``) or ``[..., H]`` the last."""
        H = self.hidden
        gi = self.ih(seq)  # [..., T, 3H], every step at once
        a_rz = gi[..., : 2 * H].unbind(-2)
        a_n = gi[..., 2 * H :].unbind(-2)
        h = gi.new_zeros(*gi.shape[:-2], H)
        outs = []
        for t in range(len(a_rz)):
            c = self.hh(h)
            rz = torch.sigmoid(a_rz[t] + c[..., : 2 * H])
            r, z = rz[..., :H], rz[..., H:]
            n = torch.tanh(a_n[t] + r * c[..., 2 * H :])
            h = n + z * (h - n)
            if all_steps:
                outs.append(h)
        return torch.stack(outs, -2) if all_steps else h


class CharGRU(SplitModel):
    """Embedding -> ``layers`` GRU layers -> Linear head on the last step (module docstring).

    Parameters
    ----------
    vocab : int, default 80
        The token vocabulary (embedding rows).
    classes : int or None, default None
        The head's outputs; None: ``vocab``.
    embed, hidden : int, default 8, 128
        The embedding and hidden widths.
    layers : int, default 1
        GRU layers.

    Raises
    ------
    ValueError
        A size below 1; ``forward`` too, for float inputs or an empty sequence.
    """

    default_personal = ("head.*",)
    # records per vmapped step when engine_opts.chunk_records is auto (0): per-record cost is
    # flat from 256 to 2,048 records, memory is not (about 2 MB a record)
    auto_chunk_records: ClassVar[int] = 512

    def __init__(
        self,
        vocab: int = 80,
        classes: int | None = None,
        embed: int = 8,
        hidden: int = 128,
        layers: int = 1,
    ) -> None:
        super().__init__()
        if min(vocab, embed, hidden, layers) < 1 or (classes is not None and classes < 1):
            raise ValueError(
                f"CharGRU needs positive sizes, got vocab={vocab}, classes={classes}, "
                f"embed={embed}, hidden={hidden}, layers={layers}"
            )
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, embed)
        self.rnn = nn.ModuleList(
            GRULayer(embed if k == 0 else hidden, hidden) for k in range(layers)
        )
        self.head = nn.Linear(hidden, vocab if classes is None else classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() or x.is_complex():
            raise ValueError(
                f"CharGRU takes integer token ids [..., T], got {x.dtype} "
                "(a character dataset's x is int64; this model is not for features)"
            )
        if x.dim() < 1 or x.shape[-1] < 1:
            raise ValueError(
                f"CharGRU takes token ids [..., T] with T >= 1, got shape {tuple(x.shape)}"
            )
        lead = x.shape[:-1]
        seq = self.embed(x.reshape(-1, x.shape[-1]))  # [B, T, E]
        for k, layer in enumerate(self.rnn):
            seq = layer(seq, all_steps=k < len(self.rnn) - 1)
        return self.head(seq).reshape(*lead, -1)


@register("char_gru")
def char_gru(input_shape: tuple[int, ...], classes: int) -> CharGRU:
    """``model.name=char_gru``: the character GRU over token-id sequences (T,).

    Parameters
    ----------
    input_shape : tuple of int
        ``(T,)``: a sequence of T token ids.
    classes : int
        The vocabulary, which is also the number of classes.

    Returns
    -------
    CharGRU
        The model.

    Raises
    ------
    ValueError
        ``input_shape`` is not one-dimensional.
    """
    if len(input_shape) != 1:
        raise ValueError(f"char_gru needs token-id sequences (T,), got shape {input_shape}")
    return CharGRU(vocab=classes, classes=classes)
