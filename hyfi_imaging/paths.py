"""Ids that name files, and output paths that stay in their folder.

Why this module: slide and volume ids come from files a user (or anyone who
hands them a manifest) wrote, and hyfi-imaging turns them into file names
(``<out>/masks/<id>.zarr``, ``<out>/<id>.zarr``, ``qc/<id>.png``). An id like
``../../../x`` would then write a whole store outside ``--out``, and
``sub/dir/x`` would create folders. So an id is checked once, where it is read
(:func:`safe_id`: one plain file-name component), and every path built from
one is checked again where it is made (:func:`under`), so that a check
forgotten at some reader cannot turn into a write elsewhere.

OK::

    safe_id("tumor_001", where="manifest.csv:2")          # -> "tumor_001"
    under(Path("out/masks"), "tumor_001.zarr")            # -> out/masks/tumor_001.zarr

Error::

    safe_id("../../evil", where="manifest.csv:3")
    # ConfigError: manifest.csv:3: id '../../evil' is not a plain file name (it contains '/'), ...
"""

from __future__ import annotations

import os
from pathlib import Path

from hyfi_imaging.errors import ConfigError

__all__ = ["confined", "safe_id", "under"]

#: Characters an id may not contain: path separators (POSIX and Windows) and NUL.
_FORBIDDEN = {"/": "'/'", "\\": "'\\'", "\x00": "a NUL character"}


def _why_unsafe(value: str) -> str | None:
    """Why ``value`` is not one plain file-name component, or None when it is."""
    if not value:
        return "it is empty"
    if value in (".", ".."):
        return f"{value!r} names a folder, not a file"
    for char, name in _FORBIDDEN.items():
        if char in value:
            return f"it contains {name}"
    return None


def safe_id(value: str, *, where: object, what: str = "id") -> str:
    """``value`` itself when it is one plain file-name component; else a one-line ConfigError.

    Refused: empty, ``.`` or ``..``, or containing ``/``, ``\\`` or NUL.
    ``where`` names the file and row it was read from (``manifest.csv:3``);
    ``what`` names the column (``slide id``, ``volume id``, ``label image``).
    """
    why = _why_unsafe(value)
    if why is None:
        return value
    raise ConfigError(
        where,
        f"{what} {value!r} is not a plain file name ({why}), so it could name a file "
        "outside its folder",
        "rename it to a name without '/', '\\' or NUL (and not '.' or '..')",
    )


def under(folder: Path, name: str | Path) -> Path:
    """``folder / name``, refused (one-line ConfigError) unless it lies inside ``folder``.

    The test is on the normalised path (``..`` taken out), not on resolved
    symbolic links: a link the user put into ``folder`` (a folder of linked
    annotation files, a store on another disk) is theirs to follow, while a
    name can never climb out. The returned path is ``folder / name`` as given.
    """
    path = folder / name
    root = os.path.normpath(os.path.abspath(folder))
    if os.path.commonpath([root, os.path.normpath(os.path.abspath(path))]) != root:
        raise ConfigError(
            path,
            f"this path built from {str(name)!r} lies outside {folder}",
            "use ids that are plain names (no '/', '\\' or '..')",
        )
    return path


def confined(path: Path) -> Path:
    """``path`` itself, refused when it climbs (``..``) out of the folder it was built in.

    For writers handed a path already joined (``out / "masks" / f"{id}.zarr"``):
    the folder is ``path`` up to its first ``..`` after a named component, and
    the rest must stay inside it (:func:`under`). Leading ``..`` (an output
    folder given as ``../preds``) is the folder's own and allowed.
    """
    parts = path.parts
    named = next((i for i, p in enumerate(parts) if p != ".."), len(parts))
    climb = next((i for i in range(named, len(parts)) if parts[i] == ".."), None)
    if climb is None:
        return path
    under(Path(*parts[:climb]), Path(*parts[climb:]))
    return path
