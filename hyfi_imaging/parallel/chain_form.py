"""Any traceable model as a chain of layers, so that a pipeline can cut it (HyPar-Flow's "any model").

Why: a pipeline is cut from a chain -- layers run in order, each on what the previous one
returns (:mod:`.pipeline`). A U-Net, a DenseNet or a user's own class is no chain: its
``forward`` reads earlier outputs again (skip connections, concatenations) and applies
functions between its modules. :func:`chain_layers` turns such a model into one, as
``torch.distributed.pipelining``'s tracer frontend does, but for this project's tested
pipeline runtime: ``torch.fx`` traces the model's ``forward`` once (symbolically: no compute,
no memory), and the graph, in its own topological order, is grouped into consecutive
*layers*, one per module call and the function calls after it. Each layer
(:class:`ChainLayer`) takes the tuple of *live values* -- every tensor a later layer still
reads: a U-Net's skips, at several scales -- and returns the next such tuple; the last one
returns the model's output. A pipeline stage boundary therefore sends the live tuple, which
:class:`~.pipeline.StageModule` and the runtime already do for AmoebaNet's ``(current,
previous)`` cells, and the meta trace of stage shapes covers every tensor of it.

Why the layers *share* the model's modules (never copies): spatialization swaps a module's
class in place, checkpointing is a flag on the model's blocks, FSDP2 shards the modules
themselves, so all of them see one module whether the model or a layer calls it. A layer
holds each module it calls at the module's own path (``encoder.0``, under a plain level
``encoder``), so a stage of such layers (:class:`~.pipeline.StageModule` mounts the union
of its layers' modules the same way) has exactly the model's parameter names: state dicts,
checkpoints, the tile/head gradient rule and ``hyfi-verify``'s comparison by name are those
of the model.

Why the tracer stops at every module but ``nn.Sequential``: a module called whole runs its
own ``forward`` (a checkpointed block recomputes, a spatial layer exchanges halos, a
function inside it is the same site as in the whole model's run), and nothing inside it
needs to be traceable; a plain ``nn.Sequential`` is itself a chain, so its children are
finer cut points for free. A module called twice (weights shared) keeps all its calls in
one layer, so no parameter is split over two stages.

What is refused, in one line naming the model and the fix (:class:`~..errors.ConfigError`):
a ``forward`` torch.fx cannot trace (Python control flow on tensor values), one whose graph
depends on ``self.training`` (a trace is of one mode), and, at run time, a non-tensor
value (a shape, a tuple) handed across a layer boundary (a pipeline sends tensors).

OK::

    layers = chain_layers(create_model("unet2d", width=4, depth=2))
    x = torch.randn(1, 3, 32, 32)
    for _, layer in layers:
        x = layer(x)        # the model's output, bit for bit

Error::

    chain_layers(ModelWithIfOnTensor())
    # ConfigError: ModelWithIfOnTensor: its forward cannot be traced into pipeline layers ...
"""

from __future__ import annotations

import copy
import inspect
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.node import map_arg

from hyfi_imaging.errors import ConfigError

__all__ = ["ChainLayer", "chain_layers", "mount"]


class _Level(nn.Module):
    """One level of the model's module tree (``encoder`` above ``encoder.0``), never called."""


class _BlockTracer(fx.Tracer):
    """Traces the model's own ``forward`` and plain ``nn.Sequential`` chains; every other module
    is one call (see the module doc)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return not (isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward)


@dataclass(frozen=True)
class _Traced:
    """A model's graph grouped into layers: each layer's nodes, inputs and outputs."""

    names: tuple[str, ...]
    nodes: tuple[tuple[fx.Node, ...], ...]
    inputs: tuple[tuple[fx.Node, ...], ...]
    #: Each layer's live outputs; the last layer's is the graph's output node alone.
    outputs: tuple[tuple[fx.Node, ...], ...]
    #: Each layer's mounts: module paths, and parameter/buffer paths read directly.
    mounts: tuple[tuple[str, ...], ...]
    #: Tensors the trace made constants of (``_tensor_constant0``), by name.
    constants: dict[str, torch.Tensor]


#: Traces by model (weakly): the graph depends on the model's code and module tree, not on
#: the modules' classes, which spatialization swaps in place after the first trace.
_TRACES: weakref.WeakKeyDictionary[nn.Module, _Traced] = weakref.WeakKeyDictionary()


def _trace(model: nn.Module) -> tuple[fx.Graph, nn.Module]:
    """The model's graph in its current mode, traced on a shallow copy (torch.fx writes the
    constants it finds onto the root it traces: not onto the user's model)."""
    root = copy.copy(model)
    params = list(inspect.signature(model.forward).parameters.values())
    concrete = {p.name: p.default for p in params[1:] if p.default is not inspect.Parameter.empty}
    try:
        graph = _BlockTracer().trace(root, concrete_args=concrete or None)
    except Exception as err:  # torch.fx raises TraceError, TypeError, RuntimeError, ...
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(
            type(model).__name__,
            f"its forward cannot be traced into pipeline layers (torch.fx: {first})",
            "use --pipeline 1 (spatial and data parallelism work for any model), or make its "
            "forward traceable by torch.fx (no Python control flow on tensor values), or "
            "build it as a hyfi_imaging.models.ChainModel or nn.Sequential",
        ) from err
    return graph, root


def _traced(model: nn.Module) -> _Traced:
    """The model traced in training and in eval mode (they must agree), grouped into layers."""
    found = _TRACES.get(model)
    if found is not None:
        return found
    modes = {m: m.training for m in model.modules()}
    try:
        model.train()
        graph, root = _trace(model)
        model.eval()
        other, _ = _trace(model)
    finally:
        for m, mode in modes.items():
            m.training = mode
    if str(graph) != str(other):
        raise ConfigError(
            type(model).__name__,
            "its forward runs other code in training than in eval mode (it reads self.training "
            "outside its modules), and a traced pipeline layer is of one mode",
            "use --pipeline 1, or move that code into a module (nn.Dropout, not "
            "F.dropout(x, training=self.training))",
        )
    found = _group(model, graph, root)
    _TRACES[model] = found
    return found


def _group(model: nn.Module, graph: fx.Graph, root: nn.Module) -> _Traced:
    """Cut the graph into layers: a module call and the function calls after it (the first
    layer also takes the calls before the first module), a shared module's calls in one."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    if len(inputs) != 1:
        raise ConfigError(
            type(model).__name__,
            f"its forward takes {len(inputs)} inputs without defaults; a pipeline feeds one",
            "use --pipeline 1, or give the other arguments of forward defaults",
        )
    # Layer index of every node: a new layer at each module call but the first.
    index: dict[fx.Node, int] = {}
    k, seen_module = 0, False
    for n in nodes:
        if n.op == "call_module":
            k += seen_module
            seen_module = True
        index[n] = k
    # A module called in several layers, or a parameter read in several: merge them.
    spans: dict[str, list[int]] = {}
    for n in nodes:
        for path in _paths_of(n):
            spans.setdefault(path, []).append(index[n])
    merge = sorted((min(v), max(v)) for v in spans.values() if min(v) != max(v))
    starts = sorted(set(index.values()))
    group = {}
    g, reach = -1, -1
    for i in starts:
        if i > reach:
            g += 1
        group[i] = g
        for lo, hi in merge:
            if lo <= i <= hi:
                reach = max(reach, hi)
    layer_of = {n: group[index[n]] for n in nodes}
    count = g + 1 if nodes else 1
    members: list[list[fx.Node]] = [[] for _ in range(count)]
    for n in nodes:
        members[layer_of[n]].append(n)
    layer_of[inputs[0]] = -1
    # Live values after layer l: nodes made at or before l and read after l.
    last_use: dict[fx.Node, int] = {}
    for n in [*nodes, output]:
        at = layer_of.get(n, count - 1)
        for used in n.all_input_nodes:
            if used.op != "get_attr":
                last_use[used] = max(last_use.get(used, -1), at)
    order = [inputs[0], *nodes]
    outs = [
        tuple(n for n in order if layer_of[n] <= lay < last_use.get(n, -1))
        for lay in range(count - 1)
    ]
    ins = [(inputs[0],), *outs]
    names = []
    for lay, group_nodes in enumerate(members):
        first = next((n.target for n in group_nodes if n.op == "call_module"), None)
        names.append(str(first) if first is not None else f"{type(model).__name__}.{lay}")
    mounts = [
        tuple(dict.fromkeys(p for n in group_nodes for p in _paths_of(n)))
        for group_nodes in members
    ]
    constants = {
        str(n.target): getattr(root, str(n.target))
        for n in graph.nodes
        if n.op == "get_attr" and not _is_state(model, str(n.target))
    }
    return _Traced(
        tuple(names),
        tuple(tuple(m) for m in members),
        tuple(ins),
        (*outs, (output,)),
        tuple(mounts),
        constants,
    )


@dataclass(frozen=True)
class _Program:
    """A layer's nodes, inputs and outputs: read-only, so copies of a layer share it (a deep
    copy of fx nodes would copy their whole graph)."""

    nodes: tuple[fx.Node, ...]
    inputs: tuple[fx.Node, ...]
    outputs: tuple[fx.Node, ...]

    def __deepcopy__(self, memo: dict[int, Any]) -> _Program:
        return self


def _paths_of(n: fx.Node) -> list[str]:
    """The model paths a node needs mounted: its module, and the state it reads directly."""
    out = [str(n.target)] if n.op == "call_module" else []
    return out + [str(a.target) for a in n.all_input_nodes if a.op == "get_attr"]


def _is_state(model: nn.Module, path: str) -> bool:
    """Whether ``path`` names a parameter or buffer of ``model`` (else a traced constant)."""
    owner, _, name = path.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    return name in module._parameters or name in module._buffers


def mount(root: nn.Module, model_parts: Sequence[tuple[str, Any, bool]]) -> None:
    """Register each ``(path, module or tensor, persistent)`` under ``root`` at its model path.

    Levels above a path are plain modules; a path below one already mounted (a parameter of
    a module mounted whole) is covered by it. Tensors are registered as they are in the model:
    parameters as parameters, buffers as buffers of the same persistence.
    """
    wanted = {path for path, _, _ in model_parts}
    done: set[str] = set()
    for path, part, persistent in model_parts:  # in call order: the stage's first module first
        parts = path.split(".")
        if any(".".join(parts[:i]) in wanted for i in range(1, len(parts))) or path in done:
            continue
        level = root
        for name in parts[:-1]:
            child = level._modules.get(name)
            if child is None:
                child = _Level()
                level.add_module(name, child)
            level = child
        if isinstance(part, nn.Module):
            level.add_module(parts[-1], part)
        elif isinstance(part, nn.Parameter):
            level.register_parameter(parts[-1], part)
        else:
            level.register_buffer(parts[-1], part, persistent=persistent)
        done.add(path)


def _at(root: nn.Module, path: str) -> Any:
    """The module, parameter or buffer at ``path`` below ``root``."""
    owner, _, name = path.rpartition(".")
    return getattr(root.get_submodule(owner), name) if owner else getattr(root, name)


def _part(model: nn.Module, path: str) -> tuple[str, Any, bool]:
    owner, _, name = path.rpartition(".")
    module = model.get_submodule(owner)
    return path, _at(model, path), name not in module._non_persistent_buffers_set


class ChainLayer(nn.Module):
    """Consecutive nodes of a traced model: the live values in, the next live values out.

    Called with the live values as one tensor (one value) or a tuple (several, the form a
    :class:`~.pipeline.StageModule` hands on), it returns them the same way; the last layer
    returns the model's output. The model's modules and directly read parameters are held at
    their model paths (see the module doc); ``mirror`` (a stage holding the same paths) is
    where they are looked up, so the stage's own registrations (FSDP2's sharded parameters,
    a buffer moved to the device) are the ones used.
    """

    def __init__(
        self,
        model: nn.Module,
        nodes: Sequence[fx.Node],
        inputs: Sequence[fx.Node],
        outputs: Sequence[fx.Node],
        mounts: Sequence[str],
        constants: dict[str, torch.Tensor],
    ) -> None:
        super().__init__()
        self.program = _Program(tuple(nodes), tuple(inputs), tuple(outputs))
        used = {str(a.target) for n in nodes for a in n.all_input_nodes if a.op == "get_attr"}
        self.parts = [_part(model, p) for p in mounts if p not in constants]
        self.parts += [(name, constants[name], False) for name in sorted(used & set(constants))]
        mount(self, self.parts)

    def forward(self, x: Any, mirror: nn.Module | None = None) -> Any:
        """The next live values (or the model's output) from ``x``, the live values."""
        root = self if mirror is None else mirror
        prog = self.program
        live = (x,) if len(prog.inputs) == 1 else tuple(x)
        if len(live) != len(prog.inputs):
            raise RuntimeError(f"a chain layer takes {len(prog.inputs)} values, got {len(live)}")
        env: dict[fx.Node, Any] = dict(zip(prog.inputs, live, strict=True))

        def value(n: fx.Node) -> Any:
            return _at(root, str(n.target)) if n.op == "get_attr" else env[n]

        for n in prog.nodes:
            args = map_arg(n.args, value)
            kwargs = dict(map_arg(n.kwargs, value))
            if kwargs.get("inplace") is True:
                kwargs["inplace"] = False  # a value received from another stage is a leaf
            if n.op == "call_module":
                env[n] = root.get_submodule(str(n.target))(*args, **kwargs)
            elif n.op == "call_method":
                env[n] = getattr(args[0], str(n.target))(*args[1:], **kwargs)
            else:
                target = n.target
                assert callable(target)
                env[n] = target(*args, **kwargs)
        if prog.outputs and prog.outputs[0].op == "output":
            return map_arg(prog.outputs[0].args[0], value)
        out = tuple(env[n] for n in prog.outputs)
        for n, v in zip(prog.outputs, out, strict=True):
            if not isinstance(v, torch.Tensor):
                raise ConfigError(
                    f"pipeline layer boundary after {n.name}",
                    f"hands a {type(v).__name__}, not a tensor, to a later layer (a pipeline "
                    "sends tensors only)",
                    "use --pipeline 1, or compute that value inside a module",
                )
        return out[0] if len(out) == 1 else out


def chain_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model`` as ``(name, layer)`` pairs that run as a chain (see the module doc).

    Names are the path of each layer's first module call (``encoder.0``). The layers hold the
    model's current modules (resolved now, by path: a module replaced since the trace is the
    one used). Raises ConfigError for a model torch.fx cannot trace.
    """
    t = _traced(model)
    return [
        (name, ChainLayer(model, nodes, ins, outs, mounts, t.constants))
        for name, nodes, ins, outs, mounts in zip(
            t.names, t.nodes, t.inputs, t.outputs, t.mounts, strict=True
        )
    ]
