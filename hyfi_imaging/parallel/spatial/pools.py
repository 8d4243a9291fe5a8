"""Spatial max and average pools: windowed layers whose fill outside the image is the pool's.

Why: a max-pool reads -inf outside the image and an average pool 0 (or excludes
it from the divisor, as PyTorch's ``count_include_pad=False`` does), so the tile
result equals the whole image's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hyfi_imaging.parallel import windowed
from hyfi_imaging.parallel.spatial.base import _SpatialMixin

__all__ = [
    "SpatialAvgPool1d",
    "SpatialAvgPool2d",
    "SpatialAvgPool3d",
    "SpatialMaxPool1d",
    "SpatialMaxPool2d",
    "SpatialMaxPool3d",
]


class _WindowedMaxPool(_SpatialMixin):
    """Max-pooling on a tile: outside the image is -inf, as PyTorch pads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return windowed.max_pool(*self._prepare(x, -math.inf))


class SpatialMaxPool1d(_WindowedMaxPool, nn.MaxPool1d):
    """``nn.MaxPool1d`` on a segment: outside the signal is -inf, as PyTorch pads."""


class SpatialMaxPool2d(_WindowedMaxPool, nn.MaxPool2d):
    """``nn.MaxPool2d`` on a tile: outside the image is -inf, as PyTorch pads."""


class SpatialMaxPool3d(_WindowedMaxPool, nn.MaxPool3d):
    """``nn.MaxPool3d`` on a sub-volume: outside the volume is -inf, as PyTorch pads."""


class _WindowedAvgPool(_SpatialMixin):
    """Average-pooling on a tile, honouring ``count_include_pad`` and ``divisor_override``."""

    count_include_pad: bool
    ceil_mode: bool
    divisor_override: int | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, win = self._prepare(x, 0.0)
        exclude = None
        padded = any(g.padding for g in self.hyfi_geoms) and not self.count_include_pad
        if not self.divisor_override and (padded or self.ceil_mode):
            # Divide by the number of window pixels inside the image, as PyTorch does (for a
            # window overhanging the end in ceil_mode too; layer_geom refuses what differs).
            carry = self._carry(0)
            origin = tuple(
                i * t - win.halo[2 * k] - carry[2 * k]
                for k, (i, t) in enumerate(zip(self.hyfi_ctx.tile, self._tile_hw(x), strict=True))
            )
            exclude = (origin, self.hyfi_ctx.size_of(self.hyfi_path))
        return windowed.avg_pool(
            x, win, divisor_override=self.divisor_override, exclude_padding_at=exclude
        )


class SpatialAvgPool1d(_WindowedAvgPool, nn.AvgPool1d):
    """``nn.AvgPool1d`` on a segment, honouring ``count_include_pad`` (it has no
    ``divisor_override``)."""

    divisor_override = None


class SpatialAvgPool2d(_WindowedAvgPool, nn.AvgPool2d):
    """``nn.AvgPool2d`` on a tile, honouring ``count_include_pad`` and ``divisor_override``."""


class SpatialAvgPool3d(_WindowedAvgPool, nn.AvgPool3d):
    """``nn.AvgPool3d`` on a sub-volume, as :class:`SpatialAvgPool2d`."""
