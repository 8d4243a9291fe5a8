"""Data sub-graph parallelism against one process, in float64, through ``hyfi-verify``.

Each case is one ``mpiexec`` of the real CLI (two SGD steps, every rank's
gradients, weights, BatchNorm statistics and predictions compared with rank 0's
one-process run). The sabotaged case turns the branch group's gradient sum off
(in this test, not in the CLI) and must be caught: the comparison can fail.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
from _launch import have_mpiexec, json_line, mpiexec

pytestmark = pytest.mark.mpi

AMOEBA = ("--model", "amoebanet-d-3-8", "--dtype", "float64", "--num-classes", "5", "--json")

#: name -> (ranks, extra options).
CASES = {
    "br2": (2, ("--image-size", "32x32", "--branches", "2")),
    "br2-pp2-1f1b": (
        4,
        (
            "--image-size",
            "70x52",
            "--branches",
            "2",
            "--pipeline",
            "2",
            "--microbatches",
            "2",
            "--schedule",
            "1f1b",
        ),
    ),
    "br2-sp1x2": (4, ("--image-size", "70x190", "--branches", "2", "--spatial", "1x2")),
    "br2-dp2": (4, ("--image-size", "32x32", "--branches", "2", "--data", "2")),
}
SLOW = {"br2-sp1x2", "br2-dp2"}

#: The CLI with BranchSync's gradient sum replaced by nothing (test-only sabotage).
SABOTAGE = (
    "import contextlib, sys\n"
    "from hyfi_imaging.parallel import branches\n"
    "branches.BranchSync.step = lambda self: contextlib.nullcontext()\n"
    "from hyfi_imaging.cli.verify import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _verdict(n: int, *args: str) -> dict[str, object]:
    if not have_mpiexec():
        pytest.skip("mpiexec not found (install the mpich extra)")
    job = mpiexec(n, *args, timeout=300)
    return json_line(job)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in CASES]
)
def test_branches_train_like_one_process(name: str) -> None:
    n, extra = CASES[name]
    verdict = _verdict(n, "-m", "hyfi_imaging.cli.verify", *AMOEBA, *extra)
    assert verdict["ok"], verdict
    assert "br=2" in str(verdict["plan"])
    assert verdict["compared"] > 900  # type: ignore[operator]  # every gradient, weight, statistic
    assert verdict["max_rel_error"] < 1e-5  # type: ignore[operator]


def test_missing_gradient_sum_is_caught() -> None:
    verdict = _verdict(2, "-c", SABOTAGE, *AMOEBA, *CASES["br2"][1])
    assert not verdict["ok"]
    failed = [str(f) for f in verdict["failed"]]  # type: ignore[attr-defined]
    assert any("grad/" in f and ".ops." in f for f in failed), failed
    # Parameters outside the branches still agree: only the branches' sum was removed.
    assert not any("grad/stem." in f or "grad/head." in f for f in failed), failed


# slow since 2026-11-27 (the suite's time): test_branches.py refuses the same sizes in one process
@pytest.mark.slow
def test_tiles_too_small_for_a_branch_are_refused_on_every_rank() -> None:
    """reduction1.ops.4 (a 5x5 pool's halo of 3 px on tiles 2 px wide) runs on branch rank 1
    only; before the check that rank alone raised, rank 0 (the one that prints a collective
    error) waited in the cell's sum, and the job died without a word (exit 2, no line)."""
    if not have_mpiexec():
        pytest.skip("mpiexec not found (install the mpich extra)")
    args = ("--image-size", "32x64", "--branches", "2", "--spatial", "1x2", "--steps", "1")
    job = mpiexec(4, "-m", "hyfi_imaging.cli.verify", *AMOEBA, *args, timeout=120)
    # Every rank exits 2; mpiexec may report the SIGKILL it sent the slower ones instead.
    assert job.returncode != 0, job.describe()
    lines = [ln for ln in job.stderr.splitlines() if "error" in ln]
    assert lines == [
        "hyfi-verify: error: reduction1.ops.4.4: needs a halo of 3 px but tiles are only 2 px "
        "along the width; use fewer tiles along that axis or a larger image."
    ], job.describe()


#: hyfi-verify on the user's model ``tests/workers/branch_blocks.py`` (``module:function``),
#: optionally with the fan-out's gradient sum replaced by nothing (test-only sabotage).
USER_BLOCKS = (
    "import sys\n"
    "sys.path.insert(0, 'tests/workers')\n"
    "from hyfi_imaging.parallel import branches\n"
    "if sys.argv[1] == 'sabotage':\n"
    "    branches._FanOut.backward = staticmethod(lambda ctx, *grads: (None, *grads))\n"
    "from hyfi_imaging.cli.verify import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)
BLOCKS = (
    *("--model", "branch_blocks:build", "--dtype", "float64", "--num-classes", "3"),
    *("--image-size", "22x19", "--branches", "2", "--json"),
)


@pytest.mark.parametrize("mode", ["exact", "sabotage"])
def test_parallel_branches_container_trains_like_one_process(mode: str) -> None:
    """A concatenating and a summing ``ParallelBranches`` on 2 branch ranks, float64, against
    one process; without the fan-out's gradient sum, the layers before the blocks differ."""
    verdict = _verdict(2, "-c", USER_BLOCKS, mode, *BLOCKS)
    failed = [str(f) for f in verdict["failed"]]  # type: ignore[attr-defined]
    if mode == "exact":
        assert verdict["ok"] and "br=2" in str(verdict["plan"]), verdict
        assert verdict["compared"] >= 80  # type: ignore[operator]  # 2 steps: gradients, weights, statistics, logits
        assert verdict["max_rel_error"] < 1e-12  # type: ignore[operator]
        return
    assert not verdict["ok"]
    assert any(f.startswith("step0/grad/stem.") for f in failed), failed
    # After the blocks the first step's gradient is whole (later ones follow wrong weights).
    assert not any(f.startswith(("step0/grad/fc.", "step0/grad/summed.")) for f in failed), failed
