"""The tile alignment: the one multiple every tile side of a model is aligned to.

Why one source: the engine, the planner, the loader and the recipe checks all
ask ``tile_alignment``, so they pick the same tiles.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

from torch import nn

from hyfi_imaging.errors import ConfigError, HyfiError
from hyfi_imaging.parallel.functional import Windowed
from hyfi_imaging.parallel.geometry import layer_geom
from hyfi_imaging.parallel.meta import meta_copy
from hyfi_imaging.parallel.spatial.carry import _is_carrier
from hyfi_imaging.parallel.spatial.kinds import _WINDOWED, _has_spatial_form
from hyfi_imaging.parallel.spatial.norms import _is_norm_act
from hyfi_imaging.parallel.spatial.trace import _trace_sizes
from hyfi_imaging.parallel.watch import watch_tiles

__all__ = ["tile_alignment"]


#: Side of the meta-device input the functional-op watch runs the model on.
_PROBE = 512


def _failed_on_meta(err: ConfigError) -> bool:
    """Whether ``err`` says the model's own code failed on the meta device (a shape error),
    rather than refusing what the model does."""
    return err.__cause__ is not None and not isinstance(err.__cause__, HyfiError)


def _watch(
    model: nn.Module,
    reference: nn.Module,
    in_chans: int,
    nd: int,
    image_size: Sequence[int] | None = None,
) -> Any:
    """Which modules and parameters of ``reference`` (a meta copy) see tile data.

    Refuses functions that mix pixels. Traced at the model's ``input_size`` when it
    declares one, else at a large probe size; a model that fails there (a dense head on
    the flattened map takes one size only) is traced again at ``image_size``, the size
    it will run at, and a failure names that size, never a probe the user did not give.
    """
    declared = getattr(model, "input_size", None)
    sizes = [(tuple(int(v) for v in declared), "the model's input_size")] if declared else []
    if not declared:
        origin = "a probe size: no image size was given" if image_size is None else "a probe"
        sizes.append(((_PROBE,) * nd, origin))
        if image_size is not None:
            sizes.append((tuple(int(v) for v in image_size), "the image size given"))
    for k, (probe, origin) in enumerate(sizes):
        try:
            return watch_tiles(
                reference,
                (1, in_chans, *probe),
                _has_spatial_form,
                norms=_is_norm_act,
                carriers=_is_carrier,
                origin=origin,
            )
        except ConfigError as err:
            if k == len(sizes) - 1 or not _failed_on_meta(err):
                raise
    raise AssertionError("unreachable")  # the last size returns or raises


_ALIGNMENTS: weakref.WeakKeyDictionary[nn.Module, dict[int, int]] = weakref.WeakKeyDictionary()


def tile_alignment(
    model: nn.Module,
    nd: int = 2,
    *,
    in_chans: int | None = None,
    image_size: Sequence[int] | None = None,
    _seen: tuple[nn.Module, Any] | None = None,
) -> int:
    """The multiple every tile side of ``model`` is aligned to, for ``nd`` spatial dims.

    The model's ``total_stride`` when it declares one, else the least common
    multiple of the cumulative strides of the layers that see tiles, measured on
    the meta device (remembered per model). The one source of this number: the
    engine, the planner, the loader and the recipe checks all ask here, so they
    pick the same tiles (the planner used to take 1 for a model that declares
    nothing while the engine measured, say, 32). ``image_size``: the size the model
    will run at, traced where the model takes no other (a dense head on the flattened map).
    """
    declared = int(getattr(model, "total_stride", 0))
    if declared:
        return declared
    known = _ALIGNMENTS.setdefault(model, {})
    if nd not in known:
        in_chans = in_chans or int(getattr(model, "in_chans", 3))
        if _seen is None:
            reference = meta_copy(model)
            _seen = (reference, _watch(model, reference, in_chans, nd, image_size))
        reference, use = _seen
        own_size: Sequence[int] | None = getattr(model, "input_size", None)
        fixed = tuple(int(v) for v in own_size or image_size or ()) or None
        tiled = use.tile_modules | use.functional_sites
        known[nd] = _total_stride(reference, in_chans, tiled, nd, fixed)
    return known[nd]


def _total_stride(
    reference: nn.Module,
    in_chans: int,
    tile_modules: set[str],
    nd: int = 2,
    fixed: tuple[int, ...] | None = None,
) -> int:
    """Least common multiple of the cumulative strides of the layers that see tiles.

    Measured by tracing two large inputs (image or volume, ``nd`` spatial dims) on the meta
    device: a layer's jump is the ratio of the differences of the sizes, which cancels the
    pixels unpadded convolutions take off (Inception's: 4096 px give 126 at a jump of 32).
    A model that takes one size only (a dense head on the flattened map) is traced once,
    at ``fixed``, the size the watch ran it at.
    """
    probes: tuple[int, ...] = (4096, 8192)
    try:
        traced = [_trace_sizes(reference, (1, in_chans, *(p,) * nd)) for p in probes]
    except HyfiError:
        raise
    except Exception:
        if fixed is None:
            raise
        probes = (fixed[0],)
        traced = [_trace_sizes(reference, (1, in_chans, *fixed))]
    sizes, _, calls = traced[0]
    layers: list[tuple[str, nn.Module]] = list(reference.named_modules())
    # windowed functions that see tiles (``tile_modules`` holds their site names)
    layers += [(n, c.layer()) for n, c in calls.items() if isinstance(c, Windowed)]
    align = 1
    for name, m in layers:
        if name not in tile_modules:
            continue
        if name in sizes and isinstance(m, _WINDOWED):
            if len(traced) == 2 and traced[1][0][name][0] > sizes[name][0]:
                ratio = (probes[1] - probes[0]) / (traced[1][0][name][0] - sizes[name][0])
            else:
                ratio = probes[0] / sizes[name][0]
            jump = max(1, round(ratio))
            align = math.lcm(align, *(jump * g.stride for g in layer_geom(m, sizes[name])))
    return align
