"""hyfi-plan without processes: units, candidates, ranking, the command line, parallel=auto."""

from __future__ import annotations

import pytest

from hyfi_imaging.cli.plan import main, memory_size
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models import create_model
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.plan import Candidate, candidates, predict, rank


def test_memory_sizes() -> None:
    assert memory_size("80GiB") == 80 * 2**30
    assert memory_size("512 MiB") == 512 * 2**20
    assert memory_size("40GB") == 40 * 10**9
    assert memory_size("1024") == 1024
    with pytest.raises(ConfigError):
        memory_size("lots")


def test_candidates_multiply_to_the_devices() -> None:
    model = create_model("resnet18", num_classes=2, width=0.25)
    cands = list(candidates(model, (512, 512), 4, 2))
    assert cands and all(c.layout.world_size == 4 for c in cands)
    assert {c.checkpointing for c in cands} == {"none", "selective", "full"}
    assert any(c.layout.pp == 2 and c.schedule == "1f1b" for c in cands)


def test_more_tiles_and_checkpointing_need_less_memory() -> None:
    model = create_model("resnet18", num_classes=2, width=0.25)
    one = predict(model, (512, 512), 1, Candidate(Layout()))
    four = predict(model, (512, 512), 1, Candidate(Layout(sp=(2, 2))))
    ck = predict(model, (512, 512), 1, Candidate(Layout(sp=(2, 2)), checkpointing="full"))
    assert four.activations < 0.3 * one.activations
    assert ck.activations < four.activations
    assert four.state < one.state  # FSDP2 shards gradients and momentum


def test_rank_puts_fitting_layouts_first() -> None:
    model = create_model("resnet18", num_classes=2, width=0.25)
    preds = [predict(model, (512, 512), 1, c) for c in candidates(model, (512, 512), 2, 1)]
    small = min(p.peak for p in preds)
    ranked = rank(preds, small)
    assert ranked[0].peak <= small
    assert all(p.peak > small for p in ranked[1:] if p.peak > small)


def test_cli_recommends_and_prints_recipe_lines(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--model", "resnet18", "--width", "0.25", "--image-size", "1024",
                 "--devices", "4", "--device-memory", "1GiB", "--rate", "1e10", "--top", "3"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "recommended:" in out and "parallel:" in out and "spatial:" in out


def test_cli_says_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--model", "resnet18", "--image-size", "1024", "--devices", "1",
                 "--device-memory", "1MiB", "--rate", "1e10"])  # fmt: skip
    assert code == 1
    assert "no layout fits" in capsys.readouterr().out


def test_cli_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "resnet18"]) == 2
    assert "needs a recipe" in capsys.readouterr().err
