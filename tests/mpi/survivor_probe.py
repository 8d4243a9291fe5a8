"""Does this ``mpiexec`` let the other ranks live on after one is SIGKILLed?

Why: ``-disable-auto-cleanup`` promises it, and the test that survivors name the lost rank
relies on it, but MPICH 5.0.2's hydra proxy (measured with ``strace``, 2026-11-27) sends
each survivor's process group SIGUSR1 and then SIGKILL within a millisecond of the death
even with the flag. Rank 1 SIGKILLs itself; every other rank, with MPI initialised as the
library's ranks have it, waits 1.5 s and prints ``ALIVE <rank>``.

Usage: ``mpiexec -disable-auto-cleanup -n 3 python tests/mpi/survivor_probe.py``.
"""

from __future__ import annotations

import os
import signal
import time

from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
if rank == 1:
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(1.5)
print(f"ALIVE {rank}", flush=True)
