"""Data sub-graph parallelism (Jain's thesis): a cell's independent branches on different ranks.

A *branch group* (the mesh axis ``"br"``, :attr:`.layout.Layout.br`) is ``br`` ranks
that hold the same tile of the same stage of the same replica. In every cell with
independent branches each rank computes only the branches assigned to it, and the
outputs meet where the cell combines them.

Which cells: :class:`~hyfi_imaging.models.amoebanet.Cell` (AmoebaNet's normal and
reduction cells list their ops, so the branches are read from the genotype, not traced)
and :class:`ParallelBranches`, the generic "branches on one input, then concatenate or
sum" container (inception-style blocks). A branch of a cell is one concatenated state
with every node it needs (its *closure*); nodes that several branches need (node 2 of
AmoebaNet-D's reduction cell feeds all three outputs) are recomputed by every rank that
owns one of those branches -- the alternative, merging such branches, would leave the
reduction cell a single branch. Any other module is left alone; a model with no such
cell, or fewer branches than ranks in the widest cell, is refused before any compute.

Decide, then apply: :func:`plan_cell` assigns branches to ranks by a cost (parameters of
the closure, plus one per op so that pools and identities count) with the longest-first
greedy rule, into a frozen :class:`CellPlan`; :func:`apply_branches` swaps each such
cell for a :class:`BranchedCell` that adopts the cell's children under the same names
(state-dict keys, FSDP units and the verifier's names are unchanged).

Why the combination is exact: each rank writes its own pieces into a zero tensor of the
whole output and the group sums it (:class:`_Combine`); ``x + 0 = x`` exactly, so a
concatenation is bit-identical to one process (a ``sum`` combine adds the ranks' partial
sums in another order: rounding-level). Everything after the cell is then computed
alike by every branch rank, so the gradient reaching the output is the whole one on every
rank and the backward of the sum is the identity restricted to the rank's own pieces
(Megatron's ``g``). The cell's inputs (after ``preprocess``) fan out to the branches; their
gradient is each rank's part, summed over the group in backward (:class:`_FanOut`,
Megatron's ``f``), so the preprocessing and everything before the cell get the whole
gradient on every rank.

Why the branch parameters are all-reduced, not sharded or broadcast: a node shared by
two branches gets a *part* of its gradient on each of two ranks, so the owner alone
does not have it; a sum over the group of what each rank added (zeros where it ran
nothing) is the whole gradient on every rank, and every rank's optimizer then takes the
same step -- parameters of branches a rank does not run stay equal everywhere. FSDP2
already shards over ``dp x sp``; a second shard over ``br`` would save only the cells'
parameters, small next to their activations. :class:`BranchSync` does this once per
training step (after the last micro-batch's backward, after FSDP2's reduce-scatter,
on the shards), and copies the BatchNorm running statistics of each op from the first
rank that runs it, since a rank that skips an op never updates them.

A rank *alone* (``group=None``, :func:`rank_model`): the cells of one branch rank with the
collectives left out -- the same layers, the same saved tensors and the same output shapes,
not the same values (the output holds this rank's pieces only). The planner traces it on the
meta device for the busiest rank's memory and work (:mod:`.plan`), and the memory test
measures it in one process; neither needs a process group.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models.amoebanet import Cell
from hyfi_imaging.models.registry import CheckpointedBlock
from hyfi_imaging.parallel.first_order import first_order

if TYPE_CHECKING:
    from hyfi_imaging.parallel.spatial import SpatialContext

__all__ = [
    "BranchSync",
    "BranchedCell",
    "CellPlan",
    "ParallelBranches",
    "apply_branches",
    "branch_cells",
    "check_branch_tiles",
    "check_branches",
    "plan_cell",
    "rank_model",
    "sync_bytes",
]


class ParallelBranches(nn.Module):
    """Several branches applied to one input, outputs concatenated (``dim=1``) or summed.

    OK::

        ParallelBranches([conv1x1, conv3x3, pool_proj], combine="concat")  # inception block

    Error::

        ParallelBranches([a, b], combine="max")   # ConfigError: combine is concat or sum
    """

    def __init__(self, branches: Sequence[nn.Module], *, combine: str = "concat") -> None:
        super().__init__()
        if combine not in ("concat", "sum"):
            raise ConfigError(
                "ParallelBranches", f"combine {combine!r} is unknown", "use 'concat' or 'sum'"
            )
        if not branches:
            raise ConfigError("ParallelBranches", "no branches", "give at least one branch")
        self.branches = nn.ModuleList(branches)
        self.combine = combine

    def forward(self, x: Tensor) -> Tensor:
        """Every branch on ``x``, combined."""
        outs = [b(x) for b in self.branches]
        return torch.cat(outs, dim=1) if self.combine == "concat" else torch.stack(outs).sum(0)


@dataclass(frozen=True)
class CellPlan:
    """What each rank of a branch group computes in one cell (a pure, frozen decision).

    ``pieces``: the combined outputs, in output order (a cell's concatenated states, a
    container's branches). ``owner[i]``: the rank that contributes piece ``i``.
    ``nodes[r]``: the nodes (cell states from 2 on; container branches) rank ``r``
    computes. ``cost[r]``: its cost (parameters + one per op of those nodes).
    """

    kind: str  # "cell" or "container"
    pieces: tuple[int, ...]
    owner: tuple[int, ...]
    nodes: tuple[frozenset[int], ...]
    cost: tuple[int, ...]

    def ops_of(self, rank: int) -> frozenset[int]:
        """Indices of the ops (a cell's ``ops``; a container's ``branches``) ``rank`` runs."""
        if self.kind == "container":
            return self.nodes[rank]
        return frozenset(k for s in self.nodes[rank] for k in (2 * (s - 2), 2 * (s - 2) + 1))


def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _closures(cell: Cell) -> tuple[list[int], list[frozenset[int]]]:
    """Each concatenated state and the nodes (states >= 2) it needs."""

    def need(state: int) -> frozenset[int]:
        if state < 2:
            return frozenset()
        k = 2 * (state - 2)
        return frozenset({state}) | need(cell.indices[k]) | need(cell.indices[k + 1])

    pieces = list(cell.concat)
    return pieces, [need(s) for s in pieces]


def plan_cell(module: nn.Module, br: int) -> CellPlan:
    """Assign ``module``'s branches to ``br`` ranks, longest first, each to the least loaded.

    The cost of a rank is that of the *union* of its branches' nodes, so a branch that
    shares nodes with a rank's branches costs it only what it adds. Ties go to the
    lower rank: every rank computes the same plan.
    """
    if isinstance(module, Cell):
        kind = "cell"
        pieces, closures = _closures(module)

        def node_cost(s: int) -> int:
            k = 2 * (s - 2)
            return _numel(module.ops[k]) + _numel(module.ops[k + 1]) + 2

    elif isinstance(module, ParallelBranches):
        kind = "container"
        pieces = list(range(len(module.branches)))
        closures = [frozenset({i}) for i in pieces]

        def node_cost(s: int) -> int:
            return _numel(module.branches[s]) + 1

    else:
        raise ConfigError(
            type(module).__name__,
            "is not a cell with independent branches",
            "use AmoebaNet cells or wrap the branches in ParallelBranches",
        )
    nodes: list[set[int]] = [set() for _ in range(br)]
    owner = [0] * len(pieces)

    def cost(ns: set[int]) -> int:
        return sum(node_cost(s) for s in ns)

    order = sorted(range(len(pieces)), key=lambda i: (-cost(set(closures[i])), i))
    for i in order:
        rank = min(range(br), key=lambda r: (cost(nodes[r] | closures[i]), r))
        nodes[rank] |= closures[i]
        owner[i] = rank
    return CellPlan(
        kind,
        tuple(pieces),
        tuple(owner),
        tuple(frozenset(n) for n in nodes),
        tuple(cost(n) for n in nodes),
    )


def branch_cells(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``(path, module)`` of every cell with independent branches, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Cell | ParallelBranches)]


def _width(module: nn.Module) -> int:
    """How many pieces a cell combines (its branches; a shared-input cell is still one each)."""
    return len(module.concat) if isinstance(module, Cell) else len(module.branches)  # type: ignore[arg-type]


def check_branches(model: nn.Module, br: int, *, checkpointing: Any = None) -> None:
    """ConfigError (one line) unless ``br`` branch ranks can split ``model``'s cells.

    Called before any process group exists (and again by :func:`apply_branches`).
    """
    if br == 1:
        return
    cells = branch_cells(model)
    name = type(model).__name__
    if not cells:
        raise ConfigError(
            f"--branches {br}",
            f"{name} has no cell with independent branches (AmoebaNet cells, ParallelBranches)",
            "drop --branches, or build the model's branched blocks from ParallelBranches",
        )
    widest = max(_width(m) for _, m in cells)
    for path, cell in cells:
        plan = plan_cell(cell, br)
        idle = [r for r in range(br) if r not in plan.owner]
        if idle and br <= widest:
            raise ConfigError(
                f"--branches {br}",
                f"cell {path} has {len(set(plan.owner))} independent branch group(s) for {br} "
                f"ranks (rank {idle[0]} would have no output to give)",
                f"use --branches {len(set(plan.owner))}",
            )
    if br > widest:
        raise ConfigError(
            f"--branches {br}",
            f"{name}'s widest cell has {widest} branches, so {br - widest} rank(s) would idle",
            f"use --branches {widest} or fewer",
        )
    if checkpointing not in (None, "none", (), False):
        raise ConfigError(
            f"--branches {br}",
            "activation checkpointing of branched cells is not supported (a recompute would "
            "repeat the group's collectives and BatchNorm updates)",
            "drop --checkpointing, or --branches",
        )


def check_branch_tiles(
    model: nn.Module,
    plain: nn.Module,
    ctx: SpatialContext,
    image_hw: Sequence[int],
    in_chans: int,
) -> None:
    """ConfigError unless every windowed layer of the spatialized ``model`` takes its tile.

    Why before :func:`apply_branches`, on every rank: a layer refuses a tile too small for
    its halo when it runs (:meth:`~.spatial.base._SpatialMixin._window`), and in a branch
    only some ranks run, the others would wait in the cell's sum for a rank that stopped
    (and a collective error is printed by rank 0 only, which may not be one of them). So
    every rank asks every windowed layer of the whole model, at its tile of the padded
    image, with the layers' own check: the same line, everywhere, before any compute.
    ``plain``: a meta-device copy of the model before spatialization (traced for the
    layers' input sizes on the padded image; a tile is that over the grid).
    """
    from hyfi_imaging.parallel.spatial.base import _SpatialMixin
    from hyfi_imaging.parallel.spatial.kinds import WINDOWED_LAYERS
    from hyfi_imaging.parallel.spatial.trace import _trace_sizes

    padded = ctx.padded_size(image_hw)
    sizes, _, _ = _trace_sizes(plain, (1, in_chans, *padded))
    for path, m in model.named_modules():
        if not isinstance(m, _SpatialMixin) or not isinstance(m, WINDOWED_LAYERS):
            continue
        if path not in sizes:
            continue
        carry = m._carry(0)
        tile = [s // g for s, g in zip(sizes[path], ctx.grid, strict=True)]
        shape = [t + carry[2 * k] + carry[2 * k + 1] for k, t in enumerate(tile)]
        m._window(torch.empty(1, 1, *shape, device="meta"), 0.0)


class _FanOut(torch.autograd.Function):
    """Identity forward; backward sums each input's gradient over the branch group."""

    @staticmethod
    def forward(ctx: Any, group: ProcessGroup | None, *xs: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        ctx.shapes = [(x.shape, x.dtype, x.device) for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    @first_order("the branch group's gradient sum")
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        out = []
        for g, (shape, dtype, device) in zip(grads, ctx.shapes, strict=True):
            g = torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
            _group_sum(g, ctx.group)
            out.append(g)
        return (None, *out)


class _Combine(torch.autograd.Function):
    """Forward: this rank's pieces written into zeros of the whole output (at ``slots``; a
    ``None`` slot adds the piece to the whole), summed over the group. Backward: the rank's
    own pieces of the (replicated) output gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        group: ProcessGroup | None,
        shape: list[int],
        slots: list[slice | None],
        *pieces: Tensor,
    ) -> Tensor:
        ctx.slots = slots
        full = torch.zeros(shape, dtype=pieces[0].dtype, device=pieces[0].device)
        for s, t in zip(slots, pieces, strict=True):
            if s is None:
                full += t
            else:
                full[:, s] = t
        _group_sum(full, group)
        return full

    @staticmethod
    @first_order("the branch group's combined output")
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return (None, None, None, *(grad if s is None else grad[:, s] for s in ctx.slots))


def _group_sum(t: Tensor, group: ProcessGroup | None) -> None:
    """Sum ``t`` over ``group`` in place; a rank alone (``None``, module doc) keeps its own."""
    if group is not None:
        dist.all_reduce(t, group=group)


class BranchedCell(CheckpointedBlock):
    """A cell of which this rank runs only its branches; the outputs are combined over ``group``.

    Adopts the cell's children under their names (``preprocess0``, ``ops``, ``branches``...).
    ``group=None``: this rank alone, for counting (module doc).
    """

    def __init__(
        self, cell: nn.Module, plan: CellPlan, rank: int, group: ProcessGroup | None
    ) -> None:
        super().__init__()
        self.kind = plan.kind
        for name, child in cell.named_children():
            self.add_module(name, child)
        self.plan, self.rank, self.group = plan, rank, group
        self.mine = plan.ops_of(rank)
        if isinstance(cell, Cell):
            self.indices, self.concat = cell.indices, cell.concat
            self.out_channels = cell.out_channels
        else:
            self.combine = cell.combine
        #: Channels of every piece, by input shape (one exchange per new shape).
        self._channels: dict[tuple[int, ...], list[int]] = {}

    def extra_repr(self) -> str:
        return f"rank={self.rank}, ops={sorted(self.mine)}, cost={self.plan.cost}"

    def op_list(self) -> nn.ModuleList:
        """The ops (a cell's ``ops``, a container's ``branches``) that :attr:`plan` numbers."""
        ops = self.ops if self.kind == "cell" else self.branches
        assert isinstance(ops, nn.ModuleList)
        return ops

    def _piece_channels(self, key: tuple[int, ...], mine: dict[int, Tensor]) -> list[int]:
        """Channels of every piece: each owner tells the group its pieces' (one sum)."""
        if key not in self._channels and self.group is None:
            if self.kind != "cell":
                raise ConfigError(
                    "branch rank alone",
                    "a concatenating ParallelBranches' other pieces have widths only the group "
                    "knows (no process group here: the planner's trace)",
                    "plan this model without --branches, or measure it on the ranks",
                )
            # Every state of a cell has the cell's width (every op keeps the channels).
            width = next(iter(mine.values())).shape[1]
            self._channels[key] = [int(width)] * len(self.plan.pieces)
        if key not in self._channels:
            n = len(self.plan.pieces)
            device = next(iter(mine.values())).device if mine else torch.device("cpu")
            sizes = torch.zeros(n, dtype=torch.int64, device=device)
            for i, t in mine.items():
                sizes[i] = t.shape[1]
            dist.all_reduce(sizes, group=self.group)
            self._channels[key] = [int(v) for v in sizes.tolist()]
        return self._channels[key]

    def _combine(self, key: tuple[int, ...], mine: dict[int, Tensor]) -> Tensor:
        """The whole combined output from this rank's pieces ``mine`` (piece index -> tensor;
        :func:`check_branches` made sure every rank has one)."""
        pieces = list(mine.values())
        shape = list(pieces[0].shape)
        if self.kind == "container" and self.combine == "sum":
            return _Combine.apply(self.group, shape, [None] * len(pieces), *pieces)
        channels = self._piece_channels(key, mine)
        shape[1] = sum(channels)
        starts = [sum(channels[:i]) for i in range(len(channels))]
        slots = [slice(starts[i], starts[i] + channels[i]) for i in mine]
        return _Combine.apply(self.group, shape, slots, *pieces)

    def forward_block(self, x: Any) -> Any:
        """The cell on this rank's branches, combined over the group."""
        if self.kind == "container":
            (xin,) = _FanOut.apply(self.group, x)
            ops = self.op_list()
            mine = {i: ops[i](xin) for i in sorted(self.mine)}
            return self._combine(tuple(x.shape), mine)
        current, previous = x
        ops = self.op_list()
        pre0, pre1 = self.get_submodule("preprocess0"), self.get_submodule("preprocess1")
        h0, h1 = pre0(current), pre1(previous)
        hidden: dict[int, Tensor] = dict(enumerate(_FanOut.apply(self.group, h0, h1)))
        for s in sorted(self.plan.nodes[self.rank]):
            k = 2 * (s - 2)
            a = ops[k](hidden[self.indices[k]])
            b = ops[k + 1](hidden[self.indices[k + 1]])
            hidden[s] = a + b
        mine = {
            i: hidden[s] for i, s in enumerate(self.plan.pieces) if self.plan.owner[i] == self.rank
        }
        # ``current`` passes through as AmoebaNet's Cell passes it; under FSDP2 it is a view
        # (FSDP2's pre-forward returns its inputs through an autograd Function), hence FSDP2's
        # "returned a view tensor" warning, which plain AmoebaNet prints alike. Nothing
        # downstream changes it in place (docs/architecture.md, "FSDP2's view warning").
        return self._combine(tuple(current.shape), mine), current


def apply_branches(model: nn.Module, br: int, rank: int, group: ProcessGroup | None) -> list[str]:
    """Swap every branched cell of ``model`` for this rank's :class:`BranchedCell`, in place.

    Returns the swapped cells' paths. ``rank``: this rank's coordinate in ``group``
    (``None``: the rank alone, module doc).
    """
    check_branches(model, br)
    paths = []
    for path, cell in branch_cells(model):
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        branched = BranchedCell(cell, plan_cell(cell, br), rank, group)
        if isinstance(cell, CheckpointedBlock):
            branched.grad_checkpointing = cell.grad_checkpointing
        setattr(parent, name, branched)
        paths.append(path)
    return paths


#: Per model (weakly), its meta copies as each branch rank alone runs it, by (br, rank).
_RANK_MODELS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, int], nn.Module]] = (
    weakref.WeakKeyDictionary()
)


def rank_model(model: nn.Module, br: int, rank: int) -> nn.Module:
    """A meta-device copy of ``model`` whose branched cells are branch rank ``rank``'s, alone
    (module doc; cached per model): what the planner traces for that rank.

    Why a copy of the model and not a share of the plain cell's trace: the rank's saved tensors,
    work and combine buffers are then counted by the same trace as every other layout's, and the
    assignment is :func:`plan_cell`'s own (read by :func:`apply_branches`), never re-derived.
    """
    import copy

    from hyfi_imaging.parallel.model_trace import meta_model

    cache = _RANK_MODELS.setdefault(model, {})
    if (br, rank) not in cache:
        solo = copy.deepcopy(meta_model(model).module)
        apply_branches(solo, br, rank, None)
        cache[br, rank] = solo
    return cache[br, rank]


class BranchSync:
    """Once per training step: sum the branch ops' new gradients over the group and copy each
    op's running statistics from the first rank that ran it (module doc: why)."""

    def __init__(self, stage: nn.Module, group: ProcessGroup | None) -> None:
        self.group = group
        self.params: list[nn.Parameter] = []
        #: (buffer, whether this rank is its source) for every op buffer.
        self.buffers: list[tuple[Tensor, bool]] = []
        for cell in stage.modules():
            if not isinstance(cell, BranchedCell):
                continue
            ops = cell.op_list()
            runners = [cell.plan.ops_of(r) for r in range(len(cell.plan.nodes))]
            for k, op in enumerate(ops):
                self.params += [p for p in op.parameters() if p.requires_grad]
                first = min((r for r, ks in enumerate(runners) if k in ks), default=0)
                self.buffers += [(b, first == cell.rank) for b in op.buffers()]

    @property
    def nbytes(self) -> tuple[int, int]:
        """Bytes summed per step: the branch parameters' gradients (whole: under FSDP2 each
        rank sums its ``1/shards`` of them) and the op buffers. The planner's count."""
        grads = sum(p.numel() * p.element_size() for p in self.params)
        return grads, sum(b.numel() * b.element_size() for b, _ in self.buffers)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one step's forwards and backwards: what they add to the branch gradients
        is summed over the group at the end (what was there before is kept as it was)."""
        before = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        yield
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            _sum_flat([_local(p.grad) for p in self.params if p.grad is not None], self.group)
            for p, old in zip(self.params, before, strict=True):
                if old is not None and p.grad is not None:
                    p.grad = old + p.grad
            self.sync_buffers()

    @torch.no_grad()
    def sync_buffers(self) -> None:
        """Every op buffer from its source rank (a sum with zeros elsewhere: exact)."""
        for buf, source in self.buffers:
            if not source:
                _local(buf).zero_()
        _sum_flat([_local(b) for b, _ in self.buffers], self.group)


def sync_bytes(modules: Iterable[nn.Module]) -> tuple[int, int]:
    """:attr:`BranchSync.nbytes` of the branched cells among ``modules`` (a stage's, for the
    planner): what that stage's ranks sum over the branch group once per step."""
    cells = [m for m in modules if isinstance(m, BranchedCell)]
    return BranchSync(nn.ModuleList(cells), None).nbytes if cells else (0, 0)


def _local(t: Tensor) -> Tensor:
    """A tensor's own part: a DTensor's local shard (FSDP2), else itself."""
    local = t.to_local() if hasattr(t, "to_local") else t
    assert isinstance(local, Tensor)
    return local


def _sum_flat(tensors: list[Tensor], group: ProcessGroup | None) -> None:
    """Sum ``tensors`` over ``group`` in place, one flat all-reduce per dtype, fixed order."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):
        group_ts = by_dtype[dtype]
        flat = torch.cat([t.reshape(-1) for t in group_ts])
        _group_sum(flat, group)
        offset = 0
        for t in group_ts:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
