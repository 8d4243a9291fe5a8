"""CosmoFlow: the 3-D CNN of the MLPerf HPC benchmark, regressing cosmological parameters.

Built like the MLCommons HPC reference (``mlcommons/hpc``, ``cosmoflow/models/
cosmoflow.py`` with ``configs/cosmo.yaml``; Mathuriya et al., SC'18; Farrell et
al., MLPerf HPC, 2021): a 4-channel 128^3 volume of dark-matter counts ->
``n_conv_layers`` blocks of ``Conv3d`` (kernel 2, 'same' padding) + LeakyReLU
+ ``MaxPool3d(2)``, the filters doubling from ``width`` (32) -> flatten ->
dense 128 and 64, each with LeakyReLU and dropout 0.5 -> dense to the 4
targets, ``tanh`` scaled by 1.2.

Design choices, and why:

* **The reference's numbers, as its defaults**: kernel 2 (not 3), 'same'
  padding, which for an even kernel pads one voxel *after* each axis and none
  before -- TensorFlow's rule (and PyTorch's ``padding="same"``), so the
  geometry is the reference's voxel for voxel; Keras's LeakyReLU slope 0.3 (not
  PyTorch's 0.01); Glorot-uniform weights and zero biases (Keras's defaults).
  Dropout is 0.5 (``cosmo.yaml``; the code's own default is 0).
* **The output head** ``1.2 * tanh(x)`` (:class:`ScaledTanh`): the targets are
  normalised to [-1, 1], and the factor lets the network reach the ends of that
  range without saturating ``tanh``. ``scaled_tanh=False`` gives raw outputs.
* **A chain** (:class:`~.registry.ChainModel`): the conv blocks are
  checkpointable and a pipeline may cut anywhere. ``forward_features`` is the
  last conv block's map; the head flattens it, so its first dense layer is
  sized for ``size`` (the volume side: 128 in the benchmark, any side of at
  least ``2**n_conv_layers``; pools floor odd sizes as Keras's 'valid' pools do).
  Flattening is channels-first (PyTorch), the reference's is channels-last:
  ported Keras weights need ``fc1``'s columns permuted. A volume of another size is
  refused in one line naming the sizes the head takes (:meth:`CosmoFlow.check_input_size`,
  which ``hyfi-verify`` calls before any process starts), not by a matrix product deep
  in the forward pass.
* **A global-pool head, as an option** (``head="pool"``, registered as
  ``cosmoflow-pool``): ``AdaptiveAvgPool3d(1)`` before the flatten, so the dense layers
  read ``num_features`` values and the network takes any volume of at least
  ``2**n_conv_layers`` a side -- not the benchmark's network (fc1 has 512 inputs, not
  32768), but the usual way to let one model see volumes of several sizes. On a grid the
  pool is a spatial global pool (an all-reduce of the tiles' sums), exact as the flatten.

Spatially parallel on a 3-D grid of sub-volumes (``--spatial 2x1x2``): the
conv blocks run on the tiles, and the head's ``nn.Flatten`` gathers the last
(small) map whole onto every rank (``parallel.spatial.SpatialFlatten``), after
which the dense layers run replicated, as after a global pool.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models.registry import (
    ChainModel,
    CheckpointedBlock,
    check_positive,
    register_model,
    whole_number,
)

__all__ = ["CosmoFlow", "CosmoFlowBlock", "ScaledTanh"]

#: The heads: the reference's flatten (one input size), or a global average pool (any size).
_HEADS = ("flatten", "pool")


class CosmoFlowBlock(CheckpointedBlock):
    """``maxpool(leaky_relu(conv3d(x)))``: one of the reference's convolution layers.

    The convolution pads ``"same"``: for an even kernel, PyTorch puts the odd
    voxel after each axis and none before, TensorFlow's split. Not an explicit
    ``nn.ZeroPad3d`` before an unpadded convolution (the same numbers): on a grid
    of sub-volumes that pad's output is one voxel longer than the map, which the
    tiles have no room for when the grid divides the volume evenly, while a
    convolution's own padding lies in its halo.
    """

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, negative_slope: float) -> None:
        super().__init__()
        self.conv = nn.Conv3d(in_ch, out_ch, kernel_size, padding="same")
        self.act = nn.LeakyReLU(negative_slope)
        self.pool = nn.MaxPool3d(2)

    def forward_block(self, x: torch.Tensor) -> torch.Tensor:
        with warnings.catch_warnings():
            # PyTorch notes once that an even kernel pads a copy of the input: expected here.
            warnings.filterwarnings("ignore", "Using padding='same' with even kernel")
            return self.pool(self.act(self.conv(x)))


class ScaledTanh(nn.Module):
    """``scale * tanh(x)``: the reference's output activation (``scale = 1.2``)."""

    def __init__(self, scale: float = 1.2) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * torch.tanh(x)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


class CosmoFlow(ChainModel):
    """The MLPerf HPC CosmoFlow network: ``(N, in_chans, size, size, size)`` -> ``(N, num_classes)``.

    Args:
        in_chans: input channels (4 redshifts in the benchmark).
        num_classes: regression targets (4 cosmological parameters).
        size: side of the cubic input volume; fixes the first dense layer's width.
        n_conv_layers: conv blocks, each halving the side; ``total_stride = 2**n_conv_layers``.
        width: filters of the first conv block, doubled by every following block
            (the reference's ``conv_size``).
        kernel_size: convolution kernel ('same' padding).
        fc_sizes: widths of the hidden dense layers.
        dropout: dropout probability after each hidden dense layer.
        negative_slope: LeakyReLU slope (Keras's default 0.3).
        scaled_tanh: end with ``1.2 * tanh`` as the reference does.
        head: ``"flatten"`` (the reference: the dense layers read the whole last map, so the
            input is ``size`` a side) or ``"pool"`` (a global average pool first: any size).

    OK: ``create_model("cosmoflow", size=32, n_conv_layers=3, width=4)``;
    ``create_model("cosmoflow-pool")(torch.randn(1, 4, 64, 64, 72))``.
    Error: ``create_model("cosmoflow", size=16)`` raises ConfigError (5 pools need 32 voxels);
    ``create_model("cosmoflow").check_input_size((64, 64, 72))`` raises ConfigError naming
    the sides the head takes (128 to 159).
    """

    def __init__(
        self,
        *,
        in_chans: int = 4,
        num_classes: int = 4,
        size: int = 128,
        n_conv_layers: int = 5,
        width: int = 32,
        kernel_size: int = 2,
        fc_sizes: tuple[int, ...] | list[int] = (128, 64),
        dropout: float = 0.5,
        negative_slope: float = 0.3,
        scaled_tanh: bool = True,
        head: str = "flatten",
    ) -> None:
        super().__init__()
        where = "CosmoFlow"
        width = whole_number(where, "width", width)  # hyfi-verify --width 4 passes 4.0
        if head not in _HEADS:
            raise ConfigError(where, f"head={head!r} is not known", f"use {' or '.join(_HEADS)}")
        check_positive(
            where,
            in_chans=in_chans,
            num_classes=num_classes,
            size=size,
            n_conv_layers=n_conv_layers,
            width=width,
            kernel_size=kernel_size,
        )
        check_positive(where, **{f"fc_sizes[{i}]": n for i, n in enumerate(fc_sizes)})
        if not 0 <= dropout < 1:
            raise ConfigError(where, f"dropout={dropout!r} is not in [0, 1)", "pass e.g. 0.5")
        if size < 2**n_conv_layers:
            raise ConfigError(
                where,
                f"size={size} is too small for {n_conv_layers} pools of 2",
                f"use size >= {2**n_conv_layers} or fewer n_conv_layers",
            )
        self.in_chans, self.num_classes, self.dims = in_chans, num_classes, 3
        self.total_stride = 2**n_conv_layers
        self.head = head
        #: The head's first dense layer is sized for this volume only (spatialize probes at it);
        #: None with the global-pool head, which takes any size.
        self.input_size: tuple[int, int, int] | None = (
            (size, size, size) if head == "flatten" else None
        )
        ch = in_chans
        for i in range(n_conv_layers):
            out = width * 2**i
            self.add_module(f"block{i + 1}", CosmoFlowBlock(ch, out, kernel_size, negative_slope))
            ch = out
        self.num_features = ch
        self.head_start = n_conv_layers
        if head == "pool":
            self.global_pool = nn.AdaptiveAvgPool3d(1)
        self.flatten = nn.Flatten(1)
        features = ch * (size // 2**n_conv_layers) ** 3 if head == "flatten" else ch
        for i, hidden in enumerate(fc_sizes, start=1):
            self.add_module(f"fc{i}", nn.Linear(features, hidden))
            self.add_module(f"act{i}", nn.LeakyReLU(negative_slope))
            self.add_module(f"drop{i}", nn.Dropout(dropout))
            features = hidden
        self.add_module(f"fc{len(fc_sizes) + 1}", nn.Linear(features, num_classes))
        self.out_act = ScaledTanh(1.2) if scaled_tanh else nn.Identity()

        for m in self.modules():
            if isinstance(m, nn.Conv3d | nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def check_input_size(self, size: Sequence[int]) -> None:
        """ConfigError unless the network takes a volume of ``size`` (``(d, h, w)``): every side
        at least ``total_stride``, and with the flatten head, the last map's shape the one
        the first dense layer was sized for (a side of ``size`` to ``size + stride - 1``)."""
        stride, n = self.total_stride, int(math.log2(self.total_stride))
        text = "x".join(map(str, size))
        where = f"CosmoFlow (head={self.head!r})"
        if len(size) != 3:
            raise ConfigError(where, f"takes a volume (DxHxW), not {text}", "give three sides")
        if min(size) < stride:
            raise ConfigError(
                where,
                f"a {text} volume is too small for {n} pools of 2",
                f"give every side at least {stride} voxels",
            )
        if self.input_size is None:
            return
        want = tuple(s // stride for s in self.input_size)
        got = tuple(s // stride for s in size)
        if got == want:
            return
        side, low = self.input_size[0], want[0] * stride
        fixes = [
            f"use a volume of {low} to {low + stride - 1} voxels a side (e.g. {side}x{side}x{side})"
        ]
        if len(set(got)) == 1:
            fixes.append(f"build it with size={got[0] * stride} for this one")
        fixes.append(
            "use the global-pool head (head='pool', registered as cosmoflow-pool) for any size"
        )
        raise ConfigError(
            where,
            f"its dense head reads a {'x'.join(map(str, want))} map after {n} pools of 2 "
            f"(sized for {side}^3 volumes, size={side}), and a {text} volume gives "
            f"{'x'.join(map(str, got))}",
            ", ".join(fixes[:-1]) + " or " + fixes[-1],
        )


register_model("cosmoflow", CosmoFlow)
register_model("cosmoflow-pool", CosmoFlow, head="pool")
