"""Command-line contracts that need no process group: options, messages, exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_verify_ships_no_way_to_break_itself() -> None:
    """The test-only ``--break`` hook is gone from hyfi-verify (a usage error, exit 2).

    Tests break the exchange themselves (``tests/mpi/broken_halo.py``).
    """
    from hyfi_imaging.cli.verify import build_parser

    argv = ["--model", "resnet18", "--image-size", "32x32"]
    assert build_parser().parse_args(argv).model == "resnet18"
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*argv, "--break", "halo-backward"])
    assert exit_.value.code == 2


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        # a cross-entropy over one class: every gradient 0, a wrong backward reported OK
        ("--num-classes", "1", "--num-classes: must be 2 or more"),
        # NaN on both sides read MISMATCH with an error of 0; -1 turned every gradient round
        ("--clip-grad", "nan", "--clip-grad: must be a finite number"),
        ("--clip-grad", "-1", "--clip-grad: must be > 0"),
    ],
)
def test_verify_refuses_options_that_make_its_verdict_meaningless(
    option: str, value: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from hyfi_imaging.cli.verify import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--model", "resnet18", "--image-size", "32", option, value])
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_a_diverged_reference_is_said_not_a_zero_error() -> None:
    import torch

    from hyfi_imaging.parallel.verify import VerifyReport

    report = VerifyReport()
    report.add("step0/loss", torch.tensor([float("nan")]), torch.tensor([float("nan")]), 1e-6, 0)
    assert not report.ok and report.max_rel_error == float("inf")
    assert "step0/loss (reference not finite)" in report.format("x")
    layout_nan = VerifyReport()
    layout_nan.add("w", torch.tensor([float("nan"), 1.0]), torch.tensor([2.0, 1.0]), 1e-6, 1e-9)
    assert not layout_nan.ok and layout_nan.max_rel_error == float("inf")  # max() skipped NaN


@pytest.mark.parametrize(
    ("model", "width", "words"),
    [
        ("convchain", "0.5", "ConvChain: width=0.5 is not a whole number"),
        ("torchvision.models:resnet18", "0.25", "refuses its options (ResNet.__init__() got an"),
    ],
)
def test_verify_refuses_a_models_options_in_one_line(model: str, width: str, words: str) -> None:
    """A builder's TypeError (or nn.Conv2d's, from --width 8.0 on convchain) was a traceback
    and exit 1, which hyfi-verify uses for a mismatch."""
    import subprocess
    import sys

    job = subprocess.run(
        [sys.executable, "-m", "hyfi_imaging.cli.verify", "--model", model, "--width", width,
         "--image-size", "32"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert job.returncode == 2 and words in job.stderr and "Traceback" not in job.stderr


def test_counts_that_must_be_positive_are_refused_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``hyfi-verify --steps 0`` compared nothing and reported OK; ``hyfi-preprocess --chunk 0``
    raised ZeroDivisionError. Both are usage errors (exit 2) with one line."""
    from hyfi_imaging.cli.preprocess import main as preprocess
    from hyfi_imaging.cli.verify import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--model", "resnet18", "--image-size", "32", "--steps", "0"])
    assert exit_.value.code == 2 and "--steps: must be 1 or more" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        preprocess(["slides", "--out", "out", "--chunk", "0"])
    assert exit_.value.code == 2
    assert "--chunk and --shard must be >= 1" in capsys.readouterr().err.splitlines()[-1]
    # a negative margin cropped inside the tissue (exit 0), nan or -1 failed every slide
    for option, value, said in (
        ("--margin-um", "-5", "--margin-um: must be 0 or more, got -5"),
        ("--margin-um", "nan", "--margin-um: must be a finite number, got nan"),
        ("--level", "-1", "--level: must be 0 or more, got -1"),
    ):
        with pytest.raises(SystemExit) as exit_:
            preprocess(["slides", "--out", "out", option, value])
        assert exit_.value.code == 2
        assert said in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--overlays", "-3"], "--overlays: must be 0 or more"),
        (["--batch", "0"], "--batch: must be 1 or more"),
        (["--pipeline", "0"], "--pipeline: must be 1 or more"),
    ],
)
def test_predict_counts_are_checked_as_options(
    args: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--overlays -3`` was taken; ``--batch 0`` was refused as a recipe's train.batch_size
    with the fix "--set", which hyfi-predict does not have."""
    from hyfi_imaging.cli.predict import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["run", "--manifest", "m", "--out", "o", *args])
    assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_synth_refuses_what_it_cannot_make_and_leaves_nothing(tmp_path: object) -> None:
    """``hyfi-synth --size 10000000`` died in a numpy MemoryError traceback and left an empty
    folder; ``--lesions -2`` was taken. One line each, exit 2, no folder."""
    from pathlib import Path

    from hyfi_imaging.cli.synth import main

    out = Path(str(tmp_path)) / "synth"
    assert main(["--out", str(out), "--n", "1", "--size", "10000000"]) == 2
    assert not out.exists()
    assert main(["--out", str(out), "--n", "1", "--lesions", "-2"]) == 2
    assert not out.exists()
    with pytest.raises(SystemExit) as bad:  # numpy's "expected non-negative integer" traceback
        main(["--out", str(out), "--n", "1", "--seed", "-1"])
    assert bad.value.code == 2 and not out.exists()
    # more lesions than the slide holds: 50 tries per lesion and erosion ran for hours
    assert main(["--out", str(out), "--n", "1", "--size", "256", "--lesions", "100000"]) == 2
    assert not out.exists()


def test_predict_out_of_the_wrong_kind_is_refused_before_predicting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A classification run's ``--out`` naming a folder failed after the whole prediction,
    naming its temporary file; a segmentation run's naming a file, likewise; a segmentation
    on pipeline stages failed without a line. One line now, before any rank starts."""
    import json

    import yaml
    from cohorts import preprocessed_cohort

    from hyfi_imaging.cli.predict import main as predict
    from hyfi_imaging.preprocess import PreprocessOptions
    from hyfi_imaging.train.config import load_recipe

    root = Path(__file__).resolve().parents[1]
    manifest = preprocessed_cohort(tmp_path / "cohort", 2, PreprocessOptions(mpp=2.0, size=(64, 64)),
                                   seed=4, size=(192, 192), lesions=1)  # fmt: skip
    seg = "slide-segmentation-synthetic.yaml"
    for recipe, out, said, more in (
        ("synthetic.yaml", tmp_path, f"--out {tmp_path}: is a folder; a classification run", []),
        (seg, manifest, f"--out {manifest}: is a file; a segmentation run writes", []),
        # a segmentation on pipeline stages failed on a rank, said nothing, and left 1 mask
        (seg, tmp_path / "p", "segmentation reads each mask tile on the first stage only",
         ["--pipeline", "2"]),
        # a grid the images do not fill was refused by the ranks, racing MPICH's teardown
        # (exit 9 in 1 run of 3 under mpiexec): now before they start, as hyfi-train does
        ("synthetic.yaml", tmp_path / "p.csv", "into 3 tiles aligned to 32", ["--spatial", "1x3"]),
    ):  # fmt: skip
        run = tmp_path / f"run-{recipe}"
        run.mkdir(exist_ok=True)
        rec = load_recipe(root / "recipes" / recipe)
        (run / "recipe.yaml").write_text(yaml.safe_dump(json.loads(rec.model_dump_json())))
        args = [str(run), "--manifest", str(manifest), "--out", str(out), *more]
        assert predict(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err


def test_synth_into_an_earlier_cohort_leaves_only_the_new_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second ``hyfi-synth`` into the same folder left the first cohort's extra slides (not
    in the new labels.csv) and a now negative slide's lesion outlines, which
    ``hyfi-preprocess --annotations`` would read as lesions the image does not have."""
    from hyfi_imaging.cli.synth import main as synth

    out = tmp_path / "synth"
    (tmp_path / "synth").mkdir()
    (out / "notes.txt").write_text("mine")  # not the cohort's: kept
    assert synth(["--out", str(out), "--n", "4", "--size", "256", "--seed", "1"]) == 0
    first = {p.name for p in out.iterdir()}
    assert {"synth_000.geojson", "synth_001.geojson", "synth_003.svs"} <= first
    capsys.readouterr()
    assert synth(["--out", str(out), "--n", "2", "--size", "256", "--seed", "2",
                  "--kind", "generic-tiff"]) == 0  # fmt: skip
    labels = (out / "labels.csv").read_text().split()
    positives = {row.split(",")[0] for row in labels[1:] if row.endswith(",1")}
    assert {p.name for p in out.iterdir()} == {
        "labels.csv", "notes.txt", "synth_000.tiff", "synth_001.tiff",
        *(f"{sid}.geojson" for sid in positives),
    }  # fmt: skip
    err = capsys.readouterr().err
    assert "removed" in err and "of an earlier cohort" in err and "synth_003.svs" in err
