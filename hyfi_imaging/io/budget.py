"""How much memory one read of an image may take, decided before anything is decoded.

Why: an image file says how large it is, and that is all a reader has before
decoding. An 8 MB TIFF can declare 1,000,000 x 1,000,000 pixels in a million
one-row strips (3 TB decoded), or the whole of it as one strip. Decoding such
a file runs the machine out of memory, or (one strip) is stopped only by the
kernel refusing the allocation. So every read is costed from the declared
sizes first -- the ``(C, h, w)`` region it returns and the strips or tiles
it must decode for it -- and refused in one line when the cost is over the
budget: the file, the declared size, the cost, the budget and what to do.

What a read costs (an estimate that errs high, not a measurement): twice the
region (the returned canvas and the decoded part copied into it) plus, for
each strip or tile decoded at once, twice its bytes (decoded, and copied).
zarr decodes up to ``async.concurrency`` (10) chunks at once.

The budget (:func:`default_memory_budget`) is a quarter of the memory this
process may still take (the machine's available memory, a cgroup limit or an
address-space limit, whichever is least), shared among the workers, and at
most :data:`MAX_DEFAULT_BUDGET`: no read hyfi-preprocess makes of a real slide
needs more than a few hundred MB (render reads of at most about 4096² pixels,
thumbnail strips of about 64 MB, strips and tiles of a few MB), so the cap
refuses only images whose smallest possible read is gigabytes.
``hyfi-preprocess --memory-budget`` sets it.
"""

from __future__ import annotations

import math
import os
import resource
from typing import TYPE_CHECKING

from hyfi_imaging.errors import SlideError

if TYPE_CHECKING:
    from hyfi_imaging.io.base import SlideReader

__all__ = [
    "CONCURRENT_CHUNKS",
    "MAX_DEFAULT_BUDGET",
    "MIN_BUDGET",
    "available_memory",
    "check_need",
    "check_read",
    "declared",
    "default_memory_budget",
    "format_bytes",
    "read_cost",
]

#: The default budget never exceeds this (see the module docstring).
MAX_DEFAULT_BUDGET = 4 << 30
#: Nor falls below this: a machine with less could not convert a slide anyway.
MIN_BUDGET = 256 << 20
#: Chunks a zarr read decodes at once (zarr's ``async.concurrency`` default).
CONCURRENT_CHUNKS = 10

FIX = (
    "convert the image to a tiled pyramid (e.g. vips tiffsave --tile --pyramid) or, if the "
    "file is genuine and this machine has the memory, raise --memory-budget"
)


def _read_int(path: str, key: str | None = None) -> int | None:
    """An integer from a /proc or /sys file (``key: value kB`` lines when ``key``), or None."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    if key is None:
        return int(text) if text.strip().isdigit() else None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == key:
            fields = value.split()
            return int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return None


def available_memory() -> int:
    """Bytes this process may still allocate: the least of what the machine, cgroup and rlimit allow."""
    limits = []
    avail = _read_int("/proc/meminfo", "MemAvailable")
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            avail = None
    if avail is not None:
        limits.append(avail)
    cg_max, cg_now = (
        _read_int("/sys/fs/cgroup/memory.max"),
        _read_int("/sys/fs/cgroup/memory.current"),
    )
    if cg_max is not None and cg_now is not None:
        limits.append(max(0, cg_max - cg_now))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        used = _read_int("/proc/self/status", "VmSize") or 0
        limits.append(max(0, soft - used))
    return min(limits) if limits else MAX_DEFAULT_BUDGET * 4


def default_memory_budget(workers: int = 1) -> int:
    """Bytes one read may take by default in each of ``workers`` processes (see the module)."""
    share = available_memory() // (4 * max(1, workers))
    return max(MIN_BUDGET, min(share, MAX_DEFAULT_BUDGET))


def format_bytes(n: float) -> str:
    """``3.0 TB``-style: decimal units, one decimal (the size users compare with ``df``, ``free``)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{math.ceil(n / 1e3)} kB"


def read_cost(channels: int, itemsize: int, h: int, w: int, decoded: int = 0) -> int:
    """Bytes a read of a ``(channels, h, w)`` region takes: twice the region, plus ``decoded``."""
    return 2 * channels * itemsize * h * w + decoded


def check_need(where: object, what: str, need: int, budget: int) -> None:
    """Raise a one-line SlideError when ``what`` (which needs ``need`` bytes) is over ``budget``."""
    if need > budget:
        raise SlideError(
            where,
            f"{what} needs about {format_bytes(need)} of memory, over the memory budget of "
            f"{format_bytes(budget)}",
            FIX,
        )


def declared(reader: SlideReader, level: int) -> str:
    """``level 0 (declared 1000000 x 1000000 px, 3 x uint8)``: a level as the file states it."""
    h, w = reader.level_dimensions[level]
    return f"level {level} (declared {h} x {w} px, {reader.channels} x {reader.dtype})"


def check_read(
    reader: SlideReader, level: int, h: int, w: int, budget: int, decoded: int = 0
) -> None:
    """Refuse a read of ``h x w`` pixels of ``level`` whose cost is over ``budget`` (one line)."""
    need = read_cost(reader.channels, reader.dtype.itemsize, h, w, decoded)
    check_need(reader.path, f"reading {h} x {w} px of {declared(reader, level)}", need, budget)
