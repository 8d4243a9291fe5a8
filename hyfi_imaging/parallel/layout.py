"""The parallel layout: how many ranks along data, pipeline and spatial axes.

A :class:`Layout` is a frozen, validated value. It is built into a
``DeviceMesh`` with named axes ``("dp", "pp", "sy", "sx")`` — data replicas,
pipeline stages, tile rows, tile columns — or, for a 3-D grid of sub-volumes,
``("dp", "pp", "sz", "sy", "sx")`` (``sp`` is then ``(gz, gy, gx)``), or for a 1-D
grid of signal segments (``(N, C, L)`` cut along ``L``), ``("dp", "pp", "sx")``
(``sp = (gl,)``, written ``L4`` on the command line: a bare ``4`` is the 2-D grid
``4x4``, :mod:`hyfi_imaging.shapes`); every other
module asks the mesh for a group by name instead of doing rank arithmetic. Validation happens before
any process group exists, so a wrong layout costs nothing and the message names
the numbers and the fix.

Per-stage grids (Hy-Fi's "SP + LP", the *junction*): ``grids`` gives every
pipeline stage its own tile grid, e.g. ``((2, 2), (1, 2), (1, 1))``. Such a
world is no rectangle, so ranks are numbered replica by replica, stage by
stage, tile by tile (row-major); :meth:`Layout.coords` and
:meth:`Layout.rank_of` are the only places that turn coordinates into ranks,
for both kinds of layout, and :mod:`.junction` builds its meshes from them.

Branch groups (data sub-graph parallelism, :mod:`.branches`): ``br`` ranks hold the
same tile of the same stage and each runs some of the independent branches of every
cell. Their mesh axis ``"br"`` sits between ``pp`` and the spatial axes (only when
``br > 1``, so every other layout's mesh is unchanged); :meth:`Layout.coords` keeps
returning ``(dp, pp, *tile)`` and :meth:`Layout.branch` gives the branch coordinate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hyfi_imaging.errors import ConfigError
from hyfi_imaging.parallel.launcher_env import launch_with
from hyfi_imaging.shapes import parse_shape, parse_shapes

__all__ = ["MESH_DIMS", "SPATIAL_AXES", "Grid", "Layout", "grid_text"]

#: A tile grid: ``(gy, gx)``, ``(gz, gy, gx)`` for volumes, or ``(gl,)`` for 1-D signals.
Grid = tuple[int, ...]

#: Mesh axis names, outermost first. Spatial axes are innermost so that the
#: ranks of one tile grid are neighbours (same node, fastest links).
MESH_DIMS = ("dp", "pp", "sy", "sx")
#: Names of the spatial mesh axes, outermost first, by the grid's number of axes.
#: A 1-D grid tiles the last (length) axis: its mesh axis is ``sx``, like the columns of a map.
SPATIAL_AXES = {1: ("sx",), 2: ("sy", "sx"), 3: ("sz", "sy", "sx")}


#: Names of the grid factors, by the grid's number of axes (for messages).
_FACTORS = {1: ("gl",), 2: ("gy", "gx"), 3: ("gz", "gy", "gx")}


def grid_text(grid: Grid) -> str:
    """A grid as the command line spells it: ``2x2``, ``2x1x2``, or ``L4`` for a 1-D grid."""
    return f"L{grid[0]}" if len(grid) == 1 else "x".join(map(str, grid))


@dataclass(frozen=True)
class Layout:
    """Ranks along each axis: ``dp`` data replicas, ``pp`` pipeline stages, ``sp`` tile grid
    ``(gy, gx)``, or ``(gz, gy, gx)`` for volumes.

    OK::

        Layout(sp=(2, 2))            # 4 ranks, one image cut into 2x2 tiles
        Layout(dp=2, pp=2, sp=(1, 2))  # 8 ranks
        Layout(sp=(2, 1, 2))         # 4 ranks, one volume cut into 2x1x2 sub-volumes
        Layout(sp=(4,))              # 4 ranks, one (N, C, L) signal cut into 4 segments
        Layout(pp=3, grids=((2, 2), (1, 2), (1, 1)))  # 7 ranks: a grid per stage
        Layout(br=2, sp=(1, 2))      # 4 ranks: two branch ranks per tile

    Error::

        Layout(sp=(0, 2))            # ConfigError: grid factors must be >= 1
        Layout(pp=2, grids=((1, 1), (2, 2)))  # ConfigError: grids may not grow along the pipe

    ``grids`` (one per stage) sets ``sp`` to the first stage's grid; a list of
    equal grids is the same as ``sp`` alone (every stage on one grid).
    """

    dp: int = 1
    pp: int = 1
    sp: Grid = (1, 1)
    grids: tuple[Grid, ...] | None = None
    #: Branch ranks per tile (:mod:`.branches`): each runs some branches of every cell.
    br: int = 1

    def __post_init__(self) -> None:
        if self.grids is not None:
            self._set_grids(tuple(tuple(int(v) for v in g) for g in self.grids))
        if not isinstance(self.br, int) or self.br < 1:
            raise ConfigError(
                "layout", f"br must be a positive integer, got {self.br!r}", "use e.g. --branches 2"
            )
        if self.br > 1 and self.grids is not None:
            raise ConfigError(
                f"--branches {self.br} --spatial {','.join(map(grid_text, self.grids))}",
                "branch groups need one tile grid for every stage (no per-stage grids)",
                "give one grid, e.g. --spatial 1x2, or drop --branches",
            )
        if not isinstance(self.sp, tuple) or len(self.sp) not in SPATIAL_AXES:
            raise ConfigError(
                "layout",
                f"the spatial grid {self.sp!r} must have 1 (L<GL>), 2 (GYxGX) or 3 (GZxGYxGX) "
                "factors",
                "use e.g. --spatial L4, --spatial 2x2 or --spatial 2x1x2",
            )
        names = (
            ("sp length",)
            if len(self.sp) == 1
            else ("sp depth", "sp rows", "sp columns")[-len(self.sp) :]
        )
        for name, value in (("dp", self.dp), ("pp", self.pp), *zip(names, self.sp, strict=True)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(
                    "layout",
                    f"{name} must be a positive integer, got {value!r}",
                    "use e.g. --spatial 2x2 --pipeline 1 --data 1",
                )

    def _set_grids(self, grids: tuple[Grid, ...]) -> None:
        text = ",".join("x".join(map(str, g)) for g in grids)
        if len(grids) != self.pp:
            raise ConfigError(
                f"--pipeline {self.pp} --spatial {text}",
                f"{len(grids)} stage grids for {self.pp} pipeline stages",
                f"give one grid per stage (--pipeline {len(grids)}), or one grid for every stage",
            )
        if len(set(grids)) > 1 and any(len(g) != 2 for g in grids):
            raise ConfigError(
                f"--spatial {text}",
                "per-stage grids are 2-D (GYxGX) only: volumes and signals keep one grid for "
                "every stage",
                "give one grid for every stage, e.g. --spatial 2x1x2 or --spatial L4",
            )
        for s, g in enumerate(grids):
            if min(g) < 1:
                raise ConfigError(
                    f"--spatial {text}",
                    f"stage {s}'s grid {'x'.join(map(str, g))} has a factor below 1",
                    "use grids such as 2x2,1x2,1x1",
                )
        for s in range(1, len(grids)):
            a, b = grids[s - 1], grids[s]
            if any(nb > na for na, nb in zip(a, b, strict=False)):
                raise ConfigError(
                    f"--spatial {text}",
                    f"stage {s}'s grid {'x'.join(map(str, b))} has more tiles along an axis than "
                    f"stage {s - 1}'s {'x'.join(map(str, a))}; grids may only shrink along the "
                    "pipe (the first, activation-heavy stages hold the most tiles)",
                    "order the grids from most tiles to fewest, e.g. 2x2,1x2,1x1",
                )
        object.__setattr__(self, "sp", grids[0])
        # Equal grids everywhere: the plain layout, one rectangular mesh.
        object.__setattr__(self, "grids", grids if len(set(grids)) > 1 else None)

    @property
    def junction(self) -> bool:
        """Whether stages have different grids (activations re-partitioned between them)."""
        return self.grids is not None

    def grid_of(self, stage: int) -> Grid:
        """The tile grid of pipeline stage ``stage``."""
        return self.grids[stage] if self.grids is not None else self.sp

    def stage_size(self, stage: int) -> int:
        """Ranks of one replica of stage ``stage``: its grid's tiles."""
        return math.prod(self.grid_of(stage))

    @property
    def replica_size(self) -> int:
        """Ranks of one data replica: the tiles of every stage, times the branch ranks."""
        return self.br * sum(self.stage_size(s) for s in range(self.pp))

    @property
    def world_size(self) -> int:
        """Ranks the layout needs: dp * br * (sum of the stage grids' tiles) = dp * pp * br * gy * gx
        (* gz)."""
        return self.dp * self.replica_size

    @property
    def sp_size(self) -> int:
        """Tiles per image of the first stage's grid (of every stage's, without per-stage grids)."""
        return math.prod(self.sp)

    @property
    def spatial_axes(self) -> tuple[str, ...]:
        """Names of the spatial mesh axes: ``("sy", "sx")``, ``("sz", "sy", "sx")`` or ``("sx",)``."""
        return SPATIAL_AXES[len(self.sp)]

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """Mesh axis names, outermost first: ``("dp", "pp", *spatial_axes)``, with ``"br"``
        before the spatial axes when ``br > 1``."""
        return ("dp", "pp", *(("br",) if self.br > 1 else ()), *self.spatial_axes)

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in :attr:`mesh_dims` order."""
        return (self.dp, self.pp, *((self.br,) if self.br > 1 else ()), *self.sp)

    def check_world(self, world_size: int) -> None:
        """Raise ConfigError unless the job has exactly the ranks this layout needs."""
        if world_size != self.world_size:
            raise ConfigError(
                "layout",
                f"{self.describe()} needs {self.world_size} ranks but the job has {world_size}",
                f"{launch_with(self.world_size)}, or change the layout so that "
                + (
                    f"dp*(sum of the stage grids) = {world_size}"
                    if self.junction
                    else f"dp*pp*{'br*' if self.br > 1 else ''}"
                    f"{'*'.join(_FACTORS[len(self.sp)])} = {world_size}"
                ),
            )

    def coords(self, rank: int) -> tuple[int, ...]:
        """``(dp, pp, sy, sx)`` (or ``(dp, pp, sz, sy, sx)``) of a global rank: replica, then
        stage, then tile (row-major; the order of the rectangular mesh when every stage has one
        grid). The branch coordinate is :meth:`branch`'s."""
        dp, rest = divmod(rank, self.replica_size)
        for stage in range(self.pp):
            if rest < self.br * self.stage_size(stage):
                rest %= self.stage_size(stage)  # branch-major within the stage
                tile = []
                for n in reversed(self.grid_of(stage)):
                    tile.append(rest % n)
                    rest //= n
                return (dp, stage, *reversed(tile))
            rest -= self.br * self.stage_size(stage)
        raise ValueError(f"rank {rank} is outside {self.describe()}")

    def rank_of(self, dp: int, pp: int, *tile: int, br: int = 0) -> int:
        """The global rank at coordinates ``(dp, pp, *tile)`` of branch ``br``: :meth:`coords`
        (and :meth:`branch`) inverted."""
        index = 0
        for t, n in zip(tile, self.grid_of(pp), strict=True):
            index = index * n + t
        index += br * self.stage_size(pp)
        before = self.br * sum(self.stage_size(s) for s in range(pp))
        return dp * self.replica_size + before + index

    def branch(self, rank: int) -> int:
        """The branch coordinate (``0 .. br-1``) of a global rank; 0 without branch groups."""
        rest = rank % self.replica_size
        for stage in range(self.pp):
            size = self.br * self.stage_size(stage)
            if rest < size:
                return rest // self.stage_size(stage)
            rest -= size
        raise ValueError(f"rank {rank} is outside {self.describe()}")

    def describe(self) -> str:
        if self.grids is not None:
            grids = ",".join("x".join(map(str, g)) for g in self.grids)
            return f"dp={self.dp} x pp={self.pp} x sp=[{grids}]"
        branches = f" x br={self.br}" if self.br > 1 else ""
        return f"dp={self.dp} x pp={self.pp}{branches} x sp={grid_text(self.sp)}"

    @staticmethod
    def parse_grid(text: str) -> tuple[int, ...]:
        """``"2x3"`` -> (2, 3); ``"2"`` -> (2, 2); ``"2x1x2"`` -> (2, 1, 2); ``"L4"`` -> (4,).

        The one spelling of :func:`hyfi_imaging.shapes.parse_shape` (sizes alike).
        """
        return parse_shape(text, "--spatial", kind="grid")

    @staticmethod
    def parse_grids(text: str) -> tuple[Grid, ...]:
        """``"2x2,1x2,1x1"`` -> ((2, 2), (1, 2), (1, 1)); ``"2x2"`` -> ((2, 2),)."""
        return parse_shapes(text, "--spatial")
