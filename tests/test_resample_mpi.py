"""Pads and interpolations of the whole image run exactly on a tile grid (float64, mpiexec).

U-Net decoders (``F.interpolate(x, size=skip.shape[-2:])`` in every mode,
``nn.Upsample`` or ``nn.ConvTranspose2d`` + ``F.pad`` to the skip), asymmetric and non-zero pads, a crop
by negative pad and a downsampling interpolation, at odd sizes where the
ratio of sizes is not an integer (75 from 37): each must equal one process,
through ``hyfi_imaging.verify_model`` (outputs, input and parameter gradients,
weights after two steps). Their refusals and the per-axis arithmetic are in
``test_watch.py`` and ``test_geometry.py``.
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
WORKER = Path(__file__).parent / "workers" / "resample_models.py"

CASES = [
    ("unet-nearest", (2, 2), (90, 75)),
    ("unet-nearest-exact", (1, 2), (45, 37)),
    ("unet-bilinear", (2, 2), (90, 75)),
    ("unet-bilinear-corners", (2, 1), (45, 37)),
    ("unet-pad", (2, 2), (90, 75)),
    ("unet-pad", (1, 3), (30, 70)),
    ("unet-transposed", (2, 2), (90, 75)),
    ("unet-transposed", (1, 3), (30, 70)),
    ("pads", (2, 2), (90, 75)),
    ("pads", (1, 2), (45, 37)),
    ("fractional", (2, 2), (64, 61)),
    ("fractional", (1, 2), (50, 64)),
]


def _case(model: str, grid: tuple[int, int], size: tuple[int, int]) -> str:
    return ":".join(map(str, (model, *grid, *size)))


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[dict[str, Any], Job]]:
    """Every case, one launch per world size (start-up costs seconds, a case less)."""
    worlds: dict[int, list[str]] = {}
    for model, grid, size in CASES:
        worlds.setdefault(grid[0] * grid[1], []).append(_case(model, grid, size))
    return results_per_world(WORKER, worlds)


@pytest.mark.parametrize(("model", "grid", "size"), CASES)
def test_pads_and_interpolations_match_one_process(
    results: dict[str, tuple[dict[str, Any], Job]],
    model: str,
    grid: tuple[int, int],
    size: tuple[int, int],
) -> None:
    """The worst relative errors (~1e-7) are on a bias gradient BatchNorm makes ~1e-16."""
    result, job = results[_case(model, grid, size)]
    assert job.returncode == 0 and "error" not in result, (result, job.describe())
    assert result["ok"] and result["max_rel_error"] < 1e-6, result
