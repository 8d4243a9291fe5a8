"""Refusals before the swap: layers that mix pixels and have no spatial form, wrong dims.

Why: a clear line naming the module beats an op the watch refuses deep inside
its forward.
"""

from __future__ import annotations

from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.geometry import dynamic_same, layer_geom
from hyfi_imaging.parallel.spatial.kinds import _ADAPTIVE, _DIMS, _SWAP, _WINDOWED, _is_global_pool
from hyfi_imaging.parallel.spatial.norms import _is_norm_act, _plain_equivalent

__all__: list[str] = []


# torch layers that mix pixels, refused by name unless the registry (kinds.py) gives them a
# spatial form (the watch would refuse their ops too; this names the module). nn.LayerNorm is
# not here: over channels (timm's LayerNorm2d) it acts per pixel, which the watch lets
# through. nn.Upsample, nn.ZeroPad2d, nn.ConstantPad2d, nn.ReflectionPad2d and
# nn.ReplicationPad2d are not here either: their F.interpolate / F.pad calls run in their
# spatial form (parallel/functional.py).
_PIXEL_MIXERS = (
    nn.LPPool1d, nn.LPPool2d, nn.LPPool3d, nn.FractionalMaxPool2d, nn.FractionalMaxPool3d,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm, nn.PixelShuffle,
    nn.PixelUnshuffle, nn.Unfold, nn.Fold, nn.ReflectionPad1d, nn.ReflectionPad3d,
    nn.ReplicationPad1d, nn.ReplicationPad3d,
    nn.CircularPad1d, nn.MultiheadAttention, nn.MaxUnpool1d, nn.MaxUnpool2d, nn.MaxUnpool3d,
)  # fmt: skip
#: Those without a spatial form.
_UNSUPPORTED = tuple(c for c in _PIXEL_MIXERS if c not in _SWAP)


#: How messages name a grid of each number of axes.
_GRID_NAMES = {1: "a 1-D grid (L<GL>)", 2: "a 2-D grid (GYxGX)", 3: "a 3-D grid (GZxGYxGX)"}


def _check_dims(name: str, m: nn.Module, nd: int) -> None:
    """Refuse a layer of another number of spatial dims than the grid's.

    Only for layers that see tile data (or when the model fails on the probe, where such a
    layer is the likely cause): a Conv1d on the pooled channel vector ``(N, 1, C)`` of ECA
    attention sees no tile and stays a plain layer.
    """
    for dims, layers in _DIMS.items():
        if dims != nd and isinstance(m, layers):
            raise ConfigError(
                f"module {name!r} ({type(m).__name__})",
                f"is a {dims}-D layer on tile data but the model is tiled on {_GRID_NAMES[nd]}",
                f"tile a model of {dims}-D layers on {_GRID_NAMES[dims]}",
            )


def _check_tiled(name: str, m: nn.Module, nd: int) -> None:
    """Refuse a layer that sees tile data and is only spatial on some grids: a layer of
    another number of dims (:func:`_check_dims`), a BatchNorm1d off a 1-D grid."""
    _check_dims(name, m, nd)
    if not isinstance(m, nn.BatchNorm1d):
        return
    where = f"module {name!r} ({type(m).__name__})"
    if nd != 1:
        raise ConfigError(
            where,
            f"normalises tile data (N, C, L) but the model is tiled on {_GRID_NAMES[nd]}",
            "apply BatchNorm1d after the global pool, or tile a model of 1-D layers on a 1-D "
            "grid (L<GL>)",
        )
    if type(m) is not nn.BatchNorm1d:
        raise ConfigError(where, "is a BatchNorm1d subclass", "use plain nn.BatchNorm1d")


def _check(name: str, m: nn.Module, nd: int = 2) -> None:
    where = f"module {name!r} ({type(m).__name__})"
    if isinstance(m, _UNSUPPORTED):
        raise ConfigError(
            where,
            "mixes pixels and has no spatial (tiled) form",
            "replace it with Conv2d/MaxPool2d/AvgPool2d/BatchNorm2d/global average pooling "
            "(or their 1-D and 3-D forms), or run without spatial parallelism",
        )
    # A layer of another number of dims is judged once the watch says whether it sees
    # tiles (_check_tiled).
    if isinstance(m, nn.AdaptiveMaxPool1d | nn.AdaptiveMaxPool2d | nn.AdaptiveMaxPool3d) and (
        m.return_indices
    ):
        raise ConfigError(where, "return_indices=True is not supported", "use return_indices=False")
    if isinstance(m, _ADAPTIVE) and not _is_global_pool(m):
        raise ConfigError(
            where,
            f"adaptive pooling to {m.output_size} depends on the whole image's size",
            "use global pooling (output size 1)",
        )
    if isinstance(m, nn.MaxPool1d | nn.MaxPool2d | nn.MaxPool3d) and m.return_indices:
        raise ConfigError(where, "return_indices=True is not supported", "use return_indices=False")
    if _is_norm_act(m) or _plain_equivalent(m) is not None or dynamic_same(m):
        return  # a known timm layer with a spatial form (see _norm_act, SpatialConv2dSame)
    for bn in (nn.BatchNorm2d, nn.BatchNorm3d):
        if isinstance(m, bn) and type(m) is not bn:
            raise ConfigError(where, f"is a {bn.__name__} subclass", f"use plain nn.{bn.__name__}")
    if isinstance(m, nn.BatchNorm1d):
        return  # judged once the watch says whether it sees tiles (_check_tiled)
    if isinstance(m, tuple(_SWAP)) and type(m) not in _SWAP:
        raise ConfigError(where, "subclasses a pixel-mixing layer", "use the plain torch.nn layer")
    if isinstance(m, _WINDOWED):
        try:
            layer_geom(m)  # refuses padding_mode != zeros, an avg-pool's ceil_mode divisor
        except ConfigError as err:
            raise ConfigError(where, err.what, err.fix) from None
    # Any other module is judged by what it does to tile data: see parallel/watch.py.
