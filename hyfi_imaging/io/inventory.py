"""Chunk inventories: each multiscale group records the stored objects its writer wrote.

Why: zarr reads a chunk (or shard) file that is not there as the array's fill
value. For a slide that is white glass, so a store that lost a file reads back
as a blank image and is trained on with its label, without a word. The store
alone cannot tell "deleted" from "never written", because zarr 3 does not write
a shard that is all fill value (a canvas's empty corners). So the writer lists,
after writing, the stored object files of every level array that are really on
disk, each with its size and CRC-32, and the readers and checkers compare the
store with that record:

* :class:`ChunkGuard` (inside :class:`~hyfi_imaging.io.zarr_store.ZarrReader`
  and :class:`~hyfi_imaging.io.volume_store.VolumeStore`): every object a
  region needs that the inventory lists must exist, else one line naming the
  store, the level and the key. Existence only (a stat), each key once per
  reader; a damaged object that exists is caught by zarr's own checksum of the
  shard index, or by :func:`check_store` with ``checksums=True``.
* :func:`check_store`: the whole store (``hyfi-preprocess --verify`` re-hashes
  every object; ``hyfi-train --check`` and the resume rule of ``hyfi-preprocess``
  only stat them).

Why the record lives in the group's attributes (``attributes.hyfi_inventory``
of ``zarr.json``) and not in a file of its own: the attributes are written
last, in one file, by the same call that marks the store complete, inside the
temporary directory that is renamed into place, so the record is as atomic as
the store. And it cannot be lost on its own: a separate file that went missing
would silently turn a damaged store into an "older store" that is not checked,
while a store without its ``zarr.json`` does not open at all. Opening reads
``zarr.json`` anyway, so the check costs no extra metadata read. The record is
small: one entry per shard (a 65536² canvas at the default 4096² shards has 341).

Each multiscale group (the image, each ``labels/<name>``) holds the inventory
of its own level arrays, with keys relative to the array, as zarr encodes them::

    "hyfi_inventory": {"format": 1, "checksum": "crc32",
                       "arrays": {"0": {"c/0/0/0": [nbytes, crc32], ...}, "1": {...}}}

Stores written before inventories existed have none: they read as before, but
a missing object in them cannot be detected (readers do not warn about it on
every read; ``--verify`` counts such stores apart).
"""

from __future__ import annotations

import itertools
import os
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyfi_imaging.errors import SlideError, problem

__all__ = [
    "INVENTORY_ATTR",
    "REPAIR",
    "ChunkGuard",
    "Inventory",
    "StoreCheck",
    "check_store",
    "file_size",
    "find_stores",
    "parse_inventory",
    "store_size",
    "take_inventory",
]

#: The group attribute that holds the inventory.
INVENTORY_ATTR = "hyfi_inventory"
_FORMAT = 1
_BLOCK = 1 << 20

#: Array name -> stored object key (relative to the array) -> ``(nbytes, crc32)``.
Inventory = dict[str, dict[str, tuple[int, int]]]

#: What to do about a store the checks find damaged.
REPAIR = "re-run hyfi-preprocess for this slide (a store with missing chunks is converted again)"
_REWRITE = "remove the store and re-run hyfi-preprocess for this slide"


def _crc32(path: Path) -> tuple[int, int]:
    """``(nbytes, crc32)`` of a file, read in 1 MiB blocks."""
    crc, n = 0, 0
    with path.open("rb") as fh:
        while block := fh.read(_BLOCK):
            crc = zlib.crc32(block, crc)
            n += len(block)
    return n, crc


def _stored_objects(array_dir: Path) -> Iterator[tuple[str, Path]]:
    """``(key, file)`` of every stored object (chunk or shard) of one array directory."""
    for root, dirs, files in os.walk(array_dir):
        dirs.sort()
        for name in sorted(files):
            file = Path(root) / name
            key = file.relative_to(array_dir).as_posix()
            if key != "zarr.json":
                yield key, file


def take_inventory(group_dir: str | os.PathLike[str], arrays: Sequence[str]) -> dict[str, Any]:
    """The JSON-able inventory of the level ``arrays`` of the group at ``group_dir``, as on disk.

    Call it once every level is written, before the group's attributes: it lists
    what zarr really stored (all-fill shards are not written), reading each
    object once to checksum it.
    """
    group = Path(group_dir)
    listed: dict[str, dict[str, list[int]]] = {}
    for name in arrays:
        listed[name] = {key: list(_crc32(file)) for key, file in _stored_objects(group / name)}
    return {"format": _FORMAT, "checksum": "crc32", "arrays": listed}


def parse_inventory(attrs: Mapping[str, Any]) -> Inventory | None:
    """The inventory in a group's attributes; ``None`` when the group has none (an older store).

    Raises ValueError when one is there but is not an inventory this code reads.
    """
    record = attrs.get(INVENTORY_ATTR)
    if record is None:
        return None
    try:
        if record["format"] != _FORMAT or record["checksum"] != "crc32":
            raise ValueError(f"format {record['format']!r}, checksum {record['checksum']!r}")
        return {
            str(name): {str(k): (int(v[0]), int(v[1])) for k, v in keys.items()}
            for name, keys in record["arrays"].items()
        }
    except (KeyError, TypeError, IndexError, AttributeError) as err:
        raise ValueError(f"malformed {INVENTORY_ATTR} ({type(err).__name__}: {err})") from err


class _FileSize:
    """``key -> bytes or None`` by a stat under a directory; a class, not a closure, so
    readers pickle."""

    def __init__(self, root: str) -> None:
        self.root = root

    def __call__(self, key: str) -> int | None:
        path = os.path.join(self.root, key)
        return os.stat(path).st_size if os.path.isfile(path) else None


class _StoreSize:
    """``key -> bytes or None`` through a zarr store, keys under ``prefix``. A store that
    does not size an object without reading it (zarr's default ``getsize``, which a
    wrapper such as a counting store inherits) is asked only whether the key exists, and
    answers -1 for one that does (its size is then not compared)."""

    def __init__(self, store: Any, prefix: str) -> None:
        from zarr.abc.store import Store

        self.store = store
        self.prefix = prefix
        self.sizes = type(store).getsize is not Store.getsize

    def __call__(self, key: str) -> int | None:
        from zarr.core.sync import sync

        full = f"{self.prefix}{key}"
        if not self.sizes:
            return -1 if sync(self.store.exists(full)) else None
        try:
            return int(sync(self.store.getsize(full)))
        except FileNotFoundError:
            return None


def file_size(group_dir: str | os.PathLike[str]) -> Callable[[str], int | None]:
    """``key -> bytes``: the size of the file of ``key`` (relative to the group; a stat),
    None when there is none."""
    return _FileSize(os.fspath(group_dir))


def store_size(store: Any, prefix: str = "") -> Callable[[str], int | None]:
    """``key -> bytes`` through a zarr store (remote, or a wrapper), keys under ``prefix``;
    None when there is none, -1 from a store that cannot size an object without reading it."""
    return _StoreSize(store, prefix)


@dataclass(frozen=True)
class _Level:
    path: str
    written: dict[str, int]  # key -> bytes written
    shape: tuple[int, ...]
    grid: tuple[int, ...]  # the stored object's shape: the shard, or the chunk when unsharded
    encode: Callable[[tuple[int, ...]], str]


class ChunkGuard:
    """Refuses a read whose stored objects are missing, or not the size written, although
    the inventory lists them (a missing or emptied shard reads as the fill value: blank).

    Args:
        where: the store, as error messages name it.
        inventory: the group's :func:`parse_inventory`, or ``None`` (nothing is checked).
        arrays: ``(name, zarr array)`` of each level, in level order.
        size: ``key -> bytes or None`` for keys relative to the group (:func:`file_size`,
            :func:`store_size`).
        fix: what the error tells the user to do.

    Keys found whole are remembered, so each is stat-ed once per guard (per
    reader); keys the inventory does not list were never written (all fill
    value) and read as fill by design.
    """

    def __init__(
        self,
        where: str,
        inventory: Inventory | None,
        arrays: Sequence[tuple[str, Any]],
        size: Callable[[str], int | None],
        *,
        fix: str = REPAIR,
    ) -> None:
        self.where = where
        self.fix = fix
        self._size = size
        self._confirmed: set[str] = set()
        self._levels: list[_Level | None] = []
        for name, arr in arrays:
            written = None if inventory is None else inventory.get(name)
            grid = getattr(
                getattr(getattr(arr, "metadata", None), "chunk_grid", None), "chunk_shape", None
            )
            if written is None or grid is None:
                self._levels.append(None)
                continue
            self._levels.append(
                _Level(
                    name,
                    {key: nbytes for key, (nbytes, _) in written.items()},
                    tuple(int(n) for n in arr.shape),
                    tuple(int(n) for n in grid),
                    arr.metadata.encode_chunk_key,
                )
            )

    @property
    def active(self) -> bool:
        """Whether any level has an inventory to check against."""
        return any(lv is not None for lv in self._levels)

    def check(self, level: int, selection: Sequence[slice | int]) -> None:
        """SlideError unless every listed object that ``selection`` of ``level`` touches is
        there with the bytes written."""
        lv = self._levels[level] if 0 <= level < len(self._levels) else None
        if lv is None:
            return
        spans: list[range] = []
        for sel, n, g in zip(selection, lv.shape, lv.grid, strict=True):
            if isinstance(sel, slice):
                start, stop, _ = sel.indices(n)
                if stop <= start:
                    return
                spans.append(range(start // g, (stop - 1) // g + 1))
            else:
                spans.append(range(int(sel) // g, int(sel) // g + 1))
        for index in itertools.product(*spans):
            key = lv.encode(index)
            if key not in lv.written:
                continue
            full = f"{lv.path}/{key}"
            if full in self._confirmed:
                continue
            got = self._size(full)
            if got is None:
                raise SlideError(
                    self.where,
                    f"chunk {full} of level {level} is missing, though the store's chunk "
                    "inventory lists it as written (it would read as blank background)",
                    self.fix,
                )
            if got != lv.written[key] and got != -1:  # -1: a store that cannot size it
                raise SlideError(
                    self.where,
                    f"chunk {full} of level {level} is {got} bytes, though the store's chunk "
                    f"inventory lists it as written with {lv.written[key]} (truncated or "
                    "overwritten; an empty one would read as blank background)",
                    self.fix,
                )
            self._confirmed.add(full)


@dataclass(frozen=True)
class StoreCheck:
    """What :func:`check_store` found in one store.

    ``problems``: one phrase each (empty: intact); ``inventoried``: whether the
    store has an inventory (without one only its metadata could be checked).
    """

    store: Path
    problems: tuple[str, ...]
    inventoried: bool
    checked: int = 0
    corrupt: bool = False

    @property
    def status(self) -> str:
        """``"ok"``, ``"bad"`` or ``"no-inventory"``."""
        if self.problems:
            return "bad"
        return "ok" if self.inventoried else "no-inventory"

    def what(self) -> str:
        """The first problem, and how many more there are."""
        more = len(self.problems) - 1
        return self.problems[0] + (f" (and {more} more)" if more > 0 else "")

    def line(self) -> str:
        """One line: the store, its first problem, what to do."""
        return problem(self.store, self.what(), _REWRITE if self.corrupt else REPAIR)


def _multiscale_groups(store: Path) -> list[tuple[str, Path]]:
    """``(key prefix, directory)`` of the image and of each label image listed under ``labels``."""
    from hyfi_imaging.io.zarr_store import _open_group_attrs

    groups = [("", store)]
    labels = _open_group_attrs(store / "labels") or {}
    listed = labels.get("ome", labels).get("labels", [])
    for name in listed if isinstance(listed, list) else []:
        groups.append((f"labels/{name}/", store / "labels" / str(name)))
    return groups


def check_store(store: str | os.PathLike[str], *, checksums: bool = False) -> StoreCheck:
    """Check a store against its inventories: metadata, every listed object (and its checksum).

    Reads JSON and stats files; with ``checksums`` every listed object is read
    and its size and CRC-32 compared with the record. Never raises for a bad
    store: every problem is a phrase of the result.
    """
    from hyfi_imaging.io.zarr_store import _open_group_attrs

    path = Path(store)
    if not path.is_dir():
        return StoreCheck(path, ("the store does not exist",), False)
    attrs = _open_group_attrs(path)
    if attrs is None:
        return StoreCheck(path, ("no readable group metadata (zarr.json)",), False)
    problems: list[str] = []
    inventoried, checked, corrupt = False, 0, False
    for prefix, group in _multiscale_groups(path):
        gattrs = attrs if group == path else _open_group_attrs(group)
        if gattrs is None:
            problems.append(f"{prefix}zarr.json: no readable group metadata")
            continue
        try:
            datasets = [
                str(d["path"]) for d in gattrs.get("ome", gattrs)["multiscales"][0]["datasets"]
            ]
        except (KeyError, IndexError, TypeError):
            problems.append(f"{prefix}zarr.json: not an OME-Zarr image (no multiscales)")
            continue
        for d in datasets:
            if not (group / d / "zarr.json").is_file():
                problems.append(f"{prefix}{d}/zarr.json: level {d} has no array metadata")
        try:
            inventory = parse_inventory(gattrs)
        except ValueError as err:
            problems.append(f"{prefix}zarr.json: {err}")
            continue
        if inventory is None:
            continue
        inventoried = True
        for array, keys in inventory.items():
            for key, (nbytes, crc) in keys.items():
                file = group / array / key
                checked += 1
                if not file.is_file():
                    problems.append(
                        f"chunk {prefix}{array}/{key} (level {array}) is missing, though the "
                        "chunk inventory lists it as written"
                    )
                elif (size := file.stat().st_size) != nbytes:
                    corrupt = True
                    problems.append(
                        f"chunk {prefix}{array}/{key} (level {array}) is {size} bytes, though "
                        f"the chunk inventory lists it as written with {nbytes}"
                    )
                elif checksums:
                    got = _crc32(file)
                    if got != (nbytes, crc):
                        corrupt = True
                        problems.append(
                            f"chunk {prefix}{array}/{key} (level {array}) fails its checksum "
                            f"({got[0]} bytes, crc32 {got[1]:08x}; written: {nbytes} bytes, "
                            f"crc32 {crc:08x})"
                        )
    return StoreCheck(path, tuple(problems), inventoried, checked, corrupt)


def find_stores(root: str | os.PathLike[str]) -> list[Path]:
    """Every store under ``root`` (``root`` itself if it is one), sorted.

    A store is a folder holding a ``zarr.json`` or named ``*.zarr``; stores are
    not searched inside, and hidden folders and the temporaries of unfinished
    writes (``*.zarr.tmp-*``) are passed over.
    """
    top = Path(root)
    if (top / "zarr.json").is_file():
        return [top]
    found: list[Path] = []
    for dirpath, dirs, _files in os.walk(top):
        keep = []
        for name in sorted(dirs):
            sub = Path(dirpath) / name
            if name.startswith(".") or ".zarr.tmp-" in name:
                continue
            if name.endswith(".zarr") or (sub / "zarr.json").is_file():
                found.append(sub)
            else:
                keep.append(name)
        dirs[:] = keep
    return sorted(found)
