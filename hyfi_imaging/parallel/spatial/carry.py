"""Deep halos: runs of windowed layers that share one deeper halo exchange.

Why: one exchange of a deeper halo serves up to ``halo_depth`` layers; each layer
of a run computes its outputs and the border the rest of the run reads.
"""

from __future__ import annotations

from torch import nn

from hyfi_imaging.parallel.geometry import LayerGeom, carried_halos
from hyfi_imaging.parallel.spatial.base import _NO_CARRY
from hyfi_imaging.parallel.spatial.kinds import _CARRIERS, _DEEPABLE, _SPATIAL_CARRIERS

__all__: list[str] = []


def _is_carrier(m: nn.Module) -> bool:
    """Layers a deep halo may pass through: per pixel once their statistics are known."""
    return type(m) in _CARRIERS


def _deepable(m: nn.Module) -> bool:
    """Windowed layers whose window is fixed (the registry's ``deepable``: 2-D and 3-D
    convolution, max and average pooling), without ``ceil_mode``."""
    return type(m) in _DEEPABLE and not any(g.ceil_mode for g in _geoms(m))


def _geoms(m: nn.Module) -> tuple[LayerGeom, ...]:
    geoms: tuple[LayerGeom, ...] = m.hyfi_geoms  # type: ignore[assignment]
    return geoms


def _plan_deep_halos(
    model: nn.Module,
    links: dict[str, tuple[str, tuple[str, ...]]],
    depth: int,
    stage_cuts: bool,
) -> list[list[str]]:
    """Group linked windowed layers into runs that share one (deeper) halo exchange.

    Along a chain of layers linked by the watch (each reads the previous one's
    output alone, through per-pixel ops and BatchNorms), runs of up to
    ``depth`` layers that need a halo are formed. The first layer of a run
    receives the run's whole halo (:func:`~.geometry.carried_halos`); each
    layer then computes its outputs *and* the border the rest of the run reads,
    masked outside the image to the next layer's padding value; BatchNorms in
    between take statistics from the tile's own pixels. The last layer's output
    is exactly the tile. Sets ``hyfi_carry`` on the layers; returns the runs.
    """
    if depth <= 1:
        return []
    modules = dict(model.named_modules())
    succ: dict[str, tuple[str, tuple[str, ...]]] = {}
    for consumer, (producer, carriers) in links.items():
        if producer not in modules or consumer not in modules:
            continue
        if not (_deepable(modules[producer]) and _deepable(modules[consumer])):
            continue
        if not all(type(modules[c]) in _SPATIAL_CARRIERS for c in carriers):
            continue
        if stage_cuts and producer.split(".")[0] != consumer.split(".")[0]:
            continue
        succ[producer] = (consumer, carriers)
    consumers = {c for c, _ in succ.values()}
    runs: list[list[str]] = []
    for head in sorted(p for p in succ if p not in consumers):
        chain, between = [head], [tuple[str, ...]()]
        while chain[-1] in succ:
            nxt, carriers = succ[chain[-1]]
            chain.append(nxt)
            between.append(carriers)
        group: list[int] = []
        halos = 0
        for k, path in enumerate([*chain, None]):
            needs = path is not None and any(any(g.halo()) for g in _geoms(modules[path]))
            if path is None or (needs and halos == depth):
                if len(group) > 1:
                    runs.append([chain[i] for i in group])
                    _set_carries(modules, [chain[i] for i in group], [between[i] for i in group])
                group, halos = [], 0
            if path is not None:
                group.append(k)
                halos += needs
    return runs


def _set_carries(
    modules: dict[str, nn.Module], run: list[str], between: list[tuple[str, ...]]
) -> None:
    carries = carried_halos([_geoms(modules[p]) for p in run])
    for k, (path, (inn, out)) in enumerate(zip(run, carries, strict=True)):
        carry_in = _NO_CARRY if k == 0 else inn
        modules[path].hyfi_carry = (carry_in, out)  # type: ignore[assignment]
        for c in between[k] if k else ():
            modules[c].hyfi_carry = (inn, inn)  # type: ignore[assignment]
