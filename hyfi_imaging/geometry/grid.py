"""One image on one grid of equal tiles: the numbers every part of the package reads.

Why one object: the loader (which pixels a rank reads), the engine's spatial context (the
tile a rank computes and where the padding starts), the junction (the tile of every stage's
grid), the planner (the tile it prices) and the per-rank plan all need the same four
numbers: the padded size, the tile, a tile's origin and how much of it is image. Each used
to divide the padded size by the grid itself; now each asks a :class:`TileGrid`, built on
the one padding rule (:func:`~.spans.padded_hw`), so they cannot disagree.

A map deeper in a network is cut on the same grid with its own tiles (a stride-2 layer's
output tiles are half the input's): :meth:`TileGrid.of_map` holds such a map without the
padding rule, and :func:`map_end` says where the map ends inside a tile.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.geometry.spans import padded_hw

__all__ = ["TileGrid", "map_end"]


def map_end(extent: Sequence[int], coords: Sequence[int], tile: Sequence[int]) -> tuple[int, ...]:
    """Per axis, where a map of ``extent`` ends in the coordinates of the tile at ``coords``
    (tiles of ``tile``): indices ``>= map_end`` of that tile, or of the tile with a border
    carried past it, are padding. It may exceed the tile (the map goes on into the next).

    OK: ``map_end((10, 7), (1, 1), (6, 4))`` -> ``(4, 3)``; ``map_end((10,), (0,), (6,))``
    -> ``(10,)``.
    """
    return tuple(int(n) - c * t for n, c, t in zip(extent, coords, tile, strict=True))


@dataclass(frozen=True)
class TileGrid:
    """An image of ``image`` pixels per axis, padded to ``padded`` and cut into ``grid``
    equal tiles of ``tile`` pixels; tile ``coords`` (row-major, last axis fastest) owns
    ``[c * t, (c + 1) * t)`` along each axis.

    OK: ``TileGrid.padding((777, 777), (1, 2), 32)`` -> padded ``(800, 832)``, tile
    ``(800, 416)``; ``.valid((0, 1))`` -> ``(777, 361)``.
    Error: ``TileGrid.padding((8, 8), (1, 3), 4)`` -> ConfigError (a tile past the image).
    """

    image: tuple[int, ...]
    grid: tuple[int, ...]
    tile: tuple[int, ...]

    @classmethod
    def padding(cls, image: Sequence[int], grid: Sequence[int], align: int = 1) -> TileGrid:
        """The image padded by the one rule (:func:`~.spans.padded_hw`: a multiple of
        ``grid x align``; a 1x1 grid is not padded) and cut into equal tiles."""
        padded = padded_hw(image, grid, align)
        return cls(
            tuple(int(n) for n in image),
            tuple(int(g) for g in grid),
            tuple(p // int(g) for p, g in zip(padded, grid, strict=True)),
        )

    @classmethod
    def of_map(cls, extent: Sequence[int], grid: Sequence[int], tile: Sequence[int]) -> TileGrid:
        """A map of ``extent`` held as ``grid`` tiles of ``tile`` (a layer's map, whose tiles
        follow from the input's through the layers, not from the padding rule)."""
        out = cls(tuple(map(int, extent)), tuple(map(int, grid)), tuple(map(int, tile)))
        if any(g * t < n for n, g, t in zip(out.image, out.grid, out.tile, strict=True)):
            raise ConfigError(
                f"map {out.image}",
                f"{out.grid} tiles of {out.tile} cannot hold it",
                "give tiles that cover the map",
            )
        return out

    @property
    def padded(self) -> tuple[int, ...]:
        """The padded size: the grid times the tile."""
        return tuple(g * t for g, t in zip(self.grid, self.tile, strict=True))

    @property
    def ndim(self) -> int:
        return len(self.grid)

    def coords(self) -> Iterator[tuple[int, ...]]:
        """Every tile's coordinates in rank order (row-major, last axis fastest)."""
        return itertools.product(*(range(g) for g in self.grid))

    def _check(self, coords: Sequence[int]) -> tuple[int, ...]:
        at = tuple(int(c) for c in coords)
        if len(at) != self.ndim or any(not 0 <= c < g for c, g in zip(at, self.grid, strict=True)):
            raise ConfigError(
                f"tile {tuple(coords)}",
                f"is outside the grid {self.grid}",
                "use 0 <= coordinate < tiles on every axis",
            )
        return at

    def origin(self, coords: Sequence[int]) -> tuple[int, ...]:
        """The first pixel the tile at ``coords`` owns, per axis."""
        return tuple(c * t for c, t in zip(self._check(coords), self.tile, strict=True))

    def slices(self, coords: Sequence[int]) -> tuple[slice, ...]:
        """The padded image's indices the tile at ``coords`` owns."""
        return tuple(slice(o, o + t) for o, t in zip(self.origin(coords), self.tile, strict=True))

    def valid(self, coords: Sequence[int]) -> tuple[int, ...]:
        """How many leading indices of the tile at ``coords`` are image, per axis."""
        ends = map_end(self.image, self._check(coords), self.tile)
        return tuple(min(t, max(0, e)) for e, t in zip(ends, self.tile, strict=True))

    def owner(self, pixel: Sequence[int]) -> tuple[int, ...]:
        """The coordinates of the tile that owns ``pixel`` (an index of the padded image)."""
        at = tuple(int(v) for v in pixel)
        if len(at) != self.ndim or any(
            not 0 <= v < p for v, p in zip(at, self.padded, strict=True)
        ):
            raise ConfigError(
                f"pixel {tuple(pixel)}",
                f"is outside the padded image {self.padded}",
                "give an index inside the padded image",
            )
        return tuple(v // t for v, t in zip(at, self.tile, strict=True))
