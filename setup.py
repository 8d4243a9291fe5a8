"""Build hook: the start-up hook that lets torchvision import in any order (see compat.py).

Everything about the package is in ``pyproject.toml``; this file only adds two
files at the top of site-packages to every wheel setuptools builds
(``pip install .``, ``pip wheel``): ``_hyfi_imaging_compat.py``, a copy of
``hyfi_imaging/compat.py`` importable without importing ``hyfi_imaging``
(whose ``__init__`` imports numpy), and ``_hyfi_imaging_compat.pth``, whose
``import _hyfi_imaging_compat`` Python's ``site`` module runs at every start
of the environment's interpreter. pip records both, so ``pip uninstall``
removes them with the package.

Why ``install_data``: pyproject's ``data-files`` go under the environment's
prefix, not site-packages, where ``.pth`` files are read; ``install_data``
writes into ``install_lib`` instead (site-packages, the wheel's root).
The editable wheel of ``pip install -e .`` (setuptools 84) runs no install
step that reaches site-packages, so ``scripts/setup.sh`` writes the hook there
with the same function.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from setuptools import setup
from setuptools.dist import Distribution

# setuptools has no install_data of its own; the one it runs (distutils', setuptools' copy).
install_data: Any = Distribution().get_command_class("install_data")

COMPAT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hyfi_imaging", "compat.py")


class InstallStartupHook(install_data):
    """``install_data``, plus the start-up hook in ``install_lib``."""

    def run(self) -> None:
        super().run()
        # compat.py alone: importing hyfi_imaging.compat would run hyfi_imaging/__init__.
        spec = importlib.util.spec_from_file_location("_hyfi_imaging_compat_build", COMPAT)
        assert spec is not None and spec.loader is not None
        compat = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(compat)
        lib = self.get_finalized_command("install").install_lib
        if not self.dry_run:
            self.outfiles += list(compat.write_startup_hook(lib, compile_module=False))


setup(
    # install_data runs only when there are data files; this entry names none, it only
    # makes setuptools run InstallStartupHook.
    data_files=[("", [])],
    cmdclass={"install_data": InstallStartupHook},
)
