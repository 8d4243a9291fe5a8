"""Shared fixtures: small real synthetic slides of every kind, written once per session.

Slides are 1536 x 2048 with 256-px tiles, so they have 3 pyramid levels
(2048 -> 1024 -> 512) and reads cross tile borders. Lossless (zlib) slides
are compared pixel for pixel with :func:`render_synthetic`; the JPEG slide
is for tolerance tests. Fixtures are lazy: a test module that does not ask
for a slide does not pay for it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from hyfi_imaging.data.synthetic import SlideInfo, render_synthetic, write_synthetic_slide
from hyfi_imaging.io.zarr_store import downsample_2x

# The launcher (``tests/mpi/_launch.py``) for every test module, in whatever order they run.
sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))

SLIDE_SIZE = (1536, 2048)
SLIDE_SEED = 11


@dataclass(frozen=True)
class SyntheticSlides:
    """Paths and ground truth of the session's synthetic slides."""

    slides: dict[str, SlideInfo]
    levels: list[np.ndarray]  # expected (3, h, w) pixels per pyramid level (lossless slides)


def reference_pyramid(image_hwc: np.ndarray, n_levels: int) -> list[np.ndarray]:
    """The ``(C, h, w)`` levels a lossless synthetic slide must read back as."""
    levels = [np.ascontiguousarray(np.moveaxis(image_hwc, -1, 0))]
    while len(levels) < n_levels:
        levels.append(downsample_2x(levels[-1]))
    return levels


@pytest.fixture(scope="session")
def synthetic_slides(tmp_path_factory: pytest.TempPathFactory) -> SyntheticSlides:
    """One slide per kind (label 1, seed 11), keyed by a short name.

    Keys: ``aperio``, ``generic`` (TIFF resolution tags), ``generic-nompp``
    (no resolution), ``ome`` (SubIFD pyramid, mpp 0.25) — all zlib — and
    ``aperio-jpeg`` (JPEG quality 95).
    """
    root = tmp_path_factory.mktemp("synthetic")
    specs = {
        "aperio": ("aperio", 0.5, "zlib", "slide.svs"),
        "generic": ("generic-tiff", 0.5, "zlib", "slide.tiff"),
        "generic-nompp": ("generic-tiff", None, "zlib", "nompp.tiff"),
        "ome": ("ome-tiff", 0.25, "zlib", "slide.ome.tiff"),
        "aperio-jpeg": ("aperio", 0.5, "jpeg", "slide-jpeg.svs"),
    }
    slides = {
        key: write_synthetic_slide(
            root / name,
            seed=SLIDE_SEED,
            label=1,
            size=SLIDE_SIZE,
            mpp=mpp,
            kind=kind,
            compression=compression,
        )
        for key, (kind, mpp, compression, name) in specs.items()
    }
    image = render_synthetic(seed=SLIDE_SEED, label=1, size=SLIDE_SIZE).image
    return SyntheticSlides(slides, reference_pyramid(image, 3))


@pytest.fixture(scope="session")
def synthetic_cohort(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-slide Aperio JPEG cohort of 1024 x 1024; returns its ``labels.csv``."""
    from hyfi_imaging.data.synthetic import write_synthetic_cohort

    return write_synthetic_cohort(tmp_path_factory.mktemp("cohort"), 4, seed=5, size=(1024, 1024))


@pytest.fixture(scope="session")
def train_manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The training tests' cohort: 8 synthetic slides of 512², 4 lesions each, preprocessed at
    1 µm/px onto 192 x 160 (``tests/cohorts.py``); returns its manifest."""
    from cohorts import preprocessed_cohort

    from hyfi_imaging.preprocess import PreprocessOptions

    root = tmp_path_factory.mktemp("train_cohort")
    options = PreprocessOptions(mpp=1.0, size=(192, 160))
    return preprocessed_cohort(root, 8, options, seed=3, size=(512, 512), lesions=4)


@pytest.fixture(scope="module")
def single() -> Iterator[object]:
    """One process's ParallelContext (a 1x1 layout, one thread) for a module's tests; the
    process group is shut down after them unless it existed before."""
    import torch
    import torch.distributed as dist

    from hyfi_imaging.parallel.launch import init_parallel, shutdown
    from hyfi_imaging.parallel.layout import Layout

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    mine = not dist.is_initialized()
    yield init_parallel(Layout())
    torch.set_num_threads(threads)
    if mine:
        shutdown()
