"""Pipeline and data parallelism composed with spatial, against one process (mpiexec).

Integration tests are data (torchtitan's way): :data:`CASES` lists small
configurations -- model, ``dp x pp x sp`` layout, micro-batches, schedule,
balance, checkpointing, image size -- and each runs through the real engine
(:func:`hyfi_imaging.parallel.verify.run_verify`, the engine behind
``hyfi-verify``): two SGD steps on every rank and, on every rank, the same two
steps in one process with the same micro-batch split. Compared: loss, outputs,
input gradients, every parameter gradient, the clipped gradient norm, eval
predictions, weights and BatchNorm running statistics, in float64.

Why this file is also the worker: pytest cannot run a test body inside
``mpiexec``, and one launch per world size (2, 4, 8 ranks, one after the other) costs far less than
one per case (start-up is seconds). Run as ``mpiexec -n N python
tests/test_pipeline_mpi.py`` it runs every case of world size N (several
layouts share one launch: meshes are built per case) and prints one JSON line.

Image sizes: AmoebaNet's 7-tap convolutions at total stride 32 need tiles of
at least 96 pixels along a split axis; ResNet needs 32.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
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
from broken_halo import dropped_halo_gradients

ROOT = Path(__file__).resolve().parents[1]

RESNET = {"model": "resnet18", "width": 0.25}
RESNET_V2 = {"model": "resnet20-v2", "width": 0.5}
AMOEBA = {"model": "amoebanet-d-3-8"}

#: name -> (ranks, config). Layout (dp, pp, gy, gx); balance None = automatic.
CASES: dict[str, tuple[int, dict[str, Any]]] = {
    # pp=2, both schedules, explicit and automatic balance, checkpointing on and off;
    # (2, 9) starts stage 1 with ResNet's in-place ReLU on the received activation
    "pp2-gpipe-resnet-explicit-inplace-cut": (2, {**RESNET, "layout": (1, 2, 1, 1), "m": 2, "schedule": "gpipe", "balance": (2, 9), "ck": "none", "hw": (70, 52)}),
    "pp2-1f1b-resnet-auto-ckfull-clip": (2, {**RESNET, "layout": (1, 2, 1, 1), "m": 4, "schedule": "1f1b", "balance": None, "ck": "full", "hw": (70, 52), "clip": 0.5}),
    "pp2-gpipe-amoeba-automem-ck2": (2, {**AMOEBA, "layout": (1, 2, 1, 1), "m": 2, "schedule": "gpipe", "balance": "memory", "ck": "every:2", "hw": (70, 52)}),
    "pp2-1f1b-amoeba-explicit": (2, {**AMOEBA, "layout": (1, 2, 1, 1), "m": 2, "schedule": "1f1b", "balance": (4, 5), "ck": "none", "hw": (70, 52)}),
    "pp2-1f1b-resnetv2-ckfull": (2, {**RESNET_V2, "layout": (1, 2, 1, 1), "m": 2, "schedule": "1f1b", "balance": (2, 7), "ck": "full", "hw": (30, 26)}),
    # pp=2 x sp=1x2 and dp=2 x sp=2x1
    "pp2-sp1x2-1f1b-resnet-ck2": (4, {**RESNET, "layout": (1, 2, 1, 2), "m": 2, "schedule": "1f1b", "balance": None, "ck": "every:2", "hw": (70, 100)}),
    "pp2-sp1x2-gpipe-amoeba-ckfull": (4, {**AMOEBA, "layout": (1, 2, 1, 2), "m": 2, "schedule": "gpipe", "balance": (3, 6), "ck": "full", "hw": (70, 190)}),
    "dp2-sp2x1-resnet-accumulate2": (4, {**RESNET, "layout": (2, 1, 2, 1), "m": 2, "schedule": "gpipe", "balance": None, "ck": "none", "hw": (100, 60), "accumulate": 2}),
    "dp2-sp2x1-amoeba-ckfull-clip": (4, {**AMOEBA, "layout": (2, 1, 2, 1), "m": 1, "schedule": "1f1b", "balance": None, "ck": "full", "hw": (190, 70), "clip": 0.5}),
    # selective checkpointing (convolution outputs kept) with spatial alone (the checkpointed
    # blocks are whole FSDP units), with deep halos, with spatial x data and spatial x pipeline
    "dp2-sp2x1-resnetv2-selective-clip": (4, {**RESNET_V2, "layout": (2, 1, 2, 1), "m": 2, "schedule": "gpipe", "balance": None, "ck": "selective", "hw": (60, 26), "clip": 0.5}),
    "sp1x2-resnet-selective-deep-halo": (2, {**RESNET, "layout": (1, 1, 1, 2), "m": 1, "schedule": "gpipe", "balance": None, "ck": "selective", "hw": (70, 100), "halo_depth": 2}),
    "pp2-sp1x2-1f1b-resnet-selective": (4, {**RESNET, "layout": (1, 2, 1, 2), "m": 2, "schedule": "1f1b", "balance": (5, 6), "ck": "selective", "hw": (70, 100)}),
    # deep checkpointing (layer1's block inputs computed again from its input, the blocks'
    # units checkpointed again) on tiles, with pipeline stages, and on blocks without units
    "sp1x2-resnet-deep-clip": (2, {**RESNET, "layout": (1, 1, 1, 2), "m": 1, "schedule": "gpipe", "balance": None, "ck": "deep", "hw": (70, 100), "clip": 0.5}),
    "pp2-sp1x2-1f1b-resnet-deep": (4, {**RESNET, "layout": (1, 2, 1, 2), "m": 2, "schedule": "1f1b", "balance": (5, 6), "ck": "deep", "hw": (70, 100)}),
    "dp2-sp2x1-resnetv2-deep": (4, {**RESNET_V2, "layout": (2, 1, 2, 1), "m": 2, "schedule": "gpipe", "balance": None, "ck": "deep", "hw": (60, 26)}),
    # torch.compile over FSDP2 on data replicas (torch's kernels: exact)
    "dp2-resnet-compiled": (2, {**RESNET, "layout": (2, 1, 1, 1), "m": 1, "schedule": "gpipe", "balance": None, "ck": "none", "hw": (70, 52), "compile": "aot_eager"}),
    # dp=2 x pp=2 x sp=1x2: 8 ranks
    "dp2-pp2-sp1x2-1f1b-resnet-ckfull-clip-accumulate2": (8, {**RESNET, "layout": (2, 2, 1, 2), "m": 2, "schedule": "1f1b", "balance": None, "ck": "full", "hw": (70, 100), "clip": 0.5, "accumulate": 2}),
    "dp2-pp2-sp1x2-gpipe-amoeba": (8, {**AMOEBA, "layout": (2, 2, 1, 2), "m": 2, "schedule": "gpipe", "balance": (5, 4), "ck": "none", "hw": (70, 190)}),
}  # fmt: skip

#: Cases that must *fail*: verification that cannot fail proves nothing.
SABOTAGED = {"pp2-sp1x2-resnet-broken-halo": (4, {**RESNET, "layout": (1, 2, 1, 2), "m": 2, "schedule": "gpipe", "balance": (6, 5), "ck": "none", "hw": (70, 100)})}  # fmt: skip

WORLDS = sorted({n for n, _ in [*CASES.values(), *SABOTAGED.values()]})

#: Cases whose families other default cases hold (AmoebaNet beyond its automatic memory
#: balance; selective checkpointing with pipeline stages), run by ``pytest -m slow``.
SLOW = {
    "pp2-1f1b-amoeba-explicit",
    "pp2-sp1x2-gpipe-amoeba-ckfull",
    "dp2-sp2x1-amoeba-ckfull-clip",
    "dp2-pp2-sp1x2-gpipe-amoeba",
    "pp2-sp1x2-1f1b-resnet-selective",
    # deep checkpointing with pipeline stages and on blocks without units: its tile case is a
    # default one
    "pp2-sp1x2-1f1b-resnet-deep",
    "dp2-sp2x1-resnetv2-deep",
    # The 8-rank world (dp x pp x spatial at once): its pairs are default cases above.
    "dp2-pp2-sp1x2-1f1b-resnet-ckfull-clip-accumulate2",
}


# ----------------------------------------------------------------------------- worker


def _run_case(cfg: dict[str, Any], *, sabotage: bool) -> dict[str, Any]:
    import torch
    from torch._dynamo.utils import counters

    from hyfi_imaging.models import create_model
    from hyfi_imaging.parallel.engine import ParallelPlan
    from hyfi_imaging.parallel.launch import init_parallel
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.parallel.verify import run_verify

    dp, pp, gy, gx = cfg["layout"]
    layout = Layout(dp=dp, pp=pp, sp=(gy, gx))
    balance = cfg["balance"]
    plan = ParallelPlan(
        layout,
        microbatches=cfg["m"],
        schedule=cfg["schedule"],
        balance=balance if isinstance(balance, tuple) else None,
        balance_by="memory" if balance == "memory" else "time",
        checkpointing=cfg["ck"],
        halo_depth=cfg.get("halo_depth", 1),
        compile=cfg.get("compile", "none"),
    )
    kwargs: dict[str, Any] = {"num_classes": 3}
    if "width" in cfg:
        kwargs["width"] = cfg["width"]
    pc = init_parallel(layout)
    counters.clear()  # one launch runs its world's cases one after another
    began = time.perf_counter()
    with dropped_halo_gradients() if sabotage else nullcontext():
        report = run_verify(
            lambda: create_model(cfg["model"], **kwargs),
            pc,
            image_hw=cfg["hw"],
            batch=2 * cfg["m"],
            steps=2,
            dtype=torch.float64,
            plan=plan,
            clip_grad=cfg.get("clip"),
            accumulate=cfg.get("accumulate", 1),
        )
    return {
        "ok": report.ok,
        "max_rel": report.max_rel_error,
        "compared": len(report.comparisons),
        "failed": [c.name for c in report.comparisons if not c.ok][:5],
        "names": sorted(c.name for c in report.comparisons),
        "plan": report.plan,
        "seconds": time.perf_counter() - began,
        "graphs": counters["stats"]["unique_graphs"],  # torch.compile's captured graphs
    }


def _worker() -> None:
    from functools import partial

    import torch
    from _worker import emit, run_world

    from hyfi_imaging.errors import ConfigError
    from hyfi_imaging.parallel.launch import init_parallel
    from hyfi_imaging.parallel.layout import Layout

    torch.set_num_threads(1)
    from mpi4py import MPI

    world = MPI.COMM_WORLD.Get_size()
    results: dict[str, Any] = {}
    # A layout that needs another world size fails before any group or compute.
    try:
        init_parallel(Layout(pp=world + 1))
        results["world-mismatch"] = {"ok": False, "detail": "no error"}
    except ConfigError as err:
        results["world-mismatch"] = {"ok": "launch with -np" in str(err), "detail": str(err)}
    for table, sabotage in ((CASES, False), (SABOTAGED, True)):
        results.update(run_world(table, partial(_run_case, sabotage=sabotage), world))
    if not torch.distributed.is_initialized():  # no case ran here: a group for emit's barrier
        init_parallel(Layout(dp=world))
    emit(results)


# ----------------------------------------------------------------------------- pytest

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def launches(request: pytest.FixtureRequest) -> dict[int, dict[str, Any]]:
    """One mpiexec per world size, one world after the other, running the selected cases only
    (``-m "not slow"`` leaves :data:`SLOW` out), every verdict by name.

    One at a time: three worlds at once put 14 ranks on 2 cores, and a rank that
    waits on a busy core can time out or be taken by the OOM killer.
    """
    if not have_mpiexec():
        pytest.skip("mpiexec not found (install the mpich extra)")
    return marked_results_per_world(
        Path(__file__).resolve(),
        {**CASES, **SABOTAGED},
        MARKER,
        only=selected_cases(request),
        worlds=selected_cases(request, "n"),
    )


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in CASES]
)
def test_layout_trains_like_one_process(launches: dict[int, dict[str, Any]], name: str) -> None:
    n, cfg = CASES[name]
    verdict = training_verdict(launches, n, name)
    names = verdict["names"]
    if cfg.get("clip"):
        assert any("grad_norm" in x for x in names)
    if cfg["balance"] in (None, "memory") and cfg["layout"][1] > 1:
        assert "automatic" in verdict["plan"]
    dp, _, gy, gx = cfg["layout"]
    # Parameters, gradients and optimizer state are sharded wherever ranks share them.
    assert ("sharded by FSDP2" in verdict["plan"]) == (dp * gy * gx > 1), verdict["plan"]
    assert bool(verdict["graphs"]) == ("compile" in cfg)  # compiled where asked, only there


@pytest.mark.parametrize("name", list(SABOTAGED))
def test_broken_halo_backward_is_caught(launches: dict[int, dict[str, Any]], name: str) -> None:
    n, _ = SABOTAGED[name]
    verdict = launches[n].get(name) or launches[n]["_launch"]
    assert "error" not in verdict, verdict
    assert not verdict["ok"]
    assert any("input_grad" in f or "grad/" in f for f in verdict["failed"])


#: Worlds the default cases launch anyway; a mismatch check alone launches no other world.
_DEFAULT_WORLDS = {n for name, (n, _) in CASES.items() if name not in SLOW} | {
    n for n, _ in SABOTAGED.values()
}


@pytest.mark.parametrize(
    "n", [pytest.param(n, marks=[] if n in _DEFAULT_WORLDS else [pytest.mark.slow]) for n in WORLDS]
)
def test_world_mismatch_fails_before_compute(launches: dict[int, dict[str, Any]], n: int) -> None:
    verdict = launches[n].get("world-mismatch") or launches[n].get("_launch")
    assert verdict and verdict["ok"], verdict


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker()
