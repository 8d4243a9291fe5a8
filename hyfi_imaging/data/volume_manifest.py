"""The manifest of a volume cohort: one CSV row per volume, its store, size and targets.

Why a manifest of its own: the slide manifest (:mod:`hyfi_imaging.preprocess.manifest`)
has one class label and a 2-D size; a volume has a depth, a voxel size per
axis and often several regression targets (CosmoFlow regresses four
cosmological parameters). The conventions are the slide manifest's: one row
per volume, finished or not (``status`` ``ok`` or why not in ``error``), store
paths relative to the manifest's directory, written atomically.

Columns: ``volume_id, path, depth, height, width, voxel_z, voxel_y, voxel_x,
labels, status, error, source`` and one ``target_<name>`` column per
regression target (``labels`` names the store's label image, if any).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hyfi_imaging.atomic import write_atomic
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.paths import safe_id

__all__ = [
    "VOLUME_COLUMNS",
    "VolumeRow",
    "manifest_kind",
    "read_volume_manifest",
    "write_volume_manifest",
]

VOLUME_COLUMNS = (
    "volume_id",
    "path",
    "depth",
    "height",
    "width",
    "voxel_z",
    "voxel_y",
    "voxel_x",
    "labels",
    "status",
    "error",
    "source",
)
_TARGET = "target_"


@dataclass(frozen=True)
class VolumeRow:
    """One line of a volume ``manifest.csv``.

    Attributes:
        volume_id: the volume's id.
        path: its OME-Zarr store, relative to the manifest's directory (or absolute).
        shape: ``(depth, height, width)`` at level 0.
        voxel_size: ``(z, y, x)`` micrometres per voxel.
        targets: regression targets by name (the same names on every row).
        labels: the name of the store's label image, or ``""``.
        status: ``ok`` when the store is finished and usable.
        error: why not, when ``status`` is not ``ok``.
        source: where the volume came from (a generator and its seed, a file).
    """

    volume_id: str
    path: str
    shape: tuple[int, int, int]
    voxel_size: tuple[float, float, float]
    targets: dict[str, float] = field(default_factory=dict)
    labels: str = ""
    status: str = "ok"
    error: str = ""
    source: str = ""


def write_volume_manifest(rows: Sequence[VolumeRow], path: str | Path) -> Path:
    """Write ``rows`` as a volume manifest, atomically; every row must name the same targets."""
    names = sorted(rows[0].targets) if rows else []
    for row in rows:
        if sorted(row.targets) != names:
            raise ConfigError(
                f"volume {row.volume_id}",
                f"has targets {sorted(row.targets)} but the first row has {names}",
                "give every volume of a cohort the same targets",
            )
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([*VOLUME_COLUMNS, *(_TARGET + n for n in names)])
    for r in rows:
        writer.writerow(
            [
                r.volume_id,
                r.path,
                *r.shape,
                *(f"{v:.6g}" for v in r.voxel_size),
                r.labels,
                r.status,
                r.error,
                r.source,
                *(repr(float(r.targets[n])) for n in names),
            ]
        )
    return write_atomic(path, buf.getvalue())


def read_volume_manifest(path: str | Path) -> list[VolumeRow]:
    """Read a manifest written by :func:`write_volume_manifest` (or its directory).

    Raises :class:`ConfigError` for a missing file, missing columns, bad numbers,
    or an id or label image name that is not a plain name
    (:func:`~hyfi_imaging.paths.safe_id`: ids become output file names).
    """
    p = Path(path)
    p = p / "manifest.csv" if p.is_dir() else p
    try:
        with p.open(newline="", encoding="utf-8-sig") as f:  # a BOM: Excel's "CSV UTF-8"
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            records = []
            for d in reader:
                if any((v or "").strip() for v in d.values() if isinstance(v, str)):
                    records.append((reader.line_num, d))  # a spreadsheet's ,,,, row: none
    except OSError as err:
        raise ConfigError(str(p), f"cannot read the manifest ({err})", "check the path") from err
    missing = [c for c in VOLUME_COLUMNS if c not in header]
    if missing:
        raise ConfigError(
            str(p),
            f"not a volume manifest (no column {', '.join(missing)})",
            "write it with write_volume_manifest",
        )
    names = [c[len(_TARGET) :] for c in header if c.startswith(_TARGET)]
    rows = []
    seen: dict[str, int] = {}
    for line, d in records:
        try:
            targets = {n: float(d[_TARGET + n]) for n in names}
            row = VolumeRow(
                d["volume_id"],
                d["path"],
                (int(d["depth"]), int(d["height"]), int(d["width"])),
                (float(d["voxel_z"]), float(d["voxel_y"]), float(d["voxel_x"])),
                targets,
                d["labels"],
                d["status"],
                d["error"],
                d["source"],
            )
        except (TypeError, ValueError) as err:
            raise ConfigError(
                f"{p}:{line}", f"bad value ({err})", "fix or rewrite the row"
            ) from err
        # Outside the try: a ConfigError is a ValueError, and its own line says more.
        safe_id(row.volume_id, where=f"{p}:{line}", what="volume id")
        if row.labels:  # the name of the store's label image: a folder inside it
            safe_id(row.labels, where=f"{p}:{line}", what="label image")
        if row.status == "ok" and not all(math.isfinite(v) for v in targets.values()):
            raise ConfigError(f"{p}:{line}", "a target is not a finite number", "fix the row")
        if row.status == "ok" and not all(math.isfinite(v) and v > 0 for v in row.voxel_size):
            raise ConfigError(
                f"{p}:{line}",
                f"voxel size {row.voxel_size} is not three positive numbers (µm, z y x)",
                "fix the row",
            )
        first = seen.setdefault(row.volume_id, line)
        if first != line:
            # its outputs (masks, rows of per_image.csv) are named by the id: one would
            # overwrite the other's
            raise ConfigError(
                f"{p}:{line}",
                f"volume id {row.volume_id!r} is on line {first} too",
                "give every volume its own id",
            )
        rows.append(row)
    return rows


def manifest_kind(manifest: str | Path) -> Literal["slides", "volumes"]:
    """``"volumes"`` for a volume manifest (a ``volume_id`` column), else ``"slides"`` (here,
    with the data: the loaders and the trainer ask it alike)."""
    given = Path(manifest)
    if (given / "zarr.json").is_file():  # "cannot read the manifest ...: run hyfi-preprocess"
        raise ConfigError(
            given,
            "is an image store, not a manifest",
            "pass the manifest.csv hyfi-preprocess wrote beside it (its --out folder)",
        )
    path = given / "manifest.csv" if given.is_dir() else given
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            header = next(csv.reader(f), [])
    except OSError:
        return "slides"  # the slide reader says what is wrong with the file
    except UnicodeDecodeError as err:
        from hyfi_imaging.errors import HyfiError
        from hyfi_imaging.io.detect import recognise

        try:
            slide = recognise(path).readable
        except HyfiError:
            slide = False
        if slide:  # "not UTF-8 text": a slide, not a damaged manifest
            raise ConfigError(
                path,
                "is a slide, not a manifest",
                "convert it with hyfi-preprocess SLIDE --out DIR, then pass DIR/manifest.csv",
            ) from None
        raise ConfigError(
            path, f"is not UTF-8 text (byte {err.start})", "save the manifest as UTF-8"
        ) from None
    return "volumes" if "volume_id" in header else "slides"
