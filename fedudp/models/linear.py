"""Convex multinomial logistic model with a shared and a personal part (Huang et al. §3.1).

logits = x @ (W_shared + W_personal) + b_shared + b_personal. The loss is convex in
(x_j, u) = (personal, shared) jointly, as Huang et al.'s analysis assumes. joint_dp keeps
``personal.*`` on each owner; full_dp / fedavg share both parts (the model is then one
global logistic regression); per_silo keeps both personal.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class SharedPersonalLogistic(nn.Module):
    default_personal = ("personal.*",)

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.shared = nn.Linear(features, classes)
        self.personal = nn.Linear(features, classes)
        nn.init.zeros_(self.shared.weight)
        nn.init.zeros_(self.shared.bias)
        nn.init.zeros_(self.personal.weight)
        nn.init.zeros_(self.personal.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1) if x.dim() > 2 else x
        return self.shared(x) + self.personal(x)
