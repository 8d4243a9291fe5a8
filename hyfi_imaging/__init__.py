"""hyfi-imaging: train CNNs on whole 8K-16K images with exact hybrid parallelism.

The public entry points most users need are re-exported here; everything else
lives in the sub-packages named in ``docs/architecture.md``. Your own model,
in one call per parallel dimension (run under ``mpirun``/``torchrun``)::

    import hyfi_imaging as hyfi

    pc = hyfi.init_parallel(hyfi.Layout(sp=(2, 2)))
    report = hyfi.verify_model(build_my_model, (1024, 768), pc)  # exact, or says where not
    ctx = hyfi.apply_spatial(my_model, pc, image_size=(1024, 768))  # your own loop
    pm = hyfi.ParallelModel(my_model, pc, hyfi.ParallelPlan(pc.layout), image_hw=(1024, 768))

The parallel names are imported on first use, so ``import hyfi_imaging`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from hyfi_imaging.compat import allow_torchvision_without_ops
from hyfi_imaging.errors import HyfiError, SlideError
from hyfi_imaging.io import open_slide

allow_torchvision_without_ops()  # see hyfi_imaging/compat.py

__all__ = [
    "HyfiError",
    "Layout",
    "ParallelModel",
    "ParallelPlan",
    "SlideError",
    "__version__",
    "apply_spatial",
    "init_parallel",
    "open_slide",
    "tile_of",
    "tiled_mean",
    "verify_model",
]

_PARALLEL = {
    "Layout", "ParallelModel", "ParallelPlan", "apply_spatial", "init_parallel", "tile_of",
    "tiled_mean", "verify_model",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _PARALLEL:
        return getattr(importlib.import_module("hyfi_imaging.parallel"), name)
    raise AttributeError(f"module 'hyfi_imaging' has no attribute {name!r}")
