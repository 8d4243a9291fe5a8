"""Random layers in training -- drop-path, channel dropout, dropout in the head -- on a tile grid.

A mask drawn per sample (or per sample and channel) is exact on tiles only if
every tile of the image draws the same numbers. The worker
(``tests/workers/random_layers.py``) seeds every rank differently and must
still equal one process in float64, because the drawing modules synchronise
the generator over the tiles; without that synchronisation it must not. A
mask drawn per pixel is refused (``test_watch.py``); the zoo's drop-path
models are checked through ``verify_model`` in ``test_zoo_mpi.py``.
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
WORKER = Path(__file__).parent / "workers" / "random_layers.py"


@pytest.mark.parametrize(("grid", "sync", "exact"), [((1, 2), 1, True), ((2, 2), 1, True),
                                                     ((1, 2), 0, False)])  # fmt: skip
def test_random_masks_are_drawn_alike_on_every_tile(
    grid: tuple[int, int], sync: int, exact: bool
) -> None:
    job = mpiexec(grid[0] * grid[1], str(WORKER), *map(str, (*grid, 38, 45, sync)))
    result = json_line(job)
    assert job.returncode == 0, job.describe()
    assert result["random_modules"] == ["branch.1", "drop_path", "head.0"], result
    assert result["ok"] is exact, result


def test_a_deep_chain_replays_the_masks_its_blocks_drew() -> None:
    """Blocks that draw their own masks, under ``checkpointing: deep`` on 1x2: a replay
    draws each block's mask again from the state the block's forward started in (after its
    pre-hook synchronised the generator over the tiles), though every rank drew differently
    since. Equal to one process in float64."""
    job = mpiexec(2, str(WORKER), "1", "2", "24", "32", "1", "deep")
    result = json_line(job)
    assert job.returncode == 0, job.describe()
    assert result["random_modules"] == [f"block1.{i}" for i in range(4)], result
    assert result["ok"], result
