"""What a test launch's process sees at its start, for ``tests/test_forkserver.py``.

Usage: ``python tests/mpi/fork_probe.py EXIT [kill]``: prints one JSON line (the modules it
started with, its ``argv``, directory, rank, a string hash, pid) and one stderr line, then
exits with status EXIT, or kills itself with SIGKILL after printing when ``kill`` is given.
"""

from __future__ import annotations

import json
import os
import signal
import sys

started_with = sorted(m for m in ("torch", "hyfi_imaging", "mpi4py") if m in sys.modules)
print(
    json.dumps(
        {
            "modules": started_with,
            "argv": sys.argv,
            "cwd": os.getcwd(),
            "main": __name__,
            "rank": os.environ.get("PMI_RANK"),
            "hash": hash("fork-probe"),
            "pid": os.getpid(),
            "path0": sys.path[0],
        }
    ),
    flush=True,
)
print("probe: to stderr", file=sys.stderr, flush=True)
if sys.argv[2:] == ["kill"]:
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(sys.argv[1]))
