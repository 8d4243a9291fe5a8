"""BatchNorm running statistics over replicas: every replica ends a step with the reference's.

Why this is needed at all: BatchNorm's batch statistics are exact inside a stage (an
all-reduce over the tiles of each micro-batch), but each data replica -- and each of the two
mirrored copies of a stage under the bi-directional schedule -- updates its *running*
statistics from its own micro-batches only. The single-process reference splits the global
batch (replica 0's rows first) into ``dp x copies x micro-batches`` micro-batches and updates
once per micro-batch, in that order.

Why one all-reduce suffices: the update ``r <- (1 - m) r + m x`` is affine. Replica ``d`` ran
``k`` updates from the shared start ``r0``, so ``r_d = a r0 + c_d`` with ``a = (1 - m)^k``;
replicas in order ``0, 1, ..., D - 1`` give ``a^D r0 + sum_d a^(D-1-d) c_d``. Each replica
computes its weighted share :func:`running_stats_increment`, one sum over the replicas adds
them, and :func:`running_stats_merge` rebuilds the statistic. With ``momentum=None`` (the
cumulative average) the shares are the replicas' sums of batch statistics and simply add up.
The arithmetic is done in float64 and written back in the buffers' dtype.

Bi-directional (GEMS): copy ``h`` (A = 0, B = 1) of data replica ``d`` is replica
``2 d + h`` (the reference runs ``d``'s first half, then its second half); the shares are
summed over the mirror pair as well as over ``dp``.

Everything of it lives here (:class:`ReplicaRunningStats`, built once by
:func:`apply_running_stats`): the engine only wraps each training step in
:meth:`ReplicaRunningStats.merged`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hyfi_imaging.parallel.launch import ParallelContext
from hyfi_imaging.parallel.schedules import LocalStage

__all__ = [
    "ReplicaRunningStats",
    "apply_running_stats",
    "running_stats_increment",
    "running_stats_merge",
]

#: A norm's running mean, running variance and update count before a step.
Snapshot = list[tuple[Tensor, Tensor, int]]


def running_stats_increment(
    now: Tensor,
    start: Tensor,
    *,
    n0: int,
    k: int,
    momentum: float | None,
    replica: int,
    replicas: int,
) -> Tensor:
    """One replica's share of the merged running statistic (sum the shares over replicas).

    ``start`` is the statistic before the step (``n0`` updates so far), ``now``
    after this replica's ``k`` updates. Momentum ``m``: ``now = a start + c``
    with ``a = (1 - m)^k``, and replica ``d`` of ``D`` contributes
    ``a^(D-1-d) c``. ``momentum=None`` (cumulative average): the contribution is
    the sum of the replica's batch statistics, ``(n0 + k) now - n0 start``.
    """
    now, start = now.detach().double(), start.detach().double()
    if momentum is None:
        return (n0 + k) * now - n0 * start
    a = (1.0 - momentum) ** k
    return a ** (replicas - 1 - replica) * (now - a * start)


def running_stats_merge(
    total: Tensor, start: Tensor, *, n0: int, k: int, momentum: float | None, replicas: int
) -> Tensor:
    """The statistic after ``replicas x k`` updates in replica order, from the summed shares."""
    start = start.detach().double()
    if momentum is None:
        return (n0 * start + total) / (n0 + replicas * k)
    return (1.0 - momentum) ** (k * replicas) * start + total


class ReplicaRunningStats:
    """The running statistics of one rank's stages, merged over the replicas after each step.

    ``stages`` pairs each model stage this rank holds with its module (the copy of a
    stage is its :attr:`LocalStage.replica`); ``data_replica`` is this rank's ``dp``
    coordinate, ``copies`` the copies of every stage per data replica, and ``groups``
    the process groups the shares are summed over, in order (the mirror pair, then
    ``dp``). With one replica in all there is nothing to merge and :meth:`merged` does
    nothing (no float64 round trip of the buffers either).
    """

    def __init__(
        self,
        module: nn.Module,
        stages: Sequence[tuple[LocalStage, nn.Module]],
        *,
        data_replica: int,
        replicas: int,
        copies: int,
        groups: Sequence[ProcessGroup],
    ) -> None:
        self.module, self.groups = module, list(groups)
        self.replicas, self.copies, self.data_replica = replicas, copies, data_replica
        self._copy_of = {id(m): ls.replica for ls, sub in stages for m in sub.modules()}

    def norms(self) -> list[nn.modules.batchnorm._BatchNorm]:
        """The norms that keep running statistics, in model order (the same on every copy)."""
        return [
            m
            for m in self.module.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and m.track_running_stats
            and m.running_mean is not None
        ]

    def snapshot(self) -> Snapshot:
        """Every norm's statistics and count before a step (the shared start ``r0``)."""
        out = []
        for m in self.norms():
            assert m.running_mean is not None and m.running_var is not None
            assert m.num_batches_tracked is not None
            out.append((m.running_mean.clone(), m.running_var.clone(), int(m.num_batches_tracked)))
        return out

    def merge(self, snapshot: Snapshot) -> None:
        """Running statistics as if one process had run every replica's micro-batches in order."""
        norms = self.norms()
        if not norms:
            return
        n_rep = self.replicas
        parts: list[Tensor] = []
        for m, (r0m, r0v, n0) in zip(norms, snapshot, strict=True):
            assert m.running_mean is not None and m.running_var is not None
            assert m.num_batches_tracked is not None
            k = int(m.num_batches_tracked) - n0
            replica = self.copies * self.data_replica + self._copy_of.get(id(m), 0)
            for now, r0 in ((m.running_mean, r0m), (m.running_var, r0v)):
                parts.append(
                    running_stats_increment(
                        now, r0, n0=n0, k=k, momentum=m.momentum, replica=replica, replicas=n_rep
                    ).reshape(-1)
                )
        flat = torch.cat(parts)
        for group in self.groups:
            dist.all_reduce(flat, group=group)
        offset = 0
        with torch.no_grad():
            for m, (r0m, r0v, n0) in zip(norms, snapshot, strict=True):
                assert m.num_batches_tracked is not None
                k = int(m.num_batches_tracked) - n0
                for buf, r0 in ((m.running_mean, r0m), (m.running_var, r0v)):
                    assert buf is not None
                    total = flat[offset : offset + r0.numel()].view_as(r0)
                    offset += r0.numel()
                    merged = running_stats_merge(
                        total, r0, n0=n0, k=k, momentum=m.momentum, replicas=n_rep
                    )
                    buf.copy_(merged)
                m.num_batches_tracked.fill_(n0 + n_rep * k)

    @contextmanager
    def merged(self) -> Iterator[None]:
        """Around one training step: snapshot before it, merge after it (not after an error)."""
        if self.replicas == 1:
            yield
            return
        snapshot = self.snapshot()
        yield
        self.merge(snapshot)


def apply_running_stats(
    module: nn.Module,
    stages: Sequence[tuple[LocalStage, nn.Module]],
    pc: ParallelContext,
    *,
    copies: int,
    copy_groups: Sequence[ProcessGroup],
) -> ReplicaRunningStats:
    """The running-statistics merge of a rank's stages: over the copies' groups, then ``dp``."""
    dp = pc.layout.dp
    return ReplicaRunningStats(
        module,
        stages,
        data_replica=pc.coords[0],
        replicas=dp * copies,
        copies=copies,
        groups=[*copy_groups, *([pc.group("dp")] if dp > 1 else [])],
    )
