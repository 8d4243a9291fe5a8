"""``hyfi-demo``: the whole data path on built-in synthetic slides, then a spatial exactness check.

What it shows, in order: a synthetic cohort of pyramidal TIFF slides (positive
slides carry small lesions that vanish at 8x downsampling), ``hyfi-preprocess``
turning them into OME-Zarr with a manifest and QC pictures, how one image is
cut into a 2x2 tile grid with halos, and ``hyfi-verify`` proving on 4 MPI ranks
that the tiled model computes exactly what one process computes.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["main"]

EXAMPLES = """\
examples:
  hyfi-demo --out demo_out
  hyfi-demo --out /tmp/demo --slides 4 --slide-size 2048 --no-verify
"""


def _print_manifest(path: Path) -> None:
    from hyfi_imaging.preprocess import read_manifest

    rows = read_manifest(path)
    print(f"\nmanifest ({path}):")
    print(f"  {'slide_id':<12}{'label':>6}{'size':>12}{'mpp':>6}  status  store")
    for r in rows:
        size = f"{r.height}x{r.width}"
        mpp = "" if r.mpp is None else f"{r.mpp:g}"
        print(
            f"  {r.slide_id:<12}{r.label:>6}{size:>12}{mpp:>6}  {r.status:<6}  {r.path or r.error}"
        )


def _tile_grid_figure(manifest: Path, out: Path) -> Path:
    from hyfi_imaging.data.figures import plot_tile_grid
    from hyfi_imaging.data.tiles import tile_regions
    from hyfi_imaging.io import open_slide
    from hyfi_imaging.preprocess import read_manifest

    rows = [r for r in read_manifest(manifest) if r.status == "ok"]
    row = next((r for r in rows if r.label == "1"), rows[0])
    with open_slide(manifest.parent / row.path) as store:
        h, w = store.level_dimensions[0]
        image = store.read_region(0, 0, 0, h, w)
    # ResNet's stem + first basic block need a (13, 10) halo; tiles align to its stride 32.
    regions = tile_regions((h, w), (2, 2), halo=(13, 10), align=32)
    return plot_tile_grid(
        image,
        regions,
        out / "tile_grid.png",
        title=f"{row.slide_id}: 2x2 tiles (solid) and reads with a 13/10 px halo (dashed)",
    )


def _verify(out: Path) -> int:
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).with_name("mpiexec"))
    if not Path(mpiexec).exists():
        print("  (mpiexec not found: skipping the 4-rank check; install the 'mpich' extra)")
        return 0
    cmd = [
        mpiexec,
        "-n",
        "4",
        sys.executable,
        "-m",
        "hyfi_imaging.cli.verify",
        "--model",
        "resnet18",
        "--width",
        "0.25",
        "--image-size",
        "200x168",
        "--spatial",
        "2x2",
        "--steps",
        "2",
    ]
    print(
        "  $ mpiexec -n 4 hyfi-verify --model resnet18 --width 0.25 --image-size 200x168 --spatial 2x2"
    )
    env = {"OMP_NUM_THREADS": "1"}
    import os

    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, **env}, check=False
    )
    for line in proc.stdout.splitlines()[:4]:
        print("  " + line)
    (out / "verify.txt").write_text(proc.stdout + proc.stderr)
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    p = argparse.ArgumentParser(
        prog="hyfi-demo",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out", type=Path, default=Path("demo_out"), help="output directory (default: demo_out)"
    )
    p.add_argument(
        "--slides", type=int, default=8, help="synthetic slides to generate (default: 8)"
    )
    p.add_argument(
        "--slide-size", type=int, default=4096, help="slide side in pixels (default: 4096)"
    )
    p.add_argument("--size", type=int, default=2048, help="training canvas side (default: 2048)")
    p.add_argument("--workers", type=int, default=2, help="preprocess workers (default: 2)")
    p.add_argument("--no-verify", action="store_true", help="skip the 4-rank exactness check")
    args = p.parse_args(argv)

    from hyfi_imaging.data.synthetic import write_synthetic_cohort
    from hyfi_imaging.preprocess import PreprocessOptions, run_preprocess

    start = time.monotonic()
    out: Path = args.out
    print(f"[1/4] writing {args.slides} synthetic slides of {args.slide_size}^2 px (0.5 um/px)")
    labels = write_synthetic_cohort(
        out / "slides", args.slides, seed=0, size=(args.slide_size, args.slide_size), progress=True
    )
    print(f"[2/4] hyfi-preprocess -> {out / 'data'} (1.0 um/px on a {args.size}^2 canvas)")
    summary = run_preprocess(
        [out / "slides"],
        out / "data",
        PreprocessOptions(mpp=1.0, size=(args.size, args.size)),
        labels_path=labels,
        workers=args.workers,
    )
    print(f"  {summary.line()}")
    assert summary.manifest is not None
    _print_manifest(summary.manifest)
    print("[3/4] drawing the 2x2 tile grid with halos")
    grid = _tile_grid_figure(summary.manifest, out)
    status = 1 if summary.failed else 0
    if not args.no_verify:
        print("[4/4] spatial exactness: 4 ranks vs one process")
        status = status or _verify(out)
    print(f"\ndone in {time.monotonic() - start:.0f} s; look at:")
    print(f"  {summary.contact_sheet}   QC contact sheet (tissue outline, crop box, canvas)")
    print(f"  {grid}   one image cut into a 2x2 tile grid with halos")
    print(f"  {summary.manifest}   manifest for training")
    return status


if __name__ == "__main__":
    sys.exit(main())
