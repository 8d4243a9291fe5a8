"""The run's metric log: ``metrics.csv``, TensorBoard events and an in-memory history.

Why a CSV first and TensorBoard second: the CSV is the record a user can open
anywhere, diff between runs and redraw with
:func:`~hyfi_imaging.train.plots.plot_training_curves`; TensorBoard is the live
view while a run is going. TensorBoard is optional — without it the logger
warns once and keeps the CSV.

Design points:

* **One row per call.** :meth:`RunLogger.log_step` writes a training row
  (``loss``, ``lr``, ``images_per_s`` ...), :meth:`RunLogger.log_eval` an
  evaluation row whose keys carry a prefix (``val_accuracy``, ``val_auc`` ...).
  Columns are ``step, epoch, time`` followed by every other key in the order
  it first appeared; a key seen for the first time rewrites the file with the
  wider header (atomically), so a row never lands under the wrong column.
* **Flushed on every write**, so a killed run loses at most the row being
  written; a torn last line is dropped when the file is opened again.
* **Resume.** Opening an existing run directory loads its rows into
  :attr:`RunLogger.history`; :meth:`RunLogger.truncate_after` then drops the
  rows logged after the checkpoint being resumed (in the CSV, in
  ``evals.jsonl``, and in TensorBoard through ``purge_step``), so the log
  never shows two different histories for one step.
* **Only rank 0 writes.** ``RunLogger(..., enabled=False)`` on every other
  rank makes each method a no-op, so the trainer calls it unconditionally.

Full evaluation results (with the confusion matrix) go to ``evals.jsonl``, one
JSON object per evaluation, since a matrix does not fit a CSV cell.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from hyfi_imaging.atomic import write_atomic
from hyfi_imaging.train.metrics import EvalResult

__all__ = ["CSV_NAME", "EVALS_NAME", "TENSORBOARD_DIR", "RunLogger", "jsonable", "read_metrics_csv"]

CSV_NAME = "metrics.csv"
EVALS_NAME = "evals.jsonl"
TENSORBOARD_DIR = "tensorboard"

_LEADING = ("step", "epoch", "time")
_NOT_SCALARS = frozenset(_LEADING)
_tensorboard_warned = False

Value = float | int
Row = dict[str, Value]


def _to_number(key: str, value: object) -> Value | None:
    """A CSV/TensorBoard-ready number from a Python, numpy or 0-d torch scalar."""
    if value is None:
        return None
    if isinstance(value, bool | np.bool_):
        return int(value)
    if isinstance(value, int | np.integer):
        return int(value)
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"RunLogger: {key}={value!r} is not a number; log scalars only "
            "(call .item() on a tensor)."
        ) from err


def _parse(text: str) -> Value | None:
    if text == "":
        return None
    try:
        return int(text)
    except ValueError:
        return float(text)


def _format(value: Value | None) -> str:
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)


def _read_csv(path: Path) -> tuple[list[str], list[Row], bool]:
    """Columns, rows and whether a torn last line was dropped."""
    text = path.read_text(encoding="utf-8")
    torn = bool(text) and not text.endswith("\n")
    if torn:
        text = text[: text.rfind("\n") + 1]
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    if header is None:
        return list(_LEADING), [], torn
    rows: list[Row] = []
    for lineno, cells in enumerate(reader, start=2):
        if len(cells) != len(header):
            raise ValueError(
                f"{path}:{lineno}: {len(cells)} cells for {len(header)} columns; "
                "the file was edited or mixed with another run — move it away to start afresh."
            )
        row: Row = {}
        for key, cell in zip(header, cells, strict=True):
            value = _parse(cell)
            if value is not None:
                row[key] = value
        rows.append(row)
    return header, rows, torn


def read_metrics_csv(path: str | os.PathLike[str]) -> list[Row]:
    """Rows of a ``metrics.csv`` as dicts (empty cells left out), e.g. to redraw curves."""
    return _read_csv(Path(path))[1]


class RunLogger:
    """Log training and evaluation scalars to CSV, TensorBoard and :attr:`history`.

    OK::

        log = RunLogger(run_dir, enabled=(rank == 0))
        log.truncate_after(resume_step)          # only when resuming
        log.log_step(step, epoch=epoch, loss=loss.item(), lr=lr, images_per_s=ips)
        log.log_eval(step, epoch, evaluate_predictions(probs, labels, task="binary"))
        log.close()

    Error: ``log.log_step(step, loss=tensor_with_3_values)`` raises
    :class:`TypeError` — log scalars only.
    """

    def __init__(
        self, out_dir: str | os.PathLike[str], *, enabled: bool = True, tensorboard: bool = True
    ) -> None:
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self.use_tensorboard = tensorboard
        self.history: list[Row] = []
        """Every row of this run, oldest first (including rows loaded on resume)."""
        self._columns: list[str] = list(_LEADING)
        self._csv: io.TextIOWrapper | None = None
        self._writer: Any = None
        self._tb_failed = False
        self._purge_step: int | None = None
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.csv_path.exists():
            columns, self.history, torn = _read_csv(self.csv_path)
            self._columns = columns + [c for c in _LEADING if c not in columns]
            if torn or columns != self._columns:
                self._rewrite()

    # -- paths -------------------------------------------------------------------------

    @property
    def csv_path(self) -> Path:
        """``out_dir / "metrics.csv"``."""
        return self.out_dir / CSV_NAME

    @property
    def evals_path(self) -> Path:
        """``out_dir / "evals.jsonl"``: one full evaluation result per line."""
        return self.out_dir / EVALS_NAME

    @property
    def tensorboard_dir(self) -> Path:
        """``out_dir / "tensorboard"``."""
        return self.out_dir / TENSORBOARD_DIR

    # -- logging -----------------------------------------------------------------------

    def log_step(self, step: int, **scalars: object) -> Row:
        """Log one training row (``loss=``, ``lr=``, ``epoch=`` ...); ``None`` values are skipped.

        Returns the row as stored in :attr:`history` (empty when disabled).
        """
        if not self.enabled:
            return {}
        row = self._row(step, scalars)
        self._write(row, prefix="train")
        return row

    def log_eval(
        self,
        step: int,
        epoch: int | None,
        result: EvalResult | Mapping[str, Any],
        *,
        prefix: str = "val",
    ) -> Row:
        """Log an evaluation as ``<prefix>_<metric>`` columns and one line of ``evals.jsonl``.

        ``result`` is an :class:`EvalResult` (its defined scalars are logged)
        or a mapping (its numeric values are logged, e.g. ``{"loss": 0.41}``; a key
        that already has the prefix, ``"val_loss"``, keeps it).
        Returns the row as stored in :attr:`history` (empty when disabled).
        """
        if not self.enabled:
            return {}
        if isinstance(result, EvalResult):
            scalars: dict[str, object] = dict(result.scalars())
            full: dict[str, Any] = result.as_dict()
        else:
            scalars = {k: v for k, v in result.items() if _is_scalar(v)}
            full = dict(result)
        named = {
            k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": v for k, v in scalars.items()
        }
        row = self._row(step, named, epoch=epoch)
        self._write(row, prefix=prefix)
        record = {"step": int(step), "epoch": epoch, "prefix": prefix, "time": row["time"], **full}
        with self.evals_path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(jsonable(record)) + "\n")
        return row

    def truncate_after(self, step: int, *, evals_at_step: bool = True) -> int:
        """Drop every row logged after ``step`` (CSV, ``evals.jsonl``, TensorBoard); return how many.

        Call it right after opening the logger when resuming from a checkpoint
        taken at ``step``, before logging anything new. ``evals_at_step=False`` also drops
        the evaluation rows at ``step`` itself: a checkpoint taken at an epoch's last step
        is written before that epoch's evaluation, which the resumed run then does again
        (and logged twice).
        """
        if not self.enabled:
            return 0
        cut = step if evals_at_step else step - 1

        def kept_row(r: Row) -> bool:
            at = int(r.get("step", 0))
            return at <= cut or (at == step and not any(str(k).startswith("val_") for k in r))

        kept = [r for r in self.history if kept_row(r)]
        dropped = len(self.history) - len(kept)
        self.history = kept
        self._rewrite()
        if self.evals_path.exists():
            lines = self.evals_path.read_text(encoding="utf-8").splitlines(keepends=True)
            kept_lines = [ln for ln in lines if _jsonl_step(ln, default=cut + 1) <= cut]
            write_atomic(self.evals_path, "".join(kept_lines))
        # TensorBoard hides events at or after purge_step from older files of the run.
        self._purge_step = step + 1
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._tensorboard()
        return dropped

    def plot(self, path: str | os.PathLike[str] | None = None) -> Path | None:
        """Draw :attr:`history` with :func:`plot_training_curves` (default ``out_dir/training_curves.png``)."""
        if not self.enabled:
            return None
        from hyfi_imaging.train.plots import plot_training_curves

        return plot_training_curves(self.history, path or self.out_dir / "training_curves.png")

    def flush(self) -> None:
        """Flush the TensorBoard writer (the CSV is flushed on every write)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Close the CSV and TensorBoard files; safe to call twice. Logging again reopens them."""
        if self._csv is not None:
            self._csv.close()
            self._csv = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _row(self, step: int, scalars: Mapping[str, object], *, epoch: object = None) -> Row:
        row: Row = {"step": int(step)}
        epoch_number = _to_number("epoch", scalars.get("epoch", epoch))
        if epoch_number is not None:
            row["epoch"] = int(epoch_number)
        row["time"] = round(time.time(), 3)
        for key, value in scalars.items():
            if key in _NOT_SCALARS:
                continue
            if "," in key or "\n" in key or '"' in key:
                raise ValueError(
                    f"RunLogger: metric name {key!r} cannot be a CSV column; rename it."
                )
            number = _to_number(key, value)
            if number is not None:
                row[key] = number
        return row

    def _write(self, row: Row, *, prefix: str) -> None:
        self.history.append(row)
        new = [k for k in row if k not in self._columns]
        if new or not self.csv_path.exists():
            self._columns.extend(new)
            self._rewrite()
        else:
            fh = self._csv_handle()
            fh.write(self._line(row))
            fh.flush()
        writer = self._tensorboard()
        if writer is not None:
            for key, value in row.items():
                if key in _NOT_SCALARS:
                    continue
                tag = f"{prefix}/{key.removeprefix(prefix + '_')}"
                writer.add_scalar(tag, value, global_step=row["step"], walltime=row["time"])
            writer.flush()

    def _line(self, row: Row) -> str:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow([_format(row.get(c)) for c in self._columns])
        return buf.getvalue()

    def _csv_handle(self) -> io.TextIOWrapper:
        if self._csv is None:
            self._csv = self.csv_path.open("a", encoding="utf-8", newline="")
        return self._csv

    def _rewrite(self) -> None:
        """Write header and :attr:`history` to a temp file and move it over the CSV."""
        if self._csv is not None:
            self._csv.close()
            self._csv = None
        header = io.StringIO()
        csv.writer(header, lineterminator="\n").writerow(self._columns)
        write_atomic(
            self.csv_path, header.getvalue() + "".join(self._line(r) for r in self.history)
        )

    def _tensorboard(self) -> Any:
        global _tensorboard_warned
        if not self.use_tensorboard or self._tb_failed:
            return None
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                self._tb_failed = True
                if not _tensorboard_warned:
                    _tensorboard_warned = True
                    warnings.warn(
                        f"RunLogger: TensorBoard is unavailable ({err}); logging to "
                        f"{CSV_NAME} only. Install it with `pip install tensorboard`.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                return None
            self._writer = SummaryWriter(str(self.tensorboard_dir), purge_step=self._purge_step)
        return self._writer


def _is_scalar(value: object) -> bool:
    if isinstance(value, int | float | np.number):
        return True
    return hasattr(value, "item") and getattr(value, "ndim", None) == 0  # 0-d tensor / array


def jsonable(obj: object) -> Any:
    """Plain JSON types; NaN/inf become ``null`` so the file stays strict JSON."""
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, np.generic) or _is_scalar(obj):
        obj = getattr(obj, "item", lambda: obj)()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    return str(obj)


def _jsonl_step(line: str, *, default: int) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return default  # a torn last line of a killed run
