"""The benchmark scripts refuse a bad option in one argparse line (exit 2), before any launch.

Each case used to end in a Python traceback (exit 1), or in one traceback per MPI rank once
``mpiexec`` had started; ``--help`` of the scripts without examples now shows some.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

#: script, arguments, a fragment of the one-line message
CASES = [
    ("bench_spatial.py", ["--time-sizes", "abc"], "--time-sizes 'abc': give comma-separated"),
    ("bench_junction.py", ["--size", "abc"], "--size: cannot read the size 'abc'"),
    ("bench_junction.py", ["--rows", "nope"], "--rows 'nope': give some of"),
    ("bench_junction.py", ["--pipeline-balance", "4,x"], "--pipeline-balance '4,x'"),
    ("bench_deep_halo.py", ["--grid", "abc"], "--grid 'abc': give the tile grid as GYxGX"),
    ("bench_deep_halo.py", ["--depth", "0"], "--depth 0: give a whole number >= 1"),
    ("bench_overlap.py", ["--grid", "abc"], "--grid 'abc': give the tile grid as GYxGX"),
    ("bench_scale.py", ["--sizes", "abc"], "--sizes 'abc': give comma-separated image sides"),
    ("bench_read.py", ["--tile", "0", "--size", "600"], "--tile 0: give a multiple of 512"),
    ("bench_pipeline.py", ["--microbatches", "0"], "--microbatches 0: give micro-batch counts"),
    ("bench_schedules.py", ["--pp", "3"], "--pp 3: give an even number of pipeline ranks"),
    ("bench_schedules.py", ["--microbatches", "3"], "--microbatches 3:"),
    ("bench_tradeoffs.py", ["--grid", "abc"], "--grid 'abc': give the tile grid as GYxGX"),
    ("bench_speed_model.py", ["--grids", "abc"], "'abc': give a tile grid GYxGX"),
    ("bench_volume.py", ["--depth", "0"], "--depth 0: give a whole number >= 1"),
    ("bench_train.py", ["--steps", "1"], "--steps 1: give at least 2"),
]


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("script", "args", "fragment"), CASES, ids=[f"{c[0]} {' '.join(c[1])}" for c in CASES]
)
def test_bad_option_is_one_usage_line(script: str, args: list[str], fragment: str) -> None:
    proc = _run(script, *args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert fragment in proc.stderr
    assert "error: " in proc.stderr.splitlines()[-1]
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "script", ["bench_memory.py", "bench_pipeline.py", "bench_scale.py", "bench_schedules.py"]
)
def test_help_shows_examples(script: str) -> None:
    proc = _run(script, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "examples:" in proc.stdout
    assert f"python benchmarks/{script}" in proc.stdout.split("examples:")[1]
