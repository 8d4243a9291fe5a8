"""A job whose ranks build the model from different seeds (``--divergent``) or the same one.

Usage: ``mpiexec -n 2 python tests/mpi/divergent_init.py [--divergent]``. Each
rank builds the convchain model and a 1x2 :class:`ParallelModel`; with
``--divergent`` rank r seeds with r, which must be refused on every rank before
any training (one line, printed once, exit status 2). Prints ``BUILT`` otherwise.
"""

from __future__ import annotations

import sys

import torch

from hyfi_imaging.models import create_model
from hyfi_imaging.parallel.engine import ParallelModel, ParallelPlan
from hyfi_imaging.parallel.launch import exit_now, fail_fast, init_parallel
from hyfi_imaging.parallel.layout import Layout


def main(divergent: bool) -> None:
    layout = Layout(dp=1, pp=1, sp=(1, 2))

    def body() -> None:
        pc = init_parallel(layout)
        torch.manual_seed(pc.rank if divergent else 0)
        model = create_model("convchain", num_classes=2)
        ParallelModel(model, pc, ParallelPlan(layout), image_hw=(64, 64))
        print(f"BUILT {pc.rank}", flush=True)

    fail_fast(body, prog="divergent-init")
    exit_now(0)


if __name__ == "__main__":
    main("--divergent" in sys.argv[1:])
