"""Every Python snippet of the README and the user guide names only what the package has.

Why: a reader copies a snippet before reading the reference; a name the package does not
export (``hyfi.tile_of`` once shipped before it existed), a renamed keyword or a
positional argument too many fails in their hands, not ours. The snippets that run whole
on this machine run in their own tests (``test_own_loop_mpi``, ``test_doc_examples``);
the rest need a cluster, a slide file or a 16K image, so here each one is parsed and
every ``hyfi_imaging`` name it reaches -- ``import hyfi_imaging as hyfi`` then
``hyfi.X``, ``from hyfi_imaging.m import X``, and the names a continuation snippet uses
from an earlier one -- is looked up, and every call to one is bound to its signature
(``inspect.Signature.bind_partial``: unknown keywords and surplus positionals fail).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/user-guide.md")
PACKAGE = "hyfi_imaging"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _snippets() -> list[Any]:
    out = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for m in _BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append(pytest.param(m.group(1), id=f"{doc}:{line}"))
    return out


class _Names(ast.NodeVisitor):
    """What one snippet binds to package objects, and the package names and calls it uses."""

    def __init__(self, known: dict[str, Any]) -> None:
        self.known = known  # name in the snippet -> package module or object
        self.missing: list[str] = []
        self.bad_calls: list[str] = []

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.split(".")[0] == PACKAGE:
                self.known[a.asname or a.name.split(".")[0]] = importlib.import_module(
                    a.name if a.asname else PACKAGE
                )

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if not node.module or node.module.split(".")[0] != PACKAGE:
            return
        module = importlib.import_module(node.module)
        for a in node.names:
            if not hasattr(module, a.name):
                self.missing.append(f"from {node.module} import {a.name}")
            else:
                self.known[a.asname or a.name] = getattr(module, a.name)

    def resolve(self, node: ast.expr) -> tuple[str, Any] | None:
        """``(dotted name, object)`` for a package name or attribute chain, else None."""
        if isinstance(node, ast.Name) and node.id in self.known:
            return node.id, self.known[node.id]
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            if base is None or not inspect.ismodule(base[1]):
                return None  # an attribute of an object (report.ok): not a package name
            name = f"{base[0]}.{node.attr}"
            if not hasattr(base[1], node.attr):
                if name not in self.missing:  # a call's name is looked up twice
                    self.missing.append(name)
                return None
            return name, getattr(base[1], node.attr)
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.resolve(node)

    def visit_Call(self, node: ast.Call) -> None:
        found = self.resolve(node.func)
        if found is not None and callable(found[1]):
            name, fn = found
            try:
                sig = inspect.signature(fn)
            except (TypeError, ValueError):  # a builtin without a signature
                sig = None
            starred = any(isinstance(a, ast.Starred) for a in node.args)
            keywords = {k.arg: None for k in node.keywords if k.arg is not None}
            if sig is not None and not starred:
                try:
                    sig.bind_partial(*[None] * len(node.args), **keywords)
                except TypeError as err:
                    self.bad_calls.append(f"{name}(...): {err}")
        if found is None:
            self.visit(node.func)
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            self.visit(arg)


@pytest.mark.parametrize("code", _snippets())
def test_snippet_names_exist_and_calls_bind(code: str) -> None:
    tree = ast.parse(code)  # a snippet that does not parse cannot be copied
    package = importlib.import_module(PACKAGE)
    # Continuation snippets use the guide's usual names without importing them again.
    known: dict[str, Any] = {"hyfi": package, "hy": package}
    for name in ("apply_spatial", "tile_of", "verify_model", "init_parallel", "Layout"):
        known[name] = getattr(package, name)
    names = _Names(known)
    names.visit(tree)
    assert not names.missing, f"not in the package: {names.missing}"
    assert not names.bad_calls, names.bad_calls


def test_the_snippets_are_found_and_a_wrong_name_fails() -> None:
    assert len(_snippets()) >= 8
    wrong = _Names({"hyfi": importlib.import_module(PACKAGE)})
    wrong.visit(ast.parse("hyfi.tile_off(x)\nhyfi.verify_model(f, image_sise=(1, 2))"))
    assert wrong.missing == ["hyfi.tile_off"]
    assert len(wrong.bad_calls) == 1 and "image_sise" in wrong.bad_calls[0]


#: The commands whose documented invocations are parsed by their own parser here
#: (hyfi-verify and hyfi-plan examples also run: tests/test_doc_examples.py).
COMMANDS = ("preprocess", "train", "predict", "synth", "verify", "plan")
_LAUNCH = re.compile(r"^(?:mpirun|mpiexec|srun|torchrun)\s+(?:-\S+(?:\s+(?!hyfi-)\S+)?\s+)*")


def _fenced(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of each fenced block, fences paired in order."""
    blocks: list[tuple[str, str]] = []
    lang: str | None = None
    body: list[str] = []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                blocks.append((lang, "\n".join(body)))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def _command_lines() -> list[Any]:
    """``(command, line)`` of every hyfi command line in a shell block of :data:`DOCS`
    (continuations joined; a trailing comment, a redirection and a launcher with its
    options dropped)."""
    out = []
    for doc in DOCS:
        for lang, block in _fenced((ROOT / doc).read_text()):
            if lang not in ("", "bash", "sh", "console"):
                continue
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = re.sub(r"\s+#.*$", "", line.strip().removeprefix("$ "))
                line = _LAUNCH.sub("", re.split(r"\s+(?:[|>;]|&&)\s*", line)[0])
                words = line.split()
                if len(words) > 1 and words[0] in {f"hyfi-{c}" for c in COMMANDS}:
                    out.append(pytest.param(words[0], line, id=f"{doc}: {line}"[:150]))
    return out


@pytest.mark.parametrize(("command", "line"), _command_lines())
def test_documented_command_lines_parse(command: str, line: str) -> None:
    import contextlib
    import io
    import shlex

    cli = importlib.import_module(f"hyfi_imaging.cli.{command.removeprefix('hyfi-')}")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cli.build_parser().parse_args(shlex.split(line)[1:])
    except SystemExit as exit_:
        assert exit_.code == 0, f"{line!r}: {err.getvalue().strip().splitlines()[-1:]}"


def test_command_lines_are_found() -> None:
    found = {p.values[0] for p in _command_lines()}
    assert found >= {"hyfi-preprocess", "hyfi-train", "hyfi-predict"}, found
