"""``hyfi-train`` with ``parallel.branches`` under mpiexec: a recipe trains AmoebaNet on two
branch ranks as it does in one process, and a bad branch count is refused before any compute.

Recipes have no float64 (``train.precision`` is fp32 or bf16), so the comparison is in
float32: the first loss is the forward of the same weights on the same image, and a branch
rank's concatenation is exact (``x + 0``), so it is equal bit for bit; later losses follow
gradients whose branch parts were summed over the group in another order than one process
adds them (rounding, amplified by a few SGD steps: ``rel=1e-4``, as for tiles in
``tests/test_train_mpi.py``). hyfi-verify proves the float64 exactness (test_branches_mpi).
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
from _launch import REPO, Job, have_mpiexec, mpiexec, plain

pytestmark = pytest.mark.mpi


def _recipe(tmp: Path, manifest: Path, name: str, **parallel: object) -> Path:
    """A tiny AmoebaNet-D recipe (3 cells of 8 filters) on the training tests' cohort."""
    recipe = {
        "name": name,
        "dataset": str(REPO / "datasets" / "synthetic.yaml"),
        "model": {"name": "amoebanet-d-3-8"},
        "data": {"manifest": str(manifest), "val_fraction": 0.25},
        "parallel": {"spatial": "1x1", **parallel},
        "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "train": {
            "out_dir": str(tmp / name),
            "epochs": 1,
            "batch_size": 2,
            "max_steps": 3,
            "progress": False,
            "seed": 0,
        },
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


#: hyfi-train in one process on half the CPUs: a rank takes its node's CPUs over its ranks
#: (``threads_per_rank``), and a convolution's sums come out in another order on another
#: thread count (measured: the first loss differs by 2e-7 between 2 threads and 1), so the
#: reference runs on as many threads as each of the 2 ranks.
HALF_CPUS = (
    "import os, sys\n"
    "cpus = sorted(os.sched_getaffinity(0))\n"
    "os.sched_setaffinity(0, cpus[: max(1, len(cpus) // 2)])\n"
    "from hyfi_imaging.cli.train import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _train(ranks: int, recipe: Path) -> Job:
    if ranks > 1:
        return mpiexec(ranks, "-m", "hyfi_imaging.cli.train", str(recipe), timeout=180)
    return plain("-c", HALF_CPUS, str(recipe), timeout=180)


def _losses(out: Path) -> list[float]:
    with (out / "metrics.csv").open() as f:
        return [float(r["loss"]) for r in csv.DictReader(f) if r["loss"]]


# slow since 2026-11-27 (the suite's time): branches train like one process through the
# engine by default (test_branches_mpi, with and without pipeline stages), and the recipe's
# refusals below stay
@pytest.mark.slow
def test_branches_train_like_one_process(train_manifest: Path, tmp_path: Path) -> None:
    if not have_mpiexec():
        pytest.skip("mpiexec not found (install the mpich extra)")
    one = _train(1, _recipe(tmp_path, train_manifest, "one"))
    assert one.returncode == 0, one.describe()
    br = _train(2, _recipe(tmp_path, train_manifest, "br2", branches=2))
    assert br.returncode == 0, br.describe()
    assert "br=2" in (tmp_path / "br2" / "summary.json").read_text()
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "br2")
    assert len(a) == len(b) == 3 and all(math.isfinite(v) for v in b)
    assert b[0] == a[0]  # the same forward: the combination adds zeros only
    assert b == pytest.approx(a, rel=1e-4, abs=1e-6)
    assert b[1] != b[0]  # it trained


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        ({"branches": 5}, "widest cell has 4 branches"),
        ({"branches": 2, "checkpointing": "full"}, "checkpointing of branched cells"),
    ],
)
def test_bad_branches_refused_before_any_rank_starts(
    train_manifest: Path, tmp_path: Path, parallel: dict[str, object], message: str
) -> None:
    """The recipe's check (``--check``: no process group, a meta-device model) names the fix."""
    recipe = _recipe(tmp_path, train_manifest, "bad", **parallel)
    job = plain("-m", "hyfi_imaging.cli.train", str(recipe), "--check", timeout=120)
    assert job.returncode == 2, job.describe()
    lines = job.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "--branches" in lines[0], lines
