"""Pipeline stages: a model's ordered top-level children, cut by a balance.

Why cut at top-level children: every registered model is a
:class:`~hyfi_imaging.models.ChainModel`, whose ``forward`` *is* its top-level
children run in order, each on the previous child's output. Any cut between
children is therefore a valid stage boundary, and the stages chained again are
the model, bit for bit (``tests/test_pipeline.py`` checks it). A *balance* is
the number of children per stage, as in torchgpipe: ``(5, 6)`` gives stage 0
the first five children and stage 1 the other six.

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

import copy
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models.registry import CheckpointedBlock

__all__ = [
    "StageModule",
    "as_tuple",
    "check_balance",
    "cut_stages",
    "model_layers",
    "parse_checkpointing",
    "set_checkpointing",
    "stage_boundaries",
    "stage_bounds",
]


def model_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``(name, child)`` pairs a pipeline is cut from: the model's top-level children.

    Raises ConfigError for a model without children (nothing to cut).
    """
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


class StageModule(nn.Module):
    """Consecutive top-level children of a model, under their original names.

    ``forward(*args)`` packs several arguments into one tuple (the form a
    multi-input child such as an AmoebaNet cell takes), runs the children in
    order, and returns a tensor or a tuple of tensors in standard contiguous
    layout (a received buffer is filled with bytes in that order).

    ``expected`` (set by the engine) holds the output shapes the next stage
    allocated buffers for; a mismatch raises before anything is sent.
    """

    def __init__(self, layers: Sequence[tuple[str, nn.Module]], *, index: int = 0) -> None:
        super().__init__()
        for name, module in layers:
            self.add_module(name, module)
        self.index = index
        self.expected: tuple[tuple[int, ...], ...] | None = None

    def forward(self, *args: Any) -> Any:
        """Run the children in order on ``args`` (one tensor, or a tuple given as several args)."""
        x: Any = args[0] if len(args) == 1 else tuple(args)
        for module in self.children():
            x = module(x)
        if isinstance(x, tuple | list):
            x = tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in x)
        elif isinstance(x, torch.Tensor):
            x = x.contiguous()
        if self.expected is not None:
            got = tuple(tuple(t.shape) for t in as_tuple(x))
            if got != self.expected:
                raise RuntimeError(
                    f"pipeline stage {self.index} produced tensors of shapes {got} but "
                    f"{self.expected} were planned from a meta trace of the model; a layer "
                    "maps a tile to a size other than tile/stride (use 'same' padding)"
                )
        return x


def cut_stages(model: nn.Module, balance: Sequence[int]) -> list[StageModule]:
    """Cut ``model`` into stages of ``balance`` children each (the modules are shared, not copied)."""
    layers = model_layers(model)
    check_balance(tuple(balance), len(layers), len(balance))
    return [
        StageModule(layers[start:stop], index=i)
        for i, (start, stop) in enumerate(stage_bounds(balance))
    ]


_EVERY = re.compile(r"\s*every\s*:\s*(\d+)\s*")


def parse_checkpointing(text: str) -> int:
    """``"none"`` -> 0, ``"full"`` -> 1 (every block), ``"every:N"`` -> N (every N-th block).

    Error: ``parse_checkpointing("some")`` raises ConfigError listing the forms.
    """
    t = text.strip().lower()
    if t == "none":
        return 0
    if t == "full":
        return 1
    m = _EVERY.fullmatch(t)
    if m and int(m.group(1)) >= 1:
        return int(m.group(1))
    raise ConfigError(
        f"--checkpointing {text}",
        "is not a checkpointing mode",
        "use none, full (every block) or every:N (every N-th block, N >= 1)",
    )


def set_checkpointing(model: nn.Module, mode: str) -> list[str]:
    """Enable activation checkpointing on the blocks ``mode`` selects; returns their names.

    Blocks are the model's :class:`~hyfi_imaging.models.CheckpointedBlock`
    modules numbered 1, 2, ... in module order over the *whole* model, and
    ``every:N`` checkpoints blocks N, 2N, ..., so the same blocks are
    recomputed whatever the pipeline cut. Raises ConfigError if checkpointing
    is asked for and the model has no checkpointable block.
    """
    every = parse_checkpointing(mode)
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, CheckpointedBlock)]
    if every and not blocks:
        raise ConfigError(
            f"--checkpointing {mode}",
            f"{type(model).__name__} has no checkpointable blocks",
            "use --checkpointing none, or build the model from CheckpointedBlock modules",
        )
    chosen = []
    for i, (name, block) in enumerate(blocks, start=1):
        block.grad_checkpointing = bool(every) and i % every == 0
        if block.grad_checkpointing:
            chosen.append(name)
    return chosen


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
    layers = model_layers(copy.deepcopy(model).to("meta"))
    check_balance(tuple(balance), len(layers), len(balance))
    x: Any = torch.empty(tuple(input_shape), dtype=dtype, device="meta")
    out: list[tuple[torch.Tensor, ...]] = [(x,)]
    with torch.no_grad():
        for start, stop in stage_bounds(balance):
            for _, module in layers[start:stop]:
                x = module(x)
            out.append(
                tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in as_tuple(x))
            )
    return out
