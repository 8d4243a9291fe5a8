"""mpiexec worker: a tile's forward is traced in its own modes and with its own arguments.

Usage: ``mpiexec -n 2 python tests/workers/trace_modes.py`` (a 1x2 grid, float64, 30x22
images). Each model is compared with a copy of itself in one process (``copy.deepcopy``
before ``apply_spatial``) through a loss over the whole output map (``hyfi.tiled_mean``) and
its gradients; rank 0 prints one JSON line:

* ``odd_interp``: an interpolation made only where the shapes differ
  (``if u.shape != f.shape``) after an unpadded pool, at sizes where the whole image and the
  watch's probe both make it and a tile does not: the refusal (0.30 off, silently, before);
* ``odd_sub``: the same with the interpolation in a submodule called only then (0.15 off);
  ``*_keyword``: the image given by keyword, ``model(x=tile)`` (no check ran: 0.15 off);
* ``mask``: a mask cut like the image as a forward argument: the largest relative error
  (traced at the tile's size beside the whole image, it was refused);
* ``parts``: a decoder whose interpolation's mode depends on the mode, called as
  ``dec(enc(x))`` in training after a forward in eval (the eval trace's bilinear ran
  where the tile asked nearest: 0.23 off): the refusal;
* ``train_only``: a deep-supervision head (a convolution and an interpolation) called in
  training only: the largest relative error of the losses and gradients (refused before: the
  whole image was traced in eval mode only);
* ``eval_only``: the logits upsampled in eval mode only, run in eval and in training: the
  largest relative error (the forward-time check refused it when traced in eval only);
* ``arg_off``: a forward argument that turns an interpolation off: the largest relative error;
* ``arg_on``: the same argument turning on an interpolation the watch never saw (it ran on
  the tiles as a plain op, silently wrong, before): the refusal.
* ``compiled``: the tiled model under ``torch.compile`` (dynamo's own AssertionError on the
  hooks): the refusal;
* ``engine_eval_only``: ``verify_model`` of a chain (``ParallelModel`` runs its layers in a
  stage, not its forward) with a layer that smooths only in eval mode: the largest relative
  error (a ``KeyError`` at the eval-mode prediction before: the trace stayed in training).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HW = (30, 22)


class OddInterp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(3, stride=2)  # unpadded: 255 from 512, 14 from 30
        self.mid = nn.Conv2d(4, 4, 3, padding=1)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.enc(x)
        u = F.interpolate(self.mid(self.pool(f)), scale_factor=2)
        if u.shape != f.shape:
            u = F.interpolate(u, size=f.shape[2:])
        return self.out(torch.cat([u, f], 1))


class Resize(nn.Module):
    def forward(self, u: torch.Tensor, size: Any) -> torch.Tensor:
        return F.interpolate(u, size=size)


class OddInterpSub(OddInterp):
    """``OddInterp`` with its conditional interpolation in a submodule called only then."""

    def __init__(self) -> None:
        super().__init__()
        self.fix = Resize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.enc(x)
        u = F.interpolate(self.mid(self.pool(f)), scale_factor=2)
        if u.shape != f.shape:
            u = self.fix(u, f.shape[2:])
        return self.out(torch.cat([u, f], 1))


class Masked(nn.Module):
    """A second map as a forward argument (a mask cut like the image)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        f = self.enc(x)
        return F.interpolate(f if mask is None else f * mask, scale_factor=2, mode="bilinear")


class Decoder(nn.Module):
    def forward(self, d: torch.Tensor) -> torch.Tensor:
        return F.interpolate(d, scale_factor=2, mode="nearest" if self.training else "bilinear")


class Parts(nn.Module):
    """An encoder and a decoder whose interpolation depends on the mode, called as parts."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 2, 3, padding=1)
        self.dec = Decoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x))


class Supervised(nn.Module):
    """Deep supervision: an auxiliary map at the input's size in training only; the logits
    upsampled in eval only (``upsample``: a forward argument turning that off)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 4, 3, padding=1)
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.aux = nn.Conv2d(4, 2, 3, padding=1)
        self.out = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor, upsample: bool = True) -> Any:
        d = torch.relu(self.down(torch.relu(self.enc(x))))
        out = self.out(d)
        if self.training:
            aux = F.interpolate(self.aux(d), size=x.shape[2:], mode="bilinear")
            return out, aux
        if upsample:
            out = F.interpolate(out, scale_factor=2, mode="bilinear")
        return out


class Blurred(nn.Module):
    """An interpolation the default arguments never make."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x: torch.Tensor, upsample: bool = False) -> torch.Tensor:
        out = self.enc(x)
        return F.interpolate(out, scale_factor=2, mode="bilinear") if upsample else out


class Smooth(nn.Module):
    """A layer of a chain that smooths its map at evaluation only."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y if self.training else F.avg_pool2d(y, 3, 1, 1)


def _chain() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        Smooth(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / (b.abs().max() + 1e-300))


def _compare(
    model: nn.Module, ctx: Any, ref: nn.Module, run: Callable[[nn.Module, torch.Tensor, Any], Any]
) -> float:
    """The largest relative error of the loss and every gradient: ``run(model, x, ctx)``
    returns the loss (``ctx`` None: one process)."""
    import hyfi_imaging as hyfi

    x = torch.randn(2, 3, *HW, generator=torch.Generator().manual_seed(5))
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    got = run(model, hyfi.tile_of(x, ctx, HW), ctx)
    want = run(ref, x, None)
    got.backward()
    want.backward()
    errors = [_rel(got.detach(), want.detach())]
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        if p.grad is None or q.grad is None:  # (a layer the mode does not call)
            errors.append(0.0 if p.grad is q.grad else float("inf"))
        else:
            errors.append(_rel(p.grad, q.grad))
    return max(errors)


def _dense_loss(out: torch.Tensor, ctx: Any, size: tuple[int, int]) -> torch.Tensor:
    import hyfi_imaging as hyfi

    return hyfi.tiled_mean((out * out).sum(1), ctx, size)


def _training(m: nn.Module, x: torch.Tensor, ctx: Any) -> torch.Tensor:
    out, aux = m(x)
    return _dense_loss(out, ctx, (15, 11)) + _dense_loss(aux, ctx, HW)


def _eval(m: nn.Module, x: torch.Tensor, ctx: Any) -> torch.Tensor:
    return _dense_loss(m(x), ctx, HW)


def _no_upsample(m: nn.Module, x: torch.Tensor, ctx: Any) -> torch.Tensor:
    return _dense_loss(m(x, upsample=False), ctx, (15, 11))


def main() -> int:
    import hyfi_imaging as hyfi
    from hyfi_imaging.errors import HyfiError
    from hyfi_imaging.parallel.launch import shutdown

    torch.set_default_dtype(torch.float64)
    pc = hyfi.init_parallel(hyfi.Layout(sp=(1, 2)))
    found: dict[str, object] = {}

    torch.manual_seed(0)
    image = torch.randn(1, 3, 32, 24)
    for case, build in (("odd_interp", OddInterp), ("odd_sub", OddInterpSub)):
        odd = build()
        ctx = hyfi.apply_spatial(odd, pc, image_size=(32, 24))
        for key in ("", "_keyword"):
            tile = hyfi.tile_of(image, ctx, (32, 24))
            try:
                odd(x=tile) if key else odd(tile)
                found[case + key] = "ran"
            except HyfiError as err:
                found[case + key] = str(err)

    masked = Masked()
    ref = copy.deepcopy(masked)
    ctx = hyfi.apply_spatial(masked, pc, image_size=HW)
    mask = torch.rand(2, 1, *HW, generator=torch.Generator().manual_seed(6))

    def _masked(m: nn.Module, x: torch.Tensor, ctx: Any) -> torch.Tensor:
        cut = mask if ctx is None else hyfi.tile_of(mask, ctx, HW)
        return _dense_loss(m(x, mask=cut), ctx, (60, 44))

    found["mask"] = _compare(masked, ctx, ref, _masked)

    parts = Parts()
    ctx = hyfi.apply_spatial(parts, pc, image_size=HW)
    tile = hyfi.tile_of(image[..., :30, :22], ctx, HW)
    parts.eval()
    parts(tile)
    parts.train()
    try:
        parts.dec(parts.enc(tile))  # no forward of the model: the eval trace stays
        found["parts"] = "ran"
    except HyfiError as err:
        found["parts"] = str(err)

    model = Supervised()
    ref = copy.deepcopy(model)
    ctx = hyfi.apply_spatial(model, pc, image_size=HW)
    found["train_only"] = _compare(model, ctx, ref, _training)
    model.eval(), ref.eval()
    found["eval_only"] = _compare(model, ctx, ref, _eval)
    found["arg_off"] = _compare(model, ctx, ref, _no_upsample)
    model.train(), ref.train()
    found["train_again"] = _compare(model, ctx, ref, _training)

    blurred = Blurred()
    ctx = hyfi.apply_spatial(blurred, pc, image_size=HW)
    try:
        blurred(hyfi.tile_of(torch.randn(1, 3, *HW), ctx, HW), upsample=True)
        found["arg_on"] = "ran"
    except HyfiError as err:
        found["arg_on"] = str(err)
    # ParallelModel runs a chain's layers in its stage, not the model's forward.
    report = hyfi.verify_model(_chain, HW, pc)
    found["engine_eval_only"] = report.max_rel_error if report.ok else str(report)
    try:  # dynamo failed on the hooks with an AssertionError of its own
        torch.compile(blurred, backend="eager")(hyfi.tile_of(torch.randn(1, 3, *HW), ctx, HW))
        found["compiled"] = "ran"
    except HyfiError as err:
        found["compiled"] = str(err)
    if pc.rank == 0:
        print(json.dumps(found))
    shutdown()
    return 0


if __name__ == "__main__":
    from hyfi_imaging.parallel.launch import exit_now

    exit_now(main())
