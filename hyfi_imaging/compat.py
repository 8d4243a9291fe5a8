"""torchvision's model definitions beside a CPU build of torch, whatever the import order.

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
with a torchvision whose extension loads the finder does nothing.

Why at interpreter start: a finder installed by ``import hyfi_imaging`` comes
too late for a user who imports torchvision or timm first (to check a version,
to look into a checkpoint). So the installed package also ships this file as
the top-level module ``_hyfi_imaging_compat`` with ``_hyfi_imaging_compat.pth``,
whose one ``import`` line Python's ``site`` runs at start-up
(:func:`write_startup_hook` writes both: ``setup.py`` into every wheel, so
``pip install .`` installs them; ``scripts/setup.sh`` beside the editable
install, whose wheel setuptools builds without them). That is why this module
imports only ``sys`` and ``importlib.machinery`` (not ``importlib.abc``,
``typing`` or ``collections.abc``: about 15 ms at every start of every
interpreter in the environment, for nothing; as it is, 0.13 ms) and why, run
from the ``.pth``, it never raises: a start-up hook that fails would print a
traceback before every command. ``import hyfi_imaging`` still installs the
finder, for environments without the hook (a checkout on ``PYTHONPATH``); the
two copies recognise each other's finder (``_MARK``), so there is only ever one.
"""

from __future__ import annotations

import importlib.machinery
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see above)
if TYPE_CHECKING:
    import types
    from collections.abc import Sequence

__all__ = ["STARTUP_MODULE", "allow_torchvision_without_ops", "write_startup_hook"]

_META = "torchvision._meta_registrations"
#: The top-level name of this file's copy that the start-up hook imports.
STARTUP_MODULE = "_hyfi_imaging_compat"
#: The attribute that marks the finder, whichever copy of this module made it.
_MARK = "hyfi_imaging_skips_torchvision_meta_kernels"


class _SkipMetaKernels:
    """Finds an empty ``torchvision._meta_registrations`` where torchvision's ops did not load.

    A meta-path finder and loader by protocol (``find_spec``, ``create_module``,
    ``exec_module``); not derived from ``importlib.abc`` to keep start-up cheap.
    """

    hyfi_imaging_skips_torchvision_meta_kernels = True  # _MARK

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """A spec for the empty module, or None (the normal import) for every other case."""
        if fullname != _META:
            return None
        extension = sys.modules.get("torchvision.extension")
        has_ops = getattr(extension, "_has_ops", None)
        if has_ops is None or has_ops():
            return None  # ops loaded (or an unknown torchvision): its own module, as always
        return importlib.machinery.ModuleSpec(fullname, self)  # type: ignore[arg-type]

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        """The default: an empty module."""
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run; the docstring says who skipped the real module."""
        module.__doc__ = "Skipped by hyfi_imaging.compat: torchvision's compiled ops did not load."


def allow_torchvision_without_ops() -> bool:
    """Let ``import torchvision`` succeed where its compiled ops cannot load (see the module
    docstring); True if the finder was installed now, False if it already was."""
    if any(getattr(f, _MARK, False) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _SkipMetaKernels())
    return True


def write_startup_hook(
    site_dir: str | None = None, *, compile_module: bool = True
) -> tuple[str, str]:
    """Write the start-up hook into ``site_dir`` (default: this interpreter's site-packages).

    The hook is this file, copied as ``_hyfi_imaging_compat.py``, and
    ``_hyfi_imaging_compat.pth`` holding ``import _hyfi_imaging_compat``.
    ``setup.py`` calls it for every wheel; ``scripts/setup.sh`` for the
    editable install, whose wheel setuptools builds without it. Each file is
    replaced whole (a temporary file renamed), so an interpreter starting
    meanwhile reads the old hook or the new one, never half of one. Returns
    the two paths. ``compile_module`` writes its bytecode too, since an
    environment with ``PYTHONDONTWRITEBYTECODE`` would compile it at every start
    (a wheel leaves that to pip, which compiles what it installs).
    """
    import os
    import py_compile
    import sysconfig
    import tempfile

    folder = site_dir if site_dir is not None else sysconfig.get_paths()["purelib"]
    os.makedirs(folder, exist_ok=True)
    with open(__file__, "rb") as f:
        source = f.read()
    written = []
    for name, content in (
        (f"{STARTUP_MODULE}.py", source),
        (f"{STARTUP_MODULE}.pth", f"import {STARTUP_MODULE}\n".encode()),
    ):
        path = os.path.join(folder, name)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the hook from other users
        os.replace(tmp, path)
        written.append(path)
    if compile_module:
        py_compile.compile(written[0], doraise=True)
    return written[0], written[1]


if __name__ == STARTUP_MODULE:  # run by the start-up hook: never raise
    try:  # noqa: SIM105 -- contextlib.suppress would cost an import at every start
        allow_torchvision_without_ops()
    except Exception:
        pass
