"""The one-process reference of a verification, computed on one rank and shared with the others.

Why one rank: the reference trains the whole model on the whole image, the very thing the
layout exists to avoid, and in float64 on the CPU (``hyfi-verify``'s default) its
convolutions unfold their input too (:func:`~.memory.cpu_unfold_bytes`). Computed on every
rank, four ranks of ``hyfi-verify --model unet3d --image-size 40x48x56 --spatial 2x1x2``
needed 4 x 11.8 GB and were killed for memory on a 24 GiB machine. Here rank
:data:`REFERENCE_RANK` computes it between the layout's steps, while the others wait
(holding only their state), and broadcasts what each rank compares: the tensors travel
unchanged, so every comparison is exactly as strict as when each rank computed its own.

Why a group of its own: the waiting ranks may wait minutes for one whole-image step, longer
than the job's collective timeout, which is there to catch dead ranks. A dead rank closes
its sockets, so the others still learn of it at once; the long timeout only bounds a live
rank that never finishes. Gloo on the CPU whatever the job's backend: the reference lives on
the CPU. While the others wait, the reference's rank also uses their CPU threads.

An exception in the reference is raised on every rank (the others would otherwise wait for
a broadcast that never comes), as a :class:`~hyfi_imaging.errors.HyfiError` where it was one.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor

from hyfi_imaging.errors import ConfigError, HyfiError
from hyfi_imaging.parallel.launch import ParallelContext, launch_env

__all__ = ["REFERENCE_RANK", "REFERENCE_TIMEOUT", "ReferenceLink", "TensorSpec"]

#: The rank that computes the one-process reference.
REFERENCE_RANK = 0
#: How long the other ranks wait for one reference step (see the module docstring).
REFERENCE_TIMEOUT = datetime.timedelta(hours=6)
#: The link's group is Gloo whatever the job's backend: its tensors live on the CPU.
LINK_DEVICE = torch.device("cpu")

#: A tensor's name, shape and dtype, which a receiving rank knows without the tensor.
TensorSpec = tuple[str, tuple[int, ...], torch.dtype]
T = TypeVar("T")


class ReferenceLink:
    """Rank :data:`REFERENCE_RANK` (``holder``) to every rank of ``pc``'s job; :meth:`close` it
    while the job's process group is alive."""

    def __init__(self, pc: ParallelContext) -> None:
        self.holder = pc.rank == REFERENCE_RANK
        self.group = (
            dist.new_group(backend="gloo", timeout=REFERENCE_TIMEOUT) if pc.world_size > 1 else None
        )

    def close(self) -> None:
        """Destroy the link's group (collective)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def compute(self, fn: Callable[[], T]) -> T | None:
        """``fn()`` on the holder with the node's CPU threads; None on the others. An exception
        of ``fn`` is raised on every rank."""
        result, failure = None, None
        if self.holder:
            try:
                with _node_threads():
                    result = fn()
            except Exception as err:
                if self.group is None:
                    raise
                failure = err
        if self.group is not None:
            box: list[object] = [None if failure is None else _describe(failure)]
            dist.broadcast_object_list(box, src=REFERENCE_RANK, group=self.group)
            if box[0] is not None:
                if failure is not None:
                    raise failure
                raise _rebuild(box[0])
        return result

    def share(self, value: Tensor | None) -> Tensor:
        """The holder's ``value`` (any shape, as float64: lossless for every float dtype) on
        every rank."""
        if self.group is None:
            assert value is not None
            return value.detach().double()
        head = torch.zeros(9, dtype=torch.int64, device=LINK_DEVICE)
        if self.holder:
            assert value is not None and value.dim() <= 8, "a reference tensor of up to 8 dims"
            head[0] = value.dim()
            head[1 : 1 + value.dim()] = torch.tensor(value.shape, dtype=torch.int64)
        dist.broadcast(head, src=REFERENCE_RANK, group=self.group)
        shape = tuple(int(v) for v in head[1 : 1 + int(head[0])])
        return self._send(value, shape, torch.float64)

    def share_named(
        self,
        values: Mapping[str, Tensor | None] | None,
        specs: Sequence[TensorSpec],
        keep: set[str],
    ) -> dict[str, Tensor | None]:
        """The holder's ``values`` (by the names of ``specs``, each of that shape and dtype; None
        for a missing one), of which each rank keeps the names in ``keep``: one tensor in
        flight at a time, so a rank holds no more than its own share."""
        present = torch.zeros(len(specs), dtype=torch.int32, device=LINK_DEVICE)
        if self.holder:
            assert values is not None
            present = torch.tensor(
                [values.get(n) is not None for n, _, _ in specs],
                dtype=torch.int32,
                device=LINK_DEVICE,
            )
        if self.group is not None:
            dist.broadcast(present, src=REFERENCE_RANK, group=self.group)
        out: dict[str, Tensor | None] = {}
        for (name, shape, dtype), here in zip(specs, present.tolist(), strict=True):
            value = values.get(name) if self.holder and values is not None else None
            got = self._send(value, shape, dtype) if here else None
            if name in keep:
                out[name] = got
        return out

    def _send(self, value: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        if self.holder:
            assert value is not None
            buf = value.detach().to(LINK_DEVICE, dtype).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype, device=LINK_DEVICE)
        if self.group is not None:
            dist.broadcast(buf, src=REFERENCE_RANK, group=self.group)
        return buf


@contextlib.contextmanager
def _node_threads() -> Iterator[None]:
    """The threads of every rank of this node (they wait for the reference), at most its CPUs."""
    before = torch.get_num_threads()
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    wanted = min(cpus, before * max(1, launch_env().local_world_size))
    if wanted > before:
        torch.set_num_threads(wanted)
    try:
        yield
    finally:
        if wanted > before:
            torch.set_num_threads(before)


def _describe(err: Exception) -> tuple[str, str, str, str]:
    """What the other ranks need to raise ``err`` again: kind, then where/what/fix or the text."""
    if isinstance(err, HyfiError):
        return ("config" if isinstance(err, ConfigError) else "hyfi", err.where, err.what, err.fix)
    return ("other", type(err).__name__, str(err), "")


def _rebuild(info: object) -> Exception:
    kind, where, what, fix = cast(tuple[str, str, str, str], info)
    if kind == "config":
        return ConfigError(where, what, fix)
    if kind == "hyfi":
        return HyfiError(where, what, fix)
    return RuntimeError(f"rank {REFERENCE_RANK}, in the one-process reference: {where}: {what}")
