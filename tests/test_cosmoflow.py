"""Tests of hyfi_imaging.models.cosmoflow in one process: the MLPerf HPC CosmoFlow network.

The reference configuration's parameter count (derived by hand in
``models/cosmoflow.yaml``), its layer shapes, TensorFlow's 'same' padding for
the even kernel, the chain contract, options and refusals, and that a few
optimizer steps fit a tiny random regression problem.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models import ChainModel, CosmoFlow, ScaledTanh, create_model

torch.set_num_threads(1)

TINY = {"size": 16, "n_conv_layers": 2, "width": 4, "fc_sizes": (16, 8)}


def tiny(seed: int = 0, **kwargs: object) -> CosmoFlow:
    torch.manual_seed(seed)
    model = create_model("cosmoflow", **{**TINY, **kwargs})
    assert isinstance(model, CosmoFlow)
    return model


def test_reference_configuration() -> None:
    """configs/cosmo.yaml: 4 x 128^3, conv_size 32, 5 conv layers of kernel 2, fc 128 and 64."""
    with torch.device("meta"):
        model = create_model("cosmoflow")
    assert isinstance(model, ChainModel)
    # convs 1056 + 16448 + 65664 + 262400 + 1049088; dense 4194432 + 8256 + 260
    assert sum(p.numel() for p in model.parameters()) == 5_597_604
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["block1.conv.weight"] == (32, 4, 2, 2, 2)
    assert shapes["block5.conv.weight"] == (512, 256, 2, 2, 2)
    assert shapes["fc1.weight"] == (128, 512 * 4**3)
    assert shapes["fc2.weight"] == (64, 128)
    assert shapes["fc3.weight"] == (4, 64)
    assert (model.in_chans, model.num_classes, model.num_features) == (4, 4, 512)
    assert (model.total_stride, model.dims, model.head_start) == (32, 3, 5)
    assert model.block1.act.negative_slope == 0.3  # Keras's LeakyReLU default
    assert model.drop1.p == 0.5 and model.drop2.p == 0.5
    assert isinstance(model.out_act, ScaledTanh) and model.out_act.scale == 1.2


def test_same_padding_is_tensorflows() -> None:
    """Kernel 2, 'same': no pad before, one voxel after (TF and PyTorch's padding='same')."""
    block = tiny().block1
    x = torch.randn(1, 4, 5, 6, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch warns about the copy an even kernel needs
        out = block.conv(x)
    assert out.shape[-3:] == (5, 6, 7)
    padded = F.pad(x, (0, 1) * 3)  # TensorFlow's 'SAME' for kernel 2: one voxel after each axis
    torch.testing.assert_close(out, F.conv3d(padded, block.conv.weight, block.conv.bias))
    first = F.conv3d(x[..., :2, :2, :2], block.conv.weight, block.conv.bias)
    torch.testing.assert_close(out[..., :1, :1, :1], first)


@pytest.mark.parametrize("size", [16, 19])
def test_output_shape_range_and_chain(size: int) -> None:
    model = tiny(size=size).eval()
    x = torch.randn(3, 4, size, size, size)
    out = model(x)
    assert out.shape == (3, 4) and out.abs().max() < 1.2
    feats = model.forward_features(x)
    assert feats.shape == (3, model.num_features, size // 4, size // 4, size // 4)
    assert torch.equal(model.forward_head(feats), out)
    chained = x
    for child in model.children():
        chained = child(chained)
    assert torch.equal(chained, out)
    assert not isinstance(tiny(scaled_tanh=False).out_act, ScaledTanh)


def test_options_and_refusals() -> None:
    model = tiny(in_chans=1, num_classes=3, dropout=0.1, negative_slope=0.2, kernel_size=3)
    assert model.block1.conv.weight.shape == (4, 1, 3, 3, 3)
    assert model.fc3.out_features == 3 and model.drop1.p == 0.1
    assert model(torch.randn(2, 1, 16, 16, 16)).shape == (2, 3)
    with pytest.raises(ConfigError, match="size=16 is too small") as err:
        create_model("cosmoflow", size=16)
    assert "size >= 32" in str(err.value)
    with pytest.raises(ConfigError, match="dropout"):
        create_model("cosmoflow", dropout=1.0)
    with pytest.raises(ConfigError, match="conv_size") as err:
        create_model("cosmoflow", conv_size=16)
    assert "width" in str(err.value)


def test_the_flatten_head_names_the_sizes_it_takes() -> None:
    """The reference's head reads the whole last map: another volume size is one line naming
    the sides that fit (not a matrix product's shape error deep in the forward pass)."""
    model = tiny()  # size 16, 2 pools: a 4x4x4 map
    model.check_input_size((16, 19, 17))  # floors to 4x4x4 as well
    with pytest.raises(ConfigError) as err:
        model.check_input_size((8, 8, 12))
    text = str(err.value)
    assert "\n" not in text and "16 to 19 voxels a side" in text and "2x2x3" in text
    assert "head='pool'" in text and "size=" not in text.split(";")[1]  # no cube fits 2x2x3
    with pytest.raises(ConfigError, match="size=8 for this one"):
        model.check_input_size((8, 8, 8))
    with pytest.raises(ConfigError, match="a volume"):
        model.check_input_size((16, 16))


@pytest.mark.parametrize("size", [(8, 9, 13), (16, 16, 16), (12, 20, 31)])
def test_the_pool_head_takes_any_size(size: tuple[int, int, int]) -> None:
    model = tiny(head="pool").eval()
    assert model.input_size is None and isinstance(model.global_pool, nn.AdaptiveAvgPool3d)
    assert model.fc1.in_features == model.num_features  # not num_features x (size / 4)^3
    model.check_input_size(size)
    x = torch.randn(2, 4, *size)
    out = model(x)
    assert out.shape == (2, 4)
    chained = x
    for child in model.children():  # still a chain: pipeline stages cut anywhere
        chained = child(chained)
    assert torch.equal(chained, out)
    with pytest.raises(ConfigError, match="too small for 2 pools"):
        model.check_input_size((3, 16, 16))


def test_the_pool_variant_and_its_options() -> None:
    with torch.device("meta"):
        model = create_model("cosmoflow-pool", width=8.0)  # hyfi-verify --width passes a float
    assert isinstance(model, CosmoFlow) and model.head == "pool"
    assert model.block1.conv.out_channels == 8 and model.fc1.in_features == 8 * 16
    with pytest.raises(ConfigError, match="head='mean' is not known"):
        create_model("cosmoflow", head="mean")
    with pytest.raises(ConfigError, match=r"width=2\.5 is not a whole number"):
        create_model("cosmoflow", width=2.5)


def test_grad_checkpointing_changes_nothing() -> None:
    plain = tiny(dropout=0.0)
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    assert sum(1 for b in ckpt.blocks() if b.grad_checkpointing) == 2
    x = torch.randn(2, 4, 16, 16, 16)
    for model in (plain, ckpt):
        model(x).square().sum().backward()
    for (n, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, n
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=n)


def test_training_reduces_the_loss() -> None:
    """Regress 4 targets in [-1, 1] from 8 random volumes: the MSE falls (memorisation)."""
    model = tiny(dropout=0.0)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 4, 16, 16, 16, generator=gen)
    y = torch.rand(8, 4, generator=gen) * 2 - 1
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
