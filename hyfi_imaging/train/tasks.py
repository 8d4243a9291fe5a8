"""What each ``hyfi-train`` task reads and learns: classification, segmentation, regression.

Why a module between the recipe and the loop: the loop (:mod:`.trainer`) is
the same for every task -- tiles in, a loss, an optimizer step -- but what a
sample *is* differs. A slide with a class label (classification); a slide
with a label image, each rank reading its tile of the mask with the same
region and augmentation as its image tile (segmentation, ``unet2d``); a
volume with regression targets or a label volume (``cosmoflow``, ``unet3d``),
each rank reading its sub-volume (:class:`~hyfi_imaging.data.volume_dataset.VolumeDataset`).
:class:`Cohort` is that difference, read from the manifest alone, so that
every mismatch between task, data and model is refused with one line in
``preflight``, before any rank starts.

Volumes run on 3-D grids of sub-volumes (``GZxGYxGX``) as slides run on 2-D grids of
tiles, with data replicas alike (:func:`check_task_layout` refuses the wrong kind of grid).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor

from hyfi_imaging.data.volume_manifest import manifest_kind
from hyfi_imaging.errors import ConfigError

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from hyfi_imaging.train.config import Recipe

__all__ = [
    "Cohort",
    "SegmentationSlides",
    "check_task",
    "check_task_layout",
    "has_label_images",
    "load_cohort",
    "manifest_kind",
    "num_outputs",
    "task_dataset",
    "task_loss",
]

Kind = Literal["slides", "volumes"]  # what manifest_kind answers (hyfi_imaging.data)


@dataclass(frozen=True)
class Cohort:
    """The usable images of a manifest as a task sees them (no pixel read).

    ``size``: ``(H, W)`` at the recipe's level, or ``(D, H, W)``; ``strata``:
    the class of each image for a stratified split (zeros unless
    classification); ``targets``: ``(N, T)`` regression targets or None;
    ``stores``: each image's store; ``labelled``: volumes: whether every one names its label
    image (slides: see :func:`has_label_images`).
    """

    kind: Kind
    ids: list[str]
    stores: list[str]
    size: tuple[int, ...]
    channels: int
    strata: list[int]
    targets: Tensor | None
    target_names: list[str]
    labelled: bool = True

    def __len__(self) -> int:
        return len(self.ids)


def _volume_dataset(recipe: Recipe, manifest: Path, *, augment: bool, **kwargs: Any) -> Any:
    """A VolumeDataset for the recipe (its constructor checks sizes, grid and quarter turns)."""
    from hyfi_imaging.data.volume_augment import VolumeAugment
    from hyfi_imaging.data.volume_dataset import VolumeDataset

    t, a = recipe.task, recipe.data.augment
    return VolumeDataset(
        manifest,
        level=recipe.data.level,
        target="regression" if t.name == "regression" else "labels",
        targets=t.targets,
        augment=VolumeAugment(flip=a.flip, rot90=a.rot90) if augment else None,
        seed=recipe.train.seed,
        normalize="dtype",  # data.normalize's default (check_task refuses the other modes)
        **kwargs,
    )


def load_cohort(recipe: Recipe, manifest: Path) -> Cohort:
    """The :class:`Cohort` of ``manifest`` for the recipe's task; ConfigError on any mismatch."""
    from hyfi_imaging.data.dataset import level_hw, load_samples

    t, d = recipe.task, recipe.data
    kind = manifest_kind(manifest)
    if kind == "volumes":
        if t.name == "classification":
            raise ConfigError(
                manifest,
                "is a volume manifest, and volumes have no class labels",
                "set task.name to regression (targets) or segmentation (label volumes)",
            )
        from hyfi_imaging.io.volume_store import VolumeStore

        # volumes without label images are predicted (check_task refuses them for training)
        ds = _volume_dataset(recipe, manifest, augment=True, truth=False)
        sizes = {ds.shape(i) for i in range(len(ds))}
        if len(sizes) != 1:
            raise ConfigError(
                manifest,
                f"volumes have different sizes {sorted(sizes)[:3]}",
                "train on volumes of one size",
            )
        channels: dict[int, str] = {}
        for s in ds.samples:  # the metadata of each store (the model takes one count)
            channels.setdefault(VolumeStore(s.path).channels, s.volume_id)
        if len(channels) != 1:
            said = ", ".join(f"{v} has {c}" for c, v in sorted(channels.items()))
            raise ConfigError(
                manifest,
                f"volumes have different channel counts ({said})",
                "train on volumes of one kind",
            )
        names = list(ds.target_names)
        targets = (
            # float64, as the manifest holds them (the CSVs' true_ columns, the errors); the
            # trainer's targets are float32, as the dataset's
            torch.tensor([s.targets for s in ds.samples], dtype=torch.float64)
            if t.name == "regression"
            else None
        )
        return Cohort(
            kind,
            [s.volume_id for s in ds.samples],
            [s.path for s in ds.samples],
            next(iter(sizes)),
            next(iter(channels)),
            [0] * len(ds.samples),
            targets,
            names,
            t.name != "segmentation" or all(s.labels for s in ds.samples),
        )
    if t.name == "regression":
        raise ConfigError(
            manifest,
            "is a slide manifest; regression reads target_<name> columns of a volume manifest",
            "use a volume manifest (write_grf_cohort), or task.name classification",
        )
    from hyfi_imaging.train.inputs import data_pixels

    classify = t.name == "classification"
    samples = load_samples(manifest, classes=d.classes if classify else None, labels=classify)
    sizes = {s.image_hw for s in samples}
    if len(sizes) != 1:
        raise ConfigError(
            manifest,
            f"images have different sizes {sorted(sizes)}",
            "preprocess all slides with the same --size",
        )
    pixels = data_pixels(
        recipe.model_copy(update={"data": d.model_copy(update={"manifest": manifest})})
    )
    return Cohort(
        kind,
        [s.slide_id for s in samples],
        [s.path for s in samples],
        level_hw(samples[0].image_hw, d.level),
        pixels.channels,
        [max(s.label, 0) if classify else 0 for s in samples],
        None,
        [],
    )


def has_label_images(recipe: Recipe, cohort: Cohort) -> bool:
    """Whether every image of ``cohort`` has its label image (volumes: a ``labels`` column)."""
    if cohort.kind == "volumes":
        return cohort.labelled
    from hyfi_imaging.io.labels import label_names

    return all(recipe.task.labels in label_names(s) for s in cohort.stores)


def _check_label_images(recipe: Recipe, cohort: Cohort, manifest: Path) -> None:
    """Every slide has the label image, with values that are classes (metadata only)."""
    from hyfi_imaging.io.labels import label_names

    t = recipe.task
    missing = [
        i for i, s in zip(cohort.ids, cohort.stores, strict=True) if t.labels not in label_names(s)
    ]
    if missing:
        shown = ", ".join(missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        raise ConfigError(
            manifest,
            f"{len(missing)} slide(s) have no label image {t.labels!r} ({shown})",
            "preprocess them with hyfi-preprocess --annotations DIR (or set task.labels)",
        )
    if not t.foreground:
        labels = [t.labels] * len(cohort)
        _check_label_values(recipe, zip(cohort.ids, cohort.stores, labels, strict=True))


def _check_label_values(recipe: Recipe, images: Iterable[tuple[str, str, str]]) -> None:
    """Each ``(id, store, label image)``'s values, as its NGFF metadata lists them (no pixel
    read), against ``data.classes``: a value no class names is refused before any rank."""
    from hyfi_imaging.io.labels import label_path
    from hyfi_imaging.io.zarr_store import _open_group_attrs

    k = len(recipe.data.classes)
    for sid, store, name in images:
        attrs = _open_group_attrs(label_path(store, name)) or {}
        props = attrs.get("ome", attrs).get("image-label", {}).get("properties", [])
        values = [int(p.get("label-value", 0)) for p in props if isinstance(p, dict)]
        if values and max(values) >= k:
            raise ConfigError(
                f"{store} labels/{name}",
                f"has label value {max(values)} but data.classes names {k} classes ({sid})",
                "list a class per label value in data.classes, or set task.foreground=true",
            )


def check_task(recipe: Recipe, cohort: Cohort, manifest: Path) -> None:
    """The task against its data and layout, before any rank starts (one line on a mismatch)."""
    t = recipe.task
    k = len(recipe.data.classes)
    if t.name in ("classification", "segmentation") and k < 2:
        raise ConfigError(
            "data.classes",
            f"{t.name} needs at least two classes (got {recipe.data.classes})",
            "list the class names in data.classes (segmentation: background first)",
        )
    allowed = {
        "classification": ("auto", "ce"),
        "segmentation": ("auto", "dice_ce", "ce"),
        "regression": ("auto", "mse", "mae"),
    }[t.name]
    if t.loss not in allowed:
        raise ConfigError(
            "task.loss", f"{t.loss!r} is not a {t.name} loss", f"use one of {', '.join(allowed)}"
        )
    check_task_layout(recipe, cohort, manifest)
    if cohort.kind == "volumes":
        _check_volume_inputs(recipe, manifest)
        if t.name == "segmentation":
            # a row without its label image: the dataset's line naming the row
            volumes = _volume_dataset(recipe, manifest, augment=False).samples
            if not t.foreground:
                _check_label_values(recipe, ((v.volume_id, v.path, v.labels) for v in volumes))
    if t.name == "segmentation" and cohort.kind == "slides":
        _check_label_images(recipe, cohort, manifest)


def _check_volume_inputs(recipe: Recipe, manifest: Path) -> None:
    """What the volume path does not apply is refused, not ignored (a percentile mode and a
    brightness jitter trained as if absent): integer voxels over their type's maximum,
    floats as stored, then ``data.mean``/``data.std``; flips and quarter turns."""
    d = recipe.data
    if d.normalize.mode != "dtype":
        raise ConfigError(
            "data.normalize.mode",
            f"is {d.normalize.mode}, but the volumes of {manifest} are normalised by their "
            "voxel type (integers over its maximum, floats as stored)",
            "use mode dtype, with data.mean and data.std per channel",
        )
    jitter = [k for k in ("brightness", "contrast", "saturation", "hue") if getattr(d.augment, k)]
    if jitter:
        raise ConfigError(
            f"data.augment.{jitter[0]}",
            f"colour jitter ({', '.join(jitter)}) is for slides; the volumes of {manifest} take "
            "flips and quarter turns",
            "set it to 0 for volumes",
        )


def check_task_layout(recipe: Recipe, cohort: Cohort, manifest: Path) -> None:
    """The layout against the task and its data (``hyfi-predict`` checks this part too:
    a segmentation prediction on pipeline stages failed on a rank without a line)."""
    t, p = recipe.task, recipe.parallel
    if t.name == "segmentation" and p.pipeline > 1:
        raise ConfigError(
            "parallel.pipeline",
            f"is {p.pipeline}, but segmentation reads each mask tile on the first stage only",
            "use one stage (the U-Nets are one stage; use spatial tiles and data replicas)",
        )
    grid = "x".join(map(str, p.spatial))
    if len(p.spatial) == 1:
        raise ConfigError(
            "parallel.spatial",
            f"is L{p.spatial[0]}, a 1-D grid of signal segments, but {manifest} holds "
            f"{cohort.kind} and the training data path reads images and volumes only",
            "use a 2-D grid GYxGX for slides or a 3-D grid GZxGYxGX for volumes (1-D grids "
            "tile models through spatialize() / verify_model)",
        )
    if cohort.kind == "volumes" and len(p.spatial) == 2 and p.spatial != (1, 1):
        raise ConfigError(
            "parallel.spatial",
            f"is {grid}, a grid of 2-D tiles, but {manifest} holds volumes",
            "cut volumes into sub-volumes with a 3-D grid GZxGYxGX (e.g. 2x1x2), or use 1x1",
        )
    if cohort.kind == "slides" and len(p.spatial) == 3:
        raise ConfigError(
            "parallel.spatial",
            f"is {grid}, a grid of sub-volumes, but {manifest} holds 2-D slides",
            "use a 2-D grid GYxGX (e.g. 2x2)",
        )


def num_outputs(recipe: Recipe, cohort: Cohort) -> int:
    """The model's ``num_classes``: the classes, or the regression targets."""
    return (
        len(cohort.target_names) if recipe.task.name == "regression" else len(recipe.data.classes)
    )


def task_loss(recipe: Recipe) -> Callable[[Tensor, Tensor], Tensor]:
    """The loss the engine calls per micro-batch (exact on tiles; see :mod:`.losses`)."""
    from hyfi_imaging.parallel.apply import cross_entropy
    from hyfi_imaging.train.losses import DiceCELoss, RegressionLoss

    t = recipe.task
    if t.name == "regression":
        return RegressionLoss("mae" if t.loss == "mae" else "mse")
    if t.name == "segmentation":
        ce_only = t.loss == "ce"
        return DiceCELoss(ce_weight=t.ce_weight, dice_weight=0.0 if ce_only else t.dice_weight)
    return cross_entropy


class _MaskTarget:
    """A dataset item's label tile as class indices (foreground merge, range check)."""

    def __init__(self, classes: int, foreground: bool, where: str) -> None:
        self.classes, self.foreground, self.where = classes, foreground, where

    def __call__(self, mask: np.ndarray | Tensor) -> Tensor:
        m = torch.as_tensor(np.asarray(mask)).long()
        if self.foreground:
            return (m > 0).long()
        top = int(m.max()) if m.numel() else 0
        low = int(m.min()) if m.numel() else 0
        if top >= self.classes or low < 0:
            from hyfi_imaging.errors import HyfiError

            raise HyfiError(
                self.where,
                f"a mask holds label {top if low >= 0 else low} but data.classes names "
                f"{self.classes} classes (labels 0-{self.classes - 1})",
                "list a class per label value, or set task.foreground=true",
            )
        return m


class SegmentationSlides(torch.utils.data.Dataset[dict[str, Any]]):
    """A :class:`~hyfi_imaging.data.dataset.TileDataset` whose items also hold the mask tile.

    The label image is read over the *same* box through the same augmentation
    (flips and quarter turns are exact on labels; colour jitter is not applied
    to them), with background 0 past the image border.
    """

    def __init__(self, tiles: Any, labels: str, target: _MaskTarget, *, truth: bool = True) -> None:
        self.tiles, self.labels, self.target, self.truth = tiles, labels, target, truth
        self._readers: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.tiles)

    def set_epoch(self, epoch: int) -> None:
        """Draw ``epoch``'s augmentation (as the image dataset does)."""
        self.tiles.set_epoch(epoch)

    def __getitem__(self, index: int) -> dict[str, Any]:
        from hyfi_imaging.data.augment import read_augmented
        from hyfi_imaging.io.labels import open_labels

        item = self.tiles[index]
        if not self.truth:  # predicting slides without masks: a background placeholder
            return {**item, "target": torch.zeros(item["image"].shape[1:], dtype=torch.int64)}
        path = self.tiles.samples[index].path
        reader = self._readers.get(path)
        if reader is None:
            reader = self._readers[path] = open_labels(path, self.labels)
        mask = read_augmented(
            reader,
            self.tiles.params(index),
            self.tiles.region(index).read,
            level=self.tiles.level,
            fill=0,
        )[0]
        return {**item, "target": self.target(mask)}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_readers"] = {}  # zarr handles never cross into a worker
        return state


def task_dataset(
    recipe: Recipe,
    cohort: Cohort,
    manifest: Path,
    *,
    augment: bool,
    grid: tuple[int, ...],
    rank: tuple[int, ...],
    align: int,
    slides: Callable[[bool, Path], Any],
    truth: bool = True,
) -> Dataset[dict[str, Any]]:
    """This rank's dataset of ``manifest``: items hold ``image`` and, unless classification, ``target``.

    ``slides(augment, manifest)`` builds the trainer's slide
    :class:`~hyfi_imaging.data.dataset.TileDataset` (one place for its options).
    ``truth=False``: images without label images (prediction only; targets are zeros).
    """
    t = recipe.task
    target = _MaskTarget(len(recipe.data.classes), t.foreground, str(manifest))
    if cohort.kind == "volumes":
        # Each rank reads its sub-volume of the (gz, gy, gx) grid (1x1: the whole volume).
        ds = _volume_dataset(
            recipe,
            manifest,
            augment=augment,
            grid=(1, *grid) if len(grid) == 2 else grid,
            rank=(0, *rank) if len(rank) == 2 else rank,
            align=align,
            truth=truth,
        )
        return _VolumeTargets(ds, target if t.name == "segmentation" else None)
    tiles = slides(augment, manifest)
    if t.name == "segmentation":
        return SegmentationSlides(tiles, t.labels, target, truth=truth)
    return tiles


class _VolumeTargets(torch.utils.data.Dataset[dict[str, Any]]):
    """A VolumeDataset whose label tiles become class indices (foreground, range check)."""

    def __init__(self, volumes: Any, target: _MaskTarget | None) -> None:
        self.volumes, self.target = volumes, target
        self.samples = volumes.samples

    def __len__(self) -> int:
        return len(self.volumes)

    def set_epoch(self, epoch: int) -> None:
        """Draw ``epoch``'s augmentation."""
        self.volumes.set_epoch(epoch)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = self.volumes[index]
        if self.target is not None:
            item["target"] = self.target(item["target"])
        return item
