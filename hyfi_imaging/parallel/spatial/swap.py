"""``spatialize()``: the class swap that turns a model's layers into their spatial forms.

Why a class swap: parameter names, state dicts, optimizers and hooks are
untouched, so a checkpoint moves freely between layouts. Named ``swap`` (not
``spatialize``) so that the package's ``spatialize`` is always the function.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.functional import SpatialFunctions
from hyfi_imaging.parallel.geometry import dynamic_same, layer_geom
from hyfi_imaging.parallel.halo import Neighbours
from hyfi_imaging.parallel.meta import meta_copy
from hyfi_imaging.parallel.randomness import install_rng_sync
from hyfi_imaging.parallel.spatial.alignment import _failed_on_meta, _watch, tile_alignment
from hyfi_imaging.parallel.spatial.base import _AXES
from hyfi_imaging.parallel.spatial.carry import _plan_deep_halos
from hyfi_imaging.parallel.spatial.checks import _check, _check_dims, _check_tiled
from hyfi_imaging.parallel.spatial.context import SpatialContext
from hyfi_imaging.parallel.spatial.convolutions import SpatialConv2dSame
from hyfi_imaging.parallel.spatial.flatten import SpatialFlatten, _is_gathering_flatten
from hyfi_imaging.parallel.spatial.global_context import is_global_context, spatial_global_context
from hyfi_imaging.parallel.spatial.kinds import (
    _GLOBAL_POOLS,
    _SWAP,
    _WINDOWED,
    _has_spatial_form,
    _is_global_pool,
)
from hyfi_imaging.parallel.spatial.norms import (
    SpatialBatchNorm2d,
    SpatialGroupNorm,
    _is_norm_act,
    _norm_act,
    _plain_equivalent,
)

__all__ = ["spatialize"]


def spatialize(
    model: nn.Module,
    *,
    grid: tuple[int, ...],
    tile: tuple[int, ...],
    neighbours: Neighbours,
    group: Any,
    in_chans: int | None = None,
    align: int | None = None,
    overlap: bool = False,
    halo_depth: int = 1,
    stage_cuts: bool = False,
    backward_bands: bool = False,
    image_size: Sequence[int] | None = None,
) -> SpatialContext:
    """Turn ``model`` (in place) into its spatial form for tile ``tile`` of ``grid``.

    Returns the :class:`SpatialContext`; call its ``set_image_size`` before the
    forward pass and feed each rank ``image[..., ctx.tile_slice(hw)]`` of the
    image padded to ``ctx.padded_size(hw)``. Raises ConfigError naming the module
    path of any layer that mixes pixels and has no spatial form.

    ``halo_depth`` > 1: one exchange of a deeper halo serves up to that many
    consecutive windowed layers with a halo (:func:`_plan_deep_halos`);
    ``stage_cuts``: the model's top-level children may become pipeline stages,
    so no deep halo crosses from one to the next.

    The watch runs the model on a meta-device input of the model's ``input_size``
    when it declares one (a dense head on the flattened map, CosmoFlow, runs at
    that size only), else of a large probe size, else (a model that fails there)
    of ``image_size``, the size it will run at.

    A grid of three factors ``(gz, gy, gx)`` tiles a volume model (Conv3d,
    MaxPool3d, AvgPool3d, BatchNorm3d, ConvTranspose3d, 3-D global pools,
    trilinear/nearest F.interpolate) into sub-volumes the same way; a grid of one factor
    ``(gl,)`` tiles a 1-D model (Conv1d, MaxPool1d, AvgPool1d, BatchNorm1d on ``(N, C, L)``,
    ConvTranspose1d, 1-D global pools, linear/nearest F.interpolate) into segments.
    """
    nd = len(grid)
    if nd not in _AXES or len(tile) != nd:
        raise ConfigError(
            "spatial grid",
            f"{tuple(grid)} with tile {tuple(tile)}",
            "give a grid and tile of 1 (L<GL>), 2 (GYxGX) or 3 (GZxGYxGX) entries",
        )
    if halo_depth < 1:
        raise ConfigError("halo_depth", f"is {halo_depth}", "use 1 (a halo per layer) or more")
    if halo_depth > 1 and nd == 1:
        raise ConfigError(
            "halo_depth",
            f"is {halo_depth} on a 1-D grid; deep halos are implemented for 2-D and 3-D grids",
            "use halo_depth=1 (one halo per layer) for signals",
        )
    for name, m in model.named_modules():
        _check(name or type(model).__name__, m, nd)
    in_chans = in_chans or int(getattr(model, "in_chans", 3))
    reference = meta_copy(model)
    try:
        use = _watch(model, reference, in_chans, nd, image_size)
    except ConfigError as err:
        if _failed_on_meta(err):
            # The model's own code failed on the probe: a layer of another number of dims
            # given the tiles' (N, C, *spatial) is the likely cause, and the clearer line.
            for name, m in model.named_modules():
                _check_dims(name or type(model).__name__, m, nd)
        raise
    for name, m in model.named_modules():
        if name in use.tile_modules:
            _check_tiled(name or type(model).__name__, m, nd)
    align = align or tile_alignment(
        model, nd, in_chans=in_chans, image_size=image_size, _seen=(reference, use)
    )
    ctx = SpatialContext(
        grid, tile, neighbours, group, align=align, overlap=overlap, backward_bands=backward_bands
    )
    ctx._reference = reference
    ctx._in_chans = in_chans
    ctx.tile_param_names = use.tile_params
    ctx.rejoined_pools = use.rejoined_pools
    ctx.functional_sites = use.functional_sites
    ctx.seen_sites = use.seen_sites
    ctx.random_modules = use.random_modules
    ctx.rng_hooks = install_rng_sync(model, use.random_modules, group)  # one draw per image
    if use.functional_sites:
        ctx._functions = SpatialFunctions(
            model,
            _has_spatial_form,
            use.functional_sites,
            ctx.run_site,
            lambda: None if ctx.image_hw is None else ctx.traced_calls,
            lambda: ctx.in_forward,
        )
    # Each forward of the model (or of a deep copy) reads the trace of its own modes and
    # arguments; before the function mode's own hooks, which would run the trace on tiles.
    ctx._model = weakref.ref(model)
    model.register_forward_pre_hook(
        lambda m, args, kwargs: ctx.begin_forward(m, args, kwargs), prepend=True, with_kwargs=True
    )
    model.register_forward_hook(lambda m, args, out: ctx.end_forward(), always_call=True)
    for name, m in model.named_modules():
        if name not in use.tile_modules:
            continue  # e.g. a squeeze-excite convolution on the pooled vector: stays plain
        cls = SpatialConv2dSame if dynamic_same(m) else _SWAP.get(_plain_equivalent(m) or type(m))
        if _is_norm_act(m):
            norm = SpatialBatchNorm2d if isinstance(m, nn.BatchNorm2d) else SpatialGroupNorm
            cls = _norm_act(norm, type(m))
        if _is_global_pool(m):
            cls = _GLOBAL_POOLS[type(m)]
        if is_global_context(m):
            cls = spatial_global_context(type(m))
        if _is_gathering_flatten(m):
            cls = SpatialFlatten
            ctx.flatten_paths.add(name)
        if cls is not None:
            m.__class__ = cls
            m.hyfi_path, m.hyfi_ctx = name, ctx
            if isinstance(m, _WINDOWED) and not dynamic_same(m):
                m.hyfi_geoms = layer_geom(m)  # type: ignore[assignment]
    ctx.halo_depth = halo_depth
    ctx.deep_runs = _plan_deep_halos(model, use.links, halo_depth, stage_cuts)
    return ctx
