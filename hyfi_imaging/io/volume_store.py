"""OME-Zarr (NGFF 0.5, zarr v3) volumes ``(c, z, y, x)``: writer, reader, tile + halo reads.

Why a store of its own beside :mod:`hyfi_imaging.io.zarr_store`: a volume has
a third spatial axis everywhere — chunks, shards, the pyramid, the voxel
size, the tile grid — and squeezing it through the 2-D ``(c, y, x)`` reader
would read one z-plane (which is what that reader does for foreign ``z``
axes). The layout follows the 2-D store so that one set of habits serves both:

* chunks hold every channel (a rank needs them all) and are the unit of
  decoding; shards (a whole number of chunks per axis) are written in one
  piece each, so no shard is ever re-encoded;
* level ``l`` is the ``2x2x2`` mean of level ``l - 1`` (integers rounded half
  up, floats averaged in float64), an odd last plane replicated, so voxel
  ``i`` of level ``l`` covers level-0 voxels ``[i·2^l, (i+1)·2^l)`` and the
  scale transform is exactly ``2^l · voxel_size``;
* label images (``labels/<name>``, NGFF ``image-label``) are downsampled by
  taking the first voxel of each block (``nearest``): a mean of labels is no label;
* the whole group is written into a temporary directory beside ``path`` and
  renamed into place, so a reader sees a finished store or none (an error
  removes the temporary directory); group attributes are written last, with
  each multiscale group's chunk inventory (:mod:`hyfi_imaging.io.inventory`),
  so that a shard deleted later is refused by :class:`VolumeStore` instead of
  reading as zeros.

Reads go through :func:`read_subvolume`, which slices the zarr array, so only
the chunks a box touches are fetched and decoded; :func:`volume_tile` is one
rank's tile plus halo (:mod:`hyfi_imaging.geometry.tiles`), zero outside the volume.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from hyfi_imaging.errors import ConfigError, SlideError
from hyfi_imaging.geometry.tiles import BoxND, HaloND, read_box_nd, tile_region_nd
from hyfi_imaging.io.channels import channel_stats, omero_metadata
from hyfi_imaging.io.inventory import (
    INVENTORY_ATTR,
    ChunkGuard,
    file_size,
    parse_inventory,
    store_size,
    take_inventory,
)
from hyfi_imaging.io.pixels import default_channels

__all__ = [
    "VolumeStore",
    "downsample_2x_nd",
    "read_subvolume",
    "volume_level_shapes",
    "volume_tile",
    "write_ome_zarr_volume",
]

NGFF_VERSION = "0.5"
_AXES = ("c", "z", "y", "x")
_ZSTD_LEVEL = 3


def downsample_2x_nd(array: np.ndarray, *, method: str = "mean") -> np.ndarray:
    """Halve every spatial axis of ``(C, *spatial)``: ``mean`` of each 2^n block, or ``nearest``.

    ``mean`` is exact for the type: integers give the integer mean rounded half
    up, floats the float64 mean rounded once to the type. An odd last plane is
    replicated (edge), so a block never averages fewer voxels than the others
    and the scale stays exactly 2. ``nearest`` (labels) keeps each block's first voxel.
    """
    if method == "nearest":
        return np.ascontiguousarray(
            array[(slice(None), *(slice(None, None, 2),) * (array.ndim - 1))]
        )
    if method != "mean":
        raise ConfigError(f"downsampling {method!r}", "is not a method", "use mean or nearest")
    odd = [(0, 0)] + [(0, n % 2) for n in array.shape[1:]]
    if any(p[1] for p in odd):
        array = np.pad(array, odd, mode="edge")
    n = array.ndim - 1
    wide: type[np.generic] = np.float64 if array.dtype.kind == "f" else np.int64
    if array.dtype.kind == "u" and array.dtype.itemsize == 8:
        wide = np.uint64
    acc: np.ndarray | None = None
    for offsets in itertools.product((0, 1), repeat=n):
        part = array[(slice(None), *(slice(o, None, 2) for o in offsets))]
        acc = part.astype(wide) if acc is None else acc + part
    assert acc is not None
    count = 2**n
    if array.dtype.kind == "f":
        return (acc / count).astype(array.dtype)
    return ((acc + count // 2) // count).astype(array.dtype)


def volume_level_shapes(
    shape: Sequence[int], chunks: Sequence[int], pyramid_levels: int
) -> list[tuple[int, ...]]:
    """Spatial shape of every level written: ``ceil(n / 2**l)`` per axis.

    As for 2-D stores, a level is written only while every axis keeps at least
    half a chunk (level 0 always is).
    """
    shapes = [tuple(int(n) for n in shape)]
    while len(shapes) < pyramid_levels:
        f = 2 ** len(shapes)
        nxt = tuple(-(-int(n) // f) for n in shape)
        if any(n < c / 2 for n, c in zip(nxt, chunks, strict=True)):
            break
        shapes.append(nxt)
    return shapes


def _triple(value: int | Sequence[int], what: str) -> tuple[int, int, int]:
    v = (value,) * 3 if isinstance(value, (int, np.integer)) else tuple(value)
    if len(v) != 3 or any(int(n) < 1 for n in v):
        raise ConfigError(f"{what} {value!r}", "needs one size >= 1 or three (z, y, x)", "fix it")
    return int(v[0]), int(v[1]), int(v[2])


def _multiscales(
    name: str,
    voxel_size: tuple[float, float, float],
    n_levels: int,
    method: str,
    origin: Sequence[float] = (0.0, 0.0, 0.0),
) -> dict[str, Any]:
    """The NGFF ``multiscales`` of a ``c, z, y, x`` pyramid. ``origin``: where level-0 voxel
    ``(0, 0, 0)``'s centre lies (µm). A ``mean`` level's voxel is centred on its 2**l block
    (a translation of (2**l - 1) / 2 voxels: without it a viewer drew level l that far off);
    a ``nearest`` level's is its block's first voxel."""

    def transforms(level: int) -> list[dict[str, Any]]:
        f = 2**level
        out: list[dict[str, Any]] = [
            {"type": "scale", "scale": [1.0, *(v * f for v in voxel_size)]}
        ]
        shift = (f - 1) / 2 if method == "mean" else 0.0
        moved = [o + v * shift for o, v in zip(origin, voxel_size, strict=True)]
        if any(moved):
            out.append({"type": "translation", "translation": [0.0, *moved]})
        return out

    return {
        "name": name,
        "axes": [
            {"name": "c", "type": "channel"},
            *({"name": a, "type": "space", "unit": "micrometer"} for a in _AXES[1:]),
        ],
        "datasets": [
            {"path": str(level), "coordinateTransformations": transforms(level)}
            for level in range(n_levels)
        ],
        "type": method,
        "metadata": {"description": f"2x2x2 {method} per level, edge voxels replicated"},
    }


def _write_pyramid(
    group: Any,
    volume: np.ndarray,
    *,
    chunks: tuple[int, int, int],
    shards: tuple[int, int, int],
    pyramid_levels: int,
    method: str,
) -> tuple[int, np.ndarray]:
    """Write levels ``0, 1, ...`` of ``volume`` into ``group``; return their count and the coarsest."""
    from zarr.codecs import ZstdCodec

    c = volume.shape[0]
    shapes = volume_level_shapes(volume.shape[1:], chunks, pyramid_levels)
    level_data = volume
    for level, shape in enumerate(shapes):
        if level:
            level_data = downsample_2x_nd(level_data, method=method)
        shard = tuple(min(s, -(-n // k) * k) for s, n, k in zip(shards, shape, chunks, strict=True))
        arr = group.create_array(
            str(level),
            shape=(c, *shape),
            dtype=volume.dtype,
            chunks=(c, *chunks),
            shards=(c, *shard),
            compressors=ZstdCodec(level=_ZSTD_LEVEL),
            fill_value=0,
            dimension_names=_AXES,
        )
        # One assignment per shard: each shard is encoded once, never rewritten.
        for origin in itertools.product(
            *(range(0, n, s) for n, s in zip(shape, shard, strict=True))
        ):
            index = tuple(
                slice(o, min(o + s, n)) for o, s, n in zip(origin, shard, shape, strict=True)
            )
            arr[(slice(None), *index)] = level_data[(slice(None), *index)]
    return len(shapes), level_data


def write_ome_zarr_volume(
    path: str | os.PathLike[str],
    volume: np.ndarray,
    *,
    voxel_size: Sequence[float],
    chunks: int | Sequence[int] = 64,
    shards: int | Sequence[int] | None = None,
    channel_names: Sequence[str] | None = None,
    pyramid_levels: int = 3,
    name: str = "",
    attrs: Mapping[str, Any] | None = None,
    labels: Mapping[str, np.ndarray] | None = None,
    origin: Sequence[float] = (0.0, 0.0, 0.0),
    method: Literal["mean", "nearest"] = "mean",
) -> Path:
    """Write a ``(C, Z, Y, X)`` volume (its dtype kept) as an OME-Zarr 0.5 group, atomically.

    Args:
        path: the group to create; must not exist.
        volume: level-0 voxels, any integer or float type (kept as given).
        voxel_size: ``(z, y, x)`` micrometres per level-0 voxel.
        chunks: inner chunk size, one for every axis or ``(z, y, x)``.
        shards: shard size, a multiple of ``chunks`` per axis (default: 4 chunks),
            clamped to the level rounded up to whole chunks.
        channel_names: one per channel (default ``c0, c1, ...``).
        pyramid_levels: at most this many levels (see :func:`volume_level_shapes`).
        name: the multiscale's ``name``.
        attrs: JSON-able provenance stored as ``attributes["hyfi"]``.
        labels: ``name -> (Z, Y, X)`` integer label volumes of the same shape,
            written as NGFF label images ``labels/<name>`` (nearest downsampling).
        origin: where level-0 voxel ``(0, 0, 0)``'s centre lies, µm ``(z, y, x)`` (a map of
            a coarser level of another volume: :func:`~hyfi_imaging.train.outputs.write_mask`).
        method: how the image's coarser levels are made: ``mean`` of 2x2x2 voxels, or
            ``nearest`` for class numbers (a mean of classes 0 and 2 is class 1).

    Returns ``path``. Raises :class:`SlideError` when ``path`` exists and
    :class:`ConfigError` for bad arguments; nothing is left behind either way.
    """
    import zarr

    out = Path(path)
    if not isinstance(volume, np.ndarray) or volume.ndim != 4 or volume.dtype.kind not in "uif":
        raise ConfigError(
            f"volume for {out}",
            f"is {getattr(volume, 'dtype', type(volume).__name__)} "
            f"{getattr(volume, 'shape', '')}, not a numeric (C, Z, Y, X) array",
            "pass channels first, then z, y, x",
        )
    chunk = _triple(chunks, "chunks")
    shard = _triple(shards if shards is not None else tuple(4 * c for c in chunk), "shards")
    if any(s % c for s, c in zip(shard, chunk, strict=True)):
        raise ConfigError(f"shards {shard}", f"are not multiples of chunks {chunk}", "fix them")
    vs = tuple(float(v) for v in voxel_size)
    if len(vs) != 3 or not all(v > 0 for v in vs):
        raise ConfigError(f"voxel_size {voxel_size!r}", "needs three sizes > 0", "give (z, y, x)")
    if pyramid_levels < 1:
        raise ConfigError(f"pyramid_levels {pyramid_levels}", "must be >= 1", "use e.g. 3")
    c = volume.shape[0]
    names = tuple(channel_names) if channel_names is not None else default_channels(c, rgb=False)[0]
    colors = default_channels(c, rgb=False)[1]
    if len(names) != c:
        raise ConfigError(f"channel_names {names}", f"{len(names)} names for {c} channels", "fix")
    label_volumes = dict(labels or {})
    for key, lab in label_volumes.items():
        if lab.shape != volume.shape[1:] or lab.dtype.kind not in "ui" or "/" in key or not key:
            raise ConfigError(
                f"label image {key!r}",
                f"is {lab.dtype} {lab.shape}, not integer labels of shape {volume.shape[1:]}",
                "give one integer label per voxel and a plain name",
            )
    hyfi = dict(attrs or {})
    json.dumps(hyfi)  # fail before writing anything if not JSON-able
    if out.exists():
        raise SlideError(str(out), "output store already exists", "remove it or choose another")

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        group = zarr.open_group(zarr.storage.LocalStore(tmp), mode="w-", zarr_format=3)
        n_levels, coarsest = _write_pyramid(
            group, volume, chunks=chunk, shards=shard, pyramid_levels=pyramid_levels, method=method
        )
        # The 2-D statistics over the coarsest level, its z-planes stacked along y.
        stats = channel_stats(coarsest.reshape(c, -1, coarsest.shape[-1]), None, n_levels - 1)
        if label_volumes:
            root = group.create_group("labels")
            for key, lab in label_volumes.items():
                sub = root.create_group(key)
                n_lab, _ = _write_pyramid(
                    sub,
                    lab[None],
                    chunks=chunk,
                    shards=shard,
                    pyramid_levels=n_levels,
                    method="nearest",
                )
                sub.attrs.update(
                    {
                        "ome": {
                            "version": NGFF_VERSION,
                            "multiscales": [_multiscales(key, vs, n_lab, "nearest", origin)],
                            "image-label": {
                                "version": NGFF_VERSION,
                                "source": {"image": "../../"},
                                # the values it holds: a value no class names is refused
                                # before training starts, from this metadata alone
                                "properties": [
                                    {"label-value": int(v)} for v in np.unique(lab).tolist()
                                ],
                            },
                        },
                        INVENTORY_ATTR: take_inventory(
                            tmp / "labels" / key, [str(level) for level in range(n_lab)]
                        ),
                    }
                )
            root.attrs.update({"ome": {"version": NGFF_VERSION, "labels": list(label_volumes)}})
        # Written last: attributes mark a complete store.
        group.attrs.update(
            {
                "ome": {
                    "version": NGFF_VERSION,
                    "multiscales": [_multiscales(name, vs, n_levels, method, origin)],
                    "omero": omero_metadata(names, colors, volume.dtype, stats),
                },
                "hyfi": {"kind": "volume", **hyfi},  # a mask's own kind: "prediction"
                "hyfi_stats": stats,
                INVENTORY_ATTR: take_inventory(tmp, [str(level) for level in range(n_levels)]),
            }
        )
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _scale(dataset: Mapping[str, Any]) -> list[float]:
    for t in dataset.get("coordinateTransformations", []):
        if t.get("type") == "scale":
            return [float(v) for v in t["scale"]]
    raise KeyError(f"dataset {dataset.get('path')!r} has no scale transform")


class VolumeStore:
    """An open ``(c, z, y, x)`` OME-Zarr volume (or one of its label images).

    Opening reads only metadata; voxels are read by :func:`read_subvolume`.
    A store with a chunk inventory (:mod:`hyfi_imaging.io.inventory`) is
    guarded: a box whose shard the inventory lists but the store lacks raises
    :class:`SlideError` naming the store, level and key (each shard is stat-ed
    once per store object); stores without one are read unchecked.

    Args:
        path: the image group.
        label: open the label image ``labels/<label>`` instead of the image.
        store: read through this zarr store (a remote store, or a wrapper that
            counts accesses) instead of ``path``.

    Attributes:
        channels, dtype, channel_names: what each voxel holds.
        shapes: ``(z, y, x)`` of every level.
        voxel_size: ``(z, y, x)`` micrometres of a level-0 voxel.
        labels: names of the label images stored with the image.
        attrs: the ``hyfi`` attributes; ``channel_stats``: the ``hyfi_stats``.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, label: str | None = None, store: Any = None
    ) -> None:
        import zarr

        self.path = str(path)
        where = self.path if label is None else f"{self.path} label {label}"
        try:
            root = zarr.open_group(
                store if store is not None else zarr.storage.LocalStore(Path(path), read_only=True),
                mode="r",
            )
            group = root if label is None else root[f"labels/{label}"]
            attrs: dict[str, Any] = dict(group.attrs)
            multiscale = attrs["ome"]["multiscales"][0]
            axes = tuple(a["name"] for a in multiscale["axes"])
            datasets = multiscale["datasets"]
            self._arrays: list[Any] = [group[d["path"]] for d in datasets]
            scale0 = _scale(datasets[0])
            inventory = parse_inventory(attrs)
            label_attrs: dict[str, Any] = dict(root["labels"].attrs) if "labels" in root else {}
        except Exception as err:  # zarr raises many types for bad stores
            raise SlideError(
                where,
                f"not a readable OME-Zarr volume ({type(err).__name__}: {err})",
                "check that the store was written completely, or rewrite it",
            ) from err
        if axes != _AXES:
            raise SlideError(
                where, f"has axes {axes}, not {_AXES}", "open 2-D images with open_slide"
            )
        first = self._arrays[0]
        self.dtype: np.dtype[Any] = np.dtype(first.dtype)
        self.channels = int(first.shape[0])
        self.shapes = tuple(tuple(int(n) for n in a.shape[1:]) for a in self._arrays)
        self.voxel_size = (scale0[1], scale0[2], scale0[3])
        omero = attrs["ome"].get("omero", {}).get("channels", [])
        self.channel_names = tuple(
            str(ch.get("label", f"c{i}")) for i, ch in enumerate(omero)
        ) or tuple(f"c{i}" for i in range(self.channels))
        self.labels = tuple(label_attrs.get("ome", {}).get("labels", ()))
        hyfi = dict(root.attrs).get("hyfi")
        self.attrs: dict[str, Any] = hyfi if isinstance(hyfi, dict) else {}
        stats = attrs.get("hyfi_stats")
        self.channel_stats: dict[str, Any] = stats if isinstance(stats, dict) else {}
        prefix = "" if label is None else f"labels/{label}/"
        self._guard = ChunkGuard(
            where,
            inventory,
            [(str(d["path"]), a) for d, a in zip(datasets, self._arrays, strict=True)],
            file_size(Path(path) / prefix) if store is None else store_size(store, prefix),
            fix="rewrite this volume's store with the tool that wrote it",
        )

    @property
    def level_count(self) -> int:
        """Number of pyramid levels."""
        return len(self._arrays)

    def check_level(self, level: int) -> None:
        """ConfigError unless the store has ``level``."""
        if not 0 <= level < len(self._arrays):
            raise ConfigError(
                f"{self.path} level {level}",
                f"the store has levels 0-{len(self._arrays) - 1}",
                "choose one of those",
            )

    def fetch(self, level: int, box: BoxND) -> np.ndarray:
        """``(C, *box.size)`` of a box inside ``level``: only the chunks it touches are read."""
        self._guard.check(level, (slice(None), *box.slices()))
        return np.asarray(self._arrays[level][(slice(None), *box.slices())])


def read_subvolume(
    store: VolumeStore, level: int, box: Sequence[int] | BoxND, *, fill: float = 0
) -> np.ndarray:
    """Read ``box = (z, y, x, d, h, w)`` of ``level`` as ``(C, d, h, w)`` of the store's type.

    Only the chunks inside the volume that the box touches are read; the rest
    of the box (outside the volume) is ``fill``.
    """
    store.check_level(level)
    b = box if isinstance(box, BoxND) else BoxND.of(box)
    if len(b.origin) != 3:
        raise ConfigError(f"box {b.flat}", "a volume box is (z, y, x, d, h, w)", "give 6 numbers")
    return read_box_nd(
        lambda inner: store.fetch(level, inner),
        b,
        store.shapes[level],
        channels=store.channels,
        dtype=store.dtype,
        fill=fill,
    )


def volume_tile(
    store: VolumeStore,
    level: int,
    grid: Sequence[int],
    coords: Sequence[int],
    *,
    halo: HaloND = 0,
    align: int = 1,
    padded_size: Sequence[int] | None = None,
    fill: float = 0,
) -> np.ndarray:
    """The rank at ``coords`` of a ``(gz, gy, gx)`` grid: its sub-volume plus halo, ``(C, d, h, w)``.

    The same rule as 2-D tiles (:func:`hyfi_imaging.geometry.tiles.tile_region_nd`):
    the volume is padded at the far end of each axis to a multiple of
    ``grid · align`` (``padded_size``, when given, must equal that), equal tiles;
    voxels outside the volume (padding, halo past the border) are ``fill``.
    """
    store.check_level(level)
    region = tile_region_nd(
        store.shapes[level], grid, coords, halo=halo, align=align, padded=padded_size
    )
    return read_subvolume(store, level, region.read, fill=fill)
