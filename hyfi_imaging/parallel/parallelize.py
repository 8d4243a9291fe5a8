"""Every parallel dimension applied to a single-device model, in one written order.

Model code is single-device; parallelism is applied to it here, as torchtitan's
``parallelize_*`` functions do, by small steps in a fixed order (:func:`parallelize`):

1. **check** -- the plan fits the model and the job, and every rank built bit-identical
   weights (:func:`check_same_weights`), before anything is changed;
2. **checkpointing** -- the chosen blocks recompute in backward (:func:`~.pipeline.set_checkpointing`),
   before any copy is taken, so that copies (the timing copy of step 6) checkpoint alike;
3. **spatial** -- the whole model is spatialized for this rank's tile
   (:func:`~.apply.apply_spatial`), so every layer knows its true size at the image size;
   FSDP2 applies the gradient rule, so the layers' own reduction is off;
4. **streaming** -- a chain's stem runs in row bands (:func:`~.streaming.stream_stem`);
5. **branches** -- each cell with independent branches runs only this rank's branches,
   combined over the branch group (:func:`~.branches.apply_branches`; after spatial, so
   the branches' layers are already this tile's; before the cut, which then takes the
   branched cells); the branch gradients' sum (:class:`~.branches.BranchSync`) is made
   after sharding, on this rank's stage;
6. **balance** -- where the model is cut: given, or measured on a tile-sized micro-batch
   (the maximum over the world, so every rank cuts alike) (:func:`choose_balance`);
7. **stages** -- a chain is cut into this rank's stage modules (:func:`apply_stages`); any
   other model is one stage, itself, or, cut into several, its traced chain form
   (:mod:`.chain_form`);
8. **FSDP2** -- each stage module is sharded over ``dp x sp`` of its stage
   (:func:`apply_sharding`);
9. **runtime** -- the schedule family's runtime (:func:`~.runtimes.runtime_for`; GEMS
   creates its process groups here, after sharding, in the same order on every rank);
10. **running statistics** -- BatchNorm's running statistics merged over the replicas after
    each step (:func:`~.running_stats.apply_running_stats`);
11. **compile** -- the stage module compiled with ``torch.compile`` where the plan asks
    (:func:`apply_compile`), last, so that it captures the module as it runs.

The result is one :class:`~.rank_model.RankModel` of facts (tiles, cut, stages, units) that
the engine, the runtime and the printed plan read, plus the runtime and the statistics merge.

Two mirrored replicas on per-stage grids (``bidirectional`` with a junction) run steps 2-8
once per replica the rank holds a stage of, each on the rank's view of that replica, then
join the two parts (:func:`_parallelize_mirrored`; why views: :mod:`.junction`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.apply import (
    apply_spatial,
    input_channels,
    output_map,
    output_shape,
)
from hyfi_imaging.parallel.balance import LayerCosts, measure_layers, partition
from hyfi_imaging.parallel.branches import (
    BranchSync,
    apply_branches,
    check_branch_tiles,
    check_branches,
)
from hyfi_imaging.parallel.junction import check_junction_model
from hyfi_imaging.parallel.launch import ParallelContext
from hyfi_imaging.parallel.meta import meta_copy
from hyfi_imaging.parallel.mirrored import MirroredPlacement, mirrored
from hyfi_imaging.parallel.parallel_plan import ParallelPlan
from hyfi_imaging.parallel.pipeline import (
    StageModule,
    is_chain,
    model_layers,
    set_checkpointing,
    stage_bounds,
    stage_called,
)
from hyfi_imaging.parallel.rank_model import BalanceInfo, PlannedShapes, RankModel
from hyfi_imaging.parallel.rank_plan import RankPlan, model_facts, rank_plan
from hyfi_imaging.parallel.running_stats import ReplicaRunningStats, apply_running_stats
from hyfi_imaging.parallel.runtimes import MirroredJunctionRuntime, PipelineRuntime, runtime_for
from hyfi_imaging.parallel.schedules import LocalStage
from hyfi_imaging.parallel.sharding import apply_fsdp, called_modules
from hyfi_imaging.parallel.spatial import SpatialContext, tile_shaped
from hyfi_imaging.parallel.streaming import stream_stem

__all__ = [
    "apply_compile",
    "apply_sharding",
    "apply_stages",
    "check_same_weights",
    "choose_balance",
    "parallelize",
]


def parallelize(
    model: nn.Module,
    pc: ParallelContext,
    plan: ParallelPlan,
    *,
    image_hw: Sequence[int],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
) -> tuple[RankModel, PipelineRuntime, ReplicaRunningStats]:
    """This rank's part of ``model`` (spatialized, cut, sharded in place), its runtime and
    its running-statistics merge: the steps of the module doc, in that order."""
    layout = plan.layout
    if pc.layout != layout:
        raise ConfigError(
            "ParallelModel",
            f"the plan's layout {layout.describe()} is not the job's {pc.layout.describe()}",
            "build the ParallelContext and the plan from the same Layout",
        )
    if (mirrored(layout, plan.schedule) is not None) != bool(pc.slots):
        started = "two mirrored replicas" if pc.slots else f"{layout.world_size} ranks"
        raise ConfigError(
            "ParallelModel",
            f"the plan's schedule {plan.schedule} on {layout.describe()} places its ranks "
            f"otherwise than the job, started for {started}",
            "start the job with init_parallel(layout, schedule=plan.schedule)",
        )
    plan.check_model(model)
    check_branches(model, layout.br, checkpointing=plan.checkpointing)
    check_same_weights(model, pc.device)
    image = tuple(int(v) for v in image_hw)
    if pc.slots:
        return _parallelize_mirrored(model, pc, plan, image, loss_fn)
    part = _build_part(model, pc, plan, image, None)
    runtime_cls = runtime_for(plan.schedule, layout)
    runtime = runtime_cls(part, pc, layout, plan.schedule, loss_fn)
    running_stats = apply_running_stats(
        part.stage_module,
        list(zip(part.local, part.submods, strict=True)),
        pc,
        copies=runtime_cls.copies,
        copy_groups=runtime.copy_groups,
    )
    apply_compile(part.stage_module, plan.compile, part.fsdp_units)
    return part, runtime, running_stats


def apply_compile(stage: nn.Module, backend: str, units: Sequence[str] = ()) -> None:
    """Compile ``stage`` in place with ``torch.compile`` (``backend``; ``"none"``: nothing).

    In place (``nn.Module.compile``), so its parameters and state dict keep their names and
    checkpoints move between compiled and eager runs. Shapes are static: an image size is
    fixed per run, and a smaller last batch compiles once more. Sharded by FSDP2 (``units``:
    the unit paths, root ``(stage)`` last), each unit below the root is compiled on its own
    and the root's own layers run eagerly, as torchtitan compiles its blocks: FSDP2's hooks
    stay between the graphs, and each graph sees one input shape (the stage compiled whole
    broke its graph at every unit and recompiled the chain's loop for each unit's shape,
    past dynamo's limit). Offered where measured: one stage without tiles
    (:meth:`~.parallel_plan.ParallelPlan._check_compile` refuses the rest). Measured on an
    H200 (ResNet-50, bf16, 4096², one GPU): 2.61x eager's step (docs/benchmarks.md).
    """
    if backend == "none":
        return
    below = [u for u in units if u != "(stage)"]
    modules = [stage.get_submodule(u) for u in below] or [stage]
    # Every module compiled in place shares ``nn.Module._call_impl``'s code, whose cache
    # dynamo limits to 8 entries (a ResNet-18's 7 units, in training and in evaluation, went
    # past it and ran eagerly after a warning): room for each module's train, eval and
    # last-batch graphs.
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, 8 * len(modules))
    for module in modules:
        module.compile(backend=backend, dynamic=False)


def _build_part(
    model: nn.Module,
    pc: ParallelContext,
    plan: ParallelPlan,
    image: tuple[int, ...],
    cut: BalanceInfo | None,
) -> RankModel:
    """Steps 2-8 for one rank (``cut``: the cut already chosen, else step 6 chooses it)."""
    layout = plan.layout
    in_chans = input_channels(model)
    dtype = next((p.dtype for p in model.parameters()), torch.get_default_dtype())
    set_checkpointing(model, plan.checkpointing)
    meta_model = meta_copy(model)
    if layout.junction:
        h, w = image
        check_junction_model(
            layout,
            output_shape(meta_model, (1, in_chans, h, w)) or (),
            output_shape(meta_model, (1, in_chans, max(1, h // 2), max(1, w // 2))) or (),
        )
    plain = (
        copy.deepcopy(model) if cut is None and plan.balance is None and plan.stages > 1 else None
    )
    ctx = apply_spatial(
        model,
        pc,
        image_size=image,
        in_chans=in_chans,
        overlap=plan.overlap,
        halo_depth=plan.halo_depth,
        reduce_grads=False,  # FSDP2 reduces them (sharding.py: the tile/head rule)
        backward_bands=plan.backward_bands,
    )
    if ctx is not None and plan.stages > 1 and not is_chain(model):
        _check_traced_sites(model, ctx)
    # The plan of this rank: the tiles on the context's alignment (one number, measured once).
    facts = model_facts(
        meta_model,
        plan,
        image,
        in_chans,
        ctx=ctx,
    )
    rank = rank_plan(facts, plan, pc.layout_rank)
    local = rank.local
    streamed = stream_stem(model, ctx) if plan.streaming == "stem" else []
    if layout.br > 1:
        if ctx is not None:  # a layer too small for its tile, judged on every rank
            check_branch_tiles(model, meta_model, ctx, image, in_chans)
        apply_branches(model, layout.br, pc.branch, pc.group("br"))
    tile_model = meta_model
    if ctx is not None and ctx.flatten_paths:
        tile_model = tile_shaped(copy.deepcopy(meta_model), ctx)
        plain = None if plain is None else tile_shaped(plain, ctx)
    out_map = output_map(tile_model, in_chans, image, rank.tile)
    info = cut if cut is not None else choose_balance(rank, plain, dtype, pc.device)
    del plain
    planned = PlannedShapes()
    submods, stage_module = apply_stages(
        model, local, info.balance, dtype=dtype, schedule=plan.schedule, planned=planned
    )
    fsdp_units = apply_sharding(submods, rank, pc, ctx, meta_model, (1, in_chans, *image), streamed)
    return RankModel(
        plan=rank,
        dtype=dtype,
        meta_model=meta_model,
        tile_model=tile_model,
        ctx=ctx,
        out_map=out_map,
        balance_info=info,
        submods=submods,
        stage_module=stage_module,
        fsdp_units=fsdp_units,
        planned=planned,
        branch_sync=BranchSync(stage_module, pc.group("br")) if layout.br > 1 else None,
    )


def _parallelize_mirrored(
    model: nn.Module,
    pc: ParallelContext,
    plan: ParallelPlan,
    image: tuple[int, ...],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
) -> tuple[RankModel, PipelineRuntime, ReplicaRunningStats]:
    """Two mirrored replicas on per-stage grids (:class:`~.mirrored.MirroredPlacement`).

    Each replica this rank holds a stage of is built by steps 2-8 on the rank's view of that
    replica (its own grid, tiles and groups: ``pc.slots``), exactly as a plain junction rank
    of it, from its own copy of ``model`` (each copy is spatialized for its own grid). The cut
    is chosen once, by the first build (every rank's first build measures, so the world's
    maximum is taken once), and given to the second: both copies of a stage are the same
    layers. The rank's part joins the two: its stage modules, under the model's names.
    """
    slots = sorted(pc.slots.items())
    models = [model, *(copy.deepcopy(model) for _ in slots[1:])]
    one = dataclasses.replace(plan, schedule="gpipe")  # each replica alone: a junction pipeline
    built: dict[int, tuple[ParallelContext, RankModel]] = {}
    cut: BalanceInfo | None = None
    for (replica, view), copy_of in zip(slots, models, strict=True):
        slot_part = _build_part(copy_of, view, one, image, cut)
        cut = slot_part.balance_info
        built[replica] = (view, slot_part)
    assert cut is not None
    first = next((p for _, p in built.values() if p.is_first), built[slots[0][0]][1])
    local = tuple(
        LocalStage(index=p.stage_index, replica=replica) for replica, (_, p) in built.items()
    )
    submods = [p.submods[0] for _, p in built.values()]
    in_order = sorted(built.values(), key=lambda held: held[1].stage_index)
    layers = [nl for _, p in in_order for nl in cast(StageModule, p.submods[0]).named_layers()]
    stage_module = (
        submods[0]
        if len(submods) == 1
        else StageModule(layers, index=min(ls.index for ls in local))
    )
    place = MirroredPlacement(plan.layout)
    rank = dataclasses.replace(
        first.plan,
        local=local,
        copies=2,
        actions=tuple(place.orders(plan.microbatches)[pc.rank % place.replica_size]),
        parallel=plan,
    )
    part = RankModel(
        plan=rank,
        dtype=first.dtype,
        meta_model=first.meta_model,
        tile_model=first.tile_model,
        ctx=first.ctx,
        out_map=first.out_map,
        balance_info=cut,
        submods=submods,
        stage_module=stage_module,
        fsdp_units=[u for _, p in built.values() for u in p.fsdp_units],
        planned=first.planned,
    )
    runtime = MirroredJunctionRuntime(part, pc, plan.layout, plan.schedule, loss_fn, built)
    running_stats = apply_running_stats(
        stage_module,
        list(zip(local, submods, strict=True)),
        pc,
        copies=2,
        copy_groups=runtime.copy_groups,
    )
    return part, runtime, running_stats


def _check_traced_sites(model: nn.Module, ctx: SpatialContext) -> None:
    """ConfigError for a function call in the model's own ``forward`` that mixes pixels across
    tiles: its spatial form is entered with a module's frame, and a traced pipeline layer
    calls it outside any (functions inside the model's modules run as in one stage)."""
    top = sorted(s for s in ctx.functional_sites if s.startswith("#"))
    if top:
        raise ConfigError(
            f"{type(model).__name__}'s forward",
            f"calls a function that mixes pixels across tiles itself (site {top[0]}), which "
            "a traced pipeline stage cannot run on tiles",
            "use --pipeline 1 on a grid, or move that call into a module (e.g. "
            "nn.AdaptiveAvgPool2d(1) for F.adaptive_avg_pool2d(x, 1))",
        )


def choose_balance(
    rank: RankPlan,
    plain: nn.Module | None,
    dtype: torch.dtype,
    device: torch.device,
) -> BalanceInfo:
    """The cut: the plan's (or one stage), or measured per layer on this rank's tile
    (``plain``: a copy of the model before spatialization, timed one layer at a time)."""
    params = list(rank.facts.layer_params)
    plan = rank.parallel
    if rank.balance is not None:
        how = "explicit" if plan.balance is not None else "one stage"
        return BalanceInfo(rank.balance, how, None, params)
    assert plain is not None
    n = len(params)
    plain.to(device)
    sample = torch.randn(1, rank.facts.in_chans, *rank.tile, dtype=dtype, device=device)
    costs = measure_layers(model_layers(plain, plan.stages), sample, repeat=3)
    # Max over ranks is exact: every rank then cuts from the same numbers.
    vec = torch.tensor([*costs.seconds, *[float(b) for b in costs.bytes]], dtype=torch.float64).to(
        device
    )
    # The world: every stage, tile and replica must cut the model identically.
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
    vec = vec.cpu()
    costs = LayerCosts(
        costs.names,
        tuple(float(v) for v in vec[:n]),
        tuple(int(v) for v in vec[n:]),
    )
    balance = partition(costs.of(plan.balance_by), plan.stages)
    return BalanceInfo(balance, f"automatic, by {plan.balance_by}", costs, params)


def apply_stages(
    model: nn.Module,
    local: Sequence[LocalStage],
    balance: Sequence[int],
    *,
    dtype: torch.dtype,
    schedule: str,
    planned: PlannedShapes,
) -> tuple[list[nn.Module], nn.Module]:
    """This rank's stage modules (one per local stage) and all its layers as one module.

    A chain is cut into stages of its children; any other model is one stage, the model
    itself, running its own forward under its own parameter names, or, cut into several, its
    traced chain form (:mod:`.chain_form`, the same parameter names). The stage modules are
    fixed here: their dtype, the split-backward schedules' contiguous input gradients, and
    the output shapes they check (looked up in ``planned``, which the runtime fills).
    """
    if len(balance) == 1 and not is_chain(model):
        return [model], model
    layers = model_layers(model, len(balance))
    bounds = stage_bounds(balance)
    submods: list[nn.Module] = []
    for ls in local:
        start, stop = bounds[ls.index]
        submods.append(
            StageModule(
                layers[start:stop],
                index=ls.index,
                dtype=dtype,
                contiguous_grads=schedule in ("zbv", "dualpipev"),
                planned=partial(planned.of, ls.index),
            )
        )
    if len(submods) == 1:
        return submods, submods[0]
    order = sorted(range(len(local)), key=lambda k: local[k].index)
    whole = StageModule(
        [nl for k in order for nl in cast(StageModule, submods[k]).named_layers()],
        index=local[0].index,
    )
    return submods, whole


def apply_sharding(
    submods: Sequence[nn.Module],
    rank: RankPlan,
    pc: ParallelContext,
    ctx: SpatialContext | None,
    meta_model: nn.Module,
    input_shape: tuple[int, ...],
    streamed: Sequence[str],
) -> list[str]:
    """Move each stage module to the device and shard it with FSDP2 over ``dp x sp`` of its
    stage (each stage its own FSDP root), in the units the rank's plan chose (chosen here by
    the same function where the cut was measured); returns the units' paths."""
    units: list[str] = []
    planned = rank.facts.stage_units
    called: set[str] | None = None
    for ls, sub in zip(rank.local, submods, strict=True):
        if ls.index > 0:
            _no_inplace_at_entry(sub)
        sub.to(pc.device)
        if pc.shard_mesh is None or not any(p.requires_grad for p in sub.parameters()):
            continue
        if planned is None and called is None:
            # A streamed stem's layers are not called one by one: their parameters are the
            # root's, gathered when the stage starts.
            called = called_modules(meta_model, input_shape) - set(streamed)
        paths = apply_fsdp(
            sub,
            pc.shard_mesh,
            tile_names=None if ctx is None else ctx.tile_param_names,
            tiles=rank.parallel.layout.stage_size(rank.pp_rank),
            # Keep each unit's parameters gathered from its forward to its backward: a
            # second all-gather per step cost a 1x2 ResNet-50 rank 0.4 s of its 3.4 s on CPU
            # (bench_spatial, CPU-time bound 0.442 -> 0.486), and the parameters are small
            # next to a whole image's activations.
            reshard_after_forward=False,
            called=None if called is None else stage_called(sub, called),
            units=None if planned is None else planned[ls.index],
        )
        # FSDP2 hands a unit its input as a view made by a custom Function, which an
        # in-place op may not modify (torchvision's classifier: Dropout(inplace=True)).
        modules = dict(sub.named_modules())
        for path in paths:
            if path in modules and modules[path] is not sub:
                _no_inplace_at_entry(modules[path])
        units += paths
    return units


def _no_inplace_at_entry(stage: nn.Module) -> None:
    """Turn off ``inplace`` on the op a stage (or an FSDP unit) starts with.

    A received activation is an autograd leaf; an in-place op on it (ResNet's
    top-level ``relu`` when a cut falls right before it) is refused by
    autograd, as on the view FSDP2 hands a unit. Out of place gives the same values.
    """
    for m in stage.modules():
        if m is stage:
            continue
        if getattr(m, "inplace", False):
            m.inplace = False  # type: ignore[assignment]
        if not list(m.children()):
            break


def _fingerprint(t: Tensor) -> Tensor:
    """An exact, order-sensitive integer digest of a tensor's bits (int64, wrapping)."""
    bits = t.detach().contiguous().reshape(-1)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[bits.element_size()]
    ints = bits.view(width).to(torch.int64)
    weights = torch.arange(1, ints.numel() + 1, dtype=torch.int64, device=ints.device) % 1000003
    return torch.stack([ints.sum(), (ints * weights).sum()])


@torch.no_grad()
def check_same_weights(model: nn.Module, device: torch.device) -> None:
    """ConfigError on every rank unless every rank built bit-identical weights and buffers.

    Each rank builds the whole model from the recipe's seed and keeps its
    part; a model whose initialisation depends on the rank (or on an unseeded
    generator) would train different replicas silently. Integer digests of the
    bits are compared over the world (one MIN and one MAX all-reduce): exact on
    any hardware, unlike float checksums.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    named = [
        (n, t)
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if not nn.parameter.is_lazy(t)
    ]
    if not named:
        return
    digest = torch.stack([_fingerprint(t) for _, t in named]).to(device)
    low, high = digest.clone(), digest.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)  # the world: every rank built the whole model
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    differ = (low != high).any(dim=1).nonzero().flatten().tolist()
    if differ:
        raise ConfigError(
            type(model).__name__,
            f"ranks built different initial weights ({len(differ)} tensors differ, first "
            f"{named[differ[0]][0]})",
            "build the model the same way on every rank: seed torch before building it and "
            "do not make its initialisation depend on the rank",
        )
