"""Data x pipeline x spatial parallelism behind one object: :class:`ParallelModel`.

A :class:`ParallelPlan` (layout, micro-batches, schedule, balance,
checkpointing) plus the full single-device model give every rank its part:
the pipeline stage of its ``pp`` coordinate, spatialized for its tile of the
``sp`` grid, replicated over ``dp``. ``train_step`` then trains *exactly* like
one process that splits the global batch into the same micro-batches and
accumulates ``mean cross-entropy / (dp x micro-batches)`` over them.

How the pieces compose, and why:

* **Any model on one stage.** A chain (a registered ``ChainModel``, an
  ``nn.Sequential``) is cut into stages of its top-level children; any other
  module (torchvision, timm, a user's class) is one stage, the model itself,
  running its own ``forward`` (``pp > 1`` is refused for it before compute).
* **Spatial inside the stage.** The whole model is spatialized first
  (:func:`~.apply.apply_spatial`, so every layer knows its true size at the
  given image size), then cut. Every spatial
  rank of a stage runs the same schedule on its tile; halos and BatchNorm
  statistics are exchanged inside the stage's forward over the ``sp`` group;
  activations and gradients go tile to tile over the ``pp`` group (the ``pp``
  mesh axis joins equal tile coordinates of consecutive stages).
* **Pipeline: torch.distributed.pipelining** (``PipelineStage``,
  ``ScheduleGPipe``, ``Schedule1F1B``) on the mesh's ``pp`` group, in its
  *static* mode: stage input/output shapes come from a meta-device trace of the
  unmodified model on a tile-sized micro-batch (see :mod:`.pipeline` for why
  the runtime's own shape inference must not run spatial layers). Shapes
  depend on the micro-batch size, so stages and schedules are built per
  micro-batch size and cached.
* **Loss scaling.** Each micro-batch's loss is ``loss_fn / (dp x
  micro-batches)`` -- the reference's term, exactly -- with
  ``scale_grads=False``, so the accumulated gradient is that of the mean loss
  over the *global* batch whatever ``dp`` and the micro-batch count; input
  gradients too (a per-replica mean would make them ``dp`` times too large).
  A gradient already in ``.grad`` is not rescaled (accumulation over steps works).
  A loss that returns per-sample or per-pixel values is averaged; a dense
  model's output is tiled like its input, and the mean over the image's pixels
  is taken across tiles (:func:`~.apply.reduce_loss`); a
  :class:`~.apply.TiledLoss` (Dice) reduces across tiles itself.
* **Sharding, data and the gradient rule: FSDP2** (:mod:`.sharding`) over the
  flattened ``dp x sy x sx`` mesh of the stage: parameters, gradients and
  optimizer state are sharded; each unit reduce-scatters its gradients as soon
  as its backward is done (pipelining syncs only in the last micro-batch's
  backward). Tile-derived gradients are summed over ``sp`` and, with the
  loss's ``1/dp``, averaged over ``dp``; head gradients are divided by ``sp``
  (DESIGN.md invariant 5).
* **BatchNorm across micro-batches.** Statistics are those of each micro-batch
  (over all its tiles), and running statistics are updated once per
  micro-batch, in micro-batch order -- as in the single-process reference
  with the same split. With ``dp > 1`` the reference is one process that splits
  the *global* batch (replica 0's rows first) into ``dp x micro-batches``
  micro-batches. Running statistics are an affine recurrence, so each replica
  updates from the shared start with its own micro-batches, and one
  all-reduce over ``dp`` of the weighted increments gives every replica the
  statistics the reference reaches after all ``dp x micro-batches`` updates
  (both for ``momentum`` and for the cumulative average ``momentum=None``).
* **Loss.** ``train_step`` returns the mean loss of the global batch on every
  rank: the last stages sum their micro-batch terms, one all-reduce over the
  world adds the replicas (and divides out the tiles of a stage, which hold
  the same value).
* **Gradient clipping** (:meth:`ParallelModel.clip_grad_norm_`): every rank
  sums the squares of the gradient shard it owns; one all-reduce over the
  world counts every element exactly once.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class
from torch.distributed.tensor import DTensor

from hyfi_imaging.errors import ConfigError, HyfiError
from hyfi_imaging.models.registry import CheckpointedBlock
from hyfi_imaging.parallel.apply import (
    OutputMap,
    TiledLoss,
    apply_spatial,
    cross_entropy,
    input_channels,
    output_map,
    output_shape,
    reduce_loss,
    tile_of,
)
from hyfi_imaging.parallel.balance import BalanceBy, LayerCosts, measure_layers, partition
from hyfi_imaging.parallel.junction import (
    JunctionSchedule,
    check_junction_model,
    check_junction_plan,
    stage_tiles,
)
from hyfi_imaging.parallel.launch import ParallelContext, error_chain
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.pipeline import (
    StageModule,
    check_balance,
    is_chain,
    model_layers,
    parse_checkpointing,
    set_checkpointing,
    stage_boundaries,
    stage_bounds,
)
from hyfi_imaging.parallel.schedules import (
    SCHEDULES,
    TORCH_MULTI,
    BidirectionalSchedule,
    LocalStage,
    MirrorGroups,
    check_schedule,
    eval_last_rank,
    forward_only,
    local_stages,
    mirror_groups,
    model_stages,
)
from hyfi_imaging.parallel.sharding import apply_fsdp, called_modules
from hyfi_imaging.parallel.spatial import SpatialContext, tile_alignment, tile_shaped
from hyfi_imaging.parallel.streaming import STREAMING_MODES, stream_stem

__all__ = [
    "ParallelModel",
    "ParallelPlan",
    "Schedule",
    "running_stats_increment",
    "running_stats_merge",
]

Schedule = Literal["gpipe", "1f1b", "bidirectional", "interleaved1f1b", "zbv", "dualpipev"]


@dataclass(frozen=True)
class ParallelPlan:
    """How to run a model: the layout plus the pipeline's micro-batches, schedule, cut and checkpointing.

    ``balance`` is the number of top-level layers per stage; ``None`` measures
    every layer (``balance_by``: ``"time"`` or ``"memory"``) and cuts where the
    slowest (largest) stage is smallest. ``checkpointing`` is ``"none"``,
    ``"full"`` (every block), ``"every:N"`` (every N-th block) or ``"selective"``
    (every block, convolution outputs kept). ``overlap`` computes each spatial
    convolution's interior while its halos are in flight (and its weight
    gradient while the halo gradients are): same results, less exposed waiting.
    ``halo_depth`` > 1: one halo exchange serves up to that many consecutive
    windowed layers (fewer messages; the border is computed twice).
    ``streaming``: ``"stem"`` runs a chain's leading convolution, BatchNorm,
    activation and max-pool in row bands (:mod:`.streaming`): their maps are
    never whole, which is the peak of a checkpointed ResNet.
    ``backward_bands``: each spatial convolution's backward runs in bands of
    output rows (:func:`~.windowed.backward_band`): band-sized transients
    instead of tile-sized ones, for about nine times the kernel calls -- a
    memory tool the planner chooses only where a layout does not fit without it.
    ``schedule`` is ``gpipe``, ``1f1b``, or one with two stages per rank
    (:mod:`.schedules`): ``bidirectional`` (two mirrored replicas, GEMS),
    ``interleaved1f1b``, ``zbv``, ``dualpipev`` (torch's; the model is cut into
    ``2 pp`` stages, so ``balance`` lists ``2 pp`` counts).

    OK::

        ParallelPlan(Layout(dp=2, pp=2, sp=(1, 2)), microbatches=4, schedule="1f1b")

    Error::

        ParallelPlan(Layout(pp=4), microbatches=2, schedule="1f1b").validate(model, 8)
        # ConfigError: 1F1B needs at least as many micro-batches as stages
    """

    layout: Layout
    microbatches: int = 1
    schedule: Schedule = "gpipe"
    balance: tuple[int, ...] | None = None
    checkpointing: str = "none"
    balance_by: BalanceBy = "time"
    overlap: bool = False
    halo_depth: int = 1
    streaming: str = "none"
    backward_bands: bool = False

    def __post_init__(self) -> None:
        check_junction_plan(self.layout, self.schedule)
        if self.streaming not in STREAMING_MODES:
            raise ConfigError(
                f"streaming {self.streaming!r}",
                "is not a streaming mode",
                f"use one of {', '.join(STREAMING_MODES)}",
            )
        if self.streaming != "none" and self.halo_depth > 1:
            raise ConfigError(
                f"streaming {self.streaming} with halo_depth {self.halo_depth}",
                "a deep halo would carry a border out of the streamed stem, which computes "
                "its own tile only",
                "use halo_depth 1 with streaming, or streaming none",
            )
        if not isinstance(self.halo_depth, int) or self.halo_depth < 1:
            raise ConfigError(
                f"--halo-depth {self.halo_depth}",
                "must be a positive integer",
                "use 1 (one exchange per layer) or e.g. --halo-depth 2",
            )
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ConfigError(
                f"--microbatches {self.microbatches}",
                "must be a positive integer",
                "use e.g. --microbatches 4",
            )
        if self.schedule not in SCHEDULES:
            check_schedule(self.schedule, self.layout, self.microbatches)  # names the choices
        if self.balance_by not in ("time", "memory"):
            raise ConfigError(
                f"balance by {self.balance_by!r}", "is not a cost", "use time or memory"
            )
        if self.balance is not None:
            object.__setattr__(self, "balance", tuple(int(b) for b in self.balance))
        parse_checkpointing(self.checkpointing)
        if self.schedule == "1f1b" and self.microbatches < self.layout.pp:
            raise ConfigError(
                f"--schedule 1f1b --microbatches {self.microbatches}",
                f"1F1B needs at least as many micro-batches as pipeline stages ({self.layout.pp})",
                f"use --microbatches {self.layout.pp} or more, or --schedule gpipe",
            )
        check_schedule(self.schedule, self.layout, self.microbatches)

    @property
    def stages(self) -> int:
        """How many stages the model is cut into (``2 pp`` for torch's multi-stage schedules)."""
        return model_stages(self.schedule, self.layout.pp)

    def check_model(self, model: nn.Module) -> None:
        """ConfigError unless the model can be cut and checkpointed as planned (no compute)."""
        if self.layout.pp > 1 and not is_chain(model):
            raise ConfigError(
                f"--pipeline {self.layout.pp}",
                f"{type(model).__name__} is not a chain of layers (its forward is not its "
                "top-level children in order), so it cannot be cut into pipeline stages",
                "use --pipeline 1 (spatial and data parallelism work for any model), or build it "
                "as a hyfi_imaging.models.ChainModel or nn.Sequential",
            )
        n = len(model_layers(model))
        if self.stages > n:
            per_rank = self.stages // self.layout.pp
            raise ConfigError(
                f"--pipeline {self.layout.pp} --schedule {self.schedule}",
                f"needs {self.stages} model stages but {type(model).__name__} has only {n} "
                "top-level layers to cut",
                f"use at most {n // per_rank} pipeline stages"
                + (f" ({per_rank} model stages per rank)" if per_rank > 1 else ""),
            )
        if self.balance is not None:
            check_balance(self.balance, n, self.stages)
        if parse_checkpointing(self.checkpointing) and not any(
            isinstance(m, CheckpointedBlock) for m in model.modules()
        ):
            raise ConfigError(
                f"--checkpointing {self.checkpointing}",
                f"{type(model).__name__} has no checkpointable blocks",
                "use --checkpointing none",
            )

    def check_batch(self, batch: int) -> None:
        """ConfigError unless the per-replica ``batch`` splits into equal micro-batches."""
        m = self.microbatches
        if batch < 1 or batch % m:
            up = m * max(1, math.ceil(batch / m))
            raise ConfigError(
                f"batch {batch} with --microbatches {m}",
                f"the per-replica batch does not split into {m} equal micro-batches",
                f"use a per-replica batch that is a multiple of {m} (e.g. {up}), "
                f"or a number of micro-batches that divides {batch}",
            )

    def validate(self, model: nn.Module, batch: int) -> None:
        """Every check that needs no process group and no compute; ConfigError naming the fix."""
        self.check_model(model)
        self.check_batch(batch)


@dataclass
class _Pipe:
    """One PipelineStage and its schedule, for one micro-batch size."""

    stages: list[PipelineStage]  # empty: a junction's own schedule (see .junction)
    schedule: (
        ScheduleGPipe
        | Schedule1F1B
        | PipelineScheduleMulti
        | BidirectionalSchedule
        | JunctionSchedule
    )
    logits_shape: tuple[int, ...]


@dataclass
class _BalanceInfo:
    balance: tuple[int, ...]
    how: str
    costs: LayerCosts | None = None
    params: list[int] = field(default_factory=list)


class ParallelModel:
    """The model of one rank: its pipeline stage, spatialized for its tile, replicated over dp.

    ``model`` is the full single-device model, built identically (same seed) on
    every rank; it is spatialized in place and only this rank's stage is kept
    (drop other references to ``model`` to free the rest). Keys of
    :meth:`state_dict` and :meth:`named_parameters` are the original model's,
    restricted to the stage.
    """

    def __init__(
        self,
        model: nn.Module,
        pc: ParallelContext,
        plan: ParallelPlan,
        *,
        image_hw: Sequence[int],
        loss_fn: Callable[[Tensor, Tensor], Tensor] = cross_entropy,
    ) -> None:
        if pc.layout != plan.layout:
            raise ConfigError(
                "ParallelModel",
                f"the plan's layout {plan.layout.describe()} is not the job's {pc.layout.describe()}",
                "build the ParallelContext and the plan from the same Layout",
            )
        plan.check_model(model)
        check_same_weights(model, pc.device)
        self.pc, self.plan, self.loss_fn = pc, plan, loss_fn
        #: The image's size: ``(h, w)``, or ``(d, h, w)`` for volumes on a 3-D grid.
        self.image_hw: tuple[int, ...] = tuple(int(v) for v in image_hw)
        layout = plan.layout
        pp_i = pc.coords[1]
        self.pp_rank = pp_i
        #: The model stages this rank holds (two for bidirectional and torch's V schedules).
        self.local: tuple[LocalStage, ...] = local_stages(plan.schedule, layout.pp, pp_i)
        self.stage_index, self.num_stages = self.local[0].index, plan.stages
        #: Whether this rank holds a first (takes the input) or a last stage (computes the loss).
        self.is_first = any(ls.index == 0 for ls in self.local)
        self.is_last = any(ls.index == plan.stages - 1 for ls in self.local)
        #: Copies of every stage across the pipeline (2: bidirectional replicas A and B).
        self.copies = 2 if plan.schedule == "bidirectional" else 1
        self.in_chans = input_channels(model)
        self.dtype = next((p.dtype for p in model.parameters()), torch.get_default_dtype())
        self.checkpointed = set_checkpointing(model, plan.checkpointing)
        layers = model_layers(model)
        self.layer_names = [n for n, _ in layers]
        self._meta_model = copy.deepcopy(model).to("meta")
        if layout.junction:
            h, w = self.image_hw
            check_junction_model(
                layout,
                output_shape(self._meta_model, (1, self.in_chans, h, w)) or (),
                output_shape(self._meta_model, (1, self.in_chans, max(1, h // 2), max(1, w // 2)))
                or (),
            )
        plain = copy.deepcopy(model) if plan.balance is None and plan.stages > 1 else None

        self.ctx: SpatialContext | None = apply_spatial(
            model,
            pc,
            image_size=self.image_hw,
            in_chans=self.in_chans,
            overlap=plan.overlap,
            halo_depth=plan.halo_depth,
            reduce_grads=False,  # FSDP2 reduces them (sharding.py: the tile/head rule)
            backward_bands=plan.backward_bands,
        )
        #: The streamed stem's layers (parallel/streaming.py), empty without streaming.
        self.streamed: list[str] = stream_stem(model, self.ctx) if plan.streaming == "stem" else []
        self.padded_hw: tuple[int, ...] = self.image_hw
        self.tile_hw: tuple[int, ...] = self.image_hw
        #: The plain model as it runs on a tile's shape (stage shapes, layer timing).
        self._tile_model = self._meta_model
        if self.ctx is not None:
            self.padded_hw = self.ctx.padded_size(self.image_hw)
            self.tile_hw = self.ctx.tile_size(self.image_hw)
            if self.ctx.flatten_paths:
                self._tile_model = tile_shaped(copy.deepcopy(self._meta_model), self.ctx)
                plain = None if plain is None else tile_shaped(plain, self.ctx)
        #: The input tile of every stage's grid (all the same without per-stage grids).
        self.stage_tiles: list[tuple[int, ...]] = [self.tile_hw] * layout.pp
        if layout.junction:
            # Every grid pads the image to the model's alignment (a 1x1 stage too, which
            # has no spatial context: the number comes from the model, the same everywhere).
            align = tile_alignment(self._meta_model, len(self.image_hw), in_chans=self.in_chans)
            self.stage_tiles = list(stage_tiles(layout, self.image_hw, align))
        #: The output's map when the model is dense (its output is tiled too), else None.
        self.out_map: OutputMap | None = output_map(
            self._tile_model, self.in_chans, self.image_hw, self.tile_hw
        )

        self.balance_info = self._choose_balance(plain)
        del plain
        self.balance = self.balance_info.balance
        bounds = stage_bounds(self.balance)
        #: Whether the first stage holds the whole streamed stem (a cut inside it runs its
        #: layers one by one: exact, without the memory saving; said in the plan).
        self.stem_whole = not self.streamed or bounds[0][1] >= len(self.streamed)
        # A chain is cut into stages of its children; any other model is one stage, the
        # model itself, running its own forward under its own parameter names.
        self._submods: list[nn.Module] = [model]
        if is_chain(model):
            self._submods = []
            for ls in self.local:
                start, stop = bounds[ls.index]
                cut = StageModule(
                    layers[start:stop],
                    index=ls.index,
                    dtype=self.dtype,
                    contiguous_grads=plan.schedule in ("zbv", "dualpipev"),
                    planned=partial(self._planned_outputs, ls.index),
                )
                self._submods.append(cut)
        #: This rank's layers (of all its stages, in model order) under their original names.
        self.stage_module: nn.Module = self._submods[0]
        if len(self._submods) > 1:
            order = sorted(range(len(self.local)), key=lambda k: self.local[k].index)
            self.stage_module = StageModule(
                [nl for k in order for nl in self._submods[k].named_children()],
                index=self.stage_index,
            )
        self.fsdp_units: list[str] = []
        for ls, sub in zip(self.local, self._submods, strict=True):
            if ls.index > 0:
                _no_inplace_at_entry(sub)
            sub.to(pc.device)
            self.fsdp_units += self._shard(sub)
        #: B's pipeline group and the mirror pairs (bidirectional only).
        self._mirror: MirrorGroups | None = None
        if self.copies == 2:
            self._mirror = mirror_groups(pc.mesh.mesh, pc.rank)
        self._pipes: dict[tuple[int, int, bool], _Pipe] = {}
        #: Per micro-batch size, every stage boundary's tensor shapes (:meth:`_pipe`'s trace).
        self._boundaries: dict[int, list[tuple[tuple[int, ...], ...]]] = {}
        self.last_logits: Tensor | None = None
        #: Whether every gradient of the world was finite after the last ``train_step``.
        self.grads_finite = True
        #: Whether any rank passed ``stop`` to the last ``train_step``.
        self.stop_requested = False

    # ------------------------------------------------------------------ set-up

    def _shard(self, sub: nn.Module) -> list[str]:
        """Shard one stage module with FSDP2 over ``dp x sp`` (each stage its own FSDP root)."""
        pc, plan = self.pc, self.plan
        if pc.shard_mesh is None or not any(p.requires_grad for p in sub.parameters()):
            return []
        paths = apply_fsdp(
            sub,
            pc.shard_mesh,
            tile_names=None if self.ctx is None else self.ctx.tile_param_names,
            tiles=plan.layout.stage_size(self.pp_rank),
            # Keep each unit's parameters gathered from its forward to its backward: a
            # second all-gather per step cost a 1x2 ResNet-50 rank 0.4 s of its 3.4 s on CPU
            # (bench_spatial, CPU-time bound 0.442 -> 0.486), and the parameters are small
            # next to a whole image's activations.
            reshard_after_forward=False,
            # A streamed stem's layers are not called one by one: their parameters are the
            # root's, gathered when the stage starts.
            called=called_modules(self._meta_model, (1, self.in_chans, *self.image_hw))
            - set(self.streamed),
        )
        # FSDP2 hands a unit its input as a view made by a custom Function, which an
        # in-place op may not modify (torchvision's classifier: Dropout(inplace=True)).
        units = dict(sub.named_modules())
        for path in paths:
            if path in units and units[path] is not sub:
                _no_inplace_at_entry(units[path])
        return paths

    def _choose_balance(self, plain: nn.Module | None) -> _BalanceInfo:
        plan = self.plan
        params = [sum(p.numel() for p in m.parameters()) for _, m in model_layers(self._meta_model)]
        n = len(params)
        if plan.balance is not None:
            return _BalanceInfo(plan.balance, "explicit", None, params)
        if plan.stages == 1:
            return _BalanceInfo((n,), "one stage", None, params)
        assert plain is not None
        plain.to(self.pc.device)
        sample = torch.randn(
            1, self.in_chans, *self.tile_hw, dtype=self.dtype, device=self.pc.device
        )
        costs = measure_layers(model_layers(plain), sample, repeat=3)
        # Max over ranks is exact: every rank then cuts from the same numbers.
        vec = torch.tensor(
            [*costs.seconds, *[float(b) for b in costs.bytes]], dtype=torch.float64
        ).to(self.pc.device)
        # The world: every stage, tile and replica must cut the model identically.
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
        vec = vec.cpu()
        costs = LayerCosts(
            costs.names,
            tuple(float(v) for v in vec[:n]),
            tuple(int(v) for v in vec[n:]),
        )
        balance = partition(costs.of(plan.balance_by), plan.stages)
        return _BalanceInfo(balance, f"automatic, by {plan.balance_by}", costs, params)

    def _loss(self, n_micro: int) -> Callable[[Tensor, Tensor], Tensor]:
        fn, terms = self.loss_fn, n_micro * self.plan.layout.dp

        def loss(out: Tensor, target: Tensor) -> Tensor:
            if isinstance(fn, TiledLoss):  # reduces across tiles itself (Dice)
                return fn(out, target, self.ctx, self.out_map) / terms
            return reduce_loss(fn(out, target), self.ctx, self.out_map) / terms

        return loss

    def _junction_pipe(self, mb: int, n_micro: int, train: bool) -> _Pipe:
        """Per-stage grids: this stage's part of the schedule, the junction's pieces in between."""
        schedule = JunctionSchedule(
            self._submods[0],
            layout=self.plan.layout,
            coords=self.pc.coords,
            image_hw=self.image_hw,
            tiles=self.stage_tiles,
            meta_model=self._meta_model,
            balance=self.balance,
            microbatch=mb,
            in_chans=self.in_chans,
            microbatches=n_micro,
            schedule=self.plan.schedule,
            loss_fn=self._loss(n_micro) if train else None,
            group=self.pc.group("replica"),
            device=self.pc.device,
            dtype=self.dtype,
        )
        logits = stage_boundaries(
            self._meta_model, self.balance, (mb, self.in_chans, *self.stage_tiles[-1])
        )[-1][0]
        return _Pipe([], schedule, tuple(logits.shape))

    def _pipe(self, mb: int, n_micro: int, train: bool) -> _Pipe:
        key = (mb, n_micro, train)
        if key not in self._pipes and self.plan.layout.junction:
            self._pipes[key] = self._junction_pipe(mb, n_micro, train)
        if key not in self._pipes:
            bounds = stage_boundaries(
                self._tile_model,
                self.balance,
                (mb, self.in_chans, *self.tile_hw),
                dtype=self.dtype,
            )
            self._boundaries[mb] = [tuple(tuple(t.shape) for t in b) for b in bounds]
            schedule_name = self.plan.schedule
            # Evaluation of two mirrored replicas runs replica A alone (one pipeline, GPipe).
            local = list(zip(self.local, self._submods, strict=True))
            if not train and schedule_name == "bidirectional":
                local = local[:1]
            stages = []
            for ls, sub in local:
                s = ls.index
                group = self.pc.group("pp")
                if ls.replica == 1:
                    assert self._mirror is not None
                    group = self._mirror.pipeline_b
                stage = PipelineStage(
                    sub,
                    s,
                    self.num_stages,
                    self.pc.device,
                    input_args=tuple(t.requires_grad_(s > 0) for t in bounds[s]),
                    output_args=tuple(t.requires_grad_(True) for t in bounds[s + 1]),
                    group=group,
                )
                if ls.replica == 1:  # replica B runs right to left: its stage j is on rank P-1-j
                    p = self.plan.layout.pp
                    stage.stage_index_to_group_rank = {j: p - 1 - j for j in range(p)}
                stages.append(stage)
            loss = self._loss(n_micro) if train else None
            schedule: ScheduleGPipe | Schedule1F1B | PipelineScheduleMulti | BidirectionalSchedule
            if schedule_name in TORCH_MULTI and not train:
                schedule = forward_only(stages, n_micro, schedule_name, self.plan.layout.pp)
            elif schedule_name in TORCH_MULTI:
                cls = get_schedule_class(TORCH_MULTI[schedule_name])
                schedule = cls(stages, n_micro, loss_fn=loss, scale_grads=False)
            elif schedule_name == "bidirectional" and train:
                assert self._mirror is not None
                schedule = BidirectionalSchedule(
                    (stages[0], stages[1]),
                    n_micro,
                    loss,
                    mirror=self._mirror.mirror,
                    pipeline_rank=self.pp_rank,
                    pipeline_size=self.plan.layout.pp,
                )
            elif schedule_name == "1f1b" and train:
                schedule = Schedule1F1B(stages[0], n_micro, loss_fn=loss, scale_grads=False)
            else:
                schedule = ScheduleGPipe(stages[0], n_micro, loss_fn=loss, scale_grads=False)
            self._pipes[key] = _Pipe(stages, schedule, tuple(bounds[-1][0].shape))
        return self._pipes[key]

    # ------------------------------------------------------------------ data

    def tile_of(self, images: Tensor) -> Tensor:
        """This rank's tile of a full ``(N, C, H, W)`` batch (``(N, C, D, H, W)`` volumes),
        padded as the layout needs."""
        nd = len(self.image_hw)
        if tuple(images.shape[-nd:]) != self.image_hw:
            raise ConfigError(
                "ParallelModel.tile_of",
                f"images are {tuple(images.shape[-nd:])} but the model was planned for "
                f"{self.image_hw}",
                "pass images of the planned size, or build a ParallelModel for this size",
            )
        return tile_of(images, self.ctx, self.image_hw)

    def target_of(self, target: Tensor) -> Tensor:
        """This rank's part of a per-replica target: its tile of a per-pixel target of a dense
        model's output map (``(N, h, w)`` for the whole image), else the target itself."""
        if self.out_map is None or self.ctx is None:
            return target
        return self.out_map.tile_of(target, self.ctx)

    def _check_tiles(self, tiles: Tensor | None, batch: int | None) -> Tensor:
        want = (self.in_chans, *self.tile_hw)
        if (
            tiles is None
            or tuple(tiles.shape[1:]) != want
            or (batch is not None and tiles.shape[0] != batch)
        ):
            got = None if tiles is None else tuple(tiles.shape)
            raise ConfigError(
                f"pipeline stage 0 (rank {self.pc.rank})",
                f"needs this rank's tiles of shape ({batch or 'N'}, {', '.join(map(str, want))}), "
                f"got {got}",
                "pass ParallelModel.tile_of(images) on first-stage ranks",
            )
        if tiles.is_floating_point() and tiles.dtype != self.dtype:
            tiles = tiles.to(self.dtype)  # integer pixels: normalising is the data path's job
        return tiles.to(self.pc.device)

    def _planned_outputs(self, stage: int, mb: int) -> tuple[tuple[int, ...], ...]:
        """The output shapes of model stage ``stage`` for a micro-batch of ``mb`` samples, as
        the meta trace of :meth:`_pipe` planned them (what the next stage's buffers hold)."""
        return self._boundaries[mb][stage + 1]

    # ------------------------------------------------------------------ training

    def train_step(self, tiles: Tensor | None, labels: Tensor, *, stop: bool = False) -> float:
        """Forward and backward of every micro-batch; returns the global batch's mean loss.

        ``tiles``: this rank's tiles of the per-replica batch (first-stage ranks;
        others may pass None). ``labels``: the per-replica targets, on every rank
        (a dense model's per-pixel targets for the whole image: each rank takes its tile).
        Gradients of the global batch's mean loss land in ``.grad`` (summed over
        ``sp``, over ``dp`` the mean of the replicas)
        (added to what is there); the optimizer is not stepped.

        The step's one all-reduce also tells every rank whether every gradient is
        finite (:attr:`grads_finite`) and whether any rank passed ``stop`` (a
        signal asked it to stop: :attr:`stop_requested`), without another sync.
        """
        batch = int(labels.shape[0])
        self.plan.check_batch(batch)
        m = self.plan.microbatches
        args: tuple[Tensor, ...] = ()
        if self.is_first:
            args = (self._check_tiles(tiles, batch),)
        pipe = self._pipe(batch // m, m, train=True)
        self.stage_module.train()
        snapshot = self._norm_snapshot() if self.plan.layout.dp * self.copies > 1 else None
        losses: list[Tensor] = []
        # FSDP2 reduce-scatters each unit's gradients during the last micro-batch's
        # backward and adds them to the (sharded) gradients already there.
        target = self.target_of(labels).to(self.pc.device)
        with _own_errors():
            out = pipe.schedule.step(*args, target=target, losses=losses)
        self.last_logits = out.detach() if self.is_last and isinstance(out, Tensor) else None
        if snapshot is not None:
            self._sync_running_stats(snapshot)
        # One host read per step (the returned float), not one per micro-batch. It
        # carries the loss and whether every gradient this rank owns is finite.
        total = torch.zeros(3, dtype=torch.float64, device=self.pc.device)
        if self.is_last and losses:
            total[0] += torch.stack(
                [v.detach().to(torch.float64).reshape(()) for v in losses]
            ).sum()
        total[1] = self._owned_grad_norm()  # summed over the world: finite iff all are
        total[2] = float(stop)
        # The world: the loss terms live on the last stage of every replica and tile,
        # and every rank returns the step's loss.
        dist.all_reduce(total, group=dist.group.WORLD)
        # NaN unless the loss and every gradient are finite and no rank asked to stop:
        # one read in the common case.
        loss = float(total[0] + 0.0 * total[1] + torch.where(total[2] > 0, math.nan, 0.0))
        self.grads_finite, self.stop_requested = True, False
        if not math.isfinite(loss):  # which one (rare: a few more reads)
            loss, norm, stops = total.tolist()
            self.grads_finite, self.stop_requested = math.isfinite(norm), stops > 0
        layout = self.plan.layout
        return loss / layout.stage_size(layout.pp - 1)

    def _owned_grad_norm(self) -> Tensor:
        """The norm of the gradients this rank owns (its FSDP shards): non-finite iff one is.

        One fused norm per tensor in the gradients' own dtype (no float64 copy of
        them); summed over the world with the loss, it is the step's one flag.
        """
        grads = [_local(p.grad) for p in self.stage_module.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.pc.device)
        return torch.nn.utils.get_total_norm(grads).to(torch.float64)

    @torch.no_grad()
    def predict(self, tiles: Tensor | None) -> Tensor:
        """Logits of the per-replica batch in eval mode, without gradients, on every rank."""
        # From the first stage to all, and back from the last: along the tile's ``pp`` axis,
        # or over the whole replica with per-stage grids (its last stage's tile 0 sends).
        layout = self.plan.layout
        pp = layout.pp
        pp_group = self.pc.group("replica" if layout.junction else "pp")
        # The pipeline predict runs starts on pipeline rank 0 (for GEMS: replica A alone).
        first, last = self.pp_rank == 0, self.pp_rank == eval_last_rank(self.plan.schedule, pp)
        src = (
            layout.replica_size - layout.stage_size(pp - 1)
            if layout.junction
            else eval_last_rank(self.plan.schedule, pp)
        )
        n = torch.tensor([0 if tiles is None else int(tiles.shape[0])], device=self.pc.device)
        if pp > 1:
            dist.broadcast(n, group=pp_group, group_src=0)
        batch = int(n.item())
        args: tuple[Tensor, ...] = ()
        if first:
            args = (self._check_tiles(tiles, batch),)
        m = max(d for d in range(1, min(batch, self.plan.microbatches) + 1) if batch % d == 0)
        pipe = self._pipe(batch // m, m, train=False)
        was_training = self.stage_module.training
        self.stage_module.eval()
        try:
            with _own_errors():
                out = pipe.schedule.step(*args)
        finally:
            self.stage_module.train(was_training)
        if last:
            assert isinstance(out, Tensor)
            logits = out.contiguous()
        else:
            shape = (batch, *pipe.logits_shape[1:])
            logits = torch.empty(shape, dtype=self.dtype, device=self.pc.device)
        if pp > 1:
            dist.broadcast(logits, group=pp_group, group_src=src)
        return logits

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale gradients so that the norm over the *whole* model is at most ``max_norm``.

        Returns the total norm before clipping (as ``torch.nn.utils.clip_grad_norm_``).
        Each rank sums the squares of the gradient it *owns* -- its FSDP shard,
        or the whole gradient where nothing is sharded -- and one all-reduce over
        the world adds the shards of every stage: each element is counted once.
        """
        grads = [_local(p.grad) for p in self.stage_module.parameters() if p.grad is not None]
        sq = torch.zeros(1, dtype=torch.float64, device=self.pc.device)
        for g in grads:
            sq += g.detach().double().pow(2).sum()
        if self.pc.world_size > 1:
            dist.all_reduce(sq, group=dist.group.WORLD)  # the shards of every stage
        # Bidirectional: the world holds two identical copies of every stage's gradient.
        total = float((sq / self.copies).sqrt().item())
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.detach().mul_(coef)
        return total

    # ------------------------------------------------------------------ BatchNorm over dp

    def _norms(self) -> list[nn.modules.batchnorm._BatchNorm]:
        return [
            m
            for m in self.stage_module.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and m.track_running_stats
            and m.running_mean is not None
        ]

    def _norm_snapshot(self) -> list[tuple[Tensor, Tensor, int]]:
        out = []
        for m in self._norms():
            assert m.running_mean is not None and m.running_var is not None
            assert m.num_batches_tracked is not None
            out.append((m.running_mean.clone(), m.running_var.clone(), int(m.num_batches_tracked)))
        return out

    def _sync_running_stats(self, snapshot: list[tuple[Tensor, Tensor, int]]) -> None:
        """Running statistics as if one process had run every replica's micro-batches in order.

        Replica ``d`` ran ``k`` updates ``r <- (1 - m) r + m x`` from the shared
        start ``r0``: ``r_d = a r0 + c_d`` with ``a = (1 - m)^k``. Replicas in
        order 0, 1, ... give ``a^D r0 + sum_d a^(D-1-d) c_d``. With
        ``momentum=None`` (cumulative average) the increments simply add up.

        Bidirectional: copy ``h`` (A = 0, B = 1) of data replica ``d`` is replica ``2 d + h``
        (the reference runs ``d``'s first half, then its second half); this rank's norms are
        listed in model order, the same on both ranks of a mirror pair, and the shares are
        summed over the pair as well as over ``dp``.
        """
        norms = self._norms()
        if not norms:
            return
        copy_of = {
            id(m): ls.replica
            for ls, sub in zip(self.local, self._submods, strict=True)
            for m in sub.modules()
        }
        d, n_rep = self.pc.coords[0], self.plan.layout.dp * self.copies
        parts: list[Tensor] = []
        for m, (r0m, r0v, n0) in zip(norms, snapshot, strict=True):
            assert m.running_mean is not None and m.running_var is not None
            assert m.num_batches_tracked is not None
            k = int(m.num_batches_tracked) - n0
            replica = self.copies * d + copy_of.get(id(m), 0)
            for now, r0 in ((m.running_mean, r0m), (m.running_var, r0v)):
                parts.append(
                    running_stats_increment(
                        now, r0, n0=n0, k=k, momentum=m.momentum, replica=replica, replicas=n_rep
                    ).reshape(-1)
                )
        flat = torch.cat(parts)
        if self._mirror is not None:
            dist.all_reduce(flat, group=self._mirror.mirror)
        if self.plan.layout.dp > 1:
            dist.all_reduce(flat, group=self.pc.group("dp"))
        offset = 0
        with torch.no_grad():
            for m, (r0m, r0v, n0) in zip(norms, snapshot, strict=True):
                assert m.num_batches_tracked is not None
                k = int(m.num_batches_tracked) - n0
                for buf, r0 in ((m.running_mean, r0m), (m.running_var, r0v)):
                    assert buf is not None
                    total = flat[offset : offset + r0.numel()].view_as(r0)
                    offset += r0.numel()
                    merged = running_stats_merge(
                        total, r0, n0=n0, k=k, momentum=m.momentum, replicas=n_rep
                    )
                    buf.copy_(merged)
                m.num_batches_tracked.fill_(n0 + n_rep * k)

    # ------------------------------------------------------------------ parameters, state

    @property
    def module(self) -> nn.Module:
        """This rank's stage (unwrapped): the original model's layers of this stage (a
        :class:`StageModule`), or the model itself when it is not a chain."""
        return self.stage_module

    def parameters(self) -> Iterator[nn.Parameter]:
        """This stage's parameters."""
        return self.stage_module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This stage's parameters under the original model's names."""
        return self.stage_module.named_parameters()

    def state_dict(self) -> dict[str, Any]:
        """This stage's state under the original model's keys (no ``module.``/stage prefix)."""
        return self.stage_module.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> Any:
        """Load this stage's entries (keys as in the original model)."""
        return self.stage_module.load_state_dict(state, strict=strict)

    def train(self, mode: bool = True) -> ParallelModel:
        """Set training mode on the stage (``train_step`` always trains, ``predict`` evaluates)."""
        self.stage_module.train(mode)
        return self

    # ------------------------------------------------------------------ plan printout

    def describe(self) -> str:
        """The plan in words: layout, stages and their layers, which rank holds which tile."""
        layout, plan, info = self.plan.layout, self.plan, self.balance_info
        size = "x".join(map(str, self.image_hw))
        lines = [
            f"hyfi parallel plan: {layout.describe()} = {layout.world_size} ranks "
            f"({self.pc.backend} on {self.pc.device.type})",
            f"  schedule {plan.schedule}, {plan.microbatches} micro-batch(es) per step; "
            f"checkpointing {plan.checkpointing}; each replica's batch is split into "
            f"{plan.microbatches} equal micro-batches, BatchNorm per micro-batch",
        ]
        if self.streamed:
            how = (
                "in row bands"
                if self.stem_whole
                else "NOT streamed: the first pipeline stage ends inside it, so its layers run "
                "one by one (give the first stage more layers with --balance)"
            )
            lines.append(f"  streaming: stem {', '.join(self.streamed)} {how}")
        if len(self.local) > 1:
            held = ", ".join(
                f"{'AB'[ls.replica] if self.copies > 1 else ''}{ls.index}"
                for ls in local_stages(plan.schedule, layout.pp, 0)
            )
            what = (
                "two mirrored replicas: rank r holds stage r of replica A (first half of the "
                "micro-batches) and stage P-1-r of replica B (second half); the two copies of "
                "each stage sum their gradients"
                if self.copies > 1
                else f"{plan.stages} model stages, two per pipeline rank"
            )
            lines.append(f"  {what} (pipeline rank 0 holds {held})")
        if layout.junction:
            tiles = ", ".join(
                f"stage {s} {gy}x{gx} tiles of {h}x{w}"
                for s, ((gy, gx), (h, w)) in enumerate(
                    zip(map(layout.grid_of, range(layout.pp)), self.stage_tiles, strict=True)
                )
            )
            lines.append(
                f"  image {size}, a grid per stage: {tiles}; "
                "activations re-partitioned exactly where the grid changes (junction)"
            )
        elif self.ctx is not None:
            lines.append(
                f"  image {size} padded to {'x'.join(map(str, self.padded_hw))}, "
                f"{'x'.join(map(str, layout.sp))} tiles of {'x'.join(map(str, self.tile_hw))}"
            )
        else:
            lines.append(f"  image {size}, one tile (no spatial split)")
        if self.fsdp_units:
            lines.append(
                f"  parameters, gradients and optimizer state sharded by FSDP2 over "
                f"{layout.dp * layout.stage_size(self.stage_index)} ranks (dp x sp) on this stage, "
                f"{len(self.fsdp_units)} units on this stage"
            )
        lines.append(f"  balance {','.join(map(str, info.balance))} ({info.how})")
        for s, (start, stop) in enumerate(stage_bounds(info.balance)):
            names = self.layer_names[start:stop]
            span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            extra = ""
            if info.costs is not None:
                ms = 1e3 * sum(info.costs.seconds[start:stop])
                mib = sum(info.costs.bytes[start:stop]) / 2**20
                extra = f", {ms:.1f} ms, {mib:.1f} MiB per micro-batch of 1"
            n_params = sum(info.params[start:stop]) / 1e6
            cp = [n for n in self.checkpointed if n.split(".")[0] in names]
            ck = f", {len(cp)} block(s) checkpointed" if cp else ""
            lines.append(
                f"  stage {s}: {span} ({stop - start} layers, {n_params:.3g} M params{extra}{ck})"
            )
        nd = len(self.image_hw)  # a volume on a one-tile 2-D layout still has 3 axes
        axes = ("slabs", "rows", "cols")[-nd:]
        lines.append("  rank  dp stage  tile   " + "".join(f"{a:<12s}" for a in axes).rstrip())
        shown = min(layout.world_size, 64)
        for rank in range(shown):
            d, p, *tile = layout.coords(rank)
            tile = [0] * (nd - len(tile)) + tile
            held = "+".join(str(ls.index) for ls in local_stages(plan.schedule, layout.pp, p))
            spans = "".join(
                f"{i * t:5d}:{(i + 1) * t:<6d}"
                for i, t in zip(tile, self.stage_tiles[p], strict=True)
            )
            lines.append(
                f"  {rank:4d} {d:3d} {held:>5s}  {','.join(map(str, tile)):<6s} {spans.rstrip()}"
            )
        if shown < layout.world_size:
            lines.append(f"  ... ({layout.world_size - shown} more ranks)")
        return "\n".join(lines)


@contextmanager
def _own_errors() -> Iterator[None]:
    """A HyfiError raised inside a pipeline stage comes out as itself (one line), not
    wrapped in ``torch.distributed.pipelining``'s RuntimeError with a traceback."""
    try:
        yield
    except RuntimeError as err:
        cause = next((e for e in error_chain(err) if isinstance(e, HyfiError)), None)
        if cause is None:
            raise
        raise cause from None


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


def _local(t: Tensor) -> Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard, else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def running_stats_increment(
    now: Tensor,
    start: Tensor,
    *,
    n0: int,
    k: int,
    momentum: float | None,
    replica: int,
    replicas: int,
) -> Tensor:
    """One replica's share of the merged running statistic (sum the shares over replicas).

    ``start`` is the statistic before the step (``n0`` updates so far), ``now``
    after this replica's ``k`` updates. Momentum ``m``: ``now = a start + c``
    with ``a = (1 - m)^k``, and replica ``d`` of ``D`` contributes
    ``a^(D-1-d) c``. ``momentum=None`` (cumulative average): the contribution is
    the sum of the replica's batch statistics, ``(n0 + k) now - n0 start``.
    """
    now, start = now.detach().double(), start.detach().double()
    if momentum is None:
        return (n0 + k) * now - n0 * start
    a = (1.0 - momentum) ** k
    return a ** (replicas - 1 - replica) * (now - a * start)


def running_stats_merge(
    total: Tensor, start: Tensor, *, n0: int, k: int, momentum: float | None, replicas: int
) -> Tensor:
    """The statistic after ``replicas x k`` updates in replica order, from the summed shares."""
    start = start.detach().double()
    if momentum is None:
        return (n0 * start + total) / (n0 + replicas * k)
    return (1.0 - momentum) ** (k * replicas) * start + total


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
