"""One writer per output folder: an advisory lock held for a tool's lifetime.

Why ``flock``: the kernel drops the lock when its holder exits, however it
exits (a crash, SIGKILL, the OOM killer), so a stale lock file never blocks
the next run, and no pid file has to be trusted. Two runs into one folder
would share a run id, interleave ``metrics.csv`` and evict each other's
checkpoints (``hyfi-train``), or remove each other's temporary stores
(``hyfi-preprocess``); the second is refused in one line instead.
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import IO

from hyfi_imaging.errors import ConfigError

__all__ = ["hold_lock"]


def hold_lock(folder: Path, tool: str, fix: str) -> IO[str]:
    """Lock ``folder`` for ``tool`` until the returned file is closed (or the process ends).

    Raises :class:`ConfigError` naming the folder when another process holds it.
    """
    folder.mkdir(parents=True, exist_ok=True)
    lock = (folder / f".{tool}.lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise ConfigError(folder, f"another {tool} run is writing to this directory", fix) from None
    return lock
