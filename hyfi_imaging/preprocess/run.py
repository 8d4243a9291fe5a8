"""A preprocessing run over many slides: discovery, labels, workers, resume, summary.

Why processes and ``forkserver``: decoding and resampling are CPU-bound, and zarr 3
keeps an event-loop thread that a forked child would inherit half-alive; each
worker therefore starts fresh and opens its own files. One bad slide is
reported and skipped, never fatal; the manifest is rewritten after every slide
so an interrupted run still leaves an accurate (atomic) picture behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing as mp
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from hyfi_imaging.errors import ConfigError, problem
from hyfi_imaging.preprocess.convert import (
    ConvertResult,
    PreprocessOptions,
    convert_slide,
    remove_stale_temporaries,
)
from hyfi_imaging.preprocess.manifest import (
    ManifestRow,
    labels_from_names,
    read_labels,
    slide_id_of,
    write_manifest,
)
from hyfi_imaging.preprocess.qc import write_contact_sheet

__all__ = ["SLIDE_SUFFIXES", "PreprocessSummary", "discover_slides", "run_preprocess"]

log = logging.getLogger("hyfi_imaging.preprocess")

#: File name endings picked up when a directory is given (files named explicitly are always tried).
SLIDE_SUFFIXES = (
    ".svs",
    ".tif",
    ".tiff",
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


@dataclass
class PreprocessSummary:
    """Outcome of a run; ``failed`` non-empty means exit status 1."""

    results: list[ConvertResult] = field(default_factory=list)
    manifest: Path | None = None
    contact_sheet: Path | None = None

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


def discover_slides(inputs: Sequence[Path], *, recursive: bool = False) -> list[Path]:
    """Files named on the command line, plus slide files found in named directories."""
    found: list[Path] = []
    for item in inputs:
        if item.is_dir() and not (item / "zarr.json").exists():
            pattern = "**/*" if recursive else "*"
            found.extend(
                p
                for p in sorted(item.glob(pattern))
                if p.is_file() and p.name.lower().endswith(SLIDE_SUFFIXES)
            )
        elif item.exists():
            found.append(item)
        else:
            raise ConfigError(item, "no such file or directory", "check the slide path")
    return found


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
    workers: int = 1,
    recursive: bool = False,
    qc: bool = True,
    progress: bool = True,
    on_result: Callable[[ConvertResult], None] | None = None,
) -> PreprocessSummary:
    """Convert every slide in ``inputs`` into ``out_dir``; see ``hyfi-preprocess --help``.

    Raises :class:`ConfigError` only for problems that stop the whole run
    (unwritable output, unreadable labels file, no slides); everything that
    concerns one slide is recorded in its result and the manifest.
    """
    _check_writable(out_dir)
    with _exclusive(out_dir):
        return _run_locked(
            inputs,
            out_dir,
            options,
            labels_path=labels_path,
            id_column=id_column,
            label_column=label_column,
            label_from_name=label_from_name,
            workers=workers,
            recursive=recursive,
            qc=qc,
            progress=progress,
            on_result=on_result,
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


def _run_locked(
    inputs: Sequence[Path],
    out_dir: Path,
    options: PreprocessOptions,
    *,
    labels_path: Path | None,
    id_column: str | None,
    label_column: str | None,
    label_from_name: str | None,
    workers: int,
    recursive: bool,
    qc: bool,
    progress: bool,
    on_result: Callable[[ConvertResult], None] | None,
) -> PreprocessSummary:
    for stale in remove_stale_temporaries(out_dir):
        log.info("removed an unfinished store from an interrupted run: %s", stale)
    labels = (
        read_labels(labels_path, id_column=id_column, label_column=label_column)
        if labels_path
        else {}
    )
    slides = discover_slides(inputs, recursive=recursive)
    if label_from_name:
        labels = {**labels_from_names(slides, label_from_name), **labels}
    if not slides:
        raise ConfigError(
            ", ".join(map(str, inputs)),
            "no slide files found",
            f"name slide files, or directories holding files ending in {', '.join(SLIDE_SUFFIXES)}",
        )
    qc_dir = out_dir / "qc" if qc else None
    results: dict[str, ConvertResult] = {}
    todo: list[tuple[str, Path]] = []
    for source in slides:
        sid = slide_id_of(source)
        if sid in results or any(sid == s for s, _ in todo):
            results[f"{sid}#{source}"] = _failed(
                sid,
                source,
                f"slide id {sid!r} is used by another input file",
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

    manifest = out_dir / "manifest.csv"

    def record(res: ConvertResult) -> None:
        results[res.slide_id] = res
        if res.status == "failed":
            log.error("FAILED %s", res.error)
        else:
            log.info("%s %s -> %s", res.status, res.source, res.store)
        write_manifest(_rows(results, labels, out_dir), manifest)
        if on_result is not None:
            on_result(res)

    bar = tqdm(total=len(todo), unit="slide", desc="preprocess", disable=not progress)
    try:
        if workers <= 1:
            for sid, source in todo:
                record(convert_slide(source, out_dir, sid, options, qc_dir=qc_dir))
                bar.update()
        else:
            # forkserver, not fork: zarr's event-loop thread must not be inherited; the
            # preload pays the imaging imports once instead of once per worker (0.46 s CPU each).
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(
                ["hyfi_imaging.preprocess.convert", "hyfi_imaging.preprocess.qc"]
            )
            with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
                futures: dict[Future[ConvertResult], tuple[str, Path]] = {
                    pool.submit(convert_slide, source, out_dir, sid, options, qc_dir=qc_dir): (
                        sid,
                        source,
                    )
                    for sid, source in todo
                }
                for fut in as_completed(futures):
                    sid, source = futures[fut]
                    try:
                        res = fut.result()
                    except Exception as err:  # a worker died (e.g. out of memory)
                        res = _failed(
                            sid,
                            source,
                            f"the worker process died ({type(err).__name__}: {err})",
                            "re-run with fewer --workers or a smaller --size",
                        )
                    record(res)
                    bar.update()
    finally:
        bar.close()
    ordered = sorted(results.values(), key=lambda r: (r.slide_id, r.source))
    summary = PreprocessSummary(ordered, write_manifest(_rows(results, labels, out_dir), manifest))
    if qc_dir is not None:
        summary.contact_sheet = write_contact_sheet(ordered, labels, out_dir / "contact_sheet.png")
    return summary


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
            )
        )
    return rows
