"""Slides that failed preprocessing are accounted for, not silently dropped.

A real cohort with one unreadable slide goes through ``hyfi-preprocess`` (its
manifest row says ``failed``), then ``hyfi-train`` and ``hyfi-predict`` run
on two ranks: each says once how many slides it left out and why, and the
predictions file has a row for every slide of the manifest. The run directory
is also checked for files created private (0600) among readable ones.
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
from _launch import REPO, Job, have_mpiexec, mpiexec, plain

from hyfi_imaging.data.synthetic import write_synthetic_cohort
from hyfi_imaging.preprocess import PreprocessOptions, run_preprocess

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not installed"),
]

LINE = "1 of 6 slides left out: status failed (see {manifest})"


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Five good synthetic slides and one labelled slide that is not an image."""
    root = tmp_path_factory.mktemp("cohort")
    labels = write_synthetic_cohort(root / "slides", 5, seed=4, size=(384, 384), lesions=2)
    (root / "slides" / "broken.svs").write_bytes(b"not a slide")
    with labels.open("a") as fh:
        fh.write("broken,1\n")
    summary = run_preprocess(
        [root / "slides"],
        root / "data",
        PreprocessOptions(mpp=1.0, size=(128, 128)),
        labels_path=labels,
        progress=False,
        qc=False,
    )
    assert summary.manifest is not None and [r.slide_id for r in summary.failed] == ["broken"]
    return summary.manifest


def _train_args(manifest: Path, out: Path, *extra: str) -> list[str]:
    args = ["-m", "hyfi_imaging.cli.train", str(REPO / "recipes" / "synthetic.yaml"), *extra]
    for s in (
        f"data.manifest={manifest}",
        f"train.out_dir={out}",
        "model.kwargs.width=0.125",
        "parallel.spatial=1x2",
        "train.epochs=1",
        "train.max_steps=1",
        "train.batch_size=2",
        "train.progress=false",
    ):
        args += ["--set", s]
    return args


def _ok(job: Job) -> Job:
    assert job.returncode == 0, job.describe()
    return job


def test_train_and_predict_account_for_failed_slides(manifest: Path, tmp_path: Path) -> None:
    line = LINE.format(manifest=manifest)
    run = tmp_path / "run"
    check = _ok(plain(*_train_args(manifest, run, "--check"), timeout=120))
    assert check.stderr.count(line) == 1, check.describe()

    trained = _ok(mpiexec(2, *_train_args(manifest, run), timeout=300))
    assert trained.stderr.count(line) == 1, trained.describe()  # rank 0 only

    out = tmp_path / "pred.csv"
    cmd = ["-m", "hyfi_imaging.cli.predict", str(run), "--manifest", str(manifest)]
    predicted = _ok(mpiexec(2, *cmd, "--out", str(out), "--spatial", "1x2", timeout=300))
    assert predicted.stderr.count(line) == 1, predicted.describe()
    assert "5 of 6 slides predicted" in predicted.stdout
    with out.open(newline="") as fh:
        rows = {r["slide_id"]: r for r in csv.DictReader(fh)}
    assert len(rows) == 6
    assert rows["broken"] == {
        "slide_id": "broken", "label": "1", "status": "failed", "pred": "", "p_0": "", "p_1": "",
    }  # fmt: skip
    good = [r for sid, r in rows.items() if sid != "broken"]
    assert all(r["status"] == "ok" and r["pred"] in ("0", "1") for r in good)
    assert all(float(r["p_0"]) + float(r["p_1"]) == pytest.approx(1.0, abs=1e-5) for r in good)

    # Every file of the run and the predictions: the mode open() gives under this umask.
    umask = os.umask(0)
    os.umask(umask)
    files = [p for p in run.rglob("*") if p.is_file()] + [out]
    assert {"metrics.csv", "training_curves.png", "confusion_matrix.png"} <= {p.name for p in files}
    private = [
        str(p.relative_to(tmp_path)) for p in files if p.stat().st_mode & 0o777 != 0o666 & ~umask
    ]
    assert private == []
