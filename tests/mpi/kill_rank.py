"""A job in which rank 1 dies mid-run while the others wait on it.

Why: a dead rank must end the whole job with a non-zero status, never leave
the others blocked in a halo exchange or an all-reduce until a scheduler's
wall-clock limit. The test launches this under ``mpiexec`` and ``torchrun``
and measures how long the job takes to end after the death.

Usage: ``mpiexec -n 2 python tests/mpi/kill_rank.py {halo|allreduce} {exit|sigkill}``.
Rank 1 prints ``DYING <unix time>`` and dies at iteration 3; the survivors are
by then inside the chosen collective, waiting for it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from _worker import start

__all__ = ["main"]


def main(argv: list[str]) -> None:
    op, how = argv
    from hyfi_imaging.parallel.halo import Neighbours, halo_exchange
    from hyfi_imaging.parallel.launch import fail_fast

    def body() -> None:
        world = int(os.environ.get("WORLD_SIZE") or os.environ.get("PMI_SIZE") or 1)
        pc = start((1, world))
        nb = Neighbours(left=pc.peer(dx=-1), right=pc.peer(dx=1))
        x = torch.ones(1, 2, 8, 8)
        for it in range(1000):
            if pc.rank == 1 and it == 3:
                time.sleep(0.5)  # let the others enter the collective first
                print(f"DYING {time.time():.3f}", flush=True)
                if how == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(9)
            if op == "halo":
                y = halo_exchange(x.requires_grad_(True), (0, 0, 2, 2), nb)
                y.sum().backward()
            else:
                t = torch.ones(4)
                dist.all_reduce(t, group=pc.group("sp"))
        print("SURVIVED: the job did not notice the death", flush=True)

    fail_fast(body, prog="kill-rank")


if __name__ == "__main__":
    main(sys.argv[1:])
