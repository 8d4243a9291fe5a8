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
  (``selective``). Multiplied by the micro-batches in flight (GPipe: all of
  them; 1F1B: ``pp - stage``).
* **backward transient**: walking backward, the activations still kept plus
  the gradients being computed (output, input and the rebuilt extended tile of
  the layer at hand), and a checkpointed block's recomputed internals; the
  maximum over layers.
* **state**: gradients and optimizer state, ``1/(dp x sp)`` of the stage's
  under FSDP2 plus the gathered parameters and unsharded gradients of the
  units in flight; whole without sharding.
* **buffers**: pipeline gradient buffers of the stage boundaries, and the
  runtime's own first-step allocations (:data:`RUNTIME_OVERHEAD`).

Step time: forward + backward FLOPs of the busiest stage per micro-batch (the
forward again for recomputed blocks) over the measured rate, times
``(m + pp - 1)`` micro-batch slots for a pipeline, plus halo and FSDP2 traffic
over ``bandwidth``. It ranks layouts; it is not a promise of wall time.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models.registry import CheckpointedBlock
from hyfi_imaging.parallel.balance import partition
from hyfi_imaging.parallel.geometry import layer_geom, padded_hw
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.memory import SavedActivations, saved_activations
from hyfi_imaging.parallel.pipeline import (
    StageModule,
    model_layers,
    set_checkpointing,
    stage_boundaries,
    stage_bounds,
)
from hyfi_imaging.parallel.sharding import shard_units

__all__ = [
    "Candidate",
    "Prediction",
    "candidates",
    "device_memory",
    "measure_rate",
    "predict",
    "rank",
]

#: Bytes a rank's runtime allocates on its first training step besides tensors.
#: On CPU the anonymous part measures ~0 with ``tests/mpi/plan_accuracy.py``
#: (the 15-30 MiB of library code paged in on the first step is file-backed and
#: reclaimable, and depends on the CPU and page cache, so it is not counted);
#: on CUDA the context and the caching allocator's slack.
RUNTIME_OVERHEAD = {"cpu": 0, "cuda": 512 * 2**20}
#: Optimizer state tensors per parameter.
OPT_STATE = {"sgd": 1, "adamw": 2}
CHECKPOINTING = ("none", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    """One way to run: layout, micro-batches, schedule, checkpointing, stage cut."""

    layout: Layout
    microbatches: int = 1
    checkpointing: str = "none"
    schedule: str = "gpipe"
    balance: tuple[int, ...] | None = None

    def describe(self) -> str:
        return (
            f"{self.layout.describe()}, m={self.microbatches} {self.schedule}, "
            f"ckpt {self.checkpointing}"
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

    @property
    def peak(self) -> int:
        return self.activations + self.transient + self.state + self.buffers


def tile_hw(image_hw: tuple[int, int], grid: tuple[int, int], align: int) -> tuple[int, int]:
    """The padded tile every rank holds (the geometry module's rule)."""
    ph, pw = padded_hw(image_hw, grid, align)
    return ph // grid[0], pw // grid[1]


def _in_block(path: str, blocks: Sequence[str]) -> str | None:
    return next((b for b in blocks if path == b or path.startswith(b + ".")), None)


def _strips(model: nn.Module, trace: SavedActivations, grid: tuple[int, int]) -> int:
    """Bytes of halo strips the busiest rank receives for every windowed layer."""
    if grid == (1, 1):
        return 0
    modules = dict(model.named_modules())
    total = 0
    for path, _, nbytes, _, shape in trace.calls:
        m = modules.get(path)
        if not isinstance(m, nn.Conv2d | nn.MaxPool2d | nn.AvgPool2d) or len(shape) != 4:
            continue
        side: list[int] = []
        for g, tiles in zip(layer_geom(m, shape[-2:]), grid, strict=True):
            before, after = g.padding, max(0, g.extent - g.padding - g.stride)
            side.append(0 if tiles == 1 else before + after if tiles > 2 else max(before, after))
        h, w = shape[-2:]
        rows, cols = side
        total += nbytes * (rows * w + cols * (h + rows)) // max(1, h * w)
    return total


def _stage_memory(
    trace: SavedActivations, blocks: Sequence[str], policy: str, *, spatial: bool
) -> tuple[int, int]:
    """(kept activations, backward transient above them) of one micro-batch of a stage."""
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
    for b, i in first_call.items():
        _, key, nbytes, _, _ = trace.calls[i]
        if key not in kept_keys:
            kept.append((i, nbytes))
        if policy == "selective":
            kept += [
                (j, out)
                for j, (path, _, _, out, _) in enumerate(trace.calls)
                if _in_block(path, [b]) and kinds.get(path) == "Conv2d"
            ]
    total = sum(n for _, n in kept)
    peak = 0
    for i, (path, _, in_bytes, out_bytes, _) in enumerate(trace.calls):
        b = _in_block(path, blocks)
        if b is None:
            base = sum(n for pos, n in kept if pos <= i)
        else:  # inside a recomputed block: its internals up to here are back
            start = first_call[b]
            base = sum(n for pos, n in kept if pos <= start)
            base += sum(n for pos, n, bb in items if bb == b and pos <= i)
        peak = max(
            peak, base + out_bytes + _transient_factor(kinds.get(path, ""), spatial) * in_bytes
        )
    return total, max(0, peak - total)


def _transient_factor(kind: str, spatial: bool) -> int:
    """Input-sized tensors a layer's backward holds at once, besides its output gradient.

    Spatial BatchNorm (:class:`~.spatial.SpatialBatchNorm2d`): a product for the
    channel sums and the input gradient; PyTorch's fused kernel: the input
    gradient. A spatial window op: the rebuilt extended tile and its gradient
    (reduced in place), and the recomputed max-pool winners; a plain one: the
    input gradient and a layout reorder. Pointwise layers: the input gradient.
    """
    if kind.endswith("BatchNorm2d"):
        return 2 if spatial else 1
    if kind in ("Conv2d", "MaxPool2d", "AvgPool2d"):
        return 3 if spatial else 2
    return 1


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
) -> Prediction:
    """Predict per-rank peak memory and step time of ``candidate`` (ConfigError if it cannot run).

    ``model`` is the single-device model (any device; a meta copy is traced);
    ``batch`` the per-replica batch. Step time: FLOPs counted on the meta
    device at ``flops_per_s`` (see :func:`measure_rate`), halo and FSDP2
    traffic at ``bandwidth`` bytes/s.
    ``overhead`` is what the runtime allocates on a rank's first step besides
    tensors (kernel workspaces, communication threads); default
    :data:`RUNTIME_OVERHEAD` for the model's device type.
    """
    lay, m = candidate.layout, candidate.microbatches
    if batch % m:
        raise ConfigError(
            f"batch {batch}", f"does not split into {m} micro-batches", "pick a divisor"
        )
    meta = copy.deepcopy(model).to("meta")
    dtype = next((p.dtype for p in meta.parameters()), torch.float32)
    in_chans = int(getattr(meta, "in_chans", 3))
    align = int(getattr(meta, "total_stride", 1))
    tile = tile_hw(image_hw, lay.sp, align) if lay.sp_size > 1 else image_hw
    mb = batch // m
    blocks = set_checkpointing(meta, candidate.checkpointing)
    policy = "selective" if candidate.checkpointing == "selective" else "full"
    for blk in meta.modules():  # traced plainly; the accounting above models the recompute
        if isinstance(blk, CheckpointedBlock):
            blk.grad_checkpointing = False
    layers = model_layers(meta)
    balance = candidate.balance or _memory_balance(meta, layers, lay.pp, (mb, in_chans, *tile))
    bounds = stage_boundaries(meta, balance, (mb, in_chans, *tile), dtype=dtype)
    n_shard = lay.dp * lay.sp_size
    k_opt = OPT_STATE.get(optimizer, 1)
    worst: Prediction | None = None
    stage_s: list[float] = []
    for s, (start, stop) in enumerate(stage_bounds(balance)):
        stage = StageModule(layers[start:stop], index=s)
        # A received activation: requires grad from stage 1 on; a non-leaf, so a stage
        # may start with an in-place op (the engine runs that one out of place).
        ins = tuple(
            t.detach().requires_grad_(True).clone() if s > 0 else t.detach() for t in bounds[s]
        )
        trace = saved_activations(stage, partial(stage, *ins))
        names = {n for n, _ in layers[start:stop]}
        mine = [b for b in blocks if b.split(".")[0] in names]
        act, transient = _stage_memory(trace, mine, policy, spatial=lay.sp_size > 1)
        act += _strips(stage, trace, lay.sp)
        flight = m if candidate.schedule == "gpipe" else min(m, lay.pp - s)
        params = sum(p.numel() * p.element_size() for p in stage.parameters())
        units = _unit_sizes(stage)
        if n_shard > 1:
            gathered = params if m > 1 else 2 * max(units, default=0)
            state = (1 + k_opt) * params // n_shard + gathered + max(units, default=0)
        else:
            state = (1 + k_opt) * params
        out_bytes = sum(t.numel() * t.element_size() for t in bounds[s + 1])
        buffers = out_bytes * flight if s < lay.pp - 1 else 0
        if overhead is None:
            overhead = RUNTIME_OVERHEAD["cuda" if _on_cuda(model) else "cpu"]
        pred = Prediction(
            candidate, tuple(balance), act * flight, transient, state, buffers + overhead
        )
        if worst is None or pred.peak > worst.peak:
            worst = pred
        # Time of one micro-batch on this stage: forward + backward (2x forward)
        # FLOPs, plus the forward of recomputed blocks again (convolutions kept
        # by selective checkpointing are not recomputed: count a sixth).
        flops = _layer_flops(stage, ins)
        sec = 0.0
        for name, f in flops.items():
            redo = any(b.split(".")[0] == name for b in mine)
            sec += f * (3 + ((1.0 if policy == "full" else 0.5) if redo else 0.0))
        comm = 2 * _strips(stage, trace, lay.sp) / bandwidth
        if n_shard > 1:
            comm += 3 * params * (n_shard - 1) / n_shard / bandwidth
        stage_s.append(sec / flops_per_s + comm)
    assert worst is not None
    worst.step_s = (m + lay.pp - 1) * max(stage_s)
    worst.images_per_s = lay.dp * batch / worst.step_s
    return worst


def _layer_flops(stage: nn.Module, inputs: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """Forward FLOPs of each top-level layer of ``stage`` on ``inputs`` (meta device)."""
    counter = FlopCounterMode(display=False)
    with counter:  # grad mode on: its module tracker needs outputs with a grad_fn
        stage(*(t.detach() for t in inputs))
    per_module = counter.get_flop_counts()
    out = {}
    for name, _ in stage.named_children():
        key = f"{type(stage).__name__}.{name}"
        out[name] = float(sum(per_module.get(key, {}).values()))
    return out


def measure_rate(model: nn.Module, device: torch.device, *, side: int = 128) -> float:
    """FLOP/s this device reaches on ``model``'s forward+backward (one probe, after a warm-up)."""
    probe = copy.deepcopy(model).to(device).train()
    align = int(getattr(probe, "total_stride", 1))
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
    meta: nn.Module, layers: list[tuple[str, nn.Module]], pp: int, shape: tuple[int, ...]
) -> tuple[int, ...]:
    """A cut that evens out what each stage keeps (saved activations + parameters)."""
    if pp == 1:
        return (len(layers),)
    dtype = next((p.dtype for p in meta.parameters()), torch.float32)
    x = torch.empty(shape, dtype=dtype, device="meta")
    trace = saved_activations(meta, lambda: meta(x))
    cost = dict.fromkeys((n for n, _ in layers), 0.0)
    for _, owner, nbytes, _ in trace.storages:
        top = owner.split(".")[0]
        if top in cost:
            cost[top] += nbytes
    for name, layer in layers:
        cost[name] += 4 * sum(p.numel() * p.element_size() for p in layer.parameters())
    return partition([cost[n] for n, _ in layers], pp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    model: nn.Module, image_hw: tuple[int, int], devices: int, batch: int
) -> Iterator[Candidate]:
    """Every layout of ``devices`` ranks worth predicting for this model and image."""
    n_layers = len(model_layers(model))
    align = int(getattr(model, "total_stride", 1))
    for dp in _divisors(devices):
        for pp in _divisors(devices // dp):
            if pp > n_layers:
                continue
            sp = devices // dp // pp
            for gy in _divisors(sp):
                grid = (gy, sp // gy)
                try:
                    tile = tile_hw(image_hw, grid, align)
                except ConfigError:
                    continue
                if sp > 1 and min(tile) < 2 * align:
                    continue  # tiles of one pixel at the deepest layer: no room for halos
                for m in _divisors(batch):
                    schedules = (
                        ["gpipe"] if pp == 1 else ["gpipe", "1f1b"] if m >= pp else ["gpipe"]
                    )
                    for schedule in schedules:
                        for ck in CHECKPOINTING:
                            yield Candidate(Layout(dp=dp, pp=pp, sp=grid), m, ck, schedule)


def rank(predictions: Sequence[Prediction], memory: float) -> list[Prediction]:
    """Fitting layouts first (fastest per device, then smallest), then the rest by peak."""
    fit = [p for p in predictions if p.peak <= memory]
    rest = [p for p in predictions if p.peak > memory]
    per_device = lambda p: p.images_per_s / p.candidate.layout.world_size  # noqa: E731
    fit.sort(key=lambda p: (-per_device(p), p.peak))
    rest.sort(key=lambda p: p.peak)
    return fit + rest


def device_memory(devices: int) -> int:
    """Bytes of one device: this machine's GPU, or its RAM shared by ``devices`` ranks."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(ram) // max(1, devices)
