"""The engine's shape (issue 20, item 3): a facade over parallelize, runtimes and running stats.

Pure checks, one process: the runtime family each schedule gets, that ``ParallelModel``
stays a thin facade (length, no branch on a mode), the shared record of planned stage
shapes, and that the running-statistics merge leaves a single replica's buffers untouched.
The multi-rank exactness of every family is held by the ``*_mpi`` tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.pipeline import StageModule
from hyfi_imaging.parallel.rank_model import PlannedShapes
from hyfi_imaging.parallel.running_stats import ReplicaRunningStats
from hyfi_imaging.parallel.runtimes import (
    BidirectionalRuntime,
    JunctionRuntime,
    OnePipelineRuntime,
    TorchMultiRuntime,
    runtime_for,
)
from hyfi_imaging.parallel.schedules import SCHEDULES, LocalStage

ENGINE = Path(__file__).resolve().parents[1] / "hyfi_imaging" / "parallel" / "engine.py"

#: Words whose appearance in a condition of the facade would be a branch on a mode.
MODE_WORDS = {"schedule", "junction", "streaming", "streamed", "copies", "balance", "replica"}


def test_every_schedule_has_one_runtime_family() -> None:
    want = {
        "gpipe": OnePipelineRuntime,
        "1f1b": OnePipelineRuntime,
        "interleaved1f1b": TorchMultiRuntime,
        "zbv": TorchMultiRuntime,
        "dualpipev": TorchMultiRuntime,
        "bidirectional": BidirectionalRuntime,
    }
    assert set(want) == set(SCHEDULES)
    for schedule, cls in want.items():
        assert runtime_for(schedule, Layout(pp=2)) is cls
    junction = Layout(pp=2, grids=((1, 2), (1, 1)))
    assert runtime_for("1f1b", junction) is JunctionRuntime
    assert [c.copies for c in (OnePipelineRuntime, TorchMultiRuntime, JunctionRuntime)] == [1] * 3
    assert BidirectionalRuntime.copies == 2


def test_parallel_model_is_a_thin_facade() -> None:
    tree = ast.parse(ENGINE.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ParallelModel")
    assert cls.end_lineno is not None
    assert cls.end_lineno - cls.lineno + 1 <= 300
    branches = [n for n in ast.walk(cls) if isinstance(n, ast.If | ast.IfExp)]
    for node in branches:
        words = {
            sub.attr if isinstance(sub, ast.Attribute) else sub.id
            for sub in ast.walk(node.test)
            if isinstance(sub, ast.Attribute | ast.Name)
        }
        assert not words & MODE_WORDS, f"engine.py:{node.lineno} branches on {words & MODE_WORDS}"
    assert len(branches) <= 20


def test_stage_module_checks_the_shapes_a_runtime_recorded() -> None:
    planned = PlannedShapes()
    conv = nn.Conv2d(1, 1, 3)
    stage = StageModule([("conv", conv)], index=1, planned=lambda mb: planned.of(1, mb))
    planned.record(2, 1, [torch.Size([2, 1, 6, 6])])
    assert planned.of(1, 2) == ((2, 1, 6, 6),)
    assert stage(torch.zeros(2, 1, 8, 8)).shape == (2, 1, 6, 6)
    planned.record(2, 1, [(2, 1, 8, 8)])
    with pytest.raises(RuntimeError, match=r"\(\(2, 1, 8, 8\),\) were planned"):
        stage(torch.zeros(2, 1, 8, 8))


def test_one_replica_merges_nothing() -> None:
    torch.manual_seed(0)
    norm, plain = nn.BatchNorm2d(3), nn.BatchNorm2d(3)
    stats = ReplicaRunningStats(
        norm, [(LocalStage(0, 0), norm)], data_replica=0, replicas=1, copies=1, groups=[]
    )
    x = torch.randn(4, 3, 5, 5)
    with stats.merged():
        norm(x)
    plain(x)
    for mine, want in (
        (norm.running_mean, plain.running_mean),
        (norm.running_var, plain.running_var),
        (norm.num_batches_tracked, plain.num_batches_tracked),
    ):
        assert mine is not None and want is not None and torch.equal(mine, want)
    assert len(stats.norms()) == 1 and len(stats.snapshot()) == 1
