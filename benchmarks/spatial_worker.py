"""One rank of a spatial-parallelism benchmark run (started by ``bench_spatial.py``).

Why a separate per-rank script: peak memory is a per-process quantity that only
grows, so every (layout, image size) measurement runs in fresh processes, and
the grid runs must be real ranks under ``mpiexec`` -- the same code path as
training. The driver starts this script, reads the one ``RESULT {json}`` line
that rank 0 prints, and does all the arithmetic and printing.

What one run does, with one thread per rank (``torch.set_num_threads(1)``):

* builds ResNet-50 (``--grid 1x1``: the plain model in one process, no
  process group; otherwise spatialized for this rank's tile),
* ``--mode mem``: resets the kernel's peak-RSS counter (``/proc/self/clear_refs``,
  value 5) and reads ``VmRSS`` before and ``VmHWM`` after each of ``--steps``
  training steps (forward, backward, spatial gradient reduction, SGD step);
  optionally counts the bytes of tensors saved for backward, by module class;
* ``--mode time``: ``--warmup`` steps, then ``--steps`` timed steps, each
  started after a barrier; the step time is the slowest rank's;
* ``--count-halo``: wraps :func:`hyfi_imaging.parallel.halo._exchange` (the one
  function every halo message goes through) to count the bytes this rank sends,
  split into forward and backward.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["main"]

_PHASE = {"name": "idle"}
_SENT: dict[str, int] = defaultdict(int)
_MESSAGES: dict[str, int] = defaultdict(int)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if m is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(m.group(1))


def _reset_peak() -> None:
    """Make VmHWM equal the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _install_halo_counter() -> None:
    """Count the bytes each halo message sends, per phase (forward/backward)."""
    from hyfi_imaging.parallel import halo

    real = halo._exchange

    def counting(sends: list[tuple[int, Any]], recvs: list[tuple[int, Any]]) -> None:
        for _, t in sends:
            _SENT[_PHASE["name"]] += t.numel() * t.element_size()
            _MESSAGES[_PHASE["name"]] += 1
        real(sends, recvs)

    halo._exchange = counting


@contextmanager
def _phase(name: str) -> Iterator[None]:
    old = _PHASE["name"]
    _PHASE["name"] = name
    try:
        yield
    finally:
        _PHASE["name"] = old


def _saved_bytes_by_class(model: Any, step: Any) -> dict[str, int]:
    """Bytes of distinct storages autograd saves for backward during ``step()``, by module class."""
    import torch

    current = ["(outside modules)"]
    seen: set[int] = set()
    by_class: dict[str, int] = defaultdict(int)
    handles = []
    for mod in model.modules():
        if list(mod.children()):
            continue

        def pre(m: Any, args: Any) -> None:
            current.append(type(m).__name__)

        def post(m: Any, args: Any, out: Any) -> None:
            current.pop()

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))

    def pack(t: Any) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in seen and storage.nbytes() > 0:
            seen.add(key)
            by_class[current[-1]] += storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()
    finally:
        for h in handles:
            h.remove()
    return dict(by_class)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("mem", "time"), required=True)
    p.add_argument("--grid", default="1x1", help="tile grid GYxGX; 1x1 = plain model, one process")
    p.add_argument("--image", type=int, required=True, help="square image side in pixels")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--count-halo", action="store_true")
    p.add_argument("--saved", action="store_true", help="also count tensors saved for backward")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    import torch.distributed as dist
    import torch.nn.functional as F

    from hyfi_imaging.models import create_model
    from hyfi_imaging.parallel.launch import init_parallel, shutdown
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.parallel.spatial import reduce_spatial_grads
    from hyfi_imaging.parallel.verify import pad_image, spatial_context_for

    grid = Layout.parse_grid(args.grid)
    spatial = grid != (1, 1)
    hw = (args.image, args.image)
    torch.manual_seed(0)
    model = create_model(args.model, num_classes=2)
    model.train()
    rank, world = 0, 1
    ctx = None
    if spatial:
        pc = init_parallel(Layout(sp=grid))
        rank, world = pc.rank, pc.world_size
        ctx = spatial_context_for(model, pc)
        ctx.set_image_size(hw)
        if args.count_halo:
            _install_halo_counter()
    gen = torch.Generator().manual_seed(1)
    image = torch.randn(args.batch, 3, *hw, generator=gen)
    labels = torch.randint(0, 2, (args.batch,), generator=gen)
    if ctx is not None:
        rows, cols = ctx.tile_slice(hw)
        x = pad_image(image, ctx.padded_size(hw))[..., rows, cols].clone()
    else:
        x = image.clone()
    del image
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with _phase("forward"):
            loss = F.cross_entropy(model(x), labels)
        with _phase("backward"):
            loss.backward()
        if ctx is not None:
            reduce_spatial_grads(model, ctx)
        opt.step()

    def barrier() -> None:
        if spatial:
            dist.barrier()

    result: dict[str, Any] = {"rank": rank, "tile": list(x.shape[-2:])}
    n_params = sum(p.numel() for p in model.parameters())
    result["param_bytes"] = n_params * 4
    if args.mode == "mem":
        steps = []
        for _ in range(args.steps):
            gc.collect()
            barrier()
            before = _status_kib("VmRSS")
            _reset_peak()
            step()
            steps.append({"rss_before_kib": before, "peak_kib": _status_kib("VmHWM")})
            barrier()
        result["steps"] = steps
        result["halo_sent"], result["halo_messages"] = dict(_SENT), dict(_MESSAGES)
        if args.saved:
            result["saved_bytes"] = _saved_bytes_by_class(
                model, lambda: F.cross_entropy(model(x), labels)
            )
    else:
        times = []
        for i in range(args.warmup + args.steps):
            barrier()
            t0 = time.perf_counter()
            step()
            barrier()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        result["times"] = times
        result["halo_sent"], result["halo_messages"] = dict(_SENT), dict(_MESSAGES)
    if spatial:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            print("RESULT " + json.dumps({"ranks": gathered}), flush=True)
        shutdown()
    else:
        print("RESULT " + json.dumps({"ranks": [result]}), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
