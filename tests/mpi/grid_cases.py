"""Every halo and layer case of one tile grid, in one launch.

Why one launch: starting N Python processes with torch and a process group
costs ~2 s, more than all the cases of a grid together.

Usage: ``mpiexec -n 6 python tests/mpi/grid_cases.py 3x2`` prints one JSON
line ``{"grid": ..., "cases": {"halo/<case>": ..., "layer/<case>": ...}}``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import halo_cases
import layer_cases
from _worker import Case, emit, merge_ranks, parse_grid, run_cases, start

__all__ = ["case_names", "main"]


def case_names(grid: tuple[int, int]) -> list[str]:
    """Names the launch for ``grid`` reports (for pytest, without processes)."""
    return [f"halo/{n}" for n in halo_cases.case_names(grid)] + [
        f"layer/{n}" for n in layer_cases.case_names()
    ]


def main(argv: list[str]) -> None:
    began = time.perf_counter()
    pc = start(parse_grid(argv[0]))
    todo: dict[str, Callable[[], Case]] = {
        **{f"halo/{k}": v for k, v in halo_cases.cases(pc).items()},
        **{f"layer/{k}": v for k, v in layer_cases.cases(pc).items()},
    }
    verdicts = merge_ranks(run_cases(todo))
    emit({"grid": argv[0], "cases": verdicts, "seconds": time.perf_counter() - began})


if __name__ == "__main__":
    main(sys.argv[1:])
