"""Pipeline stages: a model's ordered top-level children, cut by a balance.

Why cut at top-level children: every registered model is a
:class:`~hyfi_imaging.models.ChainModel`, whose ``forward`` *is* its top-level
children run in order, each on the previous child's output. Any cut between
children is therefore a valid stage boundary, and the stages chained again are
the model, bit for bit (``tests/test_pipeline.py`` checks it). A *balance* is
the number of children per stage, as in torchgpipe: ``(5, 6)`` gives stage 0
the first five children and stage 1 the other six. Any other module (a U-Net,
a torchvision or timm network, a user's own class) is one layer, the whole
model, on one stage; cut into several, it is its traced chain form
(:mod:`.chain_form`), whose layers hand on the tuple of live tensors
(:func:`model_layers`).

Why a :class:`StageModule` keeps the children under their original names:
``stage.state_dict()`` then has exactly the keys of the full model restricted
to the stage (``layer3.0.conv1.weight``, not ``1.0.conv1.weight``), so a
checkpoint written by one layout loads into any other.

Why stage inputs are ``*args``: ``torch.distributed.pipelining`` sends a tuple
output of one stage as separate tensors and calls the next stage with them as
separate positional arguments. AmoebaNet's cells carry ``(current, previous)``;
:class:`StageModule` packs several arguments back into the tuple the next child
expects, so a cut between two cells needs no special case.

Why stage boundaries are described by *meta* tensors (:func:`stage_boundaries`):
the pipelining runtime can infer shapes by running each stage on real data
(its "dynamic" mode), but that forward pass would run spatial layers -- halo
exchanges and BatchNorm all-reduces -- outside the schedule, and update
BatchNorm running statistics an extra time. Shapes of a tile-sized input
traced through the *unmodified* model on the ``meta`` device are the same as
the spatial layers produce (tiles are aligned to the total stride, so every
layer maps a tile of ``t`` pixels to ``t / stride``), cost nothing, and let
the runtime use its "static" mode. :class:`StageModule` checks every output
shape against them at run time, so a model for which the assumption fails
stops with a message instead of sending a wrongly sized message.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models.registry import ChainModel, CheckpointedBlock, run_chain
from hyfi_imaging.parallel.chain_form import ChainLayer, chain_layers, mount
from hyfi_imaging.parallel.meta import shape_copy

__all__ = [
    "StageModule",
    "as_tuple",
    "check_balance",
    "cut_stages",
    "DEEP_LAYERS",
    "deep_layers",
    "draw_plan",
    "even_balance",
    "is_chain",
    "model_layers",
    "parse_checkpointing",
    "schedule_order",
    "set_checkpointing",
    "stage_boundaries",
    "stage_bounds",
    "stage_called",
]


def is_chain(model: nn.Module) -> bool:
    """Whether ``model.forward`` *is* its top-level children run in order.

    True for :class:`~hyfi_imaging.models.ChainModel` (every registered model)
    and ``nn.Sequential``. Any other module -- a torchvision or timm network, a
    user's own class -- may call its children in another order, call one
    twice, or apply functions between them (``torch.flatten`` before the
    classifier), so its children are no pipeline.
    """
    return isinstance(model, ChainModel | nn.Sequential)


def model_layers(model: nn.Module, stages: int = 1) -> list[tuple[str, nn.Module]]:
    """The ``(name, layer)`` pairs a pipeline of ``stages`` model stages is cut from.

    For a chain (:func:`is_chain`): the model's top-level children. Any other
    module is, for one stage, one layer, the whole model under its class name
    (it runs its own ``forward``); for several, its traced chain form
    (:func:`~.chain_form.chain_layers`: ConfigError naming the fix when torch.fx
    cannot trace it). Raises ConfigError for a chain without children.
    """
    if not is_chain(model):
        if stages > 1:
            return chain_layers(model)
        return [(type(model).__name__, model)]
    layers = list(model.named_children())
    if not layers:
        raise ConfigError(
            type(model).__name__,
            "has no top-level children to cut into pipeline stages",
            "build the model as an ordered chain of modules (see hyfi_imaging.models.ChainModel)",
        )
    return layers


def check_balance(balance: Sequence[int], n_layers: int, stages: int) -> None:
    """Raise ConfigError unless ``balance`` cuts ``n_layers`` children into ``stages`` stages.

    OK: ``check_balance((5, 6), 11, 2)``.
    Error: ``check_balance((5, 5), 11, 2)`` -- the message names the sum and a fix.
    """
    text = ",".join(str(b) for b in balance)
    if len(balance) != stages:
        raise ConfigError(
            f"--balance {text}",
            f"gives {len(balance)} stages but the layout has pp={stages}",
            f"give {stages} layer counts, one per stage (the model has {n_layers} layers)",
        )
    if any(not isinstance(b, int) or b < 1 for b in balance):
        raise ConfigError(
            f"--balance {text}", "every stage needs at least one layer", "use counts >= 1"
        )
    if sum(balance) != n_layers:
        raise ConfigError(
            f"--balance {text}",
            f"sums to {sum(balance)} but the model has {n_layers} top-level layers",
            f"give counts that sum to {n_layers}, e.g. {','.join(map(str, even_balance(n_layers, stages)))}",
        )


def even_balance(n_layers: int, stages: int) -> tuple[int, ...]:
    """Layer counts as equal as possible (earlier stages get the extra layers)."""
    q, r = divmod(n_layers, stages)
    return tuple(q + (1 if i < r else 0) for i in range(stages))


def stage_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` child indices of every stage: ``(2, 3)`` -> ``[(0, 2), (2, 5)]``."""
    bounds, start = [], 0
    for n in balance:
        bounds.append((start, start + n))
        start += n
    return bounds


def as_tuple(x: Any) -> tuple[Any, ...]:
    """A stage output as the tuple of tensors pipelining sends (a tensor becomes ``(x,)``)."""
    return tuple(x) if isinstance(x, tuple | list) else (x,)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (see :class:`StageModule`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def stage_called(stage: nn.Module, called: set[str]) -> set[str]:
    """Of ``called`` (the model paths the whole model's forward calls,
    :func:`~.sharding.called_modules`), those ``stage``'s forward calls: all of them for the
    whole model or a stage of its own children; for a stage of traced layers, the modules
    their programs call and those these call in turn. The plain levels a traced stage mounts
    its modules under (:func:`~.chain_form.mount`) are never called, though the model's
    modules at their paths were: an FSDP2 unit there would never gather its parameters."""
    if not isinstance(stage, StageModule) or not stage.traced:
        return called
    targets = {
        str(n.target)
        for _, layer in stage.traced
        for n in layer.program.nodes
        if n.op == "call_module"
    }
    return {p for p in called if any(p == t or p.startswith(t + ".") for t in targets)}


class StageModule(nn.Module):
    """Consecutive top-level children of a model, under their original names.

    Layers of a traced chain form (:class:`~.chain_form.ChainLayer`) are not
    registered under their layer names: the modules they call are, at their
    model paths (:func:`~.chain_form.mount`), so the stage's parameter names are
    the model's here too; :meth:`named_layers` gives the layers in order.

    ``forward(*args)`` packs several arguments into one tuple (the form a
    multi-input child such as an AmoebaNet cell takes), runs the children in
    order, and returns a tensor or a tuple of tensors in standard contiguous
    layout (a received buffer is filled with bytes in that order).

    Fixed at construction, never written after (the engine hands them in):
    ``planned(n)`` gives the output shapes planned (a meta trace) for a
    micro-batch of ``n`` samples, which the next stage allocated buffers for;
    a mismatch raises before anything is sent (``None``: no check). ``dtype``
    is the dtype of those buffers: outputs of another floating dtype (autocast)
    are cast to it, so the bytes sent match. ``contiguous_grads`` (split-backward
    schedules): the gradient sent back for each input is made contiguous --
    torch's input-only backward (ZBV, DualPipeV) sends what ``autograd.grad``
    returns, which after a halo exchange's backward is a strided view that the
    send refuses.
    """

    def __init__(
        self,
        layers: Sequence[tuple[str, nn.Module]],
        *,
        index: int = 0,
        dtype: torch.dtype | None = None,
        contiguous_grads: bool = False,
        planned: Callable[[int], tuple[tuple[int, ...], ...]] | None = None,
    ) -> None:
        super().__init__()
        #: The traced layers in order (not registered: their modules are, by model path).
        self.traced: tuple[tuple[str, ChainLayer], ...] = tuple(
            (n, m) for n, m in layers if isinstance(m, ChainLayer)
        )
        if self.traced:
            mount(self, [part for _, layer in self.traced for part in layer.parts])
        else:
            for name, module in layers:
                self.add_module(name, module)
        self.index = index
        self.dtype = dtype
        self.contiguous_grads = contiguous_grads
        self.planned = planned

    def _boundary(self, t: Any) -> Any:
        """Contiguous, and in the planned dtype (autocast may have produced another)."""
        if not isinstance(t, torch.Tensor):
            return t
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t.contiguous()

    def named_layers(self) -> list[tuple[str, nn.Module]]:
        """The stage's layers in order: its children, or its traced layers."""
        return list(self.traced) if self.traced else list(self.named_children())

    def forward(self, *args: Any) -> Any:
        """Run the children in order on ``args`` (one tensor, or a tuple given as several args)."""
        if self.contiguous_grads:
            args = tuple(
                _ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a
                for a in args
            )
        x: Any = args[0] if len(args) == 1 else tuple(args)
        if self.traced:
            for _, layer in self.traced:
                x = layer(x, mirror=self)  # the modules as this stage holds them (FSDP2)
        else:
            x = run_chain(list(self.children()), x)
        if isinstance(x, tuple | list):
            x = tuple(self._boundary(t) for t in x)
        else:
            x = self._boundary(x)
        if self.planned is not None:
            got = tuple(tuple(t.shape) for t in as_tuple(x))
            want = self.planned(int(as_tuple(args[0])[0].shape[0]))  # the micro-batch size
            if got != want:
                raise RuntimeError(
                    f"pipeline stage {self.index} produced tensors of shapes {got} but "
                    f"{want} were planned from a meta trace of the model; a layer "
                    "maps a tile to a size other than tile/stride (use 'same' padding)"
                )
        return x


def cut_stages(model: nn.Module, balance: Sequence[int]) -> list[StageModule]:
    """Cut ``model`` into stages of ``balance`` children each (the modules are shared, not copied)."""
    layers = model_layers(model, len(balance))
    check_balance(tuple(balance), len(layers), len(balance))
    return [
        StageModule(layers[start:stop], index=i)
        for i, (start, stop) in enumerate(stage_bounds(balance))
    ]


_EVERY = re.compile(r"\s*every\s*:\s*(\d+)\s*")


def parse_checkpointing(text: str) -> int:
    """Which blocks are checkpointed: ``"none"`` -> 0, ``"full"``, ``"selective"`` and
    ``"deep"`` -> 1 (every block), ``"every:N"`` -> N (every N-th block).

    Error: ``parse_checkpointing("some")`` raises ConfigError listing the forms.
    """
    t = text.strip().lower()
    if t == "none":
        return 0
    if t in ("full", "selective", "deep"):
        return 1
    m = _EVERY.fullmatch(t)
    if m and int(m.group(1)) >= 1:
        return int(m.group(1))
    raise ConfigError(
        f"--checkpointing {text}",
        "is not a checkpointing mode",
        "use none, full (every block), every:N (every N-th block, N >= 1), selective "
        "(every block, convolution outputs kept) or deep (every block, and in the first two "
        "layers of several blocks the blocks' inputs computed again from the layer's)",
    )


def checkpoint_blocks(model: nn.Module, mode: str) -> list[str]:
    """The names of the blocks ``mode`` checkpoints (pure: the model is only read).

    Blocks are the model's :class:`~hyfi_imaging.models.CheckpointedBlock`
    modules numbered 1, 2, ... in module order over the *whole* model, and
    ``every:N`` checkpoints blocks N, 2N, ..., so the same blocks are
    recomputed whatever the pipeline cut; ``selective`` checkpoints every
    block but keeps convolution outputs. Raises ConfigError if checkpointing
    is asked for and the model has no checkpointable block.
    """
    every = parse_checkpointing(mode)
    blocks = [n for n, m in model.named_modules() if isinstance(m, CheckpointedBlock)]
    if every and not blocks:
        raise ConfigError(
            f"--checkpointing {mode}",
            f"{type(model).__name__} has no checkpointable blocks",
            "use --checkpointing none, or build the model from CheckpointedBlock modules",
        )
    return [name for i, name in enumerate(blocks, start=1) if every and i % every == 0]


#: How many of a chain's layers of several blocks ``checkpointing: deep`` runs as deep
#: chains, from the first (the highest resolution) on. Measured on ResNet-50 (bfloat16, one
#: process, the stem streamed; bytes per input pixel alive at once between 1536² and 2048²;
#: CPU time of a step at 1024², one thread; `docs/benchmarks.md`): full checkpointing 248
#: bytes; ``layer1`` 184 (the peak is then ``layer3``'s backward, which still holds
#: ``layer2``'s block inputs) for 1.14x full's time; ``layer1`` and ``layer2`` 152 (the
#: peak is ``layer1``'s backward) for 1.40x. ``deep`` is the mode for the largest image.
DEEP_LAYERS = 2


def deep_layers(model: nn.Module, mode: str) -> tuple[str, ...]:
    """The top-level layers ``checkpointing: deep`` runs as deep chains (pure).

    They are the chain's first :data:`DEEP_LAYERS` layers holding two or more checkpointable
    blocks: in a CNN that downsamples, those at the highest resolutions, whose blocks' kept
    inputs are most of what full checkpointing holds at the end of forward (ResNet-50's
    ``layer1`` and ``layer2``: 160 of 216 bytes per input pixel in bfloat16). A deep
    chain's blocks keep none of their inputs but the layer's, and recompute in units where
    they have them (:func:`~hyfi_imaging.models.registry.deep_chain`). Empty for the other
    modes, and for a chain with no such layer (deep is then full). Raises ConfigError for
    ``deep`` on a model that is not a chain (only a chain runs its layers one by one).
    """
    if mode.strip().lower() != "deep":
        return ()
    if not isinstance(model, ChainModel):
        raise ConfigError(
            f"--checkpointing {mode} on {type(model).__name__}",
            "recomputes the inputs of a chain model's blocks from their layer's; this "
            "model is not a chain",
            "use --checkpointing full",
        )
    several = [
        name
        for name, layer in model.named_children()
        if sum(isinstance(m, CheckpointedBlock) for m in layer.modules()) >= 2
    ]
    return tuple(several[:DEEP_LAYERS])


def set_checkpointing(model: nn.Module, mode: str) -> list[str]:
    """Enable activation checkpointing on the blocks ``mode`` selects
    (:func:`checkpoint_blocks`), with the ``"deep"`` policy on the blocks of the layers
    :func:`deep_layers` names (:func:`~hyfi_imaging.models.registry.deep_chain`);
    returns the blocks' names."""
    chosen = set(checkpoint_blocks(model, mode))
    deep = deep_layers(model, mode)
    selective = mode.strip().lower() == "selective"
    for name, block in model.named_modules():
        if isinstance(block, CheckpointedBlock):
            block.grad_checkpointing = name in chosen
            in_deep = any(name.startswith(layer + ".") for layer in deep)
            block.checkpoint_policy = "selective" if selective else "deep" if in_deep else "full"
    return [n for n, m in model.named_modules() if n in chosen]


def stage_boundaries(
    model: nn.Module,
    balance: Sequence[int],
    input_shape: Sequence[int],
    *,
    dtype: torch.dtype | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """Meta tensors flowing into every stage and out of the last: ``len(balance) + 1`` tuples.

    Entry ``s`` is the input of stage ``s`` (entry 0 the model input of
    ``input_shape``), entry ``len(balance)`` the model output. Traced on a
    ``meta`` copy of ``model``: no memory, no compute, no communication. The
    tensors are contiguous, like the ones :class:`StageModule` sends.
    """
    dtype = dtype or next((p.dtype for p in model.parameters()), torch.get_default_dtype())
    layers = model_layers(shape_copy(model), len(balance))
    check_balance(tuple(balance), len(layers), len(balance))
    x: Any = torch.empty(tuple(input_shape), dtype=dtype, device="meta")
    out: list[tuple[torch.Tensor, ...]] = [(x,)]
    with torch.no_grad(), torch.device("meta"):
        for start, stop in stage_bounds(balance):
            for _, module in layers[start:stop]:
                x = module(x)
            out.append(
                tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in as_tuple(x))
            )
    return out


def schedule_order(schedule: str, stages: int, microbatches: int) -> list[list[tuple[str, int]]]:
    """The order in which every stage runs forward (``"F"``) and backward (``"B"``) micro-batches.

    The same orders as ``torch.distributed.pipelining``: GPipe runs all forwards,
    then all backwards; 1F1B runs ``stages - s`` forwards on stage ``s``, then
    alternates one backward and one forward, then drains the backwards.
    """
    if schedule not in ("gpipe", "1f1b"):
        raise ConfigError(
            f"schedule {schedule}",
            "has no single-pipeline order (it places two stages per rank)",
            "see hyfi_imaging.parallel.schedules for its placement and order",
        )
    out = []
    for s in range(stages):
        if schedule == "gpipe":
            order = [("F", i) for i in range(microbatches)] + [
                ("B", i) for i in range(microbatches)
            ]
        else:
            warm = min(microbatches, stages - s)
            order = [("F", i) for i in range(warm)]
            f, b = warm, 0
            while b < microbatches:
                order.append(("B", b))
                b += 1
                if f < microbatches:
                    order.append(("F", f))
                    f += 1
        out.append(order)
    return out


def draw_plan(
    path: str,
    *,
    layout: Any,
    balance: Sequence[int],
    layer_names: Sequence[str],
    microbatches: int,
    schedule: str,
) -> None:
    """Write a PNG of a plan: which rank holds which stage and tile, and the schedule's timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    # A 3-D grid is drawn with its slabs stacked as rows.
    pp, dp, gx = layout.pp, layout.dp, layout.sp[-1]
    gy = layout.sp_size // gx
    fig, (ax_mesh, ax_time) = plt.subplots(
        1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.5]}
    )
    colours = plt.get_cmap("tab10")
    bounds = stage_bounds(balance)
    rows = dp * gy
    for rank in range(layout.world_size):
        d, p, *tile = layout.coords(rank)
        i, j = (rank % layout.sp_size) // gx, tile[-1]
        x0, y0 = p * (gx + 0.6) + j, (rows - 1 - (d * gy + i)) + (dp - 1 - d) * 0.4
        ax_mesh.add_patch(
            Rectangle((x0, y0), 0.95, 0.95, color=colours(p % 10), alpha=0.75 - 0.4 * d / dp)
        )
        ax_mesh.text(
            x0 + 0.47, y0 + 0.47, f"rank {rank}\ntile ({','.join(map(str, tile))})\ndp {d}",
            ha="center", va="center", fontsize=8,
        )  # fmt: skip
    for p, (start, stop) in enumerate(bounds):
        names = layer_names[start:stop]
        label = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        ax_mesh.text(
            p * (gx + 0.6) + gx / 2, rows + dp * 0.4 + 0.15, f"stage {p}\n{label}",
            ha="center", va="bottom", fontsize=9,
        )  # fmt: skip
    ax_mesh.set_xlim(-0.2, pp * (gx + 0.6))
    ax_mesh.set_ylim(-0.2, rows + dp * 0.4 + 1.0)
    ax_mesh.set_aspect("equal")
    ax_mesh.axis("off")
    ax_mesh.set_title(f"{layout.describe()}: {layout.world_size} ranks", fontsize=10)

    from hyfi_imaging.parallel.schedules import simulate

    orders = schedule_order(schedule, pp, microbatches)  # stage s on rank s
    times = simulate([[[(0, s, k, i) for k, i in o]] for s, o in enumerate(orders)], pp)
    for (_, s, kind, i), (_, t0, t1) in times.items():
        shade = colours(i % 10)
        ax_time.add_patch(
            Rectangle(
                (t0, pp - 1 - s), t1 - t0, 0.9, color=shade, alpha=0.45 if kind == "F" else 0.85
            )
        )
        ax_time.text((t0 + t1) / 2, pp - 1 - s + 0.45, f"{kind}{i}", ha="center", va="center")
    end = max(t1 for _, _, t1 in times.values())
    ideal = (microbatches + pp - 1) / microbatches
    ax_time.set_xlim(0, end)
    ax_time.set_ylim(0, pp)
    ax_time.set_yticks([pp - 1 - s + 0.45 for s in range(pp)], [f"stage {s}" for s in range(pp)])
    ax_time.set_xlabel("time (forward = 1, backward = 2)")
    ax_time.set_title(
        f"{schedule.upper()} with {microbatches} micro-batches: every tile of a stage runs this "
        f"row; ideal time / no-bubble time = {ideal:.2f}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
