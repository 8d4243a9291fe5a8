"""Spans and partitions of one axis, and the one padding rule: pure integer arithmetic.

Why at the bottom: the engine, the planner, the loader (2-D tiles and 3-D
sub-volumes) and the stores all ask which indices a tile owns and how far the
image is padded. These answers import nothing but :mod:`hyfi_imaging.errors`,
so every layer of the package can ask them without importing the layers above
(the loader used to reach them through ``hyfi_imaging.parallel``, and ``io``
through ``data``: a cycle).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import NamedTuple

from hyfi_imaging.errors import ConfigError

__all__ = ["Span", "check_int", "check_partition", "padded_hw", "split", "split_balanced"]


class Span(NamedTuple):
    """Half-open index range ``[start, stop)``; empty when ``stop <= start``."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        """Number of indices in the span (0 when empty)."""
        return max(0, self.stop - self.start)

    @property
    def empty(self) -> bool:
        """True when the span holds no index."""
        return self.stop <= self.start

    def intersect(self, other: tuple[int, int]) -> Span:
        """Indices in both spans; an empty result is returned as ``(a, a)``."""
        start, stop = max(self.start, other[0]), min(self.stop, other[1])
        return Span(start, max(start, stop))

    def slice(self, origin: int = 0) -> slice:
        """Local slice of this span in an array whose index 0 is global ``origin``."""
        return slice(self.start - origin, self.stop - origin)


def check_int(where: str, name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(where, f"{name} is {value!r}", f"use an integer >= {minimum}")


def padded_hw(image_hw: Sequence[int], grid: Sequence[int], align: int = 1) -> tuple[int, ...]:
    """The image size after global padding: the one padding rule, used everywhere.

    A grid of one tile is not padded: one process runs the plain model on the
    image as it is, whatever the model's stride. Otherwise each axis becomes
    ``tiles x t``, ``t = ceil(n / (tiles * align)) * align`` (see :func:`split`,
    which also refuses a grid that leaves a tile without image pixels).

    OK: ``padded_hw((777, 777), (1, 1), 32)`` -> ``(777, 777)``;
    ``padded_hw((777, 777), (1, 2), 32)`` -> ``(800, 832)``.
    """
    if len(image_hw) != len(grid):
        raise ConfigError(
            f"grid {tuple(grid)}",
            f"has {len(grid)} axes for an image of {len(image_hw)}",
            "give one tile count per image axis",
        )
    if all(int(g) == 1 for g in grid):
        return tuple(int(n) for n in image_hw)
    names = {1: ("length",), 2: ("height", "width")}.get(len(grid), ("depth", "height", "width"))
    return tuple(
        split(int(n), int(g), align=align, axis=names[k])[-1].stop
        for k, (n, g) in enumerate(zip(image_hw, grid, strict=True))
    )


def split(n: int, parts: int, *, align: int = 1, axis: str = "axis") -> tuple[Span, ...]:
    """Equal tiles ``[r*t, (r+1)*t)``, ``t = ceil(n / (parts*align)) * align``.

    The tiles cover the padded length ``parts * t >= n``; the last tiles may own
    indices past ``n`` (not data, see the module docstring). ConfigError when a
    tile would hold nothing of the image.

    OK: ``split(10, 3, align=2)`` -> ``[0,4) [4,8) [8,12)``.
    Error: ``split(8, 3, align=4)`` -> tile 2 would start at 8 >= 8.
    """
    where = f"split of {axis} (length {n}) into {parts} tiles aligned to {align}"
    check_int(where, "length", n, 1)
    check_int(where, "parts", parts, 1)
    check_int(where, "align", align, 1)
    tile = -(-n // (parts * align)) * align
    if (parts - 1) * tile >= n:
        most = max(p for p in range(1, parts) if (p - 1) * (-(-n // (p * align)) * align) < n)
        raise ConfigError(
            where,
            f"tiles of {tile} leave tile {parts - 1} with nothing of the image "
            f"(it would start at {(parts - 1) * tile} >= {n})",
            f"use at most {most} tiles along {axis}, or a {axis} length of at least "
            f"{_next_splittable(n, parts, align)}",
        )
    return tuple(Span(r * tile, (r + 1) * tile) for r in range(parts))


def _next_splittable(n: int, parts: int, align: int) -> int:
    """The least length ``>= n`` whose equal tiles leave none of ``parts`` empty."""
    m = n
    while (parts - 1) * (-(-m // (parts * align)) * align) >= m:
        m += 1
    return m


def split_balanced(n: int, parts: int, *, axis: str = "axis") -> tuple[Span, ...]:
    """Tiles covering exactly ``[0, n)`` whose sizes differ by at most one (larger first)."""
    where = f"balanced split of {axis} (length {n}) into {parts} tiles"
    check_int(where, "length", n, 1)
    check_int(where, "parts", parts, 1)
    if parts > n:
        raise ConfigError(
            where,
            f"{parts} tiles cannot each own one of {n} indices",
            f"use at most {n} tiles along {axis}",
        )
    size, extra = divmod(n, parts)
    starts = [r * size + min(r, extra) for r in range(parts + 1)]
    return tuple(Span(a, b) for a, b in pairwise(starts))


def check_partition(spans: Sequence[tuple[int, int]], n: int, where: str) -> tuple[Span, ...]:
    """Contiguous, non-empty spans from 0 whose every tile holds something of ``[0, n)``."""
    result = tuple(Span(int(a), int(b)) for a, b in spans)
    if not result:
        raise ConfigError(where, "no tile was given", "give one span per rank")
    expect = 0
    for rank, span in enumerate(result):
        if span.start != expect or span.empty:
            raise ConfigError(
                where,
                f"rank {rank} owns {tuple(span)} but the tiles must be non-empty and "
                f"contiguous from 0 (expected a start of {expect})",
                "give spans [0, a), [a, b), ... as split() returns",
            )
        if span.start >= n:
            raise ConfigError(
                where,
                f"rank {rank} would own {tuple(span)}, nothing of the {n} real indices",
                "use fewer tiles along this axis or a larger image",
            )
        expect = span.stop
    if expect < n:
        raise ConfigError(where, f"the tiles end at {expect} < {n}", "cover the whole axis")
    return result
