"""``nn.Flatten`` into a dense head: the small last map gathered whole onto every rank.

Why: the head's first dense layer weighs every pixel of the whole map, so the
junction gathers it (CosmoFlow); ``tile_shaped`` gives the plain model the same
shapes for planning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from hyfi_imaging.parallel.collectives import gather_replicated
from hyfi_imaging.parallel.spatial.base import _SpatialMixin

if TYPE_CHECKING:
    from hyfi_imaging.parallel.spatial.context import SpatialContext

__all__ = ["SpatialFlatten", "tile_shaped"]


class SpatialFlatten(_SpatialMixin, nn.Flatten):
    """``nn.Flatten`` of a tiled map into a dense head (CosmoFlow): the junction to the head.

    The head's first dense layer weighs every pixel of the whole map, so the
    (small, last) map is gathered from all tiles onto every rank, its padding
    cut off, and flattened; the head then runs replicated, as after a global
    pool (backward: each tile's gradient is its slice of the whole gradient,
    :func:`~.collectives.gather_replicated`). Only ``nn.Flatten`` of all dims
    from 1 on does this; any other flatten of a tile is refused by the watch.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.hyfi_ctx
        whole = gather_replicated(
            x,
            ctx.grid,
            ctx.tile,
            ctx.size_of(self.hyfi_path),
            ctx.group,
            partial=self.hyfi_path in ctx.rejoined_pools,
        )
        return whole.flatten(self.start_dim, self.end_dim)


class _WholeFlatten(nn.Module):
    """Shape stand-in of a :class:`SpatialFlatten` in a plain model run on a tile's shape: the
    whole map's flattened size (zeros), so that the layers after it get the shapes they will
    get (pipeline stage shapes, layer timing)."""

    def __init__(self, size: tuple[int, ...]) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:2], *self.size).flatten(1)


def tile_shaped(plain: nn.Module, ctx: SpatialContext) -> nn.Module:
    """``plain`` (a copy of the unspatialized model), changed in place to run on one tile's
    shape as its spatial form does: each gathering flatten outputs the whole map's size.

    The engine plans pipeline stages and times layers on a tile-shaped input of the plain
    model; without this, a head sized for the whole map would not fit a tile's map.
    """
    for path in sorted(ctx.flatten_paths):
        parent, _, leaf = path.rpartition(".")
        owner = plain.get_submodule(parent) if parent else plain
        setattr(owner, leaf, _WholeFlatten(ctx.size_of(path)))
    return plain


def _is_gathering_flatten(m: nn.Module) -> bool:
    """``nn.Flatten`` of every dim from 1 on (a dense head's input): see :class:`SpatialFlatten`."""
    kinds = (nn.Flatten, SpatialFlatten)
    return type(m) in kinds and getattr(m, "start_dim", 0) == 1 and getattr(m, "end_dim", 0) == -1
