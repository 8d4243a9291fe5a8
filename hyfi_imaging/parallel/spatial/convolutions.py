"""Spatial convolutions (``nn.Conv1d/2d/3d``, timm's ``Conv2dSame``): halo exchanged, padding 0.

Why a class per torch layer on one mixin: the class swap keeps parameter names
and state dicts; the forward is the window of :mod:`.base` and the windowed
autograd Function of :mod:`hyfi_imaging.parallel.windowed` (tile + halo strips saved).
"""

from __future__ import annotations

import torch
from torch import nn

from hyfi_imaging.parallel import windowed
from hyfi_imaging.parallel.geometry import LayerGeom, layer_geom
from hyfi_imaging.parallel.spatial.base import _SpatialMixin

__all__ = ["SpatialConv1d", "SpatialConv2d", "SpatialConv2dSame", "SpatialConv3d"]


class _WindowedConv(_SpatialMixin):
    """The forward of a spatial convolution, 2-D or 3-D."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    groups: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, self.weight, self.bias)

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """This layer's window with ``weight`` and ``bias`` (its own, or a functional
        convolution's: see :meth:`SpatialContext.windowed`)."""
        x, win = self._prepare(x, 0.0)
        return windowed.conv(x, weight, bias, win, self.groups)


class SpatialConv1d(_WindowedConv, nn.Conv1d):
    """``nn.Conv1d`` on a segment of a signal: as :class:`SpatialConv2d`, along the length."""


class SpatialConv2d(_WindowedConv, nn.Conv2d):
    """``nn.Conv2d`` on a tile: halo exchanged, padding 0, only tile + halo strips saved."""


class SpatialConv3d(_WindowedConv, nn.Conv3d):
    """``nn.Conv3d`` on a sub-volume: as :class:`SpatialConv2d`, over three spatial dims."""


class SpatialConv2dSame(SpatialConv2d):
    """timm's ``Conv2dSame`` (TensorFlow 'SAME' padding, by the input's size): its window
    geometry is that of the whole image's input at this layer, from the trace."""

    def _geoms(self) -> tuple[LayerGeom, ...]:
        return layer_geom(self, self.hyfi_ctx.size_of(self.hyfi_path), tf_same=True)
