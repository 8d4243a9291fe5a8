"""Training throughput of the synthetic recipe per layout, as ratios to one process.

Usage::

    python benchmarks/bench_train.py            # 768^2 images, 12 steps per layout (~4 min)
    python benchmarks/bench_train.py --quick    # 256^2 images, 4 steps (~1 min)
    python benchmarks/bench_train.py --compile  # one process and dp=2, eager vs torch.compile

Every layout trains the same recipe (ResNet-18 x0.25, batch 4) on the same
synthetic cohort for the same number of steps; throughput is the median of
``images_per_s`` and ``megapixels_per_s`` logged by hyfi-train after a warm-up
step. Layouts run one after another in one invocation, so the ratios share the
machine's state. Each rank uses one thread (OMP_NUM_THREADS=1), as a 2-core
machine with up to 4 ranks should.

``--compile`` runs the layouts ``parallel.compile`` is offered on (one process, data replicas)
eagerly and compiled with inductor, side by side, and says whether compiling worked (PASS:
both compiled runs trained) and how fast it ran against eager; the speed target is a GPU's
(``benchmarks/gpu_check.py`` item (e)), so here it is reported, not judged.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [
    ("1 process", 1, ["parallel.spatial=1x1"]),
    ("sp=1x2", 2, ["parallel.spatial=1x2"]),
    ("sp=2x2", 4, ["parallel.spatial=2x2"]),
    ("pp=2 (m=2)", 2, ["parallel.spatial=1x1", "parallel.pipeline=2", "parallel.microbatches=2"]),
    ("dp=2", 2, ["parallel.spatial=1x1", "parallel.data=2", "train.batch_size=2"]),
]
COMPILED = [
    (f"{name}, compiled", ranks, [*sets, "parallel.compile=inductor"])
    for name, ranks, sets in LAYOUTS
    if name in ("1 process", "dp=2")
]


def cohort(work: Path, size: int, n: int = 24) -> Path:
    """``n`` synthetic slides of ``size``^2 written and preprocessed under ``work``; the manifest."""
    from hyfi_imaging.data.synthetic import write_synthetic_cohort
    from hyfi_imaging.preprocess import PreprocessOptions, run_preprocess

    labels = write_synthetic_cohort(work / "slides", n, seed=0, size=(size, size), lesions=8)
    summary = run_preprocess(
        [work / "slides"],
        work / "data",
        PreprocessOptions(mpp=0.5, size=(size, size)),
        labels_path=labels,
        progress=False,
        qc=False,
    )
    assert summary.manifest is not None and not summary.failed
    return summary.manifest


def _run(manifest: Path, out: Path, ranks: int, sets: list[str], steps: int) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "hyfi_imaging.cli.train", str(ROOT / "recipes" / "synthetic.yaml")]
    if ranks > 1:
        cmd = [str(Path(sys.executable).with_name("mpiexec")), "-n", str(ranks), *cmd]
    base = [
        f"data.manifest={manifest}",
        f"train.out_dir={out}",
        "train.batch_size=4",
        "train.epochs=100",
        f"train.max_steps={steps}",
        "train.progress=false",
        "train.checkpoint_every_steps=0",
        "data.val_fraction=0.0",
    ]
    for s in (*base, *sets):
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"hyfi-train exit {done.returncode}: {last}")
    rows = [r for r in csv.DictReader((out / "metrics.csv").open()) if r.get("images_per_s")]
    ips = [float(r["images_per_s"]) for r in rows[1:]]  # step 1 is warm-up
    mps = [float(r["megapixels_per_s"]) for r in rows[1:]]
    return statistics.median(ips), statistics.median(mps)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", type=int, default=768, help="image side (default: 768)")
    p.add_argument("--steps", type=int, default=12, help="training steps per layout (default: 12)")
    p.add_argument("--quick", action="store_true", help="256^2 images, 4 steps")
    p.add_argument(
        "--compile", action="store_true", help="one process and dp=2, eager against compiled"
    )
    args = p.parse_args()
    if args.size < 1:
        p.error(f"--size {args.size}: give a whole number >= 1")
    if args.steps < 2:
        p.error(f"--steps {args.steps}: give at least 2 (step 1 is a warm-up, not timed)")
    if args.quick:
        args.size, args.steps = 256, 4
    layouts = LAYOUTS
    if args.compile:
        eager = [lay for lay in LAYOUTS if f"{lay[0]}, compiled" in {c[0] for c in COMPILED}]
        layouts = [x for pair in zip(eager, COMPILED, strict=True) for x in pair]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        manifest = cohort(work, args.size)
        results = []
        failed: list[str] = []
        for name, ranks, sets in layouts:
            out = work / name.replace(" ", "_").replace("=", "").replace(",", "")
            try:
                ips, mps = _run(manifest, out, ranks, sets, args.steps)
            except RuntimeError as err:
                failed.append(f"{name}: {err}")
                ips = mps = float("nan")
            results.append((name, ranks, ips, mps))
            print(f"  {name:20s} {ranks} ranks: {ips:6.2f} images/s  {mps:6.2f} MP/s", flush=True)
    base = results[0][2]
    print(
        f"\nsynthetic recipe, {args.size}^2 images, ResNet-18 x0.25, batch 4, {args.steps} steps, 2 cores"
    )
    print(f"{'layout':20s}{'ranks':>6s}{'images/s':>10s}{'MP/s':>8s}{'ratio':>8s}")
    for name, ranks, ips, mps in results:
        print(f"{name:20s}{ranks:>6d}{ips:>10.2f}{mps:>8.2f}{ips / base:>8.2f}")
    for line in failed:
        print(f"failed: {line}")
    if args.compile:  # pairs: eager, then compiled
        pairs = zip(results[::2], results[1::2], strict=True)
        ratios = "; ".join(f"{c[0]} {c[2] / e[2]:.2f}x eager" for e, c in pairs)
        verdict = "MISS" if failed else "PASS"
        print(f"\n{verdict}  torch.compile (inductor) trains on every layout it is offered on: "
              f"{ratios} (the speed target is a GPU's: gpu_check.py (e))")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
