"""Augmentation of a *whole* volume that every spatial rank applies to its own tile.

The slide rules (:mod:`hyfi_imaging.data.augment`) in three dimensions:

* **Parameters are global.** :func:`draw_volume_augment` draws them from
  ``Generator(PCG64(SeedSequence([seed, epoch, index])))``, so every rank and
  every DataLoader worker draws the same for the same sample without talking.
  All values are always drawn, in a fixed order (three flips, then a quarter
  turn count per plane ``zy, zx, yx``), so turning an option off does not
  shift the others.
* **Geometry is a signed permutation of the axes**
  (:class:`~hyfi_imaging.data.orientation.Orientation`, shared with slides):
  a rank's tile box in the augmented volume maps to one source box, which is
  read (:func:`~hyfi_imaging.io.volume_store.read_subvolume`) and oriented.
  So the rank's tile of the augmented volume equals the augmented volume's
  tile, bit for bit, while reading only the source voxels it shows.

The augmented volume is: flip z, y, x where drawn, then ``np.rot90`` by
``k`` in the planes ``zy``, ``zx``, ``yx`` in that order. Quarter turns are
allowed only in square planes: a turn in a ``d x h`` plane with ``d != h``
would swap the two lengths, so the tile grid (and the model's input shape)
would change from sample to sample; it is refused with one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hyfi_imaging.data.orientation import Orientation
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.geometry.tiles import BoxND
from hyfi_imaging.io.volume_store import VolumeStore, read_subvolume

__all__ = [
    "PLANES",
    "VolumeAugment",
    "VolumeAugmentParams",
    "augment_volume",
    "draw_volume_augment",
    "read_augmented_volume",
]

_AXES = "zyx"
#: The planes a quarter turn may act in, in the order they are applied.
PLANES = ("zy", "zx", "yx")


def _names(value: bool | Sequence[str], every: Sequence[str], what: str) -> tuple[str, ...]:
    if isinstance(value, bool):
        return tuple(every) if value else ()
    names = tuple(str(v) for v in value)
    bad = [v for v in names if v not in every]
    if bad:
        raise ConfigError(
            f"volume augment {what}={list(names)}",
            f"{', '.join(bad)} is not one of {', '.join(every)}",
            f"name {what} from {', '.join(every)} (or true for all)",
        )
    return tuple(v for v in every if v in names)


@dataclass(frozen=True)
class VolumeAugment:
    """Which flips and quarter turns to draw.

    Attributes:
        flip: the axes (``"z"``, ``"y"``, ``"x"``) flipped each with probability
            1/2, or true for all three.
        rot90: the planes (``"zy"``, ``"zx"``, ``"yx"``) turned ``k · 90°``
            (``k`` uniform in 0..3) each, or true for all three (a cube's 24 rotations).
    """

    flip: bool | tuple[str, ...] = False
    rot90: bool | tuple[str, ...] = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "flip", _names(self.flip, _AXES, "flip"))
        object.__setattr__(self, "rot90", _names(self.rot90, PLANES, "rot90"))

    def check(self, shape: Sequence[int], voxel: Sequence[float] | None = None) -> None:
        """ConfigError when a quarter-turn plane of a ``(d, h, w)`` volume is not square, in
        voxels or (``voxel``: µm per voxel, ``(z, y, x)``) in their sizes: turned, 2 x 0.5 µm
        voxels stretched an object 4x along one axis and shrank it 4x along the other."""
        for plane in _names(self.rot90, PLANES, "rot90"):
            a, b = (_AXES.index(c) for c in plane)
            if voxel is not None and abs(voxel[a] - voxel[b]) > 0.01 * min(voxel[a], voxel[b]):
                raise ConfigError(
                    f"volume augment rot90 in the {plane} plane",
                    f"the voxels are {voxel[a]:g} µm along {plane[0]} and {voxel[b]:g} µm along "
                    f"{plane[1]}: a quarter turn would stretch what it turns "
                    f"{max(voxel[a], voxel[b]) / min(voxel[a], voxel[b]):.3g}x",
                    "turn only in planes of square voxels (yx for most microscopes)",
                )
            if int(shape[a]) != int(shape[b]):
                raise ConfigError(
                    f"volume augment rot90 in the {plane} plane of a "
                    f"{'x'.join(str(int(n)) for n in shape)} volume",
                    f"a quarter turn would swap its {plane[0]} ({shape[a]}) and "
                    f"{plane[1]} ({shape[b]}) lengths, so shapes would vary per sample",
                    "turn only in square planes, or use cubes",
                )


@dataclass(frozen=True)
class VolumeAugmentParams:
    """One sample's drawn flips and turns; identical on every rank.

    Attributes:
        shape: ``(d, h, w)`` of the volume (the same after augmentation).
        flips: flip ``(z, y, x)`` first.
        turns: then ``np.rot90`` by ``k`` in the planes ``zy, zx, yx``.
    """

    shape: tuple[int, int, int]
    flips: tuple[bool, bool, bool] = (False, False, False)
    turns: tuple[int, int, int] = (0, 0, 0)

    @property
    def orientation(self) -> Orientation:
        """The flips and turns as a signed permutation of ``(z, y, x)``."""
        planes = [
            ((_AXES.index(p[0]), _AXES.index(p[1])), k)
            for p, k in zip(PLANES, self.turns, strict=True)
        ]
        return Orientation.of(3, flips=self.flips, turns=planes)


def draw_volume_augment(
    config: VolumeAugment, shape: Sequence[int], *, seed: int, epoch: int, index: int
) -> VolumeAugmentParams:
    """Draw one sample's :class:`VolumeAugmentParams`, the same on every rank and worker."""
    if min(seed, epoch, index) < 0:
        raise ConfigError(
            f"volume augment seed={seed} epoch={epoch} index={index}",
            "must be >= 0",
            "use non-negative integers",
        )
    s = (int(shape[0]), int(shape[1]), int(shape[2]))
    config.check(s)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, index])))
    flips = rng.random(3) < 0.5
    ks = rng.integers(0, 4, size=3)
    flip_axes, planes = _names(config.flip, _AXES, "flip"), _names(config.rot90, PLANES, "rot90")
    return VolumeAugmentParams(
        shape=s,
        flips=(
            bool(flips[0]) and "z" in flip_axes,
            bool(flips[1]) and "y" in flip_axes,
            bool(flips[2]) and "x" in flip_axes,
        ),
        turns=(
            int(ks[0]) if "zy" in planes else 0,
            int(ks[1]) if "zx" in planes else 0,
            int(ks[2]) if "yx" in planes else 0,
        ),
    )


def read_augmented_volume(
    store: VolumeStore,
    level: int,
    params: VolumeAugmentParams,
    box: Sequence[int] | BoxND,
    *,
    fill: float = 0,
) -> np.ndarray:
    """Read ``box = (z, y, x, d, h, w)`` of the augmented volume as ``(C, d, h, w)``.

    Equals ``augment_volume(whole)`` cut to the box (``fill`` outside the
    volume), while reading only the source chunks the box shows.
    """
    store.check_level(level)
    if store.shapes[level] != params.shape:
        raise ConfigError(
            f"{store.path} level {level}",
            f"the level is {store.shapes[level]} but the augmentation was drawn for {params.shape}",
            "draw it with draw_volume_augment(config, store.shapes[level], ...)",
        )
    b = box if isinstance(box, BoxND) else BoxND.of(box)
    orientation = params.orientation
    source = read_subvolume(store, level, orientation.source_box(b, params.shape), fill=fill)
    return orientation.apply(source)


def augment_volume(volume: np.ndarray, params: VolumeAugmentParams) -> np.ndarray:
    """The augmented whole ``(C, D, H, W)`` volume (the reference).

    Written with ``np.flip`` and ``np.rot90`` directly, not through
    :class:`~hyfi_imaging.data.orientation.Orientation`, so the tile path is
    tested against an independent computation.
    """
    if tuple(volume.shape[1:]) != params.shape:
        raise ValueError(f"volume {volume.shape} does not match params {params.shape}")
    out = volume
    for axis, flip in enumerate(params.flips):
        if flip:
            out = np.flip(out, 1 + axis)
    for plane, k in zip(PLANES, params.turns, strict=True):
        out = np.rot90(out, k, axes=(1 + _AXES.index(plane[0]), 1 + _AXES.index(plane[1])))
    return np.ascontiguousarray(out)
