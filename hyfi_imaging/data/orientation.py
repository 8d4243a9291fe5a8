"""Flips and quarter turns of an N-d image as one value: a signed permutation of its axes.

Why: globally consistent augmentation (:mod:`hyfi_imaging.data.augment` for
slides, :mod:`hyfi_imaging.data.volume_augment` for volumes) must tell each
rank which source box its tile shows, and turn that block exactly as the whole
image is turned. Any sequence of flips and ``np.rot90`` calls on an N-d array
is a *signed permutation*: output axis ``i`` is source axis ``perm[i]``, read
backwards when ``reverse[i]``. In that form both questions are one line per
axis, for any number of axes, with no corner cases:

* the source box of an output box ``[o, o + s)`` on axis ``i`` is
  ``[o, o + s)`` on source axis ``perm[i]``, or ``[N - o - s, N - o)`` when
  reversed (``N`` that axis's length) — boxes reaching outside the image map
  to boxes reaching outside the source, so halos and padding need no case;
* a block is flipped along the reversed source axes, then transposed.

So slides (flips of y and x, rot90 in the one plane) and volumes (flips of
z, y and x, rot90 in any plane) share this code rather than each deriving
its own inverse maps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hyfi_imaging.geometry.tiles import BoxND

__all__ = ["Orientation"]


@dataclass(frozen=True)
class Orientation:
    """Output axis ``i`` is source axis ``perm[i]``, reversed when ``reverse[i]``.

    OK: ``Orientation.of(2, flips=(True, False), turns=[((0, 1), 1)])`` is
    ``np.rot90(np.flip(a, 0), 1)`` of an ``(h, w)`` image.
    """

    perm: tuple[int, ...]
    reverse: tuple[bool, ...]

    @classmethod
    def identity(cls, ndim: int) -> Orientation:
        """No flip, no turn."""
        return cls(tuple(range(ndim)), (False,) * ndim)

    @classmethod
    def of(
        cls,
        ndim: int,
        *,
        flips: Sequence[bool] = (),
        turns: Sequence[tuple[tuple[int, int], int]] = (),
    ) -> Orientation:
        """Flip the source along the axes where ``flips`` is true, then ``np.rot90`` in order.

        ``turns`` holds ``((a, b), k)``: ``np.rot90(image, k, axes=(a, b))`` on
        the spatial axes ``a, b`` of the image as turned so far.
        """
        o = cls.identity(ndim)
        for axis, flip in enumerate(flips):
            if flip:
                o = o.flipped(axis)
        for (a, b), k in turns:
            for _ in range(int(k) % 4):
                o = o.turned(a, b)
        return o

    def flipped(self, axis: int) -> Orientation:
        """This orientation followed by a flip of output axis ``axis``."""
        rev = list(self.reverse)
        rev[axis] = not rev[axis]
        return Orientation(self.perm, tuple(rev))

    def turned(self, a: int, b: int) -> Orientation:
        """This orientation followed by ``np.rot90(image, 1, axes=(a, b))``.

        numpy's quarter turn reads the new axis ``a`` from the old axis ``b``
        backwards and the new axis ``b`` from the old axis ``a``.
        """
        perm, rev = list(self.perm), list(self.reverse)
        perm[a], perm[b] = self.perm[b], self.perm[a]
        rev[a], rev[b] = not self.reverse[b], self.reverse[a]
        return Orientation(tuple(perm), tuple(rev))

    def out_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Spatial shape of the oriented image of a source of ``shape``."""
        return tuple(int(shape[p]) for p in self.perm)

    def source_box(self, box: BoxND, shape: Sequence[int]) -> BoxND:
        """The source box (in a source of ``shape``) that output ``box`` shows; unclipped."""
        origin = [0] * len(self.perm)
        size = [0] * len(self.perm)
        for i, (p, rev) in enumerate(zip(self.perm, self.reverse, strict=True)):
            o, s = box.origin[i], box.size[i]
            origin[p] = int(shape[p]) - o - s if rev else o
            size[p] = s
        return BoxND(tuple(origin), tuple(size))

    def apply(self, block: np.ndarray) -> np.ndarray:
        """Orient a ``(C, *spatial)`` source block as the whole image is oriented (contiguous)."""
        flip_axes = tuple(1 + p for p, rev in zip(self.perm, self.reverse, strict=True) if rev)
        flipped = np.flip(block, flip_axes) if flip_axes else block
        return np.ascontiguousarray(np.transpose(flipped, (0, *(1 + p for p in self.perm))))
