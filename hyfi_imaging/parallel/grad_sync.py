"""The spatial gradient rule, applied by itself at the end of every backward.

Why: on a tile grid every rank computes a *part* of the gradient of each
parameter that sees tiles (a convolution's weight sums over the pixels of the
image, each rank holds the sum over its own tile), while the head after a
global pool is computed whole on every rank. The true gradient is therefore the
**sum over the tiles** for the former and the local value for the latter
(DESIGN.md invariant 5). A user who runs ``loss.backward(); optimizer.step()``
after :func:`~.apply.apply_spatial` -- the loop every PyTorch tutorial writes --
must get that rule without knowing it: a plain step would train each rank on
its own tile's gradient, and the ranks' weights drift apart (silently wrong);
an all-reduce of every gradient, as a DDP user would write, counts the head's
gradients once per tile (silently wrong again).

How: a tensor hook on each tile parameter notes that the parameter received a
gradient in this backward and queues, once per backward, a callback that the
autograd engine runs when the backward ends (DDP's mechanism). The callback sums
what this backward added to each tile parameter's ``.grad`` over the spatial
group, in flat buckets, in the parameters' fixed order (the same collectives on
every rank, whatever order autograd visited them in). Only what *this* backward
added is summed, so accumulating gradients over several backwards before a step
stays exact: it is read from ``.grad`` after the accumulation, less a copy of
``.grad`` taken before it (a user's own gradient hook, registered after ours,
changes what is accumulated, not what our hook saw); an empty ``.grad`` needs no
copy. A parameter that received no gradient on some rank takes part
with zeros and a presence flag, so the ranks never disagree about the
collectives they issue. Parameters are looked up by name before every forward:
one replaced after :func:`~.apply.apply_spatial` (``load_state_dict(...,
assign=True)``, a new ``nn.Parameter``) is hooked in its turn.

Why a digest: the rule keeps replicas equal only if they started equal. Ranks
seeded differently, or a second reduction written by hand, make them differ;
every ``digest_every`` backwards (and at the first) one float64 sum per
parameter is compared across the group (two small all-reduces, one host sync)
and a difference is refused in one line naming the parameter.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from functools import partial
from types import FrameType

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from hyfi_imaging.errors import ConfigError, HyfiError

__all__ = ["DriftError", "TileGradSync"]

#: Elements per all-reduce bucket (64 MiB of float32): few messages, bounded extra memory.
BUCKET_NUMEL = 16 * 1024 * 1024
#: Relative difference of a parameter's float64 sum across ranks that counts as drift.
DRIFT_RTOL = 1e-9


class DriftError(HyfiError):
    """The copies of a parameter differ between the ranks that must hold it alike."""

    collective = True


class _Fresh:
    """Marks a parameter whose ``.grad`` was empty when this backward reached it."""


_FRESH = _Fresh()


def _refuse_ddp(model: nn.Module) -> None:
    """Refuse a forward called by ``DistributedDataParallel`` (found among the few frames
    above the hook): its reducer and the tiles' sum do not compose (the tile parameters'
    gradients came out 1.6e-2 off on 1x2 with 2 replicas, silently)."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return
        if isinstance(frame.f_locals.get("self"), DistributedDataParallel):
            raise ConfigError(
                f"model {type(model).__name__}",
                "runs inside DistributedDataParallel, whose reducer and the tiles' gradient "
                "sum do not compose (its gradients come out wrong, silently)",
                "all-reduce the gradients over pc.group('dp') and divide by the replica "
                "count after backward(), or use hyfi_imaging.ParallelModel",
            )
        frame = frame.f_back


class TileGradSync:
    """Sums the tile parameters' gradients over ``group`` when each backward ends.

    ``model``: the spatialized model; ``tile_names``: the parameters whose
    gradient comes from tiles (``SpatialContext.tile_param_names``); the others
    are left as they are. ``digest_every``: compare every parameter across the
    group at the first backward and then every that many (0: never).
    :meth:`remove` takes the hooks off.
    """

    def __init__(
        self,
        model: nn.Module,
        tile_names: set[str],
        group: ProcessGroup | None,
        *,
        digest_every: int = 100,
    ) -> None:
        named = list(model.named_parameters())
        # Every tile parameter, frozen ones too: one unfrozen later (fine-tuning) is hooked
        # at the next forward (:meth:`refresh`); it trained on its tile's share before.
        self.names = [n for n, _ in named if n in tile_names]
        self._params = [p for n, p in named if n in tile_names]
        self._everything = named
        self._model = weakref.ref(model)  # weak: the context's registry is keyed by the model
        self.group = group
        self.digest_every = digest_every
        #: Backwards whose end this object has handled.
        self.backwards = 0
        self._pending: dict[int, Tensor | _Fresh] = {}
        self._accumulated: set[int] = set()
        self._queued = False
        self._hooked: dict[int, list[RemovableHandle]] = {}
        self._handles: list[RemovableHandle] = []
        self.refresh()
        self._handles.append(model.register_forward_pre_hook(self._before_forward))
        # load_state_dict(..., assign=True) puts new parameter objects in: hooked at once (a
        # model run through its methods, forward_features, never passes the pre-hook above).
        self._handles += [
            m.register_load_state_dict_post_hook(lambda *_: self.refresh()) for m in model.modules()
        ]

    def _before_forward(self, model: nn.Module, _args: tuple[object, ...]) -> None:
        _refuse_ddp(model)
        self.refresh()

    def refresh(self) -> None:
        """Hook the tile parameters that require a gradient and have no hook yet; a parameter
        replaced since (``load_state_dict(..., assign=True)``) is followed to its new object."""
        model = self._model()
        now = list(model.named_parameters()) if model is not None else self._everything
        if len(now) != len(self._everything) or any(
            p is not q for (_, p), (_, q) in zip(now, self._everything, strict=True)
        ):
            named = dict(now)
            self._everything = now
            for i, name in enumerate(self.names):
                if name in named and named[name] is not self._params[i]:
                    for handle in self._hooked.pop(i, []):
                        handle.remove()
                    self._params[i] = named[name]
        for i, p in enumerate(self._params):
            if p.requires_grad and i not in self._hooked:
                self._hooked[i] = [
                    p.register_hook(partial(self._arrived, i)),
                    p.register_post_accumulate_grad_hook(partial(self._accumulate, i)),
                ]

    def remove(self) -> None:
        """Stop applying the rule (the hooks are removed)."""
        for handle in [*self._handles, *(h for hs in self._hooked.values() for h in hs)]:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()

    def __deepcopy__(self, memo: dict[int, object]) -> TileGradSync:
        """Not copied (it holds a process group; a deep copy of the model is given its own at
        its first forward: :func:`~.apply.apply_spatial`)."""
        return self

    # ------------------------------------------------------------------ hooks

    def _arrived(self, index: int, grad: Tensor) -> None:
        """A gradient for parameter ``index`` is about to be accumulated into its ``.grad``."""
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            self._queued = True
        if index not in self._pending:
            # An empty .grad will hold exactly what this backward adds: keep no copy. Else
            # what it held before this backward (a second arrival in one backward keeps it).
            held = self._params[index].grad
            self._pending[index] = _FRESH if held is None else held.detach().clone()

    def _accumulate(self, index: int, _param: Tensor) -> None:
        """Parameter ``index``'s gradient went into its ``.grad`` (``backward``, not
        ``torch.autograd.grad``, which leaves ``.grad`` alone)."""
        self._accumulated.add(index)

    def _backward_ended(self) -> None:
        self._queued = False
        pending, self._pending = self._pending, {}
        accumulated, self._accumulated = self._accumulated, set()
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return
        model = self._model()
        if model is not None:
            now = dict(model.named_parameters())
            moved = [
                n for n, p in zip(self.names, self._params, strict=True) if now.get(n, p) is not p
            ]
            if moved:
                # Replaced (load_state_dict(assign=True)) and run through the model's methods
                # (forward_features), which the forward pre-hook that follows them never saw:
                # its gradient is a tile's share (0.07 off in two steps, silently).
                self.refresh()  # hooked from the next backward on
                raise ConfigError(
                    f"parameter {moved[0]!r}",
                    "was replaced after apply_spatial (load_state_dict(..., assign=True) or a "
                    "new nn.Parameter) and this backward's forward did not call the model "
                    "itself, so its gradient is a tile's share",
                    "call model(x) once after replacing parameters, or load the weights "
                    "before apply_spatial",
                )
        returned = sorted(set(pending) - accumulated)
        if returned:
            # torch.autograd.grad: the gradients it returns are this tile's shares, and .grad
            # must stay as it was (the sum was added to it, corrupting the next step)
            raise ConfigError(
                f"parameter {self.names[returned[0]]!r}",
                "torch.autograd.grad returns a tile's share of the gradient of a parameter "
                "that sees tiles, not the image's",
                "use loss.backward() (the tiles' sum reaches .grad), or pass "
                "reduce_grads=False to apply_spatial and all-reduce over ctx.group yourself",
            )
        if self.digest_every and self.backwards % self.digest_every == 0:
            self.check_agreement()
        self.backwards += 1
        for bucket in self._buckets():
            self._reduce(bucket, pending, accumulated)

    def _buckets(self) -> Iterator[list[int]]:
        """Parameter indices in fixed order, cut where the dtype or device changes or a
        bucket is full; frozen ones left out (every rank freezes alike: no zeros all-reduced
        for a frozen backbone)."""
        bucket: list[int] = []
        numel = 0
        for i, p in enumerate(self._params):
            if not p.requires_grad:
                continue
            if bucket and (
                numel + p.numel() > BUCKET_NUMEL
                or (p.dtype, p.device)
                != (self._params[bucket[0]].dtype, self._params[bucket[0]].device)
            ):
                yield bucket
                bucket, numel = [], 0
            bucket.append(i)
            numel += p.numel()
        if bucket:
            yield bucket

    def _reduce(
        self, bucket: list[int], pending: dict[int, Tensor | _Fresh], accumulated: set[int]
    ) -> None:
        params = [self._params[i] for i in bucket]
        sizes = [p.numel() for p in params]
        total = sum(sizes)
        first = params[0]
        flat = torch.empty(total + len(bucket), dtype=first.dtype, device=first.device)
        parts = list(flat[:total].split(sizes))
        flags = flat[total:]
        for k, (i, p, part) in enumerate(zip(bucket, params, parts, strict=True)):
            added = self._added(p, pending.get(i), i in accumulated)
            if added is None:
                part.zero_()
                flags[k] = 0
            else:
                part.copy_(added.reshape(-1))
                flags[k] = 1
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        # Read the flags on the host only where this rank had no gradient (a sync): a
        # parameter with a gradient here has one in the sum.
        absent = [k for k, i in enumerate(bucket) if i not in pending or i not in accumulated]
        elsewhere = set(absent) & set((flags > 0).nonzero().flatten().tolist()) if absent else set()
        for k, (i, p, part) in enumerate(zip(bucket, params, parts, strict=True)):
            if k in absent and k not in elsewhere:
                continue
            summed = part.view_as(p)
            seen = pending.get(i)
            if p.grad is None:
                p.grad = summed.clone()
            elif isinstance(seen, _Fresh):
                p.grad.copy_(summed)
            elif isinstance(seen, Tensor):
                p.grad.copy_(summed).add_(seen)
            else:  # no gradient here this time, some on other tiles
                p.grad.add_(summed)

    @staticmethod
    def _added(p: nn.Parameter, seen: Tensor | _Fresh | None, accumulated: bool) -> Tensor | None:
        """What this backward added to ``p.grad`` (None: nothing): ``.grad`` less what it
        held before (``seen``; an empty one held nothing)."""
        if seen is None or not accumulated or p.grad is None:
            return None
        return p.grad if isinstance(seen, _Fresh) else p.grad - seen

    # ------------------------------------------------------------------ drift

    def check_agreement(self) -> None:
        """Refuse (:class:`DriftError`, on every rank) parameters that differ across the group."""
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return
        device = self._params[0].device if self._params else torch.device("cpu")
        digest = torch.stack(
            [p.detach().to(device=device, dtype=torch.float64).sum() for _, p in self._everything]
        )
        low, high = digest.clone(), digest.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.group)
        gap = (high - low).abs() > DRIFT_RTOL * (high.abs() + low.abs() + 1.0)
        if not bool(gap.any()):
            return
        k = int(gap.nonzero()[0])
        name = self._everything[k][0]
        raise DriftError(
            f"parameter {name!r}",
            f"differs between the ranks of one image's tiles (its sum is {low[k].item():.6g} on "
            f"one rank, {high[k].item():.6g} on another; {int(gap.sum())} of {len(gap)} "
            f"parameters differ, after {self.backwards} backward(s))",
            "build the model with the same seed on every rank (torch.manual_seed before "
            "creating it) and let apply_spatial sum the tile gradients: do not all-reduce "
            "gradients yourself, nor step an optimizer inside backward (a post-accumulate-grad "
            "hook steps on a tile's share, before the sum)",
        )
