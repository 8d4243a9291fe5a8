"""hyfi-plan without processes: units, candidates, ranking, the command line, parallel=auto."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch

from hyfi_imaging.cli.plan import main, memory_size
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models import create_model
from hyfi_imaging.parallel.candidates import candidates, rank
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.memory import SavedActivations
from hyfi_imaging.parallel.plan import Candidate, predict

ROOT = Path(__file__).resolve().parents[1]


def test_memory_sizes() -> None:
    assert memory_size("80GiB") == 80 * 2**30
    assert memory_size("512 MiB") == 512 * 2**20
    assert memory_size("40GB") == 40 * 10**9
    assert memory_size("1024") == 1024
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        memory_size("lots")
    with pytest.raises(argparse.ArgumentTypeError, match="more than 0"):
        memory_size("0")  # was silently "the default"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--device-memory", "0"], "--device-memory: must be more than 0"),
        (["--devices", "0"], "--devices: must be 1 or more, got 0"),
        (["--devices", "-2"], "--devices: must be 1 or more, got -2"),
        (["--batch", "x"], "--batch: must be a whole number"),
        # a ZeroDivisionError traceback (exit 1, "none fits"), "nan TFLOP/s" step times, and
        # a negative latency's negative communication times
        (["--rate", "0"], "--rate/--flops: must be > 0, got 0"),
        (["--rate", "nan"], "--rate/--flops: must be a finite number, got nan"),
        (["--link-latency", "-1"], "--link-latency: must be 0 or more, got -1"),
        (["--inter-latency", "inf"], "--inter-latency: must be a finite number"),
    ],
)
def test_plan_refuses_sizes_and_counts_that_mean_nothing(
    args: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--model", "resnet18", "--image-size", "512", "--devices", "2"]
    with pytest.raises(SystemExit) as caught:
        main([*base, *args])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err


def test_candidates_multiply_to_the_devices() -> None:
    model = create_model("resnet18", num_classes=2, width=0.25)
    cands = list(candidates(model, (512, 512), 4, 2))
    assert cands and all(c.world_size == 4 for c in cands)
    assert {c.checkpointing for c in cands} == {"none", "selective", "full", "deep"}
    # deep: one stage, with the streamed stem
    assert {(c.layout.pp, c.streaming) for c in cands if c.checkpointing == "deep"} == {(1, "stem")}
    assert any(c.layout.pp == 2 and c.schedule == "1f1b" for c in cands)
    # Two mirrored replicas of a 3-rank junction (1x2 -> 1x1) take 4 ranks: offered only so.
    mirrored = [c for c in cands if c.layout.junction and c.schedule == "bidirectional"]
    assert {c.layout.grids for c in mirrored} == {((1, 2), (1, 1)), ((2, 1), (1, 1))}
    assert all(c.layout.world_size == 3 for c in mirrored)
    assert all(c.layout.world_size == 4 for c in cands if c.schedule != "bidirectional")


def test_more_tiles_and_checkpointing_need_less_memory() -> None:
    model = create_model("resnet18", num_classes=2, width=0.25)
    one = predict(model, (512, 512), 1, Candidate(Layout()))
    four = predict(model, (512, 512), 1, Candidate(Layout(sp=(2, 2))))
    ck = predict(model, (512, 512), 1, Candidate(Layout(sp=(2, 2)), checkpointing="full"))
    assert four.activations < 0.3 * one.activations
    assert ck.activations < four.activations
    # the streamed stem keeps none of its maps: about half of a checkpointed ResNet's peak
    stem = predict(
        model, (512, 512), 1, Candidate(Layout(sp=(2, 2)), checkpointing="full", streaming="stem")
    )
    assert stem.activations + stem.transient < 0.7 * (ck.activations + ck.transient)
    assert stem.step_s > ck.step_s  # its layers run once more per BatchNorm, both ways
    # deep: layer1 keeps one input of its two blocks' (the other computed again), and its
    # blocks recompute unit by unit, for more forwards of layer1
    deep = predict(
        model, (512, 512), 1, Candidate(Layout(sp=(2, 2)), checkpointing="deep", streaming="stem")
    )
    assert deep.activations < stem.activations
    assert deep.step_s > stem.step_s
    # FSDP2 shards gradients and momentum: less state per rank once the model is not tiny
    # (for a 0.7 M-parameter model the gathered units cost more than sharding saves).
    big = create_model("resnet50", num_classes=2)
    assert (
        predict(big, (256, 256), 1, Candidate(Layout(sp=(2, 2)))).state
        < predict(big, (256, 256), 1, Candidate(Layout())).state
    )


def test_rank_puts_fitting_layouts_first() -> None:
    model = create_model("resnet18", num_classes=2, width=0.25)
    preds = [predict(model, (512, 512), 1, c) for c in candidates(model, (512, 512), 2, 1)]
    small = min(p.peak for p in preds)
    ranked = rank(preds, small)
    assert ranked[0].peak <= small
    assert all(p.peak > small for p in ranked[1:] if p.peak > small)


def test_rank_keeps_the_batch_whole_where_the_rate_cannot_tell() -> None:
    """parallel=auto's nominal rate gives one stage's m=1 and m=2 the same speed: m=2 won on
    its smaller peak, and trained BatchNorm on half batches (another first loss than the
    layout by hand and hyfi-plan's pick)."""
    model = create_model("resnet18", num_classes=2, width=0.25)
    one, two = (predict(model, (256, 256), 2, Candidate(Layout(), m), flops_per_s=5e10)
                for m in (1, 2))  # fmt: skip
    assert one.images_per_s == two.images_per_s and two.peak < one.peak
    assert [p.candidate.microbatches for p in rank([two, one], 2**40)] == [1, 2]


def test_cli_recommends_and_prints_recipe_lines(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--model", "resnet18", "--width", "0.25", "--image-size", "1024",
                 "--devices", "4", "--device-memory", "1GiB", "--rate", "1e10", "--top", "3"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "recommended:" in out and "parallel:" in out and "spatial:" in out


def test_cli_says_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--model", "resnet18", "--image-size", "1024", "--devices", "1",
                 "--device-memory", "1MiB", "--rate", "1e10"])  # fmt: skip
    assert code == 1
    assert "no layout fits" in capsys.readouterr().out


def test_cli_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "resnet18"]) == 2
    assert "needs a recipe" in capsys.readouterr().err


@pytest.fixture(scope="module")
def manifest(synthetic_cohort: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hyfi_imaging.preprocess import PreprocessOptions, run_preprocess

    out = tmp_path_factory.mktemp("plan_data")
    summary = run_preprocess(
        [synthetic_cohort.parent], out, PreprocessOptions(mpp=2.0, size=(256, 256)),
        labels_path=synthetic_cohort, progress=False, qc=False,
    )  # fmt: skip
    assert summary.manifest is not None
    return summary.manifest


def _recipe(tmp_path: Path, manifest: Path, model: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(
        f"dataset: {ROOT}/datasets/synthetic.yaml\nmodel: {{name: {model}}}\n"
        f"data: {{manifest: {manifest}}}\ntrain: {{out_dir: {tmp_path}/run, batch_size: 2}}\n"
    )
    return path


def test_parallel_auto_picks_a_layout_for_the_launched_ranks(
    tmp_path: Path, manifest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hyfi_imaging.train.config import load_recipe

    monkeypatch.setenv("WORLD_SIZE", "4")
    r = load_recipe(_recipe(tmp_path, manifest, "resnet18"), ["parallel=auto"])
    assert r.world_size == 4
    assert r.parallel.checkpointing in ("none", "selective", "full")


def test_fit_warning_names_the_layout_and_the_fix(tmp_path: Path, manifest: Path) -> None:
    from hyfi_imaging.train.autoplan import fit_warning
    from hyfi_imaging.train.config import load_recipe

    recipe = load_recipe(_recipe(tmp_path, manifest, "resnet18"))
    assert fit_warning(recipe) is None  # this machine's RAM holds it easily
    message = fit_warning(recipe, memory=2**20)  # a 1 MiB device does not
    assert message is not None and "GiB per rank" in message and "parallel=auto" in message


# ----------------------------------------------------------------------------- schedules


def test_candidates_rank_every_schedule_and_leave_out_refused_ones() -> None:
    model = create_model("resnet18", num_classes=2, width=0.25)
    two = list(candidates(model, (256, 256), 2, 4))
    assert {c.schedule for c in two if c.layout.pp == 2} == {
        "gpipe", "1f1b", "bidirectional", "interleaved1f1b", "zbv", "dualpipev",
    }  # fmt: skip
    assert {c.schedule for c in two if c.layout.pp == 1} == {"gpipe"}
    for c in two:  # what training refuses is never offered
        if c.schedule == "bidirectional":
            assert c.microbatches % 2 == 0
        if c.schedule in ("1f1b", "zbv"):
            assert c.microbatches >= c.layout.pp
        if c.schedule == "dualpipev":
            assert c.microbatches >= 2 * c.layout.pp
    # three pipeline ranks: no mirrored pairs
    three = list(candidates(model, (256, 256), 3, 4))
    assert any(c.layout.pp == 3 for c in three)
    assert not any(c.schedule == "bidirectional" for c in three)
    with pytest.raises(ConfigError, match="even number of pipeline ranks"):
        predict(model, (256, 256), 4, Candidate(Layout(pp=3), 2, schedule="bidirectional"))
    with pytest.raises(ConfigError, match="micro-batches"):
        predict(model, (256, 256), 4, Candidate(Layout(pp=2), 2, schedule="dualpipev"))
    preds = rank([predict(model, (256, 256), 4, c) for c in two if c.layout.pp == 2], 2**40)
    assert {p.candidate.schedule for p in preds} >= {"bidirectional", "zbv", "dualpipev"}


def test_bidirectional_holds_a_second_stage() -> None:
    """Mirrored replicas: every rank keeps two stages' gradients and momentum (here, pp = 2 and
    no sharding, the whole model's), so the busiest rank holds at least one stage's state more
    than under 1F1B, and with as many micro-batches per replica as 1F1B keeps in flight, at
    least as many activations."""
    model = create_model("resnet18", num_classes=2, width=0.25)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    lay = Layout(pp=2)
    one = predict(model, (256, 256), 4, Candidate(lay, 4, schedule="1f1b", balance=(5, 6)))
    two = predict(model, (256, 256), 4, Candidate(lay, 4, schedule="bidirectional", balance=(5, 6)))
    assert two.state == 2 * whole  # SGD: gradient + momentum of both stages
    # 1F1B's busiest rank holds one stage: the difference is the other stage's state.
    assert two.state - one.state in {2 * n for n in _stage_params(model, (5, 6))}
    assert two.activations >= one.activations
    assert two.peak >= one.peak + min(2 * n for n in _stage_params(model, (5, 6)))
    # Torch's V schedules cut 2 pp stages and also hold two per rank.
    v = predict(model, (256, 256), 4, Candidate(lay, 4, schedule="zbv"))
    assert len(v.balance) == 4
    assert v.step_s > 0 and 0.0 <= v.bubble < 1.0


def _stage_params(model: object, balance: tuple[int, ...]) -> list[int]:
    from hyfi_imaging.parallel.pipeline import model_layers, stage_bounds

    layers = model_layers(model)  # type: ignore[arg-type]
    return [
        sum(p.numel() * p.element_size() for _, m in layers[a:b] for p in m.parameters())
        for a, b in stage_bounds(balance)
    ]


def test_simulated_bubble_orders_the_schedules() -> None:
    """Step time replays each schedule's own order: GEMS fills 1F1B's bubble at equal ranks."""
    model = create_model("resnet18", num_classes=2, width=0.25)
    cut = Candidate(Layout(pp=2), 4, balance=(5, 6))
    gems = predict(
        model, (256, 256), 4, Candidate(cut.layout, 4, schedule="bidirectional", balance=(5, 6))
    )
    one = predict(model, (256, 256), 4, Candidate(cut.layout, 4, schedule="1f1b", balance=(5, 6)))
    assert gems.bubble < one.bubble


def test_cli_table_and_recipe_lines_name_the_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    from hyfi_imaging.cli.plan import recipe_lines

    code = main(["--model", "resnet18", "--width", "0.25", "--image-size", "256", "--devices", "2",
                 "--batch", "4", "--device-memory", "4GiB", "--rate", "1e10", "--top", "200"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "schedule" in out.splitlines()[1] and "bubble" in out.splitlines()[1]
    assert " bidirectional " in out and " dualpipev " in out
    assert "schedule: " in out.split("recommended:")[1]
    assert "not calibrated" in out.lower()
    lines = recipe_lines(Candidate(Layout(pp=2), 2, schedule="bidirectional"), (5, 6))
    assert "  schedule: bidirectional" in lines and "  balance: [5, 6]" in lines


def test_cli_evaluates_a_recipe_set_to_bidirectional(
    tmp_path: Path, manifest: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([str(_recipe(tmp_path, manifest, "resnet18")),
                 "--set", "parallel.pipeline=2", "--set", "parallel.microbatches=2",
                 "--set", "parallel.schedule=bidirectional",
                 "--device-memory", "64GiB", "--rate", "1e10", "--top", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    mine = [ln for ln in out.splitlines() if ln.endswith("<- recipe")]
    assert len(mine) == 1 and " bidirectional " in mine[0] and "dp1 pp2 sp1x1" in mine[0]


def test_cli_refuses_model_options_beside_a_recipe(
    tmp_path: Path, manifest: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hyfi-plan RECIPE --model resnet50`` planned the recipe's model and said nothing of the
    one asked for: one line now."""
    recipe = str(_recipe(tmp_path, manifest, "resnet18"))
    for extra in (["--model", "resnet50"], ["--width", "2"], ["--num-classes", "5"]):
        assert main([recipe, *extra, "--device-memory", "64GiB", "--rate", "1e10"]) == 2
        (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
        assert f"{extra[0]}: plans the recipe's model" in line, line


def test_schedule_replay_agrees_with_the_schedules_own_simulations() -> None:
    """One simulator for every schedule: on unit costs GPipe and 1F1B take the textbook
    ``3 (m + p - 1)``, GEMS's merged order replays to the span it was scheduled in, and
    torch's orders for its schedules replay without deadlock, each micro-batch once per stage."""
    from hyfi_imaging.parallel.schedules import (
        gems_queues,
        schedule_actions,
        simulate,
        simulate_orders,
    )

    for pp, m in ((2, 4), (4, 8)):
        for name in ("gpipe", "1f1b"):
            span, _ = simulate_orders(schedule_actions(name, pp, m), pp)
            assert span == 3 * (m + pp - 1)
        span, _ = simulate_orders(schedule_actions("bidirectional", pp, m), pp)
        assert span == max(end for _, _, end in simulate(gems_queues(pp, m // 2), pp).values())
        for name in ("interleaved1f1b", "zbv", "dualpipev"):
            orders = schedule_actions(name, pp, m)
            forwards = sorted((s, i) for o in orders for _, s, k, i in o if k == "F")
            assert forwards == sorted((s, i) for s in range(2 * pp) for i in range(m))
            span, idle = simulate_orders(orders, 2 * pp)
            assert span > 0 and 0 <= idle < 1


# ----------------------------------------------------------------------------- per-stage grids


def test_junction_grids_split_the_replica_and_never_grow() -> None:
    from hyfi_imaging.parallel.candidates import JUNCTION_LIMIT, junction_grids

    assert junction_grids(3, 2) == [((1, 2), (1, 1)), ((2, 1), (1, 1))]
    five = junction_grids(5, 2)
    assert ((2, 2), (1, 1)) in five and ((1, 4), (1, 1)) in five
    assert ((2, 2), (1, 2), (1, 1)) in junction_grids(7, 3)
    assert junction_grids(4, 1) == [] and junction_grids(2, 2) == []  # one stage; only 1x1,1x1
    for ranks in range(2, 33):
        for pp in range(2, 6):
            seqs = junction_grids(ranks, pp)
            assert len(seqs) <= JUNCTION_LIMIT
            for grids in seqs:
                assert len(grids) == pp and len(set(grids)) > 1
                assert sum(gy * gx for gy, gx in grids) == ranks
                layout = Layout(pp=pp, grids=grids)  # the junction's own checks accept it
                assert layout.junction and layout.world_size == ranks


def test_candidates_include_per_stage_grids_with_their_schedules() -> None:
    from hyfi_imaging.parallel.candidates import JUNCTION_STAGES

    model = create_model("resnet18", num_classes=2, width=0.25)
    cands = list(candidates(model, (512, 512), 3, 2))
    mixed = [c for c in cands if c.layout.junction]
    assert {c.layout.grids for c in mixed} == {((1, 2), (1, 1)), ((2, 1), (1, 1))}
    assert {c.schedule for c in mixed} == {"gpipe", "1f1b"}  # what the junction runs
    assert all(c.layout.world_size == 3 for c in cands)
    assert len(mixed) <= 2 * 2 * 2 * 3  # grids x micro-batch counts x schedules x checkpointing
    seven = list(candidates(model, (512, 512), 7, 1))
    assert any(c.layout.grids == ((2, 2), (1, 2), (1, 1)) for c in seven)
    assert len(seven) < 200  # bounded: at most JUNCTION_LIMIT grids per pp, pp <= JUNCTION_STAGES
    assert max(c.layout.pp for c in seven if c.layout.junction) <= JUNCTION_STAGES


def test_per_stage_grid_prediction_holds_each_stage_on_its_own_grid() -> None:
    """The first stage on 1x2 tiles keeps about half the activations it keeps on one rank; the
    last stage on one rank is not sharded; the cut moves toward the tiled stage; ranking puts
    the junction layout among the others and its recipe lines name every grid."""
    from hyfi_imaging.cli.plan import recipe_lines

    model = create_model("resnet18", num_classes=2, width=0.25)
    hw, bal = (1024, 1024), (5, 6)
    plain = predict(model, hw, 2, Candidate(Layout(pp=2), 2, schedule="1f1b", balance=bal))
    lay = Layout(pp=2, grids=((1, 2), (1, 1)))
    mixed = predict(model, hw, 2, Candidate(lay, 2, schedule="1f1b", balance=bal))
    assert mixed.peak < plain.peak
    assert 0.4 < mixed.activations / plain.activations < 0.7
    auto = predict(model, hw, 2, Candidate(lay, 2, schedule="1f1b"))
    assert sum(auto.balance[:1]) >= sum(
        predict(model, hw, 2, Candidate(Layout(pp=2), 2)).balance[:1]
    )
    with pytest.raises(ConfigError, match="gpipe, 1f1b and bidirectional"):
        predict(model, hw, 2, Candidate(lay, 2, schedule="zbv"))
    # Two mirrored replicas: 4 ranks; every position holds a tiled first stage and an untiled
    # last one (the same two stages, mirrored), so both positions peak alike (measured: 94.4
    # predicted / 94.8 MiB, tests/test_plan_mpi.py), and the copies sum their gradients.
    gems = predict(model, hw, 2, Candidate(lay, 2, schedule="bidirectional", balance=bal))
    assert gems.candidate.world_size == 4 and len(set(gems.rank_peaks)) == 1
    assert gems.parts["mirror"] > 0
    ranked = rank([plain, mixed], memory=2**40)
    assert {p.candidate.layout for p in ranked} == {Layout(pp=2), lay}
    lines = recipe_lines(mixed.candidate, mixed.balance)
    assert "  spatial: [1x2, 1x1]" in lines and "  pipeline: 2" in lines


def test_cli_ranks_per_stage_grids(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--model", "resnet18", "--width", "0.25", "--image-size", "512", "--devices", "3",
                 "--batch", "2", "--device-memory", "64GiB", "--rate", "1e10", "--top", "100"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert " dp1 pp2 sp1x2,1x1 " in out


def test_parallel_auto_and_the_cli_take_per_stage_grids(
    tmp_path: Path,
    manifest: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import hyfi_imaging.parallel.candidates as plan_space
    from hyfi_imaging.train.config import load_recipe

    recipe = _recipe(tmp_path, manifest, "resnet18")
    # A recipe with per-stage grids is its own row of the table.
    code = main([str(recipe), "--set", "parallel.pipeline=2", "--set", "parallel.spatial=1x2,1x1",
                 "--set", "parallel.microbatches=2", "--device-memory", "64GiB", "--rate", "1e10",
                 "--top", "1"])  # fmt: skip
    mine = [ln for ln in capsys.readouterr().out.splitlines() if ln.endswith("<- recipe")]
    assert code == 0 and len(mine) == 1 and "dp1 pp2 sp1x2,1x1" in mine[0]
    # parallel=auto turns a winning junction layout into the recipe's per-stage grids.
    real = plan_space.rank
    monkeypatch.setattr(
        plan_space,
        "rank",
        lambda preds, memory: sorted(
            real(preds, memory), key=lambda p: not p.candidate.layout.junction
        ),
    )
    monkeypatch.setenv("WORLD_SIZE", "3")
    r = load_recipe(recipe, ["parallel=auto"])
    assert r.parallel.stage_grids in (((1, 2), (1, 1)), ((2, 1), (1, 1)))
    assert r.world_size == 3 and r.parallel.pipeline == 2


def test_the_recommendation_lists_every_pipeline_ranks_peak(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stages hold different amounts: the recommended pipeline says what each rank holds."""
    import hyfi_imaging.parallel.candidates as plan_space

    real = plan_space.rank
    monkeypatch.setattr(  # a pipeline first, whatever the ranking says
        plan_space,
        "rank",
        lambda preds, memory: sorted(real(preds, memory), key=lambda p: p.candidate.layout.pp == 1),
    )
    code = main(["--model", "resnet18", "--image-size", "1024", "--devices", "2",
                 "--device-memory", "8GiB", "--top", "2"])  # fmt: skip
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("recommended"))
    assert code == 0 and "pp=2" in line, line
    peaks = line.split("(pipeline ranks: ")[1].removesuffix(" GiB)").split(" / ")
    assert len(peaks) == 2 and float(peaks[0]) > float(peaks[1]), line


def test_the_planner_aligns_tiles_as_the_engine_does_for_a_model_declaring_nothing() -> None:
    """A module:function model has no ``total_stride``: the planner took 1 while the engine
    measured the strides' LCM, so the two could pick different tiles."""
    from torch import nn

    from hyfi_imaging.parallel import Neighbours, spatialize
    from hyfi_imaging.parallel.geometry import padded_hw
    from hyfi_imaging.parallel.spatial import tile_alignment

    def model() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, 4, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(4, 4, 3, padding=1),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4, 2),
        )

    plain = model()
    assert not hasattr(plain, "total_stride")
    ctx = spatialize(model(), grid=(1, 2), tile=(0, 0), neighbours=Neighbours(right=1), group=None)
    assert tile_alignment(plain) == ctx.align == 4
    assert padded_hw((50, 50), (1, 2), tile_alignment(plain)) == ctx.padded_size((50, 50))
    assert ctx.padded_size((50, 50)) == (52, 56)  # the planner's 1 gave (50, 50)


# ----------------------------------------------------------------------------- issue 22: fast


def _direct_stage(layers: list, start: int, stop: int, received: tuple) -> SavedActivations:
    """A stage traced alone from copies of what it receives (what the planner once did)."""
    from functools import partial

    from hyfi_imaging.parallel.memory import saved_activations
    from hyfi_imaging.parallel.pipeline import StageModule

    stage = StageModule(layers[start:stop], index=start)
    ins = tuple(t.detach().requires_grad_(True).clone() if start else t for t in received)
    return saved_activations(stage, partial(stage, *ins))


@pytest.mark.parametrize(
    ("name", "options", "shape", "streaming", "heads"),
    [
        ("resnet18", {"width": 0.25}, (2, 3, 96, 160), "none", True),
        ("resnet18", {"width": 0.25}, (1, 3, 128, 64), "stem", True),  # cuts inside the stem
        ("amoebanet-d-3-8", {}, (1, 3, 32, 64), "none", False),  # tuples, a tensor handed twice
    ],
)
def test_a_stage_read_from_the_whole_trace_is_the_stage_traced_alone(
    name: str, options: dict, shape: tuple, streaming: str, heads: bool
) -> None:
    """The planner traces a model once per shape and reads each stage from it: for every cut,
    what the stage saves (owners, bytes, dtypes, calls) and what its layers count equal a
    trace of that stage alone."""
    from hyfi_imaging.parallel.model_trace import meta_model, stem_splits, trace_model
    from hyfi_imaging.parallel.pipeline import StageModule
    from hyfi_imaging.parallel.speed import count_chain

    model = create_model(name, num_classes=2, **options)
    layers = meta_model(model, streaming).layers
    n = len(layers)
    split_somewhere = False
    firsts = [(0, b) for b in range(1, n)] if heads else []  # first stages (else: the tails)
    for start, stop in [(0, n), *((a, n) for a in range(1, n)), *firsts]:
        splits = stem_splits(layers, [start, stop] if stop < n else [start])
        split_somewhere |= bool(splits)
        whole = trace_model(model, shape, streaming, splits)
        got = whole.stage(start, stop)
        want = _direct_stage(layers, start, stop, whole.boundaries[start])
        assert [(o, b, d) for _, o, b, d in got.storages] == [
            (o, b, d) for _, o, b, d in want.storages
        ], (name, start, stop)
        assert [(c[0], c[2], c[3], c[4]) for c in got.calls] == [
            (c[0], c[2], c[3], c[4]) for c in want.calls
        ]
        stage = StageModule(layers[start:stop])
        received = whole.boundaries[start]
        counted, _ = count_chain(
            list(stage.named_children()),
            received[0] if len(received) == 1 else received,
            input_grad=start > 0,
        )
        assert counted == {k: whole.counted[k] for k in counted}
    assert split_somewhere == (streaming == "stem")  # cuts inside the streamed stem were met


def test_memoised_meta_kernels_change_no_trace() -> None:
    """MetaMemo answers a repeated meta kernel from its first run: the saved storages and every
    layer's counts are those of the plain trace."""
    import torch

    from hyfi_imaging.parallel.memory import saved_activations
    from hyfi_imaging.parallel.model_trace import MetaMemo, layer_work, meta_model, saved_trace
    from hyfi_imaging.parallel.pipeline import StageModule
    from hyfi_imaging.parallel.speed import count_chain

    model = create_model("resnet18", num_classes=2, width=0.25)
    shape = (2, 3, 96, 64)
    meta = meta_model(model)
    whole = StageModule(meta.layers)
    x = torch.empty(shape, device="meta")
    plain = saved_activations(whole, lambda: whole(x))
    counts, _ = count_chain(meta.layers, x)
    memo = saved_trace(model, shape)
    assert [(o, b, d) for _, o, b, d in memo.storages] == [
        (o, b, d) for _, o, b, d in plain.storages
    ]
    assert layer_work(model, shape).counted == counts
    with MetaMemo():  # a second, fully memoised pass: the same again
        again, _ = count_chain(meta.layers, x)
    assert again == counts


def _cohort(manifest: Path, tmp_path: Path, n: int) -> Path:
    """A manifest of ``n`` slides (copies of the fixture's 4 stores: two ids on one store are
    refused), labels alternating."""
    import csv
    import shutil

    rows = list(csv.DictReader(manifest.open()))
    out = tmp_path / "manifest13.csv"
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for i in range(n):
            row = dict(rows[i % len(rows)])
            row["slide_id"] = f"s{i:02d}"
            copy = tmp_path / f"s{i:02d}.zarr"
            shutil.copytree(manifest.parent / row["path"], copy)
            row["path"] = str(copy)
            row["label"] = str(i % 2)
            w.writerow(row)
    return out


def test_parallel_auto_never_picks_replicas_training_refuses(
    tmp_path: Path, manifest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """13 slides, a quarter validating, batch 4 on 4 ranks: 9 training slides give 4 replicas
    no full batch (the trainer refuses), so auto keeps to 2 or fewer; preflight refuses 4."""
    from hyfi_imaging.train.autoplan import cohort_check
    from hyfi_imaging.train.config import load_recipe
    from hyfi_imaging.train.preflight import preflight
    from hyfi_imaging.train.split import check_full_batch, training_count
    from hyfi_imaging.train.tasks import load_cohort

    path = tmp_path / "r.yaml"
    path.write_text(
        f"dataset: {ROOT}/datasets/synthetic.yaml\nmodel: {{name: resnet18, kwargs: {{width: 0.25}}}}\n"
        f"data: {{manifest: {_cohort(manifest, tmp_path, 13)}}}\n"
        f"train: {{out_dir: {tmp_path}/run, batch_size: 4}}\n"
    )
    plain = load_recipe(path)
    training = training_count(plain, load_cohort(plain, plain.data.manifest))
    assert training == 9  # 7 + 6 slides, 1.75 and 1.5 rounded half up: 2 + 2 validate
    model = create_model("resnet18", num_classes=2, width=0.25)
    offered = {c.layout.dp for c in candidates(model, (256, 256), 4, 4)}
    assert 4 in offered  # what the check, not the candidates, keeps out
    with pytest.raises(ConfigError, match="9 training slides over 4 data replicas make no full"):
        cohort_check(plain)(Layout(dp=4))
    with pytest.raises(ConfigError, match="9 training slides over 4 data replicas"):
        preflight(load_recipe(path, ["parallel.data=4"]))
    monkeypatch.setenv("WORLD_SIZE", "4")
    auto = load_recipe(path, ["parallel=auto"])
    assert auto.world_size == 4 and auto.parallel.data <= 2
    from hyfi_imaging.train.autoplan import batch_line

    assert batch_line(1, 1, 4) is None
    assert batch_line(2, 2, 4) == (
        "2 data replica(s) x train.batch_size 4 = 8 images a step (an epoch has fewer steps; "
        "the learning-rate schedule counts them), BatchNorm over micro-batches of 2 image(s); "
        "set parallel to a layout to keep the recipe's batch"
    )
    check_full_batch(training, auto.parallel.data, 4)  # the trainer's own rule accepts it


def _card_text(name: str) -> str:
    return (ROOT / "models" / f"{name}.yaml").read_text()


@pytest.mark.parametrize(
    "card",
    [
        "resnet50",
        "cosmoflow",
        "resnet110-v2",
        pytest.param("amoebanet-d-18-256", marks=pytest.mark.slow),  # 5 s here
        "unet2d",
        "unet3d",
    ],
)
def test_model_cards_state_the_planners_memory(card: str) -> None:
    """Every memory figure of a card is hyfi-plan's prediction, as the generator rounds it
    (ResNet-50 at 1024^2: 1.88 GiB predicted, where the card once said 3.2)."""
    import yaml

    from hyfi_imaging.parallel.cards import card_memory, rewrite

    text = _card_text(card)
    mem = card_memory(yaml.safe_load(text))
    assert rewrite(text, mem) == text, (
        f"models/{card}.yaml is stale: run python -m hyfi_imaging.parallel.cards models/*.yaml"
    )
    if card == "resnet50":
        stated = yaml.safe_load(text)["memory_estimate"]
        assert stated["bytes_per_input_pixel"] == mem.per_pixel
        assert 1800 < mem.per_pixel < 2000  # 1.88 GiB at 1024^2, not the old 3277 B/px
        assert stated["at_1024"].startswith(f"{mem.peaks[1024][0]:.3g} GiB plain")


def test_the_guide_memory_table_states_the_planners_figures() -> None:
    """Each row of the user guide's layout table: its predicted GiB per GPU is predict()'s."""
    import re

    models = {"ResNet-50": "resnet50", "AmoebaNet-D(18, 256)": "amoebanet-d-18-256"}
    text = (ROOT / "docs" / "user-guide.md").read_text()
    head = "| image | model | suggested layout | GiB per GPU (hyfi-plan, batch 1) |"
    rows = text.split(head, 1)[1].split("\n\n", 1)[0].strip().splitlines()[1:]
    assert len(rows) >= 4, rows
    built: dict[str, object] = {}
    for row in rows:
        image, name, layout, stated = (c.strip() for c in row.strip("|").split("|"))
        size = int(image.rstrip("²"))
        keys = dict(re.findall(r"`(\w+): ([\w,]+)`", layout))
        grid = tuple(int(v) for v in keys.get("spatial", "1x1").split("x"))
        cand = Candidate(
            Layout(sp=grid, pp=int(keys.get("pipeline", 1))),
            int(keys.get("microbatches", 1)),
            keys.get("checkpointing", "none"),
        )
        model = built.setdefault(name, create_model(models[name]))
        peak = predict(model, (size, size), cand.microbatches, cand, overhead=0).peak  # type: ignore[arg-type]
        assert f"{peak / 2**30:.3g}" == stated, (row, peak / 2**30)


@pytest.mark.slow
def test_the_readme_plan_answers_within_a_minute() -> None:
    """The README's hyfi-plan example (13.5 minutes before issue 22) finishes in a minute on
    this 2-core machine, says what it is doing on stderr, and prints no step time: no device
    was named, and this CPU's speed says nothing about 80 GiB GPUs."""
    import subprocess
    import sys
    import time

    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if "hyfi-plan --" in ln)
    args = line.split("#")[0].split()[1:]
    began = time.perf_counter()
    job = subprocess.run(
        [sys.executable, "-m", "hyfi_imaging.cli.plan", *args],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    took = time.perf_counter() - began
    assert job.returncode == 0, job.stderr[-2000:]
    assert took <= 60, f"{' '.join(args)} took {took:.0f} s"
    assert "ranking 241 layouts" in job.stderr and "ranked 241 layouts in" in job.stderr
    header = job.stdout.splitlines()[0]
    assert "step time NOT PREDICTED" in header and "this CPU" not in header
    row = next(ln for ln in job.stdout.splitlines() if ln.startswith("  1 "))
    assert row.split()[10] == "-" and row.split()[-2] == "-", row  # no step s, no img/s
    assert "recommended: dp=1 x pp=1 x sp=2x4" in job.stdout


def test_parallel_auto_says_which_layouts_it_could_not_predict(
    tmp_path: Path,
    manifest: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A layout the planner cannot predict (here: every pipeline, its prediction made to fail
    with the planner's own error) is left out of ``parallel=auto`` and said in one warning, as
    hyfi-plan says it, instead of being dropped quietly."""
    from hyfi_imaging.parallel import plan
    from hyfi_imaging.train.config import load_recipe

    real = plan.predict

    def predict(model: Any, hw: Any, batch: int, cand: Any, **kw: Any) -> Any:
        if cand.layout.pp > 1:
            raise ConfigError("a stage", "cannot be predicted here", "use --pipeline 1")
        return real(model, hw, batch, cand, **kw)

    monkeypatch.setattr(plan, "predict", predict)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level("WARNING", logger="hyfi_imaging.train"):
        r = load_recipe(_recipe(tmp_path, manifest, "resnet18"), ["parallel=auto"])
    assert r.parallel.pipeline == 1
    said = [rec.getMessage() for rec in caplog.records if "parallel=auto" in rec.getMessage()]
    assert len(said) == 1 and "cannot predict" in said[0] and "pp=2" in said[0], said


def test_fit_warning_predicts_a_branches_recipe_per_branch_rank(
    tmp_path: Path, manifest: Path
) -> None:
    """The warning's figure is the planner's with br (the busiest branch rank), not one rank
    running every branch; the recipe lines keep the branches."""
    from hyfi_imaging.cli.plan import recipe_lines
    from hyfi_imaging.train.autoplan import fit_warning
    from hyfi_imaging.train.config import load_recipe

    path = _recipe(tmp_path, manifest, "amoebanet-d-3-8")
    plain, branched = (load_recipe(path, [f"parallel.branches={b}"]) for b in (1, 2))
    messages = [fit_warning(r, memory=2**16) for r in (plain, branched)]
    assert messages[1] is not None and "br=2" in messages[1]
    model = create_model("amoebanet-d-3-8", num_classes=2)
    one, two = (predict(model, (256, 256), 2, Candidate(Layout(br=b))) for b in (1, 2))
    assert two.activations < 0.85 * one.activations
    for message, pred in zip(messages, (one, two), strict=True):
        assert message is not None and f"predicts {pred.peak / 2**30:.2f} GiB" in message
    assert "branches: 2" in recipe_lines(Candidate(Layout(br=2)), (9,))


def test_the_plan_says_what_of_a_recipe_it_does_not_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Channels-last tiles measured 12-16 % above the predicted peaks, and hyfi-plan printed the
    plain row for them without a word. A recipe's halo_depth is counted (its own row, +halo2,
    a larger peak than depth 1's; it was a note of 17-30 % not counted)."""
    recipe = str(ROOT / "recipes" / "synthetic.yaml")
    rows = {}
    for depth, more in ((1, ["model.memory_format=channels_last"]), (2, [])):
        sets = ["parallel.spatial=1x2", f"parallel.halo_depth={depth}", *more]
        code = main([recipe, *(a for s in sets for a in ("--set", s)), "--image-size", "256",
                     "--top", "1"])  # fmt: skip
        out, err = capsys.readouterr()
        assert code == 0, err
        # channels-last is not modelled (said); a deep halo is (nothing to say)
        assert ("note: the peaks do not count channels-last tiles" in err) == (depth == 1), err
        assert "halo_depth" not in err
        rows[depth] = next(line for line in out.splitlines() if line.endswith("<- recipe"))
    assert "none+halo2" in rows[2] and "+halo" not in rows[1]
    peak = {d: float(row.split()[7]) for d, row in rows.items()}
    assert peak[2] > peak[1], rows


def test_deep_halos_grow_what_their_runs_keep_by_hand() -> None:
    """halo_depth 2 on a 1x2 grid of 8x8 tiles: conv 3x3 -> BatchNorm -> ReLU -> conv 3x3 is one
    run. The first convolution receives a halo of 2 and outputs its tile with a border of 1,
    which the BatchNorm and ReLU keep (10x10 of 8x8), and the second convolution keeps its
    input masked outside the image besides (one 10x10 copy more): float32, batch 1, 2 channels."""
    from torch import nn

    from hyfi_imaging.parallel.deep_borders import deep_borders, deepen
    from hyfi_imaging.parallel.memory import saved_activations
    from hyfi_imaging.parallel.meta import meta_copy

    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.BatchNorm2d(2), nn.ReLU(), nn.Conv2d(2, 2, 3, padding=1)
    )
    borders = deep_borders(model, (1, 2), (8, 8), 2, False, in_chans=1)
    one = (1, 1, 1, 1)
    assert dict(borders.heads) == {"0": (2, 2, 2, 2)}
    assert dict(borders.carried) == {"0": ((0,) * 4, one), "1": (one, one), "3": (one, (0,) * 4)}
    assert not deep_borders(model, (1, 2), (8, 8), 1, False, in_chans=1)  # depth 1: no runs
    meta = meta_copy(model)
    x = torch.empty(1, 1, 8, 8, device="meta", requires_grad=True)
    plain = saved_activations(meta, lambda: meta(x))
    deep = deepen(plain, borders, dict(meta.named_modules()))
    tile, grown = 2 * 8 * 8 * 4, 2 * 10 * 10 * 4  # bytes of a map: the tile, with its border
    assert plain.by_module["1"] - deep.by_module["1"] == tile - grown  # BatchNorm's input
    assert (plain.by_module["2"], deep.by_module["2"]) == (tile, grown)  # ReLU's output
    assert deep.by_module["3"] == grown  # the masked copy (the plain run reads ReLU's output)
    assert deep.by_module["0"] == plain.by_module["0"] == 1 * 8 * 8 * 4  # the head's own tile
    assert deep.activations - plain.activations == 3 * grown - 2 * tile


def test_the_h200s_memory_is_cudas_capacity_not_its_decimal_name() -> None:
    """141 GB (decimal) was read as 141 GiB: 1.2 GiB more than the 139.8 GiB CUDA gives, so a
    layout predicted at 140 GiB was marked as fitting."""
    from hyfi_imaging.parallel.devices import DEVICES

    assert DEVICES["h200"].memory == int(139.8 * 2**30)


def test_small_memory_figures_keep_their_digits() -> None:
    """A small plan's 4 MiB peak printed as 0.00 GiB."""
    from hyfi_imaging.cli.plan import _gib

    assert [_gib(v * 2**20) for v in (0, 4, 512, 1536)] == ["0.00", "0.00391", "0.5", "1.50"]
