"""What one rank will do, decided before anything runs: a frozen per-rank plan.

Why a pure function: a rank's tile, its stage grid and the tiles of every other stage, the
model stages it holds, the cut (when it is given), the blocks that recompute, the streamed
stem and its schedule's action order follow from the model, the layout, the options, the
image size and the rank alone. Built here from those inputs -- no process group, no
change to any module (the model is read on meta copies) -- they are the same numbers in
the engine (:func:`~.parallelize.parallelize` applies them), the printed plan (every rank's
row) and the rank snapshot (``tests/test_rank_facts.py`` builds it for every rank of a
layout and holds it against what the engine built). Only a cut measured on the device
stays out (``balance`` and the FSDP2 units are None then: the engine measures the cut and
then chooses the units with the same function, :func:`~.sharding.stage_units`).

:func:`model_facts` reads the model once: its layers, blocks and stem, and on every stage
grid its spatial form (:class:`GridFacts`: which parameters see tiles, the deep-halo runs,
every layer's size and halo), by spatializing a meta copy with no process group (the
layers enter their collectives only when they run), and the FSDP2 units of every model
stage. :func:`rank_plan` is then integer arithmetic, cheap enough to build for every rank.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from hyfi_imaging.geometry.grid import TileGrid
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.parallel_plan import ParallelPlan
from hyfi_imaging.parallel.pipeline import (
    StageModule,
    checkpoint_blocks,
    is_chain,
    model_layers,
    set_checkpointing,
    stage_bounds,
    stage_called,
)
from hyfi_imaging.parallel.schedules import (
    LocalStage,
    ScheduleAction,
    local_stages,
    schedule_actions,
)

__all__ = [
    "GridFacts",
    "ModelFacts",
    "RankPlan",
    "model_facts",
    "rank_plan",
    "rank_plans",
    "stage_grids",
]

#: A grid of tiles per spatial axis.
Grid = tuple[int, ...]


@dataclass(frozen=True)
class GridFacts:
    """The model's spatial form on one grid, the same for every tile of it."""

    grid: Grid
    #: Parameters that see tiles (their gradients are summed over the grid); the rest is the
    #: head after the global pool.
    tile_params: frozenset[str]
    #: Runs of windowed layers that share one deeper halo exchange (``halo_depth`` > 1).
    deep_runs: tuple[tuple[str, ...], ...]
    #: Global pools whose output is used again on the tiles (squeeze-excite).
    rejoined_pools: frozenset[str]
    #: Flattens that gather the whole map for a dense head.
    flatten_paths: frozenset[str]
    #: Functions in a forward that reduce tiles (their sites).
    functional_sites: frozenset[str]

    @classmethod
    def of(cls, ctx: Any) -> GridFacts:
        """The facts of a :class:`~.spatial.SpatialContext` (the engine's, or a meta copy's)."""
        return cls(
            grid=tuple(ctx.grid),
            tile_params=frozenset(ctx.tile_param_names),
            deep_runs=tuple(tuple(r) for r in ctx.deep_runs),
            rejoined_pools=frozenset(ctx.rejoined_pools),
            flatten_paths=frozenset(ctx.flatten_paths),
            functional_sites=frozenset(ctx.functional_sites),
        )


@dataclass(frozen=True)
class ModelFacts:
    """What the plan reads of the model (once, on a meta copy): the same for every rank."""

    #: The image size the facts were read at: ``(h, w)`` or ``(d, h, w)``.
    image: tuple[int, ...]
    in_chans: int
    #: The multiple every tile side is aligned to (the model's total stride; 1 without tiles).
    align: int
    #: The top-level layers a pipeline is cut from (a traced chain form's, for a non-chain).
    layer_names: tuple[str, ...]
    #: Parameters of every top-level layer.
    layer_params: tuple[int, ...]
    #: The blocks that recompute in backward (the plan's ``checkpointing``).
    checkpointed: tuple[str, ...]
    #: The streamed stem's layers (the plan's ``streaming``), empty without streaming.
    streamed: tuple[str, ...]
    #: The whole image's input size at every layer with a spatial form (and every
    #: functional site), where any stage is tiled; empty otherwise.
    sizes: dict[str, tuple[int, ...]]
    #: Every windowed layer's halo, ``(before, after)`` per spatial axis, at its size.
    halos: dict[str, tuple[tuple[int, int], ...]]
    #: The spatial form on every grid of more than one tile that a stage has.
    grids: dict[Grid, GridFacts]
    #: Per model stage, its FSDP2 units ``(path, kind)``, innermost first, the root last, as
    #: :func:`~.sharding.apply_fsdp` shards them; None where the cut is measured.
    stage_units: tuple[tuple[tuple[str, str], ...], ...] | None


def model_facts(
    meta_model: nn.Module,
    plan: ParallelPlan,
    image: Sequence[int],
    in_chans: int,
    *,
    ctx: Any = None,
) -> ModelFacts:
    """Read :class:`ModelFacts` from ``meta_model`` (a meta-device copy, left unchanged).

    ``ctx``: the engine's :class:`~.spatial.SpatialContext` where it already spatialized the
    model (its alignment, sizes and spatial form are reused: one trace, not two); the other
    grids are read by spatializing meta copies. Without any: the alignment is asked of
    :func:`~.spatial.tile_alignment` (the one source) where any stage is tiled, else 1.
    """
    from hyfi_imaging.parallel.geometry import layer_geom
    from hyfi_imaging.parallel.spatial import tile_alignment
    from hyfi_imaging.parallel.spatial.kinds import WINDOWED_LAYERS
    from hyfi_imaging.parallel.spatial.trace import _trace_sizes
    from hyfi_imaging.parallel.streaming import stem_paths

    size = tuple(int(v) for v in image)
    layout = plan.layout
    tiled = {g for g in map(layout.grid_of, range(layout.pp)) if math.prod(g) > 1}
    align = ctx.align if ctx is not None else None
    if align is None:
        align = (
            tile_alignment(meta_model, len(size), in_chans=in_chans, image_size=size)
            if tiled
            else 1
        )
    sizes = dict(ctx.sizes) if ctx is not None else None
    if sizes is None:
        sizes = _trace_sizes(meta_model, (1, in_chans, *size))[0] if tiled else {}
    grids = {
        g: GridFacts.of(ctx)
        if ctx is not None and tuple(ctx.grid) == g
        else _grid_facts(meta_model, plan, g, size, in_chans, align)
        for g in sorted(tiled)
    }
    halos = {
        path: tuple(g.halo() for g in layer_geom(m, sizes[path]))
        for path, m in meta_model.named_modules()
        if path in sizes and isinstance(m, WINDOWED_LAYERS)
    }
    layers = model_layers(meta_model, plan.stages)
    streamed = tuple(stem_paths(meta_model)) if plan.streaming == "stem" else ()
    return ModelFacts(
        image=size,
        in_chans=in_chans,
        align=int(align),
        layer_names=tuple(n for n, _ in layers),
        layer_params=tuple(sum(p.numel() for p in m.parameters()) for _, m in layers),
        checkpointed=tuple(checkpoint_blocks(meta_model, plan.checkpointing)),
        streamed=streamed,
        sizes=dict(sizes),
        halos=halos,
        grids=grids,
        stage_units=_stage_units(meta_model, plan, size, in_chans, grids, streamed),
    )


def _grid_facts(
    meta_model: nn.Module, plan: ParallelPlan, grid: Grid, image: Grid, in_chans: int, align: int
) -> GridFacts:
    """The spatial form on ``grid``, read by spatializing a meta copy for its first tile
    with no process group and no neighbours (nothing runs on it; the facts are the same for
    every tile)."""
    from hyfi_imaging.parallel.halo import Neighbours
    from hyfi_imaging.parallel.spatial import spatialize

    ctx = spatialize(
        copy.deepcopy(meta_model),
        grid=grid,
        tile=(0,) * len(grid),
        neighbours=Neighbours(),
        group=None,
        in_chans=in_chans,
        align=align,
        overlap=plan.overlap,
        halo_depth=plan.halo_depth,
        stage_cuts=plan.layout.pp > 1,
        backward_bands=plan.backward_bands,
        image_size=image,
    )
    return GridFacts.of(ctx)


def _stage_units(
    meta_model: nn.Module,
    plan: ParallelPlan,
    image: Grid,
    in_chans: int,
    grids: dict[Grid, GridFacts],
    streamed: Sequence[str],
) -> tuple[tuple[tuple[str, str], ...], ...] | None:
    """Every model stage's FSDP2 units, chosen by :func:`~.sharding.stage_units` (the
    function :func:`~.sharding.apply_fsdp` shards by) on a meta copy cut like the engine's
    stages; None where the cut is measured, or where branch groups change the cells."""
    from hyfi_imaging.parallel.sharding import called_modules, stage_units

    balance = plan.balance
    if balance is None and plan.stages == 1:
        balance = (len(model_layers(meta_model, 1)),)
    if balance is None or plan.layout.br > 1:
        return None
    layout = plan.layout
    if all(layout.dp * layout.stage_size(s) == 1 for s in range(layout.pp)):
        return tuple(() for _ in balance)  # no stage is shared: nothing to shard
    work = copy.deepcopy(meta_model)
    set_checkpointing(work, plan.checkpointing)  # whole checkpointed blocks are one unit
    called = called_modules(work, (1, in_chans, *image)) - set(streamed)
    layers = model_layers(work, plan.stages)
    out: list[tuple[tuple[str, str], ...]] = []
    for s, (start, stop) in enumerate(stage_bounds(balance)):
        grid = plan.layout.grid_of(s % plan.layout.pp if plan.layout.junction else 0)
        spatial = grids.get(tuple(grid))
        stage = (
            work
            if plan.stages == 1 and not is_chain(work)
            else StageModule(layers[start:stop], index=s)
        )
        if not any(p.requires_grad for p in stage.parameters()):
            out.append(())  # nothing to shard (apply_sharding skips the stage)
            continue
        units = stage_units(
            stage,
            None if spatial is None else set(spatial.tile_params),
            called=stage_called(stage, called),
        )
        out.append(tuple((path, kind) for path, _, kind in units))
    return tuple(out)


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a layout, decided before anything runs (see the module doc)."""

    rank: int
    #: ``(dp, pp, *tile)``: replica, pipeline position, tile in the stage's grid.
    coords: tuple[int, ...]
    #: The branch coordinate (0 without branch groups).
    branch: int
    #: The image on every stage's grid (one grid for all stages without per-stage grids).
    grids: tuple[TileGrid, ...]
    #: The model stages this rank holds (two for bidirectional and torch's V schedules).
    local: tuple[LocalStage, ...]
    #: How many stages the model is cut into.
    num_stages: int
    #: Copies of every stage across the pipeline (2: bidirectional replicas A and B).
    copies: int
    #: Layers per model stage: the plan's, or one stage; None where the cut is measured.
    balance: tuple[int, ...] | None
    #: This rank's compute actions in the order training runs them (empty for one stage).
    actions: tuple[ScheduleAction, ...]
    facts: ModelFacts
    parallel: ParallelPlan

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline position."""
        return self.coords[1]

    @property
    def tile_index(self) -> tuple[int, ...]:
        """This rank's tile in its stage's grid."""
        return self.coords[2:]

    @property
    def tiling(self) -> TileGrid:
        """The image on this rank's stage grid."""
        return self.grids[self.pp_rank]

    @property
    def padded(self) -> tuple[int, ...]:
        return self.tiling.padded

    @property
    def tile(self) -> tuple[int, ...]:
        return self.tiling.tile

    @property
    def tile_coords(self) -> tuple[int, ...]:
        """This rank's tile, one coordinate per image axis (a volume on a one-tile 2-D
        layout: the grid takes the image's axes, all of one tile)."""
        tiling = self.tiling
        index = self.tile_index
        return index if len(index) == tiling.ndim else (0,) * tiling.ndim

    @property
    def tile_slice(self) -> tuple[slice, ...]:
        """The padded image's indices this rank's tile owns."""
        return self.tiling.slices(self.tile_coords)

    @property
    def stage_tiles(self) -> list[tuple[int, ...]]:
        """The input tile of every stage's grid."""
        return [g.tile for g in self.grids]

    @property
    def spatial(self) -> GridFacts | None:
        """The model's spatial form on this rank's grid; None on a grid of one tile."""
        return self.facts.grids.get(self.tiling.grid)

    @property
    def units(self) -> tuple[tuple[tuple[str, float], ...], ...] | None:
        """Per local stage, its FSDP2 units and their gradient divide factors (none where
        this rank shares its stage with no other rank); None where the cut is measured."""
        from hyfi_imaging.parallel.sharding import divide_factor

        if self.facts.stage_units is None:
            return None
        layout = self.parallel.layout
        tiles = layout.stage_size(self.pp_rank)
        if layout.dp * tiles == 1:
            return tuple(() for _ in self.local)
        return tuple(
            tuple(
                (path, divide_factor(kind, tiles))
                for path, kind in self.facts.stage_units[ls.index]
            )
            for ls in self.local
        )

    def stem_whole(self, balance: Sequence[int]) -> bool:
        """Whether the first stage of the cut ``balance`` holds the whole streamed stem (a cut
        inside it runs its layers one by one: exact, without the memory saving)."""
        streamed = self.facts.streamed
        return not streamed or stage_bounds(balance)[0][1] >= len(streamed)

    def of_rank(self, rank: int) -> RankPlan:
        """Another rank's plan of the same job."""
        return rank_plan(self.facts, self.parallel, rank)


def stage_grids(layout: Layout, image: Sequence[int], align: int) -> tuple[TileGrid, ...]:
    """The image on every stage's grid, padded for each grid by the one rule (a grid of one
    tile is the image itself, with the image's own axes).

    OK: ``stage_grids(Layout(pp=3, grids=((2, 2), (1, 2), (1, 1))), (71, 101), 32)``: tiles
    ``(64, 64)``, ``(96, 64)``, ``(71, 101)``.
    """
    out = []
    for stage in range(layout.pp):
        grid = layout.grid_of(stage)
        if math.prod(grid) == 1 and len(grid) != len(image):
            grid = (1,) * len(image)
        out.append(TileGrid.padding(image, grid, align))
    return tuple(out)


def rank_plan(facts: ModelFacts, plan: ParallelPlan, rank: int) -> RankPlan:
    """``rank``'s :class:`RankPlan` of ``plan`` for a model of ``facts`` (pure arithmetic)."""
    layout = plan.layout
    coords = layout.coords(rank)
    pp_rank = coords[1]
    local = local_stages(plan.schedule, layout.pp, pp_rank)
    balance = plan.balance
    if balance is None and plan.stages == 1:
        balance = (len(facts.layer_names),)
    return RankPlan(
        rank=rank,
        coords=coords,
        branch=layout.branch(rank),
        grids=stage_grids(layout, facts.image, facts.align),
        local=local,
        num_stages=plan.stages,
        copies=1 + max(ls.replica for ls in local),  # replica B's stages: a second copy
        balance=None if balance is None else tuple(balance),
        actions=(
            tuple(schedule_actions(plan.schedule, layout.pp, plan.microbatches)[pp_rank])
            if layout.pp > 1
            else ()
        ),
        facts=facts,
        parallel=plan,
    )


def rank_plans(facts: ModelFacts, plan: ParallelPlan) -> list[RankPlan]:
    """Every rank's plan, in rank order."""
    return [rank_plan(facts, plan, r) for r in range(plan.layout.world_size)]
