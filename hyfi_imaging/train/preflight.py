"""What ``hyfi-train`` checks before any process group or allocation (``hyfi-train --check``).

Every rank runs :func:`preflight` first, so a bad manifest, layout or run
directory ends the job with one line before anything is computed or written;
:func:`plan_of` turns a recipe's ``parallel`` section into the engine's plan
(used here on a meta-device model, and by the trainer for the real one).
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.train.config import ParallelConfig, Recipe
from hyfi_imaging.train.rundir import StartMode

if TYPE_CHECKING:
    from hyfi_imaging.parallel.engine import ParallelPlan
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.train.tasks import Cohort

__all__ = ["plan_of", "preflight"]


def preflight(recipe: Recipe, *, start: StartMode = "resume", stores: bool = False) -> None:
    """Every check that needs no process group: runs on every rank before any allocation.

    ``hyfi-train --check`` runs exactly this, with ``stores=True``: the
    manifests (usable slides or volumes, one image size, a label on every
    training slide, label images or regression targets for the task), the
    layout against the model and the image (grid, stages, balance,
    checkpointing, micro-batches; the model is built on the meta device), and
    the run directory (writable, free space, ``--no-resume`` into a used one).

    ``stores``: also check every store the manifests name (:func:`_check_stores`).
    A launch leaves it off: it stats every shard of the cohort, on every rank,
    and the readers check the shards of each region they read anyway.
    """
    from hyfi_imaging.data.dataset import load_samples
    from hyfi_imaging.train.inputs import check_data, data_pixels
    from hyfi_imaging.train.rundir import check_start
    from hyfi_imaging.train.tasks import check_task, load_cohort, manifest_kind, num_outputs

    classify = recipe.task.name == "classification"
    if classify and manifest_kind(recipe.data.manifest) == "slides":  # labels first, as always
        samples = load_samples(recipe.data.manifest, classes=recipe.data.classes)
        _check_labels(recipe.data.manifest, samples, len(recipe.data.classes))
    cohort = load_cohort(recipe, recipe.data.manifest)
    check_task(recipe, cohort, recipe.data.manifest)
    if stores:
        _check_stores(cohort, recipe.data.manifest)
    if cohort.kind == "slides":
        check_data(recipe, data_pixels(recipe))
    if recipe.data.val_manifest is not None:
        val = load_cohort(recipe, recipe.data.val_manifest)
        check_task(recipe, val, recipe.data.val_manifest)
        if stores:
            _check_stores(val, recipe.data.val_manifest)
        if classify:
            val_samples = load_samples(recipe.data.val_manifest, classes=recipe.data.classes)
            _check_labels(recipe.data.val_manifest, val_samples, len(recipe.data.classes))
        if (val.kind, val.channels) != (cohort.kind, cohort.channels) or (
            cohort.kind == "slides"
            and data_pixels(recipe).dtype
            != data_pixels(
                recipe.model_copy(
                    update={
                        "data": recipe.data.model_copy(
                            update={"manifest": recipe.data.val_manifest}
                        )
                    }
                )
            ).dtype
        ):
            raise ConfigError(
                recipe.data.val_manifest,
                f"holds {val.channels}-channel {val.kind}, the training data "
                f"{cohort.channels}-channel {cohort.kind} (or another pixel type)",
                "validate on images preprocessed like the training images",
            )
    p = recipe.parallel
    if recipe.train.batch_size % p.microbatches:
        raise ConfigError(
            "train.batch_size",
            f"{recipe.train.batch_size} is not divisible by parallel.microbatches {p.microbatches}",
            "make the batch a multiple of the micro-batch count",
        )
    _check_layout(recipe, cohort.size, cohort.channels, num_outputs(recipe, cohort))
    out = recipe.train.out_dir
    check_start(out, start)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"x" * 4096)
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            out,
            f"output directory is not writable ({err.strerror or err})",
            "choose another train.out_dir",
        ) from err
    free = shutil.disk_usage(out).free
    if free < 256 * 2**20:
        raise ConfigError(
            out,
            f"only {free / 2**20:.0f} MiB free on the output disk",
            "free space or choose another train.out_dir",
        )


def _check_stores(cohort: Cohort, manifest: Path) -> None:
    """ConfigError unless every store of ``cohort`` is whole: it exists, opens, lost no shard.

    Reads each store's metadata (JSON: the group, its level arrays, its label
    images) and stats every shard its chunk inventory lists
    (:func:`~hyfi_imaging.io.inventory.check_store`); no pixel is read, no
    checksum computed (that is ``hyfi-preprocess --verify``). Stores without
    an inventory (older ones) pass on their metadata alone.
    """
    from hyfi_imaging.io.inventory import check_store

    bad = []
    for image_id, store in zip(cohort.ids, cohort.stores, strict=True):
        check = check_store(store)
        if check.status == "bad":
            bad.append((image_id, check))
    if not bad:
        return
    image_id, first = bad[0]
    kind = "slide" if cohort.kind == "slides" else "volume"
    fix = (
        f"re-run hyfi-preprocess for {'that slide' if len(bad) == 1 else 'those slides'} "
        "(the same command converts damaged stores again; hyfi-preprocess --verify "
        f"{Path(first.store).parent} lists every damaged store)"
        if cohort.kind == "slides"
        else "rewrite those volumes' stores with the tool that wrote them"
    )
    raise ConfigError(
        manifest,
        f"{len(bad)} of {len(cohort)} stores cannot be used ({kind} {image_id}: "
        f"{first.store}: {first.what()})",
        fix,
    )


def _check_labels(manifest: Path, samples: Sequence[Any], classes: int) -> None:
    """ConfigError unless every usable slide has a label among the ``classes`` indices."""
    bad = [s.slide_id for s in samples if not 0 <= s.label < classes]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ConfigError(
            manifest,
            f"{len(bad)} slide(s) with status ok have no label in 0..{classes - 1} ({shown})",
            "give them labels (hyfi-preprocess --labels) or set their status to failed",
        )


def _check_layout(
    recipe: Recipe, image_hw: tuple[int, ...], channels: int, num_classes: int
) -> None:
    """The engine's checks that need no process group, on a meta-device model."""
    from hyfi_imaging.geometry.spans import padded_hw
    from hyfi_imaging.parallel.spatial import tile_alignment
    from hyfi_imaging.train.inputs import build_model

    r, p = recipe, recipe.parallel
    with torch.device("meta"):
        model = build_model(r, channels, num_classes)
    dims = 3 if any(isinstance(m, torch.nn.Conv3d) for m in model.modules()) else 2
    if dims != len(image_hw):
        raise ConfigError(
            f"model {r.model.name!r}",
            f"is {dims}-D but the images of {r.data.manifest} are {len(image_hw)}-D "
            f"({'x'.join(map(str, image_hw))})",
            "use a 3-D model (cosmoflow, unet3d) for volumes and a 2-D one for slides",
        )
    want = {
        "segmentation": (1, num_classes, *image_hw),  # per-pixel logits of the image's size
        "regression": (1, num_classes),
    }.get(r.task.name)
    if want is not None:
        from hyfi_imaging.parallel.apply import output_shape

        got = output_shape(model, (1, channels, *image_hw))
        if got != want:
            raise ConfigError(
                f"model {r.model.name!r}",
                f"gives {got} for one image, but {r.task.name} needs {want}",
                "use a dense model (unet2d, unet3d) for segmentation, one output per target "
                "for regression",
            )
    if len(image_hw) == len(p.spatial) and math.prod(p.spatial) > 1:
        padded_hw(image_hw, p.spatial, tile_alignment(model, len(image_hw)))
    plan = plan_of(p, p.layout())
    plan.validate(model, recipe.train.batch_size)


def plan_of(p: ParallelConfig, layout: Layout) -> ParallelPlan:
    """The :class:`ParallelPlan` a recipe's ``parallel`` section describes."""
    from hyfi_imaging.parallel.engine import ParallelPlan

    return ParallelPlan(
        layout=layout,
        microbatches=p.microbatches,
        schedule=p.schedule,
        balance=tuple(p.balance) if p.balance else None,
        checkpointing=p.checkpointing,
        overlap=p.overlap,
        halo_depth=p.halo_depth,
        streaming=p.streaming,
        backward_bands=p.backward_bands,
    )
