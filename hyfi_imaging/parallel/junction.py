"""Per-stage tile grids and the junction between them (Hy-Fi's "SP + LP").

Only the first, activation-heavy pipeline stages need tiles: a layout may give
every stage its own grid (``2x2 -> 1x2 -> 1x1``), and activations are
re-partitioned exactly where the grid changes -- MPI4DL's *junction*, where
the tiles of a spatial stage are stitched into the next stage's feature map.

Why re-partitioning is exact and needs no new padding rule. Every stage
spatializes the *whole* model for its own grid (its own global padding,
``geometry.padded_hw`` with the model's total stride), so at a stage cut each
grid holds equal tiles of the same true feature map, aligned to the same
origin, with a tail past the true size that the next layer masks anyway. A
piece is the intersection of a sending tile, a receiving tile and the true
map (:func:`pieces`): every valid pixel travels exactly once, the receiver's
tail is zero, and in backward each piece's gradient goes back to the one tile
that sent it (the pieces are disjoint, so nothing is summed). Every tensor
crossing the cut is handled alike, so AmoebaNet's ``(current, previous)``
pair, at different resolutions after a reduction cell, crosses as two sets of
pieces.

Why not ``torch.distributed.pipelining`` here (it still runs every layout
whose stages share one grid). A ``PipelineStage`` maps each stage index to
*one* peer rank of its group (``stage_index_to_group_rank``; the group may
have no more ranks than stages) and sends its whole output there, while a
junction is a many-to-many exchange of pieces (4 tiles -> 1 rank, 2x2 -> 1x2),
and the ``pp`` mesh axis, a rectangle, cannot hold stages of unequal sizes.
Teaching ``PipelineStage`` the pieces means overriding eight private methods
(its warm-up vote, P2P op builders and receive-buffer retrieval). Instead
:class:`JunctionSchedule` runs the same action orders
(:func:`~.pipeline.schedule_order`: GPipe and 1F1B) with the same loss and
gradient semantics (a loss per micro-batch, ``scale_grads=False``, FSDP2
gradient sync only in the last backward) and exchanges the pieces with
non-blocking point-to-point messages over the replica's group.

Groups come from meshes (:func:`junction_meshes`), built from
:meth:`~.layout.Layout.rank_of` alone: the world as ``(dp, replica)``, and per
stage ``(dp, sp)`` and a flat ``shard`` mesh for FSDP2 over that stage's own
ranks (so the gradient rule -- sum over tiles, mean over dp -- holds per stage).

Two mirrored replicas of per-stage grids (GEMS, ``--schedule bidirectional``): :mod:`.mirrored`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.layout import Grid, Layout
from hyfi_imaging.parallel.pipeline import as_tuple, schedule_order, stage_boundaries

__all__ = [
    "JunctionSchedule",
    "Piece",
    "check_junction_model",
    "check_junction_plan",
    "junction_meshes",
    "pieces",
]


def check_junction_plan(layout: Layout, schedule: str) -> None:
    """ConfigError (no compute) for what per-stage grids do not combine with."""
    if not layout.junction:
        return
    if schedule not in ("gpipe", "1f1b", "bidirectional"):
        raise ConfigError(
            f"--schedule {schedule} with --spatial {_grids_text(layout)}",
            "per-stage grids (the junction) run the gpipe, 1f1b and bidirectional schedules only",
            "use --schedule gpipe, 1f1b or bidirectional, or one grid for every stage",
        )


def check_junction_model(layout: Layout, whole: Sequence[int], half: Sequence[int]) -> None:
    """ConfigError unless the model's output is pooled (the same shape for the whole image and
    for half of it): a dense output map would be tiled on the last stage's grid, not yet supported."""
    if layout.junction and len(whole) >= 3 and tuple(whole[-2:]) != tuple(half[-2:]):
        raise ConfigError(
            f"--spatial {_grids_text(layout)}",
            "per-stage grids support models with a pooled output (classifiers); this model "
            f"returns a {whole[-2]}x{whole[-1]} map",
            "use one grid for every stage for dense models",
        )


def _grids_text(layout: Layout) -> str:
    return ",".join(f"{gy}x{gx}" for gy, gx in (layout.grid_of(s) for s in range(layout.pp)))


# ----------------------------------------------------------------------------- meshes


def _stage_ranks(layout: Layout, stage: int, ranks: Sequence[int] | None = None) -> Tensor:
    """Global ranks of stage ``stage``: ``(dp, tiles)``, tiles row-major (``ranks``: the global
    rank of every layout rank, where they differ)."""
    gy, gx = layout.grid_of(stage)

    def glob(r: int) -> int:
        return r if ranks is None else ranks[r]

    return torch.tensor(
        [
            [glob(layout.rank_of(d, stage, i, j)) for i in range(gy) for j in range(gx)]
            for d in range(layout.dp)
        ]
    )


def junction_meshes(
    layout: Layout,
    device: torch.device,
    rank: int | None,
    ranks: Sequence[int] | None = None,
) -> tuple[DeviceMesh, dict[str, Any], DeviceMesh | None]:
    """The meshes of a layout with per-stage grids: ``(world mesh, groups, shard mesh)``.

    The world is the mesh ``(dp, replica)`` (its ``dp`` axis joins the same
    stage and tile of every replica; ``replica`` holds one replica's stages, over
    which the junction's messages go). Every stage gets a ``(dp, sp)`` mesh and,
    when it has more than one rank, a flat ``shard`` mesh for FSDP2. Every rank
    builds every mesh in the same order (building a group is collective) and
    keeps its own stage's groups: ``dp``, ``sp``, ``replica``, ``shard``.

    ``rank`` is this rank's number in ``layout`` (None: it holds no rank of it); ``ranks``
    the global rank of every layout rank where they differ (a mirrored replica's placement).
    """
    world = torch.cat([_stage_ranks(layout, s, ranks) for s in range(layout.pp)], dim=1)
    mesh = DeviceMesh(device.type, world, mesh_dim_names=("dp", "replica"))
    groups: dict[str, Any] = {}
    if rank is not None:
        groups = {"dp": mesh.get_group("dp"), "replica": mesh.get_group("replica")}
    shard_mesh: DeviceMesh | None = None
    mine = None if rank is None else layout.coords(rank)[1]
    for stage in range(layout.pp):
        stage_ranks = _stage_ranks(layout, stage, ranks)
        stage_mesh = DeviceMesh(device.type, stage_ranks, mesh_dim_names=("dp", "sp"))
        flat = None
        if stage_ranks.numel() > 1:
            flat = DeviceMesh(device.type, stage_ranks.reshape(-1), mesh_dim_names=("shard",))
        if stage == mine:
            groups["sp"] = stage_mesh.get_group("sp")
            if flat is not None:
                shard_mesh = flat
                groups["shard"] = flat.get_group()
    return mesh, groups, shard_mesh


# ----------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class Piece:
    """The part of one tensor that tile ``src`` of the sending grid gives tile ``dst`` of the
    receiving grid: rows and columns in the sender's tile and in the receiver's."""

    src: Grid
    dst: Grid
    src_box: tuple[slice, slice]
    dst_box: tuple[slice, slice]

    @property
    def hw(self) -> tuple[int, int]:
        r, c = self.src_box
        return r.stop - r.start, c.stop - c.start


def _spans(n: int, src: tuple[int, int], dst: tuple[int, int]) -> list[tuple[int, int, int, int]]:
    """Along one axis of length ``n``: ``(src index, dst index, lo, hi)`` of every overlap of a
    sending tile (``src`` = (tiles, size)) and a receiving one, within ``[0, n)``."""
    (gs, ts), (gd, td) = src, dst
    out = []
    for i in range(gs):
        for p in range(gd):
            lo, hi = max(i * ts, p * td), min((i + 1) * ts, (p + 1) * td, n)
            if lo < hi:
                out.append((i, p, lo, hi))
    return out


def pieces(
    valid_hw: tuple[int, int],
    src_grid: Grid,
    src_tile: tuple[int, int],
    dst_grid: Grid,
    dst_tile: tuple[int, int],
) -> list[Piece]:
    """Every piece of a ``valid_hw`` map held as ``src_grid`` tiles of ``src_tile`` that
    ``dst_grid`` tiles of ``dst_tile`` need (pure; tiles start at multiples of their size).

    OK: ``pieces((5, 6), (2, 2), (3, 3), (1, 1), (5, 6))`` -> four pieces, 3x3, 3x3, 2x3, 2x3.
    """
    for a in range(2):
        if src_grid[a] * src_tile[a] < valid_hw[a] or dst_grid[a] * dst_tile[a] < valid_hw[a]:
            raise RuntimeError(
                f"junction: {src_grid} tiles of {src_tile} or {dst_grid} tiles of {dst_tile} "
                f"cannot hold a {valid_hw} map"
            )
    rows = _spans(valid_hw[0], (src_grid[0], src_tile[0]), (dst_grid[0], dst_tile[0]))
    cols = _spans(valid_hw[1], (src_grid[1], src_tile[1]), (dst_grid[1], dst_tile[1]))
    out = []
    for i, p, r0, r1 in rows:
        for j, q, c0, c1 in cols:
            out.append(
                Piece(
                    (i, j),
                    (p, q),
                    (
                        slice(r0 - i * src_tile[0], r1 - i * src_tile[0]),
                        slice(c0 - j * src_tile[1], c1 - j * src_tile[1]),
                    ),
                    (
                        slice(r0 - p * dst_tile[0], r1 - p * dst_tile[0]),
                        slice(c0 - q * dst_tile[1], c1 - q * dst_tile[1]),
                    ),
                )
            )
    return out


@dataclass(frozen=True)
class _Route:
    """One message of one tensor: the peer's global rank and the box in this rank's tensor."""

    tensor: int
    peer: int
    box: tuple[slice, slice]


def _routes(
    layout: Layout,
    dp: int,
    me: tuple[int, int, int],
    cut: int,
    send: bool,
    shapes: tuple[list[tuple[int, ...]], list[tuple[int, ...]], list[tuple[int, ...]]],
    peer_of: Callable[[int], int],
) -> list[_Route]:
    """The messages across cut ``cut`` (between stages ``cut`` and ``cut + 1``) of this rank
    (stage, tile row, tile column), as sender (``send``) or receiver. ``shapes``: the tensors
    crossing the cut on the sender's tile, on the receiver's tile, and for the whole image;
    ``peer_of`` the global rank of a layout rank."""
    src_shapes, dst_shapes, whole = shapes
    src_grid, dst_grid = layout.grid_of(cut), layout.grid_of(cut + 1)
    out = []
    for t, (a, b, w) in enumerate(zip(src_shapes, dst_shapes, whole, strict=True)):
        for pc in pieces(
            (int(w[-2]), int(w[-1])),
            src_grid,
            (int(a[-2]), int(a[-1])),
            dst_grid,
            (int(b[-2]), int(b[-1])),
        ):
            if send and pc.src == me[1:]:
                out.append(_Route(t, peer_of(layout.rank_of(dp, cut + 1, *pc.dst)), pc.src_box))
            elif not send and pc.dst == me[1:]:
                out.append(_Route(t, peer_of(layout.rank_of(dp, cut, *pc.src)), pc.dst_box))
    return out


# ----------------------------------------------------------------------------- schedule


class JunctionSchedule:
    """GPipe / 1F1B for one stage of a layout with per-stage grids; ``step`` as pipelining's.

    ``step(*args, target=..., losses=[...])`` splits the first stage's input
    (and the target) into the micro-batches, runs this stage's actions in the
    schedule's order, receives and sends the junction's pieces, and returns the
    last stage's outputs concatenated (None elsewhere). ``loss_fn`` None: forward only.

    The actions are public (:meth:`begin`, :meth:`forward`, :meth:`backward`,
    :meth:`finish`) so that two mirrored replicas (:class:`MirroredJunctionSchedule`) run
    theirs interleaved on one rank. ``peer_of`` maps a rank of ``layout`` to its global rank.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        layout: Layout,
        coords: tuple[int, ...],
        image_hw: tuple[int, ...],
        tiles: Sequence[tuple[int, ...]],
        meta_model: nn.Module,
        balance: Sequence[int],
        microbatch: int,
        in_chans: int,
        microbatches: int,
        schedule: str,
        loss_fn: Callable[[Tensor, Tensor], Tensor] | None,
        group: Any,
        device: torch.device,
        dtype: torch.dtype,
        peer_of: Callable[[int], int] = int,
    ) -> None:
        dp, stage, sy, sx = coords  # per-stage grids are 2-D (Layout refuses others)
        self.module, self.stage, self.num_stages = module, stage, layout.pp
        self.n_micro, self.loss_fn, self.group = microbatches, loss_fn, group
        self.device, self.dtype = device, dtype
        self.is_first, self.is_last = stage == 0, stage == layout.pp - 1
        me = (stage, sy, sx)

        def bounds(hw: tuple[int, ...]) -> list[list[tuple[int, ...]]]:
            traced = stage_boundaries(meta_model, balance, (microbatch, in_chans, *hw), dtype=dtype)
            return [[tuple(t.shape) for t in entry] for entry in traced]

        whole = bounds(image_hw)
        per_stage = [bounds(hw) for hw in tiles]
        #: Shapes of this stage's inputs (received) and outputs (sent), on its own tile.
        self.in_shapes = per_stage[stage][stage]
        self.out_shapes = per_stage[stage][stage + 1]
        self.recv: list[_Route] = []
        self.send: list[_Route] = []
        if stage > 0:
            cut = stage - 1
            shapes = (per_stage[cut][stage], per_stage[stage][stage], whole[stage])
            self.recv = _routes(layout, dp, me, cut, False, shapes, peer_of)
        if stage < layout.pp - 1:
            shapes = (
                per_stage[stage][stage + 1],
                per_stage[stage + 1][stage + 1],
                whole[stage + 1],
            )
            self.send = _routes(layout, dp, me, stage, True, shapes, peer_of)
        self.order = (
            schedule_order(schedule, layout.pp, microbatches)[stage]
            if loss_fn is not None
            else [("F", k) for k in range(microbatches)]
        )
        self._pending: list[tuple[dist.Work, Tensor]] = []
        # One step's state (:meth:`begin` resets it).
        self._chunks: list[Tensor] = []
        self._targets: list[Tensor] = []
        self._losses: list[Tensor] | None = None
        self._saved: dict[int, tuple[list[Tensor], tuple[Tensor, ...] | Tensor]] = {}
        self._outputs: list[Any] = []
        self._train = False

    # -- messages

    def _tag(self, k: int, backward: bool, t: int) -> int:
        return (2 * k + int(backward)) * 64 + t

    def _post_sends(
        self, routes: list[_Route], tensors: Sequence[Tensor], k: int, backward: bool
    ) -> None:
        # A piece is a copy: drop those already delivered, so that GPipe does not keep a
        # second copy of every sent activation until the end of the step.
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        for r in routes:
            part = tensors[r.tensor].detach()[..., r.box[0], r.box[1]].contiguous()
            work = dist.isend(
                part, dst=r.peer, group=self.group, tag=self._tag(k, backward, r.tensor)
            )
            assert work is not None  # this rank is in the group
            self._pending.append((work, part))

    def _receive(
        self, routes: list[_Route], shapes: list[tuple[int, ...]], k: int, backward: bool
    ) -> list[Tensor]:
        """The tensors of ``shapes``, zero but for the pieces received into them."""
        out = [torch.zeros(s, dtype=self.dtype, device=self.device) for s in shapes]
        works = []
        for r in routes:
            rows, cols = r.box
            shape = (*shapes[r.tensor][:-2], rows.stop - rows.start, cols.stop - cols.start)
            buf = torch.empty(shape, dtype=self.dtype, device=self.device)
            tag = self._tag(k, backward, r.tensor)
            works.append((dist.irecv(buf, src=r.peer, group=self.group, tag=tag), buf, r))
        for work, buf, r in works:
            assert work is not None  # this rank is in the group
            work.wait()
            out[r.tensor][..., r.box[0], r.box[1]] = buf
        return out

    # -- the actions

    def begin(
        self,
        chunks: Sequence[Tensor],
        targets: Sequence[Tensor],
        losses: list[Tensor] | None,
    ) -> None:
        """Start a step: the first stage's micro-batches, the last stage's targets (empty
        elsewhere), and where the losses go."""
        self._train = self.loss_fn is not None
        self._pending = []
        self._chunks, self._targets, self._losses = list(chunks), list(targets), losses
        self._saved, self._outputs = {}, []

    def forward(self, k: int) -> None:
        """Micro-batch ``k``'s forward: receive the pieces, run the stage, send (or the loss)."""
        train = self._train
        if self.is_first:
            inputs = [self._chunks[k]]
        else:
            inputs = self._receive(self.recv, self.in_shapes, k, False)
            for x in inputs:
                x.requires_grad_(train and torch.is_grad_enabled())
        out = self.module(*inputs)
        if self.is_last:
            self._outputs.append(out)
            if train:
                assert self.loss_fn is not None
                loss = self.loss_fn(out, self._targets[k])
                if self._losses is not None:
                    self._losses.append(loss.detach())
                self._saved[k] = (inputs, loss)
        else:
            self._post_sends(self.send, as_tuple(out), k, False)
            if train:
                self._saved[k] = (inputs, as_tuple(out))

    def backward(self, k: int, *, last: bool) -> None:
        """Micro-batch ``k``'s backward (``last``: the step's last one here, where FSDP2
        reduce-scatters): receive the output's gradient pieces, send the input's."""
        inputs, result = self._saved.pop(k)
        _gradient_sync(self.module, last)
        if self.is_last:
            assert isinstance(result, Tensor)
            torch.autograd.backward(result)
        else:
            assert isinstance(result, tuple)
            grads = self._receive(self.send, self.out_shapes, k, True)
            pairs = [(o, g) for o, g in zip(result, grads, strict=True) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if not self.is_first:
            input_grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs]
            self._post_sends(self.recv, input_grads, k, True)

    def finish(self) -> Any:
        """End the step: every message delivered; the last stage's outputs concatenated."""
        # Every message delivered before the step returns (after an error, the peer that
        # waits for one times out with the process group's timeout).
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        outputs, self._outputs, self._chunks, self._targets = self._outputs, [], [], []
        if not self.is_last:
            return None
        if isinstance(outputs[0], Tensor):
            return torch.cat([o.detach() if self._train else o for o in outputs])
        return tuple(torch.cat(parts) for parts in zip(*outputs, strict=True))

    # -- the step

    def step(
        self, *args: Tensor, target: Tensor | None = None, losses: list[Tensor] | None = None
    ) -> Any:
        m = self.n_micro
        chunks = list(args[0].tensor_split(m)) if self.is_first else []
        targets = list(target.tensor_split(m)) if target is not None and self.is_last else []
        self.begin(chunks, targets, losses)
        last_backward = max((k for a, k in self.order if a == "B"), default=-1)
        for action, k in self.order:
            if action == "F":
                self.forward(k)
            else:
                self.backward(k, last=k == last_backward)
        return self.finish()


def _gradient_sync(module: nn.Module, last: bool) -> None:
    """FSDP2 accumulates unsharded gradients over the micro-batches and reduce-scatters them
    in the last backward only (what pipelining asks of it, through public calls)."""
    if isinstance(module, FSDPModule):
        module.set_is_last_backward(last)
        module.set_requires_gradient_sync(last)
