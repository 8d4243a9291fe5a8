"""What :func:`~.parallelize.parallelize` built for one rank: its stages, tiles, cut and shards.

Why one value: the engine (:class:`~.engine.ParallelModel`), the pipeline runtimes
(:mod:`.runtimes`), the running statistics and the printed plan (:mod:`.describe`) all read
the same facts about this rank's part of the model; none of them derives a tile, a cut or a
stage shape again. The fields are fixed once built; the modules in them are the rank's own
(spatialized, cut and sharded in place), never rebuilt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from hyfi_imaging.parallel.apply import OutputMap
from hyfi_imaging.parallel.balance import LayerCosts
from hyfi_imaging.parallel.branches import BranchSync
from hyfi_imaging.parallel.rank_plan import RankPlan
from hyfi_imaging.parallel.schedules import LocalStage
from hyfi_imaging.parallel.spatial import SpatialContext

__all__ = ["BalanceInfo", "PlannedShapes", "RankModel"]

Shapes = tuple[tuple[int, ...], ...]


@dataclass
class BalanceInfo:
    """The cut (layers per model stage), how it was chosen, and what it was chosen from."""

    balance: tuple[int, ...]
    how: str
    costs: LayerCosts | None = None
    #: Parameters of every top-level layer (for the printed plan).
    params: list[int] = field(default_factory=list)


class PlannedShapes:
    """The output shapes every model stage was planned to produce, per micro-batch size.

    Why a shared record: a stage module checks its outputs against the shapes the
    next stage allocated buffers for (:class:`~.pipeline.StageModule`'s ``planned``),
    and those come from the runtime's meta trace for each micro-batch size. The stage
    modules are built before any runtime, so both hold this one record: the runtime
    writes what it traced (:meth:`record`), the stage reads it (:meth:`of`).
    """

    def __init__(self) -> None:
        self._by_size: dict[int, dict[int, Shapes]] = {}

    def record(self, microbatch: int, stage: int, shapes: Sequence[Sequence[int]]) -> None:
        """Model stage ``stage`` produces tensors of ``shapes`` for ``microbatch`` samples."""
        self._by_size.setdefault(microbatch, {})[stage] = tuple(tuple(s) for s in shapes)

    def of(self, stage: int, microbatch: int) -> Shapes:
        """The output shapes planned for model stage ``stage`` and ``microbatch`` samples."""
        return self._by_size[microbatch][stage]


@dataclass(frozen=True)
class RankModel:
    """One rank's part of the model and the facts it was built from (see the module doc)."""

    #: What this rank does, decided before anything ran (:mod:`.rank_plan`): its tiles,
    #: stages, blocks, stem and actions; the fields below read it.
    plan: RankPlan
    dtype: torch.dtype
    #: The unmodified model on the meta device (stage shapes, units, the junction's cuts).
    meta_model: nn.Module
    #: The plain model as it runs on a tile's shape (stage shapes, layer timing).
    tile_model: nn.Module
    ctx: SpatialContext | None
    #: The output's map when the model is dense (its output is tiled too), else None.
    out_map: OutputMap | None
    balance_info: BalanceInfo
    #: One module per local stage, in :attr:`local`'s order.
    submods: list[nn.Module]
    #: This rank's layers (of all its stages, in model order) under their original names.
    stage_module: nn.Module
    #: The FSDP2 units of this rank's stages.
    fsdp_units: list[str]
    planned: PlannedShapes
    #: The branch group's once-per-step gradient and statistics sum (:mod:`.branches`), or None.
    branch_sync: BranchSync | None = None

    @property
    def image_hw(self) -> tuple[int, ...]:
        """The image's size: ``(h, w)``, or ``(d, h, w)`` for volumes."""
        return self.plan.facts.image

    @property
    def in_chans(self) -> int:
        return self.plan.facts.in_chans

    @property
    def pp_rank(self) -> int:
        return self.plan.pp_rank

    @property
    def local(self) -> tuple[LocalStage, ...]:
        return self.plan.local

    @property
    def num_stages(self) -> int:
        return self.plan.num_stages

    @property
    def copies(self) -> int:
        return self.plan.copies

    @property
    def checkpointed(self) -> list[str]:
        return list(self.plan.facts.checkpointed)

    @property
    def layer_names(self) -> list[str]:
        return list(self.plan.facts.layer_names)

    @property
    def streamed(self) -> list[str]:
        return list(self.plan.facts.streamed)

    @property
    def padded_hw(self) -> tuple[int, ...]:
        return self.plan.padded

    @property
    def tile_hw(self) -> tuple[int, ...]:
        return self.plan.tile

    @property
    def stage_tiles(self) -> list[tuple[int, ...]]:
        return self.plan.stage_tiles

    @property
    def stem_whole(self) -> bool:
        """Whether the first stage holds the whole streamed stem (a cut inside it runs its
        layers one by one: exact, without the memory saving; said in the plan)."""
        return self.plan.stem_whole(self.balance_info.balance)

    @property
    def stage_index(self) -> int:
        """The first model stage this rank holds."""
        return self.local[0].index

    @property
    def is_first(self) -> bool:
        """Whether this rank holds a first stage (it takes the input)."""
        return any(ls.index == 0 for ls in self.local)

    @property
    def is_last(self) -> bool:
        """Whether this rank holds a last stage (it computes the loss)."""
        return any(ls.index == self.num_stages - 1 for ls in self.local)
