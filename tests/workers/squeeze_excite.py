"""mpiexec worker: squeeze-excite (a global pool *inside* the network), a channels-first
LayerNorm and a layer scale (leaf modules hyfi-imaging does not know), grid vs one process.

Usage: ``mpiexec -n N python tests/workers/squeeze_excite.py GY GX H W``. The
excitation's 1x1 convolutions act on the pooled vector, which every tile holds
whole: they must stay plain layers with replicated gradients, while every
layer before them and the trunk after them work on tiles.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

from hyfi_imaging.parallel.launch import init_parallel, shutdown
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.verify import run_verify


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, channels // 2, 1)
        self.fc2 = nn.Conv2d(channels // 2, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.fc2(torch.relu(self.fc1(self.pool(x)))))


class LayerNorm2d(nn.LayerNorm):
    """timm's channels-first LayerNorm (per pixel, over channels): a leaf module of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.layer_norm(
            x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias
        )
        return y.permute(0, 3, 1, 2)


class LayerScale(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, channels).view(channels, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        SqueezeExcite(8),
        nn.Conv2d(8, 8, 3, padding=1),
        LayerNorm2d(8),
        LayerScale(8),
        nn.Hardswish(),
        SqueezeExcite(8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(1),
        nn.Linear(8, 3),
    )


if __name__ == "__main__":
    gy, gx, h, w = (int(v) for v in sys.argv[1:5])
    torch.set_num_threads(1)
    pc = init_parallel(Layout(sp=(gy, gx)))
    report = run_verify(build, pc, image_hw=(h, w), dtype=torch.float64)
    if pc.rank == 0:
        print(json.dumps({"ok": report.ok, "max_rel_error": report.max_rel_error}))
    shutdown()
