"""Pure geometry of a spatial decomposition: who owns which pixels, which halo each tile needs.

Why pure: the exact halo exchange, the spatial layers and the tile loader all
ask the same questions (which input rows does this tile need, who holds them,
which are global padding). Answering them here, with integers only and no
``torch.distributed``, lets every answer be checked exhaustively against brute
force in milliseconds, and keeps communication code free of index arithmetic.

Why per dimension: a conv or pool window is a box, so every 2-D answer is the
product of two 1-D answers. :func:`decompose` solves one axis for all ranks;
:func:`plan_layer` multiplies the two axes of a ``(gy, gx)`` grid into a
:class:`TilePlan` per rank (row-major ``rank = i * gx + j``).

Conventions:

- Ranges are half-open ``[start, stop)`` :class:`Span` values in *global*
  indices; :meth:`Span.slice` and :meth:`Box.slices` turn them into local slices.
- The image is ``[0, n)``. :func:`split` gives equal tiles over a padded length
  so that every rank has the same tensor shape (pipelining needs static
  shapes); the part of a tile beyond ``n`` is *not data*: it is never sent, and
  a rank that needs it fills it as global padding. Garbage that a layer writes
  there is therefore overwritten by the next layer for free.
- ``need`` is the contiguous hull of the inputs a tile's outputs read (with
  dilation and a stride larger than the window, a few inside it are unread):
  one box per neighbour is cheaper than many small messages.
- Output ownership rule: output ``j`` belongs to the rank owning input
  ``jump * j`` (the last rank also takes any outputs past the end that a large
  padding creates). For tiles aligned to the jump this is simply
  ``output tile = input tile / jump``; unaligned tiles get uneven outputs.

Why :class:`ChainGeom` looks like a layer: a chain of layers reads, from the
input, the window ``[J*j - P, J*j - P + R)`` for output ``j`` (REFERENCE.md:
``J, P, R``), so one deep exchange for a chain uses the same code as one layer.
A deep halo is exact only if each intermediate activation is re-masked outside
the image (0 for conv, -inf before max-pool); that is the spatial layers' job.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.geometry.spans import (
    Span,
    check_partition,
    padded_hw,
    split,
    split_balanced,
)
from hyfi_imaging.geometry.spans import check_int as _check_int

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "Box",
    "ChainGeom",
    "Decomp1D",
    "Footprint",
    "GridPlan",
    "Halo1D",
    "LayerGeom",
    "Resample1D",
    "Span",
    "TilePlan",
    "carried_halos",
    "decompose",
    "dynamic_same",
    "halo_1d",
    "layer_geom",
    "out_length",
    "owned_outputs",
    "padded_hw",
    "plan_chain",
    "plan_layer",
    "resample_1d",
    "resampled_tile",
    "split",
    "split_balanced",
    "tf_same_padding",
    "transposed_halo",
]


class Box(NamedTuple):
    """2-D box ``y x x`` of two spans, in global ``(y, x)`` coordinates."""

    y: Span
    x: Span

    @property
    def shape(self) -> tuple[int, int]:
        """``(h, w)`` of the box."""
        return (self.y.size, self.x.size)

    @property
    def empty(self) -> bool:
        """True when the box holds no pixel."""
        return self.y.empty or self.x.empty

    def intersect(self, other: Box) -> Box:
        """Pixels in both boxes."""
        return Box(self.y.intersect(other.y), self.x.intersect(other.x))

    def slices(self, origin: tuple[int, int] = (0, 0)) -> tuple[slice, slice]:
        """Local ``(y, x)`` slices in an array whose pixel ``(0, 0)`` is global ``origin``."""
        return (self.y.slice(origin[0]), self.x.slice(origin[1]))


class Footprint(Protocol):
    """What the decomposition needs to know of a layer (or a chain of layers) on one axis."""

    @property
    def jump(self) -> int:
        """Input pixels per output pixel (the stride, or a chain's total stride)."""
        ...

    def out_length(self, n: int) -> int:
        """Output length for an input of length ``n``; ConfigError when it would be <= 0."""
        ...

    def need(self, out: tuple[int, int]) -> Span:
        """Hull of the input indices (padding included) that outputs ``out`` read."""
        ...


@dataclass(frozen=True)
class LayerGeom:
    """One axis of a conv/pool window: ``kernel``, ``stride``, ``padding``, ``dilation``.

    ``padding`` pads the start of the axis and ``padding_end`` its end
    (default: the same); they differ only for ``padding='same'`` convs with an
    even window, where PyTorch puts the extra pixel at the end.

    OK: ``LayerGeom(3, stride=2, padding=1)``.  Error: ``LayerGeom(0)`` ->
    ConfigError (kernel must be >= 1).
    """

    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    padding_end: int | None = None
    ceil_mode: bool = False

    def __post_init__(self) -> None:
        where = f"layer geometry {self!r}"
        _check_int(where, "kernel", self.kernel, 1)
        _check_int(where, "stride", self.stride, 1)
        _check_int(where, "padding", self.padding, 0)
        _check_int(where, "dilation", self.dilation, 1)
        if self.padding_end is None:
            # Normalised so that equal windows compare equal however they were written.
            object.__setattr__(self, "padding_end", self.padding)
        _check_int(where, "padding_end", self.padding_end, 0)

    def __str__(self) -> str:
        pad = (
            f"{self.padding}" if self.pad_end == self.padding else f"{self.padding}+{self.pad_end}"
        )
        dil = f"/d{self.dilation}" if self.dilation != 1 else ""
        return f"k{self.kernel}/s{self.stride}/p{pad}{dil}"

    @property
    def pad_end(self) -> int:
        """Padding at the end of the axis (``padding_end`` as an int)."""
        return self.padding if self.padding_end is None else self.padding_end

    @property
    def extent(self) -> int:
        """Span of one window in input pixels, ``K = d(k-1) + 1``."""
        return self.dilation * (self.kernel - 1) + 1

    @property
    def jump(self) -> int:
        """Input pixels per output pixel: the stride."""
        return self.stride

    def out_length(self, n: int) -> int:
        """``floor((n + p + p_end - K) / s) + 1``; ConfigError when it would be <= 0."""
        span = n + self.padding + self.pad_end - self.extent
        m = (-(-span // self.stride) if self.ceil_mode else span // self.stride) + 1
        if self.ceil_mode and span >= 0 and (m - 1) * self.stride >= n + self.padding:
            m -= 1  # PyTorch: the last window must start inside the input or its left padding
        if m <= 0:
            raise ConfigError(
                f"layer {self}",
                f"an input of length {n} is shorter than the window extent {self.extent} "
                f"minus the padding {self.padding + self.pad_end}",
                f"use an input of at least {self.extent - self.padding - self.pad_end} pixels",
            )
        return m

    def halo(self, carry: tuple[int, int] = (0, 0), *, surplus: bool = False) -> tuple[int, int]:
        """Input pixels read before and after a stride-aligned tile, the one halo rule.

        For outputs that are the tile plus a carried border ``carry = (b, a)`` (0 for a
        plain layer; a deep halo's earlier layers carry one): ``(s*b + p, s*a + K - p - s)``
        (REFERENCE.md). A negative ``after`` means the windows stop short of the tile's end:
        no data is needed, so it is 0 unless ``surplus`` asks for the signed value (the
        extent the windows span is ``before + tile + after``).

        OK: ``LayerGeom(3, padding=1).halo()`` -> ``(1, 1)``; ``LayerGeom(3, 2, 1).halo()``
        -> ``(1, 0)``, with ``surplus=True`` ``(1, 0)``; ``LayerGeom(1, 2).halo(surplus=True)``
        -> ``(0, -1)``.
        """
        before = self.stride * carry[0] + self.padding
        after = self.stride * carry[1] + self.extent - self.padding - self.stride
        return before, after if surplus else max(after, 0)

    def reads(self, j: int) -> range:
        """Exact input indices (padding included) that output ``j`` reads."""
        first = self.stride * j - self.padding
        return range(first, first + self.extent, self.dilation)

    def need(self, out: tuple[int, int]) -> Span:
        """Hull ``[s*j0 - p, s*(j1-1) - p + K)`` of the inputs that outputs ``[j0, j1)`` read."""
        j0, j1 = out
        if j1 <= j0:
            return Span(self.stride * j0 - self.padding, self.stride * j0 - self.padding)
        return Span(
            self.stride * j0 - self.padding, self.stride * (j1 - 1) - self.padding + self.extent
        )


@dataclass(frozen=True)
class ChainGeom:
    """A chain of layers on one axis, seen from its input: total stride, padding, extent.

    ``J_l = J_{l-1} s_l``, ``P_l = P_{l-1} + p_l J_{l-1}``,
    ``R_l = R_{l-1} + d_l (k_l - 1) J_{l-1}`` with ``J_0 = 1, P_0 = 0, R_0 = 1``.
    For tiles aligned to ``J`` the deep halo is :attr:`halo` ``= (P, R - P - J)``.
    """

    layers: tuple[LayerGeom, ...]
    jump: int = field(init=False)
    padding: int = field(init=False)
    extent: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ConfigError("layer chain", "the chain has no layer", "give at least one layer")
        jump, pad, ext = 1, 0, 1
        for geom in self.layers:
            pad += geom.padding * jump
            ext += geom.dilation * (geom.kernel - 1) * jump
            jump *= geom.stride
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "jump", jump)
        object.__setattr__(self, "padding", pad)
        object.__setattr__(self, "extent", ext)

    def __str__(self) -> str:
        return " > ".join(str(g) for g in self.layers)

    @property
    def halo(self) -> tuple[int, int]:
        """Deep halo ``(P, R - P - J)`` of a tile aligned to :attr:`jump` (negative = surplus)."""
        return (self.padding, self.extent - self.padding - self.jump)

    def out_length(self, n: int) -> int:
        """Output length of the whole chain; ConfigError names the layer that runs out."""
        for index, geom in enumerate(self.layers):
            try:
                n = geom.out_length(n)
            except ConfigError as err:
                raise ConfigError(
                    f"layer {index} ({geom}) of chain {self}", err.what, err.fix
                ) from None
        return n

    def need(self, out: tuple[int, int]) -> Span:
        """Hull ``[J*j0 - P, J*(j1-1) - P + R)`` of chain inputs read by outputs ``[j0, j1)``."""
        j0, j1 = out
        start = self.jump * j0 - self.padding
        if j1 <= j0:
            return Span(start, start)
        return Span(start, self.jump * (j1 - 1) - self.padding + self.extent)


def carried_halos(
    layers: Sequence[Sequence[LayerGeom]],
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Deep halos of a run of windowed layers whose last output is exactly the tile.

    ``layers[l]`` is layer ``l``'s window per axis. Returns, per layer, the halo
    its input holds and the halo its output carries, ``(before, after)`` per
    axis. Computed from the end: a layer whose output carries ``(b, a)`` reads
    ``(s*b + p, s*a + K - p - s)`` around its input tile -- :class:`ChainGeom`'s
    ``(P, R - P - J)`` step by step -- clamped at 0, so that every carried halo
    is a real border (a surplus is read short, as a single layer does).

    OK: two 3x3/s1/p1 layers -> ``[((2, 2), (1, 1)), ((1, 1), (0, 0))]`` per axis.
    """
    if not layers:
        return []
    out: tuple[int, ...] = (0,) * (2 * len(layers[-1]))
    result: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for axes in reversed(layers):
        inn: list[int] = []
        for a, g in enumerate(axes):
            inn += g.halo((out[2 * a], out[2 * a + 1]))
        result.append((tuple(inn), out))
        out = tuple(inn)
    return result[::-1]


def out_length(n: int, geom: Footprint) -> int:
    """Output length of ``geom`` (a layer or a chain) for an input of length ``n``."""
    return geom.out_length(n)


def _ntuple(value: int | Sequence[int], nd: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * nd
    return tuple(int(v) for v in value)


def _window_dims(module: nn.Module) -> int:
    """Spatial dims of a conv or pool module: 1 (``*1d``), 2 (``*2d``) or 3 (``*3d``), from
    the layer-kind registry (2 for a kind it does not know)."""
    from hyfi_imaging.parallel.spatial.kinds import spatial_dims

    return spatial_dims(module) or 2


def outgrows_tiles(path: str, module: object, outs: str, held: str) -> ConfigError:
    """The refusal of a windowed layer whose map outgrows its tiles (``outs`` outputs where the
    tiles hold ``held``), with the fix for its cause: a pool's ``ceil_mode`` adds a window past
    the image, a convolution padded by more than its window takes back grows the map."""
    kind = next(
        (c.__name__ for c in type(module).__mro__ if c.__module__.startswith("torch.nn.")),
        type(module).__name__,
    )
    ceil = any(g.ceil_mode for g in getattr(module, "hyfi_geoms", ()) or ())
    cause = (
        "or use ceil_mode=False"
        if ceil
        else "or pad it by no more than its window takes back (a window of 3: padding 1)"
    )
    return ConfigError(
        f"module {path!r} ({kind})",
        f"produces {outs} outputs but the tiles hold {held}",
        f"change the image size by a few pixels, {cause}",
    )


def dynamic_same(module: nn.Module) -> bool:
    """Whether ``module`` pads TensorFlow-style by its input's size (timm's ``Conv2dSame``)."""
    return type(module).__name__ == "Conv2dSame" and type(module).__module__.startswith("timm.")


def tf_same_padding(n: int, kernel: int, stride: int, dilation: int = 1) -> tuple[int, int]:
    """TensorFlow's 'SAME' padding of an axis of length ``n``: ``(start, end)``, the odd pixel
    at the end (timm's ``pad_same``).

    OK: ``tf_same_padding(7, 3, 2)`` -> ``(1, 1)``; ``tf_same_padding(8, 3, 2)`` -> ``(0, 1)``.
    """
    total = max((-(-n // stride) - 1) * stride + (kernel - 1) * dilation + 1 - n, 0)
    return total // 2, total - total // 2


def layer_geom(
    module: nn.Module, size: Sequence[int] | None = None, *, tf_same: bool | None = None
) -> tuple[LayerGeom, ...]:
    """``(y, x)`` window geometry of a ``Conv2d``, ``MaxPool2d`` or ``AvgPool2d``; ``(z, y, x)``
    of their 3-D forms, ``(l,)`` of their 1-D forms.

    Conv ``padding='valid'`` is 0 and ``'same'`` is ``d(k-1)`` split as PyTorch
    does (the odd pixel at the end); a TF-'SAME' convolution (:func:`dynamic_same`)
    pads by its input ``size`` (:func:`tf_same_padding`; ``tf_same`` overrides the
    detection, for its spatial form). Refused with ConfigError: other modules,
    non-zero conv ``padding_mode`` (a tile border has no reflection to copy)
    and ``ceil_mode=True`` on avg-pools that count their padding (the divisor of an
    overhanging window has no tiled form).
    """
    from torch import nn

    # Spatial layers call this on every forward: the repr is built only for an error.
    def where() -> str:
        return repr(module).replace("\n", " ")

    nd = _window_dims(module)
    if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d):
        if module.padding_mode != "zeros":
            mode = module.padding_mode
            # (2-D only: the 1-D and 3-D pad layers have no tiled form)
            pad = (
                {"reflect": "Reflection", "replicate": "Replication"}.get(mode) if nd == 2 else None
            )
            raise ConfigError(
                where(),
                f"padding_mode={mode!r} is not supported by spatial tiling",
                f"use padding_mode='zeros', or the same layer as an nn.{pad}Pad{nd}d of its "
                "padding before it and padding=0 (such pads run tiled)"
                if pad
                else "use padding_mode='zeros'",
            )
        kernel, stride, dilation = (
            _ntuple(module.kernel_size, nd),
            _ntuple(module.stride, nd),
            _ntuple(module.dilation, nd),
        )
        if module.padding == "valid":
            pads = [(0, 0)] * nd
        elif module.padding == "same":
            total = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
            pads = [(t // 2, t - t // 2) for t in total]
        else:
            pads = [(p, p) for p in _ntuple(module.padding, nd)]  # type: ignore[arg-type]
    elif isinstance(
        module,
        nn.MaxPool1d | nn.AvgPool1d | nn.MaxPool2d | nn.AvgPool2d | nn.MaxPool3d | nn.AvgPool3d,
    ):
        # ceil_mode only adds windows that overhang the end, which see -inf there (max)
        # or are divided by their pixels inside the image (avg, as PyTorch does, ResNet-D's
        # shortcut) -- except an average that counts padding: it counts the padding before
        # the end but not the overhang past it, a divisor the tiles have no form for.
        if (
            isinstance(module, nn.AvgPool1d | nn.AvgPool2d | nn.AvgPool3d)
            and module.ceil_mode
            and module.count_include_pad
            and getattr(module, "divisor_override", None) is None  # AvgPool1d has none
            and any(_ntuple(module.padding, nd))
        ):
            raise ConfigError(
                where(),
                f"{type(module).__name__} with ceil_mode=True, padding and count_include_pad=True is not "
                "supported by spatial tiling",
                "use count_include_pad=False, padding=0 or ceil_mode=False",
            )
        kernel = _ntuple(module.kernel_size, nd)
        stride = _ntuple(module.stride if module.stride is not None else module.kernel_size, nd)
        pads = [(p, p) for p in _ntuple(module.padding, nd)]
        dilation = (
            _ntuple(module.dilation, nd)
            if isinstance(module, nn.MaxPool1d | nn.MaxPool2d | nn.MaxPool3d)
            else (1,) * nd
        )
    else:
        raise ConfigError(
            where(),
            f"{type(module).__name__} has no window geometry",
            "pass a Conv1d/2d/3d, MaxPool1d/2d/3d or AvgPool1d/2d/3d",
        )
    if dynamic_same(module) if tf_same is None else tf_same:
        if size is None:
            raise ConfigError(where(), "pads by its input's size (TF 'SAME')", "pass size=(h, w)")
        pads = [tf_same_padding(size[a], kernel[a], stride[a], dilation[a]) for a in range(nd)]
    ceil = bool(getattr(module, "ceil_mode", False))
    return tuple(
        LayerGeom(
            kernel[a], stride[a], pads[a][0], dilation[a], padding_end=pads[a][1], ceil_mode=ceil
        )
        for a in range(nd)
    )


def owned_outputs(
    owned_in: Sequence[tuple[int, int]], geom: Footprint, m: int, *, axis: str = "axis"
) -> tuple[Span, ...]:
    """Output tiles by the ownership rule: output ``j`` goes to the owner of input ``jump*j``.

    ``m`` is the real output length; the last rank's tile also reaches past the
    end so that every output in ``[0, m)`` has exactly one owner. ConfigError
    when a rank would own no real output (grid too fine for this layer).
    """
    jump = geom.jump
    starts = [-(-int(a) // jump) for a, _ in owned_in]
    stops = [*starts[1:], max(-(-int(owned_in[-1][1]) // jump), m)]
    for rank, (a, b) in enumerate(zip(starts, stops, strict=True)):
        if a >= b or a >= m:
            raise ConfigError(
                f"outputs of {geom} along {axis} ({m} outputs, {len(starts)} tiles)",
                f"rank {rank} with input tile {tuple(owned_in[rank])} would own no output "
                f"(outputs [{a}, {min(b, m)}))",
                f"use fewer tiles along {axis} (each must own one of the {m} outputs) "
                f"with input tiles aligned to the stride {jump}",
            )
    return tuple(Span(a, b) for a, b in zip(starts, stops, strict=True))


@dataclass(frozen=True)
class Halo1D:
    """One rank on one axis for one layer (or chain), in global input/output indices.

    ``halo``: pixels of the image beyond the owned data that the rank must
    receive, ``(left, right)``; negative = surplus owned data to slice away.
    ``pad``: needed indices outside ``[0, n)``, made as global padding.
    ``surplus``: ``max(0, -halo)`` per side.
    """

    n: int
    out: Span
    owned: Span
    need: Span
    halo: tuple[int, int]
    pad: tuple[int, int]
    surplus: tuple[int, int]

    @property
    def data(self) -> Span:
        """Owned indices that are image data: ``owned`` clipped to ``[0, n)``."""
        return self.owned.intersect((0, self.n))

    @property
    def own(self) -> Span:
        """Needed indices the rank already holds: ``need`` and ``data`` both."""
        return self.need.intersect(self.data)


def halo_1d(n: int, geom: Footprint, out: tuple[int, int], owned: tuple[int, int]) -> Halo1D:
    """Halo, global padding and surplus of a tile owning inputs ``owned`` and outputs ``out``.

    Identity: ``need.size == sum(pad) + sum(halo) + data.size``.
    """
    out_span, owned_span = Span(*out), Span(*owned)
    need = geom.need(out_span)
    data = owned_span.intersect((0, n))
    # Image indices needed beyond the data, minus owned data not needed, per side.
    # Counting both (rather than subtracting ends) keeps the meaning when the
    # need and the data do not overlap, which a large padding can cause.
    before = max(0, min(need.stop, data.start) - max(need.start, 0))
    after = max(0, min(need.stop, n) - max(need.start, data.stop))
    surplus = (
        max(0, min(need.start, data.stop) - data.start),
        max(0, data.stop - max(need.stop, data.start)),
    )
    halo = (before - surplus[0], after - surplus[1])
    pad = (min(need.size, max(0, -need.start)), min(need.size, max(0, need.stop - n)))
    return Halo1D(n, out_span, owned_span, need, halo, pad, surplus)


@dataclass(frozen=True)
class Decomp1D:
    """All ranks of one axis through one layer: tiles, halos, and who sends what to whom."""

    n: int
    m: int
    geom: Footprint
    tiles: tuple[Halo1D, ...]

    @property
    def parts(self) -> int:
        """Number of tiles (ranks) on this axis."""
        return len(self.tiles)

    @property
    def owned_in(self) -> tuple[Span, ...]:
        """Input tile of each rank."""
        return tuple(t.owned for t in self.tiles)

    @property
    def owned_out(self) -> tuple[Span, ...]:
        """Output tile of each rank."""
        return tuple(t.out for t in self.tiles)

    def recv(self, rank: int, peer: int) -> Span:
        """What ``rank`` needs of ``peer``'s data (``peer == rank``: what it holds itself)."""
        return self.tiles[rank].need.intersect(self.tiles[peer].data)

    def recvs(self, rank: int) -> tuple[tuple[int, Span], ...]:
        """Non-empty ``(peer, span)`` that ``rank`` receives, any peer (not only neighbours)."""
        spans = ((q, self.recv(rank, q)) for q in range(self.parts) if q != rank)
        return tuple((q, s) for q, s in spans if not s.empty)

    def sends(self, rank: int) -> tuple[tuple[int, Span], ...]:
        """Non-empty ``(peer, span)`` that ``rank`` sends: the transpose of :meth:`recvs`."""
        spans = ((q, self.recv(q, rank)) for q in range(self.parts) if q != rank)
        return tuple((q, s) for q, s in spans if not s.empty)


def decompose(
    n: int,
    geom: Footprint,
    parts: int | None = None,
    *,
    align: int = 1,
    owned_in: Sequence[tuple[int, int]] | None = None,
    owned_out: Sequence[tuple[int, int]] | None = None,
    axis: str = "axis",
) -> Decomp1D:
    """Decompose one axis of length ``n`` through ``geom`` for all ranks.

    Input tiles: ``owned_in`` if given, else ``split(n, parts, align=align)``.
    Output tiles: ``owned_out`` if given (any partition of the outputs, e.g. from
    :func:`split_balanced`), else :func:`owned_outputs` (the ownership rule).
    """
    if owned_in is None:
        if parts is None:
            raise ConfigError(
                f"decomposition of {axis}",
                "neither parts nor owned_in given",
                "give the number of tiles or the input tiles",
            )
        spans_in = split(n, parts, align=align, axis=axis)
    else:
        spans_in = check_partition(owned_in, n, f"input tiles along {axis} (length {n})")
    m = geom.out_length(n)
    if owned_out is None:
        spans_out = owned_outputs(spans_in, geom, m, axis=axis)
    else:
        spans_out = check_partition(owned_out, m, f"output tiles along {axis} (length {m})")
        if len(spans_out) != len(spans_in):
            raise ConfigError(
                f"decomposition of {axis}",
                f"{len(spans_in)} input tiles but {len(spans_out)} output tiles",
                "give one output tile per input tile",
            )
    tiles = tuple(halo_1d(n, geom, o, i) for i, o in zip(spans_in, spans_out, strict=True))
    return Decomp1D(n, m, geom, tiles)


@dataclass(frozen=True)
class TilePlan:
    """Rank ``(i, j)`` of a ``(gy, gx)`` grid through one layer (or chain), in global pixels.

    The rank builds its extended input of shape ``need.shape`` as: global padding
    everywhere, then ``own`` copied from its tile, then each ``recvs`` box from
    its peer. Those boxes tile ``need`` clipped to the image with no overlap.
    ``halo``, ``pad`` and ``surplus`` are ``(top, bottom, left, right)``.
    """

    rank: int
    coord: tuple[int, int]
    owned_in: Box
    data_in: Box
    owned_out: Box
    data_out: Box
    need: Box
    own: Box
    halo: tuple[int, int, int, int]
    pad: tuple[int, int, int, int]
    surplus: tuple[int, int, int, int]
    recvs: tuple[tuple[int, Box], ...]
    sends: tuple[tuple[int, Box], ...]


@dataclass(frozen=True)
class GridPlan:
    """Every rank of a ``(gy, gx)`` grid through one layer; ``tiles[rank]``, row-major."""

    grid: tuple[int, int]
    size: tuple[int, int]
    out_size: tuple[int, int]
    y: Decomp1D
    x: Decomp1D
    tiles: tuple[TilePlan, ...]

    def rank(self, i: int, j: int) -> int:
        """Row-major rank of grid cell ``(i, j)``."""
        return i * self.grid[1] + j

    def tile(self, rank: int) -> TilePlan:
        """Plan of ``rank``."""
        return self.tiles[rank]


def _tile_plan(y: Decomp1D, x: Decomp1D, i: int, j: int) -> TilePlan:
    gx = x.parts
    ty, tx = y.tiles[i], x.tiles[j]
    recvs: list[tuple[int, Box]] = []
    sends: list[tuple[int, Box]] = []
    # The product of the 1-D partitions reaches any rank, corners and ranks
    # beyond the nearest ones included, so halos wider than a tile need no case.
    for a in range(y.parts):
        recv_y, send_y = y.recv(i, a), y.recv(a, i)
        for b in range(gx):
            if (a, b) == (i, j):
                continue
            recv, send = Box(recv_y, x.recv(j, b)), Box(send_y, x.recv(b, j))
            if not recv.empty:
                recvs.append((a * gx + b, recv))
            if not send.empty:
                sends.append((a * gx + b, send))
    return TilePlan(
        rank=i * gx + j,
        coord=(i, j),
        owned_in=Box(ty.owned, tx.owned),
        data_in=Box(ty.data, tx.data),
        owned_out=Box(ty.out, tx.out),
        data_out=Box(ty.out.intersect((0, y.m)), tx.out.intersect((0, x.m))),
        need=Box(ty.need, tx.need),
        own=Box(ty.own, tx.own),
        halo=(*ty.halo, *tx.halo),
        pad=(*ty.pad, *tx.pad),
        surplus=(*ty.surplus, *tx.surplus),
        recvs=tuple(recvs),
        sends=tuple(sends),
    )


def _per_axis(value: object, what: str) -> tuple[object, object]:
    if isinstance(value, tuple) and len(value) == 2:
        return (value[0], value[1])
    if isinstance(value, tuple | list):
        raise ConfigError(what, f"{value!r} has {len(value)} entries", "give one value or (y, x)")
    return (value, value)


def plan_layer(
    size: tuple[int, int],
    grid: tuple[int, int],
    layer: Footprint | tuple[Footprint, Footprint],
    *,
    align: int | tuple[int, int] = 1,
    owned_in: tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]]] | None = None,
    owned_out: tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]]] | None = None,
) -> GridPlan:
    """Plan one layer (or one deep chain) for an ``(h, w)`` image on a ``(gy, gx)`` grid.

    ``layer`` is ``(y_geom, x_geom)`` (see :func:`layer_geom`) or one geometry
    for both axes. Input tiles come from ``owned_in`` or :func:`split` with
    ``align``; output tiles from ``owned_out`` or the ownership rule.

    OK: ``plan_layer((22, 22), (2, 2), LayerGeom(3, 2, 1), align=2)``.
    Error: ``plan_layer((8, 8), (1, 8), LayerGeom(3, 2, 1))`` -> rank 1 of x owns no output.
    """
    for name, value in (("grid", grid), ("image size", size)):
        if not isinstance(value, tuple | list) or len(value) != 2:
            raise ConfigError(f"spatial plan {name}", f"{value!r} is not (y, x)", "give two values")
        for v in value:
            _check_int(f"spatial plan {name} {value!r}", name, v, 1)
    geoms = _per_axis(layer, "layer geometry")
    aligns = _per_axis(align, "tile alignment")
    ins = (None, None) if owned_in is None else owned_in
    outs = (None, None) if owned_out is None else owned_out
    y, x = (
        decompose(
            size[a],
            geoms[a],  # type: ignore[arg-type]
            grid[a],
            align=aligns[a],  # type: ignore[arg-type]
            owned_in=ins[a],
            owned_out=outs[a],
            axis="yx"[a],
        )
        for a in (0, 1)
    )
    if (y.parts, x.parts) != tuple(grid):
        raise ConfigError(
            "spatial plan",
            f"owned tiles give a {y.parts}x{x.parts} grid, not {grid[0]}x{grid[1]}",
            "give one tile per grid row and column",
        )
    tiles = tuple(_tile_plan(y, x, i, j) for i in range(grid[0]) for j in range(grid[1]))
    return GridPlan((grid[0], grid[1]), (size[0], size[1]), (y.m, x.m), y, x, tiles)


def plan_chain(
    size: tuple[int, int],
    grid: tuple[int, int],
    layers: Sequence[Footprint | tuple[Footprint, Footprint]],
    *,
    align: int | tuple[int, int] | None = None,
) -> tuple[GridPlan, ...]:
    """Plan a chain layer by layer: each layer's input tiles are the previous output tiles.

    ``align`` defaults to the total stride of the chain on each axis, so that
    every layer sees tiles aligned to its stride and equal output tiles follow.
    """
    if not layers:
        raise ConfigError("spatial chain plan", "the chain has no layer", "give at least one layer")
    pairs = [_per_axis(layer, "layer geometry") for layer in layers]
    if align is None:
        jumps = [1, 1]
        for pair in pairs:
            for a in (0, 1):
                jumps[a] *= pair[a].jump  # type: ignore[attr-defined]
        align = (jumps[0], jumps[1])
    plans = [plan_layer(size, grid, pairs[0], align=align)]  # type: ignore[arg-type]
    for pair in pairs[1:]:
        prev = plans[-1]
        plans.append(
            plan_layer(
                prev.out_size,
                grid,
                pair,  # type: ignore[arg-type]
                owned_in=(prev.y.owned_out, prev.x.owned_out),
            )
        )
    return tuple(plans)


# -- resampling: pads and interpolations of the whole image ---------------------------------


def resampled_tile(
    t_in: int,
    n_in: int,
    n_out: int,
    *,
    scales: bool,
    where: str,
    axis: str = "axis",
    tiles: int,
    align: int,
) -> int:
    """Tile length of a pad's (``scales`` False) or interpolation's output along one axis.

    A pad keeps the tile. An interpolation scales it by the size ratio rounded to
    an integer (U-Net's ``size=skip.shape`` at odd sizes: 75 from 37 is 2), so
    that the output tiles line up with the tiles of the same resolution
    elsewhere in the model (a skip connection). Where that leaves the ``tiles``
    short of the output (a non-integer scale: 1.4 rounds to 1), each grows to the
    least multiple of ``align`` that holds it. :func:`resample_1d` checks that
    the tiles hold the whole output.

    OK: ``resampled_tile(19, 37, 75, scales=True, where="up", tiles=2, align=1)`` -> 38;
    1.4x of 2 x 16 px (44 px): ``tiles=2, align=4`` -> 24 (the rounded scale's 16 hold 32).
    Error: ``resampled_tile(5, 45, 15, ..., tiles=3, align=1)`` (5 is not a multiple of 3).
    """
    if not scales or n_out == n_in:
        return t_in
    if n_out > n_in:
        t_out = t_in * round(n_out / n_in)
        if tiles * t_out >= n_out:
            return t_out
        return -(-n_out // (tiles * align)) * align
    factor = round(n_in / n_out)
    if t_in % factor:
        raise ConfigError(
            where,
            f"shrinks the {axis} {factor}-fold but its tiles are {t_in} px",
            f"pass an align that is a multiple of {factor} (spatialize(align=...))",
        )
    return t_in // factor


@dataclass(frozen=True)
class Resample1D:
    """One axis of a pad or interpolation, for one rank.

    The rank extends its tile by ``before``/``after`` halo pixels (the same on
    every rank); output ``r`` of its tile is ``(1 - weight[r]) * in[first[r]] +
    weight[r] * in[second[r]]`` in local indices of the extended tile, or
    outside the input (a pad, or past the output's end) where ``inside[r]`` is
    False.
    """

    before: int
    after: int
    first: tuple[int, ...]
    second: tuple[int, ...]
    weight: tuple[float, ...]
    inside: tuple[bool, ...]


def _taps(coord: float, n_in: int) -> tuple[int, int, float]:
    first = min(max(math.floor(coord), 0), n_in - 1)
    frac = coord - first
    return (first, first + 1, frac) if frac > 0 and first + 1 < n_in else (first, first, 0.0)


def resample_1d(
    coords: Sequence[float | None],
    n_in: int,
    t_in: int,
    t_out: int,
    tiles: int,
    rank: int,
    *,
    where: str,
    axis: str = "axis",
) -> Resample1D:
    """Plan one axis of a resampling for tile ``rank`` of ``tiles``.

    ``coords[r]`` is the input coordinate output ``r`` reads (``None``: a pad),
    over the whole image. The halo is the widest any rank needs, so that all
    exchange the same strips; it may reach the neighbouring tile only.

    OK: an upsampling by 2 (bilinear) reads 1 px beyond its tile on each side.
    Error: a flip (``coords[r] = n - 1 - r``) reads from the far tile.
    """
    n_out = len(coords)
    if tiles * t_out < n_out:
        raise ConfigError(
            where,
            f"gives {n_out} px along the {axis} but the tiles ({tiles} x {t_out} px) hold "
            f"{tiles * t_out}",
            "pad the input before the model instead, or give the tiles room: a larger align "
            "(apply_spatial(..., align=N))",
        )
    before = after = 0
    for q in range(tiles):
        for r in range(q * t_out, min((q + 1) * t_out, n_out)):
            c = coords[r]
            if c is not None:
                first, second, _ = _taps(c, n_in)
                before, after = (
                    max(before, q * t_in - first),
                    max(after, second + 1 - (q + 1) * t_in),
                )
    if tiles > 1 and max(before, after) > t_in:
        raise ConfigError(
            where,
            f"reads pixels {max(before, after)} px beyond a tile of {t_in} px along the {axis}, "
            "past its neighbour (a flip, roll or shift of the whole image)",
            "use fewer tiles along that axis, or do it on the input before the model",
        )
    origin = rank * t_in - before
    first_, second_, weight_, inside_ = [], [], [], []
    for r in range(rank * t_out, (rank + 1) * t_out):
        c = coords[r] if r < n_out else None
        if c is None:
            first, second, frac = before, before, 0.0  # any local pixel: its weight is 0
        else:
            first, second, frac = _taps(c, n_in)
            first, second = first - origin, second - origin
        first_.append(first)
        second_.append(second)
        weight_.append(frac)
        inside_.append(c is not None)
    return Resample1D(
        max(before, 0), max(after, 0), tuple(first_), tuple(second_), tuple(weight_), tuple(inside_)
    )


# -- transposed convolution -------------------------------------------------------------------


def transposed_halo(kernel: int, stride: int, padding: int, dilation: int = 1) -> tuple[int, int]:
    """Input rows before and after a tile that a transposed convolution's output tile reads.

    Output ``o`` sums ``x[i] * w[j]`` over ``i*stride - padding + j*dilation = o``;
    the output tile of an input tile ``[q*t, (q+1)*t)`` is ``[q*t*stride,
    (q+1)*t*stride)``. It reads inputs from ``floor(((k-1)*d - p) / s)`` rows
    before the tile to ``ceil(p / s)`` rows after it.

    OK: ``transposed_halo(2, 2, 0)`` -> ``(0, 0)``; ``transposed_halo(3, 2, 1)`` -> ``(0, 1)``.
    """
    before = max(0, ((kernel - 1) * dilation - padding) // stride)
    after = max(0, -(-padding // stride))
    return before, after
