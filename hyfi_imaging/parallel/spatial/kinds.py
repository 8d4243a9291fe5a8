"""The layer-kind registry: one record per torch layer class the spatial core knows.

Why one place (timm's one-record-per-family habit): adding a layer kind used to
touch six or seven tables over five files (the class swap, the checks of dims,
the windowed layers, deep halos, streaming, the planner). Each record says what
the torch class is to the spatial core -- its spatial form, its number of
spatial dims, its family, whether its window is fixed, whether a deep halo may
run through or across it, whether the stem may stream it, and the planner's
transient factor -- and every table below is derived from the records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from hyfi_imaging.parallel.spatial.convolutions import SpatialConv1d, SpatialConv2d, SpatialConv3d
from hyfi_imaging.parallel.spatial.flatten import _is_gathering_flatten
from hyfi_imaging.parallel.spatial.global_context import is_global_context
from hyfi_imaging.parallel.spatial.global_pools import (
    SpatialGlobalAvgPool1d,
    SpatialGlobalAvgPool2d,
    SpatialGlobalAvgPool3d,
    SpatialGlobalMaxPool1d,
    SpatialGlobalMaxPool2d,
    SpatialGlobalMaxPool3d,
)
from hyfi_imaging.parallel.spatial.instance_norm import SpatialInstanceNorm2d, SpatialInstanceNorm3d
from hyfi_imaging.parallel.spatial.norms import (
    SpatialBatchNorm1d,
    SpatialBatchNorm2d,
    SpatialBatchNorm3d,
    SpatialGroupNorm,
    _is_norm_act,
)
from hyfi_imaging.parallel.spatial.pools import (
    SpatialAvgPool1d,
    SpatialAvgPool2d,
    SpatialAvgPool3d,
    SpatialMaxPool1d,
    SpatialMaxPool2d,
    SpatialMaxPool3d,
)
from hyfi_imaging.parallel.spatial.transposed import (
    SpatialConvTranspose1d,
    SpatialConvTranspose2d,
    SpatialConvTranspose3d,
)

__all__ = [
    "BATCH_NORMS",
    "KINDS",
    "LayerKind",
    "WINDOWED_LAYERS",
    "spatial_dims",
    "streaming_classes",
]


@dataclass(frozen=True)
class LayerKind:
    """What the spatial core knows of one ``torch.nn`` class (exact class, no subclasses).

    ``spatial``: its spatial form. ``dims``: its number of spatial dims (None: any).
    ``family``: the file its spatial form lives in (``convolutions``, ``transposed``,
    ``pools``, ``norms``, ``global_pools``, ``instance_norm``); the halo and the fill
    outside the image follow from it (a window's halo from
    :func:`~hyfi_imaging.parallel.geometry.layer_geom`; 0 outside the image, -inf before
    a max). ``windowed``: a fixed window (its halo and the tile alignment come from its
    geometry). ``dims_checked``: refused on a grid of another number of dims (not
    BatchNorm1d, spatial only on the ``(N, C, L)`` of a 1-D grid; nor GroupNorm, of any
    dims). ``deepable``: a deep halo may run through its window (2-D and 3-D windows).
    ``carrier``: per pixel once its statistics are known, so a deep halo may pass
    across it. ``stream``: the stem streaming's name for it
    (:mod:`hyfi_imaging.parallel.streaming`), None where it does not stream.
    ``transient``: input-sized tensors its backward holds besides the output gradient,
    ``(plain, spatial)``, as the planner counts them (``plan._transient_factor``).
    """

    layer: type[nn.Module]
    spatial: type[nn.Module]
    dims: int | None
    family: str
    windowed: bool = False
    dims_checked: bool = True
    deepable: bool = False
    carrier: bool = False
    stream: str | None = None
    transient: tuple[float, float] = (1.0, 1.0)


def _windowed(
    layer: type[nn.Module], spatial: type[nn.Module], dims: int, family: str, **kw: Any
) -> LayerKind:
    """A fixed-window layer: a deep halo runs through its 2-D and 3-D forms."""
    return LayerKind(layer, spatial, dims, family, windowed=True, deepable=dims > 1, **kw)


#: Every torch class with a spatial form.
KINDS: tuple[LayerKind, ...] = (
    _windowed(nn.Conv1d, SpatialConv1d, 1, "convolutions"),
    _windowed(nn.Conv2d, SpatialConv2d, 2, "convolutions", stream="conv", transient=(2, 2)),
    _windowed(nn.Conv3d, SpatialConv3d, 3, "convolutions"),
    LayerKind(nn.ConvTranspose1d, SpatialConvTranspose1d, 1, "transposed"),
    LayerKind(nn.ConvTranspose2d, SpatialConvTranspose2d, 2, "transposed"),
    LayerKind(nn.ConvTranspose3d, SpatialConvTranspose3d, 3, "transposed"),
    _windowed(nn.MaxPool1d, SpatialMaxPool1d, 1, "pools"),
    _windowed(nn.MaxPool2d, SpatialMaxPool2d, 2, "pools", stream="max", transient=(2, 3)),
    _windowed(nn.MaxPool3d, SpatialMaxPool3d, 3, "pools"),
    _windowed(nn.AvgPool1d, SpatialAvgPool1d, 1, "pools"),
    _windowed(nn.AvgPool2d, SpatialAvgPool2d, 2, "pools", transient=(2, 3)),
    _windowed(nn.AvgPool3d, SpatialAvgPool3d, 3, "pools"),
    # Swapped only where it sees tile data (N, C, L): a head's BatchNorm1d on pooled (N, C)
    # features stays plain (the watch says which modules see tiles; _check_tiled).
    LayerKind(nn.BatchNorm1d, SpatialBatchNorm1d, 1, "norms", dims_checked=False),
    LayerKind(
        nn.BatchNorm2d,
        SpatialBatchNorm2d,
        2,
        "norms",
        carrier=True,
        stream="bn",
        transient=(1, 2),
    ),
    LayerKind(nn.BatchNorm3d, SpatialBatchNorm3d, 3, "norms", carrier=True),
    LayerKind(nn.GroupNorm, SpatialGroupNorm, None, "norms", dims_checked=False),
    LayerKind(nn.InstanceNorm2d, SpatialInstanceNorm2d, 2, "instance_norm"),
    LayerKind(nn.InstanceNorm3d, SpatialInstanceNorm3d, 3, "instance_norm"),
    LayerKind(nn.AdaptiveAvgPool1d, SpatialGlobalAvgPool1d, 1, "global_pools"),
    LayerKind(nn.AdaptiveMaxPool1d, SpatialGlobalMaxPool1d, 1, "global_pools"),
    LayerKind(nn.AdaptiveAvgPool2d, SpatialGlobalAvgPool2d, 2, "global_pools"),
    LayerKind(nn.AdaptiveMaxPool2d, SpatialGlobalMaxPool2d, 2, "global_pools"),
    LayerKind(nn.AdaptiveAvgPool3d, SpatialGlobalAvgPool3d, 3, "global_pools"),
    LayerKind(nn.AdaptiveMaxPool3d, SpatialGlobalMaxPool3d, 3, "global_pools"),
)


def streaming_classes(stream: str) -> tuple[type[nn.Module], ...]:
    """The exact classes, plain and spatial form, the stem streams as ``stream``: a
    subclass may compute something else in its ``forward`` (timm's BatchNormAct2d)."""
    return tuple(c for k in KINDS if k.stream == stream for c in (k.layer, k.spatial))


# The tables the spatial core reads, derived from the records.
#: Windowed, transposed and norm layers: torch class -> spatial form (the class swap).
_SWAP = {k.layer: k.spatial for k in KINDS if k.family != "global_pools"}
#: Adaptive pools: their spatial form when they pool to one value (global pooling).
_GLOBAL_POOLS = {k.layer: k.spatial for k in KINDS if k.family == "global_pools"}
_ADAPTIVE = tuple(_GLOBAL_POOLS)
_WINDOWED = tuple(k.layer for k in KINDS if k.windowed)
#: Layers of each number of spatial dims: a model tiled on a grid of the other kind is refused.
_DIMS = {d: tuple(k.layer for k in KINDS if k.dims == d and k.dims_checked) for d in (1, 2, 3)}
#: The planner's and the speed model's tables (public: read outside the spatial core).
#: Fixed-window layers, every number of dims: each exchanges halo strips on a grid.
WINDOWED_LAYERS: tuple[type[nn.Module], ...] = _WINDOWED
#: Batch norms: each all-reduces its statistics (sum, sum of squares, count) over the grid.
BATCH_NORMS: tuple[type[nn.Module], ...] = tuple(
    k.layer for k in KINDS if k.family == "norms" and k.layer is not nn.GroupNorm
)
#: The spatial forms a deep halo may run through, and those it may pass across.
_DEEPABLE = tuple(k.spatial for k in KINDS if k.deepable)
_CARRIERS = tuple(k.layer for k in KINDS if k.carrier)
_SPATIAL_CARRIERS = tuple(k.spatial for k in KINDS if k.carrier)


def _is_global_pool(m: nn.Module) -> bool:
    """An adaptive pool to one value per channel: global pooling (it has a spatial form)."""
    if not isinstance(m, _ADAPTIVE):
        return False
    size: Any = m.output_size
    return all(v == 1 for v in size) if isinstance(size, tuple | list) else size == 1


def _has_spatial_form(m: nn.Module) -> bool:
    """Layers whose forward is their spatial form's business. Not timm's norm + activation
    layers: their normalisation is (the watch's ``norms``), their ``drop`` and ``act`` are not."""
    if _is_norm_act(m) or getattr(m, "hyfi_norm_act", False):
        return False
    if isinstance(m, nn.Flatten):
        return _is_gathering_flatten(m)
    return isinstance(m, tuple(_SWAP)) or _is_global_pool(m) or is_global_context(m)


def spatial_dims(module: nn.Module) -> int | None:
    """Spatial dims of ``module``'s kind (its class or the nearest registered base class,
    so timm's ``Conv2dSame`` is a ``Conv2d``); None for a kind of any dims or none known."""
    for cls in type(module).__mro__:
        for k in KINDS:
            if k.layer is cls:
                return k.dims
    return None
