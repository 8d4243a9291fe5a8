"""Class activation maps (``hyfi-predict --heatmaps``) in one process: the head, the frame, files.

The multi-rank exactness (1x2, 2x2 and a pipeline equal one process in float64) and the
command end to end are in ``tests/test_heatmaps_mpi.py``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.io.zarr_store import ZarrReader, write_ome_zarr
from hyfi_imaging.models import create_model
from hyfi_imaging.parallel.engine import ParallelModel, ParallelPlan
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.preprocess.canvas import CropPlan
from hyfi_imaging.train.heatmap_files import slide_frame, write_heatmap, write_heatmap_png
from hyfi_imaging.train.heatmaps import CamRecorder, cam_head

REPO = Path(__file__).resolve().parents[1]


def _one_line(err: pytest.ExceptionInfo[ConfigError], *needles: str) -> None:
    text = str(err.value)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, (needle, text)


@pytest.mark.parametrize(
    ("name", "kwargs", "pool", "linear", "stride", "feature_hw"),
    [
        ("resnet18", {"width": 0.125}, "avgpool", "fc", 32, (4, 5)),  # ceil(100/32), ceil(130/32)
        ("amoebanet-d-3-8", {}, "head.avgpool", "head.fc", 32, (4, 5)),
        ("convchain", {"depth": 2, "width": 4}, "avgpool", "fc", 1, (100, 130)),
    ],
)
def test_cam_head_finds_the_pool_the_linear_and_the_map(
    name: str,
    kwargs: dict[str, object],
    pool: str,
    linear: str,
    stride: int,
    feature_hw: tuple[int, int],
) -> None:
    with torch.device("meta"):
        model = create_model(name, num_classes=2, **kwargs)
    head = cam_head(model, name=name, image_hw=(100, 130), in_chans=3)
    assert (head.pool, head.linear, head.kind) == (pool, linear, "avg")
    assert head.stride == (stride, stride) and head.feature_hw == feature_hw


def test_cam_head_at_8192_is_256_and_max_pool_is_named() -> None:
    with torch.device("meta"):
        model = create_model("resnet50", num_classes=2, global_pool="max")
    head = cam_head(model, name="resnet50", image_hw=(8192, 8192), in_chans=3)
    assert head.feature_hw == (256, 256) and head.kind == "max"


def test_a_map_that_is_not_the_image_over_the_stride_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Unpadded convolutions pool a smaller map than image / stride: placed at the stride from
    the corner, it is off by up to a stride per missing pixel, and the log says so."""
    model = nn.Sequential(
        nn.Conv2d(3, 4, 5), nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(4, 2)
    )
    with caplog.at_level("WARNING", logger="hyfi_imaging.train"):
        head = cam_head(model, name="valid", image_hw=(40, 50), in_chans=3)
    assert head.feature_hw == (36, 46) and head.stride == (1, 1)
    assert "pools a 36x46 map from a 40x50 image, not ceil(image / 1) = 40x50" in caplog.text
    assert "off by up to 4 px" in caplog.text


class _TwoLayerHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.fc1 = nn.Linear(4, 8)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(self.flatten(self.avgpool(self.conv(x))))))


def test_a_head_that_is_not_pool_then_linear_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        cam_head(_TwoLayerHead(), name="mine", image_hw=(32, 32), in_chans=3)
    _one_line(
        err,
        "hyfi-predict --heatmaps",
        "'mine'",
        "avgpool (AdaptiveAvgPool2d) -> flatten (Flatten) -> fc1 (Linear) -> relu (ReLU) -> "
        "fc2 (Linear), not global pool -> Linear",
        "predict without --heatmaps",
    )
    with torch.device("meta"):
        unet = create_model("unet2d", num_classes=2)
    with pytest.raises(ConfigError) as err:
        cam_head(unet, name="unet2d", image_hw=(64, 64), in_chans=3)
    _one_line(err, "model 'unet2d' has no global pool", "head")


def test_slide_frame_places_map_pixels_through_the_stores_crop() -> None:
    """Map pixel i covers canvas [i S, (i+1) S); its centre must land, through the crop plan's
    own transform (the one the image was rendered with), on canvas (i + 1/2) S."""
    attrs = {
        "source_box": [100, 200, 3001, 3999],
        "placement": [10, 20, 1500, 2000],
        "source_mpp": 0.25,
        "mpp": 0.5,
    }
    frame = slide_frame(attrs, (32.0, 32.0))
    assert frame.frame == "slide" and frame.unit == "micrometer"
    r = (3001 / 1500, 3999 / 2000)
    assert frame.scale == pytest.approx((32 * r[0] * 0.25, 32 * r[1] * 0.25), rel=1e-12)
    plan = CropPlan((100, 200, 3001, 3999), (10, 20, 1500, 2000), 0, 0.5, (0, 0, 1, 1))
    i = np.arange(6, dtype=np.float64)
    # NGFF: physical = translation + index * scale is a pixel centre; source pixel k is centred
    # on k, i.e. at continuous source coordinate k + 1/2.
    src_y = (frame.translation[0] + i * frame.scale[0]) / 0.25 + 0.5
    src_x = (frame.translation[1] + i * frame.scale[1]) / 0.25 + 0.5
    cy, cx = plan.to_canvas(src_y, src_x)
    np.testing.assert_allclose(cy, (i + 0.5) * 32, atol=1e-9)
    np.testing.assert_allclose(cx, (i + 0.5) * 32, atol=1e-9)
    # Unknown source resolution: slide pixels, no unit; no provenance: the store's own frame.
    assert slide_frame({**attrs, "source_mpp": None}, (32, 32)).unit is None
    own = slide_frame({"mpp": 0.5}, (32, 32))
    assert own.frame == "store" and own.scale == (16.0, 16.0)
    assert own.translation == (pytest.approx((16 - 0.5) * 0.5),) * 2


def test_hyfi_predict_replaces_nothing_but_earlier_predictions(
    tmp_path: Path, manifest: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``--heatmaps`` given the data's own folder replaced every preprocessed slide by its heat
    map (exit 0, the cohort lost), and ``--out`` given the manifest's path overwrote it with
    predictions: both refused before any rank starts, the data untouched; the writers refuse
    to replace what is not their own kind of store too."""
    import shutil
    import subprocess
    import sys

    def main(argv: list[str]) -> int:  # a process of its own: past its checks it would launch
        cmd = [sys.executable, "-m", "hyfi_imaging.cli.predict", *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        sys.stderr.write(proc.stderr)
        return proc.returncode

    data = tmp_path / "data"
    shutil.copytree(manifest.parent, data)
    files = {p: p.read_bytes() for p in data.rglob("*") if p.is_file()}
    run = _recipe_yaml(tmp_path, name="resnet18")
    args = [str(run), "--manifest", str(data / "manifest.csv")]
    assert main([*args, "--out", str(tmp_path / "p.csv"), "--heatmaps", str(data)]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "exists and is other data" in err, err
    assert "never the data's own" in err
    assert main([*args, "--out", str(data / "manifest.csv")]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "is the manifest the images are read from" in err, err
    assert {p: p.read_bytes() for p in data.rglob("*") if p.is_file()} == files
    slide = next(data.glob("*.zarr"))
    with pytest.raises(ConfigError, match="exists and is other data"):
        write_heatmap(slide, np.zeros((2, 2, 2)), image=str(slide), level=0, stride=(32, 32),
                      pool="avg", classes=["a", "b"])  # fmt: skip
    assert {p: p.read_bytes() for p in data.rglob("*") if p.is_file()} == files


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    """A 256 x 384 grey store with the provenance hyfi-preprocess records."""
    y, x = np.mgrid[0:256, 0:384]
    image = ((np.sin(y / 9.0) * np.cos(x / 13.0) + 1) * 120).astype(np.uint8)
    path = tmp_path / "s1.zarr"
    attrs = {
        "slide_id": "s1",
        "source": "/slides/s1.svs",
        "source_mpp": 0.25,
        "mpp": 1.0,
        "source_box": [40, 80, 1000, 1500],
        "placement": [3, 0, 250, 375],
        "size": [256, 384],
    }
    write_ome_zarr(path, np.repeat(image[None], 3, axis=0), mpp=1.0, hyfi_attrs=attrs, chunk=128)
    return path


def test_write_heatmap_records_the_slide_frame_and_draws_the_overlay(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cam = np.stack([np.full((8, 12), -1.5), np.arange(96.0).reshape(8, 12)])
    monkeypatch.chdir(store.parent)  # the store named relative to where the command ran
    out = write_heatmap(
        tmp_path / "maps" / "s1.zarr",
        cam,
        image=store.name,
        level=0,
        stride=(32, 32),
        pool="avg",
        classes=["normal", "tumor"],
        logits=[-1.5, 47.5],
    )
    meta = json.loads((out / "zarr.json").read_text())["attributes"]
    ms = meta["ome"]["multiscales"][0]
    assert [a.get("unit") for a in ms["axes"][1:]] == ["micrometer", "micrometer"]
    scale, trans = ms["datasets"][0]["coordinateTransformations"]
    r = (1000 / 250, 1500 / 375)  # 4 source pixels per canvas pixel
    assert scale == {"type": "scale", "scale": [1.0, 32 * r[0] * 0.25, 32 * r[1] * 0.25]}
    want = [0.0, (40 + (16 - 3) * r[0] - 0.5) * 0.25, (80 + 16 * r[1] - 0.5) * 0.25]
    assert trans["type"] == "translation"
    assert trans["translation"] == pytest.approx(want, rel=1e-12)
    assert [c["label"] for c in meta["ome"]["omero"]["channels"]] == ["normal", "tumor"]
    hyfi = meta["hyfi"]
    assert hyfi["stride"] == [32.0, 32.0] and hyfi["frame"] == "slide"
    assert hyfi["canvas_transform"]["scale"] == [32.0, 32.0]  # the store is 1 µm/px
    assert hyfi["slide_id"] == "s1" and hyfi["mean_is_logit"] is True
    assert hyfi["image"] == str(store)  # absolute: read from any folder
    with ZarrReader(out) as reader:
        back = reader.read_region(0, 0, 0, 8, 12)
    np.testing.assert_array_equal(back, cam.astype(np.float32))
    assert not list((tmp_path / "maps").glob("*.tmp-*"))
    png = write_heatmap_png(
        tmp_path / "maps" / "s1.png",
        cam,
        image=str(store),
        level=0,
        stride=(32, 32),
        classes=["normal", "tumor"],
        title="s1: class activation maps",
        probs=[0.1, 0.9],
    )
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > im.size[1] > 100
    with pytest.raises(ConfigError, match="outside"):
        write_heatmap(
            tmp_path / "maps" / ".." / ".." / "x.zarr",
            cam,
            image=str(store),
            level=0,
            stride=(32, 32),
            pool="avg",
            classes=["a", "b"],
        )


def test_map_means_are_the_logits_in_one_process(single: object) -> None:
    torch.manual_seed(0)
    model = create_model("resnet18", width=0.125, num_classes=3).double()
    head = cam_head(model, name="resnet18", image_hw=(70, 100), in_chans=3)
    pm = ParallelModel(model, single, ParallelPlan(Layout()), image_hw=(70, 100))  # type: ignore[arg-type]
    x = torch.randn(2, 3, 70, 100, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with CamRecorder(pm, head) as rec:
        logits = pm.predict(pm.tile_of(x))
        maps = rec.take(logits)
    assert maps is not None and maps.shape == (2, 3, 3, 4)
    np.testing.assert_allclose(maps.mean(axis=(2, 3)), logits.numpy(), rtol=1e-12, atol=1e-12)


class _ScaledLogits(nn.Module):
    """Pool -> Linear in its modules, but its forward doubles the logits: no map of them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.fc(self.avgpool(self.conv(x)).flatten(1))


def test_a_forward_that_is_not_pool_then_linear_is_refused_while_predicting(
    single: object,
) -> None:
    model = _ScaledLogits().double()
    head = cam_head(copy.deepcopy(model), name="scaled", image_hw=(16, 16), in_chans=3)
    pm = ParallelModel(model, single, ParallelPlan(Layout()), image_hw=(16, 16))  # type: ignore[arg-type]
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    with CamRecorder(pm, head) as rec, pytest.raises(ConfigError) as err:
        rec.take(pm.predict(pm.tile_of(x)))
    _one_line(err, "logits are not its Linear 'fc' applied to its pool 'avgpool'")


def _recipe_yaml(tmp_path: Path, **model: object) -> Path:
    """A run directory's recipe.yaml, as hyfi-train writes it (the whole recipe)."""
    from hyfi_imaging.train.config import load_recipe

    sets = [f"model.{k}={v}" for k, v in model.items()]
    recipe = load_recipe(REPO / "recipes" / "synthetic.yaml", sets)
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(yaml.safe_dump(json.loads(recipe.model_dump_json())))
    return run


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cohorts import preprocessed_cohort

    from hyfi_imaging.preprocess import PreprocessOptions

    options = PreprocessOptions(mpp=2.0, size=(64, 96))
    root = tmp_path_factory.mktemp("cohort")
    return preprocessed_cohort(root, 2, options, seed=4, size=(256, 256), lesions=1)


def test_hyfi_predict_refuses_heatmaps_of_an_unfit_head_in_one_line(
    tmp_path: Path,
    manifest: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hyfi_imaging.cli.predict import main

    (tmp_path / "mymodels.py").write_text(
        "from torch import nn\n"
        "def build(num_classes=2, in_chans=3, **_):\n"
        "    return nn.Sequential(nn.Conv2d(in_chans, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1),\n"
        "                         nn.Flatten(1), nn.Linear(4, 8), nn.ReLU(),\n"
        "                         nn.Linear(8, num_classes))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    run = _recipe_yaml(tmp_path, name="mymodels:build")
    args = [str(run), "--manifest", str(manifest), "--out", str(tmp_path / "p.csv")]
    assert main([*args, "--heatmaps"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("hyfi-predict: error: hyfi-predict --heatmaps: model 'mymodels:build'")
    assert "1 (AdaptiveAvgPool2d) -> 2 (Flatten) -> 3 (Linear) -> 4 (ReLU) -> 5 (Linear)" in err
    assert not (tmp_path / "p.csv").exists() and not (tmp_path / "heatmaps").exists()


def test_pictures_behind_masks_and_maps_show_16_bit_channels_in_their_windows(
    tmp_path: Path,
) -> None:
    """Overlays and heat-map PNGs divided every store's first channels by 255: a uint16
    fluorescence slide (values to 4095) came out white, over a third of its pixels clipped.
    They show it as the QC pictures do: each channel over the store's display window."""
    from hyfi_imaging.io.zarr_store import write_ome_zarr
    from hyfi_imaging.train.outputs import _background

    rng = np.random.default_rng(0)
    image = rng.integers(0, 200, size=(5, 64, 64), dtype=np.uint16)  # dark glass
    image[:, 16:48, 16:48] += 3000  # tissue, bright in every channel
    store = tmp_path / "fl.zarr"
    names = ["DAPI", "CD8", "PanCK", "FITC", "Cy5"]
    write_ome_zarr(store, image, mpp=0.5, hyfi_attrs={}, chunk=32, shard=64, channel_names=names)
    rgb, factor = _background(str(store), (64, 64), 1024)
    assert factor == 1 and rgb.shape == (64, 64, 3)
    assert rgb.min() >= 0.0 and rgb.max() <= 1.0
    tissue = np.zeros((64, 64), dtype=bool)
    tissue[16:48, 16:48] = True
    assert rgb[~tissue].mean() < 0.2 < rgb[tissue].mean(), (rgb[~tissue].mean(), rgb[tissue].mean())
