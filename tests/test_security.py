"""Input safety: ids that would write outside --out, checkpoints that would run code, and
images that declare more pixels than memory holds (decompression bombs).

Each test is a defect that existed: before the fix a manifest id ``../../../x`` made
``hyfi-predict`` write a whole OME-Zarr outside ``--out``, a crafted checkpoint
``.metadata`` ran its payload on load, and an 8 MB TIFF declaring 10^12 pixels drove
``hyfi-preprocess`` past 6 GB with no message.
"""

from __future__ import annotations

import io
import json
import pickle
import resource
import shutil
import struct
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hyfi_imaging.errors import ConfigError, SlideError
from hyfi_imaging.preprocess.manifest import ManifestRow, write_manifest

# --------------------------------------------------------------------------------------
# 1. Ids that name files
# --------------------------------------------------------------------------------------

UNSAFE_IDS = ["../../../evil_predict", "sub/dir/x", "..", ".", "", "a\\b", "a\x00b"]


def _manifest(path: Path, slide_id: str) -> Path:
    rows = [
        ManifestRow("fine", "fine.zarr", "0", 64, 64, None, "ok", "", "fine.tif"),
        ManifestRow(slide_id, "x.zarr", "0", 64, 64, None, "ok", "", "x.tif"),
    ]
    return write_manifest(rows, path)


def _one_line_naming(err: BaseException, *parts: str) -> None:
    text = str(err)
    assert "\n" not in text
    for part in parts:
        assert part in text, (part, text)


@pytest.mark.parametrize("slide_id", UNSAFE_IDS)
def test_slide_manifest_refuses_ids_that_are_not_plain_names(tmp_path: Path, slide_id: str) -> None:
    from hyfi_imaging.data.dataset import load_samples
    from hyfi_imaging.preprocess.manifest import read_manifest

    manifest = _manifest(tmp_path / "manifest.csv", slide_id)
    for read in (read_manifest, load_samples):
        with pytest.raises(ConfigError) as err:
            read(manifest)
        # file and row, the id, and what to do -- not "not a hyfi-preprocess manifest"
        _one_line_naming(err.value, f"{manifest}:3", repr(slide_id), "rename it to a name")


def test_labels_file_refuses_an_id_that_names_a_folder(tmp_path: Path) -> None:
    from hyfi_imaging.preprocess.manifest import read_labels

    labels = tmp_path / "labels.csv"
    labels.write_text("slide_id,label\ntumor_001,1\n..,0\n")
    with pytest.raises(ConfigError) as err:
        read_labels(labels)
    _one_line_naming(err.value, f"{labels}:3", "'..'")


@pytest.mark.parametrize("column", ["volume_id", "labels"])
def test_volume_manifest_refuses_ids_that_are_not_plain_names(tmp_path: Path, column: str) -> None:
    from hyfi_imaging.data.volume_manifest import (
        VolumeRow,
        read_volume_manifest,
        write_volume_manifest,
    )

    bad = {"volume_id": "v0", "labels": ""} | {column: "../../../evil_predict"}
    rows = [
        VolumeRow("fine", "fine.zarr", (8, 8, 8), (1.0, 1.0, 1.0)),
        VolumeRow(bad["volume_id"], "v.zarr", (8, 8, 8), (1.0, 1.0, 1.0), labels=bad["labels"]),
    ]
    manifest = write_volume_manifest(rows, tmp_path / "manifest.csv")
    with pytest.raises(ConfigError) as err:
        read_volume_manifest(manifest)
    _one_line_naming(err.value, f"{manifest}:3", "'../../../evil_predict'")


def test_hyfi_predict_refuses_a_traversing_manifest_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hyfi_imaging.cli.predict import main

    work = tmp_path / "a" / "b" / "c"
    work.mkdir(parents=True)
    manifest = _manifest(work / "manifest.csv", "../../../evil_predict")
    (work / "run").mkdir()
    assert main([str(work / "run"), "--manifest", str(manifest), "--out", str(work / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'../../../evil_predict'" in err and f"{manifest}:3" in err
    assert not list(tmp_path.rglob("evil_predict*"))


def test_mask_and_overlay_writers_refuse_a_path_that_climbs_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hyfi_imaging.io.zarr_store import write_ome_zarr
    from hyfi_imaging.train.outputs import write_mask, write_overlay

    image = tmp_path / "image.zarr"
    write_ome_zarr(image, np.full((3, 32, 32), 200, np.uint8), mpp=None, hyfi_attrs={})
    out = tmp_path / "a" / "b" / "out"
    mask = np.zeros((32, 32), np.uint8)
    with pytest.raises(ConfigError) as err:
        write_mask(
            out / "masks" / "../../../evil_predict.zarr",
            mask,
            classes=["bg", "fg"],
            image=str(image),
            scale=None,
        )
    _one_line_naming(err.value, "lies outside", str(out / "masks"))
    with pytest.raises(ConfigError):
        write_overlay(
            out / "overlays" / "../../../evil_predict.png", mask, image=str(image), title="x"
        )
    assert not list(tmp_path.rglob("evil_predict*"))
    # an output folder given with a leading '..' is the user's own
    (out.parent / "cwd").mkdir(parents=True)
    monkeypatch.chdir(out.parent / "cwd")
    written = write_mask(Path("../out/masks/ok.zarr"), mask, classes=["bg"], image="", scale=None)
    assert (out / "masks" / "ok.zarr").is_dir() and written.name == "ok.zarr"


def test_an_output_folder_with_dotdot_inside_is_normalised_not_refused() -> None:
    """``train.out_dir: runs/../x`` is ``x``: the writers only ever see a path climbing
    after a folder name when an id made it so, never hours into a run from a user's spelling."""
    from hyfi_imaging.resources import recipe_path
    from hyfi_imaging.train.config import load_recipe

    recipe = load_recipe(recipe_path("synthetic"), ["train.out_dir=runs/../x/./y"])
    assert recipe.train.out_dir == Path("x/y")


def test_a_run_id_that_climbs_never_moves_a_run_out_of_its_folder(tmp_path: Path) -> None:
    """``--restart`` moves the old run to ``previous/<run id>-<time>``; run.json is a user file."""
    import json

    from hyfi_imaging.train.rundir import start_run

    out = tmp_path / "a" / "b" / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "run.json").write_text(json.dumps({"run_id": "../../../../evil_run"}))
    with pytest.raises(ConfigError) as err:
        start_run(out, "restart")
    _one_line_naming(err.value, str(out / "run.json"), "'../../../../evil_run'")
    assert (out / "checkpoints").is_dir() and not list(tmp_path.rglob("evil_run*"))


def test_paths_built_from_ids_stay_in_their_folder(tmp_path: Path) -> None:
    from hyfi_imaging.io.labels import label_path
    from hyfi_imaging.paths import safe_id, under
    from hyfi_imaging.preprocess.convert import store_path

    assert store_path(tmp_path, "tumor_001") == tmp_path / "tumor_001.zarr"
    assert safe_id("tumor_001.v2 (scan)", where="m.csv:2") == "tumor_001.v2 (scan)"
    for build in (
        lambda: store_path(tmp_path, "../evil"),
        lambda: under(tmp_path / "qc", "../../evil.png"),
        lambda: label_path(tmp_path / "s.zarr", "../../evil"),
    ):
        with pytest.raises(ConfigError):
            build()


# --------------------------------------------------------------------------------------
# 2. Checkpoints that would run code
# --------------------------------------------------------------------------------------


class _Payload:
    """What an attacker pickles: unpickling it creates ``marker`` (open(marker, "w"))."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    return {
        "model": model.state_dict(),
        "optim": {
            "0.weight/exp_avg": torch.randn(4, 3, 3, 3).to(torch.bfloat16),
            "0.weight/step": torch.tensor(3.0),
        },
    }


def _zeros(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _zeros(v) for k, v in state.items()}
    return torch.zeros_like(state)


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A real DCP checkpoint (one process) and the state it holds."""
    import torch.distributed.checkpoint as dcp

    state = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(state, checkpoint_id=str(tmp_path / "good"))
    return tmp_path / "good", state


def _load(path: Path, into: dict[str, Any]) -> Any:
    import torch.distributed.checkpoint as dcp

    from hyfi_imaging.train.safe_reader import SafeReader

    reader = SafeReader(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dcp.load(into, storage_reader=reader)
        except BaseException:
            if reader.refused is None:
                raise
    return reader


def test_safe_reader_loads_a_real_checkpoint(checkpoint: tuple[Path, dict[str, Any]]) -> None:
    path, state = checkpoint
    into = _zeros(state)
    assert _load(path, into).refused is None
    for part in ("model", "optim"):
        for name, value in state[part].items():
            assert torch.equal(into[part][name], value), name


def test_safe_reader_loads_plain_non_tensor_values(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": torch.ones(2), "n": 3, "s": "hi"}, checkpoint_id=str(tmp_path / "c"))
    into = {"x": torch.zeros(2), "n": 0, "s": ""}
    _load(tmp_path / "c", into)
    assert into["n"] == 3 and into["s"] == "hi" and torch.equal(into["x"], torch.ones(2))


def _tampered(good: Path, name: str, change: Any) -> Path:
    """A copy of ``good`` whose metadata ``change(metadata)`` altered (written as pickle does)."""
    bad = good.parent / name
    shutil.copytree(good, bad)
    with (good / ".metadata").open("rb") as f:
        metadata = pickle.load(f)  # our own, just written
    change(metadata, bad)
    with (bad / ".metadata").open("wb") as f:
        pickle.dump(metadata, f)
    return bad


def test_metadata_with_a_reduce_payload_is_refused_and_never_run(
    checkpoint: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, state = checkpoint
    marker = tmp_path / "PWNED"
    bad = _tampered(path, "bad", lambda md, _: setattr(md, "planner_data", _Payload(marker)))
    reader = _load(bad, _zeros(state))
    assert not marker.exists()
    _one_line_naming(reader.refused, str(bad / ".metadata"), "refers to io.open")
    from hyfi_imaging.train.safe_reader import MetadataUnpickler

    with (bad / ".metadata").open("rb") as f, pytest.raises(pickle.UnpicklingError):
        MetadataUnpickler(f, bad).load()  # also what code that skips damaged checkpoints catches
    assert not marker.exists()


def test_a_value_declared_as_bytes_with_a_payload_is_refused_and_never_run(
    checkpoint: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Metadata of allowed classes only can still declare a tensor to be a pickled value,
    which DCP's planner loads with weights_only=False: the data file carries the payload."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    path, state = checkpoint
    marker = tmp_path / "PWNED"
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    fqn = "model.0.bias"

    def change(md: Any, bad: Path) -> None:
        (bad / "__9_0.distcp").write_bytes(buf.getvalue())
        md.state_dict_metadata[fqn] = BytesStorageMetadata()
        md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != fqn}
        md.storage_data[MetadataIndex(fqn)] = _StorageInfo("__9_0.distcp", 0, len(buf.getvalue()))

    reader = _load(_tampered(path, "bad", change), _zeros(state))
    assert not marker.exists()
    _one_line_naming(reader.refused, repr(fqn), "io.open")


def test_metadata_pointing_at_files_outside_the_checkpoint_is_refused(
    checkpoint: tuple[Path, dict[str, Any]],
) -> None:
    path, state = checkpoint

    def change(md: Any, _: Path) -> None:
        for info in md.storage_data.values():
            info.relative_path = "../good/__0_0.distcp"

    reader = _load(_tampered(path, "bad", change), _zeros(state))
    _one_line_naming(reader.refused, "'../good/__0_0.distcp'")


def test_the_refusal_survives_the_trip_between_ranks() -> None:
    """DCP gathers each rank's exception by pickling it."""
    from hyfi_imaging.train.safe_reader import UnsafeCheckpointError

    err = UnsafeCheckpointError("ckpt/.metadata", "refers to posix.system", "restore it")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and isinstance(back, pickle.UnpicklingError)


# --------------------------------------------------------------------------------------
# 3. Decompression bombs
# --------------------------------------------------------------------------------------


def _bomb_tiff(path: Path, height: int, width: int, rows_per_strip: int, samples: int = 3) -> Path:
    """A baseline TIFF declaring ``height x width`` uint8 pixels in strips of ``rows_per_strip``
    rows, every strip pointing at one small deflate block: the file holds a few bytes per
    strip, the declaration terabytes."""
    n = -(-height // rows_per_strip)
    blob = zlib.compress(bytes(min(rows_per_strip * width * samples, 1 << 16)), 9)
    arrays = 4 * n if n > 1 else 0  # one strip: its offset and count stand in the tags
    offsets_at = 8 + len(blob)
    bits_at = offsets_at + 2 * arrays
    ifd_at = bits_at + 2 * samples + (bits_at % 2)
    many = n > 1
    entries = [
        (256, 4, 1, width),
        (257, 4, 1, height),
        (258, 3, samples, bits_at),
        (259, 3, 1, 8),  # deflate
        (262, 3, 1, 2),  # RGB
        (273, 4, n, offsets_at if many else 8),
        (277, 3, 1, samples),
        (278, 4, 1, rows_per_strip),
        (279, 4, n, offsets_at + arrays if many else len(blob)),
        (284, 3, 1, 1),
    ]
    out = bytearray(b"II*\x00" + struct.pack("<I", ifd_at)) + blob
    if many:
        out += struct.pack(f"<{n}I", *[8] * n) + struct.pack(f"<{n}I", *[len(blob)] * n)
    out += struct.pack(f"<{samples}H", *[8] * samples)
    out += bytes(ifd_at - len(out))
    out += struct.pack("<H", len(entries))
    for tag, kind, count, value in entries:
        short = kind == 3 and count == 1
        out += struct.pack("<HHI", tag, kind, count)
        out += struct.pack("<HH", value, 0) if short else struct.pack("<I", value)
    path.write_bytes(bytes(out + struct.pack("<I", 0)))
    return path


#: The real hyfi-preprocess (its console script runs this same main).
CLI = [sys.executable, "-m", "hyfi_imaging.cli.preprocess"]


def _limit_memory() -> None:
    """Child of the CLI test: a 3 GB address space, so a regression fails instead of swapping."""
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


@pytest.mark.parametrize(
    ("rows_per_strip", "what"),
    [(1, "reading 977 x 1000000 px of level 0"), (1_000_000, "decoding one strip")],
    ids=["million-one-row-strips", "one-strip"],
)
def test_hyfi_preprocess_refuses_a_decompression_bomb_fast_in_one_line(
    tmp_path: Path, rows_per_strip: int, what: str
) -> None:
    bomb = _bomb_tiff(tmp_path / "bomb.tif", 1_000_000, 1_000_000, rows_per_strip)
    assert bomb.stat().st_size < 9_000_000
    start = time.monotonic()
    run = subprocess.run(
        [*CLI, str(bomb), "--out", str(tmp_path / "out"), "--size", "512", "--no-qc", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limit_memory,
    )
    took = time.monotonic() - start
    # One bad slide fails (exit 1, as any slide that cannot be converted); the run goes on.
    assert run.returncode == 1, run.stdout + run.stderr
    failed = [ln for ln in run.stdout.splitlines() if ln.strip().startswith("FAILED")]
    assert len(failed) == 1, run.stdout
    line = failed[0]
    for part in (str(bomb), what, "declared 1000000 x 1000000 px", "memory budget of", "tiled"):
        assert part in line, (part, line)
    assert "MemoryError" not in run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    assert took < 60, took


def test_a_large_png_is_judged_by_our_limits_not_pillows_bomb_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pillow refuses more than 2 x MAX_IMAGE_PIXELS (179 Mpx) as a decompression bomb: a
    valid 19000^2 PNG (under MAX_IMAGE_SIDE) was called damaged ("check that the file is a
    complete PNG"). Its limit is lowered here so that a small image stands for a large one;
    the limit is Pillow's again afterwards."""
    from PIL import Image

    from hyfi_imaging.io.image_reader import open_image

    Image.new("RGB", (64, 48), (200, 30, 40)).save(tmp_path / "wide.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with open_image(tmp_path / "wide.png") as reader:
        assert reader.level_dimensions[0] == (48, 64)
    assert Image.MAX_IMAGE_PIXELS == 1000


def test_reads_are_costed_before_decoding(tmp_path: Path) -> None:
    import tifffile

    from hyfi_imaging.io.tiff_reader import TiffReader

    path = tmp_path / "tiled.tif"
    pixels = np.random.default_rng(0).integers(0, 255, (512, 768, 3), dtype=np.uint8)
    tifffile.imwrite(path, pixels, tile=(256, 256), photometric="rgb", compression="zlib")
    with TiffReader(path) as reader:  # the default budget reads it
        assert np.array_equal(reader.read_region(0, 0, 0, 512, 768), pixels.transpose(2, 0, 1))
    with TiffReader(path, memory_budget=2 << 20) as reader:  # a tile fits, the whole does not
        assert reader.read_region(0, 0, 0, 64, 64).shape == (3, 64, 64)
        with pytest.raises(SlideError) as err:
            reader.read_region(0, 0, 0, 512, 768)
    _one_line_naming(err.value, str(path), "declared 512 x 768 px", "memory budget of 2.1 MB")
    with pytest.raises(SlideError, match="decoding one tile"):
        TiffReader(path, memory_budget=100_000)


def test_whole_image_decoders_and_shards_are_costed(tmp_path: Path) -> None:
    from PIL import Image

    from hyfi_imaging.io.base import ArrayReader
    from hyfi_imaging.io.image_reader import open_image
    from hyfi_imaging.preprocess.convert import PreprocessOptions, check_shard_memory

    png = tmp_path / "x.png"
    Image.new("RGB", (300, 200), "white").save(png)
    assert open_image(png).level_dimensions == ((200, 300),)
    with pytest.raises(SlideError, match="declared 200 x 300 px"):
        open_image(png, memory_budget=100_000)
    # a file declaring 60000 channels: one 512 x 512 shard of them is gigabytes
    many = ArrayReader(np.zeros((60000, 1, 1), np.uint8), path="many.tif")
    with pytest.raises(SlideError, match="60000 channels"):
        check_shard_memory(many, PreprocessOptions(), 1 << 30)
    check_shard_memory(ArrayReader(np.zeros((3, 1, 1), np.uint8)), PreprocessOptions(), 1 << 30)


def test_an_ome_zarr_input_is_costed_like_any_other(tmp_path: Path) -> None:
    """An OME-Zarr store given to hyfi-preprocess was read uncosted: a store of a few hundred
    kB declaring one chunk of 3 x 24000 x 24000 took 1.9 GB against a 256 MiB budget. Its
    reads are costed now, chunks included, before anything is decoded."""
    import zarr

    from hyfi_imaging.io.detect import open_slide
    from hyfi_imaging.io.zarr_store import ZarrReader

    n = 4096
    store = tmp_path / "bomb.zarr"
    g = zarr.open_group(str(store), mode="w", zarr_format=3)
    a = g.create_array("0", shape=(3, n, n), chunks=(3, n, n), dtype="uint8", fill_value=255,
                       dimension_names=["c", "y", "x"])  # fmt: skip
    a[:, :, :] = np.full((3, n, n), 200, np.uint8)  # one chunk: compresses to almost nothing
    space = {"type": "space", "unit": "micrometer"}
    g.attrs["ome"] = {"version": "0.5", "multiscales": [{
        "axes": [{"name": "c", "type": "channel"}, {"name": "y", **space}, {"name": "x", **space}],
        "datasets": [{"path": "0", "coordinateTransformations": [
            {"type": "scale", "scale": [1.0, 0.5, 0.5]}]}]}]}  # fmt: skip
    budget = 64 << 20  # a 64 x 64 read decodes the whole 48 MiB chunk (twice: decoded, copied)
    refused = pytest.raises(SlideError, match=r"reading 64 x 64 px of level 0 \(declared 4096")
    with refused, open_slide(store, memory_budget=budget) as reader:
        reader.read_region(0, 0, 0, 64, 64)
    with open_slide(store, memory_budget=256 << 20) as reader:
        assert reader.read_region(0, 0, 0, 64, 64).max() == 200
    assert ZarrReader(store).read_region(0, 0, 0, 8, 8).shape == (3, 8, 8)  # a loader's: uncosted


def test_the_default_budget_follows_available_memory() -> None:
    from hyfi_imaging.io.budget import (
        MAX_DEFAULT_BUDGET,
        MIN_BUDGET,
        available_memory,
        default_memory_budget,
    )

    one, four = default_memory_budget(1), default_memory_budget(4)
    assert MIN_BUDGET <= four <= one <= MAX_DEFAULT_BUDGET
    assert one == max(MIN_BUDGET, min(available_memory() // 4, MAX_DEFAULT_BUDGET))


def test_a_run_resumed_from_a_tampered_checkpoint_is_refused_in_one_line(
    checkpoint: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """The loader every resume and hyfi-predict uses: the payload never runs, and the
    refusal stops the load (an older checkpoint is not taken in its place)."""
    from hyfi_imaging.train.checkpoint import MARKER, load_latest
    from hyfi_imaging.train.safe_reader import UnsafeCheckpointError

    path, state = checkpoint
    marker = tmp_path / "PWNED"
    root = tmp_path / "checkpoints"
    root.mkdir()
    shutil.copytree(path, root / "step_00000001")
    bad = _tampered(path, "bad", lambda md, _: setattr(md, "planner_data", _Payload(marker)))
    shutil.move(bad, root / "step_00000002")
    for step in (1, 2):
        (root / f"step_{step:08d}" / MARKER).write_text(json.dumps({"step": step}))
    with pytest.raises(UnsafeCheckpointError) as caught:
        load_latest(root, _zeros(state))
    assert not marker.exists()
    _one_line_naming(caught.value, "step_00000002/.metadata", "refers to io.open")
