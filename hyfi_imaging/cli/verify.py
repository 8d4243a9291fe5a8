"""``hyfi-verify``: prove that a parallel layout trains exactly like one process.

Any ``dp x pp x sp`` layout, with micro-batches, a pipeline schedule, a stage
balance and activation checkpointing, is compared with one process that runs
the same micro-batch split. Every option is validated before a process group
exists, so a bad combination costs nothing and names its fix.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["build_parser", "main"]

EXAMPLES = """\
examples:
  # ResNet-50 on a 2x2 tile grid, 4 ranks, 2 SGD steps
  mpirun -np 4 hyfi-verify --model resnet50 --image-size 512x384 --spatial 2x2

  # the same as a SLURM job step (inside sbatch or salloc; no MPI needed)
  srun -n 4 hyfi-verify --model resnet50 --image-size 512x384 --spatial 2x2

  # the same under torchrun, machine-readable
  torchrun --nproc-per-node 4 -m hyfi_imaging.cli.verify --model resnet18 \\
      --image-size 300x260 --spatial 2x2 --json

  # AmoebaNet-D, 3 tiles in a column, double precision
  mpirun -np 3 hyfi-verify --model amoebanet-d-6-64 --image-size 257x190 --spatial 3x1 --dtype float64

  # your own model (any nn.Module; spatial and data parallelism; pipeline if torch.fx traces it)
  mpirun -np 4 hyfi-verify --model torchvision.models:resnet18 --image-size 256x224 --spatial 2x2

  # a channels-last model (hyfi-train's model.memory_format: channels_last)
  mpirun -np 4 hyfi-verify --model resnet18 --width 0.25 --image-size 70x100 --spatial 2x2 \\
      --memory-format channels_last

  # deep checkpointing with the streamed stem on 2x2 tiles (the most memory saved)
  mpirun -np 4 hyfi-verify --model resnet50 --width 0.25 --image-size 128 --spatial 2x2 \\
      --checkpointing deep --streaming stem

  # torch.compile on two data replicas (aot_eager: torch's kernels, exact)
  mpirun -np 2 hyfi-verify --model resnet18 --width 0.25 --image-size 64 --data 2 \\
      --compile aot_eager

  # 2 pipeline stages, 1F1B over 4 micro-batches, every block checkpointed
  mpirun -np 2 hyfi-verify --model resnet50 --width 0.25 --image-size 96x80 --pipeline 2 \\
      --microbatches 4 --schedule 1f1b --checkpointing full

  # two mirrored replicas (GEMS): rank r holds stage r of A and stage 1-r of B
  mpirun -np 2 hyfi-verify --model resnet18 --width 0.25 --image-size 70x52 --pipeline 2 \\
      --microbatches 4 --schedule bidirectional

  # a 3D U-Net on a volume cut into 2x1x2 sub-volumes (depth x height x width)
  mpirun -np 4 hyfi-verify --model unet3d --image-size 40x48x56 --spatial 2x1x2

  # CosmoFlow with a global-pool head, which takes any volume size
  mpirun -np 4 hyfi-verify --model cosmoflow-pool --width 4 --image-size 64x64x72 --spatial 1x2x2

  # a grid per stage (Hy-Fi's junction): 2x2 tiles, then 1x2, then one rank = 7 ranks
  mpirun -np 7 hyfi-verify --model resnet18 --width 0.25 --image-size 70x100 --pipeline 3 \\
      --spatial 2x2,1x2,1x1 --microbatches 2

  # two mirrored replicas of a junction (GEMS + SP): positions of max(grid) ranks, 2 + 2
  mpirun -np 4 hyfi-verify --model resnet18 --width 0.25 --image-size 45x101 --pipeline 2 \\
      --spatial 1x2,1x1 --balance 5,6 --microbatches 2 --schedule bidirectional

  # all three: 2 replicas x 2 stages (cut 5,6) x 1x2 tiles = 8 ranks, gradient clipping
  mpirun -np 8 hyfi-verify --model resnet18 --width 0.25 --image-size 70x100 --data 2 \\
      --pipeline 2 --spatial 1x2 --microbatches 2 --balance 5,6 --clip-grad 0.5

Exit status 0: every compared tensor is within tolerance (float64: rtol 1e-6,
float32: rtol 1e-4; absolute: rtol x the tensor's largest value, at least 1e-9
and 1e-5); 1: a mismatch (the worst tensors
are listed); 2: bad arguments, or a run that a node's free memory cannot hold (the
estimate is printed before the first step; the one-process reference runs on rank 0
only). float32 checks the kernels you will train with,
but on large images a few activations round to the other side of a ReLU kink
(both answers are right), so a float32 mismatch that float64 does not show is
rounding, not a bug.
"""


def build_parser() -> argparse.ArgumentParser:
    from hyfi_imaging.cli.options import (
        classes_int,
        grids_type,
        positive_float,
        positive_int,
        shape_type,
    )
    from hyfi_imaging.parallel.parallel_plan import COMPILE_BACKENDS
    from hyfi_imaging.parallel.schedules import SCHEDULES

    p = argparse.ArgumentParser(
        prog="hyfi-verify",
        description="Run K SGD steps of a model on a data x pipeline x spatial layout and the same steps "
        "in one process with the same micro-batches; compare outputs, input gradients, every "
        "parameter gradient, the weights and BatchNorm statistics.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        required=True,
        help="registered model name, e.g. resnet50, or a Python path module:function that "
        "returns the model, e.g. torchvision.models:resnet18 (called with num_classes)",
    )
    p.add_argument(
        "--image-size",
        required=True,
        type=shape_type("--image-size"),
        metavar="N|HxW|DxHxW|L<N>",
        help="image size, or a volume's depth x height x width (3-D models)",
    )
    p.add_argument(
        "--spatial",
        default=None,
        type=grids_type,
        metavar="GYxGX[,GYxGX...]|GZxGYxGX",
        help="tile grid of every stage (default 1x1, or 1x1x1 for a volume; a volume takes a 3-D "
        "grid), or one 2-D grid per pipeline stage (e.g. 2x2,1x2,1x1: activations are "
        "re-partitioned exactly where the grid changes)",
    )
    p.add_argument(
        "--pipeline", type=int, default=1, metavar="P", help="pipeline stages, pp (default 1)"
    )
    p.add_argument(
        "--data", type=int, default=1, metavar="D", help="data-parallel replicas, dp (default 1)"
    )
    p.add_argument(
        "--branches",
        type=int,
        default=1,
        metavar="B",
        help="branch ranks per tile, br: each runs some branches of every cell (default 1)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=1,
        metavar="M",
        help="micro-batches per step (default 1)",
    )
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="gpipe",
        help="pipeline schedule (default gpipe): bidirectional = two mirrored replicas "
        "(GEMS; with per-stage grids each position as wide as its larger grid); "
        "interleaved1f1b, zbv, dualpipev = torch's schedules with two stages per rank",
    )
    p.add_argument(
        "--balance",
        default="time",
        metavar="a,b,...|time|memory",
        help="top-level layers per stage, or measure every layer and balance time or memory "
        "(default time)",
    )
    p.add_argument(
        "--checkpointing",
        default="none",
        metavar="none|full|every:N|selective|deep",
        help="activation checkpointing: no block, every block, every N-th block, every block "
        "keeping convolution outputs, or every block with, in the first two layers of "
        "several blocks, the blocks' inputs computed again and the blocks in units "
        "(default none)",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="compute each convolution's interior while its halos are in flight",
    )
    p.add_argument(
        "--backward-bands",
        action="store_true",
        help="run each convolution's backward in bands of output rows (less memory, slower)",
    )
    p.add_argument(
        "--halo-depth",
        type=int,
        default=1,
        metavar="N",
        help="one halo exchange serves up to N consecutive windowed layers (default 1)",
    )
    p.add_argument(
        "--streaming",
        choices=("none", "stem"),
        default="none",
        help="stem: run the model's leading convolution, BatchNorm, activation and max-pool "
        "in row bands (a chain model; default none)",
    )
    p.add_argument(
        "--compile",
        choices=("none", *COMPILE_BACKENDS),
        default="none",
        help="compile the stage with torch.compile and this backend (one stage without tiles, "
        "checkpointing or streaming; default none)",
    )
    p.add_argument(
        "--clip-grad",
        type=positive_float,  # -1 turned every gradient round, nan made both sides NaN
        metavar="MAX",
        help="clip the global gradient norm to MAX (> 0)",
    )
    p.add_argument(
        "--batch",
        type=int,
        help="per-replica batch (default: max(2, microbatches)); the global batch is data x this",
    )
    p.add_argument("--steps", type=positive_int, default=2)
    p.add_argument(
        "--num-classes",
        type=classes_int,
        default=3,
        help="the model's outputs, 2 or more (one makes every gradient 0; default 3)",
    )
    p.add_argument("--width", type=float, help="width multiplier for the model (if it has one)")
    p.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default="float64",
        help="float64 (default) separates logic errors from rounding; in float32 a value "
        "that rounds across a ReLU kink legitimately changes gradients on large images",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--memory-format",
        choices=("nchw", "channels_last"),
        default="nchw",
        help="the model's layout, as hyfi-train's model.memory_format (default: %(default)s)",
    )
    p.add_argument(
        "--no-memory-check",
        dest="memory_check",
        action="store_false",
        help="run even when the memory estimate (printed before the first step: the layout's "
        "ranks and the one-process reference, which runs on rank 0) exceeds what a node has free",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (rank 0)")
    return p


def _plan(args: argparse.Namespace, layout: Any) -> Any:
    """The ParallelPlan the options describe (ConfigError for a bad combination)."""
    from hyfi_imaging.errors import ConfigError
    from hyfi_imaging.parallel.engine import ParallelPlan

    balance: tuple[int, ...] | None = None
    by = "time"
    text = args.balance.strip().lower()
    if text in ("time", "memory", "auto"):
        by = "memory" if text == "memory" else "time"
    else:
        try:
            balance = tuple(int(v) for v in text.split(","))
        except ValueError:
            raise ConfigError(
                f"--balance {args.balance}",
                "is neither a list of layer counts nor time/memory",
                "write e.g. --balance 5,6 or --balance time",
            ) from None
    return ParallelPlan(
        layout,
        microbatches=args.microbatches,
        schedule=args.schedule,
        balance=balance,
        checkpointing=args.checkpointing,
        balance_by=by,  # type: ignore[arg-type]
        overlap=args.overlap,
        halo_depth=args.halo_depth,
        streaming=args.streaming,
        backward_bands=args.backward_bands,
        compile=args.compile,
    )


def _run(args: argparse.Namespace) -> int:
    import torch

    from hyfi_imaging.errors import ConfigError
    from hyfi_imaging.models import create_model
    from hyfi_imaging.models.memory_format import to_channels_last
    from hyfi_imaging.parallel.branches import check_branches
    from hyfi_imaging.parallel.launch import init_parallel, shutdown, threads_per_rank
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.parallel.verify import check_image_size, run_verify

    nd = len(args.image_size)
    grids = args.spatial if args.spatial is not None else ((1,) * nd,)
    for spatial in grids:
        if len(spatial) != nd:
            raise ConfigError(
                f"--spatial {'x'.join(map(str, spatial))}",
                f"has {len(spatial)} factors for an image size of {nd} axes "
                f"({'x'.join(map(str, args.image_size))})",
                "give a volume (DxHxW) a grid GZxGYxGX and an image (HxW) a grid GYxGX",
            )
    layout = Layout(
        dp=args.data,
        pp=args.pipeline,
        sp=grids[0],
        grids=grids if len(grids) > 1 else None,
        br=args.branches,
    )
    plan = _plan(args, layout)
    kwargs: dict[str, object] = {"num_classes": args.num_classes}
    if args.width is not None:
        kwargs["width"] = args.width
    batch = args.batch if args.batch is not None else max(2, args.microbatches)

    def build() -> torch.nn.Module:
        model = create_model(args.model, **kwargs)
        if args.memory_format == "channels_last":
            to_channels_last(model)
        return model

    # Fail on a bad name, option, cut, batch or image size before any process group exists.
    model = build()
    plan.validate(model, batch)
    check_branches(model, layout.br, checkpointing=plan.checkpointing)
    check_image_size(model, args.image_size, batch)
    del model
    pc = init_parallel(layout, schedule=plan.schedule)
    torch.set_num_threads(threads_per_rank())  # this node's CPUs over this node's ranks
    report = run_verify(
        build,
        pc,
        image_hw=args.image_size,
        batch=batch,
        steps=args.steps,
        dtype=torch.float64 if args.dtype == "float64" else torch.float32,
        seed=args.seed,
        plan=plan,
        clip_grad=args.clip_grad,
        memory_check=args.memory_check,
        announce=(lambda text: print(text, file=sys.stderr if args.json else sys.stdout))
        if pc.rank == 0
        else None,
    )
    if pc.rank == 0:
        if args.json:
            print(json.dumps(report.to_json()))
        else:
            print(
                report.format(
                    f"{args.model} {'x'.join(map(str, args.image_size))} on "
                    f"{layout.describe()} ({pc.world_size} ranks, {pc.backend}), {args.steps} steps "
                    f"of {args.microbatches} micro-batch(es) ({args.schedule})"
                )
            )
    shutdown()
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hyfi-verify``."""
    from hyfi_imaging.parallel.memory import configure_allocator

    configure_allocator()  # first: PyTorch decides on huge pages at its first tensor
    from hyfi_imaging.errors import HyfiError
    from hyfi_imaging.parallel.launch import exit_now, fail_fast, launch_rank

    args = build_parser().parse_args(argv)
    try:
        exit_now(fail_fast(lambda: _run(args), prog="hyfi-verify"))
    except HyfiError as err:
        if launch_rank() in (None, 0):  # every rank found the same: say it once
            print(f"hyfi-verify: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
