"""The README's and the user guide's ``hyfi-verify`` and ``hyfi-plan`` examples run as written.

Why: an example is the first thing a reader runs, and one that is killed for memory (the
README's 3-D U-Net was, on a 24 GiB machine), refused or misspelt costs their trust. Every
``hyfi-verify`` / ``hyfi-plan`` command of ``README.md`` and ``docs/user-guide.md`` -- in a
fenced code block (continuation lines joined, a trailing ``# comment`` dropped) or an inline
code span -- is collected; ``mpirun -np N`` (``mpiexec -n N``, ``srun -n N``, ``torchrun
--nproc-per-node N``) runs through this machine's ``mpiexec`` (``tests/mpi/_launch.py``), the
others as one process. A verification must report OK with exit 0, a plan exit 0. A recipe's
plan reads the manifest ``hyfi-preprocess`` writes: the test makes one and passes it with
``--set data.manifest=...``, as a reader would after preprocessing.

Every example's arguments are parsed by its command's own parser in the default run (a
renamed flag fails at once; a bare inline span its parser refuses is prose naming a flag,
``hyfi-verify --schedule``, not an example); the examples that take seconds on this
2-core machine (:data:`FAST`) run there too, the others -- minutes each, the README's
3-D U-Net about four, ``hyfi-plan`` 10-20 s (two to seven minutes before issue 22), and
those of more than 4 ranks -- are slow.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))

from _launch import Job, have_mpiexec, mpiexec, plain, torchrun

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/user-guide.md")
TOOLS = {
    "hyfi-verify": "hyfi_imaging.cli.verify",
    "hyfi-plan": "hyfi_imaging.cli.plan",
    "hyfi_imaging.cli.verify": "hyfi_imaging.cli.verify",
    "hyfi_imaging.cli.plan": "hyfi_imaging.cli.plan",
}
#: Launcher options that give the number of ranks.
RANKS = {"-np", "-n", "--nproc-per-node", "--nproc_per_node"}
#: Examples that run in seconds here (measured: 15 s and 9 s): the default run's share.
FAST = {
    "mpirun -np 4 hyfi-verify --model resnet18 --width 0.25 --image-size 70x100 --pipeline 2 "
    "--spatial 1x2 --microbatches 4 --schedule bidirectional",
    "mpirun -np 4 hyfi-verify --model cosmoflow-pool --width 4 --image-size 64x64x72 "
    "--spatial 1x2x2",
}
#: The README's 3-D example, the one this test was written for.
README_3D = "mpirun -np 4 hyfi-verify --model unet3d --image-size 40x48x56 --spatial 2x1x2"


@dataclass(frozen=True)
class Example:
    """One documented command: as written, and what runs."""

    text: str  # whitespace-normalised, as written
    module: str  # hyfi_imaging.cli.verify or .plan
    args: tuple[str, ...]
    ranks: int  # 1: one process
    launcher: str  # "mpi", "torchrun" or "" (one process)

    @property
    def is_verify(self) -> bool:
        return self.module.endswith(".verify")


def parse(text: str) -> Example | None:
    """The example ``text`` names, or None when it is not a hyfi-verify/hyfi-plan invocation
    with arguments (a bare command name in prose)."""
    words = shlex.split(text)
    launcher, ranks = "", 1
    if words and words[0] in ("mpirun", "mpiexec", "srun", "torchrun"):
        launcher = "torchrun" if words[0] == "torchrun" else "mpi"
        i = 1
        while i < len(words) and words[i].startswith("-") and words[i] != "-m":
            name, _, value = words[i].partition("=")
            if name in RANKS:
                if not value:
                    i += 1
                    value = words[i]
                ranks = int(value)
            i += 1
        words = words[i:]
    if words[:1] == ["-m"]:
        words = words[1:]
    if not words or words[0] not in TOOLS or len(words) < 2:
        return None
    return Example(" ".join(text.split()), TOOLS[words[0]], tuple(words[1:]), ranks, launcher)


LAUNCHERS = ("mpirun ", "mpiexec ", "srun ", "torchrun ")


def collect(markdown: str) -> list[tuple[str, bool]]:
    """The command lines of ``markdown``'s fenced blocks and inline code spans that start with
    a launcher or a hyfi command, each with whether it must be an example: a fenced line or a
    launched span must; a bare span (``hyfi-verify --schedule`` in prose) may name a flag."""
    starts = (*LAUNCHERS, "hyfi-verify", "hyfi-plan")
    fenced = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
    found = []
    for block in fenced.findall(markdown):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.strip()
            if line.startswith(starts):
                found.append((re.sub(r"\s+#.*$", "", line), True))
    for paragraph in re.split(r"\n\s*\n", fenced.sub("", markdown)):
        for span in re.findall(r"`([^`]+)`", paragraph):
            span = " ".join(span.split())
            if span.startswith(starts):
                found.append((span, span.startswith(LAUNCHERS)))
    return found


def _parses(ex: Example) -> bool:
    """Whether the command's own parser takes ``ex``'s arguments."""
    from hyfi_imaging.cli import plan, verify

    parser = (verify if ex.is_verify else plan).build_parser()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parser.parse_args(list(ex.args))
    except SystemExit:
        return False
    return True


def examples() -> list[Example]:
    """Every example of :data:`DOCS`, once (``srun`` and ``mpirun`` of the same arguments are
    the same run)."""
    seen: dict[tuple[str, tuple[str, ...], int], Example] = {}
    for doc in DOCS:
        for text, example in collect((ROOT / doc).read_text()):
            ex = parse(text)
            if ex is not None and (example or _parses(ex)):
                seen.setdefault((ex.module, ex.args, ex.ranks), ex)
    return list(seen.values())


EXAMPLES = examples()


def _param(ex: Example) -> object:
    marks = []
    if ex.launcher:
        marks += [
            pytest.mark.mpi,
            pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not installed"),
        ]
    if ex.text not in FAST or ex.ranks > 4:
        marks.append(pytest.mark.slow)
    return pytest.param(ex, id=ex.text, marks=marks)


def test_the_examples_are_found_and_their_arguments_parse() -> None:
    texts = {ex.text for ex in EXAMPLES}
    assert README_3D in texts and texts >= FAST, sorted(texts)
    assert sum(ex.is_verify for ex in EXAMPLES) >= 6 and sum(not ex.is_verify for ex in EXAMPLES)
    refused = [ex.text for ex in EXAMPLES if not _parses(ex)]
    assert not refused, f"the command's parser refuses: {refused}"


@pytest.fixture(scope="module")
def manifest(synthetic_cohort: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What ``hyfi-preprocess`` writes for a small cohort (a recipe's plan reads its sizes)."""
    from hyfi_imaging.preprocess import PreprocessOptions, run_preprocess

    out = tmp_path_factory.mktemp("doc_data")
    summary = run_preprocess(
        [synthetic_cohort.parent], out, PreprocessOptions(mpp=2.0, size=(256, 256)),
        labels_path=synthetic_cohort, progress=False, qc=False,
    )  # fmt: skip
    assert summary.manifest is not None
    return summary.manifest


def _run(ex: Example, args: list[str]) -> Job:
    timeout = 60.0 if ex.text in FAST else 1800.0
    if ex.launcher == "mpi":  # a reader's command may use this 24 GiB machine (README 3-D: 10.5)
        return mpiexec(ex.ranks, "-m", ex.module, *args, timeout=timeout, memory_gib=16.0)
    if ex.launcher == "torchrun":
        return torchrun(ex.ranks, "-m", ex.module, *args, timeout=timeout)
    return plain("-m", ex.module, *args, timeout=timeout)


@pytest.mark.parametrize("ex", [_param(ex) for ex in EXAMPLES])
def test_example_runs(ex: Example, request: pytest.FixtureRequest) -> None:
    args = list(ex.args)
    if not ex.is_verify and args[0].endswith((".yaml", ".yml")):
        args += ["--set", f"data.manifest={request.getfixturevalue('manifest')}"]
    job = _run(ex, args)
    assert job.returncode == 0, job.describe()
    if ex.is_verify:
        assert "hyfi-verify: OK" in job.stdout, job.describe()
