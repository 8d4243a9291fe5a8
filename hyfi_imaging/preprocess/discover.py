"""Which inputs are slides, and, for everything else in a folder, why not.

Why by content and why a list: slide archives hold ``.qptiff`` and ``.dcm``
files, TIFFs without a ``.tif`` name, CSVs, thumbnails and subfolders. A scan
that trusts a list of extensions silently drops the slides it does not know,
and a scan that says nothing leaves the user to guess why a folder of 400
slides produced 380 stores. So every file of a named folder is looked at
(:func:`~hyfi_imaging.io.detect.recognise`: magic bytes, a DICOM header,
OpenSlide's detection; no pixels), and everything that is not converted is
reported with its reason: once on the console (counts and a few names), in
full in ``preprocess.log``.

Rules, in order:

* Files named on the command line are always tried (a bad one fails in the
  manifest with its reason).
* In a folder: hidden files and the output folder are skipped; a subfolder is
  searched only with ``--recursive`` (an OME-Zarr store inside a folder is
  not converted again, and a MIRAX slide's data folder belongs to its
  ``.mrxs``); a file is a slide when a reader here opens its content, or
  when its name ends in a slide extension (then a damaged slide fails
  loudly rather than being skipped); other files are skipped with what they are.
* The files of one DICOM whole-slide series (one per pyramid level, plus label
  and overview) are one slide: OpenSlide opens the series from any one of
  them, so the largest file stands for it and the others are listed as parts.
* Inputs that would get one slide id (``boxes.png`` and ``boxes.tiff`` are
  both ``boxes``) are opened, and a good slide is never given up for a bad
  one: the ones that cannot be opened are skipped, with their error, when
  another one can; two or more that remain keep their file names as ids
  (``boxes.png``, ``boxes.tiff``), said in one line. Ids of inputs with a
  stem of their own never change, so existing cohorts keep theirs. Inputs
  with the same *name* (in two folders) cannot be told apart that way and
  fail as duplicates in the manifest.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hyfi_imaging.errors import ConfigError, SlideError
from hyfi_imaging.io.annotations import ANNOTATION_SUFFIXES
from hyfi_imaging.io.detect import open_slide, recognise
from hyfi_imaging.preprocess.manifest import slide_id_of

__all__ = ["SLIDE_SUFFIXES", "SUBFOLDER", "Discovery", "SkippedInput", "discover_slides"]

#: Names that mark a slide even when the content is not recognised (it then fails with a reason).
SLIDE_SUFFIXES = (
    ".svs",
    ".tif",
    ".tiff",
    ".qptiff",
    ".ndpi",
    ".mrxs",
    ".scn",
    ".vms",
    ".vmu",
    ".bif",
    ".svslide",
    ".btf",
    ".png",
    ".jpg",
    ".jpeg",
)

#: The reason of a subfolder not searched (the fix: ``--recursive``).
SUBFOLDER = "subfolders, not searched without --recursive"
_HIDDEN = "hidden files"
_OUTPUT = "the output folder (--out)"
_EARLIER_OUTPUT = "output folders of earlier hyfi-preprocess runs"
_SAME_FILE = "links to a file given already"
_STORE = "OME-Zarr stores inside a folder (name one on the command line to convert it)"
_SPECIAL = "not regular files"
_UNREADABLE = "files that cannot be read"
_DICOM_PART = "further files of a DICOM series (converted through its largest file)"
_SHARED_ID = "unreadable files whose slide id a readable input has (that one is converted)"


@dataclass(frozen=True)
class SkippedInput:
    """A path found in a folder that is not converted, and why.

    ``reason`` is the group it is reported under (e.g. ``"subfolders, not
    searched without --recursive"``); ``detail`` is what the log adds for this
    one path (e.g. which SOP class a DICOM file has).
    """

    path: Path
    reason: str
    detail: str = ""
    #: The path as shown on the console: relative to the folder named, ``/`` for folders.
    shown: str = ""

    def line(self) -> str:
        """``path: detail`` for the log."""
        return f"{self.path}: {self.detail or self.reason}"


@dataclass
class Discovery:
    """The slides to convert, in order, and what was passed over."""

    slides: list[Path] = field(default_factory=list)
    skipped: list[SkippedInput] = field(default_factory=list)
    #: Slide ids that are not :func:`slide_id_of` the path: inputs sharing a stem keep their names.
    ids: dict[Path, str] = field(default_factory=dict)
    #: One line per group of inputs that share a stem and were given their file names as ids.
    notes: list[str] = field(default_factory=list)

    def slide_id(self, path: Path) -> str:
        """The slide id of one of :attr:`slides`."""
        return self.ids.get(path) or slide_id_of(path)

    def labels_for(self, labels: dict[str, str]) -> dict[str, str]:
        """``labels`` (keyed by stem, as labels files and ``--label-from-name`` name slides)
        plus the stem's label for each input whose id is its file name, and the label of a
        row naming an input by its whole file name (an extension not known as a slide's)."""
        by_file = {self.slide_id(p): labels[p.name] for p in self.slides if p.name in labels}
        named = {
            sid: labels[slide_id_of(p)] for p, sid in self.ids.items() if slide_id_of(p) in labels
        }
        return {**by_file, **named, **labels}

    def groups(self) -> dict[str, list[SkippedInput]]:
        """Skipped paths by reason, reasons in the order first met."""
        out: dict[str, list[SkippedInput]] = defaultdict(list)
        for s in self.skipped:
            out[s.reason].append(s)
        return dict(out)

    def summary_lines(self, names: int = 3) -> list[str]:
        """One line per reason: ``reason: count (the first names, ...)``."""
        lines = []
        for reason, items in self.groups().items():
            shown = [s.shown or s.path.name for s in items[:names]]
            more = ", ..." if len(items) > names else ""
            lines.append(f"{reason}: {len(items)} ({', '.join(shown)}{more})")
        return lines

    def summary(self, names: int = 2) -> str:
        """All reasons on one line (for an error message)."""
        return "; ".join(self.summary_lines(names))


def _is_store(path: Path) -> bool:
    return (path / "zarr.json").is_file() or (path / ".zgroup").is_file()


def _is_output(path: Path) -> bool:
    """Whether ``path`` is a folder hyfi-preprocess wrote (its lock, or its manifest and log):
    its QC pictures and contact sheet are no slides."""
    return (path / ".hyfi-preprocess.lock").is_file() or (
        (path / "manifest.csv").is_file() and (path / "preprocess.log").is_file()
    )


def discover_slides(
    inputs: Sequence[Path], *, recursive: bool = False, out_dir: Path | None = None
) -> Discovery:
    """Slides among ``inputs`` (files, folders, OME-Zarr stores) and what was skipped.

    Writes nothing, and reads no pixels except to open the inputs that share a
    slide id (see the module docstring).

    Raises:
        ConfigError: an input does not exist.
    """
    found = Discovery()
    seen: dict[Path, Path] = {}  # file (links resolved) -> the input that named it first
    series: dict[tuple[Path, str], list[Path]] = defaultdict(list)
    out_real = out_dir.resolve() if out_dir is not None and out_dir.exists() else None

    def add(path: Path) -> None:
        real = path.resolve()
        if real in seen:  # one file named twice: one slide (a link to it is said)
            if path.absolute() != seen[real].absolute():
                skip(path, _SAME_FILE, f"the same file as {seen[real]}")
        else:
            seen[real] = path
            found.slides.append(path)

    root = Path()  # the folder being scanned, for the names shown
    roots: dict[Path, Path] = {}

    def skip(path: Path, reason: str, detail: str = "") -> None:
        shown = os.path.relpath(path, roots.get(path, root)) + ("/" if path.is_dir() else "")
        found.skipped.append(SkippedInput(path, reason, detail, shown))

    def scan(folder: Path, visited: frozenset[Path]) -> None:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as err:
            skip(folder, _UNREADABLE, f"cannot list the folder ({err.strerror})")
            return
        names = {e.name for e in entries}
        for entry in entries:
            path = Path(entry.path)
            if entry.name.startswith("."):
                skip(path, _HIDDEN)
            elif entry.is_dir():
                real = path.resolve()
                if real == out_real:
                    skip(path, _OUTPUT)
                elif _is_output(path):
                    skip(path, _EARLIER_OUTPUT)
                elif _is_store(path):
                    skip(path, _STORE)
                elif f"{entry.name}.mrxs" in names:
                    continue  # a MIRAX slide's data folder: part of the .mrxs file beside it
                elif not recursive:
                    skip(path, SUBFOLDER)
                elif real not in visited:  # a symlink back up the tree is not followed twice
                    scan(path, visited | {real})
            elif not entry.is_file():
                skip(path, _SPECIAL)
            else:
                classify(path)

    def classify(path: Path) -> None:
        roots[path] = root
        try:
            what = recognise(path)
        except SlideError as err:
            skip(path, _UNREADABLE, err.what)
            return
        if what.readable and what.series is not None:
            series[(path.parent.resolve(), what.series)].append(path)
            add(path)
        elif what.readable or path.name.lower().endswith(SLIDE_SUFFIXES):
            add(path)
        else:
            reason = what.reason
            if reason.startswith("DICOM whole-slide"):
                skip(path, "DICOM whole-slide images this OpenSlide cannot open", reason)
            elif reason.startswith("DICOM"):
                skip(path, "DICOM files that are not whole-slide images", reason)
            elif path.name.lower().endswith(ANNOTATION_SUFFIXES):
                skip(path, "annotation files (read with --annotations DIR)", reason)
            elif what.kind == "empty":
                skip(path, "empty files (0 bytes)", reason)
            elif what.kind == "other":
                skip(path, "files whose content is not an image", reason)
            else:
                skip(path, "files in formats hyfi-imaging does not read", reason)

    for item in inputs:
        if item.is_dir() and out_real is not None and item.resolve() == out_real:
            raise ConfigError(
                item,
                "is both an input folder and --out: this run's stores, QC pictures and "
                "contact sheet would be read as slides by the next",
                "choose another --out (e.g. a folder beside the slides)",
            )
        if item.is_dir() and not _is_store(item):
            root = item
            scan(item, frozenset({item.resolve()}))
        elif item.exists():
            add(item)
        else:
            raise ConfigError(item, "no such file or directory", "check the slide path")

    for members in series.values():
        if len(members) > 1:
            keep = max(members, key=lambda p: (p.stat().st_size, -members.index(p)))
            for part in members:
                if part != keep:
                    found.slides.remove(part)
                    skip(part, _DICOM_PART, f"part of the DICOM series converted as {keep.name}")
    _separate_shared_ids(found, skip)
    return found


def _open_error(path: Path) -> str | None:
    """Why ``path`` cannot be opened as a slide (one line), or ``None`` when it can."""
    try:
        with open_slide(path):
            return None
    except SlideError as err:
        return err.what
    except Exception as err:  # a reader's own failure: still a reason, never a crash of the scan
        return f"{type(err).__name__}: {err}"


def _separate_shared_ids(found: Discovery, skip: Callable[[Path, str, str], None]) -> None:
    """Inputs that share a slide id: skip the unreadable for a readable one, name the rest by file."""
    by_id: dict[str, list[Path]] = defaultdict(list)
    for path in found.slides:
        by_id[slide_id_of(path)].append(path)
    for sid, paths in by_id.items():
        if len(paths) < 2:
            continue
        errors = {p: _open_error(p) for p in paths}
        good = [p for p in paths if errors[p] is None]
        kept = f"{', '.join(g.name for g in good)}, with the same slide id {sid!r}, "
        kept += "is converted" if len(good) == 1 else "are converted"
        for p in paths:
            if good and errors[p] is not None:
                found.slides.remove(p)
                skip(p, _SHARED_ID, f"{errors[p]}; {kept}")
        left = good or paths
        if len({p.name for p in left}) > 1:  # same names (two folders) fail as duplicates
            for p in left:
                found.ids[p] = p.name
            found.notes.append(
                f"{len(left)} inputs share the slide id {sid!r}; their ids are their file names: "
                + ", ".join(p.name for p in left)
            )
