"""No work lost, nothing mixed up: corrupt checkpoints, one run per directory, a full disk.

Real ``hyfi-train`` runs under ``mpiexec`` on the synthetic cohort of
``test_train_mpi.py``; checkpoints are damaged by truncating their real shard
files, and the disk fills up for real on a small tmpfs (skipped where this
process may not mount one).
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cohorts import preprocessed_cohort
from test_train_mpi import MPIEXEC, _losses, _train, _train_cmd, manifest  # noqa: F401  (fixture)

from hyfi_imaging.preprocess import PreprocessOptions

pytestmark = pytest.mark.mpi
SP = "parallel.spatial=1x2"


def _corrupt(checkpoint: Path) -> None:
    for shard in checkpoint.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:10])


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "error:" in ln]


def test_corrupt_checkpoints_never_contaminate_a_run(manifest: Path, tmp_path: Path) -> None:  # noqa: F811
    run = tmp_path / "run"
    _train(manifest, run, 2, SP)
    reference = _losses(run)
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000005", "step_00000006"]

    # The newest is damaged: hyfi-predict says which one it uses instead (it said nothing)...
    _corrupt(ckpts / "step_00000006")
    cmd = [sys.executable, "-m", "hyfi_imaging.cli.predict", str(run),
           "--manifest", str(manifest), "--out", str(tmp_path / "pred.csv")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step_00000006 could not be loaded" in proc.stderr
    assert "using step_00000005 (step 5)" in proc.stderr
    # ... and training resumes from the one before, and the run goes on exactly.
    again = _train(manifest, run, 2, SP)
    assert "step_00000006.unloadable" in again.stderr
    assert _losses(run) == reference
    assert (ckpts / "step_00000006.unloadable").is_dir()

    # Every checkpoint damaged: stop with one line, the history untouched.
    for path in ckpts.glob("step_0*"):
        if path.suffix != ".unloadable":
            _corrupt(path)
    history = (run / "metrics.csv").read_text()
    stopped = _train(manifest, run, 2, SP, "train.epochs=3", check=False)
    assert stopped.returncode == 2, stopped.stderr[-2000:]
    lines = _error_lines(stopped.stderr)
    assert len(lines) == 1 and "none of the 2 checkpoint(s) can be loaded" in lines[0], lines
    assert "--restart" in lines[0] and "Traceback" not in stopped.stderr
    assert (run / "metrics.csv").read_text() == history

    # --no-resume would mix two runs: refused before any rank starts.
    refused = _train(manifest, run, 2, SP, check=False, args=("--no-resume",))
    assert refused.returncode == 2 and "holds run" in refused.stderr
    assert len(_error_lines(refused.stderr)) == 1

    # --restart keeps the old run aside and starts a clean one, equal to a fresh run.
    _train(manifest, run, 2, SP, args=("--restart",))
    (aside,) = (run / "previous").iterdir()
    assert (aside / "metrics.csv").read_text() == history
    assert _losses(run) == reference


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    ok = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=300m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if ok.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_ends_with_one_line_and_an_intact_checkpoint(
    manifest: Path,  # noqa: F811
    small_disk: Path,
) -> None:
    out = small_disk / "run"
    cmd = [MPIEXEC, "-n", "2", *_train_cmd(manifest, out, SP, "train.epochs=200", fork=False)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out / "checkpoints" / "step_00000002").exists():
        time.sleep(0.05)
    with (small_disk / "filler").open("wb") as f:  # another program fills the disk
        try:
            while True:
                f.write(b"\0" * 2**20)
                f.flush()
        except OSError:
            pass
    _, stderr = proc.communicate(timeout=120)
    # Whichever write hits the full disk first (a checkpoint on every rank, metrics.csv on
    # rank 0): one line naming the file or checkpoint, exit 2, and no other rank blames a
    # "lost rank" for rank 0's own exit.
    assert proc.returncode == 2, stderr[-2000:]
    lines = _error_lines(stderr)
    assert len(lines) == 1 and "No space left on device" in lines[0], stderr[-2000:]
    assert str(out) in lines[0] and "lost rank" not in stderr
    assert "Traceback" not in stderr
    assert not list((out / "checkpoints").glob("*.partial"))
    (small_disk / "filler").unlink()
    resumed = _train(manifest, out, 2, SP, "train.max_steps=1", check=False)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming run" in resumed.stderr


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("parallel.spatial=4x1",), "at most 3 tiles along height"),
        (("parallel.spatial=1x1", "parallel.pipeline=20"), "only 11 top-level layers"),
        (("parallel.spatial=1x1", "parallel.checkpointing=every:0"), "checkpointing"),
    ],
)
def test_check_refuses_what_training_would_refuse(
    manifest: Path,  # noqa: F811
    tmp_path: Path,
    sets: tuple[str, ...],
    message: str,
) -> None:
    proc = _train(manifest, tmp_path / "run", 1, *sets, check=False, args=("--check",))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_check_under_a_launcher_counts_its_ranks(manifest: Path, tmp_path: Path) -> None:  # noqa: F811
    """``mpiexec -n 3 hyfi-train ... --check`` of a 2x2 layout said "valid (4 ranks)", where
    the run is refused: the launcher's ranks are checked, with the run's own line."""
    proc = _train(manifest, tmp_path / "run", 3, "parallel.spatial=2x2", check=False,
                  args=("--check",))  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "needs 4 ranks but the job has 3" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_check_refuses_an_ok_slide_without_a_label(manifest: Path, tmp_path: Path) -> None:  # noqa: F811
    rows = manifest.read_text().splitlines()
    header = rows[0].split(",")
    cells = rows[3].split(",")
    cells[header.index("label")] = ""
    cells[header.index("path")] = str(manifest.parent / cells[header.index("path")])
    edited = tmp_path / "manifest.csv"
    edited.write_text("\n".join([rows[0], *rows[1:3], ",".join(cells), *rows[4:]]) + "\n")
    proc = _train(edited, tmp_path / "run", 1, check=False, args=("--check",))
    assert proc.returncode == 2 and "1 slide(s) with status ok have no label" in proc.stderr
    assert cells[0] in proc.stderr
    ok = _train(manifest, tmp_path / "run", 1, "parallel.spatial=1x2", args=("--check",))
    assert "is valid" in ok.stdout


def test_one_process_trains_and_predicts_an_image_off_the_stride(tmp_path: Path) -> None:
    # 100x90 is no multiple of ResNet's stride 32: one rule pads it for tiles, not for 1x1.
    options = PreprocessOptions(mpp=1.0, size=(100, 90))
    off = preprocessed_cohort(tmp_path, 4, options, seed=5, size=(256, 256), lesions=2)
    for grid, ranks in (("1x1", 1), ("1x2", 2)):
        run = tmp_path / grid
        _train(off, run, ranks, f"parallel.spatial={grid}", "train.max_steps=2",
               "data.val_fraction=0")  # fmt: skip
        assert len(_losses(run)) == 2
    out = tmp_path / "pred.csv"
    cmd = [sys.executable, "-m", "hyfi_imaging.cli.predict", str(tmp_path / "1x2"),
           "--manifest", str(off), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(out.read_text().splitlines()) == 5


def _steps(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.mark.parametrize("optim", ["sgd", pytest.param("adamw", marks=pytest.mark.slow)])
def test_a_diverging_run_stops_at_its_step_and_keeps_its_good_checkpoints(
    manifest: Path,  # noqa: F811
    tmp_path: Path,
    optim: str,
) -> None:
    run = tmp_path / "run"
    _train(
        manifest, run, 2, SP, f"optim.name={optim}", "train.epochs=1", "train.keep_checkpoints=2"
    )
    good = _steps(run)
    assert good == ["step_00000002", "step_00000003"]
    # Every step checkpointed: the optimiser's step 4 makes the state non-finite, and it
    # is refused before it is saved. Every 3 steps: the next step's loss is not finite and
    # is refused at that step, before the optimiser sees it.
    every = "1" if optim == "sgd" else "3"
    broken = _train(
        manifest, run, 2, SP, f"optim.name={optim}", "optim.lr=1e37", "optim.warmup_steps=0",
        "train.keep_checkpoints=2", f"train.checkpoint_every_steps={every}", check=False,
    )  # fmt: skip
    assert broken.returncode == 2, broken.stderr[-3000:]
    lines = _error_lines(broken.stderr)
    assert len(lines) == 1 and "Traceback" not in broken.stderr, broken.stderr[-3000:]
    if optim == "sgd":
        assert "step 4: the model or optimiser state holds NaN or inf" in lines[0], lines[0]
    else:
        assert "step 5: the loss is nan" in lines[0], lines[0]
    assert "is the newest checkpoint, intact" in lines[0] or "stays the newest" in lines[0]
    # No non-finite state was saved, so retention never evicted a good checkpoint.
    assert good[-1] in _steps(run)
    # Run again with a sane rate, it resumes from a finite checkpoint and trains on.
    _train(manifest, run, 2, SP, f"optim.name={optim}", "train.keep_checkpoints=2")
    assert all(math.isfinite(v) for v in _losses(run)[:3])


def test_skipped_steps_are_counted_and_a_run_of_them_stops(manifest: Path, tmp_path: Path) -> None:  # noqa: F811
    run = tmp_path / "run"
    broken = _train(
        manifest, run, 2, SP, "optim.lr=1e30", "optim.warmup_steps=0", "train.nonfinite=skip",
        "train.max_skipped_steps=1", "train.checkpoint_every_steps=0", check=False,
    )  # fmt: skip
    assert broken.returncode == 2, broken.stderr[-3000:]
    # The first step makes the weights inf; the second is skipped (said once, not per
    # rank), the third stops the run.
    assert broken.stderr.count("step 2: the loss is nan; skipped (1 in a row") == 1, broken.stderr
    (line,) = _error_lines(broken.stderr)
    assert "step 3: the loss is nan (2 steps in a row)" in line, line
    assert "no checkpoint was written yet" in line


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ('data.classes=["1", "0"]', "data.classes ['0', '1'] -> now ['1', '0']"),
        # Another seed or validation fraction moved images between training and validation:
        # the resumed run trained on the images its first epoch validated on, without a word.
        ("train.seed=3", "moved between training and validation"),
        pytest.param(
            "data.val_fraction=0.5",
            "moved between training and validation",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "model.kwargs.width=0.25",
            "model.kwargs {'width': 0.125} -> now {'width': 0.25}",
            marks=pytest.mark.slow,
        ),
        pytest.param("data.mean=[0.4]", "data.mean None -> now [0.4]", marks=pytest.mark.slow),
        pytest.param("optim.name=sgd", "optim.name adamw -> now sgd", marks=pytest.mark.slow),
        pytest.param(  # the epoch's position counts in images a step: skipped or repeated
            "train.batch_size=1",
            "trains 2 images a step (train.batch_size x parallel.data), this one 1 (1 x 1)",
            marks=pytest.mark.slow,  # the suite's time: the check is one comparison
        ),
    ],
)
def test_a_resume_that_would_change_the_runs_meaning_is_refused(
    manifest: Path,  # noqa: F811
    tmp_path: Path,
    change: str,
    named: str,
) -> None:
    run = tmp_path / "run"
    _train(manifest, run, 1, "parallel.spatial=1x1", "train.epochs=1")
    history = (run / "metrics.csv").read_text()
    refused = _train(
        manifest, run, 1, "parallel.spatial=1x1", "train.epochs=2", change, check=False
    )
    assert refused.returncode == 2, refused.stderr[-3000:]
    (line,) = _error_lines(refused.stderr)
    assert named in line and "--restart" in line, line
    assert "put back an intact checkpoint" not in line  # the checkpoint is intact
    assert (run / "metrics.csv").read_text() == history


def _resumes_as_uninterrupted(
    cohort: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """A run of the model ``build`` in ``source`` (its module's text) resumed from step 2
    gives the uninterrupted run's losses."""
    import shutil

    (tmp_path / "ownnet.py").write_text(source)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    sets = ("parallel.spatial=1x1", "model.name=ownnet:build", "train.keep_checkpoints=50")
    whole = tmp_path / "whole"
    assert _train(cohort, whole, 1, *sets, check=False).returncode == 0
    resumed = Path(shutil.copytree(whole, tmp_path / "resumed"))
    for ckpt in sorted((resumed / "checkpoints").iterdir())[2:]:  # from step 2 on
        shutil.rmtree(ckpt)
    run = _train(cohort, resumed, 1, *sets, check=False)
    assert run.returncode == 0 and "resuming run" in run.stderr, run.stderr[-3000:]
    assert len(_losses(whole)) > 3 and _losses(resumed) == _losses(whole)


def test_a_model_that_draws_resumes_as_it_would_have_run(
    manifest: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The random generator was seeded once, before the model was built, and is in no
    checkpoint: a resumed run's dropout replayed the masks of the run's first steps (a
    resumed CosmoFlow with dropout 0.5 lost 0.35 in loss at the next step). Every step is
    seeded from the run's seed and the step now: the losses go on as uninterrupted."""
    _resumes_as_uninterrupted(
        manifest,
        tmp_path,
        monkeypatch,
        "from torch import nn\n"
        "def build(num_classes=2, in_chans=3, **_):\n"
        "    return nn.Sequential(nn.Conv2d(in_chans, 8, 3, padding=1), nn.ReLU(),\n"
        "                         nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Dropout(0.5),\n"
        "                         nn.Linear(8, num_classes))\n",
    )


@pytest.mark.slow
def test_a_model_with_a_frozen_layer_resumes(
    manifest: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A frozen layer (fine-tuning) has no optimizer state: the load asked for it, and no
    checkpoint of such a run could be loaded ("Missing key ... /exp_avg"), each time the run was started again."""
    _resumes_as_uninterrupted(
        manifest,
        tmp_path,
        monkeypatch,
        "from torch import nn\n"
        "def build(num_classes=2, in_chans=3, **_):\n"
        "    net = nn.Sequential(nn.Conv2d(in_chans, 8, 3, padding=1), nn.ReLU(),\n"
        "                        nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(8, num_classes))\n"
        "    net[0].requires_grad_(False)\n"
        "    return net\n",
    )


def test_a_resume_reuses_the_pipeline_cut_of_the_runs_first_launch(
    manifest: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    pp = ("parallel.spatial=1x1", "parallel.pipeline=2", "parallel.microbatches=2")
    _train(manifest, run, 2, *pp, "train.epochs=1")
    record = json.loads((run / "run.json").read_text())
    ((layout, cut),) = record["cuts"].items()
    assert "pp=2" in layout and len(cut) == 2
    # Another cut than timing would give: the resume must take it, not time a new one.
    other = [cut[0] + 1, cut[1] - 1] if cut[1] > 1 else [cut[0] - 1, cut[1] + 1]
    record["cuts"][layout] = other
    (run / "run.json").write_text(json.dumps(record))
    again = _train(manifest, run, 2, *pp, "train.epochs=2")
    assert (
        f"pipeline cut {other[0]},{other[1]}: measured at this run's first launch" in again.stderr
    )
    assert f"balance {other[0]},{other[1]} " in again.stderr, again.stderr[-3000:]
    # A restart is a new run: its cut is timed again (timings vary: 1,10 then 4,7 was
    # seen for the same model) and recorded afresh.
    fresh = _train(manifest, run, 2, *pp, "train.epochs=1", args=("--restart",))
    assert "measured at this run's first launch" not in fresh.stderr
    assert len(json.loads((run / "run.json").read_text())["cuts"][layout]) == 2


def test_a_second_run_into_a_busy_directory_is_refused(manifest: Path, tmp_path: Path) -> None:  # noqa: F811
    from hyfi_imaging.locks import hold_lock

    run = tmp_path / "run"
    held = hold_lock(run, "hyfi-train", "wait")  # as a running hyfi-train holds it
    refused = _train(manifest, run, 2, SP, check=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    (line,) = _error_lines(refused.stderr)
    assert "another hyfi-train run is writing to this directory" in line, line
    assert not (run / "run.json").exists() and not (run / "metrics.csv").exists()
    held.close()
    _train(manifest, run, 1, "parallel.spatial=1x1", "train.epochs=1")
    # --restart moves every file of the old run aside, predictions included.
    (run / "masks").mkdir()
    (run / "val_per_image.csv").write_text("id,dice\n")
    _train(manifest, run, 1, "parallel.spatial=1x1", "train.epochs=1", args=("--restart",))
    (aside,) = (run / "previous").iterdir()
    assert (aside / "masks").is_dir() and (aside / "val_per_image.csv").exists()
    assert not (run / "masks").exists() and not (run / "val_per_image.csv").exists()


def _wait_for_steps(run: Path, n: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if (run / "metrics.csv").exists() and len(_losses(run)) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {n} steps logged in {run} (exit {proc.poll()})")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.parametrize(
    "how", ["SIGTERM to mpiexec", pytest.param("SIGUSR1 to rank 1 only", marks=pytest.mark.slow)]
)
def test_a_signal_stops_at_a_step_with_one_checkpoint_and_the_resume_is_exact(
    manifest: Path,  # noqa: F811
    tmp_path: Path,
    how: str,
) -> None:
    import signal

    sets = (SP, "train.checkpoint_every_steps=0", "train.epochs=3")
    reference = tmp_path / "reference"
    _train(manifest, reference, 2, *sets)
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [MPIEXEC, "-n", "2", *_train_cmd(manifest, run, *sets, fork=False)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    _wait_for_steps(run, 2, proc)
    if how == "SIGTERM to mpiexec":
        proc.send_signal(signal.SIGTERM)
    else:  # mpiexec -> hydra proxy -> ranks; rank 1 is the later-started python
        ranks = sorted(p for proxy in _children(proc.pid) for p in _children(proxy))
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-3000:]
    stopped = [ln for ln in stderr.splitlines() if "stopped by" in ln]
    said = "SIGTERM after step" if how == "SIGTERM to mpiexec" else "SIGUSR1 (to rank 1) after"
    assert len(stopped) == 1 and f"stopped by {said}" in stopped[0], stderr[-3000:]
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert _steps(run) == [f"step_{step:08d}"] and step < 9, (_steps(run), stderr[-2000:])
    assert not _error_lines(stderr) and "Traceback" not in stderr
    # Started again, it resumes from that checkpoint and ends as the uninterrupted run did.
    _train(manifest, run, 2, *sets)
    assert _losses(run) == _losses(reference)


#: hyfi-train whose ``N``th training step receives SIGUSR1 while it runs (sent from inside the
#: step, before its all-reduce: a scheduler's signal at a known moment).
SIGNAL_AT_STEP = """
import os, signal, sys
from hyfi_imaging.parallel.engine import ParallelModel
from hyfi_imaging.cli.train import main
at, calls, step = int(sys.argv[1]), [0], ParallelModel.train_step
def signalled(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == at:
        os.kill(os.getpid(), signal.SIGUSR1)
    return step(self, *args, **kwargs)
ParallelModel.train_step = signalled
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow  # the suite's time (25 s on the 2 cores)
def test_a_signal_during_an_epochs_last_step_stops_there_before_the_evaluation(
    manifest: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The stop flag was read when a step began: a signal during step 3 (the epoch's last)
    stopped after step 4, and the epoch's whole evaluation ran first, a scheduler's grace
    period spent on them. Now the step it arrives in is the last, the evaluation is left to
    the resumed run, and that run ends as the uninterrupted one did."""
    sets = ("parallel.spatial=1x1", "train.checkpoint_every_steps=0", "train.epochs=2")
    reference = tmp_path / "reference"
    _train(manifest, reference, 1, *sets)
    with (reference / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    last = max(int(r["step"]) for r in rows if r["loss"] and r["epoch"] == rows[0]["epoch"])
    run = tmp_path / "run"
    cmd = _train_cmd(manifest, run, *sets, fork=False)
    args = cmd[cmd.index("hyfi_imaging.cli.train") + 1 :]
    proc = subprocess.run(
        [sys.executable, "-c", SIGNAL_AT_STEP, str(last), *args],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert f"stopped by SIGUSR1 after step {last}:" in proc.stderr, proc.stderr[-2000:]
    with (run / "metrics.csv").open() as f:
        assert not [r for r in csv.DictReader(f) if r.get("val_loss")]  # no evaluation ran
    assert _steps(run) == [f"step_{last:08d}"]
    _train(manifest, run, 1, *sets)  # resumed: the evaluation, then the next epoch
    assert (run / "metrics.csv").read_text().count("\n") == len(rows) + 1
    assert _losses(run) == _losses(reference)
    with (run / "metrics.csv").open() as f, (reference / "metrics.csv").open() as g:
        evals = [[r["val_loss"] for r in csv.DictReader(h) if r["val_loss"]] for h in (f, g)]
    assert evals[0] == evals[1] and evals[0]


def test_a_signal_before_training_starts_stops_at_the_first_step(
    manifest: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The handler was installed when the loop began: a scheduler's SIGUSR1 while PyTorch was
    imported or the recipe and stores checked (seconds) killed the process (exit 138), which
    no job requeues. hyfi-train installs it on its first line (at 0.2 s here; PyTorch's
    import alone takes 3 s): the run stops at its first step with a checkpoint, exit 75."""
    import signal

    run = tmp_path / "run"
    cmd = _train_cmd(manifest, run, "parallel.spatial=1x1", fork=False)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    time.sleep(2.0)
    assert not (run / "metrics.csv").exists()  # still starting
    proc.send_signal(signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 75, stderr[-3000:]
    assert "stopped by SIGUSR1 after step 1:" in stderr, stderr[-2000:]
    assert _steps(run) == ["step_00000001"]


def test_a_stop_signal_to_the_data_workers_leaves_them_running(
    manifest: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A scheduler signals every process of a job step, the data-loading workers too. A worker
    died of SIGUSR1 (the default action), and its rank, waiting for the epoch's first batch,
    ended with "DataLoader worker ... is killed by signal" (exit 1, no checkpoint, no
    requeue). Each epoch's worker is signalled here as it is spawned, before its imports: the
    workers ignore the stop signals now, from birth, and the run ends as it would have."""
    import signal

    run = tmp_path / "run"
    sets = ("parallel.spatial=1x1", "data.workers=1", "train.epochs=2")
    proc = subprocess.Popen(
        _train_cmd(manifest, run, *sets, fork=False),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )

    def workers() -> set[int]:
        found = set()
        for pid in _children(proc.pid):
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.add(pid)
        return found

    signalled: set[int] = set()
    deadline = time.monotonic() + 150
    while proc.poll() is None and time.monotonic() < deadline:
        for pid in workers() - signalled:  # as soon as it exists
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
            signalled.add(pid)
        time.sleep(0.02)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    assert len(signalled) >= 2, signalled  # a worker per epoch, each signalled
    summary = json.loads((run / "summary.json").read_text())
    assert not _error_lines(stderr) and summary["epochs"] == 2
    assert len(_losses(run)) == summary["steps"]


def test_a_hung_rank_is_named_in_one_line_per_surviving_rank(
    manifest: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    import contextlib
    import signal

    run = tmp_path / "run"
    sets = (SP, "train.epochs=50", "parallel.timeout_s=5", "train.checkpoint_every_steps=0")
    proc = subprocess.Popen(
        [MPIEXEC, "-n", "2", *_train_cmd(manifest, run, *sets, fork=False)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    _wait_for_steps(run, 1, proc)
    ranks = sorted(p for proxy in _children(proc.pid) for p in _children(proxy))
    os.kill(ranks[1], signal.SIGSTOP)  # rank 1 stops answering (started second)
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert proc.returncode != 0
    lines = _error_lines(stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert f"rank 1 (pid {ranks[1]} " in lines[0] and "stopped answering" in lines[0], lines[0]
    assert "waited 5 s" in lines[0] and "parallel.timeout_s" in lines[0]


def test_ctrl_c_is_said_once(manifest: Path, tmp_path: Path) -> None:  # noqa: F811
    import signal

    run = tmp_path / "run"
    proc = subprocess.Popen(
        [MPIEXEC, "-n", "2", *_train_cmd(manifest, run, SP, "train.epochs=50", fork=False)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    _wait_for_steps(run, 1, proc)
    proc.send_signal(signal.SIGINT)  # mpiexec forwards it to every rank
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0 and stderr.count("interrupted") == 1, stderr[-3000:]
