"""Class activation maps over the slide: what ``hyfi-predict --heatmaps`` writes.

Why class activation maps (CAM, Zhou et al. 2016): a classifier whose head is
``global pool -> Linear`` computes each logit as ``W_c . pool(F) + b_c`` over
the last feature map ``F``. The same linear map applied to every pixel,
``CAM_c(y, x) = sum_k W[c, k] F_k(y, x) + b_c``, says where the evidence for
class ``c`` lies, in logit units, with no second model and no gradient; for
an average pool its mean over the map *is* the logit, exactly. (For a max
pool the map is the same per-pixel logit; the logit is then the Linear of the
per-channel maxima, which no single pixel's value need equal.)

Why tile by tile: at 8192² the map a ResNet pools is 256² x 512 channels; each
spatial rank holds only its tile of it. The head's Linear is applied per pixel
on the tile where it lives (a forward hook on the pool's input and one on the
Linear, for the duration of the prediction: nothing stays on the model), and
only the small ``K``-class tiles are gathered to rank 0 and placed by their
tile origins (:class:`~hyfi_imaging.geometry.tiles.BoxND`). No rank ever holds
``F`` whole, and the stitched map equals one process's (tested in float64 on
1x2 and 2x2 grids).

Why it is checked twice: :func:`cam_head` refuses, before any rank starts, a
model whose last global pool is not followed by pass-through layers
(flatten, dropout, identity) and one ``Linear`` (naming the head); and during
the prediction every batch proves it on the live model: the Linear's input
must be the pool's output and the model's logits the Linear's output, or the
run stops with one line instead of writing maps of something else.

Where the maps lie on the slide and what is written: :mod:`.heatmap_files`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.geometry.tiles import BoxND
from hyfi_imaging.parallel.meta import shape_copy

if TYPE_CHECKING:
    from hyfi_imaging.parallel.engine import ParallelModel
    from hyfi_imaging.train.config import Recipe
    from hyfi_imaging.train.tasks import Cohort
    from hyfi_imaging.train.trainer import Trainer

__all__ = ["CamHead", "CamRecorder", "cam_head", "heatmap_head", "predict_heatmaps"]

log = logging.getLogger("hyfi_imaging.train")

WHERE = "hyfi-predict --heatmaps"

#: Layers that pass the pooled features to the Linear unchanged in evaluation.
_PASS_THROUGH = (nn.Flatten, nn.Dropout, nn.Identity)


@dataclass(frozen=True)
class CamHead:
    """Where a classifier's class activation map comes from, and its size.

    Attributes:
        pool: module path of the global pool whose input is the map ``F``.
        linear: module path of the ``nn.Linear`` applied to the pooled features.
        kind: ``"avg"`` or ``"max"``, the pool's reduction.
        feature_hw: the true (unpadded) ``(h, w)`` of ``F`` for the model's input size.
        stride: input pixels per map pixel ``(sy, sx)`` (the model's tile alignment).
    """

    pool: str
    linear: str
    kind: Literal["avg", "max"]
    feature_hw: tuple[int, int]
    stride: tuple[int, int]


def _is_global_pool(m: nn.Module) -> bool:
    if not isinstance(m, nn.AdaptiveAvgPool2d | nn.AdaptiveMaxPool2d):
        return False
    size = m.output_size
    return all(v == 1 for v in size) if isinstance(size, tuple | list) else size == 1


def _describe(leaves: Sequence[tuple[str, nn.Module]]) -> str:
    return " -> ".join(f"{path} ({type(m).__name__})" for path, m in leaves)


def cam_head(model: nn.Module, *, name: str, image_hw: Sequence[int], in_chans: int) -> CamHead:
    """The :class:`CamHead` of ``model`` for ``image_hw`` inputs, or ConfigError naming its head.

    The model's leaf modules in order must end ``global pool (2-D, output 1) ->
    [Flatten | Dropout | Identity]* -> Linear``. The map's size and stride
    come from a meta-device run of a copy (no memory, no compute).
    """
    from hyfi_imaging.parallel.spatial import tile_alignment

    leaves = [(p, m) for p, m in model.named_modules() if p and not any(m.children())]
    pools = [i for i, (_, m) in enumerate(leaves) if _is_global_pool(m)]
    start = int(getattr(model, "head_start", -1))
    children = [n for n, _ in model.named_children()]
    head_names = set(children[start:]) if start >= 0 else set()
    head = [(p, m) for p, m in leaves if p.split(".")[0] in head_names] or leaves[-4:]
    fix = (
        "class activation maps need a classifier whose head is a global pool followed by one "
        "Linear; predict without --heatmaps"
    )
    if not pools:
        raise ConfigError(
            WHERE, f"model {name!r} has no global pool (head: {_describe(head)})", fix
        )
    at = pools[-1]
    after = leaves[at + 1 :]
    core = [leaf for leaf in after if not isinstance(leaf[1], _PASS_THROUGH)]
    if len(core) != 1 or not isinstance(core[0][1], nn.Linear) or after[-1] is not core[0]:
        raise ConfigError(
            WHERE,
            f"model {name!r} has the head {_describe(leaves[at:])}, not global pool -> Linear",
            fix,
        )
    pool_path, pool = leaves[at]
    sizes: list[tuple[int, int]] = []
    meta = shape_copy(model)

    def record(_: nn.Module, args: tuple[Any, ...]) -> None:
        sizes.append((int(args[0].shape[-2]), int(args[0].shape[-1])))

    hook = dict(meta.named_modules())[pool_path].register_forward_pre_hook(record)
    try:
        with torch.no_grad(), torch.device("meta"):
            dtype = next((t.dtype for t in meta.parameters()), torch.get_default_dtype())
            meta(torch.empty(1, in_chans, *image_hw, device="meta", dtype=dtype))
    finally:
        hook.remove()
    if len(sizes) != 1:
        raise ConfigError(
            WHERE, f"model {name!r} calls its pool {pool_path!r} {len(sizes)} times", fix
        )
    align = tile_alignment(model, 2, in_chans=in_chans)
    expected = tuple(-(-int(n) // align) for n in image_hw)
    if sizes[0] != expected:  # e.g. unpadded convolutions: the map is not the image / stride
        log.warning(
            "%s: model %r pools a %dx%d map from a %s image, not ceil(image / %d) = %dx%d: "
            "its pixels are placed at stride %d from the top-left corner, which may be off by "
            "up to %d px",
            WHERE,
            name,
            *sizes[0],
            "x".join(map(str, image_hw)),
            align,
            *expected,
            align,
            align * max(abs(a - b) for a, b in zip(sizes[0], expected, strict=True)),
        )
    return CamHead(
        pool=pool_path,
        linear=core[0][0],
        kind="avg" if isinstance(pool, nn.AdaptiveAvgPool2d) else "max",
        feature_hw=sizes[0],
        stride=(align, align),
    )


def heatmap_head(recipe: Recipe, cohort: Cohort) -> CamHead:
    """The recipe's :class:`CamHead` for its cohort, built on the meta device (no memory).

    Refused in one line for another task than classification or a head
    :func:`cam_head` refuses: the check hyfi-predict runs before any rank starts.
    """
    from hyfi_imaging.train.inputs import build_model
    from hyfi_imaging.train.tasks import num_outputs

    if recipe.task.name != "classification":
        raise ConfigError(
            WHERE,
            f"the run's task is {recipe.task.name}: heat maps are class activation maps of a "
            "classifier",
            "predict without --heatmaps (segmentation writes masks/ and overlays/)",
        )
    with torch.device("meta"):
        model = build_model(recipe, cohort.channels, num_outputs(recipe, cohort))
    hw = (int(cohort.size[0]), int(cohort.size[1]))
    return cam_head(model, name=recipe.model.name, image_hw=hw, in_chans=cohort.channels)


def _full(t: Tensor) -> Tensor:
    """A parameter as one tensor (an FSDP2 shard outside its unit's forward is gathered)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _head_stage(pm: ParallelModel, head: CamHead) -> int:
    """The pipeline stage holding both the pool and the Linear; ConfigError when they part."""
    from hyfi_imaging.parallel.pipeline import stage_bounds

    bounds = stage_bounds(pm.balance)
    where: dict[str, int] = {}
    for path in (head.pool, head.linear):
        top = path.split(".")[0]
        index = pm.layer_names.index(top) if top in pm.layer_names else len(pm.layer_names) - 1
        where[path] = next(s for s, (a, b) in enumerate(bounds) if a <= index < b)
    if where[head.pool] != where[head.linear]:
        raise ConfigError(
            WHERE,
            f"the pool {head.pool!r} is on pipeline stage {where[head.pool]} and the Linear "
            f"{head.linear!r} on stage {where[head.linear]}",
            "predict with --pipeline 1 (prediction needs no pipeline for memory at stride 32)",
        )
    return where[head.pool]


class CamRecorder:
    """This rank's tile of every class map during :meth:`ParallelModel.predict`; stitched on rank 0.

    Use as a context manager around the predictions (the hooks live only
    inside it) and call :meth:`take` with each batch's logits, on every rank
    (it is collective). ``dp`` must be 1 (as in hyfi-predict).
    """

    def __init__(self, pm: ParallelModel, head: CamHead) -> None:
        layout = pm.plan.layout
        if layout.dp != 1 or layout.junction:
            raise ConfigError(
                WHERE,
                f"layout {layout.describe()}: heat maps are gathered over one replica of one grid",
                "predict with --spatial and --pipeline only",
            )
        self.pm, self.head = pm, head
        self.stage = _head_stage(pm, head)
        self.holds_head = pm.pp_rank == self.stage
        self._hooks: list[Any] = []
        self._feature: Tensor | None = None
        self._pooled: Tensor | None = None
        self._tiles: list[Tensor] = []
        self._outs: list[Tensor] = []
        self._fed = True  # the Linear's input was the pool's output in every call

    # -- hooks -----------------------------------------------------------------------------
    def _on_pool_input(self, _: nn.Module, args: tuple[Any, ...]) -> None:
        self._feature = args[0].detach()

    def _on_pool_output(self, _: nn.Module, args: tuple[Any, ...], out: Tensor) -> None:
        self._pooled = out.detach()

    def _on_linear(self, m: nn.Module, args: tuple[Any, ...], out: Tensor) -> None:
        f, pooled, self._feature, self._pooled = self._feature, self._pooled, None, None
        x = args[0].detach()
        if (
            f is None
            or pooled is None
            or not torch.equal(
                x.reshape(x.shape[0], -1), pooled.reshape(pooled.shape[0], -1).to(x.dtype)
            )
        ):
            self._fed = False
            return
        assert isinstance(m, nn.Linear)
        w = _full(m.weight).detach().to(torch.float64)
        b = (
            _full(m.bias).detach().to(torch.float64)
            if m.bias is not None
            else w.new_zeros(w.shape[0])
        )
        cam = torch.einsum("ck,nkyx->ncyx", w, f.to(torch.float64)) + b[None, :, None, None]
        self._tiles.append(cam)
        self._outs.append(out.detach())

    def __enter__(self) -> CamRecorder:
        if self.holds_head:
            mods = dict(self.pm.module.named_modules())
            pool, linear = mods[self.head.pool], mods[self.head.linear]
            self._hooks = [
                pool.register_forward_pre_hook(self._on_pool_input),
                pool.register_forward_hook(self._on_pool_output),
                linear.register_forward_hook(self._on_linear),
            ]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- per batch -------------------------------------------------------------------------
    def take(self, logits: Tensor) -> np.ndarray | None:
        """The batch's ``(N, K, fh, fw)`` float64 maps on global rank 0 (None elsewhere).

        Collective over the world: every rank agrees first that the head was
        what :func:`cam_head` promised (else ConfigError everywhere), then the
        head stage's tiles are gathered to its tile ``(0, 0)`` rank and placed
        by their origins; with a pipeline that rank passes the map to rank 0.
        """
        pc = self.pm.pc
        n, k = int(logits.shape[0]), int(logits.shape[1])
        bad = torch.zeros(1, device=pc.device)
        tile: Tensor | None = None
        if self.holds_head:
            outs = torch.cat(self._outs) if self._outs else None
            ok = self._fed and outs is not None and outs.shape[0] == n
            ok = ok and torch.equal(outs.to(logits.dtype), logits)  # type: ignore[union-attr]
            bad += 0.0 if ok else 1.0
            if ok:
                tile = torch.cat(self._tiles)
        self._tiles, self._outs, self._fed = [], [], True
        if dist.is_initialized():
            dist.all_reduce(bad, group=dist.group.WORLD)
        if bad.item():
            raise ConfigError(
                WHERE,
                f"the model's logits are not its Linear {self.head.linear!r} applied to its pool "
                f"{self.head.pool!r} (the forward does more than global pool -> Linear)",
                "predict without --heatmaps",
            )
        whole = self._stitch(tile, n, k) if self.holds_head else None
        return self._to_rank0(whole, n, k)

    def _stitch(self, tile: Tensor | None, n: int, k: int) -> Tensor | None:
        """The whole map on the head stage's tile ``(0, 0)`` rank (None on its other tiles)."""
        assert tile is not None
        pc = self.pm.pc
        fh, fw = self.head.feature_hw
        grid = pc.grid
        if math.prod(grid) == 1:
            return tile[..., :fh, :fw].contiguous()
        group = pc.group("sp")
        size = (int(tile.shape[-2]), int(tile.shape[-1]))
        if grid[0] * size[0] < fh or grid[1] * size[1] < fw:
            raise ConfigError(
                WHERE,
                f"{grid[0]}x{grid[1]} map tiles of {size[0]}x{size[1]} cannot hold the "
                f"{fh}x{fw} map",
                "report this: the pool's input is not tiled like the image",
            )
        tile = tile.contiguous()
        mine = dist.get_rank(group) == 0
        parts = (
            [torch.empty_like(tile) for _ in range(dist.get_world_size(group))] if mine else None
        )
        # On the group's device (NCCL gathers device tensors, Gloo CPU ones).
        dist.gather(tile, parts, group=group, group_dst=0)
        if not mine:
            return None
        assert parts is not None
        whole = tile.new_empty(n, k, grid[0] * size[0], grid[1] * size[1])
        for g, part in enumerate(parts):
            coords = pc.layout.coords(dist.get_global_rank(group, g))[2:]
            box = BoxND(tuple(c * t for c, t in zip(coords, size, strict=True)), size)
            whole[(slice(None), slice(None), *box.slices())] = part
        return whole[..., :fh, :fw].contiguous()

    def _to_rank0(self, whole: Tensor | None, n: int, k: int) -> np.ndarray | None:
        """Along the tile ``(0, 0)`` pipeline ranks from the head's stage to global rank 0."""
        pc = self.pm.pc
        if self.pm.plan.layout.pp > 1 and all(c == 0 for c in pc.tile):
            if whole is None:
                fh, fw = self.head.feature_hw
                whole = torch.empty(n, k, fh, fw, dtype=torch.float64, device=pc.device)
            dist.broadcast(whole, group=pc.group("pp"), group_src=self.stage)
        if pc.rank != 0:
            return None
        assert whole is not None
        return whole.cpu().numpy()


def predict_heatmaps(
    trainer: Trainer,
    manifest: Path,
    indices: Sequence[int],
    out_dir: Path,
    head: CamHead,
    *,
    progress: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Class log-probabilities of ``indices`` (:meth:`Trainer.predict` with ``log``) and, on rank 0, each
    slide's map as ``out_dir/<id>.zarr`` and ``out_dir/<id>.png``.

    Collective: every rank calls it. ``progress`` (rank 0) hears the number of
    slides written so far.
    """
    from hyfi_imaging.paths import under
    from hyfi_imaging.train.heatmap_files import write_heatmap, write_heatmap_png

    r = trainer.recipe
    samples = trainer.samples
    written = 0

    def each(logits: Tensor, rows: list[int]) -> None:
        nonlocal written
        maps = rec.take(logits)
        if maps is None:
            return
        probs = torch.softmax(logits.double(), dim=1).cpu().numpy()
        for k, i in enumerate(rows):
            s = samples[i]
            write_heatmap(
                under(out_dir, f"{s.slide_id}.zarr"),
                maps[k],
                image=s.path,
                level=r.data.level,
                stride=head.stride,
                pool=head.kind,
                classes=r.data.classes,
                logits=logits[k].tolist(),
            )
            write_heatmap_png(
                under(out_dir, f"{s.slide_id}.png"),
                maps[k],
                image=s.path,
                level=r.data.level,
                stride=head.stride,
                classes=r.data.classes,
                title=f"{s.slide_id}: class activation maps",
                probs=probs[k].tolist(),
            )
            written += 1
            if progress is not None:
                progress(written)

    with CamRecorder(trainer.pm, head) as rec:
        return trainer.predict(manifest, indices, on_batch=each, log=True)
