"""Tile + halo read: our OME-Zarr against the source slide via OpenSlide and tifffile.

Why this benchmark: in spatial training every rank reads its own tile plus halo
from disk for every sample of every epoch, so the cost of that one read decides
whether the data path keeps up with the model. The question is whether
converting slides to OME-Zarr (512² zstd chunks, 4096² shards) pays off
against reading the source slide directly, and how many bytes a rank decodes
beyond the ones it needs (read amplification).

Setup: one synthetic JPEG-tiled (q95, 256² tiles) Aperio-style SVS of
``--size``² pixels; the OME-Zarr is written from the very pixels tifffile decodes
from that SVS, so every reader returns the same image (checked). The read is
the tile of rank (1, 1) of a 2x2 grid over the top-left ``2·tile``² of the
slide, plus a halo, so the whole box lies inside the slide (no padding):
halo 256 (box offset not chunk-aligned), halo 512 and halo 0 (aligned).

Each repeat reads every case once, in an order rotated per repeat so that no
contender always runs first or last; ratios are taken within a repeat (paired)
and the median over repeats is reported. Reads are warm-cache (the files sit
in the page cache after the first read), so this measures decoding, which is
what a training job with a local or cached store pays.

Read amplification = decoded bytes / needed bytes, where decoded bytes are the
inner chunks zarr actually fetched (counted with a store wrapper that maps each
byte range onto the shard index) times the uncompressed chunk size. It is also
given for ResNet's stem halo (13, 10), the halo a spatial ResNet really reads.

Exit status: 0 when measured (PASS / MISS lines report the targets), 1 with
``--strict`` and a missed target, 2 when a reader returns wrong pixels.

    python benchmarks/bench_read.py                 # 9216² slide, 4096² tile, 5 repeats
    python benchmarks/bench_read.py --quick         # small smoke run (< 30 s)
    python benchmarks/bench_read.py --repeats 9 --workdir /tmp/bench_read
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from hyfi_imaging.data.synthetic import write_synthetic_slide
from hyfi_imaging.data.tiles import Halo, read_window, tile_region
from hyfi_imaging.io.openslide_reader import OpenSlideReader
from hyfi_imaging.io.tiff_reader import TiffReader
from hyfi_imaging.io.zarr_store import ZarrReader, write_ome_zarr

__all__ = ["chunk_counting_store", "main"]

TARGET_OPENSLIDE_RATIO = 4.0  # OpenSlide time / zarr time, halo 256
TARGET_AMPLIFICATION = 1.15  # decoded / needed bytes, chunk-aligned tile and halo
CHUNK = 512
SHARD = 4096
HALOS = (256, 512, 0)
_EMPTY = 2**64 - 1  # shard index marker of a chunk that was never written


def _counting_store_class() -> type:
    """Build the store wrapper lazily: zarr starts its event loop on first use."""
    from zarr.abc.store import RangeByteRequest, SuffixByteRequest
    from zarr.storage import LocalStore, WrapperStore

    class _ChunkCountingStore(WrapperStore[LocalStore]):
        """Records which inner chunks of which shard the sharding codec fetched.

        A partial shard read is one suffix read of the shard index and one byte
        range per inner chunk; a shard read whole is one plain ``get``. Mapping
        the ranges onto the index (rather than counting requests) stays right
        if zarr ever coalesces neighbouring ranges.
        """

        def __init__(self, store: LocalStore, chunks_per_shard: int) -> None:
            super().__init__(store)
            self.index_bytes = chunks_per_shard * 16 + 4  # (offset, nbytes) uint64 + crc32c
            self.spans: dict[str, list[tuple[int, int]]] = {}
            self.fetched: set[tuple[str, int]] = set()

        def reset(self) -> None:
            self.fetched.clear()

        def _parse_index(self, key: str, raw: bytes) -> list[tuple[int, int]]:
            table = np.frombuffer(raw[: self.index_bytes - 4], dtype="<u8").reshape(-1, 2)
            spans = [(int(o), int(n)) for o, n in table if o != _EMPTY]
            self.spans[key] = spans
            return spans

        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            buf = await self._store.get(key, prototype, byte_range)
            if buf is None or key.endswith("zarr.json"):
                return buf
            if byte_range is None:  # whole shard: every chunk in it is decoded
                raw = buf.to_bytes()
                for offset, _ in self._parse_index(key, raw[-self.index_bytes :]):
                    self.fetched.add((key, offset))
            elif isinstance(byte_range, SuffixByteRequest):
                self._parse_index(key, buf.to_bytes())
            elif isinstance(byte_range, RangeByteRequest):
                for offset, nbytes in self.spans.get(key, []):
                    if byte_range.start <= offset and offset + nbytes <= byte_range.end:
                        self.fetched.add((key, offset))
            return buf

    return _ChunkCountingStore


def chunk_counting_store(path: Path, chunks_per_shard: int) -> Any:
    """A read-only zarr store over ``path`` that counts the inner chunks fetched."""
    from zarr.storage import LocalStore

    return _counting_store_class()(LocalStore(path, read_only=True), chunks_per_shard)


@dataclass
class Case:
    """One contender: a reader reading one box."""

    name: str
    halo: int
    box: tuple[int, int, int, int]
    read: Callable[[], np.ndarray]
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def _chunks_touched(start: int, length: int) -> int:
    return (start + length - 1) // CHUNK - start // CHUNK + 1


def build(workdir: Path, size: int) -> tuple[Path, Path, np.ndarray]:
    """Write the SVS and an OME-Zarr of the pixels tifffile decodes from it."""
    svs = workdir / "slide.svs"
    store = workdir / "slide.zarr"
    write_synthetic_slide(svs, seed=7, label=1, size=(size, size), tile=256, kind="aperio")
    with TiffReader(svs) as tif:
        image = tif.read_region(0, 0, 0, size, size)
    if store.exists():
        shutil.rmtree(store)
    write_ome_zarr(store, image, mpp=0.5, hyfi_attrs={}, chunk=CHUNK, shard=SHARD, pyramid_levels=1)
    return svs, store, image


def machine_load() -> str:
    """1-minute load average and CPU pressure: other work on the machine skews every time."""
    line = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    try:
        some = Path("/proc/pressure/cpu").read_text().split()[1]  # "avg10=12.34"
        line += f", CPU pressure {some.split('=')[1]}% (10 s)"
    except (OSError, IndexError):
        pass
    return line


def _median_ratio(num: Case, den: Case, *, cpu: bool = False) -> float:
    """Median over repeats of the paired ratio ``num / den`` (wall or CPU time)."""
    a, b = (num.cpu, den.cpu) if cpu else (num.wall, den.wall)
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 0 measured, 1 --strict and a target missed, 2 wrong result."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Example: python benchmarks/bench_read.py --repeats 5",
    )
    parser.add_argument("--size", type=int, default=9216, help="side of the synthetic slide (px)")
    parser.add_argument("--tile", type=int, default=4096, help="tile side; the grid is 2x2 tiles")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 2560² slide, 1024² tile, 3 repeats"
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep files here instead of a temporary directory",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.tile, args.repeats = 2560, 1024, 3
    if args.tile < CHUNK or args.tile % CHUNK:
        parser.error(f"--tile {args.tile}: give a multiple of {CHUNK} (at least {CHUNK})")
    if args.size < 2 * args.tile + max(HALOS):
        parser.error(
            f"--size {args.size}: give at least 2 x --tile + {max(HALOS)} = "
            f"{2 * args.tile + max(HALOS)}"
        )
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give a whole number >= 1")

    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_read-")
        workdir = Path(tmp.name)
    else:
        workdir = args.workdir
        workdir.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, workdir)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _run(args: argparse.Namespace, workdir: Path) -> int:
    import openslide
    import zarr

    t0 = time.perf_counter()
    svs, store, image = build(workdir, args.size)
    print(f"built {args.size}² JPEG q95 SVS + OME-Zarr in {time.perf_counter() - t0:.1f} s")

    level0 = zarr.open_array(store / "0", mode="r")
    assert level0.shards is not None, "the store was written without shards"
    chunks_per_shard = math.prod(s // c for s, c in zip(level0.shards, level0.chunks, strict=True))
    counting = chunk_counting_store(store, chunks_per_shard)
    zr = ZarrReader(store, store=counting)
    tr = TiffReader(svs)
    osr = OpenSlideReader(svs)
    raw = openslide.OpenSlide(str(svs))

    def raw_openslide(box: tuple[int, int, int, int]) -> np.ndarray:
        y, x, h, w = box
        return np.asarray(raw.read_region((x, y), 0, (w, h)))  # RGBA, (h, w, 4)

    cases: list[Case] = []
    grid_hw = (2 * args.tile, 2 * args.tile)
    for halo in HALOS:
        box = tile_region(grid_hw, (2, 2), (1, 1), halo=halo).read
        readers: list[tuple[str, Callable[[], np.ndarray]]] = [
            ("zarr", partial(read_window, zr, box)),
        ]
        if halo != 0:
            readers += [
                ("tifffile", partial(read_window, tr, box)),
                ("openslide", partial(read_window, osr, box)),
                ("openslide-raw", partial(raw_openslide, box)),
            ]
        cases += [Case(name, halo, box, fn) for name, fn in readers]

    # Correctness first (and warm-up): every reader returns the slide's pixels.
    for case in cases:
        y, x, h, w = case.box
        got = case.read()
        want = image[:, y : y + h, x : x + w]
        got = np.moveaxis(got[..., :3], -1, 0) if case.name == "openslide-raw" else got
        diff = int(np.abs(got.astype(np.int16) - want).max())
        exact = case.name in ("zarr", "tifffile")
        if (exact and diff) or diff > 2:
            print(f"ERROR: {case.name} halo {case.halo} differs from the source by {diff}")
            return 2

    load_before = machine_load()
    for r in range(args.repeats):
        k = r % len(cases)
        for case in cases[k:] + cases[:k]:
            w0, c0 = time.perf_counter(), time.process_time()
            case.read()
            case.wall.append(time.perf_counter() - w0)
            case.cpu.append(time.process_time() - c0)

    by = {(c.name, c.halo): c for c in cases}
    load_after = machine_load()
    print(
        f"\nbench_read: rank (1, 1) of a 2x2 grid of {grid_hw[0]}², tile {args.tile}², "
        f"slide {args.size}² (JPEG q95, 256² tiles); zarr {CHUNK}² chunks, {SHARD}² shards, zstd; "
        f"median of {args.repeats} alternated repeats, warm cache"
    )
    print(
        f"{'halo':>4} {'box':>10} {'reader':<14} {'ms/read':>8} {'cpu ms':>7} {'MP/s':>6} {'x zarr':>7} {'cpu x zarr':>10}"
    )
    for case in cases:
        ms = statistics.median(case.wall) * 1e3
        cpu = statistics.median(case.cpu) * 1e3
        mp = case.box[2] * case.box[3] / 1e6 / (ms / 1e3)
        ratio = _median_ratio(case, by[("zarr", case.halo)])
        cpu_ratio = _median_ratio(case, by[("zarr", case.halo)], cpu=True)
        print(
            f"{case.halo:>4} {f'{case.box[2]}x{case.box[3]}':>10} {case.name:<14} "
            f"{ms:>8.0f} {cpu:>7.0f} {mp:>6.0f} {ratio:>7.2f} {cpu_ratio:>10.2f}"
        )

    # Read amplification: one counted read per halo, plus ResNet's stem halo
    # (13 above/left, 10 below/right), the halo a spatial ResNet actually reads.
    chunk_bytes = math.prod(level0.chunks)
    print(f"\nread amplification (zarr; decoded = chunks fetched x {chunk_bytes} B)")
    print(
        f"{'halo':>5} {'box origin':>12} {'aligned':>7} {'chunks':>6} {'expected':>8} {'amplification':>13}"
    )
    amplification: dict[str, float] = {}
    halos: list[tuple[str, Halo]] = [(str(h), h) for h in HALOS] + [("13/10", (13, 10))]
    for label, spec in halos:
        y, x, h, w = tile_region(grid_hw, (2, 2), (1, 1), halo=spec).read
        counting.reset()
        read_window(zr, (y, x, h, w))
        fetched = len(counting.fetched)
        expected = _chunks_touched(y, h) * _chunks_touched(x, w)
        amplification[label] = fetched * chunk_bytes / (image.shape[0] * h * w)
        aligned = "yes" if y % CHUNK == 0 and x % CHUNK == 0 and h % CHUNK == 0 else "no"
        note = "" if fetched == expected else "  (!= expected)"
        print(
            f"{label:>5} {f'({y}, {x})':>12} {aligned:>7} {fetched:>6} {expected:>8} "
            f"{amplification[label]:>13.3f}{note}"
        )
    y, _, h, _ = by[("zarr", 256)].box
    per_axis = _chunks_touched(y, h) * CHUNK / h
    print(
        f"halo 256: the box starts mid-chunk ({y} = {y / CHUNK:g} chunks), so each axis decodes "
        f"{_chunks_touched(y, h)} chunks = {per_axis:.3f}x the pixels needed; area {per_axis**2:.3f}x"
    )

    ratio_os = _median_ratio(by[("openslide", 256)], by[("zarr", 256)])
    ratio_raw = _median_ratio(by[("openslide-raw", 256)], by[("zarr", 256)])
    ratio_tf = _median_ratio(by[("tifffile", 256)], by[("zarr", 256)])
    cpu_os = _median_ratio(by[("openslide", 256)], by[("zarr", 256)], cpu=True)
    cpu_raw = _median_ratio(by[("openslide-raw", 256)], by[("zarr", 256)], cpu=True)
    aligned_amp = max(amplification["512"], amplification["0"])
    checks = [
        (
            min(ratio_os, ratio_raw) >= TARGET_OPENSLIDE_RATIO,
            f"OpenSlide / zarr read time, halo 256: {ratio_os:.1f}x via OpenSlideReader, "
            f"{ratio_raw:.1f}x raw read_region (target >= {TARGET_OPENSLIDE_RATIO:g}x; "
            f"CPU time {cpu_os:.1f}x, {cpu_raw:.1f}x)",
        ),
        (
            aligned_amp <= TARGET_AMPLIFICATION,
            f"read amplification, chunk-aligned tile and halo (halo 512 and 0): "
            f"{aligned_amp:.3f} (target <= {TARGET_AMPLIFICATION})",
        ),
    ]
    print()
    for ok, line in checks:
        print(f"{'PASS' if ok else 'MISS'} {line}")
    print(f"INFO tifffile / zarr read time, halo 256: {ratio_tf:.2f}x (no target)")
    print(
        f"INFO read amplification, halo 256: {amplification['256']:.3f}; "
        f"ResNet stem halo (13, 10): {amplification['13/10']:.3f} (no target)"
    )
    print(f"INFO machine during the timed reads: {load_before} before, {load_after} after")
    tr.close()
    osr.close()
    raw.close()
    zr.close()
    return 1 if args.strict and not all(ok for ok, _ in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
