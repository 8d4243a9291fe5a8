"""Memory measures against their time: what each one saves per rank, and what it costs.

Why: the planner turns on banded backward, full or deep checkpointing and the streamed stem only
where a layout does not fit without them (issue 19, item 4), so a user needs both sides of
each measure, measured side by side: how much of a rank's peak it removes and how much
longer the step takes. One layout (default: ResNet-50 on a 1x2 grid at 768², batch 1, one
thread per rank), each measure in fresh processes (``spatial_worker.py`` under ``mpiexec``,
the ranks' allocator as ``hyfi-train`` sets it up):

* ``none``: the layout as it trains by default;
* ``bands``: banded backward (``parallel.backward_bands``);
* ``full``: full activation checkpointing (every block recomputed in backward);
* ``full + stem``: and the stem streamed in bands of rows (``parallel.streaming: stem``);
* ``full + stem + bands``: all three;
* ``deep + stem``: deep checkpointing (``parallel.checkpointing: deep``: every block, and in
  the first two layers of several blocks the blocks' inputs computed again, the blocks in units)
  with the stem streamed.

Memory is the largest rank's peak resident set over a step above the RSS the step started
with (its second step, with the optimizer's state); time is the slowest rank's wall time of
a step (best of ``--steps`` after a warm-up) and its CPU time. The figures are printed as
ratios to ``none``, with the MiB saved per second added. Deep halos trade messages, not
memory: ``bench_deep_halo.py`` measures them.

Beside each, ``hyfi-plan``'s predicted per-rank peak for the same candidate (the planner picks
a measure only where its prediction says the layout needs it). Verdict: PASS when the
measurement agrees with the planner on every measure: where it predicts a lower peak (by
more than 2 %), the measured peak is lower; where it predicts none, the measured peak moves
by at most 5 %. The time each costs is reported, not judged.

Examples::

    python benchmarks/bench_tradeoffs.py                      # ResNet-50 1x2 768², ~3 min
    python benchmarks/bench_tradeoffs.py --size 512 --grid 2x2
    python benchmarks/bench_tradeoffs.py --quick              # ResNet-18 x0.25 at 128², smoke
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from bench_spatial import _loadavg, _run_worker, _timed_steps

#: name: (checkpointing, streaming, backward bands)
MEASURES: dict[str, tuple[str, str, bool]] = {
    "none": ("none", "none", False),
    "bands": ("none", "none", True),
    "full": ("full", "none", False),
    "full + bands": ("full", "none", True),
    "full + stem": ("full", "stem", False),
    "full + stem + bands": ("full", "stem", True),
    "deep + stem": ("deep", "stem", False),
}
PREDICTED_GAIN, UNMOVED = 0.98, 0.05
MIB = 1024 * 1024


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--grid", default="1x2", help="tile grid GYxGX (default 1x2)")
    p.add_argument("--size", type=int, default=768, help="square image side (default 768)")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--width", type=float, default=None, help="model width multiplier")
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    p.add_argument("--quick", action="store_true", help="ResNet-18 x0.25 at 128^2: a smoke run")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    args = p.parse_args(argv)
    try:
        grid = [int(v) for v in args.grid.lower().split("x")]
    except ValueError:
        grid = [0]
    if len(grid) != 2 or min(grid) < 1:
        p.error(f"--grid {args.grid!r}: give the tile grid as GYxGX, e.g. 1x2")
    for name in ("size", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: give a whole number >= 1")
    if not args.timeout > 0:
        p.error(f"--timeout {args.timeout}: give seconds > 0")
    return args


def _peak_above(run: dict[str, Any], side: int) -> float:
    """The largest rank's peak over its second step above the RSS that step started with."""
    peaks = []
    for r in run["ranks"]:
        step = r["mem"][str(side)]["steps"][-1]
        peaks.append(step["peak_kib"] - step["rss_before_kib"])
    return float(max(peaks)) * 1024


def _flags(ck: str, streaming: str, bands: bool) -> list[str]:
    return ["--checkpointing", ck, "--streaming", streaming] + (
        ["--backward-bands"] if bands else []
    )


def _predicted(args: argparse.Namespace) -> dict[str, float]:
    """The planner's per-rank peak (bytes) of each measure on this layout."""
    from hyfi_imaging.models import create_model
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.parallel.plan import Candidate, predict

    kwargs = {} if args.width is None else {"width": args.width}
    model = create_model(args.model, num_classes=2, **kwargs)
    grid = Layout.parse_grid(args.grid)
    out = {}
    for name, (ck, streaming, bands) in MEASURES.items():
        cand = Candidate(Layout(sp=grid), 1, ck, "gpipe", streaming=streaming, backward_bands=bands)
        out[name] = predict(model, (args.size, args.size), 1, cand).peak
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.quick:
        args.model, args.width, args.size, args.steps = "resnet18", 0.25, 128, 1
    from hyfi_imaging.errors import ConfigError
    from hyfi_imaging.parallel.layout import Layout

    try:
        ranks = math.prod(Layout.parse_grid(args.grid))
    except ConfigError as err:
        print(f"bench_tradeoffs: error: {err}", file=sys.stderr)
        return 2
    model = ["--model", args.model] + ([] if args.width is None else ["--width", str(args.width)])
    side = str(args.size)
    common = [*model, "--images", side, "--mem-steps", "2", "--time-image", side]
    common += ["--warmup", "1", "--time-steps", str(args.steps)]
    t_start, load_before = time.perf_counter(), _loadavg()
    print(f"bench_tradeoffs: {args.model} {args.grid} {args.size}^2, load average "
          f"{load_before:.2f}", file=sys.stderr)  # fmt: skip
    results: dict[str, dict[str, float]] = {}
    predicted = _predicted(args)
    for name, measure in MEASURES.items():
        flags = _flags(*measure)
        run = _run_worker(ranks, args.grid, [*common, *flags], timeout_s=args.timeout, env_extra={})
        best = min(_timed_steps([run]), key=lambda s: s["wall_s"])
        results[name] = {
            "peak": _peak_above(run, args.size),
            "wall": best["wall_s"],
            "cpu": best["cpu_max_rank_s"],
        }
    base = results["none"]
    print(f"\nbench_tradeoffs: {args.model} {args.grid} {args.size}^2, batch 1, one thread per "
          f"rank; load average {load_before:.2f} before / {_loadavg():.2f} after")  # fmt: skip
    print(f"  {'measure':>19s}  {'peak MiB':>9s} {'x none':>7s}  {'planner x none':>14s}  "
          f"{'step s':>7s} {'x none':>7s}  {'CPU s':>6s}  {'MiB saved per s':>15s}")  # fmt: skip
    disagree = []
    for name, r in results.items():
        saved = (base["peak"] - r["peak"]) / MIB
        extra = r["wall"] - base["wall"]
        rate = "-" if name == "none" else (f"{saved / extra:.0f}" if extra > 0 else "free")
        measured, planned = r["peak"] / base["peak"], predicted[name] / predicted["none"]
        print(f"  {name:>19s}  {r['peak'] / MIB:>9.0f} {measured:>7.3f}  {planned:>14.3f}  "
              f"{r['wall']:>7.2f} {r['wall'] / base['wall']:>7.3f}  {r['cpu']:>6.2f}  "
              f"{rate:>15s}")  # fmt: skip
        agrees = measured < 1 if planned < PREDICTED_GAIN else abs(measured - 1) <= UNMOVED
        if not agrees:
            disagree.append(f"{name} (measured {measured:.3f}x, planner {planned:.3f}x)")
    verdict = "QUICK" if args.quick else "MISS" if disagree else "PASS"  # a smoke run: not judged
    smallest = min(results, key=lambda k: results[k]["peak"])
    line = (
        f"{verdict}  measured peaks agree with the planner's on every measure"
        + (f" except {', '.join(disagree)}" if disagree else "")
        + f"; the lowest: {smallest} at {results[smallest]['peak'] / base['peak']:.3f}x the "
        f"peak for {results[smallest]['wall'] / base['wall']:.2f}x the step time"
    )
    print("\n" + line)
    print(f"\nbench_tradeoffs: {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
