"""The one-process reference of a verification runs on rank 0 only (``parallel.reference``).

Its memory -- only rank 0 holds the whole-image reference -- is checked where hyfi-verify runs
a 3-D U-Net (``tests/test_volume_mpi.py``); here, that a failure of the reference on rank 0
reaches every rank at once instead of leaving them waiting, and that the job stays in step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))

from _launch import have_mpiexec, json_line, mpiexec

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not installed"),
]
WORKER = Path(__file__).resolve().parent / "workers" / "reference_failure.py"


def test_a_failed_reference_is_raised_on_every_rank() -> None:
    job = mpiexec(2, str(WORKER), timeout=120)  # a rank left waiting would time out here
    assert job.returncode == 0, job.describe()
    result = json_line(job)
    rank0, rank1 = result["errors"]
    assert rank0 == "RuntimeError: the whole image reached the guard", result
    assert rank1.startswith("RuntimeError: rank 0, in the one-process reference:"), result
    assert "the whole image reached the guard" in rank1
    assert result["second_ok"] is True  # the next verification in the job runs normally
