"""Command-line contracts that need no process group: options, messages, exit codes."""

from __future__ import annotations

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
