"""What every multi-rank test worker shares: start-up, comparison, one JSON line out.

Why a helper module: pytest cannot run a test body inside ``mpiexec``, so each
multi-rank case runs in a worker script launched by the test; the worker reports
its verdicts as one JSON line on rank 0 (prefixed with :data:`MARKER` so that a
stray print cannot be mistaken for it), and the test parses that line. Cases
are grouped into one launch per grid because a launch costs ~2 s of start-up.

A case that raises is recorded as failed (with the exception) instead of ending
the launch, so one broken layer does not hide the verdicts of the others; an
exception that only some ranks raise would desynchronise the collectives, which
the test's subprocess timeout turns into a clear failure.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "MARKER",
    "Case",
    "combine",
    "compare",
    "emit",
    "merge_ranks",
    "parse_grid",
    "run_cases",
    "run_world",
    "start",
]

#: Prefix of the one line of results a worker prints on rank 0.
MARKER = "HYFI-RESULT "

#: One case's verdict on one rank: ``ok``, the worst relative error and details.
Case = dict[str, Any]


def start(grid: tuple[int, ...]) -> Any:
    """Join the job as one tile of ``grid`` (mpiexec, torchrun or a plain process)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from hyfi_imaging.parallel.launch import init_parallel
    from hyfi_imaging.parallel.layout import Layout

    return init_parallel(Layout(sp=grid), timeout_s=60.0)


def compare(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> Case:
    """``max|got - want| / max|want|`` (exact equality for integer tensors)."""
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape:
        return {
            "ok": False,
            "max_rel": float("inf"),
            "detail": f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}",
        }
    if not want.is_floating_point():
        same = bool(torch.equal(got, want))
        return {"ok": same, "max_rel": 0.0 if same else float("inf"), "detail": f"{name}: exact"}
    if not bool(torch.isfinite(got).all()):
        return {"ok": False, "max_rel": float("inf"), "detail": f"{name}: non-finite values"}
    diff = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
    scale = float(want.double().abs().max()) if want.numel() else 0.0
    rel = diff / scale if scale > 0 else diff
    return {
        "ok": rel <= rtol,
        "max_rel": rel,
        "detail": f"{name}: max|a-b| {diff:.3g} rel {rel:.3g}",
    }


def combine(parts: list[Case]) -> Case:
    """One verdict from several comparisons: all ok, the worst error, the failed details."""
    bad = [p["detail"] for p in parts if not p["ok"]]
    return {
        "ok": not bad,
        "max_rel": max((p["max_rel"] for p in parts), default=0.0),
        "detail": "; ".join(bad[:4]) if bad else f"{len(parts)} tensors",
    }


def run_cases(cases: dict[str, Callable[[], Case]]) -> dict[str, Case]:
    """Run every case in order on this rank; an exception fails that case only."""
    out: dict[str, Case] = {}
    for name, fn in cases.items():
        try:
            out[name] = fn()
        except Exception as err:  # reported per case; every rank raises alike
            if dist.get_rank() == 0:
                traceback.print_exc(file=sys.stderr)
            out[name] = {
                "ok": False,
                "max_rel": float("inf"),
                "detail": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
            }
    return out


def run_world(
    cases: dict[str, tuple[int, Any]], run: Callable[[Any], Case], world: int
) -> dict[str, Case]:
    """The cases of a table ``name -> (ranks, config)`` meant for a launch of ``world`` ranks
    and named on the command line (all of them with no names; none with ``--none``: see
    ``_launch.marked_results_per_world``), each ``run(config)``'s verdict (:func:`run_cases`:
    an exception fails that case only)."""
    named = set(sys.argv[1:])
    return run_cases(
        {
            name: partial(run, cfg)
            for name, (n, cfg) in cases.items()
            if n == world and (not named or name in named)
        }
    )


def merge_ranks(local: dict[str, Case]) -> dict[str, Case]:
    """Every rank's verdicts, merged on rank 0: ok on all ranks, worst error, first failure."""
    world = dist.get_world_size()
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, local)
    merged: dict[str, Case] = {}
    for rank, verdicts in enumerate(parts):
        for name, v in verdicts.items():
            m = merged.setdefault(name, {"ok": True, "max_rel": 0.0, "detail": v["detail"]})
            m["max_rel"] = max(m["max_rel"], v["max_rel"])
            if not v["ok"] and m["ok"]:
                m["ok"], m["detail"] = False, f"rank {rank}: {v['detail']}"
    return merged


def emit(payload: dict[str, Any]) -> None:
    """Print the results line on rank 0 and leave without interpreter teardown.

    After a barrier, :func:`~hyfi_imaging.parallel.launch.exit_now` (MPI finalized, then the
    C library's ``exit``, without Python's teardown): tearing down gloo at interpreter exit
    sometimes aborts ("terminate called without an active exception", exit 6) after all the
    work is done.
    """
    from hyfi_imaging.parallel.launch import exit_now

    if dist.get_rank() == 0:
        text = json.dumps(payload, allow_nan=True)
        print(MARKER + text, flush=True)
    dist.barrier()
    exit_now(0)


def parse_grid(text: str) -> tuple[int, ...]:
    """``"2x2"`` -> (2, 2); ``"2x1x2"`` -> (2, 1, 2) (a volume's grid); ``"L3"`` -> (3,) (a
    signal's 1-D grid, spelled as the command line does)."""
    if text.lower().startswith("l"):
        return (int(text[1:]),)
    return tuple(int(v) for v in text.lower().split("x"))
