"""Tissue detection finds the tissue in every stain, and says when a crop leaves some out.

Real files written with tifffile: a QPTIFF-like multiplex image (DAPI with a
dozen bright nuclear clusters and many dim nuclei, a faint autofluorescent
core in FITC and Cy3, dark background; 8- and 16-bit), a 16-bit grey TIFF
of cells with some alone near the edges (no µm/px), and bright-field RGB.
The expected boxes are computed from how the images were drawn. (The old
rule, Otsu between the 1st and 99.9th percentile, cut the QPTIFF's core to
its DAPI clusters and the 16-bit scan to its colony.)
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import tifffile

from hyfi_imaging.io import open_slide
from hyfi_imaging.preprocess import PreprocessOptions, read_manifest, run_preprocess
from hyfi_imaging.preprocess.convert import plan_crop
from hyfi_imaging.preprocess.tissue import (
    SIGNAL_OUTSIDE_SHARE,
    crop_margin,
    find_tissue,
    lost_signal_warning,
    signal_outside,
)

Box = tuple[int, int, int, int]


def _ellipse(
    hw: tuple[int, int], centre: tuple[float, float], radii: tuple[float, float]
) -> np.ndarray:
    y, x = np.ogrid[: hw[0], : hw[1]]
    return ((y - centre[0]) / radii[0]) ** 2 + ((x - centre[1]) / radii[1]) ** 2 <= 1


def _stamp(plane: np.ndarray, centres: list[tuple[int, int]], r: int, values: np.ndarray) -> None:
    """Discs of radius ``r`` at ``centres`` (y, x), each at least its value."""
    h, w = plane.shape
    for (cy, cx), v in zip(centres, values, strict=True):
        y0, y1, x0, x1 = max(0, cy - r), min(h, cy + r + 1), max(0, cx - r), min(w, cx + r + 1)
        yy, xx = np.ogrid[y0:y1, x0:x1]
        disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
        plane[y0:y1, x0:x1][disc] = np.maximum(plane[y0:y1, x0:x1][disc], v)


def _bbox(mask: np.ndarray) -> Box:
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    return int(rows[0]), int(cols[0]), int(rows[-1] + 1 - rows[0]), int(cols[-1] + 1 - cols[0])


def _grow(box: Box, margin: int, hw: tuple[int, int]) -> Box:
    """``box`` grown by ``margin`` on every side, clipped to an image of ``hw``."""
    y, x, h, w = box
    y0, x0 = max(0, y - margin), max(0, x - margin)
    return y0, x0, min(hw[0], y + h + margin) - y0, min(hw[1], x + w + margin) - x0


def _holds(box: Box, truth: Box, *, slack: int) -> None:
    """``box`` contains ``truth`` and exceeds it by at most ``slack`` pixels on each side."""
    (y, x, h, w), (ty, tx, th, tw) = box, truth
    assert y <= ty and x <= tx and y + h >= ty + th and x + w >= tx + tw, (box, truth)
    assert ty - y <= slack and tx - x <= slack, (box, truth)
    assert y + h - ty - th <= slack and x + w - tx - tw <= slack, (box, truth)


def _multiplex(
    dtype: type, *, hw: tuple[int, int] = (1200, 1500), nuclei_left_only: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Vectra-like DAPI/FITC/Cy3 image, its tissue core and its nuclei (masks).

    The core is faint in FITC (autofluorescence) and textured in Cy3; DAPI has
    1500 dim nuclei over it and a dozen clusters 40x brighter on its left half.
    """
    h, w = hw
    rng = np.random.default_rng(5)
    big = dtype == np.uint16
    back, noise, top = (300.0, 30.0, 65535) if big else (10.0, 3.0, 255)
    core = _ellipse(hw, (0.47 * h, 0.47 * w), (0.35 * h, 0.37 * w))
    image = rng.normal(back, noise, size=(3, h, w))
    image[1][core] += 250 if big else 12
    yy, xx = np.mgrid[:h, :w]
    image[2][core] += ((150 if big else 8) * (1 + np.sin(yy / 37) * np.cos(xx / 23)))[core]
    ys, xs = np.nonzero(core & (xx < 0.47 * w) if nuclei_left_only else core)
    pick = rng.choice(ys.size, 1500, replace=False)
    dapi = np.zeros(hw)
    dim = rng.uniform(*((800, 2500) if big else (25, 60)), size=1500)
    _stamp(dapi, list(zip(ys[pick], xs[pick], strict=True)), 2, dim)
    for c in rng.choice(np.flatnonzero(xs < 0.47 * w), 12, replace=False):
        spots = np.rint(rng.normal((ys[c], xs[c]), 14, size=(80, 2))).astype(int)
        inside = [(int(y), int(x)) for y, x in spots if 0 <= y < h and 0 <= x < w and core[y, x]]
        _stamp(dapi, inside, 4, np.full(len(inside), 30000 if big else 190))
    image[0] += dapi
    return np.clip(np.rint(image), 0, top).astype(dtype), core, dapi > 0


def _write_qptiff(path: Path, image: np.ndarray, mpp: float = 0.5) -> Path:
    """One page per channel with its PerkinElmer name, and resolution tags (µm/px)."""
    with tifffile.TiffWriter(path) as tif:
        for plane, name in zip(image, ("DAPI", "FITC", "Cy3"), strict=True):
            desc = (
                '<?xml version="1.0" encoding="utf-8"?><PerkinElmer-QPI-ImageDescription>'
                f"<ImageType>FullResolution</ImageType><Name>{name}</Name>"
                "</PerkinElmer-QPI-ImageDescription>"
            )
            tif.write(
                plane,
                tile=(256, 256),
                software="PerkinElmer-QPI",
                description=desc,
                resolution=(1e4 / mpp, 1e4 / mpp),
                resolutionunit="CENTIMETER",
                metadata=None,
            )
    return path


def _plan(path: Path, **options: object) -> tuple[Box, Box, str | None]:
    """The tissue box, the crop and the warning that hyfi-preprocess would use."""
    opts = PreprocessOptions(**{"size": (4096, 4096), **options})  # type: ignore[arg-type]
    with open_slide(path) as reader:
        plan, tissue, ds = plan_crop(reader, opts)
    warning = lost_signal_warning(
        tissue.signal, ds, tissue_box=plan.tissue_box, crop=plan.source_box, detect_on=opts.tissue
    )
    return plan.tissue_box, plan.source_box, warning


@pytest.mark.parametrize("dtype", [np.uint16, np.uint8])
@pytest.mark.parametrize("tissue", ["auto", "DAPI"])
def test_multiplex_box_holds_the_whole_core(tmp_path: Path, dtype: type, tissue: str) -> None:
    image, core, nuclei = _multiplex(dtype)
    path = _write_qptiff(tmp_path / "core.qptiff", image)
    box, crop, warning = _plan(path, tissue=tissue, margin_um=0.0)
    # What the channels used show: every nucleus on DAPI, and the core on all three. The
    # thumbnail is 1.46x smaller and smoothed: a few level-0 pixels of slack, no more (the
    # old rule's box on DAPI was (187, 165, 725, 515): two thirds of the core cut).
    shown = nuclei if tissue == "DAPI" else core | nuclei
    _holds(box, _bbox(shown), slack=6)
    assert crop == box and warning is None  # the core's rim beyond the nuclei: < 1 %
    # With the default 100 µm margin (200 px at 0.5 µm/px, clipped to the image) all of it.
    box = _plan(path, tissue=tissue)[0]
    _holds(box, _grow(_bbox(shown), 200, core.shape), slack=6)
    _holds(box, _bbox(core), slack=200 + 6)


def test_16bit_cells_near_the_edges_are_kept(tmp_path: Path) -> None:
    """A colony and single cells 30 px from each edge, no µm/px: every cell is in the box."""
    hw = (900, 1400)
    rng = np.random.default_rng(2)
    cells = np.zeros(hw)
    colony = np.rint(rng.normal((450, 700), (70, 110), size=(1500, 2))).astype(int)
    alone = [(30, 300), (31, 900), (869, 500), (870, 1100), (200, 30), (700, 31), (300, 1369)]
    centres = [(int(y), int(x)) for y, x in colony] + alone
    _stamp(cells, centres, 3, rng.uniform(2000, 6000, size=len(centres)))
    image = np.clip(np.rint(rng.normal(1000, 40, size=hw) + cells), 0, 65535).astype(np.uint16)
    tifffile.imwrite(tmp_path / "cells.tif", image, tile=(256, 256))
    box, _, warning = _plan(tmp_path / "cells.tif")
    with open_slide(tmp_path / "cells.tif") as reader:
        assert reader.mpp is None and reader.channels == 1
    # No µm/px: the margin is two thumbnail pixels (ceil(2 * 1.37) = 3 level-0 pixels).
    assert crop_margin(100.0, None, (1.37, 1.37)) == 3 and crop_margin(0.0, None, (1.37,) * 2) == 0
    _holds(box, _bbox(cells > 0), slack=3 + 5)
    assert warning is None


def _bright_field(fragment: int) -> tuple[np.ndarray, Box, Box]:
    """H&E-like RGB: a tissue disc and, far to its right, a detached square fragment."""
    hw = (1000, 1600)
    rng = np.random.default_rng(9)
    image = rng.normal(242, 2, size=(*hw, 3))
    disc = _ellipse(hw, (500, 400), (110, 110))
    image[disc] = rng.normal((205, 130, 180), 8, size=(int(disc.sum()), 3))
    image[480 : 480 + fragment, 1450 : 1450 + fragment] = (190, 110, 170)
    return (
        np.clip(np.rint(image), 0, 255).astype(np.uint8),
        _bbox(disc),
        (480, 1450, fragment, fragment),
    )


def _write_rgb(path: Path, image: np.ndarray, mpp: float = 0.5) -> Path:
    res = {"resolution": (1e4 / mpp, 1e4 / mpp), "resolutionunit": "CENTIMETER"}
    tifffile.imwrite(path, image, tile=(256, 256), photometric="rgb", **res)  # type: ignore[arg-type]
    return path


def test_a_dropped_fragment_is_warned_about_in_log_and_manifest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bright-field drops specks below 0.05 % of the thumbnail as dust; a real fragment that
    small, with more than 1 % of the tissue's area, is named in the log and the manifest."""
    image, disc, fragment = _bright_field(26)
    src = tmp_path / "slides"
    src.mkdir()
    _write_rgb(src / "frag.tif", image)
    _write_rgb(src / "clean.tif", _bright_field(0)[0])
    options = PreprocessOptions(mpp=4.0, size=(256, 256), margin_um=20.0)
    with caplog.at_level(logging.WARNING, logger="hyfi_imaging"):
        summary = run_preprocess([src], tmp_path / "out", options, progress=False, qc=False)
    assert not summary.failed
    rows = {r.slide_id: r for r in read_manifest(tmp_path / "out" / "manifest.csv")}
    assert rows["clean"].warning == ""
    warning = rows["frag"].warning
    assert "leaves signal out" in warning and "--tissue none" in warning
    # The share it names: the fragment's ~17x17 thumbnail pixels over the disc's ~70-pixel radius.
    share = float(warning.split("signal out: ")[1].split("%")[0]) / 100
    assert SIGNAL_OUTSIDE_SHARE < share < 0.03
    assert [r.getMessage() for r in caplog.records if "leaves signal out" in r.getMessage()] == [
        f"frag: {warning}"
    ]
    assert summary.warning_lines() == [f"frag: {warning}"]
    box, _, again = _plan(src / "frag.tif", mpp=4.0, size=(256, 256), margin_um=20.0)
    _holds(box, disc, slack=40 + 3)  # the disc, 40 px margin; not the fragment
    assert box[1] + box[3] < fragment[1] and again == warning
    # A resumed run keeps saying it.
    resumed = run_preprocess([src], tmp_path / "out", options, progress=False, qc=False)
    assert resumed.count("skipped") == 2 and resumed.warning_lines() == [f"frag: {warning}"]


def test_a_named_channel_that_misses_tissue_is_warned_about(tmp_path: Path) -> None:
    """Nuclei on the core's left half only: DAPI's box leaves FITC/Cy3's right half out."""
    image, core, nuclei = _multiplex(np.uint16, hw=(600, 750), nuclei_left_only=True)
    path = _write_qptiff(tmp_path / "half.qptiff", image)
    box, _, warning = _plan(path, tissue="DAPI", margin_um=0.0)
    _holds(box, _bbox(nuclei), slack=6)
    assert warning is not None and "--tissue DAPI detects on one channel" in warning
    assert "--tissue auto on every channel" in warning
    box, _, warning = _plan(path, tissue="auto", margin_um=0.0)
    _holds(box, _bbox(core | nuclei), slack=6)
    assert warning is None


def test_modality_follows_the_background() -> None:
    """A grey bright-field scan (glass bright) and fluorescence saved as RGB (dark frame)."""
    rng = np.random.default_rng(4)
    hw = (400, 500)
    tissue = _ellipse(hw, (180, 260), (90, 140))
    truth = _bbox(tissue)
    grey = rng.normal(240, 2, size=hw)
    grey[tissue] -= 40
    found = find_tissue(np.clip(grey, 0, 255).astype(np.uint8)[None], rgb=False)
    assert found.modality == "intensity"
    _holds(_bbox(found.mask), truth, slack=3)
    rgb = rng.normal(6, 2, size=(3, *hw))
    rgb[1][tissue] += 30  # green signal on black
    found = find_tissue(np.clip(rgb, 0, 255).astype(np.uint8), rgb=True)
    assert found.modality == "intensity"
    _holds(_bbox(found.mask), truth, slack=3)


@pytest.mark.parametrize("seed", range(3))
def test_noise_alone_is_no_tissue(seed: int) -> None:
    """Gaussian and Poisson backgrounds of thumbnail size, 8- and 16-bit: nothing found."""
    rng = np.random.default_rng(seed)
    shape = (1, 820, 1024)
    for image in (
        np.clip(rng.normal(300, 30, size=shape), 0, None).astype(np.uint16),
        np.clip(rng.normal(10, 3, size=shape), 0, None).astype(np.uint8),
        rng.poisson(5, size=shape).astype(np.uint16),
        np.zeros(shape, dtype=np.uint8),
    ):
        found = find_tissue(image, rgb=False)
        assert not found.mask.any() and not found.signal.any()


def test_the_share_outside_and_who_cut_it() -> None:
    """Thumbnail pixels count by their centres; a --fit crop cut gets the --fit advice."""
    signal = np.zeros((10, 20), dtype=bool)
    signal[2:8, 2:12] = True  # 60 pixels
    signal[5, 18] = True  # 1 pixel away
    ds = (4.0, 4.0)
    assert signal_outside(signal, (8, 8, 24, 40), ds) == pytest.approx(1 / 60)
    assert signal_outside(signal, (0, 0, 40, 80), ds) == 0.0
    assert signal_outside(signal, (0, 76, 40, 4), ds) == float("inf")
    assert lost_signal_warning(signal, ds, tissue_box=(0, 0, 40, 80), crop=(0, 0, 40, 80)) is None
    cut = lost_signal_warning(signal, ds, tissue_box=(0, 0, 40, 80), crop=(8, 8, 24, 20))
    assert cut is not None and "--fit fit or a larger --size" in cut and "103.3%" in cut
    assert "--tissue none" in str(
        lost_signal_warning(signal, ds, tissue_box=(8, 8, 24, 40), crop=(8, 8, 24, 40))
    )
