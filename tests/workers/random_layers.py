"""mpiexec worker: random layers draw one mask per image, the same on every tile.

Usage: ``mpiexec -n N python tests/workers/random_layers.py GY GX H W SYNC [MODEL]``.
:class:`DropNet` has drop-path (a mask per sample, as timm's ``DropPath``
and torchvision's ``StochasticDepth`` draw it), ``nn.Dropout2d`` (a mask per
sample and channel) on the tiled map and ``nn.Dropout`` in the head. Every
rank seeds its generator *differently* (as a training loop seeded by rank
does), trains one forward and backward on its tile, and compares the output
and the stitched input gradient with one process seeded like rank 0, in
float64. ``SYNC`` 0 removes the hooks that synchronise the generator over
the tiles (``parallel/randomness.py``): then it must not match. ``MODEL``
``deep`` trains :class:`NoisyChain` instead, under ``checkpointing: deep``:
blocks that draw a mask per sample and channel themselves (so their own
pre-hooks synchronise the generator), whose inputs a deep chain replays in
backward, after every rank drew differently. Prints one
JSON line on rank 0: ``{"ok": ..., "max_abs": ..., "random_modules": [...]}``.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyfi_imaging.models.convchain import ConvChain
from hyfi_imaging.models.registry import CheckpointedBlock
from hyfi_imaging.parallel.apply import apply_spatial, tile_of
from hyfi_imaging.parallel.launch import exit_now, init_parallel, shutdown
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.pipeline import set_checkpointing
from hyfi_imaging.parallel.verify import gather_tile_grid


class DropPath(nn.Module):
    """Drop whole samples of a residual branch (timm's ``DropPath``)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = x.new_empty((x.shape[0], 1, 1, 1)).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class DropNet(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, stride=2, padding=1)
        self.branch = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.Dropout2d(0.3))
        self.drop_path = DropPath(0.5)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(nn.Dropout(0.4), nn.Linear(width, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        x = x + self.drop_path(self.branch(x))
        return self.head(torch.flatten(self.pool(x), 1))


class Noisy(CheckpointedBlock):
    """A convolution and ReLU whose output the block scales by a mask per sample and channel
    that it draws itself."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward_block(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.conv(x))
        return y * torch.rand(*y.shape[:2], 1, 1, dtype=y.dtype, device=y.device)


def noisy_chain() -> nn.Module:
    """Four :class:`Noisy` blocks in one layer of a chain model: a deep chain."""
    model = ConvChain(depth=1, width=3)
    model.block1 = nn.Sequential(*(Noisy(3) for _ in range(4)))
    return model


def main(argv: list[str]) -> int:
    gy, gx, h, w, sync = (int(v) for v in argv[:5])
    deep = argv[5:6] == ["deep"]
    torch.set_num_threads(1)
    pc = init_parallel(Layout(sp=(gy, gx)))
    torch.manual_seed(0)
    reference = (noisy_chain() if deep else DropNet()).double()
    model = copy.deepcopy(reference)
    if deep:
        set_checkpointing(model, "deep")
    images = torch.randn(4, 3, h, w, dtype=torch.float64)
    ctx = apply_spatial(model, pc, image_size=(h, w))
    assert ctx is not None
    if not sync:
        for handle in ctx.rng_hooks:
            handle.remove()
    tile = tile_of(images, ctx, (h, w)).clone().requires_grad_(True)
    torch.manual_seed(100 + pc.rank)  # every rank draws differently, unless synchronised
    out = model(tile)
    torch.rand(1 + pc.rank)  # and draws differently again before backward
    out.square().sum().backward()
    assert tile.grad is not None
    grad = gather_tile_grid(tile.grad, ctx, pc.group("sp"))[..., :h, :w]

    torch.manual_seed(100)  # one process, seeded like the first tile's rank
    x = images.clone().requires_grad_(True)
    want = reference(x)
    want.square().sum().backward()
    assert x.grad is not None
    err = max(float((out - want).detach().abs().max()), float((grad - x.grad).abs().max()))
    worst = torch.tensor([err], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if pc.rank == 0:
        result = {"ok": bool(worst.item() < 1e-12), "max_abs": worst.item(),
                  "random_modules": sorted(ctx.random_modules)}  # fmt: skip
        print(json.dumps(result))
    shutdown()
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
