"""The shape trace: every spatial layer's true input and output size, on the meta device.

Why: which rows of a tile lie outside the image at a layer depends on the chain
of kernels and paddings before it; one pass of the unmodified model records it,
so no arithmetic is duplicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.functional import Frames, Resample, Site, SiteMode, Windowed
from hyfi_imaging.parallel.spatial.flatten import _is_gathering_flatten
from hyfi_imaging.parallel.spatial.global_context import is_global_context
from hyfi_imaging.parallel.spatial.kinds import _SWAP, _has_spatial_form, _is_global_pool

__all__: list[str] = []


def _run_meta(model: nn.Module, shape: tuple[int, ...]) -> None:
    """One forward pass on the meta device: no memory, no compute, only shapes.

    In the parameters' dtype (a float64 model refuses float32 input) and in eval
    mode (BatchNorm with ``momentum=None`` reads its step counter in training).
    """
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.device("meta"):
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
