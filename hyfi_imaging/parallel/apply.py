"""Spatial parallelism for any model in one call, and the loss of a tiled output.

Why :func:`apply_spatial`: ``spatialize`` needs the grid, this rank's tile, its
four neighbours and the spatial process group, and a launched
:class:`~.launch.ParallelContext` already knows all of them. In torchtitan's
spirit a user's own single-device model (a torchvision or timm network, a class
of one's own) becomes spatial with one call, ``ctx = apply_spatial(model, pc)``;
:class:`~.engine.ParallelModel` calls it the same way and adds pipeline stages
and data replicas on top.

Why a tiled loss (:func:`tiled_mean`): a classifier's output is pooled, so every
tile holds the same logits and computes the same loss. A dense model's output
(per-pixel logits, a mask) is itself tiled: each rank holds its tile of the
output map, plus a tail past the image's border where the image was padded.
The mean over the image's pixels is then each rank's sum over its *valid*
pixels, summed over the tiles, divided by the image's pixel count; in backward
each rank's pixels get ``1 / count`` of the incoming gradient with no message
at all -- :func:`~.collectives.all_reduce_replicated`'s adjoint. A loss that
reduces a tile by itself (``F.cross_entropy`` with its default ``mean``) would
average each tile on its own and is refused: a dense output needs a per-pixel
loss (``reduction="none"``), whose mean :func:`reduce_loss` takes exactly.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.collectives import all_reduce_replicated
from hyfi_imaging.parallel.halo import Neighbours
from hyfi_imaging.parallel.launch import ParallelContext
from hyfi_imaging.parallel.spatial import SpatialContext, spatialize

__all__ = [
    "OutputMap",
    "apply_spatial",
    "cross_entropy",
    "input_channels",
    "output_map",
    "output_shape",
    "reduce_loss",
    "spatialize_for",
    "tile_of",
    "tiled_mean",
]

log = logging.getLogger(__name__)


def input_channels(model: nn.Module) -> int:
    """Channels the model takes: its ``in_chans``, else the first ``Conv2d``'s input channels, else 3."""
    declared = getattr(model, "in_chans", None)
    if isinstance(declared, int):
        return declared
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    return int(conv.in_channels) if conv is not None else 3


def spatialize_for(model: nn.Module, pc: ParallelContext, **kwargs: object) -> SpatialContext:
    """Spatialize ``model`` in place for this rank's tile of ``pc``'s grid (even a 1x1 grid)."""
    nb = Neighbours(up=pc.peer(dy=-1), down=pc.peer(dy=1), left=pc.peer(dx=-1), right=pc.peer(dx=1))
    return spatialize(
        model,
        grid=pc.layout.sp,
        tile=pc.tile,
        neighbours=nb,
        group=pc.group("sp"),
        **kwargs,  # type: ignore[arg-type]
    )


def apply_spatial(
    model: nn.Module,
    pc: ParallelContext,
    *,
    image_size: tuple[int, int] | None = None,
    in_chans: int | None = None,
    align: int | None = None,
    overlap: bool = False,
    halo_depth: int = 1,
) -> SpatialContext | None:
    """Make ``model`` (in place) compute this rank's tile of ``pc.layout.sp``; returns the context.

    Every pixel-mixing layer becomes its spatial form (parameter names, state
    dicts and optimizers are unchanged); pools and BatchNorm reduce over all
    tiles. On a 1x1 grid the model is left alone and None is returned. With
    ``image_size`` the layers are prepared for that size now (else call
    ``ctx.set_image_size`` before the first forward). Feed each rank
    :func:`tile_of` the batch. ``in_chans`` defaults to
    :func:`input_channels`; ``align`` (the total stride tiles are aligned to)
    is measured when the model has no ``total_stride``. ``overlap``: each
    convolution computes its interior while its halos are in flight.
    ``halo_depth``: one exchange serves up to that many consecutive windowed
    layers (a deeper halo, its border recomputed; see ``spatialize``).

    OK::

        pc = init_parallel(Layout(sp=(2, 2)))           # under mpirun -np 4
        model = torchvision.models.resnet18(num_classes=2)
        ctx = apply_spatial(model, pc, image_size=(1024, 1024))
        logits = model(tile_of(images, ctx, (1024, 1024)))  # the same on every rank

    Error::

        apply_spatial(nn.Sequential(nn.Conv2d(3, 8, 3), nn.PixelShuffle(2)), pc)
        # ConfigError: module '1' (PixelShuffle) mixes pixels and has no spatial (tiled) form
    """
    done = next((n for n, m in model.named_modules() if hasattr(m, "hyfi_ctx")), None)
    if done is not None:
        raise ConfigError(
            f"module {done or type(model).__name__!r}",
            "is already spatial (apply_spatial or ParallelModel ran on this model)",
            "pass the plain single-device model: ParallelModel applies apply_spatial itself",
        )
    if pc.layout.sp_size == 1:
        log.info("apply_spatial: 1x1 grid, %s left as it is", type(model).__name__)
        return None
    ctx = spatialize_for(
        model,
        pc,
        in_chans=in_chans or input_channels(model),
        align=align,
        overlap=overlap,
        halo_depth=halo_depth,
        stage_cuts=pc.layout.pp > 1,
    )
    if image_size is not None:
        ctx.set_image_size((int(image_size[0]), int(image_size[1])))
    gy, gx = pc.layout.sp
    log.info(
        "apply_spatial: %s on a %dx%d grid, tile %s, tiles aligned to %d px, %d parameters "
        "summed over tiles, %d deep-halo runs",
        type(model).__name__, gy, gx, pc.tile, ctx.align, len(ctx.tile_param_names),
        len(ctx.deep_runs),
    )  # fmt: skip
    return ctx


def tile_of(images: Tensor, ctx: SpatialContext | None, image_hw: tuple[int, int]) -> Tensor:
    """This rank's tile of a whole ``(..., H, W)`` batch: padded at the bottom/right, then cut."""
    if ctx is None:
        return images
    ph, pw = ctx.padded_size(image_hw)
    padded = F.pad(images, (0, pw - images.shape[-1], 0, ph - images.shape[-2]))
    rows, cols = ctx.tile_slice(image_hw)
    return padded[..., rows, cols]


def output_shape(model: nn.Module, input_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Shape of ``model``'s output for an input of ``input_shape`` (None unless one tensor).

    Traced on the ``meta`` device (a meta copy unless the model is on it): no
    memory, no compute. Eval mode, in the parameters' dtype.
    """
    if any(p.device.type != "meta" for p in model.parameters()):
        model = copy.deepcopy(model).to("meta")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.empty(input_shape, device="meta", dtype=dtype))
    finally:
        model.train(was_training)
    return tuple(out.shape) if isinstance(out, Tensor) else None


@dataclass(frozen=True)
class OutputMap:
    """A model output that is a map of the image (dense), cut into tiles like the input.

    ``size``: the map's true (unpadded) size for the whole image; ``tile``: the
    size of every rank's tile of it.
    """

    size: tuple[int, int]
    tile: tuple[int, int]

    def tile_of(self, target: Tensor, ctx: SpatialContext) -> Tensor:
        """This rank's tile of a whole-image per-pixel ``(..., h, w)`` target (else ``target``)."""
        if target.dim() < 3 or tuple(target.shape[-2:]) != self.size:
            return target
        (gy, gx), (th, tw), (i, j) = ctx.grid, self.tile, ctx.tile
        padded = F.pad(target, (0, gx * tw - self.size[1], 0, gy * th - self.size[0]))
        return padded[..., i * th : (i + 1) * th, j * tw : (j + 1) * tw]


def output_map(
    meta_model: nn.Module,
    in_chans: int,
    image_hw: tuple[int, int],
    tile_hw: tuple[int, int],
) -> OutputMap | None:
    """The model's output map when its output is tiled (a map of the image), else None.

    Judged from shapes: an output whose last two dims change when the input
    shrinks from the whole image to a tile is a map; a pooled output does not.
    On a 1x1 grid (``tile_hw == image_hw``) nothing is tiled: None.
    """
    if tuple(tile_hw) == tuple(image_hw):
        return None
    whole = output_shape(meta_model, (1, in_chans, *image_hw))
    tile = output_shape(meta_model, (1, in_chans, *tile_hw))
    if whole is None or tile is None or len(whole) < 3 or whole[-2:] == tile[-2:]:
        return None
    return OutputMap((whole[-2], whole[-1]), (tile[-2], tile[-1]))


def tiled_mean(
    values: Tensor, ctx: SpatialContext | None, size: tuple[int, int] | None = None
) -> Tensor:
    """Mean over the whole image of per-pixel ``values`` (``(..., th, tw)``) of which this rank holds its tile.

    ``size`` is the map's true size (default: the image size set on ``ctx``, for
    a map at the input's resolution); pixels of the tile past it (padding) are
    left out. Every rank returns the same value; backward gives each pixel
    ``1 / count`` of the gradient without communicating. ``ctx`` None: ``values.mean()``.
    """
    if ctx is None:
        return values.mean()
    if size is None:
        if ctx.image_hw is None:
            raise ConfigError(
                "tiled_mean", "no map size given and no image size set", "pass size=(h, w)"
            )
        size = ctx.image_hw
    th, tw = values.shape[-2:]
    (gy, gx), (i, j) = ctx.grid, ctx.tile
    if gy * th < size[0] or gx * tw < size[1]:
        raise ConfigError(
            "tiled_mean",
            f"{gy}x{gx} tiles of {th}x{tw} cannot hold a {size[0]}x{size[1]} map",
            "pass the map's true size as size=(h, w)",
        )
    # The same slice on every rank (a full one where there is no tail): one graph everywhere.
    local = values[..., : max(size[0] - i * th, 0), : max(size[1] - j * tw, 0)].sum()
    count = values[..., 0, 0].numel() * size[0] * size[1]
    return all_reduce_replicated(local.reshape(1), ctx.group).reshape(()) / count


def reduce_loss(value: Tensor, ctx: SpatialContext | None, out_map: OutputMap | None) -> Tensor:
    """The batch loss from what a loss function returned.

    A scalar is the loss. Per-sample or per-pixel values are averaged: over the
    whole image's pixels, across tiles (:func:`tiled_mean`), when the output is
    a tiled map. A scalar from a tiled map is refused: it is one tile's loss.
    """
    tiled = out_map is not None and ctx is not None
    if value.dim() == 0:
        if tiled:
            raise ConfigError(
                "loss",
                "returns one number for a tile of the model's output map, not the image's loss",
                "return per-pixel losses (e.g. F.cross_entropy(..., reduction='none')): their "
                "mean over the whole image is taken across tiles",
            )
        return value
    if not tiled:
        return value.mean()
    assert out_map is not None
    if tuple(value.shape[-2:]) != out_map.tile:
        raise ConfigError(
            "loss",
            f"returns values of shape {tuple(value.shape)}, not per pixel of the output tile "
            f"{out_map.tile}",
            "return one loss per output pixel, the spatial dims last",
        )
    return tiled_mean(value, ctx, out_map.size)


def cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy: the batch mean for ``(N, K)`` logits; per-pixel values for ``(N, K, h, w)`` maps.

    The default loss of :class:`~.engine.ParallelModel` and ``verify_model``;
    :func:`reduce_loss` takes the per-pixel values' mean over the whole image.
    """
    if output.dim() > 2:
        return F.cross_entropy(output, target, reduction="none")
    return F.cross_entropy(output, target)
