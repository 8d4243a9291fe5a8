"""Model registry and the contract every registered model honours.

Why a registry: recipes, model cards and the command line name a model by a
string (``"resnet50"``, ``"amoebanet-d-18-256"``), and variants of one family
are *data* (block type, depth, filters) registered under a name, as in timm --
not subclasses. :func:`create_model` is the one way to build a model from a
name; a mistyped name fails with the close matches, an unknown option with the
options the family accepts, both before any memory is allocated.

Why a shared base class (:class:`ChainModel`): the parallel code downstream
needs two properties of every classifier, and they are cheapest to guarantee once:

* **pipeline cuts** are made from the model's ordered top-level children, so
  ``forward`` is *literally* those children run in order, each on the previous
  child's output (a tensor, or a tuple for multi-input cells). Cutting the list
  anywhere gives stages whose composition is the model, bit for bit;
* **spatialization** swaps pixel-mixing leaf modules (Conv2d, pools, BatchNorm2d)
  for halo-exchanging twins, so models use module instances for every
  pixel-mixing op and only pointwise tensor code (add, cat) between them.

The U-Nets are the exception, on purpose (:class:`ModelBase` without the
chain): every decoder level reads an encoder level's output, so a pipeline cut
would ship all the skip tensors across it, and the decoder returns to full
resolution, so a cut would not divide the activation peak either. They run
their own ``forward`` as one stage; the spatial grid is what divides them.

Why checkpointing lives in the blocks (:class:`CheckpointedBlock`) and not in
``forward_features``: a pipeline stage runs a slice of the children directly,
so activation checkpointing must travel with the blocks themselves. The
recomputation in backward runs BatchNorm a second time; the recompute context
restores BatchNorm's running statistics afterwards, so a checkpointed step
leaves exactly the same model state as a plain one.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import fnmatch
import importlib
import inspect
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    get_device_states,
    set_device_states,
)

from hyfi_imaging.errors import ConfigError

__all__ = [
    "ChainModel",
    "CheckpointedBlock",
    "ModelBase",
    "ModelEntry",
    "check_positive",
    "create_model",
    "get_model_entry",
    "chain_run",
    "import_builder",
    "list_models",
    "register_model",
    "deep_chain",
    "set_chain_run",
    "whole_number",
]

F = TypeVar("F", bound=Callable[..., nn.Module])


@dataclass(frozen=True)
class ModelEntry:
    """One registered variant: a builder and the keyword defaults that make the variant."""

    name: str
    builder: Callable[..., nn.Module]
    defaults: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, ModelEntry] = {}


def register_model(
    name: str, builder: Callable[..., nn.Module] | None = None, /, **defaults: Any
) -> Any:
    """Register a model builder under ``name``.

    Two forms, both storing ``builder`` and ``defaults``:

    - table form: ``register_model("resnet50", ResNet, block=Bottleneck, layers=(3, 4, 6, 3))``;
    - decorator form: ``@register_model("my-net")`` above a function or class.

    ``create_model(name, **kw)`` later calls ``builder(**{**defaults, **kw})``.
    Registering a name twice is a programming error (``ValueError``).
    """

    def add(fn: F) -> F:
        if name in _REGISTRY:
            raise ValueError(f"model name {name!r} is already registered")
        _REGISTRY[name] = ModelEntry(name, fn, dict(defaults))
        return fn

    if builder is None:
        return add
    return add(builder)


def list_models(pattern: str | None = None) -> list[str]:
    """Sorted registered names, optionally filtered by a shell pattern (``"resnet*"``)."""
    names = sorted(_REGISTRY)
    if pattern is not None:
        names = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    return names


def get_model_entry(name: str) -> ModelEntry:
    """The registry entry for ``name``; an unknown name raises ConfigError with close matches."""
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(close)}?" if close else "no close match"
        raise ConfigError(
            f"model {name!r}",
            "unknown model name",
            f"{hint} (registered: {', '.join(list_models())})",
        ) from None


def _accepted_kwargs(builder: Callable[..., nn.Module]) -> set[str] | None:
    """Keyword names ``builder`` accepts; None when it takes ``**kwargs``."""
    try:
        params = inspect.signature(builder).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature: let the call decide
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }


def import_builder(path: str) -> Callable[..., nn.Module]:
    """The function a ``"package.module:function"`` path names (``function`` may be dotted).

    OK: ``import_builder("torchvision.models:resnet18")``.
    Error: ``import_builder("torchvision.model:resnet18")`` raises ConfigError naming the
    module that did not import and why.
    """
    module_name, _, attr = path.partition(":")
    where = f"model {path!r}"
    if not module_name or not attr:
        raise ConfigError(where, "is not module:function", "write e.g. torchvision.models:resnet18")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            where,
            f"cannot import {module_name} ({err})",
            "install the package, or put the module's folder on PYTHONPATH",
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            close = difflib.get_close_matches(part, [n for n in dir(obj) if not n.startswith("_")])
            hint = f"did you mean {close[0]}?" if close else f"check the name in {module_name}"
            raise ConfigError(where, f"{module_name} has no {attr}", hint)
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(where, f"{attr} is not callable", "name a function or class")
    return obj


#: Python's words for a call whose arguments do not fit the function.
_ARGUMENT_ERROR = re.compile(
    r"unexpected keyword argument|missing \d+ required|multiple values for|takes \d+ positional"
)


def create_model(name: str, **kwargs: Any) -> nn.Module:
    """Build the registered model ``name``; ``kwargs`` override the variant's defaults.

    ``name`` may also be a Python path ``"package.module:function"`` (a
    torchvision or timm builder, a function of your own): the function is
    called with ``kwargs`` and must return an ``nn.Module``.

    OK: ``create_model("resnet50", num_classes=2, in_chans=1)``;
    ``create_model("torchvision.models:resnet18", num_classes=2)``.
    Error: ``create_model("resnet5")`` raises ConfigError naming ``resnet50`` and the others;
    ``create_model("resnet50", widht=2)`` raises ConfigError listing the accepted options.
    """
    entry = ModelEntry(name, import_builder(name)) if ":" in name else get_model_entry(name)
    accepted = _accepted_kwargs(entry.builder)
    if accepted is not None:
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise ConfigError(
                f"model {name!r}",
                f"unknown option {', '.join(unknown)}",
                f"use one of: {', '.join(sorted(accepted - set(entry.defaults)))}",
            )
    try:
        model = entry.builder(**{**entry.defaults, **kwargs})
    except TypeError as err:
        # a builder without a signature to check first (timm's create_model(**kwargs)): its
        # options refused by the call itself, said in one line (other errors keep their trace)
        if not _ARGUMENT_ERROR.search(str(err)):
            raise
        raise ConfigError(
            f"model {name!r}", f"refuses its options ({err})", "give the options it takes"
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model {name!r}",
            f"returned a {type(model).__name__}, not a torch.nn.Module",
            "return the model from the function",
        )
    return model


def whole_number(where: str, key: str, value: object) -> int:
    """``value`` as an int; a float must be whole (``hyfi-verify --width 8`` passes 8.0)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value == int(value):
        return int(value)
    raise ConfigError(where, f"{key}={value!r} is not a whole number", f"pass e.g. {key}=8")


def check_positive(where: str, **values: float) -> None:
    """Raise ConfigError unless every named value is > 0 (used by the model constructors)."""
    for key, value in values.items():
        if not value > 0:
            raise ConfigError(where, f"{key}={value!r} must be positive", f"pass {key} > 0")


@torch.compiler.disable
def _refuse_compiled_checkpoint(block: str) -> None:
    """Refuse a checkpointed block under torch.compile, raised outside the compiled graph:
    torch 2.11's dynamo, tracing the raise itself, failed with an AssertionError instead
    (measured on an H200; ``docs/benchmarks.md``)."""
    raise ConfigError(
        f"checkpointed block {block}",
        "activation checkpointing cannot run under torch.compile (it keeps BatchNorm "
        "statistics from being updated twice with a context torch.compile refuses)",
        "compile without checkpointing (parallel.checkpointing: none) or run eagerly",
    )


class _RestoreBatchNormStats(contextlib.AbstractContextManager[None]):
    """Snapshot the BatchNorm buffers of ``modules`` on entry, put them back on exit.

    Used as the *recompute* context of activation checkpointing: the second
    forward of a block during backward would otherwise update running_mean,
    running_var and num_batches_tracked a second time.
    """

    def __init__(self, *modules: nn.Module) -> None:
        self.norms = [
            m
            for module in modules
            for m in module.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase)
        ]
        self.saved: list[list[torch.Tensor | None]] = []

    def __enter__(self) -> None:
        self.saved = [
            [None if b is None else b.detach().clone() for b in self._buffers(m)]
            for m in self.norms
        ]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for m, saved in zip(self.norms, self.saved, strict=True):
                for buf, old in zip(self._buffers(m), saved, strict=True):
                    if buf is not None and old is not None:
                        buf.copy_(old)

    @staticmethod
    def _buffers(m: nn.Module) -> list[torch.Tensor | None]:
        return [m.running_mean, m.running_var, m.num_batches_tracked]  # type: ignore[list-item]


class _Both(contextlib.AbstractContextManager[None]):
    """Enter two context managers, leave them in reverse order."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.first.__enter__()
        self.second.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.second.__exit__(*exc)
        finally:
            self.first.__exit__(*exc)


def _keep_convolutions(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing: keep convolution outputs, recompute everything else."""
    return (
        CheckpointPolicy.MUST_SAVE
        if op is torch.ops.aten.convolution.default
        else CheckpointPolicy.PREFER_RECOMPUTE
    )


class CheckpointedBlock(nn.Module):
    """A block that can recompute its activations in backward instead of storing them.

    Subclasses implement :meth:`forward_block`; ``forward`` wraps it in
    :func:`torch.utils.checkpoint.checkpoint` (non-reentrant) when
    ``grad_checkpointing`` is set and autograd is recording. Values and
    gradients are unchanged; BatchNorm running statistics are updated once.

    ``checkpoint_policy``: ``"full"`` keeps only the block's input and
    recomputes the whole block in backward; ``"selective"`` also keeps every
    convolution's output (PyTorch's selective activation checkpointing) and
    recomputes only the cheap layers between them (BatchNorm, ReLU, additions,
    and the halo exchanges that rebuild each convolution's input), trading a
    little memory for not running the convolutions twice; ``"deep"`` is
    ``"full"`` in a layer of a chain whose blocks do not keep their inputs but compute
    them again from the layer's input (:func:`deep_chain`; ``checkpointing: deep``), and, in a block
    that has units (``unit_starts``), each unit is checkpointed again
    inside the block (:meth:`unit`), so that the block's recomputation keeps
    only the units' outputs and one unit's internals at a time. The policy is
    the blocks' own attribute, so a copy of the model checkpoints alike.
    """

    grad_checkpointing: bool = False
    checkpoint_policy: str = "full"

    @property
    def unit_starts(self) -> tuple[str, ...]:
        """The names of the children that start each unit :meth:`forward_block` runs through
        :meth:`unit` (policy ``"deep"``), in call order; none for a block without units (the
        planner reads them to count a unit's internals)."""
        return ()

    def unit(self, fn: Callable[..., Any], *args: Any, modules: Sequence[nn.Module]) -> Any:
        """``fn(*args)``: a unit of the block of ``modules``, checkpointed again under the
        ``"deep"`` policy while autograd records (its BatchNorm statistics restored after
        its recomputation), else run plainly."""
        deep = self.grad_checkpointing and self.checkpoint_policy == "deep"
        if not deep or not torch.is_grad_enabled():
            return fn(*args)
        return checkpoint(
            fn,
            *args,
            use_reentrant=False,
            context_fn=lambda: (contextlib.nullcontext(), _RestoreBatchNormStats(*modules)),
        )

    def _checkpoint_contexts(self) -> tuple[Any, Any]:
        restore = _RestoreBatchNormStats(self)
        if self.checkpoint_policy == "selective":
            forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(_keep_convolutions)
            return forward_ctx, _Both(restore, recompute_ctx)  # snapshot outside the SAC mode
        return contextlib.nullcontext(), restore

    def forward_block(self, x: Any) -> Any:
        """The block's computation; implemented by subclasses."""
        raise NotImplementedError

    def forward(self, x: Any) -> Any:
        """Run :meth:`forward_block`, checkpointed when enabled."""
        if self.grad_checkpointing and torch.is_grad_enabled():
            if torch.compiler.is_compiling():
                _refuse_compiled_checkpoint(type(self).__name__)
            chain = _DEEP_CHAIN.get()
            with contextlib.nullcontext() if chain is None else chain.saving(self, x):
                out = checkpoint(
                    self.forward_block,
                    x,
                    use_reentrant=False,
                    context_fn=self._checkpoint_contexts,
                )
            if chain is not None:
                chain.ran(self, out)
            return out
        return self.forward_block(x)


#: Runs standing in for consecutive layers of a chain, keyed by their first layer (a
#: side table: nothing is written onto the model's modules). A run is callable and has
#: ``modules``, the layers it replaces in order.
_CHAIN_RUNS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def deep_chain(layer: nn.Module) -> bool:
    """Whether :func:`run_chain` runs ``layer`` of a chain as a deep chain
    (:class:`_DeepChain`): its first checkpointed block (in module order) has the ``"deep"``
    policy (``checkpointing: deep`` sets it on every block of its layers)."""
    block = next((m for m in layer.modules() if isinstance(m, CheckpointedBlock)), None)
    return block is not None and block.grad_checkpointing and block.checkpoint_policy == "deep"


def _outermost_blocks(module: nn.Module) -> Iterator[CheckpointedBlock]:
    """The checkpointed blocks below ``module`` that are not inside another one, in order."""
    for child in module.children():
        if isinstance(child, CheckpointedBlock):
            yield child
        else:
            yield from _outermost_blocks(child)


def _same_view(a: torch.Tensor, b: torch.Tensor, version: int) -> bool:
    """Whether ``a`` reads the same elements of one storage as ``b`` did when that storage's
    version was ``version`` (so holds the values ``b`` then held: nothing wrote in place)."""
    return (
        a._version == version
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


@dataclass(frozen=True)
class _Step:
    """A block of a deep chain and the random state its forward started in: after the
    block's own pre-hooks (the engine's synchronisation of the random state over a grid, a
    user's), as the block's checkpoint stashes it."""

    block: CheckpointedBlock
    cpu_rng: torch.Tensor
    device_rng: tuple[list[int], list[torch.Tensor]]


@dataclass(frozen=True)
class _Replay:
    """What a deep chain's block keeps instead of its input: the chain's input, the blocks
    before it with their random states, and the autocast state the chain ran in, to compute
    the input again when the block's backward asks for it (:meth:`tensor`)."""

    x0: torch.Tensor
    x0_version: int
    before: tuple[_Step, ...]
    requires_grad: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool

    def tensor(self) -> torch.Tensor:
        """The block's input again: the chain's input through the blocks before it, with no
        graph (the block's recomputation needs its values only), each block from the random
        state its forward started in, in the chain's autocast state, the BatchNorm
        statistics left as they were. Each block runs as its checkpoint recomputes it
        (:meth:`~CheckpointedBlock.forward_block`): the block's own hooks ran in its forward
        and do not run again (a hook keeping a block's output for a loss of its own would be
        handed a copy without a graph). Raises RuntimeError, as autograd does for a saved
        tensor, if the layer's input was written in place since."""
        if self.x0._version != self.x0_version:
            raise RuntimeError(
                "checkpointing deep: the input of a deep chain's layer was modified by an "
                "in-place operation after the layer ran; its blocks' inputs cannot be computed "
                "again (use --checkpointing full, or do not modify the layer's input in place)"
            )
        kind = self.x0.device.type
        devices = self.before[0].device_rng[0]
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(torch.random.fork_rng(devices=devices, device_type=kind))
            for device_type, enabled, dtype in self.autocast:
                stack.enter_context(
                    torch.amp.autocast(
                        device_type, enabled=enabled, dtype=dtype, cache_enabled=self.autocast_cache
                    )
                )
            stack.enter_context(_RestoreBatchNormStats(*(s.block for s in self.before)))
            x = self.x0
            for step in self.before:
                torch.set_rng_state(step.cpu_rng)
                set_device_states(*step.device_rng, device_type=kind)
                x = step.block.forward_block(x)
        return x.detach().requires_grad_(self.requires_grad)


class _DeepChain:
    """One forward of a layer that ``checkpointing: deep`` runs as a chain of its blocks.

    Each checkpointed block already keeps only its input; here a block whose input is the
    previous block's output keeps a :class:`_Replay` instead, and computes its input again
    from the layer's input when its own backward starts. So while a block is
    back-propagated only the layer's input and that block's input are alive, not every
    earlier block's output (ResNet-50's ``layer1``: one map of 32 bytes per input pixel in
    bfloat16 fewer at the step's peak). For ``n`` blocks this runs ``n (n - 1) / 2`` block
    forwards more, without a graph. A block that does not read the previous one's output
    as that block returned it (a layer with code between its blocks, in place or not) keeps
    its input, and so does every block after it.
    """

    def __init__(self, layer: nn.Module, x0: torch.Tensor) -> None:
        self.members = set(_outermost_blocks(layer))
        self.x0 = x0
        self.before: list[_Step] = []
        self.last: torch.Tensor | None = x0  # the output of ``before[-1]``; None: chain broken
        self.last_version = self.x0_version = x0._version
        self.pending: _Step | None = None  # the block running, if it continues the chain
        kinds = dict.fromkeys(["cpu", x0.device.type])
        self.autocast = tuple(
            (k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds
        )
        self.autocast_cache = torch.is_autocast_cache_enabled()

    def saving(self, block: CheckpointedBlock, x: Any) -> Any:
        """The saved-tensor hooks under which ``block``'s checkpoint keeps its input ``x``;
        call :meth:`ran` with its output after it."""
        if block not in self.members:
            return contextlib.nullcontext()
        chained = (
            self.last is not None
            and isinstance(x, torch.Tensor)
            and _same_view(x, self.last, self.last_version)
        )
        self.last = None  # until :meth:`ran` says the chain goes on
        self.pending = (
            _Step(block, torch.get_rng_state(), get_device_states(x)) if chained else None
        )
        if not chained or not self.before:
            return contextlib.nullcontext()
        replay = _Replay(
            self.x0, self.x0_version, tuple(self.before), x.requires_grad, self.autocast,
            self.autocast_cache,
        )  # fmt: skip
        saved = weakref.ref(x)  # the hooks outlive the call: they must not hold ``x``
        return torch.autograd.graph.saved_tensors_hooks(
            lambda t: replay if t is saved() else t,
            lambda p: p.tensor() if isinstance(p, _Replay) else p,
        )

    def ran(self, block: CheckpointedBlock, out: Any) -> None:
        """Record that ``block`` ran: the chain goes on from ``out`` if its input continued it
        (a block inside it, which is no member, changes nothing)."""
        step = self.pending
        if step is None or step.block is not block:
            return
        self.pending = None
        if isinstance(out, torch.Tensor):
            self.before.append(step)
            self.last, self.last_version = out, out._version


_DEEP_CHAIN: contextvars.ContextVar[_DeepChain | None] = contextvars.ContextVar(
    "_DEEP_CHAIN", default=None
)


def _run_layer(layer: nn.Module, x: Any) -> Any:
    """``layer(x)``; as a deep chain (:class:`_DeepChain`) where :func:`deep_chain` says so
    and autograd records."""
    if not torch.is_grad_enabled() or not isinstance(x, torch.Tensor) or not deep_chain(layer):
        return layer(x)
    if torch.compiler.is_compiling():
        _refuse_compiled_checkpoint(type(layer).__name__)
    token = _DEEP_CHAIN.set(_DeepChain(layer, x))
    try:
        return layer(x)
    finally:
        _DEEP_CHAIN.reset(token)


def set_chain_run(first: nn.Module, run: Any) -> None:
    """Let ``run`` stand in for ``run.modules`` (starting at ``first``) in :func:`run_chain`."""
    _CHAIN_RUNS[first] = run


def chain_run(first: nn.Module) -> Any:
    """The run registered for the layers starting at ``first``, or None."""
    return _CHAIN_RUNS.get(first)


def run_chain(modules: Sequence[nn.Module], x: Any) -> Any:
    """``x`` through ``modules`` in order, as a chain model and a pipeline stage run them.

    A run registered with :func:`set_chain_run` (a streamed stem runs its layers in row
    bands) stands in for its layers when all of them follow, in order; a pipeline cut
    inside it runs them one by one. A layer :func:`deep_chain` names runs as a deep chain.
    """
    i = 0
    while i < len(modules):
        run = _CHAIN_RUNS.get(modules[i])
        if run is not None and list(modules[i : i + len(run.modules)]) == run.modules:
            x = run(x)
            i += len(run.modules)
        else:
            x = _run_layer(modules[i], x)
            i += 1
    return x


class ModelBase(nn.Module):
    """What every registered model offers, chain or not.

    Attributes set by subclasses:

    - ``num_classes``, ``in_chans``: as passed to the constructor (for a dense model,
      ``num_classes`` is the channels of the per-pixel output; for a regression model,
      the number of targets);
    - ``total_stride``: input pixels per pixel of the coarsest feature map; spatial tiles
      are aligned to it so that every strided layer sees tile offsets that divide its stride;
    - ``dims``: spatial dimensions of the input, 2 (images) unless a 3-D model says 3.

    Not every model is a chain: a U-Net's decoder reads the encoder's outputs across the
    network (skip connections), so it derives from this class only and runs its own
    ``forward`` on one pipeline stage; several stages cut its traced chain form
    (``parallel/chain_form.py``).
    """

    num_classes: int
    in_chans: int
    total_stride: int
    dims: int = 2

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute every block's activations in backward (saves memory, same results)."""
        for block in self.blocks():
            block.grad_checkpointing = enable

    def blocks(self) -> Iterator[CheckpointedBlock]:
        """All checkpointable blocks, in module order."""
        for m in self.modules():
            if isinstance(m, CheckpointedBlock):
                yield m


class ChainModel(ModelBase):
    """Base of the classifiers and regressors: ``forward`` is the top-level children in order.

    Attributes set by subclasses, besides :class:`ModelBase`'s:

    - ``num_features``: channels of the :meth:`forward_features` output;
    - ``head_start``: index of the first top-level child that belongs to the head.
    """

    num_features: int
    head_start: int

    def _run(self, x: Any, start: int, stop: int | None) -> Any:
        return run_chain(list(self.children())[start:stop], x)

    def forward_features(self, x: torch.Tensor) -> Any:
        """The feature map before global pooling (the children before the head)."""
        return self._run(x, 0, self.head_start)

    def forward_head(self, feats: Any) -> torch.Tensor:
        """Logits from :meth:`forward_features` output (the head's children)."""
        out: torch.Tensor = self._run(feats, self.head_start, None)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits: the top-level children run in order, each on the previous output."""
        out: torch.Tensor = self._run(x, 0, None)
        return out
