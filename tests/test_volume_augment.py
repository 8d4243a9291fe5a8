"""Volume augmentation mapped to tiles: a tile of the augmented volume is the augmented volume's tile."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hyfi_imaging.data.orientation import Orientation
from hyfi_imaging.data.volume_augment import (
    VolumeAugment,
    VolumeAugmentParams,
    augment_volume,
    draw_volume_augment,
    read_augmented_volume,
)
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.geometry.tiles import BoxND, stitch_nd, tile_regions_nd
from hyfi_imaging.io.volume_store import VolumeStore, write_ome_zarr_volume

SIDE = 18


@pytest.fixture(scope="module")
def cube(tmp_path_factory: pytest.TempPathFactory) -> tuple[np.ndarray, VolumeStore]:
    volume = np.random.default_rng(2).standard_normal((2, SIDE, SIDE, SIDE)).astype(np.float32)
    path = tmp_path_factory.mktemp("aug") / "cube.zarr"
    write_ome_zarr_volume(path, volume, voxel_size=(1, 1, 1), chunks=8, shards=16)
    return volume, VolumeStore(path)


def _window(volume: np.ndarray, box: BoxND) -> np.ndarray:
    m = 2 * SIDE
    big = np.pad(volume, [(0, 0)] + [(m, m)] * 3)
    return big[(slice(None), *(slice(o + m, o + m + s) for o, s in zip(*box, strict=True)))]


def test_orientation_equals_numpy_for_every_flip_and_turn() -> None:
    a = np.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
    planes = [(0, 1), (0, 2), (1, 2)]
    for flips in itertools.product((False, True), repeat=3):
        for ks in itertools.product(range(4), repeat=3):
            turns = list(zip(planes, ks, strict=True))
            expected = a
            for axis, f in enumerate(flips):
                expected = np.flip(expected, 1 + axis) if f else expected
            for (p, q), k in turns:
                expected = np.rot90(expected, k, axes=(1 + p, 1 + q))
            o = Orientation.of(3, flips=flips, turns=turns)
            np.testing.assert_array_equal(o.apply(a), expected)
            assert o.out_shape(a.shape[1:]) == expected.shape[1:]
            # Every output box shows exactly its source box, oriented.
            box = BoxND((1, 0, 1), (1, 2, 2))  # inside every orientation of 3x4x5
            out = expected[(slice(None), *box.slices())]
            src = o.source_box(box, a.shape[1:])
            np.testing.assert_array_equal(o.apply(a[(slice(None), *src.slices())]), out)


def test_draws_are_global_and_fixed_order() -> None:
    config = VolumeAugment(flip=True, rot90=True)
    draws = {draw_volume_augment(config, (8, 8, 8), seed=3, epoch=1, index=i) for i in range(40)}
    assert len(draws) > 20  # varied
    a = draw_volume_augment(config, (8, 8, 8), seed=3, epoch=1, index=7)
    assert a == draw_volume_augment(config, (8, 8, 8), seed=3, epoch=1, index=7)
    # Turning rot90 off keeps the flips drawn; a restricted flip keeps the other axes' draws.
    flips_only = draw_volume_augment(VolumeAugment(flip=True), (8, 8, 8), seed=3, epoch=1, index=7)
    assert flips_only.flips == a.flips and flips_only.turns == (0, 0, 0)
    x_only = draw_volume_augment(VolumeAugment(flip=("x",)), (8, 8, 8), seed=3, epoch=1, index=7)
    assert x_only.flips == (False, False, a.flips[2])


def test_rot90_in_a_non_square_plane_is_refused() -> None:
    with pytest.raises(ConfigError, match="zy plane of a 8x6x6 volume") as err:
        draw_volume_augment(VolumeAugment(rot90=True), (8, 6, 6), seed=0, epoch=0, index=0)
    assert "\n" not in str(err.value)
    # The square yx plane of the same volume may turn.
    p = draw_volume_augment(
        VolumeAugment(flip=True, rot90=("yx",)), (8, 6, 6), seed=0, epoch=0, index=2
    )
    assert p.turns[:2] == (0, 0)
    with pytest.raises(ConfigError, match="not one of"):
        VolumeAugment(rot90=("xz",))


@pytest.mark.parametrize("index", range(6))
def test_tiles_of_the_augmented_volume_stitch_on_a_2x1x2_grid(
    cube: tuple[np.ndarray, VolumeStore], index: int
) -> None:
    volume, store = cube
    params = draw_volume_augment(
        VolumeAugment(flip=True, rot90=True), (SIDE,) * 3, seed=11, epoch=0, index=index
    )
    whole = augment_volume(volume, params)
    halo = ((2, 1), (0, 3), (1, 2))
    regions = tile_regions_nd((SIDE,) * 3, (2, 1, 2), halo=halo, align=4)
    tiles = []
    for region in regions:
        tile = read_augmented_volume(store, 0, params, region.read)
        # The rank's tile (halo, padding and all) is the augmented volume's tile.
        np.testing.assert_array_equal(tile, _window(whole, region.read))
        tiles.append(tile)
    np.testing.assert_array_equal(stitch_nd(tiles, regions), whole)


def test_identity_and_shape_checks(cube: tuple[np.ndarray, VolumeStore]) -> None:
    volume, store = cube
    params = VolumeAugmentParams((SIDE,) * 3)
    np.testing.assert_array_equal(
        read_augmented_volume(store, 0, params, (0, 0, 0, SIDE, SIDE, SIDE)), volume
    )
    with pytest.raises(ConfigError, match="was drawn for"):
        read_augmented_volume(store, 1, params, (0, 0, 0, 2, 2, 2))


def test_rot90_of_voxels_that_are_not_cubes_is_refused() -> None:
    """A quarter turn in the zy plane of 2 x 0.5 x 0.5 µm voxels stretched an object 4x along
    one axis and shrank it 4x along the other ('a cube's 24 rotations' of a cube in voxels,
    not in µm); yx turns of the same voxels are rotations."""
    with pytest.raises(ConfigError, match=r"2 µm along z and 0.5 µm along y: .* stretch") as err:
        VolumeAugment(rot90=("zy",)).check((16, 16, 16), (2.0, 0.5, 0.5))
    assert "\n" not in str(err.value)
    VolumeAugment(rot90=("yx",)).check((16, 16, 16), (2.0, 0.5, 0.5))
    VolumeAugment(rot90=True).check((16, 16, 16), (0.5, 0.502, 0.5))  # one size, rounded
