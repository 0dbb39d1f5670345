"""Models: the paper CNN, the convex shared+personal logistic model, and the name split."""
from __future__ import annotations

import torch

from fedudp.config import ConfigError, ModelName, RunConfig
from fedudp.models.split import SplitModel


def build_model(cfg: RunConfig, input_shape: tuple[int, ...], classes: int) -> SplitModel:
    """The configured model, initialized from the run seed (public randomness)."""
    from fedudp.models.cnn import PaperCNN
    from fedudp.models.linear import SharedPersonalLogistic

    name = ModelName(cfg.model.name)
    if name == ModelName.auto:
        name = ModelName.linear if len(input_shape) == 1 else ModelName.cnn
    torch.manual_seed(cfg.seed)
    if name == ModelName.cnn:
        if len(input_shape) != 3:
            raise ConfigError(f"model.name: cnn needs image inputs (C,H,W), got shape {input_shape}")
        return PaperCNN(input_shape[0], classes, input_shape[1])
    features = 1
    for s in input_shape:
        features *= s
    return SharedPersonalLogistic(features, classes)
