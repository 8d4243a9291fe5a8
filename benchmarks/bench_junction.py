"""Layer, pipeline, spatial and Hy-Fi hybrid parallelism side by side (issue 11, parts 1-2).

Same ranks, same model, image and per-replica batch, one run after the other:

* **layer**: ``pp = P`` stages, one micro-batch (one stage busy at a time);
* **pipeline**: ``pp = P`` stages, ``m`` micro-batches (GPipe);
* **pipeline + bi-directional**: the same stages, two mirrored replicas (GEMS-MASTER);
* **spatial**: one stage on a grid of ``P`` tiles;
* **hybrid**: the junction -- a tiled front stage feeding a one-rank back stage
  (``--hybrid 1x3,1x1``: 3 + 1 ranks), ``m`` micro-batches;
* **hybrid + bi-directional**: spatial and bi-directional pipeline together -- two
  mirrored replicas of a ``pp = 2`` model whose stages are tiled alike
  (``--bidir-grid 1x2``: 2 x 2 ranks);
* **junction + bi-directional**: two mirrored replicas of a junction (MPI4DL's GEMS + SP):
  replica A's tiled front stage and replica B's tiled front stage on the two pipeline
  positions, each position as wide as its larger grid
  (:class:`~hyfi_imaging.parallel.mirrored.MirroredPlacement`; ``--junction-bidir 1x2,1x1``:
  2 + 2 ranks, a 3-rank junction mirrored);
* **sub-graph** (data sub-graph parallelism, :mod:`~hyfi_imaging.parallel.branches`):
  ``br = B`` branch ranks per stage of ``pp = P / B`` stages (``--branches 2``, models with
  branched cells only: AmoebaNet). Beside it, the planner's prediction of the same layouts
  (:func:`~hyfi_imaging.parallel.plan.predict` on this CPU, :func:`~.devices.calibrate_cpu`):
  per-rank saved activations, the busiest rank's counted FLOPs, and the predicted step,
  against the pipeline row's layout. ``--rows subgraph,pipeline`` runs only those rows.

Throughput. CPU time does not see a pipeline's bubble (a rank waiting for its
neighbour burns none), and on 2 shared cores wall time across 4 ranks says
little, so the step time a machine with a core (device) per rank would take is
*estimated*: the busiest rank's CPU seconds / (1 - the schedule's simulated
bubble), the bubble from replaying every rank's actual action order with unit
costs (:func:`~hyfi_imaging.parallel.schedules.simulate_orders`, the planner's
simulator; 0 for one stage). Throughput = images / that estimate. The issue's
GPU goals (hybrid >= 1.5x pipeline and >= 2x layer parallelism) are printed with
PASS/MISS against these estimates, labelled as such.

Per rank and step: **CPU seconds** (``time.process_time``; on this shared
2-core VM wall time across 4 ranks says little), **activation bytes sent**
(halo messages and stage-to-stage messages, pipelining's and the junction's
alike, counted at ``torch.distributed.isend`` and the halo exchange; weight and
gradient collectives of FSDP2 and BatchNorm statistics are *not* counted), and
the **peak anonymous memory** of the step over the resident set before it
(:class:`~hyfi_imaging.parallel.memory.AnonymousPeak`). Reported: the busiest
rank's CPU time, the sum over ranks (the machine's total work), bytes per step
summed over ranks, and the largest per-rank peak. Medians over the timed steps.

Usage::

    python benchmarks/bench_junction.py                       # resnet18 w0.25, 192x288, 4 ranks
    python benchmarks/bench_junction.py --size 256x384 --steps 4
    python benchmarks/bench_junction.py --model amoebanet-d-6-32 --width 1 --size 96x128 \
        --ranks 2 --batch 2 --microbatches 2 --steps 2 --rows pipeline,subgraph
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
MARKER = "HYFI-BENCH-JUNCTION "
#: Row keys, in table order (``--rows``).
ROWS = (
    "layer",
    "pipeline",
    "bidir",
    "spatial",
    "hybrid",
    "hybrid-bidir",
    "junction-bidir",
    "subgraph",
)


# ----------------------------------------------------------------------------- worker


def _count_messages() -> list[int]:
    """Count bytes at the two doors every activation message passes: ``[halo, all sends]``.

    Halo messages are posted as ``P2POp(dist.isend, ...)`` too, so stage-to-stage bytes
    are all sends less the halo's."""
    import torch.distributed as dist

    from hyfi_imaging.parallel import halo

    counters = [0, 0]
    real_exchange, real_isend = halo._exchange, dist.isend

    def exchange(sends: Any, recvs: Any) -> Any:
        counters[0] += sum(t.numel() * t.element_size() for _, t in sends)
        return real_exchange(sends, recvs)

    def isend(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        counters[1] += tensor.numel() * tensor.element_size()
        return real_isend(tensor, *args, **kwargs)

    halo._exchange = exchange
    # P2POp accepts only the module's own isend, looked up in distributed_c10d: patch both.
    dist.isend = dist.distributed_c10d.isend = isend
    return counters


def _create(name: str, width: float) -> Any:
    """The registry's model; ``width`` 1 is every model's own (AmoebaNet takes no width)."""
    from hyfi_imaging.models import create_model

    return create_model(name, num_classes=2, **({"width": width} if width != 1 else {}))


def _worker(cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from hyfi_imaging.parallel.engine import ParallelModel, ParallelPlan
    from hyfi_imaging.parallel.launch import init_parallel, shutdown
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.parallel.memory import AnonymousPeak

    torch.set_num_threads(1)
    grids = tuple(tuple(g) for g in cfg["grids"])
    layout = Layout(
        pp=cfg["pp"], br=cfg.get("br", 1), sp=grids[0], grids=grids if len(grids) > 1 else None
    )
    plan = ParallelPlan(
        layout,
        microbatches=cfg["m"],
        schedule=cfg.get("schedule", "gpipe"),
        balance=tuple(cfg["balance"]) if cfg.get("balance") else None,
    )
    pc = init_parallel(layout, schedule=plan.schedule)
    counters = _count_messages()
    torch.manual_seed(0)
    model = _create(cfg["model"], cfg["width"])
    hw = tuple(cfg["hw"])
    pm = ParallelModel(model, pc, plan, image_hw=(int(hw[0]), int(hw[1])))
    del model
    opt = torch.optim.SGD(pm.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for step in range(cfg["steps"] + 1):
        images = torch.randn(cfg["batch"], 3, *hw, generator=gen)
        labels = torch.randint(0, 2, (cfg["batch"],), generator=gen)
        tiles = pm.tile_of(images) if pm.is_first else None
        dist.barrier()
        before = list(counters)
        cpu = time.process_time()
        with AnonymousPeak() as peak:
            opt.zero_grad(set_to_none=True)
            pm.train_step(tiles, labels)
            opt.step()
        if step:  # the first step builds schedules and warms the allocator
            rows.append(
                {
                    "cpu": time.process_time() - cpu,
                    "halo": counters[0] - before[0],
                    "stage": counters[1] - before[1] - (counters[0] - before[0]),
                    "peak": peak.bytes,
                }
            )
    table: list[Any] = [None] * pc.world_size
    dist.all_gather_object(table, rows)
    if pc.rank == 0:
        print(MARKER + json.dumps(table), flush=True)
    dist.barrier()
    shutdown()


# ----------------------------------------------------------------------------- driver


def _run(name: str, cfg: dict[str, Any], ranks: int) -> dict[str, Any]:
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [mpiexec, "-n", str(ranks), sys.executable, str(HERE), "--worker", json.dumps(cfg)]
    began = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode or not lines:
        sys.exit(f"bench_junction: {name} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    table = json.loads(lines[-1][len(MARKER) :])

    def med(rank: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rank)

    return {
        "name": name,
        "ranks": ranks,
        "bubble": _bubble(cfg),
        "cpu_max": max(med(r, "cpu") for r in table),
        "cpu_sum": sum(med(r, "cpu") for r in table),
        "halo": sum(med(r, "halo") for r in table),
        "stage": sum(med(r, "stage") for r in table),
        "peak_max": max(med(r, "peak") for r in table),
        "peaks": [med(r, "peak") for r in table],
        "seconds": time.perf_counter() - began,
    }


def _bubble(cfg: dict[str, Any]) -> float:
    """The schedule's simulated idle fraction (unit costs), 0 for a single stage."""
    from hyfi_imaging.parallel.schedules import model_stages, schedule_actions, simulate_orders

    schedule, pp = cfg.get("schedule", "gpipe"), int(cfg["pp"])
    if pp == 1:
        return 0.0
    orders = schedule_actions(schedule, pp, int(cfg["m"]))
    return simulate_orders(orders, model_stages(schedule, pp))[1]


def _predicted(args: argparse.Namespace, base: dict[str, Any], rows: list[Any]) -> None:
    """The planner's figures for ``rows`` (``(name, config)``: the pipeline row, then the
    sub-graph row), on this CPU calibrated and Gloo's nominal link; the sub-graph's speed-up."""
    from hyfi_imaging.parallel.devices import calibrate_cpu
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.parallel.plan import Candidate, predict

    model = _create(args.model, args.width)
    dev = calibrate_cpu()
    hw = (int(base["hw"][0]), int(base["hw"][1]))
    print()
    print(
        "| layout (planner, this CPU calibrated) | saved activations MiB per rank, busiest "
        "| GFLOP/step, busiest rank | predicted step s | predicted images/s |"
    )
    print("|---|---|---|---|---|")
    steps = []
    for name, cfg in rows:
        lay = Layout(pp=cfg["pp"], br=cfg.get("br", 1), sp=tuple(cfg["grids"][0]))
        cand = Candidate(lay, cfg["m"], balance=tuple(cfg["balance"]) if "balance" in cfg else None)
        pred = predict(model, hw, base["batch"], cand, device=dev)
        steps.append(pred.step_s)
        print(
            f"| {name} | {pred.activations / 2**20:.2f} | {pred.parts['flops'] / 1e9:.2f} "
            f"| {pred.step_s:.3f} | {base['batch'] / pred.step_s:.2f} |"
        )
    if len(steps) == 2:
        print(f"predicted speed-up, {rows[1][0]} / {rows[0][0]}: {steps[0] / steps[1]:.2f}x")


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``p.error`` (one line, exit 2) on the first option that cannot be read, before any launch."""
    from hyfi_imaging.errors import ConfigError
    from hyfi_imaging.shapes import parse_shape, parse_shapes

    for name in ("batch", "microbatches", "steps", "ranks", "branches"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: give a whole number >= 1")
    for opt, text, kind in (
        ("--size", args.size, "size"),
        ("--spatial", args.spatial, "grid"),
        ("--bidir-grid", args.bidir_grid, "grid"),
    ):
        try:
            shape = parse_shape(text, opt, kind=kind)
        except ConfigError as err:
            p.error(str(err))
        if len(shape) != 2:
            p.error(f"{opt} {text!r}: give a 2-D {kind}, HxW (e.g. 2x2)")
    for opt, text in (("--hybrid", args.hybrid), ("--junction-bidir", args.junction_bidir)):
        try:
            grids = parse_shapes(text, opt)
        except ConfigError as err:
            p.error(str(err))
        if any(len(g) != 2 for g in grids):
            p.error(f"{opt} {text!r}: give 2-D stage grids, comma-separated (e.g. 1x3,1x1)")
    for opt, text in (
        ("--pipeline-balance", args.pipeline_balance),
        ("--hybrid-balance", args.hybrid_balance),
    ):
        try:
            cut = [int(v) for v in text.split(",")]
        except ValueError:
            cut = [0]
        if min(cut) < 1:
            p.error(f"{opt} {text!r}: give comma-separated layer counts >= 1, e.g. 5,6")
    unknown = sorted(set(args.rows.split(",")) - set(ROWS))
    if unknown:
        p.error(f"--rows {','.join(unknown)!r}: give some of {','.join(ROWS)}")
    if args.ranks % args.branches:
        p.error(f"--ranks {args.ranks}: give a multiple of --branches {args.branches}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--size", default="192x288")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ranks", type=int, default=4, help="ranks of every layout (default 4)")
    p.add_argument("--spatial", default="2x2", help="grid of the spatial-only layout")
    p.add_argument("--hybrid", default="1x3,1x1", help="stage grids of the hybrid layout")
    p.add_argument("--hybrid-balance", default="5,6", help="layers per hybrid stage")
    p.add_argument(
        "--bidir-grid", default="1x2", help="grid of both stages of hybrid + bi-directional"
    )
    p.add_argument(
        "--junction-bidir",
        default="1x2,1x1",
        help="stage grids of junction + bi-directional (mirrored: each position as wide as "
        "its larger grid)",
    )
    p.add_argument(
        "--pipeline-balance", default="4,1,2,4", help="layers per stage of layer and pipeline"
    )
    p.add_argument("--branches", type=int, default=2, help="branch ranks of the sub-graph row")
    p.add_argument(
        "--rows",
        default=",".join(ROWS[:7]),
        help=f"rows to run, of {','.join(ROWS)} (default: all but subgraph)",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run (64x96, 1 step)")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.steps, args.batch, args.microbatches = "64x96", 1, 2, 2
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    _check_args(p, args)
    from hyfi_imaging.parallel.layout import Layout

    h, w = Layout.parse_grid(args.size)
    base = {
        "model": args.model,
        "width": args.width,
        "hw": [h, w],
        "batch": args.batch,
        "steps": args.steps,
    }
    n, m = args.ranks, args.microbatches
    hybrid = Layout.parse_grids(args.hybrid)
    mirrored_grids = Layout.parse_grids(args.junction_bidir)
    cut = [int(v) for v in args.pipeline_balance.split(",")]
    pipeline = {"pp": n, "grids": [[1, 1]], "m": m, "balance": cut}
    bidir_grid = list(Layout.parse_grid(args.bidir_grid))
    bidir_pp = n // (bidir_grid[0] * bidir_grid[1])
    br = args.branches
    chosen = args.rows.split(",")
    cases = [
        ("layer (pp, 1 micro-batch)", {**pipeline, "m": 1}),
        (f"pipeline (pp, {m} micro-batches)", pipeline),
        (
            f"pipeline + bi-directional ({m} micro-batches)",
            {**pipeline, "schedule": "bidirectional"},
        ),
        (
            f"spatial ({args.spatial})",
            {"pp": 1, "grids": [list(Layout.parse_grid(args.spatial))], "m": 1},
        ),
        (
            f"hybrid ({args.hybrid}, {m} micro-batches)",
            {
                "pp": len(hybrid),
                "grids": [list(g) for g in hybrid],
                "m": m,
                "balance": [int(v) for v in args.hybrid_balance.split(",")],
            },
        ),
        (
            f"hybrid + bi-directional (pp {bidir_pp} x {args.bidir_grid}, {m} micro-batches)",
            {
                "pp": bidir_pp,
                "grids": [bidir_grid],
                "m": m,
                "schedule": "bidirectional",
                "balance": [int(v) for v in args.hybrid_balance.split(",")],
            },
        ),
        (
            f"junction + bi-directional ({args.junction_bidir} mirrored, {m} micro-batches)",
            {
                "pp": len(mirrored_grids),
                "grids": [list(g) for g in mirrored_grids],
                "m": m,
                "schedule": "bidirectional",
                "balance": [int(v) for v in args.hybrid_balance.split(",")],
            },
        ),
        (
            f"sub-graph (br {br} x pp {n // br}, {m if n > br else 1} micro-batches)",
            {"pp": n // br, "br": br, "grids": [[1, 1]], "m": m if n > br else 1},
        ),
    ]
    picked = [c for key, c in zip(ROWS, cases, strict=True) if key in chosen]
    if "junction-bidir" in chosen:
        from hyfi_imaging.parallel.mirrored import MirroredPlacement

        need = MirroredPlacement(Layout(pp=len(mirrored_grids), grids=mirrored_grids)).world_size
        if need != n:
            p.error(
                f"--junction-bidir {args.junction_bidir!r}: mirrored it takes {need} ranks, not "
                f"--ranks {n}; give grids whose placement fills {n} ranks"
            )
    if "pipeline" in chosen and len(cut) != n:
        pipeline.pop("balance")  # the default cut is for ResNet-18 on 4 ranks: let the engine cut
    load = os.getloadavg()[0]
    results = [_run(name, {**base, **cfg}, n) for name, cfg in picked]
    print(
        f"# {args.model} width {args.width}, {h}x{w}, batch {args.batch}, {n} ranks (gloo, CPU, one "
        f"thread each), median of {args.steps} steps; load average {load:.1f} at start"
    )
    for r in results:
        r["step"] = r["cpu_max"] / (1.0 - r["bubble"])  # estimated: see the module docstring
    print(
        "| layout | sim. bubble | est. step s | images/s (est.) | CPU s/step, busiest rank "
        "| CPU s/step, all ranks | halo MiB/step | stage-to-stage MiB/step "
        "| peak MiB, largest rank | peak MiB per rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        peaks = " / ".join(f"{v / 2**20:.0f}" for v in r["peaks"])
        print(
            f"| {r['name']} | {r['bubble']:.3f} | {r['step']:.2f} | {args.batch / r['step']:.2f} "
            f"| {r['cpu_max']:.2f} | {r['cpu_sum']:.2f} | {r['halo'] / 2**20:.1f} "
            f"| {r['stage'] / 2**20:.1f} | {r['peak_max'] / 2**20:.0f} | {peaks} |"
        )
    if "subgraph" in chosen:  # the planner beside it: the pipeline row's layout, and its own
        keys = [k for k in ("pipeline", "subgraph") if k in chosen]
        _predicted(args, base, [picked[[k for k in ROWS if k in chosen].index(k)] for k in keys])
    if not {"layer", "pipeline"} <= set(chosen):
        return 0
    got = dict(zip([k for k in ROWS if k in chosen], results, strict=True))
    layer, pipe = got["layer"], got["pipeline"]
    print()
    hybrids = (
        ("hybrid", "hybrid"),
        ("hybrid-bidir", "hybrid + bi-directional"),
        ("junction-bidir", "junction + bi-directional"),
    )
    for name, r in ((label, got[key]) for key, label in hybrids if key in got):
        for base, goal in ((pipe, 1.5), (layer, 2.0)):
            ratio = base["step"] / r["step"]
            verdict = "PASS" if ratio >= goal else "MISS"
            print(
                f"{verdict}  {name} throughput / {base['name'].split(' (')[0]}: {ratio:.2f}x "
                f"(GPU goal >= {goal}x; here estimated from CPU time and the simulated bubble)"
            )
        print(
            f"      {name} largest per-rank peak / pipeline's: "
            f"{r['peak_max'] / pipe['peak_max']:.2f}x, / layer's: "
            f"{r['peak_max'] / layer['peak_max']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    sys.exit(main())
