"""What one rank will do, decided before anything runs: a frozen per-rank plan.

Why a pure function: a rank's tile, its stage grid and the tiles of every other stage, the
model stages it holds, the cut (when it is given), the blocks that recompute, the streamed
stem and its schedule's action order follow from the model, the layout, the options, the
image size and the rank alone. Built here from those inputs -- no process group, no
change to any module (the model is read on a meta copy) -- they are the same numbers in
the engine (:func:`~.parallelize.parallelize` applies them), the printed plan (every rank's
row) and the rank snapshot (``tests/test_rank_facts.py`` builds it for every rank of a
layout and holds it against what the engine built). Only what needs the running job stays
out: a cut measured on the device (``balance`` is None then), FSDP2's units and the
spatial layers' runtime state.

:func:`model_facts` reads the model once (its layers, blocks, stem, alignment);
:func:`rank_plan` is then integer arithmetic, cheap enough to build for every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from hyfi_imaging.geometry.grid import TileGrid
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.parallel_plan import ParallelPlan
from hyfi_imaging.parallel.pipeline import checkpoint_blocks, model_layers, stage_bounds
from hyfi_imaging.parallel.schedules import (
    LocalStage,
    ScheduleAction,
    local_stages,
    schedule_actions,
)

__all__ = ["ModelFacts", "RankPlan", "model_facts", "rank_plan", "rank_plans"]


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


def model_facts(
    meta_model: nn.Module,
    plan: ParallelPlan,
    image: Sequence[int],
    in_chans: int,
    *,
    align: int | None = None,
    sizes: dict[str, tuple[int, ...]] | None = None,
) -> ModelFacts:
    """Read :class:`ModelFacts` from ``meta_model`` (a meta-device copy, left unchanged).

    ``align`` and ``sizes``: the engine's numbers where a spatial context already measured
    them (one trace, not two); else asked of :func:`~.spatial.tile_alignment` (the one
    source) and traced on ``meta_model``, where any stage has a grid of more than one tile
    (1 and none where none has).
    """
    from hyfi_imaging.parallel.geometry import layer_geom
    from hyfi_imaging.parallel.spatial import tile_alignment
    from hyfi_imaging.parallel.spatial.kinds import WINDOWED_LAYERS
    from hyfi_imaging.parallel.spatial.trace import _trace_sizes
    from hyfi_imaging.parallel.streaming import stem_paths

    size = tuple(int(v) for v in image)
    layout = plan.layout
    tiled = any(math.prod(layout.grid_of(s)) > 1 for s in range(layout.pp))
    if align is None:
        align = (
            tile_alignment(meta_model, len(size), in_chans=in_chans, image_size=size)
            if tiled
            else 1
        )
    if sizes is None:
        sizes = _trace_sizes(meta_model, (1, in_chans, *size))[0] if tiled else {}
    halos = {
        path: tuple(g.halo() for g in layer_geom(m, sizes[path]))
        for path, m in meta_model.named_modules()
        if path in sizes and isinstance(m, WINDOWED_LAYERS)
    }
    layers = model_layers(meta_model, plan.stages)
    return ModelFacts(
        image=size,
        in_chans=in_chans,
        align=int(align),
        layer_names=tuple(n for n, _ in layers),
        layer_params=tuple(sum(p.numel() for p in m.parameters()) for _, m in layers),
        checkpointed=tuple(checkpoint_blocks(meta_model, plan.checkpointing)),
        streamed=tuple(stem_paths(meta_model)) if plan.streaming == "stem" else (),
        sizes=dict(sizes),
        halos=halos,
    )


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

    def stem_whole(self, balance: Sequence[int]) -> bool:
        """Whether the first stage of the cut ``balance`` holds the whole streamed stem (a cut
        inside it runs its layers one by one: exact, without the memory saving)."""
        streamed = self.facts.streamed
        return not streamed or stage_bounds(balance)[0][1] >= len(streamed)

    def of_rank(self, rank: int) -> RankPlan:
        """Another rank's plan of the same job."""
        return rank_plan(self.facts, self.parallel, rank)


def _stage_grid(layout: Layout, stage: int, facts: ModelFacts) -> TileGrid:
    grid = layout.grid_of(stage)
    if math.prod(grid) == 1 and len(grid) != len(facts.image):
        grid = (1,) * len(facts.image)  # one tile: the image keeps its own axes
    return TileGrid.padding(facts.image, grid, facts.align)


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
        grids=tuple(_stage_grid(layout, s, facts) for s in range(layout.pp)),
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
