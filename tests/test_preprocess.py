"""hyfi-preprocess on real synthetic slides: pixels, provenance, bad input, resume, kill -9,
folder scans by content, bounded memory, disk space, and nothing created for a run that cannot start."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from dicom_files import write_ct_slice, write_wsi_level

from hyfi_imaging.cli.preprocess import main as preprocess_main
from hyfi_imaging.data.synthetic import render_synthetic, write_synthetic_slide
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.io.base import ArrayReader
from hyfi_imaging.io.zarr_store import downsample_2x, read_hyfi_attrs
from hyfi_imaging.preprocess import (
    PreprocessOptions,
    convert,
    read_labels,
    read_manifest,
    run_preprocess,
)
from hyfi_imaging.preprocess.canvas import CanvasRenderer, CropPlan
from hyfi_imaging.preprocess.discover import Discovery
from hyfi_imaging.preprocess.tissue import tissue_box, tissue_mask

SIZE = (1024, 1280)


@pytest.fixture(scope="module")
def cohort(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three lossless slides of different kinds plus a labels file."""
    root = tmp_path_factory.mktemp("slides")
    write_synthetic_slide(
        root / "a.svs", seed=1, label=0, size=SIZE, kind="aperio", compression="zlib"
    )
    write_synthetic_slide(
        root / "b.svs", seed=2, label=1, size=SIZE, kind="aperio", compression="zlib"
    )
    write_synthetic_slide(
        root / "c.ome.tiff",
        seed=3,
        label=1,
        size=SIZE,
        mpp=0.5,
        kind="ome-tiff",
        compression="zlib",
    )
    (root / "labels.csv").write_text("slide_id,label\na,0\nb,1\nc,1\n")
    return root


def _store(out: Path, sid: str) -> tuple[np.ndarray, dict]:
    group = zarr.open_group(out / f"{sid}.zarr", mode="r")
    return np.asarray(group["0"][:]), dict(group.attrs["hyfi"])


def test_converts_cohort_with_manifest_metadata_and_qc(cohort: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = preprocess_main(
        [
            str(cohort),
            "--out",
            str(out),
            "--mpp",
            "2.0",
            "--size",
            "512",
            "--labels",
            str(cohort / "labels.csv"),
            "--quiet",
        ]
    )
    assert code == 0
    rows = {r.slide_id: r for r in read_manifest(out / "manifest.csv")}
    assert set(rows) == {"a", "b", "c"}
    for sid, row in rows.items():
        assert row.status == "ok" and row.error == ""
        assert (row.height, row.width, row.mpp) == (512, 512, 2.0)
        image, attrs = _store(out, sid)
        assert image.shape == (3, 512, 512) and image.dtype == np.uint8
        assert attrs["mpp"] == 2.0 and attrs["source_mpp"] == 0.5
        assert attrs["source"] == str((cohort / Path(row.source).name).resolve())
        py, px, ph, pw = attrs["placement"]
        _sy, _sx, sh, sw = attrs["source_box"]
        assert abs(ph - sh / 4) <= 1 and abs(pw - sw / 4) <= 1  # 0.5 -> 2.0 um/px
        # Outside the placement: background; inside: tissue somewhere.
        assert (image[:, :py] == 255).all() and (image[:, py + ph :] == 255).all()
        assert image[:, py : py + ph, px : px + pw].min() < 200
        assert (out / "qc" / f"{sid}.png").stat().st_size > 1000
    assert rows["b"].label == "1" and rows["a"].label == "0"
    assert (out / "contact_sheet.png").exists() and (out / "preprocess.log").exists()
    ome = zarr.open_group(out / "a.zarr", mode="r").attrs["ome"]
    assert ome["version"] == "0.5"
    assert [a["name"] for a in ome["multiscales"][0]["axes"]] == ["c", "y", "x"]


def test_level_zero_output_is_the_source_pixels_at_the_recorded_place(
    cohort: Path, tmp_path: Path
) -> None:
    """Without resampling, canvas[placement] must equal source[source_box] exactly."""
    out = tmp_path / "out"
    summary = run_preprocess(
        [cohort / "b.svs"], out, PreprocessOptions(level=0, size=(1400, 1400)), progress=False
    )
    assert not summary.failed
    image, attrs = _store(out, "b")
    py, px, ph, pw = attrs["placement"]
    sy, sx, sh, sw = attrs["source_box"]
    assert (ph, pw) == (sh, sw)
    truth = np.moveaxis(render_synthetic(seed=2, label=1, size=SIZE).image, -1, 0)
    np.testing.assert_array_equal(
        image[:, py : py + ph, px : px + pw], truth[:, sy : sy + sh, sx : sx + sw]
    )
    # The crop holds all of the tissue the mask finds.
    mask = tissue_mask(truth[:, ::8, ::8])
    ty, tx, th, tw = tissue_box(mask, 8.0, SIZE) or (0, 0, 0, 0)
    assert sy <= ty and sx <= tx and sy + sh >= ty + th and sx + sw >= tx + tw


def test_fit_and_crop_policies(cohort: Path, tmp_path: Path) -> None:
    fit = run_preprocess(
        [cohort / "a.svs"],
        tmp_path / "fit",
        PreprocessOptions(mpp=0.5, size=(256, 256)),
        progress=False,
    )
    _, attrs = _store(tmp_path / "fit", "a")
    assert not fit.failed and attrs["mpp"] > 0.5  # downscaled to fit, recorded honestly
    assert max(attrs["placement"][2:]) == 256
    crop = run_preprocess(
        [cohort / "a.svs"],
        tmp_path / "crop",
        PreprocessOptions(mpp=0.5, size=(256, 256), fit="crop"),
        progress=False,
    )
    _, attrs = _store(tmp_path / "crop", "a")
    assert not crop.failed and attrs["mpp"] == 0.5
    assert attrs["placement"] == [0, 0, 256, 256] and attrs["source_box"][2:] == [256, 256]


def _bad_inputs(root: Path) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    good = write_synthetic_slide(
        root / "good.svs", seed=4, label=0, size=(768, 768), compression="zlib"
    )
    truncated = root / "truncated.svs"
    data = good.path.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    garbage = root / "garbage.svs"
    garbage.write_bytes(b"this is not a slide" * 100)
    text = root / "notes.txt"
    text.write_text("hello")
    blank = root / "blank.tiff"
    import tifffile

    tifffile.imwrite(
        blank,
        np.full((512, 512, 3), 250, np.uint8),
        tile=(256, 256),
        resolution=(20000, 20000),
        resolutionunit="CENTIMETER",
    )
    nompp = write_synthetic_slide(
        root / "nompp.tiff",
        seed=5,
        label=0,
        size=(768, 768),
        mpp=None,
        kind="generic-tiff",
        compression="zlib",
    ).path
    unlabelled = write_synthetic_slide(
        root / "unlabelled.svs", seed=6, label=0, size=(768, 768), compression="zlib"
    ).path
    return {
        "good": good.path,
        "truncated": truncated,
        "garbage": garbage,
        "text": text,
        "blank": blank,
        "nompp": nompp,
        "unlabelled": unlabelled,
    }


def test_bad_inputs_are_reported_one_line_each_and_the_rest_converted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = _bad_inputs(tmp_path / "in")
    labels = tmp_path / "labels.csv"
    ids = [p.name.split(".")[0] for k, p in files.items() if k != "unlabelled"]
    labels.write_text("slide_id,label\n" + "".join(f"{sid},0\n" for sid in ids))
    out = tmp_path / "out"
    args = [str(p) for p in files.values()]
    code = preprocess_main(
        [
            *args,
            "--out",
            str(out),
            "--mpp",
            "2",
            "--size",
            "256",
            "--labels",
            str(labels),
            "--quiet",
        ]
    )
    assert code == 1
    rows = {r.slide_id: r for r in read_manifest(out / "manifest.csv")}
    assert rows["good"].status == "ok"
    expect = {
        "truncated": "truncated",
        "garbage": "unsupported",
        "notes": "unsupported",
        "blank": "no tissue",
        "nompp": "--mpp-override",
        "unlabelled": "has no label from the labels file",
    }
    for sid, words in expect.items():
        row = rows[sid]
        assert row.status == "failed", sid
        assert "\n" not in row.error and row.source in row.error
        assert words.lower() in row.error.lower(), (sid, row.error)
    out_err = capsys.readouterr()
    printed = out_err.out
    assert "1 converted" in printed and "6 failed" in printed
    assert sum(line.startswith("  FAILED") for line in printed.splitlines()) == 6
    # each on stderr too, as it happens (a slide without a label was not: it fails before
    # converting), and in the log
    errors = [ln for ln in out_err.err.splitlines() if ln.startswith("hyfi-preprocess: FAILED")]
    logged = (out / "preprocess.log").read_text()
    # Each run's records follow a line naming its command (a rerun appends to the file).
    first = logged.splitlines()[0]
    assert " INFO run: hyfi-preprocess " in first and f"--out {out}" in first, first
    for sid in expect:
        assert sum(rows[sid].error in ln for ln in errors) == 1, (sid, out_err.err)
        assert rows[sid].error in logged, sid
    # Nothing half-written is left behind.
    assert sorted(p.name for p in out.glob("*.zarr*")) == ["good.zarr"]


def test_unwritable_output_and_missing_input_stop_before_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    slide = write_synthetic_slide(tmp_path / "s.svs", seed=1, label=0, size=(512, 512)).path
    assert preprocess_main([str(slide), "--out", str(blocker / "sub"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not writable" in err
    assert (
        preprocess_main([str(tmp_path / "missing.svs"), "--out", str(tmp_path / "o"), "--quiet"])
        == 2
    )
    assert "no such file" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_run_that_cannot_start_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Missing input, labels or disk space: one line, exit 2, and --out is not created."""
    slide = write_synthetic_slide(tmp_path / "s.svs", seed=1, label=0, size=(512, 512)).path
    out = tmp_path / "deep" / "out"
    cases = {
        "no such file": [str(tmp_path / "data" / "nope")],
        "cannot read the labels file": [str(slide), "--labels", str(tmp_path / "absent.csv")],
        "is not a regular expression": [str(slide), "--label-from-name", "(unclosed"],
        "not enough free disk space": [str(slide), "--size", "3000000"],
    }
    for words, args in cases.items():
        assert preprocess_main([*args, "--out", str(out), "--quiet"]) == 2, words
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and words in err, err
        assert not (tmp_path / "deep").exists(), words


def test_resume_skips_finished_slides_by_metadata(
    cohort: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    shutil.copytree(cohort, src)
    out = tmp_path / "out"
    opts = PreprocessOptions(mpp=2.0, size=(512, 512))
    first = run_preprocess([src], out, opts, progress=False)
    assert first.count("ok") == 3
    again = run_preprocess([src], out, opts, progress=False)
    assert again.count("skipped") == 3
    # Changed options or a changed source file: converted again, the rest skipped.
    os.utime(src / "a.svs", ns=(time.time_ns(), time.time_ns() + 10**9))
    third = run_preprocess([src], out, opts, progress=False)
    assert {r.slide_id: r.status for r in third.results} == {
        "a": "ok",
        "b": "skipped",
        "c": "skipped",
    }
    fourth = run_preprocess([src], out, PreprocessOptions(mpp=2.0, size=(640, 640)), progress=False)
    assert fourth.count("ok") == 3
    # Stores of an older pixel format (8-bit RGB only) are converted again.
    monkeypatch.setattr(convert, "STORE_FORMAT", 1)
    older = run_preprocess([src], out, PreprocessOptions(mpp=2.0, size=(640, 640)), progress=False)
    assert older.count("ok") == 3
    monkeypatch.undo()
    # A finished store whose source later breaks is kept, not destroyed.
    (src / "b.svs").write_bytes(b"broken")
    fifth = run_preprocess([src], out, PreprocessOptions(mpp=2.0, size=(640, 640)), progress=False)
    assert [r.slide_id for r in fifth.failed] == ["b"]
    assert read_hyfi_attrs(out / "b.zarr") is not None


def test_labels_files_as_they_come(tmp_path: Path) -> None:
    panda = tmp_path / "train.csv"
    panda.write_text(
        "image_id,data_provider,isup_grade,gleason_score\nabc,karolinska,3,4+3\ndef,radboud,0,0+0\n"
    )
    assert read_labels(panda) == {"abc": "3", "def": "0"}
    camelyon = tmp_path / "reference.csv"
    camelyon.write_text("test_001,Tumor,Macro,Metastasis\ntest_002,Normal,,\n")
    assert read_labels(camelyon) == {"test_001": "Tumor", "test_002": "Normal"}
    tsv = tmp_path / "labels.tsv"
    tsv.write_text("filename\tdiagnosis\nx.svs\tbenign\n")
    assert read_labels(tsv) == {"x": "benign"}
    assert read_labels(panda, label_column="gleason_score")["abc"] == "4+3"


def test_labels_file_ids_keep_their_dots(tmp_path: Path) -> None:
    """Only a slide file's extension is taken off an id: a dot inside one (TCGA's slide ids,
    ``x.v2``) took the rest away, so ``x.v2`` labelled the slide ``x``."""
    rows = tmp_path / "labels.csv"
    rows.write_text(
        "slide_id,label\nTCGA-AA-3555-01Z-00-DX1.0a2f3c,1\nS1.A,0\nS1.B,1\nx.v2,1\n"
        "cases/y.ome.tiff,0\nz.SVS,1\nscan.raw,0\n"
    )
    assert read_labels(rows) == {
        "TCGA-AA-3555-01Z-00-DX1.0a2f3c": "1", "S1.A": "0", "S1.B": "1", "x.v2": "1", "y": "0",
        "z": "1", "scan.raw": "0",
    }  # fmt: skip
    spaced = tmp_path / "spaced.csv"
    spaced.write_text('slide_id, label\n"a",  "1"\nb, 0\n')
    assert read_labels(spaced) == {"a": "1", "b": "0"}  # the quotes were part of the label
    blank = tmp_path / "blank.csv"
    blank.write_text("slide_id,label\na,1\nb,\n")
    with pytest.raises(ConfigError, match=r"blank.csv:3: slide 'b' has an empty label"):
        read_labels(blank)  # it was a slide "labelled" with the empty class
    found = Discovery(slides=[tmp_path / n for n in ("x.tif", "x.v2.tif", "scan.raw")])
    labels = found.labels_for(read_labels(rows))
    assert "x" not in labels and labels["x.v2"] == "1"
    assert labels["scan"] == "0"  # a row naming a file by its whole name labels it


def _cli(src: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hyfi_imaging.cli.preprocess",
        str(src),
        "--out",
        str(out),
        "--mpp",
        "1.0",
        "--size",
        "768",
        "--quiet",
    ]


def test_kill_minus_nine_then_resume_equals_uninterrupted_run(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        write_synthetic_slide(src / f"s{i}.svs", seed=20 + i, label=i % 2, size=(1024, 1024))
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    proc = subprocess.Popen(_cli(src, killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(killed.glob("*.zarr")):
        time.sleep(0.02)
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # Whatever is there under a final name is complete; temporaries are not mistaken for slides.
    for store in killed.glob("*.zarr"):
        assert read_hyfi_attrs(store) is not None
    assert subprocess.run(_cli(src, killed), check=False).returncode == 0
    assert subprocess.run(_cli(src, clean), check=False).returncode == 0
    assert not list(killed.glob("*tmp*"))
    for i in range(4):
        a, attrs_a = _store(killed, f"s{i}")
        b, attrs_b = _store(clean, f"s{i}")
        np.testing.assert_array_equal(a, b)
        assert attrs_a == attrs_b
    assert (killed / "manifest.csv").read_text() == (clean / "manifest.csv").read_text()


def test_a_second_run_on_the_same_directory_is_refused(cohort: Path, tmp_path: Path) -> None:
    import fcntl

    out = tmp_path / "out"
    out.mkdir()
    with (out / ".hyfi-preprocess.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code = preprocess_main([str(cohort / "a.svs"), "--out", str(out), "--quiet"])
    assert code == 2


def test_labels_from_file_names(cohort: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(cohort / "a.svs", src / "normal_001.svs")
    shutil.copy(cohort / "b.svs", src / "tumor_001.svs")
    shutil.copy(cohort / "a.svs", src / "other.svs")
    summary = run_preprocess(
        [src],
        tmp_path / "out",
        PreprocessOptions(mpp=4.0, size=(256, 256)),
        label_from_name="^(normal|tumor)_",
        progress=False,
    )
    rows = {r.slide_id: r for r in read_manifest(tmp_path / "out" / "manifest.csv")}
    assert rows["normal_001"].label == "normal" and rows["tumor_001"].label == "tumor"
    assert rows["other"].status == "failed" and [r.slide_id for r in summary.failed] == ["other"]


def test_integer_reductions_average_whole_blocks(cohort: Path, tmp_path: Path) -> None:
    """At 8x the crop snaps to 8-px blocks: each output pixel is the mean of one 8x8 block."""
    run_preprocess(
        [cohort / "b.svs"], tmp_path, PreprocessOptions(mpp=4.0, size=(256, 256)), progress=False
    )
    image, attrs = _store(tmp_path, "b")
    sy, sx, sh, sw = attrs["source_box"]
    py, px, ph, pw = attrs["placement"]
    assert sy % 8 == 0 and sx % 8 == 0 and (sh, sw) == (8 * ph, 8 * pw)
    truth = np.moveaxis(render_synthetic(seed=2, label=1, size=SIZE).image, -1, 0).astype(float)
    block = np.full((3, sh, sw), 255.0)
    hh, ww = min(sh, SIZE[0] - sy), min(sw, SIZE[1] - sx)
    block[:, :hh, :ww] = truth[:, sy : sy + hh, sx : sx + ww]
    means = block.reshape(3, ph, 8, pw, 8).mean(axis=(2, 4))
    # Read from a pyramid level (itself rounded 2x2 means): within 1.5 grey levels.
    assert np.abs(image[:, py : py + ph, px : px + pw] - means).max() <= 1.5


def _dicom_series(folder: Path) -> None:
    """A two-file DICOM whole-slide series (level 0 and level 1) in ``folder``."""
    folder.mkdir()
    image = render_synthetic(seed=9, label=1, size=(768, 768)).image
    level1 = np.moveaxis(downsample_2x(np.moveaxis(image, -1, 0)), 0, -1)
    write_wsi_level(folder / "level0.dcm", image, series="1.2.9", instance="1.2.9.1", mpp=0.5)
    write_wsi_level(folder / "level1.dcm", level1, series="1.2.9", instance="1.2.9.2", mpp=1.0)


def test_a_folder_is_scanned_by_content_and_what_is_skipped_is_listed(
    cohort: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(cohort / "a.svs", src / "a.svs")
    shutil.copy(cohort / "c.ome.tiff", src / "multiplex.qptiff")  # an extension not listed before
    shutil.copy(cohort / "b.svs", src / "scan_0042")  # no extension at all
    (src / "notes.txt").write_text("not a slide")
    (src / "clinical.csv").write_text("id,age\n")
    write_ct_slice(src / "ct.dcm")
    (src / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (src / "more").mkdir()
    shutil.copy(cohort / "a.svs", src / "more" / "deep.svs")
    _dicom_series(src / "dicom")
    out = tmp_path / "out"
    args = [str(src), "--out", str(out), "--mpp", "4", "--size", "256", "--quiet"]

    assert preprocess_main(args) == 0
    assert {r.slide_id for r in read_manifest(out / "manifest.csv")} == {
        "a",
        "multiplex",
        "scan_0042",
    }
    printed = capsys.readouterr().out
    assert "skipped 6 paths that are not slides" in printed
    for line in (
        "subfolders, not searched without --recursive: 2 (dicom/, more/)",
        "files whose content is not an image: 2 (clinical.csv, notes.txt)",
        "DICOM files that are not whole-slide images: 1 (ct.dcm)",
        "hidden files: 1 (.DS_Store)",
    ):
        assert line in printed, printed
    log = (out / "preprocess.log").read_text()
    for name in ("more", "dicom", "notes.txt", "clinical.csv", ".DS_Store"):
        assert str(src / name) in log
    assert f"{src / 'ct.dcm'}: DICOM CT image, not a whole-slide image" in log

    # With --recursive: the subfolder's slide, and the DICOM series as one slide.
    assert preprocess_main([*args, "--recursive"]) == 0
    rows = {r.slide_id: r for r in read_manifest(out / "manifest.csv")}
    assert set(rows) == {"a", "multiplex", "scan_0042", "deep", "level0"}
    assert (rows["level0"].status, rows["level0"].mpp) == ("ok", 4.0)
    printed = capsys.readouterr().out
    assert (
        "further files of a DICOM series (converted through its largest file): 1 (dicom/level1.dcm)"
        in printed
    )
    assert "subfolders" not in printed


def test_discovery_keeps_slide_parts_and_its_own_output_apart(cohort: Path, tmp_path: Path) -> None:
    """A MIRAX data folder, a store, the output folder and a symlink loop are handled, not listed as slides."""
    from hyfi_imaging.preprocess.discover import discover_slides

    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(cohort / "a.svs", src / "a.svs")
    (src / "m.mrxs").write_text("[GENERAL]\n")  # unrecognised, but named as a slide: tried
    (src / "m").mkdir()
    (src / "m" / "Slidedat.ini").write_text("[GENERAL]\n")
    (src / "done.zarr").mkdir()
    (src / "done.zarr" / "zarr.json").write_text("{}")
    (src / "out").mkdir()
    (src / "sub").mkdir()
    (src / "sub" / "loop").symlink_to(src, target_is_directory=True)
    found = discover_slides([src, src / "a.svs"], recursive=True, out_dir=src / "out")
    assert [p.name for p in found.slides] == ["a.svs", "m.mrxs"]  # named twice, listed once
    reasons = {s.path.name: s.reason for s in found.skipped}
    assert set(reasons) == {"done.zarr", "out"}
    assert reasons["out"] == "the output folder (--out)"


def test_no_slides_found_says_what_was_skipped(
    cohort: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    (src / "batch1").mkdir(parents=True)
    shutil.copy(cohort / "a.svs", src / "batch1" / "a.svs")
    (src / "readme.md").write_text("# slides are in batch1")
    assert preprocess_main([str(src), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "no slide files found (skipped subfolders, not searched without --recursive" in err
    assert "readme.md" in err and "add --recursive" in err
    assert not (tmp_path / "out").exists()


def test_canvas_regions_join_without_seams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards and render tiles of an upsampled crop join into the canvas rendered in one piece."""
    import hyfi_imaging.preprocess.canvas as canvas_module

    image = np.moveaxis(render_synthetic(seed=4, label=1, size=(300, 400)).image, -1, 0)
    reader = ArrayReader(np.ascontiguousarray(image))
    plan = CropPlan((17, 23, 250, 333), (40, 30, 750, 999), 0, None, (0, 0, 300, 400))
    canvas = CanvasRenderer(reader, plan, (800, 1100))
    whole = canvas.read(0, 0, 800, 1100)
    assert (whole[:, :40] == 255).all() and (whole[:, :, :30] == 255).all()
    monkeypatch.setattr(canvas_module, "_RENDER_TILE", 97)
    pieces = np.concatenate(
        [
            np.concatenate(
                [canvas.read(y, x, y + 256, min(x + 256, 1100)) for x in range(0, 1100, 256)], 2
            )
            for y in range(0, 800, 256)
        ],
        1,
    )[:, :800]
    # Bilinear weights are continuous: tiles differ from one piece by float rounding at most.
    assert np.abs(pieces.astype(int) - whole).max() <= 1


def test_a_flat_image_reduced_by_any_factor_stays_flat() -> None:
    """Box reduction by a factor that is no whole number (101 -> 50 columns, a level of 255
    rows read for 512): where an interval's edge fell on a pixel centre, an output's run was
    computed one pixel short or long of where the next began, and a run's sum was divided by
    the other count: a column of 120 in a flat 180 image (7 % of width pairs scanned)."""
    from hyfi_imaging.preprocess.canvas import _resample, _taps

    flat = np.full((1, 80, 101), 180, np.uint8)
    out = _resample(flat, _taps(0, 80 / 40, 0, 40, 0, 80, downscale=True),
                    _taps(0, 101 / 50, 0, 50, 0, 101, downscale=True), box=True)  # fmt: skip
    assert out.shape == (1, 40, 50) and (out == 180).all()
    for width in range(101, 400, 2):  # every odd width to 2 and 7 fewer output columns
        for n in (width // 2, width // 7):
            idx, weights = _taps(0, width / n, 0, n, 0, width, downscale=True)
            counts = np.count_nonzero(weights, axis=1)
            runs = idx[:, 0] + counts  # where each run ends: the next one starts there
            assert (runs[:-1] == idx[1:, 0]).all() and runs[-1] <= width, (width, n)


def test_a_large_canvas_is_written_in_bounded_memory(cohort: Path, tmp_path: Path) -> None:
    """Peak memory grows by a few shards, not by the canvas.

    An 8192² RGB canvas is 192 MiB (plus 64 MiB of pyramid). A subprocess imports
    everything first, then converts one slide onto it with 2048² shards; its peak
    RSS may grow by at most half the canvas. Measured: 59 MiB (about 50 of them do
    not depend on the canvas size); before the canvas was written in shards, 487 MiB.
    glibc's mmap threshold is fixed so that freed buffers leave the resident set at
    once and the peak measures live memory.
    """
    out = tmp_path / "out"
    script = (
        "import resource, sys\n"
        "import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot\n"
        "import zarr, tifffile, openslide, skimage.morphology, scipy.ndimage\n"
        "import hyfi_imaging.preprocess.run, hyfi_imaging.preprocess.qc\n"
        "from hyfi_imaging.cli.preprocess import main\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "code = main(sys.argv[1:])\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(code, (after - before) * 1024)\n"
    )
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_ARENA_MAX": "2"}
    args = ["--mpp", "0.25", "--size", "8192", "--shard", "2048", "--chunk", "512", "--quiet"]
    done = subprocess.run(
        [sys.executable, "-c", script, str(cohort / "a.svs"), "--out", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    code, grown = done.stdout.split()[-2:]
    assert code == "0", done.stderr
    canvas_bytes = 3 * 8192 * 8192
    assert int(grown) < canvas_bytes / 2, f"peak RSS grew by {int(grown) / 2**20:.0f} MiB"
    image = zarr.open_group(out / "a.zarr", mode="r")["0"]
    assert image.shape == (3, 8192, 8192)
    attrs = read_hyfi_attrs(out / "a.zarr") or {}
    py, px, ph, pw = attrs["placement"]
    assert np.asarray(image[:, py + ph // 2, px : px + pw]).min() < 200  # tissue was written
    assert (np.asarray(image[:, :py, :]) == 255).all()  # background above it


def _descendants(pid: int) -> list[int]:
    """All processes below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its parent's wait is missing


@pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc"
)
def test_kill_minus_nine_stops_the_workers_too(tmp_path: Path) -> None:
    """kill -9 of a run with workers: forkserver, workers and resource tracker are gone in seconds."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        write_synthetic_slide(src / f"s{i}.svs", seed=40 + i, label=i % 2, size=(768, 768))
    out = tmp_path / "out"
    cmd = [*_cli(src, out), "--workers", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(out.glob("*.zarr.tmp-*")):
        time.sleep(0.02)
    family = _descendants(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while any(_running(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in family if _running(p)]
    for p in left:  # do not leave them behind if the test fails
        os.kill(p, signal.SIGKILL)
    assert len(family) >= 3 and not left, (family, left)


@pytest.mark.slow
@pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc"
)
def test_a_worker_killed_fails_no_slide_it_was_not_converting(tmp_path: Path) -> None:
    """A worker killed (as the kernel's OOM killer does) broke the pool, and every slide of
    the run failed as "the worker process died", the ones never started too. The slides
    left are converted again, one worker each: here all of them, since none kills its own."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        write_synthetic_slide(src / f"s{i}.svs", seed=60 + i, label=i % 2, size=(768, 768))
    out = tmp_path / "out"
    cmd = [*_cli(src, out), "--workers", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(out.glob("*.zarr.tmp-*")):
        time.sleep(0.02)
    servers = [p for p in _descendants(proc.pid) if b"forkserver" in _cmdline(p)]
    workers = [p for s in servers for p in _descendants(s)]
    assert workers, "no worker found"
    os.kill(workers[0], signal.SIGKILL)
    said, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "4 slides: 4 converted, 0 already done, 0 failed" in said, said
    assert "a worker process died" in (out / "preprocess.log").read_text()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.parametrize("workers", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_ctrl_c_stops_the_run_in_one_line(tmp_path: Path, workers: int) -> None:
    """Ctrl-C (SIGINT to the terminal's process group) printed a KeyboardInterrupt traceback
    of ~15 lines from the run and its workers: one line now, exit 130, nothing half-written
    left under a final name, the workers gone."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        write_synthetic_slide(src / f"s{i}.svs", seed=40 + i, label=i % 2, size=(768, 768))
    out = tmp_path / "out"
    cmd = [*_cli(src, out), "--workers", str(workers)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(out.glob("*.zarr.tmp-*")):
        time.sleep(0.02)
    family = _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    deadline = time.monotonic() + 5
    while any(_running(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [
        f"hyfi-preprocess: interrupted: the slides finished are in {out}; run the same command "
        "again to convert the rest"
    ], err
    assert not [p for p in family if _running(p)]
    for store in out.glob("*.zarr"):
        assert read_hyfi_attrs(store) is not None


def test_one_file_is_one_row_and_another_batch_never_replaces_a_slide(
    cohort: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A slide listed twice in the manifest can be in training and validation both: a file
    given again under another name (a link) is one slide, and a row of a file converted under
    a new id is dropped, with a warning naming its store. A later batch's file of the same
    name replaced the earlier slide's store without a word: it fails, the slide is kept. An
    output folder read as input turned its QC pictures into slides: refused, or passed over."""
    from hyfi_imaging.preprocess.discover import discover_slides

    out = tmp_path / "out"
    opts = PreprocessOptions(mpp=2.0, size=(512, 512))
    links = tmp_path / "links"
    links.mkdir()
    (links / "case7.svs").symlink_to(cohort / "a.svs")
    found = discover_slides([cohort / "a.svs", links / "case7.svs"])
    assert found.slides == [cohort / "a.svs"]
    ((skipped,),) = [[s for s in found.skipped if s.path == links / "case7.svs"]]
    assert skipped.reason == "links to a file given already" and "a.svs" in skipped.detail
    run_preprocess([cohort / "a.svs", links / "case7.svs"], out, opts, progress=False)
    assert [r.slide_id for r in read_manifest(out / "manifest.csv")] == ["a"]
    # the same file alone under its new id: one row for it, the old one dropped and said
    run_preprocess([links / "case7.svs"], out, opts, progress=False)
    assert [r.slide_id for r in read_manifest(out / "manifest.csv")] == ["case7"]
    assert "slide 'a' is dropped from the manifest" in caplog.text
    # another batch's a.svs (another file): refused, the first a kept with its row
    run_preprocess([cohort / "a.svs"], out, opts, progress=False)
    batch2 = tmp_path / "batch2"
    batch2.mkdir()
    shutil.copy(cohort / "b.svs", batch2 / "a.svs")
    run_preprocess([batch2 / "a.svs"], out, opts, progress=False)
    rows = [r for r in read_manifest(out / "manifest.csv") if r.slide_id == "a"]
    assert [r.status for r in rows] == ["ok", "failed"]
    assert Path(rows[0].source).resolve() == (cohort / "a.svs").resolve()
    assert "is taken in" in rows[1].error and "by another file" in rows[1].error
    assert (read_hyfi_attrs(out / "a.zarr") or {})["source"] == str((cohort / "a.svs").resolve())
    # an output folder: refused as --out of its own input, passed over inside another input
    with pytest.raises(ConfigError, match="is both an input folder and --out"):
        run_preprocess([out], out, opts, progress=False)
    found = discover_slides([tmp_path], recursive=True)
    assert not [p for p in found.slides if out in p.parents]
    assert any(s.path == out for s in found.skipped)


def test_an_output_that_cannot_be_written_is_not_blamed_on_the_slide(
    cohort: Path, tmp_path: Path
) -> None:
    """A QC picture that cannot be written failed each slide with "could not be converted
    ...; check the file, or report a bug": the output folder is named now."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "qc").write_text("")  # a file where the QC folder goes
    run_preprocess([cohort / "a.svs"], out, PreprocessOptions(mpp=2.0, size=(512, 512)),
                   progress=False)  # fmt: skip
    (row,) = read_manifest(out / "manifest.csv")
    assert row.status == "failed" and row.error.startswith(f"{out}: cannot write"), row.error
    assert "make the output folder writable" in row.error and "check the file" not in row.error


def test_quiet_says_each_warning_once(
    cohort: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--quiet printed every warning live as well as in the summary (the default: the
    summary only)."""
    from hyfi_imaging.cli.preprocess import main

    args = [str(cohort / "a.svs"), "--out", str(tmp_path / "out"), "--level", "0", "--size", "64"]
    assert main([*args, "--quiet"]) == 0
    said = capsys.readouterr()
    assert "shrank" in said.out and "shrank" not in said.err, said.err


def test_a_run_over_other_slides_keeps_the_earlier_rows(cohort: Path, tmp_path: Path) -> None:
    """A second run into the same folder, over one slide that fails, rewrote the manifest with
    that slide alone: the earlier slides' rows were lost (their stores still on disk). They
    are kept now, beside the new row, and a slide of both runs is this run's."""
    out = tmp_path / "out"
    opts = PreprocessOptions(mpp=2.0, size=(512, 512))
    run_preprocess([cohort], out, opts, progress=False)
    first = {r.slide_id: r for r in read_manifest(out / "manifest.csv")}
    broken = tmp_path / "more" / "d.svs"
    broken.parent.mkdir()
    broken.write_bytes((cohort / "a.svs").read_bytes()[:5000])  # cut short
    run_preprocess([broken, cohort / "b.svs"], out, opts, progress=False)
    rows = {r.slide_id: r for r in read_manifest(out / "manifest.csv")}
    assert sorted(rows) == ["a", "b", "c", "d"] and rows["d"].status == "failed"
    assert rows["a"] == first["a"] and rows["c"] == first["c"] and rows["b"].status == "ok"


def test_an_annotation_file_of_no_slide_in_a_fresh_out(tmp_path: Path) -> None:
    """The warning of an annotation file that matches no slide comes before ``--out`` exists:
    opening ``preprocess.log`` there failed with FileNotFoundError, nothing converted (every
    subset of a cohort run against its whole annotation folder). The warning is logged once
    the folder exists, after the run's first line."""
    from PIL import Image

    slides, notes, out = tmp_path / "in", tmp_path / "ann", tmp_path / "out"
    slides.mkdir()
    notes.mkdir()
    pixels = np.full((256, 256, 3), 245, np.uint8)
    pixels[64:192, 64:192] = (200, 120, 170)
    Image.fromarray(pixels).save(slides / "s1.png")
    empty = '{"type":"FeatureCollection","features":[]}'
    (notes / "s1.geojson").write_text(empty)
    (notes / "other_slide.geojson").write_text(empty)
    argv = [str(slides), "--out", str(out), "--mpp", "1.0", "--mpp-override", "0.5"]
    assert preprocess_main([*argv, "--size", "128", "--annotations", str(notes), "--quiet"]) == 0
    lines = (out / "preprocess.log").read_text().splitlines()
    assert " INFO run: hyfi-preprocess " in lines[0], lines
    assert "match no slide id: other_slide.geojson" in lines[1], lines
    assert (out / "s1.zarr").is_dir()
