"""Deep halos in the planner: the borders a run of layers carries, counted in its memory.

Why: with ``halo_depth`` > 1 one exchange serves a run of windowed layers (the runtime's
:func:`~.spatial.carry._plan_deep_halos`); every layer of the run but the last computes its
output *and* the border the rest of the run reads, the BatchNorms and per-pixel layers in
between keep that border too, and a layer whose input carries one masks a copy of it outside
the image. The planner traces the plain model on a tile, which keeps none of these: measured
17-30 % under the peaks of ResNet-18 runs at depth 2 and 4. The runs are the runtime's own,
found on a meta copy spatialized as training does; the trace's tensors are grown by them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from hyfi_imaging.parallel.geometry import layer_geom
from hyfi_imaging.parallel.halo import Neighbours
from hyfi_imaging.parallel.memory import SavedActivations
from hyfi_imaging.parallel.meta import meta_copy
from hyfi_imaging.parallel.spatial import spatialize
from hyfi_imaging.parallel.spatial.kinds import WINDOWED_LAYERS

__all__ = ["Borders", "deep_borders", "deepen"]

Border = tuple[int, ...]  # (before, after) per spatial axis


@dataclass(frozen=True)
class Borders:
    """Per module path of a deep run: the border its input and its output carry, and the
    deeper halo each run's first layer receives (:func:`~.geometry.carried_halos`)."""

    carried: Mapping[str, tuple[Border, Border]]
    heads: Mapping[str, Border]

    def __bool__(self) -> bool:
        return bool(self.heads)

    def renamed(self, paths: Mapping[str, str]) -> Borders:
        """The same borders under other module paths (``paths``: old -> new; a trace's, which
        names a module by the pipeline layer holding it)."""
        return Borders(
            {paths.get(k, k): v for k, v in self.carried.items()},
            {paths.get(k, k): v for k, v in self.heads.items()},
        )


def deep_borders(
    model: nn.Module,
    grid: Sequence[int],
    tile: Sequence[int],
    depth: int,
    stage_cuts: bool,
    in_chans: int | None = None,
) -> Borders:
    """The runs ``halo_depth`` ``depth`` forms in ``model`` (of ``in_chans`` input channels) on
    ``grid``'s tiles of ``tile`` (:func:`~.spatial.swap.spatialize` on a meta copy: the
    runtime's planning, not a copy of it)."""
    if depth <= 1 or all(g == 1 for g in grid):
        return Borders({}, {})
    copy = meta_copy(model)
    image = [t * g for t, g in zip(tile, grid, strict=True)]
    ctx = spatialize(copy, grid=tuple(grid), tile=tuple(tile), neighbours=Neighbours(),
                     group=None, in_chans=in_chans, halo_depth=depth, stage_cuts=stage_cuts,
                     image_size=image)  # fmt: skip
    nd = len(grid)
    zero = (0,) * (2 * nd)
    carried: dict[str, tuple[Border, Border]] = {}
    for path, m in copy.named_modules():
        inn, out = getattr(m, "hyfi_carry", ((), ()))
        if any(inn) or any(out):
            carried[path] = (tuple(inn) or zero, tuple(out) or zero)
    modules = dict(copy.named_modules())
    heads: dict[str, Border] = {}
    for run in ctx.deep_runs:
        first = modules[run[0]]
        out = carried.get(run[0], (zero, zero))[1]  # a run of 1x1 layers carries nothing
        heads[run[0]] = tuple(
            v for a, g in enumerate(first.hyfi_geoms) for v in g.halo((out[2 * a], out[2 * a + 1]))
        )
    return Borders(carried, heads)


def _grown(shape: Sequence[int], border: Border) -> float:
    """How many times ``shape``'s spatial area the area with ``border`` around it is."""
    nd = len(border) // 2
    sides = shape[-nd:]
    area = math.prod(sides)
    return math.prod(t + border[2 * k] + border[2 * k + 1] for k, t in enumerate(sides)) / max(
        1, area
    )


def deepen(
    trace: SavedActivations, borders: Borders, modules: Mapping[str, nn.Module]
) -> SavedActivations:
    """``trace`` (of the plain layers on a tile) as the deep runs of ``borders`` hold it.

    Each call's input and output grow by the borders they carry (a per-pixel layer between
    two layers of a run carries its input's); a storage grows with the call it is the input
    of; a layer whose input carries a border keeps, besides, the copy masked outside the
    image (on a tile at the image's corner, the busiest: every grid has one).
    """
    if not borders:
        return trace
    zero: Border = ()
    calls = []
    grow_in: dict[int, float] = {}  # storage key -> growth, from the first call reading it
    masked: list[tuple[str, int, int]] = []  # (path, input's storage key, bytes) of the copies
    carry: Border = zero
    last_out = -1
    for path, key, in_b, out_b, in_shape in trace.calls:
        m = modules.get(path)
        windowed = isinstance(m, WINDOWED_LAYERS)
        if path in borders.carried:
            inn, out = borders.carried[path]
        elif not windowed and any(carry) and in_b == last_out:
            inn = out = carry  # a per-pixel layer on the run's carried border
        else:
            inn = out = zero
        nd = len(inn) // 2 or len(out) // 2
        fin = _grown(in_shape, inn) if nd else 1.0
        if nd and windowed:
            strides = _strides(m, nd)
            out_shape: Sequence[int] = [
                t // s for t, s in zip(in_shape[-nd:], strides, strict=True)
            ]
        else:
            out_shape = in_shape
        fout = _grown(out_shape, out) if nd else 1.0
        grow_in.setdefault(key, fin)
        if windowed and any(inn):
            masked.append((path, key, round(in_b * fin)))
        calls.append(
            (path, key, round(in_b * fin), round(out_b * fout), _grow_shape(in_shape, inn))
        )
        carry, last_out = out, out_b
    storages = [
        (key, owner, round(nbytes * grow_in.get(key, 1.0)), dtype)
        for key, owner, nbytes, dtype in trace.storages
    ]
    fresh = itertools.count(-1, -1)  # keys no real storage has
    dtypes = {key: dtype for key, _, _, dtype in storages}
    for path, key, nbytes in masked:
        at = next((i for i, s in enumerate(storages) if s[1] == path), len(storages))
        storages.insert(at, (next(fresh), path, nbytes, dtypes.get(key, torch.float32)))
    by_module: dict[str, int] = {}
    for _, owner, nbytes, _ in storages:
        by_module[owner] = by_module.get(owner, 0) + nbytes
    return replace(trace, calls=calls, storages=storages, by_module=by_module)


def _strides(m: nn.Module | None, nd: int) -> tuple[int, ...]:
    assert m is not None
    return tuple(g.stride for g in layer_geom(m))[-nd:]


def _grow_shape(shape: tuple[int, ...], border: Border) -> tuple[int, ...]:
    nd = len(border) // 2
    if not nd:
        return shape
    head = shape[: len(shape) - nd]
    return (*head, *(t + border[2 * k] + border[2 * k + 1] for k, t in enumerate(shape[-nd:])))
