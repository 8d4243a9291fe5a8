"""Recipes: a validated schema composed from dataset and model cards, with overrides.

A recipe is YAML. ``dataset:`` and ``model:`` may name a card file (resolved
relative to the recipe) whose fields give defaults; every other section is
written in the recipe itself, and ``--set section.key=value`` overrides any
field from the command line. The schema (pydantic, unknown keys forbidden)
is checked on every rank *before* any process group or tensor exists, so a
typo costs a second and prints one line naming the key, the recipe and the
closest valid spelling.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.shapes import parse_shape

__all__ = [
    "DataConfig",
    "NormalizeSection",
    "OptimConfig",
    "ParallelConfig",
    "Recipe",
    "TaskConfig",
    "TrainConfig",
    "load_recipe",
    "parse_overrides",
]


class _Strict(BaseModel):
    # inf and nan are no setting (optim.lr=inf passed --check and --print-sbatch, then the
    # first steps' loss was nan, after a job's queue wait)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_truth_for_numbers(cls, value: Any, info: Any) -> Any:
        """``train.epochs=true`` trained 1 epoch: true/false is no count or rate."""
        field = cls.model_fields.get(info.field_name)
        numbers = (int, float, int | None, float | None)
        if isinstance(value, bool) and field is not None and field.annotation in numbers:
            raise ValueError(f"is {str(value).lower()}, not a number")
        return value


class AugmentSection(_Strict):
    """Global augmentation (identical on every rank, drawn per epoch and sample)."""

    flip: bool = True
    rot90: bool = True
    brightness: float = Field(0.0, ge=0, le=1)
    contrast: float = Field(0.0, ge=0, le=1)
    saturation: float = Field(0.0, ge=0, le=1)
    hue: float = Field(0.0, ge=0, le=0.5)


class NormalizeSection(_Strict):
    """How stored pixels become ``[0, 1]`` floats (:mod:`hyfi_imaging.data.normalize`).

    ``dtype``: divide by the pixel type's maximum (8-bit: ``x / 255``, as always);
    ``range``: fixed ``ranges`` (one ``[low, high]`` or one per channel);
    ``percentile``: each image's own ``low``/``high`` channel percentiles, stored by
    hyfi-preprocess.
    """

    mode: Literal["dtype", "range", "percentile"] = "dtype"
    ranges: list[tuple[float, float]] | None = None
    low: float = 1.0
    high: float = 99.0
    clip: bool = True


class DataConfig(_Strict):
    """Where the preprocessed images are and how they become batches.

    ``mean`` / ``std`` are applied after ``normalize``: one value for every
    channel or one per channel; by default 0.5 and 0.25 for every channel.
    """

    manifest: Path
    val_manifest: Path | None = None
    val_fraction: float = Field(0.25, ge=0, lt=1)
    #: Class names (classification: the slide labels; segmentation: the label values
    #: 0, 1, ... of the masks, 0 the background); not used by regression.
    classes: list[str] = []
    task: Literal["binary", "graded", "multiclass"] = "binary"
    augment: AugmentSection = AugmentSection()
    workers: int = Field(0, ge=0)
    level: int = Field(0, ge=0)
    normalize: NormalizeSection = NormalizeSection()
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @field_validator("std")
    @classmethod
    def _positive_std(cls, v: tuple[float, ...] | None) -> tuple[float, ...] | None:
        if v is not None and (not v or min(v) <= 0):
            raise ValueError(f"std must be positive numbers (got {list(v)})")
        return v


class TaskConfig(_Strict):
    """What is learned (:mod:`hyfi_imaging.train.tasks`): one label per image, a mask, or numbers.

    ``classification``: one class per image (``data.task`` says binary, graded
    or multiclass). ``segmentation``: a class per pixel (voxel) from the
    store's label image ``labels`` (slides: ``hyfi-preprocess --annotations``
    writes ``annotations``; volumes: the manifest's ``labels`` column), loss
    ``ce_weight`` x cross-entropy + ``dice_weight`` x (1 - Dice);
    ``foreground``: every non-zero label value is class 1 (blob instances).
    ``regression``: the volume manifest's ``target_<name>`` columns ``targets``
    (default: all, sorted), loss ``mse`` or ``mae``. ``overlays``: overlay
    pictures written for that many validation images (segmentation).
    """

    name: Literal["classification", "segmentation", "regression"] = "classification"
    loss: Literal["auto", "ce", "dice_ce", "mse", "mae"] = "auto"
    ce_weight: float = Field(1.0, ge=0)
    dice_weight: float = Field(1.0, ge=0)
    labels: str = "annotations"
    foreground: bool = False
    targets: list[str] | None = None
    overlays: int = Field(4, ge=0)


class ModelConfig(_Strict):
    """A registered model and its options (``num_classes`` comes from the data).

    ``weights``: a file of pretrained weights loaded into the model as built,
    before any parallelism (a state dict, a torchvision/timm checkpoint, a
    ``.safetensors`` file; :mod:`hyfi_imaging.models.weights`), relative to
    where the command runs. A head of another class count and a first
    convolution of another channel count are handled and reported in one line.

    ``memory_format``: ``channels_last`` lays the convolution weights, and so the maps,
    out as (N, H, W, C) (volumes (N, D, H, W, C)): cuDNN's fast layout for bfloat16
    convolutions (plain PyTorch's ResNet-50 step was 1.8x faster so on an H200,
    ``docs/benchmarks.md``). The numbers are the same to rounding; checkpoints hold the same
    values either way.
    """

    name: str
    kwargs: dict[str, Any] = {}
    weights: Path | None = None
    memory_format: Literal["nchw", "channels_last"] = "nchw"


def _read_grid(v: Any) -> Any:
    if isinstance(v, (str, int)):
        try:
            return parse_shape(v, "parallel.spatial", kind="grid")
        except ConfigError as err:
            raise ValueError(f"{err.what}; {err.fix}") from None
    return v


class ParallelConfig(_Strict):
    """The layout and the pipeline schedule.

    ``spatial`` is one grid for every stage (``2x2``) or one per pipeline stage
    (``[2x2, 1x2, 1x1]``, the junction): then ``spatial`` holds the first
    stage's grid (the one the data path reads tiles for) and ``stage_grids`` all of them.
    Volumes take a grid of sub-volumes ``GZxGYxGX`` (``2x1x2``) for every stage, 1-D
    signals a grid of segments ``L<GL>`` (``L4``).
    """

    spatial: tuple[int] | tuple[int, int] | tuple[int, int, int] = (1, 1)
    stage_grids: tuple[tuple[int, int], ...] | None = None
    pipeline: int = Field(1, ge=1)
    data: int = Field(1, ge=1)
    #: Branch ranks per tile (data sub-graph parallelism, :mod:`~hyfi_imaging.parallel.branches`):
    #: each runs some independent branches of every AmoebaNet cell or ``ParallelBranches``
    #: block. ``parallel: auto`` never picks it (the planner's candidates have ``branches: 1``).
    branches: int = Field(1, ge=1)
    microbatches: int = Field(1, ge=1)
    #: Seconds a collective waits for the other ranks before the job ends naming the rank
    #: that stopped answering.
    timeout_s: float = Field(60.0, gt=0)
    #: gpipe, 1f1b; bidirectional (two mirrored replicas, GEMS); interleaved1f1b, zbv, dualpipev
    #: (torch's schedules with two stages per rank: ``balance`` then lists 2 x pipeline counts).
    schedule: Literal["gpipe", "1f1b", "bidirectional", "interleaved1f1b", "zbv", "dualpipev"] = (
        "gpipe"
    )
    balance: list[int] | None = None
    checkpointing: str = "none"
    #: Compute each convolution's interior while its halos are in flight.
    overlap: bool = False
    #: One halo exchange serves up to this many consecutive windowed layers.
    halo_depth: int = Field(1, ge=1)
    #: ``stem``: the leading convolution, BatchNorm, activation and max-pool run in row bands
    #: (their maps are never whole: the peak of a checkpointed ResNet).
    streaming: Literal["none", "stem"] = "none"
    #: Each convolution's backward in bands of output rows: less memory, more kernel calls.
    backward_bands: bool = False
    #: ``torch.compile`` the model with this backend (``inductor``: generated kernels, 2.6x a
    #: ResNet-50 step on one H200; ``aot_eager``: torch's kernels, exact). One stage without
    #: tiles, checkpointing or streaming (data replicas allowed); ``none`` runs eagerly.
    compile: Literal["none", "inductor", "aot_eager"] = "none"

    @model_validator(mode="before")
    @classmethod
    def _per_stage(cls, data: Any) -> Any:
        """``spatial: [2x2, 1x2, 1x1]`` -> the first grid plus ``stage_grids``."""
        if not isinstance(data, dict):
            return data
        v = data.get("spatial")
        if isinstance(v, str) and "," in v:
            v = [p for p in v.split(",") if p.strip()]
        if isinstance(v, list | tuple) and v and not isinstance(v[0], int):
            grids = tuple(tuple(_read_grid(g)) for g in v)
            data = {**data, "spatial": grids[0]}
            if len(set(grids)) > 1:
                data["stage_grids"] = grids
            stages = data.get("pipeline", 1)
            if len(grids) > 1 and isinstance(stages, int) and len(grids) != stages:
                # equal grids were taken as one grid without a count: [1x2, 1x2, 1x2] on 2
                # stages passed where [1x2, 1x1, 1x1] was refused
                raise ValueError(
                    f"{len(grids)} stage grids for {stages} pipeline stages; give one grid per "
                    f"stage (parallel.pipeline {len(grids)}), or one grid for every stage"
                )
        return data

    @field_validator("spatial", mode="before")
    @classmethod
    def _grid(cls, v: Any) -> Any:
        return _read_grid(v)

    def layout(self) -> Any:
        """The :class:`~hyfi_imaging.parallel.layout.Layout` of this section (ConfigError if invalid)."""
        from hyfi_imaging.parallel.layout import Layout

        return Layout(
            dp=self.data,
            pp=self.pipeline,
            br=self.branches,
            sp=self.spatial,
            grids=self.stage_grids,
        )

    @field_validator("checkpointing")
    @classmethod
    def _ckpt(cls, v: str) -> str:
        if v not in ("none", "full", "selective", "deep") and not re.fullmatch(
            r"every:[1-9]\d*", v
        ):
            raise ValueError(f"use none, full, selective, deep or every:N (got {v!r})")
        return v


class OptimConfig(_Strict):
    """Optimiser and learning-rate schedule (linear warm-up, then cosine)."""

    name: Literal["sgd", "adamw"] = "adamw"
    lr: float = Field(1e-3, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr: float = Field(0.0, ge=0)
    grad_clip: float = Field(0.0, ge=0)


class TrainConfig(_Strict):
    """The loop: how long, how big, where to write, how often to save."""

    out_dir: Path
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    seed: int = Field(0, ge=0, lt=2**63)  # numpy's generators take no negative seed
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    eval_every_epochs: int = Field(1, ge=1)
    checkpoint_every_steps: int = Field(0, ge=0)
    keep_checkpoints: int = Field(3, ge=1)
    #: A step whose loss or gradient norm is not finite: ``stop`` the run (the last
    #: checkpoint stays the newest) or ``skip`` it (counted, logged, at most
    #: ``max_skipped_steps`` in a row).
    nonfinite: Literal["stop", "skip"] = "stop"
    max_skipped_steps: int = Field(10, ge=1)
    progress: bool = True

    @field_validator("out_dir")
    @classmethod
    def _normalised(cls, v: Path) -> Path:
        # runs/../x is x: the writers of per-image outputs refuse a path that climbs
        # ('..') after a folder name, the mark of an id like '../../x' (hyfi_imaging.paths).
        return Path(os.path.normpath(v))


class Recipe(_Strict):
    """A whole training recipe."""

    name: str = "run"
    task: TaskConfig = TaskConfig()
    data: DataConfig
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig

    @property
    def world_size(self) -> int:
        """Ranks the run needs: its layout's, or more where the bidirectional schedule places
        two mirrored replicas of per-stage grids (:class:`~hyfi_imaging.parallel.mirrored.MirroredPlacement`)."""
        from hyfi_imaging.parallel.mirrored import placed_world_size

        return placed_world_size(self.parallel.layout(), self.parallel.schedule)


class RecipeLoader(yaml.SafeLoader):
    """YAML as recipes mean it: integers are decimal only. YAML 1.1 (PyYAML) reads ``0x2`` as
    the hex number 2, ``010`` as octal 8 and ``1:30`` as 90, so ``spatial: 0x2`` became a
    valid 2x2 grid and ``epochs: 010`` eight epochs; here they stay strings (and a grid or
    a count refuses them in one line)."""


RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:int"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$"), list("-+0123456789")
)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["train.epochs=3", "parallel.spatial=2x2"]`` -> nested dict (values read as YAML)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(
                "--set", f"{item!r} is not KEY=VALUE", "write e.g. --set train.epochs=3"
            )
        key, value = item.split("=", 1)
        node = out
        *parents, leaf = key.strip().split(".")
        for i, p in enumerate(parents):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                whole = ".".join(parents[: i + 1])
                raise ConfigError(
                    "--set",
                    f"{item!r}: {whole} is set to {node!r} by an earlier --set, not to fields",
                    f"set either {whole} or its fields, not both",
                )
        try:
            loaded = yaml.load(value, Loader=RecipeLoader)
            # a mapping given whole replaces the field (model.kwargs={} clears it); merged
            # into the recipe's, it could add keys but never remove one
            node[leaf] = _Whole(loaded) if isinstance(loaded, dict) else loaded
        except yaml.YAMLError as err:
            mark = getattr(err, "problem", None) or "is not valid YAML"
            raise ConfigError(
                "--set", f"{item!r}: the value {mark}", "quote it or fix it, e.g. key=[1, 2]"
            ) from None
    return out


class _Whole(dict):
    """A ``--set`` value that is a mapping: it replaces the field, not merged into it."""


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and not isinstance(v, _Whole) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = _plain(v)
    return merged


def _plain(value: Any) -> Any:
    """``value`` with every :class:`_Whole` a plain dict again (YAML dumps plain dicts)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def read_yaml(path: Path, where: str) -> dict[str, Any]:
    """A recipe or card file as a mapping, read as recipes are (UTF-8, integers decimal:
    :class:`RecipeLoader`); a ConfigError in one line otherwise (``where`` names the reader)."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=RecipeLoader)
    except OSError as err:
        raise ConfigError(where, f"cannot read {path} ({err.strerror})", "check the path") from err
    except UnicodeDecodeError as err:
        raise ConfigError(
            path, f"is not UTF-8 text (byte {err.start})", "save the recipe as UTF-8"
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(
            path, f"is not valid YAML ({str(err).splitlines()[0]})", "fix the syntax"
        ) from err
    if not isinstance(data, dict):
        raise ConfigError(path, "must be a YAML mapping", "see recipes/synthetic.yaml")
    return data


def _card_defaults(raw: dict[str, Any], base: Path, where: Path) -> dict[str, Any]:
    """Replace ``dataset: card.yaml`` / ``model: card.yaml`` by the fields the recipe takes from them."""
    raw = dict(raw)
    dataset = raw.pop("dataset", None)
    if dataset is not None:
        card = (
            read_yaml(base / dataset, f"{where}: dataset") if isinstance(dataset, str) else dataset
        )
        classes = card.get("classes")
        defaults: dict[str, Any] = {}
        if isinstance(classes, dict):
            defaults["classes"] = [str(k) for k in classes]
        elif isinstance(classes, list):
            defaults["classes"] = [str(c) for c in classes]
        if "task" in card:
            defaults["task"] = card["task"]
        if "normalize" in card:
            defaults["normalize"] = card["normalize"]
        raw["data"] = _merge(defaults, raw.get("data") or {})
    model = raw.get("model")
    if isinstance(model, str):
        card = (
            read_yaml(base / model, f"{where}: model")
            if model.endswith((".yaml", ".yml"))
            else {"name": model}
        )
        raw["model"] = {"name": card["name"], "kwargs": card.get("kwargs") or {}}
    elif isinstance(model, dict) and "card" in model:
        model = dict(model)
        card = read_yaml(base / model.pop("card"), f"{where}: model.card")
        raw["model"] = _merge({"name": card["name"], "kwargs": card.get("kwargs") or {}}, model)
    return raw


def load_recipe(path: Path, overrides: list[str] | None = None) -> Recipe:
    """Read, compose, override and validate a recipe; ConfigError (one line) on any problem.

    ``path`` is a recipe file, or the bare name of a shipped recipe
    (``synthetic``; see :mod:`hyfi_imaging.resources`), which is how an installed
    wheel without the repository's ``recipes/`` folder reaches them.
    """
    from hyfi_imaging.resources import find_recipe, recipe_names

    path = find_recipe(Path(path))
    if not path.exists():
        raise ConfigError(
            path,
            "no such recipe file",
            f"give a recipe's path, or a shipped recipe by name ({', '.join(recipe_names())})",
        )
    raw = read_yaml(path, "hyfi-train")
    raw = _card_defaults(raw, path.parent, path)
    if isinstance(raw.get("task"), str):  # "task: segmentation" names the task alone
        raw = {**raw, "task": {"name": raw["task"]}}
    extra = parse_overrides(overrides or [])
    for key, value in extra.items():
        held = raw.get(key)
        if (
            isinstance(value, dict)
            and not isinstance(value, _Whole)
            and held is not None
            and not isinstance(held, dict)
        ):
            # ``parallel: auto`` and a --set of one field would have become the default
            # layout with that field, silently.
            raise ConfigError(
                "--set",
                f"{key}.{next(iter(value))}: {key} is {held!r} in the recipe, not fields "
                "(setting one field would replace it)",
                f"set the whole {key} (--set {key}=...), or write its fields in the recipe",
            )
    raw = _merge(raw, extra)
    if isinstance(raw.get("task"), str):  # --set task=segmentation
        raw = {**raw, "task": {"name": raw["task"]}}
    auto = raw.get("parallel") == "auto"
    if auto:
        raw = {**raw, "parallel": {}}
    try:
        recipe = Recipe.model_validate(raw)
        if auto:  # the planner picks the layout for the ranks this job was launched with
            from hyfi_imaging.train.autoplan import choose_layout, launch_world_size

            recipe = recipe.model_copy(
                update={"parallel": choose_layout(recipe, launch_world_size())}
            )
        return recipe
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            section = _section_fields(first["loc"][:-1])
            close = difflib.get_close_matches(str(first["loc"][-1]), section, n=1)
            fix = (
                f"did you mean {'.'.join([*map(str, first['loc'][:-1]), close[0]])}?"
                if close
                else (f"valid keys here: {', '.join(section)}")
            )
            raise ConfigError(path, f"unknown key {loc!r}", fix) from None
        if first["type"] == "missing":
            raise ConfigError(
                path, f"{loc!r} is required", "add it to the recipe or pass --set " + loc + "=..."
            ) from None
        got = "" if first["type"] == "value_error" else f" (got {first.get('input')!r})"
        raise ConfigError(
            path, f"{loc}: {first['msg']}{got}", "fix the value in the recipe or --set"
        ) from None


def _section_fields(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = Recipe
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)
