"""VolumeDataset: every rank's tile (image and labels) stitches to the augmented volume; targets."""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path

import numpy as np
import pytest

from hyfi_imaging.data.volume_augment import VolumeAugment, augment_volume
from hyfi_imaging.data.volume_dataset import VolumeDataset
from hyfi_imaging.data.volume_manifest import read_volume_manifest
from hyfi_imaging.data.volumes import blob_volume, write_blob_cohort, write_grf_cohort
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.geometry.tiles import stitch_nd, tile_regions_nd
from hyfi_imaging.io.volume_store import VolumeStore, read_subvolume

SIDE = 16


@pytest.fixture(scope="module")
def cohorts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cohorts")
    blobs = write_blob_cohort(root / "blobs", 2, shape=SIDE, seed=1, n_blobs=5, chunks=8)
    fields = write_grf_cohort(root / "grf", 2, size=SIDE, seed=2, chunks=8)
    return blobs, fields


def test_label_tiles_of_every_rank_stitch_to_the_augmented_volume(
    cohorts: tuple[Path, Path],
) -> None:
    manifest = cohorts[0]
    grid, halo = (2, 1, 2), (1, 2)
    augment = VolumeAugment(flip=True, rot90=True)
    datasets = [
        VolumeDataset(
            manifest, grid=grid, rank=r, halo=halo, target="labels", augment=augment, seed=5
        )
        for r in itertools.product(range(2), range(1), range(2))
    ]
    regions = tile_regions_nd((SIDE,) * 3, grid, halo=halo)
    for index in range(2):
        items = [d[index] for d in datasets]
        params = datasets[0].params(index)
        image, labels, _ = blob_volume(SIDE, seed=100003 + index, n_blobs=5)
        assert all(item["image"].dtype.is_floating_point for item in items)
        images = [item["image"].numpy() for item in items]
        targets = [item["target"].numpy()[None] for item in items]
        np.testing.assert_array_equal(stitch_nd(images, regions), augment_volume(image, params))
        np.testing.assert_array_equal(
            stitch_nd(targets, regions)[0], augment_volume(labels[None], params)[0]
        )
        assert items[0]["image"].shape == (1, 8 + 3, SIDE + 3, 8 + 3)
        assert items[0]["target"].dtype.is_floating_point is False
        assert tuple(items[3]["read"].tolist()) == (7, -1, 7, 11, 19, 11)


def test_regression_targets_and_normalisation(cohorts: tuple[Path, Path]) -> None:
    manifest = cohorts[1]
    rows = read_volume_manifest(manifest)
    ds = VolumeDataset(manifest, targets=("spectral_index", "amplitude"), normalize="store")
    item = ds[1]
    assert item["target"].tolist() == pytest.approx(
        [rows[1].targets["spectral_index"], rows[1].targets["amplitude"]]
    )
    store = VolumeStore(manifest.parent / rows[1].path)
    raw = read_subvolume(store, 0, (0, 0, 0, SIDE, SIDE, SIDE))
    mean = np.asarray(store.channel_stats["mean"], np.float32)[:, None, None, None]
    std = np.asarray(store.channel_stats["std"], np.float32)[:, None, None, None]
    np.testing.assert_array_equal(item["image"].numpy(), (raw - mean) / std)
    assert item["image"].shape == (4, SIDE, SIDE, SIDE)
    fixed = VolumeDataset(manifest, normalize=((0.0,) * 4, (2.0,) * 4), level=1)
    assert fixed.target_names == ("amplitude", "spectral_index")
    assert fixed[0]["image"].shape == (4, 8, 8, 8)
    # Picklable for spawned workers, with no store inside.
    clone = pickle.loads(pickle.dumps(ds))
    assert not clone._stores and clone[1]["target"].tolist() == item["target"].tolist()


def test_configuration_errors_surface_at_construction(cohorts: tuple[Path, Path]) -> None:
    blobs, fields = cohorts
    with pytest.raises(ConfigError, match="names no label image"):
        VolumeDataset(fields, target="labels")
    with pytest.raises(ConfigError, match="has no target nope"):
        VolumeDataset(fields, targets=("nope",))
    with pytest.raises(ConfigError, match="outside the grid"):
        VolumeDataset(blobs, grid=(2, 1, 1), rank=(2, 0, 0))
    with pytest.raises(ConfigError, match="one mean and one std"):
        VolumeDataset(blobs, normalize=((0.0,), (0.0,)))


def test_volumes_without_label_images_are_read_for_prediction(cohorts: tuple[Path, Path]) -> None:
    """hyfi-predict refused to segment volumes without label images ('names no label image'),
    the usual case for prediction: read with ``truth=False``, their targets are zeros."""
    _, fields = cohorts
    ds = VolumeDataset(fields, target="labels", truth=False, grid=(1, 1, 2), rank=(0, 0, 1))
    item = ds[0]
    assert str(item["target"].dtype) == "torch.int64" and not item["target"].any()
    assert item["target"].shape == item["image"].shape[1:]


def test_a_manifest_of_one_id_twice_or_bad_voxels_is_refused(
    cohorts: tuple[Path, Path], tmp_path: Path
) -> None:
    """A volume id on two rows trained and predicted both, and one's mask overwrote the
    other's (its outputs are named by the id); voxel sizes of -1, nan or 0 were read."""
    blobs, _ = cohorts
    text = blobs.read_text().splitlines()  # the cohort's manifest.csv
    header, first, second = text[0], text[1], text[2]
    cols = header.split(",")
    twice = tmp_path / "twice.csv"
    row = second.split(",")
    row[cols.index("volume_id")] = first.split(",")[cols.index("volume_id")]
    twice.write_text("\n".join([header, first, ",".join(row)]) + "\n")
    with pytest.raises(ConfigError, match=r"twice.csv:3: volume id .* is on line 2 too"):
        read_volume_manifest(twice)
    bad = tmp_path / "voxels.csv"
    row = first.split(",")
    row[cols.index("voxel_z")] = "nan"
    bad.write_text("\n".join([header, ",".join(row)]) + "\n")
    with pytest.raises(ConfigError, match=r"voxels.csv:2: voxel size .* is not three positive"):
        read_volume_manifest(bad)
