"""Augmentation of the *whole* image that every spatial rank applies to its own tile.

Why this shape: with spatial parallelism no rank ever holds the whole image,
yet the model must see exactly the augmented whole image, stitched from tiles.
So augmentation is split into what can be mapped to a tile exactly:

* **Parameters are global.** :func:`draw_augment` draws them from
  ``numpy.random.Generator(SeedSequence([seed, epoch, index]))``: every rank
  (and every DataLoader worker) draws the same values for the same sample
  without talking to anyone. Every value is always drawn, in a fixed order, so
  turning one option off does not change the others.
* **Geometry is a map of rectangles.** A flip and a rot90 of the whole image
  carry an axis-aligned rectangle to an axis-aligned rectangle (a signed
  permutation of the axes, :mod:`hyfi_imaging.data.orientation`, shared with
  volumes), and a crop (or translation) window is an offset. So for any
  output-space box (a tile plus halo) :func:`source_box` gives the source rectangle to read, and
  :func:`apply_geometry` flips/rotates that block into the box of the augmented
  image — bit for bit, see :func:`read_augmented`.
* **Colour is pointwise.** Brightness scales, contrast pivots about a *fixed*
  0.5 (the image mean, which torchvision uses, is unknown to a tile),
  saturation blends towards each pixel's own luma, hue rotates chroma in YIQ
  space. Each is a per-pixel formula written as separate elementwise float32
  operations (no BLAS, no fused kernels whose rounding depends on array
  shape), so a tile's pixels equal the whole image's pixels exactly.

The transformed image is ``rot90(flip(source), k)`` (numpy's ``rot90`` on the
``(y, x)`` axes, counter-clockwise). The output is the ``out_size`` window at
``offset`` of the transformed image: a crop when the window is smaller, a
random placement of the image on a background canvas when it is larger.

Pixels outside the source image (translation) and outside the output image
(the global padding and the halo past the border) are background *before*
colour jitter and are jittered like every other pixel: the whole-image
reference and the tiles agree trivially, and background stays "glass" under
the same jitter as the tissue. Spatial layers mask the global padding anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hyfi_imaging.data.normalize import Window
from hyfi_imaging.data.orientation import Orientation
from hyfi_imaging.data.tiles import Box, read_window
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.geometry.tiles import BoxND
from hyfi_imaging.io.base import BACKGROUND, SlideReader, clip_region

__all__ = [
    "AugmentConfig",
    "AugmentParams",
    "apply_colour",
    "apply_geometry",
    "augment_image",
    "draw_augment",
    "output_size",
    "read_augmented",
    "source_box",
]

# Luma weights (ITU-R BT.601), used for saturation and for YIQ.
_LUMA = (0.299, 0.587, 0.114)
_RGB_TO_YIQ = np.array(
    [_LUMA, (0.596, -0.274, -0.322), (0.211, -0.523, 0.312)],
    dtype=np.float64,
)
_CONTRAST_PIVOT = 0.5


@dataclass(frozen=True)
class AugmentConfig:
    """Which augmentations to draw, and how strong.

    Attributes:
        flip: flip each axis with probability 1/2.
        rot90: rotate by ``k · 90°``, ``k`` uniform in 0..3.
        out_size: ``(h, w)`` of the output window, placed uniformly at random in
            (or around, when larger) the transformed image; ``None`` keeps the
            transformed image's size.
        brightness: scale by a factor uniform in ``[1 - b, 1 + b]``.
        contrast: stretch about 0.5 by a factor uniform in ``[1 - c, 1 + c]``.
        saturation: blend towards per-pixel luma by a factor uniform in ``[1 - s, 1 + s]``.
        hue: rotate chroma by ``2π · u`` with ``u`` uniform in ``[-hue, hue]``, ``hue <= 0.5``.
    """

    flip: bool = False
    rot90: bool = False
    out_size: tuple[int, int] | None = None
    brightness: float = 0.0
    contrast: float = 0.0
    saturation: float = 0.0
    hue: float = 0.0

    def __post_init__(self) -> None:
        for name in ("brightness", "contrast", "saturation"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"augment {name}={value}", "must lie in [0, 1]", "use e.g. 0.1")
        if not 0.0 <= self.hue <= 0.5:
            raise ConfigError(f"augment hue={self.hue}", "must lie in [0, 0.5]", "use e.g. 0.05")
        if self.out_size is not None:
            if len(self.out_size) != 2 or min(self.out_size) < 1:
                raise ConfigError(
                    f"augment out_size={self.out_size}",
                    "must be (h, w) >= 1",
                    "use e.g. (8192, 8192)",
                )
            object.__setattr__(self, "out_size", (int(self.out_size[0]), int(self.out_size[1])))


@dataclass(frozen=True)
class AugmentParams:
    """One sample's drawn augmentation; identical on every rank.

    Attributes:
        image_hw: ``(H, W)`` of the source image.
        out_hw: ``(h, w)`` of the output image.
        flip_y, flip_x: flip the source along y / x first.
        k: then rotate ``k`` times by 90° counter-clockwise (``np.rot90``).
        offset: ``(oy, ox)`` of the output window in the transformed image
            (may be negative or run past its end: background there).
        brightness, contrast, saturation: factors (1 = unchanged).
        hue: chroma rotation in turns (0 = unchanged).
    """

    image_hw: tuple[int, int]
    out_hw: tuple[int, int]
    flip_y: bool = False
    flip_x: bool = False
    k: int = 0
    offset: tuple[int, int] = (0, 0)
    brightness: float = 1.0
    contrast: float = 1.0
    saturation: float = 1.0
    hue: float = 0.0

    @property
    def transformed_hw(self) -> tuple[int, int]:
        """``(h, w)`` of the source after flip and rotation."""
        h, w = self.image_hw
        return (w, h) if self.k % 2 else (h, w)

    @property
    def orientation(self) -> Orientation:
        """The flips and rotation as a signed permutation of ``(y, x)`` (source -> transformed)."""
        return Orientation.of(2, flips=(self.flip_y, self.flip_x), turns=[((0, 1), self.k)])

    @property
    def colour_identity(self) -> bool:
        """True when colour jitter would leave every pixel unchanged."""
        return (self.brightness, self.contrast, self.saturation, self.hue) == (1.0, 1.0, 1.0, 0.0)


def output_size(spec: AugmentConfig | AugmentParams, image_hw: tuple[int, int]) -> tuple[int, int]:
    """``(h, w)`` of the augmented image of a ``image_hw`` source.

    From a config the size must not depend on the draw: a rot90 of a
    non-square image without ``out_size`` raises :class:`ConfigError`.
    """
    if isinstance(spec, AugmentParams):
        return spec.out_hw
    if spec.out_size is not None:
        return spec.out_size
    h, w = int(image_hw[0]), int(image_hw[1])
    if spec.rot90 and h != w:
        raise ConfigError(
            f"augment rot90 on a {h}x{w} image",
            "a 90° rotation swaps h and w, so the output shape would vary per sample",
            "set out_size (e.g. a square window) or turn rot90 off",
        )
    return h, w


def _window_offset(rng: np.random.Generator, length: int, window: int) -> int:
    # A smaller window crops, a larger one places the image at random on the canvas.
    lo, hi = min(0, length - window), max(0, length - window)
    return int(rng.integers(lo, hi, endpoint=True))


def draw_augment(
    config: AugmentConfig, image_hw: tuple[int, int], *, seed: int, epoch: int, index: int
) -> AugmentParams:
    """Draw one sample's :class:`AugmentParams`, the same on every rank and worker."""
    if min(seed, epoch, index) < 0:
        raise ConfigError(
            f"augment seed={seed} epoch={epoch} index={index}",
            "must be >= 0",
            "use non-negative integers",
        )
    image_hw = (int(image_hw[0]), int(image_hw[1]))
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, index])))
    # Draw everything, always, in a fixed order: options do not shift each other's streams.
    flips = rng.random(2) < 0.5
    k = int(rng.integers(0, 4))
    k = k if config.rot90 else 0
    h, w = image_hw
    transformed = (w, h) if k % 2 else (h, w)
    out_hw = config.out_size if config.out_size is not None else transformed
    # The colour draws before the window's: an offset's draws depend on its range (0 for a
    # square image, which draws nothing), so they came first and shifted the colour stream
    # of a non-square image with rot90 on or off.
    u = rng.uniform(-1.0, 1.0, size=4)
    oy = _window_offset(rng, transformed[0], out_hw[0])
    ox = _window_offset(rng, transformed[1], out_hw[1])
    return AugmentParams(
        image_hw=image_hw,
        out_hw=out_hw,
        flip_y=bool(flips[0]) and config.flip,
        flip_x=bool(flips[1]) and config.flip,
        k=k,
        offset=(oy, ox),
        brightness=1.0 + config.brightness * float(u[0]),
        contrast=1.0 + config.contrast * float(u[1]),
        saturation=1.0 + config.saturation * float(u[2]),
        hue=config.hue * float(u[3]),
    )


def source_box(params: AugmentParams, box: Box) -> Box:
    """The source rectangle ``(y, x, h, w)`` that an output box ``(y, x, h, w)`` shows.

    May extend outside the source image (translation, global padding); the
    output box is *not* clipped to the output image here.
    """
    y, x, h, w = box
    oy, ox = params.offset
    src = params.orientation.source_box(BoxND((y + oy, x + ox), (h, w)), params.image_hw)
    return src.origin[0], src.origin[1], src.size[0], src.size[1]


def apply_geometry(block: np.ndarray, params: AugmentParams) -> np.ndarray:
    """Flip and rotate a ``(C, h, w)`` source block as the whole image is flipped and rotated."""
    return params.orientation.apply(block)


def read_augmented(
    reader: SlideReader,
    params: AugmentParams,
    box: Box,
    *,
    level: int = 0,
    fill: float | None = None,
) -> np.ndarray:
    """Read output box ``(y, x, h, w)`` of the geometrically augmented image, ``(C, h, w)``.

    Equals ``augment_image(whole)[:, y:y+h, x:x+w]`` with ``fill`` (default:
    the reader's background) wherever the box lies outside the output image,
    while reading only the source pixels the box shows; pixels keep the
    reader's type. Colour jitter is separate: :func:`apply_colour`.
    """
    value = reader.background if fill is None else fill
    dims = tuple(int(v) for v in reader.level_dimensions[level])
    if dims != params.image_hw:
        raise ConfigError(
            f"{reader.path} level {level}",
            f"the level is {dims[0]}x{dims[1]} but the augmentation was drawn for "
            f"{params.image_hw[0]}x{params.image_hw[1]}",
            "draw it with draw_augment(config, reader.level_dimensions[level], ...)",
        )
    y, x, h, w = (int(v) for v in box)
    clipped = clip_region(y, x, h, w, *params.out_hw)
    out = np.full((reader.channels, h, w), value, dtype=reader.dtype)
    if clipped is not None:
        y0, x0, y1, x1 = clipped
        src = source_box(params, (y0, x0, y1 - y0, x1 - x0))
        block = read_window(reader, src, level=level, fill=value)
        out[:, y0 - y : y1 - y, x0 - x : x1 - x] = apply_geometry(block, params)
    return out


def augment_image(
    image: np.ndarray, params: AugmentParams, *, fill: float = BACKGROUND
) -> np.ndarray:
    """The geometrically augmented whole ``(C, H, W)`` image of any pixel type (the reference).

    Implemented directly with numpy flips, ``rot90`` and a padded window, not
    through :func:`source_box` or :class:`~hyfi_imaging.data.orientation.Orientation`,
    so tests of the tile path compare against an independent computation.
    """
    if tuple(image.shape[1:]) != params.image_hw:
        raise ValueError(f"image {image.shape} does not match params {params.image_hw}")
    t = image[:, ::-1, :] if params.flip_y else image
    t = t[:, :, ::-1] if params.flip_x else t
    t = np.rot90(t, params.k % 4, axes=(1, 2))
    (oy, ox), (oh, ow) = params.offset, params.out_hw
    out = np.full((image.shape[0], oh, ow), fill, dtype=image.dtype)
    box = clip_region(oy, ox, oh, ow, t.shape[1], t.shape[2])
    if box is not None:
        y0, x0, y1, x1 = box
        out[:, y0 - oy : y1 - oy, x0 - ox : x1 - ox] = t[:, y0:y1, x0:x1]
    return out


def _hue_matrix(turns: float) -> list[list[float]]:
    """The RGB -> RGB matrix that rotates the (I, Q) chroma plane by ``turns · 2π``."""
    c, s = math.cos(2 * math.pi * turns), math.sin(2 * math.pi * turns)
    rotate = np.array([[1.0, 0.0, 0.0], [0.0, c, -s], [0.0, s, c]])
    matrix = np.linalg.inv(_RGB_TO_YIQ) @ rotate @ _RGB_TO_YIQ
    return [[float(v) for v in row] for row in matrix]


def _mix(
    x: np.ndarray, weights: list[float] | tuple[float, ...], scratch: np.ndarray
) -> np.ndarray:
    """``sum_c weights[c] * x[c]`` as separate elementwise float32 ops.

    One rounding per multiply and add, in a fixed order, whatever the array
    shape: a BLAS matrix product could block and fuse differently for a tile
    than for the whole image.
    """
    acc: np.ndarray = x[0] * np.float32(weights[0])
    for c in range(1, x.shape[0]):
        np.multiply(x[c], np.float32(weights[c]), out=scratch)
        acc += scratch
    return acc


def apply_colour(
    image: np.ndarray, params: AugmentParams, *, window: Window | None = None
) -> np.ndarray:
    """Normalise a ``(C, h, w)`` image to float32 and colour-jitter it.

    ``window`` maps stored values to ``[0, 1]`` per channel
    (:mod:`hyfi_imaging.data.normalize`; default: divide by the pixel type's
    maximum, exactly ``x / 255`` for 8-bit images). Then pointwise, in the
    fixed order brightness, contrast, saturation, hue, each clipped to
    ``[0, 1]`` where the window keeps values there (:meth:`Window.bounded`; a float
    image used as it is, or ``clip: false``, is jittered unclipped: clipping only the
    training images made them another range than the validation ones): a tile gives
    exactly the pixels of the whole image.
    Saturation and hue need RGB (``C == 3``). Works in place where it can: an
    8K tile plus halo is ~0.9 GB per float32 copy.
    """
    if window is None:
        window = Window.of_dtype(image.dtype, image.shape[0])
    x = window.apply(image)
    if params.colour_identity:
        return x
    one, zero = np.float32(1.0), np.float32(0.0)
    bounded = window.bounded(image.dtype)
    if params.brightness != 1.0:
        x *= np.float32(params.brightness)
        if bounded:
            np.clip(x, zero, one, out=x)
    if params.contrast != 1.0:
        pivot = np.float32(_CONTRAST_PIVOT)
        x -= pivot
        x *= np.float32(params.contrast)
        x += pivot
        if bounded:
            np.clip(x, zero, one, out=x)
    if params.saturation == 1.0 and params.hue == 0.0:
        return x
    if x.shape[0] != 3:
        raise ConfigError(
            f"colour jitter on a {x.shape[0]}-channel image",
            "saturation and hue need RGB",
            "set saturation=0 and hue=0 for non-RGB images",
        )
    scratch = np.empty_like(x[0])
    if params.saturation != 1.0:
        luma = _mix(x, _LUMA, scratch)
        x -= luma
        x *= np.float32(params.saturation)
        x += luma
        if bounded:
            np.clip(x, zero, one, out=x)
    if params.hue != 0.0:
        # Every output channel needs all three inputs: compute them all, then write back.
        turned = [_mix(x, row, scratch) for row in _hue_matrix(params.hue)]
        for c, channel in enumerate(turned):
            if bounded:
                np.clip(channel, zero, one, out=x[c])
            else:
                x[c] = channel
    return x
