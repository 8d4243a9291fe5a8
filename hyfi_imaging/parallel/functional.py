"""Global reductions written as functions: where they are, and their spatial form.

Why: models pool with functions as often as with modules -- torchvision's
DenseNet and MobileNetV2 end with ``F.adaptive_avg_pool2d(x, 1)``, many
squeeze-excite blocks call ``x.mean((2, 3), keepdim=True)``. On a tile each
would pool the tile only. A *site* is one such call: a global average, sum or
maximum over both spatial dims of a 4-D map (``F.adaptive_avg_pool2d`` /
``F.adaptive_max_pool2d`` to 1x1, ``mean`` / ``sum`` / ``amax`` over dims
``(2, 3)``). Sites are named ``"<module path>#<k>"``: the k-th site call made
directly by that module's ``forward`` in one invocation. The name is the same
in the meta-device traces (where the functional-op watch learns which sites see
tile data and the shape trace learns each site's true input size) and at run
time, where :class:`SpatialFunctions` replaces exactly those calls by masked
local reductions and an all-reduce (``SpatialContext.global_reduce``), like the
global-pool modules. Calls inside layers that have a spatial form are not
counted: those layers do their own work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

__all__ = ["Frames", "Site", "SiteMode", "SpatialFunctions", "site_of"]

_KINDS = {
    "adaptive_avg_pool2d": "avg",
    "adaptive_max_pool2d": "max",
    "_adaptive_max_pool2d": "max",
    "adaptive_max_pool2d_with_indices": "max",
    "mean": "avg",
    "sum": "sum",
    "amax": "max",
}


@dataclass(frozen=True)
class Site:
    """A global spatial reduction call: ``kind`` avg/sum/max, whether it keeps the dims."""

    kind: str
    keepdim: bool
    pool: bool  # F.adaptive_*_pool2d (True) or a tensor reduction (False)


def site_of(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Site | None:
    """The :class:`Site` if ``func(*args, **kwargs)`` reduces a 4-D map over both spatial dims."""
    name = getattr(func, "__name__", "")
    kind = _KINDS.get(name)
    x = args[0] if args else kwargs.get("input")
    if kind is None or not isinstance(x, torch.Tensor) or x.dim() != 4:
        return None
    if name.startswith(("adaptive", "_adaptive")):
        size = args[1] if len(args) > 1 else kwargs.get("output_size")
        returns_indices = kwargs.get("return_indices") or (len(args) > 2 and args[2] is True)
        if size not in (1, (1, 1), [1, 1]) or returns_indices or name.endswith("indices"):
            return None
        return Site(kind, True, True)
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or kwargs.get("dtype") is not None:
        return None  # a reduction over everything, or with a cast: the watch judges it
    dims = {dim % 4} if isinstance(dim, int) else {int(d) % 4 for d in dim}
    if dims != {2, 3}:
        return None
    return Site(kind, bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False)), False)


class Frames:
    """Which module is running, and how many sites it called, from forward hooks.

    ``known(module)`` marks layers that have a spatial form: inside them
    nothing is counted (``inside`` > 0). ``on_enter``/``on_leave`` are called
    with (path, module, args[, output]) after the bookkeeping.
    """

    def __init__(
        self,
        model: nn.Module,
        known: Callable[[nn.Module], bool],
        *,
        on_enter: Callable[[str, nn.Module, tuple[Any, ...]], None] | None = None,
        on_leave: Callable[[str, nn.Module, tuple[Any, ...], Any], None] | None = None,
    ) -> None:
        self.stack: list[tuple[str, list[int]]] = []
        self.inside = 0
        self.known = known
        self._on_enter, self._on_leave = on_enter, on_leave
        self.handles: list[RemovableHandle] = []
        for path, module in model.named_modules():
            self.handles.append(
                module.register_forward_pre_hook(lambda m, a, path=path: self._enter(path, m, a))
            )
            self.handles.append(
                module.register_forward_hook(lambda m, a, o, path=path: self._leave(path, m, a, o))
            )

    @property
    def path(self) -> str:
        return self.stack[-1][0] if self.stack else ""

    def next_site(self) -> str:
        """The name of the site being called now (and count it)."""
        if not self.stack:
            return "#0"
        path, counter = self.stack[-1]
        counter[0] += 1
        return f"{path}#{counter[0] - 1}"

    def _enter(self, path: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._on_enter is not None:
            self._on_enter(path, module, tuple(args))
        self.stack.append((path, [0]))
        if self.known(module):
            self.inside += 1

    def _leave(self, path: str, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        self.stack.pop()
        if self.known(module):
            self.inside -= 1
        if self._on_leave is not None:
            self._on_leave(path, module, tuple(args), out)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class SiteMode(TorchFunctionMode):
    """A function mode that names every site the same way, in traces and at run time.

    The counting rule lives here once (sites outside layers with a spatial
    form, named by :meth:`Frames.next_site`): the shape trace, the watch and
    the run-time replacement must agree on it call for call. Subclasses say
    what happens at a site in :meth:`at_site`; every other call runs as is.
    """

    def __init__(self, frames: Frames) -> None:
        super().__init__()
        self.frames = frames

    def at_site(
        self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], site: Site, name: str
    ) -> Any:
        """What a site call does; default: run it."""
        return func(*args, **kwargs)

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.frames.inside == 0:
            site = site_of(func, args, kwargs)
            if site is not None:
                return self.at_site(func, args, kwargs, site, self.frames.next_site())
        return func(*args, **kwargs)


class SpatialFunctions(SiteMode):
    """At run time: the tile sites of a spatialized model, replaced by their spatial form.

    Active while any module of the model runs (entered by the outermost
    module's pre-hook, left by its hook), so pipeline stages that call the
    model's layers one by one are covered too.
    """

    def __init__(
        self,
        model: nn.Module,
        known: Callable[[nn.Module], bool],
        sites: set[str],
        reduce: Callable[[torch.Tensor, Site, str], torch.Tensor],
    ) -> None:
        super().__init__(Frames(model, known, on_enter=self._entering, on_leave=self._left))
        self.sites, self.reduce = sites, reduce

    def _entering(self, path: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not self.frames.stack:
            self.__enter__()

    def _left(self, path: str, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if not self.frames.stack:
            self.__exit__(None, None, None)

    def at_site(
        self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], site: Site, name: str
    ) -> Any:
        if name in self.sites:
            return self.reduce(args[0], site, name)
        return func(*args, **kwargs)
