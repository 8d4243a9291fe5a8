"""Global augmentation mapped to tiles: every rank's tile equals the whole augmented image."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import pytest

from hyfi_imaging.data.augment import (
    AugmentConfig,
    AugmentParams,
    apply_colour,
    apply_geometry,
    augment_image,
    draw_augment,
    output_size,
    read_augmented,
    source_box,
)
from hyfi_imaging.data.tiles import Halo, stitch, tile_regions
from hyfi_imaging.errors import ConfigError
from hyfi_imaging.io.base import ArrayReader

H, W = 517, 389
GRIDS = [(1, 2), (2, 2), (3, 1), (2, 3)]
HALOS: list[Halo] = [0, (13, 10)]
CONFIGS = {
    # Flips only: the output keeps the (non-square) source size.
    "flip": AugmentConfig(flip=True, brightness=0.2, contrast=0.3),
    # Crop smaller than the image, any rotation.
    "crop": AugmentConfig(flip=True, rot90=True, out_size=(300, 350), saturation=0.5, hue=0.3),
    # Window larger than the image along y, smaller along x: translation plus crop.
    "translate": AugmentConfig(
        flip=True,
        rot90=True,
        out_size=(600, 320),
        brightness=0.4,
        contrast=0.4,
        saturation=0.6,
        hue=0.5,
    ),
}


@pytest.fixture(scope="module")
def image() -> np.ndarray:
    # Texture plus flat "glass", so clipping and the background fill both occur.
    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, (3, H, W), dtype=np.uint8)
    img[:, :40, :] = 255
    return img


def _reference(image: np.ndarray, p: AugmentParams, fill: int = 255) -> np.ndarray:
    """The augmented whole image, computed independently of the library's geometry."""
    t = image
    if p.flip_y:
        t = np.flip(t, 1)
    if p.flip_x:
        t = np.flip(t, 2)
    t = np.rot90(t, p.k, axes=(1, 2))
    (oy, ox), (oh, ow) = p.offset, p.out_hw
    m = max(oh, ow) + max(abs(oy), abs(ox))
    big = np.pad(t, ((0, 0), (m, m), (m, m)), constant_values=fill)
    return big[:, oy + m : oy + m + oh, ox + m : ox + m + ow]


def _window(image: np.ndarray, box: tuple[int, int, int, int], fill: float) -> np.ndarray:
    y, x, h, w = box
    m = max(abs(y), abs(x), h, w)
    big = np.pad(image, ((0, 0), (m, m), (m, m)), constant_values=fill)
    return big[:, y + m : y + m + h, x + m : x + m + w]


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(12))
def test_tiles_stitch_to_whole_augmented_image(image: np.ndarray, name: str, seed: int) -> None:
    reader = ArrayReader(image)
    p = draw_augment(CONFIGS[name], (H, W), seed=seed, epoch=seed % 3, index=7 * seed)
    whole = augment_image(image, p)
    np.testing.assert_array_equal(whole, _reference(image, p))
    whole_colour = apply_colour(whole, p)
    for grid, halo in itertools.product(GRIDS, HALOS):
        regions = tile_regions(p.out_hw, grid, halo=halo, align=4)
        tiles = [read_augmented(reader, p, r.read) for r in regions]
        assert np.array_equal(stitch(tiles, regions), whole), (grid, halo)
        coloured = [apply_colour(t, p) for t in tiles]
        assert np.array_equal(stitch(coloured, regions), whole_colour), (grid, halo)
        for r, tile, col in zip(regions, tiles, coloured, strict=True):
            # Tile plus halo equals the window of the whole image, background outside.
            assert np.array_equal(tile, _window(whole, r.read, 255)), (grid, halo, r.rank)
            fill_colour = apply_colour(np.full((3, 1, 1), 255, np.uint8), p)[:, 0, 0]
            outside = np.ones(r.read[2:], bool)
            iy, ix, ih, iw = r.inside
            outside[iy : iy + ih, ix : ix + iw] = False
            assert (col[:, outside] == fill_colour[:, None]).all()
            assert np.array_equal(col, apply_colour(_window(whole, r.read, 255), p))


@pytest.mark.parametrize(
    ("flip_y", "flip_x", "k"), list(itertools.product([0, 1], [0, 1], range(4)))
)
def test_source_box_is_the_shown_rectangle(flip_y: int, flip_x: int, k: int) -> None:
    # Every source pixel holds its own flat index; a box of the transformed image
    # must show exactly the source rectangle source_box names.
    h, w = 13, 9
    index = np.arange(h * w, dtype=np.int64).reshape(1, h, w)
    p = AugmentParams((h, w), (w, h) if k % 2 else (h, w), bool(flip_y), bool(flip_x), k)
    t = np.flip(index, 1) if flip_y else index
    t = np.flip(t, 2) if flip_x else t
    t = np.rot90(t, k, axes=(1, 2))
    np.testing.assert_array_equal(apply_geometry(index, p), t)
    th, tw = t.shape[1:]
    rng = np.random.default_rng(k + 4 * flip_x + 8 * flip_y)
    for _ in range(20):
        y0, y1 = sorted(rng.integers(0, th + 1, 2))
        x0, x1 = sorted(rng.integers(0, tw + 1, 2))
        if y0 == y1 or x0 == x1:
            continue
        shown = t[0, y0:y1, x0:x1]
        sy, sx = np.divmod(shown, w)
        expected = (sy.min(), sx.min(), sy.max() - sy.min() + 1, sx.max() - sx.min() + 1)
        assert source_box(p, (y0, x0, y1 - y0, x1 - x0)) == expected
        assert shown.size == expected[2] * expected[3]


def test_draw_is_deterministic_and_streams_are_independent() -> None:
    cfg = CONFIGS["translate"]
    a = draw_augment(cfg, (H, W), seed=3, epoch=2, index=11)
    assert a == draw_augment(cfg, (H, W), seed=3, epoch=2, index=11)
    others = [
        draw_augment(cfg, (H, W), seed=4, epoch=2, index=11),
        draw_augment(cfg, (H, W), seed=3, epoch=3, index=11),
        draw_augment(cfg, (H, W), seed=3, epoch=2, index=12),
    ]
    assert all(o != a for o in others)
    # Switching flips off leaves every other draw as it was.
    b = draw_augment(dataclasses.replace(cfg, flip=False), (H, W), seed=3, epoch=2, index=11)
    assert not (b.flip_y or b.flip_x)
    assert (b.k, b.offset, b.brightness, b.hue) == (a.k, a.offset, a.brightness, a.hue)


def test_draw_ranges() -> None:
    cfg = AugmentConfig(
        flip=True, rot90=True, out_size=(300, 500), brightness=0.2, contrast=0.1, hue=0.05
    )
    seen_k, seen_flip = set(), set()
    for i in range(200):
        p = draw_augment(cfg, (H, W), seed=0, epoch=0, index=i)
        th, tw = p.transformed_hw
        assert p.out_hw == (300, 500)
        # Crop along an axis that is larger, placement along one that is smaller.
        assert min(0, th - 300) <= p.offset[0] <= max(0, th - 300)
        assert min(0, tw - 500) <= p.offset[1] <= max(0, tw - 500)
        assert 0.8 <= p.brightness <= 1.2 and 0.9 <= p.contrast <= 1.1
        assert p.saturation == 1.0 and -0.05 <= p.hue <= 0.05
        seen_k.add(p.k)
        seen_flip.add((p.flip_y, p.flip_x))
    assert seen_k == {0, 1, 2, 3} and len(seen_flip) == 4
    plain = draw_augment(AugmentConfig(), (H, W), seed=5, epoch=0, index=0)
    assert plain == AugmentParams((H, W), (H, W)) and plain.colour_identity


def test_output_size_and_config_errors() -> None:
    assert output_size(AugmentConfig(flip=True), (H, W)) == (H, W)
    assert output_size(AugmentConfig(rot90=True), (64, 64)) == (64, 64)
    assert output_size(AugmentConfig(rot90=True, out_size=(8, 9)), (H, W)) == (8, 9)
    with pytest.raises(ConfigError, match="set out_size"):
        output_size(AugmentConfig(rot90=True), (H, W))
    bad: dict[str, Any]
    for bad in ({"brightness": 1.5}, {"hue": 0.6}, {"contrast": -0.1}, {"out_size": (0, 4)}):
        with pytest.raises(ConfigError):
            AugmentConfig(**bad)
    with pytest.raises(ConfigError, match=">= 0"):
        draw_augment(AugmentConfig(), (H, W), seed=-1, epoch=0, index=0)


def test_jitter_keeps_the_range_the_normalisation_gives() -> None:
    """Brightness and contrast clipped to [0, 1] whatever the normalisation: a float image used
    as it is, or a window with ``clip: false``, came out of training in [0, 1] and out of
    validation in its own range (a float channel up to 65 in validation, 1 in training).
    Clipped where the window keeps values in [0, 1] (integer types over their maximum,
    clipping windows), not elsewhere."""
    from hyfi_imaging.data.normalize import Window

    p = AugmentParams((1, 2), (1, 2), brightness=1.000001, contrast=0.999999)
    floats = np.array([[[-0.01, 2.9]], [[65.0, 0.2]]], np.float32)
    out = apply_colour(floats, p)
    assert out.min() < -0.005 and out.max() > 64, out  # jittered, not clipped
    np.testing.assert_allclose(
        out, apply_colour(floats, AugmentParams((1, 2), (1, 2))), rtol=1e-5, atol=1e-5
    )
    wide = Window(np.zeros(1, np.float32), np.full(1, 4000, np.float32), clip=False)
    u16 = np.array([[[100, 45000]]], np.uint16)
    assert apply_colour(u16, p, window=wide).max() > 11  # range [0, 4000], clip: false
    assert apply_colour(u16, p).max() <= 1.0  # x / 65535: within [0, 1], clipped as before
    clipped = Window(np.zeros(1, np.float32), np.full(1, 4000, np.float32), clip=True)
    assert (
        apply_colour(
            u16, dataclasses.replace(p, brightness=1.5, contrast=1.0), window=clipped
        ).max()
        == 1.0
    )
    assert wide.bounded(np.dtype(np.uint16)) is False and clipped.bounded(np.dtype(np.float32))
    assert Window.of_dtype(np.dtype(np.uint8), 3).bounded(np.dtype(np.uint8))
    assert not Window.of_dtype(np.dtype(np.float32), 3).bounded(np.dtype(np.float32))


def test_colour_formulas() -> None:
    px = np.array([[[0]], [[128]], [[255]]], dtype=np.uint8)  # one RGB pixel
    base = px.astype(np.float32) / np.float32(255)
    p = AugmentParams((1, 1), (1, 1))
    assert np.array_equal(apply_colour(px, p), base)  # exactly x / 255, like ToTensor
    out = apply_colour(px, dataclasses.replace(p, brightness=1.5))
    np.testing.assert_allclose(out[:, 0, 0], [0.0, min(1.0, 1.5 * 128 / 255), 1.0], atol=1e-6)
    # Contrast pivots about the fixed 0.5, not the image mean.
    out = apply_colour(px, dataclasses.replace(p, contrast=0.5))
    np.testing.assert_allclose(out[:, 0, 0], 0.5 + (base[:, 0, 0] - 0.5) * 0.5, atol=1e-6)
    # Saturation 0 turns a pixel into its luma, the same in every channel.
    out = apply_colour(px, dataclasses.replace(p, saturation=0.0))
    luma = 0.299 * 0 + 0.587 * 128 / 255 + 0.114 * 1
    np.testing.assert_allclose(out[:, 0, 0], [luma] * 3, atol=1e-6)
    # Hue rotates chroma: grey stays grey, luma is kept, a half turn changes colour.
    grey = np.full((3, 1, 1), 90, np.uint8)
    np.testing.assert_allclose(
        apply_colour(grey, dataclasses.replace(p, hue=0.3)), grey / 255, atol=1e-6
    )
    colour = np.array([[[200]], [[120]], [[60]]], dtype=np.uint8)
    turned = apply_colour(colour, dataclasses.replace(p, hue=0.5))[:, 0, 0]
    weights = np.array([0.299, 0.587, 0.114])
    assert abs(turned @ weights - (colour[:, 0, 0] / 255) @ weights) < 1e-3
    assert np.abs(turned - colour[:, 0, 0] / 255).max() > 0.1
    assert turned.min() >= 0 and turned.max() <= 1 and turned.dtype == np.float32


def test_colour_is_pointwise_bit_for_bit(image: np.ndarray) -> None:
    p = draw_augment(CONFIGS["translate"], (H, W), seed=9, epoch=0, index=0)
    whole = apply_colour(image, p)
    # Odd pieces, single rows, single pixels and non-contiguous views give the same bits.
    for y, x, h, w in [(0, 0, 1, 1), (17, 3, 1, 389), (5, 100, 257, 3), (200, 201, 33, 77)]:
        assert np.array_equal(
            apply_colour(image[:, y : y + h, x : x + w], p), whole[:, y : y + h, x : x + w]
        )
    assert np.array_equal(apply_colour(image[:, ::-1, ::-1], p), whole[:, ::-1, ::-1])


def test_colour_needs_rgb_for_saturation_and_hue() -> None:
    grey = np.zeros((1, 4, 4), np.uint8)
    p = AugmentParams((4, 4), (4, 4), brightness=1.1)
    assert apply_colour(grey, p).shape == (1, 4, 4)
    with pytest.raises(ConfigError, match="RGB"):
        apply_colour(grey, dataclasses.replace(p, saturation=0.5))


def test_read_augmented_fill_and_checks(image: np.ndarray) -> None:
    reader = ArrayReader(image, background=255)
    p = draw_augment(CONFIGS["translate"], (H, W), seed=2, epoch=0, index=0)
    whole = augment_image(image, p, fill=0)
    for box in [(-20, -20, 50, 60), (590, 300, 30, 40), (1000, 1000, 4, 4), (0, 0, 600, 320)]:
        assert np.array_equal(read_augmented(reader, p, box, fill=0), _window(whole, box, 0))
    with pytest.raises(ConfigError, match="drawn for"):
        read_augmented(ArrayReader(image[:, :-1]), p, (0, 0, 4, 4))


def test_options_do_not_shift_the_colour_draws_of_a_non_square_image() -> None:
    """The window offset of a turned non-square image drew first, by its range: switching
    rot90 on moved that image's brightness and contrast (a square image's stayed)."""
    from hyfi_imaging.data.augment import AugmentConfig, draw_augment

    for hw in ((96, 96), (96, 128)):
        on, off = (
            draw_augment(
                AugmentConfig(rot90=turns, out_size=hw, brightness=0.3, contrast=0.3),
                hw,
                seed=3,
                epoch=1,
                index=0,
            )
            for turns in (True, False)
        )
        assert (on.brightness, on.contrast) == (off.brightness, off.contrast), hw
