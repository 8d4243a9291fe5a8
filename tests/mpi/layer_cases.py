"""One-layer (and tiny-chain) sweeps: spatial vs one process, on every rank of a grid.

Why one layer at a time: a whole-model mismatch says *that* something is
wrong; a one-layer mismatch says *which* window geometry is. Each case builds a
tiny ``nn.Sequential``, copies it, spatializes the copy for this rank's tile
(alignment detected by ``spatialize``), runs both on the same float64 batch and
pulls back the same random upstream gradient, then compares: the gathered
output, the gathered input gradient, every parameter gradient after
the tile-gradient sum and every buffer (BatchNorm running statistics).
Image sizes are odd and not powers of two, so the last tiles hang over the
image and every masking path runs.

Usage: ``mpiexec -n 4 python tests/mpi/layer_cases.py 2x2`` prints one JSON line.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _worker import Case, combine, compare, emit, merge_ranks, parse_grid, run_cases, start
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["API", "LAYERS", "SIZES", "LayerSpec", "case_names", "cases", "main"]

#: Image sizes (h, w): odd, not powers of two, each axis a different remainder.
SIZES: list[tuple[int, int]] = [(37, 29), (45, 52)]
#: float64 tolerance on ``max|a-b| / max|b|``: rounding only (sums in another order).
RTOL = 1e-10
C = 4  # channels


@dataclass(frozen=True)
class LayerSpec:
    """A tiny model and how to drive it.

    ``train_steps`` forward/backward passes in training mode, then ``eval_steps``
    in eval mode; ``head`` models end in global pooling + Linear (cross-entropy
    loss, replicated output) instead of a random upstream gradient on the map.
    ``scale``/``shift`` tilt the input channels (BatchNorm on badly scaled data).
    """

    build: Callable[[], nn.Module]
    align: int
    train_steps: int = 1
    eval_steps: int = 0
    head: bool = False
    scale: tuple[float, ...] | None = None
    shift: tuple[float, ...] | None = None
    rtol: float = RTOL


def _seq(*layers: nn.Module) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(*copy.deepcopy(layers))


def _conv(k: Any, s: Any = 1, p: Any = 0, **kw: Any) -> nn.Module:
    return nn.Conv2d(C, C, k, stride=s, padding=p, **kw)


def _tconv(k: Any, s: Any = 1, p: Any = 0, **kw: Any) -> nn.Module:
    return nn.ConvTranspose2d(C, C, k, stride=s, padding=p, **kw)


def _head(*layers: nn.Module) -> Callable[[], nn.Module]:
    return _seq(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(C, 3))


#: BatchNorm cases: two training steps (running statistics compared after each), then eval.
BN_STEPS: dict[str, int] = {"train_steps": 2, "eval_steps": 1}

#: name -> spec. ``align`` is the stride product ``spatialize`` must detect.
LAYERS: dict[str, LayerSpec] = {
    "conv3x3-s1-p1": LayerSpec(_seq(_conv(3, 1, 1)), 1),
    "conv3x3-s2-p1": LayerSpec(_seq(_conv(3, 2, 1, bias=False)), 2),
    "conv5x5-s4-p2": LayerSpec(_seq(_conv(5, 4, 2)), 4),
    "conv7x7-s2-p3": LayerSpec(_seq(_conv(7, 2, 3, bias=False)), 2),
    "conv3x3-d2-p2": LayerSpec(_seq(_conv(3, 1, 2, dilation=2)), 1),
    "conv3x3-s2-d2-p1": LayerSpec(_seq(_conv(3, 2, 1, dilation=2)), 2),
    "conv2x2-s1-p0": LayerSpec(_seq(_conv(2, 1, 0)), 1),
    "conv4x4-s2-p1": LayerSpec(_seq(_conv(4, 2, 1)), 2),
    "conv1x1-s2": LayerSpec(_seq(_conv(1, 2, 0, bias=False)), 2),
    "conv3x3-g2-bias": LayerSpec(_seq(_conv(3, 1, 1, groups=2, bias=True)), 1),
    "conv1x7-p0x3": LayerSpec(_seq(_conv((1, 7), 1, (0, 3))), 1),
    "conv-same-k2": LayerSpec(_seq(_conv(2, 1, "same")), 1),
    "conv-same-k4-d2": LayerSpec(_seq(_conv(4, 1, "same", dilation=2)), 1),
    "tconv2x2-s2": LayerSpec(_seq(_tconv(2, 2)), 1),
    "tconv3x3-s2-p1-op1": LayerSpec(_seq(_tconv(3, 2, 1, output_padding=1)), 1),
    "tconv4x4-s2-p1": LayerSpec(_seq(_tconv(4, 2, 1, bias=False)), 1),
    "tconv1x1-s2": LayerSpec(_seq(_tconv(1, 2)), 1),
    "tconv3x3-s1-p1": LayerSpec(_seq(_tconv(3, 1, 1)), 1),
    "tconv5x5-s3-p2-op2": LayerSpec(_seq(_tconv(5, 3, 2, output_padding=2)), 1),
    "tconv3x3-s2-p2-d2-g2": LayerSpec(_seq(_tconv(3, 2, 2, dilation=2, groups=2)), 1),
    "tconv-conv": LayerSpec(_seq(_tconv(2, 2), nn.ReLU(), _conv(3, 2, 1)), 2),
    "maxpool3x3-s2-p1": LayerSpec(_seq(nn.MaxPool2d(3, 2, 1)), 2),
    "maxpool2x2-s2-ceil": LayerSpec(_seq(nn.MaxPool2d(2, 2, ceil_mode=True)), 2),
    "maxpool3x3-s2-p1-ceil": LayerSpec(_seq(nn.MaxPool2d(3, 2, 1, ceil_mode=True)), 2),
    "avgpool3x3-s2-p1-incl": LayerSpec(_seq(nn.AvgPool2d(3, 2, 1, count_include_pad=True)), 2),
    "avgpool3x3-s2-p1-excl": LayerSpec(_seq(nn.AvgPool2d(3, 2, 1, count_include_pad=False)), 2),
    "avgpool3x3-s1-p1-excl": LayerSpec(_seq(nn.AvgPool2d(3, 1, 1, count_include_pad=False)), 1),
    "avgpool2x2-s2": LayerSpec(_seq(nn.AvgPool2d(2, 2)), 2),
    # ResNet-D's shortcut (timm avg_down): windows overhanging an odd end, divided by their pixels.
    "avgpool2x2-s2-ceil-excl": LayerSpec(
        _seq(nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)), 2
    ),
    "avgpool3x3-s2-ceil": LayerSpec(_seq(nn.AvgPool2d(3, 2, ceil_mode=True)), 2),
    "avgpool3x3-s2-p1-div5": LayerSpec(_seq(nn.AvgPool2d(3, 2, 1, divisor_override=5)), 2),
    "bn": LayerSpec(_seq(nn.BatchNorm2d(C)), 1, **BN_STEPS),
    "bn-tilted": LayerSpec(_seq(nn.BatchNorm2d(C)), 1, **BN_STEPS, scale=(1.0, 10.0, 100.0, 1.0)),
    # Channel 3 is 1e4 +- 0.01: mean/std = 1e6, so any two correct float64
    # answers may differ by ~1e6 * 2**-52 relative; the others stay tight.
    "bn-tilted-shifted": LayerSpec(
        _seq(nn.BatchNorm2d(C)),
        1,
        **BN_STEPS,
        scale=(1.0, 10.0, 100.0, 0.01),
        shift=(0.0, 5.0, -300.0, 1e4),
        rtol=1e-7,
    ),
    "bn-cumulative-momentum": LayerSpec(_seq(nn.BatchNorm2d(C, momentum=None)), 1, **BN_STEPS),
    "conv-conv": LayerSpec(_seq(_conv(3, 1, 1), nn.ReLU(), _conv(3, 2, 1)), 2),
    # Tiles narrower than the second layer's window (4 px against 7 after the stride 4):
    # an output reads the strips on both sides, and a tile with one neighbour must still
    # redo the outputs that read its strip (AmoebaNet's 1x7 convolutions on deep tiles).
    "conv-s4-then-k7": LayerSpec(_seq(_conv(3, 4, 1), nn.ReLU(), _conv(7, 1, 3)), 4),
    "conv-bn-relu-conv": LayerSpec(
        _seq(_conv(3, 2, 1, bias=False), nn.BatchNorm2d(C), nn.ReLU(), _conv(3, 1, 1)),
        2,
        **BN_STEPS,
    ),
    "maxpool-bn": LayerSpec(_seq(nn.MaxPool2d(3, 2, 1), nn.BatchNorm2d(C)), 2, **BN_STEPS),
    "avgpool-excl-bn": LayerSpec(
        _seq(nn.AvgPool2d(3, 2, 1, count_include_pad=False), nn.BatchNorm2d(C)), 2, **BN_STEPS
    ),
    "stem-head": LayerSpec(
        _head(_conv(7, 2, 3, bias=False), nn.BatchNorm2d(C), nn.ReLU(), nn.MaxPool2d(3, 2, 1)),
        4,
        **BN_STEPS,
        head=True,
    ),
    "conv-head": LayerSpec(_head(_conv(3, 1, 1), nn.ReLU()), 1, head=True),
    "conv-globalmax-head": LayerSpec(
        _seq(_conv(3, 2, 1), nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(C, 3)), 2, head=True
    ),
    # InstanceNorm: each sample's and channel's statistics over the whole image; running
    # statistics (their batch mean) compared after each training step, then used in eval.
    "in": LayerSpec(_seq(nn.InstanceNorm2d(C)), 1, **BN_STEPS),
    "in-affine-running": LayerSpec(
        _seq(nn.InstanceNorm2d(C, affine=True, track_running_stats=True)), 1, **BN_STEPS
    ),
    "in-running-cumulative": LayerSpec(
        _seq(nn.InstanceNorm2d(C, track_running_stats=True, momentum=None)), 1, **BN_STEPS
    ),
    "in-conv-chain": LayerSpec(
        _seq(_conv(3, 2, 1, bias=False), nn.InstanceNorm2d(C, affine=True), nn.ReLU(), _conv(3)),
        2,
        **BN_STEPS,
    ),
    # GroupNorm: each sample's statistics per group of channels over the whole image (two
    # groups of two channels; one group of all), after a strided convolution whose map ends
    # inside the last tile.
    "gn": LayerSpec(_seq(nn.GroupNorm(2, C)), 1, **BN_STEPS),
    "gn-conv-chain": LayerSpec(
        _seq(_conv(3, 2, 1, bias=False), nn.GroupNorm(1, C), nn.ReLU(), _conv(3)), 2, **BN_STEPS
    ),
}


def _tile_of(full: torch.Tensor, grid: tuple[int, int], tile: tuple[int, int]) -> torch.Tensor:
    """The (i, j) tile of a map that is exactly ``grid`` tiles of equal size."""
    th, tw = full.shape[-2] // grid[0], full.shape[-1] // grid[1]
    i, j = tile
    return full[..., i * th : (i + 1) * th, j * tw : (j + 1) * tw]


def _sum_tile_grads(model: Any, names: set[str], group: Any) -> None:
    """The gradient rule on a bare spatialized layer: tile-derived gradients summed over tiles.

    (In training FSDP2 does this reduction; here the layer is checked on its own.)
    """
    for name, p in model.named_parameters():
        if name in names and p.grad is not None:
            dist.all_reduce(p.grad, group=group)


class _InFlight(TorchDispatchMode):
    """Counts convolution kernels (forward, backward) run while halo messages are in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.open = 0
        self.counts = {"forward": 0, "backward": 0, "phases with messages": 0}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.open and func is torch.ops.aten.convolution.default:
            self.counts["forward"] += 1
        if self.open and func is torch.ops.aten.convolution_backward.default:
            self.counts["backward"] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def watching(self) -> Iterator[None]:
        from hyfi_imaging.parallel import halo

        real = halo._exchange

        def posted(sends: Any, recvs: Any) -> Callable[[], None]:
            wait = real(sends, recvs)
            self.open += 1
            self.counts["phases with messages"] += bool(sends or recvs)

            def done() -> None:
                self.open -= 1
                wait()

            return done

        halo._exchange = posted  # type: ignore[assignment]
        try:
            with self:
                yield
        finally:
            halo._exchange = real  # type: ignore[assignment]


def _run(
    pc: Any,
    spec: LayerSpec,
    hw: tuple[int, int],
    seed: int,
    overlap: bool = False,
    border_share: float = 1.0,
) -> Case:
    """One case; ``border_share`` is ``windowed.MAX_BORDER_SHARE`` for it: 1 computes every
    windowed layer on its tile itself (these tiles are small: the library's default would
    copy most of them into extended tiles), 0 on the extended tile."""
    from hyfi_imaging.parallel import windowed

    saved = windowed.MAX_BORDER_SHARE
    windowed.MAX_BORDER_SHARE = border_share
    try:
        return _run_case(pc, spec, hw, seed, overlap)
    finally:
        windowed.MAX_BORDER_SHARE = saved


def _run_case(pc: Any, spec: LayerSpec, hw: tuple[int, int], seed: int, overlap: bool) -> Case:
    from hyfi_imaging.parallel.verify import gather_tile_grid, pad_image, spatial_context_for

    reference = spec.build()
    torch.manual_seed(seed)  # the same weights on every rank, whatever ran before
    for m in reference.modules():
        if isinstance(m, nn.Conv2d | nn.ConvTranspose2d | nn.Linear | nn.BatchNorm2d):
            m.reset_parameters()
        if isinstance(m, nn.BatchNorm2d | nn.InstanceNorm2d) and m.affine:  # non-trivial affine
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.normal_(m.bias)
    model = copy.deepcopy(reference)
    # Spatialized in float32 and then converted, and told its channels by an
    # attribute: see the "api/..." cases for why (the float64 and keyword paths
    # are tested there on their own).
    model.in_chans = C
    ctx = spatial_context_for(model, pc, in_chans=C)
    ctx.overlap = overlap
    flight = _InFlight()
    reference.double()
    model.double()
    ctx.set_image_size(hw)
    grid, group = pc.layout.sp, pc.group("sp")
    rows, cols = ctx.tile_slice(hw)
    parts: list[Case] = [
        {
            "ok": ctx.align == spec.align,
            "max_rel": 0.0,
            "detail": f"align {ctx.align}, expected {spec.align}",
        }
    ]
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(spec.train_steps + spec.eval_steps):
        training = step < spec.train_steps
        reference.train(training)
        model.train(training)
        x = torch.randn(2, C, *hw, generator=gen, dtype=torch.float64)
        if spec.scale is not None:
            x = x * torch.tensor(spec.scale, dtype=x.dtype).view(1, -1, 1, 1)
        if spec.shift is not None:
            x = x + torch.tensor(spec.shift, dtype=x.dtype).view(1, -1, 1, 1)
        ref_x = x.clone().requires_grad_(True)
        ref_y = reference(ref_x)
        tile = pad_image(x, ctx.padded_size(hw))[..., rows, cols].clone().requires_grad_(True)
        with flight.watching():
            y = model(tile)
        if spec.head:
            labels = torch.randint(0, 3, (x.shape[0],), generator=gen)
            F.cross_entropy(ref_y, labels).backward()
            with flight.watching():
                F.cross_entropy(y, labels).backward()
            got_y = y
        else:
            grad_y = torch.randn(ref_y.shape, generator=gen, dtype=torch.float64)
            ref_y.backward(grad_y)
            (th, tw), (ho, wo) = y.shape[-2:], ref_y.shape[-2:]
            if grid[0] * th < ho or grid[1] * tw < wo:
                return {
                    "ok": False,
                    "max_rel": math.inf,
                    "detail": f"tiles of {th}x{tw} outputs cannot cover the {ho}x{wo} output",
                }
            grad_full = F.pad(grad_y, (0, grid[1] * tw - wo, 0, grid[0] * th - ho))
            with flight.watching():
                y.backward(_tile_of(grad_full, grid, pc.tile).contiguous())
            got_y = gather_tile_grid(y.detach(), ctx, group)[..., :ho, :wo]
        _sum_tile_grads(model, ctx.tile_param_names, group)
        assert tile.grad is not None and ref_x.grad is not None
        got_dx = gather_tile_grid(tile.grad, ctx, group)[..., : hw[0], : hw[1]]
        parts.append(compare(f"step{step}/output", got_y, ref_y, spec.rtol))
        parts.append(compare(f"step{step}/input_grad", got_dx, ref_x.grad, spec.rtol))
        ref_params = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            want = ref_params[name].grad
            if p.grad is None or want is None:
                same = (p.grad is None) == (want is None)
                parts.append(
                    {"ok": same, "max_rel": 0.0, "detail": f"step{step}/grad/{name}: None"}
                )
            else:
                parts.append(compare(f"step{step}/grad/{name}", p.grad, want, spec.rtol))
        ref_buffers = dict(reference.named_buffers())
        for name, b in model.named_buffers():
            parts.append(compare(f"step{step}/buffer/{name}", b, ref_buffers[name], spec.rtol))
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    # Overlap computes while messages are in flight; without it, nothing does.
    sends = flight.counts["phases with messages"] > 0
    computed = flight.counts["forward"] > 0 and flight.counts["backward"] > 0
    parts.append(
        {
            "ok": computed == (overlap and sends),
            "max_rel": 0.0,
            "detail": f"convolutions run while halos were in flight: {flight.counts}",
        }
    )
    return combine(parts)


def _api(pc: Any, kind: str) -> Case:
    """``spatialize`` entry paths the sweep works around, each checked on its own."""
    from hyfi_imaging.parallel.verify import spatial_context_for

    if kind == "float64-conv-bias":  # a float64 model whose convolution has a bias
        model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1, bias=True)).double()
        ctx = spatial_context_for(model, pc)
    else:  # "in-chans-keyword": channels given only as spatialize(in_chans=...)
        model = nn.Sequential(nn.Conv2d(C, C, 3, stride=2, padding=1))
        ctx = spatial_context_for(model, pc, in_chans=C)
    ctx.set_image_size(SIZES[0])
    return {"ok": True, "max_rel": 0.0, "detail": f"align {ctx.align}"}


#: Entry-path cases (see :func:`_api`).
API: list[str] = ["float64-conv-bias", "in-chans-keyword"]


#: Convolution cases run again with communication overlapped (``overlap/<name>/<size>``).
OVERLAP = [name for name in LAYERS if name.startswith("conv")]
#: Windowed cases run again on extended tiles (``extended/<name>/<size>``), the path a layer
#: takes where its border bands are a large share of its tile.
EXTENDED = [name for name in LAYERS if name.startswith(("conv", "maxpool", "avgpool"))]


def cases(pc: Any) -> dict[str, Callable[[], Case]]:
    """Every (layer, size) case for this grid, keyed by the name the test expects."""
    out: dict[str, Callable[[], Case]] = {f"api/{k}": (lambda k=k: _api(pc, k)) for k in API}
    for index, (name, spec) in enumerate(LAYERS.items()):
        for hw in SIZES:
            out[f"{name}/{hw[0]}x{hw[1]}"] = lambda s=spec, h=hw, i=index: _run(pc, s, h, 10 * i)
            if name in OVERLAP:
                out[f"overlap/{name}/{hw[0]}x{hw[1]}"] = lambda s=spec, h=hw, i=index: _run(
                    pc, s, h, 10 * i, overlap=True
                )
            if name in EXTENDED:
                out[f"extended/{name}/{hw[0]}x{hw[1]}"] = lambda s=spec, h=hw, i=index: _run(
                    pc, s, h, 10 * i, border_share=0.0
                )
    return out


def case_names() -> list[str]:
    """Names :func:`cases` produces (for pytest, without processes)."""
    names = [f"api/{k}" for k in API] + [f"{n}/{h}x{w}" for n in LAYERS for h, w in SIZES]
    names += [f"overlap/{n}/{h}x{w}" for n in OVERLAP for h, w in SIZES]
    return names + [f"extended/{n}/{h}x{w}" for n in EXTENDED for h, w in SIZES]


def main(argv: list[str]) -> None:
    pc = start(parse_grid(argv[0]))
    emit({"grid": argv[0], "cases": merge_ranks(run_cases(cases(pc)))})


if __name__ == "__main__":
    main(sys.argv[1:])
