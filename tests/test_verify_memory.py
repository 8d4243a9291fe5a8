"""hyfi-verify's memory, in one process: the CPU convolutions' unfolded inputs, the estimate it
prints, its refusal, and the input sizes a model takes (checked before any process group).

The multi-rank side -- the reference on rank 0 only, each rank's measured peak -- is in
``tests/test_volume_mpi.py`` (``hyfi-verify --model unet3d``) and
``tests/test_doc_examples.py`` (the README's example as written).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fresh import in_fresh_process
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models import create_model
from hyfi_imaging.parallel.engine import ParallelPlan
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.memory import (
    AnonymousPeak,
    LiveTensorPeak,
    cpu_unfold_bytes,
    fix_malloc_threshold,
    saved_activations,
)
from hyfi_imaging.parallel.plan import Candidate, predict
from hyfi_imaging.parallel.verify_memory import VerifyMemory, estimate_memory

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))

from _launch import plain

F64 = torch.float64


@pytest.mark.parametrize(
    ("module", "shape", "want"),
    [
        # N x C_in x kernel volume x output voxels x 8 bytes: the whole batch at once
        (nn.Conv3d(8, 4, 3, padding=1), (2, 8, 6, 5, 4), 2 * 8 * 27 * 120 * 8),
        (nn.Conv3d(8, 4, 3), (2, 8, 6, 5, 4), 2 * 8 * 27 * (4 * 3 * 2) * 8),
        (nn.Conv3d(8, 4, 3, stride=2, padding=1), (1, 8, 6, 5, 4), 8 * 27 * (3 * 3 * 2) * 8),
        (nn.Conv3d(8, 4, 2, padding="same"), (2, 8, 6, 5, 4), 2 * 8 * 8 * 120 * 8),
        (nn.Conv3d(8, 8, 3, padding=1, groups=4), (2, 8, 6, 5, 4), 2 * 8 * 27 * 120 * 8),
        (nn.Conv2d(3, 16, 7, stride=2, padding=3), (2, 3, 20, 30), 2 * 3 * 49 * (10 * 15) * 8),
        (nn.Conv1d(4, 4, 5, padding=2), (2, 4, 50), 2 * 4 * 5 * 50 * 8),
        # one sample at a time: dilated, and transposed (C_out x kernel x input voxels)
        (nn.Conv3d(8, 4, 3, padding=2, dilation=2), (2, 8, 6, 5, 4), 8 * 27 * 120 * 8),
        (nn.ConvTranspose3d(8, 4, 2, stride=2), (2, 8, 6, 5, 4), 4 * 8 * 120 * 8),
        # a 1x1 convolution reads its input as it is; other layers unfold nothing
        (nn.Conv3d(8, 4, 1), (2, 8, 6, 5, 4), 0),
        (nn.Conv3d(8, 4, 1, padding="same"), (2, 8, 6, 5, 4), 0),
        (nn.MaxPool3d(2), (2, 8, 6, 5, 4), 0),
    ],
)
def test_cpu_unfold_bytes(module: nn.Module, shape: tuple[int, ...], want: int) -> None:
    assert cpu_unfold_bytes(module, shape, F64) == want
    if torch.backends.mkldnn.is_available():  # oneDNN takes float32 without unfolding
        assert cpu_unfold_bytes(module, shape, torch.float32) == 0


def _conv_peaks() -> list[list[int]]:
    """Per dtype (float64, float32): a Conv3d forward's resident peak, its unfold as
    predicted, and its output's bytes, on one thread (run in a fresh process)."""
    fix_malloc_threshold()
    torch.set_num_threads(1)
    out = []
    for dtype in (F64, torch.float32):
        conv = nn.Conv3d(32, 16, 3, padding=1, bias=False).to(dtype)
        x = torch.randn(2, 32, 16, 16, 16, dtype=dtype)
        with torch.no_grad(), AnonymousPeak() as peak:
            y = conv(x)
        out.append(
            [peak.bytes, cpu_unfold_bytes(conv, x.shape, dtype), y.numel() * y.element_size()]
        )
        del x, y
    return out


@pytest.mark.skipif(not hasattr(torch.backends, "mkldnn"), reason="needs a CPU build")
def test_cpu_unfold_is_what_the_kernel_allocates() -> None:
    """Measured (in a fresh process, ``tests/fresh.py``): a float64 Conv3d's forward grows the
    resident set by its unfolded input (and its output), about 57 MB here, 9x its input;
    float32 (oneDNN) does not unfold."""
    try:
        with AnonymousPeak():
            pass
    except OSError:
        pytest.skip("needs Linux's /proc/self/clear_refs")
    for dtype, (peak, unfold, out) in zip(
        (F64, torch.float32), in_fresh_process("test_verify_memory", "_conv_peaks"), strict=True
    ):
        assert unfold == (2 * 32 * 27 * 4096 * 8 if dtype == F64 else 0)
        assert peak <= 1.1 * (unfold + out) + 4 * 2**20, (dtype, peak)
        if dtype == F64:
            assert peak >= 0.9 * unfold, peak


def _unet(width: int = 4, dtype: torch.dtype = F64) -> nn.Module:
    torch.manual_seed(0)
    return create_model("unet3d", num_classes=3, width=width).to(dtype)


def test_predict_adds_the_unfold_on_the_cpu_in_float64_only() -> None:
    one = Candidate(Layout(sp=(1, 1, 1)))
    size = (16, 16, 24)
    for dtype, grows in ((F64, True), (torch.float32, False)):
        model = _unet(dtype=dtype)
        on = predict(model, size, 2, one, cpu_kernels=True)  # type: ignore[arg-type]
        off = predict(model, size, 2, one, cpu_kernels=False)  # type: ignore[arg-type]
        assert on.activations == off.activations
        if grows:  # the first decoder convolution: 3 x width (skip + up) channels, full size
            assert (
                on.transient - off.transient
                >= cpu_unfold_bytes(nn.Conv3d(24, 8, 3, padding=1), (2, 24, *size), F64) // 2
            )
        else:
            assert on.peak == off.peak
    # A GPU (an asynchronous device) does not use these kernels: the default follows it.
    default = predict(_unet(), size, 2, one)  # type: ignore[arg-type]
    assert default.peak == predict(_unet(), size, 2, one, cpu_kernels=False).peak  # type: ignore[arg-type]


def _reference_peak_and_estimate() -> list[int]:
    """A float64 3-D U-Net's measured forward + backward peak, its estimated reference peak
    and model bytes, its unfold estimate and its saved activations (run in a fresh process)."""
    fix_malloc_threshold()
    torch.set_num_threads(1)
    model, size = _unet(width=4), (16, 24, 24)
    est = estimate_memory(model, size, 2, ParallelPlan(Layout(sp=(1, 1, 1))), "cpu")
    x = torch.randn(2, 3, *size, dtype=F64)
    target = torch.randint(0, 3, (2, *size))
    with AnonymousPeak() as peak:
        nn.functional.cross_entropy(model(x), target).backward()
    saved = saved_activations(model, lambda: model(x)).activations
    return [peak.bytes, est.reference_peak, est.model, est.unfold, saved]


def test_reference_estimate_is_close_to_a_measured_step() -> None:
    """The reference's predicted peak (one process, float64) against a measured forward and
    backward of the same model and batch (in a fresh process, ``tests/fresh.py``): within
    25 % (the step leaves out momentum)."""
    try:
        with AnonymousPeak():
            pass
    except OSError:
        pytest.skip("needs Linux's /proc/self/clear_refs")
    peak, reference, momentum, unfold, saved = in_fresh_process(
        "test_verify_memory", "_reference_peak_and_estimate"
    )
    # the estimate holds SGD's momentum too (the model's bytes); this step has none
    assert 0.75 * peak <= reference - momentum <= 1.25 * peak, (peak, reference, momentum)
    assert unfold > saved


def test_node_total_takes_the_larger_phase() -> None:
    est = VerifyMemory(
        model=100,
        rank_peak=1000,
        rank_state=50,
        reference_peak=5000,
        reference_state=200,
        unfold=4000,
        on_device=False,
    )
    # layout step: 4 x (100 + 1000) + 200 = 4600; reference step: 3 x (100 + 50 + 100) +
    # (100 + 50) + 5000 = 5900
    assert est.host_bytes(4, reference=True) == 5900
    assert est.host_bytes(4, reference=False) == 4 * 1100  # another node: no reference
    assert est.device_bytes() == 0
    gpu = VerifyMemory(100, 1000, 50, 5000, 200, 4000, on_device=True)
    assert gpu.device_bytes() == 1100
    assert gpu.host_bytes(4, reference=True) == max(200, 3 * 100 + 5000)


@pytest.fixture(scope="module")
def single() -> Iterator[object]:
    import torch.distributed as dist

    from hyfi_imaging.parallel.launch import init_parallel, shutdown

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    mine = not dist.is_initialized()
    yield init_parallel(Layout(sp=(1, 1, 1)))
    torch.set_num_threads(threads)
    if mine:
        shutdown()


def test_a_run_that_does_not_fit_is_refused_in_one_line(
    single: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hyfi_imaging.parallel import verify_memory
    from hyfi_imaging.parallel.verify import run_verify

    monkeypatch.setattr(verify_memory, "available_bytes", lambda: 2**20)  # 1 MiB free
    lines: list[str] = []
    with pytest.raises(ConfigError) as err:
        run_verify(lambda: _unet(width=2), single, image_hw=(16, 8, 16), steps=1, dtype=F64)  # type: ignore[arg-type]
    text = str(err.value)
    assert "\n" not in text and text.startswith("memory estimate: needs about")
    for fix in ("smaller image size", "--width", "--dtype float32 (about", "--no-memory-check"):
        assert fix in text, text
    # Told not to check, it says so and runs.
    report = run_verify(
        lambda: _unet(width=2),
        single,  # type: ignore[arg-type]
        image_hw=(16, 8, 16),
        steps=1,
        dtype=F64,
        memory_check=False,
        announce=lines.append,
    )
    assert report.ok and "NOT ENOUGH" in report.memory and any("NOT ENOUGH" in x for x in lines)
    assert report.memory_estimate["reference_peak"] >= report.memory_estimate["rank_peak"] > 0
    assert len(report.peak_rss) == 1 and report.peak_rss[0] > 0


# ----------------------------------------------------------------------------- input sizes


def test_cosmoflow_names_the_sizes_its_dense_head_takes() -> None:
    from hyfi_imaging.parallel.verify import check_image_size

    with torch.device("meta"):
        model = create_model("cosmoflow")
    check_image_size(model, (128, 140, 159))  # 4x4x4 after 5 pools, like 128^3
    with pytest.raises(ConfigError) as err:
        check_image_size(model, (64, 64, 72))
    text = str(err.value)
    assert "\n" not in text and "128 to 159 voxels a side" in text
    assert "size=64" in text and "cosmoflow-pool" in text
    with pytest.raises(ConfigError, match="too small for 5 pools"):
        model.check_input_size((16, 64, 64))  # type: ignore[operator]


def test_a_model_that_cannot_take_the_size_is_refused_not_crashed() -> None:
    """A model without check_input_size: a meta-device forward pass turns torch's error into
    one line naming the size."""
    from hyfi_imaging.parallel.verify import check_image_size

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    check_image_size(model, (8, 8))
    with pytest.raises(ConfigError, match=r"on a 9x8 input: fails on the meta device"):
        check_image_size(model, (9, 8))


def test_hyfi_verify_refuses_a_wrong_size_before_any_process_group() -> None:
    """The issue's command: one line naming the sizes, exit 2, and no process group started
    (one process of a 4-rank layout: a group would wait for the other three)."""
    job = plain(
        "-m", "hyfi_imaging.cli.verify", "--model", "cosmoflow", "--image-size", "64x64x72",
        "--spatial", "1x2x2", timeout=120,
    )  # fmt: skip
    assert job.returncode == 2, job.describe()
    err = job.stderr.strip()
    assert err.startswith("hyfi-verify: error: CosmoFlow") and "\n" not in err, err
    assert "128 to 159 voxels a side" in err and "cosmoflow-pool" in err


def test_live_tensor_peak_counts_each_storage_once_while_it_lives() -> None:
    """Views add nothing, a freed storage leaves the count, parameters are not counted, and
    the peak is broken down by the op that made each storage alive at that moment."""
    weight = nn.Parameter(torch.ones(1000, dtype=F64))
    with LiveTensorPeak() as live:
        a = torch.zeros(1000, dtype=F64)  # 8,000 bytes
        views = [a.view(10, 100), a[::2], a.t()]  # the same storage: nothing more
        b = torch.ones(500, dtype=torch.float32)  # 2,000: the peak, 10,000
        del a, views
        c = torch.empty(250, dtype=torch.float32) + 1  # empty (gone at once) and add: 1,000
        grad = weight * 2  # a new storage, not the parameter: 8,000 -> 11,000
    assert live.peak == 11_000
    assert live.by_op == {
        "aten.ones.default": 2_000, "aten.add.Tensor": 1_000, "aten.mul.Tensor": 8_000,
    }  # fmt: skip
    assert b.numel() + c.numel() + grad.numel() == 1_750


def test_live_tensor_peak_of_a_training_step_is_what_autograd_keeps() -> None:
    """One convolution's step: the live peak is the output and what backward keeps (the
    input is made outside the mode), measured against the storages counted by hand."""
    conv = nn.Conv2d(2, 4, 3, padding=1, bias=False).to(F64)
    x = torch.randn(1, 2, 8, 8, dtype=F64, requires_grad=True)
    with LiveTensorPeak() as live:
        y = conv(x)  # 4 x 8 x 8 x 8 bytes = 2,048, saved with x for backward
        loss = y.square().sum()  # y.square() 2,048 more, and the 8-byte loss
        loss.backward()
    assert live.peak >= 2 * 2048 + 8
    assert live.by_op["aten.convolution.default"] == 2048
