"""hyfi-verify, hyfi-train and their job scripts under a real SLURM (one node, this machine).

Why a real cluster: what ``srun`` and ``sbatch`` put in a task's environment,
and when (the batch script has ``SLURM_PROCID=0`` and ``SLURM_NTASKS=4`` but is
one process), is where a launcher goes wrong, and only slurmd tells the truth.
The session fixture starts a one-node cluster with ``scripts/slurm_cluster.sh``
(munged, slurmctld and slurmd, with their state, keys and logs in a temporary
folder and ports of their own) and stops it at the end. Where slurm-wlm and
munge are not installed (``apt-get install -y slurm-wlm munge``; ``.ci/run``
tries) or the daemons do not start, the tests skip and say why.

Jobs are waited for by polling ``scontrol show job`` every 0.3 s: ``sbatch
--wait`` polls at growing intervals and returns up to half a minute after the
job ended.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hyfi_imaging.parallel.launcher_env import slurm_port
from hyfi_imaging.train.sbatch import job_script, job_shape

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "slurm_cluster.sh"
PROBE = ROOT / "tests" / "mpi" / "launch_probe.py"
MARKER = "HYFI-RESULT "
VERIFY = [sys.executable, "-m", "hyfi_imaging.cli.verify", "--model", "resnet20-v2",
          "--image-size", "29x23", "--steps", "1", "--spatial", "2x2"]  # fmt: skip
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED"}  # fmt: skip
pytestmark = pytest.mark.mpi


@dataclass
class Finished:
    """A job that reached a final state: its state, exit status and log."""

    job_id: int
    state: str
    exit_code: int
    log: str
    seconds: float

    def describe(self) -> str:
        return f"job {self.job_id}: {self.state}, exit {self.exit_code}, {self.seconds:.1f} s\n{self.log[-4000:]}"


@dataclass
class Cluster:
    """The running test cluster: submit a script, wait for it, signal it."""

    folder: Path
    env: dict[str, str]

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )

    def submit(self, script: str, *options: str, cwd: Path) -> tuple[int, Path]:
        """``sbatch OPTIONS script`` from ``cwd``: the job id and its log file."""
        path = cwd / f"job-{time.monotonic_ns()}.sbatch"
        path.write_text(script)
        log = path.with_suffix(".out")
        proc = subprocess.run(
            ["sbatch", "--parsable", f"--output={log}", "--open-mode=append", *options, str(path)],
            cwd=cwd, env=self.env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
        return int(proc.stdout.strip().split(";")[0]), log

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields of a job."""
        proc = self.run("scontrol", "show", "job", "-o", str(job_id))
        assert proc.returncode == 0, proc.stderr
        return dict(f.split("=", 1) for f in proc.stdout.split() if "=" in f)

    def wait(self, job_id: int, log: Path, *, timeout: float) -> Finished:
        """Poll until the job ends (a job still running at ``timeout`` is cancelled: a failure)."""
        began = time.monotonic()
        while True:
            fields = self.job(job_id)
            if fields["JobState"] in FINAL:
                break
            if time.monotonic() - began > timeout:
                self.run("scancel", str(job_id))
                text = log.read_text() if log.exists() else "(no log)"
                pytest.fail(f"job {job_id} still {fields['JobState']} after {timeout} s\n{text}")
            time.sleep(0.3)
        code = int(fields["ExitCode"].split(":")[0])
        text = log.read_text() if log.exists() else "(no log)"
        return Finished(job_id, fields["JobState"], code, text, time.monotonic() - began)


def _free_port_pair() -> int:
    """A port p such that p and p + 1 are free now (slurmctld's and slurmd's)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return int(port)
    raise RuntimeError("no two consecutive free ports")


def _clean_env() -> dict[str, str]:
    """This environment without any launcher's variables (the tests may run inside a job)."""
    drop = ("SLURM_", "PMI_", "PMIX_", "OMPI_", "MV2_", "MPI_LOCAL", "HYDI_")
    rank_vars = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in rank_vars}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    missing = [c for c in ("sbatch", "srun", "scontrol", "sinfo") if not shutil.which(c)]
    missing += [d for d in ("munged", "slurmctld", "slurmd")
                if not (shutil.which(d) or Path("/usr/sbin", d).exists())]  # fmt: skip
    if missing:
        pytest.skip(
            f"SLURM is not installed ({', '.join(missing)} missing): "
            "apt-get install -y slurm-wlm munge (.ci/run tries)"
        )
    folder = tmp_path_factory.mktemp("slurm")
    env = {**_clean_env(), "HYFI_SLURM_DIR": str(folder), "HYFI_SLURM_PORT": str(_free_port_pair())}
    start = subprocess.run(
        ["bash", str(CLUSTER), "start"], env=env, capture_output=True, text=True, timeout=180
    )
    if start.returncode != 0:
        subprocess.run(["bash", str(CLUSTER), "stop"], env=env, capture_output=True, timeout=60)
        lines = start.stderr.strip().splitlines()
        said = [ln for ln in lines if ln.startswith("slurm_cluster:")] + lines[-2:]
        pytest.skip(f"the SLURM daemons did not start on this machine: {' | '.join(said)}")
    try:
        yield Cluster(folder, {**env, "SLURM_CONF": str(folder / "slurm.conf")})
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop"], env=env, capture_output=True, timeout=60)


def _sections(log: str) -> dict[str, tuple[int, str]]:
    """``STEP name`` ... ``STATUS name code`` blocks of a job's log: name -> (status, text)."""
    out = {}
    for m in re.finditer(r"^STEP (\S+)\n(.*?)^STATUS \1 (\d+)$", log, re.M | re.S):
        out[m.group(1)] = (int(m.group(3)), m.group(2))
    return out


def _probe_table(text: str) -> list[dict[str, object]]:
    lines = [ln for ln in text.splitlines() if ln.startswith(MARKER)]
    assert len(lines) == 1, text  # rank 0 alone prints the gathered table
    return json.loads(lines[0][len(MARKER) :])  # type: ignore[no-any-return]


def test_srun_starts_four_ranks_and_the_batch_script_is_one_process(
    slurm: Cluster, tmp_path: Path
) -> None:
    """One 4-task job: the probe and hyfi-verify as srun steps, then both as a bare python
    in the batch script (one process of a job of 4, which must not pose as rank 0 of 4)."""
    q = shlex.join
    steps = {
        "batch-probe": q([sys.executable, str(PROBE)]),
        "srun-probe": "srun " + q([sys.executable, str(PROBE)]),
        "srun-verify": "srun " + q(VERIFY),
        "batch-verify": q(VERIFY),
    }
    script = "#!/bin/bash\n" + "".join(
        f"echo 'STEP {name}'\n{cmd} 2>&1\necho \"STATUS {name} $?\"\n"
        for name, cmd in steps.items()
    )
    job_id, log = slurm.submit(script, "--ntasks=4", cwd=tmp_path)
    done = slurm.wait(job_id, log, timeout=150)
    print(f"job {job_id}: {done.seconds:.1f} s")
    assert done.state == "COMPLETED" and done.exit_code == 0, done.describe()
    found = _sections(done.log)
    assert set(found) == set(steps), done.describe()

    code, text = found["batch-probe"]
    assert code == 0, text
    (alone,) = _probe_table(text)
    assert alone["launcher"] == "single" and alone["world"] == 1

    code, text = found["srun-probe"]
    assert code == 0, text
    table = _probe_table(text)
    cpus = int(table[0]["cpus"])  # type: ignore[call-overload]
    assert [r["launcher"] for r in table] == ["slurm"] * 4, table
    assert [(r["rank"], r["env_rank"], r["local_rank"]) for r in table] == [
        (i, i, i) for i in range(4)
    ]
    assert {r["local_world"] for r in table} == {4}
    assert {r["threads"] for r in table} == {max(1, cpus // 4)}
    host = socket.gethostname().split(".")[0]
    assert {r["master"] for r in table} == {f"{host}:{slurm_port(job_id, 0)}"}  # step 0

    code, text = found["srun-verify"]
    assert code == 0, text
    ok = [ln for ln in text.splitlines() if ln.startswith("hyfi-verify: OK:")]
    assert len(ok) == 1 and "(4 ranks, gloo)" in ok[0], text  # 4 ranks, said once

    code, text = found["batch-verify"]
    assert code == 2, text
    assert "needs 4 ranks but this is one process of SLURM job" in text and "srun -n 4" in text


@pytest.fixture(scope="module")
def manifest(train_manifest: Path) -> Path:
    """The session's training cohort (``tests/conftest.py``, as tests/test_train_mpi.py uses)."""
    return train_manifest


def _printed_job(slurm: Cluster, manifest: Path, cwd: Path, out: Path, epochs: int) -> Path:
    """Save what ``hyfi-train --print-sbatch`` prints for a short synthetic run (2x2 tiles:
    4 CPU tasks) in ``cwd``; the script runs from there and logs to ``synthetic-<job>.out``."""
    sets = [f"data.manifest={manifest}", f"train.out_dir={out}", "model.kwargs.width=0.125",
            f"train.epochs={epochs}", "train.batch_size=2", "train.progress=false",
            "optim.warmup_steps=1"]  # fmt: skip
    cmd = [sys.executable, "-m", "hyfi_imaging.cli.train", str(ROOT / "recipes" / "synthetic.yaml")]
    cmd += [a for s in sets for a in ("--set", s)]
    cmd += ["--print-sbatch", "--gpus-per-node", "0", "--time", "10"]
    printed = subprocess.run(
        cmd, cwd=cwd, env=slurm.env, capture_output=True, text=True, timeout=120
    )
    assert printed.returncode == 0, printed.stderr
    assert "--ntasks=4" in printed.stdout and "--gpus-per-node" not in printed.stdout
    path = cwd / "synthetic.sbatch"
    path.write_text(printed.stdout)
    return path


def _sbatch(slurm: Cluster, path: Path, *options: str) -> int:
    proc = slurm.run("sbatch", "--parsable", *options, str(path))
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().split(";")[0])


# slow since 2026-11-27 (the suite's time): the shipped template and srun tests run sbatch jobs that train
@pytest.mark.slow
def test_print_sbatch_job_trains_on_four_tasks(
    slurm: Cluster, manifest: Path, tmp_path: Path
) -> None:
    """The script ``hyfi-train --print-sbatch`` prints, submitted as it is: 4 CPU tasks train
    the synthetic recipe's 2x2 tiles for one epoch."""
    out = tmp_path / "run"
    job_id = _sbatch(slurm, _printed_job(slurm, manifest, tmp_path, out, epochs=1))
    done = slurm.wait(job_id, tmp_path / f"synthetic-{job_id}.out", timeout=240)
    print(f"job {job_id}: {done.seconds:.1f} s")
    assert done.state == "COMPLETED" and done.exit_code == 0, done.describe()
    assert done.log.count("hyfi-train: done:") == 1, done.describe()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 4, summary


def test_shipped_template_runs_hyfi_train(slurm: Cluster, manifest: Path, tmp_path: Path) -> None:
    """scripts/slurm/train.sbatch as shipped, its GPUs taken away on sbatch's command line
    (this cluster has none): ``srun hyfi-train RECIPE --set ... --check`` on 4 tasks."""
    log = tmp_path / "template.out"
    options = ["--gpus-per-node=0", f"--chdir={ROOT}", f"--output={log}"]
    args = [str(ROOT / "recipes" / "synthetic.yaml"), "--set", f"data.manifest={manifest}",
            "--set", f"train.out_dir={tmp_path / 'run'}", "--check"]  # fmt: skip
    env_path = f"{Path(sys.executable).parent}:{slurm.env['PATH']}"  # hyfi-train of this venv
    proc = subprocess.run(
        ["sbatch", "--parsable", *options, str(ROOT / "scripts" / "slurm" / "train.sbatch"), *args],
        env={**slurm.env, "PATH": env_path}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    done = slurm.wait(int(proc.stdout.strip().split(";")[0]), log, timeout=120)
    assert done.state == "COMPLETED" and done.exit_code == 0, done.describe()
    valid = [ln for ln in done.log.splitlines() if "is valid (4 ranks)" in ln]
    assert len(valid) == 1, done.describe()  # said once, by rank 0 of the 4 tasks


#: A rank of the requeue test: the first run waits for SIGUSR1 and exits 75 (as the trainer
#: does after its checkpoint); the requeued run finds SLURM_RESTART_COUNT=1 and succeeds.
_PREEMPTED_RANK = """
import os, signal, sys, time
rank = os.environ["SLURM_PROCID"]
if os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
    print("resumed", rank, flush=True)
    sys.exit(0)
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
open(os.path.join(sys.argv[1], "ready." + rank), "w").close()
deadline = time.monotonic() + 90
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
print("signalled" if got else "never signalled", rank, flush=True)
sys.exit(75 if got else 1)
"""


def test_job_script_requeues_ranks_that_stop_for_sigusr1(slurm: Cluster, tmp_path: Path) -> None:
    """The generated script's preemption path, for real: SLURM signals the ranks (as
    ``--signal=USR1@120`` does before the time limit), they exit 75, the script requeues
    the job, and the requeued run starts again with SLURM_RESTART_COUNT=1."""
    command = [sys.executable, "-c", _PREEMPTED_RANK, str(tmp_path)]
    script = job_script(command, job_shape(2, gpus_per_node=0), job_name="requeue", time_limit="5")
    job_id, log = slurm.submit(script, cwd=tmp_path)
    began = time.monotonic()
    while not all((tmp_path / f"ready.{r}").exists() for r in range(2)):
        assert time.monotonic() - began < 90, log.read_text() if log.exists() else "no log"
        time.sleep(0.1)
    signal = slurm.run("scancel", "--signal=USR1", str(job_id))  # the steps, not the batch shell
    assert signal.returncode == 0, signal.stderr
    done = slurm.wait(job_id, log, timeout=120)
    print(f"job {job_id}: {done.seconds:.1f} s after the signal")
    assert done.state == "COMPLETED" and done.exit_code == 0, done.describe()
    assert slurm.job(job_id)["Restarts"] == "1", done.describe()
    assert sorted(re.findall(r"^signalled (\d)$", done.log, re.M)) == ["0", "1"], done.describe()
    assert f"requeueing job {job_id}" in done.log, done.describe()
    assert "(restart 1)" in done.log, done.describe()
    assert sorted(re.findall(r"^resumed (\d)$", done.log, re.M)) == ["0", "1"], done.describe()


@pytest.mark.slow
def test_training_job_stops_at_a_checkpoint_is_requeued_and_resumes(
    slurm: Cluster, manifest: Path, tmp_path: Path
) -> None:
    """The whole preemption chain on a real job: SIGUSR1 to the ranks of a printed training
    job (as ``--signal=USR1@120`` sends it) -> a checkpoint and exit 75 -> the script
    requeues the job -> the requeued job resumes from that checkpoint and finishes."""
    out = tmp_path / "run"
    job_id = _sbatch(slurm, _printed_job(slurm, manifest, tmp_path, out, epochs=3))
    log = tmp_path / f"synthetic-{job_id}.out"
    metrics = out / "metrics.csv"
    began = time.monotonic()
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):  # a step done
        state = slurm.job(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING"), log.read_text() if log.exists() else state
        assert time.monotonic() - began < 240, log.read_text() if log.exists() else "no log"
        time.sleep(0.2)
    signal = slurm.run("scancel", "--signal=USR1", str(job_id))
    assert signal.returncode == 0, signal.stderr
    done = slurm.wait(job_id, log, timeout=300)
    print(f"job {job_id}: {done.seconds:.1f} s after the signal")
    assert done.state == "COMPLETED" and done.exit_code == 0, done.describe()
    assert slurm.job(job_id)["Restarts"] == "1", done.describe()
    stopped = re.search(r"stopped by SIGUSR1 after step (\d+)", done.log)
    assert stopped, done.describe()
    assert f"requeueing job {job_id}" in done.log, done.describe()
    assert re.search(rf"resuming run \S+ from \S+ \(step {stopped.group(1)}\)", done.log), (
        done.describe()
    )
    assert done.log.count("hyfi-train: done:") == 1, done.describe()
    steps = [int(row.split(",")[0]) for row in metrics.read_text().splitlines()[1:] if row]
    assert max(steps) == json.loads((out / "summary.json").read_text())["steps"]
