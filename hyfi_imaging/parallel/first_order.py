"""Second-order gradients through the tiles' exchanges: refused, not computed wrong.

Why: the backward of a spatial layer exchanges halo gradients and sums statistics
over the grid with collectives that autograd does not record. A gradient penalty
(``torch.autograd.grad(..., create_graph=True)`` then a backward of the gradient's
norm) differentiated those backwards as if no rank had sent anything: the penalty
was exact, the parameters' gradients of it 0.18-0.56 off on a 1x2 grid, silently.
A backward asked to build a graph (grad mode on inside it: ``create_graph=True``)
is refused in one line instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hyfi_imaging.errors import ConfigError

__all__ = ["first_order"]

F = TypeVar("F", bound=Callable[..., Any])


def first_order(op: str) -> Callable[[F], F]:
    """Decorate a custom autograd Function's ``backward`` (``op``: what it is, in words) so
    that a double backward through it is refused in one line."""

    def wrap(backward: F) -> F:
        @functools.wraps(backward)
        def checked(ctx: Any, *grads: Any) -> Any:
            if torch.is_grad_enabled():  # the engine runs backward in grad mode = create_graph
                raise ConfigError(
                    op,
                    "was asked for a second-order gradient (create_graph=True: a gradient "
                    "penalty, a double backward), which the tiles' exchanges do not compute",
                    "compute that term without spatial parallelism (a 1x1 grid), or use a "
                    "first-order regulariser",
                )
            return backward(ctx, *grads)

        return checked  # type: ignore[return-value]

    return wrap
