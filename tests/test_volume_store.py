"""OME-Zarr volumes: layout and metadata, atomic writes, chunk-exact reads, tiles plus halos."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hyfi_imaging.errors import ConfigError, SlideError
from hyfi_imaging.geometry.tiles import BoxND, stitch_nd, strip_halo_nd, tile_regions_nd
from hyfi_imaging.io.volume_store import (
    VolumeStore,
    downsample_2x_nd,
    read_subvolume,
    volume_tile,
    write_ome_zarr_volume,
)

SHAPE = (19, 26, 23)  # odd, not powers of two


@pytest.fixture(scope="module")
def volume() -> np.ndarray:
    return np.random.default_rng(3).integers(0, 60000, (2, *SHAPE), dtype=np.uint16)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory, volume: np.ndarray) -> Path:
    path = tmp_path_factory.mktemp("vol") / "v.zarr"
    labels = (volume[0] % 3).astype(np.uint8)
    write_ome_zarr_volume(
        path,
        volume,
        voxel_size=(2.0, 0.5, 0.5),
        chunks=8,
        shards=16,
        channel_names=("dna", "actin"),
        labels={"cells": labels},
        attrs={"source": "test"},
    )
    return path


def _window(volume: np.ndarray, box: BoxND) -> np.ndarray:
    """Brute-force reference: pad the whole volume with zeros generously and slice."""
    m = max(max(abs(o) for o in box.origin), max(box.size)) + max(volume.shape[1:])
    big = np.pad(volume, [(0, 0)] + [(m, m)] * 3)
    return big[(slice(None), *(slice(o + m, o + m + s) for o, s in zip(*box, strict=True)))]


def test_layout_metadata_and_pyramid(store_path: Path, volume: np.ndarray) -> None:
    meta = json.loads((store_path / "zarr.json").read_text())["attributes"]
    ms = meta["ome"]["multiscales"][0]
    assert [a["name"] for a in ms["axes"]] == ["c", "z", "y", "x"]
    assert all(a["unit"] == "micrometer" for a in ms["axes"][1:])
    assert [d["coordinateTransformations"][0]["scale"] for d in ms["datasets"]] == [
        [1.0, 2.0, 0.5, 0.5],
        [1.0, 4.0, 1.0, 1.0],
        [1.0, 8.0, 2.0, 2.0],
    ]
    assert meta["hyfi"] == {"source": "test", "kind": "volume"}
    store = VolumeStore(store_path)
    assert store.shapes == (SHAPE, (10, 13, 12), (5, 7, 6))
    assert store.channel_names == ("dna", "actin") and store.dtype == np.uint16
    assert store.labels == ("cells",) and store.voxel_size == (2.0, 0.5, 0.5)
    level0 = json.loads((store_path / "0" / "zarr.json").read_text())
    assert level0["dimension_names"] == ["c", "z", "y", "x"] and level0["data_type"] == "uint16"
    # Level 1: integer mean of each 2x2x2 block, rounded half up, the odd last plane replicated.
    padded = np.pad(volume, [(0, 0), (0, 1), (0, 0), (0, 1)], mode="edge").astype(np.int64)
    blocks = padded.reshape(2, 10, 2, 13, 2, 12, 2).sum(axis=(2, 4, 6))
    np.testing.assert_array_equal(
        read_subvolume(store, 1, (0, 0, 0, 10, 13, 12)), (blocks + 4) // 8
    )
    # The label image: NGFF image-label group, nearest downsampling, uint8 kept.
    labels = VolumeStore(store_path, label="cells")
    lab_meta = json.loads((store_path / "labels" / "cells" / "zarr.json").read_text())
    assert lab_meta["attributes"]["ome"]["image-label"]["source"] == {"image": "../../"}
    assert labels.dtype == np.uint8 and labels.shapes == store.shapes
    np.testing.assert_array_equal(
        read_subvolume(labels, 1, (0, 0, 0, 10, 13, 12))[0], (volume[0] % 3)[::2, ::2, ::2]
    )


def test_float_mean_and_nearest() -> None:
    x = np.arange(2 * 4 * 4 * 4, dtype=np.float32).reshape(2, 4, 4, 4)
    mean = downsample_2x_nd(x)
    assert mean.dtype == np.float32
    np.testing.assert_allclose(mean, x.reshape(2, 2, 2, 2, 2, 2, 2).mean(axis=(2, 4, 6)))
    np.testing.assert_array_equal(downsample_2x_nd(x, method="nearest"), x[:, ::2, ::2, ::2])


class _FailingVolume(np.ndarray):
    """A volume whose second shard cannot be read, like a disk error in the middle of a write."""

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, tuple) and len(index) == 4 and index[1].start == 16:
            raise OSError("read error")
        return super().__getitem__(index)


def test_write_is_atomic_and_refuses_bad_input(tmp_path: Path, volume: np.ndarray) -> None:
    failing = volume.view(_FailingVolume)
    with pytest.raises(OSError, match="read error"):
        write_ome_zarr_volume(
            tmp_path / "f.zarr", failing, voxel_size=(1, 1, 1), chunks=8, shards=16
        )
    assert list(tmp_path.iterdir()) == []  # no store, no temporary directory
    write_ome_zarr_volume(tmp_path / "a.zarr", volume, voxel_size=(1, 1, 1), chunks=8)
    with pytest.raises(SlideError, match="already exists"):
        write_ome_zarr_volume(tmp_path / "a.zarr", volume, voxel_size=(1, 1, 1))
    with pytest.raises(ConfigError, match="not multiples of chunks"):
        write_ome_zarr_volume(
            tmp_path / "b.zarr", volume, voxel_size=(1, 1, 1), chunks=8, shards=12
        )
    with pytest.raises(ConfigError, match="not a numeric"):
        write_ome_zarr_volume(tmp_path / "b.zarr", volume[0], voxel_size=(1, 1, 1))
    with pytest.raises(ConfigError, match="integer labels"):
        write_ome_zarr_volume(
            tmp_path / "b.zarr", volume, voxel_size=(1, 1, 1), labels={"x": volume[0, :3]}
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.zarr"]
    with pytest.raises(SlideError, match="not a readable OME-Zarr volume"):
        VolumeStore(tmp_path / "a.zarr", label="absent")


def test_read_fetches_only_touched_chunks(store_path: Path, volume: np.ndarray) -> None:
    from zarr.storage import LocalStore, WrapperStore

    class CountingStore(WrapperStore[LocalStore]):
        def __init__(self, store: LocalStore) -> None:
            super().__init__(store)
            self.reads: list[tuple[str, Any]] = []

        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            if not key.endswith("zarr.json"):
                self.reads.append((key, byte_range))
            return await self._store.get(key, prototype, byte_range)

    counting = CountingStore(LocalStore(store_path, read_only=True))
    store = VolumeStore(store_path, store=counting)

    def chunk_reads(box: tuple[int, ...]) -> tuple[int, set[str]]:
        counting.reads.clear()
        b = BoxND.of(box)
        np.testing.assert_array_equal(read_subvolume(store, 0, b), _window(volume, b))
        # A partial shard: one read of its index, one range read per inner chunk.
        ranges = sum(type(r).__name__ == "RangeByteRequest" for _, r in counting.reads)
        return ranges, {k for k, _ in counting.reads}

    assert chunk_reads((1, 2, 3, 4, 4, 4)) == (1, {"0/c/0/0/0/0"})
    # Across a chunk border along z and y, inside shard (0, 0, 0): 2 x 2 x 1 of its 8 chunks.
    assert chunk_reads((6, 6, 2, 4, 4, 4)) == (4, {"0/c/0/0/0/0"})
    # Across the shard border along z, partly outside the volume along x.
    n, keys = chunk_reads((14, 0, 20, 4, 4, 8))
    assert n == 2 and keys == {"0/c/0/0/0/1", "0/c/0/1/0/1"}
    # Wholly outside: nothing is read.
    assert chunk_reads((-9, 0, 0, 4, 4, 4)) == (0, set())


GRIDS = [(2, 1, 2), (1, 2, 3), (2, 2, 2)]
HALOS: list[Any] = [0, (2, 1), ((1, 2), (3, 0), (2, 2))]


@pytest.mark.parametrize(("grid", "halo"), list(itertools.product(GRIDS, HALOS)))
def test_tiles_with_halos_stitch_to_the_volume(
    store_path: Path, volume: np.ndarray, grid: tuple[int, int, int], halo: Any
) -> None:
    store = VolumeStore(store_path)
    regions = tile_regions_nd(SHAPE, grid, halo=halo, align=2)
    tiles = [volume_tile(store, 0, grid, r.coords, halo=halo, align=2) for r in regions]
    for tile, region in zip(tiles, regions, strict=True):
        # Halos hold the neighbours' voxels and zero outside the volume (and in the padding).
        np.testing.assert_array_equal(tile, _window(volume, region.read))
        assert tile.shape == (2, *region.read.size)
    np.testing.assert_array_equal(stitch_nd(tiles, regions), volume)
    np.testing.assert_array_equal(
        stitch_nd([strip_halo_nd(t, r) for t, r in zip(tiles, regions, strict=True)], regions),
        volume,
    )


def test_halo_is_the_neighbours_owned_data(store_path: Path) -> None:
    store = VolumeStore(store_path)
    halo = ((2, 3), (0, 0), (1, 1))
    lo = volume_tile(store, 0, (2, 1, 1), (0, 0, 0), halo=halo)
    hi = volume_tile(store, 0, (2, 1, 1), (1, 0, 0), halo=halo)
    # Tiles of 10 planes: rank 0 reads planes [-2, 13), rank 1 reads [8, 23).
    assert lo.shape[1] == hi.shape[1] == 15
    np.testing.assert_array_equal(
        lo[:, 12:, :, 1:-1], strip_halo_nd(hi, _region((1, 0, 0), halo))[:, :3]
    )
    np.testing.assert_array_equal(
        hi[:, :2, :, 1:-1], strip_halo_nd(lo, _region((0, 0, 0), halo))[:, -2:]
    )
    assert not lo[:, :2].any() and not hi[:, -4:].any()  # outside the volume and the padding


def _region(coords: tuple[int, int, int], halo: Any) -> Any:
    from hyfi_imaging.geometry.tiles import tile_region_nd

    return tile_region_nd(SHAPE, (2, 1, 1), coords, halo=halo)


def test_padded_size_must_follow_the_rule(store_path: Path) -> None:
    store = VolumeStore(store_path)
    tile = volume_tile(store, 0, (2, 1, 2), (1, 0, 1), align=4, padded_size=(24, 28, 24))
    assert tile.shape == (2, 12, 28, 12)
    with pytest.raises(ConfigError, match="padding rule gives"):
        volume_tile(store, 0, (2, 1, 2), (1, 0, 1), align=1, padded_size=(24, 28, 24))
    with pytest.raises(ConfigError, match="levels 0-2"):
        volume_tile(store, 3, (1, 1, 1), (0, 0, 0))
    with pytest.raises(ConfigError, match="outside the grid"):
        volume_tile(store, 0, (1, 1, 1), (0, 1, 0))
