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

The group follows NGFF 0.5: ``attributes.ome`` holds ``version`` and
``multiscales`` (axes ``c, y, x``, one scale transform per level in
micrometres), and every level array carries ``dimension_names`` matching the
axes. hyfi-specific provenance (source slide, source mpp, crop box, ...) lives
beside it under ``attributes.hyfi``. Group attributes are written last, so a
group whose attributes exist was written completely.

zarr 3 runs an asyncio event-loop thread once it is first used; nothing here
touches zarr at import time, so importing the module is safe before fork.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from hyfi_imaging.errors import SlideError
from hyfi_imaging.io.base import BACKGROUND, read_filled

__all__ = [
    "NGFF_VERSION",
    "RegionSource",
    "ZarrReader",
    "downsample_2x",
    "level_shapes",
    "read_hyfi_attrs",
    "write_ome_zarr",
]

NGFF_VERSION = "0.5"
_ZSTD_LEVEL = 3


def downsample_2x(image: np.ndarray) -> np.ndarray:
    """Halve a ``(C, H, W)`` uint8 image by 2x2 area averaging (rounded).

    An odd last row or column is averaged over the pixels that exist (edge
    replication), so level ``l`` pixel ``i`` always covers level-0 pixels
    ``[i·2^l, (i+1)·2^l)`` and the scale transform stays exactly ``2^l``.
    """
    h, w = image.shape[1:]
    if h % 2 or w % 2:
        image = np.pad(image, ((0, 0), (0, h % 2), (0, w % 2)), mode="edge")
    acc = image[:, 0::2, 0::2].astype(np.uint16)
    acc += image[:, 1::2, 0::2]
    acc += image[:, 0::2, 1::2]
    acc += image[:, 1::2, 1::2]
    acc += 2  # round half up
    return (acc >> 2).astype(np.uint8)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@runtime_checkable
class RegionSource(Protocol):
    """An image too large to hold, produced one region at a time.

    ``shape`` is ``(C, H, W)``; ``read(y0, x0, y1, x1)`` returns the uint8
    ``(C, y1 - y0, x1 - x0)`` pixels of that region (inside the image).
    """

    @property
    def shape(self) -> tuple[int, int, int]: ...

    def read(self, y0: int, x0: int, y1: int, x1: int) -> np.ndarray: ...


class _ArraySource:
    """An in-memory ``(C, H, W)`` array served as a :class:`RegionSource`."""

    def __init__(self, image: np.ndarray) -> None:
        self.image = image

    @property
    def shape(self) -> tuple[int, int, int]:
        c, h, w = self.image.shape
        return int(c), int(h), int(w)

    def read(self, y0: int, x0: int, y1: int, x1: int) -> np.ndarray:
        return self.image[:, y0:y1, x0:x1]


def level_shapes(h: int, w: int, *, chunk: int, pyramid_levels: int) -> list[tuple[int, int]]:
    """``(h, w)`` of every level :func:`write_ome_zarr` writes for an ``h x w`` image.

    Level ``l`` is ``ceil(h / 2**l) x ceil(w / 2**l)``; a level whose shorter
    side would fall below ``chunk / 2`` is not written (level 0 always is).
    """
    shapes = [(h, w)]
    while len(shapes) < pyramid_levels:
        ph, pw = shapes[-1]
        nh, nw = -(-ph // 2), -(-pw // 2)
        if min(nh, nw) < chunk / 2:
            break
        shapes.append((nh, nw))
    return shapes


def _downsampled_block(finer: Any, y0: int, x0: int, y1: int, x1: int, piece: int) -> np.ndarray:
    """Rows ``[y0, y1)`` x columns ``[x0, x1)`` of the level below ``finer``, by 2x2 averaging.

    ``finer`` is read ``2 * piece`` pixels square at a time (even offsets, so
    each piece averages exactly the pixels the whole level would).
    """
    fh, fw = finer.shape[1:]
    out = np.empty((finer.shape[0], y1 - y0, x1 - x0), dtype=np.uint8)
    for py in range(y0, y1, piece):
        for px in range(x0, x1, piece):
            qy, qx = min(py + piece, y1), min(px + piece, x1)
            block = np.asarray(finer[:, 2 * py : min(2 * qy, fh), 2 * px : min(2 * qx, fw)])
            out[:, py - y0 : qy - y0, px - x0 : qx - x0] = downsample_2x(block)
    return out


def _shard_blocks(h: int, w: int, sh: int, sw: int) -> Iterator[tuple[int, int, int, int]]:
    for y0 in range(0, h, sh):
        for x0 in range(0, w, sw):
            yield y0, x0, min(y0 + sh, h), min(x0 + sw, w)


def _multiscales(name: str, mpp: float | None, n_levels: int) -> dict[str, Any]:
    # Unknown resolution: pixel units (no "unit"), scale 1 per level-0 pixel.
    unit = {"unit": "micrometer"} if mpp is not None else {}
    step = 1.0 if mpp is None else mpp
    return {
        "name": name,
        "axes": [
            {"name": "c", "type": "channel"},
            {"name": "y", "type": "space", **unit},
            {"name": "x", "type": "space", **unit},
        ],
        "datasets": [
            {
                "path": str(level),
                "coordinateTransformations": [
                    {"type": "scale", "scale": [1.0, step * 2**level, step * 2**level]}
                ],
            }
            for level in range(n_levels)
        ],
        # NGFF asks that the downsampling method be documented.
        "type": "mean",
        "metadata": {"description": "2x2 area averaging per level, uint8 rounded"},
    }


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
) -> None:
    """Write a ``(C, H, W)`` uint8 image as an OME-Zarr 0.5 multiscale group.

    Args:
        path: the group to create; must not exist (write to a temporary path
            and rename it for atomicity).
        image: uint8 ``(C, H, W)`` level-0 pixels, or a :class:`RegionSource`
            that produces them one shard at a time (memory then stays at a
            few shards, however large the image).
        mpp: microns per level-0 pixel, or None when unknown (axes then carry no unit).
        hyfi_attrs: JSON-able provenance stored as ``attributes["hyfi"]``.
        chunk: inner chunk side (the unit of decoding).
        shard: shard side, a multiple of ``chunk``; clamped to the image
            rounded up to whole chunks, so small images get one shard.
        pyramid_levels: at most this many levels; level ``l`` is downsampled
            ``2**l``. Levels whose shorter side would fall below ``chunk / 2``
            are not written (level 0 always is; see :func:`level_shapes`).
        name: the multiscale's ``name``.

    Raises:
        SlideError: ``path`` exists.
        ValueError: bad arguments (programming errors).
    """
    import zarr
    from zarr.codecs import ZstdCodec

    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.dtype != np.uint8:
            raise ValueError(
                f"write_ome_zarr needs uint8 (C, H, W), got {image.dtype} {image.shape}"
            )
        source: RegionSource = _ArraySource(image)
    else:
        source = image
    if chunk <= 0 or shard <= 0 or shard % chunk:
        raise ValueError(f"shard ({shard}) must be a positive multiple of chunk ({chunk})")
    if mpp is not None and not mpp > 0:
        raise ValueError(f"mpp must be positive or None, got {mpp}")
    if pyramid_levels < 1:
        raise ValueError(f"pyramid_levels must be >= 1, got {pyramid_levels}")
    json.dumps(hyfi_attrs)  # fail before writing anything if not JSON-able
    out = Path(path)
    if out.exists():
        raise SlideError(
            str(out), "output store already exists", "remove it or choose another output path"
        )

    group = zarr.open_group(zarr.storage.LocalStore(out), mode="w-", zarr_format=3)
    c, h0, w0 = source.shape
    shapes = level_shapes(h0, w0, chunk=chunk, pyramid_levels=pyramid_levels)
    finer: Any = None
    for level, (h, w) in enumerate(shapes):
        sh = min(shard, _round_up(h, chunk))
        sw = min(shard, _round_up(w, chunk))
        arr = group.create_array(
            str(level),
            shape=(c, h, w),
            dtype="uint8",
            chunks=(c, chunk, chunk),
            shards=(c, sh, sw),
            compressors=ZstdCodec(level=_ZSTD_LEVEL),
            fill_value=BACKGROUND,
            dimension_names=("c", "y", "x"),
        )
        for y0, x0, y1, x1 in _shard_blocks(h, w, sh, sw):
            if finer is None:
                block = source.read(y0, x0, y1, x1)
                if block.shape != (c, y1 - y0, x1 - x0) or block.dtype != np.uint8:
                    raise ValueError(
                        f"region source returned {block.dtype} {block.shape} for "
                        f"y={y0}:{y1} x={x0}:{x1}, expected uint8 {(c, y1 - y0, x1 - x0)}"
                    )
            else:
                block = _downsampled_block(finer, y0, x0, y1, x1, max(chunk, shard // 2))
            arr[:, y0:y1, x0:x1] = block
            del block
        finer = arr
    n_levels = len(shapes)
    # Written last: attributes mark a complete store.
    group.attrs.update(
        {
            "ome": {"version": NGFF_VERSION, "multiscales": [_multiscales(name, mpp, n_levels)]},
            "hyfi": hyfi_attrs,
        }
    )


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

    Args:
        path: the group directory.
        mpp_override: microns per level-0 pixel that win over the scale metadata.
        store: read through this zarr store instead of ``path`` (a remote
            store, or a wrapper that counts accesses).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mpp_override: float | None = None,
        store: Any = None,
    ) -> None:
        import zarr

        self.path = str(path)
        self.format = "ome-zarr"
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
        except Exception as err:  # zarr raises many types for bad stores
            raise SlideError(
                self.path,
                f"not a readable OME-Zarr image ({type(err).__name__}: {err})",
                "check that the store was written completely, or rewrite it",
            ) from err
        if axes[-2:] != ["y", "x"] or any(a.dtype != np.uint8 for a in self._arrays):
            raise SlideError(
                self.path,
                f"unsupported OME-Zarr layout (axes {axes}, dtype {self._arrays[0].dtype})",
                "hyfi-imaging reads uint8 images with axes ending in y, x",
            )
        # Leading non-channel axes (t, z) are read at index 0.
        self._c_axis = axes.index("c") if "c" in axes else None
        self._lead = tuple(0 for _ in axes[:-2])
        shape0 = self._arrays[0].shape
        self.channels = int(shape0[self._c_axis]) if self._c_axis is not None else 1
        self.level_dimensions = tuple((int(a.shape[-2]), int(a.shape[-1])) for a in self._arrays)
        self.level_downsamples = tuple(float(s[-1] / scales[0][-1]) for s in scales)
        hyfi = attrs.get("hyfi")
        self.attrs: dict[str, Any] = hyfi if isinstance(hyfi, dict) else {}
        has_unit = all(not isinstance(a, dict) or "unit" in a for a in multiscale["axes"][-2:])
        self.mpp: float | None = float(scales[0][-1]) if has_unit else None
        self.mpp_source = "ome" if has_unit else "none"
        if mpp_override is not None:
            self.mpp, self.mpp_source = float(mpp_override), "override"
        self.background = int(self.attrs.get("background", BACKGROUND))

    @property
    def level_count(self) -> int:
        return len(self._arrays)

    def read_region(self, level: int, y: int, x: int, h: int, w: int) -> np.ndarray:
        """Read ``[y, y+h) x [x, x+w)`` of ``level`` as uint8 ``(C, h, w)``."""

        def fetch(y0: int, x0: int, y1: int, x1: int) -> np.ndarray:
            sel: list[Any] = [*self._lead, slice(y0, y1), slice(x0, x1)]
            if self._c_axis is not None:
                sel[self._c_axis] = slice(None)
            inside = np.asarray(self._arrays[level][tuple(sel)])
            return inside if self._c_axis is not None else inside[None]

        return read_filled(
            self, level, y, x, h, w, fetch, fix="the store may be damaged; rewrite it"
        )

    def close(self) -> None:
        """Drop the array handles (zarr holds no open files between reads)."""
        self._arrays = []

    def __enter__(self) -> ZarrReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _scale_of(dataset: dict[str, Any]) -> list[float]:
    for t in dataset.get("coordinateTransformations", []):
        if t.get("type") == "scale":
            return [float(v) for v in t["scale"]]
    raise KeyError(f"dataset {dataset.get('path')!r} has no scale transform")
