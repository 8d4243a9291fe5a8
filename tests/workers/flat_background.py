"""mpiexec worker: a max-pool behind BatchNorm on images with a flat background (ties in
every window there), on a grid whose last tiles reach past the image, vs one process."""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

from hyfi_imaging.parallel.launch import exit_now, init_parallel, shutdown
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.verify import flat_background, verify_model


def build() -> nn.Module:
    """BatchNorm straight on the pixels: equal pixels are equal after it on every tile, with
    no convolution in front to round a flat map's columns apart by position."""
    return nn.Sequential(
        nn.BatchNorm2d(3), nn.MaxPool2d(3, 2, 1), nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(4, 3),
    )  # fmt: skip


if __name__ == "__main__":
    gy, gx, h, w = (int(v) for v in sys.argv[1:5])
    torch.set_num_threads(1)
    pc = init_parallel(Layout(sp=(gy, gx)))
    report = verify_model(build, (h, w), pc, images=flat_background)
    if pc.rank == 0:
        failed = [c.name for c in report.comparisons if not c.ok]
        print(json.dumps({"ok": report.ok, "failed": failed}))
    shutdown()
    exit_now(0)  # without interpreter teardown: gloo's threads can abort it after the work
