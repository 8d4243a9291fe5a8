"""Bi-directional replicas and torch's two-stages-per-rank schedules against one process (mpiexec).

The same harness as :mod:`test_pipeline_mpi` (its ``_run_case``: ``run_verify`` on every rank,
two SGD steps, float64; loss, outputs, input gradients, every parameter gradient, the clipped
norm, eval predictions, weights and BatchNorm running statistics compared), with the schedules
of :mod:`hyfi_imaging.parallel.schedules`. One launch per world size (2, 4, 8 ranks) runs every
case of that size: ``mpiexec -n N python tests/test_schedules_mpi.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also as the mpiexec worker
sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
from _launch import MARKER, marked_results_per_world, selected_cases, training_verdict

RESNET = {"model": "resnet18", "width": 0.25}
AMOEBA = {"model": "amoebanet-d-3-8"}

#: name -> (ranks, config), as in test_pipeline_mpi. Layout (dp, pp, gy, gx).
CASES: dict[str, tuple[int, dict[str, Any]]] = {
    # GEMS: pp=2, automatic balance, clipping; AmoebaNet's two-tensor cell outputs between stages
    "bidir-pp2-resnet-auto-clip": (2, {**RESNET, "layout": (1, 2, 1, 1), "m": 4, "schedule": "bidirectional", "balance": None, "ck": "none", "hw": (70, 52), "clip": 0.5}),
    "bidir-pp2-amoeba-ckfull": (2, {**AMOEBA, "layout": (1, 2, 1, 1), "m": 2, "schedule": "bidirectional", "balance": (4, 5), "ck": "full", "hw": (70, 52)}),
    # torch's schedules, 2P = 4 model stages on 2 ranks
    "interleaved1f1b-pp2-resnet": (2, {**RESNET, "layout": (1, 2, 1, 1), "m": 4, "schedule": "interleaved1f1b", "balance": None, "ck": "none", "hw": (70, 52)}),
    "zbv-pp2-resnet": (2, {**RESNET, "layout": (1, 2, 1, 1), "m": 4, "schedule": "zbv", "balance": (2, 3, 3, 3), "ck": "none", "hw": (70, 52)}),
    "dualpipev-pp2-amoeba": (2, {**AMOEBA, "layout": (1, 2, 1, 1), "m": 4, "schedule": "dualpipev", "balance": (2, 2, 3, 2), "ck": "none", "hw": (70, 52)}),
    # GEMS with a 1x2 tile grid on every stage, with pp=4, and with dp=2 (FSDP2 over dp)
    "bidir-pp2-sp1x2-resnet": (4, {**RESNET, "layout": (1, 2, 1, 2), "m": 2, "schedule": "bidirectional", "balance": (5, 6), "ck": "none", "hw": (70, 100)}),
    "bidir-pp4-resnet": (4, {**RESNET, "layout": (1, 4, 1, 1), "m": 4, "schedule": "bidirectional", "balance": (3, 2, 3, 3), "ck": "none", "hw": (70, 52)}),
    "bidir-dp2-pp2-resnet-accumulate2": (4, {**RESNET, "layout": (2, 2, 1, 1), "m": 2, "schedule": "bidirectional", "balance": None, "ck": "none", "hw": (70, 52), "accumulate": 2}),
    "zbv-pp2-sp1x2-resnet": (4, {**RESNET, "layout": (1, 2, 1, 2), "m": 2, "schedule": "zbv", "balance": (2, 3, 3, 3), "ck": "none", "hw": (70, 100)}),
    "dualpipev-dp2-pp2-resnet": (4, {**RESNET, "layout": (2, 2, 1, 1), "m": 4, "schedule": "dualpipev", "balance": None, "ck": "none", "hw": (70, 52)}),
    # all three: dp=2 x pp=2 x sp=1x2, FSDP2 over dp x sp on both copies, accumulation, clipping
    "bidir-dp2-pp2-sp1x2-resnet-clip-accumulate2": (8, {**RESNET, "layout": (2, 2, 1, 2), "m": 2, "schedule": "bidirectional", "balance": (5, 6), "ck": "none", "hw": (70, 100), "clip": 0.5, "accumulate": 2}),
}  # fmt: skip

#: Cases of families another default case holds (AmoebaNet's two-tensor cells between
#: stages: bidirectional and dualpipev; zbv with tiles), run by ``pytest -m slow``.
SLOW = {
    "bidir-pp2-amoeba-ckfull",
    "dualpipev-pp2-amoeba",
    "zbv-pp2-sp1x2-resnet",
    # The 8-rank world: GEMS with dp x spatial at once; its pairs are default cases.
    "bidir-dp2-pp2-sp1x2-resnet-clip-accumulate2",
}


def _worker() -> None:
    from functools import partial

    import torch
    from _worker import emit, run_world
    from mpi4py import MPI
    from test_pipeline_mpi import _run_case

    torch.set_num_threads(1)
    emit(run_world(CASES, partial(_run_case, sabotage=False), MPI.COMM_WORLD.Get_size()))


pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def launches(request: pytest.FixtureRequest) -> dict[int, dict[str, Any]]:
    """One mpiexec per world size, one after the other (the machine has few cores), running
    the selected cases only (``-m "not slow"`` leaves :data:`SLOW` out)."""
    return marked_results_per_world(
        Path(__file__).resolve(), CASES, MARKER, only=selected_cases(request)
    )


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in CASES]
)
def test_schedule_trains_like_one_process(launches: dict[int, dict[str, Any]], name: str) -> None:
    n, cfg = CASES[name]
    verdict = training_verdict(launches, n, name)
    names = verdict["names"]
    # BatchNorm running statistics of every copy were compared with the reference's.
    if cfg["model"].startswith("resnet"):
        assert any(x.endswith("running_mean") for x in names), name
    if cfg["schedule"] == "bidirectional":
        assert "two mirrored replicas" in verdict["plan"]
    dp, _, gy, gx = cfg["layout"]
    assert ("sharded by FSDP2" in verdict["plan"]) == (dp * gy * gx > 1), verdict["plan"]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    _worker()
