"""Global max pooling (for sparse whole-slide evidence) is exact on a tile grid."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models import create_model

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
from _launch import json_line, mpiexec

pytestmark = pytest.mark.mpi
WORKER = Path(__file__).parent / "workers" / "global_max_pool.py"


def _run_worker(worker: Path, *args: object, ranks: int) -> dict[str, Any]:
    """Run a worker under ``mpiexec -n ranks``; its last stdout line, parsed."""
    job = mpiexec(ranks, str(worker), *map(str, args), timeout=240)
    assert job.returncode == 0, job.describe()
    return json_line(job)


# 1x3 (a middle tile) with the slow set since 2026-11-27 (the suite's time); 2x2 stays
@pytest.mark.parametrize(
    ("grid", "size"),
    [((2, 2), (130, 98)), pytest.param((1, 3), (70, 200), marks=pytest.mark.slow)],
)
def test_global_max_pool_matches_one_process(grid: tuple[int, int], size: tuple[int, int]) -> None:
    result = _run_worker(WORKER, *grid, *size, ranks=grid[0] * grid[1])
    assert result["ok"] and result["max_rel_error"] < 1e-9


@pytest.mark.parametrize(
    ("grid", "size"),
    [((1, 2), (34, 34)), pytest.param((2, 2), (38, 30), marks=pytest.mark.slow)],  # suite's time
)
def test_max_pool_ties_fall_where_one_process_puts_them(
    grid: tuple[int, int], size: tuple[int, int]
) -> None:
    """A slide's glass is one value: every max-pool window there ties, and one process sends
    the gradient to the window's first maximum. A tile reaching past the image normalised
    its pixels with other arithmetic than a tile inside it, equal pixels came out one unit
    apart across the tile border, and the input gradient went to other pixels (0.2-0.6
    relative on ResNet-18's input at 96^2, 100^2 and 160^2 on 1x2)."""
    result = _run_worker(
        Path(__file__).parent / "workers" / "flat_background.py", *grid, *size,
        ranks=grid[0] * grid[1],
    )  # fmt: skip
    assert result["ok"], result["failed"]


def test_global_pool_option() -> None:
    model = create_model("resnet18", width=0.125, num_classes=2, global_pool="max")
    assert isinstance(model.avgpool, torch.nn.AdaptiveMaxPool2d)
    assert model(torch.randn(1, 3, 70, 90)).shape == (1, 2)
    with pytest.raises(ConfigError, match="global_pool"):
        create_model("resnet18", global_pool="median")


BLOCKS_WORKER = Path(__file__).parent / "workers" / "pooling_blocks.py"


@pytest.mark.parametrize("model", ["squeeze-excite", "functional"])
# # slow since 2026-11-27 (the suite's time): 2x2's global max pool runs by default above
@pytest.mark.parametrize("grid", [(1, 2), pytest.param((2, 2), marks=pytest.mark.slow)])
def test_pools_inside_the_network_and_as_functions_match_one_process(
    model: str, grid: tuple[int, int]
) -> None:
    """squeeze-excite: a pool whose output is used again on every tile; functional:
    x.mean((2, 3)), F.adaptive_{avg,max}_pool2d and x.amax((2, 3)) in forward (float64).

    The worst relative errors (~1e-8) are on a bias gradient BatchNorm makes ~1e-17.
    """
    result = _run_worker(BLOCKS_WORKER, model, *grid, 38, 45, ranks=grid[0] * grid[1])
    assert result["ok"] and result["max_rel_error"] < 1e-6, result
