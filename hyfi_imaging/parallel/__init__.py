"""Parallelism applied to single-device models: spatial geometry first.

Why a package of small modules: each parallel concept (the pure halo geometry,
the halo exchange, spatial layers, pipeline stages, gradient reduction) is
tested on its own; the geometry has no ``torch.distributed`` at all so that it
can be checked exhaustively without processes.
"""

from __future__ import annotations

from hyfi_imaging.parallel.geometry import (
    Box,
    ChainGeom,
    Decomp1D,
    Footprint,
    GridPlan,
    Halo1D,
    LayerGeom,
    Span,
    TilePlan,
    decompose,
    halo_1d,
    layer_geom,
    out_length,
    owned_outputs,
    plan_chain,
    plan_layer,
    split,
    split_balanced,
)

__all__ = [
    "Box",
    "ChainGeom",
    "Decomp1D",
    "Footprint",
    "GridPlan",
    "Halo1D",
    "LayerGeom",
    "Span",
    "TilePlan",
    "decompose",
    "halo_1d",
    "layer_geom",
    "out_length",
    "owned_outputs",
    "plan_chain",
    "plan_layer",
    "split",
    "split_balanced",
]
