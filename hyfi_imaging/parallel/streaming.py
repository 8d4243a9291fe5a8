"""Streaming the stem: the first layers run over row bands of the tile, never on all of it.

Why: with every block checkpointed, a ResNet's peak is its stem (the 7x7/2 convolution,
BatchNorm, ReLU and max-pool in front of the first block). Its maps are at half the input
resolution with tens of channels, and they are outside any block, so backward holds the
convolution's output, the BatchNorm's input gradient and the max-pool's input at once:
~80 bytes per input pixel of ResNet-18 x0.25, where the checkpointed rest needs ~32.
Checkpointing the stem as one unit cannot go below ~60 (its own backward holds three such
maps). Streaming -- the sequential sub-tiling of Pinckaers et al.'s StreamingCNN, here
exact with BatchNorm -- computes the stem one band of output rows at a time, from the
input tile and the halo strips only, so its maps never exist whole.

How, exactly:

* **Geometry.** Every layer of the stem has its level (0 is the input). A band owns a
  range of the last level's rows; at every level it owns the rows that map to them by
  the ownership rule of :func:`~hyfi_imaging.parallel.geometry.owned_outputs` (the
  rank's tile at that level, cut at the band boundaries), and it computes the *box* of
  rows its own rows and the windows above need (:meth:`LayerGeom.need`), clipped to the
  image. Windowed layers pad the box's rows outside the image explicitly (0 before a
  convolution, -inf before a max-pool) and run with no padding of their own. The input
  rows outside the tile come from one halo exchange of the whole stem's (deep) halo.
* **BatchNorm statistics** are those of the whole image: a pass over the bands per
  BatchNorm accumulates each band's count, mean and centred sum of squares over its
  *owned* positions (Chan's merge, in the statistics' precision), summed over the tiles.
  Running statistics are updated once, in forward.
* **Backward** recomputes each band with autograd and back-propagates the band's share of
  the output gradient. Gradients are linear in that share, so the bands' (and the
  tiles') partial gradients sum to the exact one -- except BatchNorm's two global terms,
  ``-w/sigma (S1 + x_hat S2) / n``, which a pass per BatchNorm first sums over the bands
  and tiles and the last pass then adds at each band's owned positions. No halo gradient
  is sent: a band's recomputed box covers what it needs. The input gets no gradient (the
  stem reads the image).

Cost: the stem's layers run ``1 + b`` times in forward and ``1 + b`` times in backward
with ``b`` BatchNorms in training mode (the convolution is cheap next to the rest of the
network at these sizes); its memory is one band's maps. Measured in
``benchmarks/bench_scale.py --part largest`` (docs/benchmarks.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models.registry import set_chain_run
from hyfi_imaging.parallel.first_order import first_order
from hyfi_imaging.parallel.geometry import LayerGeom, Span, layer_geom, outgrows_tiles
from hyfi_imaging.parallel.halo import exchange_strips, new_like, return_halo_grads, window_of
from hyfi_imaging.parallel.spatial.kinds import streaming_classes

__all__ = ["STREAMING_MODES", "Stem", "stream_stem"]

#: ``parallel.streaming`` values: no streaming, or the stem in bands.
STREAMING_MODES = ("none", "stem")

#: Per-pixel activations the stem may hold (applied per element, so per band).
_ACTIVATIONS = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SiLU, nn.GELU, nn.Hardswish, nn.Mish,
    nn.Identity,
)  # fmt: skip

#: The fewest rows of the stem's output per band: enough that the bands' overlap (a few
#: rows of each map) costs little. How many bands a tile has is planned
#: (:meth:`_Plan.band_rows`): as few as keep a band's maps no larger than the stem's output.
_MIN_BAND_ROWS = 16


@dataclass(frozen=True)
class _Layer:
    kind: str  # "conv", "max", "bn", "act"
    path: str
    module: nn.Module
    geoms: tuple[LayerGeom, LayerGeom] | None  # (rows, cols) of a windowed layer


#: The exact classes that stream (plain, and their spatial forms; the layer-kind registry's
#: ``stream``): a subclass may compute something else in its ``forward`` (timm's
#: BatchNormAct2d, a weight-standardised conv).
_CONVS = streaming_classes("conv")
_MAX_POOLS = streaming_classes("max")
_NORMS = streaming_classes("bn")


def _layer(path: str, m: nn.Module) -> _Layer | None:
    """The stem layer ``m`` is, or None when it cannot stream."""
    kind = type(m)
    if kind in _CONVS:
        assert isinstance(m, nn.Conv2d)
        if isinstance(m.padding, str) or m.padding_mode != "zeros":
            return None
        g = layer_geom(m)
        return _Layer("conv", path, m, (g[0], g[1]))
    if kind in _MAX_POOLS:
        assert isinstance(m, nn.MaxPool2d)
        if m.ceil_mode or m.return_indices:
            return None
        g = layer_geom(m)
        return _Layer("max", path, m, (g[0], g[1]))
    if kind in _NORMS:
        return _Layer("bn", path, m, None)
    if kind in _ACTIVATIONS:
        return _Layer("act", path, m, None)
    return None


def _stem_layers(layers: Sequence[tuple[str, nn.Module]]) -> list[_Layer]:
    """The leading layers of a chain that stream, up to the last windowed one among them."""
    out: list[_Layer] = []
    for path, m in layers:
        layer = _layer(path, m)
        if layer is None:
            break
        out.append(layer)
    last = max((i for i, ly in enumerate(out) if ly.geoms is not None), default=-1)
    return out[: last + 1]


@dataclass(frozen=True)
class _Frame:
    """Where this rank's tile sits, per axis: the image length, the tile's first index and
    length, whether it is the last tile; and whether the output is a spatial tile
    (``tile // jump`` long) or the whole map (one process)."""

    size: tuple[int, int]
    start: tuple[int, int]
    tile: tuple[int, int]
    last: tuple[bool, bool]
    spatial: bool

    @staticmethod
    def of(x: torch.Tensor, ctx: Any) -> _Frame:
        tile = (int(x.shape[-2]), int(x.shape[-1]))
        if ctx is None:
            return _Frame(tile, (0, 0), tile, (True, True), False)
        assert ctx.image_hw is not None, "call set_image_size() before forward"
        size = (int(ctx.image_hw[0]), int(ctx.image_hw[1]))
        start = (ctx.tile[0] * tile[0], ctx.tile[1] * tile[1])
        last = (ctx.tile[0] == ctx.grid[0] - 1, ctx.tile[1] == ctx.grid[1] - 1)
        return _Frame(size, start, tile, last, True)

    def others(self, grid: tuple[int, int]) -> list[_Frame]:
        """The frames of every tile of the grid (their halos must agree)."""
        return [
            _Frame(
                self.size,
                (i * self.tile[0], j * self.tile[1]),
                self.tile,
                (i == grid[0] - 1, j == grid[1] - 1),
                True,
            )
            for i in range(grid[0])
            for j in range(grid[1])
        ]


class _Plan:
    """Levels, owned ranges and band boxes of one stem for one tile (pure geometry)."""

    def __init__(self, layers: list[_Layer], frame: _Frame, band_rows: int | None) -> None:
        self.layers, self.frame = layers, frame
        n = len(layers)
        # Per axis: image length and cumulative jump at every level 0..n.
        self.length: list[list[int]] = [[s] for s in frame.size]
        self.jump: list[list[int]] = [[1], [1]]
        for ly in layers:
            for a in range(2):
                if ly.geoms is None:
                    self.length[a].append(self.length[a][-1])
                    self.jump[a].append(self.jump[a][-1])
                else:
                    g = ly.geoms[a]
                    self.length[a].append(g.out_length(self.length[a][-1]))
                    self.jump[a].append(self.jump[a][-1] * g.stride)
        # The rank's owned range per axis and level: its tile / jump, the last tile to the end.
        self.owned: list[list[Span]] = []
        self.out_len: list[int] = []
        for a in range(2):
            per: list[Span] = []
            for lvl in range(n + 1):
                j, m = self.jump[a][lvl], self.length[a][lvl]
                lo = -(-frame.start[a] // j)
                hi = m if frame.last[a] else -(-(frame.start[a] + frame.tile[a]) // j)
                per.append(Span(min(lo, m), min(hi, m)))
            self.owned.append(per)
            self.out_len.append(frame.tile[a] // self.jump[a][n] if frame.spatial else per[n].stop)
            if frame.spatial and frame.last[a]:
                self._check_room(a)
        top = self.owned[0][n]
        band_rows = band_rows or self.band_rows(top.stop - top.start)
        cuts = list(range(top.start, top.stop, band_rows))[1:]
        self.bands = list(zip([top.start, *cuts], [*cuts, top.stop], strict=True))
        self.cols = self._boxes(1, self.owned[1])
        self.rows = [
            self._boxes(0, [self._own_rows(lvl, b0, b1, i) for lvl in range(n + 1)])
            for i, (b0, b1) in enumerate(self.bands)
        ]

    def _check_room(self, a: int) -> None:
        """Refuse a layer whose map outgrows the tiles along axis ``a`` (a convolution padded
        by more than its window takes back): the last tile would own more outputs than a
        tile holds. The plain spatial layers refuse the same (``_window``); every rank plans
        every tile's bands before any exchange, so all refuse together."""
        f = self.frame
        for lvl, ly in enumerate(self.layers, start=1):
            own, j = self.owned[a][lvl], self.jump[a][lvl]
            if own.stop - own.start > f.tile[a] // j:
                axis = ("height", "width")[a]
                held = f"{(f.start[a] + f.tile[a]) // j} along the {axis}"
                raise outgrows_tiles(ly.path, ly.module, str(self.length[a][lvl]), held)

    def band_rows(self, rows: int) -> int:
        """Output rows per band of a tile with ``rows`` output rows: as many bands as make one
        band's maps (every layer's output, over the band's rows) about as large as the stem's
        whole output, which exists anyway (it is the next layer's input); at least
        :data:`_MIN_BAND_ROWS` rows. A ResNet's stem (64 channels at 4 pixels per output pixel
        through the convolution, BatchNorm and ReLU, then the max-pool's 64) gets 13 bands,
        whatever the tile's size: every band costs a fixed number of kernels (146 for
        ResNet-50's stem, counted), which a GPU pays in launches (16 rows a band, as before,
        was 64 bands at 4096^2; ``docs/benchmarks.md``)."""
        n = len(self.layers)
        # Until the first convolution (a stem may start with a BatchNorm, a pool or an
        # activation) the maps have the input's channels, the first convolution's in_channels.
        first = next((ly for ly in self.layers if ly.kind == "conv"), None)
        chans = int(first.module.in_channels) if first is not None else 1  # type: ignore[arg-type]
        maps = 0.0
        for lvl, ly in enumerate(self.layers, start=1):
            if ly.kind == "conv":
                chans = int(ly.module.out_channels)  # type: ignore[arg-type]
            per_output = (self.jump[0][n] / self.jump[0][lvl]) * (
                self.jump[1][n] / self.jump[1][lvl]
            )
            maps += chans * per_output
        bands = max(1, math.ceil(maps / chans))  # chans: the output's
        return max(_MIN_BAND_ROWS, -(-rows // bands))

    def _own_rows(self, lvl: int, b0: int, b1: int, band: int) -> Span:
        """Rows of level ``lvl`` band ``band`` owns (the rank's, cut at the band bounds)."""
        own = self.owned[0][lvl]
        ratio = self.jump[0][-1] // self.jump[0][lvl]
        lo = own.start if band == 0 else b0 * ratio
        hi = own.stop if band == len(self.bands) - 1 else b1 * ratio
        return Span(max(lo, own.start), min(hi, own.stop))

    def _boxes(self, a: int, own: list[Span]) -> list[Span]:
        """Per level, the rows (``a`` = 0) or columns computed: owned ones and what the
        layers above read, within the image."""
        n = len(self.layers)
        boxes = [own[n]]
        for lvl in range(n - 1, -1, -1):
            above, ly = boxes[0], self.layers[lvl]
            need = above if ly.geoms is None else ly.geoms[a].need(above)
            lo, hi = min(need.start, own[lvl].start), max(need.stop, own[lvl].stop)
            if above.stop <= above.start:  # nothing above: only the owned rows
                lo, hi = own[lvl].start, own[lvl].stop
            boxes.insert(0, Span(max(lo, 0), min(hi, self.length[a][lvl])))
        return boxes

    def halo(self) -> tuple[int, int, int, int]:
        """Input rows and columns beyond the tile that the bands read (top, bottom, left, right)."""
        f = self.frame
        first, last = self.rows[0][0], self.rows[-1][0]
        cols = self.cols[0]
        return (
            max(0, f.start[0] - first.start), max(0, last.stop - f.start[0] - f.tile[0]),
            max(0, f.start[1] - cols.start), max(0, cols.stop - f.start[1] - f.tile[1]),
        )  # fmt: skip


def _fill(layer: _Layer) -> float:
    return -math.inf if layer.kind == "max" else 0.0


def _window(
    layer: _Layer,
    x: torch.Tensor,
    box: tuple[Span, Span],
    out: tuple[Span, Span],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> Any:
    """Layer ``layer`` on ``x`` (its input's ``box``) giving outputs ``out``: the rows and
    columns it reads, padded where they fall outside the image, then the window op."""
    assert layer.geoms is not None
    index, pads = [], []
    for a in range(2):
        need = layer.geoms[a].need(out[a])
        lo, hi = max(need.start, box[a].start), min(need.stop, box[a].stop)
        index.append(slice(lo - box[a].start, hi - box[a].start))
        pads.append((lo - need.start, need.stop - hi))
    part = x[..., index[0], index[1]]
    if any(p for pair in pads for p in pair):
        part = F.pad(part, (*pads[1], *pads[0]), value=_fill(layer))
    m = layer.module
    gy, gx = layer.geoms
    if layer.kind == "conv":
        assert isinstance(m, nn.Conv2d) and weight is not None
        return F.conv2d(
            part, weight, bias, (gy.stride, gx.stride), 0, (gy.dilation, gx.dilation), m.groups
        )
    return F.max_pool2d(
        part, (gy.kernel, gx.kernel), (gy.stride, gx.stride), 0, (gy.dilation, gx.dilation)
    )


@dataclass
class _Stats:
    """One BatchNorm's statistics over the whole image: mean and 1/sqrt(var + eps)."""

    mean: torch.Tensor
    rstd: torch.Tensor
    count: int
    var: torch.Tensor


def _shape(t: torch.Tensor) -> torch.Tensor:
    return t.view(1, -1, 1, 1)


class Stem:
    """The streamed stem of a chain: its layers, and the autograd function that runs them.

    Not a module: the layers stay where the model has them (same parameter names); the
    chain runner (:func:`~hyfi_imaging.models.registry.run_chain`) calls the stem instead
    of its layers.
    """

    def __init__(self, layers: list[_Layer], ctx: Any, band_rows: int | None = None) -> None:
        self.layers, self.ctx, self.band_rows = layers, ctx, band_rows
        self.modules = [ly.module for ly in layers]
        #: Forward passes run in bands (tests and the verify report read it).
        self.runs = 0

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def paths(self) -> list[str]:
        return [ly.path for ly in self.layers]

    @property
    def passes(self) -> int:
        """Times forward (and backward again) runs the layers: once, plus once per
        BatchNorm with batch statistics."""
        return 1 + len(self.training_norms())

    def keys(self) -> list[tuple[int, str]]:
        """``(layer, name)`` of the parameters, in the order of :meth:`params`."""
        return [
            (lvl, name)
            for lvl, ly in enumerate(self.layers)
            if ly.kind in ("conv", "bn")
            for name in ("weight", "bias")
            if isinstance(getattr(ly.module, name, None), torch.Tensor)
        ]

    def params(self) -> list[torch.Tensor]:
        """The convolutions' and BatchNorms' weights and biases, as the modules hold them now."""
        return [getattr(self.layers[lvl].module, name) for lvl, name in self.keys()]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            for m in self.modules:  # not a batch of images: the layers as they are
                x = m(x)
            return x
        self.runs += 1
        out: torch.Tensor = _Streamed.apply(x, self, *self.params())
        return out

    # ---------------------------------------------------------------- per band

    def band(
        self,
        plan: _Plan,
        src: Any,
        i: int,
        stats: dict[int, _Stats],
        upto: int,
        bound: dict[tuple[int, str], torch.Tensor],
        grad: bool = False,
        input_grad: bool = False,
    ) -> list[torch.Tensor]:
        """Maps of band ``i`` at levels 0..``upto`` (each its box), from the input source,
        with the parameters ``bound`` (:meth:`keys` -> tensor); ``input_grad``: the input
        box (``maps[0]``) records its gradient."""
        rows, cols = plan.rows[i], plan.cols
        x = src(rows[0], cols[0])
        if input_grad:
            x.requires_grad_()
        maps = [x]
        for lvl in range(upto):
            ly = self.layers[lvl]
            box, out = (rows[lvl], cols[lvl]), (rows[lvl + 1], cols[lvl + 1])
            weight, bias = bound.get((lvl, "weight")), bound.get((lvl, "bias"))
            if ly.geoms is not None:
                x = _window(ly, x, box, out, weight, bias)
            elif ly.kind == "bn":
                x = self._norm(ly, lvl, x, stats, weight, bias)
            else:
                # ``forward``, not the module's hooks (once per band); an in-place one on the
                # band's own copy, so that the map below stays what it was.
                x = ly.module.forward(x.clone() if getattr(ly.module, "inplace", False) else x)
            if grad and lvl + 1 < upto and not x.requires_grad:
                x.requires_grad_()
            maps.append(x)
        return maps

    def _norm(
        self,
        ly: _Layer,
        lvl: int,
        x: torch.Tensor,
        stats: dict[int, _Stats],
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        m = ly.module
        assert isinstance(m, nn.BatchNorm2d)
        if lvl not in stats:  # evaluation: running statistics
            assert m.running_mean is not None and m.running_var is not None
            mean, rstd = m.running_mean, torch.rsqrt(m.running_var + m.eps)
        else:
            mean, rstd = stats[lvl].mean, stats[lvl].rstd
        # In the statistics' precision, rounded once to the map's dtype at the end, as
        # torch's BatchNorm does for a half-precision map under autocast (the plain stem's
        # maps stay bfloat16 there; multiplying by a float32 weight made these float32).
        y = (x.to(mean.dtype) - _shape(mean)) * _shape(rstd)
        if weight is not None:
            y = y * _shape(weight)
        if bias is not None:
            y = y + _shape(bias)
        return y.to(x.dtype)

    def owned_view(self, plan: _Plan, i: int, lvl: int, t: torch.Tensor) -> torch.Tensor:
        """The positions of ``t`` (band ``i``'s map at ``lvl``) that the band owns."""
        box, cbox = plan.rows[i][lvl], plan.cols[lvl]
        own = plan._own_rows(lvl, *plan.bands[i], i)
        cown = plan.owned[1][lvl]
        return t[
            ...,
            own.start - box.start : own.stop - box.start,
            cown.start - cbox.start : cown.stop - cbox.start,
        ]

    def training_norms(self) -> list[int]:
        """Levels (layer indices) of the BatchNorms that normalise with batch statistics."""
        out = []
        for lvl, ly in enumerate(self.layers):
            if ly.kind == "bn" and (ly.module.training or _bn(self, lvl).running_mean is None):
                out.append(lvl)
        return out

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.ctx is not None and dist.is_initialized():
            dist.all_reduce(t, group=self.ctx.group)
        return t


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def _source(x: torch.Tensor, strips: Any, halo: tuple[int, ...], frame: _Frame) -> Any:
    """Rows and columns (global spans within the image) of the input, from the tile and the
    received strips."""

    def get(rows: Span, cols: Span) -> torch.Tensor:
        box = (
            slice(rows.start - frame.start[0] + halo[0], rows.stop - frame.start[0] + halo[0]),
            slice(cols.start - frame.start[1] + halo[2], cols.stop - frame.start[1] + halo[2]),
        )
        return window_of(x, strips, halo, box)

    return get


class _Streamed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stem: Stem, *params: torch.Tensor) -> torch.Tensor:
        frame = _Frame.of(x, stem.ctx)
        plan = _Plan(stem.layers, frame, stem.band_rows)
        if x.device.type == "meta":  # a planner's trace: the shape, and what is saved
            ctx.save_for_backward(x, *params)
            return x.new_empty((x.shape[0], _out_channels(stem, x), *plan.out_len))
        strips: tuple[Any, ...] = (None,) * 4
        halo = (0, 0, 0, 0)
        if frame.spatial:
            # One halo for all tiles (the exchange sends what the neighbour's halo asks).
            halos = [
                _Plan(stem.layers, f, stem.band_rows).halo() for f in frame.others(stem.ctx.grid)
            ]
            halo = tuple(max(h[k] for h in halos) for k in range(4))  # type: ignore[assignment]
            if any(h > frame.tile[k // 2] for k, h in enumerate(halo)):
                raise ConfigError(
                    f"streamed stem {'/'.join(stem.paths)}",
                    f"needs a halo of {halo} px (top, bottom, left, right) around tiles of "
                    f"{frame.tile} px",
                    "use fewer tiles (larger ones), or parallel.streaming=none",
                )
            valid = tuple(max(0, frame.size[a] - frame.start[a]) for a in range(2))
            strips = exchange_strips(x, halo, stem.ctx.neighbours, fill=0.0, valid=valid)
        src = _source(x, strips, halo, frame)
        n = len(stem.layers)
        with torch.no_grad():
            bound = dict(zip(stem.keys(), params, strict=True))
            stats = _statistics(stem, plan, src, bound)
            _update_running(stem, stats)
            lead = x.shape[0]
            chans = _out_channels(stem, x)
            out: torch.Tensor | None = None
            for i in range(len(plan.bands)):
                y = stem.band(plan, src, i, stats, n, bound)[-1]
                if out is None:  # in the bands' dtype (autocast's, as the plain stem gives)
                    # and layout (channels-last from the weights too, where the input is not)
                    out = new_like(y, (lead, chans, *plan.out_len), zero=True, dtype=y.dtype)
                rows, cols = plan.rows[i][n], plan.cols[n]
                base = [frame.start[a] // plan.jump[a][n] if frame.spatial else 0 for a in range(2)]
                out[
                    ...,
                    rows.start - base[0] : rows.stop - base[0],
                    cols.start - base[1] : cols.stop - base[1],
                ] = y
        assert out is not None  # a tile has at least one band
        ctx.stem, ctx.plan, ctx.stats, ctx.halo = stem, plan, stats, halo
        ctx.has = tuple(s is not None for s in strips)
        ctx.save_for_backward(x, *params, *(s for s in strips if s is not None))
        ctx.n_params = len(params)
        ctx.autocast = _autocast_state(x)
        return out

    @staticmethod
    @first_order("the streamed stem")
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        stem: Stem = ctx.stem
        plan: _Plan = ctx.plan
        stats: dict[int, _Stats] = ctx.stats
        x, *rest = ctx.saved_tensors
        params, found = rest[: ctx.n_params], iter(rest[ctx.n_params :])
        strips = tuple(next(found) if h else None for h in ctx.has)
        src = _source(x, strips, ctx.halo, plan.frame)
        bound = dict(zip(stem.keys(), params, strict=True))
        frame, n = plan.frame, len(stem.layers)
        base = [frame.start[a] // plan.jump[a][n] if frame.spatial else 0 for a in range(2)]

        def g_band(i: int) -> torch.Tensor:
            rows, cols = plan.rows[i][n], plan.cols[n]
            return g[
                ...,
                rows.start - base[0] : rows.stop - base[0],
                cols.start - base[1] : cols.stop - base[1],
            ]

        # BatchNorm's global terms, from the last BatchNorm down: S1 = sum(dz), S2 =
        # sum(dz * x_hat) over the image, each pass using the terms of those above it.
        sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        grads = [torch.zeros_like(p) for p in params]
        with _autocast(ctx.autocast):
            for lvl in reversed(stem.training_norms()):
                s1 = s2 = None
                for i in range(len(plan.bands)):
                    with torch.enable_grad():
                        maps = stem.band(plan, src, i, stats, n, bound, grad=True)
                        hooks = _global_terms(bound, stem, plan, i, maps, stats, sums)
                        z = maps[lvl + 1]
                        (dz,) = torch.autograd.grad(maps[-1], z, g_band(i).to(maps[-1].dtype))
                        for h in hooks:
                            h.remove()
                    xhat = (maps[lvl].detach() - _shape(stats[lvl].mean)) * _shape(stats[lvl].rstd)
                    acc = _acc(dz)
                    b1 = dz.sum((0, 2, 3), dtype=acc)
                    b2 = (dz * xhat.to(dz.dtype)).sum((0, 2, 3), dtype=acc)
                    s1 = b1 if s1 is None else s1 + b1
                    s2 = b2 if s2 is None else s2 + b2
                    del maps, z, dz, xhat
                assert s1 is not None and s2 is not None
                sums[lvl] = (stem.all_reduce(s1), stem.all_reduce(s2))
            need_x = bool(ctx.needs_input_grad[0])
            # The input's gradient, halos included (sent back to their owners at the end).
            halo = ctx.halo
            gx = (
                new_like(
                    x,
                    (*x.shape[:2], x.shape[2] + halo[0] + halo[1], x.shape[3] + halo[2] + halo[3]),
                    zero=True,
                )
                if need_x
                else None
            )
            wanted = [k for k, p in enumerate(params) if p.requires_grad]
            for i in range(len(plan.bands)):
                with torch.enable_grad():
                    maps = stem.band(plan, src, i, stats, n, bound, grad=True, input_grad=need_x)
                    hooks = _global_terms(bound, stem, plan, i, maps, stats, sums)
                    inputs = [params[k] for k in wanted] + ([maps[0]] if need_x else [])
                    got = torch.autograd.grad(
                        maps[-1], inputs, g_band(i).to(maps[-1].dtype), allow_unused=True
                    )
                    for h in hooks:
                        h.remove()
                for k, gk in zip(wanted, got[: len(wanted)], strict=True):
                    if gk is not None:
                        grads[k] += gk
                if gx is not None and got[-1] is not None:
                    rows, cols = plan.rows[i][0], plan.cols[0]
                    r0 = rows.start - frame.start[0] + halo[0]
                    c0 = cols.start - frame.start[1] + halo[2]
                    gx[..., r0 : r0 + rows.size, c0 : c0 + cols.size] += got[-1]
                del maps, got
        g_input = None
        if gx is not None:
            if frame.spatial:
                valid = tuple(max(0, frame.size[a] - frame.start[a]) for a in range(2))
                g_input = return_halo_grads(gx, halo, stem.ctx.neighbours, valid=valid)
            else:
                g_input = gx
        return (g_input, None, *grads)


def _global_terms(
    bound: dict[tuple[int, str], torch.Tensor],
    stem: Stem,
    plan: _Plan,
    i: int,
    maps: list[torch.Tensor],
    stats: dict[int, _Stats],
    sums: dict[int, tuple[torch.Tensor, torch.Tensor]],
) -> list[Any]:
    """Hooks adding BatchNorm's global gradient terms at the band's owned inputs."""
    hooks = []
    for lvl, (s1, s2) in sums.items():
        st = stats[lvl]
        y = maps[lvl]
        w = bound.get((lvl, "weight"))

        def add(grad: torch.Tensor, y: torch.Tensor = y, st: _Stats = st, s1: Any = s1,
                s2: Any = s2, w: Any = w, lvl: int = lvl) -> torch.Tensor:  # fmt: skip
            scale = st.rstd / st.count
            if w is not None:
                scale = scale * w.detach().to(scale.dtype)
            xhat = (y.detach() - _shape(st.mean).to(y.dtype)) * _shape(st.rstd).to(y.dtype)
            term = -(_shape(scale * s1).to(y.dtype) + xhat * _shape(scale * s2).to(y.dtype))
            out = grad.clone()
            stem.owned_view(plan, i, lvl, out).add_(stem.owned_view(plan, i, lvl, term))
            return out

        hooks.append(y.register_hook(add))
    return hooks


def _statistics(
    stem: Stem, plan: _Plan, src: Any, bound: dict[tuple[int, str], torch.Tensor]
) -> dict[int, _Stats]:
    """Batch statistics of every training-mode BatchNorm, in order, over the whole image."""
    stats: dict[int, _Stats] = {}
    for lvl in stem.training_norms():
        parts = []
        lead = 0
        for i in range(len(plan.bands)):
            y = stem.band(plan, src, i, stats, lvl, bound)[-1]
            lead = y.shape[0]
            own = stem.owned_view(plan, i, lvl, y)
            cnt = own.shape[0] * own.shape[2] * own.shape[3]
            acc = _acc(own)
            if cnt == 0:
                continue
            mean = own.sum((0, 2, 3), dtype=acc) / cnt
            m2 = (own - _shape(mean).to(own.dtype)).square().sum((0, 2, 3), dtype=acc)
            parts.append((cnt, mean, m2))
        chans = _bn(stem, lvl).num_features
        device = next(iter(bound.values())).device
        # Chan's merge of the bands' (count, mean, centred squares), in float64: n*C numbers.
        total = torch.zeros(chans, dtype=torch.float64, device=device)
        for cnt, mean, _ in parts:
            total += mean.double() * cnt
        stem.all_reduce(total)
        # The whole map's pixels of the batch, from geometry: reading the reduced count back
        # would stop the device stream inside the forward (a host sync).
        count = lead * plan.length[0][lvl] * plan.length[1][lvl]
        gmean = total / max(count, 1)
        m2 = torch.zeros(chans, dtype=torch.float64, device=device)
        for cnt, mean, part in parts:
            m2 += part.double() + cnt * (mean.double() - gmean).square()
        stem.all_reduce(m2)
        var = m2 / max(count, 1)
        eps = float(_bn(stem, lvl).eps)
        stats[lvl] = _Stats(gmean, torch.rsqrt(var + eps), count, var)
    return stats


def _bn(stem: Stem, lvl: int) -> nn.BatchNorm2d:
    m = stem.layers[lvl].module
    assert isinstance(m, nn.BatchNorm2d)
    return m


def _update_running(stem: Stem, stats: dict[int, _Stats]) -> None:
    """Running statistics, once per forward, as ``nn.BatchNorm2d`` updates them."""
    for lvl, st in stats.items():
        m = stem.layers[lvl].module
        assert isinstance(m, nn.BatchNorm2d)
        if not (m.training and m.track_running_stats and m.running_mean is not None):
            continue
        assert m.running_var is not None and m.num_batches_tracked is not None
        m.num_batches_tracked.add_(1)
        factor = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
        unbiased = st.var * (st.count / max(st.count - 1, 1))
        m.running_mean.lerp_(st.mean.to(m.running_mean.dtype), factor)
        m.running_var.lerp_(unbiased.to(m.running_var.dtype), factor)


def _out_channels(stem: Stem, x: torch.Tensor) -> int:
    chans = int(x.shape[1])
    for ly in stem.layers:
        if ly.kind == "conv":
            chans = int(ly.module.out_channels)  # type: ignore[arg-type]
    return chans


def _autocast_state(x: torch.Tensor) -> tuple[str, bool, torch.dtype]:
    kind = x.device.type
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


def _autocast(state: tuple[str, bool, torch.dtype]) -> Any:
    kind, on, dtype = state
    return torch.autocast(kind, dtype=dtype, enabled=on)


def stem_paths(model: nn.Module) -> list[str]:
    """The layers :func:`stream_stem` streams in ``model`` (pure: the model is only read).

    Raises ConfigError when the model is not a chain or does not start with a convolution
    that can stream."""
    return [ly.path for ly in _stream_layers(model)]


def _stream_layers(model: nn.Module) -> list[_Layer]:
    from hyfi_imaging.parallel.pipeline import is_chain, model_layers

    if not is_chain(model):
        raise ConfigError(
            f"parallel.streaming=stem on {type(model).__name__}",
            "streaming runs the leading layers of a chain model; this model is not one",
            "use parallel.streaming=none",
        )
    layers = _stem_layers(model_layers(model))
    if not layers:
        first = next(iter(model_layers(model)), ("?", None))
        raise ConfigError(
            f"parallel.streaming=stem on {type(model).__name__}",
            f"its first layer {first[0]!r} ({type(first[1]).__name__}) is not a convolution, "
            "max-pool, BatchNorm or activation that can stream",
            "use parallel.streaming=none",
        )
    return layers


def stream_stem(model: nn.Module, ctx: Any = None, *, band_rows: int | None = None) -> list[str]:
    """Stream the stem of chain ``model`` (its leading convolutions, max-pools, BatchNorms
    and activations) in bands; returns the streamed layers' names.

    ``band_rows``: output rows per band (None: planned per tile, :meth:`_Plan.band_rows`).

    ``ctx``: the :class:`~hyfi_imaging.parallel.spatial.SpatialContext` of a spatialized
    model, or None for one process. Raises ConfigError when the model is not a chain or
    does not start with a convolution that can stream.
    """
    layers = _stream_layers(model)
    stem = Stem(layers, ctx, band_rows)
    set_chain_run(layers[0].module, stem)  # run_chain runs the stem in its layers' place
    return stem.paths
