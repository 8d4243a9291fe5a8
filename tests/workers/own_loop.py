"""The user guide's own-loop snippet, run as written (float64), with one edit per variant.

Usage: ``python tests/workers/own_loop.py GRID VARIANT OUT`` (under ``mpiexec -n
GY*GX`` for a grid other than ``1x1``). The snippet is read from
``docs/user-guide.md`` (the block that starts ``# mpirun -np 4 python
own_loop.py``); ``GRID`` replaces its ``sp=(2, 2)``; ``VARIANT`` is

* ``as-written``: nothing else changed;
* ``accumulate``: each step's backward split in two half-loss backwards (gradient
  accumulation);
* ``no-rule``: ``apply_spatial(..., reduce_grads=False)``, the loop the guide used to
  show: must differ from one process;
* ``seeded-apart``: every rank seeds with its own rank: must be refused.

Every rank saves its model's parameters to ``OUT.rank<R>.pt``; an error is saved
as ``{"error": ...}`` instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "user-guide.md"
OPENING = "# mpirun -np 4 python own_loop.py"

EDITS = {
    "as-written": [],
    "accumulate": [
        ("loss.backward()", "(loss / 2).backward(retain_graph=True); (loss / 2).backward()")
    ],
    "no-rule": [
        ("image_size=(160, 144))", "image_size=(160, 144), reduce_grads=False)"),
    ],
    "seeded-apart": [("torch.manual_seed(0)", "torch.manual_seed(pc.rank)")],
}


def snippet() -> str:
    """The guide's code block that opens with :data:`OPENING`."""
    text = GUIDE.read_text()
    start = text.index(OPENING)
    return text[start : text.index("```", start)]


def main(argv: list[str]) -> int:
    grid, variant, out = argv
    gy, gx = (int(v) for v in grid.split("x"))
    code = snippet().replace("sp=(2, 2)", f"sp=({gy}, {gx})")
    for old, new in EDITS[variant]:
        assert old in code, f"the guide's snippet no longer holds {old!r}"
        code = code.replace(old, new)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    namespace: dict[str, object] = {"__name__": "__main__"}
    from hyfi_imaging import HyfiError
    from hyfi_imaging.parallel.launch import shutdown

    rank = 0
    try:
        exec(compile(code, "own_loop.py", "exec"), namespace)
        pc = namespace["pc"]
        rank = pc.rank  # type: ignore[attr-defined]
        model = namespace["model"]
        result: dict[str, object] = {
            n: p.detach().clone()
            for n, p in model.named_parameters()  # type: ignore[attr-defined]
        }
    except HyfiError as err:
        result = {"error": str(err)}
        if torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
    torch.save(result, f"{out}.rank{rank}.pt")
    shutdown()
    return 0


if __name__ == "__main__":
    from hyfi_imaging.parallel.launch import exit_now

    exit_now(main(sys.argv[1:]))
