"""Argument types shared by the command-line tools (one vocabulary, one set of messages)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["positive_float", "size_type"]


def positive_float(text: str) -> float:
    """A float > 0 (``--mpp``, ``--mpp-override``)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def size_type(minimum: int = 1) -> Callable[[str], tuple[int, int]]:
    """Parser of ``"N"`` -> (N, N) and ``"HxW"`` -> (H, W) with sides >= ``minimum``."""

    def parse(text: str) -> tuple[int, int]:
        try:
            values = [int(p) for p in text.lower().split("x")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"size must be N or HxW, got {text!r}") from None
        if len(values) not in (1, 2) or min(values) < minimum:
            raise argparse.ArgumentTypeError(
                f"size must be N or HxW with sides >= {minimum}, got {text!r}"
            )
        return values[0], values[-1]

    return parse
