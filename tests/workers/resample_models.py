"""mpiexec worker: pads and interpolations of the whole image, grid vs one process.

Usage: ``mpiexec -n N python tests/workers/resample_models.py MODEL:GY:GX:H:W ...``
(cases of one world size, run in one launch), MODEL one of :data:`MODELS`;
``hyfi_imaging.verify_model`` in float64 (two SGD steps; outputs, input and
parameter gradients, weights after training); one JSON line per case on rank 0.

* ``unet-<mode>``: a small U-Net (dense per-pixel logits at full resolution)
  whose decoder calls ``F.interpolate(x, size=skip.shape[-2:], mode=...)``
  (torchvision/segmentation style; 75 from 37 at odd sizes);
* ``unet-pad``: the original U-Net's decoder, ``nn.Upsample(scale_factor=2)``
  then ``F.pad`` to the skip's size (the difference split left/right);
* ``unet-transposed``: the same with learned upsampling, ``nn.ConvTranspose2d``
  (2x2 stride 2, and 3x3 stride 2 padding 1 output_padding 1);
* ``pads``: ``nn.ZeroPad2d`` and ``nn.ConstantPad2d`` (asymmetric, a non-zero
  fill) after a valid convolution, a crop by negative ``F.pad``,
  ``nn.Upsample(scale_factor=2, mode="bilinear")`` and a downsampling
  ``F.interpolate(scale_factor=0.5)``, pooled by a classifier head;
* ``fractional``: upsamplings by 1.4 (nearest) and 2.5 (bilinear) after a strided
  convolution, each followed by a strided layer: the tiles of a non-integer scale hold the
  whole map (refused before as needing "a larger align", which no align gave).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
    )


class UNet(nn.Module):
    """Two levels; ``mode`` says how the decoder gets back to the skip's size."""

    def __init__(self, mode: str, width: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.mode = mode
        self.enc1, self.enc2 = _block(3, width), _block(width, 2 * width)
        self.pool1, self.pool2 = nn.MaxPool2d(2), nn.MaxPool2d(2)
        self.mid = _block(2 * width, 2 * width)
        self.up2, self.up1 = nn.Upsample(scale_factor=2), nn.Upsample(scale_factor=2)
        if mode == "transposed":  # learned upsampling: 2x2/s2, and 3x3/s2/p1 (output_padding 1)
            self.up2 = nn.ConvTranspose2d(2 * width, 2 * width, 2, stride=2)
            self.up1 = nn.ConvTranspose2d(width, width, 3, stride=2, padding=1, output_padding=1)
        self.dec2 = _block(4 * width, width)
        self.dec1 = _block(2 * width, width)
        self.head = nn.Conv2d(width, classes, 1)

    def _up(self, x: torch.Tensor, skip: torch.Tensor, up: nn.Module) -> torch.Tensor:
        if self.mode in ("pad", "transposed"):
            x = up(x)
            dy, dx = skip.shape[-2] - x.shape[-2], skip.shape[-1] - x.shape[-1]
            x = F.pad(x, (dx // 2, dx - dx // 2, dy // 2, dy - dy // 2))
        else:
            mode, _, corners = self.mode.partition("-corners")
            x = F.interpolate(
                x, size=skip.shape[-2:], mode=mode, align_corners=True if corners else None
            )
        return torch.cat([skip, x], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s1 = self.enc1(x)
        s2 = self.enc2(self.pool1(s1))
        y = self.mid(self.pool2(s2))
        y = self.dec2(self._up(y, s2, self.up2))
        return self.head(self.dec1(self._up(y, s1, self.up1)))


class Pads(nn.Module):
    """Pads, a crop and resamplings that change the map's size, then a classifier."""

    def __init__(self, width: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.valid = nn.Conv2d(3, width, 3)
        self.zero = nn.ZeroPad2d((1, 0, 1, 0))
        self.const = nn.ConstantPad2d((0, 1, 0, 1), 0.5)
        self.conv = nn.Conv2d(width, width, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.smooth = nn.Conv2d(width, width, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.const(self.zero(torch.relu(self.valid(x))))  # back to the image's size
        y = self.bn(self.conv(y))
        y = F.pad(torch.relu(self.up(y)), (-1, -1, -1, 0))  # crop 1 px at three borders
        y = self.smooth(y)
        half = F.interpolate(y, scale_factor=0.5, mode="bilinear", align_corners=False)
        pooled = torch.cat([self.pool(y), half.amax((2, 3), keepdim=True)], 1)
        return self.fc(torch.flatten(pooled, 1))


class Fractional(nn.Module):
    """Non-integer upsamplings (1.4 nearest, 2.5 bilinear), each before a strided layer."""

    def __init__(self, width: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, stride=2, padding=1)
        self.up = nn.Upsample(scale_factor=1.4)
        self.down = nn.Conv2d(width, width, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.smooth = nn.Conv2d(width, width, 3, padding=1)
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(self.stem(x))))
        y = F.interpolate(torch.relu(self.bn(y)), scale_factor=2.5, mode="bilinear")
        y = F.max_pool2d(self.smooth(y), 3, 2, 1)
        return self.fc(y.mean((2, 3)))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "unet-nearest": partial(UNet, "nearest"),
    "unet-nearest-exact": partial(UNet, "nearest-exact"),
    "unet-bilinear": partial(UNet, "bilinear"),
    "unet-bilinear-corners": partial(UNet, "bilinear-corners"),
    "unet-pad": partial(UNet, "pad"),
    "unet-transposed": partial(UNet, "transposed"),
    "pads": Pads,
    "fractional": Fractional,
}


def main(argv: list[str]) -> int:
    """Run every case ``MODEL:GY:GX:H:W`` of ``argv`` in this one launch (same world size)."""
    from hyfi_imaging import HyfiError, Layout, verify_model
    from hyfi_imaging.parallel.launch import shutdown

    torch.set_num_threads(1)
    for case in argv:
        name, *numbers = case.split(":")
        gy, gx, h, w = (int(v) for v in numbers)
        result: dict[str, object] = {"case": case}
        try:
            report = verify_model(MODELS[name], (h, w), Layout(sp=(gy, gx)), batch=2)
        except HyfiError as err:
            result["error"] = str(err)
        else:
            if torch.distributed.get_rank() == 0:
                print(report.format(f"{name} {h}x{w} on {gy}x{gx}"), file=sys.stderr)
            result.update(ok=report.ok, max_rel_error=report.max_rel_error,
                          compared=len(report.comparisons),
                          failed=[c.name for c in report.comparisons if not c.ok])  # fmt: skip
        if torch.distributed.get_rank() == 0:
            print(json.dumps(result), flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    from hyfi_imaging.parallel.launch import exit_now

    # Without interpreter teardown: gloo's threads can abort it after all work is done.
    exit_now(main(sys.argv[1:]))
