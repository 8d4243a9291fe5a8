"""How long a step takes on a device: counted work over documented device figures.

Why counts and a table, not a timing here: the layouts worth asking about run on
GPUs this machine does not have, so a step time measured here says nothing about
them (``hyfi-plan`` used to divide GPU layouts' FLOPs by this CPU's rate). What
carries over is what a step *does*, counted exactly on the meta device, and what a
device does per second, written down once per device (:data:`DEVICES`) or, for this
CPU, measured by a short calibration (:func:`calibrate_cpu`, cached). The step time
is then arithmetic, which ``tests/test_speed_model.py`` checks on a hand-computed case
and ``benchmarks/bench_speed_model.py`` against measured CPU time.

What a step costs (per rank, per micro-batch and pass):

* **compute** (:func:`compute_s`): the FLOPs of convolutions and matrix products
  (``torch.utils.flop_counter``'s registry) at :attr:`Device.flops`, plus the bytes
  every other op reads and writes (elementwise, normalisation, pooling, copies:
  memory-bound on every device here) at :attr:`Device.mem_bw`, plus
  :attr:`Device.op_overhead` per kernel, plus the new buffers' first touch by size
  (:func:`fresh_s`: a CPU's page faults, measured; none on a GPU). Counted by
  :class:`OpCounter`, one layer at a time in forward and backward
  (:func:`count_chain`). On a GPU the host launches kernels ahead of the device, so a
  layer costs the larger of its device time and its launches; on a CPU they add up.
* **messages** (:func:`message_s`): each message's latency plus its bytes over the
  link's bandwidth; a link within a node (NVLink) or across nodes (InfiniBand),
  :meth:`.devices.Device.link`. Collectives as their standard algorithms:
  :func:`allreduce_s` (ring bandwidth term, tree latency term),
  :func:`reduce_scatter_s` / all-gather.
* **halo exchange** (:func:`halo_s`): per windowed layer, one phase per split axis
  (rows, then columns of the row-extended tile, as :mod:`.halo` sends them); the
  two sides of a phase travel at once. Backward returns the same strips. Copies:
  the strips themselves (sent strips made contiguous, received ones placed), read
  and written (:func:`halo_copy_bytes`); the copy-lean path's floor, which is what
  the speed issue's windowed path targets.
* **overlap**, credited only where the runtime overlaps: with ``overlap: true`` a
  windowed layer computes its interior while its halos travel (exposed: what the
  messages take beyond that compute); FSDP2 prefetches the next unit's all-gather
  and reduce-scatters a unit's gradient while backward goes on (exposed: the first
  gather, the last reduction, and whatever exceeds the compute). Everything else --
  BatchNorm's statistics all-reduces, pipeline messages, the halo exchange without
  ``overlap`` -- waits.
* **bubble**: the schedule's own order replayed with these costs
  (:func:`~.schedules.simulate_orders`); for equal stages that is GPipe's and 1F1B's
  ``(p - 1) / (m + p - 1)`` idle share, which two mirrored replicas (GEMS) about halve
  (:func:`ideal_bubble`).

Where the figures are not calibrated (GPUs): the sustained rates are the datasheet
peak times an efficiency (:mod:`.devices`), an assumption stated as such. Every figure
can be overridden on the command line (``hyfi-plan --flops --mem-bw --link-bw ...``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

if TYPE_CHECKING:
    from hyfi_imaging.parallel.devices import Device, Link

__all__ = [
    "COPY_OPS",
    "FRESH_CLASSES",
    "Counts",
    "OpCounter",
    "SpatialOps",
    "Window",
    "allreduce_s",
    "branch_allreduce_s",
    "compute_s",
    "count_chain",
    "fresh_class",
    "fresh_s",
    "halo_copy_bytes",
    "halo_s",
    "ideal_bubble",
    "message_s",
    "reduce_scatter_s",
    "norm_allreduce_s",
    "spatial_ops",
]

# ----------------------------------------------------------------------------- counting


#: Fresh buffers by size class: class ``i`` holds buffers of ``[2^(i+12), 2^(i+13))`` bytes (the
#: first also every smaller one, the last every larger one). On a CPU a buffer's first touch
#: costs page faults that depend on its size (the heap's reused memory below glibc's mmap
#: threshold, 4 KiB pages above it, huge pages from 2 MiB with ``THP_MEM_ALLOC_ENABLE``):
#: :attr:`Device.fresh_s` is what one byte of each class costs, measured.
FRESH_CLASSES = 20


def fresh_class(nbytes: float) -> int:
    """The size class of a fresh buffer of ``nbytes`` (see :data:`FRESH_CLASSES`)."""
    if nbytes < 2**13:
        return 0
    return min(FRESH_CLASSES - 1, int(math.log2(nbytes)) - 12)


def _fresh_add(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
    if not b:
        return a
    if not a:
        return b
    return tuple(x + y for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class Counts:
    """Work of some ops: ``flops`` of convolutions and matrix products, ``bytes`` read plus
    written by every other op (``copy_bytes`` of which by copy-like ops), ``ops`` kernels,
    ``pixel_flops``: the FLOPs of *one output pixel* of each convolution or matrix-product
    call, summed over the calls (a call's fixed cost is :attr:`Device.px_half` pixels' worth),
    and ``fresh``: bytes of the new buffers the ops allocated, by size class
    (:data:`FRESH_CLASSES`; empty: none).
    """

    flops: float = 0.0
    bytes: float = 0.0
    copy_bytes: float = 0.0
    ops: int = 0
    pixel_flops: float = 0.0
    fresh: tuple[float, ...] = ()

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.flops + other.flops,
            self.bytes + other.bytes,
            self.copy_bytes + other.copy_bytes,
            self.ops + other.ops,
            self.pixel_flops + other.pixel_flops,
            _fresh_add(self.fresh, other.fresh),
        )

    @classmethod
    def allocation(cls, nbytes: float, count: float = 1.0) -> Counts:
        """``count`` fresh buffers of ``nbytes`` each (nothing else)."""
        if nbytes <= 0 or count <= 0:
            return cls()
        fresh = [0.0] * FRESH_CLASSES
        fresh[fresh_class(nbytes)] = nbytes * count
        return cls(fresh=tuple(fresh))

    def scaled(self, k: float) -> Counts:
        """The same calls on ``k`` times the pixels: FLOPs and bytes scale, calls do not (each
        fresh buffer is ``k`` times larger: its size class moves by ``log2 k``)."""
        fresh = [0.0] * FRESH_CLASSES if self.fresh else []
        shift = round(math.log2(k)) if k > 0 else 0
        for i, b in enumerate(self.fresh):
            fresh[min(FRESH_CLASSES - 1, max(0, i + shift))] += b * k
        return Counts(
            self.flops * k,
            self.bytes * k,
            self.copy_bytes * k,
            self.ops,
            self.pixel_flops,
            tuple(fresh),
        )

    def times(self, n: float) -> Counts:
        """The work run ``n`` times (calls too)."""
        return Counts(
            self.flops * n,
            self.bytes * n,
            self.copy_bytes * n,
            round(self.ops * n),
            self.pixel_flops * n,
            tuple(b * n for b in self.fresh),
        )


#: Ops that move bytes without arithmetic (their bytes are also reported apart).
COPY_OPS = frozenset(
    {"copy_", "clone", "_to_copy", "cat", "stack", "constant_pad_nd", "fill_", "zero_",
     "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full", "scatter",
     "scatter_", "scatter_add", "scatter_add_", "index_put_", "index_copy", "slice_scatter",
     "select_scatter", "as_strided_scatter", "contiguous"}
)  # fmt: skip
#: Ops that only write their output (nothing read).
_WRITE_ONLY = frozenset(
    {"fill_", "zero_", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones",
     "new_full", "zeros", "ones", "full", "randn_like", "rand_like", "bernoulli_"}
)  # fmt: skip
#: Ops that cost nothing on a device: allocation, scalars, metadata.
_FREE = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
     "_local_scalar_dense", "is_nonzero", "lift_fresh", "set_", "resize_", "_has_compatible_shallow_copy_type"}
)  # fmt: skip
#: Of those, the ones that allocate (their buffer's pages are paid when first written).
_ALLOCATING = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, list | tuple):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _conv_backward_flops(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *rest: Any
) -> float:
    """FLOPs of ``aten.convolution_backward``: the forward's for each gradient it computes.

    Not torch's ``flop_registry`` entry: on torch 2.13 it ignores ``groups`` there (a
    depthwise 3x3 over 128 channels counts 1.2 GFLOP for 19 MFLOP), which inflated
    AmoebaNet's separable convolutions ~60-fold."""
    transposed, mask = bool(rest[4]), rest[-1]
    per_out = int(weight.shape[1]) * math.prod(int(k) for k in weight.shape[2:])
    outputs = x.numel() if transposed else grad_out.numel()
    return 2.0 * outputs * per_out * (int(bool(mask[0])) + int(bool(mask[1])))


def _pixels(out: Any) -> int:
    """Output pixels of a convolution (batch x spatial) or rows of a matrix product."""
    t = out[0] if isinstance(out, tuple | list) else out
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return 1
    if t.dim() >= 3:  # (n, c, *spatial)
        return t.numel() // max(1, int(t.shape[1]))
    return t.numel() // max(1, int(t.shape[-1]))


class OpCounter(TorchDispatchMode):
    """Adds up :class:`Counts` of every aten op run inside it (works on the meta device).

    A view (an op whose outputs alias its inputs without writing) costs nothing; an
    allocation only its buffer (:attr:`Counts.fresh`). A convolution or matrix product
    (``flop_registry``) counts its FLOPs and its FLOPs per output pixel (its weights'
    traffic, constant per call, is in the call's fixed cost, :attr:`Device.px_half`); any
    other op the bytes of its distinct input and output tensors (an in-place op's tensor read
    and written, a fill's only written). Every op whose schema returns new tensors (no alias)
    adds their buffers to :attr:`Counts.fresh`; kernels' internal workspaces are not seen
    (they are part of the calibrated rates).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts = Counts()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        rets = func._schema.returns
        fresh = Counts()
        # c10d's collectives return the buffers they were given, without an alias annotation.
        if rets and all(r.alias_info is None for r in rets) and func.namespace != "c10d":
            for t in _tensors(out):
                fresh = fresh + Counts.allocation(_nbytes(t))
        if name in _FREE:
            if name in _ALLOCATING:
                self.counts = self.counts + fresh
            return out
        if rets and all(r.alias_info is not None and not r.alias_info.is_write for r in rets):
            return out  # a view
        packet = func.overloadpacket
        if name == "convolution_backward" or packet in flop_registry:
            if name == "convolution_backward":
                flops = _conv_backward_flops(*args)
                pixels = _pixels(args[0])  # the forward's output
            else:
                flops = flop_registry[packet](*args, **kwargs, out_val=out)
                pixels = _pixels(out)
            per_pixel = float(flops) / max(1, pixels)
            work = Counts(flops=float(flops), ops=1, pixel_flops=per_pixel)
            self.counts = self.counts + work + fresh
            return out
        seen: set[int] = set()
        total = 0
        ins = [] if name in _WRITE_ONLY else _tensors(args) + _tensors(kwargs)
        for t in ins + _tensors(out):
            key = id(t)
            if key not in seen:
                seen.add(key)
                total += _nbytes(t)
        copy = total if name in COPY_OPS else 0
        work = Counts(bytes=float(total), copy_bytes=float(copy), ops=1)
        self.counts = self.counts + work + fresh
        return out


def _detached(x: Any, grad: bool, leaves: list[torch.Tensor]) -> Any:
    """``x`` cut from its graph; floating tensors that need a gradient become leaves (listed in
    ``leaves``) seen through a clone, so that a layer may start with an in-place op."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if not (grad and t.is_floating_point()):
            return t
        leaves.append(t.requires_grad_(True))
        return t.clone()
    if isinstance(x, tuple | list):
        return type(x)(_detached(v, grad, leaves) for v in x)
    return x


def count_chain(
    layers: Sequence[tuple[str, nn.Module]],
    x: Any,
    *,
    input_grad: bool = False,
    per_layer: list[tuple[SpatialOps, Any]] | None = None,
) -> tuple[dict[str, tuple[Counts, Counts]], Any]:
    """Forward and backward :class:`Counts` of each layer of a chain run on ``x``.

    Each layer runs alone (``layer(x)``, as :func:`~..models.registry.run_chain` calls it)
    on the previous one's output, detached; its backward is ``autograd.grad`` of its
    outputs towards its floating inputs (not the chain's own input unless ``input_grad``:
    the image needs no gradient) and its parameters. Use meta tensors and a meta model:
    nothing is computed. Returns ``({name: (forward, backward)}, output)``. ``per_layer``:
    each layer's :func:`spatial_ops` and output are appended to it (the same forward).
    """
    out: dict[str, tuple[Counts, Counts]] = {}
    for i, (name, layer) in enumerate(layers):
        leaves: list[torch.Tensor] = []
        xin = _detached(x, input_grad or i > 0, leaves)
        fwd = OpCounter()
        with fwd, _recording(layer) as found:
            y = layer(xin)
        if per_layer is not None:
            per_layer.append((found, y))
        outs = [t for t in _tensors(y) if t.requires_grad]
        wrt = leaves + [p for p in layer.parameters() if p.requires_grad]
        bwd = OpCounter()
        if outs and wrt:
            with bwd:
                torch.autograd.grad(
                    outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True
                )
        out[name] = (fwd.counts, bwd.counts)
        x = _detached(y, False, leaves)
    return out, x


def fresh_s(counts: Counts, device: Device) -> float:
    """Seconds ``device`` spends making the fresh buffers of ``counts`` usable (a CPU's page
    faults, :attr:`Device.fresh_s` per byte of each size class; a GPU's caching allocator
    reuses its memory: none)."""
    return sum(b * s for b, s in zip(counts.fresh, device.fresh_s, strict=False))


def compute_s(counts: Counts, device: Device) -> float:
    """Seconds ``device`` spends on ``counts``: FLOPs at its rate, each convolution call slowed
    by the saturation ``pixels / (pixels + px_half)`` (so a call costs ``px_half`` pixels'
    FLOPs more), bytes at its bandwidth, fresh buffers (:func:`fresh_s`), and its launches
    (added on a CPU; on a GPU the larger of launches and work)."""
    work = counts.flops + counts.pixel_flops * device.px_half
    busy = work / device.flops + counts.bytes / device.mem_bw + fresh_s(counts, device)
    launches = counts.ops * device.op_overhead
    return max(busy, launches) if device.asynchronous else busy + launches


# ----------------------------------------------------------------------------- messages


def message_s(nbytes: float, link: Link) -> float:
    """One point-to-point message: latency plus bytes over bandwidth (0 bytes: no message)."""
    return link.latency + nbytes / link.bandwidth if nbytes > 0 else 0.0


def allreduce_s(nbytes: float, ranks: int, link: Link) -> float:
    """An all-reduce over ``ranks``: the ring's ``2 (r-1)/r`` bytes per rank over the link and
    a tree's ``2 ceil(log2 r)`` latencies (NCCL picks between them; this is their floor)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (
        2 * (ranks - 1) / ranks * nbytes / link.bandwidth
        + 2 * math.ceil(math.log2(ranks)) * link.latency
    )


def reduce_scatter_s(nbytes: float, ranks: int, link: Link) -> float:
    """A reduce-scatter (or all-gather) of ``nbytes`` in all over ``ranks``: half an all-reduce."""
    return allreduce_s(nbytes, ranks, link) / 2


# ----------------------------------------------------------------------------- halos


@dataclass(frozen=True)
class Window:
    """A windowed layer as the halo exchange sees it: its input's shape ``(n, c, *spatial)``,
    its element size, its halo ``(before, after)`` per spatial axis on tiles aligned to its
    stride (REFERENCE.md: ``p`` and ``max(0, K - p - s)``), and its forward FLOPs."""

    shape: tuple[int, ...]
    itemsize: int
    halo: tuple[tuple[int, int], ...]
    flops: float = 0.0
    #: FLOPs of one output pixel (a convolution's; 0 for a pool).
    pixel_flops: float = 0.0

    def scaled(self, edge: Sequence[float]) -> Window:
        """The same layer on a tile ``edge`` times as long per spatial axis."""
        n, c, *sp = self.shape
        grown = tuple(max(1, round(s * e)) for s, e in zip(sp, edge, strict=True))
        return replace(self, shape=(n, c, *grown), flops=self.flops * math.prod(edge))


def _phases(w: Window, grid: Sequence[int]) -> list[tuple[int, int]]:
    """Bytes ``(before, after)`` of each split axis's phase for an interior tile."""
    n, c, *sp = w.shape
    dims = list(sp)
    out = []
    for k, ((before, after), tiles) in enumerate(zip(w.halo, grid, strict=True)):
        if tiles > 1:
            cross = math.prod(dims[:k] + dims[k + 1 :])
            out.append((before * cross * n * c * w.itemsize, after * cross * n * c * w.itemsize))
        dims[k] += before + after  # later phases send rows of the extended tile (corners)
    return out


def halo_s(
    windows: Sequence[Window],
    grid: Sequence[int],
    link: Link,
    device: Device,
    *,
    overlap: bool = False,
    backward: bool = False,
) -> float:
    """Exposed seconds of the halo exchanges of ``windows`` on an interior tile of ``grid``.

    Per layer, per split axis, one phase: both sides at once, the larger message sets the
    time. Backward returns the same strips. With ``overlap`` the layer's interior (its
    FLOPs, twice in backward) runs meanwhile: only the excess waits.
    """
    total = 0.0
    for w in windows:
        comm = sum(max(message_s(b, link), message_s(a, link)) for b, a in _phases(w, grid))
        if overlap and comm > 0:
            inside = (2.0 if backward else 1.0) * w.flops / device.flops
            comm = max(0.0, comm - inside)
        total += comm
    return total


def halo_copy_bytes(windows: Sequence[Window], grid: Sequence[int]) -> float:
    """Bytes read plus written to send and place the strips of ``windows`` once (one pass):
    the sent strips made contiguous and the received ones placed (4 x the strips)."""
    return float(sum(2 * 2 * (b + a) for w in windows for b, a in _phases(w, grid)))


@dataclass
class SpatialOps:
    """What a spatial rank exchanges in one forward: its windowed layers' :class:`Window` s,
    and the channels of every BatchNorm (each all-reduces its statistics over the grid); and
    what a branch rank sums over its branch group: per branched cell, the bytes of the whole
    output (forward) and of its fanned-out inputs (their gradients, backward)."""

    windows: list[Window] = field(default_factory=list)
    norms: list[int] = field(default_factory=list)
    branch_sums: list[tuple[int, int]] = field(default_factory=list)


def spatial_ops(module: nn.Module, run: Callable[[], object]) -> SpatialOps:
    """The windowed layers (1x1/stride-1 ones have no halo and are left out) and BatchNorms
    that ``run()`` calls inside ``module`` (meta device), in call order."""
    with _recording(module) as found, torch.no_grad():
        run()
    return found


@contextmanager
def _recording(module: nn.Module) -> Iterator[SpatialOps]:
    """What :func:`spatial_ops` reports, recorded while the block runs (forward hooks)."""
    from hyfi_imaging.parallel.branches import BranchedCell
    from hyfi_imaging.parallel.geometry import layer_geom
    from hyfi_imaging.parallel.spatial.kinds import BATCH_NORMS, WINDOWED_LAYERS

    found = SpatialOps()

    def window(m: nn.Module, args: tuple[Any, ...], y: Any) -> None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None:
            return
        geoms = layer_geom(m, tuple(x.shape[2:]))
        halo = tuple(g.halo() for g in geoms)
        if not any(b or a for b, a in halo):
            return
        flops = pixel = 0.0
        if isinstance(m, nn.Conv1d | nn.Conv2d | nn.Conv3d) and isinstance(y, torch.Tensor):
            per_out = 2 * m.in_channels // m.groups * math.prod(m.kernel_size)
            flops, pixel = float(y.numel() * per_out), float(m.out_channels * per_out)
        found.windows.append(Window(tuple(x.shape), x.element_size(), halo, flops, pixel))

    def norm(m: nn.Module, args: tuple[Any, ...], y: Any) -> None:
        found.norms.append(int(getattr(m, "num_features", 0)))

    preprocessed: list[int] = []  # bytes of the running cell's preprocessed inputs

    def branched(m: nn.Module, args: tuple[Any, ...], y: Any) -> None:
        # Forward: the combined output (the first tensor; a cell passes its input on too).
        # Backward: the gradients of what fans out -- a cell's two preprocessed inputs, a
        # container's input.
        fanned = sum(preprocessed) if preprocessed else sum(_nbytes(t) for t in _tensors(args))
        preprocessed.clear()
        found.branch_sums.append((_nbytes(_tensors(y)[0]), fanned))

    handles = [
        m.register_forward_hook(window) for m in module.modules() if isinstance(m, WINDOWED_LAYERS)
    ]
    handles += [
        m.register_forward_hook(norm) for m in module.modules() if isinstance(m, BATCH_NORMS)
    ]
    cells = [m for m in module.modules() if isinstance(m, BranchedCell)]
    handles += [m.register_forward_hook(branched) for m in cells]
    handles += [
        pre.register_forward_hook(lambda _m, _a, y: preprocessed.append(_nbytes(y)))
        for m in cells
        for name, pre in m.named_children()
        if name in ("preprocess0", "preprocess1")
    ]
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def branch_allreduce_s(
    sums: Sequence[tuple[int, int]], ranks: int, link: Link, *, backward: bool
) -> float:
    """A branch group's sums of one micro-batch (:attr:`SpatialOps.branch_sums`): per cell, the
    zero-padded output in forward and the fanned-out inputs' gradients in backward; blocking."""
    return sum(allreduce_s(b if backward else f, ranks, link) for f, b in sums)


def norm_allreduce_s(channels: Sequence[int], ranks: int, link: Link, *, backward: bool) -> float:
    """BatchNorm statistics over a grid, one blocking collective per layer (float32): forward
    all-gathers every tile's (mean, variance, count) (``norms.merged_statistics``), backward
    all-reduces (sum of gradients, sum of gradient x normalised input)."""
    if backward:
        return sum(allreduce_s(2 * c * 4, ranks, link) for c in channels)
    return sum(reduce_scatter_s(ranks * (2 * c + 1) * 4, ranks, link) for c in channels)


# ----------------------------------------------------------------------------- schedules


def ideal_bubble(schedule: str, pp: int, microbatches: int) -> float:
    """Idle share of equal stages: ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B; two mirrored
    replicas (``bidirectional``, each ``m / 2``) fill about half of it (the replay in
    :func:`~.schedules.simulate_orders` gives the exact figure)."""
    if pp <= 1:
        return 0.0
    one = (pp - 1) / (microbatches + pp - 1)
    return one / 2 if schedule == "bidirectional" else one
