"""Recipe schema, card composition, overrides and one-line errors; checkpoints in one process."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.train.checkpoint import (
    MARKER,
    list_checkpoints,
    load_latest,
    optimizer_state,
    save_checkpoint,
)
from hyfi_imaging.train.config import load_recipe, parse_overrides
from hyfi_imaging.train.trainer import lr_at

ROOT = Path(__file__).resolve().parents[1]


def _recipe(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(body)
    return path


BASIC = f"""
dataset: {ROOT}/datasets/synthetic.yaml
model: {{name: resnet18, kwargs: {{width: 0.25}}}}
data: {{manifest: m.csv}}
parallel: {{spatial: 2x2, pipeline: 2, data: 2}}
train: {{out_dir: runs/x, epochs: 2, batch_size: 2}}
"""


def test_recipe_composes_cards_and_overrides(tmp_path: Path) -> None:
    r = load_recipe(
        _recipe(tmp_path, BASIC), ["train.epochs=5", "optim.lr=0.01", "parallel.spatial=1x3"]
    )
    assert r.data.classes == ["0", "1"] and r.data.task == "binary"
    assert (r.train.epochs, r.optim.lr, r.parallel.spatial) == (5, 0.01, (1, 3))
    assert r.world_size == 2 * 2 * 3


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_are_valid(recipe: Path) -> None:
    r = load_recipe(recipe)
    assert r.world_size >= 1 and r.data.classes
    assert "hyfi-train" in recipe.read_text().split("\nname:")[0]  # launch command in the header


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.epoch=3"], "unknown key 'train.epoch'; did you mean train.epochs?"),
        (["trian.epochs=3"], "did you mean train?"),
        (["parallel.spatial=2by2"], "parallel.spatial"),
        (["optim.lr=-1"], "optim.lr: Input should be greater than 0"),
        (["parallel.checkpointing=sometimes"], "use none, full, selective or every:N"),
        (["optim.name=lamb"], "optim.name"),
    ],
)
def test_recipe_errors_are_one_line(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_recipe(_recipe(tmp_path, BASIC), overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_missing_sections_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'train' is required"):
        load_recipe(_recipe(tmp_path, "model: resnet18\ndata: {manifest: m, classes: [a, b]}\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_recipe(_recipe(tmp_path, "model: [unclosed\n"))
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_overrides(["train.epochs"])


def test_learning_rate_schedule(tmp_path: Path) -> None:
    r = load_recipe(
        _recipe(tmp_path, BASIC), ["optim.warmup_steps=4", "optim.lr=1.0", "optim.min_lr=0.1"]
    )
    lrs = [lr_at(s, r, 20) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(1.0) and lrs[-1] == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(15 / 16 * torch.pi)).item())
    )
    assert all(a >= b for a, b in itertools.pairwise(lrs[4:]))


def _model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(2, 3, 8, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_checkpoints_roundtrip_keep_last_and_skip_corrupt(tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        _step(model, opt)
        state = {
            "model": model.state_dict(),
            "optim": optimizer_state(model.named_parameters(), opt, for_load=False),
        }
        save_checkpoint(root, step, state, {"epoch": 0, "batch": step}, keep=2)
    assert [p.name for p in list_checkpoints(root)] == ["step_00000003", "step_00000002"]
    (root / "step_00000009.partial").mkdir()  # a crash mid-save is never a checkpoint
    assert len(list_checkpoints(root)) == 2
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = {
        k: v.clone()
        for k, v in optimizer_state(model.named_parameters(), opt, for_load=False).items()
    }

    fresh, fresh_opt = _model_and_opt()
    state = {
        "model": fresh.state_dict(),
        "optim": optimizer_state(fresh.named_parameters(), fresh_opt, for_load=True),
    }
    path, meta = load_latest(root, state) or (None, {})
    assert path == root / "step_00000003" and meta["batch"] == 3
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k
    for k, v in optimizer_state(fresh.named_parameters(), fresh_opt, for_load=False).items():
        assert torch.equal(v, want_opt[k]), k

    # Corrupt the newest: its shard is truncated -> the previous checkpoint is used.
    for shard in (root / "step_00000003").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:10])
    path, meta = load_latest(root, state) or (None, {})
    assert path == root / "step_00000002"
    assert json.loads((path / MARKER).read_text())["step"] == 2
