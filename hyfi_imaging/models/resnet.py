"""ResNet (v1.5) with torchvision's parameter names, for whole-image training.

Why torchvision's names: ImageNet weights published for torchvision load into
these models with ``load_state_dict`` unchanged (``conv1``, ``bn1``,
``layer1.0.conv1``, ``layer1.0.downsample.0`` ...). Two additions do not
change the state dict: ``flatten`` (an ``nn.Flatten`` child, so that the
top-level children chain to ``forward`` without hidden functional code) and
the ``width`` multiplier.

Why adaptive global pooling: a whole slide is 8K-16K pixels on a side and
never 224; ``nn.AdaptiveAvgPool2d(1)`` makes any input size valid. The
network's total stride is 32 (stem conv 2 x max-pool 2 x three stride-2
stages); spatial tiles are aligned to it.

Stride sits on the 3x3 convolution of the bottleneck (the "v1.5" variant
torchvision uses), so no pixel is skipped by a strided 1x1.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models.registry import (
    ChainModel,
    CheckpointedBlock,
    check_positive,
    register_model,
)

__all__ = ["BasicBlock", "Bottleneck", "ResNet"]


class _ResidualBlock(CheckpointedBlock):
    """conv-bn-relu units per ``kernels``, a shortcut, a final ReLU.

    Subclasses are data: ``kernels`` (kernel size of each conv) and
    ``expansion`` (output channels / ``planes``). The stride is put on the
    first 3x3 conv; every conv but the last has ``planes`` outputs.
    """

    kernels: ClassVar[tuple[int, ...]]
    expansion: ClassVar[int]

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        stride_at = self.kernels.index(3)
        n = len(self.kernels)
        in_ch = inplanes
        for i, k in enumerate(self.kernels, start=1):
            out_ch = planes * self.expansion if i == n else planes
            s = stride if i - 1 == stride_at else 1
            self.add_module(
                f"conv{i}", nn.Conv2d(in_ch, out_ch, k, stride=s, padding=k // 2, bias=False)
            )
            self.add_module(f"bn{i}", nn.BatchNorm2d(out_ch))
            if i == 1:
                # One shared ReLU module as in torchvision (it has no state).
                self.relu = nn.ReLU(inplace=True)
            in_ch = out_ch
        self.downsample = downsample
        self.stride = stride

    @property
    def unit_starts(self) -> tuple[str, ...]:
        """Each unit starts at its module's first call: the shortcut's (it runs first, a
        unit of its own), then each convolution's."""
        shortcut = [] if self.downsample is None else [_first_leaf("downsample", self.downsample)]
        return (*shortcut, *(f"conv{i}" for i in range(1, len(self.kernels) + 1)))

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        """The BatchNorm before the residual add (zero-initialised on request)."""
        bn: nn.BatchNorm2d = getattr(self, f"bn{len(self.kernels)}")
        return bn

    def _unit(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """conv ``i``, its BatchNorm and the ReLU (not after the last conv)."""
        out = getattr(self, f"bn{i}")(getattr(self, f"conv{i}")(x))
        return self.relu(out) if i < len(self.kernels) else out

    def forward_block(self, x: torch.Tensor) -> torch.Tensor:
        """Residual unit: the shortcut, the conv-BN(-ReLU) units, ``relu(out + shortcut)``.

        Under the ``"deep"`` policy the shortcut and each unit are checkpointed again
        (:meth:`~.registry.CheckpointedBlock.unit`), and the sum and its ReLU run after
        them, in place (BatchNorm keeps its input, not its output), the ReLU keeping a
        mask (:class:`_ReLUKeepingMask`). At the block's recomputation in backward its peak
        is then the block's input, the output's gradient, the last convolution's output and
        its gradient (ResNet-50's ``layer1``: four maps of 256 channels, six before). The
        shortcut runs first, so that its output is not alive beside the last unit's maps.
        """
        identity = x
        if self.downsample is not None:
            identity = self.unit(self.downsample, x, modules=[self.downsample])
        out = x
        for i in range(1, len(self.kernels) + 1):
            parts = (getattr(self, f"conv{i}"), getattr(self, f"bn{i}"))
            out = self.unit(self._unit, i, out, modules=parts)
        # In place where it promotes nothing (a stage's input may arrive in another dtype).
        out = out.add_(identity) if out.dtype == identity.dtype else out + identity
        if self.grad_checkpointing and self.checkpoint_policy == "deep" and torch.is_grad_enabled():
            return _ReLUKeepingMask.apply(out)  # no mask to make where nothing back-propagates
        return self.relu(out)


class _ReLUKeepingMask(torch.autograd.Function):
    """``relu_(x)`` that keeps a boolean mask of the zeroed positions for backward, not its
    output (as ``nn.ReLU`` does): half the bytes of a bfloat16 map, a quarter of a float32
    one. Where the output would not be kept anyway (a recomputed block's last unit under
    ``checkpointing: deep``) that is the difference at the block's backward. The gradient
    is ``threshold_backward``'s: zero where the output is ``<= 0``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x.relu_()
        ctx.mark_dirty(x)
        ctx.save_for_backward(x.le(0))
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (zeroed,) = ctx.saved_tensors
        # ``where``, not ``masked_fill``: its output takes the layout threshold_backward's
        # does (masked_fill's copies the gradient's), so a channels-last model's next
        # convolution backward runs the same kernel, bit for bit.
        return torch.where(zeroed, 0, grad)


def _first_leaf(path: str, module: nn.Module) -> str:
    """The path of the first module without children at or below ``module`` (at ``path``),
    in module order: the module itself where it is a leaf (a shortcut of one convolution)."""
    name = next(n for n, m in module.named_modules() if not any(m.children()))
    return f"{path}.{name}" if name else path


class BasicBlock(_ResidualBlock):
    """Two 3x3 convs (ResNet-18/34)."""

    kernels = (3, 3)
    expansion = 1


class Bottleneck(_ResidualBlock):
    """1x1 - 3x3 - 1x1 with 4x expansion (ResNet-50/101/152)."""

    kernels = (1, 3, 1)
    expansion = 4


class ResNet(ChainModel):
    """ResNet with torchvision-compatible names; any input size; ``width`` scales channels.

    Args:
        block: :class:`BasicBlock` or :class:`Bottleneck`.
        layers: blocks per stage, e.g. ``(3, 4, 6, 3)`` for ResNet-50.
        num_classes: logits produced by ``fc``.
        in_chans: input channels (3 for RGB, 1 for grey).
        width: channel multiplier; stage widths ``round(64 * width * 2**i)`` (at least 1).
        zero_init_last_bn: start every residual branch at zero (Goyal et al. 2017).
        global_pool: ``"avg"`` (torchvision) or ``"max"``: global max pooling suits
            whole-slide tasks where the evidence is a few small regions (multiple-
            instance style); the module keeps torchvision's name ``avgpool`` either way.

    ``total_stride`` is 32. ``forward_features`` returns ``layer4``'s output.
    """

    total_stride = 32

    def __init__(
        self,
        block: type[_ResidualBlock],
        layers: tuple[int, ...] | list[int],
        *,
        num_classes: int = 1000,
        in_chans: int = 3,
        width: float = 1.0,
        zero_init_last_bn: bool = False,
        global_pool: str = "avg",
    ) -> None:
        super().__init__()
        if global_pool not in ("avg", "max"):
            raise ConfigError(
                "ResNet", f"global_pool={global_pool!r} is not known", "use 'avg' or 'max'"
            )
        check_positive(
            "ResNet", num_classes=num_classes, in_chans=in_chans, width=width, stages=len(layers)
        )
        check_positive("ResNet", **{f"layers[{i}]": n for i, n in enumerate(layers)})
        self.num_classes = num_classes
        self.in_chans = in_chans
        widths = [max(1, round(64 * width * 2**i)) for i in range(len(layers))]
        self.inplanes = max(1, round(64 * width))

        self.conv1 = nn.Conv2d(in_chans, self.inplanes, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        for i, (planes, count) in enumerate(zip(widths, layers, strict=True)):
            self.add_module(
                f"layer{i + 1}", self._make_layer(block, planes, count, stride=1 if i == 0 else 2)
            )
        self.num_features = self.inplanes
        self.head_start = 4 + len(layers)
        self.avgpool: nn.Module = (
            nn.AdaptiveAvgPool2d(1) if global_pool == "avg" else nn.AdaptiveMaxPool2d(1)
        )
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(self.num_features, num_classes)
        self.total_stride = 4 * 2 ** (len(layers) - 1)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_last_bn:
            for b in self.blocks():
                if isinstance(b, _ResidualBlock):
                    nn.init.zeros_(b.last_bn.weight)

    def _make_layer(
        self, block: type[_ResidualBlock], planes: int, count: int, stride: int
    ) -> nn.Sequential:
        downsample = None
        out_ch = planes * block.expansion
        if stride != 1 or self.inplanes != out_ch:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, out_ch, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_ch),
            )
        blocks = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = out_ch
        blocks += [block(out_ch, planes) for _ in range(1, count)]
        return nn.Sequential(*blocks)


# Variants are data: (block, blocks per stage) as in He et al. 2016, Table 1.
_VARIANTS: dict[str, tuple[type[_ResidualBlock], tuple[int, ...]]] = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet34": (BasicBlock, (3, 4, 6, 3)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
    "resnet101": (Bottleneck, (3, 4, 23, 3)),
    "resnet152": (Bottleneck, (3, 8, 36, 3)),
}
for _name, (_block, _layers) in _VARIANTS.items():
    register_model(_name, ResNet, block=_block, layers=_layers)
