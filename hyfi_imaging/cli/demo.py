"""``hyfi-demo``: the product's main job on built-in synthetic slides, on a laptop CPU.

1. a synthetic cohort of pyramidal TIFF slides (positive slides carry small
   lesions whose texture vanishes when the image is downsampled 8x);
2. ``hyfi-preprocess`` twice: full resolution (0.5 um/px) and 8x downsampled
   (4 um/px), same field of view; manifest, QC contact sheet, tile-grid figure;
3. ``hyfi-train`` on full-resolution images cut into a 2x2 tile grid on 4 MPI
   ranks (exact spatial parallelism), and the same recipe on the 8x smaller
   images; both evaluated on the same held-out slides;
4. a summary: both AUCs side by side (``resolution.png``), training curves,
   confusion matrices, and ``summary.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hyfi_imaging.cli.options import positive_int

__all__ = ["main"]

EXAMPLES = """\
examples:
  hyfi-demo --out demo_out                 # the full demo (2-3 minutes on 2 CPU cores)
  hyfi-demo --out /tmp/demo --quick        # a 1-minute smoke run (too short to learn anything)
"""


_LESIONS = 12  # per tumour slide


def _print_manifest(path: Path) -> None:
    from hyfi_imaging.preprocess import read_manifest

    rows = read_manifest(path)
    print(f"  {'slide_id':<12}{'label':>6}{'size':>12}{'mpp':>8}  status  store")
    for r in rows[:6]:
        size = f"{r.height}x{r.width}"
        mpp = "" if r.mpp is None else f"{r.mpp:.3g}"
        print(
            f"  {r.slide_id:<12}{r.label:>6}{size:>12}{mpp:>8}  {r.status:<6}  {r.path or r.error}"
        )
    if len(rows) > 6:
        print(f"  ... {len(rows) - 6} more in {path}")


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
    title = f"{row.slide_id}: 2x2 tiles (solid) and reads with a 13/10 px halo (dashed)"
    return plot_tile_grid(image, regions, out / "tile_grid.png", title=title)


def _resolution(manifest: Path) -> str:
    """The resolution the stores of ``manifest`` hold, as measured ("0.5 um/px", or a range
    where the canvas shrank slides to fit: a label never states one that was not used)."""
    from hyfi_imaging.preprocess import read_manifest

    mpps = [r.mpp for r in read_manifest(manifest) if r.status == "ok" and r.mpp is not None]
    if not mpps:
        return "unknown um/px"
    low, high = f"{min(mpps):.3g}", f"{max(mpps):.3g}"
    return f"{low} um/px" if low == high else f"{low}-{high} um/px"


def _launcher(ranks: int) -> list[str]:
    if ranks == 1:
        return [sys.executable, "-m"]
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).with_name("mpiexec"))
    return [mpiexec, "-n", str(ranks), sys.executable, "-m"]


def _overrides(name: str, manifest: Path, out: Path, grid: str, epochs: int) -> list[str]:
    """The ``--set`` values that turn the synthetic recipe into one of the demo's two runs."""
    return [
        f"name={name}",
        f"data.manifest={manifest}",
        f"train.out_dir={out / 'runs' / name}",
        f"parallel.spatial={grid}",
        f"train.epochs={epochs}",
        "train.batch_size=4",
        "optim.lr=0.001",
        "train.progress=true",
    ]


def _train(
    recipe: Path, name: str, manifest: Path, out: Path, grid: str, args: argparse.Namespace
) -> dict[str, object]:
    gy, gx = (int(v) for v in grid.split("x"))
    run = out / "runs" / name
    # A demo run again over its output starts afresh; the old run is moved to previous/.
    cmd = [*_launcher(gy * gx), "hyfi_imaging.cli.train", str(recipe), "--restart"]
    for o in _overrides(name, manifest, out, grid, args.epochs):
        cmd += ["--set", o]
    shown = (
        "mpiexec -n 4 " if gy * gx > 1 else ""
    ) + f"hyfi-train synthetic --set parallel.spatial={grid} ..."
    print(f"  $ {shown}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(
            f"hyfi-demo: training {name} failed (exit {proc.returncode}); see the messages above"
        )
    return dict(json.loads((run / "summary.json").read_text()))


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
    p.add_argument("--slides", type=positive_int, help="synthetic slides (default: 48)")
    p.add_argument(
        "--slide-size", type=positive_int, default=768, help="slide side in pixels (default: 768)"
    )
    p.add_argument("--size", type=positive_int, help="full-resolution canvas side (default: 768)")
    p.add_argument("--epochs", type=positive_int, help="training epochs (default: 6)")
    p.add_argument(
        "--workers", type=positive_int, default=2, help="preprocess workers (default: 2)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny smoke run: 8 slides of a 512^2 canvas, 1 epoch (where not given)",
    )
    p.add_argument("--no-train", action="store_true", help="stop after preprocessing and figures")
    args = p.parse_args(argv)
    chosen = (8, 512, 1) if args.quick else (48, 768, 6)  # slides, canvas, epochs
    for name, value in zip(("slides", "size", "epochs"), chosen, strict=True):
        if getattr(args, name) is None:  # a value given wins over --quick's
            setattr(args, name, value)

    from hyfi_imaging.data.synthetic import check_lesion_room, write_synthetic_cohort
    from hyfi_imaging.errors import HyfiError
    from hyfi_imaging.preprocess import PreprocessOptions, run_preprocess
    from hyfi_imaging.resources import recipe_path
    from hyfi_imaging.train.config import load_recipe

    start = time.monotonic()
    out: Path = args.out
    try:  # the recipe and its dataset card, checked before minutes of work
        recipe = recipe_path("synthetic")
        load_recipe(recipe, _overrides("full", out / "data_full", out, "2x2", args.epochs))
        check_lesion_room(
            _LESIONS, (args.slide_size, args.slide_size), options=("--slide-size", "")
        )
    except HyfiError as err:
        print(f"hyfi-demo: error: {err}", file=sys.stderr)
        return 2
    print(f"recipe: {recipe}")
    print(
        f"[1/4] {args.slides} synthetic slides of {args.slide_size}^2 px at 0.5 um/px -> {out / 'slides'}"
    )
    labels = write_synthetic_cohort(
        out / "slides",
        args.slides,
        seed=0,
        size=(args.slide_size, args.slide_size),
        lesions=_LESIONS,
        progress=True,
    )
    print("[2/4] hyfi-preprocess: full resolution (0.5 um/px) and 8x downsampled (4 um/px)")
    small = max(64, args.size // 8)
    runs = {}
    for key, mpp, size in (("full", 0.5, args.size), ("down8", 4.0, small)):
        summary = run_preprocess(
            [out / "slides"],
            out / f"data_{key}",
            PreprocessOptions(mpp=mpp, size=(size, size)),
            labels_path=labels,
            annotations=out / "slides",  # lesion masks from the slides' GeoJSON
            workers=args.workers,
        )
        print(f"  {key}: {summary.line()} ({size}x{size} px canvas)")
        if summary.annotation_line():
            print(f"    lesion masks in labels/annotations; {summary.annotation_line()}")
        if summary.failed:
            return 1
        assert summary.manifest is not None
        runs[key] = summary
    full = runs["full"]
    assert full.manifest is not None and runs["down8"].manifest is not None
    shown = {k: _resolution(r.manifest) for k, r in runs.items() if r.manifest is not None}
    if shown != {"full": "0.5 um/px", "down8": "4 um/px"}:  # a canvas that shrank the slides
        print(f"  stores at {shown['full']} and {shown['down8']} (the canvas shrank the slides)")
    _print_manifest(full.manifest)
    grid = _tile_grid_figure(full.manifest, out)
    print(f"[3/4] figures: {full.contact_sheet}, {grid}")
    if args.no_train:
        return 0
    print("[4/4] training: full resolution on a 2x2 tile grid (4 ranks), then 8x downsampled")
    results = {
        f"full resolution\n{shown['full']}, {args.size}^2, 2x2 tiles": _train(
            recipe, "full", full.manifest, out, "2x2", args
        ),
        f"8x downsampled\n{shown['down8']}, {small}^2": _train(
            recipe, "down8", runs["down8"].manifest, out, "1x1", args
        ),
    }
    from hyfi_imaging.train.plots import plot_resolution_comparison

    figure = plot_resolution_comparison(
        {k: {m: v for m, v in r.items() if m in ("auc", "accuracy")} for k, r in results.items()},  # type: ignore[misc]
        out / "resolution.png",
        title="Same slides, same model: does resolution matter?",
    )
    lines = [
        "# hyfi-imaging demo",
        "",
        "| setting | AUC | accuracy | steps | seconds |",
        "|---|---|---|---|---|",
    ]
    for k, r in results.items():
        auc, acc = (
            f"{r[m]:.3f}" if isinstance(r.get(m), float) else "n/a" for m in ("auc", "accuracy")
        )
        lines.append(
            f"| {k.replace(chr(10), ', ')} | {auc} | {acc} | {r.get('steps')} | {r.get('seconds')} |"
        )
    lines += [
        "",
        f"Figures: {figure.name}, tile_grid.png, data_full/contact_sheet.png, runs/*/training_curves.png",
    ]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines[2:]))
    print(f"\ndone in {time.monotonic() - start:.0f} s; see {out / 'summary.md'} and {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
