"""A torch Dataset that gives one spatial rank its sub-volume (plus halo) of each sample.

The volume counterpart of :class:`hyfi_imaging.data.dataset.TileDataset`, with
the same reasons: every rank of a ``(gz, gy, gx)`` grid builds its own
dataset with its ``rank`` and reads only its tile plus halo
(:func:`~hyfi_imaging.geometry.tiles.tile_region_nd`: the one tiling rule)
through the augmentation's box map
(:func:`~hyfi_imaging.data.volume_augment.read_augmented_volume`), drawn
from ``(seed, epoch, index)`` so all ranks and workers agree without talking.

Everything that can be checked from the manifest (sizes, grid, halo, quarter
turns in non-square planes, target names) is checked at construction, before
any worker starts. Stores are opened lazily in the process that reads them and
dropped when the dataset is pickled (zarr runs an event-loop thread that must
not cross a fork; use ``multiprocessing_context="spawn"`` or ``"forkserver"``).

Targets: ``"regression"`` gives the manifest's ``target_*`` values as a
float32 vector; ``"labels"`` gives the rank's tile of the store's label image
(``labels`` column), augmented exactly like the image, as int64.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from hyfi_imaging.data.volume_augment import (
    VolumeAugment,
    VolumeAugmentParams,
    draw_volume_augment,
    read_augmented_volume,
)
from hyfi_imaging.data.volume_manifest import read_volume_manifest
from hyfi_imaging.errors import ConfigError, SlideError
from hyfi_imaging.geometry.tiles import HaloND, RegionND, tile_region_nd
from hyfi_imaging.io.pixels import dtype_range
from hyfi_imaging.io.volume_store import VolumeStore

__all__ = ["VolumeDataset", "VolumeSample"]

Target = Literal["regression", "labels"]
#: Per-channel normalisation: ``"store"`` (each store's channel mean and std) or ``(means, stds)``.
VolumeNormalize = Literal["store", "dtype"] | tuple[Sequence[float], Sequence[float]]


@dataclass(frozen=True)
class VolumeSample:
    """One usable manifest row: the store, its level-0 shape, targets, label image and voxel
    size (µm, ``(z, y, x)``)."""

    volume_id: str
    path: str
    shape: tuple[int, int, int]
    targets: tuple[float, ...]
    labels: str
    voxel_size: tuple[float, float, float] = (1.0, 1.0, 1.0)


def _level_shape(shape: tuple[int, int, int], level: int) -> tuple[int, int, int]:
    f = 2**level
    return (-(-shape[0] // f), -(-shape[1] // f), -(-shape[2] // f))


class VolumeDataset(Dataset[dict[str, Any]]):
    """Spatial rank ``rank``'s sub-volume plus halo of each (augmented) volume of a manifest.

    Args:
        manifest: a volume ``manifest.csv`` (:mod:`~hyfi_imaging.data.volume_manifest`)
            or its directory.
        grid: spatial grid ``(gz, gy, gx)``; rank: this rank's ``(i, j, k)``.
        halo: voxels read around the tile (see :func:`~hyfi_imaging.geometry.tiles.normalize_halo_nd`).
        align: the model's total stride; tile offsets are multiples of it.
        level: pyramid level to read.
        target: ``"regression"`` or ``"labels"`` (see the module docstring).
        targets: regression target names in order (default: all, sorted).
        augment: flips and quarter turns; ``None`` reads the volume unchanged.
        seed: augmentation seed, the same on every rank.
        normalize: ``None`` (voxels as float32), ``"dtype"`` (integer voxels over their
            type's maximum, as slides' default; floats as stored), ``"store"`` or
            ``(means, stds)``: ``(x - mean) / std`` per channel, one elementwise float32 step, so a
            tile's voxels equal the whole volume's. Voxels outside the volume
            (zero) are normalised like the rest; spatial layers mask the padding.
        max_open: stores kept open per process.
        truth: with ``target="labels"``, read each row's label image (every row must name
            one); False: predict volumes without them, ``target`` all zeros.

    Items are dicts: ``image`` float32 ``(C, d, h, w)``, ``target`` float32
    ``(T,)`` or int64 ``(d, h, w)``, ``index``, ``volume_id``, ``read`` int64
    ``(z, y, x, d, h, w)`` of the read box and ``inside`` int64: its part inside
    the volume, box-local.
    """

    def __init__(
        self,
        manifest: str | Path,
        *,
        grid: Sequence[int] = (1, 1, 1),
        rank: Sequence[int] = (0, 0, 0),
        halo: HaloND = 0,
        align: int = 1,
        level: int = 0,
        target: Target = "regression",
        targets: Sequence[str] | None = None,
        augment: VolumeAugment | None = None,
        seed: int = 0,
        normalize: VolumeNormalize | None = None,
        max_open: int = 16,
        truth: bool = True,
    ) -> None:
        where = f"VolumeDataset({manifest})"
        if level < 0 or seed < 0 or max_open < 1 or target not in ("regression", "labels"):
            raise ConfigError(
                where,
                f"level={level}, seed={seed}, max_open={max_open}, target={target!r}",
                "use level, seed >= 0, max_open >= 1 and target regression or labels",
            )
        path = Path(manifest)
        path = path / "manifest.csv" if path.is_dir() else path
        rows = [r for r in read_volume_manifest(path) if r.status == "ok"]
        if not rows:
            raise ConfigError(str(path), "lists no volume with status ok", "check its error column")
        names = tuple(targets) if targets is not None else tuple(sorted(rows[0].targets))
        self.samples: list[VolumeSample] = []
        for row in rows:
            missing = [n for n in names if n not in row.targets]
            if target == "regression" and (missing or not names):
                raise ConfigError(
                    f"{path} volume {row.volume_id}",
                    f"has no target {', '.join(missing) or '(none at all)'}",
                    "name targets the manifest has (target_<name> columns)",
                )
            if target == "labels" and truth and not row.labels:
                raise ConfigError(
                    f"{path} volume {row.volume_id}",
                    "names no label image",
                    "fill its labels column, or use target regression",
                )
            store = Path(row.path)
            store = store if store.is_absolute() else path.parent / store
            values = tuple(row.targets[n] for n in names) if target == "regression" else ()
            self.samples.append(
                VolumeSample(
                    row.volume_id, str(store), row.shape, values, row.labels, row.voxel_size
                )
            )
        self.target_names = names if target == "regression" else ()
        self.grid = tuple(int(g) for g in grid)
        self.rank = tuple(int(r) for r in rank)
        self.halo = halo
        self.align = int(align)
        self.level = int(level)
        self.target: Target = target
        self.truth = bool(truth)
        self.augment = augment if augment is not None else VolumeAugment()
        self.seed = int(seed)
        self.normalize = normalize
        if isinstance(normalize, tuple):
            means, stds = (np.asarray(v, np.float32) for v in normalize)
            if means.shape != stds.shape or means.ndim != 1 or not (stds > 0).all():
                raise ConfigError(
                    f"{where} normalize", "needs one mean and one std > 0 per channel", "fix them"
                )
        elif normalize not in (None, "store", "dtype"):
            raise ConfigError(
                f"{where} normalize={normalize!r}",
                "is not a mode",
                "use dtype, store or (means, stds)",
            )
        self.epoch = 0
        self._max_open = int(max_open)
        self._stores: OrderedDict[str, VolumeStore] = OrderedDict()
        shapes = {_level_shape(s.shape, self.level) for s in self.samples}
        if len(shapes) > 1 and any(g != 1 for g in self.grid):
            raise ConfigError(
                f"{where} grid {self.grid}",
                f"the volumes have {len(shapes)} sizes (e.g. {sorted(shapes)[:3]})",
                "tile volumes of one size",
            )
        for shape in shapes:
            tile_region_nd(shape, self.grid, self.rank, halo=halo, align=self.align)
        for s in self.samples:
            self.augment.check(_level_shape(s.shape, self.level), s.voxel_size)

    def __len__(self) -> int:
        return len(self.samples)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s augmentation draws from now on (call before iterating)."""
        if epoch < 0:
            raise ConfigError(
                f"set_epoch({epoch})", "the epoch must be >= 0", "count epochs from 0"
            )
        self.epoch = int(epoch)

    def shape(self, index: int) -> tuple[int, int, int]:
        """``(d, h, w)`` of sample ``index`` at the dataset's level."""
        return _level_shape(self.samples[index].shape, self.level)

    def params(self, index: int) -> VolumeAugmentParams:
        """The augmentation of sample ``index`` in the current epoch (no store is opened)."""
        return draw_volume_augment(
            self.augment, self.shape(index), seed=self.seed, epoch=self.epoch, index=index
        )

    def region(self, index: int) -> RegionND:
        """This rank's :class:`~hyfi_imaging.geometry.tiles.RegionND` of sample ``index``."""
        return tile_region_nd(
            self.shape(index), self.grid, self.rank, halo=self.halo, align=self.align
        )

    def _store(self, path: str, label: str | None = None) -> VolumeStore:
        key = path if label is None else f"{path}#{label}"
        store = self._stores.get(key)
        if store is None:
            store = VolumeStore(path, label=label)
            self._stores[key] = store
            while len(self._stores) > self._max_open:
                self._stores.popitem(last=False)
        self._stores.move_to_end(key)
        return store

    def _normalise(self, tile: np.ndarray, store: VolumeStore) -> np.ndarray:
        x = tile.astype(np.float32)
        if self.normalize is None:
            return x
        if self.normalize == "dtype":
            if tile.dtype.kind in "ui":  # one division, exactly as slides: x / 65535 for uint16
                x /= np.float32(dtype_range(tile.dtype)[1])
            return x
        if self.normalize == "store":
            stats = store.channel_stats
            if len(stats.get("mean", ())) != store.channels:
                raise SlideError(
                    store.path,
                    "holds no channel statistics",
                    "rewrite it with write_ome_zarr_volume",
                )
            means = np.asarray(stats["mean"], np.float32)
            stds = np.asarray(
                [s if s > 0 and math.isfinite(s) else 1.0 for s in stats["std"]], np.float32
            )
        else:
            means, stds = (np.asarray(v, np.float32) for v in self.normalize)
        if means.shape[0] != store.channels:
            raise ConfigError(
                f"{store.path} normalize",
                f"{means.shape[0]} means for {store.channels} channels",
                "give one mean and std per channel",
            )
        shape = (-1,) + (1,) * (x.ndim - 1)
        x -= means.reshape(shape)
        x /= stds.reshape(shape)
        return x

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self.samples):
            raise IndexError(f"index {index} out of range for {len(self.samples)} samples")
        sample = self.samples[index]
        params, region = self.params(index), self.region(index)
        store = self._store(sample.path)
        if store.shapes[0] != sample.shape:
            raise SlideError(
                sample.path,
                f"is {store.shapes[0]} but the manifest says {sample.shape}",
                "rewrite the manifest or the store",
            )
        image = self._normalise(
            read_augmented_volume(store, self.level, params, region.read), store
        )
        if self.target == "labels" and not self.truth:  # prediction of unlabelled volumes
            target = torch.zeros(image.shape[1:], dtype=torch.int64)
        elif self.target == "labels":
            labels = self._store(sample.path, sample.labels)
            tile = read_augmented_volume(labels, self.level, params, region.read)[0]
            target = torch.from_numpy(tile.astype(np.int64))
        else:
            target = torch.tensor(sample.targets, dtype=torch.float32)
        return {
            "image": torch.from_numpy(image),
            "target": target,
            "index": index,
            "volume_id": sample.volume_id,
            "read": torch.tensor(region.read.flat, dtype=torch.int64),
            "inside": torch.tensor(region.inside.flat, dtype=torch.int64),
        }

    def close(self) -> None:
        """Drop every store this process opened."""
        self._stores.clear()

    def __getstate__(self) -> dict[str, Any]:
        # Stores hold zarr handles (and an event loop behind them): never ship them to a worker.
        state = self.__dict__.copy()
        state["_stores"] = OrderedDict()
        return state

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
