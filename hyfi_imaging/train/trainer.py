"""The training loop of ``hyfi-train``: tiles in; a classifier, a segmenter or a regressor out.

What differs between the tasks (what a sample's target is, the loss, the
metrics, what is written at the end) lives in :mod:`.tasks`, :mod:`.losses`
and :mod:`.outputs`; the loop is the same.

Each rank loads only its own tile of each image (first pipeline stage) and
every rank knows the labels; :class:`~hyfi_imaging.parallel.engine.ParallelModel`
runs the micro-batched schedule over the layout. The loop is deterministic for
a seed and a layout: the sample order of an epoch is a permutation drawn from
``(seed, epoch)``, split over data replicas; augmentation is drawn per
``(seed, epoch, sample)``; the learning rate is a pure function of the step.
That is what makes resume exact: a checkpoint holds weights, BatchNorm
statistics, optimiser state and the position (epoch, batch), and nothing else
is needed to continue bit for bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import resource
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml

from hyfi_imaging.errors import ConfigError, HyfiError
from hyfi_imaging.train.config import Recipe
from hyfi_imaging.train.preempt import StopSignals, ignore_stop_signals, stop_signals_blocked
from hyfi_imaging.train.preflight import (
    FACT_KEYS,
    check_trained,
    plan_of,
    run_facts,
    unknown_mpp_note,
)
from hyfi_imaging.train.rundir import StartMode

__all__ = ["Trainer", "lr_at"]

log = logging.getLogger("hyfi_imaging.train")


def step_seed(seed: int, step: int) -> int:
    """The random generator's seed for training step ``step`` of a run seeded ``seed``.

    Seeded at every step, dropout and drop-path draw after a resume what the uninterrupted
    run drew (the generator's state is not in a checkpoint: a resumed run replayed the
    masks of its first steps), on every rank alike (the grid's tiles, a pipeline's stages
    and the replicas, as seeding once before the model was built made them)."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1, np.uint64)[0] >> 1)


def lr_at(step: int, recipe: Recipe, total_steps: int) -> float:
    """Learning rate after ``step`` optimiser steps: linear warm-up, then cosine (or constant)."""
    o = recipe.optim
    if o.warmup_steps and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    span = max(1, total_steps - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / span)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))


@dataclass
class _Position:
    step: int = 0
    epoch: int = 0
    batch: int = 0  # next batch index within the epoch


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Trainer:
    """Train a recipe on the current process group layout (see ``hyfi-train --help``)."""

    def __init__(self, recipe: Recipe, *, start: StartMode = "resume") -> None:
        self.recipe = recipe
        self.start = start
        self.run_id: str | None = None

    # -- setup -----------------------------------------------------------------------------
    def setup(self) -> None:
        """Start the process group, build the parallel model, optimiser and data split."""
        from hyfi_imaging.data.dataset import load_samples
        from hyfi_imaging.parallel.engine import ParallelModel
        from hyfi_imaging.parallel.launch import init_parallel, threads_per_rank
        from hyfi_imaging.train.inputs import build_model
        from hyfi_imaging.train.tasks import load_cohort, num_outputs, task_loss

        r = self.recipe
        p = r.parallel
        layout = p.layout()
        self.pc = init_parallel(layout, schedule=p.schedule, timeout_s=p.timeout_s)
        self.rank0 = self.pc.rank == 0
        torch.set_num_threads(threads_per_rank())  # this node's CPUs over this node's ranks
        self.cohort = load_cohort(r, r.data.manifest)
        self.facts = run_facts(r)  # channels and each slide's µm/px (None: volumes)
        self.task = r.task.name
        # Classification keeps the manifest's samples (labels, ids) as before.
        self.samples: Sequence[Any] = (
            load_samples(r.data.manifest, classes=r.data.classes)
            if self.task == "classification"
            else self.cohort.ids
        )
        self.val_cohort = self.cohort  # until _split reads a val_manifest
        #: Segmentation: label images exist to score against (hyfi-predict may lack them).
        self.has_truth = True
        self.image_hw: tuple[int, ...] = self.cohort.size
        torch.manual_seed(r.train.seed)
        # in_chans comes from the data, the outputs from the classes (or the targets)
        model = build_model(r, self.cohort.channels, num_outputs(r, self.cohort), pretrained=True)
        plan = plan_of(p, layout)
        if plan.balance is None and plan.stages > 1 and self.start == "resume":
            from hyfi_imaging.train.rundir import recorded_cut

            cut = recorded_cut(r.train.out_dir, layout.describe())
            if cut is not None:  # the run's own cut, not one timed again
                plan = dataclasses.replace(plan, balance=cut)
                if self.rank0:
                    log.warning(
                        "pipeline cut %s: measured at this run's first launch on %s",
                        ",".join(map(str, cut)),
                        layout.describe(),
                    )
        self.measured_cut = plan.balance is None and plan.stages > 1
        self.pm = ParallelModel(model, self.pc, plan, image_hw=self.image_hw, loss_fn=task_loss(r))
        # Tiles are aligned to the stride spatialize() used (measured for a model that
        # does not declare its total_stride), so that the data path reads the same tiles.
        self.align = self.pm.ctx.align if self.pm.ctx is not None else 1
        params = list(self.pm.parameters())
        o = r.optim
        if o.name == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(
                params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay
            )
        else:
            self.optimizer = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)
        self.out = r.train.out_dir
        self.ckpt_root = self.out / "checkpoints"
        self.autocast: AbstractContextManager[Any] = nullcontext()
        if r.train.precision == "bf16" or (
            r.train.precision == "auto" and self.pc.device.type == "cuda"
        ):
            self.autocast = torch.autocast(self.pc.device.type, dtype=torch.bfloat16)

    def _plan_epochs(self) -> None:
        r = self.recipe
        self.train_idx, self.val_idx = self._split()
        dp = r.parallel.data
        self.dp_rank = self.pc.coords[0]
        from hyfi_imaging.train.split import check_full_batch

        check_full_batch(len(self.train_idx), dp, r.train.batch_size)  # preflight's rule too
        self.steps_per_epoch = len(self.train_idx) // dp // r.train.batch_size
        # ``max_steps`` caps the run (the epochs end it too): the schedule spans the steps
        # that run, not a cap the epochs never reach (the lr stayed near its peak).
        planned = self.steps_per_epoch * r.train.epochs
        self.total_steps = min(r.train.max_steps, planned) if r.train.max_steps else planned

    def _split(self) -> tuple[list[int], list[int]]:
        from hyfi_imaging.train.tasks import load_cohort

        r = self.recipe
        n = len(self.cohort)
        if r.data.val_manifest is not None:
            from hyfi_imaging.data.dataset import load_samples

            self.val_cohort = load_cohort(r, r.data.val_manifest)
            self.val_samples: Sequence[Any] = (
                load_samples(r.data.val_manifest, classes=r.data.classes)
                if self.task == "classification"
                else self.val_cohort.ids
            )
            return list(range(n)), list(range(len(self.val_cohort)))
        self.val_cohort = self.cohort
        self.val_samples = self.samples
        from hyfi_imaging.train.split import unvalidated_strata, validation_split

        alone = unvalidated_strata(self.cohort.strata, r.data.val_fraction)
        if alone and self.rank0:  # said, not skipped: a class the metrics never see
            named = [r.data.classes[c] for c in alone] if self.task == "classification" else []
            log.warning(
                "data.val_fraction %s: %s one image, which trains; no image of %s validates "
                "(give a data.val_manifest, or more images)",
                r.data.val_fraction,
                f"class(es) {', '.join(named)} have" if named else "the manifest has",
                "them" if named else "it",
            )
        return validation_split(self.cohort.strata, r.train.seed, r.data.val_fraction)

    def _tile_dataset(self, augment: bool, manifest: Path) -> Any:
        """The slide :class:`~hyfi_imaging.data.dataset.TileDataset` of this rank's tiles."""
        from hyfi_imaging.data.augment import AugmentConfig
        from hyfi_imaging.data.dataset import TileDataset
        from hyfi_imaging.train.inputs import normalization

        a = self.recipe.data.augment
        classify = self.task == "classification"
        aug = (
            AugmentConfig(
                flip=a.flip,
                rot90=a.rot90,
                out_size=(self.image_hw[0], self.image_hw[1]),  # rot90 keeps a non-square shape
                brightness=a.brightness,
                contrast=a.contrast,
                saturation=a.saturation,
                hue=a.hue,
            )
            if augment
            else None
        )
        return TileDataset(
            manifest,
            grid=(self.pc.grid[0], self.pc.grid[1]),  # slides: a 2-D grid (check_task)
            rank=(self.pc.tile[0], self.pc.tile[1]),
            halo=0,
            align=self.align,
            augment=aug,
            seed=self.recipe.train.seed,
            level=self.recipe.data.level,
            classes=self.recipe.data.classes if classify else None,
            labels=classify,
            normalize=normalization(self.recipe),
        )

    def _dataset(self, augment: bool, manifest: Path) -> Any:
        """This rank's dataset for the task: tiles (and mask tiles) or sub-volumes."""
        from hyfi_imaging.train.tasks import task_dataset

        cohort = self.cohort if manifest == self.recipe.data.manifest else self.val_cohort
        return task_dataset(
            self.recipe,
            cohort,
            manifest,
            augment=augment,
            grid=self.recipe.parallel.spatial,
            rank=self.pc.tile,
            align=self.align,
            slides=self._tile_dataset,
            truth=self.has_truth,
        )

    def _normalise(self, item: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
        """Mean/std normalisation on the host (in the prefetch thread), pinned for CUDA.

        One value for every channel (default 0.5 / 0.25) or one per channel;
        a target rides along untouched.
        """
        x, target = item
        d = self.recipe.data
        shape = (1, -1, *[1] * (x.dim() - 2))
        mean = torch.tensor(d.mean or (0.5,), dtype=x.dtype).view(shape)
        std = torch.tensor(d.std or (0.25,), dtype=x.dtype).view(shape)
        x = (x - mean) / std
        return (x.pin_memory() if self.pc.device.type == "cuda" else x), target

    def _batches(
        self, dataset: Any, batches: Sequence[Sequence[int]]
    ) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Tiles (and their targets) of each batch for first-stage ranks; None elsewhere.

        A :class:`~hyfi_imaging.data.prefetch.Prefetcher` keeps the next two
        batches coming (read, augmented, normalised and pinned) while the current
        step computes; the copy to the GPU is non-blocking. ``self.feed`` exposes
        how long each step waited for its tiles. The target is the batch's
        per-pixel (per-voxel) label tiles where the dataset reads them
        (segmentation), else None (the labels are known on every rank).
        """
        from hyfi_imaging.data.prefetch import Prefetcher

        self.feed: Prefetcher[tuple[torch.Tensor, Any]] | None = None
        if not self.pm.is_first:
            for _ in batches:
                yield None, None
            return
        workers = self.recipe.data.workers
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=[list(b) for b in batches],
            num_workers=workers,
            multiprocessing_context="spawn" if workers else None,
            worker_init_fn=ignore_stop_signals if workers else None,
        )
        dense = self.task == "segmentation"

        def items() -> Iterator[Any]:  # in the prefetcher's thread: it starts the workers
            with stop_signals_blocked():
                epoch = iter(loader)
            yield from epoch

        feed = Prefetcher(
            ((item["image"], item["target"] if dense else None) for item in items()),
            depth=2,
            transform=self._normalise,
        )
        self.feed = feed
        try:
            for x, target in feed:
                yield x.to(self.pc.device, non_blocking=True), target

        finally:
            feed.close()

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        """This replica's batches of ``epoch``: step ``k`` trains the epoch order's ``k``-th
        block of ``batch_size x data`` images, and replica ``d`` its ``d``-th part, the rows
        one process's micro-batches and running statistics take in that order
        (:mod:`~hyfi_imaging.parallel.running_stats`). Replicas took every ``data``-th image
        before: the same images a step, other BatchNorm batches than one process's."""
        r = self.recipe
        order = np.random.default_rng([r.train.seed, epoch]).permutation(self.train_idx)
        b = r.train.batch_size
        step = b * r.parallel.data
        first = self.dp_rank * b
        return [
            list(map(int, order[k * step + first : k * step + first + b]))
            for k in range(self.steps_per_epoch)
        ]

    # -- checkpoints -------------------------------------------------------------------------
    def _state(self, for_load: bool) -> dict[str, Any]:
        from hyfi_imaging.train.checkpoint import optimizer_state

        return {
            "model": self.pm.state_dict(),
            "optim": optimizer_state(self.pm.named_parameters(), self.optimizer, for_load=for_load),
        }

    def _save(self, pos: _Position) -> None:
        from hyfi_imaging.train.checkpoint import save_checkpoint
        from hyfi_imaging.train.guard import NonFiniteError, finite_everywhere

        r = self.recipe
        meta = {
            "epoch": pos.epoch,
            "batch": pos.batch,
            "recipe": r.name,
            "model": r.model.name,
            "layout": self.pc.layout.describe(),
            "global_batch": self._global_batch(),  # what "batch" counts in (see _restore)
            "classes": r.data.classes,
            "meaning": self._meaning(),
            "split": self._split_record(),
            "total_steps": self.total_steps,  # the learning-rate schedule's length
            "optim": r.optim.model_dump(),  # its settings: a resume under others is said
        }
        state = self._state(False)
        if not finite_everywhere(state, self.pc.device):
            raise NonFiniteError(
                f"step {pos.step}",
                "the model or optimiser state holds NaN or inf; not checkpointed",
                f"lower optim.lr or set optim.grad_clip; {self._kept_line()}",
            )
        save_checkpoint(
            self.ckpt_root,
            pos.step,
            state,
            meta,
            keep=r.train.keep_checkpoints,
            run_id=self.run_id,
        )

    def _meaning(self) -> dict[str, Any]:
        """What a checkpoint's numbers mean: a run resumed or read with another meaning is refused.

        The class order, the task, the model and its options, the input channels
        (count, names and pixel type), the cohort's µm/px, the normalisation, the pyramid level
        and the optimiser whose state is saved (as JSON reads them back).
        """
        r = self.recipe
        facts = self.facts
        meaning = {
            "task.name": r.task.name,
            "data.task": r.data.task,
            "data.classes": r.data.classes,
            "task.targets": self.cohort.target_names if r.task.name == "regression" else None,
            "task.labels": r.task.labels if r.task.name == "segmentation" else None,
            "task.foreground": r.task.foreground,
            "model.name": r.model.name,
            "model.kwargs": r.model.kwargs,
            "input channels": self.cohort.channels,
            "channel names": None if facts is None else list(facts.channel_names),
            "pixel type": None if facts is None else facts.dtype,
            "mpp": None if facts is None else facts.mpp_range,  # [low, high], with a tolerance
            "voxel sizes": self._voxel_sizes(),
            "data.level": r.data.level,
            "data.normalize": r.data.normalize.model_dump(),
            "data.mean": r.data.mean,
            "data.std": r.data.std,
            "optim.name": r.optim.name,  # its state is part of the checkpoint
        }
        loaded: dict[str, Any] = json.loads(json.dumps(meaning, default=str))
        return loaded

    def _split_record(self) -> dict[str, Any]:
        """Which images the run validates on and which it trains on, in which epoch order (the
        seed): a resume with another ``train.seed``, ``data.val_fraction`` or manifest trained
        on the images its earlier epochs had validated on, without a word. The training images
        as a digest of their ids (a cohort may hold thousands); the validation ids themselves,
        to name what changed."""
        train_ids = "\n".join(str(self.cohort.ids[i]) for i in self.train_idx)
        return {
            "train.seed": self.recipe.train.seed,
            "validation": sorted(str(self.val_cohort.ids[i]) for i in self.val_idx),
            "training": hashlib.sha256(train_ids.encode()).hexdigest(),
        }

    def _same_split(self, path: Path, was: Any, fix: str) -> None:
        """Refuse a resume whose split or epoch order is not the checkpoint's (see
        :meth:`_split_record`)."""
        now = self._split_record()
        if not isinstance(was, dict) or was == now:
            return  # written before splits were recorded, or the same
        r = self.recipe
        keep = (
            f"keep train.seed {was.get('train.seed')}, data.val_fraction and the manifests as "
            f"the run had them, or {fix}"
        )
        if was.get("validation") != now["validation"]:
            old, new = set(was.get("validation") or ()), set(now["validation"])
            moved = sorted(old ^ new)
            raise ConfigError(
                path,
                f"this checkpoint's run validated on {len(old)} image(s), this one would on "
                f"{len(new)}, {len(moved)} moved between training and validation (e.g. "
                f"{', '.join(moved[:3])}; now train.seed {r.train.seed}, data.val_fraction "
                f"{r.data.val_fraction}): validation would score images the model trained on",
                keep,
            )
        raise ConfigError(
            path,
            "this checkpoint's run trained on other images or in another order (its "
            f"train.seed {was.get('train.seed')}, now {r.train.seed}; or the manifest changed)",
            keep,
        )

    def _voxel_sizes(self) -> list[list[float]] | None:
        """The volumes' voxel sizes (µm, ``(z, y, x)``, 3 significant digits), each once; None
        for slides. A model of 2 x 0.5 x 0.5 µm voxels predicted 0.5 µm ones without a word."""
        if self.cohort.kind != "volumes":
            return None
        from hyfi_imaging.data.volume_manifest import read_volume_manifest

        rows = [
            row for row in read_volume_manifest(self.recipe.data.manifest) if row.status == "ok"
        ]
        sizes = {tuple(float(f"{v:.3g}") for v in row.voxel_size) for row in rows}
        return [list(v) for v in sorted(sizes)]

    def _kept_line(self) -> str:
        """What a run that stops on NaN leaves to resume from (it said "no checkpoint stays the
        newest checkpoint" where none existed)."""
        newest = self._newest()
        if newest is None:
            return "no checkpoint was written yet: relaunch to start again"
        return f"{newest} stays the newest checkpoint: relaunch to resume from it"

    def _global_batch(self) -> int:
        """Images a step trains: the per-replica batch times the data replicas."""
        return self.recipe.train.batch_size * self.recipe.parallel.data

    def _same_position(self, fix: str) -> Callable[[Path, dict[str, Any]], None]:
        """:meth:`_same_meaning`, and the same images a step: a checkpoint's position (the
        epoch's batch) counts in its global batch, and another one would skip or repeat the
        epoch's images and move the learning-rate schedule (any layout of that batch resumes:
        the same images make each step)."""
        same_meaning, now = self._same_meaning(fix), self._global_batch()
        r = self.recipe

        def check(path: Path, marker: dict[str, Any]) -> None:
            same_meaning(path, marker)
            self._same_split(path, marker.get("split"), fix)
            was = marker.get("global_batch")
            if isinstance(was, int) and was != now:
                dp = r.parallel.data
                keep = (
                    f" (train.batch_size={was // dp} with parallel.data={dp})"
                    if was % dp == 0
                    else ""
                )
                raise ConfigError(
                    path,
                    f"this checkpoint's run trains {was} images a step (train.batch_size x "
                    f"parallel.data), this one {now} ({r.train.batch_size} x {dp}): resuming "
                    "would skip or repeat images of the epoch and move the learning-rate schedule",
                    f"keep train.batch_size x parallel.data at {was}{keep}, or {fix}",
                )

        return check

    def _same_meaning(self, fix: str) -> Callable[[Path, dict[str, Any]], None]:
        """The check :func:`load_latest` runs on each candidate's marker before reading it."""
        now = self._meaning()

        def check(path: Path, marker: dict[str, Any]) -> None:
            was = marker.get("meaning")
            if not isinstance(was, dict):  # written before meanings were recorded
                return
            check_trained(self.facts, was, path, fix)  # naming the slides that differ
            changed = [k for k in now if k in was and k not in FACT_KEYS and was[k] != now[k]]
            if changed:
                said = "; ".join(f"{k} {was[k]} -> now {now[k]}" for k in changed)
                raise ConfigError(path, f"this checkpoint was trained with another {said}", fix)

        return check

    def _stopped(self, pos: _Position, received: Any) -> dict[str, Any]:
        """The summary of a run a signal stopped at ``pos`` (its checkpoint is written)."""
        names: list[Any] = [received.name if received is not None else None]
        if dist.is_initialized():  # which rank got which signal (said by rank 0)
            names = [None] * dist.get_world_size()
            dist.all_gather_object(names, received.name if received is not None else None)
        got = [(r, n) for r, n in enumerate(names) if n is not None]
        name = got[0][1] if got else "a signal"
        if len(got) < len(names):  # not every rank was signalled
            name += f" (to rank {', '.join(str(r) for r, _ in got)})"
        if self.rank0:
            print(
                f"hyfi-train: stopped by {name} after step {pos.step}: checkpoint "
                f"{self._newest()} written; relaunch the same command to resume from it",
                file=sys.stderr,
                flush=True,
            )
        if dist.is_initialized():
            dist.barrier()
        return {"stopped_by": name, "steps": pos.step, "run_id": self.run_id}

    def _newest(self) -> str | None:
        """The run's newest checkpoint's path (for messages), or None."""
        from hyfi_imaging.train.checkpoint import list_checkpoints

        found = list_checkpoints(self.ckpt_root, self.run_id)
        return str(found[0]) if found else None

    def _start_run(self) -> None:
        """Rank 0 makes the run directory this run's (``rundir``); every rank learns the id."""
        from hyfi_imaging.locks import hold_lock
        from hyfi_imaging.train.rundir import record_cut, start_run

        ids: list[Any] = [None]
        if self.rank0:
            try:
                # Held until this process ends: a second run into the directory is refused.
                self._lock = hold_lock(
                    self.out,
                    "hyfi-train",
                    "wait for it to finish, or set train.out_dir to another directory",
                )
                ids = [start_run(self.out, self.start)]
                if self.measured_cut:
                    record_cut(self.out, self.pc.layout.describe(), self.pm.balance)
            except ConfigError as err:
                ids = [(err.where, err.what, err.fix)]
        if dist.is_initialized():
            dist.broadcast_object_list(ids, src=0)  # the world: every rank of the job
        if isinstance(ids[0], tuple):  # refused on rank 0: said once, by every rank alike
            raise ConfigError(*ids[0])
        self.run_id = str(ids[0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._check_shared_out()

    def _check_shared_out(self) -> None:
        """Refuse a ``train.out_dir`` that is not one directory on every node (a node-local
        scratch path): each node wrote its checkpoint shards where the others cannot read
        them, the run said done, and no checkpoint could be loaded (a relaunch then timed out
        waiting for the ranks that found none)."""
        from hyfi_imaging.train.rundir import RUN_FILE, read_run_id

        sees = False
        deadline = time.monotonic() + 30.0  # a network file system may show a new file late
        while not sees:
            try:
                sees = read_run_id(self.out) == self.run_id
            except (OSError, ValueError, HyfiError):
                sees = False
            if sees or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        # float64 on the device: every tensor given to a collective lives on its group's type
        blind = torch.tensor([0.0 if sees else 1.0], dtype=torch.float64, device=self.pc.device)
        first = torch.tensor(
            [float(self.pc.rank if not sees else dist.get_world_size())],
            dtype=torch.float64,
            device=self.pc.device,
        )
        dist.all_reduce(blind)
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        if blind.item() > 0:
            raise ConfigError(
                f"train.out_dir {self.out}",
                f"is not one directory on every node: {int(blind.item())} rank(s), rank "
                f"{int(first.item())} the first, do not see rank 0's {RUN_FILE} there "
                "(checkpoint shards written on each node apart cannot be loaded)",
                "put train.out_dir on a file system every node shares",
            )

    def _restore(self) -> _Position:
        """Resume this run from its newest loadable checkpoint; step 0 if it has none yet.

        Newer checkpoints of the run that failed to load are renamed
        ``step_N.unloadable`` (kept for inspection, never tried or counted again).
        """
        from hyfi_imaging.train.checkpoint import install_optimizer_state, load_latest

        if self.start != "resume":
            return _Position()
        state = self._state(True)
        found = load_latest(
            self.ckpt_root,
            state,
            run_id=self.run_id,
            optional="optim",  # a frozen parameter has no optimizer state to load
            expect=self._same_position(
                "put the recipe back as the run had it, or relaunch with --restart for a new run "
                "(the old one is kept in previous/)"
            ),
        )
        if found is None:
            return _Position()
        install_optimizer_state(self.pm.named_parameters(), self.optimizer, state["optim"])
        if self.rank0:
            for path, why in found.skipped:
                path.rename(path.with_name(path.name + ".unloadable"))
                log.warning(
                    "%s could not be loaded (%s); kept as %s.unloadable", path, why, path.name
                )
            log.warning(
                "resuming run %s from %s (step %d)", self.run_id, found.path, found.meta["step"]
            )
            self._say_schedule(found.meta)
            self._say_optim(found.meta)
        if dist.is_initialized():
            dist.barrier()
        meta = found.meta
        return _Position(int(meta["step"]), int(meta["epoch"]), int(meta["batch"]))

    def _say_schedule(self, meta: dict[str, Any]) -> None:
        """One line when a resume plans the learning-rate schedule over another number of
        steps (train.epochs or train.max_steps changed): its rate moves at once."""
        was, step = meta.get("total_steps"), int(meta["step"])
        if not isinstance(was, int) or was == self.total_steps:
            return
        r = self.recipe
        log.warning(
            "the learning-rate schedule now runs %d steps (the run planned %d: train.epochs or "
            "train.max_steps changed): its rate at step %d is %.4g instead of %.4g",
            self.total_steps,
            was,
            step,
            lr_at(step, r, self.total_steps),
            lr_at(step, r, was),
        )

    def _say_optim(self, meta: dict[str, Any]) -> None:
        """One line when a resume runs under other optimiser settings than the run's (its
        momentum buffers, learning rate or decay change at once; a new optim.momentum
        resumed without a word)."""
        was = meta.get("optim")
        if not isinstance(was, dict):
            return  # written before the settings were recorded
        now = self.recipe.optim.model_dump()
        changed = [f"optim.{k} {was[k]} -> {now[k]}" for k in now if k in was and was[k] != now[k]]
        if changed:
            log.warning(
                "the optimiser's settings differ from the run's (%s): it goes on with the new "
                "ones from step %d",
                ", ".join(changed),
                int(meta["step"]),
            )

    def load_weights(self, checkpoint: Path) -> dict[str, Any]:
        """Load only the model (any layout's checkpoint) from a checkpoint or a checkpoint directory."""
        from hyfi_imaging.train.checkpoint import load_latest

        if (checkpoint / "checkpoints").is_dir():
            checkpoint = checkpoint / "checkpoints"
        found = load_latest(
            checkpoint,
            {"model": self.pm.state_dict()},
            expect=self._same_meaning("predict with the run's own recipe and data of its kind"),
        )
        if found is None:
            raise ConfigError(
                checkpoint,
                "no checkpoint here",
                "give a run's checkpoints/step_N directory",
            )
        if self.rank0:  # an older checkpoint than the newest: said, never silently
            for path, why in found.skipped:
                log.warning(
                    "%s could not be loaded (%s); using %s (step %s)",
                    path,
                    why,
                    found.path.name,
                    found.meta.get("step"),
                )
            note = unknown_mpp_note(self.facts, found.meta.get("meaning"))
            if note is not None:
                log.warning("%s", note)
        return found.meta

    # -- evaluation --------------------------------------------------------------------------
    def _outputs(
        self, manifest: Path, indices: Sequence[int]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, list[int]]]:
        """Eval-mode outputs batch by batch: (this rank's output, its target tile or None, rows).

        The last batch is padded with repeats of the last index (the schedule needs
        whole batches); ``rows`` are the real indices of the batch, without them.
        """
        dataset = self._dataset(False, manifest)
        bs = self.recipe.train.batch_size
        idx = list(indices)
        padded = idx + [idx[-1]] * (-len(idx) % bs)
        batches = [padded[i : i + bs] for i in range(0, len(padded), bs)]
        with torch.no_grad(), self.autocast:
            for b, (tiles, target) in enumerate(self._batches(dataset, batches)):
                rows = idx[b * bs : (b + 1) * bs]
                yield self.pm.predict(tiles).float(), target, rows

    def predict(
        self,
        manifest: Path,
        indices: Sequence[int],
        *,
        on_batch: Callable[[torch.Tensor, list[int]], None] | None = None,
        log: bool = False,
    ) -> np.ndarray:
        """Class probabilities ``(len(indices), K)`` (regression: the outputs), on every rank;
        with ``log``, their logarithms in float64 (a confident model's probabilities round to
        1.0 in float32, and its ranking and loss with them).

        ``on_batch(logits, rows)`` is called on every rank after each batch's
        forward (the heat maps' hook: :mod:`.heatmaps`); ``logits`` has the
        batch's padded rows, ``rows`` the real indices.
        """
        if not indices:
            dtype = np.float64 if log else np.float32
            return np.zeros((0, len(self.recipe.data.classes)), dtype=dtype)
        parts: list[torch.Tensor] = []
        for out, _, rows in self._outputs(manifest, indices):
            if on_batch is not None:
                on_batch(out, rows)
            if self.task == "regression":
                value = out
            elif log:
                value = torch.log_softmax(out.double(), dim=1)
            else:
                value = torch.softmax(out, dim=1)
            parts.append(value[: len(rows)].cpu())
        return torch.cat(parts).numpy()

    def _mask_scale(self, store: str) -> float | tuple[float, ...] | None:
        """µm per pixel of a mask of ``store`` at the recipe's level (``(z, y, x)`` per voxel
        for volumes), as the store records it; None when it records none."""
        from hyfi_imaging.io.volume_store import VolumeStore
        from hyfi_imaging.io.zarr_store import ZarrReader

        level = self.recipe.data.level
        if self.cohort.kind == "volumes":
            return tuple(v * 2**level for v in VolumeStore(store).voxel_size)
        with ZarrReader(store) as reader:
            if reader.mpp is None or reader.mpp_source == "none":
                return None
            return reader.mpp * reader.level_downsamples[level][1]

    def predict_masks(
        self, manifest: Path, indices: Sequence[int], out_dir: Path | None, *, overlays: int = 0
    ) -> dict[str, Any]:
        """Segment ``indices`` of ``manifest``: per-image scores and loss; masks written to ``out_dir``.

        Every rank returns the same metrics (:class:`~.seg_scores.SegmentationTally`: Dice
        and IoU from all-reduced counts over the tiles, lesions counted on the stitched
        masks on rank 0 and broadcast). With ``out_dir``, rank 0 writes
        ``masks/<id>.zarr`` for every image and ``overlays/<id>.png`` (the truth's
        outline over the prediction) for the first ``overlays`` (:mod:`.outputs`).
        """
        from hyfi_imaging.train.losses import overlap_counts
        from hyfi_imaging.train.outputs import gather_masks, write_mask, write_overlay
        from hyfi_imaging.train.seg_scores import SegmentationTally, summarise_segmentation

        r = self.recipe
        cohort = self.cohort if manifest == r.data.manifest else self.val_cohort
        loss_fn = self.pm.loss_fn
        tally = SegmentationTally(len(r.data.classes))
        losses: list[float] = []
        written = 0
        for out, target, rows in self._outputs(manifest, indices):
            if target is None:  # segmentation is one stage: every rank holds both
                raise ConfigError("predict_masks", "no label tiles were read", "use pipeline=1")
            target = target.to(out.device)
            # each rank sees its own tile: every rank learns whether any tile is not finite
            # (before a mask of it is written), one small all-reduce per batch
            bad = (~torch.isfinite(out)).any().float().reshape(1).to(self.pc.device)
            if dist.is_initialized():
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if bad.item():
                self._diverged()
            masks = truth = None
            dice: list[float] = []
            if self.has_truth or out_dir is not None:  # collective over the grid
                masks = gather_masks(out.argmax(1), self.pc, self.pm.tile_hw, self.image_hw)
            if self.has_truth:
                truth = gather_masks(target, self.pc, self.pm.tile_hw, self.image_hw)
                counts = overlap_counts(out, target, self.pm.ctx, self.pm.out_map)
                dice = tally.add([cohort.ids[i] for i in rows], counts, masks, truth)
                n = len(rows)  # the padded last batch's copies are not images of the set
                value = loss_fn(out[:n], target[:n], self.pm.ctx, self.pm.out_map)  # type: ignore[call-arg]
                losses.append(float(value) * n)
            if out_dir is None or masks is None:
                continue
            for k, i in enumerate(rows):
                sid, store = cohort.ids[i], cohort.stores[i]
                write_mask(
                    out_dir / "masks" / f"{sid}.zarr",
                    masks[k],
                    classes=r.data.classes,
                    image=store,
                    scale=self._mask_scale(store),
                    level=r.data.level,
                )
                if written < overlays:
                    score = f" (Dice {dice[k]:.3f})" if dice else ""
                    write_overlay(
                        out_dir / "overlays" / f"{sid}.png",
                        masks[k],
                        image=store,
                        title=f"{sid}: predicted {', '.join(r.data.classes[1:])}{score}",
                        truth=None if truth is None else truth[k],
                        level=r.data.level,
                    )
                    written += 1
        if not self.has_truth:  # no label images to score against
            return {"n": len(indices), "dice": None, "iou": None, "val_loss": None, "per_image": []}
        scores = tally.finish()  # collective: the lesions counted on rank 0
        return {
            **summarise_segmentation(scores),
            "val_loss": sum(losses) / len(scores),
            "per_image": [s.row() for s in scores],
        }

    def _diverged(self) -> NoReturn:
        """Refuse an evaluation of NaN or inf outputs (decided alike on every rank): scored,
        a segmentation's NaN logits were all background (Dice 1 "by rule" on an empty truth)
        and a regression's errors NaN."""
        from hyfi_imaging.train.guard import NonFiniteError

        raise NonFiniteError(
            "evaluation",
            "the model's outputs are NaN or inf (its weights diverged)",
            f"lower optim.lr or set optim.grad_clip; {self._kept_line()}",
        )

    def evaluate(self, out_dir: Path | None = None) -> dict[str, Any]:
        """Validation metrics (identical on every rank); a classification's EvalResult under ``"_result"``.

        Segmentation: the means of :func:`~.seg_scores.summarise_segmentation` (each image's
        scores under ``"_per_image"``), masks and overlays written under ``out_dir`` when given.
        Regression and classification: with ``out_dir``, ``val_predictions.csv``
        holds every image of the run with its ``split`` (the training images predicted
        now; classification: :meth:`_write_split_predictions`). Regression: MSE and MAE
        (and per target).
        """
        from hyfi_imaging.train.metrics import evaluate_predictions, log_odds
        from hyfi_imaging.train.seg_scores import segmentation_line

        r = self.recipe
        manifest = r.data.val_manifest or r.data.manifest
        if self.task == "segmentation":
            m = self.predict_masks(manifest, self.val_idx, out_dir, overlays=r.task.overlays)
            per_image = m.pop("per_image")
            line = f"{segmentation_line(m)}  val_loss {m['val_loss']:.4f}"
            return {**m, "_per_image": per_image, "_line": line}
        p = self.predict(manifest, self.val_idx, log=self.task != "regression")
        if not np.isfinite(p).all():  # the same on every rank: the outputs are gathered
            self._diverged()
        if self.task == "regression":
            from hyfi_imaging.train.losses import regression_errors

            assert self.val_cohort.targets is not None
            truth = self.val_cohort.targets[self.val_idx]
            names = self.val_cohort.target_names
            errors = regression_errors(torch.from_numpy(p), truth, names)
            errors["val_loss"] = errors["mae" if r.task.loss == "mae" else "mse"]
            if out_dir is not None:  # every volume of the run with its split, as classification
                from hyfi_imaging.train.outputs import write_regressions

                assert self.cohort.targets is not None
                train_p = self.predict(r.data.manifest, self.train_idx)  # every rank takes part
                if self.rank0:
                    ids = [self.cohort.ids[i] for i in self.train_idx]
                    ids += [self.val_cohort.ids[i] for i in self.val_idx]
                    splits = ["train"] * len(self.train_idx) + ["val"] * len(self.val_idx)
                    write_regressions(
                        out_dir / "val_predictions.csv",
                        ids,
                        np.concatenate([train_p, p]),
                        names,
                        torch.cat([self.cohort.targets[self.train_idx], truth]).numpy(),
                        splits=splits,
                    )
            line = "  ".join(f"{k} {v:.4f}" for k, v in errors.items())
            return {**errors, "n": len(self.val_idx), "_line": line}
        labels = np.array([self.val_samples[i].label for i in self.val_idx])
        # Scores are the log-odds: the ranking of the logits, which float32 probabilities lose
        # where they round to 1.0 (AUC 0.44 for 0.38) and log-probabilities where they round
        # to 0.0 (a margin of 37: AUC 0.5 for 1.0); the loss takes the log-probabilities
        # (with probabilities it was capped at 27.6).
        result = evaluate_predictions(
            log_odds(p), labels, task=r.data.task, class_names=r.data.classes
        )
        if out_dir is not None:
            self._write_split_predictions(out_dir / "val_predictions.csv", np.exp(p))
        loss = float(F.nll_loss(torch.from_numpy(p), torch.from_numpy(labels)))
        return {**result.as_dict(), "val_loss": loss, "_result": result, "_line": result.line()}

    def _write_split_predictions(self, path: Path, val_probs: np.ndarray) -> None:
        """``path``: one row per slide of the run, ``slide_id, split, label, pred, p_<class>...``.

        The validation slides' ``val_probs`` and, predicted now (every rank takes
        part), the training slides' with ``split`` ``train``: what each slide
        was used for and what the final model says of it. Rank 0 writes.
        """
        from hyfi_imaging.train.predictions import class_cells, class_columns, write_rows

        r = self.recipe
        train_probs = np.exp(self.predict(r.data.manifest, self.train_idx, log=True))
        if not self.rank0:
            return
        classes = r.data.classes
        rows = []
        for split, samples, idx, probs in (
            ("train", self.samples, self.train_idx, train_probs),
            ("val", self.val_samples, self.val_idx, val_probs),
        ):
            for i, p in zip(idx, probs, strict=True):
                s = samples[i]
                label = classes[s.label] if s.label >= 0 else ""
                rows.append([s.slide_id, split, label, *class_cells(p, classes)])
        write_rows(path, ["slide_id", "split", "label", *class_columns(classes)], rows)

    def _labels(self) -> torch.Tensor | None:
        """Every sample's target, known on every rank: class indices or regression targets.

        None for segmentation: its targets are the label tiles read with the images.
        """
        if self.task == "segmentation":
            return None
        if self.task == "regression":
            assert self.cohort.targets is not None
            return self.cohort.targets.float()  # the dataset's float32 (the cohort's float64)
        return torch.tensor([s.label for s in self.samples])

    # -- the loop ----------------------------------------------------------------------------
    def run(self, signals: StopSignals | None = None) -> dict[str, Any]:
        """Train to the end (or ``max_steps``), evaluating and checkpointing on the way.

        ``signals``: the stop signals' handler, installed by the caller from the start
        (``hyfi-train`` installs it before it reads the recipe): one that arrives while the
        recipe is checked, the process group forms, a checkpoint loads or the data opens is
        acted on at the first step (a checkpoint, exit 75) instead of killing the rank,
        which a job does not requeue. Without one, it is installed here."""
        own = signals is None
        signals = signals or StopSignals().install()
        try:
            return self._train(signals)
        finally:
            if own:
                signals.restore()

    def _stop_agreed(self, signals: StopSignals) -> bool:
        """Whether any rank received a stop signal (every rank learns the same: one small
        all-reduce, where an evaluation is about to start)."""
        if not dist.is_initialized():
            return signals.requested
        flag = torch.tensor([float(signals.requested)], device=self.pc.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def _train(self, signals: StopSignals) -> dict[str, Any]:
        from tqdm import tqdm

        from hyfi_imaging.train.guard import StepGuard
        from hyfi_imaging.train.logs import RunLogger
        from hyfi_imaging.train.outputs import write_scores
        from hyfi_imaging.train.plots import plot_confusion_matrix, plot_training_curves

        self.setup()
        self._plan_epochs()
        r = self.recipe
        self._start_run()
        pos = self._restore()
        logger = RunLogger(self.out, enabled=self.rank0)
        # At an epoch's last step the checkpoint precedes the epoch's evaluation, which the
        # resumed run does again: its logged rows go.
        logger.truncate_after(pos.step, evals_at_step=pos.batch < self.steps_per_epoch)
        if self.rank0:
            (self.out / "recipe.yaml").write_text(yaml.safe_dump(json.loads(r.model_dump_json())))
            print(self.pm.describe(), file=sys.stderr)
        train_set = self._dataset(True, r.data.manifest)
        labels_all = self._labels()
        guard = StepGuard(
            r.train.nonfinite, r.train.max_skipped_steps, newest=self._newest, say=self.rank0
        )
        summary: dict[str, Any] = {}
        final_saved = False  # the last step checkpointed before the last evaluation
        start = time.monotonic()
        data_wait = 0.0  # seconds first-stage ranks waited for tiles (0 elsewhere)
        bar = tqdm(
            total=self.total_steps,
            initial=pos.step,
            disable=not (self.rank0 and r.train.progress),
            unit="step",
            desc=r.name,
            dynamic_ncols=True,
        )
        try:
            while pos.step < self.total_steps and pos.epoch < r.train.epochs:
                train_set.set_epoch(pos.epoch)
                batches = self._epoch_batches(pos.epoch)
                todo = batches[pos.batch :]
                t0 = time.monotonic()
                for (tiles, target), batch in zip(
                    self._batches(train_set, todo), todo, strict=True
                ):
                    wait = self.feed.last_wait_s if self.feed is not None else 0.0
                    data_wait += wait
                    lr = lr_at(pos.step, r, self.total_steps)
                    for group in self.optimizer.param_groups:
                        group["lr"] = lr
                    guard.before(self.pm.module)
                    torch.manual_seed(step_seed(r.train.seed, pos.step))  # resumes draw alike
                    with self.autocast:
                        labels = target if labels_all is None else labels_all[batch]
                        assert labels is not None  # segmentation is one stage: tiles and masks
                        loss = self.pm.train_step(
                            tiles, labels.to(self.pc.device), stop=lambda: signals.requested
                        )
                    if guard.accept(pos.step + 1, loss, self.pm.grads_finite):
                        if r.optim.grad_clip > 0:
                            self.pm.clip_grad_norm_(r.optim.grad_clip)
                        self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    pos.step += 1
                    pos.batch += 1
                    dt = time.monotonic() - t0
                    t0 = time.monotonic()
                    ips = len(batch) * r.parallel.data / max(dt, 1e-9)
                    mp = ips * math.prod(self.image_hw) / 1e6  # voxels for a volume
                    logger.log_step(
                        pos.step,
                        epoch=pos.epoch,
                        loss=loss,
                        lr=lr,
                        images_per_s=ips,
                        megapixels_per_s=mp,
                        memory_mib=_rss_mib(),
                        data_wait_s=wait,
                    )
                    bar.set_postfix(
                        loss=f"{loss:.4f}", img_s=f"{ips:.2f}", mem=f"{_rss_mib():.0f}M"
                    )
                    bar.update()
                    every = r.train.checkpoint_every_steps
                    if (every and pos.step % every == 0) or self.pm.stop_requested:
                        self._save(pos)
                    if pos.step >= self.total_steps or self.pm.stop_requested:
                        break
                if self.pm.stop_requested:  # a signal: the step's checkpoint is written
                    break
                epoch_done = pos.batch >= len(batches)
                ended = dataclasses.replace(pos)  # the epoch's end, before it counts as done
                if epoch_done:
                    pos.epoch += 1
                    pos.batch = 0
                last = pos.step >= self.total_steps or pos.epoch >= r.train.epochs
                due = (epoch_done and pos.epoch % r.train.eval_every_epochs == 0) or last
                if due and self.val_idx and self._stop_agreed(signals):
                    # A signal during the epoch's last step: a scheduler's grace period is not
                    # spent on an evaluation. The checkpoint at the epoch's end (before the
                    # evaluation, which the resumed run does) is written, once.
                    every = r.train.checkpoint_every_steps
                    if not (every and ended.step % every == 0):
                        self._save(ended)
                    pos, self.pm.stop_requested = ended, True
                    break
                if due and self.val_idx:
                    if last:  # first: an evaluation or output that fails keeps the steps
                        self._save(pos)
                        final_saved = True
                    # The last evaluation also writes the predictions (masks, overlays, CSV).
                    metrics = self.evaluate(self.out if last else None)
                    result = metrics.pop("_result", None)
                    line = metrics.pop("_line")
                    per_image = metrics.pop("_per_image", None)
                    logger.log_eval(pos.step, pos.epoch, {**metrics, "run_id": self.run_id})
                    summary = metrics
                    if self.rank0:
                        bar.write(f"epoch {pos.epoch}: {line}")
                        plot_training_curves(logger.history, self.out / "training_curves.png")
                        if per_image is not None:
                            write_scores(self.out / "val_per_image.csv", per_image)
                        if result is not None:
                            plot_confusion_matrix(
                                result.confusion,
                                r.data.classes,
                                self.out / "confusion_matrix.png",
                                title=f"{r.name}, step {pos.step}",
                            )
                    if not last and self._stop_agreed(signals):
                        # A signal during the evaluation: stop before the next step, with a
                        # checkpoint after the evaluation (the resumed run does not redo it).
                        self._save(pos)
                        self.pm.stop_requested = True
                        break
            if self.pm.stop_requested:
                bar.close()  # its last line ended before the signal's own line is said
                return self._stopped(pos, signals.received)
            if not final_saved:
                self._save(pos)
            if not summary and self.val_idx:  # relaunched after the end: still report
                summary = self.evaluate(self.out)
        finally:
            bar.close()
            logger.close()
        summary = {k: v for k, v in summary.items() if not k.startswith("_")}
        summary.update(
            run_id=self.run_id,
            steps=pos.step,
            epochs=pos.epoch,
            seconds=round(time.monotonic() - start, 1),
            data_wait_s=round(data_wait, 3),
            skipped_steps=guard.skipped,
            layout=self.pc.layout.describe(),
            world_size=self.pc.world_size,
        )
        peaks: list[Any] = [None] * self.pc.world_size
        if dist.is_initialized():
            dist.all_gather_object(peaks, round(_rss_mib(), 1))
        else:
            peaks = [round(_rss_mib(), 1)]
        summary["peak_rss_mib"] = peaks  # every rank's peak resident set, rank order
        if self.facts is not None:  # each slide's final µm/px, and which --fit fit changed
            summary["cohort"] = self.facts.record()
        if self.rank0:
            from hyfi_imaging.train.logs import jsonable

            # strict JSON, as evals.jsonl: NaN/inf as null (json.dumps wrote the token NaN)
            text = json.dumps(jsonable(summary), indent=2)
            (self.out / "summary.json").write_text(text)
        if dist.is_initialized():
            dist.barrier()
        return summary
