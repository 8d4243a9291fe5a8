"""U-Nets for dense per-pixel (per-voxel) output: ``unet2d`` (slides) and ``unet3d`` (volumes).

One configurable class (:class:`UNet`) for both, as in timm: the 2-D network of
Ronneberger et al. (2015) and the 3-D network of Çiçek et al. (2016) differ in
the number of spatial dims and in one channel rule, which are options, not
subclasses.

Design choices, and why:

* **Padded convolutions, output size = input size.** Both papers use valid
  (unpadded) 3x3 convolutions, so the output is smaller than the input and the
  skip connections are centre-cropped; tiled inference then needs overlapping
  input tiles. Here every 3x3(x3) convolution pads by 1, so the logits cover
  the whole image pixel for pixel -- what a whole-slide segmentation (and the
  spatial grid, which tiles the output like the input) wants. Zero padding is
  applied once, at the image border: on a spatial grid the tiles exchange halos.
* **Any input size.** Max-pooling floors odd sizes (45 -> 22), so the 2x
  upsampled map can be one pixel short of its skip (44 vs 45). The decoder
  zero-pads it at the *bottom/right* to the skip's size (``F.pad``), which keeps
  pixel ``i`` of the coarse map over pixels ``2i, 2i + 1`` of the fine one (the
  pool dropped the last row, so that is where the missing row belongs). A size
  that divides ``2**depth`` pads nothing. ``total_stride`` is ``2**depth``: the
  spatial engine pads the image once to a multiple of ``grid * total_stride``
  and masks the padding, so results equal one process on the unpadded image at
  any size; the ``F.pad`` runs in its spatial form (``parallel/functional.py``).
* **BatchNorm after every 3x3 convolution** (not in Ronneberger et al.; Çiçek et
  al. add it), and no bias on a convolution that BatchNorm follows (the bias
  would be subtracted again). On a spatial grid the statistics are those of the
  whole image (an all-reduce over the tiles).
* **Upsampling** ``"transpose"``: ``ConvTranspose`` kernel 2 stride 2 (the
  papers' "up-convolution"); ``"bilinear"`` (``"trilinear"`` in 3-D): fixed
  interpolation (``nn.Upsample``, ``align_corners=False``) then a 3x3 convolution,
  the resize-convolution of Odena et al. (2016), free of checkerboard artefacts.
  Neither has a bias: it feeds a convolution followed by BatchNorm, which
  removes a constant per channel (Çiçek et al.'s published parameter count
  leaves it out too, see ``models/unet3d.yaml``).
* **Channel rules** (``channels``): ``"ronneberger"``: both convolutions of
  level ``l`` have ``width * 2**l`` channels and the up-convolution halves the
  channels (64, 128, ..., 1024 for ``width=64, depth=4``); ``"cicek"``: the
  first convolution of level ``l`` has ``width * 2**l`` channels, the second
  doubles them "before max pooling to avoid bottlenecks" (32/64, 64/128,
  128/256, 256/512 for ``width=32, depth=3``), and the up-convolution keeps its
  channels.
* **Not a chain.** Every decoder level reads an encoder level's output, so the
  model derives from :class:`~.registry.ModelBase` and runs its own ``forward``
  on one pipeline stage; cut into several, it is its traced chain form
  (``parallel/chain_form.py``: the skips travel between stages); the double
  convolutions are checkpointable blocks
  (``set_grad_checkpointing``), which is how a U-Net on a whole slide trades
  compute for memory.

The 3-D network runs in one process for now: the spatial engine tiles 2-D maps,
and 3-D modules are refused by ``spatialize`` with their module path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models.registry import (
    CheckpointedBlock,
    ModelBase,
    check_positive,
    register_model,
    whole_number,
)

__all__ = ["DoubleConv", "UNet", "UpConcat"]

_CONV: dict[int, type[nn.Module]] = {2: nn.Conv2d, 3: nn.Conv3d}
_NORM: dict[int, type[nn.Module]] = {2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_POOL: dict[int, type[nn.Module]] = {2: nn.MaxPool2d, 3: nn.MaxPool3d}
_UPCONV: dict[int, type[nn.Module]] = {2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
_LINEAR: dict[int, str] = {2: "bilinear", 3: "trilinear"}
_CHANNEL_RULES = ("ronneberger", "cicek")


class DoubleConv(CheckpointedBlock):
    """``(conv 3x3 - BatchNorm - ReLU) x 2``, padded: the unit of every U-Net level."""

    def __init__(self, dims: int, in_ch: int, mid_ch: int, out_ch: int) -> None:
        super().__init__()
        conv, norm = _CONV[dims], _NORM[dims]
        self.conv1 = conv(in_ch, mid_ch, 3, padding=1, bias=False)
        self.bn1 = norm(mid_ch)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = conv(mid_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = norm(out_ch)
        self.relu2 = nn.ReLU(inplace=True)

    def forward_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu2(self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x))))))


class UpConcat(nn.Module):
    """Upsample 2x, zero-pad at the bottom/right to the skip's size, concatenate ``[skip, up]``.

    ``mode`` is ``"transpose"`` (ConvTranspose, kernel 2, stride 2) or the
    interpolation ``"bilinear"``/``"trilinear"`` followed by a 3x3 convolution.
    The pad is called even when it pads nothing, so that every run (a tile, the
    meta-device trace of the whole image) makes the same calls.
    """

    def __init__(self, dims: int, in_ch: int, out_ch: int, mode: str) -> None:
        super().__init__()
        self.dims = dims
        self.up: nn.Module
        if mode == "transpose":
            self.up = _UPCONV[dims](in_ch, out_ch, 2, stride=2, bias=False)
        else:
            self.up = nn.Sequential(
                nn.Upsample(scale_factor=2, mode=mode, align_corners=False),
                _CONV[dims](in_ch, out_ch, 3, padding=1, bias=False),
            )

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.up(x)
        pad: list[int] = []
        for axis in range(1, self.dims + 1):  # F.pad lists the last axis first
            pad += [0, skip.shape[-axis] - x.shape[-axis]]
        return torch.cat([skip, F.pad(x, pad)], 1)


class UNet(ModelBase):
    """A padded U-Net in 2-D or 3-D: per-pixel logits ``(N, num_classes, *input size)``.

    Args:
        dims: 2 (images, ``(N, C, H, W)``) or 3 (volumes, ``(N, C, D, H, W)``).
        in_chans: input channels.
        num_classes: output channels (per-pixel logits).
        width: channels of the first level.
        depth: number of 2x poolings (levels below the first); ``total_stride = 2**depth``.
        upsampling: ``"transpose"`` (learned, kernel 2 stride 2) or ``"bilinear"``
            (``"trilinear"`` for ``dims=3``) interpolation followed by a 3x3 convolution.
        channels: ``"ronneberger"`` or ``"cicek"``, the channel rule (see the module docstring).

    OK: ``create_model("unet2d", num_classes=2, in_chans=1, width=8, depth=3)``.
    Error: ``create_model("unet2d", upsampling="nearest")`` raises ConfigError naming the modes.
    """

    def __init__(
        self,
        *,
        dims: int = 2,
        in_chans: int = 3,
        num_classes: int = 2,
        width: int = 64,
        depth: int = 4,
        upsampling: str = "transpose",
        channels: str = "ronneberger",
    ) -> None:
        super().__init__()
        where = f"UNet (dims={dims})"
        if dims not in _CONV:
            raise ConfigError(where, f"dims={dims!r} is not supported", "use 2 or 3")
        modes = ("transpose", _LINEAR[dims])
        if upsampling not in modes:
            raise ConfigError(
                where, f"upsampling={upsampling!r} is not known", f"use one of: {', '.join(modes)}"
            )
        if channels not in _CHANNEL_RULES:
            raise ConfigError(
                where,
                f"channels={channels!r} is not known",
                f"use one of: {', '.join(_CHANNEL_RULES)}",
            )
        width, depth = whole_number(where, "width", width), whole_number(where, "depth", depth)
        check_positive(where, in_chans=in_chans, num_classes=num_classes, width=width, depth=depth)
        self.dims, self.in_chans, self.num_classes = dims, in_chans, num_classes
        self.width, self.depth, self.upsampling = width, depth, upsampling
        self.total_stride = 2**depth

        cicek = channels == "cicek"
        # Level l: the encoder's two convolutions give mid[l] then out[l] channels.
        mid = [width * 2**level for level in range(depth + 1)]
        out = [m * 2 if cicek else m for m in mid]
        self.encoder = nn.ModuleList()
        ch = in_chans
        for level in range(depth + 1):
            self.encoder.append(DoubleConv(dims, ch, mid[level], out[level]))
            ch = out[level]
        self.pools = nn.ModuleList(_POOL[dims](2) for _ in range(depth))
        self.ups = nn.ModuleList()
        self.decoder = nn.ModuleList()
        for level in reversed(range(depth)):  # deepest first
            up_ch = ch if cicek else ch // 2
            self.ups.append(UpConcat(dims, ch, up_ch, upsampling))
            self.decoder.append(DoubleConv(dims, out[level] + up_ch, out[level], out[level]))
            ch = out[level]
        self.num_features = ch
        self.head = _CONV[dims](ch, num_classes, 1)

        for m in self.modules():
            if isinstance(m, nn.Conv2d | nn.Conv3d | nn.ConvTranspose2d | nn.ConvTranspose3d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The last decoder level's map (``num_features`` channels, the input's size)."""
        skips = []
        for level, block in enumerate(self.encoder):
            if level:
                x = self.pools[level - 1](x)
            x = block(x)
            skips.append(x)
        skips.pop()  # the bottom level is the decoder's input, not a skip
        for up, block in zip(self.ups, self.decoder, strict=True):
            x = block(up(x, skips.pop()))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Per-pixel logits, the input's spatial size."""
        out: torch.Tensor = self.head(self.forward_features(x))
        return out


register_model("unet2d", UNet, dims=2)
register_model("unet3d", UNet, dims=3, width=32, depth=3, channels="cicek")
