"""``hyfi-predict``: apply a trained checkpoint to preprocessed slides or volumes, on any layout.

What it writes follows the run's task: class probabilities (classification, a
CSV), predicted masks (segmentation: ``OUT/masks/<id>.zarr`` OME-Zarr label
images, ``OUT/overlays/*.png`` and, where the stores hold label images,
``OUT/per_image.csv`` with Dice, IoU, lesions and false positives), or regressions (a CSV of
``pred_<target>`` beside the manifest's ``true_<target>``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hyfi_imaging.train.trainer import Trainer

__all__ = ["main"]

EXAMPLES = """\
examples:
  # one process: class probabilities for every slide of a manifest
  hyfi-predict runs/synthetic --manifest data/new/manifest.csv --out predictions.csv

  # a model trained on 2x2 tiles x 2 stages, applied on 4 tiles
  mpirun -np 4 hyfi-predict runs/camelyon16-8k/checkpoints/step_00012000 \\
      --manifest data/test/manifest.csv --out test.csv --spatial 2x2

  # segmentation: masks/<slide>.zarr label images, overlays, per_image.csv (Dice, IoU)
  mpirun -np 2 hyfi-predict runs/slide-segmentation-synthetic \\
      --manifest data/synth_seg/manifest.csv --out runs/seg-pred --spatial 1x2

  # classification with class activation maps: heatmaps/<slide>.zarr (on the slide) + .png
  mpirun -np 4 hyfi-predict runs/synthetic --manifest data/new/manifest.csv \\
      --out pred/predictions.csv --spatial 2x2 --heatmaps

  # regression of volumes (CosmoFlow): pred_<target> beside true_<target>
  hyfi-predict runs/cosmoflow-synthetic --manifest data/grf/manifest.csv --out grf.csv

RUN is a training output directory (its newest loadable checkpoint is used) or
one checkpoint directory. The recipe is read from RUN/recipe.yaml.
"""


def build_parser() -> argparse.ArgumentParser:
    from hyfi_imaging.cli.options import count_int, positive_int, shape_type

    p = argparse.ArgumentParser(
        prog="hyfi-predict",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", type=Path, metavar="RUN", help="training output directory or checkpoint")
    p.add_argument("--manifest", type=Path, required=True, help="manifest.csv from hyfi-preprocess")
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="classification: CSV to write: slide_id, label, status, pred, p_<class>... (one row "
        "per manifest row; a slide left out, e.g. status failed, has an empty prediction); "
        "segmentation: a folder for masks/, overlays/ and per_image.csv; regression: a CSV",
    )
    p.add_argument(
        "--overlays",
        type=count_int,
        default=8,
        help="segmentation: overlay pictures for this many images (default: %(default)s)",
    )
    p.add_argument(
        "--heatmaps",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="classification: a class activation map per slide, DIR/<slide>.zarr (OME-Zarr, "
        "one channel per class, placed on the source slide) and DIR/<slide>.png (over the "
        "thumbnail); DIR defaults to 'heatmaps' beside --out. Needs a head 'global pool -> "
        "Linear'",
    )
    p.add_argument("--spatial", type=shape_type("--spatial"), default=(1, 1), metavar="GYxGX",
                   help="tile grid: GYxGX for slides, GZxGYxGX for volumes (default 1x1)")  # fmt: skip
    p.add_argument("--pipeline", type=positive_int, default=1)
    p.add_argument("--batch", type=positive_int, default=1)
    return p


def _run_dir(path: Path) -> Path:
    from hyfi_imaging.train.checkpoint import MARKER

    return path.parent.parent if (path / MARKER).exists() else path


def _check_out(out: Path, task: str) -> None:
    """``--out`` is a folder for segmentation and a CSV file otherwise: the other kind of path,
    existing, is refused in one line (a CSV written onto a folder failed at the end of the run,
    naming its temporary file)."""
    from hyfi_imaging.errors import ConfigError

    if task == "segmentation" and out.exists() and not out.is_dir():
        raise ConfigError(
            f"--out {out}",
            "is a file; a segmentation run writes a folder (masks/, overlays/, per_image.csv)",
            "give a folder's path",
        )
    if task != "segmentation" and out.is_dir():
        raise ConfigError(
            f"--out {out}",
            f"is a folder; a {task} run writes one CSV file",
            f"give a file's path, e.g. {out / 'predictions.csv'}",
        )


def _check_not_inputs(
    out: Path, manifest: Path, heat_dir: Path | None, task: str, ids: Sequence[str]
) -> None:
    """Before any rank starts: the outputs replace nothing but earlier predictions. ``--out``
    given the manifest's own path overwrote it with predictions; ``--heatmaps`` given the data's
    folder replaced every slide's store by its heat map (exit 0, the cohort lost)."""
    from hyfi_imaging.errors import ConfigError
    from hyfi_imaging.train.outputs import HEATMAP_KIND, MASK_KIND, check_replaceable

    listed = manifest / "manifest.csv" if manifest.is_dir() else manifest
    if out.resolve() == listed.resolve():
        raise ConfigError(
            f"--out {out}", "is the manifest the images are read from; it would be replaced",
            "write the predictions to another file",
        )  # fmt: skip
    for image_id in ids:
        if heat_dir is not None:
            for suffix in (".zarr", ".png"):  # the store and its picture
                check_replaceable(heat_dir / f"{image_id}{suffix}", HEATMAP_KIND)
        if task == "segmentation":
            check_replaceable(out / "masks" / f"{image_id}.zarr", MASK_KIND)


def _predict_dense(
    trainer: Trainer, manifest: Path, out: Path, overlays: int, meta: dict[str, Any]
) -> None:
    """Segmentation masks or regressions of every usable image of ``manifest`` (see the module)."""
    from hyfi_imaging.train.outputs import write_regressions, write_scores
    from hyfi_imaging.train.seg_scores import segmentation_line
    from hyfi_imaging.train.tasks import has_label_images

    cohort = trainer.cohort
    every = list(range(len(cohort)))
    rank0 = trainer.pc.rank == 0
    if trainer.task == "segmentation":
        trainer.has_truth = has_label_images(trainer.recipe, cohort)
        m = trainer.predict_masks(manifest, every, out, overlays=overlays)
        if rank0:
            scores = out / "per_image.csv"
            if m["per_image"]:
                write_scores(scores, m["per_image"])
            elif scores.exists():  # an earlier prediction's scores, of masks just replaced
                scores.unlink()
                print(f"hyfi-predict: removed {scores}: an earlier prediction's scores (no "
                      "label images here to score the new masks against)")  # fmt: skip
            score = f"; {segmentation_line(m)}" if m["dice"] is not None else ""
            print(
                f"hyfi-predict: {len(cohort)} masks -> {out / 'masks'}{score} "
                f"(checkpoint step {meta['step']})"
            )
            _note_earlier(out / "masks", cohort.ids, "mask(s)")
        return
    pred = trainer.predict(manifest, every)
    if rank0:
        from hyfi_imaging.data.volume_manifest import read_volume_manifest

        truth = cohort.targets.numpy() if cohort.targets is not None else None
        rows = read_volume_manifest(manifest)
        left_out = [(k, r.volume_id, r.status) for k, r in enumerate(rows) if r.status != "ok"]
        write_regressions(out, cohort.ids, pred, cohort.target_names, truth, left_out=left_out)
        print(
            f"hyfi-predict: {len(cohort)} volumes predicted -> {out} "
            f"(checkpoint step {meta['step']})"
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hyfi-predict``."""
    from hyfi_imaging.parallel.memory import configure_allocator

    configure_allocator()  # first: PyTorch decides on huge pages at its first tensor
    from hyfi_imaging.data.dataset import left_out_line, manifest_rows
    from hyfi_imaging.errors import ConfigError, HyfiError
    from hyfi_imaging.parallel.launch import exit_now, fail_fast, launch_rank, shutdown
    from hyfi_imaging.train.config import load_recipe
    from hyfi_imaging.train.preflight import check_layout, run_facts
    from hyfi_imaging.train.tasks import check_task_layout, load_cohort, manifest_kind
    from hyfi_imaging.train.trainer import Trainer

    args = build_parser().parse_args(argv)
    # runs/../x is x: the mask and overlay writers refuse a path that climbs ('..') after
    # a folder name, the mark of an id like '../../x' (hyfi_imaging.paths.confined).
    args.out = Path(os.path.normpath(args.out))
    run_dir = _run_dir(args.run)
    try:
        volumes = manifest_kind(args.manifest) == "volumes"
        rows = [] if volumes else manifest_rows(args.manifest)[1]
        left_out = left_out_line(args.manifest)
        if not (run_dir / "recipe.yaml").exists():
            raise ConfigError(
                run_dir, "no recipe.yaml here", "give the train.out_dir of a hyfi-train run"
            )
        recipe = load_recipe(
            run_dir / "recipe.yaml",
            [
                f"data.manifest={args.manifest}",
                "data.val_manifest=null",
                f"parallel.spatial={'x'.join(map(str, args.spatial))}",
                "parallel.stage_grids=null",  # a run's per-stage grids (the junction): not here
                f"parallel.pipeline={args.pipeline}",
                # the run's cut was for its own stages (and schedule): the model is cut anew
                "parallel.balance=null",
                "parallel.branches=1",  # a compute split of the training's ranks, same weights
                "parallel.data=1",
                "parallel.microbatches=1",
                # Prediction is forward only: every schedule's forward is GPipe's.
                "parallel.schedule=gpipe",
                # A compiled run's weights predict on any layout: tiles and pipelines run
                # eagerly (compile refuses them), and so do heat maps (their hooks would
                # break the graph at every layer and recompile past dynamo's limit).
                *(
                    ["parallel.compile=none"]
                    if max(args.spatial) > 1 or args.pipeline > 1 or args.heatmaps is not None
                    else []
                ),
                "model.weights=null",  # the run's checkpoint replaces them: not read again
                # prediction draws no augmentation: its checks (quarter turns of voxels that
                # are not square) are the training's
                "data.augment.flip=false",
                "data.augment.rot90=false",
                f"train.batch_size={args.batch}",
                f"train.out_dir={run_dir}",
            ],
        )
        cohort = load_cohort(recipe, args.manifest)  # targets, label images, sizes: before ranks
        check_task_layout(recipe, cohort, args.manifest)
        run_facts(recipe)  # one kind of image at one µm/px (against the checkpoint: on load)
        check_layout(recipe, cohort)  # the layout's tiles on these images, before any rank
        _check_out(args.out, recipe.task.name)  # before the long part, not at its end
        heat_dir: Path | None = None
        if args.heatmaps is not None:
            from hyfi_imaging.train.heatmaps import heatmap_head

            head = heatmap_head(recipe, cohort)  # the head's shape, refused in one line
            heat_dir = Path(args.heatmaps) if args.heatmaps else args.out.parent / "heatmaps"
        _check_not_inputs(args.out, args.manifest, heat_dir, recipe.task.name, cohort.ids)
    except HyfiError as err:
        if launch_rank() in (None, 0):  # every rank found the same: say it once
            print(f"hyfi-predict: error: {err}", file=sys.stderr)
        return 2

    def run() -> int:
        trainer = Trainer(recipe)
        trainer.setup()
        if trainer.pc.rank == 0 and left_out:  # once, before the long part
            print(f"hyfi-predict: {left_out}", file=sys.stderr, flush=True)
        meta = trainer.load_weights(args.run)
        if recipe.task.name != "classification":
            _predict_dense(trainer, args.manifest, args.out, args.overlays, meta)
            shutdown()
            return 0
        samples = trainer.samples
        every = list(range(len(samples)))
        if heat_dir is not None:
            from hyfi_imaging.train.heatmaps import predict_heatmaps

            probs = predict_heatmaps(trainer, args.manifest, every, heat_dir, head)
        else:
            probs = trainer.predict(args.manifest, every, log=True)
        import numpy as np

        # in float64 from the log-probabilities: float32's round to 1.0 from a margin of 17
        probs = np.exp(probs)
        if trainer.pc.rank == 0:
            from hyfi_imaging.train.predictions import class_cells, class_columns, write_rows

            classes = recipe.data.classes
            table: list[list[str]] = []
            # The samples are the manifest's ok rows in order; every other row is written
            # too, with its status and no prediction, so the output accounts for every slide.
            predicted = iter(zip(samples, probs, strict=True))
            for row in rows:
                if row.status != "ok":
                    table.append([row.slide_id, row.label, row.status, *class_cells(None, classes)])
                    continue
                s, p = next(predicted)
                label = classes[s.label] if s.label >= 0 else ""
                table.append([s.slide_id, label, "ok", *class_cells(p, classes)])
            header = ["slide_id", "label", "status", *class_columns(classes)]
            write_rows(args.out, header, table)
            print(
                f"hyfi-predict: {len(samples)} of {len(rows)} slides predicted -> {args.out} "
                f"(checkpoint step {meta['step']})"
            )
            if heat_dir is not None:
                print(f"hyfi-predict: {len(samples)} heat maps -> {heat_dir}")
                _note_earlier(heat_dir, [r.slide_id for r in rows], "heat map(s)")
        shutdown()
        return 0

    exit_now(fail_fast(run, prog="hyfi-predict"))


def _note_earlier(folder: Path, ids: Sequence[str], what: str) -> None:
    """Say that ``folder`` also holds outputs of an earlier prediction, of images other than
    ``ids`` (left as they were: they are not this prediction's)."""
    ours = {f"{i}.zarr" for i in ids}
    earlier = sorted(p.name for p in folder.glob("*.zarr") if p.name not in ours)
    if earlier:
        print(f"hyfi-predict: note: {folder} also holds {len(earlier)} {what} of an earlier "
              f"prediction, of images not in this manifest (e.g. {earlier[0]}); left as they "
              "were")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
