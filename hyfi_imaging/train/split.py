"""Which images train and which validate, and whether every data replica gets a full batch.

Why a module of its own: the trainer splits the cohort and refuses a layout whose data
replicas make no full batch, and the checks that run before any rank starts -- preflight,
``parallel: auto`` and ``hyfi-plan`` on a recipe -- must apply the very same rule to the very
same split. ``parallel: auto`` once chose 4 data replicas for 13 slides at batch 4, which the
trainer then refused (issue 22).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from hyfi_imaging.errors import ConfigError

if TYPE_CHECKING:
    from hyfi_imaging.train.config import Recipe
    from hyfi_imaging.train.tasks import Cohort

__all__ = [
    "check_full_batch",
    "training_count",
    "unvalidated_strata",
    "validation_count",
    "validation_split",
]


def validation_count(n: int, fraction: float) -> int:
    """How many of a stratum's ``n`` images validate: ``n x fraction`` rounded half up, at
    least one and at most ``n - 1`` when ``fraction > 0`` and ``n >= 2`` (none otherwise).

    Python's ``round`` (to even) gave 10 slides at 0.1 no validation slide, and 2 positives
    at 0.25 none (the run's AUC undefined, its accuracy that of the negatives alone),
    without a word."""
    if fraction <= 0 or n < 2:
        return 0
    return min(n - 1, max(1, math.floor(n * fraction + 0.5)))


def validation_split(
    strata: Sequence[int], seed: int, fraction: float
) -> tuple[list[int], list[int]]:
    """``(training, validation)`` indices: :func:`validation_count` of each stratum validates,
    drawn with the recipe's seed (the same on every rank and every launch)."""
    rng = np.random.default_rng([seed, 7919])
    labels = np.array(strata)
    val: list[int] = []
    for c in np.unique(labels):  # stratified (one stratum unless classification)
        idx = rng.permutation(np.flatnonzero(labels == c))
        val.extend(int(i) for i in idx[: validation_count(len(idx), fraction)])
    val_set = set(val)
    return [i for i in range(len(labels)) if i not in val_set], sorted(val)


def unvalidated_strata(strata: Sequence[int], fraction: float) -> list[int]:
    """The strata (classes) of which no image validates under ``fraction`` > 0: one image
    alone, which trains."""
    labels = np.array(strata)
    if fraction <= 0:
        return []
    return [
        int(c)
        for c in np.unique(labels)
        if validation_count(int((labels == c).sum()), fraction) == 0
    ]


def training_count(recipe: Recipe, cohort: Cohort) -> int:
    """Images the trainer trains on: the whole manifest when a validation manifest is given,
    else what :func:`validation_split` leaves."""
    if recipe.data.val_manifest is not None:
        return len(cohort)
    return len(validation_split(cohort.strata, recipe.train.seed, recipe.data.val_fraction)[0])


def check_full_batch(training: int, replicas: int, batch: int) -> None:
    """ConfigError unless ``training`` images over ``replicas`` data replicas give every replica
    at least one full batch of ``batch`` per epoch (the trainer drops the rest of an epoch).

    OK: ``check_full_batch(10, 2, 4)``. Error: ``check_full_batch(10, 4, 4)`` (2 images per
    replica, no batch of 4).
    """
    if training // replicas // batch == 0:
        fix = (
            f"use at most {training // batch} data replica(s), a smaller batch or more slides"
            if training >= batch
            else f"use a batch of at most {training}, or more slides"
        )
        raise ConfigError(
            "train.batch_size",
            f"{training} training slides over {replicas} data replicas "
            f"make no full batch of {batch}",
            fix,
        )
