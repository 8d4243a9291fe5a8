"""Geometry at the bottom of the package: which indices a tile owns, and its halo.

Pure integer arithmetic (and numpy slicing of the boxes it computes); nothing
here imports ``torch.distributed`` or any other part of the package except
:mod:`hyfi_imaging.errors`, so the stores, the loader, the planner and the
engine all take the same numbers from the same functions.

* :mod:`.spans`: spans and partitions of one axis, the padding rule
  (:func:`~.spans.padded_hw`);
* :mod:`.grid`: one image on one grid (:class:`~.grid.TileGrid`: padded size, tiles,
  origins, valid extents, owners), which the engine, the junction, the planner and the
  loader all read;
* :mod:`.tiles`: N-d boxes, a rank's tile plus halo of an image or a volume,
  reading and stitching them.

The layer geometry (windows, halos per layer, deep halos, resampling) is
:mod:`hyfi_imaging.parallel.geometry`, built on :mod:`.spans`.
"""
