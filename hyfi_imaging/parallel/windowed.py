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

from collections.abc import Callable
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
    #: Compute while the halos are in flight (convolutions): the outputs that read the
    #: tile only in forward, the weight gradient in backward.
    overlap: bool = False

    def extended_shape(self, tile: torch.Size) -> tuple[int, ...]:
        t, b, lft, r = self.halo
        return (*tile[:-2], tile[-2] + t + b, tile[-1] + lft + r)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _extend(
    x: torch.Tensor, win: Window, overlap: Callable[[torch.Tensor], None] | None = None
) -> tuple[torch.Tensor, Strips]:
    ext, strips = extend(
        x, win.halo, win.neighbours, fill=win.fill, valid=win.valid, overlap=overlap
    )
    return ext[..., : win.need[0], : win.need[1]], strips


def _outputs(win: Window, tile: torch.Size) -> tuple[tuple[int, int, int], ...]:
    """Per axis: the output count, and the first and end output that read the tile only."""
    axes = []
    for a in (0, 1):
        before, n = win.halo[2 * a], tile[-2 + a]
        extent = win.dilation[a] * (win.kernel[a] - 1) + 1
        m = (win.need[a] - extent) // win.stride[a] + 1
        first = min(m, -(-before // win.stride[a]))
        end = max(first, min(m, (before + n - extent) // win.stride[a] + 1))
        axes.append((m, first, end))
    return tuple(axes)


def _conv_overlapped(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, win: Window, groups: int
) -> tuple[torch.Tensor, Strips]:
    """The convolution computed while the halos are in flight, then its border redone.

    Output ``o`` reads extended rows ``[o*s, o*s + extent)``. While the halos
    travel, the whole convolution runs on the extended tile whose halos are not
    there yet: the outputs that read the tile's own rows and columns (and the
    fill past the grid's edges) are right, those that read a neighbour's halo
    are not. Once the halos have arrived, those border bands alone are computed
    again and written over. No interior
    copy, and the extra work is the border (a few rows and columns per tile).
    """
    (mh, h0, h1), (mw, w0, w1) = _outputs(win, x.shape)
    (sh, sw), (eh, ew) = (
        win.stride,
        (
            win.dilation[0] * (win.kernel[0] - 1) + 1,
            win.dilation[1] * (win.kernel[1] - 1) + 1,
        ),
    )
    out: list[torch.Tensor] = []

    def whole(ext: torch.Tensor) -> None:
        need = ext[..., : win.need[0], : win.need[1]]
        out.append(F.conv2d(need, weight, bias, win.stride, 0, win.dilation, groups))

    xe, strips = _extend(x, win, overlap=whole)
    y = out[0]
    nb = win.neighbours
    bands = (
        (nb.up, 0, h0, 0, mw),
        (nb.down, h1, mh, 0, mw),
        (nb.left, h0 if nb.up is not None else 0, h1 if nb.down is not None else mh, 0, w0),
        (nb.right, h0 if nb.up is not None else 0, h1 if nb.down is not None else mh, w1, mw),
    )
    for peer, r0, r1, c0, c1 in bands:  # the sides whose halo came from a neighbour
        if peer is not None and r1 > r0 and c1 > c0:
            part = xe[..., r0 * sh : (r1 - 1) * sh + eh, c0 * sw : (c1 - 1) * sw + ew]
            y[..., r0:r1, c0:c1] = F.conv2d(part, weight, bias, win.stride, 0, win.dilation, groups)
    return y, strips


def _rebuild(x: torch.Tensor, strips: Strips, win: Window) -> torch.Tensor:
    ext = rebuild(x, strips, win.halo, fill=win.fill, valid=win.valid)
    return ext[..., : win.need[0], : win.need[1]]


def _tile_grad(
    g_need: torch.Tensor,
    tile: torch.Size,
    win: Window,
    overlap: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Gradient of the tile from that of the read part of the extended tile."""
    full = win.extended_shape(tile)
    pad = (0, full[-1] - g_need.shape[-1], 0, full[-2] - g_need.shape[-2])
    g_ext = F.pad(g_need, pad) if any(pad) else g_need
    return return_halo_grads(g_ext, win.halo, win.neighbours, valid=win.valid, overlap=overlap)


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
            if win.overlap:
                y, strips = _conv_overlapped(x, weight, bias, win, groups)
            else:
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
        gy = gy.to(xe.dtype)

        def grads(x_: bool, w_: bool, b_: bool) -> tuple[Any, ...]:
            return _aten.convolution_backward(
                gy, xe, weight, [weight.shape[0]] if ctx.has_bias else None, list(win.stride),
                [0, 0], list(win.dilation), False, [0, 0], ctx.groups, [x_, w_, b_],
            )  # fmt: skip

        need_w, need_b = bool(need_w), bool(need_b and ctx.has_bias)
        held: list[Any] = [None, None, None]
        gx: torch.Tensor | None = None
        if win.overlap and need_x:
            # The halo gradients travel to their owners while the weight gradient is computed
            # (the overlap always runs: at the end when no message is sent).
            def weight_grads() -> None:
                held[:] = grads(False, need_w, need_b)

            gx = _tile_grad(grads(True, False, False)[0], x.shape, win, overlap=weight_grads)
        else:
            held[:] = grads(bool(need_x), need_w, need_b)
            gx = _tile_grad(held[0], x.shape, win) if need_x else None
        x_dtype, w_dtype = ctx.dtypes
        gw, gb = held[1], held[2]
        return (
            gx.to(x_dtype) if gx is not None else None,
            gw.to(w_dtype) if need_w else None,
            gb.to(w_dtype) if need_b else None,
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
