"""Spatial layers and ``spatialize()``: one image, cut into tiles, computed exactly.

Design, and why:

* **Equal tiles, padded once.** The image is padded at its bottom/right to a
  multiple of ``grid * total_stride`` so that every rank holds a tile of the same
  shape at every layer and every stride divides every tile. The padding is
  *outside the image*: each spatial layer re-masks it in its input (0 before a
  convolution, -inf before a max-pool) and excludes it from statistics, so the
  result equals the single-process run on the unpadded image for any size.
* **Global sizes from a shape trace.** Which rows of a tile lie outside the
  image at a given layer depends on the chain of kernels and paddings before it.
  We run the unmodified model once on the ``meta`` device and record every
  layer's true input size, per image size. No arithmetic is duplicated and any
  architecture built from the supported layers works.
* **Class swap, same parameters.** A layer becomes spatial by changing its class
  to a subclass (``nn.Conv2d`` -> :class:`SpatialConv2d`), so parameter names,
  state dicts, optimizers and hooks are untouched: a checkpoint moves freely
  between layouts.
* **Same graph on every rank.** Collectives inside backward are issued in the
  order autograd visits nodes; every rank therefore builds the same graph
  (masking is one node everywhere, see :class:`_MaskOutside`), or ranks would pair
  up different messages of equal size.
* **Gradient rule** (DESIGN.md invariant 5): parameters used before the global
  pool see only their tile and are *summed* over the spatial group; the head
  after the pool is replicated and already holds the whole gradient.

Where each part lives (one file per concept or layer family): ``context``
(:class:`SpatialContext`), ``trace`` (the meta-device size trace), ``base``
(masking and the window every layer shares), ``convolutions``, ``transposed``,
``pools``, ``norms``, ``instance_norm``, ``global_pools``, ``flatten``, ``resampling`` (pads and
interpolations), ``kinds`` (which torch layer has which spatial form),
``checks`` (refusals), ``swap`` (:func:`spatialize`), ``carry`` (deep-halo runs)
and ``alignment`` (:func:`tile_alignment`).
"""

from __future__ import annotations

from hyfi_imaging.parallel.spatial.alignment import tile_alignment
from hyfi_imaging.parallel.spatial.carry import _is_carrier as _is_carrier
from hyfi_imaging.parallel.spatial.context import SpatialContext
from hyfi_imaging.parallel.spatial.convolutions import (
    SpatialConv1d,
    SpatialConv2d,
    SpatialConv2dSame,
    SpatialConv3d,
)
from hyfi_imaging.parallel.spatial.flatten import SpatialFlatten, tile_shaped
from hyfi_imaging.parallel.spatial.global_pools import (
    SpatialGlobalAvgPool1d,
    SpatialGlobalAvgPool2d,
    SpatialGlobalAvgPool3d,
    SpatialGlobalMaxPool1d,
    SpatialGlobalMaxPool2d,
    SpatialGlobalMaxPool3d,
)
from hyfi_imaging.parallel.spatial.instance_norm import SpatialInstanceNorm2d, SpatialInstanceNorm3d
from hyfi_imaging.parallel.spatial.kinds import _has_spatial_form as _has_spatial_form
from hyfi_imaging.parallel.spatial.norms import (
    SpatialBatchNorm1d,
    SpatialBatchNorm2d,
    SpatialBatchNorm3d,
    SpatialGroupNorm,
)
from hyfi_imaging.parallel.spatial.pools import (
    SpatialAvgPool1d,
    SpatialAvgPool2d,
    SpatialAvgPool3d,
    SpatialMaxPool1d,
    SpatialMaxPool2d,
    SpatialMaxPool3d,
)
from hyfi_imaging.parallel.spatial.swap import spatialize
from hyfi_imaging.parallel.spatial.transposed import (
    SpatialConvTranspose1d,
    SpatialConvTranspose2d,
    SpatialConvTranspose3d,
)

__all__ = [
    "SpatialAvgPool1d",
    "SpatialAvgPool2d",
    "SpatialAvgPool3d",
    "SpatialBatchNorm1d",
    "SpatialBatchNorm2d",
    "SpatialBatchNorm3d",
    "SpatialContext",
    "SpatialConv1d",
    "SpatialConv2d",
    "SpatialConv2dSame",
    "SpatialConv3d",
    "SpatialConvTranspose1d",
    "SpatialConvTranspose2d",
    "SpatialConvTranspose3d",
    "SpatialFlatten",
    "SpatialGlobalAvgPool1d",
    "SpatialGlobalAvgPool2d",
    "SpatialGlobalAvgPool3d",
    "SpatialGlobalMaxPool1d",
    "SpatialGlobalMaxPool2d",
    "SpatialGlobalMaxPool3d",
    "SpatialGroupNorm",
    "SpatialInstanceNorm2d",
    "SpatialInstanceNorm3d",
    "SpatialMaxPool1d",
    "SpatialMaxPool2d",
    "SpatialMaxPool3d",
    "spatialize",
    "tile_alignment",
    "tile_shaped",
]
