"""Input files read or named right: DICOM without ImageType, empty files, two inputs of one stem.

Real files throughout: DICOM series written byte by byte (``dicom_files``) and by
pydicom (each read back by the other), a
pyramidal TIFF written by tifffile, PNGs by Pillow (one cut short), and the
real hyfi-preprocess command over them.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import openslide
import pytest
from dicom_files import jpeg_frame, write_wsi_level
from PIL import Image

from hyfi_imaging.cli.preprocess import main as preprocess_main
from hyfi_imaging.data.synthetic import render_synthetic, write_synthetic_slide
from hyfi_imaging.errors import SlideError
from hyfi_imaging.io.annotations import AnnotationError, read_annotations
from hyfi_imaging.io.detect import open_slide, recognise
from hyfi_imaging.io.dicom_instance import read_instance
from hyfi_imaging.io.dicom_reader import DicomReader
from hyfi_imaging.preprocess import read_manifest
from hyfi_imaging.preprocess.discover import discover_slides

# The size of the public test file of the report: 2638 x 3236 px in 42 frames of 512².
SIZE, TILE = (2638, 3236), 512


def _image(size: tuple[int, int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def _jpeg_level(image: np.ndarray, tile: int) -> np.ndarray:
    """What a JPEG-framed level decodes to: each padded tile through the same encoder and Pillow."""
    h, w = image.shape[:2]
    gy, gx = -(-h // tile), -(-w // tile)
    padded = np.full((gy * tile, gx * tile, 3), 255, np.uint8)
    padded[:h, :w] = image
    out = np.empty_like(padded)
    for ty in range(gy):
        for tx in range(gx):
            block = padded[ty * tile : (ty + 1) * tile, tx * tile : (tx + 1) * tile]
            decoded = np.asarray(Image.open(io.BytesIO(jpeg_frame(np.ascontiguousarray(block)))))
            out[ty * tile : (ty + 1) * tile, tx * tile : (tx + 1) * tile] = decoded
    return np.moveaxis(out[:h, :w], -1, 0)


@pytest.fixture(scope="module")
def series_without_image_type(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A whole-slide series none of whose instances says its ImageType.

    Level 0: implicit VR, uncompressed, frame positions in the per-frame
    functional groups, no DimensionOrganizationType. Level 1: JPEG frames in
    TILED_FULL order. A label with a total pixel matrix of another aspect, and
    an overview without one.
    """
    folder = tmp_path_factory.mktemp("dicom")
    image = _image(SIZE, seed=3)

    def level(name: str, pixels: np.ndarray, n: int, mpp: float, **options: Any) -> None:
        write_wsi_level(
            folder / name,
            np.ascontiguousarray(pixels),
            series="1.2.826.7",
            instance=f"1.2.826.7.{n}",
            mpp=mpp,
            image_type=None,
            **options,
        )

    level("level0.dcm", image, 1, 0.5, tile=TILE, implicit=True, positions=True, organization=None)
    level("level1.dcm", image[::2, ::2], 2, 1.0, tile=TILE, compression="jpeg")
    level("label.dcm", _image((300, 900), seed=4), 3, 20, tile=(300, 900))
    level("overview.dcm", _image((200, 250), seed=5), 4, 40, tile=(200, 250), total_matrix=False)
    np.save(folder.parent / "level0.npy", image)
    return folder


def test_dicom_series_without_image_type_reads_exactly(series_without_image_type: Path) -> None:
    folder = series_without_image_type
    image = np.moveaxis(np.load(folder.parent / "level0.npy"), -1, 0)
    with pytest.raises(openslide.OpenSlideError, match="image flavor"):
        openslide.OpenSlide(str(folder / "level0.dcm"))  # the case the report met
    assert len(read_instance(folder / "level0.dcm").frames) == 42
    level1 = _jpeg_level(np.ascontiguousarray(np.moveaxis(image, 0, -1)[::2, ::2]), TILE)
    for name in ("level0.dcm", "label.dcm"):  # any file of the series opens the series
        what = recognise(folder / name)
        assert (what.kind, what.readable, what.series) == ("dicom", True, "1.2.826.7")
        with open_slide(folder / name) as reader:
            assert isinstance(reader, DicomReader)
            assert (reader.format, reader.mpp, reader.mpp_source) == ("dicom", 0.5, "vendor")
            assert reader.level_dimensions == (SIZE, (1319, 1618))
            assert reader.level_downsamples == ((1.0, 1.0), (2.0, 2.0))
            np.testing.assert_array_equal(reader.read_region(0, 0, 0, *SIZE), image)
            np.testing.assert_array_equal(reader.read_region(1, 0, 0, 1319, 1618), level1)
            # Across four tiles, and partly outside the image (background there).
            region = reader.read_region(0, SIZE[0] - 300, 500, 400, 30)
            np.testing.assert_array_equal(region[:, :300], image[:, -300:, 500:530])
            assert (region[:, 300:] == 255).all()


def test_dicom_without_image_type_through_hyfi_preprocess(
    series_without_image_type: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = [str(series_without_image_type), "--out", str(out), "--mpp", "4", "--size", "512"]
    assert preprocess_main([*args, "--quiet"]) == 0
    (row,) = read_manifest(out / "manifest.csv")
    assert (row.slide_id, row.status, row.mpp) == ("level0", "ok", 4.0)
    assert "further files of a DICOM series (converted through its largest file): 3" in (
        capsys.readouterr().out
    )


def test_dicom_levels_of_one_size_and_16_bit_grey(tmp_path: Path) -> None:
    """Two instances of one size are refused by name; 16-bit grey frames read exactly."""
    grey = np.random.default_rng(6).integers(0, 65536, (300, 500), dtype=np.uint16)
    write_wsi_level(
        tmp_path / "a.dcm",
        grey,
        series="9.1",
        instance="9.1.1",
        mpp=0.25,
        tile=128,
        image_type=None,
    )
    with open_slide(tmp_path / "a.dcm") as reader:
        assert (reader.channels, reader.dtype, reader.background) == (1, np.uint16, 0)
        np.testing.assert_array_equal(reader.read_region(0, 0, 0, 300, 500)[0], grey)
    write_wsi_level(
        tmp_path / "b.dcm",
        grey,
        series="9.1",
        instance="9.1.2",
        mpp=0.25,
        tile=128,
        image_type=None,
    )
    with pytest.raises(SlideError, match=r"two instances of the series are 300 x 500 px") as info:
        open_slide(tmp_path / "a.dcm")
    assert "a.dcm and b.dcm" in str(info.value) and "\n" not in str(info.value)


def test_rgb_coded_jpeg_frames_keep_their_colours(tmp_path: Path) -> None:
    """Frames whose JPEG stream does not say RGB (photometric RGB in the header) are not YCbCr-converted."""
    image = render_synthetic(seed=4, label=1, size=(300, 400)).image
    write_wsi_level(
        tmp_path / "rgb.dcm",
        image,
        series="9.2",
        instance="9.2.1",
        mpp=0.5,
        tile=128,
        image_type=None,
        compression="jpeg-rgb",
    )
    frame = jpeg_frame(np.ascontiguousarray(image[:128, :128]), rgb=True)
    as_ycbcr = np.asarray(Image.open(io.BytesIO(frame)), dtype=float)  # what libjpeg guesses
    assert np.abs(as_ycbcr - image[:128, :128]).mean() > 40
    with open_slide(tmp_path / "rgb.dcm") as reader:
        read = np.moveaxis(reader.read_region(0, 0, 0, 300, 400), 0, -1).astype(float)
    assert np.abs(read - image).mean() < 3.0  # measured 1.73; the YCbCr guess: 47


def test_an_empty_file_is_called_empty_wherever_content_is_detected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "blank").write_bytes(b"")
    (src / "scan.svs").write_bytes(b"")  # a slide name: tried, and failed with the reason
    write_synthetic_slide(src / "good.tiff", seed=1, label=0, size=(512, 512), kind="generic-tiff")
    what = recognise(src / "blank")
    assert (what.kind, what.readable, what.reason) == ("empty", False, "empty file (0 bytes)")
    with pytest.raises(SlideError, match=r"scan\.svs: empty file \(0 bytes\); "):
        open_slide(src / "scan.svs")
    (tmp_path / "a.xml").write_bytes(b"")
    with pytest.raises(AnnotationError, match=r"a\.xml: empty file \(0 bytes\); "):
        read_annotations(tmp_path / "a.xml")
    out = tmp_path / "out"
    assert preprocess_main([str(src), "--out", str(out), "--mpp", "2", "--size", "128"]) == 1
    rows = {r.slide_id: r for r in read_manifest(out / "manifest.csv")}
    assert (rows["good"].status, rows["scan"].status) == ("ok", "failed")
    assert "empty file (0 bytes)" in rows["scan"].error
    assert "empty files (0 bytes): 1 (blank)" in capsys.readouterr().out


def _truncated_png(path: Path) -> Path:
    buf = io.BytesIO()
    Image.fromarray(_image((256, 256), seed=8)).save(buf, format="PNG")
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    return path


def test_a_pyramid_is_kept_over_a_broken_png_of_the_same_stem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _truncated_png(src / "boxes.png")
    write_synthetic_slide(
        src / "boxes.tiff", seed=2, label=1, size=(768, 1024), kind="generic-tiff"
    )
    found = discover_slides([src])
    assert found.slides == [src / "boxes.tiff"] and found.ids == {}
    (skipped,) = found.skipped
    assert skipped.path == src / "boxes.png"
    assert "boxes.tiff, with the same slide id 'boxes', is converted" in skipped.detail
    out = tmp_path / "out"
    assert preprocess_main([str(src), "--out", str(out), "--mpp", "2", "--size", "256"]) == 0
    (row,) = read_manifest(out / "manifest.csv")
    assert (row.slide_id, row.status, Path(row.source).name) == ("boxes", "ok", "boxes.tiff")
    printed = capsys.readouterr().out
    assert (
        "unreadable files whose slide id a readable input has (that one is converted): 1 "
        "(boxes.png)" in printed
    )
    log = (out / "preprocess.log").read_text()
    assert f"{src / 'boxes.png'}: " in log and "truncated" in log


def test_two_readable_inputs_of_one_stem_keep_their_file_names(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    Image.fromarray(_image((300, 400), seed=9)).save(src / "boxes.png")
    write_synthetic_slide(
        src / "boxes.tiff", seed=2, label=1, size=(768, 1024), kind="generic-tiff"
    )
    write_synthetic_slide(src / "other.tiff", seed=3, label=0, size=(512, 512), kind="generic-tiff")
    (tmp_path / "labels.csv").write_text("slide_id,label\nboxes,1\nother,0\n")
    out = tmp_path / "out"
    args = [str(src), "--out", str(out), "--mpp-override", "0.5", "--mpp", "2", "--size", "128"]
    assert preprocess_main([*args, "--labels", str(tmp_path / "labels.csv"), "--quiet"]) == 0
    rows = {r.slide_id: r for r in read_manifest(out / "manifest.csv")}
    assert {sid: (r.status, r.label, Path(r.source).name) for sid, r in rows.items()} == {
        "boxes.png": ("ok", "1", "boxes.png"),
        "boxes.tiff": ("ok", "1", "boxes.tiff"),
        "other": ("ok", "0", "other.tiff"),  # a stem of its own keeps its id
    }
    assert (out / "boxes.png.zarr").is_dir() and (out / "boxes.tiff.zarr").is_dir()
    log = (out / "preprocess.log").read_text()
    assert (
        "2 inputs share the slide id 'boxes'; their ids are their file names: boxes.png, boxes.tiff"
        in log
    )
    # A second boxes.tiff in a subfolder: the same name is no way apart (a duplicate in the manifest).
    (src / "more").mkdir()
    (src / "more" / "boxes.tiff").write_bytes((src / "boxes.tiff").read_bytes())
    found = discover_slides([src], recursive=True)
    assert sorted(found.slide_id(p) for p in found.slides) == [
        "boxes.png",
        "boxes.tiff",
        "boxes.tiff",
        "other",
    ]


def _pydicom_wsi(path: Path, image: np.ndarray, tile: int, mpp: float) -> None:
    """A VL Whole Slide Microscopy level written by pydicom (the issue's way to build the
    case), uncompressed, frames in TILED_FULL order, and no ImageType."""
    pytest.importorskip("pydicom")
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.sequence import Sequence
    from pydicom.uid import ExplicitVRLittleEndian

    h, w = image.shape[:2]
    gy, gx = -(-h // tile), -(-w // tile)
    frames = np.full((gy * gx, tile, tile, 3), 255, np.uint8)
    for ty in range(gy):
        for tx in range(gx):
            block = image[ty * tile : (ty + 1) * tile, tx * tile : (tx + 1) * tile]
            frames[ty * gx + tx, : block.shape[0], : block.shape[1]] = block
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.77.1.6"
    meta.MediaStorageSOPInstanceUID = "1.2.826.8.1"
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, "1.2.826.8.1"
    ds.StudyInstanceUID, ds.SeriesInstanceUID = "1.2.826.8", "1.2.826.8.2"
    ds.Modality, ds.DimensionOrganizationType = "SM", "TILED_FULL"
    ds.Rows = ds.Columns = tile
    ds.TotalPixelMatrixRows, ds.TotalPixelMatrixColumns = h, w
    ds.NumberOfFrames = gy * gx
    ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, "RGB", 0
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    measures = Dataset()
    measures.PixelSpacing = [mpp / 1000, mpp / 1000]  # mm
    measures.SliceThickness = 0.001
    shared = Dataset()
    shared.PixelMeasuresSequence = Sequence([measures])
    ds.SharedFunctionalGroupsSequence = Sequence([shared])
    ds.PixelData = frames.tobytes()
    ds.save_as(path, enforce_file_format=True)


def test_a_pydicom_written_series_without_image_type_reads_exactly(tmp_path: Path) -> None:
    """The report's case built by pydicom (2638 x 3236 in 42 frames, no ImageType): what
    pydicom wrote and reads back is what the reader gives, pixel for pixel."""
    pydicom = pytest.importorskip("pydicom")
    image = _image(SIZE, seed=7)
    _pydicom_wsi(tmp_path / "wsi.dcm", image, TILE, 0.25)
    ds = pydicom.dcmread(tmp_path / "wsi.dcm")
    assert "ImageType" not in ds and int(ds.NumberOfFrames) == 42
    np.testing.assert_array_equal(ds.pixel_array[1, :TILE, :TILE], image[:TILE, TILE : 2 * TILE])
    with pytest.raises(openslide.OpenSlideError):
        openslide.OpenSlide(str(tmp_path / "wsi.dcm"))
    with open_slide(tmp_path / "wsi.dcm") as reader:
        assert reader.level_dimensions == (SIZE,) and reader.mpp == pytest.approx(0.25)
        np.testing.assert_array_equal(reader.read_region(0, 0, 0, *SIZE), np.moveaxis(image, -1, 0))


def test_pydicom_reads_the_hand_written_series_as_the_reader_does(
    series_without_image_type: Path,
) -> None:
    """The byte-by-byte writer of ``dicom_files`` against pydicom: the same frames."""
    pydicom = pytest.importorskip("pydicom")
    ds = pydicom.dcmread(series_without_image_type / "level0.dcm")
    assert "ImageType" not in ds and int(ds.NumberOfFrames) == 42
    image = np.load(series_without_image_type.parent / "level0.npy")
    with open_slide(series_without_image_type / "level0.dcm") as reader:
        region = reader.read_region(0, 0, 0, *SIZE)
    frames = ds.pixel_array  # frame order as the per-frame positions say: row by row here
    np.testing.assert_array_equal(frames[0], image[:TILE, :TILE])
    np.testing.assert_array_equal(np.moveaxis(region, 0, -1), image)


def test_sixteen_bit_pngs_keep_their_sixteen_bits(tmp_path: Path) -> None:
    """Pillow clipped a 16-bit grey PNG to 8 bits (99.6 % of a ramp read as 255) and reduces
    16-bit colour to 8 bits: both are now read as stored -- grey as one intensity channel,
    colour as RGB, an alpha channel composited over the background (white glass for colour,
    0 for grey), in integers."""
    import imagecodecs

    rng = np.random.default_rng(3)
    grey = rng.integers(0, 65536, (37, 53), dtype=np.uint16)
    rgba = rng.integers(0, 65536, (37, 53, 4), dtype=np.uint16)
    cases = {
        "grey.png": (grey, grey[None], ("c0",)),
        "rgb.png": (rgba[..., :3], np.moveaxis(rgba[..., :3], -1, 0), ("red", "green", "blue")),
    }
    a = rgba[..., 3:].astype(np.uint64)
    over_white = (rgba[..., :3].astype(np.uint64) * a + 65535 * (65535 - a) + 32767) // 65535
    cases["rgba.png"] = (rgba, np.moveaxis(over_white, -1, 0), ("red", "green", "blue"))
    for name, (stored, want, names) in cases.items():
        (tmp_path / name).write_bytes(imagecodecs.png_encode(np.ascontiguousarray(stored)))
        reader = open_slide(tmp_path / name)
        got = reader.read_region(0, 0, 0, 37, 53)
        assert got.dtype == np.uint16 and reader.channel_names == names, name
        assert np.array_equal(got, want), name


@pytest.mark.parametrize("orientation", range(1, 9))
def test_the_exif_orientation_is_applied(tmp_path: Path, orientation: int) -> None:
    """A camera's or scanner's EXIF orientation (a JPEG on its side was read as stored):
    the image is read upright, as Pillow's ``exif_transpose`` shows it."""
    from PIL import ImageOps

    image = Image.fromarray(_image((40, 60), seed=orientation))
    exif = Image.Exif()
    exif[274] = orientation
    image.save(tmp_path / "side.png", exif=exif)
    upright = np.asarray(ImageOps.exif_transpose(Image.open(tmp_path / "side.png")))
    reader = open_slide(tmp_path / "side.png")
    h, w = reader.level_dimensions[0]
    assert (h, w) == upright.shape[:2]
    assert np.array_equal(reader.read_region(0, 0, 0, h, w), np.moveaxis(upright, -1, 0))


def test_tiff_colour_forms_are_read_as_the_colours_a_viewer_shows(tmp_path: Path) -> None:
    """Associated (premultiplied) alpha was composited as unassociated (darkened); a palette
    TIFF was read as its indices; a MINISWHITE one as stored (0 is white): each is now read
    as the colours it stands for, exactly."""
    import tifffile

    from hyfi_imaging.io.tiff_reader import TiffReader

    rng = np.random.default_rng(5)
    colour = rng.integers(0, 256, (32, 48, 3), dtype=np.uint16)
    alpha = rng.integers(0, 256, (32, 48, 1), dtype=np.uint16)
    stored = np.concatenate([(colour * alpha + 127) // 255, alpha], -1).astype(np.uint8)
    tifffile.imwrite(tmp_path / "assoc.tif", stored, photometric="rgb",
                     extrasamples=["assocalpha"], tile=(16, 16))  # fmt: skip
    over_white = np.minimum(
        (stored[..., :3].astype(np.uint32) * 255 + 255 * (255 - alpha) + 127) // 255, 255
    )
    got = TiffReader(tmp_path / "assoc.tif").read_region(0, 0, 0, 32, 48)
    assert np.array_equal(got, np.moveaxis(over_white, -1, 0).astype(np.uint8))

    index = rng.integers(0, 4, (32, 48), dtype=np.uint8)
    for bits in (8, 16):
        cmap = np.zeros((3, 256), np.uint16)
        cmap[:, :4] = rng.integers(0, 256, (3, 4)) * (257 if bits == 8 else 1)
        if bits == 16:
            cmap[0, 0] = 1001  # not an 8-bit value: the colours stay 16-bit
        tifffile.imwrite(tmp_path / "palette.tif", index, photometric="palette", colormap=cmap,
                         tile=(16, 16))  # fmt: skip
        reader = TiffReader(tmp_path / "palette.tif")
        want = cmap[:, index] // (257 if bits == 8 else 1)
        assert reader.channel_names == ("red", "green", "blue") and reader.background > 0
        assert reader.read_region(0, 0, 0, 32, 48).dtype == (np.uint8 if bits == 8 else np.uint16)
        assert np.array_equal(reader.read_region(0, 0, 0, 32, 48), want), bits

    grey = rng.integers(0, 65536, (32, 48), dtype=np.uint16)
    tifffile.imwrite(tmp_path / "white.tif", grey, photometric="miniswhite", tile=(16, 16))
    got = TiffReader(tmp_path / "white.tif").read_region(0, 0, 0, 32, 48)
    assert np.array_equal(got, (65535 - grey)[None])


def test_svs_levels_below_the_first_are_read_as_stored(tmp_path: Path) -> None:
    """An SVS of floor(n / 2) levels: OpenSlide divides a level-0 origin by the averaged
    downsample (2.00067) and interpolated between the level's pixels (90 % of a level-1
    read differed from the page, by up to 72); the level is now read from its page."""
    import tifffile

    from hyfi_imaging.io.openslide_reader import OpenSlideReader

    rng = np.random.default_rng(12)
    size = (997, 1013)
    levels = [rng.integers(0, 230, (size[0] >> k, size[1] >> k, 3), dtype=np.uint8) for k in range(3)]  # fmt: skip
    path = tmp_path / "floor.svs"
    with tifffile.TiffWriter(path) as tif:
        for k, lv in enumerate(levels):
            head = f"Aperio Image Library v12.0.0\r\n{size[1]}x{size[0]} (256x256) RAW/RGB"
            desc = head + ("|AppMag = 20|MPP = 0.5" if k == 0 else f" -> {lv.shape[1]}x{lv.shape[0]} D={2**k}")  # fmt: skip
            tif.write(lv, description=desc, metadata=None, photometric="rgb", tile=(256, 256))
            if k == 0:  # an SVS's second page is its thumbnail, stripped
                thumb = f"Aperio Image Library v12.0.0\r\n{size[1]}x{size[0]} -> 120x118"
                tif.write(levels[2][:118, :120], description=thumb, metadata=None,
                          photometric="rgb")  # fmt: skip
    with OpenSlideReader(path) as reader:
        assert reader.format == "aperio" and len(reader.level_dimensions) == 3
        for k in (0, 1, 2):
            page = np.moveaxis(levels[k], -1, 0)
            for y, x in ((0, 0), (3, 5), (117, 201), (200, 220)):
                got = reader.read_region(k, y, x, 16, 24)
                assert np.array_equal(got, page[:, y : y + 16, x : x + 24]), (k, y, x)


def test_eight_bit_grey_pictures_are_one_intensity_channel(tmp_path: Path) -> None:
    """An 8-bit grey PNG or JPEG was made RGB (a 16-bit grey PNG and a grey TIFF are one
    channel): its light glass then went the bright-field tissue rule, whose grey Otsu cut
    away faint tissue and isolated cells without a word. One channel now, an alpha over 0."""
    rng = np.random.default_rng(5)
    grey = rng.integers(0, 256, (31, 47), dtype=np.uint8)
    alpha = rng.integers(0, 256, (31, 47), dtype=np.uint8)
    Image.fromarray(grey).save(tmp_path / "grey.png")
    Image.fromarray(np.stack([grey, alpha], -1), mode="LA").save(tmp_path / "grey-alpha.png")
    Image.fromarray(grey).save(tmp_path / "grey.jpg", quality=100)
    with open_slide(tmp_path / "grey.png") as r:
        assert r.channels == 1 and np.array_equal(r.read_region(0, 0, 0, 31, 47), grey[None])
    over_zero = (grey.astype(np.uint16) * alpha + 127) // 255
    with open_slide(tmp_path / "grey-alpha.png") as r:
        assert np.array_equal(r.read_region(0, 0, 0, 31, 47), over_zero[None])
    with open_slide(tmp_path / "grey.jpg") as r:
        assert r.channels == 1 and r.format == "jpeg"
        assert np.abs(r.read_region(0, 0, 0, 31, 47).astype(int) - grey).max() <= 8


def test_a_tiff_is_read_by_its_base_page_not_its_first(tmp_path: Path) -> None:
    """A generic TIFF whose page 0 is a small preview at 2 µm/px and whose larger page is the
    image at 0.5 µm/px: the resolution was taken from page 0 (the 0.5 µm/px image stored as
    2 µm/px); it is the base page's, the one read."""
    import tifffile

    rgb = _image((48, 64), seed=21)
    with tifffile.TiffWriter(tmp_path / "preview-first.tif") as tif:
        tif.write(rgb[::4, ::4], photometric="rgb", resolution=(1e4 / 2.0, 1e4 / 2.0),
                  resolutionunit="CENTIMETER", metadata=None)  # fmt: skip
        tif.write(rgb, photometric="rgb", resolution=(1e4 / 0.5, 1e4 / 0.5),
                  resolutionunit="CENTIMETER", metadata=None, tile=(16, 16))  # fmt: skip
    with open_slide(tmp_path / "preview-first.tif") as reader:
        assert reader.level_dimensions[0] == (48, 64)
        assert (reader.mpp, reader.mpp_source) == (pytest.approx(0.5), "tiff-resolution")
        assert np.array_equal(reader.read_region(0, 0, 0, 48, 64), np.moveaxis(rgb, -1, 0))


@pytest.mark.parametrize(("unit", "mpp"), [("um", 0.65), ("micron", 0.65), ("mm", 0.5e-3)])
def test_a_fiji_tiff_gives_its_resolution_in_its_own_unit(
    tmp_path: Path, unit: str, mpp: float
) -> None:
    """Fiji/ImageJ writes ResolutionUnit none and its unit in the description ("unit=um"):
    the slide was called one that "does not record its resolution"."""
    import tifffile

    grey = np.random.default_rng(23).integers(0, 4000, (3, 32, 40), dtype=np.uint16)
    tifffile.imwrite(tmp_path / "fiji.tif", grey, imagej=True, resolution=(1 / mpp, 1 / mpp),
                     metadata={"axes": "CYX", "unit": unit})  # fmt: skip
    with open_slide(tmp_path / "fiji.tif") as reader:
        want = mpp * (1e3 if unit == "mm" else 1.0)
        assert (reader.mpp, reader.mpp_source) == (pytest.approx(want), "tiff-resolution")


def test_an_unspecified_fourth_tiff_sample_is_not_an_alpha(tmp_path: Path) -> None:
    """RGBX: a 4th sample that ExtraSamples calls unspecified (0) was composited as alpha,
    and its 0 pad made the whole slide white; it is dropped (as Pillow reads it), while
    ExtraSamples 2 stays an alpha."""
    import tifffile

    rgbx = np.random.default_rng(22).integers(0, 256, (24, 40, 4), dtype=np.uint8)
    rgbx[..., 3] = 0
    tifffile.imwrite(tmp_path / "rgbx.tif", rgbx, photometric="rgb", extrasamples=[0])
    with open_slide(tmp_path / "rgbx.tif") as reader:
        assert reader.channels == 3
        assert np.array_equal(
            reader.read_region(0, 0, 0, 24, 40), np.moveaxis(rgbx[..., :3], -1, 0)
        )
    tifffile.imwrite(tmp_path / "rgba.tif", rgbx, photometric="rgb", extrasamples=[2])
    with open_slide(tmp_path / "rgba.tif") as reader:  # alpha 0 everywhere: white glass
        assert (reader.read_region(0, 0, 0, 24, 40) == 255).all()


@pytest.mark.parametrize("orientation", [2, 3, 6, 8])
def test_a_turned_tiff_is_refused_not_read_as_stored(tmp_path: Path, orientation: int) -> None:
    """A TIFF Orientation (tag 274) other than top-left was ignored (PNG/JPEG EXIF is applied):
    the slide was stored turned or mirrored without a word. It is refused in one line that
    names the value and the fix; Orientation 1 written out reads as before."""
    import tifffile

    rgb = _image((24, 40), seed=orientation)
    tifffile.imwrite(tmp_path / "turned.tif", rgb, photometric="rgb",
                     extratags=[(274, "H", 1, orientation, True)])  # fmt: skip
    with pytest.raises(SlideError, match=rf"Orientation \(tag 274\) is {orientation} ") as info:
        open_slide(tmp_path / "turned.tif")
    assert "\n" not in str(info.value) and "rewrite the file upright" in str(info.value)
    tifffile.imwrite(tmp_path / "upright.tif", rgb, photometric="rgb",
                     extratags=[(274, "H", 1, 1, True)])  # fmt: skip
    with open_slide(tmp_path / "upright.tif") as reader:
        assert np.array_equal(reader.read_region(0, 0, 0, 24, 40), np.moveaxis(rgb, -1, 0))


def _level(folder: Path, name: str, image: np.ndarray, n: int, **options: Any) -> Path:
    """One level of the series ``5.1`` in ``folder``, with ImageType unless told."""
    options = {"mpp": 0.25, "tile": 32, **options}
    return write_wsi_level(
        folder / name, np.ascontiguousarray(image), series="5.1", instance=f"5.1.{n}", **options
    )


def test_dicom_optical_paths_are_refused_not_mixed(tmp_path: Path) -> None:
    """A level of two optical paths (its frames: every tile once per path) was read by
    OpenSlide as one tile-by-tile mix of the paths; it is refused in one line, with
    ImageType (OpenSlide's series) or without (hyfi-imaging's reader)."""
    image = _image((80, 104), seed=31)
    for folder, image_type in ((tmp_path / "it", "DERIVED\\PRIMARY\\VOLUME\\NONE"),
                               (tmp_path / "no-it", None)):  # fmt: skip
        folder.mkdir()
        path = _level(folder, "l0.dcm", image, 1, optical_paths=2, positions=True,
                      organization="TILED_SPARSE", image_type=image_type)  # fmt: skip
        with pytest.raises(SlideError, match=r"2 optical path\(s\) and 1 focal plane") as info:
            open_slide(path)
        assert "\n" not in str(info.value) and "export one focal plane" in str(info.value)


def test_dicom_levels_below_the_first_are_read_as_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 161 x 201 level 0 over an 81 x 101 level 1 (not an exact half): OpenSlide
    interpolated level 1 (98 % of a read differed from its frames, by up to 54); it is read
    from the level's own frames. Where those cannot be read, a level OpenSlide would
    interpolate is refused in one line, and one of a whole factor is still read."""
    from hyfi_imaging.io import dicom_reader
    from hyfi_imaging.io.openslide_reader import OpenSlideReader

    rng = np.random.default_rng(32)
    l0 = rng.integers(0, 256, (161, 201, 3), dtype=np.uint8)
    l1 = rng.integers(0, 256, (81, 101, 3), dtype=np.uint8)
    _level(tmp_path, "l0.dcm", l0, 1)
    _level(tmp_path, "l1.dcm", l1, 2, mpp=0.5)
    with open_slide(tmp_path / "l0.dcm") as reader:
        assert isinstance(reader, OpenSlideReader) and reader.level_dimensions[1] == (81, 101)
        for y, x in ((0, 0), (19, 24), (50, 70)):
            got = reader.read_region(1, y, x, 31, 31)
            assert np.array_equal(got, np.moveaxis(l1[y : y + 31, x : x + 31], -1, 0)), (y, x)

    def unreadable(*args: Any, **kwargs: Any) -> None:
        raise SlideError("x", "frames hyfi-imaging cannot read", "none")

    monkeypatch.setattr(dicom_reader, "DicomReader", unreadable)
    with open_slide(tmp_path / "l0.dcm") as reader:
        assert np.array_equal(reader.read_region(0, 0, 0, 161, 201), np.moveaxis(l0, -1, 0))
        with pytest.raises(SlideError, match="OpenSlide would interpolate") as info:
            reader.read_region(1, 19, 24, 31, 31)
        assert "\n" not in str(info.value) and "--level 0" in str(info.value)
    exact = tmp_path / "exact"
    exact.mkdir()
    _level(exact, "l0.dcm", l0[:160, :192], 1)
    _level(exact, "l1.dcm", l1[:80, :96], 2, mpp=0.5)
    with open_slide(exact / "l0.dcm") as reader:
        got = reader.read_region(1, 19, 24, 31, 31)
        assert np.array_equal(got, np.moveaxis(l1[19:50, 24:55], -1, 0))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_grey_dicom_with_image_type_reads_exactly(tmp_path: Path, dtype: type) -> None:
    """MONOCHROME2 levels with ImageType went to OpenSlide, which cannot read them
    ("Couldn't read PlanarConfiguration"); without ImageType they read exactly. Both do now."""
    grey = np.random.default_rng(33).integers(0, np.iinfo(dtype).max + 1, (80, 104), dtype=dtype)
    path = _level(tmp_path, "grey.dcm", grey, 1)
    with open_slide(path) as reader:
        assert (reader.format, reader.channels, reader.dtype, reader.mpp) == (
            "dicom",
            1,
            dtype,
            0.25,
        )
        assert np.array_equal(reader.read_region(0, 0, 0, 80, 104), grey[None])


def test_dicom_frames_without_pixels_or_outside_the_image_are_refused(tmp_path: Path) -> None:
    """Rows 0 raised ZeroDivisionError; frames placed wholly outside the total pixel matrix
    read as a white slide, exit 0. Both are refused in one line."""
    image = _image((64, 96), seed=34)
    path = _level(tmp_path, "rows0.dcm", image, 1, image_type=None)
    rows = b"\x28\x00\x10\x00US\x02\x00\x20\x00"  # (0028,0010) Rows = 32
    data = path.read_bytes()
    assert data.count(rows) == 1
    path.write_bytes(data.replace(rows, rows[:-2] + b"\x00\x00"))
    with pytest.raises(SlideError, match=r"frames of 0 x 32 px \(Rows, Columns\)") as info:
        open_slide(path)
    assert "\n" not in str(info.value)
    path.unlink()
    path = _level(tmp_path, "outside.dcm", image, 1, image_type=None, positions=True,
                  organization="TILED_SPARSE", shift=(0, 96))  # fmt: skip
    with pytest.raises(SlideError, match="outside the 64 x 96 px total pixel matrix") as info:
        open_slide(path)
    assert "frame 1 starts at row 1, column 97" in str(info.value)
    assert "\n" not in str(info.value)
