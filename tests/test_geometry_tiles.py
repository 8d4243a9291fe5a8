"""N-d tiling arithmetic: the padding rule of parallel.geometry, partitions, halo forms."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from hyfi_imaging.data.tiles import tile_region
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.geometry.spans import padded_hw
from hyfi_imaging.geometry.tiles import BoxND, normalize_halo_nd, tile_region_nd, tile_regions_nd


@pytest.mark.parametrize("grid", [(1, 1, 1), (2, 1, 2), (3, 2, 1), (2, 2, 2)])
@pytest.mark.parametrize("align", [1, 4])
def test_owned_tiles_partition_the_padded_volume(grid: tuple[int, int, int], align: int) -> None:
    shape = (19, 26, 23)
    regions = tile_regions_nd(shape, grid, halo=((1, 2), (0, 3), (2, 0)), align=align)
    padded = regions[0].padded
    assert padded == padded_hw(shape, grid, align)  # the engine's rule, not a copy of it
    assert [r.coords for r in regions] == list(itertools.product(*(range(g) for g in grid)))
    cover = np.zeros(padded, np.int64)
    for r in regions:
        cover[r.owned.slices()] += 1
        assert all(o % align == 0 for o in r.owned.origin) or grid == (1, 1, 1)
        # The inside box is the read box clipped to the volume, in read-local coordinates.
        inside = BoxND(
            tuple(a + b for a, b in zip(r.read.origin, r.inside.origin, strict=True)), r.inside.size
        )
        assert inside == r.read.clip(shape)
    assert (cover == 1).all()


def test_2d_tile_region_is_the_nd_one() -> None:
    r2 = tile_region((517, 389), (2, 2), (1, 0), halo=(13, 10), align=4)
    nd = tile_region_nd((517, 389), (2, 2), (1, 0), halo=(13, 10), align=4)
    assert r2.padded_hw == nd.padded and r2.owned == nd.owned.flat and r2.read == nd.read.flat
    assert r2.inside == nd.inside.flat


@pytest.mark.parametrize(
    ("halo", "expected"),
    [
        (2, ((2, 2),) * 3),
        ((13, 10), ((13, 10),) * 3),
        ([(1, 2), (3, 4), (5, 6)], ((1, 2), (3, 4), (5, 6))),
        (np.int64(1), ((1, 1),) * 3),
    ],
)
def test_halo_forms(halo: Any, expected: tuple[tuple[int, int], ...]) -> None:
    assert normalize_halo_nd(halo, 3) == expected


@pytest.mark.parametrize("halo", [-1, (1, -2), (1, 2, 3), ((1, 2), (3, 4)), "3", (1.5, 2)])
def test_bad_halos_are_refused(halo: Any) -> None:
    with pytest.raises(ConfigError, match="halo"):
        normalize_halo_nd(halo, 3)


def test_bad_grids_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="one factor >= 1 per image axis"):
        tile_region_nd((8, 8, 8), (2, 2), (0, 0))
    with pytest.raises(ConfigError, match="use at most") as err:
        tile_region_nd((8, 64, 64), (3, 1, 1), (0, 0, 0), align=4)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("image", "grid", "align"),
    [
        ((777, 777), (1, 2), 32),
        ((19, 26, 23), (2, 1, 2), 4),
        ((61, 45), (2, 2), 1),
        ((9,), (3,), 1),
    ],
)
def test_tile_grid_is_the_padding_rule_cut_into_owned_tiles(
    image: tuple[int, ...], grid: tuple[int, ...], align: int
) -> None:
    from hyfi_imaging.geometry.grid import TileGrid

    tg = TileGrid.padding(image, grid, align)
    assert tg.padded == padded_hw(image, grid, align)
    cover = np.zeros(tg.padded, np.int64)
    inside = np.zeros(tg.padded, bool)
    inside[tuple(slice(0, n) for n in image)] = True
    for coords in tg.coords():
        box = tg.slices(coords)
        cover[box] += 1
        # valid: the leading indices of the tile that are image, counted pixel by pixel
        tile_inside = inside[box]
        assert tg.valid(coords) == tuple(
            int(tile_inside.any(axis=tuple(b for b in range(len(grid)) if b != a)).sum())
            for a in range(len(grid))
        )
        assert tg.owner(tg.origin(coords)) == coords
        region = tile_region_nd(image, grid, coords, align=align)
        assert region.owned == BoxND(tg.origin(coords), tg.tile)  # the loader's numbers
    assert (cover == 1).all()


def test_tile_grid_refuses_a_tile_of_padding_and_a_map_it_cannot_hold() -> None:
    from hyfi_imaging.geometry.grid import TileGrid, map_end

    with pytest.raises(ConfigError, match="leave tile 2 with nothing of the image"):
        TileGrid.padding((8, 8), (1, 3), 4)
    with pytest.raises(ConfigError, match="cannot hold it"):
        TileGrid.of_map((10, 7), (2, 2), (4, 4))
    with pytest.raises(ConfigError, match="outside the grid"):
        TileGrid.padding((8, 8), (2, 2)).origin((2, 0))
    assert TileGrid.of_map((10, 7), (2, 2), (6, 4)).valid((1, 1)) == (4, 3)
    assert map_end((10, 7), (0, 1), (6, 4)) == (10, 3)  # past the tile: the map goes on
