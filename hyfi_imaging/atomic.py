"""Atomic file writes that keep the file mode a plain ``open()`` gives.

Why not :func:`tempfile.mkstemp`: it creates its file with mode 0600 on
purpose (a temporary file in a shared folder must not be readable by others),
and :func:`os.replace` keeps that mode, so every file written through it ended
up private while its neighbours were 0644 — a run's ``metrics.csv`` and
pictures could not be read by the colleagues who can read the rest of the run.
Here the temporary file is created with ``os.open(..., 0o666)`` like any file,
so the process's umask decides its mode, and a unique name (pid and random
token, ``O_EXCL``) keeps concurrent writers apart.

The file is written next to its target and moved over it, so a reader sees the
old file or the new one, never half of one, even if the writer is killed.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(
    path: str | os.PathLike[str], data: str | bytes, *, encoding: str = "utf-8"
) -> Path:
    """Write ``data`` (text or bytes) to ``path`` through a temporary file beside it; return ``path``.

    OK: ``write_atomic(run_dir / "metrics.csv", text)``; pictures render to
    bytes first (``fig.savefig(io.BytesIO())``). On any exception the temporary
    file is removed and ``path`` is untouched; an ``OSError`` names ``path`` (a full
    disk's ENOSPC from a write names no file otherwise). Text is written as given (no
    newline translation, which is what the csv module expects).
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    raw = data.encode(encoding) if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
        os.replace(tmp, target)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.filename is None and err.strerror:  # a write names no file: say which
            raise OSError(err.errno, err.strerror, str(target)) from err
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target
