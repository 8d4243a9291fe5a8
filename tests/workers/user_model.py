"""Models a user writes (not chains, not registered), checked by ``hyfi_imaging.verify_model``.

Usage: ``mpiexec -n N python tests/workers/user_model.py MODE:GY:GX:H:W:DP:M ...``
(``DP`` data replicas, ``M`` micro-batches; ``N = DP x GY x GX`` for every case;
the cases run in one launch, a JSON line each on rank 0), MODE one of

* ``classify``: :class:`ResidualNet`, whose ``forward`` is not its children in
  order (a residual, a squeeze-excite block with its own global pool, a
  functional ``torch.flatten`` before the classifier), cross-entropy;
* ``classify-cl``: the same in channels-last (weights; FSDP2 shards contiguous ones), with
  the number of spatial convolutions that ran on a channels-last input of the standard
  strides (the kernels' layout test); ``classify-cl1``: the same with one image per step
  (FSDP2's view of a unit's input gives a batch of one another stride);
* ``dense``: :class:`DenseNet`, per-pixel logits at half resolution (no global
  pool), the default per-pixel cross-entropy averaged over the image's pixels;
* ``dense-mse``: the same model with a regression loss and float targets;
* ``dense-scalar-loss``: the same model with ``F.cross_entropy``'s mean, one
  number per tile: refused (the error in its JSON line);
* ``broken``: ``classify`` with the halo exchange's backward dropping its
  gradients (``tests/mpi/broken_halo.py``): must *not* be ok.

Prints one JSON line (rank 0). :func:`build_classifier` is also what the
``hyfi-train`` test names as ``model.name: user_model:build_classifier``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from pooling_blocks import SqueezeExcite  # the worker beside this one
from torch import nn


class ResidualNet(nn.Module):
    """A small classifier in torchvision's style: children called out of order, functions between."""

    def __init__(self, num_classes: int = 3, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, num_classes)  # declared first: children are not the order
        self.stem = nn.Conv2d(3, width, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.body = nn.Sequential(
            nn.Conv2d(width, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
        )
        self.se = SqueezeExcite(width)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(torch.relu(self.bn(self.stem(x))))
        x = torch.relu(x + self.se(self.body(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class DenseNet(nn.Module):
    """Per-pixel logits at half the input's resolution: no global pool, the output is tiled."""

    def __init__(self, num_classes: int = 3, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.down = nn.Conv2d(width, width, 3, stride=2, padding=1)
        self.context = nn.Conv2d(width, width, 3, padding=2, dilation=2)
        self.head = nn.Conv2d(width, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.down(torch.relu(self.bn1(self.conv1(x)))))
        return self.head(y + torch.relu(self.context(y)))


def build_classifier(num_classes: int = 3, width: float = 0.25) -> nn.Module:
    """The ``module:function`` hyfi-train is given in the tests (``width`` as the recipe's)."""
    return ResidualNet(num_classes=num_classes, width=max(2, 2 * round(16 * width)))


def _float_target(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _per_pixel_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean(dim=1)


def _case(case: str) -> dict[str, Any]:
    """One case ``MODE:GY:GX:H:W:DP:M``: verify_model's result (or its refusal)."""
    from hyfi_imaging import HyfiError, Layout, verify_model

    mode, *numbers = case.split(":")
    gy, gx, h, w, dp, m = (int(v) for v in numbers)
    options: dict[str, Any] = {}
    broken: AbstractContextManager[Any] = nullcontext()
    build: Any = ResidualNet
    if mode.startswith("dense"):
        build = DenseNet
    if mode.startswith("classify-cl"):

        def build() -> nn.Module:
            return ResidualNet().to(memory_format=torch.channels_last)  # type: ignore[call-overload]

    if mode == "classify-cma":  # BatchNorm's cumulative average (momentum=None): traced on meta

        def build() -> nn.Module:
            model = ResidualNet()
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.momentum = None
            return model

    if mode == "dense-mse":
        options = {"loss": _per_pixel_mse, "target": _float_target}
    if mode == "dense-scalar-loss":  # one number per tile: refused, not silently wrong
        options = {"loss": torch.nn.functional.cross_entropy}
    if mode == "broken":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi"))
        from broken_halo import dropped_halo_gradients

        broken = dropped_halo_gradients()
    layouts: list[bool] = []
    counting = nullcontext() if not mode.startswith("classify-cl") else _conv_layouts(layouts)
    try:
        with broken, counting:
            layout = Layout(dp=dp, sp=(gy, gx))
            batch = m if mode == "classify-cl1" else 2 * m
            report = verify_model(build, (h, w), layout, batch=batch, microbatches=m, **options)
    except HyfiError as err:
        return {"case": case, "error": str(err)}
    if torch.distributed.get_rank() == 0:
        print(report.format(f"{mode} {h}x{w} on dp={dp} x {gy}x{gx}, m={m}"), file=sys.stderr)
    failed = [c.name for c in report.comparisons if not c.ok]
    return {"case": case, "ok": report.ok, "max_rel_error": report.max_rel_error,
            "compared": len(report.comparisons), "failed": failed,
            "spatial_convs": len(layouts), "channels_last_convs": sum(layouts)}  # fmt: skip


@contextmanager
def _conv_layouts(found: list[bool]) -> Iterator[None]:
    """Per call of a spatial convolution: was its input channels-last with the standard
    strides (what ``suggest_memory_format`` reads as channels-last, so the kernel runs so)?"""
    from hyfi_imaging.parallel.spatial.convolutions import SpatialConv2d

    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        if isinstance(module, SpatialConv2d):
            x = args[0]
            standard = torch.empty(x.shape, memory_format=torch.channels_last).stride()
            found.append(x.stride() == standard)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def main(argv: list[str]) -> int:
    """Run every case of ``argv`` (one world size) in this one launch; a JSON line each."""
    from hyfi_imaging.parallel.launch import shutdown

    torch.set_num_threads(1)
    for case in argv:
        result = _case(case)
        if torch.distributed.get_rank() == 0:
            print(json.dumps(result), flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    from hyfi_imaging.parallel.launch import exit_now

    # Without interpreter teardown: gloo's threads can abort it after all work is done.
    exit_now(main(sys.argv[1:]))
