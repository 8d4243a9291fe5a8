"""Tests of hyfi_imaging.models: the uniform model contract, checked on every registered model.

The parallel code relies on three promises checked here for all models at once:
the top-level children chained in order *are* the model (pipeline cuts), only
swappable pixel-mixing modules are used (spatialize), and block checkpointing
changes nothing but memory. Family-specific tests pin torchvision's names for
ResNet, the depth rule for ResNet-v2, the genotype, real max-pools and the exact
FactorizedReduce for AmoebaNet, and the numbers in the model cards.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.overrides import TorchFunctionMode

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.models import (
    AMOEBANET_D,
    AmoebaNet,
    ChainModel,
    FactorizedReduce,
    ModelBase,
    ResNetV2,
    create_model,
    list_models,
    register_model,
    registry,
)
from hyfi_imaging.parallel.pipeline import deep_layers, set_checkpointing

torch.set_num_threads(1)

CARDS = Path(__file__).resolve().parents[1] / "models"

# Tiny configurations (same topology, fewer channels) so every model runs in a test.
TINY: list[tuple[str, dict[str, Any]]] = [
    ("resnet1001-v2", {"width": 0.125}),
    ("resnet*-v2", {"width": 0.25}),
    ("resnet*", {"width": 1 / 16}),
    ("amoebanet-d-*", {"num_filters": 8}),
]
# Input sizes: not square, not powers of two, odd sizes deep inside the networks.
SIZES: dict[str, list[tuple[int, int]]] = {
    "resnet1001-v2": [(30, 22)],
    "resnet164-v2": [(46, 38)],
}
DEFAULT_SIZES = [(96, 80), (130, 66)]

ALLOWED_LEAVES = (
    nn.Conv2d,
    nn.BatchNorm2d,
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.ReLU,
    nn.Flatten,
    nn.Linear,
    nn.Identity,
    nn.Dropout,
)
# The only tensor functions allowed in container code (between swappable modules); a dtype
# read is no pixel-level code (a ResNet block reads dtypes to add in place).
POINTWISE_IN_CONTAINERS = {"add", "add_", "__add__", "cat", "dtype.__get__"}


def tiny_kwargs(name: str) -> dict[str, Any]:
    for pattern, kwargs in TINY:
        if fnmatch.fnmatchcase(name, pattern):
            return dict(kwargs)
    return {}


def sizes(name: str) -> list[tuple[int, int]]:
    return SIZES.get(name, DEFAULT_SIZES)


def build(name: str, seed: int = 0, **kwargs: Any) -> ChainModel:
    torch.manual_seed(seed)
    model = create_model(name, **{**tiny_kwargs(name), **kwargs})
    assert isinstance(model, ChainModel)
    return model


def make(name: str, **kwargs: Any) -> Any:
    """create_model typed as Any, for tests that reach into submodules."""
    return create_model(name, **kwargs)


def chain(model: nn.Module, x: torch.Tensor) -> Any:
    out: Any = x
    for child in model.children():
        out = child(out)
    return out


# The 2-D classifiers share the contract tests below; the U-Nets (dense output, not chains)
# and the 3-D models have their own (test_unet.py, test_cosmoflow.py, test_unet_mpi.py).
OWN_TESTS = {"unet2d", "unet3d", "cosmoflow", "cosmoflow-pool"}
ALL = [n for n in list_models() if n not in OWN_TESTS]


# ---------------------------------------------------------------- registry


def test_registry_lists_every_family() -> None:
    for name in (
        "resnet18",
        "resnet34",
        "resnet50",
        "resnet101",
        "resnet152",
        "resnet20-v2",
        "resnet110-v2",
        "resnet1001-v2",
        "amoebanet-d-18-256",
        "amoebanet-d-6-64",
        "amoebanet-d-3-8",
    ):
        assert name in ALL
    assert list_models("resnet*-v2") == sorted(n for n in ALL if n.endswith("-v2"))
    assert set(list_models()) >= OWN_TESTS


def test_unknown_name_suggests_close_matches() -> None:
    with pytest.raises(ConfigError) as err:
        create_model("resnet5O")
    assert "resnet50" in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_option_is_named() -> None:
    with pytest.raises(ConfigError, match="widht") as err:
        create_model("resnet18", widht=2)
    assert "width" in str(err.value)


def test_register_twice_fails_and_decorator_form_works() -> None:
    @register_model("test-only-net", width=3)
    def tiny_linear(width: int = 1) -> nn.Module:
        return nn.Linear(width, 1)

    try:
        assert make("test-only-net").in_features == 3
        assert make("test-only-net", width=5).in_features == 5
        with pytest.raises(ValueError, match="already registered"):
            register_model("test-only-net", tiny_linear)
    finally:
        registry._REGISTRY.pop("test-only-net")  # keep the global table clean for other tests


# ------------------------------------------------- contract, on every model


@pytest.mark.parametrize("name", ALL)
def test_output_shape_any_size_and_in_chans(name: str) -> None:
    model = build(name, num_classes=7, in_chans=1)
    assert (model.num_classes, model.in_chans) == (7, 1)
    for h, w in sizes(name):
        out = model(torch.randn(2, 1, h, w))
        assert out.shape == (2, 7)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ALL)
def test_children_chain_equals_forward(name: str) -> None:
    model = build(name, num_classes=5)
    h, w = sizes(name)[-1]
    x = torch.randn(2, 3, h, w)
    for train in (True, False):
        model.train(train)
        ref = model(x)
        assert torch.equal(chain(model, x), ref)
        feats = model.forward_features(x)
        assert torch.equal(model.forward_head(feats), ref)
        assert feats.shape[1] == model.num_features
        # A cut anywhere gives two stages whose composition is the model.
        children = list(model.children())
        cut = len(children) // 2
        stage1, stage2 = nn.Sequential(*children[:cut]), nn.Sequential(*children[cut:])
        assert torch.equal(stage2(stage1(x)), ref)


@pytest.mark.parametrize("name", ALL)
def test_total_stride(name: str) -> None:
    model = build(name).eval()
    s = model.total_stride
    with torch.no_grad():
        feats = model.forward_features(torch.randn(1, 3, 2 * s, 3 * s))
    assert feats.shape[-2:] == (2, 3)


@pytest.mark.parametrize("mode", ["full", "deep"])
@pytest.mark.parametrize("name", ALL)
def test_grad_checkpointing_changes_nothing(name: str, mode: str) -> None:
    plain = build(name, num_classes=4)
    ckpt = copy.deepcopy(plain)
    if mode == "full":
        ckpt.set_grad_checkpointing(True)
    elif not isinstance(ckpt, ChainModel):
        with pytest.raises(ConfigError, match=r"deep on .*this model is not a chain"):
            set_checkpointing(ckpt, mode)
        return
    else:
        set_checkpointing(ckpt, mode)
    assert all(b.grad_checkpointing for b in ckpt.blocks())
    assert any(True for _ in ckpt.blocks())
    h, w = sizes(name)[0]
    x = torch.randn(2, 3, h, w)
    weight = torch.randn(2, 4)

    def step(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int]:
        xi = x.clone().requires_grad_(True)
        saved = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            saved += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(xi)
        (out * weight).sum().backward()
        assert xi.grad is not None
        return out, xi.grad, saved

    out_p, gx_p, saved_p = step(plain)
    out_c, gx_c, saved_c = step(ckpt)
    assert saved_c < saved_p  # checkpointing really stores fewer activations
    if mode == "deep" and deep_layers(ckpt, mode):
        full = copy.deepcopy(plain)
        full.set_grad_checkpointing(True)
        assert saved_c < step(full)[2]  # and deep fewer than full
    assert torch.equal(out_p, out_c)
    torch.testing.assert_close(gx_c, gx_p, rtol=1e-6, atol=1e-7)
    for (n, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        if p.grad is None:
            assert q.grad is None, n
            continue
        assert q.grad is not None, n
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=n)
    # BatchNorm running statistics are updated once, not again by the recomputation.
    for (n, a), (_, b) in zip(plain.named_buffers(), ckpt.named_buffers(), strict=True):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("mode", ["full", "deep"])
def test_checkpointing_is_bit_for_bit_on_a_channels_last_model(mode: str) -> None:
    """float64, channels-last ResNet-50: every gradient equal to the plain model's, not just
    close (deep's ReLU once returned its gradient in another layout, and the convolution
    backward after it rounded differently: 1e-14)."""
    torch.manual_seed(0)
    plain = create_model("resnet50", num_classes=3, width=0.125).double()
    plain = plain.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    ckpt = copy.deepcopy(plain)
    set_checkpointing(ckpt, mode)
    x = torch.randn(2, 3, 96, 80, dtype=torch.float64).to(memory_format=torch.channels_last)
    for model in (plain, ckpt):
        nn.functional.cross_entropy(model(x), torch.tensor([0, 2])).backward()
    for (n, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n


def test_a_residual_blocks_units_start_at_its_shortcuts_first_leaf() -> None:
    """The planner reads where each unit starts: the shortcut's first leaf module, or the
    shortcut itself where it is one convolution."""
    from hyfi_imaging.models.resnet import Bottleneck

    seq = nn.Sequential(nn.Conv2d(64, 256, 1), nn.BatchNorm2d(256))
    assert Bottleneck(64, 64, downsample=seq).unit_starts == (
        "downsample.0",
        "conv1",
        "conv2",
        "conv3",
    )
    assert Bottleneck(64, 64, downsample=nn.Conv2d(64, 256, 1)).unit_starts[0] == "downsample"
    assert Bottleneck(256, 64).unit_starts == ("conv1", "conv2", "conv3")


def test_a_checkpointed_block_under_torch_compile_is_refused_in_one_line() -> None:
    """The refusal is raised outside the compiled graph (torch 2.11's dynamo turned the raise
    inside it into an AssertionError on an H200)."""
    model = build("resnet18", num_classes=2, width=0.25)
    model.set_grad_checkpointing(True)
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(ConfigError, match=r"^checkpointed block BasicBlock: .*torch.compile"):
        compiled(torch.randn(1, 3, 64, 64))
    torch.compiler.reset()


def non_container_path(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for path, m in model.named_modules():
        if not any(True for _ in m.children()):
            yield path, m


@pytest.mark.parametrize("name", ALL)
def test_only_spatializable_modules(name: str) -> None:
    model = build(name)
    for path, m in non_container_path(model):
        assert type(m) in ALLOWED_LEAVES, f"{path}: {type(m).__name__} cannot be spatialized"
    for path, m in model.named_modules():
        if any(True for _ in m.children()):
            assert type(m).__module__.startswith(("hyfi_imaging.models", "torch.nn")), path
        if isinstance(m, nn.AdaptiveAvgPool2d):
            assert m.output_size in (1, (1, 1)), f"{path}: only global pooling is spatializable"


class _ContainerOpAudit(TorchFunctionMode):
    """Record tensor functions called directly by container modules (not inside leaves)."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[nn.Module] = []
        self.calls: set[tuple[str, str]] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.stack and any(True for _ in self.stack[-1].children()):
            name = getattr(func, "__name__", str(func))
            if name == "__get__":  # an attribute read: which attribute (``x.T`` moves pixels)
                name = f"{getattr(getattr(func, '__self__', None), '__name__', '?')}.__get__"
            self.calls.add((type(self.stack[-1]).__name__, name))
        return func(*args, **(kwargs or {}))


def container_calls(model: nn.Module, x: torch.Tensor) -> set[tuple[str, str]]:
    """Run ``model(x)``; return (container class, tensor function) for ops between modules."""
    audit = _ContainerOpAudit()

    def pre(m: nn.Module, args: Any) -> None:
        audit.stack.append(m)

    def post(m: nn.Module, args: Any, out: Any) -> None:
        audit.stack.pop()

    handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
    try:
        with audit:
            model(x)
    finally:
        for h in handles:
            h.remove()
    return audit.calls


@pytest.mark.parametrize("name", ALL)
def test_no_hidden_functional_ops(name: str) -> None:
    """Between modules only add and cat run: no F.pad, slicing, interpolate or functional pool."""
    calls = container_calls(build(name), torch.randn(2, 3, *sizes(name)[0]))
    bad = {c for c in calls if c[1] not in POINTWISE_IN_CONTAINERS}
    assert not bad, f"pixel-level tensor code outside swappable modules: {sorted(bad)}"


def test_audit_catches_functional_padding_and_slicing() -> None:
    """The audit above can fail: a container that pads or slices is reported."""

    class Sneaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(F.pad(x[:, :, 1:], (1, 1, 1, 1)))

    calls = container_calls(Sneaky(), torch.randn(1, 1, 5, 5))
    assert {("Sneaky", "pad"), ("Sneaky", "__getitem__")} <= calls


# ----------------------------------------------------------------- ResNet

BN_KEYS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def torchvision_keys(convs_per_block: int, layers: tuple[int, ...]) -> list[str]:
    """torchvision's ResNet state_dict keys, written out from its naming scheme."""
    keys = ["conv1.weight", *(f"bn1.{k}" for k in BN_KEYS)]
    for stage, count in enumerate(layers, start=1):
        for b in range(count):
            p = f"layer{stage}.{b}."
            for c in range(1, convs_per_block + 1):
                keys += [f"{p}conv{c}.weight", *(f"{p}bn{c}.{k}" for k in BN_KEYS)]
            # Stage 1 of BasicBlock nets keeps 64 channels at stride 1: no projection.
            if b == 0 and (stage > 1 or convs_per_block == 3):
                keys += [f"{p}downsample.0.weight", *(f"{p}downsample.1.{k}" for k in BN_KEYS)]
    return [*keys, "fc.weight", "fc.bias"]


@pytest.mark.parametrize(
    ("name", "convs", "layers", "n_keys", "n_params"),
    [
        # 1 + 5 (stem) + 8 blocks x 12 + 3 projections x 6 + 2 (fc) = 122
        ("resnet18", 2, (2, 2, 2, 2), 122, 11_689_512),
        # 1 + 5 + 16 blocks x 18 + 4 projections x 6 + 2 = 320
        ("resnet50", 3, (3, 4, 6, 3), 320, 25_557_032),
    ],
)
def test_resnet_state_dict_is_torchvisions(
    name: str, convs: int, layers: tuple[int, ...], n_keys: int, n_params: int
) -> None:
    with torch.device("meta"):
        model = create_model(name)
    state = model.state_dict()
    assert list(state) == torchvision_keys(convs, layers)
    assert len(state) == n_keys
    assert sum(p.numel() for p in model.parameters()) == n_params
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    assert shapes["conv1.weight"] == (64, 3, 7, 7)
    if name == "resnet50":
        assert shapes["layer1.0.conv1.weight"] == (64, 64, 1, 1)
        assert shapes["layer1.0.conv3.weight"] == (256, 64, 1, 1)
        assert shapes["layer1.0.downsample.0.weight"] == (256, 64, 1, 1)
        assert shapes["layer2.0.conv2.weight"] == (128, 128, 3, 3)
        assert shapes["layer4.2.conv2.weight"] == (512, 512, 3, 3)
        assert shapes["fc.weight"] == (1000, 2048)
    else:
        assert shapes["layer2.0.conv1.weight"] == (128, 64, 3, 3)
        assert shapes["layer2.0.downsample.0.weight"] == (128, 64, 1, 1)
        assert shapes["fc.weight"] == (1000, 512)


def test_resnet_stride_on_3x3_and_width_and_zero_init() -> None:
    model = make("resnet50", width=0.5, zero_init_last_bn=True)
    block = model.layer2[0]
    assert (block.conv1.stride, block.conv2.stride) == ((1, 1), (2, 2))
    assert model.conv1.out_channels == 32
    assert model.num_features == 1024
    assert torch.count_nonzero(block.bn3.weight) == 0
    assert torch.count_nonzero(block.bn2.weight) == block.bn2.weight.numel()


def test_resnet_rejects_bad_width() -> None:
    with pytest.raises(ConfigError, match="width"):
        create_model("resnet18", width=0)


# -------------------------------------------------------------- ResNet-v2


def test_resnet_v2_depth_rule() -> None:
    blocks = list(make("resnet20-v2").blocks())
    assert len(blocks) == 9 and all(b.num_units == 2 for b in blocks)
    bottleneck = make("resnet164-v2")
    assert sum(1 for _ in bottleneck.blocks()) == 54
    # MPI4DL's ResNet-110-v2 (Keras port): bottleneck units, 9n+2 with n = 12.
    keras = make("resnet110-v2", bottleneck=True)
    assert sum(1 for _ in keras.blocks()) == 36
    with pytest.raises(ConfigError, match=r"6n\+2") as err:
        ResNetV2(100)
    assert "110" in str(err.value)
    with pytest.raises(ConfigError, match=r"9n\+2"):
        ResNetV2(110 + 6, bottleneck=True)


def test_resnet_v2_is_pre_activation() -> None:
    model = make("resnet20-v2")
    names = [n for n, _ in model.named_children()]
    assert names == [
        "conv1",
        "layer1",
        "layer2",
        "layer3",
        "bn",
        "relu",
        "avgpool",
        "flatten",
        "fc",
    ]
    first = model.layer2[0]
    assert first.conv1.stride == (2, 2) and first.downsample.stride == (2, 2)
    # Pre-activation: the unit's first BN normalizes the block input's channels.
    assert first.bn1.num_features == model.layer1[-1].out_ch


def test_resnet_v2_parameter_counts_match_he_et_al() -> None:
    # He et al. 2016, Table 3 (CIFAR-10): 1.7M, 1.7M and 10.2M parameters (rounded figures;
    # common implementations of ResNet-1001 count 10.33M, as this one does).
    for name, reported in (
        ("resnet110-v2", 1.7e6),
        ("resnet164-v2", 1.7e6),
        ("resnet1001-v2", 10.2e6),
    ):
        with torch.device("meta"):
            model = create_model(name)
        count = sum(p.numel() for p in model.parameters())
        assert abs(count - reported) < 0.15e6, (name, count)


# -------------------------------------------------------------- AmoebaNet


def test_amoebanet_uses_real_max_pools() -> None:
    model = make("amoebanet-d-3-8")
    cells = [c for c in model.children() if hasattr(c, "ops")]
    for cell in cells:
        spec = AMOEBANET_D.reduction if cell.reduction else AMOEBANET_D.normal
        for (op_name, _), op in zip(spec, cell.ops, strict=True):
            if op_name.startswith("max_pool"):
                assert type(op) is nn.MaxPool2d
            if op_name.startswith("avg_pool"):
                assert type(op) is nn.AvgPool2d and not op.count_include_pad
    n_max = sum(isinstance(m, nn.MaxPool2d) for m in model.modules())
    # 2 per normal cell (3 cells), 4 per reduction cell (2 stem + 2 between stacks).
    assert n_max == 2 * 3 + 4 * 4


def test_amoebanet_layout_and_channels() -> None:
    model = AmoebaNet(6, 16, num_classes=3)
    names = [n for n, _ in model.named_children()]
    assert names == [
        "stem",
        "stem_reduction1",
        "stem_reduction2",
        "stack1_normal1",
        "stack1_normal2",
        "reduction1",
        "stack2_normal1",
        "stack2_normal2",
        "reduction2",
        "stack3_normal1",
        "stack3_normal2",
        "head",
    ]
    widths = [c.out_channels for c in list(model.children())[1:-1]]
    # Reduction cells concatenate 3 states, normal cells 4; filters D/4, D/2, D, 2D, 4D.
    assert widths == [3 * 4, 3 * 8, 4 * 16, 4 * 16, 3 * 32, 4 * 32, 4 * 32, 3 * 64, 4 * 64, 4 * 64]
    assert model.total_stride == 32 and model.num_features == 256


def test_amoebanet_matches_gpipe_parameter_counts() -> None:
    # GPipe (Huang et al. 2019), Table 1: AmoebaNet-D (18, 208) 82M, (18, 544) 542M params.
    # Ours, built like the TF reference (no auxiliary head): 81.1M and 540.2M.
    for (layers, filters), reported in (((18, 208), 82e6), ((18, 544), 542e6)):
        with torch.device("meta"):
            model = AmoebaNet(layers, filters)
        count = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert abs(count - reported) / reported < 0.015, (layers, filters, count)


def test_amoebanet_rejects_bad_sizes() -> None:
    with pytest.raises(ConfigError, match="multiple of 3"):
        AmoebaNet(4, 64)
    with pytest.raises(ConfigError, match="multiple of 8"):
        AmoebaNet(6, 60)


@pytest.mark.parametrize(("h", "w"), [(10, 8), (11, 7), (1, 1), (2, 3)])
def test_factorized_reduce_equals_shift_and_pad(h: int, w: int) -> None:
    """The frozen one-hot conv gives exactly the classic ``x[:, :, 1:, 1:]`` + pad path."""
    torch.manual_seed(0)
    fr = FactorizedReduce(3, 6)
    x = torch.randn(2, 3, h, w, requires_grad=True)
    out = fr(x)
    r = F.relu(x)
    classic = torch.cat(
        [fr.conv1(r), fr.conv2(F.pad(r[:, :, 1:, 1:], (0, 1, 0, 1))[:, :, ::2, ::2])], 1
    )
    assert out.shape[-2:] == ((h + 1) // 2, (w + 1) // 2)
    torch.testing.assert_close(out, fr.bn(classic), rtol=0, atol=1e-6)
    out.sum().backward()
    assert fr.shift.weight.grad is None and not fr.shift.weight.requires_grad
    assert fr.conv2.weight.grad is not None


def test_amoebanet_init_keeps_selector() -> None:
    model = create_model("amoebanet-d-3-8")
    frs = [m for m in model.modules() if isinstance(m, FactorizedReduce)]
    assert frs
    for fr in frs:
        w = fr.shift.weight
        assert w.sum() == w.shape[0] and w[:, 0, 2, 2].eq(1).all()


# ------------------------------------------------------------ model cards


class _ReceptiveField(TorchFunctionMode):
    """Analytic receptive field: per tensor (jump, first tap, last tap) along y and x.

    Taps are read from conv weights (so a one-hot selector counts one tap),
    pools count their whole window, pointwise ops and add/cat take the union.
    """

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.info: dict[int, Any] = {id(x): ((1, 1), (0, 0), (0, 0), x)}

    def _geom(self, out: torch.Tensor, x: torch.Tensor, s: Any, p: Any, d: Any, taps: Any) -> None:
        pair = lambda v: tuple(v) if isinstance(v, tuple | list) else (v, v)  # noqa: E731
        s, p, d = pair(s), pair(p), pair(d)
        j, lo, hi, _ = self.info[id(x)]
        self.info[id(out)] = (
            (j[0] * s[0], j[1] * s[1]),
            tuple(lo[a] + (taps[a][0] * d[a] - p[a]) * j[a] for a in (0, 1)),
            tuple(hi[a] + (taps[a][1] * d[a] - p[a]) * j[a] for a in (0, 1)),
            out,  # keeps the tensor alive so its id is not reused
        )

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "conv2d":
            w = args[1]
            nz = w.ne(0).any(0).any(0)
            ys, xs = nz.any(1).nonzero().flatten(), nz.any(0).nonzero().flatten()
            taps = ((int(ys.min()), int(ys.max())), (int(xs.min()), int(xs.max())))
            self._geom(out, args[0], args[3], args[4], args[5], taps)
        elif name in ("max_pool2d", "avg_pool2d", "max_pool2d_with_indices"):
            opts = dict(zip(("kernel_size", "stride", "padding"), args[1:], strict=False))
            opts.update(kwargs)
            k = opts["kernel_size"]
            k = tuple(k) if isinstance(k, tuple | list) else (k, k)
            stride = opts.get("stride") or k
            pool_out = out[0] if isinstance(out, tuple) else out
            taps = ((0, k[0] - 1), (0, k[1] - 1))
            self._geom(pool_out, args[0], stride, opts.get("padding", 0), 1, taps)
        elif isinstance(out, torch.Tensor) and out.dim() == 4:
            ins = list(args[0]) if name == "cat" else list(args)
            known = [self.info[id(t)] for t in ins if id(t) in self.info]
            if known:
                self.info[id(out)] = (
                    known[0][0],
                    tuple(min(k[1][a] for k in known) for a in (0, 1)),
                    tuple(max(k[2][a] for k in known) for a in (0, 1)),
                    out,
                )
        return out


def receptive_field(model: ChainModel, size: int = 64) -> tuple[int, int]:
    x = torch.randn(1, model.in_chans, size, size)
    tracer = _ReceptiveField(x)
    with tracer, torch.no_grad():
        feats = model.eval().forward_features(x)
    _, lo, hi, _ = tracer.info[id(feats)]
    return hi[0] - lo[0] + 1, hi[1] - lo[1] + 1


def test_receptive_field_tracer_on_known_net() -> None:
    # ResNet-50 (torchvision v1.5) has a theoretical receptive field of 427 pixels,
    # ResNet-18 of 435; worked by hand in the model card README.
    assert receptive_field(build("resnet50")) == (427, 427)
    assert receptive_field(build("resnet18")) == (435, 435)


CARD_FILES = sorted(CARDS.glob("*.yaml"))


def test_cards_exist() -> None:
    names = {p.stem for p in CARD_FILES}
    assert {"resnet50", "resnet110-v2", "amoebanet-d-18-256"} <= names


@pytest.mark.parametrize("path", CARD_FILES, ids=lambda p: p.stem)
def test_card_numbers_match_the_model(path: Path) -> None:
    card = yaml.safe_load(path.read_text())
    assert card["name"] == path.stem
    kwargs = card.get("kwargs") or {}
    with torch.device("meta"):
        model = create_model(card["name"], **kwargs)
    assert isinstance(model, ModelBase)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert card["parameters"] == trainable
    assert card["total_stride"] == model.total_stride
    assert card["num_features"] == model.num_features
    if isinstance(model, ChainModel) and card["name"] not in OWN_TESTS:
        # The receptive field depends on geometry only, so a tiny-width twin measures it.
        # (The tracer follows 2-D chains; the U-Net and 3-D cards say why they leave it out.)
        tiny = build(card["name"], **kwargs)
        assert card["receptive_field"] == receptive_field(tiny)[0]
    else:
        assert "receptive_field" not in card
    dims = model.dims
    if dims == 2:
        assert {8192, 16384} <= set(card["plans"])
    for size, plan in card["plans"].items():
        grid = plan["spatial_grid"]
        assert len(grid) == dims and plan["pipeline_stages"] >= 1 and plan["reason"]
        # Tiles must align to the total stride so every strided layer splits evenly.
        for g in grid:
            assert int(size) % (g * model.total_stride) == 0, (size, grid)
