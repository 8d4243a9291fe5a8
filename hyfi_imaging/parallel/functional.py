"""Functions that mix pixels across tiles: where they are, and their spatial form.

Why: models pool with functions as often as with modules -- torchvision's
DenseNet and MobileNetV2 end with ``F.adaptive_avg_pool2d(x, 1)``, many
squeeze-excite blocks call ``x.mean((2, 3), keepdim=True)``. On a tile each
would pool the tile only. A *site* is one such call: a global average, sum or
maximum over all spatial dims of a 4-D map (``F.adaptive_avg_pool2d`` /
``F.adaptive_max_pool2d`` to 1x1, ``mean`` / ``sum`` / ``amax`` over dims
``(2, 3)``) or of a 5-D volume (the ``3d`` pools to 1x1x1, reductions over
``(2, 3, 4)``), or of a channels-last map (``mean`` / ``sum`` / ``amax`` over
``(1, 2)`` of ``(N, H, W, C)``, as timm's MambaOut head does; over ``(1, 2, 3)`` of
a volume): the same global reduction, the channels in another place. Sites are named ``"<module path>#<k>"``: the k-th site call made
directly by that module's ``forward`` in one invocation. The name is the same
in the meta-device traces (where the functional-op watch learns which sites see
tile data and the shape trace learns each site's true input size) and at run
time, where :class:`SpatialFunctions` replaces exactly those calls by masked
local reductions and an all-reduce (``SpatialContext.global_reduce``), like the
global-pool modules. Calls inside layers that have a spatial form are not
counted: those layers do their own work.

The same holds for *resampling* sites (:class:`Resample`): ``F.pad`` with a
constant, or of a 2-D map with a reflection or a replication (the pad lies at the
image border, not at every tile's: a reflection there reads pixels of the border
tile, or of its neighbour through the halo) and
``F.interpolate`` (nearest, nearest-exact, bilinear, trilinear; any size or
scale factor, either ``align_corners``), also inside ``nn.Upsample`` and
``nn.ZeroPad2d``, on 4-D maps and 5-D volumes.
Each output pixel reads at most two input pixels per axis; :func:`source_coords`
asks PyTorch itself where (the same function on an index ramp, so its rounding
rules are never re-implemented) and ``SpatialContext.resample`` fetches them
with one halo exchange.

And for *windowed* sites (:class:`Windowed`): a convolution or pool of a 2-D map
called as a function (``F.conv2d``, ``F.avg_pool2d``, ``F.max_pool2d``: GhostNetV2's
attention branch, timm's blur pool) is the same computation as
the ``torch.nn`` layer of the same arguments, so it runs that layer's spatial form
(halo exchange, padding only at the image border); a convolution's weight and bias
are read at each call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from hyfi_imaging.errors import ConfigError

__all__ = [
    "Frames",
    "Resample",
    "Site",
    "SiteMode",
    "SpatialFunctions",
    "Windowed",
    "site_of",
    "site_op_name",
    "source_coords",
]

_KINDS = {
    "adaptive_avg_pool1d": "avg",
    "adaptive_max_pool1d": "max",
    "_adaptive_max_pool1d": "max",
    "adaptive_max_pool1d_with_indices": "max",
    "adaptive_avg_pool2d": "avg",
    "adaptive_max_pool2d": "max",
    "_adaptive_max_pool2d": "max",
    "adaptive_max_pool2d_with_indices": "max",
    "adaptive_avg_pool3d": "avg",
    "adaptive_max_pool3d": "max",
    "_adaptive_max_pool3d": "max",
    "adaptive_max_pool3d_with_indices": "max",
    "mean": "avg",
    "sum": "sum",
    "amax": "max",
}


@dataclass(frozen=True)
class Site:
    """A global spatial reduction call: ``kind`` avg/sum/max, whether it keeps the dims,
    and whether the map is channels-last (``(N, *spatial, C)``) rather than ``(N, C, *spatial)``."""

    kind: str
    keepdim: bool
    pool: bool  # F.adaptive_*_pool2d/3d (True) or a tensor reduction (False)
    channels_last: bool = False

    def spatial_dims(self, rank: int) -> tuple[int, ...]:
        """The dims of a ``rank``-D input this reduction runs over (the spatial dims)."""
        return tuple(range(1, rank - 1)) if self.channels_last else tuple(range(2, rank))


@dataclass(frozen=True)
class Resample:
    """A pad (``op="pad"``) or interpolation (``op="interpolate"``) of a 4-D map or 5-D volume.

    ``options`` holds the call's arguments but the input, by keyword, so that
    :func:`source_coords` can ask PyTorch where each output pixel reads.
    """

    op: str
    options: tuple[tuple[str, Any], ...]

    @property
    def linear(self) -> bool:
        """Whether an output pixel mixes two inputs per axis (bilinear, trilinear)."""
        return dict(self.options).get("mode") in ("linear", "bilinear", "trilinear")

    @property
    def value(self) -> float:
        """The fill of a pad (0 for interpolation)."""
        return float(dict(self.options).get("value") or 0.0)


#: The torch.nn layer each windowed function computes, and the names of its arguments
#: after the input (a convolution's kernel size and channels come from its weight).
#: 2-D maps only, the forms tested exact (their 1-D and 3-D forms are still refused).
_LAYERS: dict[str, tuple[type[nn.Module], tuple[str, ...]]] = {
    "conv2d": (nn.Conv2d, ("weight", "bias", "stride", "padding", "dilation", "groups")),
    "max_pool2d": (
        nn.MaxPool2d,
        ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"),
    ),
    "avg_pool2d": (
        nn.AvgPool2d,
        ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"),
    ),
}


@dataclass(frozen=True)
class Windowed:
    """A convolution or pool called as a function: ``func`` (``conv2d``, ``avg_pool2d``, ...)
    with ``options``, the arguments of the ``torch.nn`` layer that computes it.

    A convolution's weight and bias are not kept: :meth:`tensors` reads them from each call.
    """

    func: str
    options: tuple[tuple[str, Any], ...]

    @property
    def conv(self) -> bool:
        return self.func.startswith("conv")

    def layer(self) -> nn.Module:
        """The ``torch.nn`` layer of the same arguments, on the meta device (a convolution's
        weight there is a placeholder of the call's shape)."""
        layer, _ = _LAYERS[self.func]
        opts = dict(self.options)
        if self.conv:
            return layer(**opts, bias=False, device="meta")
        return layer(**opts)

    def tensors(
        self, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The weight and bias of a convolution call (None, None for a pool)."""
        if not self.conv:
            return None, None
        bound = _bound(("weight", "bias"), args, kwargs)
        return bound.get("weight"), bound.get("bias")


def _windowed_of(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Windowed | None:
    _, names = _LAYERS[name]
    opts = _bound(names, args, kwargs)
    if opts.pop("return_indices", False):
        return None  # the watch refuses its ATen op (max_pool2d_with_indices)
    if name.startswith("conv"):
        weight = opts.pop("weight", None)
        opts.pop("bias", None)
        if not isinstance(weight, torch.Tensor):
            return None
        groups = int(opts.get("groups", 1))
        opts.update(
            in_channels=int(weight.shape[1]) * groups,
            out_channels=int(weight.shape[0]),
            kernel_size=tuple(int(v) for v in weight.shape[2:]),
        )
    return Windowed(name, tuple(sorted(opts.items())))


_INTERPOLATE = (
    "size",
    "scale_factor",
    "mode",
    "align_corners",
    "recompute_scale_factor",
    "antialias",
)
#: Pads with a tiled form: each output pixel reads one input pixel (or none), near the border.
_PAD_MODES = ("constant", "reflect", "replicate")
#: Modes whose output pixel reads at most two inputs per axis; bicubic and area are refused.
_MODES = ("nearest", "nearest-exact", "linear", "bilinear", "trilinear")


def _bound(names: Sequence[str], args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    return {**dict(zip(names, args[1:], strict=False)), **kwargs}


def _resample_of(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], nd: int
) -> Resample | None:
    if name == "pad":
        opts = _bound(("pad", "mode", "value"), args, kwargs)
        pad = tuple(int(p) for p in opts.get("pad", ()))
        mode = opts.get("mode", "constant")
        if mode not in _PAD_MODES or len(pad) not in range(2, 2 * nd + 1, 2):
            return None  # circular, or pads of channels: the watch refuses
        if mode != "constant":
            if min(pad) < 0 or nd != 2:
                return None  # a reflecting crop, or of a signal or volume: the watch refuses
            return Resample("pad", (("mode", mode), ("pad", pad)))
        return Resample("pad", (("pad", pad), ("value", opts.get("value"))))
    opts = _bound(_INTERPOLATE, args, kwargs)
    if opts.get("mode", "nearest") not in _MODES or opts.get("antialias"):
        return None  # the watch refuses the ATen op it becomes
    opts.setdefault("mode", "nearest")
    return Resample("interpolate", tuple(sorted(opts.items())))


def site_of(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> Site | Resample | Windowed | None:
    """The :class:`Site` if ``func(*args, **kwargs)`` reduces a 4-D map (5-D volume) over all
    its spatial dims, the :class:`Resample` if it pads or interpolates one, the
    :class:`Windowed` if it convolves or pools one (batched), else None."""
    name = getattr(func, "__name__", "")
    kind = _KINDS.get(name)
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4, 5):
        return None
    rank = x.dim()
    if name in _LAYERS:
        return _windowed_of(name, args, kwargs) if rank == 4 else None
    if name in ("pad", "interpolate"):
        return _resample_of(name, args, kwargs, rank - 2)
    if kind is None:
        return None
    if name.startswith(("adaptive", "_adaptive")):
        if f"{rank - 2}d" not in name:
            return None  # a 2-D pool of a volume's slices (or the reverse): the watch judges it
        size = args[1] if len(args) > 1 else kwargs.get("output_size")
        returns_indices = kwargs.get("return_indices") or (len(args) > 2 and args[2] is True)
        ones = size == 1 or (isinstance(size, tuple | list) and all(v == 1 for v in size))
        if not ones or returns_indices or name.endswith("indices"):
            return None
        return Site(kind, True, True)
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or kwargs.get("dtype") is not None:
        return None  # a reduction over everything, or with a cast: the watch judges it
    dims = {dim % rank} if isinstance(dim, int) else {int(d) % rank for d in dim}
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    if dims == set(range(2, rank)):
        return Site(kind, keepdim, False)
    if rank in (4, 5) and dims == set(range(1, rank - 1)):
        # (N, *spatial, C) -- or (N, C, *spatial) reduced over channels and spatial dims,
        # which the watch tells apart (only the first is a site of a tile)
        return Site(kind, keepdim, False, channels_last=True)
    return None


def source_coords(
    res: Resample, n_in: Sequence[int], n_out: Sequence[int]
) -> tuple[list[float | None], ...]:
    """Per axis (height, width; or depth, height, width): the input coordinate each output
    index reads.

    ``None`` where the output lies in a pad. An integer coordinate reads one
    pixel; ``i + f`` reads ``i`` and ``i + 1`` with weights ``1 - f`` and ``f``
    (bilinear). Interpolation runs PyTorch's own 1-D form of the same call on an
    index ramp (``arange(n)`` in float64), so sizes, scale factors and
    ``align_corners`` follow PyTorch's rules exactly.
    """
    opts = dict(res.options)
    nd = len(n_in)
    if res.op == "pad":
        pad = tuple(opts["pad"]) + (0,) * (2 * nd)
        # F.pad lists the last dim first: axis a starts at pad[2 * (nd - 1 - a)].
        before = [pad[2 * (nd - 1 - a)] for a in range(nd)]
        if opts.get("mode", "constant") != "constant":
            # PyTorch's own reflection (replication) of an index ramp, one axis at a time
            return tuple(
                [
                    float(v)
                    for v in F.pad(
                        torch.arange(n, dtype=torch.float64).view(1, 1, -1),
                        (b, pad[2 * (nd - 1 - a) + 1]),
                        mode=opts["mode"],
                    ).view(-1)
                ]
                for a, (b, n) in enumerate(zip(before, n_in, strict=True))
            )
        return tuple(
            [float(r - b) if 0 <= r - b < n else None for r in range(m)]
            for b, n, m in zip(before, n_in, n_out, strict=True)
        )
    mode = "linear" if opts["mode"] in ("linear", "bilinear", "trilinear") else opts["mode"]
    coords: list[list[float | None]] = []
    for axis in range(nd):
        one: dict[str, Any] = {
            "mode": mode,
            "align_corners": opts.get("align_corners"),
            "recompute_scale_factor": opts.get("recompute_scale_factor"),
        }
        size, scale = opts.get("size"), opts.get("scale_factor")
        if scale is not None and not isinstance(scale, (int, float)):
            scale = scale[axis]
        if size is not None:
            one["size"] = size if isinstance(size, int) else size[axis]
        else:
            one["scale_factor"] = scale
        ramp = torch.arange(n_in[axis], dtype=torch.float64).view(1, 1, -1)
        out = F.interpolate(ramp, **one).view(-1)
        if out.numel() != n_out[axis]:
            raise RuntimeError(f"1-D interpolation gave {out.numel()} outputs, not {n_out[axis]}")
        coords.append([float(v) for v in out.tolist()])
    return tuple(coords)


class Frames:
    """Which module is running, and how many sites it called, from forward hooks.

    ``known(module)`` marks layers that have a spatial form: inside them
    nothing is counted (``inside`` > 0). ``on_enter``/``on_leave`` are called
    with (path, module, args[, output]) after the bookkeeping.
    """

    def __init__(
        self,
        model: nn.Module,
        known: Callable[[nn.Module], bool],
        *,
        on_enter: Callable[[str, nn.Module, tuple[Any, ...]], None] | None = None,
        on_leave: Callable[[str, nn.Module, tuple[Any, ...], Any], None] | None = None,
    ) -> None:
        self.stack: list[tuple[str, list[int]]] = []
        self.inside = 0
        self.known = known
        self._on_enter, self._on_leave = on_enter, on_leave
        self.handles: list[RemovableHandle] = []
        for path, module in model.named_modules():
            self.handles.append(
                module.register_forward_pre_hook(lambda m, a, path=path: self._enter(path, m, a))
            )
            # always_call: a forward that raises (a refusal at run time) still leaves its
            # frame, and SpatialFunctions its mode, or the next model would run inside them
            self.handles.append(
                module.register_forward_hook(
                    lambda m, a, o, path=path: self._leave(path, m, a, o), always_call=True
                )
            )

    @property
    def path(self) -> str:
        return self.stack[-1][0] if self.stack else ""

    def next_site(self) -> str:
        """The name of the site being called now (and count it)."""
        if not self.stack:
            return "#0"
        path, counter = self.stack[-1]
        counter[0] += 1
        return f"{path}#{counter[0] - 1}"

    def _enter(self, path: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        try:
            if self._on_enter is not None:
                self._on_enter(path, module, tuple(args))
        finally:  # also when on_enter refuses: the forward hook always runs, and pops the frame
            self.stack.append((path, [0]))
            if self.known(module):
                self.inside += 1

    def _leave(self, path: str, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        self.stack.pop()
        if self.known(module):
            self.inside -= 1
        if self._on_leave is not None:
            self._on_leave(path, module, tuple(args), out)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class SiteMode(TorchFunctionMode):
    """A function mode that names every site the same way, in traces and at run time.

    The counting rule lives here once (sites outside layers with a spatial
    form, named by :meth:`Frames.next_site`): the shape trace, the watch and
    the run-time replacement must agree on it call for call. Subclasses say
    what happens at a site in :meth:`at_site`; every other call runs as is.
    """

    def __init__(self, frames: Frames) -> None:
        super().__init__()
        self.frames = frames

    def at_site(
        self,
        func: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        site: Site | Resample | Windowed,
        name: str,
    ) -> Any:
        """What a site call does; default: run it."""
        return func(*args, **kwargs)

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.frames.inside == 0:
            site = site_of(func, args, kwargs)
            if site is not None:
                return self.at_site(func, args, kwargs, site, self.frames.next_site())
        return func(*args, **kwargs)


def site_op_name(site: Resample | Windowed | None) -> str:
    """``F.pad``, ``F.interpolate``, ``F.conv2d`` ... for messages (None: ``nothing``)."""
    if site is None:
        return "nothing"
    return f"F.{site.op}" if isinstance(site, Resample) else f"F.{site.func}"


#: Options a tile's call gives from its own shapes (the tile's size): the trace's are used.
_SHAPE_OPTIONS = frozenset({"size", "pad", "scale_factor"})


def _fixed_options(site: Resample | Windowed) -> dict[str, Any]:
    """A call's options that its input's shape does not set: the same on a tile as on the
    whole image when both are of one forward."""
    return {k: v for k, v in site.options if k not in _SHAPE_OPTIONS}


def _options_text(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in sorted(options.items())) or "no options"


class SpatialFunctions(SiteMode):
    """At run time: the tile sites of a spatialized model, replaced by their spatial form
    (``run(x, site, name, weight, bias)``: ``SpatialContext.run_site``; a convolution's
    weight and bias, None for other sites).

    Active while any module of the model runs (entered by the outermost
    module's pre-hook, left by its hook), so pipeline stages that call the
    model's layers one by one are covered too.
    """

    def __init__(
        self,
        model: nn.Module,
        known: Callable[[nn.Module], bool],
        sites: set[str],
        run: Callable[..., torch.Tensor],
        traced: Callable[[], Mapping[str, Resample | Windowed] | None] = lambda: None,
        checking: Callable[[], bool] = lambda: False,
    ) -> None:
        super().__init__(Frames(model, known, on_enter=self._entering, on_leave=self._left))
        self.sites, self.run, self.traced, self.checking = sites, run, traced, checking
        #: The tile sites called in this forward.
        self.called: set[str] = set()

    def _entering(self, path: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not self.frames.stack:
            self.__enter__()
            self.called = set()

    def _left(self, path: str, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if not self.frames.stack:
            self.__exit__(None, None, None)
            if self.checking() and sys.exc_info()[0] is None:  # (not while a refusal unwinds)
                self._check_all_called(module)

    def _check_all_called(self, module: nn.Module) -> None:
        """Refuse a forward whose tile skipped a pad, interpolation or windowed function that
        the whole image called, traced in the same modes and with the same arguments: a
        branch on a shape (``if u.shape != f.shape: u = F.interpolate(u, size=f.shape[2:])``,
        or a submodule called only then) that the tile's shapes take the other way left the
        map uninterpolated (0.30 off, silently). Checked when the whole forward is done."""
        traced = self.traced() or {}
        missed = [n for n in traced if n in self.sites and n not in self.called]
        if missed:
            op = site_op_name(traced[missed[0]])
            path = missed[0].rsplit("#", 1)[0]
            raise ConfigError(
                f"module {path or type(module).__name__!r}",
                f"skipped on its tile the {op} the whole image called (site {missed[0]}): "
                "a branch on a shape (if u.shape != f.shape) goes another way on a tile",
                f"call the {op} unconditionally (a pad by 0 changes nothing), or compute its "
                "arguments from the image's size",
            )

    def at_site(
        self,
        func: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        site: Site | Resample | Windowed,
        name: str,
    ) -> Any:
        traced = self.traced() if name in self.sites else None
        if traced is not None and isinstance(site, Resample | Windowed):  # (None: no size set)
            op, was = site_op_name(site), site_op_name(traced.get(name))
            if op != was:
                why = "a branch on a shape (if y.shape != skip.shape) goes another way on a tile"
                if was == "nothing" and not self.checking():
                    why += (
                        ", or the model's parts are called one by one in another mode than "
                        "the whole model had when the image size was set"
                    )
                raise ConfigError(
                    f"site {name}",
                    f"calls {op} on its tile where the whole image called {was}: {why}",
                    "make the calls unconditional (a pad by 0 changes nothing) or compute "
                    "their arguments from the image's size; call the model itself",
                )
            mine, theirs = _fixed_options(site), _fixed_options(traced[name])
            if mine != theirs:
                # The traced call's options run (size=skip.shape on a tile is the tile's):
                # a trace of another forward ran bilinear where the tile asked nearest.
                raise ConfigError(
                    f"site {name}",
                    f"calls {op} with {_options_text(mine)} where the whole image, traced for "
                    f"this forward, called it with {_options_text(theirs)}: the model's parts "
                    "called one by one after a forward in another mode, or a module's "
                    "setting changed since",
                    "call the model itself (each forward is traced in its own modes and "
                    "arguments), and keep a layer's settings fixed after apply_spatial",
                )
        if name in self.sites:
            self.called.add(name)
            x = args[0] if args else kwargs["input"]
            if isinstance(site, Windowed):
                return self.run(x, site, name, *site.tensors(args, kwargs))
            return self.run(x, site, name)
        return func(*args, **kwargs)
