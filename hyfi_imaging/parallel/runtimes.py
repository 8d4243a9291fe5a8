"""Pipeline runtimes: one class per schedule family, behind one interface.

Why classes and one interface: the engine runs every layout the same way -- it asks its
runtime for the :class:`Pipe` of a micro-batch size (built once, cached) and steps it --
and whatever differs between schedule families lives in that family's class, chosen once by
:func:`runtime_for`:

* :class:`OnePipelineRuntime` -- ``gpipe``, ``1f1b``: one stage per rank, torch's
  ``ScheduleGPipe`` / ``Schedule1F1B`` (:mod:`torch.distributed.pipelining`);
* :class:`TorchMultiRuntime` -- ``interleaved1f1b``, ``zbv``, ``dualpipev``: two stages per
  rank on torch's ``PipelineScheduleMulti``; evaluation runs a forward-only order
  (:func:`~.schedules.forward_only`);
* :class:`BidirectionalRuntime` -- ``bidirectional``: two mirrored replicas (GEMS) on our
  :class:`~.schedules.BidirectionalSchedule`; evaluation runs replica A alone;
* :class:`JunctionRuntime` -- per-stage grids: :class:`~.junction.JunctionSchedule`, which
  re-partitions activations between grids.

The torch families run in *static* mode: stage input and output shapes come from a
meta-device trace of the unmodified model on a tile-sized micro-batch (see :mod:`.pipeline`
for why the runtime's own shape inference must not run spatial layers). Shapes depend on the
micro-batch size, so pipes are built per ``(micro-batch size, micro-batches, train)``; each
build records the traced output shapes in the rank's :class:`~.rank_model.PlannedShapes`,
which the stage modules check their outputs against.

Loss scaling lives here too (:meth:`PipelineRuntime.loss`): each micro-batch's loss is
``loss_fn / (dp x micro-batches)`` -- the reference's term, exactly -- with
``scale_grads=False``, so the accumulated gradient is that of the mean loss over the
*global* batch whatever ``dp`` and the micro-batch count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from hyfi_imaging.errors import HyfiError
from hyfi_imaging.parallel.apply import TiledLoss, reduce_loss
from hyfi_imaging.parallel.junction import JunctionSchedule
from hyfi_imaging.parallel.launch import ParallelContext, error_chain
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.mirrored import MirroredJunctionSchedule, MirroredPlacement, MirrorSlot
from hyfi_imaging.parallel.pipeline import stage_boundaries
from hyfi_imaging.parallel.rank_model import RankModel
from hyfi_imaging.parallel.schedules import (
    TORCH_MULTI,
    BidirectionalSchedule,
    LocalStage,
    MirrorGroups,
    eval_last_rank,
    forward_only,
    mirror_groups,
)

__all__ = [
    "BidirectionalRuntime",
    "JunctionRuntime",
    "MirroredJunctionRuntime",
    "OnePipelineRuntime",
    "Pipe",
    "PipelineRuntime",
    "TorchMultiRuntime",
    "own_errors",
    "runtime_for",
]

Loss = Callable[[Tensor, Tensor], Tensor]
AnySchedule = (
    ScheduleGPipe
    | Schedule1F1B
    | PipelineScheduleMulti
    | BidirectionalSchedule
    | JunctionSchedule
    | MirroredJunctionSchedule
)


@contextmanager
def own_errors() -> Iterator[None]:
    """A HyfiError raised inside a pipeline stage comes out as itself (one line), not
    wrapped in ``torch.distributed.pipelining``'s RuntimeError with a traceback."""
    try:
        yield
    except RuntimeError as err:
        cause = next((e for e in error_chain(err) if isinstance(e, HyfiError)), None)
        if cause is None:
            raise
        raise cause from None


@dataclass
class Pipe:
    """One micro-batch size's stages and schedule (``stages`` empty: a junction's own)."""

    stages: list[PipelineStage]
    schedule: AnySchedule
    #: The whole model's output shape for one micro-batch (what ``predict`` broadcasts).
    logits_shape: tuple[int, ...]

    def step(self, *args: Tensor, **kwargs: Any) -> Any:
        """One step of the schedule; a HyfiError in a stage comes out as itself."""
        with own_errors():
            return self.schedule.step(*args, **kwargs)


class PipelineRuntime:
    """The interface: :meth:`pipe` per micro-batch size, and where evaluation's logits are.

    ``loss_fn`` is the user's loss; ``part`` what :func:`~.parallelize.parallelize` built.
    """

    #: Copies of every stage per data replica (their gradients and statistics are summed).
    copies: ClassVar[int] = 1

    def __init__(
        self, part: RankModel, pc: ParallelContext, layout: Layout, schedule: str, loss_fn: Loss
    ) -> None:
        self.part, self.pc, self.layout, self.schedule = part, pc, layout, schedule
        self.loss_fn = loss_fn
        #: Built pipes by (micro-batch size, micro-batches, train).
        self.pipes: dict[tuple[int, int, bool], Pipe] = {}

    @property
    def copy_groups(self) -> list[ProcessGroup]:
        """The groups over which the copies of a stage sum (none with one copy)."""
        return []

    def pipe(self, microbatch: int, microbatches: int, *, train: bool) -> Pipe:
        """The stages and schedule for ``microbatches`` micro-batches of ``microbatch`` samples."""
        key = (microbatch, microbatches, train)
        if key not in self.pipes:
            loss = self.loss(microbatches) if train else None
            self.pipes[key] = self.build(microbatch, microbatches, loss)
        return self.pipes[key]

    def build(self, microbatch: int, microbatches: int, loss: Loss | None) -> Pipe:
        """A new pipe (``loss`` None: evaluation, forward only)."""
        raise NotImplementedError

    def loss(self, microbatches: int) -> Loss:
        """A micro-batch's loss term: ``loss_fn`` reduced over the image, ``/ (dp x m)``."""
        fn, terms = self.loss_fn, microbatches * self.layout.dp
        ctx, out_map = self.part.ctx, self.part.out_map

        def loss(out: Tensor, target: Tensor) -> Tensor:
            if isinstance(fn, TiledLoss):  # reduces across tiles itself (Dice)
                return fn(out, target, ctx, out_map) / terms
            return reduce_loss(fn(out, target), ctx, out_map) / terms

        return loss

    # -- evaluation: the batch size goes from the first stage to all, logits back from the last

    def eval_group(self) -> ProcessGroup:
        """The group ``predict`` broadcasts over (a tile's ranks along the pipeline)."""
        return self.pc.group("pp")

    def eval_source(self) -> int:
        """The rank in :meth:`eval_group` holding the logits ``predict`` returns."""
        return eval_last_rank(self.schedule, self.layout.pp)

    def eval_batch(self, tiles: Tensor | None) -> int:
        """The evaluated batch's size on every rank (the first stage knows it)."""
        n = torch.tensor([0 if tiles is None else int(tiles.shape[0])], device=self.pc.device)
        if self.layout.pp > 1:
            dist.broadcast(n, group=self.eval_group(), group_src=0)
        return int(n.item())

    def eval_logits(self, out: Any, batch: int, pipe: Pipe) -> Tensor:
        """The evaluated batch's logits on every rank, from the last stage's ``out``."""
        if self.part.pp_rank == eval_last_rank(self.schedule, self.layout.pp):
            assert isinstance(out, Tensor)
            logits = out.contiguous()
        else:
            shape = (batch, *pipe.logits_shape[1:])
            logits = torch.empty(shape, dtype=self.part.dtype, device=self.pc.device)
        if self.layout.pp > 1:
            dist.broadcast(logits, group=self.eval_group(), group_src=self.eval_source())
        return logits


class _TorchStages(PipelineRuntime):
    """Families on torch's ``PipelineStage``: the meta trace and the stages, shared."""

    def held(self, train: bool) -> list[tuple[LocalStage, nn.Module]]:
        """The (stage, module) pairs a pipe runs, in the runtime's order."""
        return list(zip(self.part.local, self.part.submods, strict=True))

    def stage_group(self, ls: LocalStage) -> ProcessGroup:
        """The pipeline group a local stage talks over."""
        return self.pc.group("pp")

    def place(self, stage: PipelineStage, ls: LocalStage) -> None:
        """Adjust a stage's rank map (replica B runs right to left); nothing by default."""

    def stages(self, microbatch: int, train: bool) -> tuple[list[PipelineStage], tuple[int, ...]]:
        """This rank's ``PipelineStage`` objects and the model's output shape, for one size."""
        r = self.part
        bounds = stage_boundaries(
            r.tile_model,
            r.balance_info.balance,
            (microbatch, r.in_chans, *r.tile_hw),
            dtype=r.dtype,
        )
        for s in range(len(bounds) - 1):
            r.planned.record(microbatch, s, [tuple(t.shape) for t in bounds[s + 1]])
        stages = []
        for ls, sub in self.held(train):
            s = ls.index
            stage = PipelineStage(
                sub,
                s,
                r.num_stages,
                self.pc.device,
                input_args=tuple(t.requires_grad_(s > 0) for t in bounds[s]),
                output_args=tuple(t.requires_grad_(True) for t in bounds[s + 1]),
                group=self.stage_group(ls),
            )
            self.place(stage, ls)
            stages.append(stage)
        return stages, tuple(bounds[-1][0].shape)


class OnePipelineRuntime(_TorchStages):
    """``gpipe`` and ``1f1b``: one stage per rank on torch's single-stage schedules."""

    def build(self, microbatch: int, microbatches: int, loss: Loss | None) -> Pipe:
        stages, logits = self.stages(microbatch, loss is not None)
        cls = Schedule1F1B if self.schedule == "1f1b" and loss is not None else ScheduleGPipe
        schedule = cls(stages[0], microbatches, loss_fn=loss, scale_grads=False)
        return Pipe(stages, schedule, logits)


class TorchMultiRuntime(_TorchStages):
    """``interleaved1f1b``, ``zbv``, ``dualpipev``: two stages per rank on torch's runtime."""

    def build(self, microbatch: int, microbatches: int, loss: Loss | None) -> Pipe:
        stages, logits = self.stages(microbatch, loss is not None)
        schedule: PipelineScheduleMulti
        if loss is None:
            schedule = forward_only(stages, microbatches, self.schedule, self.layout.pp)
        else:
            cls = get_schedule_class(TORCH_MULTI[self.schedule])
            schedule = cls(stages, microbatches, loss_fn=loss, scale_grads=False)
        return Pipe(stages, schedule, logits)


class BidirectionalRuntime(_TorchStages):
    """Two mirrored replicas (GEMS): A left to right, B right to left over a second group."""

    copies: ClassVar[int] = 2

    def __init__(
        self, part: RankModel, pc: ParallelContext, layout: Layout, schedule: str, loss_fn: Loss
    ) -> None:
        super().__init__(part, pc, layout, schedule, loss_fn)
        #: B's pipeline group and the mirror pairs (``new_group`` is collective: every rank
        #: creates them, here, in the same order).
        self.mirror: MirrorGroups = mirror_groups(pc.mesh.mesh, pc.rank)

    @property
    def copy_groups(self) -> list[ProcessGroup]:
        return [self.mirror.mirror]

    def held(self, train: bool) -> list[tuple[LocalStage, nn.Module]]:
        # Evaluation of two mirrored replicas runs replica A alone (one pipeline, GPipe).
        return super().held(train)[: 2 if train else 1]

    def stage_group(self, ls: LocalStage) -> ProcessGroup:
        return self.mirror.pipeline_b if ls.replica == 1 else self.pc.group("pp")

    def place(self, stage: PipelineStage, ls: LocalStage) -> None:
        if ls.replica == 1:  # replica B runs right to left: its stage j is on rank P-1-j
            p = self.layout.pp
            stage.stage_index_to_group_rank = {j: p - 1 - j for j in range(p)}

    def build(self, microbatch: int, microbatches: int, loss: Loss | None) -> Pipe:
        stages, logits = self.stages(microbatch, loss is not None)
        if loss is None:
            schedule = ScheduleGPipe(stages[0], microbatches, loss_fn=None, scale_grads=False)
            return Pipe(stages, schedule, logits)
        bidirectional = BidirectionalSchedule(
            (stages[0], stages[1]),
            microbatches,
            loss,
            mirror=self.mirror.mirror,
            pipeline_rank=self.part.pp_rank,
            pipeline_size=self.layout.pp,
        )
        return Pipe(stages, bidirectional, logits)


def _junction_schedule(
    r: RankModel,
    pc: ParallelContext,
    schedule: str,
    microbatch: int,
    microbatches: int,
    loss: Loss | None,
) -> JunctionSchedule:
    """The junction schedule of one rank's stage ``r`` of one replica (``pc``: that replica's
    view of the job), its planned output shapes recorded."""
    layout = r.plan.parallel.layout
    out = JunctionSchedule(
        r.submods[0],
        layout=layout,
        coords=pc.coords,
        image_hw=r.image_hw,
        tiles=r.stage_tiles,
        meta_model=r.meta_model,
        balance=r.balance_info.balance,
        microbatch=microbatch,
        in_chans=r.in_chans,
        microbatches=microbatches,
        schedule=schedule,
        loss_fn=loss,
        group=pc.group("replica"),
        device=pc.device,
        dtype=r.dtype,
        peer_of=pc.global_rank,
    )
    r.planned.record(microbatch, r.stage_index, out.out_shapes)  # on its own grid
    return out


def _junction_logits(r: RankModel, microbatch: int) -> tuple[int, ...]:
    """The model's output shape for one micro-batch (on the last stage's grid)."""
    shape = (microbatch, r.in_chans, *r.stage_tiles[-1])
    return tuple(stage_boundaries(r.meta_model, r.balance_info.balance, shape)[-1][0].shape)


class JunctionRuntime(PipelineRuntime):
    """Per-stage grids: this stage's part of the schedule, the junction's pieces in between."""

    def build(self, microbatch: int, microbatches: int, loss: Loss | None) -> Pipe:
        r = self.part
        schedule = _junction_schedule(r, self.pc, self.schedule, microbatch, microbatches, loss)
        return Pipe([], schedule, _junction_logits(r, microbatch))

    def eval_group(self) -> ProcessGroup:
        # The whole replica: its last stage's tile 0 sends to every rank of every grid.
        return self.pc.group("replica")

    def eval_source(self) -> int:
        return self.layout.replica_size - self.layout.stage_size(self.layout.pp - 1)


class MirroredJunctionRuntime(PipelineRuntime):
    """Two mirrored replicas on per-stage grids (GEMS + the junction): the stage of each
    replica this rank holds runs as a :class:`~.junction.JunctionSchedule` over that replica's
    view of the job (``slots``: replica -> (view, its part)), the two interleaved in the
    position's GEMS order; evaluation runs replica A alone."""

    copies: ClassVar[int] = 2

    def __init__(
        self,
        part: RankModel,
        pc: ParallelContext,
        layout: Layout,
        schedule: str,
        loss_fn: Loss,
        slots: dict[int, tuple[ParallelContext, RankModel]],
    ) -> None:
        super().__init__(part, pc, layout, schedule, loss_fn)
        self.slots = slots
        self.placement = MirroredPlacement(layout)

    @property
    def copy_groups(self) -> list[ProcessGroup]:
        return [self.pc.group("mirror")]

    def build(self, microbatch: int, microbatches: int, loss: Loss | None) -> Pipe:
        r = next(iter(self.slots.values()))[1]
        logits = _junction_logits(r, microbatch)
        if loss is None:  # replica A alone, every micro-batch, forward only
            schedules = {
                rep: _junction_schedule(part, view, "gpipe", microbatch, microbatches, None)
                for rep, (view, part) in self.slots.items()
                if rep == 0
            }
            actions = []
        else:
            schedules = {
                rep: _junction_schedule(part, view, "gpipe", microbatch, microbatches // 2, loss)
                for rep, (view, part) in self.slots.items()
            }
            actions = self.placement.orders(microbatches)[
                self.pc.rank % self.placement.replica_size
            ]
        mirrored = MirroredJunctionSchedule(schedules, actions, microbatches, self.copy_groups[0])
        return Pipe([], mirrored, logits)

    def eval_group(self) -> ProcessGroup:
        # Every rank of the data replica (both mirrored replicas' ranks).
        return self.pc.group("placement")

    def eval_source(self) -> int:
        return self.placement.rank_of(0, MirrorSlot(0, self.layout.pp - 1, 0))

    def eval_logits(self, out: Any, batch: int, pipe: Pipe) -> Tensor:
        if isinstance(out, Tensor):  # replica A's last stage, tile 0 (its other tiles alike)
            logits = out.contiguous()
        else:
            shape = (batch, *pipe.logits_shape[1:])
            logits = torch.empty(shape, dtype=self.part.dtype, device=self.pc.device)
        dist.broadcast(logits, group=self.eval_group(), group_src=self.eval_source())
        return logits


def runtime_for(schedule: str, layout: Layout) -> type[PipelineRuntime]:
    """The runtime family of a schedule on a layout (the engine's one choice of mode)."""
    if layout.junction:
        return MirroredJunctionRuntime if schedule == "bidirectional" else JunctionRuntime
    if schedule == "bidirectional":
        return BidirectionalRuntime
    if schedule in TORCH_MULTI:
        return TorchMultiRuntime
    return OnePipelineRuntime
