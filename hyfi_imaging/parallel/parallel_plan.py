"""How to run a model in parallel: :class:`ParallelPlan`, a frozen, validated value.

Why a value of its own: ``hyfi-train``'s preflight, ``hyfi-plan``, ``hyfi-verify`` and the
engine all check a plan before any process group exists or any compute runs; every check
that needs neither lives here and fails with one line naming the fix. The engine
(:class:`~.engine.ParallelModel`) applies it (:func:`~.parallelize.parallelize`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models.registry import CheckpointedBlock
from hyfi_imaging.parallel.balance import BalanceBy
from hyfi_imaging.parallel.branches import check_branches
from hyfi_imaging.parallel.junction import check_junction_plan
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.pipeline import (
    check_balance,
    deep_layers,
    is_chain,
    model_layers,
    parse_checkpointing,
)
from hyfi_imaging.parallel.schedules import SCHEDULES, check_schedule, model_stages
from hyfi_imaging.parallel.streaming import STREAMING_MODES

__all__ = ["COMPILE_BACKENDS", "ParallelPlan", "Schedule"]

#: The ``torch.compile`` backends ``ParallelPlan.compile`` takes: inductor (generated kernels:
#: 2.61x a ResNet-50 step on an H200, docs/benchmarks.md) and aot_eager (torch's own kernels
#: through the same graph capture: exact, for checking).
COMPILE_BACKENDS = ("inductor", "aot_eager")

Schedule = Literal["gpipe", "1f1b", "bidirectional", "interleaved1f1b", "zbv", "dualpipev"]


@dataclass(frozen=True)
class ParallelPlan:
    """How to run a model: the layout plus the pipeline's micro-batches, schedule, cut and checkpointing.

    ``balance`` is the number of top-level layers per stage; ``None`` measures
    every layer (``balance_by``: ``"time"`` or ``"memory"``) and cuts where the
    slowest (largest) stage is smallest. ``checkpointing`` is ``"none"``,
    ``"full"`` (every block), ``"every:N"`` (every N-th block), ``"selective"``
    (every block, convolution outputs kept) or ``"deep"`` (every block, and in the chain's
    first layers of several blocks the blocks' inputs computed again from the layer's,
    the blocks in units: :func:`~.pipeline.deep_layers`). ``overlap`` computes each spatial
    convolution's interior while its halos are in flight (and its weight
    gradient while the halo gradients are): same results, less exposed waiting.
    ``halo_depth`` > 1: one halo exchange serves up to that many consecutive
    windowed layers (fewer messages; the border is computed twice).
    ``streaming``: ``"stem"`` runs a chain's leading convolution, BatchNorm,
    activation and max-pool in row bands (:mod:`.streaming`): their maps are
    never whole, which is the peak of a checkpointed ResNet.
    ``backward_bands``: each spatial convolution's backward runs in bands of
    output rows (:func:`~.windowed.backward_band`): band-sized transients
    instead of tile-sized ones, for about nine times the kernel calls -- a
    memory tool the planner chooses only where a layout does not fit without it.
    ``compile``: ``"none"``, or the ``torch.compile`` backend the stage module is compiled
    with (``"inductor"``, ``"aot_eager"``; :func:`~.parallelize.apply_compile`), offered on
    one stage without tiles, branches, checkpointing or streaming (data replicas allowed).
    ``schedule`` is ``gpipe``, ``1f1b``, or one with two stages per rank
    (:mod:`.schedules`): ``bidirectional`` (two mirrored replicas, GEMS),
    ``interleaved1f1b``, ``zbv``, ``dualpipev`` (torch's; the model is cut into
    ``2 pp`` stages, so ``balance`` lists ``2 pp`` counts).

    OK::

        ParallelPlan(Layout(dp=2, pp=2, sp=(1, 2)), microbatches=4, schedule="1f1b")

    Error::

        ParallelPlan(Layout(pp=4), microbatches=2, schedule="1f1b").validate(model, 8)
        # ConfigError: 1F1B needs at least as many micro-batches as stages
    """

    layout: Layout
    microbatches: int = 1
    schedule: Schedule = "gpipe"
    balance: tuple[int, ...] | None = None
    checkpointing: str = "none"
    balance_by: BalanceBy = "time"
    overlap: bool = False
    halo_depth: int = 1
    streaming: str = "none"
    backward_bands: bool = False
    compile: str = "none"

    def __post_init__(self) -> None:
        check_junction_plan(self.layout, self.schedule)
        if self.streaming not in STREAMING_MODES:
            raise ConfigError(
                f"streaming {self.streaming!r}",
                "is not a streaming mode",
                f"use one of {', '.join(STREAMING_MODES)}",
            )
        if self.streaming != "none" and self.halo_depth > 1:
            raise ConfigError(
                f"streaming {self.streaming} with halo_depth {self.halo_depth}",
                "a deep halo would carry a border out of the streamed stem, which computes "
                "its own tile only",
                "use halo_depth 1 with streaming, or streaming none",
            )
        if not isinstance(self.halo_depth, int) or self.halo_depth < 1:
            raise ConfigError(
                f"--halo-depth {self.halo_depth}",
                "must be a positive integer",
                "use 1 (one exchange per layer) or e.g. --halo-depth 2",
            )
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ConfigError(
                f"--microbatches {self.microbatches}",
                "must be a positive integer",
                "use e.g. --microbatches 4",
            )
        if self.schedule not in SCHEDULES:
            check_schedule(self.schedule, self.layout, self.microbatches)  # names the choices
        if self.balance_by not in ("time", "memory"):
            raise ConfigError(
                f"balance by {self.balance_by!r}", "is not a cost", "use time or memory"
            )
        if self.balance is not None:
            object.__setattr__(self, "balance", tuple(int(b) for b in self.balance))
        parse_checkpointing(self.checkpointing)
        if self.schedule == "1f1b" and self.microbatches < self.layout.pp:
            raise ConfigError(
                f"--schedule 1f1b --microbatches {self.microbatches}",
                f"1F1B needs at least as many micro-batches as pipeline stages ({self.layout.pp})",
                f"use --microbatches {self.layout.pp} or more, or --schedule gpipe",
            )
        check_schedule(self.schedule, self.layout, self.microbatches)
        self._check_compile()

    def _check_compile(self) -> None:
        """Refuse, in one line, a ``compile`` this engine does not offer."""
        if self.compile == "none":
            return
        where = f"compile {self.compile}"
        if self.compile not in COMPILE_BACKENDS:
            raise ConfigError(
                where, "is not a torch.compile backend offered", "use none, inductor or aot_eager"
            )
        lay = self.layout
        tiles = any(g > 1 for s in range(lay.pp) for g in lay.grid_of(s))
        if lay.pp > 1 or tiles or lay.br > 1 or self.stages > 1:
            raise ConfigError(
                f"{where} on {lay.describe()}",
                "compiles one stage without tiles or branches only (on a 1x2 grid every "
                "spatial layer is a graph break and the step measured no faster; pipeline "
                "stages and branch ranks are not tried)",
                "use compile none (parallel.compile, hyfi-verify --compile), or data replicas "
                "alone",
            )
        for option, value, off in (
            ("checkpointing", self.checkpointing, "none"),
            ("streaming", self.streaming, "none"),
        ):
            if value != off:
                raise ConfigError(
                    f"{where} with {option} {value}",
                    "torch.compile cannot run the checkpointed blocks' or the streamed stem's "
                    "recomputation (their BatchNorm-statistics contexts)",
                    f"use {option} {off} with compile, or compile none",
                )

    @property
    def stages(self) -> int:
        """How many stages the model is cut into (``2 pp`` for torch's multi-stage schedules)."""
        return model_stages(self.schedule, self.layout.pp)

    def check_model(self, model: nn.Module) -> None:
        """ConfigError unless the model can be cut and checkpointed as planned (no compute)."""
        n = len(model_layers(model, self.stages))  # a non-chain: traced, or refused
        if self.stages > 1 and not is_chain(model):
            self._check_traced(model)
        if self.stages > n:
            per_rank = self.stages // self.layout.pp
            raise ConfigError(
                f"--pipeline {self.layout.pp} --schedule {self.schedule}",
                f"needs {self.stages} model stages but {type(model).__name__} has only {n} "
                "top-level layers to cut",
                f"use at most {n // per_rank} pipeline stages"
                + (f" ({per_rank} model stages per rank)" if per_rank > 1 else ""),
            )
        if self.balance is not None:
            check_balance(self.balance, n, self.stages)
        if parse_checkpointing(self.checkpointing) and not any(
            isinstance(m, CheckpointedBlock) for m in model.modules()
        ):
            raise ConfigError(
                f"--checkpointing {self.checkpointing}",
                f"{type(model).__name__} has no checkpointable blocks",
                "use --checkpointing none",
            )
        deep_layers(model, self.checkpointing)  # deep on a model that is not a chain: refused
        # Branch ranks need cells to split (hyfi-train's preflight, the planner and the engine).
        check_branches(model, self.layout.br, checkpointing=self.checkpointing)

    def _check_traced(self, model: nn.Module) -> None:
        """ConfigError for what a traced chain form (:mod:`.chain_form`) cannot run exactly."""
        where = f"--pipeline {self.layout.pp} with {type(model).__name__} (not a chain)"
        if self.halo_depth > 1:
            raise ConfigError(
                where,
                f"--halo-depth {self.halo_depth} plans deep halos across top-level children, "
                "but its traced layers may be cut inside one",
                "use --halo-depth 1",
            )
        if self.layout.junction:
            raise ConfigError(
                where,
                "per-stage grids re-partition one activation between stages, but a traced "
                "layer hands on several (skips)",
                "use one grid for every stage (e.g. --spatial 1x2)",
            )

    def check_batch(self, batch: int) -> None:
        """ConfigError unless the per-replica ``batch`` splits into equal micro-batches."""
        m = self.microbatches
        if batch < 1 or batch % m:
            up = m * max(1, math.ceil(batch / m))
            raise ConfigError(
                f"batch {batch} with --microbatches {m}",
                f"the per-replica batch does not split into {m} equal micro-batches",
                f"use a per-replica batch that is a multiple of {m} (e.g. {up}), "
                f"or a number of micro-batches that divides {batch}",
            )

    def validate(self, model: nn.Module, batch: int) -> None:
        """Every check that needs no process group and no compute; ConfigError naming the fix."""
        self.check_model(model)
        self.check_batch(batch)
