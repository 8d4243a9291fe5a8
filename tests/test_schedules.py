"""Placement, orders and validation of the schedules in :mod:`hyfi_imaging.parallel.schedules`
(pure: no process group)."""

from __future__ import annotations

import pytest

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models import create_model
from hyfi_imaging.parallel.engine import ParallelPlan
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.schedules import (
    LocalStage,
    bidirectional_order,
    check_schedule,
    gems_queues,
    local_stages,
    model_stages,
    schedule_actions,
    simulate,
    simulate_orders,
)


def test_placements() -> None:
    assert local_stages("1f1b", 4, 1) == (LocalStage(0, 1),)
    assert local_stages("bidirectional", 4, 1) == (LocalStage(0, 1), LocalStage(1, 2))
    assert local_stages("interleaved1f1b", 4, 1) == (LocalStage(0, 1), LocalStage(0, 5))
    assert local_stages("zbv", 4, 1) == (LocalStage(0, 1), LocalStage(0, 6))
    assert local_stages("dualpipev", 4, 0) == (LocalStage(0, 0), LocalStage(0, 7))
    assert model_stages("bidirectional", 4) == 4 and model_stages("zbv", 4) == 8
    # Every stage of every replica is held exactly once.
    for name in ("bidirectional", "interleaved1f1b", "zbv"):
        held = [ls for r in range(4) for ls in local_stages(name, 4, r)]
        assert len(set(held)) == len(held) == 8


@pytest.mark.parametrize(("pp", "half"), [(2, 1), (2, 2), (4, 2), (4, 4), (6, 3)])
def test_bidirectional_order_is_complete_and_respects_dependencies(pp: int, half: int) -> None:
    times = simulate(gems_queues(pp, half), pp)
    assert len(times) == 2 * 2 * pp * half  # F and B of every micro-batch, stage and replica
    for (rep, s, kind, i), (rank, start, _) in times.items():
        assert rank == (s if rep == 0 else pp - 1 - s)
        if kind == "F" and s > 0:
            assert times[(rep, s - 1, "F", i)][2] <= start
        if kind == "B":
            dep = (rep, s + 1, "B", i) if s < pp - 1 else (rep, s, "F", i)
            assert times[dep][2] <= start
    order = bidirectional_order(pp, half)
    assert [len(o) for o in order] == [4 * half] * pp
    # Each replica keeps its own 1F1B order on every rank.
    for r in range(pp):
        for rep in (0, 1):
            mine = [(k, i) for q, k, i in order[r] if q == rep]
            assert sorted(i for k, i in mine if k == "F") == list(range(half))


def test_bidirectional_fills_the_bubble() -> None:
    """Two mirrored replicas of m/2 micro-batches finish sooner than one 1F1B pipeline of m."""
    pp, m = 4, 4
    one, _ = simulate_orders(schedule_actions("1f1b", pp, m), pp)
    two = max(end for _, _, end in simulate(gems_queues(pp, m // 2), pp).values())
    assert two < one


@pytest.mark.parametrize(
    ("schedule", "layout", "m", "words"),
    [
        ("bidirectional", Layout(pp=3), 4, "even number of pipeline ranks"),
        ("bidirectional", Layout(pp=2), 3, "must be even"),
        # one micro-batch: "use --microbatches 2 or 2"
        ("bidirectional", Layout(pp=2), 1, "use 2 micro-batches, a count that divides"),
        ("bidirectional", Layout(pp=1), 2, "--pipeline 2 or more"),
        ("zbv", Layout(pp=1), 2, "--pipeline 2 or more"),
        ("dualpipev", Layout(pp=2), 2, "at least as many micro-batches as model stages"),
        ("interleaved1f1b", Layout(pp=2), 7, "equal rounds"),
        ("looped", Layout(pp=2), 2, "is not a schedule"),
    ],
)
def test_invalid_schedules_are_refused_with_one_line(
    schedule: str, layout: Layout, m: int, words: str
) -> None:
    with pytest.raises(ConfigError) as err:
        check_schedule(schedule, layout, m)
    assert words in str(err.value) and "\n" not in str(err.value)
    # The plan refuses it too, before any model or process group exists.
    with pytest.raises(ConfigError):
        ParallelPlan(layout, microbatches=m, schedule=schedule)  # type: ignore[arg-type]


def test_plan_cuts_twice_as_many_stages_for_v_schedules() -> None:
    model = create_model("resnet18", num_classes=3, width=0.25)
    ParallelPlan(Layout(pp=2), microbatches=4, schedule="zbv", balance=(2, 3, 3, 3)).validate(
        model, 4
    )
    with pytest.raises(ConfigError, match="gives 2 stages but"):
        ParallelPlan(Layout(pp=2), microbatches=4, schedule="zbv", balance=(5, 6)).validate(
            model, 4
        )
    with pytest.raises(ConfigError, match="needs 12 model stages"):
        ParallelPlan(Layout(pp=6), microbatches=12, schedule="dualpipev").validate(model, 12)
