"""mpiexec worker: global pools inside the network and as functions, grid vs one process.

Usage: ``mpiexec -n N python tests/workers/pooling_blocks.py MODEL GY GX H W``,
MODEL one of :data:`MODELS` (float64, ``run_verify``; one JSON line on rank 0):

* ``squeeze-excite``: a global pool *inside* the network whose output is used
  again on every tile, a channels-first LayerNorm and a layer scale (leaf
  modules hyfi-imaging does not know);
* ``functional``: a squeeze-excite that squeezes with ``x.mean((2, 3),
  keepdim=True)``, a max-excite with ``F.adaptive_max_pool2d``, and a head that
  pools with ``F.adaptive_avg_pool2d`` and ``x.amax((2, 3))`` (DenseNet /
  MobileNetV2 style): each runs in its spatial form.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hyfi_imaging.parallel.launch import exit_now, init_parallel, shutdown
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
        y = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias)
        return y.permute(0, 3, 1, 2)


class LayerScale(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, channels).view(channels, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


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


def build_squeeze_excite() -> nn.Module:
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


def build_functional() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        MeanExcite(8),
        nn.Conv2d(8, 8, 3, padding=1),
        FunctionalHead(8, 3),
    )


MODELS: dict[str, Callable[[], nn.Module]] = {
    "squeeze-excite": build_squeeze_excite,
    "functional": build_functional,
}

if __name__ == "__main__":
    name = sys.argv[1]
    gy, gx, h, w = (int(v) for v in sys.argv[2:6])
    torch.set_num_threads(1)
    pc = init_parallel(Layout(sp=(gy, gx)))
    report = run_verify(MODELS[name], pc, image_hw=(h, w), dtype=torch.float64)
    if pc.rank == 0:
        worst = max(report.comparisons, key=lambda c: c.max_rel)
        print(json.dumps({"ok": report.ok, "max_rel_error": report.max_rel_error,
                          "worst": worst.name}))  # fmt: skip
    shutdown()
    exit_now(0)  # without interpreter teardown: gloo's threads can abort it after the work
