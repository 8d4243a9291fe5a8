"""mpiexec worker: under bf16 autocast, each spatial layer's output has the plain layer's dtype.

Usage: ``mpiexec -n 2 python tests/workers/autocast_dtypes.py`` (a 1x2 grid). A chain of a
convolution, BatchNorm, ReLU, GroupNorm, a transposed convolution and a 1x1 convolution runs
under ``torch.autocast("cpu", torch.bfloat16)`` in one process and on the tiles; rank 0
prints one JSON line with each layer's output dtype in both.
"""

from __future__ import annotations

import copy
import json

import torch
from torch import nn


def _dtypes(model: nn.Sequential, x: torch.Tensor) -> list[str]:
    got: list[str] = []
    for layer in model:
        layer.register_forward_hook(lambda m, a, o: got.append(str(o.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    return got


def main() -> int:
    import hyfi_imaging as hyfi
    from hyfi_imaging.parallel.launch import shutdown

    pc = hyfi.init_parallel(hyfi.Layout(sp=(1, 2)))
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8),
        nn.ConvTranspose2d(8, 4, 2, stride=2), nn.Conv2d(4, 2, 1),
    )  # fmt: skip
    x = torch.randn(2, 3, 32, 30)
    plain = _dtypes(copy.deepcopy(net), x)
    ctx = hyfi.apply_spatial(net, pc, image_size=(32, 30))
    tiled = _dtypes(net, hyfi.tile_of(x, ctx, (32, 30)))
    if pc.rank == 0:
        print(json.dumps({"plain": plain, "tiled": tiled}))
    shutdown()
    return 0


if __name__ == "__main__":
    from hyfi_imaging.parallel.launch import exit_now

    exit_now(main())  # every rank ends alike (a rank that ends first got the job killed)
