"""Launching multi-rank jobs from pytest: mpiexec, torchrun, a plain process.

Why in one place: every multi-rank test needs the same things — a clean
environment (no rank variables leaking in from the caller, one thread per
rank on a small machine), a hard timeout that kills the whole process group
rather than leaving orphans, and the worker's one result line parsed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MPI_DIR",
    "REPO",
    "Job",
    "have_mpiexec",
    "json_line",
    "mpiexec",
    "plain",
    "run",
    "torchrun",
]

MPI_DIR = Path(__file__).resolve().parent
REPO = MPI_DIR.parent.parent
MARKER = "HYFI-RESULT "
_RANK_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK", "PMI_RANK", "PMI_SIZE", "PMI_FD",
    "PMI_PORT", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "MV2_COMM_WORLD_RANK",
)  # fmt: skip


@dataclass
class Job:
    """A finished (or killed) job: exit status, output, wall time."""

    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    ended: float  # unix time the job was seen to end

    def describe(self) -> str:
        tail = "\n".join(self.stderr.strip().splitlines()[-15:])
        return (
            f"$ {' '.join(self.cmd)}\nexit {self.returncode} after {self.seconds:.1f} s"
            f"{' (TIMED OUT)' if self.timed_out else ''}\n--- stdout (tail)\n"
            f"{self.stdout[-2000:]}\n--- stderr (tail)\n{tail}"
        )


def have_mpiexec() -> bool:
    return shutil.which("mpiexec") is not None


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run(cmd: list[str], *, timeout: float) -> Job:
    """Run ``cmd`` in its own session from the repository root; kill the group on timeout."""
    began = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    ended = time.time()
    return Job(cmd, proc.returncode, out, err, time.perf_counter() - began, timed_out, ended)


def mpiexec(n: int, *args: str, timeout: float = 240.0, options: tuple[str, ...] = ()) -> Job:
    """``mpiexec [OPTIONS] -n N python ARGS`` (a script path or ``-m module``)."""
    return run(["mpiexec", *options, "-n", str(n), sys.executable, *args], timeout=timeout)


def torchrun(n: int, *args: str, timeout: float = 240.0) -> Job:
    """``torchrun --standalone --nproc-per-node N ARGS`` (``python -m torch.distributed.run``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    return run([*cmd, *args], timeout=timeout)


def plain(*args: str, timeout: float = 240.0) -> Job:
    """``python ARGS`` in one process."""
    return run([sys.executable, *args], timeout=timeout)


def json_line(job: Job) -> dict[str, Any]:
    """The last JSON object a job printed: a worker's marked line, else a bare ``{...}`` line."""
    for line in reversed(job.stdout.splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER) :])  # type: ignore[no-any-return]
        if line.startswith("{"):
            return json.loads(line)  # type: ignore[no-any-return]
    raise AssertionError(f"no JSON result line\n{job.describe()}")
