"""What one training step costs, counted: FLOPs, bytes copied, host syncs, collectives.

Why counts and not timings: on a shared CPU wall time is noise, while these
numbers are exact, repeat to the byte, and carry over to a GPU, where a byte
moved costs what some 300 FLOPs do and a host sync stalls the stream. So the
benchmark (``benchmarks/bench_counts.py``) and the regression test
(``tests/test_counts_mpi.py``) count the same thing the same way, here.

:func:`count_step` runs a callable (one ``ParallelModel.train_step``) under
:class:`CountStep` and returns a :class:`StepCounts`; ``with CountStep(model)
as c: ...`` then ``c.counts`` counts any region of code. Per rank:

* **FLOPs**: :class:`torch.utils.flop_counter.FlopCounterMode`, the total
  (matrix products and convolutions, forward, backward and recomputation).
* **Copy bytes**: a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
  adds up the bytes each copy-like aten op *writes* (:data:`COPY_OPS`:
  ``copy_``, ``clone``, ``_to_copy``, ``cat``, ``stack``, ``constant_pad_nd``,
  ``fill_``, ``zero_``, ``zeros``/``ones``/``full`` and their ``_like`` and
  ``new_`` forms, the scatters, ``index_put_``/``index_copy``): the bytes
  of the tensors the op mutates (``copy_``'s destination, ``fill_``'s
  tensor, an ``out=``), else of its outputs; an in-place ``index_put_``,
  ``index_copy_`` or scatter writes only its values' (index's) elements. A ``DTensor`` counts its local shard. FSDP2's own copy ops
  (:data:`FSDP_COPY_OPS`: the all-gather copy-in, the split copy-out, the
  chunk-cat before a reduce-scatter) move parameters and gradients, not
  activations, and are counted apart (``fsdp_copies``), with every aten copy
  called from FSDP2's Python code (``torch/distributed/fsdp/``: e.g. the
  sharded gradient written at the end of backward), found by walking the
  Python stack of each copy.
* **Host syncs**: ``aten._local_scalar_dense`` (``.item()``, ``float(t)``,
  ``int(t)``, ``if t:``) and ``aten.is_nonzero``, plus copies from a device
  tensor into host memory (``.cpu()``, ``.to("cpu")``). ``tolist()`` reads a
  CPU tensor's memory without an aten op: it is invisible here (on a GPU it
  first copies to the host, which is counted).
* **Collectives**: every eager ``torch.distributed`` call on Gloo and NCCL
  reaches the dispatcher as a ``c10d.*`` op (``c10d.allreduce_``,
  ``c10d.send``, ``c10d.recv_``, ``c10d._allgather_base_``,
  ``c10d._reduce_scatter_base_``, ``c10d.barrier`` ...; checked on torch
  2.13, so nothing is wrapped): calls and payload bytes by kind, the payload
  being the tensors this rank hands in (a collective's inputs, what ``send``
  sends, the buffer ``recv`` fills; a barrier carries none).
* **Saved bytes** (:func:`count_step` with a model):
  :func:`~hyfi_imaging.parallel.memory.saved_activations` over the same call,
  the distinct storages autograd keeps for backward (parameters apart).

**Where**, by module path and phase. Global forward pre/post hooks keep the
stack of running modules (named by their path in ``model``; a module outside
it by its class name in angle brackets): an op run inside a module's forward
is that module's, ``"forward"``, or ``"recompute"`` when the forward runs
during backward (activation checkpointing; the post hook is
``always_call``, so a recomputation that checkpointing stops early leaves no
stale entry). Backward ops are attributed through the autograd graph: when a module's forward returns, every graph node
it created (reached from its outputs, stopping at its inputs' nodes and at
nodes of modules that are not inside it) and no inner module claimed is
labelled with its path, so a node is its innermost module's; in backward the node running
(``torch._C._current_autograd_node``) names the module, phase ``"backward"``.
Ops outside every module (the loss, pipeline messages, the engine's own
code) are ``"(outside modules)"``, phase ``"backward"`` inside an unlabelled
graph node, else ``"other"`` (also FSDP2's callback at the end of backward).
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from hyfi_imaging.parallel.balance import flat_tensors
from hyfi_imaging.parallel.memory import saved_activations

__all__ = [
    "COPY_OPS",
    "FSDP_COPY_OPS",
    "OUTSIDE",
    "PHASES",
    "ROOT",
    "SYNC_OPS",
    "CountStep",
    "StepCounts",
    "count_step",
]

#: Copy-like ops by overload-packet name (``aten`` unless namespaced).
COPY_OPS = frozenset(
    {
        "copy_", "clone", "_to_copy", "cat", "stack", "constant_pad_nd", "narrow_copy",
        "split_with_sizes_copy", "_chunk_cat",
        "fill_", "zero_", "zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones",
        "full", "full_like", "new_full",
        "slice_scatter", "select_scatter", "diagonal_scatter", "as_strided_scatter",
        "scatter", "scatter_", "scatter_add", "scatter_add_", "index_put", "index_put_",
        "index_copy", "index_copy_",
    }
)  # fmt: skip
#: FSDP2's copy ops (parameters and gradients), counted apart from :data:`COPY_OPS`.
FSDP_COPY_OPS = frozenset(
    {"fsdp.all_gather_copy_in", "fsdp.split_with_sizes_copy", "fsdp.chunk_cat"}
)
#: Ops that make the host wait for the device.
SYNC_OPS = frozenset({"_local_scalar_dense", "is_nonzero"})
#: A device-to-host copy, counted with the syncs under this name.
DEVICE_TO_HOST = "device_to_host_copy"
#: The path of ops that run outside every module.
OUTSIDE = "(outside modules)"
#: The path of ``model`` itself.
ROOT = "(root)"
PHASES = ("forward", "backward", "recompute", "other")
_LABEL = "hyfi_counts_module"
_FSDP_DIR = "torch/distributed/fsdp/"
# In-place ops that write only where an index says: the argument whose bytes were written.
_SPARSE_WRITES = {"index_put_": "values", "index_copy_": "source"}


@dataclass
class StepCounts:
    """Counts of one rank over one region (one training step).

    ``copies``: bytes written by copy-like op; ``copies_by_module``: path ->
    phase -> bytes; ``fsdp_copies``: bytes FSDP2's copies wrote, by op;
    ``syncs``: calls by op; ``syncs_by_module``: path -> phase -> calls; ``collectives``: kind -> ``{"calls", "bytes"}``; ``saved_bytes``:
    what autograd kept for backward (None when not counted); ``kinds``: a
    module path's class name.
    """

    flops: int = 0
    copies: dict[str, int] = field(default_factory=dict)
    copies_by_module: dict[str, dict[str, int]] = field(default_factory=dict)
    fsdp_copies: dict[str, int] = field(default_factory=dict)
    syncs: dict[str, int] = field(default_factory=dict)
    syncs_by_module: dict[str, dict[str, int]] = field(default_factory=dict)
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)
    saved_bytes: int | None = None
    kinds: dict[str, str] = field(default_factory=dict)

    @property
    def copy_bytes(self) -> int:
        """Bytes written by every copy-like op."""
        return sum(self.copies.values())

    @property
    def fsdp_copy_bytes(self) -> int:
        """Bytes written by FSDP2's copy ops (parameters and gradients)."""
        return sum(self.fsdp_copies.values())

    @property
    def sync_count(self) -> int:
        """Host syncs of every kind."""
        return sum(self.syncs.values())

    @property
    def collective_calls(self) -> int:
        return sum(v["calls"] for v in self.collectives.values())

    @property
    def collective_bytes(self) -> int:
        return sum(v["bytes"] for v in self.collectives.values())

    def top_modules(self, n: int = 10, *, phase: str | None = None) -> list[tuple[str, int]]:
        """The ``n`` module paths that copy the most bytes (one phase, or all phases summed)."""
        totals = {
            path: sum(v for p, v in phases.items() if phase is None or p == phase)
            for path, phases in self.copies_by_module.items()
        }
        ranked = sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))
        return [(p, v) for p, v in ranked[:n] if v > 0]

    def to_json(self) -> dict[str, Any]:
        """A ``json.dumps``-able dict (with the totals); :meth:`from_json` reads it back."""
        out = asdict(self)
        out.update(
            copy_bytes=self.copy_bytes,
            fsdp_copy_bytes=self.fsdp_copy_bytes,
            sync_count=self.sync_count,
            collective_calls=self.collective_calls,
            collective_bytes=self.collective_bytes,
        )
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepCounts:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in names})


def _nbytes(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", None)  # a DTensor: its shard is what this rank writes
    if isinstance(local, torch.Tensor):
        t = local
    return int(t.numel()) * int(t.element_size())


def _op_name(func: Any) -> str:
    packet = func._overloadpacket
    ns = func.namespace
    name = str(packet.__name__)
    return name if ns == "aten" else f"{ns}.{name}"


def _written(func: Any, name: str, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> int:
    """Bytes the copy-like op ``func`` wrote (see the module docstring)."""
    values = _arguments(func, args, kwargs)
    if name in _SPARSE_WRITES:  # in place, only where the index says
        return sum(_nbytes(t) for t in flat_tensors(values.get(_SPARSE_WRITES[name])))
    if name in ("scatter_", "scatter_add_"):  # (self, dim, index, src | value): index's elements
        return int(values["index"].numel()) * int(values["self"].element_size())
    if name == "fsdp.all_gather_copy_in":  # returns (all-gather input, output): fills the input
        outs = flat_tensors(out)
        return _nbytes(outs[0]) if outs else 0
    written = sum(
        _nbytes(t)
        for arg in func._schema.arguments
        if arg.alias_info is not None and arg.alias_info.is_write
        for t in flat_tensors(values.get(arg.name))
    )
    return written or sum(_nbytes(t) for t in flat_tensors(out))


def _arguments(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by their schema names."""
    names = [arg.name for arg in func._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _payload(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """Bytes a ``c10d`` op takes from this rank: its ``input*`` tensors, else its ``tensors``."""
    if func._overloadpacket.__name__ in ("barrier", "monitored_barrier_"):
        return 0
    values = _arguments(func, args, kwargs)
    chosen = [v for k, v in values.items() if k.startswith("input")] or [values.get("tensors")]
    return sum(_nbytes(t) for v in chosen for t in flat_tensors(v))


class _Mode(TorchDispatchMode):
    """The dispatch mode of :class:`CountStep`: sees every aten/c10d op once, at the top."""

    def __init__(self, owner: CountStep) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.owner._record(func, args, kwargs, out)
        return out


class CountStep:
    """Count FLOPs, copy bytes, host syncs and collectives of the code run inside ``with``.

    ``model``: the module whose submodules name the places (``model.named_modules()``
    paths); None names modules by class. After the ``with`` block, ``counts``
    holds a :class:`StepCounts` (``saved_bytes`` None: see :func:`count_step`).

    OK::

        with CountStep(model) as counter:
            loss = model(x).sum(); loss.backward()
        counter.counts.flops, counter.counts.copies

    Nesting two counters is refused (RuntimeError): each would hide the other's hooks.
    """

    _active: CountStep | None = None

    def __init__(self, model: nn.Module | None = None, *, flops: bool = True) -> None:
        self.counts = StepCounts()
        self._paths: dict[int, str] = {}
        if model is not None:
            for path, mod in model.named_modules():
                self._paths.setdefault(id(mod), path or ROOT)
                self.counts.kinds[path or ROOT] = type(mod).__name__
        self._want_flops = flops
        self._flops: FlopCounterMode | None = None
        self._mode = _Mode(self)
        # Running modules: (path, module id, ids of their inputs' graph nodes, the nodes
        # themselves, held so that the ids stay theirs).
        self._stack: list[tuple[str, int, set[int], list[Any]]] = []
        self._token = object()
        self._handles: list[Any] = []
        self._copies: dict[str, int] = defaultdict(int)
        self._fsdp: dict[str, int] = defaultdict(int)
        self._copies_at: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._syncs: dict[str, int] = defaultdict(int)
        self._syncs_at: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._coll: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes": 0})

    # ------------------------------------------------------------------ context

    def __enter__(self) -> CountStep:
        if CountStep._active is not None:
            raise RuntimeError("CountStep: a counter is already active; nesting is not supported")
        CountStep._active = self
        reg = torch.nn.modules.module
        self._handles = [
            reg.register_module_forward_pre_hook(self._enter_module),
            reg.register_module_forward_hook(self._leave_module, always_call=True),
        ]
        try:
            if self._want_flops:
                self._flops = FlopCounterMode(display=False)
                self._flops.__enter__()
            self._mode.__enter__()
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._mode.__exit__(*exc)
        finally:
            if self._flops is not None:
                self._flops.__exit__(*exc)
            self._close()
        c = self.counts
        c.flops = int(self._flops.get_total_flops()) if self._flops is not None else 0
        c.copies = dict(sorted(self._copies.items(), key=lambda kv: -kv[1]))
        c.copies_by_module = {k: dict(v) for k, v in self._copies_at.items()}
        c.fsdp_copies = dict(self._fsdp)
        c.syncs = dict(self._syncs)
        c.syncs_by_module = {k: dict(v) for k, v in self._syncs_at.items()}
        c.collectives = {k: dict(v) for k, v in sorted(self._coll.items())}

    def _close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stack.clear()
        CountStep._active = None

    # ------------------------------------------------------------------ where

    def _path_of(self, module: nn.Module) -> str:
        path = self._paths.get(id(module))
        if path is None:
            path = f"<{type(module).__name__}>"
        return path

    def _enter_module(self, module: nn.Module, args: Any) -> None:
        nodes = [t.grad_fn for t in flat_tensors(args) if t.grad_fn is not None]
        self._stack.append((self._path_of(module), id(module), {id(n) for n in nodes}, nodes))

    def _leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        # Pop up to this module's entry (an inner forward that raised is popped with it).
        if not any(entry[1] == id(module) for entry in self._stack):
            return
        while True:
            path, ident, stops, _nodes = self._stack.pop()
            if ident == id(module):
                break
        if output is None or not torch.is_grad_enabled():
            return
        # Claim the graph nodes this forward made and no inner module claimed: from the
        # outputs back to the inputs, through the inner modules' nodes (a node of this
        # module's own code may lie behind them), stopping at other modules' nodes.
        todo = [t.grad_fn for t in flat_tensors(output) if t.grad_fn is not None]
        seen: dict[int, Any] = {}  # the nodes walked, held so that their ids stay theirs
        while todo:
            node = todo.pop()
            if id(node) in stops or id(node) in seen:
                continue
            seen[id(node)] = node
            meta = _metadata(node)
            mine = meta.get(_LABEL)
            if mine is not None and mine[0] is self._token:
                if not _inside(mine[1], path):
                    continue
            else:
                meta[_LABEL] = (self._token, path)
            todo.extend(n for n, _ in node.next_functions if n is not None)

    def _where(self) -> tuple[str, str]:
        node = torch._C._current_autograd_node()
        if self._stack:
            return self._stack[-1][0], "forward" if node is None else "recompute"
        if node is None:
            return OUTSIDE, "other"
        label = _metadata(node).get(_LABEL)
        if label is not None and label[0] is self._token:
            return str(label[1]), "backward"
        return OUTSIDE, "backward"

    # ------------------------------------------------------------------ what

    def _record(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        name = _op_name(func)
        if func.namespace == "c10d":
            kind = name.removeprefix("c10d.").strip("_")
            entry = self._coll[kind]
            entry["calls"] += 1
            entry["bytes"] += _payload(func, args, kwargs)
            return
        sync = None
        if name in SYNC_OPS:
            sync = name
        elif name in ("_to_copy", "copy_") and _device_to_host(name, args, kwargs, out):
            sync = DEVICE_TO_HOST
        if sync is not None:
            self._syncs[sync] += 1
            path, phase = self._where()
            self._syncs_at[path][phase] += 1
        if name in FSDP_COPY_OPS or (name in COPY_OPS and _called_from_fsdp()):
            self._fsdp[name] += _written(func, name, args, kwargs, out)
        elif name in COPY_OPS:
            n = _written(func, name, args, kwargs, out)
            if n:
                self._copies[name] += n
                path, phase = self._where()
                self._copies_at[path][phase] += n


def _called_from_fsdp() -> bool:
    """Whether FSDP2's Python code is on the stack (it calls the op, or a hook of it does)."""
    frame = sys._getframe(1)
    while frame is not None:
        if _FSDP_DIR in frame.f_code.co_filename.replace(os.sep, "/"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _inside(inner: str, outer: str) -> bool:
    """Whether module path ``inner`` is ``outer`` or below it (everything is below the root)."""
    return outer == ROOT or inner == outer or inner.startswith(outer + ".")


def _metadata(node: Any) -> dict[str, Any]:
    """A graph node's metadata dict (kept by the C++ node, whichever Python wrapper asks)."""
    meta: dict[str, Any] = node.metadata
    return meta


def _device_to_host(name: str, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> bool:
    """Whether a ``copy_``/``_to_copy`` moved data from a device into host memory."""
    if name == "copy_":
        dst, src = args[0], args[1] if len(args) > 1 else kwargs.get("src")
    else:
        dst, src = out, args[0] if args else kwargs.get("self")
    if not isinstance(dst, torch.Tensor) or not isinstance(src, torch.Tensor):
        return False
    return dst.device.type == "cpu" and src.device.type not in ("cpu", "meta")


def count_step(
    step: Callable[[], Any],
    model: nn.Module | None = None,
    *,
    saved: bool = True,
    flops: bool = True,
) -> StepCounts:
    """Run ``step()`` once under :class:`CountStep`; the counts (its result is dropped).

    With a ``model`` and ``saved``, ``step`` runs inside
    :func:`~hyfi_imaging.parallel.memory.saved_activations` as well, and
    ``saved_bytes`` is what autograd kept for backward during the call
    (activations, parameters apart). Blocks under activation checkpointing are
    checkpointing's own business: what they save is not seen. What a
    recomputation in backward saves outside them (a streamed stem's bands) is
    counted too, deduplicated by storage address like everything
    :func:`~hyfi_imaging.parallel.memory.saved_activations` counts: a storage
    freed and another allocated at its address count once, so with
    checkpointing or streaming the figure is indicative, not exact. Without
    them every saved storage lives until backward, and the count is exact.
    """
    with CountStep(model, flops=flops) as counter:
        if model is not None and saved:
            counter.counts.saved_bytes = saved_activations(model, step).activations
        else:
            step()
    return counter.counts
