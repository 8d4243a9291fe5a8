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

import contextlib
import logging
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from types import EllipsisType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.collectives import all_reduce_replicated
from hyfi_imaging.parallel.grad_sync import TileGradSync
from hyfi_imaging.parallel.halo import trailing
from hyfi_imaging.parallel.launch import ParallelContext
from hyfi_imaging.parallel.meta import meta_copy
from hyfi_imaging.parallel.spatial import SpatialContext, spatialize
from hyfi_imaging.parallel.spatial.trace import split_image

__all__ = [
    "OutputMap",
    "TiledLoss",
    "apply_spatial",
    "cross_entropy",
    "input_channels",
    "output_map",
    "output_shape",
    "reduce_loss",
    "spatialize_for",
    "tile_of",
    "tiled_mean",
    "tiled_sum",
]

log = logging.getLogger(__name__)


def input_channels(model: nn.Module) -> int:
    """Channels the model takes: its ``in_chans``, else those of the first convolution its
    forward calls (``Conv1d/2d/3d`` or transposed; traced on the meta device), else 3.

    The first one *registered* was taken before: a head registered before the stem traced
    the model with the head's channels and refused a valid size, and a transposed first
    layer failed at the first step.
    """
    declared = getattr(model, "in_chans", None)
    if isinstance(declared, int):
        return declared
    conv = next((m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
    if conv is None:
        return 3
    meta = meta_copy(model)
    called: list[int] = []

    def first(m: nn.Module, _args: tuple[Any, ...]) -> None:
        called.append(int(m.in_channels))  # type: ignore[arg-type]
        raise _FirstConv

    for m in meta.modules():
        if isinstance(m, nn.modules.conv._ConvNd):
            m.register_forward_pre_hook(first)
    with contextlib.suppress(Exception):  # the model's own code: only the first call is read
        output_shape(meta, (1, int(conv.in_channels), *(64,) * len(conv.kernel_size)))
    return called[0] if called else int(conv.in_channels)


class _FirstConv(Exception):
    """Ends :func:`input_channels`'s trace at the first convolution."""


def spatialize_for(model: nn.Module, pc: ParallelContext, **kwargs: object) -> SpatialContext:
    """Spatialize ``model`` in place for this rank's tile of ``pc``'s grid (even a 1x1 grid)."""
    return spatialize(
        model,
        grid=pc.grid,
        tile=pc.tile,
        neighbours=pc.neighbours(),
        group=pc.group("sp"),
        **kwargs,  # type: ignore[arg-type]
    )


def apply_spatial(
    model: nn.Module,
    pc: ParallelContext,
    *,
    image_size: Sequence[int] | None = None,
    in_chans: int | None = None,
    align: int | None = None,
    overlap: bool = False,
    halo_depth: int = 1,
    reduce_grads: bool = True,
    backward_bands: bool = False,
) -> SpatialContext | None:
    """Make ``model`` (in place) compute this rank's tile of ``pc.grid``; returns the context.

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
    ``backward_bands``: each convolution's backward runs in bands of output
    rows (band-sized transients instead of tile-sized ones, at more kernel
    calls: a memory tool, see :class:`~.engine.ParallelPlan`).
    ``reduce_grads``: at the end of every backward, sum the gradients of the
    parameters that see tiles over the grid (:class:`~.grad_sync.TileGradSync`),
    so that a plain ``loss.backward(); optimizer.step()`` trains exactly as one
    process would; off only for an engine that reduces them itself
    (:class:`~.engine.ParallelModel` with FSDP2).

    OK::

        pc = init_parallel(Layout(sp=(2, 2)))           # under mpirun -np 4
        model = torchvision.models.resnet18(num_classes=2)
        ctx = apply_spatial(model, pc, image_size=(1024, 1024))
        logits = model(tile_of(images, ctx, (1024, 1024)))  # the same on every rank
        F.cross_entropy(logits, labels).backward()  # tile gradients summed over the grid
        optimizer.step()

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
    if math.prod(pc.grid) == 1:
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
        backward_bands=backward_bands,
        image_size=image_size,
    )
    if image_size is not None:
        ctx.set_image_size(tuple(int(v) for v in image_size))
    plain = {path for path, m in model.named_modules() if not hasattr(m, "hyfi_ctx")}
    model.register_forward_pre_hook(partial(_check_tile, ctx, plain), with_kwargs=True)
    if reduce_grads:
        ctx.grad_syncs = weakref.WeakKeyDictionary(
            {model: TileGradSync(model, ctx.tile_param_names, ctx.group)}
        )
    log.info(
        "apply_spatial: %s on a %s grid, tile %s, tiles aligned to %d px, %d parameters "
        "summed over tiles, %d deep-halo runs",
        type(model).__name__, "x".join(map(str, pc.grid)), pc.tile, ctx.align,
        len(ctx.tile_param_names), len(ctx.deep_runs),
    )  # fmt: skip
    return ctx


def _pad_end(t: Tensor, size: Sequence[int]) -> Tensor:
    """``t`` padded with zeros at the end of its last ``len(size)`` dims to ``size``."""
    nd = len(size)
    pad = [v for k in reversed(range(nd)) for v in (0, size[k] - t.shape[k - nd])]
    return F.pad(t, pad) if any(pad) else t


def tile_of(images: Tensor, ctx: SpatialContext | None, image_hw: Sequence[int]) -> Tensor:
    """This rank's tile of a whole ``(..., H, W)`` batch (``(..., D, H, W)`` for volumes):
    padded at the far end of each axis, then cut. ``image_hw`` must be the images' size; the
    context is set to it (:meth:`~.spatial.SpatialContext.set_image_size`) where it was set
    to another: the layers mask and exchange for the image they are given."""
    if ctx is None:
        return images
    image_hw = tuple(int(v) for v in image_hw)
    nd = len(image_hw)
    if tuple(images.shape[-nd:]) != image_hw:
        raise ConfigError(
            f"tile_of(images, ctx, {image_hw})",
            f"images are {'x'.join(map(str, images.shape[-nd:]))}, not the size given "
            "(a smaller size would crop them, a larger one pad them)",
            "give the images' own size: tile_of(images, ctx, images.shape[2:])",
        )
    if ctx.image_hw != image_hw:
        ctx.set_image_size(image_hw)
    padded = _pad_end(images, ctx.padded_size(image_hw))
    return padded[trailing(ctx.tile_slice(image_hw))]


def _check_tile(
    ctx: SpatialContext,
    plain: set[str],
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Refuse a tile the context's image size does not give: the layers would mask and
    exchange for another image (31x23 images through a model set for 32x24 gave 0.67 relative
    error in training, without a word); and a layer with a tiled form put into the model
    after ``apply_spatial`` (``plain``: the paths of the modules it left plain, such as a
    squeeze-excite's 1x1 convolution on the pooled vector), which would run on the tile as a
    plain layer (0.47 relative). By path, so that a deep copy of the model passes; a deep copy
    gets the gradient rule of its own parameters."""
    from hyfi_imaging.parallel.spatial.kinds import _has_spatial_form

    if ctx.grad_syncs is not None and model not in ctx.grad_syncs:
        # A deep copy of the model (it shares the context): its parameters are others, and a
        # copy that trains (a student) trained on its tiles' shares (0.2 relative)
        ctx.grad_syncs[model] = TileGradSync(model, ctx.tile_param_names, ctx.group)
    for path, m in model.named_modules():
        if path not in plain and not hasattr(m, "hyfi_ctx") and _has_spatial_form(m):
            raise ConfigError(
                f"module {path!r} ({type(m).__name__})",
                "was put into the model after apply_spatial: it would run on the tile as a "
                "plain layer",
                "build the whole model first, then call apply_spatial",
            )
    nd = len(ctx.grid)
    x, _, _ = split_image(args, kwargs, nd)
    if x is None:
        return
    if ctx.image_hw is None:
        raise ConfigError(
            "apply_spatial",
            "the model runs before an image size was given",
            "pass image_size=(H, W) to apply_spatial, or cut the images with "
            "hyfi.tile_of(images, ctx, (H, W)), which sets it",
        )
    want = ctx.tile_size(ctx.image_hw)
    got = tuple(int(v) for v in x.shape[-nd:])
    if got != tuple(want):
        size = "x".join(map(str, ctx.image_hw))
        raise ConfigError(
            "apply_spatial",
            f"the model got a {'x'.join(map(str, got))} tile, but {size} images give tiles of "
            f"{'x'.join(map(str, want))} on this grid",
            "cut each batch with hyfi.tile_of(images, ctx, images.shape[2:]) (it sets the "
            "size), or call ctx.set_image_size((H, W)) for images of another size",
        )


def output_shape(model: nn.Module, input_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Shape of ``model``'s output for an input of ``input_shape`` (None unless one tensor).

    Traced on the ``meta`` device (a meta copy unless the model is on it): no
    memory, no compute. Eval mode, in the parameters' dtype.
    """
    if any(p.device.type != "meta" for p in model.parameters()):
        model = meta_copy(model)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.device("meta"):
            out = model(torch.empty(input_shape, device="meta", dtype=dtype))
    finally:
        model.train(was_training)
    return tuple(out.shape) if isinstance(out, Tensor) else None


@dataclass(frozen=True)
class OutputMap:
    """A model output that is a map of the image (dense), cut into tiles like the input.

    ``size``: the map's true (unpadded) size for the whole image; ``tile``: the
    size of every rank's tile of it (``(h, w)``, or ``(d, h, w)`` for volumes).
    """

    size: tuple[int, ...]
    tile: tuple[int, ...]

    def tile_of(self, target: Tensor, ctx: SpatialContext) -> Tensor:
        """This rank's tile of a whole-image per-pixel ``(..., h, w)`` (or per-voxel
        ``(..., d, h, w)``) target (else ``target``)."""
        nd = len(self.size)
        if target.dim() < nd + 1 or tuple(target.shape[-nd:]) != self.size:
            return target
        padded = _pad_end(target, [g * t for g, t in zip(ctx.grid, self.tile, strict=True)])
        cut = [slice(i * t, (i + 1) * t) for i, t in zip(ctx.tile, self.tile, strict=True)]
        return padded[trailing(cut)]


def output_map(
    meta_model: nn.Module,
    in_chans: int,
    image_hw: Sequence[int],
    tile_hw: Sequence[int],
) -> OutputMap | None:
    """The model's output map when its output is tiled (a map of the image), else None.

    Judged from shapes: an output whose spatial dims (the last two, or three for
    volumes) change when the input shrinks from the whole image to a tile is a
    map; a pooled output does not. On a 1x1 grid (``tile_hw == image_hw``)
    nothing is tiled: None.
    """
    if tuple(tile_hw) == tuple(image_hw):
        return None
    nd = len(image_hw)
    whole = output_shape(meta_model, (1, in_chans, *image_hw))
    try:
        tile = output_shape(meta_model, (1, in_chans, *tile_hw))
    except RuntimeError as err:  # the plain model cannot run on a tile this small
        raise ConfigError(
            f"tiles of {'x'.join(map(str, tile_hw))} px",
            f"are too small for a layer of the model ({str(err).splitlines()[0]})",
            "use fewer tiles along the short axis or a larger image",
        ) from None
    if whole is None or tile is None or len(whole) < nd + 1 or whole[-nd:] == tile[-nd:]:
        return None
    if not _keeps_grid(meta_model, in_chans, tuple(tile_hw), tuple(tile[-nd:])):
        path, seen, made = _first_unscaled(meta_model, (1, in_chans, *tile_hw))
        raise ConfigError(
            f"module {path!r}",
            f"maps a {'x'.join(map(str, seen))} tile to {'x'.join(map(str, made))} px, not to "
            "the tile over a stride (or times a scale): the model's output is a map, and a "
            "map cut into tiles needs every layer to keep the tile's grid (the whole model maps "
            f"{'x'.join(map(str, tile_hw))} to {'x'.join(map(str, tile[-nd:]))})",
            "pad it to keep the size ('same' padding; a transposed convolution's kernel a "
            "multiple of its stride), pool the output globally, or run without tiles",
        )
    return OutputMap(tuple(whole[-nd:]), tuple(tile[-nd:]))


def _keeps_grid(
    meta_model: nn.Module, in_chans: int, tile_hw: tuple[int, ...], out: tuple[int, ...]
) -> bool:
    """Whether the model maps a tile to the tile over a stride (or times a scale): its output
    on a tile of twice the side is twice as large (an unpadded convolution takes pixels off,
    16 -> 14 but 32 -> 30; on a 4-px tile 4 -> 2 looked like a stride of 2), and each side
    is a whole stride or scale of the tile's."""
    if not all(_scaled(t, o) for t, o in zip(tile_hw, out, strict=True)):
        return False
    try:
        double = output_shape(meta_model, (1, in_chans, *(2 * t for t in tile_hw)))
    except RuntimeError:  # the model does not run at that size: judged on the one size
        return True
    return double is not None and tuple(double[-len(out) :]) == tuple(2 * o for o in out)


def _scaled(n_in: int, n_out: int) -> bool:
    """Whether ``n_out`` is ``n_in`` over an integer stride or times an integer scale."""
    return n_out > 0 and (n_in % n_out == 0 or n_out % n_in == 0)


def _first_unscaled(
    meta_model: nn.Module, shape: tuple[int, ...]
) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """The first module (in call order) whose map output is not :func:`_scaled` from its map
    input, with those sizes; the model itself when none is found alone."""
    nd = len(shape) - 2
    found: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []

    def hook(path: str) -> Any:
        def check(_m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            x = args[0] if args else None
            if found or not isinstance(x, Tensor) or not isinstance(out, Tensor):
                return
            if x.dim() == out.dim() == nd + 2:
                seen, made = tuple(x.shape[-nd:]), tuple(out.shape[-nd:])
                if not all(_scaled(a, b) for a, b in zip(seen, made, strict=True)):
                    found.append((path, seen, made))

        return check

    handles = [m.register_forward_hook(hook(p)) for p, m in meta_model.named_modules() if p]
    try:
        output_shape(meta_model, shape)
    finally:
        for h in handles:
            h.remove()
    if found:
        return found[0]
    return type(meta_model).__name__, tuple(shape[2:]), ()


def _map_size(values: Tensor, ctx: SpatialContext, size: Sequence[int] | None) -> tuple[int, ...]:
    """The map's true size, checked against what ``ctx.grid`` tiles of ``values`` can hold."""
    if size is None:
        if ctx.image_hw is None:
            raise ConfigError(
                "tiled_mean", "no map size given and no image size set", "pass size=(h, w)"
            )
        size = ctx.image_hw
        nd = len(ctx.grid)
        if tuple(values.shape[-nd:]) != ctx.tile_size(size):
            # A map of another forward (another image size) or of another resolution: the last
            # size set is not its size (a multi-scale loss was 1.4 % off, silently).
            raise ConfigError(
                "tiled_mean",
                f"no map size given, and the values' tile {'x'.join(map(str, values.shape[-nd:]))} "
                f"is not the {'x'.join(map(str, ctx.tile_size(size)))} tile of the last image "
                f"size set ({'x'.join(map(str, size))})",
                "pass the map's true size as size=(h, w) (the image size of the forward that "
                "made it, or the map's own size at another resolution)",
            )
    nd = len(ctx.grid)
    tile = tuple(values.shape[-nd:])
    if any(g * t < s for g, t, s in zip(ctx.grid, tile, size, strict=True)):
        raise ConfigError(
            "tiled_mean",
            f"{'x'.join(map(str, ctx.grid))} tiles of {'x'.join(map(str, tile))} cannot hold a "
            f"{'x'.join(map(str, size))} map",
            "pass the map's true size as size=(h, w)",
        )
    return tuple(int(v) for v in size)


def tiled_sum(
    values: Tensor,
    ctx: SpatialContext | None,
    size: Sequence[int] | None = None,
    *,
    keep: int = 0,
) -> Tensor:
    """Sum over the whole image of per-pixel ``values`` of which this rank holds its tile.

    The leading ``keep`` dims are kept (``keep=2``: one sum per sample and class,
    as Dice needs); every other dim is summed, over the pixels of the tile that
    lie within the map's true ``size`` (the padded tail is left out), then over
    the tiles. Every rank returns the same value; backward hands each pixel the
    incoming gradient without communicating (:func:`all_reduce_replicated`).
    ``ctx`` None (one tile): the plain sum.
    """
    if ctx is None:
        return values.flatten(keep).sum(-1) if keep else values.sum()
    size = _map_size(values, ctx, size)
    nd = len(ctx.grid)
    tile = values.shape[-nd:]
    # The same slice on every rank (a full one where there is no tail): one graph everywhere.
    window = [slice(0, max(s - i * t, 0)) for s, i, t in zip(size, ctx.tile, tile, strict=True)]
    index: tuple[EllipsisType | slice, ...] = (Ellipsis, *window)
    valid = values[index]
    local = valid.flatten(keep).sum(-1) if keep else valid.sum().reshape(1)
    total = all_reduce_replicated(local.contiguous(), ctx.group)
    return total if keep else total.reshape(())


def tiled_mean(
    values: Tensor, ctx: SpatialContext | None, size: Sequence[int] | None = None
) -> Tensor:
    """Mean over the whole image of per-pixel ``values`` (``(..., th, tw)``) of which this rank holds its tile.

    ``size`` is the map's true size (default: the image size set on ``ctx``, for
    a map at the input's resolution); pixels of the tile past it (padding) are
    left out. Every rank returns the same value; backward gives each pixel
    ``1 / count`` of the gradient without communicating. ``ctx`` None: ``values.mean()``.
    """
    if ctx is None:
        return values.mean()
    true_size = _map_size(values, ctx, size)
    count = values.flatten(values.dim() - len(true_size))[..., 0].numel() * math.prod(true_size)
    return tiled_sum(values, ctx, true_size) / count


class TiledLoss:
    """A loss that reduces a tiled output itself, exactly, across tiles (Dice needs this).

    :func:`reduce_loss` can average per-pixel values, but a loss that is not a
    mean of per-pixel terms (Dice: a ratio of sums over the image) must see the
    whole image's sums. A subclass gets this rank's output tile, its target
    tile, the spatial context (None on one tile) and the output map (None when
    the output is not tiled), and returns the loss of the whole micro-batch,
    the same on every rank -- built from :func:`tiled_sum` / :func:`tiled_mean`.
    """

    def __call__(
        self,
        output: Tensor,
        target: Tensor,
        ctx: SpatialContext | None = None,
        out_map: OutputMap | None = None,
    ) -> Tensor:
        raise NotImplementedError


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
    if tuple(value.shape[-len(out_map.tile) :]) != out_map.tile:
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
