"""The synthetic slide generator: content, the lesion design, files and the CLI."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import SLIDE_SEED, SLIDE_SIZE, SyntheticSlides
from scipy.ndimage import uniform_filter

from hyfi_imaging.cli.synth import main as synth_main
from hyfi_imaging.data.synthetic import (
    render_synthetic,
    write_synthetic_cohort,
    write_synthetic_slide,
)
from hyfi_imaging.io import open_slide


def high_pass_energy(image: np.ndarray) -> np.ndarray:
    """Per-pixel energy of ``image - box3x3(image)``, averaged over channels; ``(C, H, W)``."""
    f = image.astype(np.float32)
    return ((f - uniform_filter(f, size=(1, 3, 3), mode="reflect")) ** 2).mean(0)


def area_downsample(image: np.ndarray, k: int) -> np.ndarray:
    """``k x k`` block means of ``(C, H, W)`` (H, W multiples of k)."""
    c, h, w = image.shape
    return image.astype(np.float64).reshape(c, h // k, k, w // k, k).mean((2, 4))


def _windows(mask: np.ndarray, size: int, n: int, seed: int) -> list[tuple[int, int]]:
    """Up to ``n`` random ``size``-px windows lying wholly where ``mask`` is true."""
    inside = uniform_filter(mask.astype(np.float32), size) > 0.999
    ys, xs = np.nonzero(inside[size // 2 : -size, size // 2 : -size])
    pick = np.random.default_rng(seed).choice(len(ys), min(n, len(ys)), replace=False)
    return [(int(ys[i]), int(xs[i])) for i in pick]


@pytest.fixture(scope="module")
def pair() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Label 1 and its label-0 twin (same seed) as ``(C, H, W)``, lesion and tissue masks."""
    one = render_synthetic(seed=3, label=1, size=(1024, 1536))
    zero = render_synthetic(seed=3, label=0, size=(1024, 1536))
    tissue = (one.image.mean(-1) < 225) & ~_dilate(one.lesion_mask, 16)
    return np.moveaxis(one.image, -1, 0), np.moveaxis(zero.image, -1, 0), one.lesion_mask, tissue


def _dilate(mask: np.ndarray, r: int) -> np.ndarray:
    return uniform_filter(mask.astype(np.float32), 2 * r + 1) > 0


def test_render_is_deterministic_and_label_only_adds_lesions(
    pair: tuple[np.ndarray, ...],
) -> None:
    one, zero, lesion, _ = pair
    again = render_synthetic(seed=3, label=1, size=(1024, 1536))
    np.testing.assert_array_equal(np.moveaxis(again.image, -1, 0), one)
    assert not np.array_equal(
        render_synthetic(seed=4, label=1, size=(1024, 1536)).image, again.image
    )
    differs = (one != zero).any(0)
    assert differs.any() and not (differs & ~lesion).any()


def test_slide_content_tissue_glass_and_lesions() -> None:
    for seed in range(4):
        r = render_synthetic(seed=seed, label=1, size=(2048, 2048))
        grey = r.image.mean(-1)
        glass = grey > 235
        assert 0.05 < 1 - glass.mean() < 0.8  # tissue covers part of the slide, not all
        neutral = (r.image[..., 0] == r.image[..., 1]) & (r.image[..., 1] == r.image[..., 2])
        assert neutral.mean() > 0.2 and r.image[neutral].min() >= 240  # white glass
        ty, tx, th, tw = r.tissue_box
        assert th * tw < 2048 * 2048 * 0.9  # cropping to tissue matters
        assert 3 <= len(r.lesion_boxes) <= 6
        for y, x, h, w in r.lesion_boxes:
            assert 16 <= h <= 32 and h == w and y % 8 == 0 and x % 8 == 0
            assert ty <= y and y + h <= ty + th and tx <= x and x + w <= tx + tw
            ring = r.image[y - 16 : y + h + 16, x - 16 : x + w + 16].mean(-1)
            assert ring.max() < 235  # lesions sit inside solid tissue, away from glass
        assert render_synthetic(seed=seed, label=0, size=(512, 512)).lesion_boxes == ()
    assert len(render_synthetic(seed=0, label=0, size=(2048, 2048), lesions=2).lesion_boxes) == 2


def test_lesions_detectable_at_full_resolution(pair: tuple[np.ndarray, ...]) -> None:
    one, _, lesion, tissue = pair
    energy = high_pass_energy(one)
    lesion_energy = [energy[lesion & _box(lesion.shape, b)].mean() for b in _boxes(lesion)]
    tissue_energy = [energy[y : y + 16, x : x + 16].mean() for y, x in _windows(tissue, 16, 300, 0)]
    # Every lesion stands out from every tissue window by a wide margin.
    assert min(lesion_energy) > 10 * max(tissue_energy)


def test_lesions_vanish_after_8x_area_downsampling(pair: tuple[np.ndarray, ...]) -> None:
    one, zero, lesion, tissue = pair
    # Exact by design: an 8x (and any 2*cell-aligned) area mean of a positive slide
    # equals that of its negative twin.
    np.testing.assert_array_equal(area_downsample(one, 8), area_downsample(zero, 8))
    # Within one slide: lesion pixels against nearby tissue at 1/8 resolution.
    small = area_downsample(one, 8)
    lesion8 = area_downsample(lesion[None], 8)[0] > 0.99
    ring8 = area_downsample((_dilate(lesion, 24) & ~_dilate(lesion, 8))[None], 8)[0] > 0.99
    noise = small[:, area_downsample(tissue[None], 8)[0] > 0.99].std()
    diff = np.abs(small[:, lesion8].mean(1) - small[:, ring8].mean(1))
    assert (diff < 0.2 * noise).all()
    energy8 = high_pass_energy(small)
    assert energy8[lesion8].mean() < 2 * energy8[ring8].mean() + 1
    # At 2x the lesions are still there: resolution matters gradually.
    assert np.abs(area_downsample(one, 2) - area_downsample(zero, 2)).max() > 10


def _boxes(lesion: np.ndarray) -> list[tuple[slice, slice]]:
    from scipy.ndimage import find_objects, label

    return [b for b in find_objects(label(lesion)[0]) if b is not None]


def _box(shape: tuple[int, ...], b: tuple[slice, slice]) -> np.ndarray:
    out = np.zeros(shape, dtype=bool)
    out[b] = True
    return out


def test_lesions_survive_jpeg(synthetic_slides: SyntheticSlides) -> None:
    info = synthetic_slides.slides["aperio-jpeg"]
    truth = render_synthetic(seed=SLIDE_SEED, label=1, size=SLIDE_SIZE)
    with open_slide(info.path) as reader:
        image = reader.read_region(0, 0, 0, *SLIDE_SIZE)
    energy = high_pass_energy(image)
    lesion_energy = [energy[y : y + h, x : x + w].mean() for y, x, h, w in info.lesion_boxes]
    tissue = (truth.image.mean(-1) < 225) & ~_dilate(truth.lesion_mask, 16)
    tissue_energy = [energy[y : y + 16, x : x + 16].mean() for y, x in _windows(tissue, 16, 300, 1)]
    assert min(lesion_energy) > 5 * max(tissue_energy)
    small = area_downsample(image[:, :1536, :2048], 8)
    expected = area_downsample(np.moveaxis(truth.image, -1, 0), 8)
    assert np.abs(small - expected).mean() < 1.0


def test_slide_info_and_levels(synthetic_slides: SyntheticSlides) -> None:
    info = synthetic_slides.slides["aperio"]
    truth = render_synthetic(seed=SLIDE_SEED, label=1, size=SLIDE_SIZE)
    assert (info.label, info.size, info.mpp, info.kind) == (1, SLIDE_SIZE, 0.5, "aperio")
    assert info.level_dimensions == ((1536, 2048), (768, 1024), (384, 512))
    assert info.lesion_boxes == truth.lesion_boxes and info.tissue_box == truth.tissue_box
    big = write_synthetic_slide(
        synthetic_slides.slides["aperio"].path.with_name("big.tiff"),
        seed=0,
        label=0,
        size=(4096, 1100),
        kind="generic-tiff",
    )
    # Halve until the longest side is below 1024.
    assert [d[0] for d in big.level_dimensions] == [4096, 2048, 1024, 512]
    with pytest.raises(ValueError, match="kind"):
        write_synthetic_slide(big.path, seed=0, label=0, kind="ndpi")
    with pytest.raises(ValueError, match="mpp"):
        write_synthetic_slide(big.path, seed=0, label=0, kind="aperio", mpp=None)


def test_cohort_is_byte_identical_and_labelled(tmp_path: Path, synthetic_cohort: Path) -> None:
    again = write_synthetic_cohort(tmp_path / "again", 4, seed=5, size=(1024, 1024))
    rows = list(csv.DictReader(synthetic_cohort.open()))
    assert [r["slide_id"] for r in rows] == [f"synth_{i:03d}" for i in range(4)]
    assert sorted(int(r["label"]) for r in rows) == [0, 0, 1, 1]
    for row in rows:
        first = synthetic_cohort.parent / f"{row['slide_id']}.svs"
        assert first.read_bytes() == (again.parent / first.name).read_bytes()
    assert again.read_bytes() == synthetic_cohort.read_bytes()
    other = write_synthetic_cohort(tmp_path / "other", 1, seed=6, size=(1024, 1024))
    assert (other.parent / "synth_000.svs").read_bytes() != (
        again.parent / "synth_000.svs"
    ).read_bytes()
    ome = [
        write_synthetic_slide(
            tmp_path / f"o{i}.ome.tiff", seed=1, label=1, size=(512, 512), kind="ome-tiff"
        )
        for i in range(2)
    ]
    assert ome[0].path.read_bytes() == ome[1].path.read_bytes()  # seeded OME UUID


def test_generation_is_fast() -> None:
    render_synthetic(seed=0, label=1, size=(256, 256))  # imports out of the timing
    start = time.process_time()
    render_synthetic(seed=0, label=1, size=(4096, 4096))
    # CPU time, not wall time: other processes on a shared machine do not count.
    assert time.process_time() - start < 3.0


def test_cli_writes_a_cohort(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert (
        synth_main(["--out", str(out), "--n", "2", "--size", "512x768", "--kind", "generic-tiff"])
        == 0
    )
    names = sorted(p.name for p in out.iterdir())
    # The positive slide's lesion outlines are written beside it for --annotations.
    assert [n for n in names if not n.endswith(".geojson")] == [
        "labels.csv",
        "synth_000.tiff",
        "synth_001.tiff",
    ]
    assert len([n for n in names if n.endswith(".geojson")]) == 1
    with open_slide(out / "synth_000.tiff") as reader:
        assert reader.level_dimensions[0] == (512, 768) and reader.mpp == 0.5
    assert "wrote 2 slides" in capsys.readouterr().out
    assert synth_main(["--out", str(out), "--n", "0"]) == 2
    with pytest.raises(SystemExit) as info:
        synth_main(["--help"])
    assert info.value.code == 0 and "examples:" in capsys.readouterr().out


def test_cohort_lesion_count_applies_to_positive_slides_only(tmp_path: Path) -> None:
    from hyfi_imaging.data.synthetic import render_synthetic, write_synthetic_cohort
    from hyfi_imaging.io import open_slide

    labels = write_synthetic_cohort(
        tmp_path, 4, seed=1, size=(384, 384), lesions=8, compression="zlib"
    )
    rows = [line.split(",") for line in labels.read_text().split()[1:]]
    assert {label for _, label in rows} == {"0", "1"}
    for i, (sid, label) in enumerate(rows):
        with open_slide(tmp_path / f"{sid}.svs") as slide:
            pixels = np.moveaxis(slide.read_region(0, 0, 0, 384, 384), 0, -1)
        plain = render_synthetic(seed=1 * 100003 + i, label=0, size=(384, 384), lesions=0).image
        assert np.array_equal(pixels, plain) == (label == "0"), (sid, label)


def test_fewer_lesions_than_asked_are_said(caplog: pytest.LogCaptureFixture) -> None:
    """A small slide holds fewer lesions than ``--lesions`` asks: drawn without a word."""
    from hyfi_imaging.data.synthetic import render_synthetic

    with caplog.at_level("WARNING", logger="hyfi_imaging.data.synthetic"):
        got = render_synthetic(seed=0, label=1, size=(256, 256), lesions=200)
    assert 0 < len(got.lesion_boxes) < 200
    assert f"room for {len(got.lesion_boxes)} of the 200 lesions" in caplog.text


def test_cli_refuses_positives_without_lesions_and_an_unbelievable_mpp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--lesions 0`` labelled slides 1 that were identical to their negative twins, and
    ``--mpp 500`` wrote slides the readers then said record no resolution: both are refused
    in one line, before any file; ``--lesions 0`` stays allowed for a cohort of negatives."""
    out = tmp_path / "c"
    base = ["--out", str(out), "--n", "2", "--size", "256", "--kind", "generic-tiff"]
    assert synth_main([*base, "--lesions", "0", "--positive-fraction", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--lesions: 0 lesions per positive slide" in err
    assert "--positive-fraction 0" in err and not out.exists()
    for mpp in ("500", "0.0001"):
        assert synth_main([*base, "--mpp", mpp]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"--mpp: {float(mpp):g} µm/px is outside" in err
        assert not out.exists()
    assert synth_main([*base, "--lesions", "0", "--positive-fraction", "0"]) == 0
    assert (out / "labels.csv").read_text().split()[1:] == ["synth_000,0", "synth_001,0"]
