"""TileDataset over real OME-Zarr stores and a real manifest: tiles, labels, workers."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from hyfi_imaging.data.augment import AugmentConfig
from hyfi_imaging.data.dataset import TileDataset, left_out_line, load_samples
from hyfi_imaging.data.tiles import Halo, stitch, tile_regions
from hyfi_imaging.errors import ConfigError, SlideError
from hyfi_imaging.io.base import SlideReader
from hyfi_imaging.io.zarr_store import ZarrReader, write_ome_zarr
from hyfi_imaging.preprocess.manifest import ManifestRow, write_manifest

SIZE = (173, 131)  # odd, not a multiple of the chunk
CLASSES = ["normal", "tumor"]
AUGMENT = AugmentConfig(
    flip=True,
    rot90=True,
    out_size=(160, 160),
    brightness=0.2,
    contrast=0.2,
    saturation=0.3,
    hue=0.1,
)


def _image(seed: int, hw: tuple[int, int] = SIZE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (3, *hw), dtype=np.uint8)


def _row(
    slide_id: str, path: str, label: str, hw: tuple[int, int], status: str = "ok"
) -> ManifestRow:
    return ManifestRow(
        slide_id, path, label, hw[0], hw[1], 0.5, status, "", f"/slides/{slide_id}.svs"
    )


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three real stores (small chunks, so tiles cross chunk and shard borders) and manifests."""
    root = tmp_path_factory.mktemp("prep")
    images = {f"s{i}": _image(i) for i in range(3)}
    for sid, img in images.items():
        write_ome_zarr(
            root / "zarr" / f"{sid}.zarr",
            img,
            mpp=0.5,
            hyfi_attrs={},
            chunk=32,
            shard=64,
            pyramid_levels=2,
        )
    rows = [
        _row("s0", "zarr/s0.zarr", "tumor", SIZE),
        _row("bad", "", "", (0, 0), status="failed"),
        _row("s1", str(root / "zarr" / "s1.zarr"), "normal", SIZE),  # absolute path
        _row("s2", "zarr/s2.zarr", "tumor", SIZE),
    ]
    write_manifest(rows, root / "manifest.csv")
    return {"root": root, "images": images}


def test_load_samples(stores: dict[str, Any]) -> None:
    root = stores["root"]
    samples = load_samples(root, classes=CLASSES)  # the directory is accepted
    assert [s.slide_id for s in samples] == ["s0", "s1", "s2"]  # the failed row is skipped
    assert [s.label for s in samples] == [1, 0, 1]
    assert all(Path(s.path).is_absolute() and Path(s.path).is_dir() for s in samples)
    assert samples[0].image_hw == SIZE
    with pytest.raises(ConfigError, match="not an integer"):
        load_samples(root / "manifest.csv")
    with pytest.raises(ConfigError, match="not one of the classes"):
        load_samples(root / "manifest.csv", classes=["normal"])
    with pytest.raises(ConfigError, match="cannot read the manifest"):
        load_samples(root / "missing.csv")


def test_left_out_line_counts_rows_not_ok(tmp_path: Path, stores: dict[str, Any]) -> None:
    """The slides load_samples leaves out are counted, with their status, in one line."""
    root = stores["root"]
    assert left_out_line(root) == (
        f"1 of 4 slides left out: status failed (see {root / 'manifest.csv'})"
    )
    store = str(root / "zarr" / "s0.zarr")
    rows = [
        _row("a", store, "1", SIZE),
        _row("b", "", "", (0, 0), status="failed"),
        _row("c", "", "", (0, 0), status="failed"),
        _row("d", "", "", (0, 0), status="pending"),
    ]
    write_manifest(rows, tmp_path / "manifest.csv")
    line = left_out_line(tmp_path / "manifest.csv")
    assert line == (
        f"3 of 4 slides left out: 2 status failed, 1 status pending (see {tmp_path / 'manifest.csv'})"
    )
    write_manifest(rows[:1], tmp_path / "manifest.csv")
    assert left_out_line(tmp_path / "manifest.csv") is None


def test_foreign_csv_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "manifest.csv").write_text("slide_id,label\na,1\n")
    with pytest.raises(ConfigError, match="not a hyfi-preprocess manifest") as err:
        TileDataset(tmp_path)
    assert "\n" not in str(err.value)


def test_integer_and_empty_labels(tmp_path: Path, stores: dict[str, Any]) -> None:
    store = str(stores["root"] / "zarr" / "s0.zarr")
    write_manifest(
        [_row("a", store, "3", SIZE), _row("b", store, "", SIZE)], tmp_path / "manifest.csv"
    )
    ds = TileDataset(tmp_path / "manifest.csv")
    assert [int(ds[i]["label"]) for i in range(2)] == [3, -1]
    write_manifest([_row("a", store, "1", SIZE, status="failed")], tmp_path / "manifest.csv")
    with pytest.raises(ConfigError, match="no slide with status ok"):
        TileDataset(tmp_path / "manifest.csv")


def test_plain_items_are_the_stored_image(stores: dict[str, Any]) -> None:
    ds = TileDataset(stores["root"] / "manifest.csv", classes=CLASSES)
    assert len(ds) == 3
    item = ds[1]
    assert item["slide_id"] == "s1" and item["index"] == 1 and int(item["label"]) == 0
    assert item["image"].dtype == torch.float32 and item["image"].shape == (3, *SIZE)
    expected = stores["images"]["s1"].astype(np.float32) / np.float32(255)
    assert torch.equal(item["image"], torch.from_numpy(expected))
    assert item["read"].tolist() == [0, 0, *SIZE] and item["inside"].tolist() == [0, 0, *SIZE]
    with pytest.raises(IndexError):
        ds[3]


def test_level_one_reads_the_pyramid(stores: dict[str, Any]) -> None:
    ds = TileDataset(
        stores["root"] / "manifest.csv", classes=CLASSES, level=1, grid=(2, 1), rank=(1, 0)
    )
    reader = ZarrReader(stores["root"] / "zarr" / "s2.zarr")
    level1 = reader.read_region(1, 0, 0, *reader.level_dimensions[1])
    assert reader.level_dimensions[1] == (87, 66)
    item = ds[2]
    y, x, h, w = item["read"].tolist()
    assert (y, x, h, w) == (44, 0, 44, 66)
    got = (item["image"].numpy() * 255).round().astype(np.uint8)
    np.testing.assert_array_equal(got[:, :43], level1[:, 44:])  # the last row is padding
    assert (got[:, 43:] == 255).all()


@pytest.mark.parametrize("halo", [0, (13, 10)])
def test_grid_of_datasets_stitches_to_whole(stores: dict[str, Any], halo: Halo) -> None:
    torch.set_num_threads(1)
    manifest = stores["root"] / "manifest.csv"
    whole = TileDataset(manifest, classes=CLASSES, augment=AUGMENT, seed=7)
    ranks = {
        (i, j): TileDataset(
            manifest,
            grid=(2, 2),
            rank=(i, j),
            halo=halo,
            align=4,
            augment=AUGMENT,
            seed=7,
            classes=CLASSES,
        )
        for i in range(2)
        for j in range(2)
    }
    regions = tile_regions((160, 160), (2, 2), halo=halo, align=4)
    for epoch in (0, 1):
        for ds in [whole, *ranks.values()]:
            ds.set_epoch(epoch)
        for index in range(len(whole)):
            ref = whole[index]["image"].numpy()
            items = [ranks[r.rank][index] for r in regions]
            for item, r in zip(items, regions, strict=True):
                assert item["read"].tolist() == list(r.read)
                assert item["inside"].tolist() == list(r.inside)
                assert int(item["label"]) == int(whole[index]["label"])
            tiles = [item["image"].numpy() for item in items]
            assert np.array_equal(stitch(tiles, regions), ref), (epoch, index)
    # The epoch matters: the same sample is augmented differently.
    whole.set_epoch(0)
    first = whole[0]["image"]
    whole.set_epoch(1)
    assert not torch.equal(first, whole[0]["image"])


def test_grid_needs_one_output_size(tmp_path: Path, stores: dict[str, Any]) -> None:
    small = tmp_path / "small.zarr"
    write_ome_zarr(small, _image(5, (120, 131)), mpp=0.5, hyfi_attrs={}, chunk=32, shard=64)
    s0 = str(stores["root"] / "zarr" / "s0.zarr")
    write_manifest(
        [_row("a", s0, "0", SIZE), _row("b", str(small), "1", (120, 131))],
        tmp_path / "manifest.csv",
    )
    manifest = tmp_path / "manifest.csv"
    ds = TileDataset(manifest)  # 1x1: each sample keeps its own size
    assert ds[1]["image"].shape == (3, 120, 131)
    with pytest.raises(ConfigError, match="output sizes"):
        TileDataset(manifest, grid=(1, 2))
    with pytest.raises(ConfigError, match="set out_size"):
        TileDataset(manifest, grid=(2, 1), augment=AugmentConfig(rot90=True))
    tiled = TileDataset(manifest, grid=(2, 2), augment=AugmentConfig(out_size=(128, 128)))
    assert tiled[1]["image"].shape == (3, 64, 64)
    with pytest.raises(ConfigError, match="nothing of the image"):
        TileDataset(manifest, grid=(7, 1), align=32, augment=AugmentConfig(out_size=(128, 128)))


def test_manifest_size_must_match_store(tmp_path: Path, stores: dict[str, Any]) -> None:
    s0 = str(stores["root"] / "zarr" / "s0.zarr")
    write_manifest([_row("a", s0, "0", (170, 131))], tmp_path / "manifest.csv")
    ds = TileDataset(tmp_path / "manifest.csv")
    with pytest.raises(SlideError, match="manifest says 170x131"):
        ds[0]


def _refuse(path: str) -> SlideReader:
    raise AssertionError(f"opened {path}")


def test_stores_open_lazily_and_never_pickle(stores: dict[str, Any]) -> None:
    manifest = stores["root"] / "manifest.csv"
    TileDataset(
        manifest, classes=CLASSES, grid=(2, 2), opener=_refuse
    )  # construction opens nothing
    ds = TileDataset(manifest, classes=CLASSES, max_open=2)
    for i in range(3):
        ds[i]
    assert len(ds._readers) == 2  # least recently used store closed
    clone = pickle.loads(pickle.dumps(ds))
    assert len(clone._readers) == 0
    assert torch.equal(clone[0]["image"], ds[0]["image"])
    ds.close()
    assert len(ds._readers) == 0


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_dataloader_workers_match_main_process(stores: dict[str, Any], context: str) -> None:
    torch.set_num_threads(1)
    ds = TileDataset(
        stores["root"] / "manifest.csv",
        classes=CLASSES,
        grid=(2, 2),
        rank=(1, 1),
        halo=(13, 10),
        align=4,
        augment=AUGMENT,
        seed=3,
    )
    ds.set_epoch(2)  # must reach the workers
    reference = list(DataLoader(ds, batch_size=2, num_workers=0))
    ds[0]  # a reader open in the parent must not travel to the workers
    loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=context)
    batches = list(loader)
    assert len(batches) == len(reference) == 2
    for got, ref in zip(batches, reference, strict=True):
        assert torch.equal(got["image"], ref["image"])
        assert torch.equal(got["label"], ref["label"]) and got["slide_id"] == ref["slide_id"]
        assert torch.equal(got["read"], ref["read"])


def test_a_manifest_with_one_slide_on_two_rows_is_refused(tmp_path: Path) -> None:
    """hyfi-predict wrote a slide's prediction twice, and training would count it twice:
    a manifest names each slide once, or is refused in one line."""
    from hyfi_imaging.data.dataset import manifest_rows
    from hyfi_imaging.preprocess.manifest import MANIFEST_COLUMNS

    manifest = tmp_path / "manifest.csv"
    row = {c: "" for c in MANIFEST_COLUMNS} | {"slide_id": "s1", "path": "s1.zarr", "status": "ok"}
    header = ",".join(MANIFEST_COLUMNS)
    line = ",".join(str(row[c]) for c in MANIFEST_COLUMNS)
    manifest.write_text(f"{header}\n{line}\n")
    assert [r.slide_id for r in manifest_rows(manifest)[1]] == ["s1"]
    manifest.write_text(f"{header}\n{line}\n{line}\n")
    with pytest.raises(ConfigError, match="slide id 's1' is on 2 rows"):
        manifest_rows(manifest)


def test_a_manifest_saved_by_a_spreadsheet_reads_as_written(tmp_path: Path) -> None:
    """Excel's "CSV UTF-8" (a byte-order mark) was 'not a hyfi-preprocess manifest (KeyError:
    'slide_id')', its trailing ,,,, row an unsafe slide id '', and a bad row after a blank
    line was named 2 lines early; a labels file's, likewise."""
    from hyfi_imaging.data.dataset import manifest_rows
    from hyfi_imaging.preprocess.manifest import MANIFEST_COLUMNS, read_labels

    manifest = tmp_path / "manifest.csv"
    row = {c: "" for c in MANIFEST_COLUMNS} | {"slide_id": "s1", "path": "s1.zarr", "status": "ok",
                                               "height": "8", "width": "8", "label": "0"}  # fmt: skip
    header = ",".join(MANIFEST_COLUMNS)
    line = ",".join(str(row[c]) for c in MANIFEST_COLUMNS)
    empty = "," * (len(MANIFEST_COLUMNS) - 1)
    manifest.write_bytes(f"\ufeff{header}\r\n{line}\r\n{empty}\r\n".encode())
    assert [r.slide_id for r in manifest_rows(manifest)[1]] == ["s1"]
    bad = line.replace("s1,s1.zarr,0,8,8", "s2,s2.zarr,0,0,8")
    manifest.write_text(f"{header}\n{line}\n\n\n{bad}\n")
    with pytest.raises(ConfigError, match=r"manifest.csv:5: "):
        load_samples(manifest, classes=["0", "1"])
    manifest.write_text("slide,path\ns1,s1.zarr\n")
    with pytest.raises(
        ConfigError, match=r"not a hyfi-preprocess manifest \(no column slide_id, label"
    ):
        manifest_rows(manifest)
    labels = tmp_path / "labels.csv"
    labels.write_text("slide_id,label\na,1\n\n\nb,\n")
    with pytest.raises(ConfigError, match=r"labels.csv:5: slide 'b' has an empty label"):
        read_labels(labels)
    # a volume manifest with a byte-order mark was taken for a slide manifest
    from hyfi_imaging.data.volume_manifest import (
        VolumeRow,
        manifest_kind,
        read_volume_manifest,
        write_volume_manifest,
    )

    volumes = write_volume_manifest(
        [VolumeRow("v", "v.zarr", (4, 4, 4), (1.0, 1.0, 1.0), {"x": 1.0}, "", "ok", "", "t")],
        tmp_path / "volumes.csv",
    )
    volumes.write_bytes(b"\xef\xbb\xbf" + volumes.read_bytes() + b",,,,,,,,,,,,\n")
    assert manifest_kind(volumes) == "volumes"
    assert [r.volume_id for r in read_volume_manifest(volumes)] == ["v"]


def test_left_out_line_counts_volumes_too(tmp_path: Path) -> None:
    """A volume manifest's failed rows were dropped by hyfi-train and hyfi-predict without a
    word ("5 volumes predicted" of 6, the failed one missing from the CSV)."""
    import csv

    from hyfi_imaging.data.volumes import write_grf_cohort

    manifest = write_grf_cohort(tmp_path / "grf", 3, size=8)
    assert left_out_line(manifest) is None
    with manifest.open(newline="") as f:
        rows = list(csv.DictReader(f))
    rows[1]["status"] = "failed"
    with manifest.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    assert left_out_line(manifest) == f"1 of 3 volumes left out: status failed (see {manifest})"


def test_a_slide_or_a_store_given_as_the_manifest_is_named(tmp_path: Path) -> None:
    """A slide given where the manifest goes was "not UTF-8 text (byte 10): save the manifest
    as UTF-8"; a preprocessed store, "cannot read the manifest ...: run hyfi-preprocess
    first", though it was. Each is named for what it is, with the command that helps."""
    import numpy as np
    import pytest
    from PIL import Image

    from hyfi_imaging.data.volume_manifest import manifest_kind
    from hyfi_imaging.errors import ConfigError

    slide = tmp_path / "s.png"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(slide)
    with pytest.raises(ConfigError, match=r"s.png: is a slide, not a manifest; convert it"):
        manifest_kind(slide)
    store = tmp_path / "s.zarr"
    store.mkdir()
    (store / "zarr.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"s.zarr: is an image store, not a manifest"):
        manifest_kind(store)
    (tmp_path / "bad.csv").write_bytes(b"slide_id\n\xff\xfe")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text"):
        manifest_kind(tmp_path / "bad.csv")
