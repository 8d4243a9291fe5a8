"""hyfi-imaging: train CNNs on whole 8K-16K images with exact hybrid parallelism.

The public entry points most users need are re-exported here; everything else
lives in the sub-packages named in ``docs/architecture.md``.
"""

from __future__ import annotations

__version__ = "0.1.0"

from hyfi_imaging.errors import HyfiError, SlideError
from hyfi_imaging.io import open_slide

__all__ = ["HyfiError", "SlideError", "__version__", "open_slide"]
