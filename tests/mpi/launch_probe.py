"""What each rank's launcher told it, gathered on rank 0 as one JSON line.

Why: under ``srun``, a multi-node ``torchrun`` or ``mpiexec`` the same bootstrap
must find the same ranks, local ranks, ranks per node and thread counts that
the launcher meant; a wrong local rank picks the wrong GPU and a wrong count
per node oversubscribes the CPUs, without failing anything. Every rank reads
:func:`launch_env` *before* the process group exists (as the trainer does),
then joins the group, and rank 0 prints ``HYFI-RESULT [ {rank's view}, ... ]``
in rank order -- proof that the group formed, with what every rank saw.

Usage: ``srun -n 4 python tests/mpi/launch_probe.py`` (or any launcher).
"""

from __future__ import annotations

import json
import os
import socket

import torch.distributed as dist

from hyfi_imaging.parallel.launch import (
    exit_now,
    fail_fast,
    init_parallel,
    launch_env,
    shutdown,
    threads_per_rank,
)
from hyfi_imaging.parallel.layout import Layout


def main() -> int:
    before = launch_env()
    threads = threads_per_rank()
    pc = init_parallel(Layout(dp=before.world_size), timeout_s=120)
    view = {
        "launcher": before.launcher,
        "rank": pc.rank,
        "env_rank": before.rank,
        "world": pc.world_size,
        "local_rank": pc.local_rank,
        "local_world": before.local_world_size,
        "threads": threads,
        "threads_after_init": threads_per_rank(),
        "cpus": len(os.sched_getaffinity(0)),
        "group_rank": os.environ.get("GROUP_RANK"),
        "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    table: list[object] = [None] * pc.world_size
    dist.all_gather_object(table, view)
    if pc.rank == 0:
        print("HYFI-RESULT " + json.dumps(table), flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    exit_now(fail_fast(main, prog="launch-probe"))
