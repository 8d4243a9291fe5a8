"""One spelling of sizes and grids (issue 20, "one vocabulary"): every CLI and recipe agree."""

from __future__ import annotations

import pytest

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.shapes import parse_shape, parse_shapes, shape_text


@pytest.mark.parametrize(
    ("text", "shape"),
    [
        ("512", (512, 512)),  # hyfi-verify read 512 x 1 here
        ("512x384", (512, 384)),
        (" 40 x 48 x 56 ", (40, 48, 56)),
        ("2*3", (2, 3)),
        ("2,3", (2, 3)),
        ("L4096", (4096,)),
        ("l4", (4,)),
        (8, (8, 8)),
        ([2, 1, 2], (2, 1, 2)),
    ],
)
def test_one_spelling(text: object, shape: tuple[int, ...]) -> None:
    assert parse_shape(text, "--image-size") == shape  # type: ignore[arg-type]
    assert parse_shape(shape_text(shape), "--image-size") == shape


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("axb", "cannot read the size 'axb'"),
        ("0x4", "needs 1 to 3 sides of at least 1"),
        ("1x2x3x4", "cannot read"),
        ("L", "cannot read"),
    ],
)
def test_what_cannot_be_read_is_one_line_naming_the_option(text: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said) as caught:
        parse_shape(text, "--image-size")
    assert str(caught.value).startswith("--image-size: ") and "\n" not in str(caught.value)


def test_a_minimum_side_and_stage_grids() -> None:
    with pytest.raises(ConfigError, match="at least 256"):
        parse_shape("128", "--size", minimum=256)
    assert parse_shapes("2x2,1x2,1x1", "--spatial") == ((2, 2), (1, 2), (1, 1))
    assert parse_shapes("2", "--spatial") == ((2, 2),)
    assert parse_shapes("L4", "--spatial") == ((4,),)
