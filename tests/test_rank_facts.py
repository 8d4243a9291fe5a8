"""Every rank's derived facts against their snapshot (see tests/rank_facts.py).

Set ``HYFI_UPDATE_SNAPSHOTS=1`` to write the snapshot again after a change that means to
change a derivation (and say why in the commit); the multi-rank exactness tests check that
the new numbers still give one process's result.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from rank_facts import CASES, SMALL, Case, case_facts, mirrored_facts, planned_facts, rank_facts

SNAPSHOT = Path(__file__).parent / "snapshots" / "rank_facts.json"


def _first_difference(got: Any, want: Any, where: str = "") -> str | None:
    """The first path where ``got`` and ``want`` differ, with both values."""
    if isinstance(got, dict) and isinstance(want, dict):
        for key in sorted(set(got) | set(want)):
            if key not in got or key not in want:
                return f"{where}.{key}: only in {'got' if key in got else 'snapshot'}"
            found = _first_difference(got[key], want[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            found = _first_difference(g, w, f"{where}[{i}]")
            if found:
                return found
        return None
    return None if got == want else f"{where}: got {got!r}, snapshot {want!r}"


@pytest.fixture(scope="module")
def snapshot() -> dict[str, Any]:
    if os.environ.get("HYFI_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.parent.mkdir(exist_ok=True)
        facts = {case.name: case_facts(case) for case in CASES}
        SNAPSHOT.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
    return json.loads(SNAPSHOT.read_text())


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_rank_derives_its_snapshot(case: Case, snapshot: dict[str, Any]) -> None:
    got = json.loads(json.dumps(case_facts(case)))
    assert case.name in snapshot, f"{case.name}: no snapshot; run with HYFI_UPDATE_SNAPSHOTS=1"
    assert len(got) == len(snapshot[case.name]) == case.plan.layout.world_size
    for rank, (g, w) in enumerate(zip(got, snapshot[case.name], strict=True)):
        difference = _first_difference(g, w)
        assert difference is None, f"{case.name} rank {rank}{difference}"


#: Facts a rank on a one-tile grid has no spatial context to report (its plan has them).
_SPATIAL_ONLY = (
    "grid", "tile_index", "align", "tile_slice", "sizes", "halos", "halo_depth", "deep_runs",
    "rejoined_pools", "flatten_paths", "functional_sites",
)  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_rank_plan_is_its_snapshot_before_anything_runs(
    case: Case, snapshot: dict[str, Any]
) -> None:
    """The pure per-rank plan (no process group, no module changed) gives the numbers the
    engine built from it on every rank: its tiles, stages, cut, blocks, stem, actions,
    every layer's size and halo, the deep-halo runs and the FSDP2 units."""
    planned = json.loads(json.dumps(planned_facts(case)))
    for rank, (p, w) in enumerate(zip(planned, snapshot[case.name], strict=True)):
        keys = [k for k in p if k in w or k not in _SPATIAL_ONLY]
        if "halos" in w:  # the plan's are the whole model's; the engine's, its stages' layers
            assert set(w["halos"]) <= set(p["halos"]), f"{case.name} rank {rank}: layers missing"
            p["halos"] = {k: v for k, v in p["halos"].items() if k in w["halos"]}
        difference = _first_difference({k: p[k] for k in keys}, {k: w.get(k) for k in keys})
        assert difference is None, f"{case.name} rank {rank}{difference}"
        if "grid" not in w:  # one tile: the whole image, at its origin
            assert p["tile_slice"] == [[0, n] for n in p["padded"]]


def test_the_snapshot_holds_every_case_and_the_ranks_differ() -> None:
    """The snapshot is of these cases, and the facts are per rank (tiles differ)."""
    facts = json.loads(SNAPSHOT.read_text())
    assert sorted(facts) == sorted(c.name for c in CASES)
    two = facts["resnet-2x2-odd"]
    assert len({json.dumps(r["tile_slice"]) for r in two}) == 4
    assert facts["resnet-2x2-deep-halo"][0]["deep_runs"], "deep halos planned no run"
    assert facts["resnet-2x2-stream-full"][0]["streamed"][:2] == ["conv1", "bn1"]
    junction = facts["resnet-junction-2x2-1x1"]
    assert [r["local"] for r in junction] == [[[0, 0]]] * 4 + [[[0, 1]]]


def test_each_mirrored_replica_derives_what_the_plain_junction_rank_does() -> None:
    """Two mirrored replicas of a junction: every global rank holds the stages its placement
    gives it, and each of them is built exactly as the plain junction's rank of that stage
    and tile (tiles, cut, sizes, halos, FSDP2 units), on the fake backend in one process."""
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.parallel.mirrored import MirroredPlacement
    from hyfi_imaging.parallel.parallel_plan import ParallelPlan

    layout = Layout(pp=2, grids=((2, 1), (1, 1)))
    kw = {"microbatches": 2, "balance": (5, 6)}
    gems = Case(
        "gems", "resnet18", (61, 45), ParallelPlan(layout, schedule="bidirectional", **kw), SMALL
    )
    plain = Case("plain", "resnet18", (61, 45), ParallelPlan(layout, schedule="gpipe", **kw), SMALL)
    place = MirroredPlacement(layout)
    for rank in range(place.world_size):
        local, slots = mirrored_facts(gems, rank)
        dp, _, held = place.slots(rank)
        assert sorted(map(tuple, local)) == sorted((s.replica, s.stage) for s in held)
        for slot in held:
            gx = layout.grid_of(slot.stage)[1]
            same = layout.rank_of(dp, slot.stage, *divmod(slot.tile, gx))
            want = rank_facts(plain, same)
            want.pop("actions")
            problem = _first_difference(slots[slot.replica], want)
            assert problem is None, f"rank {rank}, {slot}: {problem}"
