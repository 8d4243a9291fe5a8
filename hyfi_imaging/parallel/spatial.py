"""Spatial layers and ``spatialize()``: one image, cut into tiles, computed exactly.

Design, and why:

* **Equal tiles, padded once.** The image is padded at its bottom/right to a
  multiple of ``grid * total_stride`` so that every rank holds a tile of the same
  shape at every layer and every stride divides every tile. The padding is
  *outside the image*: each spatial layer re-masks it in its input (0 before a
  convolution, -inf before a max-pool) and excludes it from statistics, so the
  result equals the single-process run on the unpadded image for any size.
* **Global sizes from a shape trace.** Which rows of a tile lie outside the
  image at a given layer depends on the chain of kernels and paddings before it.
  We run the unmodified model once on the ``meta`` device and record every
  layer's true input size, per image size. No arithmetic is duplicated and any
  architecture built from the supported layers works.
* **Class swap, same parameters.** A layer becomes spatial by changing its class
  to a subclass (``nn.Conv2d`` -> :class:`SpatialConv2d`), so parameter names,
  state dicts, optimizers and hooks are untouched: a checkpoint moves freely
  between layouts.
* **Same graph on every rank.** Collectives inside backward are issued in the
  order autograd visits nodes; every rank therefore builds the same graph
  (masking is one node everywhere, see :class:`_MaskOutside`), or ranks would pair
  up different messages of equal size.
* **Gradient rule** (DESIGN.md invariant 5): parameters used before the global
  pool see only their tile and are *summed* over the spatial group; the head
  after the pool is replicated and already holds the whole gradient.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from hyfi_imaging.errors import ConfigError, HyfiError
from hyfi_imaging.parallel import windowed
from hyfi_imaging.parallel.collectives import (
    all_reduce_max_replicated,
    all_reduce_replicated,
    all_reduce_sum,
    gather_replicated,
)
from hyfi_imaging.parallel.functional import (
    Frames,
    Resample,
    Site,
    SiteMode,
    SpatialFunctions,
    Windowed,
    source_coords,
)
from hyfi_imaging.parallel.geometry import (
    LayerGeom,
    Resample1D,
    carried_halos,
    dynamic_same,
    layer_geom,
    padded_hw,
    resample_1d,
    resampled_tile,
    transposed_halo,
)
from hyfi_imaging.parallel.grad_sync import TileGradSync
from hyfi_imaging.parallel.halo import Neighbours, halo_exchange, trailing
from hyfi_imaging.parallel.randomness import install_rng_sync
from hyfi_imaging.parallel.watch import watch_tiles
from hyfi_imaging.parallel.windowed import Window

_aten = torch.ops.aten

__all__ = [
    "SpatialAvgPool1d",
    "SpatialAvgPool2d",
    "SpatialAvgPool3d",
    "SpatialBatchNorm1d",
    "SpatialBatchNorm2d",
    "SpatialBatchNorm3d",
    "SpatialContext",
    "SpatialConv1d",
    "SpatialConv2d",
    "SpatialConv3d",
    "SpatialConvTranspose1d",
    "SpatialConvTranspose2d",
    "SpatialConvTranspose3d",
    "SpatialFlatten",
    "SpatialGlobalAvgPool1d",
    "SpatialGlobalAvgPool2d",
    "SpatialGlobalAvgPool3d",
    "SpatialGlobalMaxPool1d",
    "SpatialGlobalMaxPool2d",
    "SpatialGlobalMaxPool3d",
    "SpatialGroupNorm",
    "SpatialMaxPool1d",
    "SpatialMaxPool2d",
    "SpatialMaxPool3d",
    "spatialize",
    "tile_alignment",
    "tile_shaped",
]

#: Names of the spatial axes, outermost first, by their number.
_AXES = {1: ("length",), 2: ("height", "width"), 3: ("depth", "height", "width")}

#: Side of the meta-device input the functional-op watch runs the model on.
_PROBE = 512
# Modules that mix pixels but have no spatial form: refused by name (the watch would
# refuse their ops too; this names the module). nn.LayerNorm is not here: over channels
# (timm's LayerNorm2d) it acts per pixel, which the watch lets through. nn.Upsample,
# nn.ZeroPad2d, nn.ConstantPad2d, nn.ReflectionPad2d and nn.ReplicationPad2d are not here
# either: their F.interpolate / F.pad calls run in their spatial form (parallel/functional.py).
_UNSUPPORTED = (
    nn.LPPool1d, nn.LPPool2d, nn.LPPool3d, nn.FractionalMaxPool2d, nn.FractionalMaxPool3d,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm, nn.PixelShuffle,
    nn.PixelUnshuffle, nn.Unfold, nn.Fold, nn.ReflectionPad1d, nn.ReflectionPad3d,
    nn.ReplicationPad1d, nn.ReplicationPad3d,
    nn.CircularPad1d, nn.MultiheadAttention, nn.MaxUnpool1d, nn.MaxUnpool2d, nn.MaxUnpool3d,
)  # fmt: skip


#: timm layers refused by name, with what they do and the fix: the watch would refuse one of
#: their ops (a view across the spatial dims), a line that does not say what the layer is.
_REFUSED_BY_NAME: dict[str, tuple[Any, str, str]] = {
    "GlobalContext": (
        lambda m: getattr(m, "conv_attn", None) is not None,
        "is global-context attention: a softmax over all pixels of the image and the map "
        "weighted by it (a global max, sum of exponentials and weighted sum over the tiles, "
        "which is not implemented)",
        "build it with use_attn=False (a global mean), use squeeze-excite attention, or run "
        "without spatial parallelism",
    ),
}


class SpatialContext:
    """What the spatial layers of one model share: the grid, neighbours, groups, sizes.

    Call :meth:`set_image_size` with the *unpadded* image size before a forward
    pass; :meth:`padded_size` and :meth:`tile_slice` tell how to cut an image.
    A grid of two factors tiles 2-D maps ``(h, w)``; of three, volumes ``(d, h, w)``
    (sizes, tiles and slices then have three entries); of one, 1-D signals ``(l,)``.
    """

    def __init__(
        self,
        grid: tuple[int, ...],
        tile: tuple[int, ...],
        neighbours: Neighbours,
        group: Any,
        *,
        align: int,
        overlap: bool = False,
        backward_bands: bool = False,
    ) -> None:
        self.grid, self.tile, self.neighbours, self.group, self.align = (
            tuple(grid), tuple(tile), neighbours, group, align,
        )  # fmt: skip
        #: Number of spatial dims: 2 (slides), 3 (volumes) or 1 (signals).
        self.nd = len(self.grid)
        #: Convolutions compute their interior while their halos are in flight.
        self.overlap = overlap
        #: Convolutions run their backward in bands of output rows (a memory tool).
        self.backward_bands = backward_bands
        #: Deep halos: at most this many windowed layers with a halo per exchange, and the
        #: runs of layers that share one (see _plan_deep_halos).
        self.halo_depth = 1
        self.deep_runs: list[list[str]] = []
        self.image_hw: tuple[int, ...] | None = None
        self.sizes: dict[str, tuple[int, ...]] = {}
        self.tile_param_names: set[str] = set()
        #: The gradient rule for a user's own loop (apply_spatial), None where an engine
        #: reduces the gradients itself.
        self.grad_sync: TileGradSync | None = None
        #: Global pools whose output is used again on the tiles (squeeze-excite).
        self.rejoined_pools: set[str] = set()
        #: Modules that draw random numbers in training (drop-path), synchronised over the
        #: tiles before they draw (see parallel/randomness.py).
        self.random_modules: set[str] = set()
        self.rng_hooks: list[RemovableHandle] = []
        #: Flattens gathering the whole map for a dense head (see SpatialFlatten).
        self.flatten_paths: set[str] = set()
        #: Global reductions written as functions that reduce tiles (see parallel/functional.py).
        self.functional_sites: set[str] = set()
        self._functions: SpatialFunctions | None = None
        self._reference: nn.Module | None = None
        self._in_chans = 3
        self._cache: dict[tuple[int, ...], dict[str, tuple[int, ...]]] = {}
        self._out_cache: dict[tuple[int, ...], dict[str, tuple[int, ...]]] = {}
        self._resamples: dict[tuple[Any, ...], tuple[Resample1D, ...]] = {}
        # The pads, interpolations and windowed functions as called on the whole image
        # (``size=skip.shape`` on a tile is the tile's size): their arguments come from the trace.
        self._traced_resamples: dict[tuple[int, ...], dict[str, Resample | Windowed]] = {}
        # The spatial layer each windowed function runs as, per site and image size.
        self._windowed: dict[tuple[str, tuple[int, ...]], nn.Module] = {}

    def padded_size(self, image_hw: Sequence[int]) -> tuple[int, ...]:
        """Image size after global padding (:func:`~hyfi_imaging.parallel.geometry.padded_hw`)."""
        return padded_hw(image_hw, self.grid, self.align)

    def tile_size(self, image_hw: Sequence[int]) -> tuple[int, ...]:
        """This rank's tile size (every rank's: the tiles are equal)."""
        return tuple(p // g for p, g in zip(self.padded_size(image_hw), self.grid, strict=True))

    def tile_slice(self, image_hw: Sequence[int]) -> tuple[slice, ...]:
        """Rows and columns (and slabs, for volumes) of the padded image that this rank owns."""
        size = self.tile_size(image_hw)
        return tuple(slice(i * t, (i + 1) * t) for i, t in zip(self.tile, size, strict=True))

    def set_image_size(self, image_hw: Sequence[int]) -> None:
        """Prepare the layers for images of ``image_hw`` (traced once per size)."""
        if len(image_hw) != self.nd:
            raise ConfigError(
                f"image size {tuple(image_hw)}",
                f"has {len(image_hw)} axes but the grid {'x'.join(map(str, self.grid))} has "
                f"{self.nd}",
                "give a volume (DxHxW) a 3-D grid (GZxGYxGX), an image (HxW) a 2-D one and a "
                "signal (L) a 1-D one (L<GL>)",
            )
        image_hw = tuple(int(v) for v in image_hw)
        if image_hw not in self._cache:
            self._cache[image_hw] = self._trace(image_hw)
        self.sizes = self._cache[image_hw]
        self.image_hw = image_hw

    def _trace(self, image_hw: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        if self._reference is None:
            raise RuntimeError("SpatialContext has no reference model; use spatialize()")
        padded = self.padded_size(image_hw)
        for axis, n, g, p in zip(_AXES[self.nd], image_hw, self.grid, padded, strict=True):
            if (g - 1) * (p // g) >= n:
                raise ConfigError(
                    f"image {'x'.join(map(str, image_hw))} on a "
                    f"{'x'.join(map(str, self.grid))} grid",
                    f"the last tile along the {axis} would hold no image pixels (tiles of {p // g} "
                    f"px, aligned to the model's total stride {self.align})",
                    f"use at most {max(1, -(-n // (p // g)))} tiles along the {axis}, or a larger image",
                )
        try:
            sizes, outs, resamples = _trace_sizes(self._reference, (1, self._in_chans, *image_hw))
        except HyfiError:
            raise
        except Exception as err:  # the model's own code fails at this size: one line
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ConfigError(
                f"model {type(self._reference).__name__}",
                f"fails on a {'x'.join(map(str, image_hw))} input on the meta device "
                f"({type(err).__name__}: {first})",
                "give an image size the model takes (unpadded convolutions shrink the map "
                "below a kernel's size at small sizes; a dense head takes one size only)",
            ) from err
        self._out_cache[image_hw] = outs
        self._traced_resamples[image_hw] = resamples
        return sizes

    def out_size_of(self, path: str) -> tuple[int, ...]:
        """True (unpadded) output size of a spatial layer for the current image."""
        assert self.image_hw is not None
        return self._out_cache[self.image_hw][path]

    def size_of(self, path: str) -> tuple[int, ...]:
        try:
            return self.sizes[path]
        except KeyError:
            raise RuntimeError(
                f"spatial layer {path!r} has no traced size; call set_image_size() before forward"
            ) from None

    def run_site(
        self,
        x: torch.Tensor,
        site: Site | Resample | Windowed,
        name: str,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The spatial form of a functional site (see parallel/functional.py); ``weight``
        and ``bias``: a functional convolution's."""
        if isinstance(site, Resample):
            return self.resample(x, name, site)
        if isinstance(site, Windowed):
            return self.windowed(x, name, weight, bias)
        return self.global_reduce(x, site, name)

    def windowed(
        self,
        x: torch.Tensor,
        name: str,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Site ``name``'s convolution or pool (a function) run as the spatial form of the
        ``torch.nn`` layer of the same arguments, as called on the whole image."""
        assert self.image_hw is not None
        key = (name, self.image_hw)
        if key not in self._windowed:
            site = self._traced_resamples[self.image_hw][name]
            assert isinstance(site, Windowed)
            self._windowed[key] = _windowed_layer(site, name, self)
        layer = self._windowed[key]
        if isinstance(layer, _WindowedConv):
            assert weight is not None
            return layer.run(x, weight, bias)
        return layer(x)

    def _resample_plan(
        self,
        res: Resample,
        name: str,
        tile_hw: tuple[int, ...],
        out_tiles: tuple[int, ...] | None = None,
    ) -> tuple[Resample1D, ...]:
        """Per axis, what each output pixel of this rank's tile reads; ``out_tiles``: the
        output tile asked for at run time (``size=`` a tile's shape), else derived."""
        assert self.image_hw is not None
        key = (name, self.image_hw, tile_hw, out_tiles)
        if key not in self._resamples:
            n_in, n_out = self.size_of(name), self.out_size_of(name)
            path, fn = name.rsplit("#", 1)[0], f"F.{res.op}"
            where = f"module {path!r} ({fn})" if path else fn
            coords = source_coords(res, n_in, n_out)
            axes = []
            for a, axis in enumerate(_AXES[self.nd]):
                t_out = out_tiles[a] if out_tiles is not None else resampled_tile(
                    tile_hw[a], n_in[a], n_out[a], scales=res.op == "interpolate", where=where,
                    axis=axis,
                )  # fmt: skip
                if res.op == "pad" and self.grid[a] * t_out < n_out[a]:
                    raise self._no_room(where, axis, a, n_out[a], self.grid[a] * t_out, tile_hw[a])
                axes.append(
                    resample_1d(
                        coords[a],
                        n_in[a],
                        tile_hw[a],
                        t_out,
                        self.grid[a],
                        self.tile[a],
                        where=where,
                        axis=axis,
                    )
                )
            self._resamples[key] = tuple(axes)
        return self._resamples[key]

    def _no_room(
        self, where: str, axis: str, a: int, n_out: int, held: int, t_in: int
    ) -> ConfigError:
        """The refusal of a pad that grows the map past its tiles: the image fills its tiles
        to (nearly) the last pixel, so they have no room for what the pad adds (a TF-style
        stem: ``F.pad`` by 1, then a pool that shrinks the map back). An image smaller by
        the shortfall times the layer's jump gives the tiles that room."""
        assert self.image_hw is not None
        jump = self.tile_size(self.image_hw)[a] // max(t_in, 1)
        n, padded = self.image_hw[a], self.padded_size(self.image_hw)[a]
        short = (n_out - held) * jump
        if n - short > padded - self.grid[a] * self.align:  # a smaller image, the same tiles
            fix = f"use an image of at most {n - short} px along the {axis} (it leaves the tiles room)"
        else:  # no image size pads to tiles with room at this layer
            fix = (
                f"pass a larger align (apply_spatial(..., align={2 * self.align})): tiles of "
                f"that multiple leave room at some image sizes"
            )
        return ConfigError(
            where,
            f"pads the map to {n_out} px along the {axis} but its tiles ({self.grid[a]} x {t_in} "
            f"px) hold {held}: the {n} px image fills its tiles, leaving no room for the pad",
            fix,
        )

    def resample(self, x: torch.Tensor, name: str, call: Resample | None = None) -> torch.Tensor:
        """Site ``name``'s pad or interpolation of the whole image, computed on this rank's tile.

        The call's arguments are those traced on the whole image (a ``size``
        taken from another map's shape at run time would be a tile's size).

        The tile (outside the image masked to 0) is extended by the halo the
        plan asks for (one exchange; backward returns the halo's gradient to
        its owner), then each axis gathers the one or two input pixels every
        output pixel reads and weighs them; a pad's fill is added where the
        output reads nothing. The same ops on every rank: one graph everywhere.
        """
        assert self.image_hw is not None
        res = self._traced_resamples[self.image_hw][name]  # the whole image's call
        assert isinstance(res, Resample)
        tiles = tuple(int(v) for v in x.shape[-self.nd :])
        plans = self._resample_plan(res, name, tiles, _asked_tile(res, call, self.nd))
        masked = _tail(x, self._valid(name, tiles), 0.0)
        halo = [v for p in plans for v in (p.before, p.after)]
        y = halo_exchange(masked, halo, self.neighbours)
        for k, plan in enumerate(plans):
            y = _gather(y, k - self.nd, plan, res.linear)
        if res.value:
            inside = _outer([p.inside for p in plans], y)
            y = y + res.value * (1 - inside)
        return y

    def _valid(self, name: str, tiles: Sequence[int]) -> tuple[int, ...]:
        """Per spatial dim, how many leading indices of this rank's tile lie in the image."""
        return tuple(
            m - i * t for m, i, t in zip(self.size_of(name), self.tile, tiles, strict=True)
        )

    def global_reduce(self, x: torch.Tensor, site: Site, name: str) -> torch.Tensor:
        """The whole image's average, sum or maximum over the spatial dims, on every rank.

        ``name`` is a global pool module's path or a functional site's name; its
        traced true input size says which part of the tile is image. The local
        reduction of the masked tile is all-reduced; backward sums the tiles'
        shares when the result is used again on the tiles (``rejoined_pools``).
        """
        nd = self.nd
        if site.channels_last:  # (N, *spatial, C): the same reduction of (N, C, *spatial)
            out = self.global_reduce(x.movedim(-1, 1), replace(site, channels_last=False), name)
            return out.movedim(1, -1) if site.keepdim else out
        valid = self._valid(name, x.shape[-nd:])
        dims = tuple(range(-nd, 0))
        partial = name in self.rejoined_pools
        if site.kind == "max":
            masked = _tail(x, valid, -math.inf)
            pool = _ADAPTIVE_MAX[nd]
            local = pool(masked, 1) if site.pool else masked.amax(dims, True)
            out = all_reduce_max_replicated(local, self.group, partial=partial)
        else:
            masked = _tail(x, valid, 0.0)
            local = masked.sum(dim=dims, keepdim=True)
            out = all_reduce_replicated(local, self.group, partial=partial)
            if site.kind == "avg":
                out = out / math.prod(self.size_of(name))
        return out if site.keepdim else out.view(out.shape[:-nd])


def _asked_tile(traced: Resample, call: Resample | None, nd: int) -> tuple[int, ...] | None:
    """The output tile an interpolation asks for at run time, when its ``size`` is a tile's
    shape (GhostNetV2: ``size=out.shape[-2:]``; it differs from the size traced on the whole
    image), else None: the tile is then derived from the sizes (:func:`resampled_tile`).

    Why: a pool that floors an odd map (3 px to 1) and an interpolation back to its size
    (1 to 3) scale the whole map by 3 but the tile (4 px to 2) by 2; the tile the call asks
    for is the one the map it meets is cut into.
    """
    if call is None or call.op != "interpolate":
        return None
    asked, whole = dict(call.options).get("size"), dict(traced.options).get("size")
    if asked is None or asked == whole:
        return None
    return (int(asked),) * nd if isinstance(asked, int) else tuple(int(v) for v in asked)


def _outer(per_dim: Sequence[Sequence[Any]], like: torch.Tensor) -> torch.Tensor:
    """The product over spatial dims of one vector per dim, shaped to broadcast on ``like``."""
    nd = len(per_dim)
    total: torch.Tensor | None = None
    for k, values in enumerate(per_dim):
        shape = [1] * nd
        shape[k] = -1
        v = torch.tensor(values, dtype=like.dtype, device=like.device).view(shape)
        total = v if total is None else total * v
    assert total is not None
    return total


def _gather(t: torch.Tensor, dim: int, axis: Resample1D, linear: bool) -> torch.Tensor:
    """Along ``dim``: ``(1 - w) * t[first] + w * t[second]``, 0 where the output reads nothing."""
    shape = [1] * t.dim()
    shape[dim] = -1
    index = torch.tensor(axis.first, device=t.device)
    inside = torch.tensor(axis.inside, dtype=t.dtype, device=t.device)
    if not linear:
        return t.index_select(dim, index) * inside.view(shape)
    weight = torch.tensor(axis.weight, dtype=t.dtype, device=t.device)
    second = torch.tensor(axis.second, device=t.device)
    return t.index_select(dim, index) * (inside * (1 - weight)).view(shape) + t.index_select(
        dim, second
    ) * (inside * weight).view(shape)


def _run_meta(model: nn.Module, shape: tuple[int, ...]) -> None:
    """One forward pass on the meta device: no memory, no compute, only shapes.

    In the parameters' dtype (a float64 model refuses float32 input) and in eval
    mode (BatchNorm with ``momentum=None`` reads its step counter in training).
    """
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.empty(shape, device="meta", dtype=dtype))
    finally:
        model.train(was_training)


def _trace_sizes(
    model: nn.Module, shape: tuple[int, ...]
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], dict[str, Resample | Windowed]]:
    """Input and output (h, w) -- (d, h, w) for volumes -- of every spatial module and
    functional site, and the pads, interpolations and windowed functions as called on the
    whole image, from one pass on the meta device (``shape`` is ``(1, C, *image_size)``)."""
    sizes: dict[str, tuple[int, ...]] = {}
    outs: dict[str, tuple[int, ...]] = {}
    resamples: dict[str, Resample | Windowed] = {}
    handles = []
    rank = len(shape)

    def record(table: dict[str, tuple[int, ...]], name: str, x: Any) -> None:
        if isinstance(x, torch.Tensor) and x.dim() == rank:
            hw = tuple(int(v) for v in x.shape[2:])
            if table.setdefault(name, hw) != hw:
                raise ConfigError(
                    name,
                    "the module is called on inputs of different sizes",
                    "give each call site its own module",
                )

    for name, mod in model.named_modules():
        # Every layer with a spatial form, timm's norm + activation layers included (their
        # normalisation is spatial although their forward is not: see _has_spatial_form).
        if isinstance(mod, tuple(_SWAP)) or _is_global_pool(mod) or _is_gathering_flatten(mod):
            handles.append(
                mod.register_forward_pre_hook(
                    lambda m, args, name=name: record(sizes, name, args[0] if args else None)
                )
            )
            handles.append(
                mod.register_forward_hook(lambda m, args, out, name=name: record(outs, name, out))
            )
    frames = Frames(model, _has_spatial_form)
    try:
        with _SiteSizes(frames, sizes, outs, resamples, rank - 2):
            _run_meta(model, shape)
    finally:
        frames.remove()
        for h in handles:
            h.remove()
    return sizes, outs, resamples


class _SiteSizes(SiteMode):
    """Records the true input size of every functional site (parallel/functional.py), and a
    pad's, interpolation's or windowed function's output size and call."""

    def __init__(
        self,
        frames: Frames,
        sizes: dict[str, tuple[int, ...]],
        outs: dict[str, tuple[int, ...]],
        resamples: dict[str, Resample | Windowed],
        nd: int,
    ) -> None:
        super().__init__(frames)
        self.sizes, self.outs, self.resamples, self.nd = sizes, outs, resamples, nd

    def at_site(
        self,
        func: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        site: Site | Resample | Windowed,
        name: str,
    ) -> Any:
        x = args[0] if args else kwargs["input"]
        out = func(*args, **kwargs)
        sizes = [(self.sizes, x)]
        if isinstance(site, Resample | Windowed):
            sizes.append((self.outs, out))
            self.resamples[name] = site
        for table, t in sizes:
            dims = site.spatial_dims(t.dim()) if isinstance(site, Site) else range(-self.nd, 0)
            hw = tuple(int(t.shape[d]) for d in dims)
            if table.setdefault(name, hw) != hw:
                raise ConfigError(
                    f"module {name.rsplit('#', 1)[0]!r}",
                    "a function in its forward that mixes pixels runs on inputs of different sizes",
                    "give each call site its own module",
                )
        return out


class _MaskOutside(torch.autograd.Function):
    """Fill what lies outside rows ``[r0, r1)`` and columns ``[c0, c1)``; zero its gradient.

    The inside is the part of the image a tensor holds: a tile's rows past the
    image end (``r0 = 0``), and for a tile with a deep halo the border past the
    image start as well. One autograd node on *every* rank, tail or not.
    Backward collectives (halo exchange, BatchNorm, pooling) are issued in the
    order the autograd engine visits nodes, which follows the graph's shape;
    were the graphs to differ between ranks (a masking node only where a tail
    exists), ranks would pair up different messages of the same size and
    silently exchange garbage.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, inside: tuple[int, ...], fill: float) -> torch.Tensor:
        ctx.inside = inside
        if not _crosses(inside, x.shape):
            return x.view_as(x)
        out = x.clone()
        _fill_outside(out, inside, fill)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if _crosses(ctx.inside, grad.shape):
            grad = grad.clone()
            _fill_outside(grad, ctx.inside, 0.0)
        return grad, None, None


def _crosses(inside: tuple[int, ...], shape: torch.Size) -> bool:
    """Whether part of the last ``len(inside) // 2`` dims lies outside ``[start, stop)`` pairs."""
    nd = len(inside) // 2
    return any(inside[2 * k] > 0 or inside[2 * k + 1] < shape[k - nd] for k in range(nd))


def _fill_outside(t: torch.Tensor, inside: tuple[int, ...], fill: float) -> None:
    nd = len(inside) // 2
    for k in range(nd):
        start, stop = max(inside[2 * k], 0), max(inside[2 * k + 1], 0)
        dim = t.dim() - nd + k
        t.narrow(dim, 0, min(start, t.shape[dim])).fill_(fill)
        if stop < t.shape[dim]:
            t.narrow(dim, stop, t.shape[dim] - stop).fill_(fill)


def _tail(x: torch.Tensor, valid: Sequence[int], fill: float) -> torch.Tensor:
    """A tile with its indices ``>= valid[k]`` along spatial dim ``k`` set to ``fill``."""
    return _MaskOutside.apply(x, tuple(v for n in valid for v in (0, n)), fill)


#: No neighbour: a deep halo's later layers read the border their input carries.
_NO_NEIGHBOURS = Neighbours()
#: No carried border (a layer outside a deep-halo run).
_NO_CARRY: tuple[int, ...] = ()


class _SpatialMixin:
    """Shared by the spatial layers: where they are, their context, input masking.

    ``hyfi_carry`` is ``(input, output)`` deep halos, ``(before, after)`` per
    spatial dim each, e.g. ``(top, bottom, left, right)`` (see
    :func:`_plan_deep_halos`): the border a layer's input holds beyond its
    tile, and the border its output keeps for the next layer. Empty without
    deep halos.
    """

    hyfi_path: str
    hyfi_ctx: SpatialContext
    hyfi_geoms: tuple[LayerGeom, ...]  # window geometry (conv/pool), fixed at spatialize()
    hyfi_carry: tuple[tuple[int, ...], tuple[int, ...]] = (_NO_CARRY, _NO_CARRY)

    def _carry(self, which: int) -> tuple[int, ...]:
        """The input (0) or output (1) carried border, zeros when there is none."""
        return self.hyfi_carry[which] or (0,) * (2 * self.hyfi_ctx.nd)

    def _tile_hw(self, x: torch.Tensor) -> tuple[int, ...]:
        """The tile's size: the input less the border it carries."""
        nd, carry = self.hyfi_ctx.nd, self._carry(0)
        return tuple(int(x.shape[k - nd]) - carry[2 * k] - carry[2 * k + 1] for k in range(nd))

    def _inside(self, x: torch.Tensor) -> tuple[int, ...]:
        """``(start, stop)`` per spatial dim of ``x`` (a tile and its carried border) inside
        the input image."""
        sizes, coords = self.hyfi_ctx.size_of(self.hyfi_path), self.hyfi_ctx.tile
        carry = self._carry(0)
        out: list[int] = []
        for k, (m, i, t) in enumerate(zip(sizes, coords, self._tile_hw(x), strict=True)):
            out += [carry[2 * k] - i * t, carry[2 * k] - i * t + m]
        return tuple(out)

    def _mask(self, x: torch.Tensor, fill: float) -> torch.Tensor:
        """Set the part of the tile (and its border) outside the (true) input image to ``fill``."""
        return _MaskOutside.apply(x, self._inside(x), fill)

    def _prepare(self, x: torch.Tensor, fill: float) -> tuple[torch.Tensor, Window]:
        """The input a windowed layer computes on, and its :class:`Window`.

        A layer whose input carries a deep halo reads that border (set to
        ``fill`` outside the image, as the padding) and exchanges nothing; any
        other receives its halo -- a deep one when it starts a run.
        """
        win = self._window(x, fill)
        if any(self.hyfi_carry[0]):
            return self._mask(x, fill), win
        return x, win

    def _window(self, x: torch.Tensor, fill: float) -> Window:
        """Halo, extent read and valid part of this layer's tile; ConfigError when untileable."""
        ctx = self.hyfi_ctx
        tiles_hw = self._tile_hw(x)
        carry_in, carry_out = self.hyfi_carry[0], self._carry(1)
        tiles, outs = ctx.grid, ctx.out_size_of(self.hyfi_path)
        halo: list[int] = []
        need: list[int] = []
        for a, (g, t, axis, n_tiles, m) in enumerate(
            zip(self.hyfi_geoms, tiles_hw, _AXES[ctx.nd], tiles, outs, strict=True)
        ):
            if t % g.stride:
                raise ConfigError(
                    self.hyfi_path,
                    f"the tile {axis} {t} is not a multiple of the stride {g.stride}",
                    "align tiles to the model's total stride (SpatialContext.align)",
                )
            if m > (t // g.stride) * n_tiles:
                # ceil_mode with padding adds an output past the padded image (e.g. 3x3/s2/p1 on even sizes).
                held = "x".join(
                    str(tt // gg.stride * n)
                    for tt, gg, n in zip(tiles_hw, self.hyfi_geoms, tiles, strict=True)
                )
                raise ConfigError(
                    self.hyfi_path,
                    f"produces {'x'.join(map(str, outs))} outputs but the tiles hold {held}",
                    "change the image size by a few pixels, or use ceil_mode=False",
                )
            # Rows read around the tile for outputs that keep the border carry_out.
            ob, oa = carry_out[2 * a], carry_out[2 * a + 1]
            before = g.stride * ob + g.padding
            after = g.stride * oa + g.extent - g.padding - g.stride
            deep = " (a deep halo: use a smaller halo_depth)" if any(carry_out) else ""
            # With one tile along an axis the halo is all global padding: any width works.
            if max(before, after) > t and n_tiles > 1 and not any(carry_in):
                raise ConfigError(
                    self.hyfi_path,
                    f"needs a halo of {max(before, after)} px but tiles are only {t} px along "
                    f"the {axis}{deep}",
                    "use fewer tiles along that axis or a larger image"
                    + (", or a smaller halo_depth" if deep else ""),
                )
            # A negative halo (surplus) needs no data: the windows read less than the tile.
            halo += [before, max(after, 0)]
            need.append(before + t + after)
        geoms = self.hyfi_geoms
        kernel = tuple(g.kernel for g in geoms)
        stride = tuple(g.stride for g in geoms)
        dilation = tuple(g.dilation for g in geoms)
        if any(carry_in):
            # The border is already there (it is the input's carried halo): nothing to receive.
            if tuple(halo) != carry_in:
                raise RuntimeError(
                    f"{self.hyfi_path}: input carries the halo {carry_in}, the layer reads {tuple(halo)}"
                )
            return Window(
                halo=(0,) * len(halo),
                need=tuple(need),
                valid=tuple(int(v) for v in x.shape[-ctx.nd :]),
                fill=fill,
                neighbours=_NO_NEIGHBOURS,
                kernel=kernel,
                stride=stride,
                dilation=dilation,
            )
        return Window(
            halo=tuple(halo),
            need=tuple(need),
            valid=ctx._valid(self.hyfi_path, tiles_hw),
            fill=fill,
            neighbours=ctx.neighbours,
            kernel=kernel,
            stride=stride,
            dilation=dilation,
            overlap=ctx.overlap,
            bands=ctx.backward_bands,
        )


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

    def _window(self, x: torch.Tensor, fill: float) -> Window:
        self.hyfi_geoms = layer_geom(self, self.hyfi_ctx.size_of(self.hyfi_path), tf_same=True)
        return super()._window(x, fill)


class _Transposed(_SpatialMixin):
    """``nn.ConvTranspose2d``/``3d`` on a tile: the output tile is ``stride`` times the input tile.

    The input tile (outside the image set to 0) gets the halo the output tile
    reads (:func:`~.geometry.transposed_halo`, one exchange whose backward
    returns the halo's gradient to its owner); the transposed convolution runs
    without padding and the tile's outputs are cut out of its result. The
    global output size comes from the trace, so ``output_padding`` and a
    ``forward(x, output_size)`` (a tile's size at run time) need not be read.
    """

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        ctx, path, nd = self.hyfi_ctx, self.hyfi_path, self.hyfi_ctx.nd
        conv: Any = self  # an nn.ConvTranspose2d/3d (the class this mixin is swapped into)
        halo: list[int] = []
        crop: list[tuple[int, int]] = []
        for a, (t, axis) in enumerate(zip(x.shape[-nd:], _AXES[nd], strict=True)):
            k, s, p, d = (int(v[a]) for v in (conv.kernel_size, conv.stride, conv.padding, conv.dilation))  # fmt: skip
            before, after = transposed_halo(k, s, p, d)
            n_out, tiles = ctx.out_size_of(path)[a], ctx.grid[a]
            if max(before, after) > t and tiles > 1:
                raise ConfigError(
                    path,
                    f"needs a halo of {max(before, after)} px but tiles are only {t} px along "
                    f"the {axis}",
                    "use fewer tiles along that axis or a larger image",
                )
            if tiles * t * s < n_out:
                raise ConfigError(
                    path,
                    f"gives {n_out} px along the {axis} but the tiles hold {tiles * t * s}",
                    "give the tiles room: a larger align (apply_spatial(..., align=N))",
                )
            halo += [before, after]
            crop.append((before * s + p, int(t) * s))
        masked = self._mask(x, 0.0)
        ext = halo_exchange(masked, halo, ctx.neighbours)
        transpose = _CONV_TRANSPOSE[nd]
        y = transpose(ext, conv.weight, None, conv.stride, 0, 0, conv.groups, conv.dilation)
        # Kernels narrower than the stride leave the last rows empty: pad them.
        short = [max(0, c0 + n - y.shape[k - nd]) for k, (c0, n) in enumerate(crop)]
        if any(short):
            y = F.pad(y, [v for k in reversed(range(nd)) for v in (0, short[k])])
        y = y[trailing([slice(c0, c0 + n) for c0, n in crop])]
        if conv.bias is not None:
            return y + conv.bias.view(1, -1, *(1,) * nd)
        # Not the cropped view: an in-place op on a view would drop FSDP2's pre-backward hook.
        return y.clone(memory_format=torch.contiguous_format)


class SpatialConvTranspose1d(_Transposed, nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` on a segment of a signal (see ``_Transposed``)."""


class SpatialConvTranspose2d(_Transposed, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` on a tile (see ``_Transposed``)."""


class SpatialConvTranspose3d(_Transposed, nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` on a sub-volume (see ``_Transposed``)."""


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


def _acc(t: torch.Tensor) -> torch.dtype:
    """Accumulate statistics in float32 for half types, else in the tensor's own type."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


class _GlobalBatchNorm(torch.autograd.Function):
    """Training-mode BatchNorm over all tiles with a hand-written backward.

    Autograd through the tensor expression would keep two activation-sized
    tensors per layer (the masked input and the centred input); this keeps one
    (the normalised input) and does one all-reduce in backward for both sums the
    input gradient needs. Outside the image (``outside``) the input is ignored and
    gets no gradient. The formula is the standard one,
    ``dx = w * rstd * (g - mean(g) - xhat * mean(g * xhat))`` with means over all
    valid pixels of all tiles; weight and bias gradients are this tile's share
    (summed over tiles later, as for every tile-derived parameter).

    With a deep halo the input carries a border of a neighbour's pixels
    (``own`` is the box of the tile's own ones): statistics come from the own
    pixels alone, every pixel is normalised, and the sums backward takes include
    the border's gradient shares (those of this tile's later outputs); the
    statistics' part of ``dx`` goes to the own pixels only, where the owner adds
    it once.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        outside: torch.Tensor | None,
        own: tuple[int, int, int, int] | None,
        n: int,
        eps: float,
        group: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape, dims = _channel_shape(x)
        ctx.fast = outside is None and own is None and x.dtype in (torch.float32, torch.float64)
        if ctx.fast:
            return _GlobalBatchNorm.forward_whole(ctx, x, weight, bias, n, eps, group)
        xm = x if outside is None else x.masked_fill(outside, 0.0)
        mean = all_reduce_sum(_own(xm, own).sum(dim=dims, dtype=_acc(x)), group) / n
        xhat = xm - mean.to(x.dtype).view(shape)
        if outside is not None:
            xhat.masked_fill_(outside, 0.0)
        squares = _own(xhat, own).square().sum(dim=dims, dtype=_acc(x))
        var = all_reduce_sum(squares, group) / n
        rstd = torch.rsqrt(var + eps)
        xhat.mul_(rstd.to(x.dtype).view(shape))
        # One output allocation (xhat * w + b would hold a second tile-sized temporary).
        y = xhat if weight is None else torch.addcmul(bias.view(shape), xhat, weight.view(shape))  # type: ignore[union-attr]
        ctx.save_for_backward(xhat, rstd, weight, outside)
        ctx.n, ctx.group, ctx.own = n, group, own
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def forward_whole(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        n: int,
        eps: float,
        group: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A tile wholly inside the image, in float32/64: PyTorch's own kernels.

        Why: the expression above makes five passes over the tile and three
        tile-sized temporaries; here one fused pass gives the tile's mean and
        variance (``batch_norm_update_stats`` on CPU, ``var_mean`` elsewhere), Chan's merge across the tiles needs two
        all-reduces of one number per channel (the mean, then the centred
        squares: no cancellation), and the normalisation is ATen's inference
        kernel with the whole image's statistics. The input is saved (it is
        kept alive instead of a new normalised copy: the same bytes).
        """
        _, dims = _channel_shape(x)
        if x.device.type == "cpu":
            # ATen's BatchNorm statistics kernel: 4x faster than var_mean on CPU (a
            # 256-channel 192x96 map: 5.5 vs 21 ms); it has no meta or autocast form.
            mean_l, var_l = torch.batch_norm_update_stats(x, None, None, 0.0)
        else:
            var_l, mean_l = torch.var_mean(x, dim=dims, correction=0)
        count = x.numel() // x.shape[1]
        # The collectives in the dtype the masked path uses: tiles of one image may take
        # either path, and they must issue the same messages.
        mean = all_reduce_sum(mean_l * count, group) / n
        var = all_reduce_sum((var_l + (mean_l - mean).square()) * count, group) / n
        y = F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(x, weight, mean, var)
        ctx.n, ctx.group, ctx.eps = n, group, eps
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward_whole(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Backward of :meth:`forward_whole`: ATen's inference backward gives ``g * scale``
        and this tile's sums of ``g`` and ``g * xhat`` in one pass; the statistics' part
        of the gradient, ``-scale * (mean(g) + xhat * mean(g xhat))``, is then added in
        place as ``a * x + b`` per channel."""
        x, weight, mean, var = ctx.saved_tensors
        shape, _ = _channel_shape(gy)
        dtype = x.dtype
        w = weight if weight is not None else torch.ones_like(mean, dtype=dtype)
        dx, sum_gxhat, sum_g = _aten.native_batch_norm_backward(
            gy, x, w, mean, var, None, None, False, ctx.eps, [True, True, True]
        )
        local = torch.stack([sum_g, sum_gxhat])
        total = all_reduce_sum(local, ctx.group) / ctx.n
        rstd = torch.rsqrt(var + ctx.eps)
        scale = rstd * w
        a = -scale * total[1] * rstd
        b = -scale * total[0] - a * mean
        dx.addcmul_(x, a.to(dtype).view(shape)).add_(b.to(dtype).view(shape))
        if weight is None:
            return dx, None, None, None, None, None, None, None
        return (
            dx, sum_gxhat.to(weight.dtype), sum_g.to(weight.dtype), None, None, None, None, None,
        )  # fmt: skip

    @staticmethod
    def backward(
        ctx: Any, gy: torch.Tensor, _gmean: torch.Tensor, _gvar: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        if ctx.fast:
            return _GlobalBatchNorm.backward_whole(ctx, gy)
        xhat, rstd, weight, outside = ctx.saved_tensors
        shape, dims = _channel_shape(gy)
        g = gy if outside is None else gy.masked_fill(outside, 0.0)
        local = torch.stack(
            [
                g.sum(dim=dims, dtype=_acc(g)),
                (g * xhat).sum(dim=dims, dtype=_acc(g)),
            ]
        )
        dbias, dweight = local[0].clone(), local[1].clone()
        total = all_reduce_sum(local, ctx.group) / ctx.n
        scale = (rstd if weight is None else rstd * weight.to(rstd.dtype)).to(g.dtype).view(shape)
        mean_g, mean_gx = total[0].to(g.dtype).view(shape), total[1].to(g.dtype).view(shape)
        if ctx.own is None:
            # dx = (g - mean(g) - xhat * mean(g xhat)) * scale, with one activation-sized
            # allocation (this is the largest transient of a spatial backward).
            dx = xhat * -mean_gx
            dx.add_(g).sub_(mean_g).mul_(scale)
        else:
            dx = g * scale
            _own(dx, ctx.own).sub_((_own(xhat, ctx.own) * mean_gx + mean_g) * scale)
        if outside is not None:
            dx.masked_fill_(outside, 0.0)
        if weight is None:
            return dx, None, None, None, None, None, None, None
        return dx, dweight.to(weight.dtype), dbias.to(weight.dtype), None, None, None, None, None


def _channel_shape(x: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape that broadcasts a per-channel vector on ``x`` (N, C, *spatial), and the
    dims a per-channel sum reduces."""
    return (1, -1, *(1,) * (x.dim() - 2)), (0, *range(2, x.dim()))


def _own(t: torch.Tensor, own: tuple[int, ...] | None) -> torch.Tensor:
    """The tile's own pixels of ``t`` (a view), all of it when ``own`` is None.

    ``own`` is ``(start, stop)`` per spatial dim.
    """
    if own is None:
        return t
    return t[trailing([slice(own[2 * k], own[2 * k + 1]) for k in range(len(own) // 2)])]


def _outside_mask(inside: tuple[int, ...], x: torch.Tensor) -> torch.Tensor | None:
    """Boolean map of the spatial positions of ``x`` outside ``inside`` (``(start, stop)`` per
    spatial dim), broadcastable on ``x``; None when all of ``x`` is inside."""
    if not _crosses(inside, x.shape):
        return None
    nd = len(inside) // 2
    mask: torch.Tensor | None = None
    for k in range(nd):
        n = x.shape[k - nd]
        shape = [1] * nd
        shape[k] = n
        idx = torch.arange(n, device=x.device).view(shape)
        out = (idx < inside[2 * k]) | (idx >= inside[2 * k + 1])
        mask = out if mask is None else mask | out
    return mask


class _SpatialBatchNorm(_SpatialMixin):
    """BatchNorm with statistics over the whole image: all tiles, the whole batch.

    Two-pass (mean, then centred squares) for accuracy on badly scaled data.
    Normalises with the biased variance and stores the unbiased one, exactly as
    ``nn.BatchNorm2d``; running statistics equal the single-process ones.
    """

    training: bool
    running_mean: torch.Tensor | None
    running_var: torch.Tensor | None
    num_batches_tracked: torch.Tensor | None
    weight: Any
    bias: Any
    affine: bool
    track_running_stats: bool
    momentum: float | None
    eps: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use_batch = self.training or self.running_mean is None
        if not use_batch:
            # Outside the image the input may hold anything (-inf after a max-pool).
            return F.batch_norm(
                self._mask(x, 0.0),
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                False,
                0.0,
                self.eps,
            )
        n = x.shape[0] * math.prod(self.hyfi_ctx.size_of(self.hyfi_path))
        outside = _outside_mask(self._inside(x), x)
        own = None
        if any(self.hyfi_carry[0]):
            carry = self.hyfi_carry[0]
            own = tuple(
                v for k, t in enumerate(self._tile_hw(x)) for v in (carry[2 * k], carry[2 * k] + t)
            )
        y, mean, var = _GlobalBatchNorm.apply(
            x,
            self.weight if self.affine else None,
            self.bias if self.affine else None,
            outside,
            own,
            n,
            self.eps,
            self.hyfi_ctx.group,
        )
        if self.training and self.track_running_stats and self.running_mean is not None:
            assert self.running_var is not None and self.num_batches_tracked is not None
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = (
                    1.0 / float(self.num_batches_tracked)
                    if self.momentum is None
                    else self.momentum
                )
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                unbiased = var * (n / max(n - 1, 1))
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        return y


class SpatialBatchNorm1d(_SpatialBatchNorm, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` on ``(N, C, L)`` segments, statistics over the whole signal (see
    ``_SpatialBatchNorm``). Only a BatchNorm1d that sees tile data becomes one: on the
    ``(N, C)`` features of a head after the global pool it stays plain."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ConfigError(
                f"module {self.hyfi_path!r} (BatchNorm1d)",
                f"sees a {x.dim()}-D input on a 1-D grid; its spatial form normalises (N, C, L) "
                "segments",
                "give it (N, C, L) signals, or apply it after the global pool",
            )
        return super().forward(x)


class SpatialBatchNorm2d(_SpatialBatchNorm, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` with statistics over the whole image (see ``_SpatialBatchNorm``)."""


class SpatialBatchNorm3d(_SpatialBatchNorm, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` with statistics over the whole volume (see ``_SpatialBatchNorm``)."""


class SpatialGroupNorm(_SpatialMixin, nn.GroupNorm):
    """GroupNorm with statistics over the whole image: per sample and group, all tiles.

    Two-pass like :class:`SpatialBatchNorm2d` (mean, then centred squares),
    outside the image excluded; the sums are all-reduced with a backward that
    sums the tiles' gradient shares (each tile's output depends on every
    tile's pixels through the statistics). Written as tensor operations:
    autograd gives the exact adjoint.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, *tile = x.shape
        g, ctx = self.num_groups, self.hyfi_ctx
        count = (c // g) * math.prod(ctx.size_of(self.hyfi_path))
        dims = tuple(range(2, 3 + len(tile)))
        ones = (1,) * (len(tile) + 1)
        xm = self._mask(x, 0.0).view(n, g, c // g, *tile)
        mean = all_reduce_replicated(xm.sum(dim=dims, dtype=_acc(x)), ctx.group, partial=True)
        centred = xm - (mean / count).to(x.dtype).view(n, g, *ones)
        valid = ctx._valid(self.hyfi_path, tile)
        centred = _tail(centred.view(x.shape), valid, 0.0).view(n, g, c // g, *tile)
        squares = centred.square().sum(dim=dims, dtype=_acc(x))
        var = all_reduce_replicated(squares, ctx.group, partial=True) / count
        y = (centred * torch.rsqrt(var + self.eps).to(x.dtype).view(n, g, *ones)).view(x.shape)
        if self.affine:
            shape, _ = _channel_shape(x)
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


def _norm_act(norm: type[nn.Module], base: type[nn.Module]) -> type[nn.Module]:
    """The spatial form of a norm + activation layer (timm's ``BatchNormAct2d``,
    ``GroupNormAct``): the spatial norm, then the layer's own ``drop`` and ``act``."""

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(norm.forward(self, x)))

    return type(
        f"Spatial{base.__name__}", (norm, base), {"forward": forward, "hyfi_norm_act": True}
    )


def _plain_equivalent(m: nn.Module) -> type[nn.Module] | None:
    """The torch.nn layer a known subclass computes exactly (timm's ``GroupNorm`` and
    ``GroupNorm1``, whose forward is ``F.group_norm``), else None."""
    cls = type(m)
    if cls.__module__.startswith("timm.") and cls.__name__ in ("GroupNorm", "GroupNorm1"):
        return nn.GroupNorm
    return None


def _is_norm_act(m: nn.Module) -> bool:
    """timm's norm + activation layers: a BatchNorm2d/GroupNorm subclass whose forward
    normalises, then applies its ``drop`` and ``act`` modules (per pixel, judged by the watch)."""
    return (
        type(m).__name__ in ("BatchNormAct2d", "GroupNormAct")
        and isinstance(getattr(m, "act", None), nn.Module)
        and isinstance(getattr(m, "drop", None), nn.Module)
    )


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


def _windowed_layer(site: Windowed, name: str, ctx: SpatialContext) -> nn.Module:
    """The spatial form of the ``torch.nn`` layer a windowed function computes (a
    convolution's on the meta device: its weight and bias come with each call), not part
    of the model: ``name`` is the site's, whose traced sizes it reads."""
    layer = site.layer()
    layer.__class__ = _SWAP[type(layer)]
    layer.hyfi_path, layer.hyfi_ctx = name, ctx  # type: ignore[assignment]
    try:
        layer.hyfi_geoms = layer_geom(layer)  # type: ignore[assignment]
    except ConfigError as err:
        raise ConfigError(
            f"module {name.rsplit('#', 1)[0]!r} (F.{site.func})", err.what, err.fix
        ) from None
    return layer


def _is_gathering_flatten(m: nn.Module) -> bool:
    """``nn.Flatten`` of every dim from 1 on (a dense head's input): see :class:`SpatialFlatten`."""
    kinds = (nn.Flatten, SpatialFlatten)
    return type(m) in kinds and getattr(m, "start_dim", 0) == 1 and getattr(m, "end_dim", 0) == -1


_SWAP: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv1d: SpatialConv1d,
    nn.ConvTranspose1d: SpatialConvTranspose1d,
    nn.MaxPool1d: SpatialMaxPool1d,
    nn.AvgPool1d: SpatialAvgPool1d,
    # Swapped only where it sees tile data (N, C, L): a head's BatchNorm1d on pooled (N, C)
    # features stays plain (the watch says which modules see tiles).
    nn.BatchNorm1d: SpatialBatchNorm1d,
    nn.Conv2d: SpatialConv2d,
    nn.Conv3d: SpatialConv3d,
    nn.ConvTranspose2d: SpatialConvTranspose2d,
    nn.ConvTranspose3d: SpatialConvTranspose3d,
    nn.MaxPool2d: SpatialMaxPool2d,
    nn.MaxPool3d: SpatialMaxPool3d,
    nn.AvgPool2d: SpatialAvgPool2d,
    nn.AvgPool3d: SpatialAvgPool3d,
    nn.BatchNorm2d: SpatialBatchNorm2d,
    nn.BatchNorm3d: SpatialBatchNorm3d,
    nn.GroupNorm: SpatialGroupNorm,
}
_GLOBAL_POOLS: dict[type[nn.Module], type[nn.Module]] = {
    nn.AdaptiveAvgPool1d: SpatialGlobalAvgPool1d,
    nn.AdaptiveMaxPool1d: SpatialGlobalMaxPool1d,
    nn.AdaptiveAvgPool2d: SpatialGlobalAvgPool2d,
    nn.AdaptiveMaxPool2d: SpatialGlobalMaxPool2d,
    nn.AdaptiveAvgPool3d: SpatialGlobalAvgPool3d,
    nn.AdaptiveMaxPool3d: SpatialGlobalMaxPool3d,
}
_ADAPTIVE = (
    nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d,
    nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool3d,
)  # fmt: skip
_WINDOWED = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d,
    nn.AvgPool2d, nn.AvgPool3d,
)  # fmt: skip
#: The functional forms a spatial layer calls, by the number of spatial dims.
_ADAPTIVE_MAX = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d}
_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _is_global_pool(m: nn.Module) -> bool:
    if not isinstance(m, _ADAPTIVE):
        return False
    size = m.output_size
    return all(v == 1 for v in size) if isinstance(size, tuple | list) else size == 1


#: Layers of each number of spatial dims: a model tiled on a grid of the other kind is refused.
_DIMS = {
    # Not nn.BatchNorm1d: on (N, C) features after a global pool it is no spatial layer, on
    # any grid. One that sees tiles off a 1-D grid is refused in spatialize (_check_tiled).
    1: (nn.Conv1d, nn.ConvTranspose1d, nn.MaxPool1d, nn.AvgPool1d, nn.AdaptiveAvgPool1d,
        nn.AdaptiveMaxPool1d),
    2: (nn.Conv2d, nn.ConvTranspose2d, nn.MaxPool2d, nn.AvgPool2d, nn.BatchNorm2d,
        nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d),
    3: (nn.Conv3d, nn.ConvTranspose3d, nn.MaxPool3d, nn.AvgPool3d, nn.BatchNorm3d,
        nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool3d),
}  # fmt: skip


#: How messages name a grid of each number of axes.
_GRID_NAMES = {1: "a 1-D grid (L<GL>)", 2: "a 2-D grid (GYxGX)", 3: "a 3-D grid (GZxGYxGX)"}


def _check_dims(name: str, m: nn.Module, nd: int) -> None:
    """Refuse a layer of another number of spatial dims than the grid's.

    Only for layers that see tile data (or when the model fails on the probe, where such a
    layer is the likely cause): a Conv1d on the pooled channel vector ``(N, 1, C)`` of ECA
    attention sees no tile and stays a plain layer.
    """
    for dims, layers in _DIMS.items():
        if dims != nd and isinstance(m, layers):
            raise ConfigError(
                f"module {name!r} ({type(m).__name__})",
                f"is a {dims}-D layer on tile data but the model is tiled on {_GRID_NAMES[nd]}",
                f"tile a model of {dims}-D layers on {_GRID_NAMES[dims]}",
            )


def _check_tiled(name: str, m: nn.Module, nd: int) -> None:
    """Refuse a layer that sees tile data and is only spatial on some grids: a layer of
    another number of dims (:func:`_check_dims`), a BatchNorm1d off a 1-D grid."""
    _check_dims(name, m, nd)
    if not isinstance(m, nn.BatchNorm1d):
        return
    where = f"module {name!r} ({type(m).__name__})"
    if nd != 1:
        raise ConfigError(
            where,
            f"normalises tile data (N, C, L) but the model is tiled on {_GRID_NAMES[nd]}",
            "apply BatchNorm1d after the global pool, or tile a model of 1-D layers on a 1-D "
            "grid (L<GL>)",
        )
    if type(m) is not nn.BatchNorm1d:
        raise ConfigError(where, "is a BatchNorm1d subclass", "use plain nn.BatchNorm1d")


def _check(name: str, m: nn.Module, nd: int = 2) -> None:
    where = f"module {name!r} ({type(m).__name__})"
    refused = _REFUSED_BY_NAME.get(type(m).__name__)
    if refused is not None and type(m).__module__.startswith("timm.") and refused[0](m):
        raise ConfigError(where, refused[1], refused[2])
    if isinstance(m, _UNSUPPORTED):
        raise ConfigError(
            where,
            "mixes pixels and has no spatial (tiled) form",
            "replace it with Conv2d/MaxPool2d/AvgPool2d/BatchNorm2d/global average pooling "
            "(or their 1-D and 3-D forms), or run without spatial parallelism",
        )
    # A layer of another number of dims is judged once the watch says whether it sees
    # tiles (_check_tiled).
    if isinstance(m, nn.AdaptiveMaxPool1d | nn.AdaptiveMaxPool2d | nn.AdaptiveMaxPool3d) and (
        m.return_indices
    ):
        raise ConfigError(where, "return_indices=True is not supported", "use return_indices=False")
    if isinstance(m, _ADAPTIVE) and not _is_global_pool(m):
        raise ConfigError(
            where,
            f"adaptive pooling to {m.output_size} depends on the whole image's size",
            "use global pooling (output size 1)",
        )
    if isinstance(m, nn.MaxPool1d | nn.MaxPool2d | nn.MaxPool3d) and m.return_indices:
        raise ConfigError(where, "return_indices=True is not supported", "use return_indices=False")
    if _is_norm_act(m) or _plain_equivalent(m) is not None or dynamic_same(m):
        return  # a known timm layer with a spatial form (see _norm_act, SpatialConv2dSame)
    for bn in (nn.BatchNorm2d, nn.BatchNorm3d):
        if isinstance(m, bn) and type(m) is not bn:
            raise ConfigError(where, f"is a {bn.__name__} subclass", f"use plain nn.{bn.__name__}")
    if isinstance(m, nn.BatchNorm1d):
        return  # judged once the watch says whether it sees tiles (_check_tiled)
    if isinstance(m, tuple(_SWAP)) and type(m) not in _SWAP:
        raise ConfigError(where, "subclasses a pixel-mixing layer", "use the plain torch.nn layer")
    if isinstance(m, _WINDOWED):
        try:
            layer_geom(m)  # refuses padding_mode != zeros, an avg-pool's ceil_mode divisor
        except ConfigError as err:
            raise ConfigError(where, err.what, err.fix) from None
    # Any other module is judged by what it does to tile data: see parallel/watch.py.


def spatialize(
    model: nn.Module,
    *,
    grid: tuple[int, ...],
    tile: tuple[int, ...],
    neighbours: Neighbours,
    group: Any,
    in_chans: int | None = None,
    align: int | None = None,
    overlap: bool = False,
    halo_depth: int = 1,
    stage_cuts: bool = False,
    backward_bands: bool = False,
    image_size: Sequence[int] | None = None,
) -> SpatialContext:
    """Turn ``model`` (in place) into its spatial form for tile ``tile`` of ``grid``.

    Returns the :class:`SpatialContext`; call its ``set_image_size`` before the
    forward pass and feed each rank ``image[..., ctx.tile_slice(hw)]`` of the
    image padded to ``ctx.padded_size(hw)``. Raises ConfigError naming the module
    path of any layer that mixes pixels and has no spatial form.

    ``halo_depth`` > 1: one exchange of a deeper halo serves up to that many
    consecutive windowed layers with a halo (:func:`_plan_deep_halos`);
    ``stage_cuts``: the model's top-level children may become pipeline stages,
    so no deep halo crosses from one to the next.

    The watch runs the model on a meta-device input of the model's ``input_size``
    when it declares one (a dense head on the flattened map, CosmoFlow, runs at
    that size only), else of a large probe size, else (a model that fails there)
    of ``image_size``, the size it will run at.

    A grid of three factors ``(gz, gy, gx)`` tiles a volume model (Conv3d,
    MaxPool3d, AvgPool3d, BatchNorm3d, ConvTranspose3d, 3-D global pools,
    trilinear/nearest F.interpolate) into sub-volumes the same way; a grid of one factor
    ``(gl,)`` tiles a 1-D model (Conv1d, MaxPool1d, AvgPool1d, BatchNorm1d on ``(N, C, L)``,
    ConvTranspose1d, 1-D global pools, linear/nearest F.interpolate) into segments.
    """
    nd = len(grid)
    if nd not in _AXES or len(tile) != nd:
        raise ConfigError(
            "spatial grid",
            f"{tuple(grid)} with tile {tuple(tile)}",
            "give a grid and tile of 1 (L<GL>), 2 (GYxGX) or 3 (GZxGYxGX) entries",
        )
    if halo_depth < 1:
        raise ConfigError("halo_depth", f"is {halo_depth}", "use 1 (a halo per layer) or more")
    if halo_depth > 1 and nd == 1:
        raise ConfigError(
            "halo_depth",
            f"is {halo_depth} on a 1-D grid; deep halos are implemented for 2-D and 3-D grids",
            "use halo_depth=1 (one halo per layer) for signals",
        )
    for name, m in model.named_modules():
        _check(name or type(model).__name__, m, nd)
    in_chans = in_chans or int(getattr(model, "in_chans", 3))
    reference = copy.deepcopy(model).to("meta")
    try:
        use = _watch(model, reference, in_chans, nd, image_size)
    except ConfigError as err:
        if _failed_on_meta(err):
            # The model's own code failed on the probe: a layer of another number of dims
            # given the tiles' (N, C, *spatial) is the likely cause, and the clearer line.
            for name, m in model.named_modules():
                _check_dims(name or type(model).__name__, m, nd)
        raise
    for name, m in model.named_modules():
        if name in use.tile_modules:
            _check_tiled(name or type(model).__name__, m, nd)
    align = align or tile_alignment(
        model, nd, in_chans=in_chans, image_size=image_size, _seen=(reference, use)
    )
    ctx = SpatialContext(
        grid, tile, neighbours, group, align=align, overlap=overlap, backward_bands=backward_bands
    )
    ctx._reference = reference
    ctx._in_chans = in_chans
    ctx.tile_param_names = use.tile_params
    ctx.rejoined_pools = use.rejoined_pools
    ctx.functional_sites = use.functional_sites
    ctx.random_modules = use.random_modules
    ctx.rng_hooks = install_rng_sync(model, use.random_modules, group)  # one draw per image
    if use.functional_sites:
        ctx._functions = SpatialFunctions(
            model, _has_spatial_form, use.functional_sites, ctx.run_site
        )
    for name, m in model.named_modules():
        if name not in use.tile_modules:
            continue  # e.g. a squeeze-excite convolution on the pooled vector: stays plain
        cls = SpatialConv2dSame if dynamic_same(m) else _SWAP.get(_plain_equivalent(m) or type(m))
        if _is_norm_act(m):
            norm = SpatialBatchNorm2d if isinstance(m, nn.BatchNorm2d) else SpatialGroupNorm
            cls = _norm_act(norm, type(m))
        if _is_global_pool(m):
            cls = _GLOBAL_POOLS[type(m)]
        if _is_gathering_flatten(m):
            cls = SpatialFlatten
            ctx.flatten_paths.add(name)
        if cls is not None:
            m.__class__ = cls
            m.hyfi_path, m.hyfi_ctx = name, ctx
            if isinstance(m, _WINDOWED) and not dynamic_same(m):
                m.hyfi_geoms = layer_geom(m)  # type: ignore[assignment]
    ctx.halo_depth = halo_depth
    ctx.deep_runs = _plan_deep_halos(model, use.links, halo_depth, stage_cuts)
    return ctx


def _is_carrier(m: nn.Module) -> bool:
    """Layers a deep halo may pass through: per pixel once their statistics are known."""
    return type(m) in (nn.BatchNorm2d, nn.BatchNorm3d)


def _deepable(m: nn.Module) -> bool:
    """Windowed layers whose window is fixed: convolution, max and average pooling."""
    return type(m) in _DEEPABLE and not any(g.ceil_mode for g in _geoms(m))


#: The spatial forms a deep halo may run through (2-D tiles and 3-D sub-volumes).
_DEEPABLE = (
    SpatialConv2d, SpatialMaxPool2d, SpatialAvgPool2d,
    SpatialConv3d, SpatialMaxPool3d, SpatialAvgPool3d,
)  # fmt: skip


def _geoms(m: nn.Module) -> tuple[LayerGeom, ...]:
    geoms: tuple[LayerGeom, ...] = m.hyfi_geoms  # type: ignore[assignment]
    return geoms


def _plan_deep_halos(
    model: nn.Module,
    links: dict[str, tuple[str, tuple[str, ...]]],
    depth: int,
    stage_cuts: bool,
) -> list[list[str]]:
    """Group linked windowed layers into runs that share one (deeper) halo exchange.

    Along a chain of layers linked by the watch (each reads the previous one's
    output alone, through per-pixel ops and BatchNorms), runs of up to
    ``depth`` layers that need a halo are formed. The first layer of a run
    receives the run's whole halo (:func:`~.geometry.carried_halos`); each
    layer then computes its outputs *and* the border the rest of the run reads,
    masked outside the image to the next layer's padding value; BatchNorms in
    between take statistics from the tile's own pixels. The last layer's output
    is exactly the tile. Sets ``hyfi_carry`` on the layers; returns the runs.
    """
    if depth <= 1:
        return []
    modules = dict(model.named_modules())
    succ: dict[str, tuple[str, tuple[str, ...]]] = {}
    for consumer, (producer, carriers) in links.items():
        if producer not in modules or consumer not in modules:
            continue
        if not (_deepable(modules[producer]) and _deepable(modules[consumer])):
            continue
        if not all(type(modules[c]) in (SpatialBatchNorm2d, SpatialBatchNorm3d) for c in carriers):
            continue
        if stage_cuts and producer.split(".")[0] != consumer.split(".")[0]:
            continue
        succ[producer] = (consumer, carriers)
    consumers = {c for c, _ in succ.values()}
    runs: list[list[str]] = []
    for head in sorted(p for p in succ if p not in consumers):
        chain, between = [head], [tuple[str, ...]()]
        while chain[-1] in succ:
            nxt, carriers = succ[chain[-1]]
            chain.append(nxt)
            between.append(carriers)
        group: list[int] = []
        halos = 0
        for k, path in enumerate([*chain, None]):
            needs = path is not None and any(
                g.padding or g.extent - g.padding - g.stride > 0 for g in _geoms(modules[path])
            )
            if path is None or (needs and halos == depth):
                if len(group) > 1:
                    runs.append([chain[i] for i in group])
                    _set_carries(modules, [chain[i] for i in group], [between[i] for i in group])
                group, halos = [], 0
            if path is not None:
                group.append(k)
                halos += needs
    return runs


def _set_carries(
    modules: dict[str, nn.Module], run: list[str], between: list[tuple[str, ...]]
) -> None:
    carries = carried_halos([_geoms(modules[p]) for p in run])
    for k, (path, (inn, out)) in enumerate(zip(run, carries, strict=True)):
        carry_in = _NO_CARRY if k == 0 else inn
        modules[path].hyfi_carry = (carry_in, out)  # type: ignore[assignment]
        for c in between[k] if k else ():
            modules[c].hyfi_carry = (inn, inn)  # type: ignore[assignment]


def _has_spatial_form(m: nn.Module) -> bool:
    """Layers whose forward is their spatial form's business. Not timm's norm + activation
    layers: their normalisation is (the watch's ``norms``), their ``drop`` and ``act`` are not."""
    if _is_norm_act(m) or getattr(m, "hyfi_norm_act", False):
        return False
    if isinstance(m, nn.Flatten):
        return _is_gathering_flatten(m)
    return isinstance(m, tuple(_SWAP)) or _is_global_pool(m)


def _failed_on_meta(err: ConfigError) -> bool:
    """Whether ``err`` says the model's own code failed on the meta device (a shape error),
    rather than refusing what the model does."""
    return err.__cause__ is not None and not isinstance(err.__cause__, HyfiError)


def _watch(
    model: nn.Module,
    reference: nn.Module,
    in_chans: int,
    nd: int,
    image_size: Sequence[int] | None = None,
) -> Any:
    """Which modules and parameters of ``reference`` (a meta copy) see tile data.

    Refuses functions that mix pixels. Traced at the model's ``input_size`` when it
    declares one, else at a large probe size; a model that fails there (a dense head on
    the flattened map takes one size only) is traced again at ``image_size``, the size
    it will run at, and a failure names that size, never a probe the user did not give.
    """
    declared = getattr(model, "input_size", None)
    sizes = [(tuple(int(v) for v in declared), "the model's input_size")] if declared else []
    if not declared:
        origin = "a probe size: no image size was given" if image_size is None else "a probe"
        sizes.append(((_PROBE,) * nd, origin))
        if image_size is not None:
            sizes.append((tuple(int(v) for v in image_size), "the image size given"))
    for k, (probe, origin) in enumerate(sizes):
        try:
            return watch_tiles(
                reference,
                (1, in_chans, *probe),
                _has_spatial_form,
                norms=_is_norm_act,
                carriers=_is_carrier,
                origin=origin,
            )
        except ConfigError as err:
            if k == len(sizes) - 1 or not _failed_on_meta(err):
                raise
    raise AssertionError("unreachable")  # the last size returns or raises


_ALIGNMENTS: weakref.WeakKeyDictionary[nn.Module, dict[int, int]] = weakref.WeakKeyDictionary()


def tile_alignment(
    model: nn.Module,
    nd: int = 2,
    *,
    in_chans: int | None = None,
    image_size: Sequence[int] | None = None,
    _seen: tuple[nn.Module, Any] | None = None,
) -> int:
    """The multiple every tile side of ``model`` is aligned to, for ``nd`` spatial dims.

    The model's ``total_stride`` when it declares one, else the least common
    multiple of the cumulative strides of the layers that see tiles, measured on
    the meta device (remembered per model). The one source of this number: the
    engine, the planner, the loader and the recipe checks all ask here, so they
    pick the same tiles (the planner used to take 1 for a model that declares
    nothing while the engine measured, say, 32). ``image_size``: the size the model
    will run at, traced where the model takes no other (a dense head on the flattened map).
    """
    declared = int(getattr(model, "total_stride", 0))
    if declared:
        return declared
    known = _ALIGNMENTS.setdefault(model, {})
    if nd not in known:
        in_chans = in_chans or int(getattr(model, "in_chans", 3))
        if _seen is None:
            reference = copy.deepcopy(model).to("meta")
            _seen = (reference, _watch(model, reference, in_chans, nd, image_size))
        reference, use = _seen
        own_size: Sequence[int] | None = getattr(model, "input_size", None)
        fixed = tuple(int(v) for v in own_size or image_size or ()) or None
        tiled = use.tile_modules | use.functional_sites
        known[nd] = _total_stride(reference, in_chans, tiled, nd, fixed)
    return known[nd]


def _total_stride(
    reference: nn.Module,
    in_chans: int,
    tile_modules: set[str],
    nd: int = 2,
    fixed: tuple[int, ...] | None = None,
) -> int:
    """Least common multiple of the cumulative strides of the layers that see tiles.

    Measured by tracing two large inputs (image or volume, ``nd`` spatial dims) on the meta
    device: a layer's jump is the ratio of the differences of the sizes, which cancels the
    pixels unpadded convolutions take off (Inception's: 4096 px give 126 at a jump of 32).
    A model that takes one size only (a dense head on the flattened map) is traced once,
    at ``fixed``, the size the watch ran it at.
    """
    probes: tuple[int, ...] = (4096, 8192)
    try:
        traced = [_trace_sizes(reference, (1, in_chans, *(p,) * nd)) for p in probes]
    except HyfiError:
        raise
    except Exception:
        if fixed is None:
            raise
        probes = (fixed[0],)
        traced = [_trace_sizes(reference, (1, in_chans, *fixed))]
    sizes, _, calls = traced[0]
    layers: list[tuple[str, nn.Module]] = list(reference.named_modules())
    # windowed functions that see tiles (``tile_modules`` holds their site names)
    layers += [(n, c.layer()) for n, c in calls.items() if isinstance(c, Windowed)]
    align = 1
    for name, m in layers:
        if name not in tile_modules:
            continue
        if name in sizes and isinstance(m, _WINDOWED):
            if len(traced) == 2 and traced[1][0][name][0] > sizes[name][0]:
                ratio = (probes[1] - probes[0]) / (traced[1][0][name][0] - sizes[name][0])
            else:
                ratio = probes[0] / sizes[name][0]
            jump = max(1, round(ratio))
            align = math.lcm(align, *(jump * g.stride for g in layer_geom(m, sizes[name])))
    return align
