"""The task recipes end to end at tiny sizes: train, the loss falls, outputs are written and read.

``slide-segmentation-synthetic`` on a 1x2 tile grid (2 ranks under mpiexec):
masks as OME-Zarr label images, overlays, per-image Dice/IoU; then
``hyfi-predict`` in one process writes the same masks as the grid did.
``cosmoflow-synthetic`` (regression of the field parameters) and ``unet3d-synthetic``
(blob segmentation) on one tile, with data replicas, and on grids of sub-volumes.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
from _launch import kernel_oom_lines, rank_killed

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
pytestmark = pytest.mark.mpi
QUICK = ("train.progress=false", "optim.warmup_steps=0", "optim.schedule=constant")


def _run(cmd: list[str], ranks: int = 1) -> subprocess.CompletedProcess[str]:
    if ranks > 1:
        cmd = [MPIEXEC, "-n", str(ranks), *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    began = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, check=False)
    cause = ""
    if proc.returncode != 0 and rank_killed(proc.stdout + proc.stderr):
        cause = "\nA rank was killed by SIGKILL; kernel log:\n" + "\n".join(kernel_oom_lines(began))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-3000:]}{cause}"
    return proc


def _train(recipe: str, out: Path, *sets: str, ranks: int = 1) -> None:
    cmd = [sys.executable, "-m", "hyfi_imaging.cli.train", str(ROOT / "recipes" / recipe)]
    for s in (f"train.out_dir={out}", *QUICK, *sets):
        cmd += ["--set", s]
    _run(cmd, ranks)


def _predict(run: Path, manifest: Path, out: Path, *args: str, ranks: int = 1) -> None:
    cmd = [sys.executable, "-m", "hyfi_imaging.cli.predict", str(run)]
    _run([*cmd, "--manifest", str(manifest), "--out", str(out), *args], ranks)


def _losses(out: Path) -> list[float]:
    with (out / "metrics.csv").open() as f:
        return [float(r["loss"]) for r in csv.DictReader(f) if r["loss"]]


def _evals(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "evals.jsonl").read_text().splitlines()]


def _falls(values: list[float]) -> bool:
    k = max(1, len(values) // 3)
    return all(map(math.isfinite, values)) and np.mean(values[-k:]) < np.mean(values[:k])


@pytest.fixture(scope="module")
def slides(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 synthetic slides with their lesion masks in labels/annotations."""
    from cohorts import preprocessed_cohort

    from hyfi_imaging.preprocess import PreprocessOptions

    options = PreprocessOptions(mpp=2.0, size=(90, 75))
    root = tmp_path_factory.mktemp("seg")
    return preprocessed_cohort(
        root, 8, options, seed=3, size=(512, 512), lesions=4, annotations=True
    )


_VAL_LOSS = """
import json, sys
from pathlib import Path
from hyfi_imaging.train.config import load_recipe
from hyfi_imaging.train.trainer import Trainer
recipe, manifest, out, batch = sys.argv[1:]
r = load_recipe(Path(recipe), [f"data.manifest={manifest}", f"train.out_dir={out}",
                               "parallel.spatial=1x1", f"train.batch_size={batch}",
                               "model.kwargs.width=4", "model.kwargs.depth=2"])
trainer = Trainer(r)
trainer.setup()
print(json.dumps(trainer.predict_masks(Path(manifest), list(range(5)), Path(out))["val_loss"]))
"""


def test_segmentation_val_loss_does_not_count_the_padded_images(
    slides: Path, tmp_path: Path
) -> None:
    """The last evaluation batch is padded with copies of its last image; the validation loss
    weighted them as images of the set ([e, f] as [e, f, f]: (e + 2f) / 3 x 2 for e + f).
    The same weights over 5 images, one image a batch and three a batch, give one loss now."""
    script = tmp_path / "val_loss.py"
    script.write_text(_VAL_LOSS)
    recipe = ROOT / "recipes" / "slide-segmentation-synthetic.yaml"
    found = []
    for batch in (1, 3):
        run = subprocess.run(
            [sys.executable, str(script), str(recipe), str(slides), str(tmp_path / f"r{batch}"),
             str(batch)],
            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        found.append(json.loads(run.stdout.splitlines()[-1]))
    assert found[1] == pytest.approx(found[0], rel=1e-5), found
    # The masks are placed as their images are: their µm/px (they were written at 1, unitless)
    from hyfi_imaging.data.dataset import load_samples
    from hyfi_imaging.io.zarr_store import ZarrReader

    sample = load_samples(slides)[0]
    with ZarrReader(sample.path) as image, ZarrReader(tmp_path / "r3" / "masks" /
                                                      f"{sample.slide_id}.zarr") as mask:  # fmt: skip
        assert image.mpp is not None and mask.mpp == image.mpp and mask.attrs["level"] == 0


def test_a_diverged_segmentation_is_not_scored(slides: Path, tmp_path: Path) -> None:
    """NaN logits were scored as all background (Dice 1 "by rule" on an empty truth) and their
    masks written; the evaluation is refused in one line, as a classifier's, before a mask."""
    script = tmp_path / "nan_eval.py"
    script.write_text(
        _VAL_LOSS.replace(
            "print(json.dumps(",
            "import torch\nwith torch.no_grad():\n"
            "    next(trainer.pm.parameters()).fill_(float('nan'))\nprint(json.dumps(",
        )
    )
    recipe = ROOT / "recipes" / "slide-segmentation-synthetic.yaml"
    run = subprocess.run(
        [sys.executable, str(script), str(recipe), str(slides), str(tmp_path / "r"), "2"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert run.returncode != 0
    assert "NonFiniteError: evaluation: the model's outputs are NaN or inf" in run.stderr
    assert not (tmp_path / "r" / "masks").exists()


def test_a_run_whose_last_outputs_fail_keeps_its_last_step(slides: Path, tmp_path: Path) -> None:
    """The last checkpoint was written after the last evaluation's masks: a mask that could
    not be written (here: a store of another kind in its place) lost every step since the
    last checkpoint. It is written first now."""
    import json as _json

    from hyfi_imaging.data.dataset import load_samples

    run = tmp_path / "run"
    for s in load_samples(slides):  # each slide's mask place taken by a store not a mask
        (run / "masks" / f"{s.slide_id}.zarr").mkdir(parents=True)
        (run / "masks" / f"{s.slide_id}.zarr" / "zarr.json").write_text(
            _json.dumps({"zarr_format": 3, "node_type": "group",
                         "attributes": {"hyfi": {"kind": "slide"}}})
        )  # fmt: skip
    cmd = [sys.executable, "-m", "hyfi_imaging.cli.train",
           str(ROOT / "recipes" / "slide-segmentation-synthetic.yaml")]  # fmt: skip
    for s in (f"train.out_dir={run}", *QUICK, f"data.manifest={slides}", "model.kwargs.width=4",
              "model.kwargs.depth=2", "parallel.spatial=1x1", "train.epochs=1",
              "train.checkpoint_every_steps=0"):  # fmt: skip
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    assert proc.returncode == 2 and "is a slide store" in proc.stderr, proc.stderr[-2000:]
    steps = len(_losses(run))
    assert steps > 0 and (run / "checkpoints" / f"step_{steps:08d}").is_dir()


@pytest.mark.slow  # hyfi-plan ranks every layout (the suite's time)
def test_the_planner_plans_a_segmentation_recipe_as_training_runs_it(
    slides: Path, tmp_path: Path
) -> None:
    """hyfi-plan refused the recipe (it read the masks' manifest for class labels), and
    parallel=auto could pick pipeline stages, which segmentation training refuses: both
    leave out what the trainer refuses for the task."""
    from hyfi_imaging.errors import ConfigError
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.train.autoplan import cohort_check
    from hyfi_imaging.train.config import load_recipe

    recipe = ROOT / "recipes" / "slide-segmentation-synthetic.yaml"
    sets = [f"data.manifest={slides}", "model.kwargs.width=4", "model.kwargs.depth=2"]
    with pytest.raises(ConfigError, match="segmentation reads each mask tile on the first stage"):
        cohort_check(load_recipe(recipe, sets))(Layout(pp=2))
    run = subprocess.run(
        [sys.executable, "-m", "hyfi_imaging.cli.plan", str(recipe), "--devices", "2",
         *(a for s in sets for a in ("--set", s))],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "pp=2" not in run.stdout and "recommended: dp=2 x pp=1" in run.stdout, run.stdout


@pytest.mark.slow
def test_slide_segmentation_on_a_grid_writes_masks(slides: Path, tmp_path: Path) -> None:
    from hyfi_imaging.io.labels import open_labels

    run = tmp_path / "run"
    _train(
        "slide-segmentation-synthetic.yaml",
        run,
        f"data.manifest={slides}",
        "model.kwargs.width=4",
        "model.kwargs.depth=2",
        "data.augment.flip=false",
        "data.augment.rot90=false",
        "optim.lr=0.01",
        "train.epochs=3",
        "train.checkpoint_every_steps=0",
        ranks=2,  # parallel.spatial 1x2 from the recipe
    )
    assert _falls(_losses(run)), _losses(run)
    rows = list(csv.DictReader((run / "val_per_image.csv").open()))
    assert len(rows) == 2 and all(0 <= float(r["dice"]) <= 1 for r in rows)
    assert {"dice", "iou", "val_loss"} <= set(_evals(run)[-1])
    assert len(list((run / "overlays").glob("*.png"))) == 2
    grid = {}
    for r in rows:
        with open_labels(run / "masks" / f"{r['id']}.zarr", "prediction") as reader:
            assert reader.level_dimensions[0] == (90, 75)
            grid[r["id"]] = reader.read_region(0, 0, 0, 90, 75)[0]
    # hyfi-predict on one tile: masks of every slide, the grid's within float32 rounding.
    pred = tmp_path / "pred"
    _predict(run, slides, pred, "--overlays", "1")
    assert len(list((pred / "masks").glob("*.zarr"))) == 8
    assert len(list(csv.DictReader((pred / "per_image.csv").open()))) == 8
    for sid, mask in grid.items():
        with open_labels(pred / "masks" / f"{sid}.zarr", "prediction") as reader:
            assert (reader.read_region(0, 0, 0, 90, 75)[0] == mask).mean() > 0.99
    # Again into the same folder, on two of the slides without their label images: the
    # earlier per_image.csv (scores of masks now replaced) went on standing beside them.
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    data = slides.parent if slides.is_file() else slides
    lines = (data / "manifest.csv").read_text().splitlines()
    for line in lines[1:3]:
        store = line.split(",")[1]
        shutil.copytree(data / store, bare / store)
        shutil.rmtree(bare / store / "labels")
    (bare / "manifest.csv").write_text("\n".join(lines[:3]) + "\n")
    again = _run([sys.executable, "-m", "hyfi_imaging.cli.predict", str(run), "--manifest",
                  str(bare), "--out", str(pred), "--overlays", "0"])  # fmt: skip
    assert not (pred / "per_image.csv").exists(), again.stdout
    assert "removed" in again.stdout and "also holds 6 mask(s) of an earlier" in again.stdout


@pytest.mark.slow
def test_cosmoflow_regression_learns_and_predicts(tmp_path: Path) -> None:
    from hyfi_imaging.data.volumes import write_grf_cohort

    manifest = write_grf_cohort(tmp_path / "grf", 8, size=16)
    run = tmp_path / "run"
    _train(
        "cosmoflow-synthetic.yaml",
        run,
        f"data.manifest={manifest}",
        "model.kwargs.size=16",
        "model.kwargs.n_conv_layers=2",
        "parallel.data=1",
        "parallel.spatial=1x1x1",
        "train.batch_size=2",
        "train.epochs=3",
    )
    evals = _evals(run)
    assert len(evals) == 3 and evals[-1]["mse"] < evals[0]["mse"], evals
    assert {"mae", "mae_spectral_index", "mae_amplitude"} <= set(evals[-1])
    with (run / "val_predictions.csv").open(newline="") as fh:
        split = [r["split"] for r in csv.DictReader(fh)]
    assert sorted(split) == ["train"] * 6 + ["val"] * 2, split  # every volume, with its use
    out = tmp_path / "pred.csv"
    _predict(run, manifest, out)
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 8 and set(rows[0]) == {
        "id",
        "pred_spectral_index",
        "pred_amplitude",
        "true_spectral_index",
        "true_amplitude",
    }


def test_cosmoflow_trains_on_a_grid_of_sub_volumes_like_one_process(tmp_path: Path) -> None:
    """The recipe's ``parallel.spatial: 1x1x2`` on a volume the grid divides evenly (16^3, two
    sub-volumes of 16x16x8): the 'same'-padded convolutions, pools and the flatten that gathers
    the last map into the dense head give the losses of one process (float32 rounding)."""
    from hyfi_imaging.data.volumes import write_grf_cohort

    manifest = write_grf_cohort(tmp_path / "grf", 4, size=16)
    sets = (
        f"data.manifest={manifest}",
        "model.kwargs.size=16",
        "model.kwargs.n_conv_layers=2",
        "parallel.data=1",
        "train.batch_size=1",
        "train.epochs=1",
        "data.augment.rot90=false",
        "optim.name=sgd",
        "optim.lr=0.01",
    )
    grid, one = tmp_path / "grid", tmp_path / "one"
    _train("cosmoflow-synthetic.yaml", grid, *sets, "parallel.spatial=1x1x2", ranks=2)
    _train("cosmoflow-synthetic.yaml", one, *sets, "parallel.spatial=1x1x1")
    got, want = _losses(grid), _losses(one)
    assert len(got) == len(want) == 3 and np.allclose(got, want, rtol=1e-5), (got, want)


@pytest.mark.slow
def test_unet3d_segmentation_with_data_replicas(tmp_path: Path) -> None:
    from hyfi_imaging.data.volumes import write_blob_cohort
    from hyfi_imaging.io.volume_store import VolumeStore, read_subvolume

    manifest = write_blob_cohort(
        tmp_path / "blobs", 8, shape=16, n_blobs=3, radius_range=(2.0, 4.0)
    )
    run = tmp_path / "run"
    _train(
        "unet3d-synthetic.yaml",
        run,
        f"data.manifest={manifest}",
        "parallel.data=2",
        "train.batch_size=1",
        "train.epochs=3",
        "optim.lr=0.01",
        ranks=2,
    )
    assert _falls(_losses(run)), _losses(run)
    rows = list(csv.DictReader((run / "val_per_image.csv").open()))
    assert len(rows) == 2
    store = VolumeStore(run / "masks" / f"{rows[0]['id']}.zarr", label="prediction")
    mask = read_subvolume(store, 0, (0, 0, 0, 16, 16, 16))[0]
    assert mask.shape == (16, 16, 16) and set(np.unique(mask)) <= {0, 1}


# slow since 2026-11-27 (the suite's time): the CosmoFlow recipe trains on sub-volumes above, and
# test_volume_mpi runs the 3D U-Net on a 3-D grid
@pytest.mark.slow
def test_unet3d_trains_on_a_grid_of_sub_volumes_like_one_process(tmp_path: Path) -> None:
    """``parallel.spatial=2x1x2``: 4 ranks each read and train their sub-volume (+ halo);
    the losses equal one process's (float32 rounding) and the gathered masks are whole."""
    from hyfi_imaging.data.volumes import write_blob_cohort
    from hyfi_imaging.io.volume_store import VolumeStore, read_subvolume

    manifest = write_blob_cohort(tmp_path / "blobs", 4, shape=(12, 10, 14), n_blobs=2)
    sets = (
        f"data.manifest={manifest}",
        "train.epochs=1",
        "train.batch_size=1",
        "data.augment.rot90=false",
        # SGD: Adam would turn the rounding noise of BatchNorm-cancelled biases into steps.
        "optim.name=sgd",
        "optim.lr=0.05",
    )
    grid, one = tmp_path / "grid", tmp_path / "one"
    _train("unet3d-synthetic.yaml", grid, *sets, "parallel.spatial=2x1x2", ranks=4)
    _train("unet3d-synthetic.yaml", one, *sets)
    got, want = _losses(grid), _losses(one)
    assert len(got) == len(want) == 3 and np.allclose(got, want, rtol=1e-5), (got, want)
    rows = list(csv.DictReader((grid / "val_per_image.csv").open()))
    store = VolumeStore(grid / "masks" / f"{rows[0]['id']}.zarr", label="prediction")
    assert read_subvolume(store, 0, (0, 0, 0, 12, 10, 14))[0].shape == (12, 10, 14)
    # hyfi-predict on the grid (its parser took 2-D grids only) writes one process's masks
    _predict(grid, manifest, tmp_path / "p1")
    _predict(grid, manifest, tmp_path / "p4", "--spatial", "2x1x2", ranks=4)
    assert (tmp_path / "p1" / "per_image.csv").read_text() == (
        tmp_path / "p4" / "per_image.csv"
    ).read_text()
    for r in rows:
        masks = [VolumeStore(tmp_path / p / "masks" / f"{r['id']}.zarr", label="prediction")
                 for p in ("p1", "p4")]  # fmt: skip
        got = [read_subvolume(m, 0, (0, 0, 0, 12, 10, 14)) for m in masks]
        image = VolumeStore(manifest.parent / f"{r['id']}.zarr")
        assert np.array_equal(*got) and masks[1].voxel_size == image.voxel_size
