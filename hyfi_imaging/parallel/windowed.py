"""Windowed layers (convolution, max- and average-pooling) on a tile, saving no extended copy.

Why one autograd Function per windowed op, and not ``halo_exchange`` followed
by ``F.conv2d``: autograd would then save the halo-extended input of every
convolution, while the layer before (a ReLU, a BatchNorm) already keeps the
tile itself -- the input is stored twice, and a rank keeps about 0.49 of one
process's activations on a 1x4 grid instead of 0.25. Here forward exchanges and
computes without recording; what is saved for backward is

* convolution: the tile it was given (usually the very storage the previous
  layer keeps, so it costs nothing) plus the small received halo strips;
* max-pooling: the same; the winning indices are recomputed in backward rather
  than stored (they are int64, half an activation for a 3x3/s2 pool);
* average-pooling: nothing (its backward needs shapes only).

Backward rebuilds the extended tile (a transient of one layer), computes the
input and parameter gradients with the ATen backward kernels
(``convolution_backward``, ``max_pool2d_with_indices_backward``,
``avg_pool2d_backward``), and sends halo gradients back to their owners
(:func:`~hyfi_imaging.parallel.halo.return_halo_grads`).

Under autocast (bf16 on CUDA) the inputs are cast the way ``F.conv2d`` would
cast them, once, and backward uses those casts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hyfi_imaging.parallel.halo import Neighbours, Strips, extend, rebuild, return_halo_grads

__all__ = ["Window", "avg_pool", "conv", "max_pool"]

_aten = torch.ops.aten


@dataclass(frozen=True)
class Window:
    """Where one windowed layer's tile sits: halo, extent read, valid part, fill, neighbours.

    ``halo`` is ``(top, bottom, left, right)`` to receive; ``need`` the rows and
    columns of the extended tile the windows read (a negative halo, i.e. a
    surplus, makes it shorter than the extended tile); ``valid`` the leading
    rows and columns of the tile inside the image (the rest is set to ``fill``).
    """

    halo: tuple[int, int, int, int]
    need: tuple[int, int]
    valid: tuple[int, int]
    fill: float
    neighbours: Neighbours
    kernel: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]

    def extended_shape(self, tile: torch.Size) -> tuple[int, ...]:
        t, b, lft, r = self.halo
        return (*tile[:-2], tile[-2] + t + b, tile[-1] + lft + r)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _extend(x: torch.Tensor, win: Window) -> tuple[torch.Tensor, Strips]:
    ext, strips = extend(x, win.halo, win.neighbours, fill=win.fill, valid=win.valid)
    return ext[..., : win.need[0], : win.need[1]], strips


def _rebuild(x: torch.Tensor, strips: Strips, win: Window) -> torch.Tensor:
    ext = rebuild(x, strips, win.halo, fill=win.fill, valid=win.valid)
    return ext[..., : win.need[0], : win.need[1]]


def _tile_grad(g_need: torch.Tensor, tile: torch.Size, win: Window) -> torch.Tensor:
    """Gradient of the tile from that of the read part of the extended tile."""
    full = win.extended_shape(tile)
    pad = (0, full[-1] - g_need.shape[-1], 0, full[-2] - g_need.shape[-2])
    g_ext = F.pad(g_need, pad) if any(pad) else g_need
    return return_halo_grads(g_ext, win.halo, win.neighbours, valid=win.valid)


def _save_strips(ctx: Any, x: torch.Tensor, strips: Strips, *params: torch.Tensor | None) -> None:
    ctx.has = tuple(s is not None for s in strips)
    ctx.n_params = len(params)
    ctx.save_for_backward(x, *params, *(s for s in strips if s is not None))


def _load_strips(ctx: Any) -> tuple[torch.Tensor, tuple[Any, ...], Strips]:
    x, *rest = ctx.saved_tensors
    params, found = rest[: ctx.n_params], iter(rest[ctx.n_params :])
    return x, tuple(params), tuple(next(found) if h else None for h in ctx.has)


class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        win: Window,
        groups: int,
    ) -> torch.Tensor:
        dtype = _autocast_dtype(x)
        ctx.dtypes = (x.dtype, weight.dtype)
        if dtype is not None:
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            xe, strips = _extend(x, win)
            y = F.conv2d(xe, weight, bias, win.stride, 0, win.dilation, groups)
        _save_strips(ctx, x, strips, weight)
        ctx.win, ctx.groups, ctx.has_bias = win, groups, bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, (weight,), strips = _load_strips(ctx)
        win: Window = ctx.win
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        xe = _rebuild(x, strips, win)
        gi, gw, gb = _aten.convolution_backward(
            gy.to(xe.dtype),
            xe,
            weight,
            [weight.shape[0]] if ctx.has_bias else None,
            list(win.stride),
            [0, 0],
            list(win.dilation),
            False,
            [0, 0],
            ctx.groups,
            [bool(need_x), bool(need_w), bool(need_b and ctx.has_bias)],
        )
        x_dtype, w_dtype = ctx.dtypes
        gx = _tile_grad(gi, x.shape, win).to(x_dtype) if need_x else None
        return (
            gx,
            gw.to(w_dtype) if need_w else None,
            gb.to(w_dtype) if need_b and ctx.has_bias else None,
            None,
            None,
        )


class _MaxPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, win: Window) -> torch.Tensor:
        xe, strips = _extend(x, win)
        y = F.max_pool2d(xe, win.kernel, win.stride, 0, win.dilation)
        _save_strips(ctx, x, strips)
        ctx.win = win
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, _, strips = _load_strips(ctx)
        win: Window = ctx.win
        xe = _rebuild(x, strips, win)
        # Recomputing the winners costs one pooling pass; storing them would cost int64 per output.
        idx = _aten.max_pool2d_with_indices(xe, win.kernel, win.stride, [0, 0], win.dilation)[1]
        gi = _aten.max_pool2d_with_indices_backward(
            gy, xe, win.kernel, win.stride, [0, 0], win.dilation, False, idx
        )
        return _tile_grad(gi, x.shape, win), None


def _window_counts(
    win: Window, origin: tuple[int, int], size: tuple[int, int], device: Any
) -> torch.Tensor:
    """Per output pixel, how many window pixels lie inside the image (global padding excluded).

    ``origin`` is the global index of the first read row/column (negative at
    the top/left border), ``size`` the true input size: pure geometry, no message.
    """
    counts = []
    for a in (0, 1):
        idx = torch.arange(win.need[a], device=device) + origin[a]
        inside = ((idx >= 0) & (idx < size[a])).to(torch.float64)
        span = win.dilation[a] * (win.kernel[a] - 1) + 1
        counts.append(inside.unfold(0, span, win.stride[a])[:, :: win.dilation[a]].sum(-1))
    return counts[0].view(-1, 1) * counts[1].view(1, -1)


class _AvgPool(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, win: Window, divisor: torch.Tensor | int | None
    ) -> torch.Tensor:
        xe, _ = _extend(x, win)
        if isinstance(divisor, torch.Tensor):
            y = F.avg_pool2d(xe, win.kernel, win.stride, 0, False, True, 1) / divisor.to(xe.dtype)
        else:
            y = F.avg_pool2d(xe, win.kernel, win.stride, 0, False, True, divisor)
        ctx.win, ctx.divisor, ctx.tile, ctx.need_shape = win, divisor, x.shape, xe.shape
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        win: Window = ctx.win
        divisor = ctx.divisor
        shape_of = gy.new_empty(ctx.need_shape)  # the kernel reads only its shape
        if isinstance(divisor, torch.Tensor):
            gy, divisor = gy / divisor.to(gy.dtype), 1
        gi = _aten.avg_pool2d_backward(
            gy, shape_of, win.kernel, win.stride, [0, 0], False, True, divisor
        )
        return _tile_grad(gi, ctx.tile, win), None, None


def conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, win: Window, groups: int
) -> torch.Tensor:
    """Convolution of a tile with its halo (padding 0: the halo and fill are the padding)."""
    return _Conv.apply(x, weight, bias, win, groups)


def max_pool(x: torch.Tensor, win: Window) -> torch.Tensor:
    """Max-pooling of a tile; outside the image is ``win.fill`` (-inf)."""
    return _MaxPool.apply(x, win)


def avg_pool(
    x: torch.Tensor,
    win: Window,
    *,
    divisor_override: int | None,
    exclude_padding_at: tuple[tuple[int, int], tuple[int, int]] | None,
) -> torch.Tensor:
    """Average-pooling of a tile.

    ``exclude_padding_at = (origin, size)`` divides each window by the number
    of its pixels inside the image (``count_include_pad=False``), with
    ``origin`` the global index of the first read row/column and ``size`` the
    true input size; otherwise by ``divisor_override`` or the window size.
    """
    divisor: torch.Tensor | int | None = divisor_override
    if exclude_padding_at is not None:
        divisor = _window_counts(win, *exclude_padding_at, x.device)
    return _AvgPool.apply(x, win, divisor)
