"""One command on a GPU machine: does hyfi-imaging train, resume, verify, run fast, fit big there?

Run it first whenever a GPU machine is available (issue 19, item 5). It takes at most
8 minutes on one H100 or H200, writes a JSON file (``--out``) and appends a dated section
naming the device to ``docs/benchmarks.md`` (``--markdown``). The items:

* **(a)** ``hyfi-train`` on CUDA (NCCL, a world of one), bf16 autocast, a checkpoint every 2
  steps: one uninterrupted run and one SIGKILLed after a checkpoint, then relaunched; the
  resumed run's losses (``metrics.csv``) must equal the uninterrupted run's exactly. Both run
  ``hyfi-train``'s ``main`` with deterministic kernels (``torch.use_deterministic_algorithms``,
  warn-only): without them cuDNN may pick kernels whose sums change order from run to run, and
  two uninterrupted CUDA runs could differ in the last bits.
* **(b)** ``hyfi-verify`` on a 1x1 layout on CUDA (float64, against one process on the CPU);
  with two GPUs or more, also 1x2 over NCCL under ``torchrun``.
* **(c)** ResNet-50 bf16 training step time at 4096^2 and 8192^2, batch 1, SGD: plain PyTorch
  (the model, autocast, a plain loop) vs ``ParallelModel.train_step`` on 1x1, in NCHW and in
  channels-last, and hyfi with deep checkpointing + the streamed stem (its time cost). One
  step's FLOPs are counted with ``FlopCounterMode`` (the model's: recomputation not counted)
  and divided by the median step time (CUDA events, after warm-up steps), as a share of the
  device's dense bf16 peak (``PEAK_BF16_TFLOPS``). Targets: >= 40 % of peak; hyfi's overhead
  over plain PyTorch <= 5 %. Beside it, ``hyfi-plan``'s speed model predicts hyfi's step on the
  device table's row for this GPU, and on that row with the compute figures measured first on
  this GPU as ``hyfi-plan --device cuda`` measures them (:func:`_calibrate`, NCHW and
  channels-last; :func:`speed_model`): target within 20 % of the measured step, as on the CPU.
* **(d)** The largest square image that trains (two SGD steps, bf16) on the one GPU, found by
  running, as ``bench_scale.py --part largest`` does on CPU, every probe a fresh process so that
  an out-of-memory cannot poison the next (an error other than out-of-memory counts as a miss,
  with its line). Where (c) measured a contender's peak at two sides, the search starts at the
  side that line projects to fill 97 % of the device and moves in steps of 3 %; otherwise it
  doubles; then bisection on multiples of 32 (to 1/64 of the side). The probes run with
  PyTorch's expandable segments (unless ``PYTORCH_CUDA_ALLOC_CONF`` is set), as training at the
  memory limit should. Plain PyTorch vs hyfi with deep checkpointing (``checkpointing: deep``:
  every block, and in layer1 and layer2 the blocks' inputs computed again, the blocks in
  units) and the streamed stem.
  Target >= 4x the pixels, checked on the sides found and on the bytes per pixel (the slopes of
  (c)'s peaks), which a search cut short by its time cap cannot blur.
* **(e)** ``torch.compile`` (inductor) of hyfi's 1x1 training path, and of the path of (d)
  (checkpointed + streamed): it works (compile time, step time against eager) or it fails (the
  first line of the innermost error). A one-line refusal of hyfi's own (a ConfigError) passes.

Each measurement runs in a fresh process (the script re-runs itself with ``--worker``), so a
crash, a hang or an out-of-memory ends that process only; the harness never touches the GPU.
Every item has a time budget (``--budget``); time an item leaves unused passes to the next,
and the default budgets add up to 8 minutes. An item that fails or runs out of time records
its one-line error and the check goes on. Layouts of several ranks over NCCL (tile grids,
pipelines, data replicas) need several GPUs: with one, that is said and skipped.

``--dry-run`` runs every item on the CPU (Gloo, bf16 autocast on the CPU) with tiny sizes, the
largest-image search against a simulated memory cap and torch.compile with the ``aot_eager``
backend: the plumbing, for CI, in about a minute. Its figures are no measurement.

Exit status: 0 the check ran (PASS/MISS lines say how the targets fared; a failed item is
recorded); 2 no CUDA device without --dry-run, or bad options; 1 the harness itself crashed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = ["PEAK_BF16_TFLOPS", "largest_side", "main", "peak_tflops", "step_rows", "verdicts"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: When this process started: a worker's ``PHASE`` lines count from it.
STARTED = time.monotonic()
GIB = 2**30
ITEMS = {
    "a": "hyfi-train: bf16 autocast, checkpoint, kill, exact resume",
    "b": "hyfi-verify 1x1 (and 1x2 with two GPUs)",
    "c": "bf16 training step time vs the dense bf16 peak",
    "d": "largest square image that trains on one GPU",
    "e": "torch.compile of the training path",
}
TARGET_PEAK_SHARE = 0.40
TARGET_OVERHEAD = 0.05
TARGET_PIXELS = 4.0
#: (d)'s probes: the share of the device's memory a projected side fills, and the factor a
#: side grows or shrinks by from there (3 %: the projection from two sides measured in (c)
#: was within 3 % of the measured peak at 16896^2 on an H200).
PROBE_SHARE = 0.97
PROBE_GROW = 1.03
#: (d)'s searches stop when the bracket is within 1/RESOLUTION of the side (3 %, 6 % of the
#: pixels): a probe near an H200's limit takes a minute or more (plain PyTorch's two steps at
#: 12736^2: 13 s each, after a first step that benchmarks cuDNN's kernels).
RESOLUTION = 32
#: (d)'s probes run as a user at the memory limit would: PyTorch's expandable segments keep
#: the caching allocator from failing on fragmentation (the H200's first run ran out of
#: memory at 25600^2 with 24 GiB reserved and unallocated) and from freeing and retrying
#: near the limit. The same for both contenders; a user's own ``PYTORCH_CUDA_ALLOC_CONF`` wins.
PROBE_ALLOC_CONF = "expandable_segments:True"
#: hyfi-plan's predicted step time against the measured one (issue 19, item 6; as on CPU).
TARGET_SPEED_MODEL = 0.20
#: Dense (not 2:4 sparse) bf16 tensor-core peaks in TFLOP/s, matched in order against
#: ``torch.cuda.get_device_name`` (the first key it contains wins).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", 312.0),
)


@dataclass(frozen=True)
class Contender:
    """One way to train a step: plain PyTorch or hyfi's ParallelModel on 1x1."""

    hyfi: bool
    channels_last: bool = False
    checkpointing: str = "none"
    streaming: str = "none"


CONTENDERS = {
    "plain": Contender(False),
    "hyfi": Contender(True),
    "plain_cl": Contender(False, channels_last=True),
    "hyfi_cl": Contender(True, channels_last=True),
    "hyfi_ckpt": Contender(True, checkpointing="deep", streaming="stem"),
}


@dataclass(frozen=True)
class Setup:
    """Sizes and budgets of one run: the GPU check, or its dry run on the CPU."""

    device: str = "cuda"
    model: str = "resnet50"
    width: float | None = None
    step_sides: tuple[int, ...] = (4096, 8192)
    #: (c)'s probe of 32-bit indexing (:func:`_index_probe`): 64 x side^2 elements just under
    #: and just over 2^31 (2.12e9 and 2.17e9)
    index_sides: tuple[int, int] = (5760, 5824)
    warmup: int = 3
    steps: int = 5
    search_start: int = 2048
    search_caps: dict[str, int] | None = None  # simulated memory limit (largest side), dry run
    max_side: int = 65536
    compile_side: int = 4096
    backend: str = "inductor"
    train_slide: int = 512
    train_size: int = 256
    train_width: float = 0.25
    train_epochs: int = 8
    kill_after: int = 4
    verify: tuple[str, ...] = ("--model", "resnet50", "--image-size", "256x192")
    budgets: dict[str, float] = field(
        default_factory=lambda: {"a": 75.0, "b": 30.0, "c": 125.0, "d": 135.0, "e": 115.0}
    )


#: The dry run: every item's code on the CPU, sizes small enough for CI; ResNet-18 because
#: tracing for torch.compile takes as long per layer at any width.
DRY = Setup(
    device="cpu",
    model="resnet18",
    width=0.25,
    step_sides=(64, 96),
    index_sides=(64, 72),
    warmup=1,
    steps=2,
    search_start=64,
    search_caps={"plain": 64, "hyfi_ckpt": 128},
    max_side=4096,
    compile_side=64,
    backend="aot_eager",
    train_slide=256,
    train_size=64,
    train_width=0.125,
    train_epochs=3,
    kill_after=2,
    verify=("--model", "resnet18", "--width", "0.25", "--image-size", "64x48"),
    budgets={"a": 60.0, "b": 25.0, "c": 25.0, "d": 30.0, "e": 50.0},
)


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by its name (None when the table does not know it)."""
    name = device_name.lower()
    return next((v for k, v in PEAK_BF16_TFLOPS if k.lower() in name), None)


# ------------------------------------------------------------------ workers (subprocesses)


def device_info(kind: str) -> dict[str, Any]:
    """The device the check runs on, and the software versions that matter for it."""
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if kind == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(
            name=p.name,
            memory_gib=round(p.total_memory / GIB, 1),
            capability=f"{p.major}.{p.minor}",
            count=torch.cuda.device_count(),
            cudnn=torch.backends.cudnn.version(),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            bf16=torch.cuda.is_bf16_supported(),
        )
    else:
        cpu = platform.processor() or platform.machine()
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:  # Linux: the model
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if "model name" in ln), cpu)
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        info.update(name=f"CPU {cpu} ({os.cpu_count()} cores)", memory_gib=round(mem / GIB, 1))
        info.update(count=0, cudnn=None, nccl=None, bf16=None)
    info["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    return info


def _error_line(err: BaseException) -> str:
    """``Type: first line`` of the innermost cause (pipelining and dynamo wrap the real one)."""
    while err.__cause__ is not None:
        err = err.__cause__
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    # "backend='inductor' raised:" says nothing until the line after it
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else "".join(lines[:1])
    return f"{type(err).__name__}: {text}"[:300]


def _where(err: BaseException) -> str:
    """``file:line function`` of the innermost frame in hyfi_imaging, else the innermost one:
    where an out-of-memory allocated (the message names the bytes, not the tensor)."""
    import traceback

    frames = [f for e in reversed(_chain(err)) for f in traceback.extract_tb(e.__traceback__)]
    ours = [f for f in frames if "hyfi_imaging" in f.filename] or frames
    if not ours:
        return ""
    f = ours[-1]
    return f"{Path(f.filename).name}:{f.lineno} {f.name}"


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from or during, outermost first."""
    seen: list[BaseException] = []
    at: BaseException | None = err
    while at is not None and at not in seen:
        seen.append(at)
        at = at.__cause__ or at.__context__
    return seen


def _is_oom(err: BaseException) -> bool:
    import torch

    for e in _chain(err):
        text = str(e).lower()
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in text:
            return True
        if "alloc_failed" in text:  # cuDNN / cuBLAS workspaces
            return True
    return False


_CONTEXT: list[Any] = []


def _context() -> Any:
    """The process group of a world of one (NCCL on CUDA, Gloo on CPU), started once."""
    from hyfi_imaging.parallel.launch import init_parallel
    from hyfi_imaging.parallel.layout import Layout

    if not _CONTEXT:
        _CONTEXT.append(init_parallel(Layout()))
    return _CONTEXT[0]


def _count_flops(model: str, width: float | None, side: int) -> int:
    """FLOPs of one training step (forward + backward) at batch 1, counted on the meta device."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from hyfi_imaging.models import create_model

    kwargs: dict[str, Any] = {"num_classes": 2} | ({"width": width} if width else {})
    with torch.device("meta"):
        net = create_model(model, **kwargs)
        x = torch.randn(1, 3, side, side)
    counter = FlopCounterMode(display=False)
    with counter:
        F.cross_entropy(net(x), torch.zeros(1, dtype=torch.long, device="meta")).backward()
    return int(counter.get_total_flops())


def _phase(what: str) -> None:
    """A worker's progress, one line on stdout: what a run that times out had reached."""
    print(f"PHASE {time.monotonic() - STARTED:.1f} {what}", flush=True)


def _train_steps(spec: dict[str, Any], name: str) -> dict[str, Any]:
    """Build ``name``'s model at ``spec['side']``, run warm-up and timed steps (and compile)."""
    import torch
    import torch.nn.functional as F

    from hyfi_imaging.errors import HyfiError
    from hyfi_imaging.models import create_model
    from hyfi_imaging.parallel.engine import ParallelModel, ParallelPlan

    c, dev, side = CONTENDERS[name], torch.device(spec["device"]), int(spec["side"])
    cuda = dev.type == "cuda"
    out: dict[str, Any] = {"contender": name, "side": side}
    fmt = torch.channels_last if c.channels_last else torch.contiguous_format
    state: dict[str, Any] = {}
    try:
        torch.manual_seed(0)
        kwargs: dict[str, Any] = {"num_classes": 2}
        if spec.get("width"):
            kwargs["width"] = spec["width"]
        model = create_model(spec["model"], **kwargs)
        model = model.to(memory_format=fmt)  # type: ignore[call-overload]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        x = torch.randn(1, 3, side, side, device=dev).contiguous(memory_format=fmt)
        y = torch.zeros(1, dtype=torch.long, device=dev)
        if c.hyfi:
            pc = _context()
            plan = ParallelPlan(pc.layout, checkpointing=c.checkpointing, streaming=c.streaming)
            if spec.get("compile"):  # a plan the engine will not compile: refused before any step
                dataclasses.replace(plan, compile=spec["compile"])
            pm = ParallelModel(model, pc, plan, image_hw=(side, side))
            tile, module, params = pm.tile_of(x), pm.stage_module, list(pm.parameters())
            state["pm"] = pm
        else:
            module, params = model.to(dev), list(model.parameters())
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
        state.update(model=model, module=module, opt=opt, x=x)
        _phase(f"{name} {side}^2 built")

        def step() -> None:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                if c.hyfi:
                    state["pm"].train_step(tile, y)
                else:
                    F.cross_entropy(module(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def timed(n: int) -> list[float]:
            times = []
            for _ in range(n):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                    start.record()
                    step()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / 1000)
                else:
                    t0 = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - t0)
                _phase(f"{name} {side}^2 step {len(times)} of {n}: {times[-1]:.1f} s")
            return times

        first = timed(1)[0]
        timed(max(0, int(spec["warmup"]) - 1))
        times = timed(int(spec["steps"]))
        out.update(status="ok", first_step_s=first, steps_s=times)
        out["step_s"] = statistics.median(times) if times else first
        if spec.get("compile"):
            out["eager_step_s"] = out.pop("step_s")
            out["status"] = "compiling"
            _phase(f"{name} {side}^2 compiling")
            if c.hyfi:  # the engine's own compile (the plan was checked before any step)
                from hyfi_imaging.parallel.parallelize import apply_compile

                apply_compile(module, spec["compile"], state["pm"].fsdp_units)
            else:
                module.compile(backend=spec["compile"])
            out["compile_s"] = timed(1)[0]  # the first compiled step: tracing + code generation
            timed(max(0, int(spec["warmup"]) - 1))
            times = timed(int(spec["steps"]))
            out.update(status="ok", compiled_steps_s=times, step_s=statistics.median(times))
            out["speedup"] = out["eager_step_s"] / out["step_s"]
        if cuda:
            out["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    except Exception as err:
        out.update(status="oom" if _is_oom(err) else "error", error=_error_line(err))
        out["where"] = _where(err)
        out["refused"] = any(isinstance(e, HyfiError) for e in _chain(err))
    finally:
        state.clear()
    return out


def _calibrate(device: str) -> dict[str, Any]:
    """The speed model's compute figures measured on ``device`` as ``hyfi-plan --device cuda``
    measures them (:func:`~hyfi_imaging.parallel.devices.measure_figures`), in NCHW and in
    channels-last: bfloat16 on a GPU; on the CPU (a dry run), the CPU's own probe."""
    import torch

    from hyfi_imaging.parallel.devices import measure_figures, probe

    out: dict[str, Any] = {}
    for fmt, cl in (("nchw", False), ("channels_last", True)):
        where = probe(torch.device(device, 0) if device == "cuda" else torch.device(device),
                      channels_last=cl)  # fmt: skip
        t0 = time.perf_counter()
        out[fmt] = measure_figures(where)
        out[fmt]["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _index_probe(device: str, sides: tuple[int, int]) -> dict[str, Any]:
    """Seconds per pixel of a 3x3 convolution + BatchNorm + ReLU with 64 channels, forward and
    backward in bfloat16 (autocast), on maps of each side (NCHW and channels-last; median of 3
    after a warm-up): past 2^31 elements a map leaves the kernels' 32-bit indexing, and the
    plain model's step at 12736^2 ran 11x slower than its 8192^2 step scaled by the pixels."""
    import torch
    from torch import nn

    dev = torch.device(device)
    out: dict[str, Any] = {"sides": list(sides), "elements": [64 * v * v for v in sides]}
    for fmt_name, fmt in (("nchw", torch.contiguous_format), ("channels_last", torch.channels_last)):  # fmt: skip
        per_px = []
        for side in sides:
            torch.manual_seed(0)
            block = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(64), nn.ReLU())  # fmt: skip
            block = block.to(dev, memory_format=fmt)  # type: ignore[call-overload]
            x = torch.randn(1, 64, side, side, device=dev, dtype=torch.bfloat16)
            x = x.contiguous(memory_format=fmt).requires_grad_(True)
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    block(x).sum().backward()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            per_px.append(statistics.median(times[1:]) / side**2)
            _phase(f"index probe {fmt_name} {side}^2: {times[-1]:.3f} s")
            del block, x
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        out[fmt_name] = {"s_per_px": per_px, "ratio": per_px[1] / per_px[0]}
    return out


def _worker(argv: list[str]) -> int:
    """``gpu_check.py --worker KIND ...``: one measurement in a fresh process."""
    kind, rest = argv[0], argv[1:]
    if kind == "train":  # hyfi-train's main, with deterministic kernels
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        from hyfi_imaging.cli.train import main as train_main

        return train_main(rest)
    spec = json.loads(rest[0])
    if kind == "info":
        print("RESULT " + json.dumps(device_info(spec["device"])), flush=True)
        return 0
    import torch

    torch.backends.cudnn.benchmark = bool(spec.get("benchmark"))
    if kind == "calibrate":
        print("RESULT " + json.dumps(_calibrate(spec["device"])), flush=True)
        return 0
    if kind == "index":
        sides = (int(spec["sides"][0]), int(spec["sides"][1]))
        print("RESULT " + json.dumps(_index_probe(spec["device"], sides)), flush=True)
        return 0
    if spec.get("flops"):
        flops = _count_flops(spec["model"], spec.get("width"), int(spec["side"]))
        print("RESULT " + json.dumps({"flops": flops}), flush=True)
    for name in spec["contenders"]:
        print("RESULT " + json.dumps(_train_steps(spec, name)), flush=True)
        gc.collect()  # the contender's frames are gone now: give its memory back
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    # A process group's teardown may abort at exit after all work is done: skip it.
    sys.stdout.flush()
    os._exit(0)


# ------------------------------------------------------------------ the harness


@dataclass
class Run:
    """What one subprocess did: exit status (None: killed at its deadline) and output."""

    rc: int | None
    out: str
    err: str

    def results(self) -> list[dict[str, Any]]:
        return [json.loads(ln[7:]) for ln in self.out.splitlines() if ln.startswith("RESULT ")]

    def reached(self) -> str:
        """The last ``PHASE`` line (:func:`_phase`): ``at 95.2 s: hyfi 4096^2 compiling``."""
        phases = [ln.split(" ", 2) for ln in self.out.splitlines() if ln.startswith("PHASE ")]
        return f"at {phases[-1][1]} s: {phases[-1][2]}" if phases else "before any step"

    def error(self) -> str:
        """The last line of stderr that names an error, else its last line."""
        if self.rc is None:
            return f"timed out (its time budget ran out; reached {self.reached()})"
        lines = [ln.strip() for ln in self.err.splitlines() if ln.strip()]
        named = [ln for ln in lines if re.search(r"error|exception|killed", ln, re.I)]
        return ((named or lines or [f"exit status {self.rc}, no output"])[-1])[:300]


class Child:
    """A subprocess in its own session, output to files, killed with its whole group."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        # Files, not pipes: a chatty child never blocks, and a killed one leaves what it wrote.
        self._out = tempfile.TemporaryFile()  # noqa: SIM115 -- closed in finish()
        self._err = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, stdout=self._out, stderr=self._err, env=env, cwd=ROOT, start_new_session=True
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group: compile workers too
            self.proc.wait()

    def finish(self, deadline: float) -> Run:
        try:
            rc: int | None = self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            self.kill()
        texts = []
        for f in (self._out, self._err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
            f.close()
        return Run(rc, *texts)


def _python(*args: str) -> list[str]:
    return [sys.executable, *args]


def _spawn(cmd: list[str], deadline: float, env: dict[str, str] | None = None) -> Run:
    return Child(cmd, env).finish(deadline)


def _step_worker(s: Setup, deadline: float, env: dict[str, str] | None = None, **spec: Any) -> Run:
    spec = {"device": s.device, "model": s.model, "width": s.width} | spec
    return _spawn(_python(__file__, "--worker", "step", json.dumps(spec)), deadline, env)


def _losses(run_dir: Path) -> list[float]:
    path = run_dir / "metrics.csv"
    if not path.exists():
        return []
    with path.open() as f:
        return [float(r["loss"]) for r in csv.DictReader(f) if r.get("loss")]


def _newest_checkpoint(run_dir: Path) -> int:
    steps = [
        int(m.group(1))
        for p in (run_dir / "checkpoints").glob("step_*")
        if (m := re.fullmatch(r"step_(\d+)", p.name))
    ]
    return max(steps, default=0)


def item_a(s: Setup, work: Path, deadline: float) -> dict[str, Any]:
    """hyfi-train with bf16 autocast: uninterrupted vs SIGKILLed after a checkpoint + resumed."""
    from hyfi_imaging.data.synthetic import write_synthetic_cohort
    from hyfi_imaging.preprocess import PreprocessOptions, run_preprocess

    side = (s.train_slide, s.train_slide)
    labels = write_synthetic_cohort(work / "slides", 8, seed=3, size=side, lesions=4)
    prep = run_preprocess(
        [work / "slides"], work / "data", PreprocessOptions(mpp=1.0, size=(s.train_size,) * 2),
        labels_path=labels, progress=False, qc=False,
    )  # fmt: skip
    if prep.manifest is None or prep.failed:
        return {"status": "failed", "error": f"preprocessing failed: {prep.failed}"}

    def cmd(out: Path) -> list[str]:
        sets = [
            f"data.manifest={prep.manifest}", f"train.out_dir={out}",
            f"model.kwargs.width={s.train_width}", f"train.epochs={s.train_epochs}",
            "train.batch_size=2", "train.progress=false", "train.precision=bf16",
            "train.checkpoint_every_steps=2", "optim.warmup_steps=1", "data.workers=0",
            "parallel.spatial=1x1",
        ]  # fmt: skip
        args = [str(ROOT / "recipes" / "synthetic.yaml")]
        for v in sets:
            args += ["--set", v]
        return _python(__file__, "--worker", "train", *args)

    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    if s.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # two runs side by side on a small CPU
    full, cut = work / "full", work / "cut"
    reference = Child(cmd(full), env)  # runs beside the one to kill
    victim = Child(cmd(cut), env)
    killed_at = None
    while time.monotonic() < deadline and victim.proc.poll() is None:
        if (newest := _newest_checkpoint(cut)) >= s.kill_after:
            victim.kill()  # SIGKILL: nothing is flushed, nothing is cleaned up
            killed_at = newest
            break
        time.sleep(0.01)
    first = victim.finish(deadline)
    ref = reference.finish(deadline)
    if ref.rc != 0:
        return {"status": "failed", "error": f"uninterrupted run: {ref.error()}"}
    if killed_at is None:
        why = f"ended (exit {first.rc}: {first.error()})" if first.rc is not None else "timed out"
        return {"status": "failed", "error": f"the run to kill {why} before it was killed"}
    logged_at_kill = len(_losses(cut))
    resumed = _spawn(cmd(cut), deadline, env)
    if resumed.rc != 0:
        return {"status": "failed", "error": f"resumed run: {resumed.error()}"}
    want, got = _losses(full), _losses(cut)
    found = re.search(r"resuming run \S+ from \S+ \(step (\d+)\)", resumed.err)
    diff = max((abs(a - b) for a, b in zip(want, got, strict=False)), default=None)
    describe = re.search(r"\((\w+) on (\w+)\)", ref.err + ref.out)
    return {
        "status": "ok",
        "backend": describe.group(1) if describe else None,
        "device": describe.group(2) if describe else None,
        "steps": len(want),
        "killed_after_checkpoint": killed_at,
        "steps_logged_when_killed": logged_at_kill,
        "interrupted": logged_at_kill < len(want),
        "resumed_from_step": int(found.group(1)) if found else None,
        "losses_equal": bool(want) and want == got,
        "max_abs_loss_diff": diff if len(want) == len(got) else None,
        "losses": want,
        "resumed_losses": got,
    }


def item_b(s: Setup, info: dict[str, Any], deadline: float) -> dict[str, Any]:
    """hyfi-verify on 1x1 (and 1x2 over NCCL when there are two GPUs)."""

    def verify(cmd: list[str], until: float) -> dict[str, Any]:
        run = _spawn([*cmd, *s.verify, "--steps", "2", "--json"], until)
        lines = [ln for ln in run.out.splitlines() if ln.startswith("{")]
        if run.rc not in (0, 1) or not lines:
            return {"status": "failed", "error": run.error()}
        report = json.loads(lines[-1])
        backend = re.search(r"\((\w+) on (\w+)\)", run.err + run.out)
        return {
            "status": "ok",
            "ok": report["ok"],
            "max_rel_error": report["max_rel_error"],
            "compared": report["compared"],
            "failed": report["failed"][:5],
            "backend": backend.group(1) if backend else None,
        }

    result = verify(_python("-m", "hyfi_imaging.cli.verify"), deadline)
    if info.get("count", 0) >= 2:
        torchrun = _python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
        result["1x2"] = verify(
            [*torchrun, "-m", "hyfi_imaging.cli.verify", "--spatial", "1x2"], deadline
        )
    else:
        result["1x2"] = {"status": "skipped", "error": _multi_gpu_note(info)}
    return result


def step_rows(
    side: int, results: list[dict[str, Any]], peak: float | None, missing: str
) -> list[dict[str, Any]]:
    """One row per contender at ``side`` from a step worker's results (pure): TFLOP/s, share of
    the peak, overhead over plain PyTorch in the same memory format; ``missing`` is the
    error of a contender without a result."""
    flops = next((r["flops"] for r in results if "flops" in r), None)
    done = {r["contender"]: r for r in results if "contender" in r}
    rows = []
    for name, c in CONTENDERS.items():
        r = dict(done.get(name) or {"contender": name, "side": side, "status": "not run"})
        if name not in done:
            r["error"] = missing
        r["flops"] = flops
        if r["status"] == "ok" and flops:
            r["tflops_per_s"] = flops / r["step_s"] / 1e12
            r["peak_share"] = r["tflops_per_s"] / peak if peak else None
        base = done.get("plain_cl" if c.channels_last else "plain")
        if c.hyfi and r["status"] == "ok" and base and base["status"] == "ok":
            r["overhead"] = r["step_s"] / base["step_s"] - 1
        rows.append(r)
    return rows


def speed_model(
    s: Setup, info: dict[str, Any], figures: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``hyfi-plan``'s predicted step of hyfi 1x1 at each side of (c) (issue 19, item 6: the
    speed model checked on a GPU), on the device table's row for this GPU (this CPU,
    calibrated, in a dry run) and, where ``figures`` were measured on the GPU
    (:func:`_calibrate`), on that row with them, per memory format: the model in bfloat16
    (the bytes autocast moves), batch 1, SGD. Counted on the meta device in this process,
    which touches no GPU."""
    import torch

    from hyfi_imaging.models import create_model
    from hyfi_imaging.parallel.devices import calibrated, get_device, table_key
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.parallel.plan import Candidate, predict

    memory = int((info.get("memory_gib") or 0) * GIB)
    row = "cpu" if s.device == "cpu" else table_key(str(info.get("name")), memory)
    if row is None:
        return {"row": None, "error": f"the device table has no row for {info.get('name')}"}
    kwargs: dict[str, Any] = {"num_classes": 2} | ({"width": s.width} if s.width else {})
    with torch.device("meta"):
        model = create_model(s.model, **kwargs).to(torch.bfloat16)
    device = get_device(row)
    device_cl = get_device(row, channels_last=True)

    def sides(on: Any) -> dict[str, float]:
        return {
            str(side): predict(model, (side, side), 1, Candidate(Layout()), device=on).step_s
            for side in s.step_sides
        }

    out: dict[str, Any] = {"row": row, "device": device.name, "sides": sides(device)}
    if device_cl != device:  # the row measured in channels-last too (the Hopper rows)
        out["sides_channels_last"] = sides(device_cl)
    measured = {}
    for fmt, fig in (figures or {}).items():
        if isinstance(fig, dict) and "flops" in fig:
            on = calibrated(device, fig, f"{info.get('name')}, {fmt}")
            measured[fmt] = {"sides": sides(on), "figures": fig}
    if measured:
        out["measured"] = measured
    return out


def item_c(s: Setup, peak: float | None, info: dict[str, Any], deadline: float) -> dict[str, Any]:
    """Step time per side and contender, each side in its own process; the speed model's
    prediction of hyfi's beside it (:func:`speed_model`)."""
    rows: list[dict[str, Any]] = []
    errors = []
    # The speed model's figures measured on this device first (seconds): what the
    # prediction from measured figures is checked with, beside the table's row.
    spec = json.dumps({"device": s.device, "benchmark": True})
    until = time.monotonic() + 0.2 * (deadline - time.monotonic())
    calibration = _spawn(_python(__file__, "--worker", "calibrate", spec), until)
    figures = next(iter(calibration.results()), None)
    if figures is None:
        errors.append(f"calibration: {calibration.error()}")
    spec = json.dumps({"device": s.device, "benchmark": True, "sides": s.index_sides})
    until = time.monotonic() + 0.15 * (deadline - time.monotonic())
    probe = _spawn(_python(__file__, "--worker", "index", spec), until)
    index = next(iter(probe.results()), None) or {"error": probe.error()}
    for i, side in enumerate(s.step_sides):
        share = 1.0 / (len(s.step_sides) - i)  # what is left, split over the sides left
        until = time.monotonic() + share * (deadline - time.monotonic())
        run = _step_worker(
            s, until, side=side, warmup=s.warmup, steps=s.steps, flops=True,
            contenders=list(CONTENDERS), benchmark=True,
        )  # fmt: skip
        rows += step_rows(side, run.results(), peak, run.error())
        if run.rc != 0 and not run.results():
            errors.append(f"{side}^2: {run.error()}")
    status = "ok" if any(r["status"] == "ok" for r in rows) else "failed"
    error = "; ".join(errors) or None
    try:
        predicted = speed_model(s, info, figures)
    except Exception as err:  # the measurements stand without it: the failure is recorded
        predicted = {"row": None, "error": f"{type(err).__name__}: {err}".splitlines()[0]}
    return {"status": status, "model": s.model, "rows": rows, "error": error,
            "predicted": predicted, "index": index}  # fmt: skip


def largest_side(
    fits: Callable[[int], bool | None],
    *,
    start: int,
    known: int = 0,
    upper: int | None = None,
    step: int = 32,
    resolution: int = RESOLUTION,
    grow: float = 2.0,
    deadline: float,
) -> tuple[int, int | None, bool]:
    """The largest side (a multiple of ``step``) for which ``fits`` holds: from ``start``,
    times ``grow`` while sides fit and divided by it while they do not, then bisection until
    the bracket is within 1/``resolution`` of the side.

    ``known`` is a side known to fit (not probed again, nor anything at or below it), ``upper``
    one known not to (an earlier run's out-of-memory: nothing at or above it is probed);
    ``fits`` returns None when it ran out of time. ``grow`` 2 searches blind (doubling); a ``start``
    projected from measured peaks searches with a ``grow`` near 1, so that a few probes near
    the limit bracket it. Returns ``(largest found, smallest that did not fit or None,
    converged)``.
    """

    def on_step(v: float) -> int:
        return int(v) // step * step

    lo, hi = known, upper
    side = max(on_step(start), on_step(known * grow))
    if upper is not None and side >= upper:  # below the known miss, in the same steps
        side = max(on_step(upper / grow), lo + step)

    def bracketed() -> bool:
        return hi is not None and hi - lo <= max(step, lo // resolution)

    while not bracketed() and time.monotonic() < deadline:  # grow or shrink until a fit and
        ok = fits(side)
        if ok is None:
            return lo, hi, bracketed()
        if ok:
            lo, side = side, max(on_step(side * grow), side + step)
            if hi is not None:
                break
        else:
            hi, side = side, on_step(side / grow)
            if side <= lo:
                break
    while hi is not None and not bracketed() and time.monotonic() < deadline:  # a miss
        mid = (lo + hi) // 2 // step * step  # bracket it; then bisect (hi - lo >= 2 steps)
        ok = fits(mid)
        if ok is None:
            break
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo, hi, bracketed()


def peak_fit(rows: list[dict[str, Any]], name: str) -> tuple[float, float] | None:
    """``(bytes, bytes per pixel)``: the least-squares line through ``name``'s measured peaks
    (``peak_gib`` of (c)'s rows) against the image's pixels; None without two sides (pure)."""
    points = [
        (r["side"] ** 2, r["peak_gib"] * GIB)
        for r in rows
        if r.get("contender") == name and r.get("status") == "ok" and r.get("peak_gib")
    ]
    if len({px for px, _ in points}) < 2:
        return None
    mx = statistics.fmean(px for px, _ in points)
    my = statistics.fmean(b for _, b in points)
    slope = sum((px - mx) * (b - my) for px, b in points) / sum((px - mx) ** 2 for px, _ in points)
    return my - slope * mx, slope


def projected_side(fit: tuple[float, float], capacity: float, step: int = 32) -> int:
    """The largest side (a multiple of ``step``) whose projected peak ``fit`` stays within
    ``capacity`` bytes (0 when none does; pure)."""
    fixed, per_pixel = fit
    if per_pixel <= 0 or capacity <= fixed:
        return 0
    return int(math.sqrt((capacity - fixed) / per_pixel)) // step * step


def _probe_env() -> dict[str, str]:
    """The environment of (d)'s probes: this one, with expandable segments unless set."""
    return {"PYTORCH_CUDA_ALLOC_CONF": PROBE_ALLOC_CONF} | dict(os.environ)


def _search(
    s: Setup,
    name: str,
    start: int,
    known: int,
    until: float,
    grow: float = 2.0,
    upper: int | None = None,
) -> dict[str, Any]:
    """One contender's largest side, every probe two SGD steps in a fresh process."""
    probes: list[dict[str, Any]] = []
    cap = (s.search_caps or {}).get(name, s.max_side)

    def fits(side: int) -> bool | None:
        if side > cap:
            why = "simulated memory cap" if s.search_caps else "--max-side"
            probes.append({"side": side, "outcome": f"over the {why} ({cap})"})
            return False
        run = _step_worker(s, until, env=_probe_env(), side=side, warmup=1, steps=1,
                           contenders=[name])  # fmt: skip
        r = next((r for r in run.results() if "contender" in r), None)
        if r is None:
            outcome = "timeout" if run.rc is None else "error"
            probes.append({"side": side, "outcome": outcome, "error": run.error()})
            return None if run.rc is None else False
        kept: dict[str, Any] = {k: r[k] for k in ("peak_gib", "step_s", "error", "where") if k in r}
        probes.append({"side": side, "outcome": r["status"], **kept})
        return r["status"] == "ok"

    lo, hi, converged = largest_side(
        fits, start=start, known=known, upper=upper, grow=grow, deadline=until
    )
    return {"side": lo, "upper": hi, "converged": converged, "known": known, "probes": probes}


def earlier_bracket(earlier: dict[str, Any] | None, name: str) -> tuple[int, int | None]:
    """``(largest side that trained, smallest that ran out of memory or None)`` among an
    earlier run's (d) probes of ``name`` (``--earlier``); ``(0, None)`` without one (pure)."""
    v = (earlier or {}).get(name) or {}
    probes = v.get("probes") or []
    fit = [p["side"] for p in probes if p.get("outcome") == "ok"] + [v.get("known") or 0]
    oom = [p["side"] for p in probes if p.get("outcome") == "oom"]
    return max(fit), min(oom, default=None)


def _probes_text(probes: list[dict[str, Any]]) -> str:
    return ", ".join(f"{p['side']}: {p['outcome']}" for p in probes)


def item_d(
    s: Setup,
    c: dict[str, Any],
    info: dict[str, Any],
    deadline: float,
    earlier: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The largest image of plain PyTorch, then of hyfi with checkpointing + streamed stem.

    Sides that trained in (c) are known to fit (not probed again). Where (c) measured a
    contender's peak at two sides, the line through them projects the side that fills the
    device's memory (:func:`peak_fit`, :func:`projected_side`) and the search starts there in
    steps of 3 % (a blind doubling search spends its time on probes far past the limit, each
    slow); otherwise it doubles, hyfi's from twice plain's side (the target's 4x the pixels).
    The projected ratio of the pixels (plain's bytes per pixel over hyfi's) is recorded too.
    ``earlier`` (d)'s record from an earlier run on the same device (``--earlier``): the sides
    its probes found to fit and to run out of memory bracket the search from the start.
    """
    rows = c.get("rows", [])
    fitted = [(r["contender"], r["side"]) for r in rows if r.get("status") == "ok"]
    capacity = PROBE_SHARE * (info.get("memory_gib") or 0) * GIB
    found: dict[str, Any] = {}
    for name, share in (("plain", 0.45), ("hyfi_ckpt", 1.0)):
        until = time.monotonic() + share * (deadline - time.monotonic())
        known = 0 if s.search_caps else max((v for n, v in fitted if n == name), default=0)
        was, upper = earlier_bracket(earlier, name)
        known = max(known, was)
        fit = None if s.search_caps else peak_fit(rows, name)
        projected = projected_side(fit, capacity) if fit and capacity else 0
        if projected > known:
            found[name] = _search(s, name, projected, known, until, PROBE_GROW, upper)
        else:
            start = s.search_start
            if name != "plain":
                start = max(start, 2 * found["plain"]["side"])
            grow = PROBE_GROW if upper else 2.0
            found[name] = _search(s, name, start, known, until, grow, upper)
        found[name]["projected_side"] = projected or None
        found[name]["bytes_per_pixel"] = fit[1] if fit else None
    base = found["plain"]["side"] ** 2
    ratio = found["hyfi_ckpt"]["side"] ** 2 / base if base else None
    per_px = [found[n]["bytes_per_pixel"] for n in ("plain", "hyfi_ckpt")]
    ok = all(v["side"] > 0 for v in found.values())
    error = "; ".join(
        f"{name}: no side trained ({_probes_text(v['probes'])})"
        for name, v in found.items()
        if v["side"] == 0
    )
    return {
        "status": "ok" if ok else "failed",
        "pixel_ratio": ratio,
        "projected_ratio": per_px[0] / per_px[1] if all(per_px) else None,  # type: ignore[operator]
        "alloc_conf": _probe_env()["PYTORCH_CUDA_ALLOC_CONF"],
        **found,
        "error": error or None,
    }


def item_e(s: Setup, deadline: float) -> dict[str, Any]:
    """torch.compile of hyfi's 1x1 path, then of the checkpointed + streamed one."""
    out: dict[str, Any] = {"backend": s.backend, "side": s.compile_side}
    order = ["hyfi", "hyfi_ckpt"]
    for i, name in enumerate(order):
        share = 1.0 if i == len(order) - 1 else 0.6
        until = time.monotonic() + share * (deadline - time.monotonic())
        run = _step_worker(
            s, until, side=s.compile_side, warmup=s.warmup, steps=s.steps, contenders=[name],
            compile=s.backend, benchmark=True,
        )  # fmt: skip
        r = next((r for r in run.results() if "contender" in r), None)
        if r is None:
            why = f"timed out (reached {run.reached()})" if run.rc is None else run.error()
            r = {"contender": name, "status": "timeout" if run.rc is None else "error"}
            r["error"] = why
        out[name] = r
        if name == "hyfi" and r["status"] != "ok":
            order.append("plain")  # is it torch's or hyfi's? the plain model, compiled
    works = out["hyfi"]["status"] == "ok"
    return {"status": "ok" if works else "failed", **out,
            "error": None if works else out["hyfi"].get("error")}  # fmt: skip


def _multi_gpu_note(info: dict[str, Any]) -> str:
    return (
        f"Several NCCL ranks (tile grids, pipeline stages, data replicas) need several GPUs; "
        f"this machine has {info.get('count', 0)}: they were not run"
    )


# ------------------------------------------------------------------ verdicts and report


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f} %"


def verdicts(items: dict[str, dict[str, Any]], peak: float | None, device: str) -> list[str]:
    """One PASS/MISS line per target, from the items' records (pure)."""
    lines: list[str] = []

    def say(ok: bool, what: str, detail: str) -> None:
        lines.append(f"{'PASS' if ok else 'MISS'}: {what}: {detail}")

    def failed(key: str, what: str) -> bool:
        item = items.get(key, {})
        if item.get("status") in ("ok", "skipped"):
            return item.get("status") == "skipped"
        say(False, what, f"{item.get('status')}: {item.get('error')}")
        return True

    if not failed("a", "(a) hyfi-train kill + resume continues exactly"):
        a = items["a"]
        if a["losses_equal"]:
            how = "losses equal bit for bit"
        elif a["max_abs_loss_diff"] is None:
            how = f"{len(a['resumed_losses'])} losses logged, {a['steps']} uninterrupted"
        else:
            how = f"max |loss difference| {a['max_abs_loss_diff']:.3g}"
        if not a["interrupted"]:
            how += "; the run had finished before the kill"
        say(
            a["losses_equal"] and a["interrupted"],
            "(a) hyfi-train kill + resume continues exactly",
            f"{a['steps']} steps, killed after the checkpoint of step "
            f"{a['killed_after_checkpoint']}, resumed from step {a['resumed_from_step']} "
            f"({a['backend']} on {a['device']}, bf16): {how}",
        )
    if not failed("b", "(b) hyfi-verify 1x1"):
        b = items["b"]
        say(b["ok"], "(b) hyfi-verify 1x1",
            f"{'OK' if b['ok'] else 'MISMATCH'} on {b['backend']}, {b['compared']} tensors, "
            f"max relative error {b['max_rel_error']:.3g}")  # fmt: skip
    if not failed("c", "(c) bf16 step time"):
        by = {(r["contender"], r["side"]): r for r in items["c"]["rows"]}
        for side in sorted({r["side"] for r in items["c"]["rows"]}):
            best = min(
                (by[n, side] for n in ("hyfi", "hyfi_cl") if by[n, side]["status"] == "ok"),
                key=lambda r: r["step_s"],
                default=None,
            )
            what = f"(c) hyfi 1x1 at {side}^2"
            if best is None:
                why = by["hyfi", side].get("error") or by["hyfi", side]["status"]
                say(False, what, f"did not run ({why})")
                continue
            fmt = "channels-last" if best["contender"] == "hyfi_cl" else "NCHW"
            share = best.get("peak_share")
            say(share is not None and share >= TARGET_PEAK_SHARE, f"{what}, share of peak",
                f"{best.get('tflops_per_s', 0):.1f} TFLOP/s = {_pct(share)} of "
                + (f"{peak:g} TFLOP/s" if peak else f"an unknown peak ({device}; --peak-tflops)")
                + f" ({fmt}; target >= {100 * TARGET_PEAK_SHARE:.0f} %)")  # fmt: skip
            over = best.get("overhead")
            say(over is not None and over <= TARGET_OVERHEAD, f"{what}, overhead over plain PyTorch",
                f"{1e3 * best['step_s']:.1f} ms vs " + (f"{1e3 * best['step_s'] / (1 + over):.1f}"
                f" ms, {100 * over:+.1f} %" if over is not None else "plain did not run")
                + f" ({fmt}; target <= {100 * TARGET_OVERHEAD:.0f} %)")  # fmt: skip
    if items.get("c", {}).get("status") == "ok":
        rows = {(r["contender"], r["side"]): r for r in items["c"]["rows"]}
        pred = items["c"].get("predicted") or {}
        if pred.get("row") is None:
            say(False, "(c) hyfi-plan's speed model", str(pred.get("error")))
        # (the table's row; its compute figures measured on this device, per memory format)
        checks = [(f"row {pred.get('row')}", "hyfi", "NCHW", pred.get("sides") or {})]
        if pred.get("sides_channels_last"):
            checks.append((f"row {pred.get('row')}, channels-last", "hyfi_cl", "channels-last",
                           pred["sides_channels_last"]))  # fmt: skip
        for key, name, fmt in (("nchw", "hyfi", "NCHW"), ("channels_last", "hyfi_cl", "channels-last")):  # fmt: skip
            if key in (pred.get("measured") or {}):
                label = f"row {pred.get('row')} with figures measured here, {fmt}"
                checks.append((label, name, fmt, pred["measured"][key]["sides"]))
        for label, name, fmt, sides in checks:
            for side, p in sides.items():
                what = f"(c) hyfi-plan's speed model at {side}^2 ({label})"
                r = rows.get((name, int(side)), {})
                if r.get("status") != "ok":
                    say(False, what, f"predicted {1e3 * p:.1f} ms; hyfi 1x1 ({fmt}) did not run")
                    continue
                err = p / r["step_s"] - 1
                say(abs(err) <= TARGET_SPEED_MODEL, what,
                    f"predicted {1e3 * p:.1f} ms, measured {1e3 * r['step_s']:.1f} ms (hyfi 1x1, "
                    f"{fmt}): {100 * err:+.1f} % (target within +-{100 * TARGET_SPEED_MODEL:.0f} %)")  # fmt: skip
    if not failed("d", "(d) largest image, hyfi deep ckpt + streamed stem / plain"):
        d = items["d"]
        p, h = d["plain"], d["hyfi_ckpt"]
        bound = "" if h["converged"] and p["converged"] else " (a search stopped at its time cap)"
        say((d["pixel_ratio"] or 0) >= TARGET_PIXELS,
            "(d) largest image, hyfi deep ckpt + streamed stem / plain",
            f"{h['side']}^2 vs {p['side']}^2 = {d['pixel_ratio'] or 0:.2f}x the pixels"
            f"{bound} (target >= {TARGET_PIXELS:g}x)")  # fmt: skip
        if d.get("projected_ratio"):
            say(d["projected_ratio"] >= TARGET_PIXELS,
                "(d) memory per pixel, hyfi deep ckpt + streamed stem / plain",
                f"{h['bytes_per_pixel']:.0f} vs {p['bytes_per_pixel']:.0f} bytes (the slopes of "
                f"(c)'s peaks) = {d['projected_ratio']:.2f}x the pixels in the same memory "
                f"(target >= {TARGET_PIXELS:g}x)")  # fmt: skip
    e = items.get("e", {})
    if e.get("status") != "skipped":
        for name, what in (
            ("hyfi", "hyfi 1x1"),
            ("hyfi_ckpt", "hyfi 1x1 + deep ckpt + streamed stem"),
        ):
            r = e.get(name)
            if r is None:
                say(False, f"(e) torch.compile of {what}", f"{e.get('status')}: {e.get('error')}")
            elif r["status"] == "ok":
                say(True, f"(e) torch.compile of {what}",
                    f"works ({e['backend']}): compiled in {r['compile_s']:.1f} s, "
                    f"{1e3 * r['step_s']:.1f} ms vs {1e3 * r['eager_step_s']:.1f} ms eager "
                    f"({r['speedup']:.2f}x)")  # fmt: skip
            else:
                how = "refused in one line" if r.get("refused") else "fails"
                say(bool(r.get("refused")), f"(e) torch.compile of {what}",
                    f"{how} ({e['backend']}): {r.get('error')}")  # fmt: skip
    return lines


def _markdown(report: dict[str, Any], out_json: Path) -> str:
    dev, items = report["device"], report["items"]
    dry = " (dry run on the CPU: plumbing, not a measurement)" if report["dry_run"] else ""
    lines = [
        f"\n## GPU check, {report['date']}: {dev['name']}{dry}\n",
        f"`python benchmarks/gpu_check.py{' --dry-run' if report['dry_run'] else ''}` "
        f"({report['seconds']:.0f} s; JSON: `{out_json.name}`) on {dev['name']}, "
        f"{dev['memory_gib']} GiB, {dev['count']} GPU(s); torch {dev['torch']}, "
        f"CUDA {dev['cuda']}, cuDNN {dev['cudnn']}, NCCL {dev['nccl']}; dense bf16 peak "
        + (
            f"{report['peak_tflops']:g} TFLOP/s ({report['peak_source']})."
            if report["peak_tflops"]
            else "unknown."
        ),
        "",
        "| item | status | seconds | note |",
        "|---|---|---|---|",
    ]
    for key, title in ITEMS.items():
        it = items[key]
        note = (it.get("error") or "").replace("|", "/")
        if it.get("from"):
            note = f"from the earlier run `{it['from']}`" + (f"; {note}" if note else "")
        lines.append(f"| ({key}) {title} | {it['status']} | {it.get('seconds', 0):.0f} | {note} |")
    rows = items["c"].get("rows", [])
    if rows:
        lines += ["", f"| {items['c'].get('model')} bf16, batch 1 | side | step ms | TFLOP/s "
                  "| share of peak | vs plain | peak GiB |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            if r["status"] != "ok":
                lines.append(f"| {r['contender']} | {r['side']} | {r['status']} | | | | |")
                continue
            over = f"{100 * r['overhead']:+.1f} %" if "overhead" in r else ""
            gib = f"{r['peak_gib']:.1f}" if "peak_gib" in r else ""
            lines.append(f"| {r['contender']} | {r['side']} | {1e3 * r['step_s']:.1f} | "
                         f"{r.get('tflops_per_s', 0):.1f} | {_pct(r.get('peak_share'))} | "
                         f"{over} | {gib} |")  # fmt: skip
    measured = (items["c"].get("predicted") or {}).get("measured") or {}
    if measured:  # what a row of the device table would take (hyfi_imaging/parallel/devices.py)
        lines += ["", "| speed model's figures, measured here | conv TFLOP/s | memory GB/s "
                  "| µs per kernel | px_half |", "|---|---|---|---|---|"]  # fmt: skip
        for fmt, m in measured.items():
            f = m["figures"]
            lines.append(f"| {fmt} | {f['flops'] / 1e12:.1f} | {f['mem_bw'] / 1e9:.0f} | "
                         f"{1e6 * f['op_overhead']:.1f} | {f['px_half']:.0f} |")  # fmt: skip
    index = items["c"].get("index") or {}
    if "nchw" in index:
        a, b = index["sides"]
        lines += ["", f"| 3x3 conv + BN + ReLU, 64 channels, bf16 fwd+bwd | ns per pixel at {a}^2 "
                  f"({index['elements'][0]:.3g} elements) | at {b}^2 ({index['elements'][1]:.3g}) "
                  "| ratio |", "|---|---|---|---|"]  # fmt: skip
        for fmt in ("nchw", "channels_last"):
            v = index[fmt]
            lines.append(f"| {fmt} | {1e9 * v['s_per_px'][0]:.3g} | {1e9 * v['s_per_px'][1]:.3g} "
                         f"| {v['ratio']:.2f} |")  # fmt: skip
    d = items["d"]
    if "plain" in d:
        lines += ["", "| largest image | side | megapixels | projected side | bytes per pixel "
                  "| probes |", "|---|---|---|---|---|---|"]  # fmt: skip
        for name in ("plain", "hyfi_ckpt"):
            v = d[name]
            per_px = f"{v['bytes_per_pixel']:.0f}" if v.get("bytes_per_pixel") else ""
            lines.append(f"| {name} | {v['side']} | {v['side'] ** 2 / 1e6:.1f} | "
                         f"{v.get('projected_side') or ''} | {per_px} | "
                         f"{_probes_text(v['probes'])} |")  # fmt: skip
    lines += ["", *[f"- {v}" for v in report["verdicts"]], f"- {report['multi_gpu']}", ""]
    return "\n".join(lines)


EXAMPLES = """\
examples:
  # on a GPU machine, from the repository root: the first thing to run there (<= 8 min)
  python benchmarks/gpu_check.py

  # the plumbing on a CPU, writing elsewhere (what tests/test_gpu_check.py runs)
  python benchmarks/gpu_check.py --dry-run --out /tmp/gc.json --markdown /tmp/gc.md

  # only the step time and the largest image, with more time for the search
  python benchmarks/gpu_check.py --items c,d --budget d=240

  # the largest image and torch.compile again, the rest (and (d)'s probes) from a first run
  python benchmarks/gpu_check.py --items d,e --earlier docs/gpu/2026-11-28-h200-run4.json

  # a device the peak table does not know (dense bf16 TFLOP/s)
  python benchmarks/gpu_check.py --peak-tflops 756

  # where only one folder comes back from the GPU machine: both files there, then append
  # the section to docs/benchmarks.md by hand
  python benchmarks/gpu_check.py --out "$OUT/gpu_check.json" --markdown "$OUT/gpu_check.md"
"""


def _budgets(s: Setup, given: list[str]) -> dict[str, float]:
    budgets = dict(s.budgets)
    for item in given:
        key, _, value = item.partition("=")
        if key not in ITEMS or not re.fullmatch(r"\d+(\.\d*)?", value):
            raise ValueError(f"--budget {item}: write ITEM=SECONDS with ITEM one of a-e")
        budgets[key] = float(value)
    return budgets


def _run_item(key: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one item; any exception becomes its one-line error, and the check goes on."""
    t0 = time.monotonic()
    try:
        result = fn()
    except Exception as err:
        result = {"status": "failed", "error": _error_line(err)}
    result["seconds"] = round(time.monotonic() - t0, 1)
    error = f": {result['error']}" if result.get("error") else ""
    print(f"({key}) {ITEMS[key]}: {result['status']} in {result['seconds']:.0f} s{error}",
          flush=True)  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    p = argparse.ArgumentParser(
        prog="gpu_check.py",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (CI)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("gpu_check.json"),
        help="the JSON result (default %(default)s)",
    )
    p.add_argument("--markdown", type=Path,
                   help="the markdown file the dated section is appended to (default "
                        "docs/benchmarks.md; none on a --dry-run: plumbing is not a record)")  # fmt: skip
    p.add_argument(
        "--items", default="abcde", help="the items to run, e.g. c,d (default %(default)s)"
    )
    p.add_argument("--budget", action="append", default=[], metavar="ITEM=SECONDS",
                   help="an item's time budget, seconds (a=75 b=30 c=125 d=135 e=115; dry run "
                        "a=60 b=25 c=25 d=30 e=50)")  # fmt: skip
    p.add_argument("--sides", help="image sides of (c) (4096,8192; dry run 64,96)")
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, TFLOP/s")
    p.add_argument("--workdir", type=Path, help="keep the cohort and runs here (else a temp dir)")
    p.add_argument("--earlier", type=Path, metavar="JSON",
                   help="an earlier run's JSON on the same device: the items not chosen are "
                        "taken from it (marked so), and (d) starts from its probes")  # fmt: skip
    args = p.parse_args(argv)
    s = DRY if args.dry_run else Setup()
    chosen = [k for k in ITEMS if k in args.items]
    try:
        s = replace(s, budgets=_budgets(s, args.budget))
        if args.sides:
            s = replace(s, step_sides=tuple(int(v) for v in args.sides.split(",")))
    except ValueError as err:
        p.error(str(err))
    if not chosen:
        p.error(f"--items {args.items}: name some of a, b, c, d, e")
    earlier: dict[str, dict[str, Any]] = {}
    if args.earlier:
        try:
            earlier = json.loads(args.earlier.read_text())["items"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            p.error(f"--earlier {args.earlier}: not a gpu_check.py JSON record ({err})")

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda}): run it on a GPU machine, or use --dry-run", file=sys.stderr)  # fmt: skip
        return 2
    t_start = time.monotonic()
    if s.device == "cuda":  # in a subprocess: this process keeps no CUDA context
        run = _spawn(_python(__file__, "--worker", "info", '{"device": "cuda"}'), t_start + 60)
        found = run.results()
        info: dict[str, Any] = found[0] if found else {
            "name": f"CUDA device ({run.error()})", "memory_gib": None, "count": 1,
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": None, "nccl": None,
        }  # fmt: skip
    else:
        info = device_info("cpu")
    peak = args.peak_tflops or peak_tflops(info["name"])
    source = "--peak-tflops" if args.peak_tflops else ("table" if peak else None)
    multi = (
        f"{info['count']} GPUs: hyfi-verify 1x2 ran over NCCL in (b); the rest on one GPU"
        if info.get("count", 0) >= 2
        else f"{_multi_gpu_note(info)}."
    )
    print(f"gpu_check: {info['name']}, {info.get('memory_gib')} GiB; torch {info.get('torch')}, "
          f"CUDA {info.get('cuda')}; dense bf16 peak {peak or 'unknown'} TFLOP/s", flush=True)  # fmt: skip
    print(f"gpu_check: {multi}", flush=True)

    items: dict[str, dict[str, Any]] = {}
    end = t_start
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        jobs: dict[str, Callable[[float], dict[str, Any]]] = {
            "a": lambda until: item_a(s, work / "train", until),
            "b": lambda until: item_b(s, info, until),
            "c": lambda until: item_c(s, peak, info, until),
            "d": lambda until: item_d(s, items.get("c", {}), info, until, earlier.get("d")),
            "e": lambda until: item_e(s, until),
        }
        for key in ITEMS:
            if key not in chosen:
                was = earlier.get(key, {})
                items[key] = {"status": "skipped", "error": "not chosen (--items)"}
                if was.get("status", "skipped") != "skipped":
                    items[key] = {**was, "from": args.earlier.name}
                continue
            end += s.budgets[key]  # what an item leaves unused passes to the next
            items[key] = _run_item(key, functools.partial(jobs[key], end))
    from hyfi_imaging.atomic import write_atomic

    now = datetime.datetime.now(datetime.timezone.utc)
    report = {
        "date": now.strftime("%Y-%m-%d %H:%M UTC"),
        "dry_run": args.dry_run,
        "host": socket.gethostname(),
        "device": info,
        "peak_tflops": peak,
        "peak_source": source,
        "budgets_s": s.budgets,
        "seconds": round(time.monotonic() - t_start, 1),
        "multi_gpu": multi,
        "items": {k: {"title": ITEMS[k], **v} for k, v in items.items()},
        "verdicts": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # The measurements first: a fault in the verdicts or the markdown must not lose them.
    write_atomic(args.out, json.dumps(report, indent=1, default=str) + "\n")
    report["verdicts"] = lines = verdicts(items, peak, info["name"])
    write_atomic(args.out, json.dumps(report, indent=1, default=str) + "\n")
    markdown = args.markdown or (None if args.dry_run else ROOT / "docs" / "benchmarks.md")
    if markdown is not None:
        old = markdown.read_text() if markdown.exists() else ""
        markdown.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(markdown, old + _markdown(report, args.out))
    print()
    for line in lines:
        print(line)
    section = f" and a section of {markdown}" if markdown is not None else ""
    print(f"gpu_check: {report['seconds']:.0f} s; wrote {args.out}{section}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
