"""Annotation files (ASAP XML, GeoJSON) in, labelled polygons in level-0 pixels out.

Why our own small parser: the two formats that matter for whole-slide
cohorts are simple, and the libraries that read them (shapely, ASAP's
multiresolutionimageinterface, QuPath's Java API) are heavy or not on PyPI.

* **ASAP XML** (CAMELYON16/17): ``<ASAP_Annotations><Annotations><Annotation
  Name=.. PartOfGroup=.. Type="Polygon"><Coordinates><Coordinate Order X Y/>``.
  The class of an annotation is its ``PartOfGroup``. ``Polygon``, ``Spline``
  (its control points) and ``Rectangle`` have an area; ``Dot``, ``PointSet``
  and ``Measurement`` do not and are passed over. Vertices are taken in
  ``Order``.
* **GeoJSON** (QuPath's export): a ``FeatureCollection``, a list of
  ``Feature``\\ s, one ``Feature`` or a bare geometry; ``Polygon`` (first ring
  the outline, further rings holes), ``MultiPolygon`` and
  ``GeometryCollection``. Points and lines have no area and are passed over.
  The class is ``properties.classification.name`` (or QuPath 0.4's
  ``classification.names`` joined with ``": "``), else ``properties.name``,
  else ``"unclassified"``.

Coordinates are continuous level-0 pixel coordinates, pixel ``i`` spanning
``[i, i + 1)`` (ASAP's and QuPath's convention), converted from the files'
``(x, y)`` to this library's ``(y, x)`` here, at the boundary.

**Classes to labels.** A label image holds integers, 0 the background. Class
names map to labels case-insensitively through :data:`DEFAULT_CLASSES`
(tumour-like names -> 1; CAMELYON16's groups ``_0``, ``_1`` -> 1 and ``_2``
-> 0) overridden by ``--annotation-classes name=int,...``. A class mapped to
0 is an *exclusion*: its area is background whatever else covers it
(CAMELYON16's ``_2`` regions are holes cut into the tumour outlines). A class
that maps to nothing fails the slide with the names found and the fix, rather
than silently dropping what a pathologist drew.
"""

from __future__ import annotations

import codecs
import json
import math
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hyfi_imaging.errors import ConfigError, SlideError
from hyfi_imaging.paths import under

__all__ = [
    "ANNOTATION_SUFFIXES",
    "DEFAULT_CLASSES",
    "AnnotationError",
    "AnnotationPolygon",
    "LabelledPolygon",
    "class_mapping",
    "find_annotation",
    "label_polygons",
    "parse_class_mapping",
    "read_annotations",
    "write_geojson",
]

#: Annotation file names looked for beside a slide's id, in this order.
ANNOTATION_SUFFIXES = (".xml", ".geojson", ".json")

#: Class name (case-insensitive) -> label value; 0 marks an exclusion.
DEFAULT_CLASSES: dict[str, int] = {
    "tumor": 1,
    "tumour": 1,
    "metastasis": 1,
    "metastases": 1,
    "carcinoma": 1,
    "cancer": 1,
    "_0": 1,
    "_1": 1,
    "_2": 0,
    "exclusion": 0,
    "exclude": 0,
    "ignore": 0,
}

_AREA_TYPES_ASAP = {"polygon", "spline", "rectangle"}
_NO_AREA_ASAP = {"dot", "pointset", "measurement"}
_FIX_FILE = "fix or re-export the annotation file, or move it out of the --annotations folder"


class AnnotationError(SlideError):
    """An annotation file cannot be read, or names a class with no label."""


@dataclass(frozen=True)
class AnnotationPolygon:
    """One area of an annotation file, as drawn.

    ``rings[0]`` is the outline, further rings are holes; each ring is an
    ``(N, 2)`` float64 array of ``(y, x)`` level-0 coordinates (not closed:
    the last vertex joins the first).
    """

    class_name: str
    rings: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class LabelledPolygon:
    """An :class:`AnnotationPolygon` with its label value (0: an exclusion)."""

    label: int
    rings: tuple[np.ndarray, ...]


def _numbers(points: object) -> bool:
    """Whether ``points`` is a list of lists of JSON numbers (``"0"`` and ``true`` are not:
    numpy read them as 0 and 1)."""
    return isinstance(points, list | tuple) and all(
        isinstance(pt, list | tuple)
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in pt)
        for pt in points
    )


def _ring(points: Sequence[Sequence[float]] | np.ndarray, where: str) -> np.ndarray:
    if not isinstance(points, np.ndarray) and not _numbers(points):
        raise ValueError(f"{where}: a ring must be a list of finite [x, y] pairs of numbers")
    try:
        arr = np.asarray(points, dtype=np.float64)
    except (TypeError, ValueError):
        arr = np.empty(0)
    if arr.ndim != 2 or arr.shape[1] < 2 or not np.isfinite(arr[:, :2]).all():
        raise ValueError(f"{where}: a ring must be a list of finite [x, y] pairs")
    yx = arr[:, [1, 0]]
    if len(yx) > 1 and np.array_equal(yx[0], yx[-1]):
        yx = yx[:-1]  # GeoJSON closes rings explicitly
    return np.ascontiguousarray(yx)


def _read_asap(path: Path) -> list[AnnotationPolygon]:
    root = ET.parse(path).getroot()
    if root.tag != "ASAP_Annotations":
        raise ValueError(f"the root element is <{root.tag}>, not <ASAP_Annotations>")
    out = []
    for i, ann in enumerate(root.iter("Annotation")):
        kind = (ann.get("Type") or "Polygon").casefold()
        name = ann.get("Name") or f"#{i}"
        if kind in _NO_AREA_ASAP:
            continue
        if kind not in _AREA_TYPES_ASAP:
            raise ValueError(f"annotation {name!r} has an unknown Type {ann.get('Type')!r}")
        coords: list[tuple[float, float, float]] = []
        for c in ann.iter("Coordinate"):
            try:
                order = float(c.get("Order", len(coords)))
                x = float(str(c.get("X")).replace(",", "."))
                y = float(str(c.get("Y")).replace(",", "."))
            except ValueError:
                raise ValueError(
                    f"annotation {name!r}: coordinate {c.attrib} is not numeric"
                ) from None
            coords.append((order, x, y))
        coords.sort(key=lambda t: t[0])
        points = [(x, y) for _, x, y in coords]
        if kind == "rectangle" and len(points) == 2:  # two opposite corners
            (xa, ya), (xb, yb) = points
            points = [(xa, ya), (xb, ya), (xb, yb), (xa, yb)]
        if len(points) < 3:
            continue  # no area: nothing to paint
        out.append(AnnotationPolygon(ann.get("PartOfGroup") or "None", (_ring(points, name),)))
    return out


def _class_of(properties: Any) -> str:
    if not isinstance(properties, dict):
        return "unclassified"
    cls = properties.get("classification")
    if isinstance(cls, dict):
        if isinstance(cls.get("name"), str):
            return str(cls["name"])
        if isinstance(cls.get("names"), list):
            return ": ".join(str(n) for n in cls["names"])
    if isinstance(cls, str):
        return cls
    name = properties.get("name")
    return name if isinstance(name, str) and name else "unclassified"


def _geometry_polygons(geometry: Any, class_name: str, where: str) -> list[AnnotationPolygon]:
    if geometry is None:
        return []
    if not isinstance(geometry, dict) or "type" not in geometry:
        raise ValueError(f"{where}: a geometry must be an object with a 'type'")
    kind = geometry["type"]
    if kind == "GeometryCollection":
        return [
            p
            for k, g in enumerate(geometry.get("geometries", []))
            for p in _geometry_polygons(g, class_name, f"{where} geometry {k}")
        ]
    if kind in ("Point", "MultiPoint", "LineString", "MultiLineString"):
        return []
    coords = geometry.get("coordinates")
    if kind == "Polygon":
        polygons = [coords]
    elif kind == "MultiPolygon":
        polygons = coords if isinstance(coords, list) else None  # type: ignore[assignment]
    else:
        raise ValueError(f"{where}: unknown geometry type {kind!r}")
    if not isinstance(polygons, list):
        raise ValueError(f"{where}: {kind} coordinates must be a list")
    out = []
    for k, rings in enumerate(polygons):
        if not isinstance(rings, list) or not rings:
            raise ValueError(f"{where} polygon {k}: a polygon must be a non-empty list of rings")
        out.append(
            AnnotationPolygon(
                class_name,
                tuple(_ring(r, f"{where} polygon {k} ring {j}") for j, r in enumerate(rings)),
            )
        )
    return out


def _read_geojson(path: Path) -> list[AnnotationPolygon]:
    data = json.loads(path.read_bytes())  # UTF-8 (a byte-order mark too), UTF-16 or UTF-32
    if isinstance(data, dict) and data.get("type") == "FeatureCollection":
        features = data.get("features")
    elif isinstance(data, dict) and data.get("type") == "Feature":
        features = [data]
    elif isinstance(data, dict) and "type" in data:
        features = [{"type": "Feature", "geometry": data, "properties": {}}]
    else:
        features = data
    if not isinstance(features, list):
        raise ValueError("not GeoJSON: expected a FeatureCollection, a Feature or a list of them")
    out = []
    for i, feature in enumerate(features):
        if not isinstance(feature, dict) or feature.get("type") != "Feature":
            raise ValueError(f"feature {i} is not a GeoJSON Feature")
        out += _geometry_polygons(
            feature.get("geometry"), _class_of(feature.get("properties")), f"feature {i}"
        )
    return out


def read_annotations(path: str | Path) -> list[AnnotationPolygon]:
    """The polygons of an ASAP XML or GeoJSON file (by content, not by name).

    Raises:
        AnnotationError: the file cannot be read or is not a well-formed
            annotation file; the message names the file, the problem and the fix.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
        if not data:
            raise AnnotationError(p, "empty file (0 bytes)", _FIX_FILE)
        head = _text_start(data[:512])
        if head.startswith(b"<"):
            return _read_asap(p)
        if head[:1] in (b"{", b"["):
            return _read_geojson(p)
        raise ValueError("neither ASAP XML nor GeoJSON (the file starts with neither '<' nor '{')")
    except OSError as err:
        raise AnnotationError(
            p, f"cannot read the annotation file ({err.strerror or err})", _FIX_FILE
        ) from err
    except ET.ParseError as err:
        raise AnnotationError(p, f"not well-formed XML ({err})", _FIX_FILE) from err
    except json.JSONDecodeError as err:
        raise AnnotationError(p, f"not valid JSON ({err})", _FIX_FILE) from err
    except (ValueError, TypeError, KeyError) as err:
        raise AnnotationError(p, f"malformed annotation file ({err})", _FIX_FILE) from err
    except RecursionError:  # JSON nested thousands deep: the slide's "report a bug" line
        raise AnnotationError(p, "malformed annotation file (nested too deep)", _FIX_FILE) from None


def _text_start(head: bytes) -> bytes:
    """The first bytes of a text file as ASCII, past a byte-order mark (Excel's and Windows
    tools' UTF-8 ``EF BB BF``, UTF-16) and leading white space: a BOM read "starts with
    neither '<' nor '{'"."""
    for bom, codec in (
        (codecs.BOM_UTF8, "utf-8"),
        (codecs.BOM_UTF16_LE, "utf-16-le"),
        (codecs.BOM_UTF16_BE, "utf-16-be"),
    ):
        if head.startswith(bom):
            text = head[len(bom) :].decode(codec, errors="ignore")
            return text.lstrip().encode("ascii", errors="replace")
    return head.lstrip()


def parse_class_mapping(text: str) -> dict[str, int]:
    """``"Tumor=1,Stroma=2,_2=0"`` -> ``{"tumor": 1, "stroma": 2, "_2": 0}`` (names casefolded).

    Raises :class:`ConfigError` (a usage error) for anything else.
    """
    out: dict[str, int] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, value = item.rpartition("=")
        if not sep or not name.strip() or not value.strip().isdigit() or int(value) > 255:
            raise ConfigError(
                f"--annotation-classes {text!r}",
                f"{item!r} is not NAME=LABEL with a label from 0 to 255",
                "write e.g. Tumor=1,Stroma=2,Exclusion=0",
            )
        out[name.strip().casefold()] = int(value)
    return out


def class_mapping(overrides: Mapping[str, int] | None = None) -> dict[str, int]:
    """``overrides`` (keys casefolded, first: the first name of a value names its class in
    the label image), then the :data:`DEFAULT_CLASSES` that still mean what they say.

    A default group (the names of one default label) is dropped whole when an override
    moves one of its names to another label, or gives its label (other than 0, the
    exclusion) to another name: with ``Stroma=1,Tumor=2`` the tumour-like defaults stayed
    at 1 and drew "Tumour" outlines as stroma, and the label image named 1 "tumour". A
    polygon of a dropped name then fails its slide, naming it, like any unmapped class.
    """
    given = {k.casefold(): int(v) for k, v in (overrides or {}).items()}
    kept: dict[str, int] = {}
    for name, value in DEFAULT_CLASSES.items():
        group = {n for n, v in DEFAULT_CLASSES.items() if v == value}
        moved = any(given.get(n, value) != value for n in group)
        taken = value != 0 and any(v == value and n not in group for n, v in given.items())
        if name not in given and not (moved or taken):
            kept[name] = value
    return {**given, **kept}


def label_polygons(
    polygons: Iterable[AnnotationPolygon], classes: Mapping[str, int], path: str | Path
) -> list[LabelledPolygon]:
    """Give every polygon its label; unknown class names fail the slide (``path`` names it)."""
    polygons = list(polygons)

    def key(name: str) -> str:  # as --annotation-classes reads names: "Tumor " is tumor
        return name.strip().casefold()

    unknown = sorted({p.class_name for p in polygons if key(p.class_name) not in classes})
    if unknown:
        # the option as given, with the names added: "Tumour=1" alone replaced a mapping of
        # Stroma=1,Tumor=2 and drew tumour as label 1, the stroma's
        given = [f"{n}={v}" for n, v in classes.items() if DEFAULT_CLASSES.get(n) != v]
        label = "1" if not given else "LABEL"
        example = ",".join([*given, *(f"{n.strip()}={label}" for n in unknown[:2])])
        raise AnnotationError(
            path,
            f"class(es) {', '.join(map(repr, unknown))} have no label",
            f"map them with --annotation-classes {example} (0 marks an exclusion)",
        )
    return [LabelledPolygon(classes[key(p.class_name)], p.rings) for p in polygons]


def find_annotation(folder: Path, slide_id: str) -> Path | None:
    """The annotation file of ``slide_id`` in ``folder`` (``<id>.xml``, ``.geojson``, ``.json``).

    Raises:
        AnnotationError: more than one of them exists (which one is meant is unclear).
    """
    found = [under(folder, f"{slide_id}{s}") for s in ANNOTATION_SUFFIXES]
    found = [p for p in found if p.is_file()]
    if len(found) > 1:
        raise AnnotationError(
            folder,
            f"slide {slide_id!r} has {len(found)} annotation files "
            f"({', '.join(p.name for p in found)})",
            "keep one of them in the --annotations folder",
        )
    return found[0] if found else None


def write_geojson(
    path: str | Path,
    polygons: Sequence[Sequence[np.ndarray]],
    *,
    class_name: str = "Tumor",
    color: tuple[int, int, int] = (200, 0, 0),
) -> Path:
    """Write polygons (lists of ``(y, x)`` rings: outline, holes) as a QuPath-style FeatureCollection."""
    features = []
    for rings in polygons:
        coords = []
        for ring in rings:
            xy = [[_num(x), _num(y)] for y, x in np.asarray(ring, dtype=np.float64)]
            coords.append([*xy, xy[0]])
        features.append(
            {
                "type": "Feature",
                "geometry": {"type": "Polygon", "coordinates": coords},
                "properties": {
                    "objectType": "annotation",
                    "classification": {"name": class_name, "color": list(color)},
                },
            }
        )
    out = Path(path)
    out.write_text(json.dumps({"type": "FeatureCollection", "features": features}) + "\n")
    return out


def _num(v: float) -> float | int:
    return int(v) if math.isfinite(v) and float(v).is_integer() else float(v)
