"""Label files in, manifest out.

Label files come as the data sets ship them: PANDA's ``train.csv``
(``image_id,data_provider,isup_grade,gleason_score``), CAMELYON16's headerless
``reference.csv`` (``test_001,Tumor,Macro,...``), or a plain
``slide_id,label``. We detect a header, find the id and label columns by their
usual names (or take the user's ``--id-column``/``--label-column``), and match
ids to slide file names without their extension.

The manifest is the hand-over to training: one row per input slide, finished
or not, written atomically so a reader never sees half a file. It states each
slide's final µm/px (``mpp``), and ``fit_scale`` says when ``--fit fit``
shrank a slide to its canvas (below 1; ``warning`` says it in words), since
training refuses a cohort whose µm/px differ (:mod:`hyfi_imaging.train.preflight`).
Manifests written before these columns existed read as ``fit_scale`` 1.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.paths import safe_id

__all__ = [
    "MANIFEST_COLUMNS",
    "ManifestRow",
    "read_labels",
    "read_manifest",
    "label_id",
    "slide_id_of",
    "write_manifest",
]

MANIFEST_COLUMNS = (
    "slide_id",
    "path",
    "label",
    "height",
    "width",
    "mpp",
    "status",
    "error",
    "source",
    "fit_scale",
    "warning",
)

_ID_NAMES = ("slide_id", "image_id", "slide", "image", "id", "filename", "file", "name", "case_id")
_LABEL_NAMES = ("label", "isup_grade", "class", "target", "diagnosis", "y", "grade", "category")
_SLIDE_SUFFIXES = (".ome.tiff", ".ome.tif", ".ome.zarr")
#: File name endings a labels file's id may carry (``tumor_001.tif``): taken off. Any other dot
#: is part of the id (TCGA's ``...-DX1.0a2f3c``, ``S1.A``), never mistaken for an extension.
_IMAGE_SUFFIXES = (
    *_SLIDE_SUFFIXES, ".svs", ".ndpi", ".mrxs", ".scn", ".vms", ".vmu", ".bif", ".svslide",
    ".tif", ".tiff", ".btf", ".tf2", ".tf8", ".qptiff", ".dcm", ".zarr", ".png", ".jpg",
    ".jpeg", ".isyntax", ".czi", ".vsi",
)  # fmt: skip


def slide_id_of(path: Path | str) -> str:
    """The slide id of a file: its name without the (double) extension."""
    name = Path(path).name
    for suffix in _SLIDE_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return Path(name).stem if "." in name else name


def label_id(text: str) -> str:
    """The slide id a labels file's id cell names: its last path part, without a slide
    file's extension (:data:`_IMAGE_SUFFIXES`); other dots are part of the id."""
    name = Path(text).name
    for suffix in _IMAGE_SUFFIXES:
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


def _pick(
    header: list[str], wanted: str | None, names: tuple[str, ...], path: Path, what: str
) -> int:
    lower = [h.strip().lower() for h in header]
    if wanted is not None:
        if wanted.lower() not in lower:
            raise ConfigError(
                path,
                f"no column named {wanted!r} (columns: {', '.join(header)})",
                f"pass --{what}-column with one of those names",
            )
        return lower.index(wanted.lower())
    for name in names:
        if name in lower:
            return lower.index(name)
    raise ConfigError(
        path,
        f"cannot tell which column holds the {what} (columns: {', '.join(header)})",
        f"pass --{what}-column NAME",
    )


def read_labels(
    path: Path, *, id_column: str | None = None, label_column: str | None = None
) -> dict[str, str]:
    """Map slide id -> label from a CSV/TSV label file, header or not."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(path, f"cannot read the labels file ({err})", "check the path") from err
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ConfigError(path, "the labels file is empty", "give a CSV with slide ids and labels")
    try:
        dialect: type[csv.Dialect] | csv.Dialect = csv.Sniffer().sniff(lines[0], delimiters=",;\t")
    except csv.Error:
        dialect = csv.excel
    reader = csv.reader(io.StringIO(text), dialect, skipinitialspace=True)  # "a", "1": the 1
    rows: list[list[str]] = []
    numbers: list[int] = []  # each row's line in the file, blank lines counted
    for row in reader:
        if any(c.strip() for c in row):
            rows.append(row)
            numbers.append(reader.line_num)
    first = [c.strip().lower() for c in rows[0]]
    has_header = bool(set(first) & set(_ID_NAMES + _LABEL_NAMES)) or id_column is not None
    if has_header:
        header, body, numbers = rows[0], rows[1:], numbers[1:]
        id_col = _pick(header, id_column, _ID_NAMES, path, "id")
        label_col = _pick(header, label_column, _LABEL_NAMES, path, "label")
    else:  # headerless (CAMELYON16 reference.csv): id, label, ...
        body, id_col, label_col = rows, 0, 1
    labels: dict[str, str] = {}
    for lineno, row in zip(numbers, body, strict=True):
        if len(row) <= max(id_col, label_col):
            raise ConfigError(
                f"{path}:{lineno}",
                f"row has {len(row)} fields, expected at least {max(id_col, label_col) + 1}",
                "fix or remove that row",
            )
        where = f"{path}:{lineno}"
        sid = safe_id(label_id(row[id_col].strip()), where=where, what="slide id")
        label = row[label_col].strip()
        if not label:
            raise ConfigError(
                where,
                f"slide {sid!r} has an empty label",
                "fill it in, or remove the row (a slide without a label is not converted)",
            )
        if sid in labels and labels[sid] != label:
            raise ConfigError(
                where,
                f"slide {sid!r} has two labels ({labels[sid]!r}, {label!r})",
                "keep one row per slide",
            )
        labels[sid] = label
    return labels


def labels_from_names(paths: Iterable[Path], pattern: str) -> dict[str, str]:
    """Labels taken from file names by a regular expression's first group.

    CAMELYON16's training slides carry their class only in their names
    (``normal_001.tif``, ``tumor_042.tif``): ``--label-from-name '^(normal|tumor)_'``.
    Names that do not match get no label (and fail as unlabelled).
    """
    try:
        rx = re.compile(pattern)
    except re.error as err:
        raise ConfigError(
            "--label-from-name", f"{pattern!r} is not a regular expression ({err})", "fix it"
        ) from err
    if rx.groups < 1:
        raise ConfigError(
            "--label-from-name", f"{pattern!r} has no group", "put the label in parentheses"
        )
    labels = {}
    for p in paths:
        m = rx.search(p.name)
        if m:
            labels[slide_id_of(p)] = m.group(1)
    return labels


@dataclass(frozen=True)
class ManifestRow:
    """One line of ``manifest.csv``.

    ``mpp``: the µm/px the store came out at; ``fit_scale``: what ``--fit fit``
    shrank the asked resolution by (1: as asked); ``warning``: what the user
    should know about the slide (``"; "``-joined lines), else empty.
    """

    slide_id: str
    path: str
    label: str
    height: int
    width: int
    mpp: float | None
    status: str
    error: str
    source: str
    fit_scale: float = 1.0
    warning: str = ""
    #: the file line it was read from (0: not read from a file), for messages
    line: int = field(default=0, compare=False)


def write_manifest(rows: Iterable[ManifestRow], path: Path) -> Path:
    """Write the manifest atomically (temporary file, then rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(MANIFEST_COLUMNS)
        for r in rows:
            writer.writerow(
                [
                    r.slide_id,
                    r.path,
                    r.label,
                    r.height,
                    r.width,
                    "" if r.mpp is None else f"{r.mpp:.6g}",
                    r.status,
                    r.error,
                    r.source,
                    f"{r.fit_scale:.6g}",
                    r.warning,
                ]
            )
    os.replace(tmp, path)
    return path


#: The columns a slide manifest needs (``fit_scale`` and ``warning`` came later: optional).
_REQUIRED = ("slide_id", "path", "label", "height", "width", "mpp", "status", "error", "source")


def read_manifest(path: Path) -> list[ManifestRow]:
    """Read a manifest written by :func:`write_manifest`.

    Every row's slide id must be a plain name (:func:`~hyfi_imaging.paths.safe_id`):
    ids become output file names, and a manifest may come from anyone.
    """
    # utf-8-sig: a byte-order mark (Excel's "CSV UTF-8") read as part of the first column's
    # name, and the file as "not a hyfi-preprocess manifest (KeyError: 'slide_id')"
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        missing = [c for c in _REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise ConfigError(
                path,
                f"not a hyfi-preprocess manifest (no column {', '.join(missing)}; its columns: "
                f"{', '.join(reader.fieldnames or [])})",
                "write it with hyfi-preprocess, or give it those columns",
            )
        rows = []
        for d in reader:
            if not any((v or "").strip() for v in d.values() if isinstance(v, str)):
                continue  # a spreadsheet's empty row (,,,,): no slide
            line = reader.line_num  # the file's own line, blank lines counted
            rows.append(
                ManifestRow(
                    safe_id(d["slide_id"], where=f"{path}:{line}", what="slide id"),
                    d["path"],
                    d["label"],
                    int(d["height"] or 0),
                    int(d["width"] or 0),
                    float(d["mpp"]) if d["mpp"] else None,
                    d["status"],
                    d["error"],
                    d["source"],
                    float(d.get("fit_scale") or 1.0),
                    d.get("warning") or "",
                    line,
                )
            )
        return rows
