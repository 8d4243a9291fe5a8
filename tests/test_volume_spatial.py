"""3-D spatial core without processes: geometry of 3-D layers, the watch on volumes, refusals.

The multi-rank exactness of every 3-D layer and model is ``tests/test_volume_mpi.py``;
here the pure and single-process parts: window geometry per axis, what the
functional-op watch lets through or refuses on a 5-D tile, and the one-line
refusals that come before any process group.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.functional import Resample, Site, site_of, source_coords
from hyfi_imaging.parallel.geometry import LayerGeom, layer_geom
from hyfi_imaging.parallel.halo import Neighbours
from hyfi_imaging.parallel.spatial import _has_spatial_form, spatialize
from hyfi_imaging.parallel.watch import watch_tiles


def test_layer_geom_gives_one_window_per_axis_of_3d_layers() -> None:
    conv = nn.Conv3d(2, 2, (3, 5, 1), stride=(1, 2, 1), padding=(1, 2, 0), dilation=(2, 1, 1))
    assert layer_geom(conv) == (LayerGeom(3, 1, 1, 2), LayerGeom(5, 2, 2), LayerGeom(1, 1, 0))
    assert layer_geom(nn.MaxPool3d(2)) == (LayerGeom(2, 2),) * 3
    assert layer_geom(nn.AvgPool3d(3, 2, 1)) == (LayerGeom(3, 2, 1),) * 3
    same = layer_geom(nn.Conv3d(1, 1, 2, padding="same"))
    assert [(g.padding, g.pad_end) for g in same] == [(0, 1)] * 3  # the odd pixel at the end


class _Volume(nn.Module):
    def __init__(self, tail: nn.Module | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)
        self.tail = tail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return self.tail(x) if self.tail is not None else x


class _Fn(nn.Module):
    def __init__(self, fn: object) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)  # type: ignore[operator, no-any-return]


SHAPE = (1, 2, 24, 20, 28)


@pytest.mark.parametrize(
    ("fn", "op"),
    [
        (lambda x: torch.flip(x, (2,)), "aten.flip"),
        (lambda x: F.max_pool3d(x, 2), "aten.max_pool3d_with_indices"),
        (lambda x: F.pad(x, (1, 1, 1, 1, 1, 1), mode="replicate"), "replication_pad3d"),
        (lambda x: x[..., 1:, :, :], "aten.slice"),
        (lambda x: x.flatten(2).mean(2), "reshapes the tiled feature map"),
        (lambda x: x.mean((3, 4)), "aten.mean"),
    ],
)
def test_watch_refuses_pixel_mixing_ops_on_volumes(fn: object, op: str) -> None:
    with pytest.raises(ConfigError, match="module 'tail'") as err:
        watch_tiles(_Volume(_Fn(fn)).to("meta"), SHAPE, _has_spatial_form)
    assert op in str(err.value) and "\n" not in str(err.value)


def test_watch_lets_volume_sites_through() -> None:
    use = watch_tiles(
        _Volume(_Fn(lambda x: F.interpolate(x, scale_factor=2, mode="trilinear"))).to("meta"),
        SHAPE,
        _has_spatial_form,
    )
    assert use.functional_sites == {"tail#0"}
    use = watch_tiles(
        _Volume(_Fn(lambda x: x.mean((2, 3, 4)))).to("meta"), SHAPE, _has_spatial_form
    )
    assert use.functional_sites == {"tail#0"}
    head = nn.Sequential(nn.Flatten(), nn.Linear(2 * 24 * 20 * 28, 3))
    use = watch_tiles(_Volume(head).to("meta"), SHAPE, _has_spatial_form)
    assert "tail.0" in use.tile_modules and "tail.1.weight" not in use.tile_params


def test_volume_sites_and_their_source_coordinates() -> None:
    x = torch.empty(1, 2, 4, 5, 6)
    assert site_of(torch.Tensor.mean, (x, (2, 3, 4)), {}) == Site("avg", False, False)
    assert site_of(torch.Tensor.mean, (x, (3, 4)), {}) is None
    assert site_of(F.adaptive_max_pool3d, (x, 1), {}) == Site("max", True, True)
    assert site_of(F.adaptive_max_pool2d, (x, 1), {}) is None  # a 2-D pool of a volume
    res = site_of(F.interpolate, (x,), {"scale_factor": 2, "mode": "trilinear"})
    assert isinstance(res, Resample) and res.linear
    coords = source_coords(res, (4, 5, 6), (8, 10, 12))
    assert [len(c) for c in coords] == [8, 10, 12]
    assert coords[0][:3] == [0.0, 0.25, 0.75]  # align_corners=False: (j + 0.5) / 2 - 0.5, clamped
    pad = Resample("pad", (("pad", (1, 0, 0, 2, 3, 0)), ("value", 0.0)))
    z, y, w = source_coords(pad, (4, 5, 6), (7, 7, 7))
    assert z[:4] == [None, None, None, 0.0] and y[-2:] == [None, None] and w[:2] == [None, 0.0]


def _spatialize_3d(model: nn.Module, **kwargs: object) -> None:
    spatialize(model, grid=(2, 1, 2), tile=(0, 0, 0), neighbours=Neighbours(), group=None, **kwargs)  # type: ignore[arg-type]


def test_spatialize_refuses_layers_of_the_other_dimensionality_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"module '0' \(Conv2d\).*is a 2-D layer") as err:
        _spatialize_3d(nn.Sequential(nn.Conv2d(2, 2, 3)))
    assert "GZxGYxGX" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"module '0' \(MaxPool3d\).*is a 3-D layer"):
        spatialize(
            nn.Sequential(nn.MaxPool3d(2)), grid=(2, 2), tile=(0, 0), neighbours=Neighbours(),
            group=None,
        )  # fmt: skip


def test_deep_halos_on_3d_grids_join_linked_windowed_layers() -> None:
    """Two 3x3x3 convolutions through a BatchNorm3d share one exchange (exactness and the
    message count are tests/test_deep_halo_mpi.py's)."""
    model = nn.Sequential(
        nn.Conv3d(2, 2, 3, padding=1), nn.BatchNorm3d(2), nn.ReLU(), nn.Conv3d(2, 2, 3, padding=1)
    )
    ctx = spatialize(
        model, grid=(2, 1, 2), tile=(0, 0, 0), neighbours=Neighbours(), group=None,
        in_chans=2, halo_depth=2,
    )  # fmt: skip
    assert ctx.deep_runs == [["0", "3"]]


def test_a_transposed_convolution_without_bias_returns_no_view() -> None:
    """FSDP2 drops its pre-backward hook when an in-place op follows a module returning a view
    (it warns): the spatial form's cropped output is a tensor of its own."""
    up = nn.ConvTranspose3d(2, 2, 2, stride=2, bias=False)
    _spatialize_3d(nn.Sequential(up))
    up.hyfi_ctx.set_image_size((4, 4, 4))  # type: ignore[operator]
    out = up(torch.randn(1, 2, 2, 4, 2))
    assert not out._is_view() and out.shape == (1, 2, 4, 8, 4)


def test_hyfi_verify_refuses_a_grid_that_does_not_match_the_volume() -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "hyfi_imaging.cli.verify", "--model", "unet3d",
         "--image-size", "16x16x16", "--spatial", "2x2"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "\n" not in err, err
    assert "has 2 factors for an image size of 3 axes" in err and "GZxGYxGX" in err
