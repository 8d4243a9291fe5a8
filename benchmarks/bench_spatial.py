"""Spatial parallelism on CPU: memory per rank, parallel efficiency, halo bytes, largest image.

Why these four numbers: spatial parallelism exists to fit images that do not
fit one device, so the first question is how much of the ideal 1/N memory per
rank it delivers (1), and then what it costs in time (2) and communication (3);
(4) turns the memory into the answer a user wants -- how large an image fits.
Every figure is a ratio against one process running the plain (unspatialized)
model, measured on the same machine minutes apart, so the machine's speed
cancels out.

Why measured this way:

* **Memory** is the kernel's peak resident set (``VmHWM``) of each rank's
  process, reset right before the step and compared with ``VmRSS`` right
  before it: it counts everything a real run pays for (activations, gradients,
  optimizer state, halo copies, allocator slack, communication buffers) and
  nothing of the interpreter and libraries loaded before. Each (layout, size)
  runs in fresh processes (``spatial_worker.py``), so no memory from one size
  is reused by the next.
* **Time** is wall time per step with one thread per rank, the slowest rank's,
  best of the timed steps (the machine is shared; the best step is the one
  least disturbed). CPU time per step is printed too: it does not depend on
  what else runs, so it shows the extra *work* spatial parallelism adds.
* **Halo bytes** are counted by wrapping ``hyfi_imaging.parallel.halo._exchange``
  (every halo message passes through it) and compared with a count derived
  here, independently of the library, from each conv/pool's kernel, stride,
  padding and dilation and the activation sizes of a shape trace. They must be
  equal to the byte; the script exits 1 otherwise.

Exit status: 0 all measured (PASS or MISS lines say how targets fared),
1 measured halo bytes differ from the analytic count, 2 a run failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["analytic_halo_bytes", "main"]

HERE = Path(__file__).resolve().parent
WORKER = HERE / "spatial_worker.py"
GIB = 1024**3
KIB = 1024


@dataclass(frozen=True)
class Config:
    """Sizes and step counts of one benchmark run (default or ``--quick``)."""

    mem_sizes: tuple[int, ...]
    target_size: int  # the size target 1 is judged at
    time_image: int
    warmup: int
    time_steps: int
    repeats: int
    ram_gib: float = 20.0


DEFAULT = Config(mem_sizes=(512, 768, 1024), target_size=1024, time_image=768, warmup=1, time_steps=3, repeats=2)  # fmt: skip
QUICK = Config(mem_sizes=(128, 256), target_size=128, time_image=256, warmup=1, time_steps=2, repeats=1)  # fmt: skip

TARGET_MEM_RATIO = 0.32
TARGET_EFFICIENCY = 0.80


# ---------------------------------------------------------------- analytic halo bytes


def _halo_1d(kernel: int, stride: int, padding: int, dilation: int) -> tuple[int, int]:
    """(before, after) halo of one window axis for stride-aligned tiles (REFERENCE.md)."""
    extent = dilation * (kernel - 1) + 1
    return padding, max(0, extent - padding - stride)


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, str):
        raise ValueError(f"string padding {v!r} is not handled by the analytic count")
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _window_layers(model_name: str, side: int, batch: int) -> list[dict[str, Any]]:
    """Every conv/pool of the plain model: its input shape at ``side`` px and its halo."""
    import torch
    from torch import nn

    from hyfi_imaging.models import create_model

    model = create_model(model_name, num_classes=2).to("meta")
    layers: list[dict[str, Any]] = []

    def hook(m: nn.Module, args: tuple[Any, ...]) -> None:
        k, s, p = _pair(m.kernel_size), _pair(m.stride or m.kernel_size), _pair(m.padding)
        d = _pair(getattr(m, "dilation", 1)) if not isinstance(m, nn.AvgPool2d) else (1, 1)
        hy, hx = (_halo_1d(k[a], s[a], p[a], d[a]) for a in (0, 1))
        # An avg-pool that excludes padding from its divisor also exchanges a
        # one-channel mask of ones, forward only (it needs no gradient).
        extra = (
            isinstance(m, nn.AvgPool2d)
            and not m.count_include_pad
            and not m.divisor_override
            and any(p)
        )
        # A layer fed the image itself sends no halo gradient: the image needs none.
        grad = args[0] is not image
        layers.append(
            {
                "shape": tuple(args[0].shape),
                "halo": (*hy, *hx),
                "mask_exchange": extra,
                "grad": grad,
            }
        )

    handles = [
        m.register_forward_pre_hook(hook)
        for m in model.modules()
        if isinstance(m, nn.Conv2d | nn.MaxPool2d | nn.AvgPool2d)
    ]
    image = torch.empty(batch, int(getattr(model, "in_chans", 3)), side, side, device="meta")
    with torch.no_grad():
        model(image)
    for h in handles:
        h.remove()
    return layers


def analytic_halo_bytes(
    model_name: str, grid: tuple[int, int], side: int, *, batch: int = 1, elem: int = 4
) -> list[dict[str, int]]:
    """Bytes and messages each rank sends per training step, forward and backward.

    Derived from first principles, not from the library: the exchange extends
    rows first (to the neighbour above go the ``bottom`` rows it lacks, to the
    one below the ``top`` rows), then columns of the row-extended tile, whose
    height is ``tile + top + bottom``. Backward sends each received halo's
    gradient back to its owner, so a rank's backward bytes equal its forward
    *received* bytes -- except for a layer fed the image, which needs no
    gradient. ``side`` must be a multiple of ``grid * total stride``
    so that no padding is involved and every tile is ``activation / grid``.
    """
    gy, gx = grid
    layers = _window_layers(model_name, side, batch)
    ranks = []
    for i in range(gy):
        for j in range(gx):
            up, down, left, right = i > 0, i < gy - 1, j > 0, j < gx - 1
            fwd = bwd = fwd_msgs = bwd_msgs = 0
            for layer in layers:
                b, c, h, w = layer["shape"]
                if h % gy or w % gx:
                    raise ValueError(f"activation {h}x{w} does not divide into a {gy}x{gx} grid")
                th, tw = h // gy, w // gx
                top, bottom, lft, rgt = layer["halo"]
                tall = th + top + bottom  # columns are exchanged after the rows
                # (pixels sent, pixels received) per neighbour, forward.
                links = [
                    (up, bottom * tw, top * tw),
                    (down, top * tw, bottom * tw),
                    (left, rgt * tall, lft * tall),
                    (right, lft * tall, rgt * tall),
                ]
                reps = [(b * c, layer["grad"])] + ([(1, False)] if layer["mask_exchange"] else [])
                for planes, has_grad in reps:
                    for present, send, recv in links:
                        if not present:
                            continue
                        fwd += send * planes * elem
                        fwd_msgs += send > 0
                        if has_grad:
                            bwd += recv * planes * elem
                            bwd_msgs += recv > 0
            ranks.append(
                {
                    "forward": fwd,
                    "backward": bwd,
                    "forward_msgs": fwd_msgs,
                    "backward_msgs": bwd_msgs,
                }
            )
    return ranks


# ---------------------------------------------------------------- running the worker


def _run_worker(nprocs: int, grid: str, extra: list[str], *, timeout_s: float) -> dict[str, Any]:
    """Run the worker (under ``mpiexec -n nprocs`` when nprocs > 1) and parse its result."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(WORKER), "--grid", grid, *extra]
    if nprocs > 1:
        cmd = ["mpiexec", "-n", str(nprocs), *cmd]
    label = " ".join(c if c != sys.executable else "python" for c in cmd).replace(
        str(HERE) + "/", ""
    )
    print(f"  running: {label}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SystemExit(
            f"bench_spatial: error: run timed out after {timeout_s:.0f} s: {label}"
        ) from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        print(tail, file=sys.stderr)
        print(f"bench_spatial: error: exit {proc.returncode}: {label}", file=sys.stderr)
        sys.exit(2)
    print(f"           {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return json.loads(lines[-1][len("RESULT ") :])  # type: ignore[no-any-return]


def _loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return float("nan")


# ---------------------------------------------------------------- reporting


def _growth_kib(rank: dict[str, Any], side: int, step: int) -> int:
    s = rank["mem"][str(side)]["steps"][step]
    return int(s["peak_kib"] - s["rss_before_kib"])


def _peak_total_bytes(run: dict[str, Any], side: int) -> int:
    """Sum over ranks of each rank's highest absolute peak RSS at ``side``."""
    return sum(max(s["peak_kib"] for s in r["mem"][str(side)]["steps"]) * KIB for r in run["ranks"])


def _table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  " + "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def _verdict(name: str, ok: bool, detail: str, quick: bool) -> str:
    tag = "PASS" if ok else "MISS"
    note = " (quick run: small sizes, indicative only)" if quick else ""
    line = f"{tag}  {name}: {detail}{note}"
    print(line)
    return line


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def _report_memory(
    single: dict[int, Any], grid22: dict[int, Any], cfg: Config, quick: bool
) -> tuple[str, dict[str, Any]]:
    side = cfg.target_size
    s_run, g_run = single[side], grid22[side]
    s_rank = s_run["ranks"][0]
    rows = []
    for step in (0, 1):
        s_growth = _growth_kib(s_rank, side, step) * KIB
        per_rank = [_growth_kib(r, side, step) * KIB for r in g_run["ranks"]]
        rows.append(
            [
                "1 (fresh process)" if step == 0 else "2 (steady state)",
                _mib(s_growth),
                " / ".join(_mib(v) for v in per_rank),
                f"{max(per_rank) / s_growth:.3f}",
            ]
        )
    _table(
        f"1. Peak RSS growth of one training step, {side}x{side}, batch 1, ResNet-50 (MiB)",
        ["step", "1 process", "2x2 ranks 0/1/2/3", "max rank / 1 process"],
        rows,
    )
    ratio = max(_growth_kib(r, side, 0) for r in g_run["ranks"]) / _growth_kib(s_rank, side, 0)
    info: dict[str, Any] = {"ratio": ratio}
    # Where the difference from the ideal 1/4 goes.
    if "saved_bytes" in s_rank and "saved_bytes" in g_run["ranks"][0]:
        s_saved, g_saved = s_rank["saved_bytes"], g_run["ranks"][0]["saved_bytes"]
        # one row per layer kind: SpatialConv2d is counted with Conv2d
        merged: dict[str, list[int]] = {}
        for k, v in s_saved.items():
            if k != "(parameters)":
                merged.setdefault(k.replace("Spatial", ""), [0, 0])[0] += v
        for k, v in g_saved.items():
            if k != "(parameters)":
                merged.setdefault(k.replace("Spatial", ""), [0, 0])[1] += v
        rows = [
            [k, _mib(a), _mib(g), f"{g / a:.3f}" if a else "-"]
            for k, (a, g) in sorted(merged.items(), key=lambda kv: -kv[1][0])
            if a or g
        ]
        tot_s = sum(a for a, _ in merged.values())
        tot_g = sum(g for _, g in merged.values())
        rows.append(["total saved activations", _mib(tot_s), _mib(tot_g), f"{tot_g / tot_s:.3f}"])
        _table(
            "   Tensors autograd saves for backward, by layer kind (MiB; rank 0 of 2x2)",
            ["layer kind", "1 process", "2x2 rank", "ratio"],
            rows,
        )
        param_bytes = s_rank["param_bytes"]
        s_growth = _growth_kib(s_rank, side, 0) * KIB
        g_growth = _growth_kib(g_run["ranks"][0], side, 0) * KIB
        replicated = 2 * param_bytes  # gradients + momentum, on every rank
        rows = [
            ["gradients + SGD momentum (replicated)", _mib(replicated), _mib(replicated)],
            ["saved activations", _mib(tot_s), _mib(tot_g)],
            ["rest (transients, halo buffers, allocator)", _mib(s_growth - replicated - tot_s), _mib(g_growth - replicated - tot_g)],
            ["step-1 peak growth", _mib(s_growth), _mib(g_growth)],
        ]  # fmt: skip
        _table("   Breakdown of the step-1 peak (MiB)", ["part", "1 process", "2x2 rank 0"], rows)
        info.update(saved_single=tot_s, saved_rank=tot_g, replicated=replicated)
        info["ratio_without_replicated"] = (g_growth - replicated) / (s_growth - replicated)
    line = _verdict(
        f"per-rank memory 2x2 vs 1 process at {side}^2",
        ratio <= TARGET_MEM_RATIO,
        f"ratio {ratio:.3f} (target <= {TARGET_MEM_RATIO}, ideal 0.25)",
        quick,
    )
    return line, info


def _report_time(
    t_single: list[dict[str, Any]], t_grid: list[dict[str, Any]], cfg: Config, quick: bool
) -> tuple[str, dict[str, Any]]:
    def best(runs: list[dict[str, Any]]) -> dict[str, float]:
        """Per step: slowest rank's wall parts and the ranks' summed CPU; best step over runs."""
        steps = []
        for run in runs:
            per_rank = [r["time"]["steps"] for r in run["ranks"]]
            for k in range(len(per_rank[0])):
                parts = [pr[k] for pr in per_rank]
                slowest = max(parts, key=lambda p: p["wall_s"])
                steps.append({**slowest, "cpu_sum_s": sum(p["cpu_s"] for p in parts)})
        return min(steps, key=lambda p: p["wall_s"])

    one, two = best(t_single), best(t_grid)
    eff = one["wall_s"] / (2 * two["wall_s"])
    cpu_eff = one["cpu_sum_s"] / two["cpu_sum_s"]
    rows = [
        [k.removesuffix("_s"), f"{one[k]:.2f}", f"{two[k]:.2f}"]
        for k in ("forward_s", "backward_s", "grad_reduce_s", "optimizer_s", "wall_s", "cpu_sum_s")
    ]
    _table(
        f"2. Seconds per training step, ResNet-50 {cfg.time_image}x{cfg.time_image}, batch 1, "
        f"1 thread per rank (best of {cfg.time_steps * cfg.repeats} steps)",
        ["part", "1 process", "1x2 grid (slowest rank)"],
        rows,
    )
    print(f"   parallel efficiency T1/(2*T2) = {eff:.3f}; CPU-time efficiency = {cpu_eff:.3f}")
    line = _verdict(
        f"parallel efficiency 1x2 grid on 2 cores at {cfg.time_image}^2",
        eff >= TARGET_EFFICIENCY,
        f"{eff:.3f} (target >= {TARGET_EFFICIENCY})",
        quick,
    )
    return line, {"efficiency": eff, "cpu_efficiency": cpu_eff, "single": one, "grid": two}


def _halo_rows(label: str, run: dict[str, Any], part: str, side: int) -> tuple[list[str], bool]:
    grid = (int(run["grid"][0]), int(run["grid"][1]))
    want = analytic_halo_bytes("resnet50", grid, side)
    got = []
    for r in run["ranks"]:
        rec = r["mem"][str(side)] if part == "mem" else r["time"]
        n = rec["halo_steps"]
        b, m = rec["halo"]["bytes"], rec["halo"]["messages"]
        # per step; a count that is not a whole multiple of the steps is a mismatch
        got.append(
            {
                "forward": b.get("forward", 0) / n,
                "backward": b.get("backward", 0) / n,
                "forward_msgs": m.get("forward", 0) / n,
                "backward_msgs": m.get("backward", 0) / n,
            }
        )
    equal = all(g[k] == w[k] for g, w in zip(got, want, strict=True) for k in w)
    tot = {k: sum(g[k] for g in got) for k in ("forward", "backward")}
    tot_w = {k: sum(w[k] for w in want) for k in ("forward", "backward")}
    row = [
        f"{label} {side}^2",
        f"{tot['forward']:,.0f}",
        f"{tot_w['forward']:,}",
        f"{tot['backward']:,.0f}",
        f"{tot_w['backward']:,}",
        f"{sum(g['forward_msgs'] + g['backward_msgs'] for g in got):,.0f}",
        "EQUAL" if equal else "DIFFERENT",
    ]
    return row, equal


# ---------------------------------------------------------------- main


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_spatial.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  python benchmarks/bench_spatial.py            # full run, about 4 min on 2 cores\n"
            "  python benchmarks/bench_spatial.py --quick    # small sizes, about 40 s\n"
            "  python benchmarks/bench_spatial.py --json out.json   # also keep the raw numbers\n"
        ),
    )
    p.add_argument("--quick", action="store_true", help="small images, fewer steps (indicative)")
    p.add_argument("--json", type=Path, help="write every raw measurement to this file")
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds allowed per run (default: %(default)s)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    cfg = QUICK if args.quick else DEFAULT
    t_start = time.perf_counter()
    load_before = _loadavg()
    print(
        f"bench_spatial: {'quick' if args.quick else 'full'} run, {os.cpu_count()} CPUs, "
        f"load average {load_before:.2f}",
        file=sys.stderr,
    )
    run = lambda n, grid, extra: _run_worker(n, grid, extra, timeout_s=args.timeout)  # noqa: E731
    sizes = cfg.mem_sizes
    single: dict[int, Any] = {}
    grid22: dict[int, Any] = {}
    t_single: list[dict[str, Any]] = []
    t_grid: list[dict[str, Any]] = []
    timing = ["--time-image", str(cfg.time_image), "--warmup", str(cfg.warmup), "--time-steps", str(cfg.time_steps)]  # fmt: skip
    if args.quick:  # one process per layout for all sizes: startup dominates at these sizes
        csv = ",".join(map(str, sizes))
        r = run(1, "1x1", ["--images", csv, "--saved", *timing])
        single, t_single = dict.fromkeys(sizes, r), [r]
        r = run(4, "2x2", ["--images", csv, "--saved", "--count-halo"])
        grid22 = dict.fromkeys(sizes, r)
        t_grid.append(run(2, "1x2", [*timing, "--mem-steps", "0", "--count-halo"]))
    else:
        for side in sizes:
            saved = ["--saved"] if side == cfg.target_size else []
            single[side] = run(1, "1x1", ["--images", str(side), *saved])
            grid22[side] = run(4, "2x2", ["--images", str(side), "--count-halo", *saved])
        for _ in range(cfg.repeats):  # alternate, so that a busy moment hits both layouts alike
            t_single.append(run(1, "1x1", [*timing, "--mem-steps", "0"]))
            t_grid.append(run(2, "1x2", [*timing, "--mem-steps", "0", "--count-halo"]))
    load_after = _loadavg()

    print(f"\nbench_spatial ({'quick' if args.quick else 'full'}): ratios against one process, "
          f"1 thread per rank, load average {load_before:.2f} before / {load_after:.2f} after")  # fmt: skip
    verdicts = []
    line, mem_info = _report_memory(single, grid22, cfg, args.quick)
    verdicts.append(line)
    line, time_info = _report_time(t_single, t_grid, cfg, args.quick)
    verdicts.append(line)

    rows, all_equal = [], True
    for side in sizes:
        row, ok = _halo_rows("2x2", grid22[side], "mem", side)
        rows.append(row)
        all_equal &= ok
    row, ok = _halo_rows("1x2", t_grid[0], "time", cfg.time_image)
    rows.append(row)
    all_equal &= ok
    _table(
        "3. Halo bytes per training step, all ranks (measured in _exchange vs analytic)",
        [
            "grid, image",
            "fwd measured",
            "fwd analytic",
            "bwd measured",
            "bwd analytic",
            "messages",
            "check",
        ],
        rows,
    )
    line = f"{'PASS' if all_equal else 'FAIL'}  halo bytes per rank, forward and backward: measured {'==' if all_equal else '!='} analytic"
    print(line)
    verdicts.append(line)

    budget = cfg.ram_gib * GIB
    fits: dict[str, Any] = {}
    rows = []
    for label, runs, align in (("1 process", single, 1), ("2x2 (sum of 4 ranks)", grid22, 64)):
        points = [(float(s * s), float(_peak_total_bytes(runs[s], s))) for s in sizes]
        a, b = _fit(points)
        side = int(math.sqrt((budget - a) / b)) // align * align
        worst = max(abs(y - (a + b * x)) / y for x, y in points)
        fits[label] = {"a": a, "b": b, "side": side, "points": points, "max_residual": worst}
        rows.append(
            [
                label,
                " / ".join(f"{s}:{_mib(y)}" for s, (_, y) in zip(sizes, points, strict=True)),
                f"{a / GIB:.2f} + {b * 1e6 / GIB:.3f}e-6*px",
                f"{worst:.1%}",
                f"{side}",
            ]
        )
    _table(
        f"4. Largest square image for one training step in {cfg.ram_gib:g} GiB of RAM "
        "(EXTRAPOLATED from the measured points by a linear fit)",
        [
            "layout",
            "measured peak MiB (side:MiB)",
            "fit GiB",
            "max residual",
            f"side at {cfg.ram_gib:g} GiB",
        ],
        rows,
    )
    s1, s4 = fits["1 process"]["side"], fits["2x2 (sum of 4 ranks)"]["side"]
    print(f"   pixel ratio 2x2 / 1 process = {(s4 * s4) / (s1 * s1):.2f} (extrapolated)")
    print("\n" + "\n".join(verdicts))
    print(f"\nbench_spatial: {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    if args.json:
        raw = {
            "config": cfg.__dict__,
            "load": [load_before, load_after],
            "single": {str(k): v for k, v in single.items()},
            "grid22": {str(k): v for k, v in grid22.items()},
            "time_single": t_single,
            "time_grid12": t_grid,
            "memory": mem_info,
            "time": time_info,
            "fits": fits,
            "verdicts": verdicts,
        }
        args.json.write_text(json.dumps(raw, indent=1))
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
