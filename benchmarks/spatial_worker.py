"""One rank of a spatial-parallelism benchmark run (started by ``bench_spatial.py``).

Why a separate per-rank script: peak memory is a per-process quantity, so each
measurement runs in fresh processes, and the grid runs must be real ranks under
``mpiexec`` -- the code path training takes. The driver starts this script,
reads the one ``RESULT {json}`` line that rank 0 prints, and does all the
arithmetic and printing. Every rank uses one thread (``torch.set_num_threads(1)``).
Grid runs set the allocator up first, as ``hyfi-train`` does
(:func:`hyfi_imaging.parallel.memory.configure_allocator`); a 1x1 run keeps glibc's and
PyTorch's defaults, as plain PyTorch runs, unless ``--allocator library``.

What one run does:

* builds the model (``--grid 1x1``: the plain model in one process, no process
  group; otherwise spatialized for this rank's tile), and SGD with momentum;
* for each size in ``--images``: ``--mem-steps`` training steps (forward,
  backward, spatial gradient reduction, SGD step). Before each step it reads
  ``VmRSS`` and resets the kernel's peak-RSS counter (``/proc/self/clear_refs``,
  value 5); after it, it reads ``VmHWM``. The first step of the first size is
  the one of a fresh process;
* ``--time-image N``: ``--warmup`` then ``--time-steps`` timed steps at N, each
  started after a barrier, with wall and CPU time of forward, backward,
  gradient reduction and optimizer step; ``--time-width W`` (1x1 only) makes the
  timed image N x W: the plain model on a rank's tile, the reference the driver
  splits the grid's efficiency with;
* ``--count-halo``: wraps :func:`hyfi_imaging.parallel.halo._exchange` (the one
  function every halo message goes through) to count the bytes and messages
  this rank sends, per image size and per phase (forward/backward);
* ``--channels-last``: the model and its input in channels-last; the timed steps count the
  2-D convolutions that ran on a channels-last input (and all of them);
* ``--profile N``: one warm-up and one profiled step at N (``torch.profiler``),
  self CPU time per operator;
* ``--fake-messages`` (grid runs): this process alone as the grid's rank 0 on torch's
  ``fake`` backend (:func:`hyfi_imaging.parallel.launch.fake_rank`): every collective and
  halo message returns at once and moves nothing, so a step is the rank's own work (its
  tile's layers, border bands, BatchNorm statistics, FSDP2's copies, host code) without
  its messages. Started twice under ``mpiexec``, two such ranks run side by side;
* ``--shard fsdp|replicate``: grid runs shard parameters, gradients and
  momentum with FSDP2 over the tiles (default, as the library trains), or keep
  them whole on every rank and all-reduce each tile gradient (the baseline);
* ``--saved``: after everything else, one forward at the first size under
  ``saved_tensors_hooks`` (:func:`hyfi_imaging.parallel.memory.saved_activations`),
  counting the distinct storages autograd keeps for backward, by the class of
  the module that saved them (parameters apart).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

__all__ = ["main"]

PARTS = ("forward", "backward", "grad_reduce", "optimizer")
_PHASE = {"name": "other"}
_SENT: dict[str, int] = defaultdict(int)
_MESSAGES: dict[str, int] = defaultdict(int)


def _status_kib(field: str) -> int:
    from hyfi_imaging.parallel.memory import rss_bytes

    return rss_bytes(field) // 1024


def _system_busy_s() -> float:
    """CPU seconds all processes of the machine have used (``/proc/stat``), stolen time included.

    Compared with our own CPU time over a step, it tells how much the rest of
    the machine ran meanwhile: a timing taken while others ran is not clean.
    """
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _reset_peak() -> None:
    from hyfi_imaging.parallel.memory import reset_peak_rss

    reset_peak_rss()


def _install_halo_counter() -> None:
    """Count the bytes and messages each rank sends through the halo exchange, per phase."""
    from hyfi_imaging.parallel import halo

    real = halo._exchange

    def counting(sends: list[tuple[int, Any]], recvs: list[tuple[int, Any]]) -> Any:
        for _, t in sends:
            _SENT[_PHASE["name"]] += t.numel() * t.element_size()
            _MESSAGES[_PHASE["name"]] += 1
        return real(sends, recvs)

    halo._exchange = counting


def _take_halo_counts() -> dict[str, dict[str, int]]:
    out = {"bytes": dict(_SENT), "messages": dict(_MESSAGES)}
    _SENT.clear()
    _MESSAGES.clear()
    return out


@contextmanager
def _phase(name: str) -> Iterator[None]:
    old = _PHASE["name"]
    _PHASE["name"] = name
    try:
        yield
    finally:
        _PHASE["name"] = old


@contextmanager
def _count_layouts() -> Iterator[list[int]]:
    """``[channels-last, all]``: the 2-D convolutions called, and how many of them on a
    channels-last input of the standard strides (what the kernels run channels-last)."""
    import torch

    counted = [0, 0]

    def hook(module: Any, args: tuple[Any, ...]) -> None:
        if isinstance(module, torch.nn.Conv2d) and args and args[0].dim() == 4:
            x = args[0]
            counted[1] += 1
            counted[0] += (
                x.stride() == torch.empty(x.shape, memory_format=torch.channels_last).stride()
            )

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield counted
    finally:
        handle.remove()


def _profile_step(
    step: Callable[..., Any], inputs: tuple[Any, Any], barrier: Callable[[], None]
) -> list[dict[str, Any]]:
    """Self CPU seconds per operator over one training step (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile

    step(*inputs)  # warm-up at this size
    barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(*inputs)
    barrier()
    rows = [
        {"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count}
        for e in prof.key_averages()
    ]
    return sorted(rows, key=lambda r: -r["self_s"])


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--grid", default="1x1", help="tile grid GYxGX; 1x1 = plain model, one process")
    p.add_argument("--images", default="", help="comma-separated square sizes for memory steps")
    p.add_argument("--mem-steps", type=int, default=2, help="measured steps per memory size")
    p.add_argument(
        "--time-image", type=int, default=0, help="square size for timed steps (0: none)"
    )
    p.add_argument(
        "--time-width",
        type=int,
        default=0,
        help="1x1 runs: timed image --time-image x this width (0: square)",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed ones")
    p.add_argument("--time-steps", type=int, default=3)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--width", type=float, default=None, help="model width multiplier")
    p.add_argument(
        "--checkpointing",
        default="none",
        help="none, full, every:N, selective or deep (as hyfi-train)",
    )
    p.add_argument(
        "--streaming", choices=("none", "stem"), default="none", help="as parallel.streaming"
    )
    p.add_argument(
        "--backward-bands", action="store_true", help="as parallel.backward_bands (grid runs)"
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--count-halo", action="store_true")
    p.add_argument("--saved", action="store_true", help="count tensors saved for backward")
    p.add_argument(
        "--shard",
        choices=("fsdp", "replicate"),
        default="fsdp",
        help="grid runs: FSDP2 over the tiles (the library's way), or whole parameters, "
        "gradients and momentum on every rank with one all-reduce per gradient (the baseline)",
    )
    p.add_argument(
        "--fake-messages",
        action="store_true",
        help="grid runs: rank 0 alone on torch's fake backend (messages move nothing)",
    )
    p.add_argument("--profile", type=int, default=0, help="profile one step at this size (0: no)")
    p.add_argument(
        "--channels-last",
        action="store_true",
        help="the model and its input in channels-last (cuDNN's fast layout for bf16)",
    )
    p.add_argument(
        "--allocator",
        choices=("default", "library"),
        default="default",
        help="1x1 runs: 'library' sets the allocator up as the ranks do (grids always do)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.parallel.memory import configure_allocator

    grid = Layout.parse_grid(args.grid)
    spatial = grid != (1, 1)
    if spatial or args.allocator == "library":
        configure_allocator()  # before the first tensor, as the commands do
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    import torch.distributed as dist
    import torch.nn.functional as F

    from hyfi_imaging.models import create_model
    from hyfi_imaging.parallel.launch import exit_now, fake_rank, init_parallel
    from hyfi_imaging.parallel.memory import PARAMETERS, saved_activations
    from hyfi_imaging.parallel.pipeline import set_checkpointing
    from hyfi_imaging.parallel.sharding import apply_fsdp
    from hyfi_imaging.parallel.streaming import stream_stem
    from hyfi_imaging.parallel.verify import pad_image, spatial_context_for

    torch.manual_seed(0)
    kwargs = {} if args.width is None else {"width": args.width}
    model = create_model(args.model, num_classes=2, **kwargs)
    set_checkpointing(model, args.checkpointing)
    model.train()
    layout = torch.channels_last if args.channels_last else torch.contiguous_format
    model.to(memory_format=layout)  # type: ignore[call-overload]
    rank, world, ctx = 0, 1, None
    if not spatial and args.streaming == "stem":
        stream_stem(model)
    fake = ExitStack()
    if spatial:
        if args.fake_messages:
            pc = fake.enter_context(fake_rank(Layout(sp=grid), 0))
            # Received strips and statistics hold whatever their buffers held: denormal
            # numbers among them would make the arithmetic, not the rank, slow.
            torch.set_flush_denormal(True)
        else:
            pc = init_parallel(Layout(sp=grid))
        rank, world = pc.rank, pc.world_size
        ctx = spatial_context_for(model, pc, backward_bands=args.backward_bands)
        streamed = stream_stem(model, ctx) if args.streaming == "stem" else []
        if args.shard == "fsdp" and pc.shard_mesh is not None:
            apply_fsdp(
                model,
                pc.shard_mesh,
                tile_names=ctx.tile_param_names,
                tiles=world,
                reshard_after_forward=False,  # as the engine (parallelize.apply_sharding)
                # a streamed stem's layers are not called one by one: the root holds them
                called={n for n, _ in model.named_modules()} - set(streamed),
            )
        if args.count_halo:
            _install_halo_counter()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    gen = torch.Generator().manual_seed(1)

    if args.time_width and spatial:
        raise SystemExit("spatial_worker: error: --time-width is for 1x1 runs (a plain model)")

    def make_input(side: int, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        hw = (side, width or side)
        image = torch.randn(args.batch, 3, *hw, generator=gen)
        labels = torch.randint(0, 2, (args.batch,), generator=gen)
        if ctx is None:
            return image.contiguous(memory_format=layout), labels
        ctx.set_image_size(hw)
        rows, cols = ctx.tile_slice(hw)
        tile = pad_image(image, ctx.padded_size(hw))[..., rows, cols]
        return tile.contiguous(memory_format=layout).clone(), labels

    def barrier() -> None:
        if spatial:
            dist.barrier()

    def step(x: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        """One training step: wall and CPU seconds of its parts, peak RSS after each part."""
        busy0 = _system_busy_s()
        marks = [(time.perf_counter(), time.process_time())]
        peaks = []

        def mark() -> None:
            marks.append((time.perf_counter(), time.process_time()))
            peaks.append(_status_kib("VmHWM"))

        opt.zero_grad(set_to_none=True)
        with _phase("forward"):
            loss = F.cross_entropy(model(x), labels)
        mark()
        with _phase("backward"):
            loss.backward()
        mark()
        if ctx is not None and args.shard == "replicate":
            for name, p in model.named_parameters():  # FSDP2 reduces inside backward
                if p.grad is not None and name in ctx.tile_param_names:
                    dist.all_reduce(p.grad)
        mark()
        opt.step()
        mark()
        out: dict[str, Any] = {f"{p}_s": marks[i + 1][0] - marks[i][0] for i, p in enumerate(PARTS)}
        out.update({f"{p}_cpu_s": marks[i + 1][1] - marks[i][1] for i, p in enumerate(PARTS)})
        out["wall_s"] = marks[-1][0] - marks[0][0]
        out["cpu_s"] = marks[-1][1] - marks[0][1]
        out["system_busy_s"] = _system_busy_s() - busy0
        out["peak_after_kib"] = dict(zip(PARTS, peaks, strict=True))
        return out

    result: dict[str, Any] = {
        "rank": rank,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "mem": {},
    }
    sizes = [int(s) for s in args.images.split(",") if s.strip()]
    for side in sizes:
        x, labels = make_input(side)
        steps = []
        for _ in range(args.mem_steps):
            gc.collect()
            barrier()
            before = _status_kib("VmRSS")
            _reset_peak()
            parts = step(x, labels)
            steps.append(
                {
                    "rss_before_kib": before,
                    "peak_kib": _status_kib("VmHWM"),
                    "peak_after_kib": parts["peak_after_kib"],
                }
            )
        barrier()
        result["mem"][str(side)] = {
            "tile": list(x.shape[-2:]),
            "steps": steps,
            "halo": _take_halo_counts(),
            "halo_steps": args.mem_steps,
        }
        del x
    if args.time_image:
        x, labels = make_input(args.time_image, args.time_width)
        times = []
        layouts = _count_layouts() if args.channels_last else nullcontext([0, 0])
        with layouts as counted:
            for i in range(args.warmup + args.time_steps):
                barrier()
                parts = step(x, labels)
                barrier()
                if i >= args.warmup:
                    times.append(parts)
        result["time"] = {
            "channels_last_convs": counted,
            "image": args.time_image,
            "tile": list(x.shape[-2:]),
            "steps": times,
            "halo": _take_halo_counts(),
            "halo_steps": args.warmup + args.time_steps,
        }
        del x
    if args.profile:
        result["profile"] = _profile_step(step, make_input(args.profile), barrier)
    if args.saved and sizes:
        x, labels = make_input(sizes[0])
        saved = saved_activations(model, lambda: F.cross_entropy(model(x), labels))
        result["saved_bytes"] = {**saved.by_kind(), PARAMETERS: saved.by_module.get(PARAMETERS, 0)}
    if spatial and args.fake_messages:
        print("RESULT " + json.dumps({"grid": list(grid), "ranks": [result]}), flush=True)
        fake.close()
    elif spatial:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            print("RESULT " + json.dumps({"grid": list(grid), "ranks": gathered}), flush=True)
        dist.barrier()
        # Not interpreter teardown: gloo's threads sometimes abort it ("terminate called
        # without an active exception") after all the work is done (the product's own exit).
        exit_now(0)
    else:
        print("RESULT " + json.dumps({"grid": [1, 1], "ranks": [result]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
