"""The streamed stem in one process: bands give what the whole map gives (float64).

The multi-rank cases (tiles, halos, pipeline, data replicas) run through hyfi-verify in
``tests/test_streaming_mpi.py``; here the band arithmetic, the BatchNorm passes and the
memory claim are checked without processes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models import create_model
from hyfi_imaging.models.registry import chain_run, run_chain
from hyfi_imaging.parallel.halo import rebuild, window_of
from hyfi_imaging.parallel.memory import LiveTensorPeak
from hyfi_imaging.parallel.pipeline import set_checkpointing
from hyfi_imaging.parallel.streaming import stream_stem


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _compare(plain: nn.Module, streamed: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Two SGD steps of both models on the same data; the worst relative difference of the
    outputs, input gradients, parameter gradients and BatchNorm buffers."""
    worst = 0.0
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, streamed)]
    for _ in range(2):
        outs, grads = [], []
        for m, opt in zip((plain, streamed), opts, strict=True):
            opt.zero_grad()
            xi = x.clone().requires_grad_(True)
            # A Sequential's own forward calls its children one by one: a chain runs them as
            # a chain model and a pipeline stage do (run_chain), the stem in its layers' place.
            out = run_chain(list(m.children()), xi) if isinstance(m, nn.Sequential) else m(xi)
            F.cross_entropy(out, y).backward()
            outs.append(out.detach())
            grads.append(xi.grad)
            opt.step()
        worst = max(worst, _rel(outs[1], outs[0]), _rel(grads[1], grads[0]))
    # Gradients relative to the model's largest: a gradient that is zero by construction (a
    # convolution's bias before a BatchNorm) holds rounding noise in both models.
    scale = max(float(a.grad.abs().max()) for a in plain.parameters())
    for (_, a), (_, b) in zip(plain.named_parameters(), streamed.named_parameters(), strict=True):
        worst = max(worst, float((b.grad - a.grad).abs().max()) / scale, _rel(b, a))
    for (_, a), (_, b) in zip(plain.named_buffers(), streamed.named_buffers(), strict=True):
        worst = max(worst, _rel(b.double(), a.double()))
    return worst


@pytest.mark.parametrize(("size", "band_rows"), [((67, 45), 3), ((64, 64), 1), ((33, 70), 100)])
def test_resnet_stem_in_bands_trains_like_the_whole_map(
    size: tuple[int, int], band_rows: int
) -> None:
    """Odd sizes (windows hanging over the end), one-row bands, one band for everything."""
    torch.manual_seed(0)
    plain = create_model("resnet18", num_classes=3, width=0.25).double().train()
    streamed = copy.deepcopy(plain)
    assert stream_stem(streamed, band_rows=band_rows) == ["conv1", "bn1", "relu", "maxpool"]
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    assert _compare(plain, streamed, x, torch.tensor([1, 2])) < 1e-11
    assert chain_run(streamed.conv1).runs == 2  # both steps ran in bands


def test_bands_are_planned_by_the_stems_maps_not_a_fixed_height() -> None:
    """A ResNet stem's maps per output pixel (conv, BatchNorm, ReLU: 64 channels at 4 pixels;
    the max-pool's 64) are 13 times its output's: 13 bands a tile at any size past 13 x 16
    output rows, not one band per 16 rows (64 at 4096^2, each a fixed number of kernels)."""
    from hyfi_imaging.parallel.streaming import _Frame, _Plan

    model = create_model("resnet50", num_classes=2)
    stream_stem(model)
    layers = chain_run(model.conv1).layers
    for side, bands in ((4096, 13), (16384, 13), (512, 8), (64, 1)):
        frame = _Frame((side, side), (0, 0), (side, side), (True, True), False)
        assert len(_Plan(layers, frame, None).bands) == bands, side
    frame = _Frame((4096, 4096), (0, 0), (4096, 4096), (True, True), False)
    assert len(_Plan(layers, frame, 16).bands) == 64  # an explicit height is kept


def test_a_stem_of_two_batchnorms_and_a_trailing_convolution() -> None:
    """conv/2 > BN > ReLU6 > conv (dilated, grouped, biased) > BN (no affine, cumulative
    running average) > SiLU > max-pool > 1x1 conv: one BatchNorm pass each, in order."""
    torch.manual_seed(1)
    plain = nn.Sequential(
        nn.Conv2d(3, 6, 5, stride=2, padding=2, bias=False),
        nn.BatchNorm2d(6),
        nn.ReLU6(inplace=True),
        nn.Conv2d(6, 6, 3, padding=2, dilation=2, groups=2),
        nn.BatchNorm2d(6, affine=False, momentum=None),
        nn.SiLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(6, 4, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    ).double()
    streamed = copy.deepcopy(plain)
    assert stream_stem(streamed, band_rows=2) == [str(i) for i in range(8)]
    x = torch.randn(3, 3, 41, 38, dtype=torch.float64)
    assert _compare(plain, streamed, x, torch.tensor([0, 1, 2])) < 1e-11
    assert chain_run(streamed[0]).runs == 2  # both steps ran in bands


@pytest.mark.parametrize(
    "first", [nn.BatchNorm2d(3), nn.MaxPool2d(3, stride=2, padding=1), nn.ReLU()], ids=str
)
def test_a_stem_that_starts_with_a_batchnorm_a_pool_or_an_activation(first: nn.Module) -> None:
    """The stem the guide describes need not start with a convolution: the bands' height read
    the first layer's in_channels, and a BatchNorm, max-pool or ReLU first crashed (planning
    with hyfi-plan too: its streamed candidates were traced the same way)."""
    torch.manual_seed(2)
    plain = nn.Sequential(
        first,
        nn.Conv2d(3, 6, 3, stride=2, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 4, 3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    ).double()
    streamed = copy.deepcopy(plain)
    assert stream_stem(streamed, band_rows=None)[:2] == ["0", "1"]  # the first layer streams
    x = torch.randn(2, 3, 37, 30, dtype=torch.float64)
    assert _compare(plain, streamed, x, torch.tensor([0, 2])) < 1e-11
    assert chain_run(streamed[0]).runs == 2  # both steps ran in bands


def test_evaluation_uses_the_running_statistics() -> None:
    torch.manual_seed(2)
    plain = create_model("resnet18", num_classes=2, width=0.25).double().eval()
    streamed = copy.deepcopy(plain)
    stream_stem(streamed, band_rows=5)
    x = torch.randn(1, 3, 50, 61, dtype=torch.float64)
    with torch.no_grad():
        assert _rel(streamed(x), plain(x)) < 1e-12


def test_with_checkpointed_blocks() -> None:
    torch.manual_seed(3)
    plain = create_model("resnet18", num_classes=2, width=0.25).double().train()
    streamed = copy.deepcopy(plain)
    set_checkpointing(streamed, "full")
    stream_stem(streamed)
    x = torch.randn(2, 3, 90, 75, dtype=torch.float64)
    assert _compare(plain, streamed, x, torch.tensor([0, 1])) < 1e-11


def test_backward_keeps_no_map_of_the_stem() -> None:
    """What autograd saves for the stem is the image and the parameters, nothing of the
    size of a map (the plain stem keeps the convolution's output and the ReLU's, 16
    channels at half resolution each: 2.7x the RGB image)."""
    torch.manual_seed(4)
    model = create_model("resnet18", num_classes=2, width=0.25).train()
    stem = model.conv1, model.bn1, model.relu, model.maxpool
    x = torch.randn(1, 3, 256, 256)

    def saved_bytes() -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.data_ptr() != x.data_ptr() and not isinstance(t, nn.Parameter):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            from hyfi_imaging.models.registry import run_chain

            run_chain(list(stem), x)
        return sum(seen.values())

    plain = saved_bytes()
    stream_stem(model)
    assert plain > 2 * x.numel() * 4  # the maps (16 channels at 128x128, twice)
    # the parameters as autograd hands them over (views) and the statistics: < 1 KiB each
    assert saved_bytes() < 16 * 1024


def test_models_that_cannot_stream_are_refused_in_one_line() -> None:
    class NotAChain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x).mean((2, 3))

    with pytest.raises(ConfigError, match="not one") as err:
        stream_stem(NotAChain())
    assert "\n" not in str(err.value) and "streaming=none" in str(err.value)
    with pytest.raises(ConfigError, match="'0' \\(Flatten\\)"):
        stream_stem(nn.Sequential(nn.Flatten(), nn.Linear(4, 2)))


@pytest.mark.parametrize("halo", [(2, 1, 3, 0), (0, 2, 1, 1), (1, 1, 1, 1)])
def test_a_window_of_the_tile_and_its_strips_is_the_extended_tile_s(
    halo: tuple[int, int, int, int],
) -> None:
    """window_of reads the part of the extended tile asked for from the tile and the strips
    (row strips over the tile's columns, column strips over the extended rows)."""
    gen = torch.Generator().manual_seed(5)
    top, bottom, left, right = halo
    ext = torch.randn(2, 3, 7 + top + bottom, 6 + left + right, generator=gen)
    x = ext[..., top : top + 7, left : left + 6].clone()
    cols = slice(left, left + 6)
    strips = (
        ext[..., :top, cols].clone() if top else None,
        ext[..., top + 7 :, cols].clone() if bottom else None,
        ext[..., :, :left].clone() if left else None,
        ext[..., :, left + 6 :].clone() if right else None,
    )
    h, w = ext.shape[-2:]
    for r0, r1, c0, c1 in [(0, h, 0, w), (1, h - 1, 0, 3), (top, top + 2, 2, w), (h - 2, h, 0, w)]:
        got = window_of(x, strips, halo, (slice(r0, r1), slice(c0, c1)))
        assert torch.equal(got, ext[..., r0:r1, c0:c1])
        # A tile past the image's edge (valid) and a fill where no neighbour sends: as rebuilt.
        for fill, valid in ((0.0, (5, 6)), (float("-inf"), (7, 4)), (2.0, (3, 2))):
            none_left = (*strips[:2], None, strips[3])
            whole = rebuild(x, none_left, halo, fill=fill, valid=valid)
            box = (slice(r0, r1), slice(c0, c1))
            got = window_of(x, none_left, halo, box, fill=fill, valid=valid)
            assert torch.equal(got, whole[..., r0:r1, c0:c1])


def test_a_channels_last_model_streams_into_a_channels_last_map() -> None:
    """Weights channels-last, the input not (the engine hands a stage its input contiguous):
    the plain stem's convolution gives a channels-last map and the streamed stem's output
    is laid out so too (it took the input's NCHW, and every convolution after it read NCHW),
    with the same numbers."""
    torch.manual_seed(0)
    plain = create_model("resnet18", num_classes=3, width=0.25).double().train()
    plain.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    streamed = copy.deepcopy(plain)
    stream_stem(streamed, band_rows=4)
    x = torch.randn(1, 3, 67, 45, dtype=torch.float64)
    stem_out: list[torch.Tensor] = []
    for m in (plain, streamed):
        hook = m.layer1.register_forward_pre_hook(lambda _, a: stem_out.append(a[0]))
        m(x)
        hook.remove()
    assert all(t.is_contiguous(memory_format=torch.channels_last) for t in stem_out)
    assert not stem_out[1].is_contiguous()
    assert _compare(plain, streamed, x, torch.tensor([1])) < 1e-11


def test_under_autocast_the_stem_is_as_close_to_float32_as_the_plain_one() -> None:
    """bf16 autocast (CPU here, CUDA on a cluster): bands recompute under the same autocast
    in backward; their gradients are as far from float32 as the plain model's (bf16 noise on
    a tiny model is tens of percent, so the check is relative)."""
    torch.manual_seed(6)
    ref = create_model("resnet18", num_classes=3, width=0.25).train()
    plain, streamed = copy.deepcopy(ref), copy.deepcopy(ref)
    stream_stem(streamed, band_rows=4)
    x, y = torch.randn(2, 3, 160, 144), torch.tensor([1, 2])
    F.cross_entropy(ref(x), y).backward()
    stem_out: list[torch.dtype] = []
    for m in (plain, streamed):
        hook = m.layer1.register_forward_pre_hook(lambda _, a: stem_out.append(a[0].dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        hook.remove()
        F.cross_entropy(out.float(), y).backward()
    # The stem's output in autocast's dtype, as the plain stem's (it was float32: twice the
    # bytes of the map that exists whole, and of its gradient).
    assert stem_out == [torch.bfloat16, torch.bfloat16], stem_out
    for name in ("conv1.weight", "bn1.weight", "layer1.0.conv1.weight"):
        want = dict(ref.named_parameters())[name].grad
        errs = [_rel(dict(m.named_parameters())[name].grad, want) for m in (plain, streamed)]
        assert errs[1] < 2 * errs[0] + 0.05, (name, errs)


def test_layers_whose_forward_is_their_own_are_not_streamed() -> None:
    """A subclass may compute more than its base (an activation folded into a norm, a
    standardised weight): the stem ends before it; a deep halo is refused with it."""

    class NormAct(nn.BatchNorm2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(super().forward(x))

    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), NormAct(4), nn.MaxPool2d(2))
    assert stream_stem(model) == ["0"]

    from hyfi_imaging.parallel.engine import ParallelPlan
    from hyfi_imaging.parallel.layout import Layout

    with pytest.raises(ConfigError, match="use halo_depth 1 with streaming"):
        ParallelPlan(Layout(), streaming="stem", halo_depth=2)


def test_deep_checkpointing_lowers_the_peak_of_a_step() -> None:
    """Live tensors at the peak of a training step, ResNet-50 x0.25 at 384² with the streamed
    stem: full checkpointing holds every block's input at the end of forward (layer1's three
    are the largest); deep recomputes layer1 as a whole and its blocks in units. Measured
    160 and 148 bytes per pixel (float32)."""
    peaks = {}
    for mode in ("full", "deep"):
        torch.manual_seed(5)
        model = create_model("resnet50", num_classes=2, width=0.25).train()
        set_checkpointing(model, mode)
        stream_stem(model)
        x = torch.randn(1, 3, 384, 384)
        with LiveTensorPeak() as live:
            F.cross_entropy(model(x), torch.tensor([1])).backward()
        peaks[mode] = live.peak
    assert peaks["deep"] < 0.95 * peaks["full"], peaks


def test_a_stem_layer_that_outgrows_the_tiles_is_refused_on_every_tile() -> None:
    """A first convolution padded (1, 2) makes a 64-px image 66 px wide (a 62-px one 64: fits):
    the plain spatial layer refuses it; the streamed stem wrote the last tile's 34 columns into 32 (a shape
    error on that rank, its neighbour waiting for a message until Gloo's timeout). Every rank
    plans every tile's bands before the exchange: each refuses, naming the layer and the fix."""
    from hyfi_imaging.parallel.streaming import _Frame, _Plan

    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=(1, 2)), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
    )
    stream_stem(model)
    layers = chain_run(model[0]).layers
    first = _Frame((64, 64), (0, 0), (64, 32), (True, False), True)
    _Plan(layers, first, None)  # the first tile's own bands fit
    with pytest.raises(ConfigError) as err:
        for frame in first.others((1, 2)):
            _Plan(layers, frame, None)
    assert str(err.value).startswith("module '0' (Conv2d): produces 66 outputs")
    assert "pad it by no more than its window takes back" in str(err.value)
    _Plan(layers, _Frame((64, 62), (0, 32), (64, 32), (True, True), True), None)  # room: fits
