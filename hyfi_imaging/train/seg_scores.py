"""Segmentation scores that do not mislead: the empty-truth rule, lesions, means that say what they mean.

Why a module of its own: a cohort of mostly negative slides made the headline
Dice about the negative slides (a mean of 0.38 while lesion slides scored
0.72-0.84), and nothing said how an empty truth was scored. Here each number
is defined once, and each per-image row states the rule it was scored by.

* per-image ``dice`` / ``iou`` of the foreground classes, from the whole
  image's pixel counts (all-reduced over the tiles, so exact on any grid;
  :func:`hyfi_imaging.train.losses.scores_from_counts` holds the formula: the
  mean over the classes present in the prediction or the truth).
  **Rule for an empty ground truth**: an image with no foreground in the truth
  *and* none in the prediction scores Dice = IoU = 1 (nothing to find, nothing
  found); with a prediction it scores 0. Each row of the per-image CSV says
  which case applied (``note``), so a mean is never read without the rule.
* the mean over all images *and* over the images whose truth has lesions
  (``dice_with_lesions``): the first is about the empty slides as much as the
  lesion slides, the second says how well lesions are outlined.
* lesion level: a *lesion* is a connected component (full connectivity: 8
  neighbours in 2-D, 26 in 3-D) of one foreground class. A truth lesion is
  *hit* when the prediction of its class covers more than ``HIT_FRACTION`` of
  its pixels (0: any overlap); a predicted component touching no truth lesion
  of its class is a *false positive*. ``lesion_sensitivity`` pools the hits
  over all images (hits / lesions); ``fp_per_image`` is the mean false
  positives per image. Components are found on the whole stitched mask (one
  rank, :class:`SegmentationTally`), so a lesion across a tile border is one lesion.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyfi_imaging.errors import problem

__all__ = [
    "HIT_FRACTION",
    "SCORE_COLUMNS",
    "ImageScore",
    "LesionCounts",
    "SegmentationTally",
    "count_lesions",
    "segmentation_line",
    "summarise_segmentation",
]


#: A truth lesion is hit when the prediction of its class covers more than this fraction of
#: its pixels (0: any overlap, the usual lesion-detection rule). The one place for "hit".
HIT_FRACTION = 0.0

#: The columns of ``val_per_image.csv`` / ``per_image.csv``, in order (:meth:`ImageScore.row`).
SCORE_COLUMNS = (
    "id",
    "dice",
    "iou",
    "truth_pixels",
    "pred_pixels",
    "lesions",
    "lesions_hit",
    "sensitivity",
    "pred_lesions",
    "false_positives",
    "note",
)

_SEG = "segmentation scores"


@dataclass(frozen=True)
class LesionCounts:
    """Lesion-level counts of one image, summed over the foreground classes (module docstring)."""

    lesions: int = 0
    hit: int = 0
    predicted: int = 0
    false_positives: int = 0


def count_lesions(
    pred: np.ndarray, truth: np.ndarray, classes: int, *, hit_fraction: float = HIT_FRACTION
) -> LesionCounts:
    """Truth lesions, those hit, predicted components and false positives of one whole image.

    ``pred`` and ``truth`` are ``(H, W)`` or ``(D, H, W)`` class maps of the *whole* image
    (stitched, padding cut): a component is only whole there. Each foreground class
    ``1 .. classes - 1`` is labelled on its own with full connectivity.

    OK::

        >>> t = np.array([[1, 0, 0, 1]]); p = np.array([[1, 0, 0, 0]])
        >>> count_lesions(p, t, 2)
        LesionCounts(lesions=2, hit=1, predicted=1, false_positives=0)
    """
    from scipy import ndimage

    if pred.shape != truth.shape or pred.ndim not in (2, 3):
        raise ValueError(
            problem(
                _SEG,
                f"prediction {pred.shape} and truth {truth.shape} are not one 2-D or 3-D image",
                "pass the whole stitched class maps of one image",
            )
        )
    if not 0.0 <= hit_fraction < 1.0:
        raise ValueError(problem(_SEG, f"hit_fraction {hit_fraction}", "use a value in [0, 1)"))
    structure = ndimage.generate_binary_structure(pred.ndim, pred.ndim)
    lesions = hit = predicted = false_positives = 0
    for c in range(1, classes):
        t, p = truth == c, pred == c
        t_any, p_any = bool(t.any()), bool(p.any())
        if t_any:
            t_lab, n_t = ndimage.label(t, structure=structure)
            size = np.bincount(t_lab[t], minlength=n_t + 1)[1:]
            cover = np.bincount(t_lab[p], minlength=n_t + 1)[1:]
            lesions += int(n_t)
            hit += int(np.count_nonzero((cover > 0) & (cover > hit_fraction * size)))
        if p_any:
            p_lab, n_p = ndimage.label(p, structure=structure)
            touching = np.unique(p_lab[t]) if t_any else np.zeros(0, dtype=p_lab.dtype)
            predicted += int(n_p)
            false_positives += int(n_p) - int(np.count_nonzero(touching))
    return LesionCounts(lesions, hit, predicted, false_positives)


@dataclass(frozen=True)
class ImageScore:
    """One image's segmentation scores: a row of the per-image CSV."""

    id: str
    dice: float
    iou: float
    truth_pixels: int
    pred_pixels: int
    lesions: LesionCounts

    @property
    def has_lesions(self) -> bool:
        """Whether the ground truth holds any foreground."""
        return self.truth_pixels > 0

    @property
    def sensitivity(self) -> float | None:
        """Truth lesions hit / truth lesions; None for an empty truth (nothing to find)."""
        n = self.lesions.lesions
        return self.lesions.hit / n if n else None

    @property
    def note(self) -> str:
        """The empty-truth rule as it applied to this image ('' when the truth has lesions)."""
        if self.has_lesions:
            return ""
        if self.pred_pixels == 0:
            return "empty truth and prediction: Dice = IoU = 1 by rule"
        return f"empty truth, {self.lesions.false_positives} predicted lesion(s): Dice = IoU = 0"

    def row(self) -> dict[str, Any]:
        """The :data:`SCORE_COLUMNS` of this image (``sensitivity`` None when undefined)."""
        les = self.lesions
        return {
            "id": self.id,
            "dice": self.dice,
            "iou": self.iou,
            "truth_pixels": self.truth_pixels,
            "pred_pixels": self.pred_pixels,
            "lesions": les.lesions,
            "lesions_hit": les.hit,
            "sensitivity": self.sensitivity,
            "pred_lesions": les.predicted,
            "false_positives": les.false_positives,
            "note": self.note,
        }


class SegmentationTally:
    """Per-image scores of one evaluation pass, gathered batch by batch.

    Why two sources: Dice, IoU and pixel counts come from the all-reduced
    per-tile counts (exact and known on every rank); lesions need whole
    components, so they are counted on the one rank that holds the stitched
    masks (global rank 0) and :meth:`finish` broadcasts them to the world, so
    every rank returns the same scores. That rank also checks the stitched
    masks against the tile counts: a gather that lost or shifted pixels is
    refused, not scored.
    """

    def __init__(self, classes: int, *, hit_fraction: float = HIT_FRACTION) -> None:
        self.classes, self.hit_fraction = classes, hit_fraction
        self.ids: list[str] = []
        self._counts: list[np.ndarray] = []  # (K, 3) per image: intersection, predicted, true
        self._lesions: list[LesionCounts] = []
        self._error: str | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def add(
        self,
        ids: Sequence[str],
        counts: Any,
        pred: np.ndarray | None = None,
        truth: np.ndarray | None = None,
    ) -> list[float]:
        """Add a batch; return its images' Dice (for overlay titles).

        ``counts``: ``(n, K, 3)`` from :func:`~hyfi_imaging.train.losses.overlap_counts`
        for the ``n = len(ids)`` real images of the batch; ``pred`` / ``truth``: their
        whole ``(n, *size)`` class maps on the rank that holds them, else None.
        """
        import torch

        from hyfi_imaging.train.losses import scores_from_counts

        c = torch.as_tensor(counts, dtype=torch.float64)[: len(ids)]
        if c.shape[0] != len(ids):
            raise ValueError(
                problem(_SEG, f"{c.shape[0]} counts for {len(ids)} ids", "pass one each")
            )
        self.ids.extend(ids)
        self._counts.extend(c.numpy())
        if pred is not None and truth is not None:
            for k in range(len(ids)):
                fg = c[k, 1:].sum(0)
                held = (int(np.count_nonzero(pred[k])), int(np.count_nonzero(truth[k])))
                if self._error is None and held != (int(fg[1]), int(fg[2])):
                    self._error = (
                        f"image {ids[k]}: the stitched masks hold {held} (predicted, true) "
                        f"foreground pixels but the tiles counted {(int(fg[1]), int(fg[2]))}"
                    )
                self._lesions.append(
                    count_lesions(pred[k], truth[k], self.classes, hit_fraction=self.hit_fraction)
                )
        return [float(v) for v in scores_from_counts(c)[0]]

    def finish(self) -> list[ImageScore]:
        """Every image's :class:`ImageScore`, the same on every rank (collective when distributed)."""
        import torch

        from hyfi_imaging.train.losses import scores_from_counts

        box: list[Any] = [(self._lesions, self._error)]
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(box, src=0)  # the world: every rank's result
        lesions, error = box[0]
        if error is not None:
            raise RuntimeError(
                problem(_SEG, error, "report this: the tiles were stitched wrongly, no score given")
            )
        if len(lesions) != len(self.ids):
            raise RuntimeError(
                problem(
                    _SEG,
                    f"lesions counted for {len(lesions)} of {len(self.ids)} images",
                    "pass the whole masks of every batch to add() on global rank 0",
                )
            )
        if not self.ids:
            return []
        counts = torch.from_numpy(np.stack(self._counts))
        dice, iou = scores_from_counts(counts)
        fg = counts[:, 1:].sum(1)
        return [
            ImageScore(i, float(d), float(j), int(f[2]), int(f[1]), les)
            for i, d, j, f, les in zip(self.ids, dice, iou, fg, lesions, strict=True)
        ]


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


def summarise_segmentation(scores: Sequence[ImageScore]) -> dict[str, Any]:
    """The means of an evaluation pass (module docstring); None where a mean has no images.

    ``dice`` / ``iou`` over all images; ``dice_with_lesions`` / ``iou_with_lesions`` over
    the ``n_with_lesions`` images whose truth has foreground; ``lesion_sensitivity``
    pooled (hits / lesions); ``fp_per_image`` over all images; ``empty_clean``: the
    fraction of the ``n_empty`` empty-truth images with no predicted pixel.
    """
    lesion = [s for s in scores if s.has_lesions]
    empty = [s for s in scores if not s.has_lesions]
    found = sum(s.lesions.lesions for s in scores)
    return {
        "n": len(scores),
        "dice": _mean([s.dice for s in scores]),
        "iou": _mean([s.iou for s in scores]),
        "n_with_lesions": len(lesion),
        "dice_with_lesions": _mean([s.dice for s in lesion]),
        "iou_with_lesions": _mean([s.iou for s in lesion]),
        "lesion_sensitivity": sum(s.lesions.hit for s in scores) / found if found else None,
        "fp_per_image": _mean([float(s.lesions.false_positives) for s in scores]),
        "n_empty": len(empty),
        "empty_clean": _mean([float(s.pred_pixels == 0) for s in empty]),
    }


def segmentation_line(summary: Mapping[str, Any]) -> str:
    """One log line of :func:`summarise_segmentation`; an undefined mean shows as ``n/a``."""

    def fmt(key: str) -> str:
        value = summary.get(key)
        return "n/a" if value is None else f"{value:.4f}"

    return (
        f"dice {fmt('dice')}  iou {fmt('iou')}  "
        f"with lesions ({summary['n_with_lesions']}/{summary['n']}): dice "
        f"{fmt('dice_with_lesions')} iou {fmt('iou_with_lesions')}  "
        f"lesion sensitivity {fmt('lesion_sensitivity')}  fp/image {fmt('fp_per_image')}  "
        f"empty clean {fmt('empty_clean')}"
    )
