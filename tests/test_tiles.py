"""Tile + halo geometry and reading: hand-worked tables, brute-force windows, stitching."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hyfi_imaging.data.tiles import (
    Halo,
    normalize_halo,
    read_tile,
    read_window,
    stitch,
    strip_halo,
    tile_region,
    tile_regions,
)
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.io.base import ArrayReader

GRIDS = [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (2, 3), (4, 4)]
HALOS: list[Halo] = [0, 1, (13, 10), (0, 7, 3, 0), ((2, 5), (6, 1))]


def _image(h: int, w: int, c: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (c, h, w), dtype=np.uint8)


def _window(image: np.ndarray, box: tuple[int, int, int, int], fill: int) -> np.ndarray:
    """Brute-force reference: pad the whole image generously and slice."""
    y, x, h, w = box
    m = max(abs(y), abs(x), h, w) + max(image.shape[1:])
    big = np.pad(image, ((0, 0), (m, m), (m, m)), constant_values=fill)
    return big[:, y + m : y + m + h, x + m : x + m + w]


@pytest.mark.parametrize(
    ("halo", "expected"),
    [
        (0, (0, 0, 0, 0)),
        (5, (5, 5, 5, 5)),
        ((13, 10), (13, 10, 13, 10)),
        (((1, 2), (3, 4)), (1, 2, 3, 4)),
        ((1, 2, 3, 4), (1, 2, 3, 4)),
        ([4, 0], (4, 0, 4, 0)),
        (np.int64(2), (2, 2, 2, 2)),
    ],
)
def test_normalize_halo_forms(halo: object, expected: tuple[int, int, int, int]) -> None:
    assert normalize_halo(halo) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("halo", [-1, (1, -2), (1, 2, 3), (1.5, 2), "3", ((1, 2), 3)])
def test_normalize_halo_rejects(halo: object) -> None:
    with pytest.raises(ConfigError, match="halo"):
        normalize_halo(halo)  # type: ignore[arg-type]


def test_hand_worked_regions() -> None:
    # 517 x 389 on 2x2 aligned to the ResNet stem (J=4): padded to 520 x 392.
    r = tile_region((517, 389), (2, 2), (1, 0), halo=(13, 10), align=4)
    assert r.padded_hw == (520, 392)
    assert r.owned == (260, 0, 260, 196)
    assert r.halo == (13, 10, 13, 10)
    assert r.read == (247, -13, 283, 219)
    # Rows 247..529 of which 247..516 are image; columns -13..205 of which 0..205.
    assert r.inside == (0, 13, 270, 206)
    # No alignment: padded to the grid only.
    r = tile_region((517, 389), (2, 2), (0, 1))
    assert (r.padded_hw, r.owned, r.read, r.inside) == (
        (518, 390),
        (0, 195, 259, 195),
        (0, 195, 259, 195),
        (0, 0, 259, 194),
    )
    # 3 x 1 on 100 rows with align 8: padded to 120, tiles of 40, the last has 20 image rows.
    last = tile_region((100, 50), (3, 1), (2, 0), align=8)
    assert last.owned == (80, 0, 40, 56) and last.inside == (0, 0, 20, 50)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("align", [1, 4, 32])
def test_regions_partition_padded_image(grid: tuple[int, int], align: int) -> None:
    image_hw = (517, 389)
    regions = tile_regions(image_hw, grid, halo=(13, 10), align=align)
    assert [r.rank for r in regions] == [(i, j) for i in range(grid[0]) for j in range(grid[1])]
    hp, wp = regions[0].padded_hw
    if grid == (1, 1):  # one process runs the plain model on the image as it is
        assert (hp, wp) == image_hw
    else:
        assert hp % (grid[0] * align) == 0 and wp % (grid[1] * align) == 0
        assert hp - grid[0] * align < image_hw[0] <= hp
        assert wp - grid[1] * align < image_hw[1] <= wp
    cover = np.zeros((hp, wp), dtype=np.int32)
    for r in regions:
        y, x, h, w = r.owned
        assert (h, w) == r.tile_hw == regions[0].tile_hw  # equal tiles
        assert y % align == 0 and x % align == 0
        cover[y : y + h, x : x + w] += 1
        top, bottom, left, right = r.halo
        assert r.read == (y - top, x - left, h + top + bottom, w + left + right)
        # inside is exactly where the read box meets the image.
        mask = np.zeros(r.read[2:], dtype=bool)
        ry, rx = np.meshgrid(
            np.arange(r.read[0], r.read[0] + r.read[2]),
            np.arange(r.read[1], r.read[1] + r.read[3]),
            indexing="ij",
        )
        mask = (ry >= 0) & (ry < image_hw[0]) & (rx >= 0) & (rx < image_hw[1])
        iy, ix, ih, iw = r.inside
        assert mask.sum() == ih * iw and mask[iy : iy + ih, ix : ix + iw].all()
    assert (cover == 1).all()


def test_too_many_tiles_names_the_limit() -> None:
    # 10 rows, align 4: 4 tile rows of 4 px would put row 3 (y=12..15) wholly in padding.
    with pytest.raises(ConfigError, match=r"at most 3 tiles along height") as err:
        tile_region((10, 100), (4, 1), (0, 0), align=4)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"tiles along width"):
        tile_region((100, 5), (1, 6), (0, 0))
    tile_region((10, 100), (3, 1), (2, 0), align=4)  # the limit itself is fine


@pytest.mark.parametrize(
    ("grid", "rank", "align"),
    [((0, 1), (0, 0), 1), ((2, 2), (2, 0), 1), ((2, 2), (0, -1), 1), ((1, 1), (0, 0), 0)],
)
def test_bad_grid_rank_align(grid: tuple[int, int], rank: tuple[int, int], align: int) -> None:
    with pytest.raises(ConfigError):
        tile_region((64, 64), grid, rank, align=align)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("halo", HALOS)
def test_read_tile_equals_window_and_stitches(grid: tuple[int, int], halo: Halo) -> None:
    image = _image(123, 97)
    reader = ArrayReader(image)
    regions = tile_regions((123, 97), grid, halo=halo, align=2)
    tiles = [read_tile(reader, r) for r in regions]
    for tile, r in zip(tiles, regions, strict=True):
        assert tile.dtype == np.uint8 and tile.shape == (3, *r.read[2:])
        np.testing.assert_array_equal(tile, _window(image, r.read, 255))
        owned = strip_halo(tile, r)
        assert owned.shape[1:] == r.tile_hw
    np.testing.assert_array_equal(stitch(tiles, regions), image)
    # Owned tiles alone stitch as well.
    owned_only = [strip_halo(t, r) for t, r in zip(tiles, regions, strict=True)]
    np.testing.assert_array_equal(stitch(owned_only, regions), image)


def test_halo_larger_than_tile_is_read_from_neighbours() -> None:
    image = _image(40, 36)
    regions = tile_regions((40, 36), (4, 3), halo=(25, 30))  # tiles of 10 x 12
    for r in regions:
        np.testing.assert_array_equal(
            read_tile(ArrayReader(image), r, fill=7), _window(image, r.read, 7)
        )


def test_fill_and_level_checks() -> None:
    image = _image(20, 30, c=1)
    reader = ArrayReader(image, background=200)
    r = tile_region((20, 30), (2, 2), (1, 1), halo=4)
    assert (read_tile(reader, r)[:, -4:, :] == 200).all()  # default: the reader's background
    np.testing.assert_array_equal(read_tile(reader, r, fill=3), _window(image, r.read, 3))
    np.testing.assert_array_equal(
        read_window(reader, (-50, -50, 5, 6), fill=9), np.full((1, 5, 6), 9)
    )
    with pytest.raises(ConfigError, match="level is 20x30 but the tile grid was cut for 21x30"):
        read_tile(reader, tile_region((21, 30), (1, 1), (0, 0)))


def test_strip_halo_on_tensors_and_shape_check() -> None:
    r = tile_region((50, 40), (2, 2), (0, 1), halo=(3, 2))
    t = torch.arange(2 * r.read[2] * r.read[3]).reshape(2, 1, r.read[2], r.read[3])
    owned = strip_halo(t, r)
    assert isinstance(owned, torch.Tensor) and owned.shape == (2, 1, *r.tile_hw)
    assert owned[0, 0, 0, 0] == t[0, 0, 3, 3]
    with pytest.raises(ValueError, match="does not match"):
        strip_halo(np.zeros((1, 5, 5)), r)


def test_stitch_rejects_incomplete_grids() -> None:
    regions = tile_regions((30, 30), (2, 2))
    tiles = [np.zeros((1, *r.tile_hw), np.uint8) for r in regions]
    with pytest.raises(ValueError, match="exactly once"):
        stitch(tiles[:3], regions[:3])
    with pytest.raises(ValueError, match="exactly once"):
        stitch(tiles, [regions[0], *regions[:3]])
