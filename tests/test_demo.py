"""The README's demo runs end to end (small settings) and writes what it promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyfi_imaging.cli.demo import main


def test_demo_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "--out",
            str(tmp_path),
            "--slides",
            "2",
            "--slide-size",
            "1024",
            "--size",
            "512",
            "--workers",
            "1",
            "--no-train",
        ]
    )
    assert code == 0
    for name in (
        "data_full/manifest.csv",
        "data_full/contact_sheet.png",
        "tile_grid.png",
        "data_down8/synth_000.zarr",
        "data_full/synth_000.zarr/labels/annotations",  # the cohort's lesion masks
    ):
        assert (tmp_path / name).exists(), name
    assert (tmp_path / "tile_grid.png").stat().st_size > 10_000
    # 1024 px slides on a 512 canvas are shrunk: the stores' real resolution is said (the
    # labels said 0.5 and 4 um/px whatever was used)
    printed = capsys.readouterr().out
    assert "stores at 1 um/px and 8 um/px (the canvas shrank the slides)" in printed, printed


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--slides", "0"], "--slides: must be 1 or more"),
        (["--size", "0"], "--size: must be 1 or more"),  # each slide failed after minutes
        (["--workers", "0"], "--workers: must be 1 or more"),
    ],
)
def test_demo_refuses_counts_that_mean_nothing(
    args: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(args)
    assert caught.value.code == 2 and said in capsys.readouterr().err


def test_demo_refuses_slides_too_small_for_its_lesions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A traceback naming hyfi-synth's --lesions and --size, options hyfi-demo does not have."""
    assert main(["--out", str(tmp_path / "d"), "--slide-size", "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hyfi-demo: error: --slide-size: 12 lesions cannot fit"), err
    assert "use a larger --slide-size" in err and "--lesions" not in err
    assert not (tmp_path / "d").exists()
