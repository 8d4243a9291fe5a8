"""Pre-activation ResNet (ResNet-v2) for three-stage, CIFAR-style networks.

This is the network family that GEMS, HyPar-Flow and MPI4DL benchmark at
1K-16K pixels (ResNet-110-v2, ResNet-1001-v2), defined as in He et al. 2016,
"Identity Mappings in Deep Residual Networks":

- a 3x3 stem conv (16 x width channels, stride 1), then three stages of
  16/32/64 x width channels (x4 at the output of bottleneck blocks), stride 2
  at the start of stages 2 and 3, then a final BatchNorm + ReLU, global
  average pooling and a linear classifier;
- every residual unit is BN-ReLU-conv (pre-activation), the shortcut an
  identity, or a 1x1 conv on the pre-activated input where shape changes;
- basic units (two 3x3) give depth 6n+2 (ResNet-20, -56, -110); bottleneck
  units (1x1-3x3-1x1) give depth 9n+2 (ResNet-164, -1001).

110 is also 9n+2 with n=12: MPI4DL's ResNet-110-v2 (a port of the Keras
CIFAR example) uses bottleneck units, so ``create_model("resnet110-v2",
bottleneck=True)`` reproduces that model.

The total stride is 4, so tiles need only 4-pixel alignment; there is no
max-pool in this family. Why a stride-1 stem: these nets were designed for
small images and are used at high resolution by the systems above *because*
their activations are enormous -- exactly the workload spatial parallelism
exists for.
"""

from __future__ import annotations

import torch
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models.registry import (
    ChainModel,
    CheckpointedBlock,
    check_positive,
    register_model,
)

__all__ = ["PreActBlock", "ResNetV2", "resnet_v2_units"]


class PreActBlock(CheckpointedBlock):
    """One pre-activation residual unit, basic (3x3, 3x3) or bottleneck (1x1, 3x3, 1x1).

    Modules ``bn{i}``, ``conv{i}`` for each unit, one shared ``relu``, and
    ``downsample`` (a 1x1 conv) when stride or channels change. The stride is
    on the 3x3 conv.
    """

    def __init__(
        self, in_ch: int, planes: int, stride: int = 1, *, bottleneck: bool = False
    ) -> None:
        super().__init__()
        kernels = (1, 3, 1) if bottleneck else (3, 3)
        out_ch = planes * 4 if bottleneck else planes
        self.num_units = len(kernels)
        self.relu = nn.ReLU()
        ch = in_ch
        stride_at = kernels.index(3) + 1
        for i, k in enumerate(kernels, start=1):
            unit_out = out_ch if i == len(kernels) else planes
            self.add_module(f"bn{i}", nn.BatchNorm2d(ch))
            self.add_module(
                f"conv{i}",
                nn.Conv2d(
                    ch,
                    unit_out,
                    k,
                    stride=stride if i == stride_at else 1,
                    padding=k // 2,
                    bias=False,
                ),
            )
            ch = unit_out
        self.downsample = (
            nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False)
            if stride != 1 or in_ch != out_ch
            else None
        )
        self.out_ch = out_ch

    def forward_block(self, x: torch.Tensor) -> torch.Tensor:
        """``out = units(x) + shortcut``; a projection shortcut sees the pre-activated input."""
        out = x
        shortcut = x
        for i in range(1, self.num_units + 1):
            out = self.relu(getattr(self, f"bn{i}")(out))
            if i == 1 and self.downsample is not None:
                shortcut = self.downsample(out)
            out = getattr(self, f"conv{i}")(out)
        return out + shortcut


def resnet_v2_units(depth: int, bottleneck: bool) -> int:
    """Residual units per stage for ``depth``; ConfigError naming the valid depths otherwise."""
    per_unit = 9 if bottleneck else 6
    if depth < per_unit + 2 or (depth - 2) % per_unit:
        kind, examples = (
            ("bottleneck", "11, 29, 47, 164, 1001") if bottleneck else ("basic", "8, 20, 56, 110")
        )
        raise ConfigError(
            f"ResNetV2(depth={depth})",
            f"{kind} units need depth = {per_unit}n+2 with n >= 1",
            f"use one of {examples}, ... (or bottleneck={not bottleneck} if depth fits that form)",
        )
    return (depth - 2) // per_unit


class ResNetV2(ChainModel):
    """Three-stage pre-activation ResNet of ``depth`` layers.

    Args:
        depth: 6n+2 for basic units, 9n+2 for bottleneck units.
        bottleneck: use 1x1-3x3-1x1 units (He et al. use them for depth >= 164).
        num_classes, in_chans: classifier outputs and input channels.
        width: channel multiplier on 16/32/64 (rounded, at least 1).

    Top-level children: ``conv1, layer1, layer2, layer3, bn, relu`` (features),
    ``avgpool, flatten, fc`` (head). ``total_stride`` is 4.
    """

    def __init__(
        self,
        depth: int = 110,
        *,
        bottleneck: bool = False,
        num_classes: int = 10,
        in_chans: int = 3,
        width: float = 1.0,
    ) -> None:
        super().__init__()
        check_positive("ResNetV2", num_classes=num_classes, in_chans=in_chans, width=width)
        units = resnet_v2_units(depth, bottleneck)
        self.depth = depth
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.total_stride = 4
        widths = [max(1, round(c * width)) for c in (16, 32, 64)]

        self.conv1 = nn.Conv2d(in_chans, widths[0], 3, padding=1, bias=False)
        ch = widths[0]
        for i, planes in enumerate(widths):
            blocks = []
            for j in range(units):
                stride = 2 if i > 0 and j == 0 else 1
                block = PreActBlock(ch, planes, stride, bottleneck=bottleneck)
                ch = block.out_ch
                blocks.append(block)
            self.add_module(f"layer{i + 1}", nn.Sequential(*blocks))
        self.bn = nn.BatchNorm2d(ch)
        self.relu = nn.ReLU()
        self.head_start = 6
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(ch, num_classes)
        self.num_features = ch

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")


# Named variants: (depth, bottleneck). Small ones keep tests and demos fast.
_VARIANTS: dict[str, tuple[int, bool]] = {
    "resnet20-v2": (20, False),
    "resnet56-v2": (56, False),
    "resnet110-v2": (110, False),
    "resnet164-v2": (164, True),
    "resnet1001-v2": (1001, True),
}
for _name, (_depth, _bottleneck) in _VARIANTS.items():
    register_model(_name, ResNetV2, depth=_depth, bottleneck=_bottleneck)
