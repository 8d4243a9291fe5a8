"""The shipped recipes, dataset cards and model cards, wherever hyfi-imaging is installed.

Why this module: ``recipes/``, ``datasets/`` and ``models/`` are data folders at
the top of the repository (not Python packages: a top-level ``datasets`` or
``models`` package would shadow others). A source checkout and an editable
install find them next to the package; an installed wheel has no repository,
so ``pyproject.toml`` ships the same three folders as package data under
``hyfi_imaging/share/`` (``package-dir`` maps them; nothing is copied in the
repository). :func:`data_root` looks in the installed place first, then in the
checkout, so ``hyfi-demo`` and ``hyfi-train synthetic`` work from both.

A recipe names its cards relative to itself (``dataset: ../datasets/x.yaml``),
which holds in both layouts because the three folders stay siblings.
"""

from __future__ import annotations

from pathlib import Path

from hyfi_imaging.errors import HyfiError

__all__ = ["data_root", "find_recipe", "recipe_names", "recipe_path"]

_PACKAGE = Path(__file__).resolve().parent
#: Files that only a complete data root has (a bare ``datasets`` folder is not enough:
#: site-packages may hold the Hugging Face ``datasets`` package).
_MARKERS = ("recipes/synthetic.yaml", "datasets/synthetic.yaml")


def data_root() -> Path:
    """The folder holding ``recipes/``, ``datasets/`` and ``models/``.

    Raises:
        HyfiError: neither an installed copy nor a source checkout has them.
    """
    for root in (_PACKAGE / "share", _PACKAGE.parent):
        if all((root / m).is_file() for m in _MARKERS):
            return root
    raise HyfiError(
        _PACKAGE,
        "the shipped recipes and dataset cards are missing (neither share/ in the package "
        "nor recipes/ beside it)",
        "reinstall hyfi-imaging from a wheel or run from a source checkout",
    )


def recipe_names() -> list[str]:
    """Names of the shipped recipes (``synthetic``, ``camelyon16-8k`` ...), sorted."""
    return sorted(p.stem for p in (data_root() / "recipes").glob("*.yaml"))


def recipe_path(name: str) -> Path:
    """The shipped recipe ``name`` (with or without ``.yaml``).

    Raises:
        HyfiError: no shipped recipe of that name (the message lists them).
    """
    stem = name.removesuffix(".yaml")
    path = data_root() / "recipes" / f"{stem}.yaml"
    if not path.is_file():
        raise HyfiError(name, "is not a shipped recipe", f"use one of {', '.join(recipe_names())}")
    return path


def find_recipe(path: Path) -> Path:
    """``path`` if it exists; else the shipped recipe it names (``synthetic``); else ``path``.

    Only a bare name (no folder) falls back to the shipped recipes, so a
    mistyped path is reported as the file it names, not replaced by another.
    """
    if path.exists() or len(path.parts) != 1:
        return path
    try:
        return recipe_path(path.name)
    except HyfiError:
        return path
