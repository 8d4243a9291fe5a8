"""Global max pooling (for sparse whole-slide evidence) is exact on a tile grid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models import create_model

pytestmark = pytest.mark.mpi
WORKER = Path(__file__).parent / "workers" / "global_max_pool.py"


@pytest.mark.parametrize(("grid", "size"), [((2, 2), (130, 98)), ((1, 3), (70, 200))])
def test_global_max_pool_matches_one_process(grid: tuple[int, int], size: tuple[int, int]) -> None:
    cmd = [str(Path(sys.executable).with_name("mpiexec")), "-n", str(grid[0] * grid[1]), sys.executable,
           str(WORKER), *map(str, (*grid, *size))]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["max_rel_error"] < 1e-9


def test_global_pool_option() -> None:
    model = create_model("resnet18", width=0.125, num_classes=2, global_pool="max")
    assert isinstance(model.avgpool, torch.nn.AdaptiveMaxPool2d)
    assert model(torch.randn(1, 3, 70, 90)).shape == (1, 2)
    with pytest.raises(ConfigError, match="global_pool"):
        create_model("resnet18", global_pool="median")


SE_WORKER = Path(__file__).parent / "workers" / "squeeze_excite.py"


@pytest.mark.parametrize(("grid", "size"), [((1, 2), (38, 45)), ((2, 2), (38, 45))])
def test_squeeze_excite_matches_one_process(grid: tuple[int, int], size: tuple[int, int]) -> None:
    """A global pool *inside* the network, its output used again on every tile (float64)."""
    cmd = [str(Path(sys.executable).with_name("mpiexec")), "-n", str(grid[0] * grid[1]), sys.executable,
           str(SE_WORKER), *map(str, (*grid, *size))]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["max_rel_error"] < 1e-7, result


FUNCTIONAL_WORKER = Path(__file__).parent / "workers" / "functional_pools.py"


@pytest.mark.parametrize(("grid", "size"), [((1, 2), (38, 45)), ((2, 2), (38, 45))])
def test_functional_global_reductions_match_one_process(
    grid: tuple[int, int], size: tuple[int, int]
) -> None:
    """x.mean((2, 3)), F.adaptive_{avg,max}_pool2d and x.amax((2, 3)) in forward (float64)."""
    cmd = [str(Path(sys.executable).with_name("mpiexec")), "-n", str(grid[0] * grid[1]), sys.executable,
           str(FUNCTIONAL_WORKER), *map(str, (*grid, *size))]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["max_rel_error"] < 1e-6, result
