"""``hyfi-plan``: which layout fits, and which is fastest, before any rank allocates.

Predicts each candidate layout's per-rank peak memory (activations,
gradients and optimizer state, gathered parameters, buffers) and step time
from a meta-device trace of the model (see :mod:`hyfi_imaging.parallel.plan`)
on a device of the speed model's table (:mod:`hyfi_imaging.parallel.speed`:
``--device h100``, ...; by default this machine's GPU, else this CPU, measured -- but
with ``--device-memory`` alone no device, and no step time), ranks them, and prints
the recipe lines of the best one that fits. The model is traced once per tile shape
(:mod:`hyfi_imaging.parallel.model_trace`): ResNet-50 on 8 devices, 241 layouts, in
seconds, with its progress on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hyfi_imaging.cli.options import (
    memory_size,
    nonnegative_float,
    positive_float,
    positive_int,
    size_type,
)
from hyfi_imaging.errors import ConfigError, HyfiError

#: Rows of the speed model's device table (kept here so that --help needs no torch import).
DEVICE_NAMES = ("v100", "a100-40gb", "a100-80gb", "h100", "h200", "mi300a")

EXAMPLES = """\
examples:
  # the layouts of 8 H100s (one node) for ResNet-50 on 16384^2 images
  hyfi-plan --model resnet50 --image-size 16384 --devices 8 --device h100

  # 64 A100s, 4 per node, on a slower fabric than the table's
  hyfi-plan --model resnet50 --image-size 8192 --devices 64 --device a100-80gb \
      --gpus-per-node 4 --inter-bw 12.5GB --inter-latency 15e-6

  # a recipe's own layout and its alternatives on as many ranks (same --set as hyfi-train)
  hyfi-plan recipes/synthetic.yaml --set parallel.spatial=1x2 --device-memory 2GiB

  # two mirrored replicas (GEMS) on the recipe's pipeline, and its alternatives
  hyfi-plan recipes/synthetic.yaml --set parallel.pipeline=2 --set parallel.microbatches=2 \
      --set parallel.schedule=bidirectional

  # per-stage grids (the junction) are ranked too; a recipe's own is evaluated
  hyfi-plan recipes/synthetic.yaml --set parallel.pipeline=3 \
      --set parallel.spatial=2x2,1x2,1x1 --set parallel.microbatches=4

  # let hyfi-train pick the layout itself
  mpirun -np 4 hyfi-train recipes/synthetic.yaml --set parallel=auto

Memory is the peak over what a rank holds once its model is built; it was
within 9 % of measured peaks on 10 of the 11 layouts of tests/test_plan_mpi.py
(CPU) and 22 % under on the smallest: it counts tensors, not the runtime's own memory.
Devices (--device): v100, a100-40gb, a100-80gb, mi300a (datasheet figures x a
stated efficiency), h100, h200 (compute measured on an H200, in the model's
layout), cpu (this CPU, measured once and cached). With
--device-memory and no device (and no GPU here), step times are not predicted.
Step times rank layouts; they are not wall-time promises.
Exit status: 0 a layout fits, 1 none fits, 2 bad arguments.
"""

#: Printed under the table: what each column is, and which parts are not calibrated.
LEGEND = """\
peak: the busiest rank's predicted peak over its built model (act = activations in flight plus
the backward's working set; state = gradients, optimizer state, gathered parameters). Ranks of
bidirectional, interleaved1f1b, zbv and dualpipev hold two model stages: both stages' state and
the activations their order keeps in flight. Measured on CPU (tests/test_plan_mpi.py): within
9 % on 10 of 11 layouts (bidirectional -1.4 %, zbv -8.6 %); 22 % under on 2x2 with full
checkpointing and the streamed stem, where the runtime's own memory (not counted: Python,
oneDNN, Gloo; on a GPU the CUDA context and NCCL) is a fifth of a small peak; dualpipev -20 %
in the case measured. Leave a margin. Per-stage
grids (sp2x2,1x2,1x1, the junction): each stage on its own grid; the busiest (front) rank
within 1 %, later stages up to 14 % lower. With bidirectional, two mirrored replicas of the
junction take more ranks than its grids (sp1x2,1x1: 4): such rows appear where they fill
--devices (their peak within 1 % on 1x2,1x1). "recommended" lists every pipeline rank's peak.
ckpt full+stem: every block checkpointed and the stem streamed in row bands (parallel.streaming);
deep+stem: and in the first two layers of several blocks the inputs of blocks computed again, blocks
in units (parallel.checkpointing: deep: less memory than full+stem for more forwards of them);
+bands: each convolution's backward in bands of rows (parallel.backward_bands: less memory,
more kernel calls; offered with full checkpointing on tiles, chosen only where it is needed to fit);
+halo2: a recipe's parallel.halo_depth (its runs' deeper borders counted; never picked here).
step s / bubble: the schedule's own order replayed; a stage's forward and backward are each
layer's counted FLOPs at the device's rate (each convolution call's fixed cost included),
its other ops' bytes at its memory bandwidth and its kernel launches, plus halo exchanges,
BatchNorm statistics and stage-to-stage messages (latency + bytes over NVLink within a node,
InfiniBand across), then FSDP2 and bidirectional mirror traffic where the runtime does not
overlap them. comm %: the share of the step spent waiting on messages. On this CPU within
20 % of measured CPU time for one process (benchmarks/bench_speed_model.py); the spatial
path measured slower than its counts there, and GPU figures are datasheet peaks x an
efficiency, not calibrated against a GPU run: it ranks layouts, it does not promise wall time."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hyfi-plan",
        description="Predict per-rank peak memory and step time of candidate layouts "
        "(spatial grid or per-stage grids, pipeline stages and schedule, data replicas, "
        "micro-batches, checkpointing) "
        "and recommend one.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("recipe", type=Path, nargs="?", help="recipe YAML (or use --model)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe value, as hyfi-train")  # fmt: skip
    p.add_argument("--model", help="registered model name or module:function (instead of a recipe)")
    p.add_argument("--width", type=float, help="model width multiplier")
    p.add_argument("--num-classes", type=int, help="(with --model; default 2)")
    p.add_argument("--image-size", type=size_type(1), help="N or HxW (with --model)")
    p.add_argument("--devices", type=positive_int, help="ranks (default: the recipe's world size)")
    p.add_argument(
        "--batch", type=positive_int, help="images per replica per step (default 1 / recipe)"
    )
    p.add_argument("--optimizer", choices=("sgd", "adamw"), help="(default sgd / recipe)")
    p.add_argument("--device-memory", type=memory_size, help="per device, e.g. 80GiB "
                   "(default: this machine's GPU, else its RAM over the ranks)")  # fmt: skip
    p.add_argument("--device", dest="device_name", metavar="NAME",
                   help="a row of the device table: " + ", ".join((*DEVICE_NAMES, "cpu"))
                   + "; cuda: this machine's GPU, its figures measured (a few seconds, cached)"
                   + " (default: this machine's GPU's table row if the table has it, else this "
                   "CPU)")  # fmt: skip
    p.add_argument("--rate", "--flops", dest="rate", type=positive_float,
                   help="sustained FLOP/s per device (default: the device's)")  # fmt: skip
    p.add_argument("--mem-bw", type=memory_size, help="bytes/s of memory-bound ops")
    p.add_argument("--link-bw", "--bandwidth", dest="link_bw", type=memory_size,
                   help="bytes/s per direction between ranks of a node (NVLink)")  # fmt: skip
    p.add_argument(
        "--link-latency", type=nonnegative_float, help="seconds per message within a node"
    )
    p.add_argument("--inter-bw", type=memory_size,
                   help="bytes/s per GPU across nodes (InfiniBand)")  # fmt: skip
    p.add_argument(
        "--inter-latency", type=nonnegative_float, help="seconds per message across nodes"
    )
    p.add_argument("--gpus-per-node", type=positive_int, help="devices per node")
    p.add_argument("--overlap", action="store_true",
                   help="as parallel.overlap: halos travel while a layer's interior computes")  # fmt: skip
    p.add_argument("--top", type=positive_int, default=12, help="rows to show (default 12)")
    return p


def choose_device(args: argparse.Namespace, model: Any = None) -> Any:
    """The speed model's device, with the figures given on the command line replacing its own.

    ``--device`` names a row of the table (or ``cpu``); without it, this machine's GPU if the
    table has it, else this CPU -- unless ``--device-memory`` says the plan is for devices that
    are not here: then there is no device (None), and CPU-calibrated step times would only
    pass for a GPU plan's (the README's example printed "step s 2.6e+04" for 80 GiB devices).
    ``model``: the model planned; ``--device cuda`` measures the GPU in its layout.
    """
    import torch

    from hyfi_imaging.models.memory_format import model_layout
    from hyfi_imaging.parallel.devices import Link, get_device, table_key

    name = args.device_name
    if name is None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_properties(0)
        name = table_key(gpu.name, gpu.total_memory)
    if name is None and args.device_memory is not None:
        return None  # devices of some memory, elsewhere: no figures to time them with
    # --device cuda measures the GPU in the model's layout (a recipe's model.memory_format)
    dev = get_device(
        name or "cpu", channels_last=model is not None and model_layout(model) is not None
    )
    intra = Link(
        args.link_bw or dev.intra.bandwidth,
        dev.intra.latency if args.link_latency is None else args.link_latency,
    )
    inter = Link(
        args.inter_bw or dev.inter.bandwidth,
        dev.inter.latency if args.inter_latency is None else args.inter_latency,
    )
    return dev.with_(
        flops=args.rate, mem_bw=args.mem_bw, per_node=args.gpus_per_node, intra=intra, inter=inter
    )


def _unnamed_device(args: argparse.Namespace) -> Any:
    """The device that ranks layouts when none is named (see :func:`choose_device`): the
    nominal device of :func:`~.parallel.plan.nominal_device` (counted FLOPs and bytes sent;
    memory-bound work, launches and latencies cost nothing) at ``--rate`` (else 1e12 FLOP/s)
    and ``--link-bw`` (else 10 GB/s). Its step times are shown only when ``--rate`` gives one."""
    from hyfi_imaging.parallel.plan import nominal_device

    return nominal_device(args.rate or 1e12, args.link_bw or 10e9)


def _gib(n: float) -> str:
    """GiB to two decimals, below 1 GiB to three significant digits (a small plan's 4 MiB
    peak printed as 0.00)."""
    v = n / 2**30
    return f"{v:.2f}" if v >= 1 or v == 0 else f"{v:.3g}"


def grids_text(layout: Any, sep: str = ",") -> str:
    """``2x2`` for one grid, ``2x2,1x2,1x1`` for per-stage grids (the junction)."""
    grids = layout.grids or (layout.sp,)
    return sep.join("x".join(map(str, g)) for g in grids)


def recipe_lines(cand: Any, balance: tuple[int, ...]) -> str:
    """The ``parallel:`` block of a recipe for ``cand``."""
    lay = cand.layout
    spatial = f"[{grids_text(lay, ', ')}]" if lay.junction else grids_text(lay)
    lines = [
        "parallel:",
        f"  spatial: {spatial}",
        f"  pipeline: {lay.pp}",
        f"  data: {lay.dp}",
        f"  microbatches: {cand.microbatches}",
        f"  schedule: {cand.schedule}",
        f"  checkpointing: {cand.checkpointing}",
    ]
    if lay.br > 1:
        lines.insert(4, f"  branches: {lay.br}")
    if cand.streaming != "none":
        lines.append(f"  streaming: {cand.streaming}")
    if cand.backward_bands:
        lines.append("  backward_bands: true")
    if lay.pp > 1:
        lines.append(f"  balance: [{', '.join(map(str, balance))}]")
    return "\n".join(lines)


def _ckpt_text(c: Any) -> str:
    """The checkpointing column: the mode, ``+stem`` (streamed stem), ``+bands`` (banded
    backward), ``+haloN`` (a recipe's deep halos)."""
    return (
        c.checkpointing
        + ("+stem" if c.streaming == "stem" else "")
        + ("+bands" if c.backward_bands else "")
        + (f"+halo{c.halo_depth}" if c.halo_depth > 1 else "")
    )


def _inputs(args: argparse.Namespace) -> tuple[Any, tuple[int, int], int, int, str, Any, Any]:
    """(model, image size, devices, batch, optimizer, the recipe's own candidate or None, and
    the check of a layout against the recipe's cohort that training applies, or None)."""
    from hyfi_imaging.models import create_model
    from hyfi_imaging.parallel.plan import Candidate

    given = [f"--{k.replace('_', '-')}" for k in ("model", "width", "num_classes")
             if getattr(args, k) is not None]  # fmt: skip
    if args.recipe is not None and given:  # they would be ignored: the recipe's model is planned
        raise ConfigError(
            f"hyfi-plan {args.recipe} {' '.join(given)}",
            "plans the recipe's model; the model options describe one without a recipe",
            "leave them out, or change the recipe's model with --set model.name=... "
            "(--set model.kwargs.width=...)",
        )
    if args.recipe is not None:
        from hyfi_imaging.train.autoplan import cohort_check, slide_size
        from hyfi_imaging.train.config import load_recipe
        from hyfi_imaging.train.inputs import build_model, data_pixels
        from hyfi_imaging.train.preflight import plan_of

        r = load_recipe(args.recipe, args.overrides)
        hw = args.image_size or slide_size(r, f"hyfi-plan {args.recipe}")
        try:  # the data's channel count when the manifest is at hand (else the model's own)
            channels: int | None = data_pixels(r).channels
        except ConfigError:
            if args.image_size is None:
                raise
            channels = None
        # What training refuses for the cohort (without a manifest at hand: nothing known).
        check = cohort_check(r, args.batch) if channels is not None else None
        model = build_model(r, channels)
        own = Candidate.of(plan_of(r.parallel, r.parallel.layout()))
        devices = args.devices or own.world_size
        return (
            model,
            hw,
            devices,
            args.batch or r.train.batch_size,
            args.optimizer or r.optim.name,
            own,
            check,
        )
    if not args.model or not args.image_size or not args.devices:
        raise ConfigError(
            "hyfi-plan", "needs a recipe, or --model, --image-size and --devices",
            "see hyfi-plan --help for examples",
        )  # fmt: skip
    kwargs: dict[str, Any] = {"num_classes": args.num_classes or 2}
    if args.width is not None:
        kwargs["width"] = args.width
    model = create_model(args.model, **kwargs)
    return (
        model,
        args.image_size,
        args.devices,
        args.batch or 1,
        args.optimizer or "sgd",
        None,
        None,
    )


def _predict_all(
    model: Any,
    hw: tuple[int, int],
    batch: int,
    todo: list[Any],
    *,
    optimizer: str,
    dev: Any,
    overlap: bool,
    left_out: list[str],
) -> list[Any]:
    """Every candidate's prediction, with a progress bar on a terminal and a line before and
    after on stderr. A candidate the model or image cannot take (a HyfiError, which names
    why) is left out and said in ``left_out``; any other error is a bug and propagates."""
    import time

    from tqdm import tqdm

    from hyfi_imaging.parallel.plan import predict

    began = time.perf_counter()
    print(f"hyfi-plan: ranking {len(todo)} layouts of {type(model).__name__} on "
          f"{hw[0]}x{hw[1]} ...", file=sys.stderr, flush=True)  # fmt: skip
    preds = []
    with tqdm(todo, unit="layout", desc="hyfi-plan", file=sys.stderr,
              disable=not sys.stderr.isatty()) as bar:  # fmt: skip
        for cand in bar:
            try:
                preds.append(predict(model, hw, batch, cand, optimizer=optimizer,
                                     device=dev, overlap=overlap))  # fmt: skip
            except HyfiError as err:
                left_out.append(f"{cand.describe()}: {err}")
    print(f"hyfi-plan: ranked {len(preds)} layouts in {time.perf_counter() - began:.1f} s",
          file=sys.stderr, flush=True)  # fmt: skip
    return preds


def _unmodelled(args: argparse.Namespace) -> list[str]:
    """What of a recipe's layout the memory model does not count, with what it was measured to
    add (``tests/mpi/plan_accuracy.py``'s method, 2026-11-29): said, not left to surprise."""
    if args.recipe is None:
        return []
    from hyfi_imaging.train.config import load_recipe

    r = load_recipe(args.recipe, args.overrides)
    p, notes = r.parallel, []
    tiled = any(g > 1 for g in p.spatial)
    if tiled and r.model.memory_format == "channels_last":
        notes.append(
            "the peaks do not count channels-last tiles' layout copies: measured 12-16 % "
            "above them (ResNet-18 x0.25 on 1x2 and 2x2); leave that margin"
        )
    return notes


def run(args: argparse.Namespace) -> int:
    what = args.recipe or args.model
    print(f"hyfi-plan: building {what} and listing its layouts ...", file=sys.stderr, flush=True)
    from hyfi_imaging.parallel.candidates import candidates, device_memory, rank

    model, hw, devices, batch, optimizer, own, cohort_check = _inputs(args)
    for note in _unmodelled(args):
        print(f"hyfi-plan: note: {note}", file=sys.stderr, flush=True)
    dev = choose_device(args, model)
    timed = dev is not None or args.rate is not None  # step times from figures, not invented
    if dev is None:
        dev = _unnamed_device(args)
        memory = args.device_memory
    else:
        on_cpu = dev.name.startswith("this CPU")
        memory = args.device_memory or (device_memory(devices) if on_cpu else dev.memory)
    todo = list(candidates(model, hw, devices, batch))
    refused: list[str] = []
    if cohort_check is not None:  # what training would refuse for this cohort is not offered
        kept = []
        for c in todo:
            try:
                cohort_check(c.layout)
                kept.append(c)
            except ConfigError as err:
                refused.append(str(err))
        todo = kept
    if own is not None and own not in todo:
        todo.insert(0, own)
    left_out: list[str] = []
    preds = _predict_all(model, hw, batch, todo, optimizer=optimizer, dev=dev,
                         overlap=args.overlap, left_out=left_out)  # fmt: skip
    ranked = rank(preds, memory)
    name = type(model).__name__
    if not timed:
        device_text = (
            "step time NOT PREDICTED: no device named (--device h100, a100-80gb, ... or --rate); "
            "layouts that fit are ranked by counted FLOPs and bytes sent at a nominal rate"
        )
    elif dev.name == "nominal":
        device_text = (
            f"device unnamed: --rate {dev.flops:.3g} FLOP/s, links {dev.intra.bandwidth / 1e9:.3g} "
            "GB/s (FLOPs and bytes sent only)"
        )
    else:
        device_text = (
            f"device {dev.name}: {dev.flops / 1e12:.3g} TFLOP/s sustained ({dev.dtype}), "
            f"{dev.mem_bw / 1e9:.0f} GB/s, links {dev.intra.bandwidth / 1e9:.3g} GB/s + "
            f"{dev.intra.latency * 1e6:.0f} us within {dev.per_node} per node, "
            f"{dev.inter.bandwidth / 1e9:.3g} GB/s + {dev.inter.latency * 1e6:.0f} us across"
        )
    print(
        f"hyfi-plan: {name} on {hw[0]}x{hw[1]}, {devices} device(s) of {_gib(memory)} GiB, "
        f"batch {batch} per replica, {optimizer}, {len(preds)} layouts; {device_text}"
    )
    if refused:
        print(f"hyfi-plan: {len(refused)} layouts left out, which training refuses for this "
              f"cohort (e.g. {refused[-1]})")  # fmt: skip
    if left_out:
        print(f"hyfi-plan: {len(left_out)} layouts left out, which the planner cannot predict "
              f"for this model and image (e.g. {left_out[0]})")  # fmt: skip
    head = f"{'#':>3} {'layout':28} {'m':>2} {'schedule':15} {'ckpt':14} {'peak GiB':>9} " \
           f"{'act':>7} {'state':>7} {'step s':>9} {'bubble':>6} {'comm %':>6} " \
           f"{'img/s/dev':>10}  fits"  # fmt: skip
    print(head)
    shown = ranked[: args.top]
    if own is not None:
        shown += [p for p in ranked if p.candidate == own and p not in shown]
    for i, p in enumerate(shown, start=1):
        c = p.candidate
        lay = f"dp{c.layout.dp} pp{c.layout.pp} sp{grids_text(c.layout)}"
        mark = " <- recipe" if c == own else ""
        step = f"{p.step_s:>9.3g}" if timed else f"{'-':>9}"
        speed = f"{p.images_per_s / c.world_size:>10.3g}" if timed else f"{'-':>10}"
        print(
            f"{i:>3} {lay:28} {c.microbatches:>2} {c.schedule:15} "
            f"{_ckpt_text(c):14} "
            f"{_gib(p.peak):>9} {_gib(p.activations + p.transient):>7} {_gib(p.state):>7} "
            f"{step} {p.bubble:>6.2f} {100 * _waiting(p):>6.1f} "
            f"{speed}  "
            f"{'yes' if p.peak <= memory else 'NO'}{mark}"
        )
    print(LEGEND)
    best = ranked[0] if ranked and ranked[0].peak <= memory else None
    if own is not None:
        mine = next((p for p in preds if p.candidate == own), None)
        if mine is not None and mine.peak > memory:
            print(f"hyfi-plan: the recipe's layout needs {_gib(mine.peak)} GiB per rank, "
                  f"more than {_gib(memory)} GiB")  # fmt: skip
        if cohort_check is not None:
            try:
                cohort_check(own.layout)
            except ConfigError as err:
                print(f"hyfi-plan: training refuses the recipe's layout: {err}")
    if best is None:
        print("hyfi-plan: no layout fits; use more devices, a smaller image or a narrower model")
        return 1
    stages = ""
    if len(set(best.rank_peaks)) > 1:  # pipeline ranks that differ: say which holds what
        stages = " (pipeline ranks: " + " / ".join(_gib(v) for v in best.rank_peaks) + " GiB)"
    print(f"\nrecommended: {best.candidate.describe()}, {_gib(best.peak)} GiB per rank{stages}\n")
    print(recipe_lines(best.candidate, best.balance))
    return 0


def _waiting(pred: Any) -> float:
    """Share of the step spent waiting on messages (halos, statistics, stages, FSDP2)."""
    parts = pred.parts
    wait = sum(parts.get(k, 0.0) for k in ("halo", "collectives", "p2p", "exposed"))
    return min(1.0, wait / pred.step_s) if pred.step_s > 0 else 0.0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hyfi-plan``."""
    args = build_parser().parse_args(argv)
    from hyfi_imaging.parallel.memory import configure_allocator

    configure_allocator()  # as hyfi-train's ranks: this CPU's calibration runs under it
    try:
        return run(args)
    except HyfiError as err:
        print(f"hyfi-plan: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
