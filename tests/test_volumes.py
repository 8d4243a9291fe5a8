"""Synthetic volumes: the field's spectral index is recoverable, blob labels are exact, cohorts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hyfi_imaging.data.volume_manifest import read_volume_manifest
from hyfi_imaging.data.volumes import (
    blob_volume,
    fit_spectral_index,
    gaussian_random_field,
    grf_volume,
    radial_power_spectrum,
    write_blob_cohort,
    write_grf_cohort,
)
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.io.volume_store import VolumeStore, read_subvolume


@pytest.mark.parametrize(
    ("index", "amplitude", "seed"), [(1.2, 0.7, 0), (2.0, 1.0, 1), (2.8, 1.6, 2)]
)
def test_spectral_index_is_recoverable(index: float, amplitude: float, seed: int) -> None:
    field = gaussian_random_field(64, index, amplitude=amplitude, seed=seed)
    n, a = fit_spectral_index(field)
    # The fit's scatter over seeds is ~0.04 in n and ~5% in A on a 64^3 grid.
    assert n == pytest.approx(index, abs=0.15)
    assert a == pytest.approx(amplitude, rel=0.2)
    k, p = radial_power_spectrum(field)
    assert np.all(np.diff(k) > 0) and np.all(p > 0)
    assert abs(float(field.mean())) < 1e-6  # no k = 0 mode


def test_fields_are_reproducible_bit_for_bit() -> None:
    a = grf_volume(16, 2.0, amplitude=1.5, seed=4)
    b = grf_volume(16, 2.0, amplitude=1.5, seed=4)
    assert a.dtype == np.float32 and a.shape == (4, 16, 16, 16)
    assert a.tobytes() == b.tobytes()
    assert a.tobytes() != grf_volume(16, 2.0, amplitude=1.5, seed=5).tobytes()
    # Channels are the one field scaled by the linear growth 1 / (1 + z).
    np.testing.assert_array_equal(a[2], a[0] * np.float32(0.5))
    with pytest.raises(ConfigError, match="A > 0"):
        gaussian_random_field(16, 2.0, amplitude=0.0, seed=0)


def test_blob_labels_match_analytic_ellipsoids() -> None:
    shape = (24, 30, 28)
    image, labels, blobs = blob_volume(shape, seed=9, n_blobs=6, radius_range=(2.5, 7.0))
    again = blob_volume(shape, seed=9, n_blobs=6, radius_range=(2.5, 7.0))
    assert image.tobytes() == again[0].tobytes() and labels.tobytes() == again[1].tobytes()
    assert image.shape == (1, *shape) and image.dtype == np.float32 and labels.dtype == np.uint8
    # Independent membership over the whole grid: q = R^T (p - c), sum (q / r)^2 <= 1.
    points = np.indices(shape).reshape(3, -1).T.astype(np.float64)
    expected = np.zeros(len(points), np.uint8)
    margin = np.zeros(len(points), bool)
    for blob in blobs:
        q = (points - np.array(blob.center)) @ np.array(blob.rotation)
        f = ((q / np.array(blob.radii)) ** 2).sum(axis=1)
        expected[f <= 1.0] = blob.label
        margin |= np.abs(f - 1.0) < 1e-9  # a voxel centre on a surface: rounding may decide
    got = labels.reshape(-1)
    assert np.array_equal(got[~margin], expected[~margin])
    assert len(set(np.unique(got)) - {0}) >= 4  # most blobs are visible
    # Intensity: each label's voxels are its blob's intensity plus noise of 0.1.
    for blob in blobs:
        inside = image[0][labels == blob.label]
        if inside.size > 50:
            assert inside.mean() == pytest.approx(blob.intensity, abs=0.05)


def test_cohorts_write_stores_and_manifests(tmp_path: Path) -> None:
    manifest = write_grf_cohort(tmp_path / "grf", 2, size=16, seed=3, chunks=8)
    rows = read_volume_manifest(manifest)
    assert [r.volume_id for r in rows] == ["grf_000", "grf_001"]
    assert all(1.0 <= r.targets["spectral_index"] <= 3.0 for r in rows)
    assert all(0.5 <= r.targets["amplitude"] <= 2.0 for r in rows)
    store = VolumeStore(tmp_path / "grf" / rows[1].path)
    assert store.channel_names == ("z=0", "z=0.5", "z=1", "z=1.5")
    expected = grf_volume(
        16, rows[1].targets["spectral_index"], amplitude=rows[1].targets["amplitude"], seed=300010
    )
    np.testing.assert_array_equal(read_subvolume(store, 0, (0, 0, 0, 16, 16, 16)), expected)
    # The same arguments give the same manifest, byte for byte.
    again = write_grf_cohort(tmp_path / "again", 2, size=16, seed=3, chunks=8)
    assert again.read_text() == manifest.read_text()
    with pytest.raises(ConfigError, match="already holds a manifest"):
        write_grf_cohort(tmp_path / "grf", 1, size=16)

    blobs = read_volume_manifest(write_blob_cohort(tmp_path / "b", 1, shape=(16, 20, 24), chunks=8))
    assert blobs[0].labels == "blobs" and blobs[0].shape == (16, 20, 24)
    label_store = VolumeStore(tmp_path / "b" / blobs[0].path, label="blobs")
    _, labels, _ = blob_volume((16, 20, 24), seed=0)
    np.testing.assert_array_equal(read_subvolume(label_store, 0, (0, 0, 0, 16, 20, 24))[0], labels)


def test_dataset_card_names_the_generators() -> None:
    import importlib

    import yaml

    card_path = Path(__file__).resolve().parents[1] / "datasets" / "volumes-synthetic.yaml"
    card = yaml.safe_load(card_path.read_text())
    assert card["name"] == card_path.stem
    module = importlib.import_module(card["generator"].split()[0])
    assert callable(module.write_grf_cohort) and callable(module.write_blob_cohort)
    header = card["label_format"]["example"].splitlines()[0].split(",")
    assert header[:12] == card["label_format"]["columns"][:12]
