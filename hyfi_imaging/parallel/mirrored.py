r"""Two mirrored replicas of a pipeline with per-stage grids: MPI4DL's GEMS + SP.

Where they live (:class:`MirroredPlacement`, pure): pipeline position ``p`` holds replica A's
stage ``p`` and replica B's stage ``P - 1 - p``, each on its own grid, tile ``i`` of either on
the position's rank ``i`` -- so a position needs as many ranks as the larger of its two grids.
With one grid for every stage it is exactly the GEMS placement of :mod:`.schedules` (rank
``(d, p, tile)`` holds A's ``p`` and B's ``P - 1 - p`` at the same tile), and every position's
actions keep its merged order (:func:`~.schedules.schedule_actions`), which a rank filters to
the stages it holds. MPI4DL mirrors *world* ranks instead (``gems_comm.MPIComm``: B's slot
``k`` on rank ``R - 1 - k`` of the same ``R`` ranks): fewer ranks, but its middle ranks hold
two tiles of the activation-heavy first stage, which is the memory a junction exists to
spread. Two disjoint sets of ranks would share no rank, so no bubble would be filled:
``--data 2`` with half the micro-batches under another name.

How a rank runs them: one *view* of the job per replica it holds a stage of
(:func:`mirrored_context`: a :class:`~.launch.ParallelContext` whose layout ranks map to the
placement's global ranks, with that replica's meshes); each replica's stage is built on its
view as a plain junction rank (:mod:`.parallelize`), and :class:`MirroredJunctionSchedule`
runs the two :class:`~.junction.JunctionSchedule`\ s in the position's GEMS order; the mirror
pair (position ``p`` and ``P - 1 - p``, the same tile) sums the copies' gradients. Why views
and not a second engine: docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.junction import JunctionSchedule, junction_meshes
from hyfi_imaging.parallel.launcher_env import launch_with
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.schedules import (
    ScheduleAction,
    add_mirror_grads,
    check_schedule,
    mirror_input_grad,
    mirror_outputs,
    schedule_actions,
)

if TYPE_CHECKING:
    from hyfi_imaging.parallel.launch import ParallelContext

__all__ = [
    "MirrorSlot",
    "MirroredJunctionSchedule",
    "MirroredPlacement",
    "mirrored",
    "mirrored_context",
    "check_placed_world",
    "placed_world_size",
]


def mirrored(layout: Layout, schedule: str | None) -> MirroredPlacement | None:
    """The placement of two mirrored replicas where ``schedule`` asks for them on per-stage
    grids (None elsewhere: every layout rank is its global rank)."""
    return MirroredPlacement(layout) if layout.junction and schedule == "bidirectional" else None


def check_placed_world(layout: Layout, schedule: str | None, world_size: int) -> None:
    """Raise ConfigError (one line) unless a job of ``world_size`` ranks runs ``layout`` under
    ``schedule`` (the mirrored placement's count where it has one)."""
    place = mirrored(layout, schedule)
    (layout if place is None else place).check_world(world_size)


def placed_world_size(layout: Layout, schedule: str | None) -> int:
    """Ranks a run of ``layout`` under ``schedule`` takes: the layout's, or the mirrored
    placement's (two replicas of per-stage grids widen each position to its larger grid)."""
    place = mirrored(layout, schedule)
    return layout.world_size if place is None else place.world_size


@dataclass(frozen=True)
class MirrorSlot:
    """One stage tile of GEMS's two replicas: ``replica`` 0 (A) or 1 (B), model ``stage``,
    ``tile`` the row-major index in that stage's grid."""

    replica: int
    stage: int
    tile: int


@dataclass(frozen=True)
class MirroredPlacement:
    """Where two mirrored replicas of a per-stage-grid pipeline live (see the module doc).

    OK: ``MirroredPlacement(Layout(pp=2, grids=((2, 1), (1, 1))))`` -> 4 ranks: rank 0 holds
    A's stage 0 tile 0 and B's stage 1, rank 1 A's stage 0 tile 1, rank 2 A's stage 1 and
    B's stage 0 tile 0, rank 3 B's stage 0 tile 1.

    Error: ``MirroredPlacement(...).check(4, microbatches=3)`` -> ConfigError (odd
    micro-batches), as :func:`~.schedules.check_schedule` says for one grid.
    """

    layout: Layout

    def position(self, replica: int, stage: int) -> int:
        """The pipeline position holding ``stage`` of ``replica`` (B runs right to left)."""
        return stage if replica == 0 else self.layout.pp - 1 - stage

    @property
    def widths(self) -> tuple[int, ...]:
        """Ranks of every pipeline position: the larger of its two stages' grids."""
        lay = self.layout
        return tuple(max(lay.stage_size(p), lay.stage_size(lay.pp - 1 - p)) for p in range(lay.pp))

    @property
    def replica_size(self) -> int:
        """Ranks of one data replica (both mirrored replicas)."""
        return sum(self.widths)

    @property
    def world_size(self) -> int:
        """Ranks the placement needs: ``dp x`` the sum of the positions' widths."""
        return self.layout.dp * self.replica_size

    def rank_of(self, dp: int, slot: MirrorSlot) -> int:
        """The global rank holding ``slot`` of data replica ``dp``."""
        p = self.position(slot.replica, slot.stage)
        return dp * self.replica_size + sum(self.widths[:p]) + slot.tile

    def slots(self, rank: int) -> tuple[int, int, tuple[MirrorSlot, ...]]:
        """``(data replica, position, slots held)`` of a global rank: A's first, then B's."""
        lay = self.layout
        dp, rest = divmod(rank, self.replica_size)
        if dp >= lay.dp:
            raise ValueError(f"rank {rank} is outside {self.world_size} ranks")
        for p, width in enumerate(self.widths):
            if rest < width:
                held = [MirrorSlot(0, p, rest), MirrorSlot(1, lay.pp - 1 - p, rest)]
                return dp, p, tuple(s for s in held if s.tile < lay.stage_size(s.stage))
            rest -= width
        raise AssertionError("unreachable: widths sum to replica_size")

    def orders(self, microbatches: int) -> list[list[ScheduleAction]]:
        """Every rank's actions (one data replica, ranks in order): its position's GEMS order
        (each replica ``microbatches / 2``) kept to the stages the rank holds. All tiles of a
        stage run its actions in one relative order, so halo exchanges and the stage's
        collectives stay matched."""
        per_position = schedule_actions("bidirectional", self.layout.pp, microbatches)
        out = []
        for rank in range(self.replica_size):
            _, p, held = self.slots(rank)
            mine = {(s.replica, s.stage) for s in held}
            out.append([a for a in per_position[p] if (a[0], a[1]) in mine])
        return out

    def replica_ranks(self, replica: int) -> tuple[int, ...]:
        """The global rank of every rank of :attr:`layout` as replica ``replica`` (0: A, 1: B)
        places it: ``layout`` rank ``r`` of stage ``s``, tile ``t`` -> the rank holding it."""
        lay = self.layout
        out = []
        for r in range(lay.world_size):
            dp, stage, *tile = lay.coords(r)
            index = 0
            for t, n in zip(tile, lay.grid_of(stage), strict=True):
                index = index * n + t
            out.append(self.rank_of(dp, MirrorSlot(replica, stage, index)))
        return tuple(out)

    def mirror_pairs(self) -> list[tuple[int, int]]:
        """Every pair of mirror ranks (position ``p`` and ``P - 1 - p``, the same tile), in one
        order for every rank: the groups over which a stage's two copies are summed."""
        lay, pairs = self.layout, []
        for dp in range(lay.dp):
            base = dp * self.replica_size
            for p in range(lay.pp // 2):
                q = lay.pp - 1 - p
                for i in range(self.widths[p]):
                    pairs.append((base + sum(self.widths[:p]) + i, base + sum(self.widths[:q]) + i))
        return pairs

    def check_world(self, world_size: int) -> None:
        """ConfigError (one line, no compute) unless the job has the ranks the placement needs."""
        if world_size != self.world_size:
            widths = "+".join(map(str, self.widths))
            raise ConfigError(
                "layout",
                f"{self.layout.describe()} with two mirrored replicas needs {self.world_size} "
                f"ranks (dp {self.layout.dp} x positions {widths}) but the job has {world_size}",
                launch_with(self.world_size),
            )

    def check(self, world_size: int, *, microbatches: int) -> None:
        """ConfigError (one line, no compute) unless the job and micro-batches fit."""
        check_schedule("bidirectional", self.layout, microbatches)
        self.check_world(world_size)


class MirroredJunctionSchedule:
    """One step of two mirrored replicas on per-stage grids, on this rank (GEMS + the junction).

    ``schedules``: the :class:`JunctionSchedule` of each replica this rank holds a stage of
    (0: A, 1: B), each over its replica's group and built for half the micro-batches;
    ``actions`` this rank's part of its position's GEMS order
    (:meth:`MirroredPlacement.orders`); ``mirror`` the group of this rank and its mirror
    (position ``P - 1 - p``, the same tile). ``step`` as
    :class:`~.schedules.BidirectionalSchedule`'s: A takes the first half of the micro-batches,
    B the second; it returns the whole per-replica batch's outputs on the ranks holding a last
    stage, completes the input's gradient on the ranks holding a first stage, and leaves in
    ``.grad`` of both copies of every stage the whole batch's gradient (summed over the
    mirror pair). Without a loss (evaluation) replica A runs every micro-batch alone.
    """

    def __init__(
        self,
        schedules: dict[int, JunctionSchedule],
        actions: Sequence[ScheduleAction],
        microbatches: int,
        mirror: Any,
    ) -> None:
        self.schedules, self.actions = schedules, list(actions)
        self.m, self.mirror = microbatches, mirror
        self.train = any(s.loss_fn is not None for s in schedules.values())

    def step(
        self, *args: Tensor, target: Tensor | None = None, losses: list[Tensor] | None = None
    ) -> Tensor | None:
        x = args[0] if args else None
        if not self.train:
            a = self.schedules.get(0)
            return None if a is None else a.step(*(args if a.is_first else ()))
        half = self.m // 2
        terms: dict[int, list[Tensor]] = {0: [], 1: []}
        for rep, sched in self.schedules.items():
            mine = slice(rep * half, (rep + 1) * half)
            chunks = list(x.tensor_split(self.m))[mine] if sched.is_first and x is not None else []
            parts = (
                list(target.tensor_split(self.m))[mine]
                if sched.is_last and target is not None
                else []
            )
            sched.begin(chunks, parts, terms[rep])
        b = self.schedules.get(1)
        if b is not None:
            for p in b.module.parameters():  # the A copy keeps what earlier steps accumulated
                p.grad = None
        before = None if x is None or x.grad is None else x.grad.detach().clone()
        for rep, _, kind, i in self.actions:
            sched = self.schedules[rep]
            if kind == "F":
                sched.forward(i)
            else:
                sched.backward(i, last=i == half - 1)
        outs = {rep: sched.finish() for rep, sched in self.schedules.items()}
        add_mirror_grads([(s.stage, s.module) for s in self.schedules.values()], self.mirror)
        if losses is not None:
            losses.clear()
            losses.extend([*terms[0], *terms[1]])
        if x is not None:
            mirror_input_grad(x, before, self.mirror)
        last = [(rep, out) for rep, out in outs.items() if out is not None]
        if not last:
            return None
        rep, mine_out = last[0]
        assert isinstance(mine_out, Tensor)
        return mirror_outputs(mine_out, rep, self.mirror)


def mirrored_context(
    context: Callable[[DeviceMesh, dict[str, Any], DeviceMesh | None], ParallelContext],
    placement: MirroredPlacement,
    device: torch.device,
) -> ParallelContext:
    """A rank's context under two mirrored replicas on per-stage grids: its view of each
    replica it holds a stage of (that replica's layout ranks mapped to the placement's global
    ranks, its meshes and groups), and the groups of the pair (``mirror``) and of the data
    replica (``placement``). Every rank builds every group in one order (collective)."""
    layout, rank = placement.layout, dist.get_rank()
    views: dict[int, ParallelContext] = {}
    for replica in (0, 1):
        ranks = placement.replica_ranks(replica)
        mine = ranks.index(rank) if rank in ranks else None
        view = context(*junction_meshes(layout, device, mine, ranks))
        if mine is not None:
            views[replica] = dataclasses.replace(view, ranks=ranks)
    extra: dict[str, Any] = {}
    for pair in placement.mirror_pairs():
        group = dist.new_group(ranks=sorted(pair))
        if rank in pair:
            extra["mirror"] = group
    size = placement.replica_size
    for dp in range(layout.dp):
        members = list(range(dp * size, (dp + 1) * size))
        group = dist.new_group(ranks=members)
        if rank in members:
            extra["placement"] = group
    for view in views.values():
        view.groups.update(extra)
    # The view holding the input (a first stage), else A's, speaks for the rank.
    primary = next((v for v in views.values() if v.coords[1] == 0), next(iter(views.values())))
    return dataclasses.replace(primary, slots=views)
