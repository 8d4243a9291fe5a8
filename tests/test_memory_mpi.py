"""Per-rank activation memory: windowed layers keep no halo-extended copy.

The invariant (issue: memory is the product): a spatial convolution, max-pool
or avg-pool saves for backward only its input tile -- usually the very storage
the layer before already keeps -- plus the halo strips it received. Counted
with ``saved_tensors_hooks`` on real ranks under ``mpiexec``
(``tests/mpi/saved_memory.py``), deterministically: bytes of distinct storages,
not RSS. The totals are held to the issue's targets against one process on the
same image: a conv+ReLU chain on a 1x4 grid keeps at most 0.27 of one process
per rank (LBANN DistConv reaches 0.265; ideal 0.25 plus the strips). A 3-D
windowed layer (Conv3d, MaxPool3d) is held to the same bound: tile plus strips.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))

from _launch import have_mpiexec, merged_result, mpiexec

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not installed"),
]

CASES = {
    # name: (model, grid, image, per-rank ceiling of saved activations / one process)
    "convchain-1x4-512": ("convchain", "1x4", "512", 0.27),
    "resnet18-2x2-256": ("resnet18", "2x2", "256", 0.28),
    "amoebanet-2x2-192": ("amoebanet-d-6-64", "2x2", "192", 0.30),
    # 3-D: a 3D U-Net (width 4) cut into 2x1x2 sub-volumes of 16x20x16 (measured 0.332; ideal
    # 0.25 plus the strips of a 3-D halo, large next to such small sub-volumes).
    "unet3d-2x1x2-32x20x32": ("unet3d", "2x1x2", "32x20x32", 0.35),
}
#: With the slow set since 2026-11-27 (the suite's time): the same windowed layers as the
#: chain's and the U-Net's, in other models (bench_spatial measures ResNet-50's share).
SLOW = {"resnet18-2x2-256", "amoebanet-2x2-192"}
#: Extra worker options per model.
OPTIONS = {"unet3d": ("--width", "4")}


def _run(model: str, grid: str, image: str) -> dict[str, Any]:
    job = mpiexec(
        4, "tests/mpi/saved_memory.py", "--model", model, "--grid", grid, "--image", image,
        *OPTIONS.get(model, ()),
    )  # fmt: skip
    return merged_result(job)


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[pytest.mark.slow] * (c in SLOW)) for c in CASES]
)
def test_windowed_layers_save_tile_and_strips_only(case: str) -> None:
    model, grid, image, ceiling = CASES[case]
    result = _run(model, grid, image)
    for rank, mine in enumerate(result["ranks"]):
        assert mine["layers"], "no windowed layer was seen"
        for path, info in mine["layers"].items():
            # Pay for the input tile only if no earlier layer already keeps it.
            allowed = info["strips"] + max(0, info["input"] - info["shared"])
            assert info["new"] <= allowed, (
                f"rank {rank} {path}: saved {info['new']} new bytes, allowed {allowed} "
                f"(input {info['input']}, strips {info['strips']}, already kept {info['shared']})"
            )
    worst = max(r["total"] for r in result["ranks"]) / result["single"]
    assert worst <= ceiling, f"{case}: a rank keeps {worst:.3f} of one process (ceiling {ceiling})"
