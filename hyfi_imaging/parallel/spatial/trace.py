"""The shape trace: every spatial layer's true input and output size, on the meta device.

Why: which rows of a tile lie outside the image at a layer depends on the chain
of kernels and paddings before it; one pass of the unmodified model records it,
so no arithmetic is duplicated.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.functional import Frames, Resample, Site, SiteMode, Windowed
from hyfi_imaging.parallel.spatial.flatten import _is_gathering_flatten
from hyfi_imaging.parallel.spatial.global_context import is_global_context
from hyfi_imaging.parallel.spatial.kinds import _SWAP, _has_spatial_form, _is_global_pool

__all__ = ["TraceMode", "split_image", "trace_mode"]


@dataclass(frozen=True)
class TraceMode:
    """How a forward runs, for the shape trace: the modules in training (``training``, by
    path; the layers with a spatial form are traced in eval mode whatever theirs) and the
    forward's arguments after the image (tensors as meta tensors of their shape).

    Why: a call the model makes only in training, or only for some argument, is a call
    the whole image makes in that forward alone; a tile's forward is compared with the
    trace of its own mode (a shape branch that goes another way on a tile is then seen).
    ``key`` identifies the mode (argument values by value, tensors by shape and dtype).
    """

    training: frozenset[str] = frozenset()
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    batch: int = 1
    key: tuple[Any, ...] = (frozenset(), (), ())


def trace_mode(
    model: nn.Module,
    known: Callable[[nn.Module], bool],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    batch: int = 1,
    sizes: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> TraceMode:
    """The :class:`TraceMode` of a forward of ``model`` with these arguments after the
    image (``known(module)``: the module has a spatial form, its mode is not traced).
    ``sizes``: (tile, image): a tensor argument whose last dims are the tile's (a mask cut
    like the image) is traced at the image's size."""
    if model not in _UNKNOWN:  # named_modules and the kind test cost ~1 ms a forward
        _UNKNOWN[model] = [(n, m) for n, m in model.named_modules() if not known(m)]
    training = frozenset(n for n, m in _UNKNOWN[model] if m.training)
    items = tuple(sorted((kwargs or {}).items()))
    key = (training, _arg_key(tuple(args)), _arg_key(items))
    has_tensors = any(isinstance(t, torch.Tensor) for t in tree_flatten((args, items))[0])
    return TraceMode(
        training,
        _meta(tuple(args), sizes),
        _meta(items, sizes),
        batch if has_tensors else 1,
        key,
    )


#: Per model, its modules without a spatial form (whose modes a trace follows).
_UNKNOWN: weakref.WeakKeyDictionary[nn.Module, list[tuple[str, nn.Module]]] = (
    weakref.WeakKeyDictionary()
)


def split_image(
    args: Sequence[Any], kwargs: dict[str, Any], nd: int
) -> tuple[torch.Tensor | None, tuple[Any, ...], dict[str, Any]]:
    """A forward's image (its first argument, or the first ``(N, C, *spatial)`` tensor
    given by keyword: ``model(x=tile)``) and its other arguments; None where it has none."""
    rest = dict(kwargs)
    if args:
        x: Any = args[0]
        others = tuple(args[1:])
    else:
        name = next(
            (k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() == nd + 2),
            None,
        )
        x, others = (None if name is None else rest.pop(name)), ()
    if not isinstance(x, torch.Tensor) or x.dim() != nd + 2:
        return None, others, rest
    return x, others, rest


def _arg_key(v: Any) -> Any:
    """A forward argument as part of a :class:`TraceMode`'s key: tensors by shape and dtype,
    numbers, strings, enums and None by value, containers item by item, other objects by
    their type (the path such an object chooses is taken to be its type's)."""
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype)
    if v is None or isinstance(v, bool | int | float | str | enum.Enum):
        return (type(v).__name__, v)
    if isinstance(v, tuple | list):
        return (type(v).__name__, tuple(_arg_key(u) for u in v))
    if isinstance(v, dict):
        return ("dict", tuple((str(k), _arg_key(u)) for k, u in v.items()))
    return ("object", type(v).__qualname__)


def _meta(v: Any, sizes: tuple[tuple[int, ...], tuple[int, ...]] | None) -> Any:
    """``v`` with every tensor replaced by an empty meta tensor of its shape and dtype (of
    the image's size where its last dims are the tile's: ``sizes`` is (tile, image))."""
    if isinstance(v, torch.Tensor):
        shape = tuple(v.shape)
        if sizes is not None and len(shape) >= len(sizes[0]):
            tile, image = sizes
            if shape[len(shape) - len(tile) :] == tile:
                shape = shape[: len(shape) - len(tile)] + image
        return torch.empty(shape, dtype=v.dtype, device="meta")
    if isinstance(v, tuple | list):
        return type(v)(_meta(u, sizes) for u in v)
    if isinstance(v, dict):
        return {k: _meta(u, sizes) for k, u in v.items()}
    return v


def _run_meta(model: nn.Module, shape: tuple[int, ...], mode: TraceMode | None = None) -> None:
    """One forward pass on the meta device: no memory, no compute, only shapes.

    In the parameters' dtype (a float64 model refuses float32 input) and in eval
    mode (BatchNorm with ``momentum=None`` reads its step counter in training), or
    in ``mode`` (its modules in training, its arguments after the image).
    """
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    modes = {m: m.training for m in model.modules()}
    mode = mode or TraceMode()
    for name, m in model.named_modules():
        m.training = name in mode.training
    try:
        with torch.no_grad(), torch.device("meta"):
            image = torch.empty((mode.batch, *shape[1:]), device="meta", dtype=dtype)
            model(image, *mode.args, **dict(mode.kwargs))
    finally:
        for m, training in modes.items():
            m.training = training


def _trace_sizes(
    model: nn.Module, shape: tuple[int, ...], mode: TraceMode | None = None
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], dict[str, Resample | Windowed]]:
    """Input and output (h, w) -- (d, h, w) for volumes -- of every spatial module and
    functional site, and the pads, interpolations and windowed functions as called on the
    whole image, from one pass on the meta device (``shape`` is ``(1, C, *image_size)``),
    in eval mode or in ``mode``."""
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
        if (
            isinstance(mod, tuple(_SWAP))
            or _is_global_pool(mod)
            or _is_gathering_flatten(mod)
            or is_global_context(mod)
        ):
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
            _run_meta(model, shape, mode)
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
