"""Who launched this process, and as which rank: read from the environment, decided once.

Why a pure function of the environment: every rank must reach the same verdict
before any process group exists (to pick a rendezvous, to plan ``parallel=auto``,
to size its thread pool), and the rules are subtle enough to deserve tests on
plain dictionaries rather than on real launches alone.

Launchers nest -- ``srun`` starts ``torchrun`` or ``mpiexec``, which start the
ranks -- and every level leaves its variables in the environment of the ranks.
The *innermost* launcher is the one that knows the rank, so the precedence is:

1. **torchrun** (``TORCHELASTIC_RUN_ID``, or ``RANK`` and ``WORLD_SIZE``): it is
   always innermost; under ``srun -N2 torchrun ...`` ``SLURM_PROCID`` numbers the
   torchrun agents, not the ranks.
2. **MPI** when its world size differs from the SLURM step's: ``mpiexec`` inside a
   job runs its ranks below one SLURM task (or below one ``srun`` task per node for
   its proxies), so they inherit that task's ``SLURM_PROCID`` and step size, and
   ``PMI_RANK``/``PMI_SIZE`` are the truth. Sizes decide, not ranks, because they
   are the same on every rank: all ranks must choose the same launcher.
3. **SLURM**: a task of an ``srun`` *step* (``SLURM_STEP_ID`` and ``SLURM_PROCID``
   set). With ``srun --mpi=pmi2`` MPICH's ``PMI_RANK``/``PMI_SIZE`` are also set
   and agree with it; SLURM's numbers are then used, and the rendezvous needs no
   MPI library. The batch script of ``sbatch`` (and an ``salloc`` shell) has
   ``SLURM_PROCID=0`` and ``SLURM_NTASKS=4`` but *no step id*: a plain ``python``
   there is one process, not rank 0 of 4. A step's size is ``SLURM_STEP_NUM_TASKS``,
   not the job's ``SLURM_NTASKS`` (a step may use part of the job).
4. **MPI** (``PMI_RANK``, ``OMPI_COMM_WORLD_RANK``, ``PMIX_RANK``, ``MV2_COMM_WORLD_RANK``).
5. **single**: one process.

Under SLURM the rendezvous (``MASTER_ADDR:MASTER_PORT``, where rank 0 serves the
TCP store) is the step's first node -- where block and cyclic distributions both
put task 0 -- and a port computed from the job and step ids, so every task finds
it without talking to the others; ``MASTER_ADDR``/``MASTER_PORT`` override both.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from hyfi_imaging.errors import ConfigError

__all__ = [
    "MPI_RANK_VARS",
    "LaunchEnv",
    "Launcher",
    "expand_hostlist",
    "expand_tasks_per_node",
    "launch_env",
    "launch_with",
    "slurm_port",
    "slurm_rendezvous",
    "threads_per_rank",
]

Launcher = Literal["torchrun", "slurm", "mpi", "single"]
#: The MPI launchers' rank variables, then their size, local rank and ranks-on-this-node ones,
#: each in the order read: MPICH/Hydra (and SLURM's pmi2), Open MPI, PMIx, MVAPICH.
MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_MPI_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")
_MPI_LOCAL_RANK_VARS = (
    "MPI_LOCALRANKID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MV2_COMM_WORLD_LOCAL_RANK",
)
_MPI_LOCAL_SIZE_VARS = (
    "MPI_LOCALNRANKS",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MV2_COMM_WORLD_LOCAL_SIZE",
)
#: SLURM's reserved step ids (batch script, extern, interactive step ...) are not srun steps.
_SLURM_SPECIAL_STEPS = 0xFFFFFFF0
#: Rendezvous ports under SLURM: below Linux's ephemeral range (32768-60999), so that a port
#: the kernel hands out to some connection never collides with it.
_PORT_BASE, _PORT_SPAN = 10000, 20000


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher says about this process (see the module docstring for the rules)."""

    launcher: Launcher
    rank: int
    world_size: int
    local_rank: int
    #: Ranks of this job on this node (torchrun's LOCAL_WORLD_SIZE and its kin).
    local_world_size: int
    #: SLURM's ``--cpus-per-task``, when the job asked for it.
    cpus_per_task: int | None = None


def _int(env: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` that holds a non-negative integer."""
    for name in names:
        value = env.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM's ``SLURM_TASKS_PER_NODE`` form, ``"2(x3),1"``, as ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ConfigError(
                f"tasks per node {text!r}",
                "is not SLURM's N or N(xK) list",
                "unset the variable or report the SLURM version",
            )
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _slurm(env: Mapping[str, str]) -> LaunchEnv | None:
    """This process as a task of an ``srun`` step, or None outside one."""
    step = _int(env, "SLURM_STEP_ID", "SLURM_STEPID")
    rank = _int(env, "SLURM_PROCID")
    if step is None or step >= _SLURM_SPECIAL_STEPS or rank is None:
        return None  # the batch script, an salloc shell, or no SLURM at all
    world = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") or 1
    local = None
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    try:
        counts = expand_tasks_per_node(per_node) if per_node else []
    except ConfigError:
        counts = []  # an unknown form: fall back to the variables below
    if counts:
        local = counts[min(_int(env, "SLURM_NODEID") or 0, len(counts) - 1)]
    local = local or _int(env, "SLURM_NTASKS_PER_NODE")
    if local is None:
        nodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES") or 1
        local = -(-world // nodes)
    return LaunchEnv(
        "slurm",
        rank,
        world,
        _int(env, "SLURM_LOCALID") or 0,
        max(1, local),
        _int(env, "SLURM_CPUS_PER_TASK"),
    )


def _mpi(env: Mapping[str, str]) -> LaunchEnv | None:
    """This process as an MPI rank (from the launcher's variables), or None."""
    rank = _int(env, *MPI_RANK_VARS)
    if rank is None:
        return None
    world = _int(env, *_MPI_SIZE_VARS) or rank + 1
    local_size = _int(env, *_MPI_LOCAL_SIZE_VARS) or world
    return LaunchEnv("mpi", rank, world, _int(env, *_MPI_LOCAL_RANK_VARS) or 0, local_size)


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """This process's launcher, rank, world and local sizes, by the module's precedence rules.

    Under MPI the numbers are the launcher's variables; :func:`.launch.init_parallel`
    still asks MPI itself. Without ``environ``, ``os.environ``.
    """
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env):
        world = _int(env, "WORLD_SIZE") or 1
        return LaunchEnv(
            "torchrun",
            _int(env, "RANK") or 0,
            world,
            _int(env, "LOCAL_RANK") or 0,
            _int(env, "LOCAL_WORLD_SIZE") or world,
        )
    slurm, mpi = _slurm(env), _mpi(env)
    mpi_size = _int(env, *_MPI_SIZE_VARS)
    # Sizes, not ranks, decide: they are the same on every rank, so all ranks choose alike.
    if slurm is not None and (mpi_size is None or mpi_size == slurm.world_size):
        return slurm
    if mpi is not None:
        return mpi
    return LaunchEnv("single", 0, 1, 0, 1)


def launch_with(ranks: int, environ: Mapping[str, str] | None = None) -> str:
    """How to start ``ranks`` ranks with the launcher that started this process (for messages).

    OK: under torchrun, ``launch_with(4)`` names ``--nnodes x --nproc-per-node = 4``;
    under ``srun``, ``srun -n 4``; under MPI or alone, ``mpirun -np 4``.
    """
    env = os.environ if environ is None else environ
    # init_parallel gives MPI and SLURM ranks torchrun's variables (for a later init), and
    # notes what launched them: under mpiexec the fix named torchrun's options.
    launcher = env.get("HYFI_LAUNCHED_BY") or launch_env(env).launcher
    if launcher == "torchrun":
        return f"launch {ranks} ranks (torchrun with --nnodes x --nproc-per-node = {ranks})"
    if launcher == "slurm":
        return f"launch {ranks} ranks (srun -n {ranks})"
    return f"launch with -np {ranks} (mpirun -np {ranks})"


def threads_per_rank(environ: Mapping[str, str] | None = None, *, cpus: int | None = None) -> int:
    """Threads for one rank's CPU work: this node's CPUs shared by this job's ranks on it.

    ``cpus`` defaults to the CPUs this process may run on (its affinity mask, which
    honours ``taskset`` and cpusets; ``os.cpu_count()`` where there is none). The
    ranks on this node come from ``LOCAL_WORLD_SIZE`` (torchrun), SLURM's tasks per
    node of the step, ``MPI_LOCALNRANKS`` (MPICH) or ``OMPI_COMM_WORLD_LOCAL_SIZE``
    (Open MPI), else the world size. A SLURM job that asked for ``--cpus-per-task``
    gets that many (at most ``cpus``). At least 1. Dividing by the world size instead
    would starve multi-node jobs: 2 nodes x 4 ranks on 32-core nodes want 8 threads
    per rank, not 4.
    """
    env = os.environ if environ is None else environ
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
    le = launch_env(env)
    # After init_parallel a SLURM rank carries torchrun's variables too (HYFI_LAUNCHED_BY
    # says who started it): its --cpus-per-task was read as a torchrun rank's share.
    slurm = _slurm(env) if env.get("HYFI_LAUNCHED_BY", le.launcher) == "slurm" else None
    if slurm is not None and slurm.cpus_per_task:
        return max(1, min(slurm.cpus_per_task, cpus))
    return max(1, cpus // max(1, le.local_world_size))


# --- the SLURM rendezvous --------------------------------------------------------------


def _expand_one(name: str) -> list[str]:
    """``rack[1-2]-n[01,03]`` -> the product of its bracket groups, in SLURM's order."""
    m = re.search(r"\[([^\[\]]*)\]", name)
    if m is None:
        if any(c in name for c in "[]"):
            raise ValueError(name)
        return [name]
    head, tail = name[: m.start()], name[m.end() :]
    values: list[str] = []
    for item in m.group(1).split(","):
        lo, _, hi = item.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(name)
        width = len(lo)
        values += [f"{i:0{width}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return [head + v + rest for v in values for rest in _expand_one(tail)]


def expand_hostlist(text: str, *, scontrol: bool = True) -> list[str]:
    """SLURM's compressed host list (``node[01-03,07],login1``) as host names, in order.

    ``scontrol show hostnames`` is asked first where it is installed (it knows every
    form SLURM writes); without it, or if it fails within 10 s (it waits for a
    missing ``slurm.conf``), this module's parser expands ranges with their zero
    padding and several bracket groups per name.
    """
    if scontrol and shutil.which("scontrol"):
        try:
            proc = subprocess.run(
                ["scontrol", "show", "hostnames", text],
                capture_output=True,
                text=True,
                timeout=10,
            )
            hosts = proc.stdout.split()
            if proc.returncode == 0 and hosts:
                return hosts
        except (OSError, subprocess.TimeoutExpired):
            pass
    names: list[str] = []
    depth, start = 0, 0
    for i, c in enumerate(text + ","):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            if text[start:i].strip():
                names.append(text[start:i].strip())
            start = i + 1
    try:
        if depth:
            raise ValueError(text)
        return [host for name in names for host in _expand_one(name)]
    except ValueError:
        raise ConfigError(
            f"SLURM node list {text!r}",
            "cannot be expanded",
            "set MASTER_ADDR to the first node's address in the job script",
        ) from None


def slurm_port(job_id: int, step_id: int = 0) -> int:
    """The rendezvous port of a job's step: the same on every task, different for the next
    job (consecutive jobs on a node get consecutive ports) and for another step of this one."""
    return _PORT_BASE + (job_id + 1009 * step_id) % _PORT_SPAN


def slurm_rendezvous(environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """``(MASTER_ADDR, MASTER_PORT)`` of an ``srun`` step: the variables where set, else the
    step's first node and :func:`slurm_port` of the job and step ids."""
    env = os.environ if environ is None else environ
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodes = next(
            (env[v] for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
             if env.get(v)),
            None,
        )  # fmt: skip
        if nodes is None:
            raise ConfigError(
                "SLURM step",
                "has no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST to find rank 0's node",
                "set MASTER_ADDR (and MASTER_PORT) in the job script",
            )
        addr = expand_hostlist(nodes)[0]
    port = _int(env, "MASTER_PORT")
    if port is None:
        job = _int(env, "SLURM_JOB_ID", "SLURM_JOBID")
        if job is None:
            raise ConfigError(
                "SLURM step",
                "has no SLURM_JOB_ID to derive a rendezvous port from",
                "set MASTER_PORT in the job script",
            )
        port = slurm_port(job, _int(env, "SLURM_STEP_ID", "SLURM_STEPID") or 0)
    return addr, port
