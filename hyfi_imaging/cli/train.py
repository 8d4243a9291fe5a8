"""``hyfi-train``: train a recipe's task -- classification, segmentation, regression -- on any layout."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]

EXAMPLES = """\
examples:
  # the synthetic recipe on a 2x2 tile grid (4 ranks), CPU or GPU
  mpirun -np 4 hyfi-train recipes/synthetic.yaml

  # the same with torchrun, overriding values from the command line
  torchrun --nproc-per-node 4 -m hyfi_imaging.cli.train recipes/synthetic.yaml \\
      --set train.epochs=2 --set optim.lr=3e-4

  # let the planner choose the layout for the ranks launched (see hyfi-plan --help)
  mpirun -np 4 hyfi-train recipes/synthetic.yaml --set parallel=auto

  # one process (layout 1x1), a quick check that the recipe is valid, then nothing else
  hyfi-train recipes/synthetic.yaml --set parallel.spatial=1x1 --check

  # a SLURM job script for the recipe (4 ranks: one node, 4 GPUs), to submit with sbatch
  hyfi-train recipes/synthetic.yaml --set train.epochs=20 --print-sbatch --time 2:00:00 > job.sbatch

  # segmentation of slides with a U-Net on 1x2 tiles (masks from hyfi-preprocess --annotations)
  mpirun -np 2 hyfi-train recipes/slide-segmentation-synthetic.yaml

  # regression of volumes (CosmoFlow) on 2 data replicas; 3-D segmentation (unet3d)
  mpirun -np 2 hyfi-train recipes/cosmoflow-synthetic.yaml
  hyfi-train recipes/unet3d-synthetic.yaml --set task.loss=ce

Tasks (task.name): classification (default), segmentation (Dice + cross-entropy,
per-image Dice/IoU, masks/<id>.zarr label images and overlays/*.png), regression
(MSE/MAE of the volume manifest's target_<name> columns, val_predictions.csv).

A run directory (train.out_dir) holds one run. Re-launching the same command
resumes it from its newest loadable checkpoint; if it has checkpoints and none
loads, hyfi-train stops and says so. --restart moves the old run to
<train.out_dir>/previous/ and starts over; --no-resume starts a new run and is
refused where a run already is.

Exit status: 0 trained; 1 a rank failed (one line on stderr: a lost rank is
named, a file error names the file); 2 a problem to fix first -- recipe,
options, run directory, a checkpoint that cannot be written or loaded (one
line, printed once).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hyfi-train",
        description="Train a whole-slide classifier: recipe = dataset card + model card + layout + "
        "optimiser + schedule. Runs under mpirun, torchrun, SLURM's srun or as one process.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("recipe", type=Path, help="recipe YAML (see recipes/)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe value, e.g. train.epochs=3 (repeatable)",
    )
    start = p.add_mutually_exclusive_group()
    start.add_argument(
        "--no-resume",
        action="store_true",
        help="start a new run; refused if train.out_dir already holds one",
    )
    start.add_argument(
        "--restart",
        action="store_true",
        help="move the run in train.out_dir to previous/ and start a new one",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="run every check that needs no processes (recipe, data, labels, layout, "
        "run directory, and that every store exists and lost no chunk), then exit",
    )
    job = p.add_argument_group(
        "SLURM job script",
        "--print-sbatch prints a job script for the recipe's layout and exits: nodes, tasks "
        "and GPUs per node, and an srun line with this recipe and its --set values. It checks "
        "the recipe, not its data (that is --check), and starts no process.",
    )
    job.add_argument("--print-sbatch", action="store_true", help="print the job script, then exit")
    job.add_argument(
        "--gpus-per-node",
        type=int,
        metavar="N",
        help="GPUs per node, one rank each (default 8; 0 = CPU nodes)",
    )
    job.add_argument(
        "--tasks-per-node",
        type=int,
        metavar="N",
        help="ranks per node (default: --gpus-per-node; on CPU nodes, every rank on one node)",
    )
    job.add_argument("--time", metavar="LIMIT", help="time limit (default 24:00:00)")
    job.add_argument("--partition", metavar="NAME", help="SLURM partition (default: the site's)")
    job.add_argument("--account", metavar="NAME", help="SLURM account to charge")
    return p


#: The options that only shape --print-sbatch's job script.
_JOB_OPTIONS = ("--gpus-per-node", "--tasks-per-node", "--time", "--partition", "--account")


def _job_options(args: argparse.Namespace) -> list[str]:
    """The options of :data:`_JOB_OPTIONS` given on the command line."""
    return [o for o in _JOB_OPTIONS if getattr(args, o[2:].replace("-", "_")) is not None]


def _print_sbatch(args: argparse.Namespace) -> int:
    """Print the job script of ``args`` (see :mod:`hyfi_imaging.train.sbatch`); 2 on a
    problem to fix first."""
    import os
    import shlex

    from hyfi_imaging.errors import ConfigError, HyfiError
    from hyfi_imaging.resources import find_recipe
    from hyfi_imaging.train.config import load_recipe, parse_overrides, read_yaml
    from hyfi_imaging.train.sbatch import job_script, job_shape

    try:
        if not args.print_sbatch:
            raise ConfigError(
                " ".join(_job_options(args)),
                "only shape the job script of --print-sbatch",
                "add --print-sbatch, or leave them out",
            )
        if args.restart or args.no_resume or args.check:
            raise ConfigError(
                "--print-sbatch",
                "takes no --restart, --no-resume or --check: a requeued job must resume its run",
                "run hyfi-train --check (or move the old run directory away) first, then print",
            )
        path = find_recipe(args.recipe)
        raw = read_yaml(path, "hyfi-train --print-sbatch") if path.is_file() else None
        chosen = parse_overrides(args.overrides).get(
            "parallel", raw.get("parallel") if isinstance(raw, dict) else None
        )
        if chosen == "auto":
            raise ConfigError(
                "--print-sbatch",
                "parallel=auto chooses a layout for the ranks a job starts with, so it cannot "
                "size the job",
                "choose the layout (hyfi-plan suggests one) and give it, e.g. "
                "--set parallel.spatial=2x2",
            )
        recipe = load_recipe(args.recipe, args.overrides)
        gpus = 8 if args.gpus_per_node is None else args.gpus_per_node
        shape = job_shape(recipe.world_size, gpus_per_node=gpus, tasks_per_node=args.tasks_per_node)
        where = str(path.resolve()) if path.is_file() else str(args.recipe)
        command = [sys.executable, "-m", "hyfi_imaging.cli.train", where]
        for item in args.overrides:
            command += ["--set", item]
        script = job_script(
            command,
            shape,
            job_name=recipe.name,
            time_limit=args.time or "24:00:00",
            workdir=os.getcwd(),
            partition=args.partition,
            account=args.account,
            comments=[
                f"hyfi-train --print-sbatch: recipe {recipe.name}, layout "
                f"{recipe.parallel.layout().describe()}",
                f"save as {shlex.quote(args.recipe.stem + '.sbatch')} and submit: "
                f"sbatch {shlex.quote(args.recipe.stem + '.sbatch')}",
            ],
        )
    except HyfiError as err:
        print(f"hyfi-train: error: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(script)
    return 0


def _check_launch_world(recipe: Any) -> None:
    """ConfigError unless a launcher's job (none: one process, nothing to check) has the
    ranks ``recipe``'s layout takes."""
    from hyfi_imaging.parallel.launcher_env import launch_env
    from hyfi_imaging.parallel.mirrored import check_placed_world

    env = launch_env()
    if env.launcher != "single":
        check_placed_world(recipe.parallel.layout(), recipe.parallel.schedule, env.world_size)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hyfi-train``."""
    from hyfi_imaging.train.preempt import StopSignals

    # Caught from the first line (importing PyTorch takes seconds; checking the recipe and
    # the stores, minutes): a scheduler's signal before the loop killed the rank (exit 138
    # for SIGUSR1), which no job requeues; now the run stops at its first step with a
    # checkpoint and exit 75. What ends before training (--check, --print-sbatch, an error)
    # puts the handlers back and takes a signal it received as it would have.
    signals = StopSignals().install()
    try:
        return _main(argv, signals)
    finally:
        signals.restore()
        if signals.received is not None:
            signal.raise_signal(signals.received)


def _main(argv: list[str] | None, signals: Any) -> int:
    from hyfi_imaging.parallel.memory import configure_allocator

    configure_allocator()  # first: PyTorch decides on huge pages at its first tensor
    from hyfi_imaging.data.dataset import left_out_line
    from hyfi_imaging.errors import HyfiError
    from hyfi_imaging.parallel.launch import exit_now, fail_fast, launch_rank, shutdown
    from hyfi_imaging.train.autoplan import fit_warning
    from hyfi_imaging.train.config import load_recipe
    from hyfi_imaging.train.preempt import REQUEUE_EXIT
    from hyfi_imaging.train.preflight import preflight, turn_warning
    from hyfi_imaging.train.rundir import StartMode
    from hyfi_imaging.train.trainer import Trainer

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="hyfi-train: %(message)s")
    if args.print_sbatch or _job_options(args):
        return _print_sbatch(args)  # prints and exits: no data read, no process group
    start: StartMode = "restart" if args.restart else "new" if args.no_resume else "resume"
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        facts = preflight(recipe, start=start, stores=args.check)
        if args.check:  # under a launcher, its ranks are checked too (as the run's are)
            _check_launch_world(recipe)
        warning = fit_warning(recipe)
        mixed = None if facts is None else facts.mixed_warning()
        turns = turn_warning(recipe)
        manifests = (recipe.data.manifest, recipe.data.val_manifest)
        left_out = [line for m in manifests if m and (line := left_out_line(m))]
    except HyfiError as err:
        if launch_rank() in (None, 0):  # every rank found the same: say it once
            print(f"hyfi-train: error: {err}", file=sys.stderr)
        return 2
    for line in left_out if launch_rank() in (None, 0) else []:  # failed slides are not trained on
        print(f"hyfi-train: {line}", file=sys.stderr, flush=True)
    for said in (warning, mixed, turns) if launch_rank() in (None, 0) else ():  # once
        if said:
            print(f"hyfi-train: warning: {said}", file=sys.stderr, flush=True)
    if args.check:
        if launch_rank() in (None, 0):
            print(f"hyfi-train: {args.recipe} is valid ({recipe.world_size} ranks)")
        return 0

    def run() -> int:
        summary = Trainer(recipe, start=start).run(signals)
        if summary.get("stopped_by"):  # a scheduler's signal: checkpointed, said once
            shutdown()
            return REQUEUE_EXIT
        if summary.get("world_size") is not None and launch_rank() in (None, 0):
            keys = ("accuracy", "auc", "macro_auc", "qwk", "val_loss", "steps", "seconds")
            shown = ", ".join(
                f"{k}={summary[k]:.4g}"
                if isinstance(summary.get(k), float)
                else f"{k}={summary[k]}"
                for k in keys
                if summary.get(k) is not None
            )
            print(f"hyfi-train: done: {shown}; outputs in {recipe.train.out_dir}")
        shutdown()
        return 0

    exit_now(fail_fast(run, prog="hyfi-train"))


if __name__ == "__main__":
    sys.exit(main())
