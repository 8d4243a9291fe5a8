"""A classifier's per-slide predictions as CSV: the one spelling of the columns.

Why one module: ``hyfi-predict`` (one row per manifest row, with its status)
and ``hyfi-train`` (``val_predictions.csv``: every slide of the run with the
``split`` it was in) write the same ``pred, p_<class>...`` cells, so a table
from either reads the same way.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hyfi_imaging.atomic import write_atomic

__all__ = ["class_cells", "class_columns", "write_rows"]


def class_columns(classes: Sequence[str]) -> list[str]:
    """``pred, p_<class>...``: the columns of :func:`class_cells`."""
    return ["pred", *(f"p_{c}" for c in classes)]


def class_cells(probs: np.ndarray | None, classes: Sequence[str]) -> list[str]:
    """The predicted class and each class's probability (every digit: with 6 decimals, a
    confident model's were all 1.000000 from a logit margin of 14.6, and an AUC taken from
    the file 0.83 where the run logged 1.0); empty cells for None."""
    if probs is None:
        return [""] * (1 + len(classes))
    return [classes[int(np.argmax(probs))], *(repr(float(v)) for v in probs)]


def write_rows(path: Path, header: Sequence[str], rows: Sequence[Sequence[object]]) -> Path:
    """``header`` and ``rows`` as CSV at ``path``, atomically (its folder is created)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, buf.getvalue())
