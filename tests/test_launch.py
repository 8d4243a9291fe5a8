"""Layouts and launchers: one bootstrap for mpiexec, torchrun and a plain process.

Why these tests: a parallel job's worst failures are not wrong numbers but
jobs that never start, start with the wrong shape, or hang forever when one
rank dies. So: :class:`Layout` arithmetic and its error messages are checked
in-process; ``hyfi-verify`` is run under every launcher; a layout that does not
match the world must fail at once with a one-line message naming the numbers;
and a rank killed mid-run must end the whole job, non-zero, within 60 s —
measured under ``mpiexec`` and under ``torchrun``.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))

import _launch
from _launch import have_mpiexec, json_line, torchrun, torchrun_nodes

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.launch import detect_launcher
from hyfi_imaging.parallel.layout import MESH_DIMS, SPATIAL_AXES, Layout

# What this file checks is how ranks start, fail and die: each is a new interpreter, never a
# process forked by the test house's fork server (``_launch.python``).
mpiexec = functools.partial(_launch.mpiexec, fork=False)
plain = functools.partial(_launch.plain, fork=False)

needs_mpi = pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not installed")
VERIFY = ("-m", "hyfi_imaging.cli.verify")
#: A small, fast model and image for launcher tests (total stride 4).
SMALL = ("--model", "resnet20-v2", "--image-size", "29x23", "--steps", "1", "--json")

# --- Layout ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dp", "pp", "sp"),
    [
        (1, 1, (1, 1)),
        (1, 1, (2, 3)),
        (2, 1, (1, 2)),
        (2, 3, (2, 2)),
        (3, 2, (3, 1)),
        (2, 2, (2, 1, 3)),
    ],
)
def test_layout_coords_are_row_major_over_the_mesh(dp: int, pp: int, sp: tuple[int, ...]) -> None:
    layout = Layout(dp=dp, pp=pp, sp=sp)
    assert layout.shape == (dp, pp, *sp)
    assert layout.world_size == dp * pp * math.prod(sp)
    assert layout.sp_size == math.prod(sp)
    assert layout.mesh_dims == ("dp", "pp", "sz", "sy", "sx")[:2] + SPATIAL_AXES[len(sp)]
    seen = set()
    for rank in range(layout.world_size):
        coords = layout.coords(rank)
        assert coords == tuple(int(c) for c in np.unravel_index(rank, layout.shape))
        seen.add(coords)
    assert seen == set(itertools.product(*(range(n) for n in layout.shape)))
    assert MESH_DIMS == ("dp", "pp", "sy", "sx")


def test_layout_check_world_names_the_numbers() -> None:
    layout = Layout(dp=2, sp=(2, 2))
    layout.check_world(8)
    with pytest.raises(ConfigError) as err:
        layout.check_world(6)
    msg = str(err.value)
    assert "\n" not in msg
    assert "needs 8 ranks" in msg and "has 6" in msg and "sp=2x2" in msg
    assert "-np 8" in msg


def test_layout_check_world_names_the_launcher_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun or srun, the fix names that launcher's option, not mpirun's -np."""
    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "SLURM_STEP_ID", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ConfigError) as err:
        Layout(dp=2, sp=(2, 2)).check_world(6)
    assert "--nproc-per-node = 8" in str(err.value) and "mpirun" not in str(err.value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.delenv("WORLD_SIZE")
    for name, value in {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_STEP_NUM_TASKS": "6",
        "SLURM_NTASKS": "6",
    }.items():
        monkeypatch.setenv(name, value)
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError) as err:
        Layout(dp=2, sp=(2, 2)).check_world(6)
    assert "srun -n 8" in str(err.value)


@pytest.mark.parametrize(
    "kwargs",
    [{"sp": (0, 2)}, {"sp": (2, -1)}, {"dp": 0}, {"pp": -3}, {"dp": 1.5}, {"sp": (2.0, 2)}],
)
def test_layout_rejects_non_positive_or_non_integer_axes(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="must be a positive integer"):
        Layout(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("sp", [(), (1, 1, 1, 2)])
def test_layout_rejects_grids_of_other_than_one_to_three_axes(sp: tuple[int, ...]) -> None:
    """1 (a signal's segments, since issue 12), 2 or 3 axes."""
    with pytest.raises(ConfigError, match="2 \\(GYxGX\\) or 3 \\(GZxGYxGX\\) factors"):
        Layout(sp=sp)


@pytest.mark.parametrize(
    ("text", "grid"),
    [
        ("2x3", (2, 3)),
        ("4", (4, 4)),  # square, as a size is (hyfi_imaging.shapes)
        (" 2 X 3 ", (2, 3)),
        ("2*2", (2, 2)),
        ("1,3", (1, 3)),
        ("2x3x4", (2, 3, 4)),  # a volume's grid (gz, gy, gx)
    ],
)
def test_parse_grid_accepts(text: str, grid: tuple[int, ...]) -> None:
    assert Layout.parse_grid(text) == grid


@pytest.mark.parametrize("text", ["", "x", "2x", "x2", "2xx", "2x3x4x5", "-1x2", "axb", "2.5x2"])
def test_parse_grid_rejects_with_one_line(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        Layout.parse_grid(text)
    assert "\n" not in str(err.value) and "HxW" in str(err.value) and "L<N>" in str(err.value)


@pytest.mark.parametrize(
    ("env", "launcher"),
    [
        ({}, "single"),
        ({"PMI_RANK": "0"}, "mpi"),
        ({"OMPI_COMM_WORLD_RANK": "1"}, "mpi"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "torchrun"),
        ({"TORCHELASTIC_RUN_ID": "x", "PMI_RANK": "0"}, "torchrun"),
        ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}, "slurm"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}, "single"),  # sbatch
    ],
)
def test_detect_launcher(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], launcher: str
) -> None:
    """The precedence rules themselves are tested in tests/test_launcher_env.py."""
    for var in list(os.environ):
        if var.startswith(("SLURM_", "PMI_", "OMPI_", "PMIX_", "MV2_", "MPI_LOCAL")):
            monkeypatch.delenv(var)
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert detect_launcher() == launcher


# --- hyfi-verify under every launcher --------------------------------------------------


@pytest.mark.mpi
def test_verify_single_process() -> None:
    job = plain(*VERIFY, *SMALL, "--spatial", "1x1", timeout=120)
    report = json_line(job)
    assert job.returncode == 0 and report["ok"], job.describe()


@pytest.mark.mpi
@pytest.mark.slow
def test_verify_under_torchrun() -> None:
    job = torchrun(2, *VERIFY, *SMALL, "--spatial", "1x2", timeout=180)
    report = json_line(job)
    assert job.returncode == 0 and report["ok"], job.describe()
    assert report["max_rel_error"] < 1e-9


@pytest.mark.mpi
@needs_mpi
def test_layout_world_mismatch_fails_fast_with_one_line() -> None:
    job = mpiexec(3, *VERIFY, *SMALL, "--spatial", "2x2", timeout=60)
    assert job.returncode != 0, job.describe()
    assert job.seconds < 30, job.describe()
    lines = [ln for ln in job.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln]
    assert errors, job.describe()
    assert all("needs 4 ranks" in ln and "has 3" in ln for ln in errors), job.describe()
    assert not any("Traceback" in ln for ln in lines), job.describe()


@pytest.mark.mpi
@pytest.mark.parametrize(
    "spec",
    [
        "2xx",
        "0x2",
    ],
)
def test_invalid_grid_spec_exits_2(spec: str) -> None:
    job = plain(
        *VERIFY, "--model", "resnet20-v2", "--image-size", "29x23", "--spatial", spec, timeout=60
    )
    assert job.returncode == 2, job.describe()
    assert "Traceback" not in job.stderr, job.describe()
    assert "--spatial" in job.stderr or "sp rows" in job.stderr, job.describe()


@pytest.mark.mpi
def test_two_torchrun_nodes_find_their_ranks_and_threads() -> None:
    """Global ranks 0-3 over 2 nodes of 2 (two torchrun agents on this machine): local ranks
    0,1 on each node, and each node's CPUs shared by its 2 ranks, not by all 4."""
    jobs = torchrun_nodes(2, 2, "tests/mpi/launch_probe.py")
    assert all(j.returncode == 0 for j in jobs), "\n".join(j.describe() for j in jobs)
    lines = [ln for j in jobs for ln in j.stdout.splitlines() if ln.startswith("HYFI-RESULT ")]
    assert len(lines) == 1, "\n".join(j.describe() for j in jobs)
    table = json.loads(lines[0].split(" ", 1)[1])
    assert [r["rank"] for r in table] == [0, 1, 2, 3]
    by_node: dict[str, list[int]] = {}
    for r in table:
        assert r["launcher"] == "torchrun" and r["local_world"] == 2, r
        by_node.setdefault(r["group_rank"], []).append(r["local_rank"])
        assert r["threads"] == r["threads_after_init"] == max(1, r["cpus"] // 2), r
    assert by_node == {"0": [0, 1], "1": [0, 1]}, table
    assert any(r["rank"] != r["local_rank"] for r in table)


@pytest.mark.mpi
@pytest.mark.slow
def test_verify_on_two_torchrun_nodes() -> None:
    """hyfi-verify on 2x2 tiles over the two "nodes" agrees with one process."""
    jobs = torchrun_nodes(2, 2, *VERIFY, *SMALL, "--spatial", "2x2")
    assert all(j.returncode == 0 for j in jobs), "\n".join(j.describe() for j in jobs)
    reports = [json_line(j) for j in jobs if "{" in j.stdout]
    assert len(reports) == 1 and reports[0]["ok"], "\n".join(j.describe() for j in jobs)
    assert reports[0]["max_rel_error"] < 1e-9


# --- a rank dies mid-run ---------------------------------------------------------------

KILLS = [
    pytest.param("mpiexec", "halo", "exit", marks=needs_mpi, id="mpiexec-halo-os._exit"),
    pytest.param(
        "mpiexec", "allreduce", "sigkill", marks=needs_mpi, id="mpiexec-allreduce-SIGKILL"
    ),
    pytest.param("torchrun", "allreduce", "exit", id="torchrun-allreduce-os._exit"),
    pytest.param("torchrun", "halo", "sigkill", marks=pytest.mark.slow, id="torchrun-halo-SIGKILL"),
]


@pytest.mark.mpi
@pytest.mark.parametrize(("launcher", "op", "how"), KILLS)
def test_killed_rank_ends_the_job(
    launcher: str, op: str, how: str, record_property: pytest.RecordProperty
) -> None:
    """Rank 1 dies while the others wait on it: the job exits non-zero within 60 s."""
    script = "tests/mpi/kill_rank.py"
    launch = mpiexec if launcher == "mpiexec" else torchrun
    job = launch(2 if launcher == "torchrun" else 3, script, op, how, timeout=90)
    died = [float(ln.split()[1]) for ln in job.stdout.splitlines() if ln.startswith("DYING ")]
    assert died, job.describe()
    assert "SURVIVED" not in job.stdout, job.describe()
    assert not job.timed_out and job.returncode != 0, job.describe()
    after_death = job.ended - died[0]
    record_property("seconds_after_death", round(after_death, 2))
    assert after_death < 60, job.describe()
    print(f"{launcher} {op} {how}: job ended {after_death:.2f} s after rank 1 died")


def _survivors_live_on() -> tuple[bool, str]:
    """Whether this ``mpiexec -disable-auto-cleanup`` leaves the survivors of a SIGKILLed
    rank alive (three probes, all must): see ``tests/mpi/survivor_probe.py``."""
    alive = []
    for _ in range(3):
        job = mpiexec(3, "tests/mpi/survivor_probe.py", timeout=60,
                      options=("-disable-auto-cleanup",))  # fmt: skip
        alive.append(sum(ln.startswith("ALIVE ") for ln in job.stdout.splitlines()))
    return alive == [2, 2, 2], f"survivors alive per probe: {alive} of 2"


# Slow like the other kill tests. Its failures (first seen 2026-11-25: it failed in full
# runs and passed alone) are the launcher's: MPICH 5.0.2's hydra SIGKILLs the survivors
# within a millisecond of the death even with -disable-auto-cleanup (strace, 2026-11-27),
# before they can speak. The probe says so, and the test then skips naming it.
@pytest.mark.slow
@pytest.mark.mpi
@needs_mpi
def test_survivors_name_the_lost_rank() -> None:
    """Each survivor says which rank is gone and its pid (MPICH's banner names only a pid).

    Without ``-disable-auto-cleanup`` MPICH SIGKILLs the survivors as soon as it
    sees the death, which may be before they notice it: then its banner alone
    speaks. With it, where the launcher keeps its word, the survivors get to say it.
    """
    keeps_word, measured = _survivors_live_on()
    if not keeps_word:
        pytest.skip(f"this mpiexec kills the survivors despite -disable-auto-cleanup ({measured})")
    job = mpiexec(3, "tests/mpi/kill_rank.py", "allreduce", "sigkill", timeout=90,
                  options=("-disable-auto-cleanup",))  # fmt: skip
    dying = [ln for ln in job.stdout.splitlines() if ln.startswith("DYING ")]
    assert dying, job.describe()
    lines = [ln for ln in job.stderr.splitlines() if "error:" in ln]
    # A survivor that exits first can take the other's connection with it: at least one
    # speaks, and each that does names rank 1 (perhaps with the survivor gone before or
    # after it: "lost rank 0, 1 (pid ...)").
    assert 1 <= len(lines) <= 2, job.describe()
    for line in lines:
        found = re.search(r"^kill-rank: rank ([02]): error: lost rank ([\d, ]+) \(pid", line)
        assert found, line
        lost = {int(r) for r in found.group(2).split(",")}
        assert 1 in lost and int(found.group(1)) not in lost, line


# --- every rank must start from the same weights -------------------------------------


@pytest.mark.mpi
@needs_mpi
def test_ranks_with_different_initial_weights_are_refused() -> None:
    same = mpiexec(2, "tests/mpi/divergent_init.py", timeout=120)
    assert same.returncode == 0 and same.stdout.count("BUILT") == 2, same.describe()
    job = mpiexec(2, "tests/mpi/divergent_init.py", "--divergent", timeout=120)
    assert job.returncode == 2, job.describe()
    lines = [ln for ln in job.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "ranks built different initial weights" in lines[0], job.describe()
    assert "BUILT" not in job.stdout


def test_a_rendezvous_port_held_by_a_silent_server_ends_in_one_line() -> None:
    """Rank 1 of a job whose rendezvous port is held by something that accepts connections and
    never answers (a foreign server on the SLURM job's derived port): PyTorch's first
    connection to the store waited without a limit, and the rank hung for good. It ends now,
    past its timeout, with the rendezvous line and status 2."""
    import socket
    import subprocess
    import threading
    import time

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])  # accepted, never answered
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.getsockname()[1]),
           "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}  # fmt: skip
    code = "import hyfi_imaging as h; h.init_parallel(h.Layout(sp=(1, 2)), timeout_s=2)"
    start = time.monotonic()
    try:
        job = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        server.close()
    assert job.returncode == 2, job.stderr[-2000:]
    assert "not every one of the job's 2 ranks reached it within 2 s" in job.stderr
    assert time.monotonic() - start < 60


def test_a_rank_that_said_its_own_error_is_not_named_as_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 said "lost rank 1, 2, 3 ... which exited or was killed" after a node's crash
    although rank 1 had printed its own error: only the ranks that said nothing are named."""
    import socket
    import subprocess

    from hyfi_imaging.parallel import launch

    dead = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(3)]
    for p in dead:
        p.wait()
    host = socket.gethostname()
    peers = [(host, os.getpid()), *((host, p.pid) for p in dead)]
    monkeypatch.setattr(launch, "_PEERS", peers)
    launch._note_reported(1)  # rank 1 said why
    try:
        line, _ = launch.failure_line(RuntimeError("Connection reset by peer"), 0)
        assert line is not None and "lost rank 2, 3 (pid" in line, line
        for r in (2, 3):
            launch._note_reported(r)
        assert launch.failure_line(RuntimeError("Connection reset by peer"), 0)[0] is None
    finally:
        notes = launch._notes_dir()
        if notes is not None:
            for r in (1, 2, 3):
                (notes / f"rank{r}").unlink(missing_ok=True)
            notes.rmdir()
