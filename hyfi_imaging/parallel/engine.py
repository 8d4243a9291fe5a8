"""Data x pipeline x spatial parallelism behind one object: :class:`ParallelModel`.

A :class:`~.parallel_plan.ParallelPlan` (layout, micro-batches, schedule, balance,
checkpointing) plus the full single-device model give every rank its part: the pipeline
stage of its ``pp`` coordinate, spatialized for its tile of the ``sp`` grid, replicated over
``dp``. ``train_step`` then trains *exactly* like one process that splits the global batch
into the same micro-batches and accumulates ``mean loss / (dp x micro-batches)`` over them.

Why the engine is a facade: it orchestrates, it does not re-implement. Where each piece
lives, and the order the pieces are applied in, written once:

* :func:`~.parallelize.parallelize` -- checkpointing, spatial, streaming, the cut, stage
  modules, FSDP2 (the gradient rule: tile gradients summed over ``sp``, with the loss's
  ``1/dp`` averaged over ``dp``, head gradients divided by ``sp``; DESIGN.md invariant 5),
  the runtime and the running statistics, into one :class:`~.rank_model.RankModel` of facts;
* :mod:`.runtimes` -- one runtime class per schedule family (torch's GPipe/1F1B, torch's
  multi-stage schedules, the bi-directional replicas, the junction of per-stage grids) behind
  one interface, and the loss scaling ``loss_fn / (dp x micro-batches)``;
* :mod:`.running_stats` -- BatchNorm's running statistics merged over data replicas (and
  mirrored copies) after each step, as the reference's ``dp x micro-batches`` updates;
* :mod:`.describe` -- the printed plan.

What stays here is what every layout does alike. **Loss**: ``train_step`` returns the mean
loss of the global batch on every rank: the last stages sum their micro-batch terms, one
all-reduce over the world adds the replicas (and divides out the tiles of a stage, which hold
the same value); the same all-reduce says whether every gradient is finite and whether any
rank was asked to stop. **Gradient clipping** (:meth:`ParallelModel.clip_grad_norm_`): every
rank sums the squares of the gradient shard it owns; one all-reduce over the world counts
every element exactly once.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.apply import cross_entropy, tile_of
from hyfi_imaging.parallel.describe import describe_plan
from hyfi_imaging.parallel.launch import ParallelContext
from hyfi_imaging.parallel.parallel_plan import ParallelPlan, Schedule
from hyfi_imaging.parallel.parallelize import parallelize
from hyfi_imaging.parallel.running_stats import running_stats_increment, running_stats_merge
from hyfi_imaging.parallel.runtimes import Pipe

__all__ = [
    "ParallelModel",
    "ParallelPlan",
    "Schedule",
    "running_stats_increment",
    "running_stats_merge",
]


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
        part, self.runtime, self.running_stats = parallelize(
            model, pc, plan, image_hw=image_hw, loss_fn=loss_fn
        )
        self.pc, self.plan, self.loss_fn = pc, plan, loss_fn
        #: What :func:`~.parallelize.parallelize` built (tiles, cut, stages, units).
        self.part = part
        # Its facts, under the names trainers, the verifier and benchmarks read
        # (each documented on :class:`~.rank_model.RankModel`).
        self.image_hw, self.in_chans, self.dtype = part.image_hw, part.in_chans, part.dtype
        self.pp_rank, self.local, self.num_stages = part.pp_rank, part.local, part.num_stages
        self.stage_index, self.copies = part.stage_index, part.copies
        self.is_first, self.is_last = part.is_first, part.is_last
        self.checkpointed, self.layer_names = part.checkpointed, part.layer_names
        self.ctx, self.streamed, self.stem_whole = part.ctx, part.streamed, part.stem_whole
        self.padded_hw, self.tile_hw = part.padded_hw, part.tile_hw
        self.stage_tiles, self.out_map = part.stage_tiles, part.out_map
        self.balance_info, self.balance = part.balance_info, part.balance_info.balance
        self.stage_module, self.fsdp_units = part.stage_module, part.fsdp_units
        self._meta_model = part.meta_model
        #: The last stage's outputs of the last ``train_step`` (None on other ranks).
        self.last_logits: Tensor | None = None
        #: Whether every gradient of the world was finite after the last ``train_step``.
        self.grads_finite = True
        #: Whether any rank passed ``stop`` to the last ``train_step``.
        self.stop_requested = False

    @property
    def _pipes(self) -> dict[tuple[int, int, bool], Pipe]:
        """The runtime's pipes by (micro-batch size, micro-batches, train) (benchmarks read them)."""
        return self.runtime.pipes

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
        # Contiguous: torch's PipelineStage (2.11, measured on a GPU) checks a stage's input
        # strides against its contiguous meta trace, so a channels-last batch was refused.
        # A channels-last model gets its layout back inside: from its weights where they are
        # whole, from its FSDP2 units' input hook where they are sharded (sharding.py).
        return tiles.to(self.pc.device).contiguous()

    # ------------------------------------------------------------------ training

    def train_step(
        self, tiles: Tensor | None, labels: Tensor, *, stop: bool | Callable[[], bool] = False
    ) -> float:
        """Forward and backward of every micro-batch; returns the global batch's mean loss.

        ``tiles``: this rank's tiles of the per-replica batch (first-stage ranks;
        others may pass None). ``labels``: the per-replica targets, on every rank
        (a dense model's per-pixel targets for the whole image: each rank takes its tile).
        Gradients of the global batch's mean loss land in ``.grad`` (summed over
        ``sp``, over ``dp`` the mean of the replicas)
        (added to what is there); the optimizer is not stepped.

        The step's one all-reduce also tells every rank whether every gradient is
        finite (:attr:`grads_finite`) and whether any rank passed ``stop`` (a
        signal asked it to stop: :attr:`stop_requested`), without another sync. A callable
        ``stop`` is read just before that all-reduce: a signal that arrives during the step
        stops at this step, not the next.
        """
        batch = int(labels.shape[0])
        self.plan.check_batch(batch)
        m = self.plan.microbatches
        args: tuple[Tensor, ...] = ()
        if self.is_first:
            args = (self._check_tiles(tiles, batch),)
        pipe = self.runtime.pipe(batch // m, m, train=True)
        self.stage_module.train()
        if self.ctx is not None:
            self.ctx.follow_modes(self.stage_module)
        losses: list[Tensor] = []
        # FSDP2 reduce-scatters each unit's gradients during the last micro-batch's
        # backward and adds them to the (sharded) gradients already there.
        target = self.target_of(labels).to(self.pc.device)
        sync = self.part.branch_sync
        with self.running_stats.merged(), sync.step() if sync else contextlib.nullcontext():
            out = pipe.step(*args, target=target, losses=losses)
        self.last_logits = out.detach() if self.is_last and isinstance(out, Tensor) else None
        # One host read per step (the returned float), not one per micro-batch. It
        # carries the loss and whether every gradient this rank owns is finite.
        total = torch.zeros(3, dtype=torch.float64, device=self.pc.device)
        if self.is_last and losses:
            total[0] += torch.stack(
                [v.detach().to(torch.float64).reshape(()) for v in losses]
            ).sum()
        total[1] = self._owned_grad_norm()  # summed over the world: finite iff all are
        total[2] = float(stop() if callable(stop) else stop)
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
        # Every tile and branch rank of the last stage holds the replica's whole loss.
        return loss / (layout.stage_size(layout.pp - 1) * layout.br)

    def _owned_grads(self) -> list[Tensor]:
        """The gradients this rank owns: its FSDP shards (a DTensor's local part), else whole."""
        return [
            g.to_local() if isinstance(g, DTensor) else g
            for g in (p.grad for p in self.stage_module.parameters())
            if g is not None
        ]

    def _owned_grad_norm(self) -> Tensor:
        """The norm of the gradients this rank owns (its FSDP shards): non-finite iff one is.

        One fused norm per tensor in the gradients' own dtype (no float64 copy of
        them); summed over the world with the loss, it is the step's one flag.
        """
        grads = self._owned_grads()
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.pc.device)
        return torch.nn.utils.get_total_norm(grads).to(torch.float64)

    @torch.no_grad()
    def predict(self, tiles: Tensor | None) -> Tensor:
        """Logits of the per-replica batch in eval mode, without gradients, on every rank."""
        # The batch size goes from the pipeline's first stage to all, the logits back from
        # the last (the runtime knows over which group; for GEMS replica A runs alone).
        batch = self.runtime.eval_batch(tiles)
        args: tuple[Tensor, ...] = ()
        if self.pp_rank == 0:
            args = (self._check_tiles(tiles, batch),)
        m = max(d for d in range(1, min(batch, self.plan.microbatches) + 1) if batch % d == 0)
        pipe = self.runtime.pipe(batch // m, m, train=False)
        was_training = self.stage_module.training
        self.stage_module.eval()
        if self.ctx is not None:
            self.ctx.follow_modes(self.stage_module)
        try:
            out = pipe.step(*args)
        finally:
            self.stage_module.train(was_training)
        return self.runtime.eval_logits(out, batch, pipe)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale gradients so that the norm over the *whole* model is at most ``max_norm``.

        Returns the total norm before clipping (as ``torch.nn.utils.clip_grad_norm_``).
        Each rank sums the squares of the gradient it *owns* -- its FSDP shard,
        or the whole gradient where nothing is sharded -- and one all-reduce over
        the world adds the shards of every stage: each element is counted once.
        """
        grads = self._owned_grads()
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

    # ------------------------------------------------------------------ parameters, state

    @property
    def module(self) -> nn.Module:
        """This rank's stage (unwrapped): the original model's layers of this stage (a
        :class:`~.pipeline.StageModule`), or the model itself when it is not a chain."""
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

    def describe(self) -> str:
        """The plan in words: layout, stages and their layers, which rank holds which tile."""
        return describe_plan(self.part, self.pc, self.plan)
