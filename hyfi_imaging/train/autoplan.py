"""The planner inside hyfi-train: ``parallel=auto``, and a warning before a layout that will not fit.

Both run before any process group exists, on every rank, and must reach the
same answer everywhere: memory predictions come from a meta-device trace
(deterministic), and the ranking uses a nominal device rate instead of a
timing (a measured rate differs from rank to rank).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.train.config import ParallelConfig, Recipe

__all__ = [
    "batch_line",
    "choose_layout",
    "cohort_check",
    "fit_warning",
    "launch_world_size",
    "slide_size",
]

#: FLOP/s used to rank layouts when nothing is measured (the ranking barely depends on it).
NOMINAL_RATE = {"cpu": 5e10, "cuda": 2e14}


def launch_world_size() -> int:
    """Ranks of this job, from the launcher's environment (an ``srun`` step's task count
    under SLURM, see :mod:`hyfi_imaging.parallel.launcher_env`); ``WORLD_SIZE`` alone also
    counts; 1 for a plain process."""
    from hyfi_imaging.parallel.launcher_env import launch_env

    env = launch_env()
    if env.launcher == "single" and os.environ.get("WORLD_SIZE", "").isdigit():
        return int(os.environ["WORLD_SIZE"])
    return env.world_size


def slide_size(recipe: Recipe, where: str = "parallel: auto") -> tuple[int, int]:
    """The size of the recipe's slides (the manifest's first; labels are not read: a
    segmentation manifest's are its masks); ConfigError for volumes, which the planner's 2-D
    model does not plan."""
    from hyfi_imaging.data.dataset import load_samples
    from hyfi_imaging.train.tasks import manifest_kind

    if manifest_kind(recipe.data.manifest) == "volumes":
        raise ConfigError(
            where,
            "plans layouts for slides only",
            "write the parallel section for volumes (spatial 1x1, data N)",
        )
    return load_samples(recipe.data.manifest, labels=False)[0].image_hw


def _setting(recipe: Recipe) -> tuple[nn.Module, tuple[int, int], float, str]:
    import torch

    from hyfi_imaging.train.inputs import build_model, data_pixels

    r = recipe
    hw = slide_size(r)
    model = build_model(r, data_pixels(r).channels)
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    return model, hw, NOMINAL_RATE[kind], r.optim.name


def cohort_check(recipe: Recipe, batch: int | None = None) -> Callable[[Layout], None]:
    """The trainer's refusals of a layout for this recipe's task and cohort, as a check of a
    layout: ConfigError where the task does not run on it (segmentation on pipeline stages:
    :func:`~.tasks.check_task_layout`), or where a data replica would not get a full batch
    (``batch``, default the recipe's) of the images the trainer trains on (:mod:`.split`: the
    same split, the same rule)."""
    from hyfi_imaging.train.split import check_full_batch, training_count
    from hyfi_imaging.train.tasks import check_task_layout, load_cohort

    cohort = load_cohort(recipe, recipe.data.manifest)
    training = training_count(recipe, cohort)
    per_replica = batch or recipe.train.batch_size

    def check(layout: Layout) -> None:
        parallel = recipe.parallel.model_copy(update={"pipeline": layout.pp, "spatial": layout.sp})
        check_task_layout(
            recipe.model_copy(update={"parallel": parallel}), cohort, recipe.data.manifest
        )
        check_full_batch(training, layout.dp, per_replica)

    return check


def choose_layout(recipe: Recipe, devices: int) -> ParallelConfig:
    """The fastest layout of ``devices`` ranks whose predicted peak fits this machine's devices
    and that training accepts for this task and cohort (micro-batches that split the batch, a
    full batch for every data replica, one stage for segmentation: :func:`cohort_check`)."""
    from hyfi_imaging.parallel.candidates import candidates, device_memory, rank
    from hyfi_imaging.parallel.plan import predict

    model, hw, rate, optimizer = _setting(recipe)
    batch = recipe.train.batch_size
    check = cohort_check(recipe)
    preds, refused, unpredicted = [], None, []
    for cand in candidates(model, hw, devices, batch):
        try:
            check(cand.layout)
        except ConfigError as err:
            refused = err
            continue
        try:
            preds.append(predict(model, hw, batch, cand, optimizer=optimizer, flops_per_s=rate))
        except ConfigError as err:
            unpredicted.append(f"{cand.describe()}: {err}")
    from hyfi_imaging.parallel.launch import launch_rank

    if unpredicted and launch_rank() in (None, 0):  # said once, not dropped quietly
        logging.getLogger("hyfi_imaging.train").warning(
            "parallel=auto: %d layouts left out, which the planner cannot predict (e.g. %s)",
            len(unpredicted),
            unpredicted[0],
        )
    if not preds and refused is not None:
        raise ConfigError(
            "parallel=auto",
            f"every layout of {devices} rank(s) is refused for this cohort: {refused}",
            "launch fewer ranks, or use a smaller batch or more slides",
        )
    memory = device_memory(devices)
    ranked = rank(preds, memory)
    if not ranked or ranked[0].peak > memory:
        least = f"; the smallest needs {ranked[0].peak / 2**30:.2f} GiB" if ranked else ""
        raise ConfigError(
            "parallel=auto",
            f"no layout of {devices} rank(s) fits {memory / 2**30:.2f} GiB per device{least}",
            "launch more ranks, or use a smaller image or a narrower model",
        )
    best = ranked[0]
    c = best.candidate
    said = batch_line(c.layout.dp, c.microbatches, batch)
    if said and launch_rank() in (None, 0):
        logging.getLogger("hyfi_imaging.train").warning("parallel=auto: %s", said)
    return ParallelConfig(
        spatial=c.layout.sp,
        stage_grids=c.layout.grids,
        pipeline=c.layout.pp,
        data=c.layout.dp,
        microbatches=c.microbatches,
        schedule=c.schedule,
        balance=list(best.balance) if c.layout.pp > 1 else None,
        checkpointing=c.checkpointing,
        streaming=c.streaming,
        backward_bands=c.backward_bands,
    )


def batch_line(replicas: int, microbatches: int, batch: int) -> str | None:
    """What a chosen layout makes of ``train.batch_size`` (per replica): the images a step
    trains and the images BatchNorm sees at once; None when it is the recipe's own batch
    (one replica, one micro-batch). A recipe of batch 4 ran 8 images a step on 2 replicas,
    BatchNorm over 2, its schedule half the steps, and only the plan's line said so."""
    if replicas == 1 and microbatches == 1:
        return None
    return (
        f"{replicas} data replica(s) x train.batch_size {batch} = {replicas * batch} images a "
        f"step (an epoch has fewer steps; the learning-rate schedule counts them), BatchNorm "
        f"over micro-batches of {batch // microbatches} image(s); set parallel to a layout "
        "to keep the recipe's batch"
    )


def fit_warning(recipe: Recipe, memory: int | None = None) -> str | None:
    """One line when the planner predicts the recipe's layout will not fit a device, else None.

    ``memory`` is the bytes of one device (default: :func:`~.candidates.device_memory`).
    """
    from hyfi_imaging.parallel.candidates import device_memory
    from hyfi_imaging.parallel.plan import Candidate, predict
    from hyfi_imaging.train.preflight import plan_of
    from hyfi_imaging.train.tasks import manifest_kind

    if manifest_kind(recipe.data.manifest) == "volumes":
        return None  # the planner predicts 2-D slides only
    cand = Candidate.of(plan_of(recipe.parallel, recipe.parallel.layout()))
    model, hw, rate, optimizer = _setting(recipe)
    pred = predict(model, hw, recipe.train.batch_size, cand, optimizer=optimizer, flops_per_s=rate)
    memory = memory or device_memory(cand.world_size)
    if pred.peak <= memory:
        return None
    return (
        f"the plan predicts {pred.peak / 2**30:.2f} GiB per rank for {cand.describe()}, more than "
        f"the {memory / 2**30:.2f} GiB of a device; see hyfi-plan {recipe.name} for layouts "
        f"that fit, or --set parallel=auto"
    )
