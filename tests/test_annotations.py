"""Annotations: ASAP XML / GeoJSON parsing, the scanline fill against an independent
winding-number test, labels in the store aligned through the crop, resume, bad files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from hyfi_imaging.cli.preprocess import main as preprocess_main
from hyfi_imaging.data.synthetic import render_synthetic, write_synthetic_slide
from hyfi_imaging.data.tiles import read_label_tile, tile_region
from hyfi_imaging.io.annotations import (
    DEFAULT_CLASSES,
    AnnotationError,
    AnnotationPolygon,
    LabelledPolygon,
    class_mapping,
    find_annotation,
    label_polygons,
    parse_class_mapping,
    read_annotations,
)
from hyfi_imaging.io.labels import downsample_labels_2x, label_names, open_labels
from hyfi_imaging.io.zarr_store import read_hyfi_attrs
from hyfi_imaging.preprocess import PreprocessOptions, run_preprocess
from hyfi_imaging.preprocess.rasterize import fill_polygon, rasterize_labels

ASAP = """<?xml version="1.0"?>
<ASAP_Annotations>
  <Annotations>
    <Annotation Name="Annotation 0" Type="Polygon" PartOfGroup="_0" Color="#F4FA58">
      <Coordinates>
        <Coordinate Order="2" X="30.5" Y="40" />
        <Coordinate Order="0" X="10" Y="20" />
        <Coordinate Order="1" X="30,5" Y="20" />
        <Coordinate Order="3" X="1.0e1" Y="40" />
      </Coordinates>
    </Annotation>
    <Annotation Name="Annotation 1" Type="Spline" PartOfGroup="Tumor">
      <Coordinates>
        <Coordinate Order="0" X="0" Y="0" /><Coordinate Order="1" X="5" Y="0" />
        <Coordinate Order="2" X="5" Y="5" />
      </Coordinates>
    </Annotation>
    <Annotation Name="Annotation 2" Type="Polygon" PartOfGroup="_2">
      <Coordinates>
        <Coordinate Order="0" X="15" Y="25" /><Coordinate Order="1" X="20" Y="25" />
        <Coordinate Order="2" X="20" Y="30" /><Coordinate Order="3" X="15" Y="30" />
      </Coordinates>
    </Annotation>
    <Annotation Name="a dot" Type="Dot" PartOfGroup="Tumor">
      <Coordinates><Coordinate Order="0" X="1" Y="1" /></Coordinates>
    </Annotation>
  </Annotations>
  <AnnotationGroups><Group Name="_0" PartOfGroup="None" /></AnnotationGroups>
</ASAP_Annotations>
"""


def _square(y: float, x: float, h: float, w: float) -> list[list[float]]:
    """A closed GeoJSON ring ``[x, y]`` of a rectangle."""
    return [[x, y], [x + w, y], [x + w, y + h], [x, y + h], [x, y]]


def _feature(geometry: dict, **properties: object) -> dict:
    return {"type": "Feature", "geometry": geometry, "properties": properties}


# ---------------------------------------------------------------- parsing


def test_asap_xml_polygons_classes_and_exclusions(tmp_path: Path) -> None:
    path = tmp_path / "tumor_001.xml"
    path.write_text(ASAP)
    polygons = read_annotations(path)
    # The dot has no area and is passed over; vertices come in Order, as (y, x).
    assert [p.class_name for p in polygons] == ["_0", "Tumor", "_2"]
    assert polygons[0].rings[0].tolist() == [[20, 10], [20, 30.5], [40, 30.5], [40, 10]]
    labelled = label_polygons(polygons, class_mapping(), path)
    assert [p.label for p in labelled] == [1, 1, 0]  # CAMELYON16: _0, _1 tumour, _2 a hole
    # A class without a label fails, naming the class and the fix.
    other = [AnnotationPolygon("Stroma", polygons[0].rings)]
    with pytest.raises(AnnotationError, match=r"'Stroma'.*--annotation-classes Stroma=1") as info:
        label_polygons(other, class_mapping(), path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)
    mapping = class_mapping(parse_class_mapping("stroma=2, TUMOR=3"))
    assert [p.label for p in label_polygons(other + polygons[1:2], mapping, path)] == [2, 3]
    # a name with a trailing space (as drawn in a tool) could never be mapped: the option
    # strips names, the lookup did not
    spaced = [AnnotationPolygon("Stroma ", polygons[0].rings)]
    assert [p.label for p in label_polygons(spaced, mapping, path)] == [2]
    # Tumor moved to 3: its default synonyms at 1 went on drawing 'Tumour' as label 1; now
    # the group is dropped and such an outline fails its slide, named
    assert "tumour" not in mapping and "_0" not in mapping and mapping["_2"] == 0
    # the refusal's fix keeps the user's mapping (printed as asked, 'Tumour=1' alone replaced
    # it and drew tumour as the label the user gave stroma)
    with pytest.raises(AnnotationError, match=r"stroma=2,tumor=3,Tumour=LABEL \(0 marks"):
        label_polygons([AnnotationPolygon("Tumour", polygons[0].rings)], mapping, path)
    # Stroma given 1: the tumour-like names stayed at 1 (drawn as stroma), and the label
    # image named value 1 'tumour' (the defaults came first)
    renumbered = class_mapping(parse_class_mapping("Stroma=1,Tumor=2"))
    assert list(renumbered)[:2] == ["stroma", "tumor"] and "metastasis" not in renumbered
    assert class_mapping(parse_class_mapping("Stroma=2")) == {"stroma": 2, **DEFAULT_CLASSES}


def test_geojson_holes_multipolygons_and_class_names(tmp_path: Path) -> None:
    features = [
        _feature(
            {"type": "Polygon", "coordinates": [_square(0, 0, 10, 10), _square(2, 2, 3, 3)]},
            classification={"name": "Tumor", "color": [200, 0, 0]},
        ),
        _feature(
            {
                "type": "MultiPolygon",
                "coordinates": [[_square(20, 20, 4, 4)], [_square(30, 30, 2, 2)]],
            },
            name="Stroma",
        ),
        _feature({"type": "Point", "coordinates": [1, 2]}, classification={"name": "Tumor"}),
        _feature({"type": "Polygon", "coordinates": [_square(0, 40, 2, 2)]}),
    ]
    collection = tmp_path / "a.geojson"
    collection.write_text(json.dumps({"type": "FeatureCollection", "features": features}))
    listed = tmp_path / "b.json"
    listed.write_text(json.dumps(features))  # QuPath's older export: a list of features
    for path in (collection, listed):
        polygons = read_annotations(path)
        assert [p.class_name for p in polygons] == ["Tumor", "Stroma", "Stroma", "unclassified"]
        assert len(polygons[0].rings) == 2  # outline and hole; closing vertex dropped
        assert polygons[0].rings[1].tolist() == [[2, 2], [2, 5], [5, 5], [5, 2]]
    labelled = label_polygons(
        read_annotations(collection)[:1], class_mapping(), collection
    )  # tumour with a hole of 3x3 pixels
    mask = rasterize_labels(labelled, (0, 0, 12, 12))
    assert mask.sum() == 100 - 9 and mask[3, 3] == 0 and mask[0, 0] == 1


def test_class_mapping_option_is_checked() -> None:
    assert parse_class_mapping("Tumor=1,_2=0") == {"tumor": 1, "_2": 0}
    for bad in ("Tumor", "Tumor=x", "=1", "Tumor=256"):
        with pytest.raises(ValueError, match="NAME=LABEL"):
            parse_class_mapping(bad)


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        ("broken.xml", "<ASAP_Annotations><Annotations>", "not well-formed XML"),
        ("other.xml", "<svg></svg>", "not <ASAP_Annotations>"),
        ("bad.geojson", '{"type": "FeatureCollection", "features": [', "not valid JSON"),
        (
            "ring.geojson",
            json.dumps(_feature({"type": "Polygon", "coordinates": [[[0, "a"], [1, 1]]]})),
            "finite",
        ),
        ("empty.json", "", r"empty file \(0 bytes\)"),
        ("blank.json", "\n  \n", "neither ASAP XML nor GeoJSON"),
    ],
)
def test_malformed_files_are_one_line_errors(
    tmp_path: Path, name: str, text: str, problem: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(AnnotationError, match=problem) as info:
        read_annotations(path)
    line = str(info.value)
    assert "\n" not in line and line.startswith(str(path)) and "fix or re-export" in line


def test_annotation_files_are_matched_by_slide_id(tmp_path: Path) -> None:
    (tmp_path / "tumor_001.xml").write_text(ASAP)
    assert find_annotation(tmp_path, "tumor_001") == tmp_path / "tumor_001.xml"
    assert find_annotation(tmp_path, "normal_001") is None
    (tmp_path / "tumor_001.geojson").write_text("[]")
    with pytest.raises(AnnotationError, match="2 annotation files"):
        find_annotation(tmp_path, "tumor_001")


# ---------------------------------------------------------------- rasterization


def _winding(rings: list[np.ndarray], ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """Winding number of points around ``rings`` (Sunday's is-left test, edge by edge)."""
    wn = np.zeros(ys.shape, dtype=np.int64)
    for ring in rings:
        for k in range(len(ring)):
            (ay, ax), (by, bx) = ring[k], ring[(k + 1) % len(ring)]
            left = (bx - ax) * (ys - ay) - (xs - ax) * (by - ay)
            up = (ay <= ys) & (by > ys) & (left > 0)
            down = (ay > ys) & (by <= ys) & (left < 0)
            wn += up.astype(np.int64) - down.astype(np.int64)
    return wn


def _centres(shape: tuple[int, int], origin: tuple[float, float] = (0, 0)) -> tuple:
    ii, jj = np.mgrid[: shape[0], : shape[1]]
    return ii + 0.5 + origin[0], jj + 0.5 + origin[1]


def _random_polygon(rng: np.random.Generator, kind: str, span: float) -> np.ndarray:
    n = int(rng.integers(3, 24))
    if kind == "star":  # concave, simple
        angle = np.sort(rng.uniform(0, 2 * np.pi, n))
        radius = rng.uniform(0.1, 0.6, n) * span
        centre = rng.uniform(-0.2, 1.2, 2) * span  # often across the border
        return np.stack(
            [centre[0] + radius * np.sin(angle), centre[1] + radius * np.cos(angle)], axis=1
        )
    return rng.uniform(-0.3, 1.3, (n, 2)) * span  # self-intersecting


@pytest.mark.parametrize("rule", ["nonzero", "evenodd"])
def test_fill_equals_an_independent_point_in_polygon_test(rule: str) -> None:
    from matplotlib.path import Path as MplPath

    rng = np.random.default_rng(12)
    shape = (37, 53)
    for trial in range(60):
        kind = "star" if trial % 2 else "tangle"
        ring = _random_polygon(rng, kind, 50.0)
        origin = (float(rng.uniform(-5, 5)), float(rng.uniform(-5, 5)))
        got = fill_polygon([ring], shape, origin=origin, rule=rule, band=int(rng.integers(1, 40)))
        ys, xs = _centres(shape, origin)
        wn = _winding([ring], ys, xs)
        expected = wn != 0 if rule == "nonzero" else wn % 2 == 1
        assert np.array_equal(got, expected), (trial, kind)
        if kind == "star":  # a third opinion on simple polygons
            inside = MplPath(ring[:, ::-1]).contains_points(np.stack([xs.ravel(), ys.ravel()], 1))
            assert np.array_equal(got, inside.reshape(shape)), trial


def test_bandwise_fill_equals_whole_image_fill() -> None:
    rng = np.random.default_rng(3)
    polygons = [
        LabelledPolygon(int(rng.integers(0, 4)), (_random_polygon(rng, "star", 90.0),))
        for _ in range(12)
    ]
    whole = rasterize_labels(polygons, (0, 0, 97, 89), band=97)
    for band in (1, 2, 7, 64):
        assert np.array_equal(rasterize_labels(polygons, (0, 0, 97, 89), band=band), whole)
    # Any window of the image is the same window of the whole rasterization.
    assert np.array_equal(rasterize_labels(polygons, (13, 40, 70, 89), band=5), whole[13:70, 40:])
    assert whole.max() > 0


def test_labels_paint_in_order_holes_and_exclusions_subtract() -> None:
    big = np.array([[0, 0], [0, 20], [20, 20], [20, 0]], float)
    small = big / 2
    hole = small + 2.0
    polygons = [
        LabelledPolygon(2, (small,)),
        LabelledPolygon(1, (big, hole)),  # the hole cuts only its own polygon
        LabelledPolygon(0, (big + 15,)),  # an exclusion clears every label
    ]
    out = rasterize_labels(polygons, (0, 0, 20, 20))
    assert out[5, 5] == 2  # larger label wins over the hole of label 1
    assert out[11, 11] == 0  # label 1's hole outside label 2
    assert out[1, 15] == 1 and out[17, 17] == 0


def test_label_pyramid_is_the_mode() -> None:
    labels = np.array([[[1, 1, 0, 2, 3], [0, 2, 0, 2, 3], [5, 5, 5, 5, 3]]], np.uint8)
    assert downsample_labels_2x(labels).tolist() == [[[1, 2, 3], [5, 5, 3]]]


# ---------------------------------------------------------------- preprocess


def _source_centres(
    attrs: dict, shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Level-0 source coordinates of canvas pixel centres, from the stored provenance only."""
    sy, sx, sh, sw = attrs["source_box"]
    py, px, ph, pw = attrs["placement"]
    ii, jj = _centres(shape)
    inside = (ii >= py) & (ii < py + ph) & (jj >= px) & (jj < px + pw)
    return sy + (ii - py) * sh / ph, sx + (jj - px) * sw / pw, inside


def test_stored_mask_equals_the_independent_rasterization_through_the_crop(
    tmp_path: Path,
) -> None:
    slides = tmp_path / "slides"
    slides.mkdir()
    write_synthetic_slide(slides / "s.svs", seed=4, label=0, size=(640, 896), compression="zlib")
    rng = np.random.default_rng(8)
    rings = [_random_polygon(rng, "star", 700.0) for _ in range(5)]
    hole = rings[0].mean(axis=0) + np.array([[-30, -30], [-30, 30], [30, 30], [30, -30]])
    features = [
        _feature(
            {"type": "Polygon", "coordinates": [r[:, ::-1].tolist(), hole[:, ::-1].tolist()]}
            if k == 0
            else {"type": "Polygon", "coordinates": [r[:, ::-1].tolist()]},
            classification={"name": "Tumor"},
        )
        for k, r in enumerate(rings)
    ]
    (slides / "s.geojson").write_text(
        json.dumps({"type": "FeatureCollection", "features": features})
    )
    out = tmp_path / "out"
    # A non-integer scale (0.5 -> 0.7 um/px) and a canvas that is not square.
    summary = run_preprocess(
        [slides / "s.svs"],
        out,
        PreprocessOptions(mpp=0.7, size=(512, 640), chunk=128, shard=256),
        annotations=slides,
        progress=False,
        qc=False,
    )
    assert summary.count("ok") == 1 and not summary.unannotated
    store = out / "s.zarr"
    attrs = read_hyfi_attrs(store)
    assert attrs is not None and attrs["annotations"]["source"] == str(
        (slides / "s.geojson").resolve()
    )
    assert label_names(store) == ["annotations"]
    with open_labels(store) as labels:
        assert labels.level_dimensions[:2] == ((512, 640), (256, 320))
        stored = labels.read_region(0, 0, 0, 512, 640)[0]
        level1 = labels.read_region(1, 0, 0, 256, 320)[0]
    ys, xs, inside = _source_centres(attrs, (512, 640))
    expected = np.zeros((512, 640), np.uint8)
    for k, ring in enumerate(rings):
        hit = _winding([ring], ys, xs) != 0
        if k == 0:
            hit &= _winding([hole], ys, xs) == 0
        expected[hit & inside] = 1
    assert stored.dtype == np.uint8 and expected.sum() > 1000
    assert np.array_equal(stored, expected)
    assert np.array_equal(level1, downsample_labels_2x(expected[None])[0])
    # A rank's tile plus halo, padded like the image tiles (background 0 past the border).
    region = tile_region((512, 640), (2, 2), (1, 1), halo=(13, 10), align=32)
    tile = read_label_tile(store, region)
    y, x, h, w = region.read
    padded = np.zeros((y + h, x + w), np.uint8)
    padded[:512, :640] = expected
    assert np.array_equal(tile, padded[y:, x:])


def test_synthetic_cohort_annotations_give_the_lesion_mask(tmp_path: Path) -> None:
    from hyfi_imaging.data.synthetic import write_synthetic_cohort

    slides = tmp_path / "slides"
    write_synthetic_cohort(slides, 2, seed=3, size=(384, 384), compression="zlib")
    geojson = sorted(p.name for p in slides.glob("*.geojson"))
    assert len(geojson) == 1  # the positive slide only, as CAMELYON16
    sid = geojson[0].removesuffix(".geojson")
    out = tmp_path / "out"
    summary = run_preprocess(
        [slides],
        out,
        PreprocessOptions(level=0, size=(384, 384), tissue="none", chunk=128, shard=256),
        annotations=slides,
        progress=False,
        qc=False,
    )
    assert summary.count("ok") == 2 and len(summary.unannotated) == 1
    assert summary.annotation_line() == "1 slide has no annotation file: background masks"
    i = int(sid.split("_")[1])
    truth = render_synthetic(seed=3 * 100003 + i, label=1, size=(384, 384)).lesion_mask
    with open_labels(out / f"{sid}.zarr") as labels:
        assert np.array_equal(labels.read_region(0, 0, 0, 384, 384)[0], truth.astype(np.uint8))
    (other,) = summary.unannotated
    with open_labels(out / f"{other}.zarr") as labels:
        assert not labels.read_region(0, 0, 0, 384, 384).any()


def test_resume_redoes_a_store_when_its_annotation_file_changes(tmp_path: Path) -> None:
    slides = tmp_path / "slides"
    slides.mkdir()
    for sid in ("a", "b"):
        write_synthetic_slide(slides / f"{sid}.svs", seed=1, label=0, size=(256, 256))
    ann = slides / "a.geojson"
    ann.write_text(
        json.dumps(
            [_feature({"type": "Polygon", "coordinates": [_square(40, 40, 60, 60)]}, name="Tumor")]
        )
    )
    options = PreprocessOptions(level=0, size=(256, 256), tissue="none", chunk=128, shard=256)

    def run() -> dict[str, str]:
        summary = run_preprocess(
            [slides], tmp_path / "out", options, annotations=slides, progress=False, qc=False
        )
        return {r.slide_id: r.status for r in summary.results}

    assert run() == {"a": "ok", "b": "ok"}
    assert run() == {"a": "skipped", "b": "skipped"}
    ann.write_text(ann.read_text().replace("40", "50"))
    os.utime(ann, ns=(ann.stat().st_atime_ns, ann.stat().st_mtime_ns + 10**9))
    assert run() == {"a": "ok", "b": "skipped"}
    with open_labels(tmp_path / "out" / "a.zarr") as labels:
        assert labels.read_region(0, 0, 0, 256, 256)[0, 45, 45] == 0  # the new polygon
    (slides / "b.xml").write_text(ASAP)  # an annotation file appears for b
    assert run() == {"a": "skipped", "b": "ok"}
    # Without --annotations the options differ: converted again, now without labels.
    plain = run_preprocess([slides], tmp_path / "out", options, progress=False, qc=False)
    assert {r.status for r in plain.results} == {"ok"}
    assert label_names(tmp_path / "out" / "a.zarr") == []


def test_a_malformed_annotation_file_fails_only_its_slide(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slides = tmp_path / "slides"
    slides.mkdir()
    for sid in ("good", "bad", "none"):
        write_synthetic_slide(slides / f"{sid}.svs", seed=2, label=0, size=(256, 256))
    (slides / "good.xml").write_text(ASAP)
    (slides / "bad.xml").write_text("<ASAP_Annotations><Annotation")
    out = tmp_path / "out"
    code = preprocess_main(
        [
            str(slides),
            "--out",
            str(out),
            "--level",
            "0",
            "--size",
            "256",
            "--quiet",
            "--annotations",
            str(slides),
            "--chunk",
            "128",
            "--shard",
            "256",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 1
    assert "3 slides: 2 converted, 0 already done, 1 failed" in printed
    assert "1 slide has no annotation file: background masks" in printed
    (failed,) = [line for line in printed.splitlines() if "FAILED" in line]
    assert str(slides / "bad.xml") in failed and "not well-formed XML" in failed
    assert "fix or re-export the annotation file" in failed
    assert (out / "good.zarr" / "labels" / "annotations").is_dir()
    assert not (out / "bad.zarr").exists()
    # An unknown class fails the same way, with the option that fixes it.
    (slides / "bad.xml").write_text(ASAP.replace('"Tumor"', '"Stroma"'))
    assert (
        preprocess_main(
            [
                str(slides),
                "--out",
                str(out),
                "--level",
                "0",
                "--size",
                "256",
                "--quiet",
                "--annotations",
                str(slides),
                "--chunk",
                "128",
                "--shard",
                "256",
            ]
        )
        == 1
    )
    assert "--annotation-classes Stroma=1" in capsys.readouterr().out
    assert (
        preprocess_main(
            [
                str(slides),
                "--out",
                str(out),
                "--level",
                "0",
                "--size",
                "256",
                "--quiet",
                "--annotations",
                str(slides),
                "--annotation-classes",
                "stroma=2",
                "--chunk",
                "128",
                "--shard",
                "256",
            ]
        )
        == 0
    )


def test_an_edge_on_a_row_of_pixel_centres_keeps_the_half_open_rule() -> None:
    """--mpp 0.3 --size 900 on a 512² slide at 0.5 µm/px: canvas row 449's centre maps onto
    the outline's bottom edge y = 256 exactly, outside by the rule; through the rounded
    source-rows-per-row it mapped to 449.50000000000006 and the row was labelled (27 px)."""
    from fractions import Fraction

    from hyfi_imaging.preprocess.canvas import CropPlan
    from hyfi_imaging.preprocess.rasterize import MaskRenderer

    plan = CropPlan((0, 0, 512, 512), (23, 23, 853, 853), 0, 0.3, (0, 0, 512, 512))
    ring = np.array([[240, 272], [240, 288], [256, 288], [256, 272]], float)
    mask = MaskRenderer([LabelledPolygon(1, (ring,))], plan, (900, 900)).read(0, 0, 900, 900)[0]
    rows = np.nonzero(mask.any(1))[0].tolist()
    want = [
        v for v in range(900) if 240 <= (Fraction(2 * v + 1, 2) - 23) * Fraction(512, 853) < 256
    ]
    assert rows == want


def test_annotation_files_of_no_slide_are_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Tumor_001.geojson beside slide tumor_001: the slide's mask was all background, said only
    as 'no annotation file'; the unclaimed file is named now, with the slide it nearly is."""
    from hyfi_imaging.preprocess.run import _match_annotations

    (tmp_path / "Tumor_001.geojson").write_text("{}")
    (tmp_path / "normal_002.xml").write_text("<x/>")
    (tmp_path / "notes.txt").write_text("not an annotation")
    todo = [("tumor_001", tmp_path / "a.tif"), ("normal_002", tmp_path / "b.tif")]
    with caplog.at_level("WARNING", logger="hyfi_imaging"):
        _, matched = _match_annotations(tmp_path, PreprocessOptions(), todo, {})
    assert matched == {"tumor_001": None, "normal_002": tmp_path / "normal_002.xml"}
    assert "1 annotation file(s)" in caplog.text
    assert "Tumor_001.geojson (slide tumor_001? ids match by exact name)" in caplog.text


def test_annotation_files_as_tools_write_them(tmp_path: Path) -> None:
    """A UTF-8 byte-order mark (Windows tools) was 'neither ASAP XML nor GeoJSON'; strings and
    booleans as coordinates were read as numbers ("0" -> 0, true -> 1); JSON nested deep
    escaped as a RecursionError (the slide's 'report a bug' line)."""
    square = {"type": "Polygon", "coordinates": [_square(0, 0, 10, 10)]}
    doc = {"type": "FeatureCollection", "features": [_feature(square)]}
    bom = tmp_path / "bom.geojson"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(doc).encode())
    assert len(read_annotations(bom)) == 1
    wide = tmp_path / "wide.geojson"
    wide.write_bytes(json.dumps(doc).encode("utf-16"))
    assert len(read_annotations(wide)) == 1
    strings = tmp_path / "strings.geojson"
    shape = {"type": "Polygon", "coordinates": [[["0", "0"], [True, "1e1"], [5, 5], ["0", "0"]]]}
    strings.write_text(json.dumps(_feature(shape)))
    with pytest.raises(AnnotationError, match="pairs of numbers"):
        read_annotations(strings)
    deep = tmp_path / "deep.geojson"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(AnnotationError, match="nested too deep"):
        read_annotations(deep)
