"""Global max pooling (for sparse whole-slide evidence) is exact on a tile grid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models import create_model

pytestmark = pytest.mark.mpi
WORKER = Path(__file__).parent / "workers" / "global_max_pool.py"


def _run_worker(worker: Path, *args: object, ranks: int) -> dict[str, Any]:
    """Run a worker under ``mpiexec -n ranks``; its last stdout line, parsed."""
    cmd = [str(Path(sys.executable).with_name("mpiexec")), "-n", str(ranks), sys.executable,
           str(worker), *map(str, args)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize(("grid", "size"), [((2, 2), (130, 98)), ((1, 3), (70, 200))])
def test_global_max_pool_matches_one_process(grid: tuple[int, int], size: tuple[int, int]) -> None:
    result = _run_worker(WORKER, *grid, *size, ranks=grid[0] * grid[1])
    assert result["ok"] and result["max_rel_error"] < 1e-9


def test_global_pool_option() -> None:
    model = create_model("resnet18", width=0.125, num_classes=2, global_pool="max")
    assert isinstance(model.avgpool, torch.nn.AdaptiveMaxPool2d)
    assert model(torch.randn(1, 3, 70, 90)).shape == (1, 2)
    with pytest.raises(ConfigError, match="global_pool"):
        create_model("resnet18", global_pool="median")


BLOCKS_WORKER = Path(__file__).parent / "workers" / "pooling_blocks.py"


@pytest.mark.parametrize("model", ["squeeze-excite", "functional"])
@pytest.mark.parametrize("grid", [(1, 2), (2, 2)])
def test_pools_inside_the_network_and_as_functions_match_one_process(
    model: str, grid: tuple[int, int]
) -> None:
    """squeeze-excite: a pool whose output is used again on every tile; functional:
    x.mean((2, 3)), F.adaptive_{avg,max}_pool2d and x.amax((2, 3)) in forward (float64).

    The worst relative errors (~1e-8) are on a bias gradient BatchNorm makes ~1e-17.
    """
    result = _run_worker(BLOCKS_WORKER, model, *grid, 38, 45, ranks=grid[0] * grid[1])
    assert result["ok"] and result["max_rel_error"] < 1e-6, result
