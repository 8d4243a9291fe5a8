"""3D U-Net on a 2x2x2 grid of sub-volumes: per-rank memory against one process, halo bytes.

What it measures (issue 12), with the library's own counters:

* **saved activations** per rank (distinct storages autograd keeps for backward,
  :func:`hyfi_imaging.parallel.memory.saved_activations`) over those of one
  process on the whole volume; ideal 1/8 = 0.125;
* **peak anonymous memory** of one training step per rank (forward, backward;
  :class:`hyfi_imaging.parallel.memory.AnonymousPeak`) over one process's;
* **halo bytes**: every message of the exchange passes through
  ``parallel.halo._exchange``, which is wrapped to count the bytes sent in the
  forward and the backward pass, against the analytic count from the layers'
  geometry -- per windowed layer and spatial dim, ``p`` before and
  ``max(0, K - p - s)`` after (REFERENCE.md), received only from a face
  neighbour, the strips of dim ``k`` spanning the halos of the dims before it
  (transposed convolutions: ``geometry.transposed_halo``). The backward sends
  the same strips back (the adjoint), except for layers whose input needs no
  gradient (the first convolution, on the input volume).

Usage: ``python benchmarks/bench_volume.py [--size 64 --width 4 --depth 2]``
(starts ``mpiexec -n 8`` itself). Prints a table and PASS/MISS lines; exit 0
measured, 2 a run failed. Every rank uses one thread.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARK = "RESULT "


def _analytic(
    model: Any, ctx: Any, shapes: dict[str, tuple[int, ...]], itemsize: int, paths: set[str]
) -> int:
    """Bytes this rank receives in one forward through the layers ``paths``, from their
    geometry alone."""
    from torch import nn

    from hyfi_imaging.parallel.geometry import layer_geom, transposed_halo

    nd = len(ctx.grid)
    sides = ctx.neighbours.pairs()[-nd:]
    total = 0
    for path, m in model.named_modules():
        if path not in shapes or path not in paths:
            continue
        n, c, *tile = shapes[path]
        if isinstance(m, nn.ConvTranspose3d):
            halo = [transposed_halo(m.kernel_size[a], m.stride[a], m.padding[a], m.dilation[a])
                    for a in range(nd)]  # fmt: skip
        else:
            halo = [g.halo() for g in layer_geom(m)]
        for k, (lo, hi) in enumerate(sides):
            got = (halo[k][0] if lo is not None else 0) + (halo[k][1] if hi is not None else 0)
            across = math.prod(
                tile[j] + sum(halo[j]) if j < k else tile[j] for j in range(nd) if j != k
            )
            total += n * c * got * across * itemsize
    return total


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from hyfi_imaging.models import create_model
    from hyfi_imaging.parallel import halo
    from hyfi_imaging.parallel.launch import exit_now, init_parallel
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.parallel.memory import (
        AnonymousPeak,
        configure_allocator,
        saved_activations,
    )
    from hyfi_imaging.parallel.verify import pad_image, spatial_context_for

    torch.set_num_threads(1)
    grid = tuple(int(v) for v in args.grid.split("x"))
    size = (args.size,) * 3

    def build() -> nn.Module:
        torch.manual_seed(0)
        return create_model(
            "unet3d", in_chans=1, num_classes=2, width=args.width, depth=args.depth,
            upsampling="transpose",
        ).train()  # fmt: skip

    configure_allocator()  # before the first tensor, as the commands do (one process too)
    torch.manual_seed(1)
    volume = torch.randn(1, 1, *size)
    if grid == (1, 1, 1):
        model = build()
        saved = saved_activations(model, lambda: model(volume).sum()).activations
        model(volume).sum().backward()  # warm-up
        model.zero_grad(set_to_none=True)
        with AnonymousPeak() as peak:
            model(volume).sum().backward()
        print(MARK + json.dumps({"saved": saved, "peak": peak.bytes}), flush=True)
        return
    pc = init_parallel(Layout(sp=grid))
    model = build()
    ctx = spatial_context_for(model, pc, in_chans=1)
    ctx.set_image_size(size)
    tile = pad_image(volume, ctx.padded_size(size))[(..., *ctx.tile_slice(size))].contiguous()
    shapes: dict[str, tuple[int, ...]] = {}
    windowed = (nn.Conv3d, nn.MaxPool3d, nn.ConvTranspose3d)

    graded: set[str] = set()  # layers whose input needs a gradient: halo gradients go back

    def record(path: str, args: Any) -> None:
        shapes.setdefault(path, tuple(args[0].shape))  # a pre-hook returning a value replaces args
        if args[0].requires_grad:
            graded.add(path)

    hooks = [
        m.register_forward_pre_hook(lambda m, a, p=p: record(p, a))
        for p, m in model.named_modules()
        if isinstance(m, windowed)
    ]
    saved = saved_activations(model, lambda: model(tile).sum()).activations
    for h in hooks:
        h.remove()
    sent = {"forward": 0, "backward": 0}
    phase = ["forward"]
    real = halo._exchange

    def counting(sends: Any, recvs: Any) -> Any:
        sent[phase[0]] += sum(t.numel() * t.element_size() for _, t in sends)
        return real(sends, recvs)

    halo._exchange = counting  # type: ignore[assignment]
    out = model(tile)
    phase[0] = "backward"
    out.sum().backward()
    halo._exchange = real  # type: ignore[assignment]
    model.zero_grad(set_to_none=True)
    with AnonymousPeak() as peak:
        model(tile).sum().backward()
    mine = {
        "saved": saved, "peak": peak.bytes, "sent": sent,
        "analytic": _analytic(model, ctx, shapes, tile.element_size(), set(shapes)),
        "analytic_backward": _analytic(model, ctx, shapes, tile.element_size(), graded),
        "padded": list(ctx.padded_size(size)),
    }  # fmt: skip
    gathered: list[Any] = [None] * pc.world_size
    dist.all_gather_object(gathered, mine)
    if pc.rank == 0:
        print(MARK + json.dumps({"ranks": gathered}), flush=True)
    dist.barrier()
    exit_now(0)


def _launch(n: int, argv: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", *argv]
    if n > 1:
        cmd = ["mpiexec", "-n", str(n), *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode or not lines:
        print("\n".join((proc.stdout + proc.stderr).splitlines()[-20:]), file=sys.stderr)
        raise SystemExit(2)
    return json.loads(lines[-1][len(MARK) :])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", type=int, default=64, help="volume side (default 64)")
    p.add_argument("--width", type=int, default=4, help="U-Net width (default 4)")
    p.add_argument("--depth", type=int, default=2, help="U-Net depth (default 2)")
    p.add_argument("--grid", default="2x2x2", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("size", "width", "depth"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: give a whole number >= 1")
    if args.worker:
        worker(args)
        return 0
    common = ["--size", str(args.size), "--width", str(args.width), "--depth", str(args.depth)]
    one = _launch(1, [*common, "--grid", "1x1x1"])
    grid = _launch(8, [*common, "--grid", "2x2x2"])
    ranks = grid["ranks"]
    mib = 2**20
    print(f"3D U-Net (width {args.width}, depth {args.depth}, transposed up-convolutions), "
          f"{args.size}^3 float32, batch 1, one thread per rank; 2x2x2 = 8 ranks "
          f"(padded to {'x'.join(map(str, ranks[0]['padded']))})")  # fmt: skip
    print(f"{'':24s}{'one process':>14s}{'2x2x2 worst rank':>18s}{'ratio':>8s}{'ideal':>7s}")
    rows = []
    for key, label in (("saved", "saved activations"), ("peak", "peak anonymous")):
        worst = max(r[key] for r in ranks)
        ratio = worst / one[key]
        rows.append((label, ratio))
        print(
            f"{label + ', MiB':24s}{one[key] / mib:14.1f}{worst / mib:18.1f}{ratio:8.3f}{0.125:7.3f}"
        )
    fwd = sum(r["sent"]["forward"] for r in ranks)
    bwd = sum(r["sent"]["backward"] for r in ranks)
    want = sum(r["analytic"] for r in ranks)
    want_bwd = sum(r["analytic_backward"] for r in ranks)
    print(f"halo bytes sent, all ranks: forward {fwd:,} (analytic {want:,}), backward {bwd:,} "
          f"(analytic {want_bwd:,}: no halo gradient for the input volume, which needs none)")  # fmt: skip
    for label, ratio in rows:
        target = 0.2  # 1/8 plus the 3-D strips of sub-volumes this small
        print(f"{'PASS' if ratio <= target else 'MISS'}: {label} per rank, 2x2x2 / one process: "
              f"{ratio:.3f} (target <= {target}, ideal 0.125)")  # fmt: skip
    print(f"{'PASS' if fwd == want else 'MISS'}: forward halo bytes {fwd:,} = analytic {want:,}")
    print(f"{'PASS' if bwd == want_bwd else 'MISS'}: backward halo bytes {bwd:,} = analytic "
          f"{want_bwd:,}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
