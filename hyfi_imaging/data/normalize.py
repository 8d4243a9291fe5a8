"""From stored pixels to ``[0, 1]`` floats, per channel: the one place that does it.

Why here, at load time, and not in the store: the store keeps the image as it
is (:mod:`hyfi_imaging.io.pixels`), so one preprocessed cohort serves any
normalisation a study wants, and a change of mind costs no re-conversion.

Three modes, set in the dataset card (``normalize:``) or the recipe
(``data.normalize``):

* ``dtype`` (default): divide by the pixel type's maximum. 8-bit RGB is
  ``x / 255``, exactly what hyfi-imaging always did; uint16 is ``x / 65535``;
  float32 images are used as they are (not clipped).
* ``range``: fixed ``[low, high]`` per channel (one pair for every channel, or
  one per channel): ``(x - low) / (high - low)``.
* ``percentile``: each image's own ``low``-th and ``high``-th percentile of
  each channel, from the statistics ``hyfi-preprocess`` stored with the image
  (``attributes.hyfi_stats``: the coarsest pyramid level, tissue placement
  only), so no pixels are read to find them. ``low`` and ``high`` must be
  percentiles the store holds (:data:`~hyfi_imaging.io.channels.STAT_PERCENTILES`).

``clip`` (default on) clips to ``[0, 1]`` afterwards. Every step is one
elementwise float32 operation, so a tile's pixels equal the whole image's.
The recipe's ``data.mean`` / ``data.std`` are applied after this, in the trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from hyfi_imaging.errors import ConfigError, SlideError
from hyfi_imaging.io.channels import STAT_PERCENTILES, stat_percentile
from hyfi_imaging.io.pixels import dtype_range

__all__ = ["NormalizeMode", "Normalization", "Window"]

NormalizeMode = Literal["dtype", "range", "percentile"]


@dataclass(frozen=True)
class Window:
    """The per-channel map ``(x - low) / span``, then optionally clipped to ``[0, 1]``.

    ``low`` and ``span`` are float32 ``(C,)``; ``span`` is never zero.
    """

    low: np.ndarray
    span: np.ndarray
    clip: bool

    def apply(self, image: np.ndarray) -> np.ndarray:
        """``image`` ``(C, h, w)`` of any pixel type as float32 ``(C, h, w)`` (a new array)."""
        if image.shape[0] != self.low.shape[0]:
            raise ValueError(
                f"a {image.shape[0]}-channel image for a {self.low.shape[0]}-channel window"
            )
        x: np.ndarray = image.astype(np.float32)
        if self.low.any():
            np.subtract(x, self.low[:, None, None], out=x)
        # Exactly x / 255 for 8-bit images, like torchvision's ToTensor.
        np.divide(x, self.span[:, None, None], out=x)
        if self.clip:
            np.clip(x, np.float32(0.0), np.float32(1.0), out=x)
        return x

    def bounded(self, dtype: np.dtype[Any]) -> bool:
        """Whether :meth:`apply` keeps every value of an image of ``dtype`` in ``[0, 1]``:
        clipped, or an integer type divided by its maximum (:meth:`of_dtype`)."""
        if self.clip:
            return True
        if np.dtype(dtype).kind not in "ui":
            return False
        top = np.float32(dtype_range(dtype)[1])
        return bool(not self.low.any() and np.all(self.span == top))

    @classmethod
    def of_dtype(cls, dtype: np.dtype[Any], channels: int) -> Window:
        """The default: divide by the type's maximum (float32: unchanged, not clipped)."""
        top = dtype_range(dtype)[1]
        is_int = np.dtype(dtype).kind in "ui"
        return cls(
            np.zeros(channels, np.float32),
            np.full(channels, top if is_int else 1.0, np.float32),
            clip=False,
        )


@dataclass(frozen=True)
class Normalization:
    """How a dataset's stored pixels become ``[0, 1]`` floats (see the module docstring).

    Attributes:
        mode: ``"dtype"``, ``"range"`` or ``"percentile"``.
        ranges: ``range`` mode: ``((low, high),)`` for every channel, or one pair per channel.
        low, high: ``percentile`` mode: the percentiles mapped to 0 and 1.
        clip: clip to ``[0, 1]`` (``range`` and ``percentile`` modes).

    OK: ``Normalization("percentile", low=1.0, high=99.0)``.
    Error: ``Normalization("percentile", low=3.0)`` raises ConfigError listing the
    stored percentiles.
    """

    mode: NormalizeMode = "dtype"
    ranges: tuple[tuple[float, float], ...] = ()
    low: float = 1.0
    high: float = 99.0
    clip: bool = True

    def __post_init__(self) -> None:
        where = f"normalize mode {self.mode}"
        if self.mode not in ("dtype", "range", "percentile"):
            raise ConfigError(
                where, "is not a normalisation mode", "use dtype, range or percentile"
            )
        bad_ranges = not self.ranges or any(len(r) != 2 or not r[0] < r[1] for r in self.ranges)
        if self.mode == "range" and bad_ranges:
            raise ConfigError(
                f"{where}, ranges {list(self.ranges)}",
                "needs one [low, high] with low < high, or one per channel",
                "write e.g. ranges: [[0, 4095]]",
            )
        if self.mode == "percentile":
            bad = [q for q in (self.low, self.high) if q not in STAT_PERCENTILES]
            if bad or not self.low < self.high:
                raise ConfigError(
                    f"{where}, low {self.low}, high {self.high}",
                    f"low < high must be percentiles the stores hold ({', '.join(map(str, STAT_PERCENTILES))})",
                    "pick two of those",
                )

    def check(self, channels: int, where: str) -> None:
        """ConfigError unless this normalisation fits images of ``channels`` channels."""
        if self.mode == "range" and len(self.ranges) not in (1, channels):
            raise ConfigError(
                where,
                f"normalize has {len(self.ranges)} ranges but the images have {channels} channels",
                "give one [low, high] for all channels or one per channel",
            )

    def window(
        self,
        dtype: np.dtype[Any],
        channels: int,
        stats: dict[str, Any] | None,
        where: str,
    ) -> Window:
        """The :class:`Window` of one image (``stats``: its store's ``hyfi_stats``).

        Raises SlideError when ``percentile`` mode meets a store without statistics.
        """
        if self.mode == "dtype":
            return Window.of_dtype(dtype, channels)
        self.check(channels, where)
        if self.mode == "range":
            pairs: Sequence[tuple[float, float]] = (
                self.ranges * channels if len(self.ranges) == 1 else self.ranges
            )
        else:
            if not stats or len(stats.get("values", ())) != channels:
                raise SlideError(
                    where,
                    "the store holds no channel statistics for percentile normalisation",
                    "rewrite it with this version of hyfi-preprocess, or use normalize mode range",
                )
            pairs = [
                (stat_percentile(stats, c, self.low), stat_percentile(stats, c, self.high))
                for c in range(channels)
            ]
        low = np.array([p[0] for p in pairs], np.float32)
        span = np.array([p[1] - p[0] for p in pairs], np.float32)
        span[span <= 0] = 1.0  # a flat channel (all one value) maps to 0, not to NaN
        return Window(low, span, self.clip)
