"""No work lost, nothing mixed up: corrupt checkpoints, one run per directory, a full disk.

Real ``hyfi-train`` runs under ``mpiexec`` on the synthetic cohort of
``test_train_mpi.py``; checkpoints are damaged by truncating their real shard
files, and the disk fills up for real on a small tmpfs (skipped where this
process may not mount one).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_train_mpi import _losses, _train, _train_cmd, manifest  # noqa: F401  (fixture)

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

    # The newest is damaged: resume from the one before, and the run goes on exactly.
    _corrupt(ckpts / "step_00000006")
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
    cmd = _train_cmd(manifest, out, "parallel.spatial=1x1", "train.epochs=200")
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
    # 2 when the checkpoint write hits the full disk first, 1 when the metrics log does.
    assert proc.returncode in (1, 2), stderr[-2000:]
    lines = _error_lines(stderr)
    assert len(lines) == 1 and "No space left on device" in lines[0], stderr[-2000:]
    assert "Traceback" not in stderr
    assert not list((out / "checkpoints").glob("*.partial"))
    (small_disk / "filler").unlink()
    resumed = _train(manifest, out, 1, "parallel.spatial=1x1", "train.max_steps=1", check=False)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming run" in resumed.stderr
