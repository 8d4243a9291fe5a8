"""mpiexec worker: ResNet with global max pooling, spatial grid vs one process (run_verify)."""

from __future__ import annotations

import json
import sys

import torch

from hyfi_imaging.models import create_model
from hyfi_imaging.parallel.launch import exit_now, init_parallel, shutdown
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.verify import run_verify

if __name__ == "__main__":
    gy, gx, h, w = (int(v) for v in sys.argv[1:5])
    torch.set_num_threads(1)
    pc = init_parallel(Layout(sp=(gy, gx)))
    report = run_verify(
        lambda: create_model("resnet18", width=0.25, num_classes=3, global_pool="max"),
        pc,
        image_hw=(h, w),
        dtype=torch.float64,
    )
    if pc.rank == 0:
        print(json.dumps({"ok": report.ok, "max_rel_error": report.max_rel_error}))
    shutdown()
    exit_now(0)  # without interpreter teardown: gloo's threads can abort it after the work
