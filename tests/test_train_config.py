"""Recipe schema, card composition, overrides and one-line errors; checkpoints in one process."""

from __future__ import annotations

import itertools
import json
import resource
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.train.checkpoint import (
    MARKER,
    CheckpointError,
    _disk_reason,
    _reason,
    install_optimizer_state,
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
    assert r.world_size >= 1 and (r.data.classes or r.task.name == "regression")
    assert "hyfi-train" in recipe.read_text().split("\nname:")[0]  # launch command in the header


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.epoch=3"], "unknown key 'train.epoch'; did you mean train.epochs?"),
        (["trian.epochs=3"], "did you mean train?"),
        (["parallel.spatial=2by2"], "parallel.spatial"),
        (["optim.lr=-1"], "optim.lr: Input should be greater than 0"),
        (["parallel.checkpointing=sometimes"], "use none, full, selective, deep or every:N"),
        (["optim.name=lamb"], "optim.name"),
        (["parallel.streaming=rows"], "parallel.streaming: Input should be 'none' or 'stem'"),
        (["task.name=detection"], "task.name: Input should be 'classification', 'segmentation'"),
        (["task.lost=mse"], "did you mean task.loss?"),
        (["model.memory_format=nhwc"], "model.memory_format: Input should be 'nchw' or"),
        # equal grids were never counted against the stages ([1x2, 1x1, 1x1] was refused)
        (
            ["parallel.pipeline=2", "parallel.spatial=[1x2,1x2,1x2]"],
            "3 stage grids for 2 pipeline stages",
        ),
    ],
)
def test_recipe_errors_are_one_line(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_recipe(_recipe(tmp_path, BASIC), overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_recipe_takes_the_engines_modes_and_backends() -> None:
    """The recipe's parallel section (kept free of torch) lists checkpointing modes and
    compile backends of its own: they must be the engine's."""
    from typing import get_args

    from pydantic import ValidationError

    from hyfi_imaging.parallel.parallel_plan import COMPILE_BACKENDS
    from hyfi_imaging.parallel.pipeline import parse_checkpointing
    from hyfi_imaging.train.config import ParallelConfig

    assert get_args(ParallelConfig.model_fields["compile"].annotation) == (
        "none",
        *COMPILE_BACKENDS,
    )
    for mode in ("none", "full", "selective", "deep", "every:3", "every:0", "some", "deeper"):
        try:
            parse_checkpointing(mode)
            engine = True
        except ConfigError:
            engine = False
        try:
            ParallelConfig(checkpointing=mode)
            recipe = True
        except ValidationError:
            recipe = False
        assert recipe == engine, mode


def test_missing_sections_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'train' is required"):
        load_recipe(_recipe(tmp_path, "model: resnet18\ndata: {manifest: m, classes: [a, b]}\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_recipe(_recipe(tmp_path, "model: [unclosed\n"))
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_overrides(["train.epochs"])
    with pytest.raises(ConfigError, match=r"--set: 'train.epochs=\[1': the value expected"):
        parse_overrides(["train.epochs=[1"])  # was a 20-line YAML traceback


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("train.seed=-1", "train.seed: Input should be greater than or equal to 0"),
        ("train.seed=99999999999999999999999", "train.seed: Input should be less than"),
        ("optim.lr=.inf", "optim.lr: Input should be a finite number"),
        ("optim.lr=1e400", "optim.lr: Input should be a finite number"),
        ("optim.momentum=.nan", "optim.momentum: Input should be a finite number"),
        ("train.epochs=true", "train.epochs: Value error, is true, not a number"),
    ],
)
def test_values_that_passed_the_check_and_failed_the_run_are_refused(
    tmp_path: Path, setting: str, said: str
) -> None:
    """A negative or 64-bit-overflowing seed was a traceback (numpy, torch) after the run
    folder was made; an infinite rate passed --check and --print-sbatch and made the first
    steps' loss nan after a job's queue wait; true trained 1 epoch."""
    with pytest.raises(ConfigError, match=said):
        load_recipe(_recipe(tmp_path, BASIC), [setting])


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


def _state_of(model: nn.Module, opt: torch.optim.Optimizer, *, for_load: bool) -> dict:
    return {
        "model": model.state_dict(),
        "optim": optimizer_state(model.named_parameters(), opt, for_load=for_load),
    }


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    flat = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for k, v in optimizer_state(model.named_parameters(), opt, for_load=False).items():
        flat[f"optim/{k}"] = v.clone()
    return flat


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _corrupt(checkpoint: Path) -> None:
    for shard in checkpoint.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:10])


def test_checkpoints_roundtrip_keep_last_and_skip_corrupt(tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        _step(model, opt)
        save_checkpoint(
            root, step, _state_of(model, opt, for_load=False), {"epoch": 0, "batch": step}, keep=2
        )
    assert [p.name for p in list_checkpoints(root)] == ["step_00000003", "step_00000002"]
    (root / "step_00000009.partial").mkdir()  # a crash mid-save is never a checkpoint
    assert len(list_checkpoints(root)) == 2
    want = _snapshot(model, opt)

    fresh, fresh_opt = _model_and_opt()
    state = _state_of(fresh, fresh_opt, for_load=True)
    found = load_latest(root, state)
    assert found is not None and found.path == root / "step_00000003" and found.meta["batch"] == 3
    install_optimizer_state(fresh.named_parameters(), fresh_opt, state["optim"])
    assert _same(_snapshot(fresh, fresh_opt), want)

    # Corrupt the newest: its shard is truncated -> the previous checkpoint is used.
    _corrupt(root / "step_00000003")
    found = load_latest(root, _state_of(fresh, fresh_opt, for_load=True))
    assert found is not None and found.path == root / "step_00000002"
    assert [p.name for p, _ in found.skipped] == ["step_00000003"]
    assert json.loads((found.path / MARKER).read_text())["step"] == 2


def test_bytes_flipped_in_a_shard_are_damage_not_other_weights(tmp_path: Path) -> None:
    """DCP keeps no checksum: a shard whose bytes changed (its size kept) loaded as other
    weights and a resumed run trained from them. The marker's CRC-32s catch it."""
    model, opt = _model_and_opt()
    root = tmp_path / "ckpt"
    for step in (1, 2):
        _step(model, opt)
        save_checkpoint(root, step, _state_of(model, opt, for_load=False), {}, keep=5)
    newest = root / "step_00000002"
    (shard,) = newest.glob("*.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x08
    shard.write_bytes(bytes(data))
    fresh, fresh_opt = _model_and_opt()
    found = load_latest(root, _state_of(fresh, fresh_opt, for_load=True))
    assert found is not None and found.path == root / "step_00000001"
    ((path, why),) = found.skipped
    assert path == newest and f"{shard.name} does not match its checksum" in why
    # a marker of an earlier version (no checksums) still loads
    marker = json.loads((newest / MARKER).read_text())
    del marker["crc32"]
    (newest / MARKER).write_text(json.dumps(marker))
    found = load_latest(root, _state_of(fresh, fresh_opt, for_load=True))
    assert found is not None and found.path == newest


def test_a_frozen_parameter_without_optimizer_state_resumes(tmp_path: Path) -> None:
    """A frozen layer (fine-tuning) never gets optimizer state: the load asked for its zero
    placeholders, DCP refused them as missing keys and no checkpoint of such a run loaded."""
    model, opt = _model_and_opt()
    model[0].weight.requires_grad_(False)
    root = tmp_path / "ckpt"
    _step(model, opt)
    save_checkpoint(root, 1, _state_of(model, opt, for_load=False), {}, keep=2)
    want = _snapshot(model, opt)
    fresh, fresh_opt = _model_and_opt()
    fresh[0].weight.requires_grad_(False)
    state = _state_of(fresh, fresh_opt, for_load=True)
    assert "0.weight/exp_avg" in state["optim"]  # the placeholder the load asks for
    found = load_latest(root, state, optional="optim")
    assert found is not None and "0.weight/exp_avg" not in state["optim"]
    install_optimizer_state(fresh.named_parameters(), fresh_opt, state["optim"])
    assert _same(_snapshot(fresh, fresh_opt), want)
    assert fresh[0].weight not in fresh_opt.state  # nothing installed for the frozen one


def test_a_checkpoint_without_metadata_is_passed_over_without_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """DCP's loader logs on the root logger: a missing ``.metadata`` (of a marker without
    checksums, an earlier version's) printed its traceback before the one line."""
    model, opt = _model_and_opt()
    root = tmp_path / "ckpt"
    for step in (1, 2):
        _step(model, opt)
        save_checkpoint(root, step, _state_of(model, opt, for_load=False), {}, keep=5)
    newest = root / "step_00000002"
    marker = json.loads((newest / MARKER).read_text())
    del marker["crc32"]
    (newest / MARKER).write_text(json.dumps(marker))
    (newest / ".metadata").unlink()
    found = load_latest(root, _state_of(model, opt, for_load=True))
    assert found is not None and found.path.name == "step_00000001"
    assert "metadata is not found" not in caplog.text  # logged with its traceback


def test_a_failed_load_leaves_no_trace_and_all_corrupt_raises(tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    root = tmp_path / "ckpt"
    for step in (1, 2):
        _step(model, opt)
        save_checkpoint(root, step, _state_of(model, opt, for_load=False), {}, keep=5)
    for path in list_checkpoints(root):
        _corrupt(path)
    fresh, fresh_opt = _model_and_opt()
    before = _snapshot(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match=r"none of the 2 checkpoint\(s\).*--restart") as err:
        load_latest(root, _state_of(fresh, fresh_opt, for_load=True))
    assert "\n" not in str(err.value) and "step_00000002" in str(err.value)
    assert _same(_snapshot(fresh, fresh_opt), before)  # model and optimiser untouched
    assert not fresh_opt.state  # no zero state was left behind either
    assert load_latest(tmp_path / "empty", _state_of(fresh, fresh_opt, for_load=True)) is None


def test_retention_and_resume_see_only_the_current_run(tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    root = tmp_path / "ckpt"
    for step in (7, 8, 9):  # an old run got further than the new one will
        save_checkpoint(root, step, _state_of(model, opt, for_load=False), {}, keep=2, run_id="old")
    for step in (2, 4, 6):
        _step(model, opt)
        save_checkpoint(root, step, _state_of(model, opt, for_load=False), {}, keep=2, run_id="new")
    names = [p.name for p in list_checkpoints(root)]
    assert names == ["step_00000009", "step_00000008", "step_00000006", "step_00000004"]
    assert [p.name for p in list_checkpoints(root, "new")] == ["step_00000006", "step_00000004"]
    fresh, fresh_opt = _model_and_opt()
    found = load_latest(root, _state_of(fresh, fresh_opt, for_load=True), run_id="new")
    assert found is not None and found.path.name == "step_00000006"
    # Ordering is by step number, not by name.
    save_checkpoint(
        root, 100000000, _state_of(model, opt, for_load=False), {}, keep=2, run_id="new"
    )
    assert [p.name for p in list_checkpoints(root, "new")] == ["step_100000000", "step_00000006"]


def test_a_kill_while_a_step_is_written_again_keeps_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's end writes its last step again (and so does a launch after the end). The old
    checkpoint was deleted before the new one was renamed into place: a kill in between left
    only the ``.partial``, and the next launch started over from step 0, silently."""
    model, opt = _model_and_opt()
    _step(model, opt)
    root = tmp_path / "ckpt"
    save_checkpoint(
        root, 8, _state_of(model, opt, for_load=False), {"batch": 1}, keep=1, run_id="r"
    )
    want = _snapshot(model, opt)
    real = Path.rename

    def killed(self: Path, target: Any) -> Any:
        if self.name.endswith(".partial"):
            raise SystemExit("killed")  # the process dies before the new one is in place
        return real(self, target)

    monkeypatch.setattr(Path, "rename", killed)
    with pytest.raises(SystemExit):
        save_checkpoint(
            root, 8, _state_of(model, opt, for_load=False), {"batch": 2}, keep=1, run_id="r"
        )
    monkeypatch.undo()
    fresh, fresh_opt = _model_and_opt()
    state = _state_of(fresh, fresh_opt, for_load=True)
    found = load_latest(root, state, run_id="r")
    assert found is not None and found.meta["step"] == 8 and found.meta["batch"] == 1
    install_optimizer_state(fresh.named_parameters(), fresh_opt, state["optim"])
    assert _same(_snapshot(fresh, fresh_opt), want)
    # The next write of that step completes, and leaves one checkpoint of it.
    save_checkpoint(
        root, 8, _state_of(model, opt, for_load=False), {"batch": 2}, keep=1, run_id="r"
    )
    assert sorted(p.name for p in root.iterdir()) == ["step_00000008"]
    assert load_latest(root, _state_of(fresh, fresh_opt, for_load=True)).meta["batch"] == 2  # type: ignore[union-attr]


def test_a_failed_write_leaves_no_partial_and_keeps_the_previous(tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, _state_of(model, opt, for_load=False), {}, keep=2, run_id="r")
    # The kernel refuses the write of step 2 (a file-size limit fails writes as a full
    # disk does; Python ignores SIGXFSZ, so write() raises).
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        with pytest.raises(CheckpointError, match=r"step_00000002: checkpoint not written") as err:
            save_checkpoint(root, 2, _state_of(model, opt, for_load=False), {}, keep=2, run_id="r")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "File too large" in str(err.value), str(err.value)
    assert "resume from step_00000001, which is intact" in str(err.value)
    assert not (root / "step_00000002.partial").exists()
    assert [p.name for p in list_checkpoints(root, "r")] == ["step_00000001"]


def test_a_write_that_found_no_space_is_said_as_a_full_disk(tmp_path: Path) -> None:
    """PyTorch's zip writer reports a write onto a full disk as "file write failed" under a
    C++ tag, without the system's error: the reason drops the tag, and a failed write to a
    disk with less free space than the rank's share of the checkpoint says the disk is full."""
    torch_error = RuntimeError(
        "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
        "data/0: file write failed"
    )
    reason = _reason(torch_error)
    assert reason == "PytorchStreamWriter failed writing file data/0: file write failed"
    huge = {"model": {"w": torch.empty(2**50, device="meta")}}  # 4 PiB: no disk holds it
    assert _disk_reason(reason, tmp_path, huge) == f"No space left on device: {reason}"
    small = {"model": {"w": torch.zeros(4)}, "step": 3}
    assert _disk_reason(reason, tmp_path, small) == reason  # a disk with room: not the cause
    assert _disk_reason("", tmp_path, huge) == ""


def test_a_field_set_on_a_key_that_is_not_fields_is_refused(tmp_path: Path) -> None:
    """``parallel: auto`` with ``--set parallel.compile=...`` silently became the default
    layout with compile on; two --set of a key and of its field raised a TypeError. Both are
    one line now, naming the key."""
    recipe = _recipe(tmp_path, BASIC.replace("{spatial: 2x2, pipeline: 2, data: 2}", "auto"))
    with pytest.raises(ConfigError, match=r"parallel.compile: parallel is 'auto' in the recipe"):
        load_recipe(recipe, ["parallel.compile=aot_eager"])
    with pytest.raises(ConfigError, match=r"parallel is set to 'auto' by an earlier --set"):
        load_recipe(recipe, ["parallel=auto", "parallel.compile=aot_eager"])


def test_recipe_integers_are_decimal_and_recipes_utf8(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """YAML 1.1 read ``0x2`` as the hex number 2: ``--set parallel.spatial=0x2`` (or the same in
    a recipe) trained a 2x2 grid, silently. A recipe or manifest that is not UTF-8 raised a
    UnicodeDecodeError. Each is one line now."""
    from hyfi_imaging.train.tasks import manifest_kind

    basic = _recipe(tmp_path, BASIC)
    with pytest.raises(ConfigError, match="grid 0x2 needs"):
        load_recipe(basic, ["parallel.spatial=0x2"])
    hexed = tmp_path / "hex.yaml"
    hexed.write_text(BASIC.replace("spatial: 2x2", "spatial: 0x2"))
    with pytest.raises(ConfigError, match="grid 0x2 needs"):
        load_recipe(hexed)
    assert load_recipe(basic, ["train.epochs=010"]).train.epochs == 10
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(BASIC.encode() + b"# caf\xe9\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_recipe(latin)
    # --print-sbatch looks at the recipe's layout first: the same line, not a traceback
    from hyfi_imaging.cli.train import main as train_main

    assert train_main([str(latin), "--print-sbatch"]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err
    manifest = tmp_path / "m.csv"
    manifest.write_bytes(b"slide_id,label\ncaf\xe9,1\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        manifest_kind(manifest)


def test_quarter_turns_of_non_square_slides_are_said(train_manifest: Path, tmp_path: Path) -> None:
    """A quarter turn of a non-square slide is cropped back to its shape at a random offset:
    a quarter of a 96x128 slide cut away in every odd turn, without a word."""
    from hyfi_imaging.train.preflight import turn_warning

    def said(*sets: str) -> str | None:
        sets = (f"data.manifest={train_manifest}", *sets)
        return turn_warning(load_recipe(_recipe(tmp_path, BASIC), list(sets)))

    line = said("data.augment.rot90=true")  # the cohort is 192x160
    assert line is not None and "cropped back to 192x160 at a random offset (up to 32 px" in line
    assert "set data.augment.rot90=false" in line and said("data.augment.rot90=false") is None


def test_every_class_of_two_or_more_images_validates() -> None:
    """Python's round (to even) gave 10 slides at 0.1 no validation slide, and 8 negatives and
    2 positives at 0.25 no positive (AUC undefined, without a word): half up, at least one of
    each class of two or more, never all of one."""
    from hyfi_imaging.train.split import unvalidated_strata, validation_count, validation_split

    assert [validation_count(n, 0.1) for n in (1, 2, 5, 10, 14, 15)] == [0, 1, 1, 1, 1, 2]
    assert [validation_count(n, 0.25) for n in (2, 6, 8, 21)] == [1, 2, 2, 5]
    assert validation_count(3, 0.9) == 2 and validation_count(10, 0.0) == 0
    strata = [0] * 8 + [1] * 2
    train, val = validation_split(strata, 0, 0.25)
    assert sorted(strata[i] for i in val) == [0, 0, 1] and len(train) == 7
    assert unvalidated_strata([0, 0, 1, 2, 2], 0.5) == [1]


def test_a_validation_manifest_of_training_images_is_refused(
    train_manifest: Path, tmp_path: Path
) -> None:
    """A val_manifest of rows copied from the training manifest, or a row copied and renamed
    onto another id's store, trained and validated on the same images without a word; a
    store that does not exist failed at its first read, after the run's folder was made."""
    from hyfi_imaging.errors import ConfigError
    from hyfi_imaging.train.preflight import preflight

    lines = train_manifest.read_text().splitlines()
    data = train_manifest.parent

    def manifest(name: str, rows: list[str]) -> Path:
        path = tmp_path / name
        absolute = []
        for row in rows:  # stores named from another folder: absolute paths
            cells = row.split(",", 2)
            absolute.append(",".join([cells[0], str(data / cells[1]), cells[2]]))
        path.write_text("\n".join([lines[0], *absolute]) + "\n")
        return path

    def check(*sets: str) -> str:
        recipe = load_recipe(
            ROOT / "recipes" / "synthetic.yaml",
            [f"data.manifest={train_manifest}", f"train.out_dir={tmp_path / 'run'}", *sets],
        )
        with pytest.raises(ConfigError) as err:
            preflight(recipe)
        return str(err.value)

    copied = manifest("copied.csv", lines[1:4])
    assert "3 of its images are training images of" in check(f"data.val_manifest={copied}")
    renamed = manifest("renamed.csv", [lines[1].replace("synth_000,", "other_000,", 1)])
    assert "1 of its images are training images" in check(f"data.val_manifest={renamed}")
    twice = manifest("twice.csv", [*lines[1:5], lines[1].replace("synth_000,", "again,", 1)])
    assert "synth_000 and again name one store" in check(f"data.manifest={twice}")
    gone = manifest("gone.csv", [*lines[1:5], lines[5].replace("synth_004.zarr", "nowhere.zarr")])
    assert "1 store(s) it names do not exist (synth_004:" in check(f"data.manifest={gone}")


def test_a_mapping_given_whole_replaces_the_field(tmp_path: Path) -> None:
    """``--set model.kwargs={}`` changed nothing (merged into the recipe's kwargs): a user
    builder was still given the recipe's width. A key path still sets one field."""
    recipe = ROOT / "recipes" / "synthetic.yaml"
    base = ["data.manifest=m.csv", f"train.out_dir={tmp_path}"]
    assert load_recipe(recipe, base).model.kwargs  # the recipe's own (a width)
    assert load_recipe(recipe, [*base, "model.kwargs={}"]).model.kwargs == {}
    assert load_recipe(recipe, [*base, "model.kwargs={depth: 2}"]).model.kwargs == {"depth": 2}
    kept = load_recipe(recipe, [*base, "model.kwargs.depth=2"]).model.kwargs
    assert kept["depth"] == 2 and len(kept) > 1
