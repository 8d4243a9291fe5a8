"""Parameters, gradients and optimizer state sharded over ``dp x sp`` with PyTorch's FSDP2.

Why FSDP2 (``torch.distributed.fsdp.fully_shard``), and why this mesh: every
rank of a spatial grid and every data replica holds the same weights, so
without sharding each keeps whole parameters, gradients and optimizer state
(179 MiB of a 653 MiB ResNet-50 rank peak at 1024^2). torchtitan shards
over the flattened ``dp_shard x cp`` mesh, context parallelism being the
transformer analogue of spatial parallelism (every rank holds a slice of the
sample, the weights are shared); here the flattened ``dp x sy x sx`` mesh of
each pipeline stage (:attr:`ParallelContext.shard_mesh`). FSDP2 all-gathers a
unit's parameters before its forward and backward and reduce-scatters its
gradients as soon as its backward is done, which overlaps the reduction with
the rest of backward; gradients and optimizer state stay sharded (DTensors), so
DCP checkpoints hold each shard once and reload into any layout.

The gradient rule (DESIGN.md invariant 5) maps onto FSDP2's reduce-scatter,
which sums over the mesh and divides by a per-unit factor:

* the loss already carries ``1 / (dp x micro-batches)`` (see :mod:`.engine`);
* parameters used before the global pool see only their tile: their gradient
  is the **sum** over tiles and replicas -- divide factor 1;
* the head after the pool is computed identically on every tile and already
  holds the whole gradient: summing over ``sp`` tiles would count it ``sp``
  times -- divide factor ``sp``.

So a unit must not mix the two kinds: units are the top-level layers, split
into their children where a layer mixes them or holds more than
:data:`MAX_UNIT_BYTES` of parameters. A unit must also be *called*: FSDP2
gathers its parameters in its forward pre-hook, and a model may call a
module's children without the module (timm's MetaFormer head:
``self.head.norm(x)``), which left them sharded; such a module is no unit,
its children are judged instead (:func:`called_modules`).
On Gloo the reductions are forced to plain sums with separate scaling (Gloo
has no ``PREMUL_SUM``).

A channels-last model (cuDNN's fast layout for bf16) keeps its layout: FSDP2 shards only
contiguous parameters, so its weights become contiguous, and a convolution then runs in
the layout of its input. Two things would lose it: the first stage's input, which the
engine hands torch's ``PipelineStage`` contiguous, and FSDP2's view of a unit's inputs,
which gives a size-1 batch dimension a stride that the kernels' layout test
(``suggest_memory_format``) no longer reads as channels-last (every convolution of a 1x2
ResNet-50 rank with one image ran NCHW: counted). So every unit of such a model takes its
floating-point inputs in the model's layout with the standard strides
(:func:`~hyfi_imaging.models.memory_format.in_layout`: a view where the elements already
are in that order; the stage's input is copied into it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models.memory_format import in_layout, model_layout
from hyfi_imaging.parallel.meta import meta_copy

__all__ = [
    "apply_fsdp",
    "called_modules",
    "divide_factor",
    "full_tensor",
    "shard_units",
    "stage_units",
]

TILE, HEAD = "tile", "head"


def _kinds(
    prefix: str, module: nn.Module, tile_names: set[str] | None, *, recurse: bool
) -> set[str]:
    return {
        TILE if tile_names is None or f"{prefix}{n}" in tile_names else HEAD
        for n, _ in module.named_parameters(recurse=recurse)
    }


#: Largest parameter bytes of one FSDP unit before it is split into its children.
#: The peak of a spatial rank comes at the start of backward, when nearly every
#: activation is still kept and the last units are gathered (their parameters,
#: their unsharded gradients and the next unit's prefetch): on ResNet-50 at
#: 1024^2 (2x2) units of whole bottleneck blocks (24 MiB) added 0.02 to the
#: per-rank ratio.
MAX_UNIT_BYTES = 8 * 2**20


def _nbytes(params: list[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def called_modules(model: nn.Module, input_shape: tuple[int, ...]) -> set[str]:
    """Paths of the modules whose forward runs when ``model`` (on the meta device, or a
    meta copy is made) runs on an input of ``input_shape``, in eval mode."""
    if any(p.device.type != "meta" for p in model.parameters()):
        model = meta_copy(model)
    called: set[str] = set()
    handles = [
        m.register_forward_pre_hook(lambda m, a, path=path: called.add(path))
        for path, m in model.named_modules()
    ]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.device("meta"):
            model(torch.empty(input_shape, device="meta", dtype=dtype))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return called


def shard_units(
    stage: nn.Module,
    tile_names: set[str] | None,
    *,
    max_bytes: int = MAX_UNIT_BYTES,
    called: set[str] | None = None,
) -> list[tuple[str, nn.Module, str, int]]:
    """``(path, module, kind, bytes)`` of each FSDP unit below ``stage``, innermost first.

    A top-level layer is a unit when its parameters are of one kind and take at
    most ``max_bytes``; otherwise its children that are larger than a quarter
    of that (or mix kinds) are split off the same way, and the layer keeps the
    rest; a block with activation checkpointing on is never split. ``kind`` says whether the gradient is summed over tiles (``tile_names``;
    None: all) or the parameters form the replicated head; ``bytes`` are the
    unit's own parameters (without those of units inside it). ConfigError when
    one module holds both kinds directly. With ``called`` (see :func:`called_modules`),
    a module not in it is no unit: its children are visited instead, and its own
    parameters are left to the stage's root unit.
    """
    units: list[tuple[str, nn.Module, str, int]] = []
    claimed: set[int] = set()

    def visit(prefix: str, module: nn.Module) -> None:
        own = [p for p in module.parameters() if id(p) not in claimed]
        if not own:
            return
        if called is not None and prefix.rstrip(".") not in called:
            for name, child in module.named_children():
                visit(f"{prefix}{name}.", child)
            return
        kinds = _kinds(prefix, module, tile_names, recurse=True)
        # A checkpointed block is one unit, however large (FSDP outside, recomputation
        # inside, as torchtitan composes them): a unit inside it would run its hooks again
        # at recomputation, which selective checkpointing refuses as a different op sequence.
        whole = getattr(module, "grad_checkpointing", False) and len(kinds) == 1
        if not whole and (len(kinds) > 1 or _nbytes(own) > max_bytes):
            for name, child in module.named_children():
                child_params = list(child.parameters())
                mixed = len(_kinds(f"{prefix}{name}.", child, tile_names, recurse=True)) > 1
                if mixed or _nbytes(child_params) > max_bytes // 4:
                    visit(f"{prefix}{name}.", child)
        rest = {id(p) for p in module.parameters()} - claimed
        if not rest:
            return
        names = [n for n, p in module.named_parameters() if id(p) in rest]
        rest_kinds = {
            TILE if tile_names is None or f"{prefix}{n}" in tile_names else HEAD for n in names
        }
        if len(rest_kinds) > 1:
            raise ConfigError(
                f"module {prefix.rstrip('.') or type(module).__name__!r}",
                "holds parameters used both before and after the global pool",
                "split it into two modules (tiles before the pool, head after)",
            )
        rest_params = [p for p in module.parameters() if id(p) in rest]
        claimed.update(rest)
        units.append((prefix.rstrip("."), module, next(iter(rest_kinds)), _nbytes(rest_params)))

    for name, child in stage.named_children():
        visit(f"{name}.", child)
    # Innermost first: fully_shard must see a child before its parent.
    units.sort(key=lambda u: -u[0].count("."))
    return units


def apply_fsdp(
    stage: nn.Module,
    mesh: DeviceMesh,
    *,
    tile_names: set[str] | None,
    tiles: int,
    reshard_after_forward: bool,
    called: set[str] | None = None,
    units: Sequence[tuple[str, str]] | None = None,
) -> list[str]:
    """Shard ``stage`` in place over ``mesh`` (FSDP2); returns the unit paths, root last.

    ``tiles`` is the number of spatial ranks (``sp``) in the mesh: the divide
    factor of head units; ``called`` as for :func:`shard_units`. ``units``: the
    ``(path, kind)`` pairs the per-rank plan chose (:mod:`.rank_plan`, by
    :func:`stage_units` on a meta copy), sharded as given; else chosen here by that
    function. Channels-last parameters are made contiguous first (FSDP2 shards only
    contiguous ones). Call once, before creating the optimizer (its parameters become sharded
    DTensors).
    """
    gloo = dist.get_backend(mesh.get_group()) == "gloo"
    chosen = (
        stage_units(stage, tile_names, called=called)
        if units is None
        else [(p, stage if p == "(stage)" else stage.get_submodule(p), k) for p, k in units]
    )
    layout = model_layout(stage)
    for param in stage.parameters():
        if not param.is_contiguous():  # channels-last weights: FSDP2 shards contiguous ones only
            param.data = param.data.contiguous()
    for _, module, kind in chosen:
        sharded: FSDPModule = fully_shard(
            module, mesh=mesh, reshard_after_forward=reshard_after_forward
        )
        sharded.set_gradient_divide_factor(divide_factor(kind, tiles))
        if gloo:
            sharded.set_force_sum_reduction_for_comms(True)
        if layout is not None:  # after FSDP2's own pre-hook (prepended), on what it hands on
            root = module is stage  # the stage's input is the one laid out anew
            module.register_forward_pre_hook(
                lambda _m, args, fmt=layout, copy=root: tuple(
                    in_layout(a, fmt, copy=copy) for a in args
                )
            )
    return [path for path, _, _ in chosen]


def stage_units(
    stage: nn.Module, tile_names: set[str] | None, *, called: set[str] | None = None
) -> list[tuple[str, nn.Module, str]]:
    """``(path, module, kind)`` of every FSDP unit of ``stage``, innermost first, its root
    (path ``(stage)``) last: what :func:`apply_fsdp` shards, decided without a mesh (the
    per-rank plan reads it on a meta copy). ConfigError when the root would hold both kinds."""
    scalar = next((n for n, p in stage.named_parameters() if p.dim() == 0), None)
    if scalar is not None:  # fully_shard raised ValueError from inside FSDP2
        raise ConfigError(
            f"parameter {scalar!r}",
            "is a 0-dim tensor, which FSDP2 (fully_shard) cannot shard",
            "make it a one-element 1-D tensor, nn.Parameter(torch.tensor([value])): it "
            "broadcasts alike",
        )
    units = shard_units(stage, tile_names, called=called)
    inner = {id(p) for _, module, _, _ in units for p in module.parameters()}
    rest = [n for n, p in stage.named_parameters() if id(p) not in inner]
    root_kinds = {TILE if tile_names is None or n in tile_names else HEAD for n in rest}
    if len(root_kinds) > 1:
        raise ConfigError(
            f"module {type(stage).__name__!r}",
            "keeps parameters used both before and after the global pool outside any module "
            "its forward calls",
            "call the modules that hold them (or split them into two modules)",
        )
    return [
        *((path, module, kind) for path, module, kind, _ in units),
        ("(stage)", stage, next(iter(root_kinds), TILE)),
    ]


def divide_factor(kind: str, tiles: int) -> float:
    """FSDP2's gradient divide factor of a unit: a head unit's gradient is the same on every
    tile, so its sum over the ``tiles`` ranks of a grid is divided by them; a tile unit's
    sum is the whole image's gradient (1)."""
    return float(tiles) if kind == HEAD else 1.0


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded DTensor gathered (collective over its mesh), else ``t``."""
    return t.full_tensor() if isinstance(t, DTensor) else t
