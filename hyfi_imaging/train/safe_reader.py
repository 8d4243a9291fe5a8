"""Reading a distributed checkpoint without letting it run code.

Why: ``torch.distributed.checkpoint`` (DCP) keeps a checkpoint's index in a
``.metadata`` file that its :class:`~torch.distributed.checkpoint.FileSystemReader`
reads with a bare ``pickle.load``, so a crafted ``.metadata`` runs any code it
names the moment ``hyfi-predict`` or a resumed ``hyfi-train`` opens the
checkpoint. Checkpoints travel (downloaded runs, shared folders), so
:class:`SafeReader` reads them the way they are meant to be read:

* **Metadata** is unpickled by :class:`MetadataUnpickler`, which admits only
  the classes DCP's metadata holds (the dataclasses of
  ``torch.distributed.checkpoint.metadata``, ``_StorageInfo``, ``torch.Size``,
  dtypes, the layout and memory-format encodings, ``pathlib`` paths; listed
  from real checkpoints with ``pickletools``). Any other global is refused with
  one line naming the file and the global, before it is called. The result is
  then checked to be DCP metadata whose data files are plain names in the
  checkpoint directory (a ``relative_path`` of ``/etc/passwd`` or ``../x`` is
  refused too).
* **Tensors** in the ``__<rank>_<n>.distcp`` data files are already read by
  DCP with ``torch.load(weights_only=True)``.
* **Non-tensor values** (``BytesStorageMetadata`` entries) are handed by DCP's
  default planner to ``torch.load(weights_only=False)``; crafted metadata can
  declare any key to be one. :class:`SafeReader` loads those bytes with
  ``weights_only=True`` first and gives the planner a fresh serialisation of
  the result, so only plain data ever reaches the full unpickler.

Use it wherever a checkpoint is loaded::

    dcp.load(state, storage_reader=SafeReader(path))

Error (one line, a :class:`UnsafeCheckpointError`)::

    runs/x/checkpoints/step_00000010/.metadata: refers to posix.system, which DCP
    checkpoint metadata never holds (loading it could run code); ...
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Mapping
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from hyfi_imaging.errors import ConfigError, HyfiError
from hyfi_imaging.paths import safe_id

__all__ = ["MetadataUnpickler", "SafeReader", "UnsafeCheckpointError"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"

#: Globals a DCP ``.metadata`` pickle may name (module -> names). Calling any of
#: them with any arguments only builds a value: no file, process or import is touched.
_ALLOWED: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    # torch.layout pickles as _get_layout("torch.strided"): a lookup in a fixed table.
    "torch.serialization": frozenset({"_get_layout"}),
    # StorageMeta.checkpoint_id is the path the checkpoint was saved to.
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "pathlib._local": frozenset(
        {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}
    ),
    # torch.Size and every dtype (torch.float32, torch.bfloat16, torch.float8_e4m3fn ...);
    # taken from the module's namespace so no lazy attribute is triggered.
    "torch": frozenset(
        {"Size"} | {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
    ),
}

_FIX = (
    "load only checkpoints written by your own runs; if this one is yours, its "
    "files were altered: restore it from a backup or train again"
)


class UnsafeCheckpointError(HyfiError, pickle.UnpicklingError):
    """A checkpoint file names code to run or files outside the checkpoint; nothing was run.

    Also a :class:`pickle.UnpicklingError`, so code that treats unreadable
    checkpoints as damaged (and tries an older one) treats this one alike.
    """

    collective = True

    def __reduce__(self) -> tuple[Any, ...]:
        # DCP gathers each rank's exception across ranks by pickling it; the
        # default reduce would call __init__ with the formatted line alone.
        return (type(self), (self.where, self.what, self.fix))


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals DCP's metadata holds (see the module)."""

    def __init__(self, file: IO[bytes], where: object) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            self.where,
            f"refers to {module}.{name}, which DCP checkpoint metadata never holds "
            "(loading it could run code)",
            _FIX,
        )


def _check_metadata(metadata: object, where: object) -> Metadata:
    """``metadata`` when it is DCP metadata whose data files are plain names; else refused."""
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            where, f"holds a {type(metadata).__name__}, not DCP checkpoint metadata", _FIX
        )
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        raise UnsafeCheckpointError(where, "its storage index is not a mapping", _FIX)
    for info in storage.values():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str):
            raise UnsafeCheckpointError(
                where, f"its storage index holds a {type(info).__name__}", _FIX
            )
        # Data files lie in the checkpoint directory itself (__0_0.distcp): a
        # path here would read any file on the machine as tensor data.
        try:
            safe_id(info.relative_path, where=where, what="data file")
        except ConfigError as err:
            raise UnsafeCheckpointError(where, err.what, _FIX) from None
    return metadata


def _unsafe_global(err: Exception) -> str:
    """The global torch's weights-only unpickler refused, from its message (or the message)."""
    text = str(err)
    found = re.search(r"(?:Unsupported global|GLOBAL)\W+(?:GLOBAL\s+)?([\w.]+)", text)
    return found.group(1) if found else text.strip().splitlines()[0][:160]


class _PlainBytes:
    """A load planner seen through a filter: non-tensor values arrive as plain data only.

    Everything but :meth:`load_bytes` is the wrapped planner's own.
    """

    def __init__(self, planner: LoadPlanner, reader: SafeReader) -> None:
        self._planner = planner
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            plain = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise self._reader.refuse(
                self._reader.path,
                f"the value of {read_item.dest_index.fqn!r} refers to {_unsafe_global(err)}, "
                "which a checkpoint of plain values never holds (loading it could run code)",
            ) from None
        # Re-serialised by us from plain values: whatever the planner unpickles is that.
        fresh = io.BytesIO()
        torch.save(plain, fresh)
        fresh.seek(0)
        self._planner.load_bytes(read_item, fresh)


class SafeReader(FileSystemReader):
    """A :class:`~torch.distributed.checkpoint.FileSystemReader` that never runs checkpoint code.

    Args:
        path: the checkpoint directory (the one holding ``.metadata``).

    Raises (inside ``dcp.load``, which wraps it: DCP turns a failed metadata
    read into an ``AssertionError`` quoting it, inside a ``CheckpointException``):
        UnsafeCheckpointError: ``.metadata`` names a global outside DCP's
            metadata classes, is not DCP metadata, or points at data files
            outside the checkpoint; or a non-tensor value names a global that
            ``torch.load(weights_only=True)`` refuses.

    Attributes:
        refused: the first :class:`UnsafeCheckpointError` this reader raised
            (None while it raised none), so that a caller can report that
            line rather than DCP's wrapping of it.
    """

    refused: UnsafeCheckpointError | None = None

    def refuse(self, where: object, what: str) -> UnsafeCheckpointError:
        """The error for ``what`` at ``where``, remembered in :attr:`refused` (first one wins)."""
        err = UnsafeCheckpointError(where, what, _FIX)
        if self.refused is None:
            self.refused = err
        return err

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, unpickled by :class:`MetadataUnpickler` and checked."""
        # Same file and same load_id stamping as FileSystemReader.read_metadata, whose
        # only difference is the unrestricted pickle.load.
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _check_metadata(
                    MetadataUnpickler(cast(IO[bytes], stream), path).load(), path
                )
            except UnsafeCheckpointError as err:
                raise self.refuse(err.where, err.what) from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        cast(StorageMeta, metadata.storage_meta).load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the plan's items; non-tensor values go through ``weights_only`` first."""
        return super().read_data(plan, cast(LoadPlanner, _PlainBytes(planner, self)))
