"""OME-Zarr (NGFF 0.5, zarr v3) writer and reader: the training store.

Why this layout: training reads one tile plus halo per spatial rank, many times
per epoch, so the store is cut for that access pattern. Inner chunks of 512²
are the unit of decoding (small enough that a halo costs little, large enough
that per-chunk overhead stays low); shards of 4096² (a multiple of the tile
grid) keep the file count of a 16K image in the tens instead of thousands.
Each shard is written in one piece: a sharded array rewritten piecemeal would
re-encode the whole shard for every partial write, and concurrent writers of
one shard would lose data.

Why the writer takes a :class:`RegionSource` and not only an array: a 65536²
RGB canvas is 12.9 GB, and a worker that holds it (plus its pyramid) runs a
machine out of memory. Level 0 is therefore asked for one shard at a time,
and each coarser level is built from the level below it, read back from the
store one shard-sized piece at a time, so memory is bounded by a few shards
whatever the image size. Pieces are cut at even offsets, so the 2x2
averaging of a piece equals that of the whole level (an odd last row or
column is only ever at the true image edge).

Pixels are stored as they came (:mod:`hyfi_imaging.io.pixels`): uint8,
uint16 or float32, any number of channels. Each level is the 2x2 area mean of
the one below, exact for the type: integer means rounded half up, float32
means of the four values. A shard holds all channels, so with more bytes per
pixel than 8-bit RGB its side shrinks (in whole chunks) until it holds no
more bytes than an 8-bit RGB shard of the requested side: memory stays a few
such shards whatever the channel count.

The group follows NGFF 0.5: ``attributes.ome`` holds ``version``,
``multiscales`` (axes ``c, y, x``, one scale transform per level in
micrometres) and ``omero`` (one entry per channel: ``label``, ``color`` and the
display ``window``: the type's range for RGB, else the 0.5-99.5th
percentiles), and every level array carries ``dimension_names`` matching the
axes. hyfi-specific provenance (source slide, source mpp, crop box, ...) lives
beside it under ``attributes.hyfi``, and per-channel statistics (percentiles,
mean, standard deviation of the coarsest level, optionally within a box)
under ``attributes.hyfi_stats`` (:mod:`hyfi_imaging.io.channels`): the loader
normalises with them (:mod:`hyfi_imaging.data.normalize`) without reading any pixels. Group
attributes are written last, so a group whose attributes exist was written
completely. They also hold the group's chunk inventory (``attributes.hyfi_inventory``,
:mod:`hyfi_imaging.io.inventory`): the shard files each level really has on
disk, with their checksums, so that a shard deleted later is refused by the
reader instead of reading as blank background.

zarr 3 runs an asyncio event-loop thread once it is first used; nothing here
touches zarr at import time, so importing the module is safe before fork.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from hyfi_imaging.errors import SlideError
from hyfi_imaging.io.base import read_filled
from hyfi_imaging.io.channels import channel_stats, omero_metadata, parse_omero
from hyfi_imaging.io.inventory import (
    INVENTORY_ATTR,
    ChunkGuard,
    file_size,
    parse_inventory,
    store_size,
    take_inventory,
)
from hyfi_imaging.io.openslide_reader import square_mpp
from hyfi_imaging.io.pixels import (
    default_background,
    default_channels,
    is_rgb,
    rgb_equivalent_side,
    supported_dtype,
)

__all__ = [
    "NGFF_VERSION",
    "RegionSource",
    "StorePixels",
    "ZarrReader",
    "downsample_2x",
    "level_hw",
    "level_shapes",
    "multiscales_metadata",
    "store_levels",
    "read_hyfi_attrs",
    "read_store_pixels",
    "shard_side",
    "write_ome_zarr",
    "write_pyramid",
]

NGFF_VERSION = "0.5"
_ZSTD_LEVEL = 3


def downsample_2x(image: np.ndarray) -> np.ndarray:
    """Halve a ``(C, H, W)`` image by 2x2 area averaging, exact for its type.

    uint8 and uint16: the integer mean of the four pixels, rounded half up;
    float32: the mean of the four values (summed in float64, then rounded to
    float32). An odd last row or column is averaged over the pixels that
    exist (edge replication), so level ``l`` pixel ``i`` always covers
    level-0 pixels ``[i·2^l, (i+1)·2^l)`` and the scale transform stays
    exactly ``2^l``.
    """
    h, w = image.shape[1:]
    if h % 2 or w % 2:
        image = np.pad(image, ((0, 0), (0, h % 2), (0, w % 2)), mode="edge")
    if image.dtype.kind == "f":
        acc = image[:, 0::2, 0::2].astype(np.float64)
        acc += image[:, 1::2, 0::2]
        acc += image[:, 0::2, 1::2]
        acc += image[:, 1::2, 1::2]
        return (acc * 0.25).astype(image.dtype)
    wide = np.uint16 if image.dtype == np.uint8 else np.uint32
    iacc: np.ndarray[Any, np.dtype[np.unsignedinteger[Any]]] = image[:, 0::2, 0::2].astype(wide)
    iacc += image[:, 1::2, 0::2]
    iacc += image[:, 0::2, 1::2]
    iacc += image[:, 1::2, 1::2]
    iacc += 2  # round half up
    return (iacc >> 2).astype(image.dtype)


def shard_side(shard: int, chunk: int, channels: int, itemsize: int) -> int:
    """The shard side written for ``channels`` of ``itemsize`` bytes when ``shard`` was asked.

    A shard holds every channel, so its side shrinks (in whole chunks, never
    below one) until it holds no more bytes than an 8-bit RGB shard of side
    ``shard``; 8-bit RGB and smaller pixels keep ``shard``.
    """
    if channels * itemsize <= 3:
        return shard
    return max(chunk, math.floor(rgb_equivalent_side(shard, channels, itemsize) / chunk) * chunk)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@runtime_checkable
class RegionSource(Protocol):
    """An image too large to hold, produced one region at a time.

    ``shape`` is ``(C, H, W)``; ``read(y0, x0, y1, x1)`` returns the
    ``(C, y1 - y0, x1 - x0)`` pixels of that region (inside the image). A
    source may say its pixel type in a ``dtype`` attribute; without one it is uint8.
    """

    @property
    def shape(self) -> tuple[int, int, int]: ...

    def read(self, y0: int, x0: int, y1: int, x1: int) -> np.ndarray: ...


class _ArraySource:
    """An in-memory ``(C, H, W)`` array served as a :class:`RegionSource`."""

    def __init__(self, image: np.ndarray) -> None:
        self.image = image
        self.dtype = image.dtype

    @property
    def shape(self) -> tuple[int, int, int]:
        c, h, w = self.image.shape
        return int(c), int(h), int(w)

    def read(self, y0: int, x0: int, y1: int, x1: int) -> np.ndarray:
        return self.image[:, y0:y1, x0:x1]


def level_hw(image_hw: tuple[int, int], level: int) -> tuple[int, int]:
    """``(h, w)`` of level ``level`` of a store of ``image_hw``: ``ceil(H / 2**l) x ceil(W / 2**l)``.

    Pixel ``i`` of that level covers level-0 pixels ``[i·2**l, (i+1)·2**l)``
    (:func:`downsample_2x`); the scale transform is exactly ``2**l``.
    """
    f = 2**level
    return -(-int(image_hw[0]) // f), -(-int(image_hw[1]) // f)


def level_shapes(h: int, w: int, *, chunk: int, pyramid_levels: int) -> list[tuple[int, int]]:
    """``(h, w)`` of every level :func:`write_ome_zarr` writes for an ``h x w`` image.

    Level ``l`` is :func:`level_hw`; a level whose shorter side would fall
    below ``chunk / 2`` is not written (level 0 always is).
    """
    shapes = [(h, w)]
    while len(shapes) < pyramid_levels:
        nh, nw = level_hw((h, w), len(shapes))
        if min(nh, nw) < chunk / 2:
            break
        shapes.append((nh, nw))
    return shapes


def _downsampled_block(
    finer: Any,
    y0: int,
    x0: int,
    y1: int,
    x1: int,
    piece: int,
    downsample: Callable[[np.ndarray], np.ndarray] = downsample_2x,
) -> np.ndarray:
    """Rows ``[y0, y1)`` x columns ``[x0, x1)`` of the level below ``finer``, by ``downsample``.

    ``finer`` is read ``2 * piece`` pixels square at a time (even offsets, so
    each piece averages exactly the pixels the whole level would).
    """
    fh, fw = finer.shape[1:]
    out = np.empty((finer.shape[0], y1 - y0, x1 - x0), dtype=finer.dtype)
    for py in range(y0, y1, piece):
        for px in range(x0, x1, piece):
            qy, qx = min(py + piece, y1), min(px + piece, x1)
            block = np.asarray(finer[:, 2 * py : min(2 * qy, fh), 2 * px : min(2 * qx, fw)])
            out[:, py - y0 : qy - y0, px - x0 : qx - x0] = downsample(block)
    return out


def _shard_blocks(h: int, w: int, sh: int, sw: int) -> Iterator[tuple[int, int, int, int]]:
    for y0 in range(0, h, sh):
        for x0 in range(0, w, sw):
            yield y0, x0, min(y0 + sh, h), min(x0 + sw, w)


def multiscales_metadata(
    name: str,
    mpp: float | None,
    n_levels: int,
    dtype: np.dtype[Any],
    *,
    method: str = "mean",
    description: str | None = None,
    spacing: tuple[float, float] | None = None,
    origin: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """The NGFF ``multiscales`` entry of a ``c, y, x`` pyramid of ``n_levels`` 2x levels.

    ``method`` and ``description`` document the downsampling (NGFF asks for
    it): the 2x2 mean for images, the 2x2 mode for label images. ``spacing``:
    a level-0 pixel's ``(y, x)`` size in the axes' unit (default ``mpp`` on
    both); ``origin``: where level-0 pixel ``(0, 0)`` lies (a ``translation``;
    default the frame's origin). Both serve an image placed on another's frame (a heat
    map on its slide: :mod:`hyfi_imaging.train.heatmaps`). A level-l pixel is the centre
    of its 2**l x 2**l level-0 pixels: every level past 0 carries that ``translation``
    (without it, a viewer drew level l (2**l - 1) / 2 level-0 pixels up and left).
    """
    # Unknown resolution: pixel units (no "unit"), scale 1 per level-0 pixel.
    unit = {"unit": "micrometer"} if mpp is not None else {}
    step = 1.0 if mpp is None else mpp
    dy, dx = spacing if spacing is not None else (step, step)

    def transforms(level: int) -> list[dict[str, Any]]:
        f = 2**level
        out: list[dict[str, Any]] = [{"type": "scale", "scale": [1.0, dy * f, dx * f]}]
        if origin is not None or level > 0:  # a level-l pixel's centre: 2**l pixels' centre
            oy, ox = origin if origin is not None else (0.0, 0.0)
            shift = (f - 1) / 2
            out.append(
                {"type": "translation", "translation": [0.0, oy + dy * shift, ox + dx * shift]}
            )
        return out

    if description is None:
        description = f"2x2 area averaging per level, {dtype} " + (
            "rounded half up" if dtype.kind in "ui" else "mean"
        )
    return {
        "name": name,
        "axes": [
            {"name": "c", "type": "channel"},
            {"name": "y", "type": "space", **unit},
            {"name": "x", "type": "space", **unit},
        ],
        "datasets": [
            {"path": str(level), "coordinateTransformations": transforms(level)}
            for level in range(n_levels)
        ],
        # NGFF asks that the downsampling method be documented.
        "type": method,
        "metadata": {"description": description},
    }


def write_pyramid(
    group: Any,
    source: RegionSource,
    *,
    dtype: np.dtype[Any],
    chunk: int,
    shard: int,
    pyramid_levels: int,
    fill_value: float,
    downsample: Callable[[np.ndarray], np.ndarray] = downsample_2x,
) -> tuple[Any, int]:
    """Write ``source`` as arrays ``"0"``, ``"1"``, ... of the zarr ``group``, shard by shard.

    Level 0 is asked of ``source`` one shard at a time; each coarser level is
    ``downsample`` (a 2x reduction of a ``(C, h, w)`` block: the 2x2 mean for
    images, :func:`~hyfi_imaging.io.labels.downsample_labels_2x` for label
    images) of the level below, read back in even-aligned pieces. Shared by
    :func:`write_ome_zarr` and the label writer, so both pyramids have the same
    levels, chunks and shards. Returns the coarsest array and the level count.
    """
    from zarr.codecs import ZstdCodec

    c, h0, w0 = source.shape
    shapes = level_shapes(h0, w0, chunk=chunk, pyramid_levels=pyramid_levels)
    side = shard_side(shard, chunk, c, dtype.itemsize)
    finer: Any = None
    for level, (h, w) in enumerate(shapes):
        sh = min(side, _round_up(h, chunk))
        sw = min(side, _round_up(w, chunk))
        arr = group.create_array(
            str(level),
            shape=(c, h, w),
            dtype=dtype,
            chunks=(c, chunk, chunk),
            shards=(c, sh, sw),
            compressors=ZstdCodec(level=_ZSTD_LEVEL),
            fill_value=fill_value,
            dimension_names=("c", "y", "x"),
        )
        for y0, x0, y1, x1 in _shard_blocks(h, w, sh, sw):
            if finer is None:
                block = source.read(y0, x0, y1, x1)
                if block.shape != (c, y1 - y0, x1 - x0) or block.dtype != dtype:
                    raise ValueError(
                        f"region source returned {block.dtype} {block.shape} for "
                        f"y={y0}:{y1} x={x0}:{x1}, expected {dtype} {(c, y1 - y0, x1 - x0)}"
                    )
            else:
                block = _downsampled_block(finer, y0, x0, y1, x1, max(chunk, side // 2), downsample)
            arr[:, y0:y1, x0:x1] = block
            del block
        finer = arr
    return finer, len(shapes)


def write_ome_zarr(
    path: str | os.PathLike[str],
    image: np.ndarray | RegionSource,
    *,
    mpp: float | None,
    hyfi_attrs: dict[str, Any],
    chunk: int = 512,
    shard: int = 4096,
    pyramid_levels: int = 3,
    name: str = "",
    channel_names: Sequence[str] | None = None,
    channel_colors: Sequence[str] | None = None,
    stats_box: tuple[int, int, int, int] | None = None,
    spacing: tuple[float, float] | None = None,
    origin: tuple[float, float] | None = None,
) -> None:
    """Write a ``(C, H, W)`` image (uint8, uint16 or float32) as an OME-Zarr 0.5 multiscale group.

    Args:
        path: the group to create; must not exist (write to a temporary path
            and rename it for atomicity).
        image: ``(C, H, W)`` level-0 pixels, or a :class:`RegionSource`
            that produces them one shard at a time (memory then stays at a
            few shards, however large the image).
        mpp: microns per level-0 pixel, or None when unknown (axes then carry no unit).
        hyfi_attrs: JSON-able provenance stored as ``attributes["hyfi"]``; its
            ``background`` (default: white for RGB, else 0) is the fill value.
        chunk: inner chunk side (the unit of decoding).
        shard: shard side, a multiple of ``chunk``; clamped to the image
            rounded up to whole chunks, so small images get one shard, and
            narrowed for pixels of more than 3 bytes (:func:`shard_side`).
        pyramid_levels: at most this many levels; level ``l`` is downsampled
            ``2**l``. Levels whose shorter side would fall below ``chunk / 2``
            are not written (level 0 always is; see :func:`level_shapes`).
        name: the multiscale's ``name``.
        channel_names, channel_colors: one label and ``RRGGBB`` colour per
            channel for ``omero`` (default: RGB's for 3 uint8 channels, else
            ``c0, c1, ...`` and a palette).
        stats_box: ``(y, x, h, w)`` in level-0 pixels that the channel
            statistics (``attributes.hyfi_stats``) and display windows are
            taken from (default: the whole image; a preprocessed canvas
            passes its tissue placement, so the padding does not count).
        spacing, origin: a level-0 pixel's ``(y, x)`` size and the position of
            pixel ``(0, 0)`` in the axes' unit, for an image on another
            image's frame (see :func:`multiscales_metadata`).

    Raises:
        SlideError: ``path`` exists.
        ValueError: bad arguments (programming errors).
    """
    import zarr

    if isinstance(image, np.ndarray):
        if image.ndim != 3 or supported_dtype(image.dtype) is None:
            raise ValueError(
                "write_ome_zarr needs a uint8, uint16 or float32 (C, H, W) array, "
                f"got {image.dtype} {image.shape}"
            )
        source: RegionSource = _ArraySource(image)
    else:
        source = image
    dtype = supported_dtype(getattr(source, "dtype", np.uint8))
    if dtype is None:
        raise ValueError(f"region source of pixel type {getattr(source, 'dtype', None)}")
    if chunk <= 0 or shard <= 0 or shard % chunk:
        raise ValueError(f"shard ({shard}) must be a positive multiple of chunk ({chunk})")
    if mpp is not None and not mpp > 0:
        raise ValueError(f"mpp must be positive or None, got {mpp}")
    if pyramid_levels < 1:
        raise ValueError(f"pyramid_levels must be >= 1, got {pyramid_levels}")
    c = source.shape[0]
    names, colors = default_channels(c, rgb=c == 3 and dtype == np.uint8)
    names = tuple(channel_names) if channel_names is not None else names
    colors = tuple(channel_colors) if channel_colors is not None else colors
    if len(names) != c or len(colors) != c:
        raise ValueError(f"{len(names)} names and {len(colors)} colours for {c} channels")
    background = hyfi_attrs.get("background", default_background(dtype, rgb=is_rgb(names)))
    json.dumps(hyfi_attrs)  # fail before writing anything if not JSON-able
    out = Path(path)
    if out.exists():
        raise SlideError(
            str(out), "output store already exists", "remove it or choose another output path"
        )

    group = zarr.open_group(zarr.storage.LocalStore(out), mode="w-", zarr_format=3)
    finer, n_levels = write_pyramid(
        group,
        source,
        dtype=dtype,
        chunk=chunk,
        shard=shard,
        pyramid_levels=pyramid_levels,
        fill_value=background,
    )
    stats = channel_stats(finer, stats_box, n_levels - 1)
    # Written last: attributes mark a complete store, and list what it holds.
    group.attrs.update(
        {
            "ome": {
                "version": NGFF_VERSION,
                "multiscales": [
                    multiscales_metadata(name, mpp, n_levels, dtype, spacing=spacing, origin=origin)
                ],
                "omero": omero_metadata(names, colors, dtype, stats),
            },
            "hyfi": hyfi_attrs,
            "hyfi_stats": stats,
            INVENTORY_ATTR: take_inventory(out, [str(level) for level in range(n_levels)]),
        }
    )


def store_levels(path: str | os.PathLike[str]) -> int | None:
    """How many pyramid levels an OME-Zarr image store lists (its metadata alone), or None
    where it lists none readable."""
    attrs = _open_group_attrs(path)
    if attrs is None:
        return None
    try:
        return len(attrs.get("ome", attrs)["multiscales"][0]["datasets"])
    except (KeyError, IndexError, TypeError, AttributeError):
        return None


def _open_group_attrs(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Group attributes straight from ``zarr.json`` (or v2 ``.zattrs``), or None."""
    p = Path(path)
    try:
        meta = json.loads((p / "zarr.json").read_text())
        if meta.get("node_type") != "group":
            return None
        attrs = meta.get("attributes", {})
    except (OSError, ValueError, AttributeError):
        try:
            if not (p / ".zgroup").is_file():
                return None
            attrs = json.loads((p / ".zattrs").read_text())
        except (OSError, ValueError):
            return None
    return attrs if isinstance(attrs, dict) else None


def read_hyfi_attrs(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``hyfi`` attributes of a finished store, or ``None``.

    Never raises: a missing path, a file, garbage JSON or a group without
    ``hyfi`` attributes (e.g. an interrupted write) all give ``None``.
    """
    attrs = _open_group_attrs(path)
    if attrs is None:
        return None
    hyfi = attrs.get("hyfi")
    return hyfi if isinstance(hyfi, dict) else None


class ZarrReader:
    """Reads an OME-Zarr multiscale image (ours, or any NGFF 0.4/0.5 ``c, y, x`` image).

    ``read_region`` slices the zarr array, so only the inner chunks that the
    region touches are fetched and decoded. Opening reads only the group and
    array metadata.

    A store with a chunk inventory (:mod:`hyfi_imaging.io.inventory`, written by
    :func:`write_ome_zarr` and the label writer) is guarded: a region whose
    shard the inventory lists but the store lacks raises :class:`SlideError`
    naming the store, level and key, instead of reading as background. Each
    shard is stat-ed once per reader. Stores without an inventory (written
    before it existed, or by other tools) read as before, unchecked.

    Args:
        path: the group directory.
        mpp_override: microns per level-0 pixel that win over the scale metadata.
        store: read through this zarr store instead of ``path`` (a remote
            store, or a wrapper that counts accesses).
        memory_budget: bytes one read may take, region and chunks decoded at once
            (:func:`~hyfi_imaging.io.budget.check_read`); None: not costed (the training
            loader's reads of hyfi's own stores). ``hyfi-preprocess`` gives its budget: a
            store is an input like a TIFF, and one chunk of 24000² px decodes 1.7 GB for
            any read that touches it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mpp_override: float | None = None,
        store: Any = None,
        memory_budget: int | None = None,
    ) -> None:
        import zarr

        self.path = str(path)
        self.format = "ome-zarr"
        self.memory_budget = memory_budget
        try:
            group = zarr.open_group(
                store if store is not None else zarr.storage.LocalStore(Path(path), read_only=True),
                mode="r",
            )
            attrs: dict[str, Any] = dict(group.attrs)
            ome: Any = attrs.get("ome", attrs)  # NGFF 0.5 nests under "ome"; 0.4 does not
            multiscale = ome["multiscales"][0]
            axes = [a["name"] if isinstance(a, dict) else a for a in multiscale["axes"]]
            datasets = multiscale["datasets"]
            self._arrays: list[Any] = [group[d["path"]] for d in datasets]
            scales = [_scale_of(d) for d in datasets]
            inventory = parse_inventory(attrs)
        except Exception as err:  # zarr raises many types for bad stores
            raise SlideError(
                self.path,
                f"not a readable OME-Zarr image ({type(err).__name__}: {err})",
                "check that the store was written completely, or rewrite it",
            ) from err
        dtype = supported_dtype(self._arrays[0].dtype)
        if axes[-2:] != ["y", "x"] or dtype is None or any(a.dtype != dtype for a in self._arrays):
            raise SlideError(
                self.path,
                f"unsupported OME-Zarr layout (axes {axes}, dtype {self._arrays[0].dtype})",
                "hyfi-imaging reads uint8, uint16 or float32 images with axes ending in y, x",
            )
        self.dtype: np.dtype[np.generic] = dtype
        # Leading non-channel axes (t, z) are read at index 0.
        self._c_axis = axes.index("c") if "c" in axes else None
        self._lead = tuple(0 for _ in axes[:-2])
        shape0 = self._arrays[0].shape
        self.channels = int(shape0[self._c_axis]) if self._c_axis is not None else 1
        self.level_dimensions = tuple((int(a.shape[-2]), int(a.shape[-1])) for a in self._arrays)
        # Per axis from the scale transforms (ours are exactly 2**l).
        self.level_downsamples = tuple(
            (float(s[-2] / scales[0][-2]), float(s[-1] / scales[0][-1])) for s in scales
        )
        hyfi = attrs.get("hyfi")
        self.attrs: dict[str, Any] = hyfi if isinstance(hyfi, dict) else {}
        stats = attrs.get("hyfi_stats")
        #: Per-channel statistics written by :func:`write_ome_zarr` (empty for other stores).
        self.channel_stats: dict[str, Any] = stats if isinstance(stats, dict) else {}
        self.channel_names, self.channel_colors, self.channel_windows = parse_omero(
            ome.get("omero"), self.channels, self.dtype
        )
        per_um = [
            _UNIT_UM.get(str(a.get("unit"))) if isinstance(a, dict) else None
            for a in multiscale["axes"][-2:]
        ]
        y, x = (
            float(scales[0][k]) * um if um is not None else None
            for k, um in zip((-2, -1), per_um, strict=True)
        )
        self.mpp: float | None
        if mpp_override is not None:  # it wins, also over pixels that are not square
            self.mpp, self.mpp_source = float(mpp_override), "override"
        else:
            self.mpp = square_mpp(self.path, x, y)
            self.mpp_source = "ome" if self.mpp is not None else "none"
        self.background = self.attrs.get(
            "background", default_background(self.dtype, rgb=is_rgb(self.channel_names))
        )
        self._guard = ChunkGuard(
            self.path,
            inventory,
            [(str(d["path"]), a) for d, a in zip(datasets, self._arrays, strict=True)],
            file_size(path) if store is None else store_size(store),
        )

    @property
    def level_count(self) -> int:
        return len(self._arrays)

    def read_region(self, level: int, y: int, x: int, h: int, w: int) -> np.ndarray:
        """Read ``[y, y+h) x [x, x+w)`` of ``level`` as ``(C, h, w)`` of :attr:`dtype`."""

        def fetch(y0: int, x0: int, y1: int, x1: int) -> np.ndarray:
            sel: list[Any] = [*self._lead, slice(y0, y1), slice(x0, x1)]
            if self._c_axis is not None:
                sel[self._c_axis] = slice(None)
            self._guard.check(level, sel)
            inside = np.asarray(self._arrays[level][tuple(sel)])
            return inside if self._c_axis is not None else inside[None]

        return read_filled(
            self, level, y, x, h, w, fetch, fix="the store may be damaged; rewrite it",
            budget=self.memory_budget, decoded=lambda box: self._decoded(level, box),
        )  # fmt: skip

    def _decoded(self, level: int, box: tuple[int, int, int, int]) -> int:
        """Bytes decoded at once besides the region to read ``box`` of ``level``: the chunks
        it touches (all channels), at most as many as zarr decodes at once, decoded and copied."""
        from hyfi_imaging.io.budget import CONCURRENT_CHUNKS

        arr = self._arrays[level]
        chunks = tuple(int(n) for n in arr.chunks)
        y0, x0, y1, x1 = box
        cy, cx = chunks[-2], chunks[-1]
        touched = ((y1 - 1) // cy - y0 // cy + 1) * ((x1 - 1) // cx - x0 // cx + 1)
        if self._c_axis is not None:
            touched *= -(-int(arr.shape[self._c_axis]) // chunks[self._c_axis])
        chunk_bytes = math.prod(chunks) * self.dtype.itemsize
        return 2 * chunk_bytes * min(touched, CONCURRENT_CHUNKS)

    def close(self) -> None:
        """Drop the array handles (zarr holds no open files between reads)."""
        self._arrays = []

    def __enter__(self) -> ZarrReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class StorePixels:
    """What a store holds per pixel, read from its metadata alone (no pixel data).

    Attributes:
        channels: channel count.
        dtype: the pixel type's name (``"uint8"``, ``"uint16"``, ``"float32"``).
        channel_names: one label per channel.
        mpp: level 0's µm/px as preprocessing recorded it (``hyfi.mpp``), or None when the
            source stated none.
    """

    channels: int
    dtype: str
    channel_names: tuple[str, ...]
    mpp: float | None = None


def read_store_pixels(path: str | os.PathLike[str]) -> StorePixels | None:
    """Channels, pixel type and channel names of a finished hyfi store, from its JSON only.

    Reads the group's and level 0's ``zarr.json``: no zarr import, no event
    loop, so every rank may call it before any process group exists.
    ``None`` when ``path`` is not a finished store of ``(c, y, x)`` images.
    """
    attrs = _open_group_attrs(path)
    if attrs is None or not isinstance(attrs.get("hyfi"), dict):
        return None
    try:
        ome = attrs.get("ome", attrs)
        level0 = ome["multiscales"][0]["datasets"][0]["path"]
        meta = json.loads((Path(path) / str(level0) / "zarr.json").read_text())
        channels, dtype = int(meta["shape"][0]), np.dtype(str(meta["data_type"]))
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    if len(meta.get("shape", ())) != 3 or supported_dtype(dtype) is None:
        return None
    names, _, _ = parse_omero(ome.get("omero"), channels, dtype)
    mpp = attrs["hyfi"].get("mpp")  # None where the source stated none
    known = isinstance(mpp, int | float) and not isinstance(mpp, bool) and mpp > 0
    return StorePixels(channels, str(dtype), names, float(mpp) if known else None)


#: NGFF's space units (UDUNITS-2 names), in µm.
_UNIT_UM = {
    "micrometer": 1.0, "micron": 1.0, "nanometer": 1e-3, "millimeter": 1e3, "centimeter": 1e4,
    "meter": 1e6, "angstrom": 1e-4,
}  # fmt: skip


def _scale_of(dataset: dict[str, Any]) -> list[float]:
    for t in dataset.get("coordinateTransformations", []):
        if t.get("type") == "scale":
            return [float(v) for v in t["scale"]]
    raise KeyError(f"dataset {dataset.get('path')!r} has no scale transform")
