"""All-reduces for spatial layers, as autograd functions where the backward matters.

Plus :func:`group_device` and :func:`all_agree`: a tensor handed to a
collective must live on the device type of the group's backend (NCCL takes
CUDA tensors only), so control-flow decisions made on the host go through them.

Which backward is right depends on who uses the reduced value:

* :func:`all_reduce_sum` — a plain sum for code with its own backward
  (BatchNorm's statistics: every rank normalises *its own* tile with the global
  mean, so its backward all-reduces the gradient sums itself, see
  ``spatial._GlobalBatchNorm``).
* :func:`all_reduce_max_replicated` — global max pooling: the gradient goes only
  to the rank(s) whose local maximum is the global one.
* :func:`all_reduce_replicated` — global average pooling. Everything after
  the pool (the head, the loss) is computed identically on every rank, so each
  rank already holds the **whole** gradient; summing again would multiply it
  by the number of tiles (the double count REFERENCE.md warns about).
* :func:`gather_replicated` — the whole (small) map from every rank's tile, for
  a head that flattens it (CosmoFlow): the same rule, each rank's tile gradient
  is its slice of the whole gradient every rank holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hyfi_imaging.parallel.first_order import first_order
from hyfi_imaging.parallel.halo import trailing

__all__ = [
    "all_agree",
    "all_gather_grid",
    "gather_replicated",
    "all_reduce_max_replicated",
    "all_reduce_replicated",
    "all_reduce_sum",
    "group_device",
]


def group_device(group: Any = None) -> torch.device:
    """The device a tensor must be on for a collective of ``group`` (default: the world)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_agree(ok: bool, group: Any = None) -> bool:
    """True on every rank of ``group`` if ``ok`` is true on all of them (one process: ``ok``)."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=group_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum of ``t`` over ``group`` as a new tensor (no autograd)."""
    out = t.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


class _AllReduceReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, partial: bool) -> torch.Tensor:
        ctx.group, ctx.partial = group, partial
        return all_reduce_sum(x, group)

    @staticmethod
    @first_order("a global pool's all-reduce")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (all_reduce_sum(grad, ctx.group) if ctx.partial else grad), None, None


def all_reduce_replicated(x: torch.Tensor, group: Any, *, partial: bool = False) -> torch.Tensor:
    """Sum over ``group``. Backward passes the gradient through when every rank holds it
    whole (the head after the final pool); with ``partial`` (the pooled value is used
    again on each tile, as squeeze-excite does) each rank holds its tile's share and
    the shares are summed first.
    """
    return _AllReduceReplicated.apply(x, group, partial)


class _AllReduceMaxReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, partial: bool) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
        ctx.save_for_backward(x == out)
        ctx.group, ctx.partial = group, partial
        return out

    @staticmethod
    @first_order("a global max pool's all-reduce")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (winner,) = ctx.saved_tensors
        if ctx.partial:
            grad = all_reduce_sum(grad, ctx.group)
        return grad * winner, None, None


def all_reduce_max_replicated(
    x: torch.Tensor, group: Any, *, partial: bool = False
) -> torch.Tensor:
    """Maximum over ``group``; backward routes the gradient to the rank holding it.

    ``partial`` as in :func:`all_reduce_replicated`. If two tiles hold exactly
    the same maximum both receive the gradient, where one process would pick
    one; with real-valued activations this does not happen.
    """
    return _AllReduceMaxReplicated.apply(x, group, partial)


def all_gather_grid(tile: torch.Tensor, grid: Sequence[int], group: Any) -> torch.Tensor:
    """Every rank's tile (same shape everywhere, row-major ranks of ``grid``) stitched into
    the padded whole along the last ``len(grid)`` dims, on every rank (no autograd)."""
    tile = tile.contiguous()
    parts = [torch.empty_like(tile) for _ in range(math.prod(grid))]
    dist.all_gather(parts, tile, group=group)
    nd = len(grid)
    # Join along the last axis first, then each outer axis in turn.
    for k in reversed(range(nd)):
        g = grid[k]
        parts = [torch.cat(parts[r * g : (r + 1) * g], dim=k - nd) for r in range(len(parts) // g)]
    return parts[0]


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        grid: tuple[int, ...],
        tile: tuple[int, ...],
        size: tuple[int, ...],
        group: Any,
        partial: bool,
    ) -> torch.Tensor:
        ctx.grid, ctx.tile, ctx.group, ctx.partial = grid, tile, group, partial
        ctx.shape = tuple(x.shape)
        whole = all_gather_grid(x, grid, group)
        return whole[trailing([slice(0, n) for n in size])].contiguous()

    @staticmethod
    @first_order("a flattened map's gather")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.partial:
            grad = all_reduce_sum(grad, ctx.group)
        nd = len(ctx.grid)
        out = grad.new_zeros(ctx.shape)
        src, dst = [], []
        for k, i in enumerate(ctx.tile):
            t = ctx.shape[k - nd]
            n = max(0, min(t, grad.shape[k - nd] - i * t))
            src.append(slice(i * t, i * t + n))
            dst.append(slice(0, n))
        out[trailing(dst)] = grad[trailing(src)]
        return out, None, None, None, None, None


def gather_replicated(
    x: torch.Tensor,
    grid: tuple[int, ...],
    tile: tuple[int, ...],
    size: tuple[int, ...],
    group: Any,
    *,
    partial: bool = False,
) -> torch.Tensor:
    """The whole map (true ``size``, padding cut off) from every rank's tile, on every rank.

    Backward as :func:`all_reduce_replicated`: the head after it is replicated,
    so a rank's tile gradient is its slice of the whole gradient (summed over
    the group first when ``partial``: the map is used again on the tiles).
    """
    return _GatherReplicated.apply(x, tuple(grid), tuple(tile), tuple(size), group, partial)
