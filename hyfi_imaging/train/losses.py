"""The losses and dense metrics of ``hyfi-train``'s tasks, exact on a tiled output.

Why one module: segmentation's Dice + cross-entropy and its Dice/IoU metrics
are ratios and means over the *whole* image, while on a spatial grid every rank
holds only its tile of the logits (plus a padded tail past the image border).
Each of them is built from the two exact reductions of
:mod:`hyfi_imaging.parallel.apply` -- :func:`~hyfi_imaging.parallel.apply.tiled_sum`
(per-sample, per-class sums over the valid pixels, all-reduced over the tiles)
and :func:`~hyfi_imaging.parallel.apply.tiled_mean` (the all-reduced sum over
the global pixel count) -- so one implementation serves one process, a 1x2
or a 2x2 grid, and the values and gradients agree with one process on the
whole image.

Dice is per image and per class (soft Dice with ``smooth`` in numerator and
denominator, averaged over images and classes, background included as in
MONAI's default), so a micro-batch's loss is a mean over its images: the
engine's ``1 / (dp x micro-batches)`` scaling then gives the global batch's
mean exactly, whatever the micro-batch split.

Regression (CosmoFlow's four cosmological parameters) is a pooled output, the
same on every tile: a plain MSE or MAE over the batch and targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.apply import OutputMap, TiledLoss, tiled_mean, tiled_sum
from hyfi_imaging.parallel.spatial import SpatialContext

__all__ = [
    "DiceCELoss",
    "RegressionLoss",
    "overlap_counts",
    "regression_errors",
    "scores_from_counts",
]


def _map_size(
    output: Tensor, ctx: SpatialContext | None, out_map: OutputMap | None
) -> tuple[int, ...] | None:
    """The output map's true size on a grid (None on one tile); refuses a pooled output."""
    if ctx is None:
        return None
    if out_map is None:
        raise ConfigError(
            "task segmentation",
            f"the model's output {tuple(output.shape)} is not a map of the image",
            "use a dense model (unet2d) whose output has the input's spatial size",
        )
    return out_map.size


def _check_target(output: Tensor, target: Tensor) -> None:
    if target.shape != output.shape[:1] + output.shape[2:]:
        raise ConfigError(
            "task segmentation",
            f"per-pixel targets {tuple(target.shape)} do not match the logits "
            f"{tuple(output.shape)}",
            "read each rank's mask tile with the same region as its image tile",
        )


@dataclass(frozen=True)
class DiceCELoss(TiledLoss):
    """``ce_weight`` x cross-entropy + ``dice_weight`` x (1 - mean soft Dice), exact on tiles.

    ``output``: logits ``(N, K, *spatial)``; ``target``: class indices
    ``(N, *spatial)``. Cross-entropy is the mean over every pixel of the
    micro-batch; Dice of image ``n`` and class ``k`` is
    ``(2 I + smooth) / (P + T + smooth)`` with ``I = sum p t``, ``P = sum p``,
    ``T = sum t`` over the image's pixels (``p`` the softmax, ``t`` one-hot).
    """

    ce_weight: float = 1.0
    dice_weight: float = 1.0
    smooth: float = 1.0

    def __call__(
        self,
        output: Tensor,
        target: Tensor,
        ctx: SpatialContext | None = None,
        out_map: OutputMap | None = None,
    ) -> Tensor:
        _check_target(output, target)
        size = _map_size(output, ctx, out_map)
        if output.dtype in (torch.float16, torch.bfloat16):
            output = output.float()  # sums over millions of pixels need float32 at least
        target = target.long()
        ce = tiled_mean(F.cross_entropy(output, target, reduction="none"), ctx, size)
        prob = torch.softmax(output, dim=1)
        onehot = F.one_hot(target, output.shape[1]).movedim(-1, 1).to(prob.dtype)
        inter = tiled_sum(prob * onehot, ctx, size, keep=2)
        total = tiled_sum(prob + onehot, ctx, size, keep=2)
        dice = (2 * inter + self.smooth) / (total + self.smooth)
        return self.ce_weight * ce + self.dice_weight * (1 - dice.mean())


@torch.no_grad()
def overlap_counts(
    output: Tensor,
    target: Tensor,
    ctx: SpatialContext | None = None,
    out_map: OutputMap | None = None,
) -> Tensor:
    """Per image and class, the whole image's ``(intersection, predicted, true)`` pixel counts.

    ``output`` logits ``(N, K, *spatial)`` (this rank's tile), ``target``
    ``(N, *spatial)``; the prediction is the arg-max class. Returns float64
    ``(N, K, 3)``, the same on every rank (the padded tail is not counted).
    """
    _check_target(output, target)
    size = _map_size(output, ctx, out_map)
    k = output.shape[1]
    pred = F.one_hot(output.argmax(1), k).movedim(-1, 1).double()
    true = F.one_hot(target.long(), k).movedim(-1, 1).double()
    stacked = torch.stack([pred * true, pred, true], dim=2)  # (N, K, 3, *spatial)
    return tiled_sum(stacked, ctx, size, keep=3)


def scores_from_counts(counts: Tensor) -> tuple[Tensor, Tensor]:
    """Per-image Dice and IoU ``(N,)`` from :func:`overlap_counts`, over the foreground classes.

    Class 0 is the background and is left out (with two classes: the lesion's
    Dice). The mean is over the classes present in the prediction or the
    truth, so a class absent from both neither lifts nor lowers an image's
    score; an image with no foreground in either scores 1 (nothing to find,
    nothing found), one with foreground in only one of them scores 0
    (:mod:`.seg_scores` states the rule in every per-image row).
    """
    fg = counts[:, 1:] if counts.shape[1] > 1 else counts
    inter, pred, true = fg.unbind(-1)
    union = pred + true - inter
    present = (pred + true) > 0
    dice = torch.where(present, 2 * inter / (pred + true).clamp_min(1), 0.0)
    iou = torch.where(present, inter / union.clamp_min(1), 0.0)
    n = present.sum(1)
    none = n == 0
    return (
        torch.where(none, 1.0, dice.sum(1) / n.clamp_min(1)),
        torch.where(none, 1.0, iou.sum(1) / n.clamp_min(1)),
    )


@dataclass(frozen=True)
class RegressionLoss:
    """Mean squared (``mse``) or absolute (``mae``) error over the batch and targets."""

    kind: Literal["mse", "mae"] = "mse"

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        if output.shape != target.shape:
            raise ConfigError(
                "task regression",
                f"the model gives {tuple(output.shape)} for targets {tuple(target.shape)}",
                "set the model's number of outputs to the number of targets",
            )
        target = target.to(output.dtype)
        if self.kind == "mae":
            return F.l1_loss(output, target)
        return F.mse_loss(output, target)


def regression_errors(pred: Tensor, target: Tensor, names: list[str]) -> dict[str, float]:
    """MSE and MAE over everything, and per target (``mae_<name>``), of ``(N, T)`` predictions."""
    diff = pred.double() - target.double()
    out = {"mse": float(diff.pow(2).mean()), "mae": float(diff.abs().mean())}
    for i, name in enumerate(names):
        out[f"mae_{name}"] = float(diff[:, i].abs().mean())
    return out
