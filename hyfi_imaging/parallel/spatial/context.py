"""``SpatialContext``: what the spatial layers of one model share (grid, neighbours, group, sizes).

Why one object: the layers read their true sizes (traced once per image size),
the tile they are, and the group they reduce over from here; the loader asks it
how to cut an image (``padded_size``, ``tile_slice``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from hyfi_imaging.errors import ConfigError, HyfiError
from hyfi_imaging.geometry.grid import TileGrid, map_end
from hyfi_imaging.parallel.collectives import all_reduce_max_replicated, all_reduce_replicated
from hyfi_imaging.parallel.functional import (
    Resample,
    Site,
    SpatialFunctions,
    Windowed,
    site_op_name,
)
from hyfi_imaging.parallel.geometry import Resample1D, layer_geom
from hyfi_imaging.parallel.grad_sync import TileGradSync
from hyfi_imaging.parallel.halo import Neighbours
from hyfi_imaging.parallel.spatial import resampling
from hyfi_imaging.parallel.spatial.base import _tail
from hyfi_imaging.parallel.spatial.convolutions import _WindowedConv
from hyfi_imaging.parallel.spatial.kinds import _SWAP, _has_spatial_form
from hyfi_imaging.parallel.spatial.trace import TraceMode, _trace_sizes, split_image, trace_mode

__all__ = ["SpatialContext"]


#: Traces kept (by image size and mode), the least recently used dropped first.
_TRACES_KEPT = 8

#: The functional forms a global max reduction calls, by the number of spatial dims.
_ADAPTIVE_MAX = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d}


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
        #: The gradient rule for a user's own loop (apply_spatial), by the model it applies to
        #: (a deep copy that trains, a student or EMA copy, gets its own at its first forward);
        #: None where an engine reduces the gradients itself.
        self.grad_syncs: weakref.WeakKeyDictionary[nn.Module, TileGradSync] | None = None
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
        #: Every functional site the watch saw (on tiles or not), at its probe size.
        self.seen_sites: set[str] | None = None
        self._functions: SpatialFunctions | None = None
        self._reference: nn.Module | None = None
        self._in_chans = 3
        #: The model the context was made for (a weak reference): its modes at
        #: set_image_size say which trace the layers read until a forward says otherwise.
        self._model: weakref.ref[nn.Module] | None = None
        #: The mode the current trace is of (see trace_mode), and whether a forward of the
        #: whole model selected it (the check of sites a tile skipped runs then only).
        self.mode = TraceMode()
        self.in_forward = False
        # The traces, by image size and mode: sizes in, sizes out, and the pads,
        # interpolations and windowed functions as called on the whole image (``size=
        # skip.shape`` on a tile is the tile's size): their arguments come from the trace.
        self._traces: dict[tuple[Any, ...], _Traced] = {}
        self._traced = _Traced({}, {}, {})
        self._resamples: dict[tuple[Any, ...], tuple[Resample1D, ...]] = {}
        # The spatial layer each windowed function runs as, per site, image size and mode.
        self._windowed: dict[tuple[Any, ...], nn.Module] = {}

    def tiling(self, image_hw: Sequence[int]) -> TileGrid:
        """The image on this grid: padded size, tiles, origins (:class:`~hyfi_imaging.geometry.grid.TileGrid`)."""
        return TileGrid.padding(image_hw, self.grid, self.align)

    def padded_size(self, image_hw: Sequence[int]) -> tuple[int, ...]:
        """Image size after global padding (:func:`~hyfi_imaging.geometry.spans.padded_hw`)."""
        return self.tiling(image_hw).padded

    def tile_size(self, image_hw: Sequence[int]) -> tuple[int, ...]:
        """This rank's tile size (every rank's: the tiles are equal)."""
        return self.tiling(image_hw).tile

    def tile_slice(self, image_hw: Sequence[int]) -> tuple[slice, ...]:
        """Rows and columns (and slabs, for volumes) of the padded image that this rank owns."""
        return self.tiling(image_hw).slices(self.tile)

    def __deepcopy__(self, memo: dict[int, object]) -> SpatialContext:
        """Shared, not copied (it holds process groups): a deep copy of a spatial model (an
        EMA or teacher copy) runs its tiles on this context. Deep-copying it failed with
        "cannot pickle 'ProcessGroup'"."""
        return self

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
        self._select(tuple(int(v) for v in image_hw), self._model_mode())

    def follow_modes(self, module: nn.Module) -> None:
        """Trace in the modes of ``module`` from now on: ``ParallelModel``'s stages run the
        model's layers, not its forward, and set their modes themselves (a layer's
        eval-only call, traced in training, failed); their paths are the model's."""
        mode = trace_mode(module, _has_spatial_form)
        if self.image_hw is not None and mode.key != self.mode.key:
            self._select(self.image_hw, mode)

    def _model_mode(self) -> TraceMode:
        """The modes of the model the context was made for, without forward arguments."""
        model = self._model() if self._model is not None else None
        return self.mode if model is None else trace_mode(model, _has_spatial_form)

    def begin_forward(
        self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """A forward of the whole model (or a deep copy) begins: trace the image in its
        modes and with its arguments (once per image size and mode) for the layers to read."""
        if torch.compiler.is_compiling():
            raise ConfigError(
                f"model {type(model).__name__}",
                "is compiled (torch.compile) with spatial tiles: its halo exchanges, hooks and "
                "traces are not compiled",
                "run it eagerly, or compile a model without tiles (ParallelModel on a 1x1 grid, "
                "parallel.compile in hyfi-train)",
            )
        x, args, kwargs = split_image(args, kwargs, self.nd)
        if self.image_hw is None or x is None:
            return
        sizes = (tuple(self.tile_size(self.image_hw)), self.image_hw)
        mode = trace_mode(model, _has_spatial_form, args, kwargs, int(x.shape[0]), sizes)
        if mode.key != self.mode.key:
            self._select(self.image_hw, mode)
        self.in_forward = True

    def end_forward(self) -> None:
        self.in_forward = False

    @property
    def trace_key(self) -> tuple[Any, ...]:
        """The current trace's image size and mode (a key for what is derived from it)."""
        return (self.image_hw, self.mode.key)

    def _select(self, image_hw: tuple[int, ...], mode: TraceMode) -> None:
        key = (image_hw, mode.key)
        traced = self._traces.pop(key, None) or self._trace(image_hw, mode)
        self._traces[key] = traced  # the most recent last
        if len(self._traces) > _TRACES_KEPT:  # a forward argument that changes every step
            old = next(iter(self._traces))
            del self._traces[old]
            for cache in (self._resamples, self._windowed):
                for k in [k for k in cache if k[1] == old]:
                    del cache[k]
        self._traced, self.mode, self.image_hw = traced, mode, image_hw
        self.sizes = self._traced.sizes

    @property
    def traced_calls(self) -> dict[str, Resample | Windowed]:
        """The pads, interpolations and windowed functions the whole image calls, by site,
        in the current mode (empty before an image size is set)."""
        return self._traced.calls

    def _trace(self, image_hw: tuple[int, ...], mode: TraceMode) -> _Traced:
        if self._reference is None:
            raise RuntimeError("SpatialContext has no reference model; use spatialize()")
        self.tiling(image_hw)  # ConfigError for a grid that leaves a tile no image pixels
        try:
            sizes, outs, resamples = _trace_sizes(
                self._reference, (1, self._in_chans, *image_hw), mode
            )
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
        unseen = [n for n in resamples if self.seen_sites is not None and n not in self.seen_sites]
        if unseen:
            # A pad made only at some sizes (if y.shape != skip.shape): the watch's probe
            # never made it, so no rank runs it on its tile while the image has it (0.15 off).
            op = site_op_name(resamples[unseen[0]])
            path = unseen[0].rsplit("#", 1)[0] or type(self._reference).__name__
            size = "x".join(map(str, image_hw))
            if mode.args or mode.kwargs:  # the watch ran the model without them
                raise ConfigError(
                    f"module {path!r}",
                    f"calls {op} (site {unseen[0]}) on a {size} image with the forward's "
                    "arguments but not without them, as the model was checked for its tiles "
                    "(or not at other sizes: a branch on a shape)",
                    "wrap the model in a module whose forward fixes those arguments and "
                    "apply_spatial the wrapper, or call the model on the image alone",
                )
            raise ConfigError(
                f"module {path!r}",
                f"calls {op} (site {unseen[0]}) on a {size} image but "
                "not at other sizes: a branch on a shape (if y.shape != skip.shape) goes "
                "another way on a tile",
                f"call the {op} unconditionally (a pad by 0 changes nothing), or compute its "
                "arguments from the image's size",
            )
        return _Traced(sizes, outs, resamples)

    def out_size_of(self, path: str) -> tuple[int, ...]:
        """True (unpadded) output size of a spatial layer for the current image."""
        assert self.image_hw is not None
        return self._traced.outs[path]

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
        key = (name, self.trace_key)
        if key not in self._windowed:
            site = self.traced_calls[name]
            assert isinstance(site, Windowed)
            self._windowed[key] = _windowed_layer(site, name, self)
        layer = self._windowed[key]
        if isinstance(layer, _WindowedConv):
            assert weight is not None
            return layer.run(x, weight, bias)
        return layer(x)

    def resample(self, x: torch.Tensor, name: str, call: Resample | None = None) -> torch.Tensor:
        """Site ``name``'s pad or interpolation of the whole image, computed on this rank's tile
        (:func:`~hyfi_imaging.parallel.spatial.resampling.resample`)."""
        return resampling.resample(self, x, name, call)

    def _valid(self, name: str, tiles: Sequence[int]) -> tuple[int, ...]:
        """Per spatial dim, how many leading indices of this rank's tile lie in the image."""
        return map_end(self.size_of(name), self.tile, tiles)

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


class _Traced(NamedTuple):
    """One trace of the whole image (see spatial/trace.py): every spatial layer's and
    functional site's true input (``sizes``) and output (``outs``) size, and the pads,
    interpolations and windowed functions as called (``calls``)."""

    sizes: dict[str, tuple[int, ...]]
    outs: dict[str, tuple[int, ...]]
    calls: dict[str, Resample | Windowed]


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
