"""AmoebaNet-D(L, D), the network GPipe and Hy-Fi/MPI4DL scale, for any image size.

Architecture (Real et al. 2019; GPipe, Huang et al. 2019; the TensorFlow TPU
``amoeba_net`` reference): a stride-2 3x3 stem conv, two stride-2 *stem*
reduction cells (D/4 and D/2 filters), then three stacks of L/3 normal cells
with D, 2D and 4D filters separated by two reduction cells, then ReLU, global
average pooling, dropout and a linear classifier. ``L`` is the total number of
normal cells, as in GPipe's "AmoebaNet-D (18, 256)": 6 per stack. Each cell
reads the outputs of the two previous cells, applies the five pairs of
operations of the genotype (:data:`AMOEBANET_D`, which is data, not code) and
concatenates the unused hidden states.

Differences from the public PyTorch port (torchgpipe), on purpose:

- ``max_pool_3x3`` is a real ``nn.MaxPool2d`` (the port builds an average pool);
- no fixed 224-pixel assumption: global pooling is adaptive, every stride-2
  branch yields ``ceil(n / 2)`` pixels for odd ``n`` too (``max_pool_2x2`` uses
  ``ceil_mode``, which is TensorFlow's SAME padding), so any input size works;
- stem filters follow TensorFlow (D/8 stem conv, D/4 and D/2 stem cells);
- the second input of the first stem cell is projected to the cell's width by
  ReLU-1x1-BN (TensorFlow instead widens it inside each operation).

Why :class:`FactorizedReduce` has a fixed depthwise conv: the classic version
takes ``x[:, :, 1:, 1:]``, pads one zero row and column, then applies a
stride-2 1x1 conv, i.e. it samples pixels ``(2i+1, 2j+1)`` (a zero past the
border). Tensor slicing and ``F.pad`` are invisible to a halo-exchanging
spatial layer. A 3x3, stride-2, padding-1 depthwise conv whose kernel is
one-hot at tap (2, 2) reads exactly input ``2i - 1 + 2 = 2i + 1``, sees the
zero padding at the border exactly when the classic version does, and gives
``ceil(n / 2)`` outputs for odd and even ``n`` alike. It is an ordinary conv
geometry (halo 1 on the left, 0 on the right for stride-aligned tiles), so the
spatial conv handles it with no special case. Its weight is a frozen
parameter (``requires_grad=False``): exact, not trained, and loaded and saved
with the state dict.

Chaining: the stem maps the image to ``(x, x)``; every cell maps
``(current, previous)`` to ``(cell output, current)``; the head maps that tuple
(or a bare feature map) to logits. So the top-level children run in order are
the model, and any cut between children is a valid pipeline stage boundary.

Omitted (training regularisers, not architecture): the auxiliary head and drop-path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models.registry import (
    ChainModel,
    CheckpointedBlock,
    check_positive,
    register_model,
)

__all__ = ["AMOEBANET_D", "OPERATIONS", "AmoebaNet", "Cell", "FactorizedReduce", "Genotype"]

States = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class Genotype:
    """A cell search result: pairs of ``(operation name, hidden-state index)`` and the outputs.

    Hidden state 0 is the (projected) output of the previous cell, 1 that of the
    cell before it; node ``k`` (from 2 on) is the sum of ops ``2(k-2)`` and
    ``2(k-2)+1``. ``*_concat`` lists the states concatenated as the cell output.
    """

    normal: tuple[tuple[str, int], ...]
    normal_concat: tuple[int, ...]
    reduction: tuple[tuple[str, int], ...]
    reduction_concat: tuple[int, ...]


# From the TF TPU reference model_specs.py ('amoeba_net_d'); the concatenated
# states are the ones no node consumes (its "used_hiddenstates" mask).
AMOEBANET_D = Genotype(
    normal=(
        ("1x1", 1),
        ("max_pool_3x3", 1),
        ("none", 1),
        ("1x7_7x1", 0),
        ("1x1", 0),
        ("1x7_7x1", 0),
        ("max_pool_3x3", 2),
        ("none", 2),
        ("avg_pool_3x3", 1),
        ("1x1", 5),
    ),
    normal_concat=(0, 3, 4, 6),
    reduction=(
        ("max_pool_2x2", 0),
        ("max_pool_3x3", 0),
        ("none", 2),
        ("3x3", 1),
        ("1x7_7x1", 2),
        ("max_pool_3x3", 2),
        ("none", 3),
        ("max_pool_2x2", 1),
        ("avg_pool_3x3", 2),
        ("1x1", 3),
    ),
    reduction_concat=(4, 5, 6),
)


def _relu_conv_bn(
    c_in: int,
    c_out: int,
    kernel: int | tuple[int, int] = 1,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
) -> list[nn.Module]:
    return [
        nn.ReLU(),
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=padding, bias=False),
        nn.BatchNorm2d(c_out),
    ]


def _conv_op(kernels: Sequence[tuple[int, int]]) -> Callable[[int, int], nn.Module]:
    """TF AmoebaNet conv operation: ReLU-conv-BN per kernel, inside a c/4 1x1 bottleneck.

    The stride is applied along each axis whose kernel is larger than 1 (so a
    1x7 conv strides along x, the 7x1 after it along y). Below 4 channels the
    bottleneck is dropped, as in the reference.
    """

    def build(channels: int, stride: int) -> nn.Module:
        mid = channels // 4
        inner = mid if mid >= 1 else channels
        layers: list[nn.Module] = _relu_conv_bn(channels, inner) if mid >= 1 else []
        for kh, kw in kernels:
            s = (stride if kh > 1 else 1, stride if kw > 1 else 1)
            layers += _relu_conv_bn(inner, inner, (kh, kw), s, (kh // 2, kw // 2))
        if mid >= 1:
            layers += _relu_conv_bn(inner, channels)
        return nn.Sequential(*layers)

    return build


def _none(channels: int, stride: int) -> nn.Module:
    return nn.Identity() if stride == 1 else nn.Sequential(*_relu_conv_bn(channels, channels, 1, 2))


def _max_pool_2x2(channels: int, stride: int) -> nn.Module:
    if stride != 2:
        raise ConfigError(
            "genotype", "max_pool_2x2 is defined for stride 2 only", "use max_pool_3x3"
        )
    return nn.MaxPool2d(2, stride=2, ceil_mode=True)


#: Operation name -> builder(channels, stride). Every op keeps the channel count.
OPERATIONS: dict[str, Callable[[int, int], nn.Module]] = {
    "none": _none,
    "1x1": lambda c, s: nn.Sequential(*_relu_conv_bn(c, c, 1, s)),
    "3x3": _conv_op([(3, 3)]),
    "1x7_7x1": _conv_op([(1, 7), (7, 1)]),
    "max_pool_3x3": lambda c, s: nn.MaxPool2d(3, stride=s, padding=1),
    "max_pool_2x2": _max_pool_2x2,
    "avg_pool_3x3": lambda c, s: nn.AvgPool2d(3, stride=s, padding=1, count_include_pad=False),
}


class FactorizedReduce(nn.Module):
    """Halve the resolution without dropping pixels: two stride-2 1x1 paths, one shifted.

    ``path 1`` samples pixels (2i, 2j), ``path 2`` pixels (2i+1, 2j+1) through
    ``shift``, a frozen one-hot depthwise 3x3/s2/p1 conv (see the module
    docstring for why this is exact and spatializable). Outputs are concatenated
    and batch-normalised.
    """

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        if c_out % 2:
            raise ConfigError("FactorizedReduce", f"{c_out} output channels is odd", "use even")
        self.relu = nn.ReLU()
        self.conv1 = nn.Conv2d(c_in, c_out // 2, 1, stride=2, bias=False)
        self.shift = nn.Conv2d(c_in, c_in, 3, stride=2, padding=1, groups=c_in, bias=False)
        self.conv2 = nn.Conv2d(c_in, c_out // 2, 1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)
        self.reset_shift()

    def reset_shift(self) -> None:
        """(Re)set the fixed selector kernel: one at tap (2, 2), zero elsewhere; frozen."""
        with torch.no_grad():
            self.shift.weight.zero_()
            self.shift.weight[:, :, 2, 2] = 1.0
        self.shift.weight.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        """``bn(cat(conv1(relu x), conv2(shift(relu x))))``."""
        x = self.relu(x)
        return self.bn(torch.cat([self.conv1(x), self.conv2(self.shift(x))], dim=1))


class Cell(CheckpointedBlock):
    """One normal or reduction cell of ``genotype``: ``(current, previous) -> (out, current)``.

    ``preprocess0`` projects the current input to ``channels`` (ReLU-1x1-BN);
    ``preprocess1`` brings the previous one to the same shape (FactorizedReduce
    after a reduction, ReLU-1x1-BN if only the width differs, else identity).
    In a reduction cell, ops reading state 0 or 1 have stride 2.
    """

    def __init__(
        self,
        genotype: Genotype,
        *,
        reduction: bool,
        c_prev_prev: int,
        c_prev: int,
        channels: int,
        reduction_prev: bool,
    ) -> None:
        super().__init__()
        spec = genotype.reduction if reduction else genotype.normal
        concat = genotype.reduction_concat if reduction else genotype.normal_concat
        _check_cell(spec, concat, "reduction" if reduction else "normal")
        self.reduction = reduction
        self.preprocess0 = nn.Sequential(*_relu_conv_bn(c_prev, channels))
        self.preprocess1: nn.Module
        if reduction_prev:
            self.preprocess1 = FactorizedReduce(c_prev_prev, channels)
        elif c_prev_prev != channels:
            self.preprocess1 = nn.Sequential(*_relu_conv_bn(c_prev_prev, channels))
        else:
            self.preprocess1 = nn.Identity()
        self.indices = tuple(i for _, i in spec)
        self.concat = tuple(concat)
        self.ops = nn.ModuleList(
            OPERATIONS[name](channels, 2 if reduction and i < 2 else 1) for name, i in spec
        )
        self.out_channels = channels * len(concat)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction}, indices={self.indices}, concat={self.concat}"

    def forward_block(self, x: States) -> States:
        """Run the genotype's nodes; return ``(concat of unused states, current input)``."""
        current, previous = x
        hidden = [self.preprocess0(current), self.preprocess1(previous)]
        for k in range(0, len(self.ops), 2):
            a = self.ops[k](hidden[self.indices[k]])
            b = self.ops[k + 1](hidden[self.indices[k + 1]])
            hidden.append(a + b)
        return torch.cat([hidden[i] for i in self.concat], dim=1), current


def _check_cell(spec: Sequence[tuple[str, int]], concat: Sequence[int], kind: str) -> None:
    """A genotype error names the cell kind and the offending entry."""
    where = f"genotype ({kind} cell)"
    if not spec or len(spec) % 2:
        raise ConfigError(where, f"{len(spec)} operations", "give an even, non-zero number")
    for pos, (name, idx) in enumerate(spec):
        if name not in OPERATIONS:
            raise ConfigError(where, f"unknown operation {name!r}", f"use {sorted(OPERATIONS)}")
        if not 0 <= idx < 2 + pos // 2:
            raise ConfigError(where, f"op {pos} reads state {idx} before it exists", "fix index")
    n_states = 2 + len(spec) // 2
    if not concat or any(not 0 <= i < n_states for i in concat):
        raise ConfigError(where, f"concat {tuple(concat)} out of range", f"use 0..{n_states - 1}")


class Stem(nn.Module):
    """3x3 stride-2 conv + BN; returns ``(x, x)`` so the first cell has two inputs."""

    def __init__(self, in_chans: int, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_chans, channels, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> States:
        """Image -> ``(features, features)``."""
        x = self.bn(self.conv(x))
        return x, x


class Head(nn.Module):
    """ReLU, global average pool, flatten, dropout, linear; takes a state tuple or a map."""

    def __init__(self, channels: int, num_classes: int, drop_rate: float) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.dropout = nn.Dropout(drop_rate)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: States | Tensor) -> Tensor:
        """Logits from the last cell's output (the first element of a state tuple)."""
        if isinstance(x, tuple):
            x = x[0]
        out: Tensor = self.fc(self.dropout(self.flatten(self.avgpool(self.relu(x)))))
        return out


class AmoebaNet(ChainModel):
    """AmoebaNet(L, D) with a given genotype (AmoebaNet-D by default).

    Args:
        num_layers: L, the total number of normal cells, a multiple of 3 (L/3 per stack).
        num_filters: D, filters of the first stack; a multiple of 8.
        num_classes, in_chans: classifier outputs and input channels.
        stem_filters: channels of the stem conv (default D/8, TensorFlow's 32 for D=256).
        drop_rate: dropout before the classifier (the reference trains with 0.5).
        genotype: the cell description.

    Top-level children: ``stem``, ``stem_reduction1..2``, ``stack1_normal1..``,
    ``reduction1``, ``stack2_normal..``, ``reduction2``, ``stack3_normal..``, ``head``.
    ``total_stride`` = 2 per stride-2 stage (stem + 4 reduction cells) = 32.
    ``forward_features`` returns the last cell's output (before the head's ReLU).
    """

    def __init__(
        self,
        num_layers: int = 18,
        num_filters: int = 256,
        *,
        num_classes: int = 1000,
        in_chans: int = 3,
        stem_filters: int | None = None,
        drop_rate: float = 0.0,
        genotype: Genotype = AMOEBANET_D,
    ) -> None:
        super().__init__()
        where = f"AmoebaNet(num_layers={num_layers}, num_filters={num_filters})"
        check_positive(where, num_classes=num_classes, in_chans=in_chans)
        if num_layers < 3 or num_layers % 3:
            raise ConfigError(where, "num_layers must be a positive multiple of 3", "use 3, 6, 18")
        if num_filters < 8 or num_filters % 8:
            raise ConfigError(where, "num_filters must be a multiple of 8", "use 8, 64, 256")
        stem_filters = stem_filters if stem_filters is not None else num_filters // 8
        check_positive(where, stem_filters=stem_filters)
        self.num_classes = num_classes
        self.in_chans = in_chans

        plan: list[tuple[str, bool, int]] = [
            ("stem_reduction1", True, num_filters // 4),
            ("stem_reduction2", True, num_filters // 2),
        ]
        for stack in range(3):
            if stack:
                plan.append((f"reduction{stack}", True, num_filters * 2**stack))
            plan += [
                (f"stack{stack + 1}_normal{i + 1}", False, num_filters * 2**stack)
                for i in range(num_layers // 3)
            ]

        self.stem = Stem(in_chans, stem_filters)
        c_prev_prev = c_prev = stem_filters
        reduction_prev = False
        for name, reduction, channels in plan:
            cell = Cell(
                genotype,
                reduction=reduction,
                c_prev_prev=c_prev_prev,
                c_prev=c_prev,
                channels=channels,
                reduction_prev=reduction_prev,
            )
            self.add_module(name, cell)
            c_prev_prev, c_prev, reduction_prev = c_prev, cell.out_channels, reduction
        self.head_start = 1 + len(plan)
        self.head = Head(c_prev, num_classes, drop_rate)
        self.num_features = c_prev
        self.total_stride = 2 ** (1 + sum(r for _, r, _ in plan))

        for m in self.modules():
            if isinstance(m, nn.Conv2d) and m.weight.requires_grad:
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward_features(self, x: Tensor) -> Tensor:
        """The last cell's output map (first element of the chained state tuple)."""
        states: States = self._run(x, 0, self.head_start)
        return states[0]

    def forward_head(self, feats: Any) -> Tensor:
        """Logits from a feature map or a state tuple."""
        out: Tensor = self.head(feats)
        return out


for _l, _d in ((18, 256), (6, 64), (3, 8)):
    register_model(f"amoebanet-d-{_l}-{_d}", AmoebaNet, num_layers=_l, num_filters=_d)
