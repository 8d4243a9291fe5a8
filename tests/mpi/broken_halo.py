"""The halo exchange broken on purpose: verification that cannot fail proves nothing.

:func:`dropped_halo_gradients` makes the exchange's backward drop the halo
gradients instead of adding them into their owners' borders, the one bug that
no single-process test can see. The tests use it to prove that the adjoint
test, the pipeline comparisons and ``hyfi-verify`` catch it.

Why here and not a ``hyfi-verify`` option: a way to break the product belongs
to the tests, not to a command users run. As a script this runs
``hyfi-verify``'s own ``main`` with the exchange broken, so the test sees the
real command's report and exit status::

    mpiexec -n 2 python tests/mpi/broken_halo.py --model resnet20-v2 \\
        --image-size 29x23 --spatial 1x2 --json
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["dropped_halo_gradients", "main"]


def _drop(
    g: torch.Tensor,
    before: int,
    after: int,
    lo: int | None,
    hi: int | None,
    dim: int,
    overlap: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """Cut the halo off the gradient and add what the neighbours return nowhere.

    The messages still go both ways (into a copy): tiles of one grid may take different
    paths for one layer (extended tile or the tile itself), and every path must send and
    receive alike or the ranks would wait for each other.
    """
    from hyfi_imaging.parallel import halo

    _, overlap = halo._reduce_for_real(g.clone(), before, after, lo, hi, dim, overlap)
    return g.narrow(dim, before, g.shape[dim] - before - after).clone(), overlap


def _lose(*args: object) -> None:
    """Receive a neighbour's halo gradient and add it nowhere."""


@contextmanager
def dropped_halo_gradients() -> Iterator[None]:
    """Within the block, the halo exchange's backward loses every halo gradient (both the
    extended-tile adjoint and the one of layers computed on the tile itself)."""
    from hyfi_imaging.parallel import halo

    saved = halo._reduce, halo._add_returned
    halo._reduce_for_real = saved[0]  # type: ignore[attr-defined]
    halo._reduce, halo._add_returned = _drop, _lose
    try:
        yield
    finally:
        halo._reduce, halo._add_returned = saved
        del halo._reduce_for_real  # type: ignore[attr-defined]


def main() -> int:
    """``hyfi-verify`` with the command-line arguments, the exchange broken."""
    from hyfi_imaging.cli import verify

    with dropped_halo_gradients():
        return verify.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
