"""The segmentation loss is exact on a tile grid: Dice + CE and its gradients (float64, mpiexec).

Dice is a ratio of whole-image sums, so every rank must see the all-reduced
intersection and sums over the *valid* pixels (the padded tail masked), and
the cross-entropy mean is the all-reduced sum over the global pixel count.
Odd sizes on 1x2 and 2x2 (45x37 and 43x51 pad to multiples of 4 x grid), two
micro-batches (Dice is per image, so the split changes nothing), through
``hyfi_imaging.verify_model``: loss, outputs, input and parameter gradients,
weights after two SGD steps. One launch per world size.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
from _launch import Job, have_mpiexec, results_per_world

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not installed"),
]
WORKER = Path(__file__).parent / "workers" / "dense_losses.py"

CASES = [
    ("dicece", (1, 2), (45, 37)),
    ("dice", (1, 2), (43, 51)),
    ("dicece", (2, 2), (43, 51)),
    ("dice", (2, 2), (45, 37)),
]


def _case(loss: str, grid: tuple[int, int], size: tuple[int, int]) -> str:
    return ":".join(map(str, (loss, *grid, *size)))


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[dict[str, Any], Job]]:
    """Every case, one launch per world size (start-up costs seconds, a case less)."""
    worlds: dict[int, list[str]] = {}
    for loss, grid, size in CASES:
        worlds.setdefault(grid[0] * grid[1], []).append(_case(loss, grid, size))
    return results_per_world(WORKER, worlds)


@pytest.mark.parametrize(("loss", "grid", "size"), CASES)
def test_segmentation_loss_matches_one_process(
    results: dict[str, tuple[dict[str, Any], Job]],
    loss: str,
    grid: tuple[int, int],
    size: tuple[int, int],
) -> None:
    """Rounding only (float64); the loss itself is compared on every rank."""
    result, job = results[_case(loss, grid, size)]
    assert job.returncode == 0 and "error" not in result, (result, job.describe())
    assert result["ok"] and result["max_rel_error"] < 1e-8, result
    assert result["compared"] > 50  # every parameter's gradient, not just the loss
    assert all(v > 0 for v in result["losses"])
