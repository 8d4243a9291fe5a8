"""Deep halos (issue 11, part 3): messages, bytes and time per step, depth 1 vs depth N.

What is measured, side by side in one run (same ranks, weights, image, data):
two copies of one model on a spatial grid, spatialized with ``halo_depth=1``
and with ``halo_depth=N``, trained alternately step by step so that the
machine's load hits both alike. Per rank and step:

* **halo messages** and **bytes sent** (forward and backward), counted where
  every halo message passes -- exact, not timed;
* **exposed wait**: seconds inside the waits of the halo phases;
* **step wall time** and **process CPU time** (a deep halo recomputes the
  border of each later layer of a run: more CPU, fewer messages);
* **saved activations** (bytes autograd keeps for backward, measured with
  ``saved_tensors_hooks``): the carried borders cost memory;
* the loss, which must be the same at both depths (exact arithmetic in
  float64 here; the figures are for float32 steps).

Each figure is the median over the timed steps of the slowest rank.

Targets (ours; the issue asks to measure): on the plain conv + ReLU chain
(Hy-Fi's setting, every layer 3x3) messages at depth N at most ``1/N + 0.1``
of depth 1, CPU time at most 1.15x, and losses identical.

Usage::

    python benchmarks/bench_deep_halo.py                          # convchain, 1x4, 256^2, depth 4
    python benchmarks/bench_deep_halo.py --model resnet18 --grid 2x2 --depth 2
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overlap import summary, timed_exchanges

TARGET_CPU = 1.15


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    from hyfi_imaging.models import create_model
    from hyfi_imaging.parallel.apply import apply_spatial, tile_of
    from hyfi_imaging.parallel.launch import init_parallel, shutdown
    from hyfi_imaging.parallel.layout import Layout

    gy, gx = (int(v) for v in args.grid.split("x"))
    torch.set_num_threads(1)
    pc = init_parallel(Layout(sp=(gy, gx)))
    torch.manual_seed(0)
    options: dict[str, Any] = {"num_classes": 2}
    if args.model.startswith("resnet"):
        options["width"] = args.width
    plain = create_model(args.model, **options)
    hw = (args.size, args.size)
    models, ctxs = {}, {}
    for depth in (1, args.depth):
        models[depth] = copy.deepcopy(plain)
        ctxs[depth] = apply_spatial(models[depth], pc, image_size=hw, halo_depth=depth)
    counters = timed_exchanges()
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(2, 3, *hw, generator=gen)
    labels = torch.tensor([0, 1])
    x = tile_of(images, ctxs[1], hw).contiguous()
    rows: list[dict[str, Any]] = []
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    for step in range(2 * (args.steps + 1)):
        depth = args.depth if step % 2 else 1
        model = models[depth]
        torch.distributed.barrier(group=pc.group("sp"))
        counters[:] = [0.0, 0, 0]
        saved[0] = 0
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(model(x), labels)
        loss.backward()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        model.zero_grad(set_to_none=True)
        if step >= 2:  # the first pair warms up
            rows.append(
                {"depth": depth, "wall": wall, "cpu": cpu, "wait": counters[0],
                 "messages": counters[1], "bytes": counters[2], "saved": saved[0],
                 "loss": float(loss)}
            )  # fmt: skip
    runs = len(ctxs[args.depth].deep_runs) if ctxs[args.depth] is not None else 0
    gathered: list[Any] = [None] * pc.world_size
    torch.distributed.all_gather_object(gathered, rows)
    if pc.rank == 0:
        print("RESULT " + json.dumps({"ranks": gathered, "runs": runs}))
    shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--grid", default="1x4")
    p.add_argument("--model", default="convchain")
    p.add_argument("--width", type=float, default=0.5, help="ResNet width multiplier")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--depth", type=int, default=4, help="halo depth compared with 1")
    p.add_argument("--steps", type=int, default=4, help="timed steps of each depth")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    try:
        gy, gx = (int(v) for v in args.grid.split("x"))
    except ValueError:
        gy = gx = 0
    if min(gy, gx) < 1:
        p.error(f"--grid {args.grid!r}: give the tile grid as GYxGX, e.g. 2x2")
    for name in ("size", "depth", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: give a whole number >= 1")
    cmd = ["mpiexec", "-n", str(gy * gx), sys.executable, str(Path(__file__).resolve()),
           "--worker", *(argv if argv is not None else sys.argv[1:])]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 2
    result = json.loads(line[len("RESULT ") :])
    ranks = result["ranks"]
    one, deep = summary(ranks, "depth", 1), summary(ranks, "depth", args.depth)
    same = len({round(r["loss"], 5) for r in ranks[0]}) == 1
    print(f"{args.model}, {args.size}^2, batch 2, grid {args.grid} ({gy * gx} ranks, gloo, "
          f"1 thread each), {result['runs']} deep-halo runs at depth {args.depth}; "
          f"medians of {args.steps} steps, slowest rank")  # fmt: skip
    print(f"{'depth':<8}{'messages':>10}{'MiB sent':>10}{'saved MiB':>11}{'wall s':>9}"
          f"{'CPU s':>9}{'wait s':>9}")  # fmt: skip
    for name, s in (("1", one), (str(args.depth), deep)):
        print(f"{name:<8}{s['messages']:>10.0f}{s['bytes'] / 2**20:>10.2f}"
              f"{s['saved'] / 2**20:>11.1f}{s['wall']:>9.3f}{s['cpu']:>9.3f}{s['wait']:>9.4f}")  # fmt: skip
    ratio = {k: deep[k] / one[k] if one[k] else float("nan") for k in one}
    print(
        "depth {}/1: messages {messages:.2f}x, bytes {bytes:.2f}x, saved {saved:.2f}x, "
        "wall {wall:.2f}x, CPU {cpu:.2f}x, exposed wait {wait:.2f}x".format(args.depth, **ratio)
    )
    print(
        f"{'PASS' if same else 'MISS'} losses at both depths identical (5 digits, float32): {same}"
    )
    target_msgs = 1 / args.depth + 0.1
    ok_msgs = ratio["messages"] <= target_msgs
    print(f"{'PASS' if ok_msgs else 'MISS'} messages {ratio['messages']:.2f}x "
          f"(target <= {target_msgs:.2f}x)")  # fmt: skip
    ok_cpu = ratio["cpu"] <= TARGET_CPU
    print(f"{'PASS' if ok_cpu else 'MISS'} CPU time {ratio['cpu']:.2f}x (target <= {TARGET_CPU}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
