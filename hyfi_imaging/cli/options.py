"""Argument types shared by the command-line tools (one vocabulary, one set of messages)."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.shapes import parse_shape, parse_shapes

__all__ = [
    "count_int",
    "grids_type",
    "memory_size",
    "nonnegative_float",
    "positive_float",
    "positive_int",
    "shape_type",
    "size_type",
]

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}  # fmt: skip


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0 (``--mpp``, ``--mpp-override``, ``--rate``)."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite float >= 0 (``--margin-um``, ``--link-latency``)."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _whole(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {minimum} or more, got {text}")
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1 (``--devices``, ``--batch``, ``--gpus-per-node``, ...)."""
    return _whole(text, 1)


def count_int(text: str) -> int:
    """A whole number >= 0 (``--overlays``: how many, none allowed)."""
    return _whole(text, 0)


def classes_int(text: str) -> int:
    """A whole number >= 2 (``--num-classes``: a cross-entropy over one class is 0 for every
    weight, so its gradients are 0 and every comparison of them passes)."""
    return _whole(text, 2)


def shape_type(what: str, minimum: int = 1) -> Callable[[str], tuple[int, ...]]:
    """Parser of a size of 1 to 3 sides (``512``, ``512x384``, ``40x48x56``, ``L4096``)."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            return parse_shape(text, what, minimum=minimum)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(f"{err.what}; {err.fix}") from None

    return parse


def grids_type(text: str) -> tuple[tuple[int, ...], ...]:
    """Parser of ``--spatial``: one grid (``2x2``, ``2x1x2``, ``L4``) or one per stage."""
    try:
        return parse_shapes(text, "--spatial")
    except ConfigError as err:
        raise argparse.ArgumentTypeError(f"{err.what}; {err.fix}") from None


def size_type(minimum: int = 1) -> Callable[[str], tuple[int, int]]:
    """Parser of an image size ``"N"`` -> (N, N), ``"HxW"`` -> (H, W), sides >= ``minimum``.

    The spelling of :func:`hyfi_imaging.shapes.parse_shape`, limited to two sides.
    """

    def parse(text: str) -> tuple[int, int]:
        try:
            shape = parse_shape(text, "size", minimum=minimum)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(f"{err.what}; {err.fix}") from None
        if len(shape) != 2:
            raise argparse.ArgumentTypeError(f"size must be N or HxW, got {text!r}")
        return shape[0], shape[1]

    return parse


def memory_size(text: str) -> int:
    """``80GiB``, ``512MiB``, ``40GB`` or plain bytes -> bytes (``--device-memory``, ``--memory-budget``)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 80GiB or 512MiB")
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size < 1:  # 0 would silently mean "the default"
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}; write e.g. 80GiB")
    return size
