"""The training loop of ``hyfi-train``: tiles in, a whole-slide classifier out.

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

import json
import logging
import math
import os
import resource
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.train.config import ParallelConfig, Recipe
from hyfi_imaging.train.rundir import StartMode

if TYPE_CHECKING:
    from hyfi_imaging.parallel.engine import ParallelPlan
    from hyfi_imaging.parallel.layout import Layout

__all__ = ["Trainer", "lr_at", "preflight"]

log = logging.getLogger("hyfi_imaging.train")


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


def preflight(recipe: Recipe, *, start: StartMode = "resume") -> None:
    """Every check that needs no process group: runs on every rank before any allocation.

    ``hyfi-train --check`` runs exactly this: the manifests (usable slides,
    one image size, a label on every training slide), the layout against the
    model and the image (grid, stages, balance, checkpointing, micro-batches;
    the model is built on the meta device), and the run directory (writable,
    free space, ``--no-resume`` into a used one).
    """
    from hyfi_imaging.data.dataset import level_hw, load_samples
    from hyfi_imaging.train.inputs import check_data, data_pixels
    from hyfi_imaging.train.rundir import check_start

    samples = load_samples(recipe.data.manifest, classes=recipe.data.classes)
    if not samples:
        raise ConfigError(
            recipe.data.manifest,
            "no usable slides (status ok) in the manifest",
            "run hyfi-preprocess first",
        )
    sizes = {s.image_hw for s in samples}
    if len(sizes) != 1:
        raise ConfigError(
            recipe.data.manifest,
            f"images have different sizes {sorted(sizes)}",
            "preprocess all slides with the same --size",
        )
    _check_labels(recipe.data.manifest, samples, len(recipe.data.classes))
    pixels = data_pixels(recipe)
    check_data(recipe, pixels)
    if recipe.data.val_manifest is not None:
        val = load_samples(recipe.data.val_manifest, classes=recipe.data.classes)
        _check_labels(recipe.data.val_manifest, val, len(recipe.data.classes))
        val_pixels = data_pixels(
            recipe.model_copy(
                update={
                    "data": recipe.data.model_copy(update={"manifest": recipe.data.val_manifest})
                }
            )
        )
        if (val_pixels.channels, val_pixels.dtype) != (pixels.channels, pixels.dtype):
            raise ConfigError(
                recipe.data.val_manifest,
                f"holds {val_pixels.channels} {val_pixels.dtype} channels, the training "
                f"images {pixels.channels} {pixels.dtype}",
                "validate on images preprocessed like the training images",
            )
    p = recipe.parallel
    if recipe.train.batch_size % p.microbatches:
        raise ConfigError(
            "train.batch_size",
            f"{recipe.train.batch_size} is not divisible by parallel.microbatches {p.microbatches}",
            "make the batch a multiple of the micro-batch count",
        )
    _check_layout(recipe, level_hw(samples[0].image_hw, recipe.data.level), pixels.channels)
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


def _check_layout(recipe: Recipe, image_hw: tuple[int, int], channels: int) -> None:
    """The engine's checks that need no process group, on a meta-device model."""
    from hyfi_imaging.parallel.geometry import padded_hw
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.train.inputs import build_model

    r, p = recipe, recipe.parallel
    with torch.device("meta"):
        model = build_model(r, channels)
    padded_hw(image_hw, p.spatial, int(getattr(model, "total_stride", 1)))
    plan = plan_of(p, Layout(dp=p.data, pp=p.pipeline, sp=p.spatial))
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
    )


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
        from hyfi_imaging.data.dataset import level_hw, load_samples
        from hyfi_imaging.parallel.engine import ParallelModel
        from hyfi_imaging.parallel.launch import init_parallel
        from hyfi_imaging.parallel.layout import Layout
        from hyfi_imaging.train.inputs import build_model, data_pixels

        r = self.recipe
        p = r.parallel
        layout = Layout(dp=p.data, pp=p.pipeline, sp=p.spatial)
        self.pc = init_parallel(layout)
        self.rank0 = self.pc.rank == 0
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, self.pc.world_size)))
        self.samples = load_samples(r.data.manifest, classes=r.data.classes)
        self.image_hw = level_hw(self.samples[0].image_hw, r.data.level)
        self.pixels = data_pixels(r)
        torch.manual_seed(r.train.seed)
        model = build_model(r, self.pixels.channels)  # in_chans comes from the data
        plan = plan_of(p, layout)
        self.pm = ParallelModel(model, self.pc, plan, image_hw=self.image_hw)
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
        self.steps_per_epoch = len(self.train_idx) // dp // r.train.batch_size
        if self.steps_per_epoch == 0:
            raise ConfigError(
                "train.batch_size",
                f"{len(self.train_idx)} training slides over {dp} data replicas "
                f"make no full batch of {r.train.batch_size}",
                "use a smaller batch or more slides",
            )
        self.total_steps = r.train.max_steps or self.steps_per_epoch * r.train.epochs

    def _split(self) -> tuple[list[int], list[int]]:
        r = self.recipe
        n = len(self.samples)
        if r.data.val_manifest is not None:
            from hyfi_imaging.data.dataset import load_samples

            self.val_samples = load_samples(r.data.val_manifest, classes=r.data.classes)
            return list(range(n)), list(range(len(self.val_samples)))
        self.val_samples = self.samples
        rng = np.random.default_rng([r.train.seed, 7919])
        labels = np.array([s.label for s in self.samples])
        val: list[int] = []
        for c in np.unique(labels):  # stratified
            idx = rng.permutation(np.flatnonzero(labels == c))
            val.extend(int(i) for i in idx[: round(len(idx) * r.data.val_fraction)])
        val_set = set(val)
        return [i for i in range(n) if i not in val_set], sorted(val)

    def _dataset(self, augment: bool, manifest: Path) -> Any:
        from hyfi_imaging.data.augment import AugmentConfig
        from hyfi_imaging.data.dataset import TileDataset
        from hyfi_imaging.train.inputs import normalization

        a = self.recipe.data.augment
        aug = (
            AugmentConfig(
                flip=a.flip,
                rot90=a.rot90,
                out_size=self.image_hw,  # rot90 of a non-square image keeps its shape
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
            grid=self.recipe.parallel.spatial,
            rank=self.pc.tile,
            halo=0,
            align=self.align,
            augment=aug,
            seed=self.recipe.train.seed,
            level=self.recipe.data.level,
            classes=self.recipe.data.classes,
            normalize=normalization(self.recipe),
        )

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        """Mean/std normalisation on the host (in the prefetch thread), pinned for CUDA.

        One value for every channel (default 0.5 / 0.25) or one per channel.
        """
        d = self.recipe.data
        mean = torch.tensor(d.mean or (0.5,), dtype=x.dtype).view(1, -1, 1, 1)
        std = torch.tensor(d.std or (0.25,), dtype=x.dtype).view(1, -1, 1, 1)
        x = (x - mean) / std
        return x.pin_memory() if self.pc.device.type == "cuda" else x

    def _batches(
        self, dataset: Any, batches: Sequence[Sequence[int]]
    ) -> Iterator[torch.Tensor | None]:
        """Tiles of each batch for first-stage ranks, read ahead in the background; None elsewhere.

        A :class:`~hyfi_imaging.data.prefetch.Prefetcher` keeps the next two
        batches coming (read, augmented, normalised and pinned) while the current
        step computes; the copy to the GPU is non-blocking. ``self.feed`` exposes
        how long each step waited for its tiles.
        """
        from hyfi_imaging.data.prefetch import Prefetcher

        self.feed: Prefetcher[torch.Tensor] | None = None
        if not self.pm.is_first:
            for _ in batches:
                yield None
            return
        workers = self.recipe.data.workers
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=[list(b) for b in batches],
            num_workers=workers,
            multiprocessing_context="spawn" if workers else None,
        )
        feed = Prefetcher((item["image"] for item in loader), depth=2, transform=self._normalise)
        self.feed = feed
        try:
            for x in feed:
                yield x.to(self.pc.device, non_blocking=True)
        finally:
            feed.close()

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        r = self.recipe
        order = np.random.default_rng([r.train.seed, epoch]).permutation(self.train_idx)
        mine = order[self.dp_rank :: r.parallel.data][: self.steps_per_epoch * r.train.batch_size]
        return [
            list(map(int, mine[i : i + r.train.batch_size]))
            for i in range(0, len(mine), r.train.batch_size)
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

        r = self.recipe
        meta = {
            "epoch": pos.epoch,
            "batch": pos.batch,
            "recipe": r.name,
            "model": r.model.name,
            "layout": self.pc.layout.describe(),
            "classes": r.data.classes,
        }
        save_checkpoint(
            self.ckpt_root,
            pos.step,
            self._state(False),
            meta,
            keep=r.train.keep_checkpoints,
            run_id=self.run_id,
        )

    def _start_run(self) -> None:
        """Rank 0 makes the run directory this run's (``rundir``); every rank learns the id."""
        from hyfi_imaging.train.rundir import start_run

        ids: list[Any] = [start_run(self.out, self.start) if self.rank0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(ids, src=0)  # the world: every rank of the job
        self.run_id = str(ids[0])

    def _restore(self) -> _Position:
        """Resume this run from its newest loadable checkpoint; step 0 if it has none yet.

        Newer checkpoints of the run that failed to load are renamed
        ``step_N.unloadable`` (kept for inspection, never tried or counted again).
        """
        from hyfi_imaging.train.checkpoint import install_optimizer_state, load_latest

        if self.start != "resume":
            return _Position()
        state = self._state(True)
        found = load_latest(self.ckpt_root, state, run_id=self.run_id)
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
        if dist.is_initialized():
            dist.barrier()
        meta = found.meta
        return _Position(int(meta["step"]), int(meta["epoch"]), int(meta["batch"]))

    def load_weights(self, checkpoint: Path) -> dict[str, Any]:
        """Load only the model (any layout's checkpoint) from a checkpoint or a checkpoint directory."""
        from hyfi_imaging.train.checkpoint import load_latest

        if (checkpoint / "checkpoints").is_dir():
            checkpoint = checkpoint / "checkpoints"
        found = load_latest(checkpoint, {"model": self.pm.state_dict()})
        if found is None:
            raise ConfigError(
                checkpoint,
                "no checkpoint here",
                "give a run's checkpoints/step_N directory",
            )
        return found.meta

    # -- evaluation --------------------------------------------------------------------------
    def predict(self, manifest: Path, indices: Sequence[int]) -> np.ndarray:
        """Class probabilities ``(len(indices), K)`` for samples of ``manifest``, on every rank."""
        if not indices:
            return np.zeros((0, len(self.recipe.data.classes)), dtype=np.float32)
        dataset = self._dataset(False, manifest)
        bs = self.recipe.train.batch_size
        idx = list(indices)
        padded = idx + [idx[-1]] * (-len(idx) % bs)  # the schedule needs whole batches
        batches = [padded[i : i + bs] for i in range(0, len(padded), bs)]
        probs: list[torch.Tensor] = []
        with torch.no_grad(), self.autocast:
            for tiles in self._batches(dataset, batches):
                probs.append(torch.softmax(self.pm.predict(tiles).float(), dim=1).cpu())
        return torch.cat(probs)[: len(idx)].numpy()

    def evaluate(self) -> dict[str, Any]:
        """Validation metrics (identical on every rank); the EvalResult under ``"_result"``."""
        from hyfi_imaging.train.metrics import evaluate_predictions

        r = self.recipe
        p = self.predict(r.data.val_manifest or r.data.manifest, self.val_idx)
        labels = np.array([self.val_samples[i].label for i in self.val_idx])
        result = evaluate_predictions(p, labels, task=r.data.task, class_names=r.data.classes)
        loss = float(
            F.nll_loss(torch.log(torch.from_numpy(p).clamp_min(1e-12)), torch.from_numpy(labels))
        )
        return {**result.as_dict(), "val_loss": loss, "_result": result}

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train to the end (or ``max_steps``), evaluating and checkpointing on the way."""
        from tqdm import tqdm

        from hyfi_imaging.train.logs import RunLogger
        from hyfi_imaging.train.plots import plot_confusion_matrix, plot_training_curves

        self.setup()
        self._plan_epochs()
        r = self.recipe
        self._start_run()
        pos = self._restore()
        logger = RunLogger(self.out, enabled=self.rank0)
        logger.truncate_after(pos.step)
        if self.rank0:
            (self.out / "recipe.yaml").write_text(yaml.safe_dump(json.loads(r.model_dump_json())))
            print(self.pm.describe(), file=sys.stderr)
        train_set = self._dataset(True, r.data.manifest)
        labels_all = torch.tensor([s.label for s in self.samples])
        summary: dict[str, Any] = {}
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
                for tiles, batch in zip(self._batches(train_set, todo), todo, strict=True):
                    wait = self.feed.last_wait_s if self.feed is not None else 0.0
                    data_wait += wait
                    lr = lr_at(pos.step, r, self.total_steps)
                    for group in self.optimizer.param_groups:
                        group["lr"] = lr
                    with self.autocast:
                        loss = self.pm.train_step(tiles, labels_all[batch].to(self.pc.device))
                    if r.optim.grad_clip > 0:
                        self.pm.clip_grad_norm_(r.optim.grad_clip)
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    pos.step += 1
                    pos.batch += 1
                    dt = time.monotonic() - t0
                    t0 = time.monotonic()
                    ips = len(batch) * r.parallel.data / max(dt, 1e-9)
                    mp = ips * self.image_hw[0] * self.image_hw[1] / 1e6
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
                    if every and pos.step % every == 0:
                        self._save(pos)
                    if pos.step >= self.total_steps:
                        break
                epoch_done = pos.batch >= len(batches)
                if epoch_done:
                    pos.epoch += 1
                    pos.batch = 0
                last = pos.step >= self.total_steps or pos.epoch >= r.train.epochs
                due = (epoch_done and pos.epoch % r.train.eval_every_epochs == 0) or last
                if due and self.val_idx:
                    metrics = self.evaluate()
                    result = metrics.pop("_result")
                    logger.log_eval(pos.step, pos.epoch, {**metrics, "run_id": self.run_id})
                    summary = metrics
                    if self.rank0:
                        bar.write(f"epoch {pos.epoch}: {result.line()}")
                        plot_training_curves(logger.history, self.out / "training_curves.png")
                        plot_confusion_matrix(
                            result.confusion,
                            r.data.classes,
                            self.out / "confusion_matrix.png",
                            title=f"{r.name}, step {pos.step}",
                        )
            if not summary and self.val_idx:  # relaunched after the end: still report
                summary = self.evaluate()
            self._save(pos)
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
            layout=self.pc.layout.describe(),
            world_size=self.pc.world_size,
        )
        peaks: list[Any] = [None] * self.pc.world_size
        if dist.is_initialized():
            dist.all_gather_object(peaks, round(_rss_mib(), 1))
        else:
            peaks = [round(_rss_mib(), 1)]
        summary["peak_rss_mib"] = peaks  # every rank's peak resident set, rank order
        if self.rank0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
        if dist.is_initialized():
            dist.barrier()
        return summary
