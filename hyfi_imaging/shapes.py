"""One spelling of sizes and grids for every command and recipe.

Why one parser: three used to exist, and they disagreed. ``hyfi-verify
--image-size 512`` read a 512 x 1 image (the grid parser's "a bare number is
rows") while ``hyfi-plan --image-size 512`` read 512 x 512, and a recipe
refused a bare number altogether. Now every size and every grid is read here:

* ``512`` is 512 x 512 (a square image, a 2-D grid ``2`` is 2 x 2);
* ``HxW`` (``512x384``, ``2x1``) and ``DxHxW`` for volumes (``40x48x56``,
  ``2x1x2``);
* ``L<n>`` is one-dimensional: a signal's length (``L4096``) or a grid of
  segments along it (``L4``) -- a 1-D shape is never a bare number;
* a list of 2-D grids, one per pipeline stage (``2x2,1x2,1x1``), for ``--spatial``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from hyfi_imaging.errors import ConfigError

__all__ = ["parse_shape", "parse_shapes", "shape_text"]

_ONE_D = re.compile(r"\s*[lL]\s*(\d+)\s*")
_ND = re.compile(r"\s*(\d+)\s*(?:[xX*,]\s*(\d+)\s*(?:[xX*,]\s*(\d+)\s*)?)?")


def _explain(what: str, kind: str) -> str:
    example = "512, 512x384, 40x48x56 or L4096" if kind == "size" else "2x2, 2x1x2 or L4"
    return f"write the {kind} as N (N x N), HxW, DxHxW or L<N> (1-D), e.g. {example}"


def parse_shape(
    text: str | int | Sequence[int], what: str, *, kind: str = "size", minimum: int = 1
) -> tuple[int, ...]:
    """``"512"`` -> (512, 512); ``"512x384"`` -> (512, 384); ``"2x1x2"`` -> (2, 1, 2); ``"L4"`` -> (4,).

    ``what`` names the option or recipe key in the error; ``kind`` is ``"size"``
    or ``"grid"`` (words of the message only); every side must be ``>= minimum``.
    An int or a sequence of ints (YAML) is taken as already read (an int as N x N).
    """
    if isinstance(text, int):
        values: tuple[int, ...] = (text, text)
    elif isinstance(text, (list, tuple)):
        values = tuple(int(v) for v in text)
    else:
        s = str(text)
        one = _ONE_D.fullmatch(s)
        nd = _ND.fullmatch(s)
        if one:
            values = (int(one.group(1)),)
        elif nd:
            found = [int(v) for v in nd.groups() if v is not None]
            values = (found[0], found[0]) if len(found) == 1 else tuple(found)
        else:
            raise ConfigError(what, f"cannot read the {kind} {s!r}", _explain(what, kind))
    if not 1 <= len(values) <= 3 or min(values) < minimum:
        raise ConfigError(
            what,
            f"{kind} {shape_text(values)} needs 1 to 3 sides of at least {minimum}",
            _explain(what, kind),
        )
    return values


def parse_shapes(text: str, what: str) -> tuple[tuple[int, ...], ...]:
    """``"2x2,1x2,1x1"`` -> one 2-D grid per pipeline stage; ``"2x2"`` -> ((2, 2),)."""
    parts = [p for p in re.split(r"[;,]\s*(?=\d+\s*[xX*])", text.strip()) if p.strip()]
    if len(parts) <= 1:
        return (parse_shape(text, what, kind="grid"),)
    return tuple(parse_shape(p, what, kind="grid") for p in parts)


def shape_text(shape: Sequence[int]) -> str:
    """(512, 384) -> ``"512x384"``; (4,) -> ``"L4"``: what :func:`parse_shape` reads back."""
    return f"L{shape[0]}" if len(shape) == 1 else "x".join(str(v) for v in shape)
