"""The printed plan: one rank's view of the whole layout, in words, at start-up.

Why a module of its own: the text reads the facts :func:`~.parallelize.parallelize` built
(:class:`~.rank_model.RankModel`) and the plan, and nothing else; keeping it out of the
engine keeps the engine an orchestrator, and the text can change without touching a step.
"""

from __future__ import annotations

from hyfi_imaging.parallel.launch import ParallelContext
from hyfi_imaging.parallel.mirrored import mirrored
from hyfi_imaging.parallel.parallel_plan import ParallelPlan
from hyfi_imaging.parallel.pipeline import stage_bounds
from hyfi_imaging.parallel.rank_model import RankModel

__all__ = ["describe_plan"]


def describe_plan(part: RankModel, pc: ParallelContext, plan: ParallelPlan) -> str:
    """The plan in words: layout, stages and their layers, which rank holds which tile."""
    layout, info = plan.layout, part.balance_info
    size = "x".join(map(str, part.image_hw))
    place = mirrored(layout, plan.schedule)
    world = layout.world_size if place is None else place.world_size
    lines = [
        f"hyfi parallel plan: {layout.describe()} = {world} ranks "
        f"({pc.backend} on {pc.device.type})",
        f"  schedule {plan.schedule}, {plan.microbatches} micro-batch(es) per step; "
        f"checkpointing {plan.checkpointing}; each replica's batch is split into "
        f"{plan.microbatches} equal micro-batches, BatchNorm per micro-batch",
    ]
    if part.streamed:
        how = (
            "in row bands"
            if part.stem_whole
            else "NOT streamed: the first pipeline stage ends inside it, so its layers run "
            "one by one (give the first stage more layers with --balance)"
        )
        lines.append(f"  streaming: stem {', '.join(part.streamed)} {how}")
    if plan.compile != "none":
        lines.append(f"  compiled with torch.compile ({plan.compile} backend, static shapes)")
    if place is not None:
        widths = "+".join(map(str, place.widths))
        lines.append(
            "  two mirrored replicas on per-stage grids: pipeline position p holds stage p of "
            "replica A (first half of the micro-batches) and stage P-1-p of replica B (second "
            "half), each on its own grid, tile i on the position's rank i; the two copies of "
            f"each stage sum their gradients (ranks per position {widths})"
        )
    elif len(part.local) > 1:
        held = ", ".join(
            f"{'AB'[ls.replica] if part.copies > 1 else ''}{ls.index}"
            for ls in part.plan.of_rank(0).local
        )
        what = (
            "two mirrored replicas: rank r holds stage r of replica A (first half of the "
            "micro-batches) and stage P-1-r of replica B (second half); the two copies of "
            "each stage sum their gradients"
            if part.copies > 1
            else f"{plan.stages} model stages, two per pipeline rank"
        )
        lines.append(f"  {what} (pipeline rank 0 holds {held})")
    if layout.junction:
        tiles = ", ".join(
            f"stage {s} {gy}x{gx} tiles of {h}x{w}"
            for s, ((gy, gx), (h, w)) in enumerate(
                zip(map(layout.grid_of, range(layout.pp)), part.stage_tiles, strict=True)
            )
        )
        lines.append(
            f"  image {size}, a grid per stage: {tiles}; "
            "activations re-partitioned exactly where the grid changes (junction)"
        )
    elif part.ctx is not None:
        lines.append(
            f"  image {size} padded to {'x'.join(map(str, part.padded_hw))}, "
            f"{'x'.join(map(str, layout.sp))} tiles of {'x'.join(map(str, part.tile_hw))}"
        )
    else:
        lines.append(f"  image {size}, one tile (no spatial split)")
    if part.fsdp_units:
        lines.append(
            f"  parameters, gradients and optimizer state sharded by FSDP2 over "
            f"{layout.dp * layout.stage_size(part.stage_index)} ranks (dp x sp) on this stage, "
            f"{len(part.fsdp_units)} units on this stage"
        )
    lines.append(f"  balance {','.join(map(str, info.balance))} ({info.how})")
    for s, (start, stop) in enumerate(stage_bounds(info.balance)):
        names = part.layer_names[start:stop]
        span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        extra = ""
        if info.costs is not None:
            ms = 1e3 * sum(info.costs.seconds[start:stop])
            mib = sum(info.costs.bytes[start:stop]) / 2**20
            extra = f", {ms:.1f} ms, {mib:.1f} MiB per micro-batch of 1"
        n_params = sum(info.params[start:stop]) / 1e6
        cp = [n for n in part.checkpointed if n.split(".")[0] in names]
        ck = f", {len(cp)} block(s) checkpointed" if cp else ""
        lines.append(
            f"  stage {s}: {span} ({stop - start} layers, {n_params:.3g} M params{extra}{ck})"
        )
    nd = len(part.image_hw)  # a volume on a one-tile 2-D layout still has 3 axes
    axes = ("slabs", "rows", "cols")[-nd:]
    lines.append("  rank  dp stage  tile   " + "".join(f"{a:<12s}" for a in axes).rstrip())
    rows = []  # (global rank, its plan for one stage it holds, the stages it shows)
    if place is None:
        for r in range(min(layout.world_size, 64)):
            other = part.plan.of_rank(r)
            rows.append((r, other, "+".join(str(ls.index) for ls in other.local)))
    else:
        for r in range(min(world, 64)):
            dp, _, slots = place.slots(r)
            for slot in slots:
                at = divmod(slot.tile, layout.grid_of(slot.stage)[1])
                other = part.plan.of_rank(layout.rank_of(dp, slot.stage, *at))
                rows.append((r, other, f"{'AB'[slot.replica]}{slot.stage}"))
    for r, other, held in rows:
        spans = "".join(f"{s.start:5d}:{s.stop:<6d}" for s in other.tile_slice)
        tile = ",".join(map(str, other.tile_coords))
        lines.append(f"  {r:4d} {other.coords[0]:3d} {held:>5s}  {tile:<6s} {spans.rstrip()}")
    if world > 64:
        lines.append(f"  ... ({world - 64} more ranks)")
    return "\n".join(lines)
