"""Worker: what each rank saves for backward, layer by layer, against one process.

Run under ``mpiexec -n N`` with ``--model NAME --grid GYxGX --image H[xW]``
(a volume model: ``--grid GZxGYxGX --image DxHxW``).
Rank 0 also counts the plain model on the whole image. For every windowed
layer (conv, max-pool, avg-pool) it records the bytes of storages the layer
saved first (``new``), the bytes of its input tile and the bytes of the halo
strips it received -- the limit the memory invariant sets: a windowed layer
keeps no halo-extended copy, only the tile (usually saved already by the layer
before) and the strips. One JSON line on rank 0.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.distributed as dist
from _worker import emit, parse_grid, start

from hyfi_imaging.models import create_model
from hyfi_imaging.parallel.memory import saved_activations
from hyfi_imaging.parallel.spatial import (
    SpatialAvgPool2d,
    SpatialAvgPool3d,
    SpatialConv2d,
    SpatialConv3d,
    SpatialMaxPool2d,
    SpatialMaxPool3d,
)
from hyfi_imaging.parallel.verify import pad_image, spatial_context_for

WINDOWED = (
    SpatialConv2d, SpatialMaxPool2d, SpatialAvgPool2d,
    SpatialConv3d, SpatialMaxPool3d, SpatialAvgPool3d,
)  # fmt: skip


def _strip_bytes(m: Any, x: torch.Tensor) -> int:
    """Bytes of the halo strips this rank receives for layer ``m`` on input ``x``.

    The exchange goes dim by dim, outermost first: dim ``k``'s strips span the
    halos of the dims before it (already in place) and the tile along the dims after.
    """
    win = m._window(x, 0.0)
    nd = len(win.kernel)
    tile = [int(v) for v in x.shape[-nd:]]
    sides = win.neighbours.pairs()[-nd:]
    lead = x.shape[0] * x.shape[1] * x.element_size()
    total = 0
    for k, (lo, hi) in enumerate(sides):
        before, after = win.halo[2 * k], win.halo[2 * k + 1]
        got = (before if lo is not None else 0) + (after if hi is not None else 0)
        across = 1
        for j in range(nd):
            if j < k:
                across *= tile[j] + win.halo[2 * j] + win.halo[2 * j + 1]
            elif j > k:
                across *= tile[j]
        total += got * across
    return lead * total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="convchain")
    p.add_argument("--grid", default="1x4")
    p.add_argument("--image", default="256")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--width", type=float, default=None)
    args = p.parse_args()
    grid = parse_grid(args.grid)
    hw = tuple(int(v) for v in args.image.split("x")) * (1 if "x" in args.image else 2)
    pc = start(grid)
    kwargs: dict[str, Any] = {"num_classes": 2}
    if args.width is not None:
        kwargs["width"] = args.width if args.model != "convchain" else int(args.width)
    torch.manual_seed(0)
    image = torch.randn(args.batch, 3, *hw)
    single = 0
    if pc.rank == 0:
        plain = create_model(args.model, **kwargs).train()
        single = saved_activations(plain, lambda: plain(image).sum()).activations
    torch.manual_seed(0)
    model = create_model(args.model, **kwargs).train()
    ctx = spatial_context_for(model, pc)
    ctx.set_image_size(hw)  # type: ignore[arg-type]
    # A loader yields a contiguous tile (a view of the whole image would count the whole storage).
    tile = pad_image(image, ctx.padded_size(hw))[(..., *ctx.tile_slice(hw))].contiguous()
    layers: dict[str, dict[str, int]] = {}
    hooks = []
    for path, m in model.named_modules():
        if isinstance(m, WINDOWED):

            def pre(m: Any, a: Any, path: str = path) -> None:
                x = a[0]
                layers[path] = {"input": x.numel() * x.element_size(), "strips": _strip_bytes(m, x)}

            hooks.append(m.register_forward_pre_hook(pre))
    saved = saved_activations(model, lambda: model(tile).sum())
    for h in hooks:
        h.remove()
    for path, info in layers.items():
        info["new"] = saved.by_module.get(path, 0)
        info["shared"] = saved.shared.get(path, 0)
    mine = {"total": saved.activations, "layers": layers}
    gathered: list[Any] = [None] * pc.world_size
    dist.all_gather_object(gathered, mine)
    emit({"single": single, "ranks": gathered})


if __name__ == "__main__":
    try:
        main()
    finally:
        sys.stdout.flush()
