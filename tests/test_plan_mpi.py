"""hyfi-plan's memory model against measured per-rank peaks on real multi-rank runs.

Each layout trains two steps under ``mpiexec`` (``tests/mpi/plan_accuracy.py``):
the peak resident set over the memory after the model build, on every rank,
against the planner's prediction for the same layout and stage cut. The issue
sets +-15 % on at least six layouts; these cover one process, spatial grids,
data x spatial, pipeline (both schedules) and pipeline x spatial, with every
checkpointing mode, two-stage schedules (GEMS, ZBV), and per-stage grids (the junction).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))

from _launch import have_mpiexec, merged_result, mpiexec

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not installed"),
]

TOLERANCE = 0.15
#: name -> (ranks, dp,pp,gy,gx, checkpointing[+stem], micro-batches, schedule[, per-stage grids]);
#: ResNet-18 x0.25, 1024^2, batch 2.
LAYOUTS: dict[str, tuple[Any, ...]] = {
    "1-process": (1, "1,1,1,1", "none", 1, "gpipe"),
    "sp2x2": (4, "1,1,2,2", "none", 1, "gpipe"),
    "sp2x2-full": (4, "1,1,2,2", "full", 1, "gpipe"),
    "sp2x2-full+stem": (4, "1,1,2,2", "full+stem", 1, "gpipe"),
    "sp1x2-selective": (2, "1,1,1,2", "selective", 1, "gpipe"),
    # deep: the first layers' block inputs computed again, their blocks in units (the planner
    # counts each unit's internals). On sp1x2 + stem (2026-11-28, fifteenth session): full
    # 54.4 / 63.1-63.4 MiB, deep 50.2 / 58.9-59.1 (-14 %), the tensors alive at once +2.4 %
    # and +2.6 %: the grid's runtime memory below.
    "1-process-deep+stem": (1, "1,1,1,1", "deep+stem", 1, "gpipe"),
    "pp2-1f1b": (2, "1,2,1,1", "none", 2, "1f1b"),
    "dp2-sp1x2": (4, "2,1,1,2", "none", 1, "gpipe"),
    "pp2-sp1x2-full": (4, "1,2,1,2", "full", 2, "gpipe"),
    "pp2-bidirectional": (2, "1,2,1,1", "none", 2, "bidirectional"),
    "pp2-zbv": (2, "1,2,1,1", "none", 2, "zbv"),
    "pp2-junction-1x2,1x1": (3, "1,2,1,2", "none", 2, "1f1b", "1x2,1x1"),
    "pp2-junction-1x2,1x1-bidirectional": (4, "1,2,1,2", "none", 2, "bidirectional", "1x2,1x1"),
    # Deep halos: the runs' carried borders and masked copies (parallel/deep_borders.py).
    # Measured 2026-11-29 (nineteenth session), predicted / measured (tensors alive at once):
    # sp1x2 depth 2 154.2 / 159.1 MiB, -3.1 % (151.9, +1.5 %); sp2x2 depth 2 80.3 / 86.8,
    # -7.5 % (79.0, +1.6 %), depth 4 the same runs (a block's two convolutions); sp1x2 depth 2
    # full 120.6 / 122.3, -1.4 % (115.2, +4.8 %). Before the planner counted them: 17-30 % under.
    "sp1x2-halo2": (2, "1,1,1,2", "none", 1, "gpipe"),
    "sp2x2-halo2-full": (4, "1,1,2,2", "full", 1, "gpipe"),
    # FSDP2 inside pipeline stages, at a size where the state outweighs the activations: the
    # pipeline holds every unit's unsharded gradients to its last backward (measured
    # 2026-11-29, twenty-first session, 128^2: 8.0 predicted / 8.5 MiB, -5 %; tensors +2.7 %;
    # -22 % on both while the planner counted one unit's).
    "dp2-pp2-128": (4, "2,2,1,1", "none", 1, "gpipe"),
}
#: Cases run at another image size than 1024^2.
IMAGE = {"dp2-pp2-128": 128}
#: Cases run with deep halos (``parallel.halo_depth``).
HALO_DEPTH = {"sp1x2-halo2": 2, "sp2x2-halo2-full": 2}


# Eight layouts in the default run; the others with the slow ones (-m slow).
# Measured 2026-11-26 (CPU, this VM), predicted / measured per pipeline rank, after the planner
# counts torch's per-micro-batch receive buffers, the whole input batch on the first stage and
# each backward's working set with what is alive at *its* time: pp2-1f1b 148.0 / 143.9 and
# 81.9 / 85.3 MiB (the last stage was 73.9, -13 %); pp 2 1F1B m 4 batch 4 180.0 / 179.8 and
# 89.9 / 93.8 (the first stage was 148.0, -18 %); pp2-bidirectional 141.9 / 147.0 (was +12 %).
# Per-stage grids: 1x2,1x1 1f1b m 2: 92.4 / 92.7 (the 1x2 stage), the 1x1 stage 49.8 / 57.7
# (-14 %, not the busiest rank). Known under-predictions: ZBV (pp2-zbv, -19.5 %: the split
# input/weight backward's working set is not modelled; it read -7 % only while the transient
# of one stage was added to the other's activations) and DualPipeV (pp 2, m 4, -20 %).
# ZBV now reads -8.5 % (measured twice, 2026-11-27, fifth session): no longer an xfail.
# The streamed stem (sp2x2-full+stem) read -22.6 % at 1024^2 until 2026-11-27: the ~9 MiB
# "not modelled" were the stem's input bands, kept alive by a reference cycle in
# halo.window_of until the garbage collector ran (fixed, not modelled away).
XFAIL = {
    # Measured 2026-11-27 (fifth session) on this session's code and on 201f3e8 alike: 28.5
    # predicted / 36.0 MiB measured. Within 15 % when fixed (8b4ed78), while every
    # convolution's backward still ran in bands (an option since c69ee4d). With the stem
    # streamed the planner is 5-7 MiB under at every checkpointing mode (none 46.8 / 52.1,
    # selective 39.8 / 44.7, full 28.5 / 35.8), and its transient drops to 0.5-6.7 MiB: the
    # stem's saved input tile is counted (6 MiB "between modules" in the trace). One process
    # at the tile's size with the stem streamed is within 4 % (45.6 / 47.4 MiB), and the 2x2
    # grid without the stem is 4.8 MiB under too (62.9 / 67.7, -7 %, a default case that
    # passes): about 5 MiB per rank on a grid that the planner does not model, whatever the
    # stem, which only the smallest prediction (full + stem) turns into a -20 % miss. About
    # 3 MiB of it is there at any size and layout (64^2, one process: 6.3 predicted / 9.3
    # measured; 2x2 at 128^2: 7.0 / 10.7; dp 2: 8.3 / 10.3), the rest grows with the grid.
    # Sixth session: the tensors alive at once on the same steps (LiveTensorPeak) read 27.8
    # MiB, so the planner is +2.6 % on the tensors and the 8.8 MiB it misses are no tensor:
    # Python objects (1.4 MiB by tracemalloc) and what oneDNN and Gloo allocate inside their
    # kernels. glibc's heap is not it (an mmap threshold of 4 KiB changes nothing).
    # Eighth session: 3.2 MiB of it is oneDNN's primitive cache (a compiled primitive per
    # distinct convolution shape, border bands included): ONEDNN_PRIMITIVE_CACHE_CAPACITY=0
    # measures 33.0 MiB, -14 % (docs/benchmarks.md); per-arena malloc is not it.
    "sp2x2-full+stem": "the streamed stem with full checkpointing, unbanded: -20.7 %",
}
#: Cases held to the tensors alive at once as well: deep checkpointing's units counted
#: (measured 2026-11-28, fifteenth session: 89.5 predicted / 89.5 MiB, +0.02 %; full + stem
#: alike, 97.9 / 97.9).
TENSORS_WITHIN = {
    "1-process-deep+stem": 0.03, "sp1x2-halo2": 0.05, "sp2x2-halo2-full": 0.06,
    "dp2-pp2-128": 0.06,
}  # fmt: skip
#: Four more in the slow set since 2026-11-27 (the suite's time): each composes a planner
#: term a default layout already checks (dp with sp1x2 / sp2x2; checkpointing full with
#: selective; the bidirectional schedule with 1F1B and the junction).
SLOW = {
    "pp2-sp1x2-full", "pp2-zbv", "sp2x2-full+stem",
    "dp2-sp1x2", "sp2x2-full", "sp1x2-selective", "pp2-bidirectional",
    "pp2-junction-1x2,1x1-bidirectional", "sp1x2-halo2", "sp2x2-halo2-full",
}  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            n,
            marks=[pytest.mark.slow] * (n in SLOW)
            + [pytest.mark.xfail(reason=XFAIL.get(n, ""), strict=True)] * (n in XFAIL),
        )
        for n in LAYOUTS
    ],
)
def test_predicted_peak_within_15_percent(name: str) -> None:
    ranks, layout, ck, m, schedule, *grids = LAYOUTS[name]
    ck, _, stem = ck.partition("+")  # "full+stem": the stem streamed too
    job = mpiexec(
        ranks, "tests/mpi/plan_accuracy.py", "--layout", layout, "--ck", ck,
        "--streaming", stem or "none", "--m", str(m), "--schedule", schedule,
        "--image", str(IMAGE.get(name, 1024)),
        *(("--grids", grids[0]) if grids else ()),
        "--halo-depth", str(HALO_DEPTH.get(name, 1)),
    )  # fmt: skip
    result = merged_result(job)
    measured, tensors = max(result["measured"]), max(result["tensors"])
    error, tensor_error = result["predicted"] / measured - 1, result["predicted"] / tensors - 1
    said = (
        f"{name}: predicted {result['predicted'] / 2**20:.1f} MiB, measured "
        f"{measured / 2**20:.1f} MiB ({100 * error:+.1f} %), tensors alive at once "
        f"{tensors / 2**20:.1f} MiB ({100 * tensor_error:+.1f} %); parts {result['parts']}"
    )
    # The tensors alive at once (``LiveTensorPeak``, on the same steps) say which side of the
    # planner a miss is on; they are not its quantity: it counts the kernels' workspaces too.
    assert abs(error) <= TOLERANCE, said
    if name in TENSORS_WITHIN:  # cases whose tensors the planner counts to the byte, nearly
        assert abs(tensor_error) <= TENSORS_WITHIN[name], said
