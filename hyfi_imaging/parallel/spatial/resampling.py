"""Pads and interpolations of the whole image, computed on a tile (``SpatialContext.resample``).

Why: the call's arguments are the whole image's (from the trace); each output
pixel reads one or two input pixels per axis, gathered after one halo exchange,
so the tile's result equals the whole image's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.functional import Resample, source_coords
from hyfi_imaging.parallel.geometry import Resample1D, resample_1d, resampled_tile
from hyfi_imaging.parallel.halo import halo_exchange
from hyfi_imaging.parallel.spatial.base import _AXES, _tail

if TYPE_CHECKING:
    from hyfi_imaging.parallel.spatial.context import SpatialContext

__all__ = ["resample"]


def _asked_tile(traced: Resample, call: Resample | None, nd: int) -> tuple[int, ...] | None:
    """The output tile an interpolation asks for at run time, when its ``size`` is a tile's
    shape (GhostNetV2: ``size=out.shape[-2:]``; it differs from the size traced on the whole
    image), else None: the tile is then derived from the sizes (:func:`resampled_tile`).

    Why: a pool that floors an odd map (3 px to 1) and an interpolation back to its size
    (1 to 3) scale the whole map by 3 but the tile (4 px to 2) by 2; the tile the call asks
    for is the one the map it meets is cut into.
    """
    if call is None or call.op != "interpolate":
        return None
    asked, whole = dict(call.options).get("size"), dict(traced.options).get("size")
    if asked is None or asked == whole:
        return None
    return (int(asked),) * nd if isinstance(asked, int) else tuple(int(v) for v in asked)


def _outer(per_dim: Sequence[Sequence[Any]], like: torch.Tensor) -> torch.Tensor:
    """The product over spatial dims of one vector per dim, shaped to broadcast on ``like``."""
    nd = len(per_dim)
    total: torch.Tensor | None = None
    for k, values in enumerate(per_dim):
        shape = [1] * nd
        shape[k] = -1
        v = torch.tensor(values, dtype=like.dtype, device=like.device).view(shape)
        total = v if total is None else total * v
    assert total is not None
    return total


def _gather(t: torch.Tensor, dim: int, axis: Resample1D, linear: bool) -> torch.Tensor:
    """Along ``dim``: ``(1 - w) * t[first] + w * t[second]``, 0 where the output reads nothing."""
    shape = [1] * t.dim()
    shape[dim] = -1
    index = torch.tensor(axis.first, device=t.device)
    inside = torch.tensor(axis.inside, dtype=t.dtype, device=t.device)
    if not linear:
        return t.index_select(dim, index) * inside.view(shape)
    weight = torch.tensor(axis.weight, dtype=t.dtype, device=t.device)
    second = torch.tensor(axis.second, device=t.device)
    return t.index_select(dim, index) * (inside * (1 - weight)).view(shape) + t.index_select(
        dim, second
    ) * (inside * weight).view(shape)


def _resample_plan(
    ctx: SpatialContext,
    res: Resample,
    name: str,
    tile_hw: tuple[int, ...],
    out_tiles: tuple[int, ...] | None = None,
) -> tuple[Resample1D, ...]:
    """Per axis, what each output pixel of this rank's tile reads; ``out_tiles``: the
    output tile asked for at run time (``size=`` a tile's shape), else derived."""
    assert ctx.image_hw is not None
    key = (name, ctx.trace_key, tile_hw, out_tiles)
    if key not in ctx._resamples:
        n_in, n_out = ctx.size_of(name), ctx.out_size_of(name)
        path, fn = name.rsplit("#", 1)[0], f"F.{res.op}"
        where = f"module {path!r} ({fn})" if path else fn
        coords = source_coords(res, n_in, n_out)
        axes = []
        for a, axis in enumerate(_AXES[ctx.nd]):
            t_out = out_tiles[a] if out_tiles is not None else resampled_tile(
                tile_hw[a], n_in[a], n_out[a], scales=res.op == "interpolate", where=where,
                axis=axis, tiles=ctx.grid[a], align=ctx.align,
            )  # fmt: skip
            if res.op == "pad" and ctx.grid[a] * t_out < n_out[a]:
                raise _no_room(ctx, where, axis, a, n_out[a], ctx.grid[a] * t_out, tile_hw[a])
            axes.append(
                resample_1d(
                    coords[a],
                    n_in[a],
                    tile_hw[a],
                    t_out,
                    ctx.grid[a],
                    ctx.tile[a],
                    where=where,
                    axis=axis,
                )
            )
        ctx._resamples[key] = tuple(axes)
    return ctx._resamples[key]


def _no_room(
    ctx: SpatialContext, where: str, axis: str, a: int, n_out: int, held: int, t_in: int
) -> ConfigError:
    """The refusal of a pad that grows the map past its tiles: the image fills its tiles
    to (nearly) the last pixel, so they have no room for what the pad adds (a TF-style
    stem: ``F.pad`` by 1, then a pool that shrinks the map back). An image smaller by
    the shortfall times the layer's jump gives the tiles that room."""
    assert ctx.image_hw is not None
    jump = ctx.tile_size(ctx.image_hw)[a] // max(t_in, 1)
    n, padded = ctx.image_hw[a], ctx.padded_size(ctx.image_hw)[a]
    short = (n_out - held) * jump
    if n - short > padded - ctx.grid[a] * ctx.align:  # a smaller image, the same tiles
        fix = f"use an image of at most {n - short} px along the {axis} (it leaves the tiles room)"
    else:  # no image size pads to tiles with room at this layer
        fix = (
            f"align tiles to a larger multiple: total_stride = {2 * ctx.align} on the model "
            f"(hyfi-train, hyfi-verify) or apply_spatial(..., align={2 * ctx.align}); tiles "
            "of that multiple leave room at some image sizes"
        )
    return ConfigError(
        where,
        f"pads the map to {n_out} px along the {axis} but its tiles ({ctx.grid[a]} x {t_in} "
        f"px) hold {held}: the {n} px image fills its tiles, leaving no room for the pad",
        fix,
    )


def resample(
    ctx: SpatialContext, x: torch.Tensor, name: str, call: Resample | None = None
) -> torch.Tensor:
    """Site ``name``'s pad or interpolation of the whole image, computed on this rank's tile.

    The call's arguments are those traced on the whole image (a ``size``
    taken from another map's shape at run time would be a tile's size).

    The tile (outside the image masked to 0) is extended by the halo the
    plan asks for (one exchange; backward returns the halo's gradient to
    its owner), then each axis gathers the one or two input pixels every
    output pixel reads and weighs them; a pad's fill is added where the
    output reads nothing. The same ops on every rank: one graph everywhere.
    """
    assert ctx.image_hw is not None
    res = ctx.traced_calls[name]  # the whole image's call
    assert isinstance(res, Resample)
    tiles = tuple(int(v) for v in x.shape[-ctx.nd :])
    plans = _resample_plan(ctx, res, name, tiles, _asked_tile(res, call, ctx.nd))
    masked = _tail(x, ctx._valid(name, tiles), 0.0)
    halo = [v for p in plans for v in (p.before, p.after)]
    y = halo_exchange(masked, halo, ctx.neighbours)
    for k, plan in enumerate(plans):
        y = _gather(y, k - ctx.nd, plan, res.linear)
    if res.value:
        inside = _outer([p.inside for p in plans], y)
        y = y + res.value * (1 - inside)
    return y
