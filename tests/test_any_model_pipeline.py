"""Pipelines for any traceable model (``parallel/chain_form.py``, issue 23).

Single process, float64: a model's traced chain form, cut into stages and chained again,
gives the model's outputs, input gradient and every parameter gradient bit for bit, under
the model's own parameter names -- the project's U-Nets (2-D and 3-D, odd sizes, so the
decoder pads), a hand-written model with skips, concatenations, an interpolation, a
module called twice and a root parameter, and the U-Net with checkpointed blocks. What
cannot be traced is refused in one line with the fix.

Multi-rank (mpiexec), float64 through ``hyfi-verify``: ``unet2d`` on 2 pipeline stages,
on 2 stages x a 1x2 grid with checkpointing, and with 1F1B over 2 micro-batches.
"""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models import create_model
from hyfi_imaging.parallel.chain_form import chain_layers
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.parallel_plan import ParallelPlan
from hyfi_imaging.parallel.pipeline import (
    StageModule,
    cut_stages,
    model_layers,
    set_checkpointing,
    stage_boundaries,
    stage_called,
)
from hyfi_imaging.parallel.sharding import called_modules, stage_units

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
from _launch import have_mpiexec, json_line, mpiexec


class SkipNet(nn.Module):
    """Skips across the network, a concatenation, an interpolation and a residual at the top
    level, a module called twice (its calls must share a layer), a root parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.down = nn.Conv2d(4, 6, 3, stride=2, padding=1)
        self.mix = nn.Conv2d(6, 6, 1)
        self.fuse = nn.Conv2d(10, 4, 3, padding=1)
        self.head = nn.Conv2d(4, 3, 1)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.stem(x))
        b = self.mix(torch.relu(self.down(a)))
        b = self.mix(b) * self.scale  # the same module again
        up = F.interpolate(b, size=a.shape[-2:], mode="bilinear", align_corners=False)
        y = self.fuse(torch.cat([a, up], 1)) + a
        return self.head(y)


class Untraceable(nn.Module):
    """Python control flow on a tensor's value: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if x.sum() > 0 else self.b(x)


class ShapeAcross(nn.Module):
    """A shape (an int, not a tensor) read in one layer and used two layers later."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(1, 2, 1), nn.Conv2d(2, 2, 1), nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        w = y.size(-1)
        return self.c(self.b(y))[..., : w - 1]


def _run_stages(stages: list[StageModule], x: torch.Tensor) -> torch.Tensor:
    y: object = x
    for stage in stages:
        y = stage(*y) if isinstance(y, tuple) else stage(y)
    assert isinstance(y, torch.Tensor)
    return y


def _assert_same_as_model(
    model: nn.Module, balance: tuple[int, ...], shape: tuple[int, ...]
) -> None:
    """Stages of the chain form, chained, equal the model: outputs, gradients, names."""
    torch.manual_seed(1)
    model = model.double().train()
    ref = copy.deepcopy(model)
    stages = cut_stages(model, balance)
    names = [k for s in stages for k in s.state_dict()]
    assert sorted(names) == sorted(model.state_dict())  # every key once, the model's names
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, want = _run_stages(stages, x), ref(x_ref)
    assert torch.equal(out, want)
    (out * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    (want * torch.arange(want.numel(), dtype=want.dtype).reshape(want.shape)).sum().backward()
    assert x.grad is not None and x_ref.grad is not None and torch.equal(x.grad, x_ref.grad)
    got = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        mine = got[name].grad
        assert mine is not None and p.grad is not None and torch.equal(mine, p.grad), name
    for name, buf in ref.named_buffers():  # BatchNorm statistics, updated once
        assert torch.equal(dict(model.named_buffers())[name], buf), name


@pytest.mark.parametrize(
    ("name", "kwargs", "shape", "balance"),
    [
        ("unet2d", {"width": 4, "depth": 3, "in_chans": 1}, (2, 1, 45, 37), (5, 9)),
        ("unet2d", {"width": 4, "depth": 3, "in_chans": 1}, (2, 1, 45, 37), (2, 4, 3, 5)),
        ("unet3d", {"width": 2, "depth": 2, "in_chans": 1}, (2, 1, 12, 10, 14), (4, 6)),
    ],
    ids=["unet2d-2-stages", "unet2d-4-stages", "unet3d-2-stages"],
)
def test_unet_chain_form_is_the_model(
    name: str, kwargs: dict[str, int], shape: tuple[int, ...], balance: tuple[int, ...]
) -> None:
    _assert_same_as_model(create_model(name, **kwargs), balance, shape)


def test_unet_chain_form_layers_and_live_skips() -> None:
    """One layer per module call; the cut after ``pools.1`` hands on three skips at three
    scales and the pooled map (the meta trace plans every one of them)."""
    model = create_model("unet2d", width=4, depth=3, in_chans=1)
    names = [n for n, _ in model_layers(model, 2)]
    assert names == [
        "encoder.0", "pools.0", "encoder.1", "pools.1", "encoder.2", "pools.2", "encoder.3",
        "ups.0", "decoder.0", "ups.1", "decoder.1", "ups.2", "decoder.2", "head",
    ]  # fmt: skip
    assert model_layers(model, 1) == [("UNet", model)]  # one stage: the model itself
    bounds = stage_boundaries(model, (4, 10), (2, 1, 45, 37))
    assert [tuple(t.shape) for t in bounds[1]] == [(2, 4, 45, 37), (2, 8, 22, 18), (2, 8, 11, 9)]
    assert [tuple(t.shape) for t in bounds[2]] == [(2, 2, 45, 37)]


def test_checkpointed_blocks_in_the_chain_form() -> None:
    """The double convolutions are whole layers, so their checkpointing travels with them."""
    model = create_model("unet2d", width=4, depth=2, in_chans=1)
    assert len(set_checkpointing(model, "full")) == 5
    _assert_same_as_model(model, (4, 6), (2, 1, 21, 26))


def test_hand_written_model_with_skips() -> None:
    model = SkipNet()
    layers = model_layers(model, 2)
    # stem; down (with its ReLU); mix twice with the root parameter, and what follows to fuse's
    # input, in one layer; fuse; head.
    assert [n for n, _ in layers] == ["stem", "down", "mix", "fuse", "head"]
    _assert_same_as_model(model, (2, 3), (2, 2, 15, 13))
    _assert_same_as_model(SkipNet(), (1, 1, 1, 1, 1), (1, 2, 8, 9))


def test_a_traced_model_passes_the_plan_checks() -> None:
    ParallelPlan(Layout(pp=2)).validate(create_model("unet2d", width=4, depth=2), 2)
    with pytest.raises(ConfigError, match=r"halo-depth 2.*use --halo-depth 1"):
        ParallelPlan(Layout(pp=2), halo_depth=2).validate(SkipNet(), 2)
    with pytest.raises(ConfigError, match=r"needs 8 model stages.*only 5 top-level layers"):
        ParallelPlan(Layout(pp=8)).validate(SkipNet(), 8)


def test_untraceable_model_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        ParallelPlan(Layout(pp=2)).validate(Untraceable(), 2)
    text = str(err.value)
    assert "Untraceable" in text and "torch.fx" in text and "--pipeline 1" in text
    assert "\n" not in text
    ParallelPlan(Layout(pp=1)).validate(Untraceable(), 2)  # one stage: the model itself


def test_a_non_tensor_across_a_layer_boundary_is_refused() -> None:
    layers = chain_layers(ShapeAcross())
    x: object = torch.randn(1, 1, 4, 4)
    with pytest.raises(ConfigError, match=r"hands a int, not a tensor.*--pipeline 1"):
        for _, layer in layers:
            x = layer(x)


# ----------------------------------------------------------------------------- multi-rank


def _mark(ran: set[str], path: str, _m: nn.Module, _a: object) -> None:
    ran.add(path)


def test_fsdp_units_of_a_traced_stage_are_modules_the_stage_calls() -> None:
    """A traced stage mounts the modules it calls under plain levels (``layer1`` holding
    ``layer1.0`` ..); the whole model calls ``layer1``, the stage never does, and an FSDP2
    unit there never gathered its parameters (torchvision's ResNet-18 on 2 stages with 2
    ranks each failed with mixed Tensor and DTensor). Every unit chosen for each stage of
    the cut runs when the stage runs (forward pre-hooks, on the meta device)."""
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(num_classes=3).to("meta")
    called = called_modules(model, (1, 3, 64, 48))
    layers = len(model_layers(model, 2))
    y: object = torch.empty(1, 3, 64, 48, device="meta")
    for stage in cut_stages(model, (layers // 2, layers - layers // 2)):
        units = stage_units(stage, None, called=stage_called(stage, called))
        paths = {path for path, _, _ in units if path != "(stage)"}
        assert paths, "a unit below the stage's root"
        ran: set[str] = set()
        for path in paths:
            stage.get_submodule(path).register_forward_pre_hook(functools.partial(_mark, ran, path))
        with torch.no_grad():
            y = stage(*y) if isinstance(y, tuple) else stage(y)
        assert ran == paths, sorted(paths - ran)


def _verify(ranks: int, *args: str) -> dict[str, object]:
    job = mpiexec(
        ranks, "-m", "hyfi_imaging.cli.verify", "--model", "unet2d", "--image-size", "48x40",
        "--width", "2", "--steps", "1", "--json", *args, timeout=300,
    )  # fmt: skip
    report = json_line(job)
    assert job.returncode == 0 and report["ok"], job.describe()
    return report


@pytest.mark.parametrize(
    ("ranks", "args"),
    [
        (2, ("--pipeline", "2")),
        (4, ("--spatial", "1x2", "--pipeline", "2", "--checkpointing", "full")),
        (2, ("--pipeline", "2", "--schedule", "1f1b", "--microbatches", "2")),
    ],
    ids=["pp2", "pp2-sp1x2-checkpointed", "pp2-1f1b-m2"],
)
@pytest.mark.mpi
@pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not installed")
def test_hyfi_verify_unet2d_pipeline(ranks: int, args: tuple[str, ...]) -> None:
    """Errors are rounding: measured 8e-16 (pp2), 6e-14 (with the grid's all-reduces), 3e-16."""
    report = _verify(ranks, *args)
    assert isinstance(report["max_rel_error"], float) and report["max_rel_error"] < 1e-10
    assert isinstance(report["compared"], int) and report["compared"] > 100
    plan = str(report["plan"])
    assert "stage 1: " in plan and ".. head" in plan  # cut inside the U-Net, not one stage


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not installed")
def test_hyfi_verify_traced_resnet_on_two_stages_of_two_ranks() -> None:
    """torchvision's ResNet-18, traced, on 2 stages x a 1x2 grid: each stage's parameters
    sharded by FSDP2 over its two ranks (it failed before: a unit on a mounting level)."""
    pytest.importorskip("torchvision")
    job = mpiexec(
        4, "-m", "hyfi_imaging.cli.verify", "--model", "torchvision.models:resnet18",
        "--image-size", "70x54", "--pipeline", "2", "--spatial", "1x2", "--microbatches", "2",
        "--steps", "1", "--json", timeout=300,
    )  # fmt: skip
    report = json_line(job)
    assert job.returncode == 0 and report["ok"], job.describe()
