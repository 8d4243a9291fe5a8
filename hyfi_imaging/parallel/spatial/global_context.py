"""Spatial global-context attention (timm's ``GlobalContext``, GCNet): a softmax over the image.

Why it is exact on tiles: the block's context is a weighted mean of the map, ``sum_p x_p
exp(a_p) / sum_p exp(a_p)`` over every pixel ``p`` of the image, with ``a`` a 1x1
convolution of the map (``use_attn``), or the plain mean without it. Both sums are sums
over tiles, all-reduced over the spatial group. The softmax's shift (the largest ``a``,
which keeps ``exp`` finite) is a global maximum, all-reduced too and held constant: the
softmax does not depend on it, so no gradient flows through it, and one process computes
the same quotient. Pixels outside the image weigh ``exp(-inf) = 0``. The context is then
used again on every pixel of the tile (a gate multiplies the map, an addend is added), so
each rank's gradient of the two sums is its tile's share and the backward sums the shares
(``partial``, as for squeeze-excite's pooled vector); the block's parameters, the MLPs' on
the replicated context included, see tile data and their gradients are summed over the tiles
like every other such parameter's.

timm is optional: the spatial class is made from the block's own class when a model has one
(:func:`spatial_global_context`), keeping its parameters, names and state dict.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyfi_imaging.parallel.collectives import all_reduce_replicated
from hyfi_imaging.parallel.spatial.base import _SpatialMixin, _tail

__all__ = ["is_global_context", "spatial_global_context"]


def is_global_context(m: nn.Module) -> bool:
    """timm's ``GlobalContext`` block (GCNet) itself, by class name and module (timm is
    optional). Not a subclass: its forward may be another, which the watch then judges."""
    cls = type(m)
    return cls.__name__ == "GlobalContext" and cls.__module__.startswith("timm.")


class _SpatialGlobalContext(_SpatialMixin):
    """timm's ``GlobalContext`` with its context over the whole image (all tiles)."""

    conv_attn: nn.Module | None
    mlp_scale: nn.Module | None
    mlp_add: nn.Module | None
    gate: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.hyfi_ctx
        nd = ctx.nd
        dims = tuple(range(-nd, 0))
        valid = ctx._valid(self.hyfi_path, x.shape[-nd:])
        inside = _tail(x, valid, 0.0)
        if self.conv_attn is None:
            total = all_reduce_replicated(inside.sum(dims, keepdim=True), ctx.group, partial=True)
            context = total / math.prod(ctx.size_of(self.hyfi_path))
        else:
            attn = _tail(self.conv_attn(x), valid, -math.inf)  # (N, 1, *tile)
            with torch.no_grad():  # the softmax's shift: a constant (see the module doc)
                shift = attn.amax(dims, keepdim=True)
                dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=ctx.group)
            weights = torch.exp(attn - shift)  # 0 outside the image
            norm = all_reduce_replicated(weights.sum(dims, keepdim=True), ctx.group, partial=True)
            weighted = (inside * weights).sum(dims, keepdim=True)
            context = all_reduce_replicated(weighted, ctx.group, partial=True) / norm
        if self.mlp_scale is not None:
            x = x * self.gate(self.mlp_scale(context))
        if self.mlp_add is not None:
            x = x + self.mlp_add(context)
        return x


_MADE: dict[type[nn.Module], type[nn.Module]] = {}


def spatial_global_context(cls: type[nn.Module]) -> type[nn.Module]:
    """The spatial form of ``cls`` (timm's ``GlobalContext``), made once."""
    if cls not in _MADE:
        spatial: Any = type(f"Spatial{cls.__name__}", (_SpatialGlobalContext, cls), {})
        spatial.__module__ = __name__
        _MADE[cls] = spatial
    return _MADE[cls]
