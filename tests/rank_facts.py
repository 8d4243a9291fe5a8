"""Every rank's derived facts, built in one process: the engine on a fake process group.

Why: the tiles, cuts, stage shapes, local stages, per-layer halos, deep-halo runs, streamed
layers, FSDP2 units and schedule orders that :func:`~hyfi_imaging.parallel.parallelize.parallelize`
derives for each rank are pure functions of the model, the layout, the options, the image
size and the rank. Built here for every rank of a layout in one process, on torch's
``fake`` backend (collectives do nothing, no ``mpiexec``), they are pinned as a snapshot
(``tests/snapshots/rank_facts.json``): a refactor that changes any of them fails
``tests/test_rank_facts.py`` in seconds, where the multi-rank exactness tests would need
minutes. The numbers themselves are checked against one process by those tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyfi_imaging.parallel.geometry import layer_geom
from hyfi_imaging.parallel.launch import ParallelContext, fake_rank
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.parallel_plan import ParallelPlan
from hyfi_imaging.parallel.schedules import schedule_actions
from hyfi_imaging.parallel.spatial.kinds import WINDOWED_LAYERS


@dataclass(frozen=True)
class Case:
    """One layout case: a registered model, its options, the plan and the image size."""

    name: str
    model: str
    image: tuple[int, ...]
    plan: ParallelPlan
    model_kwargs: dict[str, Any] = field(default_factory=dict)


#: ResNet at an eighth of its channels: the facts depend on the layers, not their widths.
SMALL = {"width": 0.125}


def mirrored_facts(case: Case, rank: int) -> tuple[list[list[int]], dict[int, dict[str, Any]]]:
    """Global ``rank`` of two mirrored replicas of ``case``'s per-stage grids (its schedule
    ``bidirectional``), built on the fake backend as :func:`~hyfi_imaging.parallel.launch.init_parallel`
    builds it: the joined part's local stages, and each replica's stage's facts on its view."""
    from functools import partial

    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hyfi_imaging.models.registry import create_model
    from hyfi_imaging.parallel.engine import ParallelModel
    from hyfi_imaging.parallel.mirrored import mirrored, mirrored_context

    plan = case.plan
    placement = mirrored(plan.layout, plan.schedule)
    assert placement is not None, f"{case.name}: not two mirrored replicas"
    world = placement.world_size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        device = torch.device("cpu")
        context = partial(ParallelContext, plan.layout, rank, world, rank, "single", "gloo", device)
        pc = mirrored_context(context, placement, device)
        torch.manual_seed(0)
        model = create_model(case.model, **case.model_kwargs)
        pm = ParallelModel(model, pc, plan, image_hw=case.image)
        slots = pm.runtime.slots  # type: ignore[attr-defined]
        local = [[ls.replica, ls.index] for ls in pm.part.local]
        return local, {
            rep: part_facts(part, view, case.image) for rep, (view, part) in slots.items()
        }
    finally:
        dist.destroy_process_group()


def _halos(module: nn.Module, sizes: dict[str, tuple[int, ...]]) -> dict[str, list[list[int]]]:
    """Every windowed layer's halo (before, after per spatial dim) at its traced input size."""
    out: dict[str, list[list[int]]] = {}
    for path, m in module.named_modules():
        size = sizes.get(path)
        if size is None or not isinstance(m, WINDOWED_LAYERS):
            continue
        out[path] = [list(g.halo()) for g in layer_geom(m, size)]
    return out


def rank_facts(case: Case, rank: int) -> dict[str, Any]:
    """What the engine derived for ``rank`` of ``case`` (JSON-ready)."""
    from hyfi_imaging.models.registry import create_model
    from hyfi_imaging.parallel.engine import ParallelModel

    plan = case.plan
    with fake_rank(plan.layout, rank) as pc:
        torch.manual_seed(0)
        model = create_model(case.model, **case.model_kwargs)
        pm = ParallelModel(model, pc, plan, image_hw=case.image)
        facts = part_facts(pm.part, pc, case.image)
        if plan.layout.pp > 1:
            facts["actions"] = [
                list(a)
                for a in schedule_actions(plan.schedule, plan.layout.pp, plan.microbatches)[
                    pm.part.pp_rank
                ]
            ]
        return facts


def part_facts(part: Any, pc: ParallelContext, image: tuple[int, ...]) -> dict[str, Any]:
    """What :func:`~hyfi_imaging.parallel.parallelize.parallelize` built for one rank (or for
    one replica's stage of it, on that replica's view ``pc``), JSON-ready."""
    ctx = part.ctx
    facts: dict[str, Any] = {
        "coords": list(pc.coords),
        "padded": list(part.padded_hw),
        "tile": list(part.tile_hw),
        "stage_tiles": [list(t) for t in part.stage_tiles],
        "balance": list(part.balance_info.balance),
        "local": [[ls.replica, ls.index] for ls in part.local],
        "num_stages": part.num_stages,
        "copies": part.copies,
        "checkpointed": list(part.checkpointed),
        "streamed": list(part.streamed),
        "stem_whole": part.stem_whole,
        "fsdp_units": list(part.fsdp_units),
        "out_map": None if part.out_map is None else repr(part.out_map),
    }
    if ctx is not None:
        sizes = {k: list(v) for k, v in sorted(ctx.sizes.items())}
        facts |= {
            "grid": list(ctx.grid),
            "tile_index": list(ctx.tile),
            "align": ctx.align,
            "tile_slice": [[s.start, s.stop] for s in ctx.tile_slice(image)],
            "halo_depth": ctx.halo_depth,
            "deep_runs": [list(r) for r in ctx.deep_runs],
            "sizes": sizes,
            "halos": _halos(part.stage_module, dict(ctx.sizes)),
            "rejoined_pools": sorted(ctx.rejoined_pools),
            "flatten_paths": sorted(ctx.flatten_paths),
            "functional_sites": sorted(ctx.functional_sites),
        }
    return facts


def planned_facts(case: Case) -> list[dict[str, Any]]:
    """Every rank's facts as :mod:`hyfi_imaging.parallel.rank_plan` decides them before
    anything runs: no process group (not even a fake one), the model only read on a meta
    copy. The keys are the snapshot's that the rank plan holds."""
    import copy

    from hyfi_imaging.models.registry import create_model
    from hyfi_imaging.parallel.apply import input_channels
    from hyfi_imaging.parallel.rank_plan import model_facts, rank_plans

    assert not dist.is_initialized()
    torch.manual_seed(0)
    model = create_model(case.model, **case.model_kwargs)
    meta = copy.deepcopy(model).to("meta")
    facts = model_facts(meta, case.plan, case.image, input_channels(model))
    out = []
    for rp in rank_plans(facts, case.plan):
        assert rp.balance is not None, f"{case.name}: every case gives its cut"
        got: dict[str, Any] = {
            "coords": list(rp.coords),
            "padded": list(rp.padded),
            "tile": list(rp.tile),
            "stage_tiles": [list(t) for t in rp.stage_tiles],
            "balance": list(rp.balance),
            "local": [[ls.replica, ls.index] for ls in rp.local],
            "num_stages": rp.num_stages,
            "copies": rp.copies,
            "checkpointed": list(rp.facts.checkpointed),
            "streamed": list(rp.facts.streamed),
            "stem_whole": rp.stem_whole(rp.balance),
            "grid": list(rp.tiling.grid),
            "tile_index": list(rp.tile_coords),
            "align": rp.facts.align,
            "tile_slice": [[s.start, s.stop] for s in rp.tile_slice],
            "sizes": {k: list(v) for k, v in sorted(rp.facts.sizes.items())},
            "halos": {k: [list(h) for h in v] for k, v in rp.facts.halos.items()},
        }
        assert rp.units is not None, f"{case.name}: every case gives its cut"
        got["fsdp_units"] = [path for stage in rp.units for path, _ in stage]
        if rp.spatial is not None:
            got |= {
                "halo_depth": case.plan.halo_depth,
                "deep_runs": [list(r) for r in rp.spatial.deep_runs],
                "rejoined_pools": sorted(rp.spatial.rejoined_pools),
                "flatten_paths": sorted(rp.spatial.flatten_paths),
                "functional_sites": sorted(rp.spatial.functional_sites),
            }
        if case.plan.layout.pp > 1:
            got["actions"] = [list(a) for a in rp.actions]
        out.append(got)
    return out


def case_facts(case: Case) -> list[dict[str, Any]]:
    """Every rank's facts of ``case``, in rank order."""
    return [rank_facts(case, r) for r in range(case.plan.layout.world_size)]


#: The layout families the multi-rank tests run, each at a small size.
CASES: Sequence[Case] = (
    Case("resnet-1x2", "resnet18", (64, 48), ParallelPlan(Layout(sp=(1, 2))), SMALL),
    Case("resnet-2x2-odd", "resnet18", (61, 45), ParallelPlan(Layout(sp=(2, 2))), SMALL),
    Case("resnet-dp2-1x2", "resnet18", (64, 64), ParallelPlan(Layout(dp=2, sp=(1, 2))), SMALL),
    Case(
        "resnet-pp2-1x2-1f1b",
        "resnet18",
        (64, 64),
        ParallelPlan(Layout(pp=2, sp=(1, 2)), microbatches=2, schedule="1f1b", balance=(5, 6)),
        SMALL,
    ),
    Case(
        "resnet-pp2-bidirectional",
        "resnet18",
        (64, 64),
        ParallelPlan(Layout(pp=2), microbatches=4, schedule="bidirectional", balance=(5, 6)),
        SMALL,
    ),
    Case(
        "resnet-pp2-zbv",
        "resnet18",
        (64, 64),
        ParallelPlan(Layout(pp=2), microbatches=4, schedule="zbv", balance=(3, 3, 3, 2)),
        SMALL,
    ),
    Case(
        "resnet-junction-2x2-1x1",
        "resnet18",
        (64, 64),
        ParallelPlan(Layout(pp=2, grids=((2, 2), (1, 1))), microbatches=2, balance=(5, 6)),
        SMALL,
    ),
    Case(
        "resnet-2x2-deep-halo",
        "resnet18",
        (96, 96),
        ParallelPlan(Layout(sp=(2, 2)), halo_depth=3),
        SMALL,
    ),
    Case(
        "resnet-2x2-stream-full",
        "resnet18",
        (96, 96),
        ParallelPlan(Layout(sp=(2, 2)), streaming="stem", checkpointing="full"),
        SMALL,
    ),
    Case("unet2d-1x2", "unet2d", (40, 44), ParallelPlan(Layout(sp=(1, 2))), {"width": 2}),
    Case("unet3d-2x1x2", "unet3d", (20, 18, 22), ParallelPlan(Layout(sp=(2, 1, 2))), {"width": 2}),
)
