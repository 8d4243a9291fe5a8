"""The layouts ``hyfi-plan`` and ``parallel: auto`` consider, and how they are ranked.

:func:`candidates` enumerates every layout of a number of devices worth
predicting -- data replicas x pipeline stages x one grid for every stage, and
per-stage grids (:func:`junction_grids`, the junction) for pipelines of up to
:data:`JUNCTION_STAGES` stages -- with every micro-batch count, schedule and
checkpointing mode the engine's own checks accept; :mod:`.plan` predicts each
one's memory and step time; :func:`rank` orders the predictions.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.geometry.grid import TileGrid
from hyfi_imaging.parallel.layout import Grid, Layout
from hyfi_imaging.parallel.model_trace import meta_model
from hyfi_imaging.parallel.pipeline import deep_layers
from hyfi_imaging.parallel.plan import (
    CHECKPOINTING,
    Candidate,
    Prediction,
    candidate_plan,
    check_pooled,
)
from hyfi_imaging.parallel.schedules import SCHEDULES
from hyfi_imaging.parallel.spatial import tile_alignment

__all__ = [
    "JUNCTION_LIMIT",
    "JUNCTION_STAGES",
    "candidates",
    "device_memory",
    "junction_grids",
    "rank",
]


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n``, ascending (cached: the junction's grids ask for the same sizes
    millions of times at thousands of devices, where they took a minute of a plan's listing)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


#: Per-stage grid sequences offered per (data replicas, pipeline stages): the ones with the most
#: tiles up front come first, so a bound keeps the activation-heavy ones.
JUNCTION_LIMIT = 8
#: Deepest pipeline offered with per-stage grids (only the front stages need tiles; a bound on
#: the candidates, each of which is traced stage by stage).
JUNCTION_STAGES = 4


def junction_grids(ranks: int, pp: int, *, limit: int = JUNCTION_LIMIT) -> list[tuple[Grid, ...]]:
    """Per-stage 2-D grids for ``pp`` stages whose tiles sum to ``ranks`` (one replica), none
    growing along the pipe (the junction's rule), not all equal; at most ``limit``.

    OK: ``junction_grids(3, 2) == [((1, 2), (1, 1)), ((2, 1), (1, 1))]``;
    ``junction_grids(7, 3)`` holds ``((2, 2), (1, 2), (1, 1))``.
    """
    out: list[tuple[Grid, ...]] = []

    def extend(prefix: tuple[Grid, ...], left: int) -> None:
        stages_left = pp - len(prefix)
        if len(out) >= limit or stages_left == 0:
            if left == 0 and len(set(prefix)) > 1 and len(out) < limit:
                out.append(prefix)
            return
        most = left - stages_left + 1  # every later stage needs a rank
        if prefix:  # and none has more tiles than the one before it
            most = min(most, prefix[-1][0] * prefix[-1][1])
        for size in range(most, 0, -1):
            if left - size > size * (stages_left - 1):
                break  # the later stages, no larger than this one, cannot take the rest
            for gy in _divisors(size):
                grid = (gy, size // gy)
                if prefix and any(g > p for g, p in zip(grid, prefix[-1], strict=True)):
                    continue
                extend((*prefix, grid), left - size)

    if pp >= 2:
        extend((), ranks)
    return out


def _widened(grids: tuple[Grid, ...]) -> int:
    """Ranks of one replica of two mirrored replicas of per-stage ``grids`` (each pipeline
    position as wide as the larger of its two stages' grids: :class:`~.mirrored.MirroredPlacement`)."""
    sizes = [math.prod(g) for g in grids]
    return sum(max(sizes[p], sizes[-1 - p]) for p in range(len(sizes)))


def candidates(
    model: nn.Module, image_hw: tuple[int, int], devices: int, batch: int
) -> Iterator[Candidate]:
    """Every layout of ``devices`` ranks worth predicting for this model and image.

    Besides one grid for every stage, pipelines of two or more stages get per-stage grids
    (:func:`junction_grids`, for models with a pooled output). With a pipeline, every schedule
    is a candidate; combinations training would refuse (odd
    ``pp`` for ``bidirectional``, too few micro-batches for 1F1B, ZBV or DualPipeV, more model
    stages than layers, a model without checkpointable blocks) are left out, by the engine's own
    checks (:func:`~.plan.candidate_plan`).
    """
    try:
        align = tile_alignment(model)  # the engine's number (a model may declare none)
    except ConfigError:  # no spatial form: the engine refuses each spatial candidate
        align = 1

    def roomy(grid: Grid) -> bool:
        try:
            tile = TileGrid.padding(image_hw, grid, align).tile
        except ConfigError:
            return False
        # tiles of one pixel at the deepest layer: no room for halos
        return math.prod(grid) == 1 or min(tile) >= 2 * align

    try:
        meta_model(model, "stem")  # the planner's streamed meta copy, made once
        streams = True
    except ConfigError:
        streams = False
    try:
        deep = bool(deep_layers(model, "deep"))
    except ConfigError:  # not a chain
        deep = False
    try:
        check_pooled(model, image_hw, Layout(pp=2, grids=((1, 2), (1, 1))))
        pooled = True
    except ConfigError:
        pooled = False
    for dp in _divisors(devices):
        layouts = []
        for pp in range(1, devices // dp + 1):
            ranks = devices // dp
            if ranks % pp == 0:
                sp = ranks // pp
                layouts += [Layout(dp=dp, pp=pp, sp=(gy, sp // gy)) for gy in _divisors(sp)]
            if pooled and pp <= JUNCTION_STAGES:  # per-stage grids: splits of the replica's ranks
                # (and, for two mirrored replicas, of fewer ranks that the placement widens
                # to these: each position as wide as the larger of its two stages' grids, so
                # between half of them and all, and only splits that widen to all of them)
                fewest = max(pp, (ranks + 1) // 2)
                splits = (
                    g
                    for k in range(ranks, fewest - 1, -1)
                    for g in junction_grids(k, pp)
                    if k == ranks or _widened(g) == ranks
                )
                for grids in dict.fromkeys(splits):
                    try:
                        layouts.append(Layout(dp=dp, pp=pp, grids=grids))
                    except ConfigError:
                        continue
        for lay in layouts:
            if not all(roomy(lay.grid_of(s)) for s in range(lay.pp)):
                continue
            for m in _divisors(batch):
                for schedule in SCHEDULES if lay.pp > 1 else ("gpipe",):
                    for ck in CHECKPOINTING:
                        # Deep checkpointing, the most memory for the most compute: one
                        # stage, with the streamed stem where there is one.
                        if ck == "deep" and not (deep and lay.pp == 1):
                            continue
                        # The streamed stem where memory matters most: every block
                        # checkpointed, tiles and replicas only (bounds the search).
                        both = ck in ("full", "deep") and lay.pp == 1 and streams
                        # The banded convolution backward likewise, on tiles with every
                        # block checkpointed: ranked by speed, it wins only where the
                        # layout does not fit without it.
                        banded = ck in ("full", "deep") and any(g > 1 for g in lay.grid_of(0))
                        stems = ("stem",) if ck == "deep" else ("none", "stem")
                        for streaming in stems if both else ("none",):
                            for bands in (False, True) if banded else (False,):
                                cand = Candidate(
                                    lay, m, ck, schedule, streaming=streaming,
                                    backward_bands=bands,
                                )  # fmt: skip
                                if cand.world_size != devices:
                                    continue  # per-stage grids: mirrored replicas widen them
                                try:
                                    candidate_plan(cand).validate(model, batch)
                                except ConfigError:
                                    continue  # e.g. per-stage grids with a schedule they do not run
                                yield cand


def rank(predictions: Sequence[Prediction], memory: float) -> list[Prediction]:
    """Fitting layouts first (fastest per device, then fewest micro-batches, then smallest),
    then the rest by peak. Where the rate cannot tell micro-batches apart (``parallel:
    auto``'s nominal rate on one stage), the replica's batch stays whole: BatchNorm's
    statistics are the batch's, as the user would train it by hand, not each half's."""
    fit = [p for p in predictions if p.peak <= memory]
    rest = [p for p in predictions if p.peak > memory]
    per_device = lambda p: p.images_per_s / p.candidate.world_size  # noqa: E731
    fit.sort(key=lambda p: (-per_device(p), p.candidate.microbatches, p.peak))
    rest.sort(key=lambda p: p.peak)
    return fit + rest


def device_memory(devices: int) -> int:
    """Bytes of one device: this machine's GPU, or its RAM shared by the ranks on it -- the
    launched job's ranks on this node when ``devices`` is its world (2 nodes x 2 ranks
    divided each node's RAM by 4, and parallel=auto chose a slower layout), else all
    ``devices`` (a plan for this machine)."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    from hyfi_imaging.parallel.launcher_env import launch_env

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    job = launch_env()
    here = job.local_world_size if job.world_size == devices > 1 else devices
    return int(ram) // max(1, here)
