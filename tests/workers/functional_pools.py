"""mpiexec worker: global reductions written as functions, grid vs one process (float64).

Usage: ``mpiexec -n N python tests/workers/functional_pools.py GY GX H W``. A
squeeze-excite block that squeezes with ``x.mean((2, 3), keepdim=True)``, a
max-excite with ``F.adaptive_max_pool2d``, and a head that pools with
``F.adaptive_avg_pool2d`` and ``x.amax((2, 3))`` (DenseNet/MobileNetV2 style):
each runs in its spatial form (masked local reduction + all-reduce).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch import nn

from hyfi_imaging.parallel.launch import init_parallel, shutdown
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.verify import run_verify


class MeanExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.fc = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean((2, 3), keepdim=True)
        m = F.adaptive_max_pool2d(x, 1)
        return x * torch.sigmoid(self.fc(s) + m)


class FunctionalHead(nn.Module):
    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        avg = torch.flatten(F.adaptive_avg_pool2d(F.relu(x), (1, 1)), 1)
        return self.fc(torch.cat([avg, x.amax((2, 3))], 1))


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        MeanExcite(8),
        nn.Conv2d(8, 8, 3, padding=1),
        FunctionalHead(8, 3),
    )


if __name__ == "__main__":
    gy, gx, h, w = (int(v) for v in sys.argv[1:5])
    torch.set_num_threads(1)
    pc = init_parallel(Layout(sp=(gy, gx)))
    report = run_verify(build, pc, image_hw=(h, w), dtype=torch.float64)
    if pc.rank == 0:
        worst = max(report.comparisons, key=lambda c: c.max_rel)
        print(json.dumps({"ok": report.ok, "max_rel_error": report.max_rel_error,
                          "worst": worst.name}))  # fmt: skip
    shutdown()
