"""Random layers on tiles: one draw per image, the same on every tile.

Why: drop-path (timm's ``DropPath``, torchvision's ``StochasticDepth``),
channel dropout (``nn.Dropout2d``) and dropout in the head draw random masks
in training. A mask per sample or per channel is exact on a tile grid only if
every tile of the image draws *the same* numbers: the tiles of one image are
one sample. Ranks seeded alike happen to agree -- until anything draws a
different amount on one rank (a user's loop seeded by rank, a data pipeline
on the main thread), and then each tile drops different blocks of the same
image, silently. So every module that draws (found by the functional-op
watch in training mode, :mod:`.watch`) gets a forward pre-hook that copies the
random generator's state from the spatial group's first rank before it draws
(:func:`install_rng_sync`): one message of 5 KiB (CPU) or 16 bytes (CUDA) per
drawing module and step, and every tile draws what one process would.

A mask *per pixel* (``nn.Dropout`` or DropBlock on the feature map) cannot be
made exact this way -- a tile's draws are not the whole image's draws at the
tile's place -- and the watch refuses it with the module path and the op.

``hyfi-verify`` (:func:`~.verify.run_verify`) compares with one process that
draws the same numbers: it restores the generator's state before running the
reference (:func:`rng_state`, :func:`set_rng_state`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from hyfi_imaging.parallel.collectives import group_device

__all__ = ["draws_random", "install_rng_sync", "rng_state", "set_rng_state", "sync_rng"]


def draws_random(func: Any) -> bool:
    """Whether the ATen op ``func`` draws from a random generator (dropout, bernoulli, rand...)."""
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def rng_state(device: torch.device) -> torch.Tensor:
    """The state of the default generator of ``device`` (CPU or one CUDA device)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    """Restore a state :func:`rng_state` returned for ``device``."""
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def sync_rng(group: Any, device: torch.device) -> None:
    """Give every rank of ``group`` the random state of its first rank, for ``device``."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    state = rng_state(device)
    buf = state.to(group_device(group))
    dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
    set_rng_state(buf.to("cpu"), device)


def install_rng_sync(model: nn.Module, paths: set[str], group: Any) -> list[RemovableHandle]:
    """Synchronise the random state over ``group`` before each module of ``paths`` runs in
    training (``""`` is the model itself); returns the hooks' handles.

    Meta-device passes (shape traces, planning) are left alone: they draw nothing and may
    run on one rank only.
    """

    def before(module: nn.Module, args: tuple[Any, ...]) -> None:
        if not module.training:
            return
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        device = x.device if x is not None else torch.device("cpu")
        if device.type != "meta":
            sync_rng(group, device)

    modules = dict(model.named_modules())
    return [modules[p].register_forward_pre_hook(before) for p in sorted(paths) if p in modules]
