"""mpiexec worker: the one-process reference fails on rank 0 only; every rank must hear of it.

Usage: ``mpiexec -n 2 python tests/workers/reference_failure.py``. The model raises on an
input as wide as the whole image (only the reference, on rank 0, sees one; the ranks' tiles
are half as wide), so the layout's step succeeds everywhere and the reference's fails on
rank 0 alone. Every rank must raise (the others would otherwise wait in a broadcast that
never comes), and a second verification in the same job must run normally (the ranks are
still in step). One JSON line on rank 0.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

WIDTH = 24


class RefuseWholeImage(nn.Module):
    """Identity on a tile; RuntimeError on a real (not meta) input of the whole image's width."""

    def __init__(self, armed: bool) -> None:
        super().__init__()
        self.armed = armed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and x.device.type != "meta" and x.shape[-1] >= WIDTH:
            raise RuntimeError("the whole image reached the guard")
        return x


def build(armed: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        RefuseWholeImage(armed),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    ).double()


def main() -> int:
    from hyfi_imaging import Layout, verify_model
    from hyfi_imaging.parallel.launch import init_parallel

    torch.set_num_threads(1)
    pc = init_parallel(Layout(sp=(1, 2)), timeout_s=60.0)
    try:
        verify_model(lambda: build(True), (16, WIDTH), pc, steps=1)
        first = "no error"
    except Exception as err:
        first = f"{type(err).__name__}: {err}"
    report = verify_model(lambda: build(False), (16, WIDTH), pc, steps=1)
    seen: list[object] = [None] * pc.world_size
    dist.all_gather_object(seen, first)
    if pc.rank == 0:
        print(json.dumps({"errors": seen, "second_ok": report.ok}), flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    from hyfi_imaging.parallel.launch import exit_now

    exit_now(main())
    sys.exit(1)
