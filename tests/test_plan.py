"""hyfi-plan without processes: units, candidates, ranking, the command line, parallel=auto."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyfi_imaging.cli.plan import main, memory_size
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models import create_model
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.plan import Candidate, candidates, predict, rank

ROOT = Path(__file__).resolve().parents[1]


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
    # FSDP2 shards gradients and momentum: less state per rank once the model is not tiny
    # (for a 0.7 M-parameter model the gathered units cost more than sharding saves).
    big = create_model("resnet50", num_classes=2)
    assert (
        predict(big, (256, 256), 1, Candidate(Layout(sp=(2, 2)))).state
        < predict(big, (256, 256), 1, Candidate(Layout())).state
    )


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


@pytest.fixture(scope="module")
def manifest(synthetic_cohort: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hyfi_imaging.preprocess import PreprocessOptions, run_preprocess

    out = tmp_path_factory.mktemp("plan_data")
    summary = run_preprocess(
        [synthetic_cohort.parent], out, PreprocessOptions(mpp=2.0, size=(256, 256)),
        labels_path=synthetic_cohort, progress=False, qc=False,
    )  # fmt: skip
    assert summary.manifest is not None
    return summary.manifest


def _recipe(tmp_path: Path, manifest: Path, model: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(
        f"dataset: {ROOT}/datasets/synthetic.yaml\nmodel: {{name: {model}}}\n"
        f"data: {{manifest: {manifest}}}\ntrain: {{out_dir: {tmp_path}/run, batch_size: 2}}\n"
    )
    return path


def test_parallel_auto_picks_a_layout_for_the_launched_ranks(
    tmp_path: Path, manifest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hyfi_imaging.train.config import load_recipe

    monkeypatch.setenv("WORLD_SIZE", "4")
    r = load_recipe(_recipe(tmp_path, manifest, "resnet18"), ["parallel=auto"])
    assert r.world_size == 4
    assert r.parallel.checkpointing in ("none", "selective", "full")


def test_fit_warning_names_the_layout_and_the_fix(tmp_path: Path, manifest: Path) -> None:
    from hyfi_imaging.train.autoplan import fit_warning
    from hyfi_imaging.train.config import load_recipe

    recipe = load_recipe(_recipe(tmp_path, manifest, "resnet18"))
    assert fit_warning(recipe) is None  # this machine's RAM holds it easily
    message = fit_warning(recipe, memory=2**20)  # a 1 MiB device does not
    assert message is not None and "GiB per rank" in message and "parallel=auto" in message
