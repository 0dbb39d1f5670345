"""The app's model, data and training step: plain Flower/PyTorch, nothing fedudp-specific.

``load_data(partition_id, num_partitions)``: partition ``partition_id`` of ``num_partitions``
of a seeded synthetic two-class problem (10 features). Each partition holds between 2 and 11
records. With fedudp's mod the partitions are the users.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 2))


def load_data(partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(1000 + partition_id)
    n = 2 + partition_id % 10
    y = rng.integers(0, 2, n)
    x = rng.standard_normal((n, 10)) + 1.5 * (2 * y[:, None] - 1) * np.linspace(1, 0, 10)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y)


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float, epochs: int = 1) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss = torch.zeros(())
    for _ in range(epochs):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return float(loss)


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        out = model(x)
        return float(nn.functional.cross_entropy(out, y)), float(
            (out.argmax(1) == y).float().mean()
        )
