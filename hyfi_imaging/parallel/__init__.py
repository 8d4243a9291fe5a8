"""Parallelism applied to single-device models: spatial, pipeline and data.

Why a package of small modules: each parallel concept is tested on its own —
the pure halo geometry (``geometry``, no ``torch.distributed`` at all), the halo
exchange (``halo``), spatial layers (``spatial``), collectives with the right
adjoint (``collectives``), pipeline stages and balance (``pipeline``,
``balance``), the one object trainers use (``engine.ParallelModel``), and the
one-call doors for any model (``apply.apply_spatial``, ``verify.verify_model``).

The public names below are imported lazily, so that importing the pure
geometry does not start pulling in ``torch.distributed.pipelining``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Layout",
    "Neighbours",
    "ParallelContext",
    "ParallelModel",
    "ParallelPlan",
    "SpatialContext",
    "apply_spatial",
    "halo_exchange",
    "init_parallel",
    "run_verify",
    "shutdown",
    "spatialize",
    "tile_of",
    "tiled_mean",
    "verify_model",
]

_WHERE = {
    "Layout": "layout",
    "Neighbours": "halo",
    "halo_exchange": "halo",
    "ParallelContext": "launch",
    "init_parallel": "launch",
    "shutdown": "launch",
    "ParallelModel": "engine",
    "ParallelPlan": "engine",
    "SpatialContext": "spatial",
    "spatialize": "spatial",
    "run_verify": "verify",
    "verify_model": "verify",
    "apply_spatial": "apply",
    "tile_of": "apply",
    "tiled_mean": "apply",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"hyfi_imaging.parallel.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'hyfi_imaging.parallel' has no attribute {name!r}")
