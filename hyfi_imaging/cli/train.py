"""``hyfi-train``: train a whole-slide classifier from a recipe on any layout."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

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

Re-launching the same command resumes from the newest loadable checkpoint in
<train.out_dir>/checkpoints (use --no-resume to start over). Exit status: 0
trained; 1 a rank failed (message on stderr); 2 invalid recipe or options.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hyfi-train",
        description="Train a whole-slide classifier: recipe = dataset card + model card + layout + "
        "optimiser + schedule. Runs under mpirun, torchrun or as one process.",
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
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    p.add_argument("--check", action="store_true", help="validate the recipe and data, then exit")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hyfi-train``."""
    from hyfi_imaging.data.dataset import left_out_line
    from hyfi_imaging.errors import HyfiError
    from hyfi_imaging.parallel.launch import exit_now, fail_fast, shutdown
    from hyfi_imaging.train.autoplan import fit_warning
    from hyfi_imaging.train.config import load_recipe
    from hyfi_imaging.train.trainer import Trainer, preflight

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="hyfi-train: %(message)s")
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        preflight(recipe)
        warning = fit_warning(recipe)
        manifests = (recipe.data.manifest, recipe.data.val_manifest)
        left_out = [line for m in manifests if m and (line := left_out_line(m))]
    except HyfiError as err:
        print(f"hyfi-train: error: {err}", file=sys.stderr)
        return 2
    for line in left_out if _launch_rank() == 0 else []:  # failed slides are not trained on
        print(f"hyfi-train: {line}", file=sys.stderr, flush=True)
    if warning and _launch_rank() == 0:  # said once, before any rank allocates
        print(f"hyfi-train: warning: {warning}", file=sys.stderr, flush=True)
    if args.check:
        print(f"hyfi-train: {args.recipe} is valid ({recipe.world_size} ranks)")
        return 0

    def run() -> int:
        summary = Trainer(recipe, resume=not args.no_resume).run()
        if summary.get("world_size") is not None and _rank() == 0:
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


def _launch_rank() -> int:
    """This process's rank from the launcher's environment (no process group yet)."""
    import os

    for var in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


if __name__ == "__main__":
    sys.exit(main())
