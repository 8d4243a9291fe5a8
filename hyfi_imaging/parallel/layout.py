"""The parallel layout: how many ranks along data, pipeline and spatial axes.

A :class:`Layout` is a frozen, validated value. It is built into a
``DeviceMesh`` with named axes ``("dp", "pp", "sy", "sx")`` — data replicas,
pipeline stages, tile rows, tile columns — and every other module asks the mesh
for a group by name instead of doing rank arithmetic. Validation happens before
any process group exists, so a wrong layout costs nothing and the message names
the numbers and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hyfi_imaging.errors import ConfigError

__all__ = ["MESH_DIMS", "Layout"]

#: Mesh axis names, outermost first. Spatial axes are innermost so that the
#: ranks of one tile grid are neighbours (same node, fastest links).
MESH_DIMS = ("dp", "pp", "sy", "sx")


@dataclass(frozen=True)
class Layout:
    """Ranks along each axis: ``dp`` data replicas, ``pp`` pipeline stages, ``sp`` tile grid (gy, gx).

    OK::

        Layout(sp=(2, 2))            # 4 ranks, one image cut into 2x2 tiles
        Layout(dp=2, pp=2, sp=(1, 2))  # 8 ranks

    Error::

        Layout(sp=(0, 2))            # ConfigError: grid factors must be >= 1
    """

    dp: int = 1
    pp: int = 1
    sp: tuple[int, int] = (1, 1)

    def __post_init__(self) -> None:
        for name, value in (
            ("dp", self.dp),
            ("pp", self.pp),
            ("sp rows", self.sp[0]),
            ("sp columns", self.sp[1]),
        ):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(
                    "layout",
                    f"{name} must be a positive integer, got {value!r}",
                    "use e.g. --spatial 2x2 --pipeline 1 --data 1",
                )

    @property
    def world_size(self) -> int:
        """Ranks the layout needs: dp * pp * gy * gx."""
        return self.dp * self.pp * self.sp[0] * self.sp[1]

    @property
    def sp_size(self) -> int:
        return self.sp[0] * self.sp[1]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Mesh shape in :data:`MESH_DIMS` order."""
        return (self.dp, self.pp, self.sp[0], self.sp[1])

    def check_world(self, world_size: int) -> None:
        """Raise ConfigError unless the job has exactly the ranks this layout needs."""
        if world_size != self.world_size:
            raise ConfigError(
                "layout",
                f"{self.describe()} needs {self.world_size} ranks but the job has {world_size}",
                f"launch with -np {self.world_size}, or change the layout so that "
                f"dp*pp*gy*gx = {world_size}",
            )

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(dp, pp, sy, sx) coordinates of a global rank (row-major over the mesh)."""
        sx = rank % self.sp[1]
        sy = (rank // self.sp[1]) % self.sp[0]
        pp = (rank // self.sp_size) % self.pp
        dp = rank // (self.sp_size * self.pp)
        return dp, pp, sy, sx

    def describe(self) -> str:
        return f"dp={self.dp} x pp={self.pp} x sp={self.sp[0]}x{self.sp[1]}"

    @staticmethod
    def parse_grid(text: str) -> tuple[int, int]:
        """``"2x3"`` -> (2, 3); ``"4"`` -> (4, 1)."""
        m = re.fullmatch(r"\s*(\d+)\s*(?:[xX*,]\s*(\d+))?\s*", text)
        if not m:
            raise ConfigError(
                "--spatial", f"cannot read the grid {text!r}", "write it as GYxGX, e.g. 2x2"
            )
        return int(m.group(1)), int(m.group(2) or 1)
