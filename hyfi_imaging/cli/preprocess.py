"""``hyfi-preprocess``: whole-slide images -> training-ready OME-Zarr + manifest + QC."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hyfi_imaging.cli.options import (
    count_int,
    memory_size,
    nonnegative_float,
    positive_float,
    size_type,
)
from hyfi_imaging.errors import HyfiError

if TYPE_CHECKING:
    from hyfi_imaging.preprocess.qc import QcChannels

__all__ = ["build_parser", "main", "verify"]

EXAMPLES = """\
examples:
  # every slide in a folder, 2 microns per pixel, on an 8192 x 8192 canvas, 2 workers
  hyfi-preprocess slides/ --out data/cohort --mpp 2.0 --size 8192 --workers 2

  # with labels (PANDA train.csv, CAMELYON16 reference.csv or slide_id,label all work)
  hyfi-preprocess slides/ --out data/panda --mpp 1.0 --size 16384 --labels train.csv

  # a slide without resolution metadata: say what it is
  hyfi-preprocess scan.tif --out data/one --mpp 2.0 --mpp-override 0.25

  # take pyramid level 2 as it is, centre-crop tissue that does not fit
  hyfi-preprocess slides/ --out data/l2 --level 2 --size 4096 --fit crop

  # multiplex OME-TIFF / QPTIFF: tissue from DAPI, QC pictures of three markers
  hyfi-preprocess mif/ --out data/mif --mpp 0.5 --size 8192 --tissue DAPI \\
      --qc-channels DAPI:blue,CD8:green,PanCK:red

  # a 16-bit scientific image that is all content: no tissue detection, whole image
  hyfi-preprocess scan.tif --out data/sci --level 0 --size 4096 --tissue none

  # CAMELYON16 with its lesion annotations (tumor_001.tif <-> annotations/tumor_001.xml):
  # each store gets labels/annotations, aligned to the image; normal slides get
  # all-background masks
  hyfi-preprocess training/ --out data/c16 --mpp 1.0 --size 16384 \\
      --label-from-name '^(normal|tumor)_' --annotations training/annotations

  # QuPath GeoJSON exports with two classes, and one class that cuts holes
  hyfi-preprocess slides/ --out data/seg --mpp 2.0 --annotations geojson/ \\
      --annotation-classes Tumor=1,Stroma=2,Ignore=0

  # check a whole cohort's stores: every chunk listed as written exists and
  # matches its checksum (exit 2 and one line per damaged store)
  hyfi-preprocess --verify data/cohort

Images are kept as they are: uint8, uint16 or float32 pixels and every
channel (named from OME-XML or QPTIFF page names) go into the store; 8-bit RGB
bright-field slides come out exactly as before.

Annotations (--annotations DIR): ASAP XML (CAMELYON16) or GeoJSON (QuPath)
files named like the slide (<slide id>.xml, .geojson or .json). Class names map
to labels case-insensitively: tumor, tumour, metastasis, carcinoma, cancer and
CAMELYON16's _0, _1 -> 1; _2, exclusion, exclude, ignore -> 0, an exclusion
that clears what it covers (holes do the same inside their polygon). Add or
change classes with --annotation-classes; a class without a label fails that
slide, naming the class. The mask goes through the image's own crop, placement
and resampling (pixel-centre rule) into <slide>.zarr/labels/annotations (uint8,
NGFF labels, same pyramid levels; coarser levels by 2x2 mode).

Files in a folder are recognised by content (TIFF, SVS, NDPI, QPTIFF, DICOM
whole-slide images, MRXS, PNG, JPEG, ...), not by name; whatever is not
converted (subfolders without --recursive, other files) is listed with the
reason at the end, in full in preprocess.log. Inputs, labels and free disk
space (store size estimated as the uncompressed pyramid / 2) are checked
before --out is created. The canvas is written shard by shard, so memory does
not grow with --size. Every read is costed from the sizes the file declares
before anything is decoded: a slide whose strips, tiles or smallest read do
not fit --memory-budget (a decompression bomb, or a huge image without a
pyramid) fails with one line instead of exhausting memory. Workers stop when
the run is killed.

Re-running the same command resumes: finished slides (same source, same
options, every chunk still there) are skipped. Exit status: 0 all slides
converted, 1 some slides failed (see manifest.csv and preprocess.log), 2 the
run could not start.

Each store records the chunk (shard) files it was written with and their
CRC-32 (zarr.json, attributes.hyfi_inventory). Training and prediction refuse
a store whose needed chunk is gone, instead of reading it as blank background.
--verify DIR checks every store under DIR against that record, re-reading
every chunk: exit 0 all intact, 2 a store is damaged (or none was found).
Stores written before the record existed are counted apart: only their
metadata can be checked.
"""


def _qc_channels(text: str) -> QcChannels:
    from hyfi_imaging.preprocess.qc import QcChannels

    try:
        return QcChannels.parse(text)
    except HyfiError as err:  # argparse shows an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(f"{err.what}; {err.fix}") from None


def _class_mapping(text: str) -> dict[str, int]:
    from hyfi_imaging.io.annotations import parse_class_mapping

    try:
        return parse_class_mapping(text)
    except HyfiError as err:
        raise argparse.ArgumentTypeError(f"{err.what}; {err.fix}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hyfi-preprocess",
        description="Convert whole-slide images (SVS, NDPI, MRXS, SCN, DICOM, (OME-)TIFF, PNG/JPEG) into "
        "chunked, sharded OME-Zarr v3 images at a chosen resolution, with tissue masks, a "
        "manifest and QC pictures.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("inputs", nargs="*", type=Path, metavar="SLIDE_OR_DIR")
    p.add_argument("--out", type=Path, help="output directory (required to convert)")
    p.add_argument(
        "--verify",
        type=Path,
        metavar="DIR",
        help="instead of converting: check every store under DIR against its chunk "
        "inventory and checksums (exit 2 if one is damaged)",
    )
    res = p.add_mutually_exclusive_group()
    res.add_argument("--mpp", type=positive_float, help="target microns per pixel (resample)")
    res.add_argument("--level", type=count_int, help="use this pyramid level as it is (default: 0)")
    p.add_argument(
        "--size", type=size_type(1), default=(8192, 8192), help="canvas N or HxW (default: 8192)"
    )
    p.add_argument(
        "--fit",
        choices=("fit", "crop"),
        default="fit",
        help="tissue larger than the canvas: 'fit' downscales it to fit (the recorded mpp "
        "changes), 'crop' keeps the resolution and centre-crops (default: fit)",
    )
    p.add_argument(
        "--margin-um",
        type=nonnegative_float,
        default=100.0,
        help="margin around tissue in microns (default: 100)",
    )
    p.add_argument(
        "--mpp-override",
        type=positive_float,
        help="level-0 microns per pixel of the inputs, overriding metadata",
    )
    p.add_argument("--labels", type=Path, help="CSV/TSV of slide ids and labels")
    p.add_argument("--id-column", help="column of slide ids in --labels (default: detected)")
    p.add_argument("--label-column", help="column of labels in --labels (default: detected)")
    p.add_argument(
        "--label-from-name",
        metavar="REGEX",
        help="take labels from file names, e.g. '^(normal|tumor)_' for CAMELYON16 training slides",
    )
    p.add_argument(
        "--annotations",
        type=Path,
        metavar="DIR",
        help="folder of annotation files (ASAP XML, GeoJSON) named by slide id; each store "
        "gets a label image labels/annotations aligned to the image",
    )
    p.add_argument(
        "--annotation-classes",
        type=_class_mapping,
        metavar="NAME=LABEL,...",
        help="class name -> label (0-255; 0 excludes), added to the defaults, e.g. "
        "Tumor=1,Stroma=2,Ignore=0 (default: tumour-like names -> 1, see below)",
    )
    p.add_argument("--workers", type=int, default=1, help="parallel worker processes (default: 1)")
    p.add_argument(
        "--memory-budget",
        type=memory_size,
        metavar="SIZE",
        help="memory one read of a slide may take in each worker, e.g. 2GiB; a slide whose "
        "strips, tiles or smallest read need more is refused before decoding (default: a "
        "quarter of the available memory shared among --workers, at most 4 GiB each)",
    )
    p.add_argument(
        "--recursive",
        action="store_true",
        help="search subfolders too (without it they are listed as skipped)",
    )
    p.add_argument("--chunk", type=int, default=512, help="zarr chunk side (default: 512)")
    p.add_argument(
        "--shard",
        type=int,
        default=4096,
        help="zarr shard side, a multiple of --chunk (default: 4096)",
    )
    p.add_argument(
        "--tissue",
        default="auto",
        metavar="auto|none|CHANNEL",
        help="tissue detection: 'auto' (RGB: darker than glass; other images: signal "
        "against each channel's own background, on every channel), 'none' (the whole "
        "image is kept), or a channel index or name to detect on (default: auto); a crop "
        "that leaves over 1%% of the signal out is warned about",
    )
    p.add_argument("--no-qc", action="store_true", help="skip QC pictures")
    p.add_argument(
        "--qc-channels",
        type=_qc_channels,
        metavar="CH[:COLOUR],...",
        help="channels the QC pictures show and their colours, e.g. DAPI:blue,CD8:green,3:red "
        "(default: RGB as it is, else the first 3 channels in their colours, grey for 1)",
    )
    p.add_argument(
        "--quiet", action="store_true", help="no progress bar (the summary at the end only)"
    )
    return p


def _classes(
    folder: Path | None, overrides: dict[str, int] | None
) -> tuple[tuple[str, int], ...] | None:
    """The recorded class mapping: defaults plus ``overrides``; None without annotations."""
    if folder is None:
        return None
    from hyfi_imaging.io.annotations import class_mapping

    return tuple(class_mapping(overrides).items())


def verify(root: Path, *, progress: bool = True) -> int:
    """``hyfi-preprocess --verify DIR``: check every store under ``root``; returns the exit status.

    Prints one line per damaged store (store, first problem, what to do) and a
    summary; 2 when a store is damaged, ``root`` does not exist or holds no
    store, else 0. Every chunk is read again to compare its checksum: expect
    the time of reading the cohort's compressed bytes once.
    """
    from tqdm import tqdm

    from hyfi_imaging.errors import problem
    from hyfi_imaging.io.inventory import check_store, find_stores

    stores = find_stores(root) if root.is_dir() else []
    if not stores:
        what = "holds no OME-Zarr store" if root.is_dir() else "is not a directory"
        line = problem(root, what, "give the --out folder of a hyfi-preprocess run")
        print(f"hyfi-preprocess: error: {line}", file=sys.stderr)
        return 2
    counts = {"ok": 0, "bad": 0, "no-inventory": 0}
    chunks = 0
    with tqdm(stores, unit="store", desc="verify", disable=not progress) as bar:
        for store in bar:
            check = check_store(store, checksums=True)
            counts[check.status] += 1
            chunks += check.checked
            if check.status == "bad":
                bar.write(f"hyfi-preprocess: BAD {check.line()}")
    print(
        f"hyfi-preprocess: verified {len(stores)} stores under {root} ({chunks} chunks): "
        f"{counts['ok']} intact, {counts['bad']} damaged, "
        f"{counts['no-inventory']} without a chunk inventory"
    )
    if counts["no-inventory"]:
        print(
            "  stores without a chunk inventory were written by an older hyfi-preprocess: "
            "a lost chunk in them cannot be detected (convert them again into a new --out)"
        )
    return 2 if counts["bad"] else 0


class _RunLog(logging.FileHandler):
    """``preprocess.log``, appended to by every run: each run's records follow a line that
    names the run (its command), so that a rerun's lines are not read as the first run's.
    Opened at the first record (which comes once ``--out`` exists)."""

    def __init__(self, path: Path, command: str) -> None:
        super().__init__(path, delay=True)
        self._command: str | None = command
        #: Records from before ``--out`` exists (an annotation file that matches no slide,
        #: said while the slides are matched): kept until it does (opening the log there
        #: failed with FileNotFoundError, nothing converted).
        self._early: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not Path(self.baseFilename).parent.is_dir():
            self._early.append(record)
            return
        early, self._early = self._early, []
        if self._command is not None:
            command, self._command = self._command, None
            header = logging.LogRecord(
                record.name, logging.INFO, __file__, 0, f"run: {command}", None, None
            )
            header.created = (early or [record])[0].created  # the run's first line first
            super().emit(header)
        for r in (*early, record):
            super().emit(r)


def main(argv: list[str] | None = None) -> int:
    """Run ``hyfi-preprocess``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verify is not None:
        if args.inputs or args.out is not None:
            parser.error("--verify DIR checks stores: give no slides and no --out with it")
        return verify(args.verify, progress=not args.quiet)
    if not args.inputs or args.out is None:
        parser.error("give the slides (SLIDE_OR_DIR ...) and --out, or --verify DIR")
    if args.chunk < 1 or args.shard < 1:
        parser.error("--chunk and --shard must be >= 1")
    if args.shard % args.chunk:
        parser.error(f"--shard {args.shard} is not a multiple of --chunk {args.chunk}")
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.annotation_classes is not None and args.annotations is None:
        parser.error("--annotation-classes needs --annotations DIR")
    from hyfi_imaging.preprocess import PreprocessOptions, run_preprocess

    log = logging.getLogger("hyfi_imaging")
    log.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.ERROR)  # warnings are in the summary (said twice with --quiet)
    console.setFormatter(logging.Formatter("hyfi-preprocess: %(message)s"))
    log.addHandler(console)
    options = PreprocessOptions(
        mpp=args.mpp,
        level=args.level,
        size=args.size,
        fit=args.fit,
        margin_um=args.margin_um,
        mpp_override=args.mpp_override,
        chunk=args.chunk,
        shard=args.shard,
        tissue=args.tissue,
        annotation_classes=_classes(args.annotations, args.annotation_classes),
        memory_budget=args.memory_budget,
    )
    # delay=True: the log file is opened at the first record, which run_preprocess
    # emits only after it has checked everything and created --out.
    logfile = _RunLog(
        args.out / "preprocess.log",
        shlex.join(["hyfi-preprocess", *(sys.argv[1:] if argv is None else argv)]),
    )
    logfile.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(logfile)
    try:
        summary = run_preprocess(
            args.inputs,
            args.out,
            options,
            labels_path=args.labels,
            id_column=args.id_column,
            label_column=args.label_column,
            label_from_name=args.label_from_name,
            annotations=args.annotations,
            workers=args.workers,
            recursive=args.recursive,
            qc=not args.no_qc,
            qc_channels=args.qc_channels,
            progress=not args.quiet,
        )
    except HyfiError as err:
        print(f"hyfi-preprocess: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"hyfi-preprocess: interrupted: the slides finished are in {args.out}; run the same "
            "command again to convert the rest",
            file=sys.stderr,
        )
        return 130
    finally:
        for h in list(log.handlers):
            log.removeHandler(h)
            h.close()
    print(f"hyfi-preprocess: {summary.line()}")
    print(f"  manifest:      {summary.manifest}")
    if summary.annotation_line():
        print(f"  {summary.annotation_line()}")
    if summary.contact_sheet:
        print(f"  contact sheet: {summary.contact_sheet}")
    for line in summary.warning_lines():
        print(f"  WARNING {line}")
    for res in summary.failed:
        print(f"  FAILED {res.error}")
    if summary.skipped:
        from hyfi_imaging.preprocess.discover import Discovery

        print(
            f"  skipped {len(summary.skipped)} paths that are not slides "
            f"(all listed in {args.out / 'preprocess.log'}):"
        )
        for line in Discovery(skipped=summary.skipped).summary_lines():
            print(f"    {line}")
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
