"""Tile, halo and global padding of an N-d image (2-D slides, 3-D volumes): the one place.

Why N-d: a volume is cut into a ``gz x gy x gx`` grid exactly as a slide is cut
into ``gy x gx`` tiles, and every rule of :mod:`hyfi_imaging.data.tiles` holds
per axis. So the arithmetic is written once, for any number of axes, here:

* **padding**: the image is padded once, globally, at the far end of each axis,
  to the smallest multiple of ``grid · align`` that holds it (a grid of one
  tile is not padded). The rule itself is
  :func:`hyfi_imaging.geometry.spans.padded_hw`, which the engine uses and
  which already takes any number of axes; nothing here re-derives it.
* **tiles**: equal tiles of ``padded // grid``; rank ``(i, j, ...)`` owns
  ``[i·t, (i+1)·t)`` along each axis (row-major rank order, last axis fastest).
* **halo**: a ``(before, after)`` pair per axis is read around the owned tile;
  the part of the read box outside the image is filled (zero for volumes).

:func:`hyfi_imaging.data.tiles.tile_region` (2-D) is this module's
:func:`tile_region_nd` spelled in ``(y, x, h, w)`` boxes. Everything here is
pure integer arithmetic plus numpy slicing; no store is touched.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import numpy as np

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.geometry.grid import TileGrid

__all__ = [
    "BoxND",
    "HaloND",
    "RegionND",
    "normalize_halo_nd",
    "read_box_nd",
    "stitch_nd",
    "strip_halo_nd",
    "tile_region_nd",
    "tile_regions_nd",
]

#: A halo as given by users; see :func:`normalize_halo_nd`.
HaloND = int | Sequence[int] | Sequence[Sequence[int]]

_ArrayT = TypeVar("_ArrayT", bound=Any)
_INTS = (int, np.integer)


class BoxND(NamedTuple):
    """An axis-aligned box: ``origin`` and ``size`` per axis (may reach outside the image)."""

    origin: tuple[int, ...]
    size: tuple[int, ...]

    @classmethod
    def of(cls, flat: Sequence[int]) -> BoxND:
        """A box from its flat form ``(z, y, x, d, h, w)`` (origins, then sizes)."""
        n = len(flat) // 2
        if len(flat) != 2 * n or n < 1:
            raise ConfigError(
                f"box {tuple(flat)}", "a box is its origins then its sizes", "give 2n integers"
            )
        return cls(tuple(int(v) for v in flat[:n]), tuple(int(v) for v in flat[n:]))

    @property
    def flat(self) -> tuple[int, ...]:
        """``(*origin, *size)``, e.g. ``(z, y, x, d, h, w)``."""
        return (*self.origin, *self.size)

    @property
    def stop(self) -> tuple[int, ...]:
        """The first index past the box on each axis."""
        return tuple(o + s for o, s in zip(self.origin, self.size, strict=True))

    def clip(self, shape: Sequence[int]) -> BoxND | None:
        """The part of the box inside ``[0, shape)``, or ``None`` when nothing is."""
        lo = tuple(max(o, 0) for o in self.origin)
        hi = tuple(min(e, int(n)) for e, n in zip(self.stop, shape, strict=True))
        if any(a >= b for a, b in zip(lo, hi, strict=True)):
            return None
        return BoxND(lo, tuple(b - a for a, b in zip(lo, hi, strict=True)))

    def slices(self, origin: Sequence[int] | None = None) -> tuple[slice, ...]:
        """Local slices of this box in an array whose index 0 is global ``origin``."""
        base = origin if origin is not None else (0,) * len(self.origin)
        return tuple(
            slice(o - b, o - b + s) for o, s, b in zip(self.origin, self.size, base, strict=True)
        )


@dataclass(frozen=True)
class RegionND:
    """What the rank at ``coords`` of an N-d ``grid`` owns and reads.

    Attributes:
        grid: tiles per axis, e.g. ``(gz, gy, gx)``.
        coords: this rank's position in the grid.
        shape: the image's size per axis (spatial axes only).
        padded: the image plus global padding (a multiple of ``grid · align``).
        owned: the tile this rank owns, in image coordinates.
        halo: ``(before, after)`` per axis read around the owned tile.
        read: owned tile plus halo; may extend outside the image.
        inside: the part of ``read`` within the image, in ``read``-local coordinates.
    """

    grid: tuple[int, ...]
    coords: tuple[int, ...]
    shape: tuple[int, ...]
    padded: tuple[int, ...]
    owned: BoxND
    halo: tuple[tuple[int, int], ...]
    read: BoxND
    inside: BoxND

    @property
    def tile(self) -> tuple[int, ...]:
        """Size of the owned tile (equal on every rank)."""
        return self.owned.size


def normalize_halo_nd(halo: HaloND, ndim: int) -> tuple[tuple[int, int], ...]:
    """Spell a halo out as ``(before, after)`` per axis; reject negative values.

    Accepted forms: ``n`` (every side), ``(before, after)`` (the same pair on
    every axis, as a layer chain's halo math gives it) and one pair per axis
    ``((zb, za), (yb, ya), (xb, xa))``.

    >>> normalize_halo_nd((13, 10), 3)
    ((13, 10), (13, 10), (13, 10))
    """
    h: Any = halo  # checked by hand: user input may be any shape
    pairs: tuple[tuple[int, int], ...] = ()
    if isinstance(h, _INTS):
        pairs = ((int(h), int(h)),) * ndim
    elif isinstance(h, (tuple, list)) and len(h) == 2 and all(isinstance(v, _INTS) for v in h):
        pairs = ((int(h[0]), int(h[1])),) * ndim
    elif (
        isinstance(h, (tuple, list))
        and len(h) == ndim
        and all(
            isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(v, _INTS) for v in p)
            for p in h
        )
    ):
        pairs = tuple((int(p[0]), int(p[1])) for p in h)
    if not pairs:
        raise ConfigError(
            f"halo {halo!r}",
            f"a halo of {ndim} axes is n, (before, after) or one (before, after) per axis",
            "give non-negative integers in one of those forms",
        )
    if min(min(p) for p in pairs) < 0:
        raise ConfigError(f"halo {halo!r}", "halo sizes must be >= 0", "use non-negative halos")
    return pairs


def _check(shape: tuple[int, ...], grid: tuple[int, ...], align: int) -> None:
    if min(shape) < 1:
        raise ConfigError(f"image {shape}", "image sizes must be >= 1", "check the image")
    if len(grid) != len(shape) or min(grid) < 1:
        raise ConfigError(
            f"grid {grid}",
            f"needs one factor >= 1 per image axis ({len(shape)})",
            "use a grid like " + ("(2, 2)" if len(shape) == 2 else "(1, 2, 2)"),
        )
    if align < 1:
        raise ConfigError(f"align {align}", "align must be >= 1", "use the model's total stride")


def tile_region_nd(
    shape: Sequence[int],
    grid: Sequence[int],
    coords: Sequence[int],
    *,
    halo: HaloND = 0,
    align: int = 1,
    padded: Sequence[int] | None = None,
) -> RegionND:
    """The :class:`RegionND` of the rank at ``coords`` in ``grid`` over an image of ``shape``.

    ``padded``, when given (e.g. the engine's padded size), must be what the
    padding rule gives for ``align``: the loader never invents its own.

    Raises :class:`ConfigError` for a bad grid, rank, halo or align, a grid
    that leaves a tile wholly in the padding, or a ``padded`` the rule does not give.

    >>> r = tile_region_nd((37, 517, 389), (1, 2, 2), (0, 1, 0), halo=(13, 10), align=4)
    >>> r.padded, r.owned, r.read.flat
    ((40, 520, 392), BoxND(origin=(0, 260, 0), size=(40, 260, 196)), (-13, 247, -13, 63, 283, 219))
    """
    shape_t = tuple(int(n) for n in shape)
    grid_t = tuple(int(g) for g in grid)
    _check(shape_t, grid_t, int(align))
    rank = tuple(int(c) for c in coords)
    if len(rank) != len(grid_t) or any(not 0 <= c < g for c, g in zip(rank, grid_t, strict=True)):
        raise ConfigError(
            f"rank {tuple(coords)}",
            f"outside the grid {grid_t}",
            "use 0 <= coordinate < tiles on every axis",
        )
    pairs = normalize_halo_nd(halo, len(shape_t))
    tiling = TileGrid.padding(shape_t, grid_t, int(align))
    rule = tiling.padded
    if padded is not None and tuple(int(n) for n in padded) != rule:
        raise ConfigError(
            f"padded size {tuple(padded)}",
            f"the padding rule gives {rule} for {shape_t} on grid {grid_t} with align {align}",
            "pass the model's total stride as align, or the padded size the rule gives",
        )
    tile = tiling.tile
    owned = BoxND(tiling.origin(rank), tile)
    read = BoxND(
        tuple(o - b for o, (b, _) in zip(owned.origin, pairs, strict=True)),
        tuple(t + b + a for t, (b, a) in zip(tile, pairs, strict=True)),
    )
    inside = read.clip(shape_t)
    # The padding rule leaves image voxels in every tile, so the read box always holds some.
    assert inside is not None
    local = BoxND(
        tuple(i - r for i, r in zip(inside.origin, read.origin, strict=True)), inside.size
    )
    return RegionND(grid_t, rank, shape_t, rule, owned, pairs, read, local)


def tile_regions_nd(
    shape: Sequence[int],
    grid: Sequence[int],
    *,
    halo: HaloND = 0,
    align: int = 1,
) -> list[RegionND]:
    """Every rank's :class:`RegionND`, in row-major rank order (last axis fastest)."""
    return [
        tile_region_nd(shape, grid, coords, halo=halo, align=align)
        for coords in itertools.product(*(range(int(g)) for g in grid))
    ]


def read_box_nd(
    fetch: Callable[[BoxND], np.ndarray],
    box: BoxND,
    shape: Sequence[int],
    *,
    channels: int,
    dtype: np.dtype[Any],
    fill: float,
) -> np.ndarray:
    """``(C, *box.size)``: the part of ``box`` inside ``shape`` from ``fetch``, ``fill`` elsewhere.

    ``fetch`` is asked only for the clipped box (inside the image), so a
    reader never sees coordinates outside it and reads no more than it must.
    """
    out = np.full((channels, *box.size), fill, dtype=dtype)
    clipped = box.clip(shape)
    if clipped is not None:
        out[(slice(None), *clipped.slices(box.origin))] = fetch(clipped)
    return out


def strip_halo_nd(array: _ArrayT, region: RegionND) -> _ArrayT:
    """The owned part of a tile read with its halo (numpy arrays and torch tensors).

    Works on any array whose trailing axes are ``region.read``'s size.
    """
    n = len(region.shape)
    if tuple(array.shape[-n:]) != region.read.size:
        raise ValueError(
            f"tile of shape {tuple(array.shape)} does not match read box {region.read}"
        )
    index = tuple(slice(b, b + t) for (b, _), t in zip(region.halo, region.tile, strict=True))
    return array[(Ellipsis, *index)]


def stitch_nd(tiles: Sequence[np.ndarray], regions: Sequence[RegionND]) -> np.ndarray:
    """Reassemble the whole ``(C, *shape)`` image from every rank's tile (with or without halo).

    The global padding is cropped away. ``regions`` must cover every rank of
    one grid over one image exactly once.
    """
    if not regions or len(tiles) != len(regions):
        raise ValueError(f"stitch needs one tile per region, got {len(tiles)} and {len(regions)}")
    first = regions[0]
    expected = sorted(itertools.product(*(range(g) for g in first.grid)))
    if sorted(r.coords for r in regions) != expected or any(
        (r.grid, r.shape, r.padded) != (first.grid, first.shape, first.padded) for r in regions
    ):
        raise ValueError("stitch needs every rank of one grid over one image exactly once")
    n = len(first.shape)
    out = np.empty((tiles[0].shape[0], *first.padded), dtype=tiles[0].dtype)
    for tile, region in zip(tiles, regions, strict=True):
        owned = tile if tuple(tile.shape[-n:]) == region.tile else strip_halo_nd(tile, region)
        out[(slice(None), *region.owned.slices())] = owned
    return out[(slice(None), *(slice(0, s) for s in first.shape))]
