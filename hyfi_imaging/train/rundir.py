"""One run per directory: its identity, starting over, and what resuming may touch.

Why: a run directory used to be "whatever is in it". An old run's checkpoints
with higher step numbers then outranked a new run's, retention deleted the new
ones, and a relaunch resumed the wrong run while ``metrics.csv`` held the other
one's rows. Now ``run.json`` names the run (``run_id``); every checkpoint
marker, ``evals.jsonl`` record and ``summary.json`` carries the id, and resume
and retention look at that run's checkpoints only.

Three ways to start (``hyfi-train`` options):

* resume (default): continue the run in the directory, or start one if the
  directory holds none;
* ``--no-resume``: start a new run; refused (before any rank starts) if the
  directory already holds one, since that would mix two runs;
* ``--restart``: move every file of the old run into
  ``previous/<run_id>-<time>/`` (nothing is deleted), then start a new run.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Literal

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.paths import safe_id, under

__all__ = [
    "PREVIOUS",
    "RUN_FILE",
    "StartMode",
    "check_start",
    "read_run_id",
    "record_cut",
    "recorded_cut",
    "start_run",
    "used_by",
]

RUN_FILE = "run.json"
PREVIOUS = "previous"
StartMode = Literal["resume", "new", "restart"]
#: Files and folders a run writes into its directory (moved aside together).
_RUN_ENTRIES = (
    RUN_FILE,
    "checkpoints",
    "metrics.csv",
    "evals.jsonl",
    "tensorboard",
    "training_curves.png",
    "confusion_matrix.png",
    "summary.json",
    "recipe.yaml",
    "masks",
    "overlays",
    "val_per_image.csv",
    "val_predictions.csv",
)


def read_run_id(out: Path) -> str | None:
    """The id of the run in ``out`` (None if it holds none, or one from before run ids).

    The id names the folder a ``--restart`` moves the run to, so a ``run.json``
    whose id is not a plain name (:func:`~hyfi_imaging.paths.safe_id`) is refused.
    """
    try:
        value = json.loads((out / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return safe_id(str(value), where=out / RUN_FILE, what="run id") if value else None


def recorded_cut(out: Path, layout: str) -> tuple[int, ...] | None:
    """The pipeline cut (layers per stage) the run in ``out`` measured for ``layout``, if any.

    Why: an automatic cut is timed at launch, and timings vary; a resume that cut
    the model elsewhere would tile and round differently from the run it continues.
    The cut measured at a run's first launch on a layout is part of the run.
    """
    try:
        cuts = json.loads((out / RUN_FILE).read_text()).get("cuts", {})
        return tuple(int(n) for n in cuts[layout])
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def record_cut(out: Path, layout: str, cut: tuple[int, ...]) -> None:
    """Add ``layout``'s cut to the run's ``run.json`` (rank 0; atomically; once per layout)."""
    record = json.loads((out / RUN_FILE).read_text())
    cuts = record.setdefault("cuts", {})
    if layout in cuts:
        return
    cuts[layout] = list(cut)
    _write_record(out, record)


def _write_record(out: Path, record: dict[str, object]) -> None:
    tmp = out / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(out / RUN_FILE)


def used_by(out: Path) -> str | None:
    """What run ``out`` holds, in words, or None if it holds none."""
    checkpoints = out / "checkpoints"
    steps = sorted(p.name for p in checkpoints.glob("step_*")) if checkpoints.is_dir() else []
    run_id = read_run_id(out)
    if not steps and not (out / "metrics.csv").exists() and run_id is None:
        return None
    what = f"run {run_id}" if run_id else "a run"
    return f"{what} ({len(steps)} checkpoint(s))" if steps else f"{what} (no checkpoint yet)"


def check_start(out: Path, mode: StartMode) -> None:
    """Refuse ``--no-resume`` into a directory that holds a run (no process group needed)."""
    held = used_by(out)
    if mode == "new" and held is not None:
        raise ConfigError(
            out,
            f"holds {held}; --no-resume would mix a new run into it",
            "relaunch without --no-resume to continue it, with --restart to move it to "
            f"{PREVIOUS}/ and start over, or set train.out_dir to a new directory",
        )


def start_run(out: Path, mode: StartMode) -> str:
    """Make ``out`` belong to the run being started and return its id (rank 0 only).

    ``resume`` keeps the id in ``run.json`` (a directory from before run ids
    is adopted under a new id); ``new`` and ``restart`` write a new id, after
    ``restart`` moved the old run's files to ``previous/``.
    """
    out.mkdir(parents=True, exist_ok=True)
    if mode == "resume":
        run_id = read_run_id(out)
        if run_id is not None:
            return run_id
    elif mode == "restart" and used_by(out) is not None:
        old = read_run_id(out) or "run"
        aside = under(out / PREVIOUS, f"{old}-{time.strftime('%Y%m%d-%H%M%S')}")
        aside.mkdir(parents=True, exist_ok=False)
        for name in _RUN_ENTRIES:
            if (out / name).exists():
                shutil.move(str(out / name), str(aside / name))
    run_id = uuid.uuid4().hex[:12]
    _write_record(out, {"run_id": run_id, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return run_id
