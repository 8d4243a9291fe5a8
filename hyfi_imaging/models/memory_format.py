"""The memory layout of a model's maps: NCHW, or channels-last (``model.memory_format``).

Why channels-last: it is the layout cuDNN's fast bfloat16 convolutions use (plain PyTorch's
ResNet-50 step was 1.8x faster so on an H200, ``docs/benchmarks.md``). A convolution runs
in the layout of its weights or its input, as PyTorch's layout test
(``suggest_memory_format``) reads their strides; the engine keeps a channels-last model's
layout where it would otherwise be lost (:mod:`hyfi_imaging.parallel.sharding`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["CHANNELS_LAST", "in_layout", "model_layout", "to_channels_last"]

#: The channels-last layout of each number of dims of a map.
CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def model_layout(model: nn.Module) -> torch.memory_format | None:
    """The channels-last layout of ``model``'s convolution weights, else None (NCHW)."""
    for p in model.parameters():
        fmt = CHANNELS_LAST.get(p.dim())
        if fmt is not None and not p.is_contiguous() and p.is_contiguous(memory_format=fmt):
            return fmt
    return None


def in_layout(t: object, fmt: torch.memory_format, *, copy: bool) -> object:
    """``t`` in the channels-last layout ``fmt`` with its standard strides, when ``t`` is a
    floating-point map of that layout's dims; anything else as it is.

    Already in that order with another stride on a size-1 dimension (the batch of one image,
    as FSDP2's view of a unit's input leaves it): the same elements through views, no copy.
    In another order: copied into ``fmt`` if ``copy`` (a stage's input, which the engine
    hands torch contiguous), else left as it is (inside the model, a map the model's own
    code laid out otherwise, as a ``reshape``'s output, and may ``view`` so).
    """
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return t
    if CHANNELS_LAST.get(t.dim()) is not fmt:
        return t
    if not t.is_contiguous(memory_format=fmt):
        return t.contiguous(memory_format=fmt) if copy else t
    last = (0, *range(2, t.dim()), 1)  # (N, *spatial, C): there, the standard order
    flat = t.permute(last)
    if flat.stride() == _standard_strides(flat.shape):
        return t
    restrided = flat.view(flat.shape)  # a view's strides: the standard ones of its order
    return restrided.permute(0, t.dim() - 1, *range(1, t.dim() - 1))


def _standard_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def to_channels_last(model: nn.Module) -> None:
    """Lay ``model``'s 2-D and 3-D convolution weights out channels-last, in place (a
    convolution then runs, and gives its map, in that layout; the engine keeps it on tiles
    and shards, :mod:`hyfi_imaging.parallel.sharding`). Per weight, by its dims: a model may
    hold both (``Module.to`` takes one layout for all)."""
    for p in model.parameters():
        if p.dim() in CHANNELS_LAST:
            p.data = p.data.contiguous(memory_format=CHANNELS_LAST[p.dim()])
