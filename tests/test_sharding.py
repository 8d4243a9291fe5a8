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
