"""Checkpoints that survive crashes and move between layouts.

Why ``torch.distributed.checkpoint`` (DCP): every rank writes the tensors it
holds under their *original* model names (``layer1.0.conv1.weight``), DCP
keeps one copy of tensors replicated over tiles and data replicas, and a
later job on any other layout reads back exactly the names its ranks need. A
run trained on sp=2x2 x pp=2 is evaluated in one process by loading the same
checkpoint.

Why this directory dance: a checkpoint is written to ``step_N.partial`` and
renamed to ``step_N`` only after every rank finished and rank 0 wrote the
``hyfi-checkpoint.json`` marker; a crash at any moment leaves either the old
checkpoints or a ``.partial`` directory that is never mistaken for a finished
one. On resume the newest checkpoint that actually loads is used: a corrupt
one (truncated shard, missing metadata) is reported and the previous tried.
Optimizer state is saved under parameter names too, so it also survives a
change of layout.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

__all__ = [
    "MARKER",
    "list_checkpoints",
    "load_latest",
    "optimizer_state",
    "save_checkpoint",
]

log = logging.getLogger("hyfi_imaging.train")

MARKER = "hyfi-checkpoint.json"
# Optimiser state tensors by optimiser, created before loading so DCP can fill them in place.
_STATE_KEYS: dict[type[torch.optim.Optimizer], tuple[str, ...]] = {
    torch.optim.SGD: ("momentum_buffer",),
    torch.optim.AdamW: ("step", "exp_avg", "exp_avg_sq"),
    torch.optim.Adam: ("step", "exp_avg", "exp_avg_sq"),
}


def optimizer_state(
    named_params: Iterable[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    *,
    for_load: bool,
) -> dict[str, torch.Tensor]:
    """The optimiser's per-parameter tensors keyed ``<param name>/<state key>``.

    With ``for_load`` missing state is allocated first (zeros), so loading
    fills tensors the optimiser already owns.
    """
    keys = _STATE_KEYS.get(type(optimizer), ())
    flat: dict[str, torch.Tensor] = {}
    for name, p in named_params:
        state = optimizer.state[p]
        if for_load:
            for key in keys:
                if key == "momentum_buffer" and not optimizer.defaults.get("momentum"):
                    continue
                if key not in state:
                    state[key] = (
                        torch.zeros((), dtype=torch.float32)
                        if key == "step"
                        else torch.zeros_like(p)
                    )
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                flat[f"{name}/{key}"] = value
    return flat


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def list_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints under ``root``, newest first."""
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if p.is_dir() and (p / MARKER).exists()]
    return sorted(done, key=lambda p: p.name, reverse=True)


def save_checkpoint(
    root: Path, step: int, state: dict[str, Any], meta: dict[str, Any], *, keep: int
) -> Path:
    """Write ``state`` (collectively, every rank) as ``root/step_<step>``; keep the newest ``keep``."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    final = root / f"step_{step:08d}"
    partial = root / f"step_{step:08d}.partial"
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    _barrier()
    dcp.save(state, checkpoint_id=str(partial))
    _barrier()
    if rank0:
        marker = {**meta, "step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (partial / MARKER).write_text(json.dumps(marker, indent=2, default=str))
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        for old in list_checkpoints(root)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _all_ok(ok: bool) -> bool:
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def load_latest(
    root_or_checkpoint: Path, state: dict[str, Any]
) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest loadable checkpoint into ``state`` in place (collectively).

    ``root_or_checkpoint`` is a directory of checkpoints or one checkpoint.
    Returns its path and marker, or None when there is none. Corrupt
    checkpoints are logged and skipped.
    """
    for path in _candidates(root_or_checkpoint):
        try:
            meta = json.loads((path / MARKER).read_text())
            dcp.load(state, checkpoint_id=str(path))
            ok = True
        except (KeyboardInterrupt, SystemExit):
            raise
        except (
            BaseException
        ) as err:  # DCP's CheckpointException is a BaseException, raised on every rank
            log.warning(
                "checkpoint %s cannot be loaded (%s); trying the previous one",
                path,
                str(err).splitlines()[0][:200] if str(err) else type(err).__name__,
            )
            ok = False
        if _all_ok(ok):
            return path, meta
    return None


def _candidates(path: Path) -> Iterator[Path]:
    if (path / MARKER).exists():
        yield path
    else:
        yield from list_checkpoints(path)
