"""Launching multi-rank jobs from pytest: mpiexec, torchrun, a plain process.

Why in one place: every multi-rank test needs the same things — a clean
environment (no rank variables leaking in from the caller, one thread per
rank on a small machine), a hard timeout that kills the whole process group
rather than leaving orphans, and the worker's one result line parsed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "MPI_DIR",
    "RANK_MEMORY_GIB",
    "REPO",
    "Job",
    "have_mpiexec",
    "json_line",
    "kernel_oom_lines",
    "marked_results_per_world",
    "merged_result",
    "mpiexec",
    "results_per_world",
    "plain",
    "python",
    "run",
    "selected_cases",
    "torchrun",
    "torchrun_nodes",
    "training_verdict",
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
    """A finished (or killed) job: exit status, output, wall time, and the peak resident set
    size of its largest process (the launcher, a proxy or a rank: ``wait4``'s ``ru_maxrss``
    covers every descendant the job reaped)."""

    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    ended: float  # unix time the job was seen to end
    peak_rss: int = 0  # bytes

    def describe(self) -> str:
        tail = "\n".join(self.stderr.strip().splitlines()[-15:])
        return (
            f"$ {' '.join(self.cmd)}\nexit {self.returncode} after {self.seconds:.1f} s"
            f"{' (TIMED OUT)' if self.timed_out else ''}, largest process "
            f"{self.peak_rss / 2**30:.2f} GiB\n--- stdout (tail)\n"
            f"{self.stdout[-2000:]}\n--- stderr (tail)\n{tail}"
        )


def have_mpiexec() -> bool:
    return shutil.which("mpiexec") is not None


#: The fork servers' sockets (``_forkserver.py``), started on first use; empty when off.
_SERVERS: list[str] = []
_SERVER_PROCS: list[subprocess.Popen[str]] = []


def _start_servers() -> list[str]:
    """Two fork servers (ranks alternate between them; each hashes strings with its own
    seed), started once per test session and ended with it. ``HYFI_TEST_FORK=0`` turns
    them off: every launch then starts a new interpreter."""
    if _SERVERS or os.environ.get("HYFI_TEST_FORK", "1") == "0":
        return _SERVERS
    import atexit
    import random

    where = Path(tempfile.mkdtemp(prefix="hyfi-fork-"))
    seeds = random.sample(range(1, 2**31), 2)
    for i, seed in enumerate(seeds):
        path = str(where / f"server{i}.sock")
        proc = subprocess.Popen(
            [sys.executable, str(MPI_DIR / "_forkserver.py"), path],
            cwd=REPO, env={**_env(), "PYTHONHASHSEED": str(seed)}, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        _SERVER_PROCS.append(proc)
        _SERVERS.append(path)
    for proc in _SERVER_PROCS:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", (
            "a fork server did not start (HYFI_TEST_FORK=0 runs the tests without them)"
        )

    def stop() -> None:
        for proc in _SERVER_PROCS:
            assert proc.stdin is not None
            proc.stdin.close()  # the server leaves when its stdin closes
        for proc in _SERVER_PROCS:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        shutil.rmtree(where, ignore_errors=True)

    atexit.register(stop)
    os.environ.update(HYFI_FORK_SERVER=os.pathsep.join(_SERVERS), HYFI_FORK_PYTHON=sys.executable)
    return _SERVERS


def python(*, fork: bool = True) -> list[str]:
    """The command that stands for ``python`` in a test launch: the fork server's client
    (``_forkserver.py``: torch is imported once per session, not once per rank), or this
    interpreter where the servers are off or ``fork`` is False.

    ``fork=False`` where the test is about the processes themselves: a job meant to fail
    (a rank that exits without MPI's finalize makes MPICH's proxy kill the ranks still
    running; a new interpreter's exit status is final the moment it calls exit, while a
    client still waits for its child's teardown, so a kill could turn an exit 2 into
    "Killed"), or a test that signals, stops or names a rank's process."""
    if not fork or not _start_servers():
        return [sys.executable]
    return [sys.executable, "-I", "-S", str(MPI_DIR / "_forkclient.py")]


def _env() -> dict[str, str]:
    # SLURM_*: a suite run inside a SLURM job must not make its launches part of that job.
    env = {
        k: v for k, v in os.environ.items() if k not in _RANK_VARS and not k.startswith("SLURM_")
    }
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run(cmd: list[str], *, timeout: float) -> Job:
    """Run ``cmd`` in its own session from the repository root; kill the group on timeout.

    The job is reaped with ``os.wait4`` (its output read by two threads meanwhile), whose
    resource usage gives :attr:`Job.peak_rss`: Linux reports the largest resident set of
    the process and of every descendant it waited for, so the launcher's figure is its
    largest rank's. A process forked by a fork server (:func:`python`) is no descendant of
    the job; its client writes the process's peak to ``HYFI_TEST_RANK_PEAKS``, read here.
    """
    began = time.perf_counter()
    peaks = tempfile.NamedTemporaryFile("r", prefix="hyfi-peaks-", suffix=".txt")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, cwd=REPO, env={**_env(), "HYFI_TEST_RANK_PEAKS": peaks.name}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    chunks: dict[str, list[str]] = {"out": [], "err": []}
    readers = [
        threading.Thread(target=lambda f=f, k=k: chunks[k].append(f.read()), daemon=True)
        for f, k in ((proc.stdout, "out"), (proc.stderr, "err"))
    ]
    for t in readers:
        t.start()
    timed_out, deadline = False, time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if not timed_out and time.monotonic() > deadline:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    with contextlib.suppress(ProcessLookupError):  # what the job left behind goes with it
        os.killpg(proc.pid, signal.SIGKILL)
    for t in readers:
        t.join()
    ended = time.time()
    out, err = "".join(chunks["out"]), "".join(chunks["err"])
    with peaks:  # what forked processes reported (their parent is a fork server, not the job)
        forked = [int(line) for line in peaks.read().split()]
    return Job(
        cmd, proc.returncode, out, err, time.perf_counter() - began, timed_out, ended,
        peak_rss=max([usage.ru_maxrss, *forked]) * 1024,
    )  # fmt: skip


#: What MPICH prints when a rank died of SIGKILL.
_KILLED = "Killed (signal 9)"


def rank_killed(output: str) -> bool:
    """Whether MPICH reported a rank killed by SIGKILL in a job's ``output``."""
    return _KILLED in output


def kernel_oom_lines(since: float) -> list[str]:
    """The kernel log's out-of-memory lines (``oom-kill``, ``Killed process``) of the last
    minutes, or one line saying the log could not be read.

    Why: a SIGKILLed rank is usually the kernel's global OOM killer, which the cgroup's
    own counter does not show; the kernel log names it and the process it killed.
    """
    try:
        proc = subprocess.run(
            ["dmesg", "--time-format", "iso"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return [f"(kernel log not readable: {err})"]
    if proc.returncode != 0:
        return [f"(kernel log not readable: {proc.stderr.strip()[:200]})"]
    wanted = ("oom-kill", "Killed process", "Out of memory")
    lines = [ln for ln in proc.stdout.splitlines() if any(w in ln for w in wanted)]
    return lines[-6:] or [f"(no out-of-memory line in the kernel log since {time.ctime(since)})"]


#: What one process of a test launch may hold at its peak unless the test says otherwise
#: (the machine has 24 GiB; the default suite's largest rank peaks near 2 GiB).
RANK_MEMORY_GIB = 4.0


def mpiexec(
    n: int,
    *args: str,
    timeout: float = 240.0,
    options: tuple[str, ...] = (),
    memory_gib: float = RANK_MEMORY_GIB,
    fork: bool = True,
) -> Job:
    """``mpiexec [OPTIONS] -n N python ARGS`` (a script path or ``-m module``), once.

    A rank that died is never launched again to hide it: its death fails the test that reads the
    job, with its cause -- the exit status and, for a SIGKILL, the kernel's
    out-of-memory lines (:func:`kernel_oom_lines`) appended to the job's stderr. A job
    whose largest process held more than ``memory_gib`` fails here (AssertionError): a
    memory regression is a failure, not a kill waiting to happen on a smaller machine.
    """
    cmd = ["mpiexec", *options, "-n", str(n), *python(fork=fork), *args]
    began = time.time()
    job = run(cmd, timeout=timeout)
    if job.returncode != 0 and rank_killed(job.stdout + job.stderr):
        job.stderr += "\nA rank was killed by SIGKILL; kernel log:\n" + "\n".join(
            kernel_oom_lines(began)
        )
    if os.environ.get("HYFI_TEST_PEAKS"):  # a record of every launch's peak, for budgets
        with open(os.environ["HYFI_TEST_PEAKS"], "a") as log:
            log.write(f"{job.peak_rss / 2**30:.3f} GiB {n} ranks {' '.join(args)[:160]}\n")
    assert job.peak_rss <= memory_gib * 2**30, (
        f"a process of this job held {job.peak_rss / 2**30:.2f} GiB, over its budget of "
        f"{memory_gib} GiB\n{job.describe()}"
    )
    return job


def torchrun(n: int, *args: str, timeout: float = 240.0) -> Job:
    """``torchrun --standalone --nproc-per-node N ARGS`` (``python -m torch.distributed.run``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    return run([*cmd, *args], timeout=timeout)


def torchrun_nodes(nodes: int, per_node: int, *args: str, timeout: float = 240.0) -> list[Job]:
    """``torchrun --nnodes NODES --nproc-per-node PER_NODE ARGS`` once per "node", all on this
    machine, meeting at a c10d rendezvous on localhost: one Job per agent, in node order.

    Why several agents: LOCAL_WORLD_SIZE, GROUP_RANK and global rank != local rank only
    occur when a job spans nodes. Each agent's process group is killed at ``timeout``.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    began = time.perf_counter()
    procs = []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
               f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=localhost:{port}", f"--rdzv-id=hyfi-{port}",
               f"--node-rank={node}", *args]  # fmt: skip
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        procs.append((cmd, proc))
    jobs = []
    for cmd, proc in procs:
        timed_out = False
        try:
            out, err = proc.communicate(timeout=max(1.0, timeout - (time.perf_counter() - began)))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        jobs.append(
            Job(cmd, proc.returncode, out, err, time.perf_counter() - began, timed_out, time.time())
        )
    return jobs


def plain(*args: str, timeout: float = 240.0, fork: bool = True) -> Job:
    """``python ARGS`` in one process (see :func:`python` for ``fork``)."""
    return run([*python(fork=fork), *args], timeout=timeout)


def json_line(job: Job) -> dict[str, Any]:
    """The last JSON object a job printed: a worker's marked line, else a bare ``{...}`` line."""
    for line in reversed(job.stdout.splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER) :])  # type: ignore[no-any-return]
        if line.startswith("{"):
            return json.loads(line)  # type: ignore[no-any-return]
    raise AssertionError(f"no JSON result line\n{job.describe()}")


def merged_result(job: Job) -> dict[str, Any]:
    """The merged result line of a worker that ends with ``_worker.emit``, else the job's failure.

    Rank 0 prints that line only after every rank finished every case and the verdicts were
    gathered; a job that then fails (a rank dying at teardown) fails the test with its
    cause all the same: a death is never accepted.
    """
    lines = [ln for ln in job.stdout.splitlines() if ln.startswith(MARKER)]
    assert lines, f"no merged result line\n{job.describe()}"
    assert job.returncode == 0, f"the job failed after its result line\n{job.describe()}"
    return json.loads(lines[-1][len(MARKER) :])  # type: ignore[no-any-return]


def results_per_world(
    worker: str | Path, worlds: dict[int, list[str]], *, per_case: float = 60.0
) -> dict[str, tuple[dict[str, Any], Job]]:
    """Every case of ``worlds`` (world size -> case names), one ``mpiexec`` per world size.

    A launch costs seconds of start-up and a case less, so the cases of one size share one.
    The worker gets the case names as arguments and prints one JSON line per case with its
    name under ``"case"``; a case without one gets ``{"error": "no result"}`` and its job.
    """
    out: dict[str, tuple[dict[str, Any], Job]] = {}
    for n, cases in worlds.items():
        job = mpiexec(n, str(worker), *cases, timeout=120 + per_case * len(cases))
        lines = [json.loads(ln) for ln in job.stdout.splitlines() if ln.startswith("{")]
        for case in cases:
            found = next((r for r in lines if r.get("case") == case), {"error": "no result"})
            out[case] = found, job
    return out


def selected_cases(request: pytest.FixtureRequest, param: str = "name") -> set[str]:
    """The values of parameter ``param`` of the tests of the requesting module that this run
    selected (after ``-m``, ``-k`` and node ids): a shared launch runs only those cases.

    Why: a module's cases share one launch per world size (a launch costs seconds of
    start-up), and ``-m "not slow"`` must also keep the slow cases out of that launch.
    """
    return {
        item.callspec.params[param]
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and hasattr(item, "callspec")
        and param in item.callspec.params
    }


def marked_results_per_world(
    script: str | Path,
    cases: Mapping[str, tuple[int, Any]],
    marker: str,
    *,
    only: Collection[str] | None = None,
    worlds: Iterable[int] = (),
    timeout: float = 540.0,
) -> dict[int, dict[str, Any]]:
    """One ``mpiexec`` of ``script`` per world size that the cases of ``cases`` (name ->
    (ranks, config)) named in ``only`` (all when None) need, plus each of ``worlds``, one
    after the other (few cores). The script gets the case names as arguments (``--none``
    for none) and prints every verdict by name on one line starting with ``marker``.

    A world's result is that object, or ``{"_launch": {"ok": False, "error": ...}}`` when it
    printed none or exited non-zero (a death is a failure, with its cause: see :func:`mpiexec`).
    """
    names: dict[int, list[str]] = {n: [] for n in worlds}
    for name, (n, _) in cases.items():
        if only is None or name in only:
            names.setdefault(n, []).append(name)
    out: dict[int, dict[str, Any]] = {}
    for n in sorted(names):
        job = mpiexec(n, str(script), *(names[n] or ["--none"]), timeout=timeout)
        lines = [ln for ln in job.stdout.splitlines() if ln.startswith(marker)]
        out[n] = (
            json.loads(lines[-1][len(marker) :])
            if lines and job.returncode == 0
            else {"_launch": {"ok": False, "error": job.describe()[-3000:]}}
        )
    return out


#: What a training-layout case must have compared with one process (not just some of it).
COMPARED_KINDS = ("loss", "grad/", "final/", "predict/output", "output[", "input_grad[")


def training_verdict(launches: dict[int, dict[str, Any]], n: int, name: str) -> dict[str, Any]:
    """Case ``name``'s verdict from the launch of ``n`` ranks (:func:`marked_results_per_world`),
    asserted exact and comparing every kind of tensor of :data:`COMPARED_KINDS`."""
    verdict = launches[n].get(name) or launches[n].get("_launch")
    assert verdict is not None, f"{name}: no result"
    assert verdict.get("ok"), f"{name}: {verdict}"
    for kind in COMPARED_KINDS:
        assert any(kind in x for x in verdict["names"]), f"{name}: nothing named {kind!r} compared"
    return verdict
