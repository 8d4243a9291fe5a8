"""N-d layer sweep: 1-D segments, 2-D tiles and 3-D sub-volumes, spatial vs one process, float64.

Modelled on LBANN DistConv's suite (``ndims x shard dim x kernel x stride``):
the grid of the launch sets the number of spatial dims and which of them are
sharded (``2x2``: both axes of an image; ``2x1x2``: depth and width of a
volume; ``1x2x2``: height and width), every case sweeps kernel 1/3/5 x stride
1/2 of convolutions and pools, and volume sizes are odd and not divisible by
the grid, so the last tiles hang over the volume and every masking path runs.
On 3-D grids the other volume layers follow: BatchNorm3d, ConvTranspose3d
(stride, padding, output_padding, dilation), nn.Upsample / F.interpolate
(nearest, trilinear with both ``align_corners``), F.pad, the global pools as
modules and as functions (``mean``/``amax`` over ``(2, 3, 4)``), and chains.
On 1-D grids (``L2``, ``L3``: ``(N, C, L)`` signals cut along ``L``) the same
layers in their 1-D forms (linear for trilinear interpolation), BatchNorm1d on
the signal, a whole small 1-D CNN whose head normalises its pooled features with
a plain BatchNorm1d, and the 1-D refusals.

Each case compares the gathered output, the gathered input gradient, every
parameter gradient (tile shares summed over the tiles) and every buffer.

Usage: ``mpiexec -n 4 python tests/mpi/volume_cases.py 2x1x2`` prints one JSON line.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _worker import Case, combine, compare, emit, merge_ranks, parse_grid, run_cases, start
from torch import nn

__all__ = ["SIZES", "case_names", "cases", "main"]

#: Sizes per number of spatial dims: odd, not divisible by the grids, a different remainder per axis.
SIZES: dict[int, tuple[int, ...]] = {1: (37,), 2: (37, 29), 3: (13, 14, 11)}
RTOL = 1e-10
C = 3  # channels

_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_TCONV = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
_MAX = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}
_AVG = {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d}
_BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_IN = {2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}
_GAP = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}
_GMP = {1: nn.AdaptiveMaxPool1d, 2: nn.AdaptiveMaxPool2d, 3: nn.AdaptiveMaxPool3d}


@dataclass(frozen=True)
class Spec:
    """A tiny model: how to build it for ``nd`` dims, its stride product, how to drive it."""

    build: Callable[[int], nn.Module]
    align: int
    train_steps: int = 1
    eval_steps: int = 0
    head: bool = False


class _Mean(nn.Module):
    """A functional global pool: ``x.mean(spatial dims)`` (or amax), then a Linear head."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.fc = kind, nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = tuple(range(2, x.dim()))
        pooled = x.mean(dims) if self.kind == "mean" else x.amax(dims)
        return self.fc(pooled)


class _Interp(nn.Module):
    """``F.interpolate`` to a whole-volume size given at construction (U-Net's ``size=skip``)."""

    def __init__(self, mode: str, align_corners: bool | None, scale: float) -> None:
        super().__init__()
        self.mode, self.align_corners, self.scale = mode, align_corners, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(
            x, scale_factor=self.scale, mode=self.mode, align_corners=self.align_corners
        )


class _Pad(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = (1, -1, 0, 0, -1, 1)[: 2 * (x.dim() - 2)]
        return F.pad(x, pad, value=0.5)  # a shift: the size is kept


def _seq(*make: Callable[[int], nn.Module]) -> Callable[[int], nn.Module]:
    return lambda nd: nn.Sequential(*(m(nd) for m in make))


def _conv(k: int, s: int = 1, p: int | str = 0, **kw: Any) -> Callable[[int], nn.Module]:
    return lambda nd: _CONV[nd](C, C, k, stride=s, padding=p, **kw)


def _tconv(k: int, s: int, p: int = 0, **kw: Any) -> Callable[[int], nn.Module]:
    return lambda nd: _TCONV[nd](C, C, k, stride=s, padding=p, **kw)


def _sweep() -> dict[str, Spec]:
    """DistConv's space: kernel 1/3/5 x stride 1/2, convolutions and both pools."""
    out: dict[str, Spec] = {}
    for k in (1, 3, 5):
        for s in (1, 2):
            p = k // 2
            out[f"conv-k{k}-s{s}"] = Spec(_seq(_conv(k, s, p)), s)
            out[f"maxpool-k{k}-s{s}"] = Spec(_seq(lambda nd, k=k, s=s, p=p: _MAX[nd](k, s, p)), s)
            out[f"avgpool-k{k}-s{s}-excl"] = Spec(
                _seq(lambda nd, k=k, s=s, p=p: _AVG[nd](k, s, p, count_include_pad=False)), s
            )
    return out


#: Every number of dims.
SWEEP = _sweep()
#: Volume-only cases (3-D grids).
VOLUME: dict[str, Spec] = {
    "conv-k2-same": Spec(_seq(_conv(2, 1, "same")), 1),
    "conv-k3-d2-p2": Spec(_seq(_conv(3, 1, 2, dilation=2, bias=False)), 1),
    "conv-k3-s2-p1-g3": Spec(_seq(_conv(3, 2, 1, groups=3)), 2),
    "avgpool-k3-s2-p1-incl": Spec(_seq(lambda nd: _AVG[nd](3, 2, 1)), 2),
    "maxpool-k2-s2": Spec(_seq(lambda nd: _MAX[nd](2)), 2),
    "bn": Spec(_seq(lambda nd: _BN[nd](C)), 1, train_steps=2, eval_steps=1),
    "conv-bn-relu-maxpool": Spec(
        _seq(
            _conv(3, 1, 1, bias=False),
            lambda nd: _BN[nd](C),
            lambda nd: nn.ReLU(),
            lambda nd: _MAX[nd](2),
        ),
        2,
        train_steps=2,
        eval_steps=1,
    ),
    "tconv-k2-s2": Spec(_seq(_tconv(2, 2)), 1),
    "tconv-k3-s2-p1-op1": Spec(_seq(_tconv(3, 2, 1, output_padding=1)), 1),
    "tconv-k4-s2-p1": Spec(_seq(_tconv(4, 2, 1, bias=False)), 1),
    "tconv-k3-s1-p1": Spec(_seq(_tconv(3, 1, 1)), 1),
    "tconv-k3-s3-p1-op2-d1": Spec(_seq(_tconv(3, 3, 1, output_padding=2)), 1),
    "tconv-k3-s2-p2-d2": Spec(_seq(_tconv(3, 2, 2, dilation=2)), 1),
    "upsample-nearest": Spec(_seq(lambda nd: nn.Upsample(scale_factor=2)), 1),
    "upsample-trilinear": Spec(
        _seq(lambda nd: nn.Upsample(scale_factor=2, mode="trilinear", align_corners=False)), 1
    ),
    "upsample-trilinear-corners": Spec(
        _seq(lambda nd: nn.Upsample(scale_factor=2, mode="trilinear", align_corners=True)), 1
    ),
    "interp-nearest-x3": Spec(_seq(lambda nd: _Interp("nearest", None, 3.0)), 1),
    "pad-constant": Spec(_seq(lambda nd: _Pad(), _conv(3, 1, 1)), 1),
    "gap-head": Spec(
        _seq(
            _conv(3, 2, 1),
            lambda nd: nn.ReLU(),
            lambda nd: _GAP[nd](1),
            lambda nd: nn.Flatten(),
            lambda nd: nn.Linear(C, 3),
        ),
        2,
        head=True,
    ),
    "gmp-head": Spec(
        _seq(
            _conv(3, 1, 1),
            lambda nd: _GMP[nd](1),
            lambda nd: nn.Flatten(),
            lambda nd: nn.Linear(C, 3),
        ),
        1,
        head=True,
    ),
    "mean234-head": Spec(_seq(_conv(3, 1, 1), lambda nd: _Mean("mean")), 1, head=True),
    "amax234-head": Spec(_seq(_conv(3, 1, 1), lambda nd: _Mean("amax")), 1, head=True),
    "instancenorm-affine-running": Spec(
        _seq(lambda nd: _IN[nd](C, affine=True, track_running_stats=True)),
        1,
        train_steps=2,
        eval_steps=1,
    ),
    # No bias before the norm: its gradient is 0 up to rounding (the norm removes it).
    "conv-instancenorm": Spec(
        _seq(_conv(3, 2, 1, bias=False), lambda nd: _IN[nd](C)), 2, train_steps=2, eval_steps=1
    ),
    # GroupNorm of any dims (one group of all channels): each sample's statistics over the volume.
    "conv-groupnorm": Spec(
        _seq(_conv(3, 2, 1, bias=False), lambda nd: nn.GroupNorm(1, C)), 2, train_steps=2
    ),
}


def _cnn1d(nd: int) -> nn.Module:
    """A whole small 1-D CNN: conv-BN-ReLU-pool blocks, a global pool, and a head whose
    BatchNorm1d normalises the pooled (N, C) features (it must stay plain)."""
    return nn.Sequential(
        nn.Conv1d(C, 4, 5, padding=2, bias=False), nn.BatchNorm1d(4), nn.ReLU(), nn.MaxPool1d(2),
        nn.Conv1d(4, 4, 3, padding="same", bias=False), nn.BatchNorm1d(4), nn.ReLU(),
        nn.AvgPool1d(3, 2, 1), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(4, 6, bias=False),
        nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3),
    )  # fmt: skip


#: Signal-only cases (1-D grids): the volume cases in their 1-D forms, and a whole 1-D CNN.
SIGNAL: dict[str, Spec] = {
    # InstanceNorm1d has no spatial form (refused: _refusals_1d)
    **{k: v for k, v in VOLUME.items() if "trilinear" not in k and "instancenorm" not in k},
    "upsample-linear": Spec(
        _seq(lambda nd: nn.Upsample(scale_factor=2, mode="linear", align_corners=False)), 1
    ),
    "upsample-linear-corners": Spec(
        _seq(lambda nd: nn.Upsample(scale_factor=2, mode="linear", align_corners=True)), 1
    ),
    "interp-linear-x3": Spec(_seq(lambda nd: _Interp("linear", False, 3.0)), 1),
    "conv-k5-s2-same-d2": Spec(_seq(_conv(5, 1, "same", dilation=2)), 1),
    "maxpool-k3-s2-d2-ceil": Spec(
        _seq(lambda nd: nn.MaxPool1d(3, 2, 1, dilation=2, ceil_mode=True)), 2
    ),
    "avgpool-k3-s2-ceil-excl": Spec(
        _seq(lambda nd: nn.AvgPool1d(3, 2, 1, ceil_mode=True, count_include_pad=False)), 2
    ),
    "cnn1d-bn-head": Spec(_cnn1d, 4, train_steps=2, eval_steps=1, head=True),
}


#: Convolutions run again with communication overlapped (the border bands of every dim redone).
OVERLAP = ["conv-k3-s1", "conv-k5-s2", "conv-k2-same", "conv-bn-relu-maxpool"]


def _specs(nd: int) -> dict[str, Spec]:
    return {**SWEEP, **({3: VOLUME, 1: SIGNAL}.get(nd, {}))}


def _cut(full: torch.Tensor, grid: tuple[int, ...], tile: tuple[int, ...]) -> torch.Tensor:
    """Tile ``tile`` of a map that is exactly ``grid`` equal tiles along its last dims."""
    nd = len(grid)
    index: list[Any] = [Ellipsis]
    for k, (g, i) in enumerate(zip(grid, tile, strict=True)):
        t = full.shape[k - nd] // g
        index.append(slice(i * t, (i + 1) * t))
    return full[tuple(index)]


def _pad_to(t: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    nd = len(size)
    return F.pad(t, [v for k in reversed(range(nd)) for v in (0, size[k] - t.shape[k - nd])])


def _run(pc: Any, spec: Spec, size: tuple[int, ...], seed: int, overlap: bool = False) -> Case:
    """One case, every windowed layer computed on its tile itself (these sub-volumes are
    small: the library's default would copy most of them into extended ones, the path the
    2-D sweep's ``extended/`` cases cover)."""
    from hyfi_imaging.parallel import windowed

    saved = windowed.MAX_BORDER_SHARE
    windowed.MAX_BORDER_SHARE = 1.0
    try:
        return _run_case(pc, spec, size, seed, overlap)
    finally:
        windowed.MAX_BORDER_SHARE = saved


def _run_case(pc: Any, spec: Spec, size: tuple[int, ...], seed: int, overlap: bool) -> Case:
    from hyfi_imaging.parallel.verify import crop, gather_tile_grid, pad_image, spatial_context_for

    nd = len(size)
    torch.manual_seed(seed)
    reference = spec.build(nd)
    for m in reference.modules():
        if isinstance(m, (*_BN.values(), *_IN.values())) and m.affine:
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.normal_(m.bias)
    model = copy.deepcopy(reference)
    ctx = spatial_context_for(model, pc, in_chans=C)
    ctx.overlap = overlap  # convolutions compute their interior while the halos travel
    reference.double()
    model.double()
    ctx.set_image_size(size)
    grid, group = pc.layout.sp, pc.group("sp")
    parts: list[Case] = [
        {"ok": ctx.align == spec.align, "max_rel": 0.0, "detail": f"align {ctx.align}"}
    ]
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(spec.train_steps + spec.eval_steps):
        training = step < spec.train_steps
        reference.train(training)
        model.train(training)
        x = torch.randn(2, C, *size, generator=gen, dtype=torch.float64)
        ref_x = x.clone().requires_grad_(True)
        ref_y = reference(ref_x)
        tile = pad_image(x, ctx.padded_size(size))[(..., *ctx.tile_slice(size))]
        tile = tile.clone().requires_grad_(True)
        y = model(tile)
        if spec.head:
            labels = torch.randint(0, 3, (x.shape[0],), generator=gen)
            F.cross_entropy(ref_y, labels).backward()
            F.cross_entropy(y, labels).backward()
            got_y = y
        else:
            grad_y = torch.randn(ref_y.shape, generator=gen, dtype=torch.float64)
            ref_y.backward(grad_y)
            out_tile = tuple(int(v) for v in y.shape[-nd:])
            full = _pad_to(grad_y, tuple(g * t for g, t in zip(grid, out_tile, strict=True)))
            y.backward(_cut(full, grid, pc.tile).contiguous())
            got_y = crop(gather_tile_grid(y.detach(), ctx, group), tuple(ref_y.shape[-nd:]))
        for name, p in model.named_parameters():
            if name in ctx.tile_param_names and p.grad is not None:
                dist.all_reduce(p.grad, group=group)
        assert tile.grad is not None and ref_x.grad is not None
        got_dx = crop(gather_tile_grid(tile.grad, ctx, group), size)
        parts.append(compare(f"step{step}/output", got_y, ref_y, RTOL))
        parts.append(compare(f"step{step}/input_grad", got_dx, ref_x.grad, RTOL))
        ref_params = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            want = ref_params[name].grad
            if p.grad is None or want is None:
                same = (p.grad is None) == (want is None)
                parts.append({"ok": same, "max_rel": 0.0, "detail": f"grad/{name}: None"})
            else:
                parts.append(compare(f"step{step}/grad/{name}", p.grad, want, RTOL))
        ref_buffers = dict(reference.named_buffers())
        for name, b in model.named_buffers():
            parts.append(compare(f"step{step}/buffer/{name}", b, ref_buffers[name], RTOL))
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    return combine(parts)


def _refusals(pc: Any) -> Case:
    """What cannot be tiled is refused with one line naming the module: 2-D layers on a 3-D
    grid, a flip of the volume, a functional 3-D convolution, a reflect pad."""
    from hyfi_imaging.errors import ConfigError
    from hyfi_imaging.parallel.verify import spatial_context_for

    class Flip(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.flip(x, (-1,))

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(C, C, 3, 3, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.conv3d(x, self.w, padding=1)

    models = {
        "conv2d": (nn.Sequential(nn.Conv2d(C, C, 3)), "is a 2-D layer"),
        "conv1d": (nn.Sequential(nn.Conv1d(C, C, 3)), "is a 1-D layer"),
        "flip": (nn.Sequential(nn.Conv3d(C, C, 3), Flip()), "aten.flip"),
        "functional": (nn.Sequential(Functional()), "aten.convolution"),
        "reflect": (nn.Sequential(nn.ReflectionPad3d(1)), "has no spatial"),
    }
    parts: list[Case] = []
    for name, (model, needle) in models.items():
        try:
            spatial_context_for(model, pc, in_chans=C)
            parts.append({"ok": False, "max_rel": 0.0, "detail": f"{name}: not refused"})
        except ConfigError as err:
            line = str(err)
            ok = needle in line and "\n" not in line
            parts.append({"ok": ok, "max_rel": 0.0, "detail": f"{name}: {line}"})
    return combine(parts)


def _refusals_1d(pc: Any) -> Case:
    """On a 1-D grid: 2-D and 3-D layers, 1-D layers with no tiled form, functions that mix
    samples of a segment -- each refused with one line naming the module and the op."""
    from hyfi_imaging.errors import ConfigError
    from hyfi_imaging.parallel.verify import spatial_context_for

    class Call(nn.Module):
        def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
            super().__init__()
            self.fn = fn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fn(x)

    w = torch.zeros(C, C, 3)
    models = {
        "conv2d": (nn.Conv2d(C, C, 3), "is a 2-D layer"),
        "bn3d": (nn.BatchNorm3d(C), "is a 3-D layer"),
        "reflect": (nn.ReflectionPad1d(1), "has no spatial"),
        "lppool": (nn.LPPool1d(2, 3), "has no spatial"),
        "instancenorm": (nn.InstanceNorm1d(C), "has no spatial"),
        "adaptive-4": (nn.AdaptiveAvgPool1d(4), "depends on the whole image"),
        "flip": (Call(lambda x: torch.flip(x, (-1,))), "aten.flip"),
        "functional-conv1d": (Call(lambda x: F.conv1d(x, w, padding=1)), "aten.convolution"),
        "cumsum": (Call(lambda x: x.cumsum(-1)), "aten.cumsum"),
        "flatten": (Call(lambda x: x.flatten(1).sum(1)), "module '0'"),
        "interp-area": (
            Call(lambda x: F.interpolate(x, scale_factor=0.5, mode="area")),
            "adaptive",
        ),
        "bn1d-subclass": (type("MyBN", (nn.BatchNorm1d,), {})(C), "subclass"),
    }
    parts: list[Case] = []
    for name, (layer, needle) in models.items():
        model = nn.Sequential(layer)
        try:
            spatial_context_for(model, pc, in_chans=C)
            parts.append({"ok": False, "max_rel": 0.0, "detail": f"{name}: not refused"})
        except ConfigError as err:
            line = str(err)
            ok = needle.lower() in line.lower() and "\n" not in line
            parts.append({"ok": ok, "max_rel": 0.0, "detail": f"{name}: {line}"})
    return combine(parts)


def cases(pc: Any) -> dict[str, Callable[[], Case]]:
    """Every case of this launch's grid, keyed by the name the test expects."""
    nd = len(pc.layout.sp)
    size = SIZES[nd]
    out: dict[str, Callable[[], Case]] = {}
    for index, (name, spec) in enumerate(_specs(nd).items()):
        out[name] = lambda s=spec, i=index: _run(pc, s, size, 10 * i)
        if name in OVERLAP:
            out[f"overlap/{name}"] = lambda s=spec, i=index: _run(pc, s, size, 10 * i, True)
    if nd == 3:
        out["refusals"] = lambda: _refusals(pc)
    if nd == 1:
        out["refusals-1d"] = lambda: _refusals_1d(pc)
    return out


def case_names(nd: int) -> list[str]:
    """Names :func:`cases` produces on a grid of ``nd`` axes (for pytest, without processes)."""
    specs = _specs(nd)
    overlap = [f"overlap/{n}" for n in specs if n in OVERLAP]
    refusals = {3: ["refusals"], 1: ["refusals-1d"]}.get(nd, [])
    return [*specs, *overlap, *refusals]


def main(argv: list[str]) -> None:
    pc = start(parse_grid(argv[0]))
    emit({"grid": argv[0], "cases": merge_ranks(run_cases(cases(pc)))})


if __name__ == "__main__":
    main(sys.argv[1:])
