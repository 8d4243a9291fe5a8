"""What ``hyfi-train`` checks before any process group or allocation (``hyfi-train --check``).

Every rank runs :func:`preflight` first, so a bad manifest, layout or run
directory ends the job with one line before anything is computed or written;
:func:`plan_of` turns a recipe's ``parallel`` section into the engine's plan
(used here on a meta-device model, and by the trainer for the real one).

**One kind of image, resolutions said and kept** (:func:`run_facts`). A model
learns the stains and the magnifications it is shown: an H&E slide among
DAPI/FITC/Cy3 slides trains without an error and means nothing, so the usable
slides of a manifest (and of the validation manifest) must hold the same
channels (count, names and type, from each store's JSON). Resolution is
stated, then kept: a training cohort whose µm/px (the manifest's ``mpp``) span
more than :data:`MPP_TOLERANCE` -- ``--fit fit``, the default, shrinks the
slides whose tissue outgrows the canvas -- trains, with one warning line
naming the range and the slides ``--fit`` changed (and ``summary.json``'s
``cohort``); a model is then applied only to the resolutions it was trained
on: validation slides, and ``hyfi-train`` (resume) and ``hyfi-predict`` slides
against the checkpoint's recorded range (:func:`check_trained`), are refused
outside that range (beyond the tolerance), naming the slides. A slide whose
µm/px is unknown (an older or synthetic store) is compared with nothing: only
two recorded values can disagree.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.train.config import ParallelConfig, Recipe
from hyfi_imaging.train.rundir import StartMode

if TYPE_CHECKING:
    from hyfi_imaging.parallel.engine import ParallelPlan
    from hyfi_imaging.parallel.layout import Layout
    from hyfi_imaging.train.tasks import Cohort

__all__ = [
    "check_layout",
    "FACT_KEYS",
    "MPP_TOLERANCE",
    "CohortFacts",
    "check_trained",
    "cohort_facts",
    "mpp_differs",
    "plan_of",
    "preflight",
    "run_facts",
    "turn_warning",
]

#: How far two µm/px may lie apart and still be one resolution: 5 % of the smaller.
MPP_TOLERANCE = 0.05
#: The keys of a checkpoint's meaning that :func:`check_trained` compares (not exactly).
FACT_KEYS = ("channel names", "pixel type", "mpp")


def preflight(
    recipe: Recipe, *, start: StartMode = "resume", stores: bool = False
) -> CohortFacts | None:
    """Every check that needs no process group: runs on every rank before any allocation.

    ``hyfi-train --check`` runs exactly this, with ``stores=True``: the
    manifests (usable slides or volumes, one image size, a label on every
    training slide, label images or regression targets for the task), the
    layout against the model and the image (grid, stages, balance,
    checkpointing, micro-batches; the model is built on the meta device), and
    the run directory (writable, free space, ``--no-resume`` into a used one).

    Returns the training slides' :class:`CohortFacts` (``None`` for volumes).
    ``stores``: also check every store the manifests name (:func:`_check_stores`).
    A launch leaves it off: it stats every shard of the cohort, on every rank,
    and the readers check the shards of each region they read anyway.
    """
    from hyfi_imaging.data.dataset import load_samples
    from hyfi_imaging.train.inputs import check_data, check_stats, data_pixels
    from hyfi_imaging.train.rundir import check_start
    from hyfi_imaging.train.tasks import check_task, load_cohort, manifest_kind

    classify = recipe.task.name == "classification"
    if classify and manifest_kind(recipe.data.manifest) == "slides":  # labels first, as always
        samples = load_samples(recipe.data.manifest, classes=recipe.data.classes)
        _check_labels(recipe.data.manifest, samples, len(recipe.data.classes))
    cohort = load_cohort(recipe, recipe.data.manifest)
    check_task(recipe, cohort, recipe.data.manifest)
    facts = run_facts(recipe)
    _check_named_stores(cohort, recipe.data.manifest)  # on every launch: a stat a store
    _check_level(cohort, recipe.data.manifest, recipe.data.level)  # and its JSON
    if stores:
        _check_stores(cohort, recipe.data.manifest)
    if cohort.kind == "slides":
        check_data(recipe, data_pixels(recipe))
    else:  # a wrong count failed after set-up with a traceback
        check_stats(recipe, cohort.channels)
    if recipe.data.val_manifest is not None:
        val = load_cohort(recipe, recipe.data.val_manifest)
        check_task(recipe, val, recipe.data.val_manifest)
        _check_named_stores(val, recipe.data.val_manifest)
        _check_level(val, recipe.data.val_manifest, recipe.data.level)
        _check_disjoint(cohort, recipe.data.manifest, val, recipe.data.val_manifest)
        if stores:
            _check_stores(val, recipe.data.val_manifest)
        if classify:
            val_samples = load_samples(recipe.data.val_manifest, classes=recipe.data.classes)
            _check_labels(recipe.data.val_manifest, val_samples, len(recipe.data.classes))
        if (val.kind, val.channels) != (cohort.kind, cohort.channels) or (
            cohort.kind == "slides"
            and data_pixels(recipe).dtype
            != data_pixels(
                recipe.model_copy(
                    update={
                        "data": recipe.data.model_copy(
                            update={"manifest": recipe.data.val_manifest}
                        )
                    }
                )
            ).dtype
        ):
            raise ConfigError(
                recipe.data.val_manifest,
                f"holds {_pixels(recipe, recipe.data.val_manifest, val)}, the training data "
                f"{_pixels(recipe, recipe.data.manifest, cohort)}",
                "validate on images preprocessed like the training images",
            )
    p = recipe.parallel
    if recipe.train.batch_size % p.microbatches:
        raise ConfigError(
            "train.batch_size",
            f"{recipe.train.batch_size} is not divisible by parallel.microbatches {p.microbatches}",
            "make the batch a multiple of the micro-batch count",
        )
    from hyfi_imaging.train.split import check_full_batch, training_count

    check_full_batch(training_count(recipe, cohort), p.data, recipe.train.batch_size)
    check_layout(recipe, cohort)
    out = recipe.train.out_dir
    check_start(out, start)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"x" * 4096)
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            out,
            f"output directory is not writable ({err.strerror or err})",
            "choose another train.out_dir",
        ) from err
    free = shutil.disk_usage(out).free
    if free < 256 * 2**20:
        raise ConfigError(
            out,
            f"only {free / 2**20:.0f} MiB free on the output disk",
            "free space or choose another train.out_dir",
        )
    return facts


def mpp_differs(a: float | None, b: float | None) -> bool:
    """True when both µm/px are known and lie more than :data:`MPP_TOLERANCE` apart."""
    return a is not None and b is not None and abs(a - b) > MPP_TOLERANCE * min(a, b)


def _listed(items: Sequence[str], shown: int = 3) -> str:
    """``"a, b, c and 4 more"``."""
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


@dataclass(frozen=True)
class CohortFacts:
    """What the usable slides of a manifest are: each one's µm/px, and their channels.

    ``mpp``: each slide's µm/px as its manifest row states it (its store's where the row
    is blank; ``None``: unknown); ``fit_scale``: what ``--fit fit`` shrank it by (1: as asked);
    ``channel_names`` and ``dtype``: what every store holds (checked alike).
    """

    manifest: str
    ids: tuple[str, ...]
    mpp: tuple[float | None, ...]
    fit_scale: tuple[float, ...]
    channel_names: tuple[str, ...]
    dtype: str

    @property
    def mpp_range(self) -> tuple[float, float] | None:
        """The lowest and highest known µm/px of the cohort (``None``: none known)."""
        known = [m for m in self.mpp if m is not None]
        return (min(known), max(known)) if known else None

    def outside(self, low: float, high: float) -> list[str]:
        """``"id (1.93)"`` for every slide whose µm/px lies outside ``[low, high]`` by more
        than :data:`MPP_TOLERANCE` (:func:`mpp_differs` with the nearer end)."""
        return [
            f"{i} ({m:.3g})"
            for i, m in zip(self.ids, self.mpp, strict=True)
            if m is not None
            and ((m < low and mpp_differs(m, low)) or (m > high and mpp_differs(m, high)))
        ]

    def mixed_warning(self) -> str | None:
        """One line when the slides' µm/px span more than :data:`MPP_TOLERANCE`, else None."""
        span = self.mpp_range
        if span is None or not mpp_differs(*span):
            return None
        fitted = [i for i, f in zip(self.ids, self.fit_scale, strict=True) if f < 1.0]
        why = f" (--fit fit shrank {_listed(fitted)})" if fitted else ""
        return (
            f"{self.manifest}: the slides span {span[0]:.3g}-{span[1]:.3g} µm/px{why}: the "
            "model learns from several resolutions and is applied only within this range; "
            "to train at one, preprocess with a larger --size or --fit crop"
        )

    def channels_said(self) -> str:
        """``"3 uint16 channels (DAPI, FITC, Cy3)"``."""
        n = len(self.channel_names)
        return f"{n} {self.dtype} channel{'s' * (n != 1)} ({_listed(self.channel_names, 8)})"

    def record(self) -> dict[str, Any]:
        """The facts as the run's ``summary.json`` states them (JSON-able)."""
        from hyfi_imaging.preprocess.canvas import asked_mpp

        slides: dict[str, dict[str, Any]] = {}
        for i, m, f in zip(self.ids, self.mpp, self.fit_scale, strict=True):
            slides[i] = {"mpp": m, "fit_scale": f}
            if f < 1.0:  # --fit fit changed it: what was asked
                slides[i]["asked_mpp"] = asked_mpp(m, f)
        return {
            "manifest": self.manifest,
            "channels": list(self.channel_names),
            "dtype": self.dtype,
            "mpp_range": None if self.mpp_range is None else list(self.mpp_range),
            "mpp_tolerance": MPP_TOLERANCE,
            "fit_changed": [i for i, f in zip(self.ids, self.fit_scale, strict=True) if f < 1.0],
            "slides": slides,
        }


def cohort_facts(manifest: Path) -> CohortFacts | None:
    """The :class:`CohortFacts` of a slide manifest (``None`` for a volume manifest).

    Raises ConfigError (one line naming the slides and their values) when the
    usable slides hold different channels (µm/px that differ are stated, not
    refused: :meth:`CohortFacts.mixed_warning`), and when a slide's µm/px in the manifest
    is not its store's (an edited or foreign manifest; a blank cell takes the store's).
    Reads the manifest and each store's JSON, no pixel.
    """
    from hyfi_imaging.data.dataset import load_samples, manifest_rows
    from hyfi_imaging.io.zarr_store import read_store_pixels
    from hyfi_imaging.train.tasks import manifest_kind

    if manifest_kind(manifest) != "slides":
        return None
    samples = load_samples(manifest, labels=False)
    path, rows = manifest_rows(manifest)
    by_id = {r.slide_id: r for r in rows if r.status == "ok"}
    kinds: dict[tuple[tuple[str, ...], str], list[str]] = {}
    mpp = {i: r.mpp for i, r in by_id.items()}
    for s in samples:
        pixels = read_store_pixels(s.path)
        if pixels is None:  # not a finished store: the loader (and --check) say so
            continue
        kinds.setdefault((pixels.channel_names, pixels.dtype), []).append(s.slide_id)
        stated, own = mpp[s.slide_id], pixels.mpp
        if stated is not None and own is not None and not math.isclose(stated, own, rel_tol=1e-4):
            raise ConfigError(
                path,
                f"slide {s.slide_id}: the manifest says {stated:g} µm/px, its store {s.path} "
                f"is at {own:g} (the manifest was edited, or names other stores)",
                "use the manifest hyfi-preprocess wrote beside these stores, or re-run it",
            )
        mpp[s.slide_id] = stated if stated is not None else own
    ids = tuple(s.slide_id for s in samples)
    groups = list(kinds)  # the first slide's kind first
    names, dtype = groups[0] if groups else ((), "")
    others = groups[1:]
    facts = CohortFacts(
        str(path),
        ids,
        tuple(mpp[i] for i in ids),
        tuple(by_id[i].fit_scale for i in ids),
        names,
        dtype,
    )
    if others:
        said = "; ".join(
            f"{_listed(kinds[k])} hold {len(k[0])} {k[1]} ({_listed(k[0], 8)})" for k in others
        )
        raise ConfigError(
            path,
            f"slides hold different channels: {_listed(kinds[(names, dtype)])} hold "
            f"{facts.channels_said()}, but {said}",
            "keep one kind of image per manifest (one stain, one channel set): preprocess "
            "the others into a manifest of their own",
        )
    return facts


def run_facts(recipe: Recipe) -> CohortFacts | None:
    """The training manifest's :class:`CohortFacts`, its validation manifest checked against them.

    ``None`` for volumes. Raises ConfigError as :func:`cohort_facts` does, and
    when the validation slides hold other channels or lie outside the training
    slides' µm/px range.
    """
    facts = cohort_facts(recipe.data.manifest)
    val_manifest = recipe.data.val_manifest
    if facts is None or val_manifest is None:
        return facts
    val = cohort_facts(val_manifest)
    if val is None:
        return facts
    check_trained(
        val,
        {"channel names": list(facts.channel_names), "mpp": facts.mpp_range},
        val_manifest,
        "validate on slides preprocessed like the training slides",
        source=f"the training manifest {recipe.data.manifest}",
    )
    return facts


def check_trained(
    facts: CohortFacts | None,
    meaning: dict[str, Any],
    where: object,
    fix: str,
    *,
    source: str = "this checkpoint",
) -> None:
    """ConfigError unless ``facts``' slides hold the channels and µm/px ``meaning`` records.

    ``meaning`` is a checkpoint's recorded meaning (:data:`FACT_KEYS`) and
    ``source`` names where it comes from; a key it lacks (a checkpoint written
    before they were recorded) or a µm/px either side does not know is not
    compared. The line names the slides that differ and their values.
    """
    if facts is None:
        return
    names = meaning.get("channel names")
    known = bool(facts.channel_names)  # no finished store: the loader says why
    if known and isinstance(names, list) and tuple(names) != facts.channel_names:
        raise ConfigError(
            where,
            f"channels differ from {source}'s: it has {len(names)} ({_listed(names, 8)}), "
            f"the slides of {facts.manifest} ({_listed(facts.ids)}) hold {facts.channels_said()}",
            f"give it slides of those channels, or {fix}",
        )
    dtype = meaning.get("pixel type")
    if known and isinstance(dtype, str) and dtype != facts.dtype:
        # the same names on another type: every input on another scale (uint8 slides were
        # 1/256 of a uint16 model's range, and its calls flipped without a word)
        raise ConfigError(
            where,
            f"pixel type differs from {source}'s: it was trained on {dtype} pixels, the "
            f"slides of {facts.manifest} ({_listed(facts.ids)}) hold {facts.channels_said()}",
            f"give it slides of {dtype} pixels (hyfi-preprocess keeps the source's type), or {fix}",
        )
    span = _recorded_range(meaning.get("mpp"))
    if span is not None:
        off = facts.outside(*span)
        if off:
            said = f"{span[0]:.3g}" if span[0] == span[1] else f"{span[0]:.3g}-{span[1]:.3g}"
            raise ConfigError(
                where,
                f"resolution lies outside {source}'s {said} µm/px by more than "
                f"{MPP_TOLERANCE:.0%} for slides of {facts.manifest}: {_listed(off)} µm/px",
                f"preprocess them at {span[0]:.3g} µm/px (hyfi-preprocess --mpp "
                f"{span[0]:.3g}), or {fix}",
            )


def unknown_mpp_note(facts: CohortFacts | None, meaning: Any) -> str | None:
    """One line when a checkpoint records the µm/px it was trained at and some slides record
    none: nothing compares them (:func:`check_trained` cannot), and a PNG converted at 4x the
    magnification was predicted without a word."""
    if facts is None or not isinstance(meaning, dict):
        return None
    span = _recorded_range(meaning.get("mpp"))
    unknown = [i for i, m in zip(facts.ids, facts.mpp, strict=True) if m is None]
    if span is None or not unknown:
        return None
    said = f"{span[0]:.3g}" if span[0] == span[1] else f"{span[0]:.3g}-{span[1]:.3g}"
    return (
        f"{facts.manifest}: {_listed(unknown)} record no µm/px, so nothing says they are at the "
        f"{said} µm/px the model was trained at; predicted as they are (preprocess them with "
        f"--mpp-override <their µm/px> --mpp {span[0]:.3g} to be sure)"
    )


def _pixels(recipe: Recipe, manifest: Path, cohort: Any) -> str:
    """``"5-channel uint16 slides"``: a cohort's images as a line names them."""
    from hyfi_imaging.train.inputs import data_pixels

    if cohort.kind != "slides":
        return f"{cohort.channels}-channel {cohort.kind}"
    data = recipe.data.model_copy(update={"manifest": manifest})
    dtype = data_pixels(recipe.model_copy(update={"data": data})).dtype
    return f"{cohort.channels}-channel {dtype} {cohort.kind}"


def _recorded_range(value: Any) -> tuple[float, float] | None:
    """A recorded µm/px: a number (checkpoints before ranges) or ``[low, high]``; else None."""

    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    if number(value):
        return float(value), float(value)
    if isinstance(value, list | tuple) and len(value) == 2 and all(map(number, value)):
        return float(value[0]), float(value[1])
    return None


def _check_named_stores(cohort: Cohort, manifest: Path) -> None:
    """ConfigError unless every store ``manifest`` names exists and is its image's alone (a
    missing one failed at its first read, after the run's folder was made; two ids on one
    store, a copied row renamed, could train on one and validate on the other)."""
    missing = [
        (i, s) for i, s in zip(cohort.ids, cohort.stores, strict=True) if not os.path.exists(s)
    ]
    if missing:
        raise ConfigError(
            manifest,
            f"{len(missing)} store(s) it names do not exist ({missing[0][0]}: {missing[0][1]})",
            "fix their path column or preprocess them again",
        )
    seen: dict[str, str] = {}
    for sid, store in zip(cohort.ids, cohort.stores, strict=True):
        key = os.path.realpath(store)
        if key in seen:
            raise ConfigError(
                manifest,
                f"{seen[key]} and {sid} name one store ({store})",
                "give each image its own store (a row copied and renamed?)",
            )
        seen[key] = sid


def _check_disjoint(train: Cohort, manifest: Path, val: Cohort, val_manifest: Path) -> None:
    """ConfigError when an image of ``val_manifest`` is one of the training manifest's, by id
    or by store: validation scored images the model trained on, without a word."""
    ids = set(train.ids) & set(val.ids)
    stores = {os.path.realpath(s) for s in train.stores}
    shared = sorted(ids) or [i for i, s in zip(val.ids, val.stores, strict=True)
                             if os.path.realpath(s) in stores]  # fmt: skip
    if shared:
        raise ConfigError(
            val_manifest,
            f"{len(shared)} of its images are training images of {manifest} (e.g. {shared[0]})",
            "validate on images the training manifest does not list",
        )


def _check_level(cohort: Cohort, manifest: Path, level: int) -> None:
    """ConfigError unless every slide store holds pyramid level ``level`` (``data.level``):
    a small slide's pyramid stops early, and a run read it as a damaged store mid-start."""
    if cohort.kind != "slides" or level == 0:
        return
    from hyfi_imaging.io.zarr_store import store_levels

    short = [
        (i, n)
        for i, store in zip(cohort.ids, cohort.stores, strict=True)
        if (n := store_levels(store)) is not None and n <= level
    ]
    if short:
        fewest = min(n for _, n in short)
        raise ConfigError(
            "data.level",
            f"is {level}, but {len(short)} of {len(cohort)} stores of {manifest} have no such "
            f"level ({short[0][0]}: levels 0-{short[0][1] - 1})",
            f"choose data.level {fewest - 1} or lower, or leave those slides out",
        )


def _check_stores(cohort: Cohort, manifest: Path) -> None:
    """ConfigError unless every store of ``cohort`` is whole: it exists, opens, lost no shard.

    Reads each store's metadata (JSON: the group, its level arrays, its label
    images) and stats every shard its chunk inventory lists
    (:func:`~hyfi_imaging.io.inventory.check_store`); no pixel is read, no
    checksum computed (that is ``hyfi-preprocess --verify``). Stores without
    an inventory (older ones) pass on their metadata alone.
    """
    from hyfi_imaging.io.inventory import check_store

    bad = []
    for image_id, store in zip(cohort.ids, cohort.stores, strict=True):
        check = check_store(store)
        if check.status == "bad":
            bad.append((image_id, check))
    if not bad:
        return
    image_id, first = bad[0]
    kind = "slide" if cohort.kind == "slides" else "volume"
    fix = (
        f"re-run hyfi-preprocess for {'that slide' if len(bad) == 1 else 'those slides'} "
        "(the same command converts damaged stores again; hyfi-preprocess --verify "
        f"{Path(first.store).parent} lists every damaged store)"
        if cohort.kind == "slides"
        else "rewrite those volumes' stores with the tool that wrote them"
    )
    raise ConfigError(
        manifest,
        f"{len(bad)} of {len(cohort)} stores cannot be used ({kind} {image_id}: "
        f"{first.store}: {first.what()})",
        fix,
    )


def turn_warning(recipe: Recipe) -> str | None:
    """One line when quarter turns of non-square slides are cropped back to the slide's shape
    at a random offset (the rest filled with background), else None: a segmentation's mask is
    cut alike, but a slide's label can lose what it is about. It was done without a word (a
    quarter of a 96x128 slide cut away in every odd turn); the guide says it too."""
    from hyfi_imaging.train.tasks import load_cohort, manifest_kind

    if not recipe.data.augment.rot90 or manifest_kind(recipe.data.manifest) != "slides":
        return None
    h, w = load_cohort(recipe, recipe.data.manifest).size[-2:]
    if h == w:
        return None
    label = (
        ""
        if recipe.task.name == "segmentation"
        else ": it can cut away what a slide's label is about"
    )
    return (
        f"data.augment.rot90 turns the {h}x{w} slides by quarter turns, each cropped back to "
        f"{h}x{w} at a random offset (up to {abs(h - w)} px of the turned slide cut away, the "
        f"rest filled with background){label}; set data.augment.rot90=false to keep every "
        "pixel (flips still give half turns), or preprocess to a square --size"
    )


def _check_labels(manifest: Path, samples: Sequence[Any], classes: int) -> None:
    """ConfigError unless every usable slide has a label among the ``classes`` indices."""
    bad = [s.slide_id for s in samples if not 0 <= s.label < classes]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ConfigError(
            manifest,
            f"{len(bad)} slide(s) with status ok have no label in 0..{classes - 1} ({shown})",
            "give them labels (hyfi-preprocess --labels) or set their status to failed",
        )


def check_layout(recipe: Recipe, cohort: Cohort) -> None:
    """The engine's checks of the recipe's layout on ``cohort``'s images that need no process
    group, on a meta-device model: run before any rank starts (``hyfi-train``, and
    ``hyfi-predict`` for its own layout: found by the ranks, the refusal raced MPICH's
    teardown and exited 9 in 1 run of 3)."""
    from hyfi_imaging.geometry.spans import padded_hw
    from hyfi_imaging.parallel.spatial import tile_alignment
    from hyfi_imaging.train.inputs import build_model
    from hyfi_imaging.train.tasks import num_outputs

    r, p = recipe, recipe.parallel
    image_hw, channels, num_classes = cohort.size, cohort.channels, num_outputs(recipe, cohort)
    with torch.device("meta"):
        model = build_model(r, channels, num_classes, pretrained=True)  # reads model.weights
    dims = 3 if any(isinstance(m, torch.nn.Conv3d) for m in model.modules()) else 2
    if dims != len(image_hw):
        raise ConfigError(
            f"model {r.model.name!r}",
            f"is {dims}-D but the images of {r.data.manifest} are {len(image_hw)}-D "
            f"({'x'.join(map(str, image_hw))})",
            "use a 3-D model (cosmoflow, unet3d) for volumes and a 2-D one for slides",
        )
    from hyfi_imaging.parallel.verify import check_image_size

    # a head sized for one input (cosmoflow's flatten): its own line naming the sizes it
    # takes, before the meta forward's matmul traceback
    check_image_size(model, image_hw, trace=False)
    want = {
        "segmentation": (1, num_classes, *image_hw),  # per-pixel logits of the image's size
        "regression": (1, num_classes),
    }.get(r.task.name)
    if want is not None:
        from hyfi_imaging.parallel.apply import output_shape

        got = output_shape(model, (1, channels, *image_hw))
        if got != want:
            raise ConfigError(
                f"model {r.model.name!r}",
                f"gives {got} for one image, but {r.task.name} needs {want}",
                "use a dense model (unet2d, unet3d) for segmentation, one output per target "
                "for regression",
            )
    if len(image_hw) == len(p.spatial) and math.prod(p.spatial) > 1:
        padded_hw(image_hw, p.spatial, tile_alignment(model, len(image_hw)))
    plan = plan_of(p, p.layout())
    plan.validate(model, recipe.train.batch_size)


def plan_of(p: ParallelConfig, layout: Layout) -> ParallelPlan:
    """The :class:`ParallelPlan` a recipe's ``parallel`` section describes."""
    from hyfi_imaging.parallel.engine import ParallelPlan

    return ParallelPlan(
        layout=layout,
        microbatches=p.microbatches,
        schedule=p.schedule,
        balance=tuple(p.balance) if p.balance else None,
        checkpointing=p.checkpointing,
        overlap=p.overlap,
        halo_depth=p.halo_depth,
        streaming=p.streaming,
        backward_bands=p.backward_bands,
        compile=p.compile,
    )
