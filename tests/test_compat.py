"""torchvision (and timm, which imports it) beside a CPU torch: ``hyfi_imaging/compat.py``.

Each check runs in a fresh interpreter: what an import does depends on what
was imported before. Skipped without the ``zoo`` extra; the reason the shim
exists is checked only where torchvision's compiled ops do not load (pip's
CUDA build next to the CPU torch 2.13, as ``scripts/setup.sh`` installs).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is None, reason="the zoo extra is not installed"
)

OPS_LOAD = """
import ctypes, pathlib, torch, importlib.util
spec = importlib.util.find_spec("torchvision")
so = next(pathlib.Path(spec.submodule_search_locations[0]).glob("_C*.so"))
try:
    ctypes.CDLL(str(so))
    print("loads")
except OSError as err:
    print(err)
"""


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def ops_error() -> str | None:
    """Why torchvision's compiled extension does not load here (None: it loads)."""
    out = _python(OPS_LOAD).stdout.strip()
    return None if out == "loads" else out


def test_torchvision_and_timm_import_after_hyfi_imaging(ops_error: str | None) -> None:
    code = (
        "import sys, hyfi_imaging\n"
        "assert 'torch' not in sys.modules  # the shim imports nothing\n"
        "import torch, torchvision, timm\n"
        "m = torchvision.models.resnet18(num_classes=2).eval()\n"
        "assert m(torch.zeros(1, 3, 32, 32)).shape == (1, 2)\n"
        "assert timm.create_model('resnet18', num_classes=2) is not None\n"
        "print(torchvision.extension._has_ops())\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(ops_error is None)


def test_without_it_the_cuda_build_fails_for_the_recorded_reason(ops_error: str | None) -> None:
    if ops_error is None:
        pytest.skip("torchvision's compiled ops load here: nothing to work around")
    assert "libc10_cuda.so" in ops_error or "libtorch_cuda.so" in ops_error, ops_error
    proc = _python("import torch, torchvision")
    assert proc.returncode != 0
    assert "operator torchvision::nms does not exist" in proc.stderr, proc.stderr[-2000:]


def test_the_operators_that_did_not_load_say_so(ops_error: str | None) -> None:
    if ops_error is None:
        pytest.skip("torchvision's compiled ops load here")
    code = (
        "import hyfi_imaging, torch, torchvision\n"
        "torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)\n"
    )
    proc = _python(code)
    assert proc.returncode != 0
    assert "Couldn't load custom C++ ops" in proc.stderr, proc.stderr[-2000:]
