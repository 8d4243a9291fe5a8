"""Pretrained weights (``model.weights``): real files from torchvision and timm, loaded by name.

Every file here is written by the library that makes such files (torchvision's
and timm's models, ``torch.save``, safetensors); the checks compare tensors
after the load and the model's output with torchvision's own, and read the one
line the user reads.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models import ResNetV2, create_model
from hyfi_imaging.models.memory_format import to_channels_last
from hyfi_imaging.models.weights import adapt_input_conv, load_weights, read_state_dict
from hyfi_imaging.train.config import load_recipe
from hyfi_imaging.train.inputs import build_model

torchvision = pytest.importorskip("torchvision")


def _tensors_equal(model: nn.Module, state: dict[str, torch.Tensor], skip: str = "fc.") -> None:
    got = model.state_dict()
    names = [k for k in state if not k.startswith(skip)]
    assert names and all(torch.equal(got[k], state[k]) for k in names), [
        k for k in names if not torch.equal(got[k], state[k])
    ][:5]


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
def test_torchvision_state_dict_loads_into_the_project_resnet(arch: str, tmp_path: Path) -> None:
    """torchvision's names are the project's (the mapping is the identity): all 1000-class
    tensors load, and the two models compute the same logits."""
    torch.manual_seed(0)
    tv = getattr(torchvision.models, arch)().eval()
    with torch.no_grad():  # non-trivial BatchNorm statistics, so a mix-up of buffers shows
        for m in tv.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    path = tmp_path / f"{arch}.pth"
    torch.save(tv.state_dict(), path)
    model = create_model(arch, num_classes=1000).eval()
    report = load_weights(model, path)
    n = len(tv.state_dict())
    assert report.line == f"weights {arch}.pth: {n} loaded, 0 skipped, 0 missing, 0 unexpected"
    _tensors_equal(model, tv.state_dict(), skip="-")
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), tv(x), rtol=0, atol=1e-5)


def test_a_head_of_another_class_count_is_skipped_in_the_one_line(tmp_path: Path) -> None:
    tv = torchvision.models.resnet18()
    path = tmp_path / "imagenet.pth"
    torch.save(tv.state_dict(), path)
    model = create_model("resnet18", num_classes=2)
    head_before = model.fc.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning flood: not a single one
        report = load_weights(model, path)
    assert report.line == (
        "weights imagenet.pth: 120 loaded, 2 skipped (fc.weight [1000, 512] -> [2, 512], "
        "fc.bias [1000] -> [2]: the head is new), 0 missing, 0 unexpected"
    )
    assert torch.equal(model.fc.weight, head_before)  # the new head keeps its initialisation
    _tensors_equal(model, tv.state_dict())


def test_a_timm_checkpoint_with_state_dict_and_module_prefixes(tmp_path: Path) -> None:
    """timm's train.py checkpoint: ``state_dict`` (of a DDP model) beside ``args`` and more."""
    timm = pytest.importorskip("timm")
    src = timm.create_model("resnet18", num_classes=3)
    state = {f"module.{k}": v for k, v in src.state_dict().items()}
    ckpt = {
        "epoch": 7,
        "arch": "resnet18",
        "state_dict": state,
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]},
        "args": argparse.Namespace(lr=0.1, model="resnet18"),
        "version": 2,
    }
    path = tmp_path / "checkpoint-7.pth.tar"
    torch.save(ckpt, path)
    model = create_model("resnet18", num_classes=3)
    report = load_weights(model, path)
    n = len(state)
    assert report.line == (
        f"weights checkpoint-7.pth.tar: {n} loaded, 0 skipped, 0 missing, 0 unexpected; "
        "from its 'state_dict'; 'module.' removed from the names"
    )
    _tensors_equal(model, src.state_dict(), skip="-")


def test_a_torchvision_reference_checkpoint_under_model_of_a_compiled_model(
    tmp_path: Path,
) -> None:
    tv = torchvision.models.resnet18(num_classes=4)
    state = {f"_orig_mod.module.{k}": v for k, v in tv.state_dict().items()}
    path = tmp_path / "model_10.pth"
    torch.save({"model": state, "epoch": 10, "args": argparse.Namespace(lr=0.5)}, path)
    tensors, notes = read_state_dict(path)
    assert set(tensors) == set(tv.state_dict())
    assert notes == ("from its 'model'", "'_orig_mod.' and 'module.' removed from the names")


def test_a_changed_channel_count_adapts_the_first_conv_as_timm_does(tmp_path: Path) -> None:
    timm_manipulate = pytest.importorskip("timm.models._manipulate")
    torch.manual_seed(1)
    w = torch.randn(64, 3, 7, 7)
    for c in (1, 2, 3, 4, 5, 8):
        assert torch.equal(adapt_input_conv(c, w), timm_manipulate.adapt_input_conv(c, w)), c
    half = w.half()
    assert torch.equal(adapt_input_conv(5, half), timm_manipulate.adapt_input_conv(5, half))
    # Into the model: a 1-channel and a 5-channel ResNet-18 from ImageNet's 3 channels.
    tv = torchvision.models.resnet18()
    path = tmp_path / "rgb.pth"
    torch.save(tv.state_dict(), path)
    for c in (1, 5):
        model = create_model("resnet18", num_classes=1000, in_chans=c)
        report = load_weights(model, path)
        assert report.adapted == (("conv1.weight", 3, c),)
        assert report.line.endswith(
            f"; conv1.weight: 3 -> {c} input channels (timm's adapt_input_conv)"
        )
        expect = timm_manipulate.adapt_input_conv(c, tv.conv1.weight.detach())
        assert torch.equal(model.conv1.weight, expect)
    with pytest.raises(ConfigError, match="cannot adapt"):
        adapt_input_conv(0, w)


def test_timm_resnetv2_names_map_onto_the_project_resnet_v2(tmp_path: Path) -> None:
    """A timm pre-activation ResNetV2 of the project's shape (3 stages of 16/32/64): every
    tensor but the stem (timm's is 7x7, the project's 3x3) loads under the project's name."""
    pytest.importorskip("timm")
    from timm.layers import BatchNormAct2d, create_conv2d
    from timm.models.resnetv2 import ResNetV2 as TimmResNetV2

    src = TimmResNetV2(
        layers=[1, 1, 1], channels=(16, 32, 64), stem_chs=16, basic=True, bottle_ratio=1.0,
        conv_layer=create_conv2d, norm_layer=BatchNormAct2d, num_classes=10,
    )  # fmt: skip
    path = tmp_path / "resnetv2.pth"
    torch.save(src.state_dict(), path)
    model = ResNetV2(depth=8, num_classes=10)
    report = load_weights(model, path)
    s = src.state_dict()
    assert report.skipped == (("conv1.weight", (16, 3, 7, 7), (16, 3, 3, 3)),)
    assert "1 skipped (conv1.weight [16, 3, 7, 7] -> [16, 3, 3, 3]: the stem is new)" in report.line
    assert (report.missing, report.unexpected) == ((), ())
    assert len(report.loaded) == len(s) - 1
    assert "names mapped from timm ResNetV2" in report.line
    assert "fc.weight: a 1x1 convolution's, taken as a Linear's" in report.line
    got = model.state_dict()
    assert torch.equal(
        got["layer2.0.downsample.weight"], s["stages.1.blocks.0.downsample.conv.weight"]
    )
    assert torch.equal(got["layer3.0.bn2.running_var"], s["stages.2.blocks.0.norm2.running_var"])
    assert torch.equal(got["bn.weight"], s["norm.weight"])
    assert torch.equal(got["fc.weight"], s["head.fc.weight"].flatten(1))


def test_a_safetensors_file(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tv = torchvision.models.resnet18()
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(tv.state_dict(), str(path))
    model = create_model("resnet18", num_classes=1000)
    assert load_weights(model, path).line.startswith("weights model.safetensors: 122 loaded, 0 ")
    _tensors_equal(model, tv.state_dict(), skip="-")


def _one_line(path: Path, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        load_weights(create_model("resnet18", num_classes=2), path)
    assert "\n" not in str(err.value) and str(err.value).startswith(str(path)), str(err.value)


def test_bad_files_are_refused_in_one_line(tmp_path: Path) -> None:
    _one_line(tmp_path / "nope.pth", "no such weights file")
    _one_line(tmp_path, "is a folder, not a weights file")
    (tmp_path / "empty.pth").write_bytes(b"")
    _one_line(tmp_path / "empty.pth", "is an empty file")
    (tmp_path / "notes.txt").write_text("these are not weights\n")
    _one_line(tmp_path / "notes.txt", "is not a PyTorch .* or safetensors weights file")
    # A whole pickled model: unpickling it would call its classes; the weights-only load refuses.
    torch.save(torchvision.models.resnet18(), tmp_path / "whole.pth")
    _one_line(
        tmp_path / "whole.pth", r"names torchvision\.models\.resnet\.ResNet, which a weights-only"
    )
    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "meta.pth")
    _one_line(tmp_path / "meta.pth", r"holds no state dict \(a dict of epoch, lr")
    torch.save({"encoder.w": torch.ones(2)}, tmp_path / "other.pth")
    _one_line(tmp_path / "other.pth", "no weight of the file fits the model")
    # Another width: the counters (num_batches_tracked) fit, the weights do not.
    torch.save(create_model("resnet18", width=0.25).state_dict(), tmp_path / "narrow.pth")
    _one_line(
        tmp_path / "narrow.pth",
        r"99 tensors have other shapes than the model's \(bn1.weight \[16\] -> \[64\], .*"
        r"weights of another architecture",
    )
    # Another depth: loaded halfway, a partly random model trained as if pretrained
    torch.save(torchvision.models.resnet34().state_dict(), tmp_path / "deeper.pth")
    _one_line(tmp_path / "deeper.pth", r"96 tensors of the file are not in the model \(layer1.2")
    torch.save(create_model("resnet18").state_dict(), tmp_path / "shallower.pth")
    with pytest.raises(ConfigError, match=r"80 of the model's are not in the file"):
        load_weights(create_model("resnet34", num_classes=2), tmp_path / "shallower.pth")
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "cut.pth")
    data = (tmp_path / "cut.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])
    _one_line(tmp_path / "cut.pth", "cannot be read as PyTorch weights")
    # Damaged tensor data: torch.load reads a zip without its CRCs (values off by 1e4, loaded
    # without a word); the file's own CRCs refuse it
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "flipped.pth")
    data = bytearray((tmp_path / "flipped.pth").read_bytes())
    data[len(data) // 2 : len(data) // 2 + 300] = bytes(300)
    (tmp_path / "flipped.pth").write_bytes(bytes(data))
    _one_line(tmp_path / "flipped.pth", r"is damaged \(its entry .* fails its CRC check\)")
    diverged = torchvision.models.resnet18().state_dict()
    diverged["layer1.0.conv1.weight"][0, 0, 0, 0] = float("nan")
    torch.save(diverged, tmp_path / "nan.pth")
    _one_line(tmp_path / "nan.pth", r"holds NaN or inf in layer1.0.conv1.weight")
    # The user's own path, '..' and all (refused as an id climbing out of its folder)
    (tmp_path / "sub").mkdir()
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "fine.pth")
    assert load_weights(create_model("resnet18"), tmp_path / "sub" / ".." / "fine.pth").loaded


#: The weights a user's builder loads (real tensors, filled by the test).
_USER_WEIGHTS: dict[str, torch.Tensor] = {}


def _user_builder(num_classes: int = 2, **_: object) -> nn.Module:
    """A user's own builder that loads weights itself (the issue's "480 warnings")."""
    model = torchvision.models.resnet18()
    model.load_state_dict(_USER_WEIGHTS)
    model.fc = nn.Linear(512, num_classes)
    return model


def test_a_channels_last_recipe_lays_out_each_weight_by_its_dims() -> None:
    """``model.memory_format: channels_last``: 2-D convolutions' weights channels-last,
    3-D ones channels-last-3d (one model may hold both), the rest as built; same values."""
    sets = ["data.manifest=m.csv", "train.out_dir=o", "model.memory_format=channels_last"]
    recipe = load_recipe(Path("synthetic"), sets)
    torch.manual_seed(0)
    model = build_model(recipe, 3)
    torch.manual_seed(0)
    plain = build_model(load_recipe(Path("synthetic"), sets[:2]), 3)
    _tensors_equal(model, plain.state_dict())
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert not model.conv1.weight.is_contiguous() and plain.conv1.weight.is_contiguous()
    assert model.fc.weight.is_contiguous()
    both = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv3d(4, 4, 3), nn.Linear(4, 2))
    to_channels_last(both)
    assert both[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert both[1].weight.is_contiguous(memory_format=torch.channels_last_3d)
    assert not both[1].weight.is_contiguous() and both[2].weight.is_contiguous()


def test_a_recipes_num_classes_is_the_tasks() -> None:
    """``model.kwargs.num_classes`` reached the builder twice: a TypeError traceback."""
    sets = ["data.manifest=m.csv", "train.out_dir=o", "model.kwargs.num_classes=2"]
    with pytest.raises(ConfigError, match=r"^model.kwargs.num_classes: is set by the task"):
        build_model(load_recipe(Path("synthetic"), sets), 3)


def test_the_recipe_loads_weights_where_the_model_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``model.weights`` in a recipe: the trainer's build loads them and says one line; the
    preflight's meta-device build reads and matches the file, copies nothing and says
    nothing; the planners' builds do not read it."""
    monkeypatch.chdir(tmp_path)
    tv = torchvision.models.resnet18()
    torch.save(tv.state_dict(), tmp_path / "imagenet.pth")
    # The shipped recipe's resnet18 is a quarter wide: full width here, as ImageNet's.
    sets = ["data.manifest=m.csv", "train.out_dir=o", "model.weights=imagenet.pth",
            "model.kwargs.width=1"]  # fmt: skip
    recipe = load_recipe(Path("synthetic"), sets)  # resnet18, classes 0 and 1
    assert recipe.model.weights == Path("imagenet.pth")
    caplog.set_level(logging.WARNING, logger="hyfi_imaging.train")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = build_model(recipe, 3, pretrained=True)
        with torch.device("meta"):
            build_model(recipe, 3, pretrained=True)
    assert [r.getMessage() for r in caplog.records] == [
        "weights imagenet.pth: 120 loaded, 2 skipped (fc.weight [1000, 512] -> [2, 512], "
        "fc.bias [1000] -> [2]: the head is new), 0 missing, 0 unexpected"
    ]
    _tensors_equal(model, tv.state_dict())
    assert not torch.equal(build_model(recipe, 3).conv1.weight, tv.conv1.weight)  # planners
    gone = load_recipe(Path("synthetic"), [*sets[:2], "model.weights=gone.pth"])
    with torch.device("meta"), pytest.raises(ConfigError, match=r"gone\.pth: no such weights file"):
        build_model(gone, 3, pretrained=True)
    # A user's builder that loads weights itself: its meta-device build is silent too.
    _USER_WEIGHTS.update(tv.state_dict())
    user = load_recipe(Path("synthetic"), [*sets[:2], "model.name=test_weights:_user_builder"])
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("error")
        build_model(user, 3)
