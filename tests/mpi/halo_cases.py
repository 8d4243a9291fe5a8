"""Halo exchange cases, run on every rank of one tile grid (``mpiexec -n N``).

Why these three checks: the exchange is linear (with fill 0), so its backward
must be its exact adjoint — ``<F x, y> = <x, F* y>`` summed over all ranks
catches a halo gradient that is dropped, doubled or sent to the wrong owner,
which no single-rank test can see. The global-index test checks the forward
bit for bit, corners and the fill outside the image included. ``gradcheck``
compares the backward with finite differences of the *global* function (the
input replicated, the outputs all-gathered) so that every rank's perturbation
is the same.

Usage: ``mpiexec -n 4 python tests/mpi/halo_cases.py 2x2`` prints one JSON line.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _worker import Case, emit, merge_ranks, parse_grid, run_cases, start
from broken_halo import dropped_halo_gradients

__all__ = ["ADJOINT", "FILL", "GRADCHECK", "case_names", "cases", "main"]

Halo = tuple[int, int, int, int]

#: (name, tile (h, w), halo (top, bottom, left, right)); halos never wider than a tile.
ADJOINT: list[tuple[str, tuple[int, int], Halo]] = [
    ("sym1", (4, 5), (1, 1, 1, 1)),
    ("sym2", (4, 5), (2, 2, 2, 2)),
    ("asym-2-1-0-3", (4, 5), (2, 1, 0, 3)),
    ("bottom-only", (4, 5), (0, 2, 0, 0)),
    ("right-only", (4, 5), (0, 0, 0, 1)),
    ("top-left", (4, 5), (3, 0, 1, 0)),
    ("none", (4, 5), (0, 0, 0, 0)),
    ("whole-tile", (4, 5), (4, 4, 5, 5)),
    ("one-row-tile", (1, 3), (1, 1, 3, 2)),
    ("channels-last", (4, 5), (2, 1, 0, 3)),
]
#: Fill values for the global-index test, with the halos of :data:`ADJOINT`.
FILL: list[float] = [0.0, -1.0, -math.inf]
#: Halos gradchecked on 2-rank grids: (tile (h, w), halo).
GRADCHECK: list[tuple[str, tuple[int, int], Halo]] = [
    ("asym-2-1-0-3", (3, 4), (2, 1, 0, 3)),
    ("sym1", (3, 4), (1, 1, 1, 1)),
]


def _neighbours(pc: Any) -> Any:
    from hyfi_imaging.parallel.halo import Neighbours

    return Neighbours(
        up=pc.peer(dy=-1), down=pc.peer(dy=1), left=pc.peer(dx=-1), right=pc.peer(dx=1)
    )


def _adjoint(pc: Any, tile: tuple[int, int], halo: Halo, channels_last: bool) -> Case:
    """``sum_r <F x, y>_r == sum_r <x, F* y>_r`` in float64, random data per rank."""
    from hyfi_imaging.parallel.halo import halo_exchange

    gen = torch.Generator().manual_seed(1000 + pc.rank)
    top, bottom, left, right = halo
    x = torch.randn(2, 3, *tile, generator=gen, dtype=torch.float64)
    y = torch.randn(
        2, 3, tile[0] + top + bottom, tile[1] + left + right, generator=gen, dtype=torch.float64
    )
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        y = y.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    fx = halo_exchange(x, halo, _neighbours(pc), fill=0.0)
    if fx.shape != y.shape:
        return {"ok": False, "max_rel": math.inf, "detail": f"output shape {tuple(fx.shape)}"}
    (fty,) = torch.autograd.grad(fx, x, y)
    terms = torch.stack(
        [(fx.detach() * y).sum(), (x.detach() * fty).sum(), (fx.detach().abs() * y.abs()).sum()]
    )
    dist.all_reduce(terms, group=pc.group("sp"))
    lhs, rhs, scale = (float(t) for t in terms)
    rel = abs(lhs - rhs) / scale
    return {"ok": rel < 1e-13, "max_rel": rel, "detail": f"<Fx,y>={lhs:.17g} <x,F*y>={rhs:.17g}"}


def _strips_adjoint(pc: Any, tile: tuple[int, int], halo: Halo, channels_last: bool) -> Case:
    """The same for the strips alone (``exchange_strips``) and their adjoint
    (``return_strip_grads``), what layers computed on the tile itself use."""
    from hyfi_imaging.parallel.halo import exchange_strips, return_strip_grads

    gen = torch.Generator().manual_seed(2000 + pc.rank)
    x = torch.randn(2, 3, *tile, generator=gen, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    nb = _neighbours(pc)
    strips = exchange_strips(x, halo, nb, fill=0.0)
    ys = [
        None if s is None else torch.randn(s.shape, generator=gen, dtype=torch.float64)
        for s in strips
    ]
    fty = return_strip_grads(
        torch.zeros_like(x), [None if y is None else y.clone() for y in ys], halo, nb
    )
    pairs = [(s, y) for s, y in zip(strips, ys, strict=True) if s is not None and y is not None]
    terms = torch.stack(
        [
            sum(((s * y).sum() for s, y in pairs), torch.zeros((), dtype=torch.float64)),
            (x * fty).sum(),
            sum(((s.abs() * y.abs()).sum() for s, y in pairs), torch.ones((), dtype=torch.float64)),
        ]
    )
    dist.all_reduce(terms, group=pc.group("sp"))
    lhs, rhs, scale = (float(t) for t in terms)
    rel = abs(lhs - rhs) / scale
    return {"ok": rel < 1e-13, "max_rel": rel, "detail": f"<Fx,y>={lhs:.17g} <x,F*y>={rhs:.17g}"}


def _global_index(pc: Any, tile: tuple[int, int], halo: Halo, fill: float) -> Case:
    """Each owned cell holds its global index; every ghost must hold its owner's (or ``fill``)."""
    from hyfi_imaging.parallel.halo import halo_exchange

    (gy, gx), (ty, tx) = pc.layout.sp, pc.tile
    th, tw = tile
    n, c, hg, wg = 2, 3, gy * th, gx * tw
    index = torch.arange(n * c * hg * wg, dtype=torch.float64).view(n, c, hg, wg)
    x = index[..., ty * th : (ty + 1) * th, tx * tw : (tx + 1) * tw].clone()
    top, bottom, left, right = halo
    out = halo_exchange(x, halo, _neighbours(pc), fill=fill)
    want = torch.full((n, c, th + top + bottom, tw + left + right), fill, dtype=torch.float64)
    r0, c0 = ty * th - top, tx * tw - left  # global position of the padded tile's first cell
    rs, re = max(r0, 0), min(r0 + want.shape[-2], hg)
    cs, ce = max(c0, 0), min(c0 + want.shape[-1], wg)
    want[..., rs - r0 : re - r0, cs - c0 : ce - c0] = index[..., rs:re, cs:ce]
    same = out.shape == want.shape and bool(torch.equal(out, want))
    wrong = 0 if same or out.shape != want.shape else int((out != want).sum())
    return {"ok": same, "max_rel": 0.0 if same else math.inf, "detail": f"{wrong} cells wrong"}


class _Replicate(torch.autograd.Function):
    """Identity forward; backward sums over ranks (the input is replicated on all)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherReplicated(torch.autograd.Function):
    """All-gather into a stacked tensor (replicated); backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad[ctx.rank].clone(), None


def _gradcheck(pc: Any, tile: tuple[int, int], halo: Halo) -> Case:
    """``torch.autograd.gradcheck`` of image -> tiles -> exchange -> all tiles, float64."""
    from hyfi_imaging.parallel.halo import halo_exchange

    (gy, gx), (ty, tx) = pc.layout.sp, pc.tile
    th, tw = tile
    group, nb = pc.group("sp"), _neighbours(pc)
    gen = torch.Generator().manual_seed(7)  # the same image on every rank
    image = torch.randn(1, 2, gy * th, gx * tw, generator=gen, dtype=torch.float64)

    def fn(img: torch.Tensor) -> torch.Tensor:
        mine = _Replicate.apply(img, group)[..., ty * th : (ty + 1) * th, tx * tw : (tx + 1) * tw]
        return _GatherReplicated.apply(halo_exchange(mine, halo, nb), group)

    ok = torch.autograd.gradcheck(fn, (image.requires_grad_(True),), eps=1e-6, atol=1e-9, rtol=1e-7)
    return {"ok": bool(ok), "max_rel": 0.0, "detail": "gradcheck"}


def _sabotaged(fn: Callable[[], Case]) -> Case:
    """Run ``fn`` with the exchange's backward dropping the halo gradients.

    Proves the adjoint test has teeth: dropping the halo gradients must fail it.
    """
    with dropped_halo_gradients():
        return fn()


def cases(pc: Any) -> dict[str, Callable[[], Case]]:
    """Every halo case for this grid, keyed by the name the test expects."""
    out: dict[str, Callable[[], Case]] = {}
    for name, tile, halo in ADJOINT:
        last = name == "channels-last"
        out[f"adjoint/{name}"] = lambda t=tile, h=halo, cl=last: _adjoint(pc, t, h, cl)
        out[f"sabotaged/adjoint/{name}"] = lambda t=tile, h=halo, cl=last: _sabotaged(
            lambda: _adjoint(pc, t, h, cl)
        )
        out[f"adjoint/strips:{name}"] = lambda t=tile, h=halo, cl=last: _strips_adjoint(
            pc, t, h, cl
        )
        out[f"sabotaged/adjoint/strips:{name}"] = lambda t=tile, h=halo, cl=last: _sabotaged(
            lambda: _strips_adjoint(pc, t, h, cl)
        )
        if not last:
            for fill in FILL:
                out[f"index/{name}/fill={fill}"] = lambda t=tile, h=halo, f=fill: _global_index(
                    pc, t, h, f
                )
    if pc.world_size == 2:
        for name, tile, halo in GRADCHECK:
            out[f"gradcheck/{name}"] = lambda t=tile, h=halo: _gradcheck(pc, t, h)
    return out


def case_names(grid: tuple[int, int]) -> list[str]:
    """Names :func:`cases` produces for ``grid`` (for pytest, without processes)."""
    names = []
    for name, _, _ in ADJOINT:
        names += [f"adjoint/{name}", f"sabotaged/adjoint/{name}"]
        names += [f"adjoint/strips:{name}", f"sabotaged/adjoint/strips:{name}"]
        if name != "channels-last":
            names += [f"index/{name}/fill={fill}" for fill in FILL]
    if grid[0] * grid[1] == 2:
        names += [f"gradcheck/{name}" for name, _, _ in GRADCHECK]
    return names


def main(argv: list[str]) -> None:
    pc = start(parse_grid(argv[0]))
    emit({"grid": argv[0], "cases": merge_ranks(run_cases(cases(pc)))})


if __name__ == "__main__":
    main(sys.argv[1:])
