"""Convex multinomial logistic model with a shared and a personal part (Huang et al. §3.1).

logits = x @ W_shared + b_shared + b_personal. The loss is convex in (x_j, u) =
(personal, shared) jointly, as Huang et al.'s analysis assumes. The personal part is an
owner-specific logit offset (it captures each owner's label skew, the heterogeneity the
``paper_classes`` / ``dirichlet`` partitions create), small enough that an owner can fit it
from its own records. joint_dp keeps ``personal.*`` on each owner; full_dp / fedavg share it
(one global model); per_silo keeps everything personal.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fedudp.models import register
from fedudp.models.split import SplitModel

__all__ = [
    "PersonalOffset",
    "SharedPersonalLogistic",
    "linear",
]


class PersonalOffset(nn.Module):
    """A personal per-class bias added to the logits (zeros at first).

    Parameters
    ----------
    classes : int
        The number of classes.
    """

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(classes))

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits + self.bias


class SharedPersonalLogistic(SplitModel):
    """Logistic regression: a shared ``nn.Linear`` (zeros at first), then a personal offset.

    Parameters
    ----------
    features : int
        Input features (inputs are flattened).
    classes : int
        The number of classes.
    """

    default_personal = ("personal.*",)

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.shared = nn.Linear(features, classes)
        self.personal = PersonalOffset(classes)
        nn.init.zeros_(self.shared.weight)
        nn.init.zeros_(self.shared.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1) if x.dim() > 2 else x
        return self.personal(self.shared(x))


@register("linear")
def linear(input_shape: tuple[int, ...], classes: int) -> SharedPersonalLogistic:
    """``model.name=linear``: shared + personal logistic regression on the flattened inputs.

    Parameters
    ----------
    input_shape : tuple of int
        One record's input shape, flattened to its product.
    classes : int
        The number of classes.

    Returns
    -------
    SharedPersonalLogistic
        The model.
    """
    features = 1
    for s in input_shape:
        features *= s
    return SharedPersonalLogistic(features, classes)
