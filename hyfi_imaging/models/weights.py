"""Pretrained weights for a model: read without running code, matched by name, told in one line.

Why a module of its own: pathology models almost always start from ImageNet
(or a foundation model's) weights, and the files come in several shapes -- a
bare state dict (``torch.save(model.state_dict())``), a training checkpoint
that holds one under ``state_dict`` or ``model`` (timm's and torchvision's
reference scripts), keys prefixed by the wrapper that saved them (``module.``
from DistributedDataParallel, ``_orig_mod.`` from ``torch.compile``), a
``.safetensors`` file from the Hugging Face hub. A hand-written loader either
fails on these or "works" while printing a warning per tensor that reads as a
failure (``load_state_dict`` into a meta-device model, as a preflight build
does, warns once per tensor: 320 lines for a ResNet-50). :func:`load_weights`
takes any of them and says what happened in **one line**::

    weights resnet50.pth: 318 loaded, 2 skipped (fc.weight [1000, 2048] -> [2, 2048],
    fc.bias [1000] -> [2]: the head is new), 0 missing, 0 unexpected

Decisions:

* **Safe reading.** ``torch.load(weights_only=True)``, as the project reads
  its own checkpoints (:mod:`hyfi_imaging.train.safe_reader`): a file that
  names any global but tensors, plain containers and ``argparse.Namespace``
  (the ``args`` of timm's and torchvision's training checkpoints) is refused
  in one line, before anything it names is called. The path is checked first
  (missing, a folder, not a regular file, empty, unreadable, not a
  PyTorch/safetensors file: each its own line). A ``torch.save`` file's CRCs
  are checked (``torch.load`` reads a zip without them: a file with damaged
  tensor data loaded, values off by 1e4, without a word), and a tensor holding
  NaN or inf is refused by name. The path is the user's own (``data/../w.pth``
  is ``w.pth``): nothing joins an id into it.
* **Names.** The project's ResNets use torchvision's parameter names, which
  timm's ResNets keep too, so their files map by identity. timm's
  pre-activation ``ResNetV2`` names differ (``stem.conv``,
  ``stages.0.blocks.0.norm1``, ``head.fc``); :data:`NAMINGS` maps them onto
  :class:`~hyfi_imaging.models.resnet_v2.ResNetV2` (``conv1``,
  ``layer1.0.bn1``, ``fc``). The naming that matches the most of the model's
  tensors is used, and named in the line.
* **Shapes.** The classifier head (the model's last layer) and the stem (its
  first convolution) may differ: a head trained for 1000 classes does not fit
  2, so it is skipped and the line says the head is new. A stem whose input
  channels alone differ (a 3-channel ImageNet stem for 1-channel or multiplex
  images) is adapted by timm's rule (:func:`adapt_input_conv`), and the line
  says so. Any other tensor whose shape differs means weights of another
  architecture (another depth or width): refused, as is a file of which no
  weight fits (BatchNorm's ``num_batches_tracked`` counters do not count).
* **When.** Before spatialization and every wrapper (the model is as it was
  built, so the names are the plain ones), on every rank, into the model's own
  dtype. Into a meta-device model nothing is copied: the file is read and
  matched, so a bad file is refused before any rank starts, without warnings.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import stat
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hyfi_imaging.errors import ConfigError

__all__ = ["NAMINGS", "WeightsReport", "adapt_input_conv", "load_weights", "read_state_dict"]

#: Wrapper prefixes removed from every key that starts with them, in either order
#: (DistributedDataParallel, torch.compile), as timm's ``clean_state_dict`` does.
_WRAPPERS = ("module.", "_orig_mod.")
#: Keys under which training checkpoints keep the model's state dict, in order of preference.
_CONTAINERS = ("state_dict", "model")
#: How many names a list in the line shows before "...".
_SHOWN = 3


#: A renaming rule: a pattern at the start of a key, and its replacement (or a function of
#: the match that gives it).
_Rule = tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]]


def _rules(*pairs: tuple[str, str | Callable[[re.Match[str]], str]]) -> list[_Rule]:
    return [(re.compile(p), r) for p, r in pairs]


def _stage(m: re.Match[str]) -> str:
    return f"layer{int(m[1]) + 1}.{m[2]}."


#: Other libraries' names for the project's models: a naming is a list of (pattern,
#: replacement) rules, the first that matches a key renames it (keys no rule matches keep
#: their name). Identity (torchvision's and timm's ResNet names) needs no entry.
NAMINGS: dict[str, list[_Rule]] = {
    "timm ResNetV2": _rules(
        (r"^stem\.conv\.", "conv1."),
        (r"^stages\.(\d+)\.blocks\.(\d+)\.norm(\d+)\.", lambda m: f"{_stage(m)}bn{m[3]}."),
        (r"^stages\.(\d+)\.blocks\.(\d+)\.conv(\d+)\.", lambda m: f"{_stage(m)}conv{m[3]}."),
        (r"^stages\.(\d+)\.blocks\.(\d+)\.downsample\.conv\.", lambda m: f"{_stage(m)}downsample."),
        (r"^norm\.", "bn."),
        (r"^head\.fc\.", "fc."),
    ),
}


def _rename(key: str, rules: list[_Rule]) -> str:
    for pattern, replacement in rules:
        m = pattern.match(key)
        if m is not None:
            new = replacement if isinstance(replacement, str) else replacement(m)
            return new + key[m.end() :]
    return key


def adapt_input_conv(in_chans: int, weight: Tensor) -> Tensor:
    """A first convolution's ``weight`` (``out, c, *kernel``) for ``in_chans`` input channels.

    timm's rule (``timm.models._manipulate.adapt_input_conv``), with the file's own
    channel count ``c`` as the base: for one channel, the sum over the ``c`` kernels (a
    grey image seen as equal R, G and B gives the same response); for more, the ``c``
    kernels repeated cyclically and scaled by ``c / in_chans`` (the response to a flat
    image keeps its size). Half-precision weights are adapted in float32 and returned in
    their own dtype.

    OK: ``adapt_input_conv(1, w)`` for ``w`` of shape ``(64, 3, 7, 7)`` -> ``(64, 1, 7, 7)``.
    Error: ``adapt_input_conv(0, w)`` raises ConfigError.
    """
    if in_chans < 1 or weight.ndim < 3:
        raise ConfigError(
            "adapt_input_conv",
            f"cannot adapt a weight of shape {list(weight.shape)} to {in_chans} input channels",
            "give a convolution weight (out, in, *kernel) and in_chans >= 1",
        )
    base = weight.shape[1]
    if in_chans == base:
        return weight
    dtype = weight.dtype
    w = weight.float() if dtype in (torch.float16, torch.bfloat16) else weight
    if in_chans == 1:
        w = w.sum(dim=1, keepdim=True)
    else:
        repeat = -(-in_chans // base)
        w = w.repeat(1, repeat, *([1] * (w.ndim - 2)))[:, :in_chans]
        w = w * (base / float(in_chans))
    return w.to(dtype)


@dataclass(frozen=True)
class WeightsReport:
    """What :func:`load_weights` did: tensors loaded, skipped, missing, unexpected; :attr:`line`.

    ``skipped`` holds ``(name, shape in the file, shape here)``; ``adapted``
    ``(name, channels in the file, channels here)``; ``new`` what the names of
    the model's last layer and first convolution are ("head", "stem"), so that the
    line can say that the head is new; ``notes``
    where the tensors came from (a checkpoint's key, prefixes removed, the naming).
    ``copied`` is False for a meta-device model (matched, nothing copied).
    """

    path: Path
    loaded: tuple[str, ...]
    skipped: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    adapted: tuple[tuple[str, int, int], ...] = ()
    new: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    copied: bool = True

    @property
    def line(self) -> str:
        """The one line a user reads (see the module docstring)."""

        def names(items: list[str]) -> str:
            shown = ", ".join(items[:_SHOWN]) + (", ..." if len(items) > _SHOWN else "")
            kinds = {self.new.get(n.split(" ")[0], "") for n in items}
            why = f": the {' and '.join(sorted(kinds))} {'is' if len(kinds) == 1 else 'are'} new"
            return f" ({shown}{why if '' not in kinds else ''})" if items else ""

        skipped = [f"{n} {list(a)} -> {list(b)}" for n, a, b in self.skipped]
        parts = [
            f"{len(self.loaded)} loaded",
            f"{len(self.skipped)} skipped{names(skipped)}",
            f"{len(self.missing)} missing{names(list(self.missing))}",
            f"{len(self.unexpected)} unexpected{names(list(self.unexpected))}",
        ]
        extra = [
            f"{n}: {a} -> {b} input channels (timm's adapt_input_conv)" for n, a, b in self.adapted
        ]
        tail = "; ".join([*extra, *self.notes])
        return f"weights {self.path.name}: {', '.join(parts)}" + (f"; {tail}" if tail else "")


def _check_path(path: Path) -> os.stat_result:
    fix = "set model.weights to a state-dict file (a path relative to where the command runs)"
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(path, "no such weights file", fix) from None
    except OSError as err:
        raise ConfigError(path, f"cannot read the weights file ({err.strerror})", fix) from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            path,
            "is a folder, not a weights file",
            "give a file written by torch.save(model.state_dict(), path) or a .safetensors file",
        )
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(path, "is not a regular file", fix)
    if st.st_size == 0:
        raise ConfigError(path, "is an empty file, not weights", "copy the weights file again")
    if not os.access(path, os.R_OK):
        raise ConfigError(path, "cannot read the weights file (permission denied)", "chmod u+r it")
    return st


def _kind(path: Path, size: int) -> str:
    """``torch`` (zip), ``torch-legacy`` (pickle) or ``safetensors``, from the first bytes."""
    with path.open("rb") as f:
        head = f.read(9)
    if head.startswith(b"PK\x03\x04"):
        return "torch"
    if (
        head[:1] == b"\x80"
    ):  # a pickle's PROTO opcode: torch.save(_use_new_zipfile_serialization=False)
        return "torch-legacy"
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < size:
        return "safetensors"
    raise ConfigError(
        path,
        "is not a PyTorch (torch.save) or safetensors weights file",
        "give the file torch.save(model.state_dict(), path) wrote, or a .safetensors file",
    )


def _load_file(path: Path, kind: str) -> object:
    if kind == "safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ConfigError(
                path, "is a safetensors file", "pip install safetensors (timm installs it)"
            ) from None
        try:
            return load_file(str(path), device="cpu")
        except Exception as err:
            raise ConfigError(
                path, f"is a damaged safetensors file ({str(err).splitlines()[0]})", "copy it again"
            ) from None
    if kind == "torch":
        _check_crcs(path)
    allowed: list[Any] = [
        argparse.Namespace
    ]  # the ``args`` of timm's and torchvision's train checkpoints
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=kind == "torch")
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        what = f"names {found[1]}" if found else "holds objects other than tensors"
        raise ConfigError(
            path,
            f"{what}, which a weights-only load refuses (loading it could run code)",
            "save the state dict alone: torch.save(model.state_dict(), path)",
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise ConfigError(
            path,
            f"cannot be read as PyTorch weights ({str(err).splitlines()[0][:200]})",
            "check that the file is complete, or save it again with torch.save",
        ) from None


def _check_crcs(path: Path) -> None:
    """Refuse a ``torch.save`` zip whose stored CRCs do not match its bytes (``torch.load``
    never checks them). Reads the whole file once."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return  # a truncated or odd zip: torch.load's own error names it
    if bad is not None:
        raise ConfigError(
            path, f"is damaged (its entry {bad} fails its CRC check)", "copy the weights file again"
        )


def _check_finite(path: Path, tensors: Mapping[str, Tensor]) -> None:
    """Refuse a file whose floating tensors hold NaN or inf, naming the first."""
    for name, value in tensors.items():
        floating = value.is_floating_point() or value.is_complex()
        if floating and not bool(torch.isfinite(value).all()):
            raise ConfigError(
                path,
                f"holds NaN or inf in {name} (a diverged or damaged model)",
                "give weights saved before the training diverged, or copy the file again",
            )


def read_state_dict(path: Path) -> tuple[dict[str, Tensor], tuple[str, ...]]:
    """The tensors of a weights file by name, and notes on where they were found.

    Takes a state dict, a checkpoint holding one under ``state_dict`` or ``model``,
    or a ``.safetensors`` file; removes ``module.``/``_orig_mod.`` prefixes. Raises
    ConfigError (one line) for a file that is missing, unreadable, not weights, holds
    code, or holds no tensors.
    """
    path = Path(path)
    st = _check_path(path)
    obj = _load_file(path, _kind(path, st.st_size))
    notes: list[str] = []
    if isinstance(obj, Mapping):
        for key in _CONTAINERS:
            inner = obj.get(key)
            if isinstance(inner, Mapping) and any(isinstance(v, Tensor) for v in inner.values()):
                notes.append(f"from its {key!r}")
                obj = inner
                break
    tensors = (
        {str(k): v for k, v in obj.items() if isinstance(v, Tensor)}
        if isinstance(obj, Mapping)
        else {}
    )
    if not tensors:
        found = (
            f"a dict of {', '.join(map(str, list(obj)[:5]))}"
            if isinstance(obj, Mapping)
            else f"a {type(obj).__name__}"
        )
        raise ConfigError(
            path,
            f"holds no state dict ({found}, no tensors by name)",
            "save one with torch.save(model.state_dict(), path)",
        )
    cleaned: dict[str, Tensor] = {}
    removed: set[str] = set()
    for key, value in tensors.items():
        while key.startswith(_WRAPPERS):
            prefix = next(p for p in _WRAPPERS if key.startswith(p))
            removed.add(prefix)
            key = key[len(prefix) :]
        cleaned[key] = value
    if removed:
        notes.append(" and ".join(f"{p!r}" for p in sorted(removed)) + " removed from the names")
    _check_finite(path, cleaned)
    return cleaned, tuple(notes)


def _naming(names: list[str], wanted: Mapping[str, Tensor]) -> tuple[str | None, dict[str, str]]:
    """The naming (None: identity) that maps the most ``names`` onto ``wanted``; file -> model."""
    best: tuple[int, str | None, dict[str, str]] = (
        sum(n in wanted for n in names),
        None,
        {n: n for n in names},
    )
    for label, rules in NAMINGS.items():
        mapping = {n: _rename(n, rules) for n in names}
        hits = sum(m in wanted for m in mapping.values())
        if hits > best[0]:
            best = (hits, label, mapping)
    return best[1], best[2]


def _first_conv(model: nn.Module) -> str | None:
    convs = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return next((f"{n}.weight" for n, m in model.named_modules() if isinstance(m, convs)), None)


def _new_parts(model: nn.Module, first_conv: str | None) -> dict[str, str]:
    """``{tensor name: "head"}`` for the last layer with parameters (the classifier), and
    ``"stem"`` for the first convolution's weight: the tensors allowed to differ."""
    last = [n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    parts = {first_conv: "stem"} if first_conv is not None else {}
    if last:
        prefix = f"{last[-1]}." if last[-1] else ""
        layer = model.get_submodule(last[-1])
        parts.update({prefix + n: "head" for n, _ in layer.named_parameters(recurse=False)})
    return parts


def load_weights(model: nn.Module, path: Path, *, where: str = "model.weights") -> WeightsReport:
    """Load the weights file ``path`` into ``model`` (in place) and report it.

    See the module docstring for the rules. ``where`` names the setting in errors.
    Raises ConfigError (one line) for a bad file, or one of which no tensor fits.
    """
    path = Path(path)
    state, notes = read_state_dict(path)
    wanted = model.state_dict()
    label, mapping = _naming(list(state), wanted)
    first_conv = _first_conv(model)
    take: dict[str, Tensor] = {}
    skipped: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    adapted: list[tuple[str, int, int]] = []
    reshaped: list[str] = []
    unexpected: list[str] = []
    for key, value in state.items():
        name = mapping[key]
        target = wanted.get(name)
        if target is None:
            unexpected.append(key)
            continue
        have, want = tuple(value.shape), tuple(target.shape)
        if have == want:
            take[name] = value
        elif (
            name == first_conv
            and len(have) == len(want)
            and have[:1] + have[2:] == want[:1] + want[2:]
        ):
            take[name] = adapt_input_conv(want[1], value)
            adapted.append((name, have[1], want[1]))
        elif have == (*want, *([1] * (len(have) - len(want)))) and value.numel() == target.numel():
            take[name] = value.reshape(want)  # a 1x1-convolution head (timm ResNetV2) as a Linear
            reshaped.append(name)
        else:
            skipped.append((name, have, want))
    new = _new_parts(model, first_conv)
    foreign = [f"{n} {list(a)} -> {list(b)}" for n, a, b in skipped if n not in new]
    head = {n.rsplit(".", 1)[0] for n, part in new.items() if part == "head"}
    # Tensors of the file the model has no place for, and weights of the model the file
    # lacks (but the head's, which may be another): another depth. Loaded halfway, a
    # ResNet-34's weights made a ResNet-18 and the reverse a model partly random, as if
    # pretrained.
    extra = [k for k in unexpected if mapping[k].rsplit(".", 1)[0] not in head]
    lacking = [
        n
        for n in wanted
        if n not in take
        and n not in new
        and n not in {s[0] for s in skipped}
        and not n.endswith("num_batches_tracked")
    ]
    fits = any(not n.endswith("num_batches_tracked") for n in take)
    if foreign or extra or lacking or not fits:
        if foreign:
            why = (
                f"{len(foreign)} tensors have other shapes than the model's "
                f"({', '.join(foreign[:_SHOWN])}{', ...' if len(foreign) > _SHOWN else ''})"
            )
        elif fits:
            why = (
                f"{len(extra)} tensors of the file are not in the model"
                f"{' (' + ', '.join(extra[:_SHOWN]) + ', ...)' if extra else ''} and "
                f"{len(lacking)} of the model's are not in the file"
                f"{' (' + ', '.join(lacking[:_SHOWN]) + ', ...)' if lacking else ''}"
            )
        else:
            why = (
                f"no weight of the file fits the model ({len(state)} tensors, e.g. "
                f"{', '.join(list(state)[:_SHOWN])}; the model has "
                f"{', '.join(list(wanted)[:_SHOWN])}, ...)"
            )
        raise ConfigError(
            path,
            f"{why}: weights of another architecture (depth, width)",
            f"point {where} at weights of this model (for resnet*: a torchvision or timm ResNet "
            "of the same depth, full width), or leave it out",
        )
    missing = [
        n
        for n in wanted
        if n not in take
        and n not in {s[0] for s in skipped}
        and not n.endswith("num_batches_tracked")  # a counter, not a weight
    ]
    if label is not None:
        notes = (*notes, f"names mapped from {label}")
    if reshaped:
        notes = (*notes, f"{', '.join(reshaped)}: a 1x1 convolution's, taken as a Linear's")
    copied = not any(t.is_meta for t in wanted.values())
    if copied:
        with warnings.catch_warnings(), torch.no_grad():
            # Nothing to say beyond the report: the copy is checked name by name above.
            warnings.simplefilter("ignore")
            model.load_state_dict(take, strict=False)
    return WeightsReport(
        path=path,
        loaded=tuple(take),
        skipped=tuple(skipped),
        missing=tuple(missing),
        unexpected=tuple(unexpected),
        adapted=tuple(adapted),
        new=new,
        notes=notes,
        copied=copied,
    )
