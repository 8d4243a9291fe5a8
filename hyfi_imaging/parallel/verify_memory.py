"""How much memory a verification needs, said before it starts, and a refusal when it will not fit.

Why: a verification runs the layout *and* the one-process reference on the whole image
(:mod:`.reference`). A run that does not fit is killed by the kernel's out-of-memory killer
minutes in, with nothing said; predicted here, it is refused in one line naming what to change.
Both parts are predicted by ``hyfi-plan``'s model (:func:`~.plan.predict`: meta-device traces,
no memory and no compute), with the CPU convolutions' unfolded inputs
(:func:`~.memory.cpu_unfold_bytes`), which dominate the float64 reference of a 3-D model.

What a node holds, in the two phases of a step (the reference runs between the layout's
steps, never during them), beyond what its ranks hold once they built the model:

* **layout step**: every rank its copy of the model and its predicted peak; rank
  :data:`~.reference.REFERENCE_RANK` also the reference's gradients and momentum;
* **reference step**: rank :data:`~.reference.REFERENCE_RANK` the reference's peak (one
  micro-batch of the whole image), the others their state and the reference's gradients
  they receive.

On a GPU the layout's part is the device's (checked against its free memory) and the host
holds the reference. The check compares with what the kernel (and a cgroup) still grants now
(:func:`~.memory.available_bytes`), read on every rank and agreed, so every rank refuses alike.
"""

from __future__ import annotations

import copy
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.engine import ParallelPlan
from hyfi_imaging.parallel.launch import ParallelContext
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.memory import available_bytes
from hyfi_imaging.parallel.plan import RUNTIME_OVERHEAD, Candidate, predict
from hyfi_imaging.parallel.reference import REFERENCE_RANK

__all__ = ["VerifyMemory", "check_memory", "estimate_memory"]

GIB = float(2**30)


@dataclass(frozen=True)
class VerifyMemory:
    """Predicted bytes of one verification (see the module docstring for the phases)."""

    model: int  # the model's parameters and buffers, as built
    rank_peak: int  # a layout step on the busiest rank, its state included
    rank_state: int  # what a rank holds between steps: gradients and optimizer state
    reference_peak: int  # a reference step, its gradients and momentum included
    reference_state: int  # the reference's gradients and momentum
    unfold: int  # of reference_peak: CPU convolutions unfolding their input
    on_device: bool  # the layout runs on a GPU

    def host_bytes(self, ranks: int, reference: bool) -> int:
        """A node's host memory with ``ranks`` ranks (and the reference when ``reference``)."""
        layout = 0 if self.on_device else self.model + self.rank_peak
        waiting = (0 if self.on_device else self.model + self.rank_state) + self.model
        if not reference:
            return ranks * max(layout, waiting)
        return max(
            ranks * layout + self.reference_state,
            (ranks - 1) * waiting + waiting - self.model + self.reference_peak,
        )

    def device_bytes(self) -> int:
        """A rank's GPU memory (0 when the layout runs on the CPU)."""
        return self.model + self.rank_peak if self.on_device else 0

    def describe(self) -> str:
        """The two parts in words."""
        where = "GPU" if self.on_device else "rank"
        unfold = f", {_gib(self.unfold)} of it CPU convolutions unfolding their input"
        return (
            f"the one-process reference on rank {REFERENCE_RANK} {_gib(self.reference_peak)}"
            + (unfold if 10 * self.unfold >= self.reference_peak else "")
            + f", each {where} {_gib(self.model + self.rank_peak)}"
        )


def estimate_memory(
    model: nn.Module,
    image_hw: Sequence[int],
    batch: int,
    plan: ParallelPlan,
    device_type: str,
) -> VerifyMemory:
    """Predict a verification of ``model`` (built, in the dtype it runs in) on ``plan``'s layout
    with per-replica ``batch`` and images of ``image_hw``; the layout on ``device_type``."""
    size = tuple(int(v) for v in image_hw)
    layout = Candidate.of(plan)
    on_device = device_type != "cpu"
    rank = predict(
        model,
        size,  # type: ignore[arg-type]
        batch,
        layout,
        cpu_kernels=not on_device,
        overhead=RUNTIME_OVERHEAD.get(device_type, 0),
        overlap=plan.overlap,
    )
    one = Candidate(Layout(sp=(1,) * len(size)))
    mb = batch // plan.microbatches
    ref = predict(model, size, mb, one, cpu_kernels=True, overhead=0)  # type: ignore[arg-type]
    plain = predict(model, size, mb, one, cpu_kernels=False, overhead=0)  # type: ignore[arg-type]
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return VerifyMemory(
        model=weights,
        rank_peak=rank.peak,
        rank_state=rank.state,
        reference_peak=ref.peak,
        reference_state=ref.state,
        unfold=max(0, ref.peak - plain.peak),
        on_device=on_device,
    )


def check_memory(
    model: nn.Module,
    pc: ParallelContext,
    *,
    image_hw: Sequence[int],
    batch: int,
    plan: ParallelPlan,
    enforce: bool = True,
) -> tuple[str, VerifyMemory | None]:
    """The estimate in words (one line) and in bytes (None where it could not be made);
    ConfigError on every rank when a node's host memory or a GPU's memory left cannot hold it,
    unless not ``enforce``. Collective over ``pc``'s job.

    Every rank reads its node's (and GPU's) free memory; rank :data:`~.reference.REFERENCE_RANK`
    predicts (``model`` is built, in the dtype it runs in), decides and tells the others. A model
    the planner cannot trace is verified unchecked (the estimate is advice, not a condition).
    """
    device_free = torch.cuda.mem_get_info(pc.device)[0] if pc.device.type == "cuda" else -1
    mine = (socket.gethostname(), available_bytes(), device_free)
    gathered: list[object] = [mine] * pc.world_size
    if pc.world_size > 1:
        dist.all_gather_object(gathered, mine)
    verdict: list[object] = [None]
    if pc.rank == REFERENCE_RANK:
        verdict[0] = _verdict(
            model, cast(list[tuple[str, int, int]], gathered), image_hw, batch, plan, pc, enforce
        )
    if pc.world_size > 1:
        dist.broadcast_object_list(verdict, src=REFERENCE_RANK)
    text, refusal, est = cast(
        tuple[str, tuple[str, str, str] | None, VerifyMemory | None], verdict[0]
    )
    if refusal is not None:
        raise ConfigError(*refusal)
    return text, est


def _verdict(
    model: nn.Module,
    table: list[tuple[str, int, int]],
    image_hw: Sequence[int],
    batch: int,
    plan: ParallelPlan,
    pc: ParallelContext,
    enforce: bool,
) -> tuple[str, tuple[str, str, str] | None, VerifyMemory | None]:
    """(the estimate in words, the refusal's where/what/fix or None, the estimate), on the
    estimating rank."""
    try:
        est = estimate_memory(model, image_hw, batch, plan, pc.device.type)
    except Exception as err:  # advice only: a model the planner cannot trace is still verified
        why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return f"memory estimate: not available ({why}); not checked", None, None
    nodes: dict[str, list[int]] = {}
    for host, avail, _ in table:
        nodes.setdefault(host, []).append(avail)
    ref_host = table[REFERENCE_RANK][0]
    lines, short = [], None
    for host, avails in nodes.items():
        need = est.host_bytes(len(avails), host == ref_host)
        have = min(avails)  # read at slightly different times: the lowest
        lines.append(f"{host} ({len(avails)} rank{'s' * (len(avails) > 1)}) {_gib(need)}")
        lines[-1] += f" of {_gib(have)} free"
        if need > have and short is None:
            short = (host, need, have, len(avails))
    text = f"memory estimate: {est.describe()}; " + ", ".join(lines)
    gpu_free = min((free for _, _, free in table if free >= 0), default=-1)
    gpu_short = est.on_device and 0 <= gpu_free < est.device_bytes()
    if short is None and not gpu_short:
        return text, None, est
    if short is not None:
        host, need, have, ranks = short
        what = f"needs about {_gib(need)} on {host} ({ranks} ranks: {est.describe()})"
        what += f" but {_gib(have)} are free"
    else:
        what = f"needs about {_gib(est.device_bytes())} per GPU but {_gib(gpu_free)} are free"
    if not enforce:
        return f"{text}; NOT ENOUGH ({what}), running anyway", None, est
    fixes = "use a smaller image size or a narrower model (--width)"
    if est.unfold and short is not None:
        dtype = next((p.dtype for p in model.parameters()), torch.float32)
        if dtype == torch.float64:
            lighter = copy.deepcopy(model).to("meta", torch.float32)
            f32 = estimate_memory(lighter, image_hw, batch, plan, pc.device.type)
            host, _, _, ranks = short
            fixes += (
                ", or --dtype float32 (about "
                f"{_gib(f32.host_bytes(ranks, host == ref_host))} on {host})"
            )
    fixes += "; --no-memory-check (memory_check=False) runs it anyway"
    return text, ("memory estimate", what, fixes), est


def _gib(n: int) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"
