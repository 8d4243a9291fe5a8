"""Synthetic whole-slide images whose label can only be seen at full resolution.

Why: to show that training on whole high-resolution images matters, the demo
and the tests need a data set where a downsampled image provably loses the
evidence. Real data cannot guarantee that; this generator does, by design:

* Tissue: a few smooth blobs on white glass, H&E-like pink/purple colours
  mixed by a low-frequency field, plus mild luminance noise. Tissue covers
  part of the slide only, so that cropping to tissue matters.
* Lesions (label 1): small patches (16-32 px at level 0) carrying a
  checkerboard of ±A around the local tissue colour, with square cells of
  ``lesion_cell`` px (default 4, period 8), in global level-0 coordinates.
  The pattern is separable, ``A·s(y)·s(x)`` with ``s`` a ±1 square wave of
  period ``2·cell``, so any ``2·cell`` consecutive samples sum to zero: area
  downsampling by ``2·cell`` (8x) or more cancels it inside the lesion,
  whatever the block alignment. Lesion masks are unions of ``2·cell``-aligned
  blocks, so a ``2·cell``-aligned area downsample of a positive slide equals
  that of its negative twin *exactly* (same seed, label 0). At 2x and 4x the
  pattern survives (a coarser checkerboard), so resolution matters gradually.
* Random streams for tissue and lesions are independent children of the
  seed, so label 1 is label 0 plus lesions, pixel for pixel.
* Ground truth: the renderer knows where it drew each lesion, so it returns
  each lesion's outline as a polygon (level-0 ``(y, x)``, on the ``2·cell``
  block grid, so it covers exactly the lesion's pixels), and a cohort writes
  them beside every positive slide as ``<slide id>.geojson`` (QuPath-style,
  class ``Tumor``), as CAMELYON16 ships XML for its tumour slides only:
  ``hyfi-preprocess --annotations`` then exercises the whole mask path.

Slides are pyramidal tiled TIFFs written with tifffile: ``"aperio"`` (SVS-like,
OpenSlide's aperio driver reports the MPP), ``"generic-tiff"`` (plain page
pyramid, TIFF resolution tags or none) and ``"ome-tiff"`` (SubIFD pyramid,
which only tifffile sees). JPEG quality defaults to 95 so the lesion texture
survives compression. Rendering is vectorised: fields are made at 1/16
resolution and upsampled with two small matrix products.
"""

from __future__ import annotations

import csv
import logging
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.io.openslide_reader import MPP_PLAUSIBLE
from hyfi_imaging.io.zarr_store import downsample_2x

log = logging.getLogger(__name__)
#: The files :func:`write_synthetic_cohort` writes besides ``labels.csv``.
COHORT_FILE = re.compile(r"synth_\d{3,}(\.svs|\.tiff|\.ome\.tiff|\.geojson)")

__all__ = [
    "KINDS",
    "Rendered",
    "SlideInfo",
    "lesion_pattern",
    "render_synthetic",
    "write_synthetic_cohort",
    "write_synthetic_slide",
]

#: Slide kinds and the file suffix each is written with.
KINDS = {"aperio": ".svs", "generic-tiff": ".tiff", "ome-tiff": ".ome.tiff"}

_GLASS = 247.0  # background level; with noise stays inside 240..255
_PINK = np.array([218.0, 150.0, 188.0], dtype=np.float32)  # eosin-rich stroma
_PURPLE = np.array([118.0, 76.0, 150.0], dtype=np.float32)  # haematoxylin-rich
_NOISE = 4  # uniform luminance noise in [-_NOISE, _NOISE]
_LESION_AMPLITUDE = 28  # kept below 255 - max(_PINK) - _NOISE: no clipping in lesions
_FIELD_STEP = 16  # level-0 pixels per low-resolution field pixel
_MIN_LEVEL_SIDE = 1024
# Lossless codecs at a fast level: noise makes high levels slow for little gain.
_FAST_LEVELS = {"zlib": {"level": 1}, "deflate": {"level": 1}, "zstd": {"level": 1}}


@dataclass(frozen=True)
class SlideInfo:
    """What was written: boxes are ``(y, x, h, w)`` in level-0 pixels."""

    path: Path
    label: int
    size: tuple[int, int]
    mpp: float | None
    kind: str
    level_dimensions: tuple[tuple[int, int], ...]
    lesion_boxes: tuple[tuple[int, int, int, int], ...]
    tissue_box: tuple[int, int, int, int]
    #: One outline per lesion, ``(N, 2)`` level-0 ``(y, x)`` vertices on pixel edges.
    lesion_polygons: tuple[np.ndarray, ...] = ()


class Rendered(NamedTuple):
    """A rendered level-0 image ``(H, W, 3)`` uint8 and its ground truth."""

    image: np.ndarray
    lesion_mask: np.ndarray
    lesion_boxes: tuple[tuple[int, int, int, int], ...]
    tissue_box: tuple[int, int, int, int]
    #: One outline per lesion: filled by the pixel-centre rule it gives ``lesion_mask``.
    lesion_polygons: tuple[np.ndarray, ...] = ()


def _outline(disk: np.ndarray, y0: int, x0: int, block: int) -> np.ndarray:
    """The outline of a row-convex block shape as ``(y, x)`` vertices on pixel edges.

    Down the right ends of the rows' runs, then up the left ends: exact for
    shapes whose rows are single runs that overlap their neighbours (lesion disks).
    """
    right, left = [], []
    for r, row in enumerate(disk):
        cols = np.nonzero(row)[0]
        if len(cols) == 0 or len(cols) != cols[-1] - cols[0] + 1:
            raise ValueError("lesion outline needs every row to be one run of blocks")
        top, bottom = y0 + r * block, y0 + (r + 1) * block
        c0, c1 = x0 + int(cols[0]) * block, x0 + (int(cols[-1]) + 1) * block
        right += [(top, c1), (bottom, c1)]
        left += [(top, c0), (bottom, c0)]
    return np.array(right + left[::-1], dtype=np.float64)


def _interp_matrix(n_out: int, n_in: int, step: float) -> np.ndarray:
    """Linear-interpolation matrix ``(n_out, n_in)`` for pixel centres ``step`` apart."""
    pos = np.clip((np.arange(n_out, dtype=np.float32) + 0.5) / step - 0.5, 0, n_in - 1)
    i0 = np.floor(pos).astype(np.int64)
    i1 = np.minimum(i0 + 1, n_in - 1)
    frac = pos - i0
    m = np.zeros((n_out, n_in), dtype=np.float32)
    rows = np.arange(n_out)
    np.add.at(m, (rows, i0), 1 - frac)
    np.add.at(m, (rows, i1), frac)
    return m


def _smooth_noise(rng: np.random.Generator, shape: tuple[int, int], sigma: float) -> np.ndarray:
    """Gaussian-blurred white noise scaled to zero mean, unit std."""
    from scipy.ndimage import gaussian_filter

    f = gaussian_filter(rng.standard_normal(shape).astype(np.float32), sigma, mode="wrap")
    return (f - f.mean()) / (f.std() + 1e-6)


def _tissue_fields(rng: np.random.Generator, lo: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Low-resolution tissue coverage field (>0 is tissue) and colour-mix field in [0, 1]."""
    hl, wl = lo
    yy, xx = np.meshgrid(
        np.linspace(0, 1, hl, dtype=np.float32),
        np.linspace(0, 1, wl, dtype=np.float32),
        indexing="ij",
    )
    blob = np.full(lo, -1.0, dtype=np.float32)
    for _ in range(int(rng.integers(1, 4))):
        cy, cx = rng.uniform(0.3, 0.7, 2)
        ry, rx = rng.uniform(0.15, 0.3, 2)
        blob = np.maximum(blob, 1 - ((yy - cy) / ry) ** 2 - ((xx - cx) / rx) ** 2)
    cover = np.maximum(blob, -1.0) + 0.35 * _smooth_noise(rng, lo, max(hl, wl) / 24)
    # Fade to glass near the slide edges, so the tissue box is a true crop.
    edge = np.minimum.reduce([yy, 1 - yy, xx, 1 - xx])
    cover = cover - 3.0 * np.clip((0.12 - edge) / 0.08, 0.0, 1.0)
    mix = 0.5 + 0.5 * np.tanh(_smooth_noise(rng, lo, 1.5) + 0.6 * _smooth_noise(rng, lo, 6))
    return cover.astype(np.float32), mix.astype(np.float32)


def lesion_pattern(y0: int, x0: int, h: int, w: int, cell: int) -> np.ndarray:
    """The ±1 checkerboard ``s(y)·s(x)`` over a level-0 window, cells of ``cell`` px."""
    sy = 1 - 2 * ((np.arange(y0, y0 + h) // cell) % 2)
    sx = 1 - 2 * ((np.arange(x0, x0 + w) // cell) % 2)
    return (sy[:, None] * sx[None, :]).astype(np.int16)


def _place_lesions(
    rng: np.random.Generator, inside: np.ndarray, n: int, block: int, size: tuple[int, int]
) -> list[tuple[int, int, np.ndarray]]:
    """Lesions as ``(by, bx, disk)`` in ``block``-aligned units, centred in solid tissue."""
    h, w = size
    # ``inside`` is at field resolution; map candidate centres to block units.
    cand = np.argwhere(inside)
    lesions: list[tuple[int, int, np.ndarray]] = []
    if len(cand) == 0:
        return lesions
    taken = np.zeros((-(-h // block), -(-w // block)), dtype=bool)
    for _ in range(50 * n):
        if len(lesions) == n:
            break
        d = int(rng.integers(2, 5))  # diameter in blocks: 16-32 px for block 8
        cy, cx = cand[int(rng.integers(len(cand)))]
        by = int((cy + 0.5) * _FIELD_STEP) // block - d // 2
        bx = int((cx + 0.5) * _FIELD_STEP) // block - d // 2
        if by < 0 or bx < 0 or (by + d) * block > h or (bx + d) * block > w:
            continue
        if taken[max(by - 2, 0) : by + d + 2, max(bx - 2, 0) : bx + d + 2].any():
            continue
        r = np.arange(d) - (d - 1) / 2
        disk = (r[:, None] ** 2 + r[None, :] ** 2) <= (d / 2) ** 2 + 0.25
        taken[by : by + d, bx : bx + d] = True
        lesions.append((by, bx, disk))
    return lesions


def check_lesion_room(
    lesions: int,
    size: tuple[int, int],
    lesion_cell: int = 4,
    *,
    options: tuple[str, str] = ("--size", "--lesions"),
) -> None:
    """Refuse more lesions than a ``size`` slide can hold, each covering 2x2 blocks of
    ``2 * lesion_cell`` px or more (50 tries per lesion of each of three erosions:
    ``--lesions 100000`` on a 256² slide ran for hours). ``options``: the size's and the
    count's option, named in the refusal (a count that is no option: "")."""
    block = 2 * lesion_cell
    room = (size[0] // block) * (size[1] // block) // 4
    if lesions > room:
        size_option, count_option = options
        raise ConfigError(
            count_option or size_option,
            f"{lesions} lesions cannot fit in a {size[0]}x{size[1]} slide (at most {room})",
            f"use a larger {size_option}" + (f" or fewer {count_option}" if count_option else ""),
        )


def render_synthetic(
    *,
    seed: int,
    label: int,
    size: tuple[int, int],
    lesions: int | None = None,
    lesion_cell: int = 4,
) -> Rendered:
    """Render a synthetic slide's level 0 as ``(H, W, 3)`` uint8.

    Args:
        seed: the same seed gives the same tissue for either label.
        label: 0 (tissue only) or 1 (tissue plus lesions).
        size: ``(h, w)`` of level 0.
        lesions: number of lesions (overrides the label's default of 3-6 for
            label 1, 0 for label 0); fewer are placed if the tissue has no room.
        lesion_cell: checkerboard cell side in px; the lesion vanishes under
            area downsampling by ``2 * lesion_cell`` or more.
    """
    h, w = size
    if h < 64 or w < 64:
        raise ValueError(f"synthetic slides need at least 64x64 pixels, got {size}")
    tissue_seq, noise_seq, lesion_seq = np.random.SeedSequence(seed).spawn(3)
    lo = (-(-h // _FIELD_STEP) + 1, -(-w // _FIELD_STEP) + 1)
    cover, mix = _tissue_fields(np.random.default_rng(tissue_seq), lo)
    ay = _interp_matrix(h, lo[0], _FIELD_STEP)
    ax = _interp_matrix(w, lo[1], _FIELD_STEP)
    # Soft tissue edge over ~16 px; alpha 1 is solid tissue.
    alpha = ay @ cover @ ax.T
    alpha *= 4.0
    alpha += 0.5
    np.clip(alpha, 0.0, 1.0, out=alpha)
    alpha_t = ay @ mix @ ax.T
    alpha_t *= alpha
    # Glass plus noise, plus 0.5 so that truncation to uint8 rounds; every
    # colour stays inside 0..255 by design (no clipping needed, checked in tests).
    noise = np.random.default_rng(noise_seq).integers(-_NOISE, _NOISE + 1, (h, w), dtype=np.int8)
    base = noise.astype(np.float32)
    base += _GLASS + 0.5
    image = np.empty((h, w, 3), dtype=np.uint8)
    plane = np.empty((h, w), dtype=np.float32)
    for c in range(3):
        # glass + alpha * (pink - glass) + alpha * t * (purple - pink) + noise
        np.multiply(alpha, _PINK[c] - _GLASS, out=plane)
        plane += base
        plane += alpha_t * (_PURPLE[c] - _PINK[c])
        image[..., c] = plane
    mask = alpha > 0.5
    ys, xs = np.nonzero(mask.any(axis=1))[0], np.nonzero(mask.any(axis=0))[0]
    tissue_box = (
        (int(ys[0]), int(xs[0]), int(ys[-1] - ys[0] + 1), int(xs[-1] - xs[0] + 1))
        if len(ys)
        else (0, 0, 0, 0)
    )

    lesion_mask = np.zeros((h, w), dtype=bool)
    lesion_rng = np.random.default_rng(lesion_seq)
    n = int(lesion_rng.integers(3, 7)) if lesions is None and label == 1 else int(lesions or 0)
    boxes: list[tuple[int, int, int, int]] = []
    outlines: list[np.ndarray] = []
    if n:
        block = 2 * lesion_cell
        check_lesion_room(n, size, lesion_cell)
        from scipy.ndimage import binary_erosion

        # Centres well inside the tissue (alpha is 1 where cover > 0.25), 48 px from
        # its edge, or closer on small slides; never on the soft edge, where the
        # pattern would clip against the glass and change the local mean.
        placed: list[tuple[int, int, np.ndarray]] = []
        for erosion in (3, 2, 1):
            solid = binary_erosion(cover > 0.25, iterations=erosion)
            attempt = _place_lesions(lesion_rng, solid, n, block, size)
            placed = attempt if len(attempt) > len(placed) else placed
            if len(placed) == n:
                break
        if not placed:
            raise ConfigError(
                f"seed {seed}", f"no room for lesions in a {h}x{w} slide", "use a larger --size"
            )
        if lesions is not None and len(placed) < n:  # asked for: say what was drawn instead
            log.warning(
                "seed %d: room for %d of the %d lesions asked in a %dx%d slide (its outlines "
                "list them); use a larger --size for more",
                seed, len(placed), n, h, w,
            )  # fmt: skip
        for by, bx, disk in placed:
            y0, x0 = by * block, bx * block
            lh, lw = disk.shape[0] * block, disk.shape[1] * block
            m = np.repeat(np.repeat(disk, block, 0), block, 1)
            pattern = _LESION_AMPLITUDE * lesion_pattern(y0, x0, lh, lw, lesion_cell) * m
            window = image[y0 : y0 + lh, x0 : x0 + lw]
            window[:] = np.clip(window + pattern[..., None], 0, 255).astype(np.uint8)
            lesion_mask[y0 : y0 + lh, x0 : x0 + lw] |= m
            boxes.append((y0, x0, lh, lw))
            outlines.append(_outline(disk, y0, x0, block))
    return Rendered(image, lesion_mask, tuple(boxes), tissue_box, tuple(outlines))


def _pyramid(image: np.ndarray) -> list[np.ndarray]:
    """Level 0 and 2x area-averaged levels until the longest side is below 1024."""
    levels = [image]
    while max(levels[-1].shape[:2]) >= _MIN_LEVEL_SIDE and min(levels[-1].shape[:2]) >= 2:
        chw = np.moveaxis(levels[-1], -1, 0)
        levels.append(np.ascontiguousarray(np.moveaxis(downsample_2x(chw), 0, -1)))
    return levels


def write_synthetic_slide(
    path: str | os.PathLike[str],
    *,
    seed: int,
    label: int,
    size: tuple[int, int] = (4096, 4096),
    mpp: float | None = 0.5,
    tile: int = 256,
    kind: str = "aperio",
    compression: str = "jpeg",
    quality: int = 95,
    lesions: int | None = None,
) -> SlideInfo:
    """Write one synthetic pyramidal tiled TIFF slide.

    Args:
        path: output file (overwritten).
        seed, label, size, lesions: see :func:`render_synthetic`.
        mpp: microns per level-0 pixel written into the metadata; ``None``
            writes none (``"generic-tiff"`` only: no resolution tags).
        tile: TIFF tile side (a multiple of 16).
        kind: ``"aperio"``, ``"generic-tiff"`` or ``"ome-tiff"``.
        compression: ``"jpeg"`` (lossy, ``quality``) or a lossless codec such
            as ``"zlib"``.
        quality: JPEG quality.

    Returns:
        What was written, including lesion and tissue boxes in level-0 pixels.
    """
    import tifffile

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    if mpp is None and kind != "generic-tiff":
        raise ValueError(f"kind {kind!r} always records an mpp; pass mpp or use generic-tiff")
    rendered = render_synthetic(seed=seed, label=label, size=size, lesions=lesions)
    levels = _pyramid(rendered.image)
    h, w = size
    common: dict[str, Any] = {
        "photometric": "rgb",
        "tile": (tile, tile),
        "compression": compression,
        "compressionargs": {"level": quality}
        if compression == "jpeg"
        else _FAST_LEVELS.get(compression.lower()),
        "software": "hyfi-imaging synthetic",
        "datetime": False,  # no timestamp: same seed, same bytes
        "maxworkers": 1,
    }
    out = Path(path)
    if kind == "aperio":
        assert mpp is not None
        # Aperio layout: baseline, a stripped thumbnail, then the tiled levels;
        # OpenSlide files non-tiled pages as associated images.
        thumb = levels[-1]
        with tifffile.TiffWriter(out, bigtiff=False) as tif:
            for i, level in enumerate(levels):
                lh, lw = level.shape[:2]
                desc = f"Aperio Image Library vHyFi\r\n{w}x{h} ({tile}x{tile}) {compression.upper()}/RGB"
                if i == 0:
                    desc += f"|AppMag = {10.0 / mpp:g}|MPP = {mpp:g}|Filename = {out.stem}"
                else:
                    desc += f" -> {lw}x{lh} D={2**i}"
                tif.write(level, description=desc, metadata=None, **common)
                if i == 0:
                    thumb_desc = f"Aperio Image Library vHyFi\r\n{w}x{h} -> {thumb.shape[1]}x{thumb.shape[0]}"
                    tif.write(
                        thumb, description=thumb_desc, metadata=None, **{**common, "tile": None}
                    )
    elif kind == "generic-tiff":
        res: dict[str, Any] = {}
        if mpp is not None:
            res = {"resolution": (1e4 / mpp, 1e4 / mpp), "resolutionunit": "CENTIMETER"}
        with tifffile.TiffWriter(out, bigtiff=False) as tif:
            for i, level in enumerate(levels):
                # NewSubfileType "reduced resolution" marks pyramid levels for OpenSlide.
                tif.write(level, subfiletype=1 if i else 0, metadata=None, **res, **common)
    else:
        assert mpp is not None
        meta: dict[str, Any] = {
            # A seeded UUID: tifffile's default (uuid1) would break byte-identity.
            "UUID": str(uuid.uuid5(uuid.NAMESPACE_URL, f"hyfi-synthetic/{seed}/{label}/{h}x{w}")),
            "axes": "YXS",
            "PhysicalSizeX": mpp,
            "PhysicalSizeXUnit": "µm",
            "PhysicalSizeY": mpp,
            "PhysicalSizeYUnit": "µm",
        }
        with tifffile.TiffWriter(out, bigtiff=False, ome=True) as tif:
            tif.write(levels[0], subifds=len(levels) - 1, metadata=meta, **common)
            for level in levels[1:]:
                tif.write(level, subfiletype=1, metadata=None, **common)
    return SlideInfo(
        path=out,
        label=int(label),
        size=(h, w),
        mpp=mpp,
        kind=kind,
        level_dimensions=tuple((int(lv.shape[0]), int(lv.shape[1])) for lv in levels),
        lesion_boxes=rendered.lesion_boxes,
        tissue_box=rendered.tissue_box,
        lesion_polygons=rendered.lesion_polygons,
    )


def write_synthetic_cohort(
    out_dir: str | os.PathLike[str],
    n_slides: int,
    *,
    seed: int,
    size: tuple[int, int] = (4096, 4096),
    positive_fraction: float = 0.5,
    kind: str = "aperio",
    mpp: float = 0.5,
    compression: str = "jpeg",
    lesions: int | None = None,
    progress: bool = False,
    annotations: bool = True,
) -> Path:
    """Write ``n_slides`` slides ``synth_000<ext>``, ... and ``labels.csv`` in ``out_dir``.

    Exactly ``round(n_slides * positive_fraction)`` slides are positive, in a
    seeded random order; slide ``i`` uses seed ``seed * 100003 + i``. The same
    arguments give byte-identical files. Returns the labels CSV path (columns
    ``slide_id,label``; ``slide_id`` is the file name without its suffix).
    ``lesions`` fixes the number of lesions per positive slide (default: 3-6; 0 only
    where ``positive_fraction`` is 0: a positive slide without lesions is mislabelled).
    ``mpp`` must lie within the pixel sizes the readers believe (``MPP_PLAUSIBLE``), or
    the slides would read back without a resolution (ConfigError before any file).
    ``progress`` shows a progress bar on stderr. ``annotations`` writes each
    positive slide's lesion outlines as ``<slide id>.geojson`` beside it
    (negatives get none, as in CAMELYON16), for ``hyfi-preprocess --annotations``.
    An earlier cohort's slides and outlines in ``out_dir`` that this one does not write are
    removed (logged): a slide ``labels.csv`` no longer lists, or a now negative slide's old
    outlines, which ``--annotations`` would have read as its lesions.
    """
    from tqdm import tqdm

    from hyfi_imaging.io.annotations import write_geojson

    if n_slides < 1:
        raise ValueError(f"n_slides must be >= 1, got {n_slides}")
    if not 0.0 <= positive_fraction <= 1.0:
        raise ValueError(f"positive_fraction must be in [0, 1], got {positive_fraction}")
    if lesions == 0 and positive_fraction > 0:  # positives identical to their negative twins
        raise ConfigError(
            "--lesions",
            f"0 lesions per positive slide, while --positive-fraction {positive_fraction:g} "
            "labels slides 1 that would carry no lesion",
            "pass --lesions 1 or more, or --positive-fraction 0 for a cohort of negatives",
        )
    if not MPP_PLAUSIBLE[0] <= mpp <= MPP_PLAUSIBLE[1]:  # the readers would not believe it
        raise ConfigError(
            "--mpp",
            f"{mpp:g} µm/px is outside the pixel sizes the slide readers believe "
            f"({MPP_PLAUSIBLE[0]:g} to {MPP_PLAUSIBLE[1]:g} µm/px)",
            "pass a microscope's pixel size, e.g. 0.25 or 0.5",
        )
    if lesions:
        check_lesion_room(lesions, size)  # before any file is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_pos = round(n_slides * positive_fraction)
    labels = np.zeros(n_slides, dtype=int)
    labels[:n_pos] = 1
    np.random.default_rng(seed).shuffle(labels)
    rows = []
    written = {"labels.csv"}
    bar = tqdm(total=n_slides, desc="synthetic slides", unit="slide", disable=not progress)
    for i, label in enumerate(labels):
        slide_id = f"synth_{i:03d}"
        written.add(f"{slide_id}{KINDS[kind]}")
        info = write_synthetic_slide(
            out / f"{slide_id}{KINDS[kind]}",
            seed=seed * 100003 + i,
            label=int(label),
            size=size,
            mpp=mpp,
            kind=kind,
            compression=compression,
            lesions=lesions if label else 0,  # negatives never carry lesions
        )
        if annotations and info.lesion_polygons:
            write_geojson(out / f"{slide_id}.geojson", [[p] for p in info.lesion_polygons])
            written.add(f"{slide_id}.geojson")
        rows.append((slide_id, int(label)))
        bar.update()
    bar.close()
    csv_path = out / "labels.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["slide_id", "label"])
        writer.writerows(rows)
    stale = sorted(
        p for p in out.iterdir() if COHORT_FILE.fullmatch(p.name) and p.name not in written
    )
    for path in stale:
        path.unlink()
    if stale:
        log.warning(
            "removed %d file(s) of an earlier cohort in %s that this one does not write: %s",
            len(stale), out, ", ".join(p.name for p in stale[:6]) + (" ..." if len(stale) > 6 else ""),
        )  # fmt: skip
    return csv_path
