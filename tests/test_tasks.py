"""Training tasks in one process: losses, metrics, outputs, and refusals before any rank starts.

The tiled exactness of Dice + cross-entropy is tests/test_dense_loss_mpi.py;
whole runs of the task recipes are tests/test_task_recipes_mpi.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hyfi_imaging.data.volumes import write_blob_cohort, write_grf_cohort
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.train.config import load_recipe
from hyfi_imaging.train.losses import (
    DiceCELoss,
    RegressionLoss,
    overlap_counts,
    regression_errors,
    scores_from_counts,
)
from hyfi_imaging.train.preflight import preflight
from hyfi_imaging.train.tasks import manifest_kind

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


# -- losses and metrics ------------------------------------------------------------------------
def test_dice_ce_is_the_sum_of_its_terms() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 3, (2, 5, 7), generator=gen)
    p = torch.softmax(logits, 1)
    t = F.one_hot(target, 3).movedim(-1, 1).double()
    inter, total = (p * t).sum((2, 3)), (p + t).sum((2, 3))
    dice = ((2 * inter + 1) / (total + 1)).mean()  # per image and class, then the mean
    want = 0.5 * F.cross_entropy(logits, target) + 2.0 * (1 - dice)
    got = DiceCELoss(ce_weight=0.5, dice_weight=2.0)(logits, target)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-12)
    got.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_dice_ce_of_a_perfect_prediction_is_small_and_volumes_work() -> None:
    target = torch.zeros(1, 4, 6, 8, dtype=torch.long)
    target[:, 1:3, 2:5, 3:6] = 1
    logits = 40.0 * F.one_hot(target, 2).movedim(-1, 1).double()  # (N, K, D, H, W)
    assert float(DiceCELoss()(logits, target)) < 1e-6
    with pytest.raises(ConfigError, match="do not match the logits"):
        DiceCELoss()(logits, target[..., :4])


def test_overlap_counts_and_scores_by_hand() -> None:
    target = torch.tensor([[[0, 1, 1, 0]], [[0, 0, 0, 0]]])  # (N=2, 1, 4)
    pred = torch.tensor([[[0, 1, 0, 1]], [[0, 0, 0, 0]]])
    logits = F.one_hot(pred, 2).movedim(-1, 1).double()
    counts = overlap_counts(logits, target)
    assert counts.shape == (2, 2, 3)
    assert counts[0, 1].tolist() == [1, 2, 2]  # intersection, predicted, true of class 1
    dice, iou = scores_from_counts(counts)
    assert dice.tolist() == pytest.approx([0.5, 1.0])  # image 2: nothing to find, none found
    assert iou.tolist() == pytest.approx([1 / 3, 1.0])


def test_regression_losses_and_errors() -> None:
    out = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    target = torch.tensor([[1.5, 2.0], [2.0, 5.0]])
    assert float(RegressionLoss("mse")(out, target)) == pytest.approx((0.25 + 1.0) / 4)
    assert float(RegressionLoss("mae")(out, target)) == pytest.approx(1.5 / 4)
    errors = regression_errors(out, target, ["index", "amplitude"])
    assert errors["mae_index"] == pytest.approx(0.75) and errors["mae_amplitude"] == 0.0
    assert errors["mse"] == pytest.approx(1.25 / 4)
    with pytest.raises(ConfigError, match="number of outputs"):
        RegressionLoss()(out[:, :1], target)


# -- recipes and preflight ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def volumes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("volumes")
    return {
        "grf": write_grf_cohort(root / "grf", 4, size=8),
        "blobs": write_blob_cohort(root / "blobs", 2, shape=8, n_blobs=2, radius_range=(1.5, 2.5)),
    }


def _load(recipe: str, tmp_path: Path, *sets: str) -> object:
    return load_recipe(ROOT / "recipes" / recipe, [f"train.out_dir={tmp_path / 'run'}", *sets])


def test_task_shorthand_and_manifest_kind(tmp_path: Path, volumes: dict[str, Path]) -> None:
    r = load_recipe(ROOT / "recipes" / "synthetic.yaml", ["task=segmentation"])
    assert r.task.name == "segmentation" and r.task.loss == "auto"
    assert manifest_kind(volumes["grf"]) == "volumes"
    assert manifest_kind(tmp_path / "missing.csv") == "slides"


def test_volume_recipes_pass_preflight(tmp_path: Path, volumes: dict[str, Path]) -> None:
    cosmo = _load(
        "cosmoflow-synthetic.yaml",
        tmp_path,
        f"data.manifest={volumes['grf']}",
        "model.kwargs.size=8",
        "model.kwargs.n_conv_layers=2",
        "train.batch_size=1",
    )
    preflight(cosmo)  # type: ignore[arg-type]
    unet = _load(  # 2 volumes: 1 validates (at least one of two), 1 trains
        "unet3d-synthetic.yaml", tmp_path, f"data.manifest={volumes['blobs']}", "train.batch_size=1"
    )
    preflight(unet)  # type: ignore[arg-type]


def test_a_regression_cohorts_targets_are_the_manifests(
    tmp_path: Path, volumes: dict[str, Path]
) -> None:
    """The CSVs' true_ columns held float32 roundings (2.273923397064209 for the manifest's
    2.2739233746429086): the cohort keeps the manifest's float64."""
    from hyfi_imaging.data.volume_manifest import read_volume_manifest
    from hyfi_imaging.train.tasks import load_cohort

    r = _load("cosmoflow-synthetic.yaml", tmp_path, f"data.manifest={volumes['grf']}")
    cohort = load_cohort(r, volumes["grf"])
    rows = [row for row in read_volume_manifest(volumes["grf"]) if row.status == "ok"]
    assert cohort.targets is not None
    want = [[row.targets[n] for n in cohort.target_names] for row in rows]
    assert cohort.targets.tolist() == want


def test_integer_volumes_are_read_over_their_types_maximum(tmp_path: Path) -> None:
    """uint16 voxels reached the model as 0-65535 (slides' default is x / 65535); floats as
    stored."""
    from hyfi_imaging.data.volume_dataset import VolumeDataset
    from hyfi_imaging.data.volume_manifest import VolumeRow, write_volume_manifest
    from hyfi_imaging.io.volume_store import write_ome_zarr_volume

    voxels = np.arange(2 * 4 * 4 * 4, dtype=np.uint16).reshape(2, 4, 4, 4) * 500
    write_ome_zarr_volume(tmp_path / "v.zarr", voxels, voxel_size=(1.0, 1.0, 1.0), chunks=4,
                          channel_names=["a", "b"], name="v")  # fmt: skip
    manifest = write_volume_manifest(
        [VolumeRow("v", "v.zarr", (4, 4, 4), (1.0, 1.0, 1.0), {"x": 1.0}, "", "ok", "", "test")],
        tmp_path / "manifest.csv",
    )
    for mode, want in (("dtype", voxels / np.float32(65535)), (None, voxels)):
        got = VolumeDataset(manifest, target="regression", targets=["x"], normalize=mode)[0]
        np.testing.assert_array_equal(got["image"].numpy(), want.astype(np.float32))


@pytest.mark.parametrize(
    ("recipe", "cohort", "sets", "message"),
    [
        (
            "cosmoflow-synthetic.yaml",
            "grf",
            ["task.targets=[spectral_index, omega_m]"],
            "has no target omega_m",
        ),
        ("cosmoflow-synthetic.yaml", "grf", ["parallel.spatial=1x2"], "a grid of 2-D tiles"),
        ("cosmoflow-synthetic.yaml", "grf", ["task.loss=dice_ce"], "not a regression loss"),
        ("cosmoflow-synthetic.yaml", "grf", ["task.name=classification"], "have no class labels"),
        ("unet3d-synthetic.yaml", "blobs", ["model.name=unet2d"], "is 2-D but the images"),
        ("unet3d-synthetic.yaml", "grf", [], "names no label image"),
        (
            "cosmoflow-synthetic.yaml",
            "blobs",
            [
                "task.name=segmentation",
                "task.loss=auto",
                "data.classes=[bg, blob]",
                "task.foreground=true",
            ],
            "gives (1, 2) for one image, but segmentation needs (1, 2, 8, 8, 8)",
        ),
        ("unet3d-synthetic.yaml", "blobs", ["parallel.pipeline=2"], "parallel.pipeline"),
        ("unet3d-synthetic.yaml", "blobs", ["data.classes=[background]"], "at least two"),
        # settings the volume path does not apply: they trained as if absent
        (
            "unet3d-synthetic.yaml",
            "blobs",
            ["data.normalize.mode=percentile"],
            "is percentile, but the volumes of",
        ),
        ("cosmoflow-synthetic.yaml", "grf", ["data.augment.brightness=0.5"], "is for slides"),
        # a count that fits no channel count failed after set-up with a traceback
        ("cosmoflow-synthetic.yaml", "grf", ["data.mean=[0.0, 0.0]"], "data.mean: has 2 values"),
        # a label no class names: refused at the first evaluation (or step) that read it
        (
            "unet3d-synthetic.yaml",
            "blobs",
            ["task.foreground=false"],
            "has label value 2 but data.classes names 2 classes (blobs_000)",
        ),
        # a flatten head sized for other volumes: a matmul traceback from the first step
        ("cosmoflow-synthetic.yaml", "grf", ["model.kwargs.size=16"], "CosmoFlow (head="),
    ],
)
def test_volume_task_refusals_are_one_line(
    tmp_path: Path,
    volumes: dict[str, Path],
    recipe: str,
    cohort: str,
    sets: list[str],
    message: str,
) -> None:
    base = ["model.kwargs.size=8", "model.kwargs.n_conv_layers=2", "train.batch_size=1"]
    r = _load(
        recipe,
        tmp_path,
        f"data.manifest={volumes[cohort]}",
        *(base if "cosmoflow" in recipe else ["train.batch_size=1"]),  # 1 of 2 blobs trains
        *sets,
    )
    with pytest.raises(ConfigError) as err:
        preflight(r)  # type: ignore[arg-type]
    assert message in str(err.value) and "\n" not in str(err.value)


def test_segmentation_of_slides_without_masks_is_refused(tmp_path: Path) -> None:
    """A slide store without labels/annotations: one line naming the fix, before any rank."""
    from cohorts import preprocessed_cohort

    from hyfi_imaging.preprocess import PreprocessOptions

    options = PreprocessOptions(mpp=2.0, size=(64, 64))
    manifest = preprocessed_cohort(tmp_path, 2, options, seed=1, size=(256, 256), lesions=2)
    r = _load("slide-segmentation-synthetic.yaml", tmp_path, f"data.manifest={manifest}")
    with pytest.raises(ConfigError) as err:
        preflight(r)  # type: ignore[arg-type]
    assert "have no label image 'annotations'" in str(err.value)
    assert "--annotations" in str(err.value) and "\n" not in str(err.value)
    r = _load(
        "slide-segmentation-synthetic.yaml",
        tmp_path,
        f"data.manifest={manifest}",
        "task.name=regression",
    )
    with pytest.raises(ConfigError, match="is a slide manifest"):
        preflight(r)  # type: ignore[arg-type]


def test_hyfi_train_refuses_an_unknown_task_with_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hyfi_imaging.cli.train import main

    code = main([str(ROOT / "recipes" / "cosmoflow-synthetic.yaml"), "--set", "task=detection"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "task.name" in err, err


def test_mask_writer_roundtrip(tmp_path: Path) -> None:
    """A predicted mask is an OME-Zarr label image with class names (2-D and 3-D)."""
    from hyfi_imaging.io.labels import open_labels
    from hyfi_imaging.io.volume_store import VolumeStore, read_subvolume
    from hyfi_imaging.io.zarr_store import ZarrReader
    from hyfi_imaging.train.outputs import write_mask

    mask = np.zeros((37, 45), np.uint8)
    mask[5:20, 7:30] = 1
    out = write_mask(
        tmp_path / "s.zarr", mask, classes=["background", "lesion"], image="x", scale=2.0
    )
    with open_labels(out, "prediction") as reader:
        assert np.array_equal(reader.read_region(0, 0, 0, 37, 45)[0], mask)
    cube = np.zeros((6, 7, 8), np.uint8)
    cube[1:4, 2:5, 3:7] = 1
    out = write_mask(
        tmp_path / "v.zarr", cube, classes=["background", "blob"], image="y", scale=None
    )
    store = VolumeStore(out, label="prediction")
    assert np.array_equal(read_subvolume(store, 0, (0, 0, 0, 6, 7, 8))[0], cube)
    # The image's own scale and level (the masks were written at 1 µm/px, level unsaid)
    out = write_mask(tmp_path / "a.zarr", cube, classes=["background", "blob"], image="y",
                     scale=(2.0, 0.5, 0.5), level=1)  # fmt: skip
    assert VolumeStore(out).voxel_size == (2.0, 0.5, 0.5) and VolumeStore(out).attrs["level"] == 1
    with ZarrReader(tmp_path / "s.zarr") as reader:
        assert reader.mpp == 2.0 and reader.attrs["level"] == 0
        # the image as an absolute path: 'x' relative to where the command ran named
        # nothing from the mask's folder or any other
        assert reader.attrs["image"] == os.path.abspath("x")
    # Placed on the image: a map of level 1 is centred on 2x2(x2) level-0 pixels (voxels): a
    # viewer drew it half a level-0 pixel up and left (volume stores' levels as well)
    a = json.loads((tmp_path / "a.zarr" / "zarr.json").read_text())["attributes"]["ome"]
    first = a["multiscales"][0]["datasets"][0]
    assert first["coordinateTransformations"][1]["translation"] == [0.0, 0.5, 0.125, 0.125]
    from hyfi_imaging.io.volume_store import _multiscales

    mean, nearest = (_multiscales("v", (2.0, 0.5, 0.5), 2, m) for m in ("mean", "nearest"))
    assert mean["datasets"][1]["coordinateTransformations"][1]["translation"] == [
        0.0, 1.0, 0.25, 0.25,
    ]  # fmt: skip
    assert len(nearest["datasets"][1]["coordinateTransformations"]) == 1  # its first voxel
    flat = write_mask(tmp_path / "f.zarr", mask, classes=["background", "lesion"], image="x",
                      scale=2.0, level=1)  # fmt: skip
    for group in (flat, flat / "labels" / "prediction"):
        ms = json.loads((group / "zarr.json").read_text())["attributes"]["ome"]["multiscales"]
        assert ms[0]["datasets"][0]["coordinateTransformations"][1]["translation"] == [
            0.0,
            0.5,
            0.5,
        ]


def test_a_volume_mask_is_a_prediction_with_class_levels(tmp_path: Path) -> None:
    """A volume mask was marked a 'volume' store, so predicting again into the same folder
    (and a resumed 3-D segmentation's final masks) was refused; its image's coarser levels
    were means of class numbers (classes 0 and 2 made a level of class 1)."""
    import zarr

    from hyfi_imaging.train.outputs import write_mask

    cube = np.zeros((32, 32, 32), np.uint8)
    cube[:, :, ::2] = 2  # classes 0 and 2 side by side: their mean is 1
    for _ in range(2):  # the second replaces the first: a new prediction of the same volume
        out = write_mask(tmp_path / "m.zarr", cube, classes=["bg", "a", "b"], image="v",
                         scale=None)  # fmt: skip
    group = zarr.open_group(str(out), mode="r")
    assert group.attrs["hyfi"]["kind"] == "prediction"
    levels = sorted(k for k in group.array_keys())
    assert len(levels) > 1  # a pyramid: its levels hold the classes there are, nothing else
    for key in levels:
        assert set(np.unique(group[key][:]).tolist()) <= {0, 2}, key


def test_hyfi_predict_refuses_volumes_without_the_targets(
    tmp_path: Path, volumes: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's targets are checked against the manifest before any rank starts."""
    from hyfi_imaging.cli.predict import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text((ROOT / "recipes" / "cosmoflow-synthetic.yaml").read_text())
    code = main([str(run), "--manifest", str(volumes["blobs"]), "--out", str(tmp_path / "p.csv")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "has no target spectral_index" in err


def test_a_negative_label_is_refused_in_one_line() -> None:
    """A signed label image's -1 reached the loss (an IndexError traceback)."""
    from hyfi_imaging.errors import HyfiError
    from hyfi_imaging.train.tasks import _MaskTarget

    with pytest.raises(HyfiError, match=r"holds label -1 but data.classes names 2 classes"):
        _MaskTarget(2, False, "v0")(np.array([[0, 1], [-1, 0]], dtype=np.int8))


def _train_blobs(tmp_path: Path, volumes: dict[str, Path]) -> Path:
    """One step of the 3D U-Net recipe on the two blob volumes (one trains, one validates);
    returns the run's folder."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    train = [
        sys.executable,
        "-m",
        "hyfi_imaging.cli.train",
        str(ROOT / "recipes" / "unet3d-synthetic.yaml"),
    ]
    for item in (f"data.manifest={volumes['blobs']}", f"train.out_dir={run}", "train.max_steps=1",
                 "train.epochs=1", "train.progress=false", "train.batch_size=1"):  # fmt: skip
        train += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.run(train, capture_output=True, text=True, env=env, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    return run


@pytest.mark.slow  # a training and two predictions (the suite's time)
def test_hyfi_predict_segments_volumes_without_label_images(
    tmp_path: Path, volumes: dict[str, Path]
) -> None:
    """Refused ('names no label image') where the guide says such images are predicted without
    scores: the masks are those of the labelled rows, and no per_image.csv."""
    import os
    import subprocess
    import sys

    from hyfi_imaging.data.volume_manifest import read_volume_manifest, write_volume_manifest
    from hyfi_imaging.io.volume_store import VolumeStore, read_subvolume

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = _train_blobs(tmp_path, volumes)
    rows = read_volume_manifest(volumes["blobs"])
    bare = volumes["blobs"].parent / "bare.csv"
    write_volume_manifest([dataclasses.replace(r, labels="") for r in rows], bare)
    masks = {}
    for name, manifest in (("with", volumes["blobs"]), ("without", bare)):
        out = tmp_path / name
        predict = [sys.executable, "-m", "hyfi_imaging.cli.predict", str(run), "--manifest",
                   str(manifest), "--out", str(out), "--spatial", "1x1x2"]  # fmt: skip
        launch = [str(Path(sys.executable).with_name("mpiexec")), "-n", "2", *predict]
        job = subprocess.run(launch, capture_output=True, text=True, env=env, timeout=300)
        assert job.returncode == 0, job.stderr[-3000:]
        store = VolumeStore(out / "masks" / f"{rows[0].volume_id}.zarr", label="prediction")
        masks[name] = read_subvolume(store, 0, (0, 0, 0, *rows[0].shape))[0]
        assert (out / "per_image.csv").exists() == (name == "with")
    np.testing.assert_array_equal(masks["with"], masks["without"])


@pytest.mark.slow  # a training and a prediction (the suite's time)
def test_a_volume_model_refuses_volumes_of_other_voxels(
    tmp_path: Path, volumes: dict[str, Path]
) -> None:
    """A model trained on 2 x 0.5 x 0.5 µm voxels predicted 0.5 µm ones without a word (slides
    have their µm/px checked): the checkpoint records its voxel sizes."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = _train_blobs(tmp_path, volumes)
    lines = volumes["blobs"].read_text().splitlines()
    cols = lines[0].split(",")
    rows = [r.split(",") for r in lines[1:]]
    for r in rows:
        r[cols.index("voxel_z")] = str(2 * float(r[cols.index("voxel_z")]))
        r[cols.index("path")] = str((volumes["blobs"].parent / r[cols.index("path")]).resolve())
    other = tmp_path / "other.csv"
    other.write_text("\n".join([lines[0], *(",".join(r) for r in rows)]) + "\n")
    predict = [sys.executable, "-m", "hyfi_imaging.cli.predict", str(run), "--manifest",
               str(other), "--out", str(tmp_path / "pred")]  # fmt: skip
    job = subprocess.run(predict, capture_output=True, text=True, env=env, timeout=300)
    assert job.returncode == 2, job.stderr[-3000:]
    assert "trained with another voxel sizes" in job.stderr, job.stderr


def test_a_mask_of_a_level_without_a_pixel_size_lies_on_its_image(tmp_path: Path) -> None:
    """A mask predicted at ``data.level: 1`` on stores that record no µm/px (PNG slides)
    counts the image's level-0 pixels: scale 2, its pixel the centre of 2x2 (translation
    0.5), as the image's own level 1 and in its label image too. It had scale 1 and no
    translation: a viewer drew it over the image's top-left quarter at half size."""
    from hyfi_imaging.train.outputs import write_mask

    mask = np.zeros((8, 6), np.uint8)
    out = write_mask(tmp_path / "m.zarr", mask, classes=["bg", "x"], image="i", scale=None, level=1)
    for group in (out, out / "labels" / "prediction"):
        ome = json.loads((group / "zarr.json").read_text())["attributes"]["ome"]
        first = ome["multiscales"][0]["datasets"][0]["coordinateTransformations"]
        assert first == [
            {"type": "scale", "scale": [1.0, 2.0, 2.0]},
            {"type": "translation", "translation": [0.0, 0.5, 0.5]},
        ], (group, first)
    cube = np.zeros((4, 4, 4), np.uint8)
    out = write_mask(tmp_path / "v.zarr", cube, classes=["bg", "x"], image="i", scale=None, level=1)
    first = json.loads((out / "zarr.json").read_text())["attributes"]["ome"]["multiscales"][0]
    assert first["datasets"][0]["coordinateTransformations"][0]["scale"] == [1.0, 2.0, 2.0, 2.0]


def test_a_heat_map_picture_replaces_only_an_earlier_one(tmp_path: Path) -> None:
    """``hyfi-predict --heatmaps DIR`` on the folder of PNG slides replaced each slide by its
    heat map's picture, exit 0 (only the ``.zarr`` store was checked): a PNG is replaced only
    when its text says a heat map wrote it."""
    import pytest
    from matplotlib.figure import Figure
    from PIL import Image

    from hyfi_imaging.errors import ConfigError
    from hyfi_imaging.train.outputs import HEATMAP_KIND, check_replaceable
    from hyfi_imaging.train.plots import _save_atomic

    slide = tmp_path / "slide.png"
    Image.new("RGB", (8, 8), "white").save(slide)
    with pytest.raises(ConfigError, match=r"slide.png: exists and is a file \(not a class"):
        check_replaceable(slide, HEATMAP_KIND)
    picture = _save_atomic(Figure(), tmp_path / "map.png", HEATMAP_KIND)
    check_replaceable(picture, HEATMAP_KIND)  # an earlier prediction's: replaced
    (tmp_path / "bad.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(ConfigError):
        check_replaceable(tmp_path / "bad.png", HEATMAP_KIND)
