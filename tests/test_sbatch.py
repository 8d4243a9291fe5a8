"""SLURM job scripts: :mod:`hyfi_imaging.train.sbatch` and ``hyfi-train --print-sbatch``.

Why: a job script whose task count disagrees with the recipe's layout fails
only when the job starts, after its wait in the queue. So the shape arithmetic
is checked here, the printed script is parsed back, and the shipped template
must keep the same preemption contract (SIGUSR1 120 s before the limit,
``--requeue``, requeue on exit 75). Real submissions are in tests/test_slurm.py.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.train.preempt import REQUEUE_EXIT
from hyfi_imaging.train.sbatch import REQUEUE_BLOCK, JobShape, job_script, job_shape, parse_time

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "scripts" / "slurm" / "train.sbatch"


def sbatch_options(script: str) -> dict[str, str]:
    """``#SBATCH --key=value`` lines as a dict (flags without a value map to "")."""
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line.split(maxsplit=1)[1].partition("=")
            out[key] = value
    return out


@pytest.mark.parametrize(
    ("world", "gpus", "tasks", "shape"),
    [
        (4, 8, None, JobShape(1, 4, 4, 4)),  # a small world asks only for the GPUs it uses
        (16, 8, None, JobShape(2, 16, 8, 8)),
        (12, 8, None, JobShape(2, 12, 8, 8)),  # the last node runs 4
        (16, 4, None, JobShape(4, 16, 4, 4)),
        (8, 8, 2, JobShape(4, 8, 2, 2)),
        (6, 0, None, JobShape(1, 6, 6, 0)),  # CPU nodes: every rank on one node by default
        (6, 0, 4, JobShape(2, 6, 4, 0)),
    ],
)
def test_job_shape(world: int, gpus: int, tasks: int | None, shape: JobShape) -> None:
    assert job_shape(world, gpus_per_node=gpus, tasks_per_node=tasks) == shape


def test_job_shape_describes_an_uneven_last_node() -> None:
    assert (
        job_shape(12).describe()
        == "12 ranks on 2 nodes, 8 per node (the last runs 4), one GPU each"
    )
    assert job_shape(1, gpus_per_node=0).describe() == "1 rank on 1 node, CPUs only each"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tasks_per_node": 9}, "one rank per GPU"),
        ({"tasks_per_node": 0}, "give 1 or more"),
        ({"gpus_per_node": -1}, "0 \\(CPU nodes\\) or more"),
    ],
)
def test_job_shape_rejects(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        job_shape(16, **kwargs)


@pytest.mark.parametrize("text", ["90", "2:00:00", "1-12", "2-00:00:00", " 30:00 "])
def test_parse_time_accepts_slurms_forms(text: str) -> None:
    assert parse_time(text) == text.strip()


@pytest.mark.parametrize("text", ["1h", "", "2:00:00:00", "-1"])
def test_parse_time_rejects_with_the_forms(text: str) -> None:
    with pytest.raises(ConfigError, match="HH:MM:SS"):
        parse_time(text)


def test_job_script_runs_the_command_under_srun_and_requeues_on_75() -> None:
    script = job_script(
        ["python", "-m", "x", "--set", "name=my run"],
        job_shape(16),
        job_name="my run!",
        time_limit="2:00:00",
        workdir="/scratch/u",
        partition="gpu",
    )
    opts = sbatch_options(script)
    assert opts == {
        "--job-name": "my-run",
        "--nodes": "2",
        "--ntasks": "16",
        "--ntasks-per-node": "8",
        "--gpus-per-node": "8",
        "--time": "2:00:00",
        "--partition": "gpu",
        "--chdir": "/scratch/u",
        "--output": "%x-%j.out",
        "--open-mode": "append",
        "--signal": "USR1@120",
        "--requeue": "",
    }
    srun = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    assert len(srun) == 1 and shlex.split(srun[0])[1:] == [
        "python",
        "-m",
        "x",
        "--set",
        "name=my run",
    ]
    assert script.endswith(REQUEUE_BLOCK) and f"-eq {REQUEUE_EXIT} ]" in REQUEUE_BLOCK
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_job_script_comments_stay_comments() -> None:
    """A recipe named "x\\necho INJECTED > f\\n#" put a command into the job script, which the
    job's shell ran; and sbatch stopped reading #SBATCH lines at it (nodes, tasks, --signal
    and --requeue were dropped). Each comment is one line now."""
    hostile = "synthetic\necho INJECTED > injected.txt\r\n#"
    script = job_script(["python", "-m", "x"], job_shape(8), job_name=hostile,
                        time_limit="1:00:00", comments=[f"recipe {hostile}", "save\x0bas it"])  # fmt: skip
    body = [ln for ln in script.split(REQUEUE_BLOCK)[0].splitlines()[1:] if ln]
    head = body[: next(i for i, ln in enumerate(body) if not ln.startswith("#"))]
    assert all(ln.startswith("#") for ln in head) and len(head) == 3 + len(sbatch_options(script))
    assert "# recipe synthetic echo INJECTED > injected.txt #" in head
    assert sbatch_options(script)["--ntasks"] == "8" and "--requeue" in sbatch_options(script)
    assert not any(ln.startswith("echo INJECTED") for ln in script.splitlines())


def test_job_script_refuses_values_sbatch_would_split() -> None:
    with pytest.raises(ConfigError, match="white space"):
        job_script(["x"], job_shape(1), job_name="j", account="my lab")


def test_a_working_folder_with_white_space_is_entered_by_the_jobs_shell(tmp_path: Path) -> None:
    """--print-sbatch from a folder with a space was refused with "give --chdir one word", an
    option hyfi-train does not have: the job's shell enters the folder (it reads quotes)."""
    folder = tmp_path / "my project"
    folder.mkdir()
    script = job_script(["python", "-m", "x"], job_shape(1), job_name="j", workdir=str(folder))
    assert "--chdir" not in sbatch_options(script)
    body = script.split(REQUEUE_BLOCK)[0].splitlines()
    cd = next(i for i, ln in enumerate(body) if ln.startswith("cd "))
    assert body[cd + 1].startswith("srun ") and shlex.split(body[cd])[1] == str(folder)
    probe = script.split("srun ")[0] + "pwd\n"  # the lines before srun, then where it runs
    ran = subprocess.run(["bash"], input=probe, capture_output=True, text=True, cwd=tmp_path)
    assert ran.stdout.strip() == str(folder), ran.stderr


def test_shipped_template_keeps_the_preemption_contract() -> None:
    text = TEMPLATE.read_text()
    opts = sbatch_options(text)
    assert opts["--signal"] == "USR1@120" and "--requeue" in opts
    assert opts["--open-mode"] == "append"
    assert int(opts["--ntasks-per-node"]) == int(opts["--gpus-per-node"])  # one rank per GPU
    assert text.endswith(REQUEUE_BLOCK)
    assert re.search(r"^srun hyfi-train ", text, re.M)
    assert subprocess.run(["bash", "-n", str(TEMPLATE)]).returncode == 0


def _print_sbatch(
    *args: str, cwd: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str, str]:
    """``hyfi-train ARGS --print-sbatch`` in this process, from ``cwd``: (status, out, err)."""
    from hyfi_imaging.cli.train import main

    monkeypatch.chdir(cwd)
    capsys.readouterr()
    code = main([*args, "--print-sbatch"])
    out, err = capsys.readouterr()
    return code, out, err


def test_print_sbatch_sizes_the_job_from_the_recipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = ROOT / "recipes" / "synthetic.yaml"  # 2x2 tiles
    sets = ["--set", "parallel.data=3", "--set", "train.out_dir=runs/a b"]
    code, out, err = _print_sbatch(
        str(recipe), *sets, "--gpus-per-node", "4", "--time", "90",
        cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch,
    )  # fmt: skip
    assert code == 0, err
    opts = sbatch_options(out)
    assert (opts["--nodes"], opts["--ntasks"], opts["--ntasks-per-node"]) == ("3", "12", "4")
    assert opts["--gpus-per-node"] == "4" and opts["--time"] == "90"
    assert opts["--chdir"] == str(tmp_path) and opts["--job-name"] == "synthetic"
    srun = next(ln for ln in out.splitlines() if ln.startswith("srun "))
    assert shlex.split(srun)[1:] == [
        sys.executable, "-m", "hyfi_imaging.cli.train", str(recipe), *sets
    ]  # fmt: skip
    assert "dp=3 x pp=1 x sp=2x2" in out
    assert not list(tmp_path.iterdir())  # printed only: no run directory, no file


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--set", "parallel=auto"), "parallel=auto chooses a layout"),
        (("--restart",), "a requeued job must resume"),
        (("--time", "1h"), "not a SLURM time limit"),
        (("--gpus-per-node", "4", "--tasks-per-node", "8"), "one rank per GPU"),
        (("--set", "train.epochs=-1"), "train.epochs"),
    ],
)
def test_print_sbatch_refuses_with_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
    message: str,
) -> None:
    code, out, err = _print_sbatch(
        "synthetic", *args, cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch
    )
    assert code == 2 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hyfi-train: error: ") and message in lines[0]


def test_job_options_without_print_sbatch_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from hyfi_imaging.cli.train import main

    assert main(["synthetic", "--time", "10", "--gpus-per-node", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "hyfi-train: error: --gpus-per-node --time: only shape the job script of --print-sbatch; "
        "add --print-sbatch, or leave them out."
    )
