"""Every tensor made for a collective is made on the group's device.

NCCL groups take CUDA tensors only, and CI has no GPU: a flag built with
``torch.tensor([...])`` (on the CPU) and handed to ``dist.all_reduce`` works
under Gloo here and crashes on a cluster. This test reads the package's source:
in every function, a tensor created by a torch factory and passed to a
``torch.distributed`` collective must name its ``device=`` (or be moved with
``.to(device)``, or be made ``*_like`` an existing tensor). It failed on the
checkpoint resume (``_all_ok``) and hyfi-verify's final flag before they moved
to :func:`hyfi_imaging.parallel.collectives.all_agree`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hyfi_imaging"
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "as_tensor"}
COLLECTIVES = {
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce",
    "send",
    "recv",
    "isend",
    "irecv",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
}


def _is_host_factory(call: ast.expr) -> bool:
    """``torch.<factory>(...)`` without ``device=``."""
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr in FACTORIES
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "torch"
        and not any(k.arg == "device" for k in call.keywords)
    )


def _violations(tree: ast.AST, path: Path) -> list[str]:
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        host: set[str] = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name):
                    if _is_host_factory(node.value):
                        host.add(target.id)
                    else:
                        host.discard(target.id)
        for node in ast.walk(fn):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in COLLECTIVES
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "dist"
            ):
                continue
            for arg in node.args[:1]:
                if (isinstance(arg, ast.Name) and arg.id in host) or _is_host_factory(arg):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {fn.name}")
    return found


def test_no_host_tensor_reaches_a_collective() -> None:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        bad += _violations(ast.parse(path.read_text()), path)
    assert not bad, "tensors created without device= handed to a collective: " + ", ".join(bad)


@pytest.mark.parametrize(
    ("source", "caught"),
    [
        ("def f():\n    flag = torch.tensor([1])\n    dist.all_reduce(flag)\n", True),
        ("def f(d):\n    flag = torch.tensor([1], device=d)\n    dist.all_reduce(flag)\n", False),
        ("def f(d):\n    v = torch.tensor([1]).to(d)\n    dist.all_reduce(v)\n", False),
        ("def f():\n    dist.broadcast(torch.zeros(3), src=0)\n", True),
    ],
)
def test_the_check_catches_host_tensors(source: str, caught: bool) -> None:
    assert bool(_violations(ast.parse(source), PACKAGE / "x.py")) is caught
