"""Schedules with two stages per rank: bi-directional replicas (GEMS-MASTER) and torch's V schedules.

Which model stages a rank holds (:func:`local_stages`):

* ``gpipe``, ``1f1b``: stage ``r`` on pipeline rank ``r`` (``torch.distributed.pipelining``'s
  ``ScheduleGPipe`` / ``Schedule1F1B``);
* ``interleaved1f1b``: the model is cut into ``2P`` stages, ``r`` and ``r + P`` on rank ``r``
  (torch's ``ScheduleInterleaved1F1B``, loop placement);
* ``zbv``, ``dualpipev``: ``2P`` stages, ``r`` and ``2P - 1 - r`` on rank ``r`` (torch's
  ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``, V placement);
* ``bidirectional``: *two replicas* of a ``P``-stage model (GEMS-MASTER, as in Hy-Fi): rank ``r``
  holds stage ``r`` of replica A and stage ``P - 1 - r`` of replica B. Replica A runs the first
  half of every data replica's micro-batches left to right, replica B the second half right to
  left, interleaved on every rank so that each fills the other's bubble.

Why the bi-directional runner is our own (:class:`BidirectionalSchedule`) and the V schedules are
torch's: every torch runtime (``PipelineScheduleMulti`` and its custom-order
``_PipelineScheduleRuntime`` included) executes *one* chain of stage indices with one input at
stage 0 and one loss at the last stage. GEMS runs two chains -- two inputs, two losses, two
copies of every stage -- over the same ranks, which no stage numbering of a single chain
expresses (A's last stage would have to send to nobody and compute a loss in the middle of the
chain). The runner therefore drives two ordinary ``PipelineStage`` objects with torch's own
per-micro-batch methods (``forward_one_chunk``, ``backward_one_chunk``, the P2P op builders,
``perform_reduce_grad`` for FSDP2); only the *order* of their actions is ours
(:func:`bidirectional_order`). Replica B talks over a second process group on the same ranks,
so its messages never match replica A's, and its stage-to-rank map is reversed (the same
attribute torch's multi-stage schedules set).

Exactness (DESIGN.md invariant 6): the per-replica batch is split into ``m`` micro-batches as in
the one-process reference; A takes micro-batches ``0 .. m/2 - 1``, B the rest, each with the loss
term ``loss / (dp x m)``. The two copies of a stage hold the gradients of their own halves;
one all-reduce over the *mirror* pair (pipeline ranks ``r`` and ``P - 1 - r``, same tile and data
replica) adds them, so both copies hold the gradient of the whole batch and take identical
optimizer steps. Before a step, the B copy's gradient is dropped (the A copy keeps what was
accumulated), so accumulation across ``train_step`` calls counts it once. BatchNorm running
statistics: the two copies are two more "replicas" of the affine recurrence (see
:mod:`.running_stats`), merged in reference order
(data replica ``d``'s A half, then its B half, then ``d + 1``'s ...).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.pipelining.schedules import (
    FORWARD,
    PipelineScheduleMulti,
    _Action,
    _add_send_recv,
    _add_unshard_reshard,
    _PipelineScheduleRuntime,
    get_schedule_class,
)
from torch.distributed.tensor import DTensor

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.pipeline import schedule_order

__all__ = [
    "SCHEDULES",
    "TORCH_MULTI",
    "BidirectionalSchedule",
    "LocalStage",
    "MirrorGroups",
    "ScheduleAction",
    "add_mirror_grads",
    "bidirectional_order",
    "check_schedule",
    "eval_last_rank",
    "forward_only",
    "local_stages",
    "model_stages",
    "mirror_groups",
    "mirror_input_grad",
    "mirror_outputs",
    "peak_in_flight",
    "schedule_actions",
    "gems_queues",
    "simulate",
    "simulate_orders",
]

#: Every value of ``parallel.schedule`` / ``--schedule``.
SCHEDULES = ("gpipe", "1f1b", "bidirectional", "interleaved1f1b", "zbv", "dualpipev")
#: Our names of torch's multi-stage schedules -> ``get_schedule_class`` names.
TORCH_MULTI = {
    "interleaved1f1b": "Interleaved1F1B",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}


@dataclass(frozen=True)
class LocalStage:
    """One model stage a rank holds: ``replica`` 0 (A) or 1 (B, bidirectional only), ``index``."""

    replica: int
    index: int


def model_stages(schedule: str, pp: int) -> int:
    """How many stages the model is cut into: ``2 pp`` for torch's multi-stage schedules."""
    return 2 * pp if schedule in TORCH_MULTI else pp


def local_stages(schedule: str, pp: int, rank: int) -> tuple[LocalStage, ...]:
    """The stages pipeline rank ``rank`` holds, in the order the runtime lists them."""
    if schedule == "bidirectional":
        return (LocalStage(0, rank), LocalStage(1, pp - 1 - rank))
    if schedule == "interleaved1f1b":
        return (LocalStage(0, rank), LocalStage(0, rank + pp))
    if schedule in ("zbv", "dualpipev"):
        return (LocalStage(0, rank), LocalStage(0, 2 * pp - 1 - rank))
    return (LocalStage(0, rank),)


def eval_last_rank(schedule: str, pp: int) -> int:
    """Pipeline rank of the last stage of the pipeline ``predict`` runs (replica A for GEMS)."""
    return 0 if schedule in ("zbv", "dualpipev") else pp - 1


def check_schedule(schedule: str, layout: Layout, microbatches: int) -> None:
    """ConfigError (one line: where, what, fix) unless ``schedule`` runs on ``layout`` with
    ``microbatches`` micro-batches per replica. Pure: no process group, no compute."""
    pp, m = layout.pp, microbatches
    where = f"--schedule {schedule} --pipeline {pp} --microbatches {m}"
    if schedule not in SCHEDULES:
        raise ConfigError(
            f"--schedule {schedule}",
            "is not a schedule",
            "use gpipe or 1f1b (one pipeline), or bidirectional, interleaved1f1b, zbv, "
            "dualpipev (two stages per rank)",
        )
    if schedule in ("gpipe", "1f1b"):
        return
    if pp < 2:
        raise ConfigError(
            where,
            f"{schedule} places two stages on each of several pipeline ranks",
            "use --pipeline 2 or more",
        )
    if schedule == "bidirectional":
        if pp % 2:
            raise ConfigError(
                where,
                "two mirrored replicas need an even number of pipeline ranks (the middle rank would hold both copies of one stage)",
                f"use {_either(pp + 1, pp - 1)} pipeline ranks "
                "(--pipeline, or parallel.pipeline in a recipe)",
            )
        if m % 2:
            raise ConfigError(
                where,
                "each of the two replicas takes half of the micro-batches, so their number must be even",
                f"use {_either(m + 1, m - 1)} micro-batches, a count that divides the batch "
                "(--microbatches, or parallel.microbatches in a recipe)",
            )
    elif schedule == "interleaved1f1b":
        rounds = max(1, m // pp)
        if m % rounds:
            raise ConfigError(
                where,
                f"Interleaved1F1B runs the micro-batches in {rounds} equal rounds of {pp} ranks",
                f"use a multiple of {pp} micro-batches, e.g. {pp * rounds}",
            )
    elif schedule == "dualpipev" and m < 2 * pp:
        raise ConfigError(
            where,
            f"DualPipeV needs at least as many micro-batches as model stages ({2 * pp})",
            f"use --microbatches {2 * pp} or more",
        )
    elif schedule == "zbv" and m < pp:
        raise ConfigError(
            where,
            f"ZBVZeroBubble needs at least as many micro-batches as pipeline ranks ({pp})",
            f"use --microbatches {pp} or more",
        )
    if schedule in TORCH_MULTI:
        get_schedule_class(TORCH_MULTI[schedule])  # the installed torch has it


def forward_only(
    stages: list[PipelineStage], microbatches: int, schedule: str, pp: int
) -> PipelineScheduleMulti:
    """Evaluation (no loss, no backward) of a multi-stage placement on torch's runtime.

    ZBV's and DualPipeV's own orders cannot run without a backward (their same-rank
    stage-to-stage hand-over expects one), so evaluation loads a custom compute-only order
    into ``_PipelineScheduleRuntime``: every rank runs its stages in model order, each over
    all micro-batches -- a topological order, so it cannot deadlock. Torch lowers it to
    unshard and send/receive actions (its own validation, which insists on one backward per
    forward, is the one step skipped); the stage-to-rank map is read off the order.
    """
    runtime = _PipelineScheduleRuntime(stages, microbatches, loss_fn=None, scale_grads=False)
    order: dict[int, list[_Action | None]] = {
        r: [
            _Action(ls.index, FORWARD, i)
            for ls in sorted(local_stages(schedule, pp, r), key=lambda ls: ls.index)
            for i in range(microbatches)
        ]
        for r in range(pp)
    }
    mapping = {a.stage_index: r for r, acts in order.items() for a in acts if a is not None}
    runtime.stage_index_to_group_rank = mapping
    for stage in stages:
        stage.stage_index_to_group_rank = mapping
    runtime.pipeline_order_with_comms = _add_send_recv(
        {r: _add_unshard_reshard(acts) for r, acts in order.items()},
        stage_to_rank=lambda s: mapping[s],
        num_stages=runtime._num_stages,
    )
    return runtime


# ----------------------------------------------------------------------------- GEMS order


Action = tuple[int, str, int]  # (replica, "F" | "B", micro-batch of that replica)


def gems_queues(pp: int, half: int) -> list[list[list[ScheduleAction]]]:
    """Per pipeline rank, the two 1F1B orders it interleaves: replica A's stage ``r`` and
    replica B's stage ``pp - 1 - r``, ``half`` micro-batches each (for :func:`simulate`)."""
    inner = schedule_order("1f1b", pp, half)
    return [
        [
            [(0, r, k, i) for k, i in inner[r]],
            [(1, pp - 1 - r, k, i) for k, i in inner[pp - 1 - r]],
        ]
        for r in range(pp)
    ]


def bidirectional_order(pp: int, half: int) -> list[list[Action]]:
    """Per pipeline rank, the merged ``(replica, kind, micro-batch)`` actions of both replicas.

    Each replica keeps its own 1F1B order per stage; a rank, when free, starts whichever of its
    two replicas' next actions can start earliest (:func:`simulate`). The result is a valid
    timed execution, so ordering each rank's actions by start time gives a deadlock-free order
    for blocking receives and non-blocking sends.
    """
    times = simulate(gems_queues(pp, half), pp)
    out: list[list[Action]] = [[] for _ in range(pp)]
    for (rep, _, kind, i), (r, _start, _) in sorted(times.items(), key=lambda kv: kv[1][1]):
        out[r].append((rep, kind, i))
    return out


# ----------------------------------------------------------------------------- every schedule's order

#: One compute action of a rank: (chain, model stage, kind, micro-batch of that chain). Chain 1 is
#: GEMS's replica B; kinds ``F``, ``B`` (full backward), ``I`` / ``W`` (input / weight backward).
ScheduleAction = tuple[int, int, str, int]
#: When each action runs: ``{action: (rank, start, end)}`` (:func:`simulate`).
Timeline = dict[ScheduleAction, tuple[int, float, float]]
#: Unit costs of :func:`simulate`: a backward is two forwards, split evenly into I and W.
UNIT_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def _torch_rank_orders(schedule: str, pp: int, microbatches: int) -> list[list[ScheduleAction]]:
    """The compute actions torch's multi-stage schedule plans for every rank, without stages.

    Torch computes each rank's order from a handful of counts in the schedule's constructor
    (``_calculate_single_rank_operations``), which otherwise needs live ``PipelineStage`` objects
    and a process group; a bare instance with those counts set runs torch's own arithmetic, so
    the planner and the benchmark replay exactly the orders training runs. Call
    :func:`check_schedule` first: torch's invalid inputs are not re-checked here.
    """
    cls = get_schedule_class(TORCH_MULTI[schedule])
    bare: Any = object.__new__(cls)
    bare.pp_group_size, bare._n_microbatches, bare.n_local_stages = pp, microbatches, 2
    bare._num_stages = bare.num_stages = 2 * pp
    bare.number_of_rounds = max(1, microbatches // pp)
    bare.microbatches_per_round = microbatches // bare.number_of_rounds
    out: list[list[ScheduleAction]] = []
    for r in range(pp):
        flat: list[ScheduleAction] = []
        for a in bare._calculate_single_rank_operations(r):
            for b in (a.sub_actions or (a,)) if a is not None else ():
                flat.append((0, b.stage_index, b.computation_type.value, int(b.microbatch_index)))
        out.append(flat)
    return out


def schedule_actions(schedule: str, pp: int, microbatches: int) -> list[list[ScheduleAction]]:
    """Every pipeline rank's compute actions in the order training runs them, for any schedule.

    GPipe and 1F1B: :func:`~.pipeline.schedule_order` (stage ``r`` on rank ``r``); GEMS:
    :func:`bidirectional_order` (each replica ``microbatches / 2``); torch's multi-stage
    schedules: torch's own orders (:func:`_torch_rank_orders`).
    """
    if schedule in ("gpipe", "1f1b"):
        return [
            [(0, r, k, i) for k, i in o]
            for r, o in enumerate(schedule_order(schedule, pp, microbatches))
        ]
    if schedule == "bidirectional":
        out = []
        for r, order in enumerate(bidirectional_order(pp, microbatches // 2)):
            stage = {ls.replica: ls.index for ls in local_stages(schedule, pp, r)}
            out.append([(c, stage[c], k, i) for c, k, i in order])
        return out
    return _torch_rank_orders(schedule, pp, microbatches)


def _dependency(
    action: ScheduleAction, stages: int, done: dict[ScheduleAction, Any]
) -> ScheduleAction | None:
    """The action ``action`` waits for: a forward, the previous stage's forward of the same
    micro-batch (same chain); a backward (or input-backward), the next stage's (the last
    stage's, its own forward); a weight-backward, its own input-backward."""
    c, s, kind, i = action
    if kind == "F":
        return (c, s - 1, "F", i) if s > 0 else None
    if kind == "W":
        return (c, s, "I", i)
    if s == stages - 1:
        return (c, s, "F", i)
    nxt = [(c, s + 1, k, i) for k in ("B", "I")]
    return next((d for d in nxt if d in done), nxt[0])


def simulate(
    queues: Sequence[Sequence[Sequence[ScheduleAction]]],
    stages: int,
    cost: Callable[[int, str], float] | None = None,
) -> Timeline:
    """The schedule simulator: when every action runs, ``{action: (rank, start, end)}``.

    ``queues[r]`` are rank ``r``'s action queues. One queue is a fixed order, replayed (every
    schedule training runs, :func:`schedule_actions`); with several (GEMS's two replicas,
    :func:`gems_queues`), a free rank starts whichever queue's next action can start earliest
    (ties: a backward first, to free activations, then chain A). ``cost(stage, kind)`` is an
    action's duration (default :data:`UNIT_COST`); dependencies as :func:`_dependency`. The one
    simulator behind the GEMS order, the planner's step time (:mod:`.plan`), the benchmark's
    bubbles and the plan picture. Raises if the queues deadlock.
    """
    price = cost or (lambda _s, kind: UNIT_COST[kind])
    pos = [[0] * len(q) for q in queues]
    free = [0.0] * len(queues)
    done: Timeline = {}
    total = sum(len(q) for rank in queues for q in rank)
    while len(done) < total:
        best: tuple[tuple[float, int, int, int, int], ScheduleAction] | None = None
        for r, mine in enumerate(queues):
            for k, queue in enumerate(mine):
                if pos[r][k] >= len(queue):
                    continue
                action = queue[pos[r][k]]
                dep = _dependency(action, stages, done)
                if dep is not None and dep not in done:
                    continue
                start = max(free[r], done[dep][2] if dep is not None else 0.0)
                key = (start, 0 if action[2] != "F" else 1, action[0], r, k)
                if best is None or key < best[0]:
                    best = (key, action)
        if best is None:
            raise RuntimeError("the order deadlocks")
        (start, _, _, r, k), action = best
        end = start + price(action[1], action[2])
        done[action] = (r, start, end)
        free[r] = end
        pos[r][k] += 1
    return done


def simulate_orders(
    orders: list[list[ScheduleAction]],
    stages: int,
    cost: Callable[[int, str], float] | None = None,
) -> tuple[float, float]:
    """Replay every rank's action order (:func:`simulate`); returns (makespan, idle fraction
    of ranks x makespan). Used for the bubbles of ``benchmarks/bench_schedules.py`` (unit
    costs) and the step time of :mod:`.plan` (each stage's predicted costs)."""
    price = cost or (lambda _s, kind: UNIT_COST[kind])
    times = simulate([[o] for o in orders], stages, price)
    span = max((end for _, _, end in times.values()), default=0.0)
    busy = sum(price(a[1], a[2]) for o in orders for a in o)
    return span, 1.0 - busy / (len(orders) * span) if span else 0.0


def peak_in_flight(
    order: list[ScheduleAction],
    weight: Callable[[int, int], int],
    split: Callable[[int, int], int] | None = None,
    during: Callable[[int, int], int] | None = None,
) -> int:
    """Most bytes a rank keeps at once over its ``order``.

    A forward keeps ``weight(chain, stage)`` (its micro-batch's activations) until its full
    (``B``) or weight (``W``) backward. Torch's input-only backward (``I``, ZBV/DualPipeV)
    retains the graph for the weight backward and also keeps the gradients of the intermediates
    the weights need (``stage_backward_input``'s param groups): ``split(chain, stage)`` more,
    until the ``W``. ``during(chain, stage)``: a backward's working set on top of what is kept
    while it runs (so that a stage's transient counts with what is alive at *its* backward,
    not with another stage's activations that are gone by then).
    """
    extra = split or (lambda _c, _s: 0)
    working = during or (lambda _c, _s: 0)
    alive = peak = 0
    for c, s, kind, _ in order:
        if kind in ("B", "I", "W"):
            peak = max(peak, alive + working(c, s))
        if kind == "F":
            alive += weight(c, s)
        elif kind == "I":
            alive += extra(c, s)
        elif kind == "B":
            alive -= weight(c, s)
        elif kind == "W":
            alive -= weight(c, s) + extra(c, s)
        peak = max(peak, alive)
    return peak


# ----------------------------------------------------------------------------- groups


@dataclass
class MirrorGroups:
    """This rank's extra process groups for GEMS: replica B's pipeline, and the mirror pair."""

    pipeline_b: ProcessGroup
    mirror: ProcessGroup


def mirror_groups(mesh: torch.Tensor, rank: int) -> MirrorGroups:
    """Create (collectively, on every rank) replica B's pipeline groups and the mirror pairs.

    ``mesh`` is the layout's rank tensor ``(dp, pp, *tile axes)``. Every rank creates every group in
    the same order (``new_group`` is collective) and keeps those it belongs to. A pipeline row is
    the ranks of one ``(dp, tile)`` along ``pp``; its mirror pairs are ``(r, pp - 1 - r)``.
    """
    pp = int(mesh.shape[1])
    rows = mesh.movedim(1, -1).reshape(-1, pp).tolist()
    mine_b: ProcessGroup | None = None
    mine_m: ProcessGroup | None = None
    for row in rows:
        g = dist.new_group(ranks=row)
        if rank in row:
            mine_b = g
        for r in range(pp // 2):
            pair = [row[r], row[pp - 1 - r]]
            h = dist.new_group(ranks=sorted(pair))
            if rank in pair:
                mine_m = h
    assert mine_b is not None and mine_m is not None
    return MirrorGroups(mine_b, mine_m)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# ----------------------------------------------------------------------------- runner


class BidirectionalSchedule:
    """One training step of two mirrored replicas on this rank: ``step(*args, target, losses)``.

    ``stages`` are replica A's stage ``r`` and replica B's stage ``P - 1 - r`` (``PipelineStage``
    objects over the ``pp`` group and replica B's group, B's stage-to-rank map reversed);
    ``microbatches`` is the per-replica count ``m`` (even). ``step`` returns the whole per-replica
    batch's outputs on the ranks holding a last stage (both halves, exchanged over the mirror
    pair), completes the input's gradient on the ranks holding a first stage the same way, and
    leaves in ``.grad`` of both copies of every stage the gradient of the whole batch.
    """

    def __init__(
        self,
        stages: tuple[PipelineStage, PipelineStage],
        microbatches: int,
        loss_fn: Callable[[Tensor, Tensor], Tensor] | None,
        *,
        mirror: ProcessGroup,
        pipeline_rank: int,
        pipeline_size: int,
    ) -> None:
        self.stages = stages
        self.m, self.half = microbatches, microbatches // 2
        self.loss_fn = loss_fn
        self.mirror = mirror
        self.order = bidirectional_order(pipeline_size, self.half)[pipeline_rank]
        # Only for torch's stage set-up (P2P warm-up vote, static buffers): one single-stage
        # schedule per replica, never stepped.
        self._init = [
            ScheduleGPipe(s, self.half, loss_fn=loss_fn, scale_grads=False) for s in stages
        ]
        self._ready = False

    def _split(self, t: Tensor | None, replica: int) -> list[Tensor | None]:
        if t is None:
            return [None] * self.half
        chunks = t.tensor_split(self.m)
        return list(chunks[replica * self.half : (replica + 1) * self.half])

    def step(
        self, *args: Tensor, target: Tensor | None = None, losses: list[Tensor] | None = None
    ) -> Tensor | None:
        train = self.loss_fn is not None
        x = args[0] if args else None
        inputs = [self._split(x, rep) for rep in (0, 1)]
        targets = [self._split(target, rep) for rep in (0, 1)]
        for rep, (stage, sched) in enumerate(zip(self.stages, self._init, strict=True)):
            stage.has_backward = train
            stage.clear_runtime_states()
            if not self._ready:
                first = inputs[rep][0] if stage.is_first else None
                sched._initialize_stage((first,) if first is not None else (), {}, targets[rep][0])
        self._ready = True
        a_copy, b_copy = self.stages[0].submod, self.stages[1].submod
        for p in b_copy.parameters():  # the A copy keeps what earlier steps accumulated
            p.grad = None
        before = None if x is None or x.grad is None else x.grad.detach().clone()

        works: list[dist.Work] = []
        terms: list[list[Tensor]] = [[], []]
        for rep, kind, i in self.order:
            stage = self.stages[rep]
            if kind == "F":
                recv = stage.get_fwd_recv_ops(i)
                if recv:
                    for w in dist.batch_isend_irecv(recv):
                        w.wait()
                arg = inputs[rep][i]
                out = stage.forward_one_chunk(
                    i, (arg,) if stage.is_first and arg is not None else (), None
                )
                if stage.is_last and self.loss_fn is not None:
                    tgt = targets[rep][i]
                    assert tgt is not None
                    terms[rep].append(self.loss_fn(out, tgt))
                send = stage.get_fwd_send_ops(i)
            else:
                recv = stage.get_bwd_recv_ops(i)
                if recv:
                    for w in dist.batch_isend_irecv(recv):
                        w.wait()
                loss = terms[rep][i] if stage.is_last else None
                stage.backward_one_chunk(i, loss=loss, last_backward=i == self.half - 1)
                send = stage.get_bwd_send_ops(i)
            # Sends are never waited for before the step's end: a rank blocks only on receives,
            # which the simulated order guarantees are sent (see bidirectional_order).
            if send:
                works.extend(dist.batch_isend_irecv(send))
        for w in works:
            w.wait()
        if train:
            for stage in self.stages:
                stage.perform_reduce_grad(1)  # FSDP2's reduce-scatter over dp x sp
            indices = (self.stages[0].stage_index, self.stages[1].stage_index)
            add_mirror_grads(list(zip(indices, (a_copy, b_copy), strict=True)), self.mirror)
        if losses is not None:
            losses.clear()
            losses.extend([*terms[0], *terms[1]])
        if x is not None and train:
            mirror_input_grad(x, before, self.mirror)
        return self._outputs()

    def _outputs(self) -> Tensor | None:
        """The whole per-replica batch's outputs on a rank that holds a last stage, else None."""
        lasts = [s for s in self.stages if s.is_last]
        if not lasts:
            return None
        stage = lasts[0]
        mine = torch.cat([_as_tensor(o) for o in stage.output_chunks])
        return mirror_outputs(mine, self.stages.index(stage), self.mirror)


# ----------------------------------------------------------------------------- the mirror pair


def add_mirror_grads(copies: Sequence[tuple[int, nn.Module]], mirror: ProcessGroup) -> None:
    """Sum each stage's gradient over its two copies (this rank and its mirror), in place.

    ``copies``: the ``(model stage, module)`` this rank holds. Both ranks of a pair list their
    stages by stage index, so element ``k`` of the flat vector is the same parameter element
    (the same FSDP shard: mirror ranks share tile and data coordinates) on both."""
    ordered = [mod for _, mod in sorted(copies, key=lambda c: c[0])]
    params = [p for mod in ordered for p in mod.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.detach().reshape(-1) for g in grads])
    dist.all_reduce(flat, group=mirror)
    offset = 0
    with torch.no_grad():
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def mirror_input_grad(x: Tensor, before: Tensor | None, mirror: ProcessGroup) -> None:
    """Complete the input's gradient: this rank computed one half's, its mirror the other's
    (``before``: what ``x.grad`` held before the step, kept once)."""
    if x.grad is None:
        return
    grad = x.grad.detach()
    inc = grad if before is None else grad - before
    dist.all_reduce(inc, group=mirror)
    with torch.no_grad():
        grad.copy_(inc if before is None else before + inc)


def mirror_outputs(mine: Tensor, replica: int, mirror: ProcessGroup) -> Tensor:
    """The whole per-replica batch's outputs from this rank's half (``replica`` 0: the first
    half) and its mirror's."""
    whole = torch.zeros((2 * mine.shape[0], *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
    whole[replica * mine.shape[0] : (replica + 1) * mine.shape[0]] = mine.detach()
    dist.all_reduce(whole, group=mirror)
    return whole


def _as_tensor(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    return torch.as_tensor(out[0])


def _either(up: int, down: int) -> str:
    """``"3 or 1"``, or only ``up`` where ``down`` is no count (below 2: "2 or 2" was said)."""
    return f"{up} or {down}" if down >= 2 else str(up)
