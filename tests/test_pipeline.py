"""Pipeline stages, balance, plan validation and the engine on a world of one (no mpiexec).

Transparency tests in torchgpipe's manner: stages chained again are the model
bit for bit; the engine with micro-batches, either schedule and checkpointing
equals one process accumulating the same micro-batches. Every invalid plan is
refused before compute with the fix in the message.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import shlex
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models import create_model
from hyfi_imaging.models.registry import CheckpointedBlock, deep_chain
from hyfi_imaging.parallel.balance import (
    balance_by_size,
    balance_by_time,
    measure_layers,
    partition,
)
from hyfi_imaging.parallel.engine import (
    ParallelModel,
    ParallelPlan,
    running_stats_increment,
    running_stats_merge,
)
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.pipeline import (
    StageModule,
    check_balance,
    cut_stages,
    deep_layers,
    draw_plan,
    even_balance,
    model_layers,
    parse_checkpointing,
    schedule_order,
    set_checkpointing,
    stage_boundaries,
    stage_bounds,
)

MODELS = {
    "resnet18": {"width": 0.25},
    "resnet20-v2": {"width": 0.5},
    "amoebanet-d-3-8": {},
}


def _model(name: str, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return create_model(name, num_classes=3, **MODELS[name]).to(dtype)


# ----------------------------------------------------------------------------- partition


def _brute(costs: list[float], stages: int) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        edges = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(edges)))
    return best


def test_partition_examples() -> None:
    assert partition([1, 1, 1, 1], 2) == (2, 2)
    assert partition([4, 1, 1, 1, 1], 2) == (1, 4)
    assert partition([1, 1, 1, 1, 4], 2) == (4, 1)
    assert partition([5], 1) == (1,)
    assert partition([0, 0, 0], 3) == (1, 1, 1)


@pytest.mark.parametrize("seed", range(20))
def test_partition_is_optimal(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 9, (1,), generator=gen))
    stages = int(torch.randint(1, n + 1, (1,), generator=gen))
    costs = [float(c) for c in torch.rand(n, generator=gen) * 10]
    got = partition(costs, stages)
    assert len(got) == stages and sum(got) == n and min(got) >= 1
    worst = max(sum(costs[a:b]) for a, b in stage_bounds(got))
    assert worst == pytest.approx(_brute(costs, stages))


def test_partition_refuses_more_stages_than_layers() -> None:
    with pytest.raises(ConfigError, match="at most 2 pipeline stages"):
        partition([1.0, 2.0], 3)


# ----------------------------------------------------------------------------- stages


@pytest.mark.parametrize("name", list(MODELS))
def test_chained_stages_are_the_model(name: str) -> None:
    model = _model(name)
    n = len(model_layers(model))
    x = torch.randn(2, 3, 40, 36, dtype=torch.float64)
    for balance in [(n,), even_balance(n, 2), (1, n - 2, 1), (n - 1, 1)]:
        model.eval()  # running statistics would move between the two passes in training
        want = model(x)
        stages = cut_stages(model, balance)
        y = x
        for stage in stages:
            args = y if isinstance(y, tuple) else (y,)
            y = stage(*args)  # a tuple travels as separate arguments, as pipelining sends it
        assert torch.equal(y, want), balance
    # Training mode: the same graph, so the same gradients.
    model.train()
    a = copy.deepcopy(model)
    F.cross_entropy(a(x), torch.tensor([0, 2])).backward()
    y = x.clone()
    for stage in cut_stages(model, even_balance(n, 3)):
        y = stage(*(y if isinstance(y, tuple) else (y,)))
    F.cross_entropy(y, torch.tensor([0, 2])).backward()
    grads = dict(a.named_parameters())
    for pname, p in model.named_parameters():
        if p.grad is not None:
            assert torch.equal(p.grad, grads[pname].grad), pname


def test_stage_keeps_original_names() -> None:
    model = _model("resnet18")
    stages = cut_stages(model, (6, 5))
    keys = [k for s in stages for k in s.state_dict()]
    assert keys == list(model.state_dict())
    assert next(iter(stages[1].state_dict())).startswith("layer3.")


def test_stage_checks_planned_shapes() -> None:
    planned = {1: ((1, 1, 8, 8),)}.__getitem__  # micro-batch size -> the shapes planned
    conv = nn.Conv2d(1, 1, 3)  # "valid": t -> t - 2
    stage = StageModule([("conv", conv)], index=0, planned=planned)
    with pytest.raises(
        RuntimeError, match=r"\(1, 1, 6, 6\),\) but \(\(1, 1, 8, 8\),\) were planned"
    ):
        stage(torch.zeros(1, 1, 8, 8))


def test_stage_boundaries_trace_shapes_and_tuples() -> None:
    resnet = _model("resnet18")
    b = stage_boundaries(resnet, (6, 5), (2, 3, 64, 96))
    assert [tuple(t.shape) for t in b[1]] == [(2, 32, 8, 12)]  # after layer2 (stride 8)
    assert tuple(b[-1][0].shape) == (2, 3)
    assert all(t.device.type == "meta" and t.dtype == torch.float64 for t in b[1])
    amoeba = _model("amoebanet-d-3-8")
    b = stage_boundaries(amoeba, (1, 8), (2, 3, 64, 64))
    assert len(b[1]) == 2  # the stem hands (x, x) to the first cell
    # A tile whose last map is 1x1, one image: BatchNorm in training refuses one value per
    # channel, but its spatial form normalises over the whole image (the trace refused the
    # 2x2 layout one process trains, with a traceback).
    assert resnet.training
    b = stage_boundaries(resnet, (11,), (1, 3, 32, 32))
    assert tuple(b[-1][0].shape) == (1, 3)


@pytest.mark.parametrize(
    ("balance", "pattern"),
    [((5, 5), "sums to 10 .* sum to 11"), ((11,), "gives 1 stages"), ((11, 0), "at least one")],
)
def test_check_balance_names_the_fix(balance: tuple[int, ...], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        check_balance(balance, 11, 2)


def test_checkpointing_modes() -> None:
    assert parse_checkpointing("none") == 0
    assert parse_checkpointing("full") == 1
    assert parse_checkpointing("every:3") == 3
    for bad in ("some", "every:0", "every:x"):
        with pytest.raises(ConfigError, match="every:N"):
            parse_checkpointing(bad)
    model = _model("resnet18")  # 8 blocks: layer1.0 .. layer4.1
    assert set_checkpointing(model, "every:2") == [
        "layer1.1",
        "layer2.1",
        "layer3.1",
        "layer4.1",
    ]
    assert len(set_checkpointing(model, "full")) == 8
    assert set_checkpointing(model, "none") == []
    # deep: every block, and the first two layers of several blocks run as deep chains,
    # their blocks in units; switching modes takes it back
    assert parse_checkpointing("deep") == 1
    assert deep_layers(model, "deep") == ("layer1", "layer2") and deep_layers(model, "full") == ()
    assert len(set_checkpointing(model, "deep")) == 8
    policies = {n: b.checkpoint_policy for n, b in model.named_modules() if n.count(".") == 1}
    assert policies == {f"layer{i}.{j}": "deep" for i in (1, 2) for j in (0, 1)} | {
        f"layer{i}.{j}": "full" for i in (3, 4) for j in (0, 1)
    }
    assert [n for n, m in model.named_children() if deep_chain(m)] == ["layer1", "layer2"]
    assert deep_chain(copy.deepcopy(model).layer1)  # a copy checkpoints alike
    set_checkpointing(model, "full")
    assert not any(deep_chain(m) for m in model.children())
    assert {b.checkpoint_policy for b in model.modules() if hasattr(b, "grad_checkpointing")} == {
        "full"
    }
    with pytest.raises(ConfigError, match=r"deep on UNet: .* not a chain"):
        set_checkpointing(create_model("unet2d", num_classes=2, width=4, depth=2), "deep")
    with pytest.raises(ConfigError, match="no checkpointable blocks"):
        set_checkpointing(nn.Sequential(nn.Conv2d(1, 1, 1)), "full")


def _plain_and_deep(*blocks: nn.Module) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """A chain model whose one layer is ``blocks`` (float64), a copy of it under
    ``checkpointing: deep``, and an input."""
    from hyfi_imaging.models.convchain import ConvChain

    torch.manual_seed(0)
    plain = ConvChain(depth=1, width=3)
    plain.block1 = nn.Sequential(*blocks)
    plain.double()
    deep = copy.deepcopy(plain)
    set_checkpointing(deep, "deep")
    return plain, deep, torch.randn(2, 3, 9, 7, dtype=torch.float64)


class _Conv(CheckpointedBlock):
    """A 3x3 convolution as a block: nothing keeps its output, so code after it may write
    the output in place."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("between", ["inplace", "clamp", "none"])
def test_deep_chain_replays_only_what_the_blocks_passed_on(between: str) -> None:
    """A deep chain computes a block's input again from the layer's input through the
    blocks before it, so it may do so only where the block reads the previous block's
    output as that block returned it: code between blocks keeps the input (a clamp in place
    writes the previous output's storage: the same view, a new version). float64,
    gradients equal to the plain model's."""
    inner = {
        "inplace": [nn.Hardtanh(-0.1, 0.1, inplace=True)],
        "clamp": [nn.Hardtanh(-0.1, 0.1)],
        "none": [],
    }[between]
    plain, deep, x = _plain_and_deep(_Conv(3), *inner, _Conv(3), _Conv(3), *inner, _Conv(3))
    assert deep_layers(plain, "deep") == ("block1",)
    for model in (plain, deep):
        F.cross_entropy(model(x), torch.tensor([0, 1])).backward()
    for (n, p), (_, q) in zip(plain.named_parameters(), deep.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n


class _Nest(CheckpointedBlock):
    """A block holding a checkpointed block: only the outer one is a deep chain's member."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.inner = _Conv(ch)

    def forward_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)  # type: ignore[no-any-return]


def test_a_deep_chain_of_blocks_with_blocks_inside_replays_their_inputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The inner blocks run inside the outer ones and do not break the chain: the second
    and third outer blocks' inputs are replayed (through one block, then two), and the gradients
    equal the plain model's in float64."""
    from hyfi_imaging.models import registry

    replayed: list[int] = []
    tensor = registry._Replay.tensor
    monkeypatch.setattr(
        registry._Replay, "tensor", lambda self: replayed.append(len(self.before)) or tensor(self)
    )
    plain, deep, x = _plain_and_deep(_Nest(3), _Nest(3), _Nest(3))
    for model in (plain, deep):
        F.cross_entropy(model(x), torch.tensor([0, 1])).backward()
    assert sorted(replayed) == [1, 2]
    for (n, p), (_, q) in zip(plain.named_parameters(), deep.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n


class _Noisy(CheckpointedBlock):
    """A 3x3 convolution whose output is scaled by random numbers the block draws."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward_block(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y * torch.rand_like(y)  # type: ignore[no-any-return]


def _hooked_step(
    model: nn.Module, x: torch.Tensor
) -> tuple[list[int], dict[str, torch.Tensor | None]]:
    """One backward of the loss and one of a loss on the blocks' outputs that forward hooks
    kept; pre-hooks that count their calls and seed the random state (block ``i``: 100 + i)."""
    calls: list[int] = []
    kept: dict[int, torch.Tensor] = {}

    def seeded(_m: nn.Module, _a: Any, i: int) -> None:
        calls.append(i)
        torch.manual_seed(100 + i)

    def keep(_m: nn.Module, _a: Any, y: torch.Tensor, i: int) -> None:
        kept[i] = y

    for i, block in enumerate(model.block1):  # type: ignore[arg-type]
        block.register_forward_pre_hook(functools.partial(seeded, i=i))
        block.register_forward_hook(functools.partial(keep, i=i))
    with torch.random.fork_rng():
        F.cross_entropy(model(x), torch.tensor([0, 1])).backward(retain_graph=True)
        sum(y.square().mean() for y in kept.values()).backward()  # type: ignore[union-attr]
    return calls, {n: p.grad for n, p in model.named_parameters()}


def test_a_deep_chain_replays_its_blocks_as_their_checkpoints_recompute_them() -> None:
    """A replay runs each block as its checkpoint recomputes it: the block's own hooks ran in
    its forward and do not run again (a hook keeping block outputs for a loss of its own was
    handed the replay's copies, without a graph: that loss's gradients were lost, silently),
    and each block draws from the random state its own pre-hooks left, as the engine's
    synchronisation of the random state over a grid sets it. float64: gradients of the loss
    and of a loss on the kept outputs equal the plain model's; each hook ran once."""
    plain, deep, x = _plain_and_deep(_Noisy(3), _Noisy(3), _Noisy(3))
    runs = [_hooked_step(model, x) for model in (plain, deep)]
    (calls_plain, plain_grads), (calls_deep, deep_grads) = runs
    assert calls_plain == calls_deep == [0, 1, 2]
    for n, g in plain_grads.items():
        assert torch.equal(g, deep_grads[n]), n


# ----------------------------------------------------------------------------- measuring


def test_measure_layers_changes_nothing() -> None:
    model = _model("resnet18", torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(1, 3, 64, 64)
    rng = torch.get_rng_state()
    costs = measure_layers(model_layers(model), sample, repeat=2)
    assert len(costs.seconds) == len(costs.bytes) == 11
    assert all(s >= 0 for s in costs.seconds) and all(b > 0 for b in costs.bytes)
    assert costs.bytes[4] > costs.bytes[8]  # layer1 at 1/4 resolution holds more than avgpool
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    by_size = balance_by_size(2, model_layers(model), torch.randn(1, 3, 64, 64))
    assert by_size == balance_by_size(2, model_layers(model), torch.randn(1, 3, 64, 64))
    assert sum(balance_by_time(3, model_layers(model), torch.randn(1, 3, 64, 64))) == 11


# ----------------------------------------------------------------------------- plan


def test_plan_validation_names_the_fix() -> None:
    model = _model("resnet18")
    with pytest.raises(ConfigError, match="1F1B needs at least as many micro-batches"):
        ParallelPlan(Layout(pp=4), microbatches=2, schedule="1f1b")
    with pytest.raises(ConfigError, match="multiple of 4"):
        ParallelPlan(Layout(), microbatches=4).validate(model, 6)
    with pytest.raises(ConfigError, match="sum to 11"):
        ParallelPlan(Layout(pp=2), balance=(5, 5)).validate(model, 2)
    with pytest.raises(ConfigError, match="at most 11 pipeline stages"):
        ParallelPlan(Layout(pp=12)).validate(model, 2)
    with pytest.raises(ConfigError, match="gpipe or 1f1b"):
        ParallelPlan(Layout(), schedule="zb")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="positive"):
        ParallelPlan(Layout(), microbatches=0)
    with pytest.raises(ConfigError, match="every:N"):
        ParallelPlan(Layout(), checkpointing="sometimes")
    # torch.compile: one stage without tiles, checkpointing or streaming
    with pytest.raises(ConfigError, match="use none, inductor or aot_eager"):
        ParallelPlan(Layout(), compile="fast")
    for lay in (Layout(sp=(1, 2)), Layout(pp=2)):
        with pytest.raises(ConfigError, match="compiles one stage without tiles"):
            ParallelPlan(lay, microbatches=2, compile="inductor")
    with pytest.raises(ConfigError, match=r"with checkpointing full: .*use checkpointing none"):
        ParallelPlan(Layout(), checkpointing="full", compile="inductor")
    with pytest.raises(ConfigError, match=r"with streaming stem: .*use streaming none"):
        ParallelPlan(Layout(), streaming="stem", compile="inductor")
    ParallelPlan(Layout(dp=2), compile="inductor")  # data replicas: offered
    ParallelPlan(Layout(pp=2), microbatches=2, schedule="1f1b", balance=(6, 5)).validate(model, 4)


def test_verify_refuses_inductor_on_a_model_that_draws_random_numbers() -> None:
    """inductor's kernels draw their own dropout masks, not the eager generator's: hyfi-verify
    reported a MISMATCH (relative error 54) for a correct run; it refuses in one line, before
    anything is compiled, and a model that draws nothing is not refused by this check."""
    import subprocess
    import sys

    from hyfi_imaging.parallel.verify import _draws_random

    cmd = [sys.executable, "-m", "hyfi_imaging.cli.verify", "--model",
           "torchvision.models:mobilenet_v2", "--image-size", "32", "--compile", "inductor"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "hyfi-verify: error: model MobileNetV2: draws random numbers in training (dropout, "
        "drop-path), and inductor's generated kernels draw their own, not the one-process "
        "reference's; check with the model's drop rates set to 0, or with --compile aot_eager."
    ]
    assert not _draws_random(create_model("resnet18", num_classes=2, width=0.25), (2, 3, 32, 32))


def test_cli_builds_the_plan() -> None:
    from hyfi_imaging.cli.verify import _plan, build_parser

    parse = build_parser().parse_args
    args = parse(
        shlex.split(
            "--model resnet18 --image-size 64x64 --pipeline 2 --data 2 --microbatches 4 "
            "--schedule 1f1b --balance 6,5 --checkpointing every:2"
        )
    )
    plan = _plan(args, Layout(dp=2, pp=2))
    assert (plan.balance, plan.schedule, plan.microbatches, plan.checkpointing) == (
        (6, 5),
        "1f1b",
        4,
        "every:2",
    )
    args = parse(shlex.split("--model r --image-size 8x8 --balance memory"))
    assert _plan(args, Layout()).balance_by == "memory"
    args = parse(shlex.split("--model r --image-size 8x8 --balance 5,x"))
    with pytest.raises(ConfigError, match="--balance 5,6"):
        _plan(args, Layout())


# ----------------------------------------------------------------------------- BatchNorm over dp


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_stats_merge_equals_sequential_updates(momentum: float | None) -> None:
    replicas, k, n0 = 3, 4, 5
    gen = torch.Generator().manual_seed(0)
    stats = torch.rand(replicas, k, 6, generator=gen, dtype=torch.float64)
    start = torch.rand(6, generator=gen, dtype=torch.float64)

    def update(r: torch.Tensor, n: int, x: torch.Tensor) -> torch.Tensor:
        factor = 1.0 / (n + 1) if momentum is None else momentum
        return torch.lerp(r, x, factor)

    want, n = start.clone(), n0
    for d in range(replicas):
        for i in range(k):
            want, n = update(want, n, stats[d, i]), n + 1
    total = torch.zeros(6, dtype=torch.float64)
    for d in range(replicas):
        r, n = start.clone(), n0
        for i in range(k):
            r, n = update(r, n, stats[d, i]), n + 1
        total += running_stats_increment(
            r, start, n0=n0, k=k, momentum=momentum, replica=d, replicas=replicas
        )
    got = running_stats_merge(total, start, n0=n0, k=k, momentum=momentum, replicas=replicas)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)


# ----------------------------------------------------------------------------- schedules


@pytest.mark.parametrize(
    ("schedule", "stages", "m"),
    [("gpipe", 2, 1), ("gpipe", 3, 5), ("1f1b", 2, 4), ("1f1b", 3, 5), ("1f1b", 4, 8)],
)
def test_simulated_schedules(schedule: str, stages: int, m: int) -> None:
    from hyfi_imaging.parallel.schedules import schedule_actions, simulate

    times = simulate([[o] for o in schedule_actions(schedule, stages, m)], stages)
    end = max(t1 for _, _, t1 in times.values())
    assert end == pytest.approx(3 * (m + stages - 1))  # the (m + p - 1) / m bubble
    order = schedule_order(schedule, stages, m)
    in_flight = 0
    peak = 0
    for kind, _ in order[0]:
        in_flight += 1 if kind == "F" else -1
        peak = max(peak, in_flight)
    assert peak == (m if schedule == "gpipe" else min(m, stages))  # 1F1B bounds stage-0 memory


def test_draw_plan(tmp_path: object) -> None:
    from pathlib import Path

    out = Path(str(tmp_path)) / "plan.png"
    names = [n for n, _ in model_layers(_model("resnet18"))]
    draw_plan(
        str(out),
        layout=Layout(dp=2, pp=2, sp=(1, 2)),
        balance=(6, 5),
        layer_names=names,
        microbatches=4,
        schedule="1f1b",
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- engine, one rank


@pytest.mark.parametrize(
    ("name", "m", "schedule", "ck", "compiled"),
    [
        ("resnet18", 2, "gpipe", "every:2", "none"),
        ("amoebanet-d-3-8", 4, "1f1b", "full", "none"),
        ("resnet18", 2, "gpipe", "deep", "none"),
        # torch.compile's graph capture with torch's own kernels: exact; inductor's generated
        # kernels (compiled by the C++ compiler here: ~35 s) round differently, ~1e-14
        ("resnet18", 2, "gpipe", "none", "aot_eager"),
        pytest.param("resnet18", 2, "gpipe", "none", "inductor", marks=pytest.mark.slow),
    ],
)
def test_engine_equals_accumulated_microbatches(
    single: object, name: str, m: int, schedule: str, ck: str, compiled: str
) -> None:
    pc = single
    reference = _model(name)
    plan = ParallelPlan(
        Layout(),
        microbatches=m,
        schedule=schedule,  # type: ignore[arg-type]
        checkpointing=ck,
        compile=compiled,
    )
    pm = ParallelModel(copy.deepcopy(reference), pc, plan, image_hw=(40, 36))  # type: ignore[arg-type]
    assert pm.is_first and pm.is_last and pm.stage_index == 0
    assert list(pm.state_dict()) == list(reference.state_dict())
    assert "stage 0" in pm.describe() and schedule in pm.describe()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2 * m, 3, 40, 36, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (2 * m,), generator=gen)
    tiles = pm.tile_of(x).clone().requires_grad_(True)
    counters.clear()
    loss = pm.train_step(tiles, y)
    assert bool(counters["stats"]["unique_graphs"]) == (compiled != "none")  # really compiled
    norm = pm.clip_grad_norm_(0.1)

    xr = x.clone().requires_grad_(True)
    want = 0.0
    for i in range(m):
        rows = slice(2 * i, 2 * i + 2)
        part = F.cross_entropy(reference(xr[rows]), y[rows]) / m
        part.backward()
        want += float(part.detach())
    want_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1))
    assert loss == pytest.approx(want, rel=1e-12)
    assert norm == pytest.approx(want_norm, rel=1e-12)
    torch.testing.assert_close(tiles.grad, xr.grad, rtol=1e-9, atol=1e-12)
    ref = dict(reference.named_parameters())
    for pname, p in pm.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, ref[pname].grad, rtol=1e-9, atol=1e-12)
    ref_state = reference.state_dict()
    for key, value in pm.state_dict().items():  # BatchNorm running statistics included
        torch.testing.assert_close(value, ref_state[key], rtol=1e-9, atol=1e-12)
    # Eval: any batch (3 is not a multiple of m: fewer micro-batches are used).
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm.predict(pm.tile_of(x[:3])), reference(x[:3]))
    assert pm.module.training
    torch.compiler.reset()


def test_engine_refuses_bad_inputs_before_compute(single: object) -> None:
    pm = ParallelModel(
        _model("resnet18"),
        single,  # type: ignore[arg-type]
        ParallelPlan(Layout(), microbatches=2),
        image_hw=(40, 36),
    )
    with pytest.raises(ConfigError, match="multiple of 2"):
        pm.train_step(torch.zeros(3, 3, 40, 36, dtype=torch.float64), torch.zeros(3).long())
    with pytest.raises(ConfigError, match="tile_of"):
        pm.train_step(None, torch.zeros(2).long())
    with pytest.raises(ConfigError, match="planned for"):
        pm.tile_of(torch.zeros(1, 3, 41, 36))
    with pytest.raises(ConfigError, match="not the job's"):
        ParallelModel(_model("resnet18"), single, ParallelPlan(Layout(pp=2)), image_hw=(40, 36))  # type: ignore[arg-type]


def test_engine_flags_a_nonfinite_gradient_and_a_skip_restores_batchnorm(single: object) -> None:
    from hyfi_imaging.train.guard import NonFiniteError, StepGuard

    pm = ParallelModel(_model("resnet18"), single, ParallelPlan(Layout()), image_hw=(40, 36))  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 40, 36, generator=gen, dtype=torch.float64)
    y = torch.tensor([0, 1])
    loss = pm.train_step(pm.tile_of(x), y)
    assert math.isfinite(loss) and pm.grads_finite
    # A finite loss whose gradient is not: flagged from the same read as the loss.
    weight = next(pm.parameters())
    hook = weight.register_hook(lambda g: g * math.inf)
    guard = StepGuard("skip", 1, newest=lambda: None, say=False)
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    guard.before(pm.module)
    loss = pm.train_step(pm.tile_of(x), y)
    assert math.isfinite(loss) and not pm.grads_finite
    assert not guard.accept(7, loss, pm.grads_finite) and guard.skipped == 1
    for key, value in pm.state_dict().items():  # the forward's BatchNorm update undone
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    hook.remove()
    with pytest.raises(NonFiniteError, match=r"step 9: the loss is nan \(2 steps in a row\)"):
        guard.accept(9, math.nan, True)
    stop = StepGuard("stop", 1, newest=lambda: "step_00000004", say=False)
    with pytest.raises(NonFiniteError, match=r"step 3: a gradient is not finite.*step_00000004"):
        stop.accept(3, 1.0, False)
