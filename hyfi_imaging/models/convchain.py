"""A plain chain of 3x3 convolutions and ReLUs: the memory yardstick of spatial parallelism.

Why this model exists: it is the network on which spatial-parallel systems
compare how much of one process's activation memory a rank keeps (LBANN's
DistConv reports 0.265 per rank on a 1x4 split at 512^2, the ideal being
0.25 plus the halo strips). With no BatchNorm and no pooling inside the
chain, every byte a rank keeps is a convolution's input or a ReLU's output,
so any copy a windowed layer makes shows up directly.

Children: ``block1 ... blockN`` (conv 3x3 stride 1 padding 1 + ReLU each),
then the head ``avgpool, flatten, fc``. ``total_stride`` is 1.
"""

from __future__ import annotations

import torch
from torch import nn

from hyfi_imaging.models.registry import (
    ChainModel,
    CheckpointedBlock,
    check_positive,
    register_model,
    whole_number,
)

__all__ = ["ConvChain", "ConvReLU"]


class ConvReLU(CheckpointedBlock):
    """``relu(conv3x3(x))`` as one checkpointable block."""

    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.relu = nn.ReLU()

    def forward_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv(x))


class ConvChain(ChainModel):
    """``depth`` conv3x3+ReLU blocks of ``width`` channels, global average pool, linear.

    OK: ``ConvChain(depth=8, width=16)``. Error: ``ConvChain(depth=0)`` -> ConfigError.
    """

    def __init__(
        self, *, depth: int = 8, width: int = 16, num_classes: int = 2, in_chans: int = 3
    ) -> None:
        super().__init__()
        # hyfi-verify --width 8 passes 8.0 (nn.Conv2d's traceback), 0.5 is no channel count
        depth, width = (
            whole_number("ConvChain", "depth", depth),
            whole_number("ConvChain", "width", width),
        )
        check_positive(
            "ConvChain", depth=depth, width=width, num_classes=num_classes, in_chans=in_chans
        )
        self.num_classes, self.in_chans, self.total_stride = num_classes, in_chans, 1
        ch = in_chans
        for i in range(depth):
            self.add_module(f"block{i + 1}", ConvReLU(ch, width))
            ch = width
        self.head_start = depth
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(width, num_classes)
        self.num_features = width


register_model("convchain", ConvChain)
