"""``hyfi-synth``: write a cohort of synthetic whole-slide images and their labels.

A thin wrapper over :func:`hyfi_imaging.data.synthetic.write_synthetic_cohort`;
see ``datasets/synthetic.yaml`` for what the slides contain and why.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from pathlib import Path

from hyfi_imaging.cli.options import count_int, positive_float, size_type
from hyfi_imaging.errors import HyfiError

__all__ = ["build_parser", "main"]

EXAMPLES = """\
examples:
  # 8 Aperio-style slides of 4096 x 4096 pixels at 0.5 microns per pixel
  hyfi-synth --out data/synth --n 8 --size 4096

  # a bigger, reproducible cohort of plain tiled TIFFs, 8192 x 6144 (h x w)
  hyfi-synth --out data/synth8k --n 32 --size 8192x6144 --seed 7 --kind generic-tiff

  # then convert them for training (positive slides' lesion outlines are in
  # synth_NNN.geojson beside them: --annotations stores lesion masks too)
  hyfi-preprocess data/synth --out data/synth_zarr --mpp 0.5 --size 4096 \\
      --labels data/synth/labels.csv --annotations data/synth

Writes synth_000.svs (or .tiff / .ome.tiff), ..., labels.csv (slide_id,label) and,
for every positive slide, its lesion outlines as synth_NNN.geojson into --out.
The same arguments always give byte-identical files. An earlier cohort's synth_NNN
files in --out that this run does not write are removed (and named on stderr).
Exit status: 0 written, 2 bad arguments or the output could not be written.
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``hyfi-synth`` argument parser."""
    from hyfi_imaging.data.synthetic import KINDS

    p = argparse.ArgumentParser(
        prog="hyfi-synth",
        description="Write synthetic pyramidal TIFF slides whose label (small textured lesions) "
        "is visible at full resolution and vanishes when the image is downsampled 8x.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, type=Path, help="output directory (created)")
    p.add_argument("--n", type=int, default=8, help="number of slides (default: 8)")
    p.add_argument(
        "--size", type=size_type(256), default=(4096, 4096), help="N or HxW pixels (default: 4096)"
    )
    p.add_argument("--seed", type=count_int, default=0, help="random seed, 0 or more (default: 0)")
    p.add_argument(
        "--kind", choices=sorted(KINDS), default="aperio", help="file layout (default: aperio)"
    )
    p.add_argument(
        "--mpp",
        type=positive_float,
        default=0.5,
        help="microns per pixel, 0.001 to 100 as the readers believe (default: 0.5)",
    )
    p.add_argument(
        "--positive-fraction",
        type=float,
        default=0.5,
        help="share of label-1 slides (default: 0.5)",
    )
    p.add_argument(
        "--compression", default="jpeg", choices=("jpeg", "zlib"), help="tile codec (default: jpeg)"
    )
    p.add_argument(
        "--lesions",
        type=int,
        default=None,
        help="lesions per positive slide (default: 3-6; the demo uses 12; 0 only with "
        "--positive-fraction 0)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``hyfi-synth``; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.n < 1:
        print(f"hyfi-synth: --n must be >= 1, got {args.n}", file=sys.stderr)
        return 2
    if not 0.0 <= args.positive_fraction <= 1.0:
        print(
            f"hyfi-synth: --positive-fraction must be in [0, 1], got {args.positive_fraction}",
            file=sys.stderr,
        )
        return 2
    if args.lesions is not None and args.lesions < 0:
        print(f"hyfi-synth: --lesions must be >= 0, got {args.lesions}", file=sys.stderr)
        return 2
    from hyfi_imaging.data.synthetic import write_synthetic_cohort

    said = logging.StreamHandler(sys.stderr)  # e.g. an earlier cohort's files removed
    said.setFormatter(logging.Formatter("hyfi-synth: %(message)s"))
    logging.getLogger("hyfi_imaging.data.synthetic").addHandler(said)
    start = time.perf_counter()
    created = not Path(args.out).exists()
    try:
        csv_path = write_synthetic_cohort(
            args.out,
            args.n,
            seed=args.seed,
            size=args.size,
            positive_fraction=args.positive_fraction,
            lesions=args.lesions,
            kind=args.kind,
            mpp=args.mpp,
            compression=args.compression,
            progress=True,
        )
    except (OSError, HyfiError) as err:
        if created:  # nothing half-written left behind: the folder was this run's
            shutil.rmtree(args.out, ignore_errors=True)
        print(f"hyfi-synth: {err}", file=sys.stderr)
        return 2
    except MemoryError as err:
        if created:  # nothing half-written left behind: the folder was this run's
            shutil.rmtree(args.out, ignore_errors=True)
        h, w = args.size
        print(
            f"hyfi-synth: error: a {h}x{w} slide needs more memory than this machine has "
            f"({err}); use a smaller --size",
            file=sys.stderr,
        )
        return 2
    h, w = args.size
    print(
        f"wrote {args.n} slides of {h}x{w} px ({args.kind}, {args.mpp} um/px) and {csv_path} "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
