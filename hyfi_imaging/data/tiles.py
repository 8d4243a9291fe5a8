"""Which region of an image each spatial rank reads: tile, halo, global padding.

Why equal tiles on a padded grid: a spatial model exchanges halos between
neighbouring tiles after every layer, and that exchange (and every strided
layer) stays simple and exact only when all tiles have the same size and every
tile offset is a multiple of the model's total stride ``align`` (J). So an
image of ``(H, W)`` is padded *once, globally* to ``(Hp, Wp)``, the smallest
multiple of ``gy·align`` (``gx·align``) that holds it, and cut into ``gy x gx``
equal tiles; a 1x1 grid is not padded. The rule is
:func:`hyfi_imaging.geometry.spans.padded_hw`, the one the engine uses, applied
by :func:`hyfi_imaging.geometry.tiles.tile_region_nd` (the N-d arithmetic that volumes
share; :func:`tile_region` spells its answer in ``(y, x, h, w)`` boxes). The
padding lies only past the bottom and right image border, where the spatial
layers mask it; the loader fills it with the background value.

A rank reads its owned tile *plus* a halo — ``(top, bottom, left, right)``,
asymmetric for strided stems (ResNet: ``(13, 10)``) — so that the first layers
can run without waiting for neighbours. Parts of the read box outside the image
are filled with background; :attr:`TileRegion.inside` says which part is real.

A halo larger than the owned tile is legal here: the loader just reads a bigger
box (from several neighbours' tiles); whether the model's halo exchange accepts
it is the exchange's concern, not the loader's.

Everything here is pure geometry plus reading helpers, so the same regions
serve the loader, the spatial layers and the tests. :func:`read_label_tile`
reads a store's label image (``hyfi-preprocess --annotations``) for a rank's
region exactly as :func:`read_tile` reads the image: same box, same halo,
background label 0 past the border, so per-pixel targets line up with the
pixels for a segmentation model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.geometry.tiles import tile_region_nd
from hyfi_imaging.io.base import SlideReader, clip_region, paste_region

__all__ = [
    "Box",
    "Halo",
    "TileRegion",
    "normalize_halo",
    "read_label_tile",
    "read_tile",
    "read_window",
    "stitch",
    "strip_halo",
    "tile_region",
    "tile_regions",
]

#: A rectangle ``(y, x, h, w)``.
Box = tuple[int, int, int, int]
#: A halo as given by users; see :func:`normalize_halo`.
Halo = int | tuple[int, int] | tuple[tuple[int, int], tuple[int, int]] | tuple[int, int, int, int]

_ArrayT = TypeVar("_ArrayT", bound=Any)


@dataclass(frozen=True)
class TileRegion:
    """What spatial rank ``(i, j)`` of a ``gy x gx`` grid owns and reads.

    Attributes:
        grid: ``(gy, gx)``.
        rank: ``(i, j)``, row-major position of this rank in the grid.
        image_hw: ``(H, W)`` of the image being tiled.
        padded_hw: ``(Hp, Wp)``, the image plus global padding, a multiple of
            ``grid · align`` along each axis (the image itself on a 1x1 grid).
        owned: ``(y, x, h, w)`` of the tile this rank owns, in image pixels.
        halo: ``(top, bottom, left, right)`` read around the owned tile.
        read: ``(y, x, h, w)`` of owned tile plus halo; may extend outside the image.
        inside: the part of ``read`` within the image, in ``read``-local
            coordinates ``(y, x, h, w)``.
    """

    grid: tuple[int, int]
    rank: tuple[int, int]
    image_hw: tuple[int, int]
    padded_hw: tuple[int, int]
    owned: Box
    halo: tuple[int, int, int, int]
    read: Box
    inside: Box

    @property
    def tile_hw(self) -> tuple[int, int]:
        """``(h, w)`` of the owned tile (equal on every rank)."""
        return self.owned[2], self.owned[3]


def normalize_halo(halo: Halo) -> tuple[int, int, int, int]:
    """Spell a halo out as ``(top, bottom, left, right)``; reject negative values.

    Accepted forms:

    * ``5``: 5 on every side;
    * ``(before, after)``: the same pair along y and x, as the halo math of a
      layer chain gives it (``(P, R - P - J)``): ResNet's stem ``(13, 10)`` is
      13 above and left, 10 below and right;
    * ``((top, bottom), (left, right))``: a pair per axis;
    * ``(top, bottom, left, right)``.

    >>> normalize_halo((13, 10))
    (13, 10, 13, 10)
    """
    h: Any = halo  # checked by hand below: user input may be any shape
    ints = (int, np.integer)
    parts: tuple[int, ...] = ()
    if isinstance(h, ints):
        parts = (int(h),) * 4
    elif isinstance(h, (tuple, list)) and len(h) == 2:
        if all(isinstance(v, ints) for v in h):
            parts = (int(h[0]), int(h[1])) * 2
        elif all(isinstance(v, (tuple, list)) and len(v) == 2 for v in h):
            parts = tuple(int(v) for pair in h for v in pair if isinstance(v, ints))
    elif isinstance(h, (tuple, list)) and len(h) == 4 and all(isinstance(v, ints) for v in h):
        parts = tuple(int(v) for v in h)
    if len(parts) != 4:
        raise ConfigError(
            f"halo {halo!r}",
            "a halo is n, (before, after), ((top, bottom), (left, right)) "
            "or (top, bottom, left, right)",
            "give non-negative integers in one of those forms",
        )
    if min(parts) < 0:
        raise ConfigError(f"halo {halo!r}", "halo sizes must be >= 0", "use non-negative halos")
    return parts[0], parts[1], parts[2], parts[3]


def _check_grid(image_hw: tuple[int, int], grid: tuple[int, int], align: int) -> None:
    if min(image_hw) < 1:
        raise ConfigError(f"image {image_hw}", "image sizes must be >= 1", "check the image")
    if len(grid) != 2 or min(grid) < 1:
        raise ConfigError(f"grid {grid}", "grid factors must be >= 1", "use a grid like (2, 2)")
    if align < 1:
        raise ConfigError(f"align {align}", "align must be >= 1", "use the model's total stride")


def tile_region(
    image_hw: tuple[int, int],
    grid: tuple[int, int],
    rank: tuple[int, int],
    *,
    halo: Halo = 0,
    align: int = 1,
) -> TileRegion:
    """The :class:`TileRegion` of rank ``(i, j)`` in a ``grid`` over ``image_hw``.

    Raises :class:`ConfigError` when the grid, rank, halo or align is invalid,
    or when some tile of the grid would lie wholly in the global padding (the
    image is too small for that many tiles at that alignment).

    >>> r = tile_region((517, 389), (2, 2), (1, 0), halo=(13, 10), align=4)
    >>> r.padded_hw, r.owned, r.read, r.inside
    ((520, 392), (260, 0, 260, 196), (247, -13, 283, 219), (0, 13, 270, 206))
    """
    image_hw = (int(image_hw[0]), int(image_hw[1]))
    grid = (int(grid[0]), int(grid[1]))
    _check_grid(image_hw, grid, align)
    i, j = int(rank[0]), int(rank[1])
    if not (0 <= i < grid[0] and 0 <= j < grid[1]):
        raise ConfigError(
            f"rank {tuple(rank)}", f"outside the grid {grid}", "use 0 <= i < gy and 0 <= j < gx"
        )
    top, bottom, left, right = normalize_halo(halo)
    # The arithmetic (padding rule, tiles, read box, its part inside) is the N-d one.
    nd = tile_region_nd(image_hw, grid, (i, j), halo=((top, bottom), (left, right)), align=align)
    padded = (nd.padded[0], nd.padded[1])
    owned = (*nd.owned.origin, *nd.owned.size)
    read = (*nd.read.origin, *nd.read.size)
    inside = (*nd.inside.origin, *nd.inside.size)
    return TileRegion(
        grid=grid,
        rank=(i, j),
        image_hw=image_hw,
        padded_hw=padded,
        owned=(owned[0], owned[1], owned[2], owned[3]),
        halo=(top, bottom, left, right),
        read=(read[0], read[1], read[2], read[3]),
        inside=(inside[0], inside[1], inside[2], inside[3]),
    )


def tile_regions(
    image_hw: tuple[int, int], grid: tuple[int, int], *, halo: Halo = 0, align: int = 1
) -> list[TileRegion]:
    """Every rank's :class:`TileRegion`, in row-major rank order."""
    return [
        tile_region(image_hw, grid, (i, j), halo=halo, align=align)
        for i in range(int(grid[0]))
        for j in range(int(grid[1]))
    ]


def read_window(
    reader: SlideReader, box: Box, *, level: int = 0, fill: float | None = None
) -> np.ndarray:
    """Read exactly ``box = (y, x, h, w)`` of ``level`` as ``(C, h, w)`` of the reader's type.

    Only the part inside the level is asked of the reader; the rest is ``fill``
    (default: the reader's background), whatever the reader itself would fill.
    """
    value = reader.background if fill is None else fill
    y, x, h, w = (int(v) for v in box)
    height, width = reader.level_dimensions[level]
    clipped = clip_region(y, x, h, w, height, width)
    if clipped is None:
        return np.full((reader.channels, h, w), value, dtype=reader.dtype)
    y0, x0, y1, x1 = clipped
    inner = reader.read_region(level, y0, x0, y1 - y0, x1 - x0)
    return paste_region(inner, y, x, h, w, clipped, value)


def read_tile(
    reader: SlideReader, region: TileRegion, *, level: int = 0, fill: float | None = None
) -> np.ndarray:
    """Read ``region.read`` (tile plus halo) as ``(C, h, w)`` of the reader's pixel type.

    Pixels outside the image (halo past the border, global padding) are ``fill``
    (default: the reader's background). The region must have been cut for the
    size of ``level``: reading a level-0 grid from level 2 is a mistake, not a
    resize, so it raises :class:`ConfigError`.
    """
    dims = tuple(int(v) for v in reader.level_dimensions[level])
    if dims != region.image_hw:
        raise ConfigError(
            f"{reader.path} level {level}",
            f"the level is {dims[0]}x{dims[1]} but the tile grid was cut for "
            f"{region.image_hw[0]}x{region.image_hw[1]}",
            "build the regions with tile_region(reader.level_dimensions[level], ...)",
        )
    return read_window(reader, region.read, level=level, fill=fill)


def read_label_tile(
    store: str | os.PathLike[str],
    region: TileRegion,
    *,
    level: int = 0,
    name: str = "annotations",
) -> np.ndarray:
    """Read the label image ``name`` of ``store`` over ``region.read`` as ``(h, w)`` uint8.

    The region is the one the image tile was read with (cut for the image's
    size at ``level``; the label image has the same levels). Pixels outside the
    image (halo past the border, global padding) are 0, the background label.

    Raises:
        SlideError: the store has no label image ``name`` (preprocess with ``--annotations``).
        ConfigError: the region was cut for another size than ``level``'s.
    """
    from hyfi_imaging.io.labels import open_labels

    with open_labels(store, name) as reader:
        return read_tile(reader, region, level=level, fill=0)[0]


def strip_halo(array: _ArrayT, region: TileRegion) -> _ArrayT:
    """The owned part of a tile read with its halo (numpy arrays and torch tensors).

    Works on any array whose last two axes are ``region.read``'s ``(h, w)``.
    """
    top, _, left, _ = region.halo
    h, w = region.tile_hw
    if tuple(array.shape[-2:]) != region.read[2:]:
        raise ValueError(
            f"tile of shape {tuple(array.shape)} does not match read box {region.read}"
        )
    return array[..., top : top + h, left : left + w]


def stitch(tiles: Sequence[np.ndarray], regions: Sequence[TileRegion]) -> np.ndarray:
    """Reassemble the whole ``(C, H, W)`` image from every rank's tile.

    Each tile is either the read box (tile plus halo: the halo is removed) or
    the owned tile alone. The global padding is cropped away. ``regions`` must
    cover every rank of one grid over one image exactly once.
    """
    if not regions or len(tiles) != len(regions):
        raise ValueError(f"stitch needs one tile per region, got {len(tiles)} and {len(regions)}")
    first = regions[0]
    ranks = sorted(r.rank for r in regions)
    expected = [(i, j) for i in range(first.grid[0]) for j in range(first.grid[1])]
    if ranks != expected or any(
        (r.grid, r.image_hw, r.padded_hw) != (first.grid, first.image_hw, first.padded_hw)
        for r in regions
    ):
        raise ValueError("stitch needs every rank of one grid over one image exactly once")
    channels = tiles[0].shape[0]
    out = np.empty((channels, *first.padded_hw), dtype=tiles[0].dtype)
    for tile, region in zip(tiles, regions, strict=True):
        owned = tile if tuple(tile.shape[-2:]) == region.tile_hw else strip_halo(tile, region)
        y, x, h, w = region.owned
        out[:, y : y + h, x : x + w] = owned
    return out[:, : first.image_hw[0], : first.image_hw[1]]
