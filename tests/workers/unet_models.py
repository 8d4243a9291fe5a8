"""mpiexec worker: the registered ``unet2d``, grid vs one process.

Usage: ``mpiexec -n N python tests/workers/unet_models.py UPSAMPLING DEPTH GY GX H W``;
``hyfi_imaging.verify_model`` in float64 (two SGD steps; per-pixel cross-entropy;
outputs stitched from the tiles, input and parameter gradients, weights and
BatchNorm statistics after training, eval-mode outputs); one JSON line on rank 0.
"""

from __future__ import annotations

import json
import sys

import torch


def main(argv: list[str]) -> int:
    from hyfi_imaging import HyfiError, Layout, verify_model
    from hyfi_imaging.models import create_model
    from hyfi_imaging.parallel.launch import shutdown

    upsampling = argv[0]
    depth, gy, gx, h, w = (int(v) for v in argv[1:6])
    torch.set_num_threads(1)

    def build() -> torch.nn.Module:
        return create_model(
            "unet2d", in_chans=3, num_classes=3, width=4, depth=depth, upsampling=upsampling
        )

    try:
        report = verify_model(build, (h, w), Layout(sp=(gy, gx)), batch=2)
    except HyfiError as err:
        if torch.distributed.get_rank() == 0:
            print(json.dumps({"error": str(err)}))
        shutdown()
        return 2
    if torch.distributed.get_rank() == 0:
        print(report.format(f"unet2d {upsampling} depth {depth} {h}x{w} on {gy}x{gx}"),
              file=sys.stderr)  # fmt: skip
        failed = [c.name for c in report.comparisons if not c.ok]
        print(json.dumps({"ok": report.ok, "max_rel_error": report.max_rel_error,
                          "compared": len(report.comparisons), "failed": failed}))  # fmt: skip
    shutdown()
    return 0


if __name__ == "__main__":
    from hyfi_imaging.parallel.launch import exit_now

    # Without interpreter teardown: gloo's threads can abort it after all work is done.
    exit_now(main(sys.argv[1:]))
