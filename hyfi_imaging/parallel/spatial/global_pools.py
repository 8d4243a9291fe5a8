"""Spatial global pools (``nn.AdaptiveAvg/MaxPool*(1)``): the whole image's mean or maximum.

Why: local sums (maxima, -inf outside the image) all-reduced over the spatial
group give every rank the pooled vector; the reduction itself is the context's
(:meth:`SpatialContext.global_reduce`), shared with functional reductions.
"""

from __future__ import annotations

import torch
from torch import nn

from hyfi_imaging.parallel.functional import Site
from hyfi_imaging.parallel.spatial.base import _SpatialMixin

__all__ = [
    "SpatialGlobalAvgPool1d",
    "SpatialGlobalAvgPool2d",
    "SpatialGlobalAvgPool3d",
    "SpatialGlobalMaxPool1d",
    "SpatialGlobalMaxPool2d",
    "SpatialGlobalMaxPool3d",
]


class _GlobalPool(_SpatialMixin):
    """Global pooling: local sums (maxima, outside the image -inf), all-reduced; backward
    does not double-count."""

    hyfi_kind: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hyfi_ctx.global_reduce(x, Site(self.hyfi_kind, True, True), self.hyfi_path)


class SpatialGlobalAvgPool1d(_GlobalPool, nn.AdaptiveAvgPool1d):
    """Global average pooling of a signal (as :class:`SpatialGlobalAvgPool2d`)."""

    hyfi_kind = "avg"


class SpatialGlobalMaxPool1d(_GlobalPool, nn.AdaptiveMaxPool1d):
    """Global max pooling of a signal (as :class:`SpatialGlobalMaxPool2d`)."""

    hyfi_kind = "max"


class SpatialGlobalAvgPool2d(_GlobalPool, nn.AdaptiveAvgPool2d):
    """Global average pooling: local sums, all-reduced; backward does not double-count."""

    hyfi_kind = "avg"


class SpatialGlobalMaxPool2d(_GlobalPool, nn.AdaptiveMaxPool2d):
    """Global max pooling: local maxima (outside the image is -inf), all-reduced with MAX."""

    hyfi_kind = "max"


class SpatialGlobalAvgPool3d(_GlobalPool, nn.AdaptiveAvgPool3d):
    """Global average pooling of a volume (as :class:`SpatialGlobalAvgPool2d`)."""

    hyfi_kind = "avg"


class SpatialGlobalMaxPool3d(_GlobalPool, nn.AdaptiveMaxPool3d):
    """Global max pooling of a volume (as :class:`SpatialGlobalMaxPool2d`)."""

    hyfi_kind = "max"
