"""mpiexec worker: ``unet3d`` and ``cosmoflow`` on 3-D grids (with dp and pp), and a small
1-D CNN on 1-D grids, vs one process.

Usage: ``mpiexec -n N python tests/workers/volume_models.py CASE [CASE ...]`` with
cases from :data:`CASES` whose layouts need N ranks; one launch runs them all
(a launch costs ~13 CPU-seconds of start-up). ``hyfi_imaging.verify_model``
in float64, two SGD steps: outputs (the U-Net's map stitched from the
sub-volumes), input and parameter gradients, weights and BatchNorm statistics
after training, eval-mode outputs. One JSON line on rank 0:
``{"cases": {name: {"ok", "max_rel_error", "compared", "failed"}}}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

#: name -> (model, model options, layout options, volume size, micro-batches)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any], tuple[int, ...], int]] = {
    "unet3d-transpose-2x1x2": (
        "unet3d",
        {"upsampling": "transpose"},
        {"sp": (2, 1, 2)},
        (19, 13, 22),
        1,
    ),
    "unet3d-trilinear-1x2x2": (
        "unet3d",
        {"upsampling": "trilinear"},
        {"sp": (1, 2, 2)},
        (11, 21, 18),
        1,
    ),
    "unet3d-dp2-1x2x1": ("unet3d", {}, {"dp": 2, "sp": (1, 2, 1)}, (9, 22, 11), 1),
    "cosmoflow-2x1x2": ("cosmoflow", {}, {"sp": (2, 1, 2)}, (19, 19, 19), 1),
    "cosmoflow-1x2x2": ("cosmoflow", {}, {"sp": (1, 2, 2)}, (19, 19, 19), 1),
    "cosmoflow-dp2-1x1x2": ("cosmoflow", {}, {"dp": 2, "sp": (1, 1, 2)}, (19, 19, 19), 1),
    "cosmoflow-pp2-1x1x2": ("cosmoflow", {}, {"pp": 2, "sp": (1, 1, 2)}, (19, 19, 19), 2),
    "unet3d-2x2x2": ("unet3d", {"upsampling": "trilinear"}, {"sp": (2, 2, 2)}, (19, 21, 18), 1),
    "cosmoflow-2x2x2": ("cosmoflow", {}, {"sp": (2, 2, 2)}, (19, 19, 19), 1),
    # 1-D: conv-BN-ReLU-pool blocks, a global pool and a head with a plain BatchNorm1d. Global
    # *average* pool: a max over ReLU zeros ties, and ties pick different (equally valid)
    # subgradients on one process and on the tiles.
    "cnn1d-L2": ("cnn1d", {}, {"sp": (2,)}, (37,), 1),
    "cnn1d-dp2-L2": ("cnn1d", {}, {"dp": 2, "sp": (2,)}, (41,), 1),
}


def _cnn1d() -> torch.nn.Module:
    from torch import nn

    return nn.Sequential(
        nn.Conv1d(2, 4, 5, padding=2, bias=False), nn.BatchNorm1d(4), nn.ReLU(), nn.MaxPool1d(2),
        nn.Conv1d(4, 4, 3, stride=2, padding=1, bias=False), nn.BatchNorm1d(4), nn.ReLU(),
        nn.AvgPool1d(3, 1, 1), nn.AdaptiveAvgPool1d(1), nn.Flatten(),
        nn.Linear(4, 6, bias=False), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3),
    )  # fmt: skip


def _build(model: str, options: dict[str, Any], size: tuple[int, ...]) -> torch.nn.Module:
    from hyfi_imaging.models import create_model

    if model == "cnn1d":
        return _cnn1d()
    if model == "unet3d":
        return create_model("unet3d", in_chans=2, num_classes=3, width=2, depth=2, **options)
    # Small and deterministic: dropout 0 (its draws are checked by the random-layer suite).
    return create_model(
        "cosmoflow", in_chans=2, num_classes=4, size=size[0], n_conv_layers=2, width=3,
        fc_sizes=(8,), dropout=0.0, **options,
    )  # fmt: skip


def main(argv: list[str]) -> int:
    from hyfi_imaging import HyfiError, Layout, verify_model
    from hyfi_imaging.parallel.launch import init_parallel, shutdown

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    pc = None
    for name in argv:
        model, options, layout, size, micro = CASES[name]
        lay = Layout(**layout)
        pc = init_parallel(lay)
        try:
            report = verify_model(
                lambda m=model, o=options, s=size: _build(m, o, s),
                size, pc, batch=4 if model == "cnn1d" else 2, microbatches=micro,
            )  # fmt: skip
        except HyfiError as err:
            results[name] = {"ok": False, "error": str(err)}
            continue
        failed = [c.name for c in report.comparisons if not c.ok]
        results[name] = {
            "ok": report.ok, "max_rel_error": report.max_rel_error,
            "compared": len(report.comparisons), "failed": failed[:10],
        }  # fmt: skip
        if pc.rank == 0 and not report.ok:
            print(report.format(name), file=sys.stderr)
    if pc is not None and pc.rank == 0:
        print("HYFI-RESULT " + json.dumps({"cases": results}), flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    from hyfi_imaging.parallel.launch import exit_now

    exit_now(main(sys.argv[1:]))
