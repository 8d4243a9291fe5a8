"""mpiexec worker: class activation maps stitched from the tiles vs one process, float64.

Usage: ``mpiexec -n N python tests/workers/heatmaps.py PP GY GX H W CASE...``, each CASE
one of :data:`CASES`, or ``... heatmaps.py large GY GX H W`` (:func:`large`). For each, every rank builds the model (same seed), the engine runs
it on the ``PP`` x ``GY``x``GX`` layout under a :class:`CamRecorder`, and rank 0 compares
the stitched maps with one process's: the plain model's pool input ``F`` and its Linear,
``W F + b`` per pixel, computed here without the library. Also: the mean of each map
equals the logit (average pool), and no hook stays on the model. One JSON line per case.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import torch
from torch import nn

from hyfi_imaging.models import create_model
from hyfi_imaging.parallel.engine import ParallelModel, ParallelPlan
from hyfi_imaging.parallel.launch import exit_now, init_parallel, shutdown
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.train.heatmaps import CamRecorder, cam_head

#: case -> (model, its options, image size scale: AmoebaNet's reduction cells need wider tiles).
CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "resnet18-avg": ("resnet18", {"width": 0.25}, 1),
    "resnet18-max": ("resnet18", {"width": 0.25, "global_pool": "max"}, 1),
    "amoebanet": ("amoebanet-d-3-8", {}, 2),
    "convchain": ("convchain", {"depth": 3, "width": 8}, 1),
}


def _reference(model: nn.Module, pool: str, linear: str, x: torch.Tensor) -> tuple[Any, ...]:
    """One process: the logits and ``W F + b`` from the plain model's pool input."""
    seen: list[torch.Tensor] = []
    mods = dict(model.named_modules())
    hook = mods[pool].register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
    with torch.no_grad():
        logits = model(x)
    hook.remove()
    fc = mods[linear]
    assert isinstance(fc, nn.Linear) and fc.bias is not None
    cam = torch.einsum("ck,nkyx->ncyx", fc.weight, seen[0]) + fc.bias[None, :, None, None]
    return logits, cam


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def large(gy: int, gx: int, h: int, w: int) -> None:
    """A whole-slide size (8192² on 2x2): each rank makes only its own tile of a smooth image
    (no rank holds the whole), float32 ResNet-18 x0.125; rank 0 prints the map's shape, the
    mean-vs-logit error and every rank's peak resident set (MiB)."""
    import resource
    import time

    import torch.distributed as dist

    torch.set_num_threads(1)
    layout = Layout(sp=(gy, gx))
    pc = init_parallel(layout)
    torch.manual_seed(0)
    model = create_model("resnet18", width=0.125, num_classes=2).eval()
    head = cam_head(model, name="resnet18", image_hw=(h, w), in_chans=3)
    pm = ParallelModel(model, pc, ParallelPlan(layout), image_hw=(h, w))
    del model
    assert pm.ctx is not None
    ys, xs = pm.ctx.tile_slice((h, w))
    yy = torch.arange(ys.start, ys.stop, dtype=torch.float32)
    xx = torch.arange(xs.start, xs.stop, dtype=torch.float32)
    tile = torch.stack(
        [
            torch.sin(yy * 0.003 * (c + 1))[:, None] * torch.cos(xx * 0.002)[None, :]
            for c in range(3)
        ]
    )[None]
    t0 = time.monotonic()
    with CamRecorder(pm, head) as rec:
        logits = pm.predict(tile)
        maps = rec.take(logits)
    seconds = time.monotonic() - t0
    peaks: list[Any] = [None] * pc.world_size
    dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if pc.rank == 0:
        assert maps is not None
        mean_err = float(
            (torch.from_numpy(maps).mean(dim=(2, 3)) - logits.double()).abs().max()
            / logits.double().abs().max()
        )
        print(
            json.dumps(
                {
                    "shape": list(maps.shape),
                    "mean_vs_logit": mean_err,
                    "peak_rss_mib": [round(p, 1) for p in peaks],
                    "seconds": round(seconds, 1),
                }
            ),
            flush=True,
        )


def main() -> None:
    pp, gy, gx, h0, w0 = (int(v) for v in sys.argv[1:6])
    torch.set_num_threads(1)
    layout = Layout(pp=pp, sp=(gy, gx))
    pc = init_parallel(layout)
    for case in sys.argv[6:]:
        name, kwargs, scale = CASES[case]
        h, w = h0 * scale, w0 * scale
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(3, 3, h, w, generator=gen, dtype=torch.float64)
        torch.manual_seed(0)
        model = create_model(name, num_classes=3, **kwargs).double().eval()
        head = cam_head(model, name=name, image_hw=(h, w), in_chans=3)
        reference = copy.deepcopy(model)
        # Three images, two to a batch: a padded last batch and micro-batch order both count.
        pm = ParallelModel(model, pc, ParallelPlan(layout, microbatches=2), image_hw=(h, w))
        maps, logits = [], []
        before = _hooks(pm.module)
        with CamRecorder(pm, head) as rec:
            for rows in (slice(0, 2), slice(2, 3)):
                tiles = pm.tile_of(x[rows]) if pm.is_first else None
                out = pm.predict(tiles)
                logits.append(out)
                maps.append(rec.take(out))
        hooks = _hooks(pm.module) - before
        if pc.rank == 0:
            want_logits, want = _reference(reference.eval(), head.pool, head.linear, x)
            want_logits, want = want_logits.detach(), want.detach()
            got = torch.cat([torch.from_numpy(m) for m in maps if m is not None])
            err = float((got - want).abs().max() / want.abs().max())
            means = got.mean(dim=(2, 3))
            mean_err = float((means - want_logits).abs().max() / want_logits.abs().max())
            result = {
                "case": case,
                "shape": list(got.shape),
                "feature_hw": list(head.feature_hw),
                "stride": list(head.stride),
                "max_rel_error": err,
                "mean_vs_logit": mean_err,
                "logits_rel_error": float(
                    (torch.cat(logits) - want_logits).abs().max() / want_logits.abs().max()
                ),
                "hooks_left": hooks,
            }
            print(json.dumps(result), flush=True)
        del pm, model


if __name__ == "__main__":
    if sys.argv[1] == "large":
        large(*(int(v) for v in sys.argv[2:6]))
    else:
        main()
    shutdown()
    exit_now(0)  # without interpreter teardown: gloo's threads can abort it after the work
