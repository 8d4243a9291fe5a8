"""Automatic pipeline balance: measure every top-level layer, cut to minimise the slowest stage.

As torchgpipe's ``balance_by_time`` / ``balance_by_size``: run each layer of
the model on a sample input, record a cost per layer, and choose the
contiguous partition into ``stages`` parts whose largest part is smallest.

Why an exact partition: models have tens of top-level layers, so the
dynamic programme over (layers, stages) is instant; torchgpipe's block
partition heuristic is not needed and can miss the optimum.

Why layer by layer on a *tile-sized* micro-batch: a stage runs one
micro-batch of one tile at a time, so that is the workload whose cost the
cut should balance; and the whole model on that input may not fit one device
(that is why it is pipelined), while one layer at a time does. Each layer's
input is produced by the layers before it under ``no_grad``.

Two costs:

* ``time`` -- forward + backward seconds of the layer (median of a few runs).
  Noisy, so the engine reduces the measurements of all ranks with ``max`` (an
  exact operation: every rank then holds the same numbers and cuts the same
  way).
* ``memory`` -- bytes the layer keeps for backward (tensors saved by autograd,
  counted once each) plus its output and its parameters and their gradients.
  Deterministic and device-independent, so every rank computes the same cut
  without communication; the right choice when activations are what does not
  fit, which is the case whole-slide training is about.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

from hyfi_imaging.errors import ConfigError

__all__ = [
    "BalanceBy",
    "LayerCosts",
    "balance_by_size",
    "balance_by_time",
    "flat_tensors",
    "measure_layers",
    "partition",
]

BalanceBy = Literal["time", "memory"]


def partition(
    costs: Sequence[float], stages: int, *, shares: Sequence[float] | None = None
) -> tuple[int, ...]:
    """Layers per stage for contiguous stages that minimise the largest stage cost.

    Every stage gets at least one layer. ``shares`` divides each stage's cost (a stage
    on a grid of 4 tiles holds a quarter of its layers' activations per rank; default 1). Among optimal cuts the one whose
    stages are filled earliest (most layers in stage 0, then stage 1, ...) is
    returned, so equal costs give a deterministic answer.

    OK: ``partition([1, 1, 1, 1], 2) == (2, 2)``; ``partition([4, 1, 1, 1, 1], 2) == (1, 4)``.
    Error: ``partition([1, 2], 3)`` raises ConfigError (fewer layers than stages).
    """
    n = len(costs)
    if stages < 1 or n < stages:
        raise ConfigError(
            f"pipeline of {stages} stages",
            f"the model has only {n} top-level layers",
            f"use at most {n} pipeline stages",
        )
    if any(c < 0 for c in costs):
        raise ValueError(f"layer costs must be >= 0, got {list(costs)}")
    share = [float(v) for v in shares] if shares is not None else [1.0] * stages
    if len(share) != stages or min(share) <= 0:
        raise ValueError(f"need {stages} positive stage shares, got {shares}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest possible max cost of the layers i.. in k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][n] = 0.0
    for k in range(1, stages + 1):
        for i in range(n - k, -1, -1):
            for j in range(i + 1, n - k + 2):  # first stage takes layers i..j-1
                cand = max((prefix[j] - prefix[i]) / share[stages - k], best[k - 1][j])
                if cand < best[k][i]:
                    best[k][i] = cand
    # Reconstruct, taking the longest first stage that keeps the optimum.
    out, i = [], 0
    for k in range(stages, 0, -1):
        target = best[k][i]
        for j in range(n - k + 1, i, -1):
            cost = (prefix[j] - prefix[i]) / share[stages - k]
            if max(cost, best[k - 1][j]) <= target * (1 + 1e-12):
                out.append(j - i)
                i = j
                break
    return tuple(out)


@dataclass(frozen=True)
class LayerCosts:
    """Measured cost of every top-level layer: seconds (forward + backward) and bytes."""

    names: tuple[str, ...]
    seconds: tuple[float, ...]
    bytes: tuple[int, ...]

    def of(self, by: BalanceBy) -> tuple[float, ...]:
        """The cost vector ``partition`` balances for ``by``."""
        return self.seconds if by == "time" else tuple(float(b) for b in self.bytes)


def flat_tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in ``x`` (a tensor, or nested tuples/lists of them), in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, tuple | list):
        return [t for v in x for t in flat_tensors(v)]
    return []


def _detach(x: Any, requires_grad: bool) -> Any:
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        return y.requires_grad_(requires_grad and y.is_floating_point())
    if isinstance(x, tuple | list):
        return tuple(_detach(v, requires_grad) for v in x)
    return x


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _saved_bytes(run: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``run`` and count the bytes of distinct storages autograd saves for backward."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            seen[(id(t), 0)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(seen.values())


def measure_layers(
    layers: Sequence[tuple[str, nn.Module]],
    sample: torch.Tensor,
    *,
    repeat: int = 3,
) -> LayerCosts:
    """Time and size every layer on ``sample`` (one micro-batch), one layer at a time.

    The layers are run in training mode as they will be trained; BatchNorm
    running statistics are restored afterwards, so measuring changes nothing.
    """
    device = sample.device
    norms = [
        m
        for _, layer in layers
        for m in layer.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase)
    ]
    saved = [{k: v.clone() for k, v in m.named_buffers()} for m in norms]
    training = [layer.training for _, layer in layers]
    seconds: list[float] = []
    sizes: list[int] = []
    x: Any = sample
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # dropout must not shift training's RNG
        try:
            _measure(layers, x, repeat, seconds, sizes)
        finally:
            with torch.no_grad():
                for m, state in zip(norms, saved, strict=True):
                    for k, v in m.named_buffers():
                        v.copy_(state[k])
            for (_, layer), was in zip(layers, training, strict=True):
                layer.train(was)
    return LayerCosts(tuple(n for n, _ in layers), tuple(seconds), tuple(sizes))


def _clone(x: Any) -> Any:
    """A non-leaf copy, so that a layer starting with an in-place op may modify it."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, tuple | list):
        return tuple(_clone(v) for v in x)
    return x


def _call(layer: nn.Module, leaf: Any) -> Any:
    return layer(_clone(leaf))


def _measure(
    layers: Sequence[tuple[str, nn.Module]],
    x: Any,
    repeat: int,
    seconds: list[float],
    sizes: list[int],
) -> None:
    device = flat_tensors(x)[0].device
    for _, layer in layers:
        layer.train()
        params = [p for p in layer.parameters() if p.requires_grad]
        grads = [p.grad for p in params]
        param_bytes = sum(2 * p.numel() * p.element_size() for p in params)
        runs, size, out = [], 0, None
        for _ in range(max(1, repeat)):
            leaf = _detach(x, requires_grad=True)
            _sync(device)
            began = time.perf_counter()
            out, size = _saved_bytes(partial(_call, layer, leaf))
            outs = [t for t in flat_tensors(out) if t.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            _sync(device)
            runs.append(time.perf_counter() - began)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        out_bytes = sum(t.numel() * t.element_size() for t in flat_tensors(out))
        seconds.append(statistics.median(runs))
        sizes.append(size + out_bytes + param_bytes)
        with torch.no_grad():
            x = _detach(layer(_detach(x, False)), False)


def balance_by_time(
    stages: int, layers: Sequence[tuple[str, nn.Module]], sample: torch.Tensor, *, repeat: int = 3
) -> tuple[int, ...]:
    """Layers per stage that balance measured forward + backward time (torchgpipe's way)."""
    return partition(measure_layers(layers, sample, repeat=repeat).seconds, stages)


def balance_by_size(
    stages: int, layers: Sequence[tuple[str, nn.Module]], sample: torch.Tensor
) -> tuple[int, ...]:
    """Layers per stage that balance the memory each stage holds for one micro-batch."""
    costs = measure_layers(layers, sample, repeat=1)
    return partition(costs.of("memory"), stages)
