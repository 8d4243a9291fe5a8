"""Check a parallel layout against one process: the engine behind ``hyfi-verify``.

Every rank runs K SGD steps of the parallel model; rank 0 also runs the same
K steps on the whole image in one process, from the same initial weights and
data. Compared: outputs, input gradients (tiles gathered and stitched), every
parameter gradient (after the spatial reduction), BatchNorm running statistics
and the weights after K steps. ``max_rel_error`` is, over all compared tensors,
``max|a - b| / max(max|b|, atol)``; ``ok`` means every tensor is within
``rtol``/``atol`` elementwise (``torch.allclose``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyfi_imaging.parallel.halo import Neighbours
from hyfi_imaging.parallel.launch import ParallelContext
from hyfi_imaging.parallel.spatial import SpatialContext, reduce_spatial_grads, spatialize

__all__ = ["Comparison", "VerifyReport", "gather_tile_grid", "run_verify", "spatial_context_for"]

TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-7, 1e-9)}


@dataclass
class Comparison:
    name: str
    max_abs: float
    max_rel: float
    ok: bool


@dataclass
class VerifyReport:
    """Result of :func:`run_verify` (meaningful on rank 0)."""

    ok: bool = True
    max_rel_error: float = 0.0
    comparisons: list[Comparison] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)

    def add(
        self, name: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float
    ) -> None:
        got, want = got.detach().double(), want.detach().double()
        if got.shape != want.shape:
            self.comparisons.append(Comparison(name, float("inf"), float("inf"), False))
            self.ok = False
            self.max_rel_error = float("inf")
            return
        diff = float((got - want).abs().max()) if got.numel() else 0.0
        scale = float(want.abs().max()) if want.numel() else 0.0
        # A tensor that is zero up to rounding (a bias before BatchNorm) is measured
        # against the absolute tolerance, not against its own noise.
        rel = diff / max(scale, atol)
        ok = bool(torch.allclose(got, want, rtol=rtol, atol=atol))
        self.comparisons.append(Comparison(name, diff, rel, ok))
        self.ok &= ok
        self.max_rel_error = max(self.max_rel_error, rel)

    def to_json(self) -> dict[str, Any]:
        worst = sorted(self.comparisons, key=lambda c: -c.max_rel)[:10]
        return {
            "ok": self.ok,
            "max_rel_error": self.max_rel_error,
            "compared": len(self.comparisons),
            "failed": [c.name for c in self.comparisons if not c.ok],
            "worst": [{"name": c.name, "max_abs": c.max_abs, "max_rel": c.max_rel} for c in worst],
            "losses": self.losses,
            "reference_losses": self.reference_losses,
        }


def spatial_context_for(model: nn.Module, pc: ParallelContext, **kwargs: Any) -> SpatialContext:
    """Spatialize ``model`` for this rank's tile of the layout's grid."""
    nb = Neighbours(up=pc.peer(dy=-1), down=pc.peer(dy=1), left=pc.peer(dx=-1), right=pc.peer(dx=1))
    return spatialize(
        model, grid=pc.layout.sp, tile=pc.tile, neighbours=nb, group=pc.group("sp"), **kwargs
    )


def pad_image(x: torch.Tensor, padded_hw: tuple[int, int]) -> torch.Tensor:
    """Zero-pad a batch at the bottom/right to ``padded_hw`` (the padding is masked anyway)."""
    return F.pad(x, (0, padded_hw[1] - x.shape[-1], 0, padded_hw[0] - x.shape[-2]))


def gather_tile_grid(tile: torch.Tensor, ctx: SpatialContext, group: Any) -> torch.Tensor:
    """Stitch every rank's tile (same shape everywhere) into the padded whole, on all ranks."""
    gy, gx = ctx.grid
    tile = tile.contiguous()
    parts = [torch.empty(tile.shape, dtype=tile.dtype, device=tile.device) for _ in range(gy * gx)]
    dist.all_gather(parts, tile, group=group)
    rows = [torch.cat(parts[r * gx : (r + 1) * gx], dim=-1) for r in range(gy)]
    return torch.cat(rows, dim=-2)


def run_verify(
    build: Callable[[], nn.Module],
    pc: ParallelContext,
    *,
    image_hw: tuple[int, int],
    batch: int = 2,
    steps: int = 2,
    dtype: torch.dtype = torch.float32,
    lr: float = 0.1,
    seed: int = 0,
) -> VerifyReport:
    """Run ``steps`` SGD steps spatially and (on rank 0) in one process; compare."""
    rtol, atol = TOLERANCES.get(dtype, (1e-4, 1e-5))
    torch.manual_seed(seed)
    reference = build().to(dtype)
    model = copy.deepcopy(reference).to(pc.device)
    ctx = spatial_context_for(model, pc)
    ctx.set_image_size(image_hw)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr, momentum=0.9)
    report = VerifyReport()
    gen = torch.Generator().manual_seed(seed + 1)
    in_chans = int(getattr(reference, "in_chans", 3))
    num_classes = int(getattr(reference, "num_classes", 2))
    rows, cols = ctx.tile_slice(image_hw)
    padded = ctx.padded_size(image_hw)
    root = pc.rank == 0
    for step in range(steps):
        images = torch.randn(batch, in_chans, *image_hw, generator=gen, dtype=dtype)
        labels = torch.randint(0, num_classes, (batch,), generator=gen)
        tile = pad_image(images, padded)[..., rows, cols].clone().to(pc.device).requires_grad_(True)
        opt.zero_grad(set_to_none=True)
        out = model(tile)
        loss = F.cross_entropy(out, labels.to(pc.device))
        loss.backward()
        reduce_spatial_grads(model, ctx)
        assert tile.grad is not None
        input_grad = gather_tile_grid(tile.grad, ctx, pc.group("sp"))[
            ..., : image_hw[0], : image_hw[1]
        ]
        report.losses.append(loss.item())
        if root:
            x = images.clone().requires_grad_(True)
            ref_opt.zero_grad(set_to_none=True)
            ref_out = reference(x)
            ref_loss = F.cross_entropy(ref_out, labels)
            ref_loss.backward()
            report.reference_losses.append(ref_loss.item())
            report.add(f"step{step}/output", out.cpu(), ref_out, rtol, atol)
            assert x.grad is not None
            report.add(f"step{step}/input_grad", input_grad.cpu(), x.grad, rtol, atol)
            ref_params = dict(reference.named_parameters())
            for name, p in model.named_parameters():
                if p.grad is not None:
                    want = ref_params[name].grad
                    want = torch.zeros_like(p.grad.cpu()) if want is None else want
                    report.add(f"step{step}/grad/{name}", p.grad.cpu(), want, rtol, atol)
            ref_opt.step()
        opt.step()
    if root:
        ref_state = reference.state_dict()
        for name, value in model.state_dict().items():
            if value.is_floating_point():
                report.add(f"final/{name}", value.cpu(), ref_state[name], rtol, atol)
    flag = torch.tensor([1.0 if report.ok else 0.0])
    dist.broadcast(flag, src=0)
    report.ok = bool(flag.item())
    return report
