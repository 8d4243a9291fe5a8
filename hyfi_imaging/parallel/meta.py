"""A model's twin on the meta device: what every shape trace and plan runs.

Why one function: the watch, the tile alignment, the pipeline's stage boundaries, FSDP2's
units, the planner and ``verify_model`` each traced a ``copy.deepcopy(model).to("meta")``,
which copied every weight's data first and ran each layer's forward as it is -- and a
``BatchNorm2d(momentum=None)`` (a cumulative average) reads its batch count with ``.item()``
in training, which a meta tensor has no value for: every trace of such a model failed with a
traceback. Here the weights are never copied, and that average is traced as a momentum
(shapes are all a trace computes).
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

__all__ = ["meta_copy", "shape_copy"]


def meta_copy(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model).to("meta")`` without copying the parameters' and buffers' data
    (a second per copy of ResNet-50): each is given to the copy as its meta twin. BatchNorms
    with ``momentum=None`` trace with a momentum: their update needs a value, not a shape."""
    memo: dict[int, object] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        twin = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            twin = nn.Parameter(twin, requires_grad=t.requires_grad)
        memo[id(t)] = twin
    meta = copy.deepcopy(model, memo)
    for m in meta.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.momentum is None:
            m.momentum = 0.1
    return meta


def shape_copy(model: nn.Module) -> nn.Module:
    """:func:`meta_copy` for a trace of shapes alone (a pipeline's stage boundaries, a head's
    input size): its norms in eval mode. A BatchNorm in training refuses one value per channel
    (batch 1 on a 1x1 map), which a tile's last map can be where the whole image's is not:
    the spatial form normalises over the image, and the trace refused the layout."""
    meta = meta_copy(model)
    for m in meta.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase):
            m.eval()
    return meta
