"""The functional-op watch: a pixel-mixing function in a model's forward is refused, never run wrong.

Each model below is spatialized through the public ``spatialize`` (no process
group is needed to build the spatial form). Refused cases must name the module
path and the op; allowed cases act per pixel or pool with modules. Their
exactness on real grids is in ``test_global_pool_mpi.py`` (squeeze-excite).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.halo import Neighbours
from hyfi_imaging.parallel.spatial import spatialize

Fn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class Net(nn.Module):
    """conv -> ``body`` (the user's functional code) -> module global pool -> linear."""

    def __init__(self, body: Fn) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.body = body
        self.excite = nn.Conv2d(4, 4, 1)
        self.squeeze = nn.AdaptiveAvgPool2d(1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(self, self.conv(x))
        if x.dim() == 4 and x.shape[-1] > 1:
            x = self.pool(x)
        return self.fc(torch.flatten(x, 1))


def _spatialize(body: Fn) -> object:
    return spatialize(Net(body), grid=(1, 2), tile=(0, 0), neighbours=Neighbours(), group=None)


def _written(h: int, device: torch.device) -> torch.Tensor:
    """An empty (1, 1, h, 1) map whose rows are written one by one with their coordinates."""
    out = torch.empty(1, 1, h, 1, device=device)
    out[:, :, : h // 2].copy_(torch.zeros(1, 1, h // 2, 1, device=device))
    out[:, :, h // 2 :].copy_(torch.ones(1, 1, h - h // 2, 1, device=device))
    return out


REFUSED: dict[str, tuple[Fn, str]] = {
    "x.sum()": (lambda m, x: x * x.sum(), "aten.sum"),
    "x.std((2, 3))": (lambda m, x: x.std((2, 3)), "aten.std"),
    "mean over one spatial dim": (lambda m, x: x.mean(3), "aten.mean over dims [3]"),
    # (N, C, H, W) over channels and rows: not the channels-last global mean it looks like
    "mean over channels and rows": (lambda m, x: x.mean((1, 2)), "aten.mean over dims [1, 2]"),
    "F.max_pool2d with indices": (
        lambda m, x: F.max_pool2d(x, 2, return_indices=True)[0],
        "max_pool2d_with_indices",
    ),
    "F.conv_transpose2d": (
        lambda m, x: F.conv_transpose2d(x, m.excite.weight, stride=2),
        "convolution",
    ),
    "F.conv2d of a volume's slices": (
        lambda m, x: F.conv3d(x[:, :, None], m.excite.weight[..., None]).squeeze(2),
        "convolution",
    ),
    "torch.flip": (lambda m, x: torch.flip(x, (3,)), "aten.flip"),
    "torch.roll": (lambda m, x: torch.roll(x, 1, 3), "aten.roll"),
    "torch.flip of channels and rows": (lambda m, x: torch.flip(x, (1, 2)), "aten.flip"),
    "torch.roll of the flattened map": (lambda m, x: torch.roll(x, 1), "aten.roll"),
    # linalg_vector_norm's second argument is its order, not its dims (an order of 1 was read
    # as "over channels" and each tile normalised by its own L1 norm)
    "an L1 norm over the image": (
        lambda m, x: x / x.norm(p=1, dim=(2, 3), keepdim=True),
        "aten.linalg_vector_norm over dims [2, 3]",
    ),
    "an L0 norm over the columns": (
        lambda m, x: x * torch.linalg.vector_norm(x, ord=0, dim=3, keepdim=True),
        "aten.linalg_vector_norm over dims [3]",
    ),
    "bicubic": (lambda m, x: F.interpolate(x, scale_factor=2, mode="bicubic"), "bicubic"),
    "antialias": (
        lambda m, x: F.interpolate(x, scale_factor=0.5, mode="bilinear", antialias=True),
        "antialias",
    ),
    "area": (lambda m, x: F.interpolate(x, size=(7, 9), mode="area"), "whole image's size"),
    # PyTorch writes it as copies into a new tensor: the watch must not lose the tile there
    "circular pad": (lambda m, x: F.pad(x, (1, 1, 1, 1), mode="circular"), "into part of"),
    "reflecting crop": (lambda m, x: F.pad(x, (-1, 1, 0, 0), mode="reflect"), "reflection_pad2d"),
    "pad of channels": (lambda m, x: F.pad(x, (0, 0, 0, 0, 1, 1))[:, :4], "constant_pad_nd"),
    "flatten spatial": (lambda m, x: x.flatten(2).mean(2), "reshapes the tiled feature map"),
    "crop": (lambda m, x: x[..., 1:, :], "aten.slice"),
    "group norm": (lambda m, x: F.group_norm(x, 2), "group_norm"),
    # The tile's rows are not the image's columns: refused, before and at the next layer.
    "H and W swapped": (lambda m, x: m.excite(x.transpose(2, 3)), "swaps the spatial dims"),
    "a layer on a permuted map": (
        lambda m, x: m.excite(x.permute(0, 2, 3, 1).permute(0, 1, 3, 2)),
        "module 'excite': Conv2d takes a map whose tiled dims are (1, 3)",
    ),
    # Tensors sized from x.shape but not computed from x: a tile's, the same on every tile.
    "coordinates from the shape": (
        lambda m, x: x + torch.linspace(-1, 1, x.shape[2], device=x.device).view(1, 1, -1, 1),
        "aten.add with a tensor of shape (1, 1, 512, 1) combines the tiled map",
    ),
    "an embedding resized to the map": (
        lambda m, x: (
            x + F.interpolate(m.excite.weight.view(1, 4, 2, 2), size=x.shape[-2:], mode="bilinear")
        ),
        "not computed from it",
    ),
    "a count map pooled from torch.ones": (
        lambda m, x: (
            F.avg_pool2d(x, 3, 1, 1)
            / F.avg_pool2d(torch.ones(1, 1, *x.shape[-2:], device=x.device), 3, 1, 1)
        ),
        "not computed from it",
    ),
    "coordinates written into an empty map": (
        lambda m, x: x + _written(x.shape[-2], x.device),
        "not computed from it",
    ),
    # The sum is global; a count read off x.shape is the tile's.
    "a global sum by the map's pixel count": (
        lambda m, x: x * torch.sigmoid(x.sum((2, 3), keepdim=True) / (x.shape[2] * x.shape[3])),
        "aten.div of a global reduction by 262144",
    ),
    "a global mean times the map's pixel count": (
        lambda m, x: x.mean((2, 3)) * x[0, 0].numel(),
        "aten.mul of a global reduction by 262144",
    ),
    # Random draws per pixel of a tile (the watch also runs the model in training mode).
    "dropout on the map": (lambda m, x: F.dropout(x, 0.5, m.training), "per pixel"),
    "per-pixel random mask": (
        lambda m, x: x * (torch.rand(x.shape, device=x.device) < 0.9),
        "aten.mul of a random mask draws random numbers per pixel",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_pixel_mixing_functions_are_refused_by_path_and_op(case: str) -> None:
    body, op = REFUSED[case]
    with pytest.raises(ConfigError, match=r"^module '(Net|body|excite)'") as err:
        _spatialize(body)
    message = str(err.value)
    assert op in message and "\n" not in message, message


ALLOWED: dict[str, Fn] = {
    "identity": lambda m, x: x,
    "activations": lambda m, x: F.hardswish(torch.sigmoid(x) * F.silu(x) + F.gelu(x)),
    "channel mean": lambda m, x: x - x.mean(1, keepdim=True),
    "channel softmax": lambda m, x: torch.softmax(x, 1),
    "LayerNorm2d (per pixel)": lambda m, x: F.layer_norm(x.permute(0, 2, 3, 1), (4,)).permute(
        0, 3, 1, 2
    ),
    "channel concat and slice": lambda m, x: torch.cat([x, x], 1)[:, :4],
    "channel reshape": lambda m, x: x.view(x.shape[0], 2, 2, *x.shape[-2:]).flatten(1, 2),
    "full slice": lambda m, x: x[..., :, :],
    "channel split and chunk": lambda m, x: torch.cat(
        [*torch.split(x, [1, 3], 1)[::-1], *x.chunk(2, 1)], 1
    )[:, :4],
    # Tensors made without tile data that hold one value along the spatial dims.
    "a constant map": lambda m, x: x + (torch.zeros(1, 1, *x.shape[-2:], device=x.device) + 1),
    "a pooled value resized to the map (ASPP)": lambda m, x: torch.cat(
        [x, F.interpolate(m.squeeze(x), size=x.shape[-2:], mode="bilinear")], 1
    )[:, :4],
    "a pooled value expanded": lambda m, x: x * m.squeeze(x).expand_as(x),
    "channels last and back": lambda m, x: x.permute(0, 2, 3, 1).permute(0, 3, 1, 2),
    "channel L2 normalisation": lambda m, x: F.normalize(x, dim=1),
    "channel L1 norm": lambda m, x: x * x.norm(p=1, dim=1, keepdim=True),
    "channel flip and roll": lambda m, x: x.flip(1) + x.roll(1, 1),
}


@pytest.mark.parametrize(
    "body",
    [
        lambda m, x: F.adaptive_avg_pool2d(x, 1),
        lambda m, x: x.mean((2, 3)),
        lambda m, x: x.amax((-2, -1), keepdim=True),
        lambda m, x: F.adaptive_max_pool2d(x, (1, 1)),
        lambda m, x: x * torch.sigmoid(x.sum((2, 3), keepdim=True)),
        lambda m, x: x.permute(0, 2, 3, 1).mean((1, 2)),  # channels-last (timm's MambaOut head)
        lambda m, x: x.permute(0, 2, 3, 1).amax((1, 2), keepdim=True).flatten(1),
    ],
)
def test_global_reductions_written_as_functions_get_their_spatial_form(body: Fn) -> None:
    ctx = _spatialize(body)
    assert ctx.functional_sites == {"#0"}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "body",
    [
        lambda m, x: F.interpolate(x, scale_factor=2, mode="bilinear"),
        lambda m, x: F.interpolate(x, size=(33, 31), mode="bilinear", align_corners=True),
        lambda m, x: F.interpolate(x, size=(33, 31)),
        lambda m, x: F.interpolate(x, scale_factor=(0.5, 1.5), mode="nearest-exact"),
        lambda m, x: F.pad(x, (1, 1, 1, 1)),
        lambda m, x: F.pad(x, (2, -1), value=0.5),
        lambda m, x: nn.Upsample(scale_factor=2)(x),
        lambda m, x: F.pad(x, (1, 1, 1, 1), mode="reflect"),  # timm's blur pool
        lambda m, x: nn.ReflectionPad2d((2, 0, 1, 1))(x),
        lambda m, x: F.pad(x, (1, 1, 0, 0), mode="replicate"),
    ],
)
def test_pads_and_interpolations_get_their_spatial_form(body: Fn) -> None:
    """Their exactness on real grids: ``test_resample_mpi.py``."""
    ctx = _spatialize(body)
    assert len(ctx.functional_sites) == 1  # type: ignore[attr-defined]


#: Convolutions and pools written as functions: the spatial form of the nn layer of the same
#: arguments (exact on grids: test_zoo_mpi.py, "fn-windowed"), with the parameters they use.
WINDOWED: dict[str, tuple[Fn, set[str]]] = {
    "F.avg_pool2d": (lambda m, x: F.avg_pool2d(x, kernel_size=2, stride=2), set()),
    "F.max_pool2d": (lambda m, x: F.max_pool2d(x, 3, 1, 1), set()),
    "F.conv2d, a parameter": (
        lambda m, x: F.conv2d(x, m.excite.weight, m.excite.bias, stride=2),
        {"excite.weight", "excite.bias"},
    ),
    "F.conv2d, a buffer expanded (blur pool)": (
        lambda m, x: F.conv2d(x, torch.ones(1, 1, 3, 3).expand(4, 1, 3, 3) / 9, groups=4),
        set(),
    ),
}


@pytest.mark.parametrize("case", sorted(WINDOWED))
def test_windowed_functions_get_their_spatial_form(case: str) -> None:
    body, params = WINDOWED[case]
    ctx = _spatialize(body)
    assert ctx.functional_sites == {"#0"}  # type: ignore[attr-defined]
    # a parameter a functional convolution uses on the tiles: its gradient is summed over them
    assert ctx.tile_param_names == {"conv.weight", "conv.bias", *params}  # type: ignore[attr-defined]
    # the stride of a functional pool or convolution counts in the tiles' alignment
    assert ctx.align == (2 if "stride=2" in case or "avg" in case or "a parameter" in case else 1)  # type: ignore[attr-defined]


@pytest.mark.parametrize("case", sorted(ALLOWED))
def test_per_pixel_functions_are_allowed(case: str) -> None:
    ctx = _spatialize(ALLOWED[case])
    assert ctx.tile_param_names == {"conv.weight", "conv.bias"}  # type: ignore[attr-defined]


#: Masks per sample or per channel: exact when every tile draws alike (the module drawing
#: them synchronises the generator over the tiles, see parallel/randomness.py).
DRAWS: dict[str, Fn] = {
    "drop-path": lambda m, x: x * x.new_empty((x.shape[0], 1, 1, 1)).bernoulli_(0.8) / 0.8,
    "channel dropout": lambda m, x: F.dropout2d(x, 0.5, m.training),
    "dropout after the pool": lambda m, x: F.dropout(m.pool(x), 0.5, m.training),
}


@pytest.mark.parametrize("case", sorted(DRAWS))
def test_random_masks_per_sample_or_channel_draw_alike_on_every_tile(case: str) -> None:
    ctx = _spatialize(DRAWS[case])
    assert ctx.random_modules == {""}  # type: ignore[attr-defined]  # Net's own forward draws
    assert len(ctx.rng_hooks) == 1  # type: ignore[attr-defined]


def test_squeeze_excite_keeps_its_excitation_plain_and_sums_its_gradients() -> None:
    def squeeze_excite(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(m.excite(m.squeeze(x)))

    net = Net(squeeze_excite)
    ctx = spatialize(net, grid=(1, 2), tile=(0, 0), neighbours=Neighbours(), group=None)
    assert type(net.excite) is nn.Conv2d  # acts on the pooled vector: no spatial form
    assert type(net.conv).__name__ == "SpatialConv2d"
    # The excitation's output is used again on each tile: its gradients are per-tile shares.
    assert ctx.tile_param_names == {"conv.weight", "conv.bias", "excite.weight", "excite.bias"}
    assert ctx.rejoined_pools == {"squeeze"}


def test_a_pool_used_by_both_the_tiles_and_the_head_is_refused() -> None:
    class Both(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.conv(x)
            s = self.pool(x)
            y = self.pool(x * torch.sigmoid(s))
            return self.fc(torch.flatten(y + s, 1))

    with pytest.raises(ConfigError, match="both on the tiles and by the head"):
        spatialize(
            Both(lambda m, x: x), grid=(1, 2), tile=(0, 0), neighbours=Neighbours(), group=None
        )


def test_a_parameter_used_on_the_tiles_and_by_the_head_is_refused() -> None:
    """One PReLU in the body and the head, or a CAM (the classifier's weight applied to the
    map): the gradient is a tile's share plus a whole one, and summing it over the tiles
    counted the head's once per tile (0.64 relative on 1x2, 1.0 for a CAM's weight)."""

    class Reused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.act = nn.Conv2d(3, 4, 3, padding=1), nn.PReLU()
            self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.fc(torch.flatten(self.pool(self.act(self.conv(x))), 1)))

    class Cam(Reused):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            f = torch.relu(self.conv(x))
            return self.fc(torch.flatten(self.pool(f), 1)), F.conv2d(
                f, self.fc.weight[..., None, None]
            )

    for net, name in ((Reused(), "act.weight"), (Cam(), "fc.weight")):
        with pytest.raises(ConfigError, match=rf"^parameter '{name}': is used both on the tiles"):
            spatialize(net, grid=(1, 2), tile=(0, 0), neighbours=Neighbours(), group=None)

    class DetachedCam(Reused):  # the refusal's fix: the map takes no gradient to the weight
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            f = torch.relu(self.conv(x))
            w = self.fc.weight.detach()[..., None, None]
            return self.fc(torch.flatten(self.pool(f), 1)), F.conv2d(f, w)

    ctx = spatialize(DetachedCam(), grid=(1, 2), tile=(0, 0), neighbours=Neighbours(), group=None)
    assert "fc.weight" not in ctx.tile_param_names


class LayerNorm2d(nn.LayerNorm):
    """timm's channels-first LayerNorm: normalises each pixel over its channels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(
            x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias
        ).permute(0, 3, 1, 2)


class Shift(nn.Module):
    """A leaf module that mixes pixels through a function with no tiled form."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.roll(x, 1, -1)


class Scale(nn.Module):
    """A leaf module hyfi-imaging has never heard of, acting per pixel (layer scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(4, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


def test_unknown_modules_are_judged_by_what_they_do() -> None:
    def stack(*mods: nn.Module) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), *mods, nn.AdaptiveAvgPool2d(1))

    ctx = spatialize(stack(LayerNorm2d(4), Scale()), grid=(2, 1), tile=(0, 0),
                     neighbours=Neighbours(), group=None)  # fmt: skip
    # Both act on tiles, so their parameters' gradients are per-tile shares (summed).
    assert {"1.weight", "1.bias", "2.gamma"} <= ctx.tile_param_names
    with pytest.raises(ConfigError, match=r"^module '1': aten.roll"):
        spatialize(stack(Shift()), grid=(2, 1), tile=(0, 0), neighbours=Neighbours(), group=None)


def test_a_functional_pool_in_a_module_used_on_tiles_and_on_pooled_data_is_refused() -> None:
    class MeanScale(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * x.mean((2, 3), keepdim=True)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.scale = MeanScale()
            self.pool = nn.AdaptiveAvgPool2d(1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.scale(self.conv(x))  # on the tiles
            return self.scale(self.pool(y)).flatten(1)  # again, on the pooled vector

    with pytest.raises(ConfigError, match=r"^module 'scale'.*one call and on pooled data"):
        spatialize(Twice(), grid=(1, 2), tile=(0, 0), neighbours=Neighbours(), group=None)


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's norm + activation layer: BatchNorm, then its own ``drop`` and ``act`` modules."""

    def __init__(self, channels: int, drop: nn.Module) -> None:
        super().__init__(channels)
        self.drop, self.act = drop, nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                         self.training, 0.1, self.eps)  # fmt: skip
        return self.act(self.drop(x))


def test_a_norm_act_layer_gets_a_spatial_norm_and_its_drop_is_judged() -> None:
    def net(drop: nn.Module) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), BatchNormAct2d(4, drop),
                             nn.AdaptiveAvgPool2d(1))  # fmt: skip

    model = net(nn.Dropout2d(0.2))
    ctx = spatialize(model, grid=(1, 2), tile=(0, 0), neighbours=Neighbours(), group=None)
    assert type(model[1]).__name__ == "SpatialBatchNormAct2d"
    assert {"1.weight", "1.bias"} <= ctx.tile_param_names
    assert ctx.random_modules == {"1.drop"}
    # Its normalisation reads the traced size of its input (a regression: it once had none).
    ctx.set_image_size((8, 12))
    assert ctx.size_of("1") == (8, 12)
    # Dropout per pixel inside the layer (timm's drop_layer, e.g. DropBlock) is no longer hidden.
    with pytest.raises(ConfigError, match=r"^module '1.drop': aten.*per pixel"):
        spatialize(net(nn.Dropout(0.2)), grid=(1, 2), tile=(0, 0), neighbours=Neighbours(),
                   group=None)  # fmt: skip


class _Links(nn.Module):
    """Three 3x3 convolutions; what joins the second and third decides a deep halo's way."""

    def __init__(self, join: str) -> None:
        super().__init__()
        self.join = join
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.c = nn.Conv2d(4, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu_(self.bn(self.a(x)))  # per pixel, in place: a -> b is a link
        y = self.b(x)
        if self.join == "residual":
            y = y + x  # x is read twice, and two tiles meet: no link at all
        elif self.join == "residual_inplace":
            y += x  # the same, in place (torchvision's ResNet: ``out += identity``)
        elif self.join == "reused":
            return self.pool(self.c(F.relu(y)) + y)  # y is read twice: no link b -> c
        else:
            y = F.silu(y) * 2.0
        return self.pool(self.c(y))


@pytest.mark.parametrize(
    ("join", "links"),
    [
        ("pointwise", {"b": ("a", ("bn",)), "c": ("b", ())}),
        ("residual", {}),
        ("residual_inplace", {}),
        ("reused", {"b": ("a", ("bn",))}),
    ],
)
def test_deep_halo_links_follow_per_pixel_data_flow(
    join: str, links: dict[str, tuple[str, tuple[str, ...]]]
) -> None:
    """A deep halo may pass from a layer to the next only when nothing else sees the border."""
    from hyfi_imaging.parallel.spatial import _has_spatial_form, _is_carrier
    from hyfi_imaging.parallel.watch import watch_tiles

    use = watch_tiles(
        _Links(join).to("meta"), (1, 3, 16, 16), _has_spatial_form, carriers=_is_carrier
    )
    assert {k: v for k, v in use.links.items() if k in ("b", "c")} == links
    ctx = spatialize(
        _Links(join), grid=(1, 2), tile=(0, 0), neighbours=Neighbours(), group=None, halo_depth=3
    )
    runs = {
        "pointwise": [["a", "b", "c"]], "residual": [], "residual_inplace": [], "reused": [["a", "b"]]
    }  # fmt: skip
    assert ctx.deep_runs == runs[join]  # type: ignore[attr-defined]


class _OnCpu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.ones(1, 4, 1, 1, device="cpu")


def test_constants_made_in_forward_are_traced_or_their_module_named() -> None:
    """A constant made without a device (``torch.tensor([...])``) is made on the meta device
    of the tracing passes, as on the input's device in a real run (exact on grids:
    test_zoo_mpi.py, "fn-channels"); one made on another device is refused naming its module
    and the fix, not blamed on the image size."""
    ctx = _spatialize(lambda m, x: x * torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 4, 1, 1))
    assert ctx.tile_param_names == {"conv.weight", "conv.bias"}  # type: ignore[attr-defined]
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), _OnCpu())
    with pytest.raises(ConfigError, match=r"^model Sequential, module '1': fails") as err:
        spatialize(model, grid=(1, 2), tile=(0, 0), neighbours=Neighbours(), group=None)
    assert "make module '1' create its tensors on the input's device" in str(err.value)
    assert "give it an image size" not in str(err.value)


def test_input_channels_are_those_of_the_first_convolution_called() -> None:
    """A head registered before the stem (4 channels in, 8 at the head) was traced with 8
    channels and refused a valid size; a transposed first layer failed at the first step."""
    from hyfi_imaging.parallel.apply import input_channels

    class HeadFirst(nn.Module):
        def __init__(self, first: nn.Module) -> None:
            super().__init__()
            self.head = nn.Conv3d(8, 2, 1)  # registered first, called last
            self.enc = first

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.enc(x)))

    assert input_channels(HeadFirst(nn.Conv3d(4, 8, 3, padding=1))) == 4
    assert input_channels(HeadFirst(nn.ConvTranspose3d(5, 8, 2, stride=2))) == 5
    assert input_channels(nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU())) == 1
    assert input_channels(nn.Sequential(nn.BatchNorm2d(4))) == 3  # no convolution: 3
