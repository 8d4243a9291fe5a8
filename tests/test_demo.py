"""The README's demo runs end to end (small settings) and writes what it promises."""

from __future__ import annotations

from pathlib import Path

from hyfi_imaging.cli.demo import main


def test_demo_small(tmp_path: Path, capsys: object) -> None:
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
