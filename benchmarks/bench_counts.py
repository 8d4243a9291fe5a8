"""What a training step costs, counted: FLOPs, copy bytes, host syncs, collectives (issue 19, item 1).

Why counted, not timed: on a shared 2-core VM wall time is noise; these counts
are exact, repeat to the byte, and carry over to a GPU (where a byte copied
costs what ~300 FLOPs do, and a host sync stalls the stream). Every layout is
set against one process running the same model, image, batch and options
(checkpointing, streaming), so a ratio says what parallelism adds.

Per rank, over one ``ParallelModel.train_step`` (the second: the first builds
the schedule), counted by :func:`hyfi_imaging.parallel.counts.count_step`:

* **FLOPs** (``FlopCounterMode``), summed over ranks against one process;
* **copy bytes**: bytes written by copy-like aten ops (``copy_``, ``clone``,
  ``fill_``, ``zero_``, ``cat``, ``constant_pad_nd``, scatters, ``_to_copy``
  ...), by op and by module path, against the bytes one process saves for
  backward (the issue's "copy bytes per saved byte": summed over ranks) and
  against the rank's own saved bytes (exact without checkpointing or
  streaming; with them only indicative: see ``count_step``). FSDP2's parameter and gradient copies
  (its all-gather and reduce-scatter buffers, the sharded gradient) are a
  column apart: they scale with the parameters, not the image;
* **host syncs** (``.item()``, ``float(t)``, ``if t:``; device-to-host copies)
  and where they happen;
* **collectives**: calls and payload bytes by kind (halo and pipeline
  messages are ``send``/``recv``; FSDP2's are all-gathers and reduce-scatters).

Layouts (``--layouts``, each in its own ``mpiexec``): ``1x1`` one process;
``GYxGX`` a spatial grid (on a volume model ``1xGYxGX``; ``GZxGYxGX`` as is);
``GYxGX,GYxGX`` per-stage grids (the junction: ``pp`` = number of grids);
``ppN`` N pipeline stages; a ``+ckpt`` suffix adds full activation
checkpointing, ``+stream`` the streamed stem. Pipelines cut a chain into halves
of its top-level layers, two micro-batches. A layout a model cannot run (a
pipeline of a U-Net, a streamed stem of a model that does not start with a
convolution) is listed as n/a.

The **peer chain** (``--peer-size``, 0 to skip): the plain conv+ReLU chain
(``convchain``: 8 layers of 16 channels) on 1x4 against one process, the
comparison with LBANN DistConv.

Targets (issue 19), one PASS/MISS line each:

* copy bytes <= 0.25x one process's saved bytes, ResNet-50 1x2 (the issue's
  figure is at 512^2, batch 2: 2.22x at 037b84e, 2.33x with FSDP2's sharded
  gradient copy counted in, as the issue did; 0.037x at cf56a21);
* copy bytes <= 1x the rank's own saved bytes on the peer chain 1x4 at 512^2
  (4.61x at 037b84e, 0.18x at cf56a21);
* host syncs <= 2 per step per rank, none inside a layer (a module below the
  stage's root);
* FLOPs summed over ranks <= 1.01 x one process's without checkpointing or
  streaming (the classifier head runs on every tile, and a layer computed on its
  tile itself redoes its border bands, at most ``windowed.MAX_BORDER_SHARE`` of
  it; ResNet-50 512^2 1x2: 1.000000 at 037b84e, 1.0234 when every layer redid
  its borders, 1.0047 with the share capped); <= 1.03 with them.

Usage::

    python benchmarks/bench_counts.py                     # 3 models x 6 layouts at 256^2 + peer chain
    python benchmarks/bench_counts.py --models resnet50 --layouts 1x1 1x2 --size 512
    python benchmarks/bench_counts.py --models resnet18:0.25 convchain --layouts 1x1 1x2 2x2 pp2
    python benchmarks/bench_counts.py --json counts.json --detail 3

Exit status: 0 measured (PASS/MISS lines report the targets), 1 a target
missed with ``--strict``, 2 a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["LayoutSpec", "count_model", "main", "parse_layout", "summarize"]

HERE = Path(__file__).resolve()
MARKER = "HYFI-COUNTS "
MIB = 2**20

DEFAULT_MODELS = ["resnet50", "amoebanet-d-6-64", "unet3d:8"]
DEFAULT_LAYOUTS = ["1x1", "1x2", "2x2", "2x2+ckpt+stream", "1x2,1x1", "pp2"]
#: Volume models (3-D input): their size comes from ``--volume``.
VOLUME_MODELS = {"unet3d", "cosmoflow"}

TARGET_COPY_PER_SAVED = 0.25  # ResNet-50 1x2: copy bytes (all ranks) / one process's saved bytes
TARGET_PEER_COPY = 1.0  # peer chain 1x4: a rank's copy bytes / its own saved bytes
TARGET_SYNCS = 2  # per step per rank
# ratio - 1 without checkpointing or streaming: the head (global pool, fc) runs on every
# tile's pooled features, and layers on the direct path redo their border bands.
TARGET_FLOP_EXACT = 0.01
TARGET_FLOP_RECOMPUTE = 1.03  # with checkpointing / streaming


# ----------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class LayoutSpec:
    """One ``--layouts`` entry, parsed: stage grids, stages, options."""

    text: str
    grids: tuple[tuple[int, ...], ...]
    pp: int
    ckpt: bool
    stream: bool

    @property
    def junction(self) -> bool:
        return len(set(self.grids)) > 1

    @property
    def baseline(self) -> str:
        """The one-process layout it is compared with (same options)."""
        return "1x1" + ("+ckpt" if self.ckpt else "") + ("+stream" if self.stream else "")

    def ranks(self, volume: bool) -> int:
        return sum(_size(g) for g in self.stage_grids(volume))

    def stage_grids(self, volume: bool) -> tuple[tuple[int, ...], ...]:
        """The grid of every stage (a 2-D grid of a volume model becomes ``1xGYxGX``)."""
        grids = self.grids if len(self.grids) == self.pp else self.grids * self.pp
        if volume:
            grids = tuple((1, *g) if len(g) == 2 else g for g in grids)
        return grids


def _size(grid: tuple[int, ...]) -> int:
    n = 1
    for v in grid:
        n *= v
    return n


def parse_layout(text: str) -> LayoutSpec:
    """``"2x2+ckpt+stream"``, ``"1x2,1x1"``, ``"pp2"``, ``"1x1"`` -> :class:`LayoutSpec`."""
    base, *opts = text.strip().split("+")
    bad = [o for o in opts if o not in ("ckpt", "stream")]
    if bad:
        raise SystemExit(f"bench_counts: error: layout {text!r}: unknown option {bad[0]!r}")
    grids: tuple[tuple[int, ...], ...]
    try:
        if base.startswith("pp"):
            pp, grids = int(base[2:]), ((1, 1),)
        else:
            parts = base.split(",")
            grids = tuple(tuple(int(v) for v in p.lower().split("x")) for p in parts)
            pp = len(grids)
    except ValueError:
        raise SystemExit(
            f"bench_counts: error: layout {text!r} is not GYxGX[,GYxGX...] or ppN "
            "(with +ckpt, +stream)"
        ) from None
    if pp < 1 or any(v < 1 for g in grids for v in g):
        raise SystemExit(f"bench_counts: error: layout {text!r}: counts must be at least 1")
    return LayoutSpec(text, grids, pp, "ckpt" in opts, "stream" in opts)


def _model_name(spec: str) -> str:
    return spec.split(":")[0]


def _build(spec: str) -> Any:
    """``name`` or ``name:width`` -> the model (2 classes)."""
    from hyfi_imaging.models import create_model

    name, _, width = spec.partition(":")
    kwargs: dict[str, Any] = {"num_classes": 2}
    if width:
        kwargs["width"] = float(width) if "." in width else int(width)
    return create_model(name, **kwargs)


def _not_applicable(model: str, layout: LayoutSpec) -> str | None:
    """Why ``model`` cannot run ``layout`` (None: it can), judged on a meta-device copy."""
    import torch

    from hyfi_imaging.errors import ConfigError
    from hyfi_imaging.models.registry import CheckpointedBlock
    from hyfi_imaging.parallel.pipeline import is_chain
    from hyfi_imaging.parallel.streaming import stream_stem

    with torch.device("meta"):
        m = _build(model)
    if layout.pp > 1 and not is_chain(m):
        return "not a chain of layers: no pipeline"
    if layout.junction and _model_name(model) in VOLUME_MODELS:
        return "per-stage grids are 2-D only"
    if layout.ckpt and not any(isinstance(b, CheckpointedBlock) for b in m.modules()):
        return "no checkpointable blocks"
    if layout.stream:
        try:
            stream_stem(m)
        except ConfigError as err:
            return f"no streamed stem ({str(err).splitlines()[0][:60]})"
    return None


# ----------------------------------------------------------------------------- worker


def _worker(cfg: dict[str, Any]) -> None:
    """One launch: every model of ``cfg["models"]`` on ``cfg["layout"]``; rank 0 prints the counts."""
    import torch
    import torch.distributed as dist

    from hyfi_imaging.parallel.launch import exit_now, init_parallel

    torch.set_num_threads(1)
    spec = parse_layout(cfg["layout"])
    pc = None
    results: dict[str, Any] = {}
    for model_spec in cfg["models"]:
        layout = _layout(spec, _model_name(model_spec) in VOLUME_MODELS)
        if pc is None:
            pc = init_parallel(layout)
        elif pc.layout != layout:
            raise SystemExit(f"bench_counts: models of one launch need one layout ({layout})")
        mine = count_model(pc, spec, model_spec, cfg)
        gathered: list[Any] = [None] * pc.world_size
        dist.all_gather_object(gathered, mine)
        results[model_spec] = gathered
    assert pc is not None
    if pc.rank == 0:
        print(MARKER + json.dumps(results), flush=True)
    dist.barrier()
    exit_now(0)


def _layout(spec: LayoutSpec, volume: bool) -> Any:
    from hyfi_imaging.parallel.layout import Layout

    grids = spec.stage_grids(volume)
    return Layout(pp=spec.pp, sp=grids[0], grids=grids if spec.junction else None)


def count_model(pc: Any, spec: LayoutSpec, model_spec: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """This rank's counts of the second training step of ``model_spec`` on ``spec``."""
    import torch
    import torch.distributed as dist

    from hyfi_imaging.parallel.apply import output_shape
    from hyfi_imaging.parallel.counts import count_step
    from hyfi_imaging.parallel.engine import ParallelModel, ParallelPlan
    from hyfi_imaging.parallel.pipeline import model_layers
    from hyfi_imaging.parallel.verify import default_target

    volume = _model_name(model_spec) in VOLUME_MODELS
    torch.manual_seed(0)
    model = _build(model_spec)
    n = len(model_layers(model)) if spec.pp > 1 else 0
    plan = ParallelPlan(
        pc.layout,
        microbatches=2 if spec.pp > 1 else 1,
        balance=(n - n // 2, n // 2) if spec.pp > 1 else None,  # fixed: a measured cut may vary
        checkpointing="full" if spec.ckpt else "none",
        streaming="stem" if spec.stream else "none",
    )
    hw = tuple(cfg["volume"] if volume else cfg["size"])
    in_chans = int(getattr(model, "in_chans", 3))
    out_shape = output_shape(_build(model_spec).to("meta"), (cfg["batch"], in_chans, *hw))
    assert out_shape is not None
    pm = ParallelModel(model, pc, plan, image_hw=hw)
    del model
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(cfg["batch"], in_chans, *hw, generator=gen)
    labels = default_target(tuple(out_shape), gen)
    # A loader hands a rank its own tile (a view of the whole image would be counted whole).
    tiles = pm.tile_of(images).clone() if pm.is_first else None
    for p in pm.parameters():
        p.grad = None
    pm.train_step(tiles, labels)  # builds the schedule; not counted
    for p in pm.parameters():
        p.grad = None
    dist.barrier()
    began = time.process_time()
    counts = count_step(lambda: pm.train_step(tiles, labels), pm.stage_module)
    mine = counts.to_json()
    mine.update(cpu_s=time.process_time() - began, stage=pm.stage_index)
    del mine["kinds"]  # every module's class: large, and not reported
    return mine


# ----------------------------------------------------------------------------- driver


def _launch(cfg: dict[str, Any], ranks: int, timeout_s: float) -> dict[str, Any] | str:
    """Run the worker (``mpiexec -n ranks`` when ranks > 1): rank 0's counts, or why it failed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(HERE), "--worker", json.dumps(cfg)]
    if ranks > 1:
        mpiexec = str(Path(sys.executable).with_name("mpiexec"))
        if not Path(mpiexec).exists():
            mpiexec = "mpiexec"
        cmd = [mpiexec, "-n", str(ranks), *cmd]
    label = f"{cfg['layout']} ({ranks} rank{'s' if ranks > 1 else ''}): {' '.join(cfg['models'])}"
    print(f"  running {label}", file=sys.stderr, flush=True)
    began = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"bench_counts: error: {label} timed out after {timeout_s:.0f} s", file=sys.stderr)
        return f"timed out after {timeout_s:.0f} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode or not lines:
        out = (proc.stdout + proc.stderr).splitlines()
        print("\n".join(out[-30:]), file=sys.stderr)
        print(f"bench_counts: error: {label} failed (exit {proc.returncode})", file=sys.stderr)
        errors = [ln for ln in out if "Error" in ln]
        return (errors[-1] if errors else f"exit {proc.returncode}").split("]: ")[-1][:160]
    print(f"           {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
    return json.loads(lines[-1][len(MARKER) :])


def _table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]
    print(f"\n{title}")
    print("  " + "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def summarize(
    ranks: list[dict[str, Any]], base: list[dict[str, Any]], plain_saved: int
) -> dict[str, Any]:
    """The ratios of one run (``ranks``) against one process (``base``: same options;
    ``plain_saved``: what one process without checkpointing saves for backward)."""
    flops = sum(r["flops"] for r in ranks)
    copies = [r["copy_bytes"] for r in ranks]
    own = [
        c / r["saved_bytes"] if r["saved_bytes"] else float("inf")
        for c, r in zip(copies, ranks, strict=True)
    ]
    inside = [
        sum(
            v
            for path, phases in r["syncs_by_module"].items()
            if path not in ("(outside modules)", "(root)")
            for v in phases.values()
        )
        for r in ranks
    ]
    return {
        "ranks": len(ranks),
        "flops": flops,
        "flop_ratio": flops / base[0]["flops"] if base[0]["flops"] else float("nan"),
        "copy_sum": sum(copies),
        "copy_max": max(copies),
        "fsdp_copy_sum": sum(r["fsdp_copy_bytes"] for r in ranks),
        "copy_per_plain_saved": sum(copies) / plain_saved if plain_saved else float("nan"),
        "copy_per_own_saved": max(own),
        "saved_max": max(r["saved_bytes"] or 0 for r in ranks),
        "syncs_max": max(r["sync_count"] for r in ranks),
        "syncs_inside": max(inside),
        "coll_calls_max": max(r["collective_calls"] for r in ranks),
        "coll_bytes_max": max(r["collective_bytes"] for r in ranks),
    }


def _detail(model: str, layout: str, ranks: list[dict[str, Any]], top: int) -> None:
    print(f"\n  {model} {layout}, per rank:")
    for i, r in enumerate(ranks):
        ops = ", ".join(f"{k} {v / MIB:.1f}" for k, v in list(r["copies"].items())[:top])
        mods = sorted(
            ((p, sum(ph.values())) for p, ph in r["copies_by_module"].items()),
            key=lambda kv: -kv[1],
        )[:top]
        where = ", ".join(
            f"{p} {v / MIB:.1f} ("
            + "/".join(f"{ph[:3]} {n / MIB:.1f}" for ph, n in r["copies_by_module"][p].items())
            + ")"
            for p, v in mods
        )
        coll = ", ".join(
            f"{k} {v['calls']}x {v['bytes'] / MIB:.2f}" for k, v in r["collectives"].items()
        )
        syncs = ", ".join(
            f"{p}/{ph} {n}" for p, phs in r["syncs_by_module"].items() for ph, n in phs.items()
        )
        print(
            f"    rank {i} (stage {r['stage']}): {r['flops'] / 1e9:.3f} GFLOP, copies "
            f"{r['copy_bytes'] / MIB:.1f} MiB (+ FSDP2 {r['fsdp_copy_bytes'] / MIB:.1f} MiB), "
            f"saved {(r['saved_bytes'] or 0) / MIB:.1f} MiB, "
            f"syncs {r['sync_count']}, CPU {r['cpu_s']:.1f} s"
        )
        print(f"      copies by op (MiB): {ops or '-'}")
        print(f"      copies by module (MiB): {where or '-'}")
        print(f"      syncs at: {syncs or '-'}")
        print(f"      collectives (calls, MiB): {coll or '-'}")


def _verdict(ok: bool, text: str) -> str:
    line = f"{'PASS' if ok else 'MISS'}  {text}"
    print(line)
    return line


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_counts.py",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  python benchmarks/bench_counts.py\n"
            "  python benchmarks/bench_counts.py --models resnet50 --layouts 1x1 1x2 --size 512\n"
            "  python benchmarks/bench_counts.py --models convchain --layouts 1x1 1x4 "
            "--size 512 --peer-size 0\n"
            "  python benchmarks/bench_counts.py --models unet3d:8 --layouts 1x1 2x2 2x1x2 "
            "--volume 32x32x32\n\n"
            "Layouts: 1x1 (one process), GYxGX (spatial; volume models 1xGYxGX), GZxGYxGX,\n"
            "GYxGX,GYxGX (per-stage grids), ppN (pipeline); suffixes +ckpt (full\n"
            "checkpointing), +stream (streamed stem). Models: a registered name, or\n"
            "name:width (resnet18:0.25, unet3d:8)."
        ),
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument(
        "--models",
        nargs="+",
        default=DEFAULT_MODELS,
        metavar="NAME[:WIDTH]",
        help=f"models (default: {' '.join(DEFAULT_MODELS)})",
    )
    p.add_argument(
        "--layouts",
        nargs="+",
        default=DEFAULT_LAYOUTS,
        metavar="LAYOUT",
        help=f"layouts (default: {' '.join(DEFAULT_LAYOUTS)}); one-process baselines are added",
    )
    p.add_argument("--size", default="256", help="2-D image size, H or HxW (default 256)")
    p.add_argument(
        "--volume", default="32", help="volume size of 3-D models, D or DxHxW (default 32)"
    )
    p.add_argument("--batch", type=int, default=2, help="per-replica batch (default 2)")
    p.add_argument(
        "--peer-size",
        type=int,
        default=512,
        help="image side of the peer conv chain 1x4 vs one process (default 512; 0 skips it)",
    )
    p.add_argument("--detail", type=int, default=5, help="top ops/modules per rank (default 5)")
    p.add_argument("--json", type=Path, help="write every count to this file")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args(argv)
    for name, dims in (("size", 2), ("volume", 3)):
        try:
            _sizes(getattr(args, name), dims)
        except ValueError as err:
            p.error(f"--{name} {getattr(args, name)!r}: {err}")
    from hyfi_imaging.models.registry import list_models

    unknown = [m for m in args.models if _model_name(m) not in list_models()]
    if unknown:
        p.error(f"--models: unknown model {unknown[0]!r} (known: {', '.join(list_models())})")
    if args.json is not None and not args.json.parent.is_dir():
        p.error(f"--json {args.json}: its folder does not exist (the counts would be lost)")
    return args


def _sizes(text: str, dims: int) -> list[int]:
    """``"256"`` or ``"256x192"`` as ``dims`` sides (ValueError naming what is wrong)."""
    try:
        vals = [int(v) for v in text.lower().split("x")]
    except ValueError:
        raise ValueError("give N or " + "x".join("N" * dims)) from None
    if len(vals) not in (1, dims) or min(vals) < 1:
        raise ValueError("give N or " + "x".join("N" * dims) + ", each at least 1")
    return vals * dims if len(vals) == 1 else vals


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    layouts = [parse_layout(t) for t in args.layouts]
    for spec in list(layouts):  # every layout's one-process baseline, first
        if spec.baseline not in [s.text for s in layouts]:
            layouts.insert(0, parse_layout(spec.baseline))
    if "1x1" not in [s.text for s in layouts]:
        layouts.insert(0, parse_layout("1x1"))
    base_cfg = {
        "size": _sizes(args.size, 2),
        "volume": _sizes(args.volume, 3),
        "batch": args.batch,
    }
    runs: dict[str, dict[str, Any]] = {}  # layout -> model -> per-rank counts
    skipped: dict[tuple[str, str], str] = {}
    load = os.getloadavg()[0]
    failed: dict[tuple[str, str], str] = {}
    for spec in layouts:
        for model in args.models:  # one launch each: a failure stays that run's
            why = _not_applicable(model, spec)
            if why:
                skipped[(model, spec.text)] = why
                continue
            n = spec.ranks(_model_name(model) in VOLUME_MODELS)
            got = _launch({**base_cfg, "layout": spec.text, "models": [model]}, n, args.timeout)
            if isinstance(got, str):
                failed[(model, spec.text)] = got
            else:
                runs.setdefault(spec.text, {}).update(got)
    peer: dict[str, Any] = {}
    if args.peer_size:
        cfg = {**base_cfg, "size": [args.peer_size] * 2, "models": ["convchain"]}
        for lay, n in (("1x1", 1), ("1x4", 4)):
            got = _launch({**cfg, "layout": lay}, n, args.timeout)
            if isinstance(got, str):
                failed[("peer chain", lay)] = got
            else:
                peer[lay] = got["convchain"]

    h, w = base_cfg["size"]
    print(
        f"\n# Counts of one training step (ParallelModel.train_step, float32, batch {args.batch}, "
        f"2-D {h}x{w}, volumes {'x'.join(map(str, base_cfg['volume']))}; load average "
        f"{load:.1f} at start). Sums and maxima over ranks; ratios against one process "
        "with the same options."
    )
    summary: dict[str, dict[str, Any]] = {}
    rows = []
    for model in args.models:
        plain = runs.get("1x1", {}).get(model)
        plain_saved = plain[0]["saved_bytes"] if plain else 0
        for spec in layouts:
            key = (model, spec.text)
            if key in skipped or key in failed:
                rows.append(
                    [model, spec.text, "-", "n/a" if key in skipped else "FAILED", *[""] * 9]
                )
                continue
            ranks = runs[spec.text][model]
            base = runs.get(spec.baseline, {}).get(model) or ranks
            s = summarize(ranks, base, plain_saved)
            summary[f"{model} {spec.text}"] = s
            rows.append(
                [
                    model,
                    spec.text,
                    str(s["ranks"]),
                    f"{s['flops'] / 1e9:.2f}",
                    f"{s['flop_ratio']:.6f}",
                    f"{s['copy_sum'] / MIB:.1f}",
                    f"{s['fsdp_copy_sum'] / MIB:.1f}",
                    f"{s['copy_per_plain_saved']:.3f}",
                    f"{s['copy_per_own_saved']:.3f}",
                    f"{s['saved_max'] / MIB:.1f}",
                    str(s["syncs_max"]),
                    str(s["coll_calls_max"]),
                    f"{s['coll_bytes_max'] / MIB:.2f}",
                ]
            )
    _table(
        "Per layout (copy MiB: all ranks, aten copy-like ops; FSDP2 MiB: FSDP2's parameter and "
        "gradient copies, apart; copy/1p saved: copy bytes of all ranks / one process's saved "
        "bytes without checkpointing; copy/own saved: the worst rank's copies / its own saved "
        "bytes; syncs, collectives: the busiest rank)",
        [
            "model",
            "layout",
            "ranks",
            "GFLOP",
            "FLOP ratio",
            "copy MiB",
            "FSDP2 MiB",
            "copy/1p saved",
            "copy/own saved",
            "saved MiB max",
            "syncs max",
            "coll. calls max",
            "coll. MiB max",
        ],
        rows,
    )
    for (model, lay), why in skipped.items():
        print(f"  n/a: {model} {lay}: {why}")
    for (model, lay), why in failed.items():
        print(f"  FAILED: {model} {lay}: {why}")
    if args.detail:
        for model in args.models:
            for spec in layouts:
                if spec.text in runs and model in runs[spec.text]:
                    _detail(model, spec.text, runs[spec.text][model], args.detail)
    peer_summary = None
    if len(peer) == 2:
        peer_summary = summarize(peer["1x4"], peer["1x1"], peer["1x1"][0]["saved_bytes"])
        rows = [
            [
                "1x1",
                f"{peer['1x1'][0]['copy_bytes'] / MIB:.2f}",
                f"{peer['1x1'][0]['saved_bytes'] / MIB:.2f}",
                "-",
                "1",
            ],
            *[
                [
                    f"1x4 rank {i}",
                    f"{r['copy_bytes'] / MIB:.2f}",
                    f"{r['saved_bytes'] / MIB:.2f}",
                    f"{r['copy_bytes'] / r['saved_bytes']:.3f}",
                    f"{r['saved_bytes'] / peer['1x1'][0]['saved_bytes']:.3f}",
                ]
                for i, r in enumerate(peer["1x4"])
            ],
        ]
        _table(
            f"Peer chain (convchain: 8 conv3x3+ReLU, 16 channels), {args.peer_size}^2, batch "
            f"{args.batch}, 1x4 (LBANN DistConv saves 0.265 of one process per rank)",
            ["process", "copy MiB", "saved MiB", "copy/own saved", "saved / 1 process"],
            rows,
        )
        if args.detail:
            _detail("convchain", f"1x4 {args.peer_size}^2", peer["1x4"], args.detail)

    print()
    lines = []
    r50 = summary.get("resnet50 1x2")
    if r50:
        note = "" if (h, w) == (512, 512) else f" (here {h}x{w}; the issue's figure is at 512^2)"
        lines.append(
            _verdict(
                r50["copy_per_plain_saved"] <= TARGET_COPY_PER_SAVED,
                f"ResNet-50 1x2 copy bytes / one process's saved bytes: "
                f"{r50['copy_per_plain_saved']:.3f} (target <= {TARGET_COPY_PER_SAVED}){note}",
            )
        )
    if peer_summary:
        lines.append(
            _verdict(
                peer_summary["copy_per_own_saved"] <= TARGET_PEER_COPY,
                f"peer chain 1x4 {args.peer_size}^2 copy bytes / own saved bytes, worst rank: "
                f"{peer_summary['copy_per_own_saved']:.3f} (target <= {TARGET_PEER_COPY})",
            )
        )
    if summary:
        worst = max(summary.items(), key=lambda kv: kv[1]["syncs_max"])
        lines.append(
            _verdict(
                worst[1]["syncs_max"] <= TARGET_SYNCS,
                f"host syncs per step per rank: at most {worst[1]['syncs_max']} ({worst[0]}) "
                f"(target <= {TARGET_SYNCS})",
            )
        )
        inside = max(summary.items(), key=lambda kv: kv[1]["syncs_inside"])
        lines.append(
            _verdict(
                inside[1]["syncs_inside"] == 0,
                f"host syncs inside a layer's forward or backward: at most "
                f"{inside[1]['syncs_inside']} per rank ({inside[0]}) (target 0)",
            )
        )
        exact = {k: v for k, v in summary.items() if "+" not in k.split()[-1]}
        if exact:
            worst = max(exact.items(), key=lambda kv: abs(kv[1]["flop_ratio"] - 1))
            lines.append(
                _verdict(
                    1 <= worst[1]["flop_ratio"] <= 1 + TARGET_FLOP_EXACT,
                    f"FLOPs of all ranks / one process, no checkpointing or streaming: worst "
                    f"{worst[1]['flop_ratio']:.6f} ({worst[0]}) (target <= {1 + TARGET_FLOP_EXACT})",
                )
            )
        more = {k: v for k, v in summary.items() if "+" in k.split()[-1]}
        if more:
            worst = max(more.items(), key=lambda kv: kv[1]["flop_ratio"])
            lines.append(
                _verdict(
                    worst[1]["flop_ratio"] <= TARGET_FLOP_RECOMPUTE,
                    f"FLOPs of all ranks / one process, with checkpointing or streaming: worst "
                    f"{worst[1]['flop_ratio']:.4f} ({worst[0]}) (target <= {TARGET_FLOP_RECOMPUTE})",
                )
            )
    if args.json:
        from hyfi_imaging.atomic import write_atomic

        write_atomic(
            args.json,
            json.dumps(
                {
                    "config": vars(args) | {"json": str(args.json)},
                    "runs": runs,
                    "peer": peer,
                    "summary": summary,
                    "peer_summary": peer_summary,
                    "skipped": {f"{m} {lay}": v for (m, lay), v in skipped.items()},
                    "failed": {f"{m} {lay}": v for (m, lay), v in failed.items()},
                    "verdicts": lines,
                },
                indent=1,
                default=str,
            ),
        )
    if failed:
        return 2
    return 1 if args.strict and any(ln.startswith("MISS") for ln in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
