"""Worker: the planner's per-rank peak against the measured one, for one layout.

Run under ``mpiexec -n N`` (or plainly for one process) with the layout as
``--layout DP,PP,GY,GX`` (per-stage grids: ``--grids 1x2,1x1``) plus micro-batches, schedule and checkpointing. Every
rank builds its part (:class:`ParallelModel`, SGD with momentum), then the
resident set after the build is the baseline; two training steps (data
created inside the step, as a loader delivers it) and optimizer steps follow,
and the peak anonymous resident set over the baseline is this rank's measured
peak (:class:`AnonymousPeak`: ``VmHWM`` less the library pages paged in;
glibc's mmap threshold is fixed by ``init_parallel``).
The planner's prediction for the same layout and cut is computed on the meta
device. One JSON line on rank 0: predicted and measured, per rank.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

import torch
import torch.distributed as dist
from _worker import emit

from hyfi_imaging.models import create_model
from hyfi_imaging.parallel.engine import ParallelModel, ParallelPlan
from hyfi_imaging.parallel.launch import init_parallel
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.memory import AnonymousPeak, LiveTensorPeak
from hyfi_imaging.parallel.plan import Candidate, predict


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet18")
    p.add_argument("--width", type=float, default=0.25, help="0: the model's own (no option)")
    p.add_argument("--image", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layout", default="1,1,1,1")
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--schedule", default="gpipe")
    p.add_argument("--ck", default="none")
    p.add_argument("--streaming", default="none")
    p.add_argument("--halo-depth", type=int, default=1)
    p.add_argument("--grids", help="per-stage grids, e.g. 1x2,1x1 (GY,GX of --layout ignored)")
    args = p.parse_args()
    torch.set_num_threads(1)
    dp, pp, gy, gx = (int(v) for v in args.layout.split(","))
    grids = Layout.parse_grids(args.grids) if args.grids else None
    layout = Layout(dp=dp, pp=pp, sp=(gy, gx), grids=grids)
    hw = (args.image, args.image)
    cand = Candidate(
        layout, args.m, args.ck, args.schedule, streaming=args.streaming, halo_depth=args.halo_depth
    )

    def build() -> Any:
        torch.manual_seed(0)
        width = {"width": args.width} if args.width else {}
        return create_model(args.model, num_classes=2, **width)

    pred = predict(build(), hw, args.batch, cand)
    pc = init_parallel(layout, schedule=args.schedule)
    plan = ParallelPlan(
        layout,
        microbatches=args.m,
        schedule=args.schedule,  # type: ignore[arg-type]
        balance=pred.balance,
        checkpointing=args.ck,
        streaming=args.streaming,
        halo_depth=args.halo_depth,
    )
    pm = ParallelModel(build(), pc, plan, image_hw=hw)
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    gc.collect()
    dist.barrier()
    with AnonymousPeak() as peak, LiveTensorPeak() as live:
        for _ in range(2):
            # A loader delivers this rank's tile only (never the whole image).
            tiles = torch.randn(args.batch, 3, *pm.tile_hw, generator=gen) if pm.is_first else None
            labels = torch.randint(0, 2, (args.batch,), generator=gen)
            pm.train_step(tiles, labels)
            opt.step()
            opt.zero_grad(set_to_none=True)
            del tiles
    gathered: list[Any] = [None] * pc.world_size
    dist.all_gather_object(gathered, (peak.bytes, live.peak))
    emit(
        {
            "predicted": pred.peak,
            "predicted_stages": list(pred.rank_peaks),
            "parts": {
                "activations": pred.activations,
                "transient": pred.transient,
                "state": pred.state,
                "buffers": pred.buffers,
            },
            "measured": [rss for rss, _ in gathered],
            "tensors": [tensors for _, tensors in gathered],
        }
    )


if __name__ == "__main__":
    try:
        main()
    finally:
        sys.stdout.flush()
