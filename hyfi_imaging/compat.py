"""torchvision's model definitions beside a CPU build of torch.

Why: the only torchvision wheel PyPI has for torch 2.13 (0.28.0, ``+cu130``) is
a CUDA build, and pip installs it beside the CPU torch (PyTorch's CPU wheels
are on its own index, not on PyPI). Its compiled extension
``torchvision/_C.so`` (nms, roi_align, deform_conv2d) needs ``libc10_cuda.so``
and ``libtorch_cuda.so``, which a CPU torch does not ship, so ``dlopen`` fails
("libc10_cuda.so: cannot open shared object file"). ``torchvision.extension``
catches that and records ``_has_ops() == False``; then
``torchvision/_meta_registrations.py`` -- which guards every meta kernel it
registers by ``_has_ops()`` except two, ``@torch.library.register_fake(
"torchvision::nms")`` and ``"torchvision::qnms"`` -- asks the dispatcher for an
operator that was never defined, and ``import torchvision`` (and so ``import
timm``) dies: ``RuntimeError: operator torchvision::nms does not exist``.
The model definitions (``torchvision.models``), all this project uses, are
pure Python and need none of it.

:func:`allow_torchvision_without_ops` puts a finder first on ``sys.meta_path``
that answers for ``torchvision._meta_registrations`` only, and only when
torchvision's own loader has just failed (``torchvision.extension._has_ops()``
is False; the package imports ``extension`` first): it stands in an empty
module, i.e. skips registering meta kernels for operators that do not exist.
Nothing else changes: the box and detection operators stay unavailable and
say so when called (torchvision's own "Couldn't load custom C++ ops"), and
with a torchvision whose extension loads the finder does nothing. ``import
hyfi_imaging`` installs it -- import it before torchvision or timm -- and it
imports nothing itself, so ``import hyfi_imaging`` stays light.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

__all__ = ["allow_torchvision_without_ops"]

_META = "torchvision._meta_registrations"


class _SkipMetaKernels(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an empty ``torchvision._meta_registrations`` where torchvision's ops did not load."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _META:
            return None
        extension = sys.modules.get("torchvision.extension")
        has_ops = getattr(extension, "_has_ops", None)
        if has_ops is None or has_ops():
            return None  # ops loaded (or an unknown torchvision): its own module, as always
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # the default: an empty module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = "Skipped by hyfi_imaging.compat: torchvision's compiled ops did not load."


def allow_torchvision_without_ops() -> bool:
    """Let ``import torchvision`` succeed where its compiled ops cannot load (see the module
    docstring); True if the finder was installed now, False if it already was."""
    if any(isinstance(f, _SkipMetaKernels) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _SkipMetaKernels())
    return True
