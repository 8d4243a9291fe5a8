"""hyfi-train / hyfi-predict end to end under mpiexec: layouts, resume, cross-layout loading, faults."""

from __future__ import annotations

import csv
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _launch import python

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def manifest(train_manifest: Path) -> Path:
    """The session's training cohort (``tests/conftest.py``)."""
    return train_manifest


def _train_cmd(
    manifest: Path, out: Path, *sets: str, args: tuple[str, ...] = (), fork: bool = True
) -> list[str]:
    """``hyfi-train`` on the cohort; ``fork=False`` for a run the test signals or kills, or that
    is meant to fail (see ``_launch.python``)."""
    recipe = str(ROOT / "recipes" / "synthetic.yaml")
    cmd = [*python(fork=fork), "-m", "hyfi_imaging.cli.train", recipe]
    cmd += args
    base = [
        f"data.manifest={manifest}",
        f"train.out_dir={out}",
        "model.kwargs.width=0.125",
        "train.epochs=2",
        "train.batch_size=2",
        "train.progress=false",
        "optim.warmup_steps=1",
        "train.checkpoint_every_steps=1",
    ]
    for s in (*base, *sets):
        cmd += ["--set", s]
    return cmd


def _train(
    manifest: Path,
    out: Path,
    ranks: int,
    *sets: str,
    check: bool = True,
    args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """Train (must succeed unless ``check`` is False: such a run starts new interpreters)."""
    cmd = _train_cmd(manifest, out, *sets, args=args, fork=check)
    if ranks > 1:
        cmd = [MPIEXEC, "-n", str(ranks), *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _losses(out: Path) -> list[float]:
    with (out / "metrics.csv").open() as f:
        return [float(r["loss"]) for r in csv.DictReader(f) if r["loss"]]


@pytest.fixture(scope="module")
def grid_runs(manifest: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process and a 2x2 grid trained alike (``one``, ``grid``): compared below, and the
    grid's checkpoint is the one the layouts load (one 4-rank launch for both tests)."""
    # SGD: Adam turns rounding-level differences of near-zero gradients into full-size
    # steps, so only a linear optimiser keeps float32 layouts comparable step after step.
    sgd = ("optim.name=sgd", "optim.lr=0.01")
    root = tmp_path_factory.mktemp("grid_runs")
    _train(manifest, root / "one", 1, "parallel.spatial=1x1", *sgd)
    _train(manifest, root / "grid", 4, "parallel.spatial=2x2", *sgd)
    return root


def test_layouts_train_and_spatial_equals_one_process(
    manifest: Path, grid_runs: Path, tmp_path: Path
) -> None:
    one, grid = _losses(grid_runs / "one"), _losses(grid_runs / "grid")
    # Same weights, same tiles: the first losses agree to float32 rounding. Later steps
    # drift by rounding amplified through training (hyfi-verify proves exactness in float64).
    assert len(one) == 6 and one[:2] == pytest.approx(grid[:2], rel=1e-4, abs=1e-5)
    assert all(math.isfinite(v) for v in grid)
    for run in ("one", "grid"):
        for name in ("summary.json", "training_curves.png", "confusion_matrix.png", "recipe.yaml"):
            assert (grid_runs / run / name).exists(), (run, name)
    # Two data replicas of batch 2 are one process of batch 4 in two micro-batches (BatchNorm
    # per micro-batch, replica 0's rows first). Replicas took every other image of the epoch
    # order: the same images a step, other BatchNorm batches (3 % off at the first step).
    sgd = ("optim.name=sgd", "optim.lr=0.01", "parallel.spatial=1x1")
    one = _train(manifest, tmp_path / "one", 1, *sgd, "train.batch_size=4",
                 "parallel.microbatches=2")  # fmt: skip
    dp = _train(manifest, tmp_path / "dp", 2, *sgd, "parallel.data=2", "train.batch_size=2")
    assert "done" in dp.stdout and "done" in one.stdout
    want, got = _losses(tmp_path / "one"), _losses(tmp_path / "dp")
    assert len(got) == len(want) >= 2 and got == pytest.approx(want, rel=1e-5), (got, want)


# slow since 2026-11-27 (the suite's time): hyfi-train runs a pipeline by default in
# test_run_safety_mpi (a resume keeps the first launch's cut).
@pytest.mark.slow
def test_a_pipeline_layout_trains(manifest: Path, tmp_path: Path) -> None:
    _train(
        manifest,
        tmp_path / "pipe",
        2,
        "parallel.spatial=1x1",
        "parallel.pipeline=2",
        "parallel.microbatches=2",
    )
    # Pipelining splits each batch into 2 micro-batches (BatchNorm per micro-batch): it runs, losses are finite.
    assert len(_losses(tmp_path / "pipe")) == 6
    for name in ("summary.json", "training_curves.png", "confusion_matrix.png", "recipe.yaml"):
        assert (tmp_path / "pipe" / name).exists(), name


def test_bf16_trains_on_tiles_like_one_process_to_bfloat16_rounding(
    manifest: Path, tmp_path: Path
) -> None:
    """``train.precision: bf16`` (the user guide's mixed precision) on a 1x2 grid: the halo
    path runs under autocast (its losses are not float32's) and gives one process's losses
    to bfloat16 rounding: within 1 % on the first step (measured 0.4-0.5 %), and after one
    SGD step within three times what bfloat16 itself moves the one-process run from float32
    (at least 1 %; measured in the same run: 2-10 % of grid against one process for 4 % of one process
    against float32, on two preprocessings of the same cohort)."""
    sets = ("optim.name=sgd", "optim.lr=0.01", "train.max_steps=2")
    _train(manifest, tmp_path / "one", 1, "parallel.spatial=1x1", "train.precision=bf16", *sets)
    _train(manifest, tmp_path / "grid", 2, "parallel.spatial=1x2", "train.precision=bf16", *sets)
    _train(manifest, tmp_path / "fp32", 1, "parallel.spatial=1x1", "train.precision=fp32", *sets)
    one, grid, fp32 = (_losses(tmp_path / r) for r in ("one", "grid", "fp32"))
    assert len(one) == len(grid) == 2 and all(math.isfinite(v) for v in grid)
    assert grid[0] == pytest.approx(one[0], rel=1e-2)
    bf16_noise = max(abs(one[1] - fp32[1]), 0.01 * one[1])  # bfloat16's own, this run
    assert abs(grid[1] - one[1]) <= 3 * bf16_noise, (one, grid, fp32)
    assert grid[0] != pytest.approx(fp32[0], rel=1e-6, abs=0.0)
    assert one[0] != pytest.approx(fp32[0], rel=1e-6, abs=0.0)


@pytest.mark.parametrize(
    ("grid", "layout", "compiled"),
    [
        ("1x2", "nchw", "none"),
        # channels-last weights unsharded in one process: saved and loaded as they are laid
        # out; compiled in place (the state dict keeps its names), torch's kernels
        ("1x1", "channels_last", "aot_eager"),
    ],
)
def test_resume_after_a_kill_continues_exactly(
    manifest: Path, tmp_path: Path, grid: str, layout: str, compiled: str
) -> None:
    ranks = 2 if grid == "1x2" else 1
    sets = (
        f"parallel.spatial={grid}",
        f"model.memory_format={layout}",
        f"parallel.compile={compiled}",
    )
    _train(manifest, tmp_path / "full", ranks, *sets)
    cut = tmp_path / "cut"
    cmd = [MPIEXEC, "-n", str(ranks), *_train_cmd(manifest, cut, *sets, fork=False)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (cut / "checkpoints" / "step_00000003").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # mpiexec takes its ranks down with it
    proc.wait(timeout=60)
    resumed = _train(manifest, cut, ranks, *sets)
    assert "resuming run" in resumed.stderr
    assert _losses(cut) == _losses(tmp_path / "full")  # bitwise on CPU


def test_checkpoint_moves_between_layouts(manifest: Path, grid_runs: Path, tmp_path: Path) -> None:
    """The 2x2 run's checkpoint predicts alike in one process, on 1x2 tiles and on 2 stages;
    and so does a run whose recipe cut a pipeline by hand (``parallel.balance``, as hyfi-plan
    prints it; here of zbv's four stage parts): its cut was refused on any other layout,
    even on its own two stages (hyfi-predict's forward is GPipe's), naming an option
    hyfi-predict does not have."""
    import shutil

    import yaml

    staged = tmp_path / "staged"
    shutil.copytree(grid_runs / "grid", staged)
    recipe = yaml.safe_load((staged / "recipe.yaml").read_text())
    recipe["parallel"].update(pipeline=2, schedule="zbv", balance=[3, 3, 3, 2], microbatches=4)
    (staged / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    outs = []
    cases = [
        (grid_runs / "grid", 1, []),
        (grid_runs / "grid", 2, ["--spatial", "1x2"]),
        (grid_runs / "grid", 2, ["--pipeline", "2"]),
        (staged, 1, []),
        (staged, 2, ["--pipeline", "2"]),
    ]
    for run, ranks, extra in cases:
        out = tmp_path / f"pred{len(outs)}.csv"
        cmd = [
            *python(),
            "-m",
            "hyfi_imaging.cli.predict",
            str(run),
            "--manifest",
            str(manifest),
            "--out",
            str(out),
            *extra,
        ]
        if ranks > 1:
            cmd = [MPIEXEC, "-n", str(ranks), *cmd]
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(list(csv.DictReader(out.open())))
    assert len(outs[0]) == 8
    assert set(outs[0][0]) == {"slide_id", "label", "status", "pred", "p_0", "p_1"}
    for rows in outs[1:]:
        for a, b in zip(outs[0], rows, strict=True):
            assert a["slide_id"] == b["slide_id"] and a["pred"] == b["pred"]
            assert float(a["p_1"]) == pytest.approx(float(b["p_1"]), abs=1e-5)


@pytest.mark.slow
def test_a_compiled_run_predicts_on_tiles_and_on_stages(manifest: Path, tmp_path: Path) -> None:
    """Compile runs one stage without tiles; a compiled run's checkpoint predicted on 1x2 or
    2 stages was refused with advice hyfi-predict cannot follow ("use compile none"): it now
    predicts there eagerly, as in one process."""
    run = tmp_path / "run"
    _train(manifest, run, 1, "parallel.spatial=1x1", "parallel.compile=aot_eager")
    outs = []
    for ranks, extra in ((1, []), (2, ["--spatial", "1x2"]), (2, ["--pipeline", "2"])):
        out = tmp_path / f"pred{len(outs)}.csv"
        cmd = [*python(), "-m", "hyfi_imaging.cli.predict", str(run), "--manifest",
               str(manifest), "--out", str(out), *extra]  # fmt: skip
        if ranks > 1:
            cmd = [MPIEXEC, "-n", str(ranks), *cmd]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(list(csv.DictReader(out.open())))
    for rows in outs[1:]:
        for a, b in zip(outs[0], rows, strict=True):
            assert a["pred"] == b["pred"]
            assert float(a["p_1"]) == pytest.approx(float(b["p_1"]), abs=1e-5)


def test_a_resume_at_an_epoch_end_logs_each_evaluation_once(manifest: Path, tmp_path: Path) -> None:
    """A checkpoint at an epoch's last step is written before that epoch's evaluation, which
    a run resumed from it does again: the evaluation was logged twice (metrics.csv,
    evals.jsonl). Cut right after epoch 1's evaluation, resumed: the logs equal an
    uninterrupted run's, timings aside. And a ``train.max_steps`` the epochs never reach
    changes nothing (the learning-rate schedule spanned the cap, and stayed near its peak)."""
    import json
    import shutil

    sets = ("parallel.spatial=1x1", "train.keep_checkpoints=50")
    full = tmp_path / "full"
    _train(manifest, full, 1, *sets)
    rows = list(csv.DictReader((full / "metrics.csv").open()))
    end = min(int(r["step"]) for r in rows if r.get("val_loss"))  # epoch 1's last step
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    for ck in (cut / "checkpoints").iterdir():
        if int(ck.name.split("_")[1].split(".")[0]) > end:
            shutil.rmtree(ck) if ck.is_dir() else ck.unlink()
    with (cut / "metrics.csv").open("w", newline="") as f:  # as a kill after that evaluation
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(r for r in rows if int(r["step"]) <= end)
    evals = (full / "evals.jsonl").read_text().splitlines(keepends=True)
    (cut / "evals.jsonl").write_text("".join(e for e in evals if json.loads(e)["step"] <= end))
    shorter = shutil.copytree(cut, tmp_path / "shorter")
    resumed = _train(manifest, cut, 1, *sets).stderr
    assert "resuming run" in resumed and "learning-rate schedule" not in resumed
    timing = {"time", "images_per_s", "megapixels_per_s", "memory_mib", "data_wait_s"}

    def logged(run: Path) -> list[dict[str, str]]:
        table = csv.DictReader((run / "metrics.csv").open())
        return [{k: v for k, v in r.items() if k not in timing} for r in table]

    assert logged(cut) == logged(full)
    assert len((cut / "evals.jsonl").read_text().splitlines()) == len(evals)
    _train(manifest, tmp_path / "capped", 1, *sets, "train.max_steps=1000")
    assert logged(tmp_path / "capped") == logged(full)
    # A resume under a new train.max_steps (or train.epochs) plans the schedule anew: said.
    said = _train(
        manifest, shorter, 1, *sets, f"train.max_steps={end + 1}", "optim.weight_decay=0.01"
    ).stderr
    assert f"the learning-rate schedule now runs {end + 1} steps (the run planned" in said
    # So is one under other optimiser settings (a new momentum resumed without a word).
    assert "the optimiser's settings differ from the run's (optim.weight_decay " in said
    assert "-> 0.01): it goes on with the new ones from step" in said


def test_config_errors_fail_before_any_rank_starts(manifest: Path, tmp_path: Path) -> None:
    proc = _train(manifest, tmp_path / "bad", 1, "train.epoch=3", check=False)
    assert proc.returncode == 2 and "did you mean train.epochs?" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = _train(manifest, blocker / "out", 1, check=False)
    assert proc.returncode == 2 and "not writable" in proc.stderr


def test_a_killed_rank_ends_the_job_quickly(manifest: Path, tmp_path: Path) -> None:
    out = tmp_path / "killed"
    cmd = [
        MPIEXEC,
        "-n",
        "2",
        sys.executable,
        "-m",
        "hyfi_imaging.cli.train",
        str(ROOT / "recipes" / "synthetic.yaml"),
    ]
    for s in (
        f"data.manifest={manifest}",
        f"train.out_dir={out}",
        "model.kwargs.width=0.125",
        "train.epochs=50",
        "train.batch_size=2",
        "train.progress=false",
        "parallel.spatial=1x2",
    ):
        cmd += ["--set", s]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out / "metrics.csv").exists():
        time.sleep(0.2)
    ranks = subprocess.run(
        ["pgrep", "-f", f"train.out_dir={out}"], capture_output=True, text=True, check=False
    )
    pids = [int(p) for p in ranks.stdout.split() if int(p) != proc.pid]
    workers = [p for p in pids if "python" in Path(f"/proc/{p}/cmdline").read_text(errors="ignore")]
    assert workers, "no rank found"
    killed_at = time.monotonic()
    os.kill(workers[-1], signal.SIGKILL)
    proc.wait(timeout=90)
    assert proc.returncode != 0
    assert time.monotonic() - killed_at < 60


def test_an_out_dir_that_is_not_shared_is_refused(manifest: Path, tmp_path: Path) -> None:
    """A ``train.out_dir`` that is another directory on another node (a node-local scratch
    path; here a relative one, each rank started in its own folder): each node wrote its
    checkpoint shards where the other could not read them, the run said done, and no
    checkpoint could be loaded. Refused at the start now, in one line naming the fix."""
    cmd = _train_cmd(manifest, Path("runs") / "local", "parallel.spatial=1x2", fork=False)
    folders = [tmp_path / "node0", tmp_path / "node1"]
    mpmd: list[str] = [MPIEXEC]
    for k, folder in enumerate(folders):
        folder.mkdir()
        mpmd += [*([":"] if k else []), "-n", "1", "-wdir", str(folder), *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(mpmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "is not one directory on every node: 1 rank(s), rank 1 the first" in proc.stderr
    assert "put train.out_dir on a file system every node shares" in proc.stderr
    assert not list((folders[0] / "runs" / "local").glob("checkpoints/step_*")), "trained"
