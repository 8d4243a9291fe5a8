"""Checkpoints that survive crashes, move between layouts, and never mix two runs.

Why ``torch.distributed.checkpoint`` (DCP): every rank writes the tensors it
holds under their *original* model names (``layer1.0.conv1.weight``), DCP
keeps one copy of tensors replicated over tiles and data replicas, and a
later job on any other layout reads back exactly the names its ranks need. A
run trained on sp=2x2 x pp=2 is evaluated in one process by loading the same
checkpoint.

Why this directory dance: a checkpoint is written to ``step_N.partial`` and
renamed to ``step_N`` only after every rank finished and rank 0 wrote the
``hyfi-checkpoint.json`` marker; a crash at any moment leaves either the old
checkpoints or a ``.partial`` directory that is never mistaken for a finished
one. A failed write (disk full) removes its ``.partial`` and raises one
:class:`CheckpointError` on every rank; the previous checkpoint is untouched.

Why loads are staged: DCP fills tensors in place, so a checkpoint that fails
half-way would leave parts of itself in the model. Each candidate is loaded
into a copy of the state, and only a load that succeeded on *every* rank is
copied into the model and optimiser. The newest loadable checkpoint wins; when
none loads, :func:`load_latest` raises instead of letting training start over
from nothing.

Why run ids: the marker records the run (``run_id``), ordering is by step
number, and retention deletes only checkpoints of the current run, so an old
run's higher step numbers can neither outrank nor evict a new run's
checkpoints. Optimizer state is saved under parameter names too, so it also
survives a change of layout.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pickle
import re
import shutil
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from hyfi_imaging.errors import HyfiError
from hyfi_imaging.parallel.collectives import all_agree
from hyfi_imaging.train.safe_reader import SafeReader

__all__ = [
    "MARKER",
    "CheckpointError",
    "Loaded",
    "install_optimizer_state",
    "list_checkpoints",
    "load_latest",
    "optimizer_state",
    "save_checkpoint",
    "step_of",
]


MARKER = "hyfi-checkpoint.json"
#: ``step_N``, and ``step_N.replaced``: a checkpoint moved aside while the same step is
#: written again, loadable until the new one is in place (:func:`save_checkpoint`).
_NAME = re.compile(r"step_(\d+)(\.replaced)?")
_REPLACED = ".replaced"
#: What reading a damaged checkpoint raises (DCP wraps every rank's failure in a
#: CheckpointException, a BaseException); nothing else is caught.
_LOAD_ERRORS = (
    CheckpointException,
    OSError,
    ValueError,  # json.JSONDecodeError included
    KeyError,
    RuntimeError,
    EOFError,
    pickle.UnpicklingError,
)
# Optimiser state tensors by optimiser, created before loading so DCP can fill them.
_STATE_KEYS: dict[type[torch.optim.Optimizer], tuple[str, ...]] = {
    torch.optim.SGD: ("momentum_buffer",),
    torch.optim.AdamW: ("step", "exp_avg", "exp_avg_sq"),
    torch.optim.Adam: ("step", "exp_avg", "exp_avg_sq"),
}


class CheckpointError(HyfiError):
    """A checkpoint cannot be written, or none of a run's checkpoints can be loaded.

    Raised on every rank alike (the outcome is agreed collectively), so it is
    reported once.
    """

    collective = True


@dataclass
class Loaded:
    """The checkpoint that was loaded, its marker, and the newer ones that were not."""

    path: Path
    meta: dict[str, Any]
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def optimizer_state(
    named_params: Iterable[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    *,
    for_load: bool,
) -> dict[str, torch.Tensor]:
    """The optimiser's per-parameter tensors keyed ``<param name>/<state key>``.

    With ``for_load`` missing state is added as new zero tensors (not yet the
    optimiser's: :func:`install_optimizer_state` hands them over once a load
    succeeded, so a failed load leaves the optimiser as it was).
    """
    keys = _STATE_KEYS.get(type(optimizer), ())
    flat: dict[str, torch.Tensor] = {}
    for name, p in named_params:
        state = optimizer.state.get(p, {})
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                flat[f"{name}/{key}"] = value
        if not for_load:
            continue
        for key in keys:
            if key == "momentum_buffer" and not optimizer.defaults.get("momentum"):
                continue
            if key not in state:
                flat[f"{name}/{key}"] = (
                    torch.zeros((), dtype=torch.float32) if key == "step" else torch.zeros_like(p)
                )
    return flat


def install_optimizer_state(
    named_params: Iterable[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    flat: dict[str, torch.Tensor],
) -> None:
    """Give the optimiser the loaded tensors of ``flat`` it does not hold yet."""
    for name, p in named_params:
        for key_name, value in flat.items():
            pname, _, key = key_name.rpartition("/")
            if pname == name and optimizer.state[p].get(key) is not value:
                optimizer.state[p][key] = value


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_of(path: Path) -> int | None:
    """The step of a checkpoint directory ``step_N`` or ``step_N.replaced`` (None for any
    other name)."""
    m = _NAME.fullmatch(path.name)
    return int(m.group(1)) if m else None


def _marker(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def list_checkpoints(root: Path, run_id: str | None = None) -> list[Path]:
    """Finished checkpoints under ``root``, highest step first.

    With ``run_id``, only that run's (and those written before runs had ids,
    whose marker has none).
    """
    if not root.is_dir():
        return []
    done = []
    for p in root.iterdir():
        if step_of(p) is None or not p.is_dir() or not (p / MARKER).exists():
            continue
        if p.name.endswith(_REPLACED) and p.with_name(p.name[: -len(_REPLACED)]).exists():
            continue  # its step was written again: the new one is the checkpoint
        if run_id is not None:
            meta = _marker(p)
            if meta is not None and meta.get("run_id", run_id) != run_id:
                continue
        done.append(p)
    return sorted(done, key=lambda p: step_of(p) or 0, reverse=True)


def _interrupted(err: BaseException) -> bool:
    """Whether DCP's gathered failure is a Ctrl-C on some rank (a KeyboardInterrupt it wrapped)."""
    if isinstance(err, KeyboardInterrupt):
        return True
    if isinstance(err, CheckpointException):
        for failure in err.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException) and _interrupted(inner):
                return True
    return False


def _reason(err: BaseException) -> str:
    """The first line that says something, from ``err`` or what it wraps (DCP nests them)."""
    if isinstance(err, CheckpointException):
        for failure in err.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure  # (exception, trace)
            if isinstance(inner, BaseException):
                return _reason(inner)
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    if not lines:
        return type(err).__name__
    # PyTorch's C++ errors open with a tag ("[enforce fail at inline_container.cc:672] . ")
    # that says where, not what: what follows it does.
    text = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", lines[0])
    return (text or lines[0]).split(". ")[0][:160]


def _disk_reason(reason: str, root: Path, state: Any) -> str:
    """``reason``, or the full disk that caused it: PyTorch's zip writer reports a write that
    found no space without the system's error ("file write failed"), so a failed write to a
    disk with less free space than this rank's share of the checkpoint is said as one."""
    if not reason or os.strerror(errno.ENOSPC) in reason:
        return reason
    try:
        free = shutil.disk_usage(root if root.exists() else root.parent).free
    except OSError:
        return reason
    need = sum(t.numel() * t.element_size() for t in _tensors(state))
    return f"{os.strerror(errno.ENOSPC)}: {reason}" if free < max(need, 1 << 20) else reason


def _tensors(state: Any) -> list[torch.Tensor]:
    """The tensors of a nested state (dicts, lists), each as this rank holds it."""
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in _tensors(v)]
    return [_local(state)] if isinstance(state, torch.Tensor) else []


def save_checkpoint(
    root: Path,
    step: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    *,
    keep: int,
    run_id: str | None = None,
) -> Path:
    """Write ``state`` (collectively, every rank) as ``root/step_<step>``; keep the run's newest ``keep``.

    Retention deletes only checkpoints of ``run_id`` (never another run's, never
    the one just written). A failed write leaves no ``.partial`` behind and
    raises :class:`CheckpointError` on every rank.
    """
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    final = root / f"step_{step:08d}"
    partial = root / f"step_{step:08d}.partial"
    reason = ""
    if rank0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        except OSError as err:
            reason = _reason(err)
    if all_agree(not reason):
        try:
            dcp.save(state, checkpoint_id=str(partial))
        except (CheckpointException, OSError) as err:
            if _interrupted(err):  # a Ctrl-C, not a disk: said as one ("interrupted")
                if rank0:
                    shutil.rmtree(partial, ignore_errors=True)
                raise KeyboardInterrupt from err
            reason = _disk_reason(_reason(err), root, state)
    if all_agree(not reason) and rank0:
        try:
            marker = {
                **meta,
                "step": step,
                "run_id": run_id,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "crc32": _checksums(partial),
            }
            (partial / MARKER).write_text(json.dumps(marker, indent=2, default=str))
            # The step written again (a run's end, a relaunch after it): the old one moves
            # aside, loadable, until the new one is in place; a kill in between leaves one
            # of them (deleting it first left only the .partial: a relaunch started over).
            aside = final.with_name(final.name + _REPLACED)
            if final.exists():
                shutil.rmtree(aside, ignore_errors=True)
                final.rename(aside)
            partial.rename(final)
            shutil.rmtree(aside, ignore_errors=True)
        except OSError as err:
            reason = _reason(err)
    if not all_agree(not reason):
        if rank0:
            shutil.rmtree(partial, ignore_errors=True)
        previous = next((p.name for p in list_checkpoints(root, run_id) if p != final), None)
        raise CheckpointError(
            final,
            f"checkpoint not written ({reason or 'failed on another rank'})",
            "free space on that disk or set train.out_dir to another one, then relaunch to "
            + (f"resume from {previous}, which is intact" if previous else "start again"),
        )
    if rank0:
        for p in root.glob(f"step_*{_REPLACED}"):  # left by a kill after its replacement
            if p.with_name(p.name[: -len(_REPLACED)]).exists():
                shutil.rmtree(p, ignore_errors=True)
        ours = [p for p in list_checkpoints(root) if (_marker(p) or {}).get("run_id") == run_id]
        for old in [p for p in ours if p != final][max(keep - 1, 0) :]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _checksums(path: Path) -> dict[str, str]:
    """CRC-32 of every file DCP wrote in ``path`` (its shards and ``.metadata``), by name.

    Why: DCP keeps no checksum, so bytes flipped in a shard load as other weights without a
    word (a resumed run then trains from them); :func:`_damaged` checks them before a load.
    """
    sums: dict[str, str] = {}
    for f in sorted(path.iterdir()):
        if f.is_file() and f.name != MARKER:
            crc = 0
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 23):
                    crc = zlib.crc32(chunk, crc)
            sums[f.name] = f"{crc:08x}"
    return sums


def _damaged(path: Path, meta: dict[str, Any]) -> str:
    """Why ``path``'s files are not the ones its marker recorded; empty when they are (or
    when the marker has no checksums: a checkpoint of an earlier version)."""
    want = meta.get("crc32")
    if not isinstance(want, dict):
        return ""
    got = _checksums(path)
    for name, crc in sorted(want.items()):
        if name not in got:
            return f"its file {name} is missing"
        if got[name] != crc:
            return f"its file {name} does not match its checksum (damaged on disk)"
    return ""


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """DCP's loader silenced: it logs on the *root* logger (torch 2.13's
    ``state_dict_loader``), and printed a traceback for a missing ``.metadata`` before the
    one line that says which checkpoint was passed over and why."""
    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _staged(state: Any) -> Any:
    """A copy of ``state`` (nested dicts of tensors) for DCP to load into."""
    if isinstance(state, dict):
        return {k: _staged(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    return state


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor (FSDP2 shards)
    return to_local() if callable(to_local) else t


@torch.no_grad()
def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, dict):
        for k, v in dst.items():
            _copy_into(v, src[k])
    elif isinstance(dst, torch.Tensor):
        _local(dst).copy_(_local(src))


def load_latest(
    root_or_checkpoint: Path,
    state: dict[str, Any],
    *,
    run_id: str | None = None,
    expect: Callable[[Path, dict[str, Any]], None] | None = None,
    optional: str | None = None,
) -> Loaded | None:
    """Load the newest loadable checkpoint into ``state`` (collectively); None if there is none.

    ``root_or_checkpoint`` is a directory of checkpoints or one checkpoint;
    ``run_id`` restricts the candidates to one run. ``expect(path, marker)`` is
    called before each candidate is read and raises when the checkpoint means
    something else than the run (other classes, model, inputs): such a
    checkpoint is intact and must not be passed over. A checkpoint that fails to
    load on any rank leaves no trace in ``state`` and the previous one is
    tried. Raises :class:`CheckpointError` (same line on every rank) when
    there are checkpoints and none loads. ``optional`` names a key of ``state``
    whose entries a checkpoint may lack (optimizer state of a parameter that never
    had a gradient: a frozen one): those are removed from ``state[optional]``.
    """
    root = Path(root_or_checkpoint)
    candidates = [root] if (root / MARKER).exists() else list_checkpoints(root, run_id)
    failures: list[tuple[Path, str]] = []
    for path in candidates:
        reason = ""
        try:
            meta = json.loads((path / MARKER).read_text())
        except _LOAD_ERRORS as err:
            meta, reason = {}, _reason(err)
        else:
            if expect is not None:  # outside the try: another meaning is not damage
                expect(path, meta)
            rank0 = not dist.is_initialized() or dist.get_rank() == 0
            try:  # checked once (by rank 0) and agreed before DCP's collective load
                reason = _damaged(path, meta) if rank0 else ""
            except OSError as err:
                reason = _reason(err)
            if not all_agree(not reason):
                failures.append((path, reason or "damaged (checked by rank 0)"))
                continue
            reader = SafeReader(path)  # metadata that would run code is refused
            try:
                staged = _staged(state)
                if optional is not None:
                    saved = reader.read_metadata().state_dict_metadata
                    staged[optional] = {
                        k: v for k, v in staged[optional].items() if f"{optional}.{k}" in saved
                    }
                with _quiet_dcp():  # a damaged file is said in one line, below
                    dcp.load(staged, storage_reader=reader)
            except _LOAD_ERRORS as err:
                if reader.refused is not None:  # not damage: never passed over silently
                    raise reader.refused from None
                reason = _reason(err)
        if all_agree(not reason):
            if optional is not None:
                for k in set(state[optional]) - set(staged[optional]):
                    del state[optional][k]
            _copy_into(state, staged)
            return Loaded(path, meta, failures)
        failures.append((path, reason or "failed on another rank"))
    if not failures:
        return None
    listed = "; ".join(f"{p.name}: {why}" for p, why in failures)
    raise CheckpointError(
        root,
        f"none of the {len(failures)} checkpoint(s) can be loaded ({listed})",
        "relaunch with --restart to start over (the old run is kept in previous/), "
        "or put back an intact checkpoint",
    )
