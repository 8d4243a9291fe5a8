"""mpiexec worker: deep halos (one exchange for several windowed layers), grid vs one process.

Usage: ``mpiexec -n N python tests/workers/deep_halo.py MODEL GRID SIZE DEPTH [overlap] [pp2]``
(``GRID`` ``GYxGX`` or ``GZxGYxGX``, ``SIZE`` ``HxW`` or ``DxHxW``);
``hyfi_imaging.verify_model`` in float64 (two SGD steps; outputs, input and
parameter gradients, weights, BatchNorm statistics) at ``halo_depth=1`` and at
``DEPTH``, counting the halo messages of each (forward and backward). One JSON
line on rank 0. ``pp2``: two pipeline stages (no deep halo crosses a stage cut).

* ``mixed``: one ``nn.Sequential`` run of every windowed layer a deep halo
  may cross -- 3x3, 5x5, dilated, strided and 1x1 convolutions, a 3x3/s2/p1
  max-pool, an average pool with ``count_include_pad=False`` -- with
  BatchNorms, in-place and functional activations between them, then a
  classifier head;
* ``resnet18``: the registered ResNet-18 (narrow): runs inside each basic
  block (conv-bn-relu-conv) and the stem (conv-bn-relu-maxpool); the residual
  adds end them;
* ``tvresnet18``: torchvision's ResNet-18, whose blocks add the shortcut in place
  (``out += identity``): the identity's second reader, which a deep halo must not cross;
* ``mixed3d``: the same kinds of run on volumes (Conv3d, BatchNorm3d,
  MaxPool3d, AvgPool3d) for a 3-D grid of sub-volumes;
* ``unet3d``: the registered 3D U-Net (narrow): runs in every double
  convolution; the pools, transposed convolutions and concatenations end them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class _Silu(nn.Module):
    """A functional activation between two layers (the watch follows it per pixel)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x) * 0.5 + 0.1


def mixed() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False),
        nn.BatchNorm2d(6),
        nn.ReLU(inplace=True),
        nn.Conv2d(6, 6, 5, padding=2),
        _Silu(),
        nn.Conv2d(6, 8, 3, padding=2, dilation=2, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(8, 8, 1),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.LeakyReLU(0.1),
        nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(1),
        nn.Linear(8, 3),
    )


def resnet18() -> nn.Module:
    from hyfi_imaging.models import create_model

    return create_model("resnet18", num_classes=3, width=0.125)


def tvresnet18() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=3)


def mixed3d() -> nn.Module:
    return nn.Sequential(
        nn.Conv3d(2, 4, 3, padding=1, bias=False),
        nn.BatchNorm3d(4),
        nn.ReLU(inplace=True),
        nn.Conv3d(4, 4, (3, 5, 3), padding=(1, 2, 1)),
        _Silu(),
        nn.Conv3d(4, 6, 3, padding=2, dilation=2, bias=False),
        nn.BatchNorm3d(6),
        nn.ReLU(),
        nn.MaxPool3d(3, stride=2, padding=1),
        nn.Conv3d(6, 6, 1),
        nn.Conv3d(6, 6, 3, stride=(1, 2, 2), padding=1),
        nn.LeakyReLU(0.1),
        nn.AvgPool3d(3, stride=1, padding=1, count_include_pad=False),
        nn.Conv3d(6, 6, 3, padding=1),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(1),
        nn.Linear(6, 3),
    )


def unet3d() -> nn.Module:
    from hyfi_imaging.models import create_model

    return create_model("unet3d", in_chans=2, num_classes=3, width=2, depth=2)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mixed": mixed,
    "resnet18": resnet18,
    "tvresnet18": tvresnet18,
    "mixed3d": mixed3d,
    "unet3d": unet3d,
}


def _count_messages() -> list[int]:
    """Wrap the one place every halo message passes; returns the live counter."""
    from hyfi_imaging.parallel import halo

    count = [0]
    send = halo._exchange

    def counted(sends: list, recvs: list) -> Callable[[], None]:  # type: ignore[type-arg]
        count[0] += len(sends) + len(recvs)
        return send(sends, recvs)

    halo._exchange = counted  # type: ignore[assignment]
    return count


def main(argv: list[str]) -> int:
    from hyfi_imaging import HyfiError, Layout, verify_model
    from hyfi_imaging.parallel.launch import init_parallel, shutdown

    name = argv[0]
    grid, size = Layout.parse_grid(argv[1]), Layout.parse_grid(argv[2])
    depth = int(argv[3])
    overlap = "overlap" in argv[4:]
    torch.set_num_threads(1)
    count = _count_messages()
    pc = init_parallel(Layout(sp=grid, pp=2 if "pp2" in argv[4:] else 1))
    messages = []
    try:
        reports = []
        for d in (1, depth):
            count[0] = 0
            reports.append(
                verify_model(
                    MODELS[name],
                    size,
                    pc,
                    batch=2,
                    microbatches=pc.layout.pp,
                    halo_depth=d,
                    overlap=overlap,
                )
            )
            messages.append(count[0])
    except HyfiError as err:
        if torch.distributed.get_rank() == 0:
            print(json.dumps({"error": str(err)}))
        shutdown()
        return 2
    total = torch.tensor(messages, dtype=torch.int64)
    torch.distributed.all_reduce(total)
    report = reports[-1]
    if torch.distributed.get_rank() == 0:
        print(report.format(f"{name} {argv[2]} on {argv[1]}, depth {depth}"), file=sys.stderr)
        failed = [c.name for c in report.comparisons if not c.ok]
        print(json.dumps({"ok": report.ok and reports[0].ok, "max_rel_error": report.max_rel_error,
                          "failed": failed, "messages": total.tolist()}))  # fmt: skip
    shutdown()
    return 0


if __name__ == "__main__":
    from hyfi_imaging.parallel.launch import exit_now

    # Without interpreter teardown: gloo's threads can abort it after all work is done.
    exit_now(main(sys.argv[1:]))
