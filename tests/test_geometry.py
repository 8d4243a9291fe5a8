"""Tests of the pure spatial geometry: hand-worked tables, brute force, torch end to end."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel import geometry as g
from hyfi_imaging.parallel.geometry import (
    Box,
    ChainGeom,
    Decomp1D,
    LayerGeom,
    Span,
    decompose,
    layer_geom,
    out_length,
    plan_chain,
    plan_layer,
    split,
    split_balanced,
)

# ---------------------------------------------------------------- hand-worked tables


@pytest.mark.parametrize(
    ("geom", "clipped"),
    [
        (layer_geom(nn.Conv2d(1, 1, 3, 1, 1))[0], (1, 1)),
        (layer_geom(nn.Conv2d(1, 1, 3, 2, 1))[0], (1, 0)),
        (layer_geom(nn.Conv2d(1, 1, 7, 2, 3))[0], (3, 2)),
        (layer_geom(nn.MaxPool2d(3, 2, 1))[1], (1, 0)),
        (layer_geom(nn.Conv2d(1, 1, 1, 2))[0], (0, 0)),
    ],
)
def test_reference_aligned_halos(geom: LayerGeom, clipped: tuple[int, int]) -> None:
    # Interior rank of 4 stride-aligned tiles of 48: halo (p, K - p - s), REFERENCE.md
    # lists it clipped at 0 (a negative side is surplus).
    dec = decompose(48, geom, 4, align=geom.stride)
    tile = dec.tiles[1]
    raw = (geom.padding, geom.extent - geom.padding - geom.stride)
    assert tile.halo == raw
    assert (max(0, raw[0]), max(0, raw[1])) == clipped
    assert tile.surplus == (max(0, -raw[0]), max(0, -raw[1]))
    assert tile.pad == (0, 0)
    assert tile.out == Span(48 // 4 // geom.stride, 2 * 48 // 4 // geom.stride)


def test_reference_table_from_modules() -> None:
    assert layer_geom(nn.MaxPool2d(3, 2, 1)) == (LayerGeom(3, 2, 1), LayerGeom(3, 2, 1))
    assert layer_geom(nn.Conv2d(3, 8, 7, 2, 3)) == (LayerGeom(7, 2, 3), LayerGeom(7, 2, 3))
    assert layer_geom(nn.Conv2d(3, 8, 1, 2)) == (LayerGeom(1, 2), LayerGeom(1, 2))
    conv = nn.Conv2d(1, 1, (3, 5), stride=(1, 2), padding=(1, 2), dilation=(2, 1))
    assert layer_geom(conv) == (LayerGeom(3, 1, 1, 2), LayerGeom(5, 2, 2, 1))
    assert layer_geom(nn.Conv2d(1, 1, 5, padding="valid"))[0] == LayerGeom(5)
    # 'same', even kernel: total d(k-1) = 3 -> 1 before, 2 after (as PyTorch pads).
    same = layer_geom(nn.Conv2d(1, 1, (4, 3), padding="same", dilation=(1, 2)))
    assert same == (LayerGeom(4, 1, 1, 1, padding_end=2), LayerGeom(3, 1, 2, 2))
    assert layer_geom(nn.AvgPool2d(3))[1] == LayerGeom(3, 3, 0)


STEM = [LayerGeom(7, 2, 3), LayerGeom(3, 2, 1)]


def test_resnet_stem_chain() -> None:
    # 7x7/s2/p3 then 3x3 max-pool/s2/p1: J = 2*2 = 4, P = 3 + 1*2 = 5, R = 1 + 6 + 2*2 = 11,
    # halo (P, R - P - J) = (5, 2). (13, 10), quoted in REFERENCE.md for "the stem", is the
    # stem followed by the two 3x3/s1/p1 convs of a basic block: P = 5 + 4 + 4 = 13,
    # R = 11 + 8 + 8 = 27, R - P - J = 10.
    stem = ChainGeom(tuple(STEM))
    assert (stem.jump, stem.padding, stem.extent, stem.halo) == (4, 5, 11, (5, 2))
    block = ChainGeom((*STEM, LayerGeom(3, 1, 1), LayerGeom(3, 1, 1)))
    assert (block.jump, block.halo) == (4, (13, 10))
    dec = decompose(64, block, 4, align=4)
    assert dec.tiles[1].halo == (13, 10)
    assert dec.tiles[1].need == Span(16 - 13, 32 + 10)


def _table(dec: Decomp1D) -> list[tuple[object, ...]]:
    return [
        (
            tuple(t.owned),
            tuple(t.out),
            tuple(t.need),
            t.halo,
            t.pad,
            t.surplus,
            [(q, tuple(s)) for q, s in dec.recvs(r)],
            [(q, tuple(s)) for q, s in dec.sends(r)],
        )
        for r, t in enumerate(dec.tiles)
    ]


# Each row: owned input, owned output, need, halo, pad, surplus, recvs, sends.
HAND_TABLES = [
    # 5x5/s4/p2 (K=5), n=22, 3 tiles aligned to 4 -> tiles of 8 over 24, m=floor(21/4)+1=6.
    # Output j reads 4j-2 .. 4j+2.  r0: outs 0,1 -> [-2,7); r1: outs 2,3 -> [6,15);
    # r2: outs 4,5 -> [14,23), and 22 is past n=22: global padding (its 22,23 are not data).
    (
        LayerGeom(5, 4, 2),
        22,
        3,
        4,
        [
            ((0, 8), (0, 2), (-2, 7), (0, -1), (2, 0), (0, 1), [], [(1, (6, 8))]),
            ((8, 16), (2, 4), (6, 15), (2, -1), (0, 0), (0, 1), [(0, (6, 8))], [(2, (14, 16))]),
            ((16, 24), (4, 6), (14, 23), (2, 0), (0, 1), (0, 0), [(1, (14, 16))], []),
        ],
    ),
    # 3x3/s1/p2/d2 (K=5), n=10, 2 tiles: output j reads j-2, j, j+2.
    (
        LayerGeom(3, 1, 2, 2),
        10,
        2,
        1,
        [
            ((0, 5), (0, 5), (-2, 7), (0, 2), (2, 0), (0, 0), [(1, (5, 7))], [(1, (3, 5))]),
            ((5, 10), (5, 10), (3, 12), (2, 0), (0, 2), (0, 0), [(0, (3, 5))], [(0, (5, 7))]),
        ],
    ),
    # 3x3/s1/p3/d3 (K=7) on tiles of 2: the halo is wider than a tile, so r0 and r2
    # talk to each other past r1.  r0 outs 0,1 read [-3,5); r1 [-1,7); r2 [1,9).
    (
        LayerGeom(3, 1, 3, 3),
        6,
        3,
        1,
        [
            (
                (0, 2),
                (0, 2),
                (-3, 5),
                (0, 3),
                (3, 0),
                (0, 0),
                [(1, (2, 4)), (2, (4, 5))],
                [(1, (0, 2)), (2, (1, 2))],
            ),
            (
                (2, 4),
                (2, 4),
                (-1, 7),
                (2, 2),
                (1, 1),
                (0, 0),
                [(0, (0, 2)), (2, (4, 6))],
                [(0, (2, 4)), (2, (2, 4))],
            ),
            (
                (4, 6),
                (4, 6),
                (1, 9),
                (3, 0),
                (0, 3),
                (0, 0),
                [(0, (1, 2)), (1, (2, 4))],
                [(0, (4, 5)), (1, (4, 6))],
            ),
        ],
    ),
    # 2x2/s1/p0, n=9, 3 tiles of 3: m=8, so r2 also owns output 8 (past the end, garbage);
    # output j reads j, j+1: right halo 1 = K - p - s, r2's index 9 is global padding.
    (
        LayerGeom(2),
        9,
        3,
        1,
        [
            ((0, 3), (0, 3), (0, 4), (0, 1), (0, 0), (0, 0), [(1, (3, 4))], []),
            ((3, 6), (3, 6), (3, 7), (0, 1), (0, 0), (0, 0), [(2, (6, 7))], [(0, (3, 4))]),
            ((6, 9), (6, 9), (6, 10), (0, 0), (0, 1), (0, 0), [], [(1, (6, 7))]),
        ],
    ),
    # 4x4/s2/p1, n=12, 2 tiles aligned to 2: m=floor(10/2)+1=6; output j reads 2j-1 .. 2j+2.
    (
        LayerGeom(4, 2, 1),
        12,
        2,
        2,
        [
            ((0, 6), (0, 3), (-1, 7), (0, 1), (1, 0), (0, 0), [(1, (6, 7))], [(1, (5, 6))]),
            ((6, 12), (3, 6), (5, 13), (1, 0), (0, 1), (0, 0), [(0, (5, 6))], [(0, (6, 7))]),
        ],
    ),
    # 3x3/s2/p1, n=9, 3 tiles of 3 NOT aligned to the stride: output j goes to the owner of
    # input 2j: r0 {0,2} -> outs 0,1; r1 {4} -> out 2; r2 {6,8} -> outs 3,4 (m=5).
    # Output j reads 2j-1 .. 2j+1: r0 [-1,4), r1 [3,6) (all its own), r2 [5,10).
    (
        LayerGeom(3, 2, 1),
        9,
        3,
        1,
        [
            ((0, 3), (0, 2), (-1, 4), (0, 1), (1, 0), (0, 0), [(1, (3, 4))], []),
            ((3, 6), (2, 3), (3, 6), (0, 0), (0, 0), (0, 0), [], [(0, (3, 4)), (2, (5, 6))]),
            ((6, 9), (3, 5), (5, 10), (1, 0), (0, 1), (0, 0), [(1, (5, 6))], []),
        ],
    ),
    # 1x1/s2, n=7, 2 tiles of 4 (unaligned padded length 8): outs [0,2) and [2,4) (m=4);
    # r0 reads 0, 2 -> need [0,3), its input 3 is surplus; r1 reads 4, 6 -> [4,7).
    (
        LayerGeom(1, 2),
        7,
        2,
        1,
        [
            ((0, 4), (0, 2), (0, 3), (0, -1), (0, 0), (0, 1), [], []),
            ((4, 8), (2, 4), (4, 7), (0, 0), (0, 0), (0, 0), [], []),
        ],
    ),
]


@pytest.mark.parametrize(("geom", "n", "parts", "align", "rows"), HAND_TABLES)
def test_hand_tables(
    geom: LayerGeom, n: int, parts: int, align: int, rows: list[tuple[object, ...]]
) -> None:
    dec = decompose(n, geom, parts, align=align)
    assert _table(dec) == rows


def test_hand_table_2d_corners() -> None:
    # 3x3/s1/p1 on a 4x6 image, grid 2x2: tiles 2x3. Rank 0 needs [-1,3) x [-1,4) and gets
    # its right column from rank 1, its bottom row from rank 2 and the corner from rank 3.
    plan = plan_layer((4, 6), (2, 2), LayerGeom(3, 1, 1))
    t0 = plan.tile(0)
    assert t0.need == Box(Span(-1, 3), Span(-1, 4))
    assert t0.own == Box(Span(0, 2), Span(0, 3))
    assert t0.halo == (0, 1, 0, 1)
    assert t0.pad == (1, 0, 1, 0)
    assert t0.recvs == (
        (1, Box(Span(0, 2), Span(3, 4))),
        (2, Box(Span(2, 3), Span(0, 3))),
        (3, Box(Span(2, 3), Span(3, 4))),
    )
    t3 = plan.tile(plan.rank(1, 1))
    assert t3.coord == (1, 1)
    assert t3.need == Box(Span(1, 5), Span(2, 7))
    assert t3.pad == (0, 1, 0, 1)
    assert t3.sends == (
        (0, Box(Span(2, 3), Span(3, 4))),
        (1, Box(Span(2, 3), Span(3, 6))),
        (2, Box(Span(2, 4), Span(3, 4))),
    )


# ---------------------------------------------------------------- brute force, one axis


def test_split_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        n, parts, align = rng.randint(1, 60), rng.randint(1, 7), rng.randint(1, 8)
        padded = -(-n // (parts * align)) * parts * align  # smallest multiple of parts*align
        tile = padded // parts
        if (parts - 1) * tile >= n:
            with pytest.raises(ConfigError, match=f"would start at {(parts - 1) * tile}"):
                split(n, parts, align=align)
        else:
            spans = split(n, parts, align=align)
            assert [s.start for s in spans] == list(range(0, padded, tile))
            assert all(s.size == tile and s.start % align == 0 for s in spans)
        if parts <= n:
            sizes = [s.size for s in split_balanced(n, parts)]
            assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)


def _random_geom(rng: random.Random) -> LayerGeom:
    k, d = rng.randint(1, 5), rng.randint(1, 3)
    extent = d * (k - 1) + 1
    p = rng.randint(0, extent)
    p_end = p if rng.random() < 0.7 else rng.randint(0, extent)
    return LayerGeom(k, rng.randint(1, 4), p, d, padding_end=p_end)


def _brute_out_length(n: int, geom: LayerGeom) -> int:
    # Output j exists while its whole window lies in [-p, n + p_end).
    return sum(
        1
        for j in range(n + geom.padding + geom.pad_end + 1)
        if geom.reads(j)[-1] < n + geom.pad_end
    )


def _check_decomp(dec: Decomp1D, reads: Callable[[int], set[int]]) -> None:
    n, m = dec.n, dec.m
    owners = [0] * m
    for tile in dec.tiles:
        assert not tile.out.empty
        for j in range(tile.out.start, min(tile.out.stop, m)):
            owners[j] += 1
    assert owners == [1] * m, "every real output has exactly one owner"
    transpose = set()
    for r, tile in enumerate(dec.tiles):
        read = set().union(*(reads(j) for j in range(*tile.out)))
        assert (min(read), max(read) + 1) == tile.need, "need is the hull of what is read"
        data = tile.data
        assert tile.need.size == sum(tile.pad) + sum(tile.halo) + data.size
        assert tile.surplus == (max(0, -tile.halo[0]), max(0, -tile.halo[1]))
        # Halo by its meaning: image indices needed before / after the owned data, less
        # owned data not needed on that side (the surplus).
        before = sum(1 for i in range(*tile.need) if 0 <= i < data.start)
        after = sum(1 for i in range(*tile.need) if data.stop <= i < n)
        unneeded_left = sum(1 for i in range(*data) if i < tile.need.start)
        unneeded_right = sum(1 for i in range(*data) if i >= tile.need.stop)
        assert tile.halo == (before - unneeded_left, after - unneeded_right)
        assert tile.surplus == (unneeded_left, unneeded_right)
        pieces = [tile.own, *(s for _, s in dec.recvs(r))]
        for i in range(*tile.need):
            hits = sum(1 for s in pieces if s.start <= i < s.stop)
            assert hits == (0 if i < 0 or i >= n else 1), (r, i)
        below = sum(1 for i in range(*tile.need) if i < 0)
        assert tile.pad == (below, sum(1 for i in range(*tile.need) if i >= n))
        for q, s in dec.recvs(r):
            assert q != r and not s.empty
            assert dec.tiles[q].data.start <= s.start and s.stop <= dec.tiles[q].data.stop
            transpose.add((q, r, s))
    assert transpose == {(r, q, s) for r in range(dec.parts) for q, s in dec.sends(r)}


def _cases(seed: int, count: int) -> Iterator[tuple[LayerGeom, int, int, int]]:
    rng = random.Random(seed)
    for _ in range(count):
        geom = _random_geom(rng)
        align = rng.choice([1, geom.stride, rng.randint(1, 4)])
        yield geom, rng.randint(1, 40), rng.randint(1, 5), align


def test_brute_force_layer_rule_ownership() -> None:
    checked = refused = 0
    for geom, n, parts, align in _cases(1, 1500):
        m_brute = _brute_out_length(n, geom)
        if m_brute <= 0:
            with pytest.raises(ConfigError):
                out_length(n, geom)
            continue
        assert out_length(n, geom) == m_brute
        try:
            dec = decompose(n, geom, parts, align=align)
        except ConfigError:
            refused += 1
            continue
        for r, tile in enumerate(dec.tiles):  # the documented ownership rule
            for j in range(*tile.out):
                holders = [
                    q for q, o in enumerate(dec.owned_in) if o.start <= geom.stride * j < o.stop
                ]
                owner = holders[0] if holders else parts - 1  # past the tiles: the last rank
                assert owner == r
        _check_decomp(dec, lambda j, geom=geom: set(geom.reads(j)))
        checked += 1
    assert checked > 800 and refused > 20


def test_brute_force_given_output_tiles() -> None:
    # Ownership propagation with arbitrary owned outputs (balanced) and inputs (either split).
    checked = 0
    rng = random.Random(2)
    for geom, n, parts, align in _cases(3, 1200):
        m = _brute_out_length(n, geom)
        if m < parts or n < parts:
            continue
        try:
            owned_in = (
                split(n, parts, align=align) if rng.random() < 0.5 else split_balanced(n, parts)
            )
        except ConfigError:
            continue
        dec = decompose(n, geom, owned_in=owned_in, owned_out=split_balanced(m, parts))
        _check_decomp(dec, lambda j, geom=geom: set(geom.reads(j)))
        checked += 1
    assert checked > 500


def _chain_reads(layers: list[LayerGeom]) -> Callable[[int], set[int]]:
    # Receptive field through the chain, layer by layer, ignoring intermediate padding
    # (a deep halo re-masks it, so its hull is what must be exchanged).
    def reads(j: int) -> set[int]:
        cells = {j}
        for geom in reversed(layers):
            cells = {i for c in cells for i in geom.reads(c)}
        return cells

    return reads


def test_brute_force_chain() -> None:
    rng = random.Random(4)
    checked = 0
    for _ in range(400):
        layers = [_random_geom(rng) for _ in range(rng.randint(1, 4))]
        chain = ChainGeom(tuple(layers))
        n, parts = rng.randint(1, 160), rng.randint(1, 4)
        lengths = [n]
        try:
            for geom in layers:
                lengths.append(geom.out_length(lengths[-1]))
        except ConfigError:
            with pytest.raises(ConfigError):
                chain.out_length(n)
            continue
        assert chain.out_length(n) == lengths[-1]
        j0 = rng.randint(0, lengths[-1] - 1)
        j1 = rng.randint(j0 + 1, lengths[-1])
        composed = Span(j0, j1)
        for geom in reversed(layers):  # layer-by-layer composition of needs
            composed = geom.need(composed)
        assert chain.need((j0, j1)) == composed
        try:
            dec = decompose(n, chain, parts, align=chain.jump)
        except ConfigError:
            continue
        _check_decomp(dec, _chain_reads(layers))
        for tile in dec.tiles:  # J-aligned tiles away from the border: the deep halo formula
            aligned = tile.out == Span(
                tile.owned.start // chain.jump, tile.owned.stop // chain.jump
            )
            inside = tile.data == tile.owned and tile.pad == (0, 0) and not tile.own.empty
            if aligned and inside:
                assert tile.halo == chain.halo
        checked += 1
    assert checked > 150


# ---------------------------------------------------------------- brute force, two axes


def test_brute_force_grid() -> None:
    rng = random.Random(5)
    checked = 0
    while checked < 120:
        size = (rng.randint(1, 14), rng.randint(1, 14))
        grid = (rng.randint(1, 3), rng.randint(1, 3))
        layer = (_random_geom(rng), _random_geom(rng))
        try:
            plan = plan_layer(size, grid, layer, align=(rng.randint(1, 3), layer[1].stride))
        except ConfigError:
            continue
        checked += 1
        h, w = size
        owners: dict[tuple[int, int], int] = {}
        pairs = set()
        for t in plan.tiles:
            assert plan.tile(plan.rank(*t.coord)) is t
            assert t.owned_out.shape[0] > 0 and t.owned_out.shape[1] > 0
            for y in range(*t.data_out.y):
                for x in range(*t.data_out.x):
                    owners[(y, x)] = owners.get((y, x), 0) + 1
            pieces = [t.own, *(b for _, b in t.recvs)]
            pad = [0, 0, 0, 0]
            for y in range(*t.need.y):
                for x in range(*t.need.x):
                    hits = sum(1 for b in pieces if y in range(*b.y) and x in range(*b.x))
                    assert hits == (1 if 0 <= y < h and 0 <= x < w else 0)
            pad = [
                sum(1 for y in range(*t.need.y) if y < 0),
                sum(1 for y in range(*t.need.y) if y >= h),
                sum(1 for x in range(*t.need.x) if x < 0),
                sum(1 for x in range(*t.need.x) if x >= w),
            ]
            assert list(t.pad) == pad
            for q, box in t.recvs:
                assert plan.tile(q).data_in.intersect(box) == box
                pairs.add((q, t.rank, box))
        assert owners == {
            (y, x): 1 for y in range(plan.out_size[0]) for x in range(plan.out_size[1])
        }
        assert pairs == {(t.rank, q, b) for t in plan.tiles for q, b in t.sends}


# ---------------------------------------------------------------- torch, end to end


def _assemble(x: torch.Tensor, tile: g.TilePlan, fill: float) -> torch.Tensor:
    """The extended input a rank builds: padding, then its own part, then every recv box."""
    ext = torch.full((*x.shape[:2], *tile.need.shape), fill, dtype=x.dtype)
    origin = (tile.need.y.start, tile.need.x.start)
    for box in (tile.own, *(b for _, b in tile.recvs)):
        ext[(..., *box.slices(origin))] = x[(..., *box.slices())]
    return ext


MODULES = [
    ("conv", lambda: nn.Conv2d(2, 3, 3, 1, 1), 0.0),
    ("conv-s2", lambda: nn.Conv2d(2, 3, 7, 2, 3), 0.0),
    ("conv-5s4", lambda: nn.Conv2d(2, 3, 5, 4, 2), 0.0),
    ("conv-dil", lambda: nn.Conv2d(2, 3, 3, 1, 2, dilation=2), 0.0),
    ("conv-same-even", lambda: nn.Conv2d(2, 3, (4, 2), padding="same"), 0.0),
    ("conv-even-s2", lambda: nn.Conv2d(2, 3, 4, 2, 1), 0.0),
    ("conv-valid", lambda: nn.Conv2d(2, 3, 3), 0.0),
    ("maxpool", lambda: nn.MaxPool2d(3, 2, 1), float("-inf")),
    ("avgpool", lambda: nn.AvgPool2d(3, 2, 1, count_include_pad=True), 0.0),
]


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize(("name", "make", "fill"), MODULES, ids=[m[0] for m in MODULES])
@pytest.mark.parametrize(("size", "grid", "align"), [((22, 19), (2, 3), 4), ((13, 11), (3, 1), 1)])
def test_tiles_reproduce_whole_image(
    name: str,
    make: Callable[[], nn.Module],
    fill: float,
    size: tuple[int, int],
    grid: tuple[int, int],
    align: int,
) -> None:
    f = torch.nn.functional
    torch.manual_seed(0)
    module = make()
    x = torch.randn(1, 2, *size, dtype=torch.float64)
    geoms = layer_geom(module)
    plan = plan_layer(size, grid, geoms, align=align)
    with torch.no_grad():
        full = module.double()(x)
        assert tuple(full.shape[2:]) == plan.out_size
        for tile in plan.tiles:
            ext = _assemble(x, tile, fill)
            if isinstance(module, nn.Conv2d):  # tile-local ops use padding 0
                local = f.conv2d(ext, module.weight, module.bias, module.stride, 0, module.dilation)
            elif isinstance(module, nn.MaxPool2d):
                local = f.max_pool2d(ext, module.kernel_size, module.stride, 0, module.dilation)
            else:
                local = f.avg_pool2d(ext, module.kernel_size, module.stride, 0)
            assert tuple(local.shape[2:]) == tile.owned_out.shape
            origin = (tile.owned_out.y.start, tile.owned_out.x.start)
            got = local[(..., *tile.data_out.slices(origin))]
            torch.testing.assert_close(
                got, full[(..., *tile.data_out.slices())], rtol=0, atol=1e-12
            )


def test_deep_halo_chain_with_remasking() -> None:
    # One exchange for the ResNet stem (+ a 3x3 conv); intermediate activations re-masked
    # outside the image (0 before a conv, -inf before max-pool) give the exact result.
    f = torch.nn.functional
    torch.manual_seed(1)
    mods = [nn.Conv2d(2, 2, 7, 2, 3), nn.MaxPool2d(3, 2, 1), nn.Conv2d(2, 2, 3, 1, 1)]
    fills = [0.0, float("-inf"), 0.0]
    geoms = [layer_geom(m) for m in mods]
    chain = (ChainGeom(tuple(gy for gy, _ in geoms)), ChainGeom(tuple(gx for _, gx in geoms)))
    size, grid = (45, 38), (3, 2)
    plan = plan_layer(size, grid, chain, align=4)
    per_layer = plan_chain(size, grid, geoms)
    assert per_layer[-1].y.owned_out == plan.y.owned_out
    assert per_layer[-1].x.owned_out == plan.x.owned_out
    assert per_layer[0].y.owned_in == plan.y.owned_in
    x = torch.randn(1, 2, *size, dtype=torch.float64)
    with torch.no_grad():
        full = x
        for m in mods:
            full = m.double()(full)
        for tile in plan.tiles:
            act = _assemble(x, tile, fills[0])
            origin = [tile.need.y.start, tile.need.x.start]
            lengths = list(size)
            for index, m in enumerate(mods):
                if index:  # re-mask what lies outside the previous layer's real output
                    ys = torch.arange(act.shape[2]) + origin[0]
                    xs = torch.arange(act.shape[3]) + origin[1]
                    outside = ((ys < 0) | (ys >= lengths[0]))[:, None] | (
                        (xs < 0) | (xs >= lengths[1])
                    )
                    act = act.masked_fill(outside, fills[index])
                if isinstance(m, nn.Conv2d):
                    act = f.conv2d(act, m.weight, m.bias, m.stride, 0)
                else:
                    act = f.max_pool2d(act, 3, 2, 0)
                gy, gx = geoms[index]
                origin = [
                    (origin[0] + gy.padding) // gy.stride,
                    (origin[1] + gx.padding) // gx.stride,
                ]
                lengths = [gy.out_length(lengths[0]), gx.out_length(lengths[1])]
            assert tuple(act.shape[2:]) == tile.owned_out.shape
            got = act[(..., *tile.data_out.slices((origin[0], origin[1])))]
            torch.testing.assert_close(
                got, full[(..., *tile.data_out.slices())], rtol=0, atol=1e-12
            )


# ---------------------------------------------------------------- errors


def test_errors_name_numbers_and_fix() -> None:
    with pytest.raises(ConfigError, match=r"start at 8 >= 8.*at most 2 tiles"):
        split(8, 3, align=4, axis="y")
    with pytest.raises(ConfigError, match="at most 3 tiles"):
        split_balanced(3, 4)
    with pytest.raises(ConfigError, match=r"length 2 is shorter than the window extent 7"):
        out_length(2, LayerGeom(7))
    # Grid finer than the output: 8 tiles of one column, stride 2 -> odd columns own no output.
    with pytest.raises(ConfigError, match=r"rank 1 with input tile \(1, 2\) would own no output"):
        plan_layer((8, 8), (1, 8), LayerGeom(3, 2, 1))
    # 'valid' 9-wide conv on 10 pixels has 2 outputs; the second tile starts at output 5.
    with pytest.raises(ConfigError, match=r"2 outputs.*rank 1"):
        plan_layer((10, 10), (1, 2), LayerGeom(9))
    with pytest.raises(ConfigError, match=r"layer 1 \(k7/s1/p0\) of chain"):
        ChainGeom((LayerGeom(3, 2, 1), LayerGeom(7))).out_length(10)
    with pytest.raises(ConfigError, match="kernel is 0"):
        LayerGeom(0)
    with pytest.raises(ConfigError, match="stride is True"):
        LayerGeom(3, stride=True)
    with pytest.raises(ConfigError, match="expected a start of 4"):
        decompose(10, LayerGeom(3), owned_in=[(0, 4), (5, 10)])
    with pytest.raises(ConfigError, match="the tiles end at 8 < 10"):
        decompose(10, LayerGeom(3), owned_in=[(0, 4), (4, 8)])
    with pytest.raises(ConfigError, match=r"grid is 0; use an integer >= 1"):
        plan_layer((8, 8), (0, 2), LayerGeom(3))
    with pytest.raises(ConfigError, match=r"4 is not \(y, x\)"):
        plan_layer((8, 8), 4, LayerGeom(3))  # type: ignore[arg-type]
    try:
        split(5, 6)
    except ConfigError as err:
        assert "6 tiles" in err.where and err.fix
    else:
        raise AssertionError("split(5, 6) must fail")


def test_module_errors() -> None:
    with pytest.raises(ConfigError, match=r"^ReLU\(\): ReLU has no window geometry"):
        layer_geom(nn.ReLU())
    with pytest.raises(ConfigError, match="padding_mode='reflect'") as err:
        layer_geom(nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect"))
    # the fix keeps the layer's meaning: its reflection as a pad layer, which runs tiled
    assert "or the same layer as an nn.ReflectionPad2d of its padding" in str(err.value)
    with pytest.raises(
        ConfigError, match=r"^AvgPool2d\(kernel_size=3.*ceil_mode=True, padding and count_"
    ):
        layer_geom(nn.AvgPool2d(3, 2, 1, ceil_mode=True))
    # Without padding, or without counting it, the divisor is the window's pixels in the image.
    layer_geom(nn.AvgPool2d(3, 2, ceil_mode=True))
    layer_geom(nn.AvgPool2d(2, 2, 1, ceil_mode=True, count_include_pad=False))


@pytest.mark.parametrize("pool", [nn.MaxPool2d, nn.AvgPool2d])
def test_ceil_mode_pool_lengths_match_pytorch(pool: type[nn.Module]) -> None:
    for k, s, p in [(2, 2, 0), (3, 2, 1), (3, 2, 0), (3, 3, 1), (5, 4, 2)]:
        extra = {"count_include_pad": False} if pool is nn.AvgPool2d else {}
        module = pool(k, s, p, ceil_mode=True, **extra)
        geom = layer_geom(module)[0]
        for n in range(max(k - 2 * p, 1), 40):
            assert geom.out_length(n) == module(torch.zeros(1, 1, n, n)).shape[-1], (k, s, p, n)


# ---------------------------------------------------------------- resampling (pads, interpolation)


def _resample_options() -> Iterator[tuple[str, dict[str, object]]]:
    for mode in ("nearest", "nearest-exact", "bilinear"):
        corners = (None, True) if mode == "bilinear" else (None,)
        for align_corners in corners:
            for key, value in (
                ("size", (1, 3)), ("scale_factor", 2), ("scale_factor", 0.5),
                ("scale_factor", 1.7), ("size", (2, 5)),
            ):  # fmt: skip
                yield "interpolate", {"mode": mode, "align_corners": align_corners, key: value}
    for pad in ((1, 2), (0, 3), (-1, 2), (2, -1)):
        yield "pad", {"pad": (*pad, *pad[::-1]), "value": 0.5}


@pytest.mark.parametrize(("op", "options"), list(_resample_options()))
def test_tiled_resampling_equals_the_whole_image(op: str, options: dict[str, object]) -> None:
    """Every rank's halo window and gather, stitched, is the op on the whole image.

    Brute force over sizes, axes and tile counts, ranks simulated: each window
    is cut from the zero-filled padded axis, as the halo exchange delivers it.
    The image varies along the axis under test only, so a line through the
    middle of the other axis is that axis' whole answer.
    """
    from hyfi_imaging.parallel.functional import Resample, source_coords

    fn = torch.nn.functional
    for n in (5, 9, 16, 23):
        opts = dict(options)
        if isinstance(size := opts.get("size"), tuple):
            opts["size"] = (size[0] * n // 3 + 1, size[1] * n // 3 + 2)
        res = Resample(op, tuple(sorted(opts.items())))
        n_in = (n, n + 3)
        probe = fn.pad if op == "pad" else fn.interpolate
        n_out = tuple(probe(torch.zeros(1, 1, *n_in), **opts).shape[-2:])  # type: ignore[operator]
        coords = source_coords(res, n_in, n_out)  # type: ignore[arg-type]
        for a in (0, 1):
            line = torch.randn(n_in[a], dtype=torch.float64)
            image = line.view(-1, 1).expand(n_in) if a == 0 else line.view(1, -1).expand(n_in)
            whole = probe(image.reshape(1, 1, *n_in), **opts)[0, 0]  # type: ignore[operator]
            ref = whole[:, n_out[1] // 2] if a == 0 else whole[n_out[0] // 2]
            for tiles in (1, 2, 3):
                t_in = -(-n_in[a] // (tiles * 2)) * 2
                if (tiles - 1) * t_in >= n_in[a]:
                    continue
                try:
                    t_out = g.resampled_tile(
                        t_in, n_in[a], n_out[a], scales=op == "interpolate", where="t",
                        tiles=tiles, align=2,
                    )  # fmt: skip
                    plans = [
                        g.resample_1d(coords[a], n_in[a], t_in, t_out, tiles, k, where="t")
                        for k in range(tiles)
                    ]
                except ConfigError:
                    continue  # refused (the tiles cannot hold it): never wrong
                padded = torch.zeros((tiles + 2) * t_in, dtype=torch.float64)
                padded[t_in : t_in + n_in[a]] = line
                got = []
                for k, p in enumerate(plans):
                    window = padded[(k + 1) * t_in - p.before : (k + 2) * t_in + p.after]
                    w = torch.tensor(p.weight, dtype=torch.float64)
                    inside = torch.tensor(p.inside, dtype=torch.float64)
                    v = window[list(p.first)] * (1 - w) + window[list(p.second)] * w
                    got.append(v * inside + (1 - inside) * float(opts.get("value") or 0))
                stitched = torch.cat(got)[: n_out[a]]
                torch.testing.assert_close(stitched, ref, rtol=1e-12, atol=1e-12)


def test_a_flip_or_a_map_that_outgrows_its_tiles_is_refused() -> None:
    flip = [float(15 - r) for r in range(16)]
    with pytest.raises(ConfigError, match="past its neighbour"):
        g.resample_1d(flip, 16, 4, 4, 4, 0, where="module 'm' (F.x)")
    grow = [float(r - 3) if r >= 3 else None for r in range(19)]
    with pytest.raises(ConfigError, match="tiles \\(2 x 8 px\\) hold 16"):
        g.resample_1d(grow, 16, 8, 8, 2, 0, where="module 'm' (F.pad)")
    with pytest.raises(ConfigError, match="3-fold"):
        g.resampled_tile(5, 45, 15, scales=True, where="m", tiles=3, align=1)
    assert g.resampled_tile(19, 37, 75, scales=True, where="m", tiles=2, align=1) == 38
    # 1.4x of 2 x 16 px is 44 px: round(1.4) = 1 leaves 32, so the tiles grow to hold it
    # (a multiple of the align, 4): 2 x 24 px, not a refusal no align could satisfy.
    assert g.resampled_tile(16, 32, 44, scales=True, where="m", tiles=2, align=4) == 24


def test_carried_halos_are_the_chain_halos_of_each_suffix() -> None:
    """Without surplus, the halo a run's layer ``l`` reads is ChainGeom's deep halo of layers
    ``l..end``; a surplus (1x1/s2) is clamped at 0 and the layer reads short."""
    rng = random.Random(5)
    for _ in range(300):
        layers = []
        for _ in range(rng.randint(1, 5)):
            k, s, d = rng.randint(1, 5), rng.randint(1, 2), rng.randint(1, 2)
            extent = d * (k - 1) + 1
            p = rng.randint(0, extent - 1)
            if extent - p - s < 0:
                continue
            layers.append(LayerGeom(k, stride=s, padding=p, dilation=d))
        if not layers:
            continue
        carries = g.carried_halos([(geom, geom) for geom in layers])
        for i, (inn, out) in enumerate(carries):
            assert inn[:2] == inn[2:] == ChainGeom(tuple(layers[i:])).halo
            assert out == (carries[i + 1][0] if i + 1 < len(layers) else (0, 0, 0, 0))
    one_by_two = LayerGeom(1, stride=2)
    assert g.carried_halos([(one_by_two,)]) == [((0, 0), (0, 0))]
    three = LayerGeom(3, padding=1)
    assert g.carried_halos([(three,), (one_by_two,)]) == [((1, 1), (0, 0)), ((0, 0), (0, 0))]
