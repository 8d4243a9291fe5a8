"""Class activation maps on several ranks: exact against one process, and the command end to end.

* The worker (``tests/workers/heatmaps.py``) stitches the maps of 1x2, 2x2 and a 2-stage
  pipeline on 1x2 tiles and compares them with one process's ``W F + b`` in float64.
* ``hyfi-train`` then ``hyfi-predict --heatmaps`` on a real preprocessed cohort: the
  maps of 1 and 4 (2x2) processes agree, their means are the logits the CSV's
  probabilities come from, the OME-Zarr is placed on the slide through the store's
  provenance, the PNG exists; training wrote every slide with its split.
* Slow: the same path at 8192² on 2x2 stays within memory.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
from _launch import REPO, Job, have_mpiexec, json_line, mpiexec, plain

from hyfi_imaging.io.zarr_store import ZarrReader, read_hyfi_attrs

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not installed"),
]
WORKER = Path(__file__).parent / "workers" / "heatmaps.py"

#: launch -> (ranks, pp, grid, cases): one mpiexec per layout, its cases in one go.
LAUNCHES: dict[str, tuple[int, int, tuple[int, int], list[str]]] = {
    "1x2": (2, 1, (1, 2), ["resnet18-avg", "amoebanet"]),
    "2x2": (4, 1, (2, 2), ["resnet18-avg", "resnet18-max", "convchain"]),
    "pp2-1x2": (4, 2, (1, 2), ["resnet18-avg"]),
}


@pytest.fixture(scope="module")
def worlds() -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, (n, pp, grid, cases) in LAUNCHES.items():
        job = mpiexec(n, str(WORKER), str(pp), *map(str, grid), "64", "96", *cases, timeout=240)
        assert job.returncode == 0, job.describe()
        lines = [json.loads(ln) for ln in job.stdout.splitlines() if ln.startswith("{")]
        out[name] = {r["case"]: r for r in lines}
    return out


@pytest.mark.parametrize(
    ("launch", "case"),
    [(launch, case) for launch, (_, _, _, cases) in LAUNCHES.items() for case in cases],
)
def test_stitched_maps_equal_one_process_in_float64(
    worlds: dict[str, dict[str, dict[str, Any]]], launch: str, case: str
) -> None:
    r = worlds[launch][case]
    scale = 2 if case == "amoebanet" else 1
    stride = 1 if case == "convchain" else 32
    fh, fw = -(-64 * scale // stride), -(-96 * scale // stride)
    assert r["shape"] == [3, 3, fh, fw] and r["feature_hw"] == [fh, fw], r
    assert r["max_rel_error"] < 1e-12 and r["logits_rel_error"] < 1e-12, r
    assert r["hooks_left"] == 0, r
    if case != "resnet18-max":  # average pool: the mean of each class map is its logit
        assert r["mean_vs_logit"] < 1e-12, r
    else:  # max pool: the map is W F + b all the same, but its mean is no logit
        assert r["mean_vs_logit"] > 1e-3, r


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cohorts import preprocessed_cohort

    from hyfi_imaging.preprocess import PreprocessOptions

    options = PreprocessOptions(mpp=1.0, size=(192, 256), fit="crop")
    root = tmp_path_factory.mktemp("cohort")
    return preprocessed_cohort(root, 6, options, seed=4, size=(384, 512), lesions=2)


def _ok(job: Job) -> Job:
    assert job.returncode == 0, job.describe()
    return job


def _map(path: Path) -> np.ndarray:
    with ZarrReader(path) as reader:
        h, w = reader.level_dimensions[0]
        return reader.read_region(0, 0, 0, h, w).astype(np.float64)


def test_train_then_predict_heatmaps_on_one_and_four_processes(
    manifest: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    train = ["-m", "hyfi_imaging.cli.train", str(REPO / "recipes" / "synthetic.yaml")]
    for s in (
        f"data.manifest={manifest}",
        f"train.out_dir={run}",
        "model.kwargs.width=0.125",
        "parallel.spatial=1x1",
        "train.epochs=1",
        "train.max_steps=1",
        "train.batch_size=2",
        "train.progress=false",
    ):
        train += ["--set", s]
    _ok(plain(*train, timeout=300))

    # Training: every slide once, with the split it was in and the final model's prediction.
    with (run / "val_predictions.csv").open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == ["slide_id", "split", "label", "pred", "p_0", "p_1"]
    assert sorted(r["slide_id"] for r in rows) == [f"synth_{i:03d}" for i in range(6)]
    assert sorted(r["split"] for r in rows) == ["train"] * 4 + ["val"] * 2  # 0.25 per class
    assert all(float(r["p_0"]) + float(r["p_1"]) == pytest.approx(1, abs=2e-6) for r in rows)

    predict = ["-m", "hyfi_imaging.cli.predict", str(run), "--manifest", str(manifest)]
    one = _ok(plain(*predict, "--out", str(tmp_path / "one" / "p.csv"), "--heatmaps", timeout=300))
    assert "6 heat maps -> " in one.stdout, one.describe()
    four = mpiexec(
        4,
        *predict,
        "--out",
        str(tmp_path / "four.csv"),
        "--spatial",
        "2x2",
        "--heatmaps",
        str(tmp_path / "maps4"),
        timeout=300,
    )
    _ok(four)

    with (tmp_path / "one" / "p.csv").open(newline="") as fh:
        probs = {r["slide_id"]: [float(r["p_0"]), float(r["p_1"])] for r in csv.DictReader(fh)}
    for sid, p in probs.items():
        zarr_1 = tmp_path / "one" / "heatmaps" / f"{sid}.zarr"
        zarr_4 = tmp_path / "maps4" / f"{sid}.zarr"
        a, b = _map(zarr_1), _map(zarr_4)
        assert a.shape == (2, 6, 8)  # 192 x 256 at stride 32
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())
        # The mean of each class map is the logit (average pool): its softmax is the CSV's.
        mean = a.mean(axis=(1, 2))
        soft = np.exp(mean - mean.max()) / np.exp(mean - mean.max()).sum()
        np.testing.assert_allclose(soft, p, atol=2e-6)
        hyfi = read_hyfi_attrs(zarr_1)
        assert hyfi is not None and hyfi["logits"] == pytest.approx(mean, rel=1e-5, abs=1e-5)

        # On the slide: scale = stride x slide µm/px; translation through source_box/placement.
        store = read_hyfi_attrs(manifest.parent / f"{sid}.zarr")
        assert store is not None
        sy, sx, sh, sw = store["source_box"]
        py, px, ph, pw = store["placement"]
        mpp = store["source_mpp"]
        ms = json.loads((zarr_1 / "zarr.json").read_text())["attributes"]["ome"]["multiscales"]
        scale, trans = ms[0]["datasets"][0]["coordinateTransformations"]
        assert scale["scale"] == pytest.approx([1.0, 32 * sh / ph * mpp, 32 * sw / pw * mpp])
        want = [0.0, (sy + (16 - py) * sh / ph - 0.5) * mpp, (sx + (16 - px) * sw / pw - 0.5) * mpp]
        assert trans["translation"] == pytest.approx(want)
        png = tmp_path / "one" / "heatmaps" / f"{sid}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Predicted again into the same folder for two of the slides: the other four maps are an
    # earlier prediction's, said (they were left there without a word).
    two = manifest.with_name("two_of_six.csv")  # beside it: its rows name stores relatively
    two.write_text("".join(manifest.read_text().splitlines(keepends=True)[:3]))
    again = [*predict[:3], "--manifest", str(two), "--out", str(tmp_path / "one" / "p.csv")]
    said = _ok(plain(*again, "--heatmaps", timeout=300)).stdout
    assert "also holds 4 heat map(s) of an earlier prediction" in said, said


@pytest.mark.slow
def test_heatmaps_at_8192_on_2x2_stay_within_memory() -> None:
    """ResNet-18 x0.125 at 8192² on 2x2 (each rank makes only its tile): the 256² map is
    stitched on rank 0 and every rank peaks at 916 MiB (measured; one process would hold the
    whole image's activations, ~4x a rank's share)."""
    job = mpiexec(4, str(WORKER), "large", "2", "2", "8192", "8192", timeout=600)
    assert job.returncode == 0, job.describe()
    r = json_line(job)
    assert r["shape"] == [1, 2, 256, 256], r
    assert r["mean_vs_logit"] < 1e-5, r
    assert max(r["peak_rss_mib"]) < 1200, r
