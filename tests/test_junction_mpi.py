"""Per-stage grids (the junction) against one process, in float64 (mpiexec).

Each case is a small configuration run through the real engine
(:func:`hyfi_imaging.parallel.verify.run_verify`, the engine behind
``hyfi-verify``): two SGD steps on every rank and the same steps in one
process with the same micro-batch split; compared are the loss, outputs,
input gradients, every parameter gradient, eval predictions, the weights and
BatchNorm statistics. Run as ``mpiexec -n N python tests/test_junction_mpi.py``
this file is the worker: it runs every case of world size N in one launch (a
launch costs ~13 CPU-seconds of start-up) and prints one JSON line.

Image sizes are odd, so every grid pads and masks a tail; AmoebaNet's cuts
(3 or 5 layers in) send its ``(current, previous)`` pair, at two resolutions,
across the junction.
"""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))  # also as the mpiexec worker
from _launch import (
    MARKER,
    have_mpiexec,
    marked_results_per_world,
    selected_cases,
    training_verdict,
)

RESNET = {"model": "resnet18", "width": 0.25}
AMOEBA = {"model": "amoebanet-d-3-8"}

#: name -> (ranks, config); ``grids`` one per stage, ``dp`` replicas.
CASES: dict[str, tuple[int, dict[str, Any]]] = {
    # one column or one row of tiles gathered into one rank
    "1x2-1x1-resnet-gpipe": (3, {**RESNET, "dp": 1, "grids": ((1, 2), (1, 1)), "m": 2, "schedule": "gpipe", "balance": (5, 6), "ck": "none", "hw": (45, 101)}),
    "2x1-1x1-amoeba-two-tensors": (3, {**AMOEBA, "dp": 1, "grids": ((2, 1), (1, 1)), "m": 2, "schedule": "gpipe", "balance": (3, 6), "ck": "none", "hw": (193, 45)}),
    # four tiles gathered into one feature map (MPI4DL's junction)
    "2x2-1x1-resnet-1f1b": (5, {**RESNET, "dp": 1, "grids": ((2, 2), (1, 1)), "m": 2, "schedule": "1f1b", "balance": (4, 7), "ck": "none", "hw": (75, 53)}),
    # two replicas, checkpointing, AmoebaNet's pair crossing at two resolutions
    "dp2-1x2-1x1-amoeba-ck2-clip": (6, {**AMOEBA, "dp": 2, "grids": ((1, 2), (1, 1)), "m": 2, "schedule": "1f1b", "balance": (5, 4), "ck": "every:2", "hw": (45, 193), "clip": 0.5}),
    # three stages, 2x2 -> 1x2 -> 1x1, every block checkpointed
    "2x2-1x2-1x1-resnet-ckfull": (7, {**RESNET, "dp": 1, "grids": ((2, 2), (1, 2), (1, 1)), "m": 3, "schedule": "1f1b", "balance": (4, 3, 4), "ck": "full", "hw": (71, 101)}),
    # two mirrored replicas (GEMS) on per-stage grids: 2 positions of 2 ranks, one rank
    # holding A's first stage and B's last, its mirror the other two copies
    "gems-1x2-1x1-resnet": (4, {**RESNET, "dp": 1, "grids": ((1, 2), (1, 1)), "m": 2, "schedule": "bidirectional", "balance": (5, 6), "ck": "none", "hw": (45, 101)}),
    # ... and AmoebaNet's pair crossing the junction of both replicas
    "gems-2x1-1x1-amoeba-two-tensors": (4, {**AMOEBA, "dp": 1, "grids": ((2, 1), (1, 1)), "m": 2, "schedule": "bidirectional", "balance": (3, 6), "ck": "none", "hw": (193, 45)}),
    # ... with two data replicas, AmoebaNet's pair crossing, checkpointing and clipping
    "gems-dp2-2x1-1x1-amoeba-ck2-clip": (8, {**AMOEBA, "dp": 2, "grids": ((2, 1), (1, 1)), "m": 4, "schedule": "bidirectional", "balance": (3, 6), "ck": "every:2", "hw": (193, 45), "clip": 0.5}),
}  # fmt: skip


# ----------------------------------------------------------------------------- worker


def _run_case(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from hyfi_imaging.models import create_model
    from hyfi_imaging.parallel.engine import ParallelPlan
    from hyfi_imaging.parallel.launch import init_parallel
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.parallel.verify import run_verify

    grids = cfg["grids"]
    layout = Layout(dp=cfg["dp"], pp=len(grids), grids=grids)
    plan = ParallelPlan(
        layout,
        microbatches=cfg["m"],
        schedule=cfg["schedule"],
        balance=cfg["balance"],
        checkpointing=cfg["ck"],
    )
    kwargs: dict[str, Any] = {"num_classes": 3}
    if "width" in cfg:
        kwargs["width"] = cfg["width"]
    pc = init_parallel(layout, schedule=cfg["schedule"])
    began = time.perf_counter()
    report = run_verify(
        lambda: create_model(cfg["model"], **kwargs),
        pc,
        image_hw=cfg["hw"],
        batch=2 * cfg["m"],
        steps=2,
        dtype=torch.float64,
        plan=plan,
        clip_grad=cfg.get("clip"),
    )
    refused = ""
    if cfg["schedule"] == "bidirectional":  # the job's placement and the plan's must agree
        from hyfi_imaging.errors import ConfigError
        from hyfi_imaging.parallel.engine import ParallelModel

        try:
            ParallelModel(
                create_model(cfg["model"], **kwargs),
                pc,
                ParallelPlan(layout, microbatches=cfg["m"], balance=cfg["balance"]),
                image_hw=cfg["hw"],
            )
        except ConfigError as err:
            refused = str(err)
    return {
        "refused": refused,
        "ok": report.ok,
        "max_rel": report.max_rel_error,
        "failed": [c.name for c in report.comparisons if not c.ok][:5],
        "names": sorted(c.name for c in report.comparisons),
        "plan": report.plan,
        "seconds": time.perf_counter() - began,
    }


def _worker() -> None:
    import torch
    from _worker import emit, run_world
    from mpi4py import MPI

    torch.set_num_threads(1)
    emit(run_world(CASES, _run_case, MPI.COMM_WORLD.Get_size()))


# ----------------------------------------------------------------------------- pytest

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def launches(request: pytest.FixtureRequest) -> dict[int, dict[str, Any]]:
    """One mpiexec per world size, one after the other (a 2-core machine), every case's verdict."""
    if not have_mpiexec():
        pytest.skip("mpiexec not found (install the mpich extra)")
    return marked_results_per_world(
        Path(__file__).resolve(), CASES, MARKER, only=selected_cases(request)
    )


#: The 6- and 7-rank worlds (two replicas of a junction; three stages): compositions whose
#: parts the default cases hold (dp x spatial and checkpointing in the pipeline and schedule
#: tests; every rank's derived facts of a junction in tests/test_rank_facts.py), run by
#: ``pytest -m slow``: a world of 6 or 7 ranks on CI's 2 cores is most of this file's time.
#: The 3-rank world too (since 2026-11-28, the suite's time): its junction and AmoebaNet's
#: pair run by default in the 4-rank world's mirrored cases (the same pieces, both replicas)
#: and in the 5-rank 1F1B case.
SLOW = {
    "1x2-1x1-resnet-gpipe",
    "2x1-1x1-amoeba-two-tensors",
    "dp2-1x2-1x1-amoeba-ck2-clip",
    "2x2-1x2-1x1-resnet-ckfull",
    "gems-dp2-2x1-1x1-amoeba-ck2-clip",
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in CASES]
)
def test_junction_trains_like_one_process(launches: dict[int, dict[str, Any]], name: str) -> None:
    n, cfg = CASES[name]
    verdict = training_verdict(launches, n, name)
    names = verdict["names"]
    if cfg.get("clip"):
        assert any("grad_norm" in x for x in names)
    assert "a grid per stage" in verdict["plan"], verdict["plan"]
    # The first stage's ranks shard over their own dp x tiles.
    gy, gx = cfg["grids"][0]
    assert f"FSDP2 over {cfg['dp'] * gy * gx} ranks" in verdict["plan"], verdict["plan"]
    if cfg["schedule"] == "bidirectional":  # rank 0 holds A's first stage and B's last
        assert "init_parallel(layout, schedule=plan.schedule)" in verdict["refused"]
        assert "two mirrored replicas on per-stage grids" in verdict["plan"]
        rows = [line.split() for line in verdict["plan"].splitlines()]
        assert [r[2] for r in rows if r[:2] == ["0", "0"]] == ["A0", "B1"], verdict["plan"]


@pytest.mark.slow
def test_hyfi_train_runs_a_junction_like_one_process(train_manifest: Path, tmp_path: Path) -> None:
    """A recipe with ``spatial: [1x2, 1x1]`` trains through hyfi-train (3 ranks): its first
    losses equal one process's to float32 rounding (float64 exactness is the cases above)."""
    from test_train_mpi import _losses, _train

    sets = ("optim.name=sgd", "optim.lr=0.01", "train.epochs=1", "parallel.microbatches=2")
    _train(train_manifest, tmp_path / "one", 1, "parallel.spatial=1x1", *sets)
    _train(
        train_manifest,
        tmp_path / "junction",
        3,
        "parallel.spatial=1x2,1x1",
        "parallel.pipeline=2",
        *sets,
    )
    one, junction = _losses(tmp_path / "one"), _losses(tmp_path / "junction")
    assert len(one) == len(junction) == 3
    assert one[:2] == pytest.approx(junction[:2], rel=1e-4, abs=1e-5)
    # Two mirrored replicas of the same junction (GEMS): 4 ranks, the same losses.
    _train(
        train_manifest,
        tmp_path / "gems",
        4,
        "parallel.spatial=1x2,1x1",
        "parallel.pipeline=2",
        "parallel.schedule=bidirectional",
        *sets,
    )
    gems = _losses(tmp_path / "gems")
    assert len(gems) == 3 and one[:2] == pytest.approx(gems[:2], rel=1e-4, abs=1e-5)
    assert gems == pytest.approx(junction, rel=1e-5)  # the same junction, mirrored
    # Its checkpoint (two copies of every stage, on two replicas' meshes) loads in one
    # process and predicts what the junction's does (one process's third loss already
    # differs from both in float32: 0.9261 against 0.9254).
    preds = []
    for run in ("junction", "gems"):
        out = tmp_path / f"{run}.csv"
        cmd = [sys.executable, "-m", "hyfi_imaging.cli.predict", str(tmp_path / run),
               "--manifest", str(train_manifest), "--out", str(out)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        preds.append(list(csv.DictReader(out.open())))
    assert len(preds[0]) == len(preds[1]) == 8
    for a, b in zip(*preds, strict=True):
        assert a["slide_id"] == b["slide_id"]
        assert float(a["p_1"]) == pytest.approx(float(b["p_1"]), abs=1e-4)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    _worker()
