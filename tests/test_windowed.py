"""Spatial windowed layers on one tile, without processes: the banded convolution backward.

A spatial convolution's backward runs over bands of output rows
(:func:`~hyfi_imaging.parallel.windowed.backward_band`), each reading a slab of
the extended tile rebuilt from the tile and its strips. Here one tile is the
whole image (fill past its edges), so the gradients must
equal the plain layer's, in float64, for every geometry; the multi-rank sweeps
(``tests/test_spatial_mpi.py``, ``tests/test_volume_mpi.py``) run the same path
with real halos.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hyfi_imaging.parallel import windowed
from hyfi_imaging.parallel.halo import Neighbours
from hyfi_imaging.parallel.spatial import spatialize

CASES = [
    ("k3-s1-p1", lambda: nn.Conv2d(3, 4, 3, padding=1), (37, 29)),
    ("k3-s2-p1", lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), (46, 30)),
    ("k7-s2-p3", lambda: nn.Conv2d(3, 4, 7, stride=2, padding=3, bias=False), (62, 40)),
    ("k5-d2-p4", lambda: nn.Conv2d(3, 4, 5, dilation=2, padding=4), (40, 33)),
    ("k1-s1", lambda: nn.Conv2d(3, 4, 1), (33, 20)),
    ("k3-g3", lambda: nn.Conv2d(3, 6, 3, padding=1, groups=3), (35, 26)),
    ("1d-k5-s2", lambda: nn.Conv1d(3, 4, 5, stride=2, padding=2), (84,)),
    ("3d-k3-p1", lambda: nn.Conv3d(3, 4, 3, padding=1), (26, 9, 10)),
]


def _tile_model(
    conv: nn.Module, size: tuple[int, ...], overlap: bool, bands: bool = True
) -> tuple[nn.Module, Any]:
    model = nn.Sequential(conv)
    grid = (1,) * len(size)
    ctx = spatialize(
        model, grid=grid, tile=(0,) * len(size), neighbours=Neighbours(), group=None,  # type: ignore[arg-type]
        in_chans=3, overlap=overlap, backward_bands=bands,
    )  # fmt: skip
    ctx.set_image_size(size)
    return model, ctx


@pytest.mark.parametrize(("name", "make", "size"), CASES, ids=[c[0] for c in CASES])
def test_the_banded_backward_equals_the_plain_layer_s(
    name: str, make: Any, size: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Input, weight and bias gradients of the spatial convolution, banded (several bands
    of a few rows), in one piece on the extended tile, and on the tile itself (the
    default, no bands), equal the plain layer's in float64."""
    torch.manual_seed(3)
    plain = nn.Sequential(make()).double()
    x = torch.randn(2, 3, *size, dtype=torch.float64, requires_grad=True)
    y = plain(x)
    gy = torch.randn_like(y)
    ref = torch.autograd.grad(y, [x, *plain.parameters()], gy)
    bands = []
    real = windowed._conv_grads_banded

    def counting(*args: Any) -> Any:
        bands.append(args[-1])
        return real(*args)

    monkeypatch.setattr(windowed, "_conv_grads_banded", counting)
    # Bands of 3+ rows, one piece; and both again with the weight gradient computed in
    # the halo gradients' flight (overlap); then the default path (no bands), both ways.
    runs = [(3, False, True), (10_000, False, True), (3, True, True), (10_000, True, True),
            (3, False, False), (3, True, False)]  # fmt: skip
    for min_rows, overlap, banded in runs:
        monkeypatch.setattr(windowed, "MIN_BAND_ROWS", min_rows)
        spatial, ctx = _tile_model(make().double(), size, overlap, banded)
        spatial.load_state_dict(plain.state_dict())
        padded = ctx.padded_size(size)
        xt = torch.zeros(2, 3, *padded, dtype=torch.float64)
        xt[(..., *(slice(0, n) for n in size))] = x
        xt.requires_grad_(True)
        yt = spatial(xt)
        assert yt.shape == y.shape
        got = torch.autograd.grad(yt, [xt, *spatial.parameters()], gy)
        gx = got[0][(..., *(slice(0, n) for n in size))]
        torch.testing.assert_close(gx, ref[0], rtol=1e-12, atol=1e-12)
        for g, r in zip(got[1:], ref[1:], strict=True):
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    assert len(bands) == 2 and min(bands) >= 3, bands  # banded when the minimum allowed it


def test_bands_cover_a_tile_in_about_sixteen_pieces_of_at_least_the_minimum() -> None:
    assert windowed.backward_band(4) == windowed.MIN_BAND_ROWS  # one piece
    assert windowed.backward_band(640) == 40
    assert windowed.backward_band(100) == windowed.MIN_BAND_ROWS
    for rows in (9, 17, 100, 641, 4096):
        step = windowed.backward_band(rows)
        assert -(-rows // step) <= windowed.BACKWARD_BANDS


def test_extended_tiles_and_windows_keep_a_channels_last_layout() -> None:
    """A channels-last tile (cuDNN's layout for bf16) stays channels-last through the
    extended tile, its rebuild and a rebuilt window, with the same values."""
    from hyfi_imaging.parallel.halo import extend, rebuild, window_of

    x = torch.randn(2, 5, 9, 7)
    halo, valid = (1, 2, 2, 1), (8, 6)
    for tile in (x, x.contiguous(memory_format=torch.channels_last)):
        ext, strips = extend(tile, halo, Neighbours(), fill=-1.0, valid=valid)
        again = rebuild(tile, strips, halo, fill=-1.0, valid=valid)
        part = window_of(tile, strips, halo, (slice(2, 9), slice(0, 10)), fill=-1.0, valid=valid)
        cl = tile is not x
        for t in (ext, again, part):
            assert t.is_contiguous(memory_format=torch.channels_last) == cl
        torch.testing.assert_close(again, ext, rtol=0, atol=0)
        torch.testing.assert_close(part, ext[..., 2:9, 0:10], rtol=0, atol=0)
        assert (ext[..., 1 + 8 :, :] == -1).all() and (ext[..., :1, :] == -1).all()
