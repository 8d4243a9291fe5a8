"""Halo exchange between neighbouring tiles, as an autograd function.

Forward: each rank surrounds its tile with ``(top, bottom, left, right)`` rows
and columns received from its neighbours; past the image border it uses a
fill value (0 before a convolution, -inf before a max-pool). Corners come for
free by exchanging rows first and then columns *of the row-extended tile*.

Backward is the adjoint, not a copy of the forward: the gradient that lands
on a halo belongs to the neighbour that owns those pixels, so it is sent back
and **added** into the owner's border (REFERENCE.md: dropping it is the classic
bug). Fill regions get no gradient. All messages of a phase go out together
with ``batch_isend_irecv``; no barrier, no global synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Neighbours", "halo_exchange"]


@dataclass(frozen=True)
class Neighbours:
    """Global ranks of the four edge neighbours of a tile (None past the grid's edge)."""

    up: int | None = None
    down: int | None = None
    left: int | None = None
    right: int | None = None

    @property
    def alone(self) -> bool:
        return self.up is None and self.down is None and self.left is None and self.right is None


def _exchange(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for peer, t in sends]
    for _, t in recvs:
        assert t.is_contiguous(), "receive buffers must be contiguous"
    ops += [dist.P2POp(dist.irecv, t, peer) for peer, t in recvs]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _buffer(like: torch.Tensor) -> torch.Tensor:
    """A receive buffer in standard contiguous layout.

    Never ``empty_like``: it keeps a channels-last layout (which oneDNN
    convolutions produce), and the bytes received are in standard order.
    """
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def _extend(
    x: torch.Tensor, before: int, after: int, lo: int | None, hi: int | None, dim: int, fill: float
) -> torch.Tensor:
    """Grow ``x`` along ``dim`` by ``before``/``after`` slices from peers ``lo``/``hi`` (or ``fill``)."""
    if before == 0 and after == 0:
        return x
    shape = list(x.shape)
    shape[dim] = before
    head = torch.full(shape, fill, dtype=x.dtype, device=x.device)
    shape[dim] = after
    tail = torch.full(shape, fill, dtype=x.dtype, device=x.device)
    n = x.shape[dim]
    sends, recvs = [], []
    if lo is not None:
        if after:
            sends.append((lo, x.narrow(dim, 0, after)))  # my first rows are lo's `after` halo
        if before:
            recvs.append((lo, head))
    if hi is not None:
        if before:
            sends.append((hi, x.narrow(dim, n - before, before)))
        if after:
            recvs.append((hi, tail))
    _exchange(sends, recvs)
    return torch.cat([head, x, tail], dim=dim)


def _reduce(
    g: torch.Tensor, before: int, after: int, lo: int | None, hi: int | None, dim: int
) -> torch.Tensor:
    """Adjoint of :func:`_extend`: send halo gradients to their owners, add what comes back."""
    if before == 0 and after == 0:
        return g
    n = g.shape[dim] - before - after
    core = g.narrow(dim, before, n).clone()
    sends, recvs = [], []
    from_lo = from_hi = None
    if lo is not None:
        if before:
            sends.append((lo, g.narrow(dim, 0, before)))
        if after:
            from_lo = _buffer(core.narrow(dim, 0, after))
            recvs.append((lo, from_lo))
    if hi is not None:
        if after:
            sends.append((hi, g.narrow(dim, before + n, after)))
        if before:
            from_hi = _buffer(core.narrow(dim, n - before, before))
            recvs.append((hi, from_hi))
    _exchange(sends, recvs)
    if from_lo is not None:
        core.narrow(dim, 0, after).add_(from_lo)
    if from_hi is not None:
        core.narrow(dim, n - before, before).add_(from_hi)
    return core


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, halo: tuple[int, int, int, int], fill: float, nb: Neighbours
    ) -> torch.Tensor:
        top, bottom, left, right = halo
        ctx.halo, ctx.nb = halo, nb
        rows = _extend(x, top, bottom, nb.up, nb.down, x.dim() - 2, fill)
        return _extend(rows, left, right, nb.left, nb.right, x.dim() - 1, fill)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        top, bottom, left, right = ctx.halo
        nb: Neighbours = ctx.nb
        g = _reduce(grad.contiguous(), left, right, nb.left, nb.right, grad.dim() - 1)
        g = _reduce(g, top, bottom, nb.up, nb.down, grad.dim() - 2)
        return g, None, None, None


def halo_exchange(
    x: torch.Tensor, halo: tuple[int, int, int, int], neighbours: Neighbours, *, fill: float = 0.0
) -> torch.Tensor:
    """Return ``x`` (..., h, w) surrounded by its ``(top, bottom, left, right)`` halo.

    Every halo must be no wider than the neighbouring tile (the caller checks);
    all ranks of the grid must call this with the same ``halo``.
    """
    if any(v < 0 for v in halo):
        raise ValueError(f"halo sizes must be >= 0, got {halo}")
    return _HaloExchange.apply(x, halo, fill, neighbours)
