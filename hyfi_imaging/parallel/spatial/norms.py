"""Spatial BatchNorm and GroupNorm: statistics over the whole image, from all tiles.

Why: a tile's own statistics differ from the image's. BatchNorm (per channel) and GroupNorm
(per sample and group) merge every tile's mean and centred variance (two passes over its
pixels, outside the image excluded) from one all-gather (:func:`merged_statistics`), and
backward all-reduces the two gradient sums. timm's norm + activation layers get a spatial
form built from these, and InstanceNorm (``instance_norm.py``) GroupNorm's statistics
(:func:`_sample_norm`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.collectives import all_reduce_sum
from hyfi_imaging.parallel.first_order import first_order
from hyfi_imaging.parallel.halo import trailing
from hyfi_imaging.parallel.spatial.base import _crosses, _SpatialMixin

_aten = torch.ops.aten

__all__ = ["SpatialBatchNorm1d", "SpatialBatchNorm2d", "SpatialBatchNorm3d", "SpatialGroupNorm"]


def _acc(t: torch.Tensor) -> torch.dtype:
    """Accumulate statistics in float32 for half types, else in the tensor's own type."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


class _GlobalBatchNorm(torch.autograd.Function):
    """Training-mode BatchNorm over all tiles with a hand-written backward.

    Autograd through the tensor expression would keep two activation-sized
    tensors per layer (the masked input and the centred input); this keeps one
    (the normalised input) and does one all-reduce in backward for both sums the
    input gradient needs. Outside the image (``outside``) the input is ignored and
    gets no gradient. The formula is the standard one,
    ``dx = w * rstd * (g - mean(g) - xhat * mean(g * xhat))`` with means over all
    valid pixels of all tiles; weight and bias gradients are this tile's share
    (summed over tiles later, as for every tile-derived parameter).

    With a deep halo the input carries a border of a neighbour's pixels
    (``own`` is the box of the tile's own ones): statistics come from the own
    pixels alone, every pixel is normalised, and the sums backward takes include
    the border's gradient shares (those of this tile's later outputs); the
    statistics' part of ``dx`` goes to the own pixels only, where the owner adds
    it once.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        outside: torch.Tensor | None,
        own: tuple[int, int, int, int] | None,
        n: int,
        count: int,
        eps: float,
        group: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape, dims = _channel_shape(x)
        ctx.fast = outside is None and own is None and x.dtype in (torch.float32, torch.float64)
        if ctx.fast:
            return _GlobalBatchNorm.forward_whole(ctx, x, weight, bias, n, eps, group)
        # This tile's statistics over its ``count`` own pixels inside the image (two passes:
        # its mean, then the squares centred on it), merged with the other tiles' (Chan).
        xm = x if outside is None else _zeroed(x, outside)
        mean_l, var_l = _tile_moments(xm, outside, dims, count, x.shape, own=own)
        mean, var = merged_statistics(mean_l.flatten(), var_l.flatten(), count, n, group)
        # Centred on the image's mean in one rounding (a half-type input keeps its precision).
        xhat = xm - mean.to(x.dtype).view(shape)
        if outside is not None:
            xhat.masked_fill_(outside, 0.0)
        rstd = torch.rsqrt(var + eps)
        xhat.mul_(rstd.to(x.dtype).view(shape))
        if x.dtype in (torch.float32, torch.float64):
            # Normalised by the kernel a tile wholly inside the image uses (forward_whole):
            # equal pixels come out equal on every tile. Rounded otherwise, the flat
            # background of a slide came out one unit apart across a tile border, and a
            # max-pool's ties there sent the gradient to another pixel than one process.
            y = F.batch_norm(xm, mean, var, weight, bias, False, 0.0, eps)
            if outside is not None:  # as the expression has it: the affine of 0 outside
                fill = y.new_zeros(()) if bias is None else bias.to(y.dtype).view(shape)
                torch.where(outside, fill, y, out=y)
        else:
            y = _affine(xhat, weight, bias)
        ctx.save_for_backward(xhat, rstd, weight, outside)
        ctx.n, ctx.group, ctx.own = n, group, own
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def forward_whole(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        n: int,
        eps: float,
        group: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A tile wholly inside the image, in float32/64: PyTorch's own kernels.

        Why: the expression above makes five passes over the tile and three
        tile-sized temporaries; here one fused pass gives the tile's mean and
        variance (``batch_norm_update_stats`` on CPU, ``var_mean`` elsewhere),
        Chan's merge across the tiles needs one all-gather of two numbers per
        channel (:func:`merged_statistics`: no cancellation), and the
        normalisation is ATen's inference kernel with the whole image's
        statistics. The input is saved (it is kept alive instead of a new
        normalised copy: the same bytes).
        """
        _, dims = _channel_shape(x)
        if x.device.type == "cpu":
            # ATen's BatchNorm statistics kernel: 4x faster than var_mean on CPU (a
            # 256-channel 192x96 map: 5.5 vs 21 ms); it has no meta or autocast form.
            mean_l, var_l = torch.batch_norm_update_stats(x, None, None, 0.0)
        else:
            var_l, mean_l = torch.var_mean(x, dim=dims, correction=0)
        # In the dtype the masked path uses: tiles of one image may take either path, and
        # they must issue the same messages.
        mean, var = merged_statistics(mean_l, var_l, x.numel() // x.shape[1], n, group)
        y = F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(x, weight, mean, var)
        ctx.n, ctx.group, ctx.eps = n, group, eps
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward_whole(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Backward of :meth:`forward_whole`: ATen's inference backward gives ``g * scale``
        and this tile's sums of ``g`` and ``g * xhat`` in one pass; the statistics' part
        of the gradient, ``-scale * (mean(g) + xhat * mean(g xhat))``, is then added in
        place as ``a * x + b`` per channel."""
        x, weight, mean, var = ctx.saved_tensors
        shape, _ = _channel_shape(gy)
        dtype = x.dtype
        w = weight if weight is not None else torch.ones_like(mean, dtype=dtype)
        dx, sum_gxhat, sum_g = _aten.native_batch_norm_backward(
            gy, x, w, mean, var, None, None, False, ctx.eps, [True, True, True]
        )
        local = torch.stack([sum_g, sum_gxhat])
        total = all_reduce_sum(local, ctx.group) / ctx.n
        rstd = torch.rsqrt(var + ctx.eps)
        scale = rstd * w
        a = -scale * total[1] * rstd
        b = -scale * total[0] - a * mean
        dx.addcmul_(x, a.to(dtype).view(shape)).add_(b.to(dtype).view(shape))
        if weight is None:
            return dx, None, None, None, None, None, None, None, None
        return (
            dx, sum_gxhat.to(weight.dtype), sum_g.to(weight.dtype), None, None, None, None, None,
            None,
        )  # fmt: skip

    @staticmethod
    @first_order("a spatial BatchNorm")
    def backward(
        ctx: Any, gy: torch.Tensor, _gmean: torch.Tensor, _gvar: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        if ctx.fast:
            return _GlobalBatchNorm.backward_whole(ctx, gy)
        xhat, rstd, weight, outside = ctx.saved_tensors
        shape, dims = _channel_shape(gy)
        g = gy if outside is None else _zeroed(gy, outside)
        local = torch.stack(
            [
                g.sum(dim=dims, dtype=_acc(g)),
                (g * xhat).sum(dim=dims, dtype=_acc(g)),
            ]
        )
        dbias, dweight = local[0].clone(), local[1].clone()
        total = all_reduce_sum(local, ctx.group) / ctx.n
        scale = (rstd if weight is None else rstd * weight.to(rstd.dtype)).to(g.dtype).view(shape)
        mean_g, mean_gx = total[0].to(g.dtype).view(shape), total[1].to(g.dtype).view(shape)
        if ctx.own is None:
            # dx = (g - mean(g) - xhat * mean(g xhat)) * scale, with one activation-sized
            # allocation (this is the largest transient of a spatial backward).
            dx = xhat * -mean_gx
            dx.add_(g).sub_(mean_g).mul_(scale)
        else:
            dx = g * scale
            _own(dx, ctx.own).sub_((_own(xhat, ctx.own) * mean_gx + mean_g) * scale)
        if outside is not None:
            dx.masked_fill_(outside, 0.0)
        if weight is None:
            return dx, None, None, None, None, None, None, None, None
        return (
            dx, dweight.to(weight.dtype), dbias.to(weight.dtype), None, None, None, None, None,
            None,
        )  # fmt: skip


def merged_statistics(
    mean_l: torch.Tensor, var_l: torch.Tensor, count: int, n: int, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The image's per-channel mean and (biased) variance from every tile's own: one
    all-gather of ``(mean, variance, count)`` per tile, then Chan's merge, the same on every
    rank (the tiles in rank order): ``mean = sum(c m) / n``, ``var = sum(c (v + (m -
    mean)^2)) / n``, which centres each tile's mean on the image's and so cancels nothing.

    Why one collective: two all-reduces (the mean, then the centred squares) were a second
    synchronisation per BatchNorm layer in every forward; the merge needs no second look at
    the pixels, only each tile's two numbers per channel."""
    dtype, c = mean_l.dtype, mean_l.numel()
    # One message per tile, assembled once: its two vectors and its pixel count (filled on
    # the device: no copy from the host).
    mine = torch.cat([mean_l, var_l.to(dtype), mean_l.new_full((1,), float(count))])
    flat = mine.new_empty(dist.get_world_size(group) * (2 * c + 1))  # Gloo: concatenated
    dist.all_gather_single(flat, mine, group=group)
    tiles = flat.view(-1, 2 * c + 1)
    m, v, counts = tiles[:, :c], tiles[:, c : 2 * c], tiles[:, 2 * c :]
    mean = (counts * m).sum(0) / n
    var = (counts * (v + (m - mean).square())).sum(0) / n
    return mean, var


def _tile_moments(
    xm: torch.Tensor,
    outside: torch.Tensor | None,
    dims: tuple[int, ...],
    count: int,
    shape: Sequence[int],
    own: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A tile's mean and biased variance over ``dims`` (kept, size 1) of its ``count``
    pixels inside the image and in its own box ``own``, in two passes: the mean, then the
    squares centred on it. ``xm`` (a view of the tile, whose own shape is ``shape``) is
    zero outside the image (``outside``, broadcastable on the tile).

    In the accumulation type: a half-type tile's squares in float32, as torch's own norms
    compute under autocast; the centred copy is gone before the caller normalises, so the
    peak is no higher."""
    acc = _acc(xm)
    mean = _own(xm, own).sum(dim=dims, keepdim=True, dtype=acc) / max(count, 1)
    centred = xm - mean if acc == xm.dtype else xm.to(acc).sub_(mean)
    if outside is not None:
        centred.view(shape).masked_fill_(outside, 0.0)
    var = _own(centred.square_(), own).sum(dim=dims, keepdim=True) / max(count, 1)
    return mean, var


def _affine(
    xhat: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """``xhat * weight + bias`` per channel in one output allocation (the expression would
    hold a second tile-sized temporary); ``xhat`` itself without an affine. In ``xhat``'s
    dtype, as ATen's norms give a half-type input with float32 parameters (autocast):
    promoted to float32, every layer after the norm ran and was saved in float32 on a
    tile where one process runs it in bfloat16."""
    if weight is None:
        return xhat
    shape, _ = _channel_shape(xhat)
    y = torch.addcmul(bias.view(shape), xhat, weight.view(shape))  # type: ignore[union-attr]
    return y.to(xhat.dtype)


def _zeroed(x: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with the positions ``outside`` (a broadcast mask) zero, in ``x``'s
    memory layout: an out-of-place ``masked_fill`` takes the layout of the mask, and a
    channels-last map came out NCHW, and so did every layer after it. One pass into a
    buffer of ``x``'s layout (inside the Functions' forward and backward: no autograd)."""
    return torch.where(outside, x.new_zeros(()), x, out=torch.empty_like(x))


def _channel_shape(x: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape that broadcasts a per-channel vector on ``x`` (N, C, *spatial), and the
    dims a per-channel sum reduces."""
    return (1, -1, *(1,) * (x.dim() - 2)), (0, *range(2, x.dim()))


def _own(t: torch.Tensor, own: tuple[int, ...] | None) -> torch.Tensor:
    """The tile's own pixels of ``t`` (a view), all of it when ``own`` is None.

    ``own`` is ``(start, stop)`` per spatial dim.
    """
    if own is None:
        return t
    return t[trailing([slice(own[2 * k], own[2 * k + 1]) for k in range(len(own) // 2)])]


def _pixels_in(inside: tuple[int, ...], own: tuple[int, ...] | None, spatial: Sequence[int]) -> int:
    """Positions of a tile of size ``spatial`` inside the image box ``inside`` and its own box
    ``own`` (``(start, stop)`` per dim; None: all of it): its share of the statistics."""
    total = 1
    for k, size in enumerate(spatial):
        lo, hi = max(inside[2 * k], 0), min(inside[2 * k + 1], size)
        if own is not None:
            lo, hi = max(lo, own[2 * k]), min(hi, own[2 * k + 1])
        total *= max(hi - lo, 0)
    return total


def _outside_mask(inside: tuple[int, ...], x: torch.Tensor) -> torch.Tensor | None:
    """Boolean map of the spatial positions of ``x`` outside ``inside`` (``(start, stop)`` per
    spatial dim), broadcastable on ``x``; None when all of ``x`` is inside."""
    if not _crosses(inside, x.shape):
        return None
    nd = len(inside) // 2
    mask: torch.Tensor | None = None
    for k in range(nd):
        n = x.shape[k - nd]
        shape = [1] * nd
        shape[k] = n
        idx = torch.arange(n, device=x.device).view(shape)
        out = (idx < inside[2 * k]) | (idx >= inside[2 * k + 1])
        mask = out if mask is None else mask | out
    return mask


class _SpatialBatchNorm(_SpatialMixin):
    """BatchNorm with statistics over the whole image: all tiles, the whole batch.

    Two-pass on each tile (mean, then centred squares) and merged without cancellation, for
    accuracy on badly scaled data. Normalises with the biased variance and stores the
    unbiased one, exactly as ``nn.BatchNorm2d``; running statistics equal the single-process
    ones.
    """

    training: bool
    running_mean: torch.Tensor | None
    running_var: torch.Tensor | None
    num_batches_tracked: torch.Tensor | None
    weight: Any
    bias: Any
    affine: bool
    track_running_stats: bool
    momentum: float | None
    eps: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use_batch = self.training or self.running_mean is None
        if not use_batch:
            # Outside the image the input may hold anything (-inf after a max-pool).
            return F.batch_norm(
                self._mask(x, 0.0),
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                False,
                0.0,
                self.eps,
            )
        n = x.shape[0] * math.prod(self.hyfi_ctx.size_of(self.hyfi_path))
        inside = self._inside(x)
        outside = _outside_mask(inside, x)
        own = None
        if any(self.hyfi_carry[0]):
            carry = self.hyfi_carry[0]
            own = tuple(
                v for k, t in enumerate(self._tile_hw(x)) for v in (carry[2 * k], carry[2 * k] + t)
            )
        y, mean, var = _GlobalBatchNorm.apply(
            x,
            self.weight if self.affine else None,
            self.bias if self.affine else None,
            outside,
            own,
            n,
            x.shape[0] * _pixels_in(inside, own, x.shape[2:]),
            self.eps,
            self.hyfi_ctx.group,
        )
        if self.training and self.track_running_stats and self.running_mean is not None:
            assert self.running_var is not None and self.num_batches_tracked is not None
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = (
                    1.0 / float(self.num_batches_tracked)
                    if self.momentum is None
                    else self.momentum
                )
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                unbiased = var * (n / max(n - 1, 1))
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        return y


class SpatialBatchNorm1d(_SpatialBatchNorm, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` on ``(N, C, L)`` segments, statistics over the whole signal (see
    ``_SpatialBatchNorm``). Only a BatchNorm1d that sees tile data becomes one: on the
    ``(N, C)`` features of a head after the global pool it stays plain."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ConfigError(
                f"module {self.hyfi_path!r} (BatchNorm1d)",
                f"sees a {x.dim()}-D input on a 1-D grid; its spatial form normalises (N, C, L) "
                "segments",
                "give it (N, C, L) signals, or apply it after the global pool",
            )
        return super().forward(x)


class SpatialBatchNorm2d(_SpatialBatchNorm, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` with statistics over the whole image (see ``_SpatialBatchNorm``)."""


class SpatialBatchNorm3d(_SpatialBatchNorm, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` with statistics over the whole volume (see ``_SpatialBatchNorm``)."""


class SpatialGroupNorm(_SpatialMixin, nn.GroupNorm):
    """GroupNorm with statistics over the whole image: per sample and group, all tiles.

    Two-pass on each tile like :class:`SpatialBatchNorm2d` (mean, then centred squares),
    outside the image excluded, merged from one all-gather; backward all-reduces the two
    sums the input gradient needs (each tile's output depends on every tile's pixels
    through the statistics): :class:`_GlobalSampleNorm`.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = (self.weight, self.bias) if self.affine else (None, None)
        return _sample_norm(self, x, self.num_groups, self.eps, weight, bias)[0]


def _sample_norm(
    layer: _SpatialMixin,
    x: torch.Tensor,
    groups: int,
    eps: float,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``x`` normalised with the whole image's statistics per sample and group of channels
    (GroupNorm's; InstanceNorm's with one group per channel), then ``weight`` and ``bias``
    per channel where given; with the statistics: mean and biased variance ``(N, groups)``
    and the pixels each is over.

    Why one function: the two layers' statistics are the same arithmetic
    (:class:`_GlobalSampleNorm`: each tile's two-pass statistics merged from one all-gather,
    outside the image excluded).
    """
    c, tile = x.shape[1], x.shape[2:]
    ctx = layer.hyfi_ctx
    count = (c // groups) * math.prod(ctx.size_of(layer.hyfi_path))
    valid = ctx._valid(layer.hyfi_path, tile)
    inside = tuple(v for end in valid for v in (0, end))
    local = (c // groups) * _pixels_in(inside, None, tile)
    y, mean, var = _GlobalSampleNorm.apply(
        x, weight, bias, inside, groups, count, local, eps, ctx.group
    )
    return y, mean, var, count


class _GlobalSampleNorm(torch.autograd.Function):
    """GroupNorm's statistics (per sample and group of channels) over all tiles, with a
    hand-written backward, as :class:`_GlobalBatchNorm` does per channel.

    Forward: each tile's mean and centred variance per sample and group over its pixels
    inside the image (``inside``: ``(start, stop)`` per spatial dim), merged from one
    all-gather (:func:`merged_statistics`), then ``xhat = (x - mean) * rstd`` and the
    per-channel affine. Backward: one all-reduce of the two sums the input gradient needs,
    per sample and group, ``dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat))`` with
    ``gw = g * weight`` and means over the whole image's pixels and the group's channels;
    the weight and bias gradients are this tile's share (summed over the tiles later, as
    for every parameter that sees tiles). Outside the image: ignored, no gradient. One
    activation is saved (``xhat``); autograd through the tensor expression kept two, and
    issued two collectives each way.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        inside: tuple[int, ...],
        groups: int,
        count: int,
        local: int,
        eps: float,
        group: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, c, *tile = x.shape
        ones = (1,) * (len(tile) + 1)
        dims = tuple(range(2, 3 + len(tile)))
        outside = _outside_mask(inside, x)
        xm = x if outside is None else _zeroed(x, outside)
        xg = xm.view(n, groups, c // groups, *tile)
        mean_l, var_l = _tile_moments(xg, outside, dims, local, x.shape)
        mean, var = merged_statistics(mean_l.flatten(), var_l.flatten(), local, count, group)
        mean, var = mean.view(n, groups), var.view(n, groups)
        rstd = torch.rsqrt(var + eps)
        xhat = xg - mean.to(x.dtype).view(n, groups, *ones)
        xhat.mul_(rstd.to(x.dtype).view(n, groups, *ones))
        xhat = xhat.view(x.shape)
        if outside is not None:
            xhat.masked_fill_(outside, 0.0)
        y = _affine(xhat, weight, bias)
        ctx.save_for_backward(xhat, rstd, weight, outside)
        ctx.groups, ctx.count, ctx.group = groups, count, group
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    @first_order("a spatial GroupNorm")
    def backward(
        ctx: Any, gy: torch.Tensor, _gmean: torch.Tensor, _gvar: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        xhat, rstd, weight, outside = ctx.saved_tensors
        n, c, *tile = gy.shape
        groups, ones = ctx.groups, (1,) * (len(tile) + 1)
        dims = tuple(range(2, 3 + len(tile)))
        shape, channel_dims = _channel_shape(gy)
        g = gy if outside is None else _zeroed(gy, outside)
        gw = g if weight is None else g * weight.to(g.dtype).view(shape)
        gwg, xg = gw.view(n, groups, c // groups, *tile), xhat.view(n, groups, c // groups, *tile)
        acc = _acc(g)
        local = torch.stack([gwg.sum(dim=dims, dtype=acc), (gwg * xg).sum(dim=dims, dtype=acc)])
        total = all_reduce_sum(local, ctx.group) / ctx.count
        mean_g = total[0].to(g.dtype).view(n, groups, *ones)
        mean_gx = total[1].to(g.dtype).view(n, groups, *ones)
        dx = xg * -mean_gx
        dx.add_(gwg).sub_(mean_g).mul_(rstd.to(g.dtype).view(n, groups, *ones))
        dx = dx.view(gy.shape)
        if outside is not None:
            dx.masked_fill_(outside, 0.0)
        if weight is None:
            return dx, None, None, None, None, None, None, None, None
        dweight = (g * xhat).sum(dim=channel_dims, dtype=acc).to(weight.dtype)
        dbias = g.sum(dim=channel_dims, dtype=acc).to(weight.dtype)
        return dx, dweight, dbias, None, None, None, None, None, None


def _norm_act(norm: type[nn.Module], base: type[nn.Module]) -> type[nn.Module]:
    """The spatial form of a norm + activation layer (timm's ``BatchNormAct2d``,
    ``GroupNormAct``): the spatial norm, then the layer's own ``drop`` and ``act``."""

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(norm.forward(self, x)))

    return type(
        f"Spatial{base.__name__}", (norm, base), {"forward": forward, "hyfi_norm_act": True}
    )


def _plain_equivalent(m: nn.Module) -> type[nn.Module] | None:
    """The torch.nn layer a known subclass computes exactly (timm's ``GroupNorm`` and
    ``GroupNorm1``, whose forward is ``F.group_norm``), else None."""
    cls = type(m)
    if cls.__module__.startswith("timm.") and cls.__name__ in ("GroupNorm", "GroupNorm1"):
        return nn.GroupNorm
    return None


def _is_norm_act(m: nn.Module) -> bool:
    """timm's norm + activation layers: a BatchNorm2d/GroupNorm subclass whose forward
    normalises, then applies its ``drop`` and ``act`` modules (per pixel, judged by the watch)."""
    return (
        type(m).__name__ in ("BatchNormAct2d", "GroupNormAct")
        and isinstance(getattr(m, "act", None), nn.Module)
        and isinstance(getattr(m, "drop", None), nn.Module)
    )
