"""Which tensors carry tile data, and what may touch them: the functional-op watch.

Why: ``spatialize()`` swaps *modules* for their spatial forms, but a model's
``forward`` can mix pixels with plain functions -- ``F.adaptive_avg_pool2d``,
``x.mean((2, 3))``, ``torch.flip``, ``F.interpolate``, slicing -- which no
module check sees. Each would run on a tile as if it were the whole image and
give a wrong answer without a word (torchvision's densenet121 and mobilenet_v2
did). So the model runs on the meta device under a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` that follows the
*tile-carrying* tensors (the input, and whatever is computed from it without
a global pool) through every ATen op, and:

* lets through what acts per pixel (ops tagged pointwise, channel reshapes,
  channel concatenation, reductions and norms over channels only, permutes,
  which move the spatial dims along);
* lets the layers that have a spatial form (convolutions, pools, BatchNorm,
  global pools, called as modules) do their own work: their internals are not
  inspected, a global pool's output is replicated (no longer a tile);
* lets the functions that have a spatial form (global reductions, channels-last
  ones too, ``F.pad`` with a constant or a reflection, ``F.interpolate`` nearest
  or bilinear, ``F.conv2d``/``F.avg_pool2d``/``F.max_pool2d``: see
  :mod:`.functional`) run; a reduction's output is replicated, a pad's, an
  interpolation's or a convolution's is a tile again;
* refuses anything else on a tile -- a reduction or a reshape over the spatial
  dims, a crop by slicing, a circular pad (or any write of the map into part of
  another tensor), a bicubic upsample, a flip, a functional transposed
  convolution, an op it does not know -- with one line naming the module path,
  the op and the fix. Unknown means refused: never silently wrong.

The model runs twice, in eval and in training mode, because dropout,
drop-path and DropBlock draw only in training: a random draw per pixel of a
tile is refused, one per sample or channel is recorded for its module to draw
alike on every tile (:mod:`.randomness`).

It also reports which modules saw tile data and which parameters were used on
it: ``spatialize`` swaps only those modules (a 1x1 convolution on a pooled
squeeze-excite vector stays plain) and sums the gradients of exactly those
parameters over the tiles (DESIGN.md invariant 5), wherever the global pools are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hyfi_imaging.errors import ConfigError, HyfiError
from hyfi_imaging.parallel.functional import Frames, Resample, Site, SiteMode, Windowed
from hyfi_imaging.parallel.randomness import draws_random

__all__ = ["TileUse", "watch_tiles"]

_aten = torch.ops.aten
#: Ops that only reshape or move memory: fine if the spatial dims come out whole.
_VIEWS = {
    _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default,
    _aten.expand.default, _aten.clone.default, _aten._to_copy.default, _aten.detach.default,
    _aten.alias.default, _aten.contiguous.default, _aten.lift_fresh.default,
    _aten.squeeze.dim, _aten.squeeze.dims, _aten.unsqueeze.default,
    _aten.empty_like.default, _aten.zeros_like.default, _aten.ones_like.default,
    _aten.full_like.default, _aten.copy_.default,
}  # fmt: skip
#: Per-element ops ATen does not tag ``pointwise``.
_POINTWISE_NAMES = {
    "hardswish", "hardswish_", "where", "masked_fill", "masked_fill_", "native_dropout",
    "_prelu_kernel", "prelu", "log_sigmoid_forward", "fill_", "zero_", "threshold", "threshold_",
}  # fmt: skip
#: Ops whose output holds one value everywhere (on a tensor without tile data).
_CONSTANTS = {
    "zeros", "ones", "full", "empty", "empty_strided", "scalar_tensor", "zeros_like",
    "ones_like", "full_like", "empty_like", "new_zeros", "new_ones", "new_full", "new_empty",
    "new_empty_strided", "fill_", "zero_", "fill",
}  # fmt: skip
#: Interpolations: a map flat along a spatial dim stays flat along it.
_UPSAMPLES = ("upsample_", "_upsample_")
_LAYER_NORM = {_aten.native_layer_norm.default, _aten.layer_norm.default}
_SPLITS = {_aten.split.Tensor, _aten.split_with_sizes.default, _aten.chunk.default}
_SLICES = {_aten.slice.Tensor, _aten.select.int, _aten.narrow.default}
#: Ops along one dimension (``args[1]``): per pixel when that dimension is not spatial.
_ALONG = {_aten._softmax.default, _aten._log_softmax.default, _aten.cumsum.default}
#: Reorders along their ``dims`` (a roll without dims rolls the flattened tensor).
_REORDERS = {_aten.flip.default, _aten.roll.default}
#: Matrix products: per pixel when the pixels are the rows of the first factor.
_MATMUL = {_aten.mm.default, _aten.addmm.default}
#: Fresh tensors of a given shape (``x.new_empty(shape)``): a tile only if the shape is one.
_NEW = {"new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided"}
#: The normalisation of a layer with a spatial norm form (timm's BatchNormAct2d, GroupNormAct).
_NORMS = {
    "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "native_batch_norm",
    "native_group_norm",
}  # fmt: skip


@dataclass
class TileUse:
    """What the watch found.

    ``tile_modules``: modules that saw tile data. ``tile_params``: parameters
    whose gradient is a per-tile share, summed over the tiles (used on tile
    data, or on a pooled value that is used again on the tiles).
    ``rejoined_pools``: global pools (module paths, or functional sites) whose
    replicated output is used again on the tiles, as squeeze-excite does: their
    backward sums the tiles' shares. ``functional_sites``: global reductions
    written as functions that reduce tile data (see :mod:`.functional`).
    ``random_modules``: modules whose own forward draws random numbers in
    training that reach the output (drop-path, dropout): they must draw alike
    on every tile (see :mod:`.randomness`); ``""`` is the model itself.
    """

    tile_modules: set[str] = field(default_factory=set)
    tile_params: set[str] = field(default_factory=set)
    rejoined_pools: set[str] = field(default_factory=set)
    functional_sites: set[str] = field(default_factory=set)
    #: Every functional site called at the size the watch ran at (on tiles or not).
    seen_sites: set[str] = field(default_factory=set)
    random_modules: set[str] = field(default_factory=set)
    #: ``consumer: (producer, carriers)``: the layer ``consumer`` (a module with a spatial
    #: form) reads the output of the layer ``producer`` and nothing else, through per-pixel
    #: ops and the ``carriers`` (modules that act per pixel given their statistics:
    #: BatchNorm), every tensor on the way used once. A deep halo may cross such a link
    #: (:func:`~hyfi_imaging.parallel.geometry.carried_halos`): a tile with a border runs
    #: along it, no other op ever sees the border.
    links: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)


@dataclass
class _Lineage:
    """A tile tensor computed from one layer's output alone, per pixel: which layer, through
    which carrier modules, and the tensors on the way (each must be used once)."""

    producer: str
    carriers: tuple[str, ...] = ()
    path: tuple[torch.Tensor, ...] = ()


@dataclass
class _Tile:
    """Where the spatial dims of a tile-carrying tensor are, and their sizes.

    Two spatial dims for a slide's tile, three for a volume's sub-volume.
    ``flat``: the spatial dims (and those before them) are merged into dim 0, as
    ``nn.Linear`` does to a channels-last map (rows are pixels); ``flat`` is the
    shape they had, to which a view must restore them.
    """

    dims: tuple[int, ...]
    hw: tuple[int, ...]
    flat: tuple[int, ...] | None = None


def _last(t: torch.Tensor, hw: tuple[int, ...]) -> _Tile:
    """``t``'s last ``len(hw)`` dims are the spatial dims, of sizes ``hw``."""
    k = len(hw)
    return _Tile(tuple(range(t.dim() - k, t.dim())), hw)


def _refuse(path: str, op: str, why: str, fix: str) -> ConfigError:
    return ConfigError(f"module {path!r}", f"{op} {why}", fix)


class _Watch(TorchDispatchMode):
    def __init__(
        self,
        params: dict[int, str],
        known: Callable[[nn.Module], bool],
        use: TileUse,
        norms: Callable[[nn.Module], bool] | None = None,
        carriers: Callable[[nn.Module], bool] | None = None,
    ) -> None:
        super().__init__()
        # Links between layers for deep halos (see TileUse.links).
        self.carriers = carriers
        self.lineages: dict[int, tuple[torch.Tensor, _Lineage]] = {}
        self.uses: dict[int, tuple[torch.Tensor, int]] = {}
        self.calls: dict[str, int] = {}
        self.candidates: dict[str, tuple[_Lineage, torch.Tensor]] = {}
        # Random tensors (drawn, or computed from draws without tile data), and the modules
        # whose own normalisation has a spatial form (see _NORMS).
        self.randoms: dict[int, torch.Tensor] = {}
        self.norms, self.norm_paths = norms, set[str]()
        self.tiles: dict[int, tuple[torch.Tensor, _Tile]] = {}
        # Replicated tensors (a global pool's output and what is computed from it alone),
        # with the pools they come from; and the parameters used on each pool's lineage.
        self.reps: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}
        self.lineage_params: dict[str, set[str]] = {}
        # Tensors computed from parameters alone (a reshaped layer scale), with their names.
        self.derived: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}
        # Tensors made without tile data: the dims (negative) along which their values do not
        # change (a zeros map, a pooled value upsampled); and the global reductions' outputs,
        # with the pixel count of the map each reduced.
        self.flat: dict[int, tuple[torch.Tensor, frozenset[int]]] = {}
        self.counts: dict[int, tuple[torch.Tensor, int]] = {}
        self.params, self.known, self.use = params, known, use
        self.root = "<model>"
        self.frames: Frames | None = None  # set by watch_tiles

    @property
    def inside(self) -> int:
        """Depth inside modules that have a spatial form (their internals are trusted)."""
        return self.frames.inside if self.frames is not None else 0

    # -- taint -------------------------------------------------------------------------
    def tile_of(self, t: object) -> _Tile | None:
        if isinstance(t, torch.Tensor):
            hit = self.tiles.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
        return None

    def mark(self, t: object, tile: _Tile | None) -> None:
        if isinstance(t, torch.Tensor) and tile is not None:
            self.tiles[id(t)] = (t, tile)

    def pools_of(self, t: object) -> frozenset[str]:
        if isinstance(t, torch.Tensor):
            hit = self.reps.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
        return frozenset()

    def params_of(self, t: object) -> frozenset[str]:
        """Names of the parameters ``t`` is, or is computed from (without tile data)."""
        if isinstance(t, torch.Tensor):
            if id(t) in self.params:
                return frozenset({self.params[id(t)]})
            hit = self.derived.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
        return frozenset()

    def mark_derived(self, t: object, names: frozenset[str]) -> None:
        if isinstance(t, torch.Tensor) and names:
            self.derived[id(t)] = (t, names)

    def mark_replicated(self, t: object, pools: frozenset[str]) -> None:
        if isinstance(t, torch.Tensor) and pools:
            self.reps[id(t)] = (t, pools)

    def on_lineage(self, pools: frozenset[str], names: Iterable[str]) -> None:
        for p in pools:
            self.lineage_params.setdefault(p, set()).update(names)

    # -- links for deep halos ------------------------------------------------------------
    def lineage_of(self, t: object) -> _Lineage | None:
        if isinstance(t, torch.Tensor):
            hit = self.lineages.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
        return None

    def used(self, t: object) -> None:
        if isinstance(t, torch.Tensor) and self.tile_of(t) is not None:
            hit = self.uses.get(id(t))
            n = hit[1] if hit is not None and hit[0] is t else 0
            self.uses[id(t)] = (t, n + 1)

    def uses_of(self, t: torch.Tensor) -> int:
        hit = self.uses.get(id(t))
        return hit[1] if hit is not None and hit[0] is t else 0

    def follow(self, out: object, source: torch.Tensor, carrier: str | None = None) -> None:
        """``out`` is computed per pixel from ``source`` alone (through ``carrier``)."""
        lin = self.lineage_of(source)
        if lin is not None and isinstance(out, torch.Tensor):
            extra = (carrier,) if carrier is not None else ()
            self.lineages[id(out)] = (
                out,
                _Lineage(lin.producer, lin.carriers + extra, (*lin.path, source)),
            )

    def links(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        """The links of this pass: layers called once, every tensor on the way used once."""
        found = {}
        for consumer, (lin, arg) in self.candidates.items():
            once = [lin.producer, consumer, *lin.carriers]
            tensors = [*lin.path, arg]
            if all(self.calls.get(m) == 1 for m in once) and all(
                self.uses_of(t) == 1 for t in tensors
            ):
                found[consumer] = (lin.producer, lin.carriers)
        return found

    # -- module hooks --------------------------------------------------------------------
    def enter(self, path: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        names = [f"{path}.{n}" if path else n for n, _ in module.named_parameters()]
        if self.norms is not None and self.norms(module):
            self.norm_paths.add(path)
        if self.inside == 0 and any(self.tile_of(a) for a in args):
            self.use.tile_modules.add(path)
            if self.known(module):
                self.in_order(path or self.root, module, args)
                self.use.tile_params.update(names)
                self.calls[path] = self.calls.get(path, 0) + 1
                for a in args:
                    self.used(a)
                lin = self.lineage_of(args[0]) if len(args) == 1 else None
                if lin is not None:
                    self.candidates[path] = (lin, args[0])
        elif self.inside == 0 and self.known(module):
            pools = frozenset().union(*(self.pools_of(a) for a in args))
            self.on_lineage(pools, names)

    def in_order(self, path: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        """A layer with a spatial form takes its tiles as ``(N, C, *spatial)``: a map whose
        tiled dims were moved (``x.permute(0, 2, 1, 3)``) would be windowed over others."""
        for a in args:
            tile = self.tile_of(a)
            if tile is not None and (tile.flat is not None or tile.dims != _last(a, tile.hw).dims):
                raise _refuse(
                    path,
                    type(module).__name__,
                    f"takes a map whose tiled dims are {tile.dims} of {a.dim()}, not its last "
                    f"{len(tile.hw)}",
                    "call it on the (N, C, *spatial) map the grid tiles (permute back first)",
                )

    def leave(self, path: str, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if not self.known(module) or self.inside or not isinstance(out, torch.Tensor):
            return
        source = next((t for a in args if (t := self.tile_of(a)) is not None), None)
        if source is None:
            self.mark_replicated(out, frozenset().union(*(self.pools_of(a) for a in args)))
        elif isinstance(
            module,
            nn.AdaptiveAvgPool1d
            | nn.AdaptiveMaxPool1d
            | nn.AdaptiveAvgPool2d
            | nn.AdaptiveMaxPool2d
            | nn.AdaptiveAvgPool3d
            | nn.AdaptiveMaxPool3d
            | nn.Flatten,  # a dense head's input, gathered whole (spatial.SpatialFlatten)
        ):
            self.mark_replicated(out, frozenset({path}))  # a global pool: every rank holds it
        else:
            self.mark(out, _last(out, tuple(int(v) for v in out.shape[-len(source.hw) :])))
            if self.carriers is not None and self.carriers(module) and len(args) == 1:
                self.follow(out, args[0], carrier=path)
            else:
                self.lineages[id(out)] = (out, _Lineage(path))

    # -- ops -------------------------------------------------------------------------------
    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.inside:
            return out
        flat, _ = tree_flatten((args, kwargs))
        tiles = [t for a in flat if (t := self.tile_of(a)) is not None]
        pools = frozenset().union(*(self.pools_of(a) for a in flat))
        used = frozenset().union(*(self.params_of(a) for a in flat))
        outs, _ = tree_flatten(out)
        if self.random_draw(func, flat, tiles, outs):
            return out
        path = (self.frames.path if self.frames is not None else "") or self.root
        self.counted(func, args, outs, path)
        if not tiles:
            self.on_lineage(pools, used)
            # A detached copy (w.detach(), w.data) takes no gradient: not its parameter's use.
            derived = frozenset() if func.overloadpacket.__name__ in _DETACHING else used
            for o in outs:
                self.mark_replicated(o, pools)
                self.mark_derived(o, derived)  # e.g. a layer scale reshaped to (1, C, 1, 1)
            self.mark_flat(func, flat, outs)
            return out
        self.use.rejoined_pools |= pools  # a pooled value meets the tiles again
        self.mixed(func, flat, path)
        self.use.tile_params.update(used)
        result = self.classify(func, args, kwargs, tiles[0], out, path)
        self.written(func, args, result, path)
        for o in outs:
            self.mark(o, result)
        self.track(func, flat, outs, result)
        return out

    # -- tensors not made from the tiles -------------------------------------------------
    def flat_dims(self, t: torch.Tensor) -> frozenset[int]:
        """The dims (negative) along which ``t``'s values do not change: its dims of size 1,
        and those :meth:`mark_flat` followed."""
        ones = frozenset(d - t.dim() for d in range(t.dim()) if t.shape[d] == 1)
        hit = self.flat.get(id(t))
        return ones | hit[1] if hit is not None and hit[0] is t else ones

    def mark_flat(self, func: Any, flat: list[Any], outs: list[Any]) -> None:
        """Follow, for tensors made without tile data, the dims along which their values do
        not change: everywhere for a constant (``torch.zeros``, ``fill_``), along the dims
        every operand is flat in for a per-element op, a view that keeps the trailing dims, an
        expand, an upsample of a map flat in space (a pooled value resized to the map, as ASPP
        does)."""
        name = str(func.overloadpacket.__name__)
        sources = [a for a in flat if isinstance(a, torch.Tensor)]
        dst = sources[0] if sources and name.endswith("_") and name not in _CONSTANTS else None
        if dst is not None and dst._base is not None:
            self.flat.pop(id(dst._base), None)  # written in part: no longer known to be flat
        for o in outs:
            if not isinstance(o, torch.Tensor):
                continue
            every = frozenset(range(-o.dim(), 0))
            if name in _CONSTANTS:
                kept = every
            elif torch.Tag.pointwise in func.tags or name in _POINTWISE_NAMES:
                kept = frozenset(
                    d for d in every if all(a.dim() < -d or d in self.flat_dims(a) for a in sources)
                )
            elif (func in _VIEWS or name.startswith(_UPSAMPLES)) and sources:
                x = sources[0]
                kept = frozenset(
                    d
                    for d in self.flat_dims(x)
                    if -d <= o.dim()
                    and (
                        name.startswith(_UPSAMPLES)
                        or func is _aten.expand.default  # from the right, sizes 1 repeated
                        or tuple(x.shape[d:]) == tuple(o.shape[d:])
                    )
                )
            else:
                continue
            self.flat[id(o)] = (o, kept)

    def mixed(self, func: Any, flat: list[Any], path: str) -> None:
        """A tensor made without tile data, of the tile's extent in a spatial dim and not flat
        along it, combined per pixel with a tile (coordinates from ``torch.arange(x.shape[2])``,
        a mask or positional embedding sized from ``x.shape``): it would be the same on every
        tile, not the whole image's, so it is refused."""
        name = str(func.overloadpacket.__name__)
        if not (
            torch.Tag.pointwise in func.tags
            or name in _POINTWISE_NAMES
            or func in (_aten.cat.default, _aten.stack.default, _aten.copy_.default)
        ):
            return
        ref = next(a for a in flat if self.tile_of(a) is not None)
        tile = self.tile_of(ref)
        assert tile is not None
        if tile.flat is not None:
            return
        read = flat[1:] if func is _aten.copy_.default else flat  # copy_ overwrites its first
        for a in read:
            if not isinstance(a, torch.Tensor) or self.tile_of(a) is not None:
                continue
            fixed = self.flat_dims(a)
            if any(-a.dim() <= d - ref.dim() and d - ref.dim() not in fixed for d in tile.dims):
                raise _refuse(
                    path,
                    f"aten.{name} with a tensor of shape {tuple(a.shape)}",
                    "combines the tiled map with a tensor that spans its spatial dims but is "
                    "not computed from it (coordinates, a mask or an embedding sized from "
                    "x.shape): on a tile x.shape is the tile's, and the tensor would be the "
                    "same on every tile",
                    "pass such maps as input channels, or compute them from the map itself "
                    "(torch.ones_like(x), x.new_ones(...))",
                )

    def counted(self, func: Any, args: Sequence[Any], outs: list[Any], path: str) -> None:
        """A global reduction's output divided or multiplied by the pixel count of the map it
        reduced, a number read off the tile's shape (``x.sum((2, 3)) / (h * w)``): on a tile
        that is the tile's count, not the image's, so it is refused."""
        hit = next(
            (
                (t, n)
                for t in args
                if isinstance(t, torch.Tensor) and (n := self.count_of(t)) is not None
            ),
            None,
        )
        if hit is None:
            return
        name = str(func.overloadpacket.__name__)
        if func in _VIEWS:
            for o in outs:
                if isinstance(o, torch.Tensor):
                    self.counts[id(o)] = (o, hit[1])
            return
        n = hit[1]
        numbers = [a for a in args if isinstance(a, int | float) and not isinstance(a, bool)]
        scaled = name in ("div", "div_") and any(v == n for v in numbers)
        scaled |= name in ("mul", "mul_") and any(
            v == n or math.isclose(v, 1 / n, rel_tol=1e-9) for v in numbers
        )
        if n > 1 and scaled:
            raise _refuse(
                path,
                f"aten.{name} of a global reduction by {n}",
                "scales a global reduction of the tiled map by its pixel count read off "
                "x.shape: on a tile x.shape is the tile's, not the image's",
                "average with x.mean((2, 3)) or nn.AdaptiveAvgPool2d(1), which the grid "
                "takes over the whole image",
            )

    def count_of(self, t: torch.Tensor) -> int | None:
        hit = self.counts.get(id(t))
        return hit[1] if hit is not None and hit[0] is t else None

    def written(self, func: Any, args: Sequence[Any], result: _Tile | None, path: str) -> None:
        """Tile data written in place into a view of another tensor (``out[:, :c] = x``):
        that tensor carries tile data too. A view that cuts the spatial dims (a pad, crop
        or shift written by hand: PyTorch's circular pad) is refused, or the tensor would
        leave the watch untainted and its pixels be mixed unseen."""
        dst = args[0] if args else None
        if (
            not str(func.overloadpacket.__name__).endswith("_")
            or not isinstance(dst, torch.Tensor)
            or dst._base is None
            or self.tile_of(dst) is not None
        ):
            return
        base = dst._base
        if (
            result is not None
            and result.flat is None
            and base.dim() == dst.dim()
            and all(base.shape[d] == dst.shape[d] for d in result.dims)
        ):
            self.mark(base, result)
            return
        raise _refuse(
            path,
            f"aten.{func.overloadpacket.__name__} into part of a tensor",
            "writes the tiled map into a window of a larger (or smaller) map: a pad, crop or "
            "shift of the whole image written by hand (as PyTorch's circular pad is)",
            "pad with F.pad(..., mode='constant') (or 'reflect'/'replicate' on a 2-D map), or do "
            "it on the input",
        )

    def track(self, func: Any, flat: list[Any], outs: list[Any], result: _Tile | None) -> None:
        """Uses of tile tensors, and lineages carried through per-pixel ops (deep halos)."""
        tiles = [a for a in flat if isinstance(a, torch.Tensor) and self.tile_of(a) is not None]
        in_place = len(outs) == 1 and any(o is t for o in outs for t in tiles)
        pointwise = torch.Tag.pointwise in func.tags or func.overloadpacket.__name__ in (
            _POINTWISE_NAMES
        )
        alone = len({id(t) for t in tiles}) == 1 and pointwise and result is not None
        if in_place:
            # relu_(x): x is still the same tensor; mixing another tile into it ends its lineage,
            # and reads the other tile (``out += identity``: a second use of the identity).
            if not alone:
                for t in tiles:
                    self.lineages.pop(id(t), None)
                    if t is not outs[0]:
                        self.used(t)
            return
        for t in tiles:
            self.used(t)
        if alone and len(outs) == 1:
            self.follow(outs[0], tiles[0])

    def random_draw(self, func: Any, flat: list[Any], tiles: list[_Tile], outs: list[Any]) -> bool:
        """Random numbers: a draw per pixel of a tile is refused; one per sample or channel
        (drop-path, ``Dropout2d``, dropout in the head) is recorded, for its module to draw
        alike on every tile (:mod:`.randomness`). True when ``func`` drew."""
        path = (self.frames.path if self.frames is not None else "") or self.root
        if draws_random(func):
            if tiles:
                raise _refuse(path, f"aten.{func.overloadpacket.__name__}", *_PER_PIXEL)
            self.use.random_modules.add(self.frames.path if self.frames is not None else "")
            self.randoms.update((id(o), o) for o in outs if isinstance(o, torch.Tensor))
            return True
        drawn = [a for a in flat if isinstance(a, torch.Tensor) and self.randoms.get(id(a)) is a]
        if drawn and not tiles:
            self.randoms.update((id(o), o) for o in outs if isinstance(o, torch.Tensor))
        ref = next((a for a in flat if self.tile_of(a) is not None), None)
        tile = self.tile_of(ref)
        if not drawn or not isinstance(ref, torch.Tensor) or tile is None:
            return False
        for r in drawn:
            aligned = [d - (ref.dim() - r.dim()) for d in tile.dims]  # broadcast from the right
            if any(0 <= d < r.dim() and r.shape[d] > 1 for d in aligned):
                raise _refuse(
                    path, f"aten.{func.overloadpacket.__name__} of a random mask", *_PER_PIXEL
                )
        return False

    def classify(
        self,
        func: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        tile: _Tile,
        out: Any,
        path: str,
    ) -> _Tile | None:
        """The tile layout of the op's output, or ConfigError if the op mixes pixels."""
        name = str(func.overloadpacket.__name__)
        x = args[0] if args else None
        nd = x.dim() if isinstance(x, torch.Tensor) else 4
        first = tree_flatten(out)[0][0] if tree_flatten(out)[0] else out
        if torch.Tag.pointwise in func.tags or name in _POINTWISE_NAMES:
            return tile
        if name in _NORMS and self.frames is not None and self.frames.path in self.norm_paths:
            return tile  # the layer's spatial form normalises over the whole image
        if name in _NEW and isinstance(first, torch.Tensor):
            return tile if tile.flat is None and _keeps(first, tile) else None
        if func in _VIEWS and isinstance(first, torch.Tensor) and isinstance(x, torch.Tensor):
            if tile.flat is None and _keeps(first, tile):
                return _last(first, tile.hw)
            flat = _rows_of_pixels(x, first, tile)
            if flat is not None:
                return flat
        if func in _MATMUL and tile.flat is not None:
            rows, other = (args[1], args[2]) if func is _aten.addmm.default else (args[0], args[1])
            if self.tile_of(rows) is tile and self.tile_of(other) is None:
                return tile  # (pixels, C) @ (C, D): per pixel, as nn.Linear on channels-last
        if func in _VIEWS:
            raise _refuse(
                path,
                f"aten.{name} to shape {tuple(first.shape) if isinstance(first, torch.Tensor) else '?'}",
                f"reshapes the tiled feature map across its spatial dims {tile.hw}",
                "reduce the map with nn.AdaptiveAvgPool2d(1) or nn.AdaptiveMaxPool2d(1) "
                "(modules) before flattening it",
            )
        if func in (_aten.permute.default, _aten.transpose.int):
            order = _permutation(func, args, nd)
            moved = tuple(order.index(d) for d in tile.dims)
            if list(moved) != sorted(moved):
                raise _refuse(
                    path,
                    f"aten.{name} to dims {order}",
                    "swaps the spatial dims of a tile: the tile's rows are not the image's "
                    "columns (a tile sits at another place of the transposed image)",
                    "transpose the input, or keep the spatial dims in their order (moving "
                    "channels last is fine)",
                )
            return _Tile(moved, tile.hw)
        if func in _ALONG and int(args[1]) % nd not in tile.dims:
            return tile
        if func in _REORDERS:
            at = [a.name for a in func._schema.arguments].index("dims")
            dims = args[at] if len(args) > at else kwargs.get("dims", ())
            if dims and not {int(d) % nd for d in dims} & set(tile.dims):
                return tile  # a flip or roll of channels (or of the batch): per pixel
        if torch.Tag.reduction in func.tags or func in _LAYER_NORM:
            dims = _reduced_dims(func, args, kwargs, nd)
            if not dims & set(tile.dims):
                keep = isinstance(first, torch.Tensor) and first.dim() == nd
                return _shifted(tile, dims, keep)
            k = len(tile.hw)
            spatial = tuple(range(-k, 0))
            raise _refuse(
                path,
                f"aten.{name} over dims {sorted(dims)}",
                "reduces over the spatial dims of a tile as if it were the whole image",
                f"write a norm as a global sum (x.abs().sum({spatial}) for p=1, "
                f"x.pow(2).sum({spatial}).sqrt() for p=2), which has a spatial form"
                if "norm" in name
                else f"use nn.AdaptiveAvgPool{k}d(1) / nn.AdaptiveMaxPool{k}d(1) modules for "
                "global pooling",
            )
        if func in (_aten.cat.default, _aten.stack.default) or func in _SPLITS:
            at = 2 if func in _SPLITS else 1  # split(x, sizes, dim), cat(tensors, dim)
            dim = int(args[at] if len(args) > at else kwargs.get("dim", 0))
            dim = dim % nd if func is not _aten.stack.default else dim
            if dim not in tile.dims:
                if func is _aten.stack.default:
                    return _Tile(tuple(d + (d >= dim) for d in tile.dims), tile.hw)
                return tile
        elif func in _SLICES:
            dim = int(args[1]) % nd
            if dim not in tile.dims:
                return _shifted(tile, {dim}, func is not _aten.select.int)
            if (
                isinstance(first, torch.Tensor)
                and isinstance(x, torch.Tensor)
                and first.shape == x.shape
            ):  # a slice that keeps everything: x[..., :]
                return tile
        what, fix = _REFUSALS.get(name, (_UNKNOWN, _USE_MODULES))
        raise _refuse(path, f"aten.{name}", what, fix)


_PER_PIXEL = (
    "draws random numbers per pixel of the tiled map (dropout or DropBlock on the feature map): "
    "a tile's draws are not the whole image's",
    "drop whole samples or channels (drop-path, nn.Dropout2d), drop after the global pool, "
    "or set that rate to 0",
)
_USE_MODULES = (
    "use the torch.nn module (Conv2d, MaxPool2d, AvgPool2d, BatchNorm2d, AdaptiveAvgPool2d(1)) "
    "so that its spatial form runs, or run without spatial parallelism"
)
#: Ops whose output takes no gradient back to their input.
_DETACHING = frozenset({"detach", "detach_"})
_UNKNOWN = "mixes pixels of the tiled feature map (or is not known not to)"
_EDGE_PAD = (
    "has no exact tiled form (a tile's edge is not the image's)",
    "use F.pad(..., mode='constant') or a zero-padded convolution",
)
_INTERPOLATION = (
    "is an interpolation with no tiled form (bicubic, area or antialias)",
    "use F.interpolate / nn.Upsample with mode 'nearest' or 'bilinear' (antialias=False)",
)
#: What each refused ATen op is, and what to do instead (default: :data:`_UNKNOWN`).
_REFUSALS: dict[str, tuple[str, str]] = {
    "convolution": ("a functional convolution (F.conv2d) on the tiled map", _USE_MODULES),
    "max_pool2d_with_indices": ("a functional pool (F.max_pool2d) on the tiled map", _USE_MODULES),
    "avg_pool2d": ("a functional pool (F.avg_pool2d) on the tiled map", _USE_MODULES),
    "max_pool3d_with_indices": ("a functional pool (F.max_pool3d) on the tiled map", _USE_MODULES),
    "avg_pool3d": ("a functional pool (F.avg_pool3d) on the tiled map", _USE_MODULES),
    "reflection_pad3d": _EDGE_PAD,
    "replication_pad3d": _EDGE_PAD,
    "_adaptive_avg_pool3d": (
        "adaptive pooling to more than 1x1x1 depends on the whole volume's size",
        "pool globally (output size 1)",
    ),
    "constant_pad_nd": (
        "a pad that is not F.pad of the last two dims (or of a tile, not the image)",
        "pad with F.pad(x, (left, right, top, bottom[, front, back])) or nn.ZeroPad2d/"
        "nn.ConstantPad2d/nn.ConstantPad3d",
    ),
    "reflection_pad2d": _EDGE_PAD,
    "replication_pad2d": _EDGE_PAD,
    "_pad_circular": _EDGE_PAD,
    "upsample_bicubic2d": _INTERPOLATION,
    "_upsample_bilinear2d_aa": _INTERPOLATION,
    "_upsample_bicubic2d_aa": _INTERPOLATION,
    "_adaptive_avg_pool2d": (
        "adaptive pooling to more than 1x1 depends on the whole image's size",
        "pool globally (output size 1)",
    ),
    "flip": ("a flip of the whole image reads pixels from the far tiles", "flip the input"),
    "roll": ("a roll of the whole image reads pixels from the far tiles", "roll the input"),
    "slice": (
        "a crop of the tiled map (x[..., a:b, c:d])",
        "crop with F.pad and negative pads (its spatial form is exact), or crop the input",
    ),
}


def _rows_of_pixels(x: torch.Tensor, out: torch.Tensor, tile: _Tile) -> _Tile | None:
    """A view that merges the spatial dims, and those before them, into rows (or undoes it)."""
    k = len(tile.hw)
    if tile.flat is not None:
        if tuple(out.shape) == (*tile.flat, *x.shape[1:]):
            return _Tile(tuple(range(len(tile.flat) - k, len(tile.flat))), tile.hw)
        return tile if tuple(out.shape) == tuple(x.shape) else None
    if not _adjacent(tile):
        return None
    last = tile.dims[-1]
    lead = tuple(int(v) for v in x.shape[: last + 1])
    if tuple(out.shape) == (math.prod(lead), *x.shape[last + 1 :]):
        return _Tile((0,) * k, tile.hw, lead)
    return None


def _adjacent(tile: _Tile) -> bool:
    """Whether the spatial dims are adjacent and in order."""
    return tile.dims == tuple(range(tile.dims[0], tile.dims[0] + len(tile.dims)))


def _keeps(out: torch.Tensor, tile: _Tile) -> bool:
    """Whether ``out`` keeps the (adjacent, last) spatial dims at the same size."""
    k = len(tile.hw)
    return out.dim() >= k and tuple(out.shape[-k:]) == tile.hw and _adjacent(tile)


def _permutation(func: Any, args: Sequence[Any], nd: int) -> list[int]:
    if func is _aten.permute.default:
        return [int(d) % nd for d in args[1]]
    a, b = int(args[1]) % nd, int(args[2]) % nd
    order = list(range(nd))
    order[a], order[b] = order[b], order[a]
    return order


def _reduced_dims(func: Any, args: Sequence[Any], kwargs: dict[str, Any], nd: int) -> set[int]:
    if func in _LAYER_NORM:
        k = len(args[1])
        return set(range(nd - k, nd))
    # the argument named dim, wherever the overload puts it (linalg_vector_norm's args[1] is
    # its order: read as dims, an L1 norm over the image passed as one over channels)
    names = [a.name for a in func._schema.arguments]
    if "dim" not in names:
        return set(range(nd))  # an overload without dims (e.g. max of all): everything
    at = names.index("dim")
    dim = args[at] if len(args) > at else kwargs.get("dim")
    if dim is None or (isinstance(dim, Sequence) and len(dim) == 0):
        return set(range(nd))
    if isinstance(dim, int):
        return {dim % nd}
    if isinstance(dim, Sequence) and all(isinstance(d, int) for d in dim):
        return {int(d) % nd for d in dim}
    return set(range(nd))  # an overload without dims (e.g. max of all): everything


def _shifted(tile: _Tile, removed: set[int], keep: bool) -> _Tile:
    if keep:
        return tile
    return _Tile(tuple(d - sum(r < d for r in removed) for d in tile.dims), tile.hw)


class _Sites(SiteMode):
    """The watch's function-level half: global reductions, pads and interpolations.

    A site (see :mod:`.functional`) that reads tile data is recorded and runs
    unchecked (its spatial form does the work at run time): a reduction's
    output is replicated, like a global pool module's; a pad's or an
    interpolation's output is a tile again, of its new size.
    """

    def __init__(self, watch: _Watch, frames: Frames) -> None:
        super().__init__(frames)
        self.watch = watch
        self.seen: dict[str, bool] = {}

    def at_site(
        self,
        func: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        site: Site | Resample | Windowed,
        name: str,
    ) -> Any:
        self.watch.use.seen_sites.add(name)
        x = args[0] if args else kwargs.get("input")
        tile = self.watch.tile_of(x)
        if isinstance(site, Site) and site.channels_last and tile is not None:
            assert isinstance(x, torch.Tensor)
            if tile.flat is not None or tile.dims != site.spatial_dims(x.dim()):
                # (N, C, H, W) reduced over its channels and rows: no site; its ops are judged
                return func(*args, **kwargs)
        tiled = tile is not None
        if self.seen.setdefault(name, tiled) != tiled:  # one name, one run-time behaviour
            path = name.rsplit("#", 1)[0] or self.watch.root
            raise ConfigError(
                f"module {path!r}",
                f"its {getattr(func, '__name__', func)} call runs on tile data in one call and "
                "on pooled data in another",
                "give each use its own module instance",
            )
        if not tiled:
            return func(*args, **kwargs)
        assert isinstance(x, torch.Tensor) and tile is not None
        dims = site.spatial_dims(x.dim()) if isinstance(site, Site) else tuple(range(2, x.dim()))
        if tile.flat is not None or tile.dims != dims:
            # e.g. F.interpolate(x, mode="linear") of a 2-D map's rows: its spatial form
            # would resample the wrong dims
            raise _refuse(
                name.rsplit("#", 1)[0] or self.watch.root,
                getattr(func, "__name__", str(func)),
                f"on a {x.dim()}-D tensor whose tiled dims are {tile.dims}, not its last "
                f"{x.dim() - 2}",
                "call it on the (N, C, *spatial) map the grid tiles (a 1-D grid L<GL> for "
                "(N, C, L) signals)",
            )
        if isinstance(site, Windowed):
            self.weights(site, args, kwargs, name)
        self.watch.use.functional_sites.add(name)
        self.frames.inside += 1  # its own ops are the spatial form's business
        try:
            out = func(*args, **kwargs)
        finally:
            self.frames.inside -= 1
        if isinstance(site, Resample | Windowed):
            k = out.dim() - 2
            self.watch.mark(out, _last(out, tuple(int(v) for v in out.shape[-k:])))
        else:
            self.watch.mark_replicated(out, frozenset({name}))
            channels = int(x.shape[-1] if site.channels_last else x.shape[1])
            if isinstance(out, torch.Tensor) and math.prod(tile.hw) != channels:
                # (a count equal to the channels' is not told apart from them: not followed)
                self.watch.counts[id(out)] = (out, math.prod(tile.hw))
        return out

    def weights(
        self, site: Windowed, args: Sequence[Any], kwargs: dict[str, Any], name: str
    ) -> None:
        """A functional convolution's weight and bias on tile data: parameters (or tensors
        computed from them) are used on the tiles, their gradients summed; a pooled value
        meets the tiles again; weights computed from the tiles themselves are refused."""
        for t in site.tensors(args, kwargs):
            if self.watch.tile_of(t) is not None:
                raise _refuse(
                    name.rsplit("#", 1)[0] or self.watch.root,
                    f"F.{site.func}",
                    "convolves the tiled map with weights computed from the tiled map",
                    "compute the weights from a global pool (nn.AdaptiveAvgPool2d(1))",
                )
            self.watch.use.tile_params.update(self.watch.params_of(t))
            self.watch.use.rejoined_pools |= self.watch.pools_of(t)


def _watch_once(
    model: nn.Module,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    known: Callable[[nn.Module], bool],
    norms: Callable[[nn.Module], bool] | None,
    params: dict[int, str],
    use: TileUse,
    carriers: Callable[[nn.Module], bool] | None = None,
) -> tuple[_Watch, Any]:
    """One meta-device pass of ``model`` under the watch, in the modules' current modes."""
    watch = _Watch(params, known, use, norms, carriers)
    watch.root = type(model).__name__
    frames = Frames(model, known, on_enter=watch.enter, on_leave=watch.leave)
    watch.frames = frames
    x = torch.empty(shape, device="meta", dtype=dtype)
    watch.mark(x, _last(x, tuple(int(v) for v in shape[2:])))
    try:
        # tensors the forward makes without a device (torch.tensor([...]) constants) are
        # made on the meta device too, as they would be on the input's device in a real run
        with torch.no_grad(), torch.device("meta"), _Sites(watch, frames), watch:
            out = model(x)
    finally:
        frames.remove()
    return watch, out


def _failing_module(model: nn.Module, err: BaseException) -> str:
    """The path (quoted) of the innermost module of ``model`` whose forward raised ``err``,
    read off its traceback; empty when none of them did."""
    paths = {id(m): p for p, m in model.named_modules() if p}  # the root is named by its type
    found = ""
    tb = err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in paths:
            found = repr(paths[id(owner)])
        tb = tb.tb_next
    return found


def watch_tiles(
    model: nn.Module,
    shape: tuple[int, ...],
    known: Callable[[nn.Module], bool],
    *,
    norms: Callable[[nn.Module], bool] | None = None,
    carriers: Callable[[nn.Module], bool] | None = None,
    origin: str = "the image size given",
) -> TileUse:
    """Run ``model`` (a meta copy) on a meta input of ``shape`` under the watch.

    ``known(module)`` says which modules have a spatial form (their internals
    are trusted); ``norms(module)``, which modules' own normalisation has one
    while their children (an activation, a dropout) are judged as usual. The
    model runs twice, in eval and in training mode (where drop-path and
    dropout draw), the layers with a spatial form in eval mode both times.
    Returns the :class:`TileUse`; raises ConfigError naming the module path
    and the op when a function mixes pixels of tile data. ``carriers(module)``
    says which modules with a spatial form act per pixel once their statistics
    are known (BatchNorm): a deep halo may pass through them (``TileUse.links``,
    the links found in both passes). ``origin`` says where ``shape``'s size comes from,
    for the line that refuses a model failing on it.
    """
    use = TileUse()
    params = {id(p): n for n, p in model.named_parameters()}
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    modes = {m: m.training for m in model.modules()}
    lineage: dict[str, set[str]] = {}
    reaching: frozenset[str] = frozenset()
    try:
        for training in (False, True):
            model.train(training)
            for m in model.modules():
                if known(m) or (norms is not None and norms(m)):
                    m.training = False  # their own forward is the spatial form's business
            try:
                watch, out = _watch_once(model, shape, dtype, known, norms, params, use, carriers)
            except HyfiError:
                raise
            except Exception as err:  # the model's own code failed: say so in one line
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                size = "x".join(map(str, shape[2:]))
                where = _failing_module(model, err)
                fix = (
                    f"make {f'module {where}' if where else 'the forward'} create its tensors on the input's device "
                    "(torch.tensor(..., device=x.device)): the model is first run on the meta "
                    "device to see what it does with the tiles"
                    if "device" in first and "meta" in first
                    else "pass the image size the model takes (apply_spatial(..., image_size=(H, W)),"
                    " or an input_size attribute on the model): a dense head on the flattened "
                    "map takes one size only"
                    if origin.startswith("a probe")
                    else f"this model does not take {size}: give it an image size it takes (a "
                    "dense head on the flattened map takes only the size it was built for), "
                    "and make it run on the meta device"
                )
                raise ConfigError(
                    f"model {type(model).__name__}" + (f", module {where}" if where else ""),
                    f"fails on a {size} input ({origin}) on the meta device "
                    f"({'training' if training else 'eval'} mode): {type(err).__name__}: {first}",
                    fix,
                ) from err
            found = watch.links()
            use.links = (
                found if not training else {k: v for k, v in use.links.items() if found.get(k) == v}
            )
            results, _ = tree_flatten(out)
            reaching = reaching.union(*(watch.pools_of(o) for o in results))
            for pool, names in watch.lineage_params.items():
                lineage.setdefault(pool, set()).update(names)
    finally:
        for m, mode in modes.items():
            m.training = mode
    both = sorted(reaching & use.rejoined_pools)
    if both:
        raise ConfigError(
            f"module {both[0]!r}",
            "its pooled output is used both on the tiles and by the head",
            "give the head its own global pool module",
        )
    head = set().union(*(lineage.get(pool, set()) for pool in reaching - use.rejoined_pools))
    shared = sorted(head & use.tile_params)
    if shared:
        # Its gradient is a tile's share (summed over the tiles) plus a whole one (the head's,
        # on every rank): summing it all counted the head's once per tile (0.64 relative).
        raise ConfigError(
            f"parameter {shared[0]!r}",
            "is used both on the tiles and on the value of a global pool that every rank "
            "holds whole (a module reused in the head, or a head's weight applied to the "
            "map): its gradient is neither a tile's share nor whole",
            "give the head its own module (parameters), or apply a detached copy "
            "(w.detach()) on the map",
        )
    for pool in use.rejoined_pools:
        use.tile_params |= lineage.get(pool, set())
    return use
