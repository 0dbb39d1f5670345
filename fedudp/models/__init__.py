"""Models: the paper CNN, the convex shared+personal logistic model, the character GRU, and the
name split. Each model module registers a factory in ``MODELS`` (``@register("name")``), whose
names are the config's ``model.name`` choices (with ``auto``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fedudp.models.split import SplitModel
from fedudp.registry import Registry

__all__ = ["MODELS", "register", "make_model", "SplitModel"]

# a factory: (input shape, classes) -> the model; an input shape it cannot take is a ValueError
Factory = Callable[[tuple[int, ...], int], SplitModel]
MODELS: Registry[Factory] = Registry("model", "model.name")


def register(name: str) -> Callable[[Factory], Factory]:
    """Decorator: ``model.name=<name>`` builds the model from this factory.

    Parameters
    ----------
    name : str
        The ``model.name`` (an identifier).

    Returns
    -------
    callable
        The decorator; it registers the factory and returns it unchanged. It raises
        ``ValueError`` for a name that is not an identifier or is taken by another factory.
    """
    return MODELS.register(name)


def make_model(name: str, input_shape: tuple[int, ...], classes: int, seed: int) -> SplitModel:
    """The model ``name`` (``auto``: linear for flat inputs, cnn for images; ``char_gru``: a
    character-level GRU over token ids) for inputs of
    ``input_shape`` and ``classes`` classes, initialised from ``seed`` (public randomness).
    An unknown name or a CNN on flat inputs is a ``ValueError``.

    Parameters
    ----------
    name : str
        ``model.name``: a registered name or ``auto``.
    input_shape : tuple of int
        One record's input shape.
    classes : int
        The number of classes.
    seed : int
        The initialisation seed (public).

    Returns
    -------
    SplitModel
        The freshly initialised model.

    Raises
    ------
    ValueError
        An unknown name, or an input shape the model cannot take.
    """
    if name == "auto":
        name = "linear" if len(input_shape) == 1 else "cnn"
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} (available: {['auto', *MODELS.names()]})")
    torch.manual_seed(seed)
    return MODELS[name](tuple(input_shape), classes)


# the built-in models register themselves
from fedudp.models import char_rnn, cnn, linear  # noqa: E402,F401
