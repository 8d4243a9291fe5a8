"""The test house's fork server (``tests/mpi/_forkserver.py``) stands for a new interpreter.

Most launches of the suite are forked from a server that imported torch once
(``_launch.python``). What a test reads of a job must not depend on that: the exit status,
a death by a signal, the output, the directory, ``argv``, the peak resident set, a fresh
``hyfi_imaging``, string hashes that differ between neighbouring ranks, and no process left
behind when a launch is killed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from _launch import REPO, Job, have_mpiexec, mpiexec, plain, python, rank_killed, run

PROBE = "tests/mpi/fork_probe.py"


def _seen(job: Job) -> list[dict[str, Any]]:
    return [json.loads(line) for line in job.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def forked() -> None:
    if len(python()) == 1:
        pytest.skip("the fork servers are off (HYFI_TEST_FORK=0)")


def test_a_forked_process_is_a_new_interpreter_to_its_test(forked: None) -> None:
    job = plain(PROBE, "3")
    assert job.returncode == 3, job.describe()
    (seen,) = _seen(job)
    assert seen["modules"] == ["torch"], seen  # imported by the server; the package is fresh
    assert seen["argv"] == [PROBE, "3"] and seen["main"] == "__main__", seen
    assert seen["cwd"] == str(REPO) and seen["path0"] == str(REPO / "tests" / "mpi"), seen
    assert job.stderr.strip() == "probe: to stderr", job.describe()
    assert job.peak_rss > 100 * 2**20, job.describe()  # the child's own, as its client said

    killed = plain(PROBE, "0", "kill")
    assert killed.returncode == -9 and _seen(killed), killed.describe()


def test_forked_ranks_differ_and_their_deaths_reach_mpiexec(forked: None) -> None:
    if not have_mpiexec():
        pytest.skip("mpiexec not found (install the mpich extra)")
    job = mpiexec(2, PROBE, "0")
    assert job.returncode == 0, job.describe()
    seen = sorted(_seen(job), key=lambda s: str(s["rank"]))
    assert [s["rank"] for s in seen] == ["0", "1"], seen
    assert all(s["modules"] == ["torch"] for s in seen), seen
    assert seen[0]["hash"] != seen[1]["hash"], seen  # two servers, two hash seeds

    killed = mpiexec(2, PROBE, "0", "kill")
    assert killed.returncode != 0 and rank_killed(killed.stdout + killed.stderr), killed.describe()


def test_a_killed_launch_leaves_no_forked_process_behind(forked: None) -> None:
    sleeper = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
    job = run([*python(), "-c", sleeper], timeout=3)
    assert job.timed_out, job.describe()
    pid = int(job.stdout.split()[0])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists(), f"the forked process {pid} outlived its launch"
