"""What ``fedudp.flower.fast.TorchTraining`` refuses, before any user's update: a loss other
than cross-entropy, layers that couple a batch's records or are random, and settings out of
range (each a one-line error naming the setting).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import nn

from fedudp.flower.fast_data import data_arity

__all__ = ["is_cross_entropy", "refused_layers", "positive_int", "check_declaration"]


def is_cross_entropy(loss: Any) -> bool:
    """Whether ``loss`` is cross-entropy with its defaults.

    Parameters
    ----------
    loss : str, callable or torch.nn.Module

    Returns
    -------
    bool
    """
    if loss == "cross_entropy" or loss is F.cross_entropy:
        return True
    return (
        type(loss) is nn.CrossEntropyLoss
        and loss.weight is None
        and loss.reduction == "mean"
        and loss.label_smoothing == 0.0
    )


def refused_layers(model: nn.Module) -> list[str]:
    """Modules whose training-mode forward is random or couples a batch's records.

    Parameters
    ----------
    model : torch.nn.Module

    Returns
    -------
    list[str]
        Each such module's name and why.
    """
    bad = []
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            bad.append(f"{name or 'model'} ({type(m).__name__}: couples the records of a batch)")
        elif isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            bad.append(f"{name or 'model'} ({type(m).__name__}: random)")
    return bad


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1, else a one-line ``ValueError`` naming ``name``.

    Parameters
    ----------
    name : str
    value : Any
        A number, or a key (read each round: 1 here).

    Returns
    -------
    int

    Raises
    ------
    ValueError
    """
    if isinstance(value, str):
        return 1  # a key: read (and checked) each round
    try:
        ok = float(value) == int(value) and int(value) >= 1
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"TorchTraining: {name} must be an int >= 1 (or a key), got {value!r}")
    return int(value)


def check_declaration(tt: Any) -> bool:
    """A ``TorchTraining``'s declaration checked (its ``__post_init__``).

    Parameters
    ----------
    tt : TorchTraining

    Returns
    -------
    bool
        Whether ``data`` is called with the batch size as a third argument.

    Raises
    ------
    ValueError
        A loss other than cross-entropy, a setting out of range, a ``data`` that needs a batch
        size none declares.
    TypeError
        A ``data`` that is not ``data(partition_id, num_partitions[, batch_size])``.
    """
    if not is_cross_entropy(tt.loss):
        raise ValueError(
            f"TorchTraining: loss={tt.loss!r}: the fast path computes cross-entropy only; "
            "leave fast= out of user_level_mod to run the app's own training step per user"
        )
    positive_int("epochs", tt.epochs)
    if tt.batch_size is not None:
        positive_int("batch_size", tt.batch_size)
    if not isinstance(tt.lr, str) and not float(tt.lr) > 0:
        raise ValueError(f"TorchTraining: lr must be > 0 or a config key, got {tt.lr!r}")
    for name in ("momentum", "dampening", "weight_decay"):
        if not float(getattr(tt, name)) >= 0:
            raise ValueError(f"TorchTraining: {name} must be >= 0, got {getattr(tt, name)}")
    if tt.nesterov and (float(tt.momentum) <= 0 or float(tt.dampening) != 0):
        raise ValueError(
            "TorchTraining: nesterov=True needs momentum > 0 and dampening = 0 (as torch.optim.SGD)"
        )
    if not callable(tt.data):
        raise TypeError("TorchTraining: data must be data(partition_id, num_partitions)")
    accepts, requires = data_arity(tt.data)
    if accepts < 2 or requires > 3:
        raise TypeError(
            "TorchTraining: data must be data(partition_id, num_partitions) or "
            "data(partition_id, num_partitions, batch_size)"
        )
    if requires == 3 and tt.batch_size is None:
        raise ValueError(
            "TorchTraining: data takes (partition_id, num_partitions, batch_size) but no "
            "batch_size is declared: pass batch_size=32 or the run-config key, e.g. "
            "batch_size='batch-size' (Flower's quickstart)"
        )
    return accepts >= 3 and tt.batch_size is not None
