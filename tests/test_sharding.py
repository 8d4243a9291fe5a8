"""FSDP2 units (``parallel/sharding.py``): only modules whose forward runs can be units."""

from __future__ import annotations

import torch
from torch import nn

from hyfi_imaging.parallel.sharding import called_modules, shard_units


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 3)


class CallsChildren(nn.Module):
    """timm's MetaFormer head: ``self.head.norm(x)``, never ``self.head(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).mean((2, 3))
        return self.head.fc(self.head.norm(x))


def test_a_module_whose_forward_never_runs_is_no_unit() -> None:
    model = CallsChildren()
    called = called_modules(model, (1, 3, 16, 16))
    assert {"", "stem", "head.norm", "head.fc"} <= called and "head" not in called
    tile_names = {"stem.weight", "stem.bias"}
    units = [path for path, *_ in shard_units(model, tile_names, called=called)]
    assert sorted(units) == ["head.fc", "head.norm", "stem"]
    # Without knowing what runs, the head is one unit whose pre-hook never fires.
    assert sorted(path for path, *_ in shard_units(model, tile_names)) == ["head", "stem"]


def test_a_checkpointed_block_is_one_unit() -> None:
    """FSDP outside, recomputation inside: a unit within a checkpointed block would run its
    hooks again at recomputation (selective checkpointing failed on ResNet-18's wide layers)."""
    from hyfi_imaging.models import create_model
    from hyfi_imaging.parallel.pipeline import set_checkpointing

    model = create_model("resnet18", num_classes=2)
    small = 1 << 20  # forces the 2.4 MB blocks of layer3/layer4 to be split without checkpointing
    split = [p for p, *_ in shard_units(model, None, max_bytes=small)]
    assert any(p.count(".") >= 2 for p in split), split  # e.g. layer4.0.conv1
    set_checkpointing(model, "selective")
    whole = [p for p, *_ in shard_units(model, None, max_bytes=small)]
    assert not any(p.count(".") >= 2 for p in whole), whole
    assert "layer4.0" in whole


def test_a_scalar_parameter_is_refused_in_one_line() -> None:
    """FSDP2 cannot shard a 0-dim parameter (a learned temperature): ``fully_shard`` raised a
    ValueError from inside FSDP2 at the first layout that shards (verify_model on 1x2)."""
    import pytest

    from hyfi_imaging.errors import ConfigError
    from hyfi_imaging.parallel.sharding import stage_units

    model = nn.Sequential(nn.Conv2d(3, 4, 3))
    model.register_parameter("scale", nn.Parameter(torch.tensor(2.0)))
    with pytest.raises(ConfigError, match=r"parameter 'scale': is a 0-dim tensor.*torch.tensor\("):
        stage_units(model, None)
    model.scale = nn.Parameter(torch.tensor([2.0]))
    assert stage_units(model, None)[-1][0] == "(stage)"
