"""Cluster-scale predictions from one small trace: Hy-Fi's comparison of parallel strategies.

Why a profile scaled by pixels and not :func:`~.plan.predict` per layout: a comparison over
64 to 2,048 GPUs, two image sizes and hundreds of configurations per strategy would trace
the model thousands of times. A convolutional network's work per layer is proportional to
its pixels, so each top-level layer is counted **once**, on the meta device at a small size
(:func:`profile_model`: forward and backward :class:`~.speed.Counts`, saved bytes plain and
under full checkpointing, boundary bytes, parameters, halo windows, BatchNorms), and scaled
to any tile: FLOPs, bytes and saved activations by its pixels, halo strips by its edge,
kernel calls and BatchNorm statistics not at all (:func:`stage_costs`). The stage costs then
go through the planner's own step arithmetic (:func:`~.plan.step_time`: each schedule's
order replayed, FSDP2, pipeline messages) on a device of :data:`~.speed.DEVICES`.

Strategies (Hy-Fi, ISC'22, as this library runs them), each at its best configuration that
fits the device's memory (:func:`best_config`), every replica of ``1`` image per micro-batch,
the rest of the GPUs data-parallel replicas:

* ``layer``: the layers cut into ``pp`` stages on ``pp`` GPUs, one micro-batch (no overlap);
* ``pipeline``: the same with ``m`` micro-batches (GPipe or 1F1B);
* ``spatial``: one image on a grid of tiles;
* ``hybrid``: spatial + pipeline -- per-stage grids (a spatial front stage, single-GPU
  stages behind: Hy-Fi's SP+LP, the junction) or one grid for every stage;
* ``hybrid+bi``: one grid for every stage and two mirrored replicas (GEMS; the junction does
  not run it).

Memory per rank (:func:`_memory`): the activations of the micro-batches the schedule keeps
in flight (full checkpointing: block inputs, plus the largest block recomputed), gradients
and SGD momentum sharded by FSDP2 over the replica's tiles and the replicas, the gathered
parameters; it fits when 1.1 x that plus 1 GiB (runtime, workspaces) is within the device.
Coarser than ``hyfi-plan``'s (within 9 % on CPU on 10 of 11 layouts): a screen, not a promise.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from functools import cache, partial
from pathlib import Path
from typing import Any

import torch

from hyfi_imaging.errors import ConfigError, HyfiError
from hyfi_imaging.models.registry import CheckpointedBlock
from hyfi_imaging.parallel.balance import partition
from hyfi_imaging.parallel.devices import Device, get_device
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.memory import saved_activations
from hyfi_imaging.parallel.meta import meta_copy
from hyfi_imaging.parallel.pipeline import model_layers, set_checkpointing
from hyfi_imaging.parallel.plan import OPT_STATE, StageCost, step_time
from hyfi_imaging.parallel.schedules import local_stages, peak_in_flight, schedule_actions
from hyfi_imaging.parallel.speed import (
    Counts,
    Window,
    compute_s,
    count_chain,
    halo_copy_bytes,
    halo_s,
    norm_allreduce_s,
    spatial_ops,
)

__all__ = [
    "HYFI_REPORTED",
    "STRATEGIES",
    "Config",
    "LayerProfile",
    "Outcome",
    "best_config",
    "compare_hyfi",
    "format_table",
    "plot",
    "profile_model",
    "stage_costs",
]

STRATEGIES = ("layer", "pipeline", "spatial", "hybrid", "hybrid+bi")
#: Hy-Fi's own reported speed-ups (Jain et al., ISC'22): hybrid over layer and over pipeline
#: parallelism.
HYFI_REPORTED = {"layer": 2.67, "pipeline": 1.68}
#: Bytes besides what :func:`_memory` counts (CUDA context, allocator, workspaces).
RUNTIME_BYTES = 2**30
MEMORY_MARGIN = 1.1


@dataclass(frozen=True)
class LayerProfile:
    """One top-level layer traced at ``side`` x ``side`` (batch 1, float32, meta device)."""

    name: str
    fwd: Counts
    bwd: Counts
    saved: float  # bytes autograd keeps for backward
    kept_ckpt: float  # kept under full checkpointing (the blocks' inputs, the rest as is)
    redo: float  # the largest block's saved bytes: recomputed, alive during its backward
    out_bytes: float  # the tensors it hands to the next layer
    params: float  # bytes
    windows: tuple[Window, ...]
    norms: tuple[int, ...]


@cache
def profile_model(name: str, side: int = 512) -> tuple[LayerProfile, ...]:
    """Each top-level layer of registered model ``name`` counted once at ``side^2`` (meta)."""
    from hyfi_imaging.models import create_model

    meta = meta_copy(create_model(name))
    layers = model_layers(meta)
    blocks = set_checkpointing(meta, "full")
    for m in meta.modules():  # traced plainly; checkpointing is accounted below
        if isinstance(m, CheckpointedBlock):
            m.grad_checkpointing = False
    x = torch.empty(1, int(getattr(meta, "in_chans", 3)), side, side, device="meta")
    counted, _ = count_chain(layers, x)
    trace = saved_activations(meta, lambda: meta(x))
    saved: dict[str, float] = dict.fromkeys((n for n, _ in layers), 0.0)
    in_block: dict[str, float] = dict.fromkeys((n for n, _ in layers), 0.0)
    per_block: dict[str, float] = {}
    for _key, owner, nbytes, _dtype in trace.storages:
        if owner == "(parameters)":
            continue
        top = owner.split(".")[0]
        if top not in saved:
            continue
        saved[top] += nbytes
        blk = next((b for b in blocks if owner == b or owner.startswith(b + ".")), None)
        if blk is not None:
            in_block[top] += nbytes
            per_block[blk] = per_block.get(blk, 0.0) + nbytes
    inputs: dict[str, float] = {}  # a block's input: that of the first layer called in it
    for path, _k, in_bytes, _o, _s in trace.calls:
        blk = next((b for b in blocks if path == b or path.startswith(b + ".")), None)
        if blk is not None:
            inputs.setdefault(blk, float(in_bytes))
    out: list[LayerProfile] = []
    y: Any = x
    for name_, layer in layers:
        ops = spatial_ops(layer, partial(layer, y))
        with torch.no_grad():
            y = layer(y)
        mine = [b for b in blocks if b.split(".")[0] == name_]
        out.append(
            LayerProfile(
                name_,
                *counted[name_],
                saved=saved[name_],
                kept_ckpt=saved[name_] - in_block[name_] + sum(inputs.get(b, 0.0) for b in mine),
                redo=max((per_block.get(b, 0.0) for b in mine), default=0.0),
                out_bytes=float(sum(t.numel() * t.element_size() for t in _tensors(y))),
                params=float(sum(p.numel() * p.element_size() for p in layer.parameters())),
                windows=tuple(ops.windows),
                norms=tuple(ops.norms),
            )
        )
    return tuple(out)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, tuple | list):
        return [t for v in x for t in _tensors(v)]
    return []


@dataclass(frozen=True)
class Config:
    """One way to run a replica: ``pp`` stages, the first on ``grid`` (``junction``: the rest
    on one GPU each; else every stage on ``grid``), ``microbatches`` images per replica."""

    strategy: str
    pp: int = 1
    grid: tuple[int, int] = (1, 1)
    microbatches: int = 1
    schedule: str = "gpipe"
    checkpointing: str = "none"
    junction: bool = False

    @property
    def gpus(self) -> int:
        """GPUs of one replica."""
        tiles = self.grid[0] * self.grid[1]
        return tiles + self.pp - 1 if self.junction else tiles * self.pp

    def layout(self, dp: int) -> Layout:
        if self.junction:
            return Layout(dp=dp, pp=self.pp, grids=(self.grid,) + ((1, 1),) * (self.pp - 1))
        return Layout(dp=dp, pp=self.pp, sp=self.grid)

    def describe(self) -> str:
        grids = (
            f"{self.grid[0]}x{self.grid[1]}" + ",1x1" * (self.pp - 1)
            if self.junction
            else f"{self.grid[0]}x{self.grid[1]}"
        )
        ck = " ckpt" if self.checkpointing == "full" else ""
        return f"pp{self.pp} sp{grids} m{self.microbatches} {self.schedule}{ck}"


def _itemsize_factor(device: Device) -> float:
    return 0.5 if device.dtype in ("bf16", "fp16") else 1.0


def stage_costs(
    profile: Sequence[LayerProfile],
    side: int,
    image: int,
    cfg: Config,
    device: Device,
    balance: Sequence[int],
) -> list[StageCost]:
    """Each stage's :class:`~.plan.StageCost` on its tile of an ``image^2`` image."""
    from hyfi_imaging.parallel.pipeline import stage_bounds

    half = _itemsize_factor(device)
    out: list[StageCost] = []
    for s, (start, stop) in enumerate(stage_bounds(balance)):
        grid = cfg.grid if (s == 0 or not cfg.junction) else (1, 1)
        tiles = grid[0] * grid[1]
        edge = (image / grid[0] / side, image / grid[1] / side)
        k = edge[0] * edge[1]
        fwd = bwd = Counts()
        kept = redo = 0.0
        windows: list[Window] = []
        norms: list[int] = []
        for lp in profile[start:stop]:
            f, b = lp.fwd.scaled(k * half), lp.bwd.scaled(k * half)
            f = replace(f, flops=f.flops / half)  # FLOPs do not halve with the bytes
            b = replace(b, flops=b.flops / half)
            ck = cfg.checkpointing == "full" and lp.redo > 0
            fwd, bwd = fwd + f, bwd + b + (f if ck else Counts())
            kept += (lp.kept_ckpt if ck else lp.saved) * k * half
            redo = max(redo, lp.redo * k * half if ck else 0.0)
            if tiles > 1:
                windows += [
                    replace(w.scaled(edge), itemsize=max(1, int(w.itemsize * half)))
                    for w in lp.windows
                ]
                norms += list(lp.norms)
        halo = norms_s = (0.0, 0.0)
        if tiles > 1:
            link = device.link(tiles)
            copies = Counts(bytes=halo_copy_bytes(windows, grid))
            fwd, bwd = fwd + copies, bwd + copies
            halo = (
                halo_s(windows, grid, link, device),
                halo_s(windows, grid, link, device, backward=True),
            )
            norms_s = (
                norm_allreduce_s(norms, tiles, link, backward=False),
                norm_allreduce_s(norms, tiles, link, backward=True),
            )
        prev = profile[start - 1].out_bytes if start > 0 else 3 * side * side * 4.0
        out.append(
            StageCost(
                act=int(kept),
                transient=int(redo),
                params=int(sum(lp.params for lp in profile[start:stop])),
                units=[int(lp.params) for lp in profile[start:stop] if lp.params],
                out_bytes=int(profile[stop - 1].out_bytes * k * half),
                in_bytes=int(prev * k * half),
                weight_grads=0,
                forward_s=compute_s(fwd, device) + halo[0] + norms_s[0],
                backward_s=compute_s(bwd, device) + halo[1] + norms_s[1],
                fwd=fwd,
                bwd=bwd,
                halo_s=halo,
                norms_s=norms_s,
            )
        )
    return out


def _balance(profile: Sequence[LayerProfile], cfg: Config, device: Device) -> tuple[int, ...]:
    """The cut that evens out the stages' compute (a junction's front stage over its tiles)."""
    if cfg.pp == 1:
        return (len(profile),)
    cost = [compute_s(lp.fwd + lp.bwd, device) for lp in profile]
    shares = [cfg.grid[0] * cfg.grid[1] if s == 0 or not cfg.junction else 1 for s in range(cfg.pp)]
    return partition(cost, cfg.pp, shares=shares)


def _memory(costs: Sequence[StageCost], cfg: Config, lay: Layout) -> float:
    """The busiest rank's bytes: activations in flight, backward's recomputed block, state."""
    orders = schedule_actions(cfg.schedule, cfg.pp, cfg.microbatches)
    k_opt = OPT_STATE["sgd"]
    worst = 0.0
    for r in range(cfg.pp):
        act = peak_in_flight(orders[r], lambda _c, s: costs[s].act)
        mine = local_stages(cfg.schedule, cfg.pp, r)
        n = lay.dp * lay.stage_size(r)
        state = 0.0
        for ls in mine:
            c = costs[ls.index]
            gathered = c.params if cfg.microbatches > 1 or n == 1 else 2 * max(c.units, default=0)
            state += (1 + k_opt) * c.params / n + (gathered if n > 1 else 0)
        redo = max(costs[ls.index].transient for ls in mine)
        worst = max(worst, act + redo + state)
    return worst


@dataclass
class Outcome:
    """A strategy's best configuration for a model, image and GPU count (None: none fits)."""

    model: str
    image: int
    gpus: int
    strategy: str
    config: Config | None
    images_per_s: float
    step_s: float
    peak: float
    bubble: float
    #: The fastest configuration whatever its memory, for reference.
    unconstrained: float = 0.0
    device: str = ""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["config"] = self.config.describe() if self.config else None
        return d


def _configs(strategy: str, n_layers: int, gpus: int) -> Iterator[Config]:
    grids = [(g, g) for g in (1, 2, 4, 8, 16, 32)] + [(g, 2 * g) for g in (1, 2, 4, 8, 16)]
    depth = [p for p in (2, 3, 4, 6, 8, 12, 16) if p <= n_layers]
    for ck in ("none", "full"):
        if strategy == "layer":
            for pp in depth:
                yield Config(strategy, pp, checkpointing=ck)
        elif strategy == "pipeline":
            for pp in depth:
                for m in (pp, 2 * pp, 4 * pp):
                    for sched in ("gpipe", "1f1b"):
                        yield Config(strategy, pp, microbatches=m, schedule=sched, checkpointing=ck)
        elif strategy == "spatial":
            for g in grids[1:]:
                yield Config(strategy, 1, g, checkpointing=ck)
        elif strategy in ("hybrid", "hybrid+bi"):
            for pp in (2, 4):
                for g in grids[1:]:
                    for m in (pp, 2 * pp, 4 * pp):
                        if strategy == "hybrid+bi":
                            yield Config(strategy, pp, g, m, "bidirectional", ck)
                            continue
                        for sched in ("gpipe", "1f1b"):
                            yield Config(strategy, pp, g, m, sched, ck)
                            yield Config(strategy, pp, g, m, sched, ck, junction=True)


def best_config(
    model: str, image: int, gpus: int, strategy: str, device: Device, *, side: int = 512
) -> Outcome:
    """The fastest configuration of ``strategy`` that fits ``device`` (images per second)."""
    profile = profile_model(model, side)
    best: Outcome | None = None
    fastest = 0.0
    for cfg in _configs(strategy, len(profile), gpus):
        if cfg.gpus > gpus:
            continue
        last = image / max(cfg.grid) / 32  # the deepest map's side on a tile (stride 32)
        if cfg.grid != (1, 1) and last < 2:
            continue
        dp = gpus // cfg.gpus
        try:
            lay = cfg.layout(dp)
            balance = _balance(profile, cfg, device)
        except (ConfigError, HyfiError):
            continue
        costs = stage_costs(profile, side, image, cfg, device, balance)
        step, bubble, _parts = step_time(costs, lay, cfg.microbatches, cfg.schedule, device)
        rate = dp * cfg.microbatches / step
        fastest = max(fastest, rate)
        peak = MEMORY_MARGIN * _memory(costs, cfg, lay) + RUNTIME_BYTES
        if peak > device.memory:
            continue
        if best is None or rate > best.images_per_s:
            best = Outcome(model, image, gpus, strategy, cfg, rate, step, peak, bubble)
    if best is None:
        best = Outcome(model, image, gpus, strategy, None, 0.0, math.inf, math.inf, 0.0)
    best.unconstrained = fastest
    return best


def compare_hyfi(
    *,
    models: Sequence[str] = ("resnet50", "amoebanet-d-18-256"),
    sizes: Sequence[int] = (8192, 16384),
    gpus: Sequence[int] = (64, 128, 256, 512, 1024, 2048),
    device: str | Device = "v100",
) -> list[Outcome]:
    """Every strategy's best configuration for each model, image size and GPU count."""
    dev = get_device(device) if isinstance(device, str) else device
    rows = [
        best_config(m, s, n, strategy, dev)
        for m in models
        for s in sizes
        for n in gpus
        for strategy in STRATEGIES
    ]
    for r in rows:
        r.device = device if isinstance(device, str) else dev.name
    return rows


def format_table(rows: Sequence[Outcome], device: str = "") -> str:
    """The comparison as text: images/s per strategy, hybrid's speed-ups, Hy-Fi's figures."""
    lines = [
        f"PREDICTED (not measured) images/s{(' on ' + device) if device else ''}; "
        "'-' = no configuration fits (in brackets: the fastest ignoring memory); speed-ups of "
        "the better hybrid, in brackets against a strategy that does not fit",
        f"{'model':20} {'image':>6} {'GPUs':>5} "
        + " ".join(f"{s:>16}" for s in STRATEGIES)
        + f" {'hy/layer':>9} {'hy/pipe':>9}",
    ]
    key = {(r.model, r.image, r.gpus, r.strategy): r for r in rows}
    for model, image, gpus in sorted({(r.model, r.image, r.gpus) for r in rows}):
        cells, got, free = [], {}, {}
        for s in STRATEGIES:
            r = key.get((model, image, gpus, s))
            if r is None:
                cells.append(f"{'':>16}")
                continue
            got[s], free[s] = r.images_per_s, r.unconstrained
            text = f"{r.images_per_s:.3g}" if r.config else f"- ({r.unconstrained:.3g})"
            cells.append(f"{text:>16}")
        hy = max(got.get("hybrid", 0.0), got.get("hybrid+bi", 0.0))
        ratio = [
            f"{hy / got[b]:.2f}x"
            if got.get(b)
            else (f"({hy / free[b]:.2f}x)" if hy and free.get(b) else "n/a")
            for b in ("layer", "pipeline")
        ]
        lines.append(
            f"{model:20} {image:>6} {gpus:>5} " + " ".join(cells) + f" {ratio[0]:>9} {ratio[1]:>9}"
        )
    lines.append(
        f"Hy-Fi reports (measured, ISC'22): hybrid {HYFI_REPORTED['layer']}x over layer and "
        f"{HYFI_REPORTED['pipeline']}x over pipeline parallelism."
    )
    lines.append("best configurations (largest GPU count per model and image):")
    for model, image in sorted({(r.model, r.image) for r in rows}):
        top = max(r.gpus for r in rows if (r.model, r.image) == (model, image))
        for s in STRATEGIES:
            r = key.get((model, image, top, s))
            if r is not None and r.config is not None:
                lines.append(
                    f"  {model} {image} {top} GPUs {s:10} {r.config.describe():36} "
                    f"step {r.step_s:.3g} s, peak {r.peak / 2**30:.1f} GiB, bubble {r.bubble:.2f}"
                )
    return "\n".join(lines)


def plot(rows: Sequence[Outcome], path: Path) -> None:
    """Images/s against GPUs: a row of panels per device, one per model and image size, a line
    per strategy; titled as predictions, with Hy-Fi's measured speed-ups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    colours = dict(zip(STRATEGIES, ("C0", "C1", "C2", "C3", "C4"), strict=True))
    devices = sorted({r.device for r in rows})
    panels = sorted({(r.model, r.image) for r in rows})
    fig, axes = plt.subplots(
        len(devices), len(panels), figsize=(4.0 * len(panels), 3.4 * len(devices)), squeeze=False
    )
    for row, dev in zip(axes, devices, strict=True):
        for ax, (model, image) in zip(row, panels, strict=True):
            for s in STRATEGIES:
                pts = sorted(
                    (r.gpus, r.images_per_s)
                    for r in rows
                    if (r.device, r.model, r.image, r.strategy) == (dev, model, image, s)
                    and r.config is not None
                )
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", markersize=3, color=colours[s])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{dev}: {model} {image}^2", fontsize=9)
            ax.set_xlabel("GPUs", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="both", alpha=0.3)
        row[0].set_ylabel("images/s, PREDICTED", fontsize=8)
    handles = [Line2D([], [], color=colours[s], marker="o", markersize=3) for s in STRATEGIES]
    fig.legend(handles, STRATEGIES, loc="lower center", ncol=len(STRATEGIES), fontsize=8)
    fig.suptitle(
        "PREDICTIONS of hyfi-imaging's speed model (benchmarks/bench_speed_model.py), not "
        f"measurements; a strategy missing where nothing fits. Hy-Fi reports (measured): hybrid "
        f"{HYFI_REPORTED['layer']}x over layer and {HYFI_REPORTED['pipeline']}x over pipeline.",
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
