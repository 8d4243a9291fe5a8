"""A user's model built from ``ParallelBranches`` (inception-style blocks), for
``tests/test_branches_mpi.py``: ``hyfi-verify --model branch_blocks:build --branches 2``.

Two blocks: a concatenation of three branches of different widths and kernels (one a
pool then a projection), then a sum of two; BatchNorm inside the branches, so each op's
running statistics must come from the rank that runs it.
"""

from __future__ import annotations

from torch import Tensor, nn

from hyfi_imaging.parallel.branches import ParallelBranches


def _conv(c_in: int, c_out: int, k: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, k, padding=k // 2, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()
    )


class BranchNet(nn.Module):
    """stem -> concat(1x1, 3x3, pool + 1x1) -> sum(3x3, 5x5) -> pooled linear head."""

    def __init__(self, num_classes: int = 3, width: int = 4) -> None:
        super().__init__()
        w = width
        self.stem = _conv(3, w, 3)
        self.mixed = ParallelBranches(
            [
                _conv(w, w, 1),
                _conv(w, 2 * w, 3),
                nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), _conv(w, w, 1)),
            ],
            combine="concat",
        )
        self.summed = ParallelBranches([_conv(4 * w, w, 3), _conv(4 * w, w, 5)], combine="sum")
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(w, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits of ``x``."""
        out: Tensor = self.fc(self.pool(self.summed(self.mixed(self.stem(x)))).flatten(1))
        return out


def build(num_classes: int = 3) -> nn.Module:
    """The model (``module:function`` path for ``--model``)."""
    return BranchNet(num_classes=num_classes)
