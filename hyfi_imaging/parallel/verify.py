"""Check a parallel layout against one process: the engine behind ``hyfi-verify`` and ``verify_model``.

Every rank trains K SGD steps of its part of the model through
:class:`~hyfi_imaging.parallel.engine.ParallelModel` (any ``dp x pp x sp``
layout, micro-batches, schedule, balance, checkpointing), and rank 0 runs the
same K steps in one process between them, broadcasting what each rank compares
(:mod:`.reference`; the memory this takes is estimated, and a run that does not
fit refused, first: :mod:`.verify_memory`): the *reference*, which splits the global batch
(``dp x`` the per-replica batch, replica 0's rows first) into ``dp x
micro-batches`` micro-batches, each with loss ``mean cross-entropy / (dp x
micro-batches)``, accumulated -- exactly the semantics the engine promises,
BatchNorm statistics per micro-batch included. The reference has no
checkpointing, so checkpointing is checked not to change results.

Any module is checked, not only registered chains: a model that is not a
chain runs its own ``forward`` (one pipeline stage), with any loss
``loss(output, target)``; a dense model's output map is compared tile by tile,
stitched (:func:`verify_model` is the public door, for a user's own model).

Each rank compares what it holds: the loss (every rank), outputs (last
stage), input gradients (first stage; tiles gathered and stitched), the
gradient of every parameter of its stage, the gradient norm when clipping,
eval-mode predictions after training, and at the end its stage's weights and
BatchNorm running statistics. Verdicts are gathered to rank 0 and merged by
name (worst error wins). ``max_rel_error`` is, over all compared tensors,
``max|a - b| / max(max|b|, atol)``; ``ok`` means every element of every tensor
is within ``rtol`` of itself plus an absolute tolerance of ``max(atol, rtol x
max|b|)`` (``torch.allclose``).

Why the absolute part scales with the tensor: rounding in a sum is proportional
to the sizes of its terms, not to the (possibly cancelled) result, so an
element near zero in a tensor whose values reach 176 (torchvision mnasnet0_5's
input gradient, float64) carried an error of 1e-8 that a fixed ``atol`` of 1e-9
called a mismatch, at a relative error of 7e-11. Float64's ``rtol`` is 1e-6:
rounding amplified by an ill-conditioned layer reaches 6e-7 (BatchNorm over two
values, timm rexnet_100's squeeze-excite at batch 2; 1e-12 at batch 4), while
a wrong halo or gradient rule gives errors above 1e-2.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.apply import (
    cross_entropy,
    input_channels,
    output_shape,
    reduce_loss,
)
from hyfi_imaging.parallel.apply import spatialize_for as spatial_context_for
from hyfi_imaging.parallel.collectives import all_agree, all_gather_grid, group_device
from hyfi_imaging.parallel.engine import ParallelModel, ParallelPlan
from hyfi_imaging.parallel.halo import trailing
from hyfi_imaging.parallel.launch import ParallelContext, init_parallel
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.memory import rss_bytes
from hyfi_imaging.parallel.meta import meta_copy
from hyfi_imaging.parallel.randomness import draws_random, rng_state, set_rng_state
from hyfi_imaging.parallel.reference import REFERENCE_RANK, ReferenceLink, TensorSpec
from hyfi_imaging.parallel.sharding import full_tensor
from hyfi_imaging.parallel.spatial import SpatialContext
from hyfi_imaging.parallel.verify_memory import check_memory

__all__ = [
    "Comparison",
    "VerifyReport",
    "check_image_size",
    "crop",
    "flat_background",
    "gather_tile_grid",
    "pad_image",
    "random_images",
    "run_verify",
    "spatial_context_for",
    "verify_model",
]

#: ``loss(output, target)``: a scalar, or per-sample / per-pixel values (averaged).
LossFn = Callable[[Tensor, Tensor], Tensor]
#: ``target(output_shape, generator)``: random targets for outputs of that shape.
TargetFn = Callable[[tuple[int, ...], torch.Generator], Tensor]
#: ``images(shape, generator, dtype)``: the global batch's images (:func:`random_images`).
ImagesFn = Callable[[tuple[int, ...], torch.Generator, torch.dtype], Tensor]

TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-6, 1e-9)}


_WORST = (float("inf"), float("inf"))  # max|a-b| and rel of a comparison that cannot hold


@dataclass
class Comparison:
    name: str
    max_abs: float
    max_rel: float
    ok: bool


@dataclass
class VerifyReport:
    """Result of :func:`run_verify` (merged over ranks on rank 0; ``ok`` on every rank)."""

    ok: bool = True
    max_rel_error: float = 0.0
    comparisons: list[Comparison] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)
    plan: str = ""
    #: The memory estimate in words and bytes (:mod:`.verify_memory`; empty where none), and
    #: every rank's measured peak resident set (``VmHWM``, bytes; -1 where unknown).
    memory: str = ""
    memory_estimate: dict[str, int] = field(default_factory=dict)
    peak_rss: list[int] = field(default_factory=list)

    def add(
        self, name: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float
    ) -> None:
        got, want = got.detach().cpu().double(), want.detach().cpu().double()
        if got.shape != want.shape:
            self.comparisons.append(Comparison(name, float("inf"), float("inf"), False))
            self.ok = False
            self.max_rel_error = float("inf")
            return
        if not bool(torch.isfinite(want).all()):
            # the one-process reference diverged: nothing to hold the layout against (both
            # NaN read "MISMATCH, max relative error 0"); said as such, not passed
            self.comparisons.append(Comparison(f"{name} (reference not finite)", *_WORST, False))
            self.ok = False
            self.max_rel_error = float("inf")
            return
        diff = float((got - want).abs().max()) if got.numel() else 0.0
        scale = float(want.abs().max()) if want.numel() else 0.0
        # A tensor that is zero up to rounding (a bias before BatchNorm) is measured
        # against the absolute tolerance, not against its own noise.
        rel = diff / max(scale, atol)
        if not math.isfinite(rel):  # the layout's NaN: the worst error, not max()'s skip
            rel = diff = float("inf")
        ok = bool(torch.allclose(got, want, rtol=rtol, atol=max(atol, rtol * scale)))
        self.comparisons.append(Comparison(name, diff, rel, ok))
        self.ok &= ok
        self.max_rel_error = max(self.max_rel_error, rel)

    def merge(self, others: list[list[Comparison]]) -> None:
        """Replace the comparisons by those of every rank, one per name (the worst)."""
        worst: dict[str, Comparison] = {}
        for comps in others:
            for c in comps:
                old = worst.get(c.name)
                if (
                    old is None
                    or (old.ok and not c.ok)
                    or (old.ok == c.ok and c.max_rel > old.max_rel)
                ):
                    worst[c.name] = c
        self.comparisons = list(worst.values())
        self.ok = all(c.ok for c in self.comparisons)
        self.max_rel_error = max((c.max_rel for c in self.comparisons), default=0.0)

    def format(self, what: str) -> str:
        """The report in words, as ``hyfi-verify`` prints it: a verdict about ``what``, then the
        worst tensors (5 when everything matches, 15 otherwise)."""
        status = "OK" if self.ok else "MISMATCH"
        lines = [
            f"hyfi-verify: {status}: {what}, {len(self.comparisons)} tensors compared, "
            f"max relative error {self.max_rel_error:.3g}"
        ]
        for c in sorted(self.comparisons, key=lambda c: -c.max_rel)[: 5 if self.ok else 15]:
            mark = "ok  " if c.ok else "FAIL"
            lines.append(f"  {mark} {c.name:60s} max|a-b| {c.max_abs:.3g}  rel {c.max_rel:.3g}")
        if any(v >= 0 for v in self.peak_rss):
            peaks = ", ".join(f"{v / 2**30:.2f}" if v >= 0 else "?" for v in self.peak_rss)
            lines.append(f"  peak resident memory by rank (VmHWM): {peaks} GiB")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        worst = sorted(self.comparisons, key=lambda c: -c.max_rel)[:10]
        return {
            "ok": self.ok,
            "max_rel_error": self.max_rel_error,
            "compared": len(self.comparisons),
            "failed": [c.name for c in self.comparisons if not c.ok],
            "worst": [{"name": c.name, "max_abs": c.max_abs, "max_rel": c.max_rel} for c in worst],
            "losses": self.losses,
            "reference_losses": self.reference_losses,
            "plan": self.plan,
            "memory": self.memory,
            "memory_estimate": self.memory_estimate,
            "peak_rss_bytes": self.peak_rss,
        }


def pad_image(x: torch.Tensor, padded_hw: Sequence[int]) -> torch.Tensor:
    """Zero-pad a batch at the far end of its last ``len(padded_hw)`` dims (bottom/right; and
    back for volumes) to ``padded_hw`` (the padding is masked anyway)."""
    nd = len(padded_hw)
    return F.pad(x, [v for k in reversed(range(nd)) for v in (0, padded_hw[k] - x.shape[k - nd])])


def crop(x: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """The first ``size[k]`` indices of each of the last ``len(size)`` dims of ``x``."""
    return x[trailing([slice(0, n) for n in size])]


def gather_tile_grid(tile: torch.Tensor, ctx: SpatialContext, group: Any) -> torch.Tensor:
    """Stitch every rank's tile (same shape everywhere) into the padded whole, on all ranks."""
    return all_gather_grid(tile, ctx.grid, group)


def random_images(shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype) -> Tensor:
    """Standard normal pixels: every value differs from its neighbours (the default)."""
    return torch.randn(shape, generator=generator, dtype=dtype)


def flat_background(
    shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype
) -> Tensor:
    """:func:`random_images` whose lower half is one value per channel, as a slide's glass:
    every max-pool window there ties, and a tile must break its ties as one process does
    (a tile's BatchNorm rounded equal pixels one unit apart from its neighbour's, and the
    gradient went to another pixel). Exact where equal pixels reach the max-pool equal: a
    convolution before it may round a flat map's columns apart by position (its kernel's
    vector tails), and then the ties fall by rounding, in one process as on tiles."""
    x = random_images(shape, generator, dtype)
    x[..., shape[-2] // 2 :, :] = x[..., :1, :1]  # each image's and channel's first pixel
    return x


def default_target(shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """Random class indices for :func:`~.apply.cross_entropy`: ``(N,)`` for ``(N, K)`` logits,
    ``(N, h, w)`` for ``(N, K, h, w)`` maps."""
    if len(shape) < 2:
        raise ConfigError(
            f"model output of shape {shape}",
            "is not (N, K) logits or an (N, K, h, w) map, so no default target fits it",
            "pass target=lambda shape, gen: ... and a loss for it",
        )
    return torch.randint(0, shape[1], (shape[0], *shape[2:]), generator=generator)


def check_image_size(
    model: nn.Module, image_hw: Sequence[int], batch: int = 1, *, trace: bool = True
) -> tuple[int, ...] | None:
    """ConfigError unless ``model`` takes images (volumes) of ``image_hw``: its own
    ``check_input_size`` where it has one (a dense head sized for one input), then, with
    ``trace``, a meta-device forward pass of ``batch`` images (no memory, no compute), whose
    output shape it returns (None without ``trace``, or for an output that is not one tensor)."""
    size = tuple(int(v) for v in image_hw)
    check = getattr(model, "check_input_size", None)
    if callable(check):
        check(size)
    if not trace:
        return None
    try:
        return output_shape(model, (batch, input_channels(model), *size))
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"{type(model).__name__} on a {'x'.join(map(str, size))} input",
            f"fails on the meta device ({first})",
            "give an image size the model takes (a dense head on a flattened map takes only one)",
        ) from None


class _Draws(TorchDispatchMode):
    """Whether any op that ran under the mode draws from a random generator."""

    drew = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.drew = self.drew or draws_random(func)
        return func(*args, **(kwargs or {}))


def _draws_random(model: nn.Module, shape: tuple[int, ...]) -> bool:
    """Whether ``model``'s training forward on an input of ``shape`` draws random numbers
    (a copy on the meta device: nothing is computed)."""
    meta = meta_copy(model).train()
    with _Draws() as mode, torch.no_grad(), torch.device("meta"):
        meta(torch.empty(shape, device="meta"))
    return mode.drew


def run_verify(
    build: Callable[[], nn.Module],
    pc: ParallelContext,
    *,
    image_hw: Sequence[int],
    batch: int = 2,
    steps: int = 2,
    dtype: torch.dtype = torch.float32,
    lr: float = 0.1,
    seed: int = 0,
    plan: ParallelPlan | None = None,
    clip_grad: float | None = None,
    accumulate: int = 1,
    announce: Callable[[str], None] | None = None,
    loss: LossFn | None = None,
    target: TargetFn | None = None,
    memory_check: bool = True,
    draw_images: ImagesFn | None = None,
) -> VerifyReport:
    """Run ``steps`` SGD steps on ``pc``'s layout and in one process; compare on every rank.

    ``batch`` is the per-replica batch; ``plan`` a :class:`ParallelPlan` for
    ``pc.layout`` (default: one micro-batch, GPipe, automatic balance, no
    checkpointing). ``clip_grad`` clips the global gradient norm before each
    step (and compares the norm). ``accumulate`` calls ``train_step`` that
    many times (fresh data each) per optimizer step, without zeroing
    gradients in between. ``announce`` receives the plan printout and the memory
    estimate (on every rank) before training starts. ``loss(output, target)`` (default
    :func:`~.apply.cross_entropy`) and ``target(output_shape, generator)``
    (default :func:`default_target`) and ``draw_images`` (default :func:`random_images`;
    ``images`` of :func:`verify_model`) as for :func:`verify_model`.

    The one-process reference runs on rank :data:`~.reference.REFERENCE_RANK` only, which
    broadcasts what every rank compares (:mod:`.reference`). ``memory_check``: refuse
    (ConfigError, on every rank) a run that a node's free memory cannot hold
    (:mod:`.verify_memory`); the estimate is announced either way.
    """
    plan = plan if plan is not None else ParallelPlan(pc.layout)
    loss_fn = loss if loss is not None else cross_entropy
    make_target = target if target is not None else default_target
    make_images = draw_images if draw_images is not None else random_images
    if dtype not in TOLERANCES:
        raise ConfigError(
            "verify_model",
            f"dtype {dtype} has no tolerance: a half type's own rounding moves a model's "
            "gradients as much as any layout error would (bfloat16 against float64: 0.5-1.2 "
            "relative), so the check could not tell them apart",
            "verify in torch.float64 (exactness) or torch.float32; train.precision: bf16 "
            "runs the same spatial layers under autocast",
        )
    rtol, atol = TOLERANCES[dtype]
    torch.manual_seed(seed)
    model = build().to(dtype)
    plan.validate(model, batch)
    check_image_size(model, image_hw, trace=False)  # a declared size; traced after the plan
    dp, m = plan.layout.dp, plan.microbatches
    memory, estimate = check_memory(
        model, pc, image_hw=image_hw, batch=batch, plan=plan, enforce=memory_check
    )
    if plan.compile == "inductor" and _draws_random(
        model, (batch, input_channels(model), *image_hw)
    ):
        raise ConfigError(
            f"model {type(model).__name__}",
            "draws random numbers in training (dropout, drop-path), and inductor's generated "
            "kernels draw their own, not the one-process reference's",
            "check with the model's drop rates set to 0, or with --compile aot_eager",
        )
    pm = ParallelModel(copy.deepcopy(model), pc, plan, image_hw=image_hw, loss_fn=loss_fn)
    drawing = sorted(pm.ctx.random_modules) if pm.ctx is not None else []
    if drawing and (plan.layout.pp > 1 or pc.device.type != "cpu"):
        why = (
            "each pipeline stage draws from its own generator, in another order than one process"
            if plan.layout.pp > 1
            else f"the ranks draw on {pc.device.type} and the one-process reference on the CPU"
        )
        raise ConfigError(
            f"module {drawing[0] or type(model).__name__!r}",
            f"draws random numbers in training (dropout, drop-path), and {why}",
            "check with the model's drop rates set to 0 (or on CPU with one pipeline stage)",
        )
    in_chans = pm.in_chans
    out_shape = check_image_size(model, image_hw, dp * batch)
    if out_shape is None:
        raise ConfigError(
            type(model).__name__, "does not return one tensor", "return the logits (or map)"
        )
    report = VerifyReport(plan=pm.describe(), memory=memory)
    if estimate is not None:
        report.memory_estimate = dataclasses.asdict(estimate)
    if announce is not None:
        announce(report.plan)
        announce(memory)
    params: list[TensorSpec] = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    states: list[TensorSpec] = [(n, tuple(v.shape), v.dtype) for n, v in model.state_dict().items()]
    # Only the reference's rank keeps the whole model; the others train pm, a copy of it.
    reference = model if pc.rank == REFERENCE_RANK else None
    del model
    link = ReferenceLink(pc)
    ref_opt = (
        torch.optim.SGD(reference.parameters(), lr=lr, momentum=0.9)
        if reference is not None
        else None
    )
    opt = torch.optim.SGD(pm.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(seed + 1)
    d = pc.coords[0]
    mine = slice(d * batch, (d + 1) * batch)
    mb = batch // m
    f64 = torch.float64

    out_map, ctx = pm.out_map, pm.ctx

    def whole(out: Tensor) -> Tensor:
        """The output of this rank's replica: a dense model's tiles stitched and cropped."""
        if out_map is None or ctx is None:
            return out
        return crop(gather_tile_grid(out, ctx, pc.group("sp")), out_map.size)

    def reference_step(
        images: Tensor, targets: Tensor, drawn_from: Any
    ) -> tuple[float, Tensor, Tensor]:
        """The reference's forward and backward over every micro-batch of every replica:
        (loss, outputs, input gradients)."""
        assert reference is not None
        x = images.clone().requires_grad_(True)
        ref_loss, outs = 0.0, []
        for k in range(dp * m):
            if k % m == 0:
                # Random layers (drop-path, dropout) draw in the reference what each replica drew.
                set_rng_state(drawn_from, pc.device)
            rows = slice(k * mb, (k + 1) * mb)
            out = reference(x[rows])
            part = reduce_loss(loss_fn(out, targets[rows]), None, None) / (dp * m)
            part.backward()
            ref_loss += float(part.detach())
            outs.append(out.detach())
        assert x.grad is not None
        return ref_loss, torch.cat(outs), x.grad

    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        if ref_opt is not None:
            ref_opt.zero_grad(set_to_none=True)
        for a in range(accumulate):
            tag = f"step{step}" if accumulate == 1 else f"step{step}.{a}"
            images = make_images((dp * batch, in_chans, *image_hw), gen, dtype)
            targets = make_target(out_shape, gen)
            tiles = None
            if pm.is_first:
                tiles = pm.tile_of(images[mine]).clone().to(pc.device).requires_grad_(True)
            drawn_from = rng_state(pc.device)
            value = pm.train_step(tiles, targets[mine])
            report.losses.append(value)
            drawn_to = rng_state(pc.device)
            found = link.compute(partial(reference_step, images, targets, drawn_from))
            if found is not None:
                set_rng_state(drawn_to, pc.device)
            ref_loss = link.share(torch.tensor(found[0], dtype=f64) if found else None)
            want_out = link.share(found[1] if found else None)
            want_grad = link.share(found[2] if found else None)
            del found
            report.reference_losses.append(float(ref_loss))
            report.add(f"{tag}/loss", torch.tensor(value, dtype=f64), ref_loss, rtol, atol)
            if pm.is_last and pm.last_logits is not None:
                report.add(
                    f"{tag}/output[dp{d}]", whole(pm.last_logits), want_out[mine], rtol, atol
                )
            if pm.is_first:
                assert tiles is not None and tiles.grad is not None
                grad = tiles.grad
                if pm.ctx is not None:
                    grad = gather_tile_grid(grad, pm.ctx, pc.group("sp"))
                grad = crop(grad, image_hw)
                report.add(f"{tag}/input_grad[dp{d}]", grad, want_grad[mine], rtol, atol)
            del want_out, want_grad
        tag = f"step{step}"
        if clip_grad is not None:
            norm = pm.clip_grad_norm_(clip_grad)
            ref_norm = link.compute(
                lambda: torch.nn.utils.clip_grad_norm_(reference.parameters(), clip_grad)  # type: ignore[union-attr]
            )
            report.add(
                f"{tag}/grad_norm", torch.tensor(norm, dtype=f64), link.share(ref_norm), rtol, atol
            )
        own = dict(pm.named_parameters())
        grads = (
            {n: p.grad for n, p in reference.named_parameters()} if reference is not None else None
        )
        wants = link.share_named(grads, params, keep=set(own))
        del grads
        for name, p in own.items():
            assert name in wants, f"the reference has no parameter {name}"
            want = wants.pop(name)
            if p.grad is None and want is None:
                continue
            got = full_tensor(torch.zeros_like(p) if p.grad is None else p.grad)
            want = torch.zeros_like(got.cpu()) if want is None else want
            report.add(f"{tag}/grad/{name}", got, want, rtol, atol)
        del own, wants
        if ref_opt is not None:
            ref_opt.step()
        opt.step()

    images = make_images((dp * batch, in_chans, *image_hw), gen, dtype)
    logits = pm.predict(pm.tile_of(images[mine]).to(pc.device) if pm.is_first else None)

    def reference_predict() -> Tensor:
        assert reference is not None
        reference.eval()
        with torch.no_grad():  # eval mode: each sample alone, so micro-batch by micro-batch
            return torch.cat([reference(images[k * mb : (k + 1) * mb]) for k in range(dp * m)])

    want_pred = link.share(link.compute(reference_predict))
    report.add(f"predict/output[dp{d}]", whole(logits), want_pred[mine], rtol, atol)
    own_state = pm.state_dict()
    wants = link.share_named(
        reference.state_dict() if reference is not None else None, states, keep=set(own_state)
    )
    for name, value in own_state.items():
        want = wants.pop(name, None)
        assert want is not None, f"the reference has no state {name}"
        report.add(f"final/{name}", full_tensor(value), want, rtol, atol)

    # Free the stages, schedules and buffers while the process group is alive,
    # not in some later garbage collection after it has been destroyed.
    del pm, opt, ref_opt, own_state, wants
    gc.collect()
    link.close()
    try:
        peak = rss_bytes("VmHWM")
    except (OSError, RuntimeError):  # not Linux
        peak = -1
    gathered: list[Any] = [None] * pc.world_size
    dist.all_gather_object(gathered, (report.comparisons, peak))
    report.merge([comps for comps, _ in gathered])
    report.peak_rss = [int(p) for _, p in gathered]
    report.ok = all_agree(report.ok)  # on the group's device: NCCL takes CUDA tensors only
    return report


@torch.no_grad()
def _broadcast_weights(model: nn.Module, pc: ParallelContext) -> None:
    """Give every rank rank 0's parameters and buffers (a model built unseeded differs)."""
    if pc.world_size == 1:
        return
    device = group_device()
    for t in [*model.parameters(), *model.buffers()]:
        buf = t.detach().to(device)
        dist.broadcast(buf, src=0)  # the world: every rank holds the whole model
        t.copy_(buf)


def verify_model(
    model: nn.Module | Callable[[], nn.Module],
    image_size: Sequence[int],
    layout: Layout | ParallelContext | None = None,
    *,
    loss: LossFn | None = None,
    target: TargetFn | None = None,
    batch: int = 2,
    steps: int = 2,
    microbatches: int = 1,
    dtype: torch.dtype = torch.float64,
    lr: float = 0.1,
    seed: int = 0,
    overlap: bool = False,
    halo_depth: int = 1,
    backward_bands: bool = False,
    memory_check: bool = True,
    images: ImagesFn | None = None,
) -> VerifyReport:
    """Prove that *any* model trains on a layout exactly as in one process: ``hyfi-verify`` for your model.

    Run on every rank under ``mpirun``/``torchrun`` (or alone). ``model`` is a
    module (deep-copied; every rank gets rank 0's weights) or a zero-argument
    function that builds it (called with ``torch.manual_seed(seed)`` on every
    rank). ``layout`` is a :class:`~.layout.Layout` (the process group is
    started if needed, by :func:`~.launch.init_parallel`), a launched
    :class:`~.launch.ParallelContext`, or None for one process. The model is
    trained ``steps`` SGD steps in ``dtype`` on random images of
    ``image_size`` (``(h, w)``; ``(d, h, w)`` volumes on a 3-D grid) through
    :class:`~.engine.ParallelModel` (the spatial tiles
    of :func:`~.apply.apply_spatial`, data replicas, pipeline stages for a
    chain), and the same steps in one process on the whole images; compared
    are the loss, the outputs (a dense model's output map stitched from its
    tiles), the input gradients, every parameter's gradient, the weights and
    BatchNorm statistics after training, and eval-mode outputs.

    ``loss(output, target)`` returns a scalar or per-sample/per-pixel values
    (averaged; a dense model *must* return per-pixel values, whose mean over
    the image is taken across tiles), or is a :class:`~.apply.TiledLoss`
    (Dice + cross-entropy, :class:`hyfi_imaging.train.losses.DiceCELoss`) that
    reduces across tiles itself. Default: :func:`~.apply.cross_entropy`.
    ``target(output_shape, generator)`` draws targets for the global batch's
    output shape (default: class indices, :func:`default_target`).
    ``images(shape, generator, dtype)`` draws the images (default :func:`random_images`;
    :func:`flat_background` for inputs with ties, as slides have).
    ``overlap``, ``halo_depth`` and ``backward_bands`` are :class:`~.engine.ParallelPlan`'s.
    ``memory_check=False`` runs even where the memory estimate exceeds what a node has free.

    Returns the :class:`VerifyReport` (``ok`` on every rank; the comparisons of
    all ranks merged). The process group is left running.

    OK::

        report = verify_model(lambda: torchvision.models.resnet18(num_classes=3),
                              (224, 192), Layout(sp=(2, 2)))   # mpirun -np 4
        assert report.ok, report.format("resnet18")

    Error::

        verify_model(torchvision_resnet18, (224, 192), Layout(pp=2))
        # ConfigError: --pipeline 2: ResNet is not a chain of layers ...
    """
    if isinstance(model, nn.Module):
        template = model

        def build() -> nn.Module:
            copied = copy.deepcopy(template)
            _broadcast_weights(copied, pc)
            return copied

    else:
        build = model
    pc = layout if isinstance(layout, ParallelContext) else init_parallel(layout or Layout())
    plan = ParallelPlan(
        pc.layout,
        microbatches=microbatches,
        overlap=overlap,
        halo_depth=halo_depth,
        backward_bands=backward_bands,
    )
    return run_verify(
        build,
        pc,
        image_hw=tuple(int(v) for v in image_size),
        batch=batch,
        steps=steps,
        dtype=dtype,
        lr=lr,
        seed=seed,
        plan=plan,
        loss=loss,
        target=target,
        memory_check=memory_check,
        draw_images=images,
    )
