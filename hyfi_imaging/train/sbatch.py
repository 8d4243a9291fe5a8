"""SLURM job scripts for a recipe: ``hyfi-train RECIPE --print-sbatch``.

Why generate them: the numbers a job script needs -- ranks, nodes, tasks and
GPUs per node -- follow from the recipe's layout, and a hand-written script
that disagrees with it fails only once the job finally starts, after its wait
in the queue. The generated script asks SLURM for exactly the recipe's world
size, one task per GPU, and launches every rank with ``srun`` (ranks, local
ranks and the rendezvous then come from the step, see
:mod:`hyfi_imaging.parallel.launcher_env`).

Preemption: the script asks SLURM to send SIGUSR1 to the ranks 120 s before the
time limit (``--signal=USR1@120``) and to allow requeueing (``--requeue``). The
trainer turns the signal into a checkpoint and exit status 75 (EX_TEMPFAIL,
:mod:`.preempt`); the script then requeues the job, and the requeued job
resumes the same run directory. A site's own preemption (``PreemptMode=REQUEUE``)
requeues it as well. ``scripts/slurm/train.sbatch`` is the same script as a
template to edit by hand.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from hyfi_imaging.errors import ConfigError

__all__ = ["REQUEUE_BLOCK", "JobShape", "job_script", "job_shape", "parse_time"]

#: The end of every job script: requeue when the ranks stopped for a signal (exit 75, after
#: their checkpoint); otherwise end with the step's status. scripts/slurm/train.sbatch too.
REQUEUE_BLOCK = """\
status=$?
if [ "$status" -eq 75 ]; then  # stopped by SIGUSR1/SIGTERM after a checkpoint: run again
  echo "hyfi: run stopped at a checkpoint; requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
"""


@dataclass(frozen=True)
class JobShape:
    """How a world of ranks is laid out on nodes."""

    nodes: int
    ntasks: int
    tasks_per_node: int
    gpus_per_node: int

    def describe(self) -> str:
        """One line for the script's header, e.g. ``12 ranks on 2 nodes, 8 per node (the last
        runs 4), one GPU each``."""

        def n(k: int, what: str) -> str:
            return f"{k} {what}{'s' if k != 1 else ''}"

        last = self.ntasks - (self.nodes - 1) * self.tasks_per_node
        uneven = f" (the last runs {last})" if last != self.tasks_per_node else ""
        per_node = f", {self.tasks_per_node} per node{uneven}" if self.nodes > 1 else ""
        return (
            f"{n(self.ntasks, 'rank')} on {n(self.nodes, 'node')}{per_node}, "
            f"{'one GPU' if self.gpus_per_node else 'CPUs only'} each"
        )


def job_shape(
    world_size: int, *, gpus_per_node: int = 8, tasks_per_node: int | None = None
) -> JobShape:
    """Nodes and tasks per node for ``world_size`` ranks: one task per GPU by default.

    ``gpus_per_node=0`` asks for CPU nodes, where ``tasks_per_node`` (default: all
    ranks on one node) says how many ranks share a node. A world smaller than a node
    asks for only the GPUs it uses.
    """
    if world_size < 1:
        raise ConfigError("world size", f"must be positive, got {world_size}", "fix the layout")
    if gpus_per_node < 0:
        raise ConfigError(
            "--gpus-per-node", f"must be 0 (CPU nodes) or more, got {gpus_per_node}", "fix it"
        )
    if tasks_per_node is None:
        tasks_per_node = gpus_per_node or world_size
    if tasks_per_node < 1:
        raise ConfigError(
            "--tasks-per-node", f"must be positive, got {tasks_per_node}", "give 1 or more"
        )
    if gpus_per_node and tasks_per_node > gpus_per_node:
        raise ConfigError(
            "--tasks-per-node",
            f"{tasks_per_node} tasks cannot each have a GPU of {gpus_per_node} per node",
            f"give --tasks-per-node {gpus_per_node} or fewer (one rank per GPU)",
        )
    per_node = min(tasks_per_node, world_size)
    nodes = math.ceil(world_size / per_node)
    return JobShape(nodes, world_size, per_node, min(gpus_per_node, per_node))


def parse_time(text: str) -> str:
    """A SLURM time limit (``MM``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``), checked, as given."""
    forms = (r"\d+", r"\d+:\d{1,2}", r"\d+:\d{1,2}:\d{1,2}", r"\d+-\d+(:\d{1,2}){0,2}")
    if not any(re.fullmatch(f, text.strip()) for f in forms):
        raise ConfigError(
            f"--time {text}",
            "is not a SLURM time limit",
            "write minutes (90), HH:MM:SS (24:00:00) or D-HH:MM:SS (2-00:00:00)",
        )
    return text.strip()


def job_script(
    command: Sequence[str],
    shape: JobShape,
    *,
    job_name: str,
    time_limit: str = "24:00:00",
    workdir: str | None = None,
    partition: str | None = None,
    account: str | None = None,
    comments: Sequence[str] = (),
) -> str:
    """An sbatch script that runs ``command`` once per rank under ``srun`` (quoted for the
    shell), then requeues the job if the ranks stopped at a checkpoint (:data:`REQUEUE_BLOCK`).

    ``#SBATCH`` lines are not read by a shell: their values must be single words, so
    a job name is reduced to letters, digits, ``.``, ``_`` and ``-``; each of ``comments``
    is one ``#`` line, its white space (line breaks too) made single spaces.
    """
    for flag, value in (("--partition", partition), ("--account", account)):
        if value is not None and (not value or re.search(r"\s", value)):
            raise ConfigError(
                f"{flag} {value!r}", "is empty or has white space", f"give {flag} one word"
            )
    name = re.sub(r"[^\w.-]+", "-", job_name).strip("-") or "hyfi"
    opt = [
        f"--job-name={name}",
        f"--nodes={shape.nodes}",
        f"--ntasks={shape.ntasks}",
        f"--ntasks-per-node={shape.tasks_per_node}",
    ]
    if shape.gpus_per_node:
        opt.append(f"--gpus-per-node={shape.gpus_per_node}")
    opt.append(f"--time={parse_time(time_limit)}")
    opt += [f"--partition={partition}"] if partition else []
    opt += [f"--account={account}"] if account else []
    # A folder with white space (refused: hyfi-train has no --chdir to give another) is
    # entered by the job's shell instead, which reads quotes; the log then lands where
    # sbatch was run.
    spaced = workdir is not None and bool(re.search(r"\s", workdir))
    opt += [f"--chdir={workdir}"] if workdir and not spaced else []
    opt += [
        "--output=%x-%j.out",
        "--open-mode=append",  # a requeued run appends to the same log
        "--signal=USR1@120",  # the ranks checkpoint and exit 75 two minutes before the limit
        "--requeue",
    ]
    # One line each, whatever they hold: a recipe's name with a line break in it made the
    # rest a command (run by the job's shell) and ended sbatch's reading of #SBATCH lines.
    lines = ["#!/bin/bash", *(f"# {' '.join(c.split())}" for c in comments)]
    lines.append(f"# {shape.describe()}")
    lines += [f"#SBATCH {o}" for o in opt]
    lines += [
        "",
        'echo "hyfi: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST" >&2',
        *([f"cd {shlex.quote(workdir)} || exit 1"] if spaced and workdir else []),
        f"srun {shlex.join(command)}",
    ]
    return "\n".join(lines) + "\n" + REQUEUE_BLOCK
