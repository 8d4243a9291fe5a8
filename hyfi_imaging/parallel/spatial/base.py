"""What every spatial layer shares: masking outside the image, and the window it reads.

Why one place: a tile's rows past the image end (and, with a deep halo, its
carried border) are masked by one autograd node on *every* rank
(:class:`_MaskOutside`), and a windowed layer's halo, extent and valid part are
derived once (:meth:`_SpatialMixin._window`); each layer family's file only says
what it computes on the masked tile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.geometry import LayerGeom, outgrows_tiles
from hyfi_imaging.parallel.halo import Neighbours
from hyfi_imaging.parallel.windowed import Window

if TYPE_CHECKING:
    from hyfi_imaging.parallel.spatial.context import SpatialContext

__all__: list[str] = []


#: Names of the spatial axes, outermost first, by their number.
_AXES = {1: ("length",), 2: ("height", "width"), 3: ("depth", "height", "width")}


class _MaskOutside(torch.autograd.Function):
    """Fill what lies outside rows ``[r0, r1)`` and columns ``[c0, c1)``; zero its gradient.

    The inside is the part of the image a tensor holds: a tile's rows past the
    image end (``r0 = 0``), and for a tile with a deep halo the border past the
    image start as well. One autograd node on *every* rank, tail or not.
    Backward collectives (halo exchange, BatchNorm, pooling) are issued in the
    order the autograd engine visits nodes, which follows the graph's shape;
    were the graphs to differ between ranks (a masking node only where a tail
    exists), ranks would pair up different messages of the same size and
    silently exchange garbage.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, inside: tuple[int, ...], fill: float) -> torch.Tensor:
        ctx.inside = inside
        if not _crosses(inside, x.shape):
            return x.view_as(x)
        out = x.clone()
        _fill_outside(out, inside, fill)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if _crosses(ctx.inside, grad.shape):
            grad = grad.clone()
            _fill_outside(grad, ctx.inside, 0.0)
        return grad, None, None


def _crosses(inside: tuple[int, ...], shape: torch.Size) -> bool:
    """Whether part of the last ``len(inside) // 2`` dims lies outside ``[start, stop)`` pairs."""
    nd = len(inside) // 2
    return any(inside[2 * k] > 0 or inside[2 * k + 1] < shape[k - nd] for k in range(nd))


def _fill_outside(t: torch.Tensor, inside: tuple[int, ...], fill: float) -> None:
    nd = len(inside) // 2
    for k in range(nd):
        start, stop = max(inside[2 * k], 0), max(inside[2 * k + 1], 0)
        dim = t.dim() - nd + k
        t.narrow(dim, 0, min(start, t.shape[dim])).fill_(fill)
        if stop < t.shape[dim]:
            t.narrow(dim, stop, t.shape[dim] - stop).fill_(fill)


def _tail(x: torch.Tensor, valid: Sequence[int], fill: float) -> torch.Tensor:
    """A tile with its indices ``>= valid[k]`` along spatial dim ``k`` set to ``fill``."""
    return _MaskOutside.apply(x, tuple(v for n in valid for v in (0, n)), fill)


#: No neighbour: a deep halo's later layers read the border their input carries.
_NO_NEIGHBOURS = Neighbours()
#: No carried border (a layer outside a deep-halo run).
_NO_CARRY: tuple[int, ...] = ()


class _SpatialMixin:
    """Shared by the spatial layers: where they are, their context, input masking.

    ``hyfi_carry`` is ``(input, output)`` deep halos, ``(before, after)`` per
    spatial dim each, e.g. ``(top, bottom, left, right)`` (see
    :func:`_plan_deep_halos`): the border a layer's input holds beyond its
    tile, and the border its output keeps for the next layer. Empty without
    deep halos.
    """

    hyfi_path: str
    hyfi_ctx: SpatialContext
    hyfi_geoms: tuple[LayerGeom, ...]  # window geometry (conv/pool), fixed at spatialize()
    hyfi_carry: tuple[tuple[int, ...], tuple[int, ...]] = (_NO_CARRY, _NO_CARRY)

    def _carry(self, which: int) -> tuple[int, ...]:
        """The input (0) or output (1) carried border, zeros when there is none."""
        return self.hyfi_carry[which] or (0,) * (2 * self.hyfi_ctx.nd)

    def _tile_hw(self, x: torch.Tensor) -> tuple[int, ...]:
        """The tile's size: the input less the border it carries."""
        nd, carry = self.hyfi_ctx.nd, self._carry(0)
        return tuple(int(x.shape[k - nd]) - carry[2 * k] - carry[2 * k + 1] for k in range(nd))

    def _inside(self, x: torch.Tensor) -> tuple[int, ...]:
        """``(start, stop)`` per spatial dim of ``x`` (a tile and its carried border) inside
        the input image."""
        sizes, coords = self.hyfi_ctx.size_of(self.hyfi_path), self.hyfi_ctx.tile
        carry = self._carry(0)
        out: list[int] = []
        for k, (m, i, t) in enumerate(zip(sizes, coords, self._tile_hw(x), strict=True)):
            out += [carry[2 * k] - i * t, carry[2 * k] - i * t + m]
        return tuple(out)

    def _mask(self, x: torch.Tensor, fill: float) -> torch.Tensor:
        """Set the part of the tile (and its border) outside the (true) input image to ``fill``."""
        return _MaskOutside.apply(x, self._inside(x), fill)

    def _prepare(self, x: torch.Tensor, fill: float) -> tuple[torch.Tensor, Window]:
        """The input a windowed layer computes on, and its :class:`Window`.

        A layer whose input carries a deep halo reads that border (set to
        ``fill`` outside the image, as the padding) and exchanges nothing; any
        other receives its halo -- a deep one when it starts a run.
        """
        win = self._window(x, fill)
        if any(self.hyfi_carry[0]):
            return self._mask(x, fill), win
        return x, win

    def _geoms(self) -> tuple[LayerGeom, ...]:
        """This layer's window geometry per spatial dim (fixed at spatialize(); a layer whose
        padding depends on the input's size computes it, never storing it in forward)."""
        return self.hyfi_geoms

    def _window(self, x: torch.Tensor, fill: float) -> Window:
        """Halo, extent read and valid part of this layer's tile; ConfigError when untileable."""
        ctx = self.hyfi_ctx
        geoms = self._geoms()
        tiles_hw = self._tile_hw(x)
        carry_in, carry_out = self.hyfi_carry[0], self._carry(1)
        tiles, outs = ctx.grid, ctx.out_size_of(self.hyfi_path)
        halo: list[int] = []
        need: list[int] = []
        for a, (g, t, axis, n_tiles, m) in enumerate(
            zip(geoms, tiles_hw, _AXES[ctx.nd], tiles, outs, strict=True)
        ):
            if t % g.stride:
                raise ConfigError(
                    self.hyfi_path,
                    f"the tile {axis} {t} is not a multiple of the stride {g.stride}",
                    "align tiles to the model's total stride (SpatialContext.align)",
                )
            if m > (t // g.stride) * n_tiles:
                # ceil_mode with padding adds an output past the padded image (e.g. 3x3/s2/p1 on even sizes).
                held = "x".join(
                    str(tt // gg.stride * n)
                    for tt, gg, n in zip(tiles_hw, geoms, tiles, strict=True)
                )
                raise outgrows_tiles(self.hyfi_path, self, "x".join(map(str, outs)), held)
            # Rows read around the tile for outputs that keep the border carry_out.
            ob, oa = carry_out[2 * a], carry_out[2 * a + 1]
            before, after = g.halo((ob, oa), surplus=True)
            deep = " (a deep halo: use a smaller halo_depth)" if any(carry_out) else ""
            # With one tile along an axis the halo is all global padding: any width works.
            if max(before, after) > t and n_tiles > 1 and not any(carry_in):
                raise ConfigError(
                    self.hyfi_path,
                    f"needs a halo of {max(before, after)} px but tiles are only {t} px along "
                    f"the {axis}{deep}",
                    "use fewer tiles along that axis or a larger image"
                    + (", or a smaller halo_depth" if deep else ""),
                )
            # A negative halo (surplus) needs no data: the windows read less than the tile.
            halo += [before, max(after, 0)]
            need.append(before + t + after)
        kernel = tuple(g.kernel for g in geoms)
        stride = tuple(g.stride for g in geoms)
        dilation = tuple(g.dilation for g in geoms)
        if any(carry_in):
            # The border is already there (it is the input's carried halo): nothing to receive.
            if tuple(halo) != carry_in:
                raise RuntimeError(
                    f"{self.hyfi_path}: input carries the halo {carry_in}, the layer reads {tuple(halo)}"
                )
            return Window(
                halo=(0,) * len(halo),
                need=tuple(need),
                valid=tuple(int(v) for v in x.shape[-ctx.nd :]),
                fill=fill,
                neighbours=_NO_NEIGHBOURS,
                kernel=kernel,
                stride=stride,
                dilation=dilation,
            )
        return Window(
            halo=tuple(halo),
            need=tuple(need),
            valid=ctx._valid(self.hyfi_path, tiles_hw),
            fill=fill,
            neighbours=ctx.neighbours,
            kernel=kernel,
            stride=stride,
            dilation=dilation,
            overlap=ctx.overlap,
            bands=ctx.backward_bands,
        )
