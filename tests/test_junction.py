"""Per-stage grids without processes: layouts, rank numbering, pieces, refusals before compute.

The exactness of the junction itself is tests/test_junction_mpi.py's; here the
pure parts: the layout value and its one place of rank arithmetic, the pieces
every valid pixel travels in (each exactly once), and the one-line refusals.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.engine import ParallelPlan
from hyfi_imaging.parallel.junction import check_junction_model, pieces
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.mirrored import MirroredPlacement, MirrorSlot
from hyfi_imaging.parallel.schedules import ScheduleAction, schedule_actions
from hyfi_imaging.train.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def test_layout_with_a_grid_per_stage() -> None:
    lay = Layout(dp=2, pp=3, grids=((2, 2), (1, 2), (1, 1)))
    assert lay.junction and lay.sp == (2, 2)
    assert lay.replica_size == 7 and lay.world_size == 14
    assert [lay.grid_of(s) for s in range(3)] == [(2, 2), (1, 2), (1, 1)]
    assert lay.describe() == "dp=2 x pp=3 x sp=[2x2,1x2,1x1]"
    assert lay.coords(0) == (0, 0, 0, 0)
    assert lay.coords(4) == (0, 1, 0, 0)
    assert lay.coords(6) == (0, 2, 0, 0)
    assert lay.coords(10) == (1, 0, 1, 1)
    # Equal grids are the plain layout: one rectangular mesh, nothing re-partitioned.
    same = Layout(pp=2, grids=((1, 2), (1, 2)))
    assert not same.junction and same == Layout(pp=2, sp=(1, 2))


@pytest.mark.parametrize(
    "layout",
    [
        Layout(dp=2, pp=2, sp=(1, 2)),
        Layout(dp=3, pp=1, sp=(2, 3)),
        Layout(pp=3, grids=((2, 2), (1, 2), (1, 1))),
        Layout(dp=2, pp=2, grids=((3, 2), (3, 1))),
    ],
)
def test_coords_and_rank_of_are_inverse(layout: Layout) -> None:
    seen = set()
    for rank in range(layout.world_size):
        d, p, i, j = layout.coords(rank)
        gy, gx = layout.grid_of(p)
        assert 0 <= i < gy and 0 <= j < gx
        assert layout.rank_of(d, p, i, j) == rank
        seen.add((d, p, i, j))
    assert len(seen) == layout.world_size


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"pp": 2, "grids": ((2, 2), (1, 2), (1, 1))}, ["3 stage grids for 2 pipeline stages", "--pipeline 3"]),
        ({"pp": 2, "grids": ((1, 2), (2, 1))}, ["stage 1's grid 2x1", "only shrink", "2x2,1x2,1x1"]),
        ({"pp": 2, "grids": ((2, 2), (0, 1))}, ["below 1"]),
    ],
)  # fmt: skip
def test_invalid_stage_grids_are_refused_in_one_line(
    kwargs: dict[str, object], words: list[str]
) -> None:
    with pytest.raises(ConfigError) as err:
        Layout(**kwargs)  # type: ignore[arg-type]
    text = str(err.value)
    assert "\n" not in text
    for w in words:
        assert w in text, text


def test_world_size_mismatch_names_the_sum_of_the_grids() -> None:
    with pytest.raises(
        ConfigError, match=r"needs 7 ranks but the job has 4.*-np 7.*sum of the stage grids"
    ):
        Layout(pp=3, grids=((2, 2), (1, 2), (1, 1))).check_world(4)


def test_parse_grids() -> None:
    assert Layout.parse_grids("2x2,1x2,1x1") == ((2, 2), (1, 2), (1, 1))
    assert Layout.parse_grids("2x2") == ((2, 2),)
    assert Layout.parse_grids("2,3") == ((2, 3),)  # one grid written with a comma
    with pytest.raises(ConfigError):
        Layout.parse_grids("2x2,axb")


def test_two_stage_schedules_other_than_gems_are_refused_with_a_junction() -> None:
    lay = Layout(pp=2, grids=((2, 2), (1, 1)))
    ParallelPlan(lay, microbatches=2, schedule="bidirectional")  # GEMS places two replicas
    for schedule in ("interleaved1f1b", "zbv", "dualpipev"):
        with pytest.raises(ConfigError) as err:
            ParallelPlan(lay, microbatches=4, schedule=schedule)  # type: ignore[arg-type]
        assert "gpipe, 1f1b and bidirectional" in str(err.value)
        assert "\n" not in str(err.value)


def test_mirrored_replicas_map_layout_ranks_and_pair_the_mirrors() -> None:
    """Each replica's layout ranks land where the placement puts its stage tiles; the mirror
    pairs join position p and P-1-p at the same tile, every rank in exactly one pair."""
    place = MirroredPlacement(Layout(dp=2, pp=2, grids=((2, 1), (1, 1))))
    # layout ranks per replica: stage 0 tiles 0, 1, then stage 1; replica 1 after replica 0
    assert place.replica_ranks(0) == (0, 1, 2, 4, 5, 6)
    assert place.replica_ranks(1) == (2, 3, 0, 6, 7, 4)
    assert place.mirror_pairs() == [(0, 2), (1, 3), (4, 6), (5, 7)]
    four = MirroredPlacement(Layout(pp=4, grids=((2, 2), (1, 2), (1, 2), (1, 1))))
    pairs = four.mirror_pairs()
    assert sorted(r for pair in pairs for r in pair) == list(range(four.world_size))
    for a, b in pairs:  # a mirror pair holds the two copies of the same stages, same tiles
        copies_a = {(s.stage, s.tile) for s in four.slots(a)[2]}
        copies_b = {(s.stage, s.tile) for s in four.slots(b)[2]}
        assert copies_a == copies_b


def test_mirrored_placement_of_two_replicas_on_per_stage_grids() -> None:
    """Position p holds A's stage p and B's stage P-1-p, each on its own grid, tile i on rank i."""
    two = MirroredPlacement(Layout(pp=2, grids=((2, 1), (1, 1))))
    assert two.widths == (2, 2) and two.world_size == 4  # 2x1,1x1 under GEMS: 4 ranks
    A, B = 0, 1
    assert [two.slots(r)[2] for r in range(4)] == [
        (MirrorSlot(A, 0, 0), MirrorSlot(B, 1, 0)),
        (MirrorSlot(A, 0, 1),),
        (MirrorSlot(A, 1, 0), MirrorSlot(B, 0, 0)),
        (MirrorSlot(B, 0, 1),),
    ]
    four = MirroredPlacement(Layout(dp=2, pp=4, grids=((2, 2), (1, 2), (1, 2), (1, 1))))
    assert four.widths == (4, 2, 2, 4) and four.replica_size == 12 and four.world_size == 24
    assert four.rank_of(1, MirrorSlot(B, 0, 3)) == 12 + 8 + 3
    # Every stage tile of both replicas is held exactly once, where rank_of says.
    held = [(four.slots(r)[0], s) for r in range(24) for s in four.slots(r)[2]]
    assert len(held) == len(set(held)) == 2 * 2 * (4 + 2 + 2 + 1)
    assert all(
        four.rank_of(d, s) == r for r in range(24) for d, _, ss in [four.slots(r)] for s in ss
    )


def test_mirrored_placement_with_one_grid_is_todays_gems() -> None:
    lay = Layout(dp=2, pp=4, sp=(1, 2))
    place = MirroredPlacement(lay)
    assert place.world_size == lay.world_size
    for rank in range(lay.world_size):
        d, p, *tile = lay.coords(rank)
        assert place.slots(rank) == (
            d,
            p,
            (MirrorSlot(0, p, tile[-1]), MirrorSlot(1, 3 - p, tile[-1])),
        )
    assert place.orders(4)[2 * 2 + 1] == schedule_actions("bidirectional", 4, 4)[2]


def _gang_run(orders: list[list[ScheduleAction]], stages: int) -> int:
    """Run every rank's order with rendezvous semantics (an action starts when it heads the
    queue of *every* tile of its stage and its inputs are done: the strictest reading of halo
    exchanges and a stage's collectives); returns the actions run, fails on a deadlock."""
    tiles: dict[tuple[int, int], list[int]] = {}
    for r, order in enumerate(orders):
        for c, s in {(a[0], a[1]) for a in order}:
            tiles.setdefault((c, s), []).append(r)
    done: set[ScheduleAction] = set()
    pos = [0] * len(orders)
    while any(p < len(o) for p, o in zip(pos, orders, strict=True)):
        moved = False
        for r, order in enumerate(orders):
            if pos[r] == len(order):
                continue
            c, s, kind, i = a = order[pos[r]]
            if kind == "F":
                dep = (c, s - 1, "F", i) if s > 0 else None
            else:
                dep = (c, s + 1, "B", i) if s < stages - 1 else (c, s, "F", i)
            gang = tiles[(c, s)]
            if (dep is None or dep in done) and all(orders[g][pos[g]] == a for g in gang):
                done.add(a)
                for g in gang:
                    pos[g] += 1
                moved = True
        assert moved, (
            f"deadlock at {[o[p] if p < len(o) else None for p, o in zip(pos, orders, strict=True)]}"
        )
    return len(done)


@pytest.mark.parametrize(
    ("grids", "m"),
    [(((2, 1), (1, 1)), 2), (((2, 2), (1, 1)), 6), (((2, 2), (1, 2), (1, 2), (1, 1)), 4),
     (((2, 2), (2, 2), (1, 2), (1, 1)), 8), (((1, 2), (1, 2), (1, 1), (1, 1)), 2)],
)  # fmt: skip
def test_mirrored_orders_run_without_deadlock(grids: tuple[tuple[int, int], ...], m: int) -> None:
    place = MirroredPlacement(Layout(pp=len(grids), grids=grids))
    orders = place.orders(m)
    # Every stage's tiles run its actions in one order; both replicas, F and B, m/2 each.
    assert _gang_run(orders, len(grids)) == 2 * len(grids) * m
    for r, order in enumerate(orders):
        assert len(order) == 2 * (m // 2) * len(place.slots(r)[2])


def test_mirrored_placement_refuses_before_compute() -> None:
    place = MirroredPlacement(Layout(pp=2, grids=((2, 1), (1, 1))))
    place.check(4, microbatches=2)
    with pytest.raises(ConfigError) as err:
        place.check(6, microbatches=2)
    assert "needs 4 ranks" in str(err.value) and "-np 4" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="must be even"):
        place.check(4, microbatches=3)
    with pytest.raises(ConfigError, match="even number of pipeline ranks"):
        MirroredPlacement(Layout(pp=3, grids=((2, 2), (1, 2), (1, 1)))).check(12, microbatches=2)


def test_dense_outputs_are_refused_with_a_junction() -> None:
    lay = Layout(pp=2, grids=((2, 2), (1, 1)))
    check_junction_model(lay, (1, 3), (1, 3))  # a classifier: fine
    with pytest.raises(ConfigError, match="pooled output"):
        check_junction_model(lay, (1, 3, 64, 64), (1, 3, 32, 32))


@pytest.mark.parametrize(
    ("valid", "src", "dst"),
    [((75, 53), (2, 2), (1, 1)), ((7, 13), (2, 2), (1, 2)), ((9, 9), (3, 1), (2, 1)), ((5, 6), (1, 1), (1, 1))],
)  # fmt: skip
def test_pieces_carry_every_valid_pixel_exactly_once(
    valid: tuple[int, int], src: tuple[int, int], dst: tuple[int, int]
) -> None:
    def tile(n: int, g: int) -> int:
        return n if g == 1 else -(-n // g) + 1  # a padded tile with a tail

    ts = (tile(valid[0], src[0]), tile(valid[1], src[1]))
    td = (tile(valid[0], dst[0]), tile(valid[1], dst[1]))
    got: dict[tuple[int, int], int] = {}
    for pc in pieces(valid, src, ts, dst, td):
        (sr, sc), (dr, dc) = pc.src_box, pc.dst_box
        assert (sr.stop - sr.start, sc.stop - sc.start) == (dr.stop - dr.start, dc.stop - dc.start)
        for r, c in itertools.product(range(sr.start, sr.stop), range(sc.start, sc.stop)):
            y, x = pc.src[0] * ts[0] + r, pc.src[1] * ts[1] + c
            # The same global pixel on the receiving side.
            assert (y - pc.dst[0] * td[0], x - pc.dst[1] * td[1]) == (
                dr.start + r - sr.start,
                dc.start + c - sc.start,
            )
            got[(y, x)] = got.get((y, x), 0) + 1
    assert set(got) == set(itertools.product(range(valid[0]), range(valid[1])))
    assert set(got.values()) == {1}


def test_stage_tiles_pad_each_grid_to_the_stride() -> None:
    # A grid of more than one tile pads both axes (padded_hw); a 1x1 grid is the image.
    lay = Layout(pp=3, grids=((2, 2), (1, 2), (1, 1)))
    from hyfi_imaging.parallel.rank_plan import stage_grids

    assert [g.tile for g in stage_grids(lay, (71, 101), 32)] == [(64, 64), (96, 64), (71, 101)]


def test_recipe_takes_a_grid_per_stage(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(
        f"dataset: {ROOT}/datasets/synthetic.yaml\n"
        "model: {name: resnet18, kwargs: {width: 0.25}}\n"
        "data: {manifest: m.csv}\n"
        "parallel: {pipeline: 3, spatial: [2x2, 1x2, 1x1], data: 2}\n"
        f"train: {{out_dir: {tmp_path}/out}}\n"
    )
    r = load_recipe(path)
    assert r.parallel.spatial == (2, 2)  # the grid the data path reads tiles for
    assert r.parallel.stage_grids == ((2, 2), (1, 2), (1, 1))
    assert r.world_size == 14 and r.parallel.layout().world_size == 14
    r = load_recipe(path, ["parallel.spatial=2x2,1x1", "parallel.pipeline=2", "parallel.data=1"])
    assert r.parallel.stage_grids == ((2, 2), (1, 1)) and r.world_size == 5
    # Two mirrored replicas of it: each position as wide as its larger grid, 4 + 4 ranks.
    r = load_recipe(path, ["parallel.spatial=2x2,1x1", "parallel.pipeline=2", "parallel.data=1",
                           "parallel.schedule=bidirectional", "parallel.microbatches=2"])  # fmt: skip
    assert r.world_size == 8 and r.parallel.layout().world_size == 5


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--pipeline", "3", "--spatial", "2x2,1x1"], "2 stage grids for 3 pipeline stages"),
        (["--pipeline", "2", "--spatial", "2x2,1x1"], "needs 5 ranks but the job has 1"),
        (
            [
                "--pipeline",
                "2",
                "--spatial",
                "2x2,1x1",
                "--schedule",
                "bidirectional",
                "--microbatches",
                "2",
            ],
            "with two mirrored replicas needs 8 ranks",
        ),
    ],
)
def test_hyfi_verify_refuses_bad_junction_layouts_in_one_line(args: list[str], words: str) -> None:
    """Before any process group or model memory: one line on stderr, exit status 2."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "hyfi_imaging.cli.verify", "--model", "resnet18"]
    job = subprocess.run(
        [*cmd, "--image-size", "64x64", *args], capture_output=True, text=True, timeout=120
    )
    lines = [ln for ln in job.stderr.splitlines() if ln.strip()]
    assert job.returncode == 2, job.stderr
    assert len(lines) == 1 and words in lines[0], job.stderr
