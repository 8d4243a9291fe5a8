"""mpiexec worker: segmentation scores on a tile grid equal one process's, lesions counted once.

Usage: ``mpiexec -n 4 python tests/workers/seg_scores.py DP:GY:GX`` (``1:2:2``: one image
cut into 2x2 tiles; ``2:1:2``: two replicas of a 1x2 grid). The trainer's path without a
model: each rank holds its tile of fixed one-hot logits and of the truth
(:meth:`~hyfi_imaging.parallel.apply.OutputMap.tile_of`, padded tail included), the
counts are all-reduced (:func:`~hyfi_imaging.train.losses.overlap_counts`), both maps are
stitched (:func:`~hyfi_imaging.train.outputs.gather_masks`) and the
:class:`~hyfi_imaging.train.seg_scores.SegmentationTally` broadcasts rank 0's lesions. The
masks (an odd 37x45, lesions across the tile borders) and the expected rows are in
``tests/test_seg_scores.py``; every rank prints its rows, rank 0 one JSON line.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def main(case: str) -> int:
    from hyfi_imaging import Layout
    from hyfi_imaging.parallel.apply import OutputMap
    from hyfi_imaging.parallel.launch import init_parallel, shutdown
    from hyfi_imaging.parallel.spatial import SpatialContext
    from hyfi_imaging.train.losses import overlap_counts
    from hyfi_imaging.train.outputs import gather_masks
    from hyfi_imaging.train.seg_scores import SegmentationTally, summarise_segmentation

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_seg_scores import CLASSES, grid_masks

    torch.set_num_threads(1)
    dp, gy, gx = (int(v) for v in case.split(":"))
    pc = init_parallel(Layout(dp=dp, sp=(gy, gx)))
    ids, pred, truth = grid_masks()
    size = tuple(pred.shape[1:])
    tile = tuple(math.ceil(n / g) for n, g in zip(size, pc.grid, strict=True))
    ctx = SpatialContext(pc.grid, pc.tile, pc.neighbours(), pc.group("sp"), align=1)
    out_map = OutputMap(size=size, tile=tile)
    # Past the image the logits say class 1 on purpose: the padded tail must not count.
    logits = F.one_hot(torch.from_numpy(pred).long(), CLASSES).movedim(-1, 1).double()
    logits_tile = out_map.tile_of(logits, ctx).clone()
    valid = [max(0, min(t, n - i * t)) for n, i, t in zip(size, pc.tile, tile, strict=True)]
    logits_tile[:, 1, valid[0] :, :] = 2.0
    logits_tile[:, 1, :, valid[1] :] = 2.0
    target_tile = out_map.tile_of(torch.from_numpy(truth).long(), ctx)
    tally = SegmentationTally(CLASSES)
    for b in range(0, len(ids), 2):  # two batches, as the trainer's loop
        rows = slice(b, b + 2)
        masks = gather_masks(logits_tile[rows].argmax(1), pc, tile, size)
        whole = gather_masks(target_tile[rows], pc, tile, size)
        counts = overlap_counts(logits_tile[rows], target_tile[rows], ctx, out_map)
        tally.add(ids[rows], counts, masks, whole)
    scores = tally.finish()
    result = {
        "case": case,
        "rank": pc.rank,
        "rows": [s.row() for s in scores],
        "summary": summarise_segmentation(scores),
    }
    every: list[object] = [None] * pc.world_size
    torch.distributed.all_gather_object(every, result)
    if pc.rank == 0:
        print(json.dumps({"case": case, "ranks": every}), flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    from hyfi_imaging.parallel.launch import exit_now

    # Without interpreter teardown: gloo's threads can abort it after all work is done.
    exit_now(main(sys.argv[1]))
