"""hyfi-plan's model: per-rank peak memory and step time of a layout, and a ranking of layouts.

Why a model and not trial runs: the layouts worth asking about are the ones that
do not fit anywhere yet. Everything here is computed from a **meta-device
trace** (no memory, no compute) of the model's stages on a tile-sized
micro-batch, counting what autograd keeps exactly as the memory benchmark and
test do (:func:`~.memory.saved_activations`), and for time the FLOPs of each
layer counted in the same trace at a **measured** rate of this device on this
model (:func:`measure_rate`).

Per-rank peak over the memory a rank holds after building its model:

* **activations**: what the stage's layers save for backward on one tile of
  one micro-batch -- with this library's windowed layers (no halo-extended
  copies, no max-pool indices) plus the received halo strips; checkpointed
  blocks keep only their input (``full``) or also their convolutions' outputs
  (``selective``). Summed over the micro-batches the rank's schedule order keeps
  in flight (:func:`~.schedules.peak_in_flight`; GPipe: all of them; 1F1B:
  ``pp - stage``), over both stages where a rank holds two (``bidirectional``,
  ``interleaved1f1b``, ``zbv``, ``dualpipev``: :func:`~.schedules.local_stages`).
* **backward transient**: walking backward, the activations still kept plus
  the gradients being computed (output, input and the rebuilt extended tile of
  the layer at hand), and a checkpointed block's recomputed internals; the
  maximum over layers. On the CPU, in a dtype oneDNN does not take (float64),
  a convolution also unfolds its input (:func:`~.memory.cpu_unfold_bytes`).
* **state**: gradients and optimizer state, ``1/(dp x sp)`` of the stage's
  (``sp``: that stage's own grid, with per-stage grids -- the junction) under
  FSDP2 plus the gathered parameters and unsharded gradients of the units in
  flight; whole without sharding; summed over a rank's stages. A pipeline holds
  every unit's unsharded gradients to the step's last backward: at the step's
  end, past the freed activations, they count as a backward transient.
* **buffers**: pipeline gradient buffers of the stage boundaries (and, after a
  junction under 1F1B, the previous input gradient and its pieces in flight),
  and the runtime's own first-step allocations (:data:`RUNTIME_OVERHEAD`).

Step time: every rank's action order (:func:`~.schedules.schedule_actions`) replayed
(:func:`~.schedules.simulate_orders`, the benchmark's bubble replay) with each stage's
forward and backward FLOPs (the forward again for recomputed blocks) over the measured
rate, plus the bytes a stage receives from another rank (at a junction, its share of the
whole feature map), FSDP2 traffic once per step and GEMS's mirror all-reduce, over
``bandwidth``. It ranks layouts; it is not a promise of wall time.

Per-stage grids (:mod:`.junction`) are predicted stage by stage on each stage's own tile;
:func:`junction_grids` lists the ones :func:`candidates` offers (bounded).
"""

from __future__ import annotations

import copy
import itertools
import math
import time
import weakref
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from hyfi_imaging.geometry.grid import TileGrid
from hyfi_imaging.models.registry import chain_run
from hyfi_imaging.parallel.balance import partition
from hyfi_imaging.parallel.branches import rank_model, sync_bytes
from hyfi_imaging.parallel.deep_borders import Borders, deep_borders, deepen
from hyfi_imaging.parallel.devices import Device, Link
from hyfi_imaging.parallel.engine import ParallelPlan, Schedule
from hyfi_imaging.parallel.geometry import layer_geom
from hyfi_imaging.parallel.junction import check_junction_model
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.memory import SavedActivations, cpu_unfold_bytes
from hyfi_imaging.parallel.mirrored import placed_world_size
from hyfi_imaging.parallel.model_trace import (
    ModelTrace,
    layer_of,
    meta_model,
    saved_trace,
    stem_splits,
    trace_model,
)
from hyfi_imaging.parallel.pipeline import StageModule, deep_layers, stage_bounds
from hyfi_imaging.parallel.schedules import (
    LocalStage,
    local_stages,
    peak_in_flight,
    schedule_actions,
    simulate_orders,
)
from hyfi_imaging.parallel.sharding import shard_units
from hyfi_imaging.parallel.spatial import tile_alignment
from hyfi_imaging.parallel.spatial.kinds import WINDOWED_LAYERS
from hyfi_imaging.parallel.speed import (
    Counts,
    allreduce_s,
    branch_allreduce_s,
    compute_s,
    fresh_s,
    halo_copy_bytes,
    halo_s,
    message_s,
    norm_allreduce_s,
    reduce_scatter_s,
)
from hyfi_imaging.parallel.streaming import Stem
from hyfi_imaging.parallel.windowed import backward_band

__all__ = [
    "Candidate",
    "Prediction",
    "candidate_plan",
    "check_pooled",
    "measure_rate",
    "nominal_device",
    "predict",
    "step_time",
    "StageCost",
]

#: Bytes a rank's runtime allocates on its first training step besides tensors.
#: On CPU the anonymous part measures ~0 with ``tests/mpi/plan_accuracy.py``
#: (the 15-30 MiB of library code paged in on the first step is file-backed and
#: reclaimable, and depends on the CPU and page cache, so it is not counted);
#: on CUDA the context and the caching allocator's slack.
RUNTIME_OVERHEAD = {"cpu": 0, "cuda": 512 * 2**20}
#: Optimizer state tensors per parameter.
OPT_STATE = {"sgd": 1, "adamw": 2}
#: Parameter-sized tensors an optimizer step reads plus writes (SGD with momentum: parameter,
#: gradient and momentum read, parameter and momentum written; AdamW: two moments more).
OPT_BYTES = {"sgd": 5, "adamw": 7}
CHECKPOINTING = ("none", "selective", "full", "deep")


@dataclass(frozen=True)
class Candidate:
    """One way to run: layout, micro-batches, schedule, checkpointing, stage cut, streaming."""

    layout: Layout
    microbatches: int = 1
    checkpointing: str = "none"
    schedule: str = "gpipe"
    balance: tuple[int, ...] | None = None
    streaming: str = "none"
    backward_bands: bool = False
    #: The runtime's ``halo_depth``: one exchange serves up to that many windowed layers, which
    #: compute (and keep) the deeper borders the rest of their run reads.
    halo_depth: int = 1

    @staticmethod
    def of(plan: ParallelPlan) -> Candidate:
        """The candidate an engine plan (a recipe's ``parallel`` section) runs; the inverse of
        :func:`candidate_plan` (``overlap`` and ``compile`` change no memory: they are the
        planner's arguments or not modelled)."""
        return Candidate(
            plan.layout,
            microbatches=plan.microbatches,
            checkpointing=plan.checkpointing,
            schedule=plan.schedule,
            balance=tuple(plan.balance) if plan.balance else None,
            streaming=plan.streaming,
            backward_bands=plan.backward_bands,
            halo_depth=plan.halo_depth,
        )

    @property
    def world_size(self) -> int:
        """Ranks it runs on: the layout's, or more where two mirrored replicas of per-stage
        grids are placed (:class:`~.mirrored.MirroredPlacement`)."""
        return placed_world_size(self.layout, self.schedule)

    def describe(self) -> str:
        return (
            f"{self.layout.describe()}, m={self.microbatches} {self.schedule}, "
            f"ckpt {self.checkpointing}"
            + (", stem streamed" if self.streaming == "stem" else "")
            + (", banded backward" if self.backward_bands else "")
            + (f", halo depth {self.halo_depth}" if self.halo_depth > 1 else "")
        )


@dataclass
class Prediction:
    """Predicted per-rank bytes (over the post-build resident memory) and step seconds."""

    candidate: Candidate
    balance: tuple[int, ...]
    activations: int
    transient: int
    state: int
    buffers: int
    step_s: float = math.nan
    images_per_s: float = math.nan
    #: Idle share of the pipeline ranks in the simulated step (0 without a pipeline).
    bubble: float = 0.0
    #: Every pipeline rank's predicted peak (the busiest one's is :attr:`peak`).
    rank_peaks: tuple[int, ...] = ()
    #: The step time by part (seconds) and what was counted, for the busiest rank: ``busy``
    #: (what its device computes and copies, waits excluded: what CPU time measures),
    #: ``compute``, ``halo``, ``collectives`` (BatchNorm statistics), ``p2p``, ``fsdp``
    #: (exposed), ``mirror``; ``flops``, ``pixel_flops``, ``bytes``, ``ops`` of its step, and its new buffers
    #: (``fresh_bytes``) with what they cost (``fresh_s``, part of ``busy``).
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return self.activations + self.transient + self.state + self.buffers


def _in_block(path: str, blocks: Sequence[str]) -> str | None:
    return next((b for b in blocks if path == b or path.startswith(b + ".")), None)


def _strips(
    modules: dict[str, nn.Module],
    trace: SavedActivations,
    grid: Sequence[int],
    borders: Borders | None = None,
) -> int:
    """Bytes of halo strips the busiest rank receives for every windowed layer (``modules``:
    the stage's, by path); with deep halos (``borders``) a run's first layer receives the run's
    deeper halo and the rest of the run none."""
    if all(g == 1 for g in grid):
        return 0
    nd = len(grid)
    total = 0
    for path, _, nbytes, _, shape in trace.calls:
        m = modules.get(path)
        if not isinstance(m, WINDOWED_LAYERS) or len(shape) != nd + 2:
            continue
        side: list[int] = []
        halos = [g.halo() for g in layer_geom(m, shape[-nd:])]
        if borders and path in borders.heads:
            head = borders.heads[path]
            halos = [(head[2 * a], head[2 * a + 1]) for a in range(nd)]
        elif borders and path in borders.carried and any(borders.carried[path][0]):
            continue  # its input carries the run's border: nothing received
        for (before, after), tiles in zip(halos, grid, strict=True):
            side.append(0 if tiles == 1 else before + after if tiles > 2 else max(before, after))
        tile = shape[-nd:]
        grown = math.prod(t + s for t, s in zip(tile, side, strict=True)) - math.prod(tile)
        total += nbytes * grown // max(1, math.prod(tile))
    return total


def _stage_memory(
    trace: SavedActivations,
    blocks: Sequence[str],
    policy: str,
    *,
    spatial: bool,
    bands: bool = False,
    workspaces: Sequence[int] = (),
    replayed: Collection[str] = (),
    units: Mapping[str, Collection[str]] | None = None,
) -> tuple[int, int]:
    """(kept activations, backward transient above them) of one micro-batch of a stage.

    ``workspaces``: per call of ``trace.calls``, what its kernel allocates besides tensors
    (a CPU convolution's unfolded input), held while it runs. ``replayed``: the blocks
    whose inputs a deep chain computes again from its layer's (every block of a layer
    ``checkpointing: deep`` runs as a deep chain but the first): such an input is not kept,
    it exists while its block is back-propagated. ``units``: per
    block recomputed in units, the paths of the modules starting each unit; its internals
    are then the earlier units' outputs and the current unit's own (:func:`_unit_internals`)."""
    kinds = trace.kinds
    first_call: dict[str, int] = {}
    for i, (path, *_rest) in enumerate(trace.calls):
        b = _in_block(path, blocks)
        if b is not None:
            first_call.setdefault(b, i)
    order = {path: i for i, (path, *_r) in enumerate(trace.calls)}
    # Items kept from forward to backward: (position, bytes, block or None).
    items: list[tuple[int, int, str | None]] = []
    for _, owner, nbytes, dtype in trace.storages:
        if owner == "(parameters)":
            continue
        if spatial and kinds.get(owner) == "MaxPool2d" and not dtype.is_floating_point:
            continue  # our max-pool recomputes its winners instead of keeping int64 indices
        items.append((order.get(owner, 0), nbytes, _in_block(owner, blocks)))
    kept = [(pos, n) for pos, n, b in items if b is None]
    kept_keys = {key for key, owner, _, _ in trace.storages if _in_block(owner, blocks) is None}
    replays: dict[str, int] = {}  # the inputs a deep chain computes again, by block
    for b, i in first_call.items():
        _, key, nbytes, _, _ = trace.calls[i]
        if key not in kept_keys:
            if b in replayed:
                replays[b] = nbytes
            else:
                kept.append((i, nbytes))
        if policy == "selective":
            kept += [
                (j, out)
                for j, (path, _, _, out, _) in enumerate(trace.calls)
                if _in_block(path, [b]) and kinds.get(path) == "Conv2d"
            ]
    total = sum(n for _, n in kept)
    # Bytes kept up to each call (positions are call indices), and each block's internals.
    kept_upto = _upto(kept, len(trace.calls))
    inside = {b: _upto([(pos, n) for pos, n, bb in items if bb == b], len(trace.calls))
              for b in first_call}  # fmt: skip
    in_units = _unit_internals(trace, units or {})
    peak = 0
    for i, (path, _, in_bytes, out_bytes, in_shape) in enumerate(trace.calls):
        b = _in_block(path, blocks)
        # Inside a recomputed block: what was kept before it, and its internals up to here.
        base = (
            kept_upto[i] if b is None else kept_upto[first_call[b]] + in_units.get(i, inside[b][i])
        )
        if b is not None:
            base += replays.get(b, 0)
        peak = max(
            peak,
            base
            + out_bytes
            + int(_transient_factor(kinds.get(path, ""), spatial, in_shape, bands) * in_bytes)
            + (workspaces[i] if i < len(workspaces) else 0),
        )
    return total, max(0, peak - total)


def _unit_internals(
    trace: SavedActivations, units: Mapping[str, Collection[str]]
) -> dict[int, int]:
    """Per call of a block recomputed in units (``units``: block -> the paths of the modules
    starting its units), what the block holds while that call's unit is back-propagated:
    the earlier units' outputs (the later units' checkpointed inputs) and the storages the
    unit itself saves up to that call, its input excepted (counted as the earlier output).

    A storage is placed at its first saver's call, read in execution order (a block's one
    ReLU module is called once per unit)."""
    if not units:
        return {}
    paths = [c[0] for c in trace.calls]
    at, j = [], 0
    for _, owner, _, _ in trace.storages:
        k = next((k for k in range(j, len(paths)) if paths[k] == owner), None)
        at.append(-1 if k is None else k)
        j = j if k is None else k
    out: dict[int, int] = {}
    for block, starts in units.items():
        calls = [i for i, p in enumerate(paths) if _in_block(p, [block])]
        unit_of: dict[int, int] = {}
        u = 0
        for i in calls:
            u += paths[i] in starts
            unit_of[i] = u
        first_in: dict[int, int] = {}  # unit -> the storage key of its first call's input
        outs: dict[int, int] = {}  # unit -> its output bytes (its last call's)
        for i in calls:
            first_in.setdefault(unit_of[i], trace.calls[i][1])
            outs[unit_of[i]] = trace.calls[i][3]
        own: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for (key, _, nbytes, _), pos in zip(trace.storages, at, strict=True):
            if pos in unit_of and key != first_in[unit_of[pos]]:
                own[unit_of[pos]].append((pos, nbytes))
        for i in calls:
            u = unit_of[i]
            held = sum(n for v, n in outs.items() if v < u)
            out[i] = held + sum(n for pos, n in own[u] if pos <= i)
    return out


def _upto(items: Sequence[tuple[int, int]], n: int) -> list[int]:
    """``out[i]``: the bytes of ``items`` (position, bytes) at positions ``<= i``, for ``i < n``."""
    at = [0] * n
    before = 0  # positions below 0 count from the start
    for pos, nbytes in items:
        if pos < 0:
            before += nbytes
        elif pos < n:
            at[pos] += nbytes
    return list(itertools.accumulate(at, initial=before))[1:]


def _transient_factor(
    kind: str, spatial: bool, in_shape: Sequence[int] = (), bands: bool = False
) -> float:
    """Input-sized tensors a layer's backward holds at once, besides its output gradient.

    Spatial BatchNorm (:class:`~.spatial.SpatialBatchNorm2d`): a product for the
    channel sums and the input gradient; PyTorch's fused kernel: the input
    gradient. A spatial convolution computed on its tile (the default): the
    input gradient and the kernel's reorder of the input; with ``bands`` (the
    plan's ``backward_bands``, :func:`~.windowed.backward_band`): the extended
    gradient, and per band a rebuilt slab, its gradient, the output gradient's
    band and the kernel's reorders (about four band-sized tensors); a small tile
    copied into an extended one: that tile, its gradient and the reorder. A spatial
    pool: the rebuilt extended tile, its gradient and the recomputed max-pool
    winners; a plain window op: the input gradient and a layout reorder.
    Pointwise layers: the input gradient. The bands are counted on the input's
    rows (a strided convolution has fewer output rows: at most one band fewer).
    """
    if kind.endswith("BatchNorm2d"):
        return 2 if spatial else 1
    if kind == "Conv2d" and spatial and len(in_shape) == 4:
        rows = int(in_shape[-2])
        count = -(-rows // backward_band(rows))
        if bands and count > 1:
            return 1 + 4 / count
        return 2
    if kind in ("Conv2d", "MaxPool2d", "AvgPool2d"):
        return 3 if spatial else 2
    return 1


def candidate_plan(candidate: Candidate) -> ParallelPlan:
    """The engine's plan for ``candidate``: its checks are the ones training applies (one place)."""
    return ParallelPlan(
        candidate.layout,
        microbatches=candidate.microbatches,
        schedule=cast(Schedule, candidate.schedule),
        balance=candidate.balance,
        checkpointing=candidate.checkpointing,
        streaming=candidate.streaming,
        backward_bands=candidate.backward_bands,
        halo_depth=candidate.halo_depth,
    )


@dataclass
class StageCost:
    """What one model stage costs per micro-batch on one tile, and what it holds (the
    planner's trace, or :mod:`.scaling`'s profile scaled to a tile)."""

    act: int  # kept for backward, halo strips included
    transient: int  # the backward's working set above ``act``
    params: int  # bytes
    units: list[int]  # FSDP2 units' parameter bytes
    out_bytes: int  # the boundary tensors it sends
    in_bytes: int  # the boundary tensors it receives, on its own tile (first stage: the image's)
    weight_grads: int  # gradients of the parameterised layers' outputs (kept from I to W)
    forward_s: float
    backward_s: float
    fwd: Counts = field(default_factory=Counts)  # one micro-batch's forward (stem: every pass)
    bwd: Counts = field(default_factory=Counts)  # its backward, recomputed forwards included
    halo_s: tuple[float, float] = (0.0, 0.0)  # exposed halo exchange, forward and backward
    norms_s: tuple[float, float] = (0.0, 0.0)  # BatchNorm statistics (and branch) all-reduces
    #: Per branched cell, the bytes its branch group sums per micro-batch (forward, backward),
    #: and what the stage sums once per step (branch gradients, op buffers): :mod:`.branches`.
    branch_sums: tuple[tuple[int, int], ...] = ()
    branch_sync: tuple[int, int] = (0, 0)


def predict(
    model: nn.Module,
    image_hw: tuple[int, int],
    batch: int,
    candidate: Candidate,
    *,
    optimizer: str = "sgd",
    flops_per_s: float = 1e12,
    bandwidth: float = 10e9,
    overhead: int | None = None,
    device: Device | None = None,
    overlap: bool = False,
    backward_bands: bool = False,
    cpu_kernels: bool | None = None,
) -> Prediction:
    """Predict the busiest rank's peak memory and the step time of ``candidate``.

    Raises ConfigError where training would refuse the candidate (the engine's own
    :meth:`~.engine.ParallelPlan.validate`). ``model`` is the single-device model (any device;
    a meta copy is traced); ``batch`` the per-replica batch. Step time (:mod:`.speed`): each
    layer's forward and backward counted on the meta device, on ``device`` (a row of
    :data:`~.speed.DEVICES` or :func:`~.speed.calibrate_cpu`; without one, a nominal device of
    ``flops_per_s`` and ``bandwidth`` whose bytes and kernels cost nothing), plus halo exchanges,
    BatchNorm statistics, stage-to-stage messages, FSDP2 and GEMS mirror traffic over its links,
    the pipeline replayed in the schedule's own order (:func:`~.schedules.simulate_orders`).
    ``overlap``: the runtime's ``overlap: true`` (a layer's interior computes while its halos
    travel); ``backward_bands``: its ``backward_bands: true`` (each spatial convolution's
    backward in bands of rows: a call per band). ``overhead`` is what the runtime allocates on a rank's first step besides tensors
    (kernel workspaces, communication threads); default :data:`RUNTIME_OVERHEAD` for the
    model's device type. ``cpu_kernels``: the layers run on the CPU, where a convolution in a
    dtype oneDNN does not take (float64) unfolds its input (:func:`~.memory.cpu_unfold_bytes`);
    default: when ``device`` is a CPU (not asynchronous) and the model is not on a GPU.
    """
    dev = device or nominal_device(flops_per_s, bandwidth)
    if cpu_kernels is None:
        cpu_kernels = not dev.asynchronous and not _on_cuda(model)
    lay, m, schedule = candidate.layout, candidate.microbatches, candidate.schedule
    plan = candidate_plan(candidate)
    plan.validate(model, batch)
    if lay.junction:
        check_pooled(model, image_hw, lay)
    balance, costs = _stage_costs(
        model,
        image_hw,
        batch // m,
        candidate,
        plan.stages,
        dev,
        (overlap, backward_bands or candidate.backward_bands, cpu_kernels),
    )
    n_stages = plan.stages
    if lay.br > 1:
        costs = _branch_costs(model, image_hw, batch // m, replace(candidate, balance=balance),
                              n_stages, dev, (overlap, backward_bands or candidate.backward_bands,
                              cpu_kernels))  # fmt: skip
    if overhead is None:
        overhead = RUNTIME_OVERHEAD["cuda" if _on_cuda(model) else "cpu"]
    k_opt = OPT_STATE.get(optimizer, 1)
    orders = schedule_actions(schedule, lay.pp, m)
    accumulates = lay.pp > 1 and (not lay.junction or m > 1)
    worst: Prediction | None = None
    peaks: list[int] = []
    for r in range(lay.pp):
        # FSDP2 shards a stage over the ranks that share it: its grid's tiles in every replica
        # (with per-stage grids, each stage its own: two mirrored replicas hold two grids on
        # one rank). A position's rank 0 holds every stage of the position: the busiest.
        mine = local_stages(schedule, lay.pp, r)
        act = peak_in_flight(
            orders[r], lambda _c, s: costs[s].act, lambda _c, s: costs[s].weight_grads
        )
        # A backward's working set counts with what is alive while *it* runs.
        transient = (
            peak_in_flight(
                orders[r],
                lambda _c, s: costs[s].act,
                lambda _c, s: costs[s].weight_grads,
                lambda _c, s: costs[s].transient,
            )
            - act
        )
        state = buffers = accumulated = 0
        for ls in mine:
            c = costs[ls.index]
            n_shard = lay.dp * lay.stage_size(ls.index)
            if n_shard > 1:
                gathered = c.params  # kept gathered from forward to backward (engine)
                state += (1 + k_opt) * c.params // n_shard + gathered + max(c.units, default=0)
                if accumulates:
                    # A pipeline holds every unit's unsharded gradients to the step's last
                    # backward (torch's PipelineStage: always; the junction: with m > 1),
                    # and reduce-scatters them there, one unit's copy at a time: past the
                    # activations, which are freed by then (measured on CPU, dp 2 x pp 2).
                    accumulated += c.params
            else:
                state += (1 + k_opt) * c.params
            own = [a for a in orders[r] if (a[0], a[1]) == (ls.replica, ls.index)]
            runs = sum(1 for a in own if a[2] == "F")  # micro-batches this copy runs
            flight = peak_in_flight(own, lambda _c, _s: 1)
            kinds = "".join(a[2] for a in own)
            backward_first = "F" in kinds.partition("B")[2]  # 1F1B-like: a backward, then a forward
            if ls.index == 0:
                # The per-replica batch arrives as one tensor: its micro-batches not in flight
                # (whose inputs the activations do not count) are held as well.
                buffers += c.in_bytes * max(0, m - flight)
            if ls.index < n_stages - 1:
                # Output-gradient receive buffers: torch's PipelineStage keeps one per
                # micro-batch; the junction's schedule only those in flight.
                buffers += c.out_bytes * (flight if lay.junction else runs)
            if ls.index > 0 and lay.junction and backward_first:
                # The junction's schedule sends an input gradient as pieces (copies) while the
                # next micro-batch runs (1F1B, not GPipe, whose peak comes before any backward):
                # that gradient and its pieces, besides the activations (measured on CPU).
                buffers += 2 * c.in_bytes
            elif ls.index > 0:
                # torch's PipelineStage keeps an input receive buffer per micro-batch (those in
                # flight are the saved inputs the activations count) and, 1F1B-like, holds an
                # input gradient until its send completes (measured on CPU, pp 2, m 2 and 4).
                buffers += c.in_bytes * (runs - flight + int(backward_first))
        held = sum(costs[ls.index].params // (lay.dp * lay.stage_size(ls.index)) for ls in mine)
        # At the step's end: gradients held unsharded until then (the activations are freed).
        transient = max(transient, accumulated - act)
        if schedule == "bidirectional":
            # The mirror sum concatenates both copies' gradient shards once the backward is done.
            transient = max(transient, held - act)
        pred = Prediction(candidate, tuple(balance), act, transient, state, buffers + overhead)
        peaks.append(pred.peak)
        if worst is None or pred.peak > worst.peak:
            worst = pred
    assert worst is not None
    worst.rank_peaks = tuple(peaks)
    worst.step_s, worst.bubble, worst.parts = step_time(costs, lay, m, schedule, dev, optimizer)
    worst.images_per_s = lay.dp * batch / worst.step_s
    return worst


def _branch_costs(
    model: nn.Module,
    image_hw: tuple[int, int],
    mb: int,
    candidate: Candidate,
    n_stages: int,
    dev: Device,
    modes: tuple[bool, bool, bool],
) -> list[StageCost]:
    """Each stage's costs on its busiest branch rank (``candidate.layout.br > 1``).

    Every branch rank ``b`` is traced as it runs alone (:func:`~.branches.rank_model`: the
    plan's own assignment, on the cut of the plain model); per stage, the rank with the most
    memory gives the memory and the slowest the time, plus its group's sums of every branched
    cell's output (forward) and fanned-out inputs' gradients (backward), blocking, over a link
    spanning the group. Each branch rank of a pipeline rank holds one branch rank's stages, so
    with one stage per rank this is that rank's; a cell waits for the group's slowest rank, so
    the time is a floor where the slowest rank differs from cell to cell.
    """
    lay = candidate.layout
    per_rank = [
        _stage_costs(rank_model(model, lay.br, b), image_hw, mb, candidate, n_stages, dev, modes)[1]
        for b in range(lay.br)
    ]
    link = dev.link(lay.br * math.prod(lay.sp))
    out = []
    for options in zip(*per_rank, strict=True):
        heavy = max(options, key=lambda c: (c.act + c.transient, c.weight_grads))
        slow = max(options, key=lambda c: c.forward_s + c.backward_s)
        sums = tuple(
            branch_allreduce_s(slow.branch_sums, lay.br, link, backward=back)
            for back in (False, True)
        )
        out.append(
            replace(
                heavy,
                forward_s=slow.forward_s + sums[0],
                backward_s=slow.backward_s + sums[1],
                fwd=slow.fwd,
                bwd=slow.bwd,
                halo_s=slow.halo_s,
                norms_s=(slow.norms_s[0] + sums[0], slow.norms_s[1] + sums[1]),
            )
        )
    return out


def step_time(
    costs: Sequence[StageCost],
    lay: Layout,
    microbatches: int,
    schedule: str,
    dev: Device,
    optimizer: str = "sgd",
) -> tuple[float, float, dict[str, float]]:
    """(step seconds, bubble, parts of the rank that waits longest outside the schedule).

    Every rank's order replayed with each stage's forward and backward seconds, plus the
    stage-to-stage message a stage waits for when its neighbour is on another rank (forward:
    its input; backward: the gradient it returns) -- the bytes its own tile receives; at a
    junction, its share of the whole feature map, which crosses once -- then FSDP2 and GEMS's
    mirror traffic where they do not overlap (:func:`_rank_time`).
    """
    m = microbatches
    orders = schedule_actions(schedule, lay.pp, m)
    n_stages = len(costs)
    comm_s, parts = -1.0, {}
    for r in range(lay.pp):
        mine = local_stages(schedule, lay.pp, r)
        rank_parts = _rank_time(orders[r], costs, mine, m, schedule, dev, optimizer, lay)
        if rank_parts["exposed"] > comm_s:
            comm_s, parts = rank_parts["exposed"], rank_parts
    # Chain A's placement (GEMS's chain B is its mirror: the same neighbours).
    owner = {
        ls.index: r
        for r in range(lay.pp)
        for ls in local_stages(schedule, lay.pp, r)
        if ls.replica == 0
    }
    world = placed_world_size(lay, schedule)
    replica = dev.link(world // lay.dp)  # a replica's ranks are consecutive
    p2p = [
        message_s(costs[s].in_bytes, replica) if s > 0 and owner[s] != owner[s - 1] else 0.0
        for s in range(n_stages)
    ]
    span, idle = simulate_orders(
        orders,
        n_stages,
        lambda s, kind: {
            "F": costs[s].forward_s + p2p[s],
            "B": costs[s].backward_s + p2p[s],
            "I": costs[s].backward_s / 2 + p2p[s],
            "W": costs[s].backward_s / 2,
        }[kind],
    )
    bubble = max(0.0, idle)  # rounding can leave -1e-16
    parts["p2p"] = sum(p2p) * 2 * m
    parts["bubble_s"] = bubble * span
    return span + comm_s, bubble, parts


def nominal_device(flops_per_s: float, bandwidth: float) -> Device:
    """A device of ``flops_per_s`` and one link of ``bandwidth`` bytes/s, whose memory-bound
    bytes, kernel launches and message latencies cost nothing: FLOPs and bytes sent only."""
    link = Link(bandwidth, 0.0)
    return Device(
        "nominal",
        flops=flops_per_s,
        mem_bw=math.inf,
        memory=0,
        op_overhead=0.0,
        asynchronous=True,
        intra=link,
        inter=link,
        per_node=1 << 30,
    )


def _rank_time(
    order: Sequence[tuple[int, int, str, int]],
    costs: Sequence[StageCost],
    mine: Sequence[LocalStage],
    microbatches: int,
    schedule: str,
    dev: Device,
    optimizer: str,
    lay: Layout,
) -> dict[str, float]:
    """One pipeline rank's step by part (see :attr:`Prediction.parts`); ``exposed`` is the
    communication outside the replayed schedule (FSDP2, GEMS's mirror sum).

    FSDP2 over ``n_shard`` ranks (a replica's ranks are consecutive, the shard group spans
    them all): with one micro-batch its hooks gather a unit's parameters once in forward
    (kept until backward: ``reshard_after_forward=False``) and reduce-scatter its gradient as soon as
    its backward is done, prefetching the next unit: only the first gather, the last
    reduction and what exceeds the compute wait. With micro-batches torch's schedules gather
    a stage once before its first and reduce after its last: nothing overlaps. Its copies
    (the gather's copy-in and split, the reduction's concatenation and shard) and the
    optimizer step are memory-bound work on the device.
    """
    stages = [costs[ls.index] for ls in mine]
    # FSDP2 shards a stage over the ranks that share it: its grid's tiles in every replica.
    # (Two mirrored replicas on per-stage grids: a rank's two stages on two grids.)
    by_shard: dict[int, int] = {}
    for ls, c in zip(mine, stages, strict=True):
        n = lay.dp * lay.stage_size(ls.index)
        by_shard[n] = by_shard.get(n, 0) + c.params
    n_shard = max(by_shard)
    sharded = sum(held / n for n, held in by_shard.items())
    total = Counts()
    halo = norms = 0.0
    for _c, s, kind, _i in order:
        c = costs[s]
        if kind == "F":
            total = total + c.fwd
            halo, norms = halo + c.halo_s[0], norms + c.norms_s[0]
        else:  # B, or I and W halves
            share = 1.0 if kind == "B" else 0.5
            total = total + c.bwd.times(share)
            halo, norms = halo + share * c.halo_s[1], norms + share * c.norms_s[1]
    params = sum(c.params for c in stages)
    gathers = 1  # parameters stay gathered from forward to backward (engine._shard)
    fsdp = 0.0
    world = placed_world_size(lay, schedule)
    if n_shard > 1:
        link = dev.link(world)
        units = [u for c in stages for u in c.units] or [params]
        total = total + Counts(bytes=2.0 * (gathers + 1) * (params + sharded))
        for u in units:  # new buffers: each gather's copy-in (its output and this rank's
            # shard), the unsharded parameters, the reduce-scatter's input and its shard
            total = (
                total
                + Counts.allocation(u, 2 * gathers + 1)
                + Counts.allocation(u / n_shard, gathers + 1)
            )
        moved = (gathers + 1) * sum(reduce_scatter_s(held, n, link) for n, held in by_shard.items())
        compute = compute_s(total, dev)
        if microbatches == 1:
            edge = reduce_scatter_s(units[0], n_shard, link) + reduce_scatter_s(
                units[-1], n_shard, link
            )
            # the first gather and the last reduce-scatter wait; the rest runs under compute
            fsdp = edge + max(0.0, moved - edge - compute)
        else:
            fsdp = moved
    total = total + Counts(bytes=float(OPT_BYTES.get(optimizer, 5) * sharded))
    mirror = 0.0
    if schedule == "bidirectional":
        mirror = allreduce_s(sharded, 2, dev.link(world // lay.dp))
    # The branch gradients (on FSDP2's shards) and op buffers, summed once per step (BranchSync).
    grads, bufs = (sum(c.branch_sync[k] for c in stages) for k in (0, 1))
    branch = allreduce_s(grads / n_shard + bufs, lay.br, dev.link(lay.br * math.prod(lay.sp)))
    busy = compute_s(total, dev)
    return {
        "busy": busy,
        "compute": busy,
        "halo": halo,
        "collectives": norms,
        "fsdp": fsdp,
        "mirror": mirror,
        "branch": branch,
        "exposed": fsdp + mirror + branch,
        "flops": total.flops,
        "pixel_flops": total.pixel_flops,
        "bytes": total.bytes,
        "ops": float(total.ops),
        "fresh_bytes": float(sum(total.fresh)),
        "fresh_s": fresh_s(total, dev),
    }


#: Stage costs already traced, per model (weakly: a model dropped drops its entries). The
#: candidates of one model share cuts, tiles and micro-batches across schedules and replicas.
_COSTS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[object, ...], object]] = (
    weakref.WeakKeyDictionary()
)


def _stage_costs(
    model: nn.Module,
    image_hw: tuple[int, int],
    mb: int,
    candidate: Candidate,
    n_stages: int,
    dev: Device,
    modes: tuple[bool, bool, bool],
) -> tuple[tuple[int, ...], list[StageCost]]:
    """The stage cut (``candidate.balance`` or one evening out memory) and each stage's costs.

    Read from one trace of the whole model per input shape (:func:`~.model_trace.trace_model`):
    a schedule, the data replicas and the checkpointing mode only change which stages a rank
    holds, in which order, and what the accounting keeps, not what a stage's layers do. Every
    stage is read on its own grid's tile (per-stage grids: ``rank_plan.stage_grids``), and
    each stage's costs are kept per (layers, tile, options) for the candidates that share them.
    """
    lay = candidate.layout
    grids = [lay.grid_of(s) if lay.junction else lay.sp for s in range(n_stages)]
    key = (image_hw, tuple(grids), mb, candidate.checkpointing, n_stages, candidate.balance,
           dev, modes, candidate.streaming, candidate.halo_depth)  # fmt: skip
    cache = _COSTS.setdefault(model, {})
    if key in cache:
        return cast(tuple[tuple[int, ...], list[StageCost]], cache[key])
    meta = meta_model(model, candidate.streaming, n_stages)  # a U-Net cut: its traced layers
    align = tile_alignment(model, len(image_hw), in_chans=meta.in_chans)

    def shape_of(grid: Sequence[int]) -> tuple[int, ...]:
        tile = TileGrid.padding(image_hw, grid, align).tile  # a 1x1 grid: the image
        return (mb, meta.in_chans, *tile)

    blocks = meta.blocks(candidate.checkpointing)
    policy = "selective" if candidate.checkpointing == "selective" else "full"
    deep = deep_layers(meta.module, candidate.checkpointing)

    def borders_of(grid: Sequence[int]) -> Borders:
        key = ("borders", tuple(grid), shape_of(grid), candidate.halo_depth, n_stages > 1)
        if key not in cache:
            tile = shape_of(grid)[2:]
            found = deep_borders(
                model, grid, tile, candidate.halo_depth, n_stages > 1, meta.in_chans
            )
            # The trace names a module by the layer holding it (a U-Net's one layer: "UNet.").
            path_of = {id(m): p for p, m in meta.module.named_modules()}
            traced = {
                path_of[id(m)]: f"{name}.{sub}" if sub else name
                for name, layer in meta.layers
                for sub, m in layer.named_modules()
                if id(m) in path_of
            }
            cache[key] = found.renamed(traced)
        return cast(Borders, cache[key])

    # The cut evens out per-rank memory: with per-stage grids, a stage's layers traced on the
    # whole image over its grid's tiles.
    first = (1, 1) if lay.junction else grids[0]
    shares = [math.prod(g) for g in grids] if lay.junction else None
    balance = candidate.balance or _memory_balance(
        model, candidate.streaming, n_stages, shape_of(first), shares
    )
    cuts = stage_bounds(balance)
    splits = stem_splits(meta.layers, [a for a, _ in cuts])
    costs = []
    for s, (start, stop) in enumerate(cuts):
        shape = shape_of(grids[s])
        stage_key = ("stage", shape, candidate.streaming, splits, start, stop,
                     candidate.checkpointing, grids[s], dev, modes, meta.traced,
                     candidate.halo_depth)  # fmt: skip
        if stage_key not in cache:
            facts_key = ("stage facts", candidate.streaming, start, stop, meta.traced)
            if facts_key not in cache:
                cache[facts_key] = _StageFacts.of(meta.layers[start:stop])
            whole = trace_model(model, shape, candidate.streaming, splits, n_stages)
            cache[stage_key] = _stage_cost(
                whole, start, stop, cast(_StageFacts, cache[facts_key]), blocks, policy,
                grids[s], dev, modes, deep, borders_of(grids[s]),
            )  # fmt: skip
        costs.append(cast(StageCost, cache[stage_key]))
    cache[key] = (tuple(balance), costs)
    return tuple(balance), costs


@dataclass
class _StageFacts:
    """What a stage's layers are, whatever its input: read once per cut, not per tile."""

    modules: dict[str, nn.Module]  # by the path a stage's trace names
    dtype: torch.dtype
    params: int  # bytes
    units: list[int]  # FSDP2 units' parameter bytes
    weighted: frozenset[str]  # paths of the modules holding parameters of their own
    passes: dict[str, int]  # a streamed stem's layers: passes per forward

    @staticmethod
    def of(layers: Sequence[tuple[str, nn.Module]]) -> _StageFacts:
        stage = StageModule(layers)
        modules = dict(stage.named_modules())
        stem = next((r for m in stage.children() if isinstance(r := chain_run(m), Stem)), None)
        return _StageFacts(
            modules=modules,
            dtype=next((p.dtype for p in stage.parameters()), torch.float32),
            params=sum(p.numel() * p.element_size() for p in stage.parameters()),
            units=_unit_sizes(stage),
            weighted=frozenset(
                path
                for path, m in modules.items()
                if any(True for _ in m.parameters(recurse=False))
            ),
            passes={path: stem.passes for path in stem.paths} if stem is not None else {},
        )


def _stage_cost(
    whole: ModelTrace,
    start: int,
    stop: int,
    facts: _StageFacts,
    blocks: Sequence[str],
    policy: str,
    grid: Sequence[int],
    dev: Device,
    modes: tuple[bool, bool, bool],
    deep: Sequence[str] = (),
    borders: Borders | None = None,
) -> StageCost:
    """Memory and time of the stage of layers ``start:stop`` on one micro-batch's tile, read
    from ``whole`` (the model traced on that tile); ``modes``: the runtime's ``(overlap,
    backward_bands)``, and whether it runs on the CPU; ``deep``: the layers ``checkpointing:
    deep`` runs as deep chains (:func:`~.pipeline.deep_layers`); ``borders``: the deep halos'
    runs (:mod:`.deep_borders`), whose carried borders the stage's tensors keep."""
    overlap, banded, on_cpu = modes
    layers = whole.layers
    trace, held = whole.stage_held(start, stop)  # held: boundary tensors no layer saves
    if borders:
        trace = deepen(trace, borders, facts.modules)
    block_layer = {b: layer_of(layers, b) for b in blocks}
    mine = [b for b in blocks if (at := block_layer[b]) is not None and start <= at < stop]
    spatial = any(g > 1 for g in grid)
    weighted = facts.modules
    unfolds = [
        cpu_unfold_bytes(weighted[path], shape, facts.dtype) if on_cpu and path in weighted else 0
        for path, _, _, _, shape in trace.calls
    ]
    chains = {layer: [b for b in mine if b.startswith(layer + ".")] for layer in deep}
    in_deep = [b for chain in chains.values() for b in chain]
    units = {
        b: {f"{b}.{name}" for name in starts}
        for b in in_deep
        if (starts := getattr(facts.modules[b], "unit_starts", ()))
    }
    act, transient = _stage_memory(
        trace, mine, policy, spatial=spatial, bands=banded, workspaces=unfolds,
        replayed={b for chain in chains.values() for b in chain[1:]}, units=units,
    )  # fmt: skip
    strips = _strips(weighted, trace, grid, borders)
    # Each layer's forward and backward counted on the meta device (:mod:`.speed`), one by one
    # (a streamed stem's layers too: they run plainly once per pass), plus the forward again
    # for recomputed blocks (convolutions kept by selective checkpointing are not recomputed:
    # a half). A streamed stem runs its layers once per pass in forward and again per pass in
    # backward. A deep chain of n blocks computes block inputs again, n (n - 1) / 2 blocks
    # (each taken as 1/n of the layer), and blocks with units run once more again.
    passes = facts.passes
    fwd = bwd = Counts()
    for i, (name, _) in enumerate(layers[start:stop], start=start):
        f, b = whole.counted[name]
        redo = any(block_layer[bl] == i for bl in mine)
        again = ((1.0 if policy == "full" else 0.5) if redo else 0.0) + passes.get(name, 0)
        if name in chains:
            again += (len(chains[name]) - 1) / 2 + (1.0 if units else 0.0)
        fwd = fwd + f.times(passes.get(name, 1))
        bwd = bwd + b + f.times(again)
    halo = norms = (0.0, 0.0)
    if spatial:
        ops = whole.stage_ops(start, stop)
        link = dev.link(math.prod(grid))
        copies = Counts(bytes=halo_copy_bytes(ops.windows, grid))
        # ``backward_bands``: a spatial convolution's backward runs in bands of rows
        # (:func:`~.windowed.backward_band`): one more call per band, each with its fixed cost
        # (and a few kernels of bookkeeping).
        bands = Counts()
        for w in ops.windows if banded else ():
            rows = int(w.shape[-2]) if len(w.shape) >= 4 else 1
            extra = -(-rows // backward_band(rows)) - 1 if w.pixel_flops else 0
            bands = bands + Counts(ops=4 * extra, pixel_flops=2 * extra * w.pixel_flops)
        fwd, bwd = fwd + copies, bwd + copies + bands
        halo = tuple(
            halo_s(ops.windows, grid, link, dev, overlap=overlap, backward=back)
            for back in (False, True)
        )  # type: ignore[assignment]
        norms = tuple(
            norm_allreduce_s(ops.norms, math.prod(grid), link, backward=back)
            for back in (False, True)
        )  # type: ignore[assignment]
    bounds = whole.boundaries
    return StageCost(
        act=act + strips + held,
        transient=transient,
        params=facts.params,
        units=list(facts.units),
        out_bytes=sum(t.numel() * t.element_size() for t in bounds[stop]),
        in_bytes=sum(t.numel() * t.element_size() for t in bounds[start]),
        weight_grads=sum(out for path, _, _, out, _ in trace.calls if path in facts.weighted),
        forward_s=compute_s(fwd, dev) + halo[0] + norms[0],
        backward_s=compute_s(bwd, dev) + halo[1] + norms[1],
        fwd=fwd,
        bwd=bwd,
        halo_s=halo,
        norms_s=norms,
        branch_sums=tuple(whole.stage_ops(start, stop).branch_sums),
        branch_sync=sync_bytes(facts.modules.values()),
    )


def measure_rate(model: nn.Module, device: torch.device, *, side: int = 128) -> float:
    """FLOP/s this device reaches on ``model``'s forward+backward (one probe, after a warm-up)."""
    probe = copy.deepcopy(model).to(device).train()
    align = tile_alignment(model)
    side = max(side, 2 * align) // align * align
    x = torch.randn(1, int(getattr(probe, "in_chans", 3)), side, side, device=device)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        probe(x)
    flops = 3.0 * counter.get_total_flops()
    best = math.inf
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        probe(x).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - began)
    return flops / best


def _on_cuda(model: nn.Module) -> bool:
    return any(p.is_cuda for p in model.parameters())


def _unit_sizes(stage: nn.Module) -> list[int]:
    """Parameter bytes of each FSDP2 unit of the stage, as :func:`~.sharding.shard_units` cuts it.

    (Tile and head parameters are not told apart here: registry models keep
    the head in top-level layers of its own, so the cut is the same.)
    """
    return [n for _, _, _, n in shard_units(stage, None)]


def _memory_balance(
    model: nn.Module,
    streaming: str,
    pp: int,
    shape: tuple[int, ...],
    shares: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """A cut that evens out what each stage keeps (saved activations + parameters) per rank.

    ``shape`` is the traced input; ``shares`` the ranks each stage's cost is spread over (per-stage
    grids: its tiles, with ``shape`` the whole image), default one."""
    meta = meta_model(model, streaming, pp)
    layers = meta.layers
    if pp == 1:
        return (len(layers),)
    saved = saved_trace(model, shape, streaming, stages=pp).by_layer()
    cost = {n: float(saved.get(n, 0)) for n, _ in layers}
    for name, layer in layers:
        cost[name] += 4 * sum(p.numel() * p.element_size() for p in layer.parameters())
    return partition([cost[n] for n, _ in layers], pp, shares=shares)


def check_pooled(model: nn.Module, image_hw: tuple[int, int], layout: Layout) -> None:
    """The engine's check that a model with per-stage grids has a pooled output (ConfigError)."""
    from hyfi_imaging.parallel.apply import output_shape

    cache = _COSTS.setdefault(model, {})
    key = ("output shapes", image_hw)  # traced once per model and image, not per candidate
    if key not in cache:
        meta = meta_model(model)  # the planner's meta copy: no copy per image size
        c = meta.in_chans
        h, w = image_hw
        cache[key] = (
            output_shape(meta.module, (1, c, h, w)) or (),
            output_shape(meta.module, (1, c, max(1, h // 2), max(1, w // 2))) or (),
        )
    whole, half = cast(tuple[tuple[int, ...], tuple[int, ...]], cache[key])
    check_junction_model(layout, whole, half)
