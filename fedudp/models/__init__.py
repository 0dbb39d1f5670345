"""Models: the paper CNN, the convex shared+personal logistic model, and the name split."""

from __future__ import annotations

import torch

from fedudp.models.split import SplitModel

MODELS = ("auto", "linear", "cnn", "char_gru")


def make_model(name: str, input_shape: tuple[int, ...], classes: int, seed: int) -> SplitModel:
    """The model ``name`` (``auto``: linear for flat inputs, cnn for images; ``char_gru``: a
    character-level GRU over token ids) for inputs of
    ``input_shape`` and ``classes`` classes, initialised from ``seed`` (public randomness).
    An unknown name or a CNN on flat inputs is a ``ValueError``."""
    from fedudp.models.char_rnn import CharGRU
    from fedudp.models.cnn import PaperCNN
    from fedudp.models.linear import SharedPersonalLogistic

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} (available: {list(MODELS)})")
    if name == "auto":
        name = "linear" if len(input_shape) == 1 else "cnn"
    torch.manual_seed(seed)
    if name == "char_gru":
        if len(input_shape) != 1:
            raise ValueError(f"char_gru needs token-id sequences (T,), got shape {input_shape}")
        return CharGRU(vocab=classes, classes=classes)
    if name == "cnn":
        if len(input_shape) != 3:
            raise ValueError(f"cnn needs image inputs (C,H,W), got shape {input_shape}")
        return PaperCNN(input_shape[0], classes, input_shape[1])
    features = 1
    for s in input_shape:
        features *= s
    return SharedPersonalLogistic(features, classes)
