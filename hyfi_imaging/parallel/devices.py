"""The devices a step is predicted on: a table of GPUs with documented figures, and this CPU.

Why a table of figures and not a timing: the layouts worth planning run on GPUs this
machine does not have. Each row is the vendor's datasheet (dense peak, memory bandwidth,
memory, NVLink and the usual InfiniBand per GPU) times a stated efficiency
(:data:`FLOP_EFFICIENCY`, :data:`MEM_EFFICIENCY`) -- an assumption -- except where a GPU run
measured the compute figures (``benchmarks/gpu_check.py``): the Hopper rows carry an H200's,
per memory layout (:data:`HOPPER_MEASURED`). This CPU
is measured instead (:func:`calibrate_cpu`, a second or two, cached), with the same
counting (:class:`~.speed.OpCounter`) the predictions use, so that what is counted and what
is timed agree. ``hyfi-plan --device NAME`` picks a row (in the model's layout: :func:`get_device`);
``--flops``, ``--mem-bw``, ``--link-bw`` ... replace its figures.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.memory import allocator
from hyfi_imaging.parallel.speed import FRESH_CLASSES, Counts, OpCounter, fresh_s

__all__ = [
    "CPU_NAMES",
    "DEVICES",
    "FLOP_EFFICIENCY",
    "HOPPER_MEASURED",
    "MEM_EFFICIENCY",
    "Device",
    "Link",
    "calibrate_cpu",
    "calibrate_gpu",
    "calibrated",
    "get_device",
    "measure_figures",
    "probe",
    "table_key",
]

GB = 1e9
#: Sustained share of the datasheet's dense peak a convolutional network's kernels reach
#: (cuDNN convolutions in bf16 on tensor cores; an assumption, not a measurement).
FLOP_EFFICIENCY = 0.5
#: Sustained share of the datasheet's memory bandwidth of elementwise kernels (STREAM-like).
MEM_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Link:
    """One hop between two ranks: ``bandwidth`` bytes/s per direction, ``latency`` seconds."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Device:
    """What one device does per second, and how it talks to the others.

    ``flops``: sustained FLOP/s of convolutions and matrix products in ``dtype`` on large
    maps; ``px_half``: output pixels (x batch) of one convolution call at which it runs at
    half that rate (small tiles do not fill the device: a GPU's SMs, a CPU core's blocking);
    ``mem_bw``: sustained bytes/s read plus written by memory-bound ops;
    ``fresh_s``: seconds per byte of a new buffer's first touch, by size class
    (:data:`~.speed.FRESH_CLASSES`: a CPU's page faults under the process's allocator;
    empty: free, as a GPU's caching allocator makes it);
    ``op_overhead``: seconds per kernel (launch or dispatch); ``asynchronous``: the
    host launches ahead of the device (GPU), so a layer takes the larger of its kernel
    time and its launches, not their sum. ``intra``: the link to a rank of the same
    node (NVLink, per GPU and direction), ``inter``: across nodes (the GPU's share of
    the node's InfiniBand), ``per_node``: devices per node. ``memory``: bytes.
    """

    name: str
    flops: float
    mem_bw: float
    memory: int
    op_overhead: float
    asynchronous: bool
    intra: Link
    inter: Link
    per_node: int
    px_half: float = 0.0
    dtype: str = "bf16"
    note: str = ""
    fresh_s: tuple[float, ...] = ()

    def link(self, span: int) -> Link:
        """The slowest link inside a group of ranks ``span`` consecutive ranks wide."""
        return self.intra if span <= self.per_node else self.inter

    def with_(self, **changes: Any) -> Device:
        """A copy with some figures replaced (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def _gpu(
    name: str,
    *,
    peak: float,
    hbm: float,
    memory_gb: float,
    nvlink: float,
    ib: float,
    per_node: int,
    px_half: float,
    dtype: str = "bf16",
    note: str,
) -> Device:
    return Device(
        name,
        flops=FLOP_EFFICIENCY * peak,
        mem_bw=MEM_EFFICIENCY * hbm,
        memory=int(memory_gb * 2**30),
        op_overhead=5e-6,  # eager PyTorch's host cost per kernel launch
        asynchronous=True,
        intra=Link(nvlink, 5e-6),  # NCCL's small-message latency within a node
        inter=Link(ib, 10e-6),  # and across nodes
        per_node=per_node,
        px_half=px_half,
        dtype=dtype,
        note=note,
    )


#: Compute figures of one H200 measured by ``benchmarks/gpu_check.py`` (2026-11-28; torch 2.11,
#: CUDA 13.0, cuDNN 9.19; bfloat16), as ``hyfi-plan --device cuda`` measures them
#: (:func:`measure_figures`), per memory layout. In the same run they predicted hyfi's
#: ResNet-50 1x1 training step at 4096^2 and 8192^2 within +3.4 % and +8.6 % (channels-last)
#: and +35 % and +41 % (NCHW); the datasheet row with the assumed efficiencies predicted
#: -68 % (docs/benchmarks.md). An H100 SXM has the H200's compute (the same GH100 at the same
#: clocks) and 3.35 of its 4.8 TB/s: its row takes these figures with the memory bandwidth
#: scaled by that ratio (derived, not measured on an H100).
HOPPER_MEASURED: dict[str, dict[str, Any]] = {
    "nchw": {"flops": 200.19e12, "mem_bw": 659.7e9, "op_overhead": 56.61e-6,
             "px_half": 2928.0, "fresh_s": []},
    "channels_last": {"flops": 395.38e12, "mem_bw": 1689.5e9, "op_overhead": 52.46e-6,
                      "px_half": 11451.0, "fresh_s": []},
}  # fmt: skip
_HOPPER_WHERE = "an H200 by gpu_check.py, 2026-11-28, bf16"


def _hopper(row: Device, layout: str, hbm_share: float = 1.0) -> Device:
    """``row`` with :data:`HOPPER_MEASURED`'s figures in ``layout`` (memory bandwidth times
    ``hbm_share``: this GPU's HBM over the H200's)."""
    fig = dict(HOPPER_MEASURED[layout])
    fig["mem_bw"] *= hbm_share
    what = f"{_HOPPER_WHERE} {'NCHW' if layout == 'nchw' else 'channels-last'}"
    if hbm_share != 1.0:
        what = f"{what}; memory bandwidth x{hbm_share:.3g} (HBM over the H200's)"
    return row.with_(**_compute(fig), note=f"{row.note}; compute figures measured on {what}")


def _compute(figures: dict[str, Any]) -> dict[str, Any]:
    """The :class:`Device` fields of measured figures (:func:`measure_figures`)."""
    return {
        "flops": float(figures["flops"]),
        "mem_bw": float(figures["mem_bw"]),
        "op_overhead": float(figures["op_overhead"]),
        "px_half": float(figures["px_half"]),
        "fresh_s": tuple(float(v) for v in figures["fresh_s"]) if figures["fresh_s"] else (),
    }


#: The device table. Peak figures from the vendors' datasheets (dense, no sparsity); links
#: per GPU and direction (NVLink: the aggregate over a GPU's links, halved for one
#: direction; InfiniBand: one NIC per GPU, or the node's rails shared). Sustained rates
#: apply :data:`FLOP_EFFICIENCY` and :data:`MEM_EFFICIENCY`. ``cpu`` comes from
#: :func:`calibrate_cpu`.
DEVICES: dict[str, Device] = {
    "v100": _gpu(
        "V100 SXM2 16GB (Lassen/Sierra node: 4 per node, as in Hy-Fi)",
        peak=15.7e12, hbm=900 * GB, memory_gb=16, nvlink=75 * GB, ib=6.25 * GB, per_node=4,
        px_half=1024, dtype="fp32",
        note="fp32 (Hy-Fi/MPI4DL train in fp32); NVLink2 3 links between GPU pairs; "
        "dual-rail EDR InfiniBand (2 x 100 Gb/s) shared by 4 GPUs",
    ),
    "a100-40gb": _gpu(
        "A100 SXM4 40GB", peak=312e12, hbm=1555 * GB, memory_gb=40, nvlink=300 * GB,
        ib=25 * GB, per_node=8, px_half=2048, note="bf16 dense 312 TFLOP/s; NVLink3 600 GB/s; HDR 200 Gb/s per GPU",
    ),
    "a100-80gb": _gpu(
        "A100 SXM4 80GB", peak=312e12, hbm=2039 * GB, memory_gb=80, nvlink=300 * GB,
        ib=25 * GB, per_node=8, px_half=2048, note="bf16 dense 312 TFLOP/s; NVLink3 600 GB/s; HDR 200 Gb/s per GPU",
    ),
    "h100": _gpu(
        "H100 SXM5 80GB", peak=989e12, hbm=3350 * GB, memory_gb=80, nvlink=450 * GB,
        ib=50 * GB, per_node=8, px_half=4096, note="bf16 dense 989 TFLOP/s; NVLink4 900 GB/s; NDR 400 Gb/s per GPU",
    ),
    "h200": _gpu(
        # 141 GB is decimal: CUDA's total capacity is 139.8 GiB (measured, docs/gpu/)
        "H200 SXM 141GB", peak=989e12, hbm=4800 * GB, memory_gb=139.8, nvlink=450 * GB,
        ib=50 * GB, per_node=8, px_half=4096, note="bf16 dense 989 TFLOP/s; NVLink4 900 GB/s; NDR 400 Gb/s per GPU",
    ),
    "mi300a": _gpu(
        "MI300A 128GB (El Capitan node: 4 per node)", peak=980.6e12, hbm=5300 * GB, memory_gb=128,
        nvlink=128 * GB, ib=25 * GB, per_node=4, px_half=4096,
        note="bf16 dense 980.6 TFLOP/s; unified HBM3 shared with the CPU cores; Infinity Fabric "
        "between APUs (~128 GB/s per direction, approximate); Slingshot-11 200 Gb/s per APU",
    ),
}  # fmt: skip
#: The Hopper rows in each layout: the table's rows are NCHW (a model's default layout).
_BY_LAYOUT: dict[str, dict[str, Device]] = {
    layout: {
        key: _hopper(DEVICES[key], layout, DEVICES[key].mem_bw / DEVICES["h200"].mem_bw)
        for key in ("h100", "h200")
    }
    for layout in HOPPER_MEASURED
}
DEVICES |= _BY_LAYOUT["nchw"]
#: Names :func:`get_device` accepts besides the table: this CPU, measured.
CPU_NAMES = ("cpu", "this-cpu")


# ----------------------------------------------------------------------------- calibration


#: Version of :func:`_measure_cpu`'s method: cached figures of another are measured again.
_CALIBRATION = 9
#: What :func:`_measure_cpu` returns.
_FIGURES = ("flops", "mem_bw", "op_overhead", "px_half", "fresh_s")


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "hyfi-imaging" / "speed.json"


def _cpu_key() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if "model name" in ln), model)
    except OSError:
        pass
    threads = torch.get_num_threads()
    return f"{model}|torch {torch.__version__}|threads {threads}|{allocator()}|v{_CALIBRATION}"


@dataclass(frozen=True)
class _Probe:
    """Where the calibration measures and on what: the device, the element type and memory
    format of its tensors, the memory-bound blocks' maps and the convolutions' sizes, each
    ``(channels, side)``."""

    device: torch.device
    dtype: torch.dtype
    channels_last: bool
    maps: tuple[tuple[int, int], ...]
    convs: tuple[tuple[int, int], ...]

    @property
    def asynchronous(self) -> bool:
        """The host launches ahead of the device (CUDA): a launch's cost hides behind work."""
        return self.device.type == "cuda"

    def tensor(self, *shape: int, grad: bool = False) -> torch.Tensor:
        t = torch.randn(shape, device=self.device, dtype=self.dtype)
        if self.channels_last and t.dim() == 4:
            t = t.contiguous(memory_format=torch.channels_last)
        return t.requires_grad_(grad)

    def module(self, m: nn.Module) -> nn.Module:
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        return m.to(device=self.device, dtype=self.dtype, memory_format=fmt)  # type: ignore[call-overload]

    def typical_s(self, fn: Callable[[], object], repeat: int) -> float:
        """Median of ``repeat`` runs after a warm-up (the fastest caught turbo moments that a
        training step does not sustain). On the CPU with one torch thread, the main thread's
        CPU time (what another process on a shared machine does not inflate), else wall time;
        on CUDA, wall time from a synchronised start to a synchronised end."""
        cuda = self.device.type == "cuda"
        clock = time.thread_time if torch.get_num_threads() == 1 and not cuda else time.perf_counter
        fn()  # warm-up: first-call allocations and kernel selection
        spent = []
        for _ in range(repeat):
            if cuda:
                torch.cuda.synchronize(self.device)
            began = clock()
            fn()
            if cuda:
                torch.cuda.synchronize(self.device)
            spent.append(clock() - began)
        return statistics.median(spent)


def probe(
    device: torch.device, *, dtype: torch.dtype | None = None, channels_last: bool = False
) -> _Probe:
    """What the calibration measures on ``device``. A CPU (float32 unless ``dtype``): maps of
    4 and 8 MiB, convolutions from 64 channels on 96^2 to 256 on 8^2. A GPU (bfloat16 unless
    ``dtype``): maps of 128 and 256 MiB (several times an H100's 50 MB L2), convolutions from
    64 channels on 1024^2 to 512 on 32^2 (either side of the size where a call fills it)."""
    if device.type == "cpu":
        return _Probe(
            device, dtype or torch.float32, channels_last,
            maps=((64, 128), (128, 128)), convs=((64, 96), (128, 32), (256, 16), (256, 8)),
        )  # fmt: skip
    return _Probe(
        device, dtype or torch.bfloat16, channels_last,
        maps=((64, 1024), (128, 1024)), convs=((64, 1024), (128, 512), (256, 128), (512, 32)),
    )  # fmt: skip


def _counted(fn: Callable[[], object]) -> Counts:
    counter = OpCounter()
    with counter:
        fn()
    return counter.counts


def _conv_step(probe: _Probe, channels: int, side: int) -> Callable[[], None]:
    """A 3x3 convolution's forward and backward (input and weight gradients) on ``side^2``."""
    x = probe.tensor(1, channels, side + 2, side + 2, grad=True)
    w = probe.tensor(channels, channels, 3, 3, grad=True)

    def step() -> None:
        y = torch.nn.functional.conv2d(x, w)
        y.backward(torch.ones_like(y))

    return step


#: The largest fresh buffer measured (larger classes cost what it costs per byte).
_FRESH_MEASURED = 192 << 20


def _measure_fresh(repeat: int) -> list[float]:
    """Seconds per byte of a new buffer's first touch, by size class: a buffer of the class's
    geometric middle allocated, written once and freed, less the same write to a buffer
    already touched (with an empty allocation, so that only the memory differs); the median
    of ``repeat`` such pairs. What the process's allocator does decides it (glibc's mmap
    threshold, huge pages; :func:`~.memory.configure_allocator`), which is why the
    calibration runs in the process it predicts for."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    out: list[float] = []
    for i in range(FRESH_CLASSES):
        n = int(2 ** (i + 12.5)) // 64 * 64
        if n > _FRESH_MEASURED:
            out.append(out[-1])
            continue
        warm = torch.empty(n, dtype=torch.uint8)
        warm.fill_(0)
        pairs = []
        for _ in range(repeat + 1):
            began = clock()
            torch.empty(0, dtype=torch.uint8)
            warm.fill_(1)
            middle = clock()
            torch.empty(n, dtype=torch.uint8).fill_(1)
            pairs.append((clock() - middle) - (middle - began))
        out.append(max(0.0, statistics.median(pairs[1:])) / n)  # the first: a warm-up
        del warm
    return out


def _net(spent: float, known: float) -> float:
    """``spent`` less ``known`` (launches, page faults) of it; never below half of it, so that
    noise in ``known`` on a busy machine cannot make a rate negative or infinite."""
    return max(spent - known, spent / 2)


def _measure_cpu(repeat: int = 9) -> dict[str, Any]:
    """Figures of :func:`calibrate_cpu`, each with the same counting as the model uses."""
    return measure_figures(probe(torch.device("cpu")), repeat)


def measure_figures(where: _Probe, repeat: int = 9) -> dict[str, Any]:
    """A device's figures (:data:`_FIGURES`) measured on ``where`` (:func:`probe`), each with the same counting (:class:`OpCounter`) the model uses. On
    CUDA the new buffers cost nothing (the caching allocator reuses memory) and the launches
    overlap the kernels, so neither is taken off the kernels' time."""
    fresh = _measure_fresh(repeat) if where.device.type == "cpu" else []
    unit = Device(
        "unit", flops=1.0, mem_bw=1.0, memory=0, op_overhead=0.0, asynchronous=False,
        intra=Link(1.0, 0.0), inter=Link(1.0, 0.0), per_node=1, fresh_s=tuple(fresh),
    )  # fmt: skip
    launch = 0.0 if where.asynchronous else 1.0  # the share of launches kernels wait for
    # Host cost per kernel of a training step (module calls, autograd's graph and engine):
    # a network of the same layers on an 8^2 map, where the arithmetic is negligible.
    tiny = where.module(
        nn.Sequential(
            *(
                m
                for _ in range(10)
                for m in (nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
            )
        )
    )
    small = where.tensor(1, 4, 8, 8)

    def step() -> None:
        tiny(small).sum().backward()

    c = _counted(step)
    overhead = _net(where.typical_s(step, repeat), fresh_s(c, unit)) / max(1, c.ops)
    # Memory-bound ops as a network runs them: BatchNorm, a residual add and a ReLU, forward
    # and backward, on maps of 4 and 8 MiB (a plain 64 MiB copy runs about twice as fast per
    # byte on this project's CPU): their bytes over their time less their new buffers' (maps
    # this large, so that the buffers' share is small: at 0.5 MiB it was most of the time
    # under the fixed mmap threshold, and the rate a small difference of two large numbers).
    moved = spent = 0.0
    for channels, side in where.maps:
        norm = where.module(nn.BatchNorm2d(channels))
        a = where.tensor(1, channels, side, side, grad=True)
        b = where.tensor(1, channels, side, side)

        def block(norm: nn.Module = norm, a: torch.Tensor = a, b: torch.Tensor = b) -> None:
            y = torch.relu(norm(a) + b)
            y.backward(torch.ones_like(y))

        c = _counted(block)
        moved += c.bytes
        spent += _net(where.typical_s(block, repeat), fresh_s(c, unit) + launch * c.ops * overhead)
    mem_bw = moved / spent
    # Convolutions from a large map to a small one: time (less launches) = (flops + pixel_flops
    # x px_half) / rate, fitted by least squares (two unknowns, four sizes).
    rows = []
    for channels, side in where.convs:
        fn = _conv_step(where, channels, side)
        c = _counted(fn)
        spent_s = _net(where.typical_s(fn, repeat), launch * c.ops * overhead + fresh_s(c, unit))
        rows.append((c.flops, c.pixel_flops, spent_s))
    sff = sum(f * f for f, _, _ in rows)
    spp = sum(p * p for _, p, _ in rows)
    sfp = sum(f * p for f, p, _ in rows)
    sft = sum(f * t for f, _, t in rows)
    spt = sum(p * t for _, p, t in rows)
    det = sff * spp - sfp * sfp
    per_flop = (sft * spp - spt * sfp) / det  # seconds per FLOP
    per_pixel = (sff * spt - sfp * sft) / det  # seconds per pixel-FLOP of a call's fixed cost
    if per_flop <= 0 or per_pixel < 0:  # noise: the large map's rate alone
        f, _, t = rows[0]
        per_flop, per_pixel = t / f, 0.0
    return {
        "flops": 1 / per_flop,
        "mem_bw": mem_bw,
        "op_overhead": overhead,
        "px_half": per_pixel / per_flop,
        "fresh_s": fresh,
    }


def calibrate_cpu(*, refresh: bool = False, cache: Path | None = None) -> Device:
    """This CPU as a :class:`Device`, measured once (a few seconds) and cached.

    Figures: 3x3 convolutions' forward and backward (64 channels on 96^2 to 256 on 8^2,
    fitted by least squares) for :attr:`~Device.flops` and :attr:`~Device.px_half`;
    BatchNorm + add + ReLU forward and backward on 64x128^2 and 128x128^2 maps for
    :attr:`~Device.mem_bw` (bytes read + written as :class:`OpCounter` counts them); a
    training step of 10 x (3x3 convolution, BatchNorm, ReLU) on 4 channels of 8^2 for
    :attr:`~Device.op_overhead` (seconds per kernel counted; module calls and autograd); a
    new buffer of each size class allocated, written and freed, less the write alone, for
    :attr:`~Device.fresh_s` (page faults: the other figures are measured net of them); all
    at torch's current thread count, median of 9. Cached in
    ``$XDG_CACHE_HOME/hyfi-imaging/speed.json`` by CPU model, torch version, thread count
    and allocator (:func:`~.memory.allocator`; ``refresh`` measures again). Links: Gloo
    over loopback, nominal (2 GB/s, 50 µs), not measured.
    """
    key = _cpu_key()
    fig = _cached_figures(key, lambda: _measure_cpu(), refresh=refresh, cache=cache, cpu=True)
    loopback = Link(2 * GB, 50e-6)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device(
        "this CPU (measured: " + key.split("|")[0] + f", {torch.get_num_threads()} thread(s))",
        flops=float(fig["flops"]),
        mem_bw=float(fig["mem_bw"]),
        memory=int(ram),
        op_overhead=float(fig["op_overhead"]),
        asynchronous=False,
        intra=loopback,
        inter=loopback,
        per_node=os.cpu_count() or 1,
        px_half=float(fig["px_half"]),
        dtype="fp32",
        note="calibrated: conv 3x3 and BatchNorm+add+ReLU forward+backward, a tiny network, "
        "fresh buffers by size",
        fresh_s=tuple(float(v) for v in fig["fresh_s"]),
    )


def _busy() -> bool:
    """Whether other work holds the machine's CPUs now: a 1-minute load average (the whole
    machine's) above half of its CPUs (an idle machine's is near 0)."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1) / 2
    except OSError:
        return False


#: The figures this process measured or read, by cache file and key (see _cached_figures).
_THIS_PROCESS: dict[tuple[str, str], dict[str, Any]] = {}


def _cached_figures(
    key: str,
    measure: Callable[[], dict[str, Any]],
    *,
    refresh: bool,
    cache: Path | None,
    cpu: bool = False,
) -> dict[str, Any]:
    """The figures cached under ``key`` in ``cache`` (default :func:`_cache_path`), else
    ``measure()``'s, cached (``refresh``: measure again).

    The ``cpu``'s figures are marked ``loaded`` when the machine was busy before or after
    measuring (:func:`_busy`): such figures serve while it stays busy, and an idle machine
    measures again and replaces them (one measured under load predicted a step 17x too slow
    for every later run). A GPU's figures are its own, whatever the CPUs do.
    """
    path = cache or _cache_path()
    known = _THIS_PROCESS.get((str(path), key))
    if known is not None and not refresh:
        return known  # one process, one set of figures (two calls once gave two devices)
    table: dict[str, Any] = {}
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    fig = table.get(key) if not refresh else None
    stale = isinstance(fig, dict) and bool(fig.get("loaded")) and not _busy()
    if stale or not isinstance(fig, dict) or not set(_FIGURES) <= set(fig):
        busy = cpu and _busy()
        fig = measure()
        if busy or (cpu and _busy()):
            fig = {**fig, "loaded": True}
        table[key] = fig
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1))
            tmp.replace(path)
        except OSError:
            pass  # a read-only home: measure again next time
    _THIS_PROCESS[(str(path), key)] = fig
    return fig


def calibrated(row: Device, figures: dict[str, Any], what: str) -> Device:
    """``row`` (its memory, links and nodes) with its compute figures replaced by measured
    ones (:func:`measure_figures`); ``what`` says where they were measured."""
    return row.with_(
        name=f"{row.name} (measured: {what})",
        note=f"calibrated on {what}; links and memory from the table",
        **_compute(figures),
    )


def calibrate_gpu(
    *, channels_last: bool = False, refresh: bool = False, cache: Path | None = None
) -> Device:
    """This machine's first CUDA device as a :class:`Device`, in bfloat16 and NCHW
    (``channels_last``: that layout, ``model.memory_format``'s): its compute figures measured as
    :func:`calibrate_cpu` measures the CPU's (:func:`probe`, a few seconds, cached by GPU,
    torch, cuDNN and memory format), its memory and links from the table's row
    for it (:func:`table_key`; a GPU the table lacks gets nominal PCIe links: give
    ``--link-bw`` and ``--inter-bw``). ``hyfi-plan --device cuda``."""
    if not torch.cuda.is_available():
        raise ConfigError(
            "--device cuda", "found no CUDA device", "run it on a GPU machine, or name a table row"
        )
    gpu = torch.cuda.get_device_properties(0)
    fmt = "channels-last" if channels_last else "NCHW"
    key = (
        f"{gpu.name}|torch {torch.__version__}|cudnn {torch.backends.cudnn.version()}|bf16 {fmt}"
        f"|v{_CALIBRATION}"
    )
    where = probe(torch.device("cuda", 0), channels_last=channels_last)
    fig = _cached_figures(key, lambda: measure_figures(where), refresh=refresh, cache=cache)
    row_key = table_key(gpu.name, gpu.total_memory)
    row = DEVICES[row_key] if row_key else _gpu(
        gpu.name, peak=float(fig["flops"]), hbm=float(fig["mem_bw"]),
        memory_gb=gpu.total_memory / 2**30, nvlink=25 * GB, ib=12.5 * GB, per_node=8,
        px_half=0.0, note="not in the table: links nominal (PCIe 4 x16, 100 Gb/s)",
    )  # fmt: skip
    return calibrated(row, fig, f"{gpu.name}, bf16 {fmt}")


def table_key(gpu_name: str, memory: int) -> str | None:
    """The row of :data:`DEVICES` for a GPU by the name CUDA gives it and its memory in bytes
    (an A100 of more than 50 GiB is the 80 GB one); None if the table has no such GPU."""
    name = gpu_name.lower()
    a100 = "a100-80gb" if memory > 50 * 2**30 else "a100-40gb"
    found = (("h200", "h200"), ("h100", "h100"), ("mi300a", "mi300a"), ("a100", a100),
             ("v100", "v100"))  # fmt: skip
    return next((key for part, key in found if part in name), None)


def get_device(name: str, *, channels_last: bool = False) -> Device:
    """A device of :data:`DEVICES` by name (case-insensitive; a row measured in each layout
    in the model's, ``channels_last``), ``cpu`` (:func:`calibrate_cpu`) or ``cuda`` (this
    machine's GPU, :func:`calibrate_gpu`, measured in the model's layout)."""
    key = name.strip().lower()
    if key in CPU_NAMES:
        return calibrate_cpu()
    if key == "cuda":
        return calibrate_gpu(channels_last=channels_last)
    if channels_last and key in _BY_LAYOUT["channels_last"]:
        return _BY_LAYOUT["channels_last"][key]
    if key in DEVICES:
        return DEVICES[key]
    raise ConfigError(
        f"--device {name}",
        "is not in the device table",
        f"use one of {', '.join((*DEVICES, 'cpu', 'cuda'))}, or give --flops/--mem-bw yourself",
    )
