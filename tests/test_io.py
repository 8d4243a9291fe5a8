"""Slide readers and the OME-Zarr store, on real files through the real libraries."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tifffile
import zarr
from conftest import SyntheticSlides, reference_pyramid
from dicom_files import write_ct_slice, write_wsi_level
from PIL import Image

from hyfi_imaging.data.synthetic import render_synthetic
from hyfi_imaging.errors import SlideError
from hyfi_imaging.io import ArrayReader, SlideReader, open_slide, thumbnail
from hyfi_imaging.io.detect import recognise
from hyfi_imaging.io.dicom import WSI_SOP_CLASS, read_dicom_header
from hyfi_imaging.io.openslide_reader import OpenSlideReader, mpp_from_resolution
from hyfi_imaging.io.pixels import RGB_NAMES
from hyfi_imaging.io.tiff_reader import TiffReader, ome_mpp
from hyfi_imaging.io.zarr_store import ZarrReader, downsample_2x, read_hyfi_attrs, write_ome_zarr

# key -> (reader class, format, mpp, mpp_source) as open_slide must report them
EXPECTED = {
    "aperio": (OpenSlideReader, "aperio", 0.5, "vendor"),
    "generic": (TiffReader, "generic-tiff", 0.5, "tiff-resolution"),
    "generic-nompp": (TiffReader, "generic-tiff", None, "none"),
    "ome": (TiffReader, "ome-tiff", 0.25, "ome"),
}
LEVELS = ((1536, 2048), (768, 1024), (384, 512))


def _rng_image(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _assert_reads_like(reader: SlideReader, levels: list[np.ndarray]) -> None:
    """Whole levels and odd windows crossing tile borders equal the expected pixels."""
    assert reader.level_count == len(levels)
    for level, expected in enumerate(levels):
        h, w = expected.shape[1:]
        np.testing.assert_array_equal(reader.read_region(level, 0, 0, h, w), expected)
        y, x = h // 3 + 1, w // 3 + 3
        wh, ww = min(77, h - y), min(301, w - x)
        np.testing.assert_array_equal(
            reader.read_region(level, y, x, wh, ww), expected[:, y : y + wh, x : x + ww]
        )


def _assert_outside_is_background(reader: SlideReader, level: int, expected: np.ndarray) -> None:
    h, w = reader.level_dimensions[level]
    bg = reader.background
    # Partly outside at the top-left and bottom-right corners.
    region = reader.read_region(level, -10, -20, 30, 50)
    assert region.shape == (reader.channels, 30, 50)
    assert (region[:, :10] == bg).all() and (region[:, :, :20] == bg).all()
    np.testing.assert_array_equal(region[:, 10:, 20:], expected[:, :20, :30])
    region = reader.read_region(level, h - 5, w - 7, 20, 20)
    assert (region[:, 5:] == bg).all() and (region[:, :, 7:] == bg).all()
    np.testing.assert_array_equal(region[:, :5, :7], expected[:, h - 5 :, w - 7 :])
    # Wholly outside.
    for y, x in ((-100, 0), (h, 0), (0, w + 3), (-50, -50)):
        assert (reader.read_region(level, y, x, 40, 40) == bg).all()


# ---------------------------------------------------------------- TIFF slides


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_open_slide_reads_every_kind_exactly(synthetic_slides: SyntheticSlides, key: str) -> None:
    cls, fmt, mpp, source = EXPECTED[key]
    with open_slide(synthetic_slides.slides[key].path) as reader:
        assert isinstance(reader, cls) and isinstance(reader, SlideReader)
        assert reader.format == fmt
        assert reader.level_dimensions == LEVELS
        assert reader.level_downsamples == ((1.0, 1.0), (2.0, 2.0), (4.0, 4.0))
        assert reader.mpp == mpp and reader.mpp_source == source
        assert reader.channels == 3 and reader.background == 255
        _assert_reads_like(reader, synthetic_slides.levels)
        _assert_outside_is_background(reader, 0, synthetic_slides.levels[0])
        _assert_outside_is_background(reader, 2, synthetic_slides.levels[2])


def test_openslide_generic_tiff_mpp_is_tiff_resolution(synthetic_slides: SyntheticSlides) -> None:
    # OpenSlide 4 turns generic TIFF resolution tags into openslide.mpp-x; not vendor metadata.
    with OpenSlideReader(synthetic_slides.slides["generic"].path) as reader:
        assert reader.format == "generic-tiff"
        assert (reader.mpp, reader.mpp_source) == (0.5, "tiff-resolution")
        _assert_reads_like(reader, synthetic_slides.levels)
    with OpenSlideReader(synthetic_slides.slides["generic-nompp"].path) as reader:
        assert (reader.mpp, reader.mpp_source) == (None, "none")


def test_tifffile_reads_aperio_with_vendor_mpp(synthetic_slides: SyntheticSlides) -> None:
    with TiffReader(synthetic_slides.slides["aperio"].path) as reader:
        assert (reader.format, reader.mpp, reader.mpp_source) == ("aperio", 0.5, "vendor")
        assert reader.level_dimensions == LEVELS  # the thumbnail page is not a level
        _assert_reads_like(reader, synthetic_slides.levels)


def test_ome_subifd_pyramid_only_tifffile_sees(synthetic_slides: SyntheticSlides) -> None:
    path = synthetic_slides.slides["ome"].path
    with OpenSlideReader(path) as blind:
        assert blind.level_count == 1  # OpenSlide follows the main IFD chain only
    with TiffReader(path) as reader:
        assert reader.level_dimensions == LEVELS


def test_jpeg_slide_within_tolerance(synthetic_slides: SyntheticSlides) -> None:
    path = synthetic_slides.slides["aperio-jpeg"].path
    for reader in (OpenSlideReader(path), TiffReader(path)):
        with reader:
            for level, expected in enumerate(synthetic_slides.levels):
                h, w = expected.shape[1:]
                diff = np.abs(reader.read_region(level, 0, 0, h, w).astype(int) - expected)
                assert diff.mean() < 2.0 and diff.max() <= 24, (type(reader), level)


def test_tiff_region_read_decodes_only_touched_tiles(
    synthetic_slides: SyntheticSlides, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tifffile.zarr as tiffzarr

    fetched: list[str] = []
    original = tiffzarr.ZarrTiffStore.get

    async def counting_get(self: Any, key: str, *args: Any, **kwargs: Any) -> Any:
        if not key.endswith((".zarray", ".zattrs", ".zgroup", "zarr.json")):
            fetched.append(key)
        return await original(self, key, *args, **kwargs)

    monkeypatch.setattr(tiffzarr.ZarrTiffStore, "get", counting_get)
    with TiffReader(synthetic_slides.slides["generic"].path) as reader:
        fetched.clear()
        inside_one = reader.read_region(0, 260, 270, 200, 200)  # within tile (1, 1)
        assert len(set(fetched)) == 1
        fetched.clear()
        reader.read_region(0, 250, 250, 20, 20)  # a 2 x 2 tile corner
        assert len(set(fetched)) == 4
        fetched.clear()
        reader.read_region(0, 0, 0, *LEVELS[0])  # whole level: 6 x 8 tiles
        assert len(set(fetched)) == 48
    np.testing.assert_array_equal(inside_one, synthetic_slides.levels[0][:, 260:460, 270:470])


def test_tiff_layouts_gray_planar_rgba_uint16(tmp_path: Path) -> None:
    rgb = _rng_image((300, 400, 3), seed=1)
    chw = np.moveaxis(rgb, -1, 0)
    kw: dict[str, Any] = {"tile": (128, 128), "metadata": None}
    tifffile.imwrite(tmp_path / "planar.tif", chw, photometric="rgb", planarconfig="separate", **kw)
    tifffile.imwrite(tmp_path / "gray.tif", rgb[..., 0], photometric="minisblack", **kw)
    alpha = np.full((300, 400, 1), 255, np.uint8)
    alpha[:, :200] = 0
    tifffile.imwrite(
        tmp_path / "rgba.tif",
        np.concatenate([rgb, alpha], -1),
        photometric="rgb",
        extrasamples=["unassalpha"],
        **kw,
    )
    tifffile.imwrite(tmp_path / "u16.tif", rgb.astype(np.uint16) * 257, photometric="rgb", **kw)

    with open_slide(tmp_path / "planar.tif") as r:
        np.testing.assert_array_equal(r.read_region(0, 0, 0, 300, 400), chw)
    with open_slide(tmp_path / "gray.tif") as r:  # grayscale is one channel, dark background
        assert (r.channels, r.dtype, r.background, r.channel_names) == (1, np.uint8, 0, ("c0",))
        np.testing.assert_array_equal(r.read_region(0, 5, 6, 100, 100), chw[:1, 5:105, 6:106])
    with open_slide(tmp_path / "rgba.tif") as r:
        out = r.read_region(0, 0, 0, 300, 400)
        assert out.shape == (3, 300, 400) and (out[:, :, :200] == 255).all()
        np.testing.assert_array_equal(out[:, :, 200:], chw[:, :, 200:])
    with open_slide(tmp_path / "u16.tif") as r:  # 16-bit RGB stays 16-bit, white is 65535
        assert (r.dtype, r.background, r.channel_names) == (np.uint16, 65535, RGB_NAMES)
        np.testing.assert_array_equal(r.read_region(0, 0, 0, 300, 400), chw.astype(np.uint16) * 257)


def test_plain_page_pyramid_and_odd_sizes(tmp_path: Path) -> None:
    # A multi-page pyramid written without any pyramid metadata, odd sizes.
    base = _rng_image((3, 601, 803), seed=2)
    levels = reference_pyramid(np.moveaxis(base, 0, -1), 3)
    with tifffile.TiffWriter(tmp_path / "plain.tif") as tif:
        for lv in levels:
            tif.write(np.moveaxis(lv, 0, -1), photometric="rgb", tile=(128, 128), metadata=None)
    with open_slide(tmp_path / "plain.tif") as reader:
        assert reader.level_dimensions == ((601, 803), (301, 402), (151, 201))
        _assert_reads_like(reader, levels)


# ------------------------------------------------------------ content detection


def test_open_slide_chooses_by_content_not_extension(
    synthetic_slides: SyntheticSlides, tmp_path: Path
) -> None:
    slides = synthetic_slides.slides
    shutil.copy(slides["generic"].path, tmp_path / "generic.png")
    shutil.copy(slides["aperio"].path, tmp_path / "aperio.tif")
    shutil.copy(slides["ome"].path, tmp_path / "ome.jpg")
    Image.fromarray(_rng_image((40, 50, 3))).save(tmp_path / "real-png.svs", format="PNG")
    Image.fromarray(_rng_image((40, 50, 3))).save(tmp_path / "real-jpeg.tiff", format="JPEG")
    expected = {
        "generic.png": (TiffReader, "generic-tiff"),
        "aperio.tif": (OpenSlideReader, "aperio"),
        "ome.jpg": (TiffReader, "ome-tiff"),
        "real-png.svs": (ArrayReader, "png"),
        "real-jpeg.tiff": (ArrayReader, "jpeg"),
    }
    for name, (cls, fmt) in expected.items():
        with open_slide(tmp_path / name) as reader:
            assert (type(reader), reader.format) == (cls, fmt), name


def test_recognise_by_content_says_what_a_file_is(
    synthetic_slides: SyntheticSlides, tmp_path: Path
) -> None:
    """Names never decide: a TIFF called .qptiff or with no extension is a slide; the rest say why not."""
    import zipfile

    shutil.copy(synthetic_slides.slides["generic"].path, tmp_path / "scan.qptiff")
    shutil.copy(synthetic_slides.slides["aperio"].path, tmp_path / "no-extension")
    Image.fromarray(_rng_image((8, 8, 3))).save(tmp_path / "pic.dat", format="PNG")
    Image.fromarray(_rng_image((8, 8, 3))).save(tmp_path / "anim.png", format="GIF")
    Image.fromarray(_rng_image((8, 8, 3))).save(tmp_path / "old.bmp", format="BMP")
    write_ct_slice(tmp_path / "ct.dcm")
    (tmp_path / "report.pdf").write_bytes(b"%PDF-1.7\n%...")
    with zipfile.ZipFile(tmp_path / "slides.zip", "w") as z:
        z.writestr("a.txt", "x")
    (tmp_path / "notes.txt").write_text("BM looks like a bitmap, but is not")
    (tmp_path / "empty").write_bytes(b"")
    expected = {
        "scan.qptiff": ("tiff", True, ""),
        "no-extension": ("tiff", True, ""),
        "pic.dat": ("png", True, ""),
        "anim.png": ("gif", False, "GIF image"),
        "old.bmp": ("bmp", False, "BMP image"),
        "ct.dcm": ("dicom", False, "DICOM CT image, not a whole-slide image"),
        "report.pdf": ("pdf", False, "PDF document"),
        "slides.zip": ("zip", False, "ZIP archive"),
        "notes.txt": ("other", False, "not recognised"),
        "empty": ("empty", False, "empty file (0 bytes)"),
    }
    for name, (kind, readable, words) in expected.items():
        what = recognise(tmp_path / name)
        assert (what.kind, what.readable) == (kind, readable), name
        assert words in what.reason, (name, what.reason)
    with pytest.raises(SlideError, match="unsupported format: DICOM CT image"):
        open_slide(tmp_path / "ct.dcm")
    with pytest.raises(SlideError, match="file not found"):
        recognise(tmp_path / "absent")


def test_dicom_whole_slide_series_opens_from_any_of_its_files(tmp_path: Path) -> None:
    """A two-level DICOM WSI series (one file per level) reads back exactly through OpenSlide."""
    image = render_synthetic(seed=7, label=1, size=(600, 700)).image
    level1 = np.moveaxis(downsample_2x(np.moveaxis(image, -1, 0)), 0, -1)
    write_wsi_level(tmp_path / "l0.dcm", image, series="1.2.3", instance="1.2.3.1", mpp=0.5)
    write_wsi_level(
        tmp_path / "l1.dcm",
        level1,
        series="1.2.3",
        instance="1.2.3.2",
        mpp=1.0,
        referenced_series="1.2.999",  # an undefined-length sequence before the series UID
    )
    header = read_dicom_header(tmp_path / "l1.dcm")
    assert header is not None and header.is_wsi and header.sop_class == WSI_SOP_CLASS
    assert header.series_uid == "1.2.3"  # not the referenced series inside the sequence
    for name in ("l0.dcm", "l1.dcm"):
        what = recognise(tmp_path / name)
        assert (what.kind, what.readable, what.series) == ("dicom", True, "1.2.3")
        with open_slide(tmp_path / name) as reader:
            assert (reader.format, reader.mpp) == ("dicom", 0.5)
            assert reader.level_dimensions == ((600, 700), (300, 350))
            np.testing.assert_array_equal(
                reader.read_region(0, 0, 0, 600, 700), np.moveaxis(image, -1, 0)
            )
            np.testing.assert_array_equal(
                reader.read_region(1, 0, 0, 300, 350), np.moveaxis(level1, -1, 0)
            )
    assert read_dicom_header(tmp_path / "l0.dcm") is not None
    (tmp_path / "plain.bin").write_bytes(b"\x00" * 200)
    assert read_dicom_header(tmp_path / "plain.bin") is None


def _one_line(err: SlideError) -> str:
    text = str(err)
    assert "\n" not in text and text.endswith(".")
    return text


def test_unsupported_missing_and_non_store(tmp_path: Path) -> None:
    (tmp_path / "notes.svs").write_text("not a slide at all\n")
    with pytest.raises(SlideError, match="unsupported format") as info:
        open_slide(tmp_path / "notes.svs")
    assert str(tmp_path / "notes.svs") in _one_line(info.value)
    with pytest.raises(SlideError, match="file not found"):
        open_slide(tmp_path / "absent.svs")
    (tmp_path / "folder").mkdir()
    with pytest.raises(SlideError, match="not a zarr store"):
        open_slide(tmp_path / "folder")
    (tmp_path / "empty.tif").write_bytes(b"")
    with pytest.raises(SlideError, match=r"empty\.tif: empty file \(0 bytes\); the copy"):
        open_slide(tmp_path / "empty.tif")
    with pytest.raises(SlideError, match="not positive"):
        open_slide(tmp_path / "notes.svs", mpp_override=0.0)


@pytest.mark.parametrize("key", ["aperio", "generic", "ome", "aperio-jpeg"])
def test_truncated_tiff_is_a_slide_error(
    synthetic_slides: SyntheticSlides, tmp_path: Path, key: str
) -> None:
    data = synthetic_slides.slides[key].path.read_bytes()
    cut = tmp_path / "cut.tif"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(SlideError) as info, open_slide(cut) as reader:  # fails on open or read
        for level in range(reader.level_count):
            reader.read_region(level, 0, 0, *reader.level_dimensions[level])
    assert str(cut) in _one_line(info.value)


def test_mpp_never_guessed_and_override_wins(
    synthetic_slides: SyntheticSlides, tmp_path: Path
) -> None:
    Image.fromarray(_rng_image((30, 30, 3))).save(tmp_path / "a.png", dpi=(300, 300))
    with open_slide(tmp_path / "a.png") as r:
        assert (r.mpp, r.mpp_source) == (None, "none")  # print DPI is not a microscope scale
    with open_slide(synthetic_slides.slides["generic-nompp"].path) as r:
        assert (r.mpp, r.mpp_source) == (None, "none")
    store = tmp_path / "s.zarr"
    write_ome_zarr(store, _rng_image((3, 64, 64)), mpp=0.5, hyfi_attrs={}, chunk=32, shard=64)
    paths = [tmp_path / "a.png", store] + [synthetic_slides.slides[k].path for k in EXPECTED]
    for path in paths:
        with open_slide(path, mpp_override=0.123) as r:
            assert (r.mpp, r.mpp_source) == (0.123, "override"), path


def test_resolution_and_ome_mpp_parsing() -> None:
    assert mpp_from_resolution(20000.0, "centimeter") == pytest.approx(0.5)
    assert mpp_from_resolution(50800.0, "INCH") == pytest.approx(0.5)
    assert mpp_from_resolution(1.0, "none") is None
    assert mpp_from_resolution(72.0, "inch") is None  # 353 um: a screen, not a slide
    assert mpp_from_resolution(None, "inch") is None
    xml = '<OME><Image><Pixels PhysicalSizeX="250" PhysicalSizeXUnit="nm" PhysicalSizeY="0.25"/></Image></OME>'
    assert ome_mpp(xml) == pytest.approx(0.25)
    assert ome_mpp("<OME><Image><Pixels/></Image></OME>") is None
    assert ome_mpp("garbage <") is None
    greek = '<OME><Image><Pixels PhysicalSizeX="0.5" PhysicalSizeXUnit="\u03bcm"/></Image></OME>'
    assert ome_mpp(greek) == pytest.approx(0.5)  # a Greek mu is a micro sign too


def _pixels(x: float, y: float) -> str:
    return f'<OME><Image><Pixels PhysicalSizeX="{x}" PhysicalSizeY="{y}"/></Image></OME>'


def test_pixels_that_are_not_square_are_refused(tmp_path: Path) -> None:
    """Pixels 0.25 µm wide and 0.5 µm high: the mean (OME) or the width alone (TIFF tags) gave
    every store the wrong physical size in both axes, without a word."""
    assert ome_mpp(_pixels(0.2502, 0.25)) == pytest.approx(0.2501)  # scanners' rounding
    with pytest.raises(SlideError, match="pixels are not square"):
        ome_mpp(_pixels(0.25, 0.5))
    tags = tmp_path / "tags.tif"
    tifffile.imwrite(
        tags,
        _rng_image((64, 64, 3)),
        tile=(32, 32),
        resolution=(4e4, 2e4),
        resolutionunit="CENTIMETER",
    )
    with pytest.raises(SlideError, match=r"pixels are not square \(0.25 µm wide, 0.5 µm high\)"):
        open_slide(tags)
    with open_slide(tags, mpp_override=0.4) as r:  # the metadata is wrong: the user says so
        assert r.mpp == 0.4
    store = tmp_path / "nm.zarr"
    write_ome_zarr(store, _rng_image((3, 64, 64)), mpp=0.5, hyfi_attrs={}, chunk=32, shard=64)
    meta = json.loads((store / "zarr.json").read_text())
    for axis in meta["attributes"]["ome"]["multiscales"][0]["axes"][-2:]:
        axis["unit"] = "nanometer"
    for ds in meta["attributes"]["ome"]["multiscales"][0]["datasets"]:
        ds["coordinateTransformations"][0]["scale"][-2:] = [
            v * 1000 for v in ds["coordinateTransformations"][0]["scale"][-2:]
        ]
    (store / "zarr.json").write_text(json.dumps(meta))
    with open_slide(store) as r:
        assert r.mpp == pytest.approx(0.5)  # 500 nm, not 500 µm
    for ds in meta["attributes"]["ome"]["multiscales"][0]["datasets"]:
        ds["coordinateTransformations"][0]["scale"][-2] *= 2  # rows twice as tall
    (store / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(SlideError, match=r"pixels are not square \(0.5 µm wide, 1 µm high\)"):
        open_slide(store)
    with open_slide(store, mpp_override=0.5) as r:  # the override wins here too
        assert (r.mpp, r.mpp_source) == (0.5, "override")


# ---------------------------------------------------------------- PNG / JPEG


def test_png_and_jpeg_images(tmp_path: Path) -> None:
    rgb = _rng_image((70, 90, 3), seed=3)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    Image.fromarray(rgb[..., 0]).save(tmp_path / "gray.png")
    rgba = np.concatenate([rgb, np.zeros((70, 90, 1), np.uint8)], -1)
    Image.fromarray(rgba).save(tmp_path / "clear.png")
    smooth = np.broadcast_to(np.linspace(0, 255, 90, dtype=np.uint8)[None, :, None], (70, 90, 3))
    Image.fromarray(np.ascontiguousarray(smooth)).save(tmp_path / "smooth.jpg", quality=95)
    with open_slide(tmp_path / "rgb.png") as r:
        assert (r.format, r.level_dimensions, r.channels) == ("png", ((70, 90),), 3)
        np.testing.assert_array_equal(r.read_region(0, 0, 0, 70, 90), np.moveaxis(rgb, -1, 0))
        _assert_outside_is_background(r, 0, np.moveaxis(rgb, -1, 0))
    with open_slide(tmp_path / "gray.png") as r:  # one intensity channel, as a grey TIFF
        np.testing.assert_array_equal(r.read_region(0, 0, 0, 70, 90), rgb[None, ..., 0])
    with open_slide(tmp_path / "clear.png") as r:  # fully transparent composites to white
        assert (r.read_region(0, 0, 0, 70, 90) == 255).all()
    with open_slide(tmp_path / "smooth.jpg") as r:
        diff = np.abs(r.read_region(0, 0, 0, 70, 90).astype(int) - np.moveaxis(smooth, -1, 0))
        assert r.format == "jpeg" and diff.max() <= 4


def test_huge_and_truncated_images_refused(tmp_path: Path) -> None:
    Image.new("L", (20001, 2)).save(tmp_path / "wide.png")
    with pytest.raises(SlideError, match="larger than 20000"):
        open_slide(tmp_path / "wide.png")
    Image.fromarray(_rng_image((200, 200, 3))).save(tmp_path / "ok.png")
    data = (tmp_path / "ok.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(SlideError, match="cannot decode image"):
        open_slide(tmp_path / "cut.png")


# ------------------------------------------------------------------- OME-Zarr


def test_zarr_round_trip_levels_and_attributes(tmp_path: Path) -> None:
    image = _rng_image((3, 1100, 1700), seed=4)
    attrs = {"source": "a.svs", "source_mpp": 0.25, "mpp": 0.5, "version": "x"}
    store = tmp_path / "img.zarr"
    write_ome_zarr(store, image, mpp=0.5, hyfi_attrs=attrs, chunk=256, shard=1024, name="img")

    meta = json.loads((store / "zarr.json").read_text())
    assert meta["zarr_format"] == 3 and meta["node_type"] == "group"
    ome = meta["attributes"]["ome"]
    assert ome["version"] == "0.5"
    ms = ome["multiscales"][0]
    assert ms["name"] == "img"
    assert ms["axes"] == [
        {"name": "c", "type": "channel"},
        {"name": "y", "type": "space", "unit": "micrometer"},
        {"name": "x", "type": "space", "unit": "micrometer"},
    ]
    assert [d["path"] for d in ms["datasets"]] == ["0", "1", "2"]
    for level, d in enumerate(ms["datasets"]):
        # a level-l pixel is centred on its 2**l x 2**l level-0 pixels: (2**l - 1) / 2 of them
        shift = 0.5 * (2**level - 1) / 2
        assert d["coordinateTransformations"] == [
            {"type": "scale", "scale": [1.0, 0.5 * 2**level, 0.5 * 2**level]},
            *([{"type": "translation", "translation": [0.0, shift, shift]}] if level else []),
        ]
    assert meta["attributes"]["hyfi"] == attrs
    assert read_hyfi_attrs(store) == attrs

    expected = [image, downsample_2x(image)]
    expected.append(downsample_2x(expected[1]))
    group = zarr.open_group(store, mode="r")
    for level, exp in enumerate(expected):
        arr = group[str(level)]
        assert arr.dtype == np.uint8 and arr.shape == exp.shape
        assert arr.metadata.dimension_names == ("c", "y", "x")
        assert arr.chunks == (3, 256, 256)
        # 1024 shards, clamped to the level rounded up to whole chunks
        assert arr.shards == [(3, 1024, 1024), (3, 768, 1024), (3, 512, 512)][level]
        codecs = json.loads((store / str(level) / "zarr.json").read_text())["codecs"]
        assert codecs[0]["name"] == "sharding_indexed"
        assert [c["name"] for c in codecs[0]["configuration"]["codecs"]] == ["bytes", "zstd"]

    with open_slide(store) as reader:
        assert isinstance(reader, ZarrReader)
        assert (reader.format, reader.mpp, reader.mpp_source) == ("ome-zarr", 0.5, "ome")
        assert reader.level_dimensions == ((1100, 1700), (550, 850), (275, 425))
        assert reader.level_downsamples == ((1.0, 1.0), (2.0, 2.0), (4.0, 4.0))
        assert reader.attrs == attrs
        _assert_reads_like(reader, expected)
        _assert_outside_is_background(reader, 0, image)
        _assert_outside_is_background(reader, 2, expected[2])


def test_zarr_pyramid_stops_and_shards_clamp(tmp_path: Path) -> None:
    image = _rng_image((3, 700, 1300))
    write_ome_zarr(
        tmp_path / "s.zarr", image, mpp=1.0, hyfi_attrs={"background": 0}, pyramid_levels=5
    )
    with ZarrReader(tmp_path / "s.zarr") as reader:
        # 700 -> 350 (>= 256 kept) -> 175 (< 256 dropped)
        assert reader.level_dimensions == ((700, 1300), (350, 650))
        assert reader.background == 0
        assert (reader.read_region(1, -5, -5, 10, 10)[:, :5] == 0).all()
    arr = zarr.open_group(tmp_path / "s.zarr", mode="r")["0"]
    assert arr.chunks == (3, 512, 512) and arr.shards == (3, 1024, 1536)


def test_zarr_region_read_fetches_only_touched_chunks(tmp_path: Path) -> None:
    from zarr.storage import LocalStore, WrapperStore

    class CountingStore(WrapperStore[LocalStore]):
        def __init__(self, store: LocalStore) -> None:
            super().__init__(store)
            self.ranges: list[tuple[str, Any]] = []

        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            if not key.endswith("zarr.json"):
                self.ranges.append((key, byte_range))
            return await self._store.get(key, prototype, byte_range)

    image = _rng_image((3, 1024, 1536), seed=5)
    write_ome_zarr(tmp_path / "c.zarr", image, mpp=0.5, hyfi_attrs={}, chunk=128, shard=512)
    counting = CountingStore(LocalStore(tmp_path / "c.zarr", read_only=True))
    reader = ZarrReader(tmp_path / "c.zarr", store=counting)

    def chunk_reads(y: int, x: int, h: int, w: int) -> int:
        counting.ranges.clear()
        np.testing.assert_array_equal(
            reader.read_region(0, y, x, h, w), image[:, max(y, 0) : y + h, max(x, 0) : x + w]
        )
        # Partial shard: one suffix read of its index, one range read per inner chunk.
        return sum(type(r).__name__ == "RangeByteRequest" for _, r in counting.ranges)

    assert chunk_reads(130, 140, 100, 100) == 1
    assert chunk_reads(500, 500, 30, 30) == 4  # crosses chunk and shard borders
    # A whole level reads each of its 2 x 3 shards in one request.
    assert chunk_reads(0, 0, 1024, 1536) == 0
    assert sorted(k for k, r in counting.ranges if r is None) == [
        f"0/c/0/{i}/{j}" for i in range(2) for j in range(3)
    ]


def test_zarr_refuses_existing_and_reports_garbage(tmp_path: Path) -> None:
    image = _rng_image((3, 64, 64))
    write_ome_zarr(tmp_path / "a.zarr", image, mpp=0.5, hyfi_attrs={"k": 1}, chunk=32, shard=64)
    with pytest.raises(SlideError, match="already exists"):
        write_ome_zarr(tmp_path / "a.zarr", image, mpp=0.5, hyfi_attrs={}, chunk=32, shard=64)
    with pytest.raises(ValueError, match="multiple of chunk"):
        write_ome_zarr(tmp_path / "b.zarr", image, mpp=0.5, hyfi_attrs={}, chunk=32, shard=48)
    assert not (tmp_path / "b.zarr").exists()

    (tmp_path / "garbage.zarr").mkdir()
    (tmp_path / "garbage.zarr" / "zarr.json").write_text("{ not json")
    (tmp_path / "file").write_text("x")
    # An interrupted write: arrays but no group attributes yet.
    zarr.open_group(tmp_path / "partial.zarr", mode="w", zarr_format=3)
    for path in ("absent", "file", "garbage.zarr", "partial.zarr"):
        assert read_hyfi_attrs(tmp_path / path) is None
    for path in ("garbage.zarr", "partial.zarr"):
        with pytest.raises(SlideError, match="not a readable OME-Zarr"):
            open_slide(tmp_path / path)


class _CountingSource:
    """A region source over an array that remembers the largest region asked for."""

    def __init__(self, image: np.ndarray) -> None:
        self.image = image
        self.largest = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        c, h, w = self.image.shape
        return c, h, w

    def read(self, y0: int, x0: int, y1: int, x1: int) -> np.ndarray:
        self.largest = max(self.largest, (y1 - y0) * (x1 - x0))
        return self.image[:, y0:y1, x0:x1].copy()


def test_zarr_written_shard_by_shard_equals_the_whole_image(tmp_path: Path) -> None:
    """A region source is asked for one shard at a time; levels equal the whole-image pyramid."""
    image = _rng_image((3, 1000, 1301), seed=6)  # odd width: edge replication at the true edge
    source = _CountingSource(image)
    write_ome_zarr(tmp_path / "r.zarr", source, mpp=0.5, hyfi_attrs={}, chunk=64, shard=256)
    write_ome_zarr(tmp_path / "a.zarr", image, mpp=0.5, hyfi_attrs={}, chunk=64, shard=256)
    assert source.largest == 256 * 256
    expected = reference_pyramid(np.moveaxis(image, 0, -1), 3)
    for name in ("r.zarr", "a.zarr"):
        group = zarr.open_group(tmp_path / name, mode="r")
        for level, exp in enumerate(expected):
            np.testing.assert_array_equal(np.asarray(group[str(level)][:]), exp)


def test_thumbnail_reads_a_large_level_in_strips(monkeypatch: pytest.MonkeyPatch) -> None:
    """A level without a smaller one is read in bounded strips, giving the whole-level result."""
    import hyfi_imaging.io.base as base

    image = _rng_image((3, 1536, 1024), seed=8)
    whole, ds = thumbnail(ArrayReader(image), 128)  # one strip: the plain whole-level resize
    assert whole.shape == (3, 128, 85) and ds == (12.0, 1024 / 85)
    monkeypatch.setattr(base, "THUMBNAIL_STRIP_BYTES", 3 * 1024 * 100)

    class Counting(ArrayReader):
        largest = 0

        def read_region(self, level: int, y: int, x: int, h: int, w: int) -> np.ndarray:
            Counting.largest = max(Counting.largest, h)
            return super().read_region(level, y, x, h, w)

    strips, ds = thumbnail(Counting(image), 128)
    assert Counting.largest <= 100 and ds == (12.0, 1024 / 85)
    np.testing.assert_array_equal(strips, whole)  # 12 rows per output row: no fractional edges
