"""mpiexec worker: models people already use (torchvision, timm), grid vs one process.

Usage: ``mpiexec -n N python tests/workers/zoo_models.py GY GX H W NAME [NAME ...]``;
for each NAME of :data:`ZOO`, ``hyfi_imaging.verify_model`` in float64 (two SGD
steps: outputs, input and parameter gradients, weights, BatchNorm statistics)
or the refusal it gives. One JSON line on rank 0: ``{name: {"ok": ..., ...}}``.

Dropout, drop-path and stochastic depth keep their rates (or get one where
the default is 0): the masks per sample (and dropout after the global pool)
must be drawn alike on every tile, and the reference draws what the tiles drew
(``parallel/randomness.py``). A mask per pixel (DropBlock) must be refused.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _tv(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(num_classes=3, **kwargs)  # type: ignore[no-any-return]

    return build


def _tv_convnext() -> nn.Module:
    """torchvision's ConvNeXt code (CNBlock: permute, LayerNorm, nn.Linear on channels-last,
    layer scale, stochastic depth; LayerNorm2d downsampling) at a width a test can afford."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    widths = [(8, 16), (16, 32), (32, 64), (64, None)]
    blocks = [CNBlockConfig(a, b, 1) for a, b in widths]
    return ConvNeXt(blocks, stochastic_depth_prob=0.3, num_classes=3)


def _timm(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=3, **kwargs)  # type: ignore[no-any-return]

    return build


def _fixed_size(h: int, w: int) -> Callable[[], nn.Module]:
    """A classifier for ``h x w`` images only: convolutions, then ``nn.Flatten`` into an
    ``nn.Linear`` sized for the last map (LeNet's dense head)."""

    def build() -> nn.Module:
        last = (h // 2) * (w // 2)
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * last, 3),
        )  # fmt: skip

    return build


class _Functional(nn.Module):
    """Layers written as functions, each with a tiled form: ``F.conv2d`` with the module's
    own (grouped) weight and bias after a reflect pad (a blur pool's), ``F.max_pool2d``
    after a replicate pad, ``F.avg_pool2d`` upsampled back by ``F.interpolate`` to the
    map's size (GhostNetV2's attention), ECA attention (a Conv1d on the pooled channel
    vector) and a channels-last global mean (MambaOut's head)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.weight = nn.Parameter(torch.randn(8, 4, 3, 3) * 0.3)
        self.bias = nn.Parameter(torch.randn(8) * 0.1)
        self.norm = nn.BatchNorm2d(8)
        self.eca = nn.Conv1d(1, 1, 3, padding=1, bias=False)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        x = torch.relu(self.stem(x))
        x = F.pad(x, (1, 1, 1, 1), mode="reflect")
        x = F.conv2d(x, self.weight, self.bias, stride=2, groups=2)
        x = F.max_pool2d(F.pad(x, (1, 1, 1, 0), mode="replicate"), (2, 3), stride=1)
        x = self.norm(x)
        gate = F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False)
        x = x * torch.sigmoid(F.interpolate(gate, size=x.shape[-2:], mode="nearest"))
        pooled = x.mean((2, 3)).view(x.shape[0], 1, -1)
        x = x * torch.sigmoid(self.eca(pooled)).view(x.shape[0], -1, 1, 1)
        return self.fc(x.permute(0, 2, 3, 1).mean((1, 2)))


class _ChannelFunctions(nn.Module):
    """Functions over channels only, which run on the tiles as they are (an L2 normalisation,
    a channel flip and roll), and an L1 normalisation over the image written as a global sum
    (what the refusal of ``x.norm(p=1, dim=(2, 3))`` tells its user to write), and a constant
    the forward makes without a device (``torch.tensor([...])``, run on the meta device first)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, stride=2, padding=1)
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        x = self.stem(x)
        x = F.normalize(x, dim=1) + x.flip(1) * x.norm(p=1, dim=1, keepdim=True) + x.roll(2, 1)
        x = x / x.abs().sum((-2, -1), keepdim=True)
        x = x * torch.tensor([1.0, -2.0, 0.5, 3.0, 1.5, -1.0], dtype=x.dtype).view(1, 6, 1, 1)
        return self.fc(x.amax((2, 3)))


def _global_context() -> nn.Module:
    """timm's GCNet block twice: with its softmax attention, a gate and an addend (its zero
    init replaced, so the addend counts), then with the plain mean (``use_attn=False``)
    after a strided convolution, on odd maps whose tiles end past the image."""
    from timm.layers import GlobalContext

    attend = GlobalContext(8, use_attn=True, fuse_add=True, fuse_scale=True, rd_channels=4)
    nn.init.normal_(attend.mlp_add.fc2.weight, std=0.3)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), attend,
        nn.Conv2d(8, 8, 3, stride=2, padding=1), GlobalContext(8, use_attn=False),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
    )  # fmt: skip


#: name -> builder. What must happen, per grid and size, is the test's data (test_zoo_mpi.py).
ZOO: dict[str, Callable[[], nn.Module]] = {
    "tv-resnet18": _tv("resnet18"),
    "tv-resnext50_32x4d": _tv("resnext50_32x4d"),
    "tv-wide_resnet50_2": _tv("wide_resnet50_2"),
    "tv-densenet121": _tv("densenet121"),
    "tv-efficientnet_b0": _tv("efficientnet_b0"),  # dropout 0.2, stochastic depth 0.2
    "tv-regnet_y_400mf": _tv("regnet_y_400mf"),
    "tv-convnext": _tv_convnext,
    "tv-mobilenet_v3_small": _tv("mobilenet_v3_small"),  # Dropout(0.2, inplace=True) in the head
    "tv-mobilenet_v2": _tv("mobilenet_v2"),
    "tv-inception_v3": _tv("inception_v3", aux_logits=False, init_weights=False),
    "timm-resnet18": _timm("resnet18"),
    "timm-resnet18-droppath": _timm("resnet18", drop_path_rate=0.3, drop_rate=0.3),
    "timm-resnet18-dropblock": _timm("resnet18", drop_block_rate=0.2),
    "timm-resnet26d": _timm("resnet26d"),
    "timm-efficientnet_b0": _timm("efficientnet_b0", drop_rate=0.2, drop_path_rate=0.2),
    "timm-mobilenetv3_small_050": _timm("mobilenetv3_small_050", drop_rate=0.2),
    "timm-mixnet_s": _timm("mixnet_s"),
    "timm-convnext_atto": _timm("convnext_atto", drop_path_rate=0.2),
    "timm-convnextv2_atto": _timm("convnextv2_atto"),
    "timm-regnetx_002": _timm("regnetx_002"),
    "timm-resnet18-avgmax": _timm("resnet18", global_pool="avgmax"),
    "timm-resnet18-catavgmax": _timm("resnet18", global_pool="fastcatavgmax"),
    "timm-resnet18-groupnorm": _timm("resnet18", norm_layer="groupnorm"),
    "timm-tf_efficientnet_b0": _timm("tf_efficientnet_b0", drop_rate=0.2, drop_path_rate=0.2),
    "timm-nf_resnet26": _timm("nf_resnet26"),
    "timm-poolformer_s12": _timm("poolformer_s12", drop_path_rate=0.2),
    # Families the product was not written for (a sweep on 2026-11-25: each exact or refused).
    "tv-shufflenet_v2_x0_5": _tv("shufflenet_v2_x0_5"),  # channel shuffle: view + transpose
    "tv-googlenet": _tv("googlenet", aux_logits=False, init_weights=False),
    "tv-mnasnet0_5": _tv("mnasnet0_5"),
    "tv-regnet_x_400mf": _tv("regnet_x_400mf"),
    "tv-squeezenet1_0": _tv("squeezenet1_0"),  # dropout on the feature map
    "tv-alexnet": _tv("alexnet"),  # adaptive pooling to 6x6
    "timm-dla34": _timm("dla34"),  # trees of concatenated levels
    "timm-resnest14d": _timm("resnest14d"),  # split attention: a pooled softmax over radices
    "timm-skresnet18": _timm("skresnet18"),  # selective kernel: dilated branches, pooled gate
    "timm-ghostnet_050": _timm("ghostnet_050"),
    "timm-repvgg_a0": _timm("repvgg_a0"),
    "timm-lcnet_050": _timm("lcnet_050"),
    "timm-ese_vovnet19b_dw": _timm("ese_vovnet19b_dw"),  # effective SE: a pooled hard-sigmoid
    "timm-gernet_s": _timm("gernet_s"),
    "timm-hrnet_w18_small": _timm("hrnet_w18_small"),  # parallel resolutions, upsampled fusions
    "timm-tresnet_m": _timm("tresnet_m"),  # space-to-depth stem: a view across the map
    "timm-mobilevit_xxs": _timm("mobilevit_xxs"),  # attention over unfolded patches
    # Refused by an earlier sweep, now exact or refused for the real reason (issue 23).
    "timm-ecaresnet26t": _timm("ecaresnet26t"),  # ECA: a Conv1d on the pooled channel vector
    "timm-mambaout_femto": _timm("mambaout_femto"),  # channels-last, a mean over (1, 2) in the head
    "timm-hgnetv2_b0": _timm("hgnetv2_b0"),  # TF-style stem: F.pad, then a pool shrinking it back
    "timm-gcresnext26ts": _timm("gcresnext26ts"),  # global context: softmax over all pixels
    "timm-resnetblur18": _timm("resnetblur18"),  # blur pool: a reflect pad, a functional conv
    "timm-ghostnetv2_100": _timm("ghostnetv2_100"),  # DFC attention: F.avg_pool2d, F.interpolate
    "fixed-29x43": _fixed_size(29, 43),  # flatten -> Linear: takes 29x43 only
    "fn-windowed": _Functional,
    "fn-global-context": _global_context,
    "fn-channels": _ChannelFunctions,
}


def main(argv: list[str]) -> int:
    from hyfi_imaging import HyfiError, Layout, verify_model
    from hyfi_imaging.parallel.launch import init_parallel, shutdown

    gy, gx, h, w = (int(v) for v in argv[:4])
    torch.set_num_threads(1)
    pc = init_parallel(Layout(sp=(gy, gx)))
    results: dict[str, Any] = {}
    for name in argv[4:]:
        build = ZOO[name]
        began = time.perf_counter()
        try:
            report = verify_model(build, (h, w), pc, batch=2)
            failed = [c.name for c in report.comparisons if not c.ok]
            worst = max(report.comparisons, key=lambda c: c.max_rel, default=None)
            results[name] = {"ok": report.ok, "max_rel_error": report.max_rel_error,
                             "worst": worst.name if worst is not None else "",
                             "compared": len(report.comparisons), "failed": failed[:5]}  # fmt: skip
        except HyfiError as err:
            results[name] = {"ok": False, "error": str(err)}
        except Exception as err:  # a crash is a failure of its own kind: never "refused"
            results[name] = {"ok": False, "crash": f"{type(err).__name__}: {err}"[:500]}
        results[name]["seconds"] = round(time.perf_counter() - began, 1)
    if pc.rank == 0:
        print(json.dumps(results))
    shutdown()
    return 0


if __name__ == "__main__":
    from hyfi_imaging.parallel.launch import exit_now

    # Without interpreter teardown: gloo's threads can abort it after all work is done.
    exit_now(main(sys.argv[1:]))
