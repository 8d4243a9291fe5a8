"""Saved activations per rank against one process: windowed layers at the 1/P limit.

What it measures: the bytes autograd keeps for backward on each rank (distinct
storages, parameters apart, counted with ``saved_tensors_hooks``), divided by
what one process keeps on the whole image. Deterministic: no RSS, no timing.
It runs ``tests/mpi/saved_memory.py`` under ``mpiexec`` -- the very worker of
the memory regression test, so the figure here and the test cannot drift.

Cases (issue 8): the plain conv+ReLU chain (8 layers, 16 channels; ``convchain``)
at 512^2 on 1x4, against LBANN DistConv's 0.265 on the same network and split
(ideal 0.25 plus the halo strips), and ResNet-50 at 1024^2 on 2x2.

Exit status: 0 measured (PASS/MISS lines), 2 a run failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "mpi" / "saved_memory.py"
DISTCONV = 0.265
CASES = [
    # label, model, grid, image, target
    ("conv+ReLU chain 512^2, 1x4", "convchain", "1x4", "512", 0.27),
    ("ResNet-50 1024^2, 2x2", "resnet50", "2x2", "1024", 0.28),
]


def run(model: str, grid: str, image: str) -> dict[str, object]:
    n = 1
    for g in grid.split("x"):
        n *= int(g)
    cmd = ["mpiexec", "-n", str(n), sys.executable, str(WORKER), "--model", model,
           "--grid", grid, "--image", image]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=WORKER.parent)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("HYFI-RESULT ")]
    if proc.returncode or not lines:
        print("\n".join((proc.stdout + proc.stderr).splitlines()[-20:]), file=sys.stderr)
        raise SystemExit(2)
    return json.loads(lines[-1][len("HYFI-RESULT ") :])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  python benchmarks/bench_memory.py     # both cases, ~2 min on 2 cores\n"
            "  # one case by hand: its worker, as the script starts it\n"
            "  cd tests/mpi && mpiexec -n 4 python saved_memory.py --model convchain "
            "--grid 1x4 --image 512\n"
        ),
    )
    p.parse_args(argv)
    verdicts = []
    print(f"{'case':32s}{'1 process MiB':>15s}{'max rank MiB':>14s}{'ratio':>8s}{'target':>8s}")
    for label, model, grid, image, target in CASES:
        r = run(model, grid, image)
        single = float(r["single"])  # type: ignore[arg-type]
        worst = max(float(x["total"]) for x in r["ranks"])  # type: ignore[union-attr]
        ratio = worst / single
        print(
            f"{label:32s}{single / 2**20:>15.1f}{worst / 2**20:>14.1f}{ratio:>8.3f}{target:>8.2f}"
        )
        ok = ratio <= target and (model != "convchain" or ratio <= DISTCONV)
        extra = f", DistConv {DISTCONV}" if model == "convchain" else ""
        verdicts.append(
            f"{'PASS' if ok else 'MISS'}: saved activations per rank, {label}: {ratio:.3f} "
            f"of one process (target <= {target}{extra}; ideal 0.25 plus halo strips)"
        )
    print()
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
