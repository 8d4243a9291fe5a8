"""A torch Dataset that gives one spatial rank its tile (plus halo) of each sample.

Why per rank: an 8K-16K image never exists whole in one process. Every
spatial rank builds its own :class:`TileDataset` with its ``rank`` in the grid
and reads only the source pixels its tile plus halo shows — through the
augmentation's rectangle map (:mod:`hyfi_imaging.data.augment`), with
parameters drawn from ``(seed, epoch, index)`` so that all ranks (and all
DataLoader workers) augment the same sample identically without talking.
Stitching every rank's tile gives exactly the augmented whole image.

Why everything is known before a store is opened: the manifest written by
``hyfi-preprocess`` records each image's size, so the grid, the halo, the
output size and the label mapping are validated at construction — a
configuration error surfaces before any worker starts or any rank allocates.
Stores themselves are opened lazily, inside the process that reads them, and
dropped when the dataset is pickled: zarr 3 runs an event-loop thread, so a
reader must never cross a fork, and workers should be started with
``multiprocessing_context="spawn"`` or ``"forkserver"``.

The epoch lives in the dataset (:meth:`TileDataset.set_epoch`). DataLoader
pickles the dataset into its workers when an epoch's iterator is created, so
call ``set_epoch`` *before* iterating, and do not use ``persistent_workers``
(persistent workers keep the epoch they started with).
"""

from __future__ import annotations

import contextlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from hyfi_imaging.data.augment import (
    AugmentConfig,
    AugmentParams,
    apply_colour,
    draw_augment,
    output_size,
    read_augmented,
)
from hyfi_imaging.data.normalize import Normalization, Window
from hyfi_imaging.data.tiles import Halo, TileRegion, normalize_halo, tile_region
from hyfi_imaging.errors import ConfigError, SlideError
from hyfi_imaging.io.base import SlideReader
from hyfi_imaging.io.zarr_store import level_hw, read_store_pixels

if TYPE_CHECKING:
    from hyfi_imaging.preprocess.manifest import ManifestRow

__all__ = [
    "UNLABELLED",
    "Sample",
    "TileDataset",
    "left_out_line",
    "level_hw",
    "load_samples",
    "manifest_rows",
]

#: Label of a manifest row whose label is empty (an unlabelled slide).
UNLABELLED = -1


@dataclass(frozen=True)
class Sample:
    """One usable manifest row: where the store is and what it shows.

    Attributes:
        slide_id: the slide's id.
        path: absolute path of the OME-Zarr store.
        label: class index, or ``-1`` for an unlabelled slide.
        image_hw: ``(H, W)`` of the store at level 0.
    """

    slide_id: str
    path: str
    label: int
    image_hw: tuple[int, int]


def _label_of(text: str, classes: Sequence[str] | None, where: str) -> int:
    text = text.strip()
    if not text:
        return UNLABELLED
    if classes is not None:
        # Label files spell classes their own way ("Tumor", "tumor"): match case-insensitively.
        folded = [c.casefold() for c in classes]
        if text.casefold() not in folded:
            raise ConfigError(
                where,
                f"label {text!r} is not one of the classes {list(classes)}",
                "fix the label or the class list",
            )
        return folded.index(text.casefold())
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            where,
            f"label {text!r} is not an integer",
            "pass classes=[...] to map class names to indices",
        ) from None


def manifest_rows(manifest: str | Path) -> tuple[Path, list[ManifestRow]]:
    """The path and every row of a ``manifest.csv`` (or its directory), whatever their status.

    Raises:
        ConfigError: missing, unreadable or foreign manifest, or a slide id that
            is not a plain name (:func:`~hyfi_imaging.paths.safe_id`).
    """
    # Imported here: the preprocess package pulls in image libraries a worker never needs.
    from hyfi_imaging.preprocess.manifest import read_manifest

    path = Path(manifest)
    if path.is_dir():
        path = path / "manifest.csv"
    try:
        rows = read_manifest(path)
    except ConfigError:  # a row's own one-line error (an unsafe slide id), already precise
        raise
    except OSError as err:
        raise ConfigError(
            str(path), f"cannot read the manifest ({err})", "run hyfi-preprocess first"
        ) from err
    except (KeyError, ValueError, TypeError) as err:
        raise ConfigError(
            str(path),
            f"not a hyfi-preprocess manifest ({type(err).__name__}: {err})",
            "rewrite it with hyfi-preprocess",
        ) from err
    seen = Counter(r.slide_id for r in rows)
    twice = next((sid for sid, n in seen.items() if n > 1), None)
    if twice is not None:  # a slide trained on (or predicted) twice, its outputs overwritten
        raise ConfigError(
            str(path),
            f"slide id {twice!r} is on {seen[twice]} rows",
            "keep one row per slide (hyfi-preprocess writes one)",
        )
    return path, rows


def left_out_line(manifest: str | Path) -> str | None:
    """One line saying how many slides :func:`load_samples` (or volumes) leaves out and why;
    None if none.

    Why: a slide that failed preprocessing is still a row of the manifest, and
    a cohort that silently shrinks changes what a metric means. E.g.
    ``"3 of 40 slides left out: status failed (see data/manifest.csv)"``; with
    several statuses ``"... left out: 2 status failed, 1 status pending (...)"``.
    """
    from hyfi_imaging.data.volume_manifest import manifest_kind, read_volume_manifest

    kind = manifest_kind(manifest)
    if kind == "volumes":  # said for volumes too: they were dropped without a word
        path = Path(manifest)
        path = path / "manifest.csv" if path.is_dir() else path
        all_status = [r.status for r in read_volume_manifest(path)]
    else:
        path, rows = manifest_rows(manifest)
        all_status = [r.status for r in rows]
    statuses = Counter(s or "(empty)" for s in all_status if s != "ok")
    n = sum(statuses.values())
    if not n:
        return None
    if len(statuses) == 1:
        why = f"status {next(iter(statuses))}"
    else:
        why = ", ".join(f"{k} status {s}" for s, k in sorted(statuses.items()))
    return f"{n} of {len(all_status)} {kind} left out: {why} (see {path})"


def load_samples(
    manifest: str | Path, *, classes: Sequence[str] | None = None, labels: bool = True
) -> list[Sample]:
    """The usable rows (``status == "ok"``) of a ``manifest.csv`` (or its directory).

    Store paths are resolved relative to the manifest's directory. Labels are
    mapped through ``classes`` when given, else read as integers; with
    ``labels=False`` they are not read at all (every sample is ``UNLABELLED``:
    a segmentation's targets are its label images). The rows left
    out are counted by :func:`left_out_line`.

    Raises:
        ConfigError: missing or unreadable manifest, missing columns, bad
            sizes or labels, or no usable row at all.
    """
    path, rows = manifest_rows(manifest)
    samples = []
    for row in rows:
        if row.status != "ok":
            continue
        where = f"{path}:{row.line}"  # the file's line (blank lines counted)
        if min(row.height, row.width) < 1 or not row.path:
            raise ConfigError(
                where, f"row {row.slide_id!r} has no store or no size", "rerun hyfi-preprocess"
            )
        store = Path(row.path)
        store = store if store.is_absolute() else path.parent / store
        samples.append(
            Sample(
                row.slide_id,
                str(store),
                _label_of(row.label, classes, where) if labels else UNLABELLED,
                (row.height, row.width),
            )
        )
    if not samples:
        raise ConfigError(
            str(path), "the manifest lists no slide with status ok", "check its error column"
        )
    return samples


def _open_slide(path: str) -> SlideReader:
    from hyfi_imaging.io.detect import open_slide

    return open_slide(path)


class TileDataset(Dataset[dict[str, Any]]):
    """Spatial rank ``rank``'s tile plus halo of each (augmented) image of a manifest.

    Args:
        manifest: ``manifest.csv`` written by ``hyfi-preprocess``, or its directory.
        grid: spatial grid ``(gy, gx)``.
        rank: this rank's ``(i, j)`` in the grid.
        halo: pixels read around the tile (see :func:`~hyfi_imaging.data.tiles.normalize_halo`).
        align: the model's total stride; tile offsets are multiples of it.
        augment: the augmentation; ``None`` reads the stored image unchanged.
        seed: augmentation seed, the same on every rank.
        level: pyramid level to read (level ``l`` of a hyfi store is ``ceil(H / 2**l)``).
        classes: class names, mapped to their index; else labels are integers.
        labels: read the manifest's labels (False: every ``label`` is -1; a
            segmentation's targets are its label images).
        fill: stored value of pixels outside the image (halo past the border,
            padding); default: each store's background (white for RGB, 0 else).
        normalize: how stored pixels become ``[0, 1]`` floats
            (:class:`~hyfi_imaging.data.normalize.Normalization`; default:
            divide by the pixel type's maximum, ``x / 255`` for 8-bit images).
        opener: ``path -> SlideReader``; a module-level function (workers
            unpickle it). Default: :func:`hyfi_imaging.io.open_slide`.
        max_open: readers kept open per process (least recently used are closed).

    Items are dicts: ``image`` float32 ``(C, h, w)``, normalised (in ``[0, 1]``
    unless a float image is taken as it is) and augmented (tile plus halo),
    ``label`` int64, ``index`` int, ``slide_id`` str,
    ``read`` int64 ``(y, x, h, w)`` of the read box in output-image pixels,
    ``inside`` int64 ``(y, x, h, w)``: the part of the box within the output
    image, in box-local pixels (the rest is ``fill``, and global padding).

    With a grid larger than 1x1 all output images must have one size (set
    ``augment.out_size`` or give images of one size); else :class:`ConfigError`.
    Every store must have the channels and pixel type of the first sample's
    store; another is refused with :class:`SlideError` when it is opened.
    """

    def __init__(
        self,
        manifest: str | Path,
        *,
        grid: tuple[int, int] = (1, 1),
        rank: tuple[int, int] = (0, 0),
        halo: Halo = 0,
        align: int = 1,
        augment: AugmentConfig | None = None,
        seed: int = 0,
        level: int = 0,
        classes: Sequence[str] | None = None,
        labels: bool = True,
        fill: float | None = None,
        normalize: Normalization | None = None,
        opener: Callable[[str], SlideReader] | None = None,
        max_open: int = 16,
    ) -> None:
        if level < 0 or seed < 0 or max_open < 1:
            raise ConfigError(
                f"TileDataset(level={level}, seed={seed}, max_open={max_open})",
                "level and seed must be >= 0, max_open >= 1",
                "fix the argument",
            )
        self.samples = load_samples(manifest, classes=classes, labels=labels)
        self.grid = (int(grid[0]), int(grid[1]))
        self.rank = (int(rank[0]), int(rank[1]))
        self.halo = normalize_halo(halo)
        self.align = int(align)
        self.augment = augment if augment is not None else AugmentConfig()
        self.seed = int(seed)
        self.level = int(level)
        self.fill = fill
        self.normalize = normalize if normalize is not None else Normalization()
        # What every store must hold: the first store's channels and type (None: not a hyfi store).
        self.pixels = read_store_pixels(self.samples[0].path)
        if self.pixels is not None:
            self.normalize.check(self.pixels.channels, str(manifest))
        self._windows: dict[str, Window] = {}
        self.epoch = 0
        self._opener = opener if opener is not None else _open_slide
        self._max_open = int(max_open)
        self._readers: OrderedDict[str, SlideReader] = OrderedDict()
        self._region = self._fixed_region()
        if self._region is None:
            self.region(0)  # validates rank and align before any worker starts

    def _level_hw(self, sample: Sample) -> tuple[int, int]:
        return level_hw(sample.image_hw, self.level)

    def _fixed_region(self) -> TileRegion | None:
        """The one tile region all samples share, or ``None`` (1x1 grid, sizes vary)."""
        sizes: set[tuple[int, int]] = set()
        for sample in self.samples:
            try:
                sizes.add(output_size(self.augment, self._level_hw(sample)))
            except ConfigError:
                if self.grid != (1, 1):
                    raise
                return None
        if len(sizes) > 1:
            if self.grid != (1, 1):
                raise ConfigError(
                    f"TileDataset grid {self.grid}",
                    f"the images have {len(sizes)} output sizes (e.g. {sorted(sizes)[:3]})",
                    "set augment=AugmentConfig(out_size=(h, w)) or preprocess to one size",
                )
            return None
        (out_hw,) = sizes
        return tile_region(out_hw, self.grid, self.rank, halo=self.halo, align=self.align)

    def __len__(self) -> int:
        return len(self.samples)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s augmentation draws from now on (call before iterating)."""
        if epoch < 0:
            raise ConfigError(
                f"set_epoch({epoch})", "the epoch must be >= 0", "count epochs from 0"
            )
        self.epoch = int(epoch)

    def params(self, index: int) -> AugmentParams:
        """The augmentation of sample ``index`` in the current epoch (no store is opened)."""
        sample = self.samples[index]
        return draw_augment(
            self.augment, self._level_hw(sample), seed=self.seed, epoch=self.epoch, index=index
        )

    def region(self, index: int) -> TileRegion:
        """This rank's :class:`TileRegion` of sample ``index``, in output-image pixels."""
        if self._region is not None:
            return self._region
        return tile_region(
            self.params(index).out_hw, self.grid, self.rank, halo=self.halo, align=self.align
        )

    def _reader(self, sample: Sample) -> SlideReader:
        reader = self._readers.get(sample.path)
        if reader is not None:
            self._readers.move_to_end(sample.path)
            return reader
        reader = self._opener(sample.path)
        expected = self._level_hw(sample)
        dims = (
            tuple(int(v) for v in reader.level_dimensions[self.level])
            if self.level < reader.level_count
            else None
        )
        if dims is None:
            count = reader.level_count
            reader.close()
            raise SlideError(
                sample.path,
                f"has no pyramid level {self.level} (levels 0-{count - 1}): data.level asks for it",
                f"choose data.level {count - 1} or lower, or leave this slide out",
            )
        if dims != expected:
            reader.close()
            raise SlideError(
                sample.path,
                f"level {self.level} is {dims} but the manifest says {expected[0]}x{expected[1]}",
                "rerun hyfi-preprocess for this slide",
            )
        want = self.pixels
        if want is not None and (reader.channels, str(reader.dtype)) != (want.channels, want.dtype):
            reader.close()
            raise SlideError(
                sample.path,
                f"holds {reader.channels} {reader.dtype} channels but the first image of the "
                f"manifest ({self.samples[0].slide_id}) holds {want.channels} {want.dtype}",
                "train on images of one kind: preprocess them alike, or split the manifest",
            )
        self._windows[sample.path] = self.normalize.window(
            reader.dtype, reader.channels, getattr(reader, "channel_stats", None), sample.path
        )
        self._readers[sample.path] = reader
        while len(self._readers) > self._max_open:
            _, old = self._readers.popitem(last=False)
            old.close()
        return reader

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self.samples):
            raise IndexError(f"index {index} out of range for {len(self.samples)} samples")
        sample = self.samples[index]
        params = self.params(index)
        region = self.region(index)
        tile = read_augmented(
            self._reader(sample), params, region.read, level=self.level, fill=self.fill
        )
        window = self._windows[sample.path]
        return {
            "image": torch.from_numpy(apply_colour(tile, params, window=window)),
            "label": torch.tensor(sample.label, dtype=torch.int64),
            "index": index,
            "slide_id": sample.slide_id,
            "read": torch.tensor(region.read, dtype=torch.int64),
            "inside": torch.tensor(region.inside, dtype=torch.int64),
        }

    def close(self) -> None:
        """Close every reader this process opened."""
        while self._readers:
            _, reader = self._readers.popitem()
            reader.close()

    def __getstate__(self) -> dict[str, Any]:
        # Readers hold zarr handles (and an event loop behind them): never ship them to a worker.
        state = self.__dict__.copy()
        state["_readers"] = OrderedDict()
        return state

    def __del__(self) -> None:
        # Best effort: interpreter shutdown may already have torn the readers down.
        with contextlib.suppress(Exception):
            self.close()
