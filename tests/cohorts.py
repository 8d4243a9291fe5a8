"""Preprocessed synthetic cohorts for tests: the one helper every such fixture calls.

Why one helper: a dozen test modules each wrote synthetic slides, ran hyfi-preprocess over
them and checked the summary in the same ten lines; the cohort a training test needs is
one call here (``tests/conftest.py``'s ``train_manifest`` shares the common one per session).
"""

from __future__ import annotations

from pathlib import Path

from hyfi_imaging.data.synthetic import write_synthetic_cohort
from hyfi_imaging.preprocess import PreprocessOptions, run_preprocess

__all__ = ["preprocessed_cohort"]


def preprocessed_cohort(
    root: Path,
    slides: int,
    options: PreprocessOptions,
    *,
    seed: int,
    size: tuple[int, int],
    lesions: int,
    annotations: bool = False,
) -> Path:
    """Write ``slides`` synthetic slides (``write_synthetic_cohort``, with their lesions'
    GeoJSON) under ``root/slides``, preprocess them with ``options`` into ``root/data`` (the
    lesions as label images when ``annotations``), and return the manifest; every slide
    must convert."""
    labels = write_synthetic_cohort(root / "slides", slides, seed=seed, size=size, lesions=lesions)
    summary = run_preprocess(
        [root / "slides"],
        root / "data",
        options,
        labels_path=labels,
        annotations=root / "slides" if annotations else None,
        progress=False,
        qc=False,
    )
    assert summary.manifest is not None and not summary.failed, summary.failed
    return summary.manifest
