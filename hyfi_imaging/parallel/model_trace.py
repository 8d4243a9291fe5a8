"""One meta-device trace of a whole model per input shape, from which every pipeline stage is read.

Why: ``hyfi-plan`` predicts hundreds of layouts (data replicas x pipeline stages x grids x
micro-batches x schedules x checkpointing), but what a stage costs depends only on its layers,
the shape of its input (tile and micro-batch) and the streamed stem -- not on the replicas, the
schedule or the checkpointing mode, which the planner accounts for arithmetically. Tracing each
candidate's stages afresh, from a fresh meta copy of the model, took 13.5 minutes for ResNet-50
on 8 devices (issue 22). Here the model is copied to the meta device once, and traced once per
input shape: what autograd saves and which top-level layer saved it
(:meth:`~.memory.SavedActivations.restrict` reads a stage), each layer's forward and backward
work (:func:`~.speed.count_chain`), its halo windows and BatchNorms (:func:`~.speed.spatial_ops`)
and the tensors between layers. A stage read from it is what a trace of that stage alone
gives (``tests/test_plan.py`` compares the two on several models and cuts).

One exception keeps its own trace: a streamed stem that a pipeline cut splits runs its layers
one by one (:func:`~..models.registry.run_chain`), so the cut points inside it are part of the
key (``splits``).

A model that is no chain (a U-Net) is one layer for one stage and its traced chain form
(:mod:`.chain_form`) for several, as :func:`~.pipeline.model_layers` cuts it for training:
every function here takes the stage count (``stages``), and the meta copy keeps both forms
over the same modules. A traced layer holds several of the model's modules at their own
paths (``encoder.0``, ``up.1``), so a module path names its layer by the longest prefix a
layer holds (:func:`layer_of`), not by its first component.
"""

from __future__ import annotations

import copy
import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hyfi_imaging.models.registry import CheckpointedBlock, chain_run, run_chain
from hyfi_imaging.parallel.chain_form import ChainLayer
from hyfi_imaging.parallel.memory import SavedActivations, _key, saved_activations
from hyfi_imaging.parallel.meta import meta_copy
from hyfi_imaging.parallel.pipeline import (
    StageModule,
    as_tuple,
    is_chain,
    model_layers,
    set_checkpointing,
)
from hyfi_imaging.parallel.speed import Counts, SpatialOps, count_chain
from hyfi_imaging.parallel.streaming import stream_stem

__all__ = [
    "LayerWork",
    "MetaMemo",
    "MetaModel",
    "ModelTrace",
    "layer_of",
    "layer_work",
    "meta_model",
    "saved_trace",
    "stem_splits",
    "trace_model",
]


@dataclass
class MetaModel:
    """A meta-device copy of a model (its stem streamed or not), made once and traced often."""

    module: nn.Module
    layers: list[tuple[str, nn.Module]]
    dtype: torch.dtype
    in_chans: int

    @property
    def traced(self) -> bool:
        """Whether the layers are the model's traced chain form (a non-chain model cut)."""
        return any(isinstance(layer, ChainLayer) for _, layer in self.layers)

    def blocks(self, checkpointing: str) -> list[str]:
        """The blocks ``checkpointing`` recomputes, by the paths a stage's trace names. The
        copy itself always runs them plainly: the planner accounts for the recomputation
        (and a trace must not depend on the mode)."""
        chosen = set_checkpointing(self.module, checkpointing)
        for blk in self.module.modules():
            if isinstance(blk, CheckpointedBlock):
                blk.grad_checkpointing = False
        if not is_chain(self.module) and not self.traced:
            return [f"{self.layers[0][0]}.{name}" for name in chosen]  # one layer, the model
        return chosen


def layer_of(layers: Sequence[tuple[str, nn.Module]], path: str) -> int | None:
    """The index of the layer of ``layers`` that holds the module (or tensor) at ``path`` --
    a path as a stage of those layers names it -- or None.

    A top-level layer holds the paths under its name (``layer3.0.conv1``: ``layer3``); a
    traced layer (:class:`~.chain_form.ChainLayer`) the paths under each module and tensor
    it mounts, which are the model's own (``encoder.0.conv``: the layer calling
    ``encoder.0``). The longest such prefix wins."""
    roots: dict[str, int] = {}
    for i, (name, layer) in enumerate(layers):
        if isinstance(layer, ChainLayer):
            roots.update((part, i) for part, _, _ in layer.parts)
        else:
            roots[name] = i
    parts = path.split(".")
    for k in range(len(parts), 0, -1):
        found = roots.get(".".join(parts[:k]))
        if found is not None:
            return found
    return None


@dataclass
class ModelTrace:
    """The whole model traced on one input shape (``len(layers)`` top-level layers).

    ``saved``: what autograd saves, by top-level layer. ``work``: each layer run alone
    (:class:`LayerWork`; the same for every streaming mode and cut, so shared by them).
    """

    layers: list[tuple[str, nn.Module]]
    saved: SavedActivations
    work: LayerWork

    @property
    def counted(self) -> dict[str, tuple[Counts, Counts]]:
        return self.work.counted

    @property
    def boundaries(self) -> list[tuple[torch.Tensor, ...]]:
        return self.work.boundaries

    def stage(self, start: int, stop: int) -> SavedActivations:
        """What layers ``start:stop`` save, as a trace of that stage alone counts it
        (:meth:`stage_held`)."""
        return self.stage_held(start, stop)[0]

    def stage_held(self, start: int, stop: int) -> tuple[SavedActivations, int]:
        """What layers ``start:stop`` save, and the bytes of the boundary tensors it receives
        and sends (to another stage) that none of them saves.

        What is saved is read from the whole trace where every tensor the stage receives fills
        a storage of its own (a stage traced alone, like a pipeline stage, receives a copy of
        each); otherwise (AmoebaNet's stem hands on one tensor twice) the stage is traced alone.

        Why the boundary tensors: the pipeline holds what a stage received and what it sent
        until its backward (the inputs' gradients are asked of them, the outputs are given
        their gradients), saved or not. A chain stage saves them anyway (its first layer its
        input); a traced U-Net stage receives and sends skips that only a concatenation
        reads, which saves nothing -- megabytes the saved tensors do not count."""
        names = [n for n, _ in self.layers[start:stop]]
        ends: list[tuple[int, int]] = []  # (storage key, bytes) of the boundary tensors
        if start:
            received = self.saved.outputs.get(self.layers[start - 1][0], [])
            keys = [key for key, _, _ in received]
            if len(set(keys)) < len(keys) or any(own != whole for _, own, whole in received):
                stage = StageModule(self.layers[start:stop], index=start)
                ins = tuple(t.detach().requires_grad_(True).clone() for t in self.boundaries[start])
                alone = saved_activations(stage, partial(stage, *ins), stage.named_layers())
                ends = [(_key(t), t.numel() * t.element_size()) for t in ins]
                return alone, _unsaved(alone, ends, names[-1], stop < len(self.layers))
            ends = [(key, own) for key, own, _ in received]
        mine = self.saved.restrict(names)
        return mine, _unsaved(mine, ends, names[-1], stop < len(self.layers))

    def stage_ops(self, start: int, stop: int) -> SpatialOps:
        """The halo windows and BatchNorms of layers ``start:stop``, in call order."""
        out = SpatialOps()
        for ops in self.work.ops[start:stop]:
            out.windows += ops.windows
            out.norms += ops.norms
            out.branch_sums += ops.branch_sums
        return out


def _unsaved(
    saved: SavedActivations, received: list[tuple[int, int]], last: str, sends: bool
) -> int:
    """Bytes of ``received`` (storage key, bytes) and, where the stage ``sends``, of its last
    layer's outputs, that ``saved`` does not hold; a tensor passed on untouched counts once."""
    ends = dict(received)
    if sends:
        ends.update((key, own) for key, own, _ in saved.outputs.get(last, []))
    kept = {key for key, *_ in saved.storages}
    return sum(n for key, n in ends.items() if key not in kept)


@dataclass
class LayerWork:
    """Every top-level layer run alone on what the previous one returns (:func:`~.speed.count_chain`).

    ``counted``: each layer's forward and backward :class:`~.speed.Counts`; ``ops``: its
    :class:`~.speed.SpatialOps`; ``boundaries[i]``: the tensors layer ``i`` receives (fresh
    contiguous meta tensors, as a pipeline stage receives them), ``boundaries[-1]`` the
    model's output.
    """

    counted: dict[str, tuple[Counts, Counts]]
    boundaries: list[tuple[torch.Tensor, ...]]
    ops: list[SpatialOps]


#: Per model (weakly: a model dropped drops its entries): its meta copies by streaming mode,
#: and its traces by (input shape, streaming, splits).
_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[tuple[object, ...], object]] = (
    weakref.WeakKeyDictionary()
)


def meta_model(model: nn.Module, streaming: str = "none", stages: int = 1) -> MetaModel:
    """``model`` on the meta device (copied once per streaming mode), ``"stem"``: its stem
    streamed; its layers those a pipeline of ``stages`` stages is cut from
    (:func:`~.pipeline.model_layers`: a non-chain model's traced form, on the same copy)."""
    cache = _CACHE.setdefault(model, {})
    traced = stages > 1 and not is_chain(model)
    key = ("meta", streaming, traced)
    if key not in cache:
        if traced:  # the same meta modules, as the traced layers hold them
            plain = meta_model(model, streaming)
            layers = model_layers(plain.module, stages)
            cache[key] = MetaModel(plain.module, layers, plain.dtype, plain.in_chans)
        else:
            # The plain copy without copying the weights' data; the streamed one from it.
            meta = (
                meta_copy(model) if streaming == "none" else copy.deepcopy(meta_model(model).module)
            )
            if streaming == "stem":
                stream_stem(meta)
            dtype = next((p.dtype for p in meta.parameters()), torch.float32)
            in_chans = int(getattr(meta, "in_chans", 3))
            cache[key] = MetaModel(meta, model_layers(meta), dtype, in_chans)
    found = cache[key]
    assert isinstance(found, MetaModel)
    return found


def stem_splits(layers: Sequence[tuple[str, nn.Module]], starts: Sequence[int]) -> tuple[int, ...]:
    """The stage starts that fall inside a registered run of layers (a streamed stem): there
    the stages run those layers one by one, not as the run."""
    inside: set[int] = set()
    for i, (_, layer) in enumerate(layers):
        run = chain_run(layer)
        if run is not None:
            inside.update(range(i + 1, i + len(run.modules)))
    return tuple(sorted(s for s in set(starts) if s in inside))


def trace_model(
    model: nn.Module,
    shape: Sequence[int],
    streaming: str = "none",
    splits: tuple[int, ...] = (),
    stages: int = 1,
) -> ModelTrace:
    """The :class:`ModelTrace` of ``model`` (any device; its meta copy is traced) on an input of
    ``shape`` ``(batch, channels, *spatial)``, cached per model, shape, streaming and splits;
    its layers those of a pipeline of ``stages`` stages (:func:`meta_model`)."""
    shape = tuple(int(v) for v in shape)
    return ModelTrace(
        meta_model(model, streaming, stages).layers,
        saved_trace(model, shape, streaming, splits, stages),
        layer_work(model, shape, stages),
    )


def saved_trace(
    model: nn.Module,
    shape: Sequence[int],
    streaming: str = "none",
    splits: tuple[int, ...] = (),
    stages: int = 1,
) -> SavedActivations:
    """What autograd saves over one forward of the whole model on ``shape`` (cached), by
    layer of a pipeline of ``stages`` stages (:meth:`~.memory.SavedActivations.restrict`);
    the paths are a pipeline stage's. A streamed stem runs as the chain runner runs it;
    ``splits``: stage starts inside it (each side then runs its layers one by one)."""
    meta = meta_model(model, streaming, stages)
    cache = _CACHE.setdefault(model, {})
    key = ("saved", tuple(int(v) for v in shape), streaming, splits, meta.traced)
    found = cache.get(key)
    if isinstance(found, SavedActivations):
        return found
    layers = meta.layers
    whole = StageModule(layers)  # the paths a pipeline stage's trace names
    x = torch.empty(tuple(shape), dtype=meta.dtype, device="meta")
    edges = [0, *splits, len(layers)]

    def run() -> object:
        y: object = x
        for a, b in itertools.pairwise(edges):
            y = run_chain([m for _, m in layers[a:b]], y)
        return y

    with torch.device("meta"), MetaMemo():
        found = saved_activations(whole, run, whole.named_layers())
    cache[key] = found
    return found


def layer_work(model: nn.Module, shape: Sequence[int], stages: int = 1) -> LayerWork:
    """Each layer of a pipeline of ``stages`` stages run alone on an input of ``shape``
    (:class:`LayerWork`, cached): neither a streamed stem nor a cut changes it, so the plain
    meta copy is traced."""
    meta = meta_model(model, "none", stages)
    cache = _CACHE.setdefault(model, {})
    key = ("layers", tuple(int(v) for v in shape), meta.traced)
    found = cache.get(key)
    if isinstance(found, LayerWork):
        return found
    x = torch.empty(tuple(shape), dtype=meta.dtype, device="meta")
    per_layer: list[tuple[SpatialOps, object]] = []
    with torch.device("meta"), MetaMemo():
        counted, _ = count_chain(meta.layers, x, per_layer=per_layer)
    boundaries: list[tuple[torch.Tensor, ...]] = [(x,)] + [
        tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in as_tuple(y))
        for _, y in per_layer
    ]
    found = LayerWork(counted, boundaries, [ops for ops, _ in per_layer])
    cache[key] = found
    return found


# ----------------------------------------------------------------------------- memoised meta kernels

#: An output's (shape, stride, dtype); None for an optional output left out.
_Out = tuple[tuple[int, ...], tuple[int, ...], torch.dtype] | None
#: Output metadata of meta kernels already run, by op and input metadata (None: not memoisable).
_KERNELS: dict[tuple[object, ...], tuple[_Out, ...] | None] = {}
_KERNELS_MAX = 200_000


class MetaMemo(TorchDispatchMode):
    """Runs each meta kernel once per (op, inputs' shapes, strides and dtypes, other arguments).

    Why: on the meta device most of a trace's time is PyTorch's Python shape functions (a
    BatchNorm's ~10 ms), and a traced network repeats them: identical blocks, the counting
    pass after the saving pass. A meta kernel's outputs depend on nothing but those
    arguments, so an op whose outputs are all new tensors (no view, no in-place result) is
    answered with new empty tensors of the recorded shapes, strides and dtypes -- what the
    kernel returns, storage sizes included (an output that is not a plain strided tensor at
    offset 0 filling its storage is never memoised). Autograd, saved-tensor hooks and
    counting modes above it see the same tensors either way; tensors on other devices pass
    through.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        key = _signature(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        known = _KERNELS.get(key, ())
        if known is None:
            return func(*args, **kwargs)
        if known:
            outs = [
                None if m is None else torch.empty_strided(m[0], m[1], dtype=m[2], device="meta")
                for m in known
            ]
            return outs[0] if len(outs) == 1 and not _returns_tuple(func) else tuple(outs)
        out = func(*args, **kwargs)
        if len(_KERNELS) > _KERNELS_MAX:
            _KERNELS.clear()
        _KERNELS[key] = _outputs(out)
        return out


def _returns_tuple(func: Any) -> bool:
    return len(func._schema.returns) != 1


def _signature(func: Any, args: Any, kwargs: Any) -> tuple[object, ...] | None:
    """A hashable description of a call whose outputs are all new tensors, or None."""
    schema = func._schema
    if not schema.returns or any(r.alias_info is not None for r in schema.returns):
        return None  # a view or an in-place result: the caller's tensor, not a new one
    if any(str(r.type) not in ("Tensor", "Tensor?") for r in schema.returns):
        return None
    try:
        return (func, _describe(args), _describe(kwargs))
    except _NotMemoisable:
        return None


class _NotMemoisable(Exception):
    pass


def _describe(x: Any) -> object:
    if isinstance(x, torch.Tensor):
        if x.device.type != "meta" or x.layout != torch.strided:
            raise _NotMemoisable
        return ("T", tuple(x.shape), x.stride(), x.dtype, x.storage_offset())
    if x is None or isinstance(x, bool | int | float | str | torch.dtype | torch.device):
        return x
    if isinstance(x, torch.memory_format | torch.layout):
        return str(x)
    if isinstance(x, list | tuple):
        return tuple(_describe(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _describe(v)) for k, v in x.items()))
    raise _NotMemoisable


def _outputs(out: Any) -> tuple[_Out, ...] | None:
    """Each output's (shape, stride, dtype) where every output is a fresh plain tensor."""
    outs = list(out) if isinstance(out, tuple | list) else [out]
    found: list[_Out] = []
    for t in outs:
        if t is None:
            found.append(None)
            continue
        if not isinstance(t, torch.Tensor) or t.device.type != "meta" or t.storage_offset():
            return None
        made = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")
        if made.untyped_storage().nbytes() != t.untyped_storage().nbytes():
            return None
        found.append((tuple(t.shape), t.stride(), t.dtype))
    return tuple(found)
