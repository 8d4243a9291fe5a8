"""1-D spatial core without processes: the 1-D grid's spelling and layout, 1-D window
geometry, which BatchNorm1d sees tiles, the watch on 3-D tiles, and the one-line refusals.

The multi-rank exactness of every 1-D layer (and of a whole 1-D CNN) is the ``L2``/``L3``
layer sweep of ``tests/test_volume_mpi.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.functional import Resample, Site, site_of
from hyfi_imaging.parallel.geometry import LayerGeom, layer_geom, padded_hw
from hyfi_imaging.parallel.halo import Neighbours
from hyfi_imaging.parallel.layout import Layout, grid_text
from hyfi_imaging.parallel.spatial import (
    SpatialBatchNorm1d,
    SpatialConv1d,
    SpatialGlobalAvgPool1d,
    spatialize,
)
from hyfi_imaging.train.config import ParallelConfig


@pytest.mark.parametrize(("text", "grid"), [("L4", (4,)), (" l 3 ", (3,)), ("L1", (1,))])
def test_a_1d_grid_is_spelled_with_its_axis(text: str, grid: tuple[int, ...]) -> None:
    assert Layout.parse_grid(text) == grid
    assert Layout.parse_grids(text) == (grid,)
    assert ParallelConfig.model_validate({"spatial": text}).layout().sp == grid


def test_a_bare_number_is_square_as_sizes_are() -> None:
    """One vocabulary (:mod:`hyfi_imaging.shapes`): ``2`` is 2x2 as ``512`` is 512x512; a 1-D
    grid is ``L4`` (``--spatial 4`` read 4x1 before, while ``--image-size 512`` read 512x1)."""
    assert Layout.parse_grid("2") == (2, 2)
    assert ParallelConfig.model_validate({"spatial": "2"}).layout().sp == (2, 2)
    assert ParallelConfig.model_validate({"spatial": 2}).layout().sp == (2, 2)


@pytest.mark.parametrize("text", ["L", "Lx2", "L2x2", "2L", "L-1", "L2.5"])
def test_bad_1d_grids_are_refused_in_one_line(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        Layout.parse_grid(text)
    assert "\n" not in str(err.value) and "L4" in str(err.value)


def test_a_1d_layout_has_one_spatial_mesh_axis() -> None:
    lay = Layout(dp=2, sp=(3,))
    assert lay.world_size == 6 and lay.sp_size == 3
    assert lay.spatial_axes == ("sx",) and lay.mesh_dims == ("dp", "pp", "sx")
    assert lay.shape == (2, 1, 3)
    assert lay.describe() == "dp=2 x pp=1 x sp=L3" and grid_text((3,)) == "L3"
    assert [lay.coords(r) for r in range(6)][4] == (1, 0, 1)
    assert all(lay.rank_of(*lay.coords(r)) == r for r in range(6))
    with pytest.raises(ConfigError, match="dp\\*pp\\*gl = 5"):
        lay.check_world(5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sp": (0,)}, "sp length must be a positive integer"),
        ({"sp": ()}, "must have 1"),
        ({"pp": 2, "grids": ((2,), (1,))}, "per-stage grids are 2-D"),
    ],
)
def test_bad_1d_layouts_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Layout(**kwargs)


def test_1d_window_geometry_and_padding() -> None:
    assert layer_geom(nn.Conv1d(2, 2, 5, stride=2, padding=2, dilation=2)) == (
        LayerGeom(5, 2, 2, 2),
    )
    same = layer_geom(nn.Conv1d(1, 1, 4, padding="same"))
    assert [(g.padding, g.pad_end) for g in same] == [(1, 2)]  # the odd pixel at the end
    assert layer_geom(nn.MaxPool1d(3, 2, 1, dilation=2)) == (LayerGeom(3, 2, 1, 2),)
    assert layer_geom(nn.AvgPool1d(3, 2, 1)) == (LayerGeom(3, 2, 1),)
    with pytest.raises(ConfigError, match="AvgPool1d with ceil_mode=True"):
        layer_geom(nn.AvgPool1d(3, 2, 1, ceil_mode=True))
    assert padded_hw((37,), (2,), 2) == (40,) and padded_hw((37,), (3,), 4) == (48,)


def test_1d_sites_global_pools_and_linear_interpolation() -> None:
    x = torch.empty(2, 3, 10, device="meta")
    assert site_of(F.adaptive_avg_pool1d, (x, 1), {}) == Site("avg", True, True)
    assert site_of(torch.mean, (x, 2), {}) == Site("avg", False, False)
    res = site_of(F.interpolate, (x,), {"scale_factor": 2, "mode": "linear"})
    assert isinstance(res, Resample) and res.linear
    # A 2-D pool of a signal is no global pool of it.
    assert site_of(F.adaptive_avg_pool2d, (x, 1), {}) is None


def _spatialize_1d(model: nn.Module, grid: tuple[int, ...] = (2,)) -> Any:
    return spatialize(
        model, grid=grid, tile=(0,) * len(grid), neighbours=Neighbours(), group=None,  # type: ignore[arg-type]
        in_chans=2,
    )  # fmt: skip


def _cnn1d() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv1d(2, 4, 3, padding=1), nn.BatchNorm1d(4), nn.ReLU(), nn.AdaptiveAvgPool1d(1),
        nn.Flatten(), nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 3),
    )  # fmt: skip


def test_only_the_batchnorm1d_on_the_signal_becomes_spatial() -> None:
    model = _cnn1d()
    ctx = _spatialize_1d(model)
    assert type(model[0]) is SpatialConv1d and type(model[1]) is SpatialBatchNorm1d
    assert type(model[3]) is SpatialGlobalAvgPool1d
    assert type(model[6]) is nn.BatchNorm1d  # the head's, on pooled (N, C) features
    assert ctx.tile_param_names == {"0.weight", "0.bias", "1.weight", "1.bias"}


def test_a_head_batchnorm1d_keeps_working_on_2d_and_3d_grids() -> None:
    for grid, conv, pool in (
        ((1, 2), nn.Conv2d, nn.AdaptiveAvgPool2d),
        ((2, 1, 2), nn.Conv3d, nn.AdaptiveMaxPool3d),
    ):
        model = nn.Sequential(
            conv(2, 4, 3, padding=1), pool(1), nn.Flatten(), nn.BatchNorm1d(4), nn.Linear(4, 2)
        )
        ctx = spatialize(
            model, grid=grid, tile=(0,) * len(grid), neighbours=Neighbours(), group=None,  # type: ignore[arg-type]
            in_chans=2,
        )  # fmt: skip
        assert type(model[3]) is nn.BatchNorm1d
        assert "3.weight" not in ctx.tile_param_names


@pytest.mark.parametrize(
    ("model", "grid", "match"),
    [
        (nn.Sequential(nn.Conv1d(2, 2, 3)), (1, 2), r"module '0' \(Conv1d\): is a 1-D layer"),
        (
            nn.Sequential(nn.ConvTranspose1d(2, 2, 3)),
            (2, 1, 2),
            r"\(ConvTranspose1d\): is a 1-D layer .*3-D grid",
        ),
        (nn.Sequential(nn.MaxPool2d(2)), (2,), r"\(MaxPool2d\): is a 2-D layer .*1-D grid"),
        (nn.Sequential(nn.AvgPool3d(2)), (2,), r"is a 3-D layer"),
        (nn.Sequential(nn.InstanceNorm1d(2)), (2,), "has no spatial"),
        (nn.Sequential(nn.ReflectionPad1d(1)), (2,), "has no spatial"),
        (nn.Sequential(nn.AdaptiveMaxPool1d(3)), (2,), "depends on the whole image"),
        (nn.Sequential(nn.MaxPool1d(2, return_indices=True)), (2,), "return_indices"),
        (nn.Sequential(nn.Conv1d(2, 2, 3, padding_mode="reflect")), (2,), "padding_mode"),
        (nn.Sequential(type("MyBN", (nn.BatchNorm1d,), {})(2)), (2,), "BatchNorm1d subclass"),
    ],
)
def test_1d_refusals_are_one_line(model: nn.Module, grid: tuple[int, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        spatialize(
            model, grid=grid, tile=(0,) * len(grid), neighbours=Neighbours(), group=None,  # type: ignore[arg-type]
            in_chans=2,
        )  # fmt: skip
    assert "\n" not in str(err.value)


class _Call(nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


@pytest.mark.parametrize(
    ("fn", "op"),
    [
        (lambda x: torch.flip(x, (-1,)), "aten.flip"),
        (lambda x: F.conv1d(x, torch.zeros(2, 2, 3, device=x.device)), "aten.convolution"),
        (lambda x: F.max_pool1d(x, 2), "max_pool2d_with_indices"),
        (lambda x: x.cumsum(-1), "aten.cumsum"),
        (lambda x: F.interpolate(x, scale_factor=0.5, mode="area"), "adaptive"),
        (lambda x: F.pad(x, (1, 1), mode="replicate"), "replication_pad1d"),
    ],
)
def test_watch_refuses_pixel_mixing_functions_on_signals(fn: Any, op: str) -> None:
    with pytest.raises(ConfigError, match=op) as err:
        _spatialize_1d(nn.Sequential(nn.Conv1d(2, 2, 3), _Call(fn)))
    assert "module '1'" in str(err.value) and "\n" not in str(err.value)


def test_spatialize_refuses_deep_halos_on_1d_grids() -> None:
    with pytest.raises(ConfigError, match="1-D grid; deep halos are implemented for 2-D"):
        spatialize(
            nn.Sequential(nn.Conv1d(2, 2, 3)), grid=(2,), tile=(0,), neighbours=Neighbours(),
            group=None, halo_depth=2,  # type: ignore[arg-type]
        )  # fmt: skip
