"""The paper CNN inferred from Huang et al. Table 2 (docs/algorithms.md#paper-cnn).

Conv1(1->16, 5x5, pad 2) -> ReLU -> MaxPool2 -> Conv2(16->32, 5x5, pad 2) -> ReLU -> MaxPool2
(computed as MaxPool2 then ReLU: the same values and gradients)
-> flatten (32*7*7 = 1568) -> two parallel heads FC1, FC2 (Linear 1568->10), logits averaged.
Parameter counts: Conv1 416, Conv2 12,832, each head 15,690 (PyTorch, biased; the paper's
Table 2 lists FC1 as 17,248 = 1568 x 11, see docs/algorithms.md#paper-cnn). joint_dp personalizes FC1 by default.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fedudp.models import register
from fedudp.models.split import SplitModel

__all__ = [
    "PAPER_TABLE2_COUNTS",
    "channels_last",
    "PaperCNN",
    "layer_counts",
    "paper_cnn",
]

PAPER_TABLE2_COUNTS = {"conv1": 416, "conv2": 12_832, "fc1": 17_248}


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` in channels-last memory format where it is a plain 4-D batch (torch.func's
    transforms keep theirs: vmap refuses the format); its values are unchanged.

    Parameters
    ----------
    x : torch.Tensor
        A tensor (a batch ``[B, C, H, W]`` is converted).

    Returns
    -------
    torch.Tensor
        ``x`` itself, or its channels-last copy.
    """
    if x.dim() != 4 or torch._C._functorch.is_functorch_wrapped_tensor(x):
        return x
    return x.contiguous(memory_format=torch.channels_last)


class PaperCNN(SplitModel):
    """The paper CNN: two 5x5 conv + max-pool layers, two linear heads averaged (``fc1`` personal).

    Parameters
    ----------
    in_channels : int, default 1
        The image channels C.
    classes : int, default 10
        The number of classes.
    side : int, default 28
        The image height and width.
    channels_last : bool, default True
        Channels-last activations from conv1 on; False for Opacus and similar hook-based tools.
    """

    default_personal = ("fc1.*",)

    def __init__(
        self, in_channels: int = 1, classes: int = 10, side: int = 28, channels_last: bool = True
    ) -> None:
        super().__init__()
        # conv1's output converted to channels-last (see forward): fedudp's engines take either
        # layout, but hook-based per-sample gradient tools may not: Opacus 1.6 returns a wrong
        # per-sample gradient for conv2.weight when conv2's input is channels-last, silently
        # (tests/models/test_models.py compares it with torch.func's). Set
        # ``channels_last=False`` (or the attribute, on a built model) before exporting the model
        # to Opacus or a similar tool: the same values, NCHW activations, slower on the CPU
        self.channels_last = channels_last
        self.conv1 = nn.Conv2d(in_channels, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        flat = 32 * (side // 4) * (side // 4)
        self.fc1 = nn.Linear(flat, classes)
        self.fc2 = nn.Linear(flat, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # channels-last activations from conv1 on: the same values, and on the CPU max-pooling
        # over NCHW is several times slower (and ReLU's backward slower over mixed layouts).
        # Pool, then ReLU: max_pool(relu(a)) = relu(max_pool(a)) exactly (ReLU is monotone; the
        # same window element is the argmax wherever the max is positive, and the gradient is
        # zero in both orders where it is not), with ReLU and its backward on a quarter of the
        # elements
        h = self.conv1(x)
        x = F.relu(F.max_pool2d(channels_last(h) if self.channels_last else h, 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        h = x.flatten(-3)
        return 0.5 * (self.fc1(h) + self.fc2(h))


def layer_counts(model: nn.Module) -> dict[str, int]:
    """Parameters per top-level layer (weights + biases).

    Parameters
    ----------
    model : nn.Module
        The model.

    Returns
    -------
    dict of str to int
        Parameter count per top-level layer name.
    """
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        layer = name.split(".")[0]
        out[layer] = out.get(layer, 0) + p.numel()
    return out


@register("cnn")
def paper_cnn(input_shape: tuple[int, ...], classes: int) -> PaperCNN:
    """``model.name=cnn``: the paper CNN on (C, H, W) images.

    Parameters
    ----------
    input_shape : tuple of int
        ``(C, H, W)`` images (square: H is taken as the side).
    classes : int
        The number of classes.

    Returns
    -------
    PaperCNN
        The model.

    Raises
    ------
    ValueError
        ``input_shape`` is not three-dimensional.
    """
    if len(input_shape) != 3:
        raise ValueError(f"cnn needs image inputs (C,H,W), got shape {input_shape}")
    return PaperCNN(input_shape[0], classes, input_shape[1])
