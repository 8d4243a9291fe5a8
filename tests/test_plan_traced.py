"""hyfi-plan for models that are no chain (a U-Net), cut into pipeline stages (issue 23).

A U-Net pipelines as its traced chain form (``parallel/chain_form.py``); the planner reads the
same layers from its meta copy (``parallel/model_trace.py``). Single process: what the meta
trace says a stage saves is what a real stage run on the CPU saves, storage by storage; the
predicted per-stage peak is close to a measured forward and backward of that stage; every
``pp > 1`` layout is ranked by ``hyfi-plan``, and one the planner cannot predict is said, not
dropped; ``hyfi-verify``'s memory estimate is made for such runs.
"""

from __future__ import annotations

import gc
import re
from functools import partial
from typing import Any

import pytest
import torch
from fresh import in_fresh_process
from torch import nn

from hyfi_imaging.cli.plan import _predict_all, main
from hyfi_imaging.models import create_model
from hyfi_imaging.parallel.candidates import candidates
from hyfi_imaging.parallel.engine import ParallelPlan
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.memory import AnonymousPeak, fix_malloc_threshold, saved_activations
from hyfi_imaging.parallel.model_trace import layer_of, meta_model, trace_model
from hyfi_imaging.parallel.pipeline import (
    as_tuple,
    cut_stages,
    model_layers,
    set_checkpointing,
    stage_bounds,
)
from hyfi_imaging.parallel.plan import Candidate, nominal_device, predict
from hyfi_imaging.parallel.verify_memory import estimate_memory

#: The house's tolerance for a predicted per-rank peak against a measured one
#: (``tests/test_plan_mpi.py``).
TOLERANCE = 0.15


def _unet(width: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return create_model("unet2d", width=width, num_classes=2)


def test_the_meta_copy_of_a_cut_unet_is_its_traced_layers() -> None:
    """One stage: the whole model, one layer; several: the traced layers, on the same meta
    modules; module paths name their layer by what the layer holds."""
    model = _unet()
    one, cut = meta_model(model), meta_model(model, "none", 2)
    assert [n for n, _ in one.layers] == ["UNet"] and not one.traced
    assert cut.traced and cut.module is one.module
    assert [n for n, _ in cut.layers] == [n for n, _ in model_layers(model, 2)]
    names = [n for n, _ in cut.layers]
    assert names[:3] == ["encoder.0", "pools.0", "encoder.1"] and names[-1] == "head"
    # Checkpointed blocks by model path (no class-name prefix), each in its own layer.
    blocks = cut.blocks("full")
    assert blocks[0] == "encoder.0" and "decoder.3" in blocks
    assert [layer_of(cut.layers, b) for b in blocks] == [names.index(b) for b in blocks]
    assert layer_of(cut.layers, "decoder.1.conv2") == names.index("decoder.1")
    assert layer_of(cut.layers, "encoder") is None  # a level spread over several layers
    assert layer_of(one.layers, "UNet.decoder.1.conv2") == 0
    chain = meta_model(create_model("resnet18", num_classes=2, width=0.25), "none", 2)
    assert layer_of(chain.layers, "layer3.0.conv1") == [n for n, _ in chain.layers].index("layer3")


def test_a_traced_stage_read_from_the_meta_trace_is_what_a_real_stage_saves() -> None:
    """For every first and last stage of a U-Net cut in two, what the planner reads from its
    one meta trace (owners, bytes, dtypes; each leaf call's sizes) equals what the real stage,
    cut as training cuts it, saves when it runs on the CPU on the tensors it receives."""
    model = _unet()
    shape = (2, 3, 32, 48)
    whole = trace_model(model, shape, stages=2)
    n = len(whole.layers)
    x = torch.randn(shape)
    for first in (1, n // 2, n - 1):
        stages = cut_stages(model, (first, n - first))
        with torch.no_grad():
            received = as_tuple(stages[0](x))
        assert [t.shape for t in received] == [t.shape for t in whole.boundaries[first]]
        for stage, (start, stop) in zip(stages, stage_bounds((first, n - first)), strict=True):
            ins = (x,) if start == 0 else tuple(t.clone().requires_grad_(True) for t in received)
            real = saved_activations(stage, partial(stage, *ins), stage.named_layers())
            meta = whole.stage(start, stop)
            assert real.activations > 0
            assert [(o, b, d) for _, o, b, d in meta.storages] == [
                (o, b, d) for _, o, b, d in real.storages
            ], (start, stop)
            assert [(c[0], c[2], c[3], c[4]) for c in meta.calls] == [
                (c[0], c[2], c[3], c[4]) for c in real.calls
            ]
            assert meta.by_layer() == real.by_layer()
            assert set(meta.by_layer()) <= {name for name, _ in whole.layers[start:stop]}


def _stage_peak(stage: nn.Module, ins: tuple[torch.Tensor, ...], first: bool, last: bool) -> int:
    """Measured: one forward and backward of ``stage`` and an SGD step with momentum, on one
    thread. What it receives (the first stage: the image, needing no gradient) and the output
    gradient it is sent are allocated inside the phase, as the pipeline's receive buffers are;
    nothing of an earlier step is alive."""
    opt = torch.optim.SGD(stage.parameters(), lr=1e-3, momentum=0.9)
    gc.collect()
    with AnonymousPeak() as peak:
        got = tuple(t.clone().requires_grad_(not first) for t in ins)
        out = stage(*got)
        if last:
            target = torch.zeros(out.shape[0], *out.shape[2:], dtype=torch.long)
            nn.functional.cross_entropy(out, target).backward()
            del target
        else:
            outs = as_tuple(out)
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            del outs
        del out, got
        opt.step()
        opt.zero_grad(set_to_none=True)
    del opt
    return peak.bytes


def _predicted_and_measured(checkpointing: str) -> list[tuple[int, int]]:
    """Per pipeline rank of ``unet2d`` on two stages: (predicted, measured) peak bytes. Run in
    a fresh process (``tests/fresh.py`` says why)."""
    fix_malloc_threshold()
    torch.set_num_threads(1)
    model, hw, batch = _unet(width=8), (192, 192), 2
    cand = Candidate(Layout(pp=2), 1, checkpointing, "gpipe")
    pred = predict(model, hw, batch, cand, overhead=0)
    set_checkpointing(model, checkpointing)
    stages = cut_stages(model, pred.balance)
    x = torch.randn(batch, 3, *hw)
    with torch.no_grad():
        received = as_tuple(stages[0](x))
    inputs = [(x,), received]
    out = []
    for s, stage in enumerate(stages):
        _stage_peak(stage, inputs[s], s == 0, s == 1)  # warm-up: kernels, allocator
        out.append((pred.rank_peaks[s], _stage_peak(stage, inputs[s], s == 0, s == 1)))
    return out


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_a_unet_pipelines_predicted_peaks_are_close_to_measured_stage_runs(
    checkpointing: str,
) -> None:
    """``unet2d`` on two pipeline stages (GPipe, one micro-batch): each pipeline rank's
    predicted peak (activations, the backward's working set, gradients and momentum, the
    receive buffers) against its stage run in a fresh process, cut at the planner's balance:
    within the house's 15 %. Measured 2026 on this VM, 192x192, width 8, batch 2: none +6.0 %
    / -4.6 %, selective -6.1 % / +8.1 %; full checkpointing reads -14.1 % / +1.0 % (the first
    stage's recomputation, as for chains, not checked here: too close to the line). Measured in
    this test process after the rest of the suite, stage 0 read +39 %: pages freed by earlier
    tests were reused unseen."""
    try:
        with AnonymousPeak():
            pass
    except OSError:
        pytest.skip("needs Linux's /proc/self/clear_refs")
    pairs = in_fresh_process("test_plan_traced", "_predicted_and_measured", checkpointing)
    for s, (predicted, measured) in enumerate(pairs):
        error = predicted / measured - 1
        assert abs(error) <= TOLERANCE, (
            f"stage {s}: predicted {predicted / 2**20:.1f} MiB, measured "
            f"{measured / 2**20:.1f} MiB ({100 * error:+.1f} %)"
        )


def test_hyfi_plan_ranks_the_pipelines_of_a_unet(capsys: pytest.CaptureFixture[str]) -> None:
    """Every layout of unet2d on 2 devices is ranked, the pipelines among them, with a step
    time; none is left out."""
    model = _unet(width=64)
    want = list(candidates(model, (64, 64), 2, 1))
    assert sum(c.layout.pp > 1 for c in want) >= 4
    assert main(["--model", "unet2d", "--image-size", "64", "--devices", "2", "--top", "100"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"\s*\d+ dp\d+ pp\d+ ", line)]
    assert len(rows) == len(want), out
    piped = [r for r in rows if " pp2 " in r]
    assert len(piped) == sum(c.layout.pp > 1 for c in want)
    assert all(float(r.split()[9]) > 0 for r in piped)  # step s
    assert not [
        line for line in out.splitlines() if line.startswith("hyfi-plan:") and "left out" in line
    ]


class _Untraceable(nn.Module):
    """Python control flow on a shape: torch.fx cannot trace it (a meta run can)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> Any:
        y = self.a(x)
        return self.b(y) if y.shape[-1] > 8 else y


def test_a_layout_the_planner_cannot_predict_is_said_not_dropped() -> None:
    """The pipeline of a model torch.fx cannot trace is left out with its reason (the
    ConfigError naming the fix); the layouts without a pipeline are ranked."""
    model = _Untraceable()
    todo = [Candidate(Layout()), Candidate(Layout(pp=2))]
    left_out: list[str] = []
    preds = _predict_all(
        model, (32, 32), 1, todo, optimizer="sgd", dev=nominal_device(1e12, 1e10),
        overlap=False, left_out=left_out,
    )  # fmt: skip
    assert [p.candidate for p in preds] == todo[:1]
    assert len(left_out) == 1 and left_out[0].startswith(todo[1].describe())
    assert "cannot be traced" in left_out[0] and "--pipeline 1" in left_out[0]


def test_the_verify_memory_estimate_is_made_for_a_unet_pipeline() -> None:
    """``hyfi-verify --model unet2d --pipeline 2`` is estimated (it said "not available"): the
    layout's part is the planner's prediction for the same plan."""
    model = _unet()
    plan = ParallelPlan(Layout(pp=2), microbatches=2, schedule="1f1b")
    est = estimate_memory(model, (64, 64), 2, plan, "cpu")
    cand = Candidate(Layout(pp=2), 2, "none", "1f1b")
    assert est.rank_peak == predict(model, (64, 64), 2, cand, cpu_kernels=True).peak
    assert est.rank_peak < est.reference_peak  # a stage holds less than the whole model
