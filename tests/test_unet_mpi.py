"""The registered ``unet2d`` trains on a tile grid exactly as in one process (float64, mpiexec).

Both upsampling modes (``ConvTranspose2d`` 2x2/2, and bilinear ``nn.Upsample``
+ 3x3 conv), each followed by the decoder's bottom/right ``F.pad`` to the
skip's size, at sizes that are multiples of ``total_stride`` only after the
engine's padding: 90x75 at depth 3 (stride 8; padded to 96x80 on 2x2, tiles
48x40, 6x5 at the bottom level; floors 90 -> 45 -> 22 -> 11, so three decoder
levels pad a row and 75 -> 37 -> 18 -> 9 two columns) and 45x37 at depth 2
(padded to 48x40 on 1x2). Through ``hyfi_imaging.verify_model``: the output
map stitched from the tiles, input and parameter gradients, weights and
BatchNorm statistics after two SGD steps, eval-mode outputs.
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
WORKER = Path(__file__).parent / "workers" / "unet_models.py"

CASES = [
    # slow since 2026-11-27 (the suite's time): test_resample_mpi runs the bilinear U-Net on
    # 2x2 at the same size by default
    pytest.param("bilinear", 3, (2, 2), (90, 75), id="bilinear-2x2", marks=pytest.mark.slow),
    pytest.param("transpose", 2, (1, 2), (45, 37), id="transpose-1x2"),
    pytest.param("transpose", 3, (2, 2), (90, 75), id="transpose-2x2", marks=pytest.mark.slow),
    pytest.param("bilinear", 2, (1, 2), (45, 37), id="bilinear-1x2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("upsampling", "depth", "grid", "size"), CASES)
def test_unet2d_matches_one_process(
    upsampling: str, depth: int, grid: tuple[int, int], size: tuple[int, int]
) -> None:
    """Errors are rounding (~1e-13 relative, measured); BatchNorm biases make some ~1e-16."""
    job = mpiexec(grid[0] * grid[1], str(WORKER), upsampling, *map(str, (depth, *grid, *size)))
    result = json_line(job)
    assert job.returncode == 0 and "error" not in result, job.describe()
    assert result["ok"] and result["max_rel_error"] < 1e-10, result
    assert result["compared"] > 100  # every parameter's gradient, not just the loss
