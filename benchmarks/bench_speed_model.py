"""The speed model of ``hyfi-plan`` against measured CPU time, then Hy-Fi's comparison, predicted.

Two parts (``--part cpu``, ``--part hyfi``; both by default):

* **cpu** -- validation. The model (:mod:`hyfi_imaging.parallel.speed`, through
  :func:`hyfi_imaging.parallel.plan.predict` with this CPU's figures, calibrated by rank 0
  itself just before its steps: :func:`~hyfi_imaging.parallel.devices.calibrate_cpu`'s
  measurements swing by +-20 % on a shared machine from one minute to the next) predicts
  the main thread's CPU seconds of one training step (forward, backward, FSDP2
  reduction, SGD step) of one process and of rank 0 of a 1x2 grid; real ranks under
  ``mpiexec`` (one thread each, FSDP2 over the tiles, as the library trains) measure
  it with ``time.thread_time`` (median of the timed steps; process CPU time beside it).
  CPU time, not wall time: on a shared 2-core machine wall time is noise, and a rank
  blocked on a message spends none. The prediction counts what the device is busy
  with (compute, copies, launches), not the waits. Verdict: within +-20 % (PASS/MISS).
  A step also runs once under the model's own op counter (:class:`~.speed.OpCounter`,
  on real tensors): counted FLOPs, bytes and kernels beside the predicted ones say
  whether a miss is in the counts or in the rates.
* **hyfi** -- Hy-Fi's comparison (ISC'22; MPI4DL), PREDICTED, not measured: ResNet-50 and
  AmoebaNet-D (18, 256) at 8192^2 and 16384^2 on 64 to 2,048 GPUs, each strategy at its
  best configuration that fits the device's memory (:mod:`hyfi_imaging.parallel.scaling`):
  layer parallelism (a pipeline with one micro-batch), pipeline, spatial, hybrid
  (per-stage grids: spatial front stage, pipeline behind), hybrid + bi-directional
  (GEMS). Prints a table and the speed-ups next to the paper's 2.67x (over layer
  parallelism) and 1.68x (over pipeline parallelism), and draws ``--figure``.

Run (a few minutes here)::

    python benchmarks/bench_speed_model.py                    # both parts
    python benchmarks/bench_speed_model.py --part hyfi --devices v100 h100 \\
        --figure docs/hyfi_comparison.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.20


# ----------------------------------------------------------------------------- one rank


def _worker(cfg: dict[str, Any]) -> None:
    """One rank: build, time ``steps`` training steps after ``warmup``, count one more."""
    from hyfi_imaging.parallel.memory import configure_allocator

    configure_allocator()  # before the first tensor, as hyfi-train does (one process too)
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    import torch.distributed as dist
    import torch.nn.functional as F

    from hyfi_imaging.models import create_model
    from hyfi_imaging.parallel.devices import calibrate_cpu
    from hyfi_imaging.parallel.launch import exit_now, init_parallel
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.parallel.sharding import apply_fsdp
    from hyfi_imaging.parallel.speed import OpCounter
    from hyfi_imaging.parallel.verify import pad_image, spatial_context_for

    grid = tuple(cfg["grid"])
    spatial = grid != (1, 1)
    torch.manual_seed(0)
    model = create_model(cfg["model"], num_classes=2, **cfg.get("kwargs", {})).train()
    ctx = None
    rank = 0
    if spatial:
        pc = init_parallel(Layout(sp=grid))
        rank = pc.rank
        ctx = spatial_context_for(model, pc)
        if pc.shard_mesh is not None:
            apply_fsdp(
                model,
                pc.shard_mesh,
                tile_names=ctx.tile_param_names,
                tiles=pc.world_size,
                reshard_after_forward=False,  # as the engine (parallelize.apply_sharding)
            )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    side = int(cfg["image"])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, side, side, generator=gen)
    labels = torch.zeros(1, dtype=torch.long)
    if ctx is not None:
        hw = (side, side)
        ctx.set_image_size(hw)
        rows, cols = ctx.tile_slice(hw)
        x = pad_image(x, ctx.padded_size(hw))[..., rows, cols].clone()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), labels).backward()
        opt.step()

    def barrier() -> None:
        if spatial:
            dist.barrier()

    # This CPU's figures, measured by this rank just before its steps (the calibration the
    # model's prediction uses: same core, same neighbours on a shared machine).
    figures = asdict(calibrate_cpu(refresh=True, cache=Path(cfg["cache"])))
    thread, process, wall = [], [], []
    for i in range(cfg["warmup"] + cfg["steps"]):
        barrier()
        t0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
        step()
        t1, p1, w1 = time.thread_time(), time.process_time(), time.perf_counter()
        barrier()
        if i >= cfg["warmup"]:
            thread.append(t1 - t0)
            process.append(p1 - p0)
            wall.append(w1 - w0)
    counter = OpCounter()
    barrier()
    with counter:
        step()
    barrier()
    c = counter.counts
    timer = _op_timer()
    barrier()
    began = time.thread_time()
    with timer:
        step()
    timed = time.thread_time() - began
    barrier()
    result = {
        "rank": rank,
        "device": figures,
        "thread_s": thread,
        "process_s": process,
        "wall_s": wall,
        "tile": list(x.shape[-2:]),
        "counted": {
            "flops": c.flops,
            "bytes": c.bytes,
            "copy_bytes": c.copy_bytes,
            "ops": c.ops,
            "pixel_flops": c.pixel_flops,
            "fresh": list(c.fresh),
            "fresh_bytes": sum(c.fresh),
        },
        # Main-thread seconds of one more step by where they went: convolutions and matrix
        # products, other aten ops (collectives' waits included, which cost no CPU), the rest
        # (Python: layers, hooks, the autograd engine, the optimizer's loop).
        "split": {
            "flop_ops_s": timer.flop_s,
            "other_ops_s": timer.other_s,
            "outside_ops_s": timed - timer.flop_s - timer.other_s,
            "top": sorted(timer.by_op.items(), key=lambda kv: -kv[1])[:6],
        },
    }
    if spatial:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, result)
        if rank == 0:
            print("RESULT " + json.dumps(out), flush=True)
        dist.barrier()
        exit_now(0)
    print("RESULT " + json.dumps([result]), flush=True)


def _op_timer() -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    class OpTimer(TorchDispatchMode):
        """Main-thread CPU seconds inside aten ops (nested ops counted once, at the top)."""

        def __init__(self) -> None:
            super().__init__()
            self.flop_s = self.other_s = 0.0
            self.by_op: dict[str, float] = {}

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kw: Any = None) -> Any:
            began = time.thread_time()
            out = func(*args, **(kw or {}))
            spent = time.thread_time() - began
            name = func.overloadpacket.__name__
            if func.overloadpacket in flop_registry:
                self.flop_s += spent
            else:
                self.other_s += spent
            self.by_op[name] = self.by_op.get(name, 0.0) + spent
            return out

    return OpTimer()


def _launch(cfg: dict[str, Any], ranks: int, timeout_s: float = 900) -> list[dict[str, Any]]:
    cmd = [sys.executable, __file__, "--worker", json.dumps(cfg)]
    if ranks > 1:
        cmd = ["mpiexec", "-n", str(ranks), *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return list(json.loads(line[len("RESULT ") :]))
    raise RuntimeError(f"worker failed ({done.returncode}):\n{done.stderr[-3000:]}")


# ----------------------------------------------------------------------------- cpu part


def cpu_part(args: argparse.Namespace) -> list[str]:
    """Predicted vs measured main-thread CPU seconds per step; returns the verdict lines."""
    import torch

    torch.set_num_threads(1)
    from hyfi_imaging.io.budget import format_bytes
    from hyfi_imaging.models import create_model
    from hyfi_imaging.parallel.devices import Device, Link
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.parallel.plan import Candidate, predict
    from hyfi_imaging.parallel.speed import FRESH_CLASSES, Counts, compute_s

    print(f"\n== CPU validation: {args.model} {args.image}^2, main-thread CPU seconds per step")
    kwargs = {} if args.width is None else {"width": args.width}
    model = create_model(args.model, num_classes=2, **kwargs)
    verdicts = []
    header = (
        f"{'layout':8} {'pred s':>8} {'thread s':>9} {'err':>7} {'proc s':>8} {'wall s':>8} "
        f"{'GFLOP pred/count':>17} {'GB pred/count':>14} {'ops pred/count':>15}"
    )
    print(header)
    for grid in args.grids:
        lay = Layout(sp=grid)
        with tempfile.TemporaryDirectory() as tmp:
            cfg = {
                "model": args.model,
                "kwargs": kwargs,
                "grid": list(grid),
                "image": args.image,
                "warmup": args.warmup,
                "steps": args.steps,
                "cache": str(Path(tmp) / "speed.json"),
            }
            ranks = _launch(cfg, lay.world_size)
        r0 = next(r for r in ranks if r["rank"] == 0)
        fig = r0["device"]
        device = Device(
            **{
                **fig,
                "intra": Link(**fig["intra"]),
                "inter": Link(**fig["inter"]),
                "fresh_s": tuple(fig["fresh_s"]),
            }
        )
        print(
            f"{'':8} calibrated by rank 0 before its steps: {device.flops / 1e9:.0f} GFLOP/s "
            f"(conv 3x3 fwd+bwd), {device.px_half:.0f} px per call's fixed cost, "
            f"{device.mem_bw / 1e9:.1f} GB/s (BatchNorm+add+ReLU), "
            f"{device.op_overhead * 1e6:.1f} us per kernel, new buffers "
            + ", ".join(
                f"{format_bytes(2 ** (i + 12.5))} {device.fresh_s[i] * 1e9:.2f}"
                for i in range(4, FRESH_CLASSES, 3)
            )
            + " ns per byte"
        )
        pred = predict(model, (args.image, args.image), 1, Candidate(lay), device=device)
        busy = pred.parts["busy"]
        meas = statistics.median(r0["thread_s"])
        err = busy / meas - 1
        name = "x".join(map(str, grid))
        c = r0["counted"]
        # The model's rates on the work the real step did (the counter's counts): says whether
        # a miss is in what the planner counts or in the device's figures.
        real = Counts(
            flops=c["flops"],
            bytes=c["bytes"],
            ops=c["ops"],
            pixel_flops=c["pixel_flops"],
            fresh=tuple(c["fresh"]),
        )
        on_counted = compute_s(real, device)
        counted_err = on_counted / meas - 1
        print(
            f"{name:8} {busy:>8.3f} {meas:>9.3f} {err:>+7.1%} "
            f"{statistics.median(r0['process_s']):>8.3f} {statistics.median(r0['wall_s']):>8.3f} "
            f"{pred.parts['flops'] / 1e9:>8.1f}/{c['flops'] / 1e9:<8.1f} "
            f"{pred.parts['bytes'] / 1e9:>6.2f}/{c['bytes'] / 1e9:<7.2f} "
            f"{pred.parts['ops']:>7.0f}/{c['ops']:<7}"
        )
        sp = r0["split"]
        conv_s = (pred.parts["flops"] + pred.parts["pixel_flops"] * device.px_half) / device.flops
        print(
            f"{'':8} where the measured step went: convolutions {sp['flop_ops_s']:.3f} s "
            f"(predicted {conv_s:.3f}), other ops "
            f"{sp['other_ops_s']:.3f} s (predicted {pred.parts['bytes'] / device.mem_bw:.3f}), "
            f"outside aten ops {sp['outside_ops_s']:.3f} s (predicted "
            f"{pred.parts['ops'] * device.op_overhead:.3f}); new buffers predicted "
            f"{pred.parts['fresh_s']:.3f} s ({pred.parts['fresh_bytes'] / 1e9:.2f}/"
            f"{c['fresh_bytes'] / 1e9:.2f} GB pred/count; their faults are in the ops' times); top: "
            + ", ".join(f"{k} {v:.3f}" for k, v in sp["top"])
        )
        print(
            f"{'':8} the device's figures on the work the real step counted (not the "
            f"planner's): {on_counted:.3f} s ({counted_err:+.1%})"
        )
        ok = abs(err) <= TOLERANCE
        verdicts.append(
            f"{'PASS' if ok else 'MISS'}  {args.model} {args.image}^2 {name}: predicted "
            f"{busy:.3f} s, measured {meas:.3f} s main-thread CPU ({err:+.1%}, target "
            f"+-{TOLERANCE:.0%})"
        )
    return verdicts


# ----------------------------------------------------------------------------- hyfi part


def hyfi_part(args: argparse.Namespace) -> list[str]:
    """Hy-Fi's comparison, predicted: the table, the speed-ups, the figure."""
    from hyfi_imaging.parallel.devices import get_device
    from hyfi_imaging.parallel.scaling import compare_hyfi, format_table, plot

    began = time.perf_counter()
    rows = []
    for device in args.devices:
        got = compare_hyfi(models=args.models, sizes=args.sizes, gpus=args.gpus, device=device)
        print(f"\n== Hy-Fi's comparison, PREDICTED on {get_device(device).name}")
        print(format_table(got, device))
        rows += got
    if args.figure:
        plot(rows, Path(args.figure))
        print(f"figure: {args.figure}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_dict() for r in rows], indent=1))
    print(f"(predicted in {time.perf_counter() - began:.0f} s)")
    return []


def _grid(text: str) -> tuple[int, int]:
    try:
        gy, gx = (int(v) for v in text.lower().split("x"))
    except ValueError:
        gy = gx = 0
    if min(gy, gx) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a tile grid GYxGX, e.g. 1x2")
    return gy, gx


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", choices=("cpu", "hyfi", "all"), default="all")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", default="resnet18", help="cpu part: model (default resnet18)")
    p.add_argument("--width", type=float, default=None, help="cpu part: width multiplier")
    p.add_argument("--image", type=int, default=256, help="cpu part: square image side")
    p.add_argument("--grids", type=_grid, nargs="+", default=[(1, 1), (1, 2)])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--devices", nargs="+", default=["v100", "h100"],
        help="hyfi part: devices of the table (v100: Hy-Fi's Lassen-class GPUs, fp32)",
    )  # fmt: skip
    p.add_argument("--models", nargs="+", default=["resnet50", "amoebanet-d-18-256"])
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--gpus", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048])
    p.add_argument("--figure", default=str(ROOT / "docs" / "hyfi_comparison.png"))
    p.add_argument("--json", default="", help="hyfi part: write the rows here")
    args = p.parse_args(argv)
    for name in ("image", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: give a whole number >= 1")
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: give a whole number >= 0")
    for name in ("sizes", "gpus"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name} {min(getattr(args, name))}: give whole numbers >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    verdicts = []
    if args.part in ("cpu", "all"):
        verdicts += cpu_part(args)
    if args.part in ("hyfi", "all"):
        verdicts += hyfi_part(args)
    for v in verdicts:
        print(v)
    return 0


if __name__ == "__main__":
    sys.exit(main())
