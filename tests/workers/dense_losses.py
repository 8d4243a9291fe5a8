"""mpiexec worker: the segmentation loss (Dice + cross-entropy) on a tile grid vs one process.

Usage: ``mpiexec -n N python tests/workers/dense_losses.py LOSS:GY:GX:H:W ...``
(cases of one world size, in one launch); LOSS ``dicece`` (1 x CE + 1 x Dice)
or ``dice`` (Dice alone, the all-reduced sums without the per-pixel mean).
The registered ``unet2d`` (width 4, depth 2, 3 classes) through
``hyfi_imaging.verify_model`` in float64: the loss, the output map stitched
from the tiles, input and parameter gradients, weights after two SGD steps.
One JSON line per case on rank 0.
"""

from __future__ import annotations

import json
import sys

import torch


def main(argv: list[str]) -> int:
    """Run every case of ``argv`` in this one launch (same world size)."""
    from hyfi_imaging import HyfiError, Layout, verify_model
    from hyfi_imaging.models import create_model
    from hyfi_imaging.parallel.launch import shutdown
    from hyfi_imaging.train.losses import DiceCELoss

    torch.set_num_threads(1)
    losses = {"dicece": DiceCELoss(), "dice": DiceCELoss(ce_weight=0.0, smooth=0.5)}

    def build() -> torch.nn.Module:
        return create_model("unet2d", in_chans=3, num_classes=3, width=4, depth=2)

    for case in argv:
        name, *numbers = case.split(":")
        gy, gx, h, w = (int(v) for v in numbers)
        result: dict[str, object] = {"case": case}
        try:
            report = verify_model(
                build, (h, w), Layout(sp=(gy, gx)), loss=losses[name], batch=2, microbatches=2
            )
        except HyfiError as err:
            result["error"] = str(err)
        else:
            if torch.distributed.get_rank() == 0:
                print(report.format(f"{name} {h}x{w} on {gy}x{gx}"), file=sys.stderr)
            result.update(ok=report.ok, max_rel_error=report.max_rel_error,
                          compared=len(report.comparisons), losses=report.losses,
                          failed=[c.name for c in report.comparisons if not c.ok])  # fmt: skip
        if torch.distributed.get_rank() == 0:
            print(json.dumps(result), flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    from hyfi_imaging.parallel.launch import exit_now

    # Without interpreter teardown: gloo's threads can abort it after all work is done.
    exit_now(main(sys.argv[1:]))
