"""Tests of hyfi_imaging.models.unet in one process: ``unet2d`` and ``unet3d``.

Their exactness on a tile grid is ``test_unet_mpi.py``; the model cards are
checked with the others in ``test_models.py``. Here: shapes at sizes that do
not divide the stride, parameter counts against counts by hand (and Çiçek et
al.'s published one), the registry's options and refusals, checkpointing, and
that a few SGD steps learn a synthetic blob.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models import DoubleConv, ModelBase, UNet, create_model

torch.set_num_threads(1)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def unet(name: str, seed: int = 0, **kwargs: Any) -> UNet:
    torch.manual_seed(seed)
    model = create_model(name, **kwargs)
    assert isinstance(model, UNet)
    return model


@pytest.mark.parametrize("upsampling", ["transpose", "bilinear"])
@pytest.mark.parametrize(("h", "w"), [(45, 37), (64, 48), (9, 8), (8, 8)])
def test_unet2d_output_is_input_sized(upsampling: str, h: int, w: int) -> None:
    model = unet("unet2d", num_classes=2, in_chans=1, width=4, depth=3, upsampling=upsampling)
    assert (model.num_classes, model.in_chans, model.total_stride, model.dims) == (2, 1, 8, 2)
    out = model(torch.randn(2, 1, h, w))
    assert out.shape == (2, 2, h, w) and torch.isfinite(out).all()


@pytest.mark.parametrize("upsampling", ["transpose", "trilinear"])
def test_unet3d_output_is_input_sized(upsampling: str) -> None:
    model = unet("unet3d", num_classes=3, in_chans=2, width=2, depth=2, upsampling=upsampling)
    assert (model.total_stride, model.dims) == (4, 3)
    out = model(torch.randn(1, 2, 13, 8, 11))
    assert out.shape == (1, 3, 13, 8, 11) and torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("name", "kwargs", "count"),
    [
        # enc0: conv 1->2 (18) + bn (4) + conv 2->2 (36) + bn (4) = 62; bottom: conv 2->4 (72)
        # + bn (8) + conv 4->4 (144) + bn (8) = 232; up ConvT 4->2, 2x2 (32); dec0: conv 4->2 (72)
        # + bn (4) + conv 2->2 (36) + bn (4) = 116; head 1x1 2->2 + bias (6). 62+232+32+116+6.
        ("unet2d", {"upsampling": "transpose"}, 448),
        # the same with a 3x3 conv 4->2 (72) after the bilinear upsampling instead of ConvT (32)
        ("unet2d", {"upsampling": "bilinear"}, 488),
        # Çiçek channels, 3x3x3: enc0 conv 1->2 (54) + bn 4 + conv 2->4 (216) + bn 8 = 282;
        # bottom conv 4->4 (432) + bn 8 + conv 4->8 (864) + bn 16 = 1320; up ConvT3d 8->8, 2^3
        # (512); dec0 conv 12->4 (1296) + bn 8 + conv 4->4 (432) + bn 8 = 1744; head 4*2+2 = 10.
        ("unet3d", {}, 3868),
    ],
)
def test_parameter_count_by_hand(name: str, kwargs: dict[str, Any], count: int) -> None:
    model = create_model(name, in_chans=1, num_classes=2, width=2, depth=1, **kwargs)
    assert n_params(model) == count


def test_unet3d_matches_cicek_et_al() -> None:
    # Çiçek et al. 2016: "The architecture has 19069955 parameters in total" (3 channels in,
    # 3 labels): convolution weights and biases, up-convolutions without bias. We drop the
    # bias of each of the 14 convolutions BatchNorm follows and count BatchNorm's two vectors.
    with torch.device("meta"):
        model = create_model("unet3d", in_chans=3, num_classes=3)
    bn_channels = sum(m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm3d))
    assert bn_channels == 2336
    assert n_params(model) == 19_069_955 - bn_channels + 2 * bn_channels
    widths = [(b.conv1.out_channels, b.conv2.out_channels) for b in model.encoder]
    assert widths == [(32, 64), (64, 128), (128, 256), (256, 512)]
    assert [u.up.out_channels for u in model.ups] == [512, 256, 128]


def test_unet2d_is_ronneberger_shaped() -> None:
    with torch.device("meta"):
        model = create_model("unet2d", in_chans=1, num_classes=2)
    widths = [b.conv2.out_channels for b in model.encoder]
    assert widths == [64, 128, 256, 512, 1024]
    assert [u.up.out_channels for u in model.ups] == [512, 256, 128, 64]
    assert [b.conv1.in_channels for b in model.decoder] == [1024, 512, 256, 128]
    assert model.head.out_channels == 2 and model.num_features == 64
    assert isinstance(model, ModelBase) and model.total_stride == 16


def test_registry_options_and_refusals() -> None:
    model = unet("unet2d", num_classes=5, in_chans=1, width=8, depth=2, upsampling="bilinear")
    assert (model.width, model.depth, model.upsampling) == (8, 2, "bilinear")
    assert isinstance(model.ups[0].up[0], nn.Upsample)
    with pytest.raises(ConfigError, match="upsampling='nearest'") as err:
        create_model("unet2d", upsampling="nearest")
    assert "transpose, bilinear" in str(err.value)
    with pytest.raises(ConfigError, match="trilinear"):
        create_model("unet3d", upsampling="bilinear")
    with pytest.raises(ConfigError, match="depth=0"):
        create_model("unet2d", depth=0)
    assert unet("unet2d", width=8.0, depth=2).width == 8  # hyfi-verify --width passes a float
    with pytest.raises(ConfigError, match=r"width=2\.5"):
        create_model("unet2d", width=2.5)
    with pytest.raises(ConfigError, match="channels='x'"):
        create_model("unet2d", channels="x")
    with pytest.raises(ConfigError, match="levels") as err:
        create_model("unet2d", levels=3)
    assert "depth" in str(err.value)


def test_decoder_pads_at_the_bottom_right() -> None:
    """A 2x upsampled map one pixel short of its skip gets its zero row/column at the end."""
    up = UNet(width=2, depth=1, in_chans=1).ups[0]
    skip = torch.zeros(1, 2, 5, 7)
    x = torch.randn(1, 4, 2, 3)
    out = up(x, skip)
    assert out.shape == (1, 2 + 2, 5, 7)
    upsampled = out[:, 2:]
    assert torch.equal(upsampled[..., :4, :6], up.up(x))
    assert upsampled[..., 4, :].abs().sum() == 0 and upsampled[..., :, 6].abs().sum() == 0


def test_grad_checkpointing_changes_nothing() -> None:
    plain = unet("unet2d", num_classes=3, width=4, depth=2)
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    assert sum(1 for _ in ckpt.blocks()) == 5 and all(
        isinstance(b, DoubleConv) and b.grad_checkpointing for b in ckpt.blocks()
    )
    x = torch.randn(2, 3, 21, 18)
    target = torch.randint(0, 3, (2, 21, 18))
    for model in (plain, ckpt):
        F.cross_entropy(model(x), target).backward()
    for (n, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, n
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=n)
    for (n, a), (_, b) in zip(plain.named_buffers(), ckpt.named_buffers(), strict=True):
        assert torch.equal(a, b), n


def blobs(dims: int, n: int, side: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy images/volumes with one bright ball each, and the ball as the class-1 mask."""
    gen = torch.Generator().manual_seed(seed)
    axes = torch.meshgrid(*[torch.arange(side, dtype=torch.float32)] * dims, indexing="ij")
    images, masks = [], []
    for _ in range(n):
        centre = torch.rand(dims, generator=gen) * (side - 6) + 3
        radius = 2 + torch.rand(1, generator=gen) * 2
        dist2 = sum((a - c) ** 2 for a, c in zip(axes, centre, strict=True))
        mask = (dist2 <= radius**2).long()
        images.append(mask.float() + 0.3 * torch.randn(mask.shape, generator=gen))
        masks.append(mask)
    return torch.stack(images)[:, None], torch.stack(masks)


@pytest.mark.parametrize(("name", "side"), [("unet3d", 12), ("unet2d", 24)])
def test_sgd_learns_a_blob(name: str, side: int) -> None:
    model = unet(name, in_chans=1, num_classes=2, width=4, depth=2)
    x, y = blobs(model.dims, 4, side, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize(
    ("layers", "module"),
    [
        ((nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 3, 1)), "'0'"),  # an unpadded U-Net
        (
            (nn.Conv2d(3, 8, 3, padding=1), nn.MaxPool2d(3, 2, dilation=2), nn.Conv2d(8, 3, 1)),
            "'1'",
        ),
        ((nn.Conv2d(3, 8, 3, padding=1), nn.ConvTranspose2d(8, 3, 2, stride=3)), "'1'"),
    ],
)
def test_a_dense_output_off_the_tiles_grid_is_refused(
    layers: tuple[nn.Module, ...], module: str
) -> None:
    """A per-pixel model whose layer maps a tile to other than tile/stride crashed at the first
    step (a stage's planned shapes, a loss of mismatched sizes) with a traceback: refused in
    one line naming the layer. The same layers under a global pool are exact (test_zoo_mpi)."""
    from hyfi_imaging.parallel.apply import output_map
    from hyfi_imaging.parallel.meta import meta_copy

    with pytest.raises(ConfigError, match=f"^module {module}: maps a 32x16 tile to") as err:
        output_map(meta_copy(nn.Sequential(*layers)), 3, (32, 32), (32, 16))
    assert "\n" not in str(err.value)
    same = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, stride=2), nn.ConvTranspose2d(8, 3, 2, 2))
    assert output_map(meta_copy(same), 3, (32, 32), (32, 16)) is not None
    # A tile where the pixels an unpadded convolution takes off look like a stride (4 -> 2)
    valid = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 3, 1))
    with pytest.raises(ConfigError, match="not to the tile over a stride"):
        output_map(meta_copy(valid), 3, (4, 8), (4, 4))
