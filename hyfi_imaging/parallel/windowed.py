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

Everything here walks the spatial dims of the :class:`Window` (two for a slide's
tile, three for a volume's sub-volume); the 2-D or 3-D kernel is picked by that
count (:data:`_OPS`), so there is one implementation of each layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hyfi_imaging.parallel.first_order import first_order
from hyfi_imaging.parallel.halo import (
    Neighbours,
    Strips,
    add_to_parts,
    exchange_strips,
    extend,
    fill_tail,
    new_like,
    rebuild,
    return_halo_grads,
    return_strip_grads,
    strip_box,
    trailing,
    window_of,
)

__all__ = [
    "BACKWARD_BANDS",
    "MIN_BAND_ROWS",
    "Window",
    "avg_pool",
    "backward_band",
    "conv",
    "max_pool",
]

_aten = torch.ops.aten


@dataclass(frozen=True)
class _Ops:
    """The kernels of one number of spatial dims."""

    conv: Callable[..., torch.Tensor]
    max_pool: Callable[..., torch.Tensor]
    max_pool_indices: Any
    max_pool_backward: Any
    avg_pool: Callable[..., torch.Tensor]
    avg_pool_backward: Any


def _one_row(fn: Any, *, tensors: int, dilated: bool) -> Callable[..., Any]:
    """The 1-D form of a 2-D pooling kernel: the signal is a map of one row.

    ATen has no 1-D pooling backward (nor a 1-D ``divisor_override``); the 2-D
    kernels on ``(N, C, 1, L)`` with ``1 x k`` windows compute the same numbers.
    The first ``tensors`` arguments get the row (``unsqueeze(-2)``); kernel,
    stride, padding and, when ``dilated``, dilation (one entry each) get the
    row's 1, 1, 0, 1 in front; the rest pass as they are (a max-pool's winners
    stay 2-D, from its forward kernel to its backward one).
    """

    def run(*args: Any) -> Any:
        rows = [t.unsqueeze(-2) for t in args[:tensors]]
        n = 4 if dilated else 3
        k, s, p, *d = (_one(v) for v in args[tensors : tensors + n])
        geometry = [[1, *k], [1, *s], [0, *p], *([[1, *d[0]]] if dilated else [])]
        out = fn(*rows, *geometry, *args[tensors + n :])
        if isinstance(out, tuple):
            return out[0].squeeze(-2), out[1]
        return out.squeeze(-2)

    return run


def _one(v: Any) -> list[int]:
    return [int(v)] if isinstance(v, int) else [int(x) for x in v]


_OPS = {
    1: _Ops(
        F.conv1d, F.max_pool1d,
        _one_row(_aten.max_pool2d_with_indices, tensors=1, dilated=True),
        _one_row(_aten.max_pool2d_with_indices_backward, tensors=2, dilated=True),
        _one_row(_aten.avg_pool2d, tensors=1, dilated=False),
        _one_row(_aten.avg_pool2d_backward, tensors=2, dilated=False),
    ),
    2: _Ops(
        F.conv2d, F.max_pool2d, _aten.max_pool2d_with_indices,
        _aten.max_pool2d_with_indices_backward, F.avg_pool2d, _aten.avg_pool2d_backward,
    ),
    3: _Ops(
        F.conv3d, F.max_pool3d, _aten.max_pool3d_with_indices,
        _aten.max_pool3d_with_indices_backward, F.avg_pool3d, _aten.avg_pool3d_backward,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Window:
    """Where one windowed layer's tile sits: halo, extent read, valid part, fill, neighbours.

    ``halo`` is ``(before, after)`` per spatial dim to receive, e.g. ``(top,
    bottom, left, right)``; ``need`` the length of the extended tile the windows
    read along each dim (a negative halo, i.e. a surplus, makes it shorter than
    the extended tile); ``valid`` the leading indices of the tile inside the
    image along each dim (the rest is set to ``fill``). ``kernel``, ``stride``,
    ``dilation``: one value per spatial dim (1, 2 or 3 of them).
    """

    halo: tuple[int, ...]
    need: tuple[int, ...]
    valid: tuple[int, ...]
    fill: float
    neighbours: Neighbours
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    #: Compute while the halos are in flight (convolutions): the outputs that read the
    #: tile only in forward, the weight gradient in backward.
    overlap: bool = False
    #: Backward in bands of output rows (a memory tool: band-sized transients, more
    #: kernel calls); else one piece on the tile itself.
    bands: bool = False

    @property
    def dims(self) -> int:
        """Number of spatial dims."""
        return len(self.kernel)

    @property
    def ops(self) -> _Ops:
        """The 1-D, 2-D or 3-D kernels."""
        return _OPS[self.dims]

    def extended_shape(self, tile: torch.Size) -> tuple[int, ...]:
        nd = self.dims
        ext = (t + self.halo[2 * k] + self.halo[2 * k + 1] for k, t in enumerate(tile[-nd:]))
        return (*tile[:-nd], *ext)

    def read(self, ext: torch.Tensor) -> torch.Tensor:
        """The part of the extended tile the windows read (``need`` along each spatial dim)."""
        return ext[trailing([slice(0, n) for n in self.need])]


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _extend(
    x: torch.Tensor, win: Window, overlap: Callable[[torch.Tensor], None] | None = None
) -> tuple[torch.Tensor, Strips]:
    ext, strips = extend(
        x, win.halo, win.neighbours, fill=win.fill, valid=win.valid, overlap=overlap
    )
    return win.read(ext), strips


def _outputs(win: Window, tile: torch.Size) -> tuple[tuple[int, int, int], ...]:
    """Per axis: the output count, and the first and end output that read the tile only."""
    axes = []
    for a in range(win.dims):
        before, n = win.halo[2 * a], tile[a - win.dims]
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
    again and written over: per spatial dim, the band before and after the
    outputs that read the tile only, within the interior of the dims already
    done (so that no output is computed twice). No interior copy, and the extra
    work is the border (a few rows and columns per tile).
    """
    conv = win.ops.conv
    out: list[torch.Tensor] = []

    def whole(ext: torch.Tensor) -> None:
        out.append(conv(win.read(ext), weight, bias, win.stride, 0, win.dilation, groups))

    xe, strips = _extend(x, win, overlap=whole)
    y = out[0]
    # The sides past the grid's edge are fill, known before the overlap ran.
    for band in _border_bands(win, x.shape):
        part = xe[trailing(_reads(win, band))]
        _write(y, _band_index(band), conv(part, weight, bias, win.stride, 0, win.dilation, groups))
    return y, strips


def direct_padding(win: Window, tile: torch.Size) -> tuple[int, ...] | None:
    """The padding with which the layer on the tile alone puts every output where the
    extended tile would (None: it cannot, the extended path runs).

    With padding ``p = before`` along a dim, output ``o`` reads tile positions
    ``[o s - before, o s - before + extent)``, exactly what it reads in the
    extended tile; the output count must be the extended tile's too.
    """
    pads = []
    border = 0.0
    for a, (c0, c1, m) in enumerate(_clean(win, tile)):
        before, n = win.halo[2 * a], int(tile[a - win.dims])
        extent = win.dilation[a] * (win.kernel[a] - 1) + 1
        if (n + 2 * before - extent) // win.stride[a] + 1 != m:
            return None
        pads.append(before)
        border += (c0 + m - c1) / max(m, 1)
    # The border bands are computed twice (and run one more small backward each): where
    # they are a large share of a small tile, copying the tile into an extended one is
    # cheaper than the repeated work and the kernels' per-call costs.
    return tuple(pads) if border <= MAX_BORDER_SHARE else None


def _clean(win: Window, tile: torch.Size) -> list[tuple[int, int, int]]:
    """Per spatial dim ``(c0, c1, m)``: the outputs ``[c0, c1)`` read no neighbour's strip
    (``m`` outputs in all; ``c0 <= c1``).

    An output reads the strip before the tile if its window starts before the tile,
    the strip after it if its window ends past the tile; on a tile narrower than the
    window, one output may read both, so the two ranges are taken separately (an
    output reading the strip after the tile is not clean because the side before
    has no neighbour).
    """
    out = []
    sides = win.neighbours.pairs()[-win.dims :]
    for a, ((lo, hi), (m, first, _)) in enumerate(zip(sides, _outputs(win, tile), strict=True)):
        before, n = win.halo[2 * a], int(tile[a - win.dims])
        extent = win.dilation[a] * (win.kernel[a] - 1) + 1
        # The first output whose window ends past the tile (reads the strip after it).
        last = min(m, max(0, (before + n - extent) // win.stride[a] + 1))
        c0 = first if lo is not None else 0
        c1 = last if hi is not None else m
        out.append((c0, max(c0, c1), m))
    return out


def _border_bands(win: Window, tile: torch.Size) -> list[list[tuple[int, int]]]:
    """Output ranges (per spatial dim) that the padded tile alone gets wrong.

    Those whose windows read a neighbour's halo (outside the grid the padding
    is the fill itself, and the tile past ``valid`` is masked by
    :func:`_base`). The ranges do not overlap: per dim, the bands before and
    after the clean outputs, within the clean range of the dims already done.
    """
    clean = _clean(win, tile)
    bands = []
    for k, (c0, c1, m) in enumerate(clean):
        for a, b in ((0, c0), (c1, m)):
            if b <= a:
                continue
            ranges = [
                (cd0, cd1) if d < k else (a, b) if d == k else (0, md)
                for d, (cd0, cd1, md) in enumerate(clean)
            ]
            if all(r1 > r0 for r0, r1 in ranges):
                bands.append(ranges)
    return bands


def _base(x: torch.Tensor, win: Window) -> torch.Tensor:
    """What the layer reads of its own tile: the tile, or on a tile that reaches past the
    image (the last along an axis) a copy with that tail set to ``fill``.

    Why a copy there: the tail holds whatever the layers before computed on padding
    (-inf after a max-pool, say), and a weight gradient multiplies it, so it cannot be
    corrected afterwards (inf - inf); the copy is paid on those tiles only.
    """
    tile = x.shape[x.dim() - win.dims :]
    if all(v >= n for v, n in zip(win.valid, tile, strict=True)):
        return x
    masked = x.clone()
    fill_tail(masked, win.valid, win.fill)
    return masked


def _band_index(band: list[tuple[int, int]]) -> tuple[Any, ...]:
    """The output band's index (``(..., *slices)``)."""
    return trailing([slice(o0, o1) for o0, o1 in band])


def _reads(win: Window, outputs: list[tuple[int, int]]) -> list[slice]:
    """Extended-tile positions the outputs ``[o0, o1)`` per dim read."""
    return [
        slice(o0 * s, (o1 - 1) * s + d * (k - 1) + 1)
        for (o0, o1), s, k, d in zip(outputs, win.stride, win.kernel, win.dilation, strict=True)
    ]


def _conv_direct(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    win: Window,
    groups: int,
    pad: tuple[int, ...],
) -> tuple[torch.Tensor, Strips]:
    """The convolution on the tile itself, its border bands redone from the strips.

    The tile, padded by the kernel with zeros, gives every output whose window
    lies in the tile (or in the fill past the grid's edge) without any copy of
    the tile (:func:`_base`: on a tile past the image, a masked copy); while the
    halos travel (``win.overlap``) or after. Then only the outputs that read a
    neighbour's strip are computed again, each band from a slab rebuilt from the
    tile's edge and the strips, and written over. Copies: the strips sent and
    the border slabs.
    """
    conv = win.ops.conv
    out: list[torch.Tensor] = []

    base = _base(x, win)

    def interior() -> None:
        out.append(conv(base, weight, bias, win.stride, pad, win.dilation, groups))

    strips = exchange_strips(
        x, win.halo, win.neighbours, fill=win.fill, valid=win.valid,
        overlap=interior if win.overlap else None,
    )  # fmt: skip
    if not out:
        interior()
    y = out[0]
    for band in _border_bands(win, x.shape):
        slab = window_of(x, strips, win.halo, _reads(win, band), fill=win.fill, valid=win.valid)
        _write(y, _band_index(band), conv(slab, weight, bias, win.stride, 0, win.dilation, groups))
    return y, strips


def _conv_grads_direct(
    ctx: Any, gy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, strips: Strips
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Backward of :func:`_conv_direct`: the tile's gradient written once, halo gradients
    from the border bands only.

    The padded tile's backward gives the input gradient of every tile position
    (a position's gradient does not depend on what the window read beside it)
    and the weight and bias gradients as if the strips were 0. Per border band,
    one more backward on the slab's *difference* (the strips minus the zeros
    the padded tile read) corrects the
    weight gradient and yields the gradients of the strips, which go back to
    their owners and are added into their borders. Overlapped, the weight
    gradient is computed while those travel.
    """
    win: Window = ctx.win
    pad: tuple[int, ...] = ctx.pad
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    need_x, need_w, need_b = bool(need_x), bool(need_w), bool(need_b and ctx.has_bias)
    zeros = [0] * win.dims
    bias_sizes = [weight.shape[0]] if ctx.has_bias else None
    tile = [int(v) for v in x.shape[x.dim() - win.dims :]]
    held: list[torch.Tensor | None] = [None, None, None]
    base = _base(x, win) if need_w else x  # the input gradient does not read it

    def padded(x_: bool, w_: bool, b_: bool) -> None:
        got = _aten.convolution_backward(
            gy, base, weight, bias_sizes, list(win.stride), list(pad), list(win.dilation),
            False, zeros, ctx.groups, [x_, w_, b_],
        )  # fmt: skip
        for k, wanted in enumerate((x_, w_, b_)):
            if wanted:
                held[k] = got[k] if held[k] is None else held[k].add_(got[k])  # type: ignore[union-attr]

    strip_grads = _strip_grads(win, x.shape, x)
    none: Strips = (None,) * len(strips)
    corrections: list[torch.Tensor] = []

    def bands(x_: bool, w_: bool) -> None:
        for band in _border_bands(win, x.shape):
            reads = _reads(win, band)
            slab = window_of(x, strips, win.halo, reads, fill=win.fill, valid=win.valid)
            slab.sub_(window_of(x, none, win.halo, reads, fill=win.fill, valid=win.valid))
            got = _aten.convolution_backward(
                gy[_band_index(band)].contiguous(), slab, weight,
                None, list(win.stride), zeros, list(win.dilation), False, zeros, ctx.groups,
                [x_, w_, False],
            )  # fmt: skip
            if x_:
                box = [(r.start, r.stop) for r in reads]
                add_to_parts(got[0], box, win.halo, tile, strip_grads)
            if w_:
                corrections.append(got[1])

    gx: torch.Tensor | None = None
    if need_x and win.overlap:
        padded(True, False, False)
        gx = held[0]
        assert gx is not None
        bands(True, False)

        def weights() -> None:
            padded(False, need_w, need_b)
            if need_w:
                bands(False, True)

        gx = return_strip_grads(
            gx, strip_grads, win.halo, win.neighbours, valid=win.valid,
            overlap=weights if need_w or need_b else None,
        )  # fmt: skip
    elif need_x:  # input, weight and bias gradients in one kernel call
        padded(True, need_w, need_b)
        gx = held[0]
        assert gx is not None
        bands(True, need_w)
        gx = return_strip_grads(gx, strip_grads, win.halo, win.neighbours, valid=win.valid)
    else:
        padded(False, need_w, need_b)
        if need_w:
            bands(False, True)
    gw = held[1]
    for c in corrections:
        gw = c if gw is None else gw.add_(c)
    return gx, gw, held[2]


def _write(y: torch.Tensor, index: tuple[Any, ...], part: torch.Tensor) -> None:
    """Write a border band into the output the layer is still computing.

    Through ``.data``: the band is part of computing ``y``, not a change of a value
    anyone has seen, and selective activation checkpointing, which may have kept the
    convolution's output as it came out of the kernel, refuses a kept tensor whose
    version changed. It sees the finished output (the same storage) on recompute,
    where the same bands are written again.
    """
    y.data[index] = part


def _rebuild(x: torch.Tensor, strips: Strips, win: Window) -> torch.Tensor:
    ext = rebuild(x, strips, win.halo, fill=win.fill, valid=win.valid)
    return win.read(ext)


def _tile_grad(
    g_need: torch.Tensor,
    tile: torch.Size,
    win: Window,
    overlap: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Gradient of the tile from that of the read part of the extended tile."""
    full = win.extended_shape(tile)
    pad = tuple(v for d in range(1, win.dims + 1) for v in (0, full[-d] - g_need.shape[-d]))
    g_ext = F.pad(g_need, pad) if any(pad) else g_need
    return return_halo_grads(g_ext, win.halo, win.neighbours, valid=win.valid, overlap=overlap)


#: Largest share of a tile's outputs (summed over its dims) that the direct path redoes from
#: the strips; above it the layer copies its tile into an extended one. Measured on one
#: 3x3 layer per ResNet-50 stage on 1x2 tiles (CPU time of forward + backward, direct vs
#: extended): 64 ch 192x96 47 vs 50 ms, 128 ch 96x48 39 vs 38, 256 ch 48x24 42 vs 34,
#: 512 ch 24x12 71 vs 48 (border shares 1/96 .. 1/12).
MAX_BORDER_SHARE = 1 / 32
#: A spatial convolution's backward runs over about this many bands of output rows
#: (along the first spatial dim) ...
BACKWARD_BANDS = 16
#: ... of at least this many rows each: a tile of fewer output rows runs in one piece.
MIN_BAND_ROWS = 8


def backward_band(rows: int) -> int:
    """Output rows per band of a spatial convolution's backward; ``rows`` when one band.

    Why bands: the backward kernels hold transients several times their input
    (a CPU convolution's backward reorders its input and output gradient; the
    whole extended tile would be rebuilt first). Per band, only a slab of the
    extended tile is rebuilt from the tile and the saved strips, and the
    kernels' transients are a band's: measured on a 16-channel 640^2 tile,
    the backward's peak above its inputs went from 123 to 53 MiB (16 bands),
    at the same CPU time. The one tile-sized tensor left is the extended
    gradient, which :func:`return_halo_grads` reduces in place.
    """
    return max(MIN_BAND_ROWS, -(-rows // BACKWARD_BANDS))


def _conv_grads_banded(
    ctx: Any, gy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, strips: Strips, rows: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Input (tile), weight and bias gradients of ``_Conv``, computed band by band.

    Band ``[o0, o1)`` of output rows reads extended rows ``[o0 s, (o1 - 1) s +
    extent)``; its input gradient is added into those rows of the extended
    gradient (bands overlap by ``extent - s`` rows), its weight and bias
    gradients into the totals. The output gradient's band is made contiguous
    first: oneDNN given a strided view of the whole gradient held a copy of all
    of it (measured: 25 MiB above a 1 MiB band). Overlapped (``win.overlap``),
    the input gradients come first and the weight and bias gradients are
    computed, band by band again, while the halo gradients travel.
    """
    win: Window = ctx.win
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    need_x, need_w, need_b = bool(need_x), bool(need_w), bool(need_b and ctx.has_bias)
    axis = gy.dim() - win.dims
    extent = win.dilation[0] * (win.kernel[0] - 1) + 1
    zeros = [0] * win.dims
    g_ext = new_like(gy, win.extended_shape(x.shape), zero=True) if need_x else None
    g_read = win.read(g_ext) if g_ext is not None else None
    held: list[torch.Tensor | None] = [None, None]  # weight and bias gradient totals

    def bands(x_: bool, w_: bool, b_: bool) -> None:
        for o0 in range(0, gy.shape[axis], rows):
            o1 = min(gy.shape[axis], o0 + rows)
            r0, r1 = o0 * win.stride[0], (o1 - 1) * win.stride[0] + extent
            box = [slice(r0, r1), *(slice(0, n) for n in win.need[1:])]
            slab = window_of(x, strips, win.halo, box, fill=win.fill, valid=win.valid)
            got = _aten.convolution_backward(
                gy.narrow(axis, o0, o1 - o0).contiguous(), slab, weight,
                [weight.shape[0]] if ctx.has_bias else None, list(win.stride), zeros,
                list(win.dilation), False, zeros, ctx.groups, [x_, w_, b_],
            )  # fmt: skip
            if x_ and g_read is not None:
                g_read.narrow(axis, r0, r1 - r0).add_(got[0])
            for k, wanted in ((0, w_), (1, b_)):
                if wanted:
                    total = held[k]
                    held[k] = got[k + 1] if total is None else total.add_(got[k + 1])
            del slab, got

    gx = None
    if g_ext is not None and win.overlap:
        bands(True, False, False)
        gx = return_halo_grads(
            g_ext, win.halo, win.neighbours, valid=win.valid,
            overlap=(lambda: bands(False, need_w, need_b)) if need_w or need_b else None,
        )  # fmt: skip
    else:
        bands(need_x, need_w, need_b)
        if g_ext is not None:
            gx = return_halo_grads(g_ext, win.halo, win.neighbours, valid=win.valid)
    return gx, held[0], held[1]


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
        pad = direct_padding(win, x.shape)
        with torch.autocast(x.device.type, enabled=False):
            if pad is not None:
                y, strips = _conv_direct(x, weight, bias, win, groups, pad)
            elif win.overlap:
                y, strips = _conv_overlapped(x, weight, bias, win, groups)
            else:
                xe, strips = _extend(x, win)
                y = win.ops.conv(xe, weight, bias, win.stride, 0, win.dilation, groups)
        _save_strips(ctx, x, strips, weight)
        ctx.win, ctx.groups, ctx.has_bias, ctx.pad = win, groups, bias is not None, pad
        return y

    @staticmethod
    @first_order("a spatial convolution")
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, (weight,), strips = _load_strips(ctx)
        win: Window = ctx.win
        gy = gy.to(x.dtype)
        rows = backward_band(gy.shape[gy.dim() - win.dims])
        if ctx.pad is not None and not win.bands:
            gx, gw, gb = _conv_grads_direct(ctx, gy, x, weight, strips)
        elif win.bands and rows < gy.shape[gy.dim() - win.dims]:
            gx, gw, gb = _conv_grads_banded(ctx, gy, x, weight, strips, rows)
        else:
            gx, gw, gb = _conv_grads_whole(ctx, gy, x, weight, strips)
        x_dtype, w_dtype = ctx.dtypes
        return (
            gx.to(x_dtype) if gx is not None else None,
            gw.to(w_dtype) if gw is not None else None,
            gb.to(w_dtype) if gb is not None else None,
            None,
            None,
        )


def _conv_grads_whole(
    ctx: Any, gy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, strips: Strips
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """As :func:`_conv_grads_banded`, in one piece on the rebuilt extended tile.

    Overlapped (``win.overlap``), the halo gradients travel to their owners while
    the weight gradient is computed.
    """
    win: Window = ctx.win
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    need_w, need_b = bool(need_w), bool(need_b and ctx.has_bias)
    xe = _rebuild(x, strips, win)
    zeros = [0] * win.dims

    def grads(x_: bool, w_: bool, b_: bool) -> tuple[Any, ...]:
        return _aten.convolution_backward(
            gy, xe, weight, [weight.shape[0]] if ctx.has_bias else None, list(win.stride),
            zeros, list(win.dilation), False, zeros, ctx.groups, [x_, w_, b_],
        )  # fmt: skip

    held: list[Any] = [None, None, None]
    gx: torch.Tensor | None = None
    if win.overlap and need_x:
        # The overlap always runs (at the end when no message is sent).
        def weight_grads() -> None:
            held[:] = grads(False, need_w, need_b)

        gx = _tile_grad(grads(True, False, False)[0], x.shape, win, overlap=weight_grads)
    else:
        held[:] = grads(bool(need_x), need_w, need_b)
        gx = _tile_grad(held[0], x.shape, win) if need_x else None
    return gx, held[1] if need_w else None, held[2] if need_b else None


def _pool_padding(win: Window, tile: torch.Size) -> tuple[int, ...] | None:
    """:func:`direct_padding` for a pool, whose padding PyTorch caps at half its window."""
    pad = direct_padding(win, tile)
    if pad is None:
        return None
    for p, k, d in zip(pad, win.kernel, win.dilation, strict=True):
        if 2 * p > d * (k - 1) + 1:
            return None
    return pad


def _strip_grads(win: Window, tile: torch.Size, like: torch.Tensor) -> list[torch.Tensor | None]:
    """Zeroed gradients of the strips this rank receives (None where none is received)."""
    sides = win.neighbours.pairs()[-win.dims :]
    lead = tuple(like.shape[: like.dim() - win.dims])
    size = [int(v) for v in tile[-win.dims :]]
    out: list[torch.Tensor | None] = []
    for j in range(2 * win.dims):
        if sides[j // 2][j % 2] is None or win.halo[j] == 0:
            out.append(None)
            continue
        box = strip_box(j // 2, j % 2, win.halo, size)
        shape = (*lead, *(b - a for a, b in box))
        out.append(torch.zeros(shape, dtype=like.dtype, device=like.device))
    return out


class _MaxPool(torch.autograd.Function):
    """Max-pooling; on the tile itself with its border bands redone (as :func:`_conv_direct`)
    where :func:`_pool_padding` allows, else on the extended tile."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, win: Window) -> torch.Tensor:
        pad = _pool_padding(win, x.shape)
        pool = win.ops.max_pool
        if pad is None:
            xe, strips = _extend(x, win)
            y = pool(xe, win.kernel, win.stride, 0, win.dilation)
        else:
            strips = exchange_strips(x, win.halo, win.neighbours, fill=win.fill, valid=win.valid)
            y = pool(_base(x, win), win.kernel, win.stride, pad, win.dilation)
            for band in _border_bands(win, x.shape):
                slab = window_of(
                    x, strips, win.halo, _reads(win, band), fill=win.fill, valid=win.valid
                )
                _write(y, _band_index(band), pool(slab, win.kernel, win.stride, 0, win.dilation))
        _save_strips(ctx, x, strips)
        ctx.win, ctx.pad = win, pad
        return y

    @staticmethod
    @first_order("a spatial max pool")
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, _, strips = _load_strips(ctx)
        win: Window = ctx.win
        ops = win.ops

        def grad(g: torch.Tensor, inp: torch.Tensor, pad: Any) -> torch.Tensor:
            # Recomputing the winners costs one pooling pass; storing them would cost int64
            # per output.
            idx = ops.max_pool_indices(inp, win.kernel, win.stride, pad, win.dilation)[1]
            return ops.max_pool_backward(
                g, inp, win.kernel, win.stride, pad, win.dilation, False, idx
            )

        zeros = [0] * win.dims
        if ctx.pad is None:
            return _tile_grad(grad(gy, _rebuild(x, strips, win), zeros), x.shape, win), None
        # Every output's gradient goes to its winner in the padded tile; for the border
        # outputs that is taken back and given to the true winner (in the tile or a strip).
        gx = grad(gy, _base(x, win), list(ctx.pad))
        strip_grads = _strip_grads(win, x.shape, gy)
        none: Strips = (None,) * len(strips)
        tile = [int(v) for v in x.shape[x.dim() - win.dims :]]
        for band in _border_bands(win, x.shape):
            reads = _reads(win, band)
            box = [(r.start, r.stop) for r in reads]
            g_band = gy[_band_index(band)]
            seen = window_of(x, none, win.halo, reads, fill=win.fill, valid=win.valid)
            add_to_parts(grad(g_band, seen, zeros).neg_(), box, win.halo, tile, [], gx)
            true = window_of(x, strips, win.halo, reads, fill=win.fill, valid=win.valid)
            add_to_parts(grad(g_band, true, zeros), box, win.halo, tile, strip_grads, gx)
        return return_strip_grads(gx, strip_grads, win.halo, win.neighbours, valid=win.valid), None


def _window_counts(
    win: Window, origin: tuple[int, ...], size: tuple[int, ...], device: Any
) -> torch.Tensor:
    """Per output pixel, how many window pixels lie inside the image (global padding excluded).

    ``origin`` is the global index of the first read row/column (negative at
    the top/left border), ``size`` the true input size: pure geometry, no message.
    """
    total: torch.Tensor | None = None
    for a in range(win.dims):
        idx = torch.arange(win.need[a], device=device) + origin[a]
        inside = ((idx >= 0) & (idx < size[a])).to(torch.float64)
        span = win.dilation[a] * (win.kernel[a] - 1) + 1
        count = inside.unfold(0, span, win.stride[a])[:, :: win.dilation[a]].sum(-1)
        shape = [1] * win.dims
        shape[a] = -1
        total = count.view(shape) if total is None else total * count.view(shape)
    assert total is not None
    return total


class _AvgPool(torch.autograd.Function):
    """Average-pooling; on the tile itself where :func:`_pool_padding` allows (its
    backward needs no input at all: each window pixel gets ``1 / divisor``)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, win: Window, divisor: torch.Tensor | int | None
    ) -> torch.Tensor:
        pad = _pool_padding(win, x.shape)
        pool = win.ops.avg_pool
        by = divisor if isinstance(divisor, int) else None

        def run(inp: torch.Tensor, p: Any, part: Any = None) -> torch.Tensor:
            y = pool(inp, win.kernel, win.stride, p, False, True, 1 if part is not None else by)
            return y / part.to(y.dtype) if part is not None else y

        def counts(band: Any) -> Any:
            return divisor[band] if isinstance(divisor, torch.Tensor) else None

        if pad is None:
            xe, _ = _extend(x, win)
            y = run(xe, 0, counts(...))
            ctx.need_shape = xe.shape
        else:
            strips = exchange_strips(x, win.halo, win.neighbours, fill=win.fill, valid=win.valid)
            y = run(_base(x, win), pad, counts(...))
            for band in _border_bands(win, x.shape):
                slab = window_of(
                    x, strips, win.halo, _reads(win, band), fill=win.fill, valid=win.valid
                )
                _write(y, _band_index(band), run(slab, 0, counts(_band_index(band))))
        ctx.win, ctx.divisor, ctx.tile, ctx.pad = win, divisor, x.shape, pad
        return y

    @staticmethod
    @first_order("a spatial average pool")
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        win: Window = ctx.win
        divisor = ctx.divisor
        if isinstance(divisor, torch.Tensor):
            gy, divisor = gy / divisor.to(gy.dtype), 1

        def grad(g: torch.Tensor, shape: Any, pad: Any) -> torch.Tensor:
            shape_of = g.new_empty(shape)  # the kernel reads only its shape
            return win.ops.avg_pool_backward(
                g, shape_of, win.kernel, win.stride, pad, False, True, divisor
            )

        zeros = [0] * win.dims
        if ctx.pad is None:
            return _tile_grad(grad(gy, ctx.need_shape, zeros), ctx.tile, win), None, None
        gx = grad(gy, ctx.tile, list(ctx.pad))
        strip_grads = _strip_grads(win, ctx.tile, gy)
        tile = [int(v) for v in ctx.tile[-win.dims :]]
        lead = tuple(ctx.tile[: len(ctx.tile) - win.dims])
        for band in _border_bands(win, ctx.tile):
            reads = _reads(win, band)
            shape = (*lead, *(r.stop - r.start for r in reads))
            g_slab = grad(gy[_band_index(band)], shape, zeros)
            add_to_parts(g_slab, [(r.start, r.stop) for r in reads], win.halo, tile, strip_grads)
        gx = return_strip_grads(gx, strip_grads, win.halo, win.neighbours, valid=win.valid)
        return gx, None, None


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
    exclude_padding_at: tuple[tuple[int, ...], tuple[int, ...]] | None,
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
