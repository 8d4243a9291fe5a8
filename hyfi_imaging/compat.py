"""torchvision's model definitions beside a CPU build of torch.

Why: the torchvision wheel pip finds for torch 2.13 is a CUDA build. Its
compiled extension (``torchvision/_C.so``: nms, roi_align, deform_conv2d)
links against ``libtorch_cuda.so``, which a CPU torch does not ship, so it does
not load; torchvision then dies at import in ``_meta_registrations``, which
registers meta kernels for those very operators ("operator torchvision::nms
does not exist"). The model definitions (``torchvision.models``), which are
all this project uses, are pure Python and need none of it.

:func:`allow_torchvision_without_ops` lets that import succeed: when
torchvision is installed, not yet imported, and its extension cannot load,
it stands in an empty module for ``torchvision._meta_registrations``. Nothing
that works is changed: the detection and box operators stay unavailable (as
they already were), and with a matching torchvision the function does nothing.
``import hyfi_imaging`` calls it, so a user's ``import torchvision`` after it
and ``model.name: torchvision.models:resnet50`` in a recipe both work.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import types
from pathlib import Path

__all__ = ["allow_torchvision_without_ops"]


def allow_torchvision_without_ops() -> bool:
    """Make ``import torchvision`` work where its compiled ops cannot load; True if it did."""
    if "torchvision" in sys.modules:
        return False
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    extension = next(Path(spec.submodule_search_locations[0]).glob("_C*.so"), None)
    if extension is None:
        return False
    try:
        import torch

        ctypes.CDLL(
            str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"), ctypes.RTLD_GLOBAL
        )
        ctypes.CDLL(str(extension))
    except OSError:
        name = "torchvision._meta_registrations"
        sys.modules.setdefault(name, types.ModuleType(name))
        return True
    return False
