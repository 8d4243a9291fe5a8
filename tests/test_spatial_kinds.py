"""The layer-kind registry (``parallel/spatial/kinds.py``) and what it feeds, without processes.

The tables the spatial core reads are derived from the records; these tests pin
what they hold (the tables written out by hand before the registry), so a record
changes them only on purpose. InstanceNorm2d/3d are the kinds added as one file
plus one record: here their swap and refusals; their float64 exactness against
one process is ``tests/mpi/layer_cases.py`` (``in*``, every 2-D grid of
``tests/test_spatial_mpi.py``) and ``tests/mpi/volume_cases.py`` (3-D grids).
"""

from __future__ import annotations

import pytest
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.halo import Neighbours
from hyfi_imaging.parallel.spatial import (
    SpatialBatchNorm2d,
    SpatialConv2d,
    SpatialInstanceNorm2d,
    SpatialInstanceNorm3d,
    SpatialMaxPool2d,
    kinds,
    spatialize,
)
from hyfi_imaging.parallel.spatial.carry import _is_carrier
from hyfi_imaging.parallel.spatial.checks import _UNSUPPORTED
from hyfi_imaging.parallel.streaming import _CONVS, _MAX_POOLS, _NORMS


def test_every_record_is_one_exact_class_and_its_spatial_subclass() -> None:
    layers = [k.layer for k in kinds.KINDS]
    assert len(layers) == len(set(layers)) == 24
    for k in kinds.KINDS:
        assert issubclass(k.spatial, k.layer), k
        assert k.spatial.__module__ == f"hyfi_imaging.parallel.spatial.{k.family}", k


def test_the_derived_tables_hold_what_the_hand_written_ones_held() -> None:
    assert set(kinds._WINDOWED) == {
        nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
        nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    }  # fmt: skip
    assert set(kinds._DIMS[1]) == {
        nn.Conv1d, nn.ConvTranspose1d, nn.MaxPool1d, nn.AvgPool1d, nn.AdaptiveAvgPool1d,
        nn.AdaptiveMaxPool1d,
    }  # fmt: skip
    assert set(kinds._DIMS[2]) == {
        nn.Conv2d, nn.ConvTranspose2d, nn.MaxPool2d, nn.AvgPool2d, nn.BatchNorm2d,
        nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.InstanceNorm2d,
    }  # fmt: skip
    assert nn.GroupNorm in kinds._SWAP and nn.BatchNorm1d in kinds._SWAP
    assert len(kinds._SWAP) == 18 and len(kinds._GLOBAL_POOLS) == 6
    assert [c.__name__ for c in kinds._DEEPABLE] == [
        "SpatialConv2d", "SpatialConv3d", "SpatialMaxPool2d", "SpatialMaxPool3d",
        "SpatialAvgPool2d", "SpatialAvgPool3d",
    ]  # fmt: skip
    assert _is_carrier(nn.BatchNorm3d(2)) and not _is_carrier(nn.InstanceNorm2d(2))
    assert (
        (nn.Conv2d, SpatialConv2d),
        (nn.MaxPool2d, SpatialMaxPool2d),
        (nn.BatchNorm2d, SpatialBatchNorm2d),
    ) == (_CONVS, _MAX_POOLS, _NORMS)
    # The refusals by name lose exactly the classes that gained a record.
    assert nn.InstanceNorm1d in _UNSUPPORTED and len(_UNSUPPORTED) == 20
    assert nn.InstanceNorm2d not in _UNSUPPORTED and nn.InstanceNorm3d not in _UNSUPPORTED


def _spatialize(model: nn.Module, grid: tuple[int, ...]) -> None:
    spatialize(
        model, grid=grid, tile=(0,) * len(grid), neighbours=Neighbours(), group=None, in_chans=2
    )


def test_instance_norms_become_their_spatial_form_with_the_same_state() -> None:
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.InstanceNorm2d(2, affine=True))
    keys = list(model.state_dict())
    _spatialize(model, (2, 2))
    assert type(model[1]) is SpatialInstanceNorm2d and list(model.state_dict()) == keys
    volume = nn.Sequential(nn.Conv3d(2, 2, 3, padding=1), nn.InstanceNorm3d(2))
    _spatialize(volume, (2, 1, 2))
    assert type(volume[1]) is SpatialInstanceNorm3d


@pytest.mark.parametrize(
    ("layer", "grid", "message"),
    [
        (nn.InstanceNorm1d(2), (2,), r"module '0' \(InstanceNorm1d\): mixes pixels"),
        pytest.param(
            nn.InstanceNorm3d(2),
            (2, 2),
            r"module '0' \(InstanceNorm3d\).*is a 3-D layer",
            # the watch's probe (N, C, H, W) is an unbatched volume to it: torch warns
            marks=pytest.mark.filterwarnings("ignore:input's size"),
        ),
        (
            type("MyInstanceNorm", (nn.InstanceNorm2d,), {})(2),
            (2, 2),
            r"module '0' \(MyInstanceNorm\): subclasses a pixel-mixing layer",
        ),
    ],
)
def test_instance_norms_without_a_spatial_form_are_refused_in_one_line(
    layer: nn.Module, grid: tuple[int, ...], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        _spatialize(nn.Sequential(layer), grid)
    assert "\n" not in str(err.value)
