"""Spatial transposed convolutions: the output tile is ``stride`` times the input tile.

Why apart from the convolutions: the halo is the input's that the output tile
reads (:func:`~hyfi_imaging.parallel.geometry.transposed_halo`), and the output is
cut out of an unpadded transposed convolution, not a window of the input.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.geometry import transposed_halo
from hyfi_imaging.parallel.halo import halo_exchange, trailing
from hyfi_imaging.parallel.spatial.base import _AXES, _SpatialMixin

__all__ = ["SpatialConvTranspose1d", "SpatialConvTranspose2d", "SpatialConvTranspose3d"]


#: The functional form, by the number of spatial dims.
_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


class _Transposed(_SpatialMixin):
    """``nn.ConvTranspose2d``/``3d`` on a tile: the output tile is ``stride`` times the input tile.

    The input tile (outside the image set to 0) gets the halo the output tile
    reads (:func:`~.geometry.transposed_halo`, one exchange whose backward
    returns the halo's gradient to its owner); the transposed convolution runs
    without padding and the tile's outputs are cut out of its result. The
    global output size comes from the trace, so ``output_padding`` and a
    ``forward(x, output_size)`` (a tile's size at run time) need not be read.
    """

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        ctx, path, nd = self.hyfi_ctx, self.hyfi_path, self.hyfi_ctx.nd
        conv: Any = self  # an nn.ConvTranspose2d/3d (the class this mixin is swapped into)
        halo: list[int] = []
        crop: list[tuple[int, int]] = []
        for a, (t, axis) in enumerate(zip(x.shape[-nd:], _AXES[nd], strict=True)):
            k, s, p, d = (int(v[a]) for v in (conv.kernel_size, conv.stride, conv.padding, conv.dilation))  # fmt: skip
            before, after = transposed_halo(k, s, p, d)
            n_out, tiles = ctx.out_size_of(path)[a], ctx.grid[a]
            if max(before, after) > t and tiles > 1:
                raise ConfigError(
                    f"module {path!r} (ConvTranspose{nd}d)",
                    f"needs a halo of {max(before, after)} px but tiles are only {t} px along "
                    f"the {axis}",
                    "use fewer tiles along that axis or a larger image",
                )
            if tiles * t * s < n_out:
                raise ConfigError(
                    f"module {path!r} (ConvTranspose{nd}d)",
                    f"gives {n_out} px along the {axis} but the tiles hold {tiles * t * s}",
                    "give the tiles room: a larger align (apply_spatial(..., align=N))",
                )
            halo += [before, after]
            crop.append((before * s + p, int(t) * s))
        masked = self._mask(x, 0.0)
        ext = halo_exchange(masked, halo, ctx.neighbours)
        transpose = _CONV_TRANSPOSE[nd]
        y = transpose(ext, conv.weight, None, conv.stride, 0, 0, conv.groups, conv.dilation)
        # Kernels narrower than the stride leave the last rows empty: pad them.
        short = [max(0, c0 + n - y.shape[k - nd]) for k, (c0, n) in enumerate(crop)]
        if any(short):
            y = F.pad(y, [v for k in reversed(range(nd)) for v in (0, short[k])])
        y = y[trailing([slice(c0, c0 + n) for c0, n in crop])]
        if conv.bias is not None:
            # in y's dtype, as autocast gives the plain layer's bias (bfloat16 stays bfloat16)
            return y + conv.bias.to(y.dtype).view(1, -1, *(1,) * nd)
        # Not the cropped view: an in-place op on a view would drop FSDP2's pre-backward hook.
        return y.clone(memory_format=torch.contiguous_format)


class SpatialConvTranspose1d(_Transposed, nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` on a segment of a signal (see ``_Transposed``)."""


class SpatialConvTranspose2d(_Transposed, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` on a tile (see ``_Transposed``)."""


class SpatialConvTranspose3d(_Transposed, nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` on a sub-volume (see ``_Transposed``)."""
