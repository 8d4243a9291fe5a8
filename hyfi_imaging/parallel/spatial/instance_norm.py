"""Spatial InstanceNorm (``nn.InstanceNorm2d``/``3d``): statistics per sample and channel, whole image.

Why no new arithmetic: an instance's statistics are GroupNorm's with one group per
channel, so the forward is :func:`~hyfi_imaging.parallel.spatial.norms._sample_norm`
(the all-reduced sum, then the centred squares, outside the image excluded; autograd
gives the exact adjoint). What is InstanceNorm's own is its running statistics: with
``track_running_stats`` a training step moves them, as torch does, towards the batch
mean of the instances' means and unbiased variances by ``momentum`` (torch passes 0 for
``momentum=None``: they stay), and eval normalises each pixel with them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.spatial.base import _SpatialMixin
from hyfi_imaging.parallel.spatial.norms import _sample_norm

__all__ = ["SpatialInstanceNorm2d", "SpatialInstanceNorm3d"]


class _SpatialInstanceNorm(_SpatialMixin):
    """InstanceNorm with each instance's statistics over the whole image (all tiles)."""

    training: bool
    running_mean: torch.Tensor | None
    running_var: torch.Tensor | None
    weight: Any
    bias: Any
    affine: bool
    track_running_stats: bool
    momentum: float | None
    eps: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != self.hyfi_ctx.nd + 2:
            raise ConfigError(
                f"module {self.hyfi_path!r} ({type(self).__name__})",
                f"sees a {x.dim()}-D input; its spatial form normalises batched "
                f"(N, C, *spatial) tiles of {self.hyfi_ctx.nd} spatial dims",
                "give it a batch dimension",
            )
        weight, bias = (self.weight, self.bias) if self.affine else (None, None)
        if not self.training and self.track_running_stats:
            # Per pixel with the running statistics; outside the image may hold anything.
            return F.instance_norm(
                self._mask(x, 0.0),
                self.running_mean,
                self.running_var,
                weight,
                bias,
                False,
                0.0,
                self.eps,
            )
        y, mean, var, count = _sample_norm(self, x, int(x.shape[1]), self.eps, weight, bias)
        if self.training and self.track_running_stats and self.momentum:
            assert self.running_mean is not None and self.running_var is not None
            with torch.no_grad():
                self.running_mean.lerp_(mean.mean(0).to(self.running_mean.dtype), self.momentum)
                unbiased = var * (count / max(count - 1, 1))
                self.running_var.lerp_(unbiased.mean(0).to(self.running_var.dtype), self.momentum)
        return y


class SpatialInstanceNorm2d(_SpatialInstanceNorm, nn.InstanceNorm2d):
    """``nn.InstanceNorm2d`` with each instance's statistics over the whole image."""


class SpatialInstanceNorm3d(_SpatialInstanceNorm, nn.InstanceNorm3d):
    """``nn.InstanceNorm3d`` with each instance's statistics over the whole volume."""
