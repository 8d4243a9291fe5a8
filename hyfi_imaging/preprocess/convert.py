"""One slide in, one training-ready OME-Zarr image out.

The steps are the ones a pathologist would do by hand: find the tissue on a
thumbnail, crop to it with a margin, bring it to the training resolution, and
place it on a fixed-size canvas. What makes this module more than a script:

* **Provenance.** ``source_box`` (level-0 source pixels) and ``placement``
  (canvas pixels) are stored with the image, so any prediction on the canvas maps
  back onto the slide: canvas ``(py + u, px + v)`` is source
  ``(sy + u * sh / ph, sx + v * sw / pw)``.
* **Bounded memory.** The canvas is never held whole (a 65536² canvas is
  12.9 GB): the store writer asks a
  :class:`~hyfi_imaging.preprocess.canvas.CanvasRenderer` for one shard at a
  time, read from the finest pyramid level that is not coarser than the
  target. Memory is a few shards plus one render tile, whatever ``--size`` is.
* **Disk space.** Before a slide is written, the free space is checked
  against :func:`estimate_store_bytes` (uncompressed pyramid / an assumed
  zstd ratio), so a full disk is a one-line failure, not a half-written store.
* **Atomic, resumable output.** The store is written under a temporary name and
  renamed into place; an existing store is only replaced once the new one is
  complete. A store counts as done only when its recorded parameters and
  source fingerprint equal the current ones.
* **Images as they are.** The store keeps the slide's pixel type and channels
  (16-bit fluorescence stays 16-bit, a 40-channel multiplex image keeps its 40
  named channels); tissue is found by the rule for its kind of image
  (:mod:`~hyfi_imaging.preprocess.tissue`), or on the channel ``--tissue``
  names, or not at all (``--tissue none``: the whole image is the crop).
* **Annotations.** With ``--annotations DIR`` the slide's annotation file
  (ASAP XML or GeoJSON, :mod:`~hyfi_imaging.io.annotations`) is parsed before
  anything is written (a malformed file fails the slide at no cost), moved
  onto the canvas by the crop plan's own transform and rasterized shard by
  shard (:mod:`~hyfi_imaging.preprocess.rasterize`) into the store's
  ``labels/annotations`` (:mod:`~hyfi_imaging.io.labels`). The file and its
  fingerprint are recorded, so a changed annotation file redoes the store.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from hyfi_imaging.errors import ConfigError, HyfiError, SlideError, problem
from hyfi_imaging.io import open_slide, thumbnail
from hyfi_imaging.io.base import Downsample, SlideReader, level_for
from hyfi_imaging.io.budget import check_need, default_memory_budget
from hyfi_imaging.io.inventory import check_store
from hyfi_imaging.io.labels import open_labels
from hyfi_imaging.io.pixels import is_rgb
from hyfi_imaging.io.zarr_store import (
    ZarrReader,
    level_shapes,
    read_hyfi_attrs,
    shard_side,
    write_ome_zarr,
)
from hyfi_imaging.paths import under
from hyfi_imaging.preprocess.annotate import (
    annotation_record,
    labelled_polygons,
    write_annotations,
)
from hyfi_imaging.preprocess.canvas import CanvasRenderer, CropPlan
from hyfi_imaging.preprocess.tissue import (
    Tissue,
    crop_margin,
    find_tissue,
    lost_signal_warning,
    tissue_box,
)

if TYPE_CHECKING:
    from hyfi_imaging.preprocess.qc import QcChannels

__all__ = [
    "ASSUMED_COMPRESSION",
    "STORE_FORMAT",
    "ConvertResult",
    "CropPlan",
    "PreprocessOptions",
    "annotation_record",
    "check_disk_space",
    "check_shard_memory",
    "convert_slide",
    "estimate_store_bytes",
    "free_bytes",
    "is_done",
    "plan_crop",
    "source_fingerprint",
    "store_path",
]

FitPolicy = Literal["fit", "crop"]
_TMP_MARK = ".tmp-"

#: Assumed zstd compression ratio of a store, for the disk-space check: an assumption,
#: not a measurement on real slides (none are at hand). Lossless coding of H&E tissue
#: pixels typically gains 1.5-2.5x and white glass more than 50x, and a canvas is rarely
#: all tissue, so 2 errs towards needing more space. (The synthetic slides compress
#: about 13x: their texture is smoother than tissue, so they are no guide.)
ASSUMED_COMPRESSION = 2.0

#: The store's pixel format, recorded with the options: 2 keeps the source's dtype and
#: channels. Stores of format 1 (squashed to 8-bit RGB) are not "done" and are converted
#: again on a resumed run, rather than mixing two pixel formats in one manifest.
STORE_FORMAT = 2


@dataclass(frozen=True)
class PreprocessOptions:
    """Everything that determines the output of a slide (recorded in its metadata).

    Exactly one of ``mpp`` (resample to this resolution) or ``level`` (take a
    pyramid level as it is) is used; with neither, level 0 is used.
    ``tissue``: ``"auto"`` (the rule for the image's kind), ``"none"`` (no
    detection: the whole image), or a channel index or name that intensity
    images are thresholded on (RGB images keep the bright-field rule).
    ``annotation_classes``: ``None`` when annotations are not asked for, else
    the class name -> label mapping (``(name, label)`` pairs, names
    casefolded) that every slide's annotation file is rasterized with.
    ``memory_budget``: bytes one read (or one shard being written) may take
    (:mod:`hyfi_imaging.io.budget`; ``None``: the default); it decides whether
    a slide is refused, not what is written, so it is not recorded.
    """

    mpp: float | None = None
    level: int | None = None
    size: tuple[int, int] = (8192, 8192)
    fit: FitPolicy = "fit"
    margin_um: float = 100.0
    mpp_override: float | None = None
    thumbnail_size: int = 1024
    chunk: int = 512
    shard: int = 4096
    pyramid_levels: int = 3
    tissue: str = "auto"
    annotation_classes: tuple[tuple[str, int], ...] | None = None
    memory_budget: int | None = None

    def record(self) -> dict[str, Any]:
        """The JSON-able form stored under ``hyfi.params``.

        ``tissue`` and ``annotation_classes`` are left out at their defaults
        (stores written before they existed stay done); ``store_format`` is
        :data:`STORE_FORMAT`, so a store of an older pixel format is redone.
        """
        d = asdict(self)
        del d["memory_budget"]
        d["size"] = list(self.size)
        if self.tissue == "auto":
            del d["tissue"]
        if self.annotation_classes is None:
            del d["annotation_classes"]
        else:
            d["annotation_classes"] = dict(self.annotation_classes)
        d["store_format"] = STORE_FORMAT
        return d


@dataclass(frozen=True)
class ConvertResult:
    """What happened to one slide (a row of the manifest, before labels)."""

    slide_id: str
    source: str
    store: str
    status: Literal["ok", "skipped", "failed"]
    height: int = 0
    width: int = 0
    mpp: float | None = None
    error: str = ""
    qc: str = ""
    megapixels: float = 0.0
    #: What ``--fit fit`` shrank the asked resolution by (1: as asked; :class:`CropPlan`).
    fit_scale: float = 1.0
    #: The crop left signal out (:func:`~hyfi_imaging.preprocess.tissue.lost_signal_warning`).
    tissue_warning: str = ""


def store_path(out_dir: Path, slide_id: str) -> Path:
    """Where the store of ``slide_id`` lives (refused unless inside ``out_dir``)."""
    return under(out_dir, f"{slide_id}.zarr")


def source_fingerprint(path: Path) -> dict[str, Any]:
    """Size and modification time of the source: a changed file is converted again."""
    st = path.stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def is_done(
    store: Path, source: Path, options: PreprocessOptions, annotation: Path | None = None
) -> bool:
    """True when ``store`` is a finished conversion of ``source`` with ``options``.

    With annotations asked for (``options.annotation_classes``), the recorded
    annotation file (or its absence) and its fingerprint must equal
    ``annotation``'s too. Every shard the store's chunk inventories list must
    still exist (a stat each, :func:`~hyfi_imaging.io.inventory.check_store`):
    a store that lost a shard is converted again, which is what the readers'
    error tells the user to do. (Checksums are not re-read here: that is
    ``hyfi-preprocess --verify``.)
    """
    from hyfi_imaging import __version__

    attrs = read_hyfi_attrs(store)
    if not attrs:
        return False
    try:
        same_source = attrs.get("fingerprint") == source_fingerprint(source)
        if options.annotation_classes is not None:
            same_source = same_source and attrs.get("annotations") == annotation_record(annotation)
    except OSError:
        return False
    return (
        same_source
        and attrs.get("params") == options.record()
        and attrs.get("version") == __version__
        and attrs.get("source") == str(source.resolve())
        and check_store(store).status != "bad"
    )


def check_not_anothers(final: Path, source: Path) -> None:
    """Refuse to replace a store converted from another file that still exists: a later
    batch with the same file name (``batch2/x.tif`` after ``batch1/x.tif``) replaced it,
    and the first slide was gone from the folder without a word. A store whose file moved
    away is replaced (the same slide, found elsewhere)."""
    other = (read_hyfi_attrs(final) or {}).get("source") if final.exists() else None
    if isinstance(other, str) and other != str(source.resolve()) and Path(other).exists():
        raise ConfigError(
            source,
            f"its slide id {final.name.removesuffix('.zarr')!r} is taken in {final.parent} by "
            f"another file, {other} ({final.name})",
            f"rename one of the files (or delete {final} to replace that slide)",
        )


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies in it (links resolved)."""
    real, top = os.path.realpath(path), os.path.realpath(folder)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def _resolution(reader: SlideReader, options: PreprocessOptions) -> tuple[float, int, float | None]:
    """Output pixels per level-0 pixel, the level to read from, and the output mpp."""
    where = reader.path
    if options.mpp is not None:
        if reader.mpp is None:
            raise SlideError(
                where,
                "the slide records no microscope resolution (no mpp in vendor metadata, and no "
                "TIFF resolution of 0.001-100 µm/px: 72 dpi is a screen's)",
                "pass --mpp-override MICRONS_PER_PIXEL, or --level N to use a pyramid level as it is",
            )
        scale = reader.mpp / options.mpp
        return scale, level_for(reader.level_downsamples, 1.0 / scale), options.mpp
    level = options.level or 0
    if level >= reader.level_count:
        raise SlideError(
            where,
            f"level {level} requested but the slide has {reader.level_count} levels",
            f"use --level between 0 and {reader.level_count - 1}",
        )
    dy, dx = reader.level_downsamples[level]
    ds = (dy + dx) / 2  # one output resolution: exact where the level is a 2**k grid (dy == dx)
    return 1.0 / ds, level, None if reader.mpp is None else reader.mpp * ds


def tissue_channel(reader: SlideReader, tissue: str) -> int | None:
    """The channel index ``--tissue`` names for ``reader`` (``None`` for auto/none/RGB).

    Raises SlideError naming the image's channels when it names none of them.
    """
    if tissue in ("auto", "none") or is_rgb(reader.channel_names):
        return None
    if tissue in reader.channel_names:
        return reader.channel_names.index(tissue)
    if tissue.isdigit() and int(tissue) < reader.channels:
        return int(tissue)
    raise SlideError(
        reader.path,
        f"--tissue {tissue!r} names no channel of this image "
        f"(channels: {', '.join(reader.channel_names)})",
        "give a channel index or name, or --tissue auto",
    )


def plan_crop(
    reader: SlideReader, options: PreprocessOptions
) -> tuple[CropPlan, Tissue, Downsample]:
    """Find the tissue and decide the source box, canvas placement and read level.

    Returns the plan, the tissue found (its mask for the QC picture, its
    signal to check the crop against) and the thumbnail's ``(dy, dx)`` downsample.
    """
    thumb, thumb_ds = thumbnail(reader, options.thumbnail_size)
    rgb = is_rgb(reader.channel_names)
    if options.tissue == "none":
        everything = np.ones(thumb.shape[1:], dtype=bool)
        tissue = Tissue(everything, np.zeros_like(everything), "none")
    else:
        tissue = find_tissue(thumb, rgb=rgb, channel=tissue_channel(reader, options.tissue))
    scale, level, mpp = _resolution(reader, options)
    h0, w0 = reader.level_dimensions[0]
    margin = crop_margin(options.margin_um, reader.mpp, thumb_ds)
    box = (
        (0, 0, h0, w0)
        if options.tissue == "none"
        else tissue_box(tissue.mask, thumb_ds, (h0, w0), margin=margin)
    )
    if box is None:
        raise SlideError(
            reader.path,
            "no tissue found on the thumbnail (the slide looks blank)",
            "check the slide, or leave it out of the run"
            if rgb
            else "check the slide, name the channel that shows it (--tissue NAME), "
            "or keep the whole image (--tissue none)",
        )
    sy, sx, sh, sw = box
    canvas_h, canvas_w = options.size
    ph, pw = round(sh * scale), round(sw * scale)
    fit_scale = 1.0
    if ph > canvas_h or pw > canvas_w:
        if options.fit == "fit":
            shrink = min(canvas_h / ph, canvas_w / pw)
            scale *= shrink
            fit_scale = shrink
            if mpp is not None:
                mpp /= shrink
            level = level_for(reader.level_downsamples, 1.0 / scale)
            ph, pw = min(canvas_h, round(sh * scale)), min(canvas_w, round(sw * scale))
        else:  # centre-crop the tissue box to what the canvas holds at this resolution
            keep_h, keep_w = (
                min(sh, math.floor(canvas_h / scale)),
                min(sw, math.floor(canvas_w / scale)),
            )
            sy, sx = sy + (sh - keep_h) // 2, sx + (sw - keep_w) // 2
            sh, sw = keep_h, keep_w
            ph, pw = min(canvas_h, round(sh * scale)), min(canvas_w, round(sw * scale))
    factor = 1.0 / scale
    k = round(factor)
    if k > 1 and abs(factor - k) < 1e-9:
        # An integer reduction: snap the crop to multiples of k so every output pixel
        # averages exactly one k x k block of level-0 pixels (no fractional box weights,
        # and the same blocks whatever the tissue box), then keep it on the canvas. The end
        # stays within what the read level holds: a pyramid of floor(h / 2) drops an odd
        # last row, and a block past it would be glass inside the placement.
        lh, lw = reader.level_dimensions[level]
        ly, lx = reader.level_downsamples[level]
        y1 = min(-(-(sy + sh) // k) * k, math.floor(lh * ly + 1e-9) // k * k)
        x1 = min(-(-(sx + sw) // k) * k, math.floor(lw * lx + 1e-9) // k * k)
        sy, sx = sy // k * k, sx // k * k
        ph, pw = min(canvas_h, (y1 - sy) // k), min(canvas_w, (x1 - sx) // k)
        sh, sw = ph * k, pw * k
    ph, pw = max(ph, 1), max(pw, 1)
    placement = ((canvas_h - ph) // 2, (canvas_w - pw) // 2, ph, pw)
    return CropPlan((sy, sx, sh, sw), placement, level, mpp, box, fit_scale), tissue, thumb_ds


def estimate_store_bytes(options: PreprocessOptions, channels: int = 3, itemsize: int = 1) -> int:
    """Disk bytes one slide's store is expected to need (pyramid / ``ASSUMED_COMPRESSION``).

    Every level is counted uncompressed (``channels`` of ``itemsize`` bytes per
    pixel), then divided by the assumed zstd ratio; the QC picture and
    metadata are a few hundred kB and ignored.
    """
    h, w = options.size
    raw = sum(
        channels * itemsize * lh * lw
        for lh, lw in level_shapes(h, w, chunk=options.chunk, pyramid_levels=options.pyramid_levels)
    )
    return math.ceil(raw / ASSUMED_COMPRESSION)


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or would: its nearest existing parent)."""
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check_disk_space(
    out_dir: Path, options: PreprocessOptions, slides: int, channels: int = 3, itemsize: int = 1
) -> None:
    """Raise a one-line error when ``slides`` new stores will not fit into ``out_dir``."""
    need = slides * estimate_store_bytes(options, channels, itemsize)
    free = free_bytes(out_dir)
    if need > free:
        h, w = options.size
        raise ConfigError(
            out_dir,
            f"not enough free disk space: {slides} slide(s) on a {h}x{w} canvas need about "
            f"{_gb(need)} (uncompressed pyramid / {ASSUMED_COMPRESSION:g}, the assumed zstd "
            f"ratio), {_gb(free)} are free",
            "free some space, choose another --out, or a smaller --size",
        )


def check_shard_memory(reader: SlideReader, options: PreprocessOptions, budget: int) -> None:
    """Refuse (one line) a slide whose shards cannot be written within ``budget``.

    The writer holds one shard of the canvas at a time, in the slide's own
    channels: the renderer's canvas region, the resampled crop pasted into it
    and the encoder's copy, about three shards' bytes. A shard shrinks for
    pixels of many bytes, but never below one chunk, so a file that declares
    thousands of channels would need gigabytes per shard.
    """
    side = shard_side(options.shard, options.chunk, reader.channels, reader.dtype.itemsize)
    check_need(
        reader.path,
        f"writing one {side} x {side} shard of its {reader.channels} channels ({reader.dtype})",
        3 * reader.channels * reader.dtype.itemsize * side * side,
        budget,
    )


def _atomic_replace(tmp: Path, final: Path) -> None:
    """Move a finished ``tmp`` store to ``final``; an old ``final`` goes only afterwards."""
    trash: Path | None = None
    if final.exists():
        trash = final.with_name(f"{final.name}{_TMP_MARK}old-{uuid.uuid4().hex[:8]}")
        os.rename(final, trash)
    os.rename(tmp, final)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def remove_stale_temporaries(out_dir: Path) -> list[Path]:
    """Delete temporary stores a killed run left behind; returns what was removed."""
    removed = []
    for p in out_dir.glob(f"*.zarr{_TMP_MARK}*"):
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def _disk_full(err: BaseException) -> bool:
    """True when ``err`` or an exception it wraps (zarr re-raises) is ENOSPC."""
    seen: BaseException | None = err
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def convert_slide(
    source: Path,
    out_dir: Path,
    slide_id: str,
    options: PreprocessOptions,
    *,
    qc_dir: Path | None,
    qc_channels: QcChannels | None = None,
    annotation: Path | None = None,
) -> ConvertResult:
    """Convert one slide; never raises for a bad slide, returns a ``failed`` result instead.

    ``qc_channels`` chooses what the QC picture shows (default: see
    :class:`~hyfi_imaging.preprocess.qc.QcChannels`); the colours it gives
    replace the file's own in the store's ``omero`` metadata. With
    ``options.annotation_classes`` set, ``annotation`` (the slide's annotation
    file, or ``None``: an all-background mask) is rasterized into the store's
    ``labels/annotations``.
    """
    from hyfi_imaging import __version__
    from hyfi_imaging.preprocess.qc import QcChannels, write_slide_qc

    final = store_path(out_dir, slide_id)
    tmp = final.with_name(f"{final.name}{_TMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        if is_done(final, source, options, annotation):
            attrs = read_hyfi_attrs(final) or {}
            h, w = attrs.get("size", [0, 0])
            qc = under(qc_dir, f"{slide_id}.png") if qc_dir else None
            return ConvertResult(
                slide_id,
                str(source),
                str(final),
                "skipped",
                h,
                w,
                attrs.get("mpp"),
                qc=str(qc) if qc and qc.exists() else "",
                fit_scale=float(attrs.get("fit_scale", 1.0)),
                tissue_warning=str(attrs.get("tissue_warning") or ""),
            )
        check_not_anothers(final, source)
        budget = default_memory_budget() if options.memory_budget is None else options.memory_budget
        with open_slide(source, mpp_override=options.mpp_override, memory_budget=budget) as reader:
            shown = (qc_channels or QcChannels()).resolve(reader) if qc_dir is not None else None
            polygons = labelled_polygons(annotation, options)
            plan, tissue, mask_ds = plan_crop(reader, options)
            tissue_warning = lost_signal_warning(
                tissue.signal,
                mask_ds,
                tissue_box=plan.tissue_box,
                crop=plan.source_box,
                detect_on=options.tissue,
            )
            canvas_h, canvas_w = options.size
            canvas = CanvasRenderer(reader, plan, options.size)
            attrs = {
                "source": str(source.resolve()),
                "source_format": reader.format,
                "source_mpp": reader.mpp,
                "source_mpp_from": reader.mpp_source,
                "source_level": plan.read_level,
                "mpp": plan.mpp,
                "fit_scale": plan.fit_scale,
                "source_box": list(plan.source_box),
                "placement": list(plan.placement),
                "tissue_box": list(plan.tissue_box),
                "tissue_warning": tissue_warning or "",
                "size": [canvas_h, canvas_w],
                "background": reader.background,
                "slide_id": slide_id,
                "version": __version__,
                "params": options.record(),
                "fingerprint": source_fingerprint(source),
            }
            if polygons is not None:
                attrs["annotations"] = annotation_record(annotation)
            check_disk_space(out_dir, options, 1, reader.channels, reader.dtype.itemsize)
            check_shard_memory(reader, options, budget)
            write_ome_zarr(
                tmp,
                canvas,
                mpp=plan.mpp,
                hyfi_attrs=attrs,
                chunk=options.chunk,
                shard=options.shard,
                pyramid_levels=options.pyramid_levels,
                name=slide_id,
                channel_names=reader.channel_names,
                channel_colors=(qc_channels or QcChannels()).colors(reader),
                stats_box=plan.placement,
            )
            if polygons is not None:
                write_annotations(tmp, polygons, plan, options, annotation)
            qc_path = ""
            if qc_dir is not None:
                labels = open_labels(tmp) if polygons else None  # outline on the QC picture
                with ZarrReader(tmp) as written:
                    qc_path = str(
                        write_slide_qc(
                            under(qc_dir, f"{slide_id}.png"),
                            reader,
                            tissue.mask,
                            mask_ds,
                            plan,
                            written,
                            shown,
                            labels,
                        )
                    )
        _atomic_replace(tmp, final)
        return ConvertResult(
            slide_id,
            str(source),
            str(final),
            "ok",
            canvas_h,
            canvas_w,
            plan.mpp,
            qc=qc_path,
            megapixels=canvas_h * canvas_w / 1e6,
            fit_scale=plan.fit_scale,
            tissue_warning=tissue_warning or "",
        )
    except HyfiError as err:
        return ConvertResult(slide_id, str(source), "", "failed", error=str(err))
    except Exception as err:  # one bad slide must never stop the others
        what = f"{type(err).__name__}: {err}".replace("\n", " ")
        target = getattr(err, "filename", None)
        if _disk_full(err):
            error = problem(
                out_dir,
                f"the disk filled up while writing {slide_id} (nothing of it was kept)",
                "free some space and re-run the same command to resume",
            )
        elif (
            isinstance(err, OSError) and isinstance(target, str) and _inside(Path(target), out_dir)
        ):
            error = problem(  # the output's fault, not the slide's
                out_dir,
                f"cannot write {target} ({err.strerror or what})",
                "make the output folder writable (or choose another --out) and re-run",
            )
        else:
            error = (
                f"{source}: could not be converted ({what}); check the file, or report a bug "
                "with this line if the file opens in other tools."
            )
        return ConvertResult(slide_id, str(source), "", "failed", error=error)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
