"""Halo exchange between neighbouring tiles: strips in forward, their adjoint in backward.

Forward (:func:`extend`): each rank surrounds its tile with ``(top, bottom,
left, right)`` rows and columns received from its neighbours; past the image
border it uses a fill value (0 before a convolution, -inf before a max-pool).
The extended tile is allocated **once** and filled in place; corners come for
free by exchanging rows first and then columns *of the row-extended tile*.
Only the received strips are new data: a windowed layer that keeps them (and
the tile it was given, which the layer before usually keeps anyway) can
:func:`rebuild` the extended tile in backward instead of saving it.

Backward (:func:`return_halo_grads`) is the adjoint, not a copy of the
forward: the gradient that lands on a halo belongs to the neighbour that owns
those pixels, so it is sent back and **added** into the owner's border
(REFERENCE.md: dropping it is the classic bug). Fill regions get no gradient.
All messages of a phase go out together with ``batch_isend_irecv``; no
barrier, no global synchronisation.

The code walks the spatial dimensions generically (the last ``len(halo) // 2``
dimensions of the tensor), so the same functions serve 2-D tiles and 3-D
sub-volumes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hyfi_imaging.parallel.first_order import first_order

__all__ = [
    "Neighbours",
    "add_to_parts",
    "exchange_strips",
    "extend",
    "fill_tail",
    "halo_exchange",
    "new_like",
    "rebuild",
    "return_halo_grads",
    "return_strip_grads",
    "strip_box",
    "trailing",
    "window_of",
]


@dataclass(frozen=True)
class Neighbours:
    """Global ranks of the face neighbours of a tile (None past the grid's edge).

    ``front``/``back`` are the neighbours along the depth of a 3-D grid (None on
    a 2-D one); a 2-D exchange reads only the last two pairs.
    """

    up: int | None = None
    down: int | None = None
    left: int | None = None
    right: int | None = None
    front: int | None = None
    back: int | None = None

    @property
    def alone(self) -> bool:
        return all(r is None for pair in self.pairs() for r in pair)

    def pairs(self) -> tuple[tuple[int | None, int | None], ...]:
        """``(before, after)`` neighbour per spatial dimension (depth, rows, columns).

        Callers take the last ``nd`` pairs for an ``nd``-dimensional tile.
        """
        return ((self.front, self.back), (self.up, self.down), (self.left, self.right))


Strips = tuple[torch.Tensor | None, ...]  # received (before, after) per dimension; None = fill


def _exchange(
    sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]
) -> Callable[[], None]:
    """Post one phase's messages; returns the function that waits for them.

    Every halo message passes here (benchmarks count bytes by wrapping it).
    """
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for peer, t in sends]
    for _, t in recvs:
        assert t.is_contiguous(), "receive buffers must be contiguous"
    ops += [dist.P2POp(dist.irecv, t, peer) for peer, t in recvs]
    reqs = dist.batch_isend_irecv(ops) if ops else []

    def wait() -> None:
        for req in reqs:
            req.wait()

    return wait


def _overlapped(
    sends: list[tuple[int, torch.Tensor]],
    recvs: list[tuple[int, torch.Tensor]],
    overlap: Callable[[], None] | None,
) -> Callable[[], None] | None:
    """Exchange one phase; run ``overlap`` while its messages are in flight (if any are).

    Returns ``overlap`` again when this phase had nothing to send or receive
    (a later phase, or the caller, runs it), else None: it has run.
    """
    wait = _exchange(sends, recvs)
    if overlap is not None and (sends or recvs):
        overlap()
        overlap = None
    wait()
    return overlap


def _buffer(like: torch.Tensor) -> torch.Tensor:
    """A receive buffer in standard contiguous layout.

    Never ``empty_like``: it keeps a channels-last layout (which oneDNN
    convolutions produce), and the bytes received are in standard order.
    """
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def new_like(
    x: torch.Tensor,
    shape: Sequence[int],
    *,
    zero: bool = False,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A new tensor of ``shape`` in ``x``'s dtype (or ``dtype``), device and memory layout.

    A channels-last activation (a model that converts its input, cuDNN's
    preferred layout for bf16) keeps its layout through the extended tiles,
    the rebuilt windows and the streamed stem's maps: no kernel then reorders
    the whole tile. Anything else is standard contiguous.
    """
    fmt = torch.contiguous_format
    if len(shape) == x.dim() and not x.is_contiguous():
        for cl in (torch.channels_last, torch.channels_last_3d):
            if x.dim() == (4 if cl is torch.channels_last else 5) and x.is_contiguous(
                memory_format=cl
            ):
                fmt = cl
    out = torch.empty(tuple(shape), dtype=dtype or x.dtype, device=x.device, memory_format=fmt)
    return out.zero_() if zero else out


def trailing(index: Sequence[slice | int]) -> tuple[Any, ...]:
    """The key ``(..., *index)``: ``index`` applies to the last ``len(index)`` dims."""
    return (Ellipsis, *index)


def _pairs(halo: Sequence[int]) -> list[tuple[int, int]]:
    if len(halo) % 2 or any(v < 0 for v in halo):
        raise ValueError(f"halo must be (before, after) pairs of sizes >= 0, got {tuple(halo)}")
    return [(halo[i], halo[i + 1]) for i in range(0, len(halo), 2)]


def fill_tail(t: torch.Tensor, valid: Sequence[int], fill: float) -> None:
    """In place: set index ``>= valid[k]`` along each of the last ``len(valid)`` dims to ``fill``."""
    nd = len(valid)
    for k, v in enumerate(valid):
        dim = t.dim() - nd + k
        n = t.shape[dim]
        if v < n:
            t.narrow(dim, max(v, 0), n - max(v, 0)).fill_(fill)


def _core_view(ext: torch.Tensor, pairs: list[tuple[int, int]], dims: range) -> torch.Tensor:
    """``ext`` narrowed to the tile's own range along ``dims`` (the halos of the others kept)."""
    nd = len(pairs)
    for k in dims:
        before, after = pairs[k]
        dim = ext.dim() - nd + k
        ext = ext.narrow(dim, before, ext.shape[dim] - before - after)
    return ext


def _new_ext(
    x: torch.Tensor, pairs: list[tuple[int, int]], fill: float, valid: Sequence[int] | None
) -> torch.Tensor:
    """The extended tile, allocated once, with the (masked) tile in its centre.

    No halo and nothing to mask: ``x`` itself (a 1x1 convolution, or a layer
    reading the border a deep halo carries), not a copy.
    """
    nd = len(pairs)
    lead, tile = x.shape[: x.dim() - nd], x.shape[x.dim() - nd :]
    if not any(b or a for b, a in pairs) and (
        valid is None or all(v >= t for v, t in zip(valid, tile, strict=True))
    ):
        return x
    shape = (*lead, *(t + b + a for t, (b, a) in zip(tile, pairs, strict=True)))
    ext = new_like(x, shape)
    core = _core_view(ext, pairs, range(nd))
    core.copy_(x)
    if valid is not None:
        fill_tail(core, valid, fill)
    return ext


def _put(
    region: torch.Tensor, dim: int, before: int, after: int, strips: Strips, fill: float
) -> None:
    """Write the received strips (or ``fill`` where no neighbour) into ``region``'s halos."""
    n = region.shape[dim]
    for start, size, strip in ((0, before, strips[0]), (n - after, after, strips[1])):
        if size:
            dst = region.narrow(dim, start, size)
            if strip is None:
                dst.fill_(fill)
            else:
                dst.copy_(strip)


def extend(
    x: torch.Tensor,
    halo: Sequence[int],
    neighbours: Neighbours,
    *,
    fill: float = 0.0,
    valid: Sequence[int] | None = None,
    overlap: Callable[[torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, Strips]:
    """``x`` surrounded by its halo, and the strips received (no autograd).

    ``halo`` is ``(before, after)`` per spatial dimension, e.g. ``(top, bottom,
    left, right)``; ``valid`` (optional) is the number of leading indices per
    dimension that lie inside the image: the rest of the tile is set to
    ``fill`` before anything is sent. Returns ``(extended, strips)`` with
    ``strips`` the received tensors, ``(before, after)`` per dimension, None
    where the halo is fill.

    ``overlap(extended)``, if given, runs once while the first messages are in
    flight, when the extended tile holds its core and the fill past the grid's
    edges but not yet the halos from neighbours (a layer computes the outputs
    that do not read those: communication overlaps computation).
    """
    pairs = _pairs(halo)
    nd = len(pairs)
    ext = _new_ext(x, pairs, fill, valid)
    pending = None
    if overlap is not None:
        # Halos past the grid's edge are fill and known now: the overlapped computation
        # then gets those borders right and only the sides with a neighbour wait.
        for k, ((before, after), (lo, hi)) in enumerate(
            zip(pairs, neighbours.pairs()[-nd:], strict=True)
        ):
            dim = ext.dim() - nd + k
            if lo is None and before:
                ext.narrow(dim, 0, before).fill_(fill)
            if hi is None and after:
                ext.narrow(dim, ext.shape[dim] - after, after).fill_(fill)
        pending = lambda: overlap(ext)  # noqa: E731
    got: list[torch.Tensor | None] = []
    for k, ((before, after), (lo, hi)) in enumerate(
        zip(pairs, neighbours.pairs()[-nd:], strict=True)
    ):
        region = _core_view(ext, pairs, range(k + 1, nd))  # rows of the later dims not yet there
        dim = region.dim() - nd + k
        n = region.shape[dim] - before - after
        sends: list[tuple[int, torch.Tensor]] = []
        recvs: list[tuple[int, torch.Tensor]] = []
        strips: list[torch.Tensor | None] = [None, None]
        if lo is not None:
            if after:  # my first rows are lo's after-halo
                sends.append((lo, region.narrow(dim, before, after)))
            if before:
                buf = _buffer(region.narrow(dim, 0, before))
                recvs.append((lo, buf))
                strips[0] = buf
        if hi is not None:
            if before:  # my last rows are hi's before-halo
                sends.append((hi, region.narrow(dim, n, before)))
            if after:
                buf = _buffer(region.narrow(dim, before + n, after))
                recvs.append((hi, buf))
                strips[1] = buf
        pending = _overlapped(sends, recvs, pending)
        _put(region, dim, before, after, tuple(strips), fill)
        got += strips
    if pending is not None:
        pending()
    return ext, tuple(got)


def rebuild(
    x: torch.Tensor,
    strips: Strips,
    halo: Sequence[int],
    *,
    fill: float = 0.0,
    valid: Sequence[int] | None = None,
) -> torch.Tensor:
    """The extended tile :func:`extend` returned, from the tile and its saved strips (no messages)."""
    pairs = _pairs(halo)
    nd = len(pairs)
    ext = _new_ext(x, pairs, fill, valid)
    for k, (before, after) in enumerate(pairs):
        region = _core_view(ext, pairs, range(k + 1, nd))
        _put(region, region.dim() - nd + k, before, after, strips[2 * k : 2 * k + 2], fill)
    return ext


def window_of(
    x: torch.Tensor,
    strips: Strips,
    halo: Sequence[int],
    box: Sequence[slice],
    *,
    fill: float = 0.0,
    valid: Sequence[int] | None = None,
) -> torch.Tensor:
    """``extend(x, halo, fill=fill, valid=valid)[0][..., *box]`` from the tile and strips alone.

    A rebuilt window (a band of rows, say) instead of the whole extended tile: the
    streamed stem reads its input one band at a time, a spatial convolution's
    backward one band at a time. ``box`` has a slice with explicit bounds per
    spatial dim, in extended-tile indices; a part whose strip is None (no
    neighbour) is ``fill``, and so is the tile past ``valid`` (as :func:`extend`
    masks it). Strip ``k`` spans the extended tile along the dims before ``k`` and
    the tile along the dims after it, as :func:`extend` receives them.
    """
    pairs = _pairs(halo)
    nd = len(pairs)
    tile = x.shape[x.dim() - nd :]
    spans = [(int(b.start), int(b.stop)) for b in box]
    out = new_like(x, (*x.shape[: x.dim() - nd], *(e - s for s, e in spans)))
    # Per dim: the part of the box before the tile, in it and after it, in extended indices.
    parts = []
    for (before, _), n, (s, e) in zip(pairs, tile, spans, strict=True):
        cuts = [(0, max(s, 0), min(e, before)), (1, max(s, before), min(e, before + n)),
                (2, max(s, before + n), e)]  # fmt: skip
        parts.append([c for c in cuts if c[2] > c[1]])

    # Every combination of parts, one per dim (a loop, not a recursive closure: that
    # would be a reference cycle keeping ``out`` alive until the garbage collector ran).
    for chosen in itertools.product(*parts):
        dst = tuple(
            slice(lo - s, hi - s) for (_, lo, hi), (s, _) in zip(chosen, spans, strict=True)
        )
        side = max((d for d, (w, _, _) in enumerate(chosen) if w != 1), default=-1)
        if side < 0:
            src_t: torch.Tensor | None = x
            offsets = [pairs[d][0] for d in range(nd)]
        else:
            which = chosen[side][0]
            src_t = strips[2 * side + (0 if which == 0 else 1)]
            offsets = [
                0
                if d < side
                else (pairs[d][0] if d > side else (0 if which == 0 else pairs[d][0] + tile[d]))
                for d in range(nd)
            ]
        if src_t is None:  # no neighbour there: the fill (each part of the box is written once)
            out[trailing(dst)] = fill
            continue
        src = tuple(slice(lo - o, hi - o) for (_, lo, hi), o in zip(chosen, offsets, strict=True))
        out[trailing(dst)] = src_t[trailing(src)]
    if valid is not None:
        # The tile's part past the image (core indices >= valid along a dim), as _new_ext
        # masks it; the strips come masked by their owners.
        core = out
        for k, ((before, _), n, (s, e)) in enumerate(zip(pairs, tile, spans, strict=True)):
            lo, hi = max(s, before), min(e, before + n)
            if lo >= hi:
                return out  # the box holds none of the tile
            core = core.narrow(out.dim() - nd + k, lo - s, hi - lo)
        starts = [max(s, before) - before for (before, _), (s, _) in zip(pairs, spans, strict=True)]
        fill_tail(core, [v - o for v, o in zip(valid, starts, strict=True)], fill)
    return out


def strip_box(k: int, side: int, halo: Sequence[int], tile: Sequence[int]) -> list[tuple[int, int]]:
    """Extended-tile index ranges, per spatial dim, of strip ``k`` (``side`` 0: before, 1: after).

    Strip ``k`` spans the extended tile along the dims before ``k``, its halo along ``k``
    and the tile along the dims after ``k``: the strips and the tile partition the
    extended tile (the order :func:`extend` exchanges in; corners ride on the later dims).
    """
    pairs = _pairs(halo)
    box = []
    for d, ((before, after), n) in enumerate(zip(pairs, tile, strict=True)):
        if d < k:
            box.append((0, before + n + after))
        elif d > k:
            box.append((before, before + n))
        else:
            box.append((0, before) if side == 0 else (before + n, before + n + after))
    return box


def exchange_strips(
    x: torch.Tensor,
    halo: Sequence[int],
    neighbours: Neighbours,
    *,
    fill: float = 0.0,
    valid: Sequence[int] | None = None,
    overlap: Callable[[], None] | None = None,
) -> Strips:
    """The strips :func:`extend` receives, without building the extended tile (no autograd).

    Why: a layer that computes its interior from the tile itself needs only the
    strips; building the extended tile would copy the whole tile once more. What
    is sent is cut from the tile (masked past ``valid``, as :func:`extend` masks
    it) and, for a later dim, from the strips already received (the corners):
    strip-sized messages, no tile-sized copy. ``overlap()``, if given, runs while
    the first messages are in flight (or at the end when none are sent).
    """
    pairs = _pairs(halo)
    nd = len(pairs)
    tile = [int(v) for v in x.shape[x.dim() - nd :]]
    got: list[torch.Tensor | None] = []
    lead = tuple(x.shape[: x.dim() - nd])
    for k, ((before, after), (lo, hi)) in enumerate(
        zip(pairs, neighbours.pairs()[-nd:], strict=True)
    ):
        known = (*got, *(None,) * (2 * (nd - k)))

        def cut(start: int, size: int, k: int = k, known: Strips = known) -> torch.Tensor:
            box = strip_box(k, 0, halo, tile)
            box[k] = (pairs[k][0] + start, pairs[k][0] + start + size)
            spans = [slice(a, b) for a, b in box]
            return window_of(x, known, halo, spans, fill=fill, valid=valid)

        def empty(side: int, k: int = k) -> torch.Tensor:
            box = strip_box(k, side, halo, tile)
            return torch.empty((*lead, *(b - a for a, b in box)), dtype=x.dtype, device=x.device)

        sends: list[tuple[int, torch.Tensor]] = []
        recvs: list[tuple[int, torch.Tensor]] = []
        strips: list[torch.Tensor | None] = [None, None]
        if lo is not None:
            if after:  # my first positions are lo's after-halo
                sends.append((lo, cut(0, after)))
            if before:
                strips[0] = buf = empty(0)
                recvs.append((lo, buf))
        if hi is not None:
            if before:  # my last positions are hi's before-halo
                sends.append((hi, cut(tile[k] - before, before)))
            if after:
                strips[1] = buf = empty(1)
                recvs.append((hi, buf))
        overlap = _overlapped(sends, recvs, overlap)
        got += strips
    if overlap is not None:
        overlap()
    return tuple(got)


def _add_box(
    into: torch.Tensor,
    into_box: Sequence[tuple[int, int]],
    src: torch.Tensor,
    src_box: Sequence[tuple[int, int]],
) -> None:
    """Add the part of ``src`` (covering extended-tile ranges ``src_box``) that lies in
    ``into_box`` into ``into`` (covering ``into_box``)."""
    both = [
        (max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(into_box, src_box, strict=True)
    ]
    if any(e <= s for s, e in both):
        return
    dst = [slice(s - a0, e - a0) for (s, e), (a0, _) in zip(both, into_box, strict=True)]
    cut = [slice(s - b0, e - b0) for (s, e), (b0, _) in zip(both, src_box, strict=True)]
    into[trailing(dst)].add_(src[trailing(cut)])


def add_to_parts(
    src: torch.Tensor,
    src_box: Sequence[tuple[int, int]],
    halo: Sequence[int],
    tile: Sequence[int],
    strip_grads: Sequence[torch.Tensor | None],
    gx: torch.Tensor | None = None,
) -> None:
    """Add ``src`` (a gradient over extended-tile ranges ``src_box``) into the strips'
    gradients ``strip_grads`` (``(before, after)`` per dim, None where nothing is
    returned) and, if given, its part on the tile into the tile's gradient ``gx``."""
    pairs = _pairs(halo)
    if gx is not None:
        _add_box(gx, [(b, b + n) for (b, _), n in zip(pairs, tile, strict=True)], src, src_box)
    for j, g in enumerate(strip_grads):
        if g is not None:
            _add_box(g, strip_box(j // 2, j % 2, halo, tile), src, src_box)


def _add_returned(
    buf: torch.Tensor,
    box: Sequence[tuple[int, int]],
    halo: Sequence[int],
    tile: Sequence[int],
    strip_grads: Sequence[torch.Tensor | None],
    gx: torch.Tensor,
) -> None:
    """Add a neighbour's returned halo gradient into this tile's border (and corners).

    Every returned gradient of :func:`return_strip_grads` passes here (the tests break it
    on purpose, ``tests/mpi/broken_halo.py``, to prove the checks catch a lost gradient).
    """
    add_to_parts(buf, box, halo, tile, strip_grads, gx)


def return_strip_grads(
    gx: torch.Tensor,
    strip_grads: list[torch.Tensor | None],
    halo: Sequence[int],
    neighbours: Neighbours,
    *,
    valid: Sequence[int] | None = None,
    overlap: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Adjoint of :func:`exchange_strips`: the strips' gradients go to their owners.

    ``gx`` is the tile's own gradient (written in place and returned);
    ``strip_grads`` the gradients of the strips this rank received, ``(before,
    after)`` per dim (None where there is no neighbour). Dims are undone in
    reverse order: what comes back along dim ``k`` covers the extended tile along
    the dims before ``k``, so its part in an earlier dim's halo (a corner) is
    added into that strip's gradient, sent on in its turn. ``overlap()`` runs
    while the first messages are in flight (a layer computes its weight
    gradient). Past ``valid`` the tile's gradient is 0.
    """
    pairs = _pairs(halo)
    nd = len(pairs)
    tile = [int(v) for v in gx.shape[gx.dim() - nd :]]
    for k in reversed(range(nd)):
        (before, after), (lo, hi) = pairs[k], neighbours.pairs()[-nd:][k]
        sends: list[tuple[int, torch.Tensor]] = []
        recvs: list[tuple[int, torch.Tensor, list[tuple[int, int]]]] = []
        for side, peer, width, start in (
            (0, lo, after, before),
            (1, hi, before, before + tile[k] - before),
        ):
            g = strip_grads[2 * k + side]
            if peer is None:
                continue
            if g is not None:
                sends.append((peer, g))
            if width:  # my positions that are the peer's halo
                box = strip_box(k, 0, halo, tile)
                box[k] = (start, start + width)
                buf = torch.empty(
                    (*gx.shape[: gx.dim() - nd], *(b - a for a, b in box)),
                    dtype=gx.dtype, device=gx.device,
                )  # fmt: skip
                recvs.append((peer, buf, box))
        overlap = _overlapped(sends, [(p, b) for p, b, _ in recvs], overlap)
        for _, buf, box in recvs:
            _add_returned(buf, box, halo, tile, strip_grads[: 2 * k], gx)
    if overlap is not None:
        overlap()
    if valid is not None:
        fill_tail(gx, valid, 0.0)
    return gx


def _reduce(
    g: torch.Tensor,
    before: int,
    after: int,
    lo: int | None,
    hi: int | None,
    dim: int,
    overlap: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """Adjoint of one dimension of :func:`extend`, in place in ``g``; returns the core view.

    The halo slices of ``g`` go to their owners; what comes back is added into
    the core's borders (the core and the halos do not overlap). No tile-sized
    copy is made: the result is a view of ``g``. Returns it and ``overlap``
    unless it ran while this dimension's messages were in flight.
    """
    if before == 0 and after == 0:
        return g, overlap
    n = g.shape[dim] - before - after
    core = g.narrow(dim, before, n)
    sends, recvs = [], []
    from_lo = from_hi = None
    if lo is not None:
        if before:
            sends.append((lo, g.narrow(dim, 0, before)))
        if after:
            from_lo = _buffer(core.narrow(dim, 0, after))
            recvs.append((lo, from_lo))
    if hi is not None:
        if after:
            sends.append((hi, g.narrow(dim, before + n, after)))
        if before:
            from_hi = _buffer(core.narrow(dim, n - before, before))
            recvs.append((hi, from_hi))
    overlap = _overlapped(sends, recvs, overlap)
    if from_lo is not None:
        core.narrow(dim, 0, after).add_(from_lo)
    if from_hi is not None:
        core.narrow(dim, n - before, before).add_(from_hi)
    return core, overlap


def return_halo_grads(
    grad: torch.Tensor,
    halo: Sequence[int],
    neighbours: Neighbours,
    *,
    valid: Sequence[int] | None = None,
    overlap: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Adjoint of :func:`extend`: the gradient of the tile from that of the extended tile.

    Dimensions are undone in the reverse order of the forward (columns, then
    rows with their corners); outside the image (``valid``) the gradient is 0.
    Works **in place** in ``grad`` (which must be the caller's own tensor) and
    returns a view of it: a backward that allocated the extended gradient pays
    no further tile-sized copy. ``overlap()``, if given, runs once while the
    first messages are in flight (a layer computes its weight gradient).
    """
    pairs = _pairs(halo)
    nd = len(pairs)
    g = grad
    for k in reversed(range(nd)):
        lo, hi = neighbours.pairs()[-nd:][k]
        g, overlap = _reduce(g, *pairs[k], lo, hi, g.dim() - nd + k, overlap)
    if overlap is not None:
        overlap()
    if valid is not None:
        fill_tail(g, valid, 0.0)
    return g


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, halo: tuple[int, ...], fill: float, nb: Neighbours
    ) -> torch.Tensor:
        ctx.halo, ctx.nb = halo, nb
        return extend(x, halo, nb, fill=fill)[0]

    @staticmethod
    @first_order("a spatial layer's halo exchange")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # autograd owns ``grad``: reduce in a copy
        return return_halo_grads(grad.clone(), ctx.halo, ctx.nb), None, None, None


def halo_exchange(
    x: torch.Tensor, halo: Sequence[int], neighbours: Neighbours, *, fill: float = 0.0
) -> torch.Tensor:
    """Return ``x`` (..., h, w) surrounded by its ``(top, bottom, left, right)`` halo, with autograd.

    A 3-D tile (..., d, h, w) takes ``(front, back, top, bottom, left, right)``.

    Every halo must be no wider than the neighbouring tile (the caller checks);
    all ranks of the grid must call this with the same ``halo``.
    """
    if any(v < 0 for v in halo):
        raise ValueError(f"halo sizes must be >= 0, got {halo}")
    return _HaloExchange.apply(x, tuple(halo), fill, neighbours)
