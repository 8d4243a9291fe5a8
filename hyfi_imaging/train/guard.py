"""Non-finite steps and states: found at the step they appear, never checkpointed.

Why one flag per step: a diverging run (a learning rate of 1e6, an overflow in
bf16) first shows as a NaN or inf in the loss or in a gradient. The engine
already reads the step's loss once; it sums the norm of every gradient a rank
owns into the same all-reduce, so ``ParallelModel.grads_finite`` costs no extra
host sync (see ``ParallelModel.train_step``). The step is then either refused
(``train.nonfinite: stop``: the optimiser never sees it, the run stops and its
newest checkpoint stays the newest) or skipped (``skip``: counted, logged, the
BatchNorm statistics its forward changed put back, at most
``train.max_skipped_steps`` in a row).

Why the state is checked again before every checkpoint: retention deletes
older checkpoints once a new one is written, so a non-finite checkpoint would
evict the good ones and a relaunch would resume the broken state. One
all-reduced norm over every floating tensor of the state (each rank its own
shards) decides, the same on every rank.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyfi_imaging.errors import HyfiError

__all__ = ["NonFiniteError", "StepGuard", "finite_everywhere"]

log = logging.getLogger("hyfi_imaging.train")


class NonFiniteError(HyfiError):
    """A step or a state to be saved holds NaN or inf; decided alike on every rank."""

    collective = True


def _tensors(state: Any) -> Iterable[torch.Tensor]:
    if isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, torch.Tensor) and state.is_floating_point():
        to_local = getattr(state, "to_local", None)  # DTensor: this rank's shard
        yield to_local() if callable(to_local) else state


def finite_everywhere(state: Any, device: torch.device) -> bool:
    """Whether every floating tensor of ``state`` (nested dicts) is finite on every rank."""
    tensors = [t.detach() for t in _tensors(state) if t.numel()]
    norm = torch.zeros((), dtype=torch.float64, device=device)
    if tensors:
        norm += torch.nn.utils.get_total_norm(tensors).to(device, torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(norm)
    return math.isfinite(float(norm))


class StepGuard:
    """Decides what a non-finite step does: stop the run, or skip the step.

    ``before(module)`` is called before each step (in skip mode it keeps the
    buffers -- BatchNorm's running statistics and counts -- that a forward
    updates); ``accept(step, loss, grads_finite)`` says whether the optimiser
    may step, raises :class:`NonFiniteError` when the run must stop.
    """

    def __init__(
        self, policy: str, max_in_a_row: int, *, newest: Callable[[], str | None], say: bool
    ) -> None:
        self.policy = policy
        self.say = say  # one rank tells (every rank decides alike)
        self.max_in_a_row = max_in_a_row
        self.newest = newest  # the run's newest checkpoint, named when the run stops
        self.skipped = 0
        self.in_a_row = 0
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def before(self, module: nn.Module) -> None:
        """Keep a copy of the buffers (skip mode only: BatchNorm's statistics and counts are small)."""
        if self.policy == "skip":
            self._buffers = [(b, b.detach().clone()) for b in module.buffers()]

    def accept(self, step: int, loss: float, grads_finite: bool) -> bool:
        """True when the step is finite; False when it is skipped; raises to stop the run."""
        if math.isfinite(loss) and grads_finite:
            self.in_a_row = 0
            return True
        what = f"the loss is {loss}" if not math.isfinite(loss) else "a gradient is not finite"
        self.in_a_row += 1
        if self.policy == "skip" and self.in_a_row <= self.max_in_a_row:
            self.skipped += 1
            with torch.no_grad():
                for live, kept in self._buffers:
                    live.copy_(kept)
            if self.say:
                log.warning(
                    "step %d: %s; skipped (%d in a row, %d in this launch; train.nonfinite=skip)",
                    step,
                    what,
                    self.in_a_row,
                    self.skipped,
                )
            return False
        if self.policy == "skip":
            what += f" ({self.in_a_row} steps in a row)"
        newest = self.newest()
        resume = (
            f"{newest} is the newest checkpoint, intact: relaunch to resume from it"
            if newest
            else "no checkpoint was written yet: relaunch to start again"
        )
        raise NonFiniteError(
            f"step {step}",
            f"{what}; training stopped before the step changed the model",
            f"lower optim.lr or set optim.grad_clip (or train.nonfinite=skip); {resume}",
        )
