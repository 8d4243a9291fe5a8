"""Chunk inventories: a shard deleted from a store is refused, never read as blank background.

Stores are written by the real ``hyfi-preprocess`` code from real synthetic
slides (4 slides, 128² canvases cut into 64² shards of 32² chunks, so each
level 0 has four shards and a pyramid of three levels), then damaged the way
a disk, a sync tool or a person damages them: a shard file deleted, a shard's
bytes changed, the inventory absent (a store of an older version).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cohorts import preprocessed_cohort

from hyfi_imaging.cli.preprocess import main as preprocess_main
from hyfi_imaging.data.dataset import TileDataset
from hyfi_imaging.errors import SlideError
from hyfi_imaging.io.inventory import INVENTORY_ATTR, check_store
from hyfi_imaging.io.labels import open_labels, write_label_image
from hyfi_imaging.io.volume_store import VolumeStore, read_subvolume, write_ome_zarr_volume
from hyfi_imaging.io.zarr_store import ZarrReader, _ArraySource, write_ome_zarr
from hyfi_imaging.preprocess import PreprocessOptions, run_preprocess

REPO = Path(__file__).resolve().parents[1]
OPTIONS = PreprocessOptions(mpp=1.0, size=(128, 128), chunk=32, shard=64)


@pytest.fixture(scope="module")
def cohort(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``--out`` folder of a finished hyfi-preprocess run over 4 synthetic slides."""
    root = tmp_path_factory.mktemp("inventory")
    preprocessed_cohort(root, 4, OPTIONS, seed=4, size=(384, 384), lesions=2)
    return root


@pytest.fixture
def data(cohort: Path, tmp_path: Path) -> Path:
    """A private copy of the cohort's stores and manifest, for a test to damage."""
    return Path(shutil.copytree(cohort / "data", tmp_path / "data"))


def _attrs(group: Path) -> dict[str, Any]:
    attrs: dict[str, Any] = json.loads((group / "zarr.json").read_text())["attributes"]
    return attrs


def _level0_keys(store: Path) -> list[str]:
    return sorted(_attrs(store)[INVENTORY_ATTR]["arrays"]["0"])


def _delete_a_shard(data: Path, sid: str = "synth_001") -> tuple[Path, str]:
    """Delete a level-0 shard with tissue in it; returns the store and the key."""
    store = data / f"{sid}.zarr"
    key = _level0_keys(store)[-1]
    os.remove(store / "0" / key)
    return store, f"0/{key}"


def test_preprocess_records_every_shard_it_wrote(cohort: Path) -> None:
    store = cohort / "data" / "synth_000.zarr"
    inventory = _attrs(store)[INVENTORY_ATTR]
    assert inventory["format"] == 1 and inventory["checksum"] == "crc32"
    assert sorted(inventory["arrays"]) == ["0", "1", "2"]
    on_disk = sorted(
        p.relative_to(store / "0").as_posix() for p in (store / "0" / "c").rglob("*") if p.is_file()
    )
    assert _level0_keys(store) == on_disk and len(on_disk) == 4  # 128² in 64² shards
    check = check_store(store, checksums=True)
    assert check.status == "ok" and check.checked == sum(map(len, inventory["arrays"].values()))


def test_a_deleted_shard_is_refused_by_the_loader(data: Path) -> None:
    intact = TileDataset(data / "manifest.csv")
    store, key = _delete_a_shard(data)
    index = [s.path for s in intact.samples].index(str(store))
    with pytest.raises(SlideError) as err:
        TileDataset(data / "manifest.csv")[index]  # before inventories: a white quadrant, silently
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"{store}: chunk {key} of level 0 is missing")
    assert "re-run hyfi-preprocess for this slide" in line
    # The other slides read as before.
    other = next(i for i in range(len(intact)) if i != index)
    assert TileDataset(data / "manifest.csv")[other]["image"].shape == (3, 128, 128)


def test_each_shard_is_stat_ed_once_per_reader(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = data / "synth_000.zarr"
    calls: list[str] = []
    real = os.path.isfile

    def counting(path: Any) -> bool:
        calls.append(os.fspath(path))
        return real(path)

    monkeypatch.setattr(os.path, "isfile", counting)
    reader = ZarrReader(store)
    for _ in range(3):
        reader.read_region(0, 0, 0, 128, 128)
    assert sorted(c for c in calls if "/c/" in c) == sorted(
        os.path.join(store, "0", k) for k in _level0_keys(store)
    )


def test_verify_names_the_deleted_shard(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert preprocess_main(["--verify", str(data), "--quiet"]) == 0
    assert "4 intact, 0 damaged" in capsys.readouterr().out
    store, key = _delete_a_shard(data)
    assert preprocess_main(["--verify", str(data), "--quiet"]) == 2
    out = capsys.readouterr().out.splitlines()
    bad = [line for line in out if "BAD" in line]
    assert bad == [
        f"hyfi-preprocess: BAD {store}: chunk {key} (level 0) is missing, though the chunk "
        "inventory lists it as written; re-run hyfi-preprocess for this slide (a store with "
        "missing chunks is converted again)."
    ]
    assert "verified 4 stores" in out[-1] and "3 intact, 1 damaged" in out[-1]


def test_verify_reports_changed_bytes(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = data / "synth_002.zarr"
    key = _level0_keys(store)[0]
    shard = store / "0" / key
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one byte changed
    shard.write_bytes(bytes(raw))
    assert check_store(store).status == "ok"  # a stat cannot see it
    assert preprocess_main(["--verify", str(data), "--quiet"]) == 2
    (bad,) = [line for line in capsys.readouterr().out.splitlines() if "BAD" in line]
    assert f"chunk 0/{key} (level 0) fails its checksum" in bad
    assert bad.endswith("remove the store and re-run hyfi-preprocess for this slide.")


def test_verify_of_nothing_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert preprocess_main(["--verify", str(tmp_path), "--quiet"]) == 2
    assert "holds no OME-Zarr store" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        preprocess_main(["--verify", str(tmp_path), "slides/"])
    assert exit_.value.code == 2


def test_resume_converts_a_store_with_a_lost_shard_again(cohort: Path, data: Path) -> None:
    store, key = _delete_a_shard(data)
    summary = run_preprocess(
        [cohort / "slides"],
        data,
        OPTIONS,
        labels_path=cohort / "slides" / "labels.csv",
        progress=False,
        qc=False,
    )
    status = {r.slide_id: r.status for r in summary.results}
    assert status == {"synth_000": "skipped", "synth_001": "ok", "synth_002": "skipped",
                      "synth_003": "skipped"}  # fmt: skip
    assert (store / key).is_file() and check_store(store, checksums=True).status == "ok"


def test_an_emptied_shard_is_refused_everywhere_but_the_checksum(
    cohort: Path, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A shard truncated to 0 bytes (a failed copy, a full disk) still exists: zarr read it as
    the fill value, a white slide under its label, and ``hyfi-train --check`` and a resumed
    ``hyfi-preprocess`` took the store as whole (only ``--verify``'s checksums saw it). The
    inventory's sizes are compared on every stat now."""
    from hyfi_imaging.cli.train import main as train_main

    intact = TileDataset(data / "manifest.csv")
    store = data / "synth_001.zarr"
    key = _level0_keys(store)[-1]
    written = (store / "0" / key).stat().st_size
    (store / "0" / key).write_bytes(b"")
    index = [s.path for s in intact.samples].index(str(store))
    with pytest.raises(SlideError, match=rf"chunk 0/{key} of level 0 is 0 bytes, though .* "
                       rf"lists it as written with {written} \(truncated"):  # fmt: skip
        TileDataset(data / "manifest.csv")[index]
    assert check_store(store).status == "bad" and check_store(store).corrupt
    assert train_main(_check_args(data, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert f"chunk 0/{key} (level 0) is 0 bytes, though the chunk inventory lists it" in err
    summary = run_preprocess([cohort / "slides"], data, OPTIONS, progress=False, qc=False,
                             labels_path=cohort / "slides" / "labels.csv")  # fmt: skip
    assert {r.slide_id: r.status for r in summary.results}["synth_001"] == "ok"
    assert check_store(store, checksums=True).status == "ok"


def _check_args(data: Path, out: Path) -> list[str]:
    args = [str(REPO / "recipes" / "synthetic.yaml"), "--check"]
    for s in (
        f"data.manifest={data / 'manifest.csv'}",
        f"train.out_dir={out}",
        "model.kwargs.width=0.125",
        "parallel.spatial=1x1",
        "train.batch_size=2",
    ):
        args += ["--set", s]
    return args


def test_train_check_refuses_a_store_with_a_lost_shard(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hyfi_imaging.cli.train import main as train_main

    assert train_main(_check_args(data, tmp_path / "run")) == 0, capsys.readouterr().err
    capsys.readouterr()
    store, key = _delete_a_shard(data)
    assert train_main(_check_args(data, tmp_path / "run")) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"hyfi-train: error: {data / 'manifest.csv'}: 1 of 4 stores")
    assert f"slide synth_001: {store}: chunk {key} (level 0) is missing" in line
    assert f"hyfi-preprocess --verify {data}" in line


def test_train_check_refuses_a_missing_store(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hyfi_imaging.cli.train import main as train_main

    shutil.rmtree(data / "synth_003.zarr")
    assert train_main(_check_args(data, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    # on every launch, not only --check: a missing store failed at its first read
    assert f"1 store(s) it names do not exist (synth_003: {data / 'synth_003.zarr'})" in err


def test_train_check_refuses_a_level_the_stores_lack(
    cohort: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--check`` passed a data.level the stores do not have, and the run then called them
    damaged ("rerun hyfi-preprocess", which writes the same levels again)."""
    from hyfi_imaging.cli.train import main as train_main
    from hyfi_imaging.io.zarr_store import store_levels

    levels = store_levels(cohort / "data" / "synth_000.zarr")
    assert levels is not None
    args = [*_check_args(cohort / "data", tmp_path / "run"), "--set", f"data.level={levels}"]
    assert train_main(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"data.level: is {levels}, but 4 of 4 stores" in line, line
    assert f"choose data.level {levels - 1} or lower" in line, line


def _drop_inventory(group: Path) -> None:
    meta = json.loads((group / "zarr.json").read_text())
    del meta["attributes"][INVENTORY_ATTR]
    (group / "zarr.json").write_text(json.dumps(meta))


def test_an_older_store_without_inventory_still_reads(
    cohort: Path, data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = data / "synth_000.zarr"
    with ZarrReader(store) as reader:
        before = reader.read_region(0, 0, 0, 128, 128)
    _drop_inventory(store)
    with ZarrReader(store) as reader:
        np.testing.assert_array_equal(reader.read_region(0, 0, 0, 128, 128), before)
    assert TileDataset(data / "manifest.csv")[0]["image"].shape == (3, 128, 128)
    assert preprocess_main(["--verify", str(data), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "3 intact, 0 damaged, 1 without a chunk inventory" in out
    # And a resumed run leaves it as it is (done), rather than redoing old stores.
    summary = run_preprocess(
        [cohort / "slides"],
        data,
        OPTIONS,
        labels_path=cohort / "slides" / "labels.csv",
        progress=False,
        qc=False,
    )
    assert {r.status for r in summary.results} == {"skipped"}


def test_label_images_are_guarded_too(tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    image = np.full((3, 128, 128), 255, np.uint8)
    image[:, 40:90, 30:100] = 90
    write_ome_zarr(store, image, mpp=1.0, hyfi_attrs={}, chunk=32, shard=64)
    mask = (image[:1] < 255).astype(np.uint8)
    write_label_image(
        store, _ArraySource(mask), mpp=1.0, classes={"tumor": 1}, attrs={}, chunk=32, shard=64
    )
    key = sorted(_attrs(store / "labels" / "annotations")[INVENTORY_ATTR]["arrays"]["0"])[0]
    os.remove(store / "labels" / "annotations" / "0" / key)
    check = check_store(store, checksums=True)
    assert check.status == "bad"
    assert check.what().startswith(f"chunk labels/annotations/0/{key} (level 0) is missing")
    with open_labels(store) as labels, pytest.raises(SlideError, match=f"chunk 0/{key} of level"):
        labels.read_region(0, 0, 0, 128, 128)


def test_volumes_refuse_a_lost_shard(tmp_path: Path) -> None:
    path = tmp_path / "v.zarr"
    volume = np.random.default_rng(0).integers(1, 200, (1, 16, 16, 16), dtype=np.uint8)
    labels = {"cells": (volume[0] > 100).astype(np.uint8)}
    write_ome_zarr_volume(path, volume, voxel_size=(1, 1, 1), chunks=4, shards=8, labels=labels)
    assert check_store(path, checksums=True).status == "ok"
    np.testing.assert_array_equal(
        read_subvolume(VolumeStore(path), 0, (0, 0, 0, 16, 16, 16)), volume
    )
    os.remove(path / "0" / "c" / "0" / "1" / "0" / "1")
    os.remove(path / "labels" / "cells" / "0" / "c" / "0" / "0" / "0" / "0")
    with pytest.raises(SlideError, match=r"chunk 0/c/0/1/0/1 of level 0 is missing"):
        read_subvolume(VolumeStore(path), 0, (8, 0, 8, 8, 8, 8))
    # A box that needs only intact shards still reads.
    np.testing.assert_array_equal(
        read_subvolume(VolumeStore(path), 0, (0, 0, 0, 8, 8, 8)), volume[:, :8, :8, :8]
    )
    with pytest.raises(SlideError, match=r"label cells: chunk 0/c/0/0/0/0 of level 0"):
        read_subvolume(VolumeStore(path, label="cells"), 0, (0, 0, 0, 4, 4, 4))
    assert len(check_store(path).problems) == 2
