"""A preprocessing run over many slides: discovery, labels, workers, resume, summary.

Why processes and ``forkserver``: decoding and resampling are CPU-bound, and zarr 3
keeps an event-loop thread that a forked child would inherit half-alive; each
worker therefore starts fresh and opens its own files, and exits the moment
the run is gone (:mod:`~hyfi_imaging.preprocess.lifeline`). One bad slide is
reported and skipped, never fatal; the manifest is rewritten after every slide
so an interrupted run still leaves an accurate (atomic) picture behind.

Why everything is checked before anything is written: a mistyped input, a
missing labels file or a disk too small for the stores must not leave an
empty output folder behind (a later run would take it for a started one). So
inputs, labels and free disk space are all checked first; only then is the
output folder created.

Annotations (``annotations=DIR``) are matched to slides by slide id
(``tumor_001.tif`` <-> ``DIR/tumor_001.xml`` or ``.geojson``); a slide with
none gets an all-background mask, and the summary says how many did, since
a misnamed folder would otherwise turn a cohort's tumours into background
without a word.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import multiprocessing as mp
import os
import signal
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from hyfi_imaging.errors import ConfigError, HyfiError, problem
from hyfi_imaging.io.annotations import ANNOTATION_SUFFIXES, class_mapping, find_annotation
from hyfi_imaging.io.budget import default_memory_budget
from hyfi_imaging.preprocess.canvas import fit_warning
from hyfi_imaging.preprocess.convert import (
    ConvertResult,
    PreprocessOptions,
    check_disk_space,
    check_not_anothers,
    convert_slide,
    is_done,
    remove_stale_temporaries,
    store_path,
)
from hyfi_imaging.preprocess.discover import (
    SLIDE_SUFFIXES,
    SUBFOLDER,
    SkippedInput,
    discover_slides,
)
from hyfi_imaging.preprocess.lifeline import exit_with
from hyfi_imaging.preprocess.manifest import (
    ManifestRow,
    labels_from_names,
    read_labels,
    read_manifest,
    slide_id_of,
    write_manifest,
)
from hyfi_imaging.preprocess.qc import QcChannels, write_contact_sheet

__all__ = ["SLIDE_SUFFIXES", "PreprocessSummary", "discover_slides", "run_preprocess"]

log = logging.getLogger("hyfi_imaging.preprocess")


@dataclass
class PreprocessSummary:
    """Outcome of a run; ``failed`` non-empty means exit status 1."""

    results: list[ConvertResult] = field(default_factory=list)
    manifest: Path | None = None
    contact_sheet: Path | None = None
    #: Paths in the named folders that are not slides, with the reason.
    skipped: list[SkippedInput] = field(default_factory=list)
    #: With annotations asked for: slide ids that have no annotation file (background masks).
    unannotated: list[str] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def failed(self) -> list[ConvertResult]:
        return [r for r in self.results if r.status == "failed"]

    def line(self) -> str:
        return (
            f"{len(self.results)} slides: {self.count('ok')} converted, "
            f"{self.count('skipped')} already done, {self.count('failed')} failed"
        )

    def warning_lines(self) -> list[str]:
        """``"<slide id>: <warning>"`` for every slide the user should look at (``--fit`` shrank it, the crop left signal out)."""
        return [f"{r.slide_id}: {w}" for r in self.results for w in result_warnings(r)]

    def annotation_line(self) -> str | None:
        """``"N slides have no annotation file: background masks"``, or None."""
        if not self.unannotated:
            return None
        n = len(self.unannotated)
        return f"{n} slide{'s have' if n != 1 else ' has'} no annotation file: background masks"


def result_warnings(res: ConvertResult) -> list[str]:
    """What the manifest's ``warning`` column and the log say about one converted slide."""
    if res.status == "failed":
        return []
    fit = fit_warning(res.mpp, res.fit_scale, (res.height, res.width))
    return [w for w in (fit, res.tissue_warning) if w]


def _check_writable(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-test-"):
            pass
    except OSError as err:
        raise ConfigError(
            out_dir,
            f"output directory is not writable ({err.strerror or err})",
            "choose another --out or fix its permissions",
        ) from err


def _failed(sid: str, source: Path, what: str, fix: str) -> ConvertResult:
    return ConvertResult(sid, str(source), "", "failed", error=problem(source, what, fix))


def run_preprocess(
    inputs: Sequence[Path],
    out_dir: Path,
    options: PreprocessOptions,
    *,
    labels_path: Path | None = None,
    id_column: str | None = None,
    label_column: str | None = None,
    label_from_name: str | None = None,
    annotations: Path | None = None,
    workers: int = 1,
    recursive: bool = False,
    qc: bool = True,
    qc_channels: QcChannels | None = None,
    progress: bool = True,
    on_result: Callable[[ConvertResult], None] | None = None,
) -> PreprocessSummary:
    """Convert every slide in ``inputs`` into ``out_dir``; see ``hyfi-preprocess --help``.

    ``qc_channels`` chooses what the QC pictures show (default: RGB as it is,
    else the first three channels, or grey for one). ``annotations`` is a
    folder of annotation files named by slide id, rasterized into each store's
    ``labels/annotations`` with ``options.annotation_classes`` (default:
    :data:`~hyfi_imaging.io.annotations.DEFAULT_CLASSES`). Without
    ``options.memory_budget`` each worker gets
    :func:`~hyfi_imaging.io.budget.default_memory_budget` of ``workers``.

    Raises :class:`ConfigError` only for problems that stop the whole run
    (missing input, no slides, unreadable labels file, too little disk space,
    unwritable output); these are all found before ``out_dir`` is created.
    Everything that concerns one slide is recorded in its result and the manifest.
    """
    found = discover_slides(inputs, recursive=recursive, out_dir=out_dir)
    if not found.slides:
        fix = (
            "add --recursive to search subfolders"
            if any(s.reason == SUBFOLDER for s in found.skipped)
            else f"name slide files, or folders holding slides ({', '.join(SLIDE_SUFFIXES)}, "
            "DICOM whole-slide images, OME-Zarr; recognised by content)"
        )
        passed = f" (skipped {found.summary()})" if found.skipped else ""
        raise ConfigError(", ".join(map(str, inputs)), f"no slide files found{passed}", fix)
    labels = (
        read_labels(labels_path, id_column=id_column, label_column=label_column)
        if labels_path
        else {}
    )
    if label_from_name:
        labels = {**labels_from_names(found.slides, label_from_name), **labels}
    labels = found.labels_for(labels)  # inputs sharing a stem are named by file, labelled by stem
    results, todo = _assign_ids(found.slides, labels, labels_path, label_from_name, found.ids)
    todo = _not_taken(todo, results, out_dir)
    options, matched = _match_annotations(annotations, options, todo, results)
    if options.memory_budget is None:  # decided once, here, where the workers are known
        options = replace(options, memory_budget=default_memory_budget(workers))
    pending = sum(
        not is_done(store_path(out_dir, sid), src, options, matched.get(sid)) for sid, src in todo
    )
    check_disk_space(out_dir, options, pending)
    _check_writable(out_dir)
    with _exclusive(out_dir):
        for stale in remove_stale_temporaries(out_dir):
            log.info("removed an unfinished store from an interrupted run: %s", stale)
        for item in found.skipped:
            log.info("not a slide, passed over: %s", item.line())
        for note in found.notes:
            log.warning("%s", note)
        summary = _convert_all(
            todo,
            results,
            out_dir,
            options,
            labels,
            matched,
            workers=workers,
            qc=qc,
            qc_channels=qc_channels,
            progress=progress,
            on_result=on_result,
        )
    summary.skipped = found.skipped
    if annotations is not None:
        summary.unannotated = sorted(sid for sid, _ in todo if matched.get(sid) is None)
        if summary.unannotated:
            log.info(
                "no annotation file in %s (background masks): %s",
                annotations,
                ", ".join(summary.unannotated),
            )
    return summary


def _match_annotations(
    folder: Path | None,
    options: PreprocessOptions,
    todo: list[tuple[str, Path]],
    results: dict[str, ConvertResult],
) -> tuple[PreprocessOptions, dict[str, Path | None]]:
    """Each slide's annotation file (None: none); slides with two files fail in ``results``."""
    if folder is None:
        if options.annotation_classes is not None:
            raise ConfigError(
                "--annotation-classes",
                "class labels were given but no annotation folder",
                "add --annotations DIR, or leave out --annotation-classes",
            )
        return options, {}
    if not folder.is_dir():
        raise ConfigError(
            folder,
            "the annotation folder does not exist",
            "give --annotations the folder holding <slide id>.xml / .geojson files",
        )
    if options.annotation_classes is None:
        options = replace(options, annotation_classes=tuple(class_mapping().items()))
    matched: dict[str, Path | None] = {}
    for sid, source in list(todo):
        try:
            matched[sid] = find_annotation(folder, sid)
        except HyfiError as err:
            todo.remove((sid, source))
            results[sid] = ConvertResult(sid, str(source), "", "failed", error=str(err))
    _say_orphans(folder, matched, [sid for sid, _ in todo])
    return options, matched


def _say_orphans(folder: Path, matched: dict[str, Path | None], ids: list[str]) -> None:
    """Warn of annotation files no slide claimed: ``Tumor_001.geojson`` beside a slide
    ``tumor_001`` drew an all-background mask, said only as "no annotation file"."""
    claimed = {p.name for p in matched.values() if p is not None}
    by_case = {sid.casefold(): sid for sid in ids}
    orphans = sorted(
        p.name
        for p in folder.iterdir()
        if p.is_file() and p.name.lower().endswith(ANNOTATION_SUFFIXES) and p.name not in claimed
    )
    if not orphans:
        return
    near = [
        f"{name} (slide {by_case[stem]}? ids match by exact name)"
        for name in orphans
        if (stem := name.rsplit(".", 1)[0].casefold()) in by_case
    ]
    log.warning(
        "%d annotation file(s) in %s match no slide id: %s",
        len(orphans),
        folder,
        ", ".join(near[:3] or orphans[:3]) + (" ..." if len(orphans) > 3 else ""),
    )


@contextlib.contextmanager
def _exclusive(out_dir: Path) -> Iterator[None]:
    """Hold a lock on ``out_dir``: two runs would remove each other's temporary stores."""
    with (out_dir / ".hyfi-preprocess.lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ConfigError(
                out_dir,
                "another hyfi-preprocess run is writing to this directory",
                "wait for it to finish, or choose another --out",
            ) from None
        yield


def _not_taken(
    todo: list[tuple[str, Path]], results: dict[str, ConvertResult], out_dir: Path
) -> list[tuple[str, Path]]:
    """``todo`` without the slides whose store in ``out_dir`` holds another file of the same
    id (an earlier batch's): each fails (its earlier row and store are kept)."""
    kept = []
    for sid, source in todo:
        try:
            check_not_anothers(store_path(out_dir, sid), source)
        except ConfigError as err:
            results[f"{sid}#{source}"] = ConvertResult(
                sid, str(source), "", "failed", error=str(err)
            )
        else:
            kept.append((sid, source))
    return kept


def _assign_ids(
    slides: list[Path],
    labels: dict[str, str],
    labels_path: Path | None,
    label_from_name: str | None,
    ids: dict[Path, str],
) -> tuple[dict[str, ConvertResult], list[tuple[str, Path]]]:
    """Slide ids of the slides to convert (``ids``, else the stem), and failed results for
    duplicates and unlabelled."""
    results: dict[str, ConvertResult] = {}
    todo: list[tuple[str, Path]] = []
    for source in slides:
        sid = ids.get(source) or slide_id_of(source)
        if sid in results or any(sid == s for s, _ in todo):
            other = (
                results[sid].source if sid in results else next(str(p) for s, p in todo if s == sid)
            )
            results[f"{sid}#{source}"] = _failed(
                sid,
                source,
                f"slide id {sid!r} is used by another input file ({other})",
                "rename one of the files so that slide ids are unique",
            )
        elif (labels_path is not None or label_from_name) and sid not in labels:
            where = (
                f"the labels file {labels_path}"
                if labels_path
                else f"--label-from-name {label_from_name!r}"
            )
            results[sid] = _failed(
                sid,
                source,
                f"slide {sid!r} has no label from {where}",
                "add a row for it, or leave the slide out",
            )
        else:
            todo.append((sid, source))
    return results, todo


def _convert_all(
    todo: list[tuple[str, Path]],
    results: dict[str, ConvertResult],
    out_dir: Path,
    options: PreprocessOptions,
    labels: dict[str, str],
    matched: dict[str, Path | None],
    *,
    workers: int,
    qc: bool,
    qc_channels: QcChannels | None,
    progress: bool,
    on_result: Callable[[ConvertResult], None] | None,
) -> PreprocessSummary:
    qc_dir = out_dir / "qc" if qc else None
    manifest = out_dir / "manifest.csv"
    sources = {_real(p) for _, p in todo} | {_real(Path(r.source)) for r in results.values()}
    earlier = _earlier_rows(manifest, set(results) | {sid for sid, _ in todo}, sources, out_dir)

    def rows() -> list[ManifestRow]:
        return sorted([*earlier, *_rows(results, labels, out_dir)], key=lambda r: r.slide_id)

    def record(res: ConvertResult) -> None:
        results[res.slide_id] = res
        if res.status == "failed":
            log.error("FAILED %s", res.error)
        else:
            log.info("%s %s -> %s", res.status, res.source, res.store)
            for line in result_warnings(res):
                log.warning("%s: %s", res.slide_id, line)
        write_manifest(rows(), manifest)
        if on_result is not None:
            on_result(res)

    for res in results.values():  # failed before converting (no label, a duplicate id)
        if res.status == "failed":
            log.error("FAILED %s", res.error)

    # one slide's conversion, in this process or a worker's (a partial pickles)
    convert = functools.partial(
        convert_slide, out_dir=out_dir, options=options, qc_dir=qc_dir, qc_channels=qc_channels
    )
    bar = tqdm(total=len(todo), unit="slide", desc="preprocess", disable=not progress)
    try:
        if workers <= 1:
            for sid, source in todo:
                record(convert(source, slide_id=sid, annotation=matched.get(sid)))
                bar.update()
        else:
            # forkserver, not fork: zarr's event-loop thread must not be inherited; the
            # preload pays the imaging imports once instead of once per worker (0.46 s CPU each).
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(
                [
                    "hyfi_imaging.preprocess.convert",
                    "hyfi_imaging.preprocess.qc",
                    "hyfi_imaging.preprocess.lifeline",
                ]
            )
            _start_forkserver()

            def in_pool(items: list[tuple[str, Path]], size: int) -> list[tuple[str, Path]]:
                """Convert ``items`` in a pool of ``size`` workers; the ones a dead worker
                left (every unfinished one: a dead worker breaks the whole pool)."""
                left = []
                with ProcessPoolExecutor(
                    max_workers=size,
                    mp_context=ctx,
                    initializer=exit_with,
                    initargs=(os.getpid(),),
                ) as pool:
                    futures: dict[Future[ConvertResult], tuple[str, Path]] = {
                        pool.submit(convert, source, slide_id=sid, annotation=matched.get(sid)): (
                            sid,
                            source,
                        )
                        for sid, source in items
                    }
                    for fut in as_completed(futures):
                        try:
                            res = fut.result()
                        except BrokenProcessPool:  # a worker died (e.g. out of memory)
                            left.append(futures[fut])
                            continue
                        record(res)
                        bar.update()
                order = {item: i for i, item in enumerate(items)}
                return sorted(left, key=order.__getitem__)

            left = in_pool(todo, workers)
            if left:  # which slide's worker died is not known: each again, alone
                log.warning(
                    "a worker process died; the %d slide(s) not finished are converted again, "
                    "one worker each",
                    len(left),
                )
            for sid, source in left:
                if in_pool([(sid, source)], 1):
                    record(
                        _failed(
                            sid,
                            source,
                            "the worker process converting it died (out of memory? dmesg says)",
                            "re-run with a smaller --size, or convert it on a larger machine",
                        )
                    )
                    bar.update()
    finally:
        bar.close()
    ordered = sorted(results.values(), key=lambda r: (r.slide_id, r.source))
    summary = PreprocessSummary(ordered, write_manifest(rows(), manifest))
    if qc_dir is not None:
        summary.contact_sheet = write_contact_sheet(ordered, labels, out_dir / "contact_sheet.png")
    return summary


def _start_forkserver() -> None:
    """Start the forkserver with Ctrl-C ignored (it and its children inherit that): its
    preload imports printed a traceback of their own when Ctrl-C reached them; each worker
    then ends on Ctrl-C without one (:func:`~.lifeline.exit_with`)."""
    from multiprocessing import forkserver

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


def _real(path: Path) -> Path:
    """``path`` with its links resolved: the file it names."""
    return Path(os.path.realpath(path))


def _earlier_rows(
    manifest: Path, this_run: set[str], sources: set[Path], out_dir: Path
) -> list[ManifestRow]:
    """The rows an earlier run into the same folder wrote for slides this run does not
    convert: kept, so that a run over other inputs (or one slide again) loses none of
    them (a rerun rewrote the manifest with its own slides alone, and the stores of the
    others, still on disk, dropped out of it). A row of a file this run converts under
    another id (``sources``: a new file made its stem ambiguous) is dropped, with a
    warning naming its store: one slide as two rows could be in training and validation
    both. A manifest that cannot be read is left to be replaced, with a warning."""
    if not manifest.exists():
        return []
    try:
        rows = [row for row in read_manifest(manifest) if row.slide_id not in this_run]
    except Exception as err:  # a damaged or foreign manifest: this run's rows replace it
        log.warning("%s: earlier rows not kept (%s: %s)", manifest, type(err).__name__, err)
        return []
    kept = []
    for row in rows:
        if row.source and _real(Path(row.source)) in sources:
            log.warning(
                "%s: slide %r is dropped from the manifest: its file %s is converted under "
                "another id now; its store %s is left on disk (delete it)",
                manifest,
                row.slide_id,
                row.source,
                out_dir / row.path if row.path else "(none)",
            )
        else:
            kept.append(row)
    return kept


def _rows(
    results: dict[str, ConvertResult], labels: dict[str, str], out_dir: Path
) -> list[ManifestRow]:
    rows = []
    for res in sorted(results.values(), key=lambda r: (r.slide_id, r.source)):
        path = os.path.relpath(res.store, out_dir) if res.store else ""
        status = "ok" if res.status in ("ok", "skipped") else res.status
        rows.append(
            ManifestRow(
                res.slide_id,
                path,
                labels.get(res.slide_id, ""),
                res.height,
                res.width,
                res.mpp,
                status,
                res.error,
                res.source,
                res.fit_scale,
                "; ".join(result_warnings(res)),
            )
        )
    return rows
