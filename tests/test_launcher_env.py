"""Which launcher, which rank: :mod:`hyfi_imaging.parallel.launcher_env` on plain environments.

Why on dictionaries: the precedence between launchers that nest (``srun`` over
``torchrun`` or ``mpiexec``, the batch script of ``sbatch``) is where a job
silently gets the wrong shape, and most of these environments cannot be made
on a test machine. Each case is the variables a real launcher sets (the SLURM
ones copied from slurm-wlm 22.05 jobs, MPICH's from its ``mpiexec``). Real
launches are in tests/test_launch.py and tests/test_slurm.py.
"""

from __future__ import annotations

import pytest

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.launcher_env import (
    LaunchEnv,
    expand_hostlist,
    expand_tasks_per_node,
    launch_env,
    slurm_port,
    slurm_rendezvous,
    threads_per_rank,
)

#: The batch script of `sbatch -N 2 --ntasks-per-node 2` (no step: no SLURM_STEP_ID).
BATCH = {
    "SLURM_JOB_ID": "812", "SLURM_JOBID": "812", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
    "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODELIST": "gpu[07-08]",
    "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS_PER_NODE": "2",
}  # fmt: skip


def step(rank: int, *, node: int, local: int, **extra: str) -> dict[str, str]:
    """Task ``rank`` of `srun` in that job: 4 tasks, 2 per node."""
    return {
        **BATCH,
        "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node), "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        **extra,
    }  # fmt: skip


TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}  # fmt: skip
HYDRA = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, LaunchEnv("single", 0, 1, 0, 1)),
        (HYDRA, LaunchEnv("mpi", 2, 4, 0, 2)),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3",
          "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"},
         LaunchEnv("mpi", 1, 3, 1, 3)),
        (TORCHRUN, LaunchEnv("torchrun", 3, 4, 1, 2)),
        # an srun task, with SLURM's own numbers
        (step(3, node=1, local=1), LaunchEnv("slurm", 3, 4, 1, 2)),
        # srun --mpi=pmi2: MPICH's PMI variables agree with the step; SLURM's are used
        (step(3, node=1, local=1, PMI_RANK="3", PMI_SIZE="4"), LaunchEnv("slurm", 3, 4, 1, 2)),
        # the batch script itself: one process, not rank 0 of 4
        (BATCH, LaunchEnv("single", 0, 1, 0, 1)),
        # srun -N 2 torchrun --nproc-per-node 2: SLURM numbers the agents, torchrun the ranks
        ({**step(1, node=1, local=0), **TORCHRUN}, LaunchEnv("torchrun", 3, 4, 1, 2)),
        # mpiexec -n 4 inside an sbatch script (no srun): MPI
        ({**BATCH, **HYDRA}, LaunchEnv("mpi", 2, 4, 0, 2)),
        # mpiexec inside a 1-task srun step: the step's size (1) is not MPI's (4)
        ({**step(0, node=0, local=0, SLURM_STEP_NUM_TASKS="1",
                 SLURM_STEP_TASKS_PER_NODE="1"), **HYDRA},
         LaunchEnv("mpi", 2, 4, 0, 2)),
        # --cpus-per-task travels with the step
        (step(0, node=0, local=0, SLURM_CPUS_PER_TASK="6"), LaunchEnv("slurm", 0, 4, 0, 2, 6)),
        # SLURM's reserved step ids (here the batch step, 0xfffffffb) are not srun steps
        ({**BATCH, "SLURM_STEP_ID": "4294967291"}, LaunchEnv("single", 0, 1, 0, 1)),
    ],
    ids=["plain", "mpich", "openmpi", "torchrun", "srun", "srun-pmi2", "sbatch-script",
         "srun-torchrun", "sbatch-mpiexec", "srun-mpiexec", "cpus-per-task", "batch-step-id"],
)  # fmt: skip
def test_launch_env_precedence(env: dict[str, str], expected: LaunchEnv) -> None:
    assert launch_env(env) == expected


def test_every_rank_of_mpiexec_in_a_step_chooses_mpi() -> None:
    """Hydra's proxies run as one srun task per node: every rank inherits its proxy's
    SLURM_PROCID, and rank 0's equals PMI_RANK. Sizes decide, so no rank goes its own way."""
    proxies = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    views = [
        launch_env(
            {**step(node, node=node, local=0, **proxies), "PMI_RANK": str(r), "PMI_SIZE": "4"}
        )
        for r, node in enumerate((0, 0, 1, 1))
    ]
    assert [v.launcher for v in views] == ["mpi"] * 4
    assert [v.rank for v in views] == [0, 1, 2, 3]


def test_a_step_on_part_of_the_job_has_the_steps_size() -> None:
    env = step(1, node=0, local=1, SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NUM_NODES="1",
               SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NODELIST="gpu07")  # fmt: skip
    assert launch_env(env) == LaunchEnv("slurm", 1, 2, 1, 2)


@pytest.mark.parametrize(
    ("env", "cpus", "threads"),
    [
        ({}, 32, 32),
        (TORCHRUN, 32, 16),  # 2 ranks on this node of 4: not 32 // 4
        (step(2, node=1, local=0), 32, 16),
        (step(2, node=1, local=0, SLURM_CPUS_PER_TASK="4"), 32, 4),
        (step(2, node=1, local=0, SLURM_CPUS_PER_TASK="64"), 32, 32),  # never above the CPUs
        (HYDRA, 32, 16),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 32, 8),
        ({"PMI_RANK": "0", "PMI_SIZE": "8"}, 32, 4),  # no local size: the world shares a node
        (TORCHRUN, 1, 1),  # at least one
        # after init_parallel: torchrun's variables beside SLURM's (--cpus-per-task was lost)
        ({**step(2, node=1, local=0, SLURM_CPUS_PER_TASK="4"), "RANK": "2", "WORLD_SIZE": "4",
          "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "HYFI_LAUNCHED_BY": "slurm"}, 64, 4),
    ],
)  # fmt: skip
def test_threads_per_rank_shares_this_nodes_cpus(
    env: dict[str, str], cpus: int, threads: int
) -> None:
    assert threads_per_rank(env, cpus=cpus) == threads


def test_threads_per_rank_defaults_to_this_process_cpus() -> None:
    assert threads_per_rank({}) >= 1


@pytest.mark.parametrize(
    ("text", "counts"),
    [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3])],
)
def test_expand_tasks_per_node(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


def test_unknown_tasks_per_node_form_falls_back() -> None:
    env = step(0, node=0, local=0, SLURM_STEP_TASKS_PER_NODE="2[x2]")
    assert launch_env(env).local_world_size == 2  # SLURM_NTASKS_PER_NODE
    with pytest.raises(ConfigError, match="N\\(xK\\)"):
        expand_tasks_per_node("2[x2]")


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("gpu[9-11],login1", ["gpu9", "gpu10", "gpu11", "login1"]),
        ("a[1-2]b[08-09]", ["a1b08", "a1b09", "a2b08", "a2b09"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack1-n[1,3]", ["rack1-n1", "rack1-n3"]),
    ],
)
@pytest.mark.parametrize("scontrol", [False, True], ids=["parser", "scontrol-if-installed"])
def test_expand_hostlist(text: str, hosts: list[str], scontrol: bool) -> None:
    assert expand_hostlist(text, scontrol=scontrol) == hosts


@pytest.mark.parametrize("text", ["node[01-", "node[a-b]", "node]1["])
def test_expand_hostlist_rejects_with_one_line(text: str) -> None:
    with pytest.raises(ConfigError, match="set MASTER_ADDR") as err:
        expand_hostlist(text, scontrol=False)
    assert "\n" not in str(err.value)


def test_slurm_rendezvous_is_the_first_node_and_a_port_from_the_job() -> None:
    env = step(3, node=1, local=1)
    addr, port = slurm_rendezvous(env)
    assert addr == "gpu07"
    assert port == slurm_port(812, 0) == 10812
    assert slurm_rendezvous(step(0, node=0, local=0)) == (addr, port)  # every task agrees
    assert slurm_port(812, 1) != port and slurm_port(813, 0) != port
    assert all(10000 <= slurm_port(j, s) < 30000 for j in (0, 19999, 10**7) for s in (0, 5))
    assert slurm_rendezvous({**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "2345"}) == (
        "10.0.0.1",
        2345,
    )


def test_slurm_rendezvous_without_a_node_list_says_what_to_set() -> None:
    env = {k: v for k, v in step(0, node=0, local=0).items() if "NODELIST" not in k}
    with pytest.raises(ConfigError, match="set MASTER_ADDR"):
        slurm_rendezvous(env)


def test_a_rank_alone_at_the_rendezvous_says_so_in_one_line() -> None:
    """Rank 0 of two whose partner never came ended as "another rank stopped answering ...
    raise parallel.timeout_s if a step legitimately takes longer": no step had run."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "from hyfi_imaging import HyfiError, Layout, init_parallel\n"
        "try:\n"
        "    init_parallel(Layout(sp=(1, 2)), timeout_s=3)\n"
        "except HyfiError as err:\n"
        "    print(err)\n"
    )
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI", "OMPI_"))}
    env = {**keep, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    said = proc.stdout.strip()
    assert said.startswith(f"rendezvous 127.0.0.1:{port}: not every one of the job's 2 ranks"), (
        said + proc.stderr[-2000:]
    )
    assert "within 3 s" in said and "no step ran" in said


def test_a_cpu_plan_shares_this_nodes_memory_among_its_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """parallel=auto on 2 nodes x 2 ranks divided each node's RAM by the job's 4 ranks (and
    chose a slower layout, with other BatchNorm batches); a plan for this machine alone
    (hyfi-plan, not launched) still shares it among all the ranks planned."""
    import os

    from hyfi_imaging.parallel.candidates import device_memory

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for key in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "SLURM_PROCID", "PMI_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert device_memory(4) == ram // 4
    for key, value in {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    assert device_memory(4) == ram // 2
    assert device_memory(8) == ram // 8  # another world than the job's: all on this machine
