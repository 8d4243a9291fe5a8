"""The run log (CSV, evals.jsonl, TensorBoard, resume) and the run's pictures."""

from __future__ import annotations

import csv
import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from hyfi_imaging.train import logs
from hyfi_imaging.train.logs import RunLogger, read_metrics_csv
from hyfi_imaging.train.metrics import evaluate_predictions
from hyfi_imaging.train.plots import (
    plot_confusion_matrix,
    plot_resolution_comparison,
    plot_training_curves,
    smooth,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _result() -> object:
    probs = np.array([[0.2, 0.8], [0.6, 0.4], [0.5, 0.5], [0.9, 0.1]])
    return evaluate_predictions(probs, np.array([1, 1, 0, 0]), task="binary")


def _run(out: Path, steps: range, *, tensorboard: bool = False) -> RunLogger:
    log = RunLogger(out, tensorboard=tensorboard)
    for s in steps:
        log.log_step(s, epoch=(s - 1) // 3, loss=1.0 / s, lr=0.1 * 0.9**s, images_per_s=2.5)
        if s % 3 == 0:
            log.log_eval(s, s // 3, _result())  # type: ignore[arg-type]
    return log


def _header(path: Path) -> list[str]:
    with path.open(newline="") as fh:
        return next(csv.reader(fh))


def test_csv_round_trip_and_columns(tmp_path: Path) -> None:
    log = _run(tmp_path, range(1, 7))
    log.close()
    rows = read_metrics_csv(tmp_path / "metrics.csv")
    assert rows == log.history  # floats are written with repr: exact round trip
    assert [r["step"] for r in rows] == [1, 2, 3, 3, 4, 5, 6, 6]
    assert rows[0]["loss"] == 1.0 and rows[4]["loss"] == 0.25 and rows[1]["lr"] == 0.1 * 0.9**2
    assert rows[3]["val_auc"] == 0.75 and rows[3]["val_n"] == 4.0 and rows[3]["epoch"] == 1
    assert "val_qwk" not in rows[3] and "loss" not in rows[3]  # undefined / not logged: empty
    assert _header(tmp_path / "metrics.csv")[:3] == ["step", "epoch", "time"]
    evals = [json.loads(ln) for ln in (tmp_path / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [3, 6]
    assert evals[0]["confusion"] == [[2, 0], [1, 1]] and evals[0]["prefix"] == "val"


def test_new_metric_widens_the_header(tmp_path: Path) -> None:
    with RunLogger(tmp_path, tensorboard=False) as log:
        log.log_step(1, loss=2.0)
        log.log_step(2, loss=1.5, grad_norm=np.float32(3.0))
        log.log_eval(2, 0, {"loss": 0.9, "val_accuracy": 0.5, "note": "text is not a scalar"})
    assert _header(tmp_path / "metrics.csv") == [
        "step", "epoch", "time", "loss", "grad_norm", "val_loss", "val_accuracy",
    ]  # fmt: skip
    rows = read_metrics_csv(tmp_path / "metrics.csv")
    assert "grad_norm" not in rows[0] and rows[1]["grad_norm"] == 3.0
    assert rows[2] == {"step": 2, "epoch": 0, "time": rows[2]["time"], "val_loss": 0.9,
                       "val_accuracy": 0.5}  # fmt: skip


def test_resume_truncates_rows_after_the_checkpoint(tmp_path: Path) -> None:
    _run(tmp_path, range(1, 8)).close()
    log = RunLogger(tmp_path, tensorboard=False)
    assert [r["step"] for r in log.history] == [1, 2, 3, 3, 4, 5, 6, 6, 7]
    assert log.truncate_after(4) == 4  # steps 5, 6, eval 6, 7
    assert [r["step"] for r in read_metrics_csv(tmp_path / "metrics.csv")] == [1, 2, 3, 3, 4]
    evals = (tmp_path / "evals.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in evals] == [3]
    log.log_step(5, epoch=1, loss=0.125)
    log.close()
    rows = read_metrics_csv(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows] == [1, 2, 3, 3, 4, 5] and rows[-1]["loss"] == 0.125


def test_torn_last_line_is_dropped(tmp_path: Path) -> None:
    _run(tmp_path, range(1, 3)).close()
    with (tmp_path / "metrics.csv").open("a") as fh:
        fh.write("3,0,17")  # killed mid-row
    log = RunLogger(tmp_path, tensorboard=False)
    assert [r["step"] for r in log.history] == [1, 2]
    log.log_step(3, loss=0.5)
    log.close()
    assert [r["step"] for r in read_metrics_csv(tmp_path / "metrics.csv")] == [1, 2, 3]


def test_disabled_logger_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "rank1"
    log = RunLogger(out, enabled=False)
    assert log.log_step(1, loss=1.0) == {}
    assert log.log_eval(1, 0, _result()) == {}  # type: ignore[arg-type]
    assert log.truncate_after(0) == 0 and log.plot() is None
    log.close()
    assert not out.exists() and log.history == []


def test_non_scalar_is_rejected(tmp_path: Path) -> None:
    log = RunLogger(tmp_path, tensorboard=False)
    with pytest.raises(TypeError, match=r"loss=.*not a number"):
        log.log_step(1, loss=[1.0, 2.0])
    log.close()


def test_tensorboard_events_and_purge_on_resume(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(tmp_path, range(1, 7), tensorboard=True).close()
    tb = tmp_path / "tensorboard"
    assert any(
        p.name.startswith("events.out.tfevents") and p.stat().st_size > 0 for p in tb.iterdir()
    )
    log = RunLogger(tmp_path)
    log.truncate_after(4)
    log.log_step(5, loss=40.0)
    log.close()
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert {"train/loss", "train/lr", "val/auc", "val/accuracy"} <= set(acc.Tags()["scalars"])
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert loss == pytest.approx({1: 1.0, 2: 0.5, 3: 1 / 3, 4: 0.25, 5: 40.0})
    assert [e.step for e in acc.Scalars("val/auc")] == [3]  # the eval at step 6 was purged


def test_missing_tensorboard_warns_once_and_keeps_csv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now fails
    monkeypatch.setattr(logs, "_tensorboard_warned", False)
    log = RunLogger(tmp_path / "a")
    with pytest.warns(RuntimeWarning, match="TensorBoard is unavailable"):
        log.log_step(1, loss=1.0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        RunLogger(tmp_path / "b").log_step(1, loss=1.0)
    assert record == []  # once per process, not once per logger
    assert read_metrics_csv(tmp_path / "a" / "metrics.csv")[0]["loss"] == 1.0
    assert not (tmp_path / "a" / "tensorboard").exists()


def _assert_png(path: Path) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels[..., :3].std() > 0.01  # not a blank canvas
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_training_curves_from_the_logger(tmp_path: Path) -> None:
    log = _run(tmp_path, range(1, 31))
    log.log_step(31, loss=float("nan"), lr=None)  # skipped in the plot, not a crash
    path = log.plot()
    assert path == tmp_path / "training_curves.png"
    _assert_png(path)
    log.close()
    empty = plot_training_curves([], tmp_path / "sub" / "empty.png")
    _assert_png(empty)
    partial = [{"step": 1, "loss": 1.0}, {"epoch": 1, "val_accuracy": 0.5, "val_loss": 0.7}]
    _assert_png(plot_training_curves(partial, tmp_path / "partial.png"))


def test_smooth_is_a_debiased_ema() -> None:
    assert smooth(np.full(7, 3.0)).tolist() == pytest.approx([3.0] * 7)
    assert smooth(np.array([1.0, 3.0]), window=3).tolist() == pytest.approx([1.0, 1 + 2 * 2 / 3])
    assert smooth(np.array([])).size == 0


def test_confusion_matrix_png(tmp_path: Path) -> None:
    cm = np.array([[5, 1, 0], [2, 7, 1], [0, 0, 0]])
    _assert_png(plot_confusion_matrix(cm, ["benign", "grade 1", "grade 2"], tmp_path / "cm.png"))
    _assert_png(plot_confusion_matrix(cm, None, tmp_path / "cm2.png", title="no names"))
    with pytest.raises(ValueError, match="2 class names for a 3 x 3"):
        plot_confusion_matrix(cm, ["a", "b"], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="K x K"):
        plot_confusion_matrix(np.zeros((2, 3)), ["a", "b"], tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_resolution_comparison_png(tmp_path: Path) -> None:
    results = {
        "full resolution (1.0 um/px)": {"auc": 0.93, "accuracy": 0.88, "n": 40},
        "8x downsampled": {"auc": 0.55, "accuracy": None},
    }
    _assert_png(plot_resolution_comparison(results, tmp_path / "res.png"))
    with pytest.raises(ValueError, match="no results"):
        plot_resolution_comparison({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="metrics="):
        plot_resolution_comparison({"a": {"loss": 0.3}}, tmp_path / "x.png")


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_run_files_get_the_umask_mode(tmp_path: Path, umask: int) -> None:
    """Every file of a run is created like ``open()`` creates it, not 0600 (mkstemp's mode)."""
    old = os.umask(umask)
    try:
        log = _run(tmp_path, range(1, 7))  # a widened header rewrites metrics.csv atomically
        log.truncate_after(4)  # rewrites metrics.csv and evals.jsonl atomically
        log.log_step(5, loss=0.2)  # appends to the rewritten file
        log.plot()
        log.close()
        plot_confusion_matrix([[2, 0], [1, 1]], None, tmp_path / "confusion_matrix.png")
        plot_resolution_comparison({"a": {"auc": 0.5}}, tmp_path / "resolution.png")
        plain = tmp_path / "plain.txt"
        plain.write_text("written by open()")
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in tmp_path.iterdir() if p.is_file()}
    assert set(modes) == {
        "metrics.csv", "evals.jsonl", "training_curves.png", "confusion_matrix.png",
        "resolution.png", "plain.txt",
    }  # fmt: skip
    assert modes == dict.fromkeys(modes, oct(0o666 & ~umask))


def test_a_write_that_fails_names_its_file(tmp_path: Path) -> None:
    """A full disk (here: a file-size limit, EFBIG) fails os.write without a file name;
    the one line a run prints must say which file could not be written."""
    import errno
    import subprocess

    code = (
        "import resource, signal, sys\n"
        "from hyfi_imaging.atomic import write_atomic\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))\n"
        "try:\n"
        f"    write_atomic({str(tmp_path / 'metrics.csv')!r}, 'x' * 5000)\n"
        "except OSError as err:\n"
        "    print(err.filename, err.errno)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(tmp_path / "metrics.csv"), str(errno.EFBIG)], out
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary file left behind
