"""Honest resolution and channels (issue 22, item 2): what a slide came out at, and one kind per cohort.

Real files only: QPTIFF-like pages with a PerkinElmer ImageDescription XML and
OME-TIFFs written by tifffile, converted by the real hyfi-preprocess, checked
by the real ``hyfi-train --check`` and, in the slow test, a real run and
``hyfi-predict``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tifffile
import yaml
from PIL import Image

from hyfi_imaging.cli.preprocess import main as preprocess_main
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.io import open_slide
from hyfi_imaging.preprocess import PreprocessOptions, read_manifest, run_preprocess
from hyfi_imaging.preprocess.qc import QcChannels
from hyfi_imaging.train.config import load_recipe
from hyfi_imaging.train.preflight import (
    MPP_TOLERANCE,
    check_trained,
    cohort_facts,
    mpp_differs,
    run_facts,
)

#: A Vectra-like multiplex: the file's own colours (DAPI blue, FITC green, Cy3 yellow).
QPI = (("DAPI", "0,0,255"), ("FITC", "0,255,0"), ("Cy3", "255,255,0"))


def _banded(channels: int, hw: tuple[int, int], value: int = 40000) -> np.ndarray:
    """Channel ``i`` bright in the ``i``-th vertical band only (so a picture shows each alone)."""
    image = np.zeros((channels, *hw), np.uint16)
    band = hw[1] // channels
    for i in range(channels):
        image[i, :, i * band : (i + 1) * band] = value
    return image


def _write_qptiff(path: Path, image: np.ndarray, mpp: float = 0.5) -> None:
    """One tiled page per channel, each with a PerkinElmer-QPI description naming and colouring it."""
    with tifffile.TiffWriter(path) as tif:
        for (name, color), plane in zip(QPI, image, strict=True):
            desc = (
                '<?xml version="1.0" encoding="utf-8"?><PerkinElmer-QPI-ImageDescription>'
                "<DescriptionVersion>2</DescriptionVersion><ImageType>FullResolution</ImageType>"
                f"<Name>{name}</Name><Color>{color}</Color>"
                "</PerkinElmer-QPI-ImageDescription>"
            )
            tif.write(
                plane,
                tile=(64, 64),
                software="PerkinElmer-QPI",
                description=desc,
                metadata=None,
                resolution=(1e4 / mpp, 1e4 / mpp),
                resolutionunit="CENTIMETER",
            )


def _write_rgb(path: Path, hw: tuple[int, int], mpp: float | None = 0.5, seed: int = 0) -> None:
    """An 8-bit RGB (H&E-like) tiled TIFF: grey-pink noise on white glass."""
    rng = np.random.default_rng(seed)
    image = np.full((*hw, 3), 250, np.uint8)
    h, w = hw
    image[h // 8 : -h // 8, w // 8 : -w // 8] = rng.integers(
        90, 200, (h - 2 * (h // 8), w - 2 * (w // 8), 3)
    )
    tifffile.imwrite(
        path,
        image,
        photometric="rgb",
        tile=(64, 64),
        metadata=None,
        resolution=None if mpp is None else (1e4 / mpp, 1e4 / mpp),
        resolutionunit=None if mpp is None else "CENTIMETER",
    )


def _omero(store: Path) -> list[dict[str, object]]:
    attrs = json.loads((store / "zarr.json").read_text())["attributes"]
    channels: list[dict[str, object]] = attrs["ome"]["omero"]["channels"]
    return channels


def _recipe(tmp_path: Path, manifest: Path, *overrides: str) -> Path:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "dataset": {"name": "he", "task": "binary", "classes": ["neg", "pos"]},
                "model": {"name": "resnet18", "kwargs": {"width": 0.125}},
                "data": {"manifest": str(manifest)},
                "train": {"out_dir": str(tmp_path / "run")},
            }
        )
    )
    return recipe


def test_qptiff_and_ome_colours_reach_the_store_and_the_qc_picture(tmp_path: Path) -> None:
    hw = (96, 192)
    _write_qptiff(tmp_path / "vectra.qptiff", _banded(3, hw))
    with open_slide(tmp_path / "vectra.qptiff") as reader:
        assert reader.channel_names == ("DAPI", "FITC", "Cy3")
        assert reader.channel_colors == ("0000FF", "00FF00", "FFFF00")

    def convert(qc: QcChannels | None, out: str) -> tuple[list[str], list[tuple[int, ...]]]:
        summary = run_preprocess(
            [tmp_path / "vectra.qptiff"],
            tmp_path / out,
            PreprocessOptions(level=0, size=hw, tissue="none"),
            qc_channels=qc,
            progress=False,
        )
        assert not summary.failed, summary.failed
        colours = [str(c["color"]) for c in _omero(tmp_path / out / "vectra.zarr")]
        picture = np.asarray(Image.open(tmp_path / out / "qc" / "vectra.png").convert("RGB"))
        right = hw[1] + 8  # the output canvas, beside the source thumbnail
        return colours, [tuple(int(v) for v in picture[48, right + 32 + 64 * i]) for i in range(3)]

    # The file's own colours: in the store's omero metadata and in the QC picture (nuclei blue).
    colours, shown = convert(None, "own")
    assert colours == ["0000FF", "00FF00", "FFFF00"]
    assert shown == [(0, 0, 255), (0, 255, 0), (255, 255, 0)]
    # --qc-channels colours win, in the picture and in the store; unnamed channels keep theirs.
    colours, shown = convert(QcChannels.parse("Cy3:magenta,DAPI,1:FF8000"), "chosen")
    assert colours == ["0000FF", "FF8000", "FF00FF"]
    assert shown == [(0, 0, 255), (255, 128, 0), (255, 0, 255)]

    # OME-TIFF: the Channel Color attribute (signed RGBA) is the store's colour too.
    rgba = [0x0000FFFF, 0x00FF00FF, -16776961]  # blue, green, red (0xFF0000FF as int32)
    tifffile.imwrite(
        tmp_path / "mif.ome.tiff",
        _banded(3, hw),
        ome=True,
        tile=(64, 64),
        metadata={"axes": "CYX", "Channel": {"Name": ["DAPI", "FITC", "TRITC"], "Color": rgba}},
    )
    summary = run_preprocess(
        [tmp_path / "mif.ome.tiff"],
        tmp_path / "ome",
        PreprocessOptions(level=0, size=hw, tissue="none"),
        progress=False,
        qc=False,
    )
    assert not summary.failed, summary.failed
    assert [c["color"] for c in _omero(tmp_path / "ome" / "mif.zarr")] == [
        "0000FF",
        "00FF00",
        "FF0000",
    ]


def test_fit_that_changes_the_resolution_is_recorded_and_warned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slides = tmp_path / "slides"
    slides.mkdir()
    _write_rgb(slides / "big.tiff", (400, 600), seed=1)  # 300 x 200 µm: shrunk onto 128²
    _write_rgb(slides / "small.tiff", (120, 120), seed=2)  # fits at 0.5 µm/px
    (slides / "labels.csv").write_text("slide_id,label\nbig,neg\nsmall,pos\n")
    out = tmp_path / "data"
    args = ["--out", str(out), "--mpp", "0.5", "--size", "128", "--fit", "fit", "--tissue", "none"]
    code = preprocess_main([str(slides), *args, "--labels", str(slides / "labels.csv"), "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0
    rows = {r.slide_id: r for r in read_manifest(out / "manifest.csv")}
    big, small = rows["big"], rows["small"]
    # 400 x 600 px at 0.5 µm/px onto 128 x 128: shrunk by 128/600, so 0.5 / (128/600) µm/px.
    assert big.fit_scale == pytest.approx(128 / 600, rel=1e-5)
    assert big.mpp == pytest.approx(0.5 * 600 / 128, rel=1e-5)
    assert "2.34 µm/px instead of the 0.5 asked" in big.warning and "128x128" in big.warning
    assert (small.mpp, small.fit_scale, small.warning) == (0.5, 1.0, "")
    warned = [ln for ln in printed.splitlines() if "WARNING" in ln]
    assert len(warned) == 1 and warned[0].strip().startswith("WARNING big: --fit fit shrank")
    assert "fit_scale,warning" in (out / "manifest.csv").read_text().splitlines()[0]

    # hyfi-train --check trains it, saying in one line the range and the slides --fit shrank.
    from hyfi_imaging.cli.train import main as train_main

    recipe = _recipe(tmp_path, out / "manifest.csv")
    code = train_main([str(recipe), "--check"])
    err = capsys.readouterr().err.strip()
    assert code == 0 and len(err.splitlines()) == 1, err
    assert "the slides span 0.5-2.34 µm/px (--fit fit shrank big)" in err
    assert err.startswith("hyfi-train: warning: ") and "--fit crop" in err
    facts = cohort_facts(out / "manifest.csv")
    assert facts is not None and facts.mpp_range == pytest.approx((0.5, 0.5 * 600 / 128))
    assert facts.record()["fit_changed"] == ["big"]
    # A resumed run (same options) still records the change: the store remembers it.
    code = preprocess_main([str(slides), *args, "--labels", str(slides / "labels.csv"), "--quiet"])
    assert code == 0 and "WARNING big" in capsys.readouterr().out
    again = {r.slide_id: r for r in read_manifest(out / "manifest.csv")}
    assert again["big"].fit_scale == big.fit_scale and again["big"].warning == big.warning


def test_a_cohort_of_two_kinds_of_image_is_refused(tmp_path: Path) -> None:
    slides = tmp_path / "slides"
    slides.mkdir()
    _write_rgb(slides / "he.tiff", (96, 96))
    _write_qptiff(slides / "vectra.qptiff", _banded(3, (96, 96)))
    (slides / "labels.csv").write_text("slide_id,label\nhe,neg\nvectra,pos\n")
    options = PreprocessOptions(level=0, size=(96, 96), tissue="none")
    summary = run_preprocess(
        [slides],
        tmp_path / "data",
        options,
        labels_path=slides / "labels.csv",
        progress=False,
        qc=False,
    )
    assert not summary.failed, summary.failed
    with pytest.raises(ConfigError) as err:
        cohort_facts(tmp_path / "data" / "manifest.csv")
    line = str(err.value)
    assert "\n" not in line
    assert (
        "he hold 3 uint8 channels (red, green, blue), but vectra hold 3 uint16 (DAPI, FITC, Cy3)"
        in line
    )
    recipe = load_recipe(_recipe(tmp_path, tmp_path / "data" / "manifest.csv"))
    from hyfi_imaging.train.preflight import preflight

    with pytest.raises(ConfigError, match="slides hold different channels"):
        preflight(recipe, stores=True)


def test_unknown_resolution_is_compared_with_nothing_and_the_tolerance_holds(
    tmp_path: Path,
) -> None:
    slides = tmp_path / "slides"
    slides.mkdir()
    _write_rgb(slides / "a.tiff", (96, 96), mpp=0.5)
    _write_rgb(slides / "b.tiff", (96, 96), mpp=0.52)  # 4 % apart: one resolution
    _write_rgb(slides / "old.tiff", (96, 96), mpp=None)  # records none: compared with nothing
    summary = run_preprocess(
        [slides],
        tmp_path / "data",
        PreprocessOptions(level=0, size=(96, 96), tissue="none"),
        progress=False,
        qc=False,
    )
    assert not summary.failed, summary.failed
    (tmp_path / "val").mkdir()
    _write_rgb(tmp_path / "val" / "v.tiff", (96, 96), mpp=1.0)
    options = PreprocessOptions(level=0, size=(96, 96), tissue="none")
    run_preprocess([tmp_path / "val"], tmp_path / "vdata", options, progress=False, qc=False)
    facts = cohort_facts(tmp_path / "data" / "manifest.csv")
    # Validation slides outside the training slides' µm/px range: refused, naming them.
    manifests = [f"data.manifest={tmp_path / 'data'}", f"data.val_manifest={tmp_path / 'vdata'}"]
    recipe = load_recipe(_recipe(tmp_path, tmp_path / "data"), manifests)
    with pytest.raises(
        ConfigError, match=r"outside the training manifest .*'s 0.5-0.52 µm/px .*: v \(1\) µm/px"
    ):
        run_facts(recipe)
    assert facts is not None
    assert facts.ids == ("a", "b", "old") and facts.mpp == (0.5, 0.52, None)
    assert facts.mpp_range == (0.5, 0.52) and facts.channel_names == ("red", "green", "blue")
    assert facts.mixed_warning() is None  # 4 % apart: one resolution
    assert MPP_TOLERANCE == 0.05 and not mpp_differs(0.5, 0.524) and mpp_differs(0.5, 0.526)
    assert not mpp_differs(None, 3.0)
    trained = {"channel names": ["red", "green", "blue"], "mpp": 0.5}
    check_trained(facts, trained, "ckpt", "fix")  # within tolerance: passes
    check_trained(facts, {**trained, "mpp": [0.45, 0.5]}, "ckpt", "fix")  # a range: passes
    with pytest.raises(
        ConfigError,
        match=r"outside this checkpoint's 0.3-0.45 µm/px .*: a \(0.5\), b \(0.52\) µm/px",
    ):
        check_trained(facts, {**trained, "mpp": [0.3, 0.45]}, "ckpt", "fix")
    check_trained(facts, {"channel names": None, "mpp": None}, "ckpt", "fix")  # unknown: passes
    check_trained(facts, {}, "ckpt", "fix")  # a checkpoint from before: passes
    with pytest.raises(ConfigError) as err:
        check_trained(facts, {**trained, "mpp": 0.25}, "ckpt", "fix it")
    assert str(err.value) == (
        f"ckpt: resolution lies outside this checkpoint's 0.25 µm/px by more than 5% for slides "
        f"of {tmp_path / 'data' / 'manifest.csv'}: a (0.5), b (0.52) µm/px; preprocess them at "
        "0.25 µm/px (hyfi-preprocess --mpp 0.25), or fix it."
    )
    with pytest.raises(
        ConfigError, match=r"it has 3 \(DAPI, FITC, Cy3\), the slides of .* hold 3 uint8"
    ):
        check_trained(facts, {**trained, "channel names": ["DAPI", "FITC", "Cy3"]}, "ckpt", "fix")
    # The same channels as another pixel type: every input on another scale (a uint16 model
    # predicted uint8 slides at 1/256 of its range, and resumed on them, without a word).
    check_trained(facts, {**trained, "pixel type": "uint8"}, "ckpt", "fix")
    with pytest.raises(
        ConfigError, match=r"trained on uint16 pixels, the slides of .* hold 3 uint8 channels"
    ):
        check_trained(facts, {**trained, "pixel type": "uint16"}, "ckpt", "fix")


def test_the_manifest_states_the_stores_resolution(tmp_path: Path) -> None:
    """The µm/px check read the manifest's cell alone: a blank cell passed every store against
    any checkpoint, and a wrong one (an edited or foreign manifest) passed as what it said;
    ``hyfi-predict`` predicted 0.4 µm/px slides with a 1.6 µm/px model. The store's own
    record decides now."""
    import csv

    slides = tmp_path / "slides"
    slides.mkdir()
    _write_rgb(slides / "a.tiff", (96, 96), mpp=0.5)
    _write_rgb(slides / "b.tiff", (96, 96), mpp=0.5)
    options = PreprocessOptions(level=0, size=(96, 96), tissue="none")
    run_preprocess([slides], tmp_path / "data", options, progress=False, qc=False)
    manifest = tmp_path / "data" / "manifest.csv"
    rows = list(csv.DictReader(manifest.open()))

    def edited(a_mpp: str) -> Path:
        rows[0]["mpp"] = a_mpp
        with manifest.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        return manifest

    assert [r["slide_id"] for r in rows] == ["a", "b"]
    facts = cohort_facts(edited(""))  # blank: the store's
    assert facts is not None and facts.mpp == (0.5, 0.5)
    with pytest.raises(ConfigError) as err:
        check_trained(facts, {"mpp": 1.6}, "ckpt", "fix")
    assert "a (0.5), b (0.5) µm/px" in str(err.value)
    with pytest.raises(ConfigError, match=r"slide a: the manifest says 1.6 µm/px, its store .*a.zarr "
                       r"is at 0.5 \(the manifest was edited"):  # fmt: skip
        cohort_facts(edited("1.6"))


@pytest.mark.slow
def test_predict_and_resume_refuse_what_the_model_was_not_trained_on(tmp_path: Path) -> None:
    """A real one-step run at 0.5 µm/px; hyfi-predict on 1.0 µm/px slides and on DAPI/FITC/Cy3 refused."""
    slides = {
        "train": tmp_path / "s-train",
        "coarse": tmp_path / "s-coarse",
        "mif": tmp_path / "s-mif",
    }
    for folder in slides.values():
        folder.mkdir()
    for i in range(2):
        _write_rgb(slides["train"] / f"t{i}.tiff", (64, 64), mpp=0.5, seed=i)
        _write_rgb(slides["coarse"] / f"c{i}.tiff", (64, 64), mpp=1.0, seed=i)
        _write_qptiff(slides["mif"] / f"m{i}.qptiff", _banded(3, (64, 64)), mpp=0.5)
    (slides["train"] / "labels.csv").write_text("slide_id,label\nt0,neg\nt1,pos\n")
    (slides["coarse"] / "labels.csv").write_text("slide_id,label\nc0,neg\nc1,pos\n")
    for key, folder in slides.items():
        labels = ["--labels", str(folder / "labels.csv")] if key != "mif" else []
        args = ["--out", str(tmp_path / key), "--level", "0", "--size", "64", "--tissue", "none"]
        assert preprocess_main([str(folder), *args, *labels, "--quiet", "--no-qc"]) == 0
    recipe = _recipe(tmp_path, tmp_path / "train" / "manifest.csv")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sets = [
        "train.max_steps=1",
        "train.batch_size=1",
        "train.progress=false",
        "data.val_fraction=0",
    ]
    train = [sys.executable, "-m", "hyfi_imaging.cli.train", str(recipe)]
    train += [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(
        train,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["cohort"]["mpp_range"] == [0.5, 0.5] and summary["cohort"]["channels"] == [
        "red",
        "green",
        "blue",
    ]
    assert summary["cohort"]["slides"]["t1"] == {"mpp": 0.5, "fit_scale": 1.0}

    def predict(manifest: Path) -> str:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "hyfi_imaging.cli.predict",
                str(tmp_path / "run"),
                "--manifest",
                str(manifest),
                "--out",
                str(tmp_path / "p.csv"),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert run.returncode != 0, run.stdout
        return run.stderr.strip().splitlines()[-1]

    line = predict(tmp_path / "coarse" / "manifest.csv")
    assert (
        "resolution lies outside this checkpoint's 0.5 µm/px" in line
        and "c0 (1), c1 (1) µm/px" in line
    )
    # Resuming the run on the coarse slides: refused before any step, naming them.
    resumed = subprocess.run(
        [*train, "--set", f"data.manifest={tmp_path / 'coarse' / 'manifest.csv'}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert resumed.returncode != 0
    line = resumed.stderr.strip().splitlines()[-1]
    assert "resolution lies outside this checkpoint's 0.5 µm/px" in line and "c0 (1)" in line
    line = predict(tmp_path / "mif" / "manifest.csv")
    assert (
        "it has 3 (red, green, blue)" in line and "hold 3 uint16 channels (DAPI, FITC, Cy3)" in line
    )


def test_an_ome_tiffs_main_image_gives_its_own_resolution_and_channels(tmp_path: Path) -> None:
    """The OME-XML's first image was read for µm/px and channel names, whichever series was
    converted: a label image listed first (30 µm/px) made a 0.65 µm/px multiplex image 30 and
    its channels c0..c2 (--tissue DAPI could not work), exit 0."""
    rng = np.random.default_rng(0)
    path = tmp_path / "s.ome.tif"
    with tifffile.TiffWriter(path, ome=True) as tif:
        tif.write(rng.integers(0, 256, (50, 50, 3), dtype=np.uint8), photometric="rgb",
                  metadata={"Name": "label", "axes": "YXS", "PhysicalSizeX": 30.0,
                            "PhysicalSizeY": 30.0})  # fmt: skip
        tif.write(rng.integers(0, 4000, (3, 200, 296), dtype=np.uint16), tile=(64, 64),
                  photometric="minisblack",
                  metadata={"Name": "main", "axes": "CYX", "PhysicalSizeX": 0.65,
                            "PhysicalSizeY": 0.65, "Channel": {"Name": ["DAPI", "CD8", "PanCK"]}})  # fmt: skip
    with open_slide(path) as slide:
        assert slide.level_dimensions[0] == (200, 296)
        assert slide.mpp == pytest.approx(0.65)
        assert list(slide.channel_names) == ["DAPI", "CD8", "PanCK"]


def test_slides_of_unknown_resolution_against_a_checkpoints_are_said() -> None:
    """A checkpoint trained at 2 µm/px and PNG slides that record no µm/px (converted at 4x
    the magnification): nothing compares them, and hyfi-predict predicted without a word. One
    line names them now; slides whose µm/px is known, or a checkpoint without one, say nothing."""
    from hyfi_imaging.train.preflight import CohortFacts, unknown_mpp_note

    facts = CohortFacts("m.csv", ("a", "b"), (None, 2.0), (1.0, 1.0), ("R", "G", "B"), "uint8")
    note = unknown_mpp_note(facts, {"mpp": [2.0, 2.0]})
    assert note is not None and note.startswith("m.csv: a record no µm/px"), note
    assert "--mpp 2 " in note
    assert unknown_mpp_note(facts, {"mpp": None}) is None
    known = CohortFacts("m.csv", ("b",), (2.0,), (1.0,), ("R", "G", "B"), "uint8")
    assert unknown_mpp_note(known, {"mpp": [2.0, 2.0]}) is None
