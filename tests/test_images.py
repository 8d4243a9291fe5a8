"""Images as they are: 16-bit, float and multi-channel images from OME-TIFF/QPTIFF to the model.

Real tifffile OME-TIFFs (SubIFD pyramids, channel names), real hyfi-preprocess,
real stores, the real loader and a real hyfi-train run; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tifffile
import yaml
import zarr
from PIL import Image

from hyfi_imaging.cli.preprocess import main as preprocess_main
from hyfi_imaging.data.dataset import TileDataset
from hyfi_imaging.data.normalize import Normalization
from hyfi_imaging.data.tiles import stitch, tile_regions
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.io import open_slide
from hyfi_imaging.io.base import level_downsample
from hyfi_imaging.io.tiff_reader import TiffReader
from hyfi_imaging.io.zarr_store import ZarrReader, read_store_pixels
from hyfi_imaging.preprocess import PreprocessOptions, read_manifest, run_preprocess
from hyfi_imaging.preprocess.canvas import CropPlan, render_crop
from hyfi_imaging.preprocess.qc import QcChannels
from hyfi_imaging.train.config import load_recipe
from hyfi_imaging.train.inputs import normalization

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["DAPI", "CD8", "PanCK", "CD68", "Ki67"]
HW = (300, 410)  # odd sizes at every pyramid level


def _area_mean(image: np.ndarray) -> np.ndarray:
    """2x2 area mean written out independently of the library: ints rounded half up, floats exact."""
    c, h, w = image.shape
    padded = np.pad(image, ((0, 0), (0, h % 2), (0, w % 2)), mode="edge")
    blocks = padded.reshape(c, (h + 1) // 2, 2, (w + 1) // 2, 2)
    if image.dtype.kind == "f":
        return blocks.astype(np.float64).mean(axis=(2, 4)).astype(image.dtype)
    return ((blocks.astype(np.int64).sum(axis=(2, 4)) + 2) // 4).astype(image.dtype)


def _pixels(dtype: str, channels: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "uint16":  # a 16-bit scan that uses 1837..65535, as fluorescence scanners do
        return rng.integers(1837, 65536, size=(channels, *HW), dtype=np.uint16)
    return (rng.normal(size=(channels, *HW)) * 40 + 10).astype(np.float32)


def _write_ome(
    path: Path, image: np.ndarray, *, names: list[str], levels: int = 3
) -> list[np.ndarray]:
    """An OME-TIFF with a SubIFD pyramid (each level the 2x2 mean of the one below) and channel names."""
    pyramid = [image]
    while len(pyramid) < levels:
        pyramid.append(_area_mean(pyramid[-1]))
    axes = "CYX" if image.shape[0] > 1 else "YX"
    base = image if image.shape[0] > 1 else image[0]
    meta = {"axes": axes, "Channel": {"Name": names}, "PhysicalSizeX": 0.5, "PhysicalSizeY": 0.5}
    with tifffile.TiffWriter(path, ome=True) as tif:
        tif.write(base, subifds=levels - 1, tile=(64, 64), metadata=meta)
        for lv in pyramid[1:]:
            tif.write(
                lv if image.shape[0] > 1 else lv[0], subfiletype=1, tile=(64, 64), metadata=None
            )
    return pyramid


CASES = {
    "uint16-gray": ("uint16", 1),
    "uint16-5ch": ("uint16", 5),
    "float32-5ch": ("float32", 5),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each case as an OME-TIFF pyramid, converted by hyfi-preprocess at level 0, whole image.

    One output folder (one manifest) per case: a manifest holds images of one kind.
    """
    root = tmp_path_factory.mktemp("ome")
    sources, outs = {}, {}
    for key, (dtype, channels) in CASES.items():
        image = _pixels(dtype, channels, seed=len(sources))
        sources[key] = _write_ome(root / f"{key}.ome.tiff", image, names=NAMES[:channels])
        outs[key] = root / f"data-{key}"
        args = ["--out", str(outs[key]), "--level", "0", "--size", f"{HW[0]}x{HW[1]}"]
        args += ["--tissue", "none", "--chunk", "64", "--shard", "128", "--quiet"]
        code = preprocess_main([str(root / f"{key}.ome.tiff"), *args])
        assert code == 0
    return {"root": root, "out": outs, "sources": sources}


@pytest.mark.parametrize("key", sorted(CASES))
def test_ome_tiff_round_trips_pixel_exact_through_preprocess_store_and_loader(
    converted: dict[str, Any], key: str
) -> None:
    dtype, channels = CASES[key]
    pyramid = converted["sources"][key]
    src = converted["root"] / f"{key}.ome.tiff"
    with TiffReader(src) as reader:  # the SubIFD pyramid is read as it is, per level
        assert (reader.dtype, reader.channels) == (np.dtype(dtype), channels)
        assert reader.channel_names == tuple(NAMES[:channels]) and reader.background == 0
        assert reader.level_dimensions == ((300, 410), (150, 205), (75, 103))
        for level, expected in enumerate(pyramid):
            np.testing.assert_array_equal(
                reader.read_region(level, 0, 0, *expected.shape[1:]), expected
            )

    out = converted["out"][key]
    store = out / f"{key}.zarr"
    group = zarr.open_group(store, mode="r")
    # The store keeps type and channels; each level is the exact 2x2 mean for the type.
    expected = pyramid[0]
    for level in range(3):
        arr = np.asarray(group[str(level)][:])
        assert arr.dtype == np.dtype(dtype) and arr.shape[0] == channels
        np.testing.assert_array_equal(arr, expected)
        expected = _area_mean(expected)
    # A shard holds all channels: more than 3 bytes a pixel narrows it (to whole 64-px chunks).
    assert group["0"].shards == (channels, *((128, 128) if channels == 1 else (64, 64)))
    pixels = read_store_pixels(store)
    assert pixels is not None and (pixels.channels, pixels.dtype) == (channels, dtype)

    # The loader: the whole image, and 2x2 tiles with halos that stitch back to it.
    scale = np.float32(65535.0 if dtype == "uint16" else 1.0)
    want = pyramid[0].astype(np.float32) / scale
    item = TileDataset(out / "manifest.csv", level=0)[0]["image"].numpy()
    assert item.dtype == np.float32
    np.testing.assert_array_equal(item, want)
    regions = tile_regions(HW, (2, 2), halo=(5, 3), align=4)
    tiles = [
        TileDataset(out, grid=(2, 2), rank=r.rank, halo=(5, 3), align=4)[0]["image"].numpy()
        for r in regions
    ]
    np.testing.assert_array_equal(stitch(tiles, regions), want)


def test_channel_names_round_trip_from_ome_and_qptiff(
    converted: dict[str, Any], tmp_path: Path
) -> None:
    with ZarrReader(converted["out"]["uint16-5ch"] / "uint16-5ch.zarr") as store:
        assert store.channel_names == tuple(NAMES)
        omero = json.loads((Path(store.path) / "zarr.json").read_text())["attributes"]["ome"][
            "omero"
        ]
        assert [c["label"] for c in omero["channels"]] == NAMES
        assert [c["active"] for c in omero["channels"]] == [True, True, True, False, False]
        lo, hi = omero["channels"][0]["window"]["min"], omero["channels"][0]["window"]["max"]
        assert (lo, hi) == (0.0, 65535.0)
        # The display window: 0.5-99.5th percentiles of the coarsest level (here level 2).
        data = np.asarray(zarr.open_group(store.path, mode="r")["2"][0], dtype=np.float64)
        start, end = store.channel_windows[0]
        assert (start, end) == pytest.approx(tuple(np.percentile(data, [0.5, 99.5])))

    image = np.random.default_rng(3).integers(0, 4096, size=(3, 96, 128), dtype=np.uint16)
    with tifffile.TiffWriter(tmp_path / "mif.qptiff") as tif:
        for c, name in enumerate(["DAPI", "FITC", "Cy5"]):
            desc = (
                '<?xml version="1.0" encoding="utf-8"?><PerkinElmer-QPI-ImageDescription>'
                f"<ImageType>FullResolution</ImageType><Name>{name}</Name>"
                "</PerkinElmer-QPI-ImageDescription>"
            )
            tif.write(
                image[c], tile=(64, 64), software="PerkinElmer-QPI", description=desc, metadata=None
            )
    summary = run_preprocess(
        [tmp_path / "mif.qptiff"],
        tmp_path / "out",
        PreprocessOptions(level=0, size=(96, 128), tissue="none"),
        progress=False,
        qc=False,
    )
    assert not summary.failed
    with open_slide(tmp_path / "out" / "mif.zarr") as store:  # 3 channels, but not RGB
        assert store.channel_names == ("DAPI", "FITC", "Cy5") and store.background == 0
        np.testing.assert_array_equal(store.read_region(0, 0, 0, 96, 128), image)


def _card_recipe(tmp_path: Path, manifest: Path, normalize: dict[str, Any]) -> Path:
    card = tmp_path / "card.yaml"
    card.write_text(
        yaml.safe_dump(
            {"name": "mif", "task": "binary", "classes": ["neg", "pos"], "normalize": normalize}
        )
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "dataset": "card.yaml",
                "model": {"name": "resnet18", "kwargs": {"width": 0.125}},
                "data": {"manifest": str(manifest)},
                "train": {"out_dir": str(tmp_path / "run")},
            }
        )
    )
    return recipe


def test_normalisation_from_the_dataset_card_is_applied_at_load(
    converted: dict[str, Any], tmp_path: Path
) -> None:
    manifest = converted["out"]["uint16-5ch"] / "manifest.csv"
    recipe = load_recipe(
        _card_recipe(tmp_path, manifest, {"mode": "percentile", "low": 1, "high": 99})
    )
    norm = normalization(recipe)
    assert (norm.mode, norm.low, norm.high, norm.clip) == ("percentile", 1.0, 99.0, True)
    ds = TileDataset(manifest, normalize=norm)
    index = 0
    source = converted["sources"]["uint16-5ch"][0]
    # The stored statistics are the percentiles of the coarsest level's tissue placement (here
    # the whole image, at level 2 of the 64-px-chunk store): checked against numpy directly.
    coarsest = np.asarray(
        zarr.open_group(converted["out"]["uint16-5ch"] / "uint16-5ch.zarr", mode="r")["2"][:]
    )
    flat = coarsest.reshape(5, -1).astype(np.float64)
    p1, p99 = np.percentile(flat, 1, axis=1), np.percentile(flat, 99, axis=1)
    with ZarrReader(converted["out"]["uint16-5ch"] / "uint16-5ch.zarr") as store:
        assert store.channel_stats["level"] == 2
        assert [v[3] for v in store.channel_stats["values"]] == pytest.approx(list(p1))
    low, span = p1.astype(np.float32), (p99 - p1).astype(np.float32)
    want = np.clip((source.astype(np.float32) - low[:, None, None]) / span[:, None, None], 0, 1)
    got = ds[index]["image"].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert got.min() == 0.0 and got.max() == 1.0 and 0.2 < got.mean() < 0.8

    # Fixed ranges, one per channel, from the recipe over the card.
    ranges = [[2000, 60000], [0, 65535], [1837, 40000], [0, 10000], [30000, 31000]]
    recipe = load_recipe(
        _card_recipe(tmp_path, manifest, {"mode": "percentile"}),
        ["data.normalize.mode=range", f"data.normalize.ranges={ranges}"],
    )
    got = TileDataset(manifest, normalize=normalization(recipe))[index]["image"].numpy()
    r = np.array(ranges, np.float32)
    want = np.clip(
        (source.astype(np.float32) - r[:, :1, None]) / (r[:, 1:, None] - r[:, :1, None]), 0, 1
    )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ConfigError, match="2 ranges but the images have 5 channels"):
        TileDataset(manifest, normalize=Normalization("range", ((0, 1), (0, 2))))
    with pytest.raises(ConfigError, match="percentiles the stores hold"):
        Normalization("percentile", low=3.0)


def _banded(channels: int, hw: tuple[int, int], value: int = 10000) -> np.ndarray:
    """Channel ``i`` is bright in vertical band ``i`` only, dark elsewhere."""
    image = np.zeros((channels, *hw), np.uint16)
    band = hw[1] // channels
    for i in range(channels):
        image[i, :, i * band : (i + 1) * band] = value
    return image


def test_qc_picture_shows_chosen_channels_in_their_colours(tmp_path: Path) -> None:
    hw = (100, 500)
    _write_ome(tmp_path / "bands.ome.tiff", _banded(5, hw), names=NAMES, levels=1)

    def colours(qc: QcChannels | None) -> list[tuple[int, ...]]:
        out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
        summary = run_preprocess(
            [tmp_path / "bands.ome.tiff"],
            out,
            PreprocessOptions(level=0, size=hw, tissue="none"),
            qc_channels=qc,
            progress=False,
        )
        assert not summary.failed
        picture = np.asarray(Image.open(out / "qc" / "bands.png").convert("RGB"))
        right = hw[1] + 8  # the output canvas, beside the source thumbnail
        return [tuple(int(v) for v in picture[50, right + 50 + 100 * i]) for i in range(5)]

    black, red, green, blue = (0, 0, 0), (255, 0, 0), (0, 255, 0), (0, 0, 255)
    # Default: the first three channels in their colours (red, green, blue), the others not shown.
    assert colours(None) == [red, green, blue, black, black]
    chosen = QcChannels.parse("Ki67:FFFF00,CD68:cyan,0:magenta")
    assert colours(chosen) == [(255, 0, 255), black, black, (0, 255, 255), (255, 255, 0)]
    failed = run_preprocess(
        [tmp_path / "bands.ome.tiff"],
        tmp_path / "bad",
        PreprocessOptions(level=0, size=hw, tissue="none"),
        qc_channels=QcChannels.parse("CD3:red"),
        progress=False,
    ).failed
    assert (
        len(failed) == 1
        and "names channel 'CD3'" in failed[0].error
        and "DAPI, CD8" in failed[0].error
    )
    with pytest.raises(ConfigError, match="neither RRGGBB nor a colour name"):
        QcChannels.parse("DAPI:bleu")
    with pytest.raises(SystemExit) as exited:  # the command line says so before anything runs
        preprocess_main([str(tmp_path), "--out", str(tmp_path / "x"), "--qc-channels", "DAPI:bleu"])
    assert exited.value.code == 2 and not (tmp_path / "x").exists()


def test_tissue_on_intensity_images_by_channel(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    image = rng.normal(300, 20, size=(3, 400, 600)).clip(0, None).astype(np.uint16)  # dark noise
    image[0, 120:220, 380:520] += 20000  # nuclei (DAPI) in one region only
    names = ["DAPI", "CD8", "PanCK"]
    _write_ome(tmp_path / "fl.ome.tiff", image, names=names, levels=1)
    _write_ome(tmp_path / "empty.ome.tiff", image[1:], names=names[1:], levels=1)

    def run(path: str, tissue: str) -> Any:
        out = tmp_path / f"out-{tissue}-{path}"
        options = PreprocessOptions(level=0, size=(400, 600), tissue=tissue, margin_um=5.0)
        return run_preprocess([tmp_path / path], out, options, progress=False, qc=False)

    for tissue in ("auto", "DAPI", "0"):
        summary = run("fl.ome.tiff", tissue)
        assert not summary.failed, summary.failed
        attrs = json.loads((Path(summary.results[0].store) / "zarr.json").read_text())["attributes"]
        sy, sx, sh, sw = attrs["hyfi"][
            "source_box"
        ]  # the region, plus 10 px margin, give or take a pixel
        assert (
            abs(sy - 110) <= 2 and abs(sx - 370) <= 2 and abs(sh - 120) <= 4 and abs(sw - 160) <= 4
        )
    assert "no tissue found" in run("fl.ome.tiff", "CD8").failed[0].error  # noise only on CD8
    assert "no tissue found" in run("empty.ome.tiff", "auto").failed[0].error
    assert "names no channel" in run("fl.ome.tiff", "CD3").failed[0].error


def test_crop_on_a_floor_pyramid_is_exact_at_the_far_edge(tmp_path: Path) -> None:
    """Levels of floor(h / 2**k): one averaged downsample put the crop off by up to 1.5 px."""
    rng = np.random.default_rng(11)
    base = rng.integers(0, 200, size=(515, 2048, 3), dtype=np.uint8)  # tissue ...
    base[:, :512] = 250  # ... right of white glass
    levels = [base]
    for _ in range(2):  # floor sizes: the odd last row is dropped (515 -> 257 -> 128)
        lv = levels[-1]
        h, w = lv.shape[0] // 2 * 2, lv.shape[1] // 2 * 2
        blocks = lv[:h, :w].reshape(h // 2, 2, w // 2, 2, 3).astype(np.uint16).sum(axis=(1, 3))
        levels.append(((blocks + 2) // 4).astype(np.uint8))
    with tifffile.TiffWriter(tmp_path / "floor.tiff") as tif:
        for i, lv in enumerate(levels):
            tif.write(
                lv, photometric="rgb", tile=(128, 128), subfiletype=1 if i else 0, metadata=None
            )
    with open_slide(tmp_path / "floor.tiff") as reader:
        assert reader.level_dimensions == ((515, 2048), (257, 1024), (128, 512))
        assert (
            reader.level_downsamples[2] == (4.0, 4.0) == level_downsample((515, 2048), (128, 512))
        )
        level2 = np.moveaxis(levels[2], -1, 0)
        # A crop at the far right edge, read from level 2, lands on level-2 pixels exactly.
        plan = CropPlan((100, 1600, 400, 448), (0, 0, 100, 112), 2, None, (0, 0, 515, 2048))
        np.testing.assert_array_equal(render_crop(reader, plan), level2[:, 25:125, 400:512])

    summary = run_preprocess(
        [tmp_path / "floor.tiff"],
        tmp_path / "out",
        PreprocessOptions(level=2, size=(129, 512)),
        progress=False,
        qc=False,
    )
    assert not summary.failed, summary.failed
    store = tmp_path / "out" / "floor.zarr"
    attrs = json.loads((store / "zarr.json").read_text())["attributes"]["hyfi"]
    py, px, ph, pw = attrs["placement"]
    sy, sx, sh, sw = attrs["source_box"]
    # Tissue from x = 512 to the far edge; the crop is snapped to the level-2 grid ...
    assert sx <= 520 and sx + sw == 2048 and sy % 4 == sx % 4 == 0 and (sh, sw) == (4 * ph, 4 * pw)
    canvas = np.asarray(zarr.open_group(store, mode="r")["0"][:])
    # ... and shows the level's own pixels, not a resample; level 2 ends at row 128, and so
    # does the crop (a block past it was white glass inside the placement).
    assert sy // 4 + ph == 128
    np.testing.assert_array_equal(
        canvas[:, py : py + ph, px : px + pw],
        level2[:, sy // 4 : sy // 4 + ph, sx // 4 : sx // 4 + pw],
    )


def test_train_a_five_channel_model_from_the_data(tmp_path: Path) -> None:
    """hyfi-preprocess a 5-channel uint16 OME-TIFF cohort, then hyfi-train takes in_chans=5 from it."""
    slides = tmp_path / "slides"
    slides.mkdir()
    rng = np.random.default_rng(5)
    lines = ["slide_id,label"]
    for i in range(4):
        image = rng.integers(0, 4096, size=(5, 96, 96), dtype=np.uint16)
        tifffile.imwrite(
            slides / f"m{i}.ome.tiff",
            image,
            ome=True,
            tile=(64, 64),
            metadata={"axes": "CYX", "Channel": {"Name": NAMES}},
        )
        lines.append(f"m{i},{['neg', 'pos'][i % 2]}")
    (slides / "labels.csv").write_text("\n".join(lines) + "\n")
    args = ["--out", str(tmp_path / "data"), "--level", "0", "--size", "96", "--tissue", "none"]
    args += ["--labels", str(slides / "labels.csv"), "--quiet", "--no-qc"]
    code = preprocess_main([str(slides), *args])
    assert code == 0 and all(
        r.status == "ok" for r in read_manifest(tmp_path / "data" / "manifest.csv")
    )
    recipe = _card_recipe(
        tmp_path, tmp_path / "data" / "manifest.csv", {"mode": "percentile", "low": 1, "high": 99.9}
    )
    cmd = [sys.executable, "-m", "hyfi_imaging.cli.train", str(recipe)]
    sets = [
        "train.max_steps=2",
        "train.batch_size=1",
        "train.progress=false",
        "data.augment.rot90=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    refused = subprocess.run(
        [*cmd, "--check", "--set", "model.kwargs.in_chans=3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert refused.returncode == 2, refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert "in_chans" in line and "5 channels" in line

    proc = subprocess.run(
        [*cmd, *[a for s in sets for a in ("--set", s)]],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2
    from torch.distributed.checkpoint import FileSystemReader

    step = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1]
    meta = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    conv1 = next(v for k, v in meta.items() if k.endswith("conv1.weight") and "layer" not in k)
    assert tuple(conv1.size)[1] == 5  # the stem takes the data's 5 channels


@pytest.mark.parametrize(
    ("dtype", "out_hw"),
    [(np.uint8, (83, 71)), (np.uint8, (50, 37)), (np.uint16, (170, 211)), (np.uint8, (64, 60))],
    ids=["reduce-1.5", "reduce-2.7", "enlarge-0.6", "reduce-2-blocks"],
)
def test_a_resampled_crop_is_the_same_whatever_tiles_render_it(
    dtype: type, out_hw: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pillow's resize of each tile's box rounded its own coefficients and an intermediate
    image: the same output pixel came out 1-2 levels apart in two tilings (seams at every
    tile border of the store). Each pixel now comes from its absolute position alone: tiles
    of 16 output pixels give the crop rendered in one piece, exactly; a reduction by 2 is
    each 2 x 2 block's mean."""
    from hyfi_imaging.io.base import ArrayReader
    from hyfi_imaging.preprocess import canvas

    hi = np.iinfo(dtype).max
    source = np.random.default_rng(21).integers(0, hi + 1, (3, 128, 120)).astype(dtype)
    reader = ArrayReader(source)
    plan = CropPlan((0, 0, 128, 120), (0, 0, *out_hw), 0, None, (0, 0, 128, 120))
    whole = render_crop(reader, plan)
    monkeypatch.setattr(canvas, "_RENDER_TILE", 16)
    monkeypatch.setattr(canvas, "_SOURCE_TILE", 40)
    assert np.array_equal(render_crop(reader, plan), whole)
    assert np.array_equal(
        render_crop(reader, plan, window=(5, 7, out_hw[0] - 3, out_hw[1] - 2)),
        whole[:, 5 : out_hw[0] - 3, 7 : out_hw[1] - 2],
    )
    if out_hw == (64, 60):
        means = source.reshape(3, 64, 2, 60, 2).astype(np.float64).mean(axis=(2, 4))
        assert np.array_equal(whole, np.rint(means).astype(dtype))


@pytest.mark.parametrize(
    ("axes", "shape", "said"),
    [
        ("IYX", (3, 40, 56), "hold 3 along [IQ]"),  # fluorescence channels saved as pages
        ("ZYX", (2, 40, 56), "hold 2 along Z"),  # a z-stack
    ],
)
def test_a_stack_of_planes_is_refused_not_cut_to_its_first(
    tmp_path: Path, axes: str, shape: tuple[int, ...], said: str
) -> None:
    """Every plane but the first was dropped, exit 0: three channels saved as three pages
    became a one-channel slide."""
    from hyfi_imaging.errors import SlideError
    from hyfi_imaging.io import open_slide

    path = tmp_path / "stack.ome.tif"
    data = np.arange(np.prod(shape), dtype=np.uint16).reshape(shape)
    if axes == "IYX":
        path = tmp_path / "stack.tif"
        tifffile.imwrite(path, data, photometric="minisblack")
    else:
        tifffile.imwrite(path, data, ome=True, metadata={"axes": axes})
    with pytest.raises(SlideError, match=said) as err:
        open_slide(path)
    # a z-stack saved as channels trained as a flat slide: it is pointed to the volumes
    fix = "write_ome_zarr_volume" if axes == "ZYX" else "save the planes as channels"
    assert fix in str(err.value)
