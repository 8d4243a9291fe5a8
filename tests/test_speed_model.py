"""The speed model's arithmetic on hand-computed cases, and its device table (no processes)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from hyfi_imaging.cli.plan import main
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models import create_model
from hyfi_imaging.parallel import devices as devices_module
from hyfi_imaging.parallel.devices import DEVICES, Device, Link, calibrate_cpu, get_device
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.plan import Candidate, StageCost, predict, step_time
from hyfi_imaging.parallel.speed import (
    FRESH_CLASSES,
    Counts,
    OpCounter,
    Window,
    allreduce_s,
    compute_s,
    count_chain,
    fresh_class,
    fresh_s,
    halo_copy_bytes,
    halo_s,
    ideal_bubble,
    message_s,
)


def _device(**kw: object) -> Device:
    """A device whose every cost is zero unless given."""
    link = kw.pop("link", Link(math.inf, 0.0))
    base: dict[str, object] = dict(
        flops=1e9, mem_bw=math.inf, memory=2**30, op_overhead=0.0, asynchronous=False,
        intra=link, inter=link, per_node=8, px_half=0.0,
    )  # fmt: skip
    base.update(kw)
    return Device("test", **base)  # type: ignore[arg-type]


def test_compute_seconds_add_up() -> None:
    c = Counts(flops=2e12, bytes=1e9, ops=100, pixel_flops=1e6)
    cpu = _device(flops=1e12, mem_bw=1e11, op_overhead=1e-5, px_half=1000.0)
    # (2e12 FLOPs + 1000 pixels x 1e6 FLOPs per pixel) / 1e12 + 1e9 / 1e11 + 100 x 1e-5
    assert compute_s(c, cpu) == pytest.approx(2.001 + 0.01 + 0.001)
    gpu = Device(**{**cpu.__dict__, "asynchronous": True})
    assert compute_s(c, gpu) == pytest.approx(2.011)  # launches hide behind the work
    assert compute_s(Counts(ops=10**6), gpu) == pytest.approx(10.0)  # unless they dominate
    scaled = c.scaled(4)
    assert (scaled.flops, scaled.bytes, scaled.ops, scaled.pixel_flops) == (8e12, 4e9, 100, 1e6)


def test_counts_of_a_two_layer_chain() -> None:
    """Conv 3->4 then 4->4 (3x3, padding 1) on 8x8: 2 x pixels x Cout x Cin x 9 each; the first
    layer's backward computes only its weight gradient (the image needs none)."""
    layers = [
        ("a", nn.Conv2d(3, 4, 3, padding=1, bias=False)),
        ("b", nn.Conv2d(4, 4, 3, padding=1, bias=False)),
    ]
    meta = [(n, m.to("meta")) for n, m in layers]
    counted, out = count_chain(meta, torch.empty(1, 3, 8, 8, device="meta"))
    fa, fb = 2 * 64 * 4 * 3 * 9, 2 * 64 * 4 * 4 * 9
    assert counted["a"][0].flops == fa and counted["a"][1].flops == fa
    assert counted["b"][0].flops == fb and counted["b"][1].flops == 2 * fb
    assert counted["b"][0].pixel_flops == fb / 64  # one output pixel of one call
    assert tuple(out.shape) == (1, 4, 8, 8)


def test_grouped_convolution_backward_is_not_inflated() -> None:
    """torch 2.13's flop_registry ignores groups in the convolution's backward."""
    x = torch.empty(1, 32, 16, 16, device="meta", requires_grad=True)
    w = torch.empty(32, 1, 3, 3, device="meta", requires_grad=True)
    y = nn.functional.conv2d(x, w, padding=1, groups=32)
    counter = OpCounter()
    with counter:
        torch.autograd.grad(y, (x, w), torch.ones_like(y))
    assert counter.counts.flops == 2 * (2 * 32 * 256 * 9)


def test_memory_bound_ops_count_their_bytes_and_views_nothing() -> None:
    x = torch.empty(1, 4, 8, 8)
    counter = OpCounter()
    with counter:
        y = torch.relu(x)  # reads 1 KiB, writes 1 KiB
        y.view(-1)  # a view: free
        y.zero_()  # writes 1 KiB
    assert counter.counts.bytes == 3 * 1024 and counter.counts.ops == 2
    assert counter.counts.copy_bytes == 1024


def test_new_buffers_are_counted_by_size_and_cost_what_the_device_says() -> None:
    """A convolution's output and an allocation are new buffers; an in-place op and a view are
    not. Each lands in its size class (``[2^(i+12), 2^(i+13))`` bytes)."""
    x = torch.empty(1, 4, 64, 64, device="meta")  # 64 KiB
    w = torch.empty(8, 4, 3, 3, device="meta")
    counter = OpCounter()
    with counter:
        y = nn.functional.conv2d(x, w, padding=1)  # 128 KiB: class 5
        y.relu_()  # in place: nothing new
        y.view(-1)  # a view: nothing
        torch.empty(3 << 20, dtype=torch.uint8, device="meta")  # 3 MiB: class 9
        torch.relu(x)  # 64 KiB: class 4
    fresh = counter.counts.fresh
    assert len(fresh) == FRESH_CLASSES and sum(fresh) == 128 * 1024 + (3 << 20) + 64 * 1024
    assert (fresh_class(128 * 1024), fresh_class(3 << 20), fresh_class(64 * 1024)) == (5, 9, 4)
    assert fresh[5] == 128 * 1024 and fresh[9] == 3 << 20 and fresh[4] == 64 * 1024
    assert fresh_class(100) == 0 and fresh_class(2**40) == FRESH_CLASSES - 1
    # 1 ns per byte in class 9 only: 3 MiB cost 3 ms, added to the rest of the work.
    costs = tuple(1e-9 if i == 9 else 0.0 for i in range(FRESH_CLASSES))
    cpu = _device(flops=1e12, fresh_s=costs)
    c = Counts.allocation(3 << 20, 2) + Counts(flops=1e9)
    assert fresh_s(c, cpu) == pytest.approx(2 * 3 * 2**20 * 1e-9)
    assert compute_s(c, cpu) == pytest.approx(1e-3 + 2 * 3 * 2**20 * 1e-9)
    assert compute_s(c, _device(flops=1e12)) == pytest.approx(1e-3)  # a GPU's: free
    # Four times the pixels: each buffer four times larger, two classes up.
    assert c.scaled(4).fresh[11] == 4 * 2 * (3 << 20) and sum(c.scaled(4).fresh) == 24 << 20
    assert c.times(3).fresh[9] == 3 * 2 * (3 << 20)


def test_a_collective_fills_the_buffer_it_is_given_not_a_new_one() -> None:
    """c10d's ops return their output buffer without an alias annotation: not new memory."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        out, mine = torch.empty(2 << 20), torch.ones(1 << 20)
        counter = OpCounter()
        with counter:
            dist.all_gather_single(out, mine)
            dist.reduce_scatter_single(mine, out)
        assert counter.counts.ops == 2 and sum(counter.counts.fresh) == 0
    finally:
        dist.destroy_process_group()


def test_halo_messages_and_copies() -> None:
    """A 3x3/p1 layer's input (1, 16, 64, 32). Rows are extended first (with the image's zero
    padding where no neighbour is), then columns of the row-extended tile go out (corners):
    on 1x2 one phase of 66 rows x 16 channels x 4 B per side; on 2x2 a row phase (32 columns,
    2 KiB per side) then the column phase."""
    w = Window((1, 16, 64, 32), 4, ((1, 1), (1, 1)))
    link = Link(1e9, 1e-5)
    dev = _device()
    assert halo_s([w], (1, 2), link, dev) == pytest.approx(1e-5 + 4224 / 1e9)
    assert halo_s([w], (2, 2), link, dev) == pytest.approx(2e-5 + (2048 + 4224) / 1e9)
    assert halo_copy_bytes([w], (1, 2)) == 4 * (4224 + 4224)
    # overlap: the interior's FLOPs (here 1 ms at 1 GFLOP/s) hide the messages
    busy = Window(w.shape, 4, w.halo, flops=1e6)
    assert halo_s([busy], (1, 2), link, dev, overlap=True) == 0.0
    assert halo_s([w], (1, 1), link, dev) == 0.0


def test_collectives() -> None:
    link = Link(1e9, 1e-5)
    assert message_s(0, link) == 0.0
    assert message_s(1e6, link) == pytest.approx(1e-5 + 1e-3)
    # ring bytes 2 (r-1)/r, tree latencies 2 ceil(log2 r)
    assert allreduce_s(1e6, 4, link) == pytest.approx(1.5e-3 + 4e-5)
    assert allreduce_s(1e6, 1, link) == 0.0


def test_bubble_replay_equals_the_hand_computed_makespan() -> None:
    """GPipe, 2 stages, 2 micro-batches, forward 1 s, backward 2 s, a stage-to-stage message of
    t = 0.25 s + 1e9 B / 4e9 B/s = 0.5 s on stage 1 (forward and backward): rank 1's forwards end
    at 2 + t and 3 + 2t, its backwards at 5 + 3t and 7 + 4t, rank 0's last backward at 9 + 4t."""
    t = 0.5
    dev = _device(link=Link(4e9, 0.25))
    costs = [
        StageCost(0, 0, 0, [], 0, in_bytes=0, weight_grads=0, forward_s=1.0, backward_s=2.0),
        StageCost(0, 0, 0, [], 0, in_bytes=10**9, weight_grads=0, forward_s=1.0, backward_s=2.0),
    ]
    step, bubble, parts = step_time(costs, Layout(pp=2), 2, "gpipe", dev)
    assert step == pytest.approx(9 + 4 * t)
    busy = 6 + (6 + 4 * t)
    assert bubble == pytest.approx(1 - busy / (2 * (9 + 4 * t)))
    assert parts["p2p"] == pytest.approx(4 * t)
    # with no message: the textbook (m + p - 1) (F + B) and (p - 1) / (m + p - 1)
    step0, bubble0, _ = step_time(costs, Layout(pp=2), 2, "gpipe", _device())
    assert step0 == pytest.approx(9.0) and bubble0 == pytest.approx(ideal_bubble("gpipe", 2, 2))
    # GEMS: two mirrored replicas fill each other's bubble at equal stages
    _, gems, _ = step_time(costs, Layout(pp=2), 2, "bidirectional", _device())
    assert gems < bubble0
    assert ideal_bubble("bidirectional", 4, 4) == pytest.approx(ideal_bubble("1f1b", 4, 4) / 2)


def test_predicted_step_of_a_two_layer_chain_on_1x2() -> None:
    """ConvChain(depth 2, width 4) on 16x16, tiles 16x8: every part by hand.

    FLOPs: conv 3->4 forward 2 x 128 x 4 x 27 = 27,648 and its weight gradient as much; conv 4->4
    forward 36,864, backward twice; the head's linear 16 forward, 32 backward. At 1 MFLOP/s.
    Halos: one per convolution and pass, 1 ms latency each (bytes free). FSDP2 over the two
    tiles: the first unit's gather and the last unit's reduction wait (1 ms each), the rest
    hides behind the compute. Bytes, launches and the convolutions' fixed cost are free here.
    """
    model = create_model("convchain", depth=2, width=4, num_classes=2)
    dev = _device(flops=1e6, link=Link(1e15, 1e-3))
    pred = predict(model, (16, 16), 1, Candidate(Layout(sp=(1, 2))), device=dev)
    flops = 2 * 27648 + 3 * 36864 + 16 + 32
    assert pred.parts["flops"] == flops
    halo = 2 * 1e-3  # two convolutions, forward; as much in backward
    assert pred.parts["halo"] == pytest.approx(2 * halo, rel=1e-6)
    assert pred.parts["fsdp"] == pytest.approx(2e-3, rel=1e-6)
    assert pred.step_s == pytest.approx(flops / 1e6 + 2 * halo + 2e-3, rel=1e-6)


def test_device_table_is_sane() -> None:
    for name, d in DEVICES.items():
        assert get_device(name.upper()) is d
        assert 5e12 <= d.flops <= 1e15, name  # sustained dense FLOP/s
        assert 2e11 <= d.mem_bw <= 1e13, name  # bytes/s (an H200's NCHW measured: 6.6e11)
        assert 16 * 2**30 <= d.memory <= 192 * 2**30, name
        assert 10 <= d.flops / d.mem_bw <= 500, name  # FLOPs per byte at the ridge point
        assert d.intra.bandwidth > d.inter.bandwidth > 1e9, name
        assert 1e-6 <= d.intra.latency <= d.inter.latency <= 1e-4, name
        assert d.per_node in (4, 8) and d.px_half > 0 and d.asynchronous, name
    assert DEVICES["h200"].memory > DEVICES["h100"].memory
    assert DEVICES["h100"].flops > DEVICES["a100-80gb"].flops > DEVICES["v100"].flops
    with pytest.raises(Exception, match="device table"):
        get_device("tpu-v9")


def test_hopper_rows_carry_the_h200_figures_in_each_layout() -> None:
    """The H200's measured compute figures, per layout; the H100's memory bandwidth scaled by
    its HBM (3.35 of 4.8 TB/s); memory and links stay the datasheet's."""
    from hyfi_imaging.parallel.devices import HOPPER_MEASURED

    for cl, layout in ((False, "nchw"), (True, "channels_last")):
        fig = HOPPER_MEASURED[layout]
        h200, h100 = get_device("h200", channels_last=cl), get_device("H100", channels_last=cl)
        assert (h200.flops, h200.mem_bw, h200.op_overhead, h200.px_half) == (
            fig["flops"], fig["mem_bw"], fig["op_overhead"], fig["px_half"]
        )  # fmt: skip
        assert h100.flops == h200.flops and h100.mem_bw == pytest.approx(
            fig["mem_bw"] * 3350 / 4800
        )
        assert (h100.memory, h100.intra) == (80 * 2**30, DEVICES["h100"].intra)
        assert ("channels-last" if cl else "NCHW") in h200.note
    assert get_device("h200") is DEVICES["h200"]  # the table's rows are NCHW
    assert get_device("a100-80gb", channels_last=True) is DEVICES["a100-80gb"]  # not measured


def test_cpu_calibration_is_measured_once_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = devices_module._measure_cpu

    def measure(repeat: int = 2) -> dict[str, float]:
        calls.append(1)
        return real(repeat=2)

    monkeypatch.setattr(devices_module, "_measure_cpu", measure)
    cache = tmp_path / "speed.json"
    # Measured while other work holds the cores: kept, marked, for as long as the machine
    # stays busy; an idle machine measures again (a figure measured under load predicted a
    # step 17x too slow for every later run).
    monkeypatch.setattr(devices_module, "_busy", lambda: True)
    calibrate_cpu(cache=cache)
    calibrate_cpu(cache=cache)
    assert len(calls) == 1 and '"loaded": true' in cache.read_text()
    calls.clear()
    devices_module._THIS_PROCESS.clear()  # a later process (one process keeps its figures)
    monkeypatch.setattr(devices_module, "_busy", lambda: False)
    first = calibrate_cpu(cache=cache)
    second = calibrate_cpu(cache=cache)
    assert len(calls) == 1 and '"loaded"' not in cache.read_text()
    assert first.flops == second.flops
    figures = (first.flops, first.mem_bw, first.op_overhead, first.px_half)
    assert 1e9 < first.flops < 1e14 and 1e8 < first.mem_bw < 1e12, figures
    assert 0 < first.op_overhead < 1e-2 and first.px_half >= 0, figures
    assert len(first.fresh_s) == FRESH_CLASSES and min(first.fresh_s) >= 0, first.fresh_s
    assert all(s < 1e-7 for s in first.fresh_s), first.fresh_s  # < 0.4 ms per 4 KiB page
    assert not first.asynchronous


def test_the_gpu_calibration_measures_in_its_dtype_and_format_and_keeps_the_rows_links() -> None:
    """``hyfi-plan --device cuda`` measures a GPU as the CPU is measured (bfloat16,
    channels-last there); the same code on the CPU in bfloat16 channels-last, tiny sizes."""
    where = devices_module._Probe(
        torch.device("cpu"), torch.bfloat16, True, maps=((8, 32),), convs=((8, 24), (16, 8))
    )
    fig = devices_module.measure_figures(where, repeat=1)
    assert fig["flops"] > 0 and fig["mem_bw"] > 0 and fig["op_overhead"] > 0, fig
    row = DEVICES["h200"]
    dev = devices_module.calibrated(row, fig, "a test")
    assert (dev.flops, dev.mem_bw, dev.px_half) == (fig["flops"], fig["mem_bw"], fig["px_half"])
    assert (dev.intra, dev.inter, dev.memory, dev.per_node) == (
        row.intra, row.inter, row.memory, row.per_node
    )  # fmt: skip
    assert dev.asynchronous and "measured: a test" in dev.name
    gpu = devices_module.probe(torch.device("cuda", 0))
    assert gpu.asynchronous and gpu.dtype == torch.bfloat16 and not where.asynchronous
    assert devices_module.probe(torch.device("cpu")).dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"^--device cuda: found no CUDA device; run it on"):
        get_device("cuda")
    args = ["--model", "resnet18", "--width", "0.25", "--image-size", "256", "--devices", "1"]
    assert main([*args, "--device", "cuda"]) == 2
    assert "found no CUDA device" in capsys.readouterr().err


def test_cli_takes_a_device_of_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "resnet18", "--width", "0.25", "--image-size", "256", "--devices", "1",
            "--top", "2"]  # fmt: skip
    assert main([*args, "--device", "h100", "--link-bw", "100GB"]) == 0
    out = capsys.readouterr().out
    assert "H100" in out and "comm %" in out and "80.00 GiB" in out
    assert main([*args, "--device", "nonesuch"]) == 2


def test_hyfi_comparison_rows() -> None:
    from hyfi_imaging.parallel.scaling import STRATEGIES, compare_hyfi, format_table

    rows = compare_hyfi(models=("resnet18",), sizes=(2048,), gpus=(16,), device="h100")
    assert [r.strategy for r in rows] == list(STRATEGIES)
    assert all(r.images_per_s > 0 and r.config is not None for r in rows)
    assert all(r.config.gpus <= 16 for r in rows if r.config)
    text = format_table(rows, "h100")
    assert "PREDICTED" in text and "2.67x" in text


def _row_candidate(row: str) -> Candidate:
    """The candidate of a ``hyfi-plan`` table row (``dp1 pp1 sp1x2``, m, schedule, ckpt)."""
    cols = row.split()
    dp, pp, sp = (cols[1][2:], cols[2][2:], cols[3][2:])
    grids = tuple(tuple(int(v) for v in g.split("x")) for g in sp.split(","))
    layout = (
        Layout(dp=int(dp), pp=int(pp), grids=grids)
        if len(grids) > 1
        else Layout(dp=int(dp), pp=int(pp), sp=grids[0])
    )
    ckpt, *extra = cols[6].split("+")
    return Candidate(
        layout, int(cols[4]), ckpt, cols[5],
        streaming="stem" if "stem" in extra else "none", backward_bands="bands" in extra,
    )  # fmt: skip


def test_gpu_plan_step_times_come_from_the_device_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--device h100``: every step time of the table is the speed model on DEVICES["h100"]
    (not this CPU's calibration); ``--device-memory`` alone names no device, so no step time is
    printed (the README's example used to print this CPU's "2.6e+04 s" for an H100 plan)."""
    model_args = ["--model", "resnet18", "--width", "0.25", "--image-size", "512",
                  "--devices", "2", "--top", "4"]  # fmt: skip
    assert main([*model_args, "--device", "h100"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert "device H100 SXM5 80GB: 200 TFLOP/s" in header and "this CPU" not in header
    model = create_model("resnet18", num_classes=2, width=0.25)
    rows = [ln for ln in out.splitlines() if ln[:3].strip().isdigit() and " dp" in ln[:8]]
    assert len(rows) == 4
    for row in rows:
        want = predict(model, (512, 512), 1, _row_candidate(row), device=DEVICES["h100"])
        assert row.split()[10] == f"{want.step_s:.3g}", row
        assert want.step_s < 0.05  # an H100's step, not a CPU's (seconds)
    assert main([*model_args, "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert "step time NOT PREDICTED" in header and "this CPU" not in header
    rows = [ln for ln in out.splitlines() if ln[:3].strip().isdigit() and " dp" in ln[:8]]
    assert rows and all(row.split()[10] == "-" and row.split()[-2] == "-" for row in rows)


def test_fsdp_exposes_no_more_than_its_traffic() -> None:
    """One micro-batch: the first gather and the last reduce-scatter wait, the rest hides under
    compute. With no compute every byte waits, once: the edge units were counted twice
    (exposed 1.0019x all the traffic on ResNet-18 x0.25)."""
    from hyfi_imaging.parallel.plan import Candidate, nominal_device, predict
    from hyfi_imaging.parallel.speed import reduce_scatter_s

    model = create_model("resnet18", num_classes=2, width=0.25)
    dev = nominal_device(1e30, 1e9)  # compute takes no time
    pred = predict(model, (64, 64), 1, Candidate(Layout(dp=2)), device=dev)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    traffic = 2 * reduce_scatter_s(params, 2, dev.link(2))  # one gather, one reduce-scatter
    assert pred.parts["fsdp"] == pytest.approx(traffic, rel=1e-9)
