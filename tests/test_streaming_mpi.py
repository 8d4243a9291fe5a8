"""The streamed stem on tiles, pipeline stages and data replicas equals one process (float64).

hyfi-verify trains two SGD steps and compares the loss, outputs, input and parameter
gradients, weights and BatchNorm statistics with one process on the same images, at odd
sizes where the last tiles hang over the image's end. The stem's halo comes from one
exchange of the input; its BatchNorm statistics are the whole image's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
from _launch import have_mpiexec, json_line, mpiexec

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not installed"),
]

CASES = [
    # (ranks, hyfi-verify options): corners and checkpointed blocks
    (4, ("--spatial", "2x2", "--image-size", "130x97", "--checkpointing", "full")),
    # two pipeline stages (the stem in the first) on 1x2 tiles, 1F1B (slow since 2026-11-27,
    # the suite's time: the stem-cut test below runs a pipeline through the stem by default)
    pytest.param(
        4,
        (
            "--spatial",
            "1x2",
            "--pipeline",
            "2",
            "--microbatches",
            "2",
            "--schedule",
            "1f1b",
            "--image-size",
            "90x90",
        ),
        marks=pytest.mark.slow,
    ),
    # data replicas x row tiles, selective checkpointing; three column tiles
    pytest.param(
        4,
        (
            "--data",
            "2",
            "--spatial",
            "2x1",
            "--image-size",
            "99x70",
            "--checkpointing",
            "selective",
        ),
        marks=pytest.mark.slow,
    ),
    pytest.param(3, ("--spatial", "1x3", "--image-size", "97x130"), marks=pytest.mark.slow),
]


@pytest.mark.parametrize(
    ("ranks", "options"), CASES, ids=lambda v: "-".join(v) if isinstance(v, tuple) else str(v)
)
def test_streamed_stem_trains_like_one_process(ranks: int, options: tuple[str, ...]) -> None:
    job = mpiexec(
        ranks, "-m", "hyfi_imaging.cli.verify", "--model", "resnet18", "--width", "0.25",
        "--streaming", "stem", *options, "--json", timeout=400,
    )  # fmt: skip
    report = json_line(job)
    assert job.returncode == 0 and report["ok"], (report.get("worst"), job.describe())
    assert report["max_rel_error"] < 1e-10 and report["compared"] > 250
    assert "streaming: stem conv1, bn1, relu, maxpool in row bands" in report["plan"]


def test_a_pipeline_cut_inside_the_stem_runs_it_layer_by_layer_and_says_so() -> None:
    job = mpiexec(
        2, "-m", "hyfi_imaging.cli.verify", "--model", "resnet18", "--width", "0.25",
        "--streaming", "stem", "--pipeline", "2", "--microbatches", "2", "--balance", "2,9",
        "--image-size", "64x64", "--json", timeout=300,
    )  # fmt: skip
    report = json_line(job)
    assert job.returncode == 0 and report["ok"], (report.get("worst"), job.describe())
    assert "maxpool NOT streamed: the first pipeline stage ends inside it" in report["plan"]
