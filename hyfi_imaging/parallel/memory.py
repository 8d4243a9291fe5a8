"""What a rank keeps in memory: saved activations by module, and the allocator.

Why a library module: the memory regression test, the benchmarks and the
planner must count the same thing the same way. :func:`saved_activations`
counts the *distinct storages* autograd keeps for backward during one forward
pass (a tensor saved by a ReLU and again by the convolution after it is paid
for once, by the ReLU), attributed to the leaf module that was running when it
was first saved, parameters apart.

:func:`fix_malloc_threshold` makes peak RSS reproducible: glibc's adaptive mmap
threshold keeps freed buffers of up to 32 MiB in the heap, and small tiles
fall under it far more often than whole-image tensors (up to +50 % per-rank
peak on this project's benchmarks). ``mallopt(M_MMAP_THRESHOLD, 64 KiB)``
returns every larger buffer to the kernel at once, like
``MALLOC_MMAP_THRESHOLD_=65536`` in the environment, without needing it set
before the process starts. It is a no-op off glibc. That makes every buffer above
64 KiB fresh memory from the kernel, faulted in 4 KiB at a time: on a 1x2 ResNet-50 768²
rank, 3 million page faults and 5.4 s of system time in a 15 s run (a warm-up and three
steps). :func:`enable_huge_pages` has PyTorch's CPU allocator ask for transparent huge pages
for its buffers of 2 MiB and more (one fault per 2 MiB): that step is 18 % shorter, the
peak the same (``docs/benchmarks.md``).

:func:`cpu_unfold_bytes` is the one kernel workspace too large to leave out: PyTorch's own
CPU convolutions (every dtype oneDNN does not take, float64 among them) unfold their whole
input batch first (im2col / vol2col), ``C_in x kernel volume`` times the output. For a 3-D
U-Net's first decoder convolution in float64 that is 27 x its input -- 8.9 GB for a batch of
two 40x48x56 volumes, six times what autograd saves for the whole network (measured with
``VmHWM``, ``docs/benchmarks.md``). :func:`available_bytes` is what the kernel and the
cgroup still grant, for the checks that refuse a run before it is killed for memory.

:class:`LiveTensorPeak` is the planner's own quantity, measured: the peak bytes of tensor
storages alive at once. Held against :class:`AnonymousPeak` on the same steps, it splits
a miss of the planner into its tensor model (what it predicts) and the process's memory
that is no tensor at all: Python objects, autograd's graph, and the buffers oneDNN and Gloo
allocate inside their kernels (``docs/benchmarks.md``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import weakref
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hyfi_imaging.parallel.balance import flat_tensors

__all__ = [
    "SavedActivations",
    "allocator",
    "available_bytes",
    "configure_allocator",
    "cpu_unfold_bytes",
    "enable_huge_pages",
    "fix_malloc_threshold",
    "AnonymousPeak",
    "LiveTensorPeak",
    "reset_peak_rss",
    "rss_bytes",
    "saved_activations",
]

PARAMETERS = "(parameters)"
BETWEEN = "(between modules)"
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
_THP_ENV = "THP_MEM_ALLOC_ENABLE"  # PyTorch's switch (c10's CPU allocator), read once per process
_THP_PROBE_BYTES = 64 << 20  # above PyTorch's 2 MiB huge-page size and glibc's 32 MiB cap
_PAGE = 4096
#: What this process's :func:`fix_malloc_threshold` and :func:`enable_huge_pages` decided.
_SET: dict[str, str] = {}


@dataclass
class SavedActivations:
    """Bytes autograd saved for backward in one forward, by module path (distinct storages).

    ``by_module`` maps the path of the leaf module that first saved a storage
    (``"(between modules)"`` for tensor code outside leaves, ``"(parameters)"``
    for parameters) to bytes; ``shared`` counts, per module, the bytes of
    storages it saved that an earlier module had already saved (free for it).
    """

    by_module: dict[str, int] = field(default_factory=dict)
    shared: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    #: Every distinct storage saved, in order: (storage key, first saver's path, bytes, dtype).
    storages: list[tuple[int, str, int, torch.dtype]] = field(default_factory=list)
    #: Leaf modules in call order: (path, storage key and bytes of the first input,
    #: bytes of the output, shape of the first input).
    calls: list[tuple[str, int, int, int, tuple[int, ...]]] = field(default_factory=list)
    #: Every save, a storage saved again included: (storage key, saver's path, bytes, dtype,
    #: the traced module's direct child whose work it is -- between children, the one after
    #: the last finished -- ``""`` for a module without children).
    saves: list[tuple[int, str, int, torch.dtype, str]] = field(default_factory=list)
    #: The direct child running during each of :attr:`calls`.
    call_tops: list[str] = field(default_factory=list)
    #: Each direct child's output tensors: (storage key, the tensor's bytes, its storage's).
    outputs: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)

    @property
    def activations(self) -> int:
        """Total bytes, parameters excluded."""
        return sum(v for k, v in self.by_module.items() if k != PARAMETERS)

    def restrict(self, names: Collection[str]) -> SavedActivations:
        """What the direct children ``names`` save, counted as a trace of them alone counts it.

        Why: the planner traces a whole model once per input shape and reads every pipeline
        stage (a run of direct children) from it, instead of tracing each stage of each
        candidate cut. A stage traced alone starts from a copy of its input, so a storage an
        earlier child saved and one of ``names`` saves again is this stage's own (attributed
        to its first saver among ``names``). That is the same count only where each input
        tensor fills a storage of its own (see :attr:`outputs`); the caller checks.
        """
        chosen = set(names)
        out = SavedActivations(kinds=self.kinds)
        by_module: dict[str, int] = defaultdict(int)
        shared: dict[str, int] = defaultdict(int)
        seen: set[int] = set()
        for key, owner, nbytes, dtype, top in self.saves:
            if top not in chosen:
                continue
            if key in seen:
                shared[owner] += nbytes
                continue
            seen.add(key)
            by_module[owner] += nbytes
            out.storages.append((key, owner, nbytes, dtype))
            out.saves.append((key, owner, nbytes, dtype, top))
        picked = [(c, t) for c, t in zip(self.calls, self.call_tops, strict=True) if t in chosen]
        out.calls = [c for c, _ in picked]
        out.call_tops = [t for _, t in picked]
        out.outputs = {k: v for k, v in self.outputs.items() if k in chosen}
        out.by_module, out.shared = dict(by_module), dict(shared)
        return out

    def by_layer(self) -> dict[str, int]:
        """Bytes of activations (parameters apart) per direct child -- per layer, for a stage
        of traced layers -- each distinct storage counted by the child that first saved it.

        Why by the running child and not by the saver's path: a traced layer's work between
        its modules (``"(between modules)"``) has no module path, yet it is that layer's."""
        out: dict[str, int] = defaultdict(int)
        seen: set[int] = set()
        for key, owner, nbytes, _, top in self.saves:
            if key in seen or owner == PARAMETERS:
                continue
            seen.add(key)
            out[top] += nbytes
        return dict(out)

    def by_kind(self) -> dict[str, int]:
        """Bytes per module class name (parameters apart)."""
        out: dict[str, int] = defaultdict(int)
        for path, v in self.by_module.items():
            if path != PARAMETERS:
                out[self.kinds.get(path, path)] += v
        return dict(out)


def _key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage (its C++ object; works on the meta device too)."""
    return int(t.untyped_storage()._cdata)


def saved_activations(
    model: nn.Module,
    forward: Callable[[], Any],
    layers: Sequence[tuple[str, nn.Module]] | None = None,
) -> SavedActivations:
    """Run ``forward()`` (which should call ``model``) and count what autograd saves.

    The result of ``forward()`` is dropped, so its graph is freed. Works on the
    ``meta`` device (no memory, no compute), which is how the planner uses it.

    ``layers``: the ``(name, module)`` units each save is attributed to (the ``top`` of
    :attr:`SavedActivations.saves`, what :meth:`SavedActivations.restrict` selects by);
    default the model's direct children. A pipeline stage of traced layers
    (:meth:`~.pipeline.StageModule.named_layers`) passes its layers: its direct children are
    the levels of the model's module tree (``encoder``), each spread over several layers, and
    a layer's work between its modules (a concatenation, a ReLU called as a function) is
    its own.
    """
    params = {_key(p.to_local() if isinstance(p, DTensor) else p) for p in model.parameters()}
    stack = [BETWEEN]
    seen: set[int] = set()
    result = SavedActivations()
    by_module: dict[str, int] = defaultdict(int)
    shared: dict[str, int] = defaultdict(int)
    handles: list[Any] = []

    def enter(path: str, args: Any) -> None:
        stack.append(path)
        result.call_tops.append(top())
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None:
            calls.append([path, -1, 0, 0, ()])
        else:
            calls.append([path, _key(x), _nbytes(x), 0, tuple(x.shape)])

    def leave(path: str, out: Any) -> None:
        stack.pop()
        for call in reversed(calls):
            if call[0] == path:
                call[3] = sum(_nbytes(t) for t in flat_tensors(out))
                break

    calls: list[list[Any]] = []
    # The direct child running (a stage's layers, for the planner's slices): a stack, as a
    # child may call another module that is also a direct child. Between children (a run of
    # them that a chain runner calls as one, such as a streamed stem, enters none of them)
    # the work belongs to the child after the last one finished.
    tops = [""]
    units = list(model.named_children()) if layers is None else list(layers)
    order = [name for name, _ in units]
    done = [0]

    def top() -> str:
        if tops[-1] or not order:
            return tops[-1]
        return order[min(done[0], len(order) - 1)]

    alive: list[Any] = []  # outputs kept until the end: their storage keys stay unique

    def top_leave(name: str, out: Any) -> None:
        tops.pop()
        done[0] = order.index(name) + 1
        alive.append(out)
        result.outputs[name] = [
            (_key(t), _nbytes(t), t.untyped_storage().nbytes()) for t in flat_tensors(out)
        ]

    for name, child in units:
        handles.append(child.register_forward_pre_hook(lambda m, a, n=name: tops.append(n)))
        handles.append(child.register_forward_hook(lambda m, a, o, n=name: top_leave(n, o)))
    for path, mod in model.named_modules():
        if not list(mod.children()):
            result.kinds[path] = type(mod).__name__
            handles.append(mod.register_forward_pre_hook(lambda m, a, p=path: enter(p, a)))
            handles.append(mod.register_forward_hook(lambda m, a, o, p=path: leave(p, o)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        key, nbytes = _key(t), t.untyped_storage().nbytes()
        if nbytes == 0:
            return t
        # FSDP2 saves its gathered (unsharded) parameters: Parameters, other storages.
        is_param = key in params or isinstance(t, nn.Parameter)
        owner = PARAMETERS if is_param else stack[-1]
        result.saves.append((key, owner, nbytes, t.dtype, top()))
        if key in seen:
            shared[stack[-1]] += nbytes
        else:
            seen.add(key)
            by_module[owner] += nbytes
            result.storages.append((key, owner, nbytes, t.dtype))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
        del out
    finally:
        for h in handles:
            h.remove()
    result.by_module, result.shared = dict(by_module), dict(shared)
    result.calls = [(c[0], c[1], c[2], c[3], c[4]) for c in calls]
    return result


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


#: Dtypes oneDNN convolves on the CPU (no unfolded copy of the input); others take PyTorch's
#: own kernels, which unfold it.
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cpu_unfold_bytes(module: nn.Module, in_shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes a CPU convolution ``module`` allocates to unfold an input of ``in_shape``; 0 if none.

    PyTorch's own kernels (``slow_conv2d``, ``slow_conv3d``; a Conv1d runs as a 2-D one)
    unfold the whole batch: ``N x C_in x kernel volume x output size`` elements (groups do
    not divide it), except a 1x1 convolution of stride 1 without padding, which reads its
    input as it is. A dilated convolution unfolds one sample at a time, and a transposed
    one ``C_out x kernel volume x input size`` per sample. Measured, forward and backward
    alike, on torch 2.13 (``VmHWM`` of one call). oneDNN, which takes float32, bfloat16 and
    float16 when it is available, allocates no such copy: 0. The caller says the module
    runs on the CPU (a GPU has its own, bounded, workspaces).
    """
    if not isinstance(module, nn.modules.conv._ConvNd) or len(in_shape) < 3:
        return 0
    if dtype in _ONEDNN_DTYPES and torch.backends.mkldnn.is_available():
        return 0
    size = torch.empty((), dtype=dtype).element_size()
    spatial = [int(v) for v in in_shape[2:]]
    kernel = math.prod(module.kernel_size)
    if module.transposed:
        return module.out_channels * kernel * math.prod(spatial) * size
    pad = module.padding
    # "same" keeps the size (an even kernel pads a copy first), "valid" pads nothing.
    pads = (0,) * len(spatial) if pad == "valid" else pad
    geometry = zip(spatial, module.kernel_size, module.stride, module.dilation, strict=True)
    if isinstance(pads, str):
        out, padded = spatial, kernel > 1
    else:
        out = [
            (n + 2 * p - d * (k - 1) - 1) // s + 1
            for p, (n, k, s, d) in zip(pads, geometry, strict=True)
        ]
        padded = any(p != 0 for p in pads)
    if kernel == 1 and all(s == 1 for s in module.stride) and not padded:
        return 0
    dilated = any(d != 1 for d in module.dilation)
    batch = 1 if dilated else int(in_shape[0])
    return batch * module.in_channels * kernel * math.prod(max(0, v) for v in out) * size


def available_bytes() -> int:
    """Memory this process may still claim: the kernel's ``MemAvailable``, or less where a cgroup
    (a container, a SLURM job) sets a limit below it (cgroup v2 ``memory.max``, else v1)."""
    avail = _meminfo("MemAvailable")
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < (1 << 60):  # "max", or v1's "no limit" sentinel
            avail = min(avail, max(0, int(limit) - usage))
        break
    return avail


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {field}")


def fix_malloc_threshold(threshold: int = 64 * 1024) -> bool:
    """Set glibc's mmap threshold (fixed, not adaptive); True if it was set.

    Skipped when the user already chose one with ``MALLOC_MMAP_THRESHOLD_`` or
    runs another allocator (``LD_PRELOAD`` of jemalloc/tcmalloc).
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or _other_allocator():
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    if done:
        _SET["threshold"] = str(int(threshold))
    return done


def _other_allocator() -> bool:
    return "malloc" in os.environ.get("LD_PRELOAD", "")


def enable_huge_pages() -> bool:
    """Back PyTorch's CPU buffers of 2 MiB and more with transparent huge pages; True if on.

    PyTorch's CPU allocator page-aligns those buffers and marks them ``MADV_HUGEPAGE`` when
    ``THP_MEM_ALLOC_ENABLE=1``. It reads the variable once, at the process's first CPU
    allocation, so this takes effect only before the first tensor; afterwards it returns
    False and changes nothing. The user's own setting (``1`` or ``0``) and another preloaded
    allocator are left alone. Whether the kernel then grants huge pages is its own setting
    (``/sys/kernel/mm/transparent_hugepage/enabled``: ``always`` or ``madvise``); with
    ``never`` nothing changes either way.
    """
    if not _other_allocator():
        os.environ.setdefault(_THP_ENV, "1")
    if os.environ.get(_THP_ENV) != "1":
        return False
    # The allocator's alignment says what it decided: a page with huge pages on, 64 bytes
    # off. The probe is above glibc's largest mmap threshold, so it is always a fresh mapping
    # (never the heap, where 64-byte alignment could fall on a page); it is never touched.
    probe = torch.empty(_THP_PROBE_BYTES, dtype=torch.uint8)
    on = probe.data_ptr() % _PAGE == 0
    _SET["huge pages"] = "on" if on else "off"
    return on


def allocator() -> str:
    """The process's CPU allocator in one line, as far as it decides what a new buffer costs
    (the speed model's calibration is kept per allocator): the mmap threshold (fixed here,
    the user's ``MALLOC_MMAP_THRESHOLD_``, or glibc's adaptive one), huge pages, or the
    allocator preloaded instead of glibc's."""
    if _other_allocator():
        return "preloaded " + os.environ.get("LD_PRELOAD", "")
    threshold = _SET.get("threshold") or os.environ.get("MALLOC_MMAP_THRESHOLD_", "adaptive")
    huge = _SET.get("huge pages") or ("on" if os.environ.get(_THP_ENV) == "1" else "off")
    return f"mmap threshold {threshold}, huge pages {huge}"


def configure_allocator() -> tuple[bool, bool]:
    """What every rank of a parallel job does first: :func:`fix_malloc_threshold`, then
    :func:`enable_huge_pages`; whether each took effect."""
    return fix_malloc_threshold(), enable_huge_pages()


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's ``VmRSS`` (resident now) or ``VmHWM`` (peak) from ``/proc/self/status``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    """Make ``VmHWM`` equal the current resident set (Linux >= 4.0), to measure one phase's peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class AnonymousPeak:
    """The peak anonymous resident memory of one phase, over the resident set at its start.

    ``with AnonymousPeak() as peak: ...`` then ``peak.bytes``. ``VmHWM`` also
    counts file-backed pages: library code paged in the first time a kernel
    runs (which oneDNN kernels, and how many neighbouring pages the kernel maps
    with them, depend on the CPU and the page cache). Those pages are shared
    and reclaimable, never the cause of an out-of-memory kill, and they make
    the same run read tens of MiB apart on two machines; their growth over the
    phase (``RssFile`` + ``RssShmem``) is taken out.
    """

    bytes: int = 0

    def __enter__(self) -> AnonymousPeak:
        self._base = rss_bytes("VmRSS")
        self._shared = rss_bytes("RssFile") + rss_bytes("RssShmem")
        reset_peak_rss()
        return self

    def __exit__(self, *exc: object) -> None:
        grown = rss_bytes("RssFile") + rss_bytes("RssShmem") - self._shared
        self.bytes = rss_bytes("VmHWM") - self._base - max(grown, 0)


class LiveTensorPeak(TorchDispatchMode):
    """The peak bytes of tensor storages created inside the mode and alive at once.

    ``with LiveTensorPeak() as live: ...`` then ``live.peak`` (bytes) and ``live.by_op``
    (bytes alive at the peak, by the op that created each storage). A storage is counted
    once however many views of it exist, from the op that returns it until the last
    tensor on it is gone. What it cannot see, by construction: memory a kernel allocates
    for itself below the dispatcher (oneDNN's scratchpads, PyTorch's CPU convolutions'
    unfolded input, Gloo's staging buffers), storages created before the mode (parameters,
    optimizer state from earlier steps), and a storage emptied in place
    (``untyped_storage().resize_(0)``, as FSDP2 frees unsharded parameters), which counts
    until its tensor goes. Parameters are skipped; a ``DTensor`` counts its local shard.
    One process's view: use it per rank.
    """

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self.by_op: dict[str, int] = {}
        self._now = 0
        self._alive: dict[int, tuple[int, str]] = {}  # data_ptr -> (bytes, op)
        self._refs: dict[int, int] = defaultdict(int)
        self._now_by: dict[str, int] = defaultdict(int)

    def _gone(self, ptr: int) -> None:
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            del self._refs[ptr]
            size, op = self._alive.pop(ptr)
            self._now -= size
            self._now_by[op] -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter):
                continue
            local = t.to_local() if isinstance(t, DTensor) else t  # FSDP2's shards
            try:
                storage = local.untyped_storage()
            except (RuntimeError, NotImplementedError):  # no storage (another subclass)
                continue
            ptr, size = storage.data_ptr(), storage.nbytes()
            if ptr == 0 or size == 0:
                continue
            if ptr not in self._alive:
                op = str(func)
                self._alive[ptr] = (size, op)
                self._now += size
                self._now_by[op] += size
                if self._now > self.peak:
                    self.peak = self._now
                    self.by_op = {k: v for k, v in self._now_by.items() if v}
            self._refs[ptr] += 1
            weakref.finalize(t, self._gone, ptr)
        return out
