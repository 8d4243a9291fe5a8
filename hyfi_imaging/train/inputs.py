"""What the images are decides what the model takes: channels from the data, one check.

Why the data wins: a 5-channel multiplex cohort trained by a recipe written
for RGB would otherwise fail deep inside the first convolution, on every rank,
after the process group is up. So every place that builds the recipe's model
(``hyfi-train``'s preflight and setup, ``parallel=auto``, ``hyfi-plan``) calls
:func:`build_model` with the channel count read from the first store's
metadata (:func:`data_pixels`, JSON only, no pixels), and gets a model with
that many input channels, or one line saying why not:

* ``model.kwargs.in_chans`` set and different from the data: refused;
* not set: the data's count is passed as ``in_chans`` (for 3 channels nothing
  is passed, so RGB recipes and builders without ``in_chans``, such as
  torchvision's, build exactly as before);
* a builder that takes no ``in_chans`` for non-RGB data, or whose model ends
  up with another input width: refused, naming the model.

:func:`check_data` holds the other checks the data's kind calls for (mean/std
lengths, colour jitter that needs RGB, the normalisation against the channels).
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.io.zarr_store import StorePixels, read_store_pixels

if TYPE_CHECKING:
    from torch import nn

    from hyfi_imaging.data.normalize import Normalization
    from hyfi_imaging.train.config import Recipe

__all__ = ["build_model", "check_data", "data_pixels", "normalization"]


def data_pixels(recipe: Recipe) -> StorePixels:
    """Channels, pixel type and channel names of the recipe's images (its first usable store).

    Raises ConfigError when the manifest has no usable row or its first store
    is not a finished hyfi-preprocess store.
    """
    from hyfi_imaging.data.dataset import load_samples

    classify = recipe.task.name == "classification"  # else the slide labels are not read
    sample = load_samples(
        recipe.data.manifest, classes=recipe.data.classes if classify else None, labels=classify
    )[0]
    pixels = read_store_pixels(sample.path)
    if pixels is None:
        raise ConfigError(
            sample.path,
            f"slide {sample.slide_id!r} of {recipe.data.manifest} is not a finished "
            "hyfi-preprocess store",
            "rerun hyfi-preprocess",
        )
    return pixels


def normalization(recipe: Recipe) -> Normalization:
    """The recipe's ``data.normalize`` as a :class:`~hyfi_imaging.data.normalize.Normalization`."""
    from hyfi_imaging.data.normalize import Normalization

    n = recipe.data.normalize
    return Normalization(
        n.mode, tuple((float(a), float(b)) for a, b in n.ranges or ()), n.low, n.high, n.clip
    )


def check_stats(recipe: Recipe, channels: int) -> None:
    """ConfigError unless ``data.mean`` and ``data.std`` hold one value, or one per channel."""
    for key in ("mean", "std"):
        values = getattr(recipe.data, key)
        if values is not None and len(values) not in (1, channels):
            raise ConfigError(
                f"data.{key}",
                f"has {len(values)} values but the images have {channels} channels",
                "give one value for all channels or one per channel (or leave it out)",
            )


def check_data(recipe: Recipe, pixels: StorePixels) -> None:
    """ConfigError (one line) when the recipe's data options do not fit images like ``pixels``."""
    from hyfi_imaging.io.pixels import is_rgb

    d, c = recipe.data, pixels.channels
    check_stats(recipe, c)
    a = d.augment
    if (a.saturation or a.hue) and not is_rgb(pixels.channel_names):
        raise ConfigError(
            "data.augment",
            f"saturation and hue need RGB images, these have {c} {pixels.dtype} channels "
            f"({', '.join(pixels.channel_names[:5])}{', ...' if c > 5 else ''})",
            "set data.augment.saturation=0 and data.augment.hue=0",
        )
    normalization(recipe).check(c, "data.normalize")


def build_model(
    recipe: Recipe,
    channels: int | None,
    num_classes: int | None = None,
    *,
    pretrained: bool = False,
) -> nn.Module:
    """The recipe's model for images of ``channels`` channels (``None``: unknown, its default).

    ``num_classes``: the model's outputs (default: one per class of the recipe;
    a regression passes its number of targets). ``pretrained``: load
    ``model.weights`` (hyfi-train's setup, on every rank, before any
    parallelism, its one line said by rank 0; a meta-device build, as in
    preflight, reads and matches the file without copying, so a bad file is
    refused before any rank starts). The planners leave it False.

    See the module docstring for the rule; raises ConfigError on a mismatch.
    """
    from hyfi_imaging.models import create_model
    from hyfi_imaging.parallel.apply import input_channels

    r = recipe
    kwargs = dict(r.model.kwargs)
    declared = kwargs.get("in_chans")
    where = f"model {r.model.name!r}"
    if "num_classes" in kwargs:  # passed twice: a TypeError traceback
        raise ConfigError(
            "model.kwargs.num_classes",
            "is set by the task (one output per data.classes entry, or per regression target)",
            "remove it from model.kwargs",
        )
    if channels is not None and declared is not None and int(declared) != channels:
        raise ConfigError(
            "model.kwargs.in_chans",
            f"is {declared} but the images of {r.data.manifest} have {channels} channels",
            "leave in_chans out of the recipe: the data sets it",
        )
    passed = channels is not None and channels != 3 and declared is None
    if passed:
        kwargs["in_chans"] = channels
    try:
        outputs = len(r.data.classes) if num_classes is None else num_classes
        with warnings.catch_warnings():
            # A builder of the user's that loads weights warns once per tensor when preflight
            # builds it on the meta device, where the copy is a no-op by design.
            warnings.filterwarnings("ignore", message=r".*to a meta parameter .* is a no-op")
            model = create_model(r.model.name, num_classes=outputs, **kwargs)
    except (ConfigError, TypeError) as err:
        if not (passed and "in_chans" in str(err)):
            raise
        raise ConfigError(
            where,
            f"takes no in_chans, but the images have {channels} channels",
            "use a model that takes in_chans (the registered ones, timm:create_model)",
        ) from None
    got = input_channels(model)
    if channels is not None and got != channels:
        raise ConfigError(
            where,
            f"takes {got} input channels but the images have {channels}",
            "give it in_chans, or a first convolution with that many input channels",
        )
    if pretrained and r.model.weights is not None:
        from hyfi_imaging.models.weights import load_weights
        from hyfi_imaging.parallel.launch import launch_rank

        report = load_weights(model, r.model.weights)
        if report.copied and launch_rank() in (None, 0):
            logging.getLogger("hyfi_imaging.train").warning("%s", report.line)
    if r.model.memory_format == "channels_last":
        from hyfi_imaging.models.memory_format import to_channels_last

        to_channels_last(model)
    return model
